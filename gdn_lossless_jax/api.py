"""Public entry points: argument checks, backend choice, then the backend's implementation.

Every check runs on static shapes and dtypes before anything is computed or allocated,
so errors name the argument, the expected and the actual shape or dtype, also under
``jax.jit``.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import autodiff, backends, checked as checked_mode, reference
from .tape import Pending, Snapshots, Tape, Tuples

__all__ = ["verify", "replay", "commit", "commit_and_verify", "RECORD_MODES"]

RECORD_MODES = ("tuples", "snapshots")
STATE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _shape(x) -> tuple[int, ...]:
    shape = getattr(x, "shape", None)  # arrays, tracers and ShapeDtypeStructs: their own tuple (no NumPy call)
    return shape if type(shape) is tuple else tuple(np.shape(x))


def _fmt(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _dtype(x):
    return x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype


def _is_float(x) -> bool:
    d = _dtype(x)  # NumPy's own kinds answer at once; the rest (bfloat16, float8, int4: kind V) ask JAX
    return d.kind == "f" if getattr(d, "kind", "V") in "biuf" else jnp.issubdtype(d, jnp.floating)


def _is_int(x) -> bool:
    d = _dtype(x)
    return d.kind in "iu" if getattr(d, "kind", "V") in "biuf" else jnp.issubdtype(d, jnp.integer)


_INT32 = np.dtype(np.int32)  # compared as a NumPy dtype (against jnp.int32, a scalar type, it costs a hash)


def as_index(x):
    """An index argument as int32 without an eager JAX op: arrays of int32 pass through (a weakly
    typed one made plain), the rest becomes NumPy, which a jitted call takes in as part of its own
    launch. (``jnp.asarray(layer)`` of a Python int dispatched a device op of its own: a sizeable
    part of a layer call's host time.)

    Traced index arrays (inside a ``jax.jit``; rank >= 1: slots, rows, steps, not the layer)
    are :func:`staged`: the kernels read a copy the jit makes, not the caller's buffer. Not
    those a loop body (``lax.scan``) closes over: staged there, the op would run in every
    iteration (XLA does not hoist it), and XLA re-records a loop body's graph every iteration
    anyway."""
    if isinstance(x, jax.Array):
        # A weakly typed int32 (``jnp.full((n,), 3)``) is made a plain one: Pallas Triton's lowering
        # of the commit kernel failed on it on the GPU (an i1 added to an i32).
        x = x if x.dtype == _INT32 and not x.aval.weak_type else x.astype(jnp.int32)
        here = isinstance(x, jax.core.Tracer) and x.ndim >= 1 and _STAGING.get() and _traced_here(x)
        return staged(x) if here else x
    return np.asarray(x, np.int32)


_STAGING = contextvars.ContextVar("gdn_lossless_jax_staging", default=True)


def unstaged(fn):
    """``fn`` traced without :func:`staged` index arrays: for the library's own jits, whose
    Python wrappers pass their index arguments through :func:`as_index` already (which stages
    them where the caller's trace runs, not inside a loop body that calls the wrapper)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        token = _STAGING.set(False)
        try:
            return fn(*args, **kwargs)
        finally:
            _STAGING.reset(token)

    return wrapper


def _traced_here(x) -> bool:
    """Whether tracer ``x`` belongs to the trace now running (not one an inner trace, such as a
    loop body's, closes over)."""
    try:
        from jax._src import core as jcore

        return x._trace is jcore.trace_ctx.trace
    except (ImportError, AttributeError):  # other JAX internals: stage
        return True


_INT32_MIN = np.int32(np.iinfo(np.int32).min)


def staged(x: jax.Array) -> jax.Array:
    """``x`` through one elementwise op that equals it bit for bit, which XLA can neither remove
    nor fuse into a kernel: the kernels that read it read the jit's own buffer.

    Why: XLA runs a jit's kernels as a CUDA graph and re-records every kernel node whose buffers
    moved since the last launch. A serving loop passes new index arrays every step; read by all
    L verify kernels and the commit, they made each launch of an unrolled step re-record the
    whole graph (0.38 ms of host time a step at 25x4 on the H200). Staged, only this op's node
    moves; XLA merges the identical ops of the L layers into one."""
    return jnp.where(x == _INT32_MIN, _INT32_MIN, x)


def _check_rank(fn: str, name: str, x, rank: int, dims: str):
    if len(_shape(x)) != rank:
        raise ValueError(f"{fn}: argument {name!r} must have rank {rank} ({dims}), got shape {_fmt(_shape(x))}")


def _check_shape(fn: str, name: str, x, expected: Sequence[int], dims: str, source: str):
    if _shape(x) != tuple(expected):
        raise ValueError(
            f"{fn}: argument {name!r} must have shape {dims} = {_fmt(expected)} ({source}), got {_fmt(_shape(x))}"
        )


def _as_array(fn: str, name: str, x):
    """Arrays (and tracers) pass; nested lists, tuples and numbers become ``jnp`` arrays of
    JAX's default dtypes (float32 and int32 unless x64 is on); anything else is rejected."""
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return x
    if isinstance(x, (list, tuple, int, float)) and not isinstance(x, bool):
        try:
            return jnp.asarray(x)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{fn}: argument {name!r} could not be converted to an array ({e})") from e
    raise TypeError(
        f"{fn}: argument {name!r} must be an array (jax.Array, numpy array, or a nested list of numbers), "
        f"got {type(x).__name__}"
    )


def _as_arrays(fn: str, optional: tuple[str, ...] = (), **xs):
    """:func:`_as_array` of each keyword; None passes for the ``optional`` ones."""
    return [None if x is None and name in optional else _as_array(fn, name, x) for name, x in xs.items()]


def _check_float(fn: str, name: str, x):
    if not _is_float(x):
        raise TypeError(f"{fn}: argument {name!r} must be a floating-point array, got dtype {_dtype(x)}")
    if jnp.dtype(_dtype(x)).itemsize > 4:
        # Rejected like a float64 state0: everything is computed in fp32, so the library
        # would round the input silently, and results would not be reproducible from it.
        raise TypeError(
            f"{fn}: argument {name!r} must be at most 32-bit (the library computes in float32), got dtype "
            f"{_dtype(x)}; cast it with {name}.astype(jnp.float32)"
        )


def _check_static(fn: str, name: str, x):
    if isinstance(x, jax.core.Tracer):
        raise TypeError(
            f"{fn}: argument {name!r} is traced (an outer jax.jit made it an array), but it must be a Python "
            f"value: mark it static, e.g. jax.jit({fn}, static_argnames=(\"record\", \"backend\", \"scale\", "
            f"\"out_dtype\")), or bind it with functools.partial"
        )


def _check_index(fn: str, name: str, x, n: int):
    if not _is_int(x):
        raise TypeError(f"{fn}: argument {name!r} must be an integer array, got dtype {_dtype(x)}")
    _check_shape(fn, name, x, (n,), "[N]", "one per request")


def _check_state_dtype(fn: str, name: str, x):
    if jnp.dtype(x.dtype) not in STATE_DTYPES:
        hint = f"; cast it with {name}.astype(jnp.float32)" if jnp.dtype(x.dtype) == jnp.float64 else ""
        raise TypeError(f"{fn}: argument {name!r} must be float32 or bfloat16, got dtype {x.dtype}{hint}")


def _check_not_transposed(fn: str, q, k, v, a) -> None:
    """q or k passed as ``[N, H, D, K]`` instead of ``[N, D, H, K]`` are named as transposed
    (D from v and a), instead of the mismatch being blamed on v. (When D == H the shapes
    cannot tell.)"""
    N, D, H, K = _shape(q)
    others = {_shape(x)[1] for x, rank in ((v, 4), (a, 3)) if len(_shape(x)) == rank}
    if len(others) == 1 and D not in others and H in others:
        raise ValueError(
            f"{fn}: argument 'q' has shape {_fmt(_shape(q))}, which reads as [N, H, D, K]: v and a have "
            f"D={H} draft steps on axis 1. q and k must be [N, D, H, K]: pass jnp.swapaxes(q, 1, 2)"
        )
    if H != D and _shape(k) == (N, H, D, K):
        raise ValueError(
            f"{fn}: argument 'k' has shape {_fmt(_shape(k))}, which reads as [N, H, D, K] (q has D={D} draft "
            f"steps and H={H} heads). k must be [N, D, H, K] like q: pass jnp.swapaxes(k, 1, 2)"
        )


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


def _check_layer_index(fn: str, layer, L: int, what: str):
    if layer is None:
        raise ValueError(f"{fn}: {what} has a leading layer axis (L={L}): pass layer= (an int or int32 scalar)")
    if isinstance(layer, (int, np.integer)):
        if not 0 <= layer < L:
            raise ValueError(f"{fn}: argument 'layer' must be in [0, {L}) ({what}), got {layer}")
        return
    if _shape(layer) != () or not _is_int(layer):
        raise TypeError(f"{fn}: argument 'layer' must be an int or an integer scalar, got {_dtype(layer)} {_fmt(_shape(layer))}")


def _stacked_inputs(fn: str, state0, inputs: dict, slots, layer) -> dict:
    """Which inputs are stacked over the pool's layers (rank one above one layer's; the
    kernels read them at ``layer``), checked: they need the pool form with layers and
    ``layer``, and a leading axis of the pool's L. Returns ``{name: stacked}``."""
    stacked = {n: reference.stacked(n, x) for n, x in inputs.items()}
    if not any(stacked.values()):
        return stacked
    names = [n for n, st in stacked.items() if st]
    rank = {n: reference.INPUT_RANKS[n] + 1 for n in names}
    pool = _shape(state0)
    if slots is None or len(pool) != 5:
        if not stacked["q"]:  # one wrong shape, most likely: the usual checks name it
            return dict.fromkeys(stacked, False)
        raise ValueError(
            f"{fn}: argument {names[0]!r} has rank {rank[names[0]]} (stacked over layers), which needs the "
            f"pool form with layers (state0 [L, S, HV, V, K], slots= and layer=); got state0 {_fmt(pool)}"
            + ("" if slots is not None else " and no slots")
        )
    L = pool[0]
    _check_layer_index(fn, layer, L, "the pool and the stacked inputs")
    for n in names:
        if _shape(inputs[n])[0] != L:
            raise ValueError(
                f"{fn}: argument {n!r} is stacked over layers (rank {rank[n]}), so its leading axis must be "
                f"the pool's L={L}, got shape {_fmt(_shape(inputs[n]))}"
            )
    return stacked


def _check_tape_buffer(fn: str, tape, record, N: int, D: int, H: int, HV: int, V: int, K: int, state_dtype, layer):
    """The preallocated tape of ``verify(..., tape=)``; returns ``(record, layered, L)``."""
    if isinstance(tape, Tuples):
        mode, field, lead = "tuples", tape.u, (HV, V)
    elif isinstance(tape, Snapshots):
        mode, field, lead = "snapshots", tape.states, (HV, V, K)
    else:
        raise TypeError(f"{fn}: argument 'tape' must be a Tuples or Snapshots buffer, got {type(tape).__name__}")
    if record is not None and record != mode:
        raise ValueError(f"{fn}: record={record!r} but the tape buffer is a {type(tape).__name__} tape ({mode!r})")
    rank = len(_shape(field))
    name = "tape.u" if mode == "tuples" else "tape.states"
    layered = rank == 2 + len(lead) + 1
    if rank not in (2 + len(lead), 2 + len(lead) + 1):
        dims = "[L, ]R, Dmax, " + ", ".join(("HV", "V", "K")[: len(lead)])
        raise ValueError(f"{fn}: argument {name!r} must have rank {2 + len(lead)} or {3 + len(lead)} ([{dims}]), "
                         f"got shape {_fmt(_shape(field))}")  # fmt: skip
    pre = _shape(field)[: rank - len(lead) - 2]
    R, Dmax = _shape(field)[rank - len(lead) - 2 : rank - len(lead)]
    dims = ("[L, R, Dmax, " if layered else "[R, Dmax, ") + ("HV, V]" if mode == "tuples" else "HV, V, K]")
    _check_shape(fn, name, field, (*pre, R, Dmax, *lead), dims, "HV, V, K from the state")
    if Dmax < D:
        raise ValueError(f"{fn}: the tape buffer holds Dmax={Dmax} draft steps, fewer than D={D} (q has D={D})")
    if mode == "tuples":
        lead_dims = "L, R" if layered else "R"
        _check_tuples(fn, tape, (*pre, R), HV, V, K, lead_dims, prefix="tape")
        if _shape(tape.k)[len(pre) + 2] != H:
            raise ValueError(f"{fn}: argument 'tape.k' must have H={H} q/k heads (from q), got {_fmt(_shape(tape.k))}")
    elif jnp.dtype(tape.states.dtype) != jnp.dtype(state_dtype):
        raise TypeError(f"{fn}: argument 'tape.states' must have the state's dtype {state_dtype}, got {tape.states.dtype}")
    if layered:
        _check_layer_index(fn, layer, pre[0], "the tape buffer")
    return mode, layered


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
    record: str | None = None,
    scale: float | None = None,
    backend: str = "auto",
    out_dtype: Any = None,
    slots: jax.Array | None = None,
    layer: Any = None,
    tape: Tape | None = None,
    rows: jax.Array | None = None,
    parents: Any = None,
    topk: int = 1,
    out: jax.Array | None = None,
) -> tuple[jax.Array, Tape]:
    """Run D draft tokens through one GDN layer without touching the state.

    Args:
      state0: the pre-verify states (never modified; float32 or bfloat16, upcast to fp32 on
        load): ``[N, HV, V, K]``, one per request; or, with ``slots``, the state pool itself:
        ``[S, HV, V, K]``, or all layers' ``[L, S, HV, V, K]`` with ``layer``.
      q, k: ``[N, D, H, K]`` (any float dtype; bf16 in models).
      v: ``[N, D, HV, V]``.
      a, b: ``[N, D, HV]``, the raw decay and write-gate inputs.
      A_log, dt_bias: ``[HV]``.
      record: ``"tuples"`` (the lossless tape, the default) or ``"snapshots"`` (the state
        after every step); with ``tape`` it is the buffer's mode.
      scale: the query scale; ``K ** -0.5`` if None.
      backend: ``"auto"``, ``"reference"``, ``"pallas"`` or ``"triton"``.
      out_dtype: dtype of the outputs; q's dtype if None.
      slots: ``[N]`` int or None: request n's state is ``state0[slots[n]]`` (``state0[layer,
        slots[n]]``), read inside the kernels (SGLang's ``h0_indices``: no gathered copy); a
        slot outside ``[0, S)`` reads zeros, as SGLang's padding slots do.
      layer: an int or a traced int32 scalar: the layer of ``state0`` (with ``slots``), of
        ``tape`` and of the inputs, for whichever has a leading layer axis.
      tape: a preallocated tape to write into, in place when it is donated (``jax.jit(...,
        donate_argnums=...)``): :class:`Tuples` (``u [L?, R, Dmax, HV, V]``, ``k [L?, R, Dmax,
        H, K]``, ``g [L?, R, Dmax, HV]``, fp32) or :class:`Snapshots` (``[L?, R, Dmax, HV, V,
        K]`` in the state dtype), ``Dmax >= D``, the leading ``L`` optional (then ``layer``
        picks it). Request n's steps go to row ``rows[n]``, steps ``[0, D)``; every other
        element keeps its bits, and an out-of-range row writes nothing.
      rows: ``[N]`` int or None (default ``arange(N)``): the tape rows, with ``tape``.
      parents, topk: tree metadata, accepted only if it describes a linear chain
        (``parents`` ``[-1, 0, ..., D-2]`` per request, ``topk == 1``).
      out: a preallocated outputs buffer to write into, in place when it is donated:
        ``[L?, N, D, HV, V]`` in ``out_dtype`` (its dtype when ``out_dtype`` is None), the
        leading ``L`` optional (then ``layer`` picks it). The kernels store the outputs at
        ``[layer]`` of it; every other layer keeps its bits. A step that verifies every layer
        of a pool passes one ``[L, N, D, HV, V]`` buffer to all of them, so no copy stacks the
        layers' outputs (in a ``lax.scan``, carry it with the tape).
    Returns:
      ``(outputs [N, D, HV, V], tape)`` (with ``out``, the outputs buffer, updated); the tape
      is :class:`Tuples` (``u [N, D, HV, V]``, ``k [N, D, H, K]``, ``g [N, D, HV]``, fp32) or :class:`Snapshots`
      (``[N, D, HV, V, K]`` in state0's dtype), or, with ``tape``, the updated buffer.
      Outputs are identical in both modes and in every form.

    Any of the inputs may also be stacked over the pool's layers, with one more leading axis of
    the pool's L (``q, k [L, N, D, H, K]``, ``v [L, N, D, HV, V]``, ``a, b [L, N, D, HV]``,
    ``A_log, dt_bias [L, HV]``; with the pool ``[L, S, HV, V, K]``, ``slots`` and ``layer``):
    the kernels read layer ``layer`` of it in place, so a ``lax.scan`` over the layers that
    passes the stacks (the model's stacked weights, say) and its counter slices nothing.

    Arrays may be given as nested lists (converted with ``jnp.asarray``). float64 is
    rejected for every input, state0 and the parameters alike: the computation is fp32
    and would round it silently (cast with ``.astype(jnp.float32)``).

    Under ``jax.jit``, the non-array arguments must be static:
    ``jax.jit(gl.verify, static_argnames=("record", "backend", "scale", "out_dtype"))``
    (JAX rejects a string it would trace), or bind them with ``functools.partial``.

    Differentiable with respect to every floating input (``jax.grad``, ``jax.vjp``,
    ``jax.jvp``, on every backend and in every form): the values are the backend's exact
    ones, the derivatives those of the plain-float formulation of the same math
    (:func:`gdn_lossless_jax.autodiff.plain_verify`; see :mod:`gdn_lossless_jax.autodiff`).
    """
    impl, args, kw = _verify_call(
        "verify", state0, q, k, v, a, b, A_log, dt_bias, record=record, scale=scale, backend=backend,
        out_dtype=out_dtype, slots=slots, layer=layer, tape=tape, rows=rows, parents=parents, topk=topk, out=out,
    )  # fmt: skip
    outputs, new = autodiff.verify(impl, *args, **kw)
    return _strip(outputs, kw, out, "out"), _strip(new, kw, tape)


def _strip(new, kw: dict, given, key: str = "tape"):
    """A buffer as the caller gave it: without the layer axis added to a per-layer buffer."""
    if given is not None and kw[key] is not given:
        return jax.tree.map(lambda x: x[0], new)
    return new


def _check_out_buffer(fn: str, out, out_dtype, N: int, D: int, HV: int, V: int, layer):
    """The preallocated outputs of ``verify(..., out=)``; returns ``(out_dtype, layered)``."""
    rank = len(_shape(out))
    if rank not in (4, 5):
        raise ValueError(f"{fn}: argument 'out' must have rank 4 ([N, D, HV, V]) or 5 ([L, N, D, HV, V]), "
                         f"got shape {_fmt(_shape(out))}")  # fmt: skip
    layered = rank == 5
    pre = _shape(out)[:1] if layered else ()
    _check_shape(fn, "out", out, (*pre, N, D, HV, V), "[L, N, D, HV, V]" if layered else "[N, D, HV, V]",
                 "N, D from q; HV, V from the state")  # fmt: skip
    _check_float(fn, "out", out)
    if out_dtype is not None and jnp.dtype(out_dtype) != jnp.dtype(out.dtype):
        raise TypeError(f"{fn}: out_dtype={jnp.dtype(out_dtype).name} but argument 'out' is {jnp.dtype(out.dtype).name}")
    if layered:
        _check_layer_index(fn, layer, pre[0], "the outputs buffer")
    return jnp.dtype(out.dtype), layered


def _verify_call(fn, state0, q, k, v, a, b, A_log, dt_bias, *, record, scale, backend, out_dtype, slots, layer, tape,
                 rows, parents=None, topk=1, out=None):  # fmt: skip
    """Every check of :func:`verify`; returns the backend, its positional arguments and keywords."""
    if record is not None and record not in RECORD_MODES:
        raise ValueError(f"{fn}: record must be one of {RECORD_MODES}, got {record!r}")
    _check_static(fn, "scale", scale)
    _check_static(fn, "topk", topk)
    state0, q, k, v, a, b, A_log, dt_bias = _as_arrays(
        fn, state0=state0, q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias
    )
    full = dict(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    stacked = _stacked_inputs(fn, state0, full, slots, layer)
    if any(stacked.values()):  # the checks below run on one layer's shapes
        q, k, v, a, b, A_log, dt_bias = (jax.ShapeDtypeStruct(_shape(x)[1:], _dtype(x)) if stacked[n] else x
                                         for n, x in full.items())  # fmt: skip
    _check_rank(fn, "q", q, 4, "[N, D, H, K]")
    _check_not_transposed(fn, q, k, v, a)
    N, D, H = _shape(q)[:3]
    if slots is None:
        _check_rank(fn, "state0", state0, 4, "[N, HV, V, K]")
        _check_state_dtype(fn, "state0", state0)
        _, HV, V, K = _shape(state0)
        _check_shape(fn, "q", q, (_shape(state0)[0], D, H, K), "[N, D, H, K]", "N and K from state0")
        state, pool_layer = state0, None
    else:
        if len(_shape(state0)) not in (4, 5):
            raise ValueError(f"{fn}: with slots, argument 'state0' is the pool: rank 4 ([S, HV, V, K]) or 5 "
                             f"([L, S, HV, V, K]), got shape {_fmt(_shape(state0))}")  # fmt: skip
        _check_state_dtype(fn, "state0", state0)
        HV, V, K = _shape(state0)[-3:]
        _check_shape(fn, "q", q, (N, D, H, K), "[N, D, H, K]", "K from the pool")
        _check_index(fn, "slots", slots, N)
        if len(_shape(state0)) == 5:
            _check_layer_index(fn, layer, _shape(state0)[0], "the pool")
            state, pool_layer = state0, layer
        else:
            state, pool_layer = state0[None], 0
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
    buf = tape_layer = None
    if tape is not None:
        record, layered = _check_tape_buffer(fn, tape, record, N, D, H, HV, V, K, state0.dtype, layer)
        buf, tape_layer = (tape, layer) if layered else (jax.tree.map(lambda x: x[None], tape), 0)
        if rows is None:
            rows = np.arange(N, dtype=np.int32)
        _check_index(fn, "rows", rows, N)
        rows = as_index(rows)
    elif rows is not None:
        raise ValueError(f"{fn}: rows= maps requests to rows of a tape buffer: pass tape= too")
    obuf = out_layer = None
    if out is not None:
        out = _as_array(fn, "out", out)
        out_dtype, layered = _check_out_buffer(fn, out, out_dtype, N, D, HV, V, layer)
        obuf, out_layer = (out, layer) if layered else (out[None], 0)
    record = record or "tuples"
    q, k, v, a, b, A_log, dt_bias = full.values()  # the backends take the stacks
    impl = backends.resolve(backend, "verify")
    scale = float(K**-0.5 if scale is None else scale)
    out_dtype = jnp.dtype(out_dtype or q.dtype)
    kw = dict(record=record, scale=scale, out_dtype=out_dtype)
    if slots is not None:
        kw.update(slots=as_index(slots), layer=as_index(pool_layer))
    if buf is not None:
        kw.update(tape=buf, tape_layer=as_index(tape_layer), rows=rows)
    if obuf is not None:
        kw.update(out=obuf, out_layer=as_index(out_layer))
    return impl, (state, q, k, v, a, b, A_log, dt_bias), kw


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


def _tape_arrays(fn: str, tape, prefix: str):
    """The tape with list-valued fields converted (see :func:`_as_array`)."""
    if not isinstance(tape, (Tuples, Snapshots)):
        return tape
    fields = {f.name: getattr(tape, f.name) for f in dataclasses.fields(tape)}
    return tape.replace(**{name: _as_array(fn, f"{prefix}.{name}", x) for name, x in fields.items()})


def replay(
    state0: jax.Array, tuples: Tuples, steps: jax.Array, *, backend: str = "auto", checked: bool = False
) -> jax.Array:
    """Rebuild the state after draft step ``steps[i]`` from the pre-verify state.

    Args:
      state0: ``[N, HV, V, K]`` float32 or bfloat16 (upcast; the result is rounded back).
      tuples: a :class:`Tuples` tape from :func:`verify` (``u [N, D, HV, V]``,
        ``k [N, D, H, K]``, ``g [N, D, HV]``).
      steps: ``[N]`` int, 0-based: the last draft step to apply, *not* an accepted length
        (a request that accepted n drafts has step n - 1). A value outside ``[0, D)`` (a
        negative step) means no step: state0 is returned for that request, so a length
        passed by mistake returns one step too many, or state0 for a fully accepted chain.
      backend: as in :func:`verify`.
      checked: raise instead: a step outside ``[-1, D)`` names its request
        (:mod:`gdn_lossless_jax.checked`; under ``jax.jit``, functionalize with
        ``jax.experimental.checkify.checkify``).
    Returns:
      ``[N, HV, V, K]`` in state0's dtype, bit-identical to verify's snapshot of that step.
      Differentiable with respect to state0 and the tape (see :func:`verify`).
    """
    fn = "replay"
    state0, steps = _as_arrays(fn, state0=state0, steps=steps)
    tuples = _tape_arrays(fn, tuples, "tuples")
    _check_rank(fn, "state0", state0, 4, "[N, HV, V, K]")
    _check_state_dtype(fn, "state0", state0)
    N, HV, V, K = _shape(state0)
    _check_tuples(fn, tuples, (N,), HV, V, K, "N")
    _check_index(fn, "steps", steps, N)
    impl = backends.resolve(backend, "replay")
    steps = as_index(steps)
    if checked:
        checked_mode.check_steps(fn, "steps", steps, tuples.num_steps)
    return autodiff.replay(impl, state0, tuples, steps)


def _commit_index_args(fn: str, slots, steps, track_slots=None, track_steps=None, rows=None) -> list[jax.Array]:
    """Commit's index arguments checked (``[N]`` int each) and completed: no track copies
    (-1) and rows ``i`` by default. Returns ``[slots, steps, track_slots, track_steps, rows]``
    as int32."""
    slots, steps, track_slots, track_steps, rows = _as_arrays(
        fn,
        ("track_slots", "track_steps", "rows"),
        slots=slots,
        steps=steps,
        track_slots=track_slots,
        track_steps=track_steps,
        rows=rows,
    )
    _check_rank(fn, "slots", slots, 1, "[N]")
    N = _shape(slots)[0]
    _check_index(fn, "slots", slots, N)
    _check_index(fn, "steps", steps, N)
    if (track_slots is None) != (track_steps is None):
        raise ValueError(f"{fn}: give both track_slots and track_steps, or neither")
    if track_slots is None:
        track_slots = track_steps = np.full((N,), -1, np.int32)
    _check_index(fn, "track_slots", track_slots, N)
    _check_index(fn, "track_steps", track_steps, N)
    if rows is None:
        rows = np.arange(N, dtype=np.int32)
    _check_index(fn, "rows", rows, N)
    return [as_index(x) for x in (slots, steps, track_slots, track_steps, rows)]


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
    checked: bool = False,
) -> jax.Array:
    """Write each request's accepted state (and its track state) into the state pool.

    Args:
      pool: ``[L, S, HV, V, K]`` float32 or bfloat16, all GDN layers' states.
      tape: from :func:`verify` per layer, stacked with a leading layer axis:
        :class:`Tuples` (``u [L, R, D, HV, V]``, ``k [L, R, D, H, K]``, ``g [L, R, D, HV]``)
        or :class:`Snapshots` (``[L, R, D, HV, V, K]``, the pool's dtype); R >= rows used.
      slots: ``[N]`` int, the pool slot of each request (holds its pre-verify state).
      steps: ``[N]`` int, the last accepted draft step (0-based); negative: nothing written.
        **Not the accepted length**: a request that accepted n drafts has step n - 1. A
        length passed by mistake writes one step too many, and nothing at all for a fully
        accepted request (step D is out of range); ``checked=True`` catches step == D.
      track_slots, track_steps: ``[N]`` int or None, the mamba-track (prefix-cache) copy:
        the state after ``track_steps[i]`` (0-based, like steps) goes to
        ``track_slots[i]``; negative step: none.
      rows: ``[N]`` int or None, the tape row of request i (default ``i``).
      backend: as in :func:`verify`.
      checked: raise instead of skipping: every index below must be valid, and the first
        request that is not is named in the error (:mod:`gdn_lossless_jax.checked`: slots,
        rows, steps in ``[-1, D)``, track slots where a track step is given, and distinct
        destination slots). Eager calls raise ``checkify.JaxRuntimeError`` at once; under
        ``jax.jit``, functionalize with ``jax.experimental.checkify.checkify``.
    Returns:
      The new pool. The skipping rules (``checked=False``, SGLang's masking): request i is
      skipped entirely (track copy included) if ``slots[i]`` or ``rows[i]`` is out of
      range; its accepted write is skipped if ``steps[i]`` is not in ``[0, D)``; its track
      write if ``track_steps[i]`` is not in ``[0, D)`` or ``track_slots[i]`` is out of
      range. Both states come from the pre-verify state. Every other element keeps its
      bits. Duplicate destination slots are undefined. Differentiable with respect to
      the pool and the tape (see :func:`verify`).
    """
    fn = "commit"
    (pool,) = _as_arrays(fn, pool=pool)
    tape = _tape_arrays(fn, tape, "tape")
    _check_rank(fn, "pool", pool, 5, "[L, S, HV, V, K]")
    _check_state_dtype(fn, "pool", pool)
    L, _, HV, V, K = _shape(pool)
    ints = _commit_index_args(fn, slots, steps, track_slots, track_steps, rows)
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
    if checked:
        checked_mode.check_commit(fn, pool.shape[1], tape.num_rows, tape.num_steps, *ints)
    return autodiff.commit(impl, pool, tape, *ints)


def _check_pending(fn: str, pending: Pending, N: int, H: int, HV: int, V: int, K: int, state_dtype, pool_layers):
    """The pending commit's tape and indices; returns ``(tape with a layer axis, its layer or None)``."""
    if not isinstance(pending, Pending):
        raise TypeError(f"{fn}: argument 'pending' must be a gdn_lossless_jax.Pending, got {type(pending).__name__}")
    for name in ("rows", "steps", "track_slots", "track_steps"):
        _check_index(fn, f"pending.{name}", getattr(pending, name), N)
    t = pending.tape
    lead = 1 if pool_layers is None else 2
    if isinstance(t, Snapshots):
        dims = "[R, D, HV, V, K]" if lead == 1 else "[L, R, D, HV, V, K]"
        _check_rank(fn, "pending.tape.states", t.states, lead + 4, dims)
        pre = _shape(t.states)[:lead]
        _check_shape(fn, "pending.tape.states", t.states, (*pre, _shape(t.states)[lead], HV, V, K), dims,
                     "HV, V, K from the pool")  # fmt: skip
        if jnp.dtype(t.states.dtype) != jnp.dtype(state_dtype):
            raise TypeError(f"{fn}: argument 'pending.tape.states' must have the pool's dtype {state_dtype}, got {t.states.dtype}")
    elif isinstance(t, Tuples):
        _check_rank(fn, "pending.tape.u", t.u, lead + 3, "[L, R, D, HV, V]" if lead == 2 else "[R, D, HV, V]")
        pre = _shape(t.u)[:lead]
        _check_tuples(fn, t, pre, HV, V, K, "L, R" if lead == 2 else "R", prefix="pending.tape")
        if _shape(t.k)[lead + 1] != H:
            raise ValueError(f"{fn}: argument 'pending.tape.k' must have H={H} q/k heads (from q), got {_fmt(_shape(t.k))}")
    else:
        raise TypeError(f"{fn}: argument 'pending.tape' must be Tuples or Snapshots, got {type(t).__name__}")
    if lead == 2 and pre[0] != pool_layers:
        raise ValueError(f"{fn}: the pending tape has L={pre[0]} layers, the pool {pool_layers}")
    return (t, True) if lead == 2 else (jax.tree.map(lambda x: x[None], t), False)


def commit_and_verify(
    pool: jax.Array,
    pending: Pending,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    a: jax.Array,
    b: jax.Array,
    A_log: jax.Array,
    dt_bias: jax.Array,
    *,
    slots: jax.Array,
    layer: Any = None,
    tape: Tape | None = None,
    rows: jax.Array | None = None,
    record: str | None = None,
    scale: float | None = None,
    backend: str = "auto",
    out_dtype: Any = None,
    out: jax.Array | None = None,
) -> tuple[jax.Array, Tape, jax.Array]:
    """Apply the previous step's commit and verify the next drafts, reading each state once.

    A decode loop with separate calls reads every request's state twice per step and writes
    it once (``commit``, then the next ``verify``). This applies the pending commit inside
    the verify kernel: each program replays the previous step's accepted chain from the pool
    (the commit's rule, ``fma(k, u, rn(S * exp(g)))``, step by step, or the snapshot), writes
    the accepted state (and the track state) to the pool, and runs the new drafts from it. The
    pool, the outputs and the new tape are bit-identical to ``commit`` then ``verify``::

        pending = gl.Pending(prev_tape, rows, steps, track_slots, track_steps)
        out, tape, pool = gl.commit_and_verify(pool, pending, q, k, v, a, b, A_log, dt_bias, slots=slots)

    Args:
      pool: ``[S, HV, V, K]`` or ``[L, S, HV, V, K]`` (then ``layer``), float32 or bfloat16;
        returned updated (in place when donated).
      pending: :class:`Pending`: the previous step's tape (``[R', D', ...]``, with a leading
        ``L`` when the pool has one) and, per request n of this call, its row, accepted step,
        track slot and track step there (the arguments of :func:`commit`, aligned to this
        call's requests). The commit's masks apply (a request whose slot or row is out of range
        commits nothing; negative steps write nothing). Requests that left the batch are not
        here: commit them with :func:`commit` before their slots are read.
      q, k, v, a, b, A_log, dt_bias, slots, layer, tape, rows, record, scale, backend,
        out_dtype, out: as in :func:`verify` (``slots`` required: request n's state is
        ``pool[layer, slots[n]]``; the inputs may be stacked over the pool's layers).
    Returns:
      ``(outputs [N, D, HV, V], tape, pool)``. Differentiable like :func:`verify` (with
      respect to the pool, the pending tape and the inputs).

    In a jitted decode loop the two tape buffers swap roles every step: jit the step twice
    (two ``jax.jit`` objects of it, one per parity of the step), so that each executable sees
    each buffer in the same role at every call. One executable seeing them swapped re-records
    its whole CUDA graph before every launch (0.35-0.4 ms a step at 25x4 on the H200).
    """
    fn = "commit_and_verify"
    if slots is None:
        raise ValueError(f"{fn}: argument 'slots' is required (request n's state is pool[layer, slots[n]])")
    if len(_shape(q)) != 5:  # (stacked over layers: checked by verify's argument handling below)
        _check_rank(fn, "q", q, 4, "[N, D, H, K]")
    N, _, H, _ = _shape(q)[-4:]
    if len(_shape(pool)) not in (4, 5):
        raise ValueError(f"{fn}: argument 'pool' must have rank 4 ([S, HV, V, K]) or 5 ([L, S, HV, V, K]), "
                         f"got shape {_fmt(_shape(pool))}")  # fmt: skip
    _check_state_dtype(fn, "pool", pool)
    HV, V, K = _shape(pool)[-3:]
    L = _shape(pool)[0] if len(_shape(pool)) == 5 else None
    prev, layered = _check_pending(fn, pending, N, H, HV, V, K, pool.dtype, L)
    # verify's checks (shapes, the pool form, the tape buffer), through its own argument handling:
    impl, args, kw = _verify_call(
        "commit_and_verify", pool, q, k, v, a, b, A_log, dt_bias, record=record, scale=scale, backend=backend,
        out_dtype=out_dtype, slots=slots, layer=layer, tape=tape, rows=rows, out=out,
    )  # fmt: skip
    pend = tuple(as_index(getattr(pending, n)) for n in ("rows", "steps", "track_slots", "track_steps"))
    kw["pending"] = (*pend, as_index(layer if layered else 0), prev)
    outputs, new, new_pool = autodiff.verify(impl, *args, **kw)
    if L is None:
        new_pool = new_pool[0]
    return _strip(outputs, kw, out, "out"), _strip(new, kw, tape), new_pool
