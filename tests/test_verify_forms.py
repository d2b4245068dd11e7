"""The verify contract's two family fields: ``beta_scale`` (OLMo-Hybrid) and ``decay="channel"`` (KDA).

- beta_scale=2.0 (OLMo-Hybrid's ``linear_allow_neg_eigval``): the reference and Pallas (interpret mode) outputs
  and tapes equal the specification (the reference chain with beta doubled, as the family's forward computes it)
  bit for bit, Mosaic its values (and, on a GPU, the kernels), each kernel its own snapshot path bit for bit; a
  tuple commit equals the snapshot commit bit for bit. Controls: beta left at 1 (the scale
  ignored) changes the outputs; the twice-rounded replay changes the committed states. Triton (and a backend
  that declares nothing) refuses the scale by name; ``backend="auto"`` picks one that takes it.
- decay="channel" (KDA), on every backend that runs it (:data:`KDA_BACKENDS`): ``gdn_lossless_jax.verify``
  records a :class:`~gdn_lossless_jax.tape.KDATuples` tape equal to :func:`gdn_lossless_jax.kda.verify`'s bit for
  bit (the reference, Pallas in interpret mode; a kernel on a GPU its values), and the backend's commit and replay
  of it equal its snapshot commit bit for bit. Controls (:mod:`gdn_lossless_jax.testing.kda_controls`): the
  per-channel decay applied as one factor per head, and the update rounded twice. The fused step
  (``commit_and_verify``) with a KDA tape pending equals the commit, then the verify; draft trees equal the chain
  along each path; inputs stacked over layers are read at the layer. A backend without the decay refuses it by name.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import example_backend
from conftest import ON_GPU, full_only
import gdn_lossless_jax as gl
from gdn_lossless_jax import backends, checks, kda, reference
from gdn_lossless_jax.tape import KDATuples, Snapshots, Tuples
from gdn_lossless_jax.testing import assert_bitwise_differs, assert_bitwise_equal
from gdn_lossless_jax.testing.controls import twice_rounded_update
from gdn_lossless_jax.testing.kda_controls import CONTROLS as KDA_CONTROLS

F32, BF16 = jnp.float32, jnp.bfloat16
N, D, H, HV, K, V = 3, 4, 2, 4, 16, 16


def _gdn_inputs(seed, K=K, V=V):
    rng = np.random.default_rng(seed)
    n = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return dict(state0=jnp.asarray(0.5 * n(N, HV, V, K), F32), q=jnp.asarray(n(N, D, H, K), BF16),
                k=jnp.asarray(n(N, D, H, K), BF16), v=jnp.asarray(n(N, D, HV, V), BF16),
                a=jnp.asarray(n(N, D, HV), BF16), b=jnp.asarray(2 * n(N, D, HV), BF16),
                A_log=jnp.asarray(np.log(rng.uniform(0.2, 4.0, HV)), F32), dt_bias=jnp.asarray(n(HV), F32))  # fmt: skip


@functools.partial(jax.jit, static_argnums=1)
def _spec(x, beta_scale):
    """OLMo-Hybrid's GDN as its forward computes it: the reference's gates, beta times the scale, the chain
    (compiled, as the reference backend is: XLA:CPU fuses op by op otherwise)."""
    qn, kn, g, beta = reference.prepare(x["q"], x["k"], x["a"], x["b"], x["A_log"], x["dt_bias"], x["q"].shape[-1] ** -0.5)
    beta = beta * np.float32(beta_scale)
    return {r: reference.chain(x["state0"], qn, kn, x["v"], g, beta, record=r, out_dtype=BF16)
            for r in ("tuples", "snapshots")}  # fmt: skip


def jax_leaves(tape):
    return (tape.u, tape.k, tape.g) if isinstance(tape, Tuples) else (tape.states,)


_kda_verify = jax.jit(kda.verify, static_argnames=("record",))
_control_commit = jax.jit(reference.commit, static_argnames=("rule", "math"))


def _commit_all(pool, tape, rule=None, backend="reference"):
    """Every request's state after each step: D commits of the one-layer tape into a pool of N slots."""
    slots = jnp.arange(N, dtype=jnp.int32)
    out = []
    for t in range(D):
        steps = jnp.full((N,), t, jnp.int32)
        if rule is None:
            out.append(gl.commit(pool, gl.stack_tapes([tape]), slots, steps, backend=backend))
        else:
            none = jnp.full((N,), -1, jnp.int32)
            out.append(_control_commit(pool, gl.stack_tapes([tape]), slots, steps, none, none, slots, rule=rule))
    return np.stack([np.asarray(o) for o in out])


