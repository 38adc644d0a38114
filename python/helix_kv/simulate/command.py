"""``helix-kv simulate`` from parsed arguments to printed figures and an exit status.

Exit status (also in docs/user-guide.md): 0 when the run finished with the ranks in agreement
and every output exact (with ``--overlap``: also equal to the outputs of the same workload run
without it); 1 when a run failed (a scheduler error such as ``DeadlockError`` or
``PreemptionDisabledError``, a rank mismatch, a wrong output; a scheduler error mid-run prints
the step it was raised in, its remedy in the flags' terms and the report of the steps before
it); 2 when the arguments, the trace
or the environment do not allow the run to start; 130 when Ctrl-C stopped the run (the report
of the steps so far is printed first). Errors are one line on stderr; with ``--json`` stdout
carries one JSON object whatever happens: the report, or ``{"error": {...}}`` (with the report
so far beside it, ``"report"`` or ``"policies"``, when a scheduler error ended a run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
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
    service_levels,
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
    in_flag_terms,
    preflight,
)
from helix_kv.simulate.plot import check_plot_target, plot_run
from helix_kv.simulate.procs import check_procs_available, run_in_processes, run_with_options
from helix_kv.simulate.progress import progress_wanted
from helix_kv.simulate.report import (
    REPORT_WIDTH,
    add_recompute_only,
    format_comparison,
    format_table,
    summarize,
    to_json,
)
from helix_kv.simulate.step_loop import SimulationResult, outputs_match, partial_result
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


@dataclasses.dataclass(frozen=True)
class PlannedRun:
    """One run of a command."""

    name: str | None
    """Its ``--compare-policies`` column (or baseline) name; ``None`` for a single run."""
    options: SimulationOptions
    baseline: str | None = None
    """The run without the host tier that this run's recomputed tokens are compared with:
    the same options with the host tier off (``None``: no host tier, or a baseline itself)."""
    shown: bool = True
    """A column of the report; a baseline run only for another run's figures is not."""
    same_as: tuple[str, ...] = ()
    """The columns of the same configuration, run once as this one (under the default policies
    the ``suspend_first`` column is the ``newest_first`` one)."""


def _same_run(first: SimulationOptions, second: SimulationOptions) -> bool:
    """Whether two runs' options are the same configuration (scheduler defaults resolved)."""
    return first.resolved({}) == second.resolved({})


def planned_runs(options: SimulationOptions, compare: bool) -> list[PlannedRun]:
    """The runs of one command. With a host tier: ``--compare-policies`` adds a column per
    suspend policy (under the default victim policy) and one without the host tier; a single
    run is followed by a run without the host tier, the baseline of
    ``recomputed_tokens_avoided``. Each run with a host tier is compared with its own options
    without it (a victim policy's column with that policy's run, which is not a column itself
    unless it is the ``no_host_tier`` one). With prefix caching, ``--compare-policies`` ends
    with a run without it (default policies). A configuration met twice (``suspend_first``,
    the default suspend policy, is the ``newest_first`` column) runs once."""
    if not compare:
        columns: list[tuple[str | None, SimulationOptions]] = [(None, options)]
    else:
        columns = [(policy, options.with_victim_policy(policy)) for policy in VICTIM_POLICIES]
        if options.has_host_tier:
            columns += [
                (policy, options.with_suspend_policy(policy)) for policy in SUSPEND_POLICIES
            ]
            columns.append((RECOMPUTE_ONLY, options.without_host_tier()))
        if options.has_prefix_caching:
            columns.append((NO_PREFIX_CACHE, options.without_prefix_caching()))
    runs: list[PlannedRun] = []
    for name, run_options in columns:
        same = next((run for run in runs if _same_run(run.options, run_options)), None)
        if same is not None and name is not None:
            runs[runs.index(same)] = dataclasses.replace(same, same_as=(*same.same_as, name))
        else:
            runs.append(PlannedRun(name, run_options))
    if options.has_host_tier:
        for at, run in enumerate(list(runs)):
            if run.name in BASELINES:  # compared with nothing: they ran on another footing
                continue
            plain = run.options.without_host_tier()
            baseline = next((other for other in runs if _same_run(other.options, plain)), None)
            if baseline is None:
                name = RECOMPUTE_ONLY if run.name is None else f"{run.name}.{RECOMPUTE_ONLY}"
                baseline = PlannedRun(name, plain, shown=False)
                runs.append(baseline)
            runs[at] = dataclasses.replace(run, baseline=baseline.name)
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
    return _SimulateCommand(args, stdout, stderr).run()


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """What a command runs, once every check before the runs passed."""

    workload: list[RequestSpec]
    workload_info: dict[str, Any]
    runs: list[PlannedRun]
    events_at: dict[str | None, Path | str]


