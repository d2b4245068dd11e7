"""Pallas (Triton backend) causal conv1d of verify: one launch per layer, from the pool by slot.

The taps of :func:`gdn_lossless_jax.conv.causal_conv1d_verify` (inputs rounded to the conv
dtype; accumulated from the bias as ``acc = fma(w_j, x_j, acc)``, the fma pinned in PTX, or the
portable form in interpret mode). The kernel returns the fp32 accumulators and the caller
applies the SiLU (``acc / (1 + exp(-acc))``) in XLA, the same operations as the XLA form, so the
two give the same bits on every platform (tested); the kernel's ``div.rn.f32`` differed from
XLA's division by 1 ULP on some outputs, so the division stays in XLA.

Why a kernel: XLA compiles the portable fma (about 150 integer operations) into large, slow to
compile fusions, and the XLA form also gathers, transposes and concatenates each request's conv
state. A program of the grid ``(N, conv_dim / BC)`` reads request n's conv state from the pool
at ``[layer, slots[n]]`` (zeros for a padding slot), its D inputs, and writes the accumulators
split into ``[q | k | v]`` (``splits``: no slicing copies) and the deduplicated windows straight
into the scratch at ``[layer, rows[n]]`` (aliased; an out-of-range row writes nothing), or into a
fresh ``[N, C, D+Kc-2]`` array.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .rounding import ops as rounding_ops

__all__ = ["conv_verify", "conv_commit", "block_channels", "scalar"]

F32 = jnp.float32


def scalar(x) -> jax.Array:
    """An int32 index as the ``[1]`` array a kernel reads: a reshape of a traced scalar (a loop
    counter, say) is free, where stacking two would launch a kernel per call."""
    return jnp.reshape(jnp.asarray(0 if x is None else x, jnp.int32), (1,))


def block_channels(splits: tuple[int, ...], cap: int = 128) -> int:
    """Channels per program: a power of 2 that divides every split (a block never straddles
    two outputs), at most ``cap``."""
    g = functools.reduce(math.gcd, splits)
    bc = 1
    while bc * 2 <= min(g, cap) and g % (bc * 2) == 0:
        bc *= 2
    return bc


def _kernel(*refs, D: int, Kc: int, BC: int, splits: tuple[int, ...], form: str, into: bool, bias: bool,
            stacked: tuple = (False, False, False)):  # fmt: skip
    # inputs: x, weight, bias, conv pool, slots, layer[, rows, tape layer, windows buffer]; outputs: the splits, windows.
    # `stacked`: which of x, weight and bias carry a leading layer axis (read at the pool's layer).
    x_ref, w_ref, b_ref, pool_ref, slots_ref, layer_ref = refs[:6]
    rows_ref, tape_layer_ref = refs[6:8] if into else (None, None)
    outs = refs[len(refs) - len(splits) - 1 : -1]
    win_ref = refs[-1]
    n, j = pl.program_id(0), pl.program_id(1)
    cs = pl.ds(j * BC, BC)
    W = Kc - 1
    cdt = pool_ref.dtype
    _, fma = rounding_ops(form)
    slot = slots_ref[n]
    ok = (slot >= 0) & (slot < pool_ref.shape[1])
    safe = jnp.where(ok, slot, 0)
    layer = layer_ref[0]
    at_x, at_w, at_b = (((layer,) if st else ()) for st in stacked)
    mask = jnp.broadcast_to(ok, (BC,))
    # cols[c] = x_{c - W}: the state's W columns (oldest first), then the D inputs rounded to the conv dtype.
    cols = [plgpu.load(pool_ref.at[layer, safe, cs, jnp.int32(w)], mask=mask, other=0.0).astype(cdt) for w in range(W)]
    cols += [x_ref[(*at_x, n, t, cs)].astype(cdt) for t in range(D)]
    w = [w_ref[(*at_w, cs, i)].astype(F32) for i in range(Kc)]
    b = b_ref[(*at_b, cs)].astype(F32) if bias else jnp.zeros((BC,), F32)
    for t in range(D):
        acc = b
        for i in range(Kc):
            acc = fma(w[i], cols[t + i].astype(F32), acc)
        lo = 0
        for out, width in zip(outs, splits):

            @pl.when((j * BC >= lo) & (j * BC < lo + width))
            def _(out=out, lo=lo):
                out[n, t, pl.ds(j * BC - lo, BC)] = acc

            lo += width
    if into:
        row = rows_ref[n]

        @pl.when((row >= 0) & (row < win_ref.shape[1]))
        def _():
            for c in range(D + W - 1):
                win_ref[tape_layer_ref[0], row, cs, c] = cols[c + 1]

    else:
        for c in range(D + W - 1):
            win_ref[n, cs, c] = cols[c + 1]


@functools.partial(jax.jit, static_argnames=("splits", "form", "interpret"))
def conv_verify(x, weight, bias, conv_pool, slots, layer, *, splits=None, windows=None, tape_layer=None, rows=None,
                form: str, interpret: bool):  # fmt: skip
    """The conv of D draft tokens for N requests, from the conv pool by slot.

    Args:
      x: ``[N, D, C]`` pre-conv inputs. weight: ``[C, Kc]``. bias: ``[C]`` or None. Any of
        the three may be stacked over the pool's layers (``[L, N, D, C]``, ``[L, C, Kc]``,
        ``[L, C]``): read at ``layer`` in the kernel.
      conv_pool: ``[L, S, C, Kc-1]`` conv states (their dtype is the windows'); request n's is
        ``conv_pool[layer, slots[n]]`` (zeros outside ``[0, S)``).
      splits: channel counts the output is split into (default ``(C,)``).
      windows, tape_layer, rows: a window buffer ``[L', R, C, >= D+Kc-2]`` written at
        ``[tape_layer, rows[n]]`` in place, or None for fresh windows ``[N, C, D+Kc-2]``.
    Returns:
      ``(accumulators, windows)``: one fp32 ``[N, D, c]`` array of pre-activations per split
      (the SiLU is the caller's), and the windows.
    """
    stacked = (x.ndim == 4, weight.ndim == 3, bias is not None and bias.ndim == 2)
    N, D, C = x.shape[-3:]
    Kc = weight.shape[-1]
    splits = splits or (C,)
    BC = block_channels(splits)
    into = windows is not None
    has_bias = bias is not None
    inputs = [x, weight, bias if has_bias else jnp.zeros((C,), F32), conv_pool, slots, scalar(layer)]
    out_shape = [jax.ShapeDtypeStruct((N, D, c), F32) for c in splits]
    aliases = {}
    if into:
        inputs += [rows, scalar(tape_layer), windows]
        out_shape.append(jax.ShapeDtypeStruct(windows.shape, windows.dtype))
        aliases = {len(inputs) - 1: len(out_shape) - 1}
    else:
        out_shape.append(jax.ShapeDtypeStruct((N, C, D + Kc - 2), conv_pool.dtype))
    kernel = functools.partial(_kernel, D=D, Kc=Kc, BC=BC, splits=tuple(splits), form=form, into=into, bias=has_bias,
                               stacked=stacked)  # fmt: skip
    *outs, win = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(N, C // BC),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=max(1, min(4, BC // 32)), num_stages=1),
        interpret=interpret,
        name="gdn_conv_verify",
    )(*inputs)
    return outs, win


def _commit_kernel(slots_ref, steps_ref, tslots_ref, tsteps_ref, rows_ref, win_ref, pool_in, pool_ref, *, W: int, BC: int):
    """One (layer, request, channel block): the accepted and track windows into the conv pool."""
    del pool_in  # aliased with pool_ref
    l, n, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cs = pl.ds(j * BC, BC)
    S, R = pool_ref.shape[1], win_ref.shape[1]
    D = win_ref.shape[-1] - (W - 1)
    slot, step, tslot, tstep, row = slots_ref[n], steps_ref[n], tslots_ref[n], tsteps_ref[n], rows_ref[n]
    # SGLang's masks (reference.commit_masks): a request whose slot or row is out of range is skipped
    # entirely; each write needs its step in [0, D) (and the track slot in range).
    valid = (slot >= 0) & (slot < S) & (row >= 0) & (row < R)
    accept = valid & (step >= 0) & (step < D)
    track = valid & (tstep >= 0) & (tstep < D) & (tslot >= 0) & (tslot < S)
    for dst, at, ok in ((tslot, tstep, track), (slot, step, accept)):  # track first, as the reference scatters

        @pl.when(ok)
        def _(dst=dst, at=at):
            for w in range(W):
                pool_ref[l, dst, cs, w] = win_ref[l, row, cs, at + w]


@functools.partial(jax.jit, static_argnames=("interpret",))
def conv_commit(conv_pool, windows, slots, steps, track_slots, track_steps, rows, *, interpret: bool):
    """:func:`gdn_lossless_jax.conv.conv_commit` as one launch, in place on the (aliased) conv pool."""
    L, _, C, W = conv_pool.shape
    BC = block_channels((C,))
    return pl.pallas_call(
        functools.partial(_commit_kernel, W=W, BC=BC),
        out_shape=jax.ShapeDtypeStruct(conv_pool.shape, conv_pool.dtype),
        grid=(L, slots.shape[0], C // BC),
        input_output_aliases={6: 0},
        compiler_params=plgpu.CompilerParams(num_warps=max(1, min(4, BC // 32)), num_stages=1),
        interpret=interpret,
        name="gdn_conv_commit",
    )(slots, steps, track_slots, track_steps, rows, windows, conv_pool)
