"""Launch-configuration sweep for the Pallas kernels on the GPU (times only; see benchmarks/ for results).

Each variant is timed as R calls inside one jitted function over R input sets (so JAX's
dispatch cost is amortised and the L2 cache does not hold the state), interleaved across
variants, medians over trials.
"""

import itertools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import gdn_lossless_jax as gl
from gdn_lossless_jax import backends
from gdn_lossless_jax.backends.pallas import CommitConfig, VerifyConfig
from gdn_lossless_jax.cases import Shape, commit_indices, verify_inputs

pal = backends.resolve("pallas", "verify")
R, TRIALS = 12, 9
out_dir = os.environ.get("OUT", "/tmp")
rows = []


def run_interleaved(variants):
    """variants: name -> (jitted multi fn, args). Returns name -> list of per-call us."""
    for f, a in variants.values():
        jax.block_until_ready(f(*a))
    times = {k: [] for k in variants}
    for _ in range(TRIALS):
        for k, (f, a) in variants.items():
            t = time.perf_counter()
            jax.block_until_ready(f(*a))
            times[k].append((time.perf_counter() - t) / R * 1e6)
    return times


def report(times, extra):
    for k, ts in times.items():
        row = dict(variant=k, median_us=float(np.median(ts)), p10=float(np.percentile(ts, 10)), p90=float(np.percentile(ts, 90)), **extra)
        rows.append(row)
        print(f"{k:<60} {row['median_us']:8.1f} us  [{row['p10']:.1f}, {row['p90']:.1f}]", flush=True)


big = jnp.ones((256 * 2**20,), jnp.float32)
cp = jax.jit(lambda xs: [-x for x in xs])
t = run_interleaved({"copy 1 GiB": (cp, ([big] * 1,))})
copy_us = float(np.median(t["copy 1 GiB"])) * R  # one copy per call
print(f"copy 1 GiB: {copy_us:.1f} us, rate {2 * big.nbytes / (copy_us * 1e-6) / 1e12:.2f} TB/s", flush=True)
rows.append(dict(variant="copy 1 GiB", median_us=copy_us, kind="copy"))

configs = [VerifyConfig(block_v=bv, num_warps=w) for bv, w in itertools.product([16, 32, 64], [2, 4, 8])]
for N, D in [(25, 4), (8, 16)]:
    shape = Shape(N=N, D=D, H=16, HV=32, K=128, V=128)
    xs = [verify_inputs(i, shape) for i in range(R)]
    variants = {}
    for cfg in configs:
        for rec in gl.RECORD_MODES:
            f = jax.jit(lambda xs, cfg=cfg, rec=rec: [pal.verify(**x, record=rec, scale=128**-0.5, out_dtype=jnp.bfloat16, config=cfg) for x in xs])
            variants[f"verify {N}x{D} {rec} bv{cfg.block_v} w{cfg.num_warps}"] = (f, (xs,))
    report(run_interleaved(variants), dict(kind="verify", N=N, D=D))
    del xs

# commit, 30 layers, 25x4, pool donated, R commits chained inside one jit.
L, N, D = 30, 25, 4
S = 2 * N + 8
rng = np.random.default_rng(0)
pool = jnp.asarray(rng.standard_normal((L, S, 32, 128, 128), np.float32))
idx = commit_indices(0, N=N, D=D, slots_in_pool=S, track_fraction=0.25).as_args()
tup = gl.Tuples(
    u=jnp.asarray(rng.standard_normal((L, N, D, 32, 128), np.float32)),
    k=jnp.asarray(rng.standard_normal((L, N, D, 16, 128), np.float32)),
    g=-jnp.asarray(np.abs(rng.standard_normal((L, N, D, 32), np.float32))),
)
snp = gl.Snapshots(jnp.asarray(rng.standard_normal((L, N, D, 32, 128, 128), np.float32)))
ccfgs = [CommitConfig(block_v=bv, num_warps=w) for bv, w in itertools.product([16, 32, 64], [2, 4, 8])]
for name, tape in (("replay", tup), ("scatter", snp)):
    for cfg in ccfgs:
        def chain(pool, tape, cfg=cfg):
            for _ in range(R):
                pool = pal.commit(pool, tape, *idx, config=cfg)
            return pool

        f = jax.jit(chain, donate_argnums=0)
        pool = f(pool, tape)
        ts = []
        for _ in range(TRIALS):
            t0 = time.perf_counter()
            pool = f(pool, tape)
            jax.block_until_ready(pool)
            ts.append((time.perf_counter() - t0) / R * 1e6)
        report({f"commit {name} 30L 25x4 bv{cfg.block_v} w{cfg.num_warps}": ts}, dict(kind="commit", N=N, D=D))
json.dump(rows, open(os.path.join(out_dir, "tune.json"), "w"), indent=1)
