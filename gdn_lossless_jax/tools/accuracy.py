"""Sweep every float32 in a range through ``gdn_lossless_jax.portable.exp`` or ``log`` against float64.

    python -m gdn_lossless_jax.tools.accuracy exp -104 -0x1p-25     # the decay range's nontrivial part
    python -m gdn_lossless_jax.tools.accuracy log 1 5e8               # softplus's log: 1 + exp(x), x <= 20

Prints the number of inputs, the largest error in ULP of the float32 result (against NumPy's
float64 function, itself within an ULP of float64: the error stated is that of the float32
result to ~2**-28 ULP), the inputs not correctly rounded (the float64 value rounded to float32
differs), and the worst input. docs/design.md ("Portable mode") quotes its runs.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from .. import portable

CHUNK = 1 << 22


def ulp_error(y32: np.ndarray, ref64: np.ndarray) -> np.ndarray:
    """``|y - ref|`` in units of the float32 ULP at ``ref`` (the spacing above ``|ref|`` rounded to
    float32; subnormal spacing 2**-149 at the bottom)."""
    a = np.abs(ref64).astype(np.float32)
    a = np.where(np.isinf(a), np.float32(np.finfo(np.float32).max), a)
    up = np.nextafter(a, np.float32(np.inf)).astype(np.float64) - a.astype(np.float64)
    return np.abs(y32.astype(np.float64) - ref64) / up


def float_bits_range(lo: float, hi: float) -> list[tuple[int, int, int]]:
    """``(sign, first, last)`` magnitude bit ranges covering every float32 in ``[lo, hi]``."""
    def mag(x):
        return int(np.float32(abs(x)).view(np.uint32))
    out = []
    if lo < 0:
        out.append((1, mag(min(hi, 0.0)) if hi < 0 else 0, mag(lo)))
    if hi >= 0:
        out.append((0, mag(max(lo, 0.0)) if lo > 0 else 0, mag(hi)))
    return out


def sweep(name: str, lo: float, hi: float) -> dict:
    fn = jax.jit(getattr(portable, name))
    ref = getattr(np, name)
    count = bad = 0
    worst = (0.0, None)
    t0 = time.time()
    for sign, first, last in float_bits_range(lo, hi):
        for start in range(first, last + 1, CHUNK):
            m = np.arange(start, min(start + CHUNK, last + 1), dtype=np.uint32)
            x = (m | np.uint32(sign << 31)).view(np.float32)
            y = np.asarray(fn(x))
            r = ref(x.astype(np.float64))
            e = ulp_error(y, r)
            cr = r.astype(np.float32)
            bad += int(np.count_nonzero(y.view(np.uint32) != cr.view(np.uint32)))
            count += len(x)
            i = int(np.argmax(e))
            if e[i] > worst[0]:
                worst = (float(e[i]), float(x[i]))
    return dict(fn=name, lo=lo, hi=hi, inputs=count, max_ulp=worst[0], worst_input=worst[1], not_correctly_rounded=bad,
                seconds=round(time.time() - t0))  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("fn", choices=("exp", "log"))
    number = lambda s: float.fromhex(s) if "0x" in s.lower() else float(s)  # noqa: E731
    ap.add_argument("lo", type=number)
    ap.add_argument("hi", type=number)
    args = ap.parse_args(argv)
    r = sweep(args.fn, args.lo, args.hi)
    frac = r["not_correctly_rounded"] / max(r["inputs"], 1)
    print(f"{r['fn']} over every float32 in [{r['lo']!r}, {r['hi']!r}]: {r['inputs']:,} inputs, max {r['max_ulp']:.4f} "
          f"ULP (at {r['worst_input']!r}), {r['not_correctly_rounded']:,} not correctly rounded ({frac:.4%}), "
          f"{r['seconds']} s")  # fmt: skip


if __name__ == "__main__":
    main()
