"""Verify as one Triton kernel, called through jax-triton.

Grid ``(V tiles, HV, N)``: each program holds a ``[BV, K]`` fp32 tile of one request's
state for one v-head (loaded from ``state0 [N, HV, V, K]``, bf16 upcast), loads all D
steps' inputs first, computes the gates and the q/k l2 norms outside the chain, then walks
the D steps in registers (SPEC section 2)::

    alpha = exp(g_t)
    Sd    = S * alpha                      # a plain multiply: Sd has two uses
    u     = beta_t * (v_t - sum_k Sd * k_t)
    S     = fma(k_t, u, Sd)                # explicit: fp fusion would fuse the other product
    o_t   = sum_k S * q_t

One kernel body and one launch configuration serve both record modes (the constexpr
``SNAPSHOTS`` only chooses what is stored), so the outputs are identical by construction
(scripts/triton_interpret_check.py checks that the two variants' TTGIR carry the same
arithmetic in the same layouts). The wrapper launches with fp fusion off (``_lang.py``).
``record="snapshots"`` stores the state after every step (``[N, D, HV, V, K]``, state0's
dtype); ``record="tuples"`` stores ``u [N, D, HV, V]``, the normalised ``k [N, D, H, K]``
(written once per ``(n, h)``: by the program of the group's first v-head and V tile 0)
and ``g [N, D, HV]`` (once per ``(n, hv)``, V tile 0), all fp32. The outputs the mode does
not use are one-element placeholders that the kernel never touches.

JAX is imported inside the wrappers only, so that the kernels also load where the Triton
interpreter checks them without JAX (``scripts/triton_interpret_check.py``).
"""

from __future__ import annotations

import dataclasses
import functools

from ._lang import exp as _exp
from ._lang import fma as _fma
from ._lang import from_f32 as _from_f32
from ._lang import jit, next_power_of_2, tl
from ._lang import log as _log
from ._lang import to_f32 as _to_f32

__all__ = ["VerifyConfig", "verify", "verify_kernel", "launch_sizes"]


@dataclasses.dataclass(frozen=True)
class VerifyConfig:
    """Launch parameters of the verify kernel (the same for both record modes).

    Attributes:
      block_v: V rows per program (a power of two; capped at V rounded up to one).
      num_warps, num_stages: Triton launch parameters.
    """

    block_v: int = 32
    num_warps: int = 4
    num_stages: int = 2


@jit
def _row(x, rows, t):
    """Row ``t`` of a ``[BD, X]`` register tile, exactly (``x + -0.0 == x`` keeps every bit)."""
    return tl.sum(tl.where(rows[:, None] == t, x, -0.0), axis=0)


@jit
def _elem(x, idx, t):
    """Element ``t`` of a ``[BD]`` register vector, exactly."""
    return tl.sum(tl.where(idx == t, x, -0.0), axis=0)


