"""Entry point: ``python -m benchmarks.run --mode {cpu-small,h200} --out DIR``.

Times, for every available backend and configuration, verify per layer in both record
modes, commit of all layers (snapshot scatter and tuple replay, pool donated), the net cost
per verify step (L x verify + commit) and a device-to-device copy that sets the byte floor,
all interleaved in one run; optionally SGLang's own kernels as the peer baseline. Writes
``results.json``, ``results.md`` and ``results.png`` into ``--out`` (after every
configuration, so an interrupted run keeps what it finished). See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import shlex
import sys
import time
import traceback
from pathlib import Path

__all__ = ["main", "parse_args"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description="Time verify, commit and the net cost per verify step of gdn_lossless_jax against the byte floor.",
    )
    p.add_argument("--mode", choices=("cpu-small", "h200"), default="cpu-small",
                   help="h200: the Qwen3.5/3.6-35B-A3B geometry and configurations, on a GPU; cpu-small: a "
                        "reduced geometry for CI (timings are not results)")
    p.add_argument("--out", type=Path, required=True, help="folder for results.json, results.md and results.png")
    p.add_argument("--backends", default="reference,pallas,triton",
                   help="comma-separated backends; unavailable ones are skipped with the reason (default: %(default)s)")
    p.add_argument("--configs", default=None,
                   help="comma-separated REQUESTSxDRAFTS (h200 default: 25x4,8x4,8x8,8x16; cpu-small: 4x2,2x4)")
    p.add_argument("--trials", type=int, default=None, help="timed rounds per configuration (mode default)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls per row after compiling")
    p.add_argument("--reps", type=int, default=None, help="verify calls per timed invocation")
    p.add_argument("--commit-reps", type=int, default=None, help="commits per timed invocation")
    p.add_argument("--rotate-mib", type=float, default=None,
                   help="a verify row rotates through state copies holding at least this many MiB (at most --reps "
                        "copies; h200 default 192, so the 50 MB L2 cannot keep a state between its uses)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds for the timed rounds of all configurations (compiles excluded); rounds stop early "
                        "when it is spent (mode default)")
    p.add_argument("--max-wall-s", type=float, default=None,
                   help="skip configurations (and the CPU reference) that would end after this many seconds of run "
                        "time, estimated from the previous configuration (h200 default: 330; cpu-small: none)")
    p.add_argument("--peer", choices=("auto", "off"), default="auto",
                   help="auto: also time SGLang's verify and scatter kernels when they can be loaded (GPU only)")
    p.add_argument("--sglang-src", type=Path, default=None,
                   help="folder with SGLang's kernel sources (default benchmarks/_peer; see benchmarks/peer_sglang.py)")
    p.add_argument("--compile-all", action="store_true",
                   help="report the single-call compile time at every configuration (default: the first only)")
    p.add_argument("--no-cpu-reference", action="store_true",
                   help="on a GPU, skip the reference backend's small-geometry timing on the CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replot", type=Path, default=None, metavar="RESULTS_JSON",
                   help="only redraw results.md and results.png in --out from an existing results.json")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def _mode(args):
    import dataclasses

    from . import cases as bc

    m = bc.MODES[args.mode]
    rotate = None if args.rotate_mib is None else int(args.rotate_mib * 2**20)
    over = {k: v for k, v in dict(trials=args.trials, warmup=args.warmup, reps=args.reps, commit_reps=args.commit_reps,
                                  budget_s=args.budget_s, rotate_bytes=rotate).items() if v is not None}  # fmt: skip
    m = dataclasses.replace(m, **over)
    if m.trials < 1 or m.reps < 1 or m.commit_reps < 1 or m.warmup < 0:
        raise SystemExit("--trials, --reps and --commit-reps must be >= 1, --warmup >= 0")
    return dataclasses.replace(m, min_trials=min(m.min_trials, m.trials))


def _row_dict(row, samples=None) -> dict:
    import numpy as np

    from .timing import summarize

    s = row.samples() if samples is None else samples
    d = {
        "key": row.key,
        "config": row.config,
        "backend": row.backend,
        "op": row.op,
        "record": row.record,
        "calls_per_invocation": row.calls,
        "bytes": row.traffic.total,
        "bytes_read": row.traffic.read,
        "bytes_write": row.traffic.write,
        "overhead_us": float(np.median(row.overhead)) * 1e6 if row.overhead else None,
        "compile_s": row.compile_s,
        "timed_compile_s": row.timed_compile_s,
        "notes": list(row.notes),
        "failed": row.failed,
        **summarize(s),
        "samples_us": [round(float(x) * 1e6, 3) for x in s],
        "device_us": row.device["us_per_call"] if row.device else None,
        "device": row.device,
    }
    return d


class _NetRow:
    """A derived row: L x verify + commit, paired round by round."""

    def __init__(self, config, backend, record, traffic, layers):
        self.config, self.backend, self.op, self.record = config, backend, "net", record
        self.traffic, self.calls, self.overhead = traffic, 1, []
        self.compile_s = self.timed_compile_s = None
        self.notes = [f"{layers} x verify + commit, per round"]
        self.failed = None
        self.device = None

    @property
    def key(self):
        return f"{self.config}/{self.backend}/net/{self.record}"


def _net_rows(rows, layers):
    from . import traffic as tr

    out = []
    done = [r for r in rows if not r.failed and r.raw]
    for be in dict.fromkeys(r.backend for r in done):
        for rec in ("tuples", "snapshots"):
            v = next((r for r in done if (r.backend, r.op, r.record) == (be, "verify", rec)), None)
            c = next((r for r in done if (r.backend, r.op, r.record) == (be, "commit", rec)), None)
            if v is None or c is None:
                continue
            sv, sc = v.samples(), c.samples()
            n = min(len(sv), len(sc))
            net = _NetRow(v.config, be, rec, tr.net_traffic(v.traffic, c.traffic, layers), layers)
            if v.device and c.device:
                net.device = {"us_per_call": layers * v.device["us_per_call"] + c.device["us_per_call"],
                              "kernels": [], "note": f"{layers} x verify + commit device times"}
            out.append(_row_dict(net, layers * sv[:n] + sc[:n]))
    return out


def run_suite(mode, configs, backends, *, peer, clock, seed: int, label: str = "", on_config=None,
              compile_all: bool = False, max_wall_s: float | None = None) -> dict:
    """Time every configuration of ``mode`` (a :class:`benchmarks.cases.Mode`); returns the part
    of the results that depends on the device. Configurations that would end past
    ``max_wall_s`` (run time, estimated from the previous configuration) are skipped."""
    import numpy as np

    from . import suite
    from .timing import device_pass, run_rounds

    rows, compile_, checks, info, rounds, skipped_cfg = [], [], [], {}, {}, {}
    budget_left = mode.budget_s
    last_cfg_s = None
    for ci, cfg in enumerate(configs):
        tag = f"{label}{cfg.label}"
        if max_wall_s is not None and last_cfg_s is not None and clock.elapsed() + last_cfg_s > max_wall_s:
            skipped_cfg.setdefault(cfg.label, {})["all"] = (
                f"not run: {clock.elapsed():.0f} s elapsed + about {last_cfg_s:.0f} s for it > --max-wall-s {max_wall_s:.0f}")
            clock.log(f"{tag}: {skipped_cfg[cfg.label]['all']}")
            continue
        t_cfg = time.perf_counter()
        inp = suite.make_inputs(cfg, mode, seed=seed + ci)
        clock.log(f"{tag}: inputs ready: "
                  f"{inp.nbytes() / 2**30:.2f} GiB ({len(inp.states)} state copies, {len(inp.smalls)} input sets, "
                  f"pool of {inp.slots} slots, {len(inp.index_args)} commit index sets)")  # fmt: skip
        info[cfg.label] = {
            "requests": cfg.requests,
            "drafts": cfg.drafts,
            "slots": inp.slots,
            "state_copies": len(inp.states),
            "input_sets": len(inp.smalls),
            "track_rows": [int((ix.track_steps >= 0).sum()) for ix in inp.index_sets],
            "track_rows_mean": float(np.mean([(ix.track_steps >= 0).sum() for ix in inp.index_sets])),
            "accepted_steps": [ix.steps.tolist() for ix in inp.index_sets],
        }
        timed = []
        ref_out = None if "reference" in backends else suite.reference_outputs(inp)
        for be in sorted(backends, key=lambda b: b != "reference"):
            try:
                r, cs, ck, out0 = suite.backend_rows(be, inp, mode, clock, ref_out, single=compile_all or ci == 0)
            except Exception as e:  # noqa: BLE001 - one backend failing must not end the run
                msg = f"{type(e).__name__}: {str(e)[:500]}"
                skipped_cfg.setdefault(cfg.label, {})[be] = msg
                clock.log(f"{tag} {be}: skipped: {msg}")
                print("".join(traceback.format_exc().splitlines(keepends=True)[-12:]), flush=True)
                continue
            if be == "reference":
                ref_out = out0
            timed += r
            if cs:
                compile_.append({"config": cfg.label, "backend": be, "seconds": cs})
            checks.append({"config": cfg.label, "backend": be, **ck})
        if peer is not None:
            from .peer_sglang import peer_rows

            try:
                r, cs, ck = peer_rows(peer, inp, clock, ref_out)
                timed += r
                compile_.append({"config": cfg.label, "backend": "sglang", "seconds": cs})
                checks.append({"config": cfg.label, "backend": "sglang", **ck})
            except Exception as e:  # noqa: BLE001
                msg = f"{type(e).__name__}: {str(e)[:500]}"
                skipped_cfg.setdefault(cfg.label, {})["sglang"] = msg
                clock.log(f"{tag} sglang: skipped: {msg}")
                print("".join(traceback.format_exc().splitlines(keepends=True)[-12:]), flush=True)
        timed.append(suite.copy_row(inp, clock))
        t_rounds = time.perf_counter()
        share = budget_left / (len(configs) - ci)
        n = run_rounds(timed, trials=mode.trials, min_trials=mode.min_trials, deadline=t_rounds + share,
                       seed=seed + ci, clock=clock, label=tag, warmup=mode.warmup)  # fmt: skip
        if mode.device_invocations:
            device_pass(timed, invocations=mode.device_invocations, clock=clock, label=tag)
        budget_left -= time.perf_counter() - t_rounds
        rounds[cfg.label] = n
        rows += [_row_dict(r) for r in timed] + _net_rows(timed, inp.layers)
        last_cfg_s = time.perf_counter() - t_cfg
        clock.log(f"{tag}: {n} rounds of {len(timed)} rows done; configuration took {last_cfg_s:.1f} s")
        del timed, inp, ref_out
        gc.collect()
        if on_config is not None:
            on_config(rows, compile_, checks, info, rounds, skipped_cfg)
        if ci == 0 and len(configs) > 1:
            clock.log(f"{label}estimate: about {(time.perf_counter() - t_cfg) * (len(configs) - 1):.0f} s more for "
                      f"{len(configs) - 1} configurations (from the first one)")  # fmt: skip
    copies = [x for r in rows if r["op"] == "copy" for x in r["samples_us"]]
    copy = None
    if copies and np.median(copies) > 0:  # (a copy too small for the clock gives no rate)
        med = float(np.median(copies))
        nbytes = next(r["bytes"] for r in rows if r["op"] == "copy")
        copy = {"median_us": med, "bytes": nbytes, "rate_gbps": nbytes / (med * 1e-6) / 1e9, "n": len(copies)}
    from .report import finish_rows

    finish_rows(rows, copy["rate_gbps"] * 1e9 if copy else None)
    return {"rows": rows, "compile": compile_, "checks": checks, "config_info": info, "rounds": rounds,
            "skipped_per_config": skipped_cfg, "copy": copy}  # fmt: skip


def _geometry_dict(g):
    import dataclasses

    return dataclasses.asdict(g)


def _summary(result) -> str:
    """A short table for the end of the output."""
    lines = [f"{'config':<7} {'backend':<9} {'record':<9} {'verify us':>10} {'x floor':>7} {'commit us':>10} {'x floor':>7} "
             f"{'net us':>9} {'x floor':>7} {'snap/this':>9} | device us: {'verify':>7} {'commit':>7} {'net':>7} {'snap/this':>9}"]  # fmt: skip
    rows = result["rows"]
    get = lambda c, b, o, r: next((x for x in rows if (x["config"], x["backend"], x["op"], x["record"]) == (c, b, o, r)), {})  # noqa: E731
    f = lambda x, fmt: "-" if x is None else fmt.format(x)  # noqa: E731
    for c in result["meta"]["configs"]:
        for b in dict.fromkeys(x["backend"] for x in rows if x["config"] == c and x["op"] != "copy"):
            for rec in ("tuples", "snapshots"):
                v, cm, n = get(c, b, "verify", rec), get(c, b, "commit", rec), get(c, b, "net", rec)
                if not (v or cm):
                    continue
                lines.append(
                    f"{c:<7} {b:<9} {rec:<9} {f(v.get('median_us'), '{:.1f}'):>10} {f(v.get('x_floor'), '{:.2f}'):>7} "
                    f"{f(cm.get('median_us'), '{:.1f}'):>10} {f(cm.get('x_floor'), '{:.2f}'):>7} "
                    f"{f(n.get('median_us'), '{:.0f}'):>9} {f(n.get('x_floor'), '{:.2f}'):>7} {f(n.get('vs_snapshots'), '{:.2f}'):>9}"
                    f" |            {f(v.get('device_us'), '{:.1f}'):>7} {f(cm.get('device_us'), '{:.0f}'):>7} "
                    f"{f(n.get('device_us'), '{:.0f}'):>7} {f(n.get('device_vs_snapshots'), '{:.2f}'):>9}"
                )
    cr = result.get("copy")
    if cr:
        lines.append(f"copy rate {cr['rate_gbps']:.0f} GB/s; x floor = median / (bytes / copy rate); snap/this = snapshot net / this net")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    from . import report

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        result = report.load_json(args.replot)
        report.write_markdown(result, out / "results.md")
        why = report.write_plot(result, out / "results.png")
        print(f"wrote {out / 'results.md'}" + (f"; no plot: {why}" if why else f" and {out / 'results.png'}"))
        return 0
    if args.mode == "h200":
        # Leave room for torch (the SGLang peer) beside JAX's preallocated pool: set before JAX
        # is imported (it is read when the GPU client starts).
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")
    import jax

    from . import cases as bc

    mode = _mode(args)
    configs = bc.parse_configs(args.configs, mode.configs)
    max_wall = args.max_wall_s if args.max_wall_s is not None else (330.0 if args.mode == "h200" else None)

    from . import suite
    from .timing import Clock

    clock = Clock(quiet=args.quiet)
    platform = jax.default_backend()
    dev = jax.devices()[0]
    if args.mode == "h200" and platform != "gpu":
        print(f"--mode h200 needs a GPU; JAX's default platform here is {platform!r}. Use --mode cpu-small.", file=sys.stderr)
        return 2
    names = [b.strip() for b in args.backends.split(",") if b.strip()]
    backends, skipped = suite.available_backends(names)
    for b, why in skipped.items():
        clock.log(f"backend {b}: skipped: {why}")
    peer, peer_note = None, "off (--peer off)"
    if args.peer == "auto":
        if platform != "gpu":
            peer_note = f"not run: SGLang's kernels need a CUDA GPU (platform {platform!r})"
        else:
            from .peer_sglang import PeerUnavailable, load

            try:
                peer = load(args.sglang_src)
                peer_note = f"{peer.origin}"
            except PeerUnavailable as e:
                peer_note = f"not run: {e}"
    clock.log(f"{dev.device_kind} ({platform}); mode {mode.name}; configurations {', '.join(c.label for c in configs)}; "
              f"backends {', '.join(backends) or 'none'}; SGLang peer: {peer_note}")  # fmt: skip
    g = mode.geometry
    meta = {
        "mode": mode.name,
        "command": "python -m benchmarks.run " + " ".join(shlex.quote(a) for a in args.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"{dev.device_kind} ({platform})",
        "jax_version": jax.__version__,
        "python": sys.version.split()[0],
        "geometry": _geometry_dict(g),
        "state_dtype": "float32",
        "input_dtype": "bfloat16",
        "configs": [c.label for c in configs],
        "track_fraction": bc.TRACK_FRACTION,
        "trials": mode.trials,
        "min_trials": mode.min_trials,
        "warmup": mode.warmup,
        "reps": mode.reps,
        "commit_reps": mode.commit_reps,
        "rotate_bytes": mode.rotate_bytes,
        "budget_s": mode.budget_s,
        "max_wall_s": max_wall,
        "backends_requested": names,
        "backends_run": backends,
        "backends_skipped": skipped,
        "peer": peer_note,
        "seed": args.seed,
    }
    result = {"meta": meta, "rows": [], "copy": None}

    def save(rows=None, compile_=None, checks=None, info=None, rounds=None, skipped_cfg=None, final=False):
        if rows is not None:
            result.update(rows=rows, compile=compile_, checks=checks, config_info=info)
            meta["rounds_run"], meta["skipped_per_config"] = rounds, skipped_cfg
        meta["elapsed_s"] = clock.elapsed()
        if not final:  # an interim file: the rows so far, ratios without the final copy rate
            from .report import finish_rows

            import numpy as np

            copies = [x for r in result["rows"] if r["op"] == "copy" for x in r["samples_us"]]
            if copies and np.median(copies) > 0:
                nb = next(r["bytes"] for r in result["rows"] if r["op"] == "copy")
                rate = nb / (float(np.median(copies)) * 1e-6) / 1e9
                result["copy"] = {"median_us": float(np.median(copies)), "bytes": nb, "rate_gbps": rate, "n": len(copies)}
                finish_rows(result["rows"], rate * 1e9)
        report.write_json(result, out / "results.json")
        report.write_markdown(result, out / "results.md")

    meta["rounds_run"], meta["skipped_per_config"] = {}, {}
    part = run_suite(mode, configs, backends, peer=peer, clock=clock, seed=args.seed,
                     on_config=lambda *a: save(*a), compile_all=args.compile_all, max_wall_s=max_wall)  # fmt: skip
    result.update(part)
    meta["rounds_run"], meta["skipped_per_config"] = part.pop("rounds"), part.pop("skipped_per_config")
    for k in ("rounds", "skipped_per_config"):
        result.pop(k, None)
    if max_wall is not None and clock.elapsed() > max_wall - 30 and platform != "cpu":
        clock.log(f"reference backend on the CPU: not run ({clock.elapsed():.0f} s elapsed, --max-wall-s {max_wall:.0f})")
    elif platform != "cpu" and not args.no_cpu_reference and "reference" in names:
        cpu_mode = bc.CPU_REFERENCE_MODE
        cpu = jax.devices("cpu")[0]
        clock.log(f"reference backend on the CPU, {cpu_mode.geometry.name}")
        with jax.default_device(cpu):
            c = run_suite(cpu_mode, bc.parse_configs(None, cpu_mode.configs), ["reference"], peer=None, clock=clock,
                          seed=args.seed, label="cpu ")  # fmt: skip
        result["cpu_reference"] = {
            "meta": {"geometry": _geometry_dict(cpu_mode.geometry), "configs": list(cpu_mode.configs), "device": cpu.device_kind,
                     "rounds_run": c["rounds"], "trials": cpu_mode.trials},
            "rows": c["rows"], "compile": c["compile"], "copy": c["copy"],
        }  # fmt: skip
    save(final=True)
    why = report.write_plot(result, out / "results.png")
    clock.log(f"wrote {out / 'results.json'}, {out / 'results.md'}" + (f"; no plot: {why}" if why else f", {out / 'results.png'}"))
    print(_summary(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
