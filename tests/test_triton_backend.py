"""The ``triton`` backend (jax-triton kernels): the shared equivalence suite and its own checks.

GPU tests run where JAX's default backend is ``gpu`` and jax-triton imports; elsewhere
they are skipped with the reason. On the CPU, only the error a user gets when asking for
the backend is tested. Run on the H200 (jax 0.11.2, triton 3.6, jax-triton 0.3.1)::

    pip install --no-deps .whl/jax_triton-0.3.1-py3-none-any.whl
    python -m pytest -q tests/test_triton_backend.py

Matrix: D in {2, 3, 4, 8, 16} x (H, HV) in {(16, 32), (4, 16)} x N in {1, 5} x fp32 and
bf16 pools, K = V = 128, L = 2 layers; each case has a track copy, permuted rows and
invalid rows (negative step, out-of-range slot, row and track slot). KDA (``decay="channel"``)
at H = HV = 4 and Kimi-Linear-48B's H = HV = 32 (K = V = 128), each bitwise check with the
scalar-decay control (the per-channel decay applied as one factor per head).
"""

import dataclasses
import functools
import importlib.util
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdn_lossless_jax as gl
from equivalence import check_commit, check_controls, check_outputs, check_replay_every_step, layer_tapes, make_case
from gdn_lossless_jax import backends, reference
from gdn_lossless_jax.checks import commit_and_verify_args
from gdn_lossless_jax.tape import KDATuples, Tuples
from gdn_lossless_jax.testing.cases import Shape, channel_verify_inputs, verify_inputs
from gdn_lossless_jax.testing import assert_bitwise_differs, assert_bitwise_equal
from gdn_lossless_jax.testing import backend_verify

ON_GPU = jax.default_backend() == "gpu"
HAVE_JAX_TRITON = importlib.util.find_spec("jax_triton") is not None and importlib.util.find_spec("triton") is not None

requires_triton = pytest.mark.skipif(
    not (ON_GPU and HAVE_JAX_TRITON),
    reason=(
        f"backend 'triton' needs a GPU and jax-triton: JAX's default backend is {jax.default_backend()!r}, "
        f"jax_triton/triton {'found' if HAVE_JAX_TRITON else 'not installed'} "
        "(pip install 'gdn_lossless_jax[triton]')"
    ),
)

F32, BF16 = jnp.float32, jnp.bfloat16
DRAFTS = [2, 3, 4, 8, 16]
HEADS = [(16, 32), (4, 16)]
MATRIX = [
    pytest.param(Shape(N=n, D=d, H=h, HV=hv, K=128, V=128), dt, id=f"D{d}-H{h}-HV{hv}-N{n}-{jnp.dtype(dt).name}")
    for d, (h, hv), n, dt in itertools.product(DRAFTS, HEADS, [1, 5], [F32, BF16])
]
SHAPE = Shape(N=5, D=8, H=16, HV=32, K=128, V=128)


# ---------------------------------------------------------------------------------------
# Off the GPU: the error says what is missing and what to do.
# ---------------------------------------------------------------------------------------
@pytest.mark.skipif(ON_GPU, reason="tests the error raised off the GPU")
@pytest.mark.parametrize("op", ["verify", "replay", "commit"])
def test_unavailable_off_the_gpu(op):
    with pytest.raises(gl.BackendUnavailable) as e:
        backends.resolve("triton", op)
    msg = str(e.value)
    for needle in (
        op,
        "'triton'",
        repr(jax.default_backend()),
        "'reference'",
        "pip install 'gdn_lossless_jax[triton]'",
    ):
        assert needle in msg, (needle, msg)


@pytest.mark.skipif(ON_GPU, reason="tests the error raised off the GPU")
def test_unavailable_through_the_api():
    x = verify_inputs(0, Shape(N=1, D=2, H=1, HV=2, K=8, V=8))
    with pytest.raises(gl.BackendUnavailable, match="backend 'triton'"):
        gl.verify(**x, backend="triton")


def test_package_imports_without_triton():
    import gdn_lossless_jax.backends.triton as tb

    assert {"verify", "replay", "commit", "check_available"} <= set(tb.__all__)


