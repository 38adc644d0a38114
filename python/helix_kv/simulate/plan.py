"""``helix-kv plan``: the smallest KV budget (or CP size) that meets SLOs at a workload's load.

The command takes ``helix-kv simulate``'s workload, scheduler and step-time flags (the same
argument builder), the SLO targets (``--slo-ttft-ms``, ``--slo-tpot-ms``), the knob to vary
(``--vary kv-tokens`` or ``--vary cp``) and its candidate values (``--values``, or a default
ladder, :func:`default_values`). Each candidate is one ordinary simulate run in library form,
in a pool of processes (``--jobs``); it *passes* when the share of the workload's requests that
meet every target (:func:`helix_kv.simulate.report.goodput_figures`) is at least
``--slo-share``. The command prints one row per candidate, and picks the smallest value that
passes. A candidate whose run cannot start or fails (a pool too small for one request, a
deadlock) is an ``error`` row with its reason, not the command's failure.

The pick is reporting over modelled times, not a scheduling decision: each candidate's run is
the simulator's own, rank-invariant as ever; the candidates are sorted by value and the pick is
the first that passes, whatever order the processes finish in.

Exit status: 0 a candidate passed (the pick is printed); 1 none passed; 2 the arguments, the
trace or the environment do not allow the plan (one line on stderr); 130 Ctrl-C stopped it.
With ``--json`` stdout carries one JSON object: the plan, or ``{"error": {...}}``.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import signal
import sys
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

from helix_kv._core import Layout
from helix_kv.errors import (
    ConfigError,
    HelixKVError,
    PlotUnavailableError,
    SimulationSetupError,
    TraceError,
    UsageError,
)
from helix_kv.simulate.arguments import (
    DEFAULT_CP,
    DEFAULT_KV_TOKENS,
    OneLineArgumentParser,
    _fraction,
    _integer_flag,
    add_simulate_arguments,
    service_levels,
    simulation_options,
)
from helix_kv.simulate.command import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_RUN_FAILED,
    EXIT_USAGE,
    error_object,
    load_workload,
    run_once,
)
from helix_kv.simulate.options import I64_MAX, MAX_CP, check_config, preflight
from helix_kv.simulate.plot import check_plot_target, plot_format
from helix_kv.simulate.report import (
    ServiceLevels,
    Summary,
    describe_config,
    model_note,
    summarize,
    to_json,
)
from helix_kv.simulate.workload import RequestSpec

PROG = "helix-kv plan"

#: The knobs ``--vary`` takes, each with the simulate flag it sets and that flag's ``args``
#: name and largest value.
KNOBS: dict[str, tuple[str, str, int]] = {
    "kv-tokens": ("--kv-tokens", "kv_tokens", I64_MAX),
    "cp": ("--cp", "cp", MAX_CP),
}
#: ``--slo-share``'s default: 99% of the requests meet the targets ("p99 TTFT under 2 s").
DEFAULT_SLO_SHARE = 0.99
#: Points of the default ``--kv-tokens`` ladder.
LADDER_POINTS = 8
#: Budgets one refining round adds between the largest failing budget below the pick and the
#: pick (``--refine``): the gap shrinks about eightfold a round.
REFINE_POINTS = 7
#: ``--refine``'s default: one round after the default ladder.
DEFAULT_REFINE = 1
#: ``--max-cp``'s default: the default ``--cp`` ladder is 1, 2, 4, 8.
DEFAULT_MAX_CP = 8
#: Most processes ``--jobs`` starts.
MAX_JOBS = 256
#: Flags of ``helix-kv simulate`` that ``helix-kv plan`` does not take, with the reason.
REFUSED_FLAGS = {
    "compare_policies": ("--compare-policies", "each candidate runs under one victim policy"),
    "events": ("--events", "run helix-kv simulate --events on the value you pick"),
    "procs": ("--procs", "the candidates already run in parallel processes (--jobs)"),
    "overlap": ("--overlap", "each candidate is one plain run"),
}

Status = Literal["pass", "fail", "error"]


def _values(text: str) -> list[int]:
    """``--values``: comma-separated integers >= 1 (sorted and deduplicated later)."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if any(value < 1 for value in values):
        raise argparse.ArgumentTypeError(f"every value must be >= 1, got {text!r}")
    return values


