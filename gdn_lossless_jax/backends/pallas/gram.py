"""The Gram form of the Pallas verify (``VerifyConfig.algorithm="gram"``): the products against
the untouched state first, then the ``[D, D]`` recurrence (:mod:`.verify` says why and when)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ... import rounding
from .prologue import gram_steps
from .rounding import ops as rounding_ops
from .tiles import _apart, _times, _chunk_dot, _chunks, _load_state, _program, _row_sum, _state_tile, _store_row, _store_state

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST  # fp32 products in fp32 (the default would be TF32 on a GPU)


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
    sep = _apart(interpret)  # each product apart from the sum it feeds, in interpret mode
    times = _times(sep)

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
        XK = jnp.where(col == t, _chunk_dot(S0, ks, apart=sep)[:, None], XK)
        XQ = jnp.where(col == t, _chunk_dot(S0, qs, apart=sep)[:, None], XQ)
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
        u = beta_ref[n, hv, t] * (v_ref[n, t, hv, vs].astype(F32) - sep(times(P, pick(XK, t))))
        u = u - _row_sum(sep(times(W_ref[n, hv, t, :][None, :], U)), sep)
        U = jnp.where(col == t, u[:, None], U)
        o = sep(times(P, pick(XQ, t))) + _row_sum(sep(times(C_ref[n, hv, t, :][None, :], U)), sep)
        o_ref[(*w.olead, n, t, hv, vs)] = o.astype(o_ref.dtype)
        if not snapshots:
            _store_row(tape_ref, w, (*w.lead, t, hv, vs), u)
        return jnp.where(col == t, jax.lax.bitcast_convert_type(u, jnp.int32)[:, None], bits)

    bits = jax.lax.fori_loop(0, D, recurrence, jnp.zeros((BV, Dp), jnp.int32))
    if snapshots:
        S0 = _load_state(state_ref, w, cols, evict) if mma else S0
        jax.lax.fori_loop(0, D, lambda t, S: state(t, S, jax.lax.bitcast_convert_type(pick(bits, t), F32)), S0)
