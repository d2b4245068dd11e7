"""Property-based tests (Hypothesis) of verify and commit over geometries, D, dtypes and indices.

The cases come from :mod:`gdn_lossless_jax.tools.fuzz` with Hypothesis as the integer source, so
every draw (shape, slots, rows, steps, track steps, specials, the data seed) shrinks. The
properties, each with the control it must catch:

* commit leaves every slot no valid request addresses bit-identical (control: a commit that
  writes one slot too many), and every addressed slot holds verify's snapshot of its step
  (controls: the twice-rounded rounding form through ``reference.commit(..., rule=...)``, the
  accepted-first ordering, one write skipped); the pallas kernels (interpret mode) also
  equal the reference's commit of the same tape;
* verify and commit never modify their non-donated inputs (control: a call that does);
* verify's outputs are bit-identical in both record modes with NaN (payloads included),
  Inf, signed zeros and subnormals in any input (control: an output whose NaN payload or
  zero sign differs, which a value comparison misses).

Profiles: ``ci`` (default) and ``long`` (``HYPOTHESIS_PROFILE=long``), see conftest.py.
Examples are seeded from ``GDN_SEED``; compiled functions are cached by shape (one
:class:`fuzz.Runner` per backend).
"""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, seed, settings
from hypothesis import strategies as st

import gdn_lossless_jax as gl
from conftest import examples
from gdn_lossless_jax.tools import fuzz
from gdn_lossless_jax import pool as P
from gdn_lossless_jax.testing.cases import Shape, verify_inputs
from gdn_lossless_jax.config import get_geometry
from gdn_lossless_jax.testing import assert_bitwise_differs, assert_bitwise_equal, bits, compare_bitwise

GDN_SEED = int(os.environ["GDN_SEED"])


@functools.cache
def runner(backend: str) -> fuzz.Runner:
    return fuzz.Runner(backend)


def source(data) -> fuzz.IntSource:
    """Hypothesis as the fuzz module's integer source: every draw shrinks on its own."""
    return lambda lo, hi: data.draw(st.integers(lo, hi))


def check_case(backend: str, case: fuzz.CommitCase):
    result, controls = runner(backend).run(case, controls=True)
    assert result.ok, fuzz.describe(result)
    missed = [name for name, caught in controls.items() if caught is False]
    assert not missed, f"controls not caught: {missed} ({case.shape})"
    # The untouched-slot property's control applies to every case.
    assert controls["one slot too many"]
    return result, controls


@seed(GDN_SEED)
@settings(max_examples=examples(6))
@given(st.data())
def test_commit_properties_reference(data):
    """Geometries (HV = 64, K = V = 256, K != V, H = HV, ...), D in [1, 32], fp32/bf16 pools
    and inputs, permuted and sparse rows, every masking rule, specials in a third of cases."""
    draw = source(data)
    shape = fuzz.draw_shape(draw, fuzz.CPU_FAMILIES)
    case = fuzz.draw_case(draw, shape, specials=4 if draw(0, 2) == 2 else 0)
    check_case("reference", case)


@seed(GDN_SEED)
@settings(max_examples=examples(2))
@given(st.data())
def test_commit_properties_pallas_interpret(data):
    """The Pallas kernels in interpret mode on small shapes (each compile takes seconds): the
    same properties, and the kernel commit equal to the reference's commit of the same tape."""
    draw = source(data)
    shape = fuzz.draw_shape(draw, ["h2-hv4-k16-v16"], max_drafts=4, max_layers=2, max_requests=3, state_dtypes=["float32"])
    case = fuzz.draw_case(draw, shape, specials=4 if draw(0, 1) else 0)
    result, _ = check_case("pallas", case)
    assert "reference/untouched" in result.corrupted, "the kernel commit was compared with the reference's"


