"""The state pool of a hybrid model's GDN layers, with the speculative scratch.

Layout (SGLang's MambaPool; every tensor has a padding slot or row, the ``+1``)::

    ssm           [L, S+1, HV, V, K]            float32 or bfloat16   per-request recurrent states
    conv          [L, S+1, conv_dim, Kc-1]      conv dtype (bf16)     per-request conv states
    tape          Snapshots [L, R+1, D, HV, V, K] in the state dtype, or
                  Tuples u [L, R+1, D, HV, V], k [L, R+1, D, H, K], g [L, R+1, D, HV], float32
    conv_windows  [L, R+1, conv_dim, D+Kc-2]    conv dtype            deduplicated conv windows

S mamba slots, R running requests (scratch rows are batch positions, not slots), D the
most draft tokens a verify may carry. The shapes are defined once, in :mod:`gdn_lossless_jax.specs`
(:func:`state_specs`, :func:`tape_specs`, :func:`conv_window_spec`, re-exported here):
:func:`allocate` builds the pool from them and :mod:`gdn_lossless_jax.tools.memory` counts bytes
from them, so the accounting equals the allocation byte for byte.

:func:`verify_layer` runs one layer's conv and GDN verify from the pool and writes the
tape and windows into scratch rows; :func:`commit` writes the accepted states of all
layers (SSM through :func:`gdn_lossless_jax.commit`, conv through
:func:`gdn_lossless_jax.conv.conv_commit`). Both are jitted with the pool donated, so on a
GPU the updates happen in place; keep using the returned pool, not the argument.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import api, backends, checked as checked_mode, checks, reference, tree
from .backends.contract import VerifyCall
from .checks import check_heads, check_index, check_rank, check_shape, fmt_shape, shape_of
from .config import Geometry
from .conv import conv_commit, verify_from_pool
from .reference import in_range
from .staging import as_index, unstaged
from .specs import (POOL_RECORD_MODES, SCRATCH, SCRATCH_MODES, ArraySpec, SeedRing, check_fits, conv_window_spec,
                    device_free_bytes, scratch_rows, state_specs, tape_specs)  # fmt: skip
from .tape import Pending, Tape, record_type, replace_fields

__all__ = [
    "ArraySpec",
    "POOL_RECORD_MODES",
    "SCRATCH_MODES",
    "StatePool",
    "allocate",
    "check_supported",
    "commit",
    "flush",
    "Deferred",
    "conv_window_spec",
    "device_free_bytes",
    "scratch_rows",
    "state_specs",
    "store_layer",
    "tape_specs",
    "verify_layer",
]

def _positive(fn: str, **values: int) -> None:
    for name, x in values.items():
        if not isinstance(x, (int, np.integer)) or x < 1:
            raise ValueError(f"{fn}: argument {name!r} must be a positive integer, got {x!r}")


def check_supported(fn: str, geometry: Geometry, *, drafts: int = 1, topk: int = 1, parents: Any = None) -> None:
    """Reject what the pool cannot hold, before anything is allocated.

    Heads that do not divide, a draft tree that is not one (``parents`` ``[drafts]`` or
    ``[R, drafts]``, each parent in ``[-1, d)``, at most ``topk`` children a node;
    :func:`gdn_lossless_jax.checks.check_tree`).
    ``topk > 1`` without ``parents`` is a pool for trees given per step.
    """
    if not isinstance(geometry, Geometry):
        raise TypeError(f"{fn}: argument 'geometry' must be a Geometry, got {type(geometry).__name__}")
    check_heads(fn, geometry.num_k_heads, geometry.num_v_heads)
    if parents is None:  # (topk > 1: trees given per step; only its type and sign are checked)
        checks.check_topk(fn, topk)
    else:
        shape = shape_of(parents)
        checks.check_tree(fn, parents, topk, shape[0] if len(shape) == 2 else 1, drafts)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Deferred:
    """The SSM commit a pool has not applied yet (``allocate(..., defer_commit=True)``).

    ``pool.commit`` of such a pool applies the conv part at once and keeps the SSM part here;
    the next ``pool.verify_layer`` applies it inside the verify kernel
    (:func:`gdn_lossless_jax.commit_and_verify`), so each state is read once per step. The pool
    has two scratch tapes, ``StatePool.tape`` and ``Deferred.tape``; steps alternate between
    them (``parity``, static: the buffers never move, so a jitted step that donates the pool
    updates both in place; each parity compiles once).

    Attributes:
      tape: the second scratch tape, in the pool's record mode.
      slots, steps, track_slots, track_steps, rows: ``[P]`` int32 (P scratch rows), the
        previous commit's arguments, padded with slot -1.
      applied: ``[P]`` bool: entries the current step's verify has applied (their requests
        are in this step's batch); the others are flushed by the next ``commit`` or ``flush``.
    """

    tape: Tape
    slots: jax.Array
    steps: jax.Array
    track_slots: jax.Array
    track_steps: jax.Array
    rows: jax.Array
    applied: jax.Array
    parity: bool = dataclasses.field(default=False, metadata=dict(static=True))  # True: this step writes `tape`

    def buffers(self, pool_tape):
        """``(the tape this step writes, the tape of the pending commit)``."""
        return (self.tape, pool_tape) if self.parity else (pool_tape, self.tape)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StatePool:
    """All GDN layers' states and the speculative scratch (see the module docstring).

    A pytree: the arrays are its leaves, the geometry is static.
    """

    ssm: jax.Array
    conv: jax.Array
    tape: Tape
    conv_windows: jax.Array
    geometry: Geometry = dataclasses.field(metadata=dict(static=True))
    deferred: Deferred | None = None
    math: str = dataclasses.field(default="platform", metadata=dict(static=True))

    @property
    def record(self) -> str:
        """The record mode's name (its tape class: ``type(pool.tape)``)."""
        return self.tape.mode

    @property
    def slots(self) -> int:
        """S, the usable slots (the pool has S+1: the last is the padding slot)."""
        return self.ssm.shape[1] - 1

    @property
    def rows(self) -> int:
        """Scratch rows allocated (R+1 for R requests)."""
        return self.tape.num_rows

    @property
    def requests(self) -> int:
        """R, the most requests a step may carry (the last scratch row is the discard row)."""
        return self.rows - 1

    @property
    def drafts(self) -> int:
        """D, the most draft tokens a verify may record."""
        return self.tape.num_steps

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(self))

    @property
    def scratch_nbytes(self) -> int:
        """Bytes of the SSM scratch (the tape) alone."""
        return sum(x.nbytes for x in jax.tree.leaves(self.tape))

    def replace(self, **fields: Any) -> "StatePool":
        """A copy with the given fields replaced, e.g. ``pool.replace(ssm=new_ssm)``."""
        return replace_fields(self, fields)


