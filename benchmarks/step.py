"""The whole speculative step as users write it, beside SGLang's step, wall-clock and device time.

A kernel timed alone can hide the copy, gather or loop around it. This benchmark times one
speculative step of all GDN layers (verify of every layer, then the commit of all layers), the
way a JAX user composes it, for each record mode and backend:

``pool-python``
    ``pool.verify_layer`` for each layer, then ``pool.commit`` (conv included), called one by
    one from Python, the way a serving loop written against the pool module runs.
``pool-jit``
    the same calls inside one outer ``jax.jit`` with the pool donated.
``pool-scan``
    the same in one ``jax.jit``, the layers in a ``lax.scan`` over the layer index with the pool
    as its carry, the inputs and parameters stacked over layers (read at the layer by the kernels).
``scan``
    one ``jax.jit``: ``gdn_lossless_jax.verify(ssm, ..., slots=, layer=, tape=, rows=)`` for
    every layer in a ``lax.scan`` over the layer index (the states read from the pool by slot,
    the inputs, stacked over layers, read at the layer inside the kernels, each layer's tape
    written into its row of the scratch in place), then ``gdn_lossless_jax.commit``; the pool
    and the scratch donated. No conv: the same work as SGLang's step below.
``unrolled``
    the same with the layers unrolled in Python inside the jit (a static layer index), the
    outputs stacked into one ``[L, ...]`` array as the scan returns them.
``scan-out``, ``unrolled-out``
    ``scan`` and ``unrolled`` with one outputs buffer ``[L, N, D, HV, V]`` (an argument,
    donated, returned) that every layer's verify writes at its layer (``out=``; carried with
    the tape in the scan): no stacking copy, no per-layer output slice.
``scan-sliced``, ``pool-scan-sliced``, ``unrolled-lists`` (not run unless named in ``--kinds``)
    the forms before the kernels read stacked inputs: the ``lax.scan`` slicing each layer's
    inputs out of the stacks (a copy per input and layer), and the unrolled layers taking
    per-layer lists (seven arguments per layer to the jitted call).
``*-nocb`` (likewise)
    ``scan``, ``unrolled``, ``fused``, ``fused-out`` and ``pool-scan`` compiled with XLA's command buffers off
    for that one jit (``compiler_options={"xla_gpu_enable_command_buffer": ""}``).
``unrolled-out-conc``, ``fused-out-conc`` (likewise)
    ``unrolled-out`` and ``fused-out`` with XLA's command buffers recorded as a graph of the
    kernels' buffer dependencies (``xla_gpu_command_buffer_scheduling_mode="CONCURRENT"``): a
    layer's prologue, which does not wait for the last layer's kernel, may run beside it. Their
    kernels can overlap, so the device column shows the sum of kernel times and, where the GPU
    was busy for less, the union of their intervals (``busy``).
``fused``
    the ``scan`` step with the commit fused into the next verify
    (``gdn_lossless_jax.commit_and_verify``): each layer's kernel applies the previous step's
    commit (the same indices every step: the steady state of a decode) and verifies from it; no
    separate commit launch. Two tape buffers alternate. The outputs come out of the scan as in
    ``scan``.
``fused-out``
    ``fused`` with the layers unrolled and the outputs written in place (``out=``), as
    ``unrolled-out``; two jitted copies of the step, one per parity of the step (each sees
    the two tape buffers in the same roles every call: one that saw them swap would re-record
    its CUDA graph every call).
``pool-deferred``
    ``pool-scan`` on a pool allocated with ``defer_commit=True`` (``pool.commit`` keeps the SSM
    part for the next ``pool.verify_layer``).
``scan-mesh``, ``pool-scan-mesh`` (not run unless named in ``--kinds``)
    ``scan`` and ``pool-scan`` through :class:`gdn_lossless_jax.sharding.MeshPlan` (verify and
    commit per shard under ``jax.shard_map``) on the mesh ``--mesh TPxDP`` (default ``1x1``: one
    device, where the step must cost what ``scan`` costs), every input placed on the mesh first.
``sglang`` (snapshots)
    SGLang's own kernels on the same inputs: its verify with the intermediate-state buffer for
    every layer, then its two scatters (accepted, track), captured in one CUDA graph.

Every row is one step per invocation, blocking until the device is done; rounds are
interleaved (:func:`benchmarks.timing.run_rounds`), nothing is subtracted: the wall-clock is
what a user waits for. After the rounds each row is traced with the profiler: its *device
time* is the sum of every kernel the step launched (ours and XLA's), and the kernels that are
not ours (names without ``gdn_``, other than the Triton backend's kernel functions) are listed,
so hidden work shows. ``wall / device`` is the overhead of the way the step is written (launch
gaps, host work). Then each row runs ``--b2b-calls`` steps back to back (a decode loop: each
call waits for the last, no other program between): its *back to back* median; the same with
our rows waiting by polling ``is_ready()`` (the host thread spins instead of sleeping in
``block_until_ready``): *polled*; the same waiting with the driver's wait on the device, as
SGLang's row waits (:func:`gdn_lossless_jax.sync.synchronize`, GPUs only): *synced*; then as
many dispatched *ahead*, one wait at the end (a
decode loop that keeps its accept decision on the device and runs ahead of it): the time a
step, median of 5 such runs. A call that blocks pays the host's dispatch and wake-up on every
step; a step dispatched ahead hides them behind the last step's kernels.

Run on a GPU (a few minutes; the runs of record: ``benchmarks/results/step/``)::

    python -m benchmarks.step --out $OUT/step --configs 25x4,8x16,8x4,8x8 --backends mosaic,pallas \
        --kinds unrolled-out,fused-out --records tuples --budget-s 8 --rounds 20

The sharded code path on a one-device mesh beside the unsharded one::

    python -m benchmarks.step --out $OUT/step-mesh --configs 25x4,8x4 --backends pallas \
        --kinds scan,scan-mesh,pool-scan,pool-scan-mesh --mesh 1x1 --peer off

KDA beside GDN: ``--families model,kimi_linear`` adds Kimi-Linear-48B-A3B's linear layers (20 KDA layers, H = HV
= 32, K = V = 128; a per-channel decay, its tapes ``KDATuples``) as rows of their own, labelled ``25x4 kimi_linear``
(no SGLang row for them: its step is GDN's)::

    python -m benchmarks.step --out $OUT/step-kda --configs 25x4 --backends mosaic,pallas \
        --families model,kimi_linear --kinds unrolled-out,fused-out --records tuples,snapshots

``--mode cpu-small`` runs the same rows on a reduced geometry (CI keeps the harness alive;
its timings are not results).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import gdn_lossless_jax as gl
from gdn_lossless_jax import sharding
from gdn_lossless_jax.testing import cases
from gdn_lossless_jax import pool as gpool
from gdn_lossless_jax.testing.cases import Shape
from gdn_lossless_jax.sync import synchronize

from . import cases as bc
from .suite import _draw
from .timing import Clock, Row, device_pass, run_rounds, spin_until_ready, summarize
from .traffic import Traffic

# How the timed rows wait for their step: jax.block_until_ready, polling is_ready()
# (back_to_back(..., wait="poll"): the *polled* column) or the driver's wait on the device
# (wait="sync": the *synced* column, gdn_lossless_jax.sync.synchronize). SGLang's row waits with
# torch.cuda.synchronize in all three.
_WAIT = [jax.block_until_ready]


def _synced(tree):
    synchronize()
    return tree


WAITS = {"block": jax.block_until_ready, "poll": spin_until_ready, "sync": _synced}


def wait(tree):
    return _WAIT[0](tree)

__all__ = ["STEP_KINDS", "main", "step_rows"]

RECORDS = ("tuples", "snapshots")
STEP_KINDS = ("pool-python", "pool-jit", "pool-scan", "scan", "unrolled", "scan-out", "unrolled-out", "fused",
              "fused-out", "pool-deferred")
#: XLA's command buffers (CUDA graphs) off for one jitted step (``jax.jit(..., compiler_options=)``).
NO_COMMAND_BUFFERS = {"xla_gpu_enable_command_buffer": ""}
#: XLA's command buffers recorded as a graph of the kernels' buffer dependencies, so that kernels
#: that do not depend on each other may run at once (XLA's default, ``LHS``, keeps the order of its
#: latency-hiding scheduler and serializes them).
CONCURRENT = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}
#: A kind's suffix and the compiler options it stands for.
OPTION_SUFFIXES = {"-nocb": NO_COMMAND_BUFFERS, "-conc": CONCURRENT}
#: The direct step's earlier forms, and steps compiled without command buffers (``-nocb``) or with
#: concurrent command buffers (``-conc``), for comparison; run only when ``--kinds`` names them.
OLD_KINDS = ("scan-sliced", "pool-scan-sliced", "unrolled-lists", "scan-nocb", "unrolled-nocb", "fused-nocb",
             "fused-out-nocb", "pool-scan-nocb", "unrolled-out-conc", "fused-out-conc")
DIRECT_FORMS = ("scan", "unrolled", "scan-out", "unrolled-out", "scan-sliced", "unrolled-lists")
#: The fused kinds' forms of :func:`fused_step` (``fused-out-nocb``: ``fused-out`` without command buffers).
FUSED_FORMS = {"fused": "scan", "fused-out": "unrolled-out"}
#: The same steps through a MeshPlan (``--mesh``); run only when ``--kinds`` names them.
MESH_KINDS = ("pool-scan-mesh", "scan-mesh")


def split_kind(kind: str) -> tuple[str, dict | None]:
    """A step kind's form and its compiler options (``unrolled-out-conc``: ``unrolled-out``, :data:`CONCURRENT`)."""
    for suffix, options in OPTION_SUFFIXES.items():
        if kind.endswith(suffix):
            return kind.removesuffix(suffix), options
    return kind, None


