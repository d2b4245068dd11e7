#!/usr/bin/env bash
# The GPU test suite, the benchmarks, the demo and the fuzz on a GPU machine, from the repository root.
#
#   [VAR=value ...] bash scripts/gpu_session.sh PHASE...
#
# Phases, run in the order given; each writes its log (and results) under $OUT (default /tmp/out):
#   tests  pytest of TEST_FILES (default tests/, without the notebook tests where Jupyter is missing), -k PYTEST_K,
#          WORKERS processes (default 8), with GDN_FULL_TESTS=1 (the extended parameter sets); gpu_tests.log
#   bench  python -m benchmarks.run --mode h200 BENCH_ARGS; bench/ and bench.log
#   step   python -m benchmarks.step STEP_ARGS (default: the step of record, Mosaic GPU and Pallas backends, four
#          configurations); step/ and step.log
#   demo   gdn-lossless demo DEMO_ARGS (default: the real head geometry on the Pallas backend); demo.log
#   e2e    python -m benchmarks.e2e at the real depth, every record mode, K=8: deep at 25x4 with the draft calibrated
#          to E2E_TPS tokens a step (default 2.5,3.2), deep at the snapshot path's batch-64 budget (the first setting's
#          factor), deep-a3b at 25x4 (the first setting); E2E_ARGS appended to each; e2e-*/ and e2e.log
#   trees  deep at 25, tuples, the draft's factor E2E_FACTOR: a [2,2,2] tree and chains of 4 and 8; trees-*/, trees.log
#   floor  python -m benchmarks.floor FLOOR_ARGS (the GDN kernels against their byte floor); floor/ and floor.log
#   soak   gdn-lossless demo SOAK_ARGS (default: 10,000 tokens a request); soak.log
#   fuzz   gdn-lossless fuzz --backend B FUZZ_ARGS for each B in FUZZ_BACKENDS (default "pallas triton"); fuzz-B.log
#   checkpoint  a random Hugging Face checkpoint at Qwen3.6-35B-A3B's head geometry (scripts/random_checkpoint.py
#          CKPT_ARGS, default 8 blocks and 16 experts, 3.6 GB, into CKPT_DIR, default /tmp/ckpt-a3b), then
#          scripts/checkpoint_run.py on it (CKPT_RUN_ARGS; tokens/s per record mode and the checks);
#          checkpoint.json and checkpoint.log
#   portable  the portable mode on the GPU: tests/test_portable.py (its GPU test compares each GPU backend's bits with
#          the CPU's), then scripts/portable_fixtures.py records the GPU's fixture into $OUT/gpu-reference.npz (commit it
#          under tests/fixtures/portable/: CI reproduces it on the CPU); portable.log
# Other variables: TIMEOUT (seconds per phase, default 3000); SPINNERS=idle|nice|pause runs bench and step under
# python -m benchmarks.dev idle-spinners (no CPU halts while they wait on the GPU); PACK=1 packs $OUT into $OUT/results.tgz.
# Wheels in .whl/ (e.g. jax-triton) are installed into /tmp/site first. $OUT/env.txt records the GPU, the versions and
# the commit (git rev-parse HEAD and git status).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ "${PACK:-0}" = 1 ]; then
  trap 'tar czf /tmp/results.tgz -C "$OUT" . && mv /tmp/results.tgz "$OUT/results.tgz"' EXIT
