"""The causal conv1d of verify (deduplicated windows) and the conv part of commit, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn_lossless_jax import conv, rounding, testing
from gdn_lossless_jax.testing.cases import commit_indices


def _normal(rng, shape, scale, dtype):
    """Random normals built in NumPy (no XLA compile per shape), never zeros."""
    return jnp.asarray((scale * rng.standard_normal(shape)).astype(np.float32).astype(dtype))


def _inputs(seed, N, D, C, Kc, dtype, bias=True):
    rng = np.random.default_rng(seed)
    state = _normal(rng, (N, C, Kc - 1), 1.0, dtype)
    x = _normal(rng, (N, D, C), 2.0, dtype)
    w = _normal(rng, (C, Kc), 0.5, dtype)
    b = _normal(rng, (C,), 0.1, np.float32) if bias else None
    return state, x, w, b


def _taps_oracle(state, x, w, b):
    """Pre-activation accumulators ``[N, C, D]`` and dense windows ``[N, D, C, Kc-1]``, in NumPy."""
    xs = np.asarray(jnp.swapaxes(x, 1, 2).astype(state.dtype).astype(jnp.float32))
    cols = np.concatenate([np.asarray(state.astype(jnp.float32)), xs], axis=-1)  # x_{-(Kc-1)} .. x_{D-1}
    N, C, _ = cols.shape
    D, Kc = x.shape[1], w.shape[1]
    wf = np.asarray(w.astype(jnp.float32))
    acc = np.zeros((N, C, D), np.float32)
    if b is not None:
        acc += np.asarray(b, np.float32)[:, None]
    for t in range(D):
        for j in range(Kc):
            acc[:, :, t] = testing.fma_oracle(wf[:, j], cols[:, :, t + j], acc[:, :, t])
    windows = np.stack([cols[:, :, t + 1 : t + Kc] for t in range(D)], axis=1)
    return acc, windows.astype(state.dtype)  # exact: the values came from state's dtype


@pytest.mark.parametrize(
    "N, D, C, Kc, dtype, bias",
    [
        (3, 4, 24, 4, jnp.bfloat16, True),  # Qwen: Kc = 4, bf16 conv state
        (2, 1, 16, 4, jnp.bfloat16, False),  # one draft step: the window is all history but x_0
        (2, 6, 8, 2, jnp.float32, True),  # Kc = 2: no history columns in the buffer
        (1, 3, 8, 5, jnp.float32, False),  # Kc = 5 (widest SGLang supports), D < Kc - 1
    ],
)
def test_dedup_windows_match_dense_per_step_reference(seed, N, D, C, Kc, dtype, bias):
    state, x, w, b = _inputs(seed, N, D, C, Kc, dtype, bias)
    out, win = conv.causal_conv1d_verify(state, x, w, b)
    out_d, win_d = conv.causal_conv1d_verify_dense(state, x, w, b)
    assert out.shape == (N, D, C) and out.dtype == x.dtype
    assert win.shape == (N, C, D + Kc - 2) and win.dtype == state.dtype
    assert win_d.shape == (N, D, C, Kc - 1)
    testing.assert_bitwise_equal(out_d, out, "outputs: deduplicated vs dense per-step windows")
    testing.assert_bitwise_equal(win_d, conv.dense_windows(win, Kc), "window t = phys[..., t:t+Kc-1]")

    acc, win_o = _taps_oracle(state, x, w, b)
    testing.assert_bitwise_equal(win_o, np.asarray(win_d), "dense windows vs NumPy")
    # phys[..., c] = x_{c-(Kc-2)}: the first Kc-2 columns are the old history, then the drafts.
    testing.assert_bitwise_equal(np.asarray(state)[..., 1:], np.asarray(win)[..., : Kc - 2])
    testing.assert_bitwise_equal(np.asarray(jnp.swapaxes(x, 1, 2).astype(dtype)), np.asarray(win)[..., Kc - 2 :])
    silu = jax.jit(lambda a: a / (1.0 + rounding.exp(-a)))(acc)
    testing.assert_bitwise_equal(np.asarray(jnp.swapaxes(silu, 1, 2).astype(dtype)), np.asarray(out), "outputs vs NumPy taps")


def test_taps_are_pinned_fma_not_plain_fp32(seed):
    """The accumulation is ``fma(w, x, acc)``: a twice-rounded sum would differ somewhere."""
    state, x, w, b = _inputs(seed, 4, 4, 64, 4, jnp.float32)
    acc, _ = _taps_oracle(state, x, w, b)
    cols = np.concatenate([np.asarray(state), np.asarray(x).transpose(0, 2, 1)], -1)
    twice = np.zeros_like(acc) + np.asarray(b)[:, None]
    for t in range(4):
        for j in range(4):
            twice[:, :, t] = twice[:, :, t] + np.asarray(w)[:, j] * cols[:, :, t + j]  # NumPy: two roundings
    testing.assert_bitwise_differs(acc, twice)


def test_verify_does_not_touch_the_state_and_rejects_bad_shapes(seed):
    state, x, w, b = _inputs(seed, 2, 3, 8, 4, jnp.bfloat16)
    before = np.asarray(state).copy()
    conv.causal_conv1d_verify(state, x, w, b)
    testing.assert_bitwise_equal(before, np.asarray(state))
    with pytest.raises(ValueError, match=r"argument 'weight' must have shape \[conv_dim, Kc\] = \[8, 4\]"):
        conv.causal_conv1d_verify(state, x, w[:, :3], b)
    with pytest.raises(ValueError, match=r"argument 'x' must have shape \[N, D, conv_dim\] = \[2, 3, 8\]"):
        conv.causal_conv1d_verify(state, x[..., :7], w, b)
    with pytest.raises(ValueError, match=r"argument 'bias'"):
        conv.causal_conv1d_verify(state, x, w, b[:4])


def _commit_oracle(pool, windows, idx):
    """SGLang's masked window scatter, request by request, in NumPy (track copies, then accepted)."""
    out = np.asarray(pool).copy()
    win = np.asarray(windows)
    S, R = out.shape[1], win.shape[1]
    Kc = out.shape[-1] + 1
    D = win.shape[-1] - (Kc - 2)
    ok = lambda i: 0 <= idx.slots[i] < S and 0 <= idx.rows[i] < R  # noqa: E731
    for i in range(len(idx.slots)):
        t, dst = idx.track_steps[i], idx.track_slots[i]
        if ok(i) and 0 <= t < D and 0 <= dst < S:
            out[:, dst] = win[:, idx.rows[i], :, t : t + Kc - 1]
    for i in range(len(idx.slots)):
        t = idx.steps[i]
        if ok(i) and 0 <= t < D:
            out[:, idx.slots[i]] = win[:, idx.rows[i], :, t : t + Kc - 1]
    return out