# ---------------------------------------------------------------------------------------
# The shared suite (tests/equivalence.py), against the backend's own snapshot path.
# ---------------------------------------------------------------------------------------
@requires_triton
@pytest.mark.parametrize("shape,state_dtype", MATRIX)
def test_equivalence(shape, state_dtype, seed):
    case = make_case("triton", seed, shape, state_dtype=state_dtype)
    check_outputs(case)
    check_replay_every_step(case)
    check_commit(case)
    # Cross-backend: XLA's replay (the reference) of the Triton tape gives the Triton snapshots.
    check_replay_every_step(dataclasses.replace(case, backend="reference"))


@requires_triton
@pytest.mark.parametrize("kind", ["normal", "mixed"])
def test_controls_are_caught(kind, seed):
    # fp32 pool: a bf16 pool rounds a 1-ULP fp32 drift away almost always.
    case = make_case("triton", seed, Shape(N=4, D=4, H=2, HV=4, K=128, V=128), state_dtype=F32, kind=kind)
    check_controls(case)


# ---------------------------------------------------------------------------------------
# Cross-backend tapes, in both directions, and the in-kernel controls.
# ---------------------------------------------------------------------------------------
@requires_triton
@pytest.mark.parametrize("state_dtype", [F32, BF16])
@pytest.mark.parametrize("kind", ["normal", "mixed"])
def test_reference_replay_of_triton_tape(kind, state_dtype, seed):
    x = verify_inputs(seed, SHAPE, kind=kind, state_dtype=state_dtype)
    _, tup = gl.verify(**x, record="tuples", backend="triton")
    _, snp = gl.verify(**x, record="snapshots", backend="triton")
    for step in range(-1, SHAPE.D):
        steps = jnp.full((SHAPE.N,), step, jnp.int32)
        want = x["state0"] if step < 0 else snp.states[:, step]
        assert_bitwise_equal(want, gl.replay(x["state0"], tup, steps, backend="reference"), f"reference, step {step}")
        assert_bitwise_equal(want, gl.replay(x["state0"], tup, steps, backend="triton"), f"triton, step {step}")


@requires_triton
@pytest.mark.parametrize("state_dtype", [F32, BF16])
def test_triton_replay_of_reference_tape(state_dtype, seed):
    """The other direction: the commit kernel rebuilds XLA:GPU's snapshots from its tape."""
    x = verify_inputs(seed, SHAPE, kind="mixed", state_dtype=state_dtype)
    _, tup = gl.verify(**x, record="tuples", backend="reference")
    _, snp = gl.verify(**x, record="snapshots", backend="reference")
    steps = jnp.asarray(np.arange(SHAPE.N) % SHAPE.D, jnp.int32)
    want = snp.states[jnp.arange(SHAPE.N), steps]
    assert_bitwise_equal(want, gl.replay(x["state0"], tup, steps, backend="triton"))


@requires_triton
def test_outputs_agree_with_the_reference(seed):
    """Within 2e-3 relative (max-norm), in float32: reductions are ordered differently."""
    x = verify_inputs(seed, SHAPE, kind="normal")
    for record in gl.RECORD_MODES:
        ref, ref_tape = gl.verify(**x, record=record, backend="reference", out_dtype=F32)
        got, got_tape = gl.verify(**x, record=record, backend="triton", out_dtype=F32)
        ref, got = np.asarray(ref), np.asarray(got)
        assert np.abs(got - ref).max() / np.abs(ref).max() < 2e-3
        for a, b in zip(jax.tree.leaves(ref_tape), jax.tree.leaves(got_tape), strict=True):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            assert np.abs(a - b).max() / (np.abs(a).max() + 1e-30) < 2e-3


@requires_triton
def test_in_kernel_control_replays_drift(seed):
    tb = backends.resolve("triton", "replay")
    x = verify_inputs(seed, SHAPE, kind="normal")
    _, tup = gl.verify(**x, record="tuples", backend="triton")
    _, snp = gl.verify(**x, record="snapshots", backend="triton")
    last = jnp.full((SHAPE.N,), SHAPE.D - 1, jnp.int32)
    assert_bitwise_equal(snp.states[:, -1], tb.replay(x["state0"], tup, last), "the rule")
    for form in tb.CONTROL_FORMS:
        report = assert_bitwise_differs(snp.states[:, -1], tb.replay(x["state0"], tup, last, form=form), form)
        assert report.max_ulp >= 1


