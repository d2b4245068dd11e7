"""Why a jitted step's wall-clock exceeds its device time: XLA's command-buffer (CUDA graph)
updates when the step's buffers move between calls.

XLA records a jit's kernels into CUDA graphs and, before each launch, compares the addresses
of the buffers the graph's kernels read and write with the last launch's; if any moved, it
re-records the kernels that touch them and updates the graph (``command_buffer::update``).
The step's index arrays (``slots``, ``rows``, ...) are read by every verify kernel and by the
commit: a new index array per step moves them all.

For the tuple step (``benchmarks/step.py``'s ``scan`` and ``unrolled``), this times interleaved
rounds of each form with the index arrays

* ``fixed``: the same device arrays every call;
* ``rotate``: the next of four device-resident sets each call (what ``benchmarks.step`` does);
* ``fresh``: new arrays put on the device from the host each call (a serving loop);

beside SGLang's CUDA graph with a fixed set and with the next set copied into its static
buffers before each replay (what SGLang's graph runner does), and a ``null`` jit. It reports
each row's median wall-clock and the median time until the call returns (dispatch). With
``--vlog`` it instead runs a few calls of each form in a child process with XLA's
command-buffer log on and counts the graph updates and their host time::

    python scripts/launch_probe.py --config 25x4
    python scripts/launch_probe.py --config 25x4 --vlog
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

FORMS = ("scan", "unrolled")
IX = ("fixed", "rotate", "fresh", "rotate-staged")


def probe(a) -> int:
    import jax
    import numpy as np

    from benchmarks import cases as bc
    from benchmarks import step as bs

    mode = bc.MODES[a.mode]
    cfg = bc.parse_configs(a.config, mode.configs)[0]
    inp = bs.make_inputs(cfg, mode.geometry, seed=0)
    p = bs._allocate(inp, "tuples", 0)
    host_sets = [tuple(np.asarray(x) for x in s) for s in inp.index_sets]
    rows = {}
    boxes = {}
    for form in a.forms.split(","):
        if form.startswith("unrolled-stack"):  # the unrolled step returning one stacked output, not a list of L
            inner = bs.direct_step(a.backend, "unrolled")
            fn = jax.jit(lambda *args, inner=inner: (lambda r: (jax.numpy.stack(r[0]), r[1], r[2]))(inner(*args)),
                         donate_argnums=(0, 1), compiler_options=bs.NO_COMMAND_BUFFERS if "nocb" in form else None)
        else:
            fn = bs.direct_step(a.backend, form) if form != "null" else jax.jit(
            lambda ssm, tape, params, xs, ix: (xs["q"][0, 0, 0, 0, :8] * ix[0][0], ssm, tape), donate_argnums=(0, 1))
        if a.hlo and form != "null":
            txt = fn.lower(p.ssm, p.tape, inp.params, inp.qkv, inp.index_sets[0]).compile().as_text()
            sel = [ln for ln in txt.splitlines() if re.search(r"= s32\[\d+\]\{0\} select\(", ln)]
            print(f"{form}: {len(sel)} rank-1 int32 selects in the compiled HLO (the staged index arrays)")
            for ln in sel[:12]:
                print("    " + ln.strip()[:160])
        # rotate-staged: the index arrays pass through one elementwise op first (a fusion XLA
        # cannot elide), so only that op reads the moving buffers; the kernels read its output
        staged = jax.jit(lambda ssm, tape, params, xs, ix, fn=fn: fn(ssm, tape, params, xs, tuple(
            jax.numpy.minimum(x, jax.numpy.int32(2**31 - 2)) for x in ix)), donate_argnums=(0, 1))
        for ix_kind in a.ix.split(","):
            f = staged if ix_kind == "rotate-staged" else fn
            box = {"d": bs._filled((p.ssm, p.tape), 7), "i": 0, "dispatch": []}
            boxes[f"{form}/{ix_kind}"] = box

            def run(fn=f, box=box, ix_kind=ix_kind):
                box["i"] += 1
                if ix_kind == "fixed":
                    ix = inp.index_sets[0]
                elif ix_kind == "rotate":
                    ix = inp.index_sets[box["i"] % len(inp.index_sets)]
                elif ix_kind == "fresh":
                    ix = jax.device_put(host_sets[box["i"] % len(host_sets)])
                else:
                    ix = inp.index_sets[box["i"] % len(inp.index_sets)]
                t = time.perf_counter()
                outs, ssm, tape = fn(*box["d"], inp.params, inp.qkv, ix)
                box["d"] = (ssm, tape)
                box["dispatch"].append(time.perf_counter() - t)
                jax.block_until_ready((outs, ssm, tape))

            rows[f"{form}/{ix_kind}"] = run
    if a.pool:
        rows.update(pool_rows(inp, a.backend, bs, boxes))
    if not a.vlog and a.peer:
        rows.update(sglang_rows(inp))
    for name, run in rows.items():
        t = time.perf_counter()
        for _ in range(3):
            run()
        print(f"{name}: warm in {time.perf_counter() - t:.2f} s", flush=True)
    if a.vlog:
        for name, run in rows.items():
            print(f"=== {name}", file=sys.stderr, flush=True)
            for _ in range(a.vlog_calls):
                print(f"--- call {name}", file=sys.stderr, flush=True)
                run()
        return 0
    if a.profile:
        import cProfile
        import pstats

        for k in a.profile.split(","):
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(5):
                rows[k]()
            pr.disable()
            print(f"\n=== cProfile of 5 calls of {k}, by own time")
            pstats.Stats(pr).sort_stats("tottime").print_stats(14)
    wall = {k: [] for k in rows}
    for b in boxes.values():
        b["dispatch"].clear()
    rng = np.random.default_rng(0)
    names = list(rows)
    for _ in range(a.rounds):
        for i in rng.permutation(len(names)):
            k = names[i]
            t = time.perf_counter()
            rows[k]()
            wall[k].append(time.perf_counter() - t)
    # back to back: the same row called in a loop, each call waiting for the last
    b2b = {}
    for k in names:
        ts = []
        for _ in range(a.rounds):
            t = time.perf_counter()
            rows[k]()
            ts.append(time.perf_counter() - t)
        b2b[k] = ts
    print(f"\n{a.config}, {a.rounds} rounds; wall-clock median us: interleaved (p10-p90) | back to back | "
          "time until the call returns (median over both)")
    for k in names:
        w = np.array(wall[k]) * 1e6
        d = boxes[k]["dispatch"] if k in boxes else []
        print(f"  {k:24s} {np.median(w):7.0f} ({np.percentile(w, 10):.0f}-{np.percentile(w, 90):.0f})"
              f" | {np.median(b2b[k]) * 1e6:7.0f} | " + (f"{np.median(d) * 1e6:7.0f}" if d else "-"))
    return 0


def pool_rows(inp, backend, bs, boxes):
    """``pool-python`` (30 x ``pool.verify_layer`` + ``pool.commit`` from Python, the index sets
    rotating), with the library's per-layer jits as they are and compiled with command buffers off."""
    import jax

    from gdn_lossless_jax import pool as gpool

    jits = {"": (gpool._verify_layer, gpool._commit)}
    off = {"xla_gpu_enable_command_buffer": ""}
    jits["-nocb"] = (jax.jit(gpool._verify_layer.__wrapped__, donate_argnums=0, static_argnames=("scale", "backend"),
                             compiler_options=off),
                     jax.jit(gpool._commit.__wrapped__, donate_argnums=0, static_argnames=("backend",),
                             compiler_options=off))
    out = {}
    for suffix, (vl, cm) in jits.items():
        box = {"p": bs._allocate(inp, "tuples", 3), "i": 0, "dispatch": []}
        boxes[f"pool-python{suffix}/rotate"] = box

        def run(box=box, vl=vl, cm=cm):
            box["i"] += 1
            keep = gpool._verify_layer, gpool._commit
            gpool._verify_layer, gpool._commit = vl, cm
            try:
                ix = inp.index_sets[box["i"] % len(inp.index_sets)]
                t = time.perf_counter()
                outs, box["p"] = bs._pool_step(box["p"], inp.layers["params"], inp.layers["pool_inputs"], ix, backend)
                box["dispatch"].append(time.perf_counter() - t)
            finally:
                gpool._verify_layer, gpool._commit = keep
            jax.block_until_ready((outs, box["p"]))

        out[f"pool-python{suffix}/rotate"] = run
    return out


