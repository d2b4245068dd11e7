"""Public entry points: argument checks, backend choice, then the backend's implementation.

Every check runs on static shapes and dtypes before anything is computed or allocated,
so errors name the argument, the expected and the actual shape or dtype, also under
``jax.jit``.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import backends
from .tape import Snapshots, Tape, Tuples

__all__ = ["verify", "replay", "commit", "RECORD_MODES"]

RECORD_MODES = ("tuples", "snapshots")
STATE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _shape(x) -> tuple[int, ...]:
    return tuple(np.shape(x))


def _fmt(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _dtype(x):
    return x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype


def _is_float(x) -> bool:
    return jnp.issubdtype(_dtype(x), jnp.floating)


def _is_int(x) -> bool:
    return jnp.issubdtype(_dtype(x), jnp.integer)


def _check_rank(fn: str, name: str, x, rank: int, dims: str):
    if len(_shape(x)) != rank:
        raise ValueError(f"{fn}: argument {name!r} must have rank {rank} ({dims}), got shape {_fmt(_shape(x))}")


def _check_shape(fn: str, name: str, x, expected: Sequence[int], dims: str, source: str):
    if _shape(x) != tuple(expected):
        raise ValueError(
            f"{fn}: argument {name!r} must have shape {dims} = {_fmt(expected)} ({source}), got {_fmt(_shape(x))}"
        )


def _check_float(fn: str, name: str, x):
    if not _is_float(x):
        raise TypeError(f"{fn}: argument {name!r} must be a floating-point array, got dtype {_dtype(x)}")


def _check_index(fn: str, name: str, x, n: int):
    if not _is_int(x):
        raise TypeError(f"{fn}: argument {name!r} must be an integer array, got dtype {_dtype(x)}")
    _check_shape(fn, name, x, (n,), "[N]", "one per request")


def _check_state_dtype(fn: str, name: str, x):
    if jnp.dtype(x.dtype) not in STATE_DTYPES:
        raise TypeError(f"{fn}: argument {name!r} must be float32 or bfloat16, got dtype {x.dtype}")


def _check_heads(fn: str, H: int, HV: int):
    if H <= 0 or HV % H:
        raise ValueError(
            f"{fn}: the q/k heads H={H} must divide the v-heads HV={HV} "
            f"(v-heads [h*HV/H, (h+1)*HV/H) share k-head h)"
        )


def _check_linear_chain(fn: str, parents, topk: int, D: int):
    if topk != 1:
        raise ValueError(
            f"{fn}: topk={topk} is not supported: only linear draft chains (EAGLE/MTP top-k 1, "
            "DFLASH, DSPARK) can be replayed; tree verify needs the snapshot path of another library"
        )
    if parents is None:
        return
    try:
        p = np.asarray(parents)
    except (TypeError, jax.errors.TracerArrayConversionError) as e:
        raise ValueError(
            f"{fn}: tree/parent metadata ('parents') was given as a traced value; only linear chains "
            "are supported: pass parents=None"
        ) from e
    chain = np.arange(-1, p.shape[-1] - 1) if p.ndim else None
    if p.ndim == 0 or p.shape[-1] != D or not np.array_equal(p, np.broadcast_to(chain, p.shape)):
        raise ValueError(
            f"{fn}: tree/parent metadata ('parents') describes a tree, not a linear chain "
            f"(expected [-1, 0, 1, ..., {D - 2}] per request); only linear chains are supported"
        )


def verify(
    state0: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    a: jax.Array,
    b: jax.Array,
    A_log: jax.Array,
    dt_bias: jax.Array,
    *,
    record: str = "tuples",
    scale: float | None = None,
    backend: str = "auto",
    out_dtype: Any = None,
    parents: Any = None,
    topk: int = 1,
) -> tuple[jax.Array, Tape]:
    """Run D draft tokens through one GDN layer without touching the state.

    Args:
      state0: ``[N, HV, V, K]`` float32 or bfloat16, the pre-verify state of each request
        (upcast to fp32 on load; never modified).
      q, k: ``[N, D, H, K]`` (any float dtype; bf16 in models).
      v: ``[N, D, HV, V]``.
      a, b: ``[N, D, HV]``, the raw decay and write-gate inputs.
      A_log, dt_bias: ``[HV]``.
      record: ``"tuples"`` (the lossless tape) or ``"snapshots"`` (the state after every step).
      scale: the query scale; ``K ** -0.5`` if None.
      backend: ``"auto"``, ``"reference"``, ``"pallas"`` or ``"triton"``.
      out_dtype: dtype of the outputs; q's dtype if None.
      parents, topk: tree metadata, accepted only if it describes a linear chain
        (``parents`` ``[-1, 0, ..., D-2]`` per request, ``topk == 1``).
    Returns:
      ``(outputs [N, D, HV, V], tape)``; the tape is :class:`Tuples` (``u [N, D, HV, V]``,
      ``k [N, D, H, K]``, ``g [N, D, HV]``, fp32) or :class:`Snapshots`
      (``[N, D, HV, V, K]`` in state0's dtype). Outputs are identical in both modes.
    """
    fn = "verify"
    if record not in RECORD_MODES:
        raise ValueError(f"{fn}: record must be one of {RECORD_MODES}, got {record!r}")
    _check_rank(fn, "state0", state0, 4, "[N, HV, V, K]")
    _check_state_dtype(fn, "state0", state0)
    N, HV, V, K = _shape(state0)
    _check_rank(fn, "q", q, 4, "[N, D, H, K]")
    D, H = _shape(q)[1], _shape(q)[2]
    _check_shape(fn, "q", q, (N, D, H, K), "[N, D, H, K]", "N and K from state0")
    _check_shape(fn, "k", k, (N, D, H, K), "[N, D, H, K]", "from state0 and q")
    _check_shape(fn, "v", v, (N, D, HV, V), "[N, D, HV, V]", "from state0 and q")
    _check_shape(fn, "a", a, (N, D, HV), "[N, D, HV]", "from state0 and q")
    _check_shape(fn, "b", b, (N, D, HV), "[N, D, HV]", "from state0 and q")
    _check_shape(fn, "A_log", A_log, (HV,), "[HV]", "from state0")
    _check_shape(fn, "dt_bias", dt_bias, (HV,), "[HV]", "from state0")
    for name, x in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias)):
        _check_float(fn, name, x)
    if D < 1:
        raise ValueError(f"{fn}: need at least one draft step, got D={D} (q has shape {_fmt(_shape(q))})")
    _check_heads(fn, H, HV)
    _check_linear_chain(fn, parents, topk, D)
    impl = backends.resolve(backend, "verify")
    scale = float(K**-0.5 if scale is None else scale)
    out_dtype = jnp.dtype(out_dtype or q.dtype)
    return impl.verify(state0, q, k, v, a, b, A_log, dt_bias, record=record, scale=scale, out_dtype=out_dtype)


def _check_tuples(
    fn: str, tuples: Tuples, lead: tuple[int, ...], HV: int, V: int, K: int, lead_dims: str, prefix: str = "tuples"
):
    if not isinstance(tuples, Tuples):
        raise TypeError(f"{fn}: the tape must be a Tuples tape here, got {type(tuples).__name__}")
    nl = len(lead)
    _check_rank(fn, f"{prefix}.u", tuples.u, nl + 3, f"[{lead_dims}, D, HV, V]")
    D = _shape(tuples.u)[nl]
    source = "L, HV, V from the pool" if nl == 2 else "HV, V from the state"
    _check_shape(fn, f"{prefix}.u", tuples.u, (*lead, D, HV, V), f"[{lead_dims}, D, HV, V]", source)
    _check_rank(fn, f"{prefix}.k", tuples.k, nl + 3, f"[{lead_dims}, D, H, K]")
    H = _shape(tuples.k)[nl + 1]
    _check_shape(fn, f"{prefix}.k", tuples.k, (*lead, D, H, K), f"[{lead_dims}, D, H, K]", "from the u field and K")
    _check_shape(fn, f"{prefix}.g", tuples.g, (*lead, D, HV), f"[{lead_dims}, D, HV]", "from the u field")
    for name in ("u", "k", "g"):
        x = getattr(tuples, name)
        if jnp.dtype(x.dtype) != jnp.float32:
            raise TypeError(f"{fn}: argument '{prefix}.{name}' must be float32 (the tape is always fp32), got {x.dtype}")
    _check_heads(fn, H, HV)


def replay(state0: jax.Array, tuples: Tuples, steps: jax.Array, *, backend: str = "auto") -> jax.Array:
    """Rebuild the state after draft step ``steps[i]`` from the pre-verify state.

    Args:
      state0: ``[N, HV, V, K]`` float32 or bfloat16 (upcast; the result is rounded back).
      tuples: a :class:`Tuples` tape from :func:`verify` (``u [N, D, HV, V]``,
        ``k [N, D, H, K]``, ``g [N, D, HV]``).
      steps: ``[N]`` int, 0-based; a value outside ``[0, D)`` (a negative step) means no
        step: state0 is returned for that request.
    Returns:
      ``[N, HV, V, K]`` in state0's dtype, bit-identical to verify's snapshot of that step.
    """
    fn = "replay"
    _check_rank(fn, "state0", state0, 4, "[N, HV, V, K]")
    _check_state_dtype(fn, "state0", state0)
    N, HV, V, K = _shape(state0)
    _check_tuples(fn, tuples, (N,), HV, V, K, "N")
    _check_index(fn, "steps", steps, N)
    impl = backends.resolve(backend, "replay")
    return impl.replay(state0, tuples, jnp.asarray(steps, jnp.int32))


def commit(
    pool: jax.Array,
    tape: Tape,
    slots: jax.Array,
    steps: jax.Array,
    track_slots: jax.Array | None = None,
    track_steps: jax.Array | None = None,
    rows: jax.Array | None = None,
    *,
    backend: str = "auto",
) -> jax.Array:
    """Write each request's accepted state (and its track state) into the state pool.

    Args:
      pool: ``[L, S, HV, V, K]`` float32 or bfloat16, all GDN layers' states.
      tape: from :func:`verify` per layer, stacked with a leading layer axis:
        :class:`Tuples` (``u [L, R, D, HV, V]``, ``k [L, R, D, H, K]``, ``g [L, R, D, HV]``)
        or :class:`Snapshots` (``[L, R, D, HV, V, K]``, the pool's dtype); R >= rows used.
      slots: ``[N]`` int, the pool slot of each request (holds its pre-verify state).
      steps: ``[N]`` int, the last accepted draft step (0-based); negative: nothing written.
      track_slots, track_steps: ``[N]`` int or None, the mamba-track (prefix-cache) copy:
        the state after ``track_steps[i]`` goes to ``track_slots[i]``; negative step: none.
      rows: ``[N]`` int or None, the tape row of request i (default ``i``).
    Returns:
      The new pool. Request i is skipped entirely (track copy included) if ``slots[i]`` or
      ``rows[i]`` is out of range; its accepted write is skipped if ``steps[i]`` is not in
      ``[0, D)``; its track write if ``track_steps[i]`` is not in ``[0, D)`` or
      ``track_slots[i]`` is out of range. Both states come from the pre-verify state.
      Every other element keeps its bits. Duplicate destination slots are undefined.
    """
    fn = "commit"
    _check_rank(fn, "pool", pool, 5, "[L, S, HV, V, K]")
    _check_state_dtype(fn, "pool", pool)
    L, _, HV, V, K = _shape(pool)
    _check_rank(fn, "slots", slots, 1, "[N]")
    N = _shape(slots)[0]
    _check_index(fn, "slots", slots, N)
    _check_index(fn, "steps", steps, N)
    if (track_slots is None) != (track_steps is None):
        raise ValueError(f"{fn}: give both track_slots and track_steps, or neither")
    if track_slots is None:
        track_slots = track_steps = jnp.full((N,), -1, jnp.int32)
    _check_index(fn, "track_slots", track_slots, N)
    _check_index(fn, "track_steps", track_steps, N)
    if rows is None:
        rows = jnp.arange(N, dtype=jnp.int32)
    _check_index(fn, "rows", rows, N)
    if isinstance(tape, Snapshots):
        _check_rank(fn, "tape.states", tape.states, 6, "[L, R, D, HV, V, K]")
        R, D = _shape(tape.states)[1:3]
        _check_shape(fn, "tape.states", tape.states, (L, R, D, HV, V, K), "[L, R, D, HV, V, K]", "L, HV, V, K from pool")
        if tape.states.dtype != pool.dtype:
            raise TypeError(f"{fn}: snapshot dtype {tape.states.dtype} must match the pool dtype {pool.dtype}")
    elif isinstance(tape, Tuples):
        _check_rank(fn, "tape.u", tape.u, 5, "[L, R, D, HV, V]")
        R = _shape(tape.u)[1]
        _check_tuples(fn, tape, (L, R), HV, V, K, "L, R", prefix="tape")
    else:
        raise TypeError(f"{fn}: tape must be Tuples or Snapshots, got {type(tape).__name__}")
    impl = backends.resolve(backend, "commit")
    ints = [jnp.asarray(x, jnp.int32) for x in (slots, steps, track_slots, track_steps, rows)]
    return impl.commit(pool, tape, *ints)