@dataclasses.dataclass
class StepInputs:
    """Everything the rows of one configuration read: per-layer parameters and draft inputs,
    and the commit indices of a few steps (each invocation takes the next set).

    The layer-by-layer steps take each layer's arrays from lists (a model makes them layer by
    layer; slicing a stacked array per layer would add a copy per input and layer that the
    library does not make); the ``lax.scan`` steps take the stacked arrays, whose per-layer
    slices the scan copies (as a model's scan slices its stacked weights)."""

    config: bc.Config
    geometry: object
    shape: Shape
    slots: int
    params: dict  # [L, ...] stacked: conv_weight, conv_bias, A_log, dt_bias
    pool_inputs: dict  # [L, N, D, ...]: mixed_qkv, a, b (the pool path)
    qkv: dict  # [L, N, D, ...]: q, k, v, a, b (the direct path and SGLang)
    index_sets: list  # each: (slots, steps, track_slots, track_steps, rows), [N] int32 on the device
    layers: dict = dataclasses.field(default_factory=dict)  # the same, as per-layer lists
    family: str = "model"  # bc.FAMILIES: the mode's model, or a released family's (its rows' label says which)

    @property
    def label(self) -> str:
        """The rows' configuration: ``25x4``, or ``25x4 kimi_linear`` for another family's layers."""
        return self.config.label if self.family == "model" else f"{self.config.label} {self.family}"

    def layer(self, name: str, i: int) -> dict:
        return self.layers[name][i]


