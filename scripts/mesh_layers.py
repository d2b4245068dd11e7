"""The demo model's GDN, attention and logits blocks of one verify, one device against a 2x1 mesh.

A bisecting aid for a mesh difference like the one ``scripts/mesh_diff.py`` showed at the ``gpu``
size (docs/sharding.md): runs one step of ``SpecStep`` on each, then traces the next step's verify
in one jitted function from the resulting states, returning every block's output, and prints how
many elements of each differ bitwise. Runs on the CPU::

    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu python scripts/mesh_layers.py --dtype float32

In the gpu size's bfloat16 most low-bit differences round away (in the step this script traces,
all of them did; in mesh_diff.py's forced step 1, one element of a layer's 131,072 gated outputs
was left), so ``--dtype float32`` is the sharper probe: before ``model.gated_rmsnorm`` summed its
squares in a fixed order, it showed the first difference at ``L0 mixer`` with ``L0 o`` identical.
"""

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from gdn_lossless_jax import sharding
from gdn_lossless_jax.model import SpecStep, StepInputs, allocate_state, get_config, init_params
from gdn_lossless_jax.model import decode as dec
from gdn_lossless_jax.model.demo import mesh_plan
from gdn_lossless_jax.model.model import gdn_mixer, logits, mlp, rmsnorm

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--size", default="gpu")
ap.add_argument("--dtype", default=None, help="the model's dtype (default: the size's)")
args = ap.parse_args()
config, D, N = get_config(args.size), 4, 8
if args.dtype is not None:
    config = dataclasses.replace(config, dtype=args.dtype)
plan = mesh_plan(2, 1, config)
params = init_params(config, 0)
rng = np.random.default_rng(0)
new = lambda: allocate_state(config, slots=2 * N, requests=N, drafts=D, record="tuples", max_len=64)
inputs = StepInputs(
    slots=np.arange(N, dtype=np.int32),
    rows=np.arange(N, dtype=np.int32),
    pos=np.zeros(N, np.int32),
    tokens=rng.integers(0, config.vocab, (N, D)).astype(np.int32),
    n_given=np.full(N, D, np.int32),
    track_slots=np.arange(N, 2 * N, dtype=np.int32),
)


def trace(step, params, state, inputs):
    c = step.config
    pool = state.pool
    x = inputs.tokens
    h = params.embed[x]
    hs = [("embed", h)]
    gi = 0
    kv = state.kv
    positions = inputs.pos[:, None] + jnp.arange(D, dtype=jnp.int32)[None, :]
    s_kv = dec._in_range(inputs.slots, kv.k.shape[1])
    ai = 0
    for blk, kind in zip(params.blocks, c.kinds):
        if kind != "gdn":
            rows_k = kv.k.at[ai, s_kv].get(mode="fill", fill_value=0)
            rows_v = kv.v.at[ai, s_kv].get(mode="fill", fill_value=0)
            xn = rmsnorm(h, blk.norm1)
            out, _ = dec.attention(blk.mixer, c, xn, rows_k, rows_v, positions)
            hs += [(f"A{ai} xn", xn), (f"A{ai} rows_k", rows_k), (f"A{ai} attn", out)]
            h = h + out
            h = h + mlp(blk.mlp, rmsnorm(h, blk.norm2))
            hs.append((f"A{ai} h", h))
            ai += 1
            continue
        cap = {}

        def core(mixed, a, b, p, layer=gi, cap=cap):
            nonlocal pool
            cap["mixed"] = mixed
            o, pool = step._verify_layer(pool, layer, mixed, a, b, p, inputs)
            cap["o"] = o
            return o

        xn = rmsnorm(h, blk.norm1)
        mix = gdn_mixer(blk.mixer, c, xn, core=core)
        hs += [(f"L{gi} xn", xn), (f"L{gi} mixed", cap["mixed"]), (f"L{gi} o", cap["o"]), (f"L{gi} mixer", mix)]
        h = h + mix
        h = h + mlp(blk.mlp, rmsnorm(h, blk.norm2))
        hs.append((f"L{gi} h", h))
        gi += 1
    lg = logits(params, h)
    hs.append(("logits", lg))
    return [v for _, v in hs], [n for n, _ in hs]


single = SpecStep(config, D, track_interval=16)
on_mesh = dataclasses.replace(single, mesh=plan)
inputs1 = dataclasses.replace(
    inputs, pos=np.full(N, D, np.int32), tokens=rng.integers(0, config.vocab, (N, D)).astype(np.int32)
)
s0, out0 = single(params, new(), jax.tree.map(jnp.asarray, inputs))
names = trace(single, params, jax.tree.map(jnp.copy, s0), jax.tree.map(jnp.asarray, inputs1))[1]
f = jax.jit(lambda *a: trace(*a)[0], static_argnums=0)
a = list(zip(names, f(single, params, jax.tree.map(jnp.copy, s0), jax.tree.map(jnp.asarray, inputs1))))
mp, ms, mi = dec.place_on_mesh(plan, config, params, new(), jax.tree.map(jnp.asarray, inputs))
ms0, mout0 = on_mesh(mp, ms, mi)
print(
    "step 0 outputs equal:",
    all(np.array_equal(np.asarray(u), np.asarray(v)) for u, v in zip(jax.tree.leaves(out0), jax.tree.leaves(mout0))),
)
back = dec.pool_from_mesh(ms0.pool, config.geometry, 2)
from gdn_lossless_jax.testing import compare_bitwise

print("pool after step 0:", compare_bitwise(jax.device_get(s0.pool), back))
print("kv after step 0:", compare_bitwise(jax.device_get(s0.kv), jax.device_get(ms0.kv)))
mi1 = dec.place_on_mesh(plan, config, params, new(), jax.tree.map(jnp.asarray, inputs1))[2]
b = list(zip(names, f(on_mesh, mp, ms0, mi1)))
for (n, x), (_, y) in zip(a, b):
    x, y = np.asarray(x), np.asarray(y)
    if n.endswith("mixed"):
        y = np.asarray(sharding.from_tp_layout(y, config.geometry, 2, -1))
    d = x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32) != y.view(
        np.uint16 if y.dtype.itemsize == 2 else np.uint32
    )
    print(
        f"{n:12} {x.dtype} {x.shape}: {int(d.sum())} elements differ"
        + (f", rows {sorted(set(np.argwhere(d)[:, 0].tolist()))}" if d.any() else "")
    )
