"""Verify, replay and commit on a device mesh: heads over a tensor axis, requests over a data axis.

A :class:`MeshPlan` names a ``jax.sharding.Mesh`` and which of its axes shard what. Its methods
(:meth:`~MeshPlan.verify`, :meth:`~MeshPlan.replay`, :meth:`~MeshPlan.commit`,
:meth:`~MeshPlan.commit_and_verify`, :meth:`~MeshPlan.verify_layer`,
:meth:`~MeshPlan.pool_commit`, :meth:`~MeshPlan.flush`) take the same arguments as
:func:`gdn_lossless_jax.verify`, :func:`~gdn_lossless_jax.replay`,
:func:`~gdn_lossless_jax.commit`, :func:`~gdn_lossless_jax.commit_and_verify`,
:func:`gdn_lossless_jax.pool.verify_layer`, :func:`~gdn_lossless_jax.pool.commit` and
:func:`~gdn_lossless_jax.pool.flush`, as *global* arrays, and run those functions per shard under
``jax.shard_map``, with any backend (the kernels only see their shard's shapes). There are no
collectives: each head's recurrence, replay and commit read only that head's state and inputs,
and each request only its own shard's slots and rows. The results are bit-identical to the
single-device run (the same functions on the same bits of every head and request).

The rules
---------
**Tensor axis** (size ``tp``), over heads. Device ``r`` of the axis holds q/k heads
``[r*H/tp, (r+1)*H/tp)`` *together with their v-heads* ``[r*HV/tp, (r+1)*HV/tp)``: v-heads
``[h*HV/H, (h+1)*HV/H)`` share q/k head ``h``'s key, so a group must not be split. H must be a
multiple of ``tp`` (then HV and the conv channels are too); otherwise every method raises a
ValueError naming H, the axis and the sizes that fit. Each device runs a GDN layer of H/tp and
HV/tp heads (:func:`local_geometry`), as SGLang and vLLM shard GDN over tensor-parallel ranks.

**Data axis** (size ``dp``), over requests and the pool. The requests (N, a multiple of ``dp``),
the slot axis of a pool (S slots, a multiple of ``dp``) and the rows of a tape buffer (R, a
multiple of ``dp``) are each split into ``dp`` contiguous blocks. A *global* slot ``g`` lives on
data shard ``g // (S/dp)`` at local slot ``g % (S/dp)``; rows likewise. Request ``n`` is on shard
``n // (N/dp)``, and its slot, track slot and tape row must live on that same shard (an engine
assigns slots and rows per shard): the methods check this when the indices are concrete (called
outside ``jit``) and raise a ValueError naming the request, its shard and the index. Under
``jit`` the indices are traced and cannot be checked: an index that lives on another shard is
then treated like an out-of-range one (its state reads zeros, its writes are skipped), so the
result would differ from a single device's. Indices out of range globally stay out of range on
every shard. ``rows=None`` means, per shard, its own first rows in order (request ``i`` of shard
``d`` uses global row ``d*R/dp + i``), which is the single-device default when ``dp == 1``.
A pool from :func:`gdn_lossless_jax.pool.allocate` has ``slots + 1`` slots and ``requests + 1``
rows (the padding slot and row): :meth:`MeshPlan.allocate` checks both divide and places the pool.

**Conv channels** (the pool methods only). The conv runs over the ``conv_dim = 2*H*K + HV*V``
channels ``[q | k | v]``; a tensor shard needs its heads' q, k and v channels, which are not
contiguous in that order. With ``tp > 1`` the pool methods take every conv array (``mixed_qkv``,
``conv_weight``, ``conv_bias``, the pool's ``conv`` and ``conv_windows``) in the
*tensor-parallel order*: block ``r`` of ``conv_dim / tp`` channels is ``[q_r | k_r | v_r]``, shard
``r``'s own ``[q | k | v]`` (what each rank of SGLang or vLLM holds). The conv is per channel, so
the order changes no bit. Permute the in-projection's output columns and the conv weight and bias
once at load time with :func:`to_tp_layout`; the pool's conv states are then in that order too
(:func:`from_tp_layout` reads them back). With ``tp == 1`` the order is the usual one.

**Argument kinds.** Every argument has a kind (:data:`KINDS`): which of its axes, counted from
the end, the data and the tensor axes split. :data:`ARG_KINDS` gives the kind of every argument
of every method; a new entry point needs only its row there (and in ``_INDEX_TARGETS`` for its
index arguments) and a method that calls :meth:`MeshPlan.run` (as :meth:`~MeshPlan.commit_and_verify`
does). :meth:`MeshPlan.spec`, :meth:`~MeshPlan.sharding` and
:meth:`~MeshPlan.put` build the ``PartitionSpec``, ``NamedSharding`` or placed array of any kind.
A KDA call (a per-channel decay: ``a`` one axis more than ``b``) splits ``a [N, D, HV, K]`` as the
heads, ``dt_bias [HV, K]`` over its heads (``"per_key_channel"``) and its tape's ``g [..., HV, K]``
as the tape's heads: the same methods, bit for bit one device's.

**Plain functions under jit.** ``jax.jit`` of the unsharded functions on arrays placed with these
shardings gives the same bits with the reference backend (XLA propagates the shardings, but
commit all-gathers: its gathers by slot cannot know each request's slot is on its own shard). The
Pallas and Triton kernels have no partitioning rule, so XLA would run them whole on replicated
operands: use the methods here (``shard_map``) for the kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .. import api, checks, staging
from .. import pool as pool_mod
from .. import reference
from ..config import Geometry
from ..tape import KDATuples, Pending, Snapshots, Tape, Tuples
from .layout import _check_heads_split, conv_channel_order, from_tp_layout, local_geometry, to_tp_layout

__all__ = [
    "ARG_KINDS",
    "KINDS",
    "Kind",
    "MeshPlan",
    "conv_channel_order",
    "from_tp_layout",
    "local_geometry",
    "pending_kinds",
    "pool_kinds",
    "shard_map",
    "tape_kinds",
    "to_tp_layout",
]

#: ``jax.shard_map`` (jax >= 0.7); older releases had it in ``jax.experimental.shard_map``.
shard_map = getattr(jax, "shard_map", None)
if shard_map is None:  # pragma: no cover - the supported jax has jax.shard_map
    from jax.experimental.shard_map import shard_map  # type: ignore[no-redef]


@dataclasses.dataclass(frozen=True)
class Kind:
    """Which axes of an argument the mesh axes split, counted from the end (None: not split).

    Attributes:
      data: the axis of requests, slots or rows, split over the data axis.
      tensor: the axis of heads (or conv channels), split over the tensor axis.
      what: what the data axis indexes, for messages.
      tensor_what: what the tensor axis indexes, for messages.
    """

    data: int | None
    tensor: int | None
    what: str = "requests"
    tensor_what: str = "heads"


#: The argument kinds. Ranks may carry leading axes (a layer axis L): axes count from the end.
KINDS: dict[str, Kind] = {
    # state0 [N, HV, V, K]; a pool [L?, S, HV, V, K]; replay's result
    "state": Kind(-4, -3),
    "pool_state": Kind(-4, -3, "slots"),
    # q, k [N, D, H, K]; v and verify's outputs [N, D, HV, V]
    "heads": Kind(-4, -2),
    # a, b [N, D, HV]; mixed_qkv [N, D, conv_dim] (conv channels in the tensor-parallel order)
    "per_step": Kind(-3, -1),
    # a tape: u [L?, R, D, HV, V], k [L?, R, D, H, K] (tape_heads), g [L?, R, D, HV] (tape_gates),
    # states [L?, R, D, HV, V, K] (tape_snapshots); R requests (fresh tapes) or buffer rows
    "tape_heads": Kind(-4, -2, "rows"),
    "tape_gates": Kind(-3, -1, "rows"),
    "tape_snapshots": Kind(-5, -3, "rows"),
    # the conv pool [L, S, conv_dim, Kc-1] and windows [L, R, conv_dim, D+Kc-2]
    "conv_pool": Kind(-3, -2, "slots", "conv channels"),
    "conv_windows": Kind(-3, -2, "rows", "conv channels"),
    # A_log, dt_bias [HV]; conv_bias [conv_dim]; conv_weight [conv_dim, Kc]
    "per_head": Kind(None, -1),
    # a per-channel decay's (KDA's) dt_bias [HV, K]; its a [N, D, HV, K] is "heads", its tape's g "tape_heads"
    "per_key_channel": Kind(None, -2),
    "conv_weight": Kind(None, -2, tensor_what="conv channels"),
    # slots, steps, track_slots, track_steps, rows [N]
    "index": Kind(-1, None),
    # layer (a scalar), anything the same on every device
    "replicated": Kind(None, None),
}

#: The kind of every argument (and result) of every method; ``"tape"``, ``"pool"`` and ``"pending"``
#: stand for the trees :func:`tape_kinds`, :func:`pool_kinds` and :func:`pending_kinds` give for
#: the value passed.
ARG_KINDS: dict[str, dict[str, str]] = {
    "verify": dict(state0="state", q="heads", k="heads", v="heads", a="per_step", b="per_step", A_log="per_head",
                   dt_bias="per_head", slots="index", layer="replicated", tape="tape", rows="index", out="heads",
                   result="heads, tape"),  # fmt: skip
    "replay": dict(state0="state", tuples="tape", steps="index", result="state"),
    "commit": dict(pool="pool_state", tape="tape", slots="index", steps="index", track_slots="index",
                   track_steps="index", rows="index", result="pool_state"),  # fmt: skip
    "verify_layer": dict(pool="pool", layer="replicated", mixed_qkv="per_step", a="per_step", b="per_step",
                         conv_weight="conv_weight", conv_bias="per_head", A_log="per_head", dt_bias="per_head",
                         slots="index", rows="index", result="heads, pool"),  # fmt: skip
    "pool_commit": dict(pool="pool", slots="index", steps="index", track_slots="index", track_steps="index",
                        rows="index", result="pool"),  # fmt: skip
    "flush": dict(pool="pool", result="pool"),
    "commit_and_verify": dict(pool="pool_state", pending="pending", q="heads", k="heads", v="heads", a="per_step",
                              b="per_step", A_log="per_head", dt_bias="per_head", slots="index", layer="replicated",
                              tape="tape", rows="index", out="heads", result="heads, tape, pool_state"),  # fmt: skip
}

# Which array's data axis each index argument points into (made local per shard); dotted names
# reach into an argument's fields.
_INDEX_TARGETS: dict[str, dict[str, str]] = {
    "verify": {"slots": "state0", "rows": "tape"},
    "commit": {"slots": "pool", "track_slots": "pool", "rows": "tape"},
    "verify_layer": {"slots": "pool", "rows": "pool.tape"},
    "pool_commit": {"slots": "pool", "track_slots": "pool", "rows": "pool.tape"},
    "commit_and_verify": {"slots": "pool", "rows": "tape", "pending.rows": "pending.tape",
                          "pending.track_slots": "pool"},  # fmt: skip
}
# The step that decides whether a track copy happens (an inactive one needs no local slot).
_TRACK_STEPS = {"track_slots": "track_steps", "pending.track_slots": "pending.track_steps"}


def tape_kinds(tape: Tape) -> Tape:
    """The kinds of a tape's fields, as a tape of the same type (a pytree prefix)."""
    if isinstance(tape, Snapshots):
        return Snapshots(states="tape_snapshots")
    if isinstance(tape, KDATuples):  # g [L?, R, D, HV, K]: one log-decay per key channel
        return KDATuples(u="tape_heads", k="tape_heads", g="tape_heads")
    if isinstance(tape, Tuples):
        return Tuples(u="tape_heads", k="tape_heads", g="tape_gates")
    raise TypeError(f"tape_kinds: expected a Tuples or Snapshots tape, got {type(tape).__name__}")


