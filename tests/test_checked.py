"""The checked mode: requests that commit would skip raise instead, naming the request."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import gdn_lossless_jax as gl
from gdn_lossless_jax.testing.cases import Shape, commit_indices, commit_tapes
from gdn_lossless_jax.testing import assert_bitwise_equal

SHAPE = Shape(N=4, D=3, H=2, HV=4, K=8, V=4)
F32 = jnp.float32
SLOTS = 12  # 2N + 4


@pytest.fixture
def problem(seed):
    pool, tuples, snapshots = commit_tapes(seed, SHAPE, layers=2, slots_in_pool=SLOTS)
    idx = commit_indices(seed, N=SHAPE.N, D=SHAPE.D, slots_in_pool=SLOTS, track_fraction=0.5)
    return pool, tuples, snapshots, idx


def _args(idx, change=None):
    """The index arrays as a dict of int32 arrays, after ``change`` (edits numpy copies)."""
    a = dict(zip(("slots", "steps", "track_slots", "track_steps", "rows"), (np.array(x) for x in idx.as_args())))
    if change is not None:
        change(a)
    return {k: jnp.asarray(v) for k, v in a.items()}


def _put(**edits):
    """A change setting ``name=(request, value)``; a value ``"slots[j]"`` or
    ``"track_slots[j]"`` copies that entry (and gives request j a track copy)."""

    def change(a):
        for name, (i, value) in edits.items():
            if isinstance(value, str):
                src, j = value.rstrip("]").split("[")
                value = a[src][int(j)]
                if src == "track_slots":
                    a["track_steps"][int(j)] = 0
            a[name][i] = value

    return change


D = SHAPE.D
# (change, the message the checked mode must give): request 2 is the culprit.
VIOLATIONS = [
    (_put(steps=(2, D)), r"request 2: steps\[2\] = 3 = D, the number of draft steps; steps are 0-based"),
    (_put(steps=(2, -2)), r"request 2: steps\[2\] = -2 is not in \[-1, 3\)"),
    (_put(track_steps=(2, D)), r"request 2: track_steps\[2\] = 3 = D"),
    (_put(slots=(2, SLOTS)), r"request 2: slots\[2\] = 12 is not in \[0, 12\) \(the pool's slots\)"),
    (_put(slots=(2, -1)), r"request 2: slots\[2\] = -1 is not in \[0, 12\)"),
    (_put(rows=(2, SHAPE.N)), r"request 2: rows\[2\] = 4 is not in \[0, 4\) \(the tape's rows\)"),
    (_put(track_steps=(2, 0), track_slots=(2, -7)), r"request 2: track_slots\[2\] = -7 is not in \[0, 12\)"),
    (_put(slots=(2, "slots[0]")), r"requests 0 and 2 have the same slot \d+ \(duplicate destination slots\)"),
    (
        _put(track_steps=(2, 0), track_slots=(2, "track_slots[1]")),
        r"requests 1 and 2 copy their track states to the same slot \d+",
    ),
    (
        _put(track_steps=(2, 0), track_slots=(2, "slots[3]")),
        r"request 2 copies its track state to slot \d+, which is request 3's own slot",
    ),
    (
        _put(steps=(2, 0), track_steps=(2, 1)),
        r"request 2: track_steps\[2\] = 1 is after the accepted step steps\[2\] = 0: the track state would hold a "
        r"rejected token",
    ),
    (_put(steps=(2, -1), track_steps=(2, 0)), r"request 2: track_steps\[2\] = 0 is after the accepted step steps\[2\] = -1"),
]
IDS = ["step=D", "step<-1", "track_step=D", "slot>=S", "slot<0", "row>=R", "track_slot", "dup slots", "dup tracks", "on a slot",
       "track after accepted", "track without accepted"]


@pytest.mark.parametrize("change,message", VIOLATIONS, ids=IDS)
def test_violation_raises_eagerly_and_is_skipped_unchecked(problem, change, message):
    pool, tuples, _, idx = problem
    args = _args(idx, change)
    gl.commit(pool, tuples, **args)  # unchecked: the masking rules skip it, no error
    with pytest.raises(checkify.JaxRuntimeError, match=r"commit \(checked\): " + message):
        gl.commit(pool, tuples, **args, checked=True)


def test_under_jit_with_checkify(problem):
    pool, tuples, snapshots, idx = problem
    step = jax.jit(functools.partial(gl.commit, checked=True))
    checked_step = checkify.checkify(step)
    good = _args(idx)
    for tape in (tuples, snapshots):
        err, got = checked_step(pool, tape, **good)
        err.throw()  # valid indices: no error
        assert_bitwise_equal(gl.commit(pool, tape, **good), got, "checked == unchecked on valid indices")
    for change, message in VIOLATIONS:
        err, _ = checked_step(pool, tuples, **_args(idx, change))
        assert err.get() is not None and "request" in err.get()
        with pytest.raises(checkify.JaxRuntimeError, match=message):
            err.throw()
    # Control: without checkify, JAX refuses to stage the check (not a silent skip).
    with pytest.raises(ValueError, match="not functionalized"):
        step(pool, tuples, **good)


def test_replay_checked(problem, seed):
    _, tuples, _, _ = problem
    state0 = jnp.asarray(np.random.default_rng(seed).standard_normal((SHAPE.N, SHAPE.HV, SHAPE.V, SHAPE.K)), F32)
    tape = jax.tree.map(lambda t: t[0], tuples)
    lengths = jnp.asarray([1, 3, 0, 2], jnp.int32)  # accepted lengths, the trap
    gl.replay(state0, tape, lengths)  # unchecked: silently one step off, state0 for request 1
    message = r"replay \(checked\): request 1: steps\[1\] = 3 = D.*length n is step n - 1"
    with pytest.raises(checkify.JaxRuntimeError, match=message):
        gl.replay(state0, tape, lengths, checked=True)
    assert_bitwise_equal(gl.replay(state0, tape, lengths - 1), gl.replay(state0, tape, lengths - 1, checked=True))


def test_pool_commit_checked(seed):
    g = gl.get_geometry("qwen3.6-35b-a3b").reduced(gdn_layers=1, heads_divisor=16, head_dim=8)
    p = gl.pool.allocate(g, slots=6, requests=2, drafts=2, record="tuples")
    slots, steps = jnp.asarray([0, 3], jnp.int32), jnp.asarray([1, 2], jnp.int32)  # 2 = D: a length
    with pytest.raises(checkify.JaxRuntimeError, match=r"pool.commit \(checked\): request 1: steps\[1\] = 2 = D"):
        gl.pool.commit(p, slots, steps, checked=True)
    # The check runs before the pool is donated: it is still usable.
    p = gl.pool.commit(p, slots, steps - 1, checked=True)
    with pytest.raises(checkify.JaxRuntimeError, match=r"requests 0 and 1 have the same slot 6"):
        gl.pool.commit(p, jnp.asarray([6, 6], jnp.int32), steps - 1, checked=True)  # two padding requests
