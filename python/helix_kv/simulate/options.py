"""The resolved settings of a simulation and the checks made before it starts.

Scheduler settings the user did not give are left out of :attr:`SimulationOptions.scheduler`
so the core's defaults apply; the report shows the resolved values from
``SchedulerConfig.to_dict()``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from helix_kv.simulate.tokens import prompt_tokens
from helix_kv.simulate.workload import RequestSpec

#: Victim policies, in the order ``--compare-policies`` runs them.
VICTIM_POLICIES = ("newest_first", "least_computed_first", "priority")
CAPACITY_POLICIES = ("max_utilization", "guaranteed_no_evict")
SERVING_MODES = ("aggregated_helix", "non_helix", "disaggregated_generation")

_PREFLIGHT_BATCH = 256


class SimulationSetupError(ValueError):
    """The settings or the workload cannot be run; the message is one line."""


@dataclass(frozen=True)
class SimulationOptions:
    """What to simulate, apart from the workload.

    ``scheduler`` holds ``helix_kv.SchedulerConfig`` keyword arguments other than
    ``cp_size``, ``cp_rank`` and the capacity, which come from ``cp`` and ``kv_tokens``.
    """

    cp: int = 2
    kv_tokens: int = 16_384
    scheduler: dict[str, Any] = field(default_factory=dict)
    max_steps: Optional[int] = None
    procs: bool = False

    def scheduler_config(self, rank: int = 0) -> Any:
        """The ``helix_kv.SchedulerConfig`` of ``rank``; raises ``helix_kv.ConfigError``."""
        from helix_kv import SchedulerConfig

        return SchedulerConfig(
            cp_size=self.cp, cp_rank=rank, kv_tokens=self.kv_tokens, **self.scheduler
        )

    def with_victim_policy(self, policy: str) -> SimulationOptions:
        """The same options under another victim policy."""
        return dataclasses.replace(self, scheduler={**self.scheduler, "victim_policy": policy})

    def resolved(self, workload_info: dict[str, Any]) -> dict[str, Any]:
        """The configuration as run: the report's ``config`` object."""
        scheduler = dict(self.scheduler_config().to_dict())
        capacity = scheduler.get("capacity_superblocks", scheduler.get("kv_superblocks"))
        tokens_per_block = scheduler.get("tokens_per_block")
        effective = (
            int(capacity) * int(tokens_per_block) * self.cp
            if capacity is not None and tokens_per_block is not None
            else None
        )
        return {
            "cp": self.cp,
            "kv_tokens": self.kv_tokens,
            "kv_tokens_effective": effective,
            "procs": self.procs,
            "max_steps": self.max_steps,
            "scheduler": scheduler,
            "workload": workload_info,
        }


def check_config(options: SimulationOptions) -> None:
    """Build the configuration once; turn a ``ConfigError`` into a setup error."""
    from helix_kv import ConfigError

    try:
        options.scheduler_config()
    except ConfigError as err:
        raise SimulationSetupError(_one_line(str(err))) from None


def preflight(options: SimulationOptions, workload: Sequence[RequestSpec]) -> None:
    """Add every request to a throwaway scheduler so a request that can never run is
    reported before the run starts, with the core's own reason (``RequestTooLargeError``:
    longer than ``max_seq_len`` or the whole KV pool, or an unchunked re-prefill that
    cannot fit ``max_num_tokens``)."""
    from helix_kv import HelixKVError, Scheduler

    config = options.scheduler_config()
    for start in range(0, len(workload), _PREFLIGHT_BATCH):
        scheduler = Scheduler(config)
        for request in workload[start : start + _PREFLIGHT_BATCH]:
            try:
                scheduler.add_request(
                    request.request_id,
                    prompt_tokens(request.request_id, request.prompt_len),
                    request.output_len,
                    request.priority,
                )
            except HelixKVError as err:
                raise SimulationSetupError(
                    f"the workload cannot run: {_one_line(str(err))}"
                ) from None


def _one_line(text: str) -> str:
    return " ".join(text.split())
