"""What the tests expect of a run summary (``summarize`` / ``helix-kv simulate --json``)."""

from __future__ import annotations

#: Keys every summary has, whatever the run (the ``--json`` report's documented core).
SUMMARY_KEYS = frozenset(
    {
        "requests_total",
        "requests_finished",
        "requests_aborted",
        "steps",
        "generated_tokens",
        "preemptions",
        "recomputed_tokens",
        "recomputed_share",
        "kv_utilization_peak",
        "kv_utilization_mean",
        "waiting_steps_p50",
        "waiting_steps_p99",
        "completion_steps_p50",
        "completion_steps_p99",
        "rank_agreement",
        "outputs_exact",
        "config",
    }
)
