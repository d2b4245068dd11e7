"""The portable mode (``math="portable"``): its functions' accuracy and special values, the same
bits in every program form (with the platform ``exp`` as the control), the mode's verify and
commit against the snapshot path, the fixtures recorded on other platforms, and a GPU test that
compares a GPU's portable verify with the CPU's bit for bit."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import gdn_lossless_jax as gl
from gdn_lossless_jax import backends, pool as gpool, portable, reference
from gdn_lossless_jax.testing import assert_bitwise_equal, compare_bitwise

from conftest import requires_gpu

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = sorted((ROOT / "tests/fixtures/portable").glob("*.npz"))
CANONICAL_NAN = np.uint32(0x7FFFFFFF)


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / f"scripts/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fixtures = _script("portable_fixtures")
from gdn_lossless_jax.tools.accuracy import ulp_error  # noqa: E402


def _u32(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


def _floats(rng, n, lo, hi):
    return rng.uniform(lo, hi, n).astype(np.float32)


# ---------------------------------------------------------------------------------
# Accuracy and special values.
# ---------------------------------------------------------------------------------
def test_exp_accuracy():
    """Within 0.52 ULP of float64 where the result is normal (0.8 where it is subnormal), and
    correctly rounded in all but a small fraction: every 4th float32 of [-1, -0.5) (a decay
    binade), every 256th of [-104, -2**-25] and [2**-25, 88.72], random inputs of the subnormal
    results. (python -m gdn_lossless_jax.tools.accuracy sweeps every float32 of a range.)"""
    exp = jax.jit(portable.exp)
    m = np.arange(np.float32(0.5).view(np.uint32), np.float32(1.0).view(np.uint32), 4, dtype=np.uint32)
    lo, hi = int(np.float32(2.0**-25).view(np.uint32)), int(np.float32(104).view(np.uint32))
    strided = np.arange(lo, hi, 256, dtype=np.uint32)
    neg = (strided | np.uint32(1 << 31)).view(np.float32)
    pos = strided.view(np.float32)
    pos = pos[pos <= 88.72]
    x = np.concatenate([(m | np.uint32(1 << 31)).view(np.float32), neg, pos])
    y = np.asarray(exp(x))
    ref = np.exp(x.astype(np.float64))
    normal = ref >= 2.0**-126
    e = ulp_error(y, ref)
    assert e[normal].max() <= 0.52, (e[normal].max(), x[normal][np.argmax(e[normal])])
    wrong = np.count_nonzero(_u32(y) != _u32(ref.astype(np.float32)))
    assert wrong / len(x) < 0.005, wrong
    sub = _floats(np.random.default_rng(1), 200_000, -103.9, -87.34)
    e = ulp_error(np.asarray(exp(sub)), np.exp(sub.astype(np.float64)))
    assert e.max() < 0.8, e.max()


def test_log_accuracy():
    """Within 0.9 ULP of float64 (0.888 over every float32 of [1, 4], gdn_lossless_jax.tools.accuracy)
    over positive floats of every binade, subnormals included, and over softplus's arguments."""
    rng = np.random.default_rng(2)
    everywhere = rng.integers(1, 0x7F800000, 1_000_000, dtype=np.uint32).view(np.float32)
    softplus_args = _floats(rng, 500_000, 1.0, 5e8)
    for x in (everywhere, softplus_args):
        e = ulp_error(np.asarray(jax.jit(portable.log)(x)), np.log(x.astype(np.float64)))
        assert e.max() < 0.9, (e.max(), x[np.argmax(e)])


def _special_bits(rng, n):
    """Random bit patterns, a third of them subnormal, plus zeros, infinities and NaNs."""
    b = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    b[: n // 3] &= np.uint32(0x807FFFFF)  # subnormals (and zeros)
    b[-8:] = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 1, 0x80000001]
    return b.view(np.float32)


def _assert_ieee(ours, numpy_result):
    ours, want = np.asarray(ours), np.asarray(numpy_result, np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(ours), nan)
    assert (_u32(ours)[nan] == CANONICAL_NAN).all()
    assert np.array_equal(_u32(ours)[~nan], _u32(want)[~nan]), np.count_nonzero(_u32(ours)[~nan] != _u32(want)[~nan])


