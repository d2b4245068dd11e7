"""The speculative step as users write it: verify reads the pool by slot, the tape lands in place.

Every form of verify equals the state0 form on gathered states, bit for bit, on every backend
(the Pallas kernels in interpret mode on the CPU): from a one-layer pool ``[S, HV, V, K]``
and from all layers' ``[L, S, HV, V, K]`` with a layer index (a Python int, or traced under
``jit``), with padding slots (outside ``[0, S)``: zero states, as SGLang reads them); with
the tape written into a preallocated buffer at permuted rows (other rows, steps and layers
keep their bits, out-of-range rows write nothing, D below the buffer's Dmax); fp32 and bf16
pools. Each comparison has a control it must catch (a wrong slot mapping, a wrong row).

The pool path (:func:`gdn_lossless_jax.pool.verify_layer`) equals the composition it replaced
(gather, verify, store), and the compiled step over all layers (one jit, the pool donated)
holds no pool-sized or tape-sized copy (read from its HLO).
"""

import dataclasses
import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdn_lossless_jax as gl
from conftest import ON_GPU, full_only, requires_gpu
from gdn_lossless_jax import staging
from gdn_lossless_jax import pool as gpool
from gdn_lossless_jax.testing.cases import Shape, verify_inputs
from gdn_lossless_jax.config import get_geometry
from gdn_lossless_jax.conv import causal_conv1d_verify
from gdn_lossless_jax.testing import assert_bitwise_differs, assert_bitwise_equal

F32, BF16 = jnp.float32, jnp.bfloat16
BACKENDS = ["reference", "pallas"] + (["triton"] if ON_GPU and importlib.util.find_spec("jax_triton") else [])
K_ = 128 if ON_GPU else 16
SHAPE = Shape(N=5, D=3, H=2, HV=4, K=K_, V=K_)


def _interpret_only_extended(backend: str, *values) -> bool:
    return backend == "pallas" and not ON_GPU and any(values)


# Pool dtype x record mode x backend. Interpret mode compiles each combination's kernels anew
# (seconds each). On the CPU (the suite's time, docs/testing.md) the reference runs the bf16 pools
# (both record modes; its fp32 pools with GDN_FULL_TESTS=1: a plain read of each state, which
# tests/test_fused.py's separate steps take from the pool by slot, the tape in place, every run)
# and Pallas the cells ``pallas`` names, fp32 with tuples or bf16 with snapshots, so that the tests
# between them run both; the rest run with GDN_FULL_TESTS=1 (and on a GPU).
def cross(*pallas: str):
    def extended(dtype, record, backend):
        if ON_GPU:
            return False
        if backend == "reference":
            return dtype == F32
        return backend == "pallas" and f"{jnp.dtype(dtype).name}-{record}" not in pallas

    return [
        pytest.param(dtype, record, backend, id=f"{name}-{record}-{backend}",
                     marks=full_only if extended(dtype, record, backend) else ())
        for dtype, name in ((F32, "f32"), (BF16, "bf16"))
        for record in gl.RECORD_MODES
        for backend in BACKENDS
    ]  # fmt: skip


TUPLES_F32, SNAPSHOTS_BF16 = "float32-tuples", "bfloat16-snapshots"


def _pool_of(x, S: int, slots, rng, dtype):
    """A pool ``[S, HV, V, K]`` of random states holding request n's state0 at ``slots[n]``."""
    s0 = np.asarray(x["state0"].astype(F32))
    pool = rng.standard_normal((S, *s0.shape[1:]), dtype=np.float32)
    for n, slot in enumerate(slots):
        if 0 <= slot < S:
            pool[slot] = s0[n]
    return jnp.asarray(pool).astype(dtype)


def _expected_state0(x, slots, S):
    """The gathered states the pool form must read: state0, or zeros for a padding slot."""
    s0 = x["state0"]
    ok = jnp.asarray([(0 <= s < S) for s in slots])[:, None, None, None]
    return jnp.where(ok, s0, jnp.zeros_like(s0))


def _args(x):
    return {k: v for k, v in x.items() if k != "state0"}


def _case(seed, dtype, shape=SHAPE):
    rng = np.random.default_rng(seed)
    x = verify_inputs(seed, shape, kind="mixed", state_dtype=dtype)
    S = 2 * shape.N + 3
    slots = rng.permutation(S)[: shape.N].astype(np.int32)
    slots[1] = S + 2  # padding slots read zeros
    slots[3] = -1
    return rng, x, S, slots


@pytest.mark.parametrize("dtype,record,backend", cross(TUPLES_F32))
def test_verify_reads_the_pool_by_slot(backend, record, dtype, seed):
    rng, x, S, slots = _case(seed, dtype)
    pool1 = _pool_of(x, S, slots, rng, dtype)
    L, layer = 3, 1
    pool = jnp.stack([pool1 + 1, pool1, pool1 - 1]).astype(dtype)
    want = gl.verify(_expected_state0(x, slots, S), **_args(x), record=record, backend=backend)

    got1 = gl.verify(pool1, **_args(x), slots=slots, record=record, backend=backend)
    assert_bitwise_equal(want, got1, "one-layer pool [S, HV, V, K]")
    got = gl.verify(pool, **_args(x), slots=slots, layer=layer, record=record, backend=backend)
    assert_bitwise_equal(want, got, f"pool [L={L}, S, HV, V, K] at layer {layer}")
    # (the inputs are arguments: closed over, XLA would fold the gates with the host's exp)
    traced = jax.jit(lambda p, l, s, y: gl.verify(p, **y, slots=s, layer=l, record=record, backend=backend))
    assert_bitwise_equal(want, traced(pool, jnp.int32(layer), jnp.asarray(slots), _args(x)), "traced layer under jit")
    # Control: the neighbouring layer holds other states.
    wrong = gl.verify(pool, **_args(x), slots=slots, layer=layer + 1, record=record, backend=backend)
    assert_bitwise_differs(want[0], wrong[0], "the wrong layer must give other outputs")


