"""The cost of helix_kv inside vLLM's loop: ``schedule()`` + ``update_from_output()`` (and,
with drafts, ``update_draft_token_ids()``) of ``helix_kv.integrations.vllm.HelixScheduler``
against vLLM 0.32's own scheduler, side by side in one run, and against the floor vLLM's
types impose.

N = 256 / 1024 / 4096 requests, all decoding (prompts of ``PROMPT`` tokens, prefilled before
the timing), synthetic model-runner outputs (built once: the model runner's work is not the
scheduler's): ``plain``; ``prefix_caching`` (on, every prompt its own: the cache's
bookkeeping alone); ``drafts`` (the n-gram drafter's 3 drafts for every request every step,
1 accepted).

The floor (``impl="floor"``) is what any scheduler of vLLM 0.32 must do per step, timed
alone from arrays it already holds, deciding nothing: build the step's ``SchedulerOutput``
(``num_scheduled_tokens``, the cached requests' ``CachedRequestData`` lists, the drafts'
``scheduled_spec_decode_tokens``) and set each request's ``num_computed_tokens``; take the
drafter's proposals into each request's ``spec_token_ids``; then per request append its
tokens, run vLLM's stop check and build its ``EngineCoreOutput``, and the step's
``EngineCoreOutputs`` with ``SchedulerStats``. It runs on requests of the same shape.

Two settings of Python's garbage collector: ``engine``, as vLLM's engine core runs (its
start-up heap frozen, ``gc.freeze()``, the requests arriving afterwards not: a collection
scans them, as often as a scheduler's allocations trigger one, which is part of what each
scheduler costs); ``frozen``, every object alive when the timing starts frozen (the requests
too), so that only each scheduler's own work is timed.

Goal (issue 40): helix_kv >= 10x less time than vLLM's own at N = 1024 and 4096, and within
1.5x of the floor. The floor bounds the first: vLLM/helix is at most vLLM/floor, printed too.
Skipped without vLLM. Run with
``python -m pytest benches/bench_vllm_adapter.py --benchmark-enable -s``; the figures are in
``docs/vllm.md``.
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (see .ci/vllm_env.sh)")

from helix_kv.integrations.vllm import HelixScheduler  # noqa: E402
from vllm_compare import BLOCK_SIZE, OPT_CONFIG, PROMPT, vllm_scheduler  # noqa: E402

SIZES = (256, 1024, 4096)
VARIANTS = ("plain", "prefix_caching", "drafts")
DRAFTS = 3
ROUNDS = 30
WARMUP = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("opt-config")
    Path(path, "config.json").write_text(json.dumps(OPT_CONFIG))
    return str(path)


def runner_output(req_ids: list[str], sampled: list[list[int]]) -> Any:
    from vllm.v1.outputs import ModelRunnerOutput

    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


class Workload:
    """A scheduler (vLLM's or the adapter) with ``n`` requests decoding, and its step."""

    def __init__(self, n: int, variant: str, impl: str, model_dir: str) -> None:
        from vllm.v1.outputs import DraftTokenIds

        drafts = variant == "drafts"
        steps = 4 + WARMUP + ROUNDS + 5
        per_request = PROMPT + (1 + DRAFTS) * steps + 2 * BLOCK_SIZE
        self.s = vllm_scheduler(
            n,
            model_dir,
            variant == "prefix_caching",
            scheduler_cls=HelixScheduler if impl == "helix" else None,
            num_speculative_tokens=DRAFTS if drafts else None,
            blocks=n * (per_request // BLOCK_SIZE + 1) + 16,
            log_stats=True,
        )
        prefill = self.s.schedule()
        ids = list(prefill.num_scheduled_tokens)
        self.s.update_from_output(prefill, runner_output(ids, [[7]] * n))
        self.draft_ids = DraftTokenIds(ids, [[5, 6, 7]] * n) if drafts else None
        self.output = runner_output(ids, [[5, 9] if drafts else [7] for _ in ids])

    def step(self) -> None:
        if self.draft_ids is not None:
            self.s.update_draft_token_ids(self.draft_ids)
        out = self.s.schedule()
        self.s.update_from_output(out, self.output)


class Floor:
    """The objects a decode step of ``n`` requests must build, and only those (see the module
    docstring), from arrays it already holds, the cheapest way vLLM's types allow."""

    def __init__(self, n: int, variant: str, model_dir: str) -> None:
        from vllm.v1.outputs import DraftTokenIds

        s = vllm_scheduler(n, model_dir, variant == "prefix_caching", log_stats=True)
        prefill = s.schedule()
        ids = list(prefill.num_scheduled_tokens)
        s.update_from_output(prefill, runner_output(ids, [[7]] * n))
        reqs = [s.requests[rid] for rid in ids]
        self.ids = ids
        self.k = DRAFTS if variant == "drafts" else 0
        self.computed = np.array([r.num_computed_tokens for r in reqs], dtype=np.int64)
        self.prompt = np.array([r.num_prompt_tokens for r in reqs], dtype=np.int64)
        self.output = runner_output(ids, [[5, 9] if self.k else [7] for _ in ids])
        self.draft_ids = DraftTokenIds(ids, [[5, 6, 7]] * n) if self.k else None

    def step(self) -> None:
        from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
        from vllm.v1.metrics.stats import PrefixCacheStats, SchedulerStats
        from vllm.v1.spec_decode.metrics import SpecDecodingStats

        ids, k, computed = self.ids, self.k, self.computed
        # the drafter's proposals, as the model runner reads them
        spec: dict[str, list[int]] = {}
        if self.draft_ids is not None:
            spec = dict(zip(self.draft_ids.req_ids, self.draft_ids.draft_token_ids))
        # a decode entering a new block gets one (block ids stand for any)
        new_blocks: list[Any] = [None] * len(ids)
        for row in np.flatnonzero(computed % BLOCK_SIZE == 0).tolist():
            new_blocks[row] = ([row + 1],)
        output = SchedulerOutput(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=CachedRequestData(
                req_ids=ids,
                resumed_req_ids=set(),
                new_token_ids=[],
                all_token_ids={},
                new_block_ids=new_blocks,
                num_computed_tokens=computed.tolist(),
                num_output_tokens=(computed + 1 - self.prompt).tolist(),
            ),
            num_scheduled_tokens=dict.fromkeys(ids, 1 + k),
            total_num_scheduled_tokens=len(ids) * (1 + k),
            scheduled_spec_decode_tokens=spec,
            scheduled_encoder_inputs={},
            finished_req_ids=set(),
            free_encoder_mm_hashes=[],
            preempted_req_ids=set(),
            num_spec_tokens_to_schedule=k,
        )
        assert output.total_num_scheduled_tokens
        # each request's tokens, as the runner returned them, in the runner's order
        runner = self.output
        outputs = list(map(EngineCoreOutput, runner.req_ids, runner.sampled_token_ids))
        stats = None
        advance: Any = 1
        if k:
            kept = np.fromiter(map(len, runner.sampled_token_ids), np.int64, len(ids))
            stats = SpecDecodingStats.new(k)
            accepted = kept - 1
            stats.num_drafts = len(ids)
            stats.num_draft_tokens = k * len(ids)
            stats.num_accepted_tokens = int(accepted.sum())
            at_least = np.bincount(accepted, minlength=k + 1)[::-1].cumsum()[::-1]
            stats.num_accepted_tokens_per_pos = at_least[1:].tolist()
            stats.num_draft_tokens_per_pos = [len(ids)] * k
            advance = kept  # (the runner's order is the scheduler's here)
        EngineCoreOutputs(
            outputs=outputs,
            scheduler_stats=SchedulerStats(
                num_running_reqs=len(ids),
                num_waiting_reqs=0,
                kv_cache_usage=0.5,
                prefix_cache_stats=PrefixCacheStats(),
                spec_decoding_stats=stats,
            ),
        )
        self.computed = computed + advance


def _median(values: list[float]) -> float:
    return float(np.median(np.asarray(values)))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("collector", ["engine", "frozen"])
def test_bench_vllm_step(
    benchmark: Any, model_dir: str, collector: str, n: int, variant: str
) -> None:
    """vLLM's own step, the adapter's and the floor, one after the other in every round, so
    that the machine's load (shared, here) weighs on the three alike; each one's median and
    the median of the per-round ratios are reported."""
    gc.collect()
    gc.freeze()  # the start-up heap, as vLLM's engine core freezes it after start-up
    try:
        works: dict[str, Workload | Floor] = {
            "vllm": Workload(n, variant, "vllm", model_dir),
            "helix": Workload(n, variant, "helix", model_dir),
            "floor": Floor(n, variant, model_dir),
        }
        if collector == "frozen":
            gc.collect()
            gc.freeze()
        times: dict[str, list[float]] = {impl: [] for impl in works}

        def round_of_three() -> None:
            for impl, work in works.items():
                started = time.perf_counter()
                work.step()
                times[impl].append(time.perf_counter() - started)

        benchmark.group = f"vllm step gc={collector}"
        benchmark.pedantic(round_of_three, rounds=ROUNDS, warmup_rounds=WARMUP)
    finally:
        gc.unfreeze()
    helix = works["helix"].s.helix.metrics()
    assert helix.preemptions == 0
    if variant == "drafts":
        assert helix.spec_decode_num_accepted_tokens > 0
    if benchmark.stats is None:  # --benchmark-disable: one untimed round
        return
    timed = {impl: values[WARMUP:] for impl, values in times.items()}
    medians = {impl: _median(values) for impl, values in timed.items()}
    speedup = _median([v / h for v, h in zip(timed["vllm"], timed["helix"])])
    over_floor = _median([h / f for h, f in zip(timed["helix"], timed["floor"])])
    bound = _median([v / f for v, f in zip(timed["vllm"], timed["floor"])])
    info = benchmark.extra_info
    info.update({f"{impl}_us": round(median * 1e6, 1) for impl, median in medians.items()})
    info["vllm_over_helix"] = round(speedup, 2)
    info["helix_over_floor"] = round(over_floor, 2)
    info["vllm_over_floor"] = round(bound, 2)
    print(
        f"\nvLLM step, {variant}, N={n}, gc {collector}: vLLM {medians['vllm'] * 1e3:.2f} ms, "
        f"helix {medians['helix'] * 1e3:.2f} ms, floor {medians['floor'] * 1e3:.2f} ms; "
        f"vLLM/helix {speedup:.1f}x, helix/floor {over_floor:.2f}, vLLM/floor {bound:.1f}x "
        "(goal: >= 10x at N >= 1024, <= 1.5)"
    )
