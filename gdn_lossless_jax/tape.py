"""The tapes verify records, one class a record mode: per-step tuples (the lossless way) or full
state snapshots. A record mode is a :class:`Tape` subclass registered in :data:`RECORDS`; the
``record=`` string is read at the API's edge only (:func:`record_type`).

Tapes are frozen pytrees (``chex.dataclass``-style, registered with JAX), so they pass
through ``jax.jit``, ``lax.scan`` and ``jax.tree_util`` like any other tree of arrays.
Shapes are given per layer; a tape for ``commit`` carries a leading layer axis ``L``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Tape", "Tuples", "KDATuples", "Snapshots", "TAPES", "RECORDS", "RECORD_MODES", "record_type", "FieldLayout",
           "STATE_DTYPE", "Pending", "stack_tapes", "replace_fields"]


def replace_fields(obj: Any, fields: dict[str, Any]) -> Any:
    """``dataclasses.replace(obj, **fields)``, with an error that lists the fields on a typo."""
    names = [f.name for f in dataclasses.fields(obj)]
    unknown = [n for n in fields if n not in names]
    if unknown:
        raise TypeError(
            f"{type(obj).__name__}.replace: unknown field {unknown[0]!r}; the fields are {', '.join(names)}"
        )
    return dataclasses.replace(obj, **fields)


class FieldLayout(NamedTuple):
    """One field of a tape, per draft step: its trailing shape (after ``[..., R, D]``), its dtype
    (:data:`STATE_DTYPE`: the state pool's), and its dimensions' names for messages. A ``None`` in
    ``shape`` is a size the tape itself tells (the q/k heads where the caller does not know them)."""

    shape: tuple[int | None, ...]
    dtype: Any
    dims: str


#: The dtype of a field stored in the state pool's dtype (float32 or bfloat16), as :class:`FieldLayout` says it.
STATE_DTYPE = "state"


class Tape:
    """A record mode: what verify keeps of its D draft steps, so that commit can write the
    accepted state. Each mode is one frozen pytree dataclass, a subclass of this one, listed in
    :data:`TAPES` (and, the GDN class of each ``record=`` name, in :data:`RECORDS`); everything the
    library does with a tape that depends on the mode is a method or a flag here, so a new mode is
    one class.

    Class attributes (a subclass sets them):
      mode: its ``record=`` name (``"tuples"``, ``"snapshots"``); :class:`KDATuples` is ``"tuples"``
        too: ``record="tuples"`` of a KDA layer (``decay="channel"``) is that class (:func:`record_type`).
      decays: the ``decay=`` forms it records (:data:`gdn_lossless_jax.reference.DECAYS`):
        ``"scalar"`` (GDN, one decay per v-head), ``"channel"`` (KDA, one per key channel), or
        both (a mode that stores states does not depend on the decay).
      stores_states: the kernels' flag: the tape holds the state after every step (commit copies
        it) rather than what a replay needs (commit replays). A backend declares the modes its
        kernels take in its ``capabilities.records`` (:mod:`gdn_lossless_jax.backends.contract`).
      noun: how messages name one (``"tuple"``, ``"snapshot"``).

    Methods a subclass implements: :meth:`layout` (allocation, scratch accounting and the
    argument checks all derive from it), :meth:`recorded` (what a verify keeps of its steps),
    :meth:`states_at` (the commit's states: a copy or a replay), :meth:`along_path` (a draft
    tree's accepted path as a chain).
    """

    mode: ClassVar[str]
    decays: ClassVar[tuple[str, ...]] = ("scalar",)
    stores_states: ClassVar[bool]
    noun: ClassVar[str]
    _trailing: ClassVar[int]  # the first field's axes after the step axis

    # -- what a mode is ------------------------------------------------------------------------
    @classmethod
    def layout(cls, *, H: int | None, HV: int, V: int, K: int) -> dict[str, FieldLayout]:
        """Each field's per-step layout, in field order (``H`` None: read from the tape)."""
        raise NotImplementedError

    @classmethod
    def recorded(cls, *, u: jax.Array, k: jax.Array, g: jax.Array, states: jax.Array) -> "Tape":
        """The tape of a verify from what its steps computed: ``u [..., D, HV, V]``, the normalised
        ``k [..., D, H, K]``, the log-decays ``g [..., D, HV]`` (fp32) and the states after each
        step ``[..., D, HV, V, K]`` (in the pool's dtype)."""
        raise NotImplementedError

    def states_at(self, pool, slots, rows, steps, track_steps, *, replay: Callable):
        """The states after ``steps`` and after ``track_steps`` (``[N]`` int, clipped into range:
        the caller masks), ``[L, N, HV, V, K]`` each, of request n at ``pool[:, slots[n]]`` with
        tape row ``rows[n]`` (both in range). ``replay(state0 [M, ...], tuples [M, D, ...], steps,
        track_steps)`` is the replay of the tape's steps (:func:`gdn_lossless_jax.reference.replay_two`,
        with the rule and ``exp`` of the call), for modes that replay."""
        raise NotImplementedError

    def along_path(self, rows, path, steps, track_steps):
        """A draft tree's commit as a chain's: ``(tape, rows, steps, track_steps)`` such that a chain
        commit of them writes the states along ``path [N, P]`` (node indices; ``steps`` positions
        along it, -1 where the path does not reach them). The same tape where positions can be
        mapped to nodes; a gathered chain tape ``[L, N, P, ...]`` (row i request i's path, an
        out-of-range row made row N) where the steps must be applied in order."""
        raise NotImplementedError

    # -- what every mode shares ---------------------------------------------------------------
    def replace(self, **fields: jax.Array):
        """A copy with the given fields replaced, e.g. ``tape.replace(g=g2)``."""
        return replace_fields(self, fields)

    def _lead_shape(self) -> tuple[int, ...]:
        return getattr(self, dataclasses.fields(self)[0].name).shape

    @property
    def num_steps(self) -> int:
        return self._lead_shape()[-1 - self._trailing]

    @property
    def num_rows(self) -> int:
        return self._lead_shape()[-2 - self._trailing]

    @classmethod
    def specs(cls, lead: tuple[int, ...], *, H: int, HV: int, V: int, K: int, state_dtype) -> dict[str, tuple]:
        """``{field: (shape, dtype)}`` of a tape ``[*lead, ...]`` (``lead`` ends with R, D): what
        :func:`gdn_lossless_jax.pool.allocate` allocates and the memory accounting counts."""
        out = {}
        for name, f in cls.layout(H=H, HV=HV, V=V, K=K).items():
            dtype = jnp.dtype(state_dtype) if f.dtype == STATE_DTYPE else jnp.dtype(f.dtype)
            out[name] = ((*lead, *f.shape), dtype)
        return out

    @classmethod
    def zeros(cls, lead: tuple[int, ...], *, H: int, HV: int, V: int, K: int, state_dtype) -> "Tape":
        """A zero-filled tape ``[*lead, ...]`` (:meth:`specs`)."""
        specs = cls.specs(lead, H=H, HV=HV, V=V, K=K, state_dtype=state_dtype)
        return cls(**{name: jnp.zeros(shape, dtype) for name, (shape, dtype) in specs.items()})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tuples(Tape):
    """The lossless tape: what replay needs to rebuild every draft step's state.

    Attributes:
      u: ``[..., N, D, HV, V]`` float32, ``beta_t * (v_t - rn(S_{t-1} * exp(g_t)) @ k_t)``.
      k: ``[..., N, D, H, K]`` float32, the l2-normalised key, once per q/k head (the
        ``HV // H`` v-heads of a group share it).
      g: ``[..., N, D, HV]`` float32, the log-decay ``-exp(A_log) * softplus(a + dt_bias)``.
    """

    u: jax.Array
    k: jax.Array
    g: jax.Array
    mode: ClassVar[str] = "tuples"
    stores_states: ClassVar[bool] = False
    noun: ClassVar[str] = "tuple"
    _trailing: ClassVar[int] = 2  # u [..., N, D, HV, V]

    @classmethod
    def layout(cls, *, H, HV, V, K):
        f32 = jnp.dtype(jnp.float32)
        return {"u": FieldLayout((HV, V), f32, "HV, V"), "k": FieldLayout((H, K), f32, "H, K"),
                "g": FieldLayout((HV,), f32, "HV")}  # fmt: skip

    @classmethod
    def recorded(cls, *, u, k, g, states):
        return cls(u=u, k=k, g=g)

    def states_at(self, pool, slots, rows, steps, track_steps, *, replay):
        L, N = pool.shape[0], slots.shape[0]
        state0 = pool[:, slots].reshape(L * N, *pool.shape[2:])
        tuples = jax.tree.map(lambda t: t[:, rows].reshape(L * N, *t.shape[2:]), self)
        tile = lambda s: jnp.tile(s, L)  # noqa: E731
        final, tracked = replay(state0, tuples, tile(steps), tile(track_steps))
        return tuple(x.reshape(L, N, *pool.shape[2:]) for x in (final, tracked))

    def along_path(self, rows, path, steps, track_steps):
        R, D = self.num_rows, self.num_steps
        N = path.shape[0]
        ok = (rows >= 0) & (rows < R)
        r, nodes = jnp.where(ok, rows, 0), jnp.clip(path, 0, D - 1)
        tape = jax.tree.map(lambda t: t[:, r[:, None], nodes], self)
        return tape, jnp.where(ok, jnp.arange(N, dtype=jnp.int32), N), steps, track_steps


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Snapshots(Tape):
    """The dense tape: the state after every draft step.

    Attributes:
      states: ``[..., N, D, HV, V, K]`` in the state pool's dtype (float32 or bfloat16).
    """

    states: jax.Array
    mode: ClassVar[str] = "snapshots"
    decays: ClassVar[tuple[str, ...]] = ("scalar", "channel")
    stores_states: ClassVar[bool] = True
    noun: ClassVar[str] = "snapshot"
    _trailing: ClassVar[int] = 3  # states [..., N, D, HV, V, K]

    @classmethod
    def layout(cls, *, H, HV, V, K):
        return {"states": FieldLayout((HV, V, K), STATE_DTYPE, "HV, V, K")}

    @classmethod
    def recorded(cls, *, u, k, g, states):
        return cls(states)

    def states_at(self, pool, slots, rows, steps, track_steps, *, replay):
        D = self.num_steps
        pick = lambda s: self.states[:, rows, jnp.clip(s, 0, D - 1)]  # noqa: E731
        return pick(steps), pick(track_steps)

    def along_path(self, rows, path, steps, track_steps):
        P = path.shape[1]
        at = lambda s: jnp.where(s >= 0, jnp.take_along_axis(path, jnp.clip(s, 0, P - 1)[:, None], 1)[:, 0], -1)  # noqa: E731
        return self, rows, at(steps), at(track_steps)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KDATuples(Tuples):
    """The lossless tape of a per-channel decay (KDA, :mod:`gdn_lossless_jax.kda`): :class:`Tuples`
    with one log-decay per key channel, so a replay decays each column of the ``[V, K]`` state by
    its own channel's factor, one rounded multiply per element as verify did, then the fma.

    Attributes:
      u: ``[..., N, D, HV, V]`` float32, ``beta_t * (v_t - rn(S_{t-1} * exp(g_t)) @ k_t)``.
      k: ``[..., N, D, H, K]`` float32, the l2-normalised key.
      g: ``[..., N, D, HV, K]`` float32, the per-channel log-decay ``-exp(A_log) * softplus(f + dt_bias)``.

    ``HV (V + 2K)`` values a layer, request and step against ``HV V K`` for a snapshot (42.7x fewer
    at K = V = 128). Its replay is the reference's (:func:`gdn_lossless_jax.reference.replay_two`)
    with the decay broadcast by the tape's rank (:func:`gdn_lossless_jax.rounding.decay_factor`);
    commit and a tree's path are :class:`Tuples`'.
    """

    mode: ClassVar[str] = "tuples"
    decays: ClassVar[tuple[str, ...]] = ("channel",)
    noun: ClassVar[str] = "KDA tuple"

    @classmethod
    def layout(cls, *, H, HV, V, K):
        f32 = jnp.dtype(jnp.float32)
        return {"u": FieldLayout((HV, V), f32, "HV, V"), "k": FieldLayout((H, K), f32, "H, K"),
                "g": FieldLayout((HV, K), f32, "HV, K")}  # fmt: skip


#: Every tape class: adding a mode (or a decay's variant of one) is its class and one entry here.
TAPES: tuple[type[Tape], ...] = (Tuples, Snapshots, KDATuples)
#: The record modes by their ``record=`` name, each its GDN class (a scalar decay; :func:`record_type`
#: picks the class of another decay).
RECORDS: dict[str, type[Tape]] = {cls.mode: cls for cls in TAPES if "scalar" in cls.decays}
#: The ``record=`` names (:data:`RECORDS`' keys).
RECORD_MODES = tuple(RECORDS)


def _tape_names() -> str:
    """``"Tuples, Snapshots, KDATuples"``: every tape class, for messages."""
    return ", ".join(cls.__name__ for cls in TAPES)


def record_type(record: "str | type[Tape]", fn: str = "record", decay: str | None = None) -> type[Tape]:
    """The tape class of a record mode, from its ``record=`` name (the API's edge) or the class itself.

    ``decay`` (``"scalar"``, ``"channel"``; None: any for a class, ``"scalar"`` for a name): a name
    is resolved to its class that records that decay (``record="tuples"`` with ``decay="channel"``
    is :class:`KDATuples`); a class must record it.
    """
    if isinstance(record, type) and issubclass(record, Tape) and record in TAPES:
        if decay is not None and decay not in record.decays:
            raise ValueError(f"{fn}: a {record.__name__} tape records a {'/'.join(record.decays)} decay, not "
                             f"decay={decay!r}")  # fmt: skip
        return record
    if isinstance(record, str) and record in RECORDS:
        want = decay or "scalar"
        for cls in TAPES:
            if cls.mode == record and want in cls.decays:
                return cls
        raise ValueError(f"{fn}: no {record!r} tape records decay={decay!r}")
    raise ValueError(f"{fn}: record must be one of {RECORD_MODES}, got {record!r}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Pending:
    """A commit not yet applied: the previous step's tape and, per request of the *next*
    verify, what to commit from it (:func:`gdn_lossless_jax.commit_and_verify`).

    Attributes:
      tape: the previous step's tape (any record mode: :class:`Tuples`, :class:`Snapshots`), ``[L, R, D, ...]``
        (or ``[R, D, ...]`` for a one-layer pool).
      rows: ``[N]`` int, request n's row in ``tape``.
      steps: ``[N]`` int, the accepted step (0-based); negative: nothing pending (a request
        that just joined reads its state as it is).
      track_slots, track_steps: ``[N]`` int, the track copy (negative step: none).
      path: ``[N, P]`` int or None: for a draft tree, each request's accepted root-to-node path
        (node indices, -1 padded); ``steps`` and ``track_steps`` are then positions along it, as
        in :func:`gdn_lossless_jax.commit`.
      layer: None where a caller gives it (the verify's ``layer`` reads the tape); in the
        checked call a backend takes (``VerifyCall.pending``) the int32 scalar layer of ``tape``
        (``[L, R, D, ...]`` always) this call commits, ``path`` already applied (None).

    ``Pending.none(tape, N)`` is a pending commit that commits nothing.
    """

    tape: Tape
    rows: jax.Array
    steps: jax.Array
    track_slots: jax.Array
    track_steps: jax.Array
    path: jax.Array | None = None
    layer: jax.Array | None = None

    @classmethod
    def none(cls, tape: Tape, n: int) -> "Pending":
        off = np.full((n,), -1, np.int32)
        return cls(tape, off, off, off, off)

    def replace(self, **fields: Any) -> "Pending":
        """A copy with the given fields replaced, e.g. ``pending.replace(steps=s2)``."""
        return replace_fields(self, fields)


def stack_tapes(tapes: Sequence[Tape]) -> Tape:
    """Stack per-layer tapes into one with a leading layer axis, as ``commit`` takes it.

    Args:
      tapes: one tape per GDN layer, all from :func:`gdn_lossless_jax.verify` in one record
        mode and of one shape: :class:`Tuples` (``u [N, D, HV, V]``, ``k [N, D, H, K]``,
        ``g [N, D, HV]``), :class:`KDATuples` (``g [N, D, HV, K]``) or :class:`Snapshots`
        (``states [N, D, HV, V, K]``).
    Returns:
      The same kind of tape with every field stacked: ``[L, N, ...]`` for L tapes
      (``jnp.stack``; dtypes kept).
    """
    tapes = list(tapes)
    if not tapes:
        raise ValueError("stack_tapes: need at least one layer's tape, got an empty sequence")
    kind = type(tapes[0])
    if not isinstance(tapes[0], Tape):
        raise TypeError(f"stack_tapes: layer 0 must be a tape (one of {_tape_names()}), got {kind.__name__}")
    for layer, tape in enumerate(tapes[1:], start=1):
        if type(tape) is not kind:
            raise TypeError(
                f"stack_tapes: layer {layer} is a {type(tape).__name__} tape but layer 0 a {kind.__name__} tape; "
                "record every layer in one mode"
            )
        for f in dataclasses.fields(kind):
            x, x0 = getattr(tape, f.name), getattr(tapes[0], f.name)
            if np.shape(x) != np.shape(x0) or jnp.result_type(x) != jnp.result_type(x0):
                raise ValueError(
                    f"stack_tapes: layer {layer}'s field {f.name!r} is {jnp.result_type(x)}{list(np.shape(x))}, "
                    f"layer 0's {jnp.result_type(x0)}{list(np.shape(x0))}; every layer's tape must have one shape "
                    "and dtype"
                )
    return jax.tree.map(lambda *xs: jnp.stack(xs), *tapes)
