#!/usr/bin/env python3
"""A prototype of the fused step's kernel on Pallas' Mosaic GPU backend: what would it cost?

Not a backend: a measurement for issue 16 (``benchmarks/NOTES.md``, eighteenth session). One layer, an fp32 pool
whose slot n is request n, a tuple tape pending for every request. The replay is a fixed ``--replay`` steps
long, with no masks and no track state.

Each CTA is one warpgroup on a ``[64, K]`` tile of one (request, v-head), held in the ``WGMMA`` register layout (a
thread holds 2 rows and 32 columns, so a reduction over K is mostly in registers). It does:
- the pending steps replayed with the rule, ``fma(k, u, rn(S * alpha))``;
- the accepted state stored;
- the ``D`` new steps run (``u = beta (v - sum(rn(S alpha) k))``, the update with the same rule, ``o = sum(S q)``),
  their outputs and ``u`` stored.

The fma is pinned through ``plgpu.inline_mgpu`` (MLIR ``math.fma``); ``--fma plain`` writes ``k * u + Sd`` in
jax.numpy instead, the control. The pool is checked on bit patterns against ``testing.replay_oracle``, and the
outputs and ``u`` against a float64 chain from that pool (their reductions' order is the kernel's own). The
kernel's device time is the profiler's (``benchmarks.devtime``).

    python scripts/mgpu_fused_probe.py --config 25x4            # on the GPU
    python scripts/mgpu_fused_probe.py --config 2x2 --interpret # Mosaic GPU's interpret mode on the CPU (plain fma)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

from gdn_lossless_jax.testing import bits, replay_oracle

H, HV, K, V, R = 16, 32, 128, 128, 64  # the benchmark geometry; R rows a CTA (the WGMMA layout's 64)


def build(N: int, D: int, PD: int, fma_form: str, interpret):
    from jax import lax
    from jax._src.lib.mlir.dialects import math as mlir_math
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    f32 = jnp.float32
    L = plgpu.Layout.WGMMA
    ROW, COL = L.reduce(1), L.reduce(0)  # a [R] vector along the rows, a [K] vector along the columns
    G = HV // H
    T = V // R

    if fma_form == "pinned":

        @plgpu.inline_mgpu(arg_types=(L, L, L), return_type=plgpu.ShapeDtypeStruct((R, K), f32, layout=L))
        def fma(ctx, a, b, c):
            return a._pointwise(lambda x, y, z: mlir_math.fma(x, y, z), b, c)
    else:

        def fma(a, b, c):
            return a * b + c

    def load(ref, layout):
        return plgpu.load(ref, layout=layout, optimized=False)

    def rows_of(vec):  # a [R] vector across the tile's columns (one broadcast, no [R, 1] in between)
        return lax.broadcast_in_dim(vec, (R, K), (0,))

    def cols_of(vec):  # a [K] vector down the tile's rows
        return lax.broadcast_in_dim(vec, (R, K), (1,))

    def body(pool, pk, pu, pa, qn, kn, v, ga, beta, out, u_out, pool_out):
        cta = lax.axis_index("tile")
        n = cta // (HV * T)
        hv = (cta // T) % HV
        r0 = (cta % T) * R
        h = hv // G
        rows = pl.ds(r0, R)
        S = load(pool.at[n, hv, rows, :], L)
        for t in range(PD):  # the pending tuple commit
            kb = cols_of(load(pk.at[n, t, h, :], COL))
            ub = rows_of(load(pu.at[n, t, hv, rows], ROW))
            S = fma(kb, ub, S * pa[n, t, hv])
        pool_out[n, hv, rows, :] = S
        for t in range(D):  # the new drafts
            kb = cols_of(load(kn.at[n, t, h, :], COL))
            qb = cols_of(load(qn.at[n, t, h, :], COL))
            vt = load(v.at[n, t, hv, rows], ROW)
            Sd = S * ga[n, t, hv]
            ut = beta[n, t, hv] * (vt - jnp.sum(Sd * kb, axis=1))
            S = fma(kb, rows_of(ut), Sd)
            out[n, t, hv, rows] = jnp.sum(S * qb, axis=1)
            u_out[n, t, hv, rows] = ut

    shapes = (
        jax.ShapeDtypeStruct((N, D, HV, V), f32),
        jax.ShapeDtypeStruct((N, D, HV, V), f32),
        jax.ShapeDtypeStruct((N, HV, V, K), f32),
    )
    return plgpu.kernel(body, out_type=shapes, grid=(N * HV * T,), grid_names=("tile",), interpret=interpret)


def inputs(N: int, D: int, PD: int, seed: int):
    rng = np.random.default_rng(seed)
    f32 = np.float32

    def unit(*shape):
        x = rng.standard_normal(shape)
        return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(f32)

    return {
        "pool": rng.standard_normal((N, HV, V, K)).astype(f32),
        "pk": unit(N, PD, H, K),
        "pu": (rng.standard_normal((N, PD, HV, V)) * 0.5).astype(f32),
        "pa": np.exp(-rng.random((N, PD, HV)) * 0.5).astype(f32),
        "qn": unit(N, D, H, K) * f32(K**-0.5),
        "kn": unit(N, D, H, K),
        "v": rng.standard_normal((N, D, HV, V)).astype(f32),
        "ga": np.exp(-rng.random((N, D, HV)) * 0.5).astype(f32),
        "beta": rng.random((N, D, HV)).astype(f32),
    }


def expected(x, D: int, PD: int):
    """The pool bit for bit (the rule in NumPy), the outputs and u in float64 from it."""
    N = x["pool"].shape[0]
    pool = replay_oracle(x["pool"], x["pu"], x["pk"], x["pa"], np.full(N, PD - 1))
    S = pool.astype(np.float64)
    G = HV // H
    out, u = np.zeros((N, D, HV, V)), np.zeros((N, D, HV, V))
    for t in range(D):
        k = np.repeat(x["kn"][:, t], G, axis=1).astype(np.float64)  # [N, HV, K]
        q = np.repeat(x["qn"][:, t], G, axis=1).astype(np.float64)
        Sd = S * x["ga"][:, t, :, None, None]
        u[:, t] = x["beta"][:, t, :, None] * (x["v"][:, t] - np.einsum("nhvk,nhk->nhv", Sd, k))
        S = Sd + u[:, t][..., None] * k[:, :, None, :]
        out[:, t] = np.einsum("nhvk,nhk->nhv", S, q)
    return pool, out, u


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="25x4", help="REQUESTSxDRAFTS")
    p.add_argument("--replay", type=int, default=3, help="pending steps replayed (the same for every request)")
    p.add_argument("--fma", default="pinned", choices=("pinned", "plain"))
    p.add_argument("--interpret", action="store_true", help="Mosaic GPU's interpret mode (the CPU; --fma plain)")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    N, D = map(int, args.config.split("x"))
    PD = args.replay
    interpret = None
    if args.interpret:
        from jax.experimental.pallas import mosaic_gpu as plgpu

        interpret = plgpu.InterpretGPUParams()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}: {N}x{D}, replay {PD}, fma {args.fma}", flush=True)
    x = inputs(N, D, PD, args.seed)
    t0 = time.perf_counter()
    f = jax.jit(build(N, D, PD, args.fma, interpret))
    dev = {k: jnp.asarray(a) for k, a in x.items()}
    order = ("pool", "pk", "pu", "pa", "qn", "kn", "v", "ga", "beta")
    out, u, pool = jax.block_until_ready(f(*(dev[k] for k in order)))
    print(f"compiled and ran in {time.perf_counter() - t0:.1f} s", flush=True)
    want_pool, want_out, want_u = expected(x, D, PD)
    same = float(np.mean(bits(np.asarray(pool)) == bits(want_pool)))
    rel = lambda a, b: float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))
    print(
        f"pool equal to the rule, bit for bit: {same:.6f} of elements; outputs max rel {rel(out, want_out):.2e}, "
        f"u max rel {rel(u, want_u):.2e}"
    )
    if args.interpret:
        return 0 if same == 1.0 else 1
    from benchmarks.devtime import device_time

    def run():
        for _ in range(args.calls):
            r = f(*(dev[k] for k in order))
        jax.block_until_ready(r)

    t = device_time(run, 3, args.calls)
    for k in (t or {}).get("kernels", [])[:3]:
        print(
            f"kernel {k['name'][:60]}: median {k['median_us']:.1f} us (p10 {k['p10_us']:.1f}, p90 {k['p90_us']:.1f}) "
            f"x{k['launches_per_call']:.0f}  {k['details'][:160]}"
        )
    bytes_ = 4 * (2 * N * HV * V * K + N * PD * (H * K + HV * V) + N * D * (2 * H * K + 3 * HV * V))
    print(f"bytes {bytes_ / 1e6:.1f} MB: {bytes_ / 4.1e12 * 1e6:.1f} us at 4.1 TB/s")
    return 0 if same == 1.0 or args.fma == "plain" else 1


if __name__ == "__main__":
    raise SystemExit(main())
