"""Results: derived columns (floor, bandwidth, ratios), ``results.json``, ``results.md``, ``results.png``.

Columns (per row, times per call: one layer's verify, one commit of all layers, one verify
step of the model for ``net``):
  median_us, p10_us, p90_us, min_us   over the rounds, dispatch overhead subtracted
  bytes                               that must move (:mod:`benchmarks.traffic`)
  gbps                                bytes / median (10**9 bytes per second)
  floor_us                            bytes / the copy rate measured in the same run
  x_floor                             median / floor_us (1.0 = at the byte floor)
  vs_snapshots                        the snapshot path's median / this median, same backend,
                                      work and configuration (> 1: faster than snapshots)
  vs_sglang                           SGLang's median / this median for the same work (peer run only)
  device_us                           the GPU's own kernel durations per call, from a profiler
                                      trace (no dispatch, no host clock; GPU runs only)
  device_x_floor, device_vs_snapshots the floor ratio and the snapshot ratio on device times
"""

from __future__ import annotations

import json
import math
from pathlib import Path

__all__ = ["finish_rows", "write_json", "write_markdown", "write_plot", "load_json"]

OPS = ("verify", "commit", "net")
OP_TITLES = {
    "verify": "verify, one layer",
    "commit": "commit, all layers",
    "net": "net per verify step (L x verify + commit)",
    "copy": "copy (x * 2)",
}


def finish_rows(rows: list[dict], copy_rate: float | None) -> None:
    """Add gbps, floor_us, x_floor, vs_snapshots and vs_sglang to row dicts in place."""
    by = {(r["config"], r["backend"], r["op"], r["record"]): r for r in rows}
    for r in rows:
        med = r.get("median_us")
        ok = med is not None and med > 0
        r["gbps"] = r["bytes"] / (med * 1e-6) / 1e9 if ok else None
        r["floor_us"] = r["bytes"] / copy_rate * 1e6 if copy_rate else None
        r["x_floor"] = med / r["floor_us"] if ok and r["floor_us"] else None
        snap = by.get((r["config"], r["backend"], r["op"], "snapshots"))
        r["vs_snapshots"] = snap["median_us"] / med if ok and snap and snap.get("median_us") else None
        peer = by.get((r["config"], "sglang", r["op"], "snapshots"))
        r["vs_sglang"] = peer["median_us"] / med if ok and peer and peer.get("median_us") else None
        dev = r.get("device_us")
        r["device_x_floor"] = dev / r["floor_us"] if dev and r["floor_us"] else None
        r["device_vs_snapshots"] = snap["device_us"] / dev if dev and snap and snap.get("device_us") else None
        r["device_vs_sglang"] = peer["device_us"] / dev if dev and peer and peer.get("device_us") else None


