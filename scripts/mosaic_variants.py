#!/usr/bin/env python3
"""The ``mosaic`` backend's kernel per launch configuration: device time a layer, and the same bits.

One layer of the benchmark geometry (H16, HV32, K = V = 128, an fp32 pool of ``2 N + 8`` slots,
requests in a shuffled set of slots), called as ``commit_and_verify`` calls the backend: the
previous step's tuple tape pending (accepted steps drawn from ``[-1, D)``, one request in eight
crossing a track boundary into a spare slot), the tape written into a buffer. Each variant
(``mosaic.VerifyConfig`` fields) must give the outputs, the tape and the pool of the first, bit for
bit; its kernel's device time is the profiler's (``benchmarks.devtime``). ``--verify`` times the
verify alone (nothing pending) too. ``--cross-every 4`` and ``--accepted-min 0``: one request in
four crosses and every request accepts a step (as in ``benchmarks.step``'s index sets).
``--layers 30``: the calls take the pool's layers in turn, so that no state is still in L2 from
the call before (as in a step of 30 layers; with one layer, a 25x4 pool of 52 MB mostly is).

    python scripts/mosaic_variants.py --configs 25x4,8x16 --variants "replay=loop;replay=static"
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

from gdn_lossless_jax.backends import mosaic
from gdn_lossless_jax.tape import Tuples
from gdn_lossless_jax.testing import bits

H, HV, K, V = 16, 32, 128, 128


def parse_variant(text: str) -> dict:
    out = {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=")
        out[key] = int(value) if value.isdigit() else (None if value == "None" else value)
    return out


def inputs(N: int, D: int, seed: int, layers: int = 1, cross_every: int = 8, accepted_min: int = -1):
    rng = np.random.default_rng(seed)
    f32, bf16, i32 = np.float32, jnp.bfloat16, np.int32
    S = 2 * N + 8

    def unit(*shape):
        x = rng.standard_normal(shape)
        return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(f32)

    slots = rng.permutation(S - 8)[:N].astype(i32)
    track_slots = np.full(N, -1, i32)
    track_steps = np.full(N, -1, i32)
    cross = np.arange(N) % cross_every == cross_every - 1  # one request in cross_every crosses, into a slot of its own
    if cross.sum() > 8:
        raise SystemExit(
            f"--cross-every {cross_every}: {cross.sum()} requests cross at N={N}, the pool has 8 spare slots"
        )
    track_slots[cross] = S - 8 + np.arange(cross.sum())
    track_steps[cross] = rng.integers(0, D, cross.sum())
    pool = jax.random.normal(jax.random.key(seed), (layers, S, HV, V, K), jnp.float32)  # (on the device: 30 layers
    x = {  # in NumPy took minutes)
        "pool": pool,
        "q": jnp.asarray(rng.standard_normal((N, D, H, K)), bf16),
        "k": jnp.asarray(rng.standard_normal((N, D, H, K)), bf16),
        "v": jnp.asarray(rng.standard_normal((N, D, HV, V)), bf16),
        "a": jnp.asarray(rng.standard_normal((N, D, HV)), bf16),
        "b": jnp.asarray(rng.standard_normal((N, D, HV)), bf16),
        "A_log": jnp.asarray(rng.uniform(0, 2, HV).astype(f32)),
        "dt_bias": jnp.asarray(rng.standard_normal(HV).astype(f32)),
        "slots": jnp.asarray(slots),
        "rows": jnp.asarray(rng.permutation(N).astype(i32)),
        "tape": Tuples(
            jnp.zeros((1, N, D, HV, V), f32), jnp.zeros((1, N, D, H, K), f32), jnp.zeros((1, N, D, HV), f32)
        ),
        "prev": Tuples(
            jnp.asarray(0.5 * rng.standard_normal((1, N, D, HV, V)).astype(f32)),
            jnp.asarray(unit(1, N, D, H, K)),
            jnp.asarray(-rng.random((1, N, D, HV)).astype(f32) * 0.5),
        ),
        "pending_idx": tuple(
            jnp.asarray(a)
            for a in (rng.permutation(N).astype(i32), rng.integers(accepted_min, D, N).astype(i32), track_slots,
                      track_steps)  # fmt: skip
        ),
    }
    return x


def call(x, config, pending: bool, layer: int = 0):
    zero = jnp.zeros((), jnp.int32)
    layer = jnp.asarray(layer, jnp.int32)
    pend = (*x["pending_idx"], zero, x["prev"]) if pending else None
    return mosaic.verify(x["pool"], x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"], record="tuples",
                         scale=K**-0.5, out_dtype=jnp.dtype(jnp.bfloat16), slots=x["slots"], layer=layer,
                         tape=x["tape"],
                         tape_layer=zero, rows=x["rows"], pending=pend, config=config)  # fmt: skip


def _runner(x, config, pending: bool, calls: int, layers: int):
    """``calls`` calls, the pool donated and threaded through (no copy of it between calls)."""
    step = jax.jit(lambda pool, layer: call({**x, "pool": pool}, config, pending, layer),
                   donate_argnums=0 if pending else ())  # fmt: skip
    box = [jnp.copy(x["pool"])]

    def run():
        for i in range(calls):
            r = step(box[0], i % layers)
            if pending:
                box[0] = r[-1]
        jax.block_until_ready(r)

    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="25x4,8x4,8x8,8x16")
    p.add_argument("--variants", default="replay=loop;replay=static", help="';'-separated VerifyConfig fields")
    p.add_argument("--verify", action="store_true", help="also the verify alone (nothing pending)")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument(
        "--layers",
        type=int,
        default=1,
        help="layers of the pool, one a call in turn (30: no state is in L2 from the call before, as in a step)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cross-every", type=int, default=8, help="one request in this many crosses a track boundary")
    p.add_argument("--accepted-min", type=int, default=-1,
                   help="accepted steps drawn from [this, D) (-1: some accept nothing; 0: as in benchmarks.step)")
    p.add_argument("--details", action="store_true",
                   help="print the kernel's launch as the profiler records it (registers, shared memory, occupancy)")
    p.add_argument("--no-time", action="store_true", help="run the calls without the profiler (under Nsight Compute)")
    args = p.parse_args(argv)
    from benchmarks.devtime import device_time

    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    failed = 0
    for cfg in args.configs.split(","):
        N, D = map(int, cfg.split("x"))
        x = inputs(N, D, args.seed, args.layers, args.cross_every, args.accepted_min)
        floor = 4 * (2 * N * HV * V * K + N * D * (H * K + 2 * HV * V + 2 * HV)) / 4.1e12 * 1e6  # state in+out, tapes
        first = None
        for text in args.variants.split(";"):
            config = mosaic.VerifyConfig(**parse_variant(text))
            for pending in (True, False) if args.verify else (True,):
                got = jax.block_until_ready(call(x, config, pending))
                if pending:
                    leaves = [bits(np.asarray(a)) for a in jax.tree.leaves(got)]
                    if first is None:
                        first = leaves
                        same = "(the reference variant)"
                    else:
                        ok = all(np.array_equal(a, b) for a, b in zip(first, leaves))
                        failed += not ok
                        same = "same bits" if ok else "BITS DIFFER"
                else:
                    same = "verify alone"

                run = _runner(x, config, pending, args.calls, args.layers)
                if args.no_time:
                    run()
                    print(f"{cfg} {text or 'default'} {'fused' if pending else 'verify'}: ran {same}", flush=True)
                    continue
                t = device_time(run, 3, args.calls) or {"kernels": []}
                ks = [k for k in t["kernels"] if "mosaic" in k["name"]]
                us = ks[0]["median_us"] if ks else float("nan")
                print(f"{cfg} {text or 'default'} {'fused' if pending else 'verify'}: kernel {us:.1f} us "
                      f"({us / floor:.2f}x the fused floor {floor:.1f} us) {same}", flush=True)  # fmt: skip
                if args.details and ks:
                    print(f"  launch: {ks[0]['details']}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
