"""``HelixScheduler`` driven as vLLM 0.32's engine core drives it, without a model: what it
refuses, how vLLM's configuration maps onto helix_kv's, and, over random runs (KV pressure,
chunked prefill, prefix caching, drafts accepted and rejected, aborts between ``schedule()``
and ``update_from_output()``, one step ahead), that a model runner of either form (V1:
incremental tables, resumed requests with their whole table; V2: resumed requests as new
ones) holds exactly helix's block tables, that the read-only views agree with the counts,
and that nothing is left behind. Skipped where vLLM is not installed."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (see .ci/vllm_env.sh)")
torch = pytest.importorskip("torch")

from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.interface import PauseState  # noqa: E402
from vllm.v1.engine import FinishReason  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from helix_kv.errors import EngineOptionError  # noqa: E402
from helix_kv.integrations._vllm_config import helix_config  # noqa: E402
from helix_kv.integrations.vllm import HelixScheduler  # noqa: E402

OPT = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": 64,
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "ffn_dim": 128,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "word_embed_proj_dim": 64,
    "do_layer_norm_before": True,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("opt")
    Path(path, "config.json").write_text(json.dumps(OPT))
    return str(path)


def configs(
    model_dir: str,
    *,
    num_blocks: int = 200,
    block_size: int = 16,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 256,
    max_model_len: int = 1024,
    caching: bool = False,
    num_spec: int | None = None,
    async_scheduling: bool = False,
    **scheduler_options: Any,
) -> tuple[Any, Any]:
    """A vLLM engine configuration and KV cache configuration, as vLLM's engine core hands
    them to its scheduler class."""
    model = ModelConfig(
        model=model_dir, skip_tokenizer_init=True, dtype="float16", seed=0,
        max_model_len=max_model_len,
    )  # fmt: skip
    scheduler = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        is_encoder_decoder=False,
        async_scheduling=async_scheduling,
        **scheduler_options,
    )
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=caching)
    speculative = None
    if num_spec:  # one step ahead, vLLM drafts n-grams on the device
        method = "ngram_gpu" if async_scheduling else "ngram"
        speculative = SpeculativeConfig(method=method, num_speculative_tokens=num_spec)
    config = VllmConfig(
        scheduler_config=scheduler,
        model_config=model,
        cache_config=cache,
        device_config=DeviceConfig("cpu"),
        speculative_config=speculative,
    )
    # vLLM's CPU platform turns async scheduling off; the engine of a GPU keeps it.
    object.__setattr__(config.scheduler_config, "async_scheduling", async_scheduling)
    cache.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.float16
    )
    kv = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )  # fmt: skip
    return config, kv


def build(config: Any, kv: Any, block_size: int = 16, v2: bool = False) -> HelixScheduler:
    scheduler = HelixScheduler(
        vllm_config=config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config),
        block_size=block_size,
        log_stats=True,
    )
    scheduler.use_v2_model_runner = v2
    return scheduler


_HASHER: list[Any] = []


#: With ``stops``: the end-of-sequence token and the stop tokens of a request (random
#: tokens are drawn from 5..899, so about 1 in 80 stops it).
EOS, STOP_TOKENS = 7, list(range(10, 20))


def request(
    request_id: str, prompt: list[int], max_tokens: int, caching: bool, stops: bool = False
) -> Request:
    if caching and not _HASHER:
        init_none_hash(sha256)
        _HASHER.append(get_request_block_hasher(16, sha256))
    if stops:
        params = SamplingParams(max_tokens=max_tokens, stop_token_ids=STOP_TOKENS)
        params.update_from_generation_config({}, EOS)
    else:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=params,
        pooling_params=None,
        block_hasher=_HASHER[0] if caching else None,
    )


# -- refused at construction ---------------------------------------------------------------


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)


REFUSALS = {
    "kv_transfer_config": lambda c, kv: _set(
        c,
        "kv_transfer_config",
        KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both"),
    ),
    "enable_lora": lambda c, kv: _set(c, "lora_config", object()),
    "pipeline_parallel_size": lambda c, kv: _set(c.parallel_config, "pipeline_parallel_size", 2),
    "data_parallel_size": lambda c, kv: _set(c.parallel_config, "data_parallel_size", 2),
    "speculative_config.method": lambda c, kv: _set(c.speculative_config, "method", "eagle"),
    "watermark": lambda c, kv: _set(c.scheduler_config, "watermark", 0.01),
    "cp_kv_cache_interleave_size": lambda c, kv: (
        _set(c.parallel_config, "decode_context_parallel_size", 2),
        _set(c.parallel_config, "cp_kv_cache_interleave_size", 1),
    ),
    "model": lambda c, kv: _set(
        kv.kv_cache_groups[0],
        "kv_cache_spec",
        SlidingWindowSpec(
            block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float16, sliding_window=64
        ),
    ),
}


@pytest.mark.parametrize("option", sorted(REFUSALS))
def test_what_it_cannot_serve_is_refused_naming_the_option(model_dir: str, option: str) -> None:
    config, kv = configs(model_dir, num_spec=2)
    REFUSALS[option](config, kv)
    with pytest.raises(EngineOptionError, match="cannot serve") as error:
        build(config, kv)
    assert (error.value.engine, error.value.option) == ("vllm", option)
    assert error.value.reason in str(error.value)


# -- what maps to what --------------------------------------------------------------------


def test_configuration_maps_onto_helix(model_dir: str) -> None:
    config, kv = configs(
        model_dir, num_blocks=50, max_num_seqs=6, max_num_batched_tokens=96, caching=True,
        num_spec=2, max_num_active_seqs=4,
    )  # fmt: skip
    scheduler = build(config, kv)
    helix = scheduler.helix.config
    assert (helix.cp_size, helix.tokens_per_block, helix.kv_superblocks) == (1, 16, 49)
    assert (helix.max_batch_size, helix.max_num_tokens, helix.chunk_unit) == (4, 96, 1)
    assert (helix.enable_prefix_caching, helix.num_speculative_tokens) == (True, 2)
    assert helix.max_seq_len == 1024
    # vLLM's block 0 is its null block: helix page p is vLLM block p + 1.
    scheduler.add_request(request("a", list(range(40)), 4, caching=True))
    out = scheduler.schedule()
    (new,) = out.scheduled_new_reqs
    pages = scheduler.helix.block_table(np.array([0], np.uint64))[0]
    assert new.block_ids == ((pages + 1).tolist(),)
    assert 0 not in new.block_ids[0]


def test_priority_and_the_prefill_cap_map_onto_the_core(model_dir: str) -> None:
    config, kv = configs(
        model_dir, policy="priority", long_prefill_token_threshold=48,
        long_prefill_token_threshold_adaptive=True,
    )  # fmt: skip
    helix, mapping = helix_config(config, kv, 16)
    assert (helix.admission_policy, helix.victim_policy) == ("priority", "priority")
    assert helix.long_prefill_token_threshold == 48
    assert helix.long_prefill_token_threshold_adaptive is True
    assert mapping.priority
    config, kv = configs(model_dir, long_prefill_token_threshold=48)
    helix, mapping = helix_config(config, kv, 16)
    assert (helix.admission_policy, helix.victim_policy) == ("fcfs", "newest_first")
    assert (helix.long_prefill_token_threshold, helix.long_prefill_token_threshold_adaptive) == (
        48,
        False,
    )
    assert not mapping.priority
    # vLLM documents the threshold as a chunked-prefill option; the core caps chunks only
    config, kv = configs(
        model_dir, long_prefill_token_threshold=48, enable_chunked_prefill=False,
        max_num_batched_tokens=1024,
    )  # fmt: skip
    helix, _ = helix_config(config, kv, 16)
    assert (helix.enable_chunked_prefill, helix.long_prefill_token_threshold) == (False, 0)


def test_priority_admits_by_vllm_priority_then_arrival(model_dir: str) -> None:
    config, kv = configs(model_dir, policy="priority", max_num_seqs=1)
    scheduler = build(config, kv)
    for name, priority in (("a", 2), ("b", 0), ("c", 1), ("d", 0)):
        req = request(name, list(range(20)), 3, caching=False)
        req.priority = priority
        scheduler.add_request(req)
    out = scheduler.schedule()
    assert [new.req_id for new in out.scheduled_new_reqs] == ["b"]
    assert [r.request_id for r in scheduler.waiting] == ["d", "c", "a"]


def test_decode_context_parallelism_is_helix_round_robin(model_dir: str) -> None:
    config, kv = configs(model_dir, block_size=16)
    _set(config.parallel_config, "decode_context_parallel_size", 2)
    _set(config.parallel_config, "cp_kv_cache_interleave_size", 16)
    helix, _ = helix_config(config, kv, 32)  # vLLM's scheduler block: 16 x dcp
    assert (helix.cp_size, helix.tokens_per_block) == (2, 16)
    assert helix.layout.owner_rank(16) == 1
    assert helix.layout.owner_rank(32) == 0
    with pytest.raises(EngineOptionError) as error:
        helix_config(config, kv, 16)
    assert error.value.option == "block_size"


# -- a model runner of either form holds helix's tables ----------------------------------


@dataclass
class Runner:
    """What vLLM's model runner keeps of each request: its block table, V1 or V2 style."""

    v2: bool
    #: one step ahead (vLLM's V1 runner then rebuilds a resumed request's outputs from the
    #: tokens the scheduler sends)
    ahead: bool = False
    tables: dict[str, list[int]] = field(default_factory=dict)
    #: the tokens each scheduled request has computed before the step, as the runner reads
    computed: dict[str, int] = field(default_factory=dict)
    #: the requests of the previous step
    previous: set[str] = field(default_factory=set)

    def apply(self, out: Any) -> None:
        self.check_tokens_sent(out.scheduled_cached_reqs)
        self.previous = set(out.num_scheduled_tokens)
        for rid in out.finished_req_ids:
            self.tables.pop(rid, None)
        if self.v2:
            for rid in out.preempted_req_ids or ():
                self.tables.pop(rid, None)
        self.computed = {}
        for new in out.scheduled_new_reqs:
            assert self.v2 or new.req_id not in self.tables
            self.tables[new.req_id] = list(new.block_ids[0])
            self.computed[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        self.computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for rid, blocks in zip(cached.req_ids, cached.new_block_ids):
            if rid in cached.resumed_req_ids:
                assert not self.v2
                self.tables[rid] = list(blocks[0])
            elif blocks is not None:
                self.tables[rid].extend(blocks[0])

    def check_tokens_sent(self, cached: Any) -> None:
        """V1: a cached request's tokens go to the runner when it was not in the previous
        step (vLLM's own scheduler's rule) and, one step ahead, when it resumes (the runner
        reads them there); no others (a table replaced under a request that ran in the
        previous step costs no token list one step at a time). V2 reads none."""
        expected = set()
        if not self.v2:
            resumed = cached.resumed_req_ids if self.ahead else set()
            expected = {r for r in cached.req_ids if r not in self.previous or r in resumed}
        assert set(cached.all_token_ids) == expected


def check_tables(scheduler: HelixScheduler, runner: Runner, out: Any) -> None:
    """Every scheduled request's table in the runner starts with helix's (it may hold a
    page past the end: one rejected drafts gave back), and the runner computes from where
    the request stands (vLLM's ``num_computed_tokens`` counts the scheduled tokens)."""
    for rid, scheduled in out.num_scheduled_tokens.items():
        req = scheduler._req_of[scheduler._hid_of[rid]]
        assert runner.computed[rid] + scheduled == req.num_computed_tokens, rid
        hid = scheduler._hid_of[rid]
        table = scheduler.helix.block_table(np.array([hid], np.uint64))[0]
        held = (table[table >= 0] + 1).tolist()
        assert runner.tables[rid][: len(held)] == held, rid


def check_views(scheduler: HelixScheduler, arrival: dict[str, int] | None = None) -> None:
    """The views agree with the counts and the statuses; with ``arrival`` (each request's
    place in the order it was added), each view is in vLLM's priority order."""
    running, waiting = scheduler.running, scheduler.waiting
    if arrival is not None:
        for view in (running, waiting):
            order = [(r.priority, arrival[r.request_id]) for r in view]
            assert order == sorted(order)
    assert (len(running), len(waiting)) == scheduler.get_request_counts()
    assert all(r.status == RequestStatus.RUNNING for r in running)
    assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in waiting)
    assert set(scheduler.requests) == {r.request_id for r in running + waiting}


