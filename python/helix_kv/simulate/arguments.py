"""Command-line arguments of ``helix-kv simulate`` and their translation into options.

Scheduler flags default to ``None`` (not given): the core's defaults then apply, and the
report shows the resolved values. Every problem found here raises :class:`UsageError`
with a one-line reason; the CLI turns it into exit status 2.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from helix_kv._core import ConfigField, Layout, SchedulerConfig
from helix_kv.errors import ConfigError, SimulationSetupError
from helix_kv.errors import UsageError as UsageError  # also importable from here
from helix_kv.simulate.drafts import DEFAULT_ACCEPTANCE, DraftModel
from helix_kv.simulate.options import (
    I32_MAX,
    I64_MAX,
    MAX_CP,
    MAX_PROCS_CP,
    MAX_REQUEST_TOKENS,
    MAX_REQUESTS,
    MIN_ARRIVAL_RATE,
    TOKEN_FLAGS,
    U32_MAX,
    U64_MAX,
    VERIFY_ALL_UP_TO_CP,
    VERIFY_RANKS_MODES,
    SimulationOptions,
    scheduler_flag,
)
from helix_kv.simulate.report import ServiceLevels
from helix_kv.simulate.timing import DEFAULT_STEP_TIME, PROFILE_KEYS, StepTimeModel, load_profile
from helix_kv.simulate.trace_formats import TRACE_FORMATS, TraceSelection
from helix_kv.simulate.workload import (
    DEFAULT_HASH_BLOCK_TOKENS,
    MAX_REQUEST_RATE,
    MAX_THINK_S,
    MAX_THINK_STEPS,
    TRACE_OPTIONAL_KEYS,
    TRACE_REQUIRED_KEYS,
    LengthDistribution,
    WorkloadSpec,
)

#: Defaults of the embedded workload: under the default KV budget it preempts.
DEFAULT_CP = 2
DEFAULT_TOKENS_PER_BLOCK = 16
DEFAULT_KV_TOKENS = 16_384
DEFAULT_WORKLOAD = WorkloadSpec()

#: The scheduler's own defaults (the core's), quoted by the help of the flags left unset.
SCHEDULER_DEFAULTS = SchedulerConfig.DEFAULTS

#: Scheduler fields whose flags are declared by hand: the CP group and its page size (with the
#: simulator's own defaults), and the KV pools, given in global tokens.
HAND_DECLARED_FIELDS = (
    "cp_size",
    "tokens_per_block",
    "capacity_superblocks",
    "host_tier_superblocks",
)

#: The flag of every other ``SchedulerConfig`` field (``SchedulerConfig.FIELDS``, a field added
#: to the core included), declared from the field by :func:`_field_flag`; each flag's value
#: is ``args.<field name>``, ``None`` when not given.
FIELD_FLAGS = {
    field.name: flag
    for field in SchedulerConfig.FIELDS
    if field.name not in HAND_DECLARED_FIELDS and (flag := scheduler_flag(field)) is not None
}

#: ``--trace -`` reads the trace from stdin, ``--events -`` writes the events to stdout.
STDIO = "-"

#: Flags that shape the synthetic workload (they make no sense with ``--trace``).
SYNTHETIC_FLAGS = {
    "requests": "--requests",
    "seed": "--seed",
    "arrival_rate": "--arrival-rate",
    "prompt_len": "--prompt-len",
    "prompt_len_max": "--prompt-len-max",
    "output_len": "--output-len",
    "output_len_max": "--output-len-max",
    "length_dist": "--length-dist",
    "priority_levels": "--priority-levels",
    "abort_rate": "--abort-rate",
    "shared_prefix_len": "--shared-prefix-len",
    "shared_prefix_share": "--shared-prefix-share",
    "turns": "--turns",
    "think_steps": "--think-steps",
    "request_rate": "--request-rate",
    "think_s": "--think-s",
}


#: Flags whose value may start with "-" without being a plain number (``--step-time -1,0,0``),
#: which argparse would take for a flag; :func:`attach_dash_values` joins them up.
DASH_VALUE_FLAGS = ("--step-time",)


def attach_dash_values(argv: Sequence[str]) -> list[str]:
    """``argv`` with ``FLAG VALUE`` written ``FLAG=VALUE`` for the :data:`DASH_VALUE_FLAGS`
    whose value starts with ``-`` and a digit or a dot, so that argparse passes the value to the
    flag's own check instead of refusing it as a missing argument."""
    joined: list[str] = []
    values = iter(argv)
    for arg in values:
        if arg == "--":
            joined.append(arg)
            joined.extend(values)
            break
        if arg in DASH_VALUE_FLAGS:
            value = next(values, None)
            if value is not None and re.match(r"-[0-9.]", value):
                joined.append(f"{arg}={value}")
                continue
            joined.append(arg)
            if value is not None:
                joined.append(value)
            continue
        joined.append(arg)
    return joined


class OneLineArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors raise :class:`UsageError` instead of printing
    the usage block and exiting, so every argument error is one line and exit status 2."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)", prog=self.prog)


def _integer(minimum: int, maximum: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {value}")
        return value

    parse.__name__ = f"integer in [{minimum}, {maximum}]"
    return parse


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _arrival_rate(text: str) -> float:
    value = _number(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    if 0 < value < MIN_ARRIVAL_RATE:
        raise argparse.ArgumentTypeError(f"must be 0 or at least {MIN_ARRIVAL_RATE:g}, got {text}")
    return value


def _number_in(low: float, high: float, what: str, *, open_low: bool = False) -> Any:
    """A parser of a number in ``[low, high]`` (``(low, high]`` with ``open_low``; NaN is
    in neither), refused as ``must be {what} in [low, high], got TEXT``."""
    bounds = f"{'(' if open_low else '['}{_shown(low)}, {_shown(high)}]"

    def parse(text: str) -> float:
        value = _number(text)
        above = value > low if open_low else value >= low
        if not (above and value <= high):  # also rejects NaN
            raise argparse.ArgumentTypeError(f"must be {what} in {bounds}, got {text}")
        return value

    parse.__name__ = f"{what} in {bounds}"
    return parse


def _shown(bound: float) -> str:
    """A bound as the messages write it (a float in its shortest form, ``1e+06``)."""
    return f"{bound:g}" if isinstance(bound, float) else str(bound)


_fraction = _number_in(0, 1, "a fraction")
_think_steps = _number_in(0, MAX_THINK_STEPS, "a number of steps")
_request_rate = _number_in(0, MAX_REQUEST_RATE, "a number of requests per second", open_low=True)
_think_s = _number_in(0, MAX_THINK_S, "a number of seconds")


def _target_ms(text: str) -> float:
    """An SLO target in ms: a finite number > 0."""
    value = _number(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of ms > 0, got {text}")
    return value


def _step_time(text: str) -> StepTimeModel:
    """``--step-time``: ``default``, or the three coefficients in ms, comma-separated."""
    if text == "default":
        return DEFAULT_STEP_TIME
    parts = text.split(",")
    if len(parts) != len(PROFILE_KEYS):
        raise argparse.ArgumentTypeError(
            f"expected 'default' or FIXED_MS,PER_TOKEN_MS,PER_KV_TOKEN_MS, got {text!r}"
        )
    try:
        values = [float(part) for part in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected three numbers FIXED_MS,PER_TOKEN_MS,PER_KV_TOKEN_MS, got {text!r}"
        ) from None
    try:
        fixed, per_token, per_kv_token = values
        return StepTimeModel(fixed, per_token, per_kv_token, source="--step-time")
    except SimulationSetupError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _integer_flag(
    group: argparse._ArgumentGroup, flag: str, minimum: int, maximum: int, **kwargs: Any
) -> None:
    """Declare an integer flag in ``[minimum, maximum]`` (metavar ``N``), the shape of most
    flags here; ``kwargs`` (help, default, ...) go to ``add_argument`` unchanged."""
    group.add_argument(flag, type=_integer(minimum, maximum), metavar="N", **kwargs)


def _field_flag(group: argparse._ArgumentGroup, field: ConfigField, flag: str) -> None:
    """Declare ``flag``, which sets ``field``, from the core's declaration: an integer in the
    field's range (at most int64's, the binding's widest), one of its choices, or a switch that
    flips its default; the help is the field's doc and default. Unset, it is ``None``."""
    doc = field.doc.replace("`", "").rstrip(".")
    doc = doc[0].lower() + doc[1:]
    if field.type == "bool":
        flipped = not field.default
        group.add_argument(
            flag,
            dest=field.name,
            action="store_const",
            const=flipped,
            default=None,
            help=f"{doc} (default {field.default}; this flag: {flipped})",
        )
        return
    shown = "" if field.default is None else f" (default {field.default})"
    if field.choices:
        group.add_argument(flag, dest=field.name, choices=field.choices, help=doc + shown)
        return
    if field.minimum is None or field.maximum is None:
        raise TypeError(f"SchedulerConfig field {field.name} ({field.type}) has no flag form")
    maximum = min(field.maximum, I64_MAX)
    _integer_flag(group, flag, field.minimum, maximum, dest=field.name, help=doc + shown)


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare every flag of ``helix-kv simulate`` on ``parser``, group by group (the order
    of ``--help``)."""
    _add_group_flags(parser.add_argument_group("CP group and KV budget"))
    _add_scheduler_flags(
        parser.add_argument_group("scheduler (unset flags take the scheduler's defaults)")
    )
    workload = parser.add_argument_group("workload (synthetic unless --trace)")
    _add_trace_source_flags(workload)
    _add_arrival_flags(workload)
    _add_length_flags(workload)
    _add_conversation_flags(workload)
    run = parser.add_argument_group("run and output")
    _add_run_flags(run)
    _add_record_flags(run)
    _add_slo_flags(
        parser.add_argument_group(
            "service-level objectives (goodput: the requests that meet every one given)"
        )
    )


def _add_group_flags(group: argparse._ArgumentGroup) -> None:
    """The CP group, its page size and the KV budget (the simulator's own defaults)."""
    _integer_flag(
        group, "--cp", 1, MAX_CP, default=DEFAULT_CP, help="CP ranks (default: %(default)s)"
    )
    _integer_flag(
        group,
        "--tokens-per-block",
        1,
        U32_MAX,
        default=DEFAULT_TOKENS_PER_BLOCK,
        help="tokens in one KV page on one rank (default: %(default)s)",
    )
    _integer_flag(
        group,
        TOKEN_FLAGS["capacity_superblocks"],
        1,
        I64_MAX,
        default=DEFAULT_KV_TOKENS,
        help="ledger capacity in global tokens, rounded down to whole superblocks of "
        "tokens_per_block*cp tokens (default: %(default)s)",
    )


def _add_scheduler_flags(group: argparse._ArgumentGroup) -> None:
    """A flag for every ``SchedulerConfig`` field (declared from the core's field, or by
    hand: the host tier in tokens), and the draft model's acceptance."""
    for field in SchedulerConfig.FIELDS:
        if field.name == "host_tier_superblocks":
            _integer_flag(
                group,
                TOKEN_FLAGS["host_tier_superblocks"],
                0,
                I64_MAX,
                help="host tier for suspends, in global tokens (rounded down to superblocks; "
                "non_helix and aggregated_helix)",
            )
        elif field.name in FIELD_FLAGS:
            _field_flag(group, field, FIELD_FLAGS[field.name])

    group.add_argument(
        "--acceptance",
        type=_fraction,
        metavar="P",
        help="with --spec-tokens: the chance that each draft token is accepted, a seeded coin "
        "per token (from --seed), the same on every rank; a step accepts its leading "
        f"successes (default {DEFAULT_ACCEPTANCE})",
    )


def _add_trace_source_flags(group: argparse._ArgumentGroup) -> None:
    """The trace a workload is read from and how its lines are read."""
    group.add_argument(
        "--trace",
        metavar="FILE",
        help='a trace ("-": read it from stdin) in any --trace-format; the helix JSONL holds '
        "one JSON object per line: "
        f"{', '.join(TRACE_REQUIRED_KEYS)} (required; prompt_len may be left out with "
        f"token_ids) and {', '.join(TRACE_OPTIONAL_KEYS)} (optional; the prompt's content as "
        "token_ids or hash_ids, not both); or arrivals in time: arrival_ms or arrival_s "
        "instead of arrival_step (abort_ms or abort_s instead of abort_step), run on the "
        "modelled clock of --step-time (default: the default model); other keys are ignored "
        "with a warning",
    )
    _integer_flag(
        group,
        "--hash-block-tokens",
        1,
        MAX_REQUEST_TOKENS,
        help="tokens one id of a trace line's hash_ids stands for (default "
        f"{DEFAULT_HASH_BLOCK_TOKENS}, the Mooncake traces')",
    )
    add_trace_flags(group)


def _add_arrival_flags(group: argparse._ArgumentGroup) -> None:
    """The synthetic workload's requests and when they arrive."""
    workload = DEFAULT_WORKLOAD
    _integer_flag(
        group, "--requests", 1, MAX_REQUESTS, help=f"requests (default {workload.num_requests})"
    )
    _integer_flag(group, "--seed", 0, U64_MAX, help=f"workload seed (default {workload.seed})")
    group.add_argument(
        "--arrival-rate",
        type=_arrival_rate,
        metavar="RATE",
        help="mean arrivals per step (Poisson); 0 puts every request at step 0 "
        f"(default {workload.arrival_rate})",
    )
    group.add_argument(
        "--request-rate",
        type=_request_rate,
        metavar="PER_S",
        help="arrivals in time instead: mean requests per second of modelled time (Poisson), "
        "run on the modelled clock of --step-time (default: the default model); with --turns "
        "the rate of new conversations",
    )


def _add_length_flags(group: argparse._ArgumentGroup) -> None:
    """The synthetic requests' lengths, priorities and aborts."""
    workload = DEFAULT_WORKLOAD
    _integer_flag(
        group,
        "--prompt-len",
        1,
        MAX_REQUEST_TOKENS,
        help=f"mean prompt length (default {workload.prompt_len_mean})",
    )
    _integer_flag(
        group,
        "--prompt-len-max",
        1,
        MAX_REQUEST_TOKENS,
        help=f"longest prompt (default: the larger of {workload.prompt_len_max} and 4 x mean, "
        f"at most {MAX_REQUEST_TOKENS})",
    )
    _integer_flag(
        group,
        "--output-len",
        1,
        MAX_REQUEST_TOKENS,
        help=f"mean output length (default {workload.output_len_mean})",
    )
    _integer_flag(
        group,
        "--output-len-max",
        1,
        MAX_REQUEST_TOKENS,
        help=f"longest output (default: the larger of {workload.output_len_max} and 4 x mean, "
        f"at most {MAX_REQUEST_TOKENS})",
    )
    group.add_argument(
        "--length-dist",
        choices=[d.value for d in LengthDistribution],
        help=f"length distribution (default {workload.length_distribution.value})",
    )
    _integer_flag(
        group,
        "--priority-levels",
        1,
        I32_MAX,
        help=f"priorities drawn from 0..N-1 (default {workload.priority_levels})",
    )
    group.add_argument(
        "--abort-rate",
        type=_fraction,
        metavar="F",
        help="fraction of requests their client aborts, each at a seeded random step between "
        f"its arrival and its earliest possible finish (default {workload.abort_rate})",
    )


def _add_conversation_flags(group: argparse._ArgumentGroup) -> None:
    """A shared system prompt, and requests in conversations of several turns."""
    workload = DEFAULT_WORKLOAD
    _integer_flag(
        group,
        "--shared-prefix-len",
        0,
        MAX_REQUEST_TOKENS,
        help="tokens of a shared system prompt put before the prompts (default 0: none)",
    )
    group.add_argument(
        "--shared-prefix-share",
        type=_fraction,
        metavar="F",
        help="fraction of the requests (of the conversations, with --turns) that start with "
        "the shared system prompt (default 1; needs --shared-prefix-len)",
    )
    _integer_flag(
        group,
        "--turns",
        1,
        MAX_REQUESTS,
        help="requests come in conversations of N turns, each turn's prompt the previous "
        "turn's prompt and answer plus new user tokens of the drawn length; --arrival-rate "
        "is then the rate of new conversations (default 1: no conversations)",
    )
    group.add_argument(
        "--think-steps",
        type=_think_steps,
        metavar="STEPS",
        help="mean of the exponential gap between a turn's earliest finish and the next "
        f"turn's arrival (default {workload.think_steps:g}; needs --turns)",
    )
    group.add_argument(
        "--think-s",
        type=_think_s,
        metavar="SECONDS",
        help="with --request-rate: mean of the exponential gap between a turn's arrival and "
        f"the next turn's, in modelled seconds (default {workload.think_s:g}; needs --turns)",
    )


def _add_run_flags(group: argparse._ArgumentGroup) -> None:
    """How the ranks run, what is compared, and how the report is shown."""
    group.add_argument(
        "--procs",
        action="store_true",
        help="run the ranks as real processes over gloo (needs torch)",
    )
    group.add_argument(
        "--verify-ranks",
        choices=VERIFY_RANKS_MODES,
        help="ranks that run a real scheduler, compared every step: all of them, a sample "
        "(the first and the last) or none (rank 0 alone); the figures are the same "
        f"(default: all up to --cp {VERIFY_ALL_UP_TO_CP}, sample above; --procs: all)",
    )
    group.add_argument(
        "--compare-policies",
        action="store_true",
        help="run the workload under every victim policy and show them side by side; with "
        "--host-tier-tokens also under every suspend policy and without the host tier (each "
        "column compared with its own run without it; a configuration met twice runs once); "
        "with --prefix-caching also once without it (no_prefix_cache)",
    )
    group.add_argument(
        "--overlap",
        action="store_true",
        help="schedule one step ahead, as an overlapping executor does (step t+1 is planned "
        "while step t is pending); the workload also runs without overlap and 'outputs "
        "exact' needs every output to equal that run's",
    )
    group.add_argument(
        "--json", action="store_true", help="print one JSON object instead of the table"
    )
    group.add_argument(
        "--plot",
        metavar="FILE",
        help="draw KV utilisation, running/waiting and the victims (recompute-pauses and "
        "suspensions) per bin of steps (needs matplotlib); "
        "the extension picks the format: .png, .svg, .pdf, ...",
    )
    group.add_argument(
        "--progress",
        dest="progress",
        action="store_true",
        default=None,
        help="force the progress line on stderr (default: only on a terminal, not with --json)",
    )
    group.add_argument(
        "--no-progress", dest="progress", action="store_false", help="never show progress"
    )
    _integer_flag(group, "--max-steps", 1, I64_MAX, help="stop after this many scheduler steps")


def _add_record_flags(group: argparse._ArgumentGroup) -> None:
    """The events file and the step-time model of the figures in ms."""
    group.add_argument(
        "--events",
        metavar="FILE",
        help="write the per-step timeline and per-request outcomes as JSON Lines; with "
        "--compare-policies one file per policy, its name put before the extension "
        "(run.jsonl -> run.newest_first.jsonl); '-' writes them to "
        "stdout, and the report (or --json's object) goes to stderr instead",
    )
    group.add_argument(
        "--step-time",
        type=_step_time,
        metavar="MODEL",
        help="model step times to report latencies in ms: 'default' (illustrative "
        f"coefficients: {DEFAULT_STEP_TIME.describe()}) or FIXED_MS,PER_TOKEN_MS,"
        "PER_KV_TOKEN_MS; a model, not a measurement (default: off)",
    )
    group.add_argument(
        "--step-time-profile",
        metavar="FILE",
        help="the step-time model from a JSON object with fixed_ms, per_token_ms, "
        "per_kv_token_ms and an optional description",
    )


def _add_slo_flags(group: argparse._ArgumentGroup) -> None:
    """The service-level objectives goodput counts against."""
    targets = (
        ("--slo-ttft-ms", "time to first token (from arrival)"),
        ("--slo-tpot-ms", "time per output token after the first"),
    )
    for flag, what in targets:
        group.add_argument(
            flag,
            type=_target_ms,
            metavar="MS",
            help=f"largest {what} in modelled ms a request may take to count towards goodput; "
            "an aborted request never counts (with neither --step-time nor "
            "--step-time-profile, times come from the default step-time model)",
        )


def _scheduler_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    given = {"tokens_per_block": args.tokens_per_block}
    given.update((name, getattr(args, name)) for name in FIELD_FLAGS)
    if args.host_tier_tokens is not None:
        given["host_tier_superblocks"] = _host_tier_superblocks(args)
    return {key: value for key, value in given.items() if value is not None}


def _host_tier_superblocks(args: argparse.Namespace) -> int | None:
    """``--host-tier-tokens`` in superblocks of the layout (the core's), rounded down; ``None``
    when ``--cp`` with ``--tokens-per-block`` is no layout at all (building the configuration
    then refuses them, in the flags' terms)."""
    try:
        tokens_per_superblock = Layout(args.cp, args.tokens_per_block).tokens_per_superblock
    except ConfigError:
        return None
    superblocks: int = args.host_tier_tokens // tokens_per_superblock
    if args.host_tier_tokens > 0 and superblocks == 0:
        raise UsageError(
            f"--host-tier-tokens {args.host_tier_tokens} is less than one superblock "
            f"({tokens_per_superblock} tokens); give at least that"
        )
    if superblocks > U32_MAX:
        raise UsageError(
            f"--host-tier-tokens {args.host_tier_tokens} is more than {U32_MAX} superblocks "
            f"of {tokens_per_superblock} tokens"
        )
    return superblocks


def check_combinations(args: argparse.Namespace) -> None:
    """Reject flags that contradict each other."""
    if args.trace is not None:
        clashing = [
            flag for dest, flag in SYNTHETIC_FLAGS.items() if getattr(args, dest) is not None
        ]
        if clashing:
            names = clashing[0]
            if len(clashing) > 1:
                names = f"{', '.join(clashing[:-1])} and {clashing[-1]}"
            verb = "shapes" if len(clashing) == 1 else "shape"
            raise UsageError(
                f"{names} {verb} the synthetic workload and cannot be combined "
                "with --trace (the trace gives every request)"
            )
    if args.hash_block_tokens is not None and args.trace is None:
        raise UsageError("--hash-block-tokens reads the hash_ids of a --trace; give --trace")
    check_trace_flags(args)
    if args.shared_prefix_share is not None and not args.shared_prefix_len:
        raise UsageError(
            "--shared-prefix-share needs a --shared-prefix-len above 0 (it is the share of "
            "requests that start with the shared system prompt)"
        )
    if args.think_steps is not None and (args.turns or 1) < 2:
        raise UsageError("--think-steps is the gap between turns; give --turns 2 or more")
    if args.request_rate is not None and args.arrival_rate is not None:
        raise UsageError(
            "--arrival-rate (per step) and --request-rate (per second) each give the arrival "
            "rate; give one"
        )
    if args.request_rate is not None and args.think_steps is not None:
        raise UsageError(
            "--think-steps is a gap in steps; with --request-rate (arrivals in time) give --think-s"
        )
    if args.think_s is not None and (args.request_rate is None or (args.turns or 1) < 2):
        raise UsageError(
            "--think-s is the gap between turns in time; give --request-rate and --turns 2 or more"
        )
    if args.procs and args.cp > MAX_PROCS_CP:
        raise UsageError(
            f"--cp {args.cp} with --procs starts {args.cp} processes, each loading torch; "
            f"--procs runs at most {MAX_PROCS_CP} (drop --procs to simulate up to {MAX_CP} "
            "ranks in one process)"
        )
    if args.procs and args.verify_ranks not in (None, "all"):
        raise UsageError(
            f"--verify-ranks {args.verify_ranks} runs some ranks in one process; --procs runs "
            "every rank as its own process and checks them all"
        )
    if args.overlap and args.procs:
        raise UsageError(
            "--overlap runs the ranks in one process (and the workload twice, to compare); "
            "drop --procs"
        )
    if args.compare_policies and args.victim_policy is not None:
        raise UsageError("--compare-policies runs every victim policy; drop --policy")
    if args.compare_policies and args.suspend_policy is not None:
        raise UsageError(
            "--compare-policies runs every suspend policy (with --host-tier-tokens); "
            "drop --suspend-policy"
        )
    if args.acceptance is not None and not args.num_speculative_tokens:
        none = "" if args.num_speculative_tokens is None else " (--spec-tokens 0 proposes none)"
        raise UsageError(
            "--acceptance is the chance that a draft token is accepted; give --spec-tokens N "
            f"(N >= 1) to propose drafts{none}"
        )
    if args.plot is not None:
        parent = Path(args.plot).expanduser().resolve().parent
        if not parent.is_dir():
            raise UsageError(f"--plot {args.plot}: folder {parent} does not exist")
    check_output_combinations(args)


def check_output_combinations(args: argparse.Namespace) -> None:
    """Reject ``--events`` into a missing folder (or ``-`` with several runs), and two
    step-time models."""
    if args.events == STDIO:
        if args.compare_policies:
            raise UsageError(
                "--events - writes one run's events to stdout; --compare-policies runs several "
                "(give a FILE: one file per policy)"
            )
    elif args.events is not None:
        target = Path(args.events).expanduser().resolve()
        parent = target.parent
        if not parent.is_dir():
            raise UsageError(f"--events {args.events}: folder {parent} does not exist")
        if args.trace not in (None, STDIO) and Path(args.trace).resolve() == target:
            raise UsageError(f"--events {args.events} is the --trace file; give another")
    if args.step_time is not None and args.step_time_profile is not None:
        raise UsageError(
            "--step-time and --step-time-profile each give a step-time model; give one"
        )


def service_levels(args: argparse.Namespace) -> ServiceLevels | None:
    """The SLO targets ``--slo-ttft-ms`` and ``--slo-tpot-ms`` give (``None``: neither)."""
    if args.slo_ttft_ms is None and args.slo_tpot_ms is None:
        return None
    return ServiceLevels(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms)


def step_time_model(args: argparse.Namespace) -> StepTimeModel | None:
    """The step-time model the flags ask for (``None``: off; with SLOs and no model given,
    :data:`DEFAULT_STEP_TIME`: goodput needs modelled times); a bad profile is a
    :class:`UsageError` naming the flag and the file."""
    if args.step_time_profile is None:
        model: StepTimeModel | None = args.step_time
        if model is None and service_levels(args) is not None:
            return DEFAULT_STEP_TIME
        return model
    try:
        return load_profile(args.step_time_profile)
    except SimulationSetupError as err:
        raise UsageError(f"--step-time-profile {args.step_time_profile}: {err}") from None


def simulation_options(args: argparse.Namespace) -> SimulationOptions:
    """The options the flags describe (scheduler settings not given are left out)."""
    check_combinations(args)
    return SimulationOptions(
        cp_size=args.cp,
        kv_tokens=args.kv_tokens,
        scheduler=_scheduler_kwargs(args),
        max_steps=args.max_steps,
        procs=args.procs,
        step_time=step_time_model(args),
        verify_ranks=args.verify_ranks,
        overlap=args.overlap,
        drafts=draft_model(args),
    )


def draft_model(args: argparse.Namespace) -> DraftModel | None:
    """The draft model ``--spec-tokens`` and ``--acceptance`` ask for (``None``: no drafts),
    its coins seeded by ``--seed`` (the workload's default seed with ``--trace``)."""
    if not args.num_speculative_tokens:
        return None
    acceptance = DEFAULT_ACCEPTANCE if args.acceptance is None else args.acceptance
    seed = DEFAULT_WORKLOAD.seed if args.seed is None else args.seed
    return DraftModel(args.num_speculative_tokens, acceptance, seed)


def _default_max(default: int, mean: int | None) -> int:
    """The larger of ``default`` and 4 x ``mean``, within the simulator's length limit."""
    return min(MAX_REQUEST_TOKENS, max(default, 4 * (mean or 0)))


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    """The synthetic workload the flags describe (defaults where not given)."""
    defaults = DEFAULT_WORKLOAD

    def pick(value: Any | None, default: Any) -> Any:
        return default if value is None else value

    spec = WorkloadSpec(
        num_requests=pick(args.requests, defaults.num_requests),
        seed=pick(args.seed, defaults.seed),
        arrival_rate=pick(args.arrival_rate, defaults.arrival_rate),
        prompt_len_mean=pick(args.prompt_len, defaults.prompt_len_mean),
        prompt_len_max=pick(
            args.prompt_len_max, _default_max(defaults.prompt_len_max, args.prompt_len)
        ),
        output_len_mean=pick(args.output_len, defaults.output_len_mean),
        output_len_max=pick(
            args.output_len_max, _default_max(defaults.output_len_max, args.output_len)
        ),
        length_distribution=LengthDistribution(
            pick(args.length_dist, defaults.length_distribution.value)
        ),
        priority_levels=pick(args.priority_levels, defaults.priority_levels),
        abort_rate=pick(args.abort_rate, defaults.abort_rate),
        shared_prefix_len=pick(args.shared_prefix_len, defaults.shared_prefix_len),
        shared_prefix_share=pick(args.shared_prefix_share, defaults.shared_prefix_share),
        turns=pick(args.turns, defaults.turns),
        think_steps=pick(args.think_steps, defaults.think_steps),
        request_rate=args.request_rate,
        think_s=pick(args.think_s, defaults.think_s),
    )
    try:
        spec.validate()
    except ValueError as err:
        raise UsageError(str(err)) from None
    return spec


# --- the trace's format and which of its requests to replay ---------------------------------

#: The flags that read a ``--trace`` (beyond ``--hash-block-tokens``), by ``args`` name.
TRACE_FLAGS = {
    "trace_format": "--trace-format",
    "time_scale": "--time-scale",
    "trace_window": "--trace-window",
    "trace_limit": "--trace-limit",
}
#: Largest ``--time-scale``: a trace slowed down a million times is still a trace.
MAX_TIME_SCALE = 1e6


def _time_scale(text: str) -> float:
    value = _number(text)
    if not 0 < value <= MAX_TIME_SCALE:  # also rejects NaN
        raise argparse.ArgumentTypeError(f"must be a number in (0, {MAX_TIME_SCALE:g}], got {text}")
    return value


def _trace_window(text: str) -> tuple[float, float]:
    """``--trace-window START,END`` (seconds; ``START,``: to the end)."""
    start_text, comma, end_text = text.partition(",")
    if not comma:
        raise argparse.ArgumentTypeError(f"expected START,END in seconds, got {text!r}")
    start = _number(start_text)
    end = _number(end_text) if end_text.strip() else math.inf
    if not (math.isfinite(start) and start >= 0):
        raise argparse.ArgumentTypeError(f"START must be a number of seconds >= 0, got {text!r}")
    if not end > start:  # also rejects NaN
        raise argparse.ArgumentTypeError(f"END must be after START, got {text!r}")
    return start, end


def add_trace_flags(group: argparse._ArgumentGroup) -> None:
    """Declare the flags that say how to read a ``--trace`` and which requests to replay."""
    group.add_argument(
        "--trace-format",
        choices=TRACE_FORMATS,
        help="the --trace file's format (default auto: told from its first line): helix (the "
        "JSONL above), azure (Azure LLM inference CSV: TIMESTAMP,ContextTokens,"
        "GeneratedTokens), mooncake (JSONL: timestamp ms, input_length, output_length, "
        "hash_ids), burstgpt (CSV: Timestamp s, Request tokens, Response tokens, Log Type); "
        "the public formats arrive in time, and rows of a failed request or an empty prompt "
        "are skipped and counted",
    )
    group.add_argument(
        "--time-scale",
        type=_time_scale,
        metavar="F",
        help="multiply every arrival time of the --trace by F (below 1 replays it faster: 0.5 "
        "doubles the rate; default 1)",
    )
    group.add_argument(
        "--trace-window",
        type=_trace_window,
        metavar="START,END",
        help="keep the --trace rows that arrive in [START, END) seconds after its earliest row "
        "(its own time, before --time-scale; 'START,' to the end)",
    )
    _integer_flag(
        group,
        "--trace-limit",
        1,
        I64_MAX,
        help="replay only the first N requests of the --trace (in arrival order, after the "
        "window and the skipped rows)",
    )


def check_trace_flags(args: argparse.Namespace) -> None:
    """The trace flags need a ``--trace``."""
    if args.trace is None:
        given = [flag for dest, flag in TRACE_FLAGS.items() if getattr(args, dest) is not None]
        if given:
            raise UsageError(f"{given[0]} reads a --trace; give --trace")


def trace_selection(args: argparse.Namespace) -> TraceSelection:
    """Which of the ``--trace`` requests to replay, and how fast."""
    return TraceSelection(
        time_scale=args.time_scale if args.time_scale is not None else 1.0,
        window_s=args.trace_window,
        limit=args.trace_limit,
    )
