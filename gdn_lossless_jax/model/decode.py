"""Greedy speculative decoding in one jitted step, through the library's state pool.

One call of :class:`SpecStep` does, for N batch rows at once:

1. **draft**: a layer-skipping self-draft (the target's first ``draft_layers`` blocks, all
   GDN, then the final norm and LM head) proposes the chain. It starts from the committed
   states of those layers in the pool and carries its own copy through the chain (the
   reference's GDN step in plain fp32: a draft's rounding cannot change what is accepted);
   nothing of it is written back. Because the draft's blocks *are* the target's, the
   target's commit keeps the draft in step: no draft state to manage.
2. **verify**: the target runs the D inputs ``x_0 .. x_{D-1}`` through every block; each
   GDN layer goes through :func:`gdn_lossless_jax.pool.verify_layer` (the pool's record
   mode: tuples or snapshots), each attention layer writes its keys and values into the KV
   cache at the tokens' positions.
3. **accept**: ``x_0 .. x_{n_given-1}`` are given (the request's next known tokens: one
   for plain decoding, up to D for a prompt chunk) and always accepted; a drafted ``x_j``
   is accepted while it equals the target's greedy prediction after ``x_{j-1}``. With
   ``m`` inputs accepted, the target's prediction after ``x_{m-1}`` is the bonus token.
4. **commit**: :func:`gdn_lossless_jax.pool.commit` writes the SSM and conv states after
   step ``m - 1``; when the request's length crosses a multiple of ``track_interval``, the
   state at that boundary goes to the request's track slot in the same commit (the
   prefix cache), and its KV cache row is copied there too. KV entries past the accepted
   length need no undo: attention masks by position and the next step overwrites them.

So prefill (chunks of given tokens), plain greedy decoding (D = 1) and speculative decoding
are one function with one arithmetic. Indices follow the pool's rules: row i of the batch
uses mamba slot ``slots[i]`` and scratch row ``rows[i]``; a negative slot marks an empty
batch row (its reads are zeros, its writes are dropped, commit skips it).

Record-mode note: the record mode is part of the pool's pytree structure, so the two modes
are two compilations of the same step; their outputs are identical by the library's
construction (verify's outputs do not depend on the mode), which the tests check token by
token and pool by pool.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .. import api, backends, pool as pool_mod, reference, sharding
from ..pool import StatePool
from .model import ModelConfig, Params, attention, gdn_mixer, logits, mlp, rmsnorm, rows_mesh, softmax

__all__ = [
    "KVCache",
    "DecodeState",
    "StepInputs",
    "StepOutputs",
    "CommitFn",
    "accept",
    "row_keys",
    "allocate_state",
    "copy_slot",
    "SpecStep",
    "place_on_mesh",
    "pool_from_mesh",
    "decode_steps",
]

I32 = jnp.int32
F32 = jnp.float32

#: ``commit(pool, slots, steps, track_slots, track_steps, rows) -> pool``: the commit the
#: step uses (``gdn_lossless_jax.pool.commit`` by default; tests inject controls here).
CommitFn = Callable[..., StatePool]


def _pytree(cls):
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


@_pytree
class KVCache:
    """The full-attention layers' cache, by mamba slot: ``k``, ``v [A, S+1, Tmax, nkv, hd]``."""

    k: jax.Array
    v: jax.Array


@_pytree
class DecodeState:
    """Everything a step reads and writes: the GDN state pool and the KV cache (donated)."""

    pool: StatePool
    kv: KVCache

    @property
    def record(self) -> str:
        return self.pool.record


@_pytree
class StepInputs:
    """One step's batch, N rows (every field ``[N]`` int32 unless noted).

    Attributes:
      slots: the request's mamba slot (its states and KV row); negative: an empty row.
      rows: the request's scratch row in ``[0, R]`` (R: the discard row for empty rows).
      pos: tokens already in the request's state (the position of ``tokens[:, 0]``).
      tokens: ``[N, D]``, the given inputs in ``tokens[:, :n_given]`` (the rest is ignored).
      n_given: given inputs, in ``[1, D]``.
      track_slots: the slot the prefix-cache state goes to if this step crosses a multiple
        of the track interval; negative: no tracking.
      key: ``[N]`` ``jax.random`` keys for a sampling step (``SpecStep(temperature > 0)``), one
        per row (:func:`row_keys`: a request's draws then depend on the request and its position
        only, not on its batch row, the step or K); None when greedy.
    """

    slots: jax.Array
    rows: jax.Array
    pos: jax.Array
    tokens: jax.Array
    n_given: jax.Array
    track_slots: jax.Array
    key: jax.Array | None = None