def check_requests(
    scheduler: HelixScheduler,
    seen: dict[str, Request],
    tokens: dict[str, list[int]],
    ahead: bool,
) -> None:
    """vLLM's Request objects hold what vLLM's scheduler would have written: every token
    the outputs reported (helix's tokens, for a live request), and between steps a running
    decode has computed all its tokens but the last sampled one."""
    for rid, req in seen.items():
        assert list(req.all_token_ids) == tokens[rid], rid
        assert list(req.output_token_ids) == tokens[rid][req.num_prompt_tokens :], rid
        assert req.num_tokens == len(tokens[rid])
        hid = scheduler._hid_of.get(rid)
        if hid is not None:
            assert scheduler.helix.tokens(hid).tolist() == tokens[rid], rid
            if not ahead and req.status == RequestStatus.RUNNING and not req.is_prefill_chunk:
                assert req.num_computed_tokens == req.num_tokens - 1, rid
        else:  # finished: vLLM's own class again, its fields written in
            assert type(req) is Request, rid


def sampled_for(scheduler: HelixScheduler, out: Any, rng: random.Random) -> Any:
    """A model runner's output: each request sampling (accepting a random number of its
    drafts), partial prefill chunks sampling nothing; its rows in the scheduled order or
    (half the time) another."""
    ids = list(out.num_scheduled_tokens)
    if rng.random() < 0.5:
        rng.shuffle(ids)
    sampled = []
    for rid in ids:
        req = scheduler._req_of[scheduler._hid_of[rid]] if rid in scheduler._hid_of else None
        done = req is None or req.num_computed_tokens < req.num_tokens
        drafts = out.scheduled_spec_decode_tokens.get(rid, [])
        accepted = rng.randint(0, len(drafts))
        sampled.append([] if done else [rng.randrange(5, 900) for _ in range(accepted + 1)])
    return ModelRunnerOutput(
        req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)},
        sampled_token_ids=sampled,
    )  # fmt: skip


