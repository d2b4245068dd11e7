"""The GDN kernels of a whole step against their byte floor, per backend, batch and drafts.

``python -m benchmarks.floor`` builds the step of every GDN layer as :mod:`benchmarks.step`
writes it (``unrolled-out``: verify of every layer, then the commit of all layers;
``fused-out``: each layer's verify applying the previous step's commit), traces a few
invocations and sums the device time of the library's kernels (names ``gdn_*``, or the Triton
backend's), split into verify and commit where they are separate launches. Each row
(``kind: "kernel-floor"``):

  backend, record, batch, drafts, tree, op    op: ``verify`` (all layers), ``commit``, ``separate``
                                               (verify + commit) or ``fused``
  device_ms     the kernels' device time a step
  bytes         what the op must move (:mod:`benchmarks.traffic`: every input read once, every
                output written once; the fused step reads each state once and writes the
                committed one: the commit's state reads are the verify's)
  floor_ms      bytes over the copy rate measured in the same run (``x * 2`` over 2 GiB)
  ratio         device_ms / floor_ms

On a CPU (``--mode cpu-small``) the rows carry bytes and no device time (no GPU trace): CI keeps
the harness alive. Run of record (a GPU)::

    python -m benchmarks.floor --out $OUT/floor --configs 25x4,64x1,64x4,64x8,128x4,320x1,320x4,320x8 \
        --backends mosaic,pallas
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
from pathlib import Path

import jax
import numpy as np

from . import cases as bc
from .step import _ours, make_inputs, step_rows
from .timing import Clock, device_pass
from .traffic import Traffic, commit_traffic, verify_traffic

__all__ = ["floor_bytes", "main"]

KINDS = {"unrolled-out": "separate", "fused-out": "fused"}
COMMIT_KERNELS = ("gdn_commit", "commit_tuples_kernel", "commit_snapshots_kernel")


def floor_bytes(op: str, inp, record: str) -> Traffic:
    """Bytes a step's ``op`` must move at ``inp``'s shape and first index set (all layers)."""
    from gdn_lossless_jax.testing.cases import CommitIndices

    s, L = inp.shape, inp.geometry.gdn_layers
    idx = CommitIndices(*(np.asarray(x) for x in inp.index_sets[0]))
    verify = verify_traffic(s, record).scale(L)
    commit = commit_traffic(s, L, idx, record, slots_in_pool=inp.slots, rows_in_tape=s.N)
    if op == "verify":
        return verify
    if op == "commit":
        return commit
    if op == "separate":
        return verify + commit
    if op == "fused":  # the pre-verify state is read once, by the verify: the commit adds its tape and writes
        states_read = int(np.sum(_writers(idx, inp))) * s.HV * s.V * s.K * 4 * L
        return verify + Traffic(commit.read - states_read, commit.write)
    raise ValueError(f"floor_bytes: op must be verify, commit, separate or fused, got {op!r}")


def _writers(idx, inp):
    from .traffic import _masks

    accept, track = _masks(idx, inp.slots, inp.shape.N, inp.shape.D)
    return accept | track


def _device_ms(device: dict | None, commit: bool | None) -> float | None:
    """The library's kernels' device ms a call: all, the commit's only, or all but the commit's."""
    if device is None:
        return None
    us = 0.0
    for k in device["kernels"]:
        if not _ours(k["name"]):
            continue
        is_commit = any(c in k["name"] for c in COMMIT_KERNELS)
        if commit is None or commit == is_commit:
            us += k["us_per_call"]
    return us / 1e3


def _parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.floor", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for results.json")
    p.add_argument("--mode", choices=tuple(bc.MODES), default="h200")
    p.add_argument("--configs", default="25x4,64x1,64x4,64x8,320x1,320x4,320x8")
    p.add_argument("--backends", default="mosaic,pallas")
    p.add_argument("--records", default="tuples")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"step forms, of {tuple(KINDS)}")
    p.add_argument("--invocations", type=int, default=3, help="traced invocations per row")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    mode = bc.MODES[args.mode]
    kinds = [k for k in args.kinds.split(",") if k]
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise SystemExit(f"--kinds: each must be one of {tuple(KINDS)}, got {bad}")
    clock = Clock()
    copy_us = rate = None
    if jax.default_backend() == "gpu":
        from .devtime import copy_rate

        copy_us, rate = copy_rate()
        clock.log(f"copy rate {rate / 1e12:.2f} TB/s (x * 2 over 2 GiB: {copy_us:.0f} us)")
    rows = []
    for cfg in bc.parse_configs(args.configs, mode.configs):
        inp = make_inputs(cfg, mode.geometry, seed=args.seed, index_sets=2)
        for backend in [b for b in args.backends.split(",") if b]:
            for record in [r for r in args.records.split(",") if r]:
                timed = step_rows(inp, backend, record, clock, args.seed, kinds)
                device_pass(timed, invocations=args.invocations, clock=clock, label=cfg.label)
                for r in timed:
                    op = KINDS[r.op]
                    parts = [(op, None)] + ([("verify", False), ("commit", True)] if op == "separate" else [])
                    for name, commit in parts:
                        b = floor_bytes(name, inp, record)
                        ms = _device_ms(r.device, commit)
                        floor = None if rate is None else b.total / rate * 1e3
                        rows.append({
                            "kind": "kernel-floor", "backend": backend, "record": record, "batch": cfg.requests,
                            "drafts": cfg.drafts, "tree": None, "op": name, "layers": inp.geometry.gdn_layers,
                            "device_ms": ms, "bytes": b.total, "floor_ms": floor,
                            "ratio": None if ms is None or floor is None else ms / floor,
                        })  # fmt: skip
                        last = rows[-1]
                        clock.log(f"{cfg.label} {backend} {record} {name}: "
                                  + ("no device time" if ms is None else f"{ms:.3f} ms")
                                  + ("" if floor is None else f", floor {floor:.3f} ms, ratio {last['ratio']:.2f}"))
                # Each backend's rows own their pools (a second one for the direct rows): free them before the next
                # backend's, or a large configuration's second backend runs out of memory on an 80 GB card.
                timed = r = None
                gc.collect()
        del inp
        gc.collect()
    result = {
        "command": "python -m benchmarks.floor " + " ".join(sys.argv[1:] if argv is None else argv),
        "env": {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "copy_rate_bytes_per_s": rate},  # fmt: skip
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    print("| backend | record | batch x drafts | op | device ms | floor ms | ratio |")
    print("|---|---|---|---|---:|---:|---:|")
    for r in rows:
        ms, floor = ("-" if x is None else f"{x:.3f}" for x in (r["device_ms"], r["floor_ms"]))
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        print(f"| {r['backend']} | {r['record']} | {r['batch']}x{r['drafts']} | {r['op']} | {ms} | {floor} | {ratio} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
