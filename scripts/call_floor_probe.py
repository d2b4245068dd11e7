"""What a jitted call costs by wall-clock when something else ran just before it.

``benchmarks.step`` times its rows in interleaved rounds, and there a jitted call that holds
one tiny kernel took 0.32-0.39 ms against 0.10-0.11 back to back (``benchmarks/README.md``),
while SGLang's CUDA graph lost 0.04-0.09 ms. This asks why: a jitted chain of ``n`` tiny
kernels (Pallas ``x + 1`` on ``[8, 128]`` fp32, its input donated) is timed from the call to
``block_until_ready``'s return, right after each of:

* ``b2b``: the same call (a decode loop with nothing between);
* ``poll``: the same, each call waited for by polling ``is_ready()`` instead of
  ``block_until_ready`` (the host thread spins, never sleeps);
* ``sync``: the same, each call waited for by the driver's wait on the device
  (``gdn_lossless_jax.sync.synchronize``, as ``torch.cuda.synchronize()`` waits; GPUs only);
* ``jax``: another jitted program (``--other-nodes`` tiny kernels), blocked on;
* ``torch``: a PyTorch CUDA graph replay of as many tiny kernels, synchronized (``--no-torch``
  leaves it out);
* ``spin``: the host busy for ``--idle-us`` (a loop on ``time.perf_counter``), the GPU idle;
* ``sleep``: ``time.sleep`` for as long (the host thread sleeps too);
* ``gpubusy``: the host spinning as long while the GPU runs a PyTorch ``torch.cuda._sleep``
  kernel of about that length on its own stream (not waited for): is it the GPU that idled,
  or the host's threads?

each with XLA's command buffers on (the default) and off (``xla_gpu_enable_command_buffer=""``
for the jit), and the PyTorch graph itself timed the same way (``torch graph``). Medians of
``--calls``, wall-clock and the time until the call returns. Last, a jit as long as a step
(the chain plus a pass over a ``--long-mb`` buffer, donated) run ``--calls`` times blocking on
each call, then polling ``is_ready()`` on each call (the waiting thread never sleeps), then
with the driver's wait on the device after each call (``gdn_lossless_jax.sync.synchronize``,
as ``torch.cuda.synchronize()`` waits; GPUs only), then as many dispatched ahead with one
block at the end: per call, the difference is what waiting on every step costs::

    python scripts/call_floor_probe.py --nodes 1,64
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="1,64", help="kernels in the timed jit, comma-separated")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--other-nodes", type=int, default=1, help="kernels in the other program (jax, torch)")
    ap.add_argument("--pool-mb", type=int, default=0, help="a donated buffer of this size passed through the timed jit")
    ap.add_argument("--long-mb", type=int, default=None, help="the long jit's buffer (0: not run; default 4096 on a "
                    "GPU, 64 on the CPU)")
    ap.add_argument("--idle-us", type=float, default=1000.0, help="spin and sleep: how long the host waits")
    ap.add_argument("--no-torch", dest="torch", action="store_false")
    a = ap.parse_args()

    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for benchmarks/
    from benchmarks.timing import spin_until_ready
    from gdn_lossless_jax.sync import synchronize

    interpret = jax.default_backend() == "cpu"
    if a.long_mb is None:
        a.long_mb = 64 if interpret else 4096

    def add_one(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    kernel = pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32), interpret=interpret)

    def chain(n, cmdbuf):
        def f(x, pool):
            for _ in range(n):
                x = kernel(x)
            return x, pool

        opts = None if cmdbuf else {"xla_gpu_enable_command_buffer": ""}
        return jax.jit(f, donate_argnums=(0, 1), compiler_options=opts if not interpret else None)

    def other_chain(y):
        for _ in range(a.other_nodes):
            y = kernel(y)
        return y

    other = jax.jit(other_chain)
    y = jnp.zeros((8, 128), jnp.float32)

    before = {
        "b2b": lambda: None,
        "jax": lambda: jax.block_until_ready(other(y)),
        "spin": lambda: _spin(a.idle_us * 1e-6),
        "sleep": lambda: time.sleep(a.idle_us * 1e-6),
    }
    if a.torch and not interpret:
        before["torch"] = _torch_replay(a.other_nodes)
        before["gpubusy"] = _gpu_busy(a.idle_us * 1e-6)

    # (what runs before each call, how the call is waited for): ``poll`` is back to back, waited
    # for by polling; the PyTorch graph below waits its own way, so it runs ``before`` only
    cases = [(name, pre, jax.block_until_ready) for name, pre in before.items()]
    cases.insert(1, ("poll", before["b2b"], spin_until_ready))
    if not interpret:  # back to back, waited for by the driver's wait on the device
        cases.insert(2, ("sync", before["b2b"], lambda out: (synchronize(), out)[1]))
    print(f"{'jit':>16} {'before':>7} {'wall us':>9} {'returns us':>11}")
    for n in [int(s) for s in a.nodes.split(",")]:
        for cmdbuf in (True, False):
            f = chain(n, cmdbuf)
            box = [jnp.zeros((8, 128), jnp.float32), jnp.zeros((a.pool_mb << 18,), jnp.float32)]
            for _ in range(20):
                box = list(jax.block_until_ready(f(*box)))
            for name, pre, wait in cases:
                wall, ret = [], []
                for _ in range(a.calls):
                    pre()
                    t = time.perf_counter()
                    out = f(*box)
                    ret.append(time.perf_counter() - t)
                    box = list(wait(out))
                    wall.append(time.perf_counter() - t)
                label = f"{n} kernels, cb {'on' if cmdbuf else 'off'}"
                print(f"{label:>16} {name:>7} {np.median(wall) * 1e6:9.1f} {np.median(ret) * 1e6:11.1f}", flush=True)
    if a.long_mb:
        n = int(a.nodes.split(",")[-1])

        def long(x, big):
            for _ in range(n):
                x = kernel(x)
            return x, big * 1.0000001

        f = jax.jit(long, donate_argnums=(0, 1))
        box = [jnp.zeros((8, 128), jnp.float32), jnp.ones((a.long_mb << 18,), jnp.float32)]
        for _ in range(5):
            box = list(jax.block_until_ready(f(*box)))
        walls = []
        for _ in range(a.calls):
            t = time.perf_counter()
            box = list(jax.block_until_ready(f(*box)))
            walls.append(time.perf_counter() - t)
        spins = []  # waiting on each call by polling is_ready() (the host thread never sleeps)
        for _ in range(a.calls):
            t = time.perf_counter()
            box = list(spin_until_ready(f(*box)))
            spins.append(time.perf_counter() - t)
        synced = []  # waiting on each call with the driver's wait on the device (GPUs only)
        for _ in range(a.calls if not interpret else 0):
            t = time.perf_counter()
            box = list(f(*box))
            synchronize()
            synced.append(time.perf_counter() - t)
        jax.block_until_ready(box)
        t = time.perf_counter()
        for _ in range(a.calls):
            box = list(f(*box))
        jax.block_until_ready(box)
        ahead = (time.perf_counter() - t) / a.calls
        print(f"long jit ({n} kernels and {a.long_mb} MB read and written): blocking on each call "
              f"{np.median(walls) * 1e6:.1f} us a call (median), polling is_ready() on each call "
              f"{np.median(spins) * 1e6:.1f}, the driver's wait on the device (gdn_lossless_jax.sync.synchronize) "
              f"{np.median(synced) * 1e6 if synced else float('nan'):.1f}, "
              f"dispatched ahead {ahead * 1e6:.1f} us a call",
              flush=True)
    if "torch" in before:
        import torch

        replay = _torch_replay(a.other_nodes)
        for name, pre in before.items():
            wall = []
            for _ in range(a.calls):
                pre()
                t = time.perf_counter()
                replay()
                wall.append(time.perf_counter() - t)
            print(f"{'torch graph':>16} {name:>7} {np.median(wall) * 1e6:9.1f}", flush=True)
        torch.cuda.synchronize()
    return 0


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _gpu_busy(seconds: float):
    import torch

    stream = torch.cuda.Stream()
    rate = _sleep_rate(stream)

    def busy():
        with torch.cuda.stream(stream):
            torch.cuda._sleep(int(seconds * rate))
        _spin(seconds)

    return busy


def _sleep_rate(stream) -> float:
    """``torch.cuda._sleep`` cycles a second on this GPU."""
    import torch

    with torch.cuda.stream(stream):
        torch.cuda._sleep(1000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        torch.cuda._sleep(10_000_000)
        end.record(stream)
    end.synchronize()
    return 10_000_000 / (start.elapsed_time(end) * 1e-3)


def _torch_replay(n: int):
    import torch

    x = torch.zeros((8, 128), device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            x.add_(1)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            x.add_(1)

    def replay():
        g.replay()
        torch.cuda.synchronize()

    return replay


if __name__ == "__main__":
    raise SystemExit(main())
