"""A backend of one's own, for tests/test_user_backend.py: the reference, wrapped.

A backend implements :class:`gdn_lossless_jax.backends.contract.Backend` (here, as a module):
a name, its declared capabilities, an availability check, ``verify``, ``replay``, ``commit``
and its conv kernels (None: XLA runs the conv). gdn_lossless_jax's API calls them after
checking every argument and the call against the capabilities, so they can assume valid shapes
and dtypes and int32 indices. This one does not fuse the pending commit into its verify
(``fused=False``): the API commits the layer with its ``commit`` first.

Use it as ``gl.verify(..., backend=example_backend)`` and check it with
``gdn_lossless_jax.testing.run_equivalence_suite(example_backend)``.
"""

import functools

import jax

from gdn_lossless_jax import reference
from gdn_lossless_jax.backends.contract import Capabilities, VerifyCall

name = "example"
capabilities = Capabilities(fused=False)


def check_available(op: str, math: str = "platform") -> None:
    """Runs wherever JAX does."""


def conv_kernels():
    return None


@jax.jit
def verify(call: VerifyCall):
    return reference.verify_form(call)


@functools.partial(jax.jit, static_argnames="math")  # math= is a static string (the API always passes it)
def replay(state0, tuples, steps, *, math="platform"):
    return reference.replay(state0, tuples, steps, math=math)


@functools.partial(jax.jit, static_argnames="math")
def commit(pool, tape, slots, steps, track_slots, track_steps, rows, *, math="platform"):
    return reference.commit(pool, tape, slots, steps, track_slots, track_steps, rows, math=math)