# Mosaic's interpret mode on the CPU with GDN_FULL_TESTS=1 only (the suite's time; on a GPU always)
@pytest.mark.parametrize("backend", ["reference", "pallas", pytest.param("mosaic", marks=() if ON_GPU else full_only)])
def test_beta_scale_matches_the_spec(backend):
    """The reference everywhere, and Pallas in interpret mode, equal the specification bit for bit; Mosaic (its dots
    summed in its own order) and the kernels on a GPU (their exp, sqrt and division the platform's: Pallas's tapes
    differ from the reference's by a few ULP at beta_scale=1 as well) equal its values to their rounding, and are held
    to their own snapshot path bit for bit, as the equivalence suite holds every backend."""
    x = _gdn_inputs(0, **({"K": 32, "V": 64} if backend == "mosaic" else {}))  # Mosaic: K a multiple of 32, V of 64
    spec = _spec(x, 2.0)
    args = [x[n] for n in ("state0", "q", "k", "v", "a", "b", "A_log", "dt_bias")]
    exact = backend == "reference" or (backend == "pallas" and backends.platform() != "gpu")
    got = {}
    for record in ("tuples", "snapshots"):
        got[record] = o, tape = gl.verify(*args, record=record, backend=backend, beta_scale=2.0)
        so, stape = spec[record]
        for leaf, want in zip((o, *jax_leaves(tape)), (so, *jax_leaves(stape))):
            if exact:
                assert_bitwise_equal(leaf, want, f"{backend} {record}")
            else:  # the scale applied once: the spec's values to the kernel's own rounding
                np.testing.assert_allclose(np.asarray(leaf, np.float32), np.asarray(want, np.float32), rtol=1e-2,
                                           atol=1e-3, err_msg=f"{backend} {record}")  # fmt: skip
    (o, tup), (o_snap, snp) = got["tuples"], got["snapshots"]
    assert_bitwise_equal(o_snap, o, f"{backend}: outputs, snapshots == tuples")
    for step in range(D):
        replayed = gl.replay(x["state0"], tup, jnp.full((N,), step, jnp.int32), backend=backend)
        assert_bitwise_equal(snp.states[:, step], replayed, f"{backend}: step {step}, replayed tuples == snapshot")
    o1, t1 = gl.verify(*args, backend=backend)
    assert_bitwise_differs(o1, o, "control: beta_scale ignored")
    assert not np.allclose(np.asarray(t1.u), np.asarray(spec["tuples"][1].u), rtol=1e-2, atol=1e-3), \
        "control: beta_scale ignored, within the values' tolerance"


def test_beta_scale_commit_and_controls():
    x = _gdn_inputs(1)
    spec = _spec(x, 2.0)
    pool = x["state0"][None]
    tup, snp = spec["tuples"][1], spec["snapshots"][1]
    by_tuples, by_snapshots = _commit_all(pool, tup), _commit_all(pool, snp)
    assert_bitwise_equal(by_tuples, by_snapshots, "beta_scale=2: tuple commit == snapshot commit")
    assert_bitwise_differs(_commit_all(pool, tup, twice_rounded_update), by_snapshots, "control: twice rounded")


