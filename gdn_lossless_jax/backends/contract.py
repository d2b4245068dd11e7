"""The backend contract, stated once: the :class:`Backend` protocol, what it declares
(:class:`Capabilities`) and what it is handed (:class:`VerifyCall`).

A backend is any object that has the members of :class:`Backend` (a module, as the built-in
ones are, a class instance, a ``types.SimpleNamespace``; hashable, to pass through
:mod:`gdn_lossless_jax.pool`'s jits, which a module is). Pass it as ``backend=`` wherever a name
is taken, and check it with :func:`gdn_lossless_jax.testing.run_equivalence_suite`.

The API calls a backend only after every argument is checked (shapes and dtypes valid, indices
int32, ``scale`` a float, ``out_dtype`` a NumPy dtype) and after the call fits the backend's
:class:`Capabilities` (its record modes, draft trees, ``math=`` modes, state dtypes, draft count
and, where it compiles, its shape multiples): what is not declared is refused before the
backend runs, naming the backend and the one that takes it. The API passes ``math=`` to
``replay`` and ``commit`` always, and no other option; a backend's own keywords (a launch
config, a rounding form) are for direct calls (tests, benchmarks). Semantics are the
reference's (:mod:`gdn_lossless_jax.reference`), bit for bit where the reference pins them.

Draft trees: a backend with ``capabilities.trees`` takes a call with ``parents``; commit needs
nothing, the API turns a tree's accepted path into the chain commit it is
(:func:`gdn_lossless_jax.reference.along_path`). The fused step (``commit_and_verify``): a
backend with ``capabilities.fused`` applies ``call.pending`` inside its verify and returns the
pool too; for any other, the API runs its ``commit`` of that layer, then its ``verify``
(:func:`run_verify`).

The built-in backends are modules of :mod:`gdn_lossless_jax.backends`; a backend object of an
earlier release (``verify``, ``replay``, ``commit`` and optional ``TREES``, ``MATH_MODES``,
``check_math``, ``check_available(op)``) still runs, adapted by :func:`as_backend` with a
DeprecationWarning, for one release.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any, Callable, Mapping, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from .. import reference
from ..tape import TAPES, Pending, Tape, Tuples, record_type

__all__ = ["Backend", "Capabilities", "ConvKernels", "VerifyCall", "Pending", "BackendUnavailable", "run_verify",
           "as_backend", "backend_name"]  # fmt: skip


class BackendUnavailable(RuntimeError):
    """A backend was asked for where it cannot run (platform, JAX build, missing package, or a
    call outside its :class:`Capabilities`)."""


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a backend implements, declared: the API refuses any other call before the backend runs.

    Attributes:
      records: the record modes its verify records and its commit takes (tape classes,
        :data:`gdn_lossless_jax.tape.TAPES`; a class is taken where one of its decays is in ``decays``
        too: :meth:`takes`).
      trees: its verify takes draft trees (``VerifyCall.parents``).
      math_modes: the ``math=`` modes it implements somewhere (``"platform"`` always);
        ``check_available(op, math)`` refuses one where it cannot run it here.
      state_dtypes: the state pool dtypes it takes.
      fused: its verify applies ``VerifyCall.pending`` (the fused step) and returns the pool
        too; False: the API commits that layer first with its ``commit``.
      max_drafts: the most draft steps (tree nodes) a verify may carry; None: no limit.
      multiples: shape limits where its kernels compile (on a GPU; interpret mode takes any
        shape): ``{"V": 64}`` means V must be a multiple of 64. Keys: ``"H"``, ``"HV"``, ``"K"``,
        ``"V"``.
      powers_of_two: sizes that must be powers of two where its kernels compile (on a GPU):
        ``("K",)`` means K must be one (Pallas Triton loads whole ``[K]`` rows). Keys as ``multiples``.
      control_forms: for tests: the ``replay(..., form=)`` forms that break the rule on purpose
        (:data:`gdn_lossless_jax.testing.controls.CONTROLS`' names), which the equivalence suite
        must catch (:func:`gdn_lossless_jax.testing.equivalence.control_replays`).
      decays: the ``decay=`` forms its verify runs and its commit replays
        (:data:`gdn_lossless_jax.reference.DECAYS`): ``"scalar"`` (GDN) and, where declared,
        ``"channel"`` (KDA's per-channel decay: ``a [N, D, HV, K]``, the
        :class:`~gdn_lossless_jax.tape.KDATuples` tape). A tape is taken where its record mode is
        in ``records`` and one of its decays here.
      beta_scale: its verify applies ``VerifyCall.beta_scale`` (beta times a static factor,
        OLMo-Hybrid's 2.0); False: a call with a scale other than 1.0 is refused.
    """

    records: tuple[type[Tape], ...] = TAPES
    trees: bool = False
    math_modes: tuple[str, ...] = ("platform",)
    state_dtypes: tuple[Any, ...] = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
    fused: bool = True
    max_drafts: int | None = None
    multiples: Mapping[str, int] = dataclasses.field(default_factory=dict)
    powers_of_two: tuple[str, ...] = ()
    control_forms: tuple[str, ...] = ()
    decays: tuple[str, ...] = ("scalar",)
    beta_scale: bool = False

    def takes(self, tape: type[Tape]) -> bool:
        """Whether its verify records and its commit takes ``tape`` (a tape class): the record mode
        declared and one of its decays too."""
        return tape in self.records and any(d in self.decays for d in tape.decays)


