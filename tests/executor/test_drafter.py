"""Unit tests of speculative decoding's host side: the prompt-lookup drafter, greedy
acceptance and :class:`StepPlan` of a drafted step, each against a brute-force oracle."""

from __future__ import annotations

import numpy as np
import pytest

import helix_kv
from helix_kv.executor.drafter import NgramDrafter, greedy_acceptance
from helix_kv.executor.placement import RankPlacement
from helix_kv.executor.step_plan import StepPlan

from ..helpers.scheduler import needs_scheduler


def oracle_draft(
    tokens: list[int], k: int, max_n: int, min_n: int, skip: int = 0, max_search: int | None = None
) -> list[int]:
    """Longest n first; of its matches the most recent one; what followed it, extended token
    by token with the period between the match and the tail, without its first ``skip``."""
    seq = tokens[-max_search:] if max_search else list(tokens)
    length = len(seq)
    for n in range(max_n, min_n - 1, -1):
        if length < n + 1:
            continue
        tail = seq[length - n :]
        for start in range(length - n - 1, -1, -1):  # window seq[start:start + n]
            if seq[start : start + n] == tail:
                period = length - (start + n)
                extended = list(seq)
                while len(extended) < length + skip + k:
                    extended.append(extended[-period])
                return extended[length + skip :]
    return []


def test_draft_examples():
    d = NgramDrafter(num_speculative_tokens=3, max_ngram=3, min_ngram=1)
    assert d.draft([1, 2, 3, 4, 1, 2]).tolist() == [3, 4, 1]  # "1 2" seen at 0
    assert d.draft([1, 2, 3, 9, 2, 3, 7, 1, 2, 3]).tolist() == [9, 2, 3]  # "1 2 3" beats "2 3"
    assert d.draft([5, 6, 7]).tolist() == []  # nothing repeats
    assert d.draft([]).tolist() == []
    assert d.draft([4]).tolist() == []
    assert d.draft([7, 7]).tolist() == [7, 7, 7]  # a cycle of 1 continues
    assert d.draft([4, 1, 2, 1, 2]).tolist() == [1, 2, 1]  # "1 2" at 1: period 2
    # one step ahead: the continuation's first token guesses the token in flight
    assert d.draft([1, 2, 3, 4, 5, 1, 2], skip=1).tolist() == [4, 5, 1]
    assert d.draft([9, 5, 5], skip=1).tolist() == [5, 5, 5]
    assert NgramDrafter(2, max_ngram=2, min_ngram=2).draft([3, 1, 4, 1]).tolist() == []


@pytest.mark.parametrize("seed", range(40))
def test_draft_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    vocab = int(rng.integers(2, 6))  # small vocabularies: many repeats
    length = int(rng.integers(0, 60))
    tokens = rng.integers(0, vocab, size=length).tolist()
    k = int(rng.integers(1, 6))
    min_n = int(rng.integers(1, 4))
    max_n = int(rng.integers(min_n, 5))
    skip = int(rng.integers(0, 2))
    search = None if seed % 3 else int(rng.integers(2, 30))
    drafter = NgramDrafter(k, max_n, min_n, search)
    assert drafter.draft(tokens, skip).tolist() == oracle_draft(
        tokens, k, max_n, min_n, skip, search
    )


def test_propose_concatenates():
    d = NgramDrafter(2)
    counts, flat = d.propose([[1, 2, 1], [3, 4], [5, 5, 5]], [0, 0, 1])
    assert counts.tolist() == [2, 0, 2]
    assert flat.dtype == np.int32
    assert flat.tolist() == [2, 1, 5, 5]


@pytest.mark.parametrize("seed", range(20))
def test_propose_equals_draft_of_each(seed):
    """The batched search gives each history's own drafts (lengths 0 up, shared padding)."""
    rng = np.random.default_rng(500 + seed)
    k = int(rng.integers(1, 6))
    min_n = int(rng.integers(1, 3))
    max_n = int(rng.integers(min_n, 5))
    search = None if seed % 4 else int(rng.integers(2, 20))
    drafter = NgramDrafter(k, max_n, min_n, search)
    histories = [
        rng.integers(0, int(rng.integers(1, 6)), size=int(rng.integers(0, 40)))
        for _ in range(int(rng.integers(1, 9)))
    ]
    skips = rng.integers(0, 2, size=len(histories))
    counts, flat = drafter.propose(histories, skips)
    want = [drafter.draft(h, int(s)) for h, s in zip(histories, skips)]
    assert counts.tolist() == [w.size for w in want]
    assert flat.tolist() == np.concatenate([*want, np.zeros(0, np.int64)]).tolist()


def test_drafter_refuses_bad_sizes():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramDrafter(0)
    for args in ((2, 1, 2), (2, 3, 0)):
        with pytest.raises(ValueError, match="min_ngram"):
            NgramDrafter(*args)
    with pytest.raises(ValueError, match="max_search"):
        NgramDrafter(2, max_search=1)


def oracle_acceptance(sampled, counts, drafts, eos=None):
    accepted, kept, row, d = [], [], 0, 0
    for k in counts:
        rows = sampled[row : row + 1 + k]
        a = 0
        while a < k and drafts[d + a] == rows[a]:
            a += 1
        limit = a
        if eos is not None:
            flags = eos[row : row + 1 + k]
            hits = [j for j in range(1 + k) if flags[j]]
            if hits:
                limit = min(limit, hits[0])
        accepted.append(a)
        kept += [j <= limit for j in range(1 + k)]
        row += 1 + k
        d += k
    kept += [True] * (len(sampled) - row)
    return accepted, kept


