"""KDA (gdn_lossless_jax.kda): tuples == snapshots bit for bit, commit's masks, the controls, float64.

Every bit-exactness check here has a control it is shown to catch (gdn_lossless_jax.testing.kda_controls):
the per-channel decay applied as one factor per head, the update rounded twice, the other product
fused, the decay broadcast over the wrong axis, and the accepted-first commit ordering.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import examples, full_only
from gdn_lossless_jax import kda, reference
from gdn_lossless_jax.tape import Snapshots
from gdn_lossless_jax.testing import assert_bitwise_differs, assert_bitwise_equal, fma_oracle, mul_oracle
from gdn_lossless_jax.testing.kda_controls import CONTROLS

F32, BF16 = jnp.float32, jnp.bfloat16
#: The fixed-shape tests' shape (N, D, H, K, V): one compile of each jitted function below serves them all.
SHAPE = (6, 4, 2, 16, 16)
verify = jax.jit(kda.verify, static_argnames=("record",))
replay = jax.jit(kda.replay, static_argnames=("form",))
commit = jax.jit(kda.commit, static_argnames=("form",))


def kda_inputs(seed, N, D, H, K, V, *, state_dtype=F32, input_dtype=BF16):
    """Random KDA inputs; decays spread over (0, 1) per channel (A_log and dt_bias vary over heads and K)."""
    rng = np.random.default_rng(seed)
    n = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return dict(
        state0=jnp.asarray(0.5 * n(N, H, V, K), state_dtype),
        q=jnp.asarray(n(N, D, H, K), input_dtype), k=jnp.asarray(n(N, D, H, K), input_dtype),
        v=jnp.asarray(n(N, D, H, V), input_dtype), f=jnp.asarray(n(N, D, H, K), input_dtype),
        b=jnp.asarray(n(N, D, H), input_dtype),
        A_log=jnp.asarray(np.log(rng.uniform(0.2, 4.0, H)), F32), dt_bias=jnp.asarray(n(H, K), F32),
    )  # fmt: skip


def _every_step(x, tup):
    """The replay of every step at once: request n's state0 and tape repeated D times, row (t, n) stopping after t."""
    N, D = tup.u.shape[:2]
    rep = lambda a: jnp.tile(a, (D,) + (1,) * (a.ndim - 1))  # noqa: E731
    steps = jnp.repeat(jnp.arange(D, dtype=jnp.int32), N)
    return rep(x["state0"]), jax.tree.map(rep, tup), steps


def _snap_rows(snp):
    """Snapshots ``[N, D, ...]`` in :func:`_every_step`'s row order ``(t, n)``."""
    s = np.asarray(snp.states)
    return np.concatenate([s[:, t] for t in range(s.shape[1])])


def _both(x):
    """Outputs and tapes of both record modes, and every step's replay of the tuple tape, in one compiled program."""

    def run(x):
        out_t, tup = kda.verify(**x, record="tuples")
        out_s, snp = kda.verify(**x, record="snapshots")
        return out_t, tup, out_s, snp, kda.replay(*_every_step(x, tup))

    return jax.jit(run)(x)


@settings(max_examples=examples(2))
@given(
    N=st.integers(1, 3), D=st.integers(1, 6), H=st.integers(1, 3), K=st.sampled_from([4, 8, 16, 32]),
    V=st.sampled_from([4, 8, 16]), bf16_pool=st.booleans(), seed=st.integers(0, 2**31 - 1),
)  # fmt: skip
def test_tuples_replay_equals_snapshots(N, D, H, K, V, bf16_pool, seed):
    """Every step's replay of the tuple tape is the snapshot, bit for bit; the outputs do not depend on the
    record mode. (The controls are caught in test_controls_are_caught.)"""
    x = kda_inputs(seed, N, D, H, K, V, state_dtype=BF16 if bf16_pool else F32)
    out_t, tup, out_s, snp, replayed = _both(x)
    assert isinstance(tup, kda.KDATuples) and isinstance(snp, Snapshots)
    assert (tup.u.shape, tup.k.shape, tup.g.shape) == ((N, D, H, V), (N, D, H, K), (N, D, H, K))
    assert_bitwise_equal(out_s, out_t, "outputs, snapshots vs tuples")
    assert_bitwise_equal(_snap_rows(snp), np.asarray(replayed), "replay of every step vs its snapshot")


def _fixed(seed, **kw):
    x = kda_inputs(seed, *SHAPE, input_dtype=F32, **kw)
    return x, verify(**x, record="tuples"), verify(**x, record="snapshots")


@pytest.mark.parametrize("name", list(CONTROLS))
def test_controls_are_caught(name, seed):
    """Each control replays every step of a fixed-shape tape; the snapshots catch it (and the rule passes)."""
    x, (out_t, tup), (out_s, snp) = _fixed(seed)
    assert_bitwise_equal(out_s, out_t, "outputs, snapshots vs tuples")
    state0, tape, steps = _every_step(x, tup)
    want = _snap_rows(snp)
    assert_bitwise_equal(want, np.asarray(replay(state0, tape, steps)), "the rule")
    assert_bitwise_differs(want, np.asarray(replay(state0, tape, steps, form=CONTROLS[name])), name)


