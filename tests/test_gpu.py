"""Checks that only mean something on a GPU: PTX vs portable rounding, cross-backend tapes.

Skipped on a CPU (CI); run on the H200 by scripts/gpu_session.sh, whose log is committed
under benchmarks/results/.
"""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdn_lossless_jax as gl
from conftest import requires_gpu
from gdn_lossless_jax import backends
from gdn_lossless_jax.testing.cases import KINDS, Shape, verify_inputs
from gdn_lossless_jax.testing import assert_bitwise_differs, assert_bitwise_equal
from gdn_lossless_jax.testing import backend_verify

pytestmark = requires_gpu

SHAPE = Shape(N=5, D=8, H=16, HV=32, K=128, V=128)
# The portable form is integer arithmetic and compiles slowly (minutes a kernel at D = 8, K = 128);
# at D = 2, K = V = 32 (2 chunks) the kernel runs the same code.
FORMS_SHAPE = Shape(N=5, D=2, H=16, HV=32, K=32, V=32)
KERNEL_BACKENDS = ["pallas"] + (["triton"] if importlib.util.find_spec("jax_triton") else [])


@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
def test_pallas_ptx_and_portable_forms_are_bit_identical(kind, state_dtype, seed):
    """Both forms give the same bits where they run the same operations. The default launch
    fuses the dots' products with the fma instruction in the PTX form only (the portable form
    multiplies and adds, ``VerifyConfig.dot_fma``), so verify is compared with the dots unfused;
    the default PTX launch's tape is the one both forms replay."""
    pal = backends.resolve("pallas", "verify")
    x = verify_inputs(seed, FORMS_SHAPE, kind=kind, state_dtype=state_dtype)
    unfused = pal.VerifyConfig(dot_fma="none")
    for record in gl.RECORD_MODES:
        ptx = backend_verify(pal, **x, record=record, scale=128**-0.5, out_dtype=jnp.bfloat16, form="ptx", config=unfused)
        portable = backend_verify(pal, **x, record=record, scale=128**-0.5, out_dtype=jnp.bfloat16, form="portable",
                              config=unfused)  # fmt: skip
        assert_bitwise_equal(ptx, portable, f"verify {record}")
    tup = backend_verify(pal, **x, record="tuples", scale=128**-0.5, out_dtype=jnp.bfloat16, form="ptx")[1]
    steps = jnp.asarray(np.arange(FORMS_SHAPE.N) % FORMS_SHAPE.D, jnp.int32)
    assert_bitwise_equal(pal.replay(x["state0"], tup, steps, form="ptx"), pal.replay(x["state0"], tup, steps, form="portable"))


def test_pallas_default_launch_fuses_the_dots(seed):
    """The premise of the test above: the default PTX launch does fuse the dots (its u differs
    from the unfused launch's in the low bits), and its tape is as exact as the unfused one's."""
    pal = backends.resolve("pallas", "verify")
    x = verify_inputs(seed, SHAPE, kind="normal")
    kw = {"record": "tuples", "scale": 128**-0.5, "out_dtype": jnp.bfloat16, "form": "ptx"}
    fused = backend_verify(pal, **x, **kw)[1]
    assert_bitwise_differs(fused.u, backend_verify(pal, **x, **kw, config=pal.VerifyConfig(dot_fma="none"))[1].u, "fused dots")
    _, snp = backend_verify(pal, **x, **(kw | {"record": "snapshots"}))
    steps = jnp.full((SHAPE.N,), SHAPE.D - 1, jnp.int32)
    assert_bitwise_equal(snp.states[:, -1], gl.replay(x["state0"], fused, steps, backend="reference"))


