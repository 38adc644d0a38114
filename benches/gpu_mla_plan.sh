#!/usr/bin/env bash
# Issue 43 in one device call (one GPU, under 8 minutes: the parts' limits add up to 460 s
# after the wheel's install): the MLA kernel's GPU tests, its
# tiling sweep against the copy bandwidth, the matmul rate and its roofline, the decode step
# of both families against their byte and roofline floors (MLA with the default tiling and
# with the sweep's pick), and the step-time profile of both families. Every part runs under
# its own time limit and writes its log under $OUT (8 files at most come back); a summary of
# every part is printed last and written to $OUT/summary.txt.
#
#   HELIX_KV_COMMIT=abc1234 bash benches/gpu_mla_plan.sh      # on the device machine
#   DRY_RUN=1 bash benches/gpu_mla_plan.sh                    # print the parts only
#
# A wheel under .whl/ (built on the development machine) is installed first, into /tmp/site.
# Set a part's limit with e.g. LIMIT_SWEEP=150. A part that fails or runs out of time does
# not stop the others; the script exits non-zero if any did.
set -u
out=${OUT:-gpu-plan-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export HELIX_KV_COMMIT=${HELIX_KV_COMMIT:-unknown}
scratch=$(mktemp -d)

if [ -z "${DRY_RUN:-}" ] && compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

xdist=""
if [ -z "${DRY_RUN:-}" ] && python3 -c "import xdist" 2> /dev/null; then
  xdist="-n 4"
fi
# the baseline first, the new loop's tilings, the wide tiles of a95b95d last
tilings="h32-k32-w4-s2 h32-k32-w4-s3-pf h32-k16-w4-s3-pf h32-k16-w4-s4-pf h32-k16-w4-s5-pf \
h16-k16-w4-s4-pf h16-k32-w4-s3-pf h64-k32-w8-s3-pf h64-k16-w8-s4-pf h64-k64-w8-s2-pf h64-k32-w8-s2"

summary="$out/summary.txt"
: > "$summary"
failed=0

# run NAME LIMIT LOG COMMAND...: the command under `timeout`, its output to LOG (appended)
# and to stdout, its status and time to the summary.
run() {
  local name=$1 limit=$2 log=$3
  shift 3
  echo "### [$name] (limit ${limit} s) $*" | tee -a "$log"
  if [ -n "${DRY_RUN:-}" ]; then
    return 0
  fi
  local start status
  start=$(date +%s)
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$log"
  status=${PIPESTATUS[0]}
  echo "### [$name] exit $status in $(( $(date +%s) - start )) s" | tee -a "$log"
  echo "[$name] exit $status in $(( $(date +%s) - start )) s (limit $limit s)" >> "$summary"
  [ "$status" -eq 0 ] || failed=1
}

# 1. the MLA kernel on CUDA: every named tiling at 128 heads in bf16, float32, a CUDA graph
# shellcheck disable=SC2086
run tests "${LIMIT_TESTS:-80}" "$out/tests.txt" \
  python3 -m pytest -o addopts= -p no:cacheprovider $xdist -q -rs -m cuda \
  tests/executor/test_mla_kernel.py

# 2. the tilings at 32 and 128 heads, then forced splits of the best; the pick for part 3
# shellcheck disable=SC2086
run sweep "${LIMIT_SWEEP:-140}" "$out/sweep.txt" \
  python3 benches/gpu_mla_attention.py --heads 32 128 --shapes 64x2112 8x32768 256x576 \
  --tilings $tilings --split-sweep 2 4 8 --calls 10 \
  --json "$out/sweep.jsonl" --best-out "$scratch/best.txt"
best=$(cat "$scratch/best.txt" 2> /dev/null || true)

# 3. the decode step against its floors: Llama; MLA with the default tiling and the pick
run floor-llama "${LIMIT_FLOOR:-50}" "$out/floor.txt" \
  python3 benches/gpu_decode_floor.py --replays 100
mla_tilings=(h32-k32-w4-s2)
if [ -n "$best" ] && [ "$best" != "1:h32-k32-w4-s2" ]; then
  mla_tilings+=("$best")
fi
run floor-mla "${LIMIT_FLOOR_MLA:-70}" "$out/floor.txt" \
  python3 benches/gpu_decode_floor.py --model-family mla --replays 100 \
  --mla-tilings "${mla_tilings[@]}"

# 4. the step-time profiles (32-layer stacks, bf16, CUDA graphs)
for family in llama mla; do
  run "profile-$family" "${LIMIT_PROFILE:-60}" "$out/profiles.txt" \
    python3 benches/gpu_executor.py --export-step-time-profile "$out/profile_$family.json" \
    --model-family "$family" --time-budget "${PROFILE_BUDGET:-35}"
done

{
  echo
  echo "=============== summary (commit $HELIX_KV_COMMIT) ==============="
  echo "--- MLA kernel GPU tests"
  grep -hE "passed|failed|error" "$out/tests.txt" 2> /dev/null | tail -2
  echo "--- MLA kernel sweep (best per head count and shape; targets of issue 43)"
  grep -hE "^# NVIDIA|^# .*copy bandwidth" "$out/sweep.txt" 2> /dev/null | head -1
  sed -n '/^| heads | shape/,$p' "$out/sweep.txt" 2> /dev/null
  echo "--- decode step against its floors (llama, then mla: default tiling, the sweep's pick)"
  grep -hE "copy bandwidth .* TB/s" "$out/floor.txt" 2> /dev/null
  grep -hE "^\| [0-9]+ x [0-9]+" "$out/floor.txt" 2> /dev/null
  echo "--- step-time profiles"
  grep -hE "^(fit:|wrote)" "$out/profiles.txt" 2> /dev/null
} >> "$summary"
cat "$summary"
rm -rf "$scratch"
exit "$failed"
