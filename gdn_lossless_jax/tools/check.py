"""The bit-exactness run: verify and commit in both record modes on a model geometry.

This is the README's main job (``gdn-lossless check``). For every GDN layer it runs
verify in both record modes from the same pool, commits both tapes, and reports whether
every output and every pool slot matched bit for bit, how far the naive replay forms drift
from the pinned rule (in ULP), and the scratch bytes of both modes.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .. import api, reference
from ..testing import controls
from ..testing import asserts as testing
from ..testing.cases import Shape, commit_indices, verify_inputs
from ..config import Geometry
from ..tape import Snapshots, Tuples

__all__ = ["CheckResult", "run_check"]


@dataclasses.dataclass
class CheckResult:
    """What :func:`run_check` found.

    ``naive_ulp`` maps each naive form of :data:`gdn_lossless_jax.testing.controls.FORMS` to
    :func:`gdn_lossless_jax.testing.ulp_stats` of its replay against the pinned rule, in ULP of
    the pool's ``state_dtype`` (a bfloat16 pool counts bfloat16 ULP). ``scratch_bytes`` holds
    the bytes of both stacked tapes.
    """

    geometry: Geometry
    shape: Shape
    state_dtype: str
    backend: str
    outputs_equal: bool
    pool_equal: bool
    replay_equal: bool
    untouched_equal: bool
    naive_ulp: dict[str, dict]
    scratch_bytes: dict[str, int]
    seconds: float

    @property
    def ok(self) -> bool:
        return self.outputs_equal and self.pool_equal and self.replay_equal and self.untouched_equal


def _default_progress(i: int, n: int, what: str) -> None:
    print(f"  [{i}/{n}] {what}", file=sys.stderr, flush=True)


def run_check(
    geometry: Geometry,
    *,
    requests: int = 4,
    drafts: int = 4,
    state_dtype=jnp.float32,
    kind: str = "mixed",
    seed: int = 0,
    backend: str = "auto",
    progress: Callable[[int, int, str], None] | None = _default_progress,
) -> CheckResult:
    """Run the check on ``geometry`` (use ``Geometry.reduced`` for a CPU-sized run)."""
    t0 = time.perf_counter()
    g = geometry
    L, N, D = g.gdn_layers, requests, drafts
    shape = Shape.of(g, N, D)
    S = 2 * N + 3
    rng = np.random.default_rng(seed)
    pool = jnp.asarray(0.5 * rng.standard_normal((L, S, g.num_v_heads, g.head_v_dim, g.head_k_dim), np.float32))
    pool = pool.astype(state_dtype)
    idx = commit_indices(seed, N=N, D=D, slots_in_pool=S, invalid=N >= 5)
    slot_safe = np.clip(idx.slots, 0, S - 1)

    outs_equal = True
    tuples, snaps = [], []
    steps_total = L + 3
    for layer in range(L):
        x = verify_inputs(rng, shape, kind=kind, state_dtype=state_dtype)
        x["state0"] = pool[layer, slot_safe]
        o_t, tape_t = api.verify(**x, record="tuples", backend=backend)
        o_s, tape_s = api.verify(**x, record="snapshots", backend=backend)
        outs_equal &= testing.compare_bitwise(o_s, o_t).equal
        tuples.append(tape_t)
        snaps.append(tape_s)
        if progress:
            progress(layer + 1, steps_total, f"layer {layer}: verify (tuples, snapshots)")
    tup = jax.tree.map(lambda *xs: jnp.stack(xs), *tuples)
    snp = jax.tree.map(lambda *xs: jnp.stack(xs), *snaps)

    args = idx.as_args()
    pool_t = api.commit(pool, tup, *args, backend=backend)
    pool_s = api.commit(pool, snp, *args, backend=backend)
    pool_equal = testing.compare_bitwise(pool_s, pool_t).equal
    if progress:
        progress(L + 1, steps_total, "commit (replay vs gather-scatter)")

    # Slots no request may write must keep their bits.
    written = set()
    for i in range(N):
        if 0 <= idx.slots[i] < S and 0 <= idx.rows[i] < N:
            if 0 <= idx.steps[i] < D:
                written.add(int(idx.slots[i]))
            if 0 <= idx.track_steps[i] < D and 0 <= idx.track_slots[i] < S:
                written.add(int(idx.track_slots[i]))
    keep = np.array([s not in written for s in range(S)])
    untouched_equal = testing.compare_bitwise(np.asarray(pool)[:, keep], np.asarray(pool_t)[:, keep]).equal

    # Replay every step of layer 0 and compare with its snapshots; then the naive forms.
    state0 = pool[0, slot_safe]
    t0_tape = jax.tree.map(lambda t: t[0], tup)
    replay_equal = True
    for step in range(D):
        steps = jnp.full((N,), step, jnp.int32)
        replay_equal &= testing.compare_bitwise(snp.states[0, :, step], api.replay(state0, t0_tape, steps, backend=backend)).equal
    if progress:
        progress(L + 2, steps_total, "replay per step")
    last = jnp.full((N,), D - 1, jnp.int32)
    pinned = reference.replay(state0, t0_tape, last)
    naive_ulp = {}
    for name, form in controls.FORMS.items():
        if name == "rule":
            continue
        got = jax.jit(lambda s, t, st, f=form: reference.replay(s, t, st, rule=f))(state0, t0_tape, last)
        # In the pool's own dtype: one bf16 ULP is one ULP here, not the 65536 fp32 ULP it spans.
        naive_ulp[name] = testing.ulp_stats(pinned, got)
    if progress:
        progress(L + 3, steps_total, "naive forms")

    scratch = {
        "snapshots": int(sum(x.nbytes for x in jax.tree.leaves(Snapshots(snp.states)))),
        "tuples": int(sum(x.nbytes for x in jax.tree.leaves(Tuples(tup.u, tup.k, tup.g)))),
    }
    return CheckResult(
        geometry=g,
        shape=shape,
        state_dtype=jnp.dtype(state_dtype).name,
        backend=backend,
        outputs_equal=bool(outs_equal),
        pool_equal=bool(pool_equal),
        replay_equal=bool(replay_equal),
        untouched_equal=bool(untouched_equal),
        naive_ulp=naive_ulp,
        scratch_bytes=scratch,
        seconds=time.perf_counter() - t0,
    )


def format_result(r: CheckResult) -> str:
    g, s = r.geometry, r.shape
    mark = lambda ok: "MATCH (bit for bit)" if ok else "MISMATCH"  # noqa: E731
    lines = [
        f"geometry      {g.name}: L={g.gdn_layers} GDN layers, H={g.num_k_heads}, HV={g.num_v_heads}, "
        f"K={g.head_k_dim}, V={g.head_v_dim}",
        f"run           N={s.N} requests x D={s.D} drafts, state pool {r.state_dtype}, backend {r.backend}, "
        f"{jax.default_backend()}",
        f"outputs       tuples vs snapshots: {mark(r.outputs_equal)}",
        f"pool          tuple commit vs snapshot commit, every slot: {mark(r.pool_equal)}",
        f"untouched     slots no request writes: {mark(r.untouched_equal)}",
        f"replay        every step vs its snapshot: {mark(r.replay_equal)}",
        f"naive forms   replay of the last step vs the pinned rule (ULP of {r.state_dtype}):",
    ]
    for name, st in r.naive_ulp.items():
        lines.append(
            f"  {name:<14} {st['differing']:>8} of {st['elements']} elements differ "
            f"({100 * st['fraction']:.2f}%), max {st['max_ulp']} ULP, mean {st['mean_ulp']:.3g} ULP"
        )
    sb = r.scratch_bytes
    ratio = sb["snapshots"] / max(sb["tuples"], 1)
    lines += [
        f"scratch       snapshots {sb['snapshots']:,} B, tuples {sb['tuples']:,} B ({ratio:.1f}x smaller)",
        f"result        {'PASS' if r.ok else 'FAIL'} in {r.seconds:.1f} s",
    ]
    return "\n".join(lines)
