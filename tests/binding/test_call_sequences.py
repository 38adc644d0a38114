"""Hypothesis: random configurations and workloads through a simulated CP group keep every
invariant (with random aborts too), and random call sequences (bad calls and aborts included)
keep two ranks identical."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import helix_kv

from ..helpers.harness import (
    Executor,
    Model,
    Spec,
    assert_matches_reference,
    assert_matches_reference_with_aborts,
)

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw) -> tuple:
    mode = draw(
        st.sampled_from(["aggregated_helix"] * 4 + ["non_helix"] * 2 + ["disaggregated_generation"])
    )
    cp = 1 if mode == "non_helix" else draw(st.sampled_from([1, 2, 4]))
    tpb = draw(st.integers(1, 4))
    specs = [
        Spec(
            i + 1,
            draw(st.integers(1, 30)),
            draw(st.integers(1, 20)),
            draw(st.integers(-3, 3)),
            draw(st.integers(0, 2)),
        )
        for i in range(draw(st.integers(2, 10)))
    ]
    sizes = [s.prompt_len + s.max_new_tokens for s in specs]
    spare = draw(st.integers(0, 40))
    pool_tokens = max(sizes) + (sum(sizes) - max(sizes)) * spare // 100
    unit = draw(st.integers(1, 8))
    bound = draw(st.integers(0, 8))
    kwargs = {
        "cp_size": cp,
        "tokens_per_block": tpb,
        "kv_superblocks": -(-pool_tokens // (cp * tpb)),
        "serving_mode": mode,
        "host_tier_superblocks": draw(st.integers(0, 6)) if mode == "non_helix" else 0,
        "capacity_policy": draw(st.sampled_from(["max_utilization"] * 4 + ["guaranteed_no_evict"])),
        "victim_policy": draw(
            st.sampled_from(["newest_first", "least_computed_first", "priority"])
        ),
        "max_batch_size": draw(st.integers(2, 12)),
        "enable_chunked_prefill": draw(st.booleans()),
        "chunk_unit": unit,
        "max_num_tokens": max(unit, draw(st.integers(8, 64))),
        "max_preemptions_per_request": 1000 if bound > 5 else bound,
        "admit_after_preemption": draw(st.booleans()),
        "deadlock_steps": 12,
    }
    model = Model(vocab=24, eos=5) if draw(st.booleans()) else Model()
    return kwargs, specs, model, draw(st.sampled_from([0, 0, 3, 7]))


def accepted(config: helix_kv.SchedulerConfig, specs: list) -> list:
    """The requests the configuration accepts; refusals change nothing."""
    probe = helix_kv.Scheduler(config)
    kept = []
    for spec in specs:
        before = probe.state_digest()
        try:
            probe.add_request(spec.request_id, spec.prompt(), spec.max_new_tokens, spec.priority)
            kept.append(spec)
        except helix_kv.RequestTooLargeError:
            assert probe.state_digest() == before
    return kept


@FAST
@given(cases())
def test_random_configs_and_workloads_keep_every_invariant(case: tuple) -> None:
    kwargs, specs, model, revert_every = case
    config = helix_kv.SchedulerConfig(**kwargs)
    specs = accepted(config, specs)
    if not specs:
        return
    executor = Executor(config, model)
    stopped: helix_kv.HelixKVError | None = None
    try:
        result = executor.run(specs, revert_every=revert_every)
    except (helix_kv.DeadlockError, helix_kv.PreemptionDisabledError) as error:
        stopped = error
    if isinstance(stopped, helix_kv.DeadlockError):
        # only a preemption bound that ran out, or a server that may not preempt, can wedge
        # a group whose every request fits the pool
        bound_hit = executor.result.max_request_preemptions >= config.max_preemptions_per_request
        assert bound_hit or config.serving_mode == "disaggregated_generation", str(stopped)
        if config.serving_mode == "aggregated_helix":
            assert "host" not in str(stopped)
        return
    if stopped is not None:
        assert config.serving_mode == "disaggregated_generation", str(stopped)
        return
    assert_matches_reference(specs, result, model)
    assert result.metrics.preemptions == 0 or config.capacity_policy == "max_utilization"
    assert result.metrics.suspensions == 0 or config.host_tier_superblocks > 0


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


@settings(max_examples=60, deadline=None)
@given(CALLS, st.integers(0, 2**32 - 1))
def test_random_call_sequences_keep_two_ranks_identical(calls: list, seed: int) -> None:
    run_calls(calls, seed)


def check_early_stop(config: helix_kv.SchedulerConfig, executor: Executor, error) -> None:
    """The only documented ways a run may stop early (see the test above)."""
    if isinstance(error, helix_kv.DeadlockError):
        bound_hit = executor.result.max_request_preemptions == config.max_preemptions_per_request
        assert bound_hit or config.serving_mode == "disaggregated_generation", str(error)
    else:
        assert config.serving_mode == "disaggregated_generation", str(error)


@FAST
@given(cases(), st.lists(st.tuples(st.integers(0, 30), st.booleans()), min_size=10, max_size=10),
       st.lists(st.booleans(), min_size=10, max_size=10))  # fmt: skip
def test_random_aborts_keep_every_invariant(case: tuple, aborts: list, chosen: list) -> None:
    """Aborts between steps and while a step is pending (reverts mixed in): ranks agree,
    nothing leaks (the harness checks pages and the host tier), aborted outputs are the start
    of the full ones, and the survivors generate what they would without the aborted ones."""
    kwargs, specs, model, revert_every = case
    config = helix_kv.SchedulerConfig(**kwargs)
    specs = [
        Spec(s.request_id, s.prompt_len, s.max_new_tokens, s.priority, s.arrival_step,
             abort_step=s.arrival_step + after, abort_pending=pending)
        if abort else s
        for s, (after, pending), abort in zip(specs, aborts, chosen)
    ]  # fmt: skip
    specs = accepted(config, specs)
    if not specs:
        return
    executor = Executor(config, model)
    try:
        result = executor.run(specs, revert_every=revert_every)
    except (helix_kv.DeadlockError, helix_kv.PreemptionDisabledError) as error:
        check_early_stop(config, executor, error)
        return
    assert_matches_reference_with_aborts(specs, result, model)
    survivors = [
        Spec(s.request_id, s.prompt_len, s.max_new_tokens, s.priority, s.arrival_step)
        for s in specs
        if s.request_id not in result.aborted
    ]
    if not survivors:
        return
    alone = Executor(config, model)
    try:
        without = alone.run(survivors, revert_every=revert_every)
    except (helix_kv.DeadlockError, helix_kv.PreemptionDisabledError) as error:
        check_early_stop(config, alone, error)  # the pressure changed, so may its outcome
        return
    assert without.outputs == result.outputs


CALLS_WITH_ABORTS = st.lists(
    st.one_of(CALL, st.tuples(st.just("abort"), st.lists(st.integers(0, 6), max_size=3))),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(CALLS_WITH_ABORTS, st.integers(0, 2**32 - 1))
def test_random_call_sequences_with_aborts_keep_two_ranks_identical(calls: list, seed: int) -> None:
    """Aborts in any state, pending step or not, unknown ids included: every call ends alike
    on both ranks, a failed call changes nothing, and no page outlives its request."""
    for s in run_calls(calls, seed):
        if s.num_live == 0:
            assert s.metrics().kv_used_superblocks == 0
            assert s.host_used_superblocks == 0