def _fresh_buffer(record, L, R, Dmax, s: Shape, dtype, rng):
    """A tape buffer filled with random bits (so that any stray write shows)."""
    if record == "snapshots":
        return gl.Snapshots(jnp.asarray(rng.standard_normal((L, R, Dmax, s.HV, s.V, s.K), np.float32)).astype(dtype))
    f = lambda *shp: jnp.asarray(rng.standard_normal(shp, np.float32))  # noqa: E731
    return gl.Tuples(u=f(L, R, Dmax, s.HV, s.V), k=f(L, R, Dmax, s.H, s.K), g=f(L, R, Dmax, s.HV))


def _expected_buffer(buf, layer, rows, tape):
    """The buffer with request n's tape at [layer, rows[n], :D], built in NumPy."""

    def put(b, t):
        b = np.array(b)
        for n, r in enumerate(rows):
            if 0 <= r < b.shape[1]:
                b[layer, r, : t.shape[1]] = np.asarray(t[n]).astype(b.dtype)
        return jnp.asarray(b)

    return jax.tree.map(put, buf, tape)


@pytest.mark.parametrize("dtype,record,backend", cross(TUPLES_F32, SNAPSHOTS_BF16))
def test_tape_lands_in_place(backend, record, dtype, seed):
    rng, x, S, slots = _case(seed, dtype)
    s = SHAPE
    pool = jnp.stack([_pool_of(x, S, slots, rng, dtype)] * 2)
    L, R, Dmax, layer = 2, s.N + 3, s.D + 2, 1
    rows = rng.permutation(R)[: s.N].astype(np.int32)
    rows[2] = R + 4  # out of range: nothing written
    buf = _fresh_buffer(record, L, R, Dmax, s, dtype, rng)
    out_want, tape = gl.verify(_expected_state0(x, slots, S), **_args(x), record=record, backend=backend)
    want = _expected_buffer(buf, layer, rows, tape)

    step = jax.jit(
        lambda p, b, l, sl, rw, y: gl.verify(p, **y, slots=sl, layer=l, tape=b, rows=rw, backend=backend),
        donate_argnums=1,
    )
    copy = jax.tree.map(jnp.copy, buf)
    out, got = step(pool, copy, jnp.int32(layer), jnp.asarray(slots), jnp.asarray(rows), _args(x))
    assert_bitwise_equal(out_want, out, "outputs with the tape written in place")
    assert_bitwise_equal(want, got, "the buffer: request rows written, every other element kept")

    # A per-layer buffer [R, Dmax, ...] (no layer axis) with the state0 form.
    one = jax.tree.map(lambda b: b[0], buf)
    out1, got1 = gl.verify(_expected_state0(x, slots, S), **_args(x), tape=one, rows=rows, backend=backend)
    assert_bitwise_equal(out_want, out1)
    assert_bitwise_equal(jax.tree.map(lambda w: w[0], _expected_buffer(buf, 0, rows, tape)), got1, "per-layer buffer")
    # Control: rows shifted by one land elsewhere.
    assert_bitwise_differs(want, _expected_buffer(buf, layer, np.roll(rows, 1), tape), "shifted rows")


def _stacked_case(seed, dtype, L=3):
    """L layers of inputs (each layer its own draw) and a pool ``[L, S, ...]`` holding each
    layer's state0 at ``slots``."""
    rng, x, S, slots = _case(seed, dtype)
    layers = [x] + [verify_inputs(seed + 1000 * i, SHAPE, kind="mixed", state_dtype=dtype) for i in range(1, L)]
    pool = jnp.stack([_pool_of(y, S, slots, rng, dtype) for y in layers])
    stacks = {k: jnp.stack([_args(y)[k] for y in layers]) for k in _args(x)}
    return rng, layers, pool, stacks, S, slots


@pytest.mark.parametrize("dtype,record,backend", cross(SNAPSHOTS_BF16))
def test_verify_reads_inputs_stacked_over_layers(backend, record, dtype, seed):
    """Inputs stacked ``[L, ...]`` with the pool ``[L, S, ...]`` and ``layer``: the kernels read
    layer ``layer`` of each input, equal to passing that layer's inputs, with the tape in
    place, in a ``lax.scan`` with the layer as its counter; control: the neighbouring layer."""
    rng, layers, pool, stacks, S, slots = _stacked_case(seed, dtype)
    L, R, Dmax = pool.shape[0], SHAPE.N + 2, SHAPE.D + 1
    rows = rng.permutation(R)[: SHAPE.N].astype(np.int32)
    buf = _fresh_buffer(record, L, R, Dmax, SHAPE, dtype, rng)
    want_out, want_buf = [], buf
    for i, y in enumerate(layers):
        o, want_buf = gl.verify(pool, **_args(y), slots=slots, layer=i, tape=want_buf, rows=rows, backend=backend)
        want_out.append(o)
    o1, _ = gl.verify(pool, **stacks, slots=slots, layer=1, record=record, backend=backend)
    assert_bitwise_equal(gl.verify(pool, **_args(layers[1]), slots=slots, layer=1, record=record, backend=backend)[0],
                         o1, "layer 1 of the stacks, a Python int")  # fmt: skip

    def step(pool, buf, stacks, slots, rows):
        def body(buf, i):
            o, buf = gl.verify(pool, **stacks, slots=slots, layer=i, tape=buf, rows=rows, backend=backend)
            return buf, o

        return jax.lax.scan(body, buf, jnp.arange(L, dtype=jnp.int32))

    got_buf, got_out = jax.jit(step, donate_argnums=1)(pool, jax.tree.map(jnp.copy, buf), stacks, jnp.asarray(slots),
                                                       jnp.asarray(rows))  # fmt: skip
    assert_bitwise_equal(jnp.stack(want_out), got_out, "outputs of every layer, stacks read in a scan")
    assert_bitwise_equal(want_buf, got_buf, "the tape buffer after every layer")
    # Some inputs stacked, the others one layer's (a model's stacked A_log and dt_bias, say).
    for names in (("a", "b", "A_log", "dt_bias"), ("v", "A_log")):
        mixed = {k: (v if k in names else _args(layers[2])[k]) for k, v in stacks.items()}
        o2, _ = gl.verify(pool, **mixed, slots=slots, layer=2, record=record, backend=backend)
        assert_bitwise_equal(want_out[2], o2, f"{', '.join(names)} stacked, the rest layer 2's")
    # Control: the stacks read at the neighbouring layer (with this layer's pool) give other outputs.
    wrong = {k: jnp.roll(v, 1, axis=0) for k, v in stacks.items()}
    o_wrong, _ = gl.verify(pool, **wrong, slots=slots, layer=1, record=record, backend=backend)
    assert_bitwise_differs(o1, o_wrong, "the inputs of another layer")


