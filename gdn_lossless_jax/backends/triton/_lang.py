"""Triton, imported guarded, and the few numeric helpers every kernel of this backend shares.

The package must import on a machine without Triton (CI runs on the CPU), so ``triton`` is
imported here inside ``try``; where it is missing, :func:`jit` leaves the kernel functions
as plain Python and nothing can launch them (``check_available`` refuses first).

Rounding is pinned, never left to the compiler (``gdn_lossless_jax.rounding`` says why).
With fp fusion on (Triton's and jax-triton's default) ``S * alpha + k * u`` becomes ``fma(S, alpha, rn(k * u))``, the
other product; so the update is an explicit :func:`fma` of ``k`` and ``u`` into the
separately rounded decay, and the wrappers also launch with ``enable_fp_fusion=False``:
every other multiply and add then rounds as written, as on XLA:GPU, which never contracts
(the rule does not depend on this: its one fma is explicit and the decay has no add to
fuse into). ``exp`` is libdevice's ``__nv_expf``, the function XLA:GPU and Pallas Triton
call, not ``tl.exp`` (``ex2.approx`` after a multiply by log2(e)), so that a tape recorded
here replays bit for bit in the other backends on the same GPU. (Triton links libdevice
with ``nvvm-reflect-ftz`` on, which jax-triton cannot turn off; ``__nv_expf`` does not
depend on it in practice: its last instruction, ``ex2.approx.ftz``, is the same in both
modes, and its result is scaled into the subnormal range by a plain multiply, which keeps
subnormals.)

Every helper takes ``INTERPRET`` (a constexpr). The Triton interpreter (``TRITON_INTERPRET=1``,
NumPy underneath) has no libdevice, computes ``tl.fma`` as ``x * y + z`` with two
roundings and converts float32 to bfloat16 by truncation; with ``INTERPRET=True`` the
helpers use NumPy's ``exp``/``log``, an exactly rounded fma (float64 round-to-odd) and
bit-level bfloat16 conversions instead, so the kernels' logic can be checked on a CPU
(``scripts/triton_interpret_check.py``). The compiled kernels always use ``INTERPRET=False``.

``jax_triton`` is imported only through :func:`import_jax_triton`, which leaves ``os.environ`` as
it found it: jax-triton 0.3.1 sets ``TRITON_CACHE_DIR=""`` when imported, and Triton >= 3.4 then
refuses any kernel compiled or launched through Triton's own runtime (PyTorch's, say) in the same
process with "Could not create or locate cache dir". jax-triton itself never reads the variable
again: it compiles in place (``ast_to_ttir`` and the backend's ``make_*`` stages) and keeps its
own in-memory cache; Triton's on-disk cache (``triton.compile``, its launcher's C module, the
autotuner's results) is reached only through Triton's runtime.
"""

from __future__ import annotations

import importlib
import os
import threading

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    IMPORT_ERROR: ImportError | None = None
except ImportError as e:  # the package still imports; check_available reports this
    triton = None
    libdevice = None
    IMPORT_ERROR = e

    class tl:  # noqa: N801  (stands in for triton.language in annotations only)
        constexpr = None


__all__ = ["triton", "tl", "libdevice", "IMPORT_ERROR", "jit", "next_power_of_2", "import_jax_triton"]

_JAX_TRITON = None
_JAX_TRITON_LOCK = threading.Lock()


def import_jax_triton():
    """``jax_triton``, imported once, with ``os.environ`` afterwards exactly as before the import.

    Keys the import added are removed and keys it changed or removed get their old values back,
    also where the import fails (jax-triton sets the variable before it checks for a GPU jaxlib).
    Raises the import's ``ImportError``; a failed import is tried again on the next call. Where
    something imported ``jax_triton`` earlier, the import is a no-op and nothing is restored.
    """
    global _JAX_TRITON
    if _JAX_TRITON is None:
        with _JAX_TRITON_LOCK:
            if _JAX_TRITON is None:
                before = dict(os.environ)
                try:
                    _JAX_TRITON = importlib.import_module("jax_triton")
                finally:
                    _restore_environ(before)
    return _JAX_TRITON


def _restore_environ(before: dict[str, str]) -> None:
    """Make ``os.environ`` (and so the C environment under it) equal to ``before`` again."""
    for key in [key for key in os.environ if key not in before]:
        del os.environ[key]
    for key, value in before.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def jit(fn):
    """``triton.jit`` where Triton is installed; the plain function elsewhere (never launched)."""
    return fn if triton is None else triton.jit(fn)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


@jit
def exp(x, INTERPRET: tl.constexpr):
    if INTERPRET:
        return tl.exp(x)
    else:
        return libdevice.exp(x)


@jit
def decay(g_ptr, at, offs, mask, K: tl.constexpr, CHANNEL: tl.constexpr, INTERPRET: tl.constexpr):
    """``exp(g)`` of one step and v-head, ``at`` its flat index in ``g``: one scalar where ``g`` is
    GDN's ``[..., HV]``; with ``CHANNEL`` (KDA's ``g [..., HV, K]``, a per-channel decay) one factor
    per key channel, read at the columns ``offs`` (any shape; ``mask`` where they overhang K, whose
    factor is then ``exp(0) = 1``), so that ``S * decay(...)`` decays each column by its own factor
    with one rounded multiply per element. ``CHANNEL`` comes from g's rank, in the wrappers."""
    if CHANNEL:
        return exp(tl.load(g_ptr + at * K + offs, mask=mask, other=0.0), INTERPRET)
    else:
        return exp(tl.load(g_ptr + at), INTERPRET)


@jit
def log(x, INTERPRET: tl.constexpr):
    if INTERPRET:
        return tl.log(x)
    else:
        return libdevice.log(x)


@jit
def fma(a, b, c, INTERPRET: tl.constexpr):
    """``rn(a * b + c)`` with one rounding; ``a`` and ``b`` must already have ``c``'s shape."""
    if INTERPRET:
        # float64 round-to-odd: the f64 product of two f32 is exact; TwoSum gives the
        # exact error of the f64 sum; forcing an inexact sum to an odd last bit makes the
        # final rounding to f32 correct (53 >= 24 + 2 bits).
        a64 = a.to(tl.float64)
        b64 = b.to(tl.float64)
        c64 = c.to(tl.float64)
        p = a64 * b64
        s = p + c64
        bb = s - p
        err = (p - (s - bb)) + (c64 - bb)
        sb = s.to(tl.int64, bitcast=True)
        inexact = (err != 0.0) & ((sb & 1) == 0) & (tl.abs(s) < float("inf"))
        step = tl.where((err < 0.0) == (s < 0.0), 1, -1).to(tl.int64)
        odd = tl.where(inexact, sb + step, sb).to(tl.float64, bitcast=True)
        return odd.to(tl.float32)
    else:
        return tl.fma(a, b, c)


@jit
def to_f32(x, INTERPRET: tl.constexpr):
    """Exact upcast to float32 (the interpreter's bfloat16 path mishandles subnormals)."""
    if INTERPRET and x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@jit
def from_f32(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """Round a float32 tensor to ``dtype`` to nearest even, as XLA's ``astype`` does."""
    if dtype == tl.float32:
        return x
    elif INTERPRET and dtype == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        r = b + 0x7FFF + ((b >> 16) & 1)
        r = tl.where(x != x, b | 0x400000, r)  # NaN stays NaN (quiet)
        return (r >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)