def pool_kinds(p: pool_mod.StatePool) -> pool_mod.StatePool:
    """The kinds of a :class:`~gdn_lossless_jax.pool.StatePool`'s arrays, as a StatePool.

    A pool that defers its commit (``allocate(..., defer_commit=True)``) keeps the pending
    entries per scratch row (``[R+1]`` arrays: split like the rows)."""
    d = p.deferred
    if d is not None:  # (its static fields, the parity among them, as they are)
        d = dataclasses.replace(d, tape=tape_kinds(d.tape), slots="index", steps="index", track_slots="index",
                                track_steps="index", rows="index", applied="index")  # fmt: skip
    return dataclasses.replace(p, ssm="pool_state", conv="conv_pool", tape=tape_kinds(p.tape), conv_windows="conv_windows",
                               deferred=d)  # fmt: skip


def pending_kinds(pending: Pending) -> Pending:
    """The kinds of a :class:`~gdn_lossless_jax.Pending` commit: its tape's, and ``[N]`` indices."""
    return Pending(tape_kinds(pending.tape), "index", "index", "index", "index")


def _is_concrete(x) -> bool:
    if isinstance(x, jax.core.Tracer):
        return False
    return not isinstance(x, jax.Array) or x.is_fully_addressable


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """A mesh and the axes that shard heads (``tensor``) and requests (``data``).

    Either axis may be None (not sharded); an axis of the mesh that neither names replicates
    the work. Hashable: it is a static argument of the jitted methods.

    Attributes:
      mesh: the ``jax.sharding.Mesh`` (``Auto`` or ``Explicit`` axis types).
      tensor: the axis name over heads, or None.
      data: the axis name over requests, pool slots and tape rows, or None.

    >>> import jax
    >>> plan = MeshPlan(jax.make_mesh((1, 1), ("data", "tensor")), tensor="tensor", data="data")
    >>> plan.spec("heads", 4), plan.spec("pool_state", 5)
    (P('data', None, 'tensor', None), P(None, 'data', 'tensor', None, None))
    """

    mesh: Mesh
    tensor: str | None = None
    data: str | None = None

    def __post_init__(self):
        if not isinstance(self.mesh, Mesh):
            raise TypeError(f"MeshPlan: argument 'mesh' must be a jax.sharding.Mesh, got {type(self.mesh).__name__}")
        for role in ("tensor", "data"):
            name = getattr(self, role)
            if name is not None and name not in self.mesh.axis_names:
                raise ValueError(f"MeshPlan: argument {role!r} must be one of the mesh's axes "
                                 f"{tuple(self.mesh.axis_names)} or None, got {name!r}")  # fmt: skip
        if self.tensor is not None and self.tensor == self.data:
            raise ValueError(f"MeshPlan: the tensor and data axes must differ, both are {self.tensor!r}")

    @property
    def tp(self) -> int:
        """The tensor axis size (1 without a tensor axis)."""
        return self.mesh.shape[self.tensor] if self.tensor else 1

    @property
    def dp(self) -> int:
        """The data axis size (1 without a data axis)."""
        return self.mesh.shape[self.data] if self.data else 1

    # -- shardings ---------------------------------------------------------------------
    def spec(self, kind: str, ndim: int) -> PartitionSpec:
        """The ``PartitionSpec`` of an array of ``kind`` (:data:`KINDS`) and rank ``ndim``."""
        if kind not in KINDS:
            raise ValueError(f"MeshPlan.spec: kind must be one of {tuple(KINDS)}, got {kind!r}")
        k, axes = KINDS[kind], [None] * ndim
        for dim, name in ((k.data, self.data), (k.tensor, self.tensor)):
            if dim is not None and name is not None:
                if ndim < -dim:
                    raise ValueError(f"MeshPlan.spec: an array of kind {kind!r} has rank >= {-dim}, got rank {ndim}")
                axes[ndim + dim] = name
        return PartitionSpec(*axes)

    def sharding(self, kind: str, ndim: int) -> NamedSharding:
        """The ``NamedSharding`` of an array of ``kind`` and rank ``ndim`` on this mesh."""
        return NamedSharding(self.mesh, self.spec(kind, ndim))

    def specs(self, kinds, tree):
        """A pytree of PartitionSpecs for ``tree`` (arrays or shape structs), ``kinds`` a
        prefix tree of kind names (``"tape"``/``"pool"`` expand for the value given)."""
        return jax.tree.map(lambda k, x: self.spec(k, np.ndim(x)), _expand(kinds, tree), tree)

    def shardings(self, kinds, tree):
        """Like :meth:`specs`, as NamedShardings."""
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.specs(kinds, tree))

    def put(self, tree, kinds):
        """``jax.device_put`` of ``tree`` with the shardings of ``kinds`` (a kind name, or a tree).

        >>> import jax, jax.numpy as jnp
        >>> plan = MeshPlan(jax.make_mesh((1,), ("tensor",)), tensor="tensor")
        >>> plan.put(jnp.zeros((2, 3, 4)), "per_step").sharding.spec
        P(None, None, 'tensor')
        """
        self.check_divisible("MeshPlan.put", "tree", tree, kinds)
        return jax.device_put(tree, self.shardings(kinds, tree))

    def check_divisible(self, fn: str, name: str, tree, kinds) -> None:
        """Raise a ValueError naming the argument if an axis the mesh splits does not divide."""
        kinds = _expand(kinds, tree)
        for (path, x), k in zip(jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(kinds)):
            kd, shape = KINDS[k], np.shape(x)
            for dim, axis, size, what in ((kd.data, self.data, self.dp, kd.what),
                                          (kd.tensor, self.tensor, self.tp, kd.tensor_what)):  # fmt: skip
                if dim is None or axis is None or len(shape) < -dim or shape[dim] % size == 0:
                    continue
                arg = name + jax.tree_util.keystr(path)
                raise ValueError(
                    f"{fn}: argument {arg!r} has {shape[dim]} {what} on axis {len(shape) + dim} (shape "
                    f"{checks.fmt_shape(shape)}), not a multiple of the {'data' if axis == self.data else 'tensor'} axis "
                    f"{axis!r} of size {size}: each device must hold the same number"
                )

    # -- pools -------------------------------------------------------------------------
    def allocate(self, geometry: Geometry, *, slots: int, requests: int, drafts: int, **kw) -> pool_mod.StatePool:
        """:func:`gdn_lossless_jax.pool.allocate`, created in place on the mesh (each device
        allocates its own shard). ``slots + 1`` and ``requests + 1`` (with the padding slot and
        row) must be multiples of the data axis size; H of the tensor axis size."""
        fn = "MeshPlan.allocate"
        _check_heads_split(fn, geometry.num_k_heads, geometry.num_v_heads, self.tp, self.tensor)
        for name, n, pad in (("slots", slots, "slot"), ("requests", requests, "row")):
            if isinstance(n, int) and (n + 1) % self.dp:
                raise ValueError(
                    f"{fn}: {name} + 1 = {n + 1} (with the padding {pad}) must be a multiple of the data axis "
                    f"{self.data!r} of size {self.dp}: e.g. {name}={(n + 1 + self.dp - 1) // self.dp * self.dp - 1}"
                )
        make = functools.partial(pool_mod.allocate, geometry, slots=slots, requests=requests, drafts=drafts, **kw)
        spec = jax.eval_shape(make)
        return jax.jit(make, out_shardings=self.shardings("pool", spec))()

    # -- the methods: the unsharded functions' signatures, derived (_per_shard, below the class) --
    def flush(self, pool: pool_mod.StatePool, *, backend: str = "auto") -> pool_mod.StatePool:
        """:func:`gdn_lossless_jax.pool.flush` per shard (the pool is donated).

        With a data axis, a pool that defers its commit keeps its pending entries in each shard's
        own (local) indices, as :meth:`pool_commit` left them: keep such a pool on the mesh (these
        methods) until it is flushed."""
        if pool.deferred is None:
            return pool

        def call(x):
            return pool_mod.flush(x["pool"], backend=backend)

        return self.run("flush", call, dict(pool=pool), donate="pool")

    # -- the machinery -------------------------------------------------------------------
    def run(self, name: str, call: Callable[[dict], Any], args: dict, *, check: bool = True, fill_rows: str | None = None,
            donate: str | None = None):  # fmt: skip
        """Run ``call`` (the unsharded function on a dict of arguments) per shard.

        ``args`` maps the names of :data:`ARG_KINDS` ``[name]`` to global arrays (None: not
        given). Global shapes are checked first by ``call`` itself (under ``jax.eval_shape``),
        then the divisions the mesh needs; index arguments of ``_INDEX_TARGETS[name]`` are made
        local per shard (and checked when concrete); ``rows=None`` becomes each shard's own
        rows when ``fill_rows`` names the array they index. ``donate``: an argument to donate.
        """
        ranks = {**_ONE_LAYER_RANKS, **(reference.CHANNEL_INPUT_RANKS if _channel(args) else {})}
        for arg, rank in ranks.items():
            if args.get(arg) is not None and np.ndim(args[arg]) == rank + 1:
                raise ValueError(
                    f"MeshPlan.{name}: argument {arg!r} has rank {rank + 1} (stacked over layers), which a mesh does not "
                    f"split; pass one layer's (rank {rank}), got shape {list(np.shape(args[arg]))}"
                )
        if check and self.dp > 1:
            self._check_local(name, args)
        args = {k: _int32(x) if ARG_KINDS[name].get(k) == "index" else x for k, x in args.items()}
        if isinstance(args.get("pending"), Pending):
            pend = args["pending"]
            args["pending"] = Pending(pend.tape, *(_int32(getattr(pend, f)) for f in ("rows", "steps", "track_slots",
                                                                                       "track_steps")))  # fmt: skip
        static = (self, name, _Static(call), fill_rows, tuple(args))
        if donate is None:
            return _run_kept(*static, {}, args)
        kept = {k: x for k, x in args.items() if k != donate}
        return _run_donated(*static, {donate: args[donate]}, kept)

    def _check_local(self, name: str, args: dict) -> None:
        fn = f"MeshPlan.{name}"
        targets = _INDEX_TARGETS.get(name, {})
        given = [i for i in targets if _get(args, i) is not None]
        if not given or np.shape(_get(args, given[0]))[0] % self.dp:
            return  # shapes are checked (with their own message) in the traced call
        n = np.shape(_get(args, given[0]))[0]
        for idx_name in given:
            idx = _get(args, idx_name)
            size = _target_size(args, targets[idx_name])
            if not _is_concrete(idx) or size is None or size % self.dp:
                continue
            idx = np.asarray(idx)
            block, per = size // self.dp, n // self.dp
            owner = np.where((idx >= 0) & (idx < size), idx // block, -1)
            shard = np.arange(n) // per
            steps = _get(args, _TRACK_STEPS.get(idx_name, ""))
            if steps is not None and _is_concrete(steps):  # an inactive track copy moves nothing
                owner = np.where(np.asarray(steps) >= 0, owner, -1)
            bad = np.flatnonzero((owner >= 0) & (owner != shard))
            if bad.size:
                i = int(bad[0])
                what = "tape row" if idx_name.endswith("rows") else idx_name.split(".")[-1][:-1].replace("_", " ")
                raise ValueError(
                    f"{fn}: argument {idx_name!r}: request {i} is on data shard {shard[i]} of {self.dp} (requests "
                    f"[{shard[i] * per}, {(shard[i] + 1) * per})), but its {what} {idx[i]} lives on data shard "
                    f"{owner[i]} ({what}s [{owner[i] * block}, {(owner[i] + 1) * block}) of {size}); each request's "
                    f"slots and row must be on its own shard (no collectives move states between shards)"
                )


def _per_shard(fn: Callable, name: str, *, fill_rows: str | None = None, donate: str | None = None,
               exclude: tuple[str, ...] = (), doc: str = "") -> Callable:
    """The method ``MeshPlan.<name>``: ``fn`` per shard, with ``fn``'s signature (less ``exclude``)
    and a keyword ``check``. The arguments :data:`ARG_KINDS` ``[name]`` names are arrays split over
    the mesh; the others are options passed to every shard as they are."""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.name not in exclude]
    kinds = ARG_KINDS[name]

    def method(self, *args, check: bool = True, **kwargs):
        bound = sig.replace(parameters=params).bind(*args, **kwargs)
        bound.apply_defaults()
        arrays = {k: v for k, v in bound.arguments.items() if k in kinds}
        opts = {k: v for k, v in bound.arguments.items() if k not in kinds}
        if opts.get("out_dtype") is not None:
            opts["out_dtype"] = jnp.dtype(opts["out_dtype"])
        if "parents" in opts:
            opts["parents"] = _freeze(opts["parents"])
        static_layer = None
        if "layer" in arrays:
            static_layer, arrays["layer"] = _split_layer(arrays["layer"])

        def call(x, static_layer=static_layer):
            kw = {**opts, "parents": _thaw(opts["parents"])} if "parents" in opts else opts
            return fn(**{**x, **({"layer": _layer(x, static_layer)} if "layer" in x else {})}, **kw)

        return self.run(name, call, arrays, check=check, fill_rows=fill_rows, donate=donate)

    check = inspect.Parameter("check", inspect.Parameter.KEYWORD_ONLY, default=True, annotation=bool)
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    method.__signature__ = sig.replace(parameters=[self_param, *params, check])
    method.__name__, method.__qualname__ = name, f"MeshPlan.{name}"
    method.__doc__ = (f":func:`{fn.__module__}.{fn.__name__}` per shard: its arguments, shapes and results, global, "
                      f"split as :data:`ARG_KINDS` says.\n\n{doc}``check``: check that every request's slot and row "
                      "lives on its data shard when the indices are concrete (see the module docstring).")  # fmt: skip
    return method


