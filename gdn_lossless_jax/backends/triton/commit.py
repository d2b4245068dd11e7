"""Commit (and replay) as Triton kernels, called through jax-triton, in place on the pool.

Tuple tape: one launch for all layers, grid ``(V tiles * HV, N, L)``. Each program reads
its ``[BV, K]`` tile of the pre-verify state ``pool[l, slots[n], hv]`` once, walks the
chain ``t = 0 .. max(steps[n], track_steps[n])`` in registers with the library's rule
``S = fma(k_t, u_t, rn(S * exp(g_t)))`` (k of q/k head ``hv // (HV // H)``), and stores
the state to ``pool[l, track_slots[n]]`` when ``t == track_steps[n]`` and to
``pool[l, slots[n]]`` when ``t == steps[n]`` (rounded to the pool dtype). A KDA tape
(:class:`~gdn_lossless_jax.tape.KDATuples`, ``g [L, R, D, HV, K]``: the kernel's ``CHANNEL``,
read from g's rank) decays column c of the tile by ``exp(g_t[c])``, still one rounded
multiply per element before the fma. Both states come from
the pre-verify state read before either write, so the accepted-first ordering bug
(``reference.commit_accepted_first``) cannot happen.

Snapshot tape: a masked gather-scatter, grid ``(blocks of HV*V*K, N, L)``.

Masks (SGLang's ``fused_mamba_state_scatter_with_mask``, :func:`reference.commit_masks`): a
request whose slot or tape row is out of range is skipped entirely (track copy included);
its accepted write needs ``0 <= steps[n] < D``; its track write needs
``0 <= track_steps[n] < D`` and ``0 <= track_slots[n] < S``. ``rows[n]`` is request n's
tape row; the tape's row pitch comes from its own shape ``[L, R, D, ...]``.

The pool is both an input and the aliased output (``input_output_aliases``): under a jit
that donates it, the update is in place; otherwise XLA copies it first, so every slot
not written keeps its bits either way.

:func:`replay` runs the tuple kernel on a one-layer pool made of ``state0`` (slot i =
request i): a step outside ``[0, D)`` leaves that slot, i.e. ``state0``, as it is.
"""

from __future__ import annotations

import dataclasses
import functools

from ..launch import LaunchConfig
from ._lang import decay as _decay
from ._lang import fma as _fma
from ._lang import from_f32 as _from_f32
from ._lang import import_jax_triton, jit, next_power_of_2, tl
from ._lang import to_f32 as _to_f32

__all__ = [
    "CommitConfig",
    "FORMS",
    "CONTROL_FORMS",
    "COMPILER_FORMS",
    "commit_tuples",
    "commit_snapshots",
    "replay",
    "commit_tuples_kernel",
    "commit_snapshots_kernel",
]

#: The replay update of the commit kernel. ``pinned`` is the library's rule, pinned by ``tl.fma``
#: with fp fusion off (the rule of :data:`gdn_lossless_jax.testing.controls.FORMS`). The control
#: forms break it by construction, for tests that must catch them: ``twice_rounded`` is
#: ``rn(rn(S * alpha) + rn(k * u))`` (what XLA:GPU makes of the plain expression) and
#: ``other_product`` is ``fma(S, alpha, rn(k * u))`` written out (what Triton's fp fusion
#: made of it in SGLang's kernel). ``naive`` writes ``S * alpha + k * u`` and launches with fp
#: fusion on, so the compiler decides, which is why it is not among the controls: which product
#: Triton 3.6 fuses depends on the launch, the pool dtype and jax-triton's pointer
#: specialisation (scripts/triton_interpret_check.py prints which). Hence the rule is written out.
FORMS = ("pinned",)
CONTROL_FORMS = ("twice_rounded", "other_product")
COMPILER_FORMS = ("naive",)
# ("rule": the update forms' name of the rule, testing.controls.FORMS, which tools/amdgcn.py speaks.)
_FORM_CODE = {"pinned": 0, "rule": 0, "naive": 1, "twice_rounded": 1, "other_product": 2}


@dataclasses.dataclass(frozen=True)
class CommitConfig(LaunchConfig):
    """Launch parameters of the commit kernels: the tuple (replay) kernel's ``block_v``,
    ``num_warps`` and ``num_stages`` (:class:`~gdn_lossless_jax.backends.launch.LaunchConfig`;
    two stages here), and

    Attributes:
      block: elements per program of the snapshot gather-scatter.
      copy_warps: num_warps of the gather-scatter.
      evict: Triton's eviction policy for the replay's pool loads and stores (``""``: Triton's
        default).
    """

    num_stages: int = 2
    block: int = 2048
    copy_warps: int = 4
    evict: str = ""