def propose(scheduler: HelixScheduler, rng: random.Random) -> None:
    ids = [r.request_id for r in scheduler.running]
    drafts = [[rng.randrange(5, 900) for _ in range(rng.randint(0, 3))] for _ in ids]
    scheduler.update_draft_token_ids(DraftTokenIds(ids, drafts))


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
@pytest.mark.parametrize("ahead", [False, True], ids=["plain", "one_ahead"])
@pytest.mark.parametrize("caching", [False, True], ids=["no_cache", "cache"])
def test_random_runs_keep_the_runner_in_step(
    model_dir: str, v2: bool, ahead: bool, caching: bool
) -> None:
    random_run(model_dir, v2=v2, ahead=ahead, caching=caching, priority=False)


@pytest.mark.parametrize("ahead", [False, True], ids=["plain", "one_ahead"])
def test_random_runs_by_priority_keep_the_runner_in_step_and_the_queue_ordered(
    model_dir: str, ahead: bool
) -> None:
    random_run(model_dir, v2=ahead, ahead=ahead, caching=True, priority=True)


def random_run(model_dir: str, *, v2: bool, ahead: bool, caching: bool, priority: bool) -> None:
    """Requests arriving at random (with random vLLM priorities under ``policy="priority"``;
    with caching, stop tokens and an end-of-sequence token), drafts, aborts while a step is
    pending, under KV pressure: after every call the runner holds helix's tables, the views
    agree (waiting requests by vLLM priority, then arrival), vLLM's requests hold what the
    outputs reported, and the run ends with nothing left behind."""
    rng = random.Random(hash((v2, ahead, caching, priority)) & 0xFFFF)
    options: dict[str, Any] = {"policy": "priority"} if priority else {}
    config, kv = configs(
        model_dir, num_blocks=20 if caching else 24, max_num_seqs=6, caching=caching,
        max_num_batched_tokens=64, num_spec=3, async_scheduling=ahead,
        long_prefill_token_threshold=24, **options,
    )  # fmt: skip
    scheduler, runner = build(config, kv, v2=v2), Runner(v2, ahead)
    system = [rng.randrange(5, 900) for _ in range(40)]
    arrival: dict[str, int] = {}
    seen: dict[str, Request] = {}
    tokens: dict[str, list[int]] = {}  # each request's prompt, then the outputs' tokens
    pending: list[Any] = []
    added = 0
    for _step in range(400):
        if added < 30 and rng.random() < 0.4:
            prompt = system + [rng.randrange(5, 900) for _ in range(rng.randint(1, 60))]
            new = request(f"q{added}", prompt, rng.randint(1, 40), caching, stops=caching)
            new.priority = rng.randint(-2, 2) if priority else 0
            arrival[new.request_id] = added
            seen[new.request_id], tokens[new.request_id] = new, list(prompt)
            scheduler.add_request(new)
            added += 1
        if not ahead:
            propose(scheduler, rng)
        out = scheduler.schedule()
        runner.apply(out)
        check_tables(scheduler, runner, out)
        for rid, sent in out.scheduled_cached_reqs.all_token_ids.items():
            assert sent == list(seen[rid].all_token_ids), rid
        pending.append(out)
        if rng.random() < 0.05 and scheduler.requests:  # an abort while a step is pending
            scheduler.finish_requests(
                rng.choice(sorted(scheduler.requests)), RequestStatus.FINISHED_ABORTED
            )
        check_views(scheduler, arrival)
        if len(pending) == (2 if ahead else 1):
            done = pending.pop(0)
            outputs = scheduler.update_from_output(done, sampled_for(scheduler, done, rng))
            for eco in outputs.values():
                for out in eco.outputs:
                    tokens[out.request_id] += out.new_token_ids
            check_views(scheduler, arrival)
            check_requests(scheduler, seen, tokens, ahead)
        if added == 30 and not scheduler.has_unfinished_requests() and not pending:
            break
    for done in pending:
        outputs = scheduler.update_from_output(done, sampled_for(scheduler, done, rng))
        for eco in outputs.values():
            for out in eco.outputs:
                tokens[out.request_id] += out.new_token_ids
    check_requests(scheduler, seen, tokens, ahead)
    assert added == 30
    assert not scheduler.has_unfinished_requests()
    metrics = scheduler.helix.metrics()
    assert metrics.preemptions > 0, "the run must be under KV pressure"
    assert metrics.spec_decode_num_drafts > 0 or ahead
    reasons = {req.get_finished_reason() for req in seen.values()}
    assert not caching or {FinishReason.STOP, FinishReason.LENGTH} <= reasons
    assert not scheduler.helix.has_unfinished()
    assert scheduler.helix.pending_steps() == 0
    assert metrics.kv_used_superblocks == 0 or caching  # cached pages stay, unreferenced
    assert len(scheduler._free) == len(scheduler._req_of) - len(scheduler._retired)


