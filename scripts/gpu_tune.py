"""Launch-configuration sweep for the Pallas kernels, timed on the device (profiler trace).

Every variant is one jitted call; it runs ``CALLS`` times over ``COPIES`` state copies and
input sets (so the 50 MB L2 cannot keep a state between uses), and its device time is the
sum of the GPU's own kernel durations per call (benchmarks/devtime.py): no dispatch, no
host clock. Prints a table; writes ``$OUT/tune.json``. Rank configurations with it; the
benchmark (``python -m benchmarks.run``) gives the results.

Usage: python3 scripts/gpu_tune.py [verify] [commit]   (default: both)
"""

import json
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
from variants import commit_case, triton_verify_config, verify_config

import gdn_lossless_jax as gl
from benchmarks.devtime import copy_rate, device_time
from benchmarks.traffic import verify_traffic
from gdn_lossless_jax import backends
from gdn_lossless_jax.cases import Shape, verify_inputs

CALLS, COPIES = 16, 4
out_dir = os.environ.get("OUT", "/tmp")
parts = sys.argv[1:] or ["verify", "commit"]
rows = []
T0 = time.perf_counter()


def log(msg):
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def record(name, dev, **extra):
    ks = dev["kernels"]
    row = dict(variant=name, device_us=dev["us_per_call"], kernels=ks, **extra)
    rows.append(row)
    main = ks[0]
    regs = re.search(r"regs:(\d+)", main.get("details", ""))
    log(f"{name:<48} {dev['us_per_call']:8.1f} us/call  main {main['name'][:28]:<28} {main['median_us']:7.1f} "
        f"[{main['p10_us']:.1f}, {main['p90_us']:.1f}] x{main['launches_per_call']:.2g}  others "
        f"{dev['us_per_call'] - main['us_per_call']:.1f} us" + (f"  regs {regs.group(1)}" if regs else ""))


def multi(f, arg_sets):
    def run():
        outs = [f(*arg_sets[i % len(arg_sets)]) for i in range(CALLS)]
        jax.block_until_ready(outs)

    return run


copy_us, rate = copy_rate()
log(f"copy 2 GiB: {copy_us:.1f} us, rate {rate / 1e9:.0f} GB/s")
rows.append(dict(variant="copy 2 GiB", device_us=copy_us, rate_gbps=rate / 1e9))

if "verify" in parts:
    # TUNE_VERIFY: ALGORITHM:BLOCK_V:NUM_WARPS:K_CHUNK[:TAG...],... with the tags of scripts/variants.py (default:
    # the chain's and the Gram form's best launches of the fifth session; benchmarks/NOTES.md). ALGORITHM "triton":
    # the triton backend's verify (its VerifyConfig; tags nsN, phN, tf/rf, noef).
    spec = os.environ.get("TUNE_VERIFY", "chain:8:1:16,chain:16:1:16,gram:8:1:16,gram:16:1:16")
    configs = []
    for a, bv, w, kc, *more in (x.split(":") for x in spec.split(",")):
        if a == "triton":
            try:
                configs.append((backends.resolve("triton", "verify"), triton_verify_config(more, block_v=int(bv), num_warps=int(w), k_chunk=int(kc))))
            except Exception as e:  # noqa: BLE001  (triton without jax-triton)
                log(f"verify triton: unavailable ({e})")
        else:
            configs.append((backends.resolve("pallas", "verify"), verify_config(more, algorithm=a, block_v=int(bv), num_warps=int(w), k_chunk=int(kc))))
    shapes = os.environ.get("TUNE_SHAPES", "25x4,8x16,8x4,8x8").split(",")
    for N, D in [tuple(map(int, x.split("x"))) for x in shapes]:
        shape = Shape(N=N, D=D, H=16, HV=32, K=128, V=128)
        xs = [verify_inputs(i, shape) for i in range(COPIES)]
        floor_t, floor_s = (verify_traffic(shape, rec).total / rate * 1e6 for rec in ("tuples", "snapshots"))
        log(f"verify {N}x{D}: floors tuples {floor_t:.1f} us, snapshots {floor_s:.1f} us")
        for mod, cfg in configs:
            for rec in gl.RECORD_MODES:
                f = jax.jit(lambda x, cfg=cfg, rec=rec, mod=mod: mod.verify(**x, record=rec, scale=128**-0.5, out_dtype=jnp.bfloat16, config=cfg))
                tri = not hasattr(cfg, "algorithm")
                name = (f"verify {N}x{D} {rec[:5]} {'triton' if tri else cfg.algorithm} bv{cfg.block_v} w{cfg.num_warps} kc{cfg.k_chunk}"
                        + ("" if tri else f" un{cfg.unroll}" + (" 1pass" if cfg.one_pass else "") + ("" if cfg.prefetch_q else " lq") + (" mma" if cfg.products == "mma" else ""))
                        + (f" ns{cfg.num_stages}" if cfg.num_stages != 1 else "")
                        + (" ef" if cfg.evict else "") + (f" ph{cfg.prep_heads}" if cfg.prep_heads else "") + {"tiles": " tf", "requests": " rf", None: ""}[cfg.order]
                        + {None: "", "none": " dfn", "u": " dfu", "both": " dfb"}[getattr(cfg, "dot_fma", None)])
                try:
                    jax.block_until_ready(f(xs[0]))
                    dev = device_time(multi(f, [(x,) for x in xs]), 2, CALLS)
                except Exception as e:  # noqa: BLE001
                    log(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}")
                    continue
                floor = floor_t if rec == "tuples" else floor_s
                record(name, dev, kind="verify", N=N, D=D, record=rec, block_v=cfg.block_v, num_warps=cfg.num_warps,
                       one_pass=getattr(cfg, "one_pass", False), algorithm="triton" if tri else cfg.algorithm, products=getattr(cfg, "products", "fma"),
                       k_chunk=cfg.k_chunk, unroll=getattr(cfg, "unroll", 0), floor_us=floor, x_floor=dev["us_per_call"] / floor)
        del xs
    json.dump(rows, open(os.path.join(out_dir, "tune.json"), "w"), indent=1)