def allocate(
    geometry: Geometry,
    *,
    slots: int,
    requests: int,
    drafts: int,
    record: str = "tuples",
    state_dtype=jnp.float32,
    conv_dtype=jnp.bfloat16,
    topk: int = 1,
    parents: Any = None,
    defer_commit: bool = False,
    free_bytes: int | None = None,
    math: str = "platform",
) -> StatePool:
    """A zero-filled pool for ``slots`` mamba slots, ``requests`` running requests and D drafts.

    ``defer_commit``: :func:`commit` applies the SSM states with the next :func:`verify_layer`
    (one read of each state per step instead of two; a second scratch tape); call :func:`flush`
    before reading ``ssm`` or writing a slot yourself (:class:`Deferred`).

    Everything is checked before any array is allocated: positive sizes, a GDN geometry whose
    heads divide, a record mode the pool can hold, fp32 or bf16 state, a draft tree that is
    one, and that the pool fits: a :class:`MemoryError` gives the bytes asked and the bytes free.

    Draft trees (``topk``, ``parents``; :mod:`gdn_lossless_jax.tree`): the pool is the same for
    a chain of D drafts and a tree of D nodes (``drafts`` counts nodes: ``[2, 2, 2]`` is 14),
    one tape entry a node (tuples or snapshots) and the chain's conv window buffer (one column
    a node's input), so ``topk`` and ``parents`` are only checked here; the tree of each step
    goes to :func:`verify_layer` and its accepted path to :func:`commit`.

    Args:
      math: the ``math=`` of every verify and commit of the pool's SSM states
        (:func:`gdn_lossless_jax.verify`): ``"portable"`` records tapes with the same bits on
        every platform (the conv before the SSM verify keeps the platform's SiLU).
      free_bytes: the bytes the pool may take; None: what the default device has free
        (:func:`device_free_bytes`; no check where the device does not say).
    """
    fn = "allocate"
    _positive(fn, slots=slots, requests=requests, drafts=drafts)
    checks.check_math(fn, math)
    check_supported(fn, geometry, drafts=drafts, topk=topk, parents=parents)
    if record == "seed_ring":
        raise ValueError(f"{fn}: record must be one of {POOL_RECORD_MODES}, got {record!r} (seed_ring, the pull "
                         "request's layout, is counted by gdn_lossless_jax.memory, not allocated)")  # fmt: skip
    record = record_type(record, fn, geometry.decay)  # a KDA geometry's "tuples": KDATuples
    if jnp.dtype(state_dtype) not in checks.STATE_DTYPES:
        raise TypeError(f"{fn}: state_dtype must be float32 or bfloat16, got {jnp.dtype(state_dtype)}")
    if not jnp.issubdtype(conv_dtype, jnp.floating):
        raise TypeError(f"{fn}: conv_dtype must be a floating-point dtype, got {jnp.dtype(conv_dtype)}")
    rows = scratch_rows(requests)
    specs = state_specs(geometry, slots, state_dtype=state_dtype, conv_dtype=conv_dtype)
    tape_fields = tape_specs(geometry, rows, drafts, record, state_dtype=state_dtype)
    window_spec = conv_window_spec(geometry, rows, drafts, conv_dtype=conv_dtype)
    sizes = {k: v.nbytes for k, v in specs.items()}
    sizes |= {"tape": sum(v.nbytes for v in tape_fields.values()), "conv_windows": window_spec.nbytes}
    if defer_commit:  # the second scratch tape
        sizes["deferred tape"] = sizes["tape"]
    check_fits(fn, sizes, free_bytes)
    zeros = lambda spec: jnp.zeros(spec.shape, spec.dtype)  # noqa: E731
    states = {k: zeros(s) for k, s in specs.items()}
    tape = record(**{k: zeros(s) for k, s in tape_fields.items()})
    windows = zeros(window_spec)
    deferred = None
    if defer_commit:
        off = [jnp.full((rows,), -1, jnp.int32) for _ in range(5)]  # separate buffers: the pool is donated
        deferred = Deferred(jax.tree.map(jnp.zeros_like, tape), *off, jnp.zeros((rows,), bool))
    return StatePool(ssm=states["ssm"], conv=states["conv"], tape=tape, conv_windows=windows, geometry=geometry,
                     deferred=deferred, math=math)  # fmt: skip


