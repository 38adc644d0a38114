"""Views of the packed step metadata that ``Scheduler.write_step_metadata`` fills.

A caller allocates one int32 buffer per rank (:func:`new_step_metadata_buffer`, or pinned
memory viewed as numpy) and builds its views once (:func:`step_metadata_views`): every section
lies at an offset fixed by the :class:`~helix_kv.StepMetadataLayout`, so the same views (and
device tensors of the same shape) serve every step. Each step fills the front of each section;
the :class:`~helix_kv.StepMetadata` it returns (and the header section) gives the counts.
Offsets come from the layout: nothing here computes one.

A decode-only step can also be written as the rows a decode kernel reads, one int32 row per
generation entry (``Scheduler.write_decode_rows`` into a caller-owned ``[rows, width]`` array):
the columns are ``helix_kv.DECODE_ROW_COLUMNS`` in order (their index is their column; the
block table starts at ``DECODE_ROW_COLUMNS.index("block_table")``), padding rows hold
``helix_kv.DECODE_ROW_PADDING``. :mod:`helix_kv.executor.decode_step` stages those rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from helix_kv._core import (
    InvalidArgumentError,
    InvalidLengthError,
    InvalidTypeError,
    StepMetadataLayout,
)

Int32Array = npt.NDArray[np.int32]


@dataclass(frozen=True)
class StepMetadataViews:
    """Views into one packed step-metadata buffer (no copies: they see every write).

    Entries are generation entries first, then context chunks; tokens follow the entries.

    Attributes:
        header: ``[8]`` int32: ``step`` (an int64 in words 0-1), ``num_tokens``,
            ``num_entries``, ``num_generation``, ``num_samples``, ``table_width_used``, 0.
        token_ids: ``[max_tokens]`` int32 input token of each token.
        positions: ``[max_tokens]`` int32 global position of each token.
        slot_mapping: ``[max_tokens]`` int64 this rank's KV slot of each token, -1 where
            another rank owns it.
        query_start: ``[max_entries + 1]`` int32 first token of each entry (and the end).
        local_lens: ``[max_entries]`` int32 tokens this rank holds of each request after
            the step.
        past_seen_lens: ``[max_entries]`` int32 tokens this rank held before the step.
        batch_slots: ``[max_entries]`` int32 batch slot of each entry.
        sample_rows: ``[max_entries]`` int32 token rows whose logits are sampled, in
            ``sample_ids`` order.
        block_table: ``[max_entries, table_width]`` int32 superblock (= page) ids of each
            entry, -1 padded.
    """

    header: Int32Array
    token_ids: Int32Array
    positions: Int32Array
    slot_mapping: npt.NDArray[np.int64]
    query_start: Int32Array
    local_lens: Int32Array
    past_seen_lens: Int32Array
    batch_slots: Int32Array
    sample_rows: Int32Array
    block_table: Int32Array


def new_step_metadata_buffer(layout: StepMetadataLayout) -> Int32Array:
    """A zeroed int32 buffer for ``layout`` (numpy's allocation is 16-byte aligned)."""
    return np.zeros(layout.total_words, dtype=np.int32)


def step_metadata_views(buffer: Int32Array, layout: StepMetadataLayout) -> StepMetadataViews:
    """Views of every section of ``buffer`` (a one-dimensional, C-contiguous numpy array of
    native int32, at least ``layout.total_words`` words), as ``layout.sections`` places them.

    Raises (helix_kv's errors, as ``Scheduler.write_step_metadata`` does for the same buffer):
    ``InvalidTypeError`` for a ``buffer`` that is not such an array (another type or dtype)
    or a ``layout`` that is not a :class:`~helix_kv.StepMetadataLayout`;
    ``InvalidArgumentError`` for a buffer of another shape or a strided one;
    ``InvalidLengthError`` for one shorter than the layout.
    """
    if not isinstance(layout, StepMetadataLayout):
        raise InvalidTypeError(f"layout must be a StepMetadataLayout, got {type(layout).__name__}")
    if not isinstance(buffer, np.ndarray) or buffer.dtype != np.int32:
        kind = buffer.dtype if isinstance(buffer, np.ndarray) else type(buffer).__name__
        raise InvalidTypeError(
            f"buffer must be a numpy array of dtype int32 (native byte order), got {kind}"
        )
    if buffer.ndim != 1 or not buffer.flags.c_contiguous:
        raise InvalidArgumentError(
            f"buffer must be one-dimensional and C-contiguous, got shape {buffer.shape} "
            f"with strides {buffer.strides}"
        )
    if buffer.shape[0] < layout.total_words:
        raise InvalidLengthError(
            f"buffer holds {buffer.shape[0]} words; the layout needs {layout.total_words}"
        )
    views: dict[str, np.ndarray] = {}
    for name, offset, length, dtype in layout.sections:
        words = 2 * length if dtype == "int64" else length
        views[name] = buffer[offset : offset + words].view(dtype)
    views["block_table"] = views["block_table"].reshape(layout.max_entries, layout.table_width)
    return StepMetadataViews(**views)
