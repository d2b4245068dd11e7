"""The state pool: layout, allocation, rejection before allocation, verify into scratch rows, commit."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdn_lossless_jax as gdn
from gdn_lossless_jax import conv, pool as P, testing
from gdn_lossless_jax.testing.cases import commit_indices
from gdn_lossless_jax.config import Geometry, get_geometry
from gdn_lossless_jax.tape import KDATuples, Snapshots
from gdn_lossless_jax.testing import assert_bitwise_differs, assert_bitwise_equal

# Reduced Qwen3.6-35B-A3B: 2 GDN layers, H=2, HV=4, K=V=16 (conv_dim 128), Kc = 4.
SMALL = get_geometry("qwen3.6-35b-a3b").reduced(gdn_layers=2, heads_divisor=8, head_dim=16)


def _normal(rng, shape, scale=1.0, dtype=np.float32):
    return jnp.asarray((scale * rng.standard_normal(shape)).astype(np.float32).astype(dtype))


def test_layout_shapes():
    g = SMALL
    L, HV, H, K, V, C, Kc = 2, 4, 2, 16, 16, 128, 4
    assert g.conv_dim == C
    pl = P.allocate(g, slots=5, requests=3, drafts=4, record="tuples")
    assert pl.ssm.shape == (L, 6, HV, V, K) and pl.ssm.dtype == jnp.float32
    assert pl.conv.shape == (L, 6, C, Kc - 1) and pl.conv.dtype == jnp.bfloat16
    assert isinstance(pl.tape, gdn.Tuples)
    assert pl.tape.u.shape == (L, 4, 4, HV, V) and pl.tape.k.shape == (L, 4, 4, H, K) and pl.tape.g.shape == (L, 4, 4, HV)
    assert {x.dtype for x in jax.tree.leaves(pl.tape)} == {jnp.dtype(jnp.float32)}
    assert pl.conv_windows.shape == (L, 4, C, 4 + Kc - 2)
    assert (pl.slots, pl.rows, pl.drafts, pl.record) == (5, 4, 4, "tuples")
    ps = P.allocate(g, slots=5, requests=3, drafts=4, record="snapshots", state_dtype=jnp.bfloat16)
    assert isinstance(ps.tape, gdn.Snapshots)
    assert ps.tape.states.shape == (L, 4, 4, HV, V, K) and ps.tape.states.dtype == jnp.bfloat16
    assert ps.record == "snapshots"
    # A pytree: leaves are the arrays, the geometry is static.
    assert len(jax.tree.leaves(pl)) == 6 and len(jax.tree.leaves(ps)) == 4
    assert jax.tree.structure(pl) != jax.tree.structure(dataclasses.replace(pl, geometry=get_geometry("qwen3.8-27b")))


# A geometry far too large to allocate: rejection must come first.
HUGE = dict(slots=10**6, requests=10**6, drafts=16)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(topk=0), r"allocate: argument 'topk' must be a positive integer .*got 0"),
        (dict(parents=np.array([-1, 0, 0] + list(range(2, 15)))), r"allocate: argument 'parents' gives node 0 .* more than topk=1"),
        (dict(record="seed_ring"), r"allocate: record must be one of \('tuples', 'snapshots'\), got 'seed_ring'"),
        (dict(state_dtype=jnp.float16), r"allocate: state_dtype must be float32 or bfloat16, got float16"),
        (dict(drafts=0), r"allocate: argument 'drafts' must be a positive integer, got 0"),
    ],
)
def test_rejected_before_any_allocation(kwargs, match):
    args = {**HUGE, **kwargs}
    with pytest.raises((ValueError, TypeError), match=match):
        P.allocate(get_geometry("qwen3.8-27b"), **args)


@pytest.mark.parametrize("record", ["tuples", "snapshots"])
def test_kda_pool_deferred_commit_is_the_commit(record, seed):
    """A KDA pool that defers its commit into the next verify (``defer_commit=True``): three steps of two layers, then a
    flush, give the outputs, SSM states and conv windows of the pool that commits every step, bit for bit. Control:
    without the flush the last step's commit is still pending (the SSM states differ)."""
    H, K, D, N = 2, 8, 4, 3
    kda = Geometry("kda-defer", gdn_layers=2, num_k_heads=H, num_v_heads=H, head_k_dim=K, head_v_dim=K,
                   linear_attention="kda")  # fmt: skip
    rng = np.random.default_rng(seed)
    conv_dim = 3 * H * K
    layers = [(jnp.asarray(rng.uniform(-1, 1, (conv_dim, 4)), jnp.float32),
               jnp.asarray(np.log(rng.uniform(0.2, 2, H)), jnp.float32),
               jnp.asarray(rng.standard_normal((H, K)), jnp.float32)) for _ in range(2)]  # fmt: skip
    draws = [[(jnp.asarray(rng.standard_normal((N, D, conv_dim)), jnp.bfloat16),
               jnp.asarray(rng.standard_normal((N, D, H, K)), jnp.bfloat16),
               jnp.asarray(rng.standard_normal((N, D, H)), jnp.bfloat16)) for _ in layers] for _ in range(3)]  # fmt: skip
    steps = [jnp.asarray(rng.integers(-1, D, N), jnp.int32) for _ in range(3)]
    slots = jnp.array([4, 0, 2], jnp.int32)

    def run(defer: bool, flush: bool = True):
        pool, outs = P.allocate(kda, slots=6, requests=N, drafts=D, record=record, defer_commit=defer), []
        for inputs, accepted in zip(draws, steps):
            for layer, ((mixed, a, b), (w, A_log, dt_bias)) in enumerate(zip(inputs, layers)):
                o, pool = P.verify_layer(pool, layer, mixed, a, b, w, None, A_log, dt_bias, slots)
                outs.append(o)
            pool = P.commit(pool, slots, accepted)
        pool = P.flush(pool) if flush else pool
        return outs, pool.ssm, pool.conv

    want, got = run(False), run(True)
    for name, w, g in zip(("outputs", "SSM states", "conv windows"), want, got):
        assert_bitwise_equal(w, g, f"KDA {record}, deferred == committed every step: {name}")
    assert_bitwise_differs(want[1], run(True, flush=False)[1], "control: the last commit left pending")