def _check_layer(fn: str, pool: StatePool, layer) -> None:
    if not isinstance(pool, StatePool):
        raise TypeError(f"{fn}: argument 'pool' must be a StatePool, got {type(pool).__name__}")
    if isinstance(layer, (int, np.integer)) and not 0 <= layer < pool.geometry.gdn_layers:
        raise ValueError(f"{fn}: argument 'layer' must be in [0, {pool.geometry.gdn_layers}), got {layer}")


@functools.lru_cache(maxsize=1024)
def _device_index(i: int, device) -> jax.Array:
    return jax.device_put(np.int32(i), device)


def _layer_arg(pool: StatePool, layer):
    """``layer`` for a layer call's jit: a Python int becomes an int32 scalar kept on the pool's
    device (one per layer and device, made once). As NumPy it would be a host-to-device copy in
    every call, a large part of ``pool.verify_layer``'s host time."""
    ssm = pool.ssm
    if isinstance(layer, (int, np.integer)) and isinstance(ssm, jax.Array) and not isinstance(ssm, jax.core.Tracer):
        devices = ssm.devices()
        if len(devices) == 1:
            return _device_index(int(layer), next(iter(devices)))
    return as_index(layer)


def _check_arrays(fn: str, pool: StatePool) -> None:
    """Every array must be what :func:`allocate` gives the pool's geometry (scratch rows and D
    from the conv windows). A tape from another geometry (k heads included), record mode or
    pool would replay with the wrong heads, or commit the SSM and conv states under different
    masks (another D or row count), silently."""
    g, cw = pool.geometry, pool.conv_windows
    if len(shape_of(cw)) != 4:
        raise ValueError(f"{fn}: the pool's conv_windows must have rank 4 ([L, R, conv_dim, D+Kc-2]), got {fmt_shape(shape_of(cw))}")
    S, rows, D = pool.slots, cw.shape[1], cw.shape[3] - g.conv_kernel + 2
    want = state_specs(g, S, state_dtype=pool.ssm.dtype, conv_dtype=pool.conv.dtype)
    want |= {f"tape.{k}": v for k, v in tape_specs(g, rows, D, pool.record, state_dtype=pool.ssm.dtype).items()}
    want["conv_windows"] = conv_window_spec(g, rows, D, conv_dtype=pool.conv.dtype)
    for name, spec in want.items():
        x = getattr(pool.tape, name[5:]) if name.startswith("tape.") else getattr(pool, name)
        if shape_of(x) != spec.shape or jnp.dtype(x.dtype) != spec.dtype:
            raise ValueError(
                f"{fn}: the pool's {name} is {jnp.dtype(x.dtype)} {fmt_shape(shape_of(x))}, but a {pool.record} pool of "
                f"{g.name!r} (L={g.gdn_layers}, H={g.num_k_heads}, HV={g.num_v_heads}, K={g.head_k_dim}, "
                f"V={g.head_v_dim}) with {S} slots, {rows} scratch rows and D={D} (from its conv windows) has "
                f"{spec.dtype} {fmt_shape(spec.shape)}: it was recorded for another geometry, record mode or pool"
            )
    if pool.deferred is not None:
        for got, want in zip(jax.tree.leaves(pool.deferred.tape), jax.tree.leaves(pool.tape)):
            if shape_of(got) != shape_of(want) or got.dtype != want.dtype or type(pool.deferred.tape) is not type(pool.tape):
                raise ValueError(f"{fn}: the pool's deferred tape must be shaped like its tape, "
                                 f"got {type(pool.deferred.tape).__name__} {fmt_shape(shape_of(got))}")  # fmt: skip


