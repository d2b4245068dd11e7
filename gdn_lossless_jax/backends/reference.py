"""The ``reference`` backend: the pure-JAX specification, jit-compiled once per shape."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .. import reference as ref

__all__ = ["verify", "replay", "commit"]


@functools.partial(jax.jit, static_argnames=("record", "scale", "out_dtype"))
def verify(state0, q, k, v, a, b, A_log, dt_bias, *, record, scale, out_dtype, slots=None, layer=None, tape=None,
           tape_layer=None, rows=None, pending=None):  # fmt: skip
    # Always compiled: XLA:CPU contracts and fuses differently op by op than under jit, so
    # one compiled path makes the outputs the same with or without an outer jax.jit.
    # The pool form gathers the states (the reference is the specification, not the lean
    # path: the kernels read by slot instead) and scatters the tape into its buffer.
    # The barrier makes the inputs arrive in their own dtype: inside a caller's jit, XLA:GPU
    # (allow_excess_precision) would otherwise fuse their producer and skip its rounding to
    # bf16 (seen on the H200: the pool path's outputs differed from the same call outside).
    q, k, v, a, b, A_log, dt_bias = jax.lax.optimization_barrier((q, k, v, a, b, A_log, dt_bias))
    if pending is not None:  # the previous step's commit of this layer, then the verify from the pool it leaves
        prows, psteps, ptslots, ptsteps, prev_layer, prev = pending
        one = jax.tree.map(lambda x: x[prev_layer][None], prev)
        committed = ref.commit(state0[layer][None], one, slots, psteps, ptslots, ptsteps, prows)
        state0 = jax.lax.dynamic_update_index_in_dim(state0, committed[0], layer, 0)
    state = state0 if slots is None else ref.read_slots(state0, layer, slots)
    outputs, new = ref.verify(state, q, k, v, a, b, A_log, dt_bias, record=record, scale=scale, out_dtype=out_dtype)
    if tape is not None:
        new = ref.write_rows(tape, tape_layer, rows, new)
    return (outputs, new) if pending is None else (outputs, new, state0)


replay = jax.jit(ref.replay)
commit = jax.jit(ref.commit)