def test_beta_scale_refusals_and_auto():
    x = _gdn_inputs(2)
    args = [x[n] for n in ("state0", "q", "k", "v", "a", "b", "A_log", "dt_bias")]
    refused = (r"backend 'example' does not scale beta \(beta_scale=2.0, OLMo-Hybrid's .*the backends that do: "
               r"'reference', 'pallas', 'mosaic'")
    with pytest.raises(backends.BackendUnavailable, match=refused):
        gl.verify(*args, backend=example_backend, beta_scale=2.0)  # a backend that declares nothing
    with pytest.raises(ValueError, match=r"verify: argument 'beta_scale' must be finite and positive .* got -1.0"):
        gl.verify(*args, beta_scale=-1.0)
    with pytest.raises(TypeError, match=r"verify: argument 'beta_scale' must be a real number or None, got str 'x'"):
        gl.verify(*args, beta_scale="x")
    needs = backends.call_needs("scalar", 2.0)
    assert needs(backends.lookup("pallas").capabilities) and needs(backends.lookup("mosaic").capabilities)
    assert not needs(backends.lookup("triton").capabilities)
    assert not needs(backends.contract.Capabilities()), "a backend that declares nothing refuses the scale"
    assert backends.resolve_name("auto", needs=needs) == ("pallas" if backends.platform() == "gpu" else "reference")


def _kda_inputs(seed):
    rng = np.random.default_rng(seed)
    n = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return dict(state0=jnp.asarray(0.5 * n(N, HV, V, K), F32), q=jnp.asarray(n(N, D, HV, K), BF16),
                k=jnp.asarray(n(N, D, HV, K), BF16), v=jnp.asarray(n(N, D, HV, V), BF16),
                f=jnp.asarray(n(N, D, HV, K), BF16), b=jnp.asarray(n(N, D, HV), BF16),
                A_log=jnp.asarray(np.log(rng.uniform(0.2, 4.0, HV)), F32),
                dt_bias=jnp.asarray(n(HV, K), F32))  # fmt: skip


#: The backends that run KDA, each through every KDA test here (Pallas in interpret mode on the CPU); Mosaic's
#: shapes (V a multiple of 64, K of 32) and Triton's (a GPU) are their own tests' (tests/test_mosaic_backend.py,
#: tests/test_triton_backend.py), and Kimi's geometry below on a GPU.
KDA_BACKENDS = ["reference", "pallas"]
KDA_GPU_BACKENDS = [*KDA_BACKENDS, "mosaic", "triton"]


def _exact(backend: str) -> bool:
    """Whether ``backend`` computes the specification's bits here: the reference everywhere, Pallas in interpret
    mode; a kernel on a GPU its values (its exp and sums the platform's), and its own snapshot path bit for bit."""
    return backend == "reference" or (backend == "pallas" and backends.platform() != "gpu")


@pytest.mark.parametrize("backend", KDA_BACKENDS)
def test_kda_through_the_api(backend):
    x = _kda_inputs(3)
    args = [x[n] for n in ("state0", "q", "k", "v", "f", "b", "A_log", "dt_bias")]
    tapes = {}
    for record in ("tuples", "snapshots"):
        o, tape = gl.verify(*args, record=record, decay="channel", backend=backend)
        so, stape = _kda_verify(*args, record=record)
        assert type(tape) is (KDATuples if record == "tuples" else Snapshots)
        for got, want in zip((o, *jax_leaves(tape)), (so, *jax_leaves(stape))):
            if _exact(backend):
                assert_bitwise_equal(got, want, f"KDA {backend} {record}")
            else:
                np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2,
                                           atol=1e-3, err_msg=f"KDA {backend} {record}")  # fmt: skip
        tapes[record] = o, tape
    (o, tup), (o_snap, snp) = tapes["tuples"], tapes["snapshots"]
    assert_bitwise_equal(o_snap, o, f"KDA {backend}: outputs, snapshots == tuples")
    pool = x["state0"][None]
    by_tuples, by_snapshots = _commit_all(pool, tup, backend=backend), _commit_all(pool, snp, backend=backend)
    assert_bitwise_equal(by_tuples, by_snapshots, f"KDA {backend}: tuple commit == snapshot commit")
    for step in range(D):
        replayed = gl.replay(x["state0"], tup, jnp.full((N,), step, jnp.int32), backend=backend)
        assert_bitwise_equal(snp.states[:, step], replayed, f"KDA {backend}: step {step}, replay == snapshot")
    for name in ("scalar_decay", "twice_rounded"):
        assert_bitwise_differs(_commit_all(pool, tup, KDA_CONTROLS[name]), by_snapshots, f"control: {name}")
    # the GDN rule of the library takes the per-channel decay by the tape's rank: the same bits as kda.rule
    assert_bitwise_equal(_commit_all(pool, tup, kda.rule), by_snapshots, "kda.rule")


