"""Device time of the fused step (``commit_and_verify`` over every layer in a ``lax.scan``, as
``benchmarks.step``'s ``fused`` row) for each way the Pallas kernel replays the pending commit
(``VerifyConfig.pending_replay``), beside the separate ``scan`` step of the same run.

Prints, per configuration and variant, the step's device time per call, the fused kernel's
median launch and its registers (from the profiler trace); writes ``$OUT/tune_fused.json``::

    python scripts/tune_fused.py --configs 25x4,8x16 --replays carry,split,split-ahead
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

import jax

from benchmarks import cases as bc
from benchmarks import step as bstep
from benchmarks.devtime import device_time
from gdn_lossless_jax.backends import pallas as gp
from gdn_lossless_jax.backends.pallas.verify import PENDING_REPLAYS, VerifyConfig

T0 = time.perf_counter()


def log(msg):
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="25x4,8x16,8x8,8x4")
    p.add_argument("--replays", default=",".join(PENDING_REPLAYS))
    p.add_argument("--records", default="tuples", help="record modes of the step (the pending tape's too)")
    p.add_argument("--calls", type=int, default=4, help="steps per traced invocation")
    p.add_argument("--invocations", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", default="h200", choices=sorted(bc.MODES), help="geometry (benchmarks.cases.MODES)")
    args = p.parse_args(argv)
    mode = bc.MODES[args.mode]
    rows = []
    default = gp.verify.__kwdefaults__["config"]
    for cfg in bc.parse_configs(args.configs, mode.configs):
        inp = bstep.make_inputs(cfg, mode.geometry, seed=args.seed)
        for record in args.records.split(","):
            pool = bstep._allocate(inp, record, args.seed)
            variants = [("scan", None)] + [("fused", r) for r in args.replays.split(",")]
            for kind, replay in variants:
                gp.verify.__kwdefaults__["config"] = VerifyConfig(pending_replay=replay or default.pending_replay)
                try:
                    if kind == "scan":
                        fn = bstep.direct_step("pallas", "scan")
                        box = [bstep._filled((pool.ssm, pool.tape), args.seed + 7)]

                        def one(fn=fn, box=box):
                            outs, ssm, tape = fn(*box[0], inp.params, inp.qkv, inp.index_sets[0])
                            box[0] = (ssm, tape)
                            return outs
                    else:
                        fn = bstep.fused_step("pallas")
                        box = [bstep._filled((pool.ssm, pool.tape, pool.tape), args.seed + 11)]

                        def one(fn=fn, box=box):
                            outs, ssm, written, old = fn(*box[0], inp.params, inp.qkv, inp.index_sets[0])
                            box[0] = (ssm, old, written)
                            return outs

                    jax.block_until_ready(one())

                    def run(one=one, box=box):
                        for _ in range(args.calls):
                            one()
                        jax.block_until_ready(box[0])

                    dev = device_time(run, args.invocations, args.calls)
                finally:
                    gp.verify.__kwdefaults__["config"] = default
                if dev is None:
                    log(f"{cfg.label} {record} {kind} {replay or ''}: ran; no GPU kernels to time")
                    continue
                main_k = next(k for k in dev["kernels"] if "gdn_verify" in k["name"])
                regs = re.search(r"regs:(\d+)", main_k.get("details", ""))
                row = dict(config=cfg.label, record=record, kind=kind, replay=replay, step_us=dev["us_per_call"],
                           verify_median_us=main_k["median_us"], verify_us_per_step=main_k["us_per_call"],
                           regs=int(regs.group(1)) if regs else None, kernels=dev["kernels"][:6])  # fmt: skip
                rows.append(row)
                log(f"{cfg.label} {record:<9} {kind:<5} {replay or '':<11} step {dev['us_per_call']:8.1f} us   "
                    f"verify kernel {main_k['median_us']:6.1f} us x{main_k['launches_per_call']:.0f}"
                    f"  regs {row['regs']}")
            del pool
        del inp
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "tune_fused.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
