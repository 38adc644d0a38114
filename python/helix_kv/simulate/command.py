"""``helix-kv simulate`` from parsed arguments to printed figures and an exit status.

Exit status: 0 when the run finished with the ranks in agreement and every output exact;
1 when a run failed (a scheduler error such as ``DeadlockError`` or
``PreemptionDisabledError``, a rank mismatch, a wrong output); 2 when the arguments, the
trace or the environment do not allow the run to start (one line on stderr).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional, TextIO

from helix_kv.simulate.arguments import UsageError, simulation_options, workload_spec
from helix_kv.simulate.options import (
    VICTIM_POLICIES,
    SimulationOptions,
    SimulationSetupError,
    check_config,
    preflight,
)
from helix_kv.simulate.plot import PlotUnavailableError, check_plot_available, plot_run
from helix_kv.simulate.procs import (
    ProcsUnavailableError,
    RankFailedError,
    check_procs_available,
    run_in_processes,
)
from helix_kv.simulate.progress import ProgressLine, progress_wanted
from helix_kv.simulate.report import format_comparison, format_table, summarize, to_json
from helix_kv.simulate.runner import SimulationResult, run_simulation
from helix_kv.simulate.workload import RequestSpec, TraceError, read_trace, synthetic_workload

PROG = "helix-kv simulate"
EXIT_OK = 0
EXIT_RUN_FAILED = 1
EXIT_USAGE = 2


def load_workload(args: argparse.Namespace) -> tuple[list[RequestSpec], dict[str, Any]]:
    """The workload and its description for the report's ``config.workload``."""
    if args.trace is not None:
        workload = read_trace(args.trace)
        return workload, {"source": "trace", "path": str(args.trace), "requests": len(workload)}
    spec = workload_spec(args)
    return synthetic_workload(spec), spec.to_dict()


def run_once(
    options: SimulationOptions,
    workload: list[RequestSpec],
    workload_info: dict[str, Any],
    show_progress: bool,
    label: str = "",
) -> SimulationResult:
    """One run, in this process or (``options.procs``) one process per rank."""
    config = options.resolved(workload_info)
    if options.procs:
        return run_in_processes(options, workload, config, show_progress=show_progress)
    from helix_kv.simulate.group import InProcessGroup

    progress = ProgressLine(label=label) if show_progress else None
    try:
        return run_simulation(
            InProcessGroup(options.scheduler_config()),
            workload,
            config=config,
            progress=progress,
            max_steps=options.max_steps,
        )
    finally:
        if progress is not None:
            progress.close()


def _plot_path(path: str, policy: Optional[str]) -> Path:
    target = Path(path)
    if policy is None:
        return target
    return target.with_name(f"{target.stem}.{policy}{target.suffix or '.png'}")


def run_simulate(
    args: argparse.Namespace, stdout: Optional[TextIO] = None, stderr: Optional[TextIO] = None
) -> int:
    """Run ``helix-kv simulate`` for parsed ``args``; return the exit status."""
    stdout = stdout if stdout is not None else sys.stdout
    stderr = stderr if stderr is not None else sys.stderr

    def fail(status: int, message: str) -> int:
        print(f"{PROG}: {'error: ' if status == EXIT_USAGE else ''}{message}", file=stderr)
        return status

    try:
        options = simulation_options(args)
        workload, workload_info = load_workload(args)
        check_config(options)
        if args.plot is not None:
            check_plot_available()
        if options.procs:
            check_procs_available()
        preflight(options, workload)
    except UsageError as err:
        print(f"{err.prog}: error: {err}", file=stderr)
        return EXIT_USAGE
    except (
        SimulationSetupError,
        TraceError,
        PlotUnavailableError,
        ProcsUnavailableError,
    ) as err:
        return fail(EXIT_USAGE, str(err))

    from helix_kv import HelixKVError

    policies: list[Optional[str]] = list(VICTIM_POLICIES) if args.compare_policies else [None]
    show_progress = progress_wanted(args.json, args.progress, stderr)
    results: dict[str, SimulationResult] = {}
    for policy in policies:
        run_options = options if policy is None else options.with_victim_policy(policy)
        try:
            result = run_once(run_options, workload, workload_info, show_progress, policy or "")
        except HelixKVError as err:
            prefix = f"[{policy}] " if policy else ""
            return fail(EXIT_RUN_FAILED, f"{prefix}{type(err).__name__}: {err}")
        except RankFailedError as err:
            return fail(EXIT_RUN_FAILED, str(err))
        results[policy or str(result.config["scheduler"].get("victim_policy"))] = result

    summaries = {name: summarize(result) for name, result in results.items()}
    if args.compare_policies:
        if args.json:
            print(to_json({"policies": summaries}), file=stdout)
        else:
            print(format_comparison(summaries), file=stdout)
    else:
        (summary,) = summaries.values()
        print(to_json(summary) if args.json else format_table(summary), file=stdout)

    if args.plot is not None:
        for policy, result in results.items():
            path = _plot_path(args.plot, policy if args.compare_policies else None)
            plot_run(result, path)
            if not args.json:
                print(f"plot written to {path}", file=stderr)

    healthy = all(r.rank_agreement and r.outputs_exact for r in results.values())
    return EXIT_OK if healthy else EXIT_RUN_FAILED