def kda_oracle(state0, u, k, alpha, steps):
    """The replay rule in NumPy, no library code: ``S_t = fma(k_t, u_t, rn(S_{t-1} * alpha_t))`` with
    ``alpha [N, D, H, K]`` a per-column decay (float64 round-to-odd fma)."""
    S = np.asarray(state0).astype(np.float32).copy()
    u, k, alpha = (np.asarray(a, np.float32) for a in (u, k, alpha))
    N, D, H, _ = u.shape
    for n in range(N):
        for t in range(int(steps[n]) + 1 if 0 <= steps[n] < D else 0):
            for h in range(H):
                Sd = mul_oracle(S[n, h], alpha[n, t, h][None, :])
                S[n, h] = fma_oracle(k[n, t, h][None, :], u[n, t, h][:, None], Sd)
    return S.astype(np.asarray(state0).dtype)


@pytest.mark.parametrize("state_dtype", [F32, pytest.param(BF16, marks=full_only)])
def test_replay_equals_numpy_oracle(state_dtype, seed):
    """The replay against an oracle that shares no code with the library (the decay ``exp(g)`` taken as the
    library computed it: the oracle checks the rounding, not the exponential)."""
    x, (_, tup), _ = _fixed(seed, state_dtype=state_dtype)
    steps = np.array([3, 2, -1, 0, 1, 7], np.int32)
    alpha = np.asarray(kda.rounding.exp(tup.g))
    want = kda_oracle(x["state0"], tup.u, tup.k, alpha, steps)
    assert_bitwise_equal(want, np.asarray(replay(x["state0"], tup, jnp.asarray(steps))))


def expected_commit(pool, snaps, slots, steps, track_slots, track_steps, rows):
    """What a commit must write, in NumPy, from the snapshots ``[L, R, D, ...]`` (SGLang's masking rules)."""
    pool, snaps = np.asarray(pool).copy(), np.asarray(snaps)
    S, (R, D) = pool.shape[1], snaps.shape[1:3]
    writes = []
    for i in range(len(slots)):
        if not (0 <= slots[i] < S and 0 <= rows[i] < R):
            continue  # no pre-verify state: nothing, not even the track copy
        if 0 <= track_steps[i] < D and 0 <= track_slots[i] < S:
            writes.append((track_slots[i], snaps[:, rows[i], track_steps[i]]))
        if 0 <= steps[i] < D:
            writes.append((slots[i], snaps[:, rows[i], steps[i]]))
    for slot, state in writes:  # track copies first, the accepted states last (as commit scatters)
        pool[:, slot] = state
    return pool


@pytest.mark.parametrize("pool_dtype", [F32, pytest.param(BF16, marks=full_only)])
def test_commit_masks(pool_dtype, seed):
    """commit over L layers with SGLang's masks: accepted and track copies from the pre-verify state, invalid
    steps, slots, rows and track slots skipped, untouched slots bit-identical; tuples == snapshots == NumPy.
    Control: the accepted-first ordering (accepted state written, then the track state replayed from the pool)."""
    L, Sl = 2, 8
    R, D, H, K, V = SHAPE
    rng = np.random.default_rng(seed)
    pool = jnp.asarray(rng.standard_normal((L, Sl, H, V, K)), pool_dtype)
    slots = np.array([0, 3, 5, 7, 9, 2, -1, 6], np.int32)
    rows = np.array([0, 1, 2, 3, 4, 5, 0, 9], np.int32)
    steps = np.array([3, 0, -1, 2, 1, 1, 2, 0], np.int32)
    track_slots = np.array([1, 4, 6, -1, 1, 8, 1, 4], np.int32)
    track_steps = np.array([1, 0, 2, 1, 0, 0, 0, 0], np.int32)
    tups, snps = [], []
    for layer in range(L):
        x = kda_inputs(seed + layer, R, D, H, K, V, state_dtype=pool_dtype, input_dtype=F32)
        x["state0"] = pool[layer, np.clip(slots[:R], 0, Sl - 1)]  # request r < R has row r; 6 and 7 are invalid
        tups.append(verify(**x, record="tuples")[1])
        snps.append(verify(**x, record="snapshots")[1])
    tup = jax.tree.map(lambda *a: jnp.stack(a), *tups)
    snp = jax.tree.map(lambda *a: jnp.stack(a), *snps)
    args = (slots, steps, track_slots, track_steps, rows)
    want = expected_commit(pool, snp.states, *args)
    got_t = commit(pool, tup, *args)
    got_s = commit(pool, snp, *args)
    assert_bitwise_equal(want, np.asarray(got_s), "snapshot commit vs NumPy")
    assert_bitwise_equal(want, np.asarray(got_t), "tuple commit vs NumPy")
    # written: 0, 3, 7, 2 (accepted), 1, 4, 6 (track copies); slot 5's request accepted nothing (step -1)
    assert_bitwise_equal(np.asarray(pool)[:, 5], np.asarray(got_t)[:, 5], "untouched slot")
    assert_bitwise_differs(np.asarray(pool)[:, 6], np.asarray(got_t)[:, 6], "the track copy of a request that "
                           "accepted nothing")  # fmt: skip
    none = np.full_like(slots, -1)
    first = commit(pool, tup, slots, steps, none, none, rows)  # control: accepted first, track from the pool
    wrong = commit(first, tup, slots, none, track_slots, track_steps, rows)
    assert_bitwise_differs(want, np.asarray(wrong), "control: accepted-first ordering")


