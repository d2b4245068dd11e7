"""Record a portable-mode fixture: inputs, outputs, tape and committed pool of ``math="portable"``.

A fixture recorded on one platform is reproduced bit for bit on another by
``tests/test_portable.py::test_fixture_reproduces`` (CI runs it on the CPU). Run on the machine
whose results are to be pinned:

    python scripts/portable_fixtures.py [--backend reference] [--out tests/fixtures/portable/<name>.npz]

It verifies every layer of a small pool (2 GDN layers, 3 requests of 4 drafts, H=2, HV=4, K=V=16;
bf16 inputs, fp32 states), both record modes, then commits (accepted steps, a track copy) and
writes one ``.npz`` (~100 KB):

- the inputs: ``pool`` ``[L, S+1, HV, V, K]``, ``q``, ``k`` ``[L, N, D, H, K]``, ``v``, ``a``,
  ``b`` (bf16, stored as their uint16 bits), ``A_log``, ``dt_bias`` ``[L, HV]``, ``slots``,
  ``steps``, ``track_slots``, ``track_steps``;
- portable mode: ``outputs`` ``[L, N, D, HV, V]`` (fp32), the tuple tape ``u``, ``tape_k``, ``g``,
  and ``committed``, the pool after the commit (the tuple and the snapshot commits agree: checked
  here before anything is written);
- the same run in the default mode, ``platform_outputs``, ``platform_u``, ``platform_committed``:
  what a fixture from another platform is *not* expected to match (the control);
- ``meta``: the platform, device, backend and versions (a JSON string).

The inputs come from NumPy's generator, not ``jax.random`` (whose normal draws go through the
platform's float math), and the fixture stores them, so a reproduction reads them from the file.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the checkout's package, also when run as a file
    sys.path.insert(0, str(ROOT))

import gdn_lossless_jax as gl  # noqa: E402

L, S, N, D, H, HV, K, V = 2, 6, 3, 4, 2, 4, 16, 16
BF16_INPUTS = ("q", "k", "v", "a", "b")


def make_inputs(seed: int = 0) -> dict[str, np.ndarray]:
    """The fixture's inputs (NumPy arrays; bf16 ones as ``ml_dtypes.bfloat16``)."""
    rng = np.random.default_rng(seed)
    bf16 = jnp.bfloat16
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    inp = dict(
        pool=0.5 * normal(L, S + 1, HV, V, K),
        q=normal(L, N, D, H, K).astype(bf16),
        k=normal(L, N, D, H, K).astype(bf16),
        v=normal(L, N, D, HV, V).astype(bf16),
        # decays over a wide range: a + dt_bias from about -8 to 8, A_log around 0
        a=(3.0 * normal(L, N, D, HV)).astype(bf16),
        b=normal(L, N, D, HV).astype(bf16),
        A_log=0.5 * normal(L, HV),
        dt_bias=normal(L, HV),
        slots=np.array([2, 0, 5], np.int32),
        steps=np.array([3, 0, 2], np.int32),
        track_slots=np.array([-1, -1, 4], np.int32),
        track_steps=np.array([-1, -1, 1], np.int32),
    )
    return inp


def run(inp: dict, *, math: str, backend: str = "reference", device=None,
        records=("tuples", "snapshots")) -> dict[str, np.ndarray]:  # fmt: skip
    """Verify every layer (in each record mode of ``records``), commit; the results as NumPy arrays
    (the tuple mode's tape). With both modes, their outputs and committed pools must agree.

    ``device``: where to compute (the inputs are put there); None: JAX's default device.
    """
    if device is not None:  # every array the calls make lands there too
        with jax.default_device(device):
            return run(inp, math=math, backend=backend, records=records)
    x = {name: jnp.asarray(value) for name, value in inp.items()}
    pool, slots = x["pool"], x["slots"]
    results = {}
    for record in records:
        outs, tapes = [], []
        for layer in range(L):
            o, t = gl.verify(pool, *(x[n][layer] for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias")),
                             slots=slots, layer=layer, record=record, backend=backend, out_dtype=jnp.float32,
                             math=math)  # fmt: skip
            outs.append(o)
            tapes.append(t)
        tape = gl.stack_tapes(tapes)
        committed = gl.commit(pool, tape, slots, x["steps"], x["track_slots"], x["track_steps"], backend=backend,
                              math=math)  # fmt: skip
        results[record] = (jnp.stack(outs), tape, committed)
    o_t, tape, c_t = results["tuples"]
    if "snapshots" in results:
        o_s, _, c_s = results["snapshots"]
        for what, p, q in (("outputs", o_t, o_s), ("committed pool", c_t, c_s)):
            if not np.array_equal(np.asarray(p).view(np.uint32), np.asarray(q).view(np.uint32)):
                raise AssertionError(f"math={math!r}, backend={backend!r}: the two record modes' {what} differ")
    return dict(outputs=np.asarray(o_t), u=np.asarray(tape.u), tape_k=np.asarray(tape.k), g=np.asarray(tape.g),
                committed=np.asarray(c_t))  # fmt: skip


def record(seed: int = 0, backend: str = "reference") -> dict[str, np.ndarray]:
    """The fixture's arrays (what :func:`main` writes)."""
    inp = make_inputs(seed)
    out = run(inp, math="portable", backend=backend)
    plat = run(inp, math="platform", backend=backend)
    arrays = {n: (np.asarray(v).view(np.uint16) if n in BF16_INPUTS else np.asarray(v)) for n, v in inp.items()}
    arrays.update(out)
    arrays.update(platform_outputs=plat["outputs"], platform_u=plat["u"], platform_committed=plat["committed"])
    dev = jax.devices()[0]
    arrays["meta"] = np.array(json.dumps(dict(
        platform=jax.default_backend(), device=getattr(dev, "device_kind", str(dev)), backend=backend, seed=seed,
        jax=jax.__version__, gdn_lossless_jax=gl.__version__,
    )))  # fmt: skip
    return arrays


def load_inputs(fixture) -> dict[str, np.ndarray]:
    """A fixture's inputs, the bf16 ones back from their bits."""
    names = ("pool", *BF16_INPUTS, "A_log", "dt_bias", "slots", "steps", "track_slots", "track_steps")
    return {n: (fixture[n].view(jnp.bfloat16) if n in BF16_INPUTS else fixture[n]) for n in names}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="reference")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=pathlib.Path, default=None,
                    help="default: tests/fixtures/portable/<platform>-<backend>.npz")  # fmt: skip
    args = ap.parse_args(argv)
    out = args.out or ROOT / "tests/fixtures/portable" / f"{jax.default_backend()}-{args.backend}.npz"
    out.parent.mkdir(parents=True, exist_ok=True)
    arrays = record(args.seed, args.backend)
    np.savez_compressed(out, **arrays)
    print(f"{out}: {out.stat().st_size / 1024:.0f} KiB, {json.loads(str(arrays['meta']))}")


if __name__ == "__main__":
    main()