class _SimulateCommand:
    """One ``helix-kv simulate`` command: its streams, its planned runs, their results and the
    run a scheduler error ended (:meth:`run` goes from the arguments to the exit status)."""

    def __init__(
        self, args: argparse.Namespace, stdout: TextIO | None, stderr: TextIO | None
    ) -> None:
        self.args = args
        self.stderr = stderr if stderr is not None else sys.stderr
        # --events -: stdout carries the events alone, and the report (or error object) goes
        # to stderr
        self.stdout = (
            self.stderr if args.events == STDIO else stdout if stdout is not None else sys.stdout
        )
        self.results: dict[str, SimulationResult] = {}
        #: The run a scheduler error ended, and the error (the runs after it are not made).
        self.failed: tuple[PlannedRun, HelixKVError] | None = None

    def fail(self, status: int, message: str, error_type: str, detail: str | None = None) -> int:
        """One line on stderr; with ``--json`` also the error object (``detail``: its
        message when the line says more, e.g. the error's class). Returns ``status``."""
        label = "error: " if status == EXIT_USAGE else ""
        print(f"{PROG}: {label}{message}", file=self.stderr)
        if self.args.json:
            print(error_object(status, error_type, detail or message), file=self.stdout)
        return status

    def run(self) -> int:
        """The command: check, run, report, plot; the exit status."""
        try:
            prepared = self._prepare()
        except (
            UsageError,
            SimulationSetupError,
            TraceError,
            PlotUnavailableError,
            ProcsUnavailableError,
        ) as err:
            return self.fail(EXIT_USAGE, str(err), "UsageError")
        note = skipped_rows_note(prepared.workload_info)  # once the run can start
        if note is not None:
            print(note, file=self.stderr)
        with InterruptGuard() as interrupted:
            status = self._run_all(prepared, interrupted)
        if status is not None:
            return status
        shown = self._report(prepared.runs)
        status = self._plot(shown)
        if status is not None:
            return status
        if self.failed is not None:
            print(self._failure()[1], file=self.stderr)
            return EXIT_RUN_FAILED
        if interrupted():
            steps = sum(len(result.series) for result in self.results.values())
            print(
                f"{PROG}: interrupted after {steps} steps; the report covers those",
                file=self.stderr,
            )
            return EXIT_INTERRUPTED
        healthy = all(r.rank_agreement and r.outputs_exact for r in self.results.values())
        return EXIT_OK if healthy else EXIT_RUN_FAILED

    def _prepare(self) -> _Prepared:
        """The options, the workload and the runs, every check made before a run starts
        (an error here is a usage error: exit status 2)."""
        args = self.args
        options = simulation_options(args)
        workload, workload_info = load_workload(args, self.stderr)
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
        columns = [run.name for run in runs if run.shown and run.name not in BASELINES]
        events_at = events_paths(args.events, columns)
        check_events_targets(events_at)
        return _Prepared(workload, workload_info, runs, events_at)

    def _run_all(self, prepared: _Prepared, interrupted: Callable[[], bool]) -> int | None:
        """Makes the runs in order into :attr:`results`, until one fails or ``interrupted()``
        says so; an exit status where the command ends here (nothing to report)."""
        show_progress = progress_wanted(self.args.json, self.args.progress, self.stderr)
        for run in prepared.runs:
            if interrupted():
                break
            policy = run.name
            prefix = f"[{policy}] " if policy else ""
            try:
                result = run_once(
                    run.options,
                    prepared.workload,
                    prepared.workload_info,
                    show_progress,
                    policy or "",
                    interrupted,
                    prepared.events_at.get(policy),
                )
            except BrokenPipeError:  # stdout closed under --events -: exit status 141
                raise
            except OSError as err:  # the events file, written as the run goes
                path = prepared.events_at.get(policy)
                message = f"cannot write the events file {path}: {err.strerror or err}"
                return self.fail(EXIT_RUN_FAILED, message, "OSError")
            except HelixKVError as err:
                partial = partial_result(err)
                if partial is None:  # nothing ran: no report to give
                    name = type(err).__name__
                    message = f"{prefix}{in_flag_terms(err)}"
                    return self.fail(EXIT_RUN_FAILED, f"{prefix}{name}: {message}", name, message)
                self.results[_result_key(run)] = partial
                self.failed = (run, err)
                break  # the runs after it are not made: the report covers those so far
            except RankFailedError as err:
                return self.fail(EXIT_RUN_FAILED, str(err), type(err).__name__)
            if run.options.overlap and not result.interrupted:
                status = self._compare_with_plain(run, result, prepared, interrupted, prefix)
                if status is not None:
                    return status
            self.results[_result_key(run)] = result
        return None

    def _compare_with_plain(
        self,
        run: PlannedRun,
        result: SimulationResult,
        prepared: _Prepared,
        interrupted: Callable[[], bool],
        prefix: str,
    ) -> int | None:
        """Runs an ``--overlap`` run's workload without overlap, whose outputs are the
        reference, and records whether they match; an exit status where that run failed."""
        try:
            plain = run_once(
                dataclasses.replace(run.options, overlap=False),
                prepared.workload,
                prepared.workload_info,
                False,
                should_stop=interrupted,
            )
        except HelixKVError as err:
            name = type(err).__name__
            reason = in_flag_terms(err)
            message = f"{prefix}the run without --overlap failed: {name}: {reason}"
            return self.fail(EXIT_RUN_FAILED, message, name, f"{prefix}{reason}")
        if not plain.interrupted:
            result.outputs_match_plain = outputs_match(result, plain)
        return None

    def _failure(self) -> tuple[dict[str, Any] | None, str]:
        """The failed run's error object (with its step) and its line on stderr."""
        if self.failed is None:
            return None, ""
        run, raised = self.failed
        name = type(raised).__name__
        step = self.results[_result_key(run)].failed_step
        prefix = f"[{run.name}] " if run.name else ""
        reason = in_flag_terms(raised)
        error: dict[str, Any] = {
            "type": name,
            "message": f"{prefix}{reason}",
            "exit_status": EXIT_RUN_FAILED,
            "step": step,
        }
        if run.name is not None:
            error["run"] = run.name
        return error, f"{PROG}: {prefix}{name} in step {step}: {reason}"

    def _report(self, runs: list[PlannedRun]) -> dict[str, dict[str, Any]]:
        """Prints the report of the runs made (a table, a comparison, or ``--json``'s
        object, with the failed run's error where one failed); the summaries shown."""
        args, stdout = self.args, self.stdout
        slo = service_levels(args)
        summaries = {name: summarize(result, slo) for name, result in self.results.items()}
        for run in runs:
            summary = summaries.get(_result_key(run))
            baseline = summaries.get(run.baseline) if run.baseline is not None else None
            if summary is not None and baseline is not None and "failed" not in baseline:
                add_recompute_only(summary, baseline)
        shown = {
            _result_key(run): summaries[_result_key(run)]
            for run in runs
            if run.shown and _result_key(run) in summaries
        }
        same_as = {alias: run.name for run in runs if run.name is not None for alias in run.same_as}
        error = self._failure()[0]
        if args.compare_policies:
            report: dict[str, Any] = {"policies": shown}
            if same_as:
                report["same_as"] = same_as
            if args.json:
                print(to_json(report if error is None else {"error": error, **report}), file=stdout)
            else:
                print(format_comparison(shown, same_as, _report_width(stdout)), file=stdout)
        elif shown:  # a single run's report (it reports its baseline inside its own figures)
            (summary,) = shown.values()
            if args.json:
                failed_report = {"error": error, "report": summary}
                print(to_json(summary if error is None else failed_report), file=stdout)
            else:
                print(format_table(summary), file=stdout)
        elif args.json and error is not None:
            print(to_json({"error": error}), file=stdout)
        return shown

    def _plot(self, shown: dict[str, dict[str, Any]]) -> int | None:
        """Draws ``--plot`` for each run shown; an exit status where a plot cannot be
        written (the report is out already: stderr only)."""
        if self.args.plot is None:
            return None
        for name in shown:
            path = _plot_path(self.args.plot, name if self.args.compare_policies else None)
            try:
                plot_run(self.results[name], path)
            except OSError as err:
                print(
                    f"{PROG}: cannot write the plot {path}: {err.strerror or err}", file=self.stderr
                )
                return EXIT_RUN_FAILED
            if not self.args.json:
                print(f"plot written to {path}", file=self.stderr)
        return None


def _report_width(stream: TextIO) -> int:
    """The width a comparison fits: the terminal's when ``stream`` is one, else
    :data:`~.report.REPORT_WIDTH` (a file or a pipe: the same output everywhere)."""
    try:
        if stream.isatty():
            return shutil.get_terminal_size((REPORT_WIDTH, 24)).columns
    except (AttributeError, ValueError, OSError):  # a closed or unusual stream
        pass
    return REPORT_WIDTH


def _result_key(run: PlannedRun) -> str:
    """The name a run's result goes by: its column, or a single run's victim policy."""
    if run.name is not None:
        return run.name
    return str(run.options.resolved({})["scheduler"]["victim_policy"])
