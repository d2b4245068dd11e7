"""The commit fused into the next verify (``gdn_lossless_jax.commit_and_verify``), bit for bit.

A decode of several steps run two ways on the same inputs: separately (``verify`` of every
layer from the pool, then ``commit``) and fused (``commit_and_verify`` applying the previous
step's commit inside each layer's verify, the last one flushed with ``commit``). The pool after
every step's commit, the outputs and the tapes must be identical, and identical to the snapshot
path's pool. The sequence has track crossings, a padding slot, requests that join and leave
between steps, D changing between steps, both record modes of the previous step, fp32 and bf16
pools. Controls, each wrong by construction: a twice-rounded or other-product replay inside the fused kernel,
and the track state replayed after the accepted state was written in place (the Pallas kernel's test switches), and
the Mosaic GPU kernel's update rounded twice (its ``form="twice_rounded"``), must be caught.
"""

import dataclasses
import importlib.util
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdn_lossless_jax as gl
from conftest import FULL_TESTS, ON_GPU, full_only
from gdn_lossless_jax import api
from gdn_lossless_jax.backends.pallas.verify import PENDING_REPLAYS, VerifyConfig
from gdn_lossless_jax.testing.cases import Shape, verify_inputs
from gdn_lossless_jax.testing import assert_bitwise_differs, assert_bitwise_equal, backend_verify
from gdn_lossless_jax import backends, checks
from gdn_lossless_jax.backends.contract import PendingCommit, run_verify

F32, BF16 = jnp.float32, jnp.bfloat16
BACKENDS = ["reference", "pallas"] + (["triton"] if ON_GPU and importlib.util.find_spec("jax_triton") else [])
BACKENDS += ["mosaic"]  # Mosaic GPU: on a CPU its interpret mode (a sample of the cases, _interpret_sample)
K_ = 128 if ON_GPU else 16
H, HV, L = 2, 4, 2
S, R, DMAX = 12, 7, 4


@dataclasses.dataclass
class Step:
    slots: np.ndarray  # [N] this step's requests
    rows: np.ndarray  # their tape rows
    D: int
    accept: np.ndarray  # [N] accepted step (what the sampler decided), -1: nothing
    track_slots: np.ndarray
    track_steps: np.ndarray
    inputs: list  # per layer: q, k, v, a, b


# (slots, D) of each step: 4 requests, then one leaves and one joins (D 3 -> 2), then one more joins
# (D 4). Slot S + 2: padding, reads zeros.
PLAN = [([0, 3, 5, 7], 3), ([3, 5, 7, 9], 2), ([9, 3, 5, 7, S + 2], 4)]
# Interpret mode (the Pallas kernels on a CPU) compiles each step's shape anew, seconds a kernel:
# two shapes there. D still shrinks and grows again (to the buffers' DMAX), requests leave and
# join at each step, a padding slot joins; only the batch does not grow (N = 4 throughout).
SHORT_PLAN = [([0, 3, 5, 7], 4), ([3, 5, 7, 9], 2), ([9, 3, 5, S + 2], 4)]


def _plan(backend: str) -> list:
    return SHORT_PLAN if backend in ("pallas", "mosaic") and not ON_GPU else PLAN


def _steps(seed: int, plan=PLAN) -> list[Step]:
    """Three steps of ``plan``. Request 1 crosses a track boundary at or before its accepted
    step, request 2 after it."""
    rng = np.random.default_rng(seed)
    steps = []
    for slots, D in plan:
        N = len(slots)
        rows = rng.permutation(R)[:N].astype(np.int32)
        accept = rng.integers(-1, D, N).astype(np.int32)
        accept[0] = D - 1
        track_slots = np.full(N, -1, np.int32)
        track_steps = np.full(N, -1, np.int32)
        track_slots[1], track_steps[1] = 10 + len(steps) % 2, rng.integers(0, D)  # a crossing into a spare slot
        accept[1] = max(accept[1], track_steps[1])
        # a track step after the accepted one (or with nothing accepted): the replay goes past the accepted state
        track_slots[2], track_steps[2] = 8 - 2 * (len(steps) % 2), rng.integers(1, D)
        accept[2] = rng.integers(-1, track_steps[2])
        shape = Shape(N=N, D=D, H=H, HV=HV, K=K_, V=K_)
        inputs = [{k: v for k, v in verify_inputs(rng, shape, kind="mixed").items() if k != "state0"} for _ in range(L)]
        steps.append(Step(np.asarray(slots, np.int32), rows, D, accept, track_slots, track_steps, inputs))
    return steps


