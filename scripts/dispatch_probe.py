"""What one kernel adds to a jitted call's dispatch, by the kind of kernel.

``benchmarks.step``'s synced pass showed the Mosaic GPU fused step's call returning after
0.11-0.31 ms at 25x4, the Pallas (Triton) one after 0.08-0.22, and a jit of 64 tiny Pallas
kernels after 0.05-0.06 (``benchmarks/results/h200-2026-12-04-sync/``). Under the profiler the
Mosaic step spent 142-213 us in XLA's ``Thunks::Prepare`` against 3-7 for the Pallas one. This
times a jit of ``n`` tiny kernels (``x + 1`` on a ``[128, 128]`` fp32 array, donated; with
``--operands`` m, each kernel takes m - 1 more ``[8, 128]`` inputs it does not read), each kind
in turn: Pallas on Triton (a kernel XLA launches itself) and Pallas on Mosaic GPU
(``plgpu.kernel``, as the library's backend launches: an FFI custom call with prepare and
initialize stages; its body empty), back to back, each call waited for with the
driver's wait (``gdn_lossless_jax.sync.synchronize``): the call's time until it returns (its
dispatch), until the GPU is done, and dispatched ahead (``--calls`` calls, one wait)::

    python scripts/dispatch_probe.py --nodes 8,32,64

On a CPU both kinds run in interpret mode and the driver's wait is left out (the script stays
alive; its times mean nothing).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="8,32,64", help="kernels in the timed jit, comma-separated")
    ap.add_argument("--kinds", default="triton,mosaic", help="pallas backends: triton, mosaic")
    ap.add_argument("--operands", default="1,16", help="inputs of each kernel (the extra ones [8, 128] fp32, unread)")
    ap.add_argument("--calls", type=int, default=200)
    a = ap.parse_args()

    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root
    from gdn_lossless_jax.sync import synchronize

    cpu = jax.default_backend() == "cpu"
    wait = jax.block_until_ready if cpu else (lambda x: (synchronize(), x)[1])

    def add_one(x_ref, *refs):
        refs[-1][...] = x_ref[...] + 1.0

    shape = jax.ShapeDtypeStruct((128, 128), jnp.float32)
    kernels = {
        "triton": lambda: pl.pallas_call(add_one, out_shape=shape, interpret=cpu),
        # plgpu.kernel, as the library's mosaic backend launches; its refs are in global memory, and
        # the body leaves the output unwritten (a launch is what is timed)
        "mosaic": lambda: plgpu.kernel(lambda *refs: None, out_type=shape, grid=(1,), grid_names=("cta",),
                                       interpret=plgpu.InterpretGPUParams() if cpu else None),  # fmt: skip
    }
    print(f"{'kind':>7} {'kernels':>7} {'operands':>8} {'dispatch us':>11} {'synced us':>9} {'ahead us':>8}")
    for kind in [k for k in a.kinds.split(",") if k]:
        for m in [int(s) for s in a.operands.split(",")]:
            extra = [jnp.full((8, 128), i, jnp.float32) for i in range(m - 1)]
            for n in [int(s) for s in a.nodes.split(",")]:
                kernel = kernels[kind]()

                def chain(x, extra, kernel=kernel, n=n):
                    for _ in range(n):
                        x = kernel(x, *extra)
                    return x

                f = jax.jit(chain, donate_argnums=0)
                x = jax.block_until_ready(f(jnp.zeros((128, 128), jnp.float32), extra))
                for _ in range(10):
                    x = jax.block_until_ready(f(x, extra))
                disp, total = [], []
                for _ in range(a.calls):
                    t = time.perf_counter()
                    x = f(x, extra)
                    disp.append(time.perf_counter() - t)
                    x = wait(x)
                    total.append(time.perf_counter() - t)
                jax.block_until_ready(x)
                t = time.perf_counter()
                for _ in range(a.calls):
                    x = f(x, extra)
                x = wait(x)
                ahead = (time.perf_counter() - t) / a.calls
                jax.block_until_ready(x)
                print(f"{kind:>7} {n:>7} {m:>8} {np.median(disp) * 1e6:11.1f} {np.median(total) * 1e6:9.1f} "
                      f"{ahead * 1e6:8.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
