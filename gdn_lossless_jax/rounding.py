"""The rounding rule of the library, and the forms that break it (kept as controls).

The rule (steps 3 and 5 of the GDN step in :mod:`gdn_lossless_jax.reference`) for one GDN
state update is::

    Sd = rn(S * exp(g))          # one separately rounded multiply (Sd has two uses)
    S' = fma(k, u, Sd)           # one fused multiply-add, one rounding

Verify computes exactly this, and replay recomputes it from ``(u, k, g)``; if both use
the same ``exp`` and both operations round as stated, the replayed state equals the
snapshot bit for bit. Nothing may rely on what a compiler happens to do with
``S * alpha + k * u`` written plainly: XLA:CPU contracts it into an FMA (and flushes
subnormals to zero), XLA:GPU never contracts, Triton with fp fusion contracts the other
product. So every form here is pinned:

* :func:`fma_rn`, :func:`mul_rn` and :func:`add_rn` are *portable*: they compute the
  correctly rounded fp32 results from integer operations on the bit patterns (unsigned
  32-bit arithmetic, shifts, ``clz``), so no compiler can contract, reassociate or flush
  them. They keep subnormals (as the GPU does), work with x64 off, and lower in XLA on any
  platform, in Pallas interpret mode and in Pallas Triton. On CUDA they are bit-identical
  to ``mul.rn.f32`` / ``fma.rn.f32`` (tested on a CUDA GPU).
* All three are differentiable (``jax.custom_jvp``): the derivative is that of the exact
  operation they round (``a * b + c``, ``x * y``, ``x + y``), never the silent zero that
  autodiff would find through the integer bit manipulation.
* :func:`apply_rule` is the rule itself, written once and used by verify, replay and
  every backend (backends may pass hardware instructions for ``mul``/``fma``).
* The forms the rule must *not* be (the controls a bit-exactness test must catch) are in
  :mod:`gdn_lossless_jax.testing.controls`.

All functions take and return float32 arrays (they broadcast like ``jnp`` ops).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _deprecated

__all__ = [
    "exp",
    "log",
    "fma_rn",
    "mul_rn",
    "add_rn",
    "apply_rule",
    "decay_factor",
]

_U32 = jnp.uint32
_I32 = jnp.int32
_CANONICAL_NAN = 0x7FFFFFFF  # what fma.rn.f32 returns for a NaN result


# ---------------------------------------------------------------------------------
# 32-bit helpers. Shift amounts are clamped and selected, never >= 32: XLA defines
# such shifts, but LLVM (and so Triton) makes them poison.
# ---------------------------------------------------------------------------------
def _u(x):
    return jnp.asarray(x, _U32)


def _shl32(x, s):
    s = s.astype(_I32)
    return jnp.where(s >= 32, _u(0), lax.shift_left(x, jnp.clip(s, 0, 31).astype(_U32)))


def _shr32(x, s):
    s = s.astype(_I32)
    return jnp.where(s >= 32, _u(0), lax.shift_right_logical(x, jnp.clip(s, 0, 31).astype(_U32)))


def _low_mask(s):
    """Bits below position s (s >= 0): 2**s - 1, all ones for s >= 32."""
    return _shl32(jnp.ones_like(s, _U32), s) - _u(1)


def _clz32(x):
    # On int32: Pallas Triton lowers clz of int32 to __nv_clz; of uint32 it fails.
    return lax.clz(lax.bitcast_convert_type(x, _I32))


def _clz64(hi, lo):
    return jnp.where(hi != 0, _clz32(hi), 32 + _clz32(lo))


def _shl64(hi, lo, n):
    """(hi, lo) << n for 0 <= n <= 63 (no bit is lost by the callers)."""
    small = n < 32
    hi_s = _shl32(hi, n) | _shr32(lo, 32 - n)
    lo_s = _shl32(lo, n)
    hi_b = _shl32(lo, n - 32)
    return jnp.where(small, hi_s, hi_b), jnp.where(small, lo_s, _u(0))


def _shr64_sticky(hi, lo, n):
    """(hi, lo) >> n for n >= 0, OR-ing every bit shifted out into bit 0 (sticky)."""
    small = n < 32
    lo_s = _shr32(lo, n) | _shl32(hi, 32 - n)
    hi_s = _shr32(hi, n)
    lost_s = lo & _low_mask(n)
    m = n - 32
    lo_b = _shr32(hi, m)
    lost_b = lo | (hi & _low_mask(jnp.maximum(m, 0)))
    new_hi = jnp.where(small, hi_s, _u(0))
    new_lo = jnp.where(small, lo_s, lo_b)
    lost = jnp.where(small, lost_s, lost_b)
    return new_hi, new_lo | (lost != 0).astype(_U32)


def _add64(ahi, alo, bhi, blo):
    lo = alo + blo
    return ahi + bhi + (lo < alo).astype(_U32), lo


def _sub64(ahi, alo, bhi, blo):
    """a - b for a >= b."""
    return ahi - bhi - (alo < blo).astype(_U32), alo - blo


def _lt64(ahi, alo, bhi, blo):
    return (ahi < bhi) | ((ahi == bhi) & (alo < blo))


def _mul32x32(x, y):
    """Full 64-bit product of two uint32 as (hi, lo), from 16-bit limbs."""
    m16 = _u(0xFFFF)
    x0, x1 = x & m16, lax.shift_right_logical(x, _u(16))
    y0, y1 = y & m16, lax.shift_right_logical(y, _u(16))
    ll, lh, hl, hh = x0 * y0, x0 * y1, x1 * y0, x1 * y1
    mid = lh + hl
    mid_carry = (mid < lh).astype(_U32)
    lo = ll + lax.shift_left(mid, _u(16))
    carry = (lo < ll).astype(_U32)
    hi = hh + lax.shift_right_logical(mid, _u(16)) + lax.shift_left(mid_carry, _u(16)) + carry
    return hi, lo


def _unpack(bits):
    """Sign, effective biased exponent E >= 1 and integer significand m: |x| = m * 2**(E-150)."""
    sign = lax.shift_right_logical(bits, _u(31))
    e = (lax.shift_right_logical(bits, _u(23)) & _u(0xFF)).astype(_I32)
    f = bits & _u(0x7FFFFF)
    m = jnp.where(e == 0, f, f | _u(0x800000))
    return sign, e, jnp.maximum(e, 1), m


def _bits(x):
    if isinstance(x, (int, float, np.generic, np.ndarray)) or (
        isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
    ):
        # A constant: take its bits now (Pallas Triton cannot bitcast a literal).
        return jnp.asarray(np.asarray(x, np.float32).view(np.uint32))
    return lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), _U32)


def _float(bits):
    return lax.bitcast_convert_type(bits, jnp.float32)


# ---------------------------------------------------------------------------------
# The exactly rounded fused multiply-add, from integer operations.
# ---------------------------------------------------------------------------------
def _fma_rn(a, b, c):
    """``rn(a * b + c)`` from integer operations; see :func:`fma_rn` (this one has no derivative).

    Portable and compiler-proof: the product is formed exactly as a 48-bit integer, the
    sum in a 64-bit (two-word) fixed-point accumulator with a sticky bit, and the result
    is rounded once. Subnormal inputs and results are kept; overflow gives infinity;
    NaN results are the canonical NaN ``0x7FFFFFFF`` (as ``fma.rn.f32`` returns).

    Args:
      a, b, c: float32 arrays (broadcastable to a common shape).
    Returns:
      float32 array of the broadcast shape.

    ``a * a`` is ``1 + 2**-11 + 2**-24`` exactly below; one rounding keeps the ``2**-24`` that a
    rounded product loses:

    >>> import numpy as np
    >>> a, c = np.float32(1 + 2**-12), np.float32(-(1 + 2**-11))
    >>> float(fma_rn(a, a, c)) == 2**-24, float(add_rn(mul_rn(a, a), c))
    (True, 0.0)
    """
    ua, ub, uc = _bits(a), _bits(b), _bits(c)
    ua, ub, uc = jnp.broadcast_arrays(ua, ub, uc)
    sa, ea, Ea, ma = _unpack(ua)
    sb, eb, Eb, mb = _unpack(ub)
    sc, ec, Ec, mc = _unpack(uc)
    sp = sa ^ sb

    # Exact product P * 2**(Ea + Eb - 300), normalised so that its top bit is bit 62
    # (bit 63 is left free for the carry of the addition).
    phi, plo = _mul32x32(ma, mb)
    p_zero = (phi | plo) == 0
    p_shift = jnp.where(p_zero, 0, _clz64(phi, plo) - 1)
    phi, plo = _shl64(phi, plo, p_shift)
    exp_p = Ea + Eb - 300 - p_shift

    c_zero = mc == 0
    c_shift = jnp.where(c_zero, 0, _clz64(jnp.zeros_like(mc), mc) - 1)
    chi, clo = _shl64(jnp.zeros_like(mc), mc, c_shift)
    # A zero addend is placed so far below the product that it shifts out entirely.
    exp_c = jnp.where(c_zero, -100000, Ec - 150 - c_shift)

    p_big = (exp_p > exp_c) | ((exp_p == exp_c) & ~_lt64(phi, plo, chi, clo))
    bhi, blo = jnp.where(p_big, phi, chi), jnp.where(p_big, plo, clo)
    shi, slo = jnp.where(p_big, chi, phi), jnp.where(p_big, clo, plo)
    e_big = jnp.where(p_big, exp_p, exp_c)
    sign = jnp.where(p_big, sp, sc)
    d = e_big - jnp.where(p_big, exp_c, exp_p)
    shi, slo = _shr64_sticky(shi, slo, d)

    same = sp == sc
    ahi, alo = _add64(bhi, blo, shi, slo)
    dhi, dlo = _sub64(bhi, blo, shi, slo)
    rhi, rlo = jnp.where(same, ahi, dhi), jnp.where(same, alo, dlo)
    r_zero = (rhi | rlo) == 0

    # Normalise to the top bit at 63: value = R * 2**er. Sticky bits only exist when the
    # operands were >= 2 binades apart, and then at most 2 bits of cancellation occur, so
    # the sticky bit always stays far below the rounding position (bit 39).
    lz = jnp.where(r_zero, 0, _clz64(rhi, rlo))
    rhi, rlo = _shl64(rhi, rlo, lz)
    E = e_big - lz + 190  # biased exponent of the top 24 bits
    E_use = jnp.maximum(E, 1)
    rhi, rlo = _shr64_sticky(rhi, rlo, E_use - E)  # subnormal results: denormalise
    mant = lax.shift_right_logical(rhi, _u(8))
    rbit = lax.shift_right_logical(rhi, _u(7)) & _u(1)
    sticky = ((rhi & _u(0x7F)) | rlo) != 0
    inc = rbit & (sticky.astype(_U32) | (mant & _u(1)))
    # (E - 1) << 23 plus a significand that carries its implicit bit: a rounding carry
    # moves into the exponent field by itself (and up to infinity at the top).
    mag = lax.shift_left((E_use - 1).astype(_U32), _u(23)) + mant + inc
    mag = jnp.where(E >= 255, _u(0x7F800000), mag)
    out = mag | lax.shift_left(sign, _u(31))
    out = jnp.where(r_zero, _u(0), out)  # exact cancellation rounds to +0

    # Zero product: the result is c, except that -0 needs both the product and c to be -0.
    out = jnp.where(p_zero & c_zero, lax.shift_left(sp & sc, _u(31)), out)
    out = jnp.where(p_zero & ~c_zero, uc, out)

    # Infinities and NaNs, decided on the bit patterns (XLA:CPU treats subnormal floats
    # as zero, so ``inf * subnormal`` in float arithmetic would wrongly give NaN there).
    frac_a, frac_b, frac_c = ua & _u(0x7FFFFF), ub & _u(0x7FFFFF), uc & _u(0x7FFFFF)
    a_nan, b_nan, c_nan = (ea == 255) & (frac_a != 0), (eb == 255) & (frac_b != 0), (ec == 255) & (frac_c != 0)
    a_inf, b_inf, c_inf = (ea == 255) & ~a_nan, (eb == 255) & ~b_nan, (ec == 255) & ~c_nan
    a_zero, b_zero = (ua & _u(0x7FFFFFFF)) == 0, (ub & _u(0x7FFFFFFF)) == 0
    p_inf = a_inf | b_inf
    is_nan = (
        a_nan | b_nan | c_nan | (a_inf & b_zero) | (b_inf & a_zero) | (p_inf & c_inf & (sp != sc))
    )
    out = jnp.where(c_inf & ~p_inf, uc, out)
    out = jnp.where(p_inf, _u(0x7F800000) | lax.shift_left(sp, _u(31)), out)
    out = jnp.where(is_nan, _u(_CANONICAL_NAN), out)
    return _float(out)


def _mul_rn(x, y):
    # -0.0 is the additive identity that also keeps the sign of a zero product.
    return _fma_rn(x, y, np.float32(-0.0))


def _add_rn(x, y):
    return _fma_rn(x, np.float32(1.0), y)


# ---------------------------------------------------------------------------------
# The public primitives: the exact values above, with the derivatives of the exact
# operations they round (``a*b + c``, ``x*y``, ``x+y``). The bit manipulation inside has
# no useful derivative (a bitcast to an integer is a constant to autodiff, so it would
# give a silent zero). Kernels call the underscored functions: a kernel is never
# differentiated (gdn_lossless_jax.autodiff gives verify, replay and commit their
# derivatives), and its lowering stays as it was (Pallas Triton's lowering of a
# custom_jvp call rejects a body with closed-over constants).
# ---------------------------------------------------------------------------------
def _f32_tangent(t, shape):
    """A tangent as float32 of the result's shape (a float0 tangent of an integer input is 0)."""
    if jax.dtypes.issubdtype(jnp.result_type(t), jax.dtypes.float0):
        return jnp.zeros(shape, jnp.float32)
    return jnp.broadcast_to(jnp.asarray(t, jnp.float32), shape)


