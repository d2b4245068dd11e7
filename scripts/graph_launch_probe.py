"""What a jitted call's launch costs on the host per kernel it holds: XLA's CUDA graphs against
PyTorch's, on chains of tiny dependent kernels (no profiler: CUPTI slows graph launches).

For ``n`` in ``--nodes``, a ``jax.jit`` of ``n`` dependent tiny kernels (Pallas ``x + 1`` on
``[8, 128]`` fp32, the same written in Triton and called through jax-triton, or XLA fusions kept
apart by optimization barriers) and a PyTorch CUDA graph
of ``n`` tiny kernels (``x.add_(1)``) are each timed ``--calls`` times: the time until the
call returns (the host's launch) and until the device is done (``block_until_ready`` /
``torch.cuda.synchronize``), medians. The slope over ``n`` is the launch cost per kernel::

    python scripts/graph_launch_probe.py --nodes 1,8,16,32,64,128

The jax-triton row names the installed release: 0.3's launches are legacy custom calls, which
XLA keeps out of its command buffers (CUDA graphs); 0.4's are FFI calls. Its slope against the
Pallas row's says whether that release's launches are graphed (``--no-triton`` leaves it out).
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def _median_us(fn, calls: int, sync) -> tuple[float, float]:
    ret, done = [], []
    for _ in range(calls):
        t = time.perf_counter()
        out = fn()
        ret.append(time.perf_counter() - t)
        sync(out)
        done.append(time.perf_counter() - t)
    return float(np.median(ret) * 1e6), float(np.median(done) * 1e6)


def jax_rows(nodes, calls, with_triton=True):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    def add_one(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    kernel = pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                            interpret=jax.default_backend() == "cpu")

    def pallas_chain(n):
        def f(x):
            for _ in range(n):
                x = kernel(x)
            return x

        return jax.jit(f)

    def xla_chain(n):
        def f(x):
            for _ in range(n):
                x = jax.lax.optimization_barrier(jnp.sin(x) + 1.0)
            return x

        return jax.jit(f)

    x = jnp.zeros((8, 128), jnp.float32)
    chains = [("jax pallas", pallas_chain), ("jax xla", xla_chain)]
    if with_triton and jax.default_backend() != "gpu":
        print(f"the jax-triton chain left out: it launches on a GPU, and JAX's backend is {jax.default_backend()!r}")
    elif with_triton:
        try:
            import jax_triton as jt
            import triton
            import triton.language as tl
        except ImportError as e:
            raise SystemExit(f"the jax-triton chain needs jax-triton and triton ({e}); or pass --no-triton") from e

        @triton.jit
        def add_one_kernel(x_ptr, o_ptr, N: tl.constexpr):
            i = tl.arange(0, N)
            tl.store(o_ptr + i, tl.load(x_ptr + i) + 1.0)

        def triton_chain(n):
            def f(x):
                for _ in range(n):
                    x = jt.triton_call(x, kernel=add_one_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                                       grid=(1,), num_warps=4, N=x.size)  # fmt: skip
                return x

            return jax.jit(f)

        import importlib.metadata

        chains.append((f"jax-triton {importlib.metadata.version('jax-triton')}", triton_chain))
    for name, make in chains:
        for n in nodes:
            f = make(n)
            jax.block_until_ready(f(x))
            yield name, n, *_median_us(lambda f=f: f(x), calls, jax.block_until_ready)


def torch_rows(nodes, calls):
    import torch

    x = torch.zeros((8, 128), device="cuda")
    for n in nodes:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            for _ in range(3):
                for _ in range(n):
                    x.add_(1.0)
            torch.cuda.synchronize()
            with torch.cuda.graph(g):
                for _ in range(n):
                    x.add_(1.0)
        torch.cuda.synchronize()
        yield "torch graph", n, *_median_us(g.replay, calls, lambda _: torch.cuda.synchronize())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="1,8,16,32,64,128")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--no-torch", dest="torch", action="store_false")
    ap.add_argument("--no-triton", dest="triton", action="store_false", help="leave out the jax-triton chain")
    a = ap.parse_args()
    nodes = [int(n) for n in a.nodes.split(",")]
    rows = list(jax_rows(nodes, a.calls, a.triton)) + (list(torch_rows(nodes, a.calls)) if a.torch else [])
    print(f"{'what':18s} {'kernels':>7s} {'returns us':>11s} {'done us':>8s}")
    for name, n, ret, done in rows:
        print(f"{name:18s} {n:7d} {ret:11.1f} {done:8.1f}")
    for name in dict.fromkeys(r[0] for r in rows):
        pts = [(n, ret, done) for w, n, ret, done in rows if w == name]
        if len(pts) > 1:
            ns = np.array([p[0] for p in pts], float)
            print(f"{name}: per kernel {np.polyfit(ns, [p[1] for p in pts], 1)[0]:.2f} us to return, "
                  f"{np.polyfit(ns, [p[2] for p in pts], 1)[0]:.2f} us until done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
