"""``helix-kv simulate`` from parsed arguments to printed figures and an exit status.

Exit status (also in docs/user-guide.md): 0 when the run finished with the ranks in agreement
and every output exact (with ``--overlap``: also equal to the outputs of the same workload run
without it); 1 when a run failed (a scheduler error such as ``DeadlockError`` or
``PreemptionDisabledError``, a rank mismatch, a wrong output); 2 when the arguments, the trace
or the environment do not allow the run to start; 130 when Ctrl-C stopped the run (the report
of the steps so far is printed first). Errors are one line on stderr; with ``--json`` stdout
carries one JSON object whatever happens: the report, or ``{"error": {...}}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Callable, TextIO

from helix_kv.cpgroup import SimulatedCPGroup
from helix_kv.errors import (
    HelixKVError,
    PlotUnavailableError,
    ProcsUnavailableError,
    RankFailedError,
    SimulationSetupError,
    TraceError,
    UsageError,
)
from helix_kv.simulate.arguments import (
    STDIO,
    simulation_options,
    trace_selection,
    workload_spec,
)
from helix_kv.simulate.events import STDOUT_TARGET
from helix_kv.simulate.interrupt import InterruptGuard
from helix_kv.simulate.options import (
    BASELINES,
    NO_PREFIX_CACHE,
    RECOMPUTE_ONLY,
    SUSPEND_POLICIES,
    VICTIM_POLICIES,
    SimulationOptions,
    check_config,
    preflight,
)
from helix_kv.simulate.plot import check_plot_target, plot_run
from helix_kv.simulate.procs import check_procs_available, run_in_processes, run_with_options
from helix_kv.simulate.progress import progress_wanted
from helix_kv.simulate.report import (
    add_recompute_only,
    format_comparison,
    format_table,
    summarize,
    to_json,
)
from helix_kv.simulate.step_loop import SimulationResult, outputs_match
from helix_kv.simulate.timing import DEFAULT_STEP_TIME
from helix_kv.simulate.trace_formats import TraceFormat, parse_trace_lines, read_trace_file
from helix_kv.simulate.workload import (
    DEFAULT_HASH_BLOCK_TOKENS,
    TRACE_KEYS,
    HashBlocks,
    RequestSpec,
    is_timed,
    synthetic_workload,
)

PROG = "helix-kv simulate"
EXIT_OK = 0
EXIT_RUN_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command ended by Ctrl-C
#: The trace's name in messages and in ``config.workload.path`` with ``--trace -``.
STDIN_NAME = "<stdin>"


def error_object(status: int, error_type: str, message: str) -> str:
    """What ``--json`` prints instead of a report when the command fails."""
    return to_json({"error": {"type": error_type, "message": message, "exit_status": status}})


def load_workload(
    args: argparse.Namespace, stderr: TextIO | None = None
) -> tuple[list[RequestSpec], dict[str, Any]]:
    """The workload and its description for the report's ``config.workload``; a trace's keys
    that the reader ignores are named on ``stderr``, once each (the rows it skipped are in the
    description: :func:`skipped_rows_note`)."""
    if args.trace is not None:
        block_tokens = args.hash_block_tokens or DEFAULT_HASH_BLOCK_TOKENS
        trace_format = args.trace_format or TraceFormat.AUTO.value
        selection = trace_selection(args)
        if args.trace == STDIO:
            path = STDIN_NAME
            read = parse_trace_lines(sys.stdin, path, trace_format, selection, block_tokens)
        else:
            path = str(args.trace)
            read = read_trace_file(path, trace_format, selection, block_tokens)
        workload = read.requests
        out = stderr if stderr is not None else sys.stderr
        for key, line in read.unknown_keys.items():
            print(
                f"{PROG}: warning: trace {path}: unknown key {json.dumps(key)} (first on line "
                f"{line}) is ignored; the keys read are {', '.join(TRACE_KEYS)}",
                file=out,
            )
        info: dict[str, Any] = {"source": "trace", "path": path}
        if read.trace_format is not TraceFormat.HELIX:  # a helix trace's description is as it was
            info["format"] = read.trace_format.value
        info["requests"] = len(workload)
        if is_timed(workload):  # only then: the description of a step trace is unchanged
            info["arrivals"] = "ms"
        if read.trace_format is not TraceFormat.HELIX:
            info["rows"] = read.rows
            info["skipped"] = read.skipped
        if args.time_scale is not None:
            info["time_scale"] = selection.time_scale
        if selection.window_s is not None:
            info["window_s"] = list(selection.window_s)
        if selection.limit is not None:
            info["limit"] = selection.limit
        with_content = sum(1 for request in workload if request.content is not None)
        if with_content:  # only then: the description of a trace without content is unchanged
            info["requests_with_content"] = with_content
            if any(isinstance(request.content, HashBlocks) for request in workload):
                info["hash_block_tokens"] = block_tokens
        return workload, info
    spec = workload_spec(args)
    return synthetic_workload(spec), spec.to_dict()


def skipped_rows_note(workload_info: dict[str, Any]) -> str | None:
    """The note on stderr that a trace's rows were skipped, by reason (``None``: none were)."""
    skipped: dict[str, int] = workload_info.get("skipped") or {}
    if not skipped:
        return None
    counts = ", ".join(f"{count} {reason}" for reason, count in skipped.items())
    return (
        f"{PROG}: note: trace {workload_info['path']}: skipped {sum(skipped.values())} of its "
        f"{workload_info['rows']} rows ({counts})"
    )