def add_plan_arguments(parser: OneLineArgumentParser) -> None:
    """Declare ``helix-kv plan``'s flags: every ``helix-kv simulate`` flag and the planning
    ones. ``--cp`` and ``--kv-tokens`` default to ``None`` here (not given), so that the one
    the plan varies cannot be given as well."""
    add_simulate_arguments(parser)
    knob_of = {dest: knob for knob, (_, dest, _) in KNOBS.items()}
    for action in parser._actions:
        if action.dest in knob_of:
            # simulate's default, in the help, applies unless the flag is the one varied
            shown = (action.help or "").replace("%(default)s", str(action.default))
            action.default = None
            action.help = f"{shown.removesuffix(')')}; not with --vary {knob_of[action.dest]})"
    group = parser.add_argument_group("planning")
    group.add_argument(
        "--vary",
        choices=list(KNOBS),
        required=True,
        help="the knob to size: the KV budget (--kv-tokens) or the CP group (--cp)",
    )
    group.add_argument(
        "--values",
        type=_values,
        metavar="A,B,...",
        help="the candidate values (default for kv-tokens: a geometric ladder of about "
        f"{LADDER_POINTS} budgets from the largest request's tokens to the whole workload's; "
        "for cp: 1, 2, 4, ... up to --max-cp)",
    )
    _integer_flag(
        group,
        "--refine",
        0,
        8,
        help="with --vary kv-tokens and the default ladder: rounds that search between the "
        f"largest failing budget below the pick and the pick, {REFINE_POINTS} budgets a round "
        f"in whole superblocks (default {DEFAULT_REFINE}; 0: the ladder alone)",
    )
    _integer_flag(
        group,
        "--max-cp",
        1,
        MAX_CP,
        help=f"the largest --cp of the default cp ladder (default {DEFAULT_MAX_CP})",
    )
    group.add_argument(
        "--slo-share",
        type=_fraction,
        metavar="F",
        default=DEFAULT_SLO_SHARE,
        help="a candidate passes when at least this share of the requests meets every SLO "
        "(default: %(default)s)",
    )
    _integer_flag(
        group,
        "--jobs",
        1,
        MAX_JOBS,
        help="candidates run at once, each in its own process (default: the CPU count)",
    )


@dataclass(frozen=True)
class Candidate:
    """One candidate's outcome: ``pass`` or ``fail`` against the SLO share, with its figures
    (``report``: the simulate summary), or ``error`` with the reason its run failed."""

    value: int
    status: Status
    report: Summary | None = None
    error_type: str | None = None
    error_message: str | None = None

    def figure(self, key: str) -> Any:
        """A figure of the run's report (``None`` for an error row)."""
        return None if self.report is None else self.report.get(key)

    def to_dict(self) -> dict[str, Any]:
        """The candidate as ``--json`` prints it."""
        record: dict[str, Any] = {"value": self.value, "status": self.status}
        for key in (
            "goodput_share",
            "goodput_requests",
            "goodput_rate_per_s",
            "ttft_ms_p99",
            "tpot_ms_p99",
            "preemptions",
        ):
            record[key] = self.figure(key)
        record["error"] = (
            None
            if self.error_type is None
            else {"type": self.error_type, "message": self.error_message}
        )
        record["report"] = self.report
        return record