def test_kda_pools_and_non_dividing_heads():
    kda = Geometry("Kimi-Linear-like", gdn_layers=2, num_k_heads=2, num_v_heads=2, head_k_dim=8, head_v_dim=8,
                   linear_attention="kda")  # fmt: skip
    assert type(P.allocate(kda, slots=2, requests=2, drafts=4, topk=2).tape) is KDATuples  # trees (test_verify_forms)
    assert type(P.allocate(kda, slots=2, requests=2, drafts=4).tape) is KDATuples
    assert type(P.allocate(kda, slots=2, requests=2, drafts=4, record="snapshots").tape) is Snapshots
    with pytest.raises(ValueError, match=r"num_k_heads H=3 must divide num_v_heads HV=32"):
        Geometry("odd", gdn_layers=2, num_k_heads=3, num_v_heads=32)
    with pytest.raises(ValueError, match=r"linear_attention must be one of \('gdn', 'kda'\), got 'mamba2'"):
        Geometry("m", gdn_layers=2, num_k_heads=2, num_v_heads=4, linear_attention="mamba2")


def _layer_inputs(rng, g: Geometry, N: int, D: int):
    return dict(
        mixed_qkv=_normal(rng, (N, D, g.conv_dim), 1.0, jnp.bfloat16),
        a=_normal(rng, (N, D, g.num_v_heads), 1.0, jnp.bfloat16),
        b=_normal(rng, (N, D, g.num_v_heads), 1.0, jnp.bfloat16),
        conv_weight=_normal(rng, (g.conv_dim, g.conv_kernel), 0.5, jnp.bfloat16),
        conv_bias=_normal(rng, (g.conv_dim,), 0.1),
        A_log=jnp.asarray(rng.uniform(-1.0, 1.0, g.num_v_heads).astype(np.float32)),
        dt_bias=_normal(rng, (g.num_v_heads,), 0.5),
    )


def _filled(rng, pl: P.StatePool) -> P.StatePool:
    """Random states and random (stale) scratch: nothing is zero."""
    return jax.tree.map(lambda x: _normal(rng, x.shape, 0.5, x.dtype), pl)