@jit
def _request(slots_ptr, steps_ptr, track_slots_ptr, track_steps_ptr, rows_ptr, n, S: tl.constexpr, R: tl.constexpr,
             D: tl.constexpr):  # fmt: skip
    """Request n's indices and masks: ``(slot, row, step, track_slot, track_step, accept, track)``."""
    slot = tl.load(slots_ptr + n)
    row = tl.load(rows_ptr + n)
    step = tl.load(steps_ptr + n)
    track_slot = tl.load(track_slots_ptr + n)
    track_step = tl.load(track_steps_ptr + n)
    valid = (slot >= 0) & (slot < S) & (row >= 0) & (row < R)
    accept = valid & (step >= 0) & (step < D)
    track = valid & (track_step >= 0) & (track_step < D) & (track_slot >= 0) & (track_slot < S)
    # Clamped copies keep every address in range; the masks decide what is written.
    slot = tl.where(valid, slot, 0)
    row = tl.where(valid, row, 0)
    track_slot = tl.where(track, track_slot, 0)
    return slot, row, step, track_slot, track_step, accept, track


@jit
def commit_tuples_kernel(
    pool_ptr,  # [L, S, HV, V, K] f32 | bf16 (input: the pre-verify states)
    u_ptr,  # [L, R, D, HV, V] f32
    k_ptr,  # [L, R, D, H, K] f32
    g_ptr,  # [L, R, D, HV] f32, or [L, R, D, HV, K] with CHANNEL (KDA)
    slots_ptr,  # [N] i32
    steps_ptr,
    track_slots_ptr,
    track_steps_ptr,
    rows_ptr,
    out_ptr,  # the pool again (aliased with pool_ptr)
    S: tl.constexpr,
    R: tl.constexpr,
    D: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    V: tl.constexpr,
    K: tl.constexpr,
    BV: tl.constexpr,
    BK: tl.constexpr,
    NV: tl.constexpr,
    INTERPRET: tl.constexpr,
    FORM: tl.constexpr = 0,  # _FORM_CODE: 0 the rule; 1 and 2 controls
    EVICT: tl.constexpr = "",  # the pool loads' and stores' eviction policy
    CHANNEL: tl.constexpr = False,  # g per key channel (KDA; from g's rank): each column its own decay
):
    pid = tl.program_id(0)
    i_v = pid % NV
    hv = pid // NV
    n = tl.program_id(1)
    layer = tl.program_id(2).to(tl.int64)
    h = hv // (HV // H)
    slot, row, step, track_slot, track_step, accept, track = _request(
        slots_ptr, steps_ptr, track_slots_ptr, track_steps_ptr, rows_ptr, n, S, R, D
    )
    last = tl.maximum(tl.where(accept, step, -1), tl.where(track, track_step, -1))

    offs_v = i_v * BV + tl.arange(0, BV)
    offs_k = tl.arange(0, BK)
    m_v = offs_v < V
    m_k = offs_k < K
    m_vk = m_v[:, None] & m_k[None, :]
    tile = offs_v[:, None] * K + offs_k[None, :]
    src = pool_ptr + ((layer * S + slot) * HV + hv) * V * K + tile
    dst_accept = out_ptr + ((layer * S + slot) * HV + hv) * V * K + tile
    dst_track = out_ptr + ((layer * S + track_slot) * HV + hv) * V * K + tile
    tape_row = layer * R + row  # int64

    state = _to_f32(tl.load(src, mask=m_vk, other=0.0, eviction_policy=EVICT), INTERPRET)  # read before any write
    for t in range(last + 1):
        # a scalar, or [1, BK]: column c of the state decays by exp(g[c]) (KDA); g read first, as before KDA (the
        # GDN kernel's instructions in their old order: tests/test_rocm_isa.py reads the compiler's fusions)
        alpha = _decay(g_ptr, (tape_row * D + t) * HV + hv, offs_k[None, :], m_k[None, :], K, CHANNEL, INTERPRET)
        k = tl.load(k_ptr + ((tape_row * D + t) * H + h) * K + offs_k, mask=m_k, other=0.0)
        u = tl.load(u_ptr + ((tape_row * D + t) * HV + hv) * V + offs_v, mask=m_v, other=0.0)
        if FORM == 0:
            Sd = state * alpha
            state = _fma(tl.broadcast_to(k[None, :], (BV, BK)), tl.broadcast_to(u[:, None], (BV, BK)), Sd, INTERPRET)
        elif FORM == 1:
            state = state * alpha + k[None, :] * u[:, None]
        else:
            ku = tl.broadcast_to(k[None, :], (BV, BK)) * tl.broadcast_to(u[:, None], (BV, BK))
            state = _fma(state, tl.broadcast_to(alpha, (BV, BK)), ku, INTERPRET)
        value = _from_f32(state, out_ptr.dtype.element_ty, INTERPRET)
        tl.store(dst_track, value, mask=m_vk & (track & (t == track_step)), eviction_policy=EVICT)
        tl.store(dst_accept, value, mask=m_vk & (accept & (t == step)), eviction_policy=EVICT)


