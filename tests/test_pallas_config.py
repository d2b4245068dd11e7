"""Other launch configurations of the Pallas verify kernel keep the tape exact.

The reduction order over K depends on the layout Triton picks, so u and the states' low
bits may differ between configurations on a GPU; what must hold in every configuration:
outputs identical across record modes, and the replay of the tuples equal to the
snapshots at every step. Runs in interpret mode on the CPU and compiled on a GPU.
"""

import functools
import os

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gdn_lossless_jax as gl
from conftest import FULL_TESTS, ON_GPU, examples, full_only, requires_gpu
from equivalence import check_commit, control_replays, make_case
from gdn_lossless_jax import backends
from gdn_lossless_jax.backends.pallas import CommitConfig, VerifyConfig
from gdn_lossless_jax.testing.cases import Shape, verify_inputs
from gdn_lossless_jax.testing import assert_bitwise_differs, assert_bitwise_equal
from gdn_lossless_jax.testing import backend_verify

SHAPE = Shape(N=2, D=3, H=2, HV=4, K=16, V=16)


def _verify(x, record, config):
    pal = backends.resolve("pallas", "verify")
    return backend_verify(pal, **x, record=record, scale=x["q"].shape[-1] ** -0.5, out_dtype=jnp.float32, config=config)


CONFIGS = {
    "chain-bv16-w2": VerifyConfig(block_v=16, num_warps=2, algorithm="chain"),
    "chain-bv8-w1-one_pass": VerifyConfig(block_v=8, num_warps=1, one_pass=True, algorithm="chain"),
    "chain-bv4-w1": VerifyConfig(block_v=4, num_warps=1, algorithm="chain"),
    "chain-bv8-w1-kc8": VerifyConfig(k_chunk=8),  # the state tile as two [8, 8] chunks, the steps as a loop
    "chain-bv8-w1-kc8-unrolled": VerifyConfig(k_chunk=8, unroll=4),  # every step's inputs loaded first
    "chain-bv4-w1-kc4-unrolled": VerifyConfig(block_v=4, k_chunk=4, unroll=4),
    "chain-bv8-w1-kc8-no-evict": VerifyConfig(k_chunk=8, evict=None),  # the default evicts the state first
    "chain-bv8-w1-kc8-late-q": VerifyConfig(k_chunk=8, prefetch_q=False),  # each step loads its own q
    "chain-bv8-w1-kc8-prep1": VerifyConfig(k_chunk=8, prep_heads=1),  # a prologue program per q/k head
    "chain-bv8-w1-kc8-tiles-first": VerifyConfig(k_chunk=8, order="tiles"),  # grid (V tiles, HV, N), both modes
    "chain-bv8-w1-kc8-requests-first": VerifyConfig(k_chunk=8, order="requests"),  # grid (N, HV, V tiles), both
    "gram-bv8-w1-kc8-tiles-first": VerifyConfig(k_chunk=8, algorithm="gram", order="tiles"),
    "gram-bv8-w1-kc8": VerifyConfig(block_v=8, num_warps=1, k_chunk=8, algorithm="gram"),  # two chunks of K = 16
    "gram-bv16-w1-kc128": VerifyConfig(block_v=16, num_warps=1, k_chunk=128, algorithm="gram"),
    "gram-bv16-w1-mma": VerifyConfig(block_v=16, algorithm="gram", products="mma"),  # TF32x3 on a GPU
}
# The launches a GPU sweep tries, at K = V = 128: on a GPU the launch,
# not only the algorithm, sets the low bits (on the CPU they would repeat the cases above).
GPU_CONFIGS = {f"gram-bv{bv}-w{w}-kc{kc}": VerifyConfig(block_v=bv, num_warps=w, k_chunk=kc, algorithm="gram")
               for bv, w, kc in [(8, 1, 16), (16, 1, 16), (4, 1, 16), (16, 2, 32), (32, 4, 16)]}  # fmt: skip
GPU_CONFIGS |= {f"chain-bv{bv}-w{w}-kc{kc}-un{un}": VerifyConfig(block_v=bv, num_warps=w, k_chunk=kc, unroll=un)
                for bv, w, kc, un in [(8, 1, 16, 4), (16, 2, 16, 0), (4, 1, 16, 4), (8, 1, 128, 4)]}  # fmt: skip
