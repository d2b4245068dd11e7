"""The fused step's pending tuple commit inside the Triton verify kernels: the previous step's
commit of a program's tile, replayed (or copied from snapshots) before its verify.

:func:`_apply_pending` on the chunk layout, :func:`_apply_pending_rows` on a ``[BV, K]`` tile
with the lanes across K; both replay with the commit kernel's rule
``fma(k, u, rn(S * exp(g)))`` (:func:`_replay_step`, :func:`_replay_row_step`) and the commit's
masks (:func:`gdn_lossless_jax.reference.commit_masks`). A pending KDA tape (``CHANNEL``:
``g [L', PR, PD, HV, K]``) decays each column of the tile by its own channel's ``exp(g[c])``,
one rounded multiply per element, as the commit kernel does. Called by the chains of
:mod:`.verify`; Triton inlines them.
"""

from __future__ import annotations

from ._lang import decay as _decay
from ._lang import fma as _fma
from ._lang import from_f32 as _from_f32
from ._lang import jit, tl
from ._lang import to_f32 as _to_f32

__all__ = ["_apply_pending", "_apply_pending_rows"]  # (the chains of .verify call them)


@jit
def _prefetch_l2(ptrs):
    """``prefetch.global.L2`` of each address (one per 128-byte line); holds no registers."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)  # fmt: skip


@jit
def _prefetch_pending(pu_ptr, pk_ptr, pg_ptr, lead, last, h, hv, i_v, H: tl.constexpr, HV: tl.constexpr,
                      V: tl.constexpr, K: tl.constexpr, BV: tl.constexpr, PD: tl.constexpr, PDP: tl.constexpr,
                      KL: tl.constexpr, CHANNEL: tl.constexpr):  # fmt: skip
    """The lines of the pending tape that the replay of steps ``0..last`` reads: ``k`` (``K / 32``
    lines a step), this tile's ``u`` and the v-head's ``g`` (with ``CHANNEL``, a KDA tape's
    ``[K]`` row, as ``k``), asked of L2 at once. ``PDP``, ``KL``: ``PD`` and the lines of a ``k``
    row, each rounded up to a power of two."""
    ts = tl.maximum(tl.minimum(tl.arange(0, PDP), last), 0)  # steps past the last repeat it (harmless)
    at = lead * PD + ts  # [PDP]
    lines = tl.minimum(tl.arange(0, KL) * 32, K - 1)[None, :]
    _prefetch_l2(pk_ptr + ((at * H + h) * K)[:, None] + lines)
    _prefetch_l2(pu_ptr + (at * HV + hv) * V + i_v * BV)
    if CHANNEL:
        _prefetch_l2(pg_ptr + ((at * HV + hv) * K)[:, None] + lines)
    else:
        _prefetch_l2(pg_ptr + at * HV + hv)


@jit
def _replay_step(Sc, t, lead, h, hv, rows, kidx, m_tile, m_v, pu_ptr, pk_ptr, pg_ptr, H: tl.constexpr,
                 HV: tl.constexpr, V: tl.constexpr, K: tl.constexpr, BV: tl.constexpr, NC: tl.constexpr,
                 C: tl.constexpr, PD: tl.constexpr, INTERPRET: tl.constexpr, CHANNEL: tl.constexpr):  # fmt: skip
    """Step ``t`` of the pending tuple tape replayed on ``Sc`` with the rule, ``fma(k, u, rn(S * exp(g)))``
    (``CHANNEL``: a KDA tape, each column decayed by its own channel's ``exp(g[c])``)."""
    kt = tl.load(pk_ptr + tl.broadcast_to(((lead * PD + t) * H + h) * K + kidx, (BV, NC, C)), mask=m_tile, other=0.0)
    u = tl.load(pu_ptr + ((lead * PD + t) * HV + hv) * V + rows, mask=m_v, other=0.0)
    Sd = Sc * _decay(pg_ptr, (lead * PD + t) * HV + hv, tl.broadcast_to(kidx, (BV, NC, C)), m_tile, K, CHANNEL,
                     INTERPRET)  # fmt: skip
    return _fma(kt, tl.broadcast_to(u[:, None, None], Sc.shape), Sd, INTERPRET)


@jit
def _replay_steps(S, start, stop, lead, h, hv, rows, kidx, m_tile, m_v, pu_ptr, pk_ptr, pg_ptr, dst_trk, m_trk, ptstep,
                  H: tl.constexpr, HV: tl.constexpr, V: tl.constexpr, K: tl.constexpr, BV: tl.constexpr,
                  NC: tl.constexpr, C: tl.constexpr, PD: tl.constexpr, INTERPRET: tl.constexpr,
                  CHANNEL: tl.constexpr):  # fmt: skip
    """Steps ``[start, stop)`` of the pending tuple tape replayed on ``S`` (:func:`_replay_step`),
    the state after step ``ptstep`` stored to ``dst_trk`` where ``m_trk`` (the track state)."""
    for t in range(start, stop):
        S = _replay_step(S, t, lead, h, hv, rows, kidx, m_tile, m_v, pu_ptr, pk_ptr, pg_ptr, H, HV, V, K, BV, NC, C, PD,
                         INTERPRET, CHANNEL)  # fmt: skip
        tl.store(dst_trk, _from_f32(S, dst_trk.dtype.element_ty, INTERPRET), mask=m_trk & (t == ptstep))
    return S


@jit
def _pending_request(prows_ptr, psteps_ptr, ptslots_ptr, ptsteps_ptr, player_ptr, n, slot_ok, NS: tl.constexpr,
                     PR: tl.constexpr, PD: tl.constexpr):  # fmt: skip
    """Request ``n``'s pending commit: its accepted step, track slot and track step, whether it
    writes the accepted and the track state (the commit's masks), and its row of the previous tape."""
    prow = tl.load(prows_ptr + n).to(tl.int64)
    pstep = tl.load(psteps_ptr + n)
    ptslot = tl.load(ptslots_ptr + n).to(tl.int64)
    ptstep = tl.load(ptsteps_ptr + n)
    valid = slot_ok & (prow >= 0) & (prow < PR)
    accept = valid & (pstep >= 0) & (pstep < PD)
    track = valid & (ptstep >= 0) & (ptstep < PD) & (ptslot >= 0) & (ptslot < NS)
    lead = tl.load(player_ptr).to(tl.int64) * PR + tl.where(valid, prow, 0)
    return pstep, ptslot, ptstep, accept, track, lead


@jit
def _replay_bounds(accept, pstep, track, ptstep, pu_ptr, pk_ptr, pg_ptr, lead, h, hv, i_v, H: tl.constexpr,
                   HV: tl.constexpr, V: tl.constexpr, K: tl.constexpr, BV: tl.constexpr, PD: tl.constexpr,
                   PDP: tl.constexpr, KL: tl.constexpr, PREFETCH: tl.constexpr, CHANNEL: tl.constexpr):  # fmt: skip
    """The last step a pending replay runs to the accepted state and to the track state (-1: none),
    the tuples up to the later one prefetched into L2 with ``PREFETCH``."""
    upto = tl.where(accept, pstep, -1)
    tstep = tl.where(track, ptstep, -1)
    if PREFETCH:
        _prefetch_pending(pu_ptr, pk_ptr, pg_ptr, lead, tl.maximum(upto, tstep), h, hv, i_v, H, HV, V, K, BV, PD, PDP,
                          KL, CHANNEL)  # fmt: skip
    return upto, tstep


@jit
def _apply_pending(S, pool_out_ptr, prows_ptr, psteps_ptr, ptslots_ptr, ptsteps_ptr, player_ptr, pu_ptr, pk_ptr, pg_ptr,
                   pstates_ptr, n, h, hv, i_v, layer, slot, slot_ok, rows, kidx, tile, m_v, m_k, m_tile,
                   NS: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, V: tl.constexpr, K: tl.constexpr,
                   BV: tl.constexpr, NC: tl.constexpr, C: tl.constexpr, PR: tl.constexpr, PD: tl.constexpr,
                   PENDING: tl.constexpr, PREFETCH: tl.constexpr, PDP: tl.constexpr, KL: tl.constexpr,
                   INTERPRET: tl.constexpr, CHANNEL: tl.constexpr = False):  # fmt: skip
    """The previous step's commit of this program's tile, before its verify (the Pallas kernel's
    ``_apply_pending``): replay the pending chain from ``S`` with the rule (``PENDING`` 1) or copy
    the previous snapshots (2), store the track and accepted states to the pool, and return the
    state the verify starts from (the accepted state as the pool holds it, or ``S``). ``CHANNEL``:
    the pending tuple tape is KDA's (``g [L', PR, PD, HV, K]``, a per-channel decay).

    The replay runs to the accepted step carrying one state (the track state stored on the
    way), then on from the accepted state to a later track step: no step runs twice, and where
    nothing was accepted the result *is* ``S`` (already in the pool's dtype), so ``S`` need not
    live past the replay's start (the Pallas kernel's ``pending_replay="split"``)."""
    pstep, ptslot, ptstep, accept, track, lead = _pending_request(prows_ptr, psteps_ptr, ptslots_ptr, ptsteps_ptr,
                                                                  player_ptr, n, slot_ok, NS, PR, PD)  # fmt: skip
    dst_acc = pool_out_ptr + ((layer * NS + slot) * HV + hv) * V * K + tile
    dst_trk = pool_out_ptr + ((layer * NS + tl.where(track, ptslot, 0)) * HV + hv) * V * K + tile
    if PENDING == 2:
        at_t = ((lead * PD + tl.where(track, ptstep, 0)) * HV + hv) * V * K + tile
        tl.store(dst_trk, tl.load(pstates_ptr + at_t, mask=m_tile & track, other=0.0), mask=m_tile & track)
        at_a = ((lead * PD + tl.where(accept, pstep, 0)) * HV + hv) * V * K + tile
        acc = tl.load(pstates_ptr + at_a, mask=m_tile & accept, other=0.0)
        tl.store(dst_acc, acc, mask=m_tile & accept)
        res = tl.where(accept, _to_f32(acc, INTERPRET), S)
    else:
        upto, tstep = _replay_bounds(accept, pstep, track, ptstep, pu_ptr, pk_ptr, pg_ptr, lead, h, hv, i_v, H, HV, V, K,
                                     BV, PD, PDP, KL, PREFETCH, CHANNEL)  # fmt: skip
        dt = pool_out_ptr.dtype.element_ty
        args = (lead, h, hv, rows, kidx, m_tile, m_v, pu_ptr, pk_ptr, pg_ptr, dst_trk, m_tile & track, ptstep)
        acc = _replay_steps(S, 0, upto + 1, *args, H, HV, V, K, BV, NC, C, PD, INTERPRET, CHANNEL)
        # a later track step
        _replay_steps(acc, upto + 1, tstep + 1, *args, H, HV, V, K, BV, NC, C, PD, INTERPRET, CHANNEL)
        acc = _from_f32(acc, dt, INTERPRET)
        tl.store(dst_acc, acc, mask=m_tile & accept)
        res = _to_f32(acc, INTERPRET)
    return res


@jit
def _replay_row_steps(S, start, stop, lead, h, hv, rows, cols, m_c, m_v, pu_ptr, pk_ptr, pg_ptr, dst_trk, m_trk, ptstep,
                      H: tl.constexpr, HV: tl.constexpr, V: tl.constexpr, K: tl.constexpr, PD: tl.constexpr,
                      INTERPRET: tl.constexpr, CHANNEL: tl.constexpr):  # fmt: skip
    """:func:`_replay_steps` on a ``[BV, K]`` tile with the lanes across K (:func:`_replay_row_step`)."""
    for t in range(start, stop):
        S = _replay_row_step(S, t, lead, h, hv, rows, cols, m_c, m_v, pu_ptr, pk_ptr, pg_ptr, H, HV, V, K, PD,
                             INTERPRET, CHANNEL)  # fmt: skip
        tl.store(dst_trk, _from_f32(S, dst_trk.dtype.element_ty, INTERPRET), mask=m_trk & (t == ptstep))
    return S


@jit
def _apply_pending_rows(pool_out_ptr, prows_ptr, psteps_ptr, ptslots_ptr, ptsteps_ptr, player_ptr, pu_ptr, pk_ptr,
                        pg_ptr, n, h, hv, i_v, layer, slot, slot_ok, rows, m_v, NS: tl.constexpr, H: tl.constexpr,
                        HV: tl.constexpr, V: tl.constexpr, K: tl.constexpr, BV: tl.constexpr, KP: tl.constexpr,
                        PR: tl.constexpr, PD: tl.constexpr, PREFETCH: tl.constexpr, PDP: tl.constexpr, KL: tl.constexpr,
                        EVICT: tl.constexpr, INTERPRET: tl.constexpr, HAND: tl.constexpr = False,
                        CHANNEL: tl.constexpr = False):  # fmt: skip
    """The previous step's tuple commit of this program's tile (``VerifyConfig.pending_replay="rows"``),
    with :func:`_apply_pending`'s masks, rule and order, on a ``[BV, K]`` tile with the lanes
    across K (a step's ``k`` is ``K / 32`` registers a lane, not the chunk layout's ``K / 4``): the
    state read from the pool, the steps to the accepted one replayed (the track state stored on
    the way), the accepted state stored, then on to a later track step (its destination is
    another slot: duplicate destinations are undefined, as in :func:`gdn_lossless_jax.commit`).
    Returns the state the pool now holds at the request's slot: the chunk chain reads it again
    after the barrier at the end; the rows chain (``HAND``, the same layout) takes this: the
    accepted state as stored (rounded to the pool's dtype), or, where a later track step
    replayed on, read back by each lane from its own lines (no barrier needed)."""
    cols = tl.arange(0, KP)  # K rounded up to a power of two
    m_c = cols < K
    tile2 = rows[:, None] * K + cols[None, :]
    m2 = m_v[:, None] & m_c[None, :]
    at_slot = pool_out_ptr + ((layer * NS + slot) * HV + hv) * V * K + tile2
    S = _to_f32(tl.load(at_slot, mask=m2 & slot_ok, other=0.0, eviction_policy=EVICT), INTERPRET)
    pstep, ptslot, ptstep, accept, track, lead = _pending_request(prows_ptr, psteps_ptr, ptslots_ptr, ptsteps_ptr,
                                                                  player_ptr, n, slot_ok, NS, PR, PD)  # fmt: skip
    dst_trk = pool_out_ptr + ((layer * NS + tl.where(track, ptslot, 0)) * HV + hv) * V * K + tile2
    upto, tstep = _replay_bounds(accept, pstep, track, ptstep, pu_ptr, pk_ptr, pg_ptr, lead, h, hv, i_v, H, HV, V, K, BV,
                                 PD, PDP, KL, PREFETCH, CHANNEL)  # fmt: skip
    dt = pool_out_ptr.dtype.element_ty
    args = (lead, h, hv, rows, cols, m_c, m_v, pu_ptr, pk_ptr, pg_ptr, dst_trk, m2 & track, ptstep)
    acc = _replay_row_steps(S, 0, upto + 1, *args, H, HV, V, K, PD, INTERPRET, CHANNEL)
    tl.store(at_slot, _from_f32(acc, dt, INTERPRET), mask=m2 & accept)  # before a later track state: distinct slots
    if HAND:
        # the state the pool now holds at the slot: acc as stored (rounded to the pool's dtype),
        # unless a later track step replays on; then read back from the lines this lane wrote
        # (the accepted state is not held in registers through those steps)
        if tstep > upto:
            _replay_row_steps(acc, upto + 1, tstep + 1, *args, H, HV, V, K, PD, INTERPRET, CHANNEL)  # later track step
            held = _to_f32(tl.load(at_slot, mask=m2 & slot_ok, other=0.0, eviction_policy=EVICT), INTERPRET)
        else:
            held = _to_f32(_from_f32(acc, dt, INTERPRET), INTERPRET)
        return held
    _replay_row_steps(acc, upto + 1, tstep + 1, *args, H, HV, V, K, PD, INTERPRET, CHANNEL)  # a later track step
    tl.debug_barrier()  # the chain's lanes read lines that other lanes of the program wrote
    return _to_f32(tl.load(at_slot, mask=m2 & slot_ok, other=0.0, eviction_policy=EVICT), INTERPRET)


@jit
def _replay_row_step(Sc, t, lead, h, hv, rows, cols, m_c, m_v, pu_ptr, pk_ptr, pg_ptr, H: tl.constexpr,
                     HV: tl.constexpr, V: tl.constexpr, K: tl.constexpr, PD: tl.constexpr,
                     INTERPRET: tl.constexpr, CHANNEL: tl.constexpr):  # fmt: skip
    """:func:`_replay_step` on a ``[BV, K]`` tile."""
    kt = tl.load(pk_ptr + ((lead * PD + t) * H + h) * K + cols, mask=m_c, other=0.0)
    u = tl.load(pu_ptr + ((lead * PD + t) * HV + hv) * V + rows, mask=m_v, other=0.0)
    Sd = Sc * _decay(pg_ptr, (lead * PD + t) * HV + hv, cols[None, :], m_c[None, :], K, CHANNEL, INTERPRET)
    return _fma(tl.broadcast_to(kt[None, :], Sd.shape), tl.broadcast_to(u[:, None], Sd.shape), Sd, INTERPRET)