def test_div_and_sqrt_correctly_rounded():
    """Bit for bit NumPy's IEEE division and square root (subnormals kept), specials included."""
    rng = np.random.default_rng(3)
    x, y = _special_bits(rng, 300_000), _special_bits(rng, 300_000)[::-1].copy()
    with np.errstate(all="ignore"):
        _assert_ieee(jax.jit(portable.div)(x, y), x / y)
        _assert_ieee(jax.jit(portable.sqrt)(x), np.sqrt(x))


def test_special_values():
    exp, log = jax.jit(portable.exp), jax.jit(portable.log)
    inf, nan = np.float32(np.inf), np.float32(np.nan)
    x = np.float32([0.0, -0.0, 1e-45, -1e-45, 2.0**-126, 88.72283, 88.7229, 1e30, -87.33655, -103.97, -104.0, -1e30,
                    inf, -inf, nan])  # fmt: skip
    y = _u32(exp(x))
    with np.errstate(over="ignore"):
        want = _u32(np.exp(x.astype(np.float64)).astype(np.float32))
    assert np.array_equal(y[:-1], want[:-1]), (x, y.view(np.float32), want.view(np.float32))
    assert y[-1] == CANONICAL_NAN
    assert y[list(x).index(np.float32(-104.0))] == 0 and y[6] == _u32(inf)  # underflow to 0, overflow to inf
    x = np.float32([0.0, -0.0, -1.0, inf, -inf, nan, 1.0, 1e-45, 2.0**-149 * 3, np.finfo(np.float32).max])
    y = _u32(log(x))
    assert list(y[:6]) == [_u32(-inf), _u32(-inf), CANONICAL_NAN, _u32(inf), CANONICAL_NAN, CANONICAL_NAN]
    assert y[6] == 0
    e = ulp_error(y[7:].view(np.float32), np.log(x[7:].astype(np.float64)))
    assert e.max() < 0.9, e


def test_gates_and_norms_near_float64():
    """softplus (and its threshold), sigmoid and l2norm: within a few ULP of float64."""
    rng = np.random.default_rng(4)
    x = _floats(rng, 100_000, -30, 30)
    sp = np.asarray(jax.jit(portable.softplus)(x))
    ref = np.where(x > 20, x.astype(np.float64), np.log1p(np.exp(x.astype(np.float64))))
    ok = x >= 0  # log(1 + exp(x)) rounds 1 + exp(x) first: below, its relative error grows (the formula's)
    assert ulp_error(sp[ok], ref[ok]).max() < 4
    assert np.array_equal(sp[x > 20], x[x > 20])
    sig = np.asarray(jax.jit(portable.sigmoid)(x))
    assert ulp_error(sig, 1 / (1 + np.exp(-x.astype(np.float64)))).max() < 3  # three roundings: exp, 1 +, 1 /
    v = rng.standard_normal((64, 128)).astype(np.float32)
    n = np.asarray(jax.jit(portable.l2norm)(v))
    v64 = v.astype(np.float64)
    assert ulp_error(n, v64 / np.sqrt((v64 * v64).sum(-1, keepdims=True) + 1e-6)).max() < 4


@pytest.mark.parametrize("n", [1, 3, 16, 128])
def test_pairwise_sum_is_the_reference_tree(n):
    """The portable sum adds in the reference's order (``reference.pairwise_sum``): the same bits
    on normal inputs; a plain ``jnp.sum`` (another order) differs somewhere (the control)."""
    x = np.random.default_rng(n).standard_normal((4096, n)).astype(np.float32) * np.float32(1e3)
    ours = jax.jit(portable.pairwise_sum)(x)
    assert_bitwise_equal(jax.jit(reference.pairwise_sum)(x), ours)
    if n >= 16:
        assert not compare_bitwise(np.sum(x, axis=-1, dtype=np.float32), ours).equal