def sglang_rows(inp):
    import torch

    from benchmarks import peer_sglang

    peer = peer_sglang.load(None)
    s, L = inp.shape, inp.geometry.gdn_layers
    N, D = s.N, s.D
    t = torch.from_dlpack
    dev = t(inp.qkv["q"]).device
    torch.cuda.set_device(dev)
    pool = torch.randn((L, inp.slots, s.HV, s.V, s.K), dtype=torch.float32, device=dev) * 0.5
    buf = torch.empty((L, N + 1, D, s.HV, s.V, s.K), dtype=torch.float32, device=dev)
    q, k, v, a, b = (t(inp.qkv[n]) for n in ("q", "k", "v", "a", "b"))
    A_log, dt_bias = t(inp.params["A_log"]), t(inp.params["dt_bias"])
    sets = [[t(x).clone() for x in ix] for ix in inp.index_sets]
    static = [x.clone() for x in sets[0]]
    slots, steps, tslots, tsteps, rows = static
    cu = torch.arange(0, N * D + 1, D, dtype=torch.int32, device=dev)

    def step():
        for layer in range(L):
            peer_sglang.verify_call(peer, state0=pool[layer], q=q[layer], k=k[layer], v=v[layer], a=a[layer],
                                    b=b[layer], A_log=A_log[layer], dt_bias=dt_bias[layer], buffer=buf[layer],
                                    state_idx=slots, buffer_idx=rows, cu_seqlens=cu, scale=s.K**-0.5)
        peer_sglang.scatter_call(peer, pool=pool, snapshots=buf, slots=slots, steps=steps, track_slots=tslots,
                                 track_steps=tsteps, rows=rows)

    replay, how = peer_sglang._graph_or_eager(step, torch, dev)
    print(f"sglang: {how}", flush=True)
    box = {"i": 0}

    def fixed():
        replay()
        torch.cuda.synchronize()

    def copied():
        box["i"] += 1
        for dst, src in zip(static, sets[box["i"] % len(sets)]):
            dst.copy_(src, non_blocking=True)
        replay()
        torch.cuda.synchronize()

    return {"sglang/fixed": fixed, "sglang/copy-indices": copied}


