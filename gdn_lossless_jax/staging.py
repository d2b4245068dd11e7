"""Index arguments as the kernels read them: int32, and, inside a caller's ``jax.jit``, staged.

:func:`as_index` turns an index argument into int32 without an eager JAX op; a traced one is
:func:`staged` (passed through one elementwise op XLA cannot remove), so that a serving loop's new
index arrays move one CUDA-graph node, not every kernel that reads them. :func:`unstaged` traces
the library's own jits without staging (their wrappers staged already, where the caller traces).
Not a check: :mod:`gdn_lossless_jax.checks` calls it on the arguments it has checked.
"""

from __future__ import annotations

import contextvars
import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["as_index", "staged", "unstaged"]

_INT32 = np.dtype(np.int32)  # compared as a NumPy dtype (against jnp.int32, a scalar type, it costs a hash)
_INT32_MIN = np.int32(np.iinfo(np.int32).min)
_STAGING = contextvars.ContextVar("gdn_lossless_jax_staging", default=True)


def as_index(x):
    """An index argument as int32 without an eager JAX op: arrays of int32 pass through (a weakly
    typed one made plain), the rest becomes NumPy, which a jitted call takes in as part of its own
    launch (``jnp.asarray`` of a Python int would dispatch a device op of its own).

    Traced index arrays (inside a ``jax.jit``; rank >= 1: slots, rows, steps, not the layer)
    are :func:`staged`: the kernels read a copy the jit makes, not the caller's buffer. Not
    those a loop body (``lax.scan``) closes over: staged there, the op would run in every
    iteration (XLA does not hoist it), and XLA re-records a loop body's graph every iteration
    anyway."""
    if isinstance(x, jax.Array):
        # A weakly typed int32 (``jnp.full((n,), 3)``) is made a plain one: Pallas Triton's lowering
        # of the commit kernel fails on it (an i1 added to an i32).
        x = x if x.dtype == _INT32 and not x.aval.weak_type else x.astype(jnp.int32)
        here = isinstance(x, jax.core.Tracer) and x.ndim >= 1 and _STAGING.get() and _traced_here(x)
        return staged(x) if here else x
    return np.asarray(x, np.int32)


def unstaged(fn):
    """``fn`` traced without :func:`staged` index arrays: for the library's own jits, whose
    Python wrappers pass their index arguments through :func:`as_index` already (which stages
    them where the caller's trace runs, not inside a loop body that calls the wrapper)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        token = _STAGING.set(False)
        try:
            return fn(*args, **kwargs)
        finally:
            _STAGING.reset(token)

    return wrapper


def _traced_here(x) -> bool:
    """Whether tracer ``x`` belongs to the trace now running (not one an inner trace, such as a
    loop body's, closes over)."""
    try:
        from jax._src import core as jcore

        return x._trace is jcore.trace_ctx.trace
    except (ImportError, AttributeError):  # other JAX internals: stage
        return True


def staged(x: jax.Array) -> jax.Array:
    """``x`` through one elementwise op that equals it bit for bit, which XLA can neither remove
    nor fuse into a kernel: the kernels that read it read the jit's own buffer.

    Why: XLA runs a jit's kernels as a CUDA graph and re-records every kernel node whose buffers
    moved since the last launch. A serving loop passes new index arrays every step; read by all
    L verify kernels and the commit, they would make each launch re-record the whole graph.
    Staged, only this op's node moves; XLA merges the identical ops of the L layers into one."""
    return jnp.where(x == _INT32_MIN, _INT32_MIN, x)