def make_inputs(config: bc.Config, geometry, *, seed: int, index_sets: int = 4, family: str = "model") -> StepInputs:
    g = geometry
    s = Shape.of(g, config.requests, config.drafts)
    L, N, D = g.gdn_layers, s.N, s.D
    bf16 = "bfloat16"
    per_channel = (s.K,) if g.decay == "channel" else ()  # KDA: a and dt_bias one decay input per key channel
    specs = (
        ((L, g.conv_dim, g.conv_kernel), "float32", "normal", 0.3),
        ((L, g.conv_dim), "float32", "normal", 0.1),
        ((L, s.HV), "float32", "uniform", 1.0),
        ((L, s.HV, *per_channel), "float32", "normal", 0.5),
        ((L, N, D, g.conv_dim), bf16, "normal", 1.0),
        ((L, N, D, s.HV, *per_channel), bf16, "normal", 1.0),
        ((L, N, D, s.HV), bf16, "normal", 1.0),
        ((L, N, D, s.H, s.K), bf16, "normal", 1.0),
        ((L, N, D, s.H, s.K), bf16, "normal", 1.0),
        ((L, N, D, s.HV, s.V), bf16, "normal", 1.0),
    )
    x = _draw(jnp.uint32(seed % 2**32), specs)
    params = dict(conv_weight=x[0], conv_bias=x[1], A_log=x[2], dt_bias=x[3])
    pool_inputs = dict(mixed_qkv=x[4], a=x[5], b=x[6])
    qkv = dict(q=x[7], k=x[8], v=x[9], a=x[5], b=x[6])
    sets = [ix.as_args() for ix in bc.commit_index_sets(config, index_sets, seed=seed)]
    split = lambda d: [{k: v[i] for k, v in d.items()} for i in range(L)]  # noqa: E731
    layers = {"params": split(params), "pool_inputs": split(pool_inputs), "qkv": split(qkv)}
    out = StepInputs(config, g, s, bc.pool_slots(config.requests), params, pool_inputs, qkv, sets, layers, family)
    jax.block_until_ready(jax.tree.leaves((params, pool_inputs, qkv, sets, layers)))
    return out


def _filled(tree, seed: int):
    """A pytree of arrays like ``tree`` filled with random values (never zeros)."""
    leaves, treedef = jax.tree.flatten(tree)
    specs = tuple((tuple(x.shape), jnp.dtype(x.dtype).name, "normal", 0.5) for x in leaves)
    return jax.tree.unflatten(treedef, list(_draw(jnp.uint32(seed % 2**32), specs)))


def _allocate(inp: StepInputs, record: str, seed: int) -> gpool.StatePool:
    s = inp.shape
    spec = jax.eval_shape(
        lambda: gpool.allocate(inp.geometry, slots=inp.slots - 1, requests=s.N, drafts=s.D, record=record)
    )
    return _filled(spec, seed)


# ---------------------------------------------------------------------------------
# The steps
# ---------------------------------------------------------------------------------
def _pool_step(p, params, xs, ix, backend):
    """Every layer's ``pool.verify_layer`` (``params``, ``xs``: per-layer lists), then the commit."""
    slots, steps, tslots, tsteps, rows = ix
    outs = []
    for layer in range(p.geometry.gdn_layers):
        o, p = gpool.verify_layer(p, layer, **xs[layer], **params[layer], slots=slots, rows=rows, backend=backend)
        outs.append(o)
    return outs, gpool.commit(p, slots, steps, tslots, tsteps, rows, backend=backend)


def _pool_scan_step(p, params, xs, ix, backend, plan: sharding.MeshPlan | None = None, sliced: bool = False):
    """The same with the layers in a ``lax.scan`` over the layer index (``params``, ``xs``:
    stacked ``[L, ...]``, read at the layer by the kernels; ``sliced``: the scan slices them);
    with ``plan``, through ``plan.verify_layer`` and ``plan.pool_commit`` (sliced)."""
    slots, steps, tslots, tsteps, rows = ix
    verify, commit = (gpool.verify_layer, gpool.commit) if plan is None else (plan.verify_layer, plan.pool_commit)
    ids = jnp.arange(p.geometry.gdn_layers, dtype=jnp.int32)

    def layer(p, lx):
        i, prm, x = lx
        o, p = verify(p, i, **x, **prm, slots=slots, rows=rows, backend=backend)
        return p, o

    if sliced or plan is not None:
        p, outs = jax.lax.scan(layer, p, (ids, params, xs))
    else:
        p, outs = jax.lax.scan(lambda p, i: layer(p, (i, params, xs)), p, ids)
    return outs, commit(p, slots, steps, tslots, tsteps, rows, backend=backend)


def parse_mesh(text: str) -> sharding.MeshPlan:
    """``TPxDP`` (tensor x data sizes) -> a MeshPlan over the first TP*DP devices."""
    try:
        tp, dp = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--mesh must be TPxDP (e.g. 1x1, 2x1), got {text!r}") from None
    devices = jax.devices()
    if tp < 1 or dp < 1 or tp * dp > len(devices):
        raise ValueError(f"--mesh {text}: needs {tp}x{dp} devices, {len(devices)} here")
    mesh = jax.sharding.Mesh(np.array(devices[: tp * dp]).reshape(dp, tp), ("data", "tensor"))
    return sharding.MeshPlan(mesh, tensor="tensor", data="data")


