"""The device side of overlap mode: decode inputs gathered from the previous step's sampled
tokens, the tokens' copy back to the host, and the host-gap timeline (CPU, and CUDA when
present)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import helix_kv
from helix_kv.executor.overlap import DecodeInputGather, StepTimeline, TokenReadback

from ..helpers.scheduler import config

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_in_flight_decode_inputs_are_gathered_from_the_previous_step(device: str) -> None:
    # three decode entries then two context tokens; entries 0 and 2 wait for rows 2 and 0
    token_ids = torch.tensor([-1, 7, -1, 40, 41], dtype=torch.int64, device=device)
    previous = torch.tensor([11, 12, 13], dtype=torch.int64, device=device)
    entries, rows = np.array([0, 2], dtype=np.int64), np.array([2, 0], dtype=np.int64)
    got = DecodeInputGather(torch.device(device)).apply(token_ids, entries, rows, previous)
    assert got is token_ids  # in place: the staged batch sees the tokens
    assert token_ids.cpu().tolist() == [13, 7, 11, 40, 41]


@pytest.mark.parametrize("device", DEVICES)
def test_the_gather_takes_the_rows_the_driver_names(device: str) -> None:
    """Through StepDriver.gather_inputs, one step ahead: the decode inputs of the step planned
    ahead are the tokens the step in flight sampled for the same requests."""
    scheduler = helix_kv.Scheduler(config(1, 4, kv_tokens=64))
    for request_id, length in ((4, 5), (9, 3)):
        scheduler.add_request(request_id, np.arange(length, dtype=np.int32), 4)
    driver: helix_kv.StepDriver[torch.Tensor] = helix_kv.StepDriver(scheduler, one_step_ahead=True)
    gather = DecodeInputGather(torch.device(device))
    prefill = driver.schedule()
    sampled = torch.tensor([70, 90], dtype=torch.int64, device=device)  # sample_ids order
    driver.launched(sampled)
    ahead = driver.schedule()
    token_ids = torch.full((ahead.generation_ids.size,), -1, dtype=torch.int64, device=device)
    gathered = driver.gather_inputs(
        lambda entries, rows, previous: gather.apply(token_ids, entries, rows, previous)
    )
    assert gathered == 2
    by_request = dict(zip(prefill.sample_ids.tolist(), sampled.cpu().tolist()))
    assert token_ids.cpu().tolist() == [by_request[i] for i in ahead.generation_ids.tolist()]


@pytest.mark.parametrize("device", DEVICES)
def test_no_input_in_flight_writes_nothing(device: str) -> None:
    token_ids = torch.tensor([5, 6], dtype=torch.int64, device=device)
    previous = torch.tensor([1], dtype=torch.int64, device=device)
    gather = DecodeInputGather(torch.device(device))
    empty = np.zeros(0, dtype=np.int64)
    assert gather.apply(token_ids, empty, empty, previous) is token_ids
    with pytest.raises(helix_kv.InvalidLengthError, match="1 entries but 0 rows"):
        gather.apply(token_ids, np.array([0]), empty, previous)
    assert token_ids.cpu().tolist() == [5, 6]  # nothing written on error


@pytest.mark.parametrize("device", DEVICES)
def test_sampled_tokens_reach_the_host_as_int32(device: str) -> None:
    readback = TokenReadback(torch.device(device))
    tokens = torch.tensor([3, 95, 0], dtype=torch.int64, device=device)
    pending = readback.start(tokens)
    later = readback.start(torch.zeros(0, dtype=torch.int64, device=device))
    host = pending.wait()
    assert host.dtype == np.int32
    assert host.tolist() == [3, 95, 0]
    assert later.wait().tolist() == []


def test_timeline_is_off_on_the_cpu() -> None:
    timeline = StepTimeline(torch.device("cpu"))
    timeline.start()
    timeline.end()
    assert not timeline.enabled
    assert timeline.gaps_us() == []


class FakeEvent:
    """A CUDA event stand-in whose time is the order of its last record (the clock)."""

    clock = 0
    created = 0

    def __init__(self, enable_timing: bool = False) -> None:
        FakeEvent.created += 1
        self.time: int | None = None

    def record(self) -> None:
        FakeEvent.clock += 1
        self.time = FakeEvent.clock

    def synchronize(self) -> None:
        assert self.time is not None

    def elapsed_time(self, other: FakeEvent) -> float:
        assert self.time is not None
        assert other.time is not None
        return (other.time - self.time) / 1e3  # ms


@pytest.mark.parametrize("steps", [0, 1, 3, 8, 9, 23])
def test_timeline_reuses_its_events_and_keeps_every_gap(monkeypatch, steps):
    """A ring of 4 pairs: no event is created per step, and the gaps over many wraps are
    those of fresh events per step (step ``s`` starts at clock ``2 s + 1 + idle``)."""
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    FakeEvent.clock, FakeEvent.created = 0, 0
    timeline = StepTimeline(torch.device("cuda"), capacity=4)
    assert timeline.enabled
    assert FakeEvent.created == 8
    expected = []
    for step in range(steps):
        idle = step % 3  # the host's time between steps
        if step:
            expected.append(1.0 + idle)  # clock ticks between the last end and this start
        FakeEvent.clock += idle
        timeline.start()
        timeline.end()
    assert FakeEvent.created == 8
    assert timeline.gaps_us() == pytest.approx(expected)


def test_a_disabled_timeline_records_nothing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    FakeEvent.created = 0
    timeline = StepTimeline(torch.device("cuda"), enabled=False)
    timeline.start()
    timeline.end()
    assert not timeline.enabled
    assert FakeEvent.created == 0
    assert timeline.gaps_us() == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_timeline_measures_the_device_idle_between_steps() -> None:
    timeline = StepTimeline(torch.device("cuda"))
    x = torch.ones(1024, 1024, device="cuda")
    for _ in range(3):
        timeline.start()
        x = x @ x / 1024
        timeline.end()
        torch.cuda.synchronize()
        time.sleep(0.002)  # the host alone: the device idles at least this long
    gaps = timeline.gaps_us()
    assert len(gaps) == 2
    assert all(gap >= 2000 for gap in gaps), gaps
