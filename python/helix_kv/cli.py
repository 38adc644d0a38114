"""The ``helix-kv`` console script.

``helix-kv simulate`` runs a simulated CP group of real schedulers over a workload under a
KV budget and prints what KV pressure did (see ``docs/user-guide.md``). The work lives in
:mod:`helix_kv.simulate`; this module only parses arguments.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from helix_kv.simulate.arguments import (
    OneLineArgumentParser,
    UsageError,
    add_simulate_arguments,
)

EXIT_USAGE = 2


def build_parser() -> OneLineArgumentParser:
    """The ``helix-kv`` parser with its subcommands."""
    parser = OneLineArgumentParser(
        prog="helix-kv",
        description="helix_kv tools: a rank-invariant paged KV ledger and preemptive "
        "scheduler for Helix (context-parallel) decoding.",
    )
    from helix_kv import __version__

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
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``helix-kv`` with ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    parser = build_parser()
    try:
        args, extras = parser.parse_known_args(argv)
        if args.command is None:
            raise UsageError("choose a command: simulate (see helix-kv --help)", prog="helix-kv")
        if extras:
            prog = f"helix-kv {args.command}"
            raise UsageError(
                f"unrecognized arguments: {' '.join(extras)} (see {prog} --help)", prog=prog
            )
    except UsageError as err:
        print(f"{err.prog}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    from helix_kv.simulate.command import run_simulate

    return run_simulate(args)


if __name__ == "__main__":
    sys.exit(main())