_ROWS = "Index arguments are global (slots of the pool, rows of the tape); ``rows=None``: each shard's own rows in order. "
MeshPlan.verify = _per_shard(api.verify, "verify", fill_rows="tape", doc=_ROWS + (
    "With ``slots``, ``state0`` is the pool ``[L?, S, HV, V, K]``; ``out`` is sharded like the outputs (not donated: the "
    "per-shard call writes a copy). "))
MeshPlan.replay = _per_shard(api.replay, "replay", exclude=("checked",))
MeshPlan.commit = _per_shard(api.commit, "commit", fill_rows="tape", exclude=("checked",), doc=_ROWS + "Not donated. ")
MeshPlan.verify_layer = _per_shard(pool_mod.verify_layer, "verify_layer", fill_rows="pool", donate="pool", doc=(
    "The pool is donated. The conv arrays (``mixed_qkv``, ``conv_weight``, ``conv_bias`` and the pool's conv states) are "
    "in the tensor-parallel channel order when ``tp > 1`` (:func:`to_tp_layout`). "))
MeshPlan.pool_commit = _per_shard(pool_mod.commit, "pool_commit", fill_rows="pool", donate="pool", exclude=("checked",),
                                  doc="SSM and conv; the pool is donated. ")
MeshPlan.commit_and_verify = _per_shard(api.commit_and_verify, "commit_and_verify", fill_rows="tape", doc=_ROWS + (
    "``pending.rows`` are global rows of ``pending.tape`` and ``pending.track_slots`` global slots of ``pool``, on each "
    "request's own data shard like ``slots`` and ``rows``. "))


