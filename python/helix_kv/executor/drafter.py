"""Prompt-lookup (n-gram) drafting for speculative decoding: no second model.

:class:`NgramDrafter` proposes, for a request, the tokens that followed the most recent earlier
occurrence of its last ``n`` tokens (prompt and generated tokens alike), trying the longest
``n`` first (``max_ngram`` down to ``min_ngram``), as vLLM's ``ngram`` proposer and
prompt-lookup decoding do. It reads nothing but the request's own tokens, which are identical on
every rank of a CP group (the sampled tokens are broadcast), so the drafts are rank-invariant by
construction, as :meth:`helix_kv.Scheduler.propose_drafts` requires.

Greedy verification keeps exactly the tokens the model would have produced without drafts,
whatever the drafts are: a bad draft costs verification work, never correctness.

When the continuation of the match runs into the request's last tokens (the output has
fallen into a cycle shorter than the draft), it continues with the same period, so a cycle
of any length yields full drafts.

One step ahead the newest token of a request may still be in flight (sampled by the step
on the device). Drafting then starts from the tokens known on the host and skips the first
proposed token (it guesses the token in flight): ``skip=1``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]


class NgramDrafter:
    """Prompt-lookup drafts of up to ``num_speculative_tokens`` tokens per request.

    Args:
        num_speculative_tokens: most drafts per request (``K``, the scheduler's
            ``num_speculative_tokens``).
        max_ngram, min_ngram: the n-gram sizes matched, longest first.
        max_search: match only within the last ``max_search`` tokens (``None``: all of them),
            which bounds the host time per request on long contexts.
    """

    def __init__(
        self,
        num_speculative_tokens: int,
        max_ngram: int = 3,
        min_ngram: int = 1,
        max_search: int | None = None,
    ) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if max_search is not None and max_search < 2:
            raise ValueError(f"max_search must be >= 2 or None, got {max_search}")
        self.num_speculative_tokens = num_speculative_tokens
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_search = max_search

    def draft(self, tokens: npt.ArrayLike, skip: int = 0) -> IntArray:
        """The drafts that follow ``tokens`` (int64, at most ``num_speculative_tokens``;
        empty when no n-gram of the tail occurred before).

        The last ``n`` tokens are matched against every earlier window of ``n`` tokens, for
        ``n`` from ``max_ngram`` down to ``min_ngram``; the first ``n`` with a match wins, and
        of its matches the most recent one. The drafts are the tokens that followed it,
        repeated with the period ``p`` between the match and the tail where they run out
        (position ``q`` past the end takes the token at ``q - p``), without the first
        ``skip`` of them (``skip = 1``: the request's next input is still in flight, the
        continuation's first token guesses it).
        """
        seq = np.asarray(tokens, dtype=np.int64).ravel()
        if self.max_search is not None and seq.size > self.max_search:
            seq = seq[-self.max_search :]
        length = int(seq.size)
        k = self.num_speculative_tokens
        # A window ending at e (its last token seq[e]) continues at e + 1, before the tail's
        # own window: e <= length - 2.
        last_end = length - 2
        if last_end < self.min_ngram - 1:
            return np.zeros(0, dtype=np.int64)
        ends = np.arange(last_end + 1, dtype=np.int64)
        match = np.ones(last_end + 1, dtype=bool)
        best: IntArray | None = None
        best_n = 0
        for n in range(1, self.max_ngram + 1):
            # windows ending at e match the tail in their last n tokens
            back = n - 1
            if back > last_end:
                break
            shifted = np.zeros(last_end + 1, dtype=bool)
            shifted[back:] = seq[: last_end + 1 - back] == seq[length - 1 - back]
            match &= shifted
            if n >= self.min_ngram:
                found = ends[match]
                if not found.size:
                    break  # no longer n-gram can match either
                best, best_n = found, n
        if best is None or best_n < self.min_ngram:
            return np.zeros(0, dtype=np.int64)
        period = length - 1 - int(best[-1])
        wanted = length + skip + np.arange(k, dtype=np.int64)  # the positions drafted
        drafts: IntArray = seq[wanted - period * ((wanted - length) // period + 1)]
        return drafts

    def grid(self, histories: Sequence[npt.ArrayLike]) -> tuple[npt.NDArray[np.int32], IntArray]:
        """The histories (each cut to its last ``max_search`` tokens) right-aligned in one
        int32 ``[requests, width]`` array, ``-1`` before each (it matches no token), and
        their lengths (int64): what the n-gram search runs over, on the host or the device
        (:func:`helix_kv.executor.ngram_device.ngram_propose`)."""
        return _grid(histories, self.max_search)

    def propose(
        self, histories: Sequence[npt.ArrayLike], skips: npt.ArrayLike | int = 0
    ) -> tuple[IntArray, npt.NDArray[np.int32]]:
        """Drafts for several requests at once: their counts (int64, one per history) and
        their tokens concatenated (int32), what ``propose_drafts(ids, counts, tokens)`` takes.

        The same drafts as :meth:`draft` of each history, computed for all of them together:
        the histories right-aligned in one ``[requests, longest]`` array (their tails in its
        last column), every n-gram size matched there at once, so the host time grows with
        the tokens searched, not with a numpy call per request.
        """
        count = len(histories)
        skip = np.broadcast_to(np.asarray(skips, dtype=np.int64), (count,))
        k = self.num_speculative_tokens
        if not count:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)
        grid, lengths = self.grid(histories)
        width = grid.shape[1]
        first = width - lengths  # each row's first real column
        ends = np.arange(width - 1, dtype=np.int64)  # a window ends at column e <= width - 2
        match = np.ones((count, width - 1), dtype=bool)
        best_end = np.full(count, -1, dtype=np.int64)
        for n in range(1, self.max_ngram + 1):
            back = n - 1
            if back >= width - 1:
                break
            shifted = np.zeros((count, width - 1), dtype=bool)
            shifted[:, back:] = grid[:, : width - 1 - back] == grid[:, width - 1 - back, None]
            match &= shifted
            if n < self.min_ngram:
                continue
            # the window lies in the history (not the padding) and the tail has n tokens
            valid = match & (ends[None, :] - back >= first[:, None])
            found = valid.any(axis=1) & (lengths > n)
            if not found.any():
                break  # no longer n-gram matches either
            last = width - 2 - np.argmax(valid[:, ::-1], axis=1)
            best_end = np.where(found, last, best_end)
        drafted = best_end >= 0
        counts = np.where(drafted, k, 0).astype(np.int64)
        rows = np.flatnonzero(drafted)
        if not rows.size:
            return counts, np.zeros(0, dtype=np.int32)
        period = width - 1 - best_end[rows]
        wanted = width + skip[rows, None] + np.arange(k, dtype=np.int64)[None, :]
        source = wanted - period[:, None] * ((wanted - width) // period[:, None] + 1)
        tokens = grid[rows[:, None], source]
        return counts, tokens.ravel().astype(np.int32)


def _grid(
    histories: Sequence[npt.ArrayLike], max_search: int | None
) -> tuple[npt.NDArray[np.int32], IntArray]:
    """See :meth:`NgramDrafter.grid`."""
    seqs = [np.asarray(h).ravel() for h in histories]
    if max_search is not None:
        seqs = [seq[-max_search:] for seq in seqs]
    lengths = np.array([seq.size for seq in seqs], dtype=np.int64)
    width = max(2, int(lengths.max(initial=0)))
    grid = np.full((len(seqs), width), -1, dtype=np.int32)  # padding matches no token
    for row, seq in enumerate(seqs):  # one slice copy each (a scatter costs 10x more)
        if seq.size:
            grid[row, width - seq.size :] = seq
    return grid, lengths


def greedy_acceptance(
    sampled: npt.ArrayLike,
    draft_counts: npt.ArrayLike,
    draft_tokens: npt.ArrayLike,
    eos: npt.ArrayLike | None = None,
) -> tuple[IntArray, npt.NDArray[np.bool_]]:
    """Greedy verification of a step's drafts, on the host.

    Args:
        sampled: the step's sampled tokens in ``sample_ids`` order: ``1 + k_i`` rows for
            generation entry ``i`` (the argmax at its decode position, then at each draft's),
            then one row per completing context chunk.
        draft_counts: ``k_i`` per generation entry.
        draft_tokens: the drafts, concatenated in entry order.
        eos: per sampled row, whether it is an end-of-sequence token (``None``: none is).

    Returns:
        ``accepted`` (int64, per generation entry): the leading drafts equal to the argmax
        at the position before each (draft ``j`` is accepted iff it equals row ``j`` of its
        entry and every draft before it was accepted), what ``update(..., accepted=)`` takes;
        and ``kept`` (bool, per sampled row): the rows the scheduler keeps (each entry's first
        ``accepted + 1`` rows, cut after the first EOS among them; every context row).
    """
    rows = np.asarray(sampled, dtype=np.int64).ravel()
    counts = np.asarray(draft_counts, dtype=np.int64).ravel()
    drafts = np.asarray(draft_tokens, dtype=np.int64).ravel()
    entries = int(counts.size)
    gen_rows = int(counts.sum()) + entries
    if drafts.size != gen_rows - entries or rows.size < gen_rows:
        raise ValueError(
            f"{drafts.size} draft tokens and {rows.size} rows do not fit draft counts "
            f"summing to {gen_rows - entries} over {entries} entries"
        )
    row_starts = np.cumsum(counts + 1) - (counts + 1)  # each entry's first row
    entry_of_draft = np.repeat(np.arange(entries, dtype=np.int64), counts)
    within = np.arange(drafts.size, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    # draft j of entry i is compared with row j of entry i (the argmax before it)
    equal = drafts == rows[row_starts[entry_of_draft] + within]
    # accepted = index of the first mismatch within the entry, or k if none
    first_miss = np.where(equal, counts[entry_of_draft], within)
    accepted = counts.copy()
    if drafts.size:
        np.minimum.at(accepted, entry_of_draft, first_miss)
    kept = np.ones(rows.size, dtype=bool)
    row_entry = np.repeat(np.arange(entries, dtype=np.int64), counts + 1)
    row_within = np.arange(gen_rows, dtype=np.int64) - np.repeat(row_starts, counts + 1)
    limit = accepted.copy()
    if eos is not None:
        flags = np.asarray(eos, dtype=bool).ravel()[:gen_rows]
        hit = np.where(flags, row_within, np.iinfo(np.int64).max)
        first_eos = np.full(entries, np.iinfo(np.int64).max, dtype=np.int64)
        if gen_rows:
            np.minimum.at(first_eos, row_entry, hit)
        limit = np.minimum(limit, first_eos)
    kept[:gen_rows] = row_within <= limit[row_entry]
    return accepted, kept


__all__ = ["NgramDrafter", "greedy_acceptance"]