@seed(GDN_SEED)
@settings(max_examples=examples(8))
@given(st.data(), st.sets(st.sampled_from(fuzz.VERIFY_INPUTS), min_size=1))
def test_record_modes_agree_with_specials(data, where):
    """Outputs bit-identical in both record modes, with specials in any inputs."""
    draw = source(data)
    shape = fuzz.draw_shape(draw, fuzz.CPU_FAMILIES, max_drafts=8)
    case = fuzz.draw_case(draw, shape, specials=8, where=sorted(where))
    outputs, _, kept = runner("reference").verify(case)
    assert kept, "verify modified its inputs"
    assert_bitwise_equal(outputs["snapshots"], outputs["tuples"], f"outputs, tuples vs snapshots ({shape})")
    # Control: a special whose bits change but whose value compares equal must be caught.
    out = outputs["tuples"]
    wrong = out.copy()
    b = bits(wrong).reshape(-1)
    nan = np.flatnonzero(np.isnan(out.reshape(-1).astype(np.float32)))
    zero = np.flatnonzero(out.reshape(-1).astype(np.float32) == 0)
    if nan.size:
        b[nan[0]] ^= 1  # another payload (the low bit of a bf16 or f32 NaN's fraction)
        b[nan[0]] |= 1 << (wrong.dtype.itemsize * 8 - 10)  # the quiet bit: still NaN, never Inf
    elif zero.size:
        b[zero[0]] ^= 1 << (wrong.dtype.itemsize * 8 - 1)  # -0 for +0
    else:
        b[0] ^= 1
    assert_bitwise_differs(out, wrong, "control: changed special")
    if nan.size or zero.size:  # what a value comparison would have let through
        assert np.array_equal(out.astype(np.float32), wrong.astype(np.float32), equal_nan=True)


def _host(tree):
    return jax.tree.map(lambda x: np.array(x, copy=True), tree)


def test_non_donated_inputs_control():
    """The input check catches a call that writes into its input (here a NumPy array)."""
    x = np.arange(8, dtype=np.float32)
    before = _host(x)
    np.copyto(x, x + 1)  # what a kernel aliasing a non-donated input would do
    assert not compare_bitwise(before, x).equal


@seed(GDN_SEED)
@settings(max_examples=examples(3))
@given(st.data())
def test_pool_commit_keeps_its_inputs_and_scratch(data):
    """pool.commit (pool donated) leaves its index arrays, and returns the scratch (tape,
    conv windows) bit-identical; its SSM and conv states are gl.commit's and conv_commit's."""
    draw = source(data)
    g = get_geometry("qwen3.6-35b-a3b").reduced(gdn_layers=2, heads_divisor=8, head_dim=16)
    N, D = draw(1, 4), draw(1, 4)
    record = ("tuples", "snapshots")[draw(0, 1)]
    rng = np.random.default_rng(draw(0, 2**31 - 1))
    pl = P.allocate(g, slots=2 * N + draw(1, 4), requests=N + draw(0, 3), drafts=D, record=record)
    pl = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape).astype(np.float32)).astype(x.dtype), pl)
    if record == "tuples":  # decays, not growth: g < 0
        pl = dataclasses.replace(pl, tape=dataclasses.replace(pl.tape, g=-jnp.abs(pl.tape.g)))
    idx = fuzz.draw_indices(draw, N, D, pl.slots + 1, pl.rows)
    args = tuple(jnp.asarray(a) for a in idx.as_args())
    before, args_before = _host(pl), _host(args)
    want_ssm = gl.commit(pl.ssm, pl.tape, *args)
    after = P.commit(pl, *args)
    assert_bitwise_equal(args_before, _host(args), "pool.commit's index arguments")
    assert_bitwise_equal(before.tape, _host(after.tape), "scratch tape after pool.commit")
    assert_bitwise_equal(before.conv_windows, _host(after.conv_windows), "conv windows after pool.commit")
    assert_bitwise_equal(_host(want_ssm), _host(after.ssm), "pool.commit's SSM states vs gl.commit")


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_replay_keeps_its_inputs(backend, seed):
    """gl.replay leaves state0, the tape and steps as they were (checked on bit patterns)."""
    x = verify_inputs(seed, Shape(N=2, D=3, H=2, HV=4, K=16, V=16), kind="mixed")
    _, tup = gl.verify(**x, backend=backend)
    steps = jnp.asarray([2, -1], jnp.int32)
    args = (x["state0"], tup, steps)
    before = _host(args)
    jax.block_until_ready(gl.replay(*args, backend=backend))
    assert_bitwise_equal(before, _host(args), "replay's inputs")
