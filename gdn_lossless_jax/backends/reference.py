"""The ``reference`` backend: the pure-JAX specification, jit-compiled once per shape."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .. import reference as ref

__all__ = ["verify", "replay", "commit"]


@functools.partial(jax.jit, static_argnames=("record", "scale", "out_dtype"))
def verify(state0, q, k, v, a, b, A_log, dt_bias, *, record, scale, out_dtype, slots=None, layer=None, tape=None,
           tape_layer=None, rows=None):  # fmt: skip
    # Always compiled: XLA:CPU contracts and fuses differently op by op than under jit, so
    # one compiled path makes the outputs the same with or without an outer jax.jit.
    # The pool form gathers the states (the reference is the specification, not the lean
    # path: the kernels read by slot instead) and scatters the tape into its buffer.
    state = state0 if slots is None else ref.read_slots(state0, layer, slots)
    outputs, new = ref.verify(state, q, k, v, a, b, A_log, dt_bias, record=record, scale=scale, out_dtype=out_dtype)
    if tape is None:
        return outputs, new
    return outputs, ref.write_rows(tape, tape_layer, rows, new)


replay = jax.jit(ref.replay)
commit = jax.jit(ref.commit)
