"""Fuzzed commits: the commit's promises checked on many random cases, grouped by shape.

A *case* is a pool ``[L, S, HV, V, K]`` of random states, N requests verified through one
backend in both record modes (their tapes placed at scratch rows among stale filler rows),
and commit indices drawn with every masking rule in play: permuted and sparse rows,
out-of-range and negative slots and rows, negative and too-large steps, track copies
(crossings) and out-of-range track slots. Optionally IEEE specials (NaN with payloads, Inf,
signed zeros, subnormals) are written into the pool and any verify input. For each case:

* every pool slot that no valid request addresses keeps its bits (tuple and snapshot commit);
* every addressed slot holds the state of its step from verify's own snapshot tape;
* a GPU backend's tuple commit equals the reference's commit of the same tape, bit for bit;
* verify's outputs are bit-identical in both record modes;
* verify and commit leave their (non-donated) inputs unchanged.

The expected pool is built here in NumPy from the snapshot tape (no library code), and
compared bit for bit, slot by slot. The controls (:data:`CONTROLS`) are wrong commits that
the same check must catch: a wrong (twice-rounded) rounding form, the accepted-first ordering, one
slot written too many and one write skipped.

Cases come in *shape groups* (one geometry, L, N, D, S, R and dtypes): every function is
compiled once per group, and a group's cases differ in data and indices only. Draws go
through an integer source (:data:`IntSource`), NumPy's here and Hypothesis's in the
property tests, so both explore the same space (:mod:`.fuzz_cases`). ``gdn-lossless fuzz`` runs this
(:func:`run`, :func:`format_summary`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import re
import time
from pathlib import Path
from typing import Callable, Iterable

import jax
import numpy as np

from .. import api, backends, reference
from ..testing import controls
from ..testing.asserts import bits
from ..testing.expect import expected_pool, request_writes
from .fuzz_cases import (CPU_FAMILIES, FAMILIES, VERIFY_INPUTS, CaseShape, CommitCase,
                         Family, IntSource, _place_rows, draw_case, draw_indices, draw_shape, inject_specials,
                         numpy_source)  # fmt: skip

__all__ = [
    "IntSource",
    "numpy_source",
    "Family",
    "FAMILIES",
    "CPU_FAMILIES",
    "CaseShape",
    "CommitCase",
    "CaseResult",
    "CONTROLS",
    "SENSITIVE_KINDS",
    "VERIFY_INPUTS",
    "draw_shape",
    "draw_indices",
    "draw_case",
    "inject_specials",
    "request_writes",
    "expected_pool",
    "Runner",
    "describe",
    "Summary",
    "run",
    "format_summary",
    "merge_logs",
    "add_command",
]

# ---------------------------------------------------------------------------------
# Running and checking.
# ---------------------------------------------------------------------------------
@dataclasses.dataclass
class CaseResult:
    """What one case tried and what held. Slot lists name pool slots (over all layers)."""

    shape: CaseShape
    accepted: int  # accepted-state writes expected
    crossings: int  # track-state writes expected
    untouched: int  # slots no valid request addresses
    skipped: int  # requests skipped entirely (slot or row out of range)
    specials: int  # special values written into the inputs
    corrupted: dict[str, list[int]]  # "<commit>/untouched" or "<commit>/addressed" -> slots that differ
    outputs_differ: bool  # verify's outputs in the two record modes
    inputs_modified: list[str]  # inputs a call changed

    @property
    def corrupted_slots(self) -> int:
        return sum(len(v) for v in self.corrupted.values())

    @property
    def ok(self) -> bool:
        return not self.corrupted_slots and not self.outputs_differ and not self.inputs_modified


def _slot_diff(expected: np.ndarray, got: np.ndarray) -> np.ndarray:
    """``[S]`` bool: the slots whose bits differ in any layer."""
    d = bits(expected) != bits(np.asarray(got))
    return d.reshape(d.shape[0], d.shape[1], -1).any(axis=(0, 2))


def _classify(expected, got, addressed: np.ndarray, name: str) -> dict[str, list[int]]:
    bad = _slot_diff(expected, got)
    return {
        f"{name}/untouched": np.flatnonzero(bad & ~addressed).tolist(),
        f"{name}/addressed": np.flatnonzero(bad & addressed).tolist(),
    }


def _unchanged(before, after) -> bool:
    return all(
        b.shape == np.shape(a) and np.array_equal(bits(b), bits(np.asarray(a)))
        for b, a in zip(jax.tree.leaves(before), jax.tree.leaves(after))
    )


def _one_slot_too_many(case: CommitCase, pool: np.ndarray, addressed: np.ndarray) -> np.ndarray:
    """Control: the right pool, plus the first tape row's last step in the first untouched slot."""
    out = pool.copy()
    out[:, int(np.flatnonzero(~addressed)[0])] = case.filler[1].states[:, 0, -1]
    return out


