"""Figures of a simulation run, as a flat JSON-ready dict, a text table or a comparison.

:func:`summarize` is the single source of the figures; the table, the comparison and
``--json`` all print from its output, so they can never disagree.
"""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from helix_kv.simulate.step_loop import RequestOutcome, SimulationResult
from helix_kv.simulate.timing import StepTimeModel

Summary = dict[str, Any]


def _percentile(values: Sequence[int], q: float) -> int | None:
    """Nearest-rank percentile (an observed value), ``None`` for no values."""
    if len(values) == 0:
        return None
    return int(np.percentile(np.asarray(values), q, method="inverted_cdf"))


def _percentile_float(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile of real values (an observed value), ``None`` for no values."""
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q, method="inverted_cdf"))


def ttft_ms(outcome: RequestOutcome) -> float | None:
    """Modelled time to first token: from its arrival to the end of the step that sampled its
    first token (``None`` without a model or a first token)."""
    if outcome.first_token_ms is None or outcome.arrival_ms is None:
        return None
    return outcome.first_token_ms - outcome.arrival_ms


def tpot_ms(outcome: RequestOutcome) -> float | None:
    """Modelled time per output token after the first: ``(finish - first token) /
    (generated - 1)``, for a request with at least two tokens (``None`` otherwise)."""
    if outcome.first_token_ms is None or outcome.finish_ms is None:
        return None
    if outcome.generated_tokens < 2:
        return None
    return (outcome.finish_ms - outcome.first_token_ms) / (outcome.generated_tokens - 1)


def tpot_steps(outcome: RequestOutcome) -> float | None:
    """:func:`tpot_ms` in steps: ``(finish_step - first_token_step) / (generated - 1)``."""
    if outcome.first_token_step is None or outcome.generated_tokens < 2:
        return None
    return (outcome.finish_step - outcome.first_token_step) / (outcome.generated_tokens - 1)


def queue_ms(outcome: RequestOutcome) -> float | None:
    """Modelled queueing: from its arrival to the start of the first step that scheduled it
    (``None`` if none did, or without a step-time model)."""
    if outcome.first_scheduled_ms is None or outcome.arrival_ms is None:
        return None
    return outcome.first_scheduled_ms - outcome.arrival_ms


def modelled_figures(result: SimulationResult) -> Summary:
    """The latencies in modelled milliseconds, over the requests that finished (empty without
    a step-time model): queueing, TTFT and TPOT p50/p90/p99 in ms, TPOT in steps too (TTFT in
    steps is ``first_token_steps``), and the modelled length of the run."""
    if result.modelled_time_ms is None:
        return {}
    completed = [o for o in result.outcomes if not o.aborted]
    ttft = [t for t in map(ttft_ms, completed) if t is not None]
    tpot = [t for t in map(tpot_ms, completed) if t is not None]
    tpot_in_steps = [t for t in map(tpot_steps, completed) if t is not None]
    queued = [t for t in map(queue_ms, completed) if t is not None]
    return {
        "modelled_time_ms": result.modelled_time_ms,
        "queue_ms_p50": _percentile_float(queued, 50),
        "queue_ms_p90": _percentile_float(queued, 90),
        "queue_ms_p99": _percentile_float(queued, 99),
        "ttft_ms_p50": _percentile_float(ttft, 50),
        "ttft_ms_p90": _percentile_float(ttft, 90),
        "ttft_ms_p99": _percentile_float(ttft, 99),
        "tpot_ms_p50": _percentile_float(tpot, 50),
        "tpot_ms_p90": _percentile_float(tpot, 90),
        "tpot_ms_p99": _percentile_float(tpot, 99),
        "tpot_steps_p50": _percentile_float(tpot_in_steps, 50),
        "tpot_steps_p90": _percentile_float(tpot_in_steps, 90),
        "tpot_steps_p99": _percentile_float(tpot_in_steps, 99),
    }


def _share(part: float, whole: float) -> float:
    return float(part) / float(whole) if whole else 0.0


@dataclass(frozen=True)
class ServiceLevels:
    """Latency targets a request must meet to count towards goodput, in modelled ms
    (``None``: no target of that kind; at least one is given)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"the {name} target must be a finite number > 0, got {value}")
        if self.ttft_ms is None and self.tpot_ms is None:
            raise ValueError("give a TTFT or a TPOT target (or both)")

    def met_by(self, outcome: RequestOutcome) -> bool:
        """Whether ``outcome`` meets every target: it finished (not aborted) with a first
        token, its TTFT is at most ``ttft_ms`` and its TPOT at most ``tpot_ms`` (a request
        of one token has no TPOT and meets any TPOT target)."""
        ttft = ttft_ms(outcome)
        if outcome.aborted or ttft is None:
            return False
        if self.ttft_ms is not None and ttft > self.ttft_ms:
            return False
        tpot = tpot_ms(outcome)
        return self.tpot_ms is None or tpot is None or tpot <= self.tpot_ms

    def describe(self) -> str:
        """``TTFT <= 2000 ms, TPOT <= 50 ms``: the targets given."""
        targets = [
            f"{name} <= {value:g} ms"
            for name, value in (("TTFT", self.ttft_ms), ("TPOT", self.tpot_ms))
            if value is not None
        ]
        return ", ".join(targets)


