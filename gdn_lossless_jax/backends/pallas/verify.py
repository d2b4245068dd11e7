"""Pallas (Triton backend) verify: one kernel body, one launch configuration for both record modes.

A small prologue kernel (:func:`_prep`) computes the q/k l2 norms, the query scale and the gates
with ``reference.prepare``'s formulas; its ``k`` and ``g`` *are* the tape's, written once per
(request, head), never once per V tile. The main kernel's grid is ``(N, HV, V // BV)`` (or
``(V // BV, HV, N)``, ``VerifyConfig.order``): one program per request, v-head and V tile, holding
the ``[BV, K]`` fp32 state tile in registers. Two algorithms (``VerifyConfig.algorithm``):

- ``"chain"`` (default): the D steps as written (steps 3-6 of :mod:`gdn_lossless_jax.reference`):
  per step a pinned decay multiply, a reduction over K, a pinned fma, an output reduction and the
  step's store (``u`` or the snapshot).
- ``"gram"``: with ``G[t, s] = a_{s+1} ... a_t`` and ``P_t = a_1 ... a_t``,
  ``u_t = beta_t (v_t - P_t (S0 k_t)) - sum_{s<t} beta_t G[t, s] (k_t . k_s) u_s`` and
  ``o_t = P_t (S0 q_t) + sum_{s<=t} G[t, s] (q_t . k_s) u_s`` (``_gram_kernel``): the products
  against the untouched state are independent, and the ``[D, D]`` coefficients come from their
  own prologue (:func:`_gram_prep_kernel`). ``u`` and ``o`` differ from the chain's in their low
  bits; the tape stays exact because snapshots are built from the same ``u`` with the pinned rule.

Both record modes must use the same :class:`VerifyConfig` (they share arithmetic). Entry point:
:func:`verify`. The kernels read each state from the pool by slot (``state[layer, slots[n]]``,
SGLang's ``h0_indices``), never a gathered copy, and with ``tape=`` write the tape in place into
its buffer at ``[tape_layer, rows[n]]`` (aliased; donate the buffers under jit). The state0 form is
the same kernel on a one-layer pool.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ...reference import INPUT_RANKS, L2NORM_EPS, gates
from ...reference import stacked as is_stacked
from ... import rounding
from ..contract import VerifyCall
from ._refs import grid, program_ids, store
from .conv import scalar
from .rounding import ops as rounding_ops
from .rounding import replay_update

__all__ = ["VerifyConfig", "verify", "ALGORITHMS", "TUNED", "tuned_config"]

F32 = jnp.float32
ALGORITHMS = ("chain", "gram")
PRODUCTS = ("fma", "mma")
ORDERS = ("requests", "tiles")
PENDING_REPLAYS = ("rows", "split", "carry")
DOT_FMA = {"none": (False, False), "u": (True, False), "both": (True, True)}  # fused: (u's dot, o's dot)
MMA_MIN = 16  # Triton's smallest tl.dot tile side
HIGHEST = jax.lax.Precision.HIGHEST  # fp32 products in fp32 (the default would be TF32 on a GPU)


@dataclasses.dataclass(frozen=True)
class VerifyConfig:
    """Launch configuration, the same for both record modes so that their outputs agree by construction.

    ``order``, ``evict``, ``num_stages`` and ``pending_slice_v`` change no arithmetic; others may
    change ``u``'s and the outputs' low bits (never the tape's exactness). ``row_vectors``,
    ``one_pass``, ``unroll`` and ``prefetch_q`` apply to the chain only (the Gram form always runs
    loops). Design reasons for the defaults: docs/design.md.

    ``block_v``: V rows per program (a power of 2; cut to V by :meth:`fit`).
    ``num_warps``, ``num_stages``: Triton's launch parameters.
    ``row_vectors``: load q and k as ``[1, K]`` rows in the state tile's layout, not ``[K]`` vectors
    (which Triton converts through shared memory every step).
    ``one_pass``: ``o = Sd q + u (k . q)`` from the decayed state, so both reductions of a step read
    ``Sd`` together (changes the outputs' fp32 rounding, not the tape's or the state's).
    ``algorithm``: ``"chain"`` or ``"gram"`` (module docstring).
    ``k_chunk``: hold the ``[BV, K]`` state tile as ``K / k_chunk`` tiles ``[BV, k_chunk]``; a
    reduction sums the chunks elementwise, then reduces once (fewer shuffle levels). The Gram
    form's products use the same chunks.
    ``unroll``: unroll the D steps up to this D (inputs all loaded first); above it, a loop that
    prefetches step t + 1's inputs during step t. 0 (default): always a loop.
    ``evict``: Triton's eviction policy for the chain's state loads and snapshot stores, each
    touched once (``"evict_first"``, ``"evict_last"`` or None).
    ``prefetch_q``: in the loop, load step t + 1's q with its k; False loads q in its own step
    (fewer registers held across steps).
    ``products``: how the Gram form computes ``S0 k_t`` and ``S0 q_t``: ``"fma"`` (the chain's
    chunked dots) or ``"mma"`` (tensor-core ``tl.dot``, TF32x3, ``[BV, C] x [C, 16+]`` per chunk
    with ``C = max(16, k_chunk)``; needs ``block_v`` >= 16, pads the step axis to 16). Only
    ``u`` and ``o``'s low bits change; the tape stays exact.
    ``prep_heads``: q/k heads per program of the prologue kernel (grid ``(N, D, H / prep_heads)``;
    0: all heads in one program); 0 or a power of 2.
    ``order``: the grid's order, ``"requests"`` ``(N, HV, V // block_v)`` or ``"tiles"``
    ``(V // block_v, HV, N)``; None: tiles first for snapshots (consecutive programs read one
    state's contiguous tiles), requests first for tuples.
    ``dot_fma``: which of the chain's K-reductions fuse the chunks' products into the running sums
    with the pinned fma: ``"none"``, ``"u"`` (``Sd . k``) or ``"both"`` (and ``S . q``). Changes
    only ``u`` and the outputs' low bits, the same in both modes. The portable form (ROCm,
    interpret) always multiplies and adds (its fma is ~20 integer operations).
    ``pending_replay``: how the fused kernel (``commit_and_verify``) replays a pending tuple
    commit: ``"split"`` runs to the accepted step carrying one state (a later track step
    continues from it); ``"carry"`` runs one loop to the later of the two steps, the accepted
    state carried beside the running one; ``"rows"`` replays on a whole ``[BV, K]`` tile (lanes
    across K), stores the committed states and reads the state back from the pool after a
    barrier (in ``_kernel``).
    ``pending_slice_v``: the fused tuple kernel reads one layer's ``v`` sliced out by XLA (a copy)
    rather than the stacked ``v`` at the layer.
    """

    block_v: int = 8
    num_warps: int = 1
    num_stages: int = 1
    row_vectors: bool = True
    one_pass: bool = False
    algorithm: str = "chain"
    k_chunk: int = 16
    unroll: int = 0
    evict: str | None = "evict_first"
    prefetch_q: bool = True
    products: str = "fma"
    prep_heads: int = 2
    order: str | None = None
    dot_fma: str = "both"
    pending_replay: str = "split"
    pending_slice_v: bool = False

    def __post_init__(self):
        if self.pending_replay not in PENDING_REPLAYS:
            raise ValueError(f"VerifyConfig: pending_replay must be one of {PENDING_REPLAYS}, got {self.pending_replay!r}")
        if self.dot_fma not in DOT_FMA:
            raise ValueError(f"VerifyConfig: dot_fma must be one of {tuple(DOT_FMA)}, got {self.dot_fma!r}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"VerifyConfig: algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        if self.products not in PRODUCTS:
            raise ValueError(f"VerifyConfig: products must be one of {PRODUCTS}, got {self.products!r}")
        if self.products == "mma" and self.algorithm != "gram":
            raise ValueError(f"VerifyConfig: products='mma' needs algorithm='gram', got {self.algorithm!r}")
        if self.evict not in (None, "evict_first", "evict_last"):
            raise ValueError(f"VerifyConfig: evict must be None, 'evict_first' or 'evict_last', got {self.evict!r}")
        if self.order not in (None, *ORDERS):
            raise ValueError(f"VerifyConfig: order must be None or one of {ORDERS}, got {self.order!r}")
        if self.prep_heads < 0 or self.prep_heads & (self.prep_heads - 1):
            raise ValueError(f"VerifyConfig: prep_heads must be 0 or a power of 2, got {self.prep_heads}")
        if self.unroll < 0:
            raise ValueError(f"VerifyConfig: unroll must be >= 0, got {self.unroll}")
        for name in ("block_v", "num_warps", "k_chunk"):
            n = getattr(self, name)
            if n < 1 or n & (n - 1):
                raise ValueError(f"VerifyConfig: {name} must be a power of 2, got {n}")

    def fit(self, V: int) -> "VerifyConfig":
        return dataclasses.replace(self, block_v=min(self.block_v, V))


#: Launches that beat :class:`VerifyConfig`'s defaults at one shape, by ``(requests N, drafts D, pool
#: dtype)``: :func:`tuned_config` gives them where no ``config`` is passed. An entry computes what the
#: defaults compute (up to the outputs' low bits, through ``dot_fma``); it differs in the registers
#: XLA's build of the fused kernel takes, which no flag caps (ptxas's ``--maxrregcount`` through XLA
#: has no effect). At 25 x 4, ``pending_replay="rows"`` with ``dot_fma="u"`` keeps that kernel at 128
#: registers a thread where the defaults take 130 (fewer warps an SM). Because ``dot_fma`` changes the outputs' low bits, the verify and the fused kernel
#: of a shape always take the same entry (the fused step's outputs equal the separate step's).
TUNED: dict[tuple[int, int, str], dict] = {
    (25, 4, "float32"): {"pending_replay": "rows", "dot_fma": "u"},
}


def tuned_config(N: int, D: int, dtype) -> VerifyConfig:
    """:class:`VerifyConfig` with the :data:`TUNED` entry for ``N`` requests of ``D`` drafts on a
    pool of ``dtype``, or the defaults."""
    return VerifyConfig(**TUNED.get((int(N), int(D), jnp.dtype(dtype).name), {}))


class _Where(NamedTuple):
    """Where one verify program reads its state and writes its tape.

    ``n``, ``hv``, ``h``: request, v-head, q/k head; ``vs``: the V tile's rows. The state is
    read from ``state[layer, slots[n], hv, vs]`` (zeros where the slot is outside
    ``[0, S)``, as SGLang reads padding slots); the tape goes to ``tape[lead + (t, hv, vs)]``:
    ``lead`` is ``(n,)`` for a fresh tape and ``(tape_layer, rows[n])`` into a buffer, where
    ``row_ok`` says whether that row exists (out-of-range rows write nothing). The outputs go
    to ``o[olead + (n, t, hv, vs)]``: ``olead`` is ``()`` for fresh outputs and ``(out_layer,)``
    into a buffer.
    """

    n: Any
    hv: Any
    h: Any
    vs: Any
    layer: Any
    slot: Any
    slot_ok: Any
    lead: tuple
    row_ok: Any
    olead: tuple = ()


def _program(refs, n_inputs: int, into: bool, r: int, BV: int, tiles_first: bool, n_outputs: int = 2,
             out_into: bool = False):  # fmt: skip
    """What both verify kernels read first: their input refs (``state``, ``slots``, ``layer``,
    ``tape_layer`` first), the output refs ``o`` and ``tape``, and the program's :class:`_Where`.

    ``refs`` is ``inputs[, rows, tape buffer (aliased)][, pending inputs][, out_layer, outputs
    buffer (aliased)], o, tape[, pool]``.
    """
    n, hv, j = program_ids(tiles_first)
    state_ref, slots_ref, layer_ref, tape_layer_ref = refs[:4]
    slot = slots_ref[n]
    slot_ok = (slot >= 0) & (slot < state_ref.shape[1])
    row = refs[n_inputs][n] if into else None
    o_ref, tape_ref = refs[len(refs) - n_outputs : len(refs) - n_outputs + 2]
    if into:
        lead, row_ok = (tape_layer_ref[0], row), (row >= 0) & (row < tape_ref.shape[1])
    else:
        lead, row_ok = (n,), None
    olead = (refs[len(refs) - n_outputs - 2][0],) if out_into else ()
    where = _Where(n, hv, hv // r, pl.ds(j * BV, BV), layer_ref[0], jnp.where(slot_ok, slot, 0), slot_ok, lead, row_ok,
                   olead)  # fmt: skip
    return refs[4:n_inputs], o_ref, tape_ref, state_ref, where


def _unit_rows(x):
    """l2norm of each row of a ``[rows, K]`` tile (``reference.l2norm``'s formula)."""
    return x / jnp.sqrt(jnp.sum(x * x, axis=1)[:, None] + L2NORM_EPS)


def gram_steps(D: int, products: str = "fma") -> int:
    """The Gram form's step axis: D padded to a power of 2 (Triton tiles), at least 2 (at
    least 16 for ``products="mma"``: a side of a ``tl.dot`` tile)."""
    return max(MMA_MIN if products == "mma" else 2, pl.next_power_of_2(D))


def _chunks(K: int, k_chunk: int):
    """The column slices that hold a ``[BV, K]`` state tile as ``K / C`` tiles ``[BV, C]``."""
    C = min(K, k_chunk)
    return [pl.ds(c * C, C) for c in range(K // C)]


def _chunk_dot(xs, ys, fma=None):
    """Sum over K of the elementwise products of two chunked tiles (lists of ``[BV, C]`` and
    ``[1, C]``): chunk by chunk in registers, then one reduction (a short shuffle tree).
    With ``fma`` (a pinned fma) each chunk after the first is fused into the running sum:
    one instruction per element instead of a multiply and an add."""
    acc = xs[0] * ys[0]
    for x, y in zip(xs[1:], ys[1:]):
        acc = acc + x * y if fma is None else fma(x, y, acc)
    return jnp.sum(acc, axis=1)


def _state_tile(state_ref, w: _Where, c, evict):
    """One ``[BV, C]`` chunk of the program's pre-verify state, fp32 (zeros for a padding slot)."""
    shape = (w.vs.size, c.size)
    tile = plgpu.load(state_ref.at[w.layer, w.slot, w.hv, w.vs, c], mask=jnp.broadcast_to(w.slot_ok, shape),
                      other=0.0, eviction_policy=evict)  # fmt: skip
    return tile.astype(F32)


def _load_state(state_ref, w: _Where, cols, evict):
    """The program's state tile, as fp32 ``[BV, C]`` chunks (read once: ``evict``)."""
    return [_state_tile(state_ref, w, c, evict) for c in cols]


def _store_state(tape_ref, w: _Where, t, cols, S, evict):
    """Step ``t``'s state (its chunks ``S``) into the snapshot tape."""
    for c, tile in zip(cols, S):
        _store_row(tape_ref, w, (*w.lead, t, w.hv, w.vs, c), tile.astype(tape_ref.dtype), evict=evict)


def _apply_pending(refs, pending: str, state_ref, pool_ref, w: _Where, cols, S0, form: str, control: str | None = None,
                   replay_mode: str = "split"):
    """The previous step's commit of this program's tile, before its verify: the state after the
    accepted step (and the track state, to its slot), both from the pre-verify state ``S0`` with
    the commit's rule (``fma(k, u, rn(S * exp(g)))``, the replay kernel's arithmetic element for
    element) or from the previous snapshots; both stored to the pool (rounded to its dtype).
    Returns the state the verify starts from: the accepted state as the pool now holds it, or
    ``S0`` where nothing was accepted. The masks are the commit's (``reference._masks``).

    ``refs``: the pending rows, steps, track slots, track steps ``[N]``, the previous tape's
    layer ``[1]``, then the previous tape's fields (``u, k, g`` or ``states``, ``[L', R', D', ...]``).
    ``replay_mode``: ``VerifyConfig.pending_replay``.
    ``control`` breaks it on purpose, for tests that must catch it: ``"naive"`` replays with
    ``S * alpha + k * u`` as the compiler rounds it; ``"track_after_write"`` stores the accepted
    state first and replays the track state from the pool it just wrote (the ordering bug of
    SGLang's lossless-verify pull request).
    """
    prow_ref, pstep_ref, ptslot_ref, ptstep_ref, player_ref, *prev = refs
    n, hv, h, vs = w.n, w.hv, w.h, w.vs
    pl_ = player_ref[0]
    prow, pstep, ptslot, ptstep = prow_ref[n], pstep_ref[n], ptslot_ref[n], ptstep_ref[n]
    R, Dp = prev[0].shape[1], prev[0].shape[2]
    S = state_ref.shape[1]
    valid = w.slot_ok & (prow >= 0) & (prow < R)
    accept = valid & (pstep >= 0) & (pstep < Dp)
    track = valid & (ptstep >= 0) & (ptstep < Dp) & (ptslot >= 0) & (ptslot < S)
    prow = jnp.where(valid, prow, 0)
    dt = pool_ref.dtype

    def store(at, tiles):
        for c, tile in zip(cols, tiles):
            pool_ref[w.layer, at, hv, vs, c] = tile.astype(dt)

    if pending == "snapshots":
        (states_ref,) = prev

        def snap(t):
            return [states_ref[pl_, prow, t, hv, vs, c] for c in cols]

        @pl.when(track)
        def _():
            store(ptslot, snap(ptstep))

        acc = [jnp.where(accept, a, b) for a, b in zip(snap(jnp.where(accept, pstep, 0)), S0)]
    else:
        u_ref, k_ref, g_ref = prev
        update = replay_update("naive" if control == "naive" else form)
        late = control == "track_after_write"

        def steps(first, upto, S, on_step, keep=None):
            """Steps ``first..upto`` from ``S``; returns the state after step ``keep`` (carried
            beside the running one) or, without ``keep``, after the last step run."""

            def body(t, carry):
                Sc, *acc = carry
                ks = [k_ref[pl_, prow, t, pl.ds(h, 1), c] for c in cols]
                u, alpha = u_ref[pl_, prow, t, hv, vs], rounding.exp(g_ref[pl_, prow, t, hv])
                Sc = [update(c, alpha, kc, u) for kc, c in zip(ks, Sc)]
                on_step(t, Sc)
                return (Sc, *([[jnp.where(t == keep, a, b) for a, b in zip(Sc, acc[0])]] if acc else []))

            out = jax.lax.fori_loop(first, upto + 1, body, (S, *([S] if keep is not None else [])))
            return out[1] if keep is not None else out[0]

        def track_store(t, Sc):
            @pl.when(track & (t == ptstep))
            def _():
                store(ptslot, Sc)

        if replay_mode == "split" and not late:
            # To the accepted step, the track state stored on the way; a track step after it
            # continues from there. Only one state is carried, and no step runs twice.
            upto = jnp.where(accept, pstep, -1)
            acc = steps(0, upto, S0, track_store)
            steps(upto + 1, jnp.where(track, ptstep, -1), acc, track_store)
        else:  # one loop to the later of the two steps, the accepted state carried beside
            last = jnp.maximum(jnp.where(accept, pstep, -1), -1 if late else jnp.where(track, ptstep, -1))
            acc = steps(0, last, S0, (lambda t, Sc: None) if late else track_store, keep=pstep)

    @pl.when(accept)
    def _():
        store(w.slot, acc)

    if pending == "tuples" and late:  # the control: the track state replayed from the advanced state in the pool
        advanced = [jnp.where(accept, a.astype(dt).astype(F32), b) for a, b in zip(acc, S0)]
        steps(0, jnp.where(track, ptstep, -1), advanced, track_store)

    # Where nothing was accepted ``acc`` is ``S0``, already in the pool's dtype: no select, and
    # ``S0`` need not live past the replay's start.
    return [a.astype(dt).astype(F32) for a in acc]


def _kernel(*refs, D: int, r: int, BV: int, snapshots: bool, form: str, into: bool, row_vectors: bool, one_pass: bool,
            k_chunk: int, loop: bool, evict: str | None, prefetch_q: bool, tiles_first: bool, dot_fma: str,
            pending: str | None = None, control: str | None = None, stacked: bool = False,
            out_into: bool = False, pending_replay: str = "split", barrier: bool = True,
            interpret: bool = False):  # fmt: skip
    # inputs: state, slots, layer, tape_layer, qn, kn, v, g, beta[, rows, tape buffer (aliased)][, pending inputs]
    # [, out_layer, outputs buffer (aliased)]; outputs: o, tape[, pool (aliased with state)]. With ``stacked``, v is
    # [L, N, D, HV, V], read at the pool's layer.
    n_out = 3 if pending else 2
    (q_ref, k_ref, v_ref, g_ref, beta_ref), o_ref, tape_ref, state_ref, w = _program(refs, 9, into, r, BV, tiles_first,
                                                                                     n_out, out_into)  # fmt: skip
    n, hv, h, vs = w.n, w.hv, w.h, w.vs
    mul, fma = rounding_ops(form)
    cols = _chunks(k_ref.shape[-1], k_chunk)
    # The dots' products fused with the pinned fma instruction; the portable form keeps a multiply
    # and an add (its fma is ~20 integer operations, and a dot's rounding is free).
    fuse_u, fuse_o = (fma if fused and form == "ptx" else None for fused in DOT_FMA[dot_fma])

    def vec(ref, t, ks):  # q or k of step t, shaped to broadcast over the tile's rows
        return ref[n, t, pl.ds(h, 1), ks] if row_vectors else ref[n, t, h, ks][None, :]

    late_q = loop and not one_pass and not prefetch_q  # q loaded by its own step: fewer registers

    def inputs(t):  # everything step t reads besides the state
        qs = None if late_q else [vec(q_ref, t, c) for c in cols]
        ks = [vec(k_ref, t, c) for c in cols]
        kq = _chunk_dot(ks, qs) if one_pass else None  # [1]
        vt = v_ref[w.layer, n, t, hv, vs] if stacked else v_ref[n, t, hv, vs]
        return qs, ks, vt.astype(F32), rounding.exp(g_ref[n, t, hv]), beta_ref[n, t, hv], kq

    def step(t, S, x):
        qs, ks, v, alpha, beta, kq = x
        if late_q:
            qs = [vec(q_ref, t, c) for c in cols]
        Sd = [mul(c, alpha) for c in S]
        if one_pass:
            sq = _chunk_dot(Sd, qs, fuse_o)
        u = beta * (v - _chunk_dot(Sd, ks, fuse_u))
        S = [fma(kc, u[:, None], c) for kc, c in zip(ks, Sd)]
        o = sq + u * kq if one_pass else _chunk_dot(S, qs, fuse_o)
        o_ref[(*w.olead, n, t, hv, vs)] = o.astype(o_ref.dtype)
        if snapshots:
            # (interpret mode: the barrier changes no value; without it XLA:CPU compiles the in-place
            # bf16 snapshot store very slowly)
            _store_state(tape_ref, w, t, cols, jax.lax.optimization_barrier(S) if interpret else S, evict)
        else:
            _store_row(tape_ref, w, (*w.lead, t, hv, vs), u)
        return S

    start = 9 + (2 if into else 0)
    end = len(refs) - n_out - (2 if out_into else 0)
    if pending == "tuples" and pending_replay == "rows":
        # The commit replayed on the whole [BV, K] tile (one chunk: Triton lays it out with the lanes
        # across K, so a step's k is K / 32 registers a lane, where the chain's chunks hold K / 4),
        # then the state the pool now holds, in the chain's chunks, after a barrier: its lanes read
        # what other lanes of the program wrote (interpret mode runs a program as one).
        whole = _chunks(k_ref.shape[-1], k_ref.shape[-1])
        pool_ref = refs[-1]
        _apply_pending(refs[start:end], pending, pool_ref, pool_ref, w, whole, _load_state(pool_ref, w, whole, evict),
                       form, control, "split")  # fmt: skip
        if barrier:
            plgpu.debug_barrier()
        S = _load_state(pool_ref, w, cols, evict)
    else:
        S = _load_state(state_ref, w, cols, evict)
        if pending:
            S = _apply_pending(refs[start:end], pending, state_ref, refs[-1], w, cols, S, form, control,
                               pending_replay)  # fmt: skip
    if not loop:  # unrolled, every step's inputs loaded first
        xs = [inputs(t) for t in range(D)]
        for t in range(D):
            S = step(t, S, xs[t])
        return

    def body(t, carry):  # a loop (compile time grows fast with unrolled steps): prefetch step t + 1's inputs
        S, x = carry
        nxt = inputs(jnp.minimum(t + 1, D - 1))
        return step(t, S, x), nxt

    jax.lax.fori_loop(0, D, body, (S, inputs(0)))


def _prep_kernel(*refs, H: int, HV: int, hb: int, scale: float, into: bool, stacked: tuple = (False,) * 6):
    """Per (request, step, group of ``hb`` q/k heads): the q/k l2 norms of those heads and the
    gates of their v-heads.

    ``reference.prepare``'s formulas in one small kernel (XLA would make several). Heads are
    padded to powers of 2 and masked. With ``into`` the tape's ``k``
    and ``g`` also go straight into the tape buffers at ``[tape_layer, rows[n], t]`` (aliased:
    no copy after the kernel; an out-of-range row writes nothing). ``stacked``: which of the six
    inputs are stacked over layers, read at the layer in the ``[1]`` input after them.
    """
    # inputs: q, k, a, b, A_log, dt_bias[, layer][, rows, tape_layer, k buffer, g buffer];
    # outputs: qn, kn, g, beta[, buffers]
    q_ref, k_ref, a_ref, b_ref, A_log_ref, dt_bias_ref = refs[:6]
    x = 7 if any(stacked) else 6  # the first ref after the inputs
    xl = refs[6][0] if any(stacked) else None
    at_q, at_k, at_a, at_b, at_A, at_dt = (((xl,) if st else ()) for st in stacked)  # each input's layer index
    qn_ref, kn_ref, g_ref, beta_ref = refs[x + 4 : x + 8] if into else refs[x : x + 4]
    n, t, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    if into:
        row, tape_layer = refs[x][n], refs[x + 1][0]
        kbuf_ref, gbuf_ref = refs[x + 8 : x + 10]
        row_ok = (row >= 0) & (row < kbuf_ref.shape[1])
        row = jnp.where(row_ok, row, 0)
    r = HV // H
    K = k_ref.shape[-1]
    heads = j * hb + jax.lax.broadcasted_iota(jnp.int32, (hb, K), 0) < H
    hs = pl.ds(j * hb, hb)
    for src, at, dst, mult in ((q_ref, at_q, qn_ref, scale), (k_ref, at_k, kn_ref, None)):
        xt = plgpu.load(src.at[(*at, n, t, hs, slice(None))], mask=heads, other=0.0).astype(F32)  # [hb, K]
        y = _unit_rows(xt)
        y = y if mult is None else y * jnp.asarray(mult, F32)
        plgpu.store(dst.at[n, t, hs, :], y, mask=heads)
        if into and mult is None:
            plgpu.store(kbuf_ref.at[tape_layer, row, t, hs, :], y, mask=heads & row_ok)
    hvb = pl.next_power_of_2(hb * r)  # the group's v-heads, padded
    off = jax.lax.broadcasted_iota(jnp.int32, (hvb,), 0)
    vheads = (off < hb * r) & (j * hb * r + off < HV)
    hvs = pl.ds(j * hb * r, hvb)

    def load(ref, *idx):
        return plgpu.load(ref.at[(*idx, hvs)], mask=vheads, other=0.0)

    g, beta = gates(load(a_ref, *at_a, n, t), load(b_ref, *at_b, n, t), load(A_log_ref, *at_A), load(dt_bias_ref, *at_dt))
    plgpu.store(g_ref.at[n, t, hvs], g, mask=vheads)
    plgpu.store(beta_ref.at[n, t, hvs], beta, mask=vheads)
    if into:
        plgpu.store(gbuf_ref.at[tape_layer, row, t, hvs], g, mask=vheads & row_ok)


def _prep(q, k, a, b, A_log, dt_bias, *, scale, interpret: bool, heads: int = 0, into=None, xlayer=None):
    """``(qn, kn, g, beta)`` as ``reference.prepare`` computes them, in one launch: grid
    ``(N, D, H / heads)``, ``heads`` q/k heads per program (0: all of them). ``into``:
    ``(rows, tape_layer, k buffer, g buffer)``; then the updated buffers are returned too.
    ``xlayer`` (a ``[1]`` index): the layer of the inputs stacked over layers (by their rank)."""
    named = {"q": q, "k": k, "a": a, "b": b, "A_log": A_log, "dt_bias": dt_bias}
    stacked = tuple(is_stacked(n, x) for n, x in named.items())
    N, D, H, K = q.shape[-4:]
    HV = a.shape[-1]
    hb = min(pl.next_power_of_2(heads or H), pl.next_power_of_2(H))
    out_shape = [jax.ShapeDtypeStruct((N, D, H, K), F32)] * 2 + [jax.ShapeDtypeStruct((N, D, HV), F32)] * 2
    inputs, aliases = [q, k, a, b, A_log, dt_bias] + ([xlayer] if any(stacked) else []), {}
    if into is not None:
        inputs += list(into)
        out_shape += [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in into[2:]]
        aliases = {len(inputs) - 2: 4, len(inputs) - 1: 5}
    return pl.pallas_call(
        functools.partial(_prep_kernel, H=H, HV=HV, hb=hb, scale=scale, into=into is not None, stacked=stacked),
        out_shape=out_shape,
        grid=(N, D, pl.cdiv(H, hb)),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=2 if hb > 1 else 1, num_stages=1),
        interpret=interpret,
        name="gdn_verify_prep",
    )(*inputs)


def _dot(a, b, *, trans_b=False):
    """``a @ b`` (``a @ b.T`` with ``trans_b``) in fp32, fp32 accumulation."""
    return jax.lax.dot_general(a, b, (((1,), (1 if trans_b else 0,)), ((), ())), precision=HIGHEST)


def _gram_prep_kernel(q_ref, k_ref, a_ref, b_ref, A_log_ref, dt_bias_ref, qn_ref, kn_ref, g_ref, *coef_refs, D: int,
                      Dp: int, r: int, scale: float):  # fmt: skip
    """Per (request, q/k head): the norms of its D queries and keys, and for each of its r
    v-heads the gates and the coefficients of :func:`_gram_kernel`'s recurrence.

    ``qn``, ``kn`` and ``g`` are ``reference.prepare``'s (``kn`` and ``g`` are the tape's).
    With ``G[t, s] = exp(g_{s+1} + ... + g_t)`` (each exponent a sum of terms of one sign: a
    product with a 0/1 mask, no difference of cumulative sums, which would cancel under strong
    decays): ``W[t, s] = beta_t G[t, s] (k_t . k_s)`` for s < t, ``C[t, s] = G[t, s] (q_t . k_s)``
    for s <= t, ``P_t = exp(g_0 + ... + g_t)``, ``beta_t``; steps >= D are zero. ``coef_refs``:
    ``W``, ``C``, ``P``, ``beta``, or one ``[N, HV, rows, Dp]`` block of them (``_gram_prep``'s
    ``packed``: rows ``beta``, ``P``, ``W``, ``C``; the ``mosaic`` backend's ``verify="gram"``).
    """
    n, h = pl.program_id(0), pl.program_id(1)
    steps = pl.ds(0, Dp)
    K = k_ref.shape[-1]
    rows = jax.lax.broadcasted_iota(jnp.int32, (Dp, K), 0) < D

    def unit(ref):  # l2norm of the D rows (reference.l2norm)
        return _unit_rows(plgpu.load(ref.at[n, steps, h, :], mask=rows, other=0.0).astype(F32))

    qn, kn = unit(q_ref) * jnp.asarray(scale, F32), unit(k_ref)
    plgpu.store(qn_ref.at[n, steps, h, :], qn, mask=rows)
    plgpu.store(kn_ref.at[n, steps, h, :], kn, mask=rows)
    KK = _dot(kn, kn, trans_b=True)  # k_t . k_s
    QK = _dot(qn, kn, trans_b=True)  # q_t . k_s
    t_ = jax.lax.broadcasted_iota(jnp.int32, (Dp, Dp), 0)
    s_ = jax.lax.broadcasted_iota(jnp.int32, (Dp, Dp), 1)
    live = jax.lax.broadcasted_iota(jnp.int32, (Dp,), 0) < D
    for i in range(r):  # the v-heads of this q/k head
        hv = h * r + i
        a = plgpu.load(a_ref.at[n, steps, hv], mask=live, other=0.0)
        b = plgpu.load(b_ref.at[n, steps, hv], mask=live, other=0.0)
        g, beta = gates(a, b, A_log_ref[hv], dt_bias_ref[hv])
        g, beta = jnp.where(live, g, 0.0), jnp.where(live, beta, 0.0)
        plgpu.store(g_ref.at[n, steps, hv], g, mask=live)
        upto = jnp.where(s_ <= t_, g[None, :], 0.0)  # [t, j]: g_j for j <= t
        G = rounding.exp(_dot(upto, jnp.where(t_ > s_, 1.0, 0.0)))  # [t, s]: exp(sum of g_j for s < j <= t)
        W = jnp.where(s_ < t_, beta[:, None] * (G * KK), 0.0)
        C = jnp.where((s_ <= t_) & (t_ < D), G * QK, 0.0)
        P = jnp.where(live, rounding.exp(jnp.sum(upto, axis=1)), 0.0)
        if len(coef_refs) == 1:
            (coef_ref,) = coef_refs
            coef_ref[n, hv, 0, :] = beta
            coef_ref[n, hv, 1, :] = P
            coef_ref[n, hv, pl.ds(2, Dp), :] = W
            coef_ref[n, hv, pl.ds(2 + Dp, Dp), :] = C
        else:
            W_ref, C_ref, P_ref, beta_ref = coef_refs
            W_ref[n, hv, :, :], C_ref[n, hv, :, :], P_ref[n, hv, :], beta_ref[n, hv, :] = W, C, P, beta


def _gram_kernel(*refs, D: int, r: int, BV: int, snapshots: bool, form: str, into: bool, k_chunk: int,
                 evict: str | None, interpret: bool, mma_chunk: int | None, tiles_first: bool,
                 out_into: bool = False):  # fmt: skip
    """The Gram form (module docstring) for one (request, v-head, V tile).

    Products of the untouched state against every step's key and query, ``xk_t = S0 k_t`` and
    ``xq_t = S0 q_t`` (independent of each other: no serial chain through memory or
    reductions), then per row
    ``u_t = beta_t (v_t - P_t xk_t) - sum_{s<t} W[t, s] u_s`` and
    ``o_t = P_t xq_t + sum_{s<=t} C[t, s] u_s``, with the coefficients from
    :func:`_gram_prep_kernel`. The snapshot mode then builds the states from the same ``u``
    with the pinned rule, step by step. With ``mma_chunk`` (``products="mma"``) the products
    are ``tl.dot`` of the state tile against the keys and queries of all steps, chunk by chunk
    of K (``mma_chunk`` columns), summed (TF32x3; fp32 products in interpret mode, where
    XLA:CPU has no TF32).
    """
    # inputs: state, slots, layer, tape_layer, qn, kn, v, g, W, C, P, beta[, rows, tape buffer][, out_layer, outputs
    # buffer]; outputs: o, tape
    (q_ref, k_ref, v_ref, g_ref, W_ref, C_ref, P_ref, beta_ref), o_ref, tape_ref, state_ref, w = _program(
        refs, 12, into, r, BV, tiles_first, out_into=out_into)
    n, hv, h, vs = w.n, w.hv, w.h, w.vs
    mul, fma = rounding_ops(form)
    cols = _chunks(k_ref.shape[-1], k_chunk)

    def vecs(ref, t):  # q or k of step t, as [1, C] rows of the chunks
        return [ref[n, t, pl.ds(h, 1), c] for c in cols]

    # With mma the products read the state chunk by chunk; the snapshot mode reads it again for
    # its states after the recurrence (an L2 hit, not held in registers across the products).
    mma = mma_chunk is not None
    S0 = None if mma else _load_state(state_ref, w, cols, evict)

    def state(t, S, u):  # step t's state, from the same u, with the pinned rule, and its store
        alpha = rounding.exp(g_ref[n, t, hv])
        S = [fma(kc, u[:, None], mul(c, alpha)) for kc, c in zip(vecs(k_ref, t), S)]
        if interpret:  # XLA:CPU would fuse the whole elementwise chain of integer fmas (compiles for minutes)
            S = jax.lax.optimization_barrier(S)
        _store_state(tape_ref, w, t, cols, S, evict)
        return S

    # Loops (Triton unrolls short ones itself). The steps' products (step t + 1's q and k loaded during step t) go into columns
    # of [BV, Dp] tiles; the recurrence reads them back (a sum of one value and zeros) and
    # keeps its u in such a tile as bit patterns (read back by an integer sum: exact, -0.0 included).
    Dp = gram_steps(D)
    col = jax.lax.broadcasted_iota(jnp.int32, (BV, Dp), 1)
    zero = jnp.zeros((BV, Dp), F32)

    def pick(X, t):  # column t of a [BV, Dp] tile (or of the products' [BV, Dm] with mma)
        c = col if X.shape[1] == Dp else jax.lax.broadcasted_iota(jnp.int32, X.shape, 1)
        return jnp.sum(jnp.where(c == t, X, 0), axis=1)

    def products(t, carry):
        XK, XQ, (ks, qs) = carry
        nxt = jnp.minimum(t + 1, D - 1)
        nxt = vecs(k_ref, nxt), vecs(q_ref, nxt)  # loaded first: in flight during this step's products
        XK = jnp.where(col == t, _chunk_dot(S0, ks)[:, None], XK)
        XQ = jnp.where(col == t, _chunk_dot(S0, qs)[:, None], XQ)
        return XK, XQ, nxt

    if mma:  # all steps at once, [BV, C] x [C, Dm] per chunk of K on the tensor cores (rows >= D are zeros)
        Dm = gram_steps(D, "mma")
        prec = HIGHEST if interpret else jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
        XK = XQ = None
        for c in _chunks(k_ref.shape[-1], mma_chunk):
            live = jax.lax.broadcasted_iota(jnp.int32, (Dm, c.size), 0) < D
            tile = _state_tile(state_ref, w, c, None if snapshots else evict)
            xk, xq = (
                jax.lax.dot_general(tile, plgpu.load(ref.at[n, pl.ds(0, Dm), h, c], mask=live, other=0.0),
                                    (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=F32)
                for ref in (k_ref, q_ref)
            )  # fmt: skip
            XK, XQ = (xk, xq) if XK is None else (XK + xk, XQ + xq)
    else:
        XK, XQ, _ = jax.lax.fori_loop(0, D, products, (zero, zero, (vecs(k_ref, 0), vecs(q_ref, 0))))

    def recurrence(t, bits):  # step t's u and o
        U = jax.lax.bitcast_convert_type(bits, F32)  # columns >= t are 0; so are W[t, s >= t], C[t, s > t]
        P = P_ref[n, hv, t]
        u = beta_ref[n, hv, t] * (v_ref[n, t, hv, vs].astype(F32) - P * pick(XK, t))
        u = u - jnp.sum(W_ref[n, hv, t, :][None, :] * U, axis=1)
        U = jnp.where(col == t, u[:, None], U)
        o = P * pick(XQ, t) + jnp.sum(C_ref[n, hv, t, :][None, :] * U, axis=1)
        o_ref[(*w.olead, n, t, hv, vs)] = o.astype(o_ref.dtype)
        if not snapshots:
            _store_row(tape_ref, w, (*w.lead, t, hv, vs), u)
        return jnp.where(col == t, jax.lax.bitcast_convert_type(u, jnp.int32)[:, None], bits)

    bits = jax.lax.fori_loop(0, D, recurrence, jnp.zeros((BV, Dp), jnp.int32))
    if snapshots:
        S0 = _load_state(state_ref, w, cols, evict) if mma else S0
        jax.lax.fori_loop(0, D, lambda t, S: state(t, S, jax.lax.bitcast_convert_type(pick(bits, t), F32)), S0)


def _one_layer(layer, **named):
    """The inputs stacked over layers (by their rank) sliced at ``layer`` by XLA (a copy each), the
    others as they are, in the order given."""
    return tuple(jax.lax.dynamic_index_in_dim(x, layer, 0, keepdims=False) if is_stacked(n, x) else x
                 for n, x in named.items())  # fmt: skip


def _gram_prep(q, k, a, b, A_log, dt_bias, *, scale, Dp: int, interpret: bool, packed: int = 0, into=None,
               xlayer=None):  # fmt: skip
    """``(qn, kn, g, W, C, P, beta)`` for the Gram form, in one launch (grid ``(N, H)``); with
    ``packed`` (rows, at least ``2 + 2 Dp``): ``(qn, kn, g, coef)``, ``coef [N, HV, packed, Dp]``
    (:func:`_gram_prep_kernel`). ``into`` and ``xlayer`` as :func:`_prep` takes them, done by XLA
    here: the stacked inputs' layer sliced out, the tape's k and g scattered into the buffers
    (returned last; an out-of-range row writes nothing)."""
    if xlayer is not None:
        q, k, a, b, A_log, dt_bias = _one_layer(xlayer[0], q=q, k=k, a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    N, D, H, K = q.shape
    HV = a.shape[-1]
    kernel = functools.partial(_gram_prep_kernel, D=D, Dp=Dp, r=HV // H, scale=scale)
    # The kernel reads and writes whole [Dp] step tiles (masked past D): the step axis is padded to
    # Dp, so that every slice is in bounds (jax 0.12 checks them), and the outputs cut back to D.
    pad = lambda x: jnp.pad(x, [(0, 0), (0, Dp - D)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
    qn, kn, g, *rest = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((N, Dp, H, K), F32)] * 2 + [jax.ShapeDtypeStruct((N, Dp, HV), F32)]
        + ([jax.ShapeDtypeStruct((N, HV, packed, Dp), F32)] if packed else
           [jax.ShapeDtypeStruct((N, HV, Dp, Dp), F32)] * 2 + [jax.ShapeDtypeStruct((N, HV, Dp), F32)] * 2),
        grid=(N, H),
        compiler_params=plgpu.CompilerParams(num_warps=gram_prep_warps(Dp), num_stages=1),
        interpret=interpret,
        name="gdn_verify_gram_prep",
    )(pad(q), pad(k), pad(a), pad(b), A_log, dt_bias)
    qn, kn, g = qn[:, :D], kn[:, :D], g[:, :D]
    if into is None:
        return (qn, kn, g, *rest)
    rows, tape_layer, kbuf, gbuf = into
    nr = kbuf.shape[1]
    at = jnp.where((rows >= 0) & (rows < nr), rows, nr)  # out-of-range rows: dropped (negative would wrap)
    return (qn, kn, g, *rest, kbuf.at[tape_layer[0], at, :D].set(kn, mode="drop"),
            gbuf.at[tape_layer[0], at, :D].set(g, mode="drop"))  # fmt: skip


def gram_prep_warps(Dp: int) -> int:
    return 4 if Dp >= 16 else 2  # two [Dp, K] tiles per program: at Dp = 16, 2 warps spill registers


def _store_row(ref, w: _Where, idx, value, evict=None):
    if w.row_ok is None:  # a fresh tape: rows are the requests themselves
        store(ref, idx, value, evict)
        return

    @pl.when(w.row_ok)  # out-of-range rows write nothing
    def _():
        store(ref, idx, value, evict)


@functools.partial(jax.jit, static_argnames=("config", "form", "interpret", "pending_control"))
def verify(call: VerifyCall, *, config=None, form, interpret, pending_control=None):
    """See :func:`gdn_lossless_jax.verify`; the call's fields as :class:`~..contract.VerifyCall` has them.

    The kernel reads each request's state at ``pool[layer, slots[n]]`` (zeros for a slot outside
    ``[0, S)``; no gathered copy). With a tape buffer, request n's tape goes to ``[tape_layer,
    rows[n], :D]`` of it, in place (aliased; donate it under jit); an out-of-range row writes
    nothing. Inputs with a leading layer axis are read at ``layer`` by the kernels. With
    ``pending``, each program first applies that commit to its tile of the pool
    (:func:`_apply_pending`) and verifies from the committed state; the pool is aliased to a
    third output (the chain algorithm only). With ``out``, the outputs go to ``out[out_layer]``,
    in place. Returns ``(outputs, tape[, pool])``.
    """
    from ...tape import Snapshots, Tuples

    state, slots, layer, pending = call.pool, call.slots, call.layer, call.pending
    q, k, v, a, b, A_log, dt_bias = call.inputs
    tape, tape_layer, rows, out, out_layer = call.tape, call.tape_layer, call.rows, call.out, call.out_layer
    record, scale, out_dtype = call.record, call.scale, jnp.dtype(call.out_dtype)
    # inputs stacked over the pool's layers (by rank): read at `layer` by the kernels
    stacked = any(is_stacked(n, x) for n, x in zip(INPUT_RANKS, call.inputs))
    D, H = q.shape[-3], q.shape[-2]
    i32 = jnp.int32
    N = q.shape[-4]
    _, _, HV, V, K = state.shape
    layer, tape_layer = scalar(layer), scalar(tape_layer)
    cfg = (tuned_config(N, D, state.dtype) if config is None else config).fit(V)
    if stacked and cfg.algorithm == "gram":  # the Gram prologue reads one layer: slice it out (a copy)
        q, k, v, a, b, A_log, dt_bias = _one_layer(layer[0], **dict(zip(INPUT_RANKS, (q, k, v, a, b, A_log, dt_bias))))
        stacked = False
    if V % cfg.block_v:
        raise ValueError(f"pallas verify: V={V} must be a multiple of block_v={cfg.block_v}")
    if K % min(K, cfg.k_chunk):
        raise ValueError(f"pallas verify: K={K} must be a multiple of k_chunk={cfg.k_chunk} (or at most it)")
    snapshots = record == "snapshots"
    into = tape is not None
    if pending is not None and cfg.algorithm != "chain":
        raise ValueError("pallas verify: a pending commit needs the chain algorithm")
    if into and rows is None:
        rows = jnp.arange(N, dtype=i32)
    gram = cfg.algorithm == "gram"
    tiles_first = (cfg.order or ("tiles" if snapshots else "requests")) == "tiles"
    kbuf = gbuf = None
    if gram:
        mma_chunk = max(MMA_MIN, cfg.k_chunk) if cfg.products == "mma" else None
        # every side of a tl.dot tile is >= 16; the chunks must cover K
        if mma_chunk is not None and (cfg.block_v < MMA_MIN or K < MMA_MIN or K % min(K, mma_chunk)):
            raise ValueError(f"pallas verify: products='mma' needs block_v >= {MMA_MIN} (got {cfg.block_v}, V={V}) "
                             f"and K >= {MMA_MIN} a multiple of max({MMA_MIN}, k_chunk) (got K={K}, k_chunk={cfg.k_chunk})")  # fmt: skip
        pre = (rows, tape_layer, tape.k, tape.g) if into and not snapshots else None  # k and g into the tape
        qn, kn, g, W, C, P, beta, *bufs = _gram_prep(q, k, a, b, A_log, dt_bias, scale=scale, Dp=gram_steps(D),
                                                     interpret=interpret, into=pre)  # fmt: skip
        if bufs:
            kbuf, gbuf = bufs
        # The mma products read whole [Dm] step tiles of q and k (masked past D): pad them to Dm so
        # that the slices are in bounds (jax 0.12 checks them); the tape keeps kn's D steps.
        Dm = gram_steps(D, cfg.products)
        pad = lambda x: jnp.pad(x, [(0, 0), (0, Dm - D), (0, 0), (0, 0)])  # noqa: E731
        inputs = [state, slots, layer, tape_layer, pad(qn), pad(kn), v, g, W, C, P, beta]
    else:
        pre = (rows, tape_layer, tape.k, tape.g) if into and not snapshots else None
        qn, kn, g, beta, *bufs = _prep(q, k, a, b, A_log, dt_bias, scale=scale, interpret=interpret,
                                       heads=cfg.prep_heads, into=pre, xlayer=layer if stacked else None)  # fmt: skip
        if bufs:
            kbuf, gbuf = bufs
        inputs = [state, slots, layer, tape_layer, qn, kn, v, g, beta]
    out_shape = [jax.ShapeDtypeStruct((N, D, HV, V), out_dtype)]
    aliases = {}
    if into:
        buf = tape.states if snapshots else tape.u
        inputs += [rows, buf]
        out_shape.append(jax.ShapeDtypeStruct(buf.shape, buf.dtype))
        aliases = {len(inputs) - 1: 1}
    elif snapshots:
        out_shape.append(jax.ShapeDtypeStruct((N, D, HV, V, K), state.dtype))
    else:
        out_shape.append(jax.ShapeDtypeStruct((N, D, HV, V), F32))
    pending_mode = None
    if pending is not None:
        prev_tape = pending.tape
        pending_mode = "snapshots" if isinstance(prev_tape, Snapshots) else "tuples"
        if pending_mode == "tuples" and v.ndim == 5 and cfg.pending_slice_v:  # one layer's v, copied by XLA
            v = jax.lax.dynamic_index_in_dim(v, layer[0], 0, keepdims=False)
            inputs[6] = v
        inputs += [pending.rows, pending.steps, pending.track_slots, pending.track_steps, scalar(pending.layer),
                   *jax.tree.leaves(prev_tape)]
        out_shape.append(jax.ShapeDtypeStruct(state.shape, state.dtype))
        aliases[0] = 2
    out_into = out is not None
    if out_into:
        inputs += [scalar(out_layer), out]
        out_shape[0] = jax.ShapeDtypeStruct(out.shape, out.dtype)
        aliases[len(inputs) - 1] = 0
    if gram:
        kernel = functools.partial(_gram_kernel, D=D, r=HV // H, BV=cfg.block_v, snapshots=snapshots, form=form,
                                   into=into, k_chunk=cfg.k_chunk, evict=cfg.evict, interpret=interpret,
                                   mma_chunk=mma_chunk, tiles_first=tiles_first, out_into=out_into)  # fmt: skip
    else:
        kernel = functools.partial(
            _kernel, D=D, r=HV // H, BV=cfg.block_v, snapshots=snapshots, form=form, into=into,
            row_vectors=cfg.row_vectors, one_pass=cfg.one_pass, k_chunk=cfg.k_chunk,
            loop=D > cfg.unroll, evict=cfg.evict, prefetch_q=cfg.prefetch_q, tiles_first=tiles_first,
            dot_fma=cfg.dot_fma, pending=pending_mode, control=pending_control, stacked=v.ndim == 5, out_into=out_into,
            pending_replay=cfg.pending_replay, barrier=not interpret, interpret=interpret,
        )  # fmt: skip
    outputs, rec, *pool = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid(N, HV, V // cfg.block_v, tiles_first),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"gdn_verify_{record}",
    )(*inputs)
    if snapshots:
        new = Snapshots(rec)
    elif into:
        new = Tuples(rec, kbuf, gbuf)
    else:
        new = Tuples(rec, kn, g)
    return (outputs, new, *pool)
