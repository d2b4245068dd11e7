"""Argument checks shared by every entry point (:mod:`~gdn_lossless_jax.api`, the pool, the
conv, sharding).

Each check runs on static shapes and dtypes before anything is computed or allocated, and
raises naming the function, the argument, the expected and the actual value, also under
``jax.jit``. Checked index arguments leave as int32 (:func:`gdn_lossless_jax.staging.as_index`).
A tape is checked against its record mode's layout (:meth:`gdn_lossless_jax.tape.Tape.layout`),
whatever the mode.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import _deprecated, reference, tree
from .backends.contract import VerifyCall
from .staging import as_index
from .tape import RECORD_MODES, STATE_DTYPE, TAPES, Pending, Tape, _tape_names, record_type

MATH_MODES = reference.MATH_MODES


STATE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def shape_of(x) -> tuple[int, ...]:
    shape = getattr(x, "shape", None)  # arrays, tracers and ShapeDtypeStructs: their own tuple (no NumPy call)
    return shape if type(shape) is tuple else tuple(np.shape(x))


def fmt_shape(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def dtype_of(x):
    return x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype


def is_float(x) -> bool:
    d = dtype_of(x)  # NumPy's own kinds answer at once; the rest (bfloat16, float8, int4: kind V) ask JAX
    return d.kind == "f" if getattr(d, "kind", "V") in "biuf" else jnp.issubdtype(d, jnp.floating)


def is_int(x) -> bool:
    d = dtype_of(x)
    return d.kind in "iu" if getattr(d, "kind", "V") in "biuf" else jnp.issubdtype(d, jnp.integer)


def check_rank(fn: str, name: str, x, rank: int, dims: str):
    if len(shape_of(x)) != rank:
        raise ValueError(f"{fn}: argument {name!r} must have rank {rank} ({dims}), got shape {fmt_shape(shape_of(x))}")


def check_shape(fn: str, name: str, x, expected: Sequence[int], dims: str, source: str):
    if shape_of(x) != tuple(expected):
        raise ValueError(
            f"{fn}: argument {name!r} must have shape {dims} = {fmt_shape(expected)} ({source}), got {fmt_shape(shape_of(x))}"
        )


def as_array(fn: str, name: str, x):
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


def as_arrays(fn: str, optional: tuple[str, ...] = (), **xs):
    """:func:`as_array` of each keyword; None passes for the ``optional`` ones."""
    return [None if x is None and name in optional else as_array(fn, name, x) for name, x in xs.items()]


def check_float(fn: str, name: str, x):
    if not is_float(x):
        raise TypeError(f"{fn}: argument {name!r} must be a floating-point array, got dtype {dtype_of(x)}")
    if jnp.dtype(dtype_of(x)).itemsize > 4:
        # Rejected like a float64 state0: everything is computed in fp32, so the library
        # would round the input silently, and results would not be reproducible from it.
        raise TypeError(
            f"{fn}: argument {name!r} must be at most 32-bit (the library computes in float32), got dtype "
            f"{dtype_of(x)}; cast it with {name}.astype(jnp.float32)"
        )


def check_static(fn: str, name: str, x):
    if isinstance(x, jax.core.Tracer):
        raise TypeError(
            f"{fn}: argument {name!r} is traced (an outer jax.jit made it an array), but it must be a Python "
            f"value: mark it static, e.g. jax.jit({fn}, static_argnames=(\"record\", \"backend\", \"scale\", "
            f"\"out_dtype\")), or bind it with functools.partial"
        )


def as_scale(fn: str, scale, K: int) -> float:
    """The query scale as a Python float: ``K ** -0.5`` when None."""
    check_static(fn, "scale", scale)
    if scale is None:
        return float(K**-0.5)
    try:
        return float(scale)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{fn}: argument 'scale' must be a real number or None, got {type(scale).__name__} {scale!r}") from e


def check_index(fn: str, name: str, x, n: int):
    if not is_int(x):
        raise TypeError(f"{fn}: argument {name!r} must be an integer array, got dtype {dtype_of(x)}")
    check_shape(fn, name, x, (n,), "[N]", "one per request")


def check_state_dtype(fn: str, name: str, x):
    if jnp.dtype(x.dtype) not in STATE_DTYPES:
        hint = f"; cast it with {name}.astype(jnp.float32)" if jnp.dtype(x.dtype) == jnp.float64 else ""
        raise TypeError(f"{fn}: argument {name!r} must be float32 or bfloat16, got dtype {x.dtype}{hint}")


def check_not_transposed(fn: str, q, k, v, a) -> None:
    """q or k passed as ``[N, H, D, K]`` instead of ``[N, D, H, K]`` are named as transposed
    (D from v and a), instead of the mismatch being blamed on v. (When D == H the shapes
    cannot tell.)"""
    N, D, H, K = shape_of(q)
    others = {shape_of(x)[1] for x, rank in ((v, 4), (a, 3)) if len(shape_of(x)) == rank}
    if len(others) == 1 and D not in others and H in others:
        raise ValueError(
            f"{fn}: argument 'q' has shape {fmt_shape(shape_of(q))}, which reads as [N, H, D, K]: v and a have "
            f"D={H} draft steps on axis 1. q and k must be [N, D, H, K]: pass jnp.swapaxes(q, 1, 2)"
        )
    if H != D and shape_of(k) == (N, H, D, K):
        raise ValueError(
            f"{fn}: argument 'k' has shape {fmt_shape(shape_of(k))}, which reads as [N, H, D, K] (q has D={D} draft "
            f"steps and H={H} heads). k must be [N, D, H, K] like q: pass jnp.swapaxes(k, 1, 2)"
        )


def check_state_layout(fn: str, state0, q, v) -> None:
    """A state (or pool) whose last two axes read as ``[K, V]`` instead of ``[V, K]`` (K from q, V
    from v) is named as transposed, instead of the mismatch being blamed on q. (When V == K the
    shapes cannot tell.)"""
    st, qs, vs = shape_of(state0), shape_of(q), shape_of(v)
    if len(st) < 2 or len(qs) < 1 or len(vs) < 1:
        return
    K, V = qs[-1], vs[-1]
    if K != V and st[-2:] == (K, V):
        raise ValueError(
            f"{fn}: argument 'state0' has shape {fmt_shape(st)}, whose last axes read as [K, V] = [{K}, {V}] (K from q, "
            f"V from v); the state layout is [..., V, K] (SGLang's): pass jnp.swapaxes(state0, -1, -2)"
        )


def check_heads(fn: str, H: int, HV: int):
    if H <= 0 or HV % H:
        raise ValueError(
            f"{fn}: the q/k heads H={H} must divide the v-heads HV={HV} "
            f"(v-heads [h*HV/H, (h+1)*HV/H) share k-head h)"
        )


def check_topk(fn: str, topk) -> None:
    """``topk``: a static positive integer, the most children a draft node may have."""
    check_static(fn, "topk", topk)
    if not isinstance(topk, (int, np.integer)) or isinstance(topk, bool) or topk < 1:
        raise ValueError(f"{fn}: argument 'topk' must be a positive integer (the most children a draft node may "
                         f"have), got {topk!r}")  # fmt: skip


def check_tree(fn: str, parents, topk, N: int, D: int):
    """The draft tree of a verify: None for the linear chain (the fast path), else ``parents`` as
    int32 ``[N, D]`` (:mod:`gdn_lossless_jax.tree`).

    ``topk`` (static, >= 1) is the most children a node may have; ``topk > 1`` needs ``parents``.
    ``parents`` ``[D]`` (every request's) or ``[N, D]``, integers: host values (NumPy, lists, concrete
    arrays) are checked here (each parent in ``[-1, d)``: no cycle, no parent after its child, none
    out of range; at most ``topk`` children a node), and a chain in every row takes the chain's path;
    traced values take the tree's path, checked with ``checked=True``
    (:func:`gdn_lossless_jax.tree.checkify_parents`).
    """
    check_topk(fn, topk)
    if parents is None:
        if topk != 1:
            raise ValueError(
                f"{fn}: topk={topk} is not supported without parents: a draft tree is given by its parents "
                f"([N, D] or [D], node d's parent in [-1, d)); with parents=None the drafts are a linear chain"
            )
        return None
    parents = as_array(fn, "parents", parents)
    if not is_int(parents):
        raise TypeError(f"{fn}: argument 'parents' must be an integer array, got dtype {dtype_of(parents)}")
    shape = shape_of(parents)
    if shape not in ((D,), (N, D)):
        raise ValueError(
            f"{fn}: argument 'parents' must have shape [D] = [{D}] or [N, D] = [{N}, {D}] (node d's parent in "
            f"[-1, d), N and D from q), got {fmt_shape(shape)}"
        )
    if not isinstance(parents, jax.core.Tracer):
        host = np.broadcast_to(np.asarray(parents), (N, D))
        tree.check_parents_values(fn, host, topk)
        if tree.is_chain(host):
            return None
        return host.astype(np.int32)
    return jnp.broadcast_to(as_index(parents), (N, D))


def check_layer_index(fn: str, layer, L: int, what: str):
    if layer is None:
        raise ValueError(f"{fn}: {what} has a leading layer axis (L={L}): pass layer= (an int or int32 scalar)")
    if isinstance(layer, (int, np.integer)):
        if not 0 <= layer < L:
            raise ValueError(f"{fn}: argument 'layer' must be in [0, {L}) ({what}), got {layer}")
        return
    if shape_of(layer) != () or not is_int(layer):
        raise TypeError(f"{fn}: argument 'layer' must be an int or an integer scalar, got {dtype_of(layer)} {fmt_shape(shape_of(layer))}")


def stacked_inputs(fn: str, state0, inputs: dict, slots, layer, decay: str = "scalar") -> dict:
    """Which inputs are stacked over the pool's layers (rank one above one layer's; the
    kernels read them at ``layer``), checked: they need the pool form with layers and
    ``layer``, and a leading axis of the pool's L. Returns ``{name: stacked}``."""
    stacked = {n: reference.stacked(n, x, decay) for n, x in inputs.items()}
    if not any(stacked.values()):
        return stacked
    names = [n for n, st in stacked.items() if st]
    rank = {n: reference.input_ranks(decay)[n] + 1 for n in names}
    pool = shape_of(state0)
    if slots is None or len(pool) != 5:
        if not stacked["q"]:  # one wrong shape, most likely: the usual checks name it
            return dict.fromkeys(stacked, False)
        raise ValueError(
            f"{fn}: argument {names[0]!r} has rank {rank[names[0]]} (stacked over layers), which needs the "
            f"pool form with layers (state0 [L, S, HV, V, K], slots= and layer=); got state0 {fmt_shape(pool)}"
            + ("" if slots is not None else " and no slots")
        )
    L = pool[0]
    check_layer_index(fn, layer, L, "the pool and the stacked inputs")
    for n in names:
        if shape_of(inputs[n])[0] != L:
            raise ValueError(
                f"{fn}: argument {n!r} is stacked over layers (rank {rank[n]}), so its leading axis must be "
                f"the pool's L={L}, got shape {fmt_shape(shape_of(inputs[n]))}"
            )
    return stacked