#: False inside a mesh's per-shard call: a shard's scratch rows are a block of the global rows (the
#: discard row is the last shard's), and the global call was checked before it was split.
CHECK_REQUESTS = contextvars.ContextVar("gdn_lossless_jax_check_requests", default=True)


def _check_requests(fn: str, pool: StatePool, N: int, name: str) -> None:
    """A step of N requests fits the pool's scratch (shapes are static: this costs nothing at run time)."""
    if N > pool.requests and CHECK_REQUESTS.get():
        raise ValueError(
            f"{fn}: argument {name!r} carries N={N} requests, but the pool was allocated for requests={pool.requests} "
            f"(its scratch rows; the last is the discard row): allocate it with requests >= {N}"
        )


def _check_rows(fn: str, rows, N: int):
    if rows is None:
        return np.arange(N, dtype=np.int32)
    check_index(fn, "rows", rows, N)
    return as_index(rows)


def store_layer(pool: StatePool, layer, tape: Tape, windows: jax.Array, rows=None) -> StatePool:
    """Write one layer's tape and conv windows into scratch rows (the pool is donated).

    Args:
      layer: int (or a traced int32 scalar), the GDN layer.
      tape: one layer's tape from :func:`gdn_lossless_jax.verify` (``[N, D', ...]``, D' <= D),
        of the pool's record mode.
      windows: ``[N, conv_dim, D'+Kc-2]`` from :func:`gdn_lossless_jax.conv.causal_conv1d_verify`.
      rows: ``[N]`` int, the scratch row of request i (default i); out-of-range rows are dropped.
    """
    fn = "store_layer"
    _check_layer(fn, pool, layer)
    if type(tape) is not type(pool.tape):
        raise TypeError(f"{fn}: the pool records {pool.record}, got a {type(tape).__name__} tape")
    N, D = tape.num_rows, tape.num_steps
    _check_requests(fn, pool, N, "tape")
    if D > pool.drafts:
        raise ValueError(
            f"{fn}: the tape has D={D} draft steps, but the pool's scratch was sized for at most drafts={pool.drafts}"
        )
    for f in dataclasses.fields(tape):
        got, want = getattr(tape, f.name), getattr(pool.tape, f.name)
        check_shape(fn, f"tape.{f.name}", got, (N, D, *want.shape[3:]), "[N, D, ...]", "from the pool's scratch")
        if got.dtype != want.dtype:
            raise TypeError(f"{fn}: argument 'tape.{f.name}' must be {want.dtype} (the pool's scratch), got {got.dtype}")
    C, Kc = pool.geometry.conv_dim, pool.geometry.conv_kernel
    check_shape(fn, "windows", windows, (N, C, D + Kc - 2), "[N, conv_dim, D+Kc-2]", "N, D from the tape")
    return _store_layer(pool, _layer_arg(pool, layer), tape, windows, _check_rows(fn, rows, N))


def _store_windows(pool: StatePool, layer, rows, windows) -> jax.Array:
    """``conv_windows[layer, rows[n], :, :D+Kc-2] = windows[n]``; out-of-range rows are dropped."""
    r = in_range(rows, pool.rows)
    return pool.conv_windows.at[layer, r, :, : windows.shape[-1]].set(windows.astype(pool.conv_windows.dtype), mode="drop")


def _store(pool: StatePool, layer, tape: Tape, windows, rows) -> StatePool:
    new_tape = reference.write_rows(pool.tape, layer, rows, tape)
    return dataclasses.replace(pool, tape=new_tape, conv_windows=_store_windows(pool, layer, rows, windows))