def _int32(x):
    """Index arguments as int32 (:func:`gdn_lossless_jax.staging.as_index`: host values stay on the
    host, which ``jit`` takes as replicated, across processes too)."""
    return None if x is None else staging.as_index(x)


def _get(args: Mapping, path: str):
    """``args["a"]`` or, for ``"a.b"``, ``args["a"].b`` (None where missing)."""
    head, _, rest = path.partition(".")
    x = args.get(head)
    return x if not rest or x is None else getattr(x, rest, None)


def _set(args: dict, path: str, value) -> None:
    head, _, rest = path.partition(".")
    args[head] = value if not rest else dataclasses.replace(args[head], **{rest: value})


def _target_size(args: Mapping, target: str) -> int | None:
    """The length of the data axis an index points into: a pool's slots, a tape's rows."""
    x = _get(args, target)
    if x is None:
        return None
    if isinstance(x, pool_mod.StatePool):
        return x.ssm.shape[1]
    if isinstance(x, (Tuples, Snapshots)):
        return x.num_rows
    return np.shape(x)[-4]


def _expand(kinds, tree):
    """Kind names to a full tree: ``"tape"``, ``"pool"`` and kinds given for a subtree broadcast."""
    if isinstance(kinds, str):
        if kinds == "tape":
            return _expand(tape_kinds(tree), tree)
        if kinds == "pool":
            return _expand(pool_kinds(tree), tree)
        if kinds == "pending":
            return _expand(pending_kinds(tree), tree)
        return jax.tree.map(lambda _: kinds, tree)
    if isinstance(kinds, dict):
        return {k: _expand(kinds[k], tree[k]) for k in tree}
    return jax.tree.map(lambda k, t: _expand(k, t), kinds, tree, is_leaf=lambda x: isinstance(x, str))


