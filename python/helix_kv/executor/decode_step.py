"""The decode fast path: persistent device buffers, one H2D copy per step, CUDA-graph replay.

A decode-only step (every entry one generation token) has a fixed shape once its batch is padded
to a bucket, so it is run from buffers allocated once:

* :class:`DecodeLayout`: the packed metadata of a step, one int32 row per batch slot,
  ``[token_id, position, slot, local_len, past_seen_len, block_table[max_pages]]``. Row ``i``
  is the ``i``-th generation entry of the step (the entry order of ``ScheduleOutput``), which
  is also its sample row, so sample rows and batch slots need no columns of their own.
* :class:`DecodeMetadata`: a pinned host staging buffer and a device buffer of
  ``[max_batch, width]`` int32, filled on the host (today from the ``ScheduleOutput`` and the
  scheduler's ``block_table`` / ``slot_mapping``; any writer of the same rows, such as one Rust
  call filling a packed buffer, can fill :attr:`DecodeMetadata.host` instead) and copied to the
  device with **one** ``non_blocking`` copy of the bucket's rows. Padding rows (``slot -1``,
  ``local_len 0``) write no KV and attend to nothing.
* :class:`DecodeStep`: runs :meth:`~helix_kv.executor.model.TinyTransformer.forward_decode`
  on those buffers into persistent logits / token buffers, eagerly or by replaying a CUDA graph
  captured per bucket (batch sizes padded up to the next bucket, as vLLM and TensorRT-LLM do).
  A graphed step allocates nothing and takes no host sync until its tokens are read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from helix_kv.executor.kv_pool import KVPool
from helix_kv.executor.model import Combine, DecodeRows, TinyTransformer


@dataclass(frozen=True)
class DecodeLayout:
    """Column layout and capacity of the packed decode metadata (int32, one row per slot).

    Attributes:
        max_batch: rows (decode entries) a step may have.
        max_pages: block-table columns per row (pages one request may hold on this rank).
    """

    max_batch: int
    max_pages: int

    TOKEN_ID = 0
    POSITION = 1
    SLOT = 2
    LOCAL_LEN = 3
    PAST_SEEN_LEN = 4
    BLOCK_TABLE = 5

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_pages < 1:
            raise ValueError(f"a decode layout needs max_batch and max_pages >= 1, got {self}")

    @property
    def width(self) -> int:
        """Int32 columns per row."""
        return self.BLOCK_TABLE + self.max_pages

    @property
    def padding_row(self) -> tuple[int, ...]:
        """The leading columns of a padding row: no token, no KV write, nothing to attend to."""
        return (0, 0, -1, 0, 0)


def default_buckets(max_batch: int) -> tuple[int, ...]:
    """Batch sizes a graph is captured for: powers of two below ``max_batch``, then it."""
    buckets = []
    size = 1
    while size < max_batch:
        buckets.append(size)
        size *= 2
    buckets.append(max_batch)
    return tuple(buckets)


class DecodeMetadata:
    """Persistent host staging and device buffers of decode steps (see the module doc).

    Args:
        layout: capacity and column layout.
        device: where the device buffer lives (on CPU the "upload" is a plain copy).
        buckets: padded batch sizes (default :func:`default_buckets`); the largest must be
            ``layout.max_batch``.
    """

    def __init__(
        self,
        layout: DecodeLayout,
        device: torch.device | str,
        buckets: Sequence[int] | None = None,
    ) -> None:
        self.layout = layout
        self.device = torch.device(device)
        self.buckets = tuple(sorted(set(buckets or default_buckets(layout.max_batch))))
        if self.buckets[0] < 1 or self.buckets[-1] != layout.max_batch:
            raise ValueError(
                f"buckets {self.buckets} must be >= 1 and end at max_batch {layout.max_batch}"
            )
        shape = (layout.max_batch, layout.width)
        pinned = self.device.type == "cuda"
        #: Pinned host staging buffer ``[max_batch, width]`` int32; rows ``[0, n)`` are a step.
        self.host = torch.zeros(shape, dtype=torch.int32, pin_memory=pinned)
        self._host = self.host.numpy()
        self._host[:, : layout.BLOCK_TABLE] = layout.padding_row
        #: Device copy of :attr:`host`; the graphs read their rows from here.
        self.device_buffer = torch.zeros(shape, dtype=torch.int32, device=self.device)
        self.device_buffer[:, : layout.BLOCK_TABLE] = torch.tensor(
            layout.padding_row, dtype=torch.int32
        )
        self._copied = torch.cuda.Event() if pinned else None
        self._ones = np.ones(layout.max_batch, dtype=np.int64)

    def bucket(self, rows: int) -> int:
        """The smallest bucket holding ``rows`` rows."""
        for size in self.buckets:
            if size >= rows:
                return size
        raise ValueError(f"{rows} decode rows exceed the capacity {self.layout.max_batch}")

    def staging(self) -> npt.NDArray[np.int32]:
        """The host staging buffer as numpy, safe to write: waits for its last copy to finish
        (already done in a loop that reads each step's tokens)."""
        if self._copied is not None:
            self._copied.synchronize()
        return self._host

    def fill(
        self,
        token_ids: npt.ArrayLike,
        positions: npt.ArrayLike,
        slots: npt.ArrayLike,
        local_lens: npt.ArrayLike,
        past_seen_lens: npt.ArrayLike,
        block_table: npt.ArrayLike,
    ) -> int:
        """Write a step's rows from arrays, one per column (``block_table``:
        ``[rows, <= max_pages]``, -1 padded). Returns the number of rows."""
        table = np.asarray(block_table)
        rows = int(table.shape[0])
        self._check_rows(rows, int(table.shape[1]) if table.ndim == 2 else -1)
        host = self.staging()
        lay = self.layout
        host[:rows, lay.TOKEN_ID] = token_ids
        host[:rows, lay.POSITION] = positions
        host[:rows, lay.SLOT] = slots
        host[:rows, lay.LOCAL_LEN] = local_lens
        host[:rows, lay.PAST_SEEN_LEN] = past_seen_lens
        host[:rows, lay.BLOCK_TABLE : lay.BLOCK_TABLE + table.shape[1]] = table
        return rows

    def fill_from_schedule(self, scheduler: Any, out: Any) -> int:
        """Write the rows of a decode-only ``ScheduleOutput`` (generation entries, in order),
        with the block tables and slot mapping from ``scheduler``. Returns the number of rows.

        Raises ``ValueError`` for a step with context chunks or more rows than fit, and the
        scheduler's error when a request holds more than ``max_pages`` pages; in both cases
        the caller runs the step on the general path.
        """
        if len(out.context_ids):
            raise ValueError("the decode fast path takes decode-only steps")
        ids = np.asarray(out.generation_ids, dtype=np.int64)
        rows = int(ids.shape[0])
        self._check_rows(rows, 0)
        positions = np.asarray(out.generation_positions, dtype=np.int64)
        table = scheduler.block_table(ids, self.layout.max_pages)  # raises if a row is wider
        slots = scheduler.slot_mapping(ids, positions, self._ones[:rows])
        host = self.staging()
        lay = self.layout
        host[:rows, lay.TOKEN_ID] = out.generation_input_tokens
        host[:rows, lay.POSITION] = positions
        host[:rows, lay.SLOT] = slots
        host[:rows, lay.LOCAL_LEN] = out.generation_local_lens
        host[:rows, lay.PAST_SEEN_LEN] = out.generation_past_seen_lens
        host[:rows, lay.BLOCK_TABLE :] = table
        return rows

    def upload(self, rows: int) -> int:
        """Pad rows ``[rows, bucket)`` and copy rows ``[0, bucket)`` to the device in one
        ``non_blocking`` copy on the current stream. Returns the bucket."""
        bucket = self.bucket(rows)
        lay = self.layout
        if bucket > rows:
            self._host[rows:bucket, : lay.BLOCK_TABLE] = lay.padding_row
        self.device_buffer[:bucket].copy_(self.host[:bucket], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return bucket

    def wait_uploaded(self) -> None:
        """Block until the last :meth:`upload` has landed on the device (for timing; a step
        never needs it: the copy and the step are ordered on one stream)."""
        if self._copied is not None:
            self._copied.synchronize()

    def rows(self, bucket: int) -> DecodeRows:
        """Device views of rows ``[0, bucket)``, column by column."""
        buf = self.device_buffer[:bucket]
        lay = self.layout
        return DecodeRows(
            token_ids=buf[:, lay.TOKEN_ID],
            positions=buf[:, lay.POSITION],
            slots=buf[:, lay.SLOT],
            local_lens=buf[:, lay.LOCAL_LEN],
            block_table=buf[:, lay.BLOCK_TABLE :],
        )

    def _check_rows(self, rows: int, width: int) -> None:
        if rows > self.layout.max_batch or width > self.layout.max_pages:
            raise ValueError(
                f"{rows} rows x {width} pages do not fit the decode layout {self.layout}"
            )


class DecodeStep:
    """Runs decode-only steps from :class:`DecodeMetadata` into persistent output buffers.

    Args:
        model, pool, combine: what :meth:`TinyTransformer.forward_decode` takes.
        metadata: the step's persistent input buffers.
        cuda_graphs: capture one CUDA graph per bucket now (collective with ``combine``:
            every rank of the CP group constructs its ``DecodeStep`` with the same buckets)
            and replay it per step; otherwise run eagerly.
    """

    def __init__(
        self,
        model: TinyTransformer,
        pool: KVPool,
        combine: Combine,
        metadata: DecodeMetadata,
        cuda_graphs: bool = False,
    ) -> None:
        self.model = model
        self.pool = pool
        self.combine = combine
        self.metadata = metadata
        device = metadata.device
        batch = metadata.layout.max_batch
        #: ``[max_batch, vocab]`` logits of the last step (rows ``[0, n)`` are real).
        self.logits = torch.zeros(
            (batch, model.config.vocab_size), dtype=model.dtype, device=device
        )
        #: ``[max_batch]`` greedy tokens of the last step.
        self.tokens = torch.zeros(batch, dtype=torch.int64, device=device)
        self._host_tokens = torch.zeros(batch, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if cuda_graphs:
            if device.type != "cuda":
                raise ValueError("CUDA graphs need a CUDA device")
            self._capture()

    @property
    def graphed(self) -> bool:
        """Whether steps replay captured graphs."""
        return bool(self._graphs)

    def run(self, bucket: int) -> None:
        """Run the step whose rows :meth:`DecodeMetadata.upload` staged (``bucket`` rows,
        padding included) into :attr:`logits` and :attr:`tokens`."""
        graph = self._graphs.get(bucket)
        if graph is not None:
            graph.replay()
        elif self._graphs:
            raise ValueError(f"no graph captured for bucket {bucket}")
        else:
            self._forward(bucket)

    def read_tokens(self, rows: int) -> npt.NDArray[np.int64]:
        """The first ``rows`` tokens on the host (waits for the step)."""
        if self.tokens.device.type != "cuda":
            return self.tokens[:rows].numpy().copy()
        self._host_tokens[:rows].copy_(self.tokens[:rows], non_blocking=True)
        torch.cuda.current_stream(self.tokens.device).synchronize()
        return self._host_tokens[:rows].numpy().copy()

    def _forward(self, bucket: int) -> None:
        rows = self.metadata.rows(bucket)
        logits = self.model.logits(self.model.forward_decode(rows, self.pool, self.combine))
        self.logits[:bucket].copy_(logits)
        torch.argmax(logits, dim=-1, out=self.tokens[:bucket])

    def _capture(self) -> None:
        # Every row padding: warm-up and capture write no KV and read none.
        layout = self.metadata.layout
        self.metadata.staging()[:, : layout.BLOCK_TABLE] = layout.padding_row
        self.metadata.upload(layout.max_batch)
        torch.cuda.synchronize(self.metadata.device)
        side = torch.cuda.Stream(self.metadata.device)
        side.wait_stream(torch.cuda.current_stream(self.metadata.device))
        with torch.cuda.stream(side):  # compiles the kernels, sets up cuBLAS and NCCL
            for bucket in self.metadata.buckets:
                self._forward(bucket)
        torch.cuda.current_stream(self.metadata.device).wait_stream(side)
        torch.cuda.synchronize(self.metadata.device)
        memory_pool = torch.cuda.graph_pool_handle()
        for bucket in sorted(self.metadata.buckets, reverse=True):  # largest first: one pool
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=memory_pool, capture_error_mode="thread_local"):
                self._forward(bucket)
            self._graphs[bucket] = graph
        torch.cuda.synchronize(self.metadata.device)


__all__ = ["DecodeLayout", "DecodeMetadata", "DecodeStep", "default_buckets"]
