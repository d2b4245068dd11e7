#!/usr/bin/env python3
"""Probe: the verify chain with one warpgroup a ``[64, K]`` state tile, or two sharing it (K split).

The ``mosaic`` kernel's verify alone is held by its warps' latency (``benchmarks/NOTES.md``,
twenty-third session: as slow with its state in L2 as from DRAM) at two one-warpgroup CTAs an SM.
Here a CTA of ``--wgs 2`` warpgroups holds one tile, each warpgroup ``K / 2`` of its columns
(``[64, K / 2]`` in the WGMMA layout: about half the registers, 16 warps an SM): each step's two
K-reductions sum a warpgroup's half, then exchange the ``[64]`` partial sums through shared memory
(an mbarrier both warpgroups arrive at) and add them in one order, so both hold the same ``u``.

Not a backend: no pending commit, no table (request ``n`` reads state tile ``n``), fp32 outputs.
The same launch as the backend otherwise (persistent CTAs, the next tile's state and inputs by TMA
into the other of two shared-memory slots). Each form is checked against XLA's chain (fp32, the
reductions' order is each kernel's own: a tolerance, not bits) and timed by the profiler.

    python scripts/mgpu_ksplit_probe.py --configs 25x4,8x16 --wgs 1,2 --layers 30
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

H, HV, K, V, R = 16, 32, 128, 128, 64
F32 = jnp.float32


def tile_where(tile):
    """Tile ``tile``'s request (its state tile's index), v-head, q/k head and rows."""
    from jax.experimental import pallas as pl

    n, hv = tile // (HV * (V // R)), (tile // (V // R)) % HV
    return n, hv, hv // (HV // H), pl.ds((tile % (V // R)) * R, R)


@functools.cache
def build(N: int, D: int, layers: int, wgs: int, ctas: int, num_sms: int, interpret: bool):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    T = V // R
    TT = N * HV * T
    NG = ctas * num_sms
    KW = K // wgs  # a warpgroup's columns
    L = plgpu.Layout.WGMMA
    LROW, LCOL = L.reduce(1), L.reduce(0)

    def load(ref, layout):
        return plgpu.load(ref, layout=None if interpret else layout, optimized=False)

    def body(lay, kn, qn, v, gg, beta, pool, out, rec, smem, bars, xbar):
        wg = lax.axis_index("wg") if wgs > 1 else 0
        layer = lay[0]
        cta = lax.axis_index("cta")
        count = (TT - cta + NG - 1) // NG

        def fetch(tile, slot):
            n, hv, h, rows = tile_where(tile)
            bar = bars.at[slot]
            for w in range(wgs):  # the tile's column blocks, one a warpgroup
                plgpu.copy_gmem_to_smem(pool.at[layer, n, hv, rows, pl.ds(w * KW, KW)], smem["S"].at[slot, w], bar)
            plgpu.copy_gmem_to_smem(kn.at[n, :, h], smem["kn"].at[slot], bar)
            plgpu.copy_gmem_to_smem(qn.at[n, :, h], smem["qn"].at[slot], bar)
            plgpu.copy_gmem_to_smem(v.at[n, :, hv, rows], smem["v"].at[slot], bar)
            plgpu.copy_gmem_to_smem(gg.at[n], smem["g"].at[slot], bar)
            plgpu.copy_gmem_to_smem(beta.at[n], smem["beta"].at[slot], bar)

        def full_sum(part, e):
            """The [R] sum over K of a warpgroup's partial sums: exchange ``e`` (4 rotating buffers)."""
            if wgs == 1:
                return part
            buf = smem["x"].at[e % 4]
            buf[wg] = part
            plgpu.barrier_arrive(xbar.at[e % 4])
            plgpu.barrier_wait(xbar.at[e % 4])
            total = load(buf.at[0], LROW)
            for w in range(1, wgs):
                total = total + load(buf.at[w], LROW)
            return total

        def tile_step(j, e):
            tile = cta + j * NG
            slot = j % 2
            plgpu.commit_smem()

            @pl.when((j + 1 < count) & (wg == 0))
            def _():
                fetch(tile + NG, 1 - slot)

            plgpu.barrier_wait(bars.at[slot])
            n, hv, _, rows = tile_where(tile)
            S = load(smem["S"].at[slot, wg], L)
            for t in range(D):
                kb = lax.broadcast_in_dim(load(smem["kn"].at[slot, t, wg], LCOL), (R, KW), (1,))
                qb = lax.broadcast_in_dim(load(smem["qn"].at[slot, t, wg], LCOL), (R, KW), (1,))
                vt = load(smem["v"].at[slot, t], LROW).astype(F32)
                Sd = S * jnp.exp(smem["g"][slot, t, hv])
                ut = smem["beta"][slot, t, hv] * (vt - full_sum(jnp.sum(Sd * kb, axis=1), e + 2 * t))
                S = Sd + kb * lax.broadcast_in_dim(ut, (R, KW), (0,))
                o = full_sum(jnp.sum(S * qb, axis=1), e + 2 * t + 1)

                @pl.when(wg == 0)
                def _(o=o, ut=ut, t=t):
                    out[n, t, hv, rows] = o
                    rec[n, t, hv, rows] = ut

            return e + 2 * D

        @pl.when((count > 0) & (wg == 0))
        def _():
            fetch(cta, 0)

        @pl.when(count > 0)
        def _():
            lax.fori_loop(0, count, tile_step, 0)

    tr = () if interpret else (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
    smem = {
        "S": plgpu.SMEM((2, wgs, R, KW), F32, transforms=tr),
        "kn": plgpu.SMEM((2, D, wgs, KW), F32),
        "qn": plgpu.SMEM((2, D, wgs, KW), F32),
        "v": plgpu.SMEM((2, D, R), jnp.bfloat16),
        "g": plgpu.SMEM((2, D, HV), F32),
        "beta": plgpu.SMEM((2, D, HV), F32),
        "x": plgpu.SMEM((4, wgs, R), F32),
    }
    kernel = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((N, D, HV, V), F32), jax.ShapeDtypeStruct((N, D, HV, V), F32)),
        scratch_types=(smem, plgpu.Barrier(num_arrivals=wgs + 5, num_barriers=2), plgpu.Barrier(num_arrivals=wgs,
                       num_barriers=4)),  # fmt: skip
        grid=(NG,),
        grid_names=("cta",),
        num_threads=wgs if wgs > 1 else None,
        thread_name="wg" if wgs > 1 else None,
        kernel_name=f"ksplit_probe_wg{wgs}",
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )

    def run(pool, layer, kn, qn, v, g, beta):  # kn, qn: [N, D, H, wgs, KW]
        return kernel(jnp.reshape(layer, (1,)).astype(jnp.int32), kn, qn, v, g, beta, pool)

    return jax.jit(run)