def check_tape(fn: str, tape: Tape, lead: tuple[int, ...], lead_dims: str, *, prefix: str, HV: int, V: int, K: int,
               H: int | None = None, state_dtype=None, what: str = "pool", source: str = "",
               steps: str = "D") -> int:  # fmt: skip
    """Every field of ``tape`` shaped ``[*lead, D, ...]`` as its record mode's layout says
    (:meth:`~gdn_lossless_jax.tape.Tape.layout`; ``H`` None: the tape's own q/k heads, which must
    divide HV) and of its dtype (a field in the state's dtype must have ``state_dtype``, the
    ``what``'s, where given). Returns D (from the first field)."""
    cls = type(tape)
    layout = cls.layout(H=H, HV=HV, V=V, K=K)
    nl, D, sizes, first = len(lead), None, {}, next(iter(layout))
    for name, f in layout.items():
        x, label, dims = getattr(tape, name), f"{prefix}.{name}", f"[{lead_dims}, {steps}, {f.dims}]"
        check_rank(fn, label, x, nl + 1 + len(f.shape), dims)
        shape = shape_of(x)
        D = shape[nl] if D is None else D
        trailing = tuple(shape[nl + 1 + i] if n is None else n for i, n in enumerate(f.shape))
        sizes.update((d, n) for d, n in zip(f.dims.split(", "), trailing) if d not in sizes)
        check_shape(fn, label, x, (*lead, D, *trailing), dims, source if name == first else f"from the {first} field")
    for name, f in layout.items():
        x = getattr(tape, name)
        if f.dtype == STATE_DTYPE:
            if state_dtype is not None and jnp.dtype(x.dtype) != jnp.dtype(state_dtype):
                raise TypeError(f"{fn}: {cls.noun} dtype {x.dtype} must match the {what} dtype "
                                f"{jnp.dtype(state_dtype)} (argument '{prefix}.{name}')")  # fmt: skip
        elif jnp.dtype(x.dtype) != jnp.dtype(f.dtype):
            always = "fp32" if jnp.dtype(f.dtype) == jnp.float32 else jnp.dtype(f.dtype)
            raise TypeError(f"{fn}: argument '{prefix}.{name}' must be {jnp.dtype(f.dtype)} (the tape is always "
                            f"{always}), got {x.dtype}")
    if "H" in sizes:
        check_heads(fn, sizes["H"], HV)
    return D