def test_kda_refusals():
    x = _kda_inputs(4)
    args = [x[n] for n in ("state0", "q", "k", "v", "f", "b", "A_log", "dt_bias")]
    with pytest.raises(backends.BackendUnavailable, match=r"verify: backend 'example' does not run KDA layers "
                                                          r"\(decay='channel'.*the backends that do: 'reference', "
                                                          r"'pallas'"):  # fmt: skip
        gl.verify(*args, decay="channel", backend=example_backend)
    _, tape = gl.verify(*args, decay="channel", backend="reference")
    with pytest.raises(backends.BackendUnavailable, match=r"commit: backend 'example' does not run KDA layers"):
        gl.commit(x["state0"][None], gl.stack_tapes([tape]), jnp.arange(N), jnp.zeros(N, jnp.int32),
                  backend=example_backend)  # fmt: skip
    pallas = backends.lookup("pallas")
    call = checks.verify_args("test", *args, decay="channel")
    with pytest.raises(ValueError, match=r"pallas verify: VerifyConfig\(algorithm='gram'\) needs one decay per head"):
        pallas.verify(call, config=pallas.VerifyConfig(algorithm="gram"))
    with pytest.raises(ValueError, match=r"verify: argument 'a' must have shape \[N, D, HV, K\] = \[3, 4, 4, 16\] "
                                         r".*got \[3, 4, 4\]"):
        gl.verify(*args[:4], args[4][..., 0], *args[5:], decay="channel")
    with pytest.raises(ValueError, match=r"verify: decay must be one of \('scalar', 'channel'\).* got 'rows'"):
        gl.verify(*args, decay="rows")


def _root_path(parents, node):
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(int(parents[path[-1]]))
    return path[::-1]


# Pallas's interpret mode on one tree in the CI run, on all three with GDN_FULL_TESTS (on a GPU always)
@pytest.mark.parametrize("backend,parents", [(b, p) if b == "reference" or p == [-1, 0, 0, 1] or ON_GPU
                                             else pytest.param(b, p, marks=full_only)
                                             for b in KDA_BACKENDS for p in ([-1, 0, 0, 1], [-1, 0, 1, 0], [-1, 0, 0, 0])])
