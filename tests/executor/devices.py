"""Where the executor tests run the Triton decode fast path, with a GPU and without one.

Triton decides between its compiled kernels and its CPU interpreter when a kernel is defined
(``TRITON_INTERPRET``, read at the kernel modules' first import), so one process runs either
the compiled kernels on CUDA tensors or the interpreter on CPU tensors, never both:
``conftest.py`` switches the interpreter on only where there is no GPU. A fast-path test that
must run on both kinds of machine takes :func:`run_fast_path`: one rank on
:data:`FAST_PATH_DEVICE` (CUDA tensors on a GPU machine, the interpreter on the CPU
elsewhere); a CP group on one GPU per rank over NCCL where there are enough GPUs, else in
spawned ranks on the CPU with the interpreter (gloo), the run a machine without a GPU makes.
Nothing is skipped on either kind of machine.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from helix_kv.executor.runner import Job, RunResult, run_group, run_rank

#: The device of a one-rank fast-path run: CUDA where there is one (compiled kernels), else
#: the CPU (Triton's interpreter, which ``conftest.py`` switched on).
FAST_PATH_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@contextmanager
def interpreter_in_spawned_ranks() -> Iterator[None]:
    """``TRITON_INTERPRET=1`` in the environment the ranks spawned meanwhile inherit (a fresh
    process defines its kernels at first use, so they run in the interpreter on CPU tensors).

    This process's kernels stay as they were defined: it must not define any meanwhile
    (it only waits for its ranks), so the kernel modules are imported first."""
    from helix_kv.executor import fused, paged_attention

    paged_attention._kernels()  # defined now, under this process's own setting
    fused._kernels()
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


def run_fast_path(jobs: Sequence[Job], cp: int, timeout_s: float = 600.0) -> list[RunResult]:
    """Rank 0's result of each job (the jobs' ``device`` replaced): one rank on
    :data:`FAST_PATH_DEVICE`; ``cp`` ranks on ``cp`` GPUs over NCCL, or, without that many,
    on the CPU through the interpreter over gloo (``run_group`` checks the ranks agree)."""
    if cp == 1:
        return [run_rank(p, n, c.with_(device=FAST_PATH_DEVICE)) for p, n, c in jobs]
    if FAST_PATH_DEVICE == "cuda" and torch.cuda.device_count() >= cp:
        on_gpus = [(p, n, c.with_(device="cuda")) for p, n, c in jobs]
        return [ranks[0] for ranks in run_group(on_gpus, cp, backend="nccl", timeout_s=timeout_s)]
    on_cpus = [(p, n, c.with_(device="cpu")) for p, n, c in jobs]
    with interpreter_in_spawned_ranks():
        return [ranks[0] for ranks in run_group(on_cpus, cp, backend="gloo", timeout_s=timeout_s)]