def check_tape_buffer(fn: str, tape, record, N: int, D: int, H: int, HV: int, V: int, K: int, state_dtype, layer,
                      decay: str = "scalar"):  # fmt: skip
    """The preallocated tape of ``verify(..., tape=)``, in any record mode; returns ``(its tape
    class, layered)``."""
    if not isinstance(tape, Tape):
        raise TypeError(f"{fn}: argument 'tape' must be a tape buffer (one of {_tape_names()}), got "
                        f"{type(tape).__name__}")
    cls = type(tape)
    if decay not in cls.decays:
        raise ValueError(f"{fn}: decay={decay!r} but the tape buffer is a {cls.__name__} tape, which records a "
                         f"{'/'.join(cls.decays)} decay")  # fmt: skip
    if record is not None and record_type(record, fn, decay) is not cls:
        raise ValueError(f"{fn}: record={record_type(record, fn, decay).mode!r} but the tape buffer is a "
                         f"{cls.__name__} tape ({cls.mode!r})")  # fmt: skip
    first, f0 = next(iter(cls.layout(H=H, HV=HV, V=V, K=K).items()))
    field, t = getattr(tape, first), len(f0.shape)
    rank = len(shape_of(field))
    if rank not in (2 + t, 3 + t):
        raise ValueError(f"{fn}: argument 'tape.{first}' must have rank {2 + t} or {3 + t} "
                         f"([[L, ]R, Dmax, {f0.dims}]), got shape {fmt_shape(shape_of(field))}")  # fmt: skip
    layered = rank == 3 + t
    pre = shape_of(field)[: rank - t - 2]
    R, Dmax = shape_of(field)[rank - t - 2 : rank - t]
    check_tape(fn, tape, (*pre, R), "L, R" if layered else "R", prefix="tape", H=H, HV=HV, V=V, K=K,
               state_dtype=state_dtype, what="state", source="HV, V, K from the state", steps="Dmax")  # fmt: skip
    if Dmax < D:
        raise ValueError(f"{fn}: the tape buffer holds Dmax={Dmax} draft steps, fewer than D={D} (q has D={D})")
    if layered:
        check_layer_index(fn, layer, pre[0], "the tape buffer")
    return cls, layered


