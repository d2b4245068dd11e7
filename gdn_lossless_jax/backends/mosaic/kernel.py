"""The verify kernel on Pallas' Mosaic GPU backend, with the previous step's commit fused in.

One warpgroup (128 threads) holds a ``[R, K]`` tile of one (request, v-head) in the ``WGMMA``
register layout (``R = 64`` on the GPU: a thread holds 2 rows and ``K / 4`` columns, so a
reduction over K is mostly in registers). Per tile it does:

1. the pending tuple commit (with ``pending``): the previous step's accepted chain replayed
   with the rule, ``fma(k, u, rn(S * exp(g)))``, up to the accepted step (a dynamic loop), the
   track state stored on the way (at its step, to its slot), the accepted state stored in place,
   then on to a track step after the accepted one (stored, not kept);
2. the D new steps from the accepted state (as the pool holds it: rounded to its dtype):
   ``u = beta (v - sum(rn(S alpha) k))``, the update with the same rule, ``o = sum(S q)``; the
   outputs and ``u`` (or each step's state, ``snapshots``) stored. With ``verify="gram"`` the
   products ``S k_t`` and ``S q_t`` of the accepted state come first and ``u`` and ``o`` from the
   ``D x D`` recurrence with the prologue's coefficients (``coef``), the snapshots by the rule
   from that ``u``.

Launch: ``ctas`` persistent CTAs an SM (the grid is that times the SM count), each taking the
tiles ``cta, cta + G, ...``. While a tile computes, the next tile's state and inputs arrive by
TMA in the other of two shared-memory slots (``small_slots=1``: the inputs single-buffered, copied
at each tile's start, where two slots of them would not fit two CTAs an SM); every state the pool
or a snapshot receives leaves from shared memory by a TMA store. With a pending commit (by
default) a CTA that is done prefetches into L2 the tile it would take first from the pool's next
layer, which a step's next launch starts by waiting for.

Rounding: the rule's fma is MLIR's ``math.fma`` through ``plgpu.inline_mgpu`` (``form="pinned"``,
the GPU); in Mosaic GPU's interpret mode (the CPU, CI) it is the portable integer form of
:mod:`gdn_lossless_jax.rounding` (``form="portable"``). ``form="twice_rounded"`` is a control for tests, wrong by construction:
``rn(rn(S alpha) + rn(k u))``, the update rounded twice (each operation pinned), which the
equivalence tests must catch.
Decays: ``exp(g)`` in the kernel is libdevice's on the GPU (Mosaic GPU lowers ``math.exp`` to
it, as XLA, Pallas and Triton do), :func:`gdn_lossless_jax.rounding.exp` in interpret mode. GDN's
``g`` is one scalar a (step, v-head); with ``channel`` (KDA, :mod:`gdn_lossless_jax.kda`) it is a
``[K]`` row, one decay per key channel: the tile's row is exponentiated per channel and broadcast
down the tile's rows, so ``rn(S alpha)`` is still one rounded multiply per element, element
``[v, c]`` by ``exp(g[c])``, in the chain and in the pending replay alike. The Gram form
(``verify="gram"``) takes one scalar decay a step only.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

from ... import rounding

__all__ = ["CONTROLS", "CONTROL_FORMS", "FORMS", "VERIFIES", "Geometry", "build", "coef_shape",
           "smem_bytes"]  # fmt: skip

F32 = jnp.float32
FORMS = ("pinned", "portable")
CONTROL_FORMS = ("twice_rounded",)
#: Orderings that break the commit on purpose, for tests: ``"track_after_write"`` replays the
#: track state from the accepted state the kernel has just written in place (what reading the
#: pool back would give), not from the state before the verify.
CONTROLS = ("track_after_write",)

# Columns of the per-request table (int32 [N, 8]), computed by the caller with the commit's masks.
SLOT, SLOT_OK, ROW, ROW_OK, UPTO, TSTEP, TSLOT, PROW = range(8)
# Entries of the scalar vector (int32 [8]); ZERO is always 0.
LAYER, TAPE_LAYER, PREV_LAYER, OUT_LAYER, ZERO = range(5)


class Geometry(NamedTuple):
    """Everything static about one launch (hashable: the kernel is built once per geometry)."""

    N: int
    D: int
    H: int
    HV: int
    V: int
    K: int
    R: int  # rows of a tile
    state_dtype: str  # the pool's (and snapshots') dtype
    v_dtype: str
    v_stacked: bool  # v [L, N, D, HV, V], read at the layer
    out_dtype: str
    out_into: bool  # outputs into a [L', N, D, HV, V] buffer at OUT_LAYER
    snapshots: bool
    into: bool  # the tape's u (snapshots) into a [L', R', DMAX, ...] buffer at [TAPE_LAYER, row]
    pending: bool  # a pending tuple commit replayed first
    PD: int  # its steps
    ctas: int  # persistent CTAs an SM
    num_sms: int
    small_slots: int  # 1 or 2
    replay: str  # "loop" (dynamic length) or "static" (unrolled, the accepted state selected)
    control: str | None  # tests only: "track_after_write" (the ordering bug, see CONTROLS)
    outputs: str  # "smem" (a tile's outputs staged in shared memory, stored by TMA) or "registers"
    form: str
    interpret: bool
    auto_barriers: bool = False  # Pallas' warpgroup barrier around every load and store (see build)
    verify: str = "chain"  # or "gram": the D steps from the products S k_t, S q_t and coef (see build)
    thread_pool: bool = False  # (never with pending) the pool an in-place ref though unwritten (see build)
    prefetch_next_layer: bool = False  # the CTA's first tile of the pool's next layer into L2 when it is done
    channel: bool = False  # KDA: g (and the pending tape's g) [..., HV, K], one decay per key channel


VERIFIES = ("chain", "gram")


def coef_shape(D: int) -> tuple[int, int]:
    """``(rows, Dp)`` of a (request, v-head)'s Gram coefficients: rows ``beta``, ``P``, then ``W``
    and ``C`` (``Dp`` each, ``Dp`` = the Pallas Gram prologue's padded steps, at least 4: a TMA
    copy's rows are 16-byte multiples), padded so that a block is a multiple of 128 bytes."""
    from ..pallas.prologue import gram_steps

    Dp = max(4, gram_steps(D))
    rows = 2 + 2 * Dp
    while rows * Dp % 32:
        rows += 1
    return rows, Dp


def smem_bytes(D: int, PD: int, HV: int, R: int, K: int, itemsize: int, v_itemsize: int, small_slots: int,
               out_itemsize: int = 0, gram: bool = False, channel: bool = False) -> int:
    """Shared memory of one CTA: two state slots, ``small_slots`` copies of the step inputs (with
    ``gram``, the coefficients too) and, with ``out_itemsize`` (``outputs="smem"``), two slots of a
    tile's outputs. ``channel``: a per-channel decay, the tile's v-head's ``[K]`` row of ``g`` a
    step (and of the pending tape's ``g``) instead of the ``[HV]`` scalars."""
    gw = K if channel else HV  # g's values a step in shared memory
    small = D * (2 * K * 4 + R * v_itemsize + HV * 4 + gw * 4) + PD * (K * 4 + R * 4 + gw * 4)
    small += 4 * math.prod(coef_shape(D)) - D * HV * 4 if gram else 0  # the coefficients, not beta
    return 2 * R * K * itemsize + small_slots * small + 2 * D * R * out_itemsize


def _small_shapes(g: Geometry) -> dict:
    f32 = "float32"
    gw = g.K if g.channel else g.HV  # a per-channel decay: the tile's v-head's [K] row a step
    shapes = {"kn": ((g.D, g.K), f32), "qn": ((g.D, g.K), f32), "v": ((g.D, g.R), g.v_dtype),
              "g": ((g.D, gw), f32), "beta": ((g.D, g.HV), f32)}  # fmt: skip
    if g.verify == "gram":  # beta is in the coefficients
        del shapes["beta"]
        shapes["coef"] = (coef_shape(g.D), f32)
    if g.pending:
        shapes |= {"pk": ((g.PD, g.K), f32), "pu": ((g.PD, g.R), f32), "pg": ((g.PD, gw), f32)}
    return shapes


@functools.cache
def build(g: Geometry):
    """The kernel for geometry ``g``: ``f(tab, lay, qn, kn, v, g, beta | coef, [pk, pu, pg], pool, out, rec)``
    (``coef``: ``[N, HV, *coef_shape(D)]`` with ``g.verify == "gram"``; ``g`` ``[N, D, HV]``, or
    ``[N, D, HV, K]`` with ``g.channel``, as the pending tape's ``pg`` ``[L', R', PD, HV(, K)]``).

    ``out`` (the outputs: ``[N, D, HV, V]``, or a ``[L', N, D, HV, V]`` buffer with ``g.out_into``)
    and ``rec`` (``u [N, D, HV, V]`` or snapshots ``[N, D, HV, V, K]``, or with ``g.into`` a
    ``[L', R', DMAX, ...]`` tape buffer) are Refs, written in place, as ``pool`` is with
    ``g.pending`` (otherwise it may be an array). Returns nothing: call it inside
    ``pl.run_state``. ``tab`` and ``lay``: the per-request table and the scalars (see the
    column names above).
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if g.channel and g.verify == "gram":  # its coefficients fold one scalar decay a step (the caller refuses it)
        raise ValueError("mosaic kernel: verify='gram' takes a scalar decay only, not a per-channel one (KDA)")
    R, K, D, HV, V, N = g.R, g.K, g.D, g.HV, g.V, g.N
    G = HV // g.H
    T = V // R
    TT = N * HV * T  # tiles
    NG = g.ctas * g.num_sms  # CTAs
    sd = jnp.dtype(g.state_dtype)
    od = jnp.dtype(g.out_dtype)
    L = plgpu.Layout.WGMMA
    LROW, LCOL = L.reduce(1), L.reduce(0)  # an [R] vector along the tile's rows, a [K] vector along its columns

    if g.interpret:
        fma, mul, add, exp = rounding._fma_rn, rounding._mul_rn, rounding._add_rn, rounding.exp
        decay = mul
    else:
        from jax._src.lib.mlir.dialects import math as mlir_math
        from jax.experimental.mosaic.gpu.fragmented_array import FragmentedArray

        tile = plgpu.ShapeDtypeStruct((R, K), F32, layout=L)

        @plgpu.inline_mgpu(arg_types=(L, L, L), return_type=tile)
        def fma(ctx, a, b, c):
            return a._pointwise(lambda x, y, z: mlir_math.fma(x, y, z), b, c)

        @plgpu.inline_mgpu(arg_types=(L, L), return_type=tile)
        def mul(ctx, a, b):  # pinned in PTX: no contraction into a later add
            return a._pointwise(FragmentedArray._lift_fast_instr("mul.rn.f32"), b)

        @plgpu.inline_mgpu(arg_types=(L, L), return_type=tile)
        def add(ctx, a, b):
            return a._pointwise(FragmentedArray._lift_fast_instr("add.rn.f32"), b)

        exp = jnp.exp

        def decay(S, alpha):  # rn(S alpha): its consumers (an fma's addend, a product) contract nothing into it
            return S * alpha

    if g.form == "twice_rounded":  # control: rn(Sd + rn(k u)), the update rounded twice

        def update(k, u, Sd):
            return add(Sd, mul(k, u))
    else:

        def update(k, u, Sd):  # the rule
            return fma(k, u, Sd)

    def load(ref, layout):
        return plgpu.load(ref, layout=layout, optimized=False)

    def rows_of(vec):  # an [R] vector across the tile's columns
        return lax.broadcast_in_dim(vec, (R, K), (0,))

    def cols_of(vec):  # a [K] vector down the tile's rows
        return lax.broadcast_in_dim(vec, (R, K), (1,))

    def alpha(g_s, t, hv):
        """The decay ``exp(g)`` of step ``t`` from the inputs' ``g`` in shared memory: GDN's one scalar
        of v-head ``hv``, or (``channel``) the tile's ``[K]`` row, exponentiated per channel and
        broadcast down the rows: ``decay`` is then one rounded multiply per element by its own
        column's factor."""
        if g.channel:
            return cols_of(exp(load(g_s.at[t], LCOL)))
        return exp(g_s[t, hv])

    names = ["tab", "lay", "qn", "kn", "v", "g"] + (["coef"] if g.verify == "gram" else ["beta"])
    names += ["pk", "pu", "pg"] if g.pending else []
    names += ["pool", "out", "rec"]
    shapes = _small_shapes(g)

    def body(*refs):
        r = dict(zip(names + ["smem", "bars", "bar_small"], refs))
        smem, bars = r["smem"], r["bars"]
        tab, lay = r["tab"], r["lay"]
        layer, tape_layer, prev_layer, out_layer = (lay[i] for i in (LAYER, TAPE_LAYER, PREV_LAYER, OUT_LAYER))
        cta = lax.axis_index("cta")
        count = (TT - cta + NG - 1) // NG
        pool = r["pool"]
        NL = pool.shape[0]  # the pool's layers

        def where(tile):
            n = tile // (HV * T)
            hv = (tile // T) % HV
            return n, hv, hv // G, pl.ds((tile % T) * R, R)

        def table_row(tile):
            """The table's row (8 scalars) of tile ``tile``'s request."""
            n = tile // (HV * T)
            return tuple(tab[n, c] for c in range(8))

        def gmem_small(n, hv, h, rows, prow):
            src = {
                "kn": r["kn"].at[n, :, h, :],
                "qn": r["qn"].at[n, :, h, :],
                "v": r["v"].at[layer, n, :, hv, rows] if g.v_stacked else r["v"].at[n, :, hv, rows],
                "g": r["g"].at[n, :, hv, :] if g.channel else r["g"].at[n],
            }
            if g.verify == "gram":
                src["coef"] = r["coef"].at[n, hv]
            else:
                src["beta"] = r["beta"].at[n]
            if g.pending:
                src |= {
                    "pk": r["pk"].at[prev_layer, prow, :, h, :],
                    "pu": r["pu"].at[prev_layer, prow, :, hv, rows],
                    "pg": r["pg"].at[prev_layer, prow, :, hv, :] if g.channel else r["pg"].at[prev_layer, prow],
                }
            return src

        def fetch_small(tile, row, at, bar):
            n, hv, h, rows = where(tile)
            for k, src in gmem_small(n, hv, h, rows, row[PROW]).items():
                plgpu.copy_gmem_to_smem(src, at(smem[k]), bar)

        def fetch(tile, row, slot):
            _, hv, _, rows = where(tile)
            plgpu.copy_gmem_to_smem(pool.at[layer, row[SLOT], hv, rows, :], smem["S"].at[slot], bars.at[slot])
            if g.small_slots == 2:
                fetch_small(tile, row, lambda ref: ref.at[slot], bars.at[slot])

        def store_state(S_s, S, dst):
            """``S`` (f32, rounded here to ``dst``'s dtype) to ``dst`` through the SMEM tile ``S_s``."""
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # an earlier store from S_s has read it
            S_s[...] = S.astype(S_s.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(S_s, dst)

        def tile_step(j, carry):
            tile = cta + j * NG
            cur = table_row(tile)
            slot = j % 2
            plgpu.commit_smem()  # every thread is done with the other slot (the previous tile)
            if g.small_slots == 1:
                fetch_small(tile, cur, lambda ref: ref, r["bar_small"])

            if g.outputs == "smem":
                # Every store but the previous tile's outputs (its last) has read shared memory: its
                # state slot is free, and so is the outputs slot this tile writes (tile j - 2's).
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)

            @pl.when(j + 1 < count)
            def _():
                if g.outputs != "smem":
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's stores have read its slot
                fetch(tile + NG, table_row(tile + NG), 1 - slot)

            plgpu.barrier_wait(bars.at[slot])
            if g.small_slots == 1:
                plgpu.barrier_wait(r["bar_small"])
                src = {k: smem[k] for k in shapes}
            else:
                src = {k: smem[k].at[slot] for k in shapes}
            n, hv, _, rows = where(tile)
            S_s = smem["S"].at[slot]
            S = load(S_s, L).astype(F32)
            ok = lax.broadcast_in_dim(cur[SLOT_OK] != 0, S.shape, ())  # (no implicit broadcast in a select)
            S = lax.select(ok, S, jnp.zeros_like(S))  # a padding slot reads zeros

            if g.pending:
                upto, tstep, tslot = cur[UPTO], cur[TSTEP], cur[TSLOT]

                def replay(t, S, track=True):
                    kb = cols_of(load(src["pk"].at[t], LCOL))
                    ub = rows_of(load(src["pu"].at[t], LROW))
                    S = update(kb, ub, decay(S, alpha(src["pg"], t, hv)))
                    if track:

                        @pl.when(t == tstep)
                        def _():
                            store_state(S_s, S, pool.at[layer, tslot, hv, rows, :])

                    return S

                if g.control == "track_after_write":  # the ordering bug: the track from the state written
                    S = lax.fori_loop(0, upto + 1, lambda t, S: replay(t, S, track=False), S)

                    @pl.when(upto >= 0)
                    def _():
                        store_state(S_s, S, pool.at[layer, cur[SLOT], hv, rows, :])

                    lax.fori_loop(0, tstep + 1, replay, S)
                elif g.replay == "loop":  # to the accepted step, then on to a later track step
                    S = lax.fori_loop(0, upto + 1, replay, S)

                    @pl.when(upto >= 0)
                    def _():
                        store_state(S_s, S, pool.at[layer, cur[SLOT], hv, rows, :])

                    lax.fori_loop(upto + 1, tstep + 1, replay, S)  # a track step after the accepted one
                else:  # "static": all PD steps unrolled, the accepted state picked at its step
                    run = S
                    for t in range(g.PD):
                        run = replay(t, run)
                        S = lax.select(lax.broadcast_in_dim(t == upto, S.shape, ()), run, S)

                    @pl.when(upto >= 0)
                    def _():
                        store_state(S_s, S, pool.at[layer, cur[SLOT], hv, rows, :])

                if sd != F32:
                    S = S.astype(sd).astype(F32)  # the verify starts from the state as the pool holds it

            row, row_ok = cur[ROW], cur[ROW_OK] != 0
            if g.verify == "gram":  # every product of the step's starting state first: no chain through the tile
                cf, Dp = src["coef"], coef_shape(D)[1]
                xk, xq = ([jnp.sum(S * cols_of(load(src[x].at[t], LCOL)), axis=1) for t in range(D)]
                          for x in ("kn", "qn"))  # fmt: skip
                us = []
            for t in range(D):
                vt = load(src["v"].at[t], LROW).astype(F32)
                kb = None if g.verify == "gram" and not g.snapshots else cols_of(load(src["kn"].at[t], LCOL))
                if g.verify == "gram":
                    ut = cf[0, t] * (vt - cf[1, t] * xk[t])
                    for s_ in range(t):
                        ut = ut - cf[2 + t, s_] * us[s_]
                    us.append(ut)
                    o = cf[1, t] * xq[t]
                    for s_ in range(t + 1):
                        o = o + cf[2 + Dp + t, s_] * us[s_]
                    o = o.astype(od)
                    if g.snapshots:  # the states from this u by the rule: what a replay of the tuples gives
                        S = update(kb, rows_of(ut), decay(S, alpha(src["g"], t, hv)))
                else:
                    qb = cols_of(load(src["qn"].at[t], LCOL))
                    Sd = decay(S, alpha(src["g"], t, hv))
                    ut = src["beta"][t, hv] * (vt - jnp.sum(Sd * kb, axis=1))
                    S = update(kb, rows_of(ut), Sd)
                    o = jnp.sum(S * qb, axis=1).astype(od)
                if g.outputs == "smem":
                    smem["o"][slot, t] = o
                elif g.out_into:
                    r["out"][out_layer, n, t, hv, rows] = o
                else:
                    r["out"][n, t, hv, rows] = o
                if g.snapshots:
                    if g.into:

                        @pl.when(row_ok)
                        def _(S=S, t=t):
                            store_state(S_s, S, r["rec"].at[tape_layer, row, t, hv, rows, :])
                    else:
                        store_state(S_s, S, r["rec"].at[n, t, hv, rows, :])
                elif g.into:

                    @pl.when(row_ok)
                    def _(t=t, ut=ut):
                        r["rec"][tape_layer, row, t, hv, rows] = ut
                else:
                    r["rec"][n, t, hv, rows] = ut
            if g.outputs == "smem":  # the tile's last store (the wait at the next tile's start counts on it)
                plgpu.commit_smem()
                dst = r["out"].at[out_layer, n, :, hv, rows] if g.out_into else r["out"].at[n, :, hv, rows]
                plgpu.copy_smem_to_gmem(smem["o"].at[slot], dst)
            return carry

        @pl.when(count > 0)
        def _():
            fetch(cta, table_row(cta), 0)
            lax.fori_loop(0, count, tile_step, 0)
            if g.prefetch_next_layer:
                # The tile this CTA would take first in the next layer (a step's next launch: the same
                # slots), into L2 by a TMA prefetch: that launch starts by waiting for its first tiles.
                # Issued once the CTA is done, while others finish theirs (docs/design.md).
                @pl.when(layer + 1 < NL)
                def _():
                    n0, hv0, _, rows0 = where(cta)
                    plgpu.async_prefetch(pool.at[layer + 1, tab[n0, SLOT], hv0, rows0, :])

            plgpu.wait_smem_to_gmem(0)

        if g.thread_pool:
            # A store to the pool that never runs (lay[ZERO] is 0): it keeps the pool an in-place
            # operand of the kernel, so that XLA orders the next layer's in-place commit after this
            # kernel's reads. Unwritten, the ref is dropped from the kernel's results, and XLA would
            # copy the whole pool twice a step to run a pending snapshot commit before the verify
            # (python -m benchmarks.dev fused-step-hlo shows it).
            @pl.when(lay[ZERO] != 0)
            def _():
                plgpu.copy_smem_to_gmem(smem["S"].at[0], pool.at[layer, 0, 0, pl.ds(0, R), :])
                plgpu.wait_smem_to_gmem(0)

    tiling = plgpu.TilingTransform((8, 128 // sd.itemsize))  # the WGMMA register layout reads it unconflicted
    transforms = () if g.interpret else (tiling, plgpu.SwizzleTransform(128))  # (interpret: any K)
    S_smem = plgpu.SMEM((2, R, K), sd, transforms=transforms)
    lead = (2,) if g.small_slots == 2 else ()
    smem = {k: plgpu.SMEM((*lead, *shape), jnp.dtype(dt)) for k, (shape, dt) in shapes.items()} | {"S": S_smem}
    if g.outputs == "smem":
        smem["o"] = plgpu.SMEM((2, D, R), od)
    scratch = [smem]
    if g.small_slots == 2:
        scratch.append(plgpu.Barrier(num_arrivals=len(shapes) + 1, num_barriers=2))
    else:
        scratch += [plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_arrivals=len(shapes))]
    return plgpu.kernel(
        body,
        out_type=(),
        scratch_types=tuple(scratch),
        grid=(NG,),
        grid_names=("cta",),
        kernel_name=f"gdn_mosaic_verify_{'snapshots' if g.snapshots else 'tuples'}",
        # Without Pallas' automatic barriers (a warpgroup barrier before and after each store from
        # registers and around each async copy), which the kernel does not need: a thread writes to shared memory only the state tile's
        # elements it loaded itself (each warp its 16 rows), after ``wait_smem_to_gmem`` (which ends
        # with a barrier) where a TMA store may still read them; every TMA store and the prefetch
        # into the other slot come after ``commit_smem`` (a fence and a barrier); the outputs and
        # the tape leave registers for global memory that no thread of the kernel reads.
        compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=not g.auto_barriers),
        interpret=plgpu.InterpretGPUParams() if g.interpret else None,
    )
