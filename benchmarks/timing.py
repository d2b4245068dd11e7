"""Interleaved timing of many rows: warm-up, shuffled rounds, dispatch overhead subtracted.

A row is one timed *invocation*: a jitted function that makes ``calls`` calls of the work
(over different inputs, see :mod:`benchmarks.suite`) and blocks until the device is done.
Every round runs every row once, in a fresh random order, so slow drifts of the GPU (clocks,
other processes) fall on all rows alike. Right before each invocation the row's *noop* runs:
the same dispatch path with the same arguments but almost no device work; the median noop
time is subtracted from every invocation before dividing by ``calls``. Both raw and
corrected numbers are kept.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np

from .traffic import Traffic

__all__ = ["Row", "run_rounds", "summarize", "Clock"]


class Clock:
    """Wall time since the run started, and progress lines that are flushed at once."""

    def __init__(self, quiet: bool = False):
        self.t0 = time.perf_counter()
        self.quiet = quiet

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def log(self, msg: str) -> None:
        if not self.quiet:
            print(f"[{self.elapsed():7.1f}s] {msg}", flush=True)


@dataclasses.dataclass
class Row:
    """One timed row.

    Attributes:
      config, backend, op, record: what it is (op: ``verify`` per layer, ``commit`` of all
        layers, ``copy``); record: ``tuples``, ``snapshots`` or None.
      calls: calls of the work per invocation (the invocation time is divided by it).
      traffic: bytes one call must move.
      run: one invocation, blocking until the device is done.
      noop: the same dispatch with (almost) no device work, blocking.
      ahead: ``(dispatch, block)``: one invocation that does not wait for the device, and a
        wait for all dispatched so far (a loop that runs ahead, ``benchmarks.step``).
    """

    config: str
    backend: str
    op: str
    record: str | None
    calls: int
    traffic: Traffic
    run: Callable[[], None]
    noop: Callable[[], None] | None = None
    compile_s: float | None = None  # one call, lower().compile()
    timed_compile_s: float | None = None  # the timed function of `calls` calls
    notes: list[str] = dataclasses.field(default_factory=list)
    raw: list[float] = dataclasses.field(default_factory=list)  # seconds per invocation
    overhead: list[float] = dataclasses.field(default_factory=list)  # seconds per noop
    failed: str | None = None
    device: dict | None = None  # from a profiler trace (benchmarks.devtime), GPU only
    ahead: tuple[Callable[[], object], Callable[[], None]] | None = None  # (one call without blocking, block)

    @property
    def key(self) -> str:
        return "/".join(x for x in (self.config, self.backend, self.op, self.record) if x)

    def samples(self) -> np.ndarray:
        """Seconds per call, one per round: (invocation - median noop) / calls."""
        raw = np.asarray(self.raw, np.float64)
        over = float(np.median(self.overhead)) if self.overhead else 0.0
        return np.maximum(raw - over, 0.0) / self.calls


def run_rounds(
    rows: list[Row],
    *,
    trials: int,
    min_trials: int,
    deadline: float | None,
    seed: int,
    clock: Clock,
    label: str,
    warmup: int,
) -> int:
    """Warm every row up, then time ``trials`` interleaved rounds (fewer if the deadline,
    a ``time.perf_counter()`` value, passes after ``min_trials``). Returns the rounds run.

    A row that raises is marked failed and leaves the rounds; the others go on.
    """
    live = [r for r in rows if r.failed is None]
    for r in live:
        try:
            for _ in range(warmup):
                r.run()
                if r.noop:
                    r.noop()
        except Exception as e:  # noqa: BLE001 - a failing row must not end the run
            r.failed = f"warm-up: {type(e).__name__}: {e}"
            clock.log(f"{label}: {r.key} failed in warm-up: {r.failed[:300]}")
    live = [r for r in live if r.failed is None]
    rng = np.random.default_rng(seed)
    done = 0
    t_start = time.perf_counter()
    for t in range(trials):
        t_round = time.perf_counter()
        for i in rng.permutation(len(live)):
            r = live[i]
            if r.failed:
                continue
            try:
                if r.noop:
                    a = time.perf_counter()
                    r.noop()
                    r.overhead.append(time.perf_counter() - a)
                a = time.perf_counter()
                r.run()
                r.raw.append(time.perf_counter() - a)
            except Exception as e:  # noqa: BLE001
                r.failed = f"round {t}: {type(e).__name__}: {e}"
                clock.log(f"{label}: {r.key} failed: {r.failed[:300]}")
        done = t + 1
        now = time.perf_counter()
        if t == 0:
            clock.log(f"{label}: round 1 of {trials} took {now - t_round:.2f} s over {len(live)} rows; "
                      f"all rounds about {trials * (now - t_round):.1f} s")
        if deadline is not None and done >= min_trials and now > deadline and done < trials:
            clock.log(f"{label}: time budget spent after {done} of {trials} rounds ({now - t_start:.1f} s)")
            break
    # Rows that failed part-way keep only complete rounds out of the statistics.
    for r in rows:
        if r.failed:
            r.raw.clear()
            r.overhead.clear()
    return done


def device_pass(rows: list[Row], *, invocations: int, clock: Clock, label: str) -> None:
    """Trace ``invocations`` invocations of every live row and keep its device time
    (:func:`benchmarks.devtime.device_time`) in ``row.device``. Rows run one after the other,
    not interleaved: the GPU measures each kernel's duration itself, so host-side drift does
    not enter."""
    from .devtime import device_time

    t = time.perf_counter()
    for r in rows:
        if r.failed:
            continue
        try:
            r.device = device_time(r.run, invocations, r.calls)
        except Exception as e:  # noqa: BLE001 - the wall-clock numbers stand without it
            r.notes.append(f"device trace failed: {type(e).__name__}: {str(e)[:200]}")
    traced = sum(r.device is not None for r in rows)
    clock.log(f"{label}: device times of {traced} rows from a profiler trace in {time.perf_counter() - t:.1f} s")


def spin_until_ready(tree):
    """``jax.block_until_ready`` by polling each array's ``is_ready()``: the waiting host thread
    spins instead of sleeping (``benchmarks.step``'s *polled* column)."""
    import jax

    for x in jax.tree.leaves(tree):
        while not x.is_ready():
            pass
    return tree


def summarize(samples: np.ndarray) -> dict:
    """Median and spread of per-call seconds, in microseconds."""
    s = np.asarray(samples, np.float64) * 1e6
    if s.size == 0:
        return {"n": 0}
    q = np.percentile(s, [10, 25, 50, 75, 90])
    return {
        "n": int(s.size),
        "median_us": float(q[2]),
        "p10_us": float(q[0]),
        "p25_us": float(q[1]),
        "p75_us": float(q[3]),
        "p90_us": float(q[4]),
        "min_us": float(s.min()),
        "max_us": float(s.max()),
    }
