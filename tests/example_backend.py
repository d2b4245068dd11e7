"""A backend of one's own, for tests/test_user_backend.py: the reference, wrapped.

A backend is any object with three functions (here, a module). gdn_lossless_jax's API
calls them after checking every argument, so they can assume valid shapes and dtypes and
int32 indices (the contract: gdn_lossless_jax.backends.contract)::

    verify(call: VerifyCall) -> (outputs, tape), or (outputs, tape, pool) with call.pending
    replay(state0, tuples, steps) -> states
    commit(pool, tape, slots, steps, track_slots, track_steps, rows) -> pool

Use it as ``gl.verify(..., backend=example_backend)`` and check it with
``gdn_lossless_jax.testing.run_equivalence_suite(example_backend)``.
"""

import jax

from gdn_lossless_jax import reference
from gdn_lossless_jax.backends.contract import VerifyCall


@jax.jit
def verify(call: VerifyCall):
    return reference.verify_form(call)


@jax.jit
def replay(state0, tuples, steps):
    return reference.replay(state0, tuples, steps)


@jax.jit
def commit(pool, tape, slots, steps, track_slots, track_steps, rows):
    return reference.commit(pool, tape, slots, steps, track_slots, track_steps, rows)