_store_layer = jax.jit(_store, donate_argnums=0)


def verify_layer(
    pool: StatePool,
    layer,
    mixed_qkv: jax.Array,
    a: jax.Array,
    b: jax.Array,
    conv_weight: jax.Array,
    conv_bias: jax.Array | None,
    A_log: jax.Array,
    dt_bias: jax.Array,
    slots: jax.Array,
    rows: jax.Array | None = None,
    *,
    scale: float | None = None,
    backend: str = "auto",
    parents: Any = None,
    topk: int = 1,
    checked: bool = False,
    beta_scale: float | None = None,
) -> tuple[jax.Array, StatePool]:
    """Verify D draft tokens through one GDN (or KDA) layer, from the pool; record into scratch rows.

    The conv runs over the slot's conv state (:func:`gdn_lossless_jax.conv.verify_from_pool`),
    its output is split into ``[q | k | v]``, and :func:`gdn_lossless_jax.verify` runs from
    the slot's SSM state in the pool's record mode, each read by slot inside the kernels. The
    tape and the conv windows go to ``rows`` in place; the states in the pool are not modified
    (commit writes them), except that a pool allocated with ``defer_commit=True`` first applies
    the previous step's SSM commit of this layer (:class:`Deferred`). The pool is donated.

    Args:
      pool: the :class:`StatePool`.
      layer: int (or a traced int32 scalar), the GDN layer.
      mixed_qkv: ``[N, D, conv_dim]``, the layer's pre-conv ``[q | k | v]`` projections
        (``conv_dim = 2*H*K + HV*V``), D <= the pool's ``drafts``.
      a, b: ``[N, D, HV]``. conv_weight ``[conv_dim, Kc]``, conv_bias ``[conv_dim]`` or None,
        A_log and dt_bias ``[HV]``: the layer's parameters. A KDA geometry's layers (one decay
        per key channel, :mod:`gdn_lossless_jax.kda`) take ``a [N, D, HV, K]`` (the forget
        gate's projection before its bias) and ``dt_bias [HV, K]``. Any of these arrays and
        ``mixed_qkv`` may instead be stacked over all the pool's layers (a leading axis of
        ``gdn_layers``): the kernels read layer ``layer`` of it in place, so a ``lax.scan`` over
        the layers that passes the stacks and its counter slices nothing.
      slots: ``[N]`` int, each request's mamba slot; a slot outside ``[0, S]`` (padding)
        reads zero states, as in SGLang, and is skipped by commit.
      rows: ``[N]`` int or None, each request's scratch row (default i).
      scale, backend, parents, topk, checked, beta_scale: as in :func:`gdn_lossless_jax.verify`
        (``beta_scale``: OLMo-Hybrid's 2.0; the decay form is the geometry's, :attr:`Geometry.decay`). With a
        draft tree (``parents``) each node's conv window is along its root path
        (:func:`gdn_lossless_jax.conv.tree_columns`) and the tape holds one entry a node;
        commit it with :func:`commit`'s ``path``. Trees verify on ``"reference"`` and ``"pallas"``.
    Returns:
      ``(outputs [N, D, HV, V] in mixed_qkv's dtype, the new pool)``.
    """
    fn = "verify_layer"
    _check_layer(fn, pool, layer)
    g = pool.geometry
    L = g.gdn_layers
    for name, x, rank in (("mixed_qkv", mixed_qkv, 3), ("conv_weight", conv_weight, 2), ("conv_bias", conv_bias, 1)):
        if x is not None and len(shape_of(x)) == rank + 1 and shape_of(x)[0] != L:
            raise ValueError(f"{fn}: argument {name!r} is stacked over layers (rank {rank + 1}), so its leading axis "
                             f"must be the pool's gdn_layers={L}, got shape {list(shape_of(x))}")  # fmt: skip
    one = mixed_qkv if len(shape_of(mixed_qkv)) != 4 else jax.ShapeDtypeStruct(shape_of(mixed_qkv)[1:], mixed_qkv.dtype)
    check_rank(fn, "mixed_qkv", one, 3, "[N, D, conv_dim] or [L, N, D, conv_dim]")
    N, D, _ = shape_of(one)
    _check_requests(fn, pool, N, "mixed_qkv")
    if D > pool.drafts:
        raise ValueError(
            f"{fn}: argument 'mixed_qkv' has D={D} draft steps, but the pool's scratch was sized for "
            f"at most drafts={pool.drafts}"
        )
    check_shape(fn, "mixed_qkv", one, (N, D, g.conv_dim), "[N, D, conv_dim]", f"conv_dim = 2*H*K + HV*V of {g.name}")
    parents = checks.check_tree(fn, parents, topk, N, D)
    if parents is not None:
        api.check_tree_backend(fn, backend, pool.math)
        if checked:
            tree.checkify_parents(fn, parents, topk)
    check_index(fn, "slots", slots, N)
    rows = _check_rows(fn, rows, N)
    checks.check_float(fn, "mixed_qkv", mixed_qkv)
    C, Kc = g.conv_dim, g.conv_kernel
    for name, x, want, dims in (("conv_weight", conv_weight, (C, Kc), "[conv_dim, Kc]"),
                                ("conv_bias", conv_bias, (C,), "[conv_dim]")):  # fmt: skip
        if x is not None:
            x = checks.as_array(fn, name, x)
            full = (L, *want) if len(shape_of(x)) == len(want) + 1 else want
            check_shape(fn, name, x, full, dims if full == want else f"[L, {dims[1:]}", f"conv_dim, Kc of {g.name}")
            checks.check_float(fn, name, x)
    HV, K = g.num_v_heads, g.head_k_dim
    a_want, dt_want = ((N, D, HV, K), (HV, K)) if g.decay == "channel" else ((N, D, HV), (HV,))
    for name, x, want, dims in (("a", a, a_want, f"[N, D, HV{', K' * (g.decay == 'channel')}]"),
                                ("b", b, (N, D, HV), "[N, D, HV]"), ("A_log", A_log, (HV,), "[HV]"),
                                ("dt_bias", dt_bias, dt_want, f"[HV{', K' * (g.decay == 'channel')}]")):  # fmt: skip
        x = checks.as_array(fn, name, x)
        full = (L, *want) if len(shape_of(x)) == len(want) + 1 else want
        check_shape(fn, name, x, full, dims if full == want else f"[L, {dims[1:]}", f"from mixed_qkv and {g.name}")
        checks.check_float(fn, name, x)
    scale = checks.as_scale(fn, scale, g.head_k_dim)
    beta_scale = checks.as_beta_scale(fn, beta_scale)
    return _verify_layer(
        pool, _layer_arg(pool, layer), mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias,
        as_index(slots), rows, parents, scale=scale, backend=backend, beta_scale=beta_scale,
    )  # fmt: skip


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("scale", "backend", "beta_scale"))
@unstaged  # verify_layer staged its index arguments where its caller traces
def _verify_layer(pool, layer, mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, slots, rows, parents=None, *,
                  scale, backend, beta_scale=1.0):  # fmt: skip
    # The kernels read each request's conv and SSM states from the pool by slot and write the
    # windows and the tape into the scratch rows in place (verify_from_pool, verify's slots=/
    # tape= form): no gathered states, no copies of the tape or of [q | k | v] slices.
    g = pool.geometry
    N, D, _ = mixed_qkv.shape[-3:]
    HK = g.num_k_heads * g.head_k_dim
    sizes = {"H": g.num_k_heads, "HV": g.num_v_heads, "K": g.head_k_dim, "V": g.head_v_dim}
    needs = backends.call_needs(g.decay, beta_scale, sizes)
    impl = backends.resolve(backend, "verify", pool.math, needs)  # resolved once: the conv's kernels and the verify's
    (q, k, v), windows = verify_from_pool(
        pool.conv, layer, slots, mixed_qkv, conv_weight, conv_bias, windows=pool.conv_windows, rows=rows,
        splits=(HK, HK, g.num_v_heads * g.head_v_dim), backend=impl, parents=parents,
    )  # fmt: skip
    q = q.reshape(N, D, g.num_k_heads, g.head_k_dim)
    k = k.reshape(N, D, g.num_k_heads, g.head_k_dim)
    v = v.reshape(N, D, g.num_v_heads, g.head_v_dim)
    d = pool.deferred
    # verify_layer checked every argument: the backend's call directly (api.verify would check again)
    call = VerifyCall(pool.ssm, slots, layer, q, k, v, a, b, A_log, dt_bias, rows=rows, tape_layer=layer, scale=scale,
                      record=type(pool.tape), out_dtype=jnp.dtype(q.dtype), parents=parents, math=pool.math,
                      decay=g.decay, beta_scale=beta_scale)  # fmt: skip
    if d is None:
        outputs, tape = api.run_verify(call.replace(tape=pool.tape), impl)
        return outputs, dataclasses.replace(pool, tape=tape, conv_windows=windows)
    # The previous step's commit of each request's slot, applied inside this layer's verify.
    # (Every layer of the step applies its own layer's part: `applied` only tells the next flush.)
    match = (slots[:, None] == d.slots[None, :]) & (d.slots[None, :] >= 0)  # [N, P]
    has, j = match.any(1), jnp.argmax(match, axis=1)
    pick = lambda x: jnp.where(has, x[j], -1)  # noqa: E731
    current, pending_tape = d.buffers(pool.tape)
    pending = Pending(pending_tape, pick(d.rows), pick(d.steps), pick(d.track_slots), pick(d.track_steps), layer=layer)
    outputs, tape, ssm = api.run_verify(call.replace(tape=current, pending=pending), impl)
    d = dataclasses.replace(d, applied=d.applied | match.any(0))
    if d.parity:
        return outputs, dataclasses.replace(pool, ssm=ssm, conv_windows=windows, deferred=dataclasses.replace(d, tape=tape))
    return outputs, dataclasses.replace(pool, ssm=ssm, tape=tape, conv_windows=windows, deferred=d)