@_pytree
class StepOutputs:
    """What a step decided (``[N]`` or ``[N, D]`` int32; ``gaps`` fp32).

    Attributes:
      inputs: ``[N, D]``, the verified inputs (given, then drafted).
      predictions: ``[N, D]``, the target's token after each input: greedy, or when sampling
        the token emitted if decoding stops after that input (see :func:`accept`).
      gaps: ``[N, D]``, the target's top-2 logit gap at each input (near-ties show here).
      accepted: ``m`` in ``[n_given, D]``, inputs accepted (now in the state).
      track_steps: the step whose state went to the track slot, or -1.
    """

    inputs: jax.Array
    predictions: jax.Array
    gaps: jax.Array
    accepted: jax.Array
    track_steps: jax.Array


def allocate_state(
    config: ModelConfig,
    *,
    slots: int,
    requests: int,
    drafts: int,
    record: str,
    max_len: int,
    state_dtype=jnp.float32,
    defer_commit: bool = False,
) -> DecodeState:
    """A zero state: the pool (:func:`gdn_lossless_jax.pool.allocate`) and the KV cache.

    Args:
      slots: S mamba slots (each holds one request's or one prefix-cache entry's states and
        KV row). requests: R batch rows. drafts: D, the inputs a step verifies.
      record: ``"tuples"`` or ``"snapshots"``. max_len: Tmax, KV positions per slot.
      state_dtype: the SSM state dtype (float32 or bfloat16); the conv states and the KV
        cache take the model's dtype.
      defer_commit: the pool applies each commit's SSM part in the next verify
        (:func:`gdn_lossless_jax.pool.allocate`).
    """
    if not isinstance(max_len, int) or max_len < drafts:
        raise ValueError(f"allocate_state: argument 'max_len' must be an integer >= drafts={drafts}, got {max_len!r}")
    p = pool_mod.allocate(
        config.geometry, slots=slots, requests=requests, drafts=drafts, record=record,
        state_dtype=state_dtype, conv_dtype=config.jnp_dtype, defer_commit=defer_commit,
    )  # fmt: skip
    shape = (config.attention_layers, slots + 1, max_len, config.kv_heads, config.attn_head_dim)
    return DecodeState(p, KVCache(jnp.zeros(shape, config.jnp_dtype), jnp.zeros(shape, config.jnp_dtype)))


@functools.partial(jax.jit, donate_argnums=0)
def _copy_slot(state: DecodeState, src, dst) -> DecodeState:
    def move(x):  # an out-of-range src reads zeros
        return x.at[:, dst].set(x.at[:, src].get(mode="fill", fill_value=0))

    p = state.pool
    pool = dataclasses.replace(p, ssm=move(p.ssm), conv=move(p.conv))
    return DecodeState(pool, KVCache(move(state.kv.k), move(state.kv.v)))


def copy_slot(state: DecodeState, src: int | None, dst: int) -> DecodeState:
    """Copy slot ``src``'s SSM, conv and KV states to slot ``dst``, or zero ``dst`` if
    ``src`` is None (the state is donated).

    How a request starts: from a prefix-cache entry (without consuming it) or from zeros
    (a freed slot still holds its last request's states).
    """
    S = state.pool.slots
    for name, s in (("src", src), ("dst", dst)):
        if s is not None and not 0 <= s < S:
            raise ValueError(f"copy_slot: argument {name!r} must be a slot in [0, {S}), got {s}")
    return _copy_slot(state, jnp.asarray(-1 if src is None else src, I32), jnp.asarray(dst, I32))


