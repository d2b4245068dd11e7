"""The Mosaic GPU backend's argument errors, launch choice and lowering for CUDA, and its KDA runs.

Its kernel's GDN results are tested in the shared suites: ``tests/test_fused.py`` and
``tests/test_equivalence.py`` (interpret mode on the CPU, the whole matrix on a GPU). KDA (a
per-channel decay, ``decay="channel"``) runs here (the end of the file): the verify in both record
modes against the reference and :func:`gdn_lossless_jax.kda.verify`, the tuple commit against the
snapshot commit (fp32 and bf16 pools) and the fused step with a KDATuples tape pending against the
commit, then the verify; each bit-exactness check with a control (the per-channel decay applied as
one decay a head) that must differ. Interpret mode on the CPU at the backend's multiples; on a GPU
also at Kimi-Linear-48B's heads.
"""

import jax
import jax.numpy as jnp
import pytest

import numpy as np

import gdn_lossless_jax as gl
from conftest import ON_GPU, full_only, requires_gpu
from gdn_lossless_jax.backends import BackendUnavailable, mosaic
from gdn_lossless_jax import checks
from gdn_lossless_jax.backends.contract import PendingCommit

F32, BF16 = jnp.float32, jnp.bfloat16


def _geometry(monkeypatch, *, V=128, K=128, HV=32, D=4, PD=4, state=F32, out=BF16, config=None):
    """The launch the backend would choose on a GPU (the shape checks of its GPU path)."""
    monkeypatch.setattr(mosaic, "_interpret", lambda: False)
    config = config or mosaic.VerifyConfig()
    v = jax.ShapeDtypeStruct((25, D, HV, V), BF16)
    return mosaic._geometry(25, D, 16, HV, V, K, state, v, out, out_into=False, snapshots=False, into=True, PD=PD,
                            config=config)  # fmt: skip


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"V": 96}, r"V=96 a multiple of 64"),
        ({"K": 48}, r"K=48 a multiple of 32 \(float32 pool\)"),
        ({"K": 96, "state": BF16}, r"K=96 a multiple of 64 \(bfloat16 pool\)"),
        ({"HV": 6}, r"HV=6 a multiple of 4"),
    ],
)
def test_shapes_the_gpu_kernel_cannot_take_are_named(monkeypatch, kw, match):
    with pytest.raises(ValueError, match=match):
        _geometry(monkeypatch, out=F32, **kw)


def test_bf16_outputs_leave_by_the_store_this_jax_takes(monkeypatch):
    """jax 0.11.2 (the H200's) stores them from registers; jax 0.12's Mosaic GPU refuses that store, so
    there they are staged in shared memory, and asking for registers raises with the way out."""
    registers = mosaic.VerifyConfig(outputs="registers")
    assert _geometry(monkeypatch, out=F32).outputs == "registers"
    assert _geometry(monkeypatch, out=BF16, config=mosaic.VerifyConfig(outputs="smem")).outputs == "smem"
    if mosaic._jax_version() < (0, 12):
        assert _geometry(monkeypatch).outputs == "registers"
        assert _geometry(monkeypatch, config=registers).outputs == "registers"
        return
    assert _geometry(monkeypatch).outputs == "smem"
    with pytest.raises(BackendUnavailable, match=r"use VerifyConfig\(outputs='smem'\) or None.*\(got bfloat16\)"):
        _geometry(monkeypatch, config=registers)
    assert _geometry(monkeypatch, out=F32, config=registers).out_dtype == "float32"


