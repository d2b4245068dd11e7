"""The causal conv1d of a GDN layer during verify, and the conv part of commit.

A GDN layer runs its ``[q | k | v]`` projection (``conv_dim = 2*H*K + HV*V`` channels)
through a depthwise causal conv1d of width ``Kc`` (4 on Qwen models) before the
recurrence. Its state per request is the last ``Kc-1`` inputs, ``[conv_dim, Kc-1]``,
column ``j`` holding ``x_{j-(Kc-1)}`` (oldest first).

Verify over D draft tokens (SGLang's ``causal_conv1d_update`` with intermediate windows, in
its Triton kernel ``_causal_conv1d_update_kernel``): the output of step t is
``silu(bias + sum_j w[:, j] * x_{t-Kc+1+j})`` with ``x_{<0}`` read from the old state, and the
*window after step t* is the pre-activation inputs ``(x_{t-Kc+2}, ..., x_t)``. Consecutive windows overlap, so they are
kept deduplicated, as SGLang does on CUDA for linear chains: one ``[conv_dim, D+Kc-2]``
buffer per request with ``phys[..., c] = x_{c-(Kc-2)}`` (the first ``Kc-2`` columns are the
old history), and window t is ``phys[..., t : t+Kc-1]``. Commit copies the accepted
window (and the track window) into the conv state slots with the same masking, track and
row rules as the SSM commit (:func:`gdn_lossless_jax.reference.commit_masks`, reused).

Rounding: the inputs are rounded to the conv state's dtype first (the windows store them
in it, so every tap reads the value a window holds); taps accumulate in fp32 from the bias
as ``acc = fma(w_j, x_j, acc)`` for ``j = 0 .. Kc-1``, pinned with
:func:`gdn_lossless_jax.rounding.fma_rn` (what Triton's fp fusion makes of ``acc += w*x``
with fp32 operands; XLA:CPU would otherwise contract and flush subnormals as it likes);
SiLU is ``acc / (1 + exp(-acc))``. The deduplicated and the dense per-step-window forms
below are bit-identical (tested).

Draft trees (``parents``, :mod:`gdn_lossless_jax.tree`): a node's window is along its root path,
the last ``Kc-1`` inputs among its ancestors and itself, reaching into the old state above the
root. The buffer stays the chain's, ``[conv_dim, D+Kc-2]``, one column per node input (column
``Kc-2+d`` holds node d's) after the ``Kc-2`` old columns: every input is stored once, and a
node's taps read its ancestors' columns (:func:`tree_columns`), so a node on a path computes
exactly what a chain of that path computes. Commit gathers the accepted window's columns by the
accepted path (:func:`conv_commit` with ``path``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import backends, reference, rounding
from .checks import check_float, check_index, check_rank, check_shape, fmt_shape, shape_of
from .staging import as_index

__all__ = ["causal_conv1d_verify", "causal_conv1d_verify_dense", "dense_windows", "conv_commit", "verify_from_pool",
           "tree_columns"]

F32 = jnp.float32


def _check_verify_args(fn: str, conv_state, x, weight, bias):
    check_rank(fn, "conv_state", conv_state, 3, "[N, conv_dim, Kc-1]")
    N, C, W = shape_of(conv_state)
    check_rank(fn, "x", x, 3, "[N, D, conv_dim]")
    D = shape_of(x)[1]
    check_shape(fn, "x", x, (N, D, C), "[N, D, conv_dim]", "N and conv_dim from conv_state")
    if D < 1:
        raise ValueError(f"{fn}: need at least one draft step, got D={D} (x has shape {fmt_shape(shape_of(x))})")
    check_shape(fn, "weight", weight, (C, W + 1), "[conv_dim, Kc]", "Kc = conv_state.shape[-1] + 1")
    if W + 1 < 2:
        raise ValueError(f"{fn}: the conv width Kc must be at least 2, got Kc={W + 1} (conv_state {fmt_shape(shape_of(conv_state))})")
    if bias is not None:
        check_shape(fn, "bias", bias, (C,), "[conv_dim]", "from conv_state")
    for name, a in (("conv_state", conv_state), ("x", x), ("weight", weight), ("bias", bias)):
        if a is not None:
            check_float(fn, name, a)


def _taps(taps, weight, bias):
    """``bias + sum_j w[:, j] * taps[j]``, accumulated in tap order with the pinned fma.

    Args:
      taps: Kc float32 arrays ``[..., C, T]``, ``taps[j]`` the inputs weight column j multiplies.
      weight: ``[C, Kc]``; bias ``[C]`` or None.
    Returns:
      ``[..., C, T]`` float32, the pre-activation accumulator.
    """
    w = weight.astype(F32)
    shape = taps[0].shape
    acc = jnp.zeros(shape, F32) if bias is None else jnp.broadcast_to(bias.astype(F32)[:, None], shape)
    for j, x in enumerate(taps):
        acc = rounding.fma_rn(w[:, j, None], x, acc)
    return acc


def _silu(acc):
    return acc / (1.0 + rounding.exp(-acc))


def tree_columns(parents, kernel: int):
    """Which input each tap of each node reads, for a draft tree: ``[N, D] -> [Kc, N, D]`` int32.

    Columns index ``cols = [conv_state (Kc-1 columns) | x_0 .. x_{D-1}]``: tap ``j`` of node d
    (weight column j) reads ``cols[idx[j, n, d]]``, the input ``Kc-1-j`` steps up node d's root path
    (``idx[Kc-1] = Kc-1+d``, the node itself; past the root, the old state's columns, newest first).
    Each step up is one gather of the column's parent: a node column's parent is its parent node's
    column (``Kc-2``, the state's newest, for a child of the root), a state column's the one before
    it. For the chain (``parents[d] = d-1``) ``idx[j] = d + j``: the chain's taps.
    """
    p = jnp.asarray(parents, jnp.int32)
    N, D = p.shape
    W = kernel - 1
    hist = jnp.broadcast_to(jnp.maximum(jnp.arange(W, dtype=jnp.int32) - 1, 0), (N, W))  # state column i <- i-1
    pcol = jnp.concatenate([hist, jnp.where(p >= 0, W + p, W - 1)], axis=1)  # [N, W+D]
    idx = [jnp.broadcast_to(W + jnp.arange(D, dtype=jnp.int32), (N, D))]
    for _ in range(W):
        idx.insert(0, jnp.take_along_axis(pcol, idx[0], axis=1))
    return jnp.stack(idx)


def causal_conv1d_verify(conv_state, x, weight, bias=None, parents=None):
    """The conv of D draft tokens with deduplicated windows; ``conv_state`` is not modified.

    Args:
      conv_state: ``[N, conv_dim, Kc-1]``, each request's conv state (the last ``Kc-1``
        inputs, oldest first); its dtype is the window dtype (bf16 in SGLang).
      x: ``[N, D, conv_dim]`` draft inputs (pre-activation ``[q | k | v]`` projections).
      weight: ``[conv_dim, Kc]``; ``weight[:, j]`` multiplies ``x_{t-Kc+1+j}``.
      bias: ``[conv_dim]`` or None.
      parents: None (a chain), or a draft tree's ``[N, D]`` int32 parents (checked by the
        caller, :func:`gdn_lossless_jax.checks.check_tree`): node d's taps read its root path
        (:func:`tree_columns`).
    Returns:
      ``(out [N, D, conv_dim] in x's dtype, windows [N, conv_dim, D+Kc-2] in conv_state's
      dtype)`` with ``windows[..., c] = x_{c-(Kc-2)}``: window t is ``windows[..., t:t+Kc-1]``
      for a chain; for a tree, column ``Kc-2+d`` is node d's input (the window of a node is
      gathered along its path).
    """
    _check_verify_args("causal_conv1d_verify", conv_state, x, weight, bias)
    if parents is not None:
        return _verify_tree(conv_state, x, weight, bias, jnp.asarray(parents, jnp.int32))
    return _verify(conv_state, x, weight, bias)


# Always compiled (as the reference backend is): XLA:CPU rounds some ops differently op by
# op than fused under jit, so one compiled path gives the same bits with or without an outer jit.
@jax.jit
def _verify(conv_state, x, weight, bias):
    # In a caller's jit XLA:GPU could otherwise skip the rounding of x's producer (excess precision).
    conv_state, x, weight, bias = lax.optimization_barrier((conv_state, x, weight, bias))
    D = x.shape[1]
    xt = jnp.swapaxes(x, 1, 2).astype(conv_state.dtype)  # [N, C, D], rounded as the windows store it
    cols = jnp.concatenate([conv_state, xt], axis=-1)  # x_{-(Kc-1)} .. x_{D-1}
    taps = [cols[..., j : j + D].astype(F32) for j in range(weight.shape[1])]
    out = _silu(_taps(taps, weight, bias))
    return jnp.swapaxes(out, 1, 2).astype(x.dtype), cols[..., 1:]


@jax.jit
def _verify_tree(conv_state, x, weight, bias, parents):
    conv_state, x, weight, bias = lax.optimization_barrier((conv_state, x, weight, bias))
    xt = jnp.swapaxes(x, 1, 2).astype(conv_state.dtype)  # [N, C, D]
    cols = jnp.concatenate([conv_state, xt], axis=-1)  # x_{-(Kc-1)} .. x_{D-1}, node d at Kc-1+d
    idx = tree_columns(parents, weight.shape[1])  # [Kc, N, D]
    taps = [jnp.take_along_axis(cols, i[:, None, :], axis=-1).astype(F32) for i in idx]
    out = _silu(_taps(taps, weight, bias))
    return jnp.swapaxes(out, 1, 2).astype(x.dtype), cols[..., 1:]


def _conv_kernels(backend):
    """The conv kernels of ``backend`` (a name or a backend object) where they run here
    (:meth:`~gdn_lossless_jax.backends.contract.Backend.conv_kernels`), or None: XLA runs the conv.
    The Pallas kernels serve ``pallas`` (on CUDA, and in interpret mode on a CPU) and ``triton``
    (on CUDA)."""
    return backends.lookup(backend).conv_kernels()


def verify_from_pool(conv_pool, layer, slots, x, weight, bias=None, *, windows=None, rows=None, splits=None,
                     backend: str = "auto", parents=None):  # fmt: skip
    """The conv of verify, reading each request's conv state from the pool by slot.

    Args:
      conv_pool: ``[L, S, conv_dim, Kc-1]``; request n's state is ``conv_pool[layer, slots[n]]``
        (zeros for a slot outside ``[0, S)``, SGLang's padding).
      layer: int or traced int32 scalar. slots: ``[N]`` int32.
      x, weight, bias: as :func:`causal_conv1d_verify`, or stacked over the pool's layers
        (``[L, N, D, C]``, ``[L, C, Kc]``, ``[L, C]``): read at ``layer``.
      windows, rows: a window buffer ``[L, R, conv_dim, >= D+Kc-2]`` (written at
        ``[layer, rows[n]]``, in place when donated; out-of-range rows write nothing), or None
        for fresh windows ``[N, conv_dim, D+Kc-2]``.
      splits: channel counts to split the output into (``[q | k | v]``), or None for one.
      backend: with ``"pallas"`` or ``"triton"`` on CUDA (or ``"pallas"`` in interpret mode on
        a CPU), one Pallas kernel that reads the states by slot and writes the windows in
        place; otherwise XLA (gather, :func:`causal_conv1d_verify`, scatter). Same bits.
      parents: None, or a draft tree's ``[N, D]`` int32 parents: the tree's conv, in XLA on every
        backend (:func:`causal_conv1d_verify`).
    Returns:
      ``(outputs, windows)``: a list of ``[N, D, c]`` arrays (one per split), and the windows.
    """
    kernels = _conv_kernels(backend) if parents is None else None
    if kernels is not None:
        accs, win = kernels.verify(x, weight, bias, conv_pool, slots, layer,
                                   splits=None if splits is None else tuple(splits), windows=windows,
                                   tape_layer=None if windows is None else layer, rows=rows)  # fmt: skip
        return [_silu(a).astype(x.dtype) for a in accs], win
    # any of them stacked over layers: this layer's (XLA slices them)
    x = x[layer] if x.ndim == 4 else x
    weight = weight[layer] if weight.ndim == 3 else weight
    bias = bias[layer] if bias is not None and bias.ndim == 2 else bias
    S = conv_pool.shape[1]
    idx = reference.in_range(slots, S)
    y, win = causal_conv1d_verify(conv_pool.at[layer, idx].get(mode="fill", fill_value=0), x, weight, bias, parents)
    bounds = np.cumsum([0, *(splits or (x.shape[-1],))])
    outs = [y[..., lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]
    if windows is None:
        return outs, win
    R = windows.shape[1]
    r = reference.in_range(rows, R)
    return outs, windows.at[layer, r, :, : win.shape[-1]].set(win.astype(windows.dtype), mode="drop")


def causal_conv1d_verify_dense(conv_state, x, weight, bias=None):
    """Reference: the same conv step by step, with one explicit window per step.

    SGLang's dense layout (its fallback for trees, KDA and non-CUDA platforms): a scan over
    the D steps whose carry is the conv state; step t forms its full window ``[state | x_t]``
    (Kc columns) and carries the new state ``(x_{t-Kc+2}..x_t)``; each step's output is
    then computed from its own window.

    Args: as :func:`causal_conv1d_verify`.
    Returns:
      ``(out [N, D, conv_dim], windows [N, D, conv_dim, Kc-1])``.
    """
    _check_verify_args("causal_conv1d_verify_dense", conv_state, x, weight, bias)
    return _verify_dense(conv_state, x, weight, bias)


@jax.jit
def _verify_dense(conv_state, x, weight, bias):
    conv_state, x, weight, bias = lax.optimization_barrier((conv_state, x, weight, bias))
    def step(state, x_t):
        full = jnp.concatenate([state, x_t.astype(state.dtype)[..., None]], axis=-1)  # [N, C, Kc]
        return full[..., 1:], full

    _, full = lax.scan(step, conv_state, jnp.moveaxis(x, 1, 0))  # [D, N, C, Kc]: step t's window
    full = jnp.moveaxis(full, 0, -2).astype(F32)  # [N, C, D, Kc]
    out = _silu(_taps([full[..., j] for j in range(weight.shape[1])], weight, bias))  # [N, C, D]
    return jnp.swapaxes(out, 1, 2).astype(x.dtype), jnp.moveaxis(full[..., 1:], -2, 1).astype(conv_state.dtype)


def dense_windows(windows, kernel: int):
    """The per-step view of deduplicated windows: ``[..., C, D+Kc-2] -> [..., D, C, Kc-1]``.

    ``view[..., t, c, w] = windows[..., c, t + w]`` (SGLang's ``as_strided`` view, as a copy).
    """
    D = windows.shape[-1] - (kernel - 2)
    idx = jnp.arange(D)[:, None] + jnp.arange(kernel - 1)[None, :]  # [D, Kc-1]
    return jnp.swapaxes(windows[..., idx], -3, -2)  # [..., C, D, Kc-1] -> [..., D, C, Kc-1]


@dataclasses.dataclass(frozen=True)
class _Extent:
    """The rows and steps of the window scratch, shaped like a tape for ``reference.commit_masks``."""

    num_rows: int
    num_steps: int


def conv_commit(conv_pool, windows, slots, steps, track_slots=None, track_steps=None, rows=None, *, backend="auto",
                path=None):  # fmt: skip
    """Copy each request's accepted (and track) conv window into the conv state pool.

    Args:
      conv_pool: ``[L, S, conv_dim, Kc-1]``, all GDN layers' conv states.
      windows: ``[L, R, conv_dim, D+Kc-2]`` deduplicated windows from
        :func:`causal_conv1d_verify`, stacked over layers, in the pool's dtype.
      slots, steps, track_slots, track_steps, rows: ``[N]`` int, exactly as in
        :func:`gdn_lossless_jax.commit`: slot ``slots[i]`` receives the window after step
        ``steps[i]`` (``windows[:, rows[i], :, steps[i] : steps[i]+Kc-1]``), and
        ``track_slots[i]`` the window after ``track_steps[i]``.
      backend: as in :func:`verify_from_pool`: one Pallas kernel, in place on the pool, where
        the conv kernel runs; XLA elsewhere. Same bits.
      path: for a draft tree's windows, ``[N, P]`` int, request i's accepted root-to-node path
        (as in :func:`gdn_lossless_jax.commit`; steps are positions along it): the window after
        position s is the old columns and the path's node columns up to s, last ``Kc-1`` of them,
        gathered in XLA on every backend.
    Returns:
      The new conv pool. The same requests are skipped as in the SSM commit (out-of-range
      slot or row: the whole request; step outside ``[0, D)``: that write; out-of-range
      track slot: the track write). Every other element keeps its bits.
    """
    fn = "conv_commit"
    check_rank(fn, "conv_pool", conv_pool, 4, "[L, S, conv_dim, Kc-1]")
    L, _, C, W = shape_of(conv_pool)
    Kc = W + 1
    check_rank(fn, "windows", windows, 4, "[L, R, conv_dim, D+Kc-2]")
    R, width = shape_of(windows)[1], shape_of(windows)[3]
    D = width - (Kc - 2)
    if D < 1:
        raise ValueError(
            f"{fn}: argument 'windows' must have D+Kc-2 >= Kc-1 columns (Kc={Kc} from conv_pool), "
            f"got shape {fmt_shape(shape_of(windows))}"
        )
    check_shape(fn, "windows", windows, (L, R, C, width), "[L, R, conv_dim, D+Kc-2]", "L, conv_dim from conv_pool")
    if windows.dtype != conv_pool.dtype:
        raise TypeError(f"{fn}: window dtype {windows.dtype} must match the conv pool dtype {conv_pool.dtype}")
    check_rank(fn, "slots", slots, 1, "[N]")
    N = shape_of(slots)[0]
    if (track_slots is None) != (track_steps is None):
        raise ValueError(f"{fn}: give both track_slots and track_steps, or neither")
    if track_slots is None:
        track_slots = track_steps = np.full((N,), -1, np.int32)
    if rows is None:
        rows = np.arange(N, dtype=np.int32)
    for name, a in (("slots", slots), ("steps", steps), ("track_slots", track_slots), ("track_steps", track_steps), ("rows", rows)):
        check_index(fn, name, a, N)
    slots, steps, track_slots, track_steps, rows = (as_index(a) for a in (slots, steps, track_slots, track_steps, rows))
    if path is not None:
        check_rank(fn, "path", path, 2, "[N, P]")
        check_shape(fn, "path", path, (N, shape_of(path)[1]), "[N, P]", "N from slots")
        return _conv_commit_path(conv_pool, windows, slots, steps, track_slots, track_steps, rows, as_index(path))
    kernels = _conv_kernels(backend)
    if kernels is not None:
        return kernels.commit(conv_pool, windows, slots, steps, track_slots, track_steps, rows)
    return _conv_commit(conv_pool, windows, slots, steps, track_slots, track_steps, rows)


@jax.jit
def _conv_commit(conv_pool, windows, slots, steps, track_slots, track_steps, rows):
    Kc = conv_pool.shape[-1] + 1
    D = windows.shape[-1] - (Kc - 2)
    valid, accept, track = reference.commit_masks(
        conv_pool, _Extent(windows.shape[1], D), slots, steps, track_slots, track_steps, rows
    )
    mine = windows[:, jnp.where(valid, rows, 0)]  # [L, N, C, D+Kc-2]

    def pick(s):  # the window after step s: columns s .. s+Kc-2
        cols = jnp.clip(s, 0, D - 1)[:, None] + jnp.arange(Kc - 1)[None, :]  # [N, Kc-1]
        return jnp.take_along_axis(mine, cols[None, :, None, :], axis=-1)

    conv_pool = reference.scatter_slots(conv_pool, track_slots, track, pick(track_steps))
    return reference.scatter_slots(conv_pool, slots, accept, pick(steps))


@jax.jit
def _conv_commit_path(conv_pool, windows, slots, steps, track_slots, track_steps, rows, path):
    # The path's columns (the old ones, then the path's nodes in order) gathered into one chain's
    # windows per request; then the chain's commit, with the steps as positions along the path.
    Kc = conv_pool.shape[-1] + 1
    D, R = windows.shape[-1] - (Kc - 2), windows.shape[1]
    N = path.shape[0]
    steps, track_steps = reference.path_steps(path, steps, D), reference.path_steps(path, track_steps, D)
    ok = (rows >= 0) & (rows < R)
    old = jnp.broadcast_to(jnp.arange(Kc - 2, dtype=jnp.int32), (N, Kc - 2))
    cols = jnp.concatenate([old, Kc - 2 + jnp.clip(path, 0, D - 1)], axis=1)  # [N, P+Kc-2]
    chain = jnp.take_along_axis(windows[:, jnp.where(ok, rows, 0)], cols[None, :, None, :], axis=-1)
    rows = jnp.where(ok, jnp.arange(N, dtype=jnp.int32), N)
    return _conv_commit(conv_pool, chain, slots, steps, track_slots, track_steps, rows)
