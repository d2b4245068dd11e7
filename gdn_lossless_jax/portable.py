"""Portable float32 math: the same bits on every platform, from correctly rounded operations only.

The functions here (:func:`exp`, :func:`log`, :func:`softplus`, :func:`sigmoid`, :func:`div`,
:func:`sqrt`, :func:`pairwise_sum`, :func:`l2norm`) are what ``math="portable"`` verifies with
(:func:`gdn_lossless_jax.verify`): each is a fixed sequence of IEEE 754 operations that round
exactly (add, multiply, fma, division, square root, round-to-integral) and of exponent bit
manipulation for the ``2**n`` scaling, so any platform that implements those operations as IEEE
754 says (round to nearest even, subnormals kept) computes the same bits. No ``jnp.exp``,
``jnp.log``, ``rsqrt`` or approximate reciprocal is called.

In XLA every arithmetic operation goes through the integer emulations of
:mod:`gdn_lossless_jax.rounding` (``fma_rn``, ``mul_rn``, ``add_rn``) and this module's
:func:`div` and :func:`sqrt` (correctly rounded from 32-bit integer division and a digit-by-digit
square root): XLA promises neither that it will not contract a multiply and an add (XLA:CPU does,
under ``jit``), nor that it keeps subnormals (XLA:CPU flushes them), nor a correctly rounded
float32 division (XLA:GPU's differed from ``div.rn.f32`` by an ULP). Integer arithmetic leaves a
compiler nothing to choose. A GPU kernel may call the hardware's ``fma.rn``/``mul.rn``/
``add.rn``/``div.rn``/``sqrt.rn`` instead: they round the same, so they give the same bits.

Accuracy against float64 (docs/design.md, "Portable mode", has the full sweeps of
``python -m gdn_lossless_jax.tools.accuracy``; ``tests/test_portable.py`` checks samples):

* :func:`exp`: within 0.52 ULP where the result is normal, correctly rounded on all but
  ~0.1% of inputs; within 0.76 ULP where the result is subnormal (below ``exp(-87.34)``).
* :func:`log`: within 0.89 ULP (fdlibm's ``logf`` algorithm, in float32 throughout).
* :func:`div`, :func:`sqrt`: correctly rounded (0 ULP), subnormals included.

Special values: ``exp(nan) = nan``, ``exp(inf) = inf``, ``exp(-inf) = 0``, overflow to inf above
88.72, underflow to 0 below -103.98; ``log(0) = -inf``, ``log(x < 0) = nan``, ``log(inf) = inf``.
Every NaN a function here returns is the canonical ``0x7FFFFFFF`` (what ``fma.rn.f32`` gives), so
NaNs compare equal bit for bit too.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from . import rounding
from .rounding import _bits, _clz32, _float, _fma_rn, _shr32, _u

__all__ = ["exp", "log", "softplus", "sigmoid", "gates", "div", "sqrt", "neg", "pairwise_sum", "dot", "l2norm",
           "to_float32", "SOFTPLUS_THRESHOLD"]

F32 = jnp.float32
_I32 = jnp.int32
_NAN = 0x7FFFFFFF
SOFTPLUS_THRESHOLD = 20.0


def _f(v) -> np.float32:
    return np.float32(v)


def _mul(x, y):
    return _fma_rn(x, y, _f(-0.0))


def _add(x, y):
    return _fma_rn(x, _f(1.0), y)


def _neg(x):
    """``-x`` by flipping the sign bit (exact everywhere, NaNs included)."""
    return _float(_bits(x) ^ _u(0x80000000))


def _is_nan(x):
    b = _bits(x) & _u(0x7FFFFFFF)
    return b > _u(0x7F800000)


def _pow2(n):
    """``2.0**n`` for int32 ``n`` in ``[-126, 127]``, built from its exponent bits."""
    return _float(lax.shift_left((n + 127).astype(jnp.uint32), _u(23)))


def to_float32(x):
    """``x`` as float32, exactly: bfloat16 by shifting its bits (no conversion instruction that a
    platform might flush), other dtypes by ``astype`` (float16 and float32 convert exactly)."""
    x = jnp.asarray(x)
    if x.dtype == jnp.bfloat16:
        b16 = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
        return _float(lax.shift_left(b16, _u(16)))
    return x.astype(F32)


# ---------------------------------------------------------------------------------
# Rounding an integer significand: R * 2**e (R < 2**32) and a sticky bit, to float32.
# ---------------------------------------------------------------------------------
def _round_pack(sign, R, e, sticky):
    """The float32 nearest (ties to even) to ``(-1)**sign * (R + d) * 2**e``, ``0 <= d < 1`` and
    ``d > 0`` iff ``sticky``: subnormal results and overflow to infinity included. ``R > 0``."""
    lz = _clz32(R)
    R = lax.shift_left(R, lz.astype(jnp.uint32))  # top bit at 31
    E = e + 31 - lz + 127  # biased exponent of the top bit
    E_use = jnp.maximum(E, 1)
    sh = E_use - E  # subnormal: shift right, the bits shifted out go to sticky
    lost = R & (rounding._low_mask(sh))
    R = _shr32(R, sh)
    sticky = sticky | (lost != 0)
    mant = lax.shift_right_logical(R, _u(8))
    rbit = lax.shift_right_logical(R, _u(7)) & _u(1)
    st = ((R & _u(0x7F)) != 0) | sticky
    inc = rbit & (st.astype(jnp.uint32) | (mant & _u(1)))
    # (E - 1) << 23 plus a significand carrying its implicit bit: a carry moves into the exponent.
    mag = lax.shift_left((E_use - 1).astype(jnp.uint32), _u(23)) + mant + inc
    mag = jnp.where(E >= 255, _u(0x7F800000), mag)
    return _float(mag | lax.shift_left(sign.astype(jnp.uint32), _u(31)))


def _normalize(bits):
    """``(sign, m, e)`` with ``|x| = m * 2**e``, ``m`` in ``[2**23, 2**24)`` (finite, nonzero x)."""
    sign, e_field, E, m = rounding._unpack(bits)
    s = _clz32(m) - 8  # subnormals: shift the significand up to bit 23
    m = lax.shift_left(m, jnp.maximum(s, 0).astype(jnp.uint32))
    return sign, m, E - 150 - jnp.maximum(s, 0)


# ---------------------------------------------------------------------------------
# Division and square root, correctly rounded from integer operations.
# ---------------------------------------------------------------------------------
def div(x, y):
    """``x / y`` in float32, correctly rounded (ties to even), subnormals kept.

    The quotient of the 24-bit significands is formed by long division in 32-bit integers
    (27 quotient bits, the remainder as the sticky bit), then rounded once.

    >>> float(div(np.float32(1), np.float32(3))) == float(np.float32(1) / np.float32(3))
    True
    """
    bx, by = jnp.broadcast_arrays(_bits(x), _bits(y))
    sx, mx, ex = _normalize(bx)
    sy, my, ey = _normalize(by)
    q = mx // my
    r = mx - q * my
    for n in (8, 8, 8, 3):  # r < my < 2**24: r << 8 fits in 32 bits
        r = lax.shift_left(r, _u(n))
        d = r // my
        q = lax.shift_left(q, _u(n)) | d
        r = r - d * my
    out = _round_pack(sx ^ sy, q, ex - ey - 27, r != 0)
    # Special operands, decided on the bit patterns.
    ax, ay = bx & _u(0x7FFFFFFF), by & _u(0x7FFFFFFF)
    inf = _u(0x7F800000)
    sgn = lax.shift_left((sx ^ sy).astype(jnp.uint32), _u(31))
    nan = (ax > inf) | (ay > inf) | ((ax == 0) & (ay == 0)) | ((ax == inf) & (ay == inf))
    zero = (ax == 0) | (ay == inf)
    infinite = (ay == 0) | (ax == inf)
    outb = _bits(out)
    outb = jnp.where(zero, sgn, outb)
    outb = jnp.where(infinite, sgn | inf, outb)
    outb = jnp.where(nan, _u(_NAN), outb)
    return _float(outb)


def sqrt(x):
    """``sqrt(x)`` in float32, correctly rounded, subnormals kept (``sqrt(-0) = -0``; negative: NaN).

    A digit-by-digit integer square root of the significand (27 root bits, the remainder as the
    sticky bit), rounded once.
    """
    bx = _bits(x)
    _, m, e = _normalize(bx)
    odd = (e & 1) != 0
    m = jnp.where(odd, lax.shift_left(m, _u(1)), m)  # m in [2**23, 2**25), e even
    e = jnp.where(odd, e - 1, e)
    # root = floor(sqrt(m * 2**28)): the radicand's 54 bits, two at a time from the top.
    root = jnp.zeros_like(m)
    rem = jnp.zeros_like(m)
    for i in range(26, -1, -1):
        shift = 2 * i - 28  # the pair's position in m (negative: the appended zeros)
        pair = lax.shift_right_logical(m, _u(shift)) & _u(3) if shift >= 0 else jnp.zeros_like(m)
        rem = lax.shift_left(rem, _u(2)) | pair
        trial = lax.shift_left(root, _u(2)) | _u(1)
        ok = rem >= trial
        rem = jnp.where(ok, rem - trial, rem)
        root = lax.shift_left(root, _u(1)) | ok.astype(jnp.uint32)
    out = _bits(_round_pack(jnp.zeros_like(m), root, lax.shift_right_arithmetic(e, 1) - 14, rem != 0))
    a = bx & _u(0x7FFFFFFF)
    inf = _u(0x7F800000)
    neg = (lax.shift_right_logical(bx, _u(31)) != 0) & (a != 0)
    out = jnp.where(a == 0, bx, out)
    out = jnp.where(a == inf, bx, out)
    out = jnp.where((a > inf) | neg, _u(_NAN), out)
    return _float(out)


# ---------------------------------------------------------------------------------
# A straight-line program of correctly rounded operations, run as one loop.
#
# exp and log are ~30-40 operations each. Written out, each operation is a few hundred integer
# HLO operations (``_fma_rn``): ~20,000 lines of HLO for one exp, 15 s of XLA:CPU compile. As
# a program (an array of instructions run by ``lax.fori_loop``: each step reads its operands from
# a register file, computes every operation kind and keeps the instruction's) the loop body
# holds each emulation once, whatever the program's length. The bits are those of the same
# operations written out: an instruction is the same function of the same operands.
# ---------------------------------------------------------------------------------
_FMA, _ROUND, _DIV, _POW2, _MIN, _MAX = range(6)


class _Program:
    """A builder: registers are SSA values (the inputs first, then constants, then results)."""

    def __init__(self, n_inputs: int):
        self.n_inputs = n_inputs
        self.consts: list[float] = []
        self.code: list[tuple[int, int, int, int]] = []  # (op, a, b, c), operands as ("in"|"k"|"r", i)

    def const(self, v):
        v = _f(v)
        for i, c in enumerate(self.consts):
            if c.view(np.uint32) == v.view(np.uint32):
                return ("k", i)
        self.consts.append(v)
        return ("k", len(self.consts) - 1)

    def _op(self, op, a, b=None, c=None):
        z = self.const(0.0)
        self.code.append((op, a, b or z, c or z))
        return ("r", len(self.code) - 1)

    def inp(self, i):
        return ("in", i)

    def fma(self, a, b, c):
        return self._op(_FMA, a, b, c)

    def mul(self, a, b):
        return self.fma(a, b, self.const(-0.0))

    def add(self, a, b):
        return self.fma(a, self.const(1.0), b)

    def sub(self, a, b):
        return self.fma(b, self.const(-1.0), a)

    def neg(self, a):
        return self.fma(a, self.const(-1.0), self.const(-0.0))

    def round(self, a):
        return self._op(_ROUND, a)

    def div(self, a, b):
        return self._op(_DIV, a, b)

    def pow2(self, a):
        """``2**a`` for an integral ``a`` in ``[-126, 127]`` (exponent bits)."""
        return self._op(_POW2, a)

    def min(self, a, b):
        return self._op(_MIN, a, b)

    def max(self, a, b):
        return self._op(_MAX, a, b)

    def two_sum(self, a, b):
        """``(s, t)``: ``s = rn(a + b)``, ``s + t = a + b`` exactly (Knuth's TwoSum)."""
        s = self.add(a, b)
        bb = self.sub(s, a)
        return s, self.add(self.sub(a, self.sub(s, bb)), self.sub(b, bb))

    def run(self, inputs, outputs):
        """The program on ``inputs`` (float32 arrays of one shape); returns the ``outputs`` registers."""
        ni, nk = self.n_inputs, len(self.consts)
        shape = inputs[0].shape
        base = {"in": 0, "k": ni, "r": ni + nk}
        idx = lambda r: base[r[0]] + r[1]  # noqa: E731
        assert ni + nk + len(self.code) < 256
        # Each instruction packed in one int, looked up by a chain of selects on the step: no
        # array constant (a Pallas kernel may not capture one).
        packed = [op | idx(a) << 8 | idx(b) << 16 | idx(c) << 24 for op, a, b, c in self.code]
        consts = [jnp.full(shape, c, F32) for c in self.consts]
        regs = jnp.stack([*inputs, *consts, *([jnp.zeros(shape, F32)] * len(self.code))])

        def body(i, regs):
            word = jnp.int32(0)
            for j, w in enumerate(packed):
                word = jnp.where(i == j, jnp.int32(w), word)
            op, ia, ib, ic = (lax.shift_right_logical(word, jnp.int32(8 * f)) & 0xFF for f in range(4))
            get = lambda j: lax.dynamic_index_in_dim(regs, j, 0, keepdims=False)  # noqa: E731
            a, b, c = get(ia), get(ib), get(ic)
            ab, bb = _bits(a), _bits(b)
            lt = _lt(ab, bb)
            out = jnp.select(
                [op == _FMA, op == _ROUND, op == _DIV, op == _POW2, op == _MIN],
                [_fma_rn(a, b, c), lax.round(a, lax.RoundingMethod.TO_NEAREST_EVEN), div(a, b),
                 _pow2(a.astype(_I32)), jnp.where(lt, a, b)],
                jnp.where(lt, b, a),
            )
            return lax.dynamic_update_index_in_dim(regs, out, ni + nk + i, 0)

        regs = lax.fori_loop(0, len(self.code), body, regs)
        return [regs[idx(r)] for r in outputs]


def _lt(ab, bb):
    """``a < b`` for finite non-NaN floats, on their bit patterns (no float compare that a
    platform flushing subnormals could decide otherwise)."""
    ia, ib = lax.bitcast_convert_type(ab, _I32), lax.bitcast_convert_type(bb, _I32)
    ka = jnp.where(ia < 0, jnp.int32(-(2**31)) - ia, ia)  # a total order of the bit patterns
    kb = jnp.where(ib < 0, jnp.int32(-(2**31)) - ib, ib)
    return ka < kb


# ---------------------------------------------------------------------------------
# exp and log.
# ---------------------------------------------------------------------------------
_LOG2E = 1.4426950408889634
_LN2_HI = 0.6931471824645996  # float32(ln 2)
_LN2_LO = -1.904654299957768e-09  # ln 2 - _LN2_HI
# Taylor coefficients of (e**r - 1 - r - r**2/2) / r**3 = 1/3! + r/4! + ... + r**5/8!: on |r| <= ln(2)/2
# the first term left out (r**9/9!) is below 2**-32 relative to the result.
_EXP_P = tuple(1.0 / float(np.prod(np.arange(1, k + 1, dtype=np.float64))) for k in range(8, 2, -1))


def _exp_program() -> _Program:
    p = _Program(1)
    x = p.inp(0)
    n = p.round(p.mul(x, p.const(_LOG2E)))
    nf = p.neg(n)
    r = p.fma(nf, p.const(_LN2_HI), x)  # exact: |r| < 0.36 and n * ln2_hi has at most 32 bits
    r_lo = p.mul(nf, p.const(_LN2_LO))  # the reduced argument is r + r_lo, to ~2**-50
    P = p.const(_EXP_P[0])
    for c in _EXP_P[1:]:
        P = p.fma(P, r, p.const(c))
    # e**r - 1 = (r + r2/2) + [r2_lo/2 + r**3 P + r_lo (1 + r + ...)], r**2 = r2 + r2_lo exactly
    r2 = p.mul(r, r)
    r2_lo = p.fma(r, r, p.neg(r2))
    h = p.mul(r2, p.const(0.5))
    c1 = p.fma(p.mul(r2, r), P, p.mul(r2_lo, p.const(0.5)))
    rq = p.add(r, p.add(h, c1))
    c = p.add(c1, p.fma(r_lo, rq, r_lo))
    p_hi, p_lo = p.two_sum(r, h)
    s, e = p.two_sum(p.const(1.0), p_hi)
    y = p.add(s, p.add(e, p.add(p_lo, c)))  # e**r, rounded once from its double-float value
    # y * 2**n: the first factor keeps y normal (exact), the second rounds once (subnormal results).
    n1 = p.max(p.min(n, p.const(127.0)), p.const(-125.0))
    out = p.mul(p.mul(y, p.pow2(n1)), p.pow2(p.sub(n, n1)))
    p.outputs = [out]
    return p


_EXP = _exp_program()


def exp(x):
    """``e**x`` in float32: the same bits on every platform (see the module docstring).

    ``x = n ln2 + r`` (``n`` the nearest integer to ``x / ln 2``; ``r = x - n ln2_hi`` exact by one
    fma, ``- n ln2_lo`` kept as a correction), ``e**r = 1 + r + r**2/2 + r**3 P(r)`` (Taylor to
    ``r**8``, Horner with fma, ``r**2`` exact by one fma), the sum carried as a double-float
    (TwoSum) and rounded once, then scaled by ``2**n`` with exact powers of two (one rounding where
    the result is subnormal). 40 operations, run as one loop (:class:`_Program`).

    >>> float(exp(np.float32(0.0))), float(exp(np.float32(1.0))) == float(np.float32(np.e))
    (1.0, True)
    """
    x = to_float32(jnp.asarray(x))
    # Inputs outside [-120, 100] give 0 or inf anyway: clamp (by select), so that n stays small.
    xc = jnp.where(x > _f(100.0), _f(100.0), jnp.where(x < _f(-120.0), _f(-120.0), x))
    (out,) = _EXP.run([xc], _EXP.outputs)
    return jnp.where(_is_nan(x), _float(_u(_NAN)), out)


_LG = (6.6666668653e-01, 4.0000000596e-01, 2.8571429849e-01, 2.2222198546e-01, 1.8183572590e-01,
       1.5313838422e-01, 1.4798198640e-01)
_LOG_LN2_HI = 6.9313812256e-01  # 0x3f317180: k * _LOG_LN2_HI is exact for |k| < 2**8
_LOG_LN2_LO = 9.0580006145e-06  # 0x3717f7d1


def _log_program() -> _Program:
    """fdlibm's ``logf`` from ``xm = 1 + f`` and ``k``: every branch's value (:func:`log` selects)."""
    p = _Program(2)
    xm, dk = p.inp(0), p.inp(1)
    f = p.sub(xm, p.const(1.0))
    hi, lo = p.mul(dk, p.const(_LOG_LN2_HI)), p.mul(dk, p.const(_LOG_LN2_LO))
    # |f| < 2**-20: f - R0, k ln2 - ((R0 - k ln2_lo) - f)
    R0 = p.mul(p.mul(f, f), p.sub(p.const(0.5), p.mul(p.const(0.33333333333333333), f)))
    tiny_k0 = p.sub(f, R0)
    tiny_k = p.sub(hi, p.sub(p.sub(R0, lo), f))
    zero_k = p.add(hi, lo)
    # the general case
    s = p.div(f, p.add(p.const(2.0), f))
    z = p.mul(s, s)
    w = p.mul(z, z)
    t1 = p.mul(w, p.fma(w, p.fma(w, p.const(_LG[5]), p.const(_LG[3])), p.const(_LG[1])))
    t2 = p.mul(z, p.fma(w, p.fma(w, p.fma(w, p.const(_LG[6]), p.const(_LG[4])), p.const(_LG[2])), p.const(_LG[0])))
    R = p.add(t2, t1)
    hfsq = p.mul(p.mul(p.const(0.5), f), f)
    sR = p.mul(s, p.add(hfsq, R))
    big_k0 = p.sub(f, p.sub(hfsq, sR))
    big_k = p.sub(hi, p.sub(p.sub(hfsq, p.add(sR, lo)), f))
    sm = p.mul(s, p.sub(f, R))
    small_k0 = p.sub(f, sm)
    small_k = p.sub(hi, p.sub(p.sub(sm, lo), f))
    p.outputs = [f, tiny_k0, tiny_k, zero_k, big_k0, big_k, small_k0, small_k]
    return p


_LOG = _log_program()


def log(x):
    """``ln x`` in float32: the same bits on every platform (see the module docstring).

    fdlibm's ``logf`` (``e_logf.c``), every operation correctly rounded: ``x = 2**k (1 + f)``
    with ``1 + f`` in ``[sqrt(2)/2, sqrt(2))``, ``s = f / (2 + f)``, ``log(1 + f) = f - s (f - R)``
    or ``f - (hfsq - s (hfsq + R))`` with ``R`` a polynomial in ``s**2``, plus ``k ln 2`` in two
    parts (its branches computed as one program, :class:`_Program`, and selected).

    >>> float(log(np.float32(1.0))), float(log(np.float32(np.e))) == 1.0
    (0.0, True)
    """
    x = to_float32(jnp.asarray(x))
    bx = _bits(x)
    a = bx & _u(0x7FFFFFFF)
    # Subnormals: scale by 2**25 (exact), take 25 off the exponent.
    sub = (a < _u(0x00800000)) & (a != 0)
    bs = jnp.where(sub, _bits(_mul(x, _f(2.0**25))), bx)
    k = (lax.shift_right_logical(bs, _u(23)) & _u(0xFF)).astype(_I32) - 127 - jnp.where(sub, 25, 0)
    ix = (bs & _u(0x007FFFFF)).astype(_I32)
    i = (ix + (0x95F64 << 3)) & 0x800000
    xm = _float((ix | (i ^ 0x3F800000)).astype(jnp.uint32))  # the significand, or half of it
    k = k + lax.shift_right_logical(i, 23)
    f, tiny_k0, tiny_k, zero_k, big_k0, big_k, small_k0, small_k = _LOG.run([xm, k.astype(F32)], _LOG.outputs)
    tiny = (0x007FFFFF & (15 + ix)) < 16  # |f| < 2**-20
    k0 = k == 0
    general = jnp.where(((ix - (0x6147A << 3)) | ((0x6B851 << 3) - ix)) > 0, jnp.where(k0, big_k0, big_k),
                        jnp.where(k0, small_k0, small_k))
    f_zero = (_bits(f) & _u(0x7FFFFFFF)) == 0
    out = jnp.where(tiny, jnp.where(f_zero, jnp.where(k0, _f(0.0), zero_k), jnp.where(k0, tiny_k0, tiny_k)), general)
    ob = _bits(out)
    inf = _u(0x7F800000)
    ob = jnp.where(a == 0, _u(0xFF800000), ob)  # log(+-0) = -inf
    ob = jnp.where(bx == inf, inf, ob)
    ob = jnp.where((a > inf) | ((lax.shift_right_logical(bx, _u(31)) != 0) & (a != 0)), _u(_NAN), ob)
    return _float(ob)


# ---------------------------------------------------------------------------------
# What the gates and the norms need.
# ---------------------------------------------------------------------------------
def softplus(x):
    """``log(1 + exp(x))``, and ``x`` above :data:`SOFTPLUS_THRESHOLD` (the reference's formula)."""
    x = to_float32(jnp.asarray(x))
    return jnp.where(x > _f(SOFTPLUS_THRESHOLD), x, log(_add(_f(1.0), exp(x))))


def sigmoid(x):
    """``1 / (1 + exp(-x))`` (the write gate ``beta``)."""
    x = to_float32(jnp.asarray(x))
    return div(_f(1.0), _add(_f(1.0), exp(_neg(x))))


def pairwise_sum(x):
    """Sum over the last axis by the reference's fixed pairwise tree
    (:func:`gdn_lossless_jax.reference.pairwise_sum`: zero-padded to a power of two ``p``, then
    ``x[i] + x[i + h]`` for ``h = p/2, p/4, ..., 1``), every add correctly rounded.

    The levels run as a loop on the whole axis (``x + roll(x, -h)``: the entries past ``h`` are
    computed and never read), so the add's integer emulation is compiled once.
    """
    x = to_float32(x)
    n = x.shape[-1]
    p = 1 << max(n - 1, 0).bit_length()
    if p != n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, p - n)])
    if p == 1:
        return x[..., 0]
    levels = p.bit_length() - 1

    def level(j, x):
        h = lax.shift_right_logical(jnp.int32(p), (j + 1).astype(_I32))
        return _add(x, jnp.roll(x, -h, axis=-1))

    return lax.fori_loop(0, levels, level, x)[..., 0]