def _one_write_skipped(case: CommitCase, pool: np.ndarray, slot: int) -> np.ndarray:
    """Control: the right pool with ``slot`` left at its pre-commit state."""
    out = pool.copy()
    out[:, slot] = case.pool[:, slot]
    return out


#: The wrong commits the check must catch (see :meth:`Runner.run`).
CONTROLS = ("twice-rounded rule", "accepted first", "one slot too many", "one write skipped")
#: Input kinds on which every state write is visible at any dtype. Not "cancel": its decays
#: are 1.0 and its u tiny, so a step can leave a bf16 state's bits as they were and the
#: twice-rounded form can round like the rule; nor "mixed", which holds cancel requests.
SENSITIVE_KINDS = ("normal", "decay_extremes", "subnormal")


class Runner:
    """Runs cases on one backend; every function is jitted once and compiled once per shape.

    Args:
      backend: ``"reference"``, ``"pallas"`` or ``"triton"`` (``"auto"`` resolves to one).
    """

    def __init__(self, backend: str = "reference"):
        backends.resolve(backend, "fuzz")  # an unavailable backend fails here, before any case
        self.backend = backend
        self._verify = {r: jax.jit(functools.partial(api.verify, record=r, backend=backend)) for r in api.RECORD_MODES}
        self._commit = jax.jit(functools.partial(api.commit, backend=backend))
        self._reference = None if backend == "reference" else jax.jit(functools.partial(api.commit, backend="reference"))
        self._wrong_form = jax.jit(functools.partial(reference.commit, rule=controls.CONTROLS["twice_rounded"]))
        self._accepted_first = jax.jit(controls.commit_accepted_first)

    def verify(self, case: CommitCase):
        """Verify the case's L * N requests in both record modes (two programs, as a user
        calls them). Returns ``(outputs per mode, tapes per mode, inputs kept)``, NumPy."""
        host = {"state0": case.state0, **case.inputs}
        dev = {n: jax.device_put(np.array(x, copy=True)) for n, x in host.items()}
        ran = {r: self._verify[r](**dev) for r in api.RECORD_MODES}
        outputs = {r: np.asarray(o) for r, (o, _) in ran.items()}
        tapes = {r: jax.tree.map(np.asarray, t) for r, (_, t) in ran.items()}
        return outputs, tapes, _unchanged(host, dev)

    def tapes(self, case: CommitCase):
        """Both tapes placed at the case's rows (``[L, R, ...]``, NumPy), whether verify's
        outputs differ between the record modes, and whether verify kept its inputs."""
        outputs, tapes, kept = self.verify(case)
        s = case.shape
        placed = tuple(_place_rows(f, tapes[r], case.idx, s.layers, s.requests) for f, r in zip(case.filler, api.RECORD_MODES))
        differ = not np.array_equal(bits(outputs["tuples"]), bits(outputs["snapshots"]))
        return placed, differ, kept

    def run(self, case: CommitCase, *, controls: bool = False) -> tuple[CaseResult, dict[str, bool | None]]:
        """Check one case. With ``controls``, also run :data:`CONTROLS` through the same check
        and report for each whether it was caught (None: not applicable to this case)."""
        s, idx = case.shape, case.idx
        (tup, snp), differ, verify_kept = self.tapes(case)
        args = idx.as_args()
        pool_d = jax.device_put(np.array(case.pool, copy=True))
        tup_d, snp_d = jax.device_put(tup), jax.device_put(snp)
        got = {"tuples": self._commit(pool_d, tup_d, *args), "snapshots": self._commit(pool_d, snp_d, *args)}
        if self._reference is not None:
            got["reference"] = self._reference(pool_d, tup_d, *args)
        expected = expected_pool(case.pool, snp.states, idx)

        writes = [request_writes(idx, n, S=s.slots, R=s.rows, D=s.drafts) for n in range(s.requests)]
        addressed = np.zeros(s.slots, bool)
        for acc, trk in writes:
            for w in (acc, trk):
                if w is not None:
                    addressed[w] = True
        corrupted = {}
        for name, pool in got.items():
            corrupted |= _classify(expected, pool, addressed, name)
        modified = [] if verify_kept else ["verify inputs"]
        for name, before, after in (("pool", case.pool, pool_d), ("tuple tape", tup, tup_d), ("snapshot tape", snp, snp_d)):
            if not _unchanged(before, after):
                modified.append(name)
        if not _unchanged([np.asarray(a) for a in args], idx.as_args()):
            modified.append("indices")
        result = CaseResult(
            shape=s,
            accepted=sum(a is not None for a, _ in writes),
            crossings=sum(t is not None for _, t in writes),
            untouched=int((~addressed).sum()),
            skipped=sum(not (0 <= idx.slots[n] < s.slots and 0 <= idx.rows[n] < s.rows) for n in range(s.requests)),
            specials=sum(case.specials.values()),
            corrupted=corrupted,
            outputs_differ=differ,
            inputs_modified=modified,
        )
        if not controls:
            return result, {}
        return result, self._controls(case, expected, addressed, writes, pool_d, tup_d, args)

    def _controls(self, case, expected, addressed, writes, pool_d, tup_d, args) -> dict[str, bool | None]:
        """Each control's pool checked like a commit's: caught if any slot is corrupted;
        None where the case cannot tell the control from the right commit."""
        s = case.shape
        caught = lambda pool: any(_classify(expected, pool, addressed, "c").values())  # noqa: E731
        right = np.asarray(self._commit(pool_d, tup_d, *args))
        sensitive = case.kind in SENSITIVE_KINDS and not case.specials
        accepted = [a for a, _ in writes if a is not None]
        tracks = [t for _, t in writes if t is not None]
        both = any(a is not None and t is not None for a, t in writes)
        # A track slot's old state is another request's (or nobody's): a skipped track write
        # always shows. The twice-rounded form differs from the rule by about one fp32 ULP in a
        # third of the elements, which a bf16 pool rounds away almost always.
        skip = tracks[0] if tracks else accepted[0] if accepted and sensitive else None
        twice = None
        if sensitive and accepted + tracks and s.state_dtype == "float32":
            # A case whose writes are few steps of tiny products (the subnormal kind at D = 1) can
            # round both forms alike in every element: then it cannot tell them apart.
            wrong = np.asarray(self._wrong_form(pool_d, tup_d, *args))
            twice = None if np.array_equal(bits(wrong), bits(right)) else caught(wrong)
        return {
            "twice-rounded rule": twice,
            "accepted first": caught(self._accepted_first(pool_d, tup_d, *args)) if sensitive and both else None,
            "one slot too many": caught(_one_slot_too_many(case, right, addressed)),
            "one write skipped": None if skip is None else caught(_one_write_skipped(case, right, skip)),
        }