def goodput_figures(result: SimulationResult, slo: ServiceLevels | None) -> Summary:
    """Goodput under ``slo`` (empty without targets or a step-time model): the targets, the
    requests that met every one of them (:meth:`ServiceLevels.met_by`), their share of all
    the workload's requests (those that never finished, aborted or cut off by
    ``--max-steps``, miss) and their rate per modelled second (``None`` for a run of no
    modelled time)."""
    if slo is None or result.modelled_time_ms is None:
        return {}
    met = sum(1 for outcome in result.outcomes if slo.met_by(outcome))
    seconds = result.modelled_time_ms / 1000.0
    return {
        "slo_ttft_ms": slo.ttft_ms,
        "slo_tpot_ms": slo.tpot_ms,
        "goodput_requests": met,
        "goodput_share": _share(met, result.requests_total),
        "goodput_rate_per_s": met / seconds if seconds > 0 else None,
    }


def prefix_cache_figures(result: SimulationResult) -> Summary:
    """The prefix cache's figures (empty when the run had prefix caching off): prompt tokens
    looked up and found cached at admissions and their share (the hit rate, in tokens), the
    same for re-prefills after a recompute-pause, the prefill tokens the cache saved (both
    kinds of hits: tokens not computed), the part of those hits an earlier admission or chunk
    of the same step computed (same-step sharing) and the superblocks evicted from it."""
    if not result.config.get("scheduler", {}).get("enable_prefix_caching"):
        return {}
    metrics = result.final_metrics
    queries = int(metrics.prefix_cache_queries)
    hits = int(metrics.prefix_cache_hits)
    recompute_hits = int(metrics.prefix_cache_recompute_hits)
    return {
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": _share(hits, queries),
        "prefix_cache_recompute_queries": int(metrics.prefix_cache_recompute_queries),
        "prefix_cache_recompute_hits": recompute_hits,
        "prefill_tokens_saved": hits + recompute_hits,
        "prefix_cache_same_step_hits": int(metrics.prefix_cache_same_step_hits),
        "prefix_cache_evictions": int(metrics.prefix_cache_evictions),
    }


