#!/usr/bin/env bash
# Two GPUs of one host: the step benchmark split 2-way over heads beside the same work on one GPU, the sharded test
# suite on both GPUs, the long-decode soak and the GPU fuzz split in chunks of shape groups over both GPUs. Everything
# stops by a deadline; logs come back as one $OUT/results.tgz. Run from the repository root:
#   bash scripts/gpu_x2.sh [step] [step1] [diff] [demo] [tests] [parallel] [fuzz]
# Phases: step (benchmarks.step --mesh 2x1, alone on the machine), step1 (the same with one GPU visible), diff
# (scripts/mesh_diff.py: where the demo model on a mesh first differs from one GPU), demo (gdn-lossless demo DEMO_ARGS),
# tests (pytest of TEST_FILES on both GPUs), parallel (tests, a soak on GPU 1 and the fuzz side by side), fuzz.
# Env: BUDGET (seconds from the start, default 3600), STEP_ARGS, STEP1_ARGS, DIFF_ARGS, TEST_FILES, WORKERS, PYTEST_K,
# SOAK_ARGS, DEMO_ARGS, FUZZ_RANGES (backend:first:end group ranges, default pallas:0:100 triton:0:100: 10,000 cases
# each), FUZZ_CHUNK (groups of 100 cases per command), FUZZ_PAR (commands at once), FUZZ_SEED, GPUS.
# Add up the fuzz logs with: gdn-lossless fuzz-merge $OUT/fuzz/*.log
set -u
START=$(date +%s)
DEADLINE=$((START + ${BUDGET:-3600}))
left() { echo $((DEADLINE - $(date +%s))); }
FINAL_OUT=${OUT:-/tmp/out}
OUT=/tmp/gpu_out; rm -rf "$OUT"; mkdir -p "$OUT/fuzz"
trap 'tar czf "$FINAL_OUT/results.tgz" -C "$OUT" . && ls -la "$FINAL_OUT"' EXIT
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}tests:. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast off
{
  date -u; nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader; nvidia-smi topo -m
  python3 -c "import jax, triton; print('jax', jax.__version__, 'triton', triton.__version__, jax.devices())"
  python3 -c "import jax_triton; print('jax_triton', jax_triton.__version__)" 2>&1
  git log -1 --format='%H %s' 2>/dev/null || true
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

export DEADLINE OUT
fuzz_chunk() {  # backend first-group groups index: one command of `groups` groups, on GPU index % GPUS
  local b=$1 g=$2 n=$3 i=$4 log="$OUT/fuzz/$1-groups-$2-$(($2 + $3 - 1)).log"
  [ "$(left)" -gt 45 ] || return 0
  CUDA_VISIBLE_DEVICES=$((i % ${GPUS:-2})) timeout $(( $(left) - 15 )) python3 -m gdn_lossless_jax fuzz --backend "$b" \
    --cases $((n * 100)) --group-size 100 --first-group "$g" --seed ${FUZZ_SEED:-20261203} --no-progress > "$log" 2>&1
  echo "exit status $?" >> "$log"
}
export -f left fuzz_chunk
fuzz_all() {  # FUZZ_RANGES: backend:first:end ... (groups [first, end)), in chunks of FUZZ_CHUNK groups, FUZZ_PAR at once
  local i=0 b a z g c=${FUZZ_CHUNK:-3}
  for r in ${FUZZ_RANGES:-pallas:0:100 triton:0:100}; do
    IFS=: read -r b a z <<< "$r"
    for ((g = a; g < z; g += c)); do echo "$b $g $(( z - g < c ? z - g : c )) $i"; i=$((i + 1)); done
  done | xargs -P ${FUZZ_PAR:-12} -L 1 bash -c 'fuzz_chunk "$@"' _
}
fuzz_report() {
  for f in "$OUT"/fuzz/*.log; do echo "$(basename "$f"): $(grep -E '^(cases|result)' "$f" | tr '\n' ' ')$(tail -n 1 "$f")"; done
}

for phase in "$@"; do
  case "$phase" in
    step)  # alone on the machine: it is timed
      timeout $(( $(left) < ${STEP_TIMEOUT:-200} ? $(left) : ${STEP_TIMEOUT:-200} )) python3 -m benchmarks.step \
        --out "$OUT/step-x2" ${STEP_ARGS:---configs 25x4,8x16 --backends pallas --kinds scan,scan-mesh,pool-scan,pool-scan-mesh --mesh 2x1} \
        2>&1 | tee "$OUT/step-x2.log" | tail -30 ;;
    step1)  # the same benchmark with one GPU visible (STEP1_ARGS)
      CUDA_VISIBLE_DEVICES=0 timeout $(( $(left) < ${STEP_TIMEOUT:-200} ? $(left) : ${STEP_TIMEOUT:-200} )) python3 -m benchmarks.step \
        --out "$OUT/step-1gpu" ${STEP1_ARGS:---configs 25x4 --backends pallas --kinds scan} 2>&1 | tee "$OUT/step-1gpu.log" | tail -8 ;;
    diff)  # where a mesh run of the demo model first differs from one GPU (scripts/mesh_diff.py)
      timeout $(( $(left) - 5 )) python3 scripts/mesh_diff.py ${DIFF_ARGS:---size gpu --mesh 2x1} 2>&1 | tee "$OUT/mesh_diff.log" | tail -12 ;;
    tests)
      timeout $(( $(left) - 5 )) python3 -m pytest -n ${WORKERS:-6} -v -rfs -p no:cacheprovider -p no:benchmark ${TEST_FILES:-tests/test_sharding.py} \
        ${PYTEST_K:+-k "$PYTEST_K"} > "$OUT/gpu_tests-x2.log" 2>&1; echo "exit status $?" >> "$OUT/gpu_tests-x2.log"; tail -n 8 "$OUT/gpu_tests-x2.log" ;;
    demo)
      timeout $(( $(left) - 5 )) python3 -m gdn_lossless_jax demo ${DEMO_ARGS:-} 2>&1 | tee "$OUT/demo-x2.log" | tail -20 ;;
    parallel)  # tests (both GPUs), soak (GPU 1) and fuzz (both GPUs) side by side until the deadline
      pids=()
      ( CUDA_VISIBLE_DEVICES=1 timeout $(( $(left) - 10 )) python3 -m gdn_lossless_jax demo ${SOAK_ARGS:---size gpu --backend pallas \
          --tokens 10000 --turns 2 --prompts 4 --batch 4 --track-interval 256 --progress off} > "$OUT/soak-gpu.log" 2>&1
        echo "exit status $?" >> "$OUT/soak-gpu.log" ) & pids+=($!)
      ( timeout $(( $(left) - 10 )) python3 -m pytest -n ${WORKERS:-6} -v -rfs -p no:cacheprovider -p no:benchmark \
          ${TEST_FILES:-tests/test_sharding.py tests/test_equivalence.py tests/test_gpu.py tests/test_triton_backend.py tests/test_pallas_config.py tests/test_fused.py tests/test_step.py} \
          > "$OUT/gpu_tests-x2.log" 2>&1; echo "exit status $?" >> "$OUT/gpu_tests-x2.log" ) & pids+=($!)
      fuzz_all & pids+=($!)
      wait "${pids[@]}"
      tail -n 6 "$OUT/gpu_tests-x2.log"; tail -n 14 "$OUT/soak-gpu.log"
      fuzz_report ;;
    fuzz) fuzz_all; fuzz_report ;;
    *) echo "unknown phase $phase" ;;
  esac
done
echo "done after $(( $(date +%s) - START )) s"
