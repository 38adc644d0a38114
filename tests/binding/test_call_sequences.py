"""Hypothesis: random call sequences through the binding (bad calls, aborts in any state and
unknown ids included) keep two ranks identical, and a call that fails changes nothing.

Random configurations and workloads through a simulated CP group (every invariant, with random
aborts too) are the Rust property tests ``rust/core/tests/scheduler_props.rs``."""

from __future__ import annotations

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

import helix_kv
from tests.helpers import examples

CALL = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 6), st.integers(0, 12), st.integers(-1, 6)),
    st.tuples(st.just("schedule")),
    st.tuples(st.just("update"), st.sampled_from([0, 0, 0, 1]), st.booleans()),
    st.tuples(st.just("revert")),
    st.tuples(st.just("take"), st.integers(0, 6)),
)
CALLS = st.lists(CALL, max_size=60)


def apply(s: helix_kv.Scheduler, call: tuple, rng: np.random.Generator, samples: dict) -> str:
    """Applies one call; returns a printable outcome so two ranks can be compared.
    ``samples[id(s)]`` remembers how many tokens the last schedule asked for."""
    before = s.state_digest()
    try:
        if call[0] == "add":
            _, request_id, prompt_len, max_new = call
            s.add_request(request_id, np.arange(prompt_len, dtype=np.int32), max_new)
        elif call[0] == "schedule":
            out = s.schedule()
            samples[id(s)] = out.num_samples
            return f"scheduled {out.digest}"
        elif call[0] == "update":
            _, missing, with_eos = call  # missing > 0: a wrong token count, which must fail
            count = max(samples.get(id(s), 0) - missing, 0)
            tokens = rng.integers(0, 50, size=count).astype(np.int32)
            eos = rng.random(count) < 0.2 if with_eos else None
            return f"finished {s.update(tokens, eos).tolist()}"
        elif call[0] == "revert":
            return f"reverted, aborted {s.revert().tolist()}"
        elif call[0] == "abort":
            s.abort_many(list(call[1]))
        else:
            output = s.take_output(call[1])
            return f"output {output.token_ids.tolist()} {output.finish_reason}"
    except helix_kv.HelixKVError as error:
        failure = f"{type(error).__name__}: {error}"
    else:
        return "ok"
    assert s.state_digest() == before, f"{call} failed ({failure}) but changed the state"
    return failure


def run_calls(calls: list, seed: int) -> list:
    """Feeds ``calls`` to two ranks, checking after each that they ended alike."""
    config = helix_kv.SchedulerConfig(
        cp_size=2, tokens_per_block=2, kv_superblocks=6, max_num_tokens=16, chunk_unit=2
    )
    ranks = [helix_kv.Scheduler(config.with_rank(r)) for r in range(2)]
    samples: dict = {}
    for index, call in enumerate(calls):
        outcomes = [apply(s, call, np.random.default_rng(seed + index), samples) for s in ranks]
        assert outcomes[0] == outcomes[1]
        assert ranks[0].state_digest() == ranks[1].state_digest()
    for s in ranks:
        held = s.metrics().kv_used_superblocks
        assert 0 <= held <= config.kv_superblocks
    return ranks


@settings(max_examples=examples(60), deadline=None)
@given(CALLS, st.integers(0, 2**32 - 1))
def test_random_call_sequences_keep_two_ranks_identical(calls: list, seed: int) -> None:
    run_calls(calls, seed)


CALLS_WITH_ABORTS = st.lists(
    st.one_of(CALL, st.tuples(st.just("abort"), st.lists(st.integers(0, 6), max_size=3))),
    max_size=60,
)


@settings(max_examples=examples(60), deadline=None)
@given(CALLS_WITH_ABORTS, st.integers(0, 2**32 - 1))
# Found by hypothesis: the request finishes (EOS) in step 0 while step 1, planned ahead,
# still refers to it; its page is held until step 1 is reverted.
@example(
    [
        ("add", 0, 1, 2),
        ("schedule",),
        ("schedule",),
        ("schedule",),
        ("add", 0, 0, 0),
        ("schedule",),
        ("update", 0, True),
    ],
    8792,
)
def test_random_call_sequences_with_aborts_keep_two_ranks_identical(calls: list, seed: int) -> None:
    """Aborts in any state, pending step or not, unknown ids included: every call ends alike
    on both ranks, a failed call changes nothing, and no page outlives its request. A request
    that finished while a newer step still refers to it keeps its pages until that step closes
    (its forward may be writing them), so the pending steps are reverted first."""
    for s in run_calls(calls, seed):
        while s.pending_steps():
            s.revert()
        if s.num_live == 0:
            assert s.metrics().kv_used_superblocks == 0
            assert s.host_used_superblocks == 0
