"""The ``reference`` backend: the pure-JAX specification, jit-compiled once per shape."""

from __future__ import annotations

import jax

from .. import reference as ref
from .contract import Capabilities, VerifyCall

__all__ = ["name", "capabilities", "check_available", "verify", "replay", "commit", "conv_kernels"]

name = "reference"
#: Every record mode, math mode and decay (KDA's per-channel one included), the beta scale, draft trees
#: (:func:`gdn_lossless_jax.reference.tree_chain`): the specification is this backend.
capabilities = Capabilities(trees=True, math_modes=ref.MATH_MODES, decays=ref.DECAYS, beta_scale=True)


def check_available(op: str, math: str = "platform") -> None:
    """Runs on every XLA platform, in every mode."""


def conv_kernels():
    """None: the conv runs in XLA (:mod:`gdn_lossless_jax.conv`)."""
    return None


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


# The earlier contract's attributes (capabilities.trees, capabilities.math_modes): one release.
def __getattr__(attr: str):
    from .contract import _old_capability

    return _old_capability(__name__, capabilities, attr)