def _lower_for_cuda(monkeypatch, out_dtype, config):
    """Lower the fused verify (a pending tuple commit, the tape into a buffer) for CUDA here, as the
    GPU would compile it: Mosaic GPU builds the kernel's code while it lowers. The prologue (Pallas
    Triton, which needs a device to lower) is replaced by a stand-in of its shapes."""
    from gdn_lossless_jax.tape import Tuples

    monkeypatch.setattr(mosaic, "_interpret", lambda: False)

    def prep(q, k, a, b, A_log, dt_bias, *, into, **_):
        N, D, H, K = q.shape
        HV = a.shape[-1]
        z = jnp.sum(q.astype(F32))
        return [jnp.zeros((N, D, H, K)) + z] * 2 + [jnp.zeros((N, D, HV)) + z] * 2 + list(into[2:])

    monkeypatch.setattr(mosaic, "prep", prep)
    N, D, H, HV, K, V, L, S, R = 2, 2, 2, 4, 64, 64, 2, 6, 3
    sds, i32 = jax.ShapeDtypeStruct, jnp.int32
    tuples = lambda *s: Tuples(sds((*s, HV, V), F32), sds((*s, H, K), F32), sds((*s, HV), F32))  # noqa: E731
    q, v, a = sds((N, D, H, K), BF16), sds((N, D, HV, V), BF16), sds((N, D, HV), BF16)
    ix = sds((N,), i32)

    def f(pool, q, v, a, A, slots, tape, prev, idx):
        call = checks.verify_args("lower", pool, q, q, v, a, a, A, A, record="tuples", scale=K**-0.5,
                                  out_dtype=out_dtype, slots=slots, layer=1, tape=tape, rows=idx)  # fmt: skip
        return mosaic.verify(call.replace(pending=PendingCommit(prev, jnp.int32(0), idx, idx, idx, idx)), config=config)

    args = (sds((L, S, HV, V, K), F32), q, v, a, sds((HV,), F32), ix, tuples(L, R, D), tuples(L, R, D), ix)
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("out_dtype", [BF16, F32], ids=["bf16", "f32"])
def test_the_gpu_kernel_lowers_for_cuda_with_this_jax(monkeypatch, out_dtype):
    """The kernel as the GPU builds it, lowered on the CPU with this JAX (CI's is 0.12; the H200 runs
    0.11.2), both ways out for the outputs; the control, bf16 outputs stored from registers with the
    backend's refusal taken away, must fail under jax 0.12 (its Mosaic GPU refuses 2-byte stores
    from the row layout), which shows that the lowering builds the stores."""
    for outputs in (None, "smem"):
        assert "mosaic_gpu" in _lower_for_cuda(monkeypatch, out_dtype, mosaic.VerifyConfig(outputs=outputs))
    if out_dtype == F32:  # without the next layer's prefetch (the fused kernel's default has it)
        assert "mosaic_gpu" in _lower_for_cuda(monkeypatch, out_dtype, mosaic.VerifyConfig(prefetch_next_layer=False))
    if out_dtype == F32 or mosaic._jax_version() < (0, 12):
        return
    monkeypatch.setattr(mosaic, "_jax_version", lambda: (0, 11))
    with pytest.raises(Exception, match="smaller than 4 bytes"):
        _lower_for_cuda(monkeypatch, out_dtype, mosaic.VerifyConfig(outputs="registers"))


def test_the_fused_kernel_prefetches_the_next_layer_by_default(monkeypatch):
    on, off = mosaic.VerifyConfig(prefetch_next_layer=True), mosaic.VerifyConfig(prefetch_next_layer=False)
    assert _geometry(monkeypatch, out=F32, PD=4).prefetch_next_layer
    assert not _geometry(monkeypatch, out=F32, PD=0).prefetch_next_layer  # the verify alone
    assert _geometry(monkeypatch, out=F32, PD=0, config=on).prefetch_next_layer
    assert not _geometry(monkeypatch, out=F32, config=off).prefetch_next_layer


def test_launch_double_buffers_the_inputs_where_two_ctas_fit(monkeypatch):
    # 25x4: two CTAs of ~82 KB fit an SM's 227 KB; 8x16 (16 steps each side) does not: single-buffered
    assert _geometry(monkeypatch, out=F32, D=4, PD=4).small_slots == 2
    assert _geometry(monkeypatch, out=F32, D=16, PD=16).small_slots == 1
    forced = mosaic.VerifyConfig(small_slots=1)
    assert _geometry(monkeypatch, out=F32, config=forced).small_slots == 1


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"ctas": 0}, "ctas must be >= 1, got 0"),
        ({"small_slots": 3}, "small_slots must be 1, 2 or None, got 3"),
        ({"form": "ptx"}, "form must be one of"),
        ({"replay": "scan"}, "replay must be one of"),
        ({"outputs": "gmem"}, "outputs must be None or one of"),
        ({"prefetch_next_layer": "yes"}, r"prefetch_next_layer must be None, True or False, got 'yes'"),
    ],
)
def test_config_errors_name_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        mosaic.VerifyConfig(**kw)


def test_the_pinned_form_is_refused_in_interpret_mode():
    if jax.default_backend() != "cpu":
        pytest.skip("interpret mode is the CPU's")
    v = jax.ShapeDtypeStruct((2, 2, 4, 16), F32)
    with pytest.raises(BackendUnavailable, match="'pinned' form needs a CUDA GPU"):
        mosaic._geometry(2, 2, 2, 4, 16, 16, F32, v, F32, out_into=False, snapshots=False, into=False, PD=0,
                         config=mosaic.VerifyConfig(form="pinned"))  # fmt: skip


