"""Sharded verify, replay and commit (``gdn_lossless_jax.sharding``) on 8 simulated CPU devices.

How the 8 devices come about: XLA:CPU simulates them only when
``--xla_force_host_platform_device_count=8`` is in ``XLA_FLAGS`` before JAX initialises, and
``tests/conftest.py`` initialises JAX on import. So in the usual run (one CPU device)
``test_mesh_suite_in_subprocess`` runs this file again in a subprocess with the flag set (and the
same ``GDN_SEED``), and the tests that need 8 devices skip in the parent with that reason. With
the flag set they run in-process::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        .venv/bin/python -m pytest -q tests/test_sharding.py

Every comparison is bit for bit against the unsharded functions on one device, and each sharded
check has a control it must catch (v-heads split from their q/k head; a naive replay form).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import gdn_lossless_jax as gl
from equivalence import Case, check_commit, check_outputs, check_replay_every_step
from gdn_lossless_jax import pool as gpool
from gdn_lossless_jax import reference, rounding, sharding
from gdn_lossless_jax.cases import Shape, commit_indices, verify_inputs
from gdn_lossless_jax.testing import assert_bitwise_differs, assert_bitwise_equal

MESH_DEVICES = 8
HAVE_MESH = len(jax.devices()) >= MESH_DEVICES
needs_mesh = pytest.mark.skipif(
    not HAVE_MESH, reason=f"needs {MESH_DEVICES} devices: test_mesh_suite_in_subprocess runs these on simulated CPU devices"
)

# (tensor, data) sizes of the meshes: 2- and 4-way over heads, 2-way over requests, 2 x 2.
MESHES = [(2, 1), (4, 1), (1, 2), (2, 2)]
# H = 4 q/k heads of 2 v-heads each (4-way: one q/k head and its two v-heads per device).
SHAPE = Shape(N=6, D=3, H=4, HV=8, K=16, V=16)
GEOMETRY = gl.get_geometry("qwen3.6-35b-a3b").reduced(gdn_layers=2, heads_divisor=4, head_dim=16)
COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")


def make_plan(tp: int, dp: int) -> sharding.MeshPlan:
    devices = np.array(jax.devices()[: tp * dp]).reshape(dp, tp)
    return sharding.MeshPlan(Mesh(devices, ("data", "tensor")), tensor="tensor", data="data")


@pytest.mark.skipif(HAVE_MESH, reason=f"{MESH_DEVICES} devices here: the mesh tests run in this process")
def test_mesh_suite_in_subprocess():
    flags = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={MESH_DEVICES}").strip()
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", __file__]
    t = time.perf_counter()
    run = subprocess.run(cmd, env=env, cwd=os.path.dirname(__file__), capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, f"{' '.join(cmd)} failed (exit {run.returncode}):\n{out[-6000:]}"
    assert re.search(r"\d+ passed", out) and " skipped" not in out.split("\n")[-2], out[-3000:]
    print(f"mesh suite in a subprocess: {time.perf_counter() - t:.0f} s\n{out[-400:]}")


# ---------------------------------------------------------------------------------
# The equivalence suite, sharded.
# ---------------------------------------------------------------------------------
def _buffers(rng, L: int, R: int, Dmax: int, s: Shape):
    """Tape buffers with random filler (a read or write of a wrong row shows)."""
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, dtype=np.float32))  # noqa: E731
    tup = gl.Tuples(u=normal(L, R, Dmax, s.HV, s.V), k=normal(L, R, Dmax, s.H, s.K), g=-jnp.abs(normal(L, R, Dmax, s.HV)))
    return {"tuples": tup, "snapshots": gl.Snapshots(normal(L, R, Dmax, s.HV, s.V, s.K))}


def sharded_case(plan: sharding.MeshPlan, seed: int, *, L: int = 2, s: Shape = SHAPE, backend: str = "reference"):
    """The equivalence suite's case, verified on the mesh from a global pool, beside the same
    calls on one device: ``(case, single)``, both with the tapes written into buffers."""
    S, R, Dmax = 12, 8, s.D + 1  # 6 slots and 4 rows per data shard at dp = 2
    rng = np.random.default_rng(seed)
    pool = jnp.asarray(0.5 * rng.standard_normal((L, S, s.HV, s.V, s.K), dtype=np.float32))
    idx = commit_indices(seed, N=s.N, D=s.D, slots_in_pool=S, rows_in_tape=R, invalid=True, permute_rows=True,
                         shards=plan.dp)  # fmt: skip
    bufs = _buffers(rng, L, R, Dmax, s)
    slots, rows = jnp.asarray(idx.slots), jnp.asarray(idx.rows)
    got = {m: [] for m in bufs} | {"tape": dict(bufs)}
    want = {m: [] for m in bufs} | {"tape": dict(bufs)}
    for layer in range(L):
        x = verify_inputs(rng, s, kind="mixed")
        del x["state0"]
        for record in bufs:
            for out, fn in ((got, plan.verify), (want, gl.verify)):
                o, out["tape"][record] = fn(pool, **x, slots=slots, layer=jnp.int32(layer), tape=out["tape"][record],
                                            rows=rows, record=record, backend=backend)  # fmt: skip
                out[record].append(o)
    states0 = [reference.read_slots(pool, layer, slots) for layer in range(L)]
    # The tapes hold Dmax >= D steps: the case's tapes are their first D.
    crop = lambda t: jax.tree.map(lambda a: a[:, :, : s.D], t)  # noqa: E731
    case = Case(backend, s, L, pool, idx, got["tuples"], got["snapshots"], crop(got["tape"]["tuples"]),
                crop(got["tape"]["snapshots"]), states0)  # fmt: skip
    return case, want


@needs_mesh
@pytest.mark.parametrize("tp,dp", MESHES, ids=[f"mesh-tp{t}-dp{d}" for t, d in MESHES])
def test_shard_equivalence_suite(tp, dp, seed):
    """Both record modes on the mesh: bit-identical to one device (outputs, tapes, commits), and
    the shared suite's checks on the sharded results (modes agree, every step replays to its
    snapshot, tuple commit == snapshot commit == the expected writes, untouched slots)."""
    plan = make_plan(tp, dp)
    case, single = sharded_case(plan, seed)
    for record in ("tuples", "snapshots"):
        assert_bitwise_equal(single[record], getattr(case, f"outputs_{record}"), f"{record} outputs vs one device")
    crop = jax.tree.map(lambda a: a[:, :, : SHAPE.D], single["tape"])
    assert_bitwise_equal(crop, {"tuples": case.tuples, "snapshots": case.snapshots}, "tapes vs one device")
    check_outputs(case)
    check_replay_every_step(case)

    def sharded_commit(pool, tape, *ix):
        return plan.commit(pool, tape, *ix, backend=case.backend)

    by_tuples = check_commit(case, commit=sharded_commit)
    args = case.idx.as_args()
    assert_bitwise_equal(gl.commit(case.pool, single["tape"]["tuples"], *args, backend="reference"), by_tuples,
                         "sharded commit vs one device")  # fmt: skip
    # replay on the mesh (requests over data, heads over tensor) == the snapshots
    tup, snp = jax.tree.map(lambda t: t[0, np.clip(case.idx.rows, 0, 7)], (case.tuples, case.snapshots))
    last = jnp.full((SHAPE.N,), SHAPE.D - 1, jnp.int32)
    valid = (case.idx.rows >= 0) & (case.idx.rows < 8)
    got = plan.replay(case.states0[0], tup, last, backend=case.backend)
    assert_bitwise_equal(np.asarray(snp.states[:, -1])[valid], np.asarray(got)[valid], "sharded replay")


# ---------------------------------------------------------------------------------
# The pool module on a mesh.
# ---------------------------------------------------------------------------------
def _pool_inputs(rng, g, N: int, D: int):
    normal = lambda *shape, dtype=jnp.float32: jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)  # noqa: E731
    C, Kc, HV = g.conv_dim, g.conv_kernel, g.num_v_heads
    params = [dict(conv_weight=normal(C, Kc), conv_bias=normal(C), A_log=jnp.asarray(rng.uniform(-1, 1, HV), jnp.float32),
                   dt_bias=normal(HV)) for _ in range(g.gdn_layers)]  # fmt: skip
    xs = [dict(mixed_qkv=normal(N, D, C, dtype=jnp.bfloat16), a=normal(N, D, HV, dtype=jnp.bfloat16),
               b=normal(N, D, HV, dtype=jnp.bfloat16)) for _ in range(g.gdn_layers)]  # fmt: skip
    return params, xs


def _filled_pool(rng, g, record, *, slots, requests, drafts):
    p = gpool.allocate(g, slots=slots, requests=requests, drafts=drafts, record=record)
    return jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape, np.float32)).astype(x.dtype), p)


def _tp(plan, x, axis=-1):
    return sharding.to_tp_layout(x, GEOMETRY, plan.tp, axis)


def run_pool_step(plan, seed, record, backend):
    """verify_layer of every layer then pool_commit, on the mesh and on one device: the pools
    (conv arrays read back from the tensor-parallel order) and the outputs."""
    g, N, D = GEOMETRY, 4, 3
    rng = np.random.default_rng(seed)
    base = _filled_pool(rng, g, record, slots=11, requests=3, drafts=D)  # 12 slots, 4 rows
    params, xs = _pool_inputs(rng, g, N, D)
    ix = commit_indices(seed, N=N, D=D, slots_in_pool=12, rows_in_tape=4, invalid=True, permute_rows=True,
                        shards=plan.dp).as_args()  # fmt: skip
    slots, steps, track_slots, track_steps, rows = ix
    one, outs_one = jax.tree.map(jnp.copy, base), []
    for layer in range(g.gdn_layers):
        o, one = gpool.verify_layer(one, layer, **xs[layer], **params[layer], slots=slots, rows=rows, backend=backend)
        outs_one.append(o)
    one = gpool.commit(one, slots, steps, track_slots, track_steps, rows, backend=backend)

    conv = ("conv", "conv_windows")
    mesh_pool = plan.put(dataclasses.replace(base, **{f: _tp(plan, getattr(base, f), -2) for f in conv}), "pool")
    outs_mesh = []
    for layer in range(g.gdn_layers):
        prm = dict(params[layer], conv_weight=_tp(plan, params[layer]["conv_weight"], 0),
                   conv_bias=_tp(plan, params[layer]["conv_bias"]))  # fmt: skip
        x = dict(xs[layer], mixed_qkv=_tp(plan, xs[layer]["mixed_qkv"]))
        o, mesh_pool = plan.verify_layer(mesh_pool, jnp.int32(layer), **x, **prm, slots=slots, rows=rows, backend=backend)
        outs_mesh.append(o)
    mesh_pool = plan.pool_commit(mesh_pool, slots, steps, track_slots, track_steps, rows, backend=backend)
    back = dataclasses.replace(
        mesh_pool, **{f: sharding.from_tp_layout(getattr(mesh_pool, f), g, plan.tp, -2) for f in conv}
    )
    return (outs_one, one), (outs_mesh, back), mesh_pool


@needs_mesh
@pytest.mark.parametrize("record", ["tuples", "snapshots"])
@pytest.mark.parametrize("tp,dp", [(2, 2), (4, 1)], ids=["mesh-tp2-dp2", "mesh-tp4-dp1"])
def test_shard_pool_verify_layer_and_commit(tp, dp, record, seed):
    """pool.verify_layer and pool.commit on the mesh (conv included) == one device, bit for bit;
    the pool stays sharded (slots over data, heads and conv channels over tensor)."""
    plan = make_plan(tp, dp)
    want, got, mesh_pool = run_pool_step(plan, seed, record, "reference")
    assert_bitwise_equal(want, got, f"pool step on a {tp}x{dp} mesh vs one device")
    for leaf, kind in ((mesh_pool.ssm, "pool_state"), (mesh_pool.conv, "conv_pool"), (mesh_pool.tape, "tape")):
        for x, want in zip(jax.tree.leaves(leaf), jax.tree.leaves(plan.shardings(kind, leaf))):
            assert x.sharding.is_equivalent_to(want, x.ndim), (kind, x.sharding, want)


@needs_mesh
def test_shard_pallas_interpret_pool_step(seed):
    """The Pallas kernels (interpret mode) per shard on a 2 x 2 mesh: conv, verify from the pool
    by slot with the tape written in place, the commit kernels: == one device."""
    want, got, _ = run_pool_step(make_plan(2, 2), seed, "tuples", "pallas")
    assert_bitwise_equal(want, got, "Pallas pool step on a 2x2 mesh vs one device")


# ---------------------------------------------------------------------------------
# Controls, errors, collectives, the plain functions under jit.
# ---------------------------------------------------------------------------------
@needs_mesh
def test_shard_controls_are_caught(seed):
    """The sharded comparisons catch (1) v-heads split from their q/k head: the same wrapper on
    v-heads in an interleaved order, so that each tensor shard holds v-heads of other shards' q/k
    heads; (2) a naive replay form run per shard."""
    plan, s = make_plan(2, 1), SHAPE
    x = verify_inputs(seed, s, kind="mixed")
    want = gl.verify(**x, backend="reference")
    assert_bitwise_equal(want, plan.verify(**x, backend="reference"), "the right grouping")
    order = np.concatenate([np.arange(r, s.HV, plan.tp) for r in range(plan.tp)])  # shard r: v-heads r, r+tp, ...
    axis = {"state0": -3, "v": -2, "a": -1, "b": -1, "A_log": -1, "dt_bias": -1}
    wrong = {k: jnp.take(v, order, axis=axis[k]) if k in axis else v for k, v in x.items()}
    out, tape = plan.verify(**wrong, backend="reference")
    back = np.argsort(order)
    assert_bitwise_differs(want[0], jnp.take(out, back, axis=-2), "v-heads split from their q/k head: outputs")
    assert_bitwise_differs(want[1].u, jnp.take(tape.u, back, axis=-2), "v-heads split from their q/k head: tape")

    _, snp = gl.verify(**x, record="snapshots", backend="reference")
    last = jnp.full((s.N,), s.D - 1, jnp.int32)
    right = plan.replay(x["state0"], want[1], last, backend="reference")
    assert_bitwise_equal(snp.states[:, -1], right, "sharded replay")

    def naive(v):
        return jax.jit(lambda s0, t, st: reference.replay(s0, t, st, rule=rounding.FORMS["naive"]))(
            v["state0"], v["tuples"], v["steps"])

    got = plan.run("replay", naive, dict(state0=x["state0"], tuples=want[1], steps=last))
    assert_bitwise_differs(snp.states[:, -1], got, "a naive replay form per shard")


@needs_mesh
def test_shard_errors_name_the_argument_and_sizes():
    s = SHAPE
    x = verify_inputs(0, s)
    with pytest.raises(ValueError, match=r"MeshPlan.verify: H=4 q/k heads cannot be split over the tensor axis 'tensor' "
                       r"of size 8: H must be a multiple .* HV/H=2 v-heads .* tensor sizes that fit: 1, 2, 4"):  # fmt: skip
        sharding.MeshPlan(jax.make_mesh((8,), ("tensor",)), tensor="tensor").verify(**x)
    with pytest.raises(ValueError, match=r"argument 'state0' has 6 requests on axis 0 \(shape \[6, 8, 16, 16\]\), not a "
                       r"multiple of the data axis 'data' of size 4"):  # fmt: skip
        sharding.MeshPlan(jax.make_mesh((4,), ("data",)), data="data").verify(**x)
    plan = make_plan(2, 2)
    pool = jnp.zeros((1, 12, s.HV, s.V, s.K))
    y = {k: v for k, v in x.items() if k != "state0"}
    slots = np.array([0, 1, 7, 6, 8, 9], np.int32)  # request 2 (shard 0) has slot 7 (shard 1)
    with pytest.raises(ValueError, match=r"MeshPlan.verify: argument 'slots': request 2 is on data shard 0 of 2 \(requests "
                       r"\[0, 3\)\), but its slot 7 lives on data shard 1 \(slots \[6, 12\) of 12\)"):  # fmt: skip
        plan.verify(pool, **y, slots=slots, layer=0)
    tape = gl.Tuples(jnp.zeros((1, 4, s.D, s.HV, s.V)), jnp.zeros((1, 4, s.D, s.H, s.K)), jnp.zeros((1, 4, s.D, s.HV)))
    ok, steps = np.array([0, 1, 2, 6, 7, 8], np.int32), np.zeros(6, np.int32)
    with pytest.raises(ValueError, match=r"MeshPlan.commit: argument 'rows': request 3 is on data shard 1 .* its tape row 0 "
                       r"lives on data shard 0 \(tape rows \[0, 2\) of 4\)"):  # fmt: skip
        plan.commit(pool, tape, ok, steps, rows=np.array([0, 1, 0, 0, 1, 2], np.int32))
    with pytest.raises(ValueError, match=r"argument 'track_slots': request 0 .* its track slot 11 lives on data shard 1"):
        plan.commit(pool, tape, ok, steps, np.array([11, -1, -1, -1, -1, -1]), np.array([0, -1, -1, -1, -1, -1]),
                    np.array([0, 1, 0, 2, 3, 2]))  # fmt: skip
    # an inactive track copy (negative track step) needs no local track slot
    plan.commit(pool, tape, ok, steps, np.array([11, -1, -1, -1, -1, -1]), np.full(6, -1), np.array([0, 1, 0, 2, 3, 2]))
    with pytest.raises(ValueError, match=r"MeshPlan.allocate: slots \+ 1 = 11 \(with the padding slot\) must be a multiple "
                       r"of the data axis 'data' of size 2: e.g. slots=11"):  # fmt: skip
        plan.allocate(GEOMETRY, slots=10, requests=3, drafts=2)
    with pytest.raises(ValueError, match=r"MeshPlan: argument 'tensor' must be one of the mesh's axes \('data', 'tensor'\)"):
        sharding.MeshPlan(plan.mesh, tensor="model")


def _collectives(compiled_text: str) -> dict:
    return {c: compiled_text.count(c + "(") + compiled_text.count(c + "-start(") for c in COLLECTIVES}


@needs_mesh
def test_shard_wrappers_compile_without_collectives():
    """verify, replay, commit and the pool methods on a 2 x 2 mesh: no collective in the program."""
    plan, s = make_plan(2, 2), SHAPE
    x = verify_inputs(0, s)
    pool = jnp.zeros((2, 12, s.HV, s.V, s.K))
    tape = _buffers(np.random.default_rng(0), 2, 8, s.D, s)["tuples"]
    ix = commit_indices(0, N=s.N, D=s.D, slots_in_pool=12, rows_in_tape=8, shards=2).as_args()
    y = {k: v for k, v in x.items() if k != "state0"}
    programs = {
        "verify": jax.jit(lambda x: plan.verify(**x)).lower(x),
        "verify from the pool": jax.jit(lambda y, p, t, ix: plan.verify(p, **y, slots=ix[0], layer=jnp.int32(1), tape=t,
                                                                         rows=ix[4])).lower(y, pool, tape, ix),
        "replay": jax.jit(lambda s0, t, st: plan.replay(s0, t, st)).lower(x["state0"], plan.verify(**x)[1], ix[1]),
        "commit": jax.jit(lambda p, t, ix: plan.commit(p, t, *ix)).lower(pool, tape, ix),
    }  # fmt: skip
    p = plan.allocate(GEOMETRY, slots=11, requests=3, drafts=s.D)
    params, xs = _pool_inputs(np.random.default_rng(0), GEOMETRY, 4, s.D)
    pix = commit_indices(0, N=4, D=s.D, slots_in_pool=12, rows_in_tape=4, shards=2).as_args()
    programs["verify_layer"] = jax.jit(lambda p, x, prm, ix: plan.verify_layer(p, 0, **x, **prm, slots=ix[0], rows=ix[4])
                                       ).lower(p, xs[0], params[0], pix)  # fmt: skip
    programs["pool_commit"] = jax.jit(lambda p, ix: plan.pool_commit(p, *ix)).lower(p, pix)
    for name, lowered in programs.items():
        assert not any(_collectives(lowered.compile().as_text()).values()), name


@needs_mesh
def test_plain_functions_under_jit_with_named_shardings_mesh():
    """The unsharded functions under jit, on arrays placed with the plan's shardings: XLA
    propagates them (reference backend) to the same bits. Collectives are counted, not
    required to be absent (docs/sharding.md quotes the counts)."""
    plan, s = make_plan(2, 2), SHAPE
    x = verify_inputs(1, s, kind="mixed")
    placed = {k: plan.put(v, sharding.ARG_KINDS["verify"][k]) for k, v in x.items()}
    f = jax.jit(lambda x: gl.verify(**x, backend="reference"))
    assert_bitwise_equal(gl.verify(**x, backend="reference"), f(placed), "verify under jit on the mesh")
    counts = {"verify": _collectives(f.lower(placed).compile().as_text())}
    _, tup = f(placed)
    steps = jnp.asarray(np.arange(s.N) % s.D, jnp.int32)
    r = jax.jit(lambda s0, t, st: gl.replay(s0, t, st, backend="reference"))
    args = (placed["state0"], tup, plan.put(steps, "index"))
    assert_bitwise_equal(gl.replay(x["state0"], tup, steps, backend="reference"), r(*args), "replay under jit")
    counts["replay"] = _collectives(r.lower(*args).compile().as_text())
    pool = jnp.asarray(np.random.default_rng(1).standard_normal((2, 12, s.HV, s.V, s.K), np.float32))
    tape = _buffers(np.random.default_rng(2), 2, 8, s.D, s)["tuples"]
    ix = commit_indices(1, N=s.N, D=s.D, slots_in_pool=12, rows_in_tape=8, shards=2).as_args()
    c = jax.jit(lambda p, t, ix: gl.commit(p, t, *ix, backend="reference"))
    cargs = (plan.put(pool, "pool_state"), plan.put(tape, "tape"), plan.put(ix, "index"))
    assert_bitwise_equal(gl.commit(pool, tape, *ix, backend="reference"), c(*cargs), "commit under jit")
    counts["commit"] = _collectives(c.lower(*cargs).compile().as_text())
    assert not any(counts["verify"].values()), counts
    print("collectives of the plain functions under jit on a 2x2 mesh:", counts)