# -- one request at a time ------------------------------------------------------------------


def test_an_abort_between_schedule_and_update_holds_the_pages_until_the_update(
    model_dir: str,
) -> None:
    config, kv = configs(model_dir)
    scheduler = build(config, kv)
    scheduler.add_request(request("a", list(range(20)), 10, caching=False))
    scheduler.add_request(request("b", list(range(30)), 10, caching=False))
    out = scheduler.schedule()
    (aborted,) = scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert aborted.status == RequestStatus.FINISHED_ABORTED
    assert set(scheduler.requests) == {"b"}
    assert scheduler.get_request_counts() == (1, 0)
    used = scheduler.helix.metrics().kv_used_superblocks
    assert used == 4  # a's pages stay until the step it is in closes
    scheduler.update_from_output(out, sampled_for(scheduler, out, random.Random(0)))
    assert scheduler.helix.metrics().kv_used_superblocks == 2
    assert "a" in scheduler.schedule().finished_req_ids


@pytest.mark.parametrize("stagger", [0, 1], ids=["lockstep", "staggered"])
def test_decodes_crossing_a_block_boundary_get_their_new_blocks(
    model_dir: str, stagger: int
) -> None:
    """Decodes crossing a block boundary together (every row gets one new block) or apart
    (some rows do): the runner's tables stay helix's, step after step."""
    config, kv = configs(model_dir, num_blocks=64)
    scheduler, runner = build(config, kv), Runner(v2=False)
    for i in range(4):
        length = 14 + stagger * i
        scheduler.add_request(request(f"r{i}", list(range(5, 5 + length)), 24, caching=False))
    grew_together = 0
    for step in range(24):
        out = scheduler.schedule()
        runner.apply(out)
        check_tables(scheduler, runner, out)
        new_blocks = [b for b in out.scheduled_cached_reqs.new_block_ids if b is not None]
        grew_together += step > 0 and len(new_blocks) == 4
        scheduler.update_from_output(out, sampled_for(scheduler, out, random.Random(step)))
    assert grew_together == (0 if stagger else 2)  # at blocks 16 and 32