def _buffer(record, dtype):
    if record == "snapshots":
        return gl.Snapshots(jnp.zeros((L, R, DMAX, HV, K_, K_), dtype))
    return gl.Tuples(u=jnp.zeros((L, R, DMAX, HV, K_)), k=jnp.zeros((L, R, DMAX, H, K_)), g=jnp.zeros((L, R, DMAX, HV)))


def _commit_args(st: Step):
    return st.slots, st.accept, st.track_slots, st.track_steps, st.rows


def separate(pool, steps, records, backend, config=None):
    """verify every layer from the pool, then commit; the pool after every step and all outputs.
    ``config``: the backend's verify kernel called with that launch (:func:`_backend_call`)."""
    pools, outs, tapes = [], [], []
    for st, record in zip(steps, records):
        buf = _buffer(record, pool.dtype)
        for layer in range(L):
            if config is None:
                o, buf = gl.verify(pool, **st.inputs[layer], slots=st.slots, layer=layer, tape=buf, rows=st.rows,
                                   backend=backend)  # fmt: skip
            else:
                o, buf = _backend_call(backend, pool, None, st, st.inputs[layer], layer, buf, config=config)
            outs.append(o)
        tapes.append(buf)
        pool = gl.commit(pool, buf, *_commit_args(st), backend=backend)
        pools.append(pool)
    return pools, outs, tapes


def _pending_for(prev: Step | None, tape, st: Step) -> gl.Pending:
    """The previous step's commit, aligned to this step's requests by slot."""
    N = len(st.slots)
    if prev is None:
        return gl.Pending.none(tape, N)
    where = {int(s): i for i, s in enumerate(prev.slots)}
    idx = np.array([where.get(int(s), -1) for s in st.slots])
    pick = lambda a: np.where(idx >= 0, a[np.maximum(idx, 0)], -1).astype(np.int32)  # noqa: E731
    return gl.Pending(tape, pick(prev.rows), pick(prev.accept), pick(prev.track_slots), pick(prev.track_steps))


def _left(prev: Step, st: Step):
    """The previous step's commit arguments of the requests that left (not in this step)."""
    gone = ~np.isin(prev.slots, st.slots)
    return tuple(a[gone] for a in _commit_args(prev))


def fused(pool, steps, records, backend, control=None, stacked=False, config=None, flush=True, broken_from=0):
    """commit_and_verify for every layer (the previous step's commit inside); requests that left
    are committed before the step, and the last step is flushed with commit (``flush=False``: not,
    for a control that reads only the first pool). Returns the pool after each step's commit has
    been applied (before the next verify's), and all outputs.
    ``stacked``: each step's inputs stacked over the layers, read at the layer by the kernels.
    ``control`` or ``config``: the backend's kernel called with them (:func:`_backend_call`), from
    step ``broken_from`` on (the steps before it: the default kernel's, whose compiled programs the
    unbroken run left)."""
    pools, outs, tapes = [], [], []
    prev, prev_tape = None, None
    for i, (st, record) in enumerate(zip(steps, records)):
        if prev is not None:
            left = _left(prev, st)
            if len(left[0]):
                pool = gl.commit(pool, prev_tape, *left, backend=backend)
        buf = _buffer(record, pool.dtype)
        pending = _pending_for(prev, prev_tape if prev_tape is not None else _buffer("tuples", pool.dtype), st)
        stacks = {k: jnp.stack([x[k] for x in st.inputs]) for k in st.inputs[0]}
        for layer in range(L):
            x = stacks if stacked else st.inputs[layer]
            if (control is None and config is None) or i < broken_from:
                o, buf, pool = gl.commit_and_verify(pool, pending, **x, slots=st.slots, layer=layer, tape=buf,
                                                    rows=st.rows, backend=backend)  # fmt: skip
            else:
                o, buf, pool = _backend_call(backend, pool, pending, st, x, layer, buf, control, config)
            outs.append(o)
        if prev is not None:
            pools.append(pool)  # holds the previous step's commit of every layer now
        prev, prev_tape = st, buf
        tapes.append(buf)
    if flush:
        pools.append(gl.commit(pool, prev_tape, *_commit_args(prev), backend=backend))
    return pools, outs, tapes