def kda_f64(x, scale):
    """An independent float64 NumPy KDA (the module docstring's six steps, transformers' [K, V] layout)."""
    f = lambda n: np.asarray(x[n], np.float64)  # noqa: E731
    S = np.swapaxes(f("state0"), -1, -2).copy()  # [N, H, K, V]
    q, k, v, fg, b = f("q"), f("k"), f("v"), f("f"), f("b")
    N, D, H, K = q.shape
    out = np.zeros((N, D, H, v.shape[3]))
    for t in range(D):
        xg = fg[:, t] + f("dt_bias")
        g = -np.exp(f("A_log"))[:, None] * np.where(xg > 20, xg, np.log1p(np.exp(np.minimum(xg, 20))))
        beta = 1 / (1 + np.exp(-b[:, t]))
        qn = q[:, t] / np.sqrt((q[:, t] ** 2).sum(-1, keepdims=True) + 1e-6) * scale
        kn = k[:, t] / np.sqrt((k[:, t] ** 2).sum(-1, keepdims=True) + 1e-6)
        S = S * np.exp(g)[..., :, None]  # row c of [K, V] decays by exp(g[c])
        u = beta[..., None] * (v[:, t] - np.einsum("nhkv,nhk->nhv", S, kn))
        S = S + kn[..., :, None] * u[..., None, :]
        out[:, t] = np.einsum("nhkv,nhk->nhv", S, qn)
    return out, np.swapaxes(S, -1, -2)


def test_outputs_agree_with_float64(seed):
    """fp32 outputs and final state against float64 NumPy, normwise relative error <= 1e-5 (the bound of the GDN
    reference's test: about D sqrt(K) u). Control: a scalar decay (the mean of g over K) is off by far more."""
    x, _, (out, snp) = _fixed(seed)
    want_o, want_S = kda_f64(x, SHAPE[3] ** -0.5)
    rel = lambda a, b: np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)  # noqa: E731
    assert rel(out, want_o) <= 1e-5, rel(out, want_o)
    assert rel(snp.states[:, -1], want_S) <= 1e-5, rel(snp.states[:, -1], want_S)
    mean = lambda a: jnp.broadcast_to(a.mean(-1, keepdims=True), a.shape)  # noqa: E731
    y = dict(x, f=mean(x["f"]), dt_bias=mean(x["dt_bias"]))
    assert rel(verify(**y, record="snapshots")[0], want_o) > 1e-2


@full_only
def test_constant_channels_is_gdn(seed):
    """With the same gate input on every channel, KDA is GDN (H = HV): the library's GDN reference gives the same
    outputs and snapshots bit for bit."""
    x = kda_inputs(seed, *SHAPE, input_dtype=F32)
    x["f"] = jnp.broadcast_to(x["f"][..., :1], x["f"].shape)
    x["dt_bias"] = jnp.broadcast_to(x["dt_bias"][:, :1], x["dt_bias"].shape)
    out, snp = verify(**x, record="snapshots")
    gdn = jax.jit(reference.verify, static_argnames=("record", "scale"))
    ref_out, ref_snp = gdn(x["state0"], x["q"], x["k"], x["v"], x["f"][..., 0], x["b"], x["A_log"], x["dt_bias"][:, 0],
                           record="snapshots", scale=SHAPE[3] ** -0.5)  # fmt: skip
    assert_bitwise_equal(ref_out, out, "outputs")
    assert_bitwise_equal(ref_snp.states, snp.states, "snapshots")


def test_tape_size_and_errors():
    assert kda.snapshot_floats(32, 128, 128) / kda.tape_floats(32, 128, 128) == pytest.approx(42.67, abs=0.01)
    x = kda_inputs(0, 1, 2, 2, 8, 4)
    with pytest.raises(ValueError, match=r"argument 'dt_bias' must have shape \[2, 8\]"):
        kda.verify(**dict(x, dt_bias=x["dt_bias"][:, :4]))
    with pytest.raises(ValueError, match="argument 'record' must be 'tuples' or 'snapshots'"):
        kda.verify(**x, record="none")