@pytest.mark.parametrize("read_first", [False, True], ids=["handed_on", "read_first"])
def test_the_drafters_lists_reach_the_runner_and_the_requests(
    model_dir: str, read_first: bool
) -> None:
    """The drafter's proposals go to the runner as proposed (the adapter keeps its lists
    until the next schedule), and a request's ``spec_token_ids`` says them until then, read
    before the schedule or not; a schedule clears them (the next ones come later)."""
    config, kv = configs(model_dir, num_spec=3)
    scheduler = build(config, kv)
    names = ["a", "b", "c"]
    for name in names:
        scheduler.add_request(request(name, list(range(20)), 10, caching=False))
    out = scheduler.schedule()
    scheduler.update_from_output(out, sampled_for(scheduler, out, random.Random(0)))
    drafts = {"a": [5, 6, 7], "b": [8, 9, 10], "c": [11, 12, 13]}
    scheduler.update_draft_token_ids(DraftTokenIds(names, [list(drafts[n]) for n in names]))
    requests = {r.request_id: r for r in scheduler.running}
    if read_first:
        assert {n: list(requests[n].spec_token_ids) for n in names} == drafts
    out = scheduler.schedule()
    assert out.scheduled_spec_decode_tokens == drafts
    assert out.num_scheduled_tokens == dict.fromkeys(names, 4)
    assert all(requests[n].spec_token_ids == [] for n in names)
    # proposals helix cuts (it verifies the first drafts only) go cut
    scheduler.update_from_output(out, sampled_for(scheduler, out, random.Random(1)))
    scheduler.update_draft_token_ids(DraftTokenIds(["b", "a"], [[1, 2], [3]]))
    out = scheduler.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [3], "b": [1, 2]}


