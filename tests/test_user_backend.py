"""Example: checking a backend of your own with the equivalence suite the package ships.

``example_backend`` (tests/example_backend.py) is a tiny module wrapping the reference;
``wrong`` is the same with the replay's update rounded twice
(``controls.twice_rounded_update``: ``rn(rn(S * alpha) + rn(k * u))``, each operation pinned, so
it is wrong on every platform; the one-expression ``S * alpha + k * u`` is not a reliable
control: XLA:CPU from jax 0.12.1 contracts it into the rule). The suite passes the first and
must fail the second.
"""

import functools
import types

import jax
import jax.numpy as jnp
import pytest

import example_backend
import gdn_lossless_jax as gl
from gdn_lossless_jax import reference, rounding
from gdn_lossless_jax.testing.cases import Shape, verify_inputs
from gdn_lossless_jax.testing import assert_trees_bitwise_equal, run_equivalence_suite
from gdn_lossless_jax.testing import controls

# One geometry (grouped heads, N = 5 for every masking rule) keeps this example short;
# run_equivalence_suite's defaults cover three.
SHAPES = [Shape(N=5, D=3, H=2, HV=4, K=8, V=8)]

wrong = types.SimpleNamespace(
    verify=example_backend.verify,
    replay=jax.jit(lambda s, t, st: reference.replay(s, t, st, rule=controls.twice_rounded_update)),
    commit=jax.jit(lambda p, t, *idx: reference.commit(p, t, *idx, rule=controls.twice_rounded_update)),
)


def test_own_backend_passes(seed):
    passed = run_equivalence_suite(example_backend, shapes=SHAPES, seed=seed)
    assert len(passed) == 3  # fp32, bf16, the controls


def test_wrong_rounding_fails(seed):
    with pytest.raises(AssertionError, match=r"equivalence suite, case mixed N=5 .* float32: layer 0 step \d"):
        run_equivalence_suite(wrong, shapes=SHAPES, state_dtypes=[jnp.float32], seed=seed, controls=False)


def test_own_backend_through_the_api(seed):
    """The API takes the backend object wherever it takes a name, and checks arguments first."""
    x = verify_inputs(seed, SHAPES[0], kind="mixed")
    assert_trees_bitwise_equal(gl.verify(**x, backend="reference"), gl.verify(**x, backend=example_backend))
    with pytest.raises(ValueError, match=r"argument 'v' must have shape"):
        gl.verify(**dict(x, v=x["v"][:, :, :2]), backend=example_backend)
    with pytest.raises(TypeError, match=r"has no callable 'replay'"):
        gl.replay(x["state0"], gl.verify(**x)[1], jnp.zeros(5, jnp.int32), backend=types.SimpleNamespace())


def test_backend_of_the_earlier_signature_still_runs(seed):
    """A backend written for the earlier signature (``verify(state0, q, k, ..., *, record, scale,
    out_dtype, ...)``) runs for one release, with a DeprecationWarning, and gives the same bits."""

    @functools.partial(jax.jit, static_argnames=("record", "scale", "out_dtype"))
    def old_verify(state0, q, k, v, a, b, A_log, dt_bias, *, record, scale, out_dtype):
        return reference.verify(state0, q, k, v, a, b, A_log, dt_bias, record=record, scale=scale, out_dtype=out_dtype)

    old = types.SimpleNamespace(verify=old_verify, replay=example_backend.replay, commit=example_backend.commit)
    x = verify_inputs(seed, SHAPES[0], kind="mixed")
    with pytest.warns(DeprecationWarning, match="earlier backend signature"):
        got = gl.verify(**x, backend=old)
    assert_trees_bitwise_equal(gl.verify(**x, backend=example_backend), got)


def test_the_contract_is_one_protocol():
    """Every backend, built in or of one's own, implements the one typed protocol (its declared
    capabilities included); an object of the earlier, duck-typed contract is adapted with a warning."""
    from gdn_lossless_jax import backends
    from gdn_lossless_jax.backends.contract import Backend, Capabilities, as_backend

    for backend in (example_backend, *(backends.lookup(name) for name in backends.BACKENDS)):
        assert isinstance(backend, Backend), backend
        assert isinstance(backend.capabilities, Capabilities)
    assert as_backend(example_backend) is example_backend
    assert example_backend.capabilities.fused is False
    with pytest.warns(DeprecationWarning, match="lacks name, capabilities"):
        adapted = as_backend(types.SimpleNamespace(verify=wrong.verify, replay=wrong.replay, commit=wrong.commit))
    assert isinstance(adapted, Backend) and not adapted.capabilities.trees


def test_a_backend_that_does_not_fuse_the_pending_commit(seed):
    """``capabilities.fused=False``: ``commit_and_verify`` commits the layer with the backend's own
    ``commit``, then verifies: the reference's fused step, bit for bit (pool, outputs, tape)."""
    x = verify_inputs(seed, SHAPES[0], kind="mixed")
    N, D = 5, 3
    pool = jnp.stack([x["state0"], x["state0"] * 0.5])  # [L=2, S=N, HV, V, K]
    _, prev = gl.verify(**x)
    tape = jax.tree.map(lambda t: jnp.stack([t, t]), prev)
    steps = jnp.array([2, 0, -1, 1, 2], jnp.int32)
    track = jnp.array([-1, 0, -1, 1, -1], jnp.int32)
    pending = gl.Pending(tape, jnp.arange(N, dtype=jnp.int32), steps, jnp.where(track >= 0, 4 - jnp.arange(N), -1),
                         track)  # fmt: skip
    inputs = {k: v for k, v in x.items() if k != "state0"}
    want = gl.commit_and_verify(pool, pending, **inputs, slots=jnp.arange(N), layer=1, backend="reference")
    got = gl.commit_and_verify(pool, pending, **inputs, slots=jnp.arange(N), layer=1, backend=example_backend)
    assert_trees_bitwise_equal(want, got)
