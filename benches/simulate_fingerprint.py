"""A fingerprint of many ``helix-kv simulate`` runs, to prove a change decides nothing
differently: run it before and after, and the lines must be byte-identical.

Each run is ``helix-kv simulate ARGV --json --events FILE`` in this process; its line is the
SHA-256 of the ``--json`` report and of the events file (every step's figures and every
request's outcome), and the last line the SHA-256 of all of them. The runs cover what the
simulator can do: every rank verification mode, drafts, a host tier, one step ahead, prefix
caching with a shared prompt (arriving over time, or at once: a burst that shares it in its
step) and conversations, client aborts, a modelled step time, arrivals in time, each under KV
pressure (preemptions, recomputation, suspends).

    PYTHONPATH=SITE python benches/simulate_fingerprint.py [--out DIR] [--only NAME ...]

``--out DIR`` also keeps each run's report and events (``DIR/NAME.json``,
``DIR/NAME.events.jsonl``), to diff when two fingerprints differ.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import sys
import tempfile
from pathlib import Path

from helix_kv.cli import main

#: Small, under KV pressure: preemptions at every ``--cp``.
PRESSURED = (
    "--tokens-per-block 8 --kv-tokens 4096 --requests 60 --arrival-rate 1 --prompt-len 160 "
    "--output-len 64 --seed 5"
)

#: :data:`PRESSURED` with every request arriving at step 0.
BURST = PRESSURED.replace("--arrival-rate 1", "--arrival-rate 0")

#: name -> the run's flags.
RUNS: dict[str, str] = {
    "default": "",
    "cp1": f"--cp 1 {PRESSURED}",
    "cp2": f"--cp 2 {PRESSURED}",
    "cp4_policy": f"--cp 4 {PRESSURED} --policy least_computed_first",
    "cp8_all": f"--cp 8 {PRESSURED}",
    "cp8_sample": f"--cp 8 {PRESSURED} --verify-ranks sample",
    "cp16_sample": f"--cp 16 {PRESSURED}",
    "cp8_none": f"--cp 8 {PRESSURED} --verify-ranks none",
    "drafts": f"--cp 4 {PRESSURED} --spec-tokens 3 --acceptance 0.6",
    "host_tier": f"--cp 4 {PRESSURED} --host-tier-tokens 2048",
    "host_tier_cost": f"--cp 2 {PRESSURED} --host-tier-tokens 1024 --suspend-policy cost",
    "non_helix_host": f"--cp 1 --mode non_helix {PRESSURED} --host-tier-tokens 2048",
    "overlap": f"--cp 4 {PRESSURED} --overlap",
    "overlap_drafts_aborts": f"--cp 2 {PRESSURED} --overlap --spec-tokens 2 --abort-rate 0.3",
    "aborts": f"--cp 4 {PRESSURED} --abort-rate 0.25",
    "prefix_shared": (
        f"--cp 4 {PRESSURED} --prefix-caching --shared-prefix-len 256 --shared-prefix-share 0.7"
    ),
    "prefix_turns": f"--cp 8 {PRESSURED} --prefix-caching --turns 4 --think-steps 5",
    "prefix_turns_drafts_host": (
        f"--cp 4 {PRESSURED} --prefix-caching --turns 3 --spec-tokens 2 "
        "--host-tier-tokens 2048 --abort-rate 0.1"
    ),
    # every request at once behind one system prompt: the burst shares it in its step
    "prefix_burst_overlap": (
        f"--cp 4 {BURST} --prefix-caching --shared-prefix-len 256 --shared-prefix-share 0.8 "
        "--overlap"
    ),
    "prefix_burst_drafts_host": (
        f"--cp 4 {BURST} --prefix-caching --shared-prefix-len 256 --shared-prefix-share 0.8 "
        "--host-tier-tokens 2048 --spec-tokens 2 --abort-rate 0.1"
    ),
    "step_time": f"--cp 4 {PRESSURED} --step-time default",
    "arrivals_in_time": (
        "--cp 4 --tokens-per-block 8 --kv-tokens 4096 --requests 60 --prompt-len 160 "
        "--output-len 64 --seed 5 --request-rate 200 --abort-rate 0.2"
    ),
    "no_chunking": f"--cp 2 {PRESSURED} --no-chunked-prefill --max-num-tokens 2048",
    "guaranteed": f"--cp 4 {PRESSURED} --capacity-policy guaranteed_no_evict",
}


def fingerprint(name: str, argv: list[str], out: Path | None) -> str:
    """The SHA-256 of run ``name``'s report and events (kept in ``out`` if given)."""
    with tempfile.TemporaryDirectory() as scratch:
        events = Path(scratch) / "events.jsonl"
        report = io.StringIO()
        with contextlib.redirect_stdout(report):
            status = main(["simulate", *argv, "--json", "--no-progress", "--events", str(events)])
        if status != 0:
            raise SystemExit(f"{name}: helix-kv simulate exited with {status}")
        text = report.getvalue().encode()
        log = events.read_bytes()
    if out is not None:
        (out / f"{name}.json").write_bytes(text)
        (out / f"{name}.events.jsonl").write_bytes(log)
    digest = hashlib.sha256()
    for part in (text, log):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()


def main_fingerprint(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="keep every run's report and events here")
    parser.add_argument("--only", nargs="+", choices=sorted(RUNS), help="these runs only")
    args = parser.parse_args(argv)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    total = hashlib.sha256()
    for name in args.only or RUNS:
        line = f"{name:28} {fingerprint(name, RUNS[name].split(), args.out)}"
        total.update(line.encode() + b"\n")
        print(line, flush=True)
    print(f"{'all':28} {total.hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main_fingerprint())