def _channel(args: Mapping) -> bool:
    """Whether the call's decay is per key channel (KDA): ``a`` one axis more than ``b``."""
    a, b = args.get("a"), args.get("b")
    return a is not None and b is not None and np.ndim(a) == np.ndim(b) + 1


def _arg_kinds(name: str, args: dict) -> dict:
    table = dict(ARG_KINDS[name])
    if name == "verify" and args.get("slots") is not None:
        table["state0"] = "pool_state"  # the pool itself (same split, slots for messages)
    if _channel(args):  # KDA: a [N, D, HV, K] split as q, k and v are; dt_bias [HV, K] over its heads
        table.update(a="heads", dt_bias="per_key_channel")
    return {k: _expand(table[k], x) for k, x in args.items() if x is not None}


def _result_kinds(name: str, result):
    kinds = [s.strip() for s in ARG_KINDS[name]["result"].split(",")]
    if len(kinds) == 1:
        return _expand(kinds[0], result)
    return tuple(_expand(k, r) for k, r in zip(kinds, result))


#: One layer's rank of the inputs that the unsharded functions also take stacked over layers.
_ONE_LAYER_RANKS = {**reference.INPUT_RANKS, "mixed_qkv": 3, "conv_weight": 2, "conv_bias": 1}


def _split_layer(layer):
    """A Python int stays static (closed over); an array travels replicated."""
    if layer is None or isinstance(layer, (int, np.integer)):
        return layer, None
    return None, layer