@jit
def verify_kernel(
    # inputs
    state0_ptr,  # [N, HV, V, K] f32 | bf16
    q_ptr,  # [N, D, H, K]
    k_ptr,  # [N, D, H, K]
    v_ptr,  # [N, D, HV, V]
    a_ptr,  # [N, D, HV]
    b_ptr,  # [N, D, HV]
    A_log_ptr,  # [HV]
    dt_bias_ptr,  # [HV]
    # outputs
    out_ptr,  # [N, D, HV, V] out dtype
    snap_ptr,  # [N, D, HV, V, K] state dtype (SNAPSHOTS) | [1] placeholder
    u_ptr,  # [N, D, HV, V] f32 (tuples) | [1]
    kt_ptr,  # [N, D, H, K] f32 (tuples) | [1]
    g_ptr,  # [N, D, HV] f32 (tuples) | [1]
    # sizes and switches
    D: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    V: tl.constexpr,
    K: tl.constexpr,
    BD: tl.constexpr,
    BV: tl.constexpr,
    BK: tl.constexpr,
    SCALE: tl.constexpr,
    SNAPSHOTS: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    i_v = tl.program_id(0)
    hv = tl.program_id(1)
    n = tl.program_id(2).to(tl.int64)
    h = hv // (HV // H)

    steps = tl.arange(0, BD)
    offs_v = i_v * BV + tl.arange(0, BV)
    offs_k = tl.arange(0, BK)
    m_d = steps < D
    m_v = offs_v < V
    m_k = offs_k < K
    m_dk = m_d[:, None] & m_k[None, :]
    m_vk = m_v[:, None] & m_k[None, :]

    # --- everything outside the chain: inputs of all D steps, gates, norms -------------
    qk_off = ((n * D + steps[:, None]) * H + h) * K + offs_k[None, :]
    q = _to_f32(tl.load(q_ptr + qk_off, mask=m_dk, other=0.0), INTERPRET)  # [BD, BK]
    k = _to_f32(tl.load(k_ptr + qk_off, mask=m_dk, other=0.0), INTERPRET)
    v_off = ((n * D + steps[:, None]) * HV + hv) * V + offs_v[None, :]
    v = _to_f32(tl.load(v_ptr + v_off, mask=m_d[:, None] & m_v[None, :], other=0.0), INTERPRET)  # [BD, BV]
    ab_off = (n * D + steps) * HV + hv
    a = _to_f32(tl.load(a_ptr + ab_off, mask=m_d, other=0.0), INTERPRET)  # [BD]
    b = _to_f32(tl.load(b_ptr + ab_off, mask=m_d, other=0.0), INTERPRET)
    A_log = _to_f32(tl.load(A_log_ptr + hv), INTERPRET)
    dt_bias = _to_f32(tl.load(dt_bias_ptr + hv), INTERPRET)

    # The constants are reference.SOFTPLUS_THRESHOLD (20) and reference.L2NORM_EPS (1e-6)
    # (Triton kernels read no plain Python globals).
    x = a + dt_bias
    softplus = tl.where(x > 20.0, x, _log(1.0 + _exp(x, INTERPRET), INTERPRET))
    g = -_exp(A_log, INTERPRET) * softplus  # [BD]
    beta = tl.math.div_rn(tl.full([BD], 1.0, tl.float32), 1.0 + _exp(-b, INTERPRET))
    # Correctly rounded sqrt and division, as XLA computes them (Triton's defaults are approximate).
    q_norm = tl.math.sqrt_rn(tl.sum(q * q, axis=1) + 1e-6)
    k_norm = tl.math.sqrt_rn(tl.sum(k * k, axis=1) + 1e-6)
    q = tl.math.div_rn(q, tl.broadcast_to(q_norm[:, None], (BD, BK))) * SCALE
    k = tl.math.div_rn(k, tl.broadcast_to(k_norm[:, None], (BD, BK)))

    if not SNAPSHOTS:
        if i_v == 0:
            tl.store(g_ptr + ab_off, g, mask=m_d)
            if hv % (HV // H) == 0:
                tl.store(kt_ptr + qk_off, k, mask=m_dk)

    # --- the chain -----------------------------------------------------------------------
    s_off = (n * HV + hv) * V * K + offs_v[:, None] * K + offs_k[None, :]
    S = _to_f32(tl.load(state0_ptr + s_off, mask=m_vk, other=0.0), INTERPRET)  # [BV, BK]
    for t in tl.static_range(D):
        q_t = _row(q, steps, t)
        k_t = _row(k, steps, t)
        v_t = _row(v, steps, t)
        alpha = _exp(_elem(g, steps, t), INTERPRET)
        beta_t = _elem(beta, steps, t)

        Sd = S * alpha
        u = beta_t * (v_t - tl.sum(Sd * k_t[None, :], axis=1))  # [BV]
        S = _fma(tl.broadcast_to(k_t[None, :], (BV, BK)), tl.broadcast_to(u[:, None], (BV, BK)), Sd, INTERPRET)
        o = tl.sum(S * q_t[None, :], axis=1)

        step_v = ((n * D + t) * HV + hv) * V + offs_v
        tl.store(out_ptr + step_v, _from_f32(o, out_ptr.dtype.element_ty, INTERPRET), mask=m_v)
        if SNAPSHOTS:
            snap = snap_ptr + ((n * D + t) * HV + hv) * V * K + offs_v[:, None] * K + offs_k[None, :]
            tl.store(snap, _from_f32(S, snap_ptr.dtype.element_ty, INTERPRET), mask=m_vk)
        else:
            tl.store(u_ptr + step_v, u, mask=m_v)


def launch_sizes(state0_shape, q_shape, config: VerifyConfig) -> tuple[dict, tuple[int, int, int]]:
    """The kernel's constexpr sizes and its grid, from the shapes alone."""
    N, HV, V, K = state0_shape
    D, H = q_shape[1], q_shape[2]
    BV = min(next_power_of_2(config.block_v), next_power_of_2(V))
    sizes = dict(D=D, H=H, HV=HV, V=V, K=K, BD=next_power_of_2(D), BV=BV, BK=next_power_of_2(K))
    grid = (-(-V // BV), HV, N)
    return sizes, grid


@functools.cache
def _jitted():
    import jax

    return jax.jit(_verify, static_argnames=("record", "scale", "out_dtype", "config"))


def verify(state0, q, k, v, a, b, A_log, dt_bias, *, record, scale, out_dtype, config: VerifyConfig = VerifyConfig()):
    """jax-triton verify; arguments as :func:`gdn_lossless_jax.verify` (already checked).

    Returns ``(outputs [N, D, HV, V], fields)``: ``(states,)`` for ``record="snapshots"``,
    ``(u, k, g)`` for ``record="tuples"``.
    """
    return _jitted()(
        state0, q, k, v, a, b, A_log, dt_bias, record=record, scale=scale, out_dtype=out_dtype, config=config
    )


def _verify(state0, q, k, v, a, b, A_log, dt_bias, *, record, scale, out_dtype, config):
    import jax
    import jax.numpy as jnp
    import jax_triton as jt

    N, HV, V, K = state0.shape
    D, H = q.shape[1], q.shape[2]
    snapshots = record == "snapshots"
    f32 = jnp.float32
    unused = jax.ShapeDtypeStruct((1,), f32)
    out_shape = (
        jax.ShapeDtypeStruct((N, D, HV, V), out_dtype),
        jax.ShapeDtypeStruct((N, D, HV, V, K), state0.dtype) if snapshots else unused,
        unused if snapshots else jax.ShapeDtypeStruct((N, D, HV, V), f32),
        unused if snapshots else jax.ShapeDtypeStruct((N, D, H, K), f32),
        unused if snapshots else jax.ShapeDtypeStruct((N, D, HV), f32),
    )
    sizes, grid = launch_sizes(state0.shape, q.shape, config)
    out, snap, u, kt, g = jt.triton_call(
        state0, q, k, v, a, b, A_log, dt_bias,
        kernel=verify_kernel,
        out_shape=out_shape,
        grid=grid,
        enable_fp_fusion=False,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        name="gdn_verify",
        **sizes,
        SCALE=float(scale),
        SNAPSHOTS=snapshots,
        INTERPRET=False,
    )  # fmt: skip
    return out, ((snap,) if snapshots else (u, kt, g))
