"""Prefix caching through the simulated CP group, on random workloads: requests sharing
system prompts of several lengths (some salted apart), chunked prefill under KV pressure,
reverted steps, plain and one step ahead. Every rank decides alike (the group checks each
call), cached KV read back holds each request's own tokens (the harness checks each read),
and the outputs equal a run without pressure or caching."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from .helpers import examples
from .helpers.harness import Executor, Spec, assert_matches_reference
from .helpers.scheduler import config


@settings(max_examples=examples(40), deadline=None)
@given(
    cp=st.sampled_from([1, 2, 4]),
    overlap=st.booleans(),
    revert_every=st.sampled_from([0, 3, 7]),
    shared=st.sampled_from([0, 8, 16, 33]),
    lengths=st.lists(
        st.tuples(st.integers(1, 20), st.integers(1, 12), st.integers(0, 6)),
        min_size=1,
        max_size=10,
    ),
    spare=st.integers(0, 80),
)
def test_random_workloads_with_shared_prompts_match_the_reference(
    cp: int,
    overlap: bool,
    revert_every: int,
    shared: int,
    lengths: list[tuple[int, int, int]],
    spare: int,
) -> None:
    specs = [
        Spec(i, own, new, arrival_step=at, shared_prefix=shared if i % 3 else shared // 2)
        for i, (own, new, at) in enumerate(lengths)
    ]
    largest = max(s.shared_prefix + s.prompt_len + s.max_new_tokens for s in specs)
    superblock = 4 * cp
    kv_superblocks = -(-largest // superblock) + 1 + spare // superblock
    cfg = config(
        cp, 4, kv_superblocks, max_num_tokens=16, chunk_unit=4, enable_prefix_caching=True,
        max_preemptions_per_request=1000,
    )  # fmt: skip
    result = Executor(cfg, overlap=overlap).run(specs, revert_every=revert_every)
    assert_matches_reference(specs, result)
    assert result.metrics is not None
    assert result.metrics.prefix_cache_hits <= result.metrics.prefix_cache_queries
