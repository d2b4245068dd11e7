"""A backend of one's own, for tests/test_user_backend.py: the reference, wrapped.

A backend is any object with three functions (here, a module). gdn_lossless_jax's API
calls them after checking every argument, so they can assume valid shapes and dtypes,
int32 indices, a float ``scale`` and a numpy ``out_dtype``::

    verify(state0, q, k, v, a, b, A_log, dt_bias, *, record, scale, out_dtype) -> (outputs, tape)
    replay(state0, tuples, steps) -> states
    commit(pool, tape, slots, steps, track_slots, track_steps, rows) -> pool

Use it as ``gl.verify(..., backend=example_backend)`` and check it with
``gdn_lossless_jax.testing.run_equivalence_suite(example_backend)``.
"""

import functools

import jax

from gdn_lossless_jax import reference


@functools.partial(jax.jit, static_argnames=("record", "scale", "out_dtype"))
def verify(state0, q, k, v, a, b, A_log, dt_bias, *, record, scale, out_dtype):
    return reference.verify(state0, q, k, v, a, b, A_log, dt_bias, record=record, scale=scale, out_dtype=out_dtype)


@jax.jit
def replay(state0, tuples, steps):
    return reference.replay(state0, tuples, steps)


@jax.jit
def commit(pool, tape, slots, steps, track_slots, track_steps, rows):
    return reference.commit(pool, tape, slots, steps, track_slots, track_steps, rows)