def test_an_abort_with_two_steps_in_flight_drops_its_tokens_of_both(model_dir: str) -> None:
    config, kv = configs(model_dir, async_scheduling=True)
    scheduler = build(config, kv)
    for name in ("a", "b"):
        scheduler.add_request(request(name, list(range(20)), 10, caching=False))
    first = scheduler.schedule()  # both prompts
    second = scheduler.schedule()  # both decodes, planned one step ahead
    assert set(second.num_scheduled_tokens) == {"a", "b"}
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    rng = random.Random(3)
    reported: dict[str, list[int]] = {"a": [], "b": []}
    for out in (first, second):
        runner = ModelRunnerOutput(
            req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1},
            sampled_token_ids=[[rng.randrange(5, 900)], [rng.randrange(5, 900)]],
        )  # fmt: skip
        for eco in scheduler.update_from_output(out, runner).values():
            for o in eco.outputs:
                reported[o.request_id] += o.new_token_ids
    assert reported["a"] == []
    assert len(reported["b"]) == 2
    assert scheduler.helix.metrics().kv_used_superblocks == 2  # b's, a's given back
    assert set(scheduler.requests) == {"b"}


def test_a_request_it_cannot_serve_ends_through_vllms_error_path(model_dir: str) -> None:
    config, kv = configs(model_dir)
    scheduler = build(config, kv)
    bad = request("bad", list(range(10)), 5, caching=False)
    bad.lora_request = object()  # a LoRA adapter: refused per request
    scheduler.add_request(bad)
    scheduler.add_request(request("good", list(range(10)), 5, caching=False))
    assert scheduler.get_num_unfinished_requests() == 2
    out = scheduler.schedule()
    assert list(out.num_scheduled_tokens) == ["good"]
    outputs = scheduler.update_from_output(out, sampled_for(scheduler, out, random.Random(0)))
    (error,) = [o for o in outputs[0].outputs if o.request_id == "bad"]
    assert (error.finish_reason.name, bad.status) == ("ERROR", RequestStatus.FINISHED_ERROR)
    assert scheduler.get_num_unfinished_requests() == 1


