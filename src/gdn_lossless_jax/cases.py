"""Input factories shared by tests, benchmarks, the command-line tool and notebooks.

Inputs are never zeros: random normals, plus adversarial kinds that stress the rounding
rule (large cancellation in ``v - S k``, decays near 0 and 1, subnormal products).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from .config import Geometry

__all__ = ["Shape", "KINDS", "verify_inputs", "commit_indices", "CommitIndices"]

Kind = Literal["normal", "cancel", "decay_extremes", "subnormal", "mixed"]
KINDS: tuple[str, ...] = ("normal", "cancel", "decay_extremes", "subnormal", "mixed")


@dataclasses.dataclass(frozen=True)
class Shape:
    """One verify problem: N requests of D draft steps over H/HV heads of K x V."""

    N: int
    D: int
    H: int
    HV: int
    K: int
    V: int

    @classmethod
    def of(cls, geometry: Geometry, N: int, D: int) -> "Shape":
        g = geometry
        return cls(N, D, g.num_k_heads, g.num_v_heads, g.head_k_dim, g.head_v_dim)


def verify_inputs(
    key: jax.Array,
    shape: Shape,
    *,
    kind: Kind = "normal",
    state_dtype=jnp.float32,
    input_dtype=jnp.bfloat16,
) -> dict[str, jax.Array]:
    """Arguments of :func:`gdn_lossless_jax.verify` as a dict (``state0, q, k, v, a, b, A_log, dt_bias``).

    Kinds:
      normal: states and inputs ~ N(0, 1) (state scaled by 0.5), gates in their usual range.
      cancel: ``v_t`` is ``(state0 * alpha) @ k_t`` up to a relative 1e-6 (then rounded to
        the input dtype), with decays near 1, so ``v - Sd @ k`` cancels most of its bits.
      decay_extremes: half the heads decay by ``alpha`` within an ulp of 1, half by a
        subnormal or zero ``alpha``.
      subnormal: states near the smallest normal (1e-38) and tiny v, so ``S * alpha`` and
        ``k * u`` products are subnormal.
      mixed: each request draws one of the kinds above.
    """
    s = shape
    if kind == "mixed":
        keys = jax.random.split(key, s.N)
        parts = [
            verify_inputs(
                kk,
                dataclasses.replace(s, N=1),
                kind=KINDS[i % 4],
                state_dtype=state_dtype,
                input_dtype=input_dtype,
            )
            for i, kk in enumerate(keys)
        ]
        out = {n: jnp.concatenate([p[n] for p in parts]) for n in ("state0", "q", "k", "v", "a", "b")}
        out["A_log"], out["dt_bias"] = parts[0]["A_log"], parts[0]["dt_bias"]
        return out

    ks = jax.random.split(key, 8)
    f32 = jnp.float32
    state0 = 0.5 * jax.random.normal(ks[0], (s.N, s.HV, s.V, s.K), f32)
    q = jax.random.normal(ks[1], (s.N, s.D, s.H, s.K), f32)
    k = jax.random.normal(ks[2], (s.N, s.D, s.H, s.K), f32)
    v = jax.random.normal(ks[3], (s.N, s.D, s.HV, s.V), f32)
    a = jax.random.normal(ks[4], (s.N, s.D, s.HV), f32)
    b = jax.random.normal(ks[5], (s.N, s.D, s.HV), f32)
    A_log = jax.random.uniform(ks[6], (s.HV,), f32, -1.0, 1.0)
    dt_bias = 0.5 * jax.random.normal(ks[7], (s.HV,), f32)

    if kind == "cancel":
        a = jnp.full_like(a, -25.0) - dt_bias  # softplus(-25) ~ 1e-11: alpha within an ulp of 1
        kn = k / jnp.sqrt(jnp.sum(k * k, -1, keepdims=True) + 1e-6)
        kn = jnp.repeat(kn, s.HV // s.H, axis=2)
        Sk = jnp.einsum("nhvk,ndhk->ndhv", state0, kn, precision="highest")
        v = Sk * (1.0 + 1e-6 * jax.random.normal(ks[3], v.shape, f32))
    elif kind == "decay_extremes":
        near_one = jnp.arange(s.HV) % 2 == 0
        A_log = jnp.where(near_one, A_log, 2.0)  # exp(2) * ~13 ~ 96: alpha ~ 1e-42 (subnormal)
        a = jnp.where(near_one, -30.0 + 0.1 * a, 11.0 + 2.0 * a) - dt_bias
    elif kind == "subnormal":
        state0 = state0 * 2e-38
        v = v * 1e-38
        a = a - 3.0
    elif kind != "normal":
        raise ValueError(f"verify_inputs: unknown kind {kind!r}; choose one of {KINDS}")

    cast = lambda x: x.astype(input_dtype)  # noqa: E731
    return dict(
        state0=state0.astype(state_dtype),
        q=cast(q),
        k=cast(k),
        v=cast(v),
        a=cast(a),
        b=cast(b),
        A_log=A_log,
        dt_bias=dt_bias,
    )


@dataclasses.dataclass(frozen=True)
class CommitIndices:
    """Per-request commit arguments (all ``[N]`` int32) and which rows are valid."""

    slots: np.ndarray
    steps: np.ndarray
    track_slots: np.ndarray
    track_steps: np.ndarray
    rows: np.ndarray

    def as_args(self):
        return tuple(jnp.asarray(x, jnp.int32) for x in (self.slots, self.steps, self.track_slots, self.track_steps, self.rows))


def commit_indices(
    seed: int,
    *,
    N: int,
    D: int,
    slots_in_pool: int,
    rows_in_tape: int | None = None,
    track_fraction: float = 0.25,
    invalid: bool = False,
    permute_rows: bool = False,
) -> CommitIndices:
    """Commit indices like a speculative-decoding step produces them.

    Unique slots (half the pool can be track slots), accepted steps in ``[0, D)``, about
    ``track_fraction`` of requests crossing a track boundary (``track_step <= step``).
    ``invalid`` adds a negative step, an out-of-range slot, an out-of-range row and an
    out-of-range track slot (when N allows); ``permute_rows`` maps requests to tape rows
    out of order (pipeline-stable rows).
    """
    rng = np.random.default_rng(seed)
    R = rows_in_tape or N
    if 2 * N > slots_in_pool:
        raise ValueError(f"commit_indices: need at least 2*N={2 * N} pool slots, got {slots_in_pool}")
    perm = rng.permutation(slots_in_pool)
    slots, track_slots = perm[:N].copy(), perm[N : 2 * N].copy()
    steps = rng.integers(0, D, N)
    crossing = rng.random(N) < track_fraction
    crossing[0] = True  # at least one track copy
    track_steps = np.where(crossing, rng.integers(0, steps + 1), -1)
    rows = rng.permutation(R)[:N] if permute_rows else np.arange(N)
    if invalid and N >= 2:
        steps[1] = -1  # nothing accepted
        if N >= 3:
            slots[2] = slots_in_pool + 3  # own slot out of range: skipped, track copy included
            track_steps[2] = 0
        if N >= 4:
            rows[3] = R + 1  # row out of range
        if N >= 5:
            track_slots[4], track_steps[4] = -7, 0  # track slot out of range
    i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    return CommitIndices(i32(slots), i32(steps), i32(track_slots), i32(track_steps), i32(rows))