def place_on_mesh(plan: sharding.MeshPlan, config: ModelConfig, params: Params, state: DecodeState,
                  inputs: StepInputs | None = None):  # fmt: skip
    """Parameters, state (and a step's inputs) laid out for ``SpecStep(..., mesh=plan)``.

    The GDN conv channels go to the tensor-parallel order (:func:`gdn_lossless_jax.sharding.to_tp_layout`:
    the ``[q | k | v]`` columns of ``w_qkv``, the rows of ``conv_weight``, the pool's conv states and
    windows); the pool is split as :meth:`~gdn_lossless_jax.sharding.MeshPlan.put` does (heads over
    the tensor axis, slots and rows over the data axis), the KV cache's slots and the inputs' rows
    over the data axis, the parameters replicated. A request's slot, track slot and scratch row
    must live on its row's data shard (see :mod:`gdn_lossless_jax.sharding`).

    Returns:
      ``(params, state)``, or ``(params, state, inputs)`` when ``inputs`` is given.
    """
    g, tp = config.geometry, plan.tp
    blocks = tuple(
        dataclasses.replace(blk, mixer=dataclasses.replace(
            blk.mixer, w_qkv=sharding.to_tp_layout(blk.mixer.w_qkv, g, tp, -1),
            conv_weight=sharding.to_tp_layout(blk.mixer.conv_weight, g, tp, 0)))
        if kind == "gdn" else blk
        for blk, kind in zip(params.blocks, config.kinds)
    )  # fmt: skip
    replicated = jax.sharding.NamedSharding(plan.mesh, jax.sharding.PartitionSpec())
    params = jax.device_put(dataclasses.replace(params, blocks=blocks), replicated)
    p = state.pool
    p = dataclasses.replace(p, conv=sharding.to_tp_layout(p.conv, g, tp, -2),
                            conv_windows=sharding.to_tp_layout(p.conv_windows, g, tp, -2))  # fmt: skip
    rows = jax.sharding.NamedSharding(plan.mesh, jax.sharding.PartitionSpec(None, plan.data))
    state = DecodeState(plan.put(p, "pool"), jax.device_put(state.kv, rows))
    if inputs is None:
        return params, state
    by_row = jax.sharding.NamedSharding(plan.mesh, jax.sharding.PartitionSpec(plan.data))
    return params, state, jax.device_put(inputs, by_row)


def pool_from_mesh(pool, geometry, tp: int):
    """A pool laid out by :func:`place_on_mesh`, on the host with its conv states and windows
    back in the usual ``[q | k | v]`` channel order: what one device holds after the same steps."""
    host = jax.device_get(pool)
    return dataclasses.replace(host, conv=sharding.from_tp_layout(host.conv, geometry, tp, -2),
                               conv_windows=sharding.from_tp_layout(host.conv_windows, geometry, tp, -2))  # fmt: skip


_in_range = reference.in_range  # indices outside [0, n) become n: dropped by scatters, filled by gathers


def split_qkv(y: jax.Array, config: ModelConfig):
    """``[N, T, conv_dim] -> q, k [N, T, H, K], v [N, T, HV, V]`` (the conv's ``[q | k | v]``)."""
    c = config
    N, T, _ = y.shape
    HK = c.num_k_heads * c.head_k_dim
    q = y[..., :HK].reshape(N, T, c.num_k_heads, c.head_k_dim)
    k = y[..., HK : 2 * HK].reshape(N, T, c.num_k_heads, c.head_k_dim)
    v = y[..., 2 * HK :].reshape(N, T, c.num_v_heads, c.head_v_dim)
    return q, k, v


def _draft_gdn(c: ModelConfig, S, conv_state, mixed, a, b, p, mesh=None, kernel=None):
    """One token through a GDN layer from a carried state, for the draft.

    Plain fp32 arithmetic (the reference's step with unpinned ``*`` and ``+``, an unpinned
    conv): the draft only proposes, the target's verify decides, so its rounding form does not
    matter, and it keeps the draft cheap to compile. But its proposals decide which tokens are
    verified, so its sums are in a fixed order, as everywhere in the model: the conv's taps and
    the K sums by :func:`gdn_lossless_jax.reference.ksum`. ``kernel``: a backend (a name or
    object other than the reference) that runs the recurrence instead, as a one-token
    :func:`gdn_lossless_jax.verify` recording its snapshot (the state after the token): one pass
    over the state, where XLA's plain step makes several (docs/design.md, the decode loop).
    Returns ``(o [N, 1, HV, V], S' [N, HV, V, K] fp32, conv state [N, conv_dim, Kc-1])``.
    """
    x = mixed[:, 0].astype(conv_state.dtype)[..., None]  # [N, C, 1]
    window = jnp.concatenate([conv_state, x], axis=-1)  # [N, C, Kc]
    y = jax.nn.silu(reference.ksum(window.astype(F32) * p.conv_weight.astype(F32)))
    if mesh is not None:  # the conv channels are in the mesh's tensor-parallel order
        y = sharding.from_tp_layout(y, c.geometry, mesh.tp)
    q, k, v = split_qkv(y[:, None], c)
    if kernel is not None:
        o, snapshots = api.verify(S.astype(F32), q, k, v, a, b, p.A_log, p.dt_bias, record="snapshots",
                                  scale=c.head_k_dim**-0.5, backend=kernel)  # fmt: skip
        return o.astype(mixed.dtype), snapshots.states[:, 0], window[..., 1:]
    qn, kn, g, beta = reference.prepare(q, k, a, b, p.A_log, p.dt_bias, c.head_k_dim**-0.5)
    heads = lambda t: reference._expand_heads(t[:, 0], c.num_v_heads)  # noqa: E731
    step_in = (heads(qn), heads(kn), v[:, 0].astype(F32), g[:, 0], beta[:, 0])
    S_new, (o, _) = reference.gdn_step(S.astype(F32), step_in, mul=jnp.multiply, fma=lambda k, u, s: k * u + s)
    return o[:, None].astype(mixed.dtype), S_new, window[..., 1:]