GPU_CONFIGS |= {f"gram-bv{bv}-w{w}-kc{kc}-mma": VerifyConfig(block_v=bv, num_warps=w, k_chunk=kc, algorithm="gram",
                                                                products="mma")
                for bv, w, kc in [(16, 1, 32), (16, 1, 16), (32, 2, 32), (64, 4, 128)]}  # fmt: skip
GPU_CONFIGS["chain-no-evict"] = VerifyConfig(evict=None)
GPU_CONFIGS["chain-late-q"] = VerifyConfig(prefetch_q=False)
GPU_CONFIGS["chain-bv32-w4"] = VerifyConfig(block_v=32, num_warps=4)
GPU_CONFIGS |= {f"chain-prep{h}": VerifyConfig(prep_heads=h) for h in (0, 1)}  # all heads in one program; one each
GPU_CONFIGS |= {f"chain-order-{o}": VerifyConfig(order=o) for o in ("tiles", "requests")}
GPU_CONFIGS |= {f"chain-dot-fma-{d}": VerifyConfig(dot_fma=d) for d in ("none", "u")}  # the default fuses both


# Interpret mode compiles the unrolled chain's 4-column chunks (four of K = 16, every step's
# products unrolled) in ~45 s: at K = V = 8 it is still two chunks and two V tiles, in half.
SHAPES = {} if ON_GPU else {"chain-bv4-w1-kc4-unrolled": Shape(N=2, D=3, H=2, HV=4, K=8, V=8)}


# On the CPU with GDN_FULL_TESTS=1 only (the suite's time): the unrolled chunks run in the 4-column case,
# the grid's order in the gram tiles-first case and the snapshot verifies (tiles first by default; requests
# first is the tuple verify's), the prologue's heads a program in test_head_counts_that_are_not_powers_of_two
# (2, the default, and 0: all in one), the eviction hint off (it changes no arithmetic).
CPU_EXTENDED = {"chain-bv8-w1-kc8-unrolled", "chain-bv8-w1-kc8-requests-first", "chain-bv8-w1-kc8-tiles-first",
                "chain-bv8-w1-kc8-prep1", "chain-bv8-w1-kc8-no-evict"}  # fmt: skip


@pytest.mark.parametrize("config", [pytest.param(c, id=name, marks=full_only if name in CPU_EXTENDED and not ON_GPU else ())
                                    for name, c in CONFIGS.items()])  # fmt: skip
def test_config_keeps_the_tape_exact(config, seed, request):
    _check_config(config, seed, SHAPES.get(request.node.callspec.id, SHAPE))


@requires_gpu
@pytest.mark.parametrize("config", GPU_CONFIGS.values(), ids=GPU_CONFIGS.keys())
def test_gpu_launch_keeps_the_tape_exact(config, seed):
    _check_config(config, seed, Shape(N=3, D=4, H=4, HV=8, K=128, V=128))


def _check_config(config, seed, shape):
    x = verify_inputs(seed, shape, kind="normal")
    out_t, tup = _verify(x, "tuples", config)
    out_s, snp = _verify(x, "snapshots", config)
    assert_bitwise_equal(out_t, out_s, "outputs")  # one body for both modes
    last = jnp.full((shape.N,), shape.D - 1, jnp.int32)
    for step in range(shape.D):
        steps = jnp.full((shape.N,), step, jnp.int32)
        assert_bitwise_equal(snp.states[:, step], gl.replay(x["state0"], tup, steps, backend="reference"), f"step {step}")
    # Outputs: within fp32 rounding of the default launch.
    base, _ = _verify(x, "tuples", VerifyConfig())
    a, b = np.asarray(out_t), np.asarray(base)
    assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()
    # Control: the wrong replay forms of the same tape are caught.
    for name, replay in control_replays("reference").items():
        assert_bitwise_differs(snp.states[:, -1], replay(x["state0"], tup, last), name)