G, N, D, S, R = SMALL, 5, 3, 13, 6  # D + 1 drafts allocated: the last step stays stale


def _scenario(seed, state_dtype):
    """A filled pool (random states and stale scratch), two layers of inputs, commit indices
    with every masking case and permuted rows."""
    rng = np.random.default_rng(seed)
    base = _filled(rng, P.allocate(G, slots=S, requests=R, drafts=D + 1, record="snapshots", state_dtype=state_dtype))
    stale_tuples = _filled(rng, P.allocate(G, slots=1, requests=R, drafts=D + 1, record="tuples")).tape
    layers = [_layer_inputs(rng, G, N, D) for _ in range(G.gdn_layers)]
    idx = commit_indices(seed % 1000, N=N, D=D, slots_in_pool=S, rows_in_tape=R, invalid=True, permute_rows=True)
    return jax.tree.map(np.asarray, base), stale_tuples, layers, idx


def _run(record, base, stale_tuples, layers, idx):
    """verify_layer for every layer, then commit. Returns (outputs, pool before commit as NumPy, pool after)."""
    tape = gdn.Snapshots(jnp.asarray(base.tape.states)) if record == "snapshots" else stale_tuples
    pl = P.StatePool(jnp.asarray(base.ssm), jnp.asarray(base.conv), tape, jnp.asarray(base.conv_windows), G)
    args = idx.as_args()
    slots, rows = args[0], args[4]
    outs = []
    for layer, x in enumerate(layers):
        old = pl
        o, pl = P.verify_layer(pl, layer, **x, slots=slots, rows=rows)
        assert old.ssm.is_deleted() and old.conv_windows.is_deleted(), "the pool is donated"
        outs.append(o)
    before = jax.tree.map(np.asarray, pl)
    return outs, before, P.commit(pl, *args)


@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.bfloat16])
def test_pool_tuples_equal_snapshots(seed, state_dtype):
    """Both record modes through the pool: same outputs, bit-identical SSM and conv pools."""
    base, stale, layers, idx = _scenario(seed, state_dtype)
    outs_t, _, pool_t = _run("tuples", base, stale, layers, idx)
    outs_s, _, pool_s = _run("snapshots", base, stale, layers, idx)
    testing.assert_bitwise_equal(outs_s, outs_t, "outputs: snapshot vs tuple pool")
    testing.assert_bitwise_equal(pool_s.ssm, pool_t.ssm, "SSM after commit")
    testing.assert_bitwise_equal(pool_s.conv, pool_t.conv, "conv after commit")
    changed = np.any(np.asarray(pool_t.ssm) != base.ssm, axis=(0, 2, 3, 4))
    assert 2 <= changed.sum() and not changed[S], "some slots written, the padding slot never"


def test_pool_matches_library_verify_and_commit(seed):
    """verify_layer writes the library's tape and the conv windows at the request's row;
    commit is :func:`gdn_lossless_jax.commit` plus :func:`conv.conv_commit`."""
    base, stale, layers, idx = _scenario(seed, jnp.float32)
    outs, before, after = _run("snapshots", base, stale, layers, idx)
    s_np, r_np = idx.slots, idx.rows
    ok = (s_np >= 0) & (s_np <= S) & (r_np < R)
    src = np.where(ok, s_np, 0)
    for layer, x in enumerate(layers):
        y, win = conv.causal_conv1d_verify(jnp.asarray(base.conv[layer, src]), x["mixed_qkv"], x["conv_weight"], x["conv_bias"])
        HK = G.num_k_heads * G.head_k_dim
        q = y[..., :HK].reshape(N, D, G.num_k_heads, G.head_k_dim)
        k = y[..., HK : 2 * HK].reshape(N, D, G.num_k_heads, G.head_k_dim)
        v = y[..., 2 * HK :].reshape(N, D, G.num_v_heads, G.head_v_dim)
        o, tape = gdn.verify(jnp.asarray(base.ssm[layer, src]), q, k, v, x["a"], x["b"], x["A_log"], x["dt_bias"], record="snapshots")
        testing.assert_bitwise_equal(np.asarray(o)[ok], np.asarray(outs[layer])[ok], f"layer {layer} outputs")
        testing.assert_bitwise_equal(np.asarray(tape.states)[ok], before.tape.states[layer, r_np[ok], :D])
        testing.assert_bitwise_equal(np.asarray(win)[ok], before.conv_windows[layer, r_np[ok], :, : D + 2])
    # Step D (unused by this verify) and rows no request names keep their stale bits (a
    # request whose slot is out of range still writes its row; commit skips it).
    testing.assert_bitwise_equal(base.tape.states[:, :, D], before.tape.states[:, :, D])
    untouched_rows = sorted(set(range(R)) - set(r_np.tolist()))
    assert untouched_rows
    testing.assert_bitwise_equal(base.tape.states[:, untouched_rows], before.tape.states[:, untouched_rows])
    testing.assert_bitwise_equal(base.ssm, before.ssm, "verify does not touch the SSM states")
    testing.assert_bitwise_equal(base.conv, before.conv, "verify does not touch the conv states")

    args = idx.as_args()
    want_ssm = gdn.commit(jnp.asarray(base.ssm), gdn.Snapshots(jnp.asarray(before.tape.states)), *args)
    want_conv = conv.conv_commit(jnp.asarray(base.conv), jnp.asarray(before.conv_windows), *args)
    testing.assert_bitwise_equal(want_ssm, after.ssm)
    testing.assert_bitwise_equal(want_conv, after.conv)


