"""The step loop and the report, driven by a fake rank group (no scheduler needed).

The fake admits every arrived request at once with unlimited KV: one prefill step (which
samples the first token), then one token per step. It is enough to check the loop's
bookkeeping: arrivals, idle gaps, token feeding, output checks, stops and the figures.
"""

from __future__ import annotations

import io
import json
import re
from types import SimpleNamespace

import numpy as np
import pytest

import helix_kv
from helix_kv.simulate.progress import ProgressLine, progress_wanted
from helix_kv.simulate.report import format_comparison, format_table, summarize, to_json
from helix_kv.simulate.step_loop import SimulationResult, partial_result, run_simulation
from helix_kv.simulate.tokens import prompt_tokens
from helix_kv.simulate.workload import OWN_PROMPT_SALT, RequestSpec

from ..helpers.summary import SUMMARY_KEYS


class FakeGroup:
    """Unlimited KV, no preemption; optionally corrupts tokens or raises a mismatch."""

    def __init__(self, mismatch_at_step: int | None = None, corrupt: bool = False) -> None:
        self.live: dict[int, dict] = {}
        self.done: dict[int, dict] = {}
        self.step = 0
        self.mismatch_at_step = mismatch_at_step
        self.corrupt = corrupt
        self.added_at_step: dict[int, int] = {}
        self.aborted = 0
        self._last: list[int] | None = None

    def add_request(self, request_id, prompt, max_new_tokens, priority, *, cache_salt=None):
        assert np.array_equal(prompt, prompt_tokens(request_id, len(prompt)))
        # a prompt of its own comes with a salt of its own: it shares no cached KV
        assert cache_salt == OWN_PROMPT_SALT + request_id.to_bytes(8, "little")
        self.live[request_id] = {"max": max_new_tokens, "out": [], "prefilled": False}
        self.added_at_step[request_id] = self.step

    def schedule(self):
        if self.step == self.mismatch_at_step:
            raise helix_kv.ScheduleMismatchError("ranks 0 and 1 differ in field 'preempted'")
        decoding = [i for i, r in self.live.items() if r["prefilled"]]
        context = [i for i, r in self.live.items() if not r["prefilled"]]
        for i in context:
            self.live[i]["prefilled"] = True
        self._last = decoding + context
        return SimpleNamespace(
            step=self.step,
            sample_ids=np.array(self._last, dtype=np.int64),
            preempted_ids=np.array([], dtype=np.int64),
            suspended_ids=np.array([], dtype=np.int64),
            sat_out_ids=np.array([], dtype=np.int64),
            num_tokens=len(decoding) + len(context),
        )

    def update(self, tokens, eos=None, accepted=None):
        assert self._last is not None
        assert eos is None
        assert accepted is None  # no drafts here
        assert len(tokens) == len(self._last)
        finished = []
        for request_id, token in zip(self._last, tokens.tolist()):
            request = self.live[request_id]
            request["out"].append(token + (1 if self.corrupt else 0))
            if len(request["out"]) == request["max"]:
                self.done[request_id] = self.live.pop(request_id)
                finished.append(request_id)
        self.step += 1
        self._last = None
        return np.array(finished, dtype=np.int64)

    def abort_many(self, request_ids):
        assert self._last is None, "the loop aborts between steps only"
        for request_id in request_ids.tolist():
            self.done[request_id] = dict(self.live.pop(request_id), aborted=True)
        self.aborted += len(request_ids)

    def take_output(self, request_id):
        request = self.done.pop(request_id)
        return SimpleNamespace(
            token_ids=np.array(request["out"], dtype=np.int32),
            finish_reason="aborted" if request.get("aborted") else "length",
            metrics=SimpleNamespace(
                generated_tokens=len(request["out"]),
                victim_choices=0,
                recomputed_tokens=0,
                steps_waited=0,
            ),
        )

    def metrics(self):
        return SimpleNamespace(
            steps=self.step,
            preemptions=0,
            suspensions=0,
            resumes=0,
            suspended_superblocks=0,
            resumed_superblocks=0,
            suspended_tokens=0,
            recomputed_tokens=0,
            computed_tokens=100,
            sat_out=0,
            finished=len(self.done),
            aborts=self.aborted,
            kv_used_superblocks=1,
            kv_capacity_superblocks=4,
            kv_utilization=0.25,
            kv_utilization_peak=0.5,
        )

    def has_unfinished(self) -> bool:
        return bool(self.live)

    def pending_steps(self) -> int:
        return 0 if self._last is None else 1

    @property
    def num_running(self) -> int:
        return sum(r["prefilled"] for r in self.live.values())

    @property
    def num_waiting(self) -> int:
        return sum(not r["prefilled"] for r in self.live.values())