def test_kda_trees(parents, backend, seed):
    """A KDA draft tree (``parents``): each node's output and snapshot equal the chain along its root path, bit for
    bit, and committing or replaying the tuple tape along a node's path gives that node's snapshot, on each backend.
    Controls: the per-channel decay applied as a scalar, and paths with nodes 1 and 2 swapped, differ."""
    x = _kda_inputs(seed % 2**31)
    names = ("q", "k", "v", "f", "b", "A_log", "dt_bias")
    par = jnp.asarray(parents, jnp.int32)
    run = {r: gl.verify(x["state0"], *[x[n] for n in names], decay="channel", parents=par, topk=3, record=r,
                        backend=backend)
           for r in ("tuples", "snapshots")}  # fmt: skip
    (o, tape), (o_snap, snaps) = run["tuples"], run["snapshots"]
    assert type(tape) is KDATuples
    assert_bitwise_equal(o_snap, o, "tree outputs: snapshots == tuples")
    paths = [_root_path(parents, node) for node in range(D)]
    for node, path in enumerate(paths):
        along = lambda t, path=path: t[:, path]  # noqa: E731
        oc, chain = gl.verify(x["state0"], *[along(x[n]) for n in names[:5]], x["A_log"], x["dt_bias"],
                              decay="channel", record="snapshots", backend=backend)  # fmt: skip
        assert_bitwise_equal(oc[:, -1], o[:, node], f"node {node}: output == the chain's along {path}")
        assert_bitwise_equal(chain.states[:, -1], snaps.states[:, node], f"node {node}: state == the chain's")
    # every request commits another node: request i the node i + 1 (mod D)
    nodes = [(i + 1) % D for i in range(N)]
    P = max(len(p) for p in paths)
    path = jnp.asarray([paths[n] + [-1] * (P - len(paths[n])) for n in nodes], jnp.int32)
    steps = jnp.asarray([len(paths[n]) - 1 for n in nodes], jnp.int32)
    want = jnp.stack([snaps.states[i, n] for i, n in enumerate(nodes)])
    slots = jnp.arange(N, dtype=jnp.int32)
    pool = x["state0"][None]
    for tp in (tape, snaps):
        got = gl.commit(pool, gl.stack_tapes([tp]), slots, steps, path=path, parents=par, backend=backend)
        assert_bitwise_equal(want, got[0], f"{type(tp).__name__}: commit along each node's path == its snapshot")
    assert_bitwise_equal(want, gl.replay(x["state0"], tape, steps, path=path, parents=par, backend=backend),
                         "replay along the paths")  # fmt: skip
    wrong = reference.replay(x["state0"], jax.tree.map(lambda t: jnp.take_along_axis(
        t, jnp.maximum(path, 0).reshape(N, P, *[1] * (t.ndim - 2)), axis=1), tape), steps,
        rule=KDA_CONTROLS["scalar_decay"])  # fmt: skip
    assert_bitwise_differs(want, wrong, "control: the per-channel decay as a scalar along the paths")
    swapped = jnp.where(path == 1, 2, jnp.where(path == 2, 1, path))  # nodes 1 and 2 trade places on every path
    assert_bitwise_differs(want, gl.replay(x["state0"], tape, steps, path=swapped, backend=backend),
                           "control: nodes 1 and 2 swapped")  # fmt: skip


@pytest.mark.parametrize("backend", KDA_BACKENDS)
def test_kda_commit_and_verify(backend):
    """The fused step with a KDA tape pending (``commit_and_verify``; the decay read from the pending tape's class):
    the same bits as the commit, then the verify, on each backend."""
    x, y = _kda_inputs(5), _kda_inputs(6)
    names = ("q", "k", "v", "f", "b", "A_log", "dt_bias")
    slots = jnp.arange(N, dtype=jnp.int32)
    pool = x["state0"][None]
    _, tape = gl.verify(pool, *[x[n] for n in names], slots=slots, layer=0, decay="channel", backend=backend)
    assert type(tape) is KDATuples
    steps = jnp.array([2, 0, 3], jnp.int32)
    tslots, tsteps = jnp.array([-1, 3, -1], jnp.int32), jnp.array([-1, 2, -1], jnp.int32)  # one track copy
    pool = jnp.concatenate([pool, pool[:, :1] * 0.5], axis=1)  # a fourth slot for it
    pending = gl.Pending(gl.stack_tapes([tape]), slots, steps, tslots, tsteps)
    o, new_tape, new_pool = gl.commit_and_verify(pool, pending, *[y[n] for n in names], slots=slots, layer=0,
                                                 backend=backend)  # fmt: skip
    committed = gl.commit(pool, gl.stack_tapes([tape]), slots, steps, tslots, tsteps, backend=backend)
    o2, tape2 = gl.verify(committed, *[y[n] for n in names], slots=slots, layer=0, decay="channel", backend=backend)
    assert_bitwise_equal(new_pool, committed, "fused commit")
    wrong = _control_commit(pool, gl.stack_tapes([tape]), slots, steps, tslots, tsteps, slots,
                            rule=KDA_CONTROLS["scalar_decay"])  # fmt: skip
    assert_bitwise_differs(new_pool, wrong, "control: the fused commit against a scalar-decay commit")
    assert_bitwise_equal(o, o2, "fused verify outputs")
    for got, want in zip(jax_leaves(new_tape), jax_leaves(tape2)):
        assert_bitwise_equal(got, want, "fused verify tape")


