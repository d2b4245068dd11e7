#!/usr/bin/env python3
"""``benchmarks.step`` with the ``mosaic`` backend's default launch replaced, to time a variant in the step.

    python scripts/step_mosaic_config.py "replay=static" --out /tmp/step --configs 25x4 --backends mosaic

The first argument: ``VerifyConfig`` fields as ``scripts/mosaic_variants.py`` takes them; the rest go to
``benchmarks.step``.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mosaic_variants import parse_variant

from gdn_lossless_jax.backends import mosaic


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    fields = parse_variant(sys.argv[1])
    mosaic.verify.__kwdefaults__ = {**mosaic.verify.__kwdefaults__, "config": mosaic.VerifyConfig(**fields)}
    print(f"mosaic's default launch: {mosaic.verify.__kwdefaults__['config']}", flush=True)
    sys.argv = ["benchmarks.step", *sys.argv[2:]]
    runpy.run_module("benchmarks.step", run_name="__main__")


if __name__ == "__main__":
    main()
