"""Decoding on the device: K speculative steps per call, acceptance and next inputs included.

:class:`~gdn_lossless_jax.model.decode.SpecStep` is one step per call: the host builds each
step's inputs, waits for its outputs and decides what comes next, so the GPU idles while
Python runs. :class:`DecodeLoop` runs ``steps_per_call`` steps inside one jitted function (a
``lax.fori_loop`` over the step's traced body, :meth:`SpecStep.body`): each step's inputs
come from a token buffer on the device (the row's known tokens, then what it accepted),
acceptance (greedy, or sampling with a key folded per step) and the commit happen there, and
the host sees tokens every K steps. A row that reaches its budget mid-call is masked (its slot
becomes -1 for the remaining steps: the pool reads zeros for it and drops its writes), not
recompiled. Shapes never change, so the loop compiles once per record mode, batch and K.

A pool that defers its commit (``allocate(..., defer_commit=True)``, the fused
commit-into-next-verify) alternates two scratch tapes, which is part of the pool's structure;
the loop then runs two steps per iteration (K must be even) and the pool comes back with its
last commit pending, as after any step (:func:`gdn_lossless_jax.pool.flush` applies it).

The per-step form stays the simple one (:class:`~gdn_lossless_jax.model.Engine` with
``steps_per_call=1``); both run the same step and give the same tokens and states bit for bit
(``tests/test_loop.py``).
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp

from .decode import DecodeState, SpecStep, StepInputs, StepOutputs, row_keys
from .model import Params

__all__ = ["LoopInputs", "LoopOutputs", "DecodeLoop"]

I32 = jnp.int32


def _pytree(cls):
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


@_pytree
class LoopInputs:
    """One call's batch, N rows (``[N]`` int32 unless noted), fixed for the call's K steps.

    Attributes:
      slots, rows, track_slots: as in :class:`~gdn_lossless_jax.model.decode.StepInputs`
        (a negative slot: an empty row for the whole call).
      pos: tokens already in the row's state.
      tokens: ``[N, W]``, the row's known tokens from ``pos`` on (the rest of its prompt, or its
        last generated token); W >= K * D so that a call never runs out of a prompt (shorter
        rows are zero-padded: ``known`` says how many are real).
      known: real entries of ``tokens`` (>= 1 for a row that runs). When ``known`` is W and
        the row has more prompt, the call consumes at most ``K * D`` of them, D per step, and
        never decodes: so W must be a multiple of D, at least K * D.
      budget: tokens the row may still emit; 0 masks the row for the call.
      ids: the row's request id (sampling: its keys are :func:`~gdn_lossless_jax.model.decode.row_keys`
        of ``key``, the id and its position, so its tokens do not depend on K or its batch row).
      key: a ``jax.random`` key when sampling, else None.
    """

    slots: jax.Array
    rows: jax.Array
    track_slots: jax.Array
    pos: jax.Array
    tokens: jax.Array
    known: jax.Array
    budget: jax.Array
    ids: jax.Array
    key: jax.Array | None = None


@_pytree
class LoopOutputs:
    """What the K steps did.

    Attributes:
      steps: every step's :class:`~gdn_lossless_jax.model.decode.StepOutputs`, stacked ``[K,
        N, ...]``; a masked row has ``accepted`` 0 and ``track_steps`` -1 at that step.
      active: ``[K, N]`` bool, the rows each step ran.
      pos: ``[N]``, tokens in each row's state after the call.
      emitted: ``[N]``, tokens each row emitted (may pass its budget by up to D - 1: the host
        keeps the first ``budget``).
      tokens: ``[N, 2 * W]``, the call's buffer: the given tokens, then the emitted ones from
        ``known`` on.
    """

    steps: StepOutputs
    active: jax.Array
    pos: jax.Array
    emitted: jax.Array
    tokens: jax.Array


@dataclasses.dataclass(frozen=True)
class DecodeLoop:
    """``loop(params, state, inputs) -> (state, LoopOutputs)``: K steps of ``step`` in one
    jitted call; the state is donated.

    Attributes:
      step: the :class:`~gdn_lossless_jax.model.decode.SpecStep` (its model, D, backend,
        temperature).
      steps_per_call: K >= 1 (even for a pool that defers its commit).
      graph: on a GPU, compile the call with XLA's command buffers extended to the loop itself
        (:data:`GRAPH_OPTIONS`: the ``while`` and its body recorded as one CUDA graph, launched
        once a call) instead of the default, where the body's kernels are launched one by one
        each iteration. The same program and bits; only how it is launched. Ignored elsewhere.
    """

    step: SpecStep
    steps_per_call: int
    graph: bool = False

    def __post_init__(self):
        if not isinstance(self.steps_per_call, int) or self.steps_per_call < 1:
            raise ValueError(
                f"DecodeLoop: argument 'steps_per_call' must be a positive integer, got {self.steps_per_call!r}"
            )

    @property
    def traces(self) -> int:
        """How often JAX traced this loop (once per record mode and batch shape)."""
        return _TRACES[self]

    def __call__(self, params: Params, state: DecodeState, inputs: LoopInputs) -> tuple[DecodeState, LoopOutputs]:
        K, D = self.steps_per_call, self.step.drafts
        W = inputs.tokens.shape[-1]
        if W < K * D or W % D:
            raise ValueError(
                f"DecodeLoop: argument 'inputs.tokens' must have W columns, a multiple of D={D} and >= K * D = "
                f"{K * D}, got shape {inputs.tokens.shape}"
            )
        if state.pool.drafts < D:
            raise ValueError(
                f"DecodeLoop: the pool's scratch holds drafts={state.pool.drafts} steps, the step verifies D={D}"
            )
        if state.pool.deferred is not None and K % 2:
            raise ValueError(
                f"DecodeLoop: argument 'steps_per_call' must be even for a pool that defers its commit (its two "
                f"scratch tapes alternate), got {K}"
            )
        if self.step.temperature and inputs.key is None:
            raise ValueError(f"DecodeLoop: the step samples (temperature={self.step.temperature}): argument "
                             "'inputs.key' must be a jax.random key, got None")  # fmt: skip
        run = _jitted_graph_loop if self.graph and jax.default_backend() == "gpu" else _jitted_loop
        return run(self, params, state, inputs)

    # -- traced --------------------------------------------------------------------------
    def _placed(self, state: DecodeState) -> DecodeState:
        """On a mesh, the loop's carried state constrained to the layout
        :func:`~gdn_lossless_jax.model.decode.place_on_mesh` gives it (the pool as ``MeshPlan.put``
        splits it, the KV cache's slots over the data axis), as the per-step engine's step receives
        it. A precaution: what made the loop's bits differ from one device's was the GDN mixer's
        out-projection (see :func:`~gdn_lossless_jax.model.model.gdn_mixer`'s ``rows``)."""
        plan = self.step.mesh
        named = lambda spec: jax.sharding.NamedSharding(plan.mesh, spec)  # noqa: E731
        pool = jax.lax.with_sharding_constraint(state.pool, plan.shardings("pool", state.pool))
        kv = jax.lax.with_sharding_constraint(state.kv, named(jax.sharding.PartitionSpec(None, plan.data)))
        return dataclasses.replace(state, pool=pool, kv=kv)

    def _run(self, params: Params, state: DecodeState, inputs: LoopInputs):
        _TRACES[self] += 1
        K, D, step = self.steps_per_call, self.step.drafts, self.step
        N, W = inputs.tokens.shape
        R = state.pool.requests
        buf = jnp.zeros((N, 2 * W), I32).at[:, :W].set(inputs.tokens.astype(I32))
        cols = jnp.arange(D, dtype=I32)[None, :]
        n_idx = jnp.arange(N)[:, None]

        def one(t, carry):
            state, buf, p, L, pos, emitted, outs, active_log = carry
            active = (inputs.slots >= 0) & (emitted < inputs.budget)
            key = None if inputs.key is None else row_keys(inputs.key, inputs.ids, pos)
            step_in = StepInputs(
                slots=jnp.where(active, inputs.slots, -1),
                rows=jnp.where(active, inputs.rows, R),
                pos=pos,
                tokens=jnp.take_along_axis(buf, p[:, None] + cols, axis=1, mode="clip"),
                n_given=jnp.clip(L - p, 1, D).astype(I32),
                track_slots=jnp.where(active, inputs.track_slots, -1),
                key=key,
            )
            if step.mesh is not None:  # laid out as the per-step engine places them (see _placed)
                step_in, state = step._rows_only(step_in), self._placed(state)
            state, out = step.body(params, state, step_in)
            m = jnp.where(active, out.accepted, 0)
            out = dataclasses.replace(out, accepted=m, track_steps=jnp.where(active, out.track_steps, -1))
            # Every known token is in: the accepted drafts and the bonus token go after them.
            decoding = active & (p + m >= L)
            bonus = jnp.take_along_axis(out.predictions, jnp.maximum(m - 1, 0)[:, None], axis=1)
            j = jnp.arange(D + 1, dtype=I32)[None, :]
            vals = jnp.where(j < m[:, None], jnp.pad(out.inputs, ((0, 0), (0, 1))), bonus)
            dst = p[:, None] + j
            write = decoding[:, None] & (dst >= L[:, None]) & (j <= m[:, None])
            buf = buf.at[n_idx, jnp.where(write, dst, 2 * W)].set(vals, mode="drop")
            emitted = emitted + jnp.where(decoding, p + m + 1 - L, 0)
            L = jnp.where(decoding, p + m + 1, L)
            outs = jax.tree.map(lambda acc, x: acc.at[t].set(x), outs, out)
            return state, buf, p + m, L, pos + m, emitted, outs, active_log.at[t].set(active)

        zeros = jnp.zeros((N,), I32)
        outs0 = StepOutputs(
            inputs=jnp.zeros((K, N, D), I32), predictions=jnp.zeros((K, N, D), I32),
            gaps=jnp.zeros((K, N, D), jnp.float32), accepted=jnp.zeros((K, N), I32),
            track_steps=jnp.full((K, N), -1, I32),
        )  # fmt: skip
        carry = (state, buf, zeros, inputs.known.astype(I32), inputs.pos.astype(I32), zeros, outs0,
                 jnp.zeros((K, N), bool))  # fmt: skip
        if state.pool.deferred is None:
            carry = jax.lax.fori_loop(0, K, one, carry)
        else:  # two steps per iteration: the pool's structure (its tapes' parity) alternates
            carry = jax.lax.fori_loop(0, K // 2, lambda i, c: one(2 * i + 1, one(2 * i, c)), carry)
        state, buf, _, _, pos, emitted, outs, active_log = carry
        return state, LoopOutputs(outs, active_log, pos, emitted, buf)


_TRACES: collections.Counter = collections.Counter()
_jitted_loop = jax.jit(DecodeLoop._run, static_argnums=0, donate_argnums=2)
#: XLA's command-buffer kinds for :attr:`DecodeLoop.graph`: its defaults plus ``WHILE`` and
#: ``CONDITIONAL``, so that the loop and what it runs are recorded in one graph.
GRAPH_OPTIONS = {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"}
_jitted_graph_loop = jax.jit(DecodeLoop._run, static_argnums=0, donate_argnums=2, compiler_options=GRAPH_OPTIONS)