def check_out_buffer(fn: str, out, out_dtype, N: int, D: int, HV: int, V: int, layer):
    """The preallocated outputs of ``verify(..., out=)``; returns ``(out_dtype, layered)``."""
    rank = len(shape_of(out))
    if rank not in (4, 5):
        raise ValueError(f"{fn}: argument 'out' must have rank 4 ([N, D, HV, V]) or 5 ([L, N, D, HV, V]), "
                         f"got shape {fmt_shape(shape_of(out))}")  # fmt: skip
    layered = rank == 5
    pre = shape_of(out)[:1] if layered else ()
    check_shape(fn, "out", out, (*pre, N, D, HV, V), "[L, N, D, HV, V]" if layered else "[N, D, HV, V]",
                 "N, D from q; HV, V from the state")  # fmt: skip
    check_float(fn, "out", out)
    if out_dtype is not None and jnp.dtype(out_dtype) != jnp.dtype(out.dtype):
        raise TypeError(f"{fn}: out_dtype={jnp.dtype(out_dtype).name} but argument 'out' is {jnp.dtype(out.dtype).name}")
    if layered:
        check_layer_index(fn, layer, pre[0], "the outputs buffer")
    return jnp.dtype(out.dtype), layered


def resolve_decay(fn: str, decay, *tapes) -> str:
    """The ``decay=`` form of a call (:data:`gdn_lossless_jax.reference.DECAYS`, a static string):
    ``decay`` where given; None: the first tape's among ``tapes`` whose class records one decay only
    (a :class:`~gdn_lossless_jax.tape.KDATuples` buffer tells ``"channel"``), else ``"scalar"``."""
    check_static(fn, "decay", decay)
    if decay is None:
        for t in tapes:
            if isinstance(t, Tape) and len(type(t).decays) == 1:
                return type(t).decays[0]
        return "scalar"
    if not isinstance(decay, str) or decay not in reference.DECAYS:
        raise ValueError(f"{fn}: decay must be one of {reference.DECAYS} ('scalar': GDN, one decay per v-head; "
                         f"'channel': KDA, one per key channel), got {decay!r}")  # fmt: skip
    return decay


def as_beta_scale(fn: str, beta_scale) -> float:
    """beta's factor as a Python float (None: 1.0): static, finite and positive."""
    check_static(fn, "beta_scale", beta_scale)
    if beta_scale is None:
        return 1.0
    try:
        value = float(beta_scale)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{fn}: argument 'beta_scale' must be a real number or None, got "
                        f"{type(beta_scale).__name__} {beta_scale!r}") from e  # fmt: skip
    if not np.isfinite(value) or value <= 0:
        raise ValueError(f"{fn}: argument 'beta_scale' must be finite and positive (OLMo-Hybrid's negative "
                         f"eigenvalues: 2.0), got {beta_scale!r}")  # fmt: skip
    return value


def check_math(fn: str, math) -> str:
    """``math`` is one of :data:`MATH_MODES` (a static string: a traced value cannot pick the math)."""
    if not isinstance(math, str) or math not in MATH_MODES:
        raise ValueError(f"{fn}: math must be one of {MATH_MODES}, got {math!r}")
    return math


