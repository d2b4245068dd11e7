"""Where the demo model's speculative step on a mesh first differs from one device.

Runs the same prompts through ``SpecStep`` on one device and on a ``TPxDP`` mesh (default 2x1:
the GDN heads over two devices) and compares every step's outputs bit for bit: first a *forced*
phase (every row is given all D inputs, so the draft proposes nothing and only the target's
verify, accept and commit run), then a *drafting* phase (one given input, D-1 drafted). A
difference in the forced phase is the target's; one that starts in the drafting phase with the
draft chain (``inputs``) is the draft's. Prints the first difference of each field and the final
states' comparison::

    python scripts/mesh_diff.py --size gpu --mesh 2x1 --steps 12,24
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import numpy as np

from gdn_lossless_jax.model import SpecStep, allocate_state, get_config, init_params
from gdn_lossless_jax.model.decode import decode_steps, place_on_mesh, pool_from_mesh
from gdn_lossless_jax.tools.demo import mesh_plan
from gdn_lossless_jax.testing import compare_bitwise

_SEEN: set = set()


def replicas(out, t):
    """Report (once per field) a step output whose copies on two devices hold different bits,
    or whose rows are split over devices."""
    for f in ("inputs", "predictions", "accepted", "track_steps", "gaps"):
        x = getattr(out, f)
        shards = x.addressable_shards
        if len(shards) < 2 or f in _SEEN:
            continue
        index = [s.index for s in shards]
        if any(i != index[0] for i in index):
            _SEEN.add(f)
            print(f"step {t}: {f} is split over devices: {[(str(s.device), s.index) for s in shards]}")
            continue
        data = [np.asarray(s.data) for s in shards]
        if any(d.tobytes() != data[0].tobytes() for d in data[1:]):
            _SEEN.add(f)
            print(f"step {t}: the copies of {f} on {[str(s.device) for s in shards]} differ")


def run(step, params, state, prompts, slots, rows, tslots, n_steps, place=None):
    """``decode_steps`` with each step's outputs checked for copies that differ; returns the
    step outputs, whether each step was forced (every row given all D inputs) and the state."""
    forced = []

    def on_step(t, inputs, out):
        replicas(out, t)
        forced.append(bool((inputs.n_given == step.drafts).all()))

    _, outs, state = decode_steps(step, params, state, prompts, slots, rows, tslots, n_steps, place=place,
                                  on_step=on_step)  # fmt: skip
    return outs, forced, state


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="gpu")
    ap.add_argument("--dtype", default=None, help="the model's dtype (default: the size's); float32 shows the "
                    "differences that bfloat16 rounding hides")  # fmt: skip
    ap.add_argument("--mesh", default="2x1")
    ap.add_argument("--drafts", "-D", type=int, default=4)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--forced-tokens", type=int, default=40, help="prompt length: forced steps = this / D")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default="auto")
    a = ap.parse_args()
    tp, dp = (int(x) for x in a.mesh.split("x"))
    config, D, N = get_config(a.size), a.drafts, a.rows
    if a.dtype is not None:
        config = dataclasses.replace(config, dtype=a.dtype)
    plan = mesh_plan(tp, dp, config)  # the demo's: heads over the tensor axis, DP = 1
    mesh = plan.mesh
    rng = np.random.default_rng(a.seed)
    prompts = [[int(t) for t in rng.integers(0, config.vocab, a.forced_tokens)] for _ in range(N)]
    params = init_params(config, a.seed)
    slots, tslots, rows = (
        np.arange(N, dtype=np.int32),
        np.arange(N, 2 * N, dtype=np.int32),
        np.arange(N, dtype=np.int32),
    )
    max_len = a.forced_tokens + a.steps * D + 8

    def new():
        return allocate_state(config, slots=2 * N, requests=N, drafts=D, record="tuples", max_len=max_len)

    single = SpecStep(config, D, track_interval=16, backend=a.backend)
    want, forced, want_state = run(single, params, new(), prompts, slots, rows, tslots, a.steps)
    mparams, mstate = place_on_mesh(plan, config, params, new())
    on_mesh = dataclasses.replace(single, mesh=plan)
    got, _, got_state = run(on_mesh, mparams, mstate, prompts, slots, rows, tslots, a.steps,
                             place=lambda x: place_on_mesh(plan, config, params, new(), x)[2])  # fmt: skip
    print(f"{a.size} ({config.dtype}), D={D}, {N} rows, mesh {a.mesh} over {[str(d) for d in mesh.devices.flat]}; "
          f"{sum(forced)} forced steps, then {a.steps - sum(forced)} drafting steps")  # fmt: skip
    first = {}
    for t, (w, g) in enumerate(zip(want, got)):
        for f in ("inputs", "predictions", "accepted", "track_steps", "gaps"):
            x, y = np.asarray(getattr(w, f)), np.asarray(getattr(g, f))
            same = x.view(np.uint32).tobytes() == y.view(np.uint32).tobytes() if f == "gaps" else np.array_equal(x, y)
            if not same and f not in first:
                rows_d = sorted({int(i) for i in np.argwhere(x != y)[:, 0]})
                first[f] = t
                print(f"step {t} ({'forced' if forced[t] else 'drafting'}): {f} differ first, rows {rows_d}"
                      + (f"; gaps {x[rows_d[0]]} vs {y[rows_d[0]]}" if f == "gaps" else ""))  # fmt: skip
    if not first:
        print(f"all {a.steps} steps' outputs identical (inputs, predictions, accepted, track steps, gaps bit for bit)")
    back = pool_from_mesh(got_state.pool, config.geometry, tp)
    print("final pool:", compare_bitwise(jax.device_get(want_state.pool), back))
    print("final KV:", compare_bitwise(jax.device_get(want_state.kv), jax.device_get(got_state.kv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
