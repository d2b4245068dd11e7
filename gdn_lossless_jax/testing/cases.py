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

from ..config import Geometry

__all__ = ["Shape", "KINDS", "verify_inputs", "verify_inputs_numpy", "channel_verify_inputs", "commit_indices",
           "commit_tapes", "CommitIndices"]

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
    seed: int | np.random.Generator,
    shape: Shape,
    *,
    kind: Kind = "normal",
    state_dtype=jnp.float32,
    input_dtype=jnp.bfloat16,
) -> dict[str, jax.Array]:
    """Arguments of :func:`gdn_lossless_jax.verify` as a dict (``state0, q, k, v, a, b, A_log, dt_bias``).

    Drawn with NumPy (fast on any shape: no per-shape compilation) from ``seed``
    (:func:`verify_inputs_numpy`), then cast on the device.

    Kinds:
      normal: states and inputs ~ N(0, 1) (state scaled by 0.5), gates in their usual range.
      cancel: ``v_t`` is ``(state0 * alpha) @ k_t`` up to a relative 1e-6 (then rounded to
        the input dtype), with decays near 1, so ``v - Sd @ k`` cancels most of its bits.
      decay_extremes: half the heads decay by ``alpha`` within an ulp of 1, half by a
        subnormal or zero ``alpha``.
      subnormal: states near the smallest normal (1e-38) and tiny v, so ``S * alpha`` and
        ``k * u`` products are subnormal.
      mixed: request i draws kind ``i % 4`` of the four above.
    """
    x = verify_inputs_numpy(seed, shape, kind=kind)
    cast = lambda a, dtype: jnp.asarray(a).astype(dtype)  # noqa: E731
    out = {n: cast(x[n], input_dtype) for n in ("q", "k", "v", "a", "b")}
    return dict(state0=cast(x["state0"], state_dtype), **out, A_log=jnp.asarray(x["A_log"]), dt_bias=jnp.asarray(x["dt_bias"]))


def verify_inputs_numpy(seed: int | np.random.Generator, shape: Shape, *, kind: Kind = "normal") -> dict[str, np.ndarray]:
    """The float32 NumPy arrays :func:`verify_inputs` casts (same keys, same kinds), with no
    device work: for callers that draw many cases (the fuzz command) or cast themselves."""
    rng = np.random.default_rng(seed)
    s = shape
    if kind == "mixed":
        parts = [verify_inputs_numpy(rng, dataclasses.replace(s, N=1), kind=KINDS[i % 4]) for i in range(s.N)]
        out = {n: np.concatenate([p[n] for p in parts]) for n in ("state0", "q", "k", "v", "a", "b")}
        out["A_log"], out["dt_bias"] = parts[0]["A_log"], parts[0]["dt_bias"]
        return out

    f32 = np.float32
    normal = lambda *shp: rng.standard_normal(shp, dtype=f32)  # noqa: E731
    state0 = 0.5 * normal(s.N, s.HV, s.V, s.K)
    q = normal(s.N, s.D, s.H, s.K)
    k = normal(s.N, s.D, s.H, s.K)
    v = normal(s.N, s.D, s.HV, s.V)
    a = normal(s.N, s.D, s.HV)
    b = normal(s.N, s.D, s.HV)
    A_log = rng.uniform(-1.0, 1.0, s.HV).astype(f32)
    dt_bias = 0.5 * normal(s.HV)

    if kind == "cancel":
        a = np.full_like(a, -25.0) - dt_bias  # softplus(-25) ~ 1e-11: alpha within an ulp of 1
        kn = k / np.sqrt(np.sum(k * k, -1, keepdims=True) + 1e-6)
        kn = np.repeat(kn, s.HV // s.H, axis=2)
        Sk = np.einsum("nhvk,ndhk->ndhv", state0, kn)
        v = (Sk * (1.0 + 1e-6 * normal(*v.shape))).astype(f32)
    elif kind == "decay_extremes":
        near_one = np.arange(s.HV) % 2 == 0
        A_log = np.where(near_one, A_log, 2.0).astype(f32)  # g ~ -exp(2) * 13.5 ~ -100: alpha ~ 1e-44
        a = np.where(near_one, -30.0 + 0.1 * a, 13.5 + 0.3 * a).astype(f32) - dt_bias
    elif kind == "subnormal":
        state0 = state0 * f32(2e-38)
        v = v * f32(1e-38)
        a = a - f32(3.0)
    elif kind != "normal":
        raise ValueError(f"verify_inputs: unknown kind {kind!r}; choose one of {KINDS}")
    return dict(state0=state0, q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias)


def channel_verify_inputs(
    seed: int | np.random.Generator,
    shape: Shape,
    *,
    kind: Kind = "normal",
    state_dtype=jnp.float32,
    input_dtype=jnp.bfloat16,
    spread: float = 0.5,
) -> dict[str, jax.Array]:
    """:func:`verify_inputs` for a per-channel decay (KDA, ``decay="channel"``): ``a [N, D, HV, K]``
    and ``dt_bias [HV, K]``, the kind's ``a`` and ``dt_bias`` (so its decays stay near 1, extreme or
    small) plus ``spread`` times N(0, 1) for each key channel, so that the channels' decays differ."""
    rng = np.random.default_rng(seed)
    x = verify_inputs_numpy(rng, shape, kind=kind)
    noise = lambda *shp: spread * rng.standard_normal(shp, dtype=np.float32)  # noqa: E731
    x["a"] = x["a"][..., None] + noise(*x["a"].shape, shape.K)
    x["dt_bias"] = x["dt_bias"][:, None] + noise(shape.HV, shape.K)
    cast = lambda a, dtype: jnp.asarray(a).astype(dtype)  # noqa: E731
    out = {n: cast(x[n], input_dtype) for n in ("q", "k", "v", "a", "b")}
    return dict(state0=cast(x["state0"], state_dtype), **out, A_log=jnp.asarray(x["A_log"]), dt_bias=jnp.asarray(x["dt_bias"]))


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
    shards: int = 1,
) -> CommitIndices:
    """Commit indices like a speculative-decoding step produces them.

    Unique slots (half the pool can be track slots), accepted steps in ``[0, D)``, about
    ``track_fraction`` of requests crossing a track boundary (``track_step <= step``).
    ``invalid`` adds a negative step, an out-of-range slot, an out-of-range row and an
    out-of-range track slot (when N allows); ``permute_rows`` maps requests to tape rows
    out of order (pipeline-stable rows).

    ``shards``: the data-parallel layout of :mod:`gdn_lossless_jax.sharding`: request block
    ``d`` (of ``N / shards``) draws its slots and rows from block ``d`` of the pool and of the
    tape, each block drawn as above with seed ``seed + d`` (its out-of-range indices stay out
    of range globally). N, the slots and the rows must divide by ``shards``.
    """
    if shards > 1:
        return _sharded_indices(seed, N=N, D=D, slots_in_pool=slots_in_pool, rows_in_tape=rows_in_tape or N,
                                track_fraction=track_fraction, invalid=invalid, permute_rows=permute_rows,
                                shards=shards)  # fmt: skip
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