def l2norm(x, eps: float = 1e-6):
    """``x / sqrt(sum(x * x) + eps)`` over the last axis (the reference's norm), every operation
    correctly rounded, the sum by :func:`pairwise_sum`."""
    x = to_float32(jnp.asarray(x))
    ss = _add(pairwise_sum(lax.optimization_barrier(_mul(x, x))), _f(eps))
    return div(x, sqrt(ss)[..., None])


def neg(x):
    """``-x`` by its sign bit."""
    return _neg(jnp.asarray(x, F32))


def dot(X, y):
    """``X @ y`` over the last axis (``X [..., V, K]``, ``y [..., K]``): correctly rounded products
    summed by :func:`pairwise_sum` (the reference's ``ksum`` tree)."""
    return pairwise_sum(lax.optimization_barrier(_mul(X, y[..., None, :])))


def gates(a, b, A_log, dt_bias):
    """``(g, beta)`` as :func:`gdn_lossless_jax.reference.gates` defines them, portably:
    ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = 1 / (1 + exp(-b))``.

    The three ``exp`` run as one call (one compiled program; the same bits as three)."""
    x = _add(to_float32(a), to_float32(dt_bias))
    nb = _neg(to_float32(b))
    A = to_float32(A_log)
    e = exp(jnp.concatenate([x.ravel(), nb.ravel(), A.ravel()]))
    ex, enb, eA = e[: x.size].reshape(x.shape), e[x.size : x.size + nb.size].reshape(nb.shape), e[x.size + nb.size :]
    one_plus = _add(_f(1.0), jnp.concatenate([ex.ravel(), enb.ravel()]))
    sp = jnp.where(x > _f(SOFTPLUS_THRESHOLD), x, log(one_plus[: x.size].reshape(x.shape)))
    eA = eA.reshape(A.shape)
    if jnp.ndim(a) > jnp.ndim(b):  # a per-channel decay (KDA): A_log [HV] over dt_bias [HV, K]
        eA = eA[..., None]
    g = _mul(_neg(eA), sp)
    return g, div(_f(1.0), one_plus[x.size :].reshape(nb.shape))