class ConvKernels(NamedTuple):
    """A backend's kernels for the causal conv1d of the pool's step (:mod:`gdn_lossless_jax.conv`),
    the arguments as :mod:`gdn_lossless_jax.backends.pallas.conv` takes them (checked by the caller)::

        verify(x, weight, bias, conv_pool, slots, layer, *, splits, windows, tape_layer, rows)
            -> (fp32 accumulators per split, windows)     (conv.py applies the SiLU in XLA)
        commit(conv_pool, windows, slots, steps, track_slots, track_steps, rows) -> conv_pool
    """

    verify: Callable
    commit: Callable


@runtime_checkable
class Backend(Protocol):
    """The backend contract: the one place it is stated.

    Members:
      name: how messages name it.
      capabilities: what it implements (:class:`Capabilities`).
      check_available(op, math): raise :class:`BackendUnavailable`, naming the backend, the
        platform and the alternatives, where ``op`` (``"verify"``, ``"replay"``, ``"commit"``,
        ``"conv"``) with ``math`` cannot run here.
      verify(call): ``(outputs, tape)``; with ``call.pending`` (``capabilities.fused``),
        ``(outputs, tape, pool)``. See :class:`VerifyCall`.
      replay(state0, tuples, steps, *, math): the states ``[N, HV, V, K]`` after ``steps``.
      commit(pool, tape, slots, steps, track_slots, track_steps, rows, *, math): the pool.
      conv_kernels(): its conv kernels here (:class:`ConvKernels`), or None: XLA runs the conv.
    """

    name: str
    capabilities: Capabilities

    def check_available(self, op: str, math: str = "platform") -> None: ...

    def verify(self, call: "VerifyCall", **options: Any) -> tuple: ...

    def replay(self, state0: jax.Array, tuples: Tuples, steps: jax.Array, *, math: str = "platform",
               **options: Any) -> jax.Array: ...  # fmt: skip

    def commit(self, pool: jax.Array, tape: Tape, slots: jax.Array, steps: jax.Array, track_slots: jax.Array,
               track_steps: jax.Array, rows: jax.Array, *, math: str = "platform",
               **options: Any) -> jax.Array: ...  # fmt: skip

    def conv_kernels(self) -> ConvKernels | None: ...


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyCall:
    """One verify, checked and normalised (the arguments of :func:`gdn_lossless_jax.verify`).

    Attributes:
      pool: ``[L, S, HV, V, K]`` float32 or bfloat16, read at ``[layer, slots[n]]`` (zeros for
        a slot outside ``[0, S)``); never written, except by ``pending``. A plain
        ``[N, HV, V, K]`` state0 arrives as a one-layer pool whose slot n is request n.
      slots: ``[N]`` int32; layer: int32 scalar.
      q, k, v, a, b, A_log, dt_bias: one layer's inputs, or any of them stacked over the pool's
        layers (one leading axis more; read at ``layer``). With ``decay="channel"`` (KDA),
        ``a [N, D, HV, K]`` and ``dt_bias [HV, K]``.
      tape, tape_layer, rows: a tape buffer ``[L', R, Dmax, ...]`` to write request n's steps
        into at ``[tape_layer, rows[n], :D]``, or None (a fresh ``[N, D, ...]`` tape).
      out, out_layer: an outputs buffer ``[L', N, D, HV, V]`` written at ``out_layer``, or None.
      pending: the fused step's previous commit (:class:`~gdn_lossless_jax.tape.Pending`, its
        ``layer`` set, its tape ``[L', R', D', ...]``), or None.
      parents: a draft tree's ``[N, D]`` int32 parents, or None (a chain).
      record: static: the record mode, its tape class (``call.record.stores_states`` is the
        kernels' flag; a name is accepted when a call is built and made the class).
      scale, out_dtype: static: the query scale, the outputs' dtype.
      pool_form: static: whether the caller passed a pool (with ``slots``) rather than state0.
      math: static: ``"platform"`` or ``"portable"`` (:func:`gdn_lossless_jax.verify`).
      decay: static: ``"scalar"`` (GDN: ``g [..., HV]``) or ``"channel"`` (KDA: ``g [..., HV, K]``,
        each key channel its own decay; the tuple tape a :class:`~gdn_lossless_jax.tape.KDATuples`).
      beta_scale: static: beta's factor (1.0; OLMo-Hybrid's ``linear_allow_neg_eigval``: 2.0),
        applied in the gates (:func:`gdn_lossless_jax.reference.gates`).
    """

    pool: jax.Array
    slots: jax.Array
    layer: jax.Array
    q: jax.Array
    k: jax.Array
    v: jax.Array
    a: jax.Array
    b: jax.Array
    A_log: jax.Array
    dt_bias: jax.Array
    tape: Tape | None = None
    tape_layer: jax.Array | None = None
    rows: jax.Array | None = None
    out: jax.Array | None = None
    out_layer: jax.Array | None = None
    pending: Pending | None = None
    parents: jax.Array | None = None
    record: type[Tape] = dataclasses.field(default=Tuples, metadata=dict(static=True))
    scale: float = dataclasses.field(default=1.0, metadata=dict(static=True))
    out_dtype: Any = dataclasses.field(default=jnp.dtype(jnp.float32), metadata=dict(static=True))
    pool_form: bool = dataclasses.field(default=True, metadata=dict(static=True))
    math: str = dataclasses.field(default="platform", metadata=dict(static=True))
    decay: str = dataclasses.field(default="scalar", metadata=dict(static=True))
    beta_scale: float = dataclasses.field(default=1.0, metadata=dict(static=True))

    def __post_init__(self):
        if isinstance(self.record, str):  # the API's edge: a name becomes its class
            object.__setattr__(self, "record", record_type(self.record, "VerifyCall", self.decay))

    @property
    def inputs(self) -> tuple[jax.Array, ...]:
        """``(q, k, v, a, b, A_log, dt_bias)``."""
        return self.q, self.k, self.v, self.a, self.b, self.A_log, self.dt_bias

    def replace(self, **fields: Any) -> "VerifyCall":
        return dataclasses.replace(self, **fields)

    @classmethod
    def of_state(cls, state0: jax.Array, q, k, v, a, b, A_log, dt_bias, **kw) -> "VerifyCall":
        """The call for a plain ``[N, HV, V, K]`` state0: a one-layer pool whose slot n is request n."""
        n = state0.shape[0]
        return cls(state0[None], np.arange(n, dtype=np.int32), np.int32(0), q, k, v, a, b, A_log, dt_bias,
                   pool_form=False, **kw)  # fmt: skip


