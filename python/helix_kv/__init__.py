"""helix_kv: a rank-invariant paged KV ledger and preemptive scheduler for Helix
(context-parallel) decoding.

The ledger, victim selection and every ordering decision live in Rust (``helix_kv._core``);
this package re-exports them. Every exception is in :mod:`helix_kv.errors` (the core's and the
group errors are re-exported here too); the scheduler contract that :class:`Scheduler`,
:class:`SimulatedCPGroup` and ``helix_kv.distributed.HelixKVRank`` share is
:class:`helix_kv.contract.SchedulerProtocol`, and :class:`StepDriver` drives it for an executor
(plain or one step ahead). ``import helix_kv`` never imports torch: the torch pieces live in
``helix_kv.executor`` and ``helix_kv.distributed`` and are imported on demand.
"""

from helix_kv._core import (
    DECODE_ROW_COLUMNS,
    DECODE_ROW_PADDING,
    ConfigField,
    DecodeRowCounts,
    DecodeView,
    Layout,
    Ledger,
    RequestHoldings,
    RequestMetrics,
    RequestOutput,
    ScheduleOutput,
    Scheduler,
    SchedulerConfig,
    SchedulerMetrics,
    StepMetadata,
    StepMetadataLayout,
    __version__,
)
from helix_kv.cpgroup import SimulatedCPGroup
from helix_kv.errors import (
    ConfigError,
    ConfigGuardError,
    ConfigMismatchError,
    DeadlockError,
    DuplicateRequestError,
    EngineOptionError,
    HelixKVError,
    InitSyncError,
    InvalidArgumentError,
    InvalidLengthError,
    InvalidStateError,
    InvalidTypeError,
    PreemptionDisabledError,
    RequestTooLargeError,
    ScheduleMismatchError,
    UnknownRequestError,
)
from helix_kv.step_driver import PendingStep, StepDriver
from helix_kv.step_metadata import StepMetadataViews, new_step_metadata_buffer, step_metadata_views

__all__ = [
    "DECODE_ROW_COLUMNS",
    "DECODE_ROW_PADDING",
    "ConfigError",
    "ConfigField",
    "ConfigGuardError",
    "ConfigMismatchError",
    "DeadlockError",
    "DecodeRowCounts",
    "DecodeView",
    "DuplicateRequestError",
    "EngineOptionError",
    "HelixKVError",
    "InitSyncError",
    "InvalidArgumentError",
    "InvalidLengthError",
    "InvalidStateError",
    "InvalidTypeError",
    "Layout",
    "Ledger",
    "PendingStep",
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
    "StepDriver",
    "StepMetadata",
    "StepMetadataLayout",
    "StepMetadataViews",
    "UnknownRequestError",
    "__version__",
    "new_step_metadata_buffer",
    "step_metadata_views",
]
