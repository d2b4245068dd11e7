"""Ref access shared by the Pallas kernels."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
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


def grid(outer: int, middle: int, tiles: int, tiles_first: bool) -> tuple[int, int, int]:
    """A kernel's grid ``(outer, middle, tiles)``, or ``(tiles, middle, outer)`` with ``tiles_first``:
    programs are scheduled first axis fastest, so consecutive programs then walk the V tiles
    of one state (contiguous memory) rather than the requests (one state apart)."""
    return (tiles, middle, outer) if tiles_first else (outer, middle, tiles)


def program_ids(tiles_first: bool):
    """``(outer, middle, tile)`` program ids of a :func:`grid`."""
    a, m, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    return (b, m, a) if tiles_first else (a, m, b)