def _clean(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_json(result: dict, path: Path) -> None:
    path.write_text(json.dumps(_clean(result), indent=1) + "\n")


def load_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def _f(x, fmt="{:.1f}", none="-"):
    return none if x is None else fmt.format(x)


def _mb(n):
    return f"{n / 1e6:.1f}" if n >= 1e5 else f"{n / 1e6:.3f}"


ROW_HEADER = (
    "| backend | work | record | median us | p10-p90 us | min us | MB moved | GB/s | floor us | x floor | snap/this "
    "| sglang/this | device us | dev. x floor | dev. snap/this | notes |\n"
    "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
)


def _row_line(r: dict, with_config: bool = False) -> str:
    spread = f"{_f(r.get('p10_us'))}-{_f(r.get('p90_us'))}" if r.get("p10_us") is not None else "-"
    notes = "; ".join(r.get("notes") or [])
    if r.get("failed"):
        notes = f"FAILED: {r['failed']}"
    return ("| " + (f"{r['config']} | " if with_config else "")) + (
        f"{r['backend']} | {OP_TITLES.get(r['op'], r['op'])} | {r['record'] or '-'} | {_f(r.get('median_us'))} | {spread} "
        f"| {_f(r.get('min_us'))} | {_mb(r['bytes'])} | {_f(r.get('gbps'), '{:.3g}')} | {_f(r.get('floor_us'))} "
        f"| {_f(r.get('x_floor'), '{:.2f}')} | {_f(r.get('vs_snapshots'), '{:.2f}')} | {_f(r.get('vs_sglang'), '{:.2f}')} "
        f"| {_f(r.get('device_us'))} | {_f(r.get('device_x_floor'), '{:.2f}')} | {_f(r.get('device_vs_snapshots'), '{:.2f}')} "
        f"| {notes.replace('|', '/')} |"
    )


def _order(r):
    ops = {"verify": 0, "commit": 1, "net": 2, "copy": 3}
    be = {"reference": 0, "pallas": 1, "triton": 2, "sglang": 3, "xla": 4}
    return (ops.get(r["op"], 9), be.get(r["backend"], 5), r["backend"], r["record"] != "tuples")


def _rows_table(rows: list[dict], with_config: bool = False) -> list[str]:
    if not with_config:
        return [ROW_HEADER] + [_row_line(r) for r in sorted(rows, key=_order)]
    head = ROW_HEADER.split("\n")
    header = ["| config " + head[0], "|---" + head[1]]
    configs = list(dict.fromkeys(r["config"] for r in rows))
    return header + [_row_line(r, True) for r in sorted(rows, key=lambda r: (configs.index(r["config"]), *_order(r)))]


def _kernel_lines(rows: list[dict]) -> list[str]:
    """Per row, the kernels of its device time (launches per call, median of one launch)."""
    out = []
    for r in sorted(rows, key=_order):
        ks = (r.get("device") or {}).get("kernels") or []
        if not ks:
            continue
        parts = [f"`{k['name'][:48]}` x{k['launches_per_call']:.3g} {k['median_us']:.1f} us "
                 f"[{k['p10_us']:.1f}, {k['p90_us']:.1f}]" for k in ks[:4]]  # fmt: skip
        out.append(f"- {r['backend']} {r['op']} {r['record'] or ''}: " + "; ".join(parts))
    return (["Kernels in the device time (launches per call, median of one launch [p10, p90]):", ""] + out + [""]) if out else []


def write_markdown(result: dict, path: Path) -> None:
    m = result["meta"]
    g = m["geometry"]
    lines = [f"# gdn_lossless_jax benchmarks: mode {m['mode']}", ""]
    if m["mode"] != "h200":
        lines += ["**CPU mode: these timings are not results.** The mode keeps the harness alive in CI; "
                  "run `--mode h200` on the GPU for numbers.", ""]  # fmt: skip
    cr = result.get("copy")
    lines += [
        f"- command: `{m['command']}`",
        f"- date: {m['date']}; device: {m['device']}; jax {m['jax_version']}",
        f"- geometry: {g['name']}: L={g['gdn_layers']} GDN layers, H={g['num_k_heads']}, HV={g['num_v_heads']}, "
        f"K={g['head_k_dim']}, V={g['head_v_dim']}; state {m['state_dtype']}, inputs {m['input_dtype']}",
        f"- rounds: {m['trials']} requested per configuration (run: {', '.join(f'{k} {v}' for k, v in m['rounds_run'].items())}), "
        f"{m['warmup']} warm-up calls; verify: {m['reps']} calls per timed invocation; commit: {m['commit_reps']}",
        f"- backends: {', '.join(m['backends_run']) or 'none'}"
        + "".join(f"; skipped {k}: {v}" for k, v in m["backends_skipped"].items()),
        f"- SGLang peer: {m['peer']}",
        (f"- copy rate: **{cr['rate_gbps']:.0f} GB/s** (median over {cr['n']} timed copies of `x * 2`, "
         f"{cr['bytes'] / 2**30:.2f} GiB read + written each); byte floors below use it") if cr else "- copy rate: not measured",
        f"- elapsed: {m['elapsed_s']:.0f} s",
        "",
        "Times are per call: verify of one layer, commit of all layers, net = L x verify + commit per verify step. "
        "median and p10-p90 over interleaved rounds, dispatch overhead subtracted; floor = bytes / copy rate; "
        "x floor = median / floor; snap/this = the snapshot path's median / this one (same backend); "
        "device us = the GPU's own kernel durations per call from a profiler trace (no dispatch; GPU runs only), "
        "with its floor and snapshot ratios; see benchmarks/README.md.",
        "",
    ]  # fmt: skip
    for cfg in m["configs"]:
        rows = [r for r in result["rows"] if r["config"] == cfg]
        info = result["config_info"].get(cfg, {})
        lines += [f"## {cfg} ({info.get('requests')} requests x {info.get('drafts')} drafts, "
                  f"{info.get('track_rows_mean', 0):.1f} of them crossing a track boundary on average, "
                  f"pool of {info.get('slots')} slots, {info.get('state_copies')} state copies)", ""]  # fmt: skip
        lines += _rows_table(rows) + [""]
        lines += _kernel_lines(rows)
    if result.get("compile"):
        lines += ["## Compile time (one call, `lower().compile()` wall time, s)", "",
                  "| config | backend | verify tuples | verify snapshots | commit tuples | commit snapshots |",
                  "|---|---|---:|---:|---:|---:|"]  # fmt: skip
        for c in result["compile"]:
            t = c["seconds"]
            lines.append(
                f"| {c['config']} | {c['backend']} | {_f(t.get('verify_tuples'), '{:.2f}')} | {_f(t.get('verify_snapshots'), '{:.2f}')} "
                f"| {_f(t.get('commit_tuples'), '{:.2f}')} | {_f(t.get('commit_snapshots'), '{:.2f}')} |"
            )
        lines.append("")
    if result.get("checks"):
        lines += ["## Checks", "", "| config | backend | outputs identical in both modes | rel. error vs reference | commit in place (tuples / snapshots) |",
                  "|---|---|---|---:|---|"]  # fmt: skip
        for c in result["checks"]:
            ip = c.get("commit_in_place") or {}
            fmt_ip = lambda d: "-" if not d else ("yes" if d.get("aliased") and not d.get("pool_copies") else f"NO {d}")  # noqa: E731
            lines.append(
                f"| {c['config']} | {c['backend']} | {c.get('outputs_equal_across_modes', '-')} "
                f"| {_f(c.get('outputs_rel_err_vs_reference'), '{:.1e}')} | {fmt_ip(ip.get('tuples'))} / {fmt_ip(ip.get('snapshots'))} |"
            )
        lines.append("")
    cpu = result.get("cpu_reference")
    if cpu:
        cm = cpu["meta"]
        lines += [f"## Reference backend on the CPU ({cm['geometry']['name']}: L={cm['geometry']['gdn_layers']}, "
                  f"H={cm['geometry']['num_k_heads']}, HV={cm['geometry']['num_v_heads']}, K=V={cm['geometry']['head_k_dim']})", "",
                  f"CPU copy rate: {cpu['copy']['rate_gbps']:.1f} GB/s." if cpu.get("copy") else "", ""]  # fmt: skip
        lines += _rows_table(cpu["rows"], with_config=True) + [""]
    path.write_text("\n".join(lines) + "\n")


def write_plot(result: dict, path: Path) -> str | None:
    """A figure of verify, commit and net medians per configuration (p10-p90 bars, byte floors
    as black ticks). Returns None, or the reason no plot was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"matplotlib is not installed ({e}); pip install '.[bench]' for the plot"
    m = result["meta"]
    configs = m["configs"]
    rows = [r for r in result["rows"] if r.get("median_us") is not None]
    series = sorted({(r["backend"], r["record"]) for r in rows if r["op"] in OPS}, key=lambda br: (_order({"op": "verify", "backend": br[0], "record": br[1]})))
    if not series:
        return "no timed rows to plot"
    fig, grid = plt.subplots(2, 3, figsize=(17, 9), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    width = 0.8 / len(series)
    colors = plt.get_cmap("tab10")
    for col, op in enumerate(OPS):
        ax, axr = grid[0, col], grid[1, col]
        for j, (be, rec) in enumerate(series):
            xs, ys, lo, hi, fl, xf = [], [], [], [], [], []
            for i, cfg in enumerate(configs):
                r = next((r for r in rows if (r["config"], r["backend"], r["op"], r["record"]) == (cfg, be, op, rec)), None)
                if r is None:
                    continue
                xs.append(i - 0.4 + width * (j + 0.5))
                ys.append(r["median_us"])
                lo.append(max(r["median_us"] - (r.get("p10_us") or r["median_us"]), 0))
                hi.append(max((r.get("p90_us") or r["median_us"]) - r["median_us"], 0))
                fl.append(r.get("floor_us"))
                xf.append(r.get("x_floor"))
            if not xs:
                continue
            style = dict(color=colors(j % 10), hatch="//" if rec == "snapshots" else None, edgecolor="white")
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=f"{be} {rec}", **style)
            fx = [x for x, f in zip(xs, fl) if f]
            if fx:
                ax.scatter(fx, [f for f in fl if f], marker="_", s=250, color="black", zorder=3,
                           label="byte floor" if j == 0 else None)  # fmt: skip
            px = [(x, v) for x, v in zip(xs, xf) if v]
            if px:
                axr.bar([x for x, _ in px], [v for _, v in px], width, **style)
        ax.set_ylabel("us per call")
        ax.set_title(OP_TITLES[op])
        ax.grid(axis="y", alpha=0.3)
        axr.axhline(1.0, color="black", lw=0.8)
        axr.set_yscale("log")
        axr.set_ylabel("median / byte floor")
        axr.grid(axis="y", alpha=0.3, which="both")
        axr.set_xticks(range(len(configs)), configs)
        axr.set_xlabel("requests x drafts")
    axes = grid[0]
    axes[0].legend(fontsize=8)
    note = " (CPU mode: not results)" if m["mode"] != "h200" else ""
    cr = result.get("copy")
    fig.suptitle(f"gdn_lossless_jax on {m['device']}{note}; copy rate {cr['rate_gbps']:.0f} GB/s" if cr else m["device"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