def _backend_call(backend, pool, pending, st, x, layer, buf, control=None, config=None):
    """The backend's kernel as commit_and_verify calls it on the inputs ``x``, with a control
    switch (broken on purpose; Pallas only) or a launch configuration (its ``VerifyConfig``)."""
    call = checks.verify_args("control", pool, **x, slots=st.slots, layer=layer, tape=buf, rows=st.rows)
    extra = {} if config is None else {"config": config}
    if control is not None:
        extra["pending_control"] = control
    if pending is not None:
        idx = [checks.as_index(getattr(pending, n)) for n in ("rows", "steps", "track_slots", "track_steps")]
        call = call.replace(pending=PendingCommit(pending.tape, checks.as_index(layer), *idx))
    return run_verify(backends.resolve(backend, "verify"), call, **extra)


def _pool(seed, dtype):
    rng = np.random.default_rng(seed + 1)
    return jnp.asarray(0.5 * rng.standard_normal((L, S, HV, K_, K_), np.float32)).astype(dtype)


def _interpret_sample(backend, keep: bool):
    """Mosaic GPU's interpret mode takes ~1 s a call on the CPU: CI runs a sample of its cases."""
    return full_only if backend == "mosaic" and not ON_GPU and not keep else ()


def _cpu_diagonal(backend, dt_id, r_id):
    """On the CPU (the suite's time, docs/testing.md) Pallas runs fp32 with tuples and bf16 mixed, the
    reference the other two (Pallas' bf16 tuples: ``test_other_launches_of_the_fused_pallas_kernel``);
    Mosaic GPU none (its fused decode with tuples runs in its control test below)."""
    if ON_GPU:
        return ()
    if backend == "mosaic":
        return _interpret_sample(backend, False)
    keep = {"pallas": {("f32", "tuples"), ("bf16", "mixed")}, "reference": {("bf16", "tuples"), ("f32", "mixed")}}
    return () if (dt_id, r_id) in keep[backend] else full_only


@pytest.mark.parametrize("backend,records,dtype", [
    pytest.param(b, r, dt, id=f"{dt_id}-{r_id}-{b}", marks=_cpu_diagonal(b, dt_id, r_id))
    for dt, dt_id in ((F32, "f32"), (BF16, "bf16"))
    for r, r_id in ((("tuples",) * 3, "tuples"), (("snapshots", "tuples", "snapshots"), "mixed"))
    for b in BACKENDS
])  # fmt: skip
def test_fused_steps_equal_separate_steps(backend, records, dtype, seed):
    steps = _steps(seed, _plan(backend))
    pool = _pool(seed, dtype)
    want_pools, want_outs, want_tapes = separate(pool, steps, records, backend)
    got_pools, got_outs, got_tapes = fused(pool, steps, records, backend)
    assert_bitwise_equal(want_outs, got_outs, "outputs of every step and layer")
    assert_bitwise_equal(want_tapes, got_tapes, "every step's tape")
    assert_bitwise_equal(want_pools, got_pools, "the pool after every step's commit")
    # The snapshot path gives the same pools.
    snap_pools, _, _ = separate(pool, steps, ("snapshots",) * 3, backend)
    assert_bitwise_equal(snap_pools[-1], got_pools[-1], "the final pool against the snapshot path")
    # Something was committed, and the slots nobody addresses kept their bits.
    touched = set()
    for st in steps:
        touched |= {int(s) for s in st.slots} | {int(s) for s in st.track_slots if s >= 0}
    untouched = [s for s in range(S) if s not in touched]
    assert_bitwise_equal(pool[:, untouched], got_pools[-1][:, untouched], "untouched slots")
    assert_bitwise_differs(pool[:, list(steps[0].slots)], got_pools[-1][:, list(steps[0].slots)], "committed slots")


@pytest.mark.parametrize("backend", [pytest.param(b, marks=_interpret_sample(b, False)) for b in BACKENDS])
def test_fused_steps_read_inputs_stacked_over_layers(backend, seed):
    """The same decode with each step's inputs stacked over layers (``[L, ...]``, read at the
    layer by the kernels) gives the same bits."""
    steps, records = _steps(seed, _plan(backend)), ("snapshots", "tuples", "snapshots")
    pool = _pool(seed, F32)
    want = fused(pool, steps, records, backend)
    got = fused(pool, steps, records, backend, stacked=True)
    assert_bitwise_equal(want, got, "pools, outputs and tapes with stacked inputs")