@pytest.mark.parametrize("dtype,record,backend", cross(SNAPSHOTS_BF16))
def test_outputs_land_in_place(backend, record, dtype, seed):
    """``out=``: each layer's outputs written into one ``[L, N, D, HV, V]`` buffer at the layer
    (carried with the tape through a ``lax.scan``, both donated), the layers not verified keep
    their bits; a per-layer buffer ``[N, D, HV, V]``; with the pending commit of
    ``commit_and_verify`` too. Control: every layer's outputs stored at layer 0."""
    rng, layers, pool, stacks, _, slots = _stacked_case(seed, dtype)
    L, R = pool.shape[0], SHAPE.N + 1
    rows = rng.permutation(R)[: SHAPE.N].astype(np.int32)
    want = [gl.verify(pool, **_args(y), slots=slots, layer=i, record=record, backend=backend)[0]
            for i, y in enumerate(layers)]  # fmt: skip
    obuf = jnp.asarray(rng.standard_normal((L, *want[0].shape), np.float32)).astype(want[0].dtype)
    tape = _fresh_buffer(record, L, R, SHAPE.D, SHAPE, dtype, rng)
    done = (0, 2)  # layer 1 is not verified: its outputs must keep their bits

    def step(pool, tape, out, stacks, slots, rows):
        def body(carry, i):
            tape, out = carry
            out, tape = gl.verify(pool, **stacks, slots=slots, layer=i, tape=tape, rows=rows, out=out, backend=backend)
            return (tape, out), None

        return jax.lax.scan(body, (tape, out), jnp.asarray(done, jnp.int32))[0]

    _, got = jax.jit(step, donate_argnums=(1, 2))(pool, jax.tree.map(jnp.copy, tape), jnp.copy(obuf), stacks,
                                                  jnp.asarray(slots), jnp.asarray(rows))  # fmt: skip
    expected = jnp.stack([want[i] if i in done else obuf[i] for i in range(L)])
    assert_bitwise_equal(expected, got, "the outputs buffer: verified layers written, layer 1 kept")
    one, _ = gl.verify(pool, **stacks, slots=slots, layer=1, record=record, backend=backend, out=obuf[0])
    assert_bitwise_equal(want[1], one, "a per-layer buffer [N, D, HV, V]")
    prev = _fresh_buffer("tuples", L, R, SHAPE.D, SHAPE, F32, rng)
    steps = jnp.asarray(rng.integers(-1, SHAPE.D, SHAPE.N), jnp.int32)
    none = jnp.full((SHAPE.N,), -1, jnp.int32)
    pending = gl.Pending(prev, jnp.asarray(rows), steps, none, none)
    fused = gl.commit_and_verify(pool, pending, **stacks, slots=slots, layer=2, record=record, backend=backend)
    fused_out = gl.commit_and_verify(pool, pending, **stacks, slots=slots, layer=2, record=record, backend=backend,
                                     out=obuf)  # fmt: skip
    assert_bitwise_equal(fused[0], fused_out[0][2], "commit_and_verify's outputs at layer 2 of the buffer")
    assert_bitwise_equal(fused[2], fused_out[2], "commit_and_verify's pool with an outputs buffer")
    assert_bitwise_equal(obuf[:2], fused_out[0][:2], "commit_and_verify: the other layers kept")
    # Control: a kernel that ignored out_layer would leave the last verified layer's outputs at layer 0.
    ignored = obuf.at[0].set(want[done[-1]])
    assert_bitwise_differs(expected, ignored, "outputs stored at layer 0 whatever the layer")


def test_stacked_input_errors_name_the_argument():
    _, layers, pool, stacks, S, slots = _stacked_case(0, F32, L=2)
    with pytest.raises(ValueError, match="argument 'q' has rank 5 \\(stacked over layers\\), which needs the pool form "
                       "with layers .* got state0 \\[5, 4.* and no slots"):  # fmt: skip
        gl.verify(layers[0]["state0"], **stacks)
    with pytest.raises(ValueError, match="leading layer axis .* pass layer="):
        gl.verify(pool, **stacks, slots=slots)
    bad = {**stacks, "A_log": jnp.concatenate([stacks["A_log"]] * 2)}
    with pytest.raises(ValueError, match="argument 'A_log' is stacked over layers \\(rank 2\\), so its leading axis must "
                       "be the pool's L=2, got shape \\[4, 4\\]"):  # fmt: skip
        gl.verify(pool, **bad, slots=slots, layer=0)
    bad = {**stacks, "v": stacks["v"][:1]}
    with pytest.raises(ValueError, match="argument 'v' is stacked over layers"):
        gl.verify(pool, **bad, slots=slots, layer=0)
    bad = {**stacks, "k": jnp.swapaxes(stacks["k"], 2, 3)}
    with pytest.raises(ValueError, match="argument 'k'"):
        gl.verify(pool, **bad, slots=slots, layer=0)


