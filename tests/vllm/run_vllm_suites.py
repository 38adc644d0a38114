"""Runs vLLM 0.32.0's own scheduler tests against helix_kv's adapter and checks the outcome.

    python tests/vllm/run_vllm_suites.py --vllm-tests DIR [--json OUT] [--markdown]

``DIR`` holds the ``tests/`` tree of vLLM's 0.32.0 source distribution (not its ``vllm/``
package, which would shadow the installed one; ``.ci/vllm_env.sh`` extracts it). The
environment must have vLLM 0.32.0, helix_kv and pytest. The tests read
``facebook/opt-125m``'s (and ``opt-350m``'s) ``config.json`` from a Hugging Face cache with
``HF_HUB_OFFLINE=1``; the runner writes them into ``--hf-home`` (default: a cache of its own
next to ``DIR``), so nothing is downloaded.

Each test is sorted into one of:

- passed: it built the adapter (``helix_vllm_plugin`` hands vLLM's ``create_scheduler`` helper
  ``scheduler_cls=HelixScheduler``) and passed;
- listed: ``vllm_suite_expectations.NOT_APPLICABLE`` says why it cannot pass (it failed, or
  was skipped, as expected; a listed test that passes is reported too);
- vLLM's own: it never built the adapter (it tests one of vLLM's classes) and passed;
- unexpected: anything else (a test that should pass and did not). The exit status is 1 if
  there is any.

``--markdown`` prints the listed tests as the table ``docs/vllm.md`` carries.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from vllm_suite_expectations import NOT_APPLICABLE, SUITES, reasons_by_test  # noqa: E402

#: facebook/opt-125m's config.json (what the tests' ModelConfig reads); opt-350m's differs in
#: its sizes only.
OPT_125M = {
    "_name_or_path": "facebook/opt-125m",
    "activation_dropout": 0.0,
    "activation_function": "relu",
    "architectures": ["OPTForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 2,
    "do_layer_norm_before": True,
    "dropout": 0.1,
    "eos_token_id": 2,
    "ffn_dim": 3072,
    "hidden_size": 768,
    "init_std": 0.02,
    "layerdrop": 0.0,
    "max_position_embeddings": 2048,
    "model_type": "opt",
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "pad_token_id": 1,
    "prefix": "</s>",
    "torch_dtype": "float16",
    "transformers_version": "4.21.0.dev0",
    "use_cache": True,
    "vocab_size": 50272,
    "word_embed_proj_dim": 768,
}
OPT_350M = {
    **OPT_125M,
    "_name_or_path": "facebook/opt-350m",
    "hidden_size": 1024,
    "ffn_dim": 4096,
    "num_attention_heads": 16,
    "num_hidden_layers": 24,
    "word_embed_proj_dim": 512,
}
#: (repository, a snapshot name, config) written into the offline cache.
HF_CONFIGS = (
    ("facebook/opt-125m", "27dcfa74d334bc871f3234de431e71c6eeba5dd6", OPT_125M),
    ("facebook/opt-350m", "08ab08cc4b72ff5593870b5d527cf4230323703c", OPT_350M),
)


def write_hf_configs(hf_home: Path) -> None:
    """The models' ``config.json`` in the Hugging Face cache layout under ``hf_home``."""
    for repo, revision, config in HF_CONFIGS:
        root = hf_home / "hub" / ("models--" + repo.replace("/", "--"))
        snapshot = root / "snapshots" / revision
        snapshot.mkdir(parents=True, exist_ok=True)
        (snapshot / "config.json").write_text(json.dumps(config, indent=2))
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / "main").write_text(revision)


def run_pytest(vllm_tests: Path, hf_home: Path, report: Path, extra: list[str]) -> int:
    """vLLM's suites under pytest with the plugin; each test's outcome goes to ``report``."""
    env = dict(os.environ)
    env.update(
        HF_HOME=str(hf_home),
        HF_HUB_OFFLINE="1",
        HELIX_VLLM_REPORT=str(report),
        PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH", "")])),
    )
    command = [sys.executable, "-m", "pytest", "--noconftest", "-q", "-p", "no:cacheprovider"]
    command += ["-p", "helix_vllm_plugin", "--tb=line", "-W", "ignore", *SUITES, *extra]
    return subprocess.run(command, cwd=vllm_tests, env=env, check=False).returncode


def classify(records: list[dict[str, object]]) -> dict[str, list[tuple[str, str]]]:
    """Each test's class (see the module docstring), with its failure or reason."""
    listed = reasons_by_test()
    out: dict[str, list[tuple[str, str]]] = {
        key: [] for key in ("passed", "listed", "listed but passed", "vllm's own", "unexpected")
    }
    for record in records:
        test = str(record["test"])
        name = test.split("::")[-1]
        function = name if name in listed else re.sub(r"\[.*", "", name)
        passed = record["outcome"] == "passed"
        if function in listed:
            key = "listed but passed" if passed else "listed"
            out[key].append((test, listed[function]))
        elif passed:
            out["passed" if record["built_adapter"] else "vllm's own"].append((test, ""))
        else:
            out["unexpected"].append((test, str(record["reason"])))
    return out


def markdown() -> str:
    lines = ["| reason | vLLM tests |", "|---|---|"]
    for reason, tests in NOT_APPLICABLE.items():
        names = ", ".join(f"`{test}`" for test in tests)
        lines.append(f"| {reason} | {names} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-tests", type=Path, help="directory holding vLLM's tests/")
    parser.add_argument("--hf-home", type=Path, help="offline Hugging Face cache to write")
    parser.add_argument("--json", type=Path, help="write each test's class here")
    parser.add_argument("--markdown", action="store_true", help="print the listed tests")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown())
        return 0
    if args.vllm_tests is None:
        parser.error("--vllm-tests is required")
    vllm_tests = args.vllm_tests.resolve()
    hf_home = (args.hf_home or vllm_tests / "hf-home").resolve()
    write_hf_configs(hf_home)
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch, "report.json")
        run_pytest(vllm_tests, hf_home, report, args.pytest_args)
        records = json.loads(report.read_text())
    classes = classify(records)
    counts = Counter({key: len(tests) for key, tests in classes.items()})
    print("\nvLLM 0.32.0 scheduler suites against helix_kv's adapter:")
    for key in ("passed", "listed", "listed but passed", "vllm's own", "unexpected"):
        print(f"  {key:18} {counts[key]}")
    for test, reason in classes["listed but passed"]:
        print(f"  listed, passed now: {test} ({reason})")
    for test, reason in classes["unexpected"]:
        print(f"  UNEXPECTED: {test}: {reason}")
    if args.json:
        args.json.write_text(json.dumps(classes, indent=1))
    return 1 if classes["unexpected"] else 0


if __name__ == "__main__":
    sys.exit(main())
