"""Quick GPU smoke check of the kernel backends: compile, bitwise relations, rough timings.

Run on the GPU machine: PYTHONPATH=src python3 scripts/gpu_smoke.py
"""

import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import gdn_lossless_jax as gl
from gdn_lossless_jax import backends
from gdn_lossless_jax.cases import Shape, commit_indices, verify_inputs
from gdn_lossless_jax.testing import compare_bitwise

print("jax", jax.__version__, jax.devices(), flush=True)


def step(name, fn):
    t = time.perf_counter()
    try:
        out = fn()
        print(f"[ok] {name} ({time.perf_counter() - t:.1f}s): {out}", flush=True)
        return out
    except Exception:
        print(f"[FAIL] {name}", flush=True)
        traceback.print_exc(file=sys.stdout)
        return None


def timeit(f, *args, reps=30, trials=7):
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(trials):
        t = time.perf_counter()
        for _ in range(reps):
            out = f(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t) / reps * 1e6)
    return f"median {np.median(ts):.1f} us (min {min(ts):.1f}, max {max(ts):.1f})"


pal = backends.resolve("pallas", "verify")
names = ["reference", "pallas"]
try:
    import jax_triton  # noqa: F401

    names.append("triton")
except Exception as e:  # noqa: BLE001
    print("no jax_triton:", e)

shape = Shape(N=5, D=4, H=16, HV=32, K=128, V=128)
for sd in (jnp.float32, jnp.bfloat16):
    x = verify_inputs(0, shape, kind="mixed", state_dtype=sd)
    res = {}
    for form in ("ptx", "portable"):
        for rec in gl.RECORD_MODES:
            res[form, rec] = step(
                f"pallas verify {rec} {form} {jnp.dtype(sd).name}",
                lambda: jax.block_until_ready(
                    pal.verify(**x, record=rec, scale=128**-0.5, out_dtype=jnp.bfloat16, form=form)
                ),
            )
    if all(v is not None for v in res.values()):
        step("ptx vs portable (outputs, tapes)", lambda: [str(compare_bitwise(res["ptx", r], res["portable", r])) for r in gl.RECORD_MODES])
        step("outputs tuples vs snapshots", lambda: str(compare_bitwise(res["ptx", "tuples"][0], res["ptx", "snapshots"][0])))
        tup, snp = res["ptx", "tuples"][1], res["ptx", "snapshots"][1]
        last = jnp.full((5,), 3, jnp.int32)
        step("reference replay of pallas tape vs pallas snapshots", lambda: str(compare_bitwise(snp.states[:, 3], gl.replay(x["state0"], tup, last, backend="reference"))))
        step("pallas replay vs pallas snapshots", lambda: str(compare_bitwise(snp.states[:, 3], gl.replay(x["state0"], tup, last, backend="pallas"))))
        step("naive in-kernel replay differs", lambda: str(compare_bitwise(snp.states[:, 3], pal.replay(x["state0"], tup, last, form="naive"))))
        ref_o, ref_t = gl.verify(**x, backend="reference")
        step("pallas tape vs reference tape", lambda: str(compare_bitwise(ref_t, tup)))
        step("pallas outputs vs reference (max abs diff)", lambda: float(jnp.abs(ref_o.astype(jnp.float32) - res["ptx", "tuples"][0].astype(jnp.float32)).max()))
    for b in names[2:]:
        step(f"{b} verify", lambda: str(compare_bitwise(res["ptx", "tuples"][0], gl.verify(**x, backend=b)[0])))

    # commit on a small pool
    L, S = 3, 13
    pool = jnp.asarray(np.random.default_rng(1).standard_normal((L, S, 32, 128, 128), np.float32)).astype(sd)
    idx = commit_indices(1, N=5, D=4, slots_in_pool=S, invalid=True)
    slot_safe = np.clip(idx.slots, 0, S - 1)
    tups, snps = [], []
    for layer in range(L):
        xl = dict(verify_inputs(layer + 5, shape, kind="mixed", state_dtype=sd), state0=pool[layer, slot_safe])
        tups.append(gl.verify(**xl, backend="pallas")[1])
        snps.append(gl.verify(**xl, record="snapshots", backend="pallas")[1])
    st = lambda xs: jax.tree.map(lambda *a: jnp.stack(a), *xs)  # noqa: E731
    T, Sn = st(tups), st(snps)
    for b in names:
        pt = step(f"{b} commit tuples", lambda: gl.commit(pool, T, *idx.as_args(), backend=b))
        ps = step(f"{b} commit snapshots", lambda: gl.commit(pool, Sn, *idx.as_args(), backend=b))
        if pt is not None and ps is not None:
            step(f"{b} commit tuples vs snapshots", lambda: str(compare_bitwise(ps, pt)))

# rough timings at 25x4
shape = Shape(N=25, D=4, H=16, HV=32, K=128, V=128)
x = verify_inputs(0, shape)
for b in names:
    for rec in gl.RECORD_MODES:
        f = jax.jit(lambda x, b=b, rec=rec: gl.verify(**x, record=rec, backend=b))
        step(f"time verify {b} {rec} 25x4", lambda: timeit(f, x))
big = jnp.ones((256 * 2**20,), jnp.float32)
cp = jax.jit(lambda a: -a)
step("time copy 1 GiB (read+write 2 GiB)", lambda: timeit(cp, big, reps=10, trials=5))
