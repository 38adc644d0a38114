#!/usr/bin/env bash
# The multi-GPU runs in parts that each fit one device call (10 minutes): the test suites and
# the cp = N figures against cp = 1 on the same machine. Each command's output goes to
# $OUT/<part>-cp<N>-<index>.txt as well as to stdout (OUT defaults to ./gpu-plan-out).
#
#   bash benches/gpu_cp_plan.sh tests 2        # tests/executor + tests/distributed on 2 GPUs
#   bash benches/gpu_cp_plan.sh executor 2     # decode step shapes, plain and one step ahead
#   bash benches/gpu_cp_plan.sh features 2     # floor, schedule check, host tier, prefix, drafts
#   bash benches/gpu_cp_plan.sh mla 1          # one GPU: the MLA kernel's GPU tests (every
#                                              # tiling) and its tiling and split sweeps
#                                              # (benches/gpu_mla_plan.sh: issue 43's one call)
#   DRY_RUN=1 bash benches/gpu_cp_plan.sh features 4   # print the commands only
#
# A part runs every command even if one fails, and exits non-zero if any did.
set -u
part=${1:?usage: gpu_cp_plan.sh tests|executor|features|mla CP}
cp=${2:?usage: gpu_cp_plan.sh tests|executor|features|mla CP}
out=${OUT:-gpu-plan-out}
export NCCL_NVLS_ENABLE=0
mkdir -p "$out"

commands=()
case "$part" in
  tests)
    commands+=("python3 -m pytest -o addopts= -p no:cacheprovider tests/executor tests/distributed -q -rs")
    ;;
  executor)
    for n in 1 "$cp"; do
      commands+=("python3 benches/gpu_executor.py --dtype bfloat16 --cp $n --cuda-graphs --overlap")
      commands+=("python3 benches/gpu_executor.py --dtype bfloat16 --cp $n --cuda-graphs --requests 1024 --max-batch-size 1024 --single-run")
      commands+=("python3 benches/gpu_executor.py --dtype bfloat16 --cp $n --cuda-graphs --requests 256 --prompt-len 4096 --max-batch-size 256 --single-run")
    done
    ;;
  features)
    for n in 1 "$cp"; do
      commands+=("python3 benches/gpu_decode_floor.py --cp $n")
      commands+=("python3 benches/gpu_decode_floor.py --cp $n --model-family mla")
      commands+=("python3 benches/gpu_executor.py --dtype bfloat16 --cp $n --cuda-graphs --shared-prefix-len 448 --single-run")
      commands+=("python3 benches/gpu_executor.py --dtype bfloat16 --cp $n --cuda-graphs --shared-prefix-len 448 --prefix-caching --single-run")
      commands+=("python3 benches/gpu_spec_decode.py --cp $n --k 2 4 8")
    done
    commands+=("python3 benches/bench_schedule_check.py --backend nccl --ranks $cp")
    commands+=("python3 benches/gpu_host_tier.py")
    commands+=("python3 benches/gpu_host_tier.py --scattered")
    commands+=("python3 benches/gpu_executor.py --dtype bfloat16 --cp $cp --kv-tokens 20000 --host-tier-pages 512 --single-run")
    ;;
  mla)
    commands+=("python3 -m pytest -o addopts= -p no:cacheprovider tests/executor/test_mla_kernel.py tests/executor/test_fused.py -q -rs")
    commands+=("python3 benches/gpu_mla_attention.py --heads 32 128 --shapes 64x2112 256x576 64x576 8x32768 --split-sweep 1 2 3 4 5 6 8")
    commands+=("python3 benches/gpu_decode_floor.py --model-family mla --mla-tilings h32-k32-w4-s2 h32-k32-w4-s3-pf 1:h32-k32-w4-s3-pf,64:h64-k32-w8-s3-pf")
    ;;
  *)
    echo "unknown part $part: tests, executor, features or mla" >&2
    exit 2
    ;;
esac

failed=0
for index in "${!commands[@]}"; do
  command=${commands[$index]}
  log="$out/$part-cp$cp-$index.txt"
  echo "### $command"
  if [ -n "${DRY_RUN:-}" ]; then
    continue
  fi
  start=$(date +%s)
  $command 2>&1 | tee "$log"
  status=${PIPESTATUS[0]}
  echo "### exit $status in $(( $(date +%s) - start )) s: $command" | tee -a "$log"
  [ "$status" -eq 0 ] || failed=1
done
exit "$failed"
