"""The ``mosaic`` backend: verify, and the commit fused into it, on Pallas' Mosaic GPU backend.

A persistent kernel (:mod:`.kernel`) that holds each ``[64, K]`` state tile in the WGMMA
register layout and brings the next tile's state and inputs into shared memory by TMA while it
computes this one; with ``pending`` it replays the previous step's tuple commit first, stores
the accepted and track states in place, and verifies from the accepted state, reading each
state once. The q/k norms and gates come from the Pallas backend's prologue kernel, and
``commit`` and ``replay`` are the Pallas backend's (the rule is pinned there too, so the bits
are the same: a commit does not depend on a backend's reduction order).

It runs GDN (one decay per v-head and step) and KDA (``decay="channel"``, :mod:`gdn_lossless_jax.kda`:
one decay per key channel). For KDA the q/k norms and gates are computed in XLA
(:func:`gdn_lossless_jax.reference.prepare`; the tape's ``k`` and ``g`` scattered into a tape
buffer by XLA), the kernel decays each state tile column by column (element ``[v, c]`` by
``exp(g[c])``, one rounded multiply, then the same pinned fma), in the chain and in the fused
replay of a pending :class:`~gdn_lossless_jax.tape.KDATuples` tape; ``commit`` and ``replay`` are the
Pallas backend's for KDA too. The Gram verify
(``VerifyConfig.verify="gram"``) is GDN's only and refuses KDA. KDA ran on an H100 (bit-exact against its own
snapshot path at Kimi-Linear-48B's heads), not on an H200.

Where it runs: CUDA GPUs of compute capability 9.0 or later (TMA, WGMMA; Hopper), and in
Mosaic GPU's interpret mode on a CPU (tests, CI). On ROCm or an older NVIDIA GPU use ``pallas``
or ``triton``. Shapes on the GPU: ``V`` a multiple of 64, ``K`` a multiple of 32 (64 for a
bfloat16 pool) and ``HV`` of 4. Run on a GPU with jax 0.11.2; under jax 0.12 (CI's) it lowers
for CUDA, bf16 outputs staged in shared memory (``VerifyConfig.outputs``), but is untested on a GPU.

A pending commit whose tape holds snapshots is committed first (the Pallas scatter of that one
layer, in place in the donated pool) and then verified: bit for bit the same, not fused.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ...reference import stacked as is_stacked
from ..contract import Capabilities, VerifyCall
from .. import BackendUnavailable, platform
from .. import pallas as _pallas
from ..pallas.commit import commit_snapshots
from ..pallas.prologue import gram_prep, prep
from ... import reference as ref
from .kernel import CONTROL_FORMS, CONTROLS, FORMS, VERIFIES, Geometry, build, coef_shape, smem_bytes

__all__ = ["name", "capabilities", "CONTROLS", "CONTROL_FORMS", "FORMS", "OUTPUTS", "VERIFIES", "VerifyConfig",
           "check_available", "commit", "conv_kernels", "replay", "verify"]  # fmt: skip

name = "mosaic"
#: Both record modes (a pending snapshot commit is the Pallas scatter, then the verify: not fused);
#: chains only; the platform's math; on a GPU the kernel's tiles need V a multiple of 64, K of 32
#: (of 64 for a bfloat16 pool: checked by the kernel) and HV of 4; GDN's decay and KDA's per-channel one.
# beta_scale and powers_of_two: the prologue is the Pallas backend's (Pallas Triton loads whole [K] rows).
capabilities = Capabilities(multiples={"V": 64, "K": 32, "HV": 4}, control_forms=CONTROL_FORMS, beta_scale=True,
                            powers_of_two=("K",), decays=("scalar", "channel"))  # fmt: skip

SMEM_PER_SM = 227 * 1024  # Hopper (sm_90): the shared memory an SM offers its CTAs
GPU_ROWS = 64  # rows of a tile: the WGMMA layout's
_NUM_SMS_INTERPRET = 1  # interpret mode: SMs simulated (ctas x this CTAs, enough to stride the tiles)
REPLAYS = ("loop", "static")
OUTPUTS = ("smem", "registers")


@dataclasses.dataclass(frozen=True)
class VerifyConfig:
    """The kernel's launch. Only ``form``, ``control`` and ``verify`` change the arithmetic.

    Attributes:
      ctas: persistent CTAs an SM (each one warpgroup).
      small_slots: shared-memory copies of a tile's step inputs, 2 (the next tile's arrive
        while this one computes) or 1 (copied at each tile's start); None: 2 where ``ctas``
        CTAs of two fit an SM's shared memory, else 1.
      replay: how a pending tuple commit is replayed: ``"loop"``, a loop to the accepted step
        (then on to a later track step), or ``"static"``, all D previous steps unrolled, the
        accepted state selected at its step. The same bits either way.
      form: the rule's rounding (:data:`FORMS`; None: ``"pinned"`` on the GPU, ``"portable"``
        in interpret mode) or, in tests, a control (:data:`CONTROL_FORMS`).
      control: tests only: a wrong ordering of the fused commit (:data:`CONTROLS`).
      outputs: how a tile's outputs leave: ``"registers"`` (each step's, from registers) or
        ``"smem"`` (staged in shared memory, stored by TMA after the tile's D steps). None:
        ``"registers"``, except outputs narrower than 4 bytes under jax 0.12, whose Mosaic GPU
        refuses that store. The same bits either way.
      auto_barriers: keep Pallas' automatic warpgroup barriers around every load and store
        (``plgpu.CompilerParams(unsafe_no_auto_barriers=False)``); the kernel orders its shared
        memory itself (``kernel.build`` says how), so by default they are left out.
      verify: how the D new steps are computed (:data:`VERIFIES`): ``"chain"``, step after step,
        or ``"gram"``, the Pallas backend's Gram form (products of the starting state first, then
        the small recurrence). Its ``u`` differs from the chain's in the low bits; the tape stays
        exact against its own commit. GDN only: its coefficients fold one scalar decay a step, so
        a KDA call (``decay="channel"``) with ``"gram"`` raises ``ValueError``.
      prefetch_next_layer: each CTA, when done, prefetches into L2 (by TMA) the state tile it
        would take first from the pool's next layer (a hint: the same bits). None: with a
        pending tuple commit (the fused kernel) only.
    """

    ctas: int = 2
    small_slots: int | None = None
    form: str | None = None
    replay: str = "loop"
    control: str | None = None
    outputs: str | None = None
    auto_barriers: bool = False
    verify: str = "chain"
    prefetch_next_layer: bool | None = None

    def __post_init__(self):
        if self.ctas < 1:
            raise ValueError(f"mosaic VerifyConfig: ctas must be >= 1, got {self.ctas}")
        if self.small_slots not in (None, 1, 2):
            raise ValueError(f"mosaic VerifyConfig: small_slots must be 1, 2 or None, got {self.small_slots}")
        if self.replay not in REPLAYS:
            raise ValueError(f"mosaic VerifyConfig: replay must be one of {REPLAYS}, got {self.replay!r}")
        if self.control not in (None, *CONTROLS):
            raise ValueError(f"mosaic VerifyConfig: control must be None or one of {CONTROLS}, got {self.control!r}")
        if self.outputs not in (None, *OUTPUTS):
            raise ValueError(f"mosaic VerifyConfig: outputs must be None or one of {OUTPUTS}, got {self.outputs!r}")
        if self.verify not in VERIFIES:
            raise ValueError(f"mosaic VerifyConfig: verify must be one of {VERIFIES}, got {self.verify!r}")
        if self.prefetch_next_layer not in (None, True, False):
            raise ValueError(f"mosaic VerifyConfig: prefetch_next_layer must be None, True or False, got "
                             f"{self.prefetch_next_layer!r}")  # fmt: skip
        if self.form == "naive":  # the control's name before it was made wrong by construction
            warnings.warn("mosaic VerifyConfig: form='naive' is deprecated (kept for one release): the control is "
                          "named 'twice_rounded'", DeprecationWarning, stacklevel=3)  # fmt: skip
            object.__setattr__(self, "form", "twice_rounded")
        if self.form not in (None, *FORMS, *CONTROL_FORMS):
            raise ValueError(f"mosaic VerifyConfig: form must be one of {FORMS + CONTROL_FORMS}, got {self.form!r}")


def _compute_capability() -> tuple[int, int] | None:
    cc = getattr(jax.devices()[0], "compute_capability", None)
    try:
        return tuple(int(x) for x in str(cc).split(".")[:2])
    except ValueError:
        return None


def conv_kernels():
    """None: the conv runs in XLA (:mod:`gdn_lossless_jax.conv`)."""
    return None


def check_available(op: str, math: str = "platform") -> None:
    """Raise :class:`BackendUnavailable` unless Mosaic GPU can run here (or interpret on a CPU)."""
    p = platform()
    alternatives = "Alternatives: 'pallas' or 'triton' (any CUDA or ROCm GPU), 'reference' (any platform)."
    if p == "cpu":
        return
    if p != "gpu":
        raise BackendUnavailable(f"{op}: backend 'mosaic' runs on CUDA GPUs (or in interpret mode on a CPU), "
                                 f"not on platform {p!r}. {alternatives}")  # fmt: skip
    cc = _compute_capability()
    if cc is None or cc < (9, 0):
        kind = jax.devices()[0].device_kind
        raise BackendUnavailable(
            f"{op}: backend 'mosaic' needs a CUDA GPU of compute capability 9.0 or later (TMA, Mosaic GPU); "
            f"this is {kind!r} (compute capability {cc}). {alternatives}"
        )
    try:
        from jax.experimental.pallas import mosaic_gpu  # noqa: F401
    except ImportError as e:
        raise BackendUnavailable(f"{op}: backend 'mosaic' needs Pallas Mosaic GPU, which this JAX "
                                 f"({jax.__version__}) lacks: {e}. {alternatives}") from e  # fmt: skip


def _jax_version() -> tuple[int, ...]:
    return tuple(int(x) for x in jax.__version__.split(".")[:2])


def _interpret() -> bool:
    return platform() == "cpu"


def _i32(x):
    return jnp.asarray(x, jnp.int32)


def _scalar(x):
    return jnp.reshape(_i32(0 if x is None else x), ())


def _geometry(N, D, H, HV, V, K, state_dtype, v, out_dtype, *, out_into, snapshots, into, PD, config,
              thread_pool=False, channel=False):  # fmt: skip
    interpret = _interpret()
    R = min(GPU_ROWS, V) if interpret else GPU_ROWS
    sd = jnp.dtype(state_dtype)
    if not interpret:
        minor = 128 // sd.itemsize
        problems = [(V % R, f"V={V} a multiple of {R}"), (K % minor, f"K={K} a multiple of {minor} ({sd} pool)"),
                    (HV % 4, f"HV={HV} a multiple of 4")]  # fmt: skip
        bad = [what for fails, what in problems if fails]
        if bad:
            raise ValueError(f"mosaic verify: the kernel needs {', '.join(bad)}; use backend 'pallas' or 'triton'")
    elif V % R:
        raise ValueError(f"mosaic verify: V={V} must be a multiple of {R}")
    od = jnp.dtype(out_dtype)
    narrow = od.itemsize < 4 and _jax_version() >= (0, 12)  # (interpret mode takes the GPU's choice, so CI runs it)
    outputs = config.outputs or ("smem" if narrow else "registers")
    if narrow and outputs == "registers" and not interpret:
        raise BackendUnavailable(
            f"mosaic verify: with jax {jax.__version__}, Mosaic GPU cannot store {od} outputs from this kernel's row "
            f"layout ({od.itemsize} bytes a thread; it needs 4): use VerifyConfig(outputs='smem') or None (the "
            f"default), or pass out_dtype=float32 (got {od})"
        )
    form = config.form or ("portable" if interpret else "pinned")
    if form == "pinned" and interpret:
        raise BackendUnavailable("mosaic verify: the 'pinned' form needs a CUDA GPU; interpret mode uses 'portable'")
    num_sms = _NUM_SMS_INTERPRET if interpret else int(getattr(jax.devices()[0], "core_count", 0) or 132)
    slots = config.small_slots
    if slots is None:
        out_itemsize = od.itemsize if outputs == "smem" else 0
        two = smem_bytes(D, PD, HV, R, K, sd.itemsize, jnp.dtype(v.dtype).itemsize, 2, out_itemsize,
                         gram=config.verify == "gram", channel=channel)  # fmt: skip
        slots = 2 if config.ctas * (two + 1024) <= SMEM_PER_SM else 1
    return Geometry(
        N=N, D=D, H=H, HV=HV, V=V, K=K, R=R, state_dtype=sd.name, v_dtype=jnp.dtype(v.dtype).name,
        v_stacked=v.ndim == 5, out_dtype=od.name, out_into=out_into, snapshots=snapshots,
        into=into, pending=PD > 0, PD=PD, ctas=config.ctas, num_sms=num_sms, small_slots=slots, replay=config.replay,
        control=config.control, outputs=outputs, form=form, interpret=interpret, auto_barriers=config.auto_barriers,
        verify=config.verify,
        prefetch_next_layer=PD > 0 if config.prefetch_next_layer is None else config.prefetch_next_layer,
        thread_pool=thread_pool, channel=channel,
    )  # fmt: skip


def verify(call: VerifyCall, *, config: VerifyConfig = VerifyConfig()):
    """See :func:`gdn_lossless_jax.verify` (arguments already checked there); ``config`` sets the launch.

    The kernel reads each request's state at ``pool[layer, slots[n]]`` by TMA (zeros for a slot
    outside ``[0, S)``). With a tape buffer the tape goes to ``[tape_layer, rows[n]]`` of it, with
    ``out`` the outputs to ``out[out_layer]``, in place. With ``pending`` the previous step's
    commit is applied first and the pool comes back as a third element.
    """
    check_available("verify")
    return _jitted()(call, config=config)


@functools.cache
def _jitted():
    return jax.jit(_verify, static_argnames=("config",))


def _verify(call: VerifyCall, *, config, thread_pool=False):
    # thread_pool: the pool passed through the kernel as an in-place ref and returned (unchanged), so
    # that the in-place commit of the next layer orders after this kernel's reads without a copy
    i32 = jnp.int32
    state, slots, pending = call.pool, call.slots, call.pending
    q, k, v, a, b, A_log, dt_bias = call.inputs
    tape, tape_layer, rows, out, out_layer = call.tape, call.tape_layer, call.rows, call.out, call.out_layer
    scale, out_dtype = call.scale, jnp.dtype(call.out_dtype)
    layer = _scalar(call.layer)
    channel = call.decay == "channel"  # KDA: g [..., HV, K] (static: the call's decay form)
    if channel and config.verify == "gram":
        raise ValueError("mosaic verify: VerifyConfig(verify='gram') takes GDN's scalar decay only, not "
                         "decay='channel' (KDA: one decay per key channel; the Gram coefficients fold one decay a "
                         "step): use VerifyConfig(verify='chain'), the default")  # fmt: skip
    if pending is not None and pending.tape.stores_states:
        # snapshots: the commit first (the Pallas scatter of this layer's two snapshots, in place), then
        # the verify; the same bits, not fused
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
            both = jnp.stack([layer, _scalar(pending.layer)])  # the pool's layer, the tape's
            state = commit_snapshots(state, pending.tape.states, slots, pending.steps, pending.track_slots,
                                     pending.track_steps, pending.rows, interpret=_interpret(), layers=both)  # fmt: skip
        # the pool through the kernel (read only): as a plain input, XLA would copy the whole pool
        # twice a step to let the next layer's in-place commit run
        return _verify(call.replace(pool=state, pending=None), config=config, thread_pool=True)
    N, D, H, K = q.shape[-4:]
    _, NS, HV, V, _ = state.shape
    snapshots = call.record.stores_states
    into = tape is not None
    tape_layer = _scalar(tape_layer)
    if into and rows is None:
        rows = jnp.arange(N, dtype=i32)
    interpret = _interpret()

    # the prologue (the Pallas backend's kernel; KDA's in XLA): q/k norms, gates; the tape's k and g into its buffer
    stacked = any(
        is_stacked(n, x) for n, x in zip(("q", "k", "a", "b", "A_log", "dt_bias"), (q, k, a, b, A_log, dt_bias))
    )
    pre = (rows, tape_layer[None], tape.k, tape.g) if into and not snapshots else None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
        if channel:  # KDA: in XLA (the Pallas prologue kernel computes one decay a v-head)
            qn, kn, g, beta, *bufs = ref.prepare_call(call, rows)
            bufs = bufs if pre is not None else []
        elif config.verify == "gram":  # the Gram prologue ("beta": the coefficients; stacked reads, tape writes by XLA)
            rows_c, Dp = coef_shape(D)
            qn, kn, g, beta, *bufs = gram_prep(q, k, a, b, A_log, dt_bias, scale=scale, Dp=Dp, interpret=interpret,
                                                packed=rows_c, into=pre, xlayer=layer[None] if stacked else None,
                                                beta_scale=call.beta_scale)  # fmt: skip
        else:
            qn, kn, g, beta, *bufs = prep(
                q, k, a, b, A_log, dt_bias, scale=scale, interpret=interpret, heads=_pallas.VerifyConfig().prep_heads,
                into=pre, xlayer=layer[None] if stacked else None, beta_scale=call.beta_scale,
            )  # fmt: skip

    # per request: its slot, tape row and pending commit, with the commit's masks (reference.commit_masks)
    slot_ok = (slots >= 0) & (slots < NS)
    zero = jnp.zeros_like(slots)
    cols = [jnp.where(slot_ok, slots, 0), slot_ok]
    if into:
        nrows = (tape.states if snapshots else tape.u).shape[1]
        row_ok = (rows >= 0) & (rows < nrows)
        cols += [jnp.where(row_ok, rows, 0), row_ok]
    else:
        cols += [zero, zero]
    PD = 0
    prev_layer = 0
    pend_in = []
    if pending is not None:
        prev, prows, psteps, ptslots, ptsteps = pending.tape, pending.rows, pending.steps, pending.track_slots, \
            pending.track_steps
        prev_layer = pending.layer
        PR, PD = prev.u.shape[1], prev.u.shape[2]
        valid = slot_ok & (prows >= 0) & (prows < PR)
        accept = valid & (psteps >= 0) & (psteps < PD)
        track = valid & (ptsteps >= 0) & (ptsteps < PD) & (ptslots >= 0) & (ptslots < NS)
        cols += [jnp.where(accept, psteps, -1), jnp.where(track, ptsteps, -1), jnp.where(track, ptslots, 0),
                 jnp.where(valid, prows, 0)]  # fmt: skip
        if (prev.g.ndim == 5) != channel:  # g [L', R', D', HV] (GDN) or [L', R', D', HV, K] (KDA)
            raise ValueError(f"mosaic verify: the pending tape is a {type(prev).__name__} tape (g of shape "
                             f"{list(prev.g.shape)}) but the call's decay is {call.decay!r}")  # fmt: skip
        pend_in = [prev.k, prev.u, prev.g]
    else:
        cols += [zero - 1, zero - 1, zero, zero]
    tab = jnp.stack([_i32(c) for c in cols], axis=1)  # [N, 8]
    lay = jnp.stack([layer, tape_layer, _scalar(prev_layer), _scalar(out_layer)] + [_scalar(0)] * 4)

    geom = _geometry(N, D, H, HV, V, K, state.dtype, v, out_dtype, out_into=out is not None, snapshots=snapshots,
                     into=into, PD=PD, config=config, thread_pool=thread_pool, channel=channel)  # fmt: skip
    pool_out = pending is not None or thread_pool  # the kernel's pool an in-place ref, returned
    kern = build(geom)
    inputs = [tab, lay, qn, kn, v, g, beta, *pend_in]
    if out is None:
        out = jax.lax.empty((N, D, HV, V), jnp.dtype(out_dtype))
    if into:
        rec = tape.states if snapshots else tape.u
    else:
        rec = jax.lax.empty((N, D, HV, V, K) if snapshots else (N, D, HV, V), state.dtype if snapshots else jnp.float32)
    if not pool_out:
        out, rec = pl.run_state(lambda refs: kern(*inputs, state, *refs))((out, rec))
    else:
        state, out, rec = pl.run_state(lambda refs: kern(*inputs, *refs))((state, out, rec))
    if snapshots:
        new = call.record(rec)
    elif into:
        new = call.record(rec, *bufs)
    else:
        new = call.record(rec, kn, g)
    if not pool_out:
        return out, new
    return out, new, state


def commit(pool, tape, slots, steps, track_slots, track_steps, rows, *, form=None, config=None, math="platform"):
    """See :func:`gdn_lossless_jax.commit`: the Pallas backend's commit kernel (the rule pinned; a KDA
    tuple tape's per-channel decay on each key channel's column, the bits of the fused kernel's replay)."""
    check_available("commit")
    kw = {} if config is None else {"config": config}
    return _pallas.commit(pool, tape, slots, steps, track_slots, track_steps, rows, form=form, math=math, **kw)


def replay(state0, tuples, steps, *, form=None, config=None, math="platform"):
    """See :func:`gdn_lossless_jax.replay`: the Pallas backend's."""
    check_available("replay")
    kw = {} if config is None else {"config": config}
    return _pallas.replay(state0, tuples, steps, form=form, math=math, **kw)