def _sharded_indices(seed, *, N, D, slots_in_pool, rows_in_tape, shards, **kw) -> CommitIndices:
    S, R = slots_in_pool, rows_in_tape
    for name, n in (("N", N), ("slots_in_pool", S), ("rows_in_tape", R)):
        if n % shards:
            raise ValueError(f"commit_indices: argument {name!r}={n} must be a multiple of shards={shards}")
    B, Rb = S // shards, R // shards

    def globalize(x, d, block, total):  # in range: into block d; above it: above the whole axis
        return np.where(x < 0, x, np.where(x < block, x + d * block, x - block + total))

    parts = []
    for d in range(shards):
        ix = commit_indices(seed + d, N=N // shards, D=D, slots_in_pool=B, rows_in_tape=Rb, **kw)
        parts.append(CommitIndices(globalize(ix.slots, d, B, S), ix.steps, globalize(ix.track_slots, d, B, S),
                                   ix.track_steps, globalize(ix.rows, d, Rb, R)))  # fmt: skip
    cat = lambda f: np.concatenate([getattr(p, f) for p in parts]).astype(np.int32)  # noqa: E731
    return CommitIndices(*(cat(f.name) for f in dataclasses.fields(CommitIndices)))


def commit_tapes(seed: int, shape: Shape, *, layers: int, slots_in_pool: int):
    """Random fp32 commit inputs for timing (never zeros): a pool ``[L, S, HV, V, K]``, and
    tapes of ``layers`` layers: ``Tuples`` (u, k normal; g = -|normal|) and ``Snapshots``.
    Not a verify's output: the tests check semantics, timing only needs the shapes and data."""
    from ..tape import Snapshots, Tuples

    s, L = shape, layers
    rng = np.random.default_rng(seed)
    normal = lambda *dims: rng.standard_normal(dims, np.float32)  # noqa: E731
    pool = jnp.asarray(normal(L, slots_in_pool, s.HV, s.V, s.K))
    tuples = Tuples(
        u=jnp.asarray(normal(L, s.N, s.D, s.HV, s.V)),
        k=jnp.asarray(normal(L, s.N, s.D, s.H, s.K)),
        g=-jnp.asarray(np.abs(normal(L, s.N, s.D, s.HV))),
    )
    snapshots = Snapshots(jnp.asarray(normal(L, s.N, s.D, s.HV, s.V, s.K)))
    return pool, tuples, snapshots
