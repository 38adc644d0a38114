"""``helix-kv simulate``: drive a simulated CP group of real schedulers over a workload.

The pieces are small and importable on their own:

- :mod:`.workload` makes a seeded synthetic workload (shared system prompts and conversations
  included) or reads a JSONL trace (with the prompts' ``token_ids`` or ``hash_ids``);
- :mod:`.trace_formats` reads the public production traces (Azure, Mooncake, BurstGPT) as
  they are published, and any trace with a window, a limit and a time scale;
- :mod:`.step_loop` runs the step loop over ``cp_size`` schedulers (one per rank) and checks
  that the ranks agree every step;
- :mod:`.drafts` is the draft model of speculative decoding (``--spec-tokens``): seeded
  per-token acceptance and greedy verification;
- :mod:`.events` is the per-step and per-request event stream (``--events``);
- :mod:`.timing` is the optional step-time model (``--step-time``): modelled milliseconds;
- :mod:`.report` turns a run into figures, a text table and JSON;
- :mod:`.plot` draws a run with matplotlib (optional);
- :mod:`.procs` runs the ranks as real processes over gloo (needs torch);
- :mod:`.plan` is ``helix-kv plan``: the smallest KV budget or CP size that meets SLOs.

Nothing here imports torch or matplotlib at import time.
"""

from helix_kv.simulate.trace_formats import (
    TraceFormat,
    TraceRead,
    TraceSelection,
    parse_trace_lines,
    read_trace_file,
)
from helix_kv.simulate.workload import (
    HashBlocks,
    LengthDistribution,
    PromptContent,
    PromptParts,
    PromptTokens,
    RequestSpec,
    TraceError,
    WorkloadSpec,
    is_timed,
    read_trace,
    synthetic_workload,
    write_trace,
)

__all__ = [
    "HashBlocks",
    "LengthDistribution",
    "PromptContent",
    "PromptParts",
    "PromptTokens",
    "RequestSpec",
    "TraceError",
    "TraceFormat",
    "TraceRead",
    "TraceSelection",
    "WorkloadSpec",
    "is_timed",
    "parse_trace_lines",
    "read_trace",
    "read_trace_file",
    "synthetic_workload",
    "write_trace",
]
