"""Launch each kernel variant once (after a warm-up) for ncu; writes the launch order.

Used by scripts/gpu_session.sh profile: ncu's "Duration" per launch, in this order, is the
kernel time without any dispatch cost. The order goes to $OUT/variants.txt.
"""

import os

import jax
import jax.numpy as jnp
from variants import commit_case

import gdn_lossless_jax as gl
from gdn_lossless_jax import backends
from gdn_lossless_jax.backends.pallas import CommitConfig, VerifyConfig
from gdn_lossless_jax.cases import Shape, verify_inputs

pal = backends.resolve("pallas", "verify")
order = []
VERIFY = [(16, 1, True), (16, 2, True), (32, 1, True), (32, 2, True), (32, 4, True), (8, 1, True), (16, 2, False), (32, 4, False)]
for N, D in [(25, 4), (8, 16)]:
    x = verify_inputs(0, Shape(N=N, D=D, H=16, HV=32, K=128, V=128))
    for bv, w, rv in VERIFY:
        cfg = VerifyConfig(block_v=bv, num_warps=w, row_vectors=rv)
        for rec in gl.RECORD_MODES:
            f = jax.jit(lambda x, rec=rec, cfg=cfg: pal.verify(**x, record=rec, scale=128**-0.5, out_dtype=jnp.bfloat16, config=cfg))
            jax.block_until_ready(f(x))  # compile + warm-up launch (profiled too: skip the odd entries)
            jax.block_until_ready(f(x))
            order += [f"pallas verify {N}x{D} {rec} bv{bv} w{w} rv{int(rv)} (warm-up)", f"pallas verify {N}x{D} {rec} bv{bv} w{w} rv{int(rv)}"]
    try:
        for rec in gl.RECORD_MODES:
            f = jax.jit(lambda x, rec=rec: gl.verify(**x, record=rec, backend="triton"))
            jax.block_until_ready(f(x))
            jax.block_until_ready(f(x))
            order += [f"triton verify {N}x{D} {rec} (warm-up)", f"triton verify {N}x{D} {rec}"]
    except Exception as e:  # noqa: BLE001
        print("triton verify skipped:", e)
pool, tup, snp, idx = commit_case(25, 4)
for name, tape in (("replay", tup), ("scatter", snp)):
    for bv, w in [(16, 2), (32, 4), (32, 2), (64, 4), (8, 1), (128, 4)]:
        cfg = CommitConfig(block_v=bv, num_warps=w)
        f = jax.jit(lambda p, t, cfg=cfg: pal.commit(p, t, *idx, config=cfg), donate_argnums=0)
        pool = jax.block_until_ready(f(pool, tape))
        pool = jax.block_until_ready(f(pool, tape))
        order += [f"pallas commit {name} 30L 25x4 bv{bv} w{w} (warm-up)", f"pallas commit {name} 30L 25x4 bv{bv} w{w}"]
    try:
        f = jax.jit(lambda p, t: gl.commit(p, t, *idx, backend="triton"), donate_argnums=0)
        pool = jax.block_until_ready(f(pool, tape))
        pool = jax.block_until_ready(f(pool, tape))
        order += [f"triton commit {name} 30L 25x4 (warm-up)", f"triton commit {name} 30L 25x4"]
    except Exception as e:  # noqa: BLE001
        print("triton commit skipped:", e)
with open(os.path.join(os.environ.get("OUT", "/tmp"), "variants.txt"), "w") as fh:
    fh.write("\n".join(order) + "\n")
print(len(order), "launches")
