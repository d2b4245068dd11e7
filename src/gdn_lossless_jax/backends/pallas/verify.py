"""Pallas (Triton backend) verify: one kernel body, one launch for both record modes.

Grid ``(N, HV, V // BV)``: one program per request, v-head and V tile, holding the
``[BV, K]`` fp32 state tile in registers for the whole chain. Designed for latency: every
input of all D steps is loaded, and the gates and q/k norms are computed, before the
serial chain starts; the chain itself is one decay multiply, one reduction over K, one
fma and one output reduction per step. ``k`` and ``g`` go to the tape once per (request,
q/k head) and (request, v-head): only V tile 0 (and the group's first v-head for k)
writes them. The per-request pitch of the tape comes from the output buffer's shape.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ...reference import L2NORM_EPS, SOFTPLUS_THRESHOLD
from .rounding import ops as rounding_ops

__all__ = ["VerifyConfig", "verify"]

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class VerifyConfig:
    """Launch configuration (the same for both record modes, so outputs agree by construction)."""

    block_v: int = 32
    num_warps: int = 4
    num_stages: int = 1

    def fit(self, V: int) -> "VerifyConfig":
        return dataclasses.replace(self, block_v=min(self.block_v, V))


def _kernel(*refs, D: int, r: int, BV: int, scale: float, snapshots: bool, form: str, into: bool):
    # inputs: state, q, k, v, a, b, A_log, dt_bias[, rows, *tape buffers (aliased)]
    # outputs: o, *tape
    state_ref, q_ref, k_ref, v_ref, a_ref, b_ref, alog_ref, dtb_ref = refs[:8]
    n_tape = 1 if snapshots else 3
    rows_ref = refs[8] if into else None
    o_ref, *tape_refs = refs[-1 - n_tape :]
    mul, fma = rounding_ops(form)
    n, hv, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    row = rows_ref[n] if into else n
    h = hv // r
    vs = pl.ds(j * BV, BV)

    # Everything the chain needs, loaded and prepared before it starts.
    S = state_ref[n, hv, vs, :].astype(F32)  # [BV, K]
    A = jnp.exp(alog_ref[hv].astype(F32))
    dtb = dtb_ref[hv].astype(F32)
    qs, ks, vv, gs, betas = [], [], [], [], []
    for t in range(D):
        q = q_ref[n, t, h, :].astype(F32)
        k = k_ref[n, t, h, :].astype(F32)
        qs.append(q / jnp.sqrt(jnp.sum(q * q) + L2NORM_EPS) * scale)
        ks.append(k / jnp.sqrt(jnp.sum(k * k) + L2NORM_EPS))
        vv.append(v_ref[n, t, hv, vs].astype(F32))
        x = a_ref[n, t, hv].astype(F32) + dtb
        sp = jnp.where(x > SOFTPLUS_THRESHOLD, x, jnp.log(1.0 + jnp.exp(x)))
        gs.append(-A * sp)
        betas.append(1.0 / (1.0 + jnp.exp(-b_ref[n, t, hv].astype(F32))))

    for t in range(D):
        alpha = jnp.exp(gs[t])
        Sd = mul(S, alpha)
        u = betas[t] * (vv[t] - jnp.sum(Sd * ks[t][None, :], axis=1))
        S = fma(ks[t][None, :], u[:, None], Sd)
        o_ref[n, t, hv, vs] = jnp.sum(S * qs[t][None, :], axis=1).astype(o_ref.dtype)
        if snapshots:
            (snap_ref,) = tape_refs
            snap_ref[row, t, hv, vs, :] = S.astype(snap_ref.dtype)
        else:
            tape_refs[0][row, t, hv, vs] = u

    if not snapshots:
        _, k_out, g_out = tape_refs

        @pl.when(j == 0)
        def _():
            for t in range(D):
                g_out[row, pl.ds(t, 1), hv] = jnp.full((1,), gs[t], F32)

        @pl.when((j == 0) & (hv % r == 0))
        def _():
            for t in range(D):
                k_out[row, t, h, :] = ks[t]


@functools.partial(jax.jit, static_argnames=("record", "scale", "out_dtype", "config", "form", "interpret"))
def verify(
    state0, q, k, v, a, b, A_log, dt_bias, *, record, scale, out_dtype, config=VerifyConfig(), form, interpret,
    rows=None, tape=None,
):  # fmt: skip
    """See :func:`gdn_lossless_jax.verify`.

    With ``tape`` (a ``Tuples`` or ``Snapshots`` buffer of R >= N rows and Dmax >= D
    steps) and ``rows`` ``[N]``, request n's tape goes to row ``rows[n]`` of that buffer,
    in place (aliased; donate it under jit); the per-request pitch is the buffer's. Steps
    ``>= D`` and other rows keep their contents. Returns ``(outputs, tape fields)``.
    """
    from jax.experimental.pallas import triton as plgpu

    N, HV, V, K = state0.shape
    D, H = q.shape[1], q.shape[2]
    cfg = config.fit(V)
    if V % cfg.block_v:
        raise ValueError(f"pallas verify: V={V} must be a multiple of block_v={cfg.block_v}")
    snapshots = record == "snapshots"
    into = tape is not None
    inputs = [state0, q, k, v, a, b, A_log, dt_bias]
    out_shape = [jax.ShapeDtypeStruct((N, D, HV, V), out_dtype)]
    if into:
        buffers = list(jax.tree.leaves(tape))
        inputs += [rows, *buffers]
        out_shape += [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in buffers]
        aliases = {9 + i: 1 + i for i in range(len(buffers))}
    elif snapshots:
        out_shape.append(jax.ShapeDtypeStruct((N, D, HV, V, K), state0.dtype))
        aliases = {}
    else:
        out_shape += [
            jax.ShapeDtypeStruct((N, D, HV, V), F32),
            jax.ShapeDtypeStruct((N, D, H, K), F32),
            jax.ShapeDtypeStruct((N, D, HV), F32),
        ]
        aliases = {}
    kernel = functools.partial(
        _kernel, D=D, r=HV // H, BV=cfg.block_v, scale=scale, snapshots=snapshots, form=form, into=into
    )
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(N, HV, V // cfg.block_v),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"gdn_verify_{record}",
    )(*inputs)
    return outs[0], tuple(outs[1:])
