"""Ref access shared by the Pallas kernels."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu


def store(ref, idx, value, evict: str | None = None):
    """``ref[idx] = value``, with Triton's eviction policy ``evict`` when one is given.

    Without one it is the plain ref store: ``plgpu.store`` lowers to the same Triton IR for a
    GPU, but in interpret mode XLA:CPU made the commit copy its aliased pool twice around it.
    """
    if evict is None:
        ref[idx] = value
    else:  # (interpret mode's store takes no Python ints in ``.at`` indices)
        at = tuple(jnp.int32(i) if isinstance(i, int) else i for i in idx)
        plgpu.store(ref.at[at], value, eviction_policy=evict)