@pytest.mark.parametrize("seed", range(30))
def test_greedy_acceptance_matches_brute_force(seed):
    rng = np.random.default_rng(100 + seed)
    entries = int(rng.integers(0, 7))
    counts = rng.integers(0, 5, size=entries)
    contexts = int(rng.integers(0, 3))
    rows = int(counts.sum()) + entries + contexts
    sampled = rng.integers(0, 3, size=rows)  # 3 tokens: drafts often right
    drafts = rng.integers(0, 3, size=int(counts.sum()))
    eos = rng.random(rows) < 0.15 if seed % 2 else None
    accepted, kept = greedy_acceptance(sampled, counts, drafts, eos)
    want_accepted, want_kept = oracle_acceptance(
        sampled.tolist(), counts.tolist(), drafts.tolist(), None if eos is None else eos.tolist()
    )
    assert accepted.tolist() == want_accepted
    assert kept.tolist() == want_kept


def test_greedy_acceptance_refuses_mismatched_arrays():
    with pytest.raises(ValueError, match="do not fit"):
        greedy_acceptance([1, 2], [2], [1, 2])  # 3 rows needed


@needs_scheduler
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_step_plan_with_drafts_matches_brute_force(cp):
    """A real scheduler's drafted steps: every token's position, input, slot, each entry's
    local and past-seen lengths and the sampled rows, recomputed by hand."""
    tpb = 4
    config = helix_kv.SchedulerConfig(
        cp_size=cp,
        cp_rank=cp - 1,
        tokens_per_block=tpb,
        kv_superblocks=64,
        max_batch_size=8,
        max_num_tokens=48,
        num_speculative_tokens=5,
    )
    scheduler = helix_kv.Scheduler(config)
    rng = np.random.default_rng(cp)
    for rid in range(5):
        scheduler.add_request(rid, rng.integers(0, 50, size=3 + 7 * rid).astype(np.int32), 30)
    placement = RankPlacement(cp, tpb, cp - 1)
    drafted_steps = 0
    for _ in range(12):
        live = [r for r in range(5) if scheduler.request_state(r) == "decoding"]
        if live:
            counts = rng.integers(0, 6, size=len(live))
            drafts = rng.integers(0, 50, size=int(counts.sum())).astype(np.int32)
            scheduler.propose_drafts(np.array(live), counts, drafts)
        out = scheduler.schedule()
        plan = StepPlan.from_schedule(scheduler, out, placement)
        check_plan(plan, out, scheduler, placement)
        drafted_steps += plan.num_draft_tokens > 0
        dc = np.asarray(out.generation_draft_counts, dtype=np.int64)
        tokens = rng.integers(0, 50, size=out.num_samples).astype(np.int32)
        accepted = rng.integers(0, dc + 1) if dc.size else None
        scheduler.update(tokens, None, accepted)
    assert drafted_steps >= 3


def check_plan(plan: StepPlan, out, scheduler, placement: RankPlacement) -> None:
    tpb, cp, rank = placement.tokens_per_block, placement.cp_size, placement.cp_rank
    gen = np.asarray(out.generation_ids).tolist()
    dc = np.asarray(out.generation_draft_counts, dtype=np.int64).tolist() or [0] * len(gen)
    drafts = np.asarray(out.generation_draft_tokens).tolist()
    ids, starts, counts, tokens = [], [], [], []
    d = 0
    for i, rid in enumerate(gen):
        ids.append(rid)
        starts.append(int(out.generation_positions[i]))
        counts.append(1 + dc[i])
        tokens += [int(out.generation_input_tokens[i]), *drafts[d : d + dc[i]]]
        d += dc[i]
    ctx_tokens = np.asarray(out.context_token_ids).tolist()
    offset = 0
    for i, rid in enumerate(np.asarray(out.context_ids).tolist()):
        n = int(out.context_lens[i])
        ids.append(rid)
        starts.append(int(out.context_starts[i]))
        counts.append(n)
        tokens += ctx_tokens[offset : offset + n]
        offset += n
    assert plan.request_ids.tolist() == ids
    assert plan.starts.tolist() == starts
    assert plan.counts.tolist() == counts
    assert plan.token_ids.tolist() == tokens
    assert plan.num_generation == len(gen)
    assert plan.num_draft_tokens == sum(dc)
    assert plan.num_tokens == out.num_tokens
    table = scheduler.block_table(np.array(ids, dtype=np.int64)) if ids else None

    def owned(pos: int) -> bool:
        return (pos // tpb) % cp == rank

    slots, row = [], 0
    for e, (start, n) in enumerate(zip(starts, counts)):
        for pos in range(start, start + n):
            if owned(pos):
                page = table[e][pos // (tpb * cp)]
                slots.append(int(page) * tpb + pos % tpb)
            else:
                slots.append(-1)
        row += n
        local_after = sum(owned(p) for p in range(start + n))
        local_before = sum(owned(p) for p in range(start))
        assert plan.local_lens[e] == local_after, (e, start, n)
        assert plan.past_seen_lens[e] == local_before
    assert plan.slot_mapping.tolist() == slots
    # every generation row, then each completing chunk's last token: sample_ids order
    gen_rows = list(range(sum(counts[: len(gen)])))
    ends = np.cumsum(counts)[len(gen) :] - 1
    done = np.asarray(out.context_completes, dtype=bool)
    assert plan.sample_index.tolist() == gen_rows + ends[done].tolist()
    assert len(plan.sample_index) == out.num_samples
    sample_ids = np.asarray(out.sample_ids).tolist()
    assert [
        plan.request_ids[np.searchsorted(np.cumsum(counts), r, "right")] for r in plan.sample_index
    ] == sample_ids