def _f32(x):
    return jnp.asarray(x, jnp.float32)


@jax.custom_jvp
def fma_rn(a, b, c):
    """``rn(a * b + c)`` in float32 with one rounding (round to nearest even).

    Portable and compiler-proof: the product is formed exactly as a 48-bit integer, the
    sum in a 64-bit (two-word) fixed-point accumulator with a sticky bit, and the result
    is rounded once. Subnormal inputs and results are kept; overflow gives infinity;
    NaN results are the canonical NaN ``0x7FFFFFFF`` (as ``fma.rn.f32`` returns).
    Differentiable: the derivative is that of ``a * b + c`` (``jax.grad``, ``jax.jvp``).

    Args:
      a, b, c: float32 arrays (broadcastable to a common shape).
    Returns:
      float32 array of the broadcast shape.
    """
    return _fma_rn(a, b, c)


@fma_rn.defjvp
def _fma_rn_jvp(primals, tangents):
    out = fma_rn(*primals)
    a, b, _ = (_f32(x) for x in primals)
    da, db, dc = (_f32_tangent(t, out.shape) for t in tangents)
    return out, da * b + a * db + dc


@jax.custom_jvp
def mul_rn(x, y):
    """``rn(x * y)`` in float32, keeping subnormals (``fma_rn(x, y, -0.0)``).

    A plain ``x * y`` is not enough on XLA:CPU, which flushes subnormal products and
    inputs to zero; the GPU keeps them. Differentiable: the derivative is that of ``x * y``.
    """
    return _mul_rn(x, y)


