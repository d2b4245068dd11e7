"""Derivatives of verify, replay, commit and the rounding primitives.

The chain of evidence: (1) the plain-float formulation's autodiff derivatives equal finite
differences in float64; (2) the plain formulation computes the library's function (values
within fp32 rounding); (3) the library's derivatives (every backend, jvp and vjp) are the
plain formulation's, bit for bit under jit; (4) directly, the library's derivatives match
finite differences of its own exact fp32 values. Nothing returns a silent zero.
"""

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import gdn_lossless_jax as gl
from conftest import FULL_TESTS, ON_GPU
from gdn_lossless_jax import autodiff, conv, reference, rounding
from gdn_lossless_jax.testing.cases import Shape, commit_indices, verify_inputs
from gdn_lossless_jax.testing import assert_bitwise_differs, assert_bitwise_equal
from gdn_lossless_jax.testing import controls

SHAPE = Shape(N=3, D=3, H=2, HV=4, K=4, V=4)
L, S_POOL = 2, 8
F32 = jnp.float32

BACKENDS = ["reference", "pallas"] + (
    ["triton"] if ON_GPU and importlib.util.find_spec("jax_triton") is not None else []
)


def _normal(rng, shape, dtype=F32):
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def _problem(op: str, seed: int, *, kind="normal", input_dtype=jnp.bfloat16):
    """``(function of the float args, float args, plain formulation)`` for one entry point.

    ``op``: one of :data:`OPS`. Integer arguments are bound (their tangents are float0).
    """
    rng = np.random.default_rng(seed)
    x = verify_inputs(rng, SHAPE, kind=kind, input_dtype=input_dtype)
    if op == "verify-pool":  # states read from the pool by slot (a padding slot reads zeros), tape into a buffer
        s, d = SHAPE, SHAPE.D
        pool = _normal(rng, (L, S_POOL, s.HV, s.V, s.K))
        buf = gl.Tuples(
            u=_normal(rng, (L, s.N + 1, d + 1, s.HV, s.V)),
            k=_normal(rng, (L, s.N + 1, d + 1, s.H, s.K)),
            g=_normal(rng, (L, s.N + 1, d + 1, s.HV)),
        )
        slots, rows = jnp.asarray([2, S_POOL, 5], jnp.int32), jnp.asarray([1, 3, 0], jnp.int32)
        layer = jnp.asarray(1, jnp.int32)
        inputs = tuple(x[n] for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias"))

        def lib(backend):
            return lambda p, *xs: gl.verify(p, *xs[:-1], slots=slots, layer=layer, tape=xs[-1], rows=rows, backend=backend)

        def plain(p, *xs):
            outputs, tape = autodiff.plain_verify(reference.read_slots(p, layer, slots), *xs[:-1])
            return outputs, reference.write_rows(xs[-1], layer, rows, tape)

        return lib, (pool, *inputs, buf), plain
    if op == "verify-out":  # the outputs written into a [L, N, D, HV, V] buffer at the layer
        pool = _normal(rng, (L, S_POOL, SHAPE.HV, SHAPE.V, SHAPE.K))
        obuf = _normal(rng, (L, SHAPE.N, SHAPE.D, SHAPE.HV, SHAPE.V), input_dtype)
        slots, layer = jnp.asarray([2, S_POOL, 5], jnp.int32), jnp.asarray(1, jnp.int32)
        inputs = tuple(x[n] for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias"))

        def lib(backend):
            return lambda p, *xs: gl.verify(p, *xs[:-1], slots=slots, layer=layer, out=xs[-1], backend=backend)

        def plain(p, *xs):
            outputs, tape = autodiff.plain_verify(reference.read_slots(p, layer, slots), *xs[:-1])
            return xs[-1].at[layer].set(outputs), tape

        return lib, (pool, *inputs, obuf), plain
    if op == "commit-and-verify":  # the previous step's commit of the layer fused into this verify
        s, d = SHAPE, SHAPE.D
        pool = _normal(rng, (L, S_POOL, s.HV, s.V, s.K))
        prev = gl.Tuples(
            u=_normal(rng, (L, s.N, d, s.HV, s.V)),
            k=_normal(rng, (L, s.N, d, s.H, s.K)),
            g=-jnp.abs(_normal(rng, (L, s.N, d, s.HV))),
        )
        slots, layer = jnp.asarray([2, 6, 5], jnp.int32), jnp.asarray(1, jnp.int32)
        prows, psteps = jnp.asarray([2, 0, 1], jnp.int32), jnp.asarray([d - 1, -1, 0], jnp.int32)
        ptslots, ptsteps = jnp.asarray([4, -1, -1], jnp.int32), jnp.asarray([0, -1, -1], jnp.int32)
        inputs = tuple(x[n] for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias"))

        def lib(backend):
            def f(p, *xs):
                pending = gl.Pending(xs[-1], prows, psteps, ptslots, ptsteps)
                return gl.commit_and_verify(p, pending, *xs[:-1], slots=slots, layer=layer, backend=backend)

            return f

        def plain(p, *xs):  # commit the layer, then verify from the pool it leaves
            one = jax.tree.map(lambda t: t[layer][None], xs[-1])
            committed = autodiff.plain_commit(p[layer][None], one, slots, psteps, ptslots, ptsteps, prows)
            p = p.at[layer].set(committed[0])
            outputs, tape = autodiff.plain_verify(reference.read_slots(p, layer, slots), *xs[:-1])
            return outputs, tape, p

        return lib, (pool, *inputs, prev), plain
    if op.startswith("verify"):
        record = op.split("-")[1]
        return (
            lambda backend: functools.partial(gl.verify, record=record, backend=backend),
            tuple(x.values()),
            functools.partial(autodiff.plain_verify, record=record),
        )
    s, d = SHAPE, SHAPE.D
    tuples = gl.Tuples(
        u=_normal(rng, (s.N, d, s.HV, s.V)),
        k=_normal(rng, (s.N, d, s.H, s.K)),
        g=-jnp.abs(_normal(rng, (s.N, d, s.HV))),
    )
    if op == "replay":
        steps = rng.integers(-1, d, s.N)
        steps[rng.integers(s.N)] = d - 1  # one request replays every step (else all of them may skip: zero derivatives)
        steps = jnp.asarray(steps, jnp.int32)
        return (
            lambda backend: lambda s0, t: gl.replay(s0, t, steps, backend=backend),
            (x["state0"], tuples),
            lambda s0, t: autodiff.plain_replay(s0, t, steps),
        )
    idx = commit_indices(seed, N=s.N, D=d, slots_in_pool=S_POOL, rows_in_tape=s.N, invalid=True).as_args()
    pool = _normal(rng, (L, S_POOL, s.HV, s.V, s.K))
    if op == "commit-tuples":
        tape = jax.tree.map(lambda t: jnp.stack([t, 0.5 * t[::-1]]), tuples)
    else:
        tape = gl.Snapshots(_normal(rng, (L, s.N, d, s.HV, s.V, s.K)))
    return (
        lambda backend: lambda p, t: gl.commit(p, t, *idx, backend=backend),
        (pool, tape),
        lambda p, t: autodiff.plain_commit(p, t, *idx),
    )


OPS = [
    "verify-tuples",
    "verify-snapshots",
    "verify-pool",
    "verify-out",
    "commit-and-verify",
    "replay",
    "commit-tuples",
    "commit-snapshots",
]


def _random_like(rng, tree):
    return jax.tree.map(lambda t: _normal(rng, t.shape, t.dtype), tree)


# ---------------------------------------------------------------------------------
# (1) the plain formulation against finite differences in float64, and (2) against the
# library's values in float32
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize("op", OPS)
def test_plain_formulation_is_the_library_function_with_correct_derivatives(op, seed):
    make, args, plain = _problem(op, seed, input_dtype=F32)
    want, got = jax.jit(make("reference"))(*args), jax.jit(plain)(*args)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        w, g = np.asarray(w, np.float64), np.asarray(g, np.float64)
        # Normwise, as the outputs are checked against float64 elsewhere: the two differ
        # only by rounding, a few fp32 ULP per step.
        assert np.linalg.norm(w - g) <= 1e-5 * np.linalg.norm(w), op
    with jax.enable_x64(True):
        args64 = jax.tree.map(lambda t: jnp.asarray(np.asarray(t, np.float64)), args)
        assert all(t.dtype == jnp.float64 for t in jax.tree.leaves(jax.eval_shape(plain, *args64)))
        check_grads(jax.jit(plain), args64, order=1, modes=("fwd", "rev"))


# ---------------------------------------------------------------------------------
# (3) the library's derivatives are the plain formulation's, bit for bit
# ---------------------------------------------------------------------------------
def _jvp_vjp(f, args, tangents, cotangents):
    _, t = jax.jvp(f, args, tangents)
    _, pullback = jax.vjp(f, *args)
    return t, pullback(cotangents)


# On the CPU Pallas (interpret mode) runs the pool's paths and a commit, its other ops with GDN_FULL_TESTS=1 (the
# suite's time; every backend's tangent is the plain formulation's, gdn_lossless_jax.autodiff, the backend gives
# only the primal value).
_PALLAS_CI_OPS = ("verify-pool", "commit-and-verify", "commit-tuples")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", OPS)
def test_library_derivatives_are_the_plain_formulations(backend, op, seed):
    if backend == "pallas" and not (ON_GPU or FULL_TESTS or op in _PALLAS_CI_OPS):
        pytest.skip("extended set: GDN_FULL_TESTS=1 runs it (docs/testing.md)")
    make, args, plain = _problem(op, seed, kind="mixed")
    lib = make(backend)
    rng = np.random.default_rng(seed + 1)
    tangents = _random_like(rng, args)
    cotangents = _random_like(rng, jax.eval_shape(lib, *args))
    got = jax.jit(lambda *a: _jvp_vjp(lib, a, tangents, cotangents))(*args)
    want = jax.jit(lambda *a: _jvp_vjp(plain, a, tangents, cotangents))(*args)
    assert_bitwise_equal(want, got, f"{backend} {op}: (jvp, vjp) of the library vs the plain formulation")
    # No silent zero: every output's tangent and every input's cotangent is nonzero.
    assert all(np.abs(np.asarray(t, np.float32)).max() > 0 for t in jax.tree.leaves(got))


def test_second_order_and_the_control(seed):
    """A second-order jvp is the plain formulation's too. Control: the tangents that
    autodiff found before the rules (the pinned primitives differentiated through their
    integer bit manipulation) differ from the plain formulation's, so the comparison above
    catches them."""
    make, args, plain = _problem("verify-tuples", seed, kind="mixed")
    lib = make("reference")
    rng = np.random.default_rng(seed + 2)
    t1, t2 = _random_like(rng, args), _random_like(rng, args)

    def second(f):
        return jax.jit(lambda *a: jax.jvp(lambda *b: jax.jvp(f, b, t1)[1], a, t2)[1])(*args)

    assert_bitwise_equal(second(plain), second(lib), "second-order jvp")

    bare_step = functools.partial(reference.gdn_step, mul=rounding._mul_rn, fma=rounding._fma_rn)

    def bare(state0, q, k, v, a, b, A_log, dt_bias):
        qn, kn, g, beta = reference.prepare(q, k, a, b, A_log, dt_bias, SHAPE.K**-0.5)
        return reference.chain(state0, qn, kn, v, g, beta, record="tuples", out_dtype=q.dtype, step=bare_step)

    _, wrong = jax.jit(lambda *a: jax.jvp(bare, a, t1))(*args)
    _, right = jax.jit(lambda *a: jax.jvp(plain, a, t1))(*args)
    report = assert_bitwise_differs(right, wrong, "control: the primitives without their rules")
    assert report.max_ulp > 2**20  # not rounding: the state path's tangent is lost


# ---------------------------------------------------------------------------------
# (4) directly: the library's derivative against finite differences of its exact values
# ---------------------------------------------------------------------------------
def test_library_derivative_matches_finite_differences_float32(seed):
    make, args, _ = _problem("verify-snapshots", seed, input_dtype=F32)
    f = jax.jit(make("reference"))
    t = _random_like(np.random.default_rng(seed + 3), args)
    _, got = jax.jit(lambda *a: jax.jvp(f, a, t))(*args)
    # Central differences in fp32: eps = 1e-2 keeps the rounding noise (~1e-7 / eps) and
    # the curvature term (~eps^2) well under the 1e-2 tolerance on these O(1) inputs.
    eps = 1e-2
    shifted = lambda sign: f(*jax.tree.map(lambda x, d: x + sign * eps * d, args, t))  # noqa: E731
    fd = jax.tree.map(lambda p, m: (p - m) / (2 * eps), shifted(1), shifted(-1))
    for g, want in zip(jax.tree.leaves(got), jax.tree.leaves(fd)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-2, atol=1e-2)
    # Control: the same comparison catches a derivative that is off by 5%.
    with pytest.raises(AssertionError):
        for g, want in zip(jax.tree.leaves(got), jax.tree.leaves(fd)):
            np.testing.assert_allclose(1.05 * np.asarray(g), np.asarray(want), rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------------------------
# The rounding primitives
# ---------------------------------------------------------------------------------
def test_rounding_primitives_have_the_exact_operations_derivatives(seed):
    assert jax.grad(lambda a: rounding.fma_rn(a, 3.0, 1.0))(2.0) == 3.0  # was 0.0
    assert jax.grad(rounding.fma_rn, argnums=(0, 1, 2))(2.0, 3.0, 1.0) == (3.0, 2.0, 1.0)
    assert jax.grad(rounding.mul_rn, argnums=(0, 1))(2.0, 5.0) == (5.0, 2.0)
    assert jax.grad(rounding.add_rn, argnums=(0, 1))(2.0, 5.0) == (1.0, 1.0)
    rng = np.random.default_rng(seed)
    a, b, c = (_normal(rng, (5, 3)) for _ in range(3))
    da, db, dc = (_normal(rng, (5, 3)) for _ in range(3))
    for f, plain, xs, ts in [
        (rounding.fma_rn, lambda x, y, z: x * y + z, (a, b, c), (da, db, dc)),
        (rounding.mul_rn, lambda x, y: x * y, (a, b), (da, db)),
        (rounding.add_rn, lambda x, y: x + y, (a, b), (da, db)),
    ]:
        _, t = jax.jit(lambda *x, f=f: jax.jvp(f, x, ts))(*xs)
        _, want_t = jax.jit(lambda *x, plain=plain: jax.jvp(plain, x, ts))(*xs)
        np.testing.assert_allclose(np.asarray(t), np.asarray(want_t), rtol=1e-6, atol=1e-6)
    assert jax.hessian(lambda x: rounding.mul_rn(x, x))(3.0) == 2.0
    # A broadcast scalar and an integer argument (no tangent) both work.
    assert jax.grad(lambda x: rounding.mul_rn(x, jnp.arange(3.0)).sum())(2.0) == 3.0
    assert jax.grad(lambda x: rounding.fma_rn(x, 2, 1))(1.5) == 2.0


# ---------------------------------------------------------------------------------
# No silent zero anywhere
# ---------------------------------------------------------------------------------
def _entry_points(seed):
    """``(name, function, float args)`` for the differentiable functions outside the API
    (whose entry points are checked above: every tangent and cotangent leaf is nonzero)."""
    rng = np.random.default_rng(seed)
    x = verify_inputs(rng, SHAPE)
    yield "reference.verify", lambda *a: reference.verify(*a, record="tuples", scale=0.5), tuple(x.values())
    S, alpha, k, u = _normal(rng, (2, 3, 4)), jnp.full((2,), 0.9, F32), _normal(rng, (2, 4)), _normal(rng, (2, 3))
    for name, form in controls.FORMS.items():
        yield f"controls.FORMS[{name!r}]", form, (S, alpha, k, u)
    C, Kc = 6, 4
    yield (
        "conv.causal_conv1d_verify",
        conv.causal_conv1d_verify,
        (_normal(rng, (2, C, Kc - 1)), _normal(rng, (2, 3, C)), _normal(rng, (C, Kc)), _normal(rng, (C,))),
    )


def test_no_silent_zero(seed):
    """Every floating input gets a nonzero, finite gradient."""
    rng = np.random.default_rng(seed)
    for name, f, args in _entry_points(seed):
        cot = _random_like(rng, jax.eval_shape(f, *args))
        grads = jax.jit(lambda *a, f=f, cot=cot: jax.vjp(f, *a)[1](cot))(*args)
        for i, g in enumerate(grads):
            for path, leaf in jax.tree_util.tree_flatten_with_path(g)[0]:
                leaf = np.asarray(leaf, np.float32)
                where = f"{name}: argument {i}{jax.tree_util.keystr(path)}"
                assert np.isfinite(leaf).all(), where
                assert np.abs(leaf).max() > 0, f"{where}: silent zero gradient"


def test_gradients_stay_finite_at_saturated_gates():
    """softplus and sigmoid far out (exp overflows in the values' formula) keep finite derivatives."""
    x = verify_inputs(0, SHAPE, input_dtype=F32)
    x["a"] = x["a"].at[0].set(100.0)
    x["b"] = x["b"].at[1].set(-100.0)
    grads = jax.jit(jax.grad(lambda *a: gl.verify(*a)[0].sum(), argnums=tuple(range(8))))(*x.values())
    assert all(np.isfinite(np.asarray(g, np.float32)).all() for g in grads)
    # Control: the gates' formulas written plainly in float32 give NaN derivatives there (the
    # reference's own gates compute exp in float64 on a CPU, where it does not overflow at 100).
    def plain_gates(a, b):
        return jnp.log(1.0 + jnp.exp(a)).sum() + (1.0 / (1.0 + jnp.exp(-b))).sum()

    d_a, d_b = jax.grad(plain_gates, argnums=(0, 1))(jnp.full((1,), 100.0, F32), jnp.full((1,), -100.0, F32))
    assert np.isnan(d_a).all() and np.isnan(d_b).all()

