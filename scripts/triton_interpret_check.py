#!/usr/bin/env python3
"""Check the ``triton`` backend's kernels on a CPU with Triton's interpreter.

Not part of the pytest suite (CI has no Triton). The kernels run under
``TRITON_INTERPRET=1`` on torch CPU tensors, in a second Python environment that has
triton and torch but no JAX (torch's CPU wheel here is for Python 3.11, JAX 0.11.2 needs
3.12); the reference side runs in the project's JAX environment. The two exchange .npz
files in a work folder. In interpreter mode the kernels use NumPy's ``exp``/``log``, an
exactly rounded fma (float64 round-to-odd) and bit-level bfloat16 rounding (``_lang.py``),
so what is checked here is the kernels' *logic*: indexing, tiling, masks, record modes,
the in-place commit, the replay chain and its rounding rule.

Checks, per case (L = 2 layers, N requests with a track copy, permuted rows and invalid
rows, as tests/equivalence.py builds them):

* bitwise: verify outputs are identical in both record modes;
* bitwise: the commit kernel's replay of every step equals the verify kernel's snapshot;
* bitwise: tuple commit == snapshot commit == the expectation built by hand from the
  snapshots (masks: skipped requests, negative steps, out-of-range rows and track slots);
  slots nobody may write keep their bits;
* bitwise: the reference's (JAX) commit of the kernel's snapshot tape equals the kernel's;
* bitwise: the kernel's replay equals an independent NumPy oracle of the rule
  (``testing.replay_oracle``) fed with the kernel's own ``exp(g)``;
* drift: the commit kernel's control forms of the update (``twice_rounded``,
  ``other_product``) differ from the snapshots by >= 1 ULP on fp32 pools;
* close: the kernel's outputs, u, k, g and snapshots against the reference's math in JAX
  (``reference.prepare``/``gdn_step`` with plain XLA ops: exp/log differ between NumPy and
  XLA:CPU and the reductions are ordered differently, so these are reported in ULP and
  bounded by a relative tolerance, not compared bitwise).

KDA cases (``decay="channel"``, :data:`KDA_CASES`): the same checks with a per-channel decay
(``a [N, D, HV, K]``; the prologue is the backend's XLA one, computed in the JAX phase, and the
kernels read ``g [..., HV, K]``), the fused kernel's pending replay with a KDA tape, and one more
control: the tape's decay applied as one factor per head (g averaged over K) must drift, on any
pool dtype.

Usage (from the repository root)::

    python3.11 -m venv /tmp/tvenv   # once: torch's CPU wheel on this disk is for Python 3.11
    /tmp/tvenv/bin/python -m pip install triton==3.6.0 torch==2.13.0 'numpy<2.3'
    # (numpy 2.4 breaks the interpreter's dynamic loops: int() of a one-element array)
    .venv/bin/python scripts/triton_interpret_check.py --triton-python /tmp/tvenv/bin/python

``--quick`` runs three cases; the default runs every draft length of the CPU equivalence
matrix (head layouts and pool setups in turn) at small head sizes, two odd (non power of
two) sizes and one K = V = 128 case. Inputs are kept between runs in ``--work``. Before
the interpreter runs, the kernels are also compiled for sm_90 (no GPU needed) and their
code is checked (``--no-compile`` skips this; see ``compile_kernels``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
KERNELS = REPO / "gdn_lossless_jax" / "backends" / "triton"


@dataclasses.dataclass(frozen=True)
class CaseSpec:
    N: int
    D: int
    H: int
    HV: int
    K: int
    V: int
    dtype: str  # state dtype: float32 | bfloat16
    block_v: int = 32
    L: int = 2
    unroll: bool | None = None  # VerifyConfig.unroll (None: the default by D)
    decay: str = "scalar"  # "channel": KDA (a [N, D, HV, K], the prologue in JAX, g [..., HV, K] in the kernels)
    pending_replay: str = "rows"  # VerifyConfig.pending_replay of the fused kernel

    @property
    def name(self) -> str:
        tail = "" if self.unroll is None else f"-unroll{int(self.unroll)}"
        tail += "-kda" if self.decay == "channel" else ""
        tail += "" if self.pending_replay == "rows" else f"-pending_{self.pending_replay}"
        return f"D{self.D}-H{self.H}-HV{self.HV}-K{self.K}-V{self.V}-N{self.N}-{self.dtype}-BV{self.block_v}{tail}"


#: KDA (per-channel decay) cases: the rows chain with grouped heads (fp32, so the update controls must
#: drift), an odd K and V (masked columns) on a bf16 pool, and the chunk chain (D > 8) with a masked
#: last chunk and the fused kernel's chunk-layout replay (pending_replay="split").
KDA_CASES = (
    CaseSpec(N=5, D=4, H=2, HV=4, K=8, V=16, dtype="float32", block_v=8, decay="channel"),
    CaseSpec(N=4, D=3, H=2, HV=2, K=12, V=20, dtype="bfloat16", block_v=8, decay="channel"),
    CaseSpec(N=3, D=9, H=2, HV=2, K=24, V=20, dtype="float32", block_v=8, decay="channel", pending_replay="split"),
)


def case_specs(quick: bool) -> list[CaseSpec]:
    if quick:
        return [
            CaseSpec(N=5, D=4, H=2, HV=4, K=8, V=16, dtype="bfloat16", block_v=8),
            CaseSpec(N=1, D=3, H=4, HV=16, K=8, V=16, dtype="float32"),
            CaseSpec(N=5, D=2, H=1, HV=2, K=12, V=20, dtype="float32", block_v=8),
            CaseSpec(N=5, D=4, H=2, HV=4, K=8, V=16, dtype="bfloat16", block_v=8, unroll=False),
            *KDA_CASES,
        ]
    # The CPU equivalence matrix's draft lengths, each with one of its head layouts and
    # pool setups in turn (the reference's XLA:CPU compile per shape dominates the time).
    heads = ((16, 32), (4, 16), (8, 8))
    setups = ((1, "float32", 8), (5, "bfloat16", 32))
    specs = []
    for i, D in enumerate((1, 2, 3, 4, 8, 16)):
        (H, HV), (N, dtype, bv) = heads[i % 3], setups[i % 2]
        specs.append(CaseSpec(N=N, D=D, H=H, HV=HV, K=8, V=16, dtype=dtype, block_v=bv))
    specs.append(CaseSpec(N=5, D=3, H=1, HV=2, K=12, V=20, dtype="float32", block_v=8))
    specs.append(CaseSpec(N=4, D=5, H=2, HV=6, K=24, V=40, dtype="bfloat16", block_v=16))
    specs.append(CaseSpec(N=2, D=4, H=2, HV=4, K=128, V=128, dtype="float32", block_v=32))
    specs.extend(KDA_CASES)
    specs.append(CaseSpec(N=2, D=4, H=2, HV=2, K=128, V=128, dtype="float32", block_v=32, decay="channel"))
    return specs


# ---------------------------------------------------------------------------------------
# Arrays across environments: bfloat16 travels as uint16 bits.
# ---------------------------------------------------------------------------------------
def _save(path: Path, arrays: dict):
    out = {}
    for k, v in arrays.items():
        v = np.asarray(v)
        if v.dtype.name == "bfloat16":
            out[k + "__bf16"] = v.view(np.uint16)
        else:
            out[k] = v
    np.savez(path, **out)


def _load_np(path: Path, bf16=None) -> dict:
    """Load a .npz; bfloat16 fields come back through ``bf16(uint16_array)``."""
    out = {}
    with np.load(path) as f:
        for k in f.files:
            if k.endswith("__bf16"):
                out[k[: -len("__bf16")]] = bf16(f[k]) if bf16 else f[k]
            else:
                out[k] = f[k]
    return out


# ---------------------------------------------------------------------------------------
# Phase 1 (JAX environment): inputs and reference results.
# ---------------------------------------------------------------------------------------
def _reference_close(state0, q, k, v, a, b, A_log, dt_bias, scale):
    """The reference's math (``reference.prepare``, ``reference.gdn_step``) with plain ops.

    ``(outputs, u, k, g, states)``. The rounding forms are XLA's plain multiply and
    multiply-add instead of the pinned portable ones: XLA:CPU compiles the pinned verify in
    minutes per shape, this in a second, and it only feeds the tolerance comparison (the
    bitwise checks compare the kernels with themselves, the NumPy oracle and the reference
    commit).
    """
    import jax
    import jax.numpy as jnp
    from jax import lax

    from gdn_lossless_jax import reference

    HV = v.shape[2]
    qn, kn, g, beta = reference.prepare(q, k, a, b, A_log, dt_bias, scale)
    rep = lambda x: jnp.repeat(x, HV // x.shape[2], axis=2)  # noqa: E731
    xs = jax.tree.map(lambda t: jnp.moveaxis(t, 1, 0), (rep(qn), rep(kn), v.astype(jnp.float32), g, beta))

    def body(S, x):
        S, (o, u) = reference.gdn_step(S, x, mul=jnp.multiply, fma=lambda x, y, z: x * y + z)
        return S, (o, u, S.astype(state0.dtype))

    _, ys = lax.scan(body, state0.astype(jnp.float32), xs)
    o, u, states = (jnp.moveaxis(y, 0, 1) for y in ys)
    return o.astype(q.dtype), u, kn, g, states


def make_inputs(spec: CaseSpec, seed: int, work: Path):
    import jax
    import jax.numpy as jnp

    from gdn_lossless_jax import reference
    from gdn_lossless_jax.testing.cases import Shape, channel_verify_inputs, commit_indices, verify_inputs

    shape = Shape(N=spec.N, D=spec.D, H=spec.H, HV=spec.HV, K=spec.K, V=spec.V)
    dt = jnp.dtype(spec.dtype)
    kda = spec.decay == "channel"
    N, D, L = spec.N, spec.D, spec.L
    S, R = 2 * N + 3, N + 2
    rng = np.random.default_rng(seed)
    normal = lambda *s: rng.standard_normal(s, dtype=np.float32)  # noqa: E731
    pool = jnp.asarray(0.5 * normal(L, S, spec.HV, spec.V, spec.K)).astype(dt)
    idx = commit_indices(seed, N=N, D=D, slots_in_pool=S, rows_in_tape=R, invalid=True, permute_rows=True)
    # one request's track step after its accepted one (the replay goes on past the accepted state)
    live = [n for n in range(N) if 0 <= idx.slots[n] < S and 0 <= idx.rows[n] < R and 0 <= idx.track_slots[n] < S]
    if D >= 2 and live:
        idx.steps[live[0]], idx.track_steps[live[0]] = 0, D - 1
    slot_safe = np.clip(idx.slots, 0, S - 1)
    slot_ok = ((idx.slots >= 0) & (idx.slots < S))[:, None, None, None]
    arrays = dict(
        pool=np.asarray(pool),
        slots=idx.slots, steps=idx.steps, track_slots=idx.track_slots, track_steps=idx.track_steps, rows=idx.rows,
        fill_u=normal(L, R, D, spec.HV, spec.V), fill_k=normal(L, R, D, spec.H, spec.K),
        fill_g=-np.abs(normal(L, R, D, spec.HV, *((spec.K,) if kda else ()))),
        fill_states=np.asarray(jnp.asarray(normal(L, R, D, spec.HV, spec.V, spec.K)).astype(dt)),
    )  # fmt: skip
    for layer in range(L):
        x = (channel_verify_inputs if kda else verify_inputs)(rng, shape, kind="mixed", state_dtype=dt)
        x["state0"] = jnp.where(slot_ok, pool[layer, slot_safe], 0).astype(dt)  # what the kernel reads by slot
        ref = jax.jit(_reference_close, static_argnums=8)(*x.values(), spec.K**-0.5)
        for name, val in x.items():
            arrays[f"L{layer}_{name}"] = np.asarray(val)
        if kda:  # the backend's KDA prologue: XLA's norms and gates, which the chain kernel reads
            prep = jax.jit(reference.prepare, static_argnums=6)(*(x[n] for n in ("q", "k", "a", "b", "A_log", "dt_bias")),
                                                                 spec.K**-0.5)  # fmt: skip
            for name, val in zip(("qn", "kn", "g", "beta"), prep, strict=True):
                arrays[f"L{layer}_prep_{name}"] = np.asarray(val)
        for name, val in zip(("out", "u", "k", "g", "states"), ref, strict=True):
            arrays[f"L{layer}_ref_{name}"] = np.asarray(val)
    _save(work / f"{spec.name}.in.npz", arrays)


# ---------------------------------------------------------------------------------------
# Phase 2 (Triton environment, TRITON_INTERPRET=1): run the kernels.
# ---------------------------------------------------------------------------------------
def _kernel_modules():
    """The kernel modules, loaded from their files without the JAX package around them: the
    package and ``backends`` stand-ins whose ``__init__`` never runs (it imports JAX), so that the
    kernels' relative imports (``..launch``, plain dataclasses) resolve to the real files."""
    for name, path in (("gdn_triton_kernels", KERNELS.parents[1]), ("gdn_triton_kernels.backends", KERNELS.parent),
                       ("gdn_triton_kernels.backends.triton", KERNELS)):  # fmt: skip
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(path)]
        sys.modules[name] = pkg
    return (importlib.import_module("gdn_triton_kernels.backends.triton.verify"),
            importlib.import_module("gdn_triton_kernels.backends.triton.commit"))  # fmt: skip


