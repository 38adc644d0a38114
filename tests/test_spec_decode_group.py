"""Speculative decoding through the simulated CP group, on random workloads: seeded drafts
(some the model's true continuation, some wrong) for every decoding request, verified at every
query position from the KV read back, greedy acceptance. Every rank decides alike (the group
checks each call), the KV each query reads is its own context with the drafts before it, and
the outputs equal a run without drafts, pressure or caching: plain and one step ahead, with
reverts, aborts, end-of-sequence, the host tier and prefix caching."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import helix_kv

from .helpers import examples
from .helpers.harness import (
    Executor,
    Model,
    Spec,
    assert_matches_reference,
    assert_matches_reference_with_aborts,
)
from .helpers.scheduler import config


@settings(max_examples=examples(40), deadline=None)
@given(
    cp=st.sampled_from([1, 2, 4]),
    overlap=st.booleans(),
    revert_every=st.sampled_from([0, 3, 7]),
    drafts=st.integers(1, 4),
    caching=st.booleans(),
    shared=st.sampled_from([0, 8, 16]),
    lengths=st.lists(
        st.tuples(st.integers(1, 20), st.integers(1, 14), st.integers(0, 6)),
        min_size=1,
        max_size=10,
    ),
    spare=st.integers(0, 80),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_drafts_match_the_reference(
    cp: int,
    overlap: bool,
    revert_every: int,
    drafts: int,
    caching: bool,
    shared: int,
    lengths: list[tuple[int, int, int]],
    spare: int,
    seed: int,
) -> None:
    specs = [
        Spec(i, own, new, arrival_step=at, shared_prefix=shared if i % 3 else shared // 2)
        for i, (own, new, at) in enumerate(lengths)
    ]
    largest = max(s.shared_prefix + s.prompt_len + s.max_new_tokens for s in specs)
    superblock = 4 * cp
    kv_superblocks = -(-largest // superblock) + 1 + spare // superblock
    cfg = config(
        cp, 4, kv_superblocks, max_num_tokens=16, chunk_unit=4, enable_prefix_caching=caching,
        max_preemptions_per_request=1000, num_speculative_tokens=4,
    )  # fmt: skip
    result = Executor(cfg, overlap=overlap, drafts=drafts, seed=seed).run(
        specs, revert_every=revert_every
    )
    assert_matches_reference(specs, result)
    assert result.metrics is not None
    assert result.metrics.spec_decode_num_draft_tokens == result.draft_tokens
    assert result.metrics.spec_decode_num_accepted_tokens == result.accepted_tokens


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "one_step_ahead"])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_drafts_under_pressure_with_aborts_and_eos(cp: int, overlap: bool) -> None:
    """A tight pool (preemptions), aborts while pending, and a model with an end-of-sequence
    token: drafts give way, accepted tokens past an EOS are dropped, outputs equal."""
    model = Model(vocab=40, eos=3)
    specs = [Spec(i, 3 + 5 * (i % 4), 10 + (i % 5) * 3, arrival_step=i // 3) for i in range(12)] + [
        Spec(12, 6, 20, abort_step=5, abort_pending=True),
        Spec(13, 9, 20, abort_step=8),
    ]
    cfg = config(
        cp, 4, kv_tokens=96, max_num_tokens=24, chunk_unit=4, num_speculative_tokens=3,
        max_preemptions_per_request=1000,
    )  # fmt: skip
    result = Executor(cfg, model=model, overlap=overlap, drafts=3, seed=cp).run(specs)
    assert_matches_reference_with_aborts(specs, result, model)
    assert result.metrics is not None
    assert result.metrics.spec_decode_num_accepted_tokens > 0
    assert result.victims, "the pool is tight enough to preempt"


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "one_step_ahead"])
@pytest.mark.parametrize("cp", [1, 2])
def test_drafts_with_the_host_tier(cp: int, overlap: bool) -> None:
    """Aggregated Helix with a host tier: victims are suspended and resumed while others
    verify drafts; outputs equal."""
    specs = [Spec(i, 4 + 3 * (i % 5), 16, arrival_step=i // 2) for i in range(10)]
    cfg = config(
        cp, 4, kv_tokens=128, host_tier_superblocks=32 // cp, num_speculative_tokens=4,
        max_num_tokens=32, chunk_unit=4,
    )  # fmt: skip
    result = Executor(cfg, overlap=overlap, drafts=4, seed=7).run(specs, revert_every=5)
    assert_matches_reference(specs, result)
    assert result.resumed > 0, "the pool is tight enough to suspend"
    assert result.accepted_tokens > 0


def test_a_rank_fed_other_drafts_or_accepted_counts_is_caught() -> None:
    """Every input is the same on every rank: a rank proposed other drafts diverges in that
    step's schedule, and one fed another accepted count in the next step's."""
    cfg = config(2, 4, 32, num_speculative_tokens=2)
    for wrong in ("drafts", "accepted"):
        group = helix_kv.SimulatedCPGroup(cfg)
        group.add_request(1, np.arange(1, 9, dtype=np.int32), 12)
        out = group.schedule()
        group.update(np.full(out.num_samples, 5, np.int32))
        ranks = group.schedulers
        for rank, scheduler in enumerate(ranks):
            token = 6 + (rank if wrong == "drafts" else 0)
            scheduler.propose_drafts([1], [2], [token, 7])
        if wrong == "drafts":
            with pytest.raises(helix_kv.ScheduleMismatchError):
                group.schedule()
            continue
        out = group.schedule()
        assert out.generation_draft_counts.tolist() == [2]
        for rank, scheduler in enumerate(ranks):
            scheduler.update(np.full(3, 5, np.int32), None, [rank])
        with pytest.raises(helix_kv.ScheduleMismatchError):
            group.schedule()
