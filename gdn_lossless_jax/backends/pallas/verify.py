"""Pallas (Triton backend) verify: one kernel body, one launch configuration for both record modes.

A small prologue kernel (:func:`~.prologue.prep`) computes the q/k l2 norms, the query scale and the gates
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

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ...reference import INPUT_RANKS, exp_fn
from ...reference import prepare_call as ref_prepare_call
from ...reference import stacked as is_stacked
from ... import portable, rounding, tree as tree_mod
from ..contract import VerifyCall
from ..launch import VerifyLaunch
from ._refs import grid
from .gram import _gram_kernel
from .tiles import (_Where, _apart, _times, _chunk_dot, _chunks, _decays, _load_state, _program, _store_row,
                    _store_state, _tree_dot)  # fmt: skip
from .prologue import MMA_MIN, gram_prep, gram_steps, one_layer, prep
from .conv import scalar
from .rounding import ops as rounding_ops
from .rounding import COMPILER_FORMS, CONTROL_FORMS, replay_update

__all__ = ["VerifyConfig", "verify", "ALGORITHMS", "TUNED", "tuned_config"]

F32 = jnp.float32
ALGORITHMS = ("chain", "gram")
PRODUCTS = ("fma", "mma")
PENDING_REPLAYS = ("rows", "split", "carry")
DOT_FMA = {"none": (False, False), "u": (True, False), "both": (True, True)}  # fused: (u's dot, o's dot)


@dataclasses.dataclass(frozen=True)
class VerifyConfig(VerifyLaunch):
    """Launch configuration, the same for both record modes so that their outputs agree by construction.

    ``order``, ``evict``, ``num_stages`` and ``pending_slice_v`` change no arithmetic; others may
    change ``u``'s and the outputs' low bits (never the tape's exactness). ``row_vectors``,
    ``one_pass``, ``unroll`` and ``prefetch_q`` apply to the chain only (the Gram form always runs
    loops). The shared fields (``block_v``, ``num_warps``, ``num_stages``, ``k_chunk``, ``order``,
    ``prep_heads``) are :class:`~gdn_lossless_jax.backends.launch.VerifyLaunch`'s; the Gram form's
    products use the same ``k_chunk``. Design reasons for the defaults: docs/design.md.

    ``row_vectors``: load q and k as ``[1, K]`` rows in the state tile's layout, not ``[K]`` vectors
    (which Triton converts through shared memory every step).
    ``one_pass``: ``o = Sd q + u (k . q)`` from the decayed state, so both reductions of a step read
    ``Sd`` together (changes the outputs' fp32 rounding, not the tape's or the state's).
    ``algorithm``: ``"chain"`` or ``"gram"`` (module docstring).
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

    row_vectors: bool = True
    one_pass: bool = False
    algorithm: str = "chain"
    unroll: int = 0
    evict: str | None = "evict_first"
    prefetch_q: bool = True
    products: str = "fma"
    dot_fma: str = "both"
    pending_replay: str = "split"
    pending_slice_v: bool = False

    def __post_init__(self):
        super().__post_init__()
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
        if self.unroll < 0:
            raise ValueError(f"VerifyConfig: unroll must be >= 0, got {self.unroll}")


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


def _apply_pending(refs, pending, state_ref, pool_ref, w: _Where, cols, S0, form: str, control: str | None = None,
                   replay_mode: str = "split", math: str = "platform"):
    """The previous step's commit of this program's tile, before its verify: the state after the
    accepted step (and the track state, to its slot), both from the pre-verify state ``S0`` with
    the commit's rule (``fma(k, u, rn(S * exp(g)))``, the replay kernel's arithmetic element for
    element) or from the previous snapshots; both stored to the pool (rounded to its dtype).
    Returns the state the verify starts from: the accepted state as the pool now holds it, or
    ``S0`` where nothing was accepted. The masks are the commit's (``reference.commit_masks``).

    ``refs``: the pending rows, steps, track slots, track steps ``[N]``, the previous tape's
    layer ``[1]``, then the previous tape's fields (``u, k, g`` or ``states``, ``[L', R', D', ...]``).
    ``replay_mode``: ``VerifyConfig.pending_replay``.
    ``control`` breaks it on purpose, for tests that must catch it: a wrong replay form
    (``"twice_rounded"``, ``"other_product"``: :data:`~.rounding.CONTROL_FORMS`, or the compiler's
    ``"naive"``); ``"track_after_write"`` stores the accepted
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

    if pending.stores_states:
        (states_ref,) = prev

        def snap(t):
            return [states_ref[pl_, prow, t, hv, vs, c] for c in cols]

        @pl.when(track)
        def _():
            store(ptslot, snap(ptstep))

        acc = [jnp.where(accept, a, b) for a, b in zip(snap(jnp.where(accept, pstep, 0)), S0)]
    else:
        u_ref, k_ref, g_ref = prev
        update = replay_update(form, control if control in CONTROL_FORMS + COMPILER_FORMS else None)
        late = control == "track_after_write"

        def steps(first, upto, S, on_step, keep=None):
            """Steps ``first..upto`` from ``S``; returns the state after step ``keep`` (carried
            beside the running one) or, without ``keep``, after the last step run."""

            def body(t, carry):
                Sc, *acc = carry
                ks = [k_ref[pl_, prow, t, pl.ds(h, 1), c] for c in cols]
                u, alphas = u_ref[pl_, prow, t, hv, vs], _decays(g_ref, (pl_, prow, t, hv), cols, exp_fn(math))
                Sc = [update(c, alpha, kc, u) for kc, c, alpha in zip(ks, Sc, alphas)]
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

    if not pending.stores_states and late:  # the control: the track state replayed from the advanced state in the pool
        advanced = [jnp.where(accept, a.astype(dt).astype(F32), b) for a, b in zip(acc, S0)]
        steps(0, jnp.where(track, ptstep, -1), advanced, track_store)

    # Where nothing was accepted ``acc`` is ``S0``, already in the pool's dtype: no select, and
    # ``S0`` need not live past the replay's start.
    return [a.astype(dt).astype(F32) for a in acc]


def _kernel(*refs, D: int, r: int, BV: int, snapshots: bool, form: str, into: bool, row_vectors: bool, one_pass: bool,
            k_chunk: int, loop: bool, evict: str | None, prefetch_q: bool, tiles_first: bool, dot_fma: str,
            pending=None, control: str | None = None, stacked: bool = False,
            out_into: bool = False, pending_replay: str = "split", barrier: bool = True,
            interpret: bool = False, tree: bool = False,
            math: str = "platform"):  # fmt: skip
    # inputs: state, slots, layer, tape_layer, qn, kn, v, g, beta[, anc, depth (tree)][, rows, tape buffer
    # (aliased)][, pending inputs][, out_layer, outputs buffer (aliased)]; outputs: o, tape[, pool (aliased with
    # state)]. With ``stacked``, v is [L, N, D, HV, V], read at the pool's layer.
    n_out = 3 if pending else 2
    n_in = 11 if tree else 9
    (q_ref, k_ref, v_ref, g_ref, beta_ref, *tree_refs), o_ref, tape_ref, state_ref, w = _program(
        refs, n_in, into, r, BV, tiles_first, n_out, out_into)  # fmt: skip
    n, hv, h, vs = w.n, w.hv, w.h, w.vs
    mul, fma = rounding_ops(form)
    cols = _chunks(k_ref.shape[-1], k_chunk)
    # The dots' products fused with the pinned fma instruction; the portable form keeps a multiply
    # and an add (its fma is ~20 integer operations, and a dot's rounding is free).
    fuse_u, fuse_o = (fma if fused and form == "ptx" else None for fused in DOT_FMA[dot_fma])
    apart = _apart(interpret)  # each product apart from the sum it feeds, in interpret mode

    def vec(ref, t, ks):  # q or k of step t, shaped to broadcast over the tile's rows
        return ref[n, t, pl.ds(h, 1), ks] if row_vectors else ref[n, t, h, ks][None, :]

    late_q = loop and not one_pass and not prefetch_q  # q loaded by its own step: fewer registers

    def inputs(t):  # everything step t reads besides the state
        qs = None if late_q else [vec(q_ref, t, c) for c in cols]
        ks = [vec(k_ref, t, c) for c in cols]
        kq = _chunk_dot(ks, qs, apart=apart) if one_pass else None  # [1]
        vt = v_ref[w.layer, n, t, hv, vs] if stacked else v_ref[n, t, hv, vs]
        return qs, ks, vt.astype(F32), _decays(g_ref, (n, t, hv), cols, exp_fn(math)), beta_ref[n, t, hv], kq

    def step(t, S, x):
        qs, ks, v, alphas, beta, kq = x
        if late_q:
            qs = [vec(q_ref, t, c) for c in cols]
        Sd = [mul(c, alpha) for c, alpha in zip(S, alphas)]
        if math == "portable":  # (one_pass off: verify's config for the mode)
            u = rounding.mul_rn(beta, rounding.add_rn(v, portable.neg(_tree_dot(Sd, ks))))
        else:
            if one_pass:
                sq = _chunk_dot(Sd, qs, fuse_o, apart)
            u = beta * (v - _chunk_dot(Sd, ks, fuse_u, apart))
        S = [fma(kc, u[:, None], c) for kc, c in zip(ks, Sd)]
        if math == "portable":
            o = _tree_dot(S, qs)
        else:
            o = sq + apart(_times(apart)(u, kq)) if one_pass else _chunk_dot(S, qs, fuse_o, apart)
        o_ref[(*w.olead, n, t, hv, vs)] = o.astype(o_ref.dtype)
        if snapshots:
            # (interpret mode: the barrier changes no value; without it XLA:CPU compiles the in-place
            # bf16 snapshot store very slowly)
            _store_state(tape_ref, w, t, cols, jax.lax.optimization_barrier(S) if interpret else S, evict)
        else:
            _store_row(tape_ref, w, (*w.lead, t, hv, vs), u)
        return (S, u) if tree else S

    start = n_in + (2 if into else 0)
    end = len(refs) - n_out - (2 if out_into else 0)
    if pending and not pending.stores_states and pending_replay == "rows":
        # The commit replayed on the whole [BV, K] tile (one chunk: Triton lays it out with the lanes
        # across K, so a step's k is K / 32 registers a lane, where the chain's chunks hold K / 4),
        # then the state the pool now holds, in the chain's chunks, after a barrier: its lanes read
        # what other lanes of the program wrote (interpret mode runs a program as one).
        whole = _chunks(k_ref.shape[-1], k_ref.shape[-1])
        pool_ref = refs[-1]
        _apply_pending(refs[start:end], pending, pool_ref, pool_ref, w, whole, _load_state(pool_ref, w, whole, evict),
                       form, control, "split", math)  # fmt: skip
        if barrier:
            plgpu.debug_barrier()
        S = _load_state(pool_ref, w, cols, evict)
    else:
        S = _load_state(state_ref, w, cols, evict)
        if pending:
            S = _apply_pending(refs[start:end], pending, state_ref, refs[-1], w, cols, S, form, control,
                               pending_replay, math)  # fmt: skip
    if tree:  # a draft tree: node t from its parent's state, replayed from the program's own tuples
        _tree_loop(tree_refs, S, inputs, step, vec, k_ref, g_ref, w, cols, D, mul, fma)
        return
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


def _tree_loop(tree_refs, S0, inputs, step, vec, k_ref, g_ref, w: _Where, cols, D: int, mul, fma):
    """The nodes of a draft tree in order, without a state a node: node t's parent state is
    replayed from the program's pre-verify tile ``S0`` along t's ancestors (``anc[n, t, :depth[n, t]]``,
    root first) with the rule ``fma(k_a, u_a, rn(S * exp(g_a)))``: the ops of the step's own update,
    on the same fp32 values, so the replayed state is the parent's bit for bit. ``u_a`` is the
    program's own earlier result, kept as bit patterns in a ``[Dp, BV]`` register tile (Dp, the
    next power of two of D; picked by an integer sum that has one nonzero term, exact for ``-0.0``
    too). Costs ``depth`` elementwise steps a node, no reduction.
    """
    anc_ref, depth_ref = tree_refs
    n, hv = w.n, w.hv
    Dp = 1 << max(D - 1, 0).bit_length()
    iota = jax.lax.broadcasted_iota(jnp.int32, (Dp, w.vs.size), 0)

    def pick(Ub, a):
        return jax.lax.bitcast_convert_type(jnp.sum(jnp.where(iota == a, Ub, 0), axis=0), F32)

    def body(t, carry):
        Ub, x = carry
        nxt = inputs(jnp.minimum(t + 1, D - 1))

        def replay(j, S):
            a = anc_ref[n, t, j]
            alphas = _decays(g_ref, (n, a, hv), cols, rounding.exp)
            ua = pick(Ub, a)
            return [fma(vec(k_ref, a, c), ua[:, None], mul(s, alpha)) for c, s, alpha in zip(cols, S, alphas)]

        S = jax.lax.fori_loop(0, depth_ref[n, t], replay, list(S0))
        _, u = step(t, S, x)
        return jnp.where(iota == t, jax.lax.bitcast_convert_type(u, jnp.int32)[None, :], Ub), nxt

    jax.lax.fori_loop(0, D, body, (jnp.zeros((Dp, w.vs.size), jnp.int32), inputs(0)))


def tree_tables(parents):
    """The kernel's tables of a draft tree ``parents [N, D]``: ``anc [N, D, D]`` (node t's ancestors,
    root first, padded with 0) and ``depth [N, D]`` (how many), int32."""
    p = jnp.asarray(parents, jnp.int32)
    N, D = p.shape
    rep = jnp.repeat(p, D, axis=0)  # [N*D, D]: request n's tree once for each of its nodes
    path, depth = tree_mod.path_to(rep, jnp.tile(jnp.arange(D, dtype=jnp.int32), N))
    return jnp.maximum(path, 0).reshape(N, D, D), depth.reshape(N, D)


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
    state, slots, layer, pending = call.pool, call.slots, call.layer, call.pending
    q, k, v, a, b, A_log, dt_bias = call.inputs
    tape, tape_layer, rows, out, out_layer = call.tape, call.tape_layer, call.rows, call.out, call.out_layer
    record, scale, out_dtype = call.record, call.scale, jnp.dtype(call.out_dtype)
    # inputs stacked over the pool's layers (by rank): read at `layer` by the kernels
    channel = call.decay == "channel"  # KDA: g [N, D, HV, K], read by the chain as [1, C] rows (tiles._decays)
    stacked = any(is_stacked(n, x, call.decay) for n, x in zip(INPUT_RANKS, call.inputs))
    beta_scale = call.beta_scale
    D, H = q.shape[-3], q.shape[-2]
    i32 = jnp.int32
    N = q.shape[-4]
    _, _, HV, V, K = state.shape
    layer, tape_layer = scalar(layer), scalar(tape_layer)
    cfg = (tuned_config(N, D, state.dtype) if config is None else config).fit(V)
    tree = call.parents is not None
    math = call.math
    if tree and math == "portable":
        raise ValueError("pallas verify: a draft tree (parents) with math='portable' is not supported; pass "
                         "backend='reference'")
    if channel and cfg.algorithm == "gram":
        raise ValueError("pallas verify: VerifyConfig(algorithm='gram') needs one decay per head and step; a "
                         "per-channel decay (decay='channel', KDA) runs algorithm='chain'")  # fmt: skip
    if tree:  # a draft tree: the chain algorithm's loop, each node from its replayed parent (_tree_loop)
        cfg = dataclasses.replace(cfg, algorithm="chain", products="fma", one_pass=False, unroll=0)
    if math == "portable":  # the chain with the reference's K tree: one_pass and the Gram form sum otherwise
        if K & (K - 1):
            raise ValueError(f"pallas verify: math='portable' needs K a power of 2, got K={K}")
        cfg = dataclasses.replace(cfg, algorithm="chain", one_pass=False, products="fma")
    if stacked and cfg.algorithm == "gram":  # the Gram prologue reads one layer: slice it out (a copy)
        q, k, v, a, b, A_log, dt_bias = one_layer(layer[0], **dict(zip(INPUT_RANKS, (q, k, v, a, b, A_log, dt_bias))))
        stacked = False
    if V % cfg.block_v:
        raise ValueError(f"pallas verify: V={V} must be a multiple of block_v={cfg.block_v}")
    if K % min(K, cfg.k_chunk):
        raise ValueError(f"pallas verify: K={K} must be a multiple of k_chunk={cfg.k_chunk} (or at most it)")
    snapshots = record.stores_states  # the record mode's flag (record: the tape class)
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
        qn, kn, g, W, C, P, beta, *bufs = gram_prep(q, k, a, b, A_log, dt_bias, scale=scale, Dp=gram_steps(D),
                                                     interpret=interpret, into=pre, beta_scale=beta_scale)  # fmt: skip
        if bufs:
            kbuf, gbuf = bufs
        # The mma products read whole [Dm] step tiles of q and k (masked past D): pad them to Dm so
        # that the slices are in bounds (jax 0.12 checks them); the tape keeps kn's D steps.
        Dm = gram_steps(D, cfg.products)
        pad = lambda x: jnp.pad(x, [(0, 0), (0, Dm - D), (0, 0), (0, 0)])  # noqa: E731
        inputs = [state, slots, layer, tape_layer, pad(qn), pad(kn), v, g, W, C, P, beta]
    else:
        pre = (rows, tape_layer, tape.k, tape.g) if into and not snapshots else None
        xlayer = layer if stacked else None
        if channel:  # KDA's per-channel gates: the reference's program in XLA
            qn, kn, g, beta, *bufs = ref_prepare_call(call, rows)
            bufs = bufs if pre is not None else []
        else:
            qn, kn, g, beta, *bufs = prep(q, k, a, b, A_log, dt_bias, scale=scale, interpret=interpret,
                                           heads=cfg.prep_heads, into=pre, xlayer=xlayer, math=math,
                                           beta_scale=beta_scale)  # fmt: skip
        if bufs:
            kbuf, gbuf = bufs
        inputs = [state, slots, layer, tape_layer, qn, kn, v, g, beta]
        if tree:
            inputs += list(tree_tables(call.parents))
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
    pending_mode = None  # the pending tape's class: its record mode's flags
    if pending is not None:
        prev_tape = pending.tape
        pending_mode = type(prev_tape)
        if not pending_mode.stores_states and v.ndim == 5 and cfg.pending_slice_v:  # one layer's v, copied by XLA
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
            pending_replay=cfg.pending_replay, barrier=not interpret, interpret=interpret, tree=tree, math=math,
        )  # fmt: skip
    outputs, rec, *pool = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid(N, HV, V // cfg.block_v, tiles_first),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"gdn_verify_{record.mode}",
    )(*inputs)
    if snapshots:
        new = record(rec)
    elif into:
        new = record(rec, kbuf, gbuf)
    else:
        new = record(rec, kn, g)
    return (outputs, new, *pool)
