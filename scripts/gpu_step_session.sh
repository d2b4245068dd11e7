#!/usr/bin/env bash
# One device call for the speculative step (issue 15): GPU tests of the step's forms, the step benchmark with
# XLA's default GPU client and with the TFRT GPU client (XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1), and the host
# timeline of one call (scripts/host_timeline.py) under both. Logs go to $OUT.
# Env: TEST_FILES, PYTEST_K, TEST_TIMEOUT; STEP_KINDS, STEP_CONFIGS, TFRT_KINDS; TIMELINE_FORMS; PHASES (default: all).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}tests:. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null; git status --short >> "$OUT/commit.txt" 2>/dev/null
CONFIGS=${STEP_CONFIGS:-25x4,8x16}
for phase in ${PHASES:-tests step tfrt timeline}; do
  case "$phase" in
    tests)
      timeout ${TEST_TIMEOUT:-200} python3 -m pytest -n 6 -q -rfs -p no:cacheprovider \
        ${TEST_FILES:-tests/test_step.py tests/test_fused.py} ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tee "$OUT/gpu_tests.log" | tail -8 ;;
    step)
      timeout 200 python3 -m benchmarks.step --out "$OUT/step" --configs "$CONFIGS" --backends pallas --records tuples \
        --kinds ${STEP_KINDS:-pool-python,scan,unrolled,scan-out,unrolled-out,fused} --budget-s 8 --rounds 20 2>&1 \
        | tee "$OUT/step.log" | grep "^|" ;;
    tfrt)
      XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1 timeout 200 python3 -m benchmarks.step --out "$OUT/step-tfrt" \
        --configs "$CONFIGS" --backends pallas --records tuples --kinds ${TFRT_KINDS:-pool-python,scan-out,unrolled-out} \
        --budget-s 8 --rounds 20 2>&1 | tee "$OUT/step-tfrt.log" | grep "^|" ;;
    timeline)
      for client in default tfrt; do
        [ $client = tfrt ] && export XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1
        timeout 120 python3 scripts/host_timeline.py --config 25x4 --forms ${TIMELINE_FORMS:-null,unrolled,unrolled-out} \
          --calls 6 --out "$OUT/timeline-$client" > "$OUT/timeline-$client.log" 2>&1; tail -12 "$OUT/timeline-$client.log"
      done
      unset XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT ;;
  esac
done
