"""Pallas (Triton backend) commit: all GDN layers of a batch in one launch, in place.

Tuple tape: grid ``(V // BV, HV, N, L)`` (other orders: ``CommitConfig.order``). A program
loads the pre-verify state tile of its request's slot once, walks the chain up to
``max(step, track_step)`` with the rule ``fma(k, u, rn(S * exp(g)))`` (step t + 1's k, u and
g loaded during step t), and stores the track state when the chain reaches the track step and
the accepted state when it reaches the accepted step. Both come from the pre-verify state
held in registers, so writing the accepted state in place cannot corrupt the track state (the
accepted-first ordering bug, ``reference.commit_accepted_first``, cannot happen by construction).

Snapshot tape: the same grid, a masked gather-scatter of the two snapshots.

The pool is aliased to the output (``input_output_aliases``): under ``jax.jit`` with the
pool donated, the update happens in place; unwritten slots keep their bits either way.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..launch import LaunchConfig
from ._refs import grid, program_ids, store
from ...reference import exp_fn
from .rounding import replay_update
from .tiles import _decays

__all__ = ["CommitConfig", "commit_tuples", "commit_snapshots"]

F32 = jnp.float32
ORDERS = ("requests", "tiles", "heads")


def _grid(order: str, N: int, L: int, HV: int, NV: int) -> tuple[int, ...]:
    """The launch grid for :attr:`CommitConfig.order` (``NV`` V tiles)."""
    return (NV, HV, N, L) if order == "heads" else grid(N, L * HV, NV, order == "tiles")


def _ids(order: str, HV: int):
    """``(n, layer, hv, tile)`` of this program, for :func:`_grid`."""
    if order == "heads":
        j, hv, n, l = (pl.program_id(i) for i in range(4))
        return n, l, hv, j
    n, lh, j = program_ids(order == "tiles")
    return n, lh // HV, lh % HV, j


@dataclasses.dataclass(frozen=True)
class CommitConfig(LaunchConfig):
    """Launch parameters of the commit kernels (none changes the arithmetic): ``block_v``,
    ``num_warps``, ``num_stages`` (:class:`~gdn_lossless_jax.backends.launch.LaunchConfig`), and
    ``evict``: eviction policy of the replay's pool loads and stores (None: Triton's default).
    ``order``: the grid's order (programs are scheduled first axis fastest): ``"requests"``
    ``(N, L * HV, V // block_v)``; ``"tiles"`` ``(V // block_v, L * HV, N)``; ``"heads"``
    ``(V // block_v, HV, N, L)``, the Triton backend's order.
    """

    evict: str | None = None
    order: str = "heads"

    def __post_init__(self):
        super().__post_init__()
        if self.order not in ORDERS:
            raise ValueError(f"CommitConfig: order must be one of {ORDERS}, got {self.order!r}")


def _request(idx_refs, n, S: int, R: int, D: int):
    """SGLang's masking rules for request n (see reference.commit_masks)."""
    slots_ref, steps_ref, tslots_ref, tsteps_ref, rows_ref = idx_refs
    slot, step, tslot, tstep, row = slots_ref[n], steps_ref[n], tslots_ref[n], tsteps_ref[n], rows_ref[n]
    valid = (slot >= 0) & (slot < S) & (row >= 0) & (row < R)
    accept = valid & (step >= 0) & (step < D)
    track = valid & (tstep >= 0) & (tstep < D) & (tslot >= 0) & (tslot < S)
    return slot, step, tslot, tstep, row, accept, track


def _tuples_kernel(*refs, HV: int, r: int, BV: int, form: str, evict: str | None, order: str, math: str = "platform",
                   control: str | None = None):
    from jax.experimental.pallas import triton as plgpu

    idx_refs = refs[:5]
    u_ref, k_ref, g_ref = refs[5:8]
    pool_out = refs[-1]
    S = pool_out.shape[1]
    R, D = u_ref.shape[1], u_ref.shape[2]
    n, l, hv, j = _ids(order, HV)
    h = hv // r
    vs = pl.ds(j * BV, BV)
    slot, step, tslot, tstep, row, accept, track = _request(idx_refs, n, S, R, D)
    update = replay_update(form, control)

    def inputs(t):  # step t's tape: k (a [1, K] row of the tile's layout), u, the decay (a scalar or a [1, K] row)
        (alpha,) = _decays(g_ref, (l, row, t, hv), [slice(None)], exp_fn(math))
        return k_ref[l, row, t, pl.ds(h, 1), :], u_ref[l, row, t, hv, vs], alpha

    def store_state(at, S):
        store(pool_out, (l, at, hv, vs, slice(None)), S.astype(pool_out.dtype), evict)

    @pl.when(accept | track)
    def _():
        last = jnp.maximum(jnp.where(accept, step, -1), jnp.where(track, tstep, -1))
        S0 = plgpu.load(pool_out.at[l, slot, hv, vs, :], eviction_policy=evict).astype(F32)

        def body(t, carry):
            S, (k, u, alpha) = carry
            nxt = inputs(jnp.minimum(t + 1, last))  # in flight during this step
            S = update(S, alpha, k, u)

            @pl.when(track & (t == tstep))
            def _():
                store_state(tslot, S)

            @pl.when(accept & (t == step))
            def _():
                store_state(slot, S)

            return S, nxt

        lax.fori_loop(0, last + 1, body, (S0, inputs(0)))


def _snapshots_kernel(*refs, HV: int, BV: int, order: str, one_layer: bool = False):
    idx_refs = refs[:5]
    snap_ref = refs[6 if one_layer else 5]
    pool_out = refs[-1]
    S, R, D = pool_out.shape[1], snap_ref.shape[1], snap_ref.shape[2]
    n, l, hv, j = _ids(order, HV)
    lt = l  # the tape's layer
    if one_layer:  # a grid of one layer: the pool's and the tape's layers read from refs[5]
        l, lt = refs[5][0], refs[5][1]
    vs = pl.ds(j * BV, BV)
    slot, step, tslot, tstep, row, accept, track = _request(idx_refs, n, S, R, D)

    @pl.when(track)
    def _():
        pool_out[l, tslot, hv, vs, :] = snap_ref[lt, row, tstep, hv, vs, :]

    @pl.when(accept)
    def _():
        pool_out[l, slot, hv, vs, :] = snap_ref[lt, row, step, hv, vs, :]


def _launch(kernel, pool, tape_leaves, idx, cfg: CommitConfig, interpret: bool, name: str, layers=None):
    from jax.experimental.pallas import triton as plgpu

    L, _, HV, V, _ = pool.shape
    N = idx[0].shape[0]
    inputs = [*idx, *([] if layers is None else [layers]), *tape_leaves, pool]
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        grid=_grid(cfg.order, N, L if layers is None else 1, HV, V // cfg.block_v),
        input_output_aliases={len(inputs) - 1: 0},
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=name,
    )(*inputs)


@functools.partial(jax.jit, static_argnames=("config", "form", "interpret", "math", "control"), donate_argnums=())
def commit_tuples(pool, u, k, g, slots, steps, track_slots, track_steps, rows, *, config=CommitConfig(), form, interpret,
                  math="platform", control=None):
    """``control`` (tests only): a wrong replay form (:data:`~.rounding.CONTROL_FORMS`, or the
    compiler's ``"naive"``), built from ``form``'s instructions."""
    HV, V = pool.shape[2], pool.shape[3]
    cfg = config.fit(V)
    kernel = functools.partial(_tuples_kernel, HV=HV, r=HV // k.shape[3], BV=cfg.block_v, form=form, evict=cfg.evict,
                               order=cfg.order, math=math, control=control)  # fmt: skip
    idx = (slots, steps, track_slots, track_steps, rows)
    return _launch(kernel, pool, (u, k, g), idx, cfg, interpret, "gdn_commit_replay")


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def commit_snapshots(pool, states, slots, steps, track_slots, track_steps, rows, *, config=CommitConfig(), interpret,
                     layers=None):  # fmt: skip
    """The snapshot commit of every layer (``states[l]`` into ``pool[l]``) or, with ``layers`` (an
    int32 ``[2]``: the pool's layer, the tape's), of that one layer, in place either way."""
    HV, V = pool.shape[2], pool.shape[3]
    cfg = config.fit(V)
    kernel = functools.partial(_snapshots_kernel, HV=HV, BV=cfg.block_v, order=cfg.order, one_layer=layers is not None)
    idx = (slots, steps, track_slots, track_steps, rows)
    return _launch(kernel, pool, (states,), idx, cfg, interpret, "gdn_commit_scatter", layers)
