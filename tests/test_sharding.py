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
check has a control it must catch (v-heads split from their q/k head; a wrong, twice-rounded replay form).
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdn_lossless_jax as gl
from conftest import FULL_TESTS, ON_GPU, full_only, requires_gpu
from equivalence import Case, check_commit, check_outputs, check_replay_every_step
from test_invariance import row_count_matmul
from gdn_lossless_jax import pool as gpool
from gdn_lossless_jax import reference, sharding
from gdn_lossless_jax.model import numerics
from gdn_lossless_jax.testing.cases import Shape, commit_indices, verify_inputs
from gdn_lossless_jax.testing import assert_bitwise_differs, assert_bitwise_equal, ulp_stats
from gdn_lossless_jax.testing import controls

N_DEVICES = len(jax.devices())
SIMULATED = 8  # the CPU devices of test_mesh_suite_in_subprocess


def needs_devices(n: int):
    return pytest.mark.skipif(
        N_DEVICES < n,
        reason=f"needs {n} devices, {N_DEVICES} here (on a CPU, test_mesh_suite_in_subprocess runs this on "
        f"{SIMULATED} simulated devices)",
    )


needs_mesh = needs_devices(SIMULATED)
# Backends per shard: the reference on a CPU; on GPUs also the kernels (a host with two or more GPUs
# runs the meshes that fit).
BACKENDS = ["reference"] + (["pallas"] + (["triton"] if importlib.util.find_spec("jax_triton") else []) if ON_GPU else [])


def mesh_params(meshes, backends=("reference",), extra=((),), cpu_extended=()):
    """``(tp, dp, backend, *extra)`` parameters, each needing ``tp * dp`` devices; the meshes in
    ``cpu_extended`` run on simulated CPU devices with GDN_FULL_TESTS=1 only (the suite's time)."""
    return [
        pytest.param(tp, dp, b, *e, id="-".join([f"mesh-tp{tp}-dp{dp}", b, *map(str, e)]),
                     marks=[needs_devices(tp * dp), *([full_only] if (tp, dp) in cpu_extended and not ON_GPU else [])])
        for tp, dp in meshes
        for b in backends
        for e in extra
    ]


# (tensor, data) sizes of the meshes: 2- and 4-way over heads, 2-way over requests, 2 x 2.
MESHES = [(2, 1), (4, 1), (1, 2), (2, 2)]
# H = 4 q/k heads of 2 v-heads each (4-way: one q/k head and its two v-heads per device); the
# kernels' own head sizes on a GPU.
HEAD_DIM = 128 if ON_GPU else 16
SHAPE = Shape(N=6, D=3, H=4, HV=8, K=HEAD_DIM, V=HEAD_DIM)
GEOMETRY = gl.get_geometry("qwen3.6-35b-a3b").reduced(gdn_layers=2, heads_divisor=4, head_dim=HEAD_DIM)
COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")


def make_plan(tp: int, dp: int, explicit: bool = False) -> sharding.MeshPlan:
    """A (data, tensor) mesh over the first devices, of Auto axes (``jax.sharding.Mesh``'s default)
    or Explicit ones (``jax.make_mesh``'s)."""
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((dp, tp), ("data", "tensor"), axis_types=(kind, kind), devices=jax.devices()[: tp * dp])
    return sharding.MeshPlan(mesh, tensor="tensor", data="data")


# The mesh suite in subprocesses of about two minutes each (xdist can run them on both workers):
# the demo model's tests, the rest, and the invariant decoding mode's mesh tests (tests/test_invariance.py).
MESH_GROUPS = {"model": "model_spec or demo", "functions": "not (model_spec or demo)", "invariance": "mesh_invariance"}
MESH_FILES = {"invariance": os.path.join(os.path.dirname(os.path.abspath(__file__)), "test_invariance.py")}
MESH_CHILD = "GDN_MESH_SUBPROCESS"  # set in the subprocess's environment


@pytest.mark.longest
@pytest.mark.skipif(N_DEVICES >= SIMULATED, reason=f"{N_DEVICES} devices here: the mesh tests run in this process")
@pytest.mark.parametrize("group", MESH_GROUPS)
def test_mesh_suite_in_subprocess(group):
    # In the subprocess itself (MESH_CHILD set) this test must not run: there the XLA flags did not
    # give the simulated devices (a malformed XLA_FLAGS can drop them), and a run that went on would
    # start the next subprocess, and so on without end.
    assert not os.environ.get(MESH_CHILD), (
        f"the mesh subprocess has {N_DEVICES} device(s), not {SIMULATED}: XLA_FLAGS="
        f"{os.environ.get('XLA_FLAGS', '')!r} did not give --xla_force_host_platform_device_count={SIMULATED}"
    )
    flags = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={SIMULATED}").strip()
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu", **{MESH_CHILD: "1"})
    # The one-device and multi-process tests run here.
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", MESH_FILES.get(group, __file__),
           "-k", f"({MESH_GROUPS[group]}) and not one_device and not multihost"]  # fmt: skip
    t = time.perf_counter()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, f"{' '.join(cmd)} failed (exit {run.returncode}):\n{out[-6000:]}"
    assert re.search(r"\d+ passed", out), out[-3000:]
    print(f"mesh suite ({group}) in a subprocess: {time.perf_counter() - t:.0f} s\n{out[-400:]}")


# ---------------------------------------------------------------------------------
# The equivalence suite, sharded.
# ---------------------------------------------------------------------------------
def _buffers(rng, L: int, R: int, Dmax: int, s: Shape):
    """Tape buffers with random filler (a read or write of a wrong row shows)."""
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, dtype=np.float32))  # noqa: E731
    tup = gl.Tuples(u=normal(L, R, Dmax, s.HV, s.V), k=normal(L, R, Dmax, s.H, s.K), g=-jnp.abs(normal(L, R, Dmax, s.HV)))
    return {"tuples": tup, "snapshots": gl.Snapshots(normal(L, R, Dmax, s.HV, s.V, s.K))}


class Compiled:
    """``jax.jit(fn)`` compiled once for the first arguments it sees; ``collectives`` counts the
    collectives of every program it compiled (the sharded ones must have none)."""

    def __init__(self, fn):
        self.fn, self.programs, self.texts = jax.jit(fn), {}, []

    def __call__(self, *args):
        key = jax.tree.structure(args), tuple((np.shape(a), str(getattr(a, "dtype", ""))) for a in jax.tree.leaves(args))
        if key not in self.programs:
            self.programs[key] = self.fn.lower(*args).compile()
            self.texts.append(self.programs[key].as_text())
        return self.programs[key](*args)

    def collectives(self) -> dict:
        return {c: sum(_collectives(t)[c] for t in self.texts) for c in COLLECTIVES}


def _collectives(compiled_text: str) -> dict:
    return {c: compiled_text.count(c + "(") + compiled_text.count(c + "-start(") for c in COLLECTIVES}