# ---------------------------------------------------------------------------------
# One function in every program form.
# ---------------------------------------------------------------------------------
def _forms(fn, x):
    """``fn`` over ``x [R, C]`` as differently compiled programs: the whole array under jit,
    eagerly, vmapped over rows, a scan over rows, a batch of 5 rows padded to 8, the rows reshaped."""
    rows = x.shape[0]
    scan = jax.jit(lambda x: lax.scan(lambda c, r: (c, fn(r)), 0.0, x)[1])
    five = jax.jit(fn)(jnp.concatenate([x[:5], x[:3]]))[:5]
    return {
        "jit": jax.jit(fn)(x),
        "eager": fn(x),
        "vmap": jax.jit(jax.vmap(fn))(x),
        "scan": scan(x),
        "batch of 5": jnp.concatenate([five, jax.jit(fn)(x[5:])]),
        "flat": jax.jit(fn)(x.reshape(-1)).reshape(rows, -1),
    }


def test_exp_same_bits_in_every_program():
    """portable.exp gives one set of bits in every form; jnp.exp on this platform does not, or
    is not correctly rounded somewhere (the control: why the mode exists)."""
    g = -np.abs(np.random.default_rng(5).standard_normal((17, 136)).astype(np.float32)) * np.float32(3)
    forms = _forms(portable.exp, jnp.asarray(g))
    for name, y in forms.items():
        assert_bitwise_equal(forms["jit"], y, msg=name)
    plain = _forms(jnp.exp, jnp.asarray(g))
    differ = [n for n, y in plain.items() if not compare_bitwise(plain["jit"], y).equal]
    off = not compare_bitwise(fixtures_exp_oracle(g), plain["jit"]).equal
    assert differ or off, "jnp.exp was form-independent and correctly rounded here: the control shows nothing"


def fixtures_exp_oracle(g):
    """float64 exp rounded once to float32 (what portable.exp gives on all but ~0.1% of inputs)."""
    return np.exp(np.asarray(g, np.float64)).astype(np.float32)


def test_gates_and_norms_same_bits_in_every_program():
    rng = np.random.default_rng(6)
    a, b = (jnp.asarray(rng.standard_normal((8, 4)) * 4, jnp.bfloat16) for _ in range(2))
    A_log, dt_bias = (jnp.asarray(rng.standard_normal(4), jnp.float32) for _ in range(2))
    gates = lambda a, b: jnp.stack(portable.gates(a, b, A_log, dt_bias))  # noqa: E731
    assert_bitwise_equal(jax.jit(gates)(a, b), jax.jit(jax.vmap(gates, out_axes=1))(a, b), msg="vmap")
    q = jnp.asarray(rng.standard_normal((8, 3, 64)), jnp.float32)
    scan = jax.jit(lambda q: lax.scan(lambda c, r: (c, portable.l2norm(r)), 0.0, q)[1])
    assert_bitwise_equal(jax.jit(portable.l2norm)(q), scan(q), msg="scan")


# ---------------------------------------------------------------------------------
# The mode: verify, replay, commit.
# ---------------------------------------------------------------------------------
N, D, H, HV, K, V = 3, 4, 2, 4, 16, 16


def _inputs(seed=7):
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    bf = lambda *s: jnp.asarray(f(*s), jnp.bfloat16)  # noqa: E731
    return (jnp.asarray(0.5 * f(N, HV, V, K)), bf(N, D, H, K), bf(N, D, H, K), bf(N, D, HV, V),
            jnp.asarray(3 * f(N, D, HV), jnp.bfloat16), bf(N, D, HV), jnp.asarray(f(HV)), jnp.asarray(f(HV)))


def test_portable_verify_replays_its_snapshots():
    """math="portable": both record modes give the same outputs, the replay of the tuple tape (with
    the portable exp) every snapshot, bit for bit. (The control, that the default mode gives other
    bits, is test_fixture_reproduces's.)"""
    args = _inputs()
    out_t, tuples = gl.verify(*args, math="portable")
    out_s, snaps = gl.verify(*args, math="portable", record="snapshots")
    assert_bitwise_equal(out_s, out_t)
    for t in range(D):
        steps = jnp.full((N,), t, jnp.int32)
        assert_bitwise_equal(snaps.states[:, t], gl.replay(args[0], tuples, steps, math="portable"), msg=f"step {t}")


