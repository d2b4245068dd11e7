#!/usr/bin/env python3
"""The compiled HLO of ``benchmarks.step``'s fused step (``fused-out``) at a benchmark size: its
pool-, tape- and outputs-sized copies (as ``tests/test_step.py::buffer_copies`` finds them) and
the bytes it aliases. Compiles only (the arguments are shapes), so any size fits.

    python scripts/fused_step_hlo.py --configs 25x4 --backends mosaic,pallas --records snapshots --out /tmp/hlo
"""

from __future__ import annotations

import argparse
import gzip
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import cases as bc
from benchmarks.step import fused_step
from gdn_lossless_jax import pool as gpool
from gdn_lossless_jax.cases import Shape


class _Spec:
    """A shape with its bytes (what ``buffer_copies`` reads of an array)."""

    def __init__(self, x):
        self.shape, self.dtype = tuple(x.shape), jnp.dtype(x.dtype)
        self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize


def main(argv=None) -> int:
    from test_step import buffer_copies

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="25x4")
    p.add_argument("--backends", default="mosaic,pallas")
    p.add_argument("--records", default="snapshots,tuples")
    p.add_argument("--mode", choices=tuple(bc.MODES), default="h200")
    p.add_argument("--out", default=None, help="a folder for the HLO texts (gzip)")
    args = p.parse_args(argv)
    mode = bc.MODES[args.mode]
    g = mode.geometry
    sds = jax.ShapeDtypeStruct
    for cfg in bc.parse_configs(args.configs, mode.configs):
        s = Shape.of(g, cfg.requests, cfg.drafts)
        L, N, D = g.gdn_layers, s.N, s.D
        bf = jnp.bfloat16
        params = {"A_log": sds((L, s.HV), jnp.float32), "dt_bias": sds((L, s.HV), jnp.float32)}
        xs = {"q": sds((L, N, D, s.H, s.K), bf), "k": sds((L, N, D, s.H, s.K), bf), "v": sds((L, N, D, s.HV, s.V), bf),
              "a": sds((L, N, D, s.HV), bf), "b": sds((L, N, D, s.HV), bf)}  # fmt: skip
        ix = tuple(sds((N,), jnp.int32) for _ in range(5))
        obuf = sds((L, N, D, s.HV, s.V), bf)
        for record in args.records.split(","):
            spec = jax.eval_shape(lambda: gpool.allocate(g, slots=bc.pool_slots(cfg.requests) - 1, requests=N,
                                                         drafts=D, record=record))  # fmt: skip
            for backend in args.backends.split(","):
                f = fused_step(backend, form="unrolled-out")
                compiled = f.lower(spec.ssm, spec.tape, spec.tape, params, xs, ix, obuf).compile()
                whole = jax.tree.map(_Spec, (spec.ssm, spec.tape, spec.tape, obuf))
                bad, temps = buffer_copies(compiled, whole, whole[:3], whole)
                mem = compiled.memory_analysis()
                print(f"{cfg.label} {backend} {record}: {len(bad)} copies or unaliased; temps {temps / 2**20:.1f} MiB, "
                      f"aliased {mem.alias_size_in_bytes / 2**30:.2f} GiB", flush=True)  # fmt: skip
                for line in bad:
                    print("   ", line, flush=True)
                if args.out:
                    Path(args.out).mkdir(parents=True, exist_ok=True)
                    with gzip.open(Path(args.out) / f"{cfg.label}-{backend}-{record}.hlo.gz", "wt") as fh:
                        fh.write(compiled.as_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
