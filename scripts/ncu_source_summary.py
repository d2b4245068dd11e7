#!/usr/bin/env python3
"""Summarise Nsight Compute's per-instruction source page, one line per profiled launch.

Reads the CSV that ``scripts/gpu_step_session.sh``'s ``sass_fused`` phase writes
(``ncu -i REPORT --page source --print-source sass --csv``; gzipped or not) and prints, for
each launch: the warp instructions a warp executed (``--warps``: the grid's warps), the share of
the stall samples by reason, and the dynamic opcode mix. ``--segments`` also splits each launch
into runs of instructions executed the same number of times a warp (straight code, a loop's
body, a branch not taken), with their long-scoreboard samples: where in the kernel a warp waits.
``--hot N``: the N instructions with the most stall samples, each with its three largest reasons.

Usage::

    python3 scripts/ncu_source_summary.py benchmarks/results/h200-2026-12-02-replay/call3/sass_fused.csv.gz \\
        --warps 12800 --labels "verify swz,verify swz,verify,verify,fused swz,fused swz,fused,fused" --segments
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io
import re


def launches(path: str) -> list[list[dict]]:
    """The source page's rows, one list per profiled launch."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        text = f.read()
    blocks = re.split(r'^"Kernel Name",[^\n]*\n', text, flags=re.MULTILINE)[1:]
    return [list(csv.DictReader(io.StringIO(b))) for b in blocks]


def opcode(source: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", source.strip()).split(" ")[0].split(".")[0]


def summary(rows: list[dict], warps: int, top: int = 7) -> str:
    stalls = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
    tot = {c: sum(float(r[c] or 0) for r in rows) for c in stalls}
    samples = sum(tot.values()) or 1.0
    mix = collections.Counter()
    for r in rows:
        mix[opcode(r["Source"])] += float(r["Instructions Executed"] or 0) / warps
    shares = ", ".join(f"{c[6:]} {v / samples:.0%}" for c, v in sorted(tot.items(), key=lambda x: -x[1])[:top])
    ops = ", ".join(f"{k} {v:.0f}" for k, v in mix.most_common(14))
    return f"{sum(mix.values()):.0f} instructions a warp; stall samples {samples:.0f}: {shares}\n    mix: {ops}"


def segments(rows: list[dict], warps: int) -> list[str]:
    """Runs of instructions executed equally often, each with its stall samples (all reasons: its share of
    the warps' time) and its long-scoreboard samples."""
    total = sum(float(x["Warp Stall Sampling (All Samples)"] or 0) for x in rows) or 1.0
    out, run, key = [], [], None
    for r in rows + [None]:
        k = None if r is None else round(float(r["Instructions Executed"] or 0) / warps, 2)
        if run and k != key:
            ops = collections.Counter(opcode(x["Source"]) for x in run).most_common(6)
            lsb = sum(float(x["stall_long_sb"] or 0) for x in run)
            all_ = sum(float(x["Warp Stall Sampling (All Samples)"] or 0) for x in run)
            out.append(
                f"    {run[0]['Address']}  x{key:5.2f} a warp  {len(run):4d} instructions  "
                f"samples {all_:6.0f} ({all_ / total:5.1%})  long_sb {lsb:6.0f}  {dict(ops)}"
            )
            run = []
        key = k
        if r is not None:
            run.append(r)
    return out


def hot(rows: list[dict], n: int) -> list[str]:
    stalls = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
    count = lambda r: float(r["Warp Stall Sampling (All Samples)"] or 0)
    total = sum(map(count, rows)) or 1.0
    out = []
    for r in sorted(rows, key=count, reverse=True)[:n]:
        why = sorted(((c[6:], float(r[c] or 0)) for c in stalls), key=lambda kv: -kv[1])[:3]
        why_s = ", ".join(f"{k} {v:.0f}" for k, v in why if v)
        out.append(
            f"    {r['Address'][-5:]}  {r['Source'].strip()[:48]:48s} {count(r):5.0f} ({count(r) / total:5.1%})  {why_s}"
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("csv")
    p.add_argument("--warps", type=int, required=True, help="warps in the grid (one-warp programs: the grid's size)")
    p.add_argument("--labels", default="", help="comma-separated names of the launches, in order")
    p.add_argument("--segments", action="store_true")
    p.add_argument("--hot", type=int, default=0, help="the instructions with the most stall samples")
    a = p.parse_args()
    labels = a.labels.split(",") if a.labels else []
    for i, rows in enumerate(launches(a.csv)):
        name = labels[i] if i < len(labels) else f"launch {i}"
        print(f"{name}: {summary(rows, a.warps)}")
        if a.segments:
            print("\n".join(segments(rows, a.warps)))
        if a.hot:
            print("\n".join(hot(rows, a.hot)))


if __name__ == "__main__":
    main()