def test_stats_read_helix_truthfully(model_dir: str) -> None:
    config, kv = configs(model_dir, num_blocks=65, caching=True)
    scheduler = build(config, kv)
    rng = random.Random(1)
    for name in ("a", "b"):
        scheduler.add_request(request(name, list(range(40)), 3, caching=True))
        out = scheduler.schedule()
        outputs = scheduler.update_from_output(out, sampled_for(scheduler, out, rng))
        stats = outputs[0].scheduler_stats
        assert stats.prefix_cache_stats.requests == 1
        assert stats.prefix_cache_stats.queries == 40
        assert stats.kv_cache_usage == pytest.approx(scheduler.helix.metrics().kv_utilization)
    assert stats.prefix_cache_stats.hits == 32  # b finds a's two full blocks
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (2, 0)


def test_pause_all_schedules_nothing_and_reset_needs_no_running_request(model_dir: str) -> None:
    config, kv = configs(model_dir, caching=True)
    scheduler = build(config, kv)
    scheduler.add_request(request("a", list(range(20)), 2, caching=True))
    scheduler.set_pause_state(PauseState.PAUSED_ALL)
    assert scheduler.schedule().total_num_scheduled_tokens == 0
    assert scheduler.get_num_unfinished_requests() == 0
    scheduler.set_pause_state(PauseState.UNPAUSED)
    out = scheduler.schedule()
    assert scheduler.reset_prefix_cache() is False  # a step is pending, a request holds KV
    rng = random.Random(2)
    while scheduler.has_unfinished_requests():
        scheduler.update_from_output(out, sampled_for(scheduler, out, rng))
        out = scheduler.schedule()
    scheduler.update_from_output(out, sampled_for(scheduler, out, rng))
    assert scheduler.reset_prefix_cache() is True