@st.composite
def _launches(draw):
    """A verify launch and a problem it takes: the algorithm, the one-pass chain, the V tile, the K
    chunk, the grid's order (None: the modes' defaults, tiles first for snapshots and requests first
    for tuples, two loops around one body); N, D, the heads' grouping, K = V."""
    K = draw(st.sampled_from([8, 16]))
    algorithm = draw(st.sampled_from(["chain", "gram"]))
    cfg = dict(algorithm=algorithm, block_v=draw(st.sampled_from([4, 8])), num_warps=1,
               k_chunk=draw(st.sampled_from([k for k in (4, 8, 16) if k <= K])),
               order=draw(st.sampled_from([None, "tiles", "requests"])))  # fmt: skip
    if algorithm == "chain":
        cfg["one_pass"] = draw(st.booleans())
    H = draw(st.sampled_from([1, 2]))
    shape = Shape(N=draw(st.integers(1, 3)), D=draw(st.integers(1, 4)), H=H, HV=H * draw(st.sampled_from([1, 2])),
                  K=K, V=K)  # fmt: skip
    return VerifyConfig(**cfg), shape, draw(st.integers(0, 2**31 - 1))


@settings(max_examples=examples(12 if FULL_TESTS else 2), derandomize=False)
@given(_launches())
def test_record_modes_give_the_same_outputs_in_every_launch(launch):
    """The record modes' outputs are one body's, bit for bit, in any launch, shape and seed (interpret
    mode: XLA:CPU compiles each mode's program on its own; the kernels keep every product apart from
    the sum it feeds and sum rows in a fixed tree there, so no fusion decides the bits), and the
    replay of the tuples gives the snapshots at every step. Control: the twice-rounded replay."""
    config, shape, data_seed = launch
    _check_config(config, data_seed, shape)


@pytest.mark.parametrize(("kwargs", "names"), [(dict(algorithm="scan"), "algorithm"), (dict(block_v=12), "block_v"),
                                               (dict(num_warps=3), "num_warps"), (dict(k_chunk=0), "k_chunk"),
                                               ({"unroll": -1}, "unroll"), ({"evict": "first"}, "evict"),
                                               ({"products": "tf32"}, "products"), ({"prep_heads": 3}, "prep_heads"),
                                               ({"products": "mma"}, "products"), ({"order": "heads"}, "order"),
                                               ({"dot_fma": "all"}, "dot_fma")])  # fmt: skip
def test_bad_config_names_the_field(kwargs, names):
    with pytest.raises(ValueError, match=names):
        VerifyConfig(**kwargs)


def test_bad_commit_order_names_the_field():
    with pytest.raises(ValueError, match="order"):
        CommitConfig(order="layers")


def test_k_not_a_multiple_of_k_chunk_is_refused(seed):
    """K = 24 in chunks of 16 would drop 8 columns of the state: refused, naming the field."""
    x = verify_inputs(seed, Shape(N=1, D=2, H=1, HV=1, K=24, V=8), kind="normal")
    with pytest.raises(ValueError, match="k_chunk"):
        _verify(x, "tuples", VerifyConfig(k_chunk=16))


@pytest.mark.parametrize(("K", "V", "k_chunk"), [(16, 8, 16), (8, 16, 16), (24, 16, 8)])
def test_mma_products_refuse_tiles_a_dot_cannot_take(K, V, k_chunk, seed):
    """products='mma' needs tl.dot tiles of side >= 16 that cover K: V = 8 rows, K = 8, and
    K = 24 (chunks of 8 for the state, but of 16 for the products: 8 columns would be
    dropped) are refused, naming the fields."""
    x = verify_inputs(seed, Shape(N=1, D=2, H=1, HV=1, K=K, V=V), kind="normal")
    with pytest.raises(ValueError, match="products='mma'.*block_v.*k_chunk"):
        _verify(x, "tuples", VerifyConfig(algorithm="gram", products="mma", block_v=16, k_chunk=k_chunk))


