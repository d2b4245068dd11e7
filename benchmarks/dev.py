"""The benchmarks' developer helpers, one subcommand each (run from the repository root)::

    python -m benchmarks.dev idle-spinners [--cpus 0-7] [--policy idle|nice|pause] -- COMMAND...
    python -m benchmarks.dev tune-fused --configs 25x4 --variants unrolled-out,fused-out:pair
    python -m benchmarks.dev fused-step-hlo --configs 25x4 --backends mosaic,pallas --out /tmp/hlo

* ``idle-spinners``: runs a command while every CPU is kept out of its idle state, for back-to-back
  timings on machines whose idle CPUs halt;
* ``tune-fused``: times the fused step per Pallas (or Triton) kernel launch at a shape, to pick an
  entry of ``gdn_lossless_jax.backends.pallas.verify.TUNED``;
* ``fused-step-hlo``: compiles the benchmark's fused step from shapes and prints its pool-, tape-
  and outputs-sized copies and aliased bytes.

Each subcommand's section below starts with what it does in full; the heavy imports (JAX, the
benchmarks) are made by the subcommands that need them, so ``idle-spinners`` forks no JAX process.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _heavy() -> None:
    """The imports of the JAX subcommands, into this module's globals."""
    global jax, bc, bstep, device_time, gp, PENDING_REPLAYS, VerifyConfig
    for p in (ROOT, ROOT / "tests"):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))
    import jax

    from benchmarks import cases as bc
    from benchmarks import step as bstep
    from benchmarks.devtime import device_time
    from gdn_lossless_jax.backends import pallas as gp
    from gdn_lossless_jax.backends.pallas.verify import PENDING_REPLAYS, VerifyConfig


# ---------------------------------------------------------------------------------------------
# idle-spinners
# ---------------------------------------------------------------------------------------------
# Run a command while every CPU is kept out of its idle state by a process of the lowest priority.
#
# On a machine whose idle CPUs halt (a virtual machine without a cpuidle driver, for one), a jitted JAX call
# that follows a millisecond or more in which JAX had nothing to do pays for waking JAX's runtime threads on
# halted CPUs (0.15-0.35 ms a call on an H200 host). With every CPU kept busy at the lowest priority that
# cost goes away, so back-to-back timings measure the step, not the wake-ups (``docs/step.md``).
#
# Each spinner is pinned to one CPU and runs under ``SCHED_IDLE`` (Linux' lowest class: any other thread
# that wakes on its CPU preempts it at once, and the scheduler counts such a CPU as idle when it places a
# woken thread), so no CPU ever halts and no thread waits for one. ``--policy nice`` runs them at nice
# 19 in the normal class instead; ``--policy pause`` likewise, each a C loop of x86 ``pause`` instructions
# (built with ``cc`` into a temporary folder), which leaves more of a shared core to its other hardware
# thread than Python's loop does::
#
#     python -m benchmarks.dev idle-spinners -- python -m benchmarks.step --out /tmp/step ...
#     python -m benchmarks.dev idle-spinners --cpus 0-7 --policy nice -- python -m benchmarks.step ...
#
# The command's exit status is returned; the spinners are killed when it ends.


def parse_cpus(text: str | None) -> list[int]:
    if not text:
        return sorted(os.sched_getaffinity(0))
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


PAUSE_LOOP = "#include <immintrin.h>\nint main(void) { for (;;) _mm_pause(); }\n"


def build_pause_loop(folder: str) -> str:
    """The ``pause`` spinner, compiled with ``cc``: its path."""
    src, exe = os.path.join(folder, "pause_loop.c"), os.path.join(folder, "pause_loop")
    with open(src, "w") as f:
        f.write(PAUSE_LOOP)
    subprocess.run(["cc", "-O2", "-o", exe, src], check=True)
    return exe


def spin(cpu: int, policy: str, exe: str | None) -> None:  # in the child: never returns
    os.sched_setaffinity(0, {cpu})
    if policy == "idle":
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    else:
        os.nice(19)
    if exe:
        os.execv(exe, [exe])  # keeps the affinity and the nice value
    while True:
        pass


