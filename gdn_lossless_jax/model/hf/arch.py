"""Qwen3-Next / Qwen3.5 layers as transformers 5.x writes them, in JAX.

Parameters are frozen dataclasses registered with JAX (as :mod:`gdn_lossless_jax.model.model`); every
weight is stored ``[in, out]`` (``x @ w``). Where transformers rounds to the model's dtype between
operations, these functions do too, so bf16 stays close; norms, gates, routing and softmax run in fp32
as there. Sums the compiler would otherwise order per program (the norms' means, the softmax) go in a
fixed order (:func:`gdn_lossless_jax.reference.ksum`), as in the demo model. Every matmul goes through
:func:`gdn_lossless_jax.model.model.matmul` / ``einsum``: float32 operands multiply in float32
(``Precision.HIGHEST``; JAX's default would let a GPU use TF32), bf16 ones at the default.

- zero-centred RMSNorm: ``x / rms(x) * (1 + weight)`` (the decoder norms, q/k norms, final norm, the MTP
  norms); the GDN layer's gated norm keeps a plain ``weight``: ``weight * x / rms(x) * silu(z)``.
- attention: ``q_proj`` yields per head ``[q | gate]``; q/k norms; RoPE on the first ``rotary_dim``
  dims (rotate-half form); grouped KV heads; the output times ``sigmoid(gate)``.
- GDN: ``[q | k | v]`` through the causal conv and the recurrence (a ``core`` callback: the pool's
  verify for the target, a carried-state step for the draft), the gated norm, ``out_proj``.
- MLP: SwiGLU; sparse MoE: softmax router, top-k (renormalised where ``norm_topk_prob``), the experts
  weighted, plus the shared expert times ``sigmoid(shared_expert_gate(x))``.

The invariant decoding mode (:attr:`HFConfig.invariant_dots <gdn_lossless_jax.model.hf.config.HFConfig.invariant_dots>`,
on by default on the CPU) computes the same functions with the demo model's primitives
(:mod:`gdn_lossless_jax.model.numerics`): each matmul's rows in dots of one fixed shape, the MoE's experts one at a
time over the tokens, the attention one query at a time, the elementwise functions in float64 rounded once, and every
rounding to the model's dtype behind an optimization barrier (:func:`~gdn_lossless_jax.model.numerics.settle`), at the points where transformers
rounds, so that a token's bits do not depend on how many tokens or rows a step has. Off, the functions are as above.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ...reference import ksum, pairwise_sum
# The demo model's attention parameters: a checkpoint's are the same arrays (its q_norm and k_norm
# zero-centred: rmsnorm scales by 1 + w here).
from ..model import AttentionParams, GDNParams, MLPParams, einsum, matmul, softmax
from ..numerics import per_query_attention, transcendental
from ..numerics import settle as _settle  # the invariant mode's pinned rounding
from .config import HFConfig

__all__ = [
    "AttentionParams", "MoEParams", "Block", "MTPParams", "HFParams", "rmsnorm", "gated_rmsnorm", "mlp", "moe",
    "attention", "gdn_mixer", "block", "final_hidden", "head_logits", "mtp_input",
]  # fmt: skip

F32 = jnp.float32


def _pytree(cls):
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


@_pytree
class MoEParams:
    """Sparse MoE: ``router [d, E]``, ``w_gate``, ``w_up [E, d, I]``, ``w_down [E, I, d]``, the shared
    expert (an :class:`~gdn_lossless_jax.model.model.MLPParams`) and ``shared_gate [d, 1]``."""

    router: jax.Array
    w_gate: jax.Array
    w_up: jax.Array
    w_down: jax.Array
    shared: MLPParams
    shared_gate: jax.Array


@_pytree
class Block:
    """A decoder block: ``norm1``, ``norm2 [d]`` (zero-centred), a mixer, an MLP or MoE."""

    norm1: jax.Array
    mixer: GDNParams | AttentionParams
    norm2: jax.Array
    mlp: MLPParams | MoEParams


@_pytree
class MTPParams:
    """The MTP block (vLLM's / SGLang's ``mtp.*`` layout): ``fc [2d, d]`` over ``[norm(embed) |
    norm(hidden)]``, the two pre-fc norms, one full-attention block, the output norm."""

    fc: jax.Array
    norm_embedding: jax.Array
    norm_hidden: jax.Array
    block: Block
    norm: jax.Array


@_pytree
class HFParams:
    """``embed [vocab, d]``, ``blocks``, ``final_norm [d]``, ``head [d, vocab]`` (None: tied to
    ``embed``), ``mtp`` (None: no MTP block loaded)."""

    embed: jax.Array
    blocks: tuple[Block, ...]
    final_norm: jax.Array
    head: jax.Array | None
    mtp: MTPParams | None


def _mean_sq(x):
    return ksum(x * x)[..., None] / x.shape[-1]


def _mul(a, b, invariant: bool):
    """``a * b`` in their promoted dtype, as transformers multiplies them (bf16 tensors: the product
    rounded to bf16). Invariant mode: the product of the operands in fp32 (exact for two bf16
    operands), rounded to that dtype once, behind a barrier (:func:`~gdn_lossless_jax.model.numerics.settle`)."""
    if not invariant:
        return a * b
    dt = jnp.result_type(a, b)
    return _settle((a.astype(F32) * b.astype(F32)).astype(dt), True)


def rmsnorm(x, weight, eps, *, invariant: bool = False):
    """transformers' ``Qwen3NextRMSNorm``: fp32, ``* (1 + weight)``, back to x's dtype; ``invariant``:
    the reciprocal square root in float64 (:func:`~gdn_lossless_jax.model.numerics.transcendental`)."""
    xf = x.astype(F32)
    y = xf * transcendental("rsqrt", _mean_sq(xf) + eps, invariant)
    return (y * (1.0 + weight.astype(F32))).astype(x.dtype)


def gated_rmsnorm(o, z, weight, eps, *, invariant: bool = False):
    """``Qwen3NextRMSNormGated``: ``weight * rmsnorm(o)`` (rounded to o's dtype first), times
    ``silu(z)`` in fp32. o, z ``[..., HV, V]`` -> ``[..., HV*V]`` in o's dtype. ``invariant``: the
    reciprocal square root and the SiLU in float64, each rounding pinned (:func:`~gdn_lossless_jax.model.numerics.settle`)."""
    dt = o.dtype
    of = o.astype(F32)
    y = _settle((of * transcendental("rsqrt", _mean_sq(of) + eps, invariant)).astype(dt), invariant)
    y = _mul(weight, y, invariant).astype(F32) * transcendental("silu", z.astype(F32), invariant)
    return y.astype(dt).reshape(*y.shape[:-2], -1)


def _swiglu(g, u, invariant: bool):
    """``silu(g) * u`` in g's dtype (transformers' ``act_fn(gate_proj(x)) * up_proj(x)``: the SiLU
    rounded to the dtype, then the product). ``invariant``: the SiLU in float64, both roundings pinned."""
    if not invariant:
        return jax.nn.silu(g) * u
    s = _settle(transcendental("silu", g.astype(F32), True).astype(g.dtype), True)
    return _mul(s, u, True)


def mlp(p: MLPParams, x, *, invariant: bool = False):
    """SwiGLU; ``invariant``: :func:`~gdn_lossless_jax.model.numerics.matmul`'s blocked dots and
    :func:`_swiglu`'s pinned roundings."""
    mm = functools.partial(matmul, invariant=invariant)
    return mm(_swiglu(mm(x, p.w_gate), mm(x, p.w_up), invariant), p.w_down)