@pytest.mark.parametrize("backend", ["reference", "pallas"])  # XLA, and the Pallas kernel (interpret mode on a CPU)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_conv_commit_bit_exact_with_masks(seed, dtype, backend):
    L, N, D, C, Kc = 2, 9, 4, 8, 4
    S, R = 2 * N + 3, N + 2
    rng = np.random.default_rng(seed)
    pool = _normal(rng, (L, S, C, Kc - 1), 1.0, dtype)
    windows = _normal(rng, (L, R, C, D + Kc - 2), 1.0, dtype)
    # Requests use slots [0, S-1): the last slot is only reachable by wrapping a negative index.
    idx = commit_indices(seed % 1000, N=N, D=D, slots_in_pool=S - 1, rows_in_tape=R, invalid=True, permute_rows=True)
    # More masking cases than commit_indices makes: a negative own slot (must not wrap to the
    # last slot), a track slot one past the end, a step equal to D, a track step at D - 1.
    idx.slots[5] = -1
    idx.track_steps[5] = 0
    idx.track_slots[6], idx.track_steps[6] = S, 0
    idx.steps[7] = D
    idx.track_steps[8] = min(D - 1, idx.steps[8]) if idx.steps[8] >= 0 else -1
    got = conv.conv_commit(pool, windows, *idx.as_args(), backend=backend)
    want = _commit_oracle(pool, windows, idx)
    testing.assert_bitwise_equal(want, np.asarray(got))
    # The masking cases did something: some slots changed, and the skipped ones did not.
    changed = np.any(np.asarray(got) != np.asarray(pool), axis=(0, 2, 3))
    assert changed.sum() >= 3
    assert not changed[S - 1], "a negative slot must not wrap to the last slot"
    for i in (1, 7):  # negative step, step == D: own slot untouched
        assert not changed[idx.slots[i]]
    assert not changed[idx.track_slots[2]], "own slot out of range: the track copy is skipped too"