WORKLOAD = [
    RequestSpec(3, 0, 5, 4),
    RequestSpec(1, 2, 7, 1),
    RequestSpec(8, 20, 2, 3),  # after an idle gap
]
CONFIG = {"cp": 2, "kv_tokens": 64, "scheduler": {"tokens_per_block": 4}, "workload": {}}


def run(group: FakeGroup, **kwargs) -> SimulationResult:
    return run_simulation(group, WORKLOAD, config=CONFIG, **kwargs)


def test_loop_feeds_arrivals_tokens_and_checks_outputs() -> None:
    calls = []
    result = run(FakeGroup(), progress=lambda *args: calls.append(args))
    assert result.requests_finished == result.requests_total == 3
    assert result.rank_agreement
    assert result.outputs_exact
    assert result.generated_tokens == 4 + 1 + 3
    # request 8 arrives at 20 after an idle gap: the clock jumped, no empty steps were run
    by_id = {o.request_id: o for o in result.outcomes}
    assert by_id[8].first_token_step == 20
    assert by_id[8].finish_step == 22
    assert by_id[3].completion_steps == 4
    assert by_id[1].first_token_steps == 1
    assert len(result.series) == 4 + 3
    assert result.clock == 23
    assert calls[-1] == (23, 3, 3, 7)


def test_wrong_output_is_flagged() -> None:
    result = run(FakeGroup(corrupt=True))
    assert not result.outputs_exact
    assert not any(o.output_exact for o in result.outcomes)


def test_a_scheduler_error_carries_the_result_of_the_steps_before_it() -> None:
    class StuckAtStep3(FakeGroup):
        def schedule(self):
            if self.step == 3:
                raise helix_kv.DeadlockError("scheduler deadlock: stuck")
            return super().schedule()

    with pytest.raises(helix_kv.DeadlockError) as caught:
        run(StuckAtStep3())
    result = partial_result(caught.value)
    assert result is not None
    assert (result.failed_step, result.failure) == (3, "DeadlockError")
    # by hand: step 0 prefills request 3 (one token), step 1 decodes it, step 2 decodes it
    # and prefills request 1 (its one token: finished); step 3, request 3's last, fails
    assert len(result.series) == 3
    assert [o.request_id for o in result.outcomes] == [1]
    assert result.generated_tokens == 3 + 1
    summary = summarize(result)
    assert summary["failed"] == {"type": "DeadlockError", "step": 3}
    assert summary["steps"] == 3
    assert "failed in step 3 (DeadlockError): the figures cover the 3 steps run" in (
        format_table(summary)
    )
    assert partial_result(helix_kv.DeadlockError("raised elsewhere")) is None
    assert "failed" not in summarize(run(FakeGroup()))


def test_mismatch_stops_the_run() -> None:
    result = run(FakeGroup(mismatch_at_step=2))
    assert not result.rank_agreement
    assert "field 'preempted'" in (result.mismatch or "")
    assert len(result.series) == 2
    summary = summarize(result)
    assert summary["rank_agreement"] is False
    assert "NO (stopped at step 2)" in format_table(summary)


def test_max_steps_stops_early() -> None:
    result = run(FakeGroup(), max_steps=3)
    assert len(result.series) == 3
    assert result.requests_finished < result.requests_total


def test_should_stop_ends_the_run_on_a_step_boundary() -> None:
    asked = []

    def stop_after_two_steps() -> bool:
        asked.append(True)
        return len(asked) > 2

    result = run(FakeGroup(), should_stop=stop_after_two_steps)
    assert result.interrupted
    assert len(result.series) == 2  # asked before each step: the third was never started
    assert all(len(values) == 2 for values in vars(result.series).values())
    assert result.rank_agreement
    summary = summarize(result)
    assert summary["interrupted"] is True
    assert summary["steps"] == 2
    assert "interrupted after 2 steps: the figures cover those only" in format_table(summary)
    comparison = format_comparison({"newest_first": summary})
    assert "newest_first was interrupted after 2 steps" in comparison
    finished = summarize(run(FakeGroup(), should_stop=lambda: False))
    assert "interrupted" not in finished
    assert "interrupted" not in format_table(finished)


