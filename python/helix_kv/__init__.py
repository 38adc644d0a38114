"""helix_kv: a rank-invariant paged KV ledger and preemptive scheduler for Helix
(context-parallel) decoding.

The ledger, victim selection and every ordering decision live in Rust (``helix_kv._core``);
this package re-exports them. ``import helix_kv`` never imports torch: the torch pieces live in
``helix_kv.executor`` and ``helix_kv.distributed`` and are imported on demand.
"""

from helix_kv._core import (
    ConfigError,
    ConfigGuardError,
    ConfigMismatchError,
    DeadlockError,
    DecodeView,
    DuplicateRequestError,
    HelixKVError,
    InitSyncError,
    InvalidArgumentError,
    InvalidLengthError,
    InvalidStateError,
    InvalidTypeError,
    Layout,
    Ledger,
    PreemptionDisabledError,
    RequestHoldings,
    RequestMetrics,
    RequestOutput,
    RequestTooLargeError,
    ScheduleMismatchError,
    ScheduleOutput,
    Scheduler,
    SchedulerConfig,
    SchedulerMetrics,
    UnknownRequestError,
    __version__,
)
from helix_kv.cpgroup import SimulatedCPGroup

__all__ = [
    "ConfigError",
    "ConfigGuardError",
    "ConfigMismatchError",
    "DeadlockError",
    "DecodeView",
    "DuplicateRequestError",
    "HelixKVError",
    "InitSyncError",
    "InvalidArgumentError",
    "InvalidLengthError",
    "InvalidStateError",
    "InvalidTypeError",
    "Layout",
    "Ledger",
    "PreemptionDisabledError",
    "RequestHoldings",
    "RequestMetrics",
    "RequestOutput",
    "RequestTooLargeError",
    "ScheduleMismatchError",
    "ScheduleOutput",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerMetrics",
    "SimulatedCPGroup",
    "UnknownRequestError",
    "__version__",
]