@mul_rn.defjvp
def _mul_rn_jvp(primals, tangents):
    out = mul_rn(*primals)
    x, y = (_f32(v) for v in primals)
    dx, dy = (_f32_tangent(t, out.shape) for t in tangents)
    return out, dx * y + x * dy


@jax.custom_jvp
def add_rn(x, y):
    """``rn(x + y)`` in float32, pinned (``fma_rn(x, 1, y)``): no product to contract.

    Differentiable: the derivative is that of ``x + y``.
    """
    return _add_rn(x, y)


@add_rn.defjvp
def _add_rn_jvp(primals, tangents):
    out = add_rn(*primals)
    dx, dy = (_f32_tangent(t, out.shape) for t in tangents)
    return out, dx + dy


# ---------------------------------------------------------------------------------
# exp and log: one function per platform, wherever they are computed.
# ---------------------------------------------------------------------------------
def _float64_scope():
    try:
        from jax import enable_x64
    except ImportError:  # older JAX: the experimental name
        from jax.experimental import enable_x64
    return enable_x64(True)


def _through_float64(fn, x):
    x = jnp.asarray(x)
    if x.dtype == jnp.float64:  # float64 in (x64 on: the plain formulation's checks), float64 out
        return fn(x)
    x = x.astype(jnp.float32)
    if jax.default_backend() != "cpu":
        return fn(x)
    with _float64_scope():
        return fn(x.astype(jnp.float64)).astype(jnp.float32)