@requires_triton
def test_in_kernel_one_expression_replay_drifts(seed):
    """``S * alpha + k * u`` in the commit kernel with fp fusion on: the compiler decides.

    Compiled as jax-triton specialises the kernel, Triton 3.6 fuses ``S * alpha`` for sm_90
    at 32 rows on 2 warps (seen in the PTX by scripts/triton_interpret_check.py), so the
    replay drifts. Which product it fuses depends on the launch and the pool's dtype: at the
    default 8 rows on one warp it fuses ``k * u`` for an fp32 pool (the rule, by luck) and
    ``S * alpha`` for a bf16 one; the rule is written out for this reason. A failure here
    means the compiler's choice at 32 rows on 2 warps changed: not a library bug, but this
    test's premise.
    """
    tb = backends.resolve("triton", "replay")
    x = verify_inputs(seed, SHAPE, kind="normal")
    _, tup = gl.verify(**x, record="tuples", backend="triton")
    _, snp = gl.verify(**x, record="snapshots", backend="triton")
    last = jnp.full((SHAPE.N,), SHAPE.D - 1, jnp.int32)
    naive = tb.replay(x["state0"], tup, last, form="naive", config=tb.CommitConfig(block_v=32, num_warps=2))
    report = assert_bitwise_differs(snp.states[:, -1], naive, "naive")
    assert report.max_ulp >= 1


# ---------------------------------------------------------------------------------------
# Launch configurations, tape pitch, in-place commit.
# ---------------------------------------------------------------------------------------
VERIFY_CONFIGS = [
    {"block_v": 16, "num_warps": 2},
    {"block_v": 32, "num_warps": 4, "k_chunk": 32},
    {"block_v": 64, "num_warps": 8, "k_chunk": 128},
    {"block_v": 128, "num_warps": 8},
    {"order": "tiles", "evict": "", "prep_heads": 16},
    {"order": "requests", "prep_heads": 1, "num_stages": 2},
    {"chain": "chunks"},
    {"chain": "chunks", "block_v": 16, "num_warps": 2},
    {"chain": "rows", "block_v": 32},
    {"chain": "rows", "block_v": 4, "order": "tiles"},
    {"chain": "rows", "unroll": False},
    {"chain": "rows", "unroll": True, "block_v": 16},
]


@requires_triton
@pytest.mark.parametrize("D", [1, 3, 8])
def test_the_unrolled_rows_chain_gives_the_loops_bits(D, seed):
    """``VerifyConfig.unroll`` changes the schedule, never a bit: the rows chain unrolled and as
    a loop, both record modes, fp32 and bf16 states, the pool form with a padding slot."""
    tb = backends.resolve("triton", "verify")
    shape = Shape(N=5, D=D, H=4, HV=8, K=128, V=96)  # the last tile's rows masked by V
    for dtype in (F32, BF16):
        x = verify_inputs(seed, shape, kind="mixed", state_dtype=dtype)
        pool = x.pop("state0")[None]
        pool = jnp.concatenate([pool, pool[:, :2] * 0.5], axis=1)  # 7 slots; request 2 reads a padding slot
        slots = jnp.array([0, 3, -1, 2, 4], jnp.int32)
        for record in gl.RECORD_MODES:
            kw = {"record": record, "scale": 128**-0.5, "out_dtype": jnp.dtype(BF16), "slots": slots, "layer": 0}
            loop = backend_verify(tb, pool, **x, **kw, config=tb.VerifyConfig(chain="rows", unroll=False))
            unrolled = backend_verify(tb, pool, **x, **kw, config=tb.VerifyConfig(chain="rows", unroll=True))
            assert_bitwise_equal(loop, unrolled, f"{record}, {jnp.dtype(dtype).name} state, D={D}")