def test_head_counts_that_are_not_powers_of_two(seed):
    """H = 3, HV = 6: the prologue kernels pad the heads (in groups of 2, or all of them in one
    program) to powers of 2 (Triton's tiles must be) and mask them. The tape checks, and outputs within fp32 rounding of the reference's
    (a mask that drops real heads gives O(1) errors: tried, the test fails). On the CPU an
    unmasked access past the array is dropped, so only a GPU run sees that kind of mistake.
    """
    shape = Shape(N=2, D=3, H=3, HV=6, K=16, V=16)
    x = verify_inputs(seed, shape, kind="normal")
    ref = np.asarray(gl.verify(**x, backend="reference", out_dtype=jnp.float32)[0])
    # (the Gram form, whose prologue takes one head a program and pads none, with GDN_FULL_TESTS=1 on the CPU)
    gram = [VerifyConfig(block_v=8, num_warps=1, algorithm="gram")] if ON_GPU or FULL_TESTS else []
    for config in (VerifyConfig(), VerifyConfig(prep_heads=0), *gram):
        _check_config(config, seed, shape)
        got = np.asarray(_verify(x, "tuples", config)[0])
        assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max(), config


@pytest.mark.parametrize(("evict", "order"), [(None, "heads"), ("evict_first", "heads"), (None, "requests"),
                                             (None, "tiles")])  # fmt: skip
def test_commit_config_keeps_the_commit_exact(evict, order, seed):
    """The replay's eviction hint, its prefetch of the next step and the grid's order change no
    bit: the tuple commit equals the snapshot commit of the same verify, with every masking rule
    exercised. Control: the twice-rounded replay form of the same commit differs."""
    case = make_case("pallas", seed, Shape(N=3, D=3, H=2, HV=4, K=16, V=16), state_dtype=jnp.float32, kind="normal")
    commit = functools.partial(backends.resolve("pallas", "commit").commit,
                               config=CommitConfig(block_v=8, num_warps=1, evict=evict, order=order))  # fmt: skip
    by_tuples = check_commit(case, commit)
    wrong = commit(case.pool, case.tuples, *case.idx.as_args(), form="twice_rounded")
    assert_bitwise_differs(by_tuples, wrong, "twice-rounded replay")


@pytest.mark.parametrize("order", ["heads", "requests", "tiles"])
def test_one_layer_snapshot_commit_writes_that_layer_only(order, seed):
    """``commit_snapshots(..., layers=(l, lt))`` (the ``mosaic`` backend's pending snapshot commit,
    in place ahead of its verify) writes into pool layer ``l`` what the all-layers commit writes
    from tape layer ``lt``, and every other layer keeps its bits. Control: the tape's layer taken
    as the pool's differs."""
    from gdn_lossless_jax.backends.pallas import _interpret
    from gdn_lossless_jax.backends.pallas.commit import commit_snapshots

    rng = np.random.default_rng(seed)
    L, S, HV, V, K, LT, R, D = 3, 7, 4, 16, 16, 2, 5, 3
    pool = jnp.asarray(rng.standard_normal((L, S, HV, V, K), np.float32))
    states = jnp.asarray(rng.standard_normal((LT, R, D, HV, V, K), np.float32))
    # request 1 accepts nothing, 2 has an out-of-range row, 3 tracks only; 0 both
    idx = [jnp.asarray(a, jnp.int32) for a in ([4, 0, 6, 2], [2, -1, 1, -1], [5, 1, -1, 3], [0, 2, 1, 1],
                                               [3, 0, R, 1])]  # fmt: skip
    cfg = CommitConfig(order=order)
    l, lt = 2, 1
    got = commit_snapshots(pool, states, *idx, config=cfg, interpret=_interpret(), layers=jnp.asarray([l, lt]))
    want = commit_snapshots(pool[l:l + 1], states[lt:lt + 1], *idx, config=cfg, interpret=_interpret())
    assert_bitwise_equal(want[0], got[l], "the committed layer")
    assert_bitwise_differs(pool[l], got[l], "the committed layer against the pool before")
    others = np.asarray([i for i in range(L) if i != l])
    assert_bitwise_equal(pool[others], got[others], "the other layers")
    control = commit_snapshots(pool, states, *idx, config=cfg, interpret=_interpret(), layers=jnp.asarray([l, 0]))
    assert_bitwise_differs(got[l], control[l], "the commit from the wrong tape layer")