def idle_spinners(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks.dev idle-spinners",
                                 description="Run a command while every CPU is kept out of its idle state.")
    ap.add_argument("--cpus", help="CPUs to keep busy, e.g. 0-15 or 0,2,4 (default: all this process may use)")
    ap.add_argument("--policy", choices=("idle", "nice", "pause"), default="idle",
                    help="idle: SCHED_IDLE Python loops; nice: nice-19 Python loops; pause: nice-19 C pause loops")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command to run")
    a = ap.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("no command given (write it after --)")
    cpus = parse_cpus(a.cpus)
    if a.policy == "pause" and platform.machine() not in ("x86_64", "AMD64"):
        ap.error(f"--policy pause runs x86 pause instructions; this machine is {platform.machine()}")
    tmp = tempfile.TemporaryDirectory()
    exe = build_pause_loop(tmp.name) if a.policy == "pause" else None
    pids = []
    for cpu in cpus:
        pid = os.fork()
        if pid == 0:
            try:
                spin(cpu, a.policy, exe)
            finally:
                os._exit(1)
        pids.append(pid)
    print(f"idle_spinners: {len(pids)} spinners ({a.policy}) on CPUs {cpus}, pids {pids}", file=sys.stderr, flush=True)
    try:
        return subprocess.call(cmd)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        for pid in pids:
            os.waitpid(pid, 0)
        tmp.cleanup()


# ---------------------------------------------------------------------------------------------
# tune-fused
# ---------------------------------------------------------------------------------------------
# Time the fused step per launch of the Pallas (or Triton) kernel, to pick a tuned launch for a shape.
#
# The fused step is ``benchmarks.step``'s ``fused`` (a ``lax.scan``) or ``fused-out`` (unrolled, outputs in
# place) row; each variant names a ``VerifyConfig`` by tags, beside the separate steps of the same run. A
# variant's ``VerifyConfig`` reaches the kernel as its backend's default launch (``verify``'s keyword default,
# set while the variant's step is traced: a static argument of the kernel's jit, so every variant compiles its
# own kernel). Prints, per configuration and variant, the step's device time per call, its back-to-back
# wall-clock, the fused kernel's median launch and its registers (from the profiler trace); writes
# ``$OUT/tune_fused.json``. The winner at a shape goes into ``gdn_lossless_jax.backends.pallas.verify.TUNED``
# (``docs/step.md``). From the repository root, on a GPU::
#
#     python -m benchmarks.dev tune-fused --configs 25x4 --variants unrolled-out,fused-out:pair,fused-out:pair:split


# Tags naming VerifyConfig fields: a tag adds to or overrides the fields a variant sets; other tags are ignored.
_NUMBERED = {"kc": "k_chunk", "un": "unroll", "ns": "num_stages", "ph": "prep_heads"}  # tag prefix -> field
_ORDERS = {"tf": {"order": "tiles"}, "rf": {"order": "requests"}}
_DOT_FMA = {"dfn": {"dot_fma": "none"}, "dfu": {"dot_fma": "u"}, "dfb": {"dot_fma": "both"}}
_REPLAYS = {"prc": {"pending_replay": "carry"}, "prs": {"pending_replay": "split"}, "prr": {"pending_replay": "rows"},
            "psv": {"pending_slice_v": True}}


def _apply(tags, fields: dict, named: dict, numbered) -> dict:
    """``fields`` with each tag applied in turn: a name from ``named`` (its field values), or a
    prefix from ``numbered`` (prefix -> field) followed by a number."""
    for tag in tags:
        if tag in named:
            fields.update(named[tag])
        elif tag[:2] in numbered and tag[2:].isdigit():
            fields[numbered[tag[:2]]] = int(tag[2:])
    return fields


def verify_config(tags, **fields):
    """The Pallas backend's :class:`VerifyConfig`: ``gram``, ``one_pass``, ``kcN``, ``unN``, ``nsN``,
    ``phN``, ``noef`` (``evict=None``), ``lq`` (``prefetch_q=False``), ``mma``, ``tf`` / ``rf`` (grid
    order), ``dfn`` / ``dfu`` / ``dfb`` (``dot_fma``), ``prc`` / ``prs`` / ``prr`` (``pending_replay``),
    ``psv`` (``pending_slice_v=True``)."""
    named = {"gram": {"algorithm": "gram"}, "one_pass": {"one_pass": True}, "noef": {"evict": None},
             "lq": {"prefetch_q": False}, "mma": {"products": "mma"}, **_ORDERS, **_DOT_FMA, **_REPLAYS}  # fmt: skip
    return VerifyConfig(**_apply(tags, fields, named, _NUMBERED))


def triton_verify_config(tags, **fields):
    """The Triton backend's :class:`VerifyConfig`: ``kcN``, ``nsN``, ``phN``, ``bvN`` (``block_v=N``),
    ``chr`` / ``chc`` (``chain``), ``unr`` / ``unl`` (``unroll``), ``tf`` / ``rf``, ``noef`` (``evict=""``),
    ``prs`` / ``prr`` (``pending_replay``)."""
    from gdn_lossless_jax.backends.triton import VerifyConfig as TritonConfig

    numbered = {k: _NUMBERED[k] for k in ("kc", "ns", "ph")} | {"bv": "block_v"}
    named = {"noef": {"evict": ""}, "prs": {"pending_replay": "split"}, "prr": {"pending_replay": "rows"},
             "chr": {"chain": "rows"}, "chc": {"chain": "chunks"}, "unr": {"unroll": True},
             "unl": {"unroll": False}, **_ORDERS}  # fmt: skip
    return TritonConfig(**_apply(tags, fields, named, numbered))