def speculative_figures(result: SimulationResult) -> Summary:
    """Speculative decoding's figures (empty when the run proposed no drafts): the decodes
    that verified drafts, their draft tokens and the accepted ones, the acceptance rate
    (accepted / draft tokens) and per draft position (times position ``j`` was accepted, and
    that over the drafted decodes: vLLM's per-position acceptance), the mean tokens a decode
    step gives its request (``1 + accepted / decode steps``, every decode entry counted), the
    draft tokens proposed that steps did not schedule (no free pages or token budget: drafts
    give way first), and the KV superblocks drafts took from the free list and gave back at
    the update (those only rejected drafts reached)."""
    if result.drafts is None:
        return {}
    metrics = result.final_metrics
    drafted = int(metrics.spec_decode_num_drafts)
    draft_tokens = int(metrics.spec_decode_num_draft_tokens)
    accepted = int(metrics.spec_decode_num_accepted_tokens)
    per_position = list(result.accepted_per_position or [])
    return {
        "decode_steps": result.decode_entries,
        "spec_decode_drafts": drafted,
        "spec_decode_draft_tokens": draft_tokens,
        "spec_decode_accepted_tokens": accepted,
        "spec_decode_acceptance_rate": _share(accepted, draft_tokens),
        "spec_decode_accepted_per_position": per_position,
        "spec_decode_acceptance_per_position": [_share(c, drafted) for c in per_position],
        "tokens_per_decode_step": 1.0 + _share(accepted, result.decode_entries),
        "spec_decode_trimmed_tokens": int(metrics.spec_decode_num_trimmed_tokens),
        "spec_decode_draft_superblocks": int(metrics.spec_decode_draft_superblocks),
        "spec_decode_returned_superblocks": int(metrics.spec_decode_returned_superblocks),
    }


def summarize(result: SimulationResult, slo: ServiceLevels | None = None) -> Summary:
    """The figures of a run as one flat dict (what ``--json`` prints); with ``slo``, its
    goodput too (:func:`goodput_figures`).

    Times are in scheduler steps of the simulated clock: ``waiting_steps`` counts the
    steps a request was live but got no work (re-waits after preemption included),
    ``first_token_steps`` and ``completion_steps`` run from arrival to the first sampled
    token and to the last, both ends counted. These latencies describe the requests that
    finished; aborted requests are counted apart (``requests_aborted``).
    """
    metrics = result.final_metrics
    outcomes = result.outcomes
    completed = [o for o in outcomes if not o.aborted]
    waiting = [o.steps_waited for o in completed]
    first_token = [o.first_token_steps for o in completed if o.first_token_steps is not None]
    completion = [o.completion_steps for o in completed]
    utilization = result.series.kv_utilization
    computed = int(metrics.computed_tokens)
    recomputed = int(metrics.recomputed_tokens)
    scheduler = result.config.get("scheduler", {})
    tokens_per_superblock = int(scheduler.get("tokens_per_block", 0)) * int(
        result.config.get("cp", 0)
    )
    moved = int(metrics.suspended_superblocks) + int(metrics.resumed_superblocks)
    summary: Summary = {
        "requests_total": result.requests_total,
        "requests_finished": result.requests_finished,
        "requests_aborted": result.requests_aborted,
        "steps": len(result.series),
        "clock_steps": result.clock,
        "generated_tokens": result.generated_tokens,
        "computed_tokens": computed,
        **prefix_cache_figures(result),
        **speculative_figures(result),
        "preemptions": int(metrics.preemptions),
        "suspensions": int(metrics.suspensions),
        "resumes": int(metrics.resumes),
        # The simulator has no model size: copies are counted in host pages per rank (one
        # superblock = one page on every rank) and in the global tokens those pages hold.
        "host_pages_out_per_rank": int(metrics.suspended_superblocks),
        "host_pages_in_per_rank": int(metrics.resumed_superblocks),
        "host_tokens_moved": moved * tokens_per_superblock,
        "suspended_tokens": int(metrics.suspended_tokens),
        "preempted_requests": sum(1 for o in outcomes if o.victim_choices > 0),
        "max_victim_choices_of_a_request": max((o.victim_choices for o in outcomes), default=0),
        "recomputed_tokens": recomputed,
        "recomputed_share": _share(recomputed, computed),
        "sat_out": int(metrics.sat_out),
        "kv_capacity_superblocks": int(metrics.kv_capacity_superblocks),
        "kv_utilization_peak": float(metrics.kv_utilization_peak),
        "kv_utilization_mean": float(np.mean(utilization)) if utilization else 0.0,
        "waiting_steps_p50": _percentile(waiting, 50),
        "waiting_steps_p99": _percentile(waiting, 99),
        "first_token_steps_p50": _percentile(first_token, 50),
        "first_token_steps_p99": _percentile(first_token, 99),
        "completion_steps_p50": _percentile(completion, 50),
        "completion_steps_p99": _percentile(completion, 99),
        **modelled_figures(result),
        **goodput_figures(result, slo),
        "rank_agreement": result.rank_agreement,
        "outputs_exact": result.outputs_exact,
        "config": result.config,
    }
    if result.overlap:  # only then: the report without --overlap is unchanged
        summary["outputs_match_plain"] = result.outputs_match_plain
    if result.mismatch is not None:
        summary["mismatch"] = result.mismatch
    if result.interrupted:
        summary["interrupted"] = True
    if result.failed_step is not None:  # a scheduler error ended it: the figures so far
        summary["failed"] = {"type": result.failure, "step": result.failed_step}
    return summary


