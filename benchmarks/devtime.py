"""Device time from a profiler trace: the GPU's own kernel durations (CUPTI), no dispatch.

``jax.profiler`` records every kernel a traced region launches, with its start and duration
as the GPU measured them. Summing the durations of the kernels one invocation launched gives
its *device time*: what the work costs on the GPU when nothing waits on the host (inside a
CUDA graph or a larger jitted program), free of JAX's Python dispatch and of the host clock's
noise. On a CPU-only backend the trace has no device plane and the functions return None.
"""

from __future__ import annotations

import glob
import tempfile
from collections import defaultdict
from typing import Callable

import numpy as np

__all__ = ["trace_kernels", "device_time", "busy_us", "copy_rate"]

# Lines of a GPU plane that repeat the kernels under other groupings (XLA ops, modules,
# launch statistics): only the per-stream lines list each kernel once.
_STREAM_PREFIX = "Stream"
_HOST_COPIES = ("H2D", "D2H", "HtoD", "DtoH")
_DETAILS = "kernel_details"


def trace_kernels(run: Callable[[], None], invocations: int, details: dict[str, str] | None = None,
                  intervals: list[tuple[float, float]] | None = None) -> dict[str, list[float]] | None:
    """Run ``run`` ``invocations`` times under the profiler; kernel name -> durations in us.

    ``run`` must block until the device is done. Returns None when the trace holds no GPU
    kernel (a CPU backend). ``details``, when given, receives each kernel's launch details as
    the tracer records them (``kernel_details``: registers per thread, shared memory, grid,
    block, occupancy). ``intervals``, when given, receives each kernel's (start, end) in us."""
    import jax

    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        try:
            for _ in range(invocations):
                run()
        finally:
            jax.profiler.stop_trace()
        files = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        if not files:
            return None
        data = jax.profiler.ProfileData.from_file(files[0])
    out: dict[str, list[float]] = defaultdict(list)
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith(_STREAM_PREFIX):
                continue
            for ev in line.events:
                if any(x in ev.name for x in _HOST_COPIES):  # device-to-device copies count
                    continue
                out[ev.name].append(ev.duration_ns / 1e3)
                if intervals is not None:
                    intervals.append((ev.start_ns / 1e3, (ev.start_ns + ev.duration_ns) / 1e3))
                if details is not None and ev.name not in details:
                    details[ev.name] = next((str(v) for k, v in ev.stats if k == _DETAILS), "")
    return dict(out) or None


def device_time(run: Callable[[], None], invocations: int, calls: int) -> dict | None:
    """Device time per call of ``run`` (which makes ``calls`` calls of the work), and the
    kernels that make it up (count per call, median and p10/p90 of one launch, total per
    call), largest first. ``busy_us_per_call``: the union of the kernels' intervals per call, less
    than the sum where kernels ran at the same time (streams, or a CUDA graph whose independent
    nodes overlap)."""
    details: dict[str, str] = {}
    spans: list[tuple[float, float]] = []
    kernels = trace_kernels(run, invocations, details, spans)
    if kernels is None:
        return None
    n = invocations * calls
    per_kernel = []
    for name, durs in kernels.items():
        d = np.asarray(durs)
        per_kernel.append({
            "name": name[:120],
            "launches_per_call": len(d) / n,
            "median_us": float(np.median(d)),
            "p10_us": float(np.percentile(d, 10)),
            "p90_us": float(np.percentile(d, 90)),
            "us_per_call": float(d.sum() / n),
            "details": " ".join(details.get(name, "").split()),
        })  # fmt: skip
    per_kernel.sort(key=lambda k: -k["us_per_call"])
    return {"us_per_call": float(sum(k["us_per_call"] for k in per_kernel)), "invocations": invocations,
            "busy_us_per_call": busy_us(spans) / n, "kernels": per_kernel}  # fmt: skip


def busy_us(intervals) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def copy_rate(gib: int = 2) -> tuple[float, float]:
    """``(device us, bytes per second)`` of XLA's ``x * 2`` over ``gib`` GiB of fp32 (one read
    and one write per element): the copy rate that byte counts are divided by for a byte floor."""
    import jax
    import jax.numpy as jnp

    big = jnp.ones((gib * 2**28,), jnp.float32)
    cp = jax.jit(lambda x: x * 2)
    jax.block_until_ready(cp(big))
    us = device_time(lambda: jax.block_until_ready(cp(big)), 8, 1)["us_per_call"]
    return us, 2 * big.nbytes / (us * 1e-6)