def test_buffer_errors_name_the_argument():
    x = verify_inputs(0, SHAPE)
    s = SHAPE
    buf = gl.Tuples(u=jnp.zeros((2, s.N, s.D - 1, s.HV, s.V)), k=jnp.zeros((2, s.N, s.D - 1, s.H, s.K)),
                    g=jnp.zeros((2, s.N, s.D - 1, s.HV)))  # fmt: skip
    with pytest.raises(ValueError, match="Dmax=2 draft steps, fewer than D=3"):
        gl.verify(x["state0"], **_args(x), tape=jax.tree.map(lambda b: b[0], buf))
    with pytest.raises(ValueError, match="leading layer axis .* pass layer="):
        gl.verify(x["state0"], **_args(x), tape=jax.tree.map(lambda b: jnp.pad(b, [(0, 0), (0, 0), (0, 1)] + [(0, 0)] * (b.ndim - 3)), buf))
    with pytest.raises(ValueError, match="record='snapshots' but the tape buffer is a Tuples tape"):
        gl.verify(x["state0"], **_args(x), record="snapshots", tape=jax.tree.map(lambda b: b[0], buf))
    with pytest.raises(ValueError, match="'layer' must be in \\[0, 2\\)"):
        gl.verify(jnp.zeros((2, 4, s.HV, s.V, s.K)), **_args(x), slots=jnp.arange(s.N), layer=2)
    with pytest.raises(ValueError, match="rows= maps requests to rows of a tape buffer"):
        gl.verify(x["state0"], **_args(x), rows=jnp.arange(s.N))
    with pytest.raises(ValueError, match=f"argument 'out' must have shape \\[N, D, HV, V\\] = \\[5, 3, 4, {s.V}\\] .* got \\[5, 4, 4, {s.V}\\]"):
        gl.verify(x["state0"], **_args(x), out=jnp.zeros((s.N, s.D + 1, s.HV, s.V), BF16))
    with pytest.raises(TypeError, match="out_dtype=float32 but argument 'out' is bfloat16"):
        gl.verify(x["state0"], **_args(x), out=jnp.zeros((s.N, s.D, s.HV, s.V), BF16), out_dtype=F32)
    with pytest.raises(ValueError, match="the outputs buffer has a leading layer axis .* pass layer="):
        gl.verify(x["state0"], **_args(x), out=jnp.zeros((2, s.N, s.D, s.HV, s.V), BF16))


# ---------------------------------------------------------------------------------------
# The pool path
# ---------------------------------------------------------------------------------------
GEOMETRY = get_geometry("qwen3.6-35b-a3b").reduced(gdn_layers=2, heads_divisor=8, head_dim=K_)


def _pool_inputs(seed, N, D, dtype=F32, g=GEOMETRY):
    rng = np.random.default_rng(seed)
    f = lambda *s, sc=1.0: jnp.asarray(sc * rng.standard_normal(s, np.float32))  # noqa: E731
    layers = [dict(conv_weight=f(g.conv_dim, g.conv_kernel, sc=0.5), conv_bias=f(g.conv_dim, sc=0.1),
                   A_log=f(g.num_v_heads, sc=0.5), dt_bias=f(g.num_v_heads, sc=0.5)) for _ in range(g.gdn_layers)]  # fmt: skip
    steps = [dict(mixed_qkv=f(N, D, g.conv_dim).astype(BF16), a=f(N, D, g.num_v_heads).astype(BF16),
                  b=f(N, D, g.num_v_heads).astype(BF16)) for _ in range(g.gdn_layers)]  # fmt: skip
    return rng, layers, steps


def _filled_pool(rng, record, dtype, slots=9, requests=4, drafts=4, g=GEOMETRY):
    p = gpool.allocate(g, slots=slots, requests=requests, drafts=drafts, record=record, state_dtype=dtype)
    fill = lambda x: jnp.asarray(rng.standard_normal(x.shape, np.float32)).astype(x.dtype)  # noqa: E731
    return jax.tree.map(fill, p)


def _old_verify_layer(p, layer, x, prm, slots, rows, backend):
    """The pool path before: gathered states and conv states, verify, then a copy into the scratch."""
    g = p.geometry
    N, D, _ = x["mixed_qkv"].shape
    s = jnp.where((slots >= 0) & (slots < p.ssm.shape[1]), slots, p.ssm.shape[1])
    conv_state = p.conv.at[layer, s].get(mode="fill", fill_value=0)
    state0 = p.ssm.at[layer, s].get(mode="fill", fill_value=0)
    y, windows = causal_conv1d_verify(conv_state, x["mixed_qkv"], prm["conv_weight"], prm["conv_bias"])
    HK = g.num_k_heads * g.head_k_dim
    q = y[..., :HK].reshape(N, D, g.num_k_heads, g.head_k_dim)
    k = y[..., HK : 2 * HK].reshape(N, D, g.num_k_heads, g.head_k_dim)
    v = y[..., 2 * HK :].reshape(N, D, g.num_v_heads, g.head_v_dim)
    out, tape = gl.verify(state0, q, k, v, x["a"], x["b"], prm["A_log"], prm["dt_bias"], record=p.record, backend=backend)
    return out, gpool.store_layer(p, layer, tape, windows, rows)