def sharded_case(plan: sharding.MeshPlan, seed: int, *, L: int = 2, s: Shape = SHAPE, backend: str = "reference"):
    """The equivalence suite's case, verified on the mesh from a global pool, beside the same
    calls on one device: ``(case, single, programs)``, the tapes written into buffers."""
    S, R, Dmax = 12, 8, s.D + 1  # 6 slots and 4 rows per data shard at dp = 2
    rng = np.random.default_rng(seed)
    pool = jnp.asarray(0.5 * rng.standard_normal((L, S, s.HV, s.V, s.K), dtype=np.float32))
    idx = commit_indices(seed, N=s.N, D=s.D, slots_in_pool=S, rows_in_tape=R, invalid=True, permute_rows=True,
                         shards=plan.dp)  # fmt: skip
    bufs = _buffers(rng, L, R, Dmax, s)
    slots, rows = jnp.asarray(idx.slots), jnp.asarray(idx.rows)
    programs = {m: Compiled(lambda p, x, l, t, m=m: plan.verify(p, **x, slots=slots, layer=l, tape=t, rows=rows,
                                                                  record=m, backend=backend)) for m in bufs}  # fmt: skip
    got = {m: [] for m in bufs} | {"tape": dict(bufs)}
    want = {m: [] for m in bufs} | {"tape": dict(bufs)}
    for layer in range(L):
        x = verify_inputs(rng, s, kind="mixed")
        del x["state0"]
        for record in bufs:
            o, got["tape"][record] = programs[record](pool, x, jnp.int32(layer), got["tape"][record])
            got[record].append(o)
            o, want["tape"][record] = gl.verify(pool, **x, slots=slots, layer=layer, tape=want["tape"][record],
                                                rows=rows, record=record, backend=backend)  # fmt: skip
            want[record].append(o)
    states0 = [reference.read_slots(pool, layer, slots) for layer in range(L)]
    # The tapes hold Dmax >= D steps: the case's tapes are their first D.
    crop = lambda t: jax.tree.map(lambda a: a[:, :, : s.D], t)  # noqa: E731
    case = Case(backend, s, L, pool, idx, got["tuples"], got["snapshots"], crop(got["tape"]["tuples"]),
                crop(got["tape"]["snapshots"]), states0)  # fmt: skip
    return case, want, programs


@pytest.mark.parametrize("tp,dp,backend", mesh_params(MESHES, BACKENDS, cpu_extended=[(2, 1), (4, 1), (1, 2)]))
def test_shard_equivalence_suite(tp, dp, backend, seed):
    """Both record modes on the mesh: bit-identical to one device (outputs, tapes, commits), and
    the shared suite's checks on the sharded results (modes agree, every step replays to its
    snapshot, tuple commit == snapshot commit == the expected writes, untouched slots)."""
    plan = make_plan(tp, dp)
    case, single, programs = sharded_case(plan, seed, backend=backend)
    for record in ("tuples", "snapshots"):
        assert_bitwise_equal(single[record], getattr(case, f"outputs_{record}"), f"{record} outputs vs one device")
    crop = jax.tree.map(lambda a: a[:, :, : SHAPE.D], single["tape"])
    assert_bitwise_equal(crop, {"tuples": case.tuples, "snapshots": case.snapshots}, "tapes vs one device")
    check_outputs(case)
    check_replay_every_step(case, layers=[0])
    programs["commit"] = Compiled(lambda p, t, ix: plan.commit(p, t, *ix, backend=case.backend))
    by_tuples = check_commit(case, commit=lambda pool, tape, *ix: programs["commit"](pool, tape, ix))
    args = case.idx.as_args()
    assert_bitwise_equal(gl.commit(case.pool, single["tape"]["tuples"], *args, backend=backend), by_tuples,
                         "sharded commit vs one device")  # fmt: skip
    # replay on the mesh (requests over data, heads over tensor) == the snapshots
    R = case.tuples.u.shape[1]
    tup, snp = jax.tree.map(lambda t: t[0, np.clip(case.idx.rows, 0, R - 1)], (case.tuples, case.snapshots))
    last = jnp.full((SHAPE.N,), SHAPE.D - 1, jnp.int32)
    valid = (case.idx.rows >= 0) & (case.idx.rows < R)
    programs["replay"] = Compiled(lambda s0, t, st: plan.replay(s0, t, st, backend=case.backend))
    got = programs["replay"](case.states0[0], tup, last)
    assert_bitwise_equal(np.asarray(snp.states[:, -1])[valid], np.asarray(got)[valid], "sharded replay")
    for name, program in programs.items():
        assert not any(program.collectives().values()), (name, program.collectives())


