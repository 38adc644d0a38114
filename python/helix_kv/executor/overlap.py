"""The device side of one-step-ahead (overlap) execution, and the host-gap timeline.

In overlap mode the executor schedules step ``t + 1`` on the host while step ``t`` runs on the
device (the protocol: :class:`helix_kv.StepDriver`). Step ``t + 1``'s decode inputs are then
partly unknown to the host: a request that decodes in step ``t`` samples its next input there.
The driver names those entries and the rows of step ``t``'s sampled tokens they take
(:meth:`helix_kv.StepDriver.gather_inputs`), and :class:`DecodeInputGather` copies them on the
device, queued after step ``t``'s sampling, so the host never waits for step ``t``'s tokens
before queueing step ``t + 1``.

:class:`TokenReadback` copies each step's sampled tokens to pinned host memory
(``non_blocking``) behind a CUDA event; the host waits on that event only when it feeds the
tokens to ``update()``, after step ``t + 1`` is already queued. On the CPU both degenerate to
plain tensor operations, with the same code path.

:class:`StepTimeline` records a CUDA event where each step's device work starts and ends;
the host gap between steps is the time from the end of step ``t``'s last kernel to the start
of step ``t + 1``'s first one: the device idles while the host updates, schedules and plans.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from helix_kv._core import InvalidLengthError
from helix_kv.executor.staging import HostToDeviceStager


class DecodeInputGather:
    """Fills in a step's decode inputs that are still being sampled by the previous step.

    Args:
        device: where the steps run.
    """

    def __init__(self, device: torch.device) -> None:
        self._stager = HostToDeviceStager(torch.device(device))

    def apply(
        self,
        token_ids: torch.Tensor,
        entries: npt.ArrayLike,
        rows: npt.ArrayLike,
        previous: torch.Tensor,
    ) -> torch.Tensor:
        """Writes ``previous[rows[k]]`` into ``token_ids[entries[k]]`` for every ``k``: the
        ``gather`` of :meth:`helix_kv.StepDriver.gather_inputs`.

        Args:
            token_ids: the step's flat input tokens on the device; its first rows are the
                decode entries (``StepPlan`` order). Changed in place.
            entries: the decode entries whose input is in flight (host, integers).
            rows: for each, the row of ``previous`` it takes (host, integers).
            previous: the previous step's sampled tokens on the device (``sample_ids``
                order).

        Returns ``token_ids``. Queues one staging copy, an index_select and an index_copy on
        the device, after ``previous`` was produced; nothing waits for the device.
        ``InvalidLengthError`` (nothing written) when ``entries`` and ``rows`` differ in
        length.
        """
        host_entries = np.asarray(entries, dtype=np.int64)
        host_rows = np.asarray(rows, dtype=np.int64)
        if host_entries.shape != host_rows.shape:
            raise InvalidLengthError(
                f"{host_entries.size} entries but {host_rows.size} rows to gather them from"
            )
        if not host_entries.size:
            return token_ids
        device_entries, device_rows = self._stager.stage([host_entries, host_rows])
        gathered = previous.index_select(0, device_rows).to(token_ids.dtype)
        token_ids.index_copy_(0, device_entries, gathered)
        return token_ids


@dataclass
class HostTokens:
    """A step's sampled tokens on their way to the host (``_on_ready``: called once they
    landed, e.g. to release the step's staging buffer)."""

    _host: torch.Tensor
    _ready: torch.cuda.Event | None
    _on_ready: Callable[[], None] | None = None

    def wait(self) -> npt.NDArray[np.int32]:
        """Blocks until the copy has landed; the tokens as int32 (what ``update`` takes)."""
        if self._ready is not None:
            self._ready.synchronize()
        if self._on_ready is not None:
            self._on_ready()
        return self._host.numpy().astype(np.int32)


class TokenReadback:
    """Starts the copy of a step's sampled tokens to the host without blocking.

    On CUDA the tokens go to pinned host memory with ``non_blocking=True`` and an event is
    recorded after the copy: the host blocks only in :meth:`HostTokens.wait`. Pinned blocks
    come from torch's caching host allocator, which reuses a block only once the copy that
    used it has finished.
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = torch.device(device).type == "cuda"

    def start(self, tokens: torch.Tensor) -> HostTokens:
        """The copy of ``tokens`` (any integer dtype, on the device) to the host, started."""
        if not self._cuda:
            return HostTokens(tokens.detach().cpu(), None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return HostTokens(host, ready)


class StepTimeline:
    """CUDA events where each step's device work starts and ends (nothing on the CPU, nor
    when ``enabled`` is false: then :meth:`start` and :meth:`end` return at once).

    :meth:`start` is called before a step's first device operation is queued, :meth:`end`
    after its last one; :meth:`gaps_us` (after the run) gives, between consecutive steps,
    the device time from the end of one to the start of the next.

    The events are a ring of ``capacity`` (start, end) pairs allocated once and reused: a
    step records two events and creates none. Every ``capacity // 2`` steps :meth:`end`
    turns the gaps of the older half of the ring into numbers (``capacity // 2`` steps old:
    long finished) before those pairs are recorded again.
    """

    def __init__(self, device: torch.device, enabled: bool = True, capacity: int = 256) -> None:
        if capacity < 4 or capacity % 2:
            raise ValueError(f"a step timeline needs an even capacity >= 4, got {capacity}")
        self.enabled = enabled and torch.device(device).type == "cuda"
        self._ring: list[tuple[torch.cuda.Event, torch.cuda.Event]] = (
            [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(capacity)
            ]
            if self.enabled
            else []
        )
        self._started = 0  # steps started
        self._ended = 0  # steps ended
        self._harvested = 0  # gaps after steps [0, _harvested) are in _gaps
        self._gaps: list[float] = []

    def start(self) -> None:
        """Marks the start of the next step's device work."""
        if self.enabled:
            self._ring[self._started % len(self._ring)][0].record()
            self._started += 1

    def end(self) -> None:
        """Marks the end of the step started last."""
        if self.enabled and self._ended < self._started:
            self._ring[self._ended % len(self._ring)][1].record()
            self._ended += 1
            half = len(self._ring) // 2
            if self._ended % half == 0 and self._ended >= 2 * half:
                # steps [ended - 2 half, ended - half) are recorded again over the next half
                self._harvest(self._ended - half)

    def _harvest(self, upto: int) -> None:
        """Gaps after steps ``[_harvested, upto)``: each needs the end of its step and the
        start of the next, the latest being step ``upto``'s start (all still in the ring)."""
        if upto <= self._harvested:
            return
        ring = self._ring
        ring[upto % len(ring)][0].synchronize()  # every earlier event finished too
        for step in range(self._harvested, upto):
            ended = ring[step % len(ring)][1]
            started = ring[(step + 1) % len(ring)][0]
            self._gaps.append(1e3 * ended.elapsed_time(started))
        self._harvested = upto

    def gaps_us(self) -> list[float]:
        """µs the device waited between the end of each step and the start of the next
        (synchronizes with the last recorded event)."""
        if not self._ended:
            return []
        self._ring[(self._ended - 1) % len(self._ring)][1].synchronize()
        self._harvest(self._ended - 1)
        return list(self._gaps)


__all__ = ["DecodeInputGather", "HostTokens", "StepTimeline", "TokenReadback"]
