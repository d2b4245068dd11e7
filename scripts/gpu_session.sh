#!/usr/bin/env bash
# One device call: GPU tests, then (optionally) tuning and benchmarks. Logs go to $OUT.
# Usage on the device machine: bash scripts/gpu_session.sh [tests] [tune] [bench] [step] [stepnocb] [timeline] [demo] [soak] [fuzz] [pattern] [upstream] [profile] [stalls] [sass]
# With PACK=1 every log goes under /tmp/gpu_out and comes back as one $OUT/results.tgz (a call returns at most 8 files).
# Env: TEST_FILES, WORKERS, PYTEST_ARGS, PYTEST_K (a -k expression), TEST_TIMEOUT; TUNE_ARGS (verify/commit), TUNE_SHAPES,
# TUNE_VERIFY and TUNE_COMMIT (scripts/gpu_tune.py), TUNE_TIMEOUT; BENCH_ARGS, BENCH_TIMEOUT; PROFILE_TIMEOUT, NCU_SKIP, NCU_COUNT, STALL_VARIANTS, SASS_KERNELS;
# PATTERN_SHAPES, PATTERN_TILES (scripts/pattern_floor.py); UPSTREAM_VARIANTS, UPSTREAM_MAXNREG (scripts/upstream_regs.py);
# STEP_ARGS, STEP_TIMEOUT (benchmarks/step.py; stepnocb: the same with XLA's command buffers off, STEPNOCB_ARGS);
# TIMELINE_ARGS, TIMELINE_TIMEOUT (scripts/step_timeline.py);
# DEMO_ARGS, DEMO_TIMEOUT, SOAK_ARGS, SOAK_TIMEOUT (gdn-lossless demo); FUZZ_BACKENDS, FUZZ_ARGS, FUZZ_TIMEOUT (gdn-lossless fuzz)
set -u
OUT=${OUT:-/tmp/out}
FINAL_OUT=$OUT
if [ "${PACK:-0}" = 1 ]; then OUT=/tmp/gpu_out; rm -rf "$OUT"; fi
mkdir -p "$OUT"
pack() { if [ "${PACK:-0}" = 1 ]; then tar czf "$FINAL_OUT/results.tgz" -C "$OUT" . && ls -la "$FINAL_OUT"; fi; }
trap pack EXIT
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}tests:. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import jax, triton; print('jax', jax.__version__, 'triton', triton.__version__, jax.devices())"
  python3 -c "import jax_triton; print('jax_triton', jax_triton.__version__)" 2>&1
} | tee "$OUT/env.txt"
for phase in "$@"; do
  case "$phase" in
    tests)
      timeout ${TEST_TIMEOUT:-420} python3 -m pytest -n ${WORKERS:-6} -v -rfs -p no:cacheprovider -p no:benchmark \
        ${TEST_FILES:-tests/test_equivalence.py tests/test_gpu.py tests/test_triton_backend.py tests/test_pallas_config.py} ${PYTEST_ARGS:-} ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -25 ;;
    tune) timeout ${TUNE_TIMEOUT:-300} python3 scripts/gpu_tune.py ${TUNE_ARGS:-} 2>&1 | tee "$OUT/tune.log" | tail -60 ;;
    pattern) timeout ${PATTERN_TIMEOUT:-150} python3 scripts/pattern_floor.py ${PATTERN_SHAPES:-} 2>&1 | tee "$OUT/pattern_floor.log" | tail -30 ;;
    upstream) timeout ${UPSTREAM_TIMEOUT:-240} python3 scripts/upstream_regs.py ${UPSTREAM_VARIANTS:-25x4:tuples:8:1 25x4:snapshots:8:1} \
        --maxnreg ${UPSTREAM_MAXNREG:-0,96,80,64} 2>&1 | tee "$OUT/upstream_regs.log" | tail -30 ;;
    bench) timeout ${BENCH_TIMEOUT:-400} python3 -m benchmarks.run --mode h200 --out "$OUT/bench" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -40 ;;
    step) timeout ${STEP_TIMEOUT:-300} python3 -m benchmarks.step --out "$OUT/step" ${STEP_ARGS:-} 2>&1 | tee "$OUT/step.log" | tail -45 ;;
    timeline) timeout ${TIMELINE_TIMEOUT:-150} python3 scripts/step_timeline.py --out "$OUT/timeline" ${TIMELINE_ARGS:-} 2>&1 \
        | tee "$OUT/timeline.log" | grep -v '^    ' ;;
    demo) timeout ${DEMO_TIMEOUT:-150} python3 -m gdn_lossless_jax demo ${DEMO_ARGS:-} 2>&1 | tee "$OUT/demo.log" | tail -15 ;;
    soak) timeout ${SOAK_TIMEOUT:-200} python3 -m gdn_lossless_jax demo ${SOAK_ARGS:-} 2>&1 | tee "$OUT/soak.log" | tail -12 ;;
    fuzz) for b in ${FUZZ_BACKENDS:-pallas triton}; do
            timeout ${FUZZ_TIMEOUT:-120} python3 -m gdn_lossless_jax fuzz --backend "$b" ${FUZZ_ARGS:-} 2>&1 | tee "$OUT/fuzz-$b.log" | tail -12
          done ;;
    stepnocb) XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" timeout ${STEP_TIMEOUT:-300} python3 -m benchmarks.step \
        --out "$OUT/step-nocb" ${STEPNOCB_ARGS:-} 2>&1 | tee "$OUT/step-nocb.log" | tail -20 ;;
    profile)
      timeout ${PROFILE_TIMEOUT:-150} ncu --clock-control none -k "regex:gdn_|_kernel" --launch-skip ${NCU_SKIP:-0} \
        --launch-count ${NCU_COUNT:-200} --section SpeedOfLight --section Occupancy --section LaunchStats \
        python3 scripts/profile_kernels.py > "$OUT/ncu.txt" 2>&1
      python3 scripts/ncu_table.py "$OUT/ncu.txt" "$OUT/variants.txt" | tee "$OUT/ncu_table.md" ;;
    stalls)  # warp stall reasons per launch (scripts/stall_profile.py; STALL_VARIANTS)
      M=gpu__time_duration.sum,launch__registers_per_thread,launch__occupancy_limit_registers,sm__warps_active.avg.pct_of_peak_sustained_active
      M=$M,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__average_warp_latency_per_inst_issued.ratio
      M=$M,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum
      for r in barrier dispatch_stall drain imc_miss lg_throttle long_scoreboard math_pipe_throttle membar mio_throttle misc \
               no_instruction not_selected selected short_scoreboard sleeping tex_throttle wait branch_resolving; do
        M=$M,smsp__warp_issue_stalled_${r}_per_warp_active.pct
      done
      timeout ${PROFILE_TIMEOUT:-200} ncu --clock-control none -k "regex:gdn_verify_(tuples|snapshots)" --metrics "$M" \
        python3 scripts/stall_profile.py > "$OUT/stalls.txt" 2>&1
      tail -5 "$OUT/stalls.txt" ;;
    sass)  # the SASS of the commit kernels as built on this machine (scripts/sass_launch.py), from Nsight Compute
      timeout ${PROFILE_TIMEOUT:-200} ncu --clock-control none -k "regex:${SASS_KERNELS:-commit}" --launch-count ${NCU_COUNT:-8} \
        --section LaunchStats --section SourceCounters -f -o "$OUT/sass" python3 scripts/sass_launch.py > "$OUT/sass_ncu.log" 2>&1
      tail -5 "$OUT/sass_ncu.log"
      ncu -i "$OUT/sass.ncu-rep" --page source --print-source sass --csv > "$OUT/sass.csv" 2> "$OUT/sass_err.log"
      ncu -i "$OUT/sass.ncu-rep" --page details --csv > "$OUT/sass_details.csv" 2>> "$OUT/sass_err.log"
      wc -l "$OUT/sass.csv"; head -c 600 "$OUT/sass.csv"; tail -3 "$OUT/sass_err.log" ;;
    *) echo "unknown phase $phase" ;;
  esac
done