@pytest.mark.parametrize("tp,dp,backend", mesh_params([(2, 2), (4, 1)], BACKENDS, cpu_extended=[(4, 1)]))
def test_shard_kda(tp, dp, backend, seed):
    """KDA (a per-channel decay: ``a [N, D, HV, K]``, ``dt_bias [HV, K]``, the tape's ``g [..., HV, K]``) on the mesh:
    verify in both record modes, the commit with track copies, replay and the fused step equal one device bit for
    bit, with no collective. Control: ``dt_bias`` with its heads moved by one shard's share gives other outputs (a
    wrong split of the per-channel parameters would)."""
    plan = make_plan(tp, dp)
    rng = np.random.default_rng(seed % 2**31)
    N, D, H, K = 4, 3, 4, HEAD_DIM
    r = lambda *shape, dtype=jnp.bfloat16: jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)  # noqa: E731
    x = dict(q=r(N, D, H, K), k=r(N, D, H, K), v=r(N, D, H, K), a=r(N, D, H, K), b=r(N, D, H),
             A_log=jnp.asarray(np.log(rng.uniform(0.2, 4.0, H)), jnp.float32), dt_bias=r(H, K, dtype=jnp.float32))
    pool = r(1, 8, H, K, K, dtype=jnp.float32)
    # requests 0, 1 on data shard 0 (slots [0, 4)), 2, 3 on shard 1 (slots [4, 8)); two track copies
    slots, steps = jnp.array([1, 3, 4, 6], jnp.int32), jnp.array([2, -1, 0, 1], jnp.int32)
    tslots, tsteps = jnp.array([2, -1, 7, -1], jnp.int32), jnp.array([0, -1, 2, -1], jnp.int32)
    ix = (slots, steps, tslots, tsteps)
    mesh_pool = plan.put(pool, "pool_state")
    tapes = {}
    for record in ("tuples", "snapshots"):
        o1, t1 = gl.verify(pool, **x, slots=slots, layer=0, decay="channel", record=record, backend=backend)
        o2, t2 = plan.verify(mesh_pool, **x, slots=slots, layer=0, decay="channel", record=record, backend=backend)
        assert_bitwise_equal((o1, t1), (o2, t2), f"KDA verify ({record}) on a {tp}x{dp} mesh vs one device")
        tapes[record] = gl.stack_tapes([t1])
        c1 = gl.commit(pool, tapes[record], *ix, backend=backend)
        c2 = plan.commit(mesh_pool, tapes[record], *ix, backend=backend)
        assert_bitwise_equal(c1, c2, f"KDA commit ({record}) on the mesh vs one device")
    tup = tapes["tuples"]
    assert type(tup) is gl.KDATuples
    assert_bitwise_equal(gl.replay(pool[0, slots], t1 := jax.tree.map(lambda t: t[0], tup), jnp.full((N,), D - 1)),
                         plan.replay(pool[0, slots], t1, jnp.full((N,), D - 1, jnp.int32), backend=backend),
                         "KDA replay on the mesh")  # fmt: skip
    pending = gl.Pending(tup, jnp.arange(N, dtype=jnp.int32), steps, tslots, tsteps)
    y = {n: (v[:, ::-1] if v.ndim >= 3 else v) for n, v in x.items()}
    f1 = gl.commit_and_verify(pool, pending, **y, slots=slots, layer=0, backend=backend)
    f2 = plan.commit_and_verify(mesh_pool, pending, **y, slots=slots, layer=0, backend=backend)
    assert_bitwise_equal(f1, f2, "KDA commit_and_verify on the mesh vs one device")
    moved = dict(x, dt_bias=jnp.roll(x["dt_bias"], H // tp, axis=0))
    o3, _ = plan.verify(mesh_pool, **moved, slots=slots, layer=0, decay="channel", backend=backend)
    assert_bitwise_differs(o2, o3, "control: dt_bias's heads moved by one shard's share")


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


def _filled_pool(rng, g, record, *, slots, requests, drafts, defer=False):
    """A pool with random states and scratch (never zeros); a deferring pool with nothing pending."""
    p = gpool.allocate(g, slots=slots, requests=requests, drafts=drafts, record=record, defer_commit=defer)
    fill = lambda x: jnp.asarray(rng.standard_normal(x.shape, np.float32)).astype(x.dtype)  # noqa: E731
    return jax.tree.map(lambda x: fill(x) if jnp.issubdtype(x.dtype, jnp.floating) else x, p)


def _tp(plan, x, axis=-1):
    return sharding.to_tp_layout(x, GEOMETRY, plan.tp, axis)


def run_pool_step(plan, seed, record, backend, *, steps: int = 1, defer: bool = False):
    """``steps`` decode steps (verify_layer of every layer, then pool_commit; a pool that defers
    its commit is flushed at the end) on the mesh and on one device: the pools (conv arrays read
    back from the tensor-parallel order) and the outputs."""
    g, N, D = GEOMETRY, 4, 3
    rng = np.random.default_rng(seed)
    base = _filled_pool(rng, g, record, slots=11, requests=5, drafts=D, defer=defer)  # 12 slots, 6 rows
    params, xs = _pool_inputs(rng, g, N, D)
    index_sets = [commit_indices(seed + t, N=N, D=D, slots_in_pool=12, rows_in_tape=6, invalid=True,
                                 permute_rows=True, shards=plan.dp).as_args() for t in range(steps)]  # fmt: skip
    one, outs_one = jax.tree.map(jnp.copy, base), []
    for slots, st, track_slots, track_steps, rows in index_sets:
        for layer in range(g.gdn_layers):
            o, one = gpool.verify_layer(one, layer, **xs[layer], **params[layer], slots=slots, rows=rows, backend=backend)
            outs_one.append(o)
        one = gpool.commit(one, slots, st, track_slots, track_steps, rows, backend=backend)
    one = gpool.flush(one, backend=backend)

    conv = ("conv", "conv_windows")
    mesh_pool = plan.put(dataclasses.replace(base, **{f: _tp(plan, getattr(base, f), -2) for f in conv}), "pool")
    programs = {
        "verify_layer": Compiled(lambda p, layer, x, prm, ix: plan.verify_layer(p, layer, **x, **prm, slots=ix[0],
                                                                                rows=ix[4], backend=backend)),
        "pool_commit": Compiled(lambda p, ix: plan.pool_commit(p, *ix, backend=backend)),
        "flush": Compiled(lambda p: plan.flush(p, backend=backend)),
    }  # fmt: skip
    outs_mesh = []
    for ix in index_sets:
        for layer in range(g.gdn_layers):
            prm = dict(params[layer], conv_weight=_tp(plan, params[layer]["conv_weight"], 0),
                       conv_bias=_tp(plan, params[layer]["conv_bias"]))  # fmt: skip
            x = dict(xs[layer], mixed_qkv=_tp(plan, xs[layer]["mixed_qkv"]))
            o, mesh_pool = programs["verify_layer"](mesh_pool, jnp.int32(layer), x, prm, ix)
            outs_mesh.append(o)
        mesh_pool = programs["pool_commit"](mesh_pool, ix)
    mesh_pool = programs["flush"](mesh_pool)
    host = jax.device_get(mesh_pool)
    back = dataclasses.replace(host, **{f: sharding.from_tp_layout(getattr(host, f), g, plan.tp, -2) for f in conv})
    if defer and plan.dp > 1:  # the pending entries are kept in each shard's own indices: compare their tapes
        one, back = (dataclasses.replace(p, deferred=p.deferred.tape) for p in (one, back))
    for name, program in programs.items():
        assert not any(program.collectives().values()), (name, program.collectives())
    return (outs_one, one), (outs_mesh, back), mesh_pool


POOL_MESHES = [(2, 1), (1, 2), (2, 2)] if ON_GPU else [(2, 2)]


@pytest.mark.parametrize("tp,dp,backend,record", mesh_params(POOL_MESHES, BACKENDS, [("tuples",), ("snapshots",)]))
def test_shard_pool_verify_layer_and_commit(tp, dp, backend, record, seed):
    """pool.verify_layer and pool.commit on the mesh (conv included) == one device, bit for bit;
    the pool stays sharded (slots over data, heads and conv channels over tensor)."""
    plan = make_plan(tp, dp, explicit=record == "snapshots")  # both axis types
    want, got, mesh_pool = run_pool_step(plan, seed, record, backend)
    assert_bitwise_equal(want, got, f"pool step on a {tp}x{dp} mesh vs one device")
    for leaf, kind in ((mesh_pool.ssm, "pool_state"), (mesh_pool.conv, "conv_pool"), (mesh_pool.tape, "tape")):
        for x, want in zip(jax.tree.leaves(leaf), jax.tree.leaves(plan.shardings(kind, leaf))):
            assert x.sharding.is_equivalent_to(want, x.ndim), (kind, x.sharding, want)


@needs_devices(4)
@pytest.mark.skipif(ON_GPU, reason="on a GPU the pool test above runs the compiled kernels")
@full_only  # (~45 s of CI's suite; there the reference's pool step runs on the mesh, Pallas on one device)
def test_shard_pallas_interpret_pool_step(seed):
    """The Pallas kernels (interpret mode) per shard on a 2 x 2 mesh: conv, verify from the pool
    by slot with the tape written in place, the commit kernels: == one device."""
    want, got, _ = run_pool_step(make_plan(2, 2), seed, "tuples", "pallas")
    assert_bitwise_equal(want, got, "Pallas pool step on a 2x2 mesh vs one device")


@pytest.mark.parametrize("tp,dp,backend", mesh_params([(2, 2)], BACKENDS))
def test_shard_fused_commit_and_verify_and_a_deferring_pool(tp, dp, backend, seed):
    """The fused entry point, commit_and_verify (the previous step's commit inside the next
    verify), per shard == one device in both record modes; and a pool that defers its commit
    (pool.allocate(defer_commit=True)): two steps and a flush on the mesh == one device. With
    ``out=`` (an outputs buffer over layers) too. On the CPU with tuples only and without the
    deferring pool (the suite's time; both with GDN_FULL_TESTS=1; the mesh's snapshot commit runs in
    the pool's test below)."""
    plan, s = make_plan(tp, dp), SHAPE
    rng = np.random.default_rng(seed)
    pool = jnp.asarray(0.5 * rng.standard_normal((2, 12, s.HV, s.V, s.K), np.float32))
    prev = _buffers(rng, 2, 8, s.D, s)
    ix = commit_indices(seed, N=s.N, D=s.D, slots_in_pool=12, rows_in_tape=8, invalid=True, permute_rows=True,
                        shards=dp)  # fmt: skip
    x = verify_inputs(rng, s, kind="mixed")
    del x["state0"]
    for record, tape in prev.items():
        if record == "snapshots" and not (ON_GPU or FULL_TESTS):
            continue
        pending = gl.Pending(tape, ix.rows, ix.steps, ix.track_slots, ix.track_steps)
        want = gl.commit_and_verify(pool, pending, **x, slots=ix.slots, layer=1, record=record, backend=backend)
        got = plan.commit_and_verify(pool, pending, **x, slots=ix.slots, layer=1, record=record, backend=backend)
        assert_bitwise_equal(want, got, f"commit_and_verify ({record}) on a {tp}x{dp} mesh vs one device")
        if record == "snapshots" and not ON_GPU:  # out= with tuples only (the outputs are the same in both modes)
            continue
        # out=: the outputs written into a [L, N, D, HV, V] buffer at the layer, on the mesh as on one device
        obuf = jnp.asarray(rng.standard_normal((2, *want[0].shape), np.float32)).astype(want[0].dtype)
        got = plan.commit_and_verify(pool, pending, **x, slots=ix.slots, layer=1, record=record, backend=backend,
                                     out=obuf)  # fmt: skip
        assert_bitwise_equal(obuf.at[1].set(want[0]), got[0], f"commit_and_verify ({record}, out=) on the mesh")
        o, _ = plan.verify(pool, **x, slots=ix.slots, layer=0, record=record, backend=backend, out=obuf)
        o_want, _ = gl.verify(pool, **x, slots=ix.slots, layer=0, record=record, backend=backend, out=obuf)
        assert_bitwise_equal(o_want, o, f"verify ({record}, out=) on the mesh vs one device")
    if ON_GPU or FULL_TESTS:  # (CI's CPU run: the deferring pool on one device, tests/test_fused.py)
        want, got, _ = run_pool_step(plan, seed, "tuples", backend, steps=2, defer=True)
        assert_bitwise_equal(want, got, "a deferring pool, two steps and a flush, on the mesh vs one device")


# ---------------------------------------------------------------------------------
# Controls, errors, collectives, the plain functions under jit.
# ---------------------------------------------------------------------------------
@needs_devices(2)
def test_shard_controls_are_caught(seed):
    """The sharded comparisons catch (1) v-heads split from their q/k head: the same wrapper on
    v-heads in an interleaved order, so that each tensor shard holds v-heads of other shards' q/k
    heads; (2) a wrong (twice-rounded) replay form run per shard."""
    plan, s = make_plan(2, 1, explicit=True), SHAPE
    x = verify_inputs(seed, s, kind="mixed")
    want = gl.verify(**x, backend="reference")
    assert_bitwise_equal(want, plan.verify(**x, backend="reference"), "the right grouping")
    order = np.concatenate([np.arange(r, s.HV, plan.tp) for r in range(plan.tp)])  # shard r: v-heads r, r+tp, ...
    axis = {"state0": -3, "v": -2, "a": -1, "b": -1, "A_log": -1, "dt_bias": -1}
    wrong = {k: jnp.take(v, order, axis=axis[k]) if k in axis else v for k, v in x.items()}
    out, tape = plan.verify(**wrong, backend="reference")
    back = np.argsort(order)
    out, tape = jax.device_get((out, tape))  # the host's copy: reordered outside the mesh
    assert_bitwise_differs(want[0], np.take(out, back, axis=-2), "v-heads split from their q/k head: outputs")
    assert_bitwise_differs(want[1].u, np.take(tape.u, back, axis=-2), "v-heads split from their q/k head: tape")

    _, snp = gl.verify(**x, record="snapshots", backend="reference")
    last = jnp.full((s.N,), s.D - 1, jnp.int32)
    right = plan.replay(x["state0"], want[1], last, backend="reference")
    assert_bitwise_equal(snp.states[:, -1], right, "sharded replay")

    def wrong(v):
        return jax.jit(lambda s0, t, st: reference.replay(s0, t, st, rule=controls.CONTROLS["twice_rounded"]))(
            v["state0"], v["tuples"], v["steps"])

    got = plan.run("replay", wrong, dict(state0=x["state0"], tuples=want[1], steps=last))
    assert_bitwise_differs(snp.states[:, -1], got, "a twice-rounded replay form per shard")


# ---------------------------------------------------------------------------------
# The real head size (K = V = 128), D = 8, tensor axes of 2, 4 and 8.
# ---------------------------------------------------------------------------------
# H = 8 q/k heads of 2 v-heads each: an 8-way tensor axis leaves one q/k head per device (as the
# gpu size's 16 on 8 devices), the 4 x 2 mesh two q/k heads and one request per device.
HEAD128 = Shape(N=2, D=8, H=8, HV=16, K=128, V=128)
MESHES_128 = [(2, 1), (4, 1), (8, 1), (4, 2)]
# Where XLA:CPU, left to choose (jnp.sum), summed a shard's K terms in another order than one
# device's at HEAD128 (a 32-wide reduce-window and a reduce against YNNPACK's one reduce).
XLA_SPLITS_128 = [(8, 1), (4, 2)]


# On the CPU the meshes of XLA_SPLITS_128 (the suite's time; the 2- and 4-way tensor axes, the same fixed trees at
# other shard shapes, with GDN_FULL_TESTS=1).
@pytest.mark.parametrize("tp,dp,backend", mesh_params(MESHES_128, BACKENDS, cpu_extended=[(2, 1), (4, 1)]))
def test_shard_verify_and_commit_at_head_size_128(tp, dp, backend, seed, monkeypatch):
    """Verify (outputs and tape) and the commit of its tape into a pool, at K = V = 128 and D = 8
    on a tp x dp mesh, == one device bit for bit: every K sum of the reference (the q and k norms,
    ``Sd @ k``, ``S' @ q``) is a fixed pairwise tree (``reference.ksum``), whatever shape a shard
    has. The snapshot tape on the 8-way mesh (the outputs do not depend on the mode). Controls (CPU):
    the K sums left to XLA (``jnp.sum``) on the mesh must differ from one device's; and on the
    meshes of ``XLA_SPLITS_128`` the code before the fix (``jnp.sum`` on both sides) must differ
    too: the fault the fixed order removes."""
    plan, s = make_plan(tp, dp), HEAD128
    x = verify_inputs(seed, s, kind="mixed")
    want = {}
    for record in ("tuples", "snapshots") if ON_GPU or (tp, dp) == (8, 1) else ("tuples",):
        want[record] = gl.verify(**x, record=record, backend=backend)
        got = plan.verify(**x, record=record, backend=backend)
        assert_bitwise_equal(want[record], got, f"verify ({record}) on a {tp}x{dp} mesh vs one device")
    rng = np.random.default_rng(seed)
    pool = jnp.asarray(0.5 * rng.standard_normal((1, 4, s.HV, s.V, s.K), np.float32))  # 2 slots per data shard
    tape = jax.tree.map(lambda t: t[None], want["tuples"][1])  # [L=1, R=N, D, ...]
    ix = commit_indices(seed, N=s.N, D=s.D, slots_in_pool=4, rows_in_tape=s.N, shards=dp).as_args()
    assert_bitwise_equal(gl.commit(pool, tape, *ix, backend=backend), plan.commit(pool, tape, *ix, backend=backend),
                         f"commit on a {tp}x{dp} mesh vs one device")  # fmt: skip
    if ON_GPU:  # the controls show XLA:CPU's choices
        return
    with monkeypatch.context() as m:
        m.setattr(reference, "ksum", lambda t: jnp.sum(t, axis=-1))  # read when a program is traced

        def xla_order(v):  # (its own code: plan.run and jax.jit trace it afresh, with jnp.sum)
            return reference.verify(**v, record="tuples", scale=s.K**-0.5)

        on_mesh = plan.run("verify", xla_order, dict(x))
        assert_bitwise_differs(want["tuples"], on_mesh, f"control: the K sums by jnp.sum on the {tp}x{dp} mesh")
        if (tp, dp) in XLA_SPLITS_128:
            assert_bitwise_differs(jax.jit(xla_order)(x), on_mesh,
                                   f"control: jnp.sum on one device and on the {tp}x{dp} mesh: if this no "
                                   "longer differs, XLA:CPU now sums both shapes in one order and the test above no "
                                   "longer exercises the case")  # fmt: skip


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
    stacked = {k: v[None] for k, v in y.items()}
    with pytest.raises(ValueError, match=r"MeshPlan.verify: argument 'q' has rank 5 \(stacked over layers\)"):
        plan.verify(pool, **stacked, slots=np.arange(6, dtype=np.int32), layer=0)
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


PLAIN_MESHES = [(2, 1)] if ON_GPU else [(2, 2)]


@pytest.mark.parametrize("tp,dp,backend", mesh_params(PLAIN_MESHES, BACKENDS))
def test_plain_functions_under_jit_with_named_shardings_mesh(tp, dp, backend):
    """The unsharded functions under jit, on arrays placed with the plan's shardings: the same
    bits as one device. Collectives are counted and printed, not required to be absent, except
    in the reference verify (docs/sharding.md quotes the counts; on GPUs this measures what XLA
    makes of the kernels' custom calls)."""
    plan, s = make_plan(tp, dp), SHAPE
    x = verify_inputs(1, s, kind="mixed")
    placed = {k: plan.put(v, sharding.ARG_KINDS["verify"][k]) for k, v in x.items()}
    f = jax.jit(lambda x: gl.verify(**x, backend=backend))
    assert_bitwise_equal(gl.verify(**x, backend=backend), f(placed), "verify under jit on the mesh")
    counts = {"verify": _collectives(f.lower(placed).compile().as_text())}
    _, tup = f(placed)
    steps = jnp.asarray(np.arange(s.N) % s.D, jnp.int32)
    r = jax.jit(lambda s0, t, st: gl.replay(s0, t, st, backend=backend))
    args = (placed["state0"], tup, plan.put(steps, "index"))
    assert_bitwise_equal(gl.replay(x["state0"], tup, steps, backend=backend), r(*args), "replay under jit")
    counts["replay"] = _collectives(r.lower(*args).compile().as_text())
    pool = jnp.asarray(np.random.default_rng(1).standard_normal((2, 12, s.HV, s.V, s.K), np.float32))
    tape = _buffers(np.random.default_rng(2), 2, 8, s.D, s)["tuples"]
    ix = commit_indices(1, N=s.N, D=s.D, slots_in_pool=12, rows_in_tape=8, shards=dp).as_args()
    c = jax.jit(lambda p, t, ix: gl.commit(p, t, *ix, backend=backend))
    cargs = (plan.put(pool, "pool_state"), plan.put(tape, "tape"), plan.put(ix, "index"))
    assert_bitwise_equal(gl.commit(pool, tape, *ix, backend=backend), c(*cargs), "commit under jit")
    counts["commit"] = _collectives(c.lower(*cargs).compile().as_text())
    if backend == "reference":
        assert not any(counts["verify"].values()), counts
    print(f"collectives of the plain functions under jit, {backend} on a {tp}x{dp} mesh: {counts}")


# ---------------------------------------------------------------------------------
# The demo model's speculative step on a 2 x 2 mesh.
# ---------------------------------------------------------------------------------
MODEL_MESHES = [(2, 1), (1, 2), (2, 2)] if ON_GPU else [(2, 2)]


def _decode_on_one_and_mesh(single, plan, params, new, prompts, slots, rows, track_slots, n_steps):
    """``decode_steps`` of the step ``single`` on one device and of the same step through ``plan``'s
    mesh (parameters, a fresh state from ``new()`` and each step's inputs placed by
    ``place_on_mesh``): ``(one device's result, the mesh's)``."""
    from gdn_lossless_jax.model.decode import decode_steps, place_on_mesh

    config = single.config
    one = decode_steps(single, params, new(), prompts, slots, rows, track_slots, n_steps)
    mparams, mstate = place_on_mesh(plan, config, params, new())
    mesh = decode_steps(dataclasses.replace(single, mesh=plan), mparams, mstate, prompts, slots, rows, track_slots,
                        n_steps, place=lambda x: place_on_mesh(plan, config, params, new(), x)[2])  # fmt: skip
    return one, mesh


def _first_flip(want_out, got_out) -> str:
    """Where two runs' step outputs first predict another token, with the top-2 gap there."""
    for t, (a, b) in enumerate(zip(want_out, got_out)):
        for i in range(a.predictions.shape[0]):
            if not np.array_equal(a.predictions[i], b.predictions[i]):
                return f"tokens differ first at step {t}, row {i}, top-2 gap {float(np.min(a.gaps[i])):.3e}"
    return "the same predictions, other accepted tokens"


@pytest.mark.parametrize("tp,dp,backend", mesh_params(MODEL_MESHES, ["auto"]))
def test_model_spec_step_on_a_mesh_gives_identical_tokens(tp, dp, backend, seed, monkeypatch):
    """The demo model's speculative step (draft, verify of every layer through the pool, accept,
    commit with prefix-cache track copies) on a 2 x 2 mesh (GDN heads over the tensor axis, batch
    rows, slots and scratch rows over the data axis; on GPUs also 2 x 1 and 1 x 2) == one device:
    the same tokens and accept counts (no near-tie excuse), and bit-identical final states (SSM, conv,
    KV); on the CPU the top-2 gaps too. On the CPU (the invariant mode) with a data axis, the control
    must differ: the mode's matmul replaced by one whose order of the sum over K depends on how many
    rows a device gets (a data axis of 2 gives each half of them)."""
    from gdn_lossless_jax.model import SpecStep, allocate_state, get_config, init_params
    from gdn_lossless_jax.model.decode import pool_from_mesh

    config, D = get_config("tiny"), 4
    plan = make_plan(tp, dp)
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(0, config.vocab, n)] for n in (9, 1, 14, 5)]
    # Two rows per data shard: slots [0, 6) and rows [0, 3) on shard 0, [6, 12) and [3, 6) on shard 1.
    slots, track_slots, rows = (np.array(x, np.int32) for x in ([0, 1, 6, 7], [2, 3, 8, 9], [0, 1, 3, 4]))
    new = lambda: allocate_state(config, slots=11, requests=5, drafts=D, record="tuples", max_len=64)  # noqa: E731

    def both(config):
        single = SpecStep(config, D, track_interval=8, backend=backend)
        return _decode_on_one_and_mesh(single, plan, init_params(config, seed % 2**31), new, prompts, slots, rows,
                                       track_slots, 10)  # fmt: skip

    (want, want_out, want_state), (got, got_out, got_state) = both(config)
    # No near-tie excuse: every sum of the model and the reference is in a fixed order, so the two
    # runs compute the same logits and so the same tokens, however close the top two.
    assert got == want, _first_flip(want_out, got_out)
    for f in ("inputs", "predictions", "accepted", "track_steps"):
        assert_bitwise_equal([getattr(o, f) for o in want_out], [getattr(o, f) for o in got_out], f"step outputs: {f}")
    # On the CPU the logits are one device's bit for bit (the gaps show them); XLA:GPU chooses its own
    # orders (not established there: printed).
    drift = ulp_stats(np.stack([o.gaps for o in want_out]), np.stack([o.gaps for o in got_out]))
    print(f"top-2 gaps on the mesh vs one device: {drift}")
    if not ON_GPU:
        assert_bitwise_equal([o.gaps for o in want_out], [o.gaps for o in got_out], "step outputs: top-2 gaps")
    assert sum(int(o.track_steps.max() >= 0) for o in want_out) >= 1, "the run must exercise a track copy"
    assert sum(int((o.accepted > o.inputs.shape[1] - 3).sum()) for o in want_out), "some drafts must be accepted"
    p = got_state.pool
    assert_bitwise_equal(want_state.pool, pool_from_mesh(p, config.geometry, tp), "the pool after 10 steps")
    assert_bitwise_equal(want_state.kv, got_state.kv, "the KV cache after 10 steps")
    assert p.ssm.sharding.is_equivalent_to(plan.sharding("pool_state", 5), 5)
    if ON_GPU or dp == 1:  # the invariant mode is the CPU's; with one data shard a device gets every row
        return
    # a multiple of 16 rows: one device's 4 requests x 4 tokens; a device of the mesh gets half of them
    monkeypatch.setattr(numerics, "_blocked_matmul", row_count_matmul(16))
    (_, want_out, _), (_, got_out, _) = both(dataclasses.replace(config, name="tiny-control"))  # its own compile
    assert_bitwise_differs([o.gaps for o in want_out], [o.gaps for o in got_out],
                           "control (a matmul whose order over K depends on the rows a device gets)")  # fmt: skip


