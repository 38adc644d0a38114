"""``benches/gpu_executor.py --export-step-time-profile`` on the CPU (the tiny models, the
kernels in Triton's interpreter): it measures steps of both kinds, fits the step-time model,
prints the fit's error per workload, and writes a profile ``helix-kv simulate
--step-time-profile`` reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helix_kv.cli import main
from helix_kv.simulate.timing import PROFILE_KEYS, load_profile

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("family", ["llama", "mla"])
def test_export_writes_a_profile_simulate_reads(tmp_path, capsys, family):
    path = tmp_path / f"{family}.json"
    command = [
        sys.executable,
        str(ROOT / "benches" / "gpu_executor.py"),
        "--export-step-time-profile",
        str(path),
        "--model-family",
        family,
        "--device",
        "cpu",
        "--small",
        "--layers",
        "1",
    ]
    env = dict(os.environ, TRITON_INTERPRET="1", HELIX_KV_COMMIT="abc1234")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    printed = done.stdout
    # the fit's error, a line per workload and kind of step, both kinds among them
    rows = [line for line in printed.splitlines() if line.startswith("| ") and "%" in line]
    assert any("| prefill |" in row for row in rows)
    assert any("| decode |" in row for row in rows)
    assert "relative error over" in printed
    profile = json.loads(path.read_text())
    assert set(profile) == {*PROFILE_KEYS, "description"}
    description = profile["description"]
    for named in ("tiny test model", "float32", "CPU", "commit abc1234", family_word(family)):
        assert named in description
    model = load_profile(path)
    assert min(model.fixed_ms, model.per_token_ms, model.per_kv_token_ms) >= 0
    assert model.fixed_ms + model.per_token_ms + model.per_kv_token_ms > 0
    argv = ["simulate", "--requests", "8", "--prompt-len", "64", "--output-len", "8"]
    assert main([*argv, "--step-time-profile", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["step_time_model"] == {
        **{key: profile[key] for key in PROFILE_KEYS},
        "source": str(path),
        "description": description,
    }
    assert report["modelled_time_ms"] > 0


def family_word(family: str) -> str:
    """What the description says of the family's tiny model."""
    return {"llama": "kv heads of", "mla": "latent"}[family]
