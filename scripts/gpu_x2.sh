#!/usr/bin/env bash
# One device call on two H200s (issues 21 and 22): the step benchmark split 2-way over heads beside
# the same work on one GPU, then, side by side, the GPU tests (the sharded suite on both GPUs), the
# long-decode soak at the real head geometry and the GPU fuzz split in chunks of groups over both
# GPUs. Everything stops by a deadline; logs come back as one $OUT/results.tgz.
# Usage on the device machine: bash scripts/gpu_x2.sh [step] [tests] [soak] [fuzz] [demo]
# Env: BUDGET (seconds from the start, default 560), STEP_ARGS, TEST_FILES, WORKERS, SOAK_ARGS,
# FUZZ_BACKENDS, FUZZ_GROUPS (first:last groups, default 0:100), FUZZ_WORKERS (per backend),
# FUZZ_CHUNK (groups per command), FUZZ_SEED, DEMO_ARGS.
set -u
START=$(date +%s)
DEADLINE=$((START + ${BUDGET:-560}))
left() { echo $((DEADLINE - $(date +%s))); }
FINAL_OUT=${OUT:-/tmp/out}
OUT=/tmp/gpu_out; rm -rf "$OUT"; mkdir -p "$OUT/fuzz"
trap 'tar czf "$FINAL_OUT/results.tgz" -C "$OUT" . && ls -la "$FINAL_OUT"' EXIT
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}tests:. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{
  date -u; nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader; nvidia-smi topo -m
  python3 -c "import jax, triton; print('jax', jax.__version__, 'triton', triton.__version__, jax.devices())"
  python3 -c "import jax_triton; print('jax_triton', jax_triton.__version__)" 2>&1
  git log -1 --format='%H %s' 2>/dev/null || true
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

fuzz_worker() {  # backend gpu first last: groups [first, last) in chunks of FUZZ_CHUNK groups
  local b=$1 gpu=$2 g=$3 last=$4 chunk=${FUZZ_CHUNK:-5} n
  while [ "$g" -lt "$last" ] && [ "$(left)" -gt 45 ]; do
    n=$(( last - g < chunk ? last - g : chunk ))
    CUDA_VISIBLE_DEVICES=$gpu timeout $(( $(left) - 15 )) python3 -m gdn_lossless_jax fuzz --backend "$b" \
      --cases $((n * 100)) --group-size 100 --first-group "$g" --seed ${FUZZ_SEED:-20261203} --no-progress \
      > "$OUT/fuzz/$b-groups-$g-$((g + n - 1)).log" 2>&1
    echo "exit status $?" >> "$OUT/fuzz/$b-groups-$g-$((g + n - 1)).log"
    g=$((g + n))
  done
}

for phase in "$@"; do
  case "$phase" in
    step)  # alone on the machine: it is timed
      timeout $(( $(left) < ${STEP_TIMEOUT:-200} ? $(left) : ${STEP_TIMEOUT:-200} )) python3 -m benchmarks.step \
        --out "$OUT/step-x2" ${STEP_ARGS:---configs 25x4,8x16 --backends pallas --kinds scan,scan-mesh,pool-scan,pool-scan-mesh --mesh 2x1} \
        2>&1 | tee "$OUT/step-x2.log" | tail -30 ;;
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
      IFS=: read -r f0 f1 <<< "${FUZZ_GROUPS:-0:100}"
      w=${FUZZ_WORKERS:-3}
      i=0
      for b in ${FUZZ_BACKENDS:-pallas triton}; do
        for k in $(seq 0 $((w - 1))); do
          a=$(( f0 + (f1 - f0) * k / w )); z=$(( f0 + (f1 - f0) * (k + 1) / w ))
          fuzz_worker "$b" $((i % 2)) "$a" "$z" & pids+=($!); i=$((i + 1))
        done
      done
      wait "${pids[@]}"
      tail -n 6 "$OUT/gpu_tests-x2.log"; tail -n 14 "$OUT/soak-gpu.log"
      for f in "$OUT"/fuzz/*.log; do echo "$(basename "$f"): $(grep -E '^(cases|result|held)' "$f" | tr '\n' ' ')$(tail -n 1 "$f")"; done ;;
    *) echo "unknown phase $phase" ;;
  esac
done
echo "done after $(( $(date +%s) - START )) s"