def verify_args(fn, state0, q, k, v, a, b, A_log, dt_bias, *, record=None, scale=None, out_dtype=None, slots=None,
                layer=None, tape=None, rows=None, parents=None, topk=1, out=None, math="platform", decay=None,
                beta_scale=None) -> VerifyCall:  # fmt: skip
    """Every check of :func:`gdn_lossless_jax.verify`; returns the backend's :class:`VerifyCall`."""
    decay = resolve_decay(fn, decay, tape)
    beta_scale = as_beta_scale(fn, beta_scale)
    record = None if record is None else record_type(record, fn, decay)  # the API's edge: the name becomes its class
    check_math(fn, math)
    check_static(fn, "scale", scale)
    state0, q, k, v, a, b, A_log, dt_bias = as_arrays(
        fn, state0=state0, q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias
    )
    full = dict(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    stacked = stacked_inputs(fn, state0, full, slots, layer, decay)
    if any(stacked.values()):  # the checks below run on one layer's shapes
        q, k, v, a, b, A_log, dt_bias = (jax.ShapeDtypeStruct(shape_of(x)[1:], dtype_of(x)) if stacked[n] else x
                                         for n, x in full.items())  # fmt: skip
    check_rank(fn, "q", q, 4, "[N, D, H, K]")
    check_not_transposed(fn, q, k, v, a)
    N, D, H = shape_of(q)[:3]
    check_state_layout(fn, state0, q, v)
    if slots is None:
        check_rank(fn, "state0", state0, 4, "[N, HV, V, K]")
        check_state_dtype(fn, "state0", state0)
        _, HV, V, K = shape_of(state0)
        check_shape(fn, "q", q, (shape_of(state0)[0], D, H, K), "[N, D, H, K]", "N and K from state0")
        state, pool_layer = state0, None
    else:
        if len(shape_of(state0)) not in (4, 5):
            raise ValueError(f"{fn}: with slots, argument 'state0' is the pool: rank 4 ([S, HV, V, K]) or 5 "
                             f"([L, S, HV, V, K]), got shape {fmt_shape(shape_of(state0))}")  # fmt: skip
        check_state_dtype(fn, "state0", state0)
        HV, V, K = shape_of(state0)[-3:]
        check_shape(fn, "q", q, (N, D, H, K), "[N, D, H, K]", "K from the pool")
        check_index(fn, "slots", slots, N)
        if len(shape_of(state0)) == 5:
            check_layer_index(fn, layer, shape_of(state0)[0], "the pool")
            state, pool_layer = state0, layer
        else:
            state, pool_layer = state0[None], 0
    check_shape(fn, "k", k, (N, D, H, K), "[N, D, H, K]", "from state0 and q")
    check_shape(fn, "v", v, (N, D, HV, V), "[N, D, HV, V]", "from state0 and q")
    if decay == "channel":  # KDA: one decay per key channel
        check_shape(fn, "a", a, (N, D, HV, K), "[N, D, HV, K]", "from state0 and q; decay='channel'")
    else:
        check_shape(fn, "a", a, (N, D, HV), "[N, D, HV]", "from state0 and q")
    check_shape(fn, "b", b, (N, D, HV), "[N, D, HV]", "from state0 and q")
    check_shape(fn, "A_log", A_log, (HV,), "[HV]", "from state0")
    if decay == "channel":
        check_shape(fn, "dt_bias", dt_bias, (HV, K), "[HV, K]", "from state0; decay='channel'")
    else:
        check_shape(fn, "dt_bias", dt_bias, (HV,), "[HV]", "from state0")
    for name, x in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias)):
        check_float(fn, name, x)
    if D < 1:
        raise ValueError(f"{fn}: need at least one draft step, got D={D} (q has shape {fmt_shape(shape_of(q))})")
    check_heads(fn, H, HV)
    parents = check_tree(fn, parents, topk, N, D)
    buf = tape_layer = None
    if tape is not None:
        record, layered = check_tape_buffer(fn, tape, record, N, D, H, HV, V, K, state0.dtype, layer, decay)
        buf, tape_layer = (tape, layer) if layered else (jax.tree.map(lambda x: x[None], tape), 0)
        if rows is None:
            rows = np.arange(N, dtype=np.int32)
        check_index(fn, "rows", rows, N)
        rows = as_index(rows)
    elif rows is not None:
        raise ValueError(f"{fn}: rows= maps requests to rows of a tape buffer: pass tape= too")
    obuf = out_layer = None
    if out is not None:
        out = as_array(fn, "out", out)
        out_dtype, layered = check_out_buffer(fn, out, out_dtype, N, D, HV, V, layer)
        obuf, out_layer = (out, layer) if layered else (out[None], 0)
    q, k, v, a, b, A_log, dt_bias = full.values()  # the backends take the stacks
    fields = dict(record=record or record_type("tuples", fn, decay), scale=as_scale(fn, scale, K),
                  out_dtype=jnp.dtype(out_dtype or q.dtype), math=math, decay=decay, beta_scale=beta_scale)
    if buf is not None:
        fields.update(tape=buf, tape_layer=as_index(tape_layer), rows=rows)
    if obuf is not None:
        fields.update(out=obuf, out_layer=as_index(out_layer))
    if parents is not None:
        fields.update(parents=parents)
    if slots is None:
        return VerifyCall.of_state(state, q, k, v, a, b, A_log, dt_bias, **fields)
    return VerifyCall(state, as_index(slots), as_index(pool_layer), q, k, v, a, b, A_log, dt_bias, **fields)


