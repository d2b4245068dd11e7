"""The shared equivalence suite: one set of checks, run against every backend (yours too).

A *case* is a pool of L layers, N requests with commit indices (accepted steps, track
copies, a rows mapping, invalid rows), and both tapes from verify. The checks:

* verify outputs are bit-identical between the two record modes;
* replaying every step from the tuples gives the snapshot of that step, bit for bit;
* a tuple commit and a snapshot commit leave every pool slot bit-identical, and equal to
  the writes the masking rules expect;
* slots nobody may write (invalid rows, negative steps) keep their bits;
* the controls (wrong replay forms, the accepted-first ordering) are caught.

Backends are compared against their *own* snapshot path: the suite holds a backend to
the rule, not to another backend's ``exp``. To check a backend of your own (an object
implementing :class:`gdn_lossless_jax.backends.contract.Backend`)::

    from gdn_lossless_jax.testing import run_equivalence_suite
    run_equivalence_suite(my_backend)  # raises AssertionError, naming the case and check

The building blocks (:func:`make_case`, :func:`check_outputs`,
:func:`check_replay_every_step`, :func:`check_commit`, :func:`check_controls`) are the
ones this library's own tests parametrize over backends and geometries.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import api, backends, reference
from . import controls
from . import expect
from .cases import CommitIndices, Shape, channel_verify_inputs, commit_indices, verify_inputs
from ..tape import KDATuples, Snapshots, Tuples, stack_tapes
from .asserts import assert_bitwise_differs, assert_bitwise_equal

__all__ = [
    "Case",
    "DEFAULT_SHAPES",
    "make_case",
    "check_outputs",
    "check_replay_every_step",
    "check_commit",
    "check_controls",
    "run_equivalence_suite",
]


@dataclasses.dataclass
class Case:
    """One problem of the suite, with both tapes recorded by ``backend``."""

    backend: Any  # a name or a backend object
    shape: Shape
    L: int
    pool: jax.Array
    idx: CommitIndices
    outputs_tuples: list
    outputs_snapshots: list
    tuples: Tuples  # [L, R, ...] (a KDATuples for decay="channel")
    snapshots: Snapshots  # [L, R, ...]
    states0: list  # per layer [N, HV, V, K], what verify started from


def _place_rows(buf, rows, values):
    """buf[:, rows[i]] = values[:, i] for rows in range (filler elsewhere)."""
    R = buf.shape[1]
    ok = (rows >= 0) & (rows < R)
    return buf.at[:, np.where(ok, rows, R)].set(values, mode="drop")


def make_case(
    backend,
    seed: int,
    shape: Shape,
    *,
    L: int = 2,
    state_dtype=jnp.float32,
    kind: str = "mixed",
    invalid: bool = True,
    permute_rows: bool = True,
    extra_rows: int = 2,
    decay: str = "scalar",
) -> Case:
    """A case of ``backend``'s tapes (``decay="channel"``: KDA layers, a per-channel decay, the
    inputs of :func:`~gdn_lossless_jax.testing.cases.channel_verify_inputs` and a
    :class:`~gdn_lossless_jax.tape.KDATuples` tape)."""
    N, D = shape.N, shape.D
    channel = decay == "channel"
    S = 2 * N + 3
    R = N + extra_rows
    rng = np.random.default_rng(seed)
    normal = lambda *shp: rng.standard_normal(shp, dtype=np.float32)  # noqa: E731
    pool = jnp.asarray(0.5 * normal(L, S, shape.HV, shape.V, shape.K)).astype(state_dtype)
    idx = commit_indices(seed, N=N, D=D, slots_in_pool=S, rows_in_tape=R, invalid=invalid, permute_rows=permute_rows)
    slot_safe = np.clip(idx.slots, 0, S - 1)

    # Filler rows are random (never zeros), so a read from the wrong row shows.
    tup_buf = (KDATuples if channel else Tuples)(
        u=jnp.asarray(normal(L, R, D, shape.HV, shape.V)),
        k=jnp.asarray(normal(L, R, D, shape.H, shape.K)),
        g=jnp.asarray(-np.abs(normal(L, R, D, shape.HV, *((shape.K,) if channel else ())))),
    )
    snp_buf = Snapshots(jnp.asarray(normal(L, R, D, shape.HV, shape.V, shape.K)).astype(state_dtype))

    outs_t, outs_s, tups, snps, states0 = [], [], [], [], []
    for layer in range(L):
        x = (channel_verify_inputs if channel else verify_inputs)(rng, shape, kind=kind, state_dtype=state_dtype)
        x["state0"] = pool[layer, slot_safe]
        o_t, t = api.verify(**x, record="tuples", backend=backend, decay=decay)
        o_s, s = api.verify(**x, record="snapshots", backend=backend, decay=decay)
        outs_t.append(o_t)
        outs_s.append(o_s)
        tups.append(t)
        snps.append(s)
        states0.append(x["state0"])
    tup = jax.tree.map(lambda buf, v: _place_rows(buf, idx.rows, v), tup_buf, stack_tapes(tups))
    snp = jax.tree.map(lambda buf, v: _place_rows(buf, idx.rows, v), snp_buf, stack_tapes(snps))
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
        got = api.replay(tile(s0), jax.tree.map(tile, tup), jnp.asarray(np.repeat(steps, N), jnp.int32), backend=case.backend)
        for j, step in enumerate(steps):
            want = s0 if step < 0 else snp.states[:, step]
            assert_bitwise_equal(
                np.asarray(want)[valid_rows], np.asarray(got[j * N : (j + 1) * N])[valid_rows], f"layer {layer} step {step}"
            )


def commit_both(case: Case, commit=None):
    """The pool after the tuple commit and after the snapshot commit of the case. ``commit``
    (``(pool, tape, *indices) -> pool``, e.g. a backend's commit with a launch config) defaults
    to ``gdn_lossless_jax.commit`` on the case's backend."""
    commit = commit or functools.partial(api.commit, backend=case.backend)
    args = case.idx.as_args()
    return commit(case.pool, case.tuples, *args), commit(case.pool, case.snapshots, *args)


def request_writes(case: Case, n: int) -> tuple[int | None, int | None]:
    """(accepted slot, track slot) request n may write by the masking rules, or None."""
    return expect.request_writes(case.idx, n, S=case.pool.shape[1], R=case.tuples.u.shape[1], D=case.shape.D)


def written_slots(case: Case) -> tuple[set, set]:
    """(accepted slots, track slots) that the masking rules allow to be written."""
    writes = [request_writes(case, n) for n in range(case.shape.N)]
    return {a for a, _ in writes if a is not None}, {t for _, t in writes if t is not None}


def check_commit(case: Case, commit=None):
    """Tuple commit == snapshot commit == the writes the masking rules expect; untouched slots
    keep their bits. Returns the pool after the tuple commit (for a control to compare with)."""
    by_tuples, by_snapshots = commit_both(case, commit)
    assert_bitwise_equal(by_snapshots, by_tuples, "pool after tuple commit vs snapshot commit")
    # Against an expectation built by hand from the snapshots.
    expected = expect.expected_pool(np.asarray(case.pool), np.asarray(case.snapshots.states), case.idx)
    assert_bitwise_equal(expected, by_tuples, "pool after tuple commit vs expected")
    acc, trk = written_slots(case)
    untouched = np.array([s not in acc | trk for s in range(expected.shape[1])])
    assert untouched.any() and trk, "the case must leave slots untouched and exercise a track copy"
    assert_bitwise_equal(np.asarray(case.pool)[:, untouched], np.asarray(by_tuples)[:, untouched], "untouched slots")
    return by_tuples


def control_replays(backend) -> dict:
    """The control replay forms of a backend: ``name -> (state0, tuples, steps) -> states``.

    The reference's are :data:`gdn_lossless_jax.testing.controls.CONTROLS` (wrong by
    construction); a kernel backend declares its in-kernel controls in
    ``capabilities.control_forms`` (its ``replay`` takes ``form=``); none otherwise.
    """
    if backend == "reference":
        return {
            name: jax.jit(lambda s, t, st, form=form: reference.replay(s, t, st, rule=form))
            for name, form in controls.CONTROLS.items()
        }
    module = backends.resolve(backend, "replay")
    forms = module.capabilities.control_forms
    return {f"{form} (in kernel)": functools.partial(module.replay, form=form) for form in forms}


def naive_replays(backend) -> dict:
    """Deprecated alias of :func:`control_replays` (kept for one release)."""
    import warnings

    warnings.warn("naive_replays is deprecated: use control_replays (the controls are wrong by construction)",
                  DeprecationWarning, stacklevel=2)  # fmt: skip
    return control_replays(backend)


def commit_accepted_first(case: Case):
    """Control: the seed's ordering, through the backend's own commit (two launches)."""
    slots, steps, tslots, tsteps, rows = case.idx.as_args()
    none = jnp.full_like(steps, -1)
    pool = api.commit(case.pool, case.tuples, slots, steps, none, none, rows, backend=case.backend)
    return api.commit(pool, case.tuples, slots, none, tslots, tsteps, rows, backend=case.backend)


def check_controls(case: Case, require_forms: bool = True):
    """The suite must catch the control replay forms and the accepted-first ordering.

    ``require_forms=False`` lets a backend without control forms (:func:`control_replays`)
    through with the ordering control alone.
    """
    tup, snp = layer_tapes(case, 0)
    s0 = case.states0[0]
    last = jnp.full((case.shape.N,), case.shape.D - 1, jnp.int32)
    valid_rows = (case.idx.rows >= 0) & (case.idx.rows < case.tuples.u.shape[1])
    want = np.asarray(snp.states[:, -1])[valid_rows]
    controls = control_replays(case.backend)
    assert controls or not require_forms, f"backend {case.backend!r} has no control form"
    for name, replay in controls.items():
        got = replay(s0, tup, last)
        report = assert_bitwise_differs(want, np.asarray(got)[valid_rows], f"control {name}")
        assert report.max_ulp >= 1
    wrong = commit_accepted_first(case)
    right, _ = commit_both(case)
    _, trk = written_slots(case)
    trk = sorted(trk)
    assert_bitwise_differs(np.asarray(right)[:, trk], np.asarray(wrong)[:, trk], "accepted-first track state")


#: The geometries :func:`run_equivalence_suite` checks by default: grouped heads (2 and 4
#: v-heads per q/k head) and H == HV, one request of one step, and N = 5, which exercises
#: every masking rule (a negative step, an out-of-range slot, row and track slot).
DEFAULT_SHAPES: tuple[Shape, ...] = (
    Shape(N=5, D=4, H=2, HV=4, K=16, V=16),
    Shape(N=1, D=1, H=4, HV=16, K=8, V=16),
    Shape(N=5, D=3, H=8, HV=8, K=8, V=8),
)


def run_equivalence_suite(
    backend,
    *,
    shapes: Sequence[Shape] = DEFAULT_SHAPES,
    state_dtypes: Sequence[Any] = (jnp.float32, jnp.bfloat16),
    kinds: Sequence[str] = ("mixed",),
    seed: int = 0,
    layers: int = 2,
    controls: bool = True,
    log: Callable[[str], None] | None = None,
) -> list[str]:
    """Run the shared equivalence suite against ``backend``.

    For every shape, state dtype and input kind (:data:`gdn_lossless_jax.cases.KINDS`;
    "mixed" gives each request another adversarial kind), a case of ``layers`` layers is
    recorded in both modes and checked: outputs identical across record modes, every
    step's replay equal to its snapshot, tuple commit equal to snapshot commit and to the
    expected writes, untouched and skipped slots keeping their bits. With ``controls``,
    one fp32 case also checks that the suite catches the backend's control replay forms (its
    ``capabilities.control_forms``) and the accepted-first ordering through its commit.

    Args:
      backend: a backend name (``"reference"``, ``"pallas"``, ``"triton"``) or an object
        implementing :class:`gdn_lossless_jax.backends.contract.Backend`.
      shapes: :class:`gdn_lossless_jax.cases.Shape` problems (``N >= 5`` exercises every
        masking rule); state_dtypes: float32 and/or bfloat16 pools.
      seed: the inputs' seed; log: called with one line per case checked (e.g. ``print``).
    Returns:
      The names of the cases that passed.
    Raises:
      AssertionError: at the first failing case, naming it and the check (the bitwise
        report: leaf, index, both values and the ULP distance).
    """
    passed = []
    for n, (shape, dtype, kind) in enumerate(itertools.product(shapes, state_dtypes, kinds)):
        s = shape
        name = f"{kind} N={s.N} D={s.D} H={s.H} HV={s.HV} K={s.K} V={s.V} {jnp.dtype(dtype).name}"
        try:
            case = make_case(backend, seed + n, shape, L=layers, state_dtype=dtype, kind=kind)
            check_outputs(case)
            check_replay_every_step(case)
            check_commit(case)
        except AssertionError as e:
            raise AssertionError(f"equivalence suite, case {name}: {e}") from e
        passed.append(name)
        if log:
            log(f"ok  {name}")
    if controls:
        # fp32: a bf16 pool can round a 1-ULP drift of a control form away.
        name = "controls (wrong replay forms, accepted-first ordering) float32"
        case = make_case(backend, seed, Shape(N=4, D=4, H=2, HV=4, K=32, V=32), L=layers, state_dtype=jnp.float32)
        try:
            check_controls(case, require_forms=False)
        except AssertionError as e:
            raise AssertionError(f"equivalence suite, {name}: {e}") from e
        passed.append(name)
        if log:
            log(f"ok  {name}")
    return passed