_OTHER_LAUNCHES = [{"pending_replay": m} for m in PENDING_REPLAYS if m != VerifyConfig().pending_replay] + [
    {"pending_slice_v": not VerifyConfig().pending_slice_v}]


def _launch_id(fields, dtype):
    return ",".join(f"{k}={v}" for k, v in fields.items()) + f"-{jnp.dtype(dtype).name}"


# (On the CPU the rows replay with a bf16 pool, which reads the pool back rounded; with fp32 too with GDN_FULL_TESTS=1.)
@pytest.mark.parametrize("fields,dtype", [
    pytest.param(f, dt, id=_launch_id(f, dt),
                 marks=full_only if (f, dt) == ({"pending_replay": "rows"}, F32) and not ON_GPU else ())
    for f, dt in [(f, F32) for f in _OTHER_LAUNCHES] + [({"pending_replay": "rows"}, BF16)]
])  # fmt: skip
def test_other_launches_of_the_fused_pallas_kernel(fields, dtype, seed):
    """The Pallas fused kernel's other launches (``VerifyConfig.pending_replay``, ``pending_slice_v``)
    give the separate path's bits: pools, outputs and tapes, fp32 pools (and a bf16 one for the
    replay that reads the pool back), both record modes of the previous step, the inputs stacked
    over layers (read at the layer, or ``v`` sliced by XLA)."""
    steps, records = _steps(seed, _plan("pallas")), ("snapshots", "tuples", "tuples")
    pool = _pool(seed, dtype)
    want = separate(pool, steps, records, "pallas")
    got = fused(pool, steps, records, "pallas", stacked=True, config=VerifyConfig(**fields))
    assert_bitwise_equal(want, got, f"pools, outputs and tapes with VerifyConfig({fields})")


def test_tuned_launches_apply_to_verify_and_the_fused_kernel_alike(monkeypatch, seed):
    """With no ``config`` the Pallas backend launches :func:`tuned_config` of the shape (its ``TUNED``
    table, which can change the outputs' low bits): with an entry for the decode's first and last
    steps' shapes and none for the middle step's, the verify and the fused kernel of each shape take
    the same launch (a tuned fused kernel applying an untuned step's commit and the reverse), so the
    fused steps still equal the separate ones bit for bit."""
    pv = sys.modules[VerifyConfig.__module__]  # the module (the package's `verify` is its function)
    assert pv.tuned_config(25, 4, F32) == VerifyConfig(pending_replay="rows", dot_fma="u")  # the H200's entry
    assert pv.tuned_config(25, 4, BF16) == VerifyConfig() == pv.tuned_config(8, 16, F32)
    entry = {"pending_replay": "rows", "dot_fma": "u"}
    plan = _plan("pallas")
    (first, middle, last) = ((len(slots), D) for slots, D in plan)
    assert middle not in (first, last)
    for shape in (first, last):
        monkeypatch.setitem(pv.TUNED, (*shape, "float32"), entry)
    seen, tuned = [], pv.tuned_config

    def spy(N, D, dtype):  # records which entry each trace took
        seen.append((N, D, pv.TUNED.get((N, D, jnp.dtype(dtype).name))))
        return tuned(N, D, dtype)

    monkeypatch.setattr(pv, "tuned_config", spy)
    # Earlier tests' traces of the same shapes hold the launch they resolved, and this test's traces
    # hold the tuned one: the kernel's caches are cleared before and after (only its: jax.clear_caches()
    # would make every later test in this worker compile everything again).
    pv.verify.clear_cache()
    try:
        steps, records = _steps(seed, plan), ("tuples",) * 3
        pool = _pool(seed, F32)
        want = separate(pool, steps, records, "pallas")
        got = fused(pool, steps, records, "pallas")
    finally:
        pv.verify.clear_cache()
    assert_bitwise_equal(want, got, "pools, outputs and tapes with tuned launches at the first and last steps")
    assert {(*first, entry["pending_replay"]), (*last, entry["pending_replay"]), (*middle, None)} <= {
        (n, d, e and e["pending_replay"]) for n, d, e in seen}, seen