if "commit" in parts:
    # TUNE_COMMIT: BACKEND:BLOCK_V:NUM_WARPS[:TAG...],... (ef: the replay's pool states loaded and stored
    # evict_first; without it, Triton's default eviction, the default of both backends' CommitConfig; nsN: num_stages;
    # requests / tiles / heads: Pallas's CommitConfig.order; without one, the backend's default; kt / unN: the
    # k_tile / unroll fields of a patch, below)
    cspec = os.environ.get("TUNE_COMMIT", "pallas:32:8,pallas:32:8:ef,pallas:16:8,pallas:8:1,"
                                          "triton:32:2,triton:32:2:ef,triton:32:4,triton:64:2")
    # TUNE_COMMIT_SHAPES: REQUESTSxDRAFTS,... (30 layers each; default 25x4); TUNE_COMMIT_OPS: replay,scatter
    ccfgs = []
    for b, bv, w, *more in (x.split(":") for x in cspec.split(",")):
        try:
            mod = backends.resolve(b, "commit")
        except Exception as e:  # noqa: BLE001  (triton without jax-triton)
            log(f"commit {b}: unavailable ({e})")
            continue
        stages = [int(x[2:]) for x in more if x[:2] == "ns" and x[2:].isdigit()]
        extra = ({"num_stages": stages[-1]} if stages else {}) | ({"evict": "evict_first"} if "ef" in more else {})
        orders = [o for o in ("requests", "tiles", "heads") if o in more]
        extra |= {"order": orders[-1]} if orders else {}
        if b == "pallas":  # kt, unN: fields of results/h200-2026-11-30h/pallas-commit-k-tile-unroll.patch (not kept)
            extra |= {"k_tile": True} if "kt" in more else {}
            unrolls = [int(x[2:]) for x in more if x[:2] == "un" and x[2:].isdigit()]
            extra |= {"unroll": unrolls[-1]} if unrolls else {}
        ccfgs.append((b, mod, mod.CommitConfig(block_v=int(bv), num_warps=int(w), **extra)))
    L = 30
    for N, D in [tuple(map(int, x.split("x"))) for x in os.environ.get("TUNE_COMMIT_SHAPES", "25x4").split(",")]:
        pool0, tup, snp, idx = commit_case(N, D, L)
        pool = [pool0]
        tapes = {"replay": tup, "scatter": snp}
        for name in os.environ.get("TUNE_COMMIT_OPS", "replay,scatter").split(","):
            tape = tapes[name]
            for b, mod, cfg in ccfgs:
                f = jax.jit(lambda pool, tape, cfg=cfg, mod=mod, idx=idx: mod.commit(pool, tape, *idx, config=cfg),
                            donate_argnums=0)

                def run(f=f, tape=tape, pool=pool):
                    pool[0] = f(pool[0], tape)
                    jax.block_until_ready(pool[0])

                run()
                dev = device_time(run, 6, 1)
                tags = ((" ef" if cfg.evict else "") + (f" {cfg.order}" if getattr(cfg, "order", None) else "")
                        + (" kt" if getattr(cfg, "k_tile", False) else "")
                        + (f" un{cfg.unroll}" if getattr(cfg, "unroll", 0) else ""))
                record(f"commit {b} {name} {L}L {N}x{D} bv{cfg.block_v} w{cfg.num_warps} ns{cfg.num_stages}{tags}", dev,
                       kind="commit", backend=b, op=name, N=N, D=D, block_v=cfg.block_v, num_warps=cfg.num_warps,
                       num_stages=cfg.num_stages, evict=cfg.evict)
            del tape
        del pool0, tup, snp, tapes, pool
    json.dump(rows, open(os.path.join(out_dir, "tune.json"), "w"), indent=1)

log("done")