def test_summary_keys_table_and_comparison() -> None:
    summary = summarize(run(FakeGroup()))
    assert not SUMMARY_KEYS - set(summary)
    assert summary["kv_utilization_mean"] == pytest.approx(0.25)
    assert summary["completion_steps_p50"] == 3
    assert summary["completion_steps_p99"] == 4
    assert json.loads(to_json(summary)) == summary
    table = format_table(summary)
    assert re.search(r"requests finished / total +3 / 3\n", table)
    assert re.search(r"KV utilisation peak / mean +50.0% / 25.0%\n", table)
    comparison = format_comparison({"newest_first": summary, "priority": summary})
    # the settings line wraps at 100 characters: the header follows it
    header = next(line for line in comparison.splitlines() if line.startswith("  policy "))
    assert "newest_first" in header
    assert "priority" in header
    assert "policy=" not in comparison.splitlines()[0]


def test_aborts_are_applied_between_steps_and_reported() -> None:
    workload = [
        RequestSpec(3, 0, 5, 4, abort_step=0),  # aborted on arrival, before any token
        RequestSpec(1, 2, 7, 5, abort_step=4),  # two tokens in (steps 2 and 3)
        RequestSpec(8, 3, 2, 3, abort_step=99),  # finishes first: nothing to abort
    ]
    group = FakeGroup()
    result = run_simulation(group, workload, config=CONFIG)
    by_id = {o.request_id: o for o in result.outcomes}
    assert (by_id[3].finish_reason, by_id[3].generated_tokens) == ("aborted", 0)
    assert by_id[3].first_token_step is None
    assert by_id[3].first_token_steps is None
    assert (by_id[1].finish_reason, by_id[1].generated_tokens, by_id[1].finish_step) == (
        "aborted",
        2,
        4,
    )
    assert by_id[8].finish_reason == "length"
    assert (result.requests_finished, result.requests_aborted) == (1, 2)
    assert result.outputs_exact  # aborted outputs are the start of the full ones
    assert result.final_metrics.aborts == 2
    summary = summarize(result)
    assert (summary["requests_finished"], summary["requests_aborted"]) == (1, 2)
    assert summary["completion_steps_p99"] == by_id[8].completion_steps  # finished ones only
    assert re.search(r"requests aborted +2\n", format_table(summary))


def test_a_wrong_aborted_output_is_flagged() -> None:
    workload = [RequestSpec(1, 0, 7, 5, abort_step=3)]
    result = run_simulation(FakeGroup(corrupt=True), workload, config=CONFIG)
    assert result.outcomes[0].finish_reason == "aborted"
    assert not result.outputs_exact


def test_a_real_group_aborts_identically_on_every_rank() -> None:
    from helix_kv.simulate.workload import WorkloadSpec, synthetic_workload

    spec = WorkloadSpec(
        num_requests=24, seed=3, prompt_len_mean=40, output_len_mean=24, abort_rate=0.4
    )
    workload = synthetic_workload(spec)
    aborting = {r.request_id for r in workload if r.abort_step is not None}
    assert 0 < len(aborting) < len(workload)
    config = helix_kv.SchedulerConfig(cp_size=2, tokens_per_block=4, kv_tokens=512)
    result = run_simulation(helix_kv.SimulatedCPGroup(config), workload, config=CONFIG)
    assert result.rank_agreement
    assert result.outputs_exact
    aborted = {o.request_id for o in result.outcomes if o.aborted}
    assert aborted == aborting  # each abort comes before its request could finish
    assert result.final_metrics.aborts == len(aborted)
    assert result.final_metrics.kv_used_superblocks == 0
    assert result.final_metrics.preemptions > 0


def test_progress_line() -> None:
    stream = io.StringIO()
    line = ProgressLine(label="x", stream=stream)
    assert line.render(1, 4, 9) == "x [######------------------] 1/4 requests  step 9"
    line(0, 4, 4, 10)
    line.close()
    assert stream.getvalue().startswith("\rx [####")
    assert stream.getvalue().endswith("\n")
    assert progress_wanted(False, None, stream) is False  # not a terminal
    assert progress_wanted(True, True, stream) is True  # forced
    assert progress_wanted(False, False, stream) is False