def test_commit_and_verify_portable():
    """The fused step in portable mode equals commit then verify."""
    args = _inputs(8)
    state0, rest = args[0], args[1:]
    pool = jnp.stack([state0[0], state0[1], state0[2], jnp.zeros_like(state0[0])])  # [S=4, HV, V, K]
    slots = jnp.array([2, 0, 1], jnp.int32)
    _, prev = gl.verify(pool, *rest, slots=slots, math="portable")
    rows, steps = jnp.arange(N, dtype=jnp.int32), jnp.array([1, 3, -1], jnp.int32)
    none = jnp.full((N,), -1, jnp.int32)
    pending = gl.Pending(prev, rows, steps, none, none)
    out, tape, fused = gl.commit_and_verify(pool, pending, *rest, slots=slots, math="portable")
    committed = gl.commit(pool[None], jax.tree.map(lambda x: x[None], prev), slots, steps, math="portable")[0]
    out2, tape2 = gl.verify(committed, *rest, slots=slots, math="portable")
    assert_bitwise_equal((committed, out2, tape2), (fused, out, tape))


def test_pool_math_attribute():
    """pool.allocate(math="portable"): verify_layer and commit use the mode (the snapshot and tuple
    pools commit the same SSM states), and the pool says so."""
    g = gl.get_geometry("qwen3.6-35b-a3b").reduced(gdn_layers=1, heads_divisor=8, head_dim=16)
    rng = np.random.default_rng(9)
    C, HVg = g.conv_dim, g.num_v_heads
    params = dict(conv_weight=jnp.asarray(rng.standard_normal((C, g.conv_kernel)), jnp.float32),
                  conv_bias=None, A_log=jnp.asarray(rng.standard_normal(HVg), jnp.float32),
                  dt_bias=jnp.asarray(rng.standard_normal(HVg), jnp.float32))  # fmt: skip
    x = jnp.asarray(rng.standard_normal((2, 3, C)), jnp.bfloat16)
    a, b = (jnp.asarray(rng.standard_normal((2, 3, HVg)), jnp.bfloat16) for _ in range(2))
    ssm0 = jnp.asarray(0.5 * rng.standard_normal((1, 5, HVg, g.head_v_dim, g.head_k_dim)), jnp.float32)
    slots, steps = jnp.array([1, 3]), jnp.array([2, 0])
    pools = {}
    for record in ("tuples", "snapshots"):
        p = gpool.allocate(g, slots=4, requests=2, drafts=3, record=record, math="portable")
        assert p.math == "portable"
        p = p.replace(ssm=ssm0.copy())
        _, p = gpool.verify_layer(p, 0, x, a, b, **params, slots=slots)
        pools[record] = gpool.commit(p, slots, steps)
    assert_bitwise_equal(pools["snapshots"].ssm, pools["tuples"].ssm)
    with pytest.raises(ValueError, match="math must be one of"):
        gpool.allocate(g, slots=4, requests=2, drafts=3, math="exact")


def test_other_backends_refuse_the_mode():
    """triton and mosaic refuse math="portable" by name (where they run at all); pallas refuses it
    on a GPU (it runs it in interpret mode); an unknown mode is a ValueError."""
    args = _inputs()
    with pytest.raises(ValueError, match="math must be one of"):
        gl.verify(*args, math="fast")
    refusing = ["triton", "mosaic"] + ([] if backends.platform() == "cpu" else ["pallas"])
    for name in refusing:
        with pytest.raises(backends.BackendUnavailable) as e:
            gl.verify(*args, math="portable", backend=name)
        try:
            backends.resolve(name, "verify")
        except backends.BackendUnavailable:
            continue  # not available here at all: that error came first
        assert f"backend {name!r}" in str(e.value) and "math='portable'" in str(e.value)
        _, tape = gl.verify(*args, math="portable")
        one = jax.tree.map(lambda t: t[None], tape)
        with pytest.raises(backends.BackendUnavailable, match="math='portable'"):
            gl.commit(args[0][None], one, jnp.arange(N), jnp.zeros(N, jnp.int32), math="portable", backend=name)