def add_recompute_only(summary: Summary, baseline: Summary) -> None:
    """Adds what the same workload did without the host tier (every victim recompute-paused):
    its recomputed tokens and steps, and the recomputed tokens the host tier avoided."""
    summary["recompute_only_recomputed_tokens"] = baseline["recomputed_tokens"]
    summary["recompute_only_steps"] = baseline["steps"]
    summary["recomputed_tokens_avoided"] = (
        baseline["recomputed_tokens"] - summary["recomputed_tokens"]
    )


def to_json(summary: Mapping[str, Any]) -> str:
    """One JSON object, keys in a stable order."""
    return json.dumps(summary, indent=2)


def _pair(first: Any, second: Any, unit: str = "") -> str:
    def show(value: Any) -> str:
        return "-" if value is None else str(value)

    return f"{show(first)} / {show(second)}{unit}"


def _percent(value: float) -> str:
    return f"{100.0 * value:.1f}%"


def _rank_list(ranks: Sequence[int]) -> str:
    """``0 and 63``, ``0, 5 and 63``."""
    names = [str(rank) for rank in ranks]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _agreement(summary: Summary) -> str:
    config = summary["config"]
    ranks = config.get("cp", "?")
    kind = "rank process" if config.get("procs") else "rank"
    if ranks == 1:
        return f"n/a (1 {kind}: nothing to compare)"
    # the ranks that ran a scheduler and were compared (all of them unless --verify-ranks)
    verified = config.get("verified_ranks")
    if not summary["rank_agreement"]:
        return f"NO (stopped at step {summary['steps']})"
    if verified is not None and len(verified) == 1:
        return f"not checked (rank {verified[0]} of {ranks} run alone: --verify-ranks none)"
    if verified is not None and len(verified) != ranks:
        return f"yes (ranks {_rank_list(verified)} of {ranks}, every step)"
    kinds = "rank processes" if config.get("procs") else "ranks"
    return f"yes ({ranks} {kinds}, every step)"


#: Table rows: label and how to show the value from a summary.
ROWS: list[tuple[str, Callable[[Summary], str]]] = [
    ("requests finished / total", lambda s: _pair(s["requests_finished"], s["requests_total"])),
    ("requests aborted", lambda s: str(s["requests_aborted"])),
    ("steps", lambda s: str(s["steps"])),
    ("generated tokens", lambda s: str(s["generated_tokens"])),
    ("computed tokens", lambda s: str(s["computed_tokens"])),
    # JSON "preemptions": recompute-pauses; "preempted_requests": requests chosen as victims
    # either way (recompute-paused or suspended), hence the rows' names
    ("recompute-pauses", lambda s: str(s["preemptions"])),
    ("suspensions", lambda s: str(s["suspensions"])),
    (
        "paused/suspended requests",
        lambda s: f"{s['preempted_requests']} (at most {s['max_victim_choices_of_a_request']}x)",
    ),
    (
        "recomputed tokens",
        lambda s: f"{s['recomputed_tokens']} ({_percent(s['recomputed_share'])} of computed)",
    ),
    ("sat-out decode slots", lambda s: str(s["sat_out"])),
    (
        "KV utilisation peak / mean",
        lambda s: _pair(_percent(s["kv_utilization_peak"]), _percent(s["kv_utilization_mean"])),
    ),
    (
        "waiting p50 / p99",
        lambda s: _pair(s["waiting_steps_p50"], s["waiting_steps_p99"], " steps"),
    ),
    (
        "first token p50 / p99",
        lambda s: _pair(s["first_token_steps_p50"], s["first_token_steps_p99"], " steps"),
    ),
    (
        "completion p50 / p99",
        lambda s: _pair(s["completion_steps_p50"], s["completion_steps_p99"], " steps"),
    ),
    ("rank agreement", _agreement),
    ("outputs exact", lambda s: _exact(s)),
]