def _layer(x: dict, static_layer):
    return x["layer"] if x.get("layer") is not None else static_layer


def _freeze(parents):
    return None if parents is None else tuple(map(tuple, np.atleast_2d(np.asarray(parents)).tolist()))


def _thaw(parents):
    return None if parents is None else np.asarray(parents)


class _Static:
    """A callable as a static jit argument, hashed by its code and the values it closes over,
    so that a method called again with the same options reuses the compilation."""

    def __init__(self, fn):
        self.fn = fn
        cells = tuple(c.cell_contents for c in (fn.__closure__ or ()))
        defaults = fn.__defaults__ or ()
        self.key = (fn.__code__, _hashable(cells), _hashable(defaults))

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, _Static) and self.key == other.key


def _hashable(values):
    out = []
    for v in values:
        if isinstance(v, dict):
            out.append(tuple(sorted((k, _hashable((x,))) for k, x in v.items())))
        elif isinstance(v, (list, tuple)):
            out.append(_hashable(v))
        else:
            out.append(v)
    return tuple(out)


def _localize(idx, block: int, shard):
    """Global indices to this shard's: its own block ``[shard*block, (shard+1)*block)`` maps to
    ``[0, block)``; everything else (other shards, out of range) to -1, which every function
    treats as out of range (reads zeros, writes nothing)."""
    lo = shard * block
    return jnp.where((idx >= lo) & (idx < lo + block), idx - lo, -1).astype(jnp.int32)


