#!/usr/bin/env python3
"""Probe: the verify alone (tuples) in the Gram form on CUDA cores, against the chain.

The ``mosaic`` kernel's verify is held by its instructions (``benchmarks/NOTES.md``, twenty-third
session): each of its D steps decays the ``[64, K]`` state tile, reduces it against ``k_t``,
updates it and reduces it against ``q_t``, one step after the other. The Gram form (the Pallas
backend's ``gram`` verify, module docstring of ``backends/pallas/verify.py``) needs only the
untouched state's products ``xk_t = S0 k_t`` and ``xq_t = S0 q_t``: 2D independent reductions of
the tile, then per row the ``D x D`` recurrence

    u_t = beta_t (v_t - P_t xk_t) - sum_{s<t} W[t, s] u_s,   o_t = P_t xq_t + sum_{s<=t} C[t, s] u_s

with ``P_t = exp(g_0 + ... + g_t)``, ``W[t, s] = beta_t G[t, s] (k_t . k_s)``, ``C[t, s] = G[t, s]
(q_t . k_s)``, ``G[t, s] = exp(g_{s+1} + ... + g_t)``, computed here by XLA (in a backend: by the
prologue). About half the chain's floating-point instructions at D = 4 and no serial dependence
through the tile. Its ``u`` differs from the chain's in the low bits (as the backends' already do:
the tape is exact against its own commit, whichever form made it).

Not a backend: the same simplifications as ``scripts/mgpu_ksplit_probe.py`` (whose chain kernel,
one warpgroup a tile, is the baseline here), fp32 outputs. Both are checked against XLA's chain
(a tolerance) and timed by the profiler.

    python scripts/mgpu_gram_probe.py --configs 25x4 --layers 30

Measured on the H200 (``benchmarks/results/h200-2026-12-04-gram/call3``): 25x4, the verify alone,
20.0 us against the chain's 24.3. D = 16 (8x16) does not fit its one coefficient row (a TMA copy takes at
most 256 elements a dimension); the ``mosaic`` backend's ``VerifyConfig(verify="gram")``, which
grew out of it, copies them as a ``[rows, Dp]`` block and takes every D.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from mgpu_ksplit_probe import HV, H, K, R, V, case, check_and_time, parser, platform, tile_where
from mgpu_ksplit_probe import build as build_chain

F32 = jnp.float32


def coefficients(x):
    """``P [N, HV, D]``, ``W`` and ``C [N, HV, D, D]`` (the module docstring), by XLA."""
    kn, qn = (jnp.repeat(x[k], HV // H, axis=2) for k in ("kn", "qn"))  # [N, D, HV, K]
    g, beta = x["g"], x["beta"]  # [N, D, HV]
    D = g.shape[1]
    t_, s_ = np.arange(D)[:, None], np.arange(D)[None, :]
    cum = jnp.cumsum(jnp.moveaxis(g, 1, -1), axis=-1)  # [N, HV, D]: g_0 + ... + g_t
    G = jnp.exp(jnp.where(s_ <= t_, cum[..., :, None] - cum[..., None, :], -jnp.inf))  # [N, HV, t, s]
    hi = lax.Precision.HIGHEST  # (the GPU's default takes TF32 products: a 7e-5 error on the H200)
    KK = jnp.einsum("nthk,nshk->nhts", kn, kn, precision=hi)
    QK = jnp.einsum("nthk,nshk->nhts", qn, kn, precision=hi)
    W = jnp.where(s_ < t_, jnp.moveaxis(beta, 1, -1)[..., :, None] * G * KK, 0.0)
    C = jnp.where(s_ <= t_, G * QK, 0.0)
    return jnp.exp(cum), W.astype(F32), C.astype(F32)


def coef_width(D: int) -> int:
    """Floats of a coefficient row (beta, P, W, C), padded to 32 (128 bytes: a TMA copy's alignment)."""
    return -(-(2 * D + 2 * D * D) // 32) * 32


@functools.cache
def build(N: int, D: int, ctas: int, num_sms: int, interpret: bool):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    T = V // R
    CW = coef_width(D)
    TT = N * HV * T
    NG = ctas * num_sms
    L = plgpu.Layout.WGMMA
    LROW, LCOL = L.reduce(1), L.reduce(0)

    def load(ref, layout):
        return plgpu.load(ref, layout=None if interpret else layout, optimized=False)

    o_p, o_w, o_c = D, 2 * D, 2 * D + D * D  # offsets into a (request, head)'s coefficient row (beta first)

    def body(lay, kq, v, coef, pool, out, rec, smem, bars):
        layer = lay[0]
        cta = lax.axis_index("cta")
        count = (TT - cta + NG - 1) // NG

        def fetch(tile, slot):
            n, hv, h, rows = tile_where(tile)
            bar = bars.at[slot]
            plgpu.copy_gmem_to_smem(pool.at[layer, n, hv, rows, :], smem["S"].at[slot], bar)
            plgpu.copy_gmem_to_smem(kq.at[n, h], smem["kq"].at[slot], bar)
            plgpu.copy_gmem_to_smem(v.at[n, :, hv, rows], smem["v"].at[slot], bar)
            plgpu.copy_gmem_to_smem(coef.at[n, hv], smem["coef"].at[slot], bar)

        def tile_step(j, carry):
            tile = cta + j * NG
            slot = j % 2
            plgpu.commit_smem()

            @pl.when(j + 1 < count)
            def _():
                fetch(tile + NG, 1 - slot)

            plgpu.barrier_wait(bars.at[slot])
            n, hv, _, rows = tile_where(tile)
            S = load(smem["S"].at[slot], L)
            sm = {k: smem[k].at[slot] for k in ("kq", "v", "coef")}
            cf = sm["coef"]
            # xk_t = S0 k_t, xq_t = S0 q_t: 2D reductions of the same tile, independent of each other
            xs = [jnp.sum(S * lax.broadcast_in_dim(load(sm["kq"].at[i], LCOL), (R, K), (1,)), axis=1)
                  for i in range(2 * D)]  # fmt: skip
            us = []
            for t in range(D):
                vt = load(sm["v"].at[t], LROW).astype(F32)
                u = cf[t] * (vt - cf[o_p + t] * xs[t])
                for s in range(t):
                    u = u - cf[o_w + t * D + s] * us[s]
                us.append(u)
                o = cf[o_p + t] * xs[D + t]
                for s in range(t + 1):
                    o = o + cf[o_c + t * D + s] * us[s]
                out[n, t, hv, rows] = o
                rec[n, t, hv, rows] = u
            return carry

        @pl.when(count > 0)
        def _():
            fetch(cta, 0)
            lax.fori_loop(0, count, tile_step, 0)

    tr = () if interpret else (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
    # Scratch is laid out in the pytree's order (a dict's sorted keys), each TMA destination (every slot)
    # 128-byte aligned: "S" first, the coefficients one row padded to 32 floats (seven small buffers of
    # 16-64 bytes a slot gave a misaligned address on the GPU).
    smem = {
        "S": plgpu.SMEM((2, R, K), F32, transforms=tr),
        "kq": plgpu.SMEM((2, 2 * D, K), F32),
        "v": plgpu.SMEM((2, D, R), jnp.bfloat16),
        "coef": plgpu.SMEM((2, CW), F32),
    }
    kernel = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((N, D, HV, V), F32), jax.ShapeDtypeStruct((N, D, HV, V), F32)),
        scratch_types=(smem, plgpu.Barrier(num_arrivals=4, num_barriers=2)),
        grid=(NG,),
        grid_names=("cta",),
        kernel_name="gram_probe",
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )

    def run(pool, layer, kq, v, coef):  # kq: [N, H, 2D, K] (keys then queries); coef: [N, HV, CW]
        return kernel(jnp.reshape(layer, (1,)).astype(jnp.int32), kq, v, coef, pool)

    return jax.jit(run)


def main(argv=None) -> int:
    args = parser(__doc__).parse_args(argv)
    interpret, num_sms = platform()
    bad = 0
    for cfg in args.configs.split(","):
        N, D, x, want, floor = case(cfg, args.layers)
        P, W, C = coefficients(x)
        kq = jnp.moveaxis(jnp.concatenate([x["kn"], x["qn"]], axis=1), 2, 1)  # [N, H, 2D, K]
        beta = jnp.moveaxis(x["beta"], 1, -1)  # [N, HV, D]
        coef = jnp.concatenate([beta, P, W.reshape(N, HV, D * D), C.reshape(N, HV, D * D)], axis=-1)
        coef = jnp.pad(coef, [(0, 0), (0, 0), (0, coef_width(D) - coef.shape[-1])])
        chain = build_chain(N, D, args.layers, 1, args.ctas, num_sms, interpret)
        split = {k: x[k].reshape(N, D, H, 1, K) for k in ("kn", "qn")}
        forms = {
            "chain": lambda layer: chain(x["pool"], jnp.int32(layer), split["kn"], split["qn"], x["v"], x["g"],
                                         x["beta"]),  # fmt: skip
            "gram": lambda layer: build(N, D, args.ctas, num_sms, interpret)(x["pool"], jnp.int32(layer), kq, x["v"],
                                                                             coef),  # fmt: skip
        }
        for name, call in forms.items():
            bad += not check_and_time(f"{cfg} {name} ctas={args.ctas}", call, want, floor, args, interpret)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
