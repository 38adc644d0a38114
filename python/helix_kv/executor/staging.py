"""Host-to-device staging of a step's small index arrays: one pinned buffer, one async copy."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from helix_kv._core import InvalidArgumentError, InvalidTypeError

#: The largest value an int64 slot holds (a uint64 array may hold more).
_INT64_MAX = np.iinfo(np.int64).max


class HostToDeviceStager:
    """Packs a step's integer host arrays into one int64 buffer and copies it to the device.

    On CUDA the buffer is pinned host memory reused across steps (double-buffered: before a
    buffer is refilled, the event recorded after its last copy is awaited), and the copy is
    ``non_blocking=True``, so building a step never blocks on the GPU. On CPU the packed
    array is wrapped without a copy.
    """

    def __init__(self, device: torch.device, num_buffers: int = 2) -> None:
        self.device = torch.device(device)
        self._pinned = self.device.type == "cuda"
        self._buffers: list[torch.Tensor | None] = [None] * num_buffers
        self._events: list[torch.cuda.Event | None] = [None] * num_buffers
        self._next = 0

    def stage(self, arrays: Sequence[npt.ArrayLike]) -> list[torch.Tensor]:
        """Device int64 tensors with the shapes and values of ``arrays``, in order.

        Every array must hold integers that int64 holds exactly: a float, bool, string or
        object array is an ``InvalidTypeError`` and a uint64 value past ``2**63 - 1`` an
        ``InvalidArgumentError`` (numpy's cast would truncate, parse or wrap them); an empty
        array of any dtype is accepted. Nothing is staged when one is refused.
        """
        host_arrays = [np.asarray(a) for a in arrays]
        for array in host_arrays:
            _check_exact(array)
        sizes = [a.size for a in host_arrays]
        total = int(sum(sizes))
        if self._pinned:
            device_flat = self._copy_pinned(host_arrays, total)
        else:
            packed = np.empty(total, dtype=np.int64)
            _pack(host_arrays, packed)
            device_flat = torch.from_numpy(packed).to(self.device)
        tensors = []
        offset = 0
        for array, size in zip(host_arrays, sizes):
            tensors.append(device_flat[offset : offset + size].view(array.shape))
            offset += size
        return tensors

    def _copy_pinned(self, host_arrays: Sequence[np.ndarray], total: int) -> torch.Tensor:
        index = self._next
        self._next = (index + 1) % len(self._buffers)
        event = self._events[index]
        if event is not None:
            event.synchronize()  # the last copy out of this buffer has finished
        buffer = self._buffers[index]
        if buffer is None or buffer.numel() < total:
            capacity = max(total, 2 * (0 if buffer is None else buffer.numel()), 4096)
            buffer = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
            self._buffers[index] = buffer
        _pack(host_arrays, buffer.numpy()[:total])
        device_flat = buffer[:total].to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._events[index] = event
        return device_flat


def _check_exact(array: np.ndarray) -> None:
    """Refuses an array whose values int64 does not hold exactly (see ``stage``)."""
    kind = array.dtype.kind
    if kind == "i" or array.size == 0:
        return
    if kind != "u":
        raise InvalidTypeError(f"staged arrays must have an integer dtype, got {array.dtype}")
    if array.dtype.itemsize == 8 and int(array.max()) > _INT64_MAX:
        raise InvalidArgumentError(
            f"a staged uint64 value ({int(array.max())}) does not fit int64 (2**63 - 1 at most)"
        )


def _pack(host_arrays: Sequence[np.ndarray], out: np.ndarray) -> None:
    offset = 0
    for array in host_arrays:
        out[offset : offset + array.size] = array.ravel()
        offset += array.size
