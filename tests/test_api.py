"""Argument checks: clear errors before anything is computed; the small helpers."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdn_lossless_jax as gl
from gdn_lossless_jax.testing.cases import Shape, verify_inputs
from gdn_lossless_jax.testing import assert_trees_bitwise_equal
from gdn_lossless_jax import checks

SHAPE = Shape(N=2, D=3, H=2, HV=4, K=8, V=4)


@pytest.fixture
def x():
    return verify_inputs(0, SHAPE)


def test_ok(x):
    out, tape = gl.verify(**x)
    assert out.shape == (2, 3, 4, 4) and out.dtype == jnp.bfloat16
    assert tape.u.shape == (2, 3, 4, 4) and tape.k.shape == (2, 3, 2, 8) and tape.g.shape == (2, 3, 4)
    _, snp = gl.verify(**x, record="snapshots")
    assert snp.states.shape == (2, 3, 4, 4, 8) and snp.states.dtype == jnp.float32


@pytest.mark.parametrize(
    "name,value,pattern",
    [
        ("state0", jnp.ones((2, 4, 4)), r"'state0' must have rank 4 \(\[N, HV, V, K\]\), got shape \[2, 4, 4\]"),
        ("state0", jnp.ones((2, 4, 4, 8), jnp.float16), r"'state0' must be float32 or bfloat16, got dtype float16"),
        ("q", jnp.ones((2, 3, 2, 7)), r"'q' must have shape \[N, D, H, K\] = \[2, 3, 2, 8\].*got \[2, 3, 2, 7\]"),
        ("k", jnp.ones((2, 3, 1, 8)), r"'k' must have shape \[N, D, H, K\] = \[2, 3, 2, 8\].*got \[2, 3, 1, 8\]"),
        ("v", jnp.ones((2, 3, 4, 5)), r"'v' must have shape \[N, D, HV, V\] = \[2, 3, 4, 4\].*got \[2, 3, 4, 5\]"),
        ("a", jnp.ones((2, 3)), r"'a' must have shape \[N, D, HV\] = \[2, 3, 4\]"),
        ("b", jnp.ones((2, 3, 4), jnp.int32), r"'b' must be a floating-point array, got dtype int32"),
        ("A_log", jnp.ones((3,)), r"'A_log' must have shape \[HV\] = \[4\]"),
        ("dt_bias", jnp.ones((4, 1)), r"'dt_bias' must have shape \[HV\] = \[4\]"),
    ],
)
def test_verify_rejects(x, name, value, pattern):
    with pytest.raises((ValueError, TypeError), match=pattern):
        gl.verify(**dict(x, **{name: value}))


def test_heads_must_divide():
    s = Shape(N=1, D=2, H=2, HV=4, K=8, V=4)
    x = verify_inputs(0, s)
    q3 = jnp.ones((1, 2, 3, 8))
    with pytest.raises(ValueError, match=r"H=3 must divide the v-heads HV=4"):
        gl.verify(**dict(x, q=q3, k=q3))


def test_tree_metadata_checked(x):
    gl.verify(**x, parents=np.tile(np.arange(-1, 2), (2, 1)))  # a linear chain is fine
    with pytest.raises(ValueError, match=r"gives node 0 of request 0 2 children, more than topk=1"):
        gl.verify(**x, parents=np.array([[-1, 0, 0], [-1, 0, 1]]))  # a tree needs its topk (tests/test_tree.py)
    with pytest.raises(ValueError, match="topk=2 is not supported"):
        gl.verify(**x, topk=2)


def test_record_and_backend_names(x):
    with pytest.raises(ValueError, match="record must be one of"):
        gl.verify(**x, record="states")
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        gl.verify(**x, backend="cuda")


def test_record_modes_are_classes(x):
    """A record mode is its tape class: ``record=`` takes the name (the API's edge) or the class, and the
    name is read nowhere past the edge (a backend's call carries the class and its flags)."""
    from gdn_lossless_jax import checks, tape

    assert tape.RECORDS == {"tuples": gl.Tuples, "snapshots": gl.Snapshots} and gl.RECORD_MODES == tuple(tape.RECORDS)
    assert tape.record_type("snapshots") is gl.Snapshots and tape.record_type(gl.Tuples) is gl.Tuples
    assert gl.Snapshots.stores_states and not gl.Tuples.stores_states
    assert checks.verify_args("verify", **x, record="snapshots").record is gl.Snapshots
    gl.testing.assert_trees_bitwise_equal(gl.verify(**x, record="snapshots"), gl.verify(**x, record=gl.Snapshots))
    with pytest.raises(ValueError, match="record must be one of"):
        gl.verify(**x, record=gl.Tape)


def test_replay_and_commit_reject(x):
    _, tup = gl.verify(**x)
    with pytest.raises(ValueError, match=r"'steps' must have shape \[N\] = \[2\]"):
        gl.replay(x["state0"], tup, jnp.zeros((3,), jnp.int32))
    with pytest.raises(TypeError, match="'steps' must be an integer array"):
        gl.replay(x["state0"], tup, jnp.zeros((2,)))
    with pytest.raises(TypeError, match="'tuples.u' must be float32"):
        gl.replay(x["state0"], gl.Tuples(tup.u.astype(jnp.bfloat16), tup.k, tup.g), jnp.zeros((2,), jnp.int32))
    pool = jnp.ones((1, 5, 4, 4, 8))
    stacked = gl.Tuples(tup.u[None], tup.k[None], tup.g[None])
    idx = jnp.zeros((2,), jnp.int32)
    gl.commit(pool, stacked, idx, idx)
    with pytest.raises(ValueError, match=r"'tape.u' must have shape .* = \[1, 2, 3, 4, 4\]"):
        gl.commit(jnp.ones((1, 5, 4, 4, 8)), gl.Tuples(tup.u[None, :, :, :, :2], tup.k[None], tup.g[None]), idx, idx)
    with pytest.raises(ValueError, match="give both track_slots and track_steps"):
        gl.commit(pool, stacked, idx, idx, track_slots=idx)
    with pytest.raises(TypeError, match="snapshot dtype bfloat16 must match the pool dtype float32"):
        gl.commit(pool, gl.Snapshots(jnp.ones((1, 2, 3, 4, 4, 8), jnp.bfloat16)), idx, idx)
    with pytest.raises(ValueError, match=r"'pool' must have rank 5"):
        gl.commit(pool[0], stacked, idx, idx)


# ---------------------------------------------------------------------------------
# Argument traps a user runs into: each is named, with the way out.
# ---------------------------------------------------------------------------------
def test_transposed_q_and_k_are_named(x):
    qt, kt = jnp.swapaxes(x["q"], 1, 2), jnp.swapaxes(x["k"], 1, 2)  # [N, H, D, K]
    with pytest.raises(ValueError, match=r"'q' has shape \[2, 2, 3, 8\], which reads as \[N, H, D, K\].*swapaxes\(q, 1, 2\)"):
        gl.verify(**dict(x, q=qt, k=kt))
    with pytest.raises(ValueError, match=r"'k' has shape \[2, 2, 3, 8\], which reads as \[N, H, D, K\].*swapaxes\(k, 1, 2\)"):
        gl.verify(**dict(x, k=kt))


def test_lists_are_converted_or_rejected(x):
    as_f32 = {n: a.astype(jnp.float32) for n, a in x.items()}
    lists = {n: np.asarray(a).tolist() for n, a in as_f32.items()}
    assert_trees_bitwise_equal(gl.verify(**as_f32), gl.verify(**lists))
    out, tape = gl.verify(**as_f32)
    steps = [2, -1]
    assert_trees_bitwise_equal(gl.replay(as_f32["state0"], tape, jnp.asarray(steps)), gl.replay(lists["state0"], tape, steps))
    stacked = gl.stack_tapes([tape])
    pool = as_f32["state0"][None]
    assert_trees_bitwise_equal(
        gl.commit(pool, stacked, jnp.asarray([1, 0]), jnp.asarray(steps)), gl.commit(pool.tolist(), stacked, [1, 0], steps)
    )
    with pytest.raises(TypeError, match=r"argument 'q' could not be converted to an array"):
        gl.verify(**dict(x, q=[[1.0, 2.0], [3.0]]))
    with pytest.raises(TypeError, match=r"argument 'A_log' must be an array .* got str"):
        gl.verify(**dict(x, A_log="zeros"))
    with pytest.raises(TypeError, match=r"argument 'slots' must be an array .* got NoneType"):
        gl.commit(pool, stacked, None, steps)


@pytest.mark.parametrize("name", ["state0", "A_log", "dt_bias", "q", "v"])
def test_float64_is_rejected_for_every_input(x, name):
    """state0 and the parameters alike: fp32 computation would round them silently."""
    f64 = np.asarray(x[name], np.float64)  # a numpy array keeps float64 with x64 off
    with pytest.raises(TypeError, match=rf"'{name}' must be .*got dtype float64; cast it with {name}.astype\(jnp.float32\)"):
        gl.verify(**dict(x, **{name: f64}))
    gl.verify(**dict(x, **{name: f64.astype(np.float32)}))  # the cast it asks for works


def test_jit_needs_static_keywords(x):
    with pytest.raises(TypeError, match=r"static_argnames.*|path record"):
        jax.jit(gl.verify)(**x, record="snapshots")
    jitted = jax.jit(gl.verify, static_argnames=("record", "backend", "scale", "out_dtype"))
    assert_trees_bitwise_equal(gl.verify(**x, record="snapshots", scale=0.3), jitted(**x, record="snapshots", scale=0.3))
    with pytest.raises(TypeError, match=r"'scale' is traced .* static_argnames"):
        jax.jit(functools.partial(gl.verify, record="snapshots"))(**x, scale=0.3)


# ---------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------
def test_stack_tapes(x):
    tapes = [gl.verify(**dict(x, v=x["v"] * (i + 1)))[1] for i in range(3)]
    stacked = gl.stack_tapes(tapes)
    assert_trees_bitwise_equal(jax.tree.map(lambda *t: jnp.stack(t), *tapes), stacked)
    assert stacked.u.shape == (3, 2, 3, 4, 4) and stacked.num_rows == 2 and stacked.num_steps == 3
    snaps = gl.stack_tapes([gl.verify(**x, record="snapshots")[1]] * 2)
    assert snaps.states.shape == (2, 2, 3, 4, 4, 8)
    with pytest.raises(ValueError, match="need at least one layer's tape"):
        gl.stack_tapes([])
    with pytest.raises(TypeError, match=r"layer 1 is a Snapshots tape but layer 0 a Tuples tape"):
        gl.stack_tapes([tapes[0], snaps.replace(states=snaps.states[0])])
    with pytest.raises(ValueError, match=r"layer 2's field 'u' is float32\[2, 2, 4, 4\], layer 0's float32\[2, 3, 4, 4\]"):
        gl.stack_tapes([tapes[0], tapes[1], tapes[2].replace(u=tapes[2].u[:, :2])])


def test_replace(x):
    _, tape = gl.verify(**x)
    g2 = tape.g * 2
    new = tape.replace(g=g2)
    assert new.g is g2 and new.u is tape.u and isinstance(new, gl.Tuples)
    _, snp = gl.verify(**x, record="snapshots")
    assert snp.replace(states=snp.states[:1]).num_rows == 1
    with pytest.raises(TypeError, match=r"Tuples.replace: unknown field 'G'; the fields are u, k, g"):
        tape.replace(G=g2)
    geometry = gl.get_geometry("qwen3.6-35b-a3b").reduced(gdn_layers=1, heads_divisor=16, head_dim=8)
    p = gl.pool.allocate(geometry, slots=2, requests=1, drafts=2)
    ssm = p.ssm + 1
    assert p.replace(ssm=ssm).ssm is ssm and p.replace(ssm=ssm).geometry == geometry
    with pytest.raises(TypeError, match=r"StatePool.replace: unknown field 'states'"):
        p.replace(states=ssm)


def test_submodules_are_attributes():
    import gdn_lossless_jax

    for name in ("pool", "conv", "reference", "rounding", "testing", "autodiff", "checked", "checks", "sharding", "tools"):
        assert getattr(gdn_lossless_jax, name).__name__ == f"gdn_lossless_jax.{name}"
    assert gdn_lossless_jax.tools.memory.__name__ == "gdn_lossless_jax.tools.memory"


@pytest.mark.parametrize("old, new", [("cases", "testing.cases"), ("memory", "tools.memory"), ("viz", "tools.viz"),
                                      ("fuzz", "tools.fuzz"), ("equivalence", "testing.equivalence")])
def test_moved_modules_keep_their_old_names(old, new):
    """A module that moved is still there under its old name for one release, with a DeprecationWarning."""
    import importlib
    import sys

    import gdn_lossless_jax

    def forget():  # as in a fresh process, where nothing imported the old name yet
        sys.modules.pop(f"gdn_lossless_jax.{old}", None)
        vars(gdn_lossless_jax).pop(old, None)

    forget()
    with pytest.warns(DeprecationWarning, match=f"moved to gdn_lossless_jax.{new}"):
        assert getattr(gdn_lossless_jax, old).__name__ == f"gdn_lossless_jax.{new}"
    forget()
    with pytest.warns(DeprecationWarning, match=f"moved to gdn_lossless_jax.{new}"):
        assert importlib.import_module(f"gdn_lossless_jax.{old}").__name__ == f"gdn_lossless_jax.{new}"


@pytest.mark.parametrize("module, name, new", [("rounding", "FORMS", "testing.controls"),
                                               ("reference", "commit_accepted_first", "testing.controls"),
                                               ("api", "as_index", "checks")])
def test_moved_names_keep_their_old_homes(module, name, new):
    import importlib

    old = importlib.import_module(f"gdn_lossless_jax.{module}")
    with pytest.warns(DeprecationWarning, match=f"moved to gdn_lossless_jax.{new}.{name}"):
        assert getattr(old, name) is getattr(importlib.import_module(f"gdn_lossless_jax.{new}"), name)


def test_weakly_typed_index_arrays_become_plain_int32():
    """``jnp.full((n,), 3)`` is a weakly typed int32; the kernels get a plain one (Pallas Triton's
    lowering failed on the weak one on the GPU: tests/test_gpu.py), eagerly and under jit, and a
    plain int32 array passes through as it is."""
    from gdn_lossless_jax import api

    weak = jnp.full((3,), 2)
    assert weak.weak_type and not checks.as_index(weak).weak_type and checks.as_index(weak).dtype == jnp.int32
    plain = jnp.arange(3, dtype=jnp.int32)
    assert checks.as_index(plain) is plain

    def traced(s):
        assert s.aval.weak_type and not checks.as_index(s).aval.weak_type
        return checks.as_index(s)

    assert not jax.jit(traced)(weak).weak_type


def test_a_transposed_state_is_named(seed):
    """A state in [N, HV, K, V] (K != V) is named as transposed, not blamed on q; control: the
    right layout runs."""
    x = verify_inputs(seed, Shape(N=2, D=2, H=1, HV=2, K=16, V=8))
    with pytest.raises(ValueError, match=r"verify: argument 'state0' has shape \[2, 2, 16, 8\], whose last axes read "
                                         r"as \[K, V\] = \[16, 8\] .* pass jnp.swapaxes\(state0, -1, -2\)"):  # fmt: skip
        gl.verify(**{**x, "state0": jnp.swapaxes(x["state0"], -1, -2)})
    gl.verify(**x)
