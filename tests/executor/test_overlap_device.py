"""The device side of overlap mode: decode inputs gathered from the previous step's sampled
tokens, the tokens' copy back to the host, and the host-gap timeline (CPU, and CUDA when
present)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from helix_kv.executor.overlap import DecodeInputGather, StepTimeline, TokenReadback

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_in_flight_decode_inputs_are_gathered_from_the_previous_step(device: str) -> None:
    # three decode entries then two context tokens; entries 0 and 2 wait for rows 2 and 0
    token_ids = torch.tensor([-1, 7, -1, 40, 41], dtype=torch.int64, device=device)
    previous = torch.tensor([11, 12, 13], dtype=torch.int64, device=device)
    refs = np.array([2, -1, 0], dtype=np.int32)
    got = DecodeInputGather(torch.device(device)).apply(token_ids, refs, previous)
    assert got is token_ids  # in place: the staged batch sees the tokens
    assert token_ids.cpu().tolist() == [13, 7, 11, 40, 41]


@pytest.mark.parametrize("device", DEVICES)
def test_known_inputs_need_no_previous_step(device: str) -> None:
    token_ids = torch.tensor([5, 6], dtype=torch.int64, device=device)
    gather = DecodeInputGather(torch.device(device))
    gather.apply(token_ids, np.array([-1, -1]), None)
    gather.apply(token_ids, np.zeros(0, dtype=np.int32), None)
    assert token_ids.cpu().tolist() == [5, 6]
    with pytest.raises(RuntimeError, match="none is in flight"):
        gather.apply(token_ids, np.array([-1, 0]), None)
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