def _experts(p: MoEParams, xf, invariant: bool):
    """Every routed expert over every token of ``xf [T, d]``: ``[T, E, d]`` in xf's dtype. Invariant
    mode: one expert at a time (a loop, ``lax.map``), each expert's three projections
    :func:`~gdn_lossless_jax.model.numerics.matmul`'s blocked dots, so that every token row is computed
    in dots of one shape (``"td,edi->tei"`` has no axis that both operands share, for
    :func:`~gdn_lossless_jax.model.numerics.einsum`'s row loop)."""
    if not invariant:
        h = jax.nn.silu(einsum("td,edi->tei", xf, p.w_gate)) * einsum("td,edi->tei", xf, p.w_up)
        return einsum("tei,eid->ted", h, p.w_down)
    mm = functools.partial(matmul, invariant=True)

    def expert(w):
        wg, wu, wd = w
        return mm(_swiglu(mm(xf, wg), mm(xf, wu), True), wd)  # [T, d]

    return jnp.swapaxes(jax.lax.map(expert, (p.w_gate, p.w_up, p.w_down)), 0, 1)


def moe(p: MoEParams, c: HFConfig, x):
    """The sparse MoE block over ``x [..., d]``. Every expert runs on every token and the top-k are
    weighted (no token dispatch: simple, and exact for any k; costs E/k times the routed work).
    Invariant mode (``c.invariant_dots``): the router and the experts in blocked dots
    (:func:`_experts`), the softmax's and the sigmoid's ``exp`` in float64, the weighted experts summed
    over E in a fixed order (:func:`~gdn_lossless_jax.reference.pairwise_sum`), the roundings pinned."""
    inv = c.invariant_dots
    mm = functools.partial(matmul, invariant=inv)
    shape = x.shape
    xf = x.reshape(-1, shape[-1])
    probs = softmax(mm(xf, p.router).astype(F32), invariant=inv)  # [T, E]
    top_v, top_i = jax.lax.top_k(probs, c.top_k)
    if c.norm_topk_prob:
        top_v = top_v / pairwise_sum(top_v)[..., None]
    top_v = top_v.astype(x.dtype)
    weights = jnp.zeros(probs.shape, x.dtype).at[jnp.arange(xf.shape[0])[:, None], top_i].set(top_v)
    out = _experts(p, xf, inv)  # [T, E, d] in x's dtype
    if inv:
        routed = pairwise_sum(jnp.swapaxes(_mul(out, weights[..., None], True).astype(F32), 1, 2))
        gate = _settle(transcendental("sigmoid", mm(xf, p.shared_gate).astype(F32), True).astype(x.dtype), True)
        shared = _mul(mlp(p.shared, xf, invariant=True), gate, True)
        routed = _settle(routed.astype(x.dtype), True)
        return (routed.astype(F32) + shared.astype(F32)).astype(x.dtype).reshape(shape)
    routed = (out * weights[..., None]).astype(F32).sum(axis=1).astype(x.dtype)
    shared = mlp(p.shared, xf) * jax.nn.sigmoid(matmul(xf, p.shared_gate))
    return (routed + shared).reshape(shape)


