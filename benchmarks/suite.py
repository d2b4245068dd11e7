"""Rows of one configuration: inputs on the device, jitted timed functions, compile times, checks.

Timing small kernels through JAX: one jitted function makes ``reps`` verify calls over
``reps`` different small-input sets (q, k, v, a, b: distinct arrays, so XLA cannot merge
identical calls) and rotates among copies of the state (enough copies that the 50 MB L2
cannot keep a state between its uses); all outputs are returned, so nothing is dead code.
Commit: one jitted function makes ``commit_reps`` commits, chained on the pool, which is
donated (``donate_argnums=0``) so every commit updates it in place; the index sets differ
per call. The compiled commit is checked for the alias and for copies of the pool.

Inputs are random, never zeros. Per-layer verify inputs are NumPy normals with the scales of
:func:`gdn_lossless_jax.testing.cases.verify_inputs` (``kind="normal"``); the large commit arrays
(pool, tapes) are drawn on the device by one compiled function (a counter-based hash:
uniform values of unit variance; the tape's k l2-normalised, g in [-2, -0.01)). Timing does not
need a tape that verify produced; the tests check the semantics.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import gdn_lossless_jax as gdn
from gdn_lossless_jax.testing.cases import CommitIndices, Shape

from . import cases as bc
from . import traffic as tr
from .timing import Clock, Row

__all__ = ["ConfigInputs", "make_inputs", "backend_rows", "copy_row", "available_backends"]

RECORDS = ("tuples", "snapshots")


# ---------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------
def _mix(x):
    # A 32-bit integer hash (lowbias32): counter-based random bits from plain integer ops,
    # which compile in a fraction of the time of jax.random's generators on XLA:CPU.
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


@functools.partial(jax.jit, static_argnames=("specs",))
def _draw(seed, specs):
    """All random arrays of a configuration in one compiled function.

    ``specs``: ``(shape, dtype name, kind, scale)`` per array. Values: uniform with unit
    variance (``[-sqrt(3), sqrt(3))``, 2**-23 granularity: no subnormals) times ``scale``;
    kind ``unit`` normalises the last axis (the tape's k), ``uniform`` is U[-1, 1) (A_log),
    ``log_decay`` is U[-2, -0.01) (the tape's g)."""
    out = []
    for i, (shape, dtype, kind, scale) in enumerate(specs):
        # The flat element index (mod 2**32) from per-axis iotas: no axis of 2**31 or more.
        index, stride = jnp.zeros((), jnp.uint32), 1
        for d in reversed(range(len(shape))):
            index = index + lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(stride % 2**32)
            stride *= shape[d]
        stream = _mix(seed * jnp.uint32(0x632BE5AB) + jnp.uint32((i * 0x9E3779B9 + 1) % 2**32))
        bits = _mix(index * jnp.uint32(0x9E3779B9) + stream)
        u = lax.bitcast_convert_type((bits >> 9) | jnp.uint32(0x3F800000), jnp.float32) - 1.5  # U[-0.5, 0.5)
        if kind == "normal":
            x = u * (2 * math.sqrt(3.0) * scale)
        elif kind == "uniform":
            x = 2 * u
        elif kind == "unit":
            x = u / jnp.sqrt(jnp.sum(u * u, -1, keepdims=True) + 1e-6)
        elif kind == "log_decay":
            x = -(0.01 + 1.99 * (u + 0.5))
        else:
            raise ValueError(kind)
        out.append(x.astype(dtype))
    return out


@dataclasses.dataclass
class ConfigInputs:
    """Everything one configuration's rows read (shared by all backends)."""

    config: bc.Config
    shape: Shape
    layers: int
    slots: int
    states: tuple  # C x [N, HV, V, K] f32
    smalls: tuple  # R x (q, k, v, a, b)
    A_log: jax.Array
    dt_bias: jax.Array
    pool_box: list  # [pool]: the donated pool, replaced after every commit
    tuples: gdn.Tuples  # [L, N, D, ...]
    snapshots: gdn.Snapshots  # [L, N, D, HV, V, K]
    index_sets: list[CommitIndices]
    index_args: tuple  # commit_reps x (5 x [N] int32 on the device)
    copy_src: jax.Array | None
    pool_spec: tuple = ()
    seed: int = 0

    def fresh_pool(self) -> jax.Array:
        """A new pool like the first (after a failed call consumed the donated one)."""
        return _draw(jnp.uint32((self.seed + 1) % 2**32), (self.pool_spec,))[0]

    def nbytes(self) -> int:
        leaves = jax.tree.leaves((self.states, self.smalls, self.pool_box, self.tuples, self.snapshots, self.copy_src))
        return sum(x.nbytes for x in leaves)


def make_inputs(config: bc.Config, mode: bc.Mode, *, seed: int, with_copy: bool = True) -> ConfigInputs:
    g = mode.geometry
    s = Shape.of(g, config.requests, config.drafts)
    L, S = g.gdn_layers, bc.pool_slots(config.requests)
    state_bytes = s.N * s.HV * s.V * s.K * jnp.dtype(bc.STATE_DTYPE).itemsize
    C = bc.state_copies(state_bytes, mode)
    R = mode.reps
    sd, idt, f32 = jnp.dtype(bc.STATE_DTYPE), jnp.dtype(bc.INPUT_DTYPE), "float32"
    # Per-layer inputs on the host (NumPy normals as in cases.verify_inputs; copying them in
    # needs no compile); the large commit arrays on the device (one compiled function).
    rng = np.random.default_rng(seed)
    host = lambda shape, dtype, scale=1.0: jnp.asarray((rng.standard_normal(shape, np.float32) * np.float32(scale)).astype(dtype))  # noqa: E731
    states = tuple(host((s.N, s.HV, s.V, s.K), sd, 0.5) for _ in range(C))
    smalls = tuple(
        (host((s.N, s.D, s.H, s.K), idt), host((s.N, s.D, s.H, s.K), idt), host((s.N, s.D, s.HV, s.V), idt),
         host((s.N, s.D, s.HV), idt), host((s.N, s.D, s.HV), idt))
        for _ in range(R)
    )  # fmt: skip
    A_log = jnp.asarray(rng.uniform(-1.0, 1.0, s.HV).astype(np.float32))
    dt_bias = host((s.HV,), np.float32, 0.5)
    specs = [
        ((L, S, s.HV, s.V, s.K), sd.name, "normal", 0.5),  # pool
        ((L, s.N, s.D, s.HV, s.V), f32, "normal", 1.0),  # tape u
        ((L, s.N, s.D, s.H, s.K), f32, "unit", 1.0),  # tape k
        ((L, s.N, s.D, s.HV), f32, "log_decay", 1.0),  # tape g
        ((L, s.N, s.D, s.HV, s.V, s.K), sd.name, "normal", 0.5),  # snapshots
    ]
    if with_copy:
        specs += [((mode.copy_bytes // 4,), f32, "normal", 1.0)]
    arrays = iter(_draw(jnp.uint32(seed % 2**32), tuple(specs)))
    nxt = lambda: next(arrays)  # noqa: E731
    pool = nxt()
    tuples = gdn.Tuples(u=nxt(), k=nxt(), g=nxt())
    snapshots = gdn.Snapshots(nxt())
    copy_src = nxt() if with_copy else None
    index_sets = bc.commit_index_sets(config, mode.commit_reps, seed=seed)
    index_args = tuple(ix.as_args() for ix in index_sets)
    out = ConfigInputs(config, s, L, S, states, smalls, A_log, dt_bias, [pool], tuples, snapshots, index_sets, index_args,
                       copy_src, pool_spec=specs[0], seed=seed)  # fmt: skip
    jax.block_until_ready(jax.tree.leaves((out.states, out.smalls, out.pool_box, out.tuples, out.snapshots, out.index_args, copy_src)))
    return out


# ---------------------------------------------------------------------------------
# Jitted functions
# ---------------------------------------------------------------------------------
def _verify_fn(backend: str, record: str, copies: int):
    """``len(smalls)`` verify calls in one function: call r reads state copy ``r % copies``
    and input set r. With one state and one input set it is the single call whose compile
    time is reported."""

    def f(states, smalls, A_log, dt_bias):
        outs = []
        for r, (q, k, v, a, b) in enumerate(smalls):
            outs.append(gdn.verify(states[r % copies], q, k, v, a, b, A_log, dt_bias, record=record, backend=backend))
        return outs

    return jax.jit(f)


def _commit_fn(backend: str):
    """``len(index_args)`` commits chained on the donated pool (one: the single call)."""

    def f(pool, tape, index_args):
        for idx in index_args:
            pool = gdn.commit(pool, tape, *idx, backend=backend)
        return pool

    return jax.jit(f, donate_argnums=0)


def _noop():
    # Same arguments, same dispatch path; the device work is one tiny kernel on the last leaf.
    def f(*args):
        leaf = jax.tree.leaves(args)[-1]
        return leaf.reshape(-1)[:1] + 1

    return jax.jit(f, keep_unused=True)


def _compile(fn, *args):
    t = time.perf_counter()
    compiled = fn.lower(*args).compile()
    return compiled, time.perf_counter() - t


_DTYPE_HLO = {"float32": "f32", "bfloat16": "bf16"}


def in_place_report(compiled, pool: jax.Array) -> dict:
    """Whether the compiled commit aliases the donated pool to its output, and how many
    copies of a pool-shaped array its HLO makes (0 when the update is in place)."""
    try:
        text = compiled.as_text()
    except Exception as e:  # noqa: BLE001
        return {"aliased": None, "pool_copies": None, "note": f"no HLO text: {e}"}
    head = text.split("\n", 1)[0]
    aliased = "input_output_alias={ {}: (0, {}" in head
    shape = f"{_DTYPE_HLO.get(pool.dtype.name, pool.dtype.name)}[{','.join(map(str, pool.shape))}]"
    # A pool-shaped result of a copy, or of a fusion whose computation is a copy (XLA:GPU
    # wraps copies as "fused_copy" / "wrapped_copy"). A heuristic: in-place scatters and
    # custom calls aliased to the pool do not match.
    pat = re.compile(r"=\s*" + re.escape(shape) + r"\{[^}]*\}\s+(copy(-start)?\(|fusion\(.*calls=%\S*copy)")
    copies = sum(1 for line in text.splitlines() if pat.search(line))
    return {"aliased": aliased, "pool_copies": copies}


def _block(x):
    jax.block_until_ready(x)


def available_backends(names) -> tuple[list[str], dict[str, str]]:
    """Split backend names into those that can run here and the others, with the reason."""
    from gdn_lossless_jax import backends

    ok, skipped = [], {}
    for name in names:
        try:
            for op in ("verify", "commit"):
                backends.resolve(name, op)
            ok.append(name)
        except Exception as e:  # noqa: BLE001 - BackendUnavailable, ImportError, ValueError
            skipped[name] = f"{type(e).__name__}: {e}"
    return ok, skipped


def _f32(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32))


def _rel_err(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-300))


def _bits_equal(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def reference_outputs(inp: ConfigInputs):
    """The reference backend's outputs on input set 0 (for the checks), or None on failure."""
    try:
        [(out, _)] = _verify_fn("reference", "tuples", 1)(inp.states[:1], inp.smalls[:1], inp.A_log, inp.dt_bias)
        return _f32(out)
    except Exception:  # noqa: BLE001
        return None


def backend_rows(backend: str, inp: ConfigInputs, mode: bc.Mode, clock: Clock, ref_out=None, *, single: bool = True):
    """The four timed rows of one backend (verify and commit, both record modes), its
    compile times, its checks and its verify outputs on input set 0 (fp32 NumPy, or None).

    ``single``: also compile the single call (one layer's verify; one commit of all
    layers) to report its compile time, measured cold (a fresh function object each time,
    so JAX's caches cannot answer). When a timed invocation is one call (``reps`` and
    ``commit_reps`` 1, one state copy) the timed function is that single call.
    A row that fails to compile or run is left out and its error is kept in
    ``checks["errors"]``; if all four fail, the first error is raised."""
    cfg = inp.config.label
    label = f"{cfg} {backend}"
    rows: list[Row] = []
    compile_s: dict[str, float] = {}
    checks: dict = {"errors": {}}
    outs: dict = {}
    in_place: dict = {}
    first_error = None
    for op in ("verify", "commit"):
        for record in RECORDS:
            try:
                if op == "verify":
                    row, outs[record] = _verify_row(backend, record, inp, clock, label, single, compile_s)
                else:
                    row, in_place[record] = _commit_row(backend, record, inp, clock, label, single, compile_s)
                rows.append(row)
            except Exception as e:  # noqa: BLE001 - report, go on with the other rows
                msg = f"{type(e).__name__}: {str(e)[:400]}"
                checks["errors"][f"{op}_{record}"] = msg
                clock.log(f"{label}: {op} {record}: FAILED: {msg}")
                first_error = first_error or e
    if not rows:
        raise first_error
    if len(outs) == 2:
        checks["outputs_equal_across_modes"] = _bits_equal(outs["tuples"], outs["snapshots"])
    out0 = outs.get("tuples", outs.get("snapshots"))
    if ref_out is not None and out0 is not None:
        checks["outputs_rel_err_vs_reference"] = _rel_err(out0, ref_out)
    checks["commit_in_place"] = in_place
    if not checks["errors"]:
        del checks["errors"]
    return rows, compile_s, checks, out0


def _verify_row(backend, record, inp: ConfigInputs, clock: Clock, label: str, single: bool, compile_s: dict):
    C, R = len(inp.states), len(inp.smalls)
    one_args = (inp.states[:1], inp.smalls[:1], inp.A_log, inp.dt_bias)
    timed_args = (inp.states, inp.smalls, inp.A_log, inp.dt_bias)
    f1 = None
    if single or (R == 1 and C == 1):
        f1, t1 = _compile(_verify_fn(backend, record, 1), *one_args)
        compile_s[f"verify_{record}"] = t1
    if R == 1 and C == 1:
        ft, tt = f1, None  # the timed function is the single call
    else:
        ft, tt = _compile(_verify_fn(backend, record, C), *timed_args)
    first = (f1(*one_args) if f1 is not None else ft(*timed_args))[0][0]  # outputs of input set 0
    out = _f32(first)
    del first
    noop, _ = _compile(_noop(), *timed_args)
    parts = ([f"one call in {compile_s[f'verify_{record}']:.2f} s"] if f1 is not None else []) + (
        [f"the timed function ({R} calls, {C} state copies) in {tt:.2f} s"] if tt is not None else [])
    clock.log(f"{label}: verify {record}: compiled " + ", ".join(parts))
    row = Row(
        config=inp.config.label, backend=backend, op="verify", record=record, calls=R,
        traffic=tr.verify_traffic(inp.shape, record), compile_s=compile_s.get(f"verify_{record}"), timed_compile_s=tt,
        run=functools.partial(lambda f, a: _block(f(*a)), ft, timed_args),
        noop=functools.partial(lambda f, a: _block(f(*a)), noop, timed_args),
        notes=[f"{R} calls per invocation over {C} state copies"],
    )  # fmt: skip
    return row, out


def _commit_row(backend, record, inp: ConfigInputs, clock: Clock, label: str, single: bool, compile_s: dict):
    box = inp.pool_box
    tape = inp.tuples if record == "tuples" else inp.snapshots
    n_idx = len(inp.index_args)
    f1 = None
    if single or n_idx == 1:
        f1, t1 = _compile(_commit_fn(backend), box[0], tape, inp.index_args[:1])
        compile_s[f"commit_{record}"] = t1
    if n_idx == 1:
        ft, tt = f1, None
    else:
        ft, tt = _compile(_commit_fn(backend), box[0], tape, inp.index_args)
    noop, _ = _compile(_noop(), box[0], tape, inp.index_args)
    in_place = in_place_report(ft, box[0])
    parts = ([f"one call in {compile_s[f'commit_{record}']:.2f} s"] if f1 is not None else []) + (
        [f"the timed function ({n_idx} commits) in {tt:.2f} s"] if tt is not None else [])
    clock.log(f"{label}: commit {record}: compiled " + ", ".join(parts) + f"; in place: {in_place}")

    def run():
        try:
            box[0] = ft(box[0], tape, inp.index_args)
            _block(box[0])
        except Exception:
            if box[0].is_deleted():  # donated to a call that failed: the other rows need a pool
                box[0] = inp.fresh_pool()
            raise

    def run_noop():
        _block(noop(box[0], tape, inp.index_args))

    traffic = [tr.commit_traffic(inp.shape, inp.layers, ix, record, slots_in_pool=inp.slots) for ix in inp.index_sets]
    mean = tr.Traffic(sum(t.read for t in traffic) // len(traffic), sum(t.write for t in traffic) // len(traffic))
    notes = [f"{n_idx} commits per invocation (index sets differ), pool donated"]
    if in_place.get("aliased") is False or (in_place.get("pool_copies") or 0) > 0:
        notes.append(f"NOT IN PLACE: {in_place}")
    row = Row(config=inp.config.label, backend=backend, op="commit", record=record, calls=n_idx, traffic=mean,
              compile_s=compile_s.get(f"commit_{record}"), timed_compile_s=tt, run=run, noop=run_noop, notes=notes)  # fmt: skip
    return row, in_place


def copy_row(inp: ConfigInputs, clock: Clock) -> Row:
    """The device-to-device copy rate of this run: ``x * 2`` over a large fp32 array."""
    x = inp.copy_src
    f, t = _compile(jax.jit(lambda x: x * 2), x)
    noop, _ = _compile(_noop(), x)
    clock.log(f"{inp.config.label}: copy row: {x.nbytes / 2**30:.2f} GiB, compiled in {t:.2f} s")
    return Row(
        config=inp.config.label, backend="xla", op="copy", record=None, calls=1, traffic=tr.copy_traffic(x.nbytes),
        run=lambda: _block(f(x)), noop=lambda: _block(noop(x)), compile_s=t,
        notes=[f"x * 2 over {x.nbytes / 2**30:.2f} GiB fp32; read + write counted"],
    )  # fmt: skip
