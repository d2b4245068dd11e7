"""The reference against independent NumPy implementations, and with/without jit."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdn_lossless_jax as gl
from conftest import ON_GPU
from gdn_lossless_jax import reference
from gdn_lossless_jax.testing.cases import KINDS, Shape, commit_indices, verify_inputs
from gdn_lossless_jax.testing import assert_bitwise_differs, assert_bitwise_equal, replay_oracle


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.bfloat16])
def test_replay_equals_numpy_oracle(kind, state_dtype, seed):
    """The replay rule against an oracle that shares no code: f64 round-to-odd fma in NumPy."""
    shape = Shape(N=4, D=5, H=2, HV=4, K=16, V=8)
    x = verify_inputs(seed, shape, kind=kind, state_dtype=state_dtype)
    _, tup = gl.verify(**x, record="tuples")
    steps = np.array([4, 2, -1, 0], np.int32)
    alpha = np.asarray(gl.rounding.exp(tup.g))  # the oracle checks rounding, not the exponential
    want = replay_oracle(x["state0"], tup.u, tup.k, alpha, steps)
    assert_bitwise_equal(want, np.asarray(gl.replay(x["state0"], tup, jnp.asarray(steps))))


def test_adversarial_inputs_reach_their_regimes(seed):
    """The adversarial kinds do what they claim (else the oracle test above proves little)."""
    shape = Shape(N=1, D=3, H=2, HV=4, K=16, V=8)
    x = verify_inputs(seed, shape, kind="cancel", state_dtype=jnp.float32, input_dtype=jnp.float32)
    _, tup = gl.verify(**x, record="tuples")
    v_scale = np.abs(np.asarray(x["v"][:, 0])).max()
    assert np.abs(np.asarray(tup.u[:, 0])).max() < 1e-4 * v_scale  # v - Sd k cancelled
    x = verify_inputs(seed, shape, kind="decay_extremes")
    alpha = np.asarray(gl.rounding.exp(gl.reference.gates(x["a"], x["b"], x["A_log"], x["dt_bias"])[0]))
    assert (alpha[..., 0::2] > 1 - 1e-6).all() and (alpha[..., 1::2] < np.finfo(np.float32).tiny).all()
    x = verify_inputs(seed, shape, kind="subnormal")
    _, snp = gl.verify(**x, record="snapshots")
    s = np.abs(np.asarray(snp.states))
    assert ((s > 0) & (s < np.finfo(np.float32).tiny)).any()  # subnormal states reached and kept


def gdn_f64(x, scale):
    """An independent float64 NumPy implementation of the GDN steps (the six steps of gdn_lossless_jax.reference)."""
    f = lambda n: np.asarray(x[n], np.float64)  # noqa: E731
    S = f("state0").copy()
    q, k, v, a, b = f("q"), f("k"), f("v"), f("a"), f("b")
    N, D, H, K = q.shape
    HV = v.shape[2]
    r = HV // H
    out = np.zeros((N, D, HV, v.shape[3]))
    for t in range(D):
        xg = a[:, t] + f("dt_bias")
        sp = np.where(xg > 20, xg, np.log1p(np.exp(np.minimum(xg, 20))))
        g = -np.exp(f("A_log")) * sp
        beta = 1 / (1 + np.exp(-b[:, t]))
        qn = q[:, t] / np.sqrt((q[:, t] ** 2).sum(-1, keepdims=True) + 1e-6) * scale
        kn = k[:, t] / np.sqrt((k[:, t] ** 2).sum(-1, keepdims=True) + 1e-6)
        qn, kn = np.repeat(qn, r, 1), np.repeat(kn, r, 1)
        S = S * np.exp(g)[..., None, None]
        u = beta[..., None] * (v[:, t] - np.einsum("nhvk,nhk->nhv", S, kn))
        S = S + u[..., :, None] * kn[..., None, :]
        out[:, t] = np.einsum("nhvk,nhk->nhv", S, qn)
    return out


@pytest.mark.parametrize("D", [1, 4, 16])
def test_outputs_agree_with_float64(D, seed):
    """fp32 outputs vs float64, normwise relative error <= 1e-5.

    Why 1e-5: each step does O(1) roundings per state element plus two K-term dot
    products, whose errors grow like sqrt(K) * u on random data (u = 2**-24 ~ 6e-8);
    over D <= 16 steps the state error adds up to about D * sqrt(K) * u ~ 1e-5 in the
    worst case here (K = 64), and typical runs sit near 1e-7. A wrong operation (a missed
    decay, beta or norm) gives errors of order 1e-1, so the bound still has teeth.
    """
    shape = Shape(N=3, D=D, H=2, HV=4, K=64, V=32)
    x = verify_inputs(seed, shape, kind="normal", input_dtype=jnp.float32)
    out, _ = gl.verify(**x)
    ref = gdn_f64(x, 64**-0.5)
    rel = np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref)
    assert rel < 1e-5, rel
    # The control: dropping the decay is far outside the bound.
    x_nodecay = dict(x, A_log=jnp.full_like(x["A_log"], -30.0))
    bad, _ = gl.verify(**x_nodecay)
    assert np.linalg.norm(np.asarray(bad, np.float64) - ref) / np.linalg.norm(ref) > 1e-3


class JitTest(chex.TestCase):
    """The same bits with and without jit (chex variants)."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_verify_replay_commit(self):
        shape = Shape(N=3, D=4, H=2, HV=4, K=16, V=8)
        x = verify_inputs(11, shape, kind="mixed")
        base = {r: gl.verify(**x, record=r) for r in gl.RECORD_MODES}
        for record in gl.RECORD_MODES:
            got = self.variant(functools.partial(gl.verify, record=record))(**x)
            assert_bitwise_equal(base[record], got, record)
        tup, snp = base["tuples"][1], base["snapshots"][1]
        steps = jnp.asarray([3, -1, 1], jnp.int32)
        assert_bitwise_equal(gl.replay(x["state0"], tup, steps), self.variant(gl.replay)(x["state0"], tup, steps))
        pool = jnp.stack([x["state0"][jnp.array([0, 1, 2, 0, 1, 2, 0, 1, 2])]] * 2)  # [L=2, S=9, ...]
        idx = commit_indices(3, N=3, D=4, slots_in_pool=9).as_args()
        # Slot i of the pool holds request (i % 3)'s state; use matching slots.
        idx = (jnp.asarray([0, 1, 2], jnp.int32), *idx[1:2], jnp.asarray([3, 4, 5], jnp.int32), *idx[3:])
        stack = lambda t: jax.tree.map(lambda a: jnp.stack([a, a]), t)  # noqa: E731
        for tape in (stack(tup), stack(snp)):
            want = gl.commit(pool, tape, *idx)
            assert_bitwise_equal(want, self.variant(gl.commit)(pool, tape, *idx))