@jit
def commit_snapshots_kernel(
    pool_ptr,  # [L, S, HV, V, K] (input; aliased with out_ptr, not read)
    states_ptr,  # [L, R, D, HV, V, K], the pool's dtype
    slots_ptr,
    steps_ptr,
    track_slots_ptr,
    track_steps_ptr,
    rows_ptr,
    out_ptr,  # the pool again
    S: tl.constexpr,
    R: tl.constexpr,
    D: tl.constexpr,
    E: tl.constexpr,  # HV * V * K, elements of one state
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    n = tl.program_id(1)
    layer = tl.program_id(2).to(tl.int64)
    slot, row, step, track_slot, track_step, accept, track = _request(
        slots_ptr, steps_ptr, track_slots_ptr, track_steps_ptr, rows_ptr, n, S, R, D
    )
    m = offs < E
    snap = states_ptr + ((layer * R + row) * D) * E + offs
    m_track = m & track
    tl.store(out_ptr + (layer * S + track_slot) * E + offs, tl.load(snap + track_step * E, mask=m_track), mask=m_track)
    m_accept = m & accept
    tl.store(out_ptr + (layer * S + slot) * E + offs, tl.load(snap + step * E, mask=m_accept), mask=m_accept)


def tuple_launch(pool_shape, k_shape, R: int, D: int, N: int, config: CommitConfig):
    """The tuple kernel's constexpr sizes and grid, from the shapes alone."""
    L, S, HV, V, K = pool_shape
    H = k_shape[-2]
    BV = min(next_power_of_2(config.block_v), next_power_of_2(V))
    NV = -(-V // BV)
    return dict(S=S, R=R, D=D, H=H, HV=HV, V=V, K=K, BV=BV, BK=next_power_of_2(K), NV=NV), (NV * HV, N, L)


def snapshot_launch(pool_shape, R: int, D: int, N: int, config: CommitConfig):
    """The gather-scatter kernel's constexpr sizes and grid."""
    L, S, HV, V, K = pool_shape
    E = HV * V * K
    block = min(next_power_of_2(config.block), next_power_of_2(E))
    return dict(S=S, R=R, D=D, E=E, BLOCK=block), (-(-E // block), N, L)


@functools.cache
def _jitted(name: str):
    import jax

    if name == "snapshots":
        return jax.jit(_commit_snapshots, static_argnames=("config",))
    return jax.jit({"tuples": _commit_tuples, "replay": _replay}[name], static_argnames=("config", "form"))


def commit_tuples(
    pool, u, k, g, slots, steps, track_slots, track_steps, rows, *, config: CommitConfig = CommitConfig(), form="pinned"
):
    """Replay-commit all layers from a tuple tape; returns the new pool ``[L, S, HV, V, K]``."""
    return _jitted("tuples")(pool, u, k, g, slots, steps, track_slots, track_steps, rows, config=config, form=form)


def commit_snapshots(
    pool, states, slots, steps, track_slots, track_steps, rows, *, config: CommitConfig = CommitConfig()
):
    """Gather-scatter commit from a snapshot tape; returns the new pool."""
    return _jitted("snapshots")(pool, states, slots, steps, track_slots, track_steps, rows, config=config)


def replay(state0, u, k, g, steps, *, config: CommitConfig = CommitConfig(), form="pinned"):
    """The state after ``steps[i]`` for each request (``state0`` where the step is outside ``[0, D)``)."""
    return _jitted("replay")(state0, u, k, g, steps, config=config, form=form)


def _replay(state0, u, k, g, steps, *, config, form):
    import jax.numpy as jnp

    N = state0.shape[0]
    ids = jnp.arange(N, dtype=jnp.int32)
    none = jnp.full((N,), -1, jnp.int32)
    pool = _commit_tuples(
        state0[None], u[None], k[None], g[None], ids, steps, none, none, ids, config=config, form=form
    )
    return pool[0]


def _commit_tuples(pool, u, k, g, slots, steps, track_slots, track_steps, rows, *, config, form):
    import jax

    jt = import_jax_triton()

    R, D = u.shape[1], u.shape[2]
    sizes, grid = tuple_launch(pool.shape, k.shape, R, D, slots.shape[0], config)
    return jt.triton_call(
        pool, u, k, g, slots, steps, track_slots, track_steps, rows,
        kernel=commit_tuples_kernel,
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        grid=grid,
        input_output_aliases={0: 0},
        enable_fp_fusion=form == "naive",  # off: every operation rounds as written
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        name="gdn_commit_tuples",
        **sizes,
        INTERPRET=False,
        FORM=_FORM_CODE[form],
        EVICT=config.evict,
        CHANNEL=g.ndim == 5,  # KDA's g [L, R, D, HV, K]
    )  # fmt: skip


def _commit_snapshots(pool, states, slots, steps, track_slots, track_steps, rows, *, config):
    import jax

    jt = import_jax_triton()

    R, D = states.shape[1], states.shape[2]
    sizes, grid = snapshot_launch(pool.shape, R, D, slots.shape[0], config)
    return jt.triton_call(
        pool, states, slots, steps, track_slots, track_steps, rows,
        kernel=commit_snapshots_kernel,
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        grid=grid,
        input_output_aliases={0: 0},
        enable_fp_fusion=False,
        num_warps=config.copy_warps,
        name="gdn_commit_snapshots",
        **sizes,
    )  # fmt: skip
