"""Verify as Triton kernels, called through jax-triton: a prologue, then the chain.

The design of the Pallas backend's default launch (``backends/pallas/verify.py``), in Triton:

* ``verify_prep_kernel``, grid ``(N, D, H / prep_heads)``: the q/k l2 norms (the query also
  scaled) and the gates ``g``, ``beta``, once per (request, step, head) rather than once per V
  tile. Its ``k`` and ``g`` *are* the tape's.
* ``verify_kernel``, grid ``(N, HV, V / BV)`` for tuples and ``(V / BV, HV, N)`` for snapshots
  (``VerifyConfig.order``): one program holds a ``[BV, K]`` fp32 tile of one request's state for
  one v-head (bf16 upcast), as ``[BV, K / C, C]`` chunks or, up to ``ROWS_UP_TO`` drafts, as a
  ``[BV, K]`` tile with the lanes across K (:func:`_chain_rows`; ``VerifyConfig.chain``). It
  walks the D steps (steps 3-6 of :mod:`gdn_lossless_jax.reference`)::

    alpha = exp(g_t)
    Sd    = S * alpha                      # one rounded multiply
    u     = beta_t * (v_t - sum_k Sd * k_t)
    S     = fma(k_t, u, Sd)                # explicit: fp fusion would fuse the other product
    o_t   = sum_k S * q_t

The two chains' reduction orders differ, and so do u's and the outputs' low bits.

KDA (``decay="channel"``, a per-channel decay): the prologue is XLA's
(:func:`gdn_lossless_jax.reference.prepare`, ``g [N, D, HV, K]``), and the chain kernel, told by
g's rank (the constexpr ``CHANNEL``), reads step t's ``g_t`` as a ``[K]`` row in k's layout, so
``alpha = exp(g_t)`` is one factor per column and ``Sd = S * alpha`` still one rounded multiply
per element; the rest of the step is GDN's. A pending KDA tape (``PCHANNEL``) is replayed the same
way (``pending.py``).

One kernel body serves both record modes (the constexpr ``SNAPSHOTS`` only chooses what is
stored, ``TILES_FIRST`` only how the program ids are read), so the outputs are identical by
construction (scripts/triton_interpret_check.py checks that the two variants' TTGIR carry the
same arithmetic in the same layouts). ``record="snapshots"`` stores the state after every step
(``[N, D, HV, V, K]``, state0's dtype); ``record="tuples"`` stores ``u [N, D, HV, V]``, with
the prologue's ``k [N, D, H, K]`` and ``g [N, D, HV]`` (fp32; KDA's ``[N, D, HV, K]``) as the rest
of the tape.

The wrappers launch with fp fusion off (``_lang.py``): every multiply and add rounds as written,
and the pinned fma is explicit. JAX is imported inside the wrappers only, so that the kernels also
load where the Triton interpreter checks them without JAX (``scripts/triton_interpret_check.py``).
"""

from __future__ import annotations

import dataclasses
import functools

from ..launch import VerifyLaunch
from ._lang import decay as _decay
from ._lang import exp as _exp
from ._lang import fma as _fma
from ._lang import from_f32 as _from_f32
from ._lang import import_jax_triton, jit, next_power_of_2, tl
from ._lang import log as _log
from ._lang import to_f32 as _to_f32
from .pending import _apply_pending, _apply_pending_rows

__all__ = ["VerifyConfig", "verify", "verify_kernel", "verify_prep_kernel", "launch_sizes", "prep_launch"]

PENDING_REPLAYS = ("rows", "split")
CHAINS = ("chunks", "rows")
ROWS_UP_TO = 8  # VerifyConfig.chain=None: the rows chain up to this many drafts
UNROLL_UP_TO = 8  # VerifyConfig.unroll=None: the rows chain's steps unrolled up to this many drafts


@dataclasses.dataclass(frozen=True)
class VerifyConfig(VerifyLaunch):
    """Launch parameters of the verify kernels (the same arithmetic for both record modes).

    The shared fields (``block_v``, ``num_warps``, ``num_stages``, ``k_chunk``, ``order``,
    ``prep_heads``) are :class:`~gdn_lossless_jax.backends.launch.VerifyLaunch`'s; here
    ``block_v`` and ``k_chunk`` are capped at V and K rounded up to a power of 2, and
    ``prep_heads`` must be at least 1.

    Attributes:
      evict: Triton's eviction policy of the state loads and snapshot stores (``""``: Triton's
        default), each touched once.
      prefetch_pending: in the fused kernel, ask L2 for every pending step's ``k``, ``u`` and
        ``g`` at the program's start (``prefetch.global.L2``, no registers held).
      pending_replay: how the fused kernel replays a pending tuple commit: ``"rows"`` on a
        ``[BV, K]`` tile with the lanes across K, storing the accepted and track states to the
        pool, after which the chain reads the state back from the pool in its own layout (the
        program's lanes meet at a barrier first); ``"split"`` in the chain's layout, the state
        handed over in registers (the Pallas kernel's ``pending_replay="split"``).
      chain: the layout of the chain's state tile. ``"chunks"``: ``[BV, K / C, C]`` chunks, 8
        lanes across the rows and 4 across the columns (short reductions; q and k loaded once a
        row). ``"rows"``: ``[BV, K]`` with the 32 lanes across K, the rows in registers (q and k
        loaded once; reductions by :func:`_row_sums`); a pending tuple commit is then always
        replayed on that tile (``pending_replay`` is not read). None: ``"rows"`` up to
        ``ROWS_UP_TO`` drafts, ``"chunks"`` above. The two differ in ``u``'s and the outputs' low
        bits (the reductions' order), the same way in both record modes and the fused kernel.
      unroll: unroll the rows chain's steps (the chunk chain ignores it), so a step's output
        reduction can overlap the next step's chain; bit-identical. None: unrolled up to
        ``UNROLL_UP_TO`` drafts.
    """

    evict: str = "evict_first"
    prefetch_pending: bool = True
    pending_replay: str = "rows"
    chain: str | None = None
    unroll: bool | None = None

    def __post_init__(self):
        if isinstance(self.prep_heads, int) and (self.prep_heads < 1 or self.prep_heads & (self.prep_heads - 1)):
            raise ValueError(f"VerifyConfig: prep_heads must be a power of 2, got {self.prep_heads}")
        super().__post_init__()
        if self.chain not in (None, *CHAINS):
            raise ValueError(f"VerifyConfig: chain must be None or one of {CHAINS}, got {self.chain!r}")
        if self.unroll not in (None, True, False):
            raise ValueError(f"VerifyConfig: unroll must be None, True or False, got {self.unroll!r}")
        if self.pending_replay not in PENDING_REPLAYS:
            raise ValueError(f"VerifyConfig: pending_replay must be one of {PENDING_REPLAYS}, "
                             f"got {self.pending_replay!r}")
        if self.evict not in ("", "evict_first", "evict_last"):
            raise ValueError(f"VerifyConfig: evict must be '', 'evict_first' or 'evict_last', got {self.evict!r}")