def _pairwise_numpy(x):
    """A float32 NumPy pairwise tree over the last axis (halves added until one is left; a power of 2)."""
    x = np.asarray(x, np.float32)
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


# A shard's rows of [N, D, H, K] = [2, 8, 8, 128]: one q/k head of 8 (an 8-way tensor axis), and
# one request with two heads (a 4 x 2 mesh); XLA:CPU's jnp.sum summed both in other orders than the whole.
SHARD_SLICES = {"one head of 8": np.s_[:, :, :1], "one request, two heads": np.s_[:1, :, :2]}


def test_ksum_fixed_order_gives_each_shard_shape_the_same_bits(seed):
    """``reference.ksum`` (the K sums of the norms, ``Sd @ k`` and ``S' @ q``) is one order for every
    shape: a NumPy float32 pairwise tree of the rounded terms, bit for bit, on the whole ``[2, 8, 8, 128]``
    and on the rows a shard of a mesh holds (so ``l2norm`` and ``prepare`` give a shard the whole's
    bits too). Control (CPU): ``jnp.sum`` of the same terms gives some shard's rows other bits than the
    whole's: XLA:CPU chose the order by shape (YNNPACK's one reduce for the whole, a 32-wide
    reduce-window and a reduce for a slice), the fault once seen on an 8-way mesh."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 8, 8, 128), dtype=np.float32)
    y = rng.standard_normal((2, 8, 8, 128), dtype=np.float32)
    fixed = jax.jit(lambda a, b: reference.ksum(a * b))
    whole = fixed(x, y)
    assert_bitwise_equal(_pairwise_numpy(x * y), whole, "ksum vs a NumPy pairwise tree")
    norm = jax.jit(reference.l2norm)
    for name, sl in SHARD_SLICES.items():
        assert_bitwise_equal(whole[sl], fixed(x[sl], y[sl]), f"ksum on a shard's rows ({name})")
        assert_bitwise_equal(norm(x)[sl], norm(x[sl]), f"l2norm on a shard's rows ({name})")
    if ON_GPU:  # the control shows XLA:CPU's choice
        return
    plain = jax.jit(lambda a, b: jnp.sum(a * b, axis=-1))
    whole = plain(x, y)
    slices = list(SHARD_SLICES.values())
    assert_bitwise_differs([whole[sl] for sl in slices], [plain(x[sl], y[sl]) for sl in slices],
                           "control: jnp.sum on a shard's rows vs the whole's: if this no longer differs, XLA:CPU "
                           "now sums these shapes in one order and the test above no longer exercises the case")