# ---------------------------------------------------------------------------------
# The fuzz run.
# ---------------------------------------------------------------------------------
@dataclasses.dataclass
class Summary:
    """What a fuzz run tried and what held."""

    backend: str
    seed: int
    first_group: int = 0
    cases: int = 0
    groups: int = 0
    seconds: float = 0.0
    families: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    drafts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    dtypes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    kinds: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    requests: int = 0
    skipped: int = 0
    accepted: int = 0
    crossings: int = 0
    untouched: int = 0
    special_cases: int = 0
    specials: int = 0
    corrupted: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    outputs_differ: int = 0
    inputs_modified: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    controls: dict = dataclasses.field(default_factory=lambda: {c: [0, 0] for c in CONTROLS})  # name -> [caught, run]
    failures: list = dataclasses.field(default_factory=list)  # (group, case index in it, what failed)

    @property
    def corrupted_slots(self) -> int:
        return sum(self.corrupted.values())

    @property
    def controls_missed(self) -> int:
        return sum(run - caught for caught, run in self.controls.values())

    @property
    def ok(self) -> bool:
        return not (self.corrupted_slots or self.outputs_differ or self.inputs_modified or self.controls_missed)

    def add(self, case: CommitCase, r: CaseResult, controls: dict[str, bool | None]) -> None:
        s = r.shape
        self.cases += 1
        self.families[s.family.name] += 1
        self.drafts[s.drafts] += 1
        self.dtypes[f"{s.state_dtype} pool / {s.input_dtype} inputs"] += 1
        self.kinds[case.kind] += 1
        self.requests += s.requests
        self.skipped += r.skipped
        self.accepted += r.accepted
        self.crossings += r.crossings
        self.untouched += r.untouched
        self.special_cases += bool(r.specials)
        self.specials += r.specials
        for k, v in r.corrupted.items():
            self.corrupted[k] += len(v)
        self.outputs_differ += r.outputs_differ
        for name in r.inputs_modified:
            self.inputs_modified[name] += 1
        for name, caught in controls.items():
            if caught is not None:
                self.controls[name][0] += caught
                self.controls[name][1] += 1


