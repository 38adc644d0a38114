"""Without a CUDA device, run the Triton kernels of the executor in Triton's CPU interpreter.

Triton reads ``TRITON_INTERPRET`` when it is first imported, so this must run before any test
module imports :mod:`helix_kv.executor.paged_attention`; spawned ranks inherit it.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
