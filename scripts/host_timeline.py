"""Where one jitted step's host time goes, and when the GPU starts and stops: a timeline per call.

On the H200 the one-jit tuple step (``benchmarks/step.py``'s ``scan``, ``unrolled``: about 60 kernels
in XLA's CUDA graphs) costs about 0.5 ms a call more wall-clock than its kernels, back to back too.
For each form, and ``null`` (a jit of the same arguments and donation returning them, as in
``scripts/launch_probe.py``), this warms the step (3 calls), then traces ``--calls`` calls, each in
``TraceAnnotation("call i")`` and donating the last call's pool and tape, the index sets rotating (as
``benchmarks.step``'s rows), twice: ``b2b`` (``block_until_ready`` after the last call only) and
``sync`` (after every call). Per call (window: its annotation's start to the next call's start; the
last call's ends at its last kernel's end) it lists the host events in the window per thread line,
to ``--depth``, those under ``--min-us`` folded into counts, CUPTI's driver calls (``cuGraphLaunch``
...: lines ``CUPTI/...``) among them; then its kernels (launched by a driver call in the window, by
CUPTI's correlation id where the trace links them; the H200 traces of jax 0.11.2 did not, and a kernel
then goes to the call in whose window it starts): first start, last end, count, busy sum, and the GPU's idle gaps over
``--gap-us`` (the first: since the last call's last kernel) with the host events running then. Last,
medians per form and run.

Clocks: XLA writes host events on the host's clock, CUPTI's driver calls and kernels on CUPTI's moved
onto it by one (host, CUPTI) pair read at trace start. The script assumes one clock and prints how
many launch calls lie inside a call's annotation and the delay from a launch call to its kernels
(both on CUPTI's clock: never negative). On the GPU (text and traces saved under ``--out``)::

    python scripts/host_timeline.py --config 25x4 --forms null,unrolled,scan --calls 6 --out $OUT/host_timeline
    python scripts/host_timeline.py --read $OUT/host_timeline/*.xplane.pb --depth 8   # the saved traces again

``--mode cpu-small --config 2x2`` runs on a CPU (no GPU plane: XLA:CPU's thunks stand in for kernels,
given to calls by ``run_id``), to keep the script alive.
"""

from __future__ import annotations

import argparse
import bisect
import glob
import itertools
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections import Counter
from typing import NamedTuple

RUNS = ("b2b", "sync")
CUPTI = "CUPTI/"  # prefix of the lines of plane /host:CUPTI (one per host thread)
warnings.filterwarnings("ignore", "builtin type .* has no __module__", DeprecationWarning)  # ProfileData's stats


class Ev(NamedTuple):  # one event: its line (thread or stream), times in us, nesting on its line (0: outermost)
    line: str
    name: str
    start: float
    end: float
    depth: int
    stats: dict

    @property
    def dur(self) -> float:
        return self.end - self.start


def _nested(line: str, events) -> list[Ev]:
    out, ends = [], []
    for ev in sorted(events, key=lambda e: (e.start_ns, -e.duration_ns)):
        s, e = ev.start_ns / 1e3, (ev.start_ns + ev.duration_ns) / 1e3
        while ends and ends[-1] <= s:
            ends.pop()
        out.append(Ev(line, ev.name, s, e, len(ends), {k: v for k, v in ev.stats}))
        ends.append(e)
    return out


def load(path: str):
    """(host events, kernels, where the kernels come from) of one ``.xplane.pb``."""
    import jax

    host, kernels = [], []
    for plane in jax.profiler.ProfileData.from_file(path).planes:
        for line in plane.lines:
            if plane.name.startswith("/host:"):
                host += _nested(CUPTI + line.name if plane.name == "/host:CUPTI" else line.name, line.events)
            elif plane.name.startswith("/device:GPU") and line.name.startswith("Stream"):
                kernels += _nested(f"{plane.name[8:]} {line.name}", line.events)
    if kernels:
        return host, sorted(kernels, key=lambda k: k.start), "GPU stream lines"
    cpu = sorted((e for e in host if "hlo_op" in e.stats), key=lambda e: (e.line, e.start))
    cpu = [e for e, n in zip(cpu, cpu[1:] + [None]) if n is None or n.line != e.line or n.start >= e.end]  # leaves
    return host, sorted(cpu, key=lambda k: k.start), "no GPU plane: XLA:CPU's thunks (hlo_op events) stand in"