def accept(logits_: jax.Array, x: jax.Array, n_given: jax.Array, *, temperature: float = 0.0, key=None):
    """Which inputs a step accepts, and the token each input predicts.

    Inputs ``x[:, :n_given]`` are given and always accepted; a drafted ``x[:, j]`` (``j >=
    n_given``) is accepted while every input before it was.

    - Greedy (``temperature == 0``): ``x[:, j]`` is accepted when it equals the target's argmax
      after ``x[:, j-1]``; ``predictions`` are the argmaxes.
    - Sampling (``temperature > 0``), lossless speculative sampling for a draft that proposes
      one token (a one-hot proposal): ``x[:, j]`` is accepted with probability ``p_{j-1}(x_j)``,
      the target's probability of it at ``temperature`` after ``x[:, j-1]``; at the first
      rejection the emitted token is drawn from ``p_{j-1}`` with ``x_j`` removed
      (renormalised), and when every input is accepted from ``p_{D-1}``. So each emitted token
      has exactly the target's distribution, whatever the draft proposed. ``predictions[:, j]``
      is the token emitted if decoding stops after input j: a draw from ``p_j`` without
      ``x_{j+1}`` (``j < D-1``), or from ``p_{D-1}``. The draws depend on ``key`` only, not on
      the record mode: both modes give the same tokens.

    Args:
      logits_: ``[N, D, vocab]`` fp32, the target's logits after each input.
      x: ``[N, D]`` int32, the inputs. n_given: ``[N]`` int32 in ``[1, D]``.
      key: ``[N]`` keys when sampling (:func:`row_keys`).
    Returns:
      ``(predictions [N, D] int32, gaps [N, D] fp32 (top-2 logit gap), m [N] int32 (inputs
      accepted, in [n_given, D]))``.
    """
    N, D, V = logits_.shape
    top2 = jax.lax.top_k(logits_, 2)[0]
    gaps = top2[..., 0] - top2[..., 1]
    given = jnp.arange(1, D)[None, :] < n_given[:, None]  # [N, D-1]
    if not temperature:
        y = jnp.argmax(logits_, axis=-1).astype(I32)
        ok = given | (x[:, 1:] == y[:, :-1])
    else:
        keys = jax.vmap(jax.random.split)(key)  # [N, 2]: acceptance, draws
        scaled = logits_ / jnp.float32(temperature)
        p = softmax(scaled)
        p_draft = jnp.take_along_axis(p[:, :-1], x[:, 1:, None], axis=-1)[..., 0]  # p_{j-1}(x_j)
        u = jax.vmap(lambda k: jax.random.uniform(k, (D - 1,), F32))(keys[:, 0])
        ok = given | (u < p_draft)
        removed = jnp.concatenate([x[:, 1:], jnp.full((N, 1), -1, I32)], axis=1)  # x_{j+1}; none after the last
        residual = jnp.where(jnp.arange(V, dtype=I32) == removed[..., None], -jnp.inf, scaled)
        y = jax.vmap(lambda k, r: jax.random.categorical(k, r, axis=-1))(keys[:, 1], residual).astype(I32)
    m = 1 + jnp.sum(jnp.cumprod(ok.astype(I32), axis=1), axis=1).astype(I32)
    return y, gaps, m


def row_keys(key: jax.Array, ids: jax.Array, pos: jax.Array) -> jax.Array:
    """``[N]`` sampling keys: ``fold_in(fold_in(key, ids[i]), pos[i])`` for a request id and the
    row's position (tokens in its state): each request draws fresh numbers at every step, the
    same whatever its batch row, the other requests or the steps per call."""
    return jax.vmap(lambda i, p: jax.random.fold_in(jax.random.fold_in(key, i), p))(ids, pos)