def tape_arrays(fn: str, tape, prefix: str):
    """The tape with list-valued fields converted (see :func:`as_array`)."""
    if not isinstance(tape, Tape):
        return tape
    fields = {f.name: getattr(tape, f.name) for f in dataclasses.fields(tape)}
    return tape.replace(**{name: as_array(fn, f"{prefix}.{name}", x) for name, x in fields.items()})


def commit_index_args(fn: str, slots, steps, track_slots=None, track_steps=None, rows=None) -> list[jax.Array]:
    """Commit's index arguments checked (``[N]`` int each) and completed: no track copies
    (-1) and rows ``i`` by default. Returns ``[slots, steps, track_slots, track_steps, rows]``
    as int32."""
    slots, steps, track_slots, track_steps, rows = as_arrays(
        fn,
        ("track_slots", "track_steps", "rows"),
        slots=slots,
        steps=steps,
        track_slots=track_slots,
        track_steps=track_steps,
        rows=rows,
    )
    check_rank(fn, "slots", slots, 1, "[N]")
    N = shape_of(slots)[0]
    check_index(fn, "slots", slots, N)
    check_index(fn, "steps", steps, N)
    if (track_slots is None) != (track_steps is None):
        raise ValueError(f"{fn}: give both track_slots and track_steps, or neither")
    if track_slots is None:
        track_slots = track_steps = np.full((N,), -1, np.int32)
    check_index(fn, "track_slots", track_slots, N)
    check_index(fn, "track_steps", track_steps, N)
    if rows is None:
        rows = np.arange(N, dtype=np.int32)
    check_index(fn, "rows", rows, N)
    return [as_index(x) for x in (slots, steps, track_slots, track_steps, rows)]


def check_pending(fn: str, pending: Pending, N: int, H: int, HV: int, V: int, K: int, state_dtype, pool_layers,
                  decay: str = "scalar"):  # fmt: skip
    """The pending commit's tape and indices; returns ``(tape with a layer axis, its layer or None)``."""
    if not isinstance(pending, Pending):
        raise TypeError(f"{fn}: argument 'pending' must be a gdn_lossless_jax.Pending, got {type(pending).__name__}")
    for name in ("rows", "steps", "track_slots", "track_steps"):
        check_index(fn, f"pending.{name}", getattr(pending, name), N)
    t = pending.tape
    lead = 1 if pool_layers is None else 2
    if not isinstance(t, Tape):
        raise TypeError(f"{fn}: argument 'pending.tape' must be one of {_tape_names()}, got {type(t).__name__}")
    if decay not in type(t).decays:
        raise ValueError(f"{fn}: decay={decay!r} but the pending tape is a {type(t).__name__} tape, which records a "
                         f"{'/'.join(type(t).decays)} decay")  # fmt: skip
    first, f0 = next(iter(type(t).layout(H=H, HV=HV, V=V, K=K).items()))
    lead_dims = "L, R" if lead == 2 else "R"
    check_rank(fn, f"pending.tape.{first}", getattr(t, first), lead + 1 + len(f0.shape), f"[{lead_dims}, D, {f0.dims}]")
    pre = shape_of(getattr(t, first))[:lead]
    check_tape(fn, t, pre, lead_dims, prefix="pending.tape", H=H, HV=HV, V=V, K=K,
               state_dtype=state_dtype, source="HV, V, K from the pool")  # fmt: skip
    if lead == 2 and pre[0] != pool_layers:
        raise ValueError(f"{fn}: the pending tape has L={pre[0]} layers, the pool {pool_layers}")
    return (t, True) if lead == 2 else (jax.tree.map(lambda x: x[None], t), False)


def replay_args(fn: str, state0, tuples, steps):
    """The checks of :func:`gdn_lossless_jax.replay`; returns ``(state0, tuples, steps as int32)``."""
    state0, steps = as_arrays(fn, state0=state0, steps=steps)
    tuples = tape_arrays(fn, tuples, "tuples")
    check_rank(fn, "state0", state0, 4, "[N, HV, V, K]")
    check_state_dtype(fn, "state0", state0)
    N, HV, V, K = shape_of(state0)
    if not isinstance(tuples, Tape) or tuples.stores_states:
        replays = " or ".join(c.__name__ for c in TAPES if not c.stores_states)
        raise TypeError(f"{fn}: the tape must be a {replays} tape here (one that replays), got {type(tuples).__name__}")
    check_tape(fn, tuples, (N,), "N", prefix="tuples", HV=HV, V=V, K=K, source="HV, V from the state")
    check_index(fn, "steps", steps, N)
    return state0, tuples, as_index(steps)


