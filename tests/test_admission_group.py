"""Priority admission and the prefill cap through the simulated CP group, on random workloads
with priorities: every rank decides alike (the group checks each call), the queue is in
admission order after every add, victims are behind their requesters in it (never more
important, under priority admission), and the outputs equal a run without pressure: plain and
one step ahead, with reverts, aborts, prefix caching and drafts."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from .helpers import examples
from .helpers.harness import Executor, Spec, assert_matches_reference_with_aborts
from .helpers.scheduler import config


@settings(max_examples=examples(40), deadline=None)
@given(
    cp=st.sampled_from([1, 2, 4]),
    overlap=st.booleans(),
    revert_every=st.sampled_from([0, 3, 7]),
    admission=st.sampled_from(["fcfs", "priority"]),
    threshold=st.sampled_from([0, 0, 3, 4, 8, 12]),
    adaptive=st.booleans(),
    caching=st.booleans(),
    drafts=st.sampled_from([0, 0, 2]),
    requests=st.lists(
        st.tuples(
            st.integers(1, 30),  # prompt length
            st.integers(1, 12),  # max_new_tokens
            st.integers(-2, 2),  # priority
            st.integers(0, 6),  # arrival step
            st.one_of(st.none(), st.integers(0, 12)),  # aborted this many steps after arrival
        ),
        min_size=1,
        max_size=10,
    ),
    spare=st.integers(0, 60),
)
def test_random_prioritised_workloads_match_the_reference(
    cp: int,
    overlap: bool,
    revert_every: int,
    admission: str,
    threshold: int,
    adaptive: bool,
    caching: bool,
    drafts: int,
    requests: list[tuple[int, int, int, int, int | None]],
    spare: int,
) -> None:
    shared = 8 if caching else 0
    specs = [
        Spec(
            i,
            own,
            new,
            priority,
            at,
            abort_step=None if after is None else at + after,
            shared_prefix=shared,
        )
        for i, (own, new, priority, at, after) in enumerate(requests)
    ]
    largest = max(s.shared_prefix + s.prompt_len + s.max_new_tokens for s in specs)
    superblock = 4 * cp
    kv_superblocks = -(-largest // superblock) + 1 + spare // superblock
    cfg = config(
        cp, 4, kv_superblocks, max_num_tokens=16, chunk_unit=4, admission_policy=admission,
        long_prefill_token_threshold=threshold, long_prefill_token_threshold_adaptive=adaptive,
        enable_prefix_caching=caching, max_preemptions_per_request=1000,
        num_speculative_tokens=drafts,
    )  # fmt: skip
    result = Executor(cfg, overlap=overlap, drafts=drafts).run(specs, revert_every=revert_every)
    assert_matches_reference_with_aborts(specs, result)
    if admission == "priority":
        priority = {s.request_id: s.priority for s in specs}
        for victim, requester in result.victims:
            assert priority[victim] <= priority[requester], (victim, requester)
