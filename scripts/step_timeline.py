"""Where a step's wall-clock goes that its kernels do not take: a profiler timeline per step form.

For each form of the 30-layer tuple step (``benchmarks/step.py``'s ``scan``, ``unrolled``,
``scan-sliced``, ``unrolled-lists`` and ``fused``, and ``null``: a jit of the same arguments, the
pool and tape donated and returned as they are, with one tiny kernel: the floor of any step's
wall-clock through ``jax.jit``), traces a few invocations and reports, per invocation: the GPU's busy span (first
kernel start to last kernel end), the sum of kernel durations, the kernels launched, the largest
idle gaps between consecutive kernels, and the host thread's events by total time. Saves each
trace's ``.xplane.pb`` under ``--out``::

    python scripts/step_timeline.py --out $OUT/timeline --config 25x4
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import tempfile
import time
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import cases as bc
from benchmarks import step as bs


def trace(run, n, path):
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        for _ in range(n):
            run()
        jax.profiler.stop_trace()
        f = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0]
        shutil.copy(f, path)
    return jax.profiler.ProfileData.from_file(path)


def report(data, n):
    kernels, host = [], defaultdict(float)
    for plane in data.planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                if line.name.startswith("Stream"):
                    kernels += [(ev.start_ns, ev.start_ns + ev.duration_ns, ev.name) for ev in line.events]
        elif plane.name.startswith("/host:CPU"):
            for line in plane.lines:
                for ev in line.events:
                    host[(line.name[:30], ev.name[:70])] += ev.duration_ns / 1e3
    kernels.sort()
    if not kernels:
        print("  no GPU kernels traced")
        return
    starts = np.array([k[0] for k in kernels]); ends = np.array([k[1] for k in kernels])
    gaps = starts[1:] - np.maximum.accumulate(ends)[:-1]
    # invocations: split at the n-1 largest gaps
    cut = np.sort(np.argsort(gaps)[::-1][: n - 1]) if n > 1 else np.array([], int)
    bounds = [0, *(cut + 1), len(kernels)]
    for j in range(len(bounds) - 1):
        a, b = bounds[j], bounds[j + 1]
        span = (ends[a:b].max() - starts[a]) / 1e3
        busy = sum((ends[i] - starts[i]) for i in range(a, b)) / 1e3
        g = gaps[a : b - 1] / 1e3
        big = np.argsort(g)[::-1][:6]
        desc = ", ".join(f"{g[i]:.1f} us before {kernels[a + i + 1][2][:40]}" for i in big)
        print(f"  invocation {j}: {b - a} kernels, span {span:.0f} us, busy {busy:.0f} us, idle {span - busy:.0f} us "
              f"(gaps >5us: {(g > 5).sum()}, sum {g[g > 5].sum():.0f} us); largest: {desc}")
    top = sorted(host.items(), key=lambda kv: -kv[1])[:25]
    print("  host events (thread, name): total us over all invocations")
    for (line, name), us in top:
        print(f"    {us / n:10.1f} us/inv  {line:30s} {name}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default="25x4")
    ap.add_argument("--forms", default="scan,unrolled,scan-sliced,unrolled-lists,fused")
    ap.add_argument("--invocations", type=int, default=4)
    ap.add_argument("--backend", default="pallas")
    ap.add_argument("--mode", default="h200", choices=tuple(bc.MODES))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    mode = bc.MODES[a.mode]
    cfg = bc.parse_configs(a.config, mode.configs)[0]
    inp = bs.make_inputs(cfg, mode.geometry, seed=0)
    p = bs._allocate(inp, "tuples", 0)
    box = {"d": bs._filled((p.ssm, p.tape), 7)}
    forms = ("scan", "unrolled", "scan-sliced", "unrolled-lists")
    fns = {f: (bs.direct_step(a.backend, f), f == "unrolled-lists") for f in forms}
    fused = bs.fused_step(a.backend)
    fns["null"] = (jax.jit(lambda ssm, tape, params, xs, ix: (xs["q"][0, 0, 0, 0, :8] * 2, ssm, tape),
                           donate_argnums=(0, 1)), False)  # fmt: skip

    def runner(form):
        if form == "fused":
            box["f"] = bs._filled((p.ssm, p.tape, p.tape), 11)

            def run():
                outs, ssm, written, old = fused(*box["f"], inp.params, inp.qkv, inp.index_sets[0])
                box["f"] = (ssm, old, written)
                jax.block_until_ready((outs, box["f"]))

            return run
        fn, per_layer = fns[form]
        src = (inp.layers["params"], inp.layers["qkv"]) if per_layer else (inp.params, inp.qkv)

        def run():
            outs, ssm, tape = fn(*box["d"], *src, inp.index_sets[0])
            box["d"] = (ssm, tape)
            jax.block_until_ready((outs, ssm, tape))

        return run

    for form in a.forms.split(","):
        run = runner(form)
        for _ in range(5):
            run()
        w = []
        for _ in range(30):
            t = time.perf_counter(); run(); w.append(time.perf_counter() - t)
        print(f"{form} {a.config}: wall median {np.median(w) * 1e6:.0f} us (p10 {np.percentile(w, 10) * 1e6:.0f})")
        report(trace(run, a.invocations, f"{a.out}/{form}-{a.config}.xplane.pb"), a.invocations)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
