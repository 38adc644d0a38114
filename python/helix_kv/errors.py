"""Every helix_kv exception, in one namespace, each class defined once.

- The Rust core's errors: one class per core error kind, plus :class:`InvalidTypeError` for
  the binding's type checks, created by the extension (``helix_kv._core``) under
  :class:`HelixKVError` and re-exported here unchanged: the extension defines only classes
  that Rust raises (and their base). :class:`ConfigError` carries the setting at fault as
  data, ``field`` and ``value`` (keywords of its constructor), as every subclass does.
- The group errors, which only the Python layer raises, defined here: the ones with
  structured attributes (:class:`ScheduleMismatchError`, :class:`InitSyncError` and its
  ``InitSync*`` subclasses) set them in their one constructor, declared with their types
  below; :class:`ConfigGuardError` and :class:`ConfigMismatchError` carry a message.
- The command line's errors (``helix-kv simulate``): usage, setup, trace, plot and ``--procs``
  errors. They do not derive from :class:`HelixKVError`: they are about the tool's input
  and environment, not the scheduler; the CLI turns them into exit status 2 (1 for
  :class:`RankFailedError`).

``helix_kv`` re-exports the core and group errors; the modules that raise an error also keep
it importable under their own name (``helix_kv.distributed.InitSyncConfigError``,
``helix_kv.simulate.workload.TraceError``...). No two classes share a name. The hierarchy and
each error's meaning are in ``docs/errors.md``.

The structured errors pickle with their attributes (a ``--procs`` rank hands its error to the
parent that way).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from helix_kv._core import (
    ConfigError,
    DeadlockError,
    DuplicateRequestError,
    HelixKVError,
    InvalidArgumentError,
    InvalidLengthError,
    InvalidStateError,
    InvalidTypeError,
    PreemptionDisabledError,
    RequestTooLargeError,
    UnknownRequestError,
)

__all__ = [
    "CheckpointError",
    "ConfigError",
    "ConfigGuardError",
    "ConfigMismatchError",
    "DeadlockError",
    "DuplicateRequestError",
    "EngineOptionError",
    "HelixKVError",
    "InitSyncConfigError",
    "InitSyncConfigGuardError",
    "InitSyncConfigMismatchError",
    "InitSyncError",
    "InvalidArgumentError",
    "InvalidLengthError",
    "InvalidStateError",
    "InvalidTypeError",
    "PlotUnavailableError",
    "PreemptionDisabledError",
    "ProcsUnavailableError",
    "RankFailedError",
    "RequestTooLargeError",
    "ScheduleMismatchError",
    "SimulationSetupError",
    "TraceError",
    "UnknownRequestError",
    "UsageError",
]


# -- group errors (raised by the Python layer only) -----------------------------------------


class ConfigGuardError(HelixKVError):
    """A configuration is rejected under the chosen serving mode (an engine option that would
    break rank invariance under aggregated Helix); every violated guard is listed in the
    message. Raised by :func:`helix_kv.distributed.check_config_guards`."""


class ConfigMismatchError(ConfigError):
    """The ranks of a CP group were built from different configurations (raised as
    :class:`InitSyncConfigMismatchError`, which carries the ranks and fields)."""


class EngineOptionError(ConfigError):
    """A serving engine's option (or a combination of options) that helix_kv cannot serve,
    refused when the engine builds its scheduler (``helix_kv.integrations.vllm``).

    Attributes:
        engine: the engine, ``"vllm"``.
        option: the option as the engine's users set it (``"enable_lora"``,
            ``"kv_transfer_config"``, ``"policy"``...); also its ``field``, as on every
            :class:`ConfigError` (``None`` where no option is named).
        value: its value, as text.
        reason: why helix_kv cannot serve it, and what to do instead.
    """

    engine: str
    option: str
    value: str
    reason: str

    def __init__(
        self, message: str, *, engine: str = "", option: str = "", value: str = "", reason: str = ""
    ) -> None:
        super().__init__(message, field=option or None, value=value)
        self.engine = engine
        self.option = option
        self.reason = reason


class ScheduleMismatchError(HelixKVError):
    """CP ranks made different scheduling decisions, or ended the same call differently.

    Raised by :class:`helix_kv.SimulatedCPGroup` and, on every rank of a real group, by
    :class:`helix_kv.distributed.ScheduleChecker`.

    Attributes:
        step: the step whose schedules differ; ``None`` when a call other than
            ``schedule()`` ended differently on the ranks.
        ranks: the ranks that differ (from rank 0 in a simulated group; from the largest
            agreeing set of ranks in a real one).
        fields: the names of the fields that differ.
        summaries: ``{rank: ScheduleOutput.summary()}`` of every rank, when the step's
            schedules were compared (empty otherwise).
    """

    step: int | None
    ranks: list[int]
    fields: list[str]
    summaries: dict[int, str]

    def __init__(
        self,
        message: str,
        *,
        step: int | None = None,
        ranks: Iterable[int] = (),
        fields: Iterable[str] = (),
        summaries: Mapping[int, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.step = step
        self.ranks = [int(rank) for rank in ranks]
        self.fields = list(fields)
        self.summaries = dict(summaries or {})


class InitSyncError(HelixKVError):
    """Construction failed on at least one rank of the CP group, so every rank raises.

    Raised by :meth:`helix_kv.distributed.HelixKVRank.create`; ``__cause__`` is this rank's
    own failure, if it had one.

    Attributes:
        failed_ranks: the ranks whose construction failed (empty when a peer was lost before
            the ranks could report: it died or did not reach the sync in time).
        reasons: ``{rank: "ErrorClass: message"}`` of every failed rank.
    """

    failed_ranks: list[int]
    reasons: dict[int, str]

    def __init__(
        self,
        message: str,
        *,
        failed_ranks: Iterable[int] = (),
        reasons: Mapping[int, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.failed_ranks = [int(rank) for rank in failed_ranks]
        self.reasons = dict(reasons or {})


class InitSyncConfigGuardError(InitSyncError, ConfigGuardError):
    """Every failing rank was stopped by a configuration guard (catch either class)."""


class InitSyncConfigError(InitSyncError, ConfigError):
    """Every failing rank had an invalid configuration (catch either class)."""


class InitSyncConfigMismatchError(InitSyncError, ConfigMismatchError):
    """The ranks were built from different configurations (catch either class).

    Attributes:
        ranks: the ranks outside the largest agreeing set (ties: the set holding the lowest
            rank), plus any rank whose ``cp_rank``/``cp_size`` is not its place in the
            process group.
        fields: ``{field: {rank: value}}`` for every field that differs (every rank's value).
        failed_ranks, reasons: as on every :class:`InitSyncError` (``failed_ranks`` are the
            ``ranks``).
    """

    ranks: list[int]
    fields: dict[str, dict[int, Any]]

    def __init__(
        self,
        message: str,
        *,
        ranks: Iterable[int] = (),
        fields: Mapping[str, Mapping[int, Any]] | None = None,
        reasons: Mapping[int, str] | None = None,
    ) -> None:
        ranks = [int(rank) for rank in ranks]
        super().__init__(message, failed_ranks=ranks, reasons=reasons)
        self.ranks = ranks
        self.fields = {name: dict(values) for name, values in (fields or {}).items()}


# -- errors of the ``helix-kv simulate`` command line ------------------------------------


class UsageError(Exception):
    """Invalid command-line arguments; the message is one line.

    ``prog`` is the command the message is about (printed before it).
    """

    prog: str

    def __init__(self, message: str, prog: str = "helix-kv simulate") -> None:
        super().__init__(message)
        self.prog = prog


class SimulationSetupError(ValueError):
    """The settings or the workload cannot be run; the message is one line."""


class TraceError(ValueError):
    """A trace file that cannot be used; the message names the file and, if any, the line.

    Attributes:
        path: the trace file.
        line_number: the line at fault (``None``: the file as a whole).
        reason: the message without the file and line.
    """

    path: str
    line_number: int | None
    reason: str

    def __init__(self, path: str | Path, message: str, line_number: int | None = None) -> None:
        self.path = str(path)
        self.line_number = line_number
        self.reason = message
        where = f"{self.path} line {line_number}" if line_number is not None else self.path
        super().__init__(f"trace {where}: {message}")


class CheckpointError(ValueError):
    """A model checkpoint directory the executor cannot load (``python -m helix_kv.executor
    --model DIR``); the message names the directory and the field or tensor at fault.

    Attributes:
        path: the checkpoint directory.
        name: the ``config.json`` field, file or tensor at fault (``None``: the directory).
        reason: the message without the directory and the name.
    """

    path: str
    name: str | None
    reason: str

    def __init__(self, path: str | Path, reason: str, name: str | None = None) -> None:
        self.path = str(path)
        self.name = name
        self.reason = reason
        where = f"{self.path}: {name}" if name is not None else self.path
        super().__init__(f"checkpoint {where}: {reason}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.path, self.reason, self.name))


class PlotUnavailableError(RuntimeError):
    """matplotlib is not installed, or it cannot write the format the file name asks for."""


class ProcsUnavailableError(RuntimeError):
    """torch (with torch.distributed) is not available for ``--procs``."""


class RankFailedError(RuntimeError):
    """A rank process failed without a typed helix_kv error (a crash, a torch error)."""
