"""Resource errors: a pool that cannot fit fails in allocate before anything is allocated; a tape
from another geometry, record mode or pool is rejected by commit (gl.commit and pool.commit)."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdn_lossless_jax as gl
from gdn_lossless_jax import pool as P
from gdn_lossless_jax.config import get_geometry

# Reduced Qwen3.6-35B-A3B: L=2, H=2, HV=4, K=V=16.
BASE = get_geometry("qwen3.6-35b-a3b").reduced(gdn_layers=2, heads_divisor=8, head_dim=16)
SIZES = dict(slots=4, requests=2, drafts=3)


def _live_bytes() -> int:
    return sum(x.nbytes for x in jax.live_arrays())


def test_allocate_too_large_for_the_free_bytes_given():
    need = P.allocate(BASE, **SIZES).nbytes
    P.allocate(BASE, **SIZES, free_bytes=need)  # exactly fits
    live = _live_bytes()
    with pytest.raises(MemoryError) as e:
        P.allocate(BASE, **SIZES, free_bytes=need - 1)
    msg = str(e.value)
    assert msg.startswith(f"allocate: the pool needs {need:,} bytes (")
    assert f"but {need - 1:,} bytes" in msg and "are free (the free_bytes argument); nothing was allocated" in msg
    for part in ("ssm", "conv", "tape", "conv_windows"):
        assert re.search(rf"{part} [\d.,]+ (B|KiB)", msg), part
    assert _live_bytes() == live, "a rejected pool allocates nothing"


def test_allocate_too_large_for_the_device():
    """No injection: the default device's free memory decides (on the CPU the host's
    MemAvailable), before any array exists."""
    free, where = P.device_free_bytes()
    assert free > 0
    if jax.default_backend() == "cpu":
        assert where == "on the host of cpu:0 (MemAvailable)"
    where = re.sub(r"\d[\d,]*", r"[\\d,]+", re.escape(where))  # bytes in use move on a GPU
    live = _live_bytes()
    g = get_geometry("qwen3.8-27b")
    with pytest.raises(MemoryError, match=r"allocate: the pool needs 196,952,260,952,064 bytes \(179\.13 TiB: ssm .*"
                       rf"bytes \([\d.,]+ [KMGT]iB\) are free {where}; nothing was allocated"):
        P.allocate(g, slots=10**6, requests=10**6, drafts=16)
    assert _live_bytes() == live


def test_device_free_bytes_from_memory_stats():
    """An accelerator: the allocator's limit less its bytes in use."""

    class FakeGpu:
        platform = "gpu"

        def memory_stats(self):
            return {"bytes_limit": 100_000, "bytes_in_use": 30_000}

        def __str__(self):
            return "cuda:0"

    class Silent(FakeGpu):
        def memory_stats(self):
            return None

    assert P.device_free_bytes(FakeGpu()) == (70_000, "on device cuda:0 (bytes_limit 100,000 - bytes_in_use 30,000)")
    assert P.device_free_bytes(Silent()) == (None, "on device cuda:0 (free memory unknown)")


# ---------------------------------------------------------------------------------
# Tapes from another geometry, record mode or pool.
# ---------------------------------------------------------------------------------
OTHER = {
    "L": dict(gdn_layers=3),
    "HV": dict(num_v_heads=8),
    "K": dict(head_k_dim=32),
    "V": dict(head_v_dim=8),
}
IDX = (jnp.zeros((2,), jnp.int32), jnp.zeros((2,), jnp.int32))


def _pool(record="tuples", geometry=BASE, state_dtype=jnp.float32, **sizes):
    return P.allocate(geometry, **{**SIZES, **sizes}, record=record, state_dtype=state_dtype)


