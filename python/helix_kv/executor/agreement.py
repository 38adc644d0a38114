"""Compare two runs of the same prompts: tokens, and logits within a tolerance.

In float64 the executor's greedy tokens are identical whatever the CP size or KV pressure. In
float32/bf16 rounding differs with the shard layout and with chunking, so two runs are compared
on their logits: up to and including the first token where they part, the logits must agree
within ``atol``; and they may only part where the reference's top two logits are within
``2 * atol`` of each other (a near tie that rounding can legitimately flip).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from helix_kv.executor.runner import RunResult


@dataclass
class Agreement:
    """How two runs compare."""

    max_logit_diff: float = 0.0
    compared_rows: int = 0
    diverged: list[int] = field(default_factory=list)  # requests whose tokens part
    unexplained: list[str] = field(default_factory=list)  # failures, human readable

    @property
    def ok(self) -> bool:
        """No logit outside tolerance and no divergence without a near tie."""
        return not self.unexplained


def compare_runs(reference: RunResult, other: RunResult, atol: float) -> Agreement:
    """Compare ``other`` to ``reference`` (both run with ``record_logits``)."""
    result = Agreement()
    if sorted(reference.outputs) != sorted(other.outputs):
        result.unexplained.append("different finished requests")
        return result
    for request_id, want in reference.outputs.items():
        got = other.outputs[request_id]
        part = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
        rows = len(want) if part is None else part + 1
        want_logits = reference.logits[request_id][:rows].astype(np.float64)
        diff = float(np.abs(want_logits - other.logits[request_id][:rows]).max())
        result.max_logit_diff = max(result.max_logit_diff, diff)
        result.compared_rows += rows
        if diff > atol:
            result.unexplained.append(f"request {request_id}: logits differ by {diff:.3g} > {atol}")
        if part is not None:
            result.diverged.append(request_id)
            top_two = np.sort(want_logits[part])[-2:]
            gap = float(top_two[1] - top_two[0])
            if gap > 2 * atol:
                result.unexplained.append(
                    f"request {request_id}: tokens part at {part} with a top-2 gap of {gap:.3g}"
                )
    return result