@pytest.mark.parametrize("dtype,record,backend", cross(TUPLES_F32))
def test_pool_verify_layer_equals_the_old_path(backend, record, dtype, seed):
    N, D = 4, 3  # D below the scratch's 4
    rng, layers, steps = _pool_inputs(seed, N, D)
    p = _filled_pool(rng, record, dtype)
    slots = jnp.asarray(rng.permutation(p.slots)[:N].astype(np.int32)).at[2].set(p.slots)  # the padding slot
    rows = jnp.asarray(rng.permutation(p.rows)[:N].astype(np.int32))
    copy = lambda t: jax.tree.map(jnp.copy, t)  # noqa: E731
    want_p, got_p = copy(p), copy(p)
    for layer in range(GEOMETRY.gdn_layers):
        want_o, want_p = _old_verify_layer(want_p, layer, steps[layer], layers[layer], slots, rows, backend)
        got_o, got_p = gpool.verify_layer(got_p, layer, **steps[layer], **layers[layer], slots=slots, rows=rows,
                                          backend=backend)  # fmt: skip
        assert_bitwise_equal(want_o, got_o, f"layer {layer} outputs")
    assert_bitwise_equal(want_p, got_p, "the whole pool (states, scratch, windows) after all layers")
    # Control: a request mapped to another row leaves a different scratch.
    _, other = _old_verify_layer(copy(p), 0, steps[0], layers[0], slots, jnp.roll(rows, 1), backend)
    assert_bitwise_differs(want_p.tape, other.tape, "rows rolled by one")


# (On the CPU the Pallas cases run with GDN_FULL_TESTS=1: Pallas reading the stacks in interpret mode
# runs in test_verify_reads_inputs_stacked_over_layers, the pool's wiring in the reference's cases.)
@pytest.mark.parametrize("record,backend", [
    pytest.param(record, backend, id=f"{record}-{backend}",
                 marks=full_only if _interpret_only_extended(backend, True) else ())
    for record in gl.RECORD_MODES for backend in BACKENDS
])  # fmt: skip
def test_pool_verify_layer_reads_inputs_stacked_over_layers(backend, record, seed):
    """``pool.verify_layer`` with ``mixed_qkv``, the gates' inputs and the layer's parameters
    stacked over layers (read at the layer by the kernels, in a ``lax.scan``) equals the calls
    with each layer's arrays; an argument stacked over the wrong number of layers is named."""
    N, D = 4, 3
    rng, layers, steps = _pool_inputs(seed, N, D)
    p = _filled_pool(rng, record, F32)
    slots = jnp.asarray(rng.permutation(p.slots)[:N].astype(np.int32)).at[1].set(p.slots)
    rows = jnp.asarray(rng.permutation(p.rows)[:N].astype(np.int32))
    copy = lambda t: jax.tree.map(jnp.copy, t)  # noqa: E731
    want_p, want_o = copy(p), []
    for layer in range(GEOMETRY.gdn_layers):
        o, want_p = gpool.verify_layer(want_p, layer, **steps[layer], **layers[layer], slots=slots, rows=rows,
                                       backend=backend)  # fmt: skip
        want_o.append(o)
    stack = lambda ds: jax.tree.map(lambda *t: jnp.stack(t), *ds)  # noqa: E731
    prms, xs = stack(layers), stack(steps)

    def step(p, prms, xs, slots, rows):
        def body(p, i):
            out, p = gpool.verify_layer(p, i, **xs, **prms, slots=slots, rows=rows, backend=backend)
            return p, out

        return jax.lax.scan(body, p, jnp.arange(GEOMETRY.gdn_layers, dtype=jnp.int32))

    got_p, got_o = jax.jit(step, donate_argnums=0)(copy(p), prms, xs, slots, rows)
    assert_bitwise_equal(jnp.stack(want_o), got_o, "outputs of every layer")
    assert_bitwise_equal(want_p, got_p, "the whole pool after every layer")
    # Some stacked, some one layer's (the model's stacked weights with each layer's inputs).
    mixed_p, mixed_o = copy(p), []
    for layer in range(GEOMETRY.gdn_layers):
        some = {**steps[layer], **layers[layer], "b": xs["b"], "conv_weight": prms["conv_weight"], "A_log": prms["A_log"]}
        o, mixed_p = gpool.verify_layer(mixed_p, layer, **some, slots=slots, rows=rows, backend=backend)
        mixed_o.append(o)
    assert_bitwise_equal(want_o, mixed_o, "conv_weight, A_log and b stacked, the rest each layer's")
    assert_bitwise_equal(want_p, mixed_p, "the pool, some inputs stacked")
    # Control: the stacks read one layer off.
    off = jax.tree.map(lambda t: jnp.roll(t, 1, axis=0), (prms, xs))
    _, off_o = jax.jit(step, donate_argnums=0)(copy(p), *off, slots, rows)
    assert_bitwise_differs(jnp.stack(want_o), off_o, "the inputs of the neighbouring layer")
    with pytest.raises(ValueError, match="argument 'conv_weight' is stacked over layers \\(rank 3\\), so its leading axis "
                       "must be the pool's gdn_layers=2, got shape \\[1, "):  # fmt: skip
        gpool.verify_layer(copy(p), 0, **steps[0], **{**layers[0], "conv_weight": prms["conv_weight"][:1]}, slots=slots)


# ---------------------------------------------------------------------------------------
# The kernels read the jit's copy of the index arrays, not the caller's buffers
# ---------------------------------------------------------------------------------------
STAGING = {"eq", "jit[_where]", "pjit[_where]"}  # staging.staged's primitives (jit is pjit before jax 0.7)


