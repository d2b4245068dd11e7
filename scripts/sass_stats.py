#!/usr/bin/env python3
"""Static cost of the verify kernels (Pallas, and the triton backend's) per launch configuration, with no GPU.

Reads what costs no device time: the kernel is lowered to Triton IR for an sm_90 target
on the CPU (JAX's cross-platform lowering; Pallas asks for the GPU's compute capability,
which is stubbed to 9.0), compiled with Triton 3.6 to PTX and a cubin, and measured with
the ptxas and cuobjdump that Triton's wheel ships: registers, spills and the SASS
instruction mix of one thread. From the counts and the grid it prints two bounds for one
launch on an H200 (132 SMs at 1.98 GHz): *issue* (all warp instructions at 4 per SM per
clock) and *shfl* (warp shuffles at one per SM per clock). They are lower bounds from
instruction throughput, not predictions of latency.

Two Pythons: this one (the project's, with JAX) lowers; ``--triton-python`` (one with
``triton==3.6.0``; no JAX or GPU needed, e.g. the venv of scripts/triton_interpret_check.py)
compiles.

Usage::

    PYTHONPATH=src python3.12 scripts/sass_stats.py --triton-python /tmp/tvenv/bin/python \\
        25x4:tuples:16:2 25x4:tuples:8:1 8x16:snapshots:4:1:one_pass triton:25x4:tuples:8:1

A variant is ``REQUESTSxDRAFTS:RECORD:BLOCK_V:NUM_WARPS[:TAG...]``, with the tags of
``scripts/variants.py`` (``gram``, ``one_pass``, ``kcN``, ``unN``, ``nsN``, ``noef``, ``lq``, ``mma``, ``prc``...), ``portable``
and ``pend`` (the fused kernel: a pending tuple commit applied first, ``commit_and_verify``).
Prefixed with ``triton:``, it is the triton backend's chain kernel instead (tags of
``variants.triton_verify_config``, and ``pend``: its fused kernel), compiled from its source by the Triton Python,
with jax-triton's 16-byte pointer alignment and fp fusion off (its prologue is not counted);
``k_chunk`` and ``unroll`` default to ``VerifyConfig``'s (the counts in results before the fourth
session were taken with the whole-K tile, ``kc128``, and all steps unrolled). A loop's body is
counted once: the bounds of a looped chain (``unroll`` < D) are per loop body, not per launch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import types
from pathlib import Path

SM_COUNT, CLOCK_HZ = 132, 1.98e9

_COMPILE = r"""
import importlib, json, os, re, subprocess, sys, types
from collections import Counter
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
work, kernels = sys.argv[1], sys.argv[2]
bins = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
pkg = types.ModuleType("gdn_triton_kernels")  # the triton backend's kernel files, without the JAX package around them
pkg.__path__ = [kernels]
sys.modules["gdn_triton_kernels"] = pkg
out = []
for v in json.load(open(os.path.join(work, "index.json"))):
    p = os.path.join(work, v["name"] + ".ttir")
    opts = {"num_warps": v["num_warps"], "num_stages": v.get("num_stages", 1)}
    if "triton" in v:  # the triton backend's verify kernel, from its source, specialised as jax-triton does
        t = v["triton"]
        V_ = importlib.import_module("gdn_triton_kernels.verify")
        sizes, _ = V_.launch_sizes(tuple(t["state"]), tuple(t["q"]), V_.VerifyConfig(**t["config"]), t["record"])
        consts = dict(sizes, SNAPSHOTS=t["record"] == "snapshots", EVICT=t["config"]["evict"], INTERPRET=False,
                      DMAX=t["q"][1], **t.get("pending", {}))  # fmt: skip
        sig = {"state_ptr": "*fp32", "slots_ptr": "*i32", "layer_ptr": "*i32", "tape_layer_ptr": "*i32", "qn_ptr": "*fp32", "kn_ptr": "*fp32",
               "v_ptr": "*bf16", "g_ptr": "*fp32", "beta_ptr": "*fp32", "rows_ptr": "*i32", "buf_in_ptr": "*fp32",
               "prows_ptr": "*i32", "psteps_ptr": "*i32", "ptslots_ptr": "*i32", "ptsteps_ptr": "*i32", "player_ptr": "*i32",
               "pu_ptr": "*fp32", "pk_ptr": "*fp32", "pg_ptr": "*fp32", "pstates_ptr": "*fp32", "out_layer_ptr": "*i32",
               "out_in_ptr": "*bf16", "out_ptr": "*bf16", "snap_ptr": "*fp32", "u_ptr": "*fp32", "pool_out_ptr": "*fp32"}  # fmt: skip
        attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(sig))}  # 16-byte aligned pointers
        src = ASTSource(V_.verify_kernel, signature=dict(sig, **{c: "constexpr" for c in consts}), constexprs=consts,
                        attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(opts, enable_fp_fusion=False))
    else:
        k = triton.compile(p, target=GPUTarget("cuda", 90, 32), options=opts)
    open(p + ".ptx", "w").write(k.asm["ptx"])
    open(p + ".ttgir", "w").write(k.asm["ttgir"])  # the layouts (ttg.convert_layout) of each variant
    open(p + ".cubin", "wb").write(k.asm["cubin"])
    info = subprocess.run([os.path.join(bins, "ptxas"), "-v", "-arch=sm_90a", p + ".ptx", "-o", p + ".ptxas.cubin"],
                          capture_output=True, text=True).stderr
    sass = subprocess.run([os.path.join(bins, "cuobjdump"), "-sass", p + ".cubin"], capture_output=True, text=True).stdout
    ops = [re.sub(r"^@!?U?P\w+\s+", "", line.split("*/", 1)[1].strip()).split(" ")[0].split(".")[0]
           for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line)]
    c = Counter(ops)
    out.append(dict(v, registers=int(re.search(r"Used (\d+) registers", info).group(1)),
                    spill_bytes=int(re.search(r"(\d+) bytes spill stores", info).group(1)),
                    instructions=len(ops), shared=k.metadata.shared,
                    mix={k: c[k] for k in ("SHFL", "FADD", "FFMA", "FMUL", "LDS", "STS", "BAR", "LDG", "STG", "LDGSTS")}))
