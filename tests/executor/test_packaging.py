"""``import helix_kv`` stays torch-free; the executor is imported only on demand."""

from __future__ import annotations

import subprocess
import sys


def test_import_helix_kv_does_not_import_torch_or_the_executor():
    code = (
        "import sys, helix_kv; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "assert 'helix_kv.executor' not in sys.modules, 'executor imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_executor_imports_on_demand():
    code = "import helix_kv.executor as e; assert e.KVPool and e.TinyTransformer"
    subprocess.run([sys.executable, "-c", code], check=True)