@needs_devices(2)
@pytest.mark.skipif(not (ON_GPU or FULL_TESTS),
                    reason="extended set: GDN_FULL_TESTS=1 runs it (docs/testing.md; ~30 s in the mesh subprocess; CI's "
                    "CPU run: the demo model's step on a 2 x 2 mesh, and the device loop on one device in test_loop)")
def test_model_spec_loop_on_a_2x1_mesh_equals_a_single_device(seed):
    """The device decode loop (``Engine(steps_per_call=4)``) on a 2 x 1 mesh: the tokens and final
    states of the per-step engine on one device, bit for bit. Without the row-only layout of the
    GDN mixer's gated-norm output (``gdn_mixer(rows=...)``) XLA split the out-projection's sum over
    the tensor axis inside the loop's while body (an all-reduce: other bits); the control removes it
    with the invariant mode off (on, the mode's dots run per device under ``shard_map``, which
    gathers the operand first: ``model.rows_mesh``). (Not named "one device": the subprocess
    deselects those.)"""
    from gdn_lossless_jax.model import Engine, Request, get_config, init_params

    config = get_config("tiny")
    params = init_params(config, seed % 2**31)
    rng = np.random.default_rng(seed)
    reqs = [Request([int(t) for t in rng.integers(0, config.vocab, n)], 18) for n in (6, 11)]

    def run(mesh, K, config=config):
        eng = Engine(params, config, max_batch=2, max_len=64, steps_per_call=K, mesh=mesh)
        return [r.tokens for r in eng.generate(reqs)], eng.host_states()

    want = run(None, 1)
    got = run(make_plan(2, 1), 4)
    assert got[0] == want[0]
    assert_bitwise_equal(want[1], got[1], "final states, the device loop on a 2x1 mesh vs one device")
    # Control: the out-projection's operand left to XLA's layout.
    import gdn_lossless_jax.model.decode as decode_mod

    original = decode_mod.gdn_mixer
    try:
        decode_mod.gdn_mixer = lambda p, c, x, core, rows=None: original(p, c, x, core)
        bad = run(make_plan(2, 1), 4, dataclasses.replace(config, name="tiny-control", invariant=False))
    finally:
        decode_mod.gdn_mixer = original
    assert_bitwise_differs(want[1], bad[1], "control: the loop on the mesh without the row-only layout")