@requires_triton
@pytest.mark.parametrize("fields", VERIFY_CONFIGS, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
def test_any_verify_config_replays_exactly(fields, seed):
    """Tiles, warps, chunks, and the grid's order may change the reductions, never
    the replay of the verify's own tape."""
    tb = backends.resolve("triton", "verify")
    cfg = tb.VerifyConfig(**fields)
    x = verify_inputs(seed, SHAPE, kind="mixed", state_dtype=BF16)
    kw = dict(scale=128**-0.5, out_dtype=jnp.dtype(BF16), config=cfg)
    o_t, tup = backend_verify(tb, **x, record="tuples", **kw)
    o_s, snp = backend_verify(tb, **x, record="snapshots", **kw)
    assert_bitwise_equal(o_s, o_t, "outputs of the two record modes")
    for step in range(SHAPE.D):
        steps = jnp.full((SHAPE.N,), step, jnp.int32)
        assert_bitwise_equal(snp.states[:, step], tb.replay(x["state0"], tup, steps), f"step {step}")


@requires_triton
@pytest.mark.parametrize("record", gl.RECORD_MODES)
def test_commit_in_place_under_donation(record, seed):
    case = make_case("triton", seed, Shape(N=5, D=4, H=4, HV=16, K=128, V=128), state_dtype=F32)
    tape = case.tuples if record == "tuples" else case.snapshots
    args = case.idx.as_args()
    want = gl.commit(case.pool, tape, *args, backend="triton")
    donated = jax.jit(lambda p, t, *a: gl.commit(p, t, *a, backend="triton"), donate_argnums=0)
    got = donated(jnp.array(case.pool, copy=True), tape, *args)
    assert_bitwise_equal(want, got)
    # The reference's commit of the same tape agrees (snapshots: exactly; tuples: exp is
    # libdevice's in both on the GPU).
    assert_bitwise_equal(jax.jit(reference.commit)(case.pool, tape, *args), got)


@requires_triton
@pytest.mark.parametrize("fields", [{"block_v": 32, "num_warps": 2}, {"block_v": 16, "num_warps": 4}],
                         ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))  # fmt: skip
def test_any_commit_launch_is_exact(fields, seed):
    """Other replay launches than the default (8 rows on one warp) change no bit: the shared
    suite's commit check (tuple commit == snapshot commit == the expected writes, untouched
    slots kept) with the launch; the other product's form (a control) differs."""
    tb = backends.resolve("triton", "commit")
    case = make_case("triton", seed, Shape(N=5, D=4, H=4, HV=16, K=128, V=128), state_dtype=F32, kind="mixed")
    commit = functools.partial(tb.commit, config=tb.CommitConfig(**fields))
    by_tuples = check_commit(case, commit)
    control = commit(case.pool, case.tuples, *case.idx.as_args(), form="other_product")
    assert_bitwise_differs(by_tuples, control, "other_product")


@requires_triton
def test_commit_reads_the_tape_pitch_from_its_shape(seed):
    """A tape buffer with more rows than requests (R > N): rows[i] picks the row."""
    case = make_case("triton", seed, Shape(N=3, D=3, H=4, HV=16, K=128, V=128), state_dtype=BF16, extra_rows=9)
    check_commit(case)


@pytest.mark.parametrize(
    "fields,needle",
    [
        ({"block_v": 12}, "block_v must be a power of 2, got 12"),
        ({"k_chunk": 0}, "k_chunk must be a power of 2, got 0"),
        ({"prep_heads": 3}, "prep_heads must be a power of 2, got 3"),
        ({"order": "heads"}, "order must be None or one of ('requests', 'tiles'), got 'heads'"),
        ({"evict": "evict_never"}, "evict must be '', 'evict_first' or 'evict_last', got 'evict_never'"),
        ({"chain": "lanes"}, "chain must be None or one of ('chunks', 'rows'), got 'lanes'"),
        ({"unroll": 4}, "unroll must be None, True or False, got 4"),
    ],
)
def test_verify_config_rejects_bad_fields(fields, needle):
    """Checked when the config is made (no GPU needed), naming the field and the value."""
    from gdn_lossless_jax.backends.triton import VerifyConfig

    with pytest.raises(ValueError, match="VerifyConfig") as e:
        VerifyConfig(**fields)
    assert needle in str(e.value)


