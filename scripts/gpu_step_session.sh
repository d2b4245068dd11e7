#!/usr/bin/env bash
# One device call for the speculative step (issue 15). Logs go to /tmp/o, packed into $OUT/results.tgz (a call returns
# at most 8 files). Phases (PHASES, default all, in this order):
#   probe     scripts/graph_launch_probe.py: host launch cost per kernel of XLA's and PyTorch's CUDA graphs
#   tests     pytest of TEST_FILES (default the step's and the fused step's tests), PYTEST_K, with GDN_FULL_TESTS=1
#   step      benchmarks.step at STEP_CONFIGS (default 25x4,8x16,8x4,8x8), STEP_RECORDS (default both), STEP_KINDS, STEP_BACKENDS
#   tfrt      the same with XLA's TFRT GPU client (XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1), TFRT_KINDS, 25x4 and 8x16
#   timeline  scripts/host_timeline.py at 25x4 (TIMELINE_FORMS) under both clients
#   sass_fused  Nsight Compute on scripts/sass_fused.py at SASS_CONFIG: the fused kernel's SASS and stalls per variant
#             (SASS_VARIANTS, default the script's)
#   regs      Nsight Compute's registers and duration of the fused kernel per launch variant (scripts/sass_fused.py
#             --variants REGS_VARIANTS, e.g. "pallas:split,pallas:rows:dot_fma='u'") at REGS_CONFIGS (default 25x4 8x16)
#   floor     scripts/call_floor_probe.py (blocking, polling is_ready(), ahead) per CUDA context schedule (FLOOR_SCHEDULES)
#   fused     scripts/tune_fused.py at FUSED_CONFIGS (default 25x4,8x16): the fused step per variant (FUSED_VARIANTS)
#   variants  scripts/mosaic_variants.py at VAR_CONFIGS (default 25x4,8x16), VAR_VARIANTS, VAR_ARGS (e.g. "--layers 30")
#   mosaic_ncu  Nsight Compute on the mosaic fused kernel at NCU_CONFIG (default 25x4), one launch per variant of
#             NCU_VARIANTS (default "replay=loop"; NCU_LAUNCHES, default "--launch-skip 1 --launch-count 1", picks
#             others: with NCU_ARGS="... --verify", "--launch-skip 3 --launch-count 2" is a fused launch, then the
#             verify alone): details and SASS stall samples as CSV
#   step_cfg  the step phase with the mosaic backend's default launch replaced by STEP_MOSAIC (VerifyConfig fields;
#             scripts/step_mosaic_config.py), into step-cfg/
#   spinners  per SPIN_MODES (default "none idle nice"; scripts/idle_spinners.py: a spinner of that policy pinned to
#             each CPU, "none" without): scripts/call_floor_probe.py (unless SPIN_FLOOR=0), then benchmarks.step with
#             the mosaic backend at SPIN_CONFIGS (default 25x4,8x16), SPIN_KINDS (default unrolled-out,fused-out),
#             tuples, SPIN_ARGS (more arguments), into spin-MODE/ (a mode named again: spin-MODE-2/, -3/, ...);
#             SPIN_LONG_MB: the floor probe's long jit (default 4096 MB, ~2.1 ms on the H200)
set -u
OUT=${OUT:-/tmp/out}
O=/tmp/o; rm -rf $O; mkdir -p $O "$OUT"
trap 'tar czf "$OUT/results.tgz" -C $O .' EXIT
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}tests:. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
git rev-parse HEAD > $O/commit.txt 2>/dev/null; git status --short >> $O/commit.txt 2>/dev/null
for phase in ${PHASES:-probe tests step tfrt timeline}; do
  case "$phase" in
    probe) timeout 120 python3 scripts/graph_launch_probe.py 2>&1 | tee $O/graph_launch_probe.log | tail -24 ;;
    tests)
      export GDN_FULL_TESTS=1  # the extended parameter sets CI's CPU run leaves out (docs/testing.md)
      timeout ${TEST_TIMEOUT:-300} python3 -m pytest -n 8 -v --tb=short -rfs -p no:cacheprovider \
        ${TEST_FILES:-tests/test_step.py tests/test_fused.py} ${PYTEST_K:+-k "$PYTEST_K"} > $O/gpu_tests.log 2>&1
      grep -E "FAILED|ERROR| passed| failed" $O/gpu_tests.log | tail -12 ;;
    step)
      timeout ${STEP_TIMEOUT:-260} python3 -m benchmarks.step --out $O/step --configs ${STEP_CONFIGS:-25x4,8x16,8x4,8x8} --backends ${STEP_BACKENDS:-pallas} \
        --kinds ${STEP_KINDS:-pool-python,scan,unrolled,scan-out,unrolled-out,fused} ${STEP_RECORDS:+--records $STEP_RECORDS} --budget-s 8 --rounds 20 > $O/step.log 2>&1
      grep "^|" $O/step.log ;;
    tfrt)
      XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1 timeout 150 python3 -m benchmarks.step --out $O/step-tfrt --configs 25x4,8x16 \
        --backends pallas --records tuples --kinds ${TFRT_KINDS:-pool-python,unrolled-out} --budget-s 8 --rounds 20 \
        > $O/step-tfrt.log 2>&1
      grep "^|" $O/step-tfrt.log ;;
    timeline)
      for client in default tfrt; do
        [ $client = tfrt ] && export XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1
        timeout 120 python3 scripts/host_timeline.py --config 25x4 --forms ${TIMELINE_FORMS:-null,unrolled-out} --calls 6 \
          --depth 16 --out $O/timeline-$client > $O/timeline-$client.log 2>&1; tail -6 $O/timeline-$client.log
      done
      unset XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT ;;
    sass_fused)  # the fused kernel's SASS and stall samples per launch variant (scripts/sass_fused.py), from Nsight Compute
      timeout ${SASS_TIMEOUT:-240} ncu --clock-control none -k "regex:gdn_verify_tuples|verify_kernel" --launch-count 12 \
        --section LaunchStats --section Occupancy --section SpeedOfLight --section WarpStateStats --section SourceCounters \
        --section MemoryWorkloadAnalysis --section SchedulerStats \
        -f -o $O/sass_fused python3 scripts/sass_fused.py --config ${SASS_CONFIG:-8x16} \
        ${SASS_VARIANTS:+--variants "$SASS_VARIANTS"} > $O/sass_fused_ncu.log 2>&1
      tail -4 $O/sass_fused_ncu.log
      ncu -i $O/sass_fused.ncu-rep --page details --csv > $O/sass_fused_details.csv 2> $O/sass_fused_err.log
      ncu -i $O/sass_fused.ncu-rep --page source --print-source sass --csv > $O/sass_fused.csv 2>> $O/sass_fused_err.log
      rm -f $O/sass_fused.ncu-rep; wc -l $O/sass_fused*.csv; tail -2 $O/sass_fused_err.log ;;
    regs)  # registers and duration of the fused kernel per launch variant (scripts/sass_fused.py --variants)
      for cfg in ${REGS_CONFIGS:-25x4 8x16}; do
        timeout 200 ncu --clock-control none -k "regex:gdn_verify_tuples|verify_kernel" --section LaunchStats \
          --section Occupancy --section SpeedOfLight --csv python3 scripts/sass_fused.py --config $cfg \
          ${REGS_VARIANTS:+--variants "$REGS_VARIANTS"} > $O/regs-$cfg.csv 2> $O/regs-$cfg.err
        grep launched $O/regs-$cfg.csv
        grep -E '"(Registers Per Thread|Duration)"' $O/regs-$cfg.csv | awk -F'","' '{print "'$cfg'", $1, $13, $15}' | paste - -
      done ;;
    floor)  # scripts/call_floor_probe.py under each CUDA context schedule of FLOOR_SCHEDULES (XLA reads
            # TF_CUDA_PLATFORM_GPU_DEVICE_SCHEDULE: spin, yield, blocking_sync; "default" leaves it unset)
      for sched in ${FLOOR_SCHEDULES:-default spin blocking_sync}; do
        if [ $sched = default ]; then unset TF_CUDA_PLATFORM_GPU_DEVICE_SCHEDULE; else export TF_CUDA_PLATFORM_GPU_DEVICE_SCHEDULE=$sched; fi
        timeout 150 python3 scripts/call_floor_probe.py --nodes 64 --calls 100 --long-mb 4096 > $O/floor-$sched.log 2>&1
        echo "== $sched"; grep -E "b2b|poll|sleep|long jit" $O/floor-$sched.log
      done
      unset TF_CUDA_PLATFORM_GPU_DEVICE_SCHEDULE ;;
    spinners)
      for mode in ${SPIN_MODES:-none idle nice}; do
        wrap=""; [ $mode != none ] && wrap="python3 scripts/idle_spinners.py --policy $mode --"
        d=spin-$mode; n=2; while [ -e $O/$d ]; do d=spin-$mode-$n; n=$((n + 1)); done
        mkdir -p $O/$d
        echo "== $d"
        if [ "${SPIN_FLOOR:-1}" = 1 ]; then
          timeout 120 $wrap python3 scripts/call_floor_probe.py --nodes 64 --calls 100 --long-mb ${SPIN_LONG_MB:-4096} \
            > $O/$d/floor.log 2>&1
          grep -E "b2b|poll|sync|sleep|long jit" $O/$d/floor.log
        fi
        timeout ${SPIN_STEP_TIMEOUT:-150} $wrap python3 -m benchmarks.step --out $O/$d/step \
          --configs ${SPIN_CONFIGS:-25x4,8x16} --backends mosaic --kinds ${SPIN_KINDS:-unrolled-out,fused-out} \
          --records tuples --budget-s 8 --rounds 20 ${SPIN_ARGS:-} > $O/$d/step.log 2>&1
        grep "^|" $O/$d/step.log
      done ;;
    step_cfg)
      timeout ${STEP_TIMEOUT:-260} python3 scripts/step_mosaic_config.py "${STEP_MOSAIC:-replay=static}" --out $O/step-cfg \
        --configs ${STEP_CONFIGS:-25x4,8x16,8x4,8x8} --backends mosaic --kinds ${STEP_KINDS:-unrolled-out,fused-out} \
        ${STEP_RECORDS:+--records $STEP_RECORDS} --budget-s 8 --rounds 20 > $O/step-cfg.log 2>&1
      grep "^|\|default launch" $O/step-cfg.log ;;
    variants)
      timeout ${VAR_TIMEOUT:-240} python3 scripts/mosaic_variants.py --configs ${VAR_CONFIGS:-25x4,8x16} \
        --variants "${VAR_VARIANTS:-replay=loop;replay=static}" ${VAR_ARGS:-} > $O/variants.log 2>&1
      grep -v "^\s*$" $O/variants.log | tail -24 ;;
    mosaic_ncu)
      IFS=';' read -ra ncu_variants <<< "${NCU_VARIANTS:-replay=loop}"
      for v in "${ncu_variants[@]}"; do
        name=ncu-$(echo "$v" | tr -c 'A-Za-z0-9\n' '_')
        timeout ${NCU_TIMEOUT:-150} ncu --clock-control none -k regex:mosaic ${NCU_LAUNCHES:---launch-skip 1 --launch-count 1} \
          --section LaunchStats --section Occupancy --section SpeedOfLight --section WarpStateStats \
          --section SourceCounters --section MemoryWorkloadAnalysis --section SchedulerStats --section InstructionStats \
          -f -o $O/$name python3 scripts/mosaic_variants.py --configs ${NCU_CONFIG:-25x4} --variants "$v" --calls 3 \
          --no-time ${NCU_ARGS:---cross-every 4} > $O/$name.log 2>&1
        tail -3 $O/$name.log
        ncu -i $O/$name.ncu-rep --page details --csv > $O/$name-details.csv 2> $O/$name-err.log
        ncu -i $O/$name.ncu-rep --page source --print-source sass --csv > $O/$name-sass.csv 2>> $O/$name-err.log
        rm -f $O/$name.ncu-rep; wc -l $O/$name-*.csv; tail -2 $O/$name-err.log
        grep -E '"(Duration|Registers Per Thread|Issue Slots Busy|No Eligible|Warp Cycles Per Issued Instruction|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput)"' \
          $O/$name-details.csv | awk -F'","' '{print $(NF-2), $NF}' | head -12
      done ;;
    fused)
      OUT=$O timeout ${FUSED_TIMEOUT:-240} python3 scripts/tune_fused.py --configs ${FUSED_CONFIGS:-25x4,8x16} \
        ${FUSED_VARIANTS:+--variants $FUSED_VARIANTS} > $O/tune_fused.log 2>&1; grep -v "^\s*$" $O/tune_fused.log | tail -24 ;;
  esac
done