def run_once(
    options: SimulationOptions,
    workload: list[RequestSpec],
    workload_info: dict[str, Any],
    show_progress: bool,
    label: str = "",
    should_stop: Callable[[], bool] | None = None,
    events_path: Path | str | None = None,
) -> SimulationResult:
    """One run, in this process or (``options.procs``) one process per rank; with
    ``events_path``, its events are written there (by rank 0's process under ``procs``;
    :data:`~.events.STDOUT_TARGET`: to stdout)."""
    config = options.resolved(workload_info)
    if options.procs:
        return run_in_processes(
            options,
            workload,
            config,
            show_progress=show_progress,
            should_stop=should_stop,
            events_path=events_path,
        )
    return run_with_options(
        lambda: SimulatedCPGroup(options.scheduler_config(), ranks=options.verified_ranks()),
        workload,
        options,
        config,
        progress_label=label if show_progress else None,
        events_path=events_path,
        should_stop=should_stop,
    )


def _plot_path(path: str, policy: str | None) -> Path:
    target = Path(path)
    if policy is None:
        return target
    return target.with_name(f"{target.stem}.{policy}{target.suffix}")


def planned_runs(
    options: SimulationOptions, compare: bool
) -> list[tuple[str | None, SimulationOptions]]:
    """The runs of one command, each with its ``--compare-policies`` column name (``None``
    for a single run). With a host tier: ``--compare-policies`` adds a run per suspend policy
    (under the default victim policy) and one without the host tier; a single run is followed
    by a run without the host tier, the baseline of ``recomputed_tokens_avoided``. With prefix
    caching, ``--compare-policies`` ends with a run without it (default policies)."""
    if not compare:
        runs: list[tuple[str | None, SimulationOptions]] = [(None, options)]
    else:
        runs = [(policy, options.with_victim_policy(policy)) for policy in VICTIM_POLICIES]
        if options.has_host_tier:
            runs += [(policy, options.with_suspend_policy(policy)) for policy in SUSPEND_POLICIES]
    if options.has_host_tier:
        runs.append((RECOMPUTE_ONLY, options.without_host_tier()))
    if compare and options.has_prefix_caching:
        runs.append((NO_PREFIX_CACHE, options.without_prefix_caching()))
    return runs


def events_paths(path: str | None, policies: list[str | None]) -> dict[str | None, Path | str]:
    """Where each run's ``--events`` go: the file itself, or with ``--compare-policies`` one
    file per policy (``run.jsonl`` -> ``run.newest_first.jsonl``, as ``--plot`` names them);
    ``-``: stdout (:data:`~.events.STDOUT_TARGET`, one run)."""
    if path is None:
        return {}
    if path == STDIO:
        return {policy: STDOUT_TARGET for policy in policies}
    target = Path(path).expanduser()
    return {policy: _plot_path(str(target), policy) for policy in policies}


def check_events_targets(paths: dict[str | None, Path | str]) -> None:
    """Open each events file for writing once (creating it), so that a file that cannot be
    written stops the command before the run (a usage error naming ``--events``)."""
    for path in paths.values():
        if path == STDOUT_TARGET:
            continue
        try:
            with open(path, "a", encoding="utf-8"):
                pass
        except OSError as err:
            raise UsageError(f"--events {path}: cannot write it ({err.strerror or err})") from None