def backend_name(backend) -> str:
    """How messages name ``backend`` (a name, or an object's ``name`` or ``__name__``)."""
    if isinstance(backend, str):
        return backend
    name = getattr(backend, "name", None)
    if isinstance(name, str):
        return name
    return str(getattr(backend, "__name__", None) or type(backend).__name__).rsplit(".", 1)[-1]


def run_verify(backend: Backend, call: VerifyCall, **options):
    """``backend.verify(call, **options)``; for a backend that does not fuse the pending commit
    (``capabilities.fused`` False), its ``commit`` of the call's layer first
    (:func:`gdn_lossless_jax.reference.apply_pending`), then its verify: ``(outputs, tape, pool)``."""
    if call.pending is None or backend.capabilities.fused:
        return backend.verify(call, **options)
    pool = reference.apply_pending(call, lambda *args: backend.commit(*args, math=call.math))
    return (*backend.verify(call.replace(pool=pool, pending=None), **options), pool)


# -- the earlier, duck-typed contract: adapted for one release ------------------------------------
def _takes_call(fn) -> bool:
    """Whether ``fn`` is a contract verify (one positional parameter, the call)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) <= 1 and not any(p.kind is p.VAR_POSITIONAL for p in params)


def _legacy_arguments(call: VerifyCall) -> tuple[tuple, dict]:
    """``call`` as the arguments of the earliest backend signature ``verify(state0, q, k, v, a, b,
    A_log, dt_bias, *, record, scale, out_dtype, slots, layer, tape, tape_layer, rows, pending, out,
    out_layer)``."""
    kw = dict(record=call.record.mode, scale=call.scale, out_dtype=call.out_dtype)
    if call.pool_form:
        state = call.pool
        kw.update(slots=call.slots, layer=call.layer)
    else:
        state = call.pool[0]
    if call.tape is not None:
        kw.update(tape=call.tape, tape_layer=call.tape_layer, rows=call.rows)
    if call.pending is not None:
        p = call.pending
        kw["pending"] = (p.rows, p.steps, p.track_slots, p.track_steps, p.layer, p.tape)
    if call.out is not None:
        kw.update(out=call.out, out_layer=call.out_layer)
    return (state, *call.inputs), kw


class _Adapted:
    """A backend object of the earlier duck-typed contract, as a :class:`Backend`."""

    def __init__(self, obj):
        self.obj = obj
        self.name = backend_name(obj)
        self.capabilities = Capabilities(trees=bool(getattr(obj, "TREES", False)),
                                         math_modes=tuple(getattr(obj, "MATH_MODES", ("platform",))))  # fmt: skip

    def check_available(self, op: str, math: str = "platform") -> None:
        check = getattr(self.obj, "check_available", None)
        if check is not None:
            check(op)
        refine = getattr(self.obj, "check_math", None)
        if math != "platform" and refine is not None:
            refine(op, math)

    def verify(self, call, **options):
        if _takes_call(self.obj.verify):
            return self.obj.verify(call, **options)
        warnings.warn(
            f"backend {self.name!r}: verify(state0, q, k, ...) is the earlier backend signature; write "
            "verify(call: gdn_lossless_jax.backends.contract.VerifyCall) instead (it is removed in the next release)",
            DeprecationWarning, stacklevel=4,
        )  # fmt: skip
        args, kw = _legacy_arguments(call)
        result = self.obj.verify(*args, **kw, **options)
        if call.pending is not None and not call.pool_form:
            result = (*result[:2], result[2][None])
        return result

    def replay(self, state0, tuples, steps, *, math="platform", **options):
        kw = {} if math == "platform" else {"math": math}
        return self.obj.replay(state0, tuples, steps, **kw, **options)

    def commit(self, pool, tape, slots, steps, track_slots, track_steps, rows, *, math="platform", **options):
        kw = {} if math == "platform" else {"math": math}
        return self.obj.commit(pool, tape, slots, steps, track_slots, track_steps, rows, **kw, **options)

    def conv_kernels(self):
        return None


_ADAPTED: dict[int, tuple[Any, _Adapted]] = {}  # id -> (the object, kept alive so the id stays its own; adapter)


def as_backend(obj, op: str = "verify") -> Backend:
    """``obj`` as a :class:`Backend`: itself where it has every member; an object of the earlier
    contract (``verify``, ``replay``, ``commit``, optional ``TREES``, ``MATH_MODES``,
    ``check_math``, ``check_available(op)``) adapted, with a DeprecationWarning (one release).
    A ``TypeError`` where it has no callable ``op``."""
    if isinstance(obj, Backend):
        return obj
    if not callable(getattr(obj, op, None)):
        raise TypeError(
            f"{op}: backend must be one of the names in gdn_lossless_jax.backends.BACKENDS (or 'auto') or an object "
            f"implementing gdn_lossless_jax.backends.contract.Backend; {obj!r} has no callable {op!r}"
        )
    hit = _ADAPTED.get(id(obj))
    if hit is None or hit[0] is not obj:
        missing = [m for m in ("name", "capabilities", "check_available", "conv_kernels") if not hasattr(obj, m)]
        warnings.warn(
            f"backend {backend_name(obj)!r} lacks {', '.join(missing)} of the Backend protocol "
            "(gdn_lossless_jax.backends.contract.Backend): adapted as the earlier contract's object (TREES, "
            "MATH_MODES, check_math), which is removed in the next release", DeprecationWarning, stacklevel=3,
        )  # fmt: skip
        hit = _ADAPTED[id(obj)] = (obj, _Adapted(obj))
    return hit[1]


def _pending_commit(tape, layer, rows, steps, track_slots, track_steps) -> Pending:
    """The earlier ``PendingCommit(tape, layer, rows, steps, track_slots, track_steps)``: a
    :class:`~gdn_lossless_jax.tape.Pending` with its layer."""
    return Pending(tape, rows, steps, track_slots, track_steps, layer=layer)


_OLD_CAPABILITIES = {"TREES": "trees", "MATH_MODES": "math_modes"}


def _old_capability(module: str, capabilities: Capabilities, attr: str):
    """A built-in backend's attribute of the earlier contract (``TREES``, ``MATH_MODES``), one release."""
    if attr not in _OLD_CAPABILITIES:
        raise AttributeError(f"module {module!r} has no attribute {attr!r}")
    new = _OLD_CAPABILITIES[attr]
    warnings.warn(f"{module}.{attr} is now {module}.capabilities.{new} (the Backend protocol's declared "
                  "capabilities); the old name is removed in the next release", DeprecationWarning, stacklevel=3)
    return getattr(capabilities, new)


def legacy_arguments(call: VerifyCall) -> tuple[tuple, dict]:
    """Deprecated (one release): the arguments of the earliest backend signature."""
    warnings.warn("gdn_lossless_jax.backends.contract.legacy_arguments is deprecated (the earliest backend signature "
                  "is adapted by as_backend); it is removed in the next release", DeprecationWarning, stacklevel=2)
    return _legacy_arguments(call)


def __getattr__(name: str):
    # Renamed: one name per concept (docs/design.md, glossary). One release under the old name.
    if name == "PendingCommit":
        warnings.warn("gdn_lossless_jax.backends.contract.PendingCommit(tape, layer, rows, steps, track_slots, "
                      "track_steps) is now gdn_lossless_jax.Pending(tape, rows, steps, track_slots, track_steps, "
                      "layer=layer); the old name is removed in the next release", DeprecationWarning, stacklevel=2)
        return _pending_commit
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
