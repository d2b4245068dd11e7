"""The byte patterns of verify, with no arithmetic: what the memory system gives them on this GPU.

The byte floors of the benchmark divide bytes by a device-to-device copy rate (one read and one
write per byte pair). Verify's patterns are not a copy: a tuple verify reads the state and
writes almost nothing; a snapshot verify reads it once and writes it D times. This times, on
the device (profiler trace, ``benchmarks/devtime.py``), kernels that move exactly those bytes
and compute nothing:

- ``xla read``: ``state.sum(-1)`` (XLA's reduction: the state read once);
- ``xla 1r+Dw``: the state broadcast to ``[N, D, HV, V, K]`` (read once, written D times);
- ``pallas read`` / ``pallas 1r+Dw``: Pallas kernels on the verify's own grid ``(N, HV, V / BV)``
  and launch (BV rows, one warp; ``BV:WARPS[:tf]`` from ``PATTERN_TILES``, ``tf``: the grid with the V
  tiles first, as the snapshot verify launches it), loading each program's
  ``[BV, K]`` tile once and storing its row sums (read) or the tile D times (1r+Dw).

Each pattern's time over the copy floor of its bytes says how close to the copy rate that
pattern can get at all; a verify kernel's time over its pattern's time is what its own
arithmetic and latency cost. Usage (GPU)::

    python3 scripts/pattern_floor.py [25x4,8x4,8x8,8x16]

Writes ``$OUT/pattern_floor.json``. On a CPU it runs the Pallas kernels in interpret mode on a
small shape and checks their outputs (no timings).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from benchmarks.devtime import copy_rate, device_time
from gdn_lossless_jax.backends.pallas._refs import grid

CALLS, COPIES = 16, 4
T0 = time.perf_counter()


def log(msg):
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def _read_kernel(s_ref, o_ref):
    o_ref[...] = jnp.sum(plgpu.load(s_ref, eviction_policy="evict_first"), axis=-1)


def _write_kernel(s_ref, o_ref, *, D):
    x = plgpu.load(s_ref, eviction_policy="evict_first")
    for t in range(D):
        o_ref[t] = x


def pallas_pattern(state, D: int, write: bool, BV: int, warps: int, tiles_first: bool = False, interpret: bool = False):
    N, HV, V, K = state.shape

    def ids(f):  # index maps in (n, h, j) whatever the grid's order
        return (lambda j, h, n: f(n, h, j)) if tiles_first else f

    in_spec = pl.BlockSpec((None, None, BV, K), ids(lambda n, h, j: (n, h, j, 0)))
    if write:
        kernel = functools.partial(_write_kernel, D=D)
        out_shape = jax.ShapeDtypeStruct((N, D, HV, V, K), state.dtype)
        out_spec = pl.BlockSpec((None, D, None, BV, K), ids(lambda n, h, j: (n, 0, h, j, 0)))
    else:
        kernel = _read_kernel
        out_shape = jax.ShapeDtypeStruct((N, HV, V), state.dtype)
        out_spec = pl.BlockSpec((None, None, BV), ids(lambda n, h, j: (n, h, j)))
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid(N, HV, V // BV, tiles_first), in_specs=[in_spec], out_specs=out_spec,
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1), interpret=interpret,
        name="pattern_" + ("1r_Dw" if write else "read"),
    )(state)  # fmt: skip


def xla_pattern(state, D: int, write: bool):
    if write:
        N, HV, V, K = state.shape
        return jnp.broadcast_to(state[:, None], (N, D, HV, V, K))
    return jnp.sum(state, axis=-1)


def time_patterns(N: int, D: int, tiles, rate: float) -> list[dict]:
    """Every pattern at N requests and D drafts, on ``COPIES`` states in turn (no state stays in L2)."""
    rng = np.random.default_rng(N * 100 + D)
    states = [jnp.asarray(rng.standard_normal((N, 32, 128, 128), np.float32)) for _ in range(COPIES)]
    variants = [(f"xla {w}", jax.jit(functools.partial(xla_pattern, D=D, write=w == "1r+Dw")))
                for w in ("read", "1r+Dw")]  # fmt: skip
    for BV, warps, tf in tiles:
        for w in ("read", "1r+Dw"):
            f = jax.jit(functools.partial(pallas_pattern, D=D, write=w == "1r+Dw", BV=BV, warps=warps, tiles_first=tf))
            variants.append((f"pallas {w} bv{BV} w{warps}" + (" tf" if tf else ""), f))
    rows = []
    for name, f in variants:
        moved = states[0].nbytes * (1 + D if "Dw" in name else 1)

        def run(f=f):
            jax.block_until_ready([f(states[i % COPIES]) for i in range(CALLS)])

        run()
        dev = device_time(run, 2, CALLS)
        us, floor, details = dev["us_per_call"], moved / rate * 1e6, dev["kernels"][0].get("details", "")
        rows.append({"pattern": name, "N": N, "D": D, "device_us": us, "bytes": moved, "floor_us": floor,
                     "x_floor": us / floor, "achieved_gbps": moved / us / 1e3, "details": details})  # fmt: skip
        log(f"{N}x{D} {name:<26} {us:8.1f} us  {moved / 1e6:7.1f} MB  {moved / us / 1e3:6.0f} GB/s  "
            f"x{us / floor:.3f} copy floor  {details[:60]}")
    return rows


def main(argv) -> int:
    shapes = (argv[0] if argv else "25x4,8x4,8x8,8x16").split(",")
    tiles = [(int(x.split(":")[0]), int(x.split(":")[1]), x.endswith(":tf"))
             for x in os.environ.get("PATTERN_TILES", "8:1,8:1:tf,32:4").split(",")]
    gpu = jax.default_backend() == "gpu"
    if not gpu:  # a smoke check of the kernels' logic
        s = jnp.asarray(np.random.default_rng(0).standard_normal((2, 4, 16, 32)), jnp.float32)
        for BV, w, tf in tiles:
            BV = min(BV, 16)
            got = pallas_pattern(s, 3, True, BV, w, tf, interpret=True)
            np.testing.assert_array_equal(got, xla_pattern(s, 3, True))
            np.testing.assert_allclose(pallas_pattern(s, 3, False, BV, w, tf, interpret=True), xla_pattern(s, 3, False),
                                       rtol=1e-5, atol=1e-5)
        log("CPU: pattern kernels agree with XLA (interpret mode); no timings without a GPU")
        return 0

    copy_us, rate = copy_rate()
    log(f"copy 2 GiB: {copy_us:.1f} us, rate {rate / 1e9:.0f} GB/s")
    rows = [{"pattern": "copy 2 GiB", "rate_gbps": rate / 1e9}]
    for N, D in [tuple(map(int, x.split("x"))) for x in shapes]:
        rows += time_patterns(N, D, tiles, rate)
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "pattern_floor.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
