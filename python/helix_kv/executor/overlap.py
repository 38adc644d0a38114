"""The device side of one-step-ahead (overlap) execution, and the host-gap timeline.

In overlap mode the executor schedules step ``t + 1`` on the host while step ``t`` runs on the
device. Step ``t + 1``'s decode inputs are then partly unknown to the host: a request that
decodes in step ``t`` samples its next input there. The scheduler marks those entries in
``ScheduleOutput.generation_input_refs`` (``r >= 0``: row ``r`` of step ``t``'s sampled tokens,
in its ``sample_ids`` order; ``-1``: the token is ``generation_input_tokens[i]``), and
:class:`DecodeInputGather` fills them in on the device, queued after step ``t``'s sampling,
so the host never waits for step ``t``'s tokens before queueing step ``t + 1``.

:class:`TokenReadback` copies each step's sampled tokens to pinned host memory
(``non_blocking``) behind a CUDA event; the host waits on that event only when it feeds the
tokens to ``update()``, after step ``t + 1`` is already queued. On the CPU both degenerate to
plain tensor operations, with the same code path.

:class:`StepTimeline` records a CUDA event where each step's device work starts and ends;
the host gap between steps is the time from the end of step ``t``'s last kernel to the start
of step ``t + 1``'s first one: the device idles while the host updates, schedules and plans.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from helix_kv.executor.staging import HostToDeviceStager


class DecodeInputGather:
    """Fills in a step's decode inputs that are still being sampled by the previous step.

    Args:
        device: where the steps run.
    """

    def __init__(self, device: torch.device) -> None:
        self._stager = HostToDeviceStager(torch.device(device))

    def apply(
        self, token_ids: torch.Tensor, refs: npt.ArrayLike, previous: torch.Tensor | None
    ) -> torch.Tensor:
        """Writes ``previous[refs[i]]`` into ``token_ids[i]`` wherever ``refs[i] >= 0``.

        Args:
            token_ids: the step's flat input tokens on the device; its first ``len(refs)``
                rows are the decode entries (``StepPlan`` order). Changed in place.
            refs: ``ScheduleOutput.generation_input_refs`` of the step (host).
            previous: the previous step's sampled tokens on the device (``sample_ids``
                order), or ``None`` when no step is in flight.

        Returns ``token_ids``. Queues an index_select and a where on the device, after
        ``previous`` was produced; nothing waits for the device.
        """
        host_refs = np.asarray(refs, dtype=np.int64)
        in_flight = host_refs >= 0
        if not in_flight.any():
            return token_ids
        if previous is None:
            raise RuntimeError(
                "the step reads sampled tokens of a previous step, but none is in flight: "
                "a step scheduled one step ahead must run after the step it follows"
            )
        (device_refs,) = self._stager.stage([host_refs])
        rows = host_refs.size
        gathered = previous.index_select(0, device_refs.clamp(min=0)).to(token_ids.dtype)
        token_ids[:rows] = torch.where(device_refs >= 0, gathered, token_ids[:rows])
        return token_ids


@dataclass
class HostTokens:
    """A step's sampled tokens on their way to the host."""

    _host: torch.Tensor
    _ready: torch.cuda.Event | None

    def wait(self) -> npt.NDArray[np.int32]:
        """Blocks until the copy has landed; the tokens as int32 (what ``update`` takes)."""
        if self._ready is not None:
            self._ready.synchronize()
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
    """CUDA events where each step's device work starts and ends (nothing on the CPU).

    :meth:`start` is called before a step's first device operation is queued, :meth:`end`
    after its last one; :meth:`gaps_us` (after the run) gives, between consecutive steps,
    the device time from the end of one to the start of the next.
    """

    def __init__(self, device: torch.device) -> None:
        self.enabled = torch.device(device).type == "cuda"
        self._steps: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._open: torch.cuda.Event | None = None

    def start(self) -> None:
        """Marks the start of the next step's device work."""
        if self.enabled:
            self._open = torch.cuda.Event(enable_timing=True)
            self._open.record()

    def end(self) -> None:
        """Marks the end of the step started last."""
        if self.enabled and self._open is not None:
            closing = torch.cuda.Event(enable_timing=True)
            closing.record()
            self._steps.append((self._open, closing))
            self._open = None

    def gaps_us(self) -> list[float]:
        """µs the device waited between the end of each step and the start of the next
        (synchronizes with the last recorded event)."""
        if not self._steps:
            return []
        self._steps[-1][1].synchronize()
        pairs = zip(self._steps, self._steps[1:])
        return [1e3 * ended.elapsed_time(started) for (_, ended), (started, _) in pairs]


__all__ = ["DecodeInputGather", "HostTokens", "StepTimeline", "TokenReadback"]
