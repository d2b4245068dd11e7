#!/usr/bin/env bash
# The step under XLA's command-buffer settings: benchmarks/step.py once per setting (XLA_FLAGS is read at
# start-up, so each setting is its own process), and the optimized HLO of the scan and unrolled steps per setting.
# Usage on the device machine: OUT=... bash scripts/cmdbuf_probe.sh [names of settings; default: all]
# Env: PROBE_ARGS (benchmarks.step arguments), PROBE_TIMEOUT (seconds per setting).
set -u
OUT=${OUT:-/tmp/out}; WORK=/tmp/probe; rm -rf "$WORK"; mkdir -p "$WORK"
trap 'tar czf "$OUT/probe.tgz" -C "$WORK" . ; ls -la "$OUT"' EXIT
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}tests:. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
TYPES=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION
declare -A FLAGS=(
  [default]=""
  [while]="--xla_gpu_enable_command_buffer=$TYPES,WHILE,CONDITIONAL"
  [while-unroll]="--xla_gpu_enable_command_buffer=$TYPES,WHILE,CONDITIONAL --xla_gpu_command_buffer_unroll_loops=true"
  [min1]="--xla_gpu_graph_min_graph_size=1"
  [while-min1]="--xla_gpu_enable_command_buffer=$TYPES,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"
)
names=${*:-default while while-unroll min1 while-min1}
for n in $names; do
  d="$WORK/$n"; mkdir -p "$d/dump"
  echo "== $n: XLA_FLAGS=${FLAGS[$n]}"
  XLA_FLAGS="${FLAGS[$n]} --xla_dump_to=$d/dump --xla_dump_hlo_module_re=.*step.* --xla_dump_hlo_as_text" \
    timeout ${PROBE_TIMEOUT:-150} python3 -m benchmarks.step --out "$d/step" ${PROBE_ARGS:-} > "$d/step.log" 2>&1
  echo "rc=$?"; grep -E '^\| [0-9]' "$d/step.log" | cut -c1-140
  find "$d/dump" -type f ! -name '*after_optimizations.txt' -delete
done