@needs_mesh
def test_model_spec_step_on_an_8_way_mesh_at_head_size_128_is_identical(seed, monkeypatch):
    """The demo model's step with K = V = 128 heads over an 8-way tensor axis (one q/k head and its
    two v-heads per device, as the gpu size's 16 heads on 8 devices) and D = 8: the step
    outputs (on the CPU the top-2 gaps too) and the final states (SSM, conv, KV) are one device's bit
    for bit, tokens with no near-tie excuse. The reference's K sums (verify, and the draft's step) and the
    model's norms are fixed pairwise trees. Control (CPU): the reference's K sums left to XLA
    (``jnp.sum``) in the mesh's run only must differ from one device's. A small float32 model."""
    from gdn_lossless_jax.model import SpecStep, allocate_state, init_params
    from gdn_lossless_jax.model import model as model_mod
    from gdn_lossless_jax.model.decode import decode_steps, place_on_mesh, pool_from_mesh

    config = model_mod.ModelConfig(
        "k128", vocab=256, d_model=64, layers=2, attention_interval=2, num_k_heads=8, num_v_heads=16, head_k_dim=128,
        head_v_dim=128, attn_heads=2, kv_heads=1, attn_head_dim=16, mlp_dim=64,
    )  # fmt: skip
    D, N, tp = 8, 2, 8
    plan = make_plan(tp, 1)
    params = init_params(config, seed % 2**31)
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(0, config.vocab, n)] for n in (2 * D, D + 3)]  # forced, then drafting
    slots, track_slots, rows = (np.array(x, np.int32) for x in ([0, 1], [2, 3], [0, 1]))
    new = lambda: allocate_state(config, slots=2 * N, requests=N, drafts=D, record="tuples", max_len=48)  # noqa: E731
    single = SpecStep(config, D, track_interval=8)
    (want, want_out, want_state), (got, got_out, got_state) = _decode_on_one_and_mesh(
        single, plan, params, new, prompts, slots, rows, track_slots, 4)  # fmt: skip
    assert got == want, _first_flip(want_out, got_out)
    # (the gaps on the CPU: XLA:GPU chooses its own orders outside the GDN layers, as in the 2 x 2 test above)
    for f in ("inputs", "predictions", "accepted", "track_steps", *(() if ON_GPU else ("gaps",))):
        assert_bitwise_equal([getattr(o, f) for o in want_out], [getattr(o, f) for o in got_out], f"step outputs: {f}")
    assert_bitwise_equal(want_state.pool, pool_from_mesh(got_state.pool, config.geometry, tp), "the pool after 4 steps")
    assert_bitwise_equal(want_state.kv, got_state.kv, "the KV cache after 4 steps")
    assert sum(int(o.track_steps.max() >= 0) for o in want_out) >= 1, "the run must exercise a track copy"
    if ON_GPU:  # the control shows XLA:CPU's choice
        return
    # Control: the mesh's run with the reference's K sums by jnp.sum. Verify runs inside jitted functions
    # that keep their traces by shape: the caches are cleared so that they trace it afresh, and again after.
    with monkeypatch.context() as m:
        m.setattr(reference, "ksum", lambda t: jnp.sum(t, axis=-1))
        jax.clear_caches()
        try:
            control = dataclasses.replace(config, name="k128-control")
            mparams, mstate = place_on_mesh(plan, control, params, new())
            _, ctrl_out, ctrl_state = decode_steps(
                SpecStep(control, D, track_interval=8, mesh=plan), mparams, mstate, prompts, slots, rows, track_slots,
                4, place=lambda x: place_on_mesh(plan, control, params, new(), x)[2])  # fmt: skip
        finally:
            jax.clear_caches()
    assert_bitwise_differs((want_state.pool.ssm, [o.gaps for o in want_out]),
                           (ctrl_state.pool.ssm, [o.gaps for o in ctrl_out]),
                           "control: the reference's K sums by jnp.sum on the 8-way mesh")