# -- KDA (a per-channel decay) through the kernel ------------------------------------------------
# The kernel runs here in Mosaic GPU's interpret mode (the CPU) at the backend's multiples (V 64, K 32,
# HV 4; K 64 for a bf16 pool on a GPU) and, on a GPU only, at Kimi-Linear-48B's heads (H = HV = 32,
# K = V = 128). Its chain sums over K in its own order (interpret mode: XLA:CPU's), so its u and
# outputs are compared with the reference's as values; the tape's k and g (the XLA prologue's) and
# everything a replay of the tape gives are compared bit for bit.
KDA_SMALL = (2, 3, 2, 4, 32, 64)  # N, D, H, HV, K, V: two v-heads a q/k head
KDA_SHAPES = [pytest.param(KDA_SMALL, id="multiples"),
              pytest.param((2, 3, 32, 32, 128, 128), id="kimi48b", marks=requires_gpu)]  # fmt: skip
KDA_NAMES = ("q", "k", "v", "a", "b", "A_log", "dt_bias")


def _kda_shape(shape, state_dtype):
    N, D, H, HV, K, V = shape
    return N, D, H, HV, (64 if ON_GPU and state_dtype == BF16 and K < 64 else K), V  # a bf16 pool's tiles on a GPU


def _kda_inputs(seed, shape, *, N=None, state_dtype=F32):
    """Adversarial KDA inputs of :func:`gdn_lossless_jax.verify` (``decay="channel"``), none zero; request n
    draws kind n % 3: normal; cancelling (every channel's decay within an ulp of 1 and ``v = S k`` up to a
    relative 1e-6, so ``v - Sd k`` loses most of its bits); per-channel extremes (within each head, a quarter
    of the channels decaying within an ulp of 1, a quarter by a subnormal factor, the others spread; half the
    state's rows near the smallest normal, so products are subnormal)."""
    _, D, H, HV, K, V = shape
    N = shape[0] if N is None else N
    rng = np.random.default_rng(seed)
    normal = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    state0, q, k, v = 0.5 * normal(N, HV, V, K), normal(N, D, H, K), normal(N, D, H, K), normal(N, D, HV, V)
    a, b = normal(N, D, HV, K), 2 * normal(N, D, HV)
    A_log = np.log(rng.uniform(0.2, 4.0, HV)).astype(np.float32)
    dt_bias = 0.5 * normal(HV, K)
    channel = np.arange(K) % 4
    for n in range(N):
        if n % 3 == 1:  # softplus(a + dt_bias) in [e^-25, e^-17]: g ~ -1e-8, exp(g) 1 or 1 - ulp
            a[n] = rng.uniform(-25.0, -17.0, (D, HV, K)).astype(np.float32) - dt_bias
            kn = np.repeat(k[n] / np.sqrt((k[n] ** 2).sum(-1, keepdims=True) + 1e-6), HV // H, axis=1)  # [D, HV, K]
            v[n] = np.einsum("hvk,dhk->dhv", state0[n], kn) * (1 + 1e-6 * normal(D, HV, V))
        elif n % 3 == 2:
            tiny = 95.0 / np.exp(A_log)[:, None] + 0.3 * normal(D, HV, K)  # g ~ -95: exp(g) ~ 5e-42, subnormal
            a[n] = np.where(channel == 0, -30.0 + 0.1 * a[n], np.where(channel == 1, tiny, 3.0 * a[n])) - dt_bias
            state0[n, :, ::2] *= np.float32(2e-38)
    x = dict(state0=state0, q=q, k=k, v=v, a=a, b=b)
    x = {n: jnp.asarray(t, state_dtype if n == "state0" else BF16) for n, t in x.items()}
    return dict(x, A_log=jnp.asarray(A_log), dt_bias=jnp.asarray(dt_bias))


def _one_decay(tape):
    """Control: the per-channel decay applied as one scalar a head (channel 0's ``g`` on every channel)."""
    return tape.replace(g=jnp.broadcast_to(tape.g[..., :1], tape.g.shape))


def _close(want, got, what, tol=1e-5):
    want, got = np.asarray(want, np.float64), np.asarray(got, np.float64)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= tol, f"{what}: max error {err:.3g} of the largest value"


@pytest.mark.parametrize("shape", KDA_SHAPES)
def test_kda_verify_record_modes_and_reference(shape, seed):
    """The KDA verify: the outputs the same bits in both record modes (a KDATuples tape, per-channel ``g``);
    the tape's ``k`` and ``g`` the reference's bit for bit, its ``u`` and the outputs the reference's and
    :func:`gdn_lossless_jax.kda.verify`'s values; the replay of the tuples gives each step's snapshot bit for
    bit. Control: the tuples replayed with one decay a head miss the snapshots."""
    from gdn_lossless_jax import kda
    from gdn_lossless_jax.tape import KDATuples
    from gdn_lossless_jax.testing import assert_bitwise_differs, assert_bitwise_equal

    N, D, H, HV, K, _ = shape
    x = _kda_inputs(seed, shape)
    kw = dict(decay="channel", out_dtype=F32)
    (o_t, tup), (o_s, snp) = (gl.verify(**x, record=r, backend="mosaic", **kw) for r in ("tuples", "snapshots"))
    assert type(tup) is KDATuples and tup.g.shape == (N, D, HV, K)
    assert_bitwise_equal(o_t, o_s, "outputs, tuples vs snapshots")
    ro, rtup = gl.verify(**x, record="tuples", backend="reference", **kw)
    assert_bitwise_equal((rtup.k, rtup.g), (tup.k, tup.g), "the tape's k and g against the reference's")
    _close(ro, o_t, "outputs against the reference's")
    _close(rtup.u, tup.u, "u against the reference's")
    G = HV // H  # kda.verify has one head count: the q/k heads repeated to the v-heads, as the reference reads them
    rep = {n: jnp.repeat(x[n], G, axis=2) for n in ("q", "k")}
    spec = jax.jit(kda.verify, static_argnames="out_dtype")
    ko, _ = spec(x["state0"], rep["q"], rep["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"], out_dtype=F32)
    _close(ko, o_t, "outputs against kda.verify's")
    def every(tape):  # the replay of each step
        return jnp.stack([gl.replay(x["state0"], tape, jnp.full((N,), t, jnp.int32), backend="mosaic")
                          for t in range(D)], axis=1)  # fmt: skip

    assert_bitwise_equal(snp.states, every(tup), "the replay of the tuples against the snapshots")
    assert_bitwise_differs(snp.states, every(_one_decay(tup)), "control: one decay a head")


def _kda_pool(seed, shape, L, S, state_dtype):
    rng = np.random.default_rng(seed)
    HV, K, V = shape[3:]
    pool = 0.5 * rng.standard_normal((L, S, HV, V, K)).astype(np.float32)
    pool[:, ::3, :, ::2] *= np.float32(2e-38)  # some slots' rows near the smallest normal
    return jnp.asarray(pool, state_dtype)


def _kda_buffer(record, L, R, D, shape, dtype):
    from gdn_lossless_jax.tape import KDATuples

    _, _, H, HV, K, V = shape
    if record == "snapshots":
        return gl.Snapshots(jnp.zeros((L, R, D, HV, V, K), dtype))
    return KDATuples(u=jnp.zeros((L, R, D, HV, V)), k=jnp.zeros((L, R, D, H, K)), g=jnp.zeros((L, R, D, HV, K)))


# 4 requests of a 2-layer pool of 6 slots, tape rows permuted into a buffer of 3: request 0 accepts the
# last step, its track copy (step 1) to slot 0; request 1 accepts step 0, its track step 2 after it
# (to slot 3); request 2's row and request 3's slot are out of range (nothing written, not even a track copy).
_KDA_SLOTS, _KDA_ROWS = np.array([4, 1, 2, 7], np.int32), np.array([2, 0, 3, 1], np.int32)
_KDA_L, _KDA_S, _KDA_R = 2, 6, 3


def _kda_commit_args(D):
    steps = np.array([D - 1, 0, 1, 1], np.int32)
    return _KDA_SLOTS, steps, np.array([0, 3, 5, 5], np.int32), np.array([1, 2, 0, 0], np.int32), _KDA_ROWS


def _kda_verify_layers(pool, xs, record, shape, *, slots=_KDA_SLOTS, rows=_KDA_ROWS):
    """Each layer's verify from the pool into one tape buffer: ``(outputs per layer, the buffer)``."""
    buf = _kda_buffer(record, _KDA_L, _KDA_R, shape[1], shape, pool.dtype)
    outs = []
    for layer, x in enumerate(xs):
        o, buf = gl.verify(pool, *[x[n] for n in KDA_NAMES], slots=slots, layer=layer, tape=buf, rows=rows,
                           record=record, decay="channel", backend="mosaic")  # fmt: skip
        outs.append(o)
    return outs, buf


# With GDN_FULL_TESTS=1 on the CPU (the suite's time; on a GPU always): Mosaic's commit is the Pallas commit kernel,
# whose KDA replay the CPU run checks in tests/test_verify_forms.py
@pytest.mark.parametrize("state_dtype", [pytest.param(d, marks=() if ON_GPU else full_only) for d in (F32, BF16)],
                         ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", KDA_SHAPES)
def test_kda_tuple_commit_equals_snapshot_commit(shape, state_dtype, seed):
    """KDA verify of a 2-layer pool into tape buffers (rows permuted, one out of range, a padding slot), then
    ``commit`` of the tuples (the reference's, in XLA) equals the commit of the snapshots bit for bit, with a
    track copy before and one after the accepted step; untouched slots keep their bits. The outputs do not depend
    on the record mode. Control: the tuples with one decay a head commit other bits."""
    from gdn_lossless_jax.testing import assert_bitwise_differs, assert_bitwise_equal

    shape = _kda_shape(shape, state_dtype)
    D = shape[1]
    pool = _kda_pool(seed, shape, _KDA_L, _KDA_S, state_dtype)
    xs = [{n: t for n, t in _kda_inputs(seed + 1 + layer, shape, N=4).items() if n != "state0"}
          for layer in range(_KDA_L)]  # fmt: skip
    (o_t, tup), (o_s, snp) = (_kda_verify_layers(pool, xs, r, shape) for r in ("tuples", "snapshots"))
    assert_bitwise_equal(o_t, o_s, "outputs, tuples vs snapshots")
    args = _kda_commit_args(D)
    by_tuples = gl.commit(pool, tup, *args, backend="mosaic")
    by_snapshots = gl.commit(pool, snp, *args, backend="mosaic")
    assert_bitwise_equal(by_snapshots, by_tuples, "tuple commit vs snapshot commit")
    assert_bitwise_equal(pool[:, 2], by_tuples[:, 2], "the slot of the request whose row is out of range")
    for slot in (0, 3, 4, 1):  # the track copies and the accepted states were written
        assert_bitwise_differs(pool[:, slot], by_tuples[:, slot], f"slot {slot} written")
    assert_bitwise_differs(by_snapshots, gl.commit(pool, _one_decay(tup), *args, backend="mosaic"),
                           "control: one decay a head")  # fmt: skip


_KDA_FUSED = [  # (state dtype, launch): the replay unrolled and the inputs single-buffered in interpret mode with
    # GDN_FULL_TESTS=1 (a kernel compile each), every case on a GPU
    pytest.param(F32, {}, id="f32"),
    pytest.param(BF16, {}, id="bf16", marks=() if ON_GPU else full_only),
    pytest.param(F32, {"replay": "static"}, id="f32-static", marks=() if ON_GPU else full_only),
    pytest.param(BF16, {"small_slots": 1}, id="bf16-single", marks=() if ON_GPU else full_only),
]


@pytest.mark.parametrize("state_dtype,launch", _KDA_FUSED)
@pytest.mark.parametrize("shape", KDA_SHAPES)
def test_kda_fused_pending_equals_commit_then_verify(shape, state_dtype, launch, seed):
    """The fused step with a KDATuples tape pending (``commit_and_verify``: the kernel replays the previous step's
    per-channel decays, stores the accepted and track states in place, then verifies) equals ``commit``, then
    ``verify``, bit for bit: the pool after every layer, the outputs and the new tapes. Control: the same
    pending tape with one decay a head leaves other bits in the pool."""
    from gdn_lossless_jax.testing import assert_bitwise_differs, assert_bitwise_equal

    shape = _kda_shape(shape, state_dtype)
    D = shape[1]
    pool = _kda_pool(seed, shape, _KDA_L, _KDA_S, state_dtype)
    step = lambda s: [{n: t for n, t in _kda_inputs(s + layer, shape, N=4).items() if n != "state0"}  # noqa: E731
                      for layer in range(_KDA_L)]  # fmt: skip
    first, second = step(seed + 1), step(seed + 11)
    _, prev = _kda_verify_layers(pool, first, "tuples", shape)
    slots, steps, track_slots, track_steps, rows = _kda_commit_args(D)
    # the next step's requests: the same slots, new tape rows; the padding slot reads zeros and its row is out of
    # range (no two requests may write one row: on a GPU which one lands last is not defined)
    rows2 = np.array([0, 1, 2, -1], np.int32)

    def fused(tape):
        p, outs, buf = pool, [], _kda_buffer("tuples", _KDA_L, _KDA_R, D, shape, pool.dtype)
        pending = gl.Pending(tape, rows, steps, track_slots, track_steps)
        for layer, x in enumerate(second):
            if launch:  # the backend's own launch: its verify of the call commit_and_verify would make
                call = checks.verify_args("fused", p, *[x[n] for n in KDA_NAMES], record="tuples", slots=slots,
                                          layer=layer, tape=buf, rows=rows2, out_dtype=x["q"].dtype,
                                          decay="channel")  # fmt: skip
                call = call.replace(pending=gl.Pending(tape, rows, steps, track_slots, track_steps,
                                                       layer=jnp.int32(layer)))  # fmt: skip
                o, buf, p = mosaic.verify(call, config=mosaic.VerifyConfig(**launch))
            else:
                o, buf, p = gl.commit_and_verify(p, pending, *[x[n] for n in KDA_NAMES], slots=slots, layer=layer,
                                                 tape=buf, rows=rows2, backend="mosaic")  # fmt: skip
            outs.append(o)
        return p, outs, buf

    committed = gl.commit(pool, prev, slots, steps, track_slots, track_steps, rows, backend="mosaic")
    outs, buf = _kda_verify_layers(committed, second, "tuples", shape, rows=rows2)
    got_pool, got_outs, got_buf = fused(prev)
    assert_bitwise_equal(committed, got_pool, "the pool: fused vs commit")
    assert_bitwise_equal(outs, got_outs, "outputs: fused vs commit, then verify")
    assert_bitwise_equal(buf, got_buf, "tapes: fused vs commit, then verify")
    assert_bitwise_differs(committed, fused(_one_decay(prev))[0], "control: one decay a head in the fused replay")


def test_kda_refuses_the_gram_verify(seed):
    """The Gram form folds one scalar decay a step into its coefficients: a KDA call with it is refused, naming
    the config field and the decay, before any kernel is built."""
    from gdn_lossless_jax.testing import backend_verify

    x = _kda_inputs(seed, KDA_SMALL)
    with pytest.raises(ValueError, match=r"VerifyConfig\(verify='gram'\).*not decay='channel'.*verify='chain'"):
        backend_verify(mosaic, **x, decay="channel", config=mosaic.VerifyConfig(verify="gram"))
    assert "channel" in mosaic.capabilities.decays


def test_the_kda_kernel_lowers_for_cuda(monkeypatch):
    """The fused KDA kernel (a pending KDATuples commit, the tape into a buffer) lowered for CUDA here, as the GPU
    builds it: the per-channel decay's ``[K]`` rows by TMA, their ``exp`` in the column layout, broadcast down
    the tile. (Its prologue is XLA: nothing stands in for it.)"""
    from gdn_lossless_jax.tape import KDATuples

    monkeypatch.setattr(mosaic, "_interpret", lambda: False)
    N, D, H, HV, K, V, L, S, R = 2, 2, 2, 4, 64, 64, 2, 6, 3
    sds, i32 = jax.ShapeDtypeStruct, jnp.int32
    tuples = lambda *s: KDATuples(sds((*s, HV, V), F32), sds((*s, H, K), F32), sds((*s, HV, K), F32))  # noqa: E731
    q, v, a, b = sds((N, D, H, K), BF16), sds((N, D, HV, V), BF16), sds((N, D, HV, K), BF16), sds((N, D, HV), BF16)
    ix = sds((N,), i32)

    def f(pool, q, v, a, b, A, dt, slots, tape, prev, idx):
        call = checks.verify_args("lower", pool, q, q, v, a, b, A, dt, record="tuples", scale=K**-0.5, out_dtype=F32,
                                  slots=slots, layer=1, tape=tape, rows=idx, decay="channel")  # fmt: skip
        return mosaic.verify(call.replace(pending=gl.Pending(prev, idx, idx, idx, idx, layer=jnp.int32(0))))

    args = (sds((L, S, HV, V, K), F32), q, v, a, b, sds((HV,), F32), sds((HV, K), F32), ix, tuples(L, R, D),
            tuples(L, R, D), ix)  # fmt: skip
    assert "mosaic_gpu" in jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
