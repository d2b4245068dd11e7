#!/usr/bin/env python3
"""A prototype of the fused step's kernel on Pallas' Mosaic GPU backend: what would it cost?

Not a backend: a measurement for issue 16 (``benchmarks/NOTES.md``, eighteenth and nineteenth sessions). One layer,
an fp32 pool whose slot n is request n, a tuple tape pending for every request. The replay is a fixed ``--replay``
steps long, with no masks and no track state.

Each CTA is one warpgroup on a ``[64, K]`` tile of one (request, v-head), held in the ``WGMMA`` register layout (a
thread holds 2 rows and 32 columns, so a reduction over K is mostly in registers). It does:
- the pending steps replayed with the rule, ``fma(k, u, rn(S * alpha))``;
- the accepted state stored;
- the ``D`` new steps run (``u = beta (v - sum(rn(S alpha) k))``, the update with the same rule, ``o = sum(S q)``),
  their outputs and ``u`` stored.

Launches: by default one CTA a tile, every load from global memory. ``--stage small`` copies the small inputs (tape,
k, q, v, g, beta) to SMEM by TMA before any store, ``--stage all`` the state too (the pool stored from SMEM by TMA).
``--persist P`` runs P persistent CTAs an SM, each bringing the next tile's state and inputs into the other of two
SMEM slots by TMA while it computes this one (``--small-slots 1``: the inputs single-buffered). The fastest on the
H200 is ``--persist 2`` at 25x4, 8x4 and 8x8, and ``--persist 2 --small-slots 1`` at 8x16 (``benchmarks/NOTES.md``,
nineteenth session).

The fma is pinned through ``plgpu.inline_mgpu`` (MLIR ``math.fma``); ``--fma plain`` writes ``k * u + Sd`` in
jax.numpy instead: Mosaic GPU contracts that into the same fma (it gave the rule's bits on the H200), so the pin
only keeps the form from depending on the compiler. ``scripts/mgpu_fma_probe.py`` holds the controls (the other
rounding forms, which the check must tell apart). The pool is checked on bit patterns against
``testing.replay_oracle``, and the outputs and ``u`` against a float64 chain from that pool (their reductions' order
is the kernel's own). The kernel's device time is the profiler's (``benchmarks.devtime``).

    python scripts/mgpu_fused_probe.py --config 25x4 --persist 2   # on the GPU
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


SMALL = ("pk", "pu", "pa", "kn", "qn", "v", "ga", "beta")


def build(N, D, PD, fma_form, interpret, stage="none", defer=False, persist=0, small_slots=2):
    """``persist``: that many persistent CTAs an SM (``--persist``), else one CTA a tile."""
    from jax import lax
    from jax._src.lib.mlir.dialects import math as mlir_math
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    f32 = jnp.float32
    L = plgpu.Layout.WGMMA
    ROW, COL = L.reduce(1), L.reduce(0)  # a [R] vector along the rows, a [K] vector along the columns
    G = HV // H
    T = V // R
    NG = persist * getattr(jax.devices()[0], "core_count", 132) if persist else 0  # persistent CTAs

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

    def where(tile):
        n = tile // (HV * T)
        hv = (tile // T) % HV
        return n, hv, hv // G, pl.ds((tile % T) * R, R)

    def gmem_small(ins, n, hv, h, rows):
        pk, pu, pa, qn, kn, v, ga, beta = ins
        return {
            "pk": pk.at[n, :, h, :],
            "pu": pu.at[n, :, hv, rows],
            "pa": pa.at[n],
            "kn": kn.at[n, :, h, :],
            "qn": qn.at[n, :, h, :],
            "v": v.at[n, :, hv, rows],
            "ga": ga.at[n],
            "beta": beta.at[n],
        }

    def outputs_to(out, u_out, n, hv, rows):
        """``store_out`` for a tile: step t's output and u straight to global memory."""

        def store_out(t, o, ut):
            out[n, t, hv, rows] = o
            u_out[n, t, hv, rows] = ut

        return store_out

    def pool_through_smem(S_s, dst):
        """``store_pool`` through the SMEM tile ``S_s`` and an asynchronous TMA store to ``dst``."""

        def store_pool(S):
            S_s[...] = S
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(S_s, dst)

        return store_pool

    def tile_step(S, src, hv, store_pool, store_out):
        """The replay, the pool's store (``store_pool(S)``), the chain and its outputs (``store_out(t, o, u)``)."""
        for t in range(PD):  # the pending tuple commit
            kb = cols_of(load(src["pk"].at[t], COL))
            ub = rows_of(load(src["pu"].at[t], ROW))
            S = fma(kb, ub, S * src["pa"][t, hv])
        store_pool(S)
        kept = []
        for t in range(D):  # the new drafts
            kb = cols_of(load(src["kn"].at[t], COL))
            qb = cols_of(load(src["qn"].at[t], COL))
            vt = load(src["v"].at[t], ROW)
            Sd = S * src["ga"][t, hv]
            ut = src["beta"][t, hv] * (vt - jnp.sum(Sd * kb, axis=1))
            S = fma(kb, rows_of(ut), Sd)
            o = jnp.sum(S * qb, axis=1)
            if defer:
                kept.append((o, ut))
            else:
                store_out(t, o, ut)
        for t, (o, ut) in enumerate(kept):
            store_out(t, o, ut)

    def body(pool, pk, pu, pa, qn, kn, v, ga, beta, out, u_out, pool_out, *scratch):
        n, hv, h, rows = where(lax.axis_index("tile"))
        gm = gmem_small((pk, pu, pa, qn, kn, v, ga, beta), n, hv, h, rows)
        if stage == "none":
            src = gm
            S = load(pool.at[n, hv, rows, :], L)
        else:  # every small input of this (request, v-head) copied to SMEM by TMA before any store
            smem, bars = scratch
            names = [k for k in SMALL if k in smem]
            if stage == "all":
                plgpu.copy_gmem_to_smem(pool.at[n, hv, rows, :], smem["S"], bars.at[len(names)])
            for i, k in enumerate(names):
                plgpu.copy_gmem_to_smem(gm[k], smem[k], bars.at[i])
            for i in range(len(names)):
                plgpu.barrier_wait(bars.at[i])
            src = {k: smem.get(k) for k in SMALL}
            if stage == "all":
                plgpu.barrier_wait(bars.at[len(names)])
                S = load(smem["S"], L)
            else:
                S = load(pool.at[n, hv, rows, :], L)

        if stage == "all":
            store_pool = pool_through_smem(smem["S"], pool_out.at[n, hv, rows, :])
        else:

            def store_pool(S):
                pool_out[n, hv, rows, :] = S

        tile_step(S, src, hv, store_pool, outputs_to(out, u_out, n, hv, rows))
        if stage == "all":
            plgpu.wait_smem_to_gmem(0)

    TT = N * HV * T  # tiles

    def body_persist(pool, pk, pu, pa, qn, kn, v, ga, beta, out, u_out, pool_out, smem, bars, *bars_small):
        """Persistent CTAs, each on tiles cta, cta + NG, ...: the next tile's state (and, with two small slots, its
        inputs) is copied by TMA into the other of two SMEM slots while this one is computed; the pool is stored from
        its slot by TMA. With one small slot, a tile's inputs are copied at its start."""
        cta = lax.axis_index("tile")
        count = (TT - cta + NG - 1) // NG
        ins = (pk, pu, pa, qn, kn, v, ga, beta)
        names = [k for k in SMALL if k in smem]

        def fetch_small(tile, at, bar):
            n, hv, h, rows = where(tile)
            gm = gmem_small(ins, n, hv, h, rows)
            for k in names:
                plgpu.copy_gmem_to_smem(gm[k], at(smem[k]), bar)

        def fetch(tile, slot):
            n, hv, _, rows = where(tile)
            plgpu.copy_gmem_to_smem(pool.at[n, hv, rows, :], smem["S"].at[slot], bars.at[slot])
            if small_slots == 2:
                fetch_small(tile, lambda r: r.at[slot], bars.at[slot])

        fetch(cta, 0)

        def step(j, carry):
            slot = j % 2
            tile = cta + j * NG
            plgpu.commit_smem()  # every thread is done with the other slot (the previous tile)
            if small_slots == 1:
                fetch_small(tile, lambda r: r, bars_small[0])

            @pl.when(j + 1 < count)
            def _():
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's pool store has read its slot
                fetch(tile + NG, 1 - slot)

            plgpu.barrier_wait(bars.at[slot])
            n, hv, _, rows = where(tile)
            if small_slots == 1:
                plgpu.barrier_wait(bars_small[0])
                src = {k: smem[k] for k in names}
            else:
                src = {k: smem[k].at[slot] for k in names}
            S_s = smem["S"].at[slot]
            store_pool = pool_through_smem(S_s, pool_out.at[n, hv, rows, :])
            tile_step(load(S_s, L), src, hv, store_pool, outputs_to(out, u_out, n, hv, rows))
            return carry

        lax.fori_loop(0, count, step, 0)
        plgpu.wait_smem_to_gmem(0)

    shapes = (
        jax.ShapeDtypeStruct((N, D, HV, V), f32),
        jax.ShapeDtypeStruct((N, D, HV, V), f32),
        jax.ShapeDtypeStruct((N, HV, V, K), f32),
    )
    small = {"kn": (D, K), "qn": (D, K), "v": (D, R), "ga": (D, HV), "beta": (D, HV)}
    if PD:
        small |= {"pk": (PD, K), "pu": (PD, R), "pa": (PD, HV)}
    tiling = plgpu.TilingTransform((8, 128 // 4))  # the state tile as the WGMMA register layout reads it unconflicted
    S_smem = lambda *lead: plgpu.SMEM((*lead, R, K), f32, transforms=(tiling, plgpu.SwizzleTransform(128)))
    if persist:
        smem = {k: plgpu.SMEM((2, *shape)[2 - small_slots :], f32) for k, shape in small.items()} | {"S": S_smem(2)}
        if small_slots == 2:
            scratch = (smem, plgpu.Barrier(num_arrivals=len(small) + 1, num_barriers=2))
        else:
            scratch = (smem, plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_arrivals=len(small)))
        return plgpu.kernel(
            body_persist,
            out_type=shapes,
            scratch_types=scratch,
            grid=(NG,),
            grid_names=("tile",),
            interpret=interpret,
        )
    scratch = ()
    if stage != "none":
        smem = {k: plgpu.SMEM(shape, f32) for k, shape in small.items()}
        if stage == "all":
            smem["S"] = S_smem()
        scratch = (smem, plgpu.Barrier(num_barriers=len(small) + 1))
    return plgpu.kernel(
        body, out_type=shapes, scratch_types=scratch, grid=(TT,), grid_names=("tile",), interpret=interpret
    )


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
    p.add_argument(
        "--stage",
        default="none",
        choices=("none", "small", "all"),
        help="small: the per-step inputs copied to SMEM by TMA first; all: the state too, and the pool "
        "stored from SMEM by TMA",
    )
    p.add_argument("--defer", action="store_true", help="the outputs and u kept in registers, stored at the end")
    p.add_argument("--persist", type=int, default=0, help="persistent CTAs an SM, double-buffered by TMA (0: off)")
    p.add_argument(
        "--small-slots",
        type=int,
        default=2,
        choices=(1, 2),
        help="with --persist: SMEM slots for the small inputs (1: copied at each tile's start)",
    )
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    N, D = map(int, args.config.split("x"))
    PD = args.replay
    interpret = None
    if args.interpret:
        from jax.experimental.pallas import mosaic_gpu as plgpu

        interpret = plgpu.InterpretGPUParams()
    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind}: {N}x{D}, replay {PD}, fma {args.fma}, "
        f"stage {args.stage}{', stores deferred' if args.defer else ''}, persist {args.persist}",
        flush=True,
    )
    x = inputs(N, D, PD, args.seed)
    t0 = time.perf_counter()
    f = jax.jit(build(N, D, PD, args.fma, interpret, args.stage, args.defer, args.persist, args.small_slots))
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
