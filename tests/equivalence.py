"""The shared equivalence suite: one set of checks, run against every backend.

A *case* is a pool of L layers, N requests with commit indices (accepted steps, track
copies, a rows mapping, optionally invalid rows), and both tapes from verify. The checks:

* verify outputs are bit-identical between the two record modes;
* replaying every step from the tuples gives the snapshot of that step, bit for bit;
* a tuple commit and a snapshot commit leave every pool slot bit-identical;
* slots nobody may write (invalid rows, negative steps) keep their bits;
* the controls (naive replay forms, the accepted-first ordering) are caught.

Backends are compared against their *own* snapshot path; the reference is compared with
every backend elsewhere (cross-backend tests).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import gdn_lossless_jax as gl
from gdn_lossless_jax import backends, fuzz, reference, rounding
from gdn_lossless_jax.cases import CommitIndices, Shape, commit_indices, verify_inputs
from gdn_lossless_jax.testing import assert_bitwise_differs, assert_bitwise_equal


@dataclasses.dataclass
class Case:
    backend: str
    shape: Shape
    L: int
    pool: jax.Array
    idx: CommitIndices
    outputs_tuples: list
    outputs_snapshots: list
    tuples: gl.Tuples  # [L, R, ...]
    snapshots: gl.Snapshots  # [L, R, ...]
    states0: list  # per layer [N, HV, V, K], what verify started from


def _place_rows(buf, rows, values):
    """buf[:, rows[i]] = values[:, i] for rows in range (filler elsewhere)."""
    R = buf.shape[1]
    ok = (rows >= 0) & (rows < R)
    return buf.at[:, np.where(ok, rows, R)].set(values, mode="drop")


def make_case(
    backend: str,
    seed: int,
    shape: Shape,
    *,
    L: int = 2,
    state_dtype=jnp.float32,
    kind: str = "mixed",
    invalid: bool = True,
    permute_rows: bool = True,
    extra_rows: int = 2,
) -> Case:
    N, D = shape.N, shape.D
    S = 2 * N + 3
    R = N + extra_rows
    rng = np.random.default_rng(seed)
    normal = lambda *shp: rng.standard_normal(shp, dtype=np.float32)  # noqa: E731
    pool = jnp.asarray(0.5 * normal(L, S, shape.HV, shape.V, shape.K)).astype(state_dtype)
    idx = commit_indices(seed, N=N, D=D, slots_in_pool=S, rows_in_tape=R, invalid=invalid, permute_rows=permute_rows)
    slot_safe = np.clip(idx.slots, 0, S - 1)

    # Filler rows are random (never zeros), so a read from the wrong row shows.
    tup_buf = gl.Tuples(
        u=jnp.asarray(normal(L, R, D, shape.HV, shape.V)),
        k=jnp.asarray(normal(L, R, D, shape.H, shape.K)),
        g=jnp.asarray(-np.abs(normal(L, R, D, shape.HV))),
    )
    snp_buf = gl.Snapshots(jnp.asarray(normal(L, R, D, shape.HV, shape.V, shape.K)).astype(state_dtype))

    outs_t, outs_s, tups, snps, states0 = [], [], [], [], []
    for layer in range(L):
        x = verify_inputs(rng, shape, kind=kind, state_dtype=state_dtype)
        x["state0"] = pool[layer, slot_safe]
        o_t, t = gl.verify(**x, record="tuples", backend=backend)
        o_s, s = gl.verify(**x, record="snapshots", backend=backend)
        outs_t.append(o_t)
        outs_s.append(o_s)
        tups.append(t)
        snps.append(s)
        states0.append(x["state0"])
    stack = lambda xs: jax.tree.map(lambda *a: jnp.stack(a), *xs)  # noqa: E731
    tup = jax.tree.map(lambda buf, v: _place_rows(buf, idx.rows, v), tup_buf, stack(tups))
    snp = jax.tree.map(lambda buf, v: _place_rows(buf, idx.rows, v), snp_buf, stack(snps))
    return Case(backend, shape, L, pool, idx, outs_t, outs_s, tup, snp, states0)


def layer_tapes(case: Case, layer: int):
    """The tapes of one layer, rows mapped back to request order ``[N, ...]`` (valid rows only)."""
    rows = np.clip(case.idx.rows, 0, case.tuples.u.shape[1] - 1)
    pick = lambda t: t[layer, rows]  # noqa: E731
    return jax.tree.map(pick, case.tuples), jax.tree.map(pick, case.snapshots)


def check_outputs(case: Case):
    for layer in range(case.L):
        assert_bitwise_equal(case.outputs_snapshots[layer], case.outputs_tuples[layer], f"outputs, layer {layer}")


def check_replay_every_step(case: Case, steps=None, layers=None):
    """Replay each step (default: -1 and every draft step) in one call per layer."""
    steps = np.arange(-1, case.shape.D) if steps is None else np.asarray(steps)
    valid_rows = (case.idx.rows >= 0) & (case.idx.rows < case.tuples.u.shape[1])
    N = case.shape.N
    for layer in range(case.L) if layers is None else layers:
        tup, snp = layer_tapes(case, layer)
        s0 = case.states0[layer]
        tile = lambda t: jnp.concatenate([t] * len(steps))  # noqa: E731
        got = gl.replay(tile(s0), jax.tree.map(tile, tup), jnp.asarray(np.repeat(steps, N), jnp.int32), backend=case.backend)
        for j, step in enumerate(steps):
            want = s0 if step < 0 else snp.states[:, step]
            assert_bitwise_equal(
                np.asarray(want)[valid_rows], np.asarray(got[j * N : (j + 1) * N])[valid_rows], f"layer {layer} step {step}"
            )


def commit_both(case: Case, commit=None):
    """The pool after the tuple commit and after the snapshot commit of the case. ``commit``
    (``(pool, tape, *indices) -> pool``, e.g. a backend's commit with a launch config) defaults
    to ``gdn_lossless_jax.commit`` on the case's backend."""
    commit = commit or functools.partial(gl.commit, backend=case.backend)
    args = case.idx.as_args()
    return commit(case.pool, case.tuples, *args), commit(case.pool, case.snapshots, *args)


def request_writes(case: Case, n: int) -> tuple[int | None, int | None]:
    """(accepted slot, track slot) request n may write by the masking rules, or None."""
    return fuzz.request_writes(case.idx, n, S=case.pool.shape[1], R=case.tuples.u.shape[1], D=case.shape.D)


def written_slots(case: Case) -> tuple[set, set]:
    """(accepted slots, track slots) that the masking rules allow to be written."""
    writes = [request_writes(case, n) for n in range(case.shape.N)]
    return {a for a, _ in writes if a is not None}, {t for _, t in writes if t is not None}


def check_commit(case: Case, commit=None):
    """Tuple commit == snapshot commit == the writes SPEC section 4 expects; untouched slots keep
    their bits. Returns the pool after the tuple commit (for a control to compare with)."""
    by_tuples, by_snapshots = commit_both(case, commit)
    assert_bitwise_equal(by_snapshots, by_tuples, "pool after tuple commit vs snapshot commit")
    # Against an expectation built by hand from the snapshots.
    expected = fuzz.expected_pool(np.asarray(case.pool), np.asarray(case.snapshots.states), case.idx)
    assert_bitwise_equal(expected, by_tuples, "pool after tuple commit vs expected")
    acc, trk = written_slots(case)
    untouched = np.array([s not in acc | trk for s in range(expected.shape[1])])
    assert untouched.any() and trk, "the case must leave slots untouched and exercise a track copy"
    assert_bitwise_equal(np.asarray(case.pool)[:, untouched], np.asarray(by_tuples)[:, untouched], "untouched slots")
    return by_tuples


def naive_replays(backend: str) -> dict:
    """The control replay forms of a backend: ``name -> (state0, tuples, steps) -> states``."""
    if backend == "reference":
        return {
            name: jax.jit(lambda s, t, st, form=form: reference.replay(s, t, st, rule=form))
            for name, form in rounding.FORMS.items()
            if name != "rule"
        }
    module = backends.resolve(backend, "replay")
    return {f"{form} (in kernel)": functools.partial(module.replay, form=form) for form in module.CONTROL_FORMS}


def commit_accepted_first(case: Case):
    """Control: the seed's ordering, through the backend's own commit (two launches)."""
    slots, steps, tslots, tsteps, rows = case.idx.as_args()
    none = jnp.full_like(steps, -1)
    pool = gl.commit(case.pool, case.tuples, slots, steps, none, none, rows, backend=case.backend)
    return gl.commit(pool, case.tuples, slots, none, tslots, tsteps, rows, backend=case.backend)


def check_controls(case: Case):
    """The suite must catch a naive replay form and the accepted-first ordering."""
    tup, snp = layer_tapes(case, 0)
    s0 = case.states0[0]
    last = jnp.full((case.shape.N,), case.shape.D - 1, jnp.int32)
    valid_rows = (case.idx.rows >= 0) & (case.idx.rows < case.tuples.u.shape[1])
    want = np.asarray(snp.states[:, -1])[valid_rows]
    controls = naive_replays(case.backend)
    assert controls, f"backend {case.backend!r} has no control form"
    for name, replay in controls.items():
        got = replay(s0, tup, last)
        report = assert_bitwise_differs(want, np.asarray(got)[valid_rows], f"control {name}")
        assert report.max_ulp >= 1
    wrong = commit_accepted_first(case)
    right, _ = commit_both(case)
    _, trk = written_slots(case)
    trk = sorted(trk)
    assert_bitwise_differs(np.asarray(right)[:, trk], np.asarray(wrong)[:, trk], "accepted-first track state")
