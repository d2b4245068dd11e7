"""Bit digests of the library's CPU work, to compare XLA:CPU compile settings.

``tests/conftest.py`` compiles the CPU suite with ``--xla_llvm_disable_expensive_passes=true``
(the suite's time, docs/testing.md); users compile with XLA's defaults. That flag turns off LLVM
passes that must not change a float result (XLA:CPU emits no fast-math flags unless asked), and
``tests/test_compile_flags.py`` checks it: it runs :func:`digests` in a process with XLA's
defaults and compares the bits with its own process's.

The work covers the arithmetic the suite's bit-exactness tests compile: the reference's verify
(both record modes, bf16 outputs, from the pool by slot), replay, commit into a bf16 pool and
fused ``commit_and_verify``, and the conv; with ``--full`` (not in the test: its time) also the
Pallas kernels in interpret mode (verify, commit, the fused step) and the demo model's speculative
decode (tokens and final states). Run as a script it prints the digests as JSON (``python
tests/flag_digest.py [--full] [seed]``).
"""

from __future__ import annotations

import hashlib
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np


def _sha(tree) -> str:
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(jax.device_get(tree)):
        a = np.asarray(leaf)
        h.update(str((a.shape, a.dtype)).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def _work(seed: int, rule=None, full: bool = False):
    """(name, result) pairs; ``rule``: the replay's rounding form (the control's naive form);
    ``full``: the Pallas kernels (interpret mode) and the demo model's decode too (~27 s more on
    one core)."""
    import gdn_lossless_jax as gl
    from gdn_lossless_jax import conv, reference
    from gdn_lossless_jax.testing.cases import Shape, commit_indices, verify_inputs

    s = Shape(N=3, D=4, H=2, HV=4, K=16, V=16)
    x = verify_inputs(seed, s, kind="mixed")
    out, tup = gl.verify(**x, record="tuples", backend="reference", out_dtype=jnp.bfloat16)
    yield "reference verify, tuples, bf16 outputs", (out, tup)
    yield "reference verify, snapshots", gl.verify(**x, record="snapshots", backend="reference")
    steps = jnp.asarray([s.D - 1, 0, 2], jnp.int32)
    yield "reference replay", reference.replay(x["state0"], tup, steps, **({"rule": rule} if rule else {}))

    rng = np.random.default_rng(seed)
    S, R = 8, 5
    pool = jnp.asarray(0.5 * rng.standard_normal((2, S, s.HV, s.V, s.K), np.float32))
    ix = commit_indices(seed, N=s.N, D=s.D, slots_in_pool=S, rows_in_tape=R, invalid=True, permute_rows=True)
    del x["state0"]
    for backend in ("reference", "pallas") if full else ("reference",):
        _, tape = gl.verify(pool, **x, slots=ix.slots, layer=1, record="tuples", backend=backend,
                            tape=gl.Tuples(u=jnp.ones((2, R, s.D, s.HV, s.V)), k=jnp.ones((2, R, s.D, s.H, s.K)),
                                           g=-jnp.ones((2, R, s.D, s.HV))), rows=ix.rows)  # fmt: skip
        yield f"{backend} verify from the pool", tape
        committed = gl.commit(pool.astype(jnp.bfloat16), tape, ix.slots, ix.steps, ix.track_slots, ix.track_steps,
                              ix.rows, backend=backend)  # fmt: skip
        yield f"{backend} commit into a bf16 pool", committed
        pending = gl.Pending(tape, ix.rows, ix.steps, ix.track_slots, ix.track_steps)
        yield f"{backend} commit_and_verify", gl.commit_and_verify(pool, pending, **x, slots=ix.slots, layer=1,
                                                                   backend=backend)  # fmt: skip

    C, Kc = 24, 4
    w, bias = jnp.asarray(rng.standard_normal((C, Kc), np.float32)), jnp.asarray(rng.standard_normal(C, np.float32))
    window = jnp.asarray(rng.standard_normal((s.N, C, Kc - 1), np.float32)).astype(jnp.bfloat16)
    xs = jnp.asarray(rng.standard_normal((s.N, s.D, C), np.float32)).astype(jnp.bfloat16)
    yield "conv verify", conv.causal_conv1d_verify(window, xs, w, bias)
    if not full:
        return

    from gdn_lossless_jax.model import Engine, Request, get_config, init_params

    config = get_config("tiny")
    eng = Engine(init_params(config, seed), config, record="tuples", drafts=4, max_batch=2, max_len=64,
                 track_interval=16)  # fmt: skip
    prompts = [[int(t) for t in rng.integers(0, config.vocab, n)] for n in (9, 20)]
    res = eng.generate([Request(p, 24) for p in prompts])
    yield "the demo model's decode", ([np.asarray(r.tokens) for r in res], eng.state.pool.ssm, eng.state.pool.conv)


def digests(seed: int, rule=None, last: str | None = None, full: bool = False) -> dict[str, str]:
    """Each result's digest, in order; ``last``: stop after that result."""
    out = {}
    for name, result in _work(seed, rule, full):
        out[name] = _sha(result)
        if name == last:
            break
    return out


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--full"]
    print(json.dumps(digests(int(args[0]) if args else 0, full="--full" in sys.argv)))