def test_verify_launch_sizes():
    """The grids and constexpr sizes, computed without Triton: tiles first for snapshots and
    requests first for tuples unless ``order`` says otherwise; chunks and tiles that overhang
    K and V round up (the kernel masks them); the rows chain's lanes (at most 32, and a
    program's rows at most its lanes), the default's chain by D; the prologue's head groups."""
    from gdn_lossless_jax.backends.triton.verify import VerifyConfig, launch_sizes, prep_launch

    state, q = (25, 32, 128, 128), (25, 4, 16, 128)
    sizes, grid = launch_sizes(state, q, VerifyConfig(), "snapshots")
    assert grid == (16, 32, 25) and sizes["TILES_FIRST"] and (sizes["C"], sizes["NC"], sizes["BV"]) == (16, 8, 8)
    sizes, grid = launch_sizes(state, q, VerifyConfig(), "tuples")
    assert grid == (25, 32, 16) and not sizes["TILES_FIRST"]
    assert launch_sizes(state, q, VerifyConfig(order="tiles"), "tuples")[1] == (16, 32, 25)
    assert launch_sizes(state, q, VerifyConfig(order="requests"), "snapshots")[1] == (25, 32, 16)
    sizes, grid = launch_sizes((5, 6, 20, 24), (5, 3, 2, 24), VerifyConfig(), "tuples")
    assert grid == (5, 6, 3) and (sizes["C"], sizes["NC"], sizes["BV"]) == (16, 2, 8)
    assert launch_sizes((1, 2, 4, 8), (1, 1, 1, 8), VerifyConfig(block_v=32, k_chunk=64))[0]["BV"] == 4
    rows = lambda **f: launch_sizes(state, q, VerifyConfig(chain="rows", **f))[0]  # noqa: E731
    assert {k: rows()[k] for k in ("LANES", "KP", "LOG_E", "LOG_BV", "LOG_G")} == dict(LANES=32, KP=128, LOG_E=2,
                                                                                      LOG_BV=3, LOG_G=2)  # fmt: skip
    assert rows(block_v=64)["BV"] == 32 and rows(block_v=64)["LOG_G"] == 0  # at most a row a lane
    small = launch_sizes((1, 2, 20, 12), (1, 1, 1, 12), VerifyConfig(chain="rows", block_v=32))
    assert small[0]["LANES"] == 16 and small[0]["BV"] == 16 and small[0]["LOG_E"] == 0 and small[1] == (1, 2, 2)
    assert "LANES" not in launch_sizes(state, q, VerifyConfig(chain="chunks"))[0]
    assert launch_sizes(state, q, VerifyConfig())[0]["UNROLL"]  # the default: rows, unrolled, up to 8 drafts
    assert launch_sizes(state, (25, 8, 16, 128), VerifyConfig())[0]["UNROLL"]
    assert "LANES" not in launch_sizes(state, (25, 9, 16, 128), VerifyConfig())[0]  # chunks above
    assert not launch_sizes(state, q, VerifyConfig(unroll=False))[0]["UNROLL"]
    assert launch_sizes(state, (25, 16, 16, 128), VerifyConfig(chain="rows", unroll=True))[0]["UNROLL"]
    assert not launch_sizes(state, (25, 16, 16, 128), VerifyConfig(chain="rows"))[0]["UNROLL"]
    sizes, grid = prep_launch(q, 32, VerifyConfig())
    assert grid == (25, 4, 8) and (sizes["PH"], sizes["BR"], sizes["BK"]) == (2, 4, 128)
    sizes, grid = prep_launch((5, 3, 3, 24), 6, VerifyConfig(prep_heads=4))
    assert grid == (5, 3, 1) and (sizes["PH"], sizes["BR"], sizes["BK"]) == (4, 8, 32)


# ---------------------------------------------------------------------------------------
# KDA (decay="channel"): one decay per key channel, the KDATuples tape.
# ---------------------------------------------------------------------------------------
#: H = HV = 4; Kimi-Linear-48B-A3B's KDA heads (H = HV = 32, K = V = 128) at a small N; the chunk chain (D > 8).
KDA_SHAPES = [
    pytest.param(Shape(N=5, D=4, H=4, HV=4, K=128, V=128), id="H4-K128"),
    pytest.param(Shape(N=2, D=4, H=32, HV=32, K=128, V=128), id="kimi-linear-48b"),
    pytest.param(Shape(N=3, D=12, H=4, HV=4, K=128, V=128), id="H4-K128-D12-chunks"),
]
KDA_NAMES = ("q", "k", "v", "a", "b", "A_log", "dt_bias")


def _scalar_decay(tape):
    """Control: a KDA tape's per-channel decay applied as one factor per head (g averaged over K): a GDN tape."""
    return Tuples(u=tape.u, k=tape.k, g=tape.g.mean(-1))


def _flat_channels(x):
    """Control inputs: each head's per-channel gate inputs (``a``, ``dt_bias``) replaced by their mean over K, so
    every key channel of a head decays alike (the per-channel decay applied as a scalar)."""
    flat = lambda t: jnp.broadcast_to(t.astype(F32).mean(-1, keepdims=True), t.shape).astype(t.dtype)  # noqa: E731
    return dict(x, a=flat(x["a"]), dt_bias=flat(x["dt_bias"]))