def exp(x):
    """``exp`` in float32 that gives the same bits for the same input wherever it is computed.

    The replay recomputes the decay ``exp(g)`` that verify used, so both must call one and the
    same function. XLA:CPU's float32 ``exp`` is not one: its result depends on where an element
    falls in the vectorised loop XLA compiled (inside a ``lax.scan`` over 17 requests, 32 of 136
    decays came out 1 ULP off the same ``exp`` over the whole array, jax 0.12; 8 positions of 1,000
    in jax 0.11.2), and a batched replay then missed the snapshots. On the CPU it is therefore
    computed in float64 and rounded once (the correctly rounded float32 exp except within 2**-52
    of a rounding boundary, where the float64 result would have to differ by an ULP of its own);
    on a GPU, XLA's and the kernels' ``exp`` are libdevice's, the same function everywhere.
    """
    return _through_float64(jnp.exp, x)


def log(x):
    """``log`` in float32, the same function everywhere (see :func:`exp`)."""
    return _through_float64(jnp.log, x)


# ---------------------------------------------------------------------------------
# The rule, and the forms it must not be.
# ---------------------------------------------------------------------------------
Op = Callable[..., jnp.ndarray]


def decay(S, alpha, *, mul: Op = mul_rn):
    """``Sd = rn(S * alpha)``: the decayed state; ``alpha`` broadcasts over ``S``."""
    return mul(S, alpha)