def _mesh_inputs(inp: StepInputs, plan: sharding.MeshPlan, record: str, seed: int):
    """The mesh rows' pools (rows rounded up to a multiple of DP), shard-local index sets and
    inputs, placed on the mesh."""
    s = inp.shape
    requests = -(-(s.N + 1) // plan.dp) * plan.dp - 1
    spec = jax.eval_shape(
        lambda: gpool.allocate(inp.geometry, slots=inp.slots - 1, requests=requests, drafts=s.D, record=record)
    )
    pools = [plan.put(_filled(spec, seed + i), "pool") for i in (11, 13)]
    sets = [
        cases.commit_indices(seed * 1000 + r, N=s.N, D=s.D, slots_in_pool=inp.slots, rows_in_tape=requests + 1,
                             track_fraction=bc.TRACK_FRACTION, shards=plan.dp).as_args()
        for r in range(len(inp.index_sets))
    ]  # fmt: skip
    kinds = {"conv_weight": "conv_weight", "conv_bias": "per_head", "A_log": "per_head", "dt_bias": "per_head",
             "mixed_qkv": "per_step", "a": "per_step", "b": "per_step", "q": "heads", "k": "heads", "v": "heads"}
    put = lambda d: {k: plan.put(v, kinds[k]) for k, v in d.items()}  # noqa: E731
    return pools, [plan.put(ix, "index") for ix in sets], put(inp.params), put(inp.pool_inputs), put(inp.qkv)


def direct_step(backend: str, form: str, plan: sharding.MeshPlan | None = None, options: dict | None = None,
                decay: str = "scalar"):  # fmt: skip
    """The one-jit step over ``(ssm [L, S, HV, V, K], tape [L, R, D, ...])``, both donated;
    ``params`` and ``xs`` stacked ``[L, ...]`` (per-layer lists for ``unrolled-lists``).
    ``form``: ``scan`` or ``unrolled`` (verify reads the stacks at the layer),
    ``scan-sliced`` (the scan slices them) or ``unrolled-lists``; ``scan-out`` and
    ``unrolled-out`` take a sixth argument, the outputs buffer ``[L, N, D, HV, V]`` (donated),
    that verify writes in place (``out=``). With ``plan``, verify and commit run through
    ``plan.verify`` and ``plan.commit`` (shard_map; one layer's inputs). ``options``: XLA
    options of this jit (``compiler_options``). ``decay``: the layers' (``"channel"``: KDA)."""
    verify, commit = (gl.verify, gl.commit) if plan is None else (plan.verify, plan.commit)
    names = ("q", "k", "v", "a", "b")
    if decay != "scalar":
        verify = functools.partial(verify, decay=decay)

    def step(ssm, tape, params, xs, ix, obuf=None):
        slots, steps, tslots, tsteps, rows = ix

        def layer(tape, i, prm, x, obuf=None):
            kw = {} if obuf is None else {"out": obuf}
            out, tape = verify(ssm, *(x[n] for n in names), prm["A_log"], prm["dt_bias"], slots=slots, layer=i,
                               tape=tape, rows=rows, backend=backend, **kw)  # fmt: skip
            return tape, out

        L = ssm.shape[0]
        prm = {k: params[k] for k in ("A_log", "dt_bias")} if form != "unrolled-lists" else params
        if form == "unrolled-out":
            outs = obuf
            for i in range(L):
                tape, outs = layer(tape, i, prm, xs, outs)
        elif form == "scan-out":
            def body(carry, i):  # the tape and the outputs buffer carried, each written in place
                tape, outs = carry
                return layer(tape, i, prm, xs, outs), None

            (tape, outs), _ = jax.lax.scan(body, (tape, obuf), jnp.arange(L, dtype=jnp.int32))
        elif form == "unrolled-lists":
            outs = []
            for i in range(L):
                tape, o = layer(tape, i, params[i], xs[i])
                outs.append(o)
        elif form == "unrolled":
            outs = []
            for i in range(L):
                tape, o = layer(tape, i, prm, xs)
                outs.append(o)
            outs = jnp.stack(outs)  # one [L, ...] output, as the scan's
        elif form == "scan":
            tape, outs = jax.lax.scan(lambda t, i: layer(t, i, prm, xs), tape, jnp.arange(L, dtype=jnp.int32))
        else:  # scan-sliced
            tape, outs = jax.lax.scan(lambda t, lx: layer(t, *lx), tape, (jnp.arange(L, dtype=jnp.int32), prm, xs))
        ssm = commit(ssm, tape, slots, steps, tslots, tsteps, rows, backend=backend)
        return outs, ssm, tape

    return jax.jit(step, donate_argnums=(0, 1, 5) if form.endswith("-out") else (0, 1), compiler_options=options)


def fused_step(backend: str, options: dict | None = None, form: str = "scan", decay: str = "scalar"):
    """The steady-state step with the commit inside the next verify: ``(ssm, tape, prev_tape)``
    donated, returned in the same places (the caller swaps the two tapes' roles between calls:
    swapped inside the jit, XLA would copy both to keep each donated buffer in its place).
    ``form``: ``scan`` (the layers in a ``lax.scan``, outputs stacked by it) or ``unrolled-out``
    (the layers unrolled, the outputs written in place into a seventh argument, donated)."""

    def step(ssm, tape, prev, params, xs, ix, obuf=None):
        slots, steps, tslots, tsteps, rows = ix
        pending = gl.Pending(prev, rows, steps, tslots, tsteps)

        def layer(carry, i, obuf=None):  # the inputs stacked over layers, read at i by the kernels
            ssm, tape = carry
            kw = {} if obuf is None else {"out": obuf}
            out, tape, ssm = gl.commit_and_verify(
                ssm, pending, xs["q"], xs["k"], xs["v"], xs["a"], xs["b"], params["A_log"], params["dt_bias"],
                slots=slots, layer=i, tape=tape, rows=rows, backend=backend, decay=decay, **kw,
            )  # fmt: skip
            return (ssm, tape), out

        if form == "unrolled-out":
            carry, outs = (ssm, tape), obuf
            for i in range(ssm.shape[0]):
                carry, outs = layer(carry, i, outs)
            ssm, tape = carry
        else:
            (ssm, tape), outs = jax.lax.scan(layer, (ssm, tape), jnp.arange(ssm.shape[0], dtype=jnp.int32))
        return outs, ssm, tape, prev

    donate = (0, 1, 2, 6) if form == "unrolled-out" else (0, 1, 2)
    return jax.jit(step, donate_argnums=donate, compiler_options=options)


# The Triton backend's kernels: the profiler names a jax-triton launch after its Triton function.
TRITON_KERNELS = ("verify_kernel", "verify_prep_kernel", "commit_tuples_kernel", "commit_snapshots_kernel")


def direct_runner(fn, form: str, inp: StepInputs, box: list, o_box: list, next_ix):
    """One call of a direct step ``fn`` (:func:`direct_step` of ``form``): the pool's states and
    tape from ``box[0]``, replaced by the call's (donated); the outputs buffer ``o_box[0]`` of the
    ``-out`` forms likewise; the index set from ``next_ix()``. Returns the outputs, not waited for."""

    def one():
        lists = form == "unrolled-lists"
        src = (inp.layers["params"], inp.layers["qkv"]) if lists else (inp.params, inp.qkv)
        obuf = o_box if form.endswith("-out") else []  # the outputs buffer, donated and returned
        outs, ssm, tape = fn(*box[0], *src, next_ix(), *obuf)
        if obuf:
            o_box[0] = outs
        box[0] = (ssm, tape)
        return outs

    return one


def fused_call(fns):
    """The fused step (:func:`fused_step`) as a decode loop calls it: ``fns`` one executable, or one
    per parity of the step, taken in turn. ``call(ssm, tape, prev, params, xs, ix, *obuf)`` writes
    ``tape`` and commits ``prev`` (the tape the last call wrote), and returns ``(outs, ssm, tape,
    prev)`` in the next call's roles: the next call writes the tape just committed and commits the
    one just written."""
    calls = [0]

    def call(ssm, tape, prev, params, xs, ix, *obuf):
        fn = fns[calls[0] % len(fns)]
        calls[0] += 1
        outs, ssm, written, old = fn(ssm, tape, prev, params, xs, ix, *obuf)
        return outs, ssm, old, written

    return call


def fused_runner(fns, form: str, inp: StepInputs, box: list, o_box: list, fixed: bool = False):
    """One call of the fused step (:func:`fused_call` of ``fns``, :func:`fused_step` of ``form``) on
    ``box[0]``: the states, the tape this call writes and the tape the last call wrote (this call
    commits it); the two tapes swap roles after the call unless ``fixed`` (the same work, wrong for
    a decode: what the swap costs). The outputs buffer as in :func:`direct_runner`. Returns the
    outputs, not waited for."""
    call = fused_call(fns)

    def one():
        obuf = o_box if form == "unrolled-out" else []
        outs, ssm, tape, prev = call(*box[0], inp.params, inp.qkv, inp.index_sets[0], *obuf)
        if obuf:
            o_box[0] = outs
        box[0] = (ssm, prev, tape) if fixed else (ssm, tape, prev)
        return outs

    return one


def _ours(name: str) -> bool:
    return "gdn_" in name or name in TRITON_KERNELS


def _kernels_not_ours(device: dict | None) -> list[dict]:
    if not device:
        return []
    return [k for k in device["kernels"] if not _ours(k["name"])]


def step_rows(inp: StepInputs, backend: str, record: str, clock: Clock, seed: int, kinds=STEP_KINDS,
              plan: sharding.MeshPlan | None = None) -> list[Row]:  # fmt: skip
    """The step rows of one backend and record mode (``kinds``, of :data:`STEP_KINDS` and
    :data:`MESH_KINDS`; the latter on ``plan``, a one-device mesh if None)."""
    cfg, L = inp.label, inp.geometry.gdn_layers
    rows = []
    p_box = [_allocate(inp, record, seed)]
    counter = {"i": 0}

    def next_ix():
        counter["i"] += 1
        return inp.index_sets[counter["i"] % len(inp.index_sets)]

    def run_python():
        outs, p_box[0] = _pool_step(p_box[0], inp.layers["params"], inp.layers["pool_inputs"], next_ix(), backend)
        wait((outs, p_box[0]))

    pool_jit = jax.jit(lambda p, prm, xs, ix: _pool_step(p, prm, xs, ix, backend), donate_argnums=0)
    pool_scan = jax.jit(lambda p, prm, xs, ix: _pool_scan_step(p, prm, xs, ix, backend), donate_argnums=0)
    pool_scan_nocb = jax.jit(lambda p, prm, xs, ix: _pool_scan_step(p, prm, xs, ix, backend), donate_argnums=0,
                             compiler_options=NO_COMMAND_BUFFERS)  # fmt: skip
    pool_scan_sliced = jax.jit(lambda p, prm, xs, ix: _pool_scan_step(p, prm, xs, ix, backend, sliced=True),
                               donate_argnums=0)  # fmt: skip

    def run_pool(fn, stacked):
        def run():
            src = (inp.params, inp.pool_inputs) if stacked else (inp.layers["params"], inp.layers["pool_inputs"])
            outs, p_box[0] = fn(p_box[0], *src, next_ix())
            wait((outs, p_box[0]))

        return run

    d_box = [(p_box[0].ssm, p_box[0].tape)]  # the direct rows own a second pool of the same shape
    d_box[0] = _filled(d_box[0], seed + 7)
    decay = inp.geometry.decay
    fns = {f: direct_step(backend, split_kind(f)[0], options=split_kind(f)[1], decay=decay)
           for f in kinds if split_kind(f)[0] in DIRECT_FORMS}  # fmt: skip
    s = inp.shape  # the outputs buffer of the -out rows, made only when one runs
    o_box = [_filled(jax.ShapeDtypeStruct((L, s.N, s.D, s.HV, s.V), inp.qkv["q"].dtype), seed + 9)
             if any(split_kind(k)[0].endswith("-out") for k in kinds) else None]  # fmt: skip

    def run_direct(form):
        one = direct_runner(fns[form], split_kind(form)[0], inp, d_box, o_box, next_ix)

        def run():
            wait((one(), d_box[0]))

        run.ahead = (one, lambda: jax.block_until_ready((d_box[0], o_box[0])))
        return run

    def run_fused(options=None, form="scan"):
        # unrolled-out: one executable per parity of the step, so that each always sees the same
        # tape in each role (the tapes swap roles every step; one executable seeing them swapped
        # re-records its whole CUDA graph before every call)
        fns = [fused_step(backend, options, form, decay) for _ in range(2 if form == "unrolled-out" else 1)]
        f_box = [None]  # each fused row its own buffers: another row's swap would swap this one's tapes' roles
        one = fused_runner(fns, form, inp, f_box, o_box)

        def run():
            if f_box[0] is None:  # a pool and two tape buffers of its own, made on the first call
                f_box[0] = _filled((p_box[0].ssm, p_box[0].tape, p_box[0].tape), seed + 11)
            wait((one(), f_box[0]))

        run.ahead = (one, lambda: jax.block_until_ready((f_box[0], o_box[0])))  # (run makes f_box first)
        return run

    q_box = [None]

    def run_deferred():
        if q_box[0] is None:
            spec = jax.eval_shape(lambda: gpool.allocate(inp.geometry, slots=inp.slots - 1, requests=inp.shape.N,
                                                         drafts=inp.shape.D, record=record, defer_commit=True))  # fmt: skip
            q_box[0] = _filled(spec, seed + 13)
            d = q_box[0].deferred  # no pending commit at the start
            off = jnp.full(d.slots.shape, -1, jnp.int32)
            q_box[0] = dataclasses.replace(q_box[0], deferred=dataclasses.replace(
                d, slots=off, steps=off + 0, track_slots=off + 0, track_steps=off + 0, rows=off + 0,
                applied=jnp.zeros(d.slots.shape, bool)))  # fmt: skip
        outs, q_box[0] = pool_scan(q_box[0], inp.params, inp.pool_inputs, next_ix())
        wait((outs, q_box[0]))

    runs = {"pool-python": run_python, "pool-jit": run_pool(pool_jit, False), "pool-scan": run_pool(pool_scan, True),
            **{f: run_direct(f) for f in fns},
            **{k: run_fused(split_kind(k)[1], FUSED_FORMS[split_kind(k)[0]])
               for k in STEP_KINDS + OLD_KINDS if split_kind(k)[0] in FUSED_FORMS},
            "pool-scan-nocb": run_pool(pool_scan_nocb, True), "pool-scan-sliced": run_pool(pool_scan_sliced, True),
            "pool-deferred": run_deferred}  # fmt: skip
    if any(k in kinds for k in MESH_KINDS):
        plan = plan or parse_mesh("1x1")
        runs.update(_mesh_runs(inp, backend, record, seed, plan))

    def mesh_note(kind):
        return [f"mesh {plan.tp}x{plan.dp} (tensor x data)"] if kind in MESH_KINDS else []
    for kind, run in runs.items():
        if kind not in kinds:
            continue
        t = time.perf_counter()
        try:
            run()  # compile and first call
            first = time.perf_counter() - t
            rows.append(Row(config=cfg, backend=backend, op=kind, record=record, calls=1, traffic=Traffic(0, 0),
                            run=run, compile_s=first, notes=[f"{L} layers"] + mesh_note(kind),
                            ahead=getattr(run, "ahead", None)))  # fmt: skip
            clock.log(f"{cfg} {backend} {record} {kind}: first call {first:.2f} s")
        except Exception as e:  # noqa: BLE001 - report, go on
            clock.log(f"{cfg} {backend} {record} {kind}: FAILED: {type(e).__name__}: {str(e)[:300]}")
    return rows


def _mesh_runs(inp: StepInputs, backend: str, record: str, seed: int, plan: sharding.MeshPlan) -> dict:
    """``scan-mesh`` and ``pool-scan-mesh``: ``scan`` and ``pool-scan`` through ``plan``."""
    (pool, direct), index_sets, params, pool_inputs, qkv = _mesh_inputs(inp, plan, record, seed)
    box = {"pool": pool, "direct": (direct.ssm, direct.tape), "i": 0}
    pool_scan = jax.jit(lambda p, prm, xs, ix: _pool_scan_step(p, prm, xs, ix, backend, plan), donate_argnums=0)
    scan = direct_step(backend, "scan-sliced", plan)

    def next_ix():
        box["i"] += 1
        return index_sets[box["i"] % len(index_sets)]

    def run_pool():
        outs, box["pool"] = pool_scan(box["pool"], params, pool_inputs, next_ix())
        wait((outs, box["pool"]))

    def run_scan():
        outs, ssm, tape = scan(*box["direct"], params, qkv, next_ix())
        box["direct"] = (ssm, tape)
        wait((outs, ssm, tape))

    return {"pool-scan-mesh": run_pool, "scan-mesh": run_scan}


def sglang_row(inp: StepInputs, clock: Clock, src=None) -> tuple[Row | None, str]:
    """SGLang's step (snapshot path): verify of every layer with the intermediate-state buffer,
    then its two scatters, in one CUDA graph; or None and why."""
    from . import peer_sglang

    try:
        peer = peer_sglang.load(src)
        import torch
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {e}"
    if not torch.cuda.is_available():
        return None, "no CUDA device for torch"
    s, L = inp.shape, inp.geometry.gdn_layers
    N, D = s.N, s.D
    t = torch.from_dlpack
    dev = t(inp.qkv["q"]).device  # the GPU that holds JAX's inputs: every tensor of the step lives there
    torch.cuda.set_device(dev)
    pool = torch.randn((L, inp.slots, s.HV, s.V, s.K), dtype=torch.float32, device=dev) * 0.5
    buf = torch.empty((L, N + 1, D, s.HV, s.V, s.K), dtype=torch.float32, device=dev)
    q, k, v, a, b = (t(inp.qkv[n]) for n in ("q", "k", "v", "a", "b"))
    A_log, dt_bias = t(inp.params["A_log"]), t(inp.params["dt_bias"])
    ix = [t(x) for x in inp.index_sets[0]]
    slots, steps, tslots, tsteps, rows = ix
    cu = torch.arange(0, N * D + 1, D, dtype=torch.int32, device=dev)
    scale = s.K**-0.5

    def step():
        for layer in range(L):
            peer_sglang.verify_call(
                peer, state0=pool[layer], q=q[layer], k=k[layer], v=v[layer], a=a[layer], b=b[layer],
                A_log=A_log[layer], dt_bias=dt_bias[layer], buffer=buf[layer], state_idx=slots, buffer_idx=rows,
                cu_seqlens=cu, scale=scale,
            )  # fmt: skip
        peer_sglang.scatter_call(peer, pool=pool, snapshots=buf, slots=slots, steps=steps, track_slots=tslots,
                                 track_steps=tsteps, rows=rows)  # fmt: skip

    where = {str(x.device) for x in (pool, buf, q, k, v, a, b, A_log, dt_bias, *ix, cu)}
    if where != {str(dev)}:
        return None, f"tensors on several devices: {sorted(where)}"
    tm = time.perf_counter()
    run, how = peer_sglang._graph_or_eager(step, torch, dev)
    first = time.perf_counter() - tm
    clock.log(f"{inp.config.label} sglang step: ready in {first:.2f} s ({how})")

    def timed():
        run()
        torch.cuda.synchronize()

    row = Row(config=inp.config.label, backend="sglang", op="step", record="snapshots", calls=1, traffic=Traffic(0, 0),
              run=timed, compile_s=first, ahead=(run, torch.cuda.synchronize), notes=[f"{peer.origin}; {L} verify launches + 2 scatters; {how}; on {dev}"])  # fmt: skip
    return row, how


def back_to_back(rows: list[Row], calls: int, wait: str = "block", dispatch: dict | None = None) -> dict:
    """Each row called ``calls`` times in a row, each call waiting for the last (a decode loop
    that runs one step after another): seconds per call. The interleaved rounds instead run
    another row between two calls of one; XLA's CUDA graph of a jitted step starts later after
    another program ran. ``wait``: how our rows wait (:data:`WAITS`):
    ``block`` (``jax.block_until_ready``), ``poll`` (polling ``is_ready()``,
    :func:`benchmarks.timing.spin_until_ready`) or ``sync`` (the driver's wait on the device,
    :func:`gdn_lossless_jax.sync.synchronize`, as SGLang's row waits). With ``sync``, a row that
    can run ahead is dispatched and then waited for (SGLang's by ``torch.cuda.synchronize``), and
    ``dispatch`` (if given) gets each call's seconds until the dispatch returned."""
    out = {}
    _WAIT[0] = WAITS[wait]
    try:
        for r in rows:
            if r.failed or not calls:
                continue
            ts, ds = [], []
            for _ in range(calls):
                t = time.perf_counter()
                if wait == "sync" and r.ahead is not None:
                    go, block = r.ahead
                    go()
                    ds.append(time.perf_counter() - t)
                    (block if r.backend == "sglang" else synchronize)()  # SGLang's block: torch.cuda.synchronize
                else:
                    r.run()
                ts.append(time.perf_counter() - t)
            out[r.key] = np.asarray(ts)
            if dispatch is not None and ds:
                dispatch[r.key] = np.asarray(ds)
    finally:
        _WAIT[0] = jax.block_until_ready
    return out


def run_ahead(rows: list[Row], calls: int, repeats: int = 5) -> dict:
    """Each row with ``ahead`` dispatched ``calls`` times without waiting, then one wait (a
    decode loop that runs ahead): seconds a call, one value per repeat."""
    out = {}
    for r in rows:
        if r.failed or not calls or r.ahead is None:
            continue
        dispatch, block = r.ahead
        ts = []
        for _ in range(repeats):
            block()
            t = time.perf_counter()
            for _ in range(calls):
                dispatch()
            block()
            ts.append((time.perf_counter() - t) / calls)
        out[r.key] = np.asarray(ts)
    return out


def _row_dict(r: Row, b2b=None, ahead=None, polled=None, synced=None, dispatched=None) -> dict:
    d = {"config": r.config, "backend": r.backend, "kind": r.op, "record": r.record, "first_call_s": r.compile_s,
         "notes": r.notes, "failed": r.failed, "wall": summarize(np.asarray(r.raw)),
         "wall_back_to_back": summarize(b2b if b2b is not None else np.zeros(0)),
         "wall_polled": summarize(polled if polled is not None else np.zeros(0)),
         "wall_synced": summarize(synced if synced is not None else np.zeros(0)),
         "synced_dispatch": summarize(dispatched if dispatched is not None else np.zeros(0)),
         "wall_ahead": summarize(ahead if ahead is not None else np.zeros(0))}  # fmt: skip
    if r.device:
        d["device_us"] = r.device["us_per_call"]
        d["device_busy_us"] = r.device.get("busy_us_per_call")
        ours = sum(k["us_per_call"] for k in r.device["kernels"] if _ours(k["name"]))
        d["our_kernels_us"] = ours
        d["other_kernels"] = [
            {"name": k["name"], "launches": k["launches_per_call"], "us": k["us_per_call"]}
            for k in _kernels_not_ours(r.device)
        ]
        d["kernels"] = [{"name": k["name"], "launches": k["launches_per_call"], "us": k["us_per_call"]}
                        for k in r.device["kernels"]]  # fmt: skip
        w = d["wall"].get("median_us")
        d["wall_over_device"] = w / d["device_us"] if w and d["device_us"] else None
    return d


def _table(rows: list[dict]) -> list[str]:
    out = [
        (
            "| config | backend | record | step | wall median us (p10-p90) | device us | ours us | wall / device | "
            "vs SGLang (wall) | back to back us | vs SGLang (back to back) | polled us | vs SGLang (polled) | "
            "synced us | vs SGLang (synced) | ahead us | vs SGLang (ahead) |"
        ),
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    peer = {r["config"]: r["wall"].get("median_us") for r in rows if r["backend"] == "sglang" and r["wall"].get("n")}
    peer_b = {r["config"]: (r.get("wall_back_to_back") or {}).get("median_us") for r in rows if r["backend"] == "sglang"}

    peer_a = {r["config"]: (r.get("wall_ahead") or {}).get("median_us") for r in rows if r["backend"] == "sglang"}
    peer_p = {r["config"]: (r.get("wall_polled") or {}).get("median_us") for r in rows if r["backend"] == "sglang"}
    peer_s = {r["config"]: (r.get("wall_synced") or {}).get("median_us") for r in rows if r["backend"] == "sglang"}

    def b2b(r, key="wall_back_to_back", peers=peer_b):
        m, ref = (r.get(key) or {}).get("median_us"), peers.get(r["config"])
        if not m:
            return " - | - |"
        return f" {m:.0f} | " + (f"{ref / m:.2f}x |" if ref and r["backend"] != "sglang" else " |")

    for r in rows:
        w = r["wall"]
        if not w.get("n"):
            out.append(f"| {r['config']} | {r['backend']} | {r['record']} | {r['kind']} | failed: {r['failed']} "
                       "| | | | | | | | | | | | |")
            continue
        ref = peer.get(r["config"])
        vs = f"{ref / w['median_us']:.2f}x" if ref and r["backend"] != "sglang" else ""
        dev, busy = r.get("device_us"), r.get("device_busy_us")
        devs = f"{dev:.0f} (busy {busy:.0f})" if dev and busy and busy < 0.98 * dev else f"{dev or 0:.0f}"
        out.append(
            f"| {r['config']} | {r['backend']} | {r['record']} | {r['kind']} | {w['median_us']:.0f} "
            f"({w['p10_us']:.0f}-{w['p90_us']:.0f}) | {devs} | {r.get('our_kernels_us', 0):.0f} | "
            f"{r.get('wall_over_device') or 0:.2f} | {vs} |"
            if dev
            else f"| {r['config']} | {r['backend']} | {r['record']} | {r['kind']} | {w['median_us']:.0f} "
            f"({w['p10_us']:.0f}-{w['p90_us']:.0f}) | - | - | - | {vs} |"
        )
        out[-1] += b2b(r) + b2b(r, "wall_polled", peer_p) + b2b(r, "wall_synced", peer_s)
        out[-1] += b2b(r, "wall_ahead", peer_a)
    return out


def write_report(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str))
    lines = [f"# Speculative step, {result['env']['device']}", "", f"Command: `{result['command']}`", ""]
    lines += _table(result["rows"])
    lines += ["", "## Kernels that are not ours, per step (from the profiler trace)", ""]
    for r in result["rows"]:
        others = r.get("other_kernels") or []
        if r["backend"] == "sglang" or not others:
            continue
        total = sum(k["us"] for k in others)
        lines.append(f"- {r['config']} {r['backend']} {r['record']} {r['kind']}: {total:.0f} us in "
                     + ", ".join(f"{k['name'][:60]} x{k['launches']:.0f} ({k['us']:.0f} us)" for k in others[:6]))  # fmt: skip
    (out / "results.md").write_text("\n".join(lines) + "\n")
    try:
        _plot(result, out / "results.png")
    except ImportError as e:
        print(f"no plot ({e})")


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gdn_lossless_jax.tools import viz

    fig = viz.plot_step(result)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.step", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for results.json, results.md and results.png")
    p.add_argument("--mode", choices=tuple(bc.MODES), default="h200")
    p.add_argument("--configs", default="25x4,8x16")
    p.add_argument("--families", default="model",
                   help=f"comma list of {bc.FAMILIES}: the mode's model (GDN) and/or a released family's linear "
                        "layers (kimi_linear: KDA), each its own rows")  # fmt: skip
    p.add_argument("--backends", default="pallas")
    p.add_argument("--records", default=",".join(RECORDS))
    p.add_argument("--kinds", default=",".join(STEP_KINDS),
                   help=f"which steps ({', '.join(STEP_KINDS + OLD_KINDS + MESH_KINDS)}; the last four only when named)")
    p.add_argument("--mesh", default="1x1", help="TPxDP: the mesh of the *-mesh steps (default 1x1, one device)")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device-invocations", type=int, default=3)
    p.add_argument("--b2b-calls", type=int, default=20, help="calls of each row back to back after the rounds (0: none)")
    p.add_argument("--budget-s", type=float, default=60.0, help="seconds of timed rounds per configuration")
    p.add_argument("--peer", choices=("auto", "off"), default="auto")
    p.add_argument("--sglang-src", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--index-sets", type=int, default=4,
                   help="index sets on the device that the steps take in turn (1: the same arrays every step)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    mode = bc.MODES[args.mode]
    clock = Clock()
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in kinds if k not in STEP_KINDS + OLD_KINDS + MESH_KINDS]
    if unknown:
        raise SystemExit(f"--kinds: unknown step kinds {unknown}; choose from {STEP_KINDS + OLD_KINDS + MESH_KINDS}")
    plan = parse_mesh(args.mesh) if any(k in MESH_KINDS for k in kinds) else None
    result = {
        "command": "python -m benchmarks.step " + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
        "env": {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
                "xla_flags": os.environ.get("XLA_FLAGS", ""), "mesh": args.mesh if plan else None,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},  # fmt: skip
        "rows": [],
    }
    out = Path(args.out)
    configs = bc.parse_configs(args.configs, mode.configs)
    if plan is not None and plan.dp > 1:
        odd = [c.label for c in configs if c.requests % plan.dp]
        if odd:
            raise SystemExit(f"--mesh {args.mesh} splits the requests {plan.dp} ways: --configs {odd} have a request "
                             f"count that is not a multiple of {plan.dp}")  # fmt: skip
    families = [f for f in args.families.split(",") if f]
    if not families or any(f not in bc.FAMILIES for f in families):
        raise SystemExit(f"--families: expected a comma list of {bc.FAMILIES}, got {args.families!r}")
    for cfg in configs:
        rows: list[Row] = []
        for family in families:  # each family's layers, rows labelled "25x4 kimi_linear" beside "25x4"
            inp = make_inputs(cfg, bc.family_geometry(mode, family), seed=args.seed, index_sets=args.index_sets,
                              family=family)  # fmt: skip
            for backend in [b for b in args.backends.split(",") if b]:
                for record in [r for r in args.records.split(",") if r]:
                    rows += step_rows(inp, backend, record, clock, args.seed, kinds, plan)
            if family == "model":
                model_inp = inp
        if args.peer != "off" and "model" in families:  # SGLang's step: its GDN kernels, the model's layers
            inp = model_inp
            row, why = sglang_row(inp, clock, args.sglang_src)
            if row is None:
                clock.log(f"{cfg.label}: no SGLang step ({why})")
            else:
                rows.append(row)
        run_rounds(rows, trials=args.rounds, min_trials=min(8, args.rounds), seed=args.seed, clock=clock,
                   label=cfg.label, warmup=args.warmup, deadline=time.perf_counter() + args.budget_s)  # fmt: skip
        b2b = back_to_back(rows, args.b2b_calls)
        polled = back_to_back(rows, args.b2b_calls, wait="poll")
        synced, dispatched = {}, {}  # the driver's wait: GPUs only (gdn_lossless_jax.sync.synchronize)
        if jax.devices()[0].platform == "gpu":
            try:
                synced = back_to_back(rows, args.b2b_calls, wait="sync", dispatch=dispatched)
            except RuntimeError as e:  # the driver refused: the other columns stand
                clock.log(f"{cfg.label}: no synced column ({e})")
        ahead = run_ahead(rows, args.b2b_calls)
        if args.device_invocations:
            device_pass(rows, invocations=args.device_invocations, clock=clock, label=cfg.label)
        done = [_row_dict(r, b2b.get(r.key), ahead.get(r.key), polled.get(r.key), synced.get(r.key),
                          dispatched.get(r.key)) for r in rows]  # fmt: skip
        for r, d in zip(rows, done):  # what the synced calls spent before the GPU could start: the dispatch
            if r.key in dispatched:
                clock.log(f"{cfg.label} {r.key}: synced {d['wall_synced']['median_us']:.0f} us a call, its dispatch "
                          f"returned after {d['synced_dispatch']['median_us']:.0f}")  # fmt: skip
        result["rows"] += done
        write_report(result, out)
        del rows, inp
    print("\n".join(_table(result["rows"])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