def run_kernels(spec: CaseSpec, work: Path):
    import torch

    V_, C_ = _kernel_modules()
    bf16 = lambda u16: torch.from_numpy(u16.view(np.int16).copy()).view(torch.bfloat16)  # noqa: E731
    raw = _load_np(work / f"{spec.name}.in.npz", bf16=bf16)
    T = {k: (v if isinstance(v, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(v))) for k, v in raw.items()}
    N, D, H, HV, V, K, L = spec.N, spec.D, spec.H, spec.HV, spec.V, spec.K, spec.L
    R = N + 2
    f32 = torch.float32
    state_dt = T["pool"].dtype
    out = {}

    rows_t = T["rows"].to(torch.int32).contiguous()
    slots_t = T["slots"].to(torch.int32).contiguous()
    kda = spec.decay == "channel"
    rows = T["rows"].numpy()
    ok_rows = (rows >= 0) & (rows < R)

    def verify(layer: int, snapshots: bool, bufs=None, pool=None, pending=None):
        """The kernels read the state from the pool by slot; with ``bufs`` (the tape buffers
        ``[L, R, D, ...]``) the tape goes into them at [layer, rows[n]], in place as under
        jax-triton's aliasing (the same tensor as input and output). ``pool``: another pool than
        the case's; with ``pending`` (the tuple tape buffers and the commit's index arrays) the
        fused kernel commits the tape's row of each request at ``layer`` first, in ``pool``. KDA
        (``spec.decay == "channel"``): the prologue is the backend's XLA one, computed in the JAX
        phase, its k and g written into a tuple tape buffer at [layer, rows[n]] as the wrapper's
        scatter does (valid rows only); the chain kernel reads ``g [N, D, HV, K]``."""
        x = {n: T[f"L{layer}_{n}"].contiguous() for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias")}
        unused = torch.empty(1, dtype=f32)
        cfg = V_.VerifyConfig(block_v=spec.block_v, unroll=spec.unroll, pending_replay=spec.pending_replay)
        lay = torch.tensor([layer], dtype=torch.int32)
        into = bufs is not None
        buf_sizes = dict(INTO=True, R=R, DMAX=D) if into else {}

        def nan(*shape, dtype=f32):  # filled with NaN, so that a missing write shows
            return torch.full(shape, float("nan"), dtype=dtype)

        if kda:
            qn, kt, g, beta = (T[f"L{layer}_prep_{n}"].clone() for n in ("qn", "kn", "g", "beta"))
            if into and not snapshots:
                for i in np.nonzero(ok_rows)[0]:
                    bufs["k"][layer, rows[i]], bufs["g"][layer, rows[i]] = kt[i], g[i]
        else:
            qn, kt, g, beta = nan(N, D, H, K), nan(N, D, H, K), nan(N, D, HV), nan(N, D, HV)
            kbuf, gbuf = (bufs["k"], bufs["g"]) if into and not snapshots else (unused, unused)
            sizes, grid = V_.prep_launch(tuple(x["q"].shape), HV, cfg)
            V_.verify_prep_kernel[grid](x["q"], x["k"], x["a"], x["b"], x["A_log"], x["dt_bias"], lay, rows_t, lay, kbuf,
                                        gbuf, qn, kt, g, beta, kbuf, gbuf, **sizes, **(buf_sizes if not snapshots else {}),
                                        SCALE=float(K**-0.5), INTERPRET=True)  # fmt: skip
        o = nan(N, D, HV, V, dtype=x["q"].dtype)
        if into:
            snap = bufs["states"] if snapshots else unused
            u = unused if snapshots else bufs["u"]
        else:
            snap = nan(N, D, HV, V, K, dtype=state_dt) if snapshots else unused
            u = unused if snapshots else nan(N, D, HV, V)
        buf = (snap if snapshots else u) if into else unused
        record = "snapshots" if snapshots else "tuples"
        state = T["pool"] if pool is None else pool
        sizes, grid = V_.launch_sizes(tuple(state.shape), tuple(x["q"].shape), cfg, record)
        if pending is None:
            pend_in, pend_sizes, pool_out = [*[rows_t] * 4, lay, *[unused] * 4], {}, unused
        else:  # (prows, psteps, ptslots, ptsteps) of the commit, the tape [L, R, D, ...] read at `layer`
            (pu, pk, pg), (p_slots, p_steps, p_tslots, p_tsteps, p_rows) = pending
            assert torch.equal(p_slots, slots_t), "the fused kernel commits at the verify's slots"
            pend_in, pool_out = [p_rows, p_steps, p_tslots, p_tsteps, lay, pu, pk, pg, unused], state
            pend_sizes = dict(PENDING=1, PR=pu.shape[1], PD=pu.shape[2], PREFETCH=False,
                              PDP=V_.next_power_of_2(pu.shape[2]), KL=V_.next_power_of_2(-(-K // 32)),
                              ROWS=cfg.pending_replay == "rows", PCHANNEL=pg.ndim == 5)  # fmt: skip
        V_.verify_kernel[grid](state, slots_t, lay, lay, qn, kt, x["v"], g, beta, rows_t, buf, *pend_in, lay, unused, o,
                               snap, u, pool_out, **sizes, **(buf_sizes or dict(DMAX=D)), **pend_sizes,
                               SNAPSHOTS=snapshots, EVICT=cfg.evict, INTERPRET=True, CHANNEL=g.ndim == 4)  # fmt: skip
        return o, (snap,) if snapshots else (u, kt, g)

    tapes = {
        "u": T["fill_u"].clone(),
        "k": T["fill_k"].clone(),
        "g": T["fill_g"].clone(),
        "states": T["fill_states"].clone(),
    }
    in_place = {name: val.clone() for name, val in tapes.items()}
    for layer in range(L):
        o_t, (u, kt, g) = verify(layer, snapshots=False)
        o_s, (snap,) = verify(layer, snapshots=True)
        out.update({f"L{layer}_out": o_t, f"L{layer}_out_snapshots": o_s, f"L{layer}_u": u, f"L{layer}_k": kt,
                    f"L{layer}_g": g, f"L{layer}_states": snap})  # fmt: skip
        for i in np.nonzero(ok_rows)[0]:
            for name, val in (("u", u), ("k", kt), ("g", g), ("states", snap)):
                tapes[name][layer, rows[i]] = val[i]
        o_ti, _ = verify(layer, snapshots=False, bufs=in_place)
        o_si, _ = verify(layer, snapshots=True, bufs=in_place)
        out.update({f"L{layer}_out_into": o_ti, f"L{layer}_out_snapshots_into": o_si})
    for name, val in tapes.items():
        out[f"tape_{name}"] = val
        out[f"tape_{name}_into"] = in_place[name]

    idx = [T[n].to(torch.int32).contiguous() for n in ("slots", "steps", "track_slots", "track_steps", "rows")]
    ccfg = C_.CommitConfig(block_v=spec.block_v, block=256)

    # In place, as under jax-triton's aliasing: the same tensor is the input and the output.
    pool = T["pool"].clone()
    sizes, grid = C_.tuple_launch(tuple(pool.shape), tuple(tapes["k"].shape), R, D, N, ccfg)
    C_.commit_tuples_kernel[grid](pool, tapes["u"], tapes["k"], tapes["g"], *idx, pool, **sizes, INTERPRET=True,
                                  CHANNEL=kda)  # fmt: skip
    out["commit_tuples"] = pool

    # The commit fused into the next verify (PENDING=1, commit_and_verify): layer by layer in
    # one pool, against the commit kernel's pool and a plain verify on it.
    fused_pool = T["pool"].clone()
    for layer in range(L):
        for snapshots in (False, True):
            o_w, f_w = verify(layer, snapshots=snapshots, pool=out["commit_tuples"].clone())
            work_pool = fused_pool if snapshots else fused_pool.clone()  # tuples in a copy: one commit a layer
            o_f, f_f = verify(layer, snapshots=snapshots, pool=work_pool,
                              pending=((tapes["u"], tapes["k"], tapes["g"]), idx))  # fmt: skip
            mode = "snapshots" if snapshots else "tuples"
            out.update({f"L{layer}_fused_{mode}_out": o_f, f"L{layer}_fused_{mode}_out_want": o_w,
                        f"L{layer}_fused_{mode}_rec": f_f[0], f"L{layer}_fused_{mode}_rec_want": f_w[0]})  # fmt: skip
    out["fused_pool"] = fused_pool

    pool = T["pool"].clone()
    sizes, grid = C_.snapshot_launch(tuple(pool.shape), R, D, N, ccfg)
    C_.commit_snapshots_kernel[grid](pool, tapes["states"], *idx, pool, **sizes)
    out["commit_snapshots"] = pool

    # Replay of every step (-1 .. D-1) of every layer from its state0: the commit kernel on
    # a one-layer pool made of state0, as commit.replay does.
    steps_all = np.arange(-1, D)
    for layer in range(L):
        s0 = T[f"L{layer}_state0"]
        reps = len(steps_all)
        pool = torch.cat([s0] * reps)[None].contiguous()
        ids = torch.arange(N * reps, dtype=torch.int32)
        none = torch.full((N * reps,), -1, dtype=torch.int32)
        steps = torch.from_numpy(np.repeat(steps_all, N).astype(np.int32))
        tape = [torch.cat([out[f"L{layer}_{n}"]] * reps)[None].contiguous() for n in ("u", "k", "g")]
        sizes, grid = C_.tuple_launch(tuple(pool.shape), tuple(tape[1].shape), N * reps, D, N * reps, ccfg)
        C_.commit_tuples_kernel[grid](pool, *tape, ids, steps, none, none, ids, pool, **sizes, INTERPRET=True,
                                      CHANNEL=kda)  # fmt: skip
        out[f"L{layer}_replay"] = pool[0]
        # The control forms of the replay update, to the last step (commit.CONTROL_FORMS).
        for name in ("twice_rounded", "other_product"):
            pool = s0[None].clone()
            last = torch.full((N,), D - 1, dtype=torch.int32)
            ids, none = torch.arange(N, dtype=torch.int32), torch.full((N,), -1, dtype=torch.int32)
            tape = [out[f"L{layer}_{n}"][None].contiguous() for n in ("u", "k", "g")]
            sizes, grid = C_.tuple_launch(tuple(pool.shape), tuple(tape[1].shape), N, D, N, ccfg)
            C_.commit_tuples_kernel[grid](
                pool, *tape, ids, last, none, none, ids, pool, **sizes, INTERPRET=True, FORM=C_._FORM_CODE[name],
                CHANNEL=kda,
            )  # fmt: skip
            out[f"L{layer}_control_{name}"] = pool[0]
        if kda:  # control: the per-channel decay applied as one factor per head (g averaged over K), the rule
            pool = s0[None].clone()
            tape = [out[f"L{layer}_{n}"][None].contiguous() for n in ("u", "k")]
            g_mean = out[f"L{layer}_g"].mean(-1)[None].contiguous()  # [1, N, D, HV]
            C_.commit_tuples_kernel[grid](pool, *tape, g_mean, ids, last, none, none, ids, pool, **sizes,
                                          INTERPRET=True)  # fmt: skip
            out[f"L{layer}_control_scalar_decay"] = pool[0]

    def to_np(t):
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16)
        return t.numpy()

    np.savez(work / f"{spec.name}.out.npz", **{k: to_np(v) for k, v in out.items()})
    dt_names = {k: str(v.dtype).replace("torch.", "") for k, v in out.items()}
    (work / f"{spec.name}.out.json").write_text(json.dumps(dt_names))


# ---------------------------------------------------------------------------------------
# Phase 2b (Triton environment, no interpreter): compile for sm_90 and read the code.
# ---------------------------------------------------------------------------------------
def compile_kernels() -> None:
    """Compile every kernel variant for sm_90 (H200) as jax-triton would, and check the code.

    No GPU is needed: the TTIR -> TTGIR -> LLVM -> PTX stages run as jax-triton 0.3.1 calls
    them (same options and specialisation), for an explicit sm_90 target, and Triton's
    bundled ptxas assembles the result. Checks: both record modes' TTGIR carry the same arithmetic in the same
    layouts (so their outputs are identical by construction); the rule's update is
    ``fma.rn.f32`` and no contractible ``mul.f32``/``add.f32`` is left (fp fusion off);
    the verify kernel has no approximate division or square root; the ``naive`` control
    (fp fusion on) compiles to the contractible forms.
    """
    import collections
    import hashlib
    import re

    import types as _types

    import triton._C.libtriton as _triton
    import triton.backends.nvidia.compiler as cb
    from triton.compiler import code_generator as code_gen
    from triton.compiler import compiler as tc

    V_, C_ = _kernel_modules()
    capability = 90
    backend = cb.CUDABackend(cb.GPUTarget("cuda", capability, 32))

    def build(fn, signature, constexprs, fusion, num_warps, num_stages):
        """The calls jax-triton 0.3.1 makes (triton_lib.get_or_create_triton_kernel and
        compile_ttir_to_ptx_inplace), then ptxas on the PTX."""
        arg_dtypes = list(signature.values())
        sig = {fn.arg_names[i]: v for i, v in enumerate(arg_dtypes)}
        specialization = [
            _triton.native_specialize_impl(
                backend, _types.SimpleNamespace(data_ptr=lambda: 16, dtype=dt.removeprefix("*")), False, True, True
            )
            for dt in arg_dtypes
        ]
        attrs = {(i,): backend.parse_attr(attr) for i, (_, attr) in enumerate(specialization)}
        constants = dict(constexprs)
        sig.update({k: "constexpr" for k in constants})
        opts = {"num_warps": num_warps, "num_stages": num_stages, "num_ctas": 1, "optimize_epilogue": False}
        options = backend.parse_options({**opts, "debug": False, "enable_fp_fusion": fusion})
        context = _triton.ir.context()
        _triton.ir.load_dialects(context)
        backend.load_dialects(context)
        module = code_gen.ast_to_ttir(
            fn, tc.ASTSource(fn, constexprs=constants, signature=sig, attrs=attrs), options=options,
            codegen_fns=backend.get_codegen_implementation(options), context=context,
            module_map=backend.get_module_map(),
        )  # fmt: skip
        metadata = {}
        ttir = backend.make_ttir(module, metadata, options, capability)
        ttgir = backend.make_ttgir(ttir, metadata, options, capability)
        ttgir_text = str(ttgir)
        llir = backend.make_llir(ttgir, metadata, options, capability)
        ptx = backend.make_ptx(llir, metadata, options, capability)
        backend.make_cubin(ptx, metadata, options, capability)  # ptxas accepts it
        return _types.SimpleNamespace(asm={"ttgir": ttgir_text, "ptx": ptx}, shared=metadata.get("shared"))

    def ops(ptx):
        pat = r"\b((?:fma|mul|add|sub|div|sqrt|ex2|lg2|rcp)\.[a-z0-9.]*f32)\b"
        return collections.Counter(re.findall(pat, ptx))

    def arithmetic(ttgir):
        keep = ("arith.mulf", "arith.addf", "arith.subf", "arith.divf", "math.fma", "math.sqrt", "tt.reduce",
                "tt.extern_elementwise", "arith.negf", "arith.select")  # fmt: skip
        lines = [ln for ln in ttgir.splitlines() if any(k in ln for k in keep) and not ln.startswith("#")]
        lines = [re.sub(r"%[\w#]+|loc\([^)]*\)", "", ln) for ln in lines]
        return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:12]

    vcfg, ccfg = V_.VerifyConfig(), C_.CommitConfig()
    N, D, H, HV, K, Vd = 5, 4, 16, 32, 128, 128
    for state in ("fp32", "bf16"):
        for decay in ("scalar", "channel"):  # KDA: g per key channel (CHANNEL, PCHANNEL)
            kda = dict(CHANNEL=True) if decay == "channel" else {}
            tag = "" if decay == "scalar" else ", KDA"
            digests = {}
            for snapshots in (False, True):
                sig = {"state_ptr": f"*{state}", "slots_ptr": "*i32", "layer_ptr": "*i32", "tape_layer_ptr": "*i32", "qn_ptr": "*fp32",
                       "kn_ptr": "*fp32", "v_ptr": "*bf16", "g_ptr": "*fp32", "beta_ptr": "*fp32", "rows_ptr": "*i32",
                       "buf_in_ptr": "*fp32", "prows_ptr": "*i32", "psteps_ptr": "*i32", "ptslots_ptr": "*i32",
                       "ptsteps_ptr": "*i32", "player_ptr": "*i32", "pu_ptr": "*fp32", "pk_ptr": "*fp32", "pg_ptr": "*fp32",
                       "pstates_ptr": f"*{state}", "out_layer_ptr": "*i32", "out_in_ptr": "*bf16", "out_ptr": "*bf16", "snap_ptr": f"*{state}" if snapshots else "*fp32",
                       "u_ptr": "*fp32", "pool_out_ptr": f"*{state}"}  # fmt: skip
                mode = "snapshots" if snapshots else "tuples"
                sizes, _ = V_.launch_sizes((1, N, HV, Vd, K), (N, D, H, K), vcfg, mode)
                ck = build(V_.verify_kernel, sig, dict(**sizes, SNAPSHOTS=snapshots, EVICT=vcfg.evict, INTERPRET=False,
                                                       DMAX=D, **kda), False, vcfg.num_warps, vcfg.num_stages)  # fmt: skip
                c = ops(ck.asm["ptx"])
                # the steps as a loop (unroll=False): unrolled, the snapshot mode may compute a step's
                # update a second time in the store's layout, the same operation on the same values;
                # KDA also on the chunk chain (the one above 8 drafts)
                for chain in ("rows", "chunks") if kda else ("rows",):
                    lcfg = dataclasses.replace(vcfg, unroll=False, chain=chain)
                    lsizes, _ = V_.launch_sizes((1, N, HV, Vd, K), (N, D, H, K), lcfg, mode)
                    loop = build(V_.verify_kernel, sig, dict(**lsizes, SNAPSHOTS=snapshots, EVICT=vcfg.evict,
                                                             INTERPRET=False, DMAX=D, **kda), False, vcfg.num_warps,
                                 vcfg.num_stages)  # fmt: skip
                    digests.setdefault(chain, {})[snapshots] = arithmetic(loop.asm["ttgir"])
                    cl = ops(loop.asm["ptx"])
                    bad = [o for o in cl if o.startswith(("div.full", "div.approx", "sqrt.approx", "mul.f32", "add.f32"))]
                    assert not bad, f"verify ({mode}{tag}, {chain} chain): approximate or contractible operations {bad}"
                print(f"  compiled verify ({mode}, {state} state{tag}) for sm_90: {dict(sorted(c.items()))}")
                bad = [o for o in c if o.startswith(("div.full", "div.approx", "sqrt.approx", "mul.f32", "add.f32"))]
                assert not bad, f"verify ({mode}{tag}): approximate or contractible operations {bad}"
                assert c["fma.rn.f32"] > 0, "verify: no fma.rn.f32 for the update"
                into = build(V_.verify_kernel, sig, dict(**sizes, SNAPSHOTS=snapshots, EVICT=vcfg.evict, INTERPRET=False,
                                                         INTO=True, R=7, DMAX=D + 2, **kda), False, vcfg.num_warps,
                             vcfg.num_stages)  # fmt: skip
                assert ops(into.asm["ptx"]) == c, f"verify ({mode}{tag}): the tape in place changes the float operations"
                # the previous step's commit first (commit_and_verify): it compiles, rule pinned; a KDA tape
                # pending (PCHANNEL) also with the L2 prefetch of its rows (the default launch's
                # prefetch_pending) and replayed in the chunk chain's layout (pending_replay="split")
                prefetch = dict(PREFETCH=True, PDP=V_.next_power_of_2(D), KL=V_.next_power_of_2(-(-K // 32)))
                variants = [(1, {}), (2, {})] if not kda else [(1, dict(PCHANNEL=True, **prefetch)), (2, {}),
                                                                (1, dict(PCHANNEL=True, ROWS=False, chain="chunks"))]
                for pending, extra in variants:
                    fsizes = sizes
                    if extra.pop("chain", None):
                        fsizes, _ = V_.launch_sizes((1, N, HV, Vd, K), (N, D, H, K), dataclasses.replace(vcfg, chain="chunks"),
                                                    mode)  # fmt: skip
                    fused = build(V_.verify_kernel, sig, dict(**fsizes, SNAPSHOTS=snapshots, EVICT=vcfg.evict, INTERPRET=False,
                                                              INTO=True, R=7, DMAX=D + 2, PENDING=pending, PR=7, PD=D, **kda,
                                                              **extra),
                                  False, vcfg.num_warps, vcfg.num_stages)  # fmt: skip
                    cf = ops(fused.asm["ptx"])
                    assert not [o for o in cf if o.startswith(("mul.f32", "add.f32", "div.full", "div.approx"))], cf
                    how = " (split replay, chunk chain)" if "ROWS" in extra else " (L2 prefetch)" if "PREFETCH" in extra else ""
                    print(f"  compiled fused verify ({mode}, pending {('tuples', 'snapshots')[pending - 1]}{how}, {state}"
                          f"{tag}): fma.rn {cf['fma.rn.f32']} (plain {c['fma.rn.f32']})")
            for chain, d in digests.items():
                assert d[False] == d[True], f"verify ({state}{tag}, {chain} chain): the record modes' TTGIR arithmetic differs"
                print(f"  verify ({state}{tag}): tuples and snapshots TTGIR arithmetic identical ({d[False]}, {chain} chain, "
                      "steps as a loop)")
        sig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16", "A_log_ptr": "*fp32",
               "dt_bias_ptr": "*fp32", "layer_ptr": "*i32", "rows_ptr": "*i32", "tape_layer_ptr": "*i32", "kbuf_in_ptr": "*fp32",
               "gbuf_in_ptr": "*fp32", "qn_ptr": "*fp32", "kn_ptr": "*fp32", "g_ptr": "*fp32", "beta_ptr": "*fp32",
               "kbuf_ptr": "*fp32", "gbuf_ptr": "*fp32"}  # fmt: skip
        sizes, _ = V_.prep_launch((N, D, H, K), HV, vcfg)
        c = ops(build(V_.verify_prep_kernel, sig, dict(**sizes, SCALE=K**-0.5, INTERPRET=False), False, 2, 1).asm["ptx"])
        build(V_.verify_prep_kernel, sig, dict(**sizes, SCALE=K**-0.5, INTERPRET=False, INTO=True, R=7, DMAX=D + 2), False, 2, 1)
        bad = [o for o in c if o.startswith(("div.full", "div.approx", "sqrt.approx", "mul.f32", "add.f32"))]
        assert not bad, f"verify prologue: approximate or contractible operations {bad}"

        sig = {"pool_ptr": f"*{state}", "u_ptr": "*fp32", "k_ptr": "*fp32", "g_ptr": "*fp32", "slots_ptr": "*i32",
               "steps_ptr": "*i32", "track_slots_ptr": "*i32", "track_steps_ptr": "*i32", "rows_ptr": "*i32",
               "out_ptr": f"*{state}"}  # fmt: skip
        sizes, _ = C_.tuple_launch((2, 13, HV, Vd, K), (2, 7, D, H, K), 7, D, N, ccfg)
        for form, channel in itertools.product(C_.FORMS + C_.CONTROL_FORMS + C_.COMPILER_FORMS, (False, True)):
            fusion = form == "naive"
            ck = build(C_.commit_tuples_kernel, sig, dict(**sizes, INTERPRET=False, FORM=C_._FORM_CODE[form],
                                                          CHANNEL=channel), fusion, ccfg.num_warps,
                       ccfg.num_stages)  # fmt: skip
            c = ops(ck.asm["ptx"])
            tag = ", KDA tape" if channel else ""
            print(f"  compiled commit ({form}, {state} pool{tag}) for sm_90: {dict(sorted(c.items()))}")
            if form == "pinned":
                assert c["fma.rn.f32"] > 0 and c["mul.rn.f32"] > 0, "commit: the rule's mul.rn + fma.rn are missing"
                assert not (c["mul.f32"] or c["add.f32"]), "commit: contractible operations with fp fusion off"
            if form == "naive":
                assert c["mul.f32"] > 0, "commit naive: expected contractible operations with fp fusion on"
                print(f"    naive{tag}: Triton fused {_fused_product(ck.asm['ptx'])}")

    sig = {"pool_ptr": "*fp32", "states_ptr": "*fp32", "slots_ptr": "*i32", "steps_ptr": "*i32",
           "track_slots_ptr": "*i32", "track_steps_ptr": "*i32", "rows_ptr": "*i32", "out_ptr": "*fp32"}  # fmt: skip
    sizes, _ = C_.snapshot_launch((2, 13, HV, Vd, K), 7, D, N, ccfg)
    build(C_.commit_snapshots_kernel, sig, sizes, False, ccfg.copy_warps, 3)
    print("  compiled commit (snapshots) for sm_90")


def _fused_product(ptx: str) -> str:
    """Which product of ``S * alpha + k * u`` the compiler fused (the commit kernel's PTX).

    alpha is libdevice's result: ``ex2.approx`` then a multiply by the scale; if the state
    is still multiplied by it separately, ``k * u`` went into the fma (the rule).
    """
    import re

    ex2 = re.search(r"ex2\.approx[.\w]*\s+(%r\d+),", ptx)
    alpha = re.search(r"mul(?:\.rn)?\.f32\s+(%r\d+),\s*" + re.escape(ex2.group(1)) + r",", ptx) if ex2 else None
    if not alpha:
        return "(could not find exp's result)"
    reg = re.escape(alpha.group(1))
    decays = len(re.findall(r"\bmul(?:\.rn)?\.f32\s+%r\d+,\s*%r\d+,\s*" + reg + r";", ptx))
    decays += len(re.findall(r"\bmul(?:\.rn)?\.f32\s+%r\d+,\s*" + reg + r",\s*%r\d+;", ptx))
    fused = len(re.findall(r"\bfma\.rn\.f32\s+%r\d+,\s*(?:%r\d+,\s*" + reg + r"|" + reg + r",\s*%r\d+),", ptx))
    if decays and not fused:
        return f"k * u ({decays} separate multiplies by alpha): the rule, by luck"
    if fused and not decays:
        return f"S * alpha ({fused} fmas with alpha): the other product"
    return f"both ({decays} separate decays, {fused} fused)"


# ---------------------------------------------------------------------------------------
# Phase 3 (JAX environment): compare.
# ---------------------------------------------------------------------------------------
def compare(spec: CaseSpec, work: Path) -> dict:
    import jax.numpy as jnp
    import ml_dtypes

    import gdn_lossless_jax as gl
    from gdn_lossless_jax import reference
    from gdn_lossless_jax.testing import assert_bitwise_equal, replay_oracle, ulp_stats

    inp = _load_np(work / f"{spec.name}.in.npz", bf16=lambda u: u.view(ml_dtypes.bfloat16))
    dtypes = json.loads((work / f"{spec.name}.out.json").read_text())
    got = {}
    with np.load(work / f"{spec.name}.out.npz") as f:
        for k in f.files:
            got[k] = f[k].view(ml_dtypes.bfloat16) if dtypes[k] == "bfloat16" else f[k]
    N, D, L = spec.N, spec.D, spec.L
    S, R = 2 * N + 3, N + 2
    report = {"case": spec.name, "bitwise": [], "close": {}, "controls": {}}

    def bitwise(name, want, have):
        assert_bitwise_equal(np.asarray(want), np.asarray(have), f"{spec.name}: {name}")
        report["bitwise"].append(name)

    for layer in range(L):
        p = f"L{layer}_"
        bitwise(p + "outputs tuples == snapshots", got[p + "out_snapshots"], got[p + "out"])
        for mode in ("", "_snapshots"):
            bitwise(p + f"outputs{mode} with the tape in place == fresh tape", got[p + f"out{mode}"], got[p + f"out{mode}_into"])
        # Replay of every step == the snapshot of that step (state0 for step -1).
        rep = got[p + "replay"].reshape(D + 1, N, *got[p + "replay"].shape[1:])
        bitwise(p + "replay step -1 == state0", inp[p + "state0"], rep[0])
        for t in range(D):
            bitwise(p + f"replay step {t} == snapshot", got[p + "states"][:, t], rep[t + 1])
        # The rule in an independent NumPy oracle, with the kernel's own exp(g).
        alpha = np.exp(got[p + "g"].astype(np.float32))
        steps = np.full(N, D - 1)
        oracle = replay_oracle(inp[p + "state0"], got[p + "u"], got[p + "k"], alpha, steps)
        bitwise(p + "replay of the last step == NumPy oracle", oracle, rep[D])
        # The controls must drift (an fp32 pool; bf16 rounds a 1-ULP drift away almost always).
        for name in ("twice_rounded", "other_product"):
            drift = ulp_stats(rep[D], got[p + f"control_{name}"])
            report["controls"].setdefault(name, []).append(drift["max_ulp"])
            if spec.dtype == "float32" and D >= 2 and drift["max_ulp"] < 1:
                raise AssertionError(f"{spec.name}: layer {layer}: the control {name} replays bit-identically")
        if spec.decay == "channel":  # KDA's decay applied as one factor per head must drift (any pool dtype)
            drift = ulp_stats(rep[D], got[p + "control_scalar_decay"])
            report["controls"].setdefault("scalar_decay", []).append(drift["max_ulp"])
            if drift["max_ulp"] < 1:
                raise AssertionError(f"{spec.name}: layer {layer}: the scalar-decay control replays bit-identically")
        # Against the JAX reference: close, not bitwise (exp, log and reduction order differ).
        for field, ref_name in (
            ("out", "ref_out"),
            ("u", "ref_u"),
            ("k", "ref_k"),
            ("g", "ref_g"),
            ("states", "ref_states"),
        ):
            want, have = inp[p + ref_name], got[p + field]
            stats = ulp_stats(want, have)
            scale = np.max(np.abs(want.astype(np.float32))) + 1e-30
            rel = float(np.max(np.abs(want.astype(np.float32) - have.astype(np.float32))) / scale)
            report["close"].setdefault(field, []).append(
                {"max_ulp": stats["max_ulp"], "fraction": round(stats["fraction"], 4), "max_rel": rel}
            )
            # bf16 values (outputs always, states of a bf16 pool): one ULP is 2**-8 relative.
            bf16 = field == "out" or (field == "states" and spec.dtype == "bfloat16")
            tol = 1e-2 if bf16 else 1e-3
            if not rel <= tol:
                raise AssertionError(
                    f"{spec.name}: layer {layer} {field} differs from the reference by {rel:.3g} (relative) > {tol}"
                )

    # The tape written into the buffers by the kernels (rows, layers; every other element kept).
    for name in ("u", "k", "g", "states"):
        bitwise(f"tape {name} in place == fresh tapes placed by hand", got[f"tape_{name}"], got[f"tape_{name}_into"])
    # Commit: tuples == snapshots == expectation from the kernel's own snapshots.
    bitwise("commit tuples == commit snapshots", got["commit_snapshots"], got["commit_tuples"])
    expected = inp["pool"].copy()
    snaps = got["tape_states"]
    written = set()
    for n in range(N):
        slot, step, ts, tstep, row = (int(inp[k][n]) for k in ("slots", "steps", "track_slots", "track_steps", "rows"))
        if not (0 <= slot < S and 0 <= row < R):
            continue
        if 0 <= tstep < D and 0 <= ts < S:
            expected[:, ts] = snaps[:, row, tstep]
            written.add(ts)
        if 0 <= step < D:
            expected[:, slot] = snaps[:, row, step]
            written.add(slot)
    bitwise("commit == expectation from snapshots", expected, got["commit_tuples"])
    # The commit fused into the next verify: the commit kernel's pool, and a plain verify's bits on it.
    bitwise("fused kernel's pool == commit kernel's pool", got["commit_tuples"], got["fused_pool"])
    for layer in range(L):
        for mode in ("tuples", "snapshots"):
            p = f"L{layer}_fused_{mode}_"
            bitwise(p + "outputs == verify after the commit", got[p + "out_want"], got[p + "out"])
            bitwise(p + "tape == verify after the commit", got[p + "rec_want"], got[p + "rec"])
    untouched = [s for s in range(S) if s not in written]
    assert untouched, "the case must leave slots untouched"
    bitwise("untouched slots keep their bits", inp["pool"][:, untouched], got["commit_tuples"][:, untouched])
    # The reference's commit (JAX) of the kernel's snapshot tape: the masks agree.
    args = tuple(jnp.asarray(inp[k], jnp.int32) for k in ("slots", "steps", "track_slots", "track_steps", "rows"))
    ref_pool = reference.commit(jnp.asarray(inp["pool"]), gl.Snapshots(jnp.asarray(snaps)), *args)
    bitwise(
        "reference commit of the kernel's snapshot tape == kernel commit", np.asarray(ref_pool), got["commit_tuples"]
    )
    return report


# ---------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--triton-python", default="/tmp/tvenv/bin/python", help="a Python with triton and torch (CPU)")
    ap.add_argument("--work", default=None, help="folder for the exchanged .npz files (default: a temporary one)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--phase", choices=("all", "kernels", "compile"), default="all", help=argparse.SUPPRESS)
    ap.add_argument("--no-compile", action="store_true", help="skip compiling the kernels for sm_90")
    ap.add_argument("--cases", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a.phase == "compile":  # inside the Triton environment, without the interpreter
        compile_kernels()
        return
    if a.phase == "kernels":  # inside the Triton environment
        work = Path(a.work)
        for spec in (CaseSpec(**d) for d in json.loads(a.cases)):
            t0 = time.time()
            run_kernels(spec, work)
            print(f"  kernels {spec.name}: {time.time() - t0:.1f}s", flush=True)
        return

    work = Path(a.work or tempfile.mkdtemp(prefix="triton-interpret-"))
    work.mkdir(parents=True, exist_ok=True)
    specs = case_specs(a.quick)
    print(f"{len(specs)} cases, work folder {work}, seed {a.seed}", flush=True)
    for i, spec in enumerate(specs):
        stamp = work / f"{spec.name}.seed"
        seed = a.seed * 1000 + i
        if not (stamp.exists() and stamp.read_text() == str(seed) and (work / f"{spec.name}.in.npz").exists()):
            make_inputs(spec, seed, work)
            stamp.write_text(str(seed))
    env = dict(os.environ, TRITON_INTERPRET="1")
    cases = json.dumps([dataclasses.asdict(s) for s in specs])
    subprocess.run(
        [a.triton_python, __file__, "--phase", "kernels", "--work", str(work), "--cases", cases], env=env, check=True
    )
    if not a.no_compile:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        print("compiling the kernels for sm_90 (no GPU needed):", flush=True)
        subprocess.run([a.triton_python, __file__, "--phase", "compile"], env=env, check=True)
    failures = 0
    summary = {}
    for spec in specs:
        try:
            r = compare(spec, work)
        except AssertionError as e:
            failures += 1
            print(f"FAIL {spec.name}: {e}", flush=True)
            continue
        worst = {f: max(x["max_ulp"] for x in v) for f, v in r["close"].items()}
        rel = {f: max(x["max_rel"] for x in v) for f, v in r["close"].items()}
        for f in worst:
            summary.setdefault(f, []).append((worst[f], rel[f]))
        drift = {f: max(v) for f, v in r["controls"].items()}
        n = len(r["bitwise"])
        print(f"ok   {spec.name}: {n} bitwise checks; vs reference max ULP {worst}; controls drift max ULP {drift}")
    print("vs the JAX reference over all cases (max ULP, max relative):")
    for f, v in summary.items():
        print(f"  {f:7s} max ULP {max(x[0] for x in v):>8d}   max rel {max(x[1] for x in v):.3g}")
    print(f"{len(specs) - failures} passed, {failures} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