def test_conv_commit_defaults_and_errors(seed):
    L, N, D, C, Kc = 1, 3, 2, 4, 4
    rng = np.random.default_rng(seed)
    pool = _normal(rng, (L, 8, C, Kc - 1), 1.0, jnp.bfloat16)
    windows = _normal(rng, (L, N, C, D + Kc - 2), 1.0, jnp.bfloat16)
    slots, steps = jnp.array([4, 0, 6], jnp.int32), jnp.array([1, 0, -1], jnp.int32)
    got = np.asarray(conv.conv_commit(pool, windows, slots, steps))
    win = np.asarray(windows)
    testing.assert_bitwise_equal(win[:, 0, :, 1:4], got[:, 4])
    testing.assert_bitwise_equal(win[:, 1, :, 0:3], got[:, 0])
    testing.assert_bitwise_equal(np.asarray(pool)[:, 6], got[:, 6])
    with pytest.raises(TypeError, match="window dtype float32 must match the conv pool dtype bfloat16"):
        conv.conv_commit(pool, windows.astype(jnp.float32), slots, steps)
    with pytest.raises(ValueError, match="give both track_slots and track_steps"):
        conv.conv_commit(pool, windows, slots, steps, track_slots=slots)
    with pytest.raises(ValueError, match=r"argument 'steps' must have shape \[N\] = \[3\]"):
        conv.conv_commit(pool, windows, slots, steps[:2])


@pytest.mark.parametrize(
    "N, D, C, Kc, dtype, splits",
    [
        (3, 4, 32, 4, jnp.bfloat16, (8, 8, 16)),  # Qwen's Kc, bf16 windows, split into [q | k | v]
        (2, 1, 16, 4, jnp.bfloat16, None),  # one draft step
        (2, 3, 16, 2, jnp.float32, (16,)),  # Kc = 2: the windows hold the drafts only
    ],
)
@pytest.mark.parametrize("backend", ["pallas", "reference"])
def test_verify_from_pool_equals_the_gathered_conv(seed, N, D, C, Kc, dtype, splits, backend):
    """The conv read from the pool by slot (the Pallas kernel in interpret mode on a CPU,
    compiled on a GPU; XLA for the reference) equals the XLA conv of the gathered states, with
    padding slots reading zeros and the windows written into a buffer at permuted rows."""
    rng = np.random.default_rng(seed)
    L, S, R = 2, 2 * N + 2, N + 3
    pool = _normal(rng, (L, S, C, Kc - 1), 1.0, dtype)
    x = _normal(rng, (N, D, C), 2.0, dtype)
    w = _normal(rng, (C, Kc), 0.5, dtype)
    b = _normal(rng, (C,), 0.1, np.float32)
    slots = rng.permutation(S)[:N].astype(np.int32)
    slots[-1] = S + 1  # a padding slot: zeros
    rows = rng.permutation(R)[:N].astype(np.int32)
    layer = 1
    gathered = jnp.where(jnp.asarray(slots < S)[:, None, None], pool[layer, np.clip(slots, 0, S - 1)], 0).astype(dtype)
    want_y, want_w = conv.causal_conv1d_verify(gathered, x, w, b)
    bounds = np.cumsum([0, *(splits or (C,))])
    fresh = conv.verify_from_pool(pool, layer, jnp.asarray(slots), x, w, b, splits=splits, backend=backend)
    for (lo, hi), y in zip(zip(bounds[:-1], bounds[1:]), fresh[0]):
        testing.assert_bitwise_equal(np.asarray(want_y)[..., lo:hi], np.asarray(y), f"outputs [{lo}:{hi}]")
    testing.assert_bitwise_equal(want_w, fresh[1], "fresh windows")
    buf = _normal(rng, (L, R, C, D + 1 + Kc - 2), 1.0, dtype)  # one step more than D: a column stays
    want_buf = np.asarray(buf).copy()
    want_buf[layer, rows, :, : D + Kc - 2] = np.asarray(want_w)
    _, got_buf = jax.jit(lambda bf, s, r: conv.verify_from_pool(pool, layer, s, x, w, b, windows=bf, rows=r,
                                                                 splits=splits, backend=backend), donate_argnums=0)(
        jnp.copy(buf), jnp.asarray(slots), jnp.asarray(rows))  # fmt: skip
    testing.assert_bitwise_equal(want_buf, np.asarray(got_buf), "windows written in place at the rows")
    # Control: twice-rounded taps (a multiply, then an add) give other outputs (in fp32 with fp32
    # weights: a product of two bf16 values is exact, and a bf16 output rounds a 1-ULP
    # difference away almost always).
    f32 = jnp.float32
    w = _normal(rng, (C, Kc), 0.5, f32)
    outs32, _ = conv.verify_from_pool(pool.astype(f32), layer, jnp.asarray(slots), x.astype(f32), w, b, backend=backend)
    cols = jnp.concatenate([gathered, jnp.swapaxes(x, 1, 2).astype(dtype)], -1).astype(f32)
    acc = jnp.broadcast_to(b[:, None], (N, C, D))
    for j in range(Kc):
        acc = acc + w.astype(f32)[:, j, None] * cols[..., j : j + D]  # eager: two roundings
    twice = jnp.swapaxes(acc / (1.0 + rounding.exp(-acc)), 1, 2)
    testing.assert_bitwise_differs(twice, outs32[0], "twice-rounded taps")