@dataclass(frozen=True)
class Plan:
    """A whole plan: the candidates in ascending order, and the smallest that passed."""

    knob: str
    slo: ServiceLevels
    slo_share: float
    candidates: list[Candidate]
    workload: dict[str, Any] = field(default_factory=dict)

    @property
    def pick(self) -> int | None:
        """The smallest value that passes (``None``: none does)."""
        return next((c.value for c in self.candidates if c.status == "pass"), None)

    def to_dict(self) -> dict[str, Any]:
        """The plan as ``--json`` prints it."""
        return {
            "vary": self.knob,
            "slo_ttft_ms": self.slo.ttft_ms,
            "slo_tpot_ms": self.slo.tpot_ms,
            "slo_share": self.slo_share,
            "workload": self.workload,
            "candidates": [candidate.to_dict() for candidate in self.candidates],
            "pick": self.pick,
        }


def _round_up(tokens: int, unit: int) -> int:
    return -(-tokens // unit) * unit


def default_values(
    knob: str, workload: Sequence[RequestSpec], tokens_per_superblock: int, max_cp: int
) -> list[int]:
    """The candidates when ``--values`` is not given. ``kv-tokens``: about
    :data:`LADDER_POINTS` budgets in a geometric ladder from the largest request's tokens
    (prompt and output) to the whole workload's, each rounded up to whole superblocks of
    ``tokens_per_superblock`` tokens; ``cp``: the powers of two up to ``max_cp``."""
    if knob == "cp":
        return [1 << power for power in range(max_cp.bit_length()) if 1 << power <= max_cp]
    needs = [request.prompt_len + request.output_len for request in workload]
    smallest = _round_up(max(needs, default=1), tokens_per_superblock)
    largest = max(smallest, _round_up(sum(needs), tokens_per_superblock))
    if largest == smallest:
        return [smallest]
    ratio = largest / smallest
    ladder = {
        _round_up(math.ceil(smallest * ratio ** (i / (LADDER_POINTS - 1))), tokens_per_superblock)
        for i in range(LADDER_POINTS)
    }
    return sorted(min(value, largest) for value in ladder)


def refined_values(
    candidates: Sequence[Candidate], tokens_per_superblock: int, points: int = REFINE_POINTS
) -> list[int]:
    """Budgets to try next: up to ``points`` whole-superblock budgets evenly spread strictly
    between the largest candidate below the pick that does not pass and the pick (none when
    nothing passes, the smallest candidate passes, or no superblock lies between)."""
    values = [candidate.value for candidate in candidates]
    passed = [i for i, candidate in enumerate(candidates) if candidate.status == "pass"]
    if not passed or passed[0] == 0:
        return []
    low, high = values[passed[0] - 1], values[passed[0]]
    first = low // tokens_per_superblock + 1  # superblock counts strictly between
    last = -(-high // tokens_per_superblock) - 1
    if last < first:
        return []
    if last - first + 1 <= points:
        chosen = set(range(first, last + 1))
    else:  # evenly spread inside the gap
        chosen = {first + (last - first) * (k + 1) // (points + 1) for k in range(points)}
    tried = set(values)
    budgets = (count * tokens_per_superblock for count in chosen)
    return sorted(budget for budget in budgets if budget not in tried)


def evaluate(
    args: argparse.Namespace,
    knob: str,
    value: int,
    workload: Sequence[RequestSpec],
    workload_info: dict[str, Any],
    slo: ServiceLevels,
    slo_share: float,
) -> Candidate:
    """One candidate: ``helix-kv simulate`` with the knob set to ``value``, from the flags to
    the checks before the run and the run itself, every failure an ``error`` row."""
    _, dest, _ = KNOBS[knob]
    candidate_args = argparse.Namespace(**{**vars(args), dest: value})
    try:
        options = simulation_options(candidate_args)
        check_config(options)
        preflight(options, list(workload))
        result = run_once(options, list(workload), workload_info, show_progress=False)
    except (UsageError, SimulationSetupError) as err:
        return Candidate(value, "error", error_type=type(err).__name__, error_message=str(err))
    except HelixKVError as err:
        name = type(err).__name__
        return Candidate(value, "error", error_type=name, error_message=f"{name}: {err}")
    report = summarize(result, slo)
    if not result.rank_agreement:
        message = f"the ranks disagreed: {result.mismatch}"
        return Candidate(value, "error", report, "ScheduleMismatchError", message)
    if not result.outputs_exact:
        message = "an output differs from the one without preemption"
        return Candidate(value, "error", report, "OutputMismatch", message)
    status: Status = "pass" if report["goodput_share"] >= slo_share else "fail"
    return Candidate(value, status, report)


def _ignore_sigint() -> None:
    """In a worker: Ctrl-C is the parent's to handle (it stops the pool)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _progress_line(knob: str, candidate: Candidate, done: int, total: int) -> str:
    flag = KNOBS[knob][0]
    share = candidate.figure("goodput_share")
    detail = f"{candidate.error_message}" if share is None else f"goodput {100.0 * share:.1f}%"
    return f"{PROG}: [{done}/{total}] {flag} {candidate.value}: {candidate.status} ({detail})"


def run_candidates(
    args: argparse.Namespace,
    knob: str,
    values: Sequence[int],
    workload: Sequence[RequestSpec],
    workload_info: dict[str, Any],
    slo: ServiceLevels,
    slo_share: float,
    jobs: int,
    progress: TextIO | None = None,
) -> list[Candidate]:
    """Every candidate of ``values`` (ascending), ``jobs`` at a time in a pool of spawned
    processes (in this process for one job or one value); a line on ``progress`` per
    finished candidate. The result is in the order of ``values``, whatever order they end."""
    total = len(values)
    done: list[Candidate] = []

    def finished(candidate: Candidate) -> None:
        done.append(candidate)
        if progress is not None:
            print(_progress_line(knob, candidate, len(done), total), file=progress, flush=True)

    context = (args, knob)
    if jobs <= 1 or total <= 1:
        for value in values:
            finished(evaluate(*context, value, workload, workload_info, slo, slo_share))
    else:
        pool = ProcessPoolExecutor(
            max_workers=min(jobs, total),
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_ignore_sigint,
        )
        try:
            futures: list[Future[Candidate]] = [
                pool.submit(evaluate, *context, value, workload, workload_info, slo, slo_share)
                for value in values
            ]
            for future in as_completed(futures):
                finished(future.result())
        except BaseException:
            # Ctrl-C (or a broken pool): start no more candidates, stop those running (the
            # workers ignore SIGINT); shutdown forgets the processes, so they are taken first
            running = list((pool._processes or {}).values())
            pool.shutdown(wait=False, cancel_futures=True)
            for process in running:
                process.terminate()
            raise
        pool.shutdown()
    order = {value: index for index, value in enumerate(values)}
    return sorted(done, key=lambda candidate: order[candidate.value])


def _cell(value: Any, shown: str) -> str:
    return "-" if value is None else shown


def format_plan(plan: Plan) -> str:
    """The plan's table: one row per candidate, then the pick."""
    flag = KNOBS[plan.knob][0]
    header = (
        plan.knob,
        "goodput",
        "goodput/s",
        "TTFT p99 ms",
        "TPOT p99 ms",
        "preemptions",
        "result",
    )
    rows = []
    for candidate in plan.candidates:
        share = candidate.figure("goodput_share")
        rate = candidate.figure("goodput_rate_per_s")
        ttft = candidate.figure("ttft_ms_p99")
        tpot = candidate.figure("tpot_ms_p99")
        preemptions = candidate.figure("preemptions")
        result: str = candidate.status
        if candidate.status == "error":
            result = f"error: {candidate.error_message}"
        rows.append(
            (
                str(candidate.value),
                _cell(share, f"{100.0 * (share or 0.0):.1f}%"),
                _cell(rate, f"{rate or 0.0:.2f}"),
                _cell(ttft, f"{ttft or 0.0:.1f}"),
                _cell(tpot, f"{tpot or 0.0:.1f}"),
                _cell(preemptions, str(preemptions)),
                result,
            )
        )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]

    def line(cells: Sequence[str]) -> str:
        numbers = "  ".join(f"{cell:>{width}}" for cell, width in zip(cells, widths))
        return f"  {numbers}  {cells[-1]}"

    target = f"{plan.slo.describe()} for at least {100.0 * plan.slo_share:g}% of the requests"
    count = len(plan.candidates)
    lines = [f"{PROG}: {flag} over {count} value{'s' if count > 1 else ''}; SLO {target}"]
    first = next((c.report for c in plan.candidates if c.report is not None), None)
    if first is not None:
        dest = KNOBS[plan.knob][1]
        setting = {**first["config"], dest: "varied"}
        setting.pop("kv_tokens_effective", None)
        lines.append(f"  setting: {describe_config(setting)}")
    lines.append(line(header))
    lines += [line(row) for row in rows]
    pick = plan.pick
    if pick is not None:
        lines.append(f"  pick: {flag} {pick} (the smallest value that passes)")
    else:
        lines.append(f"  pick: none: no value meets the SLO for {100.0 * plan.slo_share:g}%")
    note = None if first is None else model_note(first)
    if note is not None:
        lines.append(note)
    return "\n".join(lines)


def plot_plan(plan: Plan, path: str | Path) -> None:
    """Draw goodput, p99 TTFT and p99 TPOT against the varied knob into ``path`` (format by
    extension, as ``--plot`` of simulate), the targets as dashed lines, the pick marked;
    error rows have no point."""
    file_format = plot_format(path)  # also selects the Agg backend
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    ran = [c for c in plan.candidates if c.report is not None]
    values = [c.value for c in ran]
    figure, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True, constrained_layout=True)
    target = f"SLO {plan.slo.describe()} for >= {100.0 * plan.slo_share:g}%"
    figure.suptitle(f"{PROG}: {KNOBS[plan.knob][0]} ({target})", fontsize=9)
    goodput = [100.0 * c.figure("goodput_share") for c in ran]
    panels = (
        ("goodput (% of requests)", goodput, 100.0 * plan.slo_share),
        ("p99 TTFT (modelled ms)", [c.figure("ttft_ms_p99") for c in ran], plan.slo.ttft_ms),
        ("p99 TPOT (modelled ms)", [c.figure("tpot_ms_p99") for c in ran], plan.slo.tpot_ms),
    )
    for axis, (label, figures, line) in zip(axes, panels):
        points = [(v, f) for v, f in zip(values, figures) if f is not None]
        axis.plot([v for v, _ in points], [f for _, f in points], marker="o", lw=1)
        if line is not None:
            axis.axhline(line, color="tab:red", ls="--", lw=1, label="target")
            axis.legend(loc="best")
        if plan.pick is not None:
            axis.axvline(plan.pick, color="tab:green", ls=":", lw=1)
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    axes[0].set_ylim(0, 105)
    axes[-1].set_xscale("log", base=2)
    axes[-1].xaxis.set_minor_formatter(NullFormatter())
    axes[-1].set_xticks(values, [str(value) for value in values])
    axes[-1].set_xlabel(f"{KNOBS[plan.knob][0]} (dotted: the pick)")
    figure.savefig(path, format=file_format, dpi=100)
    plt.close(figure)


def _check_flags(args: argparse.Namespace) -> None:
    """Refuse what a plan cannot do; every problem a :class:`UsageError`."""
    for dest, (flag, reason) in REFUSED_FLAGS.items():
        if getattr(args, dest):
            raise UsageError(f"{PROG} does not take {flag}: {reason}", prog=PROG)
    flag, dest, maximum = KNOBS[args.vary]
    if getattr(args, dest) is not None:
        raise UsageError(
            f"--vary {args.vary} tries the {flag} values itself; drop {flag} (--values "
            "chooses them)",
            prog=PROG,
        )
    if args.max_cp is not None and (args.vary != "cp" or args.values is not None):
        raise UsageError(
            "--max-cp bounds the default --vary cp ladder; give it with --vary cp and "
            "without --values",
            prog=PROG,
        )
    if args.refine is not None and (args.vary != "kv-tokens" or args.values is not None):
        raise UsageError(
            "--refine searches between the default --vary kv-tokens ladder's budgets; give it "
            "with --vary kv-tokens and without --values",
            prog=PROG,
        )
    if args.values is not None and max(args.values) > maximum:
        raise UsageError(
            f"--values: {flag} takes at most {maximum}, got {max(args.values)}", prog=PROG
        )


def run_plan(
    args: argparse.Namespace, stdout: TextIO | None = None, stderr: TextIO | None = None
) -> int:
    """Run ``helix-kv plan`` for parsed ``args``; return the exit status."""
    stdout = stdout if stdout is not None else sys.stdout
    stderr = stderr if stderr is not None else sys.stderr

    def fail(status: int, message: str, error_type: str) -> int:
        label = "error: " if status == EXIT_USAGE else ""
        print(f"{PROG}: {label}{message}", file=stderr)
        if args.json:
            print(error_object(status, error_type, message), file=stdout)
        return status

    try:
        _check_flags(args)
        slo = service_levels(args)
        if slo is None:
            raise UsageError(
                "a plan needs a target: give --slo-ttft-ms, --slo-tpot-ms or both", prog=PROG
            )
        # the knob not varied takes simulate's default; the one varied, each candidate's value
        base = argparse.Namespace(**vars(args))
        base.cp = DEFAULT_CP if args.cp is None else args.cp
        base.kv_tokens = DEFAULT_KV_TOKENS if args.kv_tokens is None else args.kv_tokens
        simulation_options(base)  # the flags' own checks, once, before any candidate runs
        # the budgets go in whole superblocks of the layout of --cp and --tokens-per-block
        per_superblock = Layout(base.cp, base.tokens_per_block).tokens_per_superblock
        workload, workload_info = load_workload(base, stderr)
        if args.plot is not None:
            check_plot_target(args.plot)
    except (
        UsageError,
        SimulationSetupError,
        TraceError,
        PlotUnavailableError,
        ConfigError,
    ) as err:
        return fail(EXIT_USAGE, str(err), "UsageError")

    if args.values is not None:
        values = sorted(set(args.values))
    else:
        values = default_values(args.vary, workload, per_superblock, args.max_cp or DEFAULT_MAX_CP)
    jobs = args.jobs or os.cpu_count() or 1
    progress = None if args.progress is False else stderr
    refine = DEFAULT_REFINE if args.refine is None else args.refine
    if args.values is not None or args.vary != "kv-tokens":
        refine = 0  # candidates given, or CP sizes (powers of two): tried as they are
    run = (workload, workload_info, slo, args.slo_share, jobs, progress)
    try:
        candidates = run_candidates(base, args.vary, values, *run)
        for _ in range(refine):
            more = refined_values(candidates, per_superblock)
            if not more:
                break
            found = candidates + run_candidates(base, args.vary, more, *run)
            candidates = sorted(found, key=lambda candidate: candidate.value)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=stderr)
        return EXIT_INTERRUPTED
    plan = Plan(args.vary, slo, args.slo_share, candidates, workload_info)
    print(to_json(plan.to_dict()) if args.json else format_plan(plan), file=stdout)
    if args.plot is not None:
        try:
            plot_plan(plan, args.plot)
        except OSError as err:
            print(f"{PROG}: cannot write the plot {args.plot}: {err.strerror or err}", file=stderr)
            return EXIT_RUN_FAILED
        if not args.json:
            print(f"plot written to {args.plot}", file=stderr)
    if plan.pick is None:
        print(f"{PROG}: no value of {KNOBS[args.vary][0]} passes", file=stderr)
        return EXIT_RUN_FAILED
    return EXIT_OK
