"""Public entry points: :func:`verify`, :func:`replay`, :func:`commit`, :func:`commit_and_verify`.

Each checks its arguments (:mod:`~gdn_lossless_jax.checks`: static shapes and dtypes, before
anything is computed, also under ``jax.jit``), picks the backend, and runs the backend's
implementation with the derivatives of :mod:`~gdn_lossless_jax.autodiff`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from . import _deprecated, autodiff, backends, checked as checked_mode, checks, reference, tree
from .backends.contract import VerifyCall
from .checks import MATH_MODES
from .tape import RECORD_MODES, Pending, Tape, Tuples

__all__ = ["verify", "replay", "commit", "commit_and_verify", "run_verify", "check_tree_backend", "RECORD_MODES",
           "MATH_MODES"]


def verify(
    state0: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    a: jax.Array,
    b: jax.Array,
    A_log: jax.Array,
    dt_bias: jax.Array,
    *,
    record: str | None = None,
    scale: float | None = None,
    backend: str = "auto",
    out_dtype: Any = None,
    slots: jax.Array | None = None,
    layer: Any = None,
    tape: Tape | None = None,
    rows: jax.Array | None = None,
    parents: Any = None,
    topk: int = 1,
    out: jax.Array | None = None,
    checked: bool = False,
    math: str = "platform",
    decay: str | None = None,
    beta_scale: float | None = None,
) -> tuple[jax.Array, Tape]:
    """Run D draft tokens through one GDN (or KDA) layer without touching the state.

    Args:
      state0: the pre-verify states (never modified; float32 or bfloat16, upcast to fp32 on
        load): ``[N, HV, V, K]``, one per request; or, with ``slots``, the state pool itself:
        ``[S, HV, V, K]``, or all layers' ``[L, S, HV, V, K]`` with ``layer``.
      q, k: ``[N, D, H, K]`` (any float dtype; bf16 in models).
      v: ``[N, D, HV, V]``.
      a, b: ``[N, D, HV]``, the raw decay and write-gate inputs.
      A_log, dt_bias: ``[HV]``.
      record: the record mode, by name (:data:`gdn_lossless_jax.RECORD_MODES`) or tape class:
        ``"tuples"`` (the lossless tape, the default) or ``"snapshots"`` (the state after every
        step); with ``tape`` it is the buffer's mode.
      scale: the query scale; ``K ** -0.5`` if None.
      backend: ``"auto"``, ``"reference"``, ``"pallas"`` or ``"triton"``.
      out_dtype: dtype of the outputs; q's dtype if None.
      slots: ``[N]`` int or None: request n's state is ``state0[slots[n]]`` (``state0[layer,
        slots[n]]``), read inside the kernels (SGLang's ``h0_indices``: no gathered copy); a
        slot outside ``[0, S)`` reads zeros, as SGLang's padding slots do.
      layer: an int or a traced int32 scalar: the layer of ``state0`` (with ``slots``), of
        ``tape`` and of the inputs, for whichever has a leading layer axis.
      tape: a preallocated tape to write into, in place when it is donated (``jax.jit(...,
        donate_argnums=...)``): :class:`Tuples` (``u [L?, R, Dmax, HV, V]``, ``k [L?, R, Dmax,
        H, K]``, ``g [L?, R, Dmax, HV]``, fp32) or :class:`Snapshots` (``[L?, R, Dmax, HV, V,
        K]`` in the state dtype), ``Dmax >= D``, the leading ``L`` optional (then ``layer``
        picks it). Request n's steps go to row ``rows[n]``, steps ``[0, D)``; every other
        element keeps its bits, and an out-of-range row writes nothing.
      rows: ``[N]`` int or None (default ``arange(N)``): the tape rows, with ``tape``.
      parents: None (the D drafts are a linear chain), or a draft tree of D nodes
        (:mod:`gdn_lossless_jax.tree`): ``[N, D]`` int (or ``[D]`` for every request),
        ``parents[n, d]`` node d's parent in ``[0, d)`` or -1 for a child of the committed state;
        nodes in topological order. Node d's state is its parent's state stepped by node d's
        inputs with exactly the chain's rounding; outputs and tape are per node (``D`` is the node
        count). Host values are checked here (a parent out of range, the node itself or after
        it raise) and a chain given this way takes the chain's path; traced values are checked
        with ``checked=True``. Trees verify on ``"reference"`` and ``"pallas"`` (each node's
        parent replayed on chip, no state stored a node); ``"triton"`` and ``"mosaic"`` refuse
        them (a linear chain runs everywhere).
      topk: the most children a node may have (checked where the values are); ``topk > 1``
        needs ``parents``.
      out: a preallocated outputs buffer to write into, in place when it is donated:
        ``[L?, N, D, HV, V]`` in ``out_dtype`` (its dtype when ``out_dtype`` is None), the
        leading ``L`` optional (then ``layer`` picks it). The kernels store the outputs at
        ``[layer]`` of it; every other layer keeps its bits. A step that verifies every layer
        of a pool passes one ``[L, N, D, HV, V]`` buffer to all of them, so no copy stacks the
        layers' outputs (in a ``lax.scan``, carry it with the tape).
      checked: check traced ``parents`` values too (:func:`gdn_lossless_jax.tree.checkify_parents`;
        :mod:`gdn_lossless_jax.checked` says how under ``jax.jit``).
      math: ``"platform"`` (the default, the fastest form): the platform's ``exp`` and ``log``
        (:func:`gdn_lossless_jax.rounding.exp`) and its arithmetic outside the pinned rule, so the
        outputs and the tape are the same bits on the platform that computed them.
        ``"portable"``: the gates, norms and decay by :mod:`gdn_lossless_jax.portable`, the sums
        over K by the fixed tree, every operation correctly rounded: the same bits on every
        platform (docs/rounding.md). Commit and replay a portable tape with ``math="portable"``
        too (the decay's ``exp`` must be verify's). Backends: ``"reference"``, and ``"pallas"``
        in interpret mode (the CPU); the others raise
        :class:`~gdn_lossless_jax.backends.BackendUnavailable` for ``"portable"``.
      decay: ``"scalar"`` (GDN, the default: one decay per v-head and step) or ``"channel"`` (KDA,
        :mod:`gdn_lossless_jax.kda`: one decay per key channel; then ``a [N, D, HV, K]`` is the
        forget gate's projection before its bias, ``dt_bias [HV, K]``, and the tuple tape is a
        :class:`~gdn_lossless_jax.tape.KDATuples` with ``g [N, D, HV, K]``: ``record="tuples"``
        picks it). None: from the ``tape`` buffer's class where it tells, else ``"scalar"``.
        Backends: ``"reference"`` (``"auto"`` picks it, draft trees too) and ``"triton"`` (chains,
        on a GPU: verify, commit, replay and the fused step); the others refuse it by name.
      beta_scale: beta's factor, a static float (None: 1.0): OLMo-Hybrid's
        ``linear_allow_neg_eigval`` makes beta ``2 sigmoid(b)`` (``beta_scale=2.0``), applied
        after the sigmoid; the tape is unchanged (``u`` carries beta). Backends: ``"reference"``,
        ``"pallas"`` and ``"mosaic"``; ``"triton"`` refuses it by name.
    Returns:
      ``(outputs [N, D, HV, V], tape)`` (with ``out``, the outputs buffer, updated); the tape
      is :class:`Tuples` (``u [N, D, HV, V]``, ``k [N, D, H, K]``, ``g [N, D, HV]``, fp32) or :class:`Snapshots`
      (``[N, D, HV, V, K]`` in state0's dtype), or, with ``tape``, the updated buffer.
      Outputs are identical in both modes and in every form.

    Any of the inputs may also be stacked over the pool's layers, with one more leading axis of
    the pool's L (``q, k [L, N, D, H, K]``, ``v [L, N, D, HV, V]``, ``a, b [L, N, D, HV]``,
    ``A_log, dt_bias [L, HV]``; with the pool ``[L, S, HV, V, K]``, ``slots`` and ``layer``):
    the kernels read layer ``layer`` of it in place, so a ``lax.scan`` over the layers that
    passes the stacks (the model's stacked weights, say) and its counter slices nothing.

    Arrays may be given as nested lists (converted with ``jnp.asarray``). float64 is
    rejected for every input, state0 and the parameters alike: the computation is fp32
    and would round it silently (cast with ``.astype(jnp.float32)``).

    Under ``jax.jit``, the non-array arguments must be static:
    ``jax.jit(gl.verify, static_argnames=("record", "backend", "scale", "out_dtype", "math"))``
    (JAX rejects a string it would trace), or bind them with ``functools.partial``.

    Differentiable with respect to every floating input (``jax.grad``, ``jax.vjp``,
    ``jax.jvp``, on every backend and in every form): the values are the backend's exact
    ones, the derivatives those of the plain-float formulation of the same math
    (:func:`gdn_lossless_jax.autodiff.plain_verify`; see :mod:`gdn_lossless_jax.autodiff`).
    """
    call = checks.verify_args(
        "verify", state0, q, k, v, a, b, A_log, dt_bias, record=record, scale=scale, out_dtype=out_dtype,
        slots=slots, layer=layer, tape=tape, rows=rows, parents=parents, topk=topk, out=out, math=math, decay=decay,
        beta_scale=beta_scale,
    )  # fmt: skip
    if checked and call.parents is not None:
        tree.checkify_parents("verify", call.parents, topk)
    outputs, new = run_verify(call, backend)
    return _strip(outputs, call.out, out), _strip(new, call.tape, tape)


def run_verify(call: VerifyCall, backend: Any = "auto", fn: str = "verify"):
    """The backend's verify of a checked :class:`~gdn_lossless_jax.backends.contract.VerifyCall`,
    with the derivatives of :mod:`~gdn_lossless_jax.autodiff`: for callers that checked their
    arguments already (the pool). Returns what the backend returns. The call must fit the
    backend's capabilities (:func:`gdn_lossless_jax.backends.check_call`: a draft tree needs
    ``capabilities.trees``, and so on)."""
    needs = backends.call_needs(call.decay, call.beta_scale, backends.call_sizes(call))
    impl = backends.resolve(backend, "verify", call.math, needs)
    backends.check_call(impl, fn, call)
    return autodiff.verify(impl, call)


def check_tree_backend(fn: str, backend: Any, math: str = "platform"):
    """The backend if it verifies draft trees (``capabilities.trees``), else a ``ValueError``
    naming it and the backends that do (``"auto"`` picks one for ``math``)."""
    impl = backends.resolve(backend, "verify", math)
    backends.check_trees(impl, fn)
    return impl


def _strip(new, normal, given):
    """A buffer as the caller gave it: without the layer axis added to a per-layer buffer."""
    if given is not None and normal is not given:
        return jax.tree.map(lambda x: x[0], new)
    return new


def replay(
    state0: jax.Array,
    tuples: Tuples,
    steps: jax.Array,
    *,
    path: jax.Array | None = None,
    parents: Any = None,
    backend: str = "auto",
    checked: bool = False,
    math: str = "platform",
) -> jax.Array:
    """Rebuild the state after draft step ``steps[i]`` from the pre-verify state.

    Args:
      state0: ``[N, HV, V, K]`` float32 or bfloat16 (upcast; the result is rounded back).
      tuples: a :class:`Tuples` tape from :func:`verify` (``u [N, D, HV, V]``,
        ``k [N, D, H, K]``, ``g [N, D, HV]``), or a KDA layer's
        :class:`~gdn_lossless_jax.tape.KDATuples` (``g [N, D, HV, K]``).
      steps: ``[N]`` int, 0-based: the last draft step to apply, *not* an accepted length
        (a request that accepted n drafts has step n - 1). A value outside ``[0, D)`` (a
        negative step) means no step: state0 is returned for that request, so a length
        passed by mistake returns one step too many, or state0 for a fully accepted chain.
      path: for a draft tree's tape, ``[N, P]`` int, each request's root-to-node path (node
        indices, -1 padded): ``steps`` are then positions along it, as in :func:`commit`. Its
        entries up to each step must be nodes of the tape, checked as in :func:`commit`.
      parents: the tree (``[N, D]`` or ``[D]``, as verify took it, aligned to this call's
        requests), optional, with ``path``: used only to check that each path is a root-to-node
        path of it, as in :func:`commit` (without it a path of nodes that is no root-to-node path
        replays a state that is no node's, silently: the tape does not hold the tree).
      backend: as in :func:`verify`.
      checked: raise instead: a step outside ``[-1, D)`` (``[-1, P)`` with a path) names its request
        (:mod:`gdn_lossless_jax.checked`; under ``jax.jit``, functionalize with
        ``jax.experimental.checkify.checkify``); with a path, also the path checks on traced
        values (concrete ones are checked at call time in any mode, see :func:`commit`).
      math: the ``math=`` of the verify that recorded the tape (its decay's ``exp``).
    Returns:
      ``[N, HV, V, K]`` in state0's dtype, bit-identical to verify's snapshot of that step.
      Differentiable with respect to state0 and the tape (see :func:`verify`).
    """
    fn = "replay"
    raw = (path, steps, steps, parents)
    state0, tuples, steps = checks.replay_args(fn, state0, tuples, steps)
    checks.check_math(fn, math)
    sizes = {"K": state0.shape[-1], "V": state0.shape[-2], "HV": state0.shape[-3]}
    needs = backends.call_needs(type(tuples).decays[0], sizes=sizes)
    impl = backends.resolve(backend, "replay", math, lambda c: c.takes(type(tuples)) and needs(c))
    backends.check_math(impl, fn, math)
    backends.check_sizes(impl, fn, sizes)
    _check_record(impl, fn, tuples)
    if path is not None:
        N, D = state0.shape[0], tuples.num_steps
        path = checks.check_path(fn, path, N)
        parents = checks.check_commit_parents(fn, parents, N, D)
        checks.check_path_indices(fn, D, path, steps, steps, parents, checked=checked, raw=raw)
        if checked:
            checked_mode.check_steps(fn, "steps", steps, path.shape[1])
        layered = jax.tree.map(lambda t: t[None], tuples)
        chain, _, steps, _ = _along_path(layered, jnp.arange(N, dtype=jnp.int32), path, steps, steps)
        return autodiff.replay(impl, state0, jax.tree.map(lambda t: t[0], chain), steps, math)
    if parents is not None:
        raise ValueError(f"{fn}: parents= checks a tree's paths: pass path= too")
    if checked:
        checked_mode.check_steps(fn, "steps", steps, tuples.num_steps)
    return autodiff.replay(impl, state0, tuples, steps, math)


def commit(
    pool: jax.Array,
    tape: Tape,
    slots: jax.Array,
    steps: jax.Array,
    track_slots: jax.Array | None = None,
    track_steps: jax.Array | None = None,
    rows: jax.Array | None = None,
    *,
    path: jax.Array | None = None,
    parents: Any = None,
    backend: str = "auto",
    checked: bool = False,
    math: str = "platform",
) -> jax.Array:
    """Write each request's accepted state (and its track state) into the state pool.

    Args:
      pool: ``[L, S, HV, V, K]`` float32 or bfloat16, all GDN layers' states.
      tape: from :func:`verify` per layer, stacked with a leading layer axis:
        :class:`Tuples` (``u [L, R, D, HV, V]``, ``k [L, R, D, H, K]``, ``g [L, R, D, HV]``),
        :class:`~gdn_lossless_jax.tape.KDATuples` (KDA layers: ``g [L, R, D, HV, K]``)
        or :class:`Snapshots` (``[L, R, D, HV, V, K]``, the pool's dtype); R >= rows used.
      slots: ``[N]`` int, the pool slot of each request (holds its pre-verify state).
      steps: ``[N]`` int, the last accepted draft step (0-based); negative: nothing written.
        **Not the accepted length**: a request that accepted n drafts has step n - 1. A
        length passed by mistake writes one step too many, and nothing at all for a fully
        accepted request (step D is out of range); ``checked=True`` catches step == D.
      track_slots, track_steps: ``[N]`` int or None, the mamba-track (prefix-cache) copy:
        the state after ``track_steps[i]`` (0-based, like steps) goes to
        ``track_slots[i]``; negative step: none.
      rows: ``[N]`` int or None, the tape row of request i (default ``i``).
      path: for a tape of a draft tree (``verify(..., parents=)``), ``[N, P]`` int: request i's
        accepted root-to-node path, node indices from the root's child down, padded with -1
        (:func:`gdn_lossless_jax.tree.path_to` gives it from the accepted node). ``steps`` and
        ``track_steps`` are then positions along the path (0-based, ``< P``), as a chain's
        steps are positions along the chain (whose path is ``[0, 1, ..., D-1]``): the replay
        applies the path's tuples in order from the pool state, exactly as a chain commit of
        those steps. None: the tape is a chain. A request whose path does not reach its step
        (an entry before it is not a node) writes nothing for it.
      parents: the tree (``[N, D]`` or ``[D]``, as verify took it, aligned to this call's
        requests), optional: used only to check that each path is a root-to-node path of it.
        The path checks (entries up to ``max(steps[i], track_steps[i])`` nodes of the tape, and
        with ``parents`` each the child of the one before it, the first the root's) run at call
        time, raising ``ValueError``, on concrete values: NumPy arrays, lists, and jax arrays
        that are not tracers (:func:`gdn_lossless_jax.tree.path_to`'s, say; pulled to the host, a
        device sync), whatever ``checked``. That needs ``path``, ``steps`` and ``track_steps``
        all concrete (which entries are read depends on the steps); with traced ``parents`` only
        the node range is checked then. Concrete ``parents`` are always checked themselves
        (each parent in ``[-1, d)``). Whatever a tracer (inside ``jax.jit``) keeps from being
        checked at call time is checked with ``checked=True``, on all the values; without it,
        not at all.
      backend: as in :func:`verify`. Every backend commits trees (the path's tuples are
        gathered into a chain tape, :func:`gdn_lossless_jax.reference.along_path`).
      checked: raise instead of skipping: every index below must be valid, and the first
        request that is not is named in the error (:mod:`gdn_lossless_jax.checked`: slots,
        rows, steps in ``[-1, D)`` (``[-1, P)`` with a path), track slots where a track step
        is given, and distinct destination slots; with a path, on traced values, its entries up
        to the steps nodes of the tape, and with ``parents`` a root-to-node path of a valid
        tree). Eager calls raise ``checkify.JaxRuntimeError`` at once; under ``jax.jit``,
        functionalize with ``jax.experimental.checkify.checkify``.
      math: the ``math=`` of the verify that recorded a tuple tape: the replay's decay is that
        mode's ``exp`` (a snapshot tape is copied, whatever the mode).
    Returns:
      The new pool. The skipping rules (``checked=False``, SGLang's masking): request i is
      skipped entirely (track copy included) if ``slots[i]`` or ``rows[i]`` is out of
      range; its accepted write is skipped if ``steps[i]`` is not in ``[0, D)``; its track
      write if ``track_steps[i]`` is not in ``[0, D)`` or ``track_slots[i]`` is out of
      range. Both states come from the pre-verify state. Every other element keeps its
      bits. Duplicate destination slots are undefined. Differentiable with respect to
      the pool and the tape (see :func:`verify`).
    """
    fn = "commit"
    raw = (path, steps, track_steps, parents)
    pool, tape, ints = checks.commit_args(fn, pool, tape, slots, steps, track_slots, track_steps, rows)
    checks.check_math(fn, math)
    sizes = {"K": pool.shape[-1], "V": pool.shape[-2], "HV": pool.shape[-3]}
    needs = backends.call_needs(type(tape).decays[0], sizes=sizes)
    impl = backends.resolve(backend, "commit", math, lambda c: c.takes(type(tape)) and needs(c))
    _check_record(impl, fn, tape)
    backends.check_sizes(impl, fn, sizes)
    if tape.stores_states:  # a commit that copies states has no math in it
        math = "platform"
    else:
        backends.check_math(impl, fn, math)
    if path is None:
        if parents is not None:
            raise ValueError(f"{fn}: parents= checks a tree's accepted paths: pass path= too")
        if checked:
            checked_mode.check_commit(fn, pool.shape[1], tape.num_rows, tape.num_steps, *ints)
        return autodiff.commit(impl, pool, tape, *ints, math=math)
    slots, steps, track_slots, track_steps, rows = ints
    N, D = slots.shape[0], tape.num_steps
    path = checks.check_path(fn, path, N)
    parents = checks.check_commit_parents(fn, parents, N, D)
    checks.check_path_indices(fn, D, path, steps, track_steps, parents, checked=checked, raw=raw)
    if checked:
        checked_mode.check_commit(fn, pool.shape[1], tape.num_rows, path.shape[1], *ints)
    tape, rows, steps, track_steps = _along_path(tape, rows, path, steps, track_steps)
    return autodiff.commit(impl, pool, tape, slots, steps, track_slots, track_steps, rows, math=math)


def _check_record(impl, fn: str, tape: Tape) -> None:
    """The backend takes ``tape``'s record mode and decay (``capabilities.takes``)."""
    backends.check_tape(impl, fn, type(tape))


_along_path = jax.jit(reference.along_path)  # (one dispatch, not one a jnp op, in an eager commit)


def commit_and_verify(
    pool: jax.Array,
    pending: Pending,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    a: jax.Array,
    b: jax.Array,
    A_log: jax.Array,
    dt_bias: jax.Array,
    *,
    slots: jax.Array,
    layer: Any = None,
    tape: Tape | None = None,
    rows: jax.Array | None = None,
    record: str | None = None,
    scale: float | None = None,
    backend: str = "auto",
    out_dtype: Any = None,
    out: jax.Array | None = None,
    parents: Any = None,
    topk: int = 1,
    checked: bool = False,
    math: str = "platform",
    decay: str | None = None,
    beta_scale: float | None = None,
) -> tuple[jax.Array, Tape, jax.Array]:
    """Apply the previous step's commit and verify the next drafts, reading each state once.

    A decode loop with separate calls reads every request's state twice per step and writes
    it once (``commit``, then the next ``verify``). This applies the pending commit inside
    the verify kernel: each program replays the previous step's accepted chain from the pool
    (the commit's rule, ``fma(k, u, rn(S * exp(g)))``, step by step, or the snapshot), writes
    the accepted state (and the track state) to the pool, and runs the new drafts from it. The
    pool, the outputs and the new tape are bit-identical to ``commit`` then ``verify``::

        pending = gl.Pending(prev_tape, rows, steps, track_slots, track_steps)
        out, tape, pool = gl.commit_and_verify(pool, pending, q, k, v, a, b, A_log, dt_bias, slots=slots)

    Args:
      pool: ``[S, HV, V, K]`` or ``[L, S, HV, V, K]`` (then ``layer``), float32 or bfloat16;
        returned updated (in place when donated).
      pending: :class:`Pending`: the previous step's tape (``[R', D', ...]``, with a leading
        ``L`` when the pool has one) and, per request n of this call, its row, accepted step,
        track slot and track step there (the arguments of :func:`commit`, aligned to this
        call's requests). The commit's masks apply (a request whose slot or row is out of range
        commits nothing; negative steps write nothing). Requests that left the batch are not
        here: commit them with :func:`commit` before their slots are read.
        With ``pending.path`` (a draft tree's accepted paths) the steps are positions along
        them, as in :func:`commit`: the path's tuples (this layer's) are gathered into a chain
        tape first, so the fused kernel replays a chain. Its entries up to the steps must be
        nodes of the pending tape: checked at call time where the path and steps are concrete,
        with ``checked=True`` where traced (as :func:`commit` checks a path without
        ``parents``: the pending commit has no tree to check it against).
      q, k, v, a, b, A_log, dt_bias, slots, layer, tape, rows, record, scale, backend,
        out_dtype, out, parents, topk, checked, math, decay, beta_scale: as in :func:`verify`
        (``decay`` None: from the tape buffer's or the pending tape's class where it tells; ``slots`` required:
        request n's state is ``pool[layer, slots[n]]``; the inputs may be stacked over the
        pool's layers). A tree verify (``parents``) runs on ``"reference"`` and ``"pallas"``.
    Returns:
      ``(outputs [N, D, HV, V], tape, pool)``. Differentiable like :func:`verify` (with
      respect to the pool, the pending tape and the inputs).

    In a jitted decode loop the two tape buffers swap roles every step: jit the step twice
    (two ``jax.jit`` objects of it, one per parity of the step), so that each executable sees
    each buffer in the same role at every call. One executable seeing them swapped re-records
    its whole CUDA graph before every launch.
    """
    call = checks.commit_and_verify_args(
        "commit_and_verify", pool, pending, q, k, v, a, b, A_log, dt_bias, record=record, scale=scale,
        out_dtype=out_dtype, slots=slots, layer=layer, tape=tape, rows=rows, out=out, parents=parents, topk=topk,
        math=math, checked=checked, decay=decay, beta_scale=beta_scale,
    )  # fmt: skip
    if checked and call.parents is not None:
        tree.checkify_parents("commit_and_verify", call.parents, topk)
    outputs, new, new_pool = run_verify(call, backend, "commit_and_verify")
    if len(checks.shape_of(pool)) == 4:
        new_pool = new_pool[0]
    return _strip(outputs, call.out, out), _strip(new, call.tape, tape), new_pool


__getattr__ = _deprecated.alias(__name__, {
    **{name: f"gdn_lossless_jax.staging:{name}" for name in ("staged", "unstaged")},
    **{name: f"gdn_lossless_jax.checks:{name}" for name in ("as_index", "STATE_DTYPES")},
})  # fmt: skip
