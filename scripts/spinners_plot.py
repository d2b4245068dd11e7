"""Plot the fused step's speed-up over SGLang's step per run, with and without idle spinners.

Reads ``benchmarks.step`` results (``results.json``) of runs made plainly and under
``scripts/idle_spinners.py`` (a ``wrapper.txt`` beside the run's ``step/`` folder holds its wrapper
command; else the folder name says which: ``none`` or ``step-none`` plainly, ``nice``/``idle``/``pause``
under spinners) and draws, per configuration, SGLang's step time over the
``fused-out`` step's, back to back and dispatched ahead, one point per run, beside issue 16's
targets::

    python scripts/spinners_plot.py benchmarks/results/h200-2026-12-04-spinners --out spinners.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def runs(root: Path) -> list[dict]:
    out = []
    for f in sorted(root.glob("call*/**/results.json")):
        label = f.parent.parent.name if f.parent.name == "step" else f.parent.name
        if "tfrt" in label:  # another PJRT client: not this comparison
            continue
        wrapper = f.parent.parent / "wrapper.txt"  # a run's wrapper command, where the folder does not say
        spun = "idle_spinners" in wrapper.read_text() if wrapper.exists() else "none" not in label.split("-")
        rows = json.loads(f.read_text())["rows"]
        peer = {r["config"]: r for r in rows if r["backend"] == "sglang"}
        for r in rows:
            if r["kind"] != "fused-out" or r["config"] not in peer:
                continue
            p = peer[r["config"]]
            ratio = {k: p[k]["median_us"] / r[k]["median_us"] for k in ("wall_back_to_back", "wall_ahead")
                     if r.get(k, {}).get("n") and p.get(k, {}).get("n")}  # fmt: skip
            out.append({"run": f"{f.relative_to(root).parts[0]}/{label}", "spinners": spun, "config": r["config"],
                        **ratio})  # fmt: skip
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = runs(a.root)
    configs = [c for c in ("25x4", "8x16", "8x8", "8x4") if any(d["config"] == c for d in data)]
    targets = {"25x4": 2.5, "8x16": 2.0}
    fig, axes = plt.subplots(1, len(configs), figsize=(3.4 * len(configs), 3.8), sharey=True, squeeze=False)
    for ax, cfg in zip(axes[0], configs):
        for x, (key, name) in enumerate((("wall_back_to_back", "back to back"), ("wall_ahead", "ahead"))):
            for spun, color, dx in ((False, "tab:gray", -0.12), (True, "tab:blue", 0.12)):
                ys = [d[key] for d in data if d["config"] == cfg and d["spinners"] == spun and key in d]
                name = "spinners (the CPUs kept from halting)" if spun else "plain"
                ax.scatter([x + dx] * len(ys), ys, color=color, s=22, label=name if x == 0 else None)
        if cfg in targets:
            ax.axhline(targets[cfg], color="tab:red", lw=1, ls="--", label="issue 16's target")
            ax.annotate(f"{targets[cfg]}x", (1.55, targets[cfg]), color="tab:red", fontsize=8, ha="right", va="bottom")
        ax.set_xticks([0, 1], ["back to back", "ahead"])
        ax.set_xlim(-0.6, 1.6)
        ax.set_title(f"{cfg}: fused step (mosaic)")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("SGLang's step time / ours (wall-clock)")
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    for d in data:
        print(d)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
