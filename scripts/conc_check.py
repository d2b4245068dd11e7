"""Does a compiler option change the bits of ``benchmarks.step``'s steps? The same steps, twice.

Runs ``--steps`` calls of the fused step (``fused-out``: the commit of the last call fused into this
one's verify, the tapes swapping roles) and of the separate step (``unrolled-out``) at a benchmark
configuration, once compiled with XLA's defaults and once with ``--options`` (default: command
buffers recorded as a dependency graph, ``benchmarks.step.CONCURRENT``), from the same inputs, and
compares the outputs, pools and tapes bit for bit::

    python scripts/conc_check.py --config 25x4 --backend mosaic

A control (``--control``) perturbs one element of the first request's state in the second run's pool
first: the check must then report a difference.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="25x4")
    ap.add_argument("--mode", default="h200")
    ap.add_argument("--backend", default="mosaic")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--options", default=None, help="compiler options as JSON (default: benchmarks.step.CONCURRENT)")
    ap.add_argument("--control", action="store_true", help="perturb the second run's pool: must differ")
    a = ap.parse_args(argv)

    import jax

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import cases as bc
    from benchmarks import step as bs

    options = json.loads(a.options) if a.options else bs.CONCURRENT
    mode = bc.MODES[a.mode]
    inp = bs.make_inputs(bc.parse_configs(a.config, mode.configs)[0], mode.geometry, seed=0)
    p = bs._allocate(inp, "tuples", 0)
    s, L = inp.shape, inp.geometry.gdn_layers
    obuf = jax.ShapeDtypeStruct((L, s.N, s.D, s.HV, s.V), inp.qkv["q"].dtype)

    def bits(tree):
        return [np.asarray(x).view(np.uint8) for x in jax.tree.leaves(tree)]

    def fresh(perturb):
        ssm, tape, prev, out = bs._filled((p.ssm, p.tape, p.tape, obuf), 21)
        if perturb:  # one element of the first request's state, in every layer
            slot = int(np.asarray(inp.index_sets[0][0])[0])
            ssm = ssm.at[:, slot, 0, 0, 0].add(1.0)
        return ssm, tape, prev, out

    def run_fused(opts, perturb):
        step = bs.fused_call([bs.fused_step(a.backend, opts, "unrolled-out") for _ in range(2)])
        ssm, tape, prev, out = fresh(perturb)
        for i in range(a.steps):
            out, ssm, tape, prev = step(ssm, tape, prev, inp.params, inp.qkv, inp.index_sets[i % 4], out)
        return bits((out, ssm, tape, prev))

    def run_separate(opts, perturb):
        fn = bs.direct_step(a.backend, "unrolled-out", options=opts)
        ssm, tape, _, out = fresh(perturb)
        for i in range(a.steps):
            out, ssm, tape = fn(ssm, tape, inp.params, inp.qkv, inp.index_sets[i % 4], out)
        return bits((out, ssm, tape))

    ok = True
    for name, run in (("fused-out", run_fused), ("unrolled-out", run_separate)):
        want, got = run(None, False), run(options, a.control)
        diff = [int((x != y).sum()) for x, y in zip(want, got)]
        same = not any(diff)
        ok &= same != a.control
        print(f"{a.config} {a.backend} {name}, {a.steps} steps, {options} against the defaults: "
              f"{'the same bits' if same else f'bytes differ per array {diff}'}", flush=True)
    print("ok" if ok else "FAILED" + (" (control not caught)" if a.control else ""))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