def test_auto_picks_a_backend_that_runs_the_mode(monkeypatch):
    """``backend="auto"`` with ``math="portable"`` resolves to a backend implementing the mode here
    (on a GPU the reference: the Pallas kernels run it in interpret mode only), so the documented
    flow runs as written on every platform and gives the reference's bits. Control: on a GPU,
    ``"auto"`` with the default math is the Pallas backend, which refuses the mode."""
    args = _inputs()
    impl = backends.resolve("auto", "verify", "portable")
    backends.check_math(impl, "verify", "portable")  # raises if it does not implement it
    got = gl.verify(*args, math="portable")
    want = gl.verify(*args, math="portable", backend="reference")
    assert_bitwise_equal(want, got, "auto vs reference, math='portable'")
    # A GPU platform, as the resolver sees it: the Pallas kernels refuse the mode there.
    from gdn_lossless_jax.backends import pallas

    monkeypatch.setattr(backends, "platform", lambda: "gpu")
    monkeypatch.setattr(pallas, "_interpret", lambda: False)
    assert backends.resolve_name("auto") == "pallas"  # the control: the platform mode's pick
    with pytest.raises(backends.BackendUnavailable, match="math='portable'"):
        pallas.check_math("verify", "portable")
    assert backends.resolve_name("auto", "portable") == "reference"


@pytest.mark.skipif(backends.platform() != "cpu", reason="the pallas backend runs math='portable' in interpret mode only")
def test_pallas_interpret_portable_equals_reference():
    """The Pallas kernels in interpret mode (prologue: the portable gates and norms; chain: the
    portable exp and the K tree over its chunks; the replay kernel: the portable exp) give the
    reference's portable bits: outputs, tape and replayed states."""
    args = _inputs()
    want = gl.verify(*args, math="portable")
    got = gl.verify(*args, math="portable", backend="pallas")
    assert_bitwise_equal(want, got)
    steps = jnp.array([3, 1, -1], jnp.int32)
    tape = want[1]
    assert_bitwise_equal(gl.replay(args[0], tape, steps, math="portable"),
                         gl.replay(args[0], tape, steps, math="portable", backend="pallas"))  # fmt: skip


# ---------------------------------------------------------------------------------
# Across platforms: the fixtures, and the GPU against the CPU.
# ---------------------------------------------------------------------------------
FIELDS = ("outputs", "u", "tape_k", "g", "committed")


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_fixture_reproduces(path):
    """A fixture recorded in portable mode on any platform (scripts/portable_fixtures.py) is
    reproduced here bit for bit: outputs, tape and committed pool (the pool form: slots, layers,
    a track copy; the recording checked that the tuple and snapshot commits agree). The default mode
    here does not reproduce it (the control: this platform's exp, division and sums give other
    bits)."""
    f = np.load(path)
    meta = json.loads(str(f["meta"]))
    inp = fixtures.load_inputs(f)
    cpu = jax.devices("cpu")[0]
    ours = fixtures.run(inp, math="portable", device=cpu, records=("tuples",))  # (recording checked the snapshots)
    for name in FIELDS:
        assert_bitwise_equal(f[name], ours[name], msg=f"{path.name} ({meta}): {name}")
    plat = fixtures.run(inp, math="platform", device=cpu, records=("tuples",))
    assert not compare_bitwise(tuple(f[n] for n in FIELDS), tuple(plat[n] for n in FIELDS)).equal


def test_fixtures_exist():
    assert FIXTURES, "tests/fixtures/portable/ holds no fixture: run scripts/portable_fixtures.py"


@requires_gpu
@pytest.mark.parametrize("backend", backends.BACKENDS)
def test_gpu_portable_equals_cpu(backend):
    """Portable verify and commit on the GPU, by every backend that implements the mode, give the
    CPU's bits (outputs, tape, committed pool)."""
    module = backends.resolve(backend, "verify")
    try:
        backends.check_math(module, "verify", "portable")
    except backends.BackendUnavailable as e:
        pytest.skip(str(e))
    inp = fixtures.make_inputs(seed=13)
    gpu = fixtures.run(inp, math="portable", backend=backend, device=jax.devices("gpu")[0])
    cpu = fixtures.run(inp, math="portable", backend="reference", device=jax.devices("cpu")[0])
    for name in FIELDS:
        assert_bitwise_equal(cpu[name], gpu[name], msg=f"{backend}: {name}")
