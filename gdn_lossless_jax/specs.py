"""The state pool's arrays, defined once: their shapes and dtypes for a geometry.

:func:`gdn_lossless_jax.pool.allocate` allocates from these specs and
:mod:`gdn_lossless_jax.tools.memory` counts bytes from them, so the accounting equals the
allocation byte for byte. A tape's fields come from its record mode's layout
(:meth:`gdn_lossless_jax.tape.Tape.specs`); ``seed_ring`` (:class:`SeedRing`) is a layout the
accounting knows and the pool never allocates. :func:`device_free_bytes` and
:func:`check_fits` say whether a pool fits before it is allocated.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from .config import Geometry
from .tape import RECORD_MODES, RECORDS, Tuples, record_type

__all__ = ["ArraySpec", "POOL_RECORD_MODES", "SeedRing", "SCRATCH", "SCRATCH_MODES", "scratch_rows", "state_specs",
           "tape_specs", "conv_window_spec", "device_free_bytes", "check_fits"]  # fmt: skip

#: Record modes the pool allocates (those :func:`gdn_lossless_jax.verify` records: ``tape.RECORDS``).
POOL_RECORD_MODES = RECORD_MODES


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SeedRing(Tuples):
    """The tuple ring of SGLang's lossless-verify pull request, for the memory accounting only (never
    allocated, not a record mode): :class:`~gdn_lossless_jax.tape.Tuples` with ``k`` stored once per
    v-head, ``[..., D, HV, K]``."""

    mode: ClassVar[str] = "seed_ring"

    @classmethod
    def layout(cls, *, H, HV, V, K):
        return Tuples.layout(H=HV, HV=HV, V=V, K=K)


#: The layouts the memory accounting knows, by name: the record modes', plus ``seed_ring``.
SCRATCH = {**RECORDS, "seed_ring": SeedRing}
SCRATCH_MODES = tuple(SCRATCH)


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    """The shape and dtype of one allocated array."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * jnp.dtype(self.dtype).itemsize


def scratch_rows(requests: int) -> int:
    """Scratch rows for R running requests: R + 1 (SGLang's discard row for padding)."""
    return requests + 1


def state_specs(geometry: Geometry, slots: int, *, state_dtype=jnp.float32, conv_dtype=jnp.bfloat16) -> dict[str, ArraySpec]:
    """The persistent pool: ``ssm [L, S+1, HV, V, K]`` and ``conv [L, S+1, conv_dim, Kc-1]``."""
    g = geometry
    return {
        "ssm": ArraySpec((g.gdn_layers, slots + 1, g.num_v_heads, g.head_v_dim, g.head_k_dim), jnp.dtype(state_dtype)),
        "conv": ArraySpec((g.gdn_layers, slots + 1, g.conv_dim, g.conv_kernel - 1), jnp.dtype(conv_dtype)),
    }


def tape_specs(geometry: Geometry, rows: int, drafts: int, record, *, state_dtype=jnp.float32) -> dict[str, ArraySpec]:
    """The SSM scratch for ``rows`` scratch rows of D drafts, keyed by the tape's field names: its
    record mode's layout (:meth:`gdn_lossless_jax.tape.Tape.specs`) with a leading ``[L, rows, D]``.

    ``snapshots``: ``states [L, rows, D, HV, V, K]`` in the state dtype. ``tuples`` (ours):
    ``u [L, rows, D, HV, V]``, ``k [L, rows, D, H, K]``, ``g [L, rows, D, HV]``, float32.
    ``seed_ring`` (accounting only, :class:`SeedRing`): as ``tuples`` but ``k`` per v-head. A KDA
    geometry's ``tuples`` are :class:`~gdn_lossless_jax.tape.KDATuples` (``g [L, rows, D, HV, K]``).
    """
    g = geometry
    cls = record if isinstance(record, type) else SCRATCH.get(record)
    if cls is None:
        raise ValueError(f"tape_specs: record must be one of {SCRATCH_MODES}, got {record!r}")
    if isinstance(record, str) and record in RECORDS:
        cls = record_type(record, "tape_specs", g.decay)
    elif g.decay not in cls.decays:
        raise ValueError(f"tape_specs: a {cls.__name__} tape records no {g.decay} decay (geometry {g.name!r}: "
                         f"{g.linear_attention} layers)")  # fmt: skip
    specs = cls.specs((g.gdn_layers, rows, drafts), H=g.num_k_heads, HV=g.num_v_heads, V=g.head_v_dim,
                      K=g.head_k_dim, state_dtype=state_dtype)  # fmt: skip
    return {name: ArraySpec(shape, dtype) for name, (shape, dtype) in specs.items()}


def conv_window_spec(geometry: Geometry, rows: int, drafts: int, *, conv_dtype=jnp.bfloat16) -> ArraySpec:
    """The deduplicated conv windows: ``[L, rows, conv_dim, D+Kc-2]`` in the conv dtype."""
    g = geometry
    return ArraySpec((g.gdn_layers, rows, g.conv_dim, drafts + g.conv_kernel - 2), jnp.dtype(conv_dtype))


def device_free_bytes(device: jax.Device | None = None) -> tuple[int | None, str]:
    """``(bytes free, where the figure comes from)`` on ``device`` (default: JAX's first device).

    An accelerator's allocator limit less its bytes in use (``memory_stats()``); on a CPU the
    host's available memory (``MemAvailable`` in ``/proc/meminfo``); ``(None, ...)`` where
    neither is known.
    """
    device = device or jax.devices()[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        limit, used = stats["bytes_limit"], stats.get("bytes_in_use", 0)
        return limit - used, f"on device {device} (bytes_limit {limit:,} - bytes_in_use {used:,})"
    if device.platform == "cpu":
        try:
            with open("/proc/meminfo") as f:
                kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
            return kib * 1024, f"on the host of {device} (MemAvailable)"
        except (OSError, StopIteration, ValueError):
            pass
    return None, f"on device {device} (free memory unknown)"


def _size(n: int) -> str:
    unit = next((u for u in range(4, 0, -1) if n >= 1 << (10 * u)), 0)
    return f"{n / (1 << (10 * unit)):,.2f} {('B', 'KiB', 'MiB', 'GiB', 'TiB')[unit]}" if unit else f"{n} B"


def check_fits(fn: str, sizes: dict[str, int], free_bytes: int | None) -> None:
    """Raise MemoryError, naming the bytes asked (per array) and free, if ``sizes`` cannot fit."""
    need = sum(sizes.values())
    where = "(the free_bytes argument)"
    if free_bytes is None:
        free_bytes, where = device_free_bytes()
    if free_bytes is None or need <= free_bytes:
        return
    detail = ", ".join(f"{k} {_size(v)}" for k, v in sizes.items())
    raise MemoryError(
        f"{fn}: the pool needs {need:,} bytes ({_size(need)}: {detail}) but {free_bytes:,} bytes "
        f"({_size(free_bytes)}) are free {where}; nothing was allocated. Allocate fewer slots, requests or "
        "drafts, or a smaller geometry"
    )


