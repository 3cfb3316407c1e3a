#!/usr/bin/env bash
# The course's CUDA checks on a machine with an NVIDIA GPU, in one call that ends by itself
# within BUDGET seconds (default 585), keeping whatever it finished. From the repository root:
#   bash scripts/gpu_verify.sh
# Order: build; alone on the GPU, the default shape with every kernel, the GQA kernel under
# Nsight Compute and the sweep; then the correctness checks side by side, in what time is left.
# Results land in $OUT (or /tmp/gpu-verify): summary.txt, logs.tgz (every stage's log and Nsight
# Compute's details page, refreshed after each stage), the benchmark JSON and roofline files,
# build.tgz (the built kernels, see below). It uses the machine's own python3 and PyTorch, the
# project on PYTHONPATH.
set -u
BUDGET=${BUDGET:-585}
OUT=${OUT:-/tmp/gpu-verify}
LOGS=$(mktemp -d /tmp/gpu-verify-logs.XXXX)
mkdir -p "$OUT"
trap 'rm -rf "$LOGS"' EXIT
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export MAX_JOBS=${MAX_JOBS:-$(nproc)} MINI_VLLM_BUILD_DIR=${MINI_VLLM_BUILD_DIR:-/tmp/mini-vllm-build}
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}
LAB=phase-02-paged-attention/labs/lab-06-cuda-kernel
PY=${PY:-python3}
summary="$OUT/summary.txt"
: > "$summary"
START=$SECONDS

left() { echo $((BUDGET - (SECONDS - START))); }
pack() { tar czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null; cp "$summary" "$LOGS/" 2>/dev/null; }

# run NAME CAP CMD...: run CMD for at most CAP seconds (less if the budget is nearer), log it.
run() {
  local name=$1 cap=$2; shift 2
  local t0=$SECONDS limit
  limit=$(( cap < $(left) - 10 ? cap : $(left) - 10 ))
  if (( limit < 5 )); then echo "== $name: not run (budget spent)" >> "$summary"; return 0; fi
  timeout -k 5 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  local block  # one write, so that the side-by-side stages do not interleave their lines
  block="== $name (cap $limit s): $*
   exit $rc$([ $rc = 124 ] && echo ' (cut off)') in $((SECONDS - t0)) s
$(tail -n 4 "$LOGS/$name.log" | sed 's/^/   | /')"
  echo "$block" >> "$summary"
  pack
}

# A build carried from an earlier call (gpu-build/build.tgz, which this script leaves in $OUT:
# copy it into the tree, ignored, and name gpu-build in the call's `carry`) skips the 3-minute
# nvcc build while the kernel sources are unchanged (load_ops keys builds by their content).
# (Untried so far.) The files are touched so that ninja finds them newer than the sources.
if [ -f gpu-build/build.tgz ]; then
  mkdir -p "$MINI_VLLM_BUILD_DIR" && tar xzf gpu-build/build.tgz -C "$MINI_VLLM_BUILD_DIR" \
    && find "$MINI_VLLM_BUILD_DIR" -type f -exec touch {} +
fi
run env 30 bash -c "nvidia-smi; $PY -c 'import torch,sys; print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.get_device_capability(), torch.cuda.get_device_properties(0).multi_processor_count)'; nvcc --version | tail -2; command -v ncu compute-sanitizer"
run build 300 $PY -c "from mini_vllm.csrc import load_ops; load_ops(verbose=True); print('built')"
tar czf "$OUT/build.tgz" -C "$MINI_VLLM_BUILD_DIR" . 2>/dev/null

# Alone on the GPU first: the figures (nothing else runs while they are timed).
run bench_default 75 $PY benchmarks/paged_attention.py --gqa-partitions 64 128 256 auto \
  --kernels mini_vllm_naive mini_vllm_v1 mini_vllm_v2 mini_vllm_gqa mini_vllm_gqa_p64 \
  mini_vllm_gqa_p128 mini_vllm_gqa_p256 mini_vllm_gqa_pauto torch_sdpa_gathered \
  --json "$OUT/paged_attention_default.json"
run ncu 60 bash -c "ncu --clock-control none --set full --kernel-name 'regex:paged_attention_gqa|partition_reduce' \
  --launch-count 2 -f -o $LOGS/gqa $PY benchmarks/paged_attention.py --kernels mini_vllm_gqa --warmup 1 --reps 1 \
  && ncu --import $LOGS/gqa.ncu-rep --page details > $LOGS/ncu_details.txt && rm $LOGS/gqa.ncu-rep"
run bench_sweep 130 $PY benchmarks/paged_attention.py --sweep --reps 20 --gqa-partitions auto \
  --kernels mini_vllm_naive mini_vllm_v1 mini_vllm_v2 mini_vllm_gqa mini_vllm_gqa_pauto torch_sdpa_gathered \
  --json "$OUT/paged_attention_sweep.json"

# Then the correctness checks, side by side (the GPU is shared; nothing here is timed).
run check 400 $PY -m course check 02-06 --no-bugs --no-grading-path --no-exam &
run gpu_tests 400 $PY -m pytest -q -p no:cacheprovider -rs tests/engine tests/test_logprobs.py \
  tests/test_paged_attention_benchmark.py "$LAB/test_stretch.py" &
run sanitizers 400 bash -c "
  compute-sanitizer --tool memcheck --error-exitcode 9 $PY -m pytest $LAB/test_lab.py -q -p no:cacheprovider -m cuda
  echo '--- racecheck (GQA and v2 kernels)'
  compute-sanitizer --tool racecheck --error-exitcode 9 $PY -m pytest $LAB/test_lab.py -q -p no:cacheprovider -m cuda -k 'gqa or v2' -x" &
wait
echo "== done in $((SECONDS - START)) s; logs in $OUT/logs.tgz" >> "$summary"
pack
cat "$summary"
