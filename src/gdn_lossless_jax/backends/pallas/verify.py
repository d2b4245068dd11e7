"""Pallas (Triton backend) verify: one kernel body, one launch for both record modes.

Work outside the serial chain runs first, once per (request, step, head), as one XLA
fusion: the q/k l2 norms, the query scale and the gates (``reference.prepare``, the same
code the reference runs). Its ``k`` and ``g`` *are* the tape's ``k`` and ``g``: written
once per (request, q/k head) and (request, v-head), never once per V tile.

The kernel's grid is ``(N, HV, V // BV)``: one program per request, v-head and V tile,
holding the ``[BV, K]`` fp32 state tile in registers for the whole chain. Per step: one
pinned decay multiply, one reduction over K, one pinned fma, one output reduction, and the
step's store (``u``, or the snapshot). The per-request pitch of the tape is the buffer's:
with ``tape=`` the kernel writes into rows of a larger buffer (``D <= Dmax``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ...reference import prepare
from .rounding import ops as rounding_ops

__all__ = ["VerifyConfig", "verify"]

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class VerifyConfig:
    """Launch configuration (the same for both record modes, so outputs agree by construction).

    ``row_vectors``: load q and k as ``[1, K]`` rows of the state tile's layout rather than
    ``[K]`` vectors (which Triton must convert through shared memory every step).
    ``one_pass``: compute a step's output from the decayed state, ``o = Sd q + u (k . q)``,
    so both K-reductions of a step read ``Sd`` together and the output leaves the chain
    (the output's fp32 rounding changes; the tape and the state do not).
    """

    block_v: int = 16
    num_warps: int = 2
    num_stages: int = 1
    row_vectors: bool = True
    one_pass: bool = False

    def fit(self, V: int) -> "VerifyConfig":
        return dataclasses.replace(self, block_v=min(self.block_v, V))


def _kernel(*refs, D: int, r: int, BV: int, snapshots: bool, form: str, into: bool, row_vectors: bool, one_pass: bool):
    # inputs: state, qn, kn, v, g, beta[, rows, tape buffer (aliased)]; outputs: o, tape
    state_ref, q_ref, k_ref, v_ref, g_ref, beta_ref = refs[:6]
    rows_ref = refs[6] if into else None
    o_ref, tape_ref = refs[-2:]
    mul, fma = rounding_ops(form)
    n, hv, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    row = rows_ref[n] if into else n
    h = hv // r
    vs = pl.ds(j * BV, BV)

    def vec(ref, t):  # q or k of step t, shaped to broadcast over the tile's rows
        return ref[n, t, pl.ds(h, 1), :] if row_vectors else ref[n, t, h, :][None, :]

    S = state_ref[n, hv, vs, :].astype(F32)  # [BV, K]
    qs = [vec(q_ref, t) for t in range(D)]
    ks = [vec(k_ref, t) for t in range(D)]
    vv = [v_ref[n, t, hv, vs].astype(F32) for t in range(D)]
    alphas = [jnp.exp(g_ref[n, t, hv]) for t in range(D)]
    betas = [beta_ref[n, t, hv] for t in range(D)]
    kqs = [jnp.sum(ks[t] * qs[t], axis=1) for t in range(D)] if one_pass else None  # [1]

    for t in range(D):
        Sd = mul(S, alphas[t])
        if one_pass:
            sq = jnp.sum(Sd * qs[t], axis=1)
        u = betas[t] * (vv[t] - jnp.sum(Sd * ks[t], axis=1))
        S = fma(ks[t], u[:, None], Sd)
        o = sq + u * kqs[t] if one_pass else jnp.sum(S * qs[t], axis=1)
        o_ref[n, t, hv, vs] = o.astype(o_ref.dtype)
        if snapshots:
            _store_row(tape_ref, row, into, (row, t, hv, vs, slice(None)), S.astype(tape_ref.dtype))
        else:
            _store_row(tape_ref, row, into, (row, t, hv, vs), u)


def _store_row(ref, row, into: bool, idx, value):
    if not into:  # rows are the requests themselves
        ref[idx] = value
        return

    @pl.when((row >= 0) & (row < ref.shape[0]))  # out-of-range rows write nothing
    def _():
        ref[idx] = value


@functools.partial(jax.jit, static_argnames=("record", "scale", "out_dtype", "config", "form", "interpret"))
def verify(
    state0, q, k, v, a, b, A_log, dt_bias, *, record, scale, out_dtype, config=VerifyConfig(), form, interpret,
    rows=None, tape=None,
):  # fmt: skip
    """See :func:`gdn_lossless_jax.verify`.

    With ``tape`` (a ``Tuples`` or ``Snapshots`` buffer of R >= N rows and Dmax >= D
    steps) and ``rows`` ``[N]``, request n's tape goes to row ``rows[n]`` of that buffer,
    in place (aliased; donate it under jit); steps ``>= D`` and other rows keep their
    contents. Returns ``(outputs, tape fields)``.
    """
    from jax.experimental.pallas import triton as plgpu

    from ...tape import Snapshots, Tuples

    N, HV, V, K = state0.shape
    D, H = q.shape[1], q.shape[2]
    cfg = config.fit(V)
    if V % cfg.block_v:
        raise ValueError(f"pallas verify: V={V} must be a multiple of block_v={cfg.block_v}")
    snapshots = record == "snapshots"
    qn, kn, g, beta = prepare(q, k, a, b, A_log, dt_bias, scale)
    into = tape is not None
    inputs = [state0, qn, kn, v, g, beta]
    out_shape = [jax.ShapeDtypeStruct((N, D, HV, V), out_dtype)]
    aliases = {}
    if into:
        buf = tape.states if snapshots else tape.u
        inputs += [rows, buf]
        out_shape.append(jax.ShapeDtypeStruct(buf.shape, buf.dtype))
        aliases = {7: 1}
    elif snapshots:
        out_shape.append(jax.ShapeDtypeStruct((N, D, HV, V, K), state0.dtype))
    else:
        out_shape.append(jax.ShapeDtypeStruct((N, D, HV, V), F32))
    kernel = functools.partial(
        _kernel, D=D, r=HV // H, BV=cfg.block_v, snapshots=snapshots, form=form, into=into,
        row_vectors=cfg.row_vectors, one_pass=cfg.one_pass,
    )  # fmt: skip
    outputs, rec = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(N, HV, V // cfg.block_v),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"gdn_verify_{record}",
    )(*inputs)
    if snapshots:
        return outputs, Snapshots(rec)
    if into:
        ok = (rows >= 0) & (rows < tape.k.shape[0])
        idx = jnp.where(ok, rows, tape.k.shape[0])  # out-of-range rows: dropped (negative would wrap)
        kbuf = tape.k.at[idx, :D].set(kn, mode="drop")
        gbuf = tape.g.at[idx, :D].set(g, mode="drop")
        return outputs, Tuples(rec, kbuf, gbuf)
    return outputs, Tuples(rec, kn, g)