def check_path(fn: str, path, N: int):
    """A tree commit's accepted paths: ``[N, P]`` integers, ``P >= 1``; returns them as int32."""
    (path,) = as_arrays(fn, path=path)
    if not is_int(path):
        raise TypeError(f"{fn}: argument 'path' must be an integer array, got dtype {dtype_of(path)}")
    shape = shape_of(path)
    if len(shape) != 2 or shape[0] != N or shape[1] < 1:
        raise ValueError(
            f"{fn}: argument 'path' must have shape [N, P] with N={N} (one path per request, from slots) and "
            f"P >= 1 (node indices from the root's child down, padded with -1), got {fmt_shape(shape)}"
        )
    return as_index(path)


def check_commit_parents(fn: str, parents, N: int, D: int):
    """The optional ``parents`` of a tree commit (used by its path checks): ``[D]`` or ``[N, D]``
    integers (D from the tape), in ``[-1, d)`` where host values; returns int32 ``[N, D]`` or None."""
    if parents is None:
        return None
    (parents,) = as_arrays(fn, parents=parents)
    if not is_int(parents):
        raise TypeError(f"{fn}: argument 'parents' must be an integer array, got dtype {dtype_of(parents)}")
    if shape_of(parents) not in ((D,), (N, D)):
        raise ValueError(f"{fn}: argument 'parents' must have shape [D] = [{D}] or [N, D] = [{N}, {D}] (D from the "
                         f"tape, N the requests), got {fmt_shape(shape_of(parents))}")  # fmt: skip
    if not isinstance(parents, jax.core.Tracer):
        host = np.broadcast_to(np.asarray(parents), (N, D)).astype(np.int32)
        tree.check_parents_values(fn, host)
        return host
    return jnp.broadcast_to(as_index(parents), (N, D))


def host_value(x, raw=None):
    """``x`` as a NumPy array if its values are known now, else None.

    Known: NumPy arrays, lists of numbers, and ``jax.Array`` values that are not tracers (a
    concrete array, on the device or closed over by a jit: pulled to the host, a device sync).
    A tracer's values exist only when its jit runs: None, and nothing is pulled. ``raw``: the
    argument as the caller gave it, where ``x`` is its conversion (:func:`as_array`,
    :func:`as_index`), since a conversion inside a jit makes a tracer of a concrete value."""
    for v in (x, raw):
        if v is None or isinstance(v, jax.core.Tracer):
            continue
        if isinstance(v, (list, tuple)) and any(isinstance(e, jax.core.Tracer) for e in jax.tree.leaves(v)):
            continue
        if isinstance(v, (np.ndarray, np.generic, jax.Array, list, tuple, int)):
            return np.asarray(v)
    return None


def check_path_indices(fn: str, D: int, path, steps, track_steps, parents=None, *, checked: bool = False,
                       raw: Sequence = ()) -> None:  # fmt: skip
    """The value checks of a draft tree's accepted paths (commit, replay, ``pool.commit``, the
    pending path of ``commit_and_verify``): ``path[i, :max(steps[i], track_steps[i]) + 1]`` are
    nodes of the tape (``[0, D)``) and, with ``parents``, a root-to-node path of the tree
    (:func:`gdn_lossless_jax.tree.check_path_values`). Shapes are checked already; ``parents`` is
    ``[N, D]`` or None; ``raw``: path, steps, track_steps, parents as the caller gave them (see
    :func:`host_value`).

    Concrete values (NumPy, lists, jax arrays that are not tracers) are checked here, at call
    time, whatever ``checked`` (``ValueError``): the whole check where path, steps and
    track_steps are all concrete (which entries are read depends on the steps), the
    root-to-node part with it where ``parents`` is concrete too. What a tracer keeps from being
    checked here is checked with ``checked=True`` (:func:`gdn_lossless_jax.tree.checkify_path`,
    with traced ``parents`` also :func:`gdn_lossless_jax.tree.checkify_parents`), on all the
    values, the concrete ones included; without it, nothing is (the commit's masking applies)."""
    raw = tuple(raw) + (None,) * (4 - len(raw))
    hp, hs, ht = (host_value(x, r) for x, r in zip((path, steps, track_steps), raw))
    hpar = None if parents is None else host_value(parents, raw[3])
    done = False
    if hp is not None and hs is not None and ht is not None:
        tree.check_path_values(fn, hp, hs, ht, D, hpar)  # (traced parents: the node range here, the rest checked)
        done = parents is None or hpar is not None
    if checked and parents is not None and hpar is None:
        tree.checkify_parents(fn, parents)
    if checked and not done:
        tree.checkify_path(fn, path, steps, track_steps, D, parents)


