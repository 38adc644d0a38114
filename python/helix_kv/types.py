"""Type aliases of the helix_kv API, in one place: the option strings the Rust core accepts
and the array arguments it converts.

The stub of the extension (``_core.pyi``) and the Python layer both use them. The option
aliases are ``Literal`` types, so their values are also available at run time::

    typing.get_args(VictimPolicy)  # ('newest_first', 'least_computed_first', 'priority')

An option outside its alias is still rejected at run time by the core (a ``ConfigError``
naming the accepted values); the aliases let a type checker catch it first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Union

import numpy as np
import numpy.typing as npt

__all__ = [
    "AdmissionPolicy",
    "CapacityPolicy",
    "FinishReason",
    "FlagArray",
    "IntArray",
    "RequestState",
    "ServingMode",
    "SuspendPolicy",
    "TokenArray",
    "VictimPolicy",
]

# Runtime aliases (module-level expressions, evaluated on Python 3.9): ``Union``, not ``|``.

#: The queue's order: arrival, or priority then arrival (``SchedulerConfig.admission_policy``).
AdmissionPolicy = Literal["fcfs", "priority"]
#: Which running request a KV-starved request preempts (``SchedulerConfig.victim_policy``).
VictimPolicy = Literal["newest_first", "least_computed_first", "priority"]
#: Whether a victim the host tier has room for is suspended or recompute-paused
#: (``SchedulerConfig.suspend_policy``).
SuspendPolicy = Literal["suspend_first", "recompute_first", "cost"]
#: How admission reserves KV (``SchedulerConfig.capacity_policy``).
CapacityPolicy = Literal["max_utilization", "guaranteed_no_evict"]
#: The serving mode (``SchedulerConfig.serving_mode``).
ServingMode = Literal["aggregated_helix", "non_helix", "disaggregated_generation"]
#: Why a request finished (``RequestOutput.finish_reason``).
FinishReason = Literal["length", "eos", "aborted"]
#: Where a live request is (``Scheduler.request_state``).
RequestState = Literal["waiting", "prefilling", "decoding", "suspended"]

# Argument rules (docs/errors.md): integers are ints or numpy integer scalars, never bools,
# floats or strings; arrays are 1-D numpy arrays of an integer dtype or sequences of ints.
# Request ids are 0..2**64-1, lengths/positions/counts 0..2**63-1, token ids int32.

#: Request ids, lengths, positions or counts.
IntArray = Union[npt.NDArray[np.integer], Sequence[int]]
#: Token ids (each must fit int32).
TokenArray = Union[npt.NDArray[np.integer], Sequence[int]]
#: End-of-sequence flags: bools, or integers that are 0 or 1.
FlagArray = Union[npt.NDArray[np.bool_], npt.NDArray[np.integer], Sequence[Union[bool, int]]]
