"""Record what a platform does with the rule's arithmetic, for the rounding notebook.

Writes ``platform.json`` (``gdn_lossless_jax.tools.viz.probe_platform``: ``S*alpha + k*u`` written
plainly, eagerly, under jit, in a scan body and in a Pallas kernel, matched against the pinned
forms; whether subnormals survive) and ``exp.npz`` (the bits of ``exp`` on
``viz.exp_grid(16384)``, ``uint32``: the library's ``exp`` under the default backend's name, XLA's
own ``jnp.exp`` as ``"<platform>_xla"`` for every platform present). The notebook compares a
recorded GPU's ``exp`` with the CPU it runs on, bit for bit.

    python -m gdn_lossless_jax.tools.viz --out benchmarks/results/platform
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import jax
import numpy as np

from .. import viz

EXP_POINTS = 16384


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for platform.json and exp.npz")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    facts = viz.probe_platform()
    facts["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    g = viz.exp_grid(EXP_POINTS)
    # The library's exp on this platform (what verify and replay call), XLA's own on each one.
    platforms = {jax.default_backend(): viz.exp_on(g).view(np.uint32)}
    for platform in ("gpu", "cpu"):
        try:
            platforms[f"{platform}_xla"] = viz.exp_on(g, platform, library=False).view(np.uint32)
        except RuntimeError:
            continue
    ref = np.exp(g.astype(np.float64)).astype(np.float32).view(np.uint32)
    facts["exp"] = {
        "points": EXP_POINTS,
        "grid": f"gdn_lossless_jax.tools.viz.exp_grid({EXP_POINTS})",
        "differ_from_float64_rounded": {k: float(np.mean(v != ref)) for k, v in platforms.items()},
    }
    if {"gpu", "cpu"} <= platforms.keys():
        facts["exp"]["gpu_vs_cpu_differ"] = float(np.mean(platforms["gpu"] != platforms["cpu"]))
    (out / "platform.json").write_text(json.dumps(facts, indent=1) + "\n")
    np.savez_compressed(out / "exp.npz", **platforms)
    print(viz.format_table(facts["rows"]))
    print(json.dumps(facts["exp"], indent=1))
    print(f"jax {jax.__version__}, {facts['device']}; written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