@pytest.mark.parametrize("backend", KDA_BACKENDS)
def test_kda_stacked_inputs(backend):
    """A model's call: a pool of two layers, every input stacked over them and read at ``layer`` (the tape written
    into its buffer at that layer): the same bits as the one layer's inputs; the other layer's inputs differ."""
    xs = [_kda_inputs(7), _kda_inputs(8)]
    names = ("q", "k", "v", "f", "b", "A_log", "dt_bias")
    stacked = {n: jnp.stack([x[n] for x in xs]) for n in names}
    pool = jnp.stack([x["state0"] for x in xs])
    slots = jnp.array([2, 0, 1], jnp.int32)
    buf = KDATuples.zeros((pool.shape[0], N, D), H=HV, HV=HV, V=V, K=K, state_dtype=F32)
    o, tape = gl.verify(pool, *[stacked[n] for n in names], slots=slots, layer=1, decay="channel", tape=buf,
                        backend=backend)  # fmt: skip
    o1, t1 = gl.verify(pool, *[xs[1][n] for n in names], slots=slots, layer=1, decay="channel", backend=backend)
    o0, _ = gl.verify(pool, *[xs[0][n] for n in names], slots=slots, layer=1, decay="channel", backend=backend)
    assert_bitwise_equal(o, o1, f"{backend}: stacked inputs read at the layer")
    for got, want in zip(jax_leaves(tape), jax_leaves(t1)):
        assert_bitwise_equal(got[1], want, f"{backend}: the tape at the layer")
    assert_bitwise_differs(o, o0, "control: the other layer's inputs")


