"""Launch the fused kernel (``commit_and_verify``) once per launch variant, for Nsight Compute's
SASS view and its per-instruction stall samples (run by ``scripts/gpu_session.sh sass_fused``).

One-layer fused steps (``benchmarks.step``'s ``fused_step``, unrolled with ``out=``) at one
configuration: the Pallas kernel with ``pending_replay="split"`` and ``"rows"``, and the Triton
backend's (``"rows"``). A variant whose replay is ``none`` launches the separate step's verify
(one layer, unrolled, ``out=``) instead, with no pending commit. Each variant's step is called
twice (compile and warm-up, then the launch ncu profiles: ``--launch-skip`` the warm-ups by
running ncu with ``-k`` on the kernel names and the NVTX-free order below)::

    ncu -k "regex:gdn_verify_tuples|verify_kernel" --section SourceCounters ... \\
        python scripts/sass_fused.py --config 8x16
"""

from __future__ import annotations

import argparse
import ast
import dataclasses

import jax

from benchmarks import cases as bc
from benchmarks import step as bstep
from gdn_lossless_jax.backends import pallas as gp
from gdn_lossless_jax.backends import triton as gt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="8x16")
    p.add_argument("--variants", default="pallas:split,pallas:rows,triton:rows",
                   help="backend:replay[:field=value...] (VerifyConfig fields, Python literals), comma-separated")
    args = p.parse_args()
    mode = bc.MODES["h200"]
    cfg = bc.parse_configs(args.config, mode.configs)[0]
    geometry = dataclasses.replace(mode.geometry.reduced(gdn_layers=1), name=mode.geometry.name)
    inp = bstep.make_inputs(cfg, geometry, seed=0)
    s = inp.shape
    for variant in args.variants.split(","):
        backend, replay, *fields = variant.split(":")  # backend:replay[:field=value...] of VerifyConfig
        impl = gp if backend == "pallas" else gt
        saved = impl.verify.__kwdefaults__["config"]
        extra = {k: ast.literal_eval(v) for k, v in (f.split("=", 1) for f in fields)}
        base = saved or impl.VerifyConfig()  # None: the Pallas backend's tuned_config of the shape
        replay_field = {} if replay == "none" else {"pending_replay": replay}
        impl.verify.__kwdefaults__["config"] = dataclasses.replace(base, **replay_field, **extra)
        try:
            pool = bstep._allocate(inp, "tuples", 1)
            obuf = [bstep._filled(jax.ShapeDtypeStruct((1, s.N, s.D, s.HV, s.V), inp.qkv["q"].dtype), 9)]
            if replay == "none":  # the separate step's verify
                box = [bstep._filled((pool.ssm, pool.tape), 11)]
                one = bstep.direct_runner(bstep.direct_step(backend, "unrolled-out"), "unrolled-out", inp, box, obuf,
                                          lambda: inp.index_sets[0])  # fmt: skip
            else:
                box = [bstep._filled((pool.ssm, pool.tape, pool.tape), 11)]
                one = bstep.fused_runner([bstep.fused_step(backend, form="unrolled-out")], "unrolled-out", inp, box,
                                         obuf)  # fmt: skip
            for _ in range(2):
                jax.block_until_ready(one())
            print("launched", variant, flush=True)
        finally:
            impl.verify.__kwdefaults__["config"] = saved


if __name__ == "__main__":
    main()
