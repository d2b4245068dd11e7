"""The Pallas verify kernel compiled by upstream Triton, under register limits (GPU only).

Pallas in jax 0.11.2 passes only ``num_warps`` and ``num_stages`` to XLA's Triton, and XLA does not
take ``--xla_gpu_asm_extra_flags`` (an unknown flag: the process aborts). So a register budget
cannot be set for a Pallas kernel. This measures what one would give: the kernel's Triton IR
(lowered by Pallas, as ``scripts/sass_stats.py`` does) is compiled with the installed Triton,
with and without ``maxnreg`` (PTX ``.maxnreg``), launched through Triton's own launcher on
torch tensors that share the JAX arrays' memory (DLPack), and timed on the device with the same
profiler trace as every other number here (``benchmarks/devtime.py``). Each launch's outputs
are compared bit for bit with the Pallas call's.

Usage (GPU)::

    python3 scripts/upstream_regs.py 25x4:tuples:8:1 25x4:snapshots:8:1 --maxnreg 0,96,80,64

(``0``: no limit). Variants as in ``scripts/sass_stats.py``. Writes ``$OUT/upstream_regs.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from sass_stats import lower

from benchmarks.devtime import device_time
from gdn_lossless_jax.backends.pallas.verify import _prep as pallas_prep
from gdn_lossless_jax.backends.pallas.verify import verify as pallas_verify
from gdn_lossless_jax.cases import Shape, verify_inputs
from gdn_lossless_jax.testing import bits

CALLS, COPIES = 16, 4
T0 = time.perf_counter()


def log(msg):
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def tbits(t):
    """A torch tensor's bit patterns, as NumPy unsigned integers."""
    import torch

    n = t.element_size()
    return t.view({2: torch.int16, 4: torch.int32}[n]).cpu().numpy().view({2: np.uint16, 4: np.uint32}[n])


def time_variant(spec: str, ttir: Path, limits) -> list[dict]:
    """The Pallas call's kernel (XLA's build), then the same Triton IR built upstream at each register limit."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from variants import verify_config

    parts = spec.split(":")
    N, D = map(int, parts[0].split("x"))
    record, BV, W = parts[1], int(parts[2]), int(parts[3])
    shape = Shape(N=N, D=D, H=16, HV=32, K=128, V=128)
    cfg = verify_config(parts[4:], block_v=BV, num_warps=W)
    if cfg.algorithm != "chain":
        raise SystemExit(f"{spec}: only the chain's kernel is wired here")
    xs = [verify_inputs(i, shape) for i in range(COPIES)]
    f = jax.jit(functools.partial(pallas_verify, record=record, scale=128**-0.5, out_dtype=jnp.bfloat16, config=cfg,
                                  form="ptx", interpret=False))  # fmt: skip
    ref = [f(**x) for x in xs]
    dev = device_time(lambda: jax.block_until_ready([f(**xs[i % COPIES]) for i in range(CALLS)]), 2, CALLS)
    main_k = dev["kernels"][0]
    log(f"{spec:<28} pallas (XLA's Triton)          {main_k['median_us']:7.1f} us  {main_k['details'][:40]}")
    rows = [{"spec": spec, "compiler": "xla", "kernel_us": main_k["median_us"], "details": main_k["details"]}]
    # the kernel's own inputs: the prologue's outputs, as the Pallas call made them
    ins = []
    for x in xs:
        qn, kn, g, beta = pallas_prep(x["q"], x["k"], x["a"], x["b"], x["A_log"], x["dt_bias"], scale=128**-0.5,
                                      heads=cfg.prep_heads, interpret=False)  # fmt: skip
        ins.append([torch.from_dlpack(a) for a in (x["state0"], qn, kn, x["v"], g, beta)])
    rec_shape = (N, D, 32, 128, 128) if record == "snapshots" else (N, D, 32, 128)
    outs = [(torch.empty((N, D, 32, 128), dtype=torch.bfloat16, device="cuda"),
             torch.empty(rec_shape, dtype=torch.float32, device="cuda")) for _ in xs]  # fmt: skip

    def measure(lim, fusion):
        opts = {"num_warps": W, "num_stages": cfg.num_stages, "enable_fp_fusion": fusion}
        opts |= {"maxnreg": lim} if lim else {}
        k = triton.compile(str(ttir), target=GPUTarget("cuda", 90, 32), options=opts)
        launch = k[(N, 32, 128 // BV)]

        def run():
            for i in range(CALLS):
                launch(*ins[i % COPIES], *outs[i % COPIES])
            torch.cuda.synchronize()

        run()
        same = all(np.array_equal(tbits(o[0]), bits(r[0])) and np.array_equal(tbits(o[1]), bits(r[1][0]))
                   for o, r in zip(outs, ref))  # fmt: skip
        us = device_time(run, 2, CALLS)["kernels"][0]["median_us"]
        log(f"{spec:<28} upstream maxnreg {lim or '-':>3} fp_fusion {fusion!s:<5}: {us:7.1f} us  regs {k.n_regs}  "
            f"spills {k.n_spills}  outputs {'bit-identical' if same else 'DIFFER'}")
        rows.append({"spec": spec, "compiler": "upstream", "maxnreg": lim or None, "fp_fusion": fusion, "kernel_us": us,
                     "regs": k.n_regs, "spills": k.n_spills, "identical": same})  # fmt: skip
        return same

    fusion = not measure(0, False) and measure(0, True)  # the setting whose outputs are XLA's, else no fusion
    for lim in limits:
        if lim:
            measure(lim, fusion)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("variants", nargs="+")
    p.add_argument("--maxnreg", default="0,96,80,64")
    args = p.parse_args(argv)
    limits = [int(x) for x in args.maxnreg.split(",")]
    work = Path(tempfile.mkdtemp(prefix="upstream_regs_"))
    lower(args.variants, work)
    index = {v["spec"]: v for v in json.loads((work / "index.json").read_text())}
    rows = []
    for spec in args.variants:
        rows += time_variant(spec, work / f"{index[spec]['name']}.ttir", limits)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "upstream_regs.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