def is_host(*xs) -> bool:
    """Whether every x is a host value (NumPy, a list, None): checked at call time without a device sync."""
    return all(x is None or isinstance(x, (np.ndarray, np.generic, list, tuple, int)) for x in xs)


def commit_args(fn: str, pool, tape, slots, steps, track_slots=None, track_steps=None, rows=None):
    """The checks of :func:`gdn_lossless_jax.commit`; returns ``(pool, tape, [slots, steps,
    track_slots, track_steps, rows] as int32)``."""
    (pool,) = as_arrays(fn, pool=pool)
    tape = tape_arrays(fn, tape, "tape")
    check_rank(fn, "pool", pool, 5, "[L, S, HV, V, K]")
    check_state_dtype(fn, "pool", pool)
    L, _, HV, V, K = shape_of(pool)
    ints = commit_index_args(fn, slots, steps, track_slots, track_steps, rows)
    if not isinstance(tape, Tape):
        raise TypeError(f"{fn}: tape must be one of {_tape_names()}, got {type(tape).__name__}")
    first, f0 = next(iter(type(tape).layout(H=None, HV=HV, V=V, K=K).items()))
    check_rank(fn, f"tape.{first}", getattr(tape, first), 3 + len(f0.shape), f"[L, R, D, {f0.dims}]")
    R = shape_of(getattr(tape, first))[1]
    check_tape(fn, tape, (L, R), "L, R", prefix="tape", HV=HV, V=V, K=K, state_dtype=pool.dtype,
               source="L, HV, V, K from the pool")  # fmt: skip
    return pool, tape, ints


def commit_and_verify_args(fn: str, pool, pending, q, k, v, a, b, A_log, dt_bias, *, slots, layer=None, tape=None,
                           rows=None, record=None, scale=None, out_dtype=None, out=None, parents=None,
                           topk=1, math="platform", checked=False, decay=None,
                           beta_scale=None) -> VerifyCall:  # fmt: skip
    """The checks of :func:`gdn_lossless_jax.commit_and_verify`: verify's (:func:`verify_args`) and the
    pending commit's (:func:`check_pending`; a pending path's values by :func:`check_path_indices`,
    traced ones with ``checked``); returns the :class:`VerifyCall` with its
    :class:`~gdn_lossless_jax.tape.Pending` (its ``layer`` set, the path applied)."""
    if slots is None:
        raise ValueError(f"{fn}: argument 'slots' is required (request n's state is pool[layer, slots[n]])")
    if len(shape_of(q)) != 5:  # (stacked over layers: checked by verify_args below)
        check_rank(fn, "q", q, 4, "[N, D, H, K]")
    N, _, H, _ = shape_of(q)[-4:]
    if len(shape_of(pool)) not in (4, 5):
        raise ValueError(f"{fn}: argument 'pool' must have rank 4 ([S, HV, V, K]) or 5 ([L, S, HV, V, K]), "
                         f"got shape {fmt_shape(shape_of(pool))}")  # fmt: skip
    check_state_dtype(fn, "pool", pool)
    HV, V, K = shape_of(pool)[-3:]
    L = shape_of(pool)[0] if len(shape_of(pool)) == 5 else None
    decay = resolve_decay(fn, decay, tape, getattr(pending, "tape", None))
    prev, layered = check_pending(fn, pending, N, H, HV, V, K, pool.dtype, L, decay)
    call = verify_args(fn, pool, q, k, v, a, b, A_log, dt_bias, record=record, scale=scale, out_dtype=out_dtype,
                       slots=slots, layer=layer, tape=tape, rows=rows, out=out, parents=parents, topk=topk,
                       math=math, decay=decay, beta_scale=beta_scale)  # fmt: skip
    pend = [as_index(getattr(pending, n)) for n in ("rows", "steps", "track_slots", "track_steps")]
    player = as_index(layer if layered else 0)
    if pending.path is not None:  # a tree's accepted path: the chain commit it is (reference.along_path)
        path = check_path(fn, pending.path, N)
        r, steps, track_slots, track_steps = pend
        check_path_indices(fn, prev.num_steps, path, steps, track_steps, checked=checked,
                           raw=(pending.path, pending.steps, pending.track_steps))  # fmt: skip
        if not prev.stores_states:  # this layer's steps along the path (a copy of P steps a request)
            prev = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, jnp.reshape(player, ()), 0), prev)
            player = np.int32(0)
        prev, r, steps, track_steps = reference.along_path(prev, r, path, steps, track_steps)
        pend = [r, steps, track_slots, track_steps]
    return call.replace(pending=Pending(prev, *pend, layer=player))


# Moved to gdn_lossless_jax.staging (not checks): one release under the old names.
__getattr__ = _deprecated.alias(__name__, {"staged": "gdn_lossless_jax.staging:staged",
                                           "unstaged": "gdn_lossless_jax.staging:unstaged"})  # fmt: skip