def commit(
    pool: StatePool,
    slots: jax.Array,
    steps: jax.Array,
    track_slots: jax.Array | None = None,
    track_steps: jax.Array | None = None,
    rows: jax.Array | None = None,
    *,
    path: jax.Array | None = None,
    parents: Any = None,
    backend: str = "auto",
    checked: bool = False,
) -> StatePool:
    """Commit every layer: accepted (and track) SSM states and conv windows (the pool is donated).

    Arguments and skipping rules as in :func:`gdn_lossless_jax.commit` (``[N]`` int each;
    ``steps`` are 0-based, not accepted lengths); the SSM part is that function on
    ``pool.ssm`` and ``pool.tape``, the conv part :func:`gdn_lossless_jax.conv.conv_commit`
    on ``pool.conv`` and ``pool.conv_windows``. Returns the new pool; the scratch is left
    as it was. A pool whose arrays are not those :func:`allocate` gives its geometry (a tape
    from another geometry, record mode or pool) is rejected before anything is donated.

    ``checked=True`` raises instead of skipping (:mod:`gdn_lossless_jax.checked`), before
    the pool is donated, so the pool is still usable after the error. The bounds are the
    allocated ones: slots ``[0, S+1)`` and rows ``[0, R+1)`` (the padding slot and row
    count), so padding requests that share the padding slot fail as duplicate slots.

    ``path``, ``parents``: a draft tree's accepted paths (``[N, P]``, ``P <= drafts``; steps are
    positions along them) and, optionally, its parents to check them against, as in
    :func:`gdn_lossless_jax.commit` (concrete values checked at call time, traced ones with
    ``checked=True``, before the pool is donated); the conv windows are gathered along the path
    (:func:`gdn_lossless_jax.conv.conv_commit`). With ``defer_commit=True`` a tuple pool first
    reorders each committed row of this step's scratch tape along its path (its first P entries
    become the path's), so that the next verify's fused commit replays a chain.
    """
    if not isinstance(pool, StatePool):
        raise TypeError(f"commit: argument 'pool' must be a StatePool, got {type(pool).__name__}")
    _check_arrays("commit", pool)
    N = int(np.shape(slots)[0]) if np.ndim(slots) == 1 else 0
    _check_requests("commit", pool, N, "slots")
    raw = (path, steps, track_steps, parents)
    if path is not None:
        path = checks.check_path("pool.commit", path, N)
        if path.shape[1] > pool.drafts:
            raise ValueError(f"pool.commit: argument 'path' has P={path.shape[1]} entries a request, more than the "
                             f"pool's drafts={pool.drafts} (its tape's nodes)")  # fmt: skip
        parents = checks.check_commit_parents("pool.commit", parents, N, pool.drafts)
    elif parents is not None:
        raise ValueError("pool.commit: parents= checks a tree's accepted paths: pass path= too")
    if checked or path is not None:
        ints = checks.commit_index_args("pool.commit", slots, steps, track_slots, track_steps, rows)
        if path is not None:  # concrete values now, traced ones with checked (as gl.commit's)
            checks.check_path_indices("pool.commit", pool.drafts, path, ints[1], ints[3], parents, checked=checked,
                                      raw=raw)  # fmt: skip
        if checked:
            D = pool.drafts if path is None else path.shape[1]
            checked_mode.check_commit("pool.commit", pool.ssm.shape[1], pool.rows, D, *ints)
    # Defaults (None) are filled, and every argument checked, by the two commits it calls; the
    # index arrays are staged here, where the caller traces (staging.as_index).
    ix = [as_index(x) if isinstance(x, jax.Array) and x.dtype == jnp.int32 else x
          for x in (slots, steps, track_slots, track_steps, rows)]  # fmt: skip
    return _commit(pool, *ix, path, backend=backend)


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("backend",))
@unstaged  # commit staged its index arguments where its caller traces
def _commit(pool, slots, steps, track_slots, track_steps, rows, path=None, *, backend):
    conv = conv_commit(pool.conv, pool.conv_windows, slots, steps, track_slots, track_steps, rows, backend=backend,
                       path=path)  # fmt: skip
    if pool.deferred is None:
        ssm = api.commit(pool.ssm, pool.tape, slots, steps, track_slots, track_steps, rows, path=path, backend=backend,
                         math=pool.math)
        return dataclasses.replace(pool, ssm=ssm, conv=conv)
    # The previous step's entries no verify of this step applied (requests that left) go in now;
    # this step's SSM commit waits for the next verify, which writes the other scratch tape.
    pool = _flush(pool, backend)
    if path is not None:  # the tree's commit as the chain commit it is, in the tape this step wrote
        pool, steps, track_steps = _along_path(pool, rows, path, steps, track_steps)
    P, N = pool.rows, slots.shape[0]  # (N <= the pool's requests: checked by commit)
    pad = lambda x: jnp.full((P,), -1, jnp.int32).at[:N].set(jnp.asarray(x, jnp.int32))  # noqa: E731
    if track_slots is None:
        track_slots = track_steps = np.full((N,), -1, np.int32)
    if rows is None:
        rows = np.arange(N, dtype=np.int32)
    d = Deferred(pool.deferred.tape, pad(slots), pad(steps), pad(track_slots), pad(track_steps), pad(rows),
                 jnp.zeros((P,), bool), parity=not pool.deferred.parity)  # fmt: skip
    return dataclasses.replace(pool, conv=conv, deferred=d)