def run_simulate(
    args: argparse.Namespace, stdout: TextIO | None = None, stderr: TextIO | None = None
) -> int:
    """Run ``helix-kv simulate`` for parsed ``args``; return the exit status."""
    stderr = stderr if stderr is not None else sys.stderr
    # --events -: stdout carries the events alone, and the report (or error object) goes to stderr
    stdout = stderr if args.events == STDIO else stdout if stdout is not None else sys.stdout

    def fail(status: int, message: str, error_type: str, detail: str | None = None) -> int:
        """One line on stderr; with ``--json`` also the error object (``detail``: its
        message when the line says more, e.g. the error's class)."""
        label = "error: " if status == EXIT_USAGE else ""
        print(f"{PROG}: {label}{message}", file=stderr)
        if args.json:
            print(error_object(status, error_type, detail or message), file=stdout)
        return status

    try:
        options = simulation_options(args)
        workload, workload_info = load_workload(args, stderr)
        if is_timed(workload) and options.step_time is None:
            # arrivals in time need a modelled clock: the default model, shown in the report
            options = dataclasses.replace(options, step_time=DEFAULT_STEP_TIME)
        check_config(options)
        if args.plot is not None:
            check_plot_target(args.plot)
        if options.procs:
            check_procs_available()
        preflight(options, workload)
        runs = planned_runs(options, args.compare_policies)
        events_at = events_paths(args.events, [name for name, _ in runs if name not in BASELINES])
        check_events_targets(events_at)
    except (
        UsageError,
        SimulationSetupError,
        TraceError,
        PlotUnavailableError,
        ProcsUnavailableError,
    ) as err:
        return fail(EXIT_USAGE, str(err), "UsageError")
    note = skipped_rows_note(workload_info)  # once the run can start: an error stays one line
    if note is not None:
        print(note, file=stderr)

    show_progress = progress_wanted(args.json, args.progress, stderr)
    results: dict[str, SimulationResult] = {}
    with InterruptGuard() as interrupted:
        for policy, run_options in runs:
            if interrupted():
                break
            label = policy or ""
            try:
                result = run_once(
                    run_options,
                    workload,
                    workload_info,
                    show_progress,
                    label,
                    interrupted,
                    events_at.get(policy),
                )
            except BrokenPipeError:  # stdout closed under --events -: exit status 141
                raise
            except OSError as err:  # the events file, written as the run goes
                path = events_at.get(policy)
                message = f"cannot write the events file {path}: {err.strerror or err}"
                return fail(EXIT_RUN_FAILED, message, "OSError")
            except HelixKVError as err:
                prefix = f"[{policy}] " if policy else ""
                name = type(err).__name__
                return fail(EXIT_RUN_FAILED, f"{prefix}{name}: {err}", name, f"{prefix}{err}")
            except RankFailedError as err:
                return fail(EXIT_RUN_FAILED, str(err), type(err).__name__)
            if run_options.overlap and not result.interrupted:
                # the same workload without overlap: its outputs are the reference
                try:
                    plain = run_once(
                        dataclasses.replace(run_options, overlap=False),
                        workload,
                        workload_info,
                        False,
                        should_stop=interrupted,
                    )
                except HelixKVError as err:
                    prefix = f"[{policy}] " if policy else ""
                    name = type(err).__name__
                    message = f"{prefix}the run without --overlap failed: {name}: {err}"
                    return fail(EXIT_RUN_FAILED, message, name, f"{prefix}{err}")
                if not plain.interrupted:
                    result.outputs_match_plain = outputs_match(result, plain)
            results[policy or str(result.config["scheduler"].get("victim_policy"))] = result

    summaries = {name: summarize(result) for name, result in results.items()}
    baseline = summaries.get(RECOMPUTE_ONLY)
    if baseline is not None:
        for name, summary in summaries.items():
            if name not in BASELINES:  # the run without caching ran on another footing
                add_recompute_only(summary, baseline)
        if not args.compare_policies:
            del summaries[RECOMPUTE_ONLY]  # a single run reports it inside its own figures
            del results[RECOMPUTE_ONLY]
    if args.compare_policies:
        if args.json:
            print(to_json({"policies": summaries}), file=stdout)
        else:
            print(format_comparison(summaries), file=stdout)
    else:
        (summary,) = summaries.values()
        print(to_json(summary) if args.json else format_table(summary), file=stdout)

    if args.plot is not None:
        for name, result in results.items():
            path = _plot_path(args.plot, name if args.compare_policies else None)
            try:
                plot_run(result, path)
            except OSError as err:  # the report is out already: stderr only
                print(f"{PROG}: cannot write the plot {path}: {err.strerror or err}", file=stderr)
                return EXIT_RUN_FAILED
            if not args.json:
                print(f"plot written to {path}", file=stderr)

    if interrupted():
        steps = sum(len(result.series) for result in results.values())
        print(f"{PROG}: interrupted after {steps} steps; the report covers those", file=stderr)
        return EXIT_INTERRUPTED
    healthy = all(r.rank_agreement and r.outputs_exact for r in results.values())
    return EXIT_OK if healthy else EXIT_RUN_FAILED
