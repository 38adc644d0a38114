"""The resolved settings of a simulation and the checks made before it starts.

Scheduler settings the user did not give are left out of :attr:`SimulationOptions.scheduler`
so the core's defaults apply; the report shows the resolved values from
``SchedulerConfig.to_dict()``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from helix_kv._core import ConfigField, Scheduler, SchedulerConfig
from helix_kv._renamed import Renamed, renamed_fields, renamed_keywords
from helix_kv.errors import ConfigError, HelixKVError
from helix_kv.errors import SimulationSetupError as SimulationSetupError  # also from here
from helix_kv.simulate.drafts import DraftModel
from helix_kv.simulate.timing import StepTimeModel
from helix_kv.simulate.workload import MAX_REQUEST_TOKENS as _MAX_REQUEST_TOKENS
from helix_kv.simulate.workload import RequestSpec
from helix_kv.types import CapacityPolicy, ServingMode, SuspendPolicy, VictimPolicy

#: Victim policies, in the order ``--compare-policies`` runs them (the core's names; the
#: ``Literal`` aliases of :mod:`helix_kv.types` are checked against them by a test).
VICTIM_POLICIES: tuple[VictimPolicy, ...] = SchedulerConfig.VICTIM_POLICIES
CAPACITY_POLICIES: tuple[CapacityPolicy, ...] = SchedulerConfig.CAPACITY_POLICIES
#: Suspend policies, in the order ``--compare-policies`` runs them with a host tier.
SUSPEND_POLICIES: tuple[SuspendPolicy, ...] = SchedulerConfig.SUSPEND_POLICIES
#: The ``--compare-policies`` column of the run without the host tier (recompute only).
RECOMPUTE_ONLY = "no_host_tier"
#: The ``--compare-policies`` column of the run without prefix caching (with it on).
NO_PREFIX_CACHE = "no_prefix_cache"
#: The columns of runs made to compare with (not a policy of their own).
BASELINES = (RECOMPUTE_ONLY, NO_PREFIX_CACHE)
SERVING_MODES: tuple[ServingMode, ...] = SchedulerConfig.SERVING_MODES

_PREFLIGHT_BATCH = 256

VerifyRanks = Literal["all", "sample", "none"]
#: ``--verify-ranks`` modes: which ranks of the group get a real scheduler, compared every step.
VERIFY_RANKS_MODES: tuple[VerifyRanks, ...] = ("all", "sample", "none")
VERIFY_ALL_UP_TO_CP = 8
"""Groups of at most this many ranks verify every rank by default; larger ones ``sample``
(every scheduler holds every request's tokens, so time and memory grow with the ranks run)."""

# Limits of the simulator, checked before anything is allocated (the flags in
# :mod:`.arguments`, the pool and the trace's lengths here). An upper bound is either the width
# of the core field a flag feeds, so the core never sees a value it cannot hold, or a bound on
# what one simulating process can hold. docs/user-guide.md lists them.
MAX_CP = 256
"""Ranks in one process (one scheduler each)."""
MAX_PROCS_CP = 64
"""Ranks with ``--procs`` (one process each, each loading torch)."""
MAX_REQUESTS = 1_000_000
"""Requests of a synthetic workload."""
MAX_REQUEST_TOKENS = _MAX_REQUEST_TOKENS
"""Longest prompt or output of a request, in tokens (synthetic or from a trace; the trace
reader refuses a longer one on its line)."""
MAX_KV_SUPERBLOCKS = 1 << 22
"""Largest KV pool, in superblocks: every rank's ledger allocates a few bytes per superblock
when it is built (4 MiB-superblock pools already cost tens of MB per rank)."""
MIN_ARRIVAL_RATE = 1e-6
"""Smallest non-zero ``--arrival-rate``: arrival steps must stay well within int64."""
I32_MAX = (1 << 31) - 1
U32_MAX = (1 << 32) - 1
I64_MAX = (1 << 63) - 1
U64_MAX = (1 << 64) - 1

#: ``SchedulerConfig`` fields (``SchedulerConfig.FIELDS``) whose ``helix-kv simulate`` flag is
#: not ``--<name-with-dashes>``; ``None``: no flag sets the field's value as such. Every other
#: field, one added to the core included, gets ``--<name-with-dashes>``
#: (:func:`helix_kv.simulate.arguments.add_simulate_arguments`).
FLAG_NAMES: dict[str, str | None] = {
    "cp_size": "--cp",
    "cp_rank": None,  # one scheduler per rank
    "capacity_superblocks": None,  # --kv-tokens, in global tokens (TOKEN_FLAGS)
    "enable_chunked_prefill": "--no-chunked-prefill",
    "host_tier_superblocks": None,  # --host-tier-tokens, in global tokens (TOKEN_FLAGS)
    "serving_mode": "--mode",
    "victim_policy": "--policy",
    "max_preemptions_per_request": "--max-preemptions",
    "enable_prefix_caching": "--prefix-caching",
    "num_speculative_tokens": "--spec-tokens",
}


#: ``SchedulerConfig`` fields the report's ``config.scheduler`` shows only when they differ from
#: their default (options added after the report took its form, off by default), so the report
#: of a run without them is unchanged, as with ``step_time_model``, ``overlap`` and ``drafts``.
SHOWN_WHEN_SET = (
    "long_prefill_token_threshold",
    "long_prefill_token_threshold_adaptive",
    "admission_policy",
)


def scheduler_flag(field: ConfigField) -> str | None:
    """The ``helix-kv simulate`` flag that sets ``field`` (``None``: none sets it as such)."""
    return FLAG_NAMES.get(field.name, "--" + field.name.replace("_", "-"))


#: ``SchedulerConfig`` fields counted in superblocks whose ``helix-kv simulate`` flag takes
#: global tokens (rounded down to whole superblocks), by field (``kv_superblocks`` is the core's
#: name of ``capacity_superblocks`` in its keywords and messages); the flags are declared by
#: hand (:func:`helix_kv.simulate.arguments.add_simulate_arguments`) under these names.
TOKEN_FLAGS = {
    "capacity_superblocks": "--kv-tokens",
    "kv_superblocks": "--kv-tokens",
    "host_tier_superblocks": "--host-tier-tokens",
}

#: ``SchedulerConfig`` fields as the ``helix-kv simulate`` flags that give their value, so that
#: a core message reads in the user's terms (a switch's flag gives no value).
FLAG_OF_FIELD = {
    "kv_tokens": TOKEN_FLAGS["kv_superblocks"],
    **{
        field.name: flag
        for field in SchedulerConfig.FIELDS
        if field.type != "bool" and (flag := scheduler_flag(field)) is not None
    },
}
#: Every ``SchedulerConfig`` setting a core message may name, as the ``helix-kv simulate`` flag
#: that sets it: a count of superblocks as its flag in tokens "in superblocks" (a count beside
#: it stays one; ``kv_superblocks``, the keyword the messages pair with ``kv_tokens``, as the
#: one flag of the two); the switches, and the settings no flag gives, keep their names.
FLAG_TERMS: dict[str, str] = {
    **FLAG_OF_FIELD,
    **{name: f"{flag} in superblocks" for name, flag in TOKEN_FLAGS.items()},
    "kv_superblocks": TOKEN_FLAGS["kv_superblocks"],
}
# a word (a setting's name where FLAG_TERMS has it), and a value the core gives it as ="..."
_WORD = re.compile(r'(\w+)(?:="([^"]*)")?')


@renamed_fields
@dataclass(frozen=True)
class SimulationOptions:
    """What to simulate, apart from the workload.

    ``scheduler`` holds ``helix_kv.SchedulerConfig`` keyword arguments other than
    ``cp_size``, ``cp_rank`` and the capacity, which come from ``cp_size`` (``--cp``), each
    rank's place and ``kv_tokens``. ``cp`` is the deprecated name of ``cp_size`` (kept for
    one release).
    """

    cp_size: int = 2
    kv_tokens: int = 16_384
    scheduler: dict[str, Any] = field(default_factory=dict)
    max_steps: int | None = None
    procs: bool = False
    step_time: StepTimeModel | None = None
    """The step-time model turning steps into modelled milliseconds (``None``: off)."""
    overlap: bool = False
    """Schedule one step ahead (step t+1 planned while step t is pending)."""
    verify_ranks: VerifyRanks | None = None
    """Which ranks run a real scheduler (:func:`verified_ranks`); ``None``: ``all`` up to
    :data:`VERIFY_ALL_UP_TO_CP` ranks (and always with ``procs``), ``sample`` above."""
    drafts: DraftModel | None = None
    """Speculative decoding's draft model (``--spec-tokens K --acceptance P``); its
    ``num_tokens`` is the scheduler's ``num_speculative_tokens``. ``None``: no drafts."""

    cp = Renamed[int]("cp_size")

    @property
    def verify_mode(self) -> VerifyRanks:
        """``verify_ranks`` with the default applied."""
        if self.verify_ranks is not None:
            return self.verify_ranks
        return "all" if self.procs or self.cp_size <= VERIFY_ALL_UP_TO_CP else "sample"

    def verified_ranks(self) -> tuple[int, ...]:
        """The ranks run and compared every step, in order (see :func:`verified_ranks`)."""
        return verified_ranks(self.verify_mode, self.cp_size)

    @renamed_keywords(rank="cp_rank")
    def scheduler_config(self, cp_rank: int = 0) -> SchedulerConfig:
        """The ``helix_kv.SchedulerConfig`` of rank ``cp_rank`` (``rank``: its deprecated
        name, kept for one release); raises ``helix_kv.ConfigError``."""
        return SchedulerConfig(
            cp_size=self.cp_size, cp_rank=cp_rank, kv_tokens=self.kv_tokens, **self.scheduler
        )

    def with_victim_policy(self, policy: VictimPolicy) -> SimulationOptions:
        """The same options under another victim policy."""
        return dataclasses.replace(self, scheduler={**self.scheduler, "victim_policy": policy})

    def with_suspend_policy(self, policy: SuspendPolicy) -> SimulationOptions:
        """The same options under another suspend policy."""
        return dataclasses.replace(self, scheduler={**self.scheduler, "suspend_policy": policy})

    def without_host_tier(self) -> SimulationOptions:
        """The same options with no host tier: every victim is recompute-paused (so no suspend
        policy applies: it is left to the default, and the runs of every suspend policy have
        one baseline)."""
        scheduler = {**self.scheduler, "host_tier_superblocks": 0}
        scheduler.pop("suspend_policy", None)
        return dataclasses.replace(self, scheduler=scheduler)

    def without_prefix_caching(self) -> SimulationOptions:
        """The same options with prefix caching off: every prompt token is computed."""
        return dataclasses.replace(
            self, scheduler={**self.scheduler, "enable_prefix_caching": False}
        )

    @property
    def has_prefix_caching(self) -> bool:
        """Whether the scheduler caches prefixes."""
        return bool(self.scheduler.get("enable_prefix_caching", False))

    @property
    def has_host_tier(self) -> bool:
        """Whether the scheduler gets a host tier to suspend to."""
        return int(self.scheduler.get("host_tier_superblocks", 0)) > 0

    def resolved(self, workload_info: dict[str, Any]) -> dict[str, Any]:
        """The configuration as run: the report's ``config`` object."""
        config = self.scheduler_config()
        resolved: dict[str, Any] = {
            "cp": self.cp_size,  # the report's key is the --cp flag's name
            "kv_tokens": self.kv_tokens,
            # what the pool holds: kv_tokens rounded down to whole superblocks, by the core
            "kv_tokens_effective": int(config.kv_tokens),
            "procs": self.procs,
            "verify_ranks": self.verify_mode,
            "verified_ranks": list(self.verified_ranks()),
            "max_steps": self.max_steps,
            "scheduler": {
                name: value
                for name, value in config.to_dict().items()
                if name not in SHOWN_WHEN_SET or value != SchedulerConfig.DEFAULTS[name]
            },
            "workload": workload_info,
        }
        if self.step_time is not None:  # only then: the report without a model is unchanged
            resolved["step_time_model"] = self.step_time.to_dict()
        if self.overlap:  # likewise
            resolved["overlap"] = True
        if self.drafts is not None:  # likewise
            resolved["drafts"] = self.drafts.to_dict()
        return resolved


@renamed_keywords(cp="cp_size")
def verified_ranks(mode: VerifyRanks, cp_size: int) -> tuple[int, ...]:
    """The ranks a ``mode`` runs (one real scheduler each) and compares every step, in a
    group of ``cp_size`` ranks (``cp``: its deprecated name, kept for one release).

    ``all``: every rank. ``sample``: the first and the last rank, the two ends of every
    per-rank length (the layout deals each superblock's pages out from rank 0, so rank 0 holds
    the most tokens of a request and the last rank the fewest). ``none``: rank 0 alone,
    nothing compared.
    """
    if mode == "all":
        return tuple(range(cp_size))
    if mode == "sample":
        return (0, cp_size - 1) if cp_size > 1 else (0,)
    if mode == "none":
        return (0,)
    raise ValueError(f"verify_ranks must be one of {VERIFY_RANKS_MODES}, got {mode!r}")


def in_flag_terms(error: BaseException) -> str:
    """The message of a core error (a ``ConfigError``, or a scheduler error's remedy) in the
    ``helix-kv simulate`` flags' terms, on one line: each ``SchedulerConfig`` setting it names
    by its flag (:data:`FLAG_TERMS`, looked up word by word; ``capacity_policy="x"`` reads
    ``--capacity-policy x``), and the setting at fault (``ConfigError.field``) with its value
    as its flag takes it: ``max_num_tokens = 8`` reads ``--max-num-tokens 8``,
    ``host_tier_superblocks = 4`` reads ``--host-tier-tokens (4 superblocks)``."""
    message = " ".join(str(error).split())
    if isinstance(error, ConfigError) and error.field in FLAG_TERMS:
        given = _flag_with_value(error.field, error.value)
        message = message.replace(f"{error.field} = {error.value}", given, 1)

    def flag(word: re.Match[str]) -> str:
        name, value = word[1], word[2]
        if name not in FLAG_TERMS:
            return word[0]
        return FLAG_TERMS[name] if value is None else f"{FLAG_TERMS[name]} {value}"

    message = _WORD.sub(flag, message)
    # the KV budget, named by both of its keywords, has one flag
    kv_tokens = TOKEN_FLAGS["kv_superblocks"]
    return message.replace(f"{kv_tokens} / {kv_tokens}", kv_tokens)


def _flag_with_value(field: str, value: object) -> str:
    """``field`` set to ``value`` as the flag that gives it (a count of superblocks stays
    one beside its flag in tokens)."""
    if field in TOKEN_FLAGS:
        return f"{TOKEN_FLAGS[field]} " + ("0" if value == 0 else f"({value} superblocks)")
    return f"{FLAG_TERMS[field]} {value}"


#: ``SchedulerConfig``'s ``tokens_per_block`` when the options leave it out.
_DEFAULT_TOKENS_PER_BLOCK: int = SchedulerConfig(kv_superblocks=1).tokens_per_block


def check_config(options: SimulationOptions) -> None:
    """Build the configuration once (nothing is allocated) and check the pool is within the
    simulator's limit; turn a ``ConfigError`` into a setup error in the flags' terms."""
    # The simulator's own limit first, whatever the core's limits (a pool past 2**32 or
    # 2**31 superblocks) would say: one message gives the real largest --kv-tokens.
    tokens_per_block = options.scheduler.get("tokens_per_block", _DEFAULT_TOKENS_PER_BLOCK)
    per_superblock = tokens_per_block * options.cp_size if tokens_per_block > 0 else 0
    if per_superblock > 0 and options.kv_tokens // per_superblock > MAX_KV_SUPERBLOCKS:
        raise SimulationSetupError(
            f"--kv-tokens {options.kv_tokens} is {options.kv_tokens // per_superblock} "
            f"superblocks of {per_superblock} tokens; the simulator holds at most "
            f"{MAX_KV_SUPERBLOCKS} superblocks (--kv-tokens {MAX_KV_SUPERBLOCKS * per_superblock} "
            "with this --cp and --tokens-per-block)"
        )
    try:
        options.scheduler_config()
    except ConfigError as err:
        raise SimulationSetupError(in_flag_terms(err)) from None


def preflight(options: SimulationOptions, workload: Sequence[RequestSpec]) -> None:
    """Add every request to a throwaway scheduler so a request that can never run is
    reported before the run starts, with the core's own reason (``RequestTooLargeError``:
    longer than ``max_seq_len`` or the whole KV pool, or an unchunked re-prefill that
    cannot fit ``max_num_tokens``).

    Those reasons read the lengths, never the tokens, so each request is added with a
    prompt of zeros of its length and prefix caching off: the prompts are built once, for the
    run, and hashed only by its schedulers."""
    config = options.without_prefix_caching().scheduler_config()
    for request in workload:
        # checked before any prompt is built: a trace may give lengths up to 2**31
        longest = max(request.prompt_len, request.output_len)
        if longest > MAX_REQUEST_TOKENS:
            raise SimulationSetupError(
                f"the workload cannot run: request {request.request_id} has "
                f"{request.prompt_len} prompt and {request.output_len} output tokens; the "
                f"simulator takes at most {MAX_REQUEST_TOKENS} of each"
            )
    zeros = np.zeros(max((request.prompt_len for request in workload), default=0), np.int32)
    for start in range(0, len(workload), _PREFLIGHT_BATCH):
        scheduler = Scheduler(config)
        for request in workload[start : start + _PREFLIGHT_BATCH]:
            try:
                scheduler.add_request(
                    request.request_id,
                    zeros[: request.prompt_len],
                    request.output_len,
                    request.priority,
                    cache_salt=request.cache_salt,
                )
            except HelixKVError as err:
                raise SimulationSetupError(
                    f"the workload cannot run: {_one_line(str(err))}"
                ) from None


def _one_line(text: str) -> str:
    return " ".join(text.split())