@requires_triton
@pytest.mark.parametrize("state_dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", KDA_SHAPES)
def test_kda_equivalence(shape, state_dtype, seed):
    """KDA in the Triton kernels: both record modes' outputs, every step's replay of the tuple tape (the commit
    kernel's and the reference's) and the tuple commit equal the snapshots bit for bit (L = 2, a track copy,
    permuted and invalid rows, untouched slots kept). Controls: the tape's decay applied as one factor per head (g
    averaged over K) replays and commits other bits; on fp32 pools the in-kernel update controls and the
    accepted-first ordering are caught too."""
    case = make_case("triton", seed, shape, state_dtype=state_dtype, decay="channel")
    assert type(case.tuples) is KDATuples and case.tuples.g.shape[-2:] == (shape.HV, shape.K)
    check_outputs(case)
    check_replay_every_step(case)
    by_tuples = check_commit(case)
    check_replay_every_step(dataclasses.replace(case, backend="reference"))  # XLA's replay of the Triton tape
    control = gl.commit(case.pool, _scalar_decay(case.tuples), *case.idx.as_args(), backend="triton")
    assert_bitwise_differs(by_tuples, control, "control: the per-channel decay as one factor per head (commit)")
    tup, snp = layer_tapes(case, 0)
    last = jnp.full((shape.N,), shape.D - 1, jnp.int32)
    valid = (case.idx.rows >= 0) & (case.idx.rows < case.tuples.u.shape[1])
    replayed = gl.replay(case.states0[0], _scalar_decay(tup), last, backend="triton")
    assert_bitwise_differs(np.asarray(snp.states[:, -1])[valid], np.asarray(replayed)[valid],
                           "control: the per-channel decay as one factor per head (replay)")  # fmt: skip
    if state_dtype == F32:  # a bf16 pool rounds a 1-ULP fp32 drift away almost always
        check_controls(case)


@requires_triton
@pytest.mark.parametrize("shape", KDA_SHAPES)
def test_kda_outputs(shape, seed):
    """Both record modes' outputs bit for bit, close to the reference's (2e-3 relative: the reductions' order and
    the norms differ), the tape a KDATuples with g [N, D, HV, K]. Control: the per-channel decay made one per head
    (the gate inputs averaged over K) changes the outputs."""
    x = channel_verify_inputs(seed, shape, kind="mixed")
    run = {r: gl.verify(**x, record=r, decay="channel", backend="triton", out_dtype=F32) for r in gl.RECORD_MODES}
    (o_t, tup), (o_s, snp) = run["tuples"], run["snapshots"]
    assert type(tup) is KDATuples and tup.g.shape == (shape.N, shape.D, shape.HV, shape.K)
    assert_bitwise_equal(o_s, o_t, "KDA outputs: tuples == snapshots")
    flat, _ = gl.verify(**_flat_channels(x), record="tuples", decay="channel", backend="triton", out_dtype=F32)
    assert_bitwise_differs(o_t, flat, "control: the per-channel decay as one per head (outputs)")
    ref, _ = gl.verify(**x, record="tuples", decay="channel", backend="reference", out_dtype=F32)
    ref, got = np.asarray(ref), np.asarray(o_t)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 2e-3


KDA_FUSED_LAUNCHES = [{}, {"chain": "chunks", "pending_replay": "rows"}, {"chain": "chunks", "pending_replay": "split"}]


