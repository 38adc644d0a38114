"""The decode fast path: persistent device buffers, one H2D copy per step, CUDA-graph replay.

A decode-only step (every entry one generation token) has a fixed shape once its batch is padded
to a bucket, so it is run from buffers allocated once:

* :class:`DecodeLayout`: the packed metadata of a step, one int32 row per batch slot,
  ``[token_id, position, slot, local_len, past_seen_len, input_ref, block_table[max_pages]]``.
  The column order is the core's (``helix_kv.DECODE_ROW_COLUMNS``, written once in
  ``rust/core/src/scheduler/metadata.rs``); this module reads the indices from there. Row ``i``
  is the ``i``-th generation entry of the step (the entry order of ``ScheduleOutput``), which
  is also its sample row, so sample rows and batch slots need no columns of their own.
* :class:`DecodeMetadata`: two pinned host staging buffers (used in turn, so filling one never
  waits for the copy of the other) and a device buffer of ``[max_batch, width]`` int32. One Rust
  call fills a step's rows (``Scheduler.write_decode_rows``: block tables, KV slots, lengths
  and the in-flight references, padding rows up to the bucket) and **one** ``non_blocking``
  copy moves the bucket's rows to the device. Padding rows (``slot -1``, ``local_len 0``)
  write no KV and attend to nothing.
* :class:`DecodeStep`: runs :meth:`~helix_kv.executor.model.Transformer.forward_decode`
  on those buffers into persistent logits / token buffers, eagerly or by replaying a CUDA graph
  captured per bucket (batch sizes padded up to the next bucket, as vLLM and TensorRT-LLM do).
  A graphed step allocates nothing and takes no host sync until its tokens are read.

A graphed step is **one** CUDA call: the graph of its bucket and staging buffer (two per
bucket, one per staging buffer) starts with the H2D copy of the staging rows, so a step costs
one fill (Rust) and one ``graph.replay()`` (:meth:`DecodeStep.launch`), and no event is
recorded for the staging buffers. Instead the host keeps the rule that makes the event
unneeded, and checks it: a staging buffer read by a launched copy is written again only once
that step is known finished (:meth:`DecodeMetadata.release`, called when the step's readback
was waited, :meth:`HostTokens.wait`); a fill that would overwrite a buffer whose copy may still
be pending raises :class:`StagingBufferBusy`. The executor loop reads step ``t``'s tokens
before it launches step ``t + 2`` (the next user of step ``t``'s buffer), so it never trips it.
The eager :meth:`DecodeMetadata.upload` (non-graphed steps, tests) still records an event after
its copy, and a later fill of that buffer waits on it.

One step ahead (overlap mode) a step's decode inputs may still be in flight: being sampled by
the previous step. Their rows carry ``token_id -1`` and ``input_ref r >= 0`` (row ``r`` of the
previous step's samples), and the step gathers them on the device, inside the graph, from
:attr:`DecodeStep.tokens`: the persistent buffer the previous fast-path step sampled into (a
previous general-path step's tokens are copied there first, :meth:`DecodeStep.take_previous`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
import torch

from helix_kv._core import (
    DECODE_ROW_COLUMNS,
    DECODE_ROW_PADDING,
    DecodeRowCounts,
    HelixKVError,
    InvalidArgumentError,
    InvalidLengthError,
    InvalidTypeError,
)
from helix_kv.executor import fused
from helix_kv.executor.kv_pool import KVPool
from helix_kv.executor.model import Combine, DecodeRows, Transformer
from helix_kv.executor.overlap import HostTokens


@dataclass(frozen=True)
class DecodeLayout:
    """Column layout and capacity of the packed decode metadata (int32, one row per slot).

    The column indices are the core's (``helix_kv.DECODE_ROW_COLUMNS``), not restated here.

    Attributes:
        max_batch: rows (decode entries) a step may have.
        max_pages: block-table columns per row (pages one request may hold on this rank).
    """

    max_batch: int
    max_pages: int

    TOKEN_ID: ClassVar[int] = DECODE_ROW_COLUMNS.index("token_id")
    POSITION: ClassVar[int] = DECODE_ROW_COLUMNS.index("position")
    SLOT: ClassVar[int] = DECODE_ROW_COLUMNS.index("slot")
    LOCAL_LEN: ClassVar[int] = DECODE_ROW_COLUMNS.index("local_len")
    PAST_SEEN_LEN: ClassVar[int] = DECODE_ROW_COLUMNS.index("past_seen_len")
    INPUT_REF: ClassVar[int] = DECODE_ROW_COLUMNS.index("input_ref")
    BLOCK_TABLE: ClassVar[int] = DECODE_ROW_COLUMNS.index("block_table")

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_pages < 1:
            raise ValueError(f"a decode layout needs max_batch and max_pages >= 1, got {self}")

    @property
    def width(self) -> int:
        """Int32 columns per row."""
        return self.BLOCK_TABLE + self.max_pages

    @property
    def padding_row(self) -> tuple[int, ...]:
        """The leading columns of a padding row: no token, no KV write, nothing to attend to,
        nothing to gather."""
        return DECODE_ROW_PADDING


def _check_int32(name: str, values: np.ndarray, out_of_range: type[HelixKVError]) -> None:
    """Refuses values an int32 row does not hold exactly: a dtype that is not an integer
    one (``InvalidTypeError``; an empty array of any dtype holds nothing to cast), or a
    value past int32 (``out_of_range``)."""
    if values.size == 0:
        return
    if values.dtype.kind not in "iu":
        raise InvalidTypeError(f"{name} must have an integer dtype, got {values.dtype}")
    low, high = int(values.min()), int(values.max())
    if low < -(2**31) or high > 2**31 - 1:
        raise out_of_range(f"{name} must fit int32, got {low if low < -(2**31) else high}")


def _widest_holding(scheduler: Any, request_ids: npt.ArrayLike) -> int:
    """The most superblocks (pages on every rank) one of ``request_ids`` holds."""
    ids = np.asarray(request_ids, dtype=np.int64)
    if not ids.size:
        return 0
    _, held = scheduler.block_table_tails(ids, np.zeros(ids.size, dtype=np.int64))
    return int(held.max())


def _int32_column(
    name: str, values: npt.ArrayLike, rows: int, out_of_range: type[HelixKVError]
) -> np.ndarray:
    """``values`` as ``rows`` int32-exact values (a scalar or any shape that broadcasts to
    ``[rows]``), checked as :func:`_check_int32` says; nothing is cast here."""
    array = np.asarray(values)
    if array.dtype == object and array.size:
        # Python ints past int64 make an object array: checked one by one.
        items = list(array.flat)
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in items):
            raise InvalidTypeError(f"{name} must hold integers, got {array.dtype}")
        if not all(-(2**31) <= int(v) < 2**31 for v in items):
            raise out_of_range(f"{name} must fit int32")
        array = array.astype(np.int64)
    _check_int32(name, array, out_of_range)
    try:
        return np.broadcast_to(array, (rows,))
    except ValueError:
        raise InvalidArgumentError(
            f"{name} must hold one value per row ({rows}), got shape {array.shape}"
        ) from None


class StagingBufferBusy(RuntimeError):
    """A fill would overwrite a staging buffer whose launched copy may still be pending (its
    step was not released: its readback not waited, nor the device synchronized)."""


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
        # Two staging buffers used in turn: a step fills one while the copy of the other may
        # still be in flight, so the event it waits on is the copy of two steps ago.
        self._staging = [torch.zeros(shape, dtype=torch.int32, pin_memory=pinned) for _ in range(2)]
        self._staging_np = [buffer.numpy() for buffer in self._staging]
        for host in self._staging_np:
            host[:, : layout.BLOCK_TABLE] = layout.padding_row
        # Eager uploads record an event after their copy; a later fill of the buffer waits on
        # it. Graphed steps copy inside the graph and record nothing: see _pending.
        self._copied = [torch.cuda.Event() if pinned else None for _ in range(2)]
        self._uploaded = [False, False]  # an eager upload's event guards the buffer
        # Per staging buffer, the number of the last launched step whose (in-graph) copy
        # reads it and that is not known finished; written again only once released.
        self._pending: list[int | None] = [None, None]
        self._launches = 0  # steps launched so far (step numbers count from 0)
        self._released = -1  # every step numbered <= this is known finished
        self._current = 0
        self._padded_to = 0  # rows of the current staging buffer that hold the step or padding
        #: Device copy of :attr:`host`; the graphs read their rows from here.
        self.device_buffer = torch.zeros(shape, dtype=torch.int32, device=self.device)
        self.device_buffer[:, : layout.BLOCK_TABLE] = torch.tensor(
            layout.padding_row, dtype=torch.int32
        )

    @property
    def host(self) -> torch.Tensor:
        """The current pinned host staging buffer ``[max_batch, width]`` int32 (rows
        ``[0, n)`` are the step being filled or last filled)."""
        return self._staging[self._current]

    def bucket(self, rows: int) -> int:
        """The smallest bucket holding ``rows`` rows."""
        for size in self.buckets:
            if size >= rows:
                return size
        raise ValueError(f"{rows} decode rows exceed the capacity {self.layout.max_batch}")

    def staging(self) -> npt.NDArray[np.int32]:
        """The current host staging buffer as numpy, safe to write: waits for its last eager
        copy to finish (long done: the other buffer was copied since). Raises
        :class:`StagingBufferBusy` if a launched step still reads it (not released)."""
        self._check_free(self._current)
        if self._uploaded[self._current]:
            event = self._copied[self._current]
            if event is not None:
                event.synchronize()
        return self._staging_np[self._current]

    def _next_staging(self) -> npt.NDArray[np.int32]:
        """Turns to the other staging buffer and returns it, safe to write (state unchanged
        when it is not)."""
        self._check_free(self._current ^ 1)
        self._current ^= 1
        return self.staging()

    def _check_free(self, index: int) -> None:
        pending = self._pending[index]
        if pending is not None and pending > self._released:
            raise StagingBufferBusy(
                f"staging buffer {index} is still read by the copy of launched step {pending} "
                f"(released through step {self._released}): wait for that step's readback "
                "(or synchronize and call release_all) before filling it again"
            )

    @property
    def launches(self) -> int:
        """Steps launched so far (:meth:`launched`); the last one is ``launches - 1``."""
        return self._launches

    def launched(self) -> int:
        """Records that a step whose copy reads the current staging buffer was queued (a
        graph replay: no event is recorded). Returns the step's number; the buffer is not
        written again until :meth:`release` of a number >= it."""
        step = self._launches
        self._launches += 1
        self._pending[self._current] = step
        self._uploaded[self._current] = False
        return step

    def release(self, step: int) -> None:
        """Step ``step`` (and, the stream being in order, every step before it) has finished
        on the device: its staging buffer may be written again."""
        self._released = max(self._released, step)

    def release_all(self) -> None:
        """Every launched step has finished (the caller synchronized the stream)."""
        self._released = self._launches - 1

    def pad(self, rows: int) -> int:
        """Pad rows ``[rows, bucket)`` of the current staging buffer (unless the fill did);
        returns the bucket."""
        bucket = self.bucket(rows)
        if bucket > max(rows, self._padded_to):
            host = self._staging_np[self._current]
            host[max(rows, self._padded_to) : bucket, : self.layout.BLOCK_TABLE] = (
                self.layout.padding_row
            )
            self._padded_to = bucket
        return bucket

    @property
    def current(self) -> int:
        """Index (0 or 1) of the current staging buffer."""
        return self._current

    def copy_to_device(self, bucket: int, index: int | None = None) -> None:
        """Queues the copy of rows ``[0, bucket)`` of staging buffer ``index`` (default the
        current) to :attr:`device_buffer` on the current stream (``non_blocking``: from
        pinned memory, capturable in a CUDA graph); records nothing."""
        staging = self._staging[self._current if index is None else index]
        self.device_buffer[:bucket].copy_(staging[:bucket], non_blocking=True)

    def fill(
        self,
        token_ids: npt.ArrayLike,
        positions: npt.ArrayLike,
        slots: npt.ArrayLike,
        local_lens: npt.ArrayLike,
        past_seen_lens: npt.ArrayLike,
        block_table: npt.ArrayLike,
        input_refs: npt.ArrayLike | None = None,
    ) -> int:
        """Write a step's rows from arrays, one per column (``block_table``:
        ``[rows, <= max_pages]``, -1 padded; ``input_refs``: default all -1, nothing in
        flight). Returns the number of rows. For tests and callers without a scheduler; a
        step from ``schedule()`` is written by :meth:`fill_from_schedule`.

        Every column is checked before the staging buffer turns or a word is written: a
        ``block_table`` that is not two-dimensional or a column that does not broadcast to
        ``rows`` values is an ``InvalidArgumentError``, a float, bool, string or object
        dtype an ``InvalidTypeError``, a value past int32 an ``InvalidLengthError`` (positions
        and lengths) or ``InvalidArgumentError`` (the others); more rows or pages than the
        layout holds a ``ValueError``.
        """
        table = np.asarray(block_table)
        if table.ndim != 2:
            raise InvalidArgumentError(
                f"block_table must be two-dimensional [rows, pages], got shape {table.shape}"
            )
        rows = int(table.shape[0])
        self._check_rows(rows, int(table.shape[1]))
        lay = self.layout
        columns = [
            (lay.TOKEN_ID, _int32_column("token_ids", token_ids, rows, InvalidArgumentError)),
            (lay.POSITION, _int32_column("positions", positions, rows, InvalidLengthError)),
            (lay.SLOT, _int32_column("slots", slots, rows, InvalidArgumentError)),
            (lay.LOCAL_LEN, _int32_column("local_lens", local_lens, rows, InvalidLengthError)),
            (
                lay.PAST_SEEN_LEN,
                _int32_column("past_seen_lens", past_seen_lens, rows, InvalidLengthError),
            ),
            (
                lay.INPUT_REF,
                _int32_column(
                    "input_refs",
                    -1 if input_refs is None else input_refs,
                    rows,
                    InvalidArgumentError,
                ),
            ),
        ]
        _check_int32("block_table", table, InvalidArgumentError)
        host = self._next_staging()
        for index, values in columns:
            host[:rows, index] = values
        host[:rows, lay.BLOCK_TABLE : lay.BLOCK_TABLE + table.shape[1]] = table
        host[:rows, lay.BLOCK_TABLE + table.shape[1] :] = -1
        self._padded_to = rows
        return rows

    def fill_from_schedule(self, scheduler: Any, out: Any) -> DecodeRowCounts:
        """Write the rows of a decode-only ``ScheduleOutput`` (generation entries, in order)
        and the padding rows up to its bucket, with one call into the core
        (``scheduler.write_decode_rows``). Returns its counts (``rows``, ``in_flight``, ...).

        Raises ``ValueError`` for more rows than fit, and the core's error (a
        ``HelixKVError``) for a step with context chunks or a request holding more than
        ``max_pages`` pages; in every case nothing is written and the caller runs the step
        on the general path.
        """
        bucket = self.bucket(out.num_samples)  # decode-only: one sample per entry
        host = self._next_staging()
        try:
            counts: DecodeRowCounts = scheduler.write_decode_rows(out, host, bucket)
        except Exception:
            self._current ^= 1  # nothing written: the other buffer stays the current one
            raise
        self._padded_to = counts.padded_to
        return counts

    def fill_if_fits(self, scheduler: Any, out: Any) -> DecodeRowCounts | None:
        """:meth:`fill_from_schedule`, or ``None`` (nothing written) for a step the layout
        cannot hold: more rows than its largest bucket, or a request holding more than
        ``max_pages`` pages (the core's ``InvalidLengthError``, told from the others by the
        requests' holdings). The caller runs such a step on the general path; every other
        error, a caller's mistake or a bug, propagates."""
        if out.num_samples > self.layout.max_batch:
            return None
        try:
            return self.fill_from_schedule(scheduler, out)
        except InvalidLengthError:
            if _widest_holding(scheduler, out.generation_ids) <= self.layout.max_pages:
                raise
            return None

    def upload(self, rows: int) -> int:
        """Pad rows ``[rows, bucket)`` (unless the fill did) and copy rows ``[0, bucket)`` to
        the device in one ``non_blocking`` copy on the current stream, then record an event
        that the next fill of this buffer waits on (the eager path; a graphed step copies
        inside its graph, :meth:`DecodeStep.launch`). Returns the bucket."""
        bucket = self.pad(rows)
        self.copy_to_device(bucket)
        event = self._copied[self._current]
        if event is not None:
            event.record()
            self._uploaded[self._current] = True
        return bucket

    def wait_uploaded(self) -> None:
        """Block until the last :meth:`upload` has landed on the device (for timing; a step
        never needs it: the copy and the step are ordered on one stream)."""
        event = self._copied[self._current]
        if event is not None and self._uploaded[self._current]:
            event.synchronize()

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

    def input_refs(self, bucket: int) -> torch.Tensor:
        """Device view of the ``input_ref`` column of rows ``[0, bucket)``."""
        return self.device_buffer[:bucket, self.layout.INPUT_REF]

    def _check_rows(self, rows: int, width: int) -> None:
        if rows > self.layout.max_batch or width > self.layout.max_pages:
            raise ValueError(
                f"{rows} rows x {width} pages do not fit the decode layout {self.layout}"
            )


class DecodeStep:
    """Runs decode-only steps from :class:`DecodeMetadata` into persistent output buffers.

    Args:
        model, pool, combine: what :meth:`Transformer.forward_decode` takes.
        metadata: the step's persistent input buffers.
        cuda_graphs: capture one CUDA graph per bucket now (collective with ``combine``:
            every rank of the CP group constructs its ``DecodeStep`` with the same buckets)
            and replay it per step; otherwise run eagerly.
        rows_per_request: the most rows one request has in a step (``1 + K`` with
            speculative decoding, whose rows are one per query token; buckets then count
            rows, not requests).
    """

    def __init__(
        self,
        model: Transformer,
        pool: KVPool,
        combine: Combine,
        metadata: DecodeMetadata,
        cuda_graphs: bool = False,
        rows_per_request: int = 1,
    ) -> None:
        self.model = model
        #: The most rows one request has in a step (``1 + K`` with speculative decoding:
        #: one row per query token); above 1 the kernel attends a request's rows together.
        self.rows_per_request = rows_per_request
        self.pool = pool
        self.combine = combine
        self.metadata = metadata
        device = metadata.device
        batch = metadata.layout.max_batch
        #: ``[max_batch, vocab]`` logits of the last step (rows ``[0, n)`` are real).
        self.logits = torch.zeros(
            (batch, model.config.vocab_size), dtype=model.dtype, device=device
        )
        #: ``[max_batch]`` greedy tokens of the last step (persistent: the next step gathers
        #: its inputs still in flight from here).
        self.tokens = torch.zeros(batch, dtype=torch.int64, device=device)
        cuda = device.type == "cuda"
        self._host_tokens = torch.zeros(batch, dtype=torch.int64, pin_memory=cuda)
        # Readbacks used in turn (one step ahead, step t + 1's copy is queued before the host
        # reads step t's), each with the event recorded after its copy.
        self._readback = [torch.zeros(batch, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self._readback_ready = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self._readback_next = 0
        #: Split-K scratch of the decode kernel, shared by every layer and bucket, so that a
        #: step (graphed or eager) allocates nothing for its splits.
        self.workspace = model.decode_workspace(
            batch, metadata.layout.max_pages, pool.placement.tokens_per_block, rows_per_request
        )
        # One graph per (bucket, staging buffer): its first node copies that buffer's rows.
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        if cuda_graphs:
            if device.type != "cuda":
                raise ValueError("CUDA graphs need a CUDA device")
            self._capture()

    @property
    def graphed(self) -> bool:
        """Whether steps replay captured graphs."""
        return bool(self._graphs)

    def launch(self, rows: int) -> int:
        """Queues the step whose ``rows`` rows were filled into the current staging buffer
        (padding rows up to its bucket included). Graphed: one ``graph.replay()`` whose first
        node is the H2D copy of the rows, and no event (the buffer stays unwritable until
        the step is released, :meth:`DecodeMetadata.release`). Eager:
        :meth:`DecodeMetadata.upload` then the forward. Returns the bucket."""
        metadata = self.metadata
        if not self._graphs:
            bucket = metadata.upload(rows)
            self._forward(bucket)
            return bucket
        bucket = metadata.pad(rows)
        self._replay(bucket)
        return bucket

    def run(self, bucket: int) -> None:
        """Run the step whose rows :meth:`DecodeMetadata.upload` staged (``bucket`` rows,
        padding included) into :attr:`logits` and :attr:`tokens`. Graphed, the graph copies
        the staging rows again (the same rows) and the buffer is held as in :meth:`launch`."""
        if self._graphs:
            self._replay(bucket)
        else:
            self._forward(bucket)

    def _replay(self, bucket: int) -> None:
        graph = self._graphs.get((bucket, self.metadata.current))
        if graph is None:
            raise ValueError(f"no graph captured for bucket {bucket}")
        graph.replay()
        self.metadata.launched()

    def read_tokens(self, rows: int) -> npt.NDArray[np.int64]:
        """The first ``rows`` tokens on the host (waits for the step)."""
        if self.tokens.device.type != "cuda":
            return self.tokens[:rows].numpy().copy()
        self._host_tokens[:rows].copy_(self.tokens[:rows], non_blocking=True)
        torch.cuda.current_stream(self.tokens.device).synchronize()
        self.metadata.release_all()
        return self._host_tokens[:rows].numpy().copy()

    def take_previous(self, tokens: torch.Tensor) -> None:
        """Makes ``tokens`` (a previous general-path step's samples, on the device, in
        ``sample_ids`` order) the ones the next step gathers its inputs in flight from: a
        device copy into :attr:`tokens`, queued on the current stream. Not needed after a
        fast-path step (it sampled into :attr:`tokens`)."""
        rows = int(tokens.shape[0])
        if rows > self.tokens.shape[0]:
            raise ValueError(f"{rows} previous samples exceed the {self.tokens.shape[0]} rows")
        self.tokens[:rows].copy_(tokens)

    def start_readback(self, rows: int) -> HostTokens:
        """Starts the copy of the first ``rows`` tokens to the host without blocking (into
        one of two persistent pinned buffers, used in turn: the caller reads a readback
        before it starts the one after next, as a loop one step ahead does). Waiting for it
        releases every step launched so far (:meth:`DecodeMetadata.release`): their staging
        buffers may be filled again."""
        release = partial(self.metadata.release, self.metadata.launches - 1)
        if self.tokens.device.type != "cuda":
            return HostTokens(self.tokens[:rows].clone(), None, release)
        index = self._readback_next
        self._readback_next ^= 1
        host = self._readback[index][:rows]
        host.copy_(self.tokens[:rows], non_blocking=True)
        ready = self._readback_ready[index]
        assert ready is not None
        ready.record()
        return HostTokens(host, ready, release)

    def _forward(self, bucket: int, copy_from: int | None = None) -> None:
        if copy_from is not None:  # the graphed step: the copy is the graph's first node
            self.metadata.copy_to_device(bucket, copy_from)
        rows = self.metadata.rows(bucket)
        # Inputs still in flight, gathered from the previous step's samples (a gather and a
        # select: part of the captured graph, no host work).
        refs = self.metadata.input_refs(bucket)
        gathered = self.tokens.index_select(0, refs.clamp(min=0))
        rows = rows._replace(token_ids=torch.where(refs >= 0, gathered, rows.token_ids))
        hidden = self.model.forward_decode(
            rows, self.pool, self.combine, self.workspace, self.rows_per_request
        )
        logits = self.model.logits(hidden)
        self.logits[:bucket].copy_(logits)
        fused.argmax(logits, out=self.tokens[:bucket])

    def _capture(self) -> None:
        # Every row padding, in both staging buffers: warm-up and capture write no KV and
        # read none.
        metadata = self.metadata
        layout = metadata.layout
        for index in (0, 1):
            metadata._staging_np[index][:, : layout.BLOCK_TABLE] = layout.padding_row
        device = metadata.device
        torch.cuda.synchronize(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # compiles the kernels, sets up cuBLAS and NCCL
            for bucket in metadata.buckets:
                for index in (0, 1):
                    self._forward(bucket, copy_from=index)
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        memory_pool = torch.cuda.graph_pool_handle()
        for bucket in sorted(metadata.buckets, reverse=True):  # largest first: one pool
            for index in (0, 1):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=memory_pool, capture_error_mode="thread_local"):
                    self._forward(bucket, copy_from=index)
                self._graphs[bucket, index] = graph
        torch.cuda.synchronize(device)


__all__ = [
    "DecodeLayout",
    "DecodeMetadata",
    "DecodeStep",
    "StagingBufferBusy",
    "default_buckets",
]
