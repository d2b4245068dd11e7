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
"""

from __future__ import annotations

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np

from ...reference import ksum, pairwise_sum
# The demo model's attention parameters: a checkpoint's are the same arrays (its q_norm and k_norm
# zero-centred: rmsnorm scales by 1 + w here).
from ..model import AttentionParams, GDNParams, MLPParams, einsum, matmul, softmax
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


def rmsnorm(x, weight, eps):
    """transformers' ``Qwen3NextRMSNorm``: fp32, ``* (1 + weight)``, back to x's dtype."""
    xf = x.astype(F32)
    y = xf * jax.lax.rsqrt(_mean_sq(xf) + eps)
    return (y * (1.0 + weight.astype(F32))).astype(x.dtype)


def gated_rmsnorm(o, z, weight, eps):
    """``Qwen3NextRMSNormGated``: ``weight * rmsnorm(o)`` (rounded to o's dtype first), times
    ``silu(z)`` in fp32. o, z ``[..., HV, V]`` -> ``[..., HV*V]`` in o's dtype."""
    dt = o.dtype
    of = o.astype(F32)
    y = (of * jax.lax.rsqrt(_mean_sq(of) + eps)).astype(dt)
    y = (weight * y).astype(F32) * jax.nn.silu(z.astype(F32))
    return y.astype(dt).reshape(*y.shape[:-2], -1)


def mlp(p: MLPParams, x):
    return matmul(jax.nn.silu(matmul(x, p.w_gate)) * matmul(x, p.w_up), p.w_down)


def moe(p: MoEParams, c: HFConfig, x):
    """The sparse MoE block over ``x [..., d]``. Every expert runs on every token and the top-k are
    weighted (no token dispatch: simple, and exact for any k; costs E/k times the routed work)."""
    shape = x.shape
    xf = x.reshape(-1, shape[-1])
    probs = softmax(matmul(xf, p.router).astype(F32))  # [T, E]
    top_v, top_i = jax.lax.top_k(probs, c.top_k)
    if c.norm_topk_prob:
        top_v = top_v / pairwise_sum(top_v)[..., None]
    top_v = top_v.astype(x.dtype)
    weights = jnp.zeros(probs.shape, x.dtype).at[jnp.arange(xf.shape[0])[:, None], top_i].set(top_v)
    h = jax.nn.silu(einsum("td,edi->tei", xf, p.w_gate)) * einsum("td,edi->tei", xf, p.w_up)
    out = einsum("tei,eid->ted", h, p.w_down)  # [T, E, d] in x's dtype
    routed = (out * weights[..., None]).astype(F32).sum(axis=1).astype(x.dtype)
    shared = mlp(p.shared, xf) * jax.nn.sigmoid(matmul(xf, p.shared_gate))
    return (routed + shared).reshape(shape)


def ffn(p, c: HFConfig, x):
    return moe(p, c, x) if isinstance(p, MoEParams) else mlp(p, x)


def _rope(x, positions, c: HFConfig):
    """Partial RoPE (rotate-half over the first ``rotary_dim`` dims), cos/sin rounded to x's dtype as
    transformers does. x ``[N, T, heads, hd]``, positions ``[N, T]``."""
    r = c.rotary_dim
    inv = 1.0 / (np.float32(c.rope_theta) ** (np.arange(0, r, 2, dtype=np.float32) / np.float32(r)))
    ang = positions.astype(F32)[..., None] * jnp.asarray(inv, F32)  # [N, T, r/2]
    emb = jnp.concatenate([ang, ang], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    xr, xp = x[..., :r], x[..., r:]
    rot = jnp.concatenate([-xr[..., r // 2 :], xr[..., : r // 2]], axis=-1)
    return jnp.concatenate([xr * cos + rot * sin, xp], axis=-1).astype(x.dtype)


def attention(p: AttentionParams, c: HFConfig, x, cache_k, cache_v, positions):
    """Gated attention of T new tokens per row over the row's KV cache (as
    :func:`gdn_lossless_jax.model.model.attention`: the new entries written at ``positions`` first,
    then each query attends up to its own position). Returns ``(out [N, T, d], (cache_k, cache_v))``."""
    N, T, _ = x.shape
    nq, nkv, hd = c.attn_heads, c.kv_heads, c.attn_head_dim
    q = rmsnorm(matmul(x, p.w_q).reshape(N, T, nq, hd), p.q_norm, c.rms_eps)
    k = rmsnorm(matmul(x, p.w_k).reshape(N, T, nkv, hd), p.k_norm, c.rms_eps)
    v = matmul(x, p.w_v).reshape(N, T, nkv, hd)
    q, k = _rope(q, positions, c), _rope(k, positions, c)
    n_idx = jnp.arange(N)[:, None]
    cache_k = cache_k.at[n_idx, positions].set(k.astype(cache_k.dtype), mode="drop")
    cache_v = cache_v.at[n_idx, positions].set(v.astype(cache_v.dtype), mode="drop")
    Tmax = cache_k.shape[1]
    qg = q.reshape(N, T, nkv, nq // nkv, hd)
    scores = einsum("ntgrh,nsgh->ngrts", qg, cache_k, preferred_element_type=F32) * (hd**-0.5)
    mask = jnp.arange(Tmax)[None, None, :] <= positions[:, :, None]
    probs = softmax(jnp.where(mask[:, None, None], scores, -jnp.inf)).astype(x.dtype)
    out = einsum("ngrts,nsgh->ntgrh", probs, cache_v.astype(x.dtype), preferred_element_type=F32)
    out = out.astype(x.dtype).reshape(N, T, nq * hd) * jax.nn.sigmoid(matmul(x, p.w_gate))
    return matmul(out, p.w_o), (cache_k, cache_v)


def gdn_mixer(p: GDNParams, c: HFConfig, x, core):
    """A GDN layer; ``core(mixed_qkv [N, T, conv_dim], a, b [N, T, HV], p) -> o [N, T, HV, V]`` runs the
    conv and the recurrence."""
    N, T, _ = x.shape
    o = core(matmul(x, p.w_qkv), matmul(x, p.w_a), matmul(x, p.w_b), p)
    z = matmul(x, p.w_z).reshape(N, T, c.num_v_heads, c.head_v_dim)
    return matmul(gated_rmsnorm(o.astype(x.dtype), z, p.norm, c.rms_eps), p.w_out)


def block(blk: Block, c: HFConfig, h, mixer):
    """``h + mixer(norm1(h))``, then ``+ ffn(norm2(h))``; ``mixer`` takes the normalised stream."""
    h = h + mixer(rmsnorm(h, blk.norm1, c.rms_eps))
    return h + ffn(blk.mlp, c, rmsnorm(h, blk.norm2, c.rms_eps))


def final_hidden(params: HFParams, c: HFConfig, h):
    """The final norm (what the MTP block takes as the target's hidden state)."""
    return rmsnorm(h, params.final_norm, c.rms_eps)


def head_logits(params: HFParams, hn):
    """fp32 logits of normalised hidden states (the LM head, or the embedding when tied)."""
    w = params.embed.T if params.head is None else params.head
    return matmul(hn, w, preferred_element_type=F32)


def mtp_input(params: HFParams, c: HFConfig, tokens, hidden):
    """The MTP block's input: ``fc([norm_e(embed(tokens)) | norm_h(hidden)])``."""
    m = params.mtp
    e = rmsnorm(params.embed[tokens], m.norm_embedding, c.rms_eps)
    h = rmsnorm(hidden.astype(e.dtype), m.norm_hidden, c.rms_eps)
    return matmul(jnp.concatenate([e, h], axis=-1), m.fc)