@requires_triton
@pytest.mark.parametrize("fields", KDA_FUSED_LAUNCHES, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()) or "default")
@pytest.mark.parametrize("record", gl.RECORD_MODES)
@pytest.mark.parametrize("state_dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", KDA_SHAPES[:2])
def test_kda_fused_pending_equals_commit_then_verify(shape, state_dtype, record, fields, seed):
    """The fused step with a KDATuples tape pending (``commit_and_verify``) == the commit of that layer, then the
    verify, with the same launch: the pool (the other layer untouched), the outputs and the tape written into a
    buffer at permuted rows, bit for bit. Control: the pending commit with the per-channel decay applied as one
    factor per head gives another pool."""
    tb = backends.resolve("triton", "verify")
    config = tb.VerifyConfig(**fields)
    case = make_case("triton", seed, shape, state_dtype=state_dtype, decay="channel")  # the previous step
    slots, steps, tslots, tsteps, rows = case.idx.as_args()
    layer = 1
    y = channel_verify_inputs(seed + 1, shape, kind="mixed")  # this step's drafts
    inputs = [y[n] for n in KDA_NAMES]
    # the new tape goes into another buffer (random rows elsewhere) at the permuted rows
    fill = np.random.default_rng(seed + 2)
    buf = jax.tree.map(lambda t: jnp.asarray(fill.standard_normal(t.shape, dtype=np.float32)).astype(t.dtype),
                       case.tuples if record == "tuples" else case.snapshots)  # fmt: skip
    kw = dict(slots=slots, layer=layer, tape=buf, rows=rows, record=record, decay="channel")
    call = commit_and_verify_args("test", case.pool, gl.Pending(case.tuples, rows, steps, tslots, tsteps), *inputs,
                                  **kw)  # fmt: skip
    o_f, tape_f, pool_f = tb.verify(call, config=config)
    committed = gl.commit(case.pool, case.tuples, slots, steps, tslots, tsteps, rows, backend="triton")
    want_pool = case.pool.at[layer].set(committed[layer])  # the pending commit is this layer's
    o_w, tape_w = backend_verify(tb, want_pool, *inputs, **kw, config=config)
    assert_bitwise_equal(want_pool, pool_f, "fused pool == commit, then verify")
    assert_bitwise_equal(o_w, o_f, "fused outputs")
    for got, want in zip(jax.tree.leaves(tape_f), jax.tree.leaves(tape_w), strict=True):
        assert_bitwise_equal(want, got, f"fused {record} tape")
    control = gl.commit(case.pool, _scalar_decay(case.tuples), slots, steps, tslots, tsteps, rows, backend="triton")
    assert_bitwise_differs(pool_f[layer], control[layer], "control: the pending commit's decay as one per head")


@requires_triton
@pytest.mark.parametrize("shape", KDA_SHAPES[:1])
def test_kda_tape_buffer_and_stacked_inputs(shape, seed):
    """The KDA prologue's tape written into a buffer at ``[tape layer, rows[n]]``: each valid row equals the fresh
    tape's, every other row keeps its bits; inputs stacked over the pool's layers read at ``layer`` give the same
    outputs and tape. Control: the written rows differ from the buffer's filler before."""
    N, D, L = shape.N, shape.D, 2
    x = channel_verify_inputs(seed, shape, kind="mixed")
    pool = jnp.stack([x["state0"], 0.5 * x["state0"][::-1]])
    slots = jnp.arange(N, dtype=jnp.int32)
    rows = jnp.asarray(np.random.default_rng(seed).permutation(N + 2)[:N], jnp.int32).at[-1].set(N + 5)  # one out
    rng = np.random.default_rng(seed + 1)
    filler = lambda *s: jnp.asarray(-np.abs(rng.standard_normal(s, dtype=np.float32)))  # noqa: E731
    buf = KDATuples(u=filler(L, N + 2, D + 1, shape.HV, shape.V), k=filler(L, N + 2, D + 1, shape.H, shape.K),
                    g=filler(L, N + 2, D + 1, shape.HV, shape.K))  # fmt: skip
    inputs = [x[n] for n in KDA_NAMES]
    o, fresh = gl.verify(pool, *inputs, slots=slots, layer=1, decay="channel", backend="triton")
    o_b, into = gl.verify(pool, *inputs, slots=slots, layer=1, tape=buf, rows=rows, decay="channel", backend="triton")
    assert_bitwise_equal(o, o_b, "outputs with the tape in a buffer")
    r = np.asarray(rows)
    ok = (r >= 0) & (r < N + 2)
    for name in ("u", "k", "g"):
        want = np.array(getattr(buf, name))
        want[1, r[ok], :D] = np.asarray(getattr(fresh, name))[ok]
        assert_bitwise_equal(want, getattr(into, name), f"tape buffer {name}")
        assert_bitwise_differs(np.asarray(getattr(buf, name))[1, r[ok], :D], np.asarray(getattr(into, name))[1, r[ok], :D],
                               f"control: buffer {name} rows before the write")  # fmt: skip
    stacked = [jnp.stack([t[::-1], t]) for t in inputs]  # layer 0's inputs reversed, layer 1's these
    o_s, tape_s = gl.verify(pool, *stacked, slots=slots, layer=1, decay="channel", backend="triton")
    assert_bitwise_equal(o, o_s, "outputs from inputs stacked over layers")
    for got, want in zip(jax.tree.leaves(tape_s), jax.tree.leaves(fresh), strict=True):
        assert_bitwise_equal(want, got, "tape from inputs stacked over layers")
