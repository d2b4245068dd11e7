#!/usr/bin/env python3
"""The compiled HLO of ``benchmarks.step``'s fused step (``fused-out``) at a benchmark size: its
pool-, tape- and outputs-sized copies (``tests/test_step.py::benchmark_fused_step_copies``, which
``test_benchmark_sized_fused_step_has_no_copy`` runs on a GPU at 25x4) and the bytes it aliases.
Compiles only (the arguments are shapes), so any size fits.

    python scripts/fused_step_hlo.py --configs 25x4 --backends mosaic,pallas --records snapshots --out /tmp/hlo
"""

from __future__ import annotations

import argparse
import gzip
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from benchmarks import cases as bc


def main(argv=None) -> int:
    from test_step import benchmark_fused_step_copies

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="25x4")
    p.add_argument("--backends", default="mosaic,pallas")
    p.add_argument("--records", default="snapshots,tuples")
    p.add_argument("--mode", choices=tuple(bc.MODES), default="h200")
    p.add_argument("--out", default=None, help="a folder for the HLO texts (gzip)")
    args = p.parse_args(argv)
    for label in args.configs.split(","):
        for record in args.records.split(","):
            for backend in args.backends.split(","):
                bad, temps, aliased, compiled = benchmark_fused_step_copies(label, backend, record, args.mode)
                print(f"{label} {backend} {record}: {len(bad)} copies or unaliased; temps {temps / 2**20:.1f} MiB, "
                      f"aliased {aliased / 2**30:.2f} GiB", flush=True)  # fmt: skip
                for line in bad:
                    print("   ", line, flush=True)
                if args.out:
                    Path(args.out).mkdir(parents=True, exist_ok=True)
                    with gzip.open(Path(args.out) / f"{label}-{backend}-{record}.hlo.gz", "wt") as fh:
                        fh.write(compiled.as_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