def update(Sd, k, u, *, fma: Op = fma_rn):
    """``S'[v, k] = fma(k[k], u[v], Sd[v, k])`` for ``Sd [..., V, K]``, ``k [..., K]``, ``u [..., V]``."""
    return fma(k[..., None, :], u[..., :, None], Sd)


def decay_factor(S, alpha):
    """``alpha`` shaped to multiply the state ``S [..., V, K]`` elementwise, by its rank.

    ``alpha [...]`` (two axes fewer than S): one decay per state, GDN's, broadcast over V and K.
    ``alpha [..., K]`` (one axis fewer): one decay per key channel, KDA's (:mod:`gdn_lossless_jax.kda`),
    broadcast over the V rows: element ``[v, c]`` decays by ``alpha[c]``. The shapes of a tape
    tell which (``g [..., HV]`` or ``[..., HV, K]``), so the rule and every form below take either.
    """
    if jnp.ndim(alpha) == jnp.ndim(S) - 1:
        return jnp.expand_dims(alpha, -2)
    return alpha[..., None, None]


def apply_rule(S, alpha, k, u, *, mul: Op = mul_rn, fma: Op = fma_rn):
    """One replayed state update: ``fma(k, u, rn(S * alpha))``.

    Args:
      S: ``[..., V, K]`` float32 state.
      alpha: float32 decay ``exp(g)``: ``[...]`` (GDN: broadcast over V and K) or ``[..., K]`` (KDA:
        one per key channel, broadcast over V; :func:`decay_factor`).
      k: ``[..., K]`` float32 l2-normalised key.
      u: ``[..., V]`` float32 ``beta * (v - Sd @ k)``.
    """
    return update(decay(S, decay_factor(S, alpha), mul=mul), k, u, fma=fma)


__getattr__ = _deprecated.alias(__name__, {
    name: f"gdn_lossless_jax.testing.controls:{name}"
    for name in ("naive_update", "twice_rounded_update", "other_product_update", "FORMS")
})  # fmt: skip
