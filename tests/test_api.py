"""Argument checks: clear errors before anything is computed."""

import jax.numpy as jnp
import numpy as np
import pytest

import gdn_lossless_jax as gl
from gdn_lossless_jax.cases import Shape, verify_inputs

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


def test_tree_metadata_rejected(x):
    gl.verify(**x, parents=np.tile(np.arange(-1, 2), (2, 1)))  # a linear chain is fine
    with pytest.raises(ValueError, match="describes a tree"):
        gl.verify(**x, parents=np.array([[-1, 0, 0], [-1, 0, 1]]))
    with pytest.raises(ValueError, match="topk=2 is not supported"):
        gl.verify(**x, topk=2)


def test_record_and_backend_names(x):
    with pytest.raises(ValueError, match="record must be one of"):
        gl.verify(**x, record="states")
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        gl.verify(**x, backend="cuda")


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
