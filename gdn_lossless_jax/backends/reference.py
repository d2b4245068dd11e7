"""The ``reference`` backend: the pure-JAX specification, jit-compiled once per shape."""

from __future__ import annotations

import jax

from .. import reference as ref
from .contract import VerifyCall

__all__ = ["verify", "replay", "commit", "TREES", "MATH_MODES"]

#: The reference verifies draft trees (``VerifyCall.parents``): :func:`gdn_lossless_jax.reference.tree_chain`.
TREES = True
MATH_MODES = ref.MATH_MODES  # both: the portable mode's specification is this backend


@jax.jit
def verify(call: VerifyCall):
    # Always compiled: XLA:CPU contracts and fuses differently op by op than under jit, so
    # one compiled path makes the outputs the same with or without an outer jax.jit.
    # The pool form gathers the states (the reference is the specification, not the lean
    # path: the kernels read by slot instead) and scatters the tape into its buffer.
    # The barrier makes the inputs arrive in their own dtype: inside a caller's jit, XLA:GPU
    # (allow_excess_precision) would otherwise fuse their producer and skip its rounding to
    # bf16 (the pool path's outputs then differed from the same call outside a jit).
    q, k, v, a, b, A_log, dt_bias = jax.lax.optimization_barrier(call.inputs)
    return ref.verify_form(call.replace(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias))


replay = jax.jit(ref.replay, static_argnames=("math",))
commit = jax.jit(ref.commit, static_argnames=("math",))