@jit
def verify_prep_kernel(
    q_ptr,  # [N, D, H, K] (or [L, N, D, H, K], read at layer: see XS; likewise every input)
    k_ptr,  # [N, D, H, K]
    a_ptr,  # [N, D, HV]
    b_ptr,  # [N, D, HV]
    A_log_ptr,  # [HV]
    dt_bias_ptr,  # [HV]
    layer_ptr,  # [1] i32: the stacked inputs' layer
    rows_ptr,  # [N] i32 (INTO) | [1]
    tape_layer_ptr,  # [1] i32: the tape buffer's layer
    kbuf_in_ptr,  # the k buffer as an input (aliased with kbuf_ptr; not read) | [1]
    gbuf_in_ptr,  # likewise g
    qn_ptr,  # [N, D, H, K] f32: l2norm(q) * SCALE
    kn_ptr,  # [N, D, H, K] f32: l2norm(k), the tape's k
    g_ptr,  # [N, D, HV] f32, the tape's g
    beta_ptr,  # [N, D, HV] f32
    kbuf_ptr,  # INTO: [L, R, DMAX, H, K] f32, the tape buffer's k (aliased) | [1]
    gbuf_ptr,  # INTO: [L, R, DMAX, HV] f32, its g (aliased) | [1]
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    BK: tl.constexpr,
    PH: tl.constexpr,  # q/k heads per program
    BR: tl.constexpr,  # their v-heads, padded to a power of 2
    SCALE: tl.constexpr,
    INTERPRET: tl.constexpr,
    INTO: tl.constexpr = False,  # also write k and g at [tape_layer, rows[n], t] of the buffers
    R: tl.constexpr = 1,  # rows of the buffers
    DMAX: tl.constexpr = 1,  # their steps
    XN: tl.constexpr = 0,  # the requests per layer of stacked inputs
    XS: tl.constexpr = 0,  # which inputs are stacked over layers: bits q 1, k 2, a 4, b 8, A_log 16, dt_bias 32
):
    n = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    D = tl.num_programs(1)
    XS_: tl.constexpr = XS if XS else 0  # (None where the kernel is built without jax-triton)
    xl = tl.load(layer_ptr).to(tl.int64) if XS else 0  # the stacked inputs' layer
    nx = xl * XN + n if XS else n  # request n of that layer in a stacked input
    heads = tl.program_id(2) * PH + tl.arange(0, PH)
    offs_k = tl.arange(0, BK)
    m = (heads[:, None] < H) & (offs_k[None, :] < K)
    off = ((n * D + t) * H + heads[:, None]) * K + offs_k[None, :]
    xoff = ((nx * D + t) * H + heads[:, None]) * K + offs_k[None, :]
    q = _to_f32(tl.load(q_ptr + (xoff if XS_ & 1 else off), mask=m, other=0.0), INTERPRET)  # [PH, BK]
    k = _to_f32(tl.load(k_ptr + (xoff if XS_ & 2 else off), mask=m, other=0.0), INTERPRET)
    # Correctly rounded sqrt and division, as XLA computes them (Triton's defaults are
    # approximate); 1e-6 is reference.L2NORM_EPS (Triton kernels read no plain Python globals).
    q_norm = tl.math.sqrt_rn(tl.sum(q * q, axis=1) + 1e-6)
    k_norm = tl.math.sqrt_rn(tl.sum(k * k, axis=1) + 1e-6)
    tl.store(qn_ptr + off, tl.math.div_rn(q, tl.broadcast_to(q_norm[:, None], (PH, BK))) * SCALE, mask=m)
    kn = tl.math.div_rn(k, tl.broadcast_to(k_norm[:, None], (PH, BK)))
    tl.store(kn_ptr + off, kn, mask=m)
    if INTO:
        row = tl.load(rows_ptr + n).to(tl.int64)
        row_ok = (row >= 0) & (row < R)
        lead = tl.load(tape_layer_ptr).to(tl.int64) * R + tl.where(row_ok, row, 0)
        tl.store(kbuf_ptr + ((lead * DMAX + t) * H + heads[:, None]) * K + offs_k[None, :], kn, mask=m & row_ok)

    hv = tl.program_id(2) * PH * (HV // H) + tl.arange(0, BR)
    m_hv = (tl.arange(0, BR) < PH * (HV // H)) & (hv < HV)
    ab = (n * D + t) * HV + hv
    xab = (nx * D + t) * HV + hv
    a = _to_f32(tl.load(a_ptr + (xab if XS_ & 4 else ab), mask=m_hv, other=0.0), INTERPRET)
    b = _to_f32(tl.load(b_ptr + (xab if XS_ & 8 else ab), mask=m_hv, other=0.0), INTERPRET)
    A_log = _to_f32(tl.load(A_log_ptr + (xl * HV + hv if XS_ & 16 else hv), mask=m_hv, other=0.0), INTERPRET)
    dt_bias = _to_f32(tl.load(dt_bias_ptr + (xl * HV + hv if XS_ & 32 else hv), mask=m_hv, other=0.0), INTERPRET)
    # 20 is reference.SOFTPLUS_THRESHOLD.
    x = a + dt_bias
    softplus = tl.where(x > 20.0, x, _log(1.0 + _exp(x, INTERPRET), INTERPRET))
    g = -_exp(A_log, INTERPRET) * softplus
    tl.store(g_ptr + ab, g, mask=m_hv)
    if INTO:
        tl.store(gbuf_ptr + (lead * DMAX + t) * HV + hv, g, mask=m_hv & row_ok)
    tl.store(beta_ptr + ab, tl.math.div_rn(tl.full([BR], 1.0, tl.float32), 1.0 + _exp(-b, INTERPRET)), mask=m_hv)


@jit
def _load(ptr, mask, MASKED: tl.constexpr, EVICT: tl.constexpr):
    """A load, masked only where the tile overhangs the array (a mask can stop vectorisation)."""
    if MASKED:
        return tl.load(ptr, mask=mask, other=0.0, eviction_policy=EVICT)
    else:
        return tl.load(ptr, eviction_policy=EVICT)


@jit
def _store(ptr, value, mask, MASKED: tl.constexpr, EVICT: tl.constexpr):
    if MASKED:
        tl.store(ptr, value, mask=mask, eviction_policy=EVICT)
    else:
        tl.store(ptr, value, eviction_policy=EVICT)


@jit
def _step_inputs(qn_ptr, kn_ptr, v_ptr, g_ptr, beta_ptr, n, nv, t, h, hv, rows, kidx, m_v, m_k,
                 D: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, V: tl.constexpr, K: tl.constexpr,
                 BV: tl.constexpr, NC: tl.constexpr, C: tl.constexpr, MASK_V: tl.constexpr, MASK_K: tl.constexpr,
                 INTERPRET: tl.constexpr, CHANNEL: tl.constexpr):  # fmt: skip
    """Step t's q and k, v (``[BV]``), decay (a scalar; ``CHANNEL``: KDA's, a ``[BV, K / C, C]``
    tile of each column's ``exp(g[c])``, laid out as k) and beta.

    q and k are loaded as whole ``[BV, K / C, C]`` tiles (each row the same addresses), so
    that they take the state tile's layout (lanes across rows and columns): loaded as
    ``[1, K / C, C]`` rows, Triton lays them out with the lanes across the chunks and then
    holds the state that way too (the reductions cross 5 lane levels for each row).
    """
    qk = tl.broadcast_to(((n * D + t) * H + h) * K + kidx, (BV, NC, C))
    q = _load(qn_ptr + qk, m_k, MASK_K, "")
    k = _load(kn_ptr + qk, m_k, MASK_K, "")
    v = _to_f32(_load(v_ptr + ((nv * D + t) * HV + hv) * V + rows, m_v, MASK_V, ""), INTERPRET)
    gt = (n * D + t) * HV + hv
    alpha = _decay(g_ptr, gt, tl.broadcast_to(kidx, (BV, NC, C)), m_k, K, CHANNEL, INTERPRET)
    return q, k, v, alpha, tl.load(beta_ptr + gt)


@jit
def _bfly(x, M: tl.constexpr, W: tl.constexpr):
    """``x [R, W]`` with lane ``l`` taking lane ``l ^ M``'s values (the last axis is the lanes of
    :func:`_chain_rows`; Triton builds this gather as warp shuffles)."""
    return tl.gather(x, tl.broadcast_to((tl.arange(0, W) ^ M)[None, :], x.shape), 1)


@jit
def _halves(P, R: tl.constexpr, W: tl.constexpr):
    """``P [R, W]`` split into its rows ``[0, R / 2)`` and ``[R / 2, R)``."""
    return tl.split(tl.permute(tl.reshape(P, (2, R // 2, W)), (1, 2, 0)))


@jit
def _row_sums(X, Y, BV: tl.constexpr, W: tl.constexpr, E: tl.constexpr, LOG_E: tl.constexpr, LOG_BV: tl.constexpr,
              LOG_G: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """``sum_k X * Y`` of two ``[BV, W * E]`` tiles, as ``[1, W]``: lane ``l`` holds row
    ``l // (W / BV)``'s sum. Each lane's ``E`` columns first (products in pairs, the second
    fused into the first with the pinned fma, then a tree), then ``log2(BV)`` butterfly levels
    that each send half the rows a lane holds and keep the other half (``BV - 1`` shuffles in
    all, not ``log2(W)`` a row), then ``log2(W / BV)`` that add. The order is fixed by these
    tensor operations, the same compiled or interpreted."""
    if E > 1:
        x0, x1 = tl.split(tl.reshape(X, (BV, W, E // 2, 2)))
        y0, y1 = tl.split(tl.reshape(Y, (BV, W, E // 2, 2)))
        P = _fma(x1, y1, x0 * y0, INTERPRET)  # [BV, W, E / 2]
        for i in tl.static_range(LOG_E - 1):  # the pairs' sums as a tree
            a, b = tl.split(tl.reshape(P, (BV, W, E >> (i + 2), 2)))
            P = a + b
        P = tl.reshape(P, (BV, W))
    else:
        P = tl.reshape(X * Y, (BV, W))
    lane = tl.arange(0, W)[None, :]
    for j in tl.static_range(LOG_BV):
        M = W >> (j + 1)
        lo, hi = _halves(P, BV >> j, W)
        b = ((lane // M) & 1) == 1
        P = tl.where(b, hi, lo) + _bfly(tl.where(b, lo, hi), M, W)
    for j in tl.static_range(LOG_G):
        P = P + _bfly(P, (W // BV) >> (j + 1), W)
    return P


@jit
def _all_rows(x, BV: tl.constexpr, W: tl.constexpr, E: tl.constexpr):
    """``x [1, W]`` as :func:`_row_sums` leaves it (lane ``l`` holds row ``l // (W / BV)``) to a
    ``[BV, W * E]`` tile of row ``r``'s value across row ``r``, in every lane: one gather, each
    row's value read from the first lane holding it (``BV`` independent shuffles)."""
    idx = tl.broadcast_to((tl.arange(0, BV) * (W // BV))[:, None], (BV, W))
    X = tl.gather(tl.broadcast_to(x, (BV, W)), idx, 1)
    return tl.reshape(tl.broadcast_to(tl.reshape(X, (BV, W, 1)), (BV, W, E)), (BV, W * E))


@jit
def verify_kernel(
    # inputs
    state_ptr,  # [L, S, HV, V, K] f32 | bf16, read at [layer, slots[n]]
    slots_ptr,  # [N] i32
    layer_ptr,  # [1] i32
    tape_layer_ptr,  # [1] i32
    qn_ptr,  # [N, D, H, K] f32 (verify_prep_kernel)
    kn_ptr,  # [N, D, H, K] f32
    v_ptr,  # [N, D, HV, V] (or [L, N, D, HV, V] with XN = N: read at layer)
    g_ptr,  # [N, D, HV] f32, or [N, D, HV, K] with CHANNEL (KDA)
    beta_ptr,  # [N, D, HV] f32
    rows_ptr,  # [N] i32 (INTO) | [1]
    buf_in_ptr,  # the tape buffer as an input (INTO; aliased with snap_ptr or u_ptr, not read) | [1]
    prows_ptr,  # PENDING: the previous step's commit per request: rows, steps, track slots, track steps [N] i32
    psteps_ptr,
    ptslots_ptr,
    ptsteps_ptr,
    player_ptr,  # [1] i32: the previous tape's layer
    pu_ptr,  # PENDING 1: the previous tape's u [L', PR, PD, HV, V], k [L', PR, PD, H, K], g [L', PR, PD, HV] (or
    # [L', PR, PD, HV, K] with PCHANNEL) | [1]
    pk_ptr,
    pg_ptr,
    pstates_ptr,  # PENDING 2: the previous snapshots [L', PR, PD, HV, V, K] | [1]
    out_layer_ptr,  # [1] i32: the outputs buffer's layer
    out_in_ptr,  # the outputs buffer as an input (ON; aliased with out_ptr, not read) | [1]
    # outputs
    out_ptr,  # [N, D, HV, V] out dtype, or ON the buffer [L', N, D, HV, V]
    snap_ptr,  # snapshots: [N, D, HV, V, K] state dtype, or INTO the buffer [L, R, DMAX, HV, V, K] | [1]
    u_ptr,  # tuples: [N, D, HV, V] f32, or INTO the buffer [L, R, DMAX, HV, V] | [1]
    pool_out_ptr,  # PENDING: the pool again (aliased with state_ptr) | [1]
    # sizes and switches
    NS: tl.constexpr,  # the pool's slots
    D: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    V: tl.constexpr,
    K: tl.constexpr,
    BV: tl.constexpr,
    C: tl.constexpr,  # columns per chunk
    NC: tl.constexpr,  # chunks (NC * C >= K)
    SNAPSHOTS: tl.constexpr,
    TILES_FIRST: tl.constexpr,
    EVICT: tl.constexpr,
    INTERPRET: tl.constexpr,
    INTO: tl.constexpr = False,  # the tape goes to [tape_layer, rows[n]] of a buffer of R rows
    R: tl.constexpr = 1,
    DMAX: tl.constexpr = 1,  # the tape's steps per row: the buffer's (INTO), else D
    PENDING: tl.constexpr = 0,  # the previous step's commit first: 0 none, 1 a tuple tape, 2 snapshots
    PR: tl.constexpr = 1,  # the previous tape's rows
    PD: tl.constexpr = 1,  # and steps
    PREFETCH: tl.constexpr = False,  # the pending tuple tape's lines asked of L2 first (VerifyConfig.prefetch_pending)
    ROWS: tl.constexpr = False,  # a pending tuple commit replayed on a [BV, K] tile (VerifyConfig.pending_replay)
    KP: tl.constexpr = 1,  # K rounded up to a power of two (ROWS)
    PDP: tl.constexpr = 1,  # PD rounded up to a power of two (PREFETCH)
    KL: tl.constexpr = 1,  # the 128-byte lines of a k row, rounded up to a power of two (PREFETCH)
    XN: tl.constexpr = 0,  # v stacked over layers: its requests per layer (0: not stacked)
    ON: tl.constexpr = 0,  # the outputs go to [out_layer, n] of a buffer of ON requests (0: fresh outputs)
    LANES: tl.constexpr = 0,  # the rows chain's lanes (VerifyConfig.chain="rows"; 0: the chunk chain)
    LOG_E: tl.constexpr = 0,  # log2 of its columns a lane (KP / LANES), rows (BV), lanes a row (LANES / BV)
    LOG_BV: tl.constexpr = 0,
    LOG_G: tl.constexpr = 0,
    UNROLL: tl.constexpr = False,  # the rows chain's steps unrolled (VerifyConfig.unroll)
    CHANNEL: tl.constexpr = False,  # g per key channel (KDA, g [N, D, HV, K]; from its rank): column c decays by exp(g[c])
    PCHANNEL: tl.constexpr = False,  # likewise the pending tuple tape's g (from its rank)
):
    if TILES_FIRST:
        i_v = tl.program_id(0)
        n = tl.program_id(2).to(tl.int64)
    else:
        i_v = tl.program_id(2)
        n = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    h = hv // (HV // H)

    rows = i_v * BV + tl.arange(0, BV)
    m_v = rows < V

    # The state by slot (SGLang's h0_indices): zeros for a slot outside [0, S).
    slot = tl.load(slots_ptr + n).to(tl.int64)
    slot_ok = (slot >= 0) & (slot < NS)
    layer = tl.load(layer_ptr).to(tl.int64)
    slot = tl.where(slot_ok, slot, 0)
    base = (layer * NS + slot) * HV + hv
    if INTO:  # the tape's row in the buffer; an out-of-range row writes nothing
        row = tl.load(rows_ptr + n).to(tl.int64)
        row_ok = (row >= 0) & (row < R)
        lead = tl.load(tape_layer_ptr).to(tl.int64) * R + tl.where(row_ok, row, 0)
    else:
        lead = n
        row_ok = n >= 0
    nv = layer * XN + n if XN else n  # request n of the layer in a stacked v
    no = tl.load(out_layer_ptr).to(tl.int64) * ON + n if ON else n  # request n's outputs
    if LANES:
        _chain_rows(state_ptr, qn_ptr, kn_ptr, v_ptr, g_ptr, beta_ptr, prows_ptr, psteps_ptr, ptslots_ptr, ptsteps_ptr,
                    player_ptr, pu_ptr, pk_ptr, pg_ptr, pstates_ptr, out_ptr, snap_ptr, u_ptr, pool_out_ptr, n, h, hv,
                    i_v, layer, slot, slot_ok, base, lead, row_ok, nv, no, rows, m_v, NS, D, H, HV, V, K, BV, SNAPSHOTS,
                    EVICT, INTERPRET, INTO, DMAX, PENDING, PR, PD, PREFETCH, KP, PDP, KL, LANES, LOG_E, LOG_BV,
                    LOG_G, UNROLL, CHANNEL, PCHANNEL)  # fmt: skip
    else:
        _chain_chunks(state_ptr, qn_ptr, kn_ptr, v_ptr, g_ptr, beta_ptr, prows_ptr, psteps_ptr, ptslots_ptr,
                      ptsteps_ptr, player_ptr, pu_ptr, pk_ptr, pg_ptr, pstates_ptr, out_ptr, snap_ptr, u_ptr,
                      pool_out_ptr, n, h, hv, i_v, layer, slot, slot_ok, base, lead, row_ok, nv, no, rows, m_v, NS, D, H,
                      HV, V, K, BV, C, NC, SNAPSHOTS, EVICT, INTERPRET, INTO, DMAX, PENDING, PR, PD, PREFETCH, ROWS, KP,
                      PDP, KL, CHANNEL, PCHANNEL)  # fmt: skip


@jit
def _chain_chunks(state_ptr, qn_ptr, kn_ptr, v_ptr, g_ptr, beta_ptr, prows_ptr, psteps_ptr, ptslots_ptr, ptsteps_ptr,
                  player_ptr, pu_ptr, pk_ptr, pg_ptr, pstates_ptr, out_ptr, snap_ptr, u_ptr, pool_out_ptr, n, h, hv, i_v,
                  layer, slot, slot_ok, base, lead, row_ok, nv, no, rows, m_v, NS: tl.constexpr, D: tl.constexpr,
                  H: tl.constexpr, HV: tl.constexpr, V: tl.constexpr, K: tl.constexpr, BV: tl.constexpr,
                  C: tl.constexpr, NC: tl.constexpr, SNAPSHOTS: tl.constexpr, EVICT: tl.constexpr,
                  INTERPRET: tl.constexpr, INTO: tl.constexpr, DMAX: tl.constexpr, PENDING: tl.constexpr,
                  PR: tl.constexpr, PD: tl.constexpr, PREFETCH: tl.constexpr, ROWS: tl.constexpr, KP: tl.constexpr,
                  PDP: tl.constexpr, KL: tl.constexpr, CHANNEL: tl.constexpr, PCHANNEL: tl.constexpr):  # fmt: skip
    """The chain on ``[BV, K / C, C]`` chunks (``VerifyConfig.chain="chunks"``), step t + 1's inputs
    loaded during step t."""
    kidx = tl.arange(0, NC)[None, :, None] * C + tl.arange(0, C)[None, None, :]  # [1, NC, C]
    m_k = kidx < K
    tile = rows[:, None, None] * K + kidx  # [BV, NC, C]
    m_tile = m_v[:, None, None] & m_k
    MASK_V: tl.constexpr = V % BV != 0
    MASK_K: tl.constexpr = NC * C != K
    MASK_TILE: tl.constexpr = MASK_V or MASK_K
    if ROWS and PENDING == 1:  # the pending tuple commit first, then the state the pool now holds
        _apply_pending_rows(pool_out_ptr, prows_ptr, psteps_ptr, ptslots_ptr, ptsteps_ptr, player_ptr, pu_ptr, pk_ptr,
                            pg_ptr, n, h, hv, i_v, layer, slot, slot_ok, rows, m_v, NS, H, HV, V, K, BV, KP, PR, PD,
                            PREFETCH, PDP, KL, EVICT, INTERPRET, False, PCHANNEL)  # fmt: skip
        S = _to_f32(tl.load(pool_out_ptr + base * V * K + tile, mask=m_tile & slot_ok, other=0.0,
                            eviction_policy=EVICT), INTERPRET)  # fmt: skip
    else:
        S = _to_f32(tl.load(state_ptr + base * V * K + tile, mask=m_tile & slot_ok, other=0.0, eviction_policy=EVICT),
                    INTERPRET)  # fmt: skip
    # (an unset constexpr reads as None where the kernel is built without jax-triton)
    if PENDING and not (ROWS and PENDING == 1):
        S = _apply_pending(S, pool_out_ptr, prows_ptr, psteps_ptr, ptslots_ptr, ptsteps_ptr, player_ptr, pu_ptr, pk_ptr,
                           pg_ptr, pstates_ptr, n, h, hv, i_v, layer, slot, slot_ok, rows, kidx, tile, m_v, m_k, m_tile,
                           NS, H, HV, V, K, BV, NC, C, PR, PD, PENDING, PREFETCH, PDP, KL, INTERPRET,
                           PCHANNEL)  # fmt: skip
    q, k, v, alpha, beta = _step_inputs(qn_ptr, kn_ptr, v_ptr, g_ptr, beta_ptr, n, nv, 0, h, hv, rows, kidx, m_v,
                                        m_k, D, H, HV, V, K, BV, NC, C, MASK_V, MASK_K, INTERPRET, CHANNEL)  # fmt: skip
    for t in range(D):
        # step t + 1's inputs, in flight during this step
        q1, k1, v1, alpha1, beta1 = _step_inputs(qn_ptr, kn_ptr, v_ptr, g_ptr, beta_ptr, n, nv, tl.minimum(t + 1, D - 1),
                                                 h, hv, rows, kidx, m_v, m_k, D, H, HV, V, K, BV, NC, C, MASK_V,
                                                 MASK_K, INTERPRET, CHANNEL)  # fmt: skip
        Sd = S * alpha  # alpha a scalar, or (CHANNEL) each column's own factor: one rounded multiply
        u = beta * (v - tl.sum(tl.sum(Sd * k, axis=1), axis=1))  # [BV]: the chunks in registers, then C's lanes
        S = _fma(tl.broadcast_to(k, S.shape), tl.broadcast_to(u[:, None, None], S.shape), Sd, INTERPRET)
        o = tl.sum(tl.sum(S * q, axis=1), axis=1)
        _store(out_ptr + ((no * D + t) * HV + hv) * V + rows, _from_f32(o, out_ptr.dtype.element_ty, INTERPRET), m_v,
               MASK_V, "")  # fmt: skip
        at = (lead * DMAX + t) * HV + hv
        if SNAPSHOTS:
            _store(snap_ptr + at * V * K + tile, _from_f32(S, snap_ptr.dtype.element_ty, INTERPRET), m_tile & row_ok,
                   MASK_TILE or INTO, EVICT)  # fmt: skip
        else:
            _store(u_ptr + at * V + rows, u, m_v & row_ok, MASK_V or INTO, "")
        q, k, v, alpha, beta = q1, k1, v1, alpha1, beta1


@jit
def _row_inputs(qn_ptr, kn_ptr, v_ptr, g_ptr, beta_ptr, n, nv, t, h, hv, cols, my_row, D: tl.constexpr,
                H: tl.constexpr, HV: tl.constexpr, V: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                INTERPRET: tl.constexpr, CHANNEL: tl.constexpr):  # fmt: skip
    """Step t's q and k (``[KP]``: one lane's columns each, no copies), each lane's row of v
    (``[1, W]``), decay (a scalar; ``CHANNEL``: KDA's ``[1, KP]`` of each column's ``exp(g[c])``)
    and beta."""
    qk = ((n * D + t) * H + h) * K + cols
    q = _load(qn_ptr + qk, cols < K, KP != K, "")
    k = _load(kn_ptr + qk, cols < K, KP != K, "")
    v = _to_f32(tl.load(v_ptr + ((nv * D + t) * HV + hv) * V + my_row, mask=my_row < V, other=0.0), INTERPRET)
    gt = (n * D + t) * HV + hv
    alpha = _decay(g_ptr, gt, cols[None, :], (cols < K)[None, :], K, CHANNEL, INTERPRET)
    return q, k, v, alpha, tl.load(beta_ptr + gt)


@jit
def _chain_rows(state_ptr, qn_ptr, kn_ptr, v_ptr, g_ptr, beta_ptr, prows_ptr, psteps_ptr, ptslots_ptr, ptsteps_ptr,
                player_ptr, pu_ptr, pk_ptr, pg_ptr, pstates_ptr, out_ptr, snap_ptr, u_ptr, pool_out_ptr, n, h, hv, i_v,
                layer, slot, slot_ok, base, lead, row_ok, nv, no, rows, m_v, NS: tl.constexpr, D: tl.constexpr,
                H: tl.constexpr, HV: tl.constexpr, V: tl.constexpr, K: tl.constexpr, BV: tl.constexpr,
                SNAPSHOTS: tl.constexpr, EVICT: tl.constexpr, INTERPRET: tl.constexpr, INTO: tl.constexpr,
                DMAX: tl.constexpr, PENDING: tl.constexpr, PR: tl.constexpr, PD: tl.constexpr,
                PREFETCH: tl.constexpr, KP: tl.constexpr, PDP: tl.constexpr, KL: tl.constexpr,
                W: tl.constexpr, LOG_E: tl.constexpr, LOG_BV: tl.constexpr, LOG_G: tl.constexpr,
                UNROLL: tl.constexpr, CHANNEL: tl.constexpr, PCHANNEL: tl.constexpr):  # fmt: skip
    """The chain on a ``[BV, KP]`` tile with ``W`` lanes across K (``VerifyConfig.chain="rows"``):
    a step's q and k are ``KP / W`` registers a lane and loaded once, not once a row; each
    reduction over K is :func:`_row_sums`, and ``u`` reaches every lane's rows through
    :func:`_all_rows`. A pending tuple commit is replayed on the same tile, and the chain starts
    from the state it hands over (:func:`_apply_pending_rows`). Step t + 1's inputs are loaded
    during step t (:func:`_row_step`); ``UNROLL`` unrolls the steps."""
    E: tl.constexpr = KP // W
    cols = tl.arange(0, KP)
    m_c = cols < K
    tile = rows[:, None] * K + cols[None, :]
    m_tile = m_v[:, None] & m_c[None, :]
    if PENDING == 1:
        S = _apply_pending_rows(pool_out_ptr, prows_ptr, psteps_ptr, ptslots_ptr, ptsteps_ptr, player_ptr, pu_ptr,
                                pk_ptr, pg_ptr, n, h, hv, i_v, layer, slot, slot_ok, rows, m_v, NS, H, HV, V, K, BV, KP,
                                PR, PD, PREFETCH, PDP, KL, EVICT, INTERPRET, True, PCHANNEL)  # fmt: skip
    else:
        S = _to_f32(tl.load(state_ptr + base * V * K + tile, mask=m_tile & slot_ok, other=0.0, eviction_policy=EVICT),
                    INTERPRET)  # fmt: skip
        if PENDING == 2:  # the previous snapshots: the chunk chain's copy, on this tile
            S = _apply_pending(S, pool_out_ptr, prows_ptr, psteps_ptr, ptslots_ptr, ptsteps_ptr, player_ptr, pu_ptr,
                               pk_ptr, pg_ptr, pstates_ptr, n, h, hv, i_v, layer, slot, slot_ok, rows, cols, tile, m_v,
                               m_c, m_tile, NS, H, HV, V, K, BV, 1, KP, PR, PD, PENDING, PREFETCH, PDP, KL,
                               INTERPRET, PCHANNEL)  # fmt: skip
    lane = tl.arange(0, W)[None, :]
    G: tl.constexpr = W // BV
    my_row = i_v * BV + lane // G  # [1, W]: the row whose sums lane l holds
    m_mine = (my_row < V) & (lane % G == 0)  # one lane of each row stores it
    q, k, v, alpha, beta = _row_inputs(qn_ptr, kn_ptr, v_ptr, g_ptr, beta_ptr, n, nv, 0, h, hv, cols, my_row, D, H,
                                       HV, V, K, KP, INTERPRET, CHANNEL)  # fmt: skip
    if UNROLL:  # the steps unrolled: a step's output reduction may overlap the next step's chain
        for t in tl.static_range(D):
            S, q, k, v, alpha, beta = _row_step(S, q, k, v, alpha, beta, t, qn_ptr, kn_ptr, v_ptr, g_ptr, beta_ptr,
                                                out_ptr, snap_ptr, u_ptr, n, nv, no, h, hv, lead, row_ok, cols, my_row,
                                                m_mine, tile, m_tile, D, H, HV, V, K, BV, KP, SNAPSHOTS, EVICT,
                                                INTERPRET, INTO, DMAX, W, E, LOG_E, LOG_BV, LOG_G, CHANNEL)  # fmt: skip
    else:
        for t in range(D):
            S, q, k, v, alpha, beta = _row_step(S, q, k, v, alpha, beta, t, qn_ptr, kn_ptr, v_ptr, g_ptr, beta_ptr,
                                                out_ptr, snap_ptr, u_ptr, n, nv, no, h, hv, lead, row_ok, cols, my_row,
                                                m_mine, tile, m_tile, D, H, HV, V, K, BV, KP, SNAPSHOTS, EVICT,
                                                INTERPRET, INTO, DMAX, W, E, LOG_E, LOG_BV, LOG_G, CHANNEL)  # fmt: skip


@jit
def _row_step(S, q, k, v, alpha, beta, t, qn_ptr, kn_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, snap_ptr, u_ptr, n, nv, no, h,
              hv, lead, row_ok, cols, my_row, m_mine, tile, m_tile, D: tl.constexpr, H: tl.constexpr,
              HV: tl.constexpr, V: tl.constexpr, K: tl.constexpr, BV: tl.constexpr, KP: tl.constexpr,
              SNAPSHOTS: tl.constexpr, EVICT: tl.constexpr, INTERPRET: tl.constexpr, INTO: tl.constexpr,
              DMAX: tl.constexpr, W: tl.constexpr, E: tl.constexpr, LOG_E: tl.constexpr, LOG_BV: tl.constexpr,
              LOG_G: tl.constexpr, CHANNEL: tl.constexpr):  # fmt: skip
    """Step ``t`` of :func:`_chain_rows` from its state ``S`` and inputs: the output and the
    step's ``u`` (or snapshot) stored; returns the next state and step t + 1's inputs (loaded
    first)."""
    MASK_TILE: tl.constexpr = V % BV != 0 or KP != K
    q1, k1, v1, alpha1, beta1 = _row_inputs(qn_ptr, kn_ptr, v_ptr, g_ptr, beta_ptr, n, nv, tl.minimum(t + 1, D - 1), h,
                                            hv, cols, my_row, D, H, HV, V, K, KP, INTERPRET, CHANNEL)  # fmt: skip
    kb = tl.broadcast_to(k[None, :], S.shape)
    Sd = S * alpha  # alpha a scalar, or (CHANNEL) [1, KP]: each column's own factor, one rounded multiply
    u = beta * (v - _row_sums(Sd, kb, BV, W, E, LOG_E, LOG_BV, LOG_G, INTERPRET))  # [1, W]
    S = _fma(kb, _all_rows(u, BV, W, E), Sd, INTERPRET)
    o = _row_sums(S, tl.broadcast_to(q[None, :], S.shape), BV, W, E, LOG_E, LOG_BV, LOG_G, INTERPRET)
    tl.store(out_ptr + ((no * D + t) * HV + hv) * V + my_row, _from_f32(o, out_ptr.dtype.element_ty, INTERPRET),
             mask=m_mine)  # fmt: skip
    at = (lead * DMAX + t) * HV + hv
    if SNAPSHOTS:
        _store(snap_ptr + at * V * K + tile, _from_f32(S, snap_ptr.dtype.element_ty, INTERPRET), m_tile & row_ok,
               MASK_TILE or INTO, EVICT)  # fmt: skip
    else:
        tl.store(u_ptr + at * V + my_row, u, mask=m_mine & row_ok)
    return S, q1, k1, v1, alpha1, beta1


def launch_sizes(state_shape, q_shape, config: VerifyConfig, record="tuples"):
    """The chain kernel's constexpr sizes and its grid, from the shapes alone (``state_shape``:
    the pool ``[L, S, HV, V, K]``, or ``[N, HV, V, K]`` for the state0 form)."""
    HV, V, K = state_shape[-3:]
    S = state_shape[-4] if len(state_shape) == 5 else state_shape[0]
    N, D, H = q_shape[:3]
    BV = min(next_power_of_2(config.block_v), next_power_of_2(V))
    C = min(config.k_chunk, next_power_of_2(K))
    KP = next_power_of_2(K)
    # a record= name (the interpreter check's, without JAX) or the tape class
    stores_states = record == "snapshots" if isinstance(record, str) else record.stores_states
    tiles_first = (config.order or ("tiles" if stores_states else "requests")) == "tiles"
    sizes = {"NS": S, "D": D, "H": H, "HV": HV, "V": V, "K": K, "BV": BV, "C": C, "NC": -(-K // C),
             "TILES_FIRST": tiles_first, "KP": KP}  # fmt: skip
    if (config.chain or ("rows" if D <= ROWS_UP_TO else "chunks")) == "rows":  # W lanes across K (<= 32), BV <= W
        W = min(32, KP)
        BV = sizes["BV"] = min(BV, W)
        log2 = lambda x: x.bit_length() - 1  # noqa: E731 (powers of two)
        unroll = D <= UNROLL_UP_TO if config.unroll is None else config.unroll
        sizes |= {"LANES": W, "LOG_E": log2(KP // W), "LOG_BV": log2(BV), "LOG_G": log2(W // BV), "UNROLL": unroll}
    NV = -(-V // BV)
    return sizes, ((NV, HV, N) if tiles_first else (N, HV, NV))


def prep_launch(q_shape, HV: int, config: VerifyConfig):
    """The prologue's constexpr sizes and its grid."""
    N, D, H, K = q_shape
    PH = min(config.prep_heads, next_power_of_2(H))
    sizes = {"H": H, "HV": HV, "K": K, "BK": next_power_of_2(K), "PH": PH, "BR": next_power_of_2(PH * (HV // H))}
    return sizes, (N, D, -(-H // PH))


@functools.cache
def _jitted():
    import jax

    return jax.jit(_verify, static_argnames=("config",))


def verify(call, *, config: VerifyConfig = VerifyConfig()):
    """jax-triton verify of a checked :class:`~gdn_lossless_jax.backends.contract.VerifyCall`.

    The kernel reads each request's state at ``pool[layer, slots[n]]``. With a tape buffer
    (fields ``[L', R, Dmax, ...]``) the tape goes to ``[tape_layer, rows[n]]`` of it, in place
    (aliased). Returns ``(outputs [N, D, HV, V], fields)``: ``(states,)`` for snapshots,
    ``(u, k, g)`` for tuples (the fresh tape, or the updated buffer), and with ``pending`` (as in
    the Pallas backend) the pool as a third element. With ``out`` the outputs go to
    ``out[out_layer]``, in place (aliased), and the buffer comes back as the outputs.
    """
    return _jitted()(call, config=config)


def _prologue(call, layer, tape_layer, rows, config):
    """GDN's norms and gates by :func:`verify_prep_kernel`: ``(qn, kn, g, beta, kbuf, gbuf)``, the
    last two the tape buffer's k and g with this call's rows written in place (tuples into a
    buffer), else unused."""
    import jax
    import jax.numpy as jnp

    from ...reference import stacked

    jt = import_jax_triton()
    f32 = jnp.float32
    q, k, _, a, b, A_log, dt_bias = call.inputs
    tape = call.tape
    # inputs stacked over the pool's layers (by rank): read at `layer` in the kernel
    names = ("q", "k", "a", "b", "A_log", "dt_bias")
    XS = sum(1 << i for i, (n, x) in enumerate(zip(names, (q, k, a, b, A_log, dt_bias))) if stacked(n, x))
    N, D, H, K = q.shape[-4:]
    HV = call.pool.shape[2]
    unused = jax.ShapeDtypeStruct((1,), f32)
    dummy = jnp.zeros((1,), f32)
    sizes, grid = prep_launch(q.shape[-4:], HV, config)
    pre_into = tape is not None and not call.record.stores_states
    if pre_into:
        buf_sizes = dict(INTO=True, R=tape.u.shape[1], DMAX=tape.u.shape[2])
        bufs_in = (tape.k, tape.g)
        bufs_out = [jax.ShapeDtypeStruct(tape.k.shape, f32), jax.ShapeDtypeStruct(tape.g.shape, f32)]
    else:
        buf_sizes, bufs_in, bufs_out = {}, (dummy, dummy), [unused, unused]
    return jt.triton_call(
        q, k, a, b, A_log, dt_bias, layer, rows, tape_layer, *bufs_in,
        kernel=verify_prep_kernel,
        out_shape=[jax.ShapeDtypeStruct((N, D, H, K), f32)] * 2 + [jax.ShapeDtypeStruct((N, D, HV), f32)] * 2 + bufs_out,
        grid=grid,
        input_output_aliases={9: 4, 10: 5} if pre_into else {},
        enable_fp_fusion=False,
        num_warps=2 if sizes["PH"] > 1 else 1,
        num_stages=1,
        name="gdn_verify_prep",
        **sizes,
        **buf_sizes,
        SCALE=float(call.scale),
        INTERPRET=False,
        XN=N,
        XS=XS,
    )  # fmt: skip


def _verify(call, *, config):
    import jax
    import jax.numpy as jnp

    jt = import_jax_triton()

    i32, f32 = jnp.int32, jnp.float32
    state, slots, layer, pending = call.pool, call.slots, call.layer, call.pending
    q, v = call.q, call.v
    tape, tape_layer, rows, out, out_layer = call.tape, call.tape_layer, call.rows, call.out, call.out_layer
    record, out_dtype = call.record, jnp.dtype(call.out_dtype)  # record: the tape class
    N, D, H, K = q.shape[-4:]
    HV, V = state.shape[2], state.shape[3]
    snapshots = record.stores_states
    into = tape is not None
    unused = jax.ShapeDtypeStruct((1,), f32)
    dummy = jnp.zeros((1,), f32)
    as1 = lambda x: jnp.reshape(jnp.asarray(0 if x is None else x, i32), (1,))  # noqa: E731 (a reshape is free)
    layer, tape_layer = as1(layer), as1(tape_layer)
    rows = jnp.zeros((1,), i32) if rows is None else rows
    if call.decay == "channel":  # KDA: g [N, D, HV, K], the chain's CHANNEL (from g's rank)
        from ...reference import prepare_call  # (inside: the interpreter check loads this module without JAX)

        qn, kn, g, beta, kbuf, gbuf = prepare_call(call)  # the reference's program in XLA
    else:
        qn, kn, g, beta, kbuf, gbuf = _prologue(call, layer, tape_layer, rows, config)
    if into:
        buf = tape.states if snapshots else tape.u
        rec_shape = jax.ShapeDtypeStruct(buf.shape, buf.dtype)
        chain_sizes = dict(INTO=True, R=buf.shape[1], DMAX=buf.shape[2])
    else:
        buf = dummy
        rec_shape = jax.ShapeDtypeStruct((N, D, HV, V, K) if snapshots else (N, D, HV, V), state.dtype if snapshots else f32)
        chain_sizes = dict(DMAX=D)
    out_shape = (
        jax.ShapeDtypeStruct(out.shape if out is not None else (N, D, HV, V), out_dtype),
        rec_shape if snapshots else unused,
        unused if snapshots else rec_shape,
        jax.ShapeDtypeStruct(state.shape, state.dtype) if pending is not None else unused,
    )
    aliases = {10: 1 if snapshots else 2} if into else {}
    pend_sizes = {}
    if pending is None:
        pend_in = [rows] * 4 + [layer] + [dummy] * 4
    else:

        prev = pending.tape
        snap_prev = prev.stores_states
        lead = prev.states if snap_prev else prev.u
        fields = [dummy] * 3 + [prev.states] if snap_prev else [prev.u, prev.k, prev.g, dummy]
        pend_in = [pending.rows, pending.steps, pending.track_slots, pending.track_steps, as1(pending.layer), *fields]
        pend_sizes = dict(PENDING=2 if snap_prev else 1, PR=lead.shape[1], PD=lead.shape[2],
                          PREFETCH=config.prefetch_pending and not snap_prev, PDP=next_power_of_2(lead.shape[2]),
                          KL=next_power_of_2(-(-K // 32)),
                          ROWS=config.pending_replay == "rows",
                          PCHANNEL=not snap_prev and prev.g.ndim == 5)  # a KDA tape: g [L', PR, PD, HV, K]
        aliases[0] = 3
    out_in = [dummy] * 2 if out is None else [as1(out_layer), out]
    inputs = [state, slots, layer, tape_layer, qn, kn, v, g, beta, rows, buf, *pend_in, *out_in]
    if out is not None:
        aliases[len(inputs) - 1] = 0  # the outputs buffer, the last input
    sizes, grid = launch_sizes(state.shape, q.shape[-4:], config, record)
    out, snap, u, new_pool = jt.triton_call(
        *inputs,
        kernel=verify_kernel,
        out_shape=out_shape,
        grid=grid,
        input_output_aliases=aliases,
        enable_fp_fusion=False,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        name=f"gdn_verify_{record.mode}",
        **sizes,
        **chain_sizes,
        **pend_sizes,
        SNAPSHOTS=snapshots,
        EVICT=config.evict,
        INTERPRET=False,
        XN=N if v.ndim == 5 else 0,
        ON=0 if out is None else N,
        CHANNEL=g.ndim == 4,
    )  # fmt: skip
    fields = (snap,) if snapshots else ((u, kbuf, gbuf) if into else (u, kn, g))
    return (out, fields) if pending is None else (out, fields, new_pool)