def _along_path(pool: StatePool, rows, path, steps, track_steps):
    """A deferred tree commit made a chain's (the record mode's ``along_path``): snapshots map each
    position to its node; tuples write each row's path entries to its first P steps (in this step's
    tape, in place). Returns
    ``(pool, steps, track_steps)``."""
    N = path.shape[0]
    if rows is None:
        rows = np.arange(N, dtype=np.int32)
    if track_steps is None:
        track_steps = np.full((N,), -1, np.int32)
    d = pool.deferred
    written = d.tape if d.parity else pool.tape  # the tape this step's verify wrote
    new, _, steps, track_steps = reference.along_path(written, jnp.asarray(rows, jnp.int32), path, steps, track_steps)
    if new is not written:  # the mode gathered the path's steps (tuples): into this step's tape, in place
        r, P = in_range(jnp.asarray(rows, jnp.int32), written.num_rows), path.shape[1]
        written = jax.tree.map(lambda t, x: t.at[:, r, :P].set(x, mode="drop"), written, new)
        pool = (dataclasses.replace(pool, deferred=dataclasses.replace(d, tape=written)) if d.parity
                else dataclasses.replace(pool, tape=written))  # fmt: skip
    return pool, steps, track_steps


def _flush(pool: StatePool, backend: str) -> StatePool:
    """Apply the deferred entries not yet applied. Afterwards nothing is pending: every entry's
    steps become -1 (not only marked applied), so that a later verify, which applies the pending
    entries of the slots it reads whatever their mark (every layer of a step applies its own
    part), does not apply them a second time."""
    d = pool.deferred
    off = lambda x: jnp.where(d.applied, -1, x)  # noqa: E731
    _, tape = d.buffers(pool.tape)
    ssm = api.commit(pool.ssm, tape, d.slots, off(d.steps), d.track_slots, off(d.track_steps), d.rows, backend=backend,
                     math=pool.math)
    none = jnp.full_like(d.steps, -1)
    done = dataclasses.replace(d, steps=none, track_steps=none, applied=jnp.ones_like(d.applied))
    return dataclasses.replace(pool, ssm=ssm, deferred=done)


def flush(pool: StatePool, *, backend: str = "auto") -> StatePool:
    """Apply a deferred commit (:class:`Deferred`) now: after it, ``pool.ssm`` holds every
    committed state. A pool that does not defer its commit is returned as it is. Call it after
    the last step, and before reading ``ssm`` or writing a slot outside this module."""
    if not isinstance(pool, StatePool):
        raise TypeError(f"flush: argument 'pool' must be a StatePool, got {type(pool).__name__}")
    return pool if pool.deferred is None else _flush_jit(pool, backend=backend)


_flush_jit = jax.jit(_flush, donate_argnums=0, static_argnames=("backend",))