def test_verify_layer_rejects(seed):
    rng = np.random.default_rng(seed)
    pl = P.allocate(SMALL, slots=4, requests=2, drafts=2)
    x = _layer_inputs(rng, SMALL, 2, 3)
    slots = jnp.array([0, 1], jnp.int32)
    with pytest.raises(ValueError, match=r"verify_layer: argument 'mixed_qkv' has D=3 draft steps, but the pool's scratch was sized for at most drafts=2"):
        P.verify_layer(pl, 0, **x, slots=slots)
    x = _layer_inputs(rng, SMALL, 2, 2)
    with pytest.raises(ValueError, match=r"verify_layer: topk=4 is not supported"):
        P.verify_layer(pl, 0, **x, slots=slots, topk=4)
    with pytest.raises(ValueError, match=r"verify_layer: argument 'parents' gives the root of request 0 2 children"):
        P.verify_layer(pl, 0, **x, slots=slots, parents=np.array([[-1, -1], [-1, 0]]))
    with pytest.raises(ValueError, match=r"verify_layer: argument 'layer' must be in \[0, 2\), got 2"):
        P.verify_layer(pl, 2, **x, slots=slots)
    with pytest.raises(ValueError, match=r"argument 'mixed_qkv' must have shape \[N, D, conv_dim\] = \[2, 2, 128\]"):
        P.verify_layer(pl, 0, **{**x, "mixed_qkv": x["mixed_qkv"][..., :64]}, slots=slots)
    assert not pl.ssm.is_deleted(), "a rejected call donates nothing"


def test_store_layer_writes_rows_and_drops_out_of_range(seed):
    rng = np.random.default_rng(seed)
    g, N, D = SMALL, 3, 2
    pl = _filled(rng, P.allocate(g, slots=4, requests=3, drafts=3))
    before = jax.tree.map(np.asarray, pl)
    tape = gdn.Tuples(
        u=_normal(rng, (N, D, g.num_v_heads, g.head_v_dim)),
        k=_normal(rng, (N, D, g.num_k_heads, g.head_k_dim)),
        g=_normal(rng, (N, D, g.num_v_heads)),
    )
    win = _normal(rng, (N, g.conv_dim, D + g.conv_kernel - 2), 1.0, jnp.bfloat16)
    rows = jnp.array([2, -1, 7], jnp.int32)  # -1 must not wrap to the padding row; 7 is out of range
    pl = P.store_layer(pl, 1, tape, win, rows)
    testing.assert_bitwise_equal(np.asarray(tape.u[0]), np.asarray(pl.tape.u[1, 2, :D]))
    testing.assert_bitwise_equal(np.asarray(win[0]), np.asarray(pl.conv_windows[1, 2, :, : D + 2]))
    keep = [0, 1, 3]
    testing.assert_bitwise_equal(before.tape.u[:, keep], np.asarray(pl.tape.u)[:, keep])
    testing.assert_bitwise_equal(before.tape.u[0], np.asarray(pl.tape.u)[0])
    testing.assert_bitwise_equal(before.conv_windows[:, keep], np.asarray(pl.conv_windows)[:, keep])
    with pytest.raises(TypeError, match=r"store_layer: the pool records tuples, got a Snapshots tape"):
        P.store_layer(pl, 0, gdn.Snapshots(jnp.ones((N, D, 4, 16, 16))), win)