fi
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}tests:. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
{
  date -u; nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
  python3 -c "import triton, jax_triton; print('triton', triton.__version__, 'jax_triton', jax_triton.__version__)" 2>&1
  git rev-parse HEAD 2>/dev/null; git status --short 2>/dev/null
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
T=${TIMEOUT:-3000}
wrap=""
[ -n "${SPINNERS:-}" ] && wrap="python3 -m benchmarks.dev idle-spinners --policy $SPINNERS --"

for phase in "$@"; do
  echo "== $phase"
  case "$phase" in
    tests)
      export GDN_FULL_TESTS=1
      ignore=""
      python3 -c "import nbformat, nbclient, ipykernel" 2>/dev/null || ignore="--ignore=tests/test_notebooks.py"
      timeout "$T" python3 -m pytest -n "${WORKERS:-8}" -v --tb=short -rfs -p no:cacheprovider $ignore \
        ${TEST_FILES:-tests} ${PYTEST_K:+-k "$PYTEST_K"} > "$OUT/gpu_tests.log" 2>&1
      grep -E "^(FAILED|ERROR)|^SKIPPED|^=+ .*( passed| failed| error|no tests ran)" "$OUT/gpu_tests.log" | tail -20 ;;
    bench)
      timeout "$T" $wrap python3 -m benchmarks.run --mode h200 --out "$OUT/bench" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
      tail -40 "$OUT/bench.log" ;;
    step)
      timeout "$T" $wrap python3 -m benchmarks.step --out "$OUT/step" ${STEP_ARGS:---configs 25x4,8x16,8x4,8x8 \
        --backends mosaic,pallas --kinds unrolled-out,fused-out --records tuples --budget-s 8 --rounds 20} \
        > "$OUT/step.log" 2>&1
      grep "^|" "$OUT/step.log" || tail -20 "$OUT/step.log" ;;
    demo)
      timeout "$T" python3 -m gdn_lossless_jax demo ${DEMO_ARGS:---size gpu --backend pallas --prompts 8 --batch 8 \
        --tokens 256 --turns 2} > "$OUT/demo.log" 2>&1
      tail -8 "$OUT/demo.log" ;;
    e2e)
      # The bars: deep at batch 25, calibrated to about 2.5 and 3.2 tokens a step (E2E_TPS); the same model at
      # fixed memory (the 2.5 setting's factor, no second calibration); deep-a3b at 2.5.
      tps=${E2E_TPS:-2.5,3.2}
      run_e2e() {  # name, then the arguments
        local name=$1; shift
        timeout "$T" python3 -m benchmarks.e2e --out "$OUT/$name" --drafts 4 --steps-per-call 8 --tokens 256 "$@" \
          ${E2E_ARGS:-} >> "$OUT/e2e.log" 2>&1
      }
      run_e2e e2e-deep-25 --size deep --batch 25 --tokens-per-step "$tps"
      factor=$(python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['runs'][0]; print(r['residual_factor'])" \
        "$OUT/e2e-deep-25/results.json" 2>/dev/null || echo 1)
      run_e2e e2e-deep-budget --size deep --budget-like snapshots:64 --residual-factor "$factor"
      run_e2e e2e-deep-a3b-25 --size deep-a3b --batch 25 --tokens-per-step "${tps%%,*}"
      grep -E "^(e2e|tuples|snapshots|none|ratios|checks|divergence)" "$OUT/e2e.log" ;;
    trees)
      # Trees in the loop at one agreement model (E2E_FACTOR, the 2.5 setting's factor): [2,2,2] against chains
      # of 4 and 8, tuples only.
      for shape in "--tree 2,2,2" "--drafts 4" "--drafts 8"; do
        name=trees-$(echo "$shape" | tr -c 'a-z0-9\n' '-' | tr -s '-' | sed 's/-$//')
        timeout "$T" python3 -m benchmarks.e2e --out "$OUT/$name" --size deep --batch 25 --steps-per-call 8 \
          --tokens 256 --records tuples --residual-factor "${E2E_FACTOR:-1}" $shape ${E2E_ARGS:-} >> "$OUT/trees.log" 2>&1
      done
      grep -E "^(e2e|tuples)" "$OUT/trees.log" ;;
    floor)
      timeout "$T" python3 -m benchmarks.floor --out "$OUT/floor" ${FLOOR_ARGS:-} > "$OUT/floor.log" 2>&1
      grep "^|" "$OUT/floor.log" || tail -20 "$OUT/floor.log" ;;
    portable)
      timeout "$T" python3 -m pytest -q -rfs -p no:cacheprovider tests/test_portable.py > "$OUT/portable.log" 2>&1
      timeout "$T" python3 scripts/portable_fixtures.py --out "$OUT/gpu-reference.npz" >> "$OUT/portable.log" 2>&1
      tail -12 "$OUT/portable.log" ;;
    soak)
      timeout "$T" python3 -m gdn_lossless_jax demo ${SOAK_ARGS:---size gpu --backend pallas --tokens 10000 --turns 2 \
        --prompts 4 --batch 4 --track-interval 256 --progress off} > "$OUT/soak.log" 2>&1
      tail -8 "$OUT/soak.log" ;;
    fuzz)
      for b in ${FUZZ_BACKENDS:-pallas triton}; do
        timeout "$T" python3 -m gdn_lossless_jax fuzz --backend "$b" ${FUZZ_ARGS:-} > "$OUT/fuzz-$b.log" 2>&1
        tail -12 "$OUT/fuzz-$b.log"
      done ;;
    checkpoint)
      ckpt=${CKPT_DIR:-/tmp/ckpt-a3b}
      { timeout "$T" python3 scripts/random_checkpoint.py --out "$ckpt" ${CKPT_ARGS:-} &&
        timeout "$T" python3 scripts/checkpoint_run.py "$ckpt" --out "$OUT/checkpoint.json" ${CKPT_RUN_ARGS:---prompts 8 \
          --prompt-len 32 --tokens 256 --drafts 4 --steps-per-call 8 --repeats 3}; } > "$OUT/checkpoint.log" 2>&1
      echo "exit status $?" >> "$OUT/checkpoint.log"
      tail -12 "$OUT/checkpoint.log" ;;
    *) echo "unknown phase $phase (tests, bench, step, demo, e2e, trees, floor, checkpoint, portable, soak, fuzz)"; exit 2 ;;
  esac
done