def inputs(N, D, layers, seed=0):
    rng = np.random.default_rng(seed)

    def unit(*shape):
        x = rng.standard_normal(shape)
        return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)

    pool = jax.random.normal(jax.random.key(seed), (layers, N, HV, V, K), F32)
    return {
        "pool": pool,
        "kn": jnp.asarray(unit(N, D, H, K)),
        "qn": jnp.asarray(unit(N, D, H, K) * K**-0.5),
        "v": jnp.asarray(rng.standard_normal((N, D, HV, V)), jnp.bfloat16),
        "g": jnp.asarray(-rng.random((N, D, HV)).astype(np.float32) * 0.3),
        "beta": jnp.asarray(rng.random((N, D, HV)).astype(np.float32)),
    }


def xla_chain(x, layer):
    """The same steps in XLA, fp32 (its own reduction order): outputs and u, [N, D, HV, V]."""
    S = x["pool"][layer]
    kn, qn = (jnp.repeat(x[k], HV // H, axis=2) for k in ("kn", "qn"))
    os, us = [], []
    for t in range(kn.shape[1]):
        Sd = S * jnp.exp(x["g"][:, t])[..., None, None]
        u = x["beta"][:, t][..., None] * (x["v"][:, t].astype(F32) - jnp.einsum("nhvk,nhk->nhv", Sd, kn[:, t]))
        S = Sd + u[..., None] * kn[:, t][:, :, None, :]
        os.append(jnp.einsum("nhvk,nhk->nhv", S, qn[:, t]))
        us.append(u)
    return jnp.stack(os, 1), jnp.stack(us, 1)


def check_and_time(label, call, want, floor, args, interpret) -> bool:
    """Print ``call(0)``'s largest error against ``want`` (outputs, u) and, on a GPU, its kernel's
    device time over ``args.calls`` calls taking the layers in turn; whether the error is small."""
    got = [np.asarray(a) for a in call(0)]
    err = max(np.abs(g - w).max() / np.abs(w).max() for g, w in zip(got, want))
    line = f"{label}: max relative error against XLA's chain {err:.1e}"
    if not interpret:
        from benchmarks.devtime import device_time

        def run():
            for i in range(args.calls):
                r = call(i % args.layers)
            jax.block_until_ready(r)

        t = device_time(run, 3, args.calls) or {"kernels": []}
        ks = [k for k in t["kernels"] if "probe" in k["name"]]
        us = ks[0]["median_us"] if ks else float("nan")
        line += f"; kernel {us:.1f} us ({us / floor:.2f}x the verify's floor {floor:.1f} us)"
        line += f"\n  launch: {ks[0]['details'] if ks else '?'}"
    print(line, flush=True)
    return err < 1e-4


def parser(doc: str) -> argparse.ArgumentParser:
    """The probes' common options."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--configs", default="25x4,8x16")
    p.add_argument("--ctas", type=int, default=2, help="persistent CTAs an SM")
    p.add_argument("--layers", type=int, default=30, help="pool layers, one a call in turn (30: states from DRAM)")
    p.add_argument("--calls", type=int, default=30)
    return p


def platform() -> tuple[bool, int]:
    """``(interpret, SMs)``, after printing the platform."""
    interpret = jax.default_backend() == "cpu"
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    return interpret, 1 if interpret else int(getattr(jax.devices()[0], "core_count", 0) or 132)


def case(cfg: str, layers: int):
    """``(N, D, inputs, XLA's outputs and u, the verify's byte floor in us)`` of a config ``NxD``."""
    N, D = map(int, cfg.split("x"))
    x = inputs(N, D, layers)
    want = tuple(np.asarray(a) for a in xla_chain(x, 0))
    floor = 4 * (N * HV * V * K + N * D * (2 * H * K + 2 * HV * V + 2 * HV)) / 4.1e12 * 1e6  # state in, tapes
    return N, D, x, want, floor


def main(argv=None) -> int:
    p = parser(__doc__)
    p.add_argument("--wgs", default="1,2", help="warpgroups sharing a tile, per form")
    args = p.parse_args(argv)
    interpret, num_sms = platform()
    bad = 0
    for cfg in args.configs.split(","):
        N, D, x, want, floor = case(cfg, args.layers)
        for wgs in map(int, args.wgs.split(",")):
            f = build(N, D, args.layers, wgs, args.ctas, num_sms, interpret)
            split = {k: x[k].reshape(N, D, H, wgs, K // wgs) for k in ("kn", "qn")}
            call = lambda layer: f(x["pool"], jnp.int32(layer), split["kn"], split["qn"], x["v"], x["g"], x["beta"])  # noqa: E731
            bad += not check_and_time(f"{cfg} wgs={wgs} ctas={args.ctas}", call, want, floor, args, interpret)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