@pytest.mark.parametrize("mode", ["tuples", "snapshots", "deferred"])
def test_a_step_beyond_the_pools_requests_is_an_error(mode, seed):
    """A pool allocated for 2 requests takes no step of 3 (request 2 would go through the discard
    row, later ones would be dropped): verify_layer, store_layer and commit raise, in every mode,
    before anything is donated. Control: the same calls with 2 requests run."""
    rng = np.random.default_rng(seed)
    pl = P.allocate(SMALL, slots=8, requests=2, drafts=2, record="snapshots" if mode == "snapshots" else "tuples",
                    defer_commit=mode == "deferred")  # fmt: skip
    big, fits = _layer_inputs(rng, SMALL, 3, 2), _layer_inputs(rng, SMALL, 2, 2)
    with pytest.raises(ValueError, match=r"verify_layer: argument 'mixed_qkv' carries N=3 requests, but the pool was "
                                         r"allocated for requests=2 .* allocate it with requests >= 3"):  # fmt: skip
        P.verify_layer(pl, 0, **big, slots=jnp.arange(3, dtype=jnp.int32))
    steps = jnp.zeros(3, jnp.int32)
    with pytest.raises(ValueError, match=r"commit: argument 'slots' carries N=3 requests, but the pool was allocated "
                                         r"for requests=2"):  # fmt: skip
        P.commit(pl, jnp.arange(3, dtype=jnp.int32), steps)
    tape = jax.tree.map(lambda x: jnp.zeros((3, *x.shape[2:]), x.dtype), pl.tape)
    windows = jnp.zeros((3, SMALL.conv_dim, 2 + SMALL.conv_kernel - 2), pl.conv.dtype)
    with pytest.raises(ValueError, match=r"store_layer: argument 'tape' carries N=3 requests"):
        P.store_layer(pl, 0, tape, windows)
    assert not pl.ssm.is_deleted(), "a rejected call donates nothing"
    for layer in range(SMALL.gdn_layers):
        _, pl = P.verify_layer(pl, layer, **fits, slots=jnp.arange(2, dtype=jnp.int32))
    P.flush(P.commit(pl, jnp.arange(2, dtype=jnp.int32), steps[:2]))


def test_verify_layer_names_its_own_arguments(seed):
    """Errors name verify_layer's arguments (not the conv's or verify's internal names)."""
    rng = np.random.default_rng(seed)
    pl = P.allocate(SMALL, slots=4, requests=2, drafts=2)
    x, slots = _layer_inputs(rng, SMALL, 2, 2), jnp.arange(2, dtype=jnp.int32)
    C, Kc = SMALL.conv_dim, SMALL.conv_kernel
    cases = [
        ({"conv_weight": x["conv_weight"][:, :2]}, rf"verify_layer: argument 'conv_weight' must have shape \[conv_dim, Kc\] = \[{C}, {Kc}\]"),
        ({"conv_bias": jnp.zeros(C + 1)}, r"verify_layer: argument 'conv_bias' must have shape \[conv_dim\]"),
        ({"mixed_qkv": np.asarray(x["mixed_qkv"], np.float64)}, r"verify_layer: argument 'mixed_qkv' must be at most 32-bit"),
        ({"a": x["a"][..., :2]}, r"verify_layer: argument 'a' must have shape \[N, D, HV\]"),
    ]  # fmt: skip
    for change, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            P.verify_layer(pl, 0, **{**x, **change}, slots=slots)
    with pytest.raises(TypeError, match=r"verify_layer: argument 'scale' must be a real number or None, got str 'x'"):
        P.verify_layer(pl, 0, **x, slots=slots, scale="x")
    _, pl = P.verify_layer(pl, 0, **x, slots=slots)  # control: the same arguments, unchanged, run
