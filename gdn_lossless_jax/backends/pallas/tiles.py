"""The tile of one Pallas verify program, shared by the chain (:mod:`.verify`) and Gram
(:mod:`.gram`) kernels: where it reads its state and writes its tape (:class:`_Where`,
:func:`_program`), the state as ``[BV, C]`` chunks, and the sums over K in a fixed order."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ... import portable, rounding
from ._refs import program_ids, store

F32 = jnp.float32


class _Where(NamedTuple):
    """Where one verify program reads its state and writes its tape.

    ``n``, ``hv``, ``h``: request, v-head, q/k head; ``vs``: the V tile's rows. The state is
    read from ``state[layer, slots[n], hv, vs]`` (zeros where the slot is outside
    ``[0, S)``, as SGLang reads padding slots); the tape goes to ``tape[lead + (t, hv, vs)]``:
    ``lead`` is ``(n,)`` for a fresh tape and ``(tape_layer, rows[n])`` into a buffer, where
    ``row_ok`` says whether that row exists (out-of-range rows write nothing). The outputs go
    to ``o[olead + (n, t, hv, vs)]``: ``olead`` is ``()`` for fresh outputs and ``(out_layer,)``
    into a buffer.
    """

    n: Any
    hv: Any
    h: Any
    vs: Any
    layer: Any
    slot: Any
    slot_ok: Any
    lead: tuple
    row_ok: Any
    olead: tuple = ()


def _program(refs, n_inputs: int, into: bool, r: int, BV: int, tiles_first: bool, n_outputs: int = 2,
             out_into: bool = False):  # fmt: skip
    """What both verify kernels read first: their input refs (``state``, ``slots``, ``layer``,
    ``tape_layer`` first), the output refs ``o`` and ``tape``, and the program's :class:`_Where`.

    ``refs`` is ``inputs[, rows, tape buffer (aliased)][, pending inputs][, out_layer, outputs
    buffer (aliased)], o, tape[, pool]``.
    """
    n, hv, j = program_ids(tiles_first)
    state_ref, slots_ref, layer_ref, tape_layer_ref = refs[:4]
    slot = slots_ref[n]
    slot_ok = (slot >= 0) & (slot < state_ref.shape[1])
    row = refs[n_inputs][n] if into else None
    o_ref, tape_ref = refs[len(refs) - n_outputs : len(refs) - n_outputs + 2]
    if into:
        lead, row_ok = (tape_layer_ref[0], row), (row >= 0) & (row < tape_ref.shape[1])
    else:
        lead, row_ok = (n,), None
    olead = (refs[len(refs) - n_outputs - 2][0],) if out_into else ()
    where = _Where(n, hv, hv // r, pl.ds(j * BV, BV), layer_ref[0], jnp.where(slot_ok, slot, 0), slot_ok, lead, row_ok,
                   olead)  # fmt: skip
    return refs[4:n_inputs], o_ref, tape_ref, state_ref, where


def _chunks(K: int, k_chunk: int):
    """The column slices that hold a ``[BV, K]`` state tile as ``K / C`` tiles ``[BV, C]``."""
    C = min(K, k_chunk)
    return [pl.ds(c * C, C) for c in range(K // C)]


def _decays(g_ref, idx: tuple, cols, exp):
    """``exp(g)`` for each ``[BV, C]`` chunk of a state tile, from ``g_ref`` at ``idx`` (its leading
    indices, the head last). One decay per head (GDN: ``g [..., HV]``, as many indices as axes) is
    one scalar for every chunk; a per-channel decay (KDA: ``g [..., HV, K]``, one axis more) is each
    chunk's own key channels, a ``[1, C]`` row broadcast over the tile's V rows. Either way the
    decay is one rounded multiply per element (the caller's ``mul``)."""
    if g_ref.ndim == len(idx):
        alpha = exp(g_ref[idx])
        return [alpha] * len(cols)
    *lead, hv = idx
    return [exp(g_ref[(*lead, pl.ds(hv, 1), c)]) for c in cols]


def _identity(x):
    return x


def _apart(interpret: bool):
    """Interpret mode: ``optimization_barrier``, which keeps a row's sum in :func:`_row_sum`'s
    order. XLA:CPU orders a row's sum, and contracts ``a * b + c`` into an fma or not, by the
    fusion it makes of the whole program, and the two record modes are two programs (even one
    program computes a value twice: the loop's first step before it, the others inside). On a
    GPU the identity (Triton compiles both modes' body alike). The barrier is not enough for the
    products: see :func:`_times`."""
    return jax.lax.optimization_barrier if interpret else _identity


def _times(apart=_identity):
    """The product of a dot's terms, ``x * y``; in interpret mode (``apart`` a barrier) with
    integer operations (``rounding``'s ``mul_rn``, the same correctly rounded value): XLA:CPU of
    jax 0.12.1 contracted a plain product into the add it feeds across an
    ``optimization_barrier``, in the one-pass chain's ``k . q`` of the first step (computed
    before the step loop) and not in the others'. An integer product has nothing to contract."""
    return _mul if apart is _identity else rounding._mul_rn


def _mul(x, y):
    return x * y


def _row_sum(x, apart=_identity):
    """``x.sum(axis=1)``; in interpret mode (``apart`` a barrier) a fixed pairwise tree of explicit
    adds (column j with j + w/2, ...; an odd column left over joins at the end), so that no
    fusion decides the order."""
    if apart is _identity:
        return jnp.sum(x, axis=1)
    x = apart(x)
    extra = []
    while x.shape[1] > 1:
        w = x.shape[1]
        if w % 2:
            extra.append(x[:, w - 1])
            x = x[:, : w - 1]
        half = x.shape[1] // 2
        x = apart(x[:, :half] + x[:, half:])
    out = x[:, 0]
    for e in reversed(extra):
        out = apart(out + e)
    return out


def _chunk_dot(xs, ys, fma=None, apart=_identity):
    """Sum over K of the elementwise products of two chunked tiles (lists of ``[BV, C]`` and
    ``[1, C]``): chunk by chunk in registers, then one reduction (a short shuffle tree).
    With ``fma`` (a pinned fma) each chunk after the first is fused into the running sum:
    one instruction per element instead of a multiply and an add. ``apart``: :func:`_apart`."""
    times = _times(apart)
    acc = apart(times(xs[0], ys[0]))
    for x, y in zip(xs[1:], ys[1:]):
        acc = apart(acc + apart(times(x, y))) if fma is None else fma(x, y, acc)
    return _row_sum(acc, apart)


def _tree_dot(xs, ys):
    """``math="portable"``: :func:`_chunk_dot` in the reference's tree order, every operation
    correctly rounded. The tree over K pairs element j with j + K/2, ...: chunk c with chunk
    c + n/2 while the halves are whole chunks, then the tree within the last chunk
    (:func:`gdn_lossless_jax.portable.pairwise_sum`). K and the chunk are powers of 2."""
    ps = [rounding.mul_rn(x, y) for x, y in zip(xs, ys)]
    while len(ps) > 1:
        half = len(ps) // 2
        ps = [rounding.add_rn(ps[i], ps[i + half]) for i in range(half)]
    return portable.pairwise_sum(ps[0])


def _state_tile(state_ref, w: _Where, c, evict):
    """One ``[BV, C]`` chunk of the program's pre-verify state, fp32 (zeros for a padding slot)."""
    shape = (w.vs.size, c.size)
    tile = plgpu.load(state_ref.at[w.layer, w.slot, w.hv, w.vs, c], mask=jnp.broadcast_to(w.slot_ok, shape),
                      other=0.0, eviction_policy=evict)  # fmt: skip
    return tile.astype(F32)


def _load_state(state_ref, w: _Where, cols, evict):
    """The program's state tile, as fp32 ``[BV, C]`` chunks (read once: ``evict``)."""
    return [_state_tile(state_ref, w, c, evict) for c in cols]


def _store_state(tape_ref, w: _Where, t, cols, S, evict):
    """Step ``t``'s state (its chunks ``S``) into the snapshot tape."""
    for c, tile in zip(cols, S):
        _store_row(tape_ref, w, (*w.lead, t, w.hv, w.vs, c), tile.astype(tape_ref.dtype), evict=evict)


def _store_row(ref, w: _Where, idx, value, evict=None):
    if w.row_ok is None:  # a fresh tape: rows are the requests themselves
        store(ref, idx, value, evict)
        return

    @pl.when(w.row_ok)  # out-of-range rows write nothing
    def _():
        store(ref, idx, value, evict)