def _run(plan: MeshPlan, name: str, call: _Static, fill_rows, names: tuple, donated: dict, kept: dict):
    """The traced body of :meth:`MeshPlan.run` (jitted twice below: with and without donation)."""
    fn = f"MeshPlan.{name}"
    both = {**donated, **kept}  # jit sorted the keys: back to the signature's order, for messages
    given = {k: both[k] for k in names if both.get(k) is not None}
    # The unsharded function's own checks, on the global shapes (messages name global sizes).
    # Shapes without their shardings: on a mesh of Explicit axes the types carry them, and the
    # global gathers would ask for output shardings.
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), given)
    result = jax.eval_shape(lambda g: call.fn({**dict.fromkeys(names), **g}), shapes)
    H, HV = _heads(given)
    _check_heads_split(fn, H, HV, plan.tp, plan.tensor)
    kinds = _arg_kinds(name, given)
    for k, x in given.items():
        plan.check_divisible(fn, k, x, kinds[k])
    out_specs = plan.specs(_result_kinds(name, result), result)
    in_specs = {k: plan.specs(kinds[k], x) for k, x in given.items()}
    sizes = {k: _target_size(given, t) for k, t in _INDEX_TARGETS.get(name, {}).items()}
    sizes = {k: n for k, n in sizes.items() if n is not None}
    geometry = given["pool"].geometry if isinstance(given.get("pool"), pool_mod.StatePool) else None
    for k, size in sizes.items():
        if size is not None and size % plan.dp:
            raise ValueError(f"{fn}: the {k} index {_INDEX_TARGETS[name][k]!r} holds {size}, not a multiple of "
                             f"the data axis {plan.data!r} of size {plan.dp}")  # fmt: skip

    def local(x):
        shard = lax.axis_index(plan.data) if plan.data else 0
        x = dict(x)
        for k, size in sizes.items():
            if _get(x, k) is not None:
                # One data shard: local indices are the global ones (and the traced step is the
                # unsharded one, op for op).
                if plan.dp > 1:
                    _set(x, k, _localize(_get(x, k), size // plan.dp, shard))
            elif k == "rows" and fill_rows in x:
                n = np.shape(next(x[i] for i in ("slots", "q") if i in x))[0]
                x[k] = jnp.arange(n, dtype=jnp.int32)
        if geometry is not None:  # the shard's pool is a pool of H/tp heads
            x["pool"] = dataclasses.replace(x["pool"], geometry=local_geometry(geometry, plan.tp))
        token = pool_mod.CHECK_REQUESTS.set(False)  # checked on the global shapes (eval_shape above)
        try:
            out = call.fn({**dict.fromkeys(names), **x})
        finally:
            pool_mod.CHECK_REQUESTS.reset(token)
        is_pool = lambda o: isinstance(o, pool_mod.StatePool)  # noqa: E731
        return jax.tree.map(lambda o: dataclasses.replace(o, geometry=geometry) if is_pool(o) else o, out,
                            is_leaf=is_pool)  # fmt: skip

    # Inputs placed elsewhere (one device, another layout) move to the plan's layout first; on a
    # mesh of Explicit axes shard_map requires the types to match already.
    given = jax.tree.map(lambda x, s: _place(plan.mesh, x, s), given, in_specs)
    # check_vma=False: Pallas and Triton calls declare no varying mesh axes for their outputs.
    # staging.unstaged: the index arguments were staged (or not, in a loop body) by _int32 out here.
    return shard_map(staging.unstaged(local), mesh=plan.mesh, in_specs=(in_specs,), out_specs=out_specs,
                     check_vma=False)(given)  # fmt: skip


def _place(mesh: Mesh, x, spec: PartitionSpec):
    if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        return jax.sharding.reshard(x, NamedSharding(mesh, spec))
    return lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


_run_kept = jax.jit(_run, static_argnums=(0, 1, 2, 3, 4))
_run_donated = jax.jit(_run, static_argnums=(0, 1, 2, 3, 4), donate_argnums=5)


def _heads(given: Mapping) -> tuple[int, int]:
    """(H, HV) from whichever argument carries both."""
    if "q" in given:
        return np.shape(given["q"])[-2], np.shape(given["v"])[-2]
    if "pool" in given and isinstance(given["pool"], pool_mod.StatePool):
        g = given["pool"].geometry
        return g.num_k_heads, g.num_v_heads
    tape = given.get("tape", given.get("tuples"))
    if isinstance(tape, Tuples):
        return np.shape(tape.k)[-2], np.shape(tape.u)[-2]
    HV = np.shape(tape.states)[-3]
    return HV, HV  # a snapshot tape has no q/k heads: any split of whole v-heads is exact