def vlog(a) -> int:
    env = dict(os.environ, TF_CPP_VMODULE="command_buffer_thunk=3", TF_CPP_MIN_LOG_LEVEL="0")
    argv = [sys.executable, __file__, "--child", "--config", a.config, "--forms", a.forms, "--mode", a.mode,
            "--backend", a.backend, "--vlog-calls", str(a.vlog_calls)] + ([] if a.pool else ["--no-pool"])
    with tempfile.TemporaryFile("w+") as err:
        r = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        err.seek(0)
        lines = [x.rstrip("\n") for x in err if x.startswith(("===", "---")) or "ommand buffer" in x]
    cur, stats = None, {}
    for line in lines:
        if line.startswith("=== "):
            cur = line[4:]
            stats[cur] = {"calls": 0, "updates": 0, "update_us": [], "allocs": []}
        elif line.startswith("--- call") and cur:
            stats[cur]["calls"] += 1
        elif cur and "Update command buffer" in line:
            stats[cur]["updates"] += 1
            m = re.search(r"updated_allocs=(\d+)", line)
            if m:
                stats[cur]["allocs"].append(int(m.group(1)))
        elif cur and "Updated command buffer in" in line:
            m = re.search(r"in (\d+)", line)
            if m:
                stats[cur]["update_us"].append(int(m.group(1)))
    print(r.stdout[-3000:])
    if r.returncode:
        print("".join(lines[-50:]))
        return r.returncode
    print(f"\n{a.config}: XLA command-buffer updates over {a.vlog_calls} calls of each form (after 3 warm-up calls)")
    for k, s in stats.items():
        us = s["update_us"]
        print(f"  {k:24s} updates {s['updates']:4d} ({s['updates'] / max(s['calls'], 1):.1f} a call); "
              f"update host time {sum(us) / max(s['calls'], 1):7.0f} us a call; updated allocations a update: "
              f"{sorted(set(s['allocs']))[:8]}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="25x4")
    ap.add_argument("--forms", default="null,scan,unrolled")
    ap.add_argument("--mode", default="h200")
    ap.add_argument("--backend", default="pallas")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--vlog", action="store_true")
    ap.add_argument("--vlog-calls", type=int, default=6)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-peer", dest="peer", action="store_false")
    ap.add_argument("--no-pool", dest="pool", action="store_false")
    ap.add_argument("--profile", default="", help="rows to run under cProfile first (comma-separated names)")
    ap.add_argument("--hlo", action="store_true", help="print the staged index ops of each form's compiled HLO")
    ap.add_argument("--ix", default=",".join(IX), help="index kinds")
    a = ap.parse_args()
    if a.vlog and not a.child:
        return vlog(a)
    a.vlog = a.child
    return probe(a)


if __name__ == "__main__":
    raise SystemExit(main())