def dump_names(path: str) -> list[str]:
    import jax

    out = [f"planes and lines of {path}: events, the most frequent names"]
    for plane in jax.profiler.ProfileData.from_file(path).planes:
        out.append(f"  {plane.name}")
        for line in plane.lines:
            names = Counter(ev.name for ev in line.events)
            top = ", ".join(f"{n[:50]} x{c}" for n, c in names.most_common(6))
            out.append(f"    {line.name!r}: {names.total()}; {top}")
    return out


def split_calls(host, kernels):
    """The call annotations, each call's kernels, the kernels' launch calls by correlation id, and how
    the kernels were given to calls: to the call in whose window their launch call (CUPTI) starts;
    else (XLA:CPU) the k-th ``run_id`` to start to call k; else to the call in whose window they start."""
    calls = sorted((e for e in host if e.name.startswith("call ") and e.name[5:].isdigit()), key=lambda e: e.start)
    starts = [c.start for c in calls]
    cupti = {e.stats["correlation_id"]: e for e in host if e.line.startswith(CUPTI) and "correlation_id" in e.stats}
    launch = {c: cupti[c] for k in kernels if (c := k.stats.get("correlation_id")) in cupti}
    runs = list(dict.fromkeys(k.stats.get("run_id") for k in kernels))
    rank = {r: j for j, r in enumerate(runs)} if None not in runs and len(runs) == len(calls) else {}

    def when(k):
        if (e := launch.get(k.stats.get("correlation_id"))) is not None:
            return e.start, "launch call"
        return (starts[rank[k.stats["run_id"]]], "run_id") if rank else (k.start, "start")

    per_call, how = [[] for _ in calls], Counter()
    for k in kernels:
        t, by = when(k)
        how[by] += 1
        if (i := bisect.bisect_right(starts, t) - 1) >= 0:
            per_call[i].append(k)
    return calls, per_call, launch, how


def clock_check(calls, kernels, launch, how) -> list[str]:
    out = ["kernels given to calls by " + ", ".join(f"{k} ({n})" for k, n in how.items())]
    if not launch:
        return out + ["clock: no CUPTI launch call matches a kernel; host and kernels assumed on one clock"]
    inside = sum(any(c.start <= e.start <= c.end for c in calls) for e in launch.values())
    lag = [k.start - launch[c].start for k in kernels if (c := k.stats.get("correlation_id")) in launch]
    return out + [(f"clock: one assumed (XLA moves CUPTI's onto the host's at trace start); {len(launch)} launch "
                   f"calls, {inside} inside a call's annotation; launch call start to its kernels' start: median "
                   f"{statistics.median(lag):.1f} us, min {min(lag):.1f} us (negative: the clocks disagree)")]


def host_lines(host, w0, w1, a) -> list[str]:
    near = [e for e in host if e.start < w1 and e.end > w0 and e.depth <= a.depth]
    out = []
    for line in dict.fromkeys(e.line for e in near if e.dur >= a.min_us):
        out.append(f"  [{line}]")
        out += [f"  {e.start - w0:+9.1f} {e.dur:9.1f}  {'  ' * e.depth}{e.name[:100]}"
                for e in near if e.line == line and e.dur >= a.min_us]  # fmt: skip
    folded = Counter(e.name[:40] for e in near if e.dur < a.min_us)
    if folded:
        more = f" (+{len(folded) - 8} names)" if len(folded) > 8 else ""
        out.append(f"  folded (< {a.min_us:g} us): " + ", ".join(f"{c}x {n}" for n, c in folded.most_common(8)) + more)
    return out


def _innermost(evs: list[Ev]) -> list[Ev]:
    return [e for e in evs if not any(c.line == e.line and c.depth > e.depth and e.start <= c.start and c.end <= e.end
                                      for c in evs)]  # fmt: skip


