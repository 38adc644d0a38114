"""Per-rank host KV tier: the pages of suspended requests, in (pinned, on CUDA) host memory.

One host page per host superblock id (the mirrored host ledger's id, the same on every rank);
each rank keeps its own share of a page's tokens there, as it does in its GPU pool. A step's
copies come from its :class:`helix_kv.ScheduleOutput`:

- out: ``suspended_block_ids`` (GPU pages) to ``suspended_host_block_ids`` (host pages);
- in: ``resumed_host_block_ids`` to ``resumed_block_ids`` (the resumed requests' new pages).

:meth:`HostKVPool.copy_step` enqueues both, batched for the whole step: one gather of every
suspended page into a contiguous device buffer, one copy per run of consecutive host pages
(device to host), then the reverse for the resumed pages and one scatter into the pool. On CUDA
they run on a side stream that first waits for the work already queued on the compute stream
(so the copy-out reads the pages as the last step left them), and the compute stream then waits
for the side stream: the step's attention reads resumed pages only once they are back, and no
KV write reuses a suspended page before its copy-out read it. Nothing waits on the host (no
synchronisation per request or per step).
"""

from __future__ import annotations

import numpy as np
import torch

from helix_kv._core import ScheduleOutput
from helix_kv.executor.kv_pool import KVPool


class HostKVPool:
    """One rank's host tier for the pages of ``pool``.

    Args:
        pool: this rank's GPU (or CPU) KV pool; the host pages have its geometry and dtype.
        num_pages: host pages (the group's agreed ``host_tier_superblocks``).
    """

    def __init__(self, pool: KVPool, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError("a host KV tier needs at least one page")
        self.pool = pool
        self.num_pages = num_pages
        layers, _, heads, dim = pool.key_cache.shape
        self._tpb = pool.placement.tokens_per_block
        # keys, then values (a latent pool: keys only)
        self._page_shape = (pool.kv_factor, layers, self._tpb, heads, dim)
        cuda = pool.device.type == "cuda"
        self.pages = torch.zeros(
            (num_pages, *self._page_shape), dtype=pool.key_cache.dtype, pin_memory=cuda
        )
        self._stream = torch.cuda.Stream(pool.device) if cuda else None
        self.page_bytes = self.pages[0].numel() * self.pages.element_size()
        #: Pages copied out to / in from the host tier so far (this rank).
        self.pages_out = 0
        self.pages_in = 0

    @property
    def bytes_out(self) -> int:
        """Bytes this rank copied to the host tier so far."""
        return self.pages_out * self.page_bytes

    @property
    def bytes_in(self) -> int:
        """Bytes this rank copied back from the host tier so far."""
        return self.pages_in * self.page_bytes

    def copy_step(self, out: ScheduleOutput) -> None:
        """Enqueue the step's copy-out, then its copy-in (a resume may reuse pages a suspend
        of the same step freed). Call it after ``schedule()`` and before the step's forward."""
        suspended = np.asarray(out.suspended_block_ids, dtype=np.int64)
        resumed = np.asarray(out.resumed_block_ids, dtype=np.int64)
        if suspended.size == 0 and resumed.size == 0:
            return
        host_out = np.asarray(out.suspended_host_block_ids, dtype=np.int64)
        host_in = np.asarray(out.resumed_host_block_ids, dtype=np.int64)
        if self._stream is None:
            self._copy_out(suspended, host_out)
            self._copy_in(host_in, resumed)
        else:
            compute = torch.cuda.current_stream(self.pool.device)
            self._stream.wait_stream(compute)
            with torch.cuda.stream(self._stream):
                self._copy_out(suspended, host_out)
                self._copy_in(host_in, resumed)
            compute.wait_stream(self._stream)
        self.pages_out += int(suspended.size)
        self.pages_in += int(resumed.size)

    def _paged(self, cache: torch.Tensor) -> torch.Tensor:
        layers, slots, heads, dim = cache.shape
        return cache.view(layers, slots // self._tpb, self._tpb, heads, dim)

    def _index(self, pages: np.ndarray) -> torch.Tensor:
        index = torch.from_numpy(pages)
        if self.pool.device.type == "cuda":
            index = index.pin_memory().to(self.pool.device, non_blocking=True)
        return index

    def _copy_out(self, pages: np.ndarray, host_pages: np.ndarray) -> None:
        if pages.size == 0:
            return
        index = self._index(pages)
        caches = self._caches()
        parts = [self._paged(cache).index_select(1, index) for cache in caches]
        # [pages, kv_factor, layers, tpb, heads, dim], contiguous: one copy per run of host pages
        staged = torch.stack(parts).permute(2, 0, 1, 3, 4, 5).contiguous()
        for start, end, host_start in _runs(host_pages):
            self.pages[host_start : host_start + end - start].copy_(
                staged[start:end], non_blocking=True
            )

    def _copy_in(self, host_pages: np.ndarray, pages: np.ndarray) -> None:
        if pages.size == 0:
            return
        staged = torch.empty(
            (pages.size, *self._page_shape), dtype=self.pages.dtype, device=self.pool.device
        )
        for start, end, host_start in _runs(host_pages):
            staged[start:end].copy_(
                self.pages[host_start : host_start + end - start], non_blocking=True
            )
        index = self._index(pages)
        parts = staged.permute(1, 2, 0, 3, 4, 5)  # [kv_factor, layers, pages, tpb, heads, dim]
        for cache, part in zip(self._caches(), parts):
            self._paged(cache)[:, index] = part

    def _caches(self) -> list[torch.Tensor]:
        """The pool's stored tensors: keys and values, or the keys of a latent pool."""
        if self.pool.latent_dim is not None:
            return [self.pool.key_cache]
        return [self.pool.key_cache, self.pool.value_cache]


def _runs(host_pages: np.ndarray) -> list[tuple[int, int, int]]:
    """``(start, end, first host page)`` of each run of consecutive host page ids."""
    if host_pages.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(host_pages) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [host_pages.size]))
    return [(int(s), int(e), int(host_pages[s])) for s, e in zip(starts, ends)]