def _exact(summary: Summary) -> str:
    if summary["outputs_exact"]:
        return "yes"
    if summary.get("outputs_match_plain") is False:
        return "NO (the outputs differ from the run without --overlap)"
    return "NO"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _steps(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


#: Rows added when a step-time model is on (after "completion p50 / p99"): modelled figures.
MODELLED_ROWS: list[tuple[str, Callable[[Summary], str]]] = [
    ("modelled run time", lambda s: f"{s['modelled_time_ms'] / 1000.0:.2f} s"),
    (
        "queue p50 / p90 / p99 (modelled)",
        lambda s: (
            f"{_ms(s['queue_ms_p50'])} / {_ms(s['queue_ms_p90'])} / {_ms(s['queue_ms_p99'])} ms"
        ),
    ),
    (
        "TTFT p50 / p90 / p99 (modelled)",
        lambda s: f"{_ms(s['ttft_ms_p50'])} / {_ms(s['ttft_ms_p90'])} / {_ms(s['ttft_ms_p99'])} ms",
    ),
    (
        "TPOT p50 / p90 / p99 (modelled)",
        lambda s: (
            f"{_ms(s['tpot_ms_p50'])} / {_ms(s['tpot_ms_p90'])} / {_ms(s['tpot_ms_p99'])} ms "
            f"({_steps(s['tpot_steps_p50'])} / {_steps(s['tpot_steps_p90'])} / "
            f"{_steps(s['tpot_steps_p99'])} steps)"
        ),
    ),
]


def _goodput(summary: Summary) -> str:
    rate = summary["goodput_rate_per_s"]
    shown = "-" if rate is None else f"{rate:.2f}"
    return (
        f"{_percent(summary['goodput_share'])} of requests ({summary['goodput_requests']} / "
        f"{summary['requests_total']}), {shown} req/s"
    )


#: Rows added after the modelled rows when SLOs were given (``--slo-ttft-ms``, ...).
GOODPUT_ROWS: list[tuple[str, Callable[[Summary], str]]] = [
    (
        "SLO targets",
        lambda s: ServiceLevels(s["slo_ttft_ms"], s["slo_tpot_ms"]).describe(),
    ),
    ("goodput (modelled)", _goodput),
]


#: Rows added after "computed tokens" when the run had prefix caching on.
PREFIX_CACHE_ROWS: list[tuple[str, Callable[[Summary], str]]] = [
    (
        "prefix cache hit rate",
        lambda s: (
            f"{_percent(s['prefix_cache_hit_rate'])} ({s['prefix_cache_hits']} / "
            f"{s['prefix_cache_queries']} tokens)"
        ),
    ),
    (
        "prefill tokens saved",
        lambda s: f"{s['prefill_tokens_saved']} ({s['prefix_cache_recompute_hits']} on re-prefill)",
    ),
    (
        "shared in their step",
        lambda s: f"{s['prefix_cache_same_step_hits']} tokens",
    ),
    (
        "re-prefill cache hits",
        lambda s: (
            f"{s['prefix_cache_recompute_hits']} / {s['prefix_cache_recompute_queries']} tokens"
        ),
    ),
    ("prefix cache evictions", lambda s: f"{s['prefix_cache_evictions']} superblocks"),
]


def _positions(rates: Sequence[float], shown: int = 8) -> str:
    """Per-position rates, the first ``shown`` of them."""
    text = " ".join(_percent(rate) for rate in rates[:shown])
    return text + (f" ... ({len(rates)} positions)" if len(rates) > shown else "")


#: Rows added after "computed tokens" (and the prefix cache's) when the run had drafts.
SPECULATIVE_ROWS: list[tuple[str, Callable[[Summary], str]]] = [
    (
        "decodes with drafts",
        lambda s: (
            f"{s['spec_decode_drafts']} of {s['decode_steps']} "
            f"({s['spec_decode_draft_tokens']} draft tokens)"
        ),
    ),
    (
        "draft tokens accepted",
        lambda s: (
            f"{s['spec_decode_accepted_tokens']} / {s['spec_decode_draft_tokens']} "
            f"({_percent(s['spec_decode_acceptance_rate'])})"
        ),
    ),
    (
        "accepted per position",
        lambda s: _positions(s["spec_decode_acceptance_per_position"]),
    ),
    ("tokens per decode step", lambda s: f"{s['tokens_per_decode_step']:.2f}"),
    ("drafts trimmed", lambda s: f"{s['spec_decode_trimmed_tokens']} tokens"),
    (
        "draft KV taken / returned",
        lambda s: _pair(
            s["spec_decode_draft_superblocks"],
            s["spec_decode_returned_superblocks"],
            " superblocks",
        ),
    ),
]


#: Rows added after "recomputed tokens" when the run had a host tier (and so a baseline run
#: without it).
HOST_TIER_ROWS: list[tuple[str, Callable[[Summary], str]]] = [
    (
        "recomputed w/o host tier",
        lambda s: (
            f"{s['recompute_only_recomputed_tokens']} in {s['recompute_only_steps']} steps "
            f"({s['recomputed_tokens_avoided']} avoided)"
        ),
    ),
    ("suspends / resumes", lambda s: _pair(s["suspensions"], s["resumes"])),
    (
        "host pages out / in",
        lambda s: _pair(s["host_pages_out_per_rank"], s["host_pages_in_per_rank"], " per rank"),
    ),
    ("host tokens moved", lambda s: str(s["host_tokens_moved"])),
]


def table_rows(summary: Summary) -> list[tuple[str, Callable[[Summary], str]]]:
    """The table's rows for ``summary``: :data:`ROWS`, with :data:`PREFIX_CACHE_ROWS` after
    the computed tokens when prefix caching was on, :data:`HOST_TIER_ROWS` after the
    recomputed tokens when a baseline without the host tier ran, :data:`SPECULATIVE_ROWS`
    before the recompute-pauses when the run had drafts, and :data:`MODELLED_ROWS`
    after the latencies in steps when a step-time model was on (then :data:`GOODPUT_ROWS`
    with SLOs)."""
    rows = list(ROWS)
    if "prefix_cache_hit_rate" in summary:
        at = next(i for i, (label, _) in enumerate(rows) if label == "computed tokens") + 1
        rows[at:at] = PREFIX_CACHE_ROWS
    if "spec_decode_acceptance_rate" in summary:
        at = next(i for i, (label, _) in enumerate(rows) if label == "recompute-pauses")
        rows[at:at] = SPECULATIVE_ROWS
    if "recomputed_tokens_avoided" in summary:
        at = next(i for i, (label, _) in enumerate(rows) if label == "recomputed tokens") + 1
        rows[at:at] = HOST_TIER_ROWS
    if "modelled_time_ms" in summary:
        at = next(i for i, (label, _) in enumerate(rows) if label.startswith("completion")) + 1
        rows[at:at] = MODELLED_ROWS + (GOODPUT_ROWS if "goodput_share" in summary else [])
    return rows


#: The line under a report with host-tier copies: what the page counts mean in bytes.
BYTES_NOTE = (
    "  host copies are counted in pages: the simulator has no model size; bytes = pages x "
    "tokens_per_block x KV bytes per token (per rank)"
)


def model_note(summary: Summary) -> str | None:
    """The line saying the ms figures are modelled, and by what (``None`` without a model)."""
    model = summary["config"].get("step_time_model")
    if model is None:
        return None
    step = StepTimeModel(
        model["fixed_ms"], model["per_token_ms"], model["per_kv_token_ms"]
    ).describe()
    return (
        f"  ms figures are modelled, not measured: step = {step} ({model['source']} model"
        f"{', illustrative' if model['source'] == 'default' else ''})"
    )


def _kv_tokens(config: Mapping[str, Any]) -> str:
    """The pool's capacity in tokens; the asked-for budget too when rounding cut it."""
    usable = config.get("kv_tokens_effective")
    asked = config.get("kv_tokens", "?")
    if usable is None or usable == asked:
        return str(asked)
    return f"{usable} ({asked} asked)"


def describe_config(config: Mapping[str, Any], *, include_policy: bool = True) -> str:
    """One line naming the settings that matter most for KV pressure."""
    scheduler = config.get("scheduler", {})
    parts = [
        f"cp={config.get('cp', '?')}",
        f"tokens_per_block={scheduler.get('tokens_per_block', '?')}",
        f"kv_tokens={_kv_tokens(config)}",
        f"mode={scheduler.get('serving_mode', '?')}",
        f"capacity={scheduler.get('capacity_policy', '?')}",
    ]
    if include_policy:
        parts.append(f"policy={scheduler.get('victim_policy', '?')}")
    if scheduler.get("admission_policy", "fcfs") != "fcfs":
        parts.append(f"admission={scheduler['admission_policy']}")
    threshold = int(scheduler.get("long_prefill_token_threshold", 0))
    if threshold:
        adaptive = " (adaptive)" if scheduler.get("long_prefill_token_threshold_adaptive") else ""
        parts.append(f"long_prefill_token_threshold={threshold}{adaptive}")
    host_tier = int(scheduler.get("host_tier_superblocks", 0))
    if host_tier:
        parts.append(f"host_tier_superblocks={host_tier}")
        if include_policy:
            parts.append(f"suspend_policy={scheduler.get('suspend_policy', '?')}")
    if scheduler.get("enable_prefix_caching"):
        parts.append("prefix_caching")
    if config.get("overlap"):
        parts.append("overlap")
    drafts = config.get("drafts")
    if drafts is not None:
        spec_tokens = scheduler.get("num_speculative_tokens", "?")
        parts.append(f"spec_tokens={spec_tokens} acceptance={drafts.get('acceptance', '?'):g}")
    source = config.get("workload", {})
    if source.get("source") == "trace":
        parts.append(f"trace={source.get('path')}")
        if source.get("arrivals") == "ms":
            parts.append("arrivals in ms")
    else:
        described = f"requests={source.get('requests', '?')} seed={source.get('seed', '?')}"
        if source.get("shared_prefix_len"):
            share = source.get("shared_prefix_share", 1.0)
            described += f" shared_prefix={source['shared_prefix_len']} share={share:g}"
        if source.get("turns", 1) > 1:
            described += f" turns={source['turns']}"
        if source.get("request_rate") is not None:
            described += f" request_rate={source['request_rate']:g}/s"
        parts.append(described)
    return ", ".join(parts)


def format_table(summary: Summary) -> str:
    """The end-of-run table."""
    rows = table_rows(summary)
    width = max(len(label) for label, _ in rows)
    lines = [f"helix-kv simulate: {describe_config(summary['config'])}"]
    lines += [f"  {label:<{width}}  {show(summary)}" for label, show in rows]
    note = model_note(summary)
    if note is not None:
        lines.append(note)
    if summary.get("host_tokens_moved"):
        lines.append(BYTES_NOTE)
    if "mismatch" in summary:
        lines.append(f"  mismatch: {summary['mismatch']}")
    if summary.get("interrupted"):
        lines.append(f"  interrupted after {summary['steps']} steps: the figures cover those only")
    if "failed" in summary:
        lines.append(f"  {_failure(summary)}: the figures cover the {summary['steps']} steps run")
    return "\n".join(lines)


def _failure(summary: Summary) -> str:
    """``failed in step 57 (DeadlockError)``: where a scheduler error ended the run."""
    failed = summary["failed"]
    return f"failed in step {failed['step']} ({failed['type']})"


def _cell(show: Callable[[Summary], str], summary: Summary) -> str:
    """A row's value, ``-`` where the run has no such figure (the baseline's host-tier row)."""
    try:
        return show(summary)
    except KeyError:
        return "-"


#: The widest line of a comparison (a terminal's width): the columns that do not fit beside
#: the labels go on in further blocks, each with the labels again.
REPORT_WIDTH = 100


def _column_blocks(widths: Mapping[str, int], room: int) -> list[list[str]]:
    """The columns (name -> width), in order, in blocks of at most ``room`` characters (two
    spaces before each column); a column wider than that gets a block of its own."""
    blocks: list[list[str]] = [[]]
    used = 0
    for name, width in widths.items():
        if blocks[-1] and used + 2 + width > room:
            blocks.append([])
            used = 0
        blocks[-1].append(name)
        used += 2 + width
    return blocks


def _wrapped(line: str, width: int) -> list[str]:
    """``line`` wrapped at ``width``, its continuation lines indented by four spaces."""
    return textwrap.wrap(line, width, subsequent_indent="    ", break_on_hyphens=False)


def format_comparison(
    summaries: Mapping[str, Summary],
    same_as: Mapping[str, str] | None = None,
    width: int = REPORT_WIDTH,
) -> str:
    """The same rows for several runs (one per policy), side by side, in blocks of columns that
    fit ``width`` characters. ``same_as`` names the columns left out because they are the same
    configuration as another (``{"suspend_first": "newest_first"}``); a note says so."""
    names = list(summaries)
    first = next(iter(summaries.values()))
    # every policy ran with the same step-time model, or none; the baseline column (if any)
    # has no host-tier rows, so they come from a column that has them
    rows = table_rows(max(summaries.values(), key=lambda s: len(table_rows(s))))
    cells = {name: [_cell(show, summaries[name]) for _, show in rows] for name in names}
    label_width = max(len("policy"), *(len(label) for label, _ in rows))
    widths = {name: max(len(name), *(len(cell) for cell in cells[name])) for name in names}
    setting = describe_config(first["config"], include_policy=False)
    lines = _wrapped(f"helix-kv simulate --compare-policies: {setting}", width)
    for index, block in enumerate(_column_blocks(widths, width - 2 - label_width)):
        if index:
            lines.append("")  # between blocks
        header = "  ".join(f"{name:>{widths[name]}}" for name in block)
        lines.append(f"  {'policy':<{label_width}}  {header}")
        for at, (label, _) in enumerate(rows):
            values = "  ".join(f"{cells[name][at]:>{widths[name]}}" for name in block)
            lines.append(f"  {label:<{label_width}}  {values}")
    notes = [note] if (note := model_note(first)) is not None else []
    if any(summary.get("host_tokens_moved") for summary in summaries.values()):
        notes.append(BYTES_NOTE)
    for alias, name in (same_as or {}).items():
        notes.append(f"  {alias}: the same configuration as {name}, run once (see that column)")
    for name, summary in summaries.items():
        if summary.get("interrupted"):
            notes.append(
                f"  {name} was interrupted after {summary['steps']} steps: its figures cover "
                "those only"
            )
        if "failed" in summary:
            notes.append(
                f"  {name} {_failure(summary)}: its figures cover the {summary['steps']} steps run"
            )
    for note in notes:
        lines += _wrapped(note, width)
    return "\n".join(lines)