def gpu_lines(ks, w0, prev_end, host, a) -> list[str]:
    if not ks:
        return ["  GPU: no kernels"]
    spans = [] if prev_end is None else [[prev_end, prev_end]]  # busy stretches, from the last call's last kernel
    for k in ks:
        if spans and k.start <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], k.end)
        else:
            spans.append([k.start, k.end])
    gaps = [(x[1], y[0]) for x, y in itertools.pairwise(spans) if y[0] - x[1] > a.gap_us]
    out = [(f"  GPU: first kernel {ks[0].start - w0:+.1f}, last end {max(k.end for k in ks) - w0:+.1f}, {len(ks)} "
            f"kernels, busy {sum(k.dur for k in ks):.1f} us; idle gaps > {a.gap_us:g} us: {len(gaps)}")]
    for g0, g1 in gaps:  # the innermost host events (listed ones) running during the gap
        near = [e for e in host if e.start < g1 and e.end > g0 and e.depth <= a.depth and e.dur >= a.min_us]
        what = "; ".join(f"{e.line[:18]}: {e.name[:50]} ({e.start - w0:+.0f}, {e.dur:.0f})"
                         for e in _innermost(near)[:6])  # fmt: skip
        out.append(f"    idle {g1 - g0:8.1f} us from {g0 - w0:+9.1f}: {what or '-'}")
    return out


def analyze(path: str, label: str, a, perf_us: float | None = None) -> tuple[list[str], list[dict]]:
    host, kernels, source = load(path)
    calls, per_call, launch, how = split_calls(host, kernels)
    out, rows, prev_end = [f"\n=== {label} ({os.path.basename(path)}); kernels: {source}"], [], None
    out += clock_check(calls, kernels, launch, how)
    for i, (c, ks) in enumerate(zip(calls, per_call)):
        k0, k1 = (ks[0].start, max(k.end for k in ks)) if ks else (None, None)
        w1 = calls[i + 1].start if i + 1 < len(calls) else max(c.end, k1 or c.end)
        lc = min((e.start for e in launch.values() if c.start <= e.start < w1), default=None)
        rows.append({"host": c.dur, "launch": None if lc is None else lc - c.start,
                     "first": k0 - c.start if ks else None, "busy": sum(k.dur for k in ks),
                     "span": k1 - k0 if ks else None, "wall": w1 - c.start, "perf": perf_us})  # fmt: skip
        out.append(f"\n-- {label} {c.name}: host {c.dur:.1f} us until the call returns, window {w1 - c.start:.1f} us")
        out += host_lines(host, c.start, w1, a) + gpu_lines(ks, c.start, prev_end, host, a)
        prev_end = k1 if ks else prev_end
    return out, rows


def summary(results: dict[str, list[dict]]) -> list[str]:
    cols = ("host", "launch", "first", "busy", "span", "wall", "perf")
    out = [("\nmedians over the calls, us: host (until the call returns), launch (first launch call), first (first "
            "kernel start), from the call's start; busy (sum of kernel times), span (first start to last end), wall "
            "(the call's window), perf (perf_counter over the run / calls, profiler on)"),
           f"  {'form/run':24s}" + "".join(f"{c:>9s}" for c in cols)]
    for label, rows in results.items():
        med = [statistics.median(v) if (v := [r[c] for r in rows if r[c] is not None]) else None for c in cols]
        out.append(f"  {label:24s}" + "".join(f"{m:9.1f}" if m is not None else f"{'-':>9s}" for m in med))
    return out


def trace_run(fn, box, inp, a, sync: bool, path: str) -> float:
    """Warm up (3 calls), then trace ``a.calls`` calls into ``path``; us per traced call (perf_counter)."""
    import jax

    def args():  # the last call's pool and tape (donated), the next index set
        box["i"] += 1
        sets = inp.index_sets[:1] if a.fixed_ix else inp.index_sets
        return *box["d"], inp.params, inp.qkv, sets[box["i"] % len(sets)]

    for _ in range(3):
        outs, *box["d"] = fn(*args())
        jax.block_until_ready((outs, box["d"]))
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        t = time.perf_counter()
        for i in range(a.calls):
            xs = args()
            with jax.profiler.TraceAnnotation(f"call {i}"):
                outs, *box["d"] = fn(*xs)
            if sync:
                jax.block_until_ready((outs, box["d"]))
        jax.block_until_ready((outs, box["d"]))
        us = (time.perf_counter() - t) / a.calls * 1e6
        jax.profiler.stop_trace()
        shutil.move(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0], path)
    return us


