"""Small builders the binding, group and distributed tests share.

Token ids come from the simulator's own formula (:mod:`helix_kv.simulate.tokens`), so the
tests and ``helix-kv simulate`` derive prompts and sampled tokens one way: a prompt is a
function of the request id, and the token a request samples is a function of its id and
output index. A preempted request therefore samples the same tokens again, and an output can
be checked against :func:`~helix_kv.simulate.tokens.expected_output`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import helix_kv
from helix_kv.simulate.tokens import prompt_tokens, sampled_tokens

#: Skips a test (or, as ``pytestmark``, a module) when the extension has no ``Scheduler``.
needs_scheduler = pytest.mark.skipif(
    not hasattr(helix_kv, "Scheduler"), reason="helix_kv.Scheduler is not built yet"
)


def config(
    cp: int = 1, tpb: int = 4, superblocks: int = 16, **overrides: Any
) -> helix_kv.SchedulerConfig:
    """A :class:`helix_kv.SchedulerConfig` of ``superblocks`` superblocks (or ``kv_tokens``
    among ``overrides``)."""
    if "kv_tokens" not in overrides:
        overrides["kv_superblocks"] = superblocks
    return helix_kv.SchedulerConfig(cp_size=cp, tokens_per_block=tpb, **overrides)


def scheduler(
    cp: int = 1, tpb: int = 4, superblocks: int = 16, **overrides: Any
) -> helix_kv.Scheduler:
    """A :class:`helix_kv.Scheduler` of :func:`config`."""
    return helix_kv.Scheduler(config(cp, tpb, superblocks, **overrides))


def prompt(length: int, request_id: int = 0) -> np.ndarray:
    """The prompt of ``request_id`` (int32), as ``helix-kv simulate`` builds it."""
    return prompt_tokens(request_id, length)


def step(s: Any, token: int = 7) -> helix_kv.ScheduleOutput:
    """Schedules one step and closes it, feeding ``token`` for every sample."""
    out = s.schedule()
    s.update(np.full(out.num_samples, token, dtype=np.int32))
    return out


def snapshot(s: helix_kv.Scheduler) -> tuple:
    """What a refused call must leave unchanged."""
    return (s.state_digest(), s.queue_ids().tolist(), s.metrics(), s.step_pending)


def sample(s: helix_kv.Scheduler, out: helix_kv.ScheduleOutput) -> np.ndarray:
    """The tokens the requests of ``out.sample_ids`` sample in the pending step of ``s``:
    each one's next output token by the simulator's formula (output index = tokens it has
    generated so far)."""
    ids = np.asarray(out.sample_ids, dtype=np.uint64)
    generated = [s.request_metrics(int(i)).generated_tokens for i in ids.tolist()]
    return sampled_tokens(ids, np.asarray(generated, dtype=np.uint64))