@pytest.mark.parametrize("record", ["tuples", "snapshots"])
@pytest.mark.parametrize("what", list(OTHER))
def test_commit_rejects_a_tape_of_another_geometry(record, what):
    other = _pool(record, dataclasses.replace(BASE, **OTHER[what])).tape
    field = {"tuples": "tape.k" if what == "K" else "tape.u", "snapshots": "tape.states"}[record]
    with pytest.raises(ValueError, match=rf"commit: argument '{field}' must have shape \[L, R, D, .*\] = \[2, 3, 3, .*got"):
        gl.commit(_pool(record).ssm, other, *IDX)
    pl = _pool(record)
    with pytest.raises(ValueError, match=rf"commit: the pool's {field} is float32 \[.*\], but a {record} pool of "
                       r"'Qwen3.5/3.6-35B-A3B \(reduced\)' \(L=2, H=2, HV=4, K=16, V=16\) with 4 slots, 3 scratch rows "
                       r"and D=3 \(from its conv windows\) has float32 \[2, 3, 3, .*\]: it was recorded for another "
                       r"geometry, record mode or pool"):
        P.commit(dataclasses.replace(pl, tape=other), *IDX)
    assert not pl.ssm.is_deleted(), "a rejected commit donates nothing"


def test_pool_commit_rejects_other_k_heads():
    """Only the pool knows H: a tuple tape with other k heads (dividing HV) passes gl.commit,
    which replays it with the heads it has, and is rejected by pool.commit."""
    other = _pool("tuples", dataclasses.replace(BASE, num_k_heads=4)).tape
    gl.commit(_pool().ssm, other, *IDX)
    with pytest.raises(ValueError, match=r"the pool's tape.k is float32 \[2, 3, 3, 4, 16\], but a tuples pool .* has "
                       r"float32 \[2, 3, 3, 2, 16\]"):
        P.commit(dataclasses.replace(_pool(), tape=other), *IDX)


@pytest.mark.parametrize("record", ["tuples", "snapshots"])
@pytest.mark.parametrize("sizes, dim", [(dict(drafts=5), "D"), (dict(requests=4), "R")])
def test_pool_commit_rejects_a_tape_of_another_pool(record, sizes, dim):
    """Another D or row count than the conv windows': the SSM and conv commits would mask
    different steps or rows."""
    other = _pool(record, **sizes).tape
    field = "tape.u" if record == "tuples" else "tape.states"
    with pytest.raises(ValueError, match=rf"the pool's {field} is .* with 4 slots, 3 scratch rows and D=3 .*another"):
        P.commit(dataclasses.replace(_pool(record), tape=other), *IDX)


def test_commit_rejects_a_tape_of_another_record_mode_or_dtype():
    # A snapshot tape from a bf16 pool, into an fp32 pool.
    bf16 = _pool("snapshots", state_dtype=jnp.bfloat16).tape
    with pytest.raises(TypeError, match=r"commit: snapshot dtype bfloat16 must match the pool dtype float32"):
        gl.commit(_pool("snapshots").ssm, bf16, *IDX)
    with pytest.raises(ValueError, match=r"the pool's tape.states is bfloat16 \[2, 3, 3, 4, 16, 16\], but a snapshots "
                       r"pool .* has float32 \[2, 3, 3, 4, 16, 16\]"):
        P.commit(dataclasses.replace(_pool("snapshots"), tape=bf16), *IDX)
    # A tuple tape is always fp32.
    tup = _pool().tape
    with pytest.raises(TypeError, match=r"commit: argument 'tape.u' must be float32 \(the tape is always fp32\), got bfloat16"):
        gl.commit(_pool().ssm, dataclasses.replace(tup, u=tup.u.astype(jnp.bfloat16)), *IDX)
    # One layer's tape from verify, not stacked over layers.
    for t, field, rank in ((tup, "u", 5), (_pool("snapshots").tape, "states", 6)):
        layer = jax.tree.map(lambda x: x[0], t)
        with pytest.raises(ValueError, match=rf"commit: argument 'tape.{field}' must have rank {rank}"):
            gl.commit(_pool().ssm, layer, *IDX)
    with pytest.raises(TypeError, match=r"commit: tape must be one of Tuples, Snapshots, KDATuples, got ArrayImpl"):
        gl.commit(_pool().ssm, _pool("snapshots").tape.states, *IDX)


def test_commit_accepts_its_own_tapes():
    """The checks pass what allocate and verify give (both record modes, both dtypes)."""
    for record in ("tuples", "snapshots"):
        for dtype in (jnp.float32, jnp.bfloat16):
            pl = _pool(record, state_dtype=dtype)
            out = P.commit(pl, *IDX)
            assert np.asarray(out.ssm).dtype == np.dtype(dtype)
