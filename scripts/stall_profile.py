"""Warp stall reasons of a few verify launches, for Nsight Compute (one launch each, after a warm-up).

Run under ncu by ``scripts/gpu_session.sh stalls``, which lists the metrics (durations,
occupancy, issue activity, DRAM and L2 bytes, every warp stall reason) and filters the kernels
named ``gdn_verify_*``; ncu prints them per launch. Variants: ``STALL_VARIANTS`` as
``NxD:RECORD:BLOCK_V:NUM_WARPS:K_CHUNK:UNROLL[:TAG...]`` (comma separated; tags as in
``scripts/variants.py``, e.g. ``gram``; the other fields are ``VerifyConfig``'s defaults). The launch order goes to ``$OUT/stall_variants.txt``.
"""

import os

import jax
import jax.numpy as jnp
from variants import verify_config

from gdn_lossless_jax import backends
from gdn_lossless_jax.cases import Shape, verify_inputs

DEFAULT = "25x4:tuples:8:1:16:0,25x4:tuples:8:1:128:16,25x4:snapshots:8:1:16:0,8x16:tuples:8:1:16:0"
pal = backends.resolve("pallas", "verify")
order = []
inputs = {}
for spec in os.environ.get("STALL_VARIANTS", DEFAULT).split(","):
    nd, rec, bv, w, kc, un, *tags = spec.split(":")
    N, D = map(int, nd.split("x"))
    if nd not in inputs:
        inputs[nd] = verify_inputs(0, Shape(N=N, D=D, H=16, HV=32, K=128, V=128))
    cfg = verify_config(tags, block_v=int(bv), num_warps=int(w), k_chunk=int(kc), unroll=int(un))
    f = jax.jit(lambda x, rec=rec, cfg=cfg: pal.verify(**x, record=rec, scale=128**-0.5, out_dtype=jnp.bfloat16, config=cfg))
    jax.block_until_ready(f(inputs[nd]))  # compile + warm-up (profiled too: the odd launches)
    jax.block_until_ready(f(inputs[nd]))
    order += [f"{spec} (warm-up)", spec]
    print("launched", spec, flush=True)
with open(os.path.join(os.environ.get("OUT", "/tmp"), "stall_variants.txt"), "w") as fh:
    fh.write("\n".join(order) + "\n")
