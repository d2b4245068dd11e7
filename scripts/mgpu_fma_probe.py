#!/usr/bin/env python3
"""Can a Pallas Mosaic GPU kernel pin the commit rule's rounding, ``fma(k, u, rn(S * alpha))``?

A feasibility probe for a Mosaic GPU fused kernel (``benchmarks/NOTES.md``, eighteenth session), on the GPU
only: Mosaic GPU kernels do not lower on a CPU-only jaxlib, and its interpret mode refuses ``inline_mgpu``.

One ``[128, 128]`` float32 kernel (one warpgroup), three forms of the update from adversarial inputs:

* ``pinned``: the product ``S * alpha`` as a plain multiply, then MLIR's ``math.fma`` on Mosaic GPU's
  ``FragmentedArray`` registers (``plgpu.inline_mgpu``);
* ``plain``: ``k * u + S * alpha`` written in jax.numpy inside the kernel (what the compiler makes of it);

each compared on bit patterns with NumPy oracles (``testing.fma_oracle``): the rule, the other product fused, and
both products rounded. ``pinned`` must equal the rule everywhere; ``plain`` says what an unpinned form does.

    python scripts/mgpu_fma_probe.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

from gdn_lossless_jax.testing import bits, fma_oracle, mul_oracle

INTERPRET = None  # --interpret: the plain form in Mosaic GPU's interpret mode (the CPU; inline_mgpu is refused there)


def main() -> int:
    from jax._src.lib.mlir.dialects import math as mlir_math
    from jax.experimental.pallas import mosaic_gpu as plgpu

    print("jax", jax.__version__, jax.devices()[0].device_kind, flush=True)
    shape = (128, 128)
    layout = plgpu.Layout.WG_STRIDED(shape, vec_size=4)

    @plgpu.inline_mgpu(arg_types=(layout,) * 4, return_type=plgpu.ShapeDtypeStruct(shape, jnp.float32, layout=layout))
    def pinned_rule(ctx, k, u, s, a):
        sd = s * a  # arith.mulf: one rounding
        return k._pointwise(lambda x, y, z: mlir_math.fma(x, y, z), u, sd)

    def loads(*refs):  # GMEM straight to registers, in the layout inline_mgpu declares
        return [plgpu.load(r, layout=layout, optimized=False) for r in refs]

    def pinned_body(k_ref, u_ref, s_ref, a_ref, o_ref):
        o_ref[...] = pinned_rule(*loads(k_ref, u_ref, s_ref, a_ref))

    def plain_body(k_ref, u_ref, s_ref, a_ref, o_ref):
        k, u, s, a = loads(k_ref, u_ref, s_ref, a_ref)
        o_ref[...] = k * u + s * a

    out = jax.ShapeDtypeStruct(shape, jnp.float32)
    rng = np.random.default_rng(20261202)

    def adversarial():
        # products that cancel against the state, so each form's roundings show
        k = rng.standard_normal(shape).astype(np.float32)
        u = rng.standard_normal(shape).astype(np.float32)
        a = np.exp(-rng.random(shape)).astype(np.float32)
        s = (-(k.astype(np.float64) * u) / a * (1 + rng.standard_normal(shape) * 1e-6)).astype(np.float32)
        return k, u, s, a

    k, u, s, a = adversarial()
    rule = fma_oracle(k, u, mul_oracle(s, a))
    other = fma_oracle(s, a, mul_oracle(k, u))
    both = fma_oracle(mul_oracle(k, u), np.ones(shape, np.float32), mul_oracle(s, a))  # rn(rn(k u) + rn(S alpha))
    print(
        f"oracles differ: rule vs other {np.mean(bits(rule) != bits(other)):.3f}, "
        f"rule vs both rounded {np.mean(bits(rule) != bits(both)):.3f}"
    )
    rc = 0
    for name, body in (("pinned", pinned_body), ("plain", plain_body)):
        try:
            f = plgpu.kernel(body, out_type=out, interpret=INTERPRET if name == "plain" else None)
            got = np.asarray(jax.jit(f)(*(jnp.asarray(x) for x in (k, u, s, a))))
        except Exception as e:  # noqa: BLE001 (a form Mosaic GPU cannot build is a result too)
            import traceback

            tb = traceback.extract_tb(e.__traceback__)[-3:]
            print(
                f"{name}: failed: {type(e).__name__}: {str(e)[:400]} at "
                + " < ".join(f"{Path(t.filename).name}:{t.lineno} {t.line}" for t in reversed(tb))
            )
            rc = 1
            continue
        same = {o: float(np.mean(bits(got) == bits(x))) for o, x in (("rule", rule), ("other", other), ("both", both))}
        print(
            f"{name}: equal to the rule {same['rule']:.4f}, to the other product fused {same['other']:.4f}, "
            f"to both rounded {same['both']:.4f}"
        )
        if name == "pinned" and same["rule"] != 1.0:
            rc = 1
    return rc


if __name__ == "__main__":
    if "--interpret" in sys.argv[1:]:
        from jax.experimental.pallas import mosaic_gpu as _plgpu

        INTERPRET = _plgpu.InterpretGPUParams()
    raise SystemExit(main())