@needs_devices(2)
@full_only  # (on the CPU: ~45 s of the suite; CI runs the demo model's mesh step at V = 16)
def test_model_spec_step_on_a_mesh_with_v_heads_of_128_is_identical(monkeypatch, seed):
    """The demo model's step with the heads over a 2 x 1 mesh at V = 128 (the gpu size's; above
    32, where XLA:CPU starts to split a reduce): the step outputs, top-2 gaps included, and the
    final states are one device's bit for bit. The gated norm after each GDN layer's verify sums
    its squares in a fixed order (``model.gated_rmsnorm``). The control, ``jnp.mean`` there, must
    differ: XLA:CPU summed the 128 squares in one order on one device (verify's output in a
    transposed layout: a 32-wide reduce-window, then a reduce) and in another on the mesh (the
    gathered output in the default layout: one reduce by YNNPACK). A small float32 model: any
    difference of the norm shows in the gaps (the gpu size's bfloat16 hid most of them)."""
    from gdn_lossless_jax.model import SpecStep, allocate_state, init_params
    from gdn_lossless_jax.model import model as model_mod
    from gdn_lossless_jax.model.decode import pool_from_mesh

    config = model_mod.ModelConfig(
        "v128", vocab=256, d_model=64, layers=2, attention_interval=2, num_k_heads=2, num_v_heads=8, head_k_dim=16,
        head_v_dim=128, attn_heads=2, kv_heads=1, attn_head_dim=16, mlp_dim=64,
    )  # fmt: skip
    D, N, tp = 4, 8, 2
    plan = make_plan(tp, 1)
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(0, config.vocab, 2 * D)] for _ in range(N)]  # 2 forced steps, 2 drafting
    slots, track_slots = np.arange(N, dtype=np.int32), np.arange(N, 2 * N, dtype=np.int32)
    rows = np.arange(N, dtype=np.int32)

    def both(config):
        def new():
            return allocate_state(config, slots=2 * N, requests=N, drafts=D, record="tuples", max_len=32)

        single = SpecStep(config, D, track_interval=4)
        return _decode_on_one_and_mesh(single, plan, init_params(config, seed), new, prompts, slots, rows,
                                       track_slots, 4)  # fmt: skip

    (_, want_out, want_state), (_, got_out, got_state) = both(config)
    assert_bitwise_equal(want_out, got_out, "step outputs (inputs, predictions, gaps, accepted, track steps)")
    assert_bitwise_equal(want_state.pool, pool_from_mesh(got_state.pool, config.geometry, tp), "the pool after 4 steps")
    assert_bitwise_equal(want_state.kv, got_state.kv, "the KV cache after 4 steps")
    if ON_GPU:  # the control shows XLA:CPU's choice; XLA:GPU chooses its own way
        return

    def plain(o, z, weight, dtype):  # the gated norm with the order of its sum left to XLA
        of = o.astype(jnp.float32)
        y = of * jax.lax.rsqrt(jnp.mean(of * of, axis=-1, keepdims=True) + model_mod.RMS_EPS)
        y = y * weight.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
        return y.reshape(*y.shape[:-2], -1).astype(dtype)

    monkeypatch.setattr(model_mod, "gated_rmsnorm", plain)
    (_, want_out, _), (_, got_out, _) = both(dataclasses.replace(config, name="v128-control"))  # its own compile
    assert_bitwise_differs([o.gaps for o in want_out], [o.gaps for o in got_out],
                           "control (jnp.mean in the gated norm): if this no longer differs, XLA:CPU now sums both "
                           "programs' norms in one order and the test above no longer exercises the case")  # fmt: skip


