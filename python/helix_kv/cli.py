"""The ``helix-kv`` console script (also ``python -m helix_kv``).

``helix-kv simulate`` runs a simulated CP group of real schedulers over a workload under a
KV budget and prints what KV pressure did (see ``docs/user-guide.md``); ``helix-kv plan``
runs it over candidate KV budgets or CP sizes and picks the smallest that meets SLOs
(:mod:`helix_kv.simulate.plan`, whose exit statuses differ: 1 there means no candidate
passed). The work lives in :mod:`helix_kv.simulate`; this module parses arguments and turns
the ways a command-line tool can end into exit statuses, never a traceback:

====  =========================================================================
0     the run finished, ranks in agreement, every output exact
1     the run failed (one line on stderr says why)
2     usage: bad flags, a bad trace, a missing optional dependency (one line)
130   interrupted by Ctrl-C (a run prints the report of its steps so far first)
141   stdout was closed early (``helix-kv simulate | head -1``): nothing more is
      written, as for a tool ended by SIGPIPE (128 + 13)
====  =========================================================================
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from helix_kv import __version__
from helix_kv.errors import UsageError
from helix_kv.simulate.arguments import (
    OneLineArgumentParser,
    add_simulate_arguments,
    attach_dash_values,
)
from helix_kv.simulate.command import error_object, run_simulate
from helix_kv.simulate.plan import add_plan_arguments, run_plan

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141


def build_parser() -> OneLineArgumentParser:
    """The ``helix-kv`` parser with its subcommands."""
    parser = OneLineArgumentParser(
        prog="helix-kv",
        description="helix_kv tools: a rank-invariant paged KV ledger and preemptive "
        "scheduler for Helix (context-parallel) decoding.",
    )
    parser.add_argument("--version", action="version", version=f"helix-kv {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    simulate = commands.add_parser(
        "simulate",
        help="simulate a CP group of schedulers under KV pressure",
        description="Run cp real schedulers (one per simulated rank) over a synthetic "
        "workload or a JSONL trace under a KV budget, check the ranks agree every step, "
        "and report preemptions, recomputation, KV utilisation and latency in steps.",
    )
    add_simulate_arguments(simulate)
    plan = commands.add_parser(
        "plan",
        help="find the smallest KV budget or CP size that meets SLOs",
        description="Run helix-kv simulate over candidate --kv-tokens or --cp values (in "
        "parallel processes) and pick the smallest whose share of requests meeting every SLO "
        "(--slo-ttft-ms, --slo-tpot-ms, in modelled ms) is at least --slo-share.",
    )
    add_plan_arguments(plan)
    return parser


def _asks_for_json(argv: Sequence[str]) -> bool:
    """Whether ``--json`` (or an abbreviation argparse would accept) is among the arguments,
    read from the raw arguments because a usage error stops parsing before it is known."""
    return any(len(arg) > 2 and "--json".startswith(arg) for arg in argv)


def _run(argv: Sequence[str]) -> int:
    parser = build_parser()
    try:
        args, extras = parser.parse_known_args(attach_dash_values(argv))
        if args.command is None:
            raise UsageError(
                "choose a command: simulate or plan (see helix-kv --help)", prog="helix-kv"
            )
        if extras:
            prog = f"helix-kv {args.command}"
            raise UsageError(
                f"unrecognized arguments: {' '.join(extras)} (see {prog} --help)", prog=prog
            )
    except UsageError as err:
        print(f"{err.prog}: error: {err}", file=sys.stderr)
        if _asks_for_json(argv):
            print(error_object(EXIT_USAGE, "UsageError", str(err)))
        return EXIT_USAGE
    if args.command == "plan":
        return run_plan(args)
    return run_simulate(args)


def _discard_stdout() -> None:
    """Point stdout's descriptor at /dev/null so the interpreter's final flush of what is
    still buffered cannot fail again (Python's documented recipe for SIGPIPE)."""
    try:
        descriptor = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a real file (a test's capture): nothing is flushed at exit
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, descriptor)
    os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``helix-kv`` with ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    try:
        status = _run(arguments)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
    except BrokenPipeError:
        _discard_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:  # before the run started, or a second Ctrl-C
        named = next((arg for arg in arguments if arg in ("simulate", "plan")), None)
        command = "helix-kv" if named is None else f"helix-kv {named}"
        # on a terminal the "^C" echo (or a progress line) holds the cursor: start a new line
        lead = "\n" if sys.stderr.isatty() else ""
        print(f"{lead}{command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return status


if __name__ == "__main__":
    sys.exit(main())
