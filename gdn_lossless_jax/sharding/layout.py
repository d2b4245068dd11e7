"""The conv channels' tensor-parallel order and the GDN layer one tensor shard runs.

A tensor shard holds whole q/k heads with their v-heads; the conv's ``[q | k | v]`` channels are
reordered once, at load time, so that each shard's channels are one contiguous block
(:func:`to_tp_layout`, :func:`from_tp_layout`). Re-exported by :mod:`gdn_lossless_jax.sharding`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from .. import checks
from ..config import Geometry

__all__ = ["local_geometry", "conv_channel_order", "to_tp_layout", "from_tp_layout"]


def local_geometry(geometry: Geometry, tp: int) -> Geometry:
    """The GDN layer one tensor shard runs: H/tp q/k heads, HV/tp v-heads, the rest unchanged.

    >>> from gdn_lossless_jax import get_geometry
    >>> g = local_geometry(get_geometry("qwen3.6-35b-a3b"), 4)
    >>> (g.num_k_heads, g.num_v_heads, g.conv_dim)
    (4, 8, 2048)
    """
    _check_heads_split("local_geometry", geometry.num_k_heads, geometry.num_v_heads, tp, "tp")
    if tp == 1:
        return geometry
    return dataclasses.replace(
        geometry, name=f"{geometry.name} (1/{tp} of the heads)",
        num_k_heads=geometry.num_k_heads // tp, num_v_heads=geometry.num_v_heads // tp,
    )  # fmt: skip


def conv_channel_order(geometry: Geometry, tp: int) -> np.ndarray:
    """The conv channels in the tensor-parallel order: ``tp_layout = standard[order]``.

    Block ``r`` of ``conv_dim / tp`` channels is shard ``r``'s ``[q_r | k_r | v_r]``: the q and
    k channels of its q/k heads (``H/tp * K`` each) and the v channels of its v-heads.

    Returns:
      ``[conv_dim]`` int, a permutation (the identity when ``tp == 1``).

    >>> from gdn_lossless_jax import Geometry
    >>> conv_channel_order(Geometry("toy", 1, num_k_heads=2, num_v_heads=2, head_k_dim=1, head_v_dim=1), 2)
    array([0, 2, 4, 1, 3, 5])
    """
    g = geometry
    _check_heads_split("conv_channel_order", g.num_k_heads, g.num_v_heads, tp, "tp")
    HK, HVV = g.num_k_heads * g.head_k_dim, g.num_v_heads * g.head_v_dim
    q, k, v = np.arange(HK), HK + np.arange(HK), 2 * HK + np.arange(HVV)
    blocks = [np.concatenate([q.reshape(tp, -1)[r], k.reshape(tp, -1)[r], v.reshape(tp, -1)[r]]) for r in range(tp)]
    return np.concatenate(blocks)


def to_tp_layout(x, geometry: Geometry, tp: int, axis: int = -1):
    """``x`` with its conv-channel axis (``conv_dim`` long) in the tensor-parallel order.

    Use it once at load time on the in-projection's ``[q | k | v]`` output columns, the conv
    weight (``axis=0``) and bias, and on any conv state or window written before sharding:
    on arrays not yet placed on the mesh (a gather across the tensor axis of a placed one is a
    collective, and on a mesh of Explicit axes JAX asks for its output sharding).
    """
    order = conv_channel_order(geometry, tp)
    _check_channels("to_tp_layout", x, axis, order.size)
    return jnp.take(x, jnp.asarray(order), axis=axis) if tp > 1 else x


def from_tp_layout(x, geometry: Geometry, tp: int, axis: int = -1):
    """The inverse of :func:`to_tp_layout`: the usual ``[q | k | v]`` order back."""
    order = conv_channel_order(geometry, tp)
    _check_channels("from_tp_layout", x, axis, order.size)
    return jnp.take(x, jnp.asarray(np.argsort(order)), axis=axis) if tp > 1 else x


def _check_channels(fn, x, axis, C):
    if np.shape(x)[axis] != C:
        raise ValueError(f"{fn}: axis {axis} of the array must be the conv_dim={C} channels, got shape "
                         f"{checks.fmt_shape(np.shape(x))}")  # fmt: skip


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _check_heads_split(fn: str, H: int, HV: int, tp: int, axis: str) -> None:
    if H % tp:
        raise ValueError(
            f"{fn}: H={H} q/k heads cannot be split over the tensor axis {axis!r} of size {tp}: H must be a multiple "
            f"of the axis size, so that every device holds whole q/k heads with their HV/H={HV // H} v-heads "
            f"(v-heads [h*{HV // H}, (h+1)*{HV // H}) share q/k head h); tensor sizes that fit: {_divisors(H)}"
        )
