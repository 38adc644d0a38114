#!/usr/bin/env bash
# The README's whole test command (`python -m pytest`) on a GPU machine, in parts that each fit
# one device call (10 minutes): every test the command collects is in exactly one part
# (`check` proves it by collection counts). Each part installs the carried wheel, runs its
# tests with a JUnit file and a log under $OUT, and prints one line: passed / skipped / failed /
# errors and the wall time (OUT defaults to ./gpu-suite-out).
#
#   bash benches/gpu_test_suite.sh check            # collection only: the parts cover the suite
#   bash benches/gpu_test_suite.sh oracle           # tests/executor: transformers oracles, CLI
#   bash benches/gpu_test_suite.sh executor         # tests/executor: the rest (kernels, CUDA)
#   bash benches/gpu_test_suite.sh distributed      # tests/distributed + tests/test_step_driver.py
#   bash benches/gpu_test_suite.sh rest             # everything else (binding, simulate, ...)
#   bash benches/gpu_test_suite.sh all              # the four parts one after another
#   bash benches/gpu_test_suite.sh whole            # the whole command in one part, spread over
#                                                   # the machine's cores by pytest-xdist (-n 8;
#                                                   # XDIST_WORKERS sets it): one device call
#   bash benches/gpu_test_suite.sh custom NAME ARGS...  # pytest ARGS, reported as NAME (a part
#                                                   # that ran out of time, split by file)
#   NO_INSTALL=1 bash benches/gpu_test_suite.sh check   # here: the source tree's helix_kv
#
# A part is stopped with SIGINT at PART_TIMEOUT_S (default 530 s): pytest then writes what ran
# to the JUnit file and the line says "interrupted". Exit status: 0 when every part run passed.
set -u
part=${1:?usage: gpu_test_suite.sh check|oracle|executor|distributed|rest|whole|all|custom NAME ARGS}
out=${OUT:-gpu-suite-out}
budget=${PART_TIMEOUT_S:-530}
mkdir -p "$out"
# NVLink multicast stays off on the shared machines (docs: the device notes)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1