json.dump(out, open(os.path.join(work, "stats.json"), "w"))
"""


def lower(variants, work: Path) -> None:
    import jax
    import jax.numpy as jnp
    from jax._src.pallas.triton import lowering
    from jax._src.pallas.triton import pallas_call_registration as reg
    from variants import triton_verify_config, verify_config

    from gdn_lossless_jax.backends.pallas.verify import verify
    from gdn_lossless_jax.cases import Shape, verify_inputs

    reg.gpu_info_lib.get_gpu_info = lambda: types.SimpleNamespace(compute_capability=90)  # an H200, stubbed
    captured = []
    orig = lowering.lower_jaxpr_to_triton_module

    def capture(*a, **k):
        r = orig(*a, **k)
        captured.append(r.module.operation.get_asm(enable_debug_info=False))
        return r

    reg.lowering.lower_jaxpr_to_triton_module = capture
    index = []
    for spec in variants:
        parts = spec.split(":")
        if parts[0] == "triton":  # compiled from its source by the Triton Python (no lowering here)
            cfg_s, record, bv, w = parts[1:5]
            N, D = map(int, cfg_s.split("x"))
            cfg = triton_verify_config(parts[5:], block_v=int(bv), num_warps=int(w))
            triton = {"state": [N, 32, 128, 128], "q": [N, D, 16, 128], "record": record,
                      "config": dataclasses.asdict(cfg)}
            if "pend" in parts[5:]:  # the fused kernel: a pending tuple commit of D steps (as the wrapper sizes it)
                from gdn_lossless_jax.backends.triton.verify import next_power_of_2 as p2

                triton["pending"] = dict(PENDING=1, PR=N, PD=D, PREFETCH=cfg.prefetch_pending, PDP=p2(D), KL=p2(4),
                                         ROWS=cfg.pending_replay == "rows")  # fmt: skip
            index.append({"name": spec.replace(":", "_"), "spec": spec, "num_warps": int(w),
                          "num_stages": cfg.num_stages, "warps": N * 32 * (128 // int(bv)) * int(w), "triton": triton})
            continue
        cfg_s, record, bv, w = parts[:4]
        N, D = map(int, cfg_s.split("x"))
        shape = Shape(N=N, D=D, H=16, HV=32, K=128, V=128)
        x = verify_inputs(0, shape)
        cfg = verify_config(parts[4:], block_v=int(bv), num_warps=int(w))
        form = "portable" if "portable" in parts[4:] else "ptx"
        extra = {}
        if "pend" in parts[4:]:  # the fused kernel: a pending tuple commit of D steps, read from a one-layer pool
            from gdn_lossless_jax.tape import Tuples

            i32 = jnp.int32
            ar = jnp.arange(N, dtype=i32)
            prev = Tuples(jnp.ones((1, N, D, shape.HV, shape.V)), jnp.ones((1, N, D, shape.H, shape.K)),
                          jnp.ones((1, N, D, shape.HV)))  # fmt: skip
            x["state0"] = jnp.broadcast_to(x["state0"], (1, *x["state0"].shape))
            extra = dict(slots=ar, layer=jnp.zeros((), i32), pending=(ar, ar % D, ar + N, ar % D, jnp.zeros((), i32), prev))
        f = lambda x, cfg=cfg, record=record, form=form, extra=extra: verify(  # noqa: E731
            **x, record=record, scale=128**-0.5, out_dtype=jnp.bfloat16, config=cfg, form=form, interpret=False, **extra)
        captured.clear()
        jax.jit(f).trace(x).lower(lowering_platforms=("cuda",))
        name = spec.replace(":", "_")
        (work / f"{name}.ttir").write_text(captured[-1])  # the verify kernel is lowered last
        index.append(dict(name=name, spec=spec, num_warps=int(w), num_stages=cfg.num_stages,
                          warps=N * shape.HV * (shape.V // int(bv)) * int(w)))
        if len(captured) > 1:  # the prologue kernel: grid (N, D) for the chain, (N, H) for the Gram form
            (work / f"{name}_prep.ttir").write_text(captured[0])
            from gdn_lossless_jax.backends.pallas.verify import gram_prep_warps, gram_steps

            gram = cfg.algorithm == "gram"
            programs = N * (shape.H if gram else D)
            pw = gram_prep_warps(gram_steps(D)) if gram else 2
            index.append(dict(name=f"{name}_prep", spec=f"{spec}[prep]", num_warps=pw, warps=programs * pw))
    (work / "index.json").write_text(json.dumps(index))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("variants", nargs="+", help="REQUESTSxDRAFTS:RECORD:BLOCK_V:NUM_WARPS[:TAG...] (tags: scripts/variants.py, portable)")
    p.add_argument("--triton-python", required=True, help="a Python with triton==3.6.0")
    p.add_argument("--work", type=Path, default=None, help="folder for the IR, PTX, cubins and stats.json")
    p.add_argument("--json", type=Path, default=None, help="also write the table as JSON here")
    args = p.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="sass_stats_"))
    work.mkdir(parents=True, exist_ok=True)
    lower(args.variants, work)
    kernels = Path(__file__).resolve().parents[1] / "gdn_lossless_jax" / "backends" / "triton"
    subprocess.run([args.triton_python, "-c", _COMPILE, str(work), str(kernels)], check=True)
    stats = json.loads((work / "stats.json").read_text())
    head = (f"{'variant':<30}{'regs':>5}{'spill B':>8}{'instr':>7}{'SHFL':>6}{'FADD':>6}{'FFMA':>6}{'FMUL':>6}{'LDS':>5}"
            f"{'BAR':>5}{'LDGSTS':>7}{'smem B':>7}{'issue us':>9}{'shfl us':>8}")
    print(head)
    for s in stats:
        m = s["mix"]
        s["issue_us"] = s["warps"] * s["instructions"] / (SM_COUNT * CLOCK_HZ * 4) * 1e6
        s["shfl_us"] = s["warps"] * m["SHFL"] / (SM_COUNT * CLOCK_HZ) * 1e6
        print(f"{s['spec']:<30}{s['registers']:>5}{s['spill_bytes']:>8}{s['instructions']:>7}{m['SHFL']:>6}{m['FADD']:>6}"
              f"{m['FFMA']:>6}{m['FMUL']:>6}{m['LDS']:>5}{m['BAR']:>5}{m['LDGSTS']:>7}{s['shared']:>7}{s['issue_us']:>9.1f}"
              f"{s['shfl_us']:>8.1f}")
    if args.json:
        args.json.write_text(json.dumps(stats, indent=1) + "\n")
    print(f"IR, PTX and cubins in {work}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