def _readers(jaxpr, var) -> list[str]:
    """The primitives of ``jaxpr``'s top level that read ``var``."""
    return [e.primitive.name + (f"[{e.params.get('name')}]" if "name" in e.params else "")
            for e in jaxpr.eqns if any(v is var for v in e.invars)]  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernels_read_staged_index_arrays(backend, seed, monkeypatch):
    """In a jitted step (two layers unrolled, then the commit), ``slots``, ``rows``, ``steps``
    and the track indices are read only by the one staging op each (``staging.staged``: XLA
    re-records every CUDA-graph kernel node whose buffers moved since the last launch, and a
    serving loop passes new index arrays every step). Bit-exactness is unchanged (the test
    above and the equivalence suite run through it). Control: without the staging the
    kernels read the arguments themselves. In a ``lax.scan`` that closes over them, nothing is
    staged inside the body."""
    rng, layers, pool, stacks, S, slots = _stacked_case(seed, F32, L=2)
    R = SHAPE.N + 2
    buf = _fresh_buffer("tuples", 2, R, SHAPE.D, SHAPE, F32, rng)
    ix = (jnp.asarray(slots), jnp.asarray(rng.permutation(R)[: SHAPE.N].astype(np.int32)),
          jnp.asarray(rng.integers(-1, SHAPE.D, SHAPE.N).astype(np.int32)),
          jnp.full((SHAPE.N,), -1, jnp.int32), jnp.full((SHAPE.N,), -1, jnp.int32))  # fmt: skip

    def step(pool, buf, slots, rows, steps, tslots, tsteps):
        outs = []
        for i in range(2):
            o, buf = gl.verify(pool, **stacks, slots=slots, layer=i, tape=buf, rows=rows, backend=backend)
            outs.append(o)
        return outs, gl.commit(pool, buf, slots, steps, tslots, tsteps, rows, backend=backend)

    def readers():  # a new function object each time: make_jaxpr caches traces by function
        closed = jax.make_jaxpr(lambda *a: step(*a))(pool, buf, *ix)
        return {n: _readers(closed.jaxpr, v) for n, v in zip(("slots", "rows", "steps", "tslots", "tsteps"),
                                                           closed.jaxpr.invars[-5:])}  # fmt: skip

    got = readers()
    for name, prims in got.items():
        assert prims and set(prims) <= STAGING, f"{name} is read by {prims}, not only by its staging"
    # In a lax.scan over the layers that closes over the index arrays, nothing is staged inside
    # the body (the op would run in every iteration).
    def scan_step(pool, buf, slots, rows):
        def body(buf, i):
            o, buf = gl.verify(pool, **stacks, slots=slots, layer=i, tape=buf, rows=rows, backend=backend)
            return buf, o

        return jax.lax.scan(body, buf, jnp.arange(2, dtype=jnp.int32))

    def body_wheres():
        closed = jax.make_jaxpr(lambda *a: scan_step(*a))(pool, buf, *ix[:2])
        (scan,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
        return [e for e in scan.params["jaxpr"].jaxpr.eqns if e.params.get("name") == "_where"]

    assert not body_wheres(), "staging ops inside the scan's body"
    with monkeypatch.context() as m:  # control: staging whatever the trace puts it in the body
        m.setattr(staging, "_traced_here", lambda x: True)
        assert body_wheres(), "the control found no staging op in the scan's body"
    monkeypatch.setattr(staging, "staged", lambda x: x)
    control = readers()
    assert any(set(p) - STAGING for p in control.values()), f"the control found no direct reader: {control}"


# ---------------------------------------------------------------------------------------
# The compiled step holds no pool-sized or tape-sized copy
# ---------------------------------------------------------------------------------------
def step_fn(backend: str, form: str):
    """A user's whole step: every layer's ``pool.verify_layer`` in a ``lax.scan`` (``form``
    ``"scan"``: the scan slices each layer's inputs; ``"scan-stacked"``: the stacks passed whole,
    read at the layer by the kernels) or unrolled, then ``pool.commit``; the pool is donated."""

    def step(p, prms, xs, slots, rows, acc, tslots, tsteps):
        def layer(p, lx):
            i, prm, x = lx
            out, p = gpool.verify_layer(p, i, **x, **prm, slots=slots, rows=rows, backend=backend)
            return p, out

        ids = jnp.arange(p.geometry.gdn_layers, dtype=jnp.int32)
        if form == "unrolled":
            outs = []
            for i in range(p.geometry.gdn_layers):
                p, o = layer(p, (ids[i], jax.tree.map(lambda t: t[i], prms), jax.tree.map(lambda t: t[i], xs)))
                outs.append(o)
            outs = jnp.stack(outs)
        elif form == "scan-stacked":
            p, outs = jax.lax.scan(lambda p, i: layer(p, (i, prms, xs)), p, ids)
        else:
            p, outs = jax.lax.scan(layer, p, (ids, prms, xs))
        return outs, gpool.commit(p, slots, acc, tslots, tsteps, rows, backend=backend)

    return jax.jit(step, donate_argnums=0)


_SHAPE_RE = re.compile(r"=\s*(?:f32|bf16|s32|f16)\[([\d,]+)\]")
_COMP_RE = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_IN_PLACE = ("dynamic-update-slice", "scatter")  # fusion roots that update their operand's buffer


def pool_copies(compiled, p) -> tuple[list[str], int]:
    """What in a compiled step (``jax.jit(...).lower(...).compile()``, the pool donated as its
    first argument) copies the pool or its scratch, or passes over all of it: ``copy``
    instructions, and fusions whose root is not an in-place update (``dynamic-update-slice``,
    ``scatter``), of a pool, tape or one layer's slice shape; donated bytes that do not alias
    the output (a new array instead of the donated one). Returns those, and the bytes of
    temporaries (which must not grow with the pool: see the test)."""
    return buffer_copies(compiled, (p.ssm, p.tape, p.conv_windows), (p.ssm, p.tape), p)


def buffer_copies(compiled, whole, layered, donated) -> tuple[list[str], int]:
    """:func:`pool_copies` for any buffers: the shapes of ``whole``'s arrays and of one layer of
    ``layered``'s are the ones no copy may have; ``donated``'s bytes must all alias the output."""
    leaves = jax.tree.leaves(whole)
    shapes = {tuple(x.shape) for x in leaves} | {tuple(x.shape[1:]) for x in jax.tree.leaves(layered)}
    hlo = compiled.as_text()
    roots, comp = {}, None
    for line in hlo.splitlines():
        m = _COMP_RE.match(line)
        if m:
            comp = m.group(1)
        elif comp and line.strip().startswith("ROOT"):
            op = re.search(r"\s([a-z][\w\-]*)\(", line.split("=", 1)[1])
            roots[comp] = op.group(1) if op else ""
    bad = []
    for line in hlo.splitlines():
        m = _SHAPE_RE.search(line)
        if not m or tuple(int(d) for d in m.group(1).split(",")) not in shapes:
            continue
        op = re.search(r"\]\S*\s([a-z][\w\-]*)\(", line)
        op = op.group(1) if op else ""
        if op in ("copy", "copy-start"):
            bad.append(line.strip()[:160])
        elif op == "fusion":
            called = re.search(r"calls=%?([\w.\-]+)", line)
            root = roots.get(called.group(1), "") if called else ""
            if not root.startswith(_IN_PLACE):
                bad.append(f"[fusion, root {root}] " + line.strip()[:160])
    mem = compiled.memory_analysis()
    donated = sum(x.nbytes for x in jax.tree.leaves(donated))
    if mem.alias_size_in_bytes < donated:
        bad.append(f"only {mem.alias_size_in_bytes} of the {donated} donated bytes alias the output")
    return bad, mem.temp_size_in_bytes


# On a CPU the Pallas kernels run in interpret mode, which emulates a kernel's refs with
# XLA loops over copies of its operands: only the reference's HLO is the one users run there.
# On a GPU the kernels are custom calls; the reference gathers the states by design.
HLO_BACKENDS = [b for b in BACKENDS if b != "pallas" and b != "reference"] + (["pallas"] if ON_GPU else ["reference"])
HLO_BACKENDS += ["mosaic"] if ON_GPU else []  # its kernel compiles for CUDA only (interpret mode: a different HLO)


def _compiled_step(backend, record, form, seed, copy_pool=False, size=1):
    # The same step (4 requests) on a pool and scratch of `size` times 16 slots and 8 rows.
    N, D = 4, 4
    rng, layers, steps = _pool_inputs(seed, N, D)
    p = _filled_pool(rng, record, F32, slots=16 * size, requests=8 * size)
    stack = lambda ds: jax.tree.map(lambda *t: jnp.stack(t), *ds)  # noqa: E731
    ix = [jnp.asarray(rng.permutation(p.slots)[:N].astype(np.int32)), jnp.arange(N, dtype=jnp.int32),
          jnp.asarray([0, 3, -1, 2], jnp.int32), jnp.asarray([p.slots - 1, -1, -1, -1], jnp.int32),
          jnp.asarray([0, -1, -1, -1], jnp.int32)]  # fmt: skip
    f = step_fn(backend, form)
    if copy_pool:  # control: a step that passes over the whole pool (XLA folds x + 0.0, not x * 1.5)
        g = f

        def f_copy(p, *a):
            outs, p = g(p, *a)
            return outs, dataclasses.replace(p, ssm=p.ssm * 1.5)

        f = jax.jit(f_copy, donate_argnums=0)
    return pool_copies(f.lower(p, stack(layers), stack(steps), *ix).compile(), p)


# On the CPU tuples only (snapshots in all three forms with GDN_FULL_TESTS=1 and on a GPU: the suite's time).
@pytest.mark.parametrize("backend", HLO_BACKENDS)
@pytest.mark.parametrize("form,record", [
    pytest.param(form, record, id=f"{form}-{record}",
                 marks=full_only if record == "snapshots" and not ON_GPU else ())
    for form in ("scan", "unrolled", "scan-stacked") for record in gl.RECORD_MODES
])  # fmt: skip
def test_compiled_step_has_no_pool_or_tape_copy(backend, record, form, seed):
    bad, temps = _compiled_step(backend, record, form, seed)
    assert not bad, "the compiled step copies the pool or its scratch:\n" + "\n".join(bad)
    # A copy fused into other work would need temporaries that grow with the pool or the scratch
    # by at least one layer's tape field (a few hundred bytes of alignment may move).
    _, temps2 = _compiled_step(backend, record, form, seed, size=2)
    field = min(x.nbytes // x.shape[0] for x in jax.tree.leaves(_filled_pool(np.random.default_rng(0), record, F32, slots=16, requests=8).tape))
    assert temps2 - temps < field // 4, f"temporaries grow with the pool: {temps} bytes, {temps2} with twice the slots and rows"
    # Control: the same check finds the copy of a step that writes a new pool.
    assert _compiled_step(backend, record, form, seed, copy_pool=True)[0], "the control step's copy was not found"


def _compiled_fused_step(backend, record, seed, copy_pool=False):
    """``benchmarks.step``'s ``fused-out`` step (every layer's ``commit_and_verify`` unrolled,
    the outputs written in place; the pool, both tapes and the outputs buffer donated),
    compiled: what :func:`buffer_copies` finds in it."""
    from benchmarks.step import fused_step

    rng, _, pool, stacks, _, slots = _stacked_case(seed, F32)
    L, N, R = pool.shape[0], SHAPE.N, SHAPE.N + 2
    tape, prev = (_fresh_buffer(record, L, R, SHAPE.D, SHAPE, F32, rng) for _ in range(2))
    obuf = jnp.zeros((L, N, SHAPE.D, SHAPE.HV, SHAPE.V), stacks["q"].dtype)
    steps, none = rng.integers(-1, SHAPE.D, N), np.full(N, -1)
    ix = tuple(jnp.asarray(a, jnp.int32) for a in (slots, steps, none, none, rng.permutation(R)[:N]))
    params = {k: stacks[k] for k in ("A_log", "dt_bias")}
    xs = {k: stacks[k] for k in ("q", "k", "v", "a", "b")}
    f = fused_step(backend, form="unrolled-out")
    if copy_pool:  # control: a step that passes over the whole pool
        g = f

        def f_copy(ssm, *a):
            outs, ssm, tape, prev = g(ssm, *a)
            return outs, ssm * 1.5, tape, prev

        f = jax.jit(f_copy, donate_argnums=(0, 1, 2, 6))
    compiled = f.lower(pool, tape, prev, params, xs, ix, obuf).compile()
    return buffer_copies(compiled, (pool, tape, prev, obuf), (pool, tape, prev), (pool, tape, prev, obuf))


class _Spec:
    """A shape with its bytes (what :func:`buffer_copies` reads of an array)."""

    def __init__(self, x):
        self.shape, self.dtype = tuple(x.shape), jnp.dtype(x.dtype)
        self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize


def benchmark_fused_step_copies(label: str, backend: str, record: str, mode: str = "h200", family: str = "model"):
    """``benchmarks.step``'s ``fused-out`` step at the benchmark's size ``label`` (``"25x4"``: the
    requests and drafts of one of ``mode``'s configurations, its layers; ``family``'s layers as
    ``benchmarks.step --families`` builds them), compiled from shapes (no memory): ``(copies,
    temporaries in bytes, bytes aliased, the compiled module)``, the copies as :func:`buffer_copies`
    finds them. (``python -m benchmarks.dev fused-step-hlo`` prints them.)"""
    from benchmarks import cases as bc
    from benchmarks.step import fused_step

    m = bc.MODES[mode]
    g = bc.family_geometry(m, family)
    (cfg,) = bc.parse_configs(label, m.configs)
    s = Shape.of(g, cfg.requests, cfg.drafts)
    L, N, D = g.gdn_layers, s.N, s.D
    ch = (s.K,) if g.decay == "channel" else ()  # KDA: a and dt_bias one decay input per key channel
    sds = jax.ShapeDtypeStruct
    params = {"A_log": sds((L, s.HV), F32), "dt_bias": sds((L, s.HV, *ch), F32)}
    xs = {"q": sds((L, N, D, s.H, s.K), BF16), "k": sds((L, N, D, s.H, s.K), BF16),
          "v": sds((L, N, D, s.HV, s.V), BF16), "a": sds((L, N, D, s.HV, *ch), BF16),
          "b": sds((L, N, D, s.HV), BF16)}  # fmt: skip
    ix = tuple(sds((N,), jnp.int32) for _ in range(5))
    obuf = sds((L, N, D, s.HV, s.V), BF16)
    spec = jax.eval_shape(lambda: gpool.allocate(g, slots=bc.pool_slots(cfg.requests) - 1, requests=N, drafts=D,
                                                 record=record))  # fmt: skip
    compiled = fused_step(backend, form="unrolled-out", decay=g.decay).lower(spec.ssm, spec.tape, spec.tape, params, xs, ix,
                                                              obuf).compile()  # fmt: skip
    whole = jax.tree.map(_Spec, (spec.ssm, spec.tape, spec.tape, obuf))
    bad, temps = buffer_copies(compiled, whole, whole[:3], whole)
    return bad, temps, compiled.memory_analysis().alias_size_in_bytes, compiled


@requires_gpu
@pytest.mark.parametrize("backend", [b for b in HLO_BACKENDS if b != "reference"])
@pytest.mark.parametrize("record", gl.RECORD_MODES)
def test_benchmark_sized_fused_step_has_no_copy(backend, record):
    """The fused step at 25x4 and 30 layers (the benchmark's), compiled from shapes: no pool-, tape-
    or outputs-sized copy. The small case above did not show the two pool copies XLA made there for
    the ``mosaic`` backend's pending snapshot commit (docs/design.md)."""
    bad, *_ = benchmark_fused_step_copies("25x4", backend, record)
    assert not bad, "the compiled 25x4 fused step copies the pool, a tape or the outputs:\n" + "\n".join(bad)


@pytest.mark.parametrize("backend", HLO_BACKENDS)
@pytest.mark.parametrize("record", gl.RECORD_MODES)
def test_compiled_fused_step_has_no_pool_or_tape_copy(backend, record, seed):
    """The fused step as docs/step.md writes it (``commit_and_verify`` for every layer, ``out=``)
    holds no pool-, tape- or outputs-sized copy and aliases every donated byte."""
    if backend == "reference":
        pytest.skip("the kernels' fused step is checked on a GPU: the reference's commit_and_verify (one layer of the "
                    "pool sliced, committed and written back) makes XLA:CPU copy the pool once per layer")
    bad, _ = _compiled_fused_step(backend, record, seed)
    assert not bad, "the compiled fused step copies the pool, a tape or the outputs:\n" + "\n".join(bad)
    assert _compiled_fused_step(backend, record, seed, copy_pool=True)[0], "the control step's copy was not found"