python=${PYTHON:-python3}
if [ -z "${NO_INSTALL:-}" ]; then
  $python -m pip install -q --no-deps --no-index --force-reinstall .whl/*.whl || exit 2
fi

# What the suite needs beyond torch: a missing one fails the whole command (tests/conftest.py
# imports hypothesis; pyproject's addopts name pytest-benchmark's --benchmark-disable), so say
# so before running anything. Carry a missing pure-Python wheel in .whl (the device notes).
$python - <<'EOF' || exit 2
import importlib, sys
import torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, "
      f"cuda {torch.cuda.is_available()} x{torch.cuda.device_count()}"
      + (f" ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else ""))
missing = []
for name in ("helix_kv", "pytest", "hypothesis", "pytest_benchmark", "numpy", "triton",
             "transformers", "safetensors", "prometheus_client", "matplotlib"):
    try:
        module = importlib.import_module(name)
        print(f"  {name} {getattr(module, '__version__', '')} {getattr(module, '__file__', '')}")
    except ImportError as exc:
        print(f"  {name}: MISSING ({exc})")
        missing.append(name)
needed = {"helix_kv", "pytest", "hypothesis", "pytest_benchmark", "numpy"}
if needed & set(missing):
    sys.exit(f"cannot run the suite without {sorted(needed & set(missing))}")
# the optional ones skip their tests (importorskip): listed above
EOF

# The parts: oracle and executor split tests/executor; rest is the suite minus the others.
oracle_files=(
  tests/executor/test_hf_oracle.py
  tests/executor/test_hf_oracle_configs.py
  tests/executor/test_hf_oracle_cuda.py
  tests/executor/test_executor_cli.py
  tests/executor/test_checkpoint.py
)
oracle_ignores=()
for file in "${oracle_files[@]}"; do oracle_ignores+=("--ignore=$file"); done
declare -A selection=(
  [oracle]="${oracle_files[*]}"
  [executor]="tests/executor ${oracle_ignores[*]}"
  [distributed]="tests/distributed tests/test_step_driver.py"
  [rest]="tests --ignore=tests/executor --ignore=tests/distributed --ignore=tests/test_step_driver.py"
  [whole]=""
)
parts=(oracle executor distributed rest)

collected() {  # number of tests pytest collects for the arguments
  $python -m pytest -p no:cacheprovider --collect-only -q "$@" 2>/dev/null \
    | $python -c 'import re,sys; t=sys.stdin.read(); m=re.search(r"(\d+) tests? collected", t) or re.search(r"^(\d+) tests?", t, re.M); print(m.group(1) if m else "?")'
}

summarise() {  # one line from a JUnit file
  $python - "$1" "$2" "$3" "$4" <<'EOF'
import sys, xml.etree.ElementTree as ET
path, name, seconds, status = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
try:
    root = ET.parse(path).getroot()
except (OSError, ET.ParseError) as exc:
    print(f"### {name}: no JUnit file ({exc}); pytest exit {status}, {seconds} s")
    sys.exit()
suites = [root] if root.tag == "testsuite" else list(root)
count = lambda key: sum(int(s.get(key, 0)) for s in suites)
tests, failed, errors, skipped = count("tests"), count("failures"), count("errors"), count("skipped")
note = {0: "", 1: " FAILED", 2: " interrupted", 5: " no tests"}.get(status, f" exit {status}")
print(f"### {name}: {tests - failed - errors - skipped} passed, {skipped} skipped, "
      f"{failed} failed, {errors} errors in {seconds} s (pytest exit {status}){note}")
EOF
}

run_part() {
  local name=$1
  local log="$out/$name.log" xml="$out/$name.xml"
  # shellcheck disable=SC2206  # the selection is words on purpose
  local args=(${selection[$name]})
  echo "### $name: python -m pytest ${args[*]}"
  local start status
  start=$(date +%s)
  set -o pipefail
  local spread=()
  if [ "$name" = whole ]; then
    $python -c "import xdist" 2> /dev/null || { echo "### whole: pytest-xdist is missing"; return 2; }
    local workers=${XDIST_WORKERS:-8}
    spread=(-n "$workers")
    # each worker's torch would start a thread per core: 14 workers x 16 threads on 16 cores
    # made fixtures 10x slower (the run of 1171181); a share of the cores each
    local threads=$(( $(nproc) / workers ))
    export OMP_NUM_THREADS=$(( threads > 0 ? threads : 1 ))
  fi
  timeout -s INT -k 30 "$budget" $python -m pytest -p no:cacheprovider --durations=15 \
    --junitxml="$xml" "${spread[@]}" "${args[@]}" 2>&1 | tee "$log"
  status=$?
  set +o pipefail
  [ "$status" -eq 124 ] && status=2  # timed out: pytest was interrupted
  summarise "$xml" "$name" "$(( $(date +%s) - start ))" "$status" | tee -a "$out/summary.txt"
  return "$status"
}

case "$part" in
  check)
    whole=$(collected)
    sum=0
    for name in "${parts[@]}"; do
      # shellcheck disable=SC2206
      args=(${selection[$name]})
      n=$(collected "${args[@]}")
      echo "### $name: $n tests"
      sum=$(( sum + n ))
    done
    echo "### python -m pytest collects $whole tests; the parts $sum"
    [ "$whole" = "$sum" ]
    ;;
  oracle | executor | distributed | rest | whole)
    run_part "$part"
    ;;
  custom)
    name=${2:?usage: gpu_test_suite.sh custom NAME ARGS...}
    shift 2
    selection[$name]="$*"
    run_part "$name"
    ;;
  all)
    failed=0
    for name in "${parts[@]}"; do run_part "$name" || failed=1; done
    exit "$failed"
    ;;
  *)
    echo "unknown part $part: check, oracle, executor, distributed, rest, all or custom" >&2
    exit 2
    ;;
esac
