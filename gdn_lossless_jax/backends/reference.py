"""The ``reference`` backend: the pure-JAX specification, jit-compiled once per shape."""

from __future__ import annotations

import functools

import jax

from .. import reference as ref

__all__ = ["verify", "replay", "commit"]


@functools.partial(jax.jit, static_argnames=("record", "scale", "out_dtype"))
def verify(state0, q, k, v, a, b, A_log, dt_bias, *, record, scale, out_dtype, slots=None, layer=None, tape=None,
           tape_layer=None, rows=None, pending=None, out=None, out_layer=None):  # fmt: skip
    # Always compiled: XLA:CPU contracts and fuses differently op by op than under jit, so
    # one compiled path makes the outputs the same with or without an outer jax.jit.
    # The pool form gathers the states (the reference is the specification, not the lean
    # path: the kernels read by slot instead) and scatters the tape into its buffer.
    # The barrier makes the inputs arrive in their own dtype: inside a caller's jit, XLA:GPU
    # (allow_excess_precision) would otherwise fuse their producer and skip its rounding to
    # bf16 (the pool path's outputs then differed from the same call outside a jit).
    q, k, v, a, b, A_log, dt_bias = jax.lax.optimization_barrier((q, k, v, a, b, A_log, dt_bias))
    return ref.verify_form(
        state0, q, k, v, a, b, A_log, dt_bias, record=record, scale=scale, out_dtype=out_dtype, slots=slots,
        layer=layer, tape=tape, tape_layer=tape_layer, rows=rows, pending=pending, out=out, out_layer=out_layer,
    )  # fmt: skip


replay = jax.jit(ref.replay)
commit = jax.jit(ref.commit)
