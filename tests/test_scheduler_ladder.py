"""The preemption ladder through the binding: no futile preemption, and liveness that does not
depend on ``max_preemptions_per_request`` (the executor in ``scheduler_harness`` checks every
step that each preemption's requester is served in it, and that only the queue head takes a
victim past its bound)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import helix_kv

from .helpers.harness import Executor, Spec, assert_matches_reference


@st.composite
def aggregated_cases(draw) -> tuple:
    """Aggregated Helix under pressure: every request fits the pool alone, bound 1..3."""
    cp = draw(st.integers(1, 4))
    tpb = draw(st.integers(1, 6))
    specs = [
        Spec(
            i + 1,
            draw(st.integers(1, 40)),
            draw(st.integers(1, 24)),
            draw(st.integers(-2, 2)),
            draw(st.integers(0, 4)),
        )
        for i in range(draw(st.integers(2, 10)))
    ]
    sizes = [s.prompt_len + s.max_new_tokens for s in specs]
    spare = draw(st.integers(0, 40))
    pool_tokens = max(sizes) + (sum(sizes) - max(sizes)) * spare // 100
    unit = draw(st.integers(1, 8))
    max_num_tokens = max(unit, draw(st.integers(8, 80)))
    # without chunks a re-prefill (prompt + all but the last output token) must fit one step
    chunked = draw(st.booleans()) or max(sizes) - 1 > max_num_tokens
    kwargs = {
        "cp_size": cp,
        "tokens_per_block": tpb,
        "kv_superblocks": -(-pool_tokens // (cp * tpb)),
        "victim_policy": draw(
            st.sampled_from(["newest_first", "least_computed_first", "priority"])
        ),
        "max_batch_size": draw(st.integers(1, 12)),
        "enable_chunked_prefill": chunked,
        "chunk_unit": unit,
        "max_num_tokens": max_num_tokens,
        "max_preemptions_per_request": draw(st.integers(1, 3)),
        "admit_after_preemption": draw(st.booleans()),
        "deadlock_steps": 8,
    }
    return kwargs, specs, draw(st.sampled_from([0, 0, 3, 7]))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(aggregated_cases())
def test_no_bound_deadlocks_a_workload_whose_requests_fit_alone(case: tuple) -> None:
    kwargs, specs, revert_every = case
    config = helix_kv.SchedulerConfig(**kwargs)
    result = Executor(config).run(specs, revert_every=revert_every, max_steps=20_000)
    assert_matches_reference(specs, result)


def test_the_queue_head_takes_a_victim_past_its_bound() -> None:
    # tpb 1, 19 superblocks, bound 1, 8 tokens a step: request 1 (19 tokens) and 2 (17, a
    # step later) each fit alone; before the fix the pair wedged with DeadlockError
    config = helix_kv.SchedulerConfig(
        tokens_per_block=1,
        kv_superblocks=19,
        max_batch_size=3,
        max_num_tokens=8,
        chunk_unit=1,
        max_preemptions_per_request=1,
        deadlock_steps=8,
    )
    specs = [Spec(1, 1, 18), Spec(2, 1, 16, arrival_step=1)]
    result = Executor(config).run(specs)
    assert_matches_reference(specs, result)
    assert result.preemptions_past_bound > 0
    assert set(result.victims) == {(2, 1)}