@dataclasses.dataclass(frozen=True)
class SpecStep:
    """The jitted step ``step(params, state, inputs) -> (state, outputs)``; the state is donated.

    A frozen (hashable) description: equal steps share one compilation cache, so engines
    with the same step compile once per record mode and batch shape.

    Attributes:
      config: the model's sizes.
      drafts: D, inputs verified per step (one given, D - 1 drafted when decoding; D = 1 is
        plain greedy decoding with the target alone).
      track_interval: prefix-cache interval in tokens (0: no tracking).
      backend: the library's backend for verify and the default commit.
      commit: the commit to use (:data:`CommitFn`, hashable); ``gdn_lossless_jax.pool.commit``
        if None.
      mesh: a :class:`gdn_lossless_jax.sharding.MeshPlan`, or None (one device). On a mesh the
        GDN layers' verify and commit run per shard (``MeshPlan.verify_layer`` and
        ``pool_commit``: heads over the tensor axis, rows over the data axis), the parameters
        and state come from :func:`place_on_mesh`, and every other activation is split over
        the data axis only (the same arithmetic as on one device: the tokens and states are
        identical).
      temperature: 0 (greedy: a draft is accepted when it equals the target's argmax), or the
        temperature of speculative sampling (:func:`accept`; the step then needs
        ``inputs.key``).
    """

    config: ModelConfig
    drafts: int
    track_interval: int = 0
    backend: str = "auto"
    commit: CommitFn | None = None
    mesh: sharding.MeshPlan | None = None
    temperature: float = 0.0

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise ValueError(f"SpecStep: argument 'temperature' must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.drafts, int) or self.drafts < 1:
            raise ValueError(f"SpecStep: argument 'drafts' must be a positive integer, got {self.drafts!r}")
        if not isinstance(self.track_interval, int) or self.track_interval < 0:
            raise ValueError(
                f"SpecStep: argument 'track_interval' must be an integer >= 0, got {self.track_interval!r}"
            )

    @property
    def traces(self) -> int:
        """How often JAX traced this step (once per record mode and batch shape in a decode
        loop: more means the loop retraces)."""
        return _TRACES[self]

    def __call__(self, params: Params, state: DecodeState, inputs: StepInputs) -> tuple[DecodeState, StepOutputs]:
        D = self.drafts
        if inputs.tokens.shape[-1] != D:
            raise ValueError(
                f"SpecStep: argument 'inputs.tokens' must have D={D} columns, got shape {inputs.tokens.shape}"
            )
        if state.pool.drafts < D:
            raise ValueError(
                f"SpecStep: the pool's scratch holds drafts={state.pool.drafts} steps, the step verifies D={D}"
            )
        return _jitted_step(self, params, state, inputs)

    def _commit(self, pool, *args):
        if self.commit is not None:
            return self.commit(pool, *args)
        if self.mesh is not None:
            return self.mesh.pool_commit(pool, *args, backend=self.backend)
        return pool_mod.commit(pool, *args, backend=self.backend)

    def _verify_layer(self, pool, layer, mixed, a, b, p, inputs: StepInputs):
        if self.mesh is None:
            args = (pool, layer, mixed, a, b, p.conv_weight, None, p.A_log, p.dt_bias, inputs.slots, inputs.rows)
            o, pool = pool_mod.verify_layer(*args, backend=self.backend)
            return self._rows_only(o), pool
        # The projections are computed whole on each device of the tensor axis (XLA would
        # otherwise split their columns over it, a differently blocked matmul: other bits).
        mixed, a, b = (self._rows_only(x) for x in (mixed, a, b))
        args = (pool, layer, mixed, a, b, p.conv_weight, None, p.A_log, p.dt_bias, inputs.slots, inputs.rows)
        o, pool = self.mesh.verify_layer(*args, backend=self.backend)
        return self._rows_only(o), pool

    @property
    def _invariant(self) -> bool:
        """The model's invariant mode (:attr:`ModelConfig.invariant_dots`; off for a config without one,
        e.g. a checkpoint's)."""
        return bool(getattr(self.config, "invariant_dots", False))

    def _rows_only(self, x):
        """On a mesh: ``x`` split over the data axis (its leading batch axis) only, so that what
        follows (the out-projection's sum over all v-heads) runs as on one device.

        In the invariant mode (:attr:`ModelConfig.invariant_dots`), on one device too, ``x`` goes
        through an optimization barrier first: it is rounded to its dtype here in every program.
        (XLA may drop a bfloat16 rounding between two float32 computations, a ``convert`` to bf16
        and back: its excess precision. One device's step did so between a residual add and the
        next RMSNorm, while the mesh's, with a sharding constraint between them, rounded: other
        bits in a bf16 model.)"""
        if self._invariant:
            x = jax.lax.optimization_barrier(x)
        if self.mesh is None:
            return x
        spec = jax.sharding.PartitionSpec(self.mesh.data)
        return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(self.mesh.mesh, spec))

    # -- the traced step ------------------------------------------------------------
    def _step(self, params: Params, state: DecodeState, inputs: StepInputs):
        _TRACES[self] += 1
        return self.body(params, state, inputs)

    def body(self, params: Params, state: DecodeState, inputs: StepInputs) -> tuple[DecodeState, StepOutputs]:
        """The step's traced body, not jitted (what :class:`~gdn_lossless_jax.model.loop.DecodeLoop`
        runs K times inside one jitted function)."""
        if self.temperature and inputs.key is None:
            raise ValueError(f"SpecStep(temperature={self.temperature}): argument 'inputs.key' must be a "
                             "jax.random key when sampling, got None")  # fmt: skip
        # On a mesh in the invariant mode the model's dots run per device, rows over the data axis.
        on_mesh = self.mesh is not None and self._invariant
        with rows_mesh(self.mesh.mesh if on_mesh else None, self.mesh.data if on_mesh else None):
            return self._body(params, state, inputs)

    def _body(self, params: Params, state: DecodeState, inputs: StepInputs) -> tuple[DecodeState, StepOutputs]:
        x = self._draft(params, state.pool, inputs)
        lg, pool, kv = self._verify(params, state, x, inputs)
        y, gaps, m = accept(lg, x, inputs.n_given, temperature=self.temperature, key=inputs.key)
        track_steps = self._track_steps(inputs, m)
        pool = self._commit(pool, inputs.slots, m - 1, inputs.track_slots, track_steps, inputs.rows)
        kv = self._track_kv(kv, inputs, track_steps)
        return DecodeState(pool, kv), StepOutputs(x, y, gaps, m, track_steps)

    def _track_steps(self, inputs: StepInputs, m):
        """The step at the last multiple of the interval crossed this step, or -1."""
        T = self.track_interval
        if not T:
            return jnp.full_like(m, -1)
        boundary = ((inputs.pos + m) // T) * T
        crossed = (boundary > inputs.pos) & (inputs.track_slots >= 0) & (inputs.slots >= 0)
        return jnp.where(crossed, boundary - inputs.pos - 1, -1).astype(I32)

    def _track_kv(self, kv: KVCache, inputs: StepInputs, track_steps):
        """The KV prefix goes with the tracked states (the whole row: positions past the
        boundary are masked for whoever resumes from it)."""
        if not self.track_interval or not kv.k.shape[0]:
            return kv
        S1 = kv.k.shape[1]
        dst = jnp.where(track_steps >= 0, _in_range(inputs.track_slots, S1), S1)
        src = _in_range(inputs.slots, S1)

        def copy(kv):
            move = lambda c: c.at[:, dst].set(c.at[:, src].get(mode="fill", fill_value=0), mode="drop")  # noqa: E731
            return KVCache(move(kv.k), move(kv.v))

        return jax.lax.cond(jnp.any(track_steps >= 0), copy, lambda kv: kv, kv)

    def _draft(self, params: Params, pool: StatePool, inputs: StepInputs):
        """``[N, D]`` inputs: the given ones, then the draft's greedy chain."""
        c = self.config

        def layer(l, h, core):
            blk = params.blocks[l]
            return self._block(blk, h, functools.partial(gdn_mixer, blk.mixer, c, core=core, rows=self._rows_only))

        head = lambda h: logits(params, h, invariant=c.invariant_dots)[:, 0]  # noqa: E731
        return self._draft_chain(params.embed, pool, inputs, layer, head)

    def _draft_chain(self, embed, pool: StatePool, inputs: StepInputs, layer, head):
        """The self-draft's chain over the first ``config.draft_layers`` GDN blocks: ``[N, D]``, the
        given inputs, then its greedy proposals. ``layer(l, h, core)`` runs block ``l`` over ``h``
        with ``core`` as its GDN core; ``head(h)`` gives ``[N, vocab]`` logits. The draft carries its
        states in fp32 from the committed ones whatever the pool's dtype (its chain only proposes
        tokens); nothing is written back. Shared by this model and the checkpoint models."""
        c, D = self.config, self.drafts
        tokens, n_given = inputs.tokens.astype(I32), inputs.n_given
        if D == 1:
            return tokens
        s = _in_range(inputs.slots, pool.ssm.shape[1])
        ssm0 = tuple(self._rows_only(self._committed(pool, l, inputs.slots)).astype(jnp.float32)
                     for l in range(c.draft_layers))  # fmt: skip
        conv0 = tuple(self._rows_only(pool.conv.at[l, s].get(mode="fill", fill_value=0)) for l in range(c.draft_layers))

        kernel = self._draft_kernel

        def body(carry, xs):
            ssm, convs, tok = carry
            j, given_next = xs
            h = embed[tok][:, None]
            new_ssm, new_conv = [], []
            for l in range(c.draft_layers):

                def core(mixed, a, b, p, l=l):
                    o, S, window = _draft_gdn(c, ssm[l], convs[l], mixed, a, b, p, self.mesh, kernel)
                    new_ssm.append(S)
                    new_conv.append(window)
                    return o

                h = layer(l, h, core)
            proposal = jnp.argmax(head(h), axis=-1).astype(I32)
            nxt = jnp.where(j + 1 < n_given, given_next, proposal)
            return (tuple(new_ssm), tuple(new_conv), nxt), nxt

        xs = (jnp.arange(D - 1, dtype=I32), tokens[:, 1:].T)
        _, chain = jax.lax.scan(body, (ssm0, conv0, tokens[:, 0]), xs)
        return jnp.concatenate([tokens[:, :1], chain.T], axis=1)

    @property
    def _draft_kernel(self):
        """The backend that runs the draft's recurrence (``_draft_gdn``'s ``kernel``): the step's,
        off a mesh, where it is a kernel backend; else None (XLA's plain fp32 step)."""
        return None if self.mesh is not None or backends.resolve_name(self.backend) == "reference" else self.backend

    def _committed(self, pool: StatePool, layer: int, slots):
        """``[N, HV, V, K]``: the committed SSM states of ``slots`` at ``layer`` (zeros for a
        negative slot). A pool that defers its commit (``allocate(..., defer_commit=True)``)
        still holds the last step's states in its tape: they are replayed here for the batch's
        rows (the commit's arithmetic on a gathered copy; the pool is not changed)."""
        S = pool.ssm.shape[1]
        states = pool.ssm.at[layer, _in_range(slots, S)].get(mode="fill", fill_value=0)
        d = pool.deferred
        if d is None:
            return states
        if self.mesh is not None:
            raise ValueError("SpecStep: a pool that defers its commit (defer_commit=True) is not supported on a "
                             "mesh by the model's draft; allocate the pool with defer_commit=False")  # fmt: skip
        _, tape = d.buffers(pool.tape)
        match = (d.slots[:, None] == slots[None, :]) & (slots[None, :] >= 0)  # [P, N]
        target = jnp.where(jnp.any(match, axis=1), jnp.argmax(match, axis=1), slots.shape[0]).astype(I32)
        steps = jnp.where(d.applied, -1, d.steps)
        one = jax.tree.map(lambda t: t[layer : layer + 1], tape)
        return api.commit(states[None], one, target, steps, rows=d.rows, backend=self.backend)[0]

    def _block(self, blk, h, mixer):
        # On a mesh every activation outside the GDN layers is split by row only (inside the device
        # loop's while body XLA otherwise split a matmul's contraction over the tensor axis: other bits).
        r, inv = self._rows_only, self.config.invariant_dots
        h = r(h + r(mixer(r(rmsnorm(h, blk.norm1, invariant=inv)))))
        return r(h + r(mlp(blk.mlp, r(rmsnorm(h, blk.norm2, invariant=inv)), invariant=inv)))

    def _layers(self, blocks, kinds, h, pool: StatePool, inputs: StepInputs, gdn_block, attention_block):
        """The target's blocks in order over ``h``: ``(h, pool)``. A GDN block runs
        ``gdn_block(blk, h, core)``, ``core`` verifying its layer through the pool (the layer's index
        among the GDN blocks); an attention block ``attention_block(blk, h, layer)`` (its index among
        the attention blocks). Shared by this model and the checkpoint models."""
        gdn_i = attn_i = 0
        for blk, kind in zip(blocks, kinds):
            if kind == "gdn":

                def core(mixed, a, b, p, layer=gdn_i):
                    nonlocal pool
                    o, pool = self._verify_layer(pool, layer, mixed, a, b, p, inputs)
                    return o

                h = gdn_block(blk, h, core)
                gdn_i += 1
            else:
                h = attention_block(blk, h, attn_i)
                attn_i += 1
        return h, pool

    def _verify(self, params: Params, state: DecodeState, x, inputs: StepInputs):
        """The target over ``x [N, D]``: logits ``[N, D, vocab]``, the pool with this step's
        tape in its scratch rows, and the KV cache with this step's entries."""
        c, D = self.config, self.drafts
        kv = state.kv
        positions = inputs.pos[:, None] + jnp.arange(D, dtype=I32)[None, :]
        s_kv = _in_range(inputs.slots, kv.k.shape[1])

        def gdn_block(blk, h, core):
            return self._block(blk, h, functools.partial(gdn_mixer, blk.mixer, c, core=core, rows=self._rows_only))

        def attention_block(blk, h, layer):
            def mixer(xn):
                nonlocal kv
                rows_k = kv.k.at[layer, s_kv].get(mode="fill", fill_value=0)
                rows_v = kv.v.at[layer, s_kv].get(mode="fill", fill_value=0)
                out, (rows_k, rows_v) = attention(blk.mixer, c, xn, rows_k, rows_v, positions)
                # Only this step's entries go back (the rest of each row is unchanged).
                new_k = jnp.take_along_axis(rows_k, positions[:, :, None, None], axis=1, mode="clip")
                new_v = jnp.take_along_axis(rows_v, positions[:, :, None, None], axis=1, mode="clip")
                idx = (layer, s_kv[:, None], positions)
                kv = KVCache(kv.k.at[idx].set(new_k, mode="drop"), kv.v.at[idx].set(new_v, mode="drop"))
                return out

            return self._block(blk, h, mixer)

        h, pool = self._layers(params.blocks, c.kinds, params.embed[x], state.pool, inputs, gdn_block, attention_block)
        return logits(params, h, invariant=c.invariant_dots), pool, kv


_TRACES: collections.Counter = collections.Counter()
# Bound through the instance, so that a subclass's body (another model's draft, verify or state) is
# the one traced.
_jitted_step = jax.jit(lambda step, params, state, inputs: step._step(params, state, inputs), static_argnums=0,
                       donate_argnums=2)  # fmt: skip


def decode_steps(step: SpecStep, params: Params, state: DecodeState, prompts, slots, rows, track_slots,
                 n_steps: int, *, place=None, on_step=None):  # fmt: skip
    """A minimal host loop over ``step`` with fixed batch rows (no joining or leaving: see
    :class:`~gdn_lossless_jax.model.Engine` for that): each row feeds its known tokens, up to D
    at a time, then its last token; for tests and tools that compare two runs step by step.

    Args:
      step: the :class:`SpecStep`; params, state: its parameters and state (the state is donated).
      prompts: one token list per row; slots, rows, track_slots: ``[N]`` int32, fixed for the run.
      n_steps: steps to run.
      place: applied to each step's :class:`StepInputs` (device arrays) before the step, e.g.
        :func:`place_on_mesh`'s placement; None: as they are.
      on_step: ``on_step(t, inputs, out)`` after step ``t``, with the host inputs and the
        step's outputs still on the device(s).
    Returns:
      ``(seqs, outs, state)``: each row's tokens (prompt, then the accepted ones), every step's
      :class:`StepOutputs` on the host, and the final state.
    """
    D, N = step.drafts, len(prompts)
    seqs, pos, outs = [list(p) for p in prompts], np.zeros(N, np.int32), []
    for t in range(n_steps):
        known = [s[p:] for s, p in zip(seqs, pos)]
        n_given = np.array([min(D, len(k)) for k in known], np.int32)
        tokens = np.array([(k[:D] + [0] * D)[:D] for k in known], np.int32)
        inputs = StepInputs(slots=slots, rows=rows, pos=pos.copy(), tokens=tokens, n_given=n_given,
                            track_slots=track_slots)  # fmt: skip
        device_inputs = jax.tree.map(jnp.asarray, inputs)
        state, out = step(params, state, device_inputs if place is None else place(device_inputs))
        if on_step is not None:
            on_step(t, inputs, out)
        out = jax.device_get(out)
        outs.append(out)
        for i in range(N):
            m = int(out.accepted[i])
            seqs[i] += [int(x) for x in out.inputs[i, n_given[i] : m]]  # accepted drafts
            pos[i] += m
            if pos[i] == len(seqs[i]):
                seqs[i].append(int(out.predictions[i, m - 1]))  # the bonus token
    return seqs, outs, state
