"""The verify prologue, shared by the ``pallas`` and ``mosaic`` backends: the q/k l2 norms and the
gates of every (request, step, head) in one small Pallas kernel (:func:`prep`), or with the Gram
form's coefficients (:func:`gram_prep`), with the tape's ``k`` and ``g`` written straight into
its buffers where asked (KDA's per-channel gates are the reference's program in XLA:
:func:`gdn_lossless_jax.reference.prepare_call`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ... import portable, reference, rounding
from ...reference import L2NORM_EPS, gates
from ...reference import stacked as is_stacked
from .tiles import _apart, _row_sum, _times

__all__ = ["prep", "gram_prep", "gram_steps", "gram_prep_warps", "one_layer", "MMA_MIN"]

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST  # fp32 products in fp32 (the default would be TF32 on a GPU)
MMA_MIN = 16  # Triton's smallest tl.dot tile side


def _unit_rows(x, interpret: bool = False):
    """l2norm of each row of a ``[rows, K]`` tile (``reference.l2norm``'s formula). In interpret
    mode the squares (:func:`~.tiles._times`) summed in a fixed tree (:func:`~.tiles._row_sum`),
    as the kernels' dots are: no fusion decides the norms' bits."""
    apart = _apart(interpret)
    return x / jnp.sqrt(_row_sum(apart(_times(apart)(x, x)), apart)[:, None] + L2NORM_EPS)


def gram_steps(D: int, products: str = "fma") -> int:
    """The Gram form's step axis: D padded to a power of 2 (Triton tiles), at least 2 (at
    least 16 for ``products="mma"``: a side of a ``tl.dot`` tile)."""
    return max(MMA_MIN if products == "mma" else 2, pl.next_power_of_2(D))


def _prep_kernel(*refs, H: int, HV: int, hb: int, scale: float, into: bool, stacked: tuple = (False,) * 6,
                 math: str = "platform", interpret: bool = False, beta_scale: float = 1.0):
    """Per (request, step, group of ``hb`` q/k heads): the q/k l2 norms of those heads and the
    gates of their v-heads.

    ``reference.prepare``'s formulas in one small kernel (XLA would make several). Heads are
    padded to powers of 2 and masked. With ``into`` the tape's ``k``
    and ``g`` also go straight into the tape buffers at ``[tape_layer, rows[n], t]`` (aliased:
    no copy after the kernel; an out-of-range row writes nothing). ``stacked``: which of the six
    inputs are stacked over layers, read at the layer in the ``[1]`` input after them.
    ``beta_scale``: beta's factor (:func:`gdn_lossless_jax.reference.gates`).
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
        if math == "portable":  # (interpret mode only: the pallas backend's check_math)
            y = portable.l2norm(xt, L2NORM_EPS)
            y = y if mult is None else rounding.mul_rn(y, jnp.asarray(mult, F32))
        else:
            y = _unit_rows(xt, interpret)
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

    g, beta = gates(load(a_ref, *at_a, n, t), load(b_ref, *at_b, n, t), load(A_log_ref, *at_A), load(dt_bias_ref, *at_dt),
                    math=math, beta_scale=beta_scale)  # fmt: skip
    plgpu.store(g_ref.at[n, t, hvs], g, mask=vheads)
    plgpu.store(beta_ref.at[n, t, hvs], beta, mask=vheads)
    if into:
        plgpu.store(gbuf_ref.at[tape_layer, row, t, hvs], g, mask=vheads & row_ok)


def prep(q, k, a, b, A_log, dt_bias, *, scale, interpret: bool, heads: int = 0, into=None, xlayer=None,
         math: str = "platform", beta_scale: float = 1.0):
    """``(qn, kn, g, beta)`` as ``reference.prepare`` computes them, in one launch: grid
    ``(N, D, H / heads)``, ``heads`` q/k heads per program (0: all of them). ``into``:
    ``(rows, tape_layer, k buffer, g buffer)``; then the updated buffers are returned too.
    ``xlayer`` (a ``[1]`` index): the layer of the inputs stacked over layers (by their rank).
    ``beta_scale``: beta's factor."""
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
        functools.partial(_prep_kernel, H=H, HV=HV, hb=hb, scale=scale, into=into is not None, stacked=stacked,
                          math=math, interpret=interpret, beta_scale=beta_scale),
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
                      Dp: int, r: int, scale: float, interpret: bool = False,
                      beta_scale: float = 1.0):  # fmt: skip
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
        return _unit_rows(plgpu.load(ref.at[n, steps, h, :], mask=rows, other=0.0).astype(F32), interpret)

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
        g, beta = gates(a, b, A_log_ref[hv], dt_bias_ref[hv], beta_scale=beta_scale)
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


def one_layer(layer, **named):
    """The inputs stacked over layers (by their rank) sliced at ``layer`` by XLA (a copy each), the
    others as they are, in the order given."""
    return tuple(jax.lax.dynamic_index_in_dim(x, layer, 0, keepdims=False) if is_stacked(n, x) else x
                 for n, x in named.items())  # fmt: skip


def gram_prep(q, k, a, b, A_log, dt_bias, *, scale, Dp: int, interpret: bool, packed: int = 0, into=None,
               xlayer=None, beta_scale: float = 1.0):  # fmt: skip
    """``(qn, kn, g, W, C, P, beta)`` for the Gram form, in one launch (grid ``(N, H)``); with
    ``packed`` (rows, at least ``2 + 2 Dp``): ``(qn, kn, g, coef)``, ``coef [N, HV, packed, Dp]``
    (:func:`_gram_prep_kernel`). ``into`` and ``xlayer`` as :func:`prep` takes them, done by XLA
    here: the stacked inputs' layer sliced out, the tape's k and g scattered into the buffers
    (returned last; an out-of-range row writes nothing). ``beta_scale``: beta's factor (in ``W`` too)."""
    if xlayer is not None:
        q, k, a, b, A_log, dt_bias = one_layer(xlayer[0], q=q, k=k, a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    N, D, H, K = q.shape
    HV = a.shape[-1]
    kernel = functools.partial(_gram_prep_kernel, D=D, Dp=Dp, r=HV // H, scale=scale, interpret=interpret,
                               beta_scale=beta_scale)
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
    return (qn, kn, g, *rest, *_tape_into(into, kn, g))


def _tape_into(into, kn, g) -> tuple:
    """The tape buffers of ``into`` (``(rows, tape_layer, k buffer, g buffer)``) with ``kn`` and ``g``
    scattered in at ``[tape_layer, rows[n], :D]`` by XLA (``reference.write_rows``: an out-of-range row
    writes nothing); ``()`` without ``into``."""
    if into is None:
        return ()
    rows, tape_layer, kbuf, gbuf = into
    return reference.write_rows((kbuf, gbuf), tape_layer[0], rows, (kn, g))


def gram_prep_warps(Dp: int) -> int:
    return 4 if Dp >= 16 else 2  # two [Dp, K] tiles per program: at Dp = 16, 2 warps spill registers
