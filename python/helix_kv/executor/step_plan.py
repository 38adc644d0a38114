"""A step's host-side plan: which tokens run, where their KV goes, what gets sampled.

A :class:`StepPlan` is built from a scheduler's :class:`~helix_kv.ScheduleOutput` (through the
scheduler's numpy methods ``block_table`` and ``slot_mapping``; no per-request Python loop) or,
where no scheduler runs (unit tests), from plain numpy arrays. Entries are ordered generation
entries first, then context chunks, and the flat token order follows the entries; so the sampled
rows are the generation tokens followed by the last token of every chunk that completes its
prompt — exactly the order of ``ScheduleOutput.sample_ids`` that ``Scheduler.update`` takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from helix_kv.executor.placement import RankPlacement

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class StepPlan:
    """Host (numpy) description of one forward step on one rank.

    Attributes:
        request_ids: ``[entries]`` request of each entry.
        starts: ``[entries]`` global position of each entry's first new token.
        counts: ``[entries]`` new tokens per entry (``1 + drafts`` for a decode entry: its
            input token, then the drafts it verifies).
        num_generation: entries ``[0, num_generation)`` are decode entries.
        token_ids: ``[tokens]`` input token ids, entry after entry (a drafted decode entry:
            its input token, then its drafts).
        block_table: ``[entries, width]`` superblock (= page) ids, ``-1`` padded.
        slot_mapping: ``[tokens]`` slot of each new token on this rank, ``-1`` if another
            rank owns it.
        local_lens: ``[entries]`` tokens this rank holds of each request after the step.
        past_seen_lens: ``[entries]`` tokens this rank held before the step.
        sample_index: ``[samples]`` flat token rows whose logits are sampled, in
            ``sample_ids`` order (every token of a decode entry, then the last token of
            each chunk that completes its prompt).
        num_draft_tokens: draft tokens the decode entries verify (speculative decoding).
    """

    placement: RankPlacement
    request_ids: IntArray
    starts: IntArray
    counts: IntArray
    num_generation: int
    token_ids: IntArray
    block_table: IntArray
    slot_mapping: IntArray
    local_lens: IntArray
    past_seen_lens: IntArray
    sample_index: IntArray
    num_draft_tokens: int = 0

    @property
    def num_entries(self) -> int:
        """Requests scheduled in the step."""
        return int(self.request_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """Tokens run in the step (context plus decode)."""
        return int(self.token_ids.shape[0])

    @property
    def token_offsets(self) -> IntArray:
        """``[entries + 1]`` start of each entry's tokens in the flat token order."""
        return np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)

    def positions(self) -> IntArray:
        """``[tokens]`` global position of every new token."""
        offsets = self.token_offsets
        within = np.arange(self.num_tokens, dtype=np.int64) - np.repeat(offsets[:-1], self.counts)
        return np.repeat(self.starts, self.counts) + within

    @classmethod
    def from_schedule(cls, scheduler: Any, out: Any, placement: RankPlacement) -> StepPlan:
        """The plan of a scheduled step, from the scheduler's numpy arrays.

        Args:
            scheduler: the rank's ``helix_kv.Scheduler`` (for ``block_table`` and
                ``slot_mapping``).
            out: the ``ScheduleOutput`` of its last ``schedule()``.
            placement: this rank's placement (same cp_size / tokens_per_block / cp_rank as
                the scheduler).
        """
        gen_ids = np.asarray(out.generation_ids, dtype=np.int64)
        ctx_ids = np.asarray(out.context_ids, dtype=np.int64)
        ctx_starts = np.asarray(out.context_starts, dtype=np.int64)
        ctx_lens = np.asarray(out.context_lens, dtype=np.int64)
        num_gen = int(gen_ids.shape[0])
        gen_positions = np.asarray(out.generation_positions, dtype=np.int64)
        gen_inputs = np.asarray(out.generation_input_tokens, dtype=np.int64)
        drafts = generation_draft_counts(out, num_gen)
        num_drafts = int(drafts.sum())
        request_ids = np.concatenate([gen_ids, ctx_ids])
        starts = np.concatenate([gen_positions, ctx_starts])
        counts = np.concatenate([1 + drafts, ctx_lens])
        if num_drafts:
            # each decode entry's input token, then its drafts (concatenated in entry order)
            heads = np.zeros(num_gen + num_drafts, dtype=bool)
            heads[np.cumsum(1 + drafts) - (1 + drafts)] = True
            gen_tokens = np.empty(num_gen + num_drafts, dtype=np.int64)
            gen_tokens[heads] = gen_inputs
            gen_tokens[~heads] = np.asarray(out.generation_draft_tokens, dtype=np.int64)
        else:
            gen_tokens = gen_inputs
        token_ids = np.concatenate([gen_tokens, np.asarray(out.context_token_ids, dtype=np.int64)])
        if request_ids.size:
            block_table = np.asarray(scheduler.block_table(request_ids), dtype=np.int64)
            slot_mapping = np.asarray(
                scheduler.slot_mapping(request_ids, starts, counts), dtype=np.int64
            )
        else:
            block_table = np.zeros((0, 0), dtype=np.int64)
            slot_mapping = np.zeros(0, dtype=np.int64)
        if num_drafts:
            # the output's lens are the decode position's: a drafted entry ends k later
            gen_local = placement.local_lens(gen_positions + 1 + drafts)
            gen_past = placement.local_lens(gen_positions)
        else:
            gen_local = np.asarray(out.generation_local_lens, dtype=np.int64)
            gen_past = np.asarray(out.generation_past_seen_lens, dtype=np.int64)
        local_lens = np.concatenate([gen_local, placement.local_lens(ctx_starts + ctx_lens)])
        past_seen_lens = np.concatenate([gen_past, placement.local_lens(ctx_starts)])
        completes = np.asarray(out.context_completes, dtype=bool)
        gen_tokens_run = num_gen + num_drafts
        chunk_ends = gen_tokens_run + np.cumsum(ctx_lens) - 1
        sample_index = np.concatenate(
            [np.arange(gen_tokens_run, dtype=np.int64), chunk_ends[completes].astype(np.int64)]
        )
        return cls(
            placement,
            request_ids,
            starts,
            counts,
            num_gen,
            token_ids,
            block_table,
            slot_mapping,
            local_lens,
            past_seen_lens,
            sample_index,
            num_drafts,
        )

    @classmethod
    def from_arrays(
        cls,
        placement: RankPlacement,
        request_ids: npt.ArrayLike,
        starts: npt.ArrayLike,
        token_ids_per_entry: Sequence[npt.ArrayLike],
        block_table: npt.ArrayLike,
        num_generation: int = 0,
        sample_index: npt.ArrayLike | None = None,
    ) -> StepPlan:
        """A plan from plain arrays, for running the model without a scheduler.

        The slot mapping and local lengths are derived from ``block_table`` with the Helix
        placement. ``sample_index`` defaults to the last token of every entry.
        """
        entries = [np.asarray(t, dtype=np.int64).ravel() for t in token_ids_per_entry]
        counts = np.array([e.size for e in entries], dtype=np.int64)
        starts_arr = np.asarray(starts, dtype=np.int64)
        token_ids = np.concatenate(entries) if entries else np.zeros(0, dtype=np.int64)
        table = np.asarray(block_table, dtype=np.int64)
        within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        positions = np.repeat(starts_arr, counts) + within
        rows = np.repeat(np.arange(counts.size), counts)
        if sample_index is None:
            sample_index = np.cumsum(counts) - 1
        return cls(
            placement=placement,
            request_ids=np.asarray(request_ids, dtype=np.int64),
            starts=starts_arr,
            counts=counts,
            num_generation=num_generation,
            token_ids=token_ids,
            block_table=table,
            slot_mapping=placement.slot_mapping(table, rows, positions),
            local_lens=placement.local_lens(starts_arr + counts),
            past_seen_lens=placement.local_lens(starts_arr),
            sample_index=np.asarray(sample_index, dtype=np.int64),
        )


def generation_draft_counts(out: Any, num_generation: int) -> IntArray:
    """Drafts per generation entry of ``out`` (zeros without speculative decoding)."""
    counts = np.asarray(getattr(out, "generation_draft_counts", ()), dtype=np.int64)
    if counts.shape != (num_generation,):
        return np.zeros(num_generation, dtype=np.int64)
    return counts