def _triton_other_launches():
    from gdn_lossless_jax.backends.triton.verify import PENDING_REPLAYS, VerifyConfig as TritonConfig

    default = TritonConfig()
    return [{"prefetch_pending": not default.prefetch_pending}, {"chain": "rows"}, {"chain": "rows", "unroll": False},
            {"chain": "rows", "unroll": True, "block_v": 16}] + [
        {"chain": "chunks", "pending_replay": m} for m in PENDING_REPLAYS]


@pytest.mark.skipif("triton" not in BACKENDS, reason="the Triton backend needs a GPU, triton and jax-triton")
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("fields", _triton_other_launches(), ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_other_launches_of_the_fused_triton_kernel(fields, dtype, seed, monkeypatch):
    """The Triton fused kernel's other launches (``VerifyConfig.prefetch_pending`` switched from
    its default, the rows chain at every D, unrolled or not, each ``pending_replay`` of the chunk chain) give the
    separate path's bits with the same launch: pools, outputs and tapes, both record modes of
    the previous step."""
    from gdn_lossless_jax.backends import triton as gt

    steps, records = _steps(seed), ("snapshots", "tuples", "tuples")
    pool = _pool(seed, dtype)
    config = gt.VerifyConfig(**fields)
    # the separate path's verify takes the same launch (the chain's layout changes u's and the outputs' low bits)
    monkeypatch.setitem(gt.verify.__kwdefaults__, "config", config)
    jax.clear_caches()  # traces of earlier tests hold the default launch
    try:
        want = separate(pool, steps, records, "triton")
        got = fused(pool, steps, records, "triton", config=config)
    finally:
        jax.clear_caches()
    assert_bitwise_equal(want, got, f"pools, outputs and tapes with VerifyConfig({fields})")


# On the CPU (the suite's time) each control runs in one replay: a wrong form enters both replays through the one
# update function they share, and the track state replayed after the write runs the same loop whatever the replay
# (the rest with GDN_FULL_TESTS=1).
CONTROL_CASES_CPU = {("twice_rounded", "split"), ("other_product", "rows"), ("track_after_write", "split")}


@pytest.mark.parametrize("control,replay", [
    pytest.param(c, r, id=f"{c}-{r}", marks=() if ON_GPU or (c, r) in CONTROL_CASES_CPU else full_only)
    for r in ("split", "rows") for c in ("twice_rounded", "other_product", "track_after_write")
])  # fmt: skip
def test_controls_in_the_fused_kernel_are_caught(control, replay, seed):
    """The Pallas fused kernel's default replay and its ``"rows"`` replay (``VerifyConfig.pending_replay``)
    broken on purpose: the wrong replay forms (wrong by construction), and the track state replayed after the accepted state's write."""
    steps = _steps(seed, _plan("pallas"))
    pool = _pool(seed, F32)  # fp32: a bf16 pool rounds a 1-ULP drift away almost always
    records = ("tuples",) * 3
    want_pools, _, _ = separate(pool, steps, records, "pallas")
    got_pools, _, _ = fused(pool, steps, records, "pallas", control=control,
                            config=VerifyConfig(pending_replay=replay))  # fmt: skip
    assert_bitwise_differs(want_pools, got_pools, f"the {control} control ({replay} replay)")


@pytest.mark.parametrize("dtype", [F32, pytest.param(BF16, marks=() if ON_GPU else full_only)], ids=["f32", "bf16"])
def test_mosaic_fused_kernel_controls_are_caught(dtype, seed):
    """The Mosaic GPU fused kernel broken on purpose: the update rounded twice (``form="twice_rounded"``),
    and the track state replayed from the accepted state it has just written in place
    (``control="track_after_write"``), in the second step, whose verify replays the first step's pending
    commit (the first step: the default kernel's, compiled for the unbroken run). The pools must differ
    from the separate steps' (the twice-rounded form's in every committed slot, the ordering's in the
    track slots). With a
    bf16 pool only the ordering: the twice-rounded form's 1-ULP drift in fp32 rounds away in bf16 (seen on
    the H200: no bit differed). First the kernel unbroken: the fused steps equal the separate
    ones, bit for bit (CI's CPU run of the Mosaic GPU fused decode, in interpret mode). On the CPU the ordering control with GDN_FULL_TESTS=1 only (interpret mode's time; the
    Pallas kernel's runs in CI)."""
    from gdn_lossless_jax.backends.mosaic import VerifyConfig as MosaicConfig

    steps = _steps(seed, _plan("mosaic")[:2])
    pool = _pool(seed, dtype)
    records = ("tuples",) * 2
    # The backend's own separate steps (on the CPU in interpret mode, whose prologue sums K in XLA:CPU's
    # order, not the reference's fixed one: the reference's bits may differ there).
    want = separate(pool, steps, records, "mosaic")
    assert_bitwise_equal(want, fused(pool, steps, records, "mosaic"), "pools, outputs and tapes, fused and separate")
    want_pools = want[0]
    controls = [(MosaicConfig(form="twice_rounded"), "the twice-rounded form")] if dtype == F32 else []
    if ON_GPU or FULL_TESTS:  # (CI's CPU run: the Pallas fused kernel's ordering control runs there)
        controls.append((MosaicConfig(control="track_after_write"), "the track state taken after the write"))
    for config, what in controls:
        got_pools, _, _ = fused(pool, steps, records, "mosaic", config=config, flush=False, broken_from=1)
        assert_bitwise_differs(want_pools[0], got_pools[0], f"{what} (the pool the fused replay wrote)")
    if ON_GPU or FULL_TESTS:  # the ordering's track slot: step 0's request 1 crossed at or before its accepted step
        tslot = int(steps[0].track_slots[1])
        assert_bitwise_differs(want_pools[0][:, tslot], got_pools[0][:, tslot], "the track slot (track after the write)")


_MOSAIC_LAUNCHES = [
    # interpret mode: ~45 s a case on the CPU, GDN_FULL_TESTS=1 runs them (the GPU run does)
    pytest.param(f, id=i, marks=() if ON_GPU else full_only)
    for f, i in [({"small_slots": 1}, "single"), ({"replay": "static"}, "static"),
                 ({"ctas": 3, "small_slots": 1}, "ctas3"), ({"outputs": "smem"}, "outputs-smem"),
                 ({"auto_barriers": True}, "auto-barriers"), ({"prefetch_next_layer": False}, "no-prefetch")]
]  # fmt: skip


@pytest.mark.parametrize("fields", _MOSAIC_LAUNCHES)
def test_other_launches_of_the_mosaic_kernel(fields, seed):
    """The Mosaic GPU fused kernel's other launches (``mosaic.VerifyConfig``: the inputs
    single-buffered, the replay unrolled, three CTAs an SM, the outputs staged in shared memory,
    Pallas' automatic barriers kept, no prefetch of the next layer) give the default launch's pools,
    outputs and tapes, bit for bit, over steps with a pending commit."""
    from gdn_lossless_jax.backends.mosaic import VerifyConfig as MosaicConfig

    steps = _steps(seed, _plan("mosaic")[:2])
    pool = _pool(seed, F32)
    records = ("tuples", "tuples")
    want = fused(pool, steps, records, "mosaic")
    got = fused(pool, steps, records, "mosaic", config=MosaicConfig(**fields))
    assert_bitwise_equal(want, got, f"pools, outputs and tapes with mosaic VerifyConfig({fields})")


def test_mosaic_gram_verify_keeps_the_tape_exact(seed):
    """``mosaic.VerifyConfig(verify="gram")``: the D steps in the Gram form. Its ``u`` differs from
    the chain's (the option is taken), its outputs are the same bits with either record mode and
    within fp32 rounding of the reference's, and the replay of its tuples gives its snapshots at
    every step, bit for bit. Control: the twice-rounded update form's snapshots differ from that replay."""
    from gdn_lossless_jax.backends import mosaic
    from gdn_lossless_jax.backends.mosaic import VerifyConfig as MosaicConfig

    shape = Shape(N=2, D=3, H=2, HV=4, K=K_, V=K_)
    x = verify_inputs(seed, shape, kind="normal")
    kw = dict(scale=shape.K**-0.5, out_dtype=jnp.float32)
    gram = MosaicConfig(verify="gram")
    (o_t, tup), (o_s, snp) = (backend_verify(mosaic, **x, record=r, config=gram, **kw) for r in ("tuples", "snapshots"))
    _, chain = backend_verify(mosaic, **x, record="tuples", config=MosaicConfig(), **kw)
    assert_bitwise_differs(chain.u, tup.u, "u of the chain and of the Gram form")
    assert_bitwise_equal(o_t, o_s, "outputs with tuples and with snapshots")
    ref = np.asarray(gl.verify(**x, backend="reference", out_dtype=jnp.float32)[0])
    assert np.abs(np.asarray(o_t) - ref).max() <= 1e-5 * np.abs(ref).max()
    replays = jnp.stack([gl.replay(x["state0"], tup, jnp.full((shape.N,), t, jnp.int32), backend="reference")
                         for t in range(shape.D)], axis=1)  # fmt: skip
    assert_bitwise_equal(snp.states, replays, "the snapshots against the replay of the tuples")
    _, wrong = backend_verify(mosaic, **x, record="snapshots", config=MosaicConfig(verify="gram", form="twice_rounded"),
                              **kw)  # fmt: skip
    assert_bitwise_differs(wrong.states, replays, "the twice-rounded form's snapshots")


@pytest.mark.parametrize("dtype", [pytest.param(d, marks=() if ON_GPU else full_only) for d in (F32, BF16)],
                         ids=["f32", "bf16"])  # fmt: skip
def test_mosaic_gram_fused_steps_equal_separate_steps(dtype, seed):
    """The fused decode with the Gram verify (a pending tuple commit replayed, then the Gram
    form from the accepted state) equals the separate steps with the same verify, bit for bit:
    pools, outputs and tapes; with snapshot steps between, and against the snapshot path."""
    from gdn_lossless_jax.backends.mosaic import VerifyConfig as MosaicConfig

    gram = MosaicConfig(verify="gram")
    steps = _steps(seed, _plan("mosaic"))
    pool = _pool(seed, dtype)
    records = ("tuples", "snapshots", "tuples")
    want = separate(pool, steps, records, "mosaic", config=gram)
    assert_bitwise_equal(want, fused(pool, steps, records, "mosaic", config=gram), "pools, outputs and tapes")
    snap_pools, _, _ = separate(pool, steps, ("snapshots",) * 3, "mosaic", config=gram)
    assert_bitwise_equal(snap_pools[-1], want[0][-1], "the final pool against the snapshot path")


def test_fused_errors_name_the_argument():
    st = _steps(0)[0]
    pool = _pool(0, F32)
    tape = _buffer("tuples", F32)
    with pytest.raises(ValueError, match="argument 'slots' is required"):
        gl.commit_and_verify(pool, gl.Pending.none(tape, 4), **st.inputs[0], slots=None, layer=0)
    with pytest.raises(TypeError, match="'pending' must be a gdn_lossless_jax.Pending"):
        gl.commit_and_verify(pool, tape, **st.inputs[0], slots=st.slots, layer=0)
    bad = gl.Pending.none(jax.tree.map(lambda x: x[:1], tape), 4)
    with pytest.raises(ValueError, match="the pending tape has L=1 layers, the pool 2"):
        gl.commit_and_verify(pool, bad, **st.inputs[0], slots=st.slots, layer=0)
    with pytest.raises(ValueError, match=r"'pending.steps' must have shape \[N\] = \[4\]"):
        gl.commit_and_verify(pool, dataclasses.replace(gl.Pending.none(tape, 4), steps=np.zeros(3, np.int32)),
                             **st.inputs[0], slots=st.slots, layer=0)  # fmt: skip


# ---------------------------------------------------------------------------------------
# The pool module: a pool that defers its commit to the next verify, and flush
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("record,backend", [
    # (interpret mode: the Pallas cases with GDN_FULL_TESTS=1; its fused kernel runs in
    # test_fused_steps_equal_separate_steps, the pool's wiring in the reference's cases; on the CPU
    # the reference's snapshots with GDN_FULL_TESTS=1 too: a snapshot pending commit runs in the fused
    # decodes' mixed records)
    pytest.param(record, backend, id=f"{record}-{backend}",
                 marks=full_only if (backend in ("pallas", "mosaic") or record == "snapshots") and not ON_GPU else ())
    for backend in BACKENDS for record in gl.RECORD_MODES
])  # fmt: skip
def test_pool_deferred_commit_equals_immediate(backend, record, seed):
    assert_bitwise_equal(*_deferred_vs_immediate(backend, record, seed),
                         "states, conv states and outputs: deferred vs immediate commit")  # fmt: skip


@pytest.mark.parametrize("record", gl.RECORD_MODES)
def test_a_flush_between_steps_applies_nothing_twice(record, seed, monkeypatch):
    """A flush between steps (the engine's, before requests join) applies the pending commit; the
    next verify must not apply it again to the rows that stay. Control (tuples: a replay applied twice
    advances the state twice): a flush that only marks its entries applied (a verify applies the
    entries of the slots it reads whatever their mark)."""
    from gdn_lossless_jax import pool as gpool

    want, got = _deferred_vs_immediate("reference", record, seed, flush_between=True)
    assert_bitwise_equal(want, got, "states and outputs: deferred with flushes between steps vs immediate")
    if record == "snapshots":  # copying a snapshot twice is copying it once: no control to run
        return
    fixed = gpool._flush

    def marks_only(pool, backend):
        done = fixed(pool, backend)
        return dataclasses.replace(done, deferred=dataclasses.replace(done.deferred, steps=pool.deferred.steps,
                                                                       track_steps=pool.deferred.track_steps))

    monkeypatch.setattr(gpool, "_flush", marks_only)
    monkeypatch.setattr(gpool, "_flush_jit", jax.jit(marks_only, donate_argnums=0, static_argnames=("backend",)))
    # The pool's jitted commit calls _flush: its traces only are dropped, before and after (jax.clear_caches()
    # would make every later test in this worker compile everything again).
    gpool._commit.clear_cache()
    try:
        want, got = _deferred_vs_immediate("reference", record, seed, flush_between=True)
    finally:
        gpool._commit.clear_cache()
    assert_bitwise_differs(want[0], got[0], "control: a flush that only marks its entries applied")


def _deferred_vs_immediate(backend, record, seed, flush_between=False):
    """``(immediate, deferred)``: the states, conv states and outputs after three steps of the pool with
    its commit immediate and deferred (``flush_between``: the deferred pool flushed after each step)."""
    from gdn_lossless_jax import pool as gpool
    from test_step import GEOMETRY, _pool_inputs

    g = GEOMETRY
    rng = np.random.default_rng(seed)
    plan = [([0, 3, 5, 7], 3), ([3, 5, 7, 9], 2), ([9, 3, 5, 7], 4)]  # slot 0 leaves after step 1, 9 joins
    if backend in ("pallas", "mosaic") and not ON_GPU:
        # Interpret mode compiles the pool step anew for each D and parity (~10 s each): two D, still changing
        # between steps and reaching the scratch's drafts=4, the third step writing the first one's tape again.
        plan = [(slots, D) for (slots, _), D in zip(plan, (4, 2, 4))]
    pools = {}
    for defer in (False, True):
        p = gpool.allocate(g, slots=12, requests=4, drafts=4, record=record, defer_commit=defer)
        fill = lambda x: jnp.asarray(np.random.default_rng(seed).standard_normal(x.shape, np.float32)).astype(x.dtype)  # noqa: E731
        p = dataclasses.replace(p, ssm=fill(p.ssm), conv=fill(p.conv))
        step_rng = np.random.default_rng(seed + 5)
        outs = []
        for slots, D in plan:
            _, layers, xs = _pool_inputs(int(step_rng.integers(1 << 30)), len(slots), D)
            slots = np.asarray(slots, np.int32)
            rows = step_rng.permutation(p.rows)[: len(slots)].astype(np.int32)
            for layer in range(g.gdn_layers):
                o, p = gpool.verify_layer(p, layer, **xs[layer], **layers[layer], slots=slots, rows=rows, backend=backend)
                outs.append(o)
            accept = step_rng.integers(0, D, len(slots)).astype(np.int32)
            tslots = np.array([10, -1, -1, -1], np.int32)
            tsteps = np.array([int(step_rng.integers(0, accept[0] + 1)), -1, -1, -1], np.int32)
            p = gpool.commit(p, slots, accept, tslots, tsteps, rows, backend=backend)
            if flush_between:
                p = gpool.flush(p, backend=backend)
        p = gpool.flush(p, backend=backend)
        pools[defer] = (p.ssm, p.conv, outs)
    del rng
    return pools[False], pools[True]