def test_portable_fma_matches_hardware(seed):
    """rounding.fma_rn under XLA:GPU == fma.rn.f32 in a Pallas kernel, on random bit patterns."""
    from jax.experimental import pallas as pl

    from gdn_lossless_jax.backends.pallas.rounding import ops

    rng = np.random.default_rng(seed)
    a, b, c = (rng.integers(0, 2**32, 1 << 16, dtype=np.uint64).astype(np.uint32).view(np.float32) for _ in range(3))
    a, b, c = (x.reshape(256, 256) for x in (a, b, c))

    def kernel(a_ref, b_ref, c_ref, o_ref):
        o_ref[...] = ops("ptx").fma(a_ref[...], b_ref[...], c_ref[...])

    hw = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(a.shape, jnp.float32))(a, b, c)
    sw = jax.jit(gl.rounding.fma_rn)(a, b, c)
    nan = np.isnan(np.asarray(hw)) & np.isnan(np.asarray(sw))
    assert_bitwise_equal(np.where(nan, 0, np.asarray(hw)), np.where(nan, 0, np.asarray(sw)))


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.bfloat16])
def test_reference_replay_of_kernel_tape_equals_kernel_snapshots(backend, state_dtype, seed):
    """The tape is portable: XLA's replay of a kernel's tuples gives the kernel's snapshots."""
    x = verify_inputs(seed, SHAPE, kind="mixed", state_dtype=state_dtype)
    _, tup = gl.verify(**x, record="tuples", backend=backend)
    _, snp = gl.verify(**x, record="snapshots", backend=backend)
    for step in range(SHAPE.D):
        steps = jnp.full((SHAPE.N,), step, jnp.int32)
        assert_bitwise_equal(snp.states[:, step], gl.replay(x["state0"], tup, steps, backend="reference"), f"step {step}")


@pytest.mark.parametrize("backend", KERNEL_BACKENDS + ["mosaic"])
def test_weakly_typed_indices_replay_and_commit(backend, seed):
    """``jnp.full((N,), step)`` is a weakly typed int32: Pallas Triton's lowering of the commit kernel
    failed on it (an i1 added to an i32) until the API made index arrays plain int32. Replay and
    commit take such indices on every kernel backend and give the reference's bits."""
    try:
        backends.resolve(backend, "replay")
    except gl.BackendUnavailable as e:
        pytest.skip(str(e))
    x = verify_inputs(seed, SHAPE, kind="mixed")
    _, tup = gl.verify(**x, record="tuples", backend="reference")
    steps = jnp.full((SHAPE.N,), 2)
    assert steps.weak_type
    want = gl.replay(x["state0"], tup, steps, backend="reference")
    assert_bitwise_equal(want, gl.replay(x["state0"], tup, steps, backend=backend))
    pool, slots = x["state0"][None], jnp.arange(SHAPE.N)
    tape = jax.tree.map(lambda t: t[None], tup)
    assert_bitwise_equal(gl.commit(pool, tape, slots, steps, backend="reference"),
                         gl.commit(pool, tape, slots, steps, backend=backend))  # fmt: skip


@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.bfloat16])
def test_backends_agree_on_outputs(state_dtype, seed):
    """Verify outputs of all backends agree within 2e-3 relative (max-norm) in float32.

    Why 2e-3: the backends order the K-term reductions differently (XLA, Triton tiles), so
    states differ by a few fp32 ULPs after D steps (~1e-6 relative); outputs are
    additionally compared in float32 here, so the bound is loose on purpose; a wrong
    operation gives O(1) errors. The outputs are requested in float32.
    """
    x = verify_inputs(seed, SHAPE, kind="normal", state_dtype=state_dtype)
    ref, _ = gl.verify(**x, backend="reference", out_dtype=jnp.float32)
    ref = np.asarray(ref)
    for b in KERNEL_BACKENDS:
        got, _ = gl.verify(**x, backend=b, out_dtype=jnp.float32)
        rel = np.abs(np.asarray(got) - ref).max() / np.abs(ref).max()
        assert rel < 2e-3, (b, rel)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_in_kernel_control_replays_drift(backend, seed):
    x = verify_inputs(seed, SHAPE, kind="normal")
    _, tup = gl.verify(**x, record="tuples", backend=backend)
    _, snp = gl.verify(**x, record="snapshots", backend=backend)
    module = backends.resolve(backend, "replay")
    last = jnp.full((SHAPE.N,), SHAPE.D - 1, jnp.int32)
    assert module.CONTROL_FORMS
    for form in module.CONTROL_FORMS:
        report = assert_bitwise_differs(snp.states[:, -1], module.replay(x["state0"], tup, last, form=form), form)
        assert report.max_ulp >= 1