def run(a, folder: str) -> list[tuple[str, str, float]]:
    """Trace every form and run into ``folder``; (label, trace, us per call) of each."""
    import jax

    from benchmarks import cases as bc
    from benchmarks import step as bs

    mode = bc.MODES[a.mode]
    inp = bs.make_inputs(bc.parse_configs(a.config, mode.configs)[0], mode.geometry, seed=0)
    p = bs._allocate(inp, "tuples", 0)
    box = {"d": [p.ssm, p.tape], "i": 0}
    del p
    null = jax.jit(lambda ssm, tape, params, xs, ix: (xs["q"][0, 0, 0, 0, :8] * ix[0][0], ssm, tape),
                   donate_argnums=(0, 1))  # fmt: skip
    out = []
    s, L = inp.shape, inp.geometry.gdn_layers
    obox = [bs._filled(jax.ShapeDtypeStruct((L, s.N, s.D, s.HV, s.V), inp.qkv["q"].dtype), 9)]

    def with_out(step):  # the -out forms: the outputs buffer passed in (donated) and kept for the next call
        def call(*args):
            outs, ssm, tape = step(*args, obox[0])
            obox[0] = outs
            return outs, ssm, tape

        return call

    def fused_out():  # benchmarks.step's fused-out: one executable per parity, the two tapes swapped after each call
        step = bs.fused_call([bs.fused_step(a.backend, None, "unrolled-out") for _ in range(2)])

        def call(ssm, tape, prev, params, xs, ix):
            outs, ssm, tape, prev = step(ssm, tape, prev, params, xs, ix, obox[0])
            obox[0] = outs
            return outs, ssm, tape, prev

        return call

    for form in a.forms.split(","):
        fn = null if form == "null" else fused_out() if form == "fused-out" else bs.direct_step(a.backend, form)
        fn = with_out(fn) if form.endswith("-out") and form != "fused-out" else fn
        fbox = box
        if form == "fused-out":  # a pool and two tapes of its own (the states, the tape it writes, the one it commits)
            fbox = {"d": list(bs._filled((box["d"][0], box["d"][1], box["d"][1]), 11)), "i": 0}
        for r in RUNS:
            path = os.path.join(folder, f"{form}-{r}-{a.config}.xplane.pb")
            out.append((f"{form}/{r}", path, trace_run(fn, fbox, inp, a, r == "sync", path)))
            print(f"traced {form}/{r}: {out[-1][2]:.0f} us a call", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="25x4", help="REQUESTSxDRAFTS (also names the text file under --out)")
    ap.add_argument("--forms", default="null,unrolled,scan",
                    help="null, fused-out (benchmarks.step's), and forms of benchmarks.step.direct_step")
    ap.add_argument("--calls", type=int, default=6, help="traced calls per form and run")
    ap.add_argument("--fixed-ix", action="store_true",
                    help="the same index arrays every call (default: the next of four sets, as benchmarks.step)")
    ap.add_argument("--mode", default="h200", help="a mode of benchmarks.cases.MODES (cpu-small: a reduced geometry)")
    ap.add_argument("--backend", default="auto", help="verify/commit backend (auto: pallas on a GPU, else reference)")
    ap.add_argument("--out", help="folder for host_timeline-CONFIG.txt and the traces (FORM-RUN-CONFIG.xplane.pb)")
    ap.add_argument("--read", nargs="+", metavar="PB", help="analyze these saved traces instead of running")
    ap.add_argument("--depth", type=int, default=4, help="deepest nesting of host events listed (0: outermost)")
    ap.add_argument("--min-us", type=float, default=5.0, help="shorter host events are folded into counts")
    ap.add_argument("--gap-us", type=float, default=5.0, help="GPU idle gaps longer than this are listed")
    ap.add_argument("--dump-names", action="store_true", help="list each trace's planes, lines and frequent events")
    a = ap.parse_args()
    if a.out:
        os.makedirs(a.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        if a.read:
            traces = [(os.path.basename(p).removesuffix(".xplane.pb"), p, None) for p in a.read]
            lines = [f"host timeline of {len(traces)} saved traces"]
        else:
            traces = run(a, a.out or tmp)
            lines = [f"host timeline, config {a.config}, mode {a.mode}, {a.calls} calls per form and run"]
        results = {}
        for label, path, us in traces:
            lines += dump_names(path) if a.dump_names else []
            text, results[label] = analyze(path, label, a, us)
            lines += text
        lines += summary(results)
    print("\n".join(lines))
    if a.out:
        with open(os.path.join(a.out, f"host_timeline-{a.config}.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