def ffn(p, c: HFConfig, x):
    return moe(p, c, x) if isinstance(p, MoEParams) else mlp(p, x, invariant=c.invariant_dots)


def _rope(x, positions, c: HFConfig):
    """Partial RoPE (rotate-half over the first ``rotary_dim`` dims), cos/sin rounded to x's dtype as
    transformers does. x ``[N, T, heads, hd]``, positions ``[N, T]``. Invariant mode: cos and sin in
    float64 (:func:`~gdn_lossless_jax.model.numerics.transcendental`), the two products rounded to x's
    dtype each behind a barrier (no program contracts one into the add: an FMA), then the sum."""
    inv = c.invariant_dots
    r = c.rotary_dim
    freq = 1.0 / (np.float32(c.rope_theta) ** (np.arange(0, r, 2, dtype=np.float32) / np.float32(r)))
    ang = positions.astype(F32)[..., None] * jnp.asarray(freq, F32)  # [N, T, r/2]
    emb = jnp.concatenate([ang, ang], axis=-1)[:, :, None, :]
    cos, sin = transcendental("cos", emb, inv).astype(x.dtype), transcendental("sin", emb, inv).astype(x.dtype)
    xr, xp = x[..., :r], x[..., r:]
    rot = jnp.concatenate([-xr[..., r // 2 :], xr[..., : r // 2]], axis=-1)
    if inv:
        a, b = _mul(xr, cos, True), _mul(rot, sin, True)
        rotated = (a.astype(F32) + b.astype(F32)).astype(x.dtype)
    else:
        rotated = xr * cos + rot * sin
    return jnp.concatenate([rotated, xp], axis=-1).astype(x.dtype)


def attention(p: AttentionParams, c: HFConfig, x, cache_k, cache_v, positions):
    """Gated attention of T new tokens per row over the row's KV cache (as
    :func:`gdn_lossless_jax.model.model.attention`: the new entries written at ``positions`` first,
    then each query attends up to its own position). Returns ``(out [N, T, d], (cache_k, cache_v))``.
    Invariant mode: each query alone (:func:`~gdn_lossless_jax.model.numerics.per_query_attention`,
    the scores times ``hd ** -0.5`` as here), the gate's sigmoid in float64, the roundings pinned."""
    N, T, _ = x.shape
    nq, nkv, hd = c.attn_heads, c.kv_heads, c.attn_head_dim
    inv = c.invariant_dots
    mm = functools.partial(matmul, invariant=inv)
    q = _settle(rmsnorm(mm(x, p.w_q).reshape(N, T, nq, hd), p.q_norm, c.rms_eps, invariant=inv), inv)
    k = _settle(rmsnorm(mm(x, p.w_k).reshape(N, T, nkv, hd), p.k_norm, c.rms_eps, invariant=inv), inv)
    v = mm(x, p.w_v).reshape(N, T, nkv, hd)
    q, k = _rope(q, positions, c), _rope(k, positions, c)
    n_idx = jnp.arange(N)[:, None]
    cache_k = cache_k.at[n_idx, positions].set(k.astype(cache_k.dtype), mode="drop")
    cache_v = cache_v.at[n_idx, positions].set(v.astype(cache_v.dtype), mode="drop")
    Tmax = cache_k.shape[1]
    qg = q.reshape(N, T, nkv, nq // nkv, hd)
    if inv:
        out = per_query_attention(qg, cache_k, cache_v.astype(x.dtype), positions, scale=hd**-0.5)
        out = _settle(out.astype(x.dtype).reshape(N, T, nq * hd), True)
        gate = _settle(transcendental("sigmoid", mm(x, p.w_gate).astype(F32), True).astype(x.dtype), True)
        return mm(_mul(out, gate, True), p.w_o), (cache_k, cache_v)
    scores = einsum("ntgrh,nsgh->ngrts", qg, cache_k, preferred_element_type=F32) * (hd**-0.5)
    mask = jnp.arange(Tmax)[None, None, :] <= positions[:, :, None]
    probs = softmax(jnp.where(mask[:, None, None], scores, -jnp.inf)).astype(x.dtype)
    out = einsum("ngrts,nsgh->ntgrh", probs, cache_v.astype(x.dtype), preferred_element_type=F32)
    out = out.astype(x.dtype).reshape(N, T, nq * hd) * jax.nn.sigmoid(matmul(x, p.w_gate))
    return matmul(out, p.w_o), (cache_k, cache_v)


def gdn_mixer(p: GDNParams, c: HFConfig, x, core):
    """A GDN layer; ``core(mixed_qkv [N, T, conv_dim], a, b [N, T, HV], p) -> o [N, T, HV, V]`` runs the
    conv and the recurrence. Invariant mode: blocked dots, the core's output rounded to x's dtype behind
    a barrier (:func:`~gdn_lossless_jax.model.numerics.settle`), the gated norm's."""
    N, T, _ = x.shape
    inv = c.invariant_dots
    mm = functools.partial(matmul, invariant=inv)
    o = _settle(core(mm(x, p.w_qkv), mm(x, p.w_a), mm(x, p.w_b), p).astype(x.dtype), inv)
    z = mm(x, p.w_z).reshape(N, T, c.num_v_heads, c.head_v_dim)
    return mm(gated_rmsnorm(o, z, p.norm, c.rms_eps, invariant=inv), p.w_out)


def block(blk: Block, c: HFConfig, h, mixer):
    """``h + mixer(norm1(h))``, then ``+ ffn(norm2(h))``; ``mixer`` takes the normalised stream.
    Invariant mode: the norms' and the mixer's, the FFN's and each residual sum's roundings pinned."""
    inv = c.invariant_dots
    s = functools.partial(_settle, invariant=inv)
    h = s(h + s(mixer(s(rmsnorm(h, blk.norm1, c.rms_eps, invariant=inv)))))
    return s(h + s(ffn(blk.mlp, c, s(rmsnorm(h, blk.norm2, c.rms_eps, invariant=inv)))))


def final_hidden(params: HFParams, c: HFConfig, h):
    """The final norm (what the MTP block takes as the target's hidden state)."""
    return _settle(rmsnorm(h, params.final_norm, c.rms_eps, invariant=c.invariant_dots), c.invariant_dots)


def head_logits(params: HFParams, hn, c: HFConfig):
    """fp32 logits of normalised hidden states (the LM head, or the embedding when tied); in ``c``'s
    invariant mode blocked dots."""
    w = params.embed.T if params.head is None else params.head
    return matmul(hn, w, preferred_element_type=F32, invariant=c.invariant_dots)


def mtp_input(params: HFParams, c: HFConfig, tokens, hidden):
    """The MTP block's input: ``fc([norm_e(embed(tokens)) | norm_h(hidden)])``."""
    m, inv = params.mtp, c.invariant_dots
    e = _settle(rmsnorm(params.embed[tokens], m.norm_embedding, c.rms_eps, invariant=inv), inv)
    h = _settle(rmsnorm(hidden.astype(e.dtype), m.norm_hidden, c.rms_eps, invariant=inv), inv)
    return matmul(jnp.concatenate([e, h], axis=-1), m.fc, invariant=inv)