def describe(r: CaseResult) -> str:
    """What failed in a case, in one line."""
    bad = {k: v for k, v in r.corrupted.items() if v}
    parts = [f"corrupted slots {bad}"] if bad else []
    parts += ["outputs differ between record modes"] * r.outputs_differ
    parts += [f"inputs modified: {', '.join(r.inputs_modified)}"] if r.inputs_modified else []
    return f"{r.shape}: " + "; ".join(parts)


def run(
    cases: int,
    *,
    backend: str = "reference",
    seed: int = 0,
    group_size: int = 100,
    first_group: int = 0,
    families: Iterable[str] = CPU_FAMILIES,
    specials_every: int = 4,
    controls_every: int = 25,
    max_work: int | None = 1 << 20,
    progress: Callable[[Iterable], Iterable] | None = None,
) -> Summary:
    """Run ``cases`` commit cases in groups of ``group_size`` per drawn shape.

    Group g draws its shape and cases from ``seed`` and g alone, so a run can be split
    (``first_group``: the groups from there on) and any group rerun by itself. Every
    ``specials_every``-th case writes specials into every input, every ``controls_every``-th
    also runs the controls. ``progress`` wraps the case iterator (a tqdm bar, say).
    """
    families = tuple(families)
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise ValueError(f"fuzz: unknown geometry {unknown[0]!r}; choose from {', '.join(FAMILIES)}")
    if cases < 1 or group_size < 1 or first_group < 0:
        raise ValueError(
            f"fuzz: cases and group size must be positive and the first group >= 0, got {cases}, {group_size}, {first_group}"
        )
    runner = Runner(backend)
    summary = Summary(backend=backend, seed=seed, first_group=first_group)
    plan = [(first_group + g, min(group_size, cases - g * group_size)) for g in range(-(-cases // group_size))]

    def iterate():
        for g, n in plan:
            draw = numpy_source(np.random.default_rng([seed, g]))
            shape = draw_shape(draw, families, max_work=max_work)
            summary.groups += 1
            for i in range(n):
                yield g, i, shape, draw

    t0 = time.perf_counter()
    it = iterate()
    for g, i, shape, draw in progress(it) if progress else it:
        specials = 4 if specials_every and i % specials_every == specials_every - 1 else 0
        case = draw_case(draw, shape, specials=specials)
        result, controls = runner.run(case, controls=controls_every > 0 and i % controls_every == 0)
        summary.add(case, result, controls)
        if not result.ok:
            summary.failures.append((g, i, describe(result)))
    summary.seconds = time.perf_counter() - t0
    return summary


def _counts(counter: collections.Counter) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(counter.items()))


def _draft_buckets(drafts: collections.Counter) -> str:
    """Cases per D range: 1, 2, 3-4, 5-8, 9-16, 17-32."""
    out = collections.Counter()
    for d, n in drafts.items():
        hi = 1 << (d - 1).bit_length()
        out[hi] += n
    return ", ".join(f"{'' if hi <= 2 else f'{hi // 2 + 1}-'}{hi}: {out[hi]}" for hi in sorted(out))


def format_summary(s: Summary) -> str:
    """The report ``gdn-lossless fuzz`` prints."""
    lines = [
        f"backend       {s.backend} on {jax.default_backend()}, seed {s.seed}",
        f"cases         {s.cases} commit cases in {s.groups} shape groups "
        f"({s.first_group}..{s.first_group + s.groups - 1}), {s.seconds:.1f} s "
        f"({1e3 * s.seconds / max(s.cases, 1):.1f} ms per case, compiles included)",
        f"geometries    {_counts(s.families)}",
        f"D             {min(s.drafts)}..{max(s.drafts)}, cases per range: {_draft_buckets(s.drafts)}",
        f"dtypes        {_counts(s.dtypes)}",
        f"input kinds   {_counts(s.kinds)}",
        f"requests      {s.requests}: {s.skipped} skipped entirely (slot or row out of range)",
        f"slots         {s.accepted} accepted writes, {s.crossings} track writes (crossings), "
        f"{s.untouched} untouched slots checked",
        f"specials      {s.specials} NaN/Inf/signed-zero/subnormal values in {s.special_cases} cases",
        "held          corrupted slots: "
        + ", ".join(f"{k} {s.corrupted.get(k, 0)}" for k in sorted(s.corrupted) or ["tuples/untouched"]),
        f"              outputs differing between record modes: {s.outputs_differ} cases; "
        f"inputs modified: {_counts(s.inputs_modified) or 0}",
        "controls      " + ", ".join(f"{k} caught {c} of {n}" for k, (c, n) in s.controls.items()),
        f"result        {'OK' if s.ok else 'VIOLATIONS'}: {s.corrupted_slots} corrupted slots",
    ]
    for g, i, msg in s.failures[:20]:
        lines.append(f"  group {g} case {i}: {msg}")
    if s.failures:
        lines.append("rerun group G alone: the same command with --first-group G --cases <group size>")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------
# The command: gdn-lossless fuzz.
# ---------------------------------------------------------------------------------
def add_command(sub) -> None:
    """Add ``fuzz`` to the ``gdn-lossless`` subcommands (``sub``: argparse subparsers)."""
    from .options import non_negative_int, positive_int

    f = sub.add_parser(
        "fuzz",
        help="commit properties on many random cases: untouched slots kept, addressed slots equal to the snapshot path",
        description="Verify and commit N random cases (geometries, D in 1..32, fp32/bf16 pools, permuted and sparse "
        "rows, invalid slots, rows and steps, track crossings, IEEE specials) on a backend; check every pool slot "
        "bit for bit against the snapshot path (and the reference's commit), verify's outputs across record modes "
        "and that no input was modified; print what was tried and what held. Cases are grouped by shape so that "
        "each shape compiles once. Exit status 1 on any violation, 2 on a bad argument.",
    )
    f.add_argument("--cases", type=positive_int, default=1000, help="commit cases to run (default 1000)")
    f.add_argument("--backend", choices=("auto", *backends.BACKENDS), default="reference",
                   help="backend whose verify and commit are checked (default reference)")
    f.add_argument("--seed", type=non_negative_int, default=0, help="seed of the whole run (default 0)")
    f.add_argument("--group-size", type=positive_int, default=100,
                   help="cases per shape group: one compile each (default 100)")
    f.add_argument("--first-group", type=non_negative_int, default=0,
                   help="start at this group (default 0): splits a run over several commands, or reruns a group")
    f.add_argument("--geometry", action="append", choices=list(FAMILIES), metavar="NAME",
                   help=f"a head geometry to draw from (repeat; default: on a CPU {', '.join(CPU_FAMILIES)}; "
                   "on a GPU all of them, the real Qwen heads included)")
    f.add_argument("--max-work", type=positive_int, default=None,
                   help="cap on a case's snapshot-tape elements L*R*D*HV*V*K (default 2^20 on a CPU, 2^24 on a GPU)")
    f.add_argument("--no-progress", action="store_true", help="no progress bar")
    f.set_defaults(func=_command)
    g = sub.add_parser(
        "fuzz-merge",
        help="add up the logs of one fuzz run made in pieces (--first-group)",
        description="Add up `gdn-lossless fuzz` logs of one seed run in pieces (--first-group), per backend: check "
        "that the pieces' shape groups cover [0, G) once each and print what was tried and what held. Exit status 1 "
        "on anything that did not hold (or a group missing or run twice).",
    )
    g.add_argument("logs", nargs="+", help="the fuzz logs (e.g. $OUT/fuzz/*.log of scripts/gpu_x2.sh fuzz)")
    g.set_defaults(func=lambda args: merge_logs(args.logs))


def _command(args) -> int:
    from tqdm import tqdm

    on_cpu = jax.default_backend() == "cpu"
    families = args.geometry or (CPU_FAMILIES if on_cpu else tuple(FAMILIES))
    max_work = args.max_work or (1 << 20 if on_cpu else 1 << 24)
    print(
        f"gdn-lossless fuzz: {args.cases} cases, backend {args.backend}, seed {args.seed}, "
        f"group size {args.group_size}, first group {args.first_group}, geometries {', '.join(families)}, max work {max_work}",
        flush=True,
    )
    bar = None if args.no_progress else functools.partial(tqdm, total=args.cases, unit="case", smoothing=0.05)
    summary = run(
        args.cases, backend=args.backend, seed=args.seed, group_size=args.group_size, first_group=args.first_group,
        families=families, max_work=max_work, progress=bar,
    )  # fmt: skip
    print(format_summary(summary))
    return 0 if summary.ok else 1


# ---------------------------------------------------------------------------------
# The logs of a run made in pieces: gdn-lossless fuzz-merge.
# ---------------------------------------------------------------------------------
def parse_log(path: Path) -> dict:
    """What one ``gdn-lossless fuzz`` log says it tried and held (``complete`` False: cut off)."""
    text = path.read_text()
    head = re.search(r"fuzz: (\d+) cases, backend (\w+), seed (\d+)", text)
    groups = re.search(r"shape groups \((\d+)\.\.(\d+)\), ([\d.]+) s", text)
    status = re.findall(r"exit status (\d+)", text)
    if not (head and groups and status):
        return {"path": path.name, "complete": False, "status": status[-1] if status else "?"}
    r = {"path": path.name, "complete": True, "cases": int(head[1]), "backend": head[2], "seed": int(head[3]),
         "groups": range(int(groups[1]), int(groups[2]) + 1), "seconds": float(groups[3]), "status": status[-1]}  # fmt: skip
    for key in ("geometries", "dtypes", "input kinds"):
        line = re.search(rf"^{key}\s+(.*)$", text, re.M)[1]
        r[key] = {k.strip(): int(v) for k, v in re.findall(r"([^,:]+?): (\d+)", line)}
    d = re.search(r"^D\s+.*cases per range: (.*)$", text, re.M)[1]
    r["D"] = {k.strip(): int(v) for k, v in re.findall(r"([\d-]+): (\d+)", d)}
    nums = {
        "requests": r"^requests\s+(\d+): (\d+) skipped",
        "writes": r"^slots\s+(\d+) accepted writes, (\d+) track writes.*?, (\d+) untouched",
        "specials": r"^specials\s+(\d+) NaN.* in (\d+) cases",
        "differing": r"outputs differing between record modes: (\d+) cases; inputs modified: (\d+)",
    }
    for k, pat in nums.items():
        r[k] = tuple(int(x) for x in re.search(pat, text, re.M).groups())
    held = re.search(r"^held\s+corrupted slots: (.*)$", text, re.M)[1]
    r["corrupted"] = {k: int(v) for k, v in re.findall(r"([\w/]+) (\d+)", held)}
    ctl = re.search(r"^controls\s+(.*)$", text, re.M)[1]
    r["controls"] = {k.strip(): (int(a), int(b)) for k, a, b in re.findall(r"([a-z -]+?) caught (\d+) of (\d+)", ctl)}
    return r


def _order(item):
    """D ranges by their first number, other names alphabetically."""
    k = item[0]
    return (0, int(k.split("-")[0]), "") if k.split("-")[0].isdigit() else (1, 0, k)


def merge_logs(paths: list[str]) -> int:
    """Add up ``gdn-lossless fuzz`` logs of one seed run in pieces (``--first-group``), per backend:
    check that the pieces' groups cover ``[0, G)`` once each and print what was tried and what held.
    Returns 0 when everything held, else 1."""
    logs = [parse_log(Path(p)) for p in paths]
    bad = [r for r in logs if not r["complete"]]
    for r in bad:
        print(f"incomplete (not counted): {r['path']}, exit status {r['status']}")
    by = collections.defaultdict(list)
    for r in logs:
        if r["complete"]:
            by[(r["backend"], r["seed"])].append(r)
    ok = not any(r["status"] != "0" for r in logs if r["complete"])
    for (backend, seed), rs in sorted(by.items()):
        groups = sorted(g for r in rs for g in r["groups"])
        dup = sorted(g for g, n in collections.Counter(groups).items() if n > 1)
        missing = sorted(set(range(max(groups) + 1)) - set(groups))

        def total(key):  # summed per name, zeros kept
            out = collections.defaultdict(int)
            for r in rs:
                for k, v in r[key].items():
                    out[k] += v
            return dict(out)

        add = lambda key: tuple(map(sum, zip(*(r[key] for r in rs))))  # noqa: E731
        controls = collections.defaultdict(lambda: [0, 0])
        for r in rs:
            for k, (a, b) in r["controls"].items():
                controls[k][0] += a
                controls[k][1] += b
        corrupted = total("corrupted")
        print(f"backend {backend}, seed {seed}: {sum(r['cases'] for r in rs)} cases in {len(groups)} shape groups "
              f"({len(rs)} commands; groups missing: {missing or 'none'}, twice: {dup or 'none'}), "
              f"{sum(r['seconds'] for r in rs):.0f} s of commands")  # fmt: skip
        for key in ("geometries", "D", "dtypes", "input kinds"):
            print(f"  {key:12} " + ", ".join(f"{k}: {v}" for k, v in sorted(total(key).items(), key=_order)))
        req, skip = add("requests")
        acc, trk, untouched = add("writes")
        spec, spec_cases = add("specials")
        diff, modified = add("differing")
        print(f"  requests     {req} ({skip} skipped entirely: slot or row out of range)")
        print(f"  slots        {acc} accepted writes, {trk} track writes, {untouched} untouched slots checked")
        print(f"  specials     {spec} NaN/Inf/signed-zero/subnormal values in {spec_cases} cases")
        print(
            f"  corrupted    {sum(corrupted.values())} ({', '.join(f'{k} {v}' for k, v in sorted(corrupted.items()))})"
        )
        print(f"  differing    outputs between record modes: {diff} cases; inputs modified: {modified}")
        print("  controls     " + ", ".join(f"{k} caught {a} of {b}" for k, (a, b) in controls.items()))
        ok &= not sum(corrupted.values()) and not diff and not modified and not missing and not dup
        ok &= all(a == b for a, b in controls.values())
    print("result       " + ("OK" if ok else "NOT OK"))
    return 0 if ok else 1