@pytest.mark.skipif(not ON_GPU, reason="Kimi-Linear-48B's head geometry on the GPU kernels (the CPU runs the shapes above)")
@pytest.mark.parametrize("backend", KDA_GPU_BACKENDS)
@pytest.mark.parametrize("pool_dtype", [F32, BF16])
def test_kda_kimi_geometry(backend, pool_dtype, seed):
    """Kimi-Linear-48B-A3B's KDA heads (H = 32, K = V = 128), eight requests of four drafts, on the GPU: the outputs
    equal in both record modes, the tuple commit (with track copies) equals the snapshot commit, and the fused step
    equals the commit then the verify, bit for bit; the scalar-decay commit differs (the control)."""
    rng = np.random.default_rng(seed % 2**31)
    n_, d_, h_, k_ = 8, 4, 32, 128
    r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    x = dict(q=jnp.asarray(r(n_, d_, h_, k_), BF16), k=jnp.asarray(r(n_, d_, h_, k_), BF16),
             v=jnp.asarray(r(n_, d_, h_, k_), BF16), f=jnp.asarray(r(n_, d_, h_, k_), BF16),
             b=jnp.asarray(r(n_, d_, h_), BF16), A_log=jnp.asarray(np.log(rng.uniform(0.2, 4.0, h_)), F32),
             dt_bias=jnp.asarray(r(h_, k_), F32))  # fmt: skip
    names = ("q", "k", "v", "f", "b", "A_log", "dt_bias")
    pool = jnp.asarray(0.5 * r(1, 2 * n_, h_, k_, k_)).astype(pool_dtype)
    slots = jnp.asarray(rng.permutation(2 * n_)[:n_], jnp.int32)
    run = {rec: gl.verify(pool, *[x[m] for m in names], slots=slots, layer=0, decay="channel", record=rec,
                          backend=backend) for rec in ("tuples", "snapshots")}  # fmt: skip
    (o, tup), (o_snap, snp) = run["tuples"], run["snapshots"]
    assert_bitwise_equal(o_snap, o, f"{backend}: outputs, snapshots == tuples")
    steps = jnp.asarray(rng.integers(-1, d_, n_), jnp.int32)
    free = jnp.asarray([s for s in range(2 * n_) if s not in set(np.asarray(slots).tolist())], jnp.int32)
    tslots = jnp.where(jnp.arange(n_) % 2 == 0, free, -1)
    tsteps = jnp.asarray(rng.integers(0, d_, n_), jnp.int32)
    args = (slots, steps, tslots, tsteps)
    by_tuples = gl.commit(pool, gl.stack_tapes([tup]), *args, backend=backend)
    by_snapshots = gl.commit(pool, gl.stack_tapes([snp]), *args, backend=backend)
    assert_bitwise_equal(by_tuples, by_snapshots, f"{backend}: tuple commit == snapshot commit")
    wrong = _control_commit(pool, gl.stack_tapes([tup]), *args, jnp.arange(n_, dtype=jnp.int32),
                            rule=KDA_CONTROLS["scalar_decay"])  # fmt: skip
    assert_bitwise_differs(wrong, by_snapshots, "control: the per-channel decay as a scalar")
    y = {m: (x[m][:, ::-1] if x[m].ndim == 4 and m != "dt_bias" else x[m]) for m in names}  # the next step's inputs
    pending = gl.Pending(gl.stack_tapes([tup]), jnp.arange(n_, dtype=jnp.int32), *args[1:])  # request i: tape row i
    o2, t2, fused = gl.commit_and_verify(pool, pending, *[y[m] for m in names], slots=slots, layer=0, backend=backend)
    o3, t3 = gl.verify(by_tuples, *[y[m] for m in names], slots=slots, layer=0, decay="channel", backend=backend)
    assert_bitwise_equal(fused, by_tuples, f"{backend}: the fused commit")
    assert_bitwise_equal(o2, o3, f"{backend}: the fused verify's outputs")
    for got, want in zip(jax_leaves(t2), jax_leaves(t3)):
        assert_bitwise_equal(got, want, f"{backend}: the fused verify's tape")


def test_pallas_needs_k_a_power_of_two_on_a_gpu(monkeypatch):
    """Pallas Triton loads whole [K] rows, power-of-two arrays only: on a GPU Olmo-Hybrid-7B's K = 96 is refused by
    name and ``"auto"`` picks the reference for it (the platform is pretended here: no kernel runs)."""
    monkeypatch.setattr(backends, "platform", lambda: "gpu")
    olmo = {"H": 30, "HV": 30, "K": 96, "V": 192}
    assert backends.resolve_name("auto", needs=backends.call_needs("scalar", 2.0, olmo)) == "reference"
    assert backends.resolve_name("auto", needs=backends.call_needs("scalar", 2.0, {**olmo, "K": 128})) == "pallas"
    with pytest.raises(backends.BackendUnavailable, match=r"verify: backend 'pallas' needs K=96 a power of two on this "
                                                          r"platform; the backends that take it: 'reference'"):
        backends.check_sizes(backends.lookup("pallas"), "verify", olmo)
    backends.check_sizes(backends.lookup("reference"), "verify", olmo)
    monkeypatch.undo()
    if backends.platform() != "gpu":
        backends.check_sizes(backends.lookup("pallas"), "verify", olmo)  # interpret mode takes any shape