T0 = time.perf_counter()


def log(msg):
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def tune_fused(argv=None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks.dev tune-fused", description="Time the fused step per launch of the Pallas "
                                "(or Triton) kernel, to pick a tuned launch for a shape.")
    p.add_argument("--configs", default="25x4,8x16,8x8,8x4")
    p.add_argument("--variants", default="scan,unrolled-out,fused,fused-out,fused-out:fixed,fused-out:pair",
                   help="KIND[:TAG...]: a separate step (benchmarks.step's scan, unrolled-out) or fused / "
                        "fused-out; tags: a pending_replay, slice (the fused tuple kernel reads v sliced out by "
                        "XLA), fixed (the two tapes keep their roles between calls: the same work, wrong for a "
                        "decode, to see what their swap costs), pair (one executable per parity of the step), "
                        "triton (the Triton backend's kernels instead of Pallas': a pending_replay of its own, "
                        "rows or split), npf (with triton: VerifyConfig.prefetch_pending=False), bvN (with triton: "
                        "block_v=N), "
                        "lq (Pallas: prefetch_q=False, each step's q loaded in that step), tuned (Pallas: the "
                        "backend's default, tuned_config of the shape), and the VerifyConfig tags of verify_config "
                        "(Pallas: dfn / dfu / dfb for a dot_fma, kcN, ...)")
    p.add_argument("--records", default="tuples", help="record modes of the step (the pending tape's too)")
    p.add_argument("--calls", type=int, default=4, help="steps per traced invocation")
    p.add_argument("--invocations", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wall-calls", type=int, default=30, help="calls timed back to back by the host clock")
    p.add_argument("--mode", default="h200", choices=sorted(bc.MODES), help="geometry (benchmarks.cases.MODES)")
    args = p.parse_args(argv)
    mode = bc.MODES[args.mode]
    rows = []
    default = VerifyConfig()  # the class defaults (the backend's default is None: its tuned_config of the shape)
    for cfg in bc.parse_configs(args.configs, mode.configs):
        inp = bstep.make_inputs(cfg, mode.geometry, seed=args.seed)
        s, L = inp.shape, inp.geometry.gdn_layers
        for record in args.records.split(","):
            pool = bstep._allocate(inp, record, args.seed)
            o_box = [bstep._filled(jax.ShapeDtypeStruct((L, s.N, s.D, s.HV, s.V), inp.qkv["q"].dtype), args.seed + 9)]
            for variant in args.variants.split(","):
                kind, *tags = variant.split(":")
                backend = "triton" if "triton" in tags else "pallas"
                if backend == "triton":
                    from gdn_lossless_jax.backends import triton as gt
                    from gdn_lossless_jax.backends.triton.verify import PENDING_REPLAYS as TRITON_REPLAYS

                    impl, saved = gt, gt.verify.__kwdefaults__["config"]
                    replay = next((t for t in tags if t in TRITON_REPLAYS), gt.VerifyConfig().pending_replay)
                    launch = triton_verify_config(tags, pending_replay=replay, prefetch_pending="npf" not in tags)
                else:
                    replay = next((t for t in tags if t in PENDING_REPLAYS), default.pending_replay)
                    impl, saved = gp, gp.verify.__kwdefaults__["config"]
                    # verify_config's tags apply too (dfu: dot_fma="u", kcN, ...)
                    launch = None if "tuned" in tags else verify_config(
                        tags, pending_replay=replay, pending_slice_v="slice" in tags, prefetch_q="lq" not in tags)
                impl.verify.__kwdefaults__["config"] = launch
                try:
                    if not kind.startswith("fused"):  # the separate step: the variant's verify launch
                        box = [bstep._filled((pool.ssm, pool.tape), args.seed + 7)]
                        one = bstep.direct_runner(bstep.direct_step(backend, kind), kind, inp, box, o_box,
                                                  lambda inp=inp: inp.index_sets[0])  # fmt: skip
                    else:
                        form = "unrolled-out" if kind == "fused-out" else "scan"
                        # pair: one executable per parity of the step (each sees the tapes in the same roles)
                        fns = [bstep.fused_step(backend, form=form) for _ in range(2 if "pair" in tags else 1)]
                        box = [bstep._filled((pool.ssm, pool.tape, pool.tape), args.seed + 11)]
                        one = bstep.fused_runner(fns, form, inp, box, o_box, fixed="fixed" in tags)

                    for _ in range(2):  # both parities compiled
                        jax.block_until_ready(one())

                    def run(one=one, box=box):
                        for _ in range(args.calls):
                            one()
                        jax.block_until_ready(box[0])

                    dev = device_time(run, args.invocations, args.calls)
                    walls = []
                    for _ in range(args.wall_calls):  # back to back, each call waiting for the last
                        t = time.perf_counter()
                        jax.block_until_ready(one())
                        walls.append(time.perf_counter() - t)
                finally:
                    impl.verify.__kwdefaults__["config"] = saved
                if dev is None:
                    log(f"{cfg.label} {record} {variant}: ran; no GPU kernels to time")
                    continue
                # the chain (Pallas: gdn_verify_<record>; jax-triton names it after the Triton function)
                main_k = next(k for k in dev["kernels"] if "verify" in k["name"] and "prep" not in k["name"])
                regs = re.search(r"regs:(\d+)", main_k.get("details", ""))
                wall = sorted(walls)
                row = dict(config=cfg.label, record=record, variant=variant, step_us=dev["us_per_call"],
                           wall_us=[w * 1e6 for w in walls],
                           verify_median_us=main_k["median_us"], verify_us_per_step=main_k["us_per_call"],
                           regs=int(regs.group(1)) if regs else None, kernels=dev["kernels"][:6])  # fmt: skip
                rows.append(row)
                log(f"{cfg.label} {record:<9} {variant:<22} step {dev['us_per_call']:8.1f} us   "
                    f"wall b2b median {wall[len(wall) // 2] * 1e6:7.1f} (p10 {wall[len(wall) // 10] * 1e6:7.1f}, "
                    f"p90 {wall[len(wall) * 9 // 10] * 1e6:7.1f})  "
                    f"verify kernel {main_k['median_us']:6.1f} us x{main_k['launches_per_call']:.0f}"
                    f"  regs {row['regs']}")
            del pool
        del inp
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "tune_fused.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


# ---------------------------------------------------------------------------------------------
# fused-step-hlo
# ---------------------------------------------------------------------------------------------
# The compiled HLO of ``benchmarks.step``'s fused step (``fused-out``) at a benchmark size: its
# pool-, tape- and outputs-sized copies (``tests/test_step.py::benchmark_fused_step_copies``, which
# ``test_benchmark_sized_fused_step_has_no_copy`` runs on a GPU at 25x4) and the bytes it aliases.
# Compiles only (the arguments are shapes), so any size fits.
#
#     python -m benchmarks.dev fused-step-hlo --configs 25x4 --backends mosaic,pallas --records snapshots --out /tmp/hlo


def fused_step_hlo(argv=None) -> int:
    from test_step import benchmark_fused_step_copies

    p = argparse.ArgumentParser(prog="benchmarks.dev fused-step-hlo", description="The compiled HLO of the benchmark's "
                                "fused step: its pool-, tape- and outputs-sized copies and the bytes it aliases.")
    p.add_argument("--configs", default="25x4")
    p.add_argument("--backends", default="mosaic,pallas")
    p.add_argument("--records", default="snapshots,tuples")
    p.add_argument("--mode", choices=tuple(bc.MODES), default="h200")
    p.add_argument("--families", default="model", help=f"comma list of {bc.FAMILIES}")
    p.add_argument("--out", default=None, help="a folder for the HLO texts (gzip)")
    args = p.parse_args(argv)
    for label in [f"{c} {f}".strip() for c in args.configs.split(",") for f in args.families.split(",")]:
        for record in args.records.split(","):
            for backend in args.backends.split(","):
                bad, temps, aliased, compiled = benchmark_fused_step_copies(*label.split()[:1], backend, record,
                                                                            args.mode, *label.split()[1:])
                print(f"{label} {backend} {record}: {len(bad)} copies or unaliased; temps {temps / 2**20:.1f} MiB, "
                      f"aliased {aliased / 2**30:.2f} GiB", flush=True)  # fmt: skip
                for line in bad:
                    print("   ", line, flush=True)
                if args.out:
                    Path(args.out).mkdir(parents=True, exist_ok=True)
                    with gzip.open(Path(args.out) / f"{label.replace(' ', '-')}-{backend}-{record}.hlo.gz", "wt") as fh:
                        fh.write(compiled.as_text())
    return 0


COMMANDS = {"idle-spinners": idle_spinners, "tune-fused": tune_fused, "fused-step-hlo": fused_step_hlo}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        print(__doc__, file=sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    if name != "idle-spinners":
        _heavy()
    return COMMANDS[name](rest)


if __name__ == "__main__":
    sys.exit(main())