@needs_devices(2)
@pytest.mark.skipif(not (ON_GPU or FULL_TESTS),
                    reason="extended set: GDN_FULL_TESTS=1 runs it (docs/testing.md; CI's CPU run: the demo model's step "
                    "on a 2 x 2 mesh, placed by place_on_mesh, in test_model_spec_step_on_a_mesh_gives_identical_tokens)")
def test_demo_cli_on_a_mesh_is_identical_to_a_single_device(capsys, monkeypatch):
    """``gdn-lossless demo --mesh 2x1``: both record modes through the Engine on a 2 x 1 mesh (the
    GDN heads over the tensor axis; conversations joining and leaving the batch, the second turn
    resumed from the prefix cache), and one run on one device: the same tokens and bit-identical
    final SSM, conv and KV states, so the verdict is 'identical'; a control (the mesh's conv states
    compared in the tensor-parallel order) gives 'DIFFERENT' and exit status 1. (Not named "one
    device": the subprocess deselects those.)"""
    from gdn_lossless_jax.tools.cli import main
    from gdn_lossless_jax.model import Engine, get_config, init_params

    args = ["demo", "--mesh", "2x1", "--prompts", "2", "--tokens", "40", "--turns", "2", "--batch", "2",
            "--track-interval", "16", "--progress", "off"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    devices = ", ".join(f"{d.platform}:{d.id}" for d in jax.devices()[:2])
    assert f"mesh 2x1 (tensor x data) over 2 devices: {devices}" in out, out
    for label in ("tuples", "snapshots", "1 device"):
        assert re.search(rf"^{label:<10} 160 tokens in .* tokens/s", out, re.MULTILINE), out
    assert out.count("2 of 2 later turns resumed") == 3, out
    for other in ("snapshots", "1 device"):
        assert f"tuples vs {other}: 160 of 160 tokens equal" in out, out
        assert f"tuples vs {other}, final SSM, conv and KV states: bit-identical" in out, out
    assert "verdict    identical: tuples and snapshots on the 2x1 mesh and 1 device gave the same tokens" in out, out
    # Control: the mesh's conv states compared in the tensor-parallel order (not read back) must differ.
    # (The same shapes as above: the steps are not compiled again.)
    def raw(self):
        return jax.device_get((self.state.pool.ssm, self.state.pool.conv, self.state.kv))

    monkeypatch.setattr(Engine, "host_states", raw)
    assert main([*args, "--record", "tuples"]) == 1
    out = capsys.readouterr().out
    assert "tuples vs 1 device: 160 of 160 tokens equal" in out and "conv and KV states: DIFFER" in out, out
    assert "verdict    DIFFERENT: tuples on the 2x1 mesh and 1 device disagree" in out, out
    config = get_config("tiny")
    with pytest.raises(ValueError, match=r"Engine: argument 'mesh' must have a data axis of size 1 .* got data axis "
                       r"'data' of size 2"):  # fmt: skip
        Engine(init_params(config, 0), config, mesh=make_plan(1, 2))


def test_demo_mesh_errors_name_the_argument_and_sizes(capsys):
    """``--mesh`` errors before anything runs: DP > 1, a TP that does not divide H (with the sizes
    that fit), too few devices (with the XLA flag that simulates more on a CPU), a malformed size."""
    from gdn_lossless_jax.tools.cli import main
    from gdn_lossless_jax.model import get_config
    from gdn_lossless_jax.tools.demo import mesh_plan

    def error(*argv):
        assert main(["demo", *argv, "--tokens", "4", "--progress", "off"]) == 2
        out = capsys.readouterr()
        assert out.out == "", out.out  # nothing ran
        return out.err

    assert re.search(r"--mesh 2x2: the demo splits heads only \(DP must be 1, got 2\); the data axis is exercised by "
                     r"tests/test_sharding.py", error("--mesh", "2x2"))  # fmt: skip
    assert re.search(r"--mesh 4x1 with --size tiny: H=2 q/k heads cannot be split over the tensor axis 'tensor' of "
                     r"size 4: .* tensor sizes that fit: 1, 2$", error("--mesh", "4x1"), re.MULTILINE)  # fmt: skip
    n, first = len(jax.devices()), f"{jax.devices()[0].platform}:{jax.devices()[0].id}"
    assert re.search(rf"--mesh 16x1 needs 16 devices, {n} here \({first}.*\); on a CPU, set "
                     r"XLA_FLAGS=--xla_force_host_platform_device_count=16 before JAX starts",
                     error("--mesh", "16x1", "--size", "gpu"))  # fmt: skip
    with pytest.raises(ValueError, match=rf"--mesh 2x1 needs 2 devices, 1 here \({first}\)"):
        mesh_plan(2, 1, get_config("tiny"), devices=jax.devices()[:1])
    for bad in ("2", "2x", "0x1"):
        with pytest.raises(SystemExit):
            main(["demo", "--mesh", bad])
        assert "argument --mesh:" in capsys.readouterr().err


# ---------------------------------------------------------------------------------
# One device: the sharded code path equals the unsharded one (the GPU check that it "costs
# no more than 3%" is benchmarks/step.py --kinds scan,scan-mesh,pool-scan,pool-scan-mesh).
# ---------------------------------------------------------------------------------
def _ops(compiled) -> collections.Counter:
    return collections.Counter(re.findall(r"= \S+ ([a-z][\w-]*)\(", compiled.as_text()))


KERNEL_BACKENDS = [pytest.param("pallas", marks=requires_gpu)] + (
    [pytest.param("triton", marks=requires_gpu)] if importlib.util.find_spec("jax_triton") else []
)


@pytest.mark.parametrize("record", ["tuples", "snapshots"])
@pytest.mark.parametrize("backend", ["reference", *KERNEL_BACKENDS])
def test_one_device_mesh_step_equals_unsharded(backend, record, seed):
    """The benchmark's whole step (every layer's verify from the pool by slot into the tape, then
    the commit; and the pool path with the conv) through a 1 x 1 MeshPlan == the unsharded step,
    bit for bit, and compiles to the same program (the same instructions, counted by opcode)."""
    from benchmarks import cases as bc
    from benchmarks import step as bs

    mode = bc.MODES["h200" if ON_GPU else "cpu-small"]
    inp = bs.make_inputs(bc.parse_configs("8x4" if ON_GPU else "2x2", mode.configs)[0], mode.geometry, seed=seed)
    plan = bs.parse_mesh("1x1")
    p = bs._allocate(inp, record, seed)
    ix = inp.index_sets[0]
    results, programs = {}, {}
    # (a MeshPlan takes one layer's inputs: the scan that slices them)
    sliced = {"plain": bs.direct_step(backend, "scan-sliced"), "mesh": bs.direct_step(backend, "scan-sliced", plan)}
    for name, step in sliced.items():
        args = (jnp.copy(p.ssm), jax.tree.map(jnp.copy, p.tape), inp.params, inp.qkv, ix)
        programs[name] = step.lower(*args).compile()
        results[name] = programs[name](*args)
    assert_bitwise_equal(results["plain"], results["mesh"], "scan step on a one-device mesh vs unsharded")
    assert _ops(programs["plain"]) == _ops(programs["mesh"]), "the one-device mesh changed the compiled step"
    pool_results = {}
    for name, pl in (("plain", None), ("mesh", plan)):
        fn = jax.jit(lambda q, prm, xs, ix, pl=pl: bs._pool_scan_step(q, prm, xs, ix, backend, pl), donate_argnums=0)
        pool_results[name] = fn(jax.tree.map(jnp.copy, p), inp.params, inp.pool_inputs, ix)
    assert_bitwise_equal(pool_results["plain"], pool_results["mesh"], "pool step on a one-device mesh vs unsharded")


@needs_devices(4)
@pytest.mark.parametrize("record", ["tuples", "snapshots"])
def test_memory_tp_table_is_what_each_device_of_a_mesh_holds(record):
    """``gdn-lossless memory --tp``'s per-device bytes == the shard each device of a 4-way
    tensor mesh holds of a pool from MeshPlan.allocate."""
    from gdn_lossless_jax.tools import memory

    plan = make_plan(4, 1)
    p = plan.allocate(GEOMETRY, slots=7, requests=3, drafts=SHAPE.D, record=record)
    (row,) = memory.tp_table([GEOMETRY], (4,), drafts=SHAPE.D, requests=3, slots=7)
    held = {d: 0 for d in plan.mesh.devices.flat}
    for name in ("ssm", "conv", "tape", "conv_windows"):
        for x in jax.tree.leaves(getattr(p, name)):
            for shard in x.addressable_shards:
                held[shard.device] += shard.data.nbytes
    assert set(held.values()) == {row.total(record)}


# ---------------------------------------------------------------------------------
# Several processes (jax.distributed), on this machine's CPUs.
# ---------------------------------------------------------------------------------
def test_multihost_example_runs_a_2x2_mesh_over_two_processes():
    """examples/multihost.py: 2 processes x 2 CPU devices joined through a coordinator on
    127.0.0.1; each process's shards of the sharded verify and commit (both record modes) equal
    the single-device run bit for bit."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    cmd = [sys.executable, os.path.join(root, "examples", "multihost.py"), "--processes", "2", "--devices", "2",
           "--timeout", "240", "--seed", str(int(os.environ["GDN_SEED"]))]  # fmt: skip
    run = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert out.count("shards held here bit-identical to the single-device run") == 2, out[-4000:]
    assert "mesh 2 data x 2 tensor" in out and "multihost: OK" in out
