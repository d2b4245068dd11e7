"""OLMo-Hybrid (``model_type`` ``olmo_hybrid``, allenai/Olmo-Hybrid-7B) in JAX, as transformers 5.x computes it.

- GDN blocks (pre-norm): ``h + gdn(input_layernorm(h))``, then ``h + mlp(post_attention_layernorm(h))``.
  The GDN layer: separate ``q_proj``, ``k_proj``, ``v_proj`` (H, H, HV heads), ``a_proj``, ``b_proj`` and
  ``g_proj``; the causal conv over ``[q | k | v]`` without bias, SiLU; ``g = -exp(A_log) softplus(a +
  dt_bias)``; ``beta = sigmoid(b)``, times 2 with ``linear_allow_neg_eigval`` (beta in (0, 2): the
  transition ``I - beta k k^T`` can nearly reflect); l2-normalised q and k; the gated norm
  ``weight * rmsnorm(o) * silu(g_proj(x))`` with eps 1e-5; ``o_proj``.
- Attention blocks (post-norm): ``h + post_attention_layernorm(attn(h))``, then ``h +
  post_feedforward_layernorm(mlp(h))``; full causal GQA, q/k norms over the whole projection
  (``nq * hd`` and ``nkv * hd``), RoPE only where ``rope_theta`` is set (the released checkpoints set
  ``rope_parameters.rope_theta`` to null: no RoPE), cos/sin kept in fp32.
- RMSNorm times a plain ``weight``; SwiGLU MLPs; the final norm; an untied head unless
  ``tie_word_embeddings``.

The recurrence runs as one full-sequence chain per layer through the library's GDN reference
(:func:`gdn_lossless_jax.reference.prepare` and :func:`~gdn_lossless_jax.reference.chain`, the pinned
rule), with beta scaled by 2 after the reference's fp32 ``sigmoid`` (exact: a power of two). The
checkpoint layouts read: the Hub's (``q_conv1d``/``k_conv1d``/``v_conv1d`` split by key/key/value
width, the norms named ``attention_layer_norm`` / ``feedforward_layer_norm``), transformers' in-memory
names, and what ``save_pretrained`` writes (the conv in equal thirds).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ... import reference
from ...config import Geometry
from ..model import MLPParams, einsum, matmul, softmax
from .arch import gated_rmsnorm, mlp
from .family import Reader, causal_conv_silu, conv_weight, get, plain_rmsnorm, refuse

__all__ = ["OlmoHybridConfig", "OlmoGDNParams", "OlmoAttentionParams", "OlmoBlock", "OlmoHybridParams",
           "config_from_dict", "load_params", "forward", "RENAMES", "linear_inputs", "linear_output",
           "linear_weights", "attention", "block", "head", "geometry"]  # fmt: skip

F32 = jnp.float32
#: transformers' conversion mapping for olmo_hybrid (Hub name -> in-memory name).
RENAMES = ((r"attention_layer_norm", "input_layernorm"), (r"feedforward_layer_norm", "post_attention_layernorm"))
GATED_NORM_EPS = 1e-5  # FLA's FusedRMSNormGated default, as transformers' OlmoHybridGatedDeltaNet uses


@dataclasses.dataclass(frozen=True)
class OlmoHybridConfig:
    """An OLMo-Hybrid checkpoint's sizes (static, hashable).

    ``rope_theta`` None: no RoPE. ``beta_scale``: 2.0 with ``linear_allow_neg_eigval``, else 1.0."""

    vocab: int
    d_model: int
    layer_types: tuple[str, ...]
    intermediate_size: int
    attn_heads: int
    kv_heads: int
    attn_head_dim: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    beta_scale: float
    rope_theta: float | None
    rms_eps: float
    tie_embeddings: bool = False
    dtype: str = "float32"
    name: str = "checkpoint"
    model_type: str = "olmo_hybrid"

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    def describe(self) -> str:
        gdn, attn = self.layer_types.count("linear_attention"), self.layer_types.count("full_attention")
        return (f"olmo_hybrid {self.name}: {len(self.layer_types)} blocks ({gdn} GDN H={self.num_k_heads} "
                f"HV={self.num_v_heads} K={self.head_k_dim} V={self.head_v_dim}, beta scale {self.beta_scale:g}; "
                f"{attn} attention {self.attn_heads}q/{self.kv_heads}kv x {self.attn_head_dim}, "
                f"{'no RoPE' if self.rope_theta is None else f'RoPE theta {self.rope_theta:g}'}), d_model "
                f"{self.d_model}, vocab {self.vocab}, {self.dtype}")  # fmt: skip


def _pytree(cls):
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


@_pytree
class OlmoGDNParams:
    """``w_q``, ``w_k [d, H*K]``, ``w_v``, ``w_g [d, HV*V]``, ``w_a``, ``w_b [d, HV]``, ``conv [conv_dim, Kc]``,
    ``A_log``, ``dt_bias [HV]`` (fp32), ``norm [V]``, ``w_o [HV*V, d]``."""

    w_q: jax.Array
    w_k: jax.Array
    w_v: jax.Array
    w_g: jax.Array
    w_a: jax.Array
    w_b: jax.Array
    conv: jax.Array
    A_log: jax.Array
    dt_bias: jax.Array
    norm: jax.Array
    w_o: jax.Array


@_pytree
class OlmoAttentionParams:
    """``w_q [d, nq*hd]``, ``w_k``, ``w_v [d, nkv*hd]``, ``q_norm [nq*hd]``, ``k_norm [nkv*hd]``, ``w_o``."""

    w_q: jax.Array
    w_k: jax.Array
    w_v: jax.Array
    q_norm: jax.Array
    k_norm: jax.Array
    w_o: jax.Array


@_pytree
class OlmoBlock:
    """A block: GDN (``norm1`` before the mixer, ``norm2`` before the MLP) or attention (``norm1`` after the
    mixer, ``norm2`` after the MLP)."""

    mixer: OlmoGDNParams | OlmoAttentionParams
    norm1: jax.Array
    norm2: jax.Array
    mlp: MLPParams


@_pytree
class OlmoHybridParams:
    embed: jax.Array
    blocks: tuple[OlmoBlock, ...]
    final_norm: jax.Array
    head: jax.Array | None


def _rope_theta(full: dict, file: str) -> float | None:
    """transformers' reading: ``rope_parameters.rope_theta`` (or a top-level ``rope_theta``) when given, null
    meaning no RoPE; neither: RoPE at theta 10000 (transformers' default)."""
    rp = full.get("rope_parameters")
    if full.get("rope_scaling"):
        refuse(file, f"rope_scaling {full['rope_scaling']!r} is not supported")
    if isinstance(rp, dict) and "rope_theta" in rp:
        theta, kind = rp["rope_theta"], rp.get("rope_type", rp.get("type", "default"))
    else:
        theta, kind = full.get("rope_theta", 10000.0), "default"
    if theta is not None and kind != "default":
        refuse(file, f"rope_type {kind!r} is not supported (only 'default' RoPE, or none)")
    return None if theta is None else float(theta)


def config_from_dict(full: dict, *, dtype: str, name: str, file: str) -> OlmoHybridConfig:
    g = lambda k, d=None, required=False: get(full, k, file, d, required)  # noqa: E731
    n = g("num_hidden_layers", required=True)
    types = g("layer_types")
    if types is None:  # transformers' default: full attention every 4th block (at least the last one)
        types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
        if "full_attention" not in types:
            types[-1] = "full_attention"
    types = tuple(types)
    if len(types) != n or set(types) - {"linear_attention", "full_attention"}:
        refuse(file, f"layer_types must list num_hidden_layers={n} entries 'linear_attention' or 'full_attention', "
                     f"got {list(types)}")  # fmt: skip
    if g("hidden_act", "silu") != "silu":
        refuse(file, f"hidden_act {g('hidden_act')!r} is not supported (expected 'silu')")
    if g("attention_bias", False):
        refuse(file, "attention_bias=true is not supported")
    d, nq = g("hidden_size", required=True), g("num_attention_heads", required=True)
    hk = g("linear_num_key_heads") or nq
    kdim = g("linear_key_head_dim") or int(0.75 * d / hk)
    return OlmoHybridConfig(
        vocab=g("vocab_size", required=True), d_model=d, layer_types=types,
        intermediate_size=g("intermediate_size", required=True), attn_heads=nq, kv_heads=g("num_key_value_heads") or nq,
        attn_head_dim=g("head_dim") or d // nq, num_k_heads=hk, num_v_heads=g("linear_num_value_heads") or nq,
        head_k_dim=kdim, head_v_dim=g("linear_value_head_dim") or 2 * kdim, conv_kernel=g("linear_conv_kernel_dim", 4),
        beta_scale=2.0 if g("linear_allow_neg_eigval", True) else 1.0, rope_theta=_rope_theta(full, file),
        rms_eps=float(g("rms_norm_eps", 1e-6)), tie_embeddings=bool(g("tie_word_embeddings", False)), dtype=dtype,
        name=name,
    )  # fmt: skip


def _mlp(r: Reader, p: str, d: int, i: int) -> MLPParams:
    return MLPParams(r.linear(p + "gate_proj.weight", i, d), r.linear(p + "up_proj.weight", i, d),
                     r.linear(p + "down_proj.weight", d, i))  # fmt: skip


def _gdn(r: Reader, p: str, c: OlmoHybridConfig) -> OlmoGDNParams:
    d, HV, Kc = c.d_model, c.num_v_heads, c.conv_kernel
    conv = conv_weight(r, p, (c.key_dim, c.key_dim, c.value_dim), Kc)
    return OlmoGDNParams(
        w_q=r.linear(p + "q_proj.weight", c.key_dim, d), w_k=r.linear(p + "k_proj.weight", c.key_dim, d),
        w_v=r.linear(p + "v_proj.weight", c.value_dim, d), w_g=r.linear(p + "g_proj.weight", c.value_dim, d),
        w_a=r.linear(p + "a_proj.weight", HV, d), w_b=r.linear(p + "b_proj.weight", HV, d), conv=r.arr(conv),
        A_log=jnp.asarray(r.raw(p + "A_log", (HV,)), F32), dt_bias=jnp.asarray(r.raw(p + "dt_bias", (HV,)), F32),
        norm=r.vector(p + "o_norm.weight", c.head_v_dim), w_o=r.linear(p + "o_proj.weight", d, c.value_dim),
    )  # fmt: skip


def _attention(r: Reader, p: str, c: OlmoHybridConfig) -> OlmoAttentionParams:
    d, nq, nkv, hd = c.d_model, c.attn_heads, c.kv_heads, c.attn_head_dim
    return OlmoAttentionParams(
        w_q=r.linear(p + "q_proj.weight", nq * hd, d), w_k=r.linear(p + "k_proj.weight", nkv * hd, d),
        w_v=r.linear(p + "v_proj.weight", nkv * hd, d), q_norm=r.vector(p + "q_norm.weight", nq * hd),
        k_norm=r.vector(p + "k_norm.weight", nkv * hd), w_o=r.linear(p + "o_proj.weight", d, nq * hd),
    )  # fmt: skip


def load_params(r: Reader, c: OlmoHybridConfig) -> OlmoHybridParams:
    d = c.d_model
    blocks = []
    for i, t in enumerate(c.layer_types):
        p = f"model.layers.{i}."
        ffn = _mlp(r, p + "mlp.", d, c.intermediate_size)
        if t == "linear_attention":  # pre-norm
            blk = OlmoBlock(_gdn(r, p + "linear_attn.", c), r.vector(p + "input_layernorm.weight", d),
                            r.vector(p + "post_attention_layernorm.weight", d), ffn)  # fmt: skip
        else:  # post-norm
            blk = OlmoBlock(_attention(r, p + "self_attn.", c), r.vector(p + "post_attention_layernorm.weight", d),
                            r.vector(p + "post_feedforward_layernorm.weight", d), ffn)  # fmt: skip
        blocks.append(blk)
    embed = r.arr(r.raw("model.embed_tokens.weight", (c.vocab, d)))
    head = None if c.tie_embeddings else r.linear("lm_head.weight", c.vocab, d)
    return OlmoHybridParams(embed, tuple(blocks), r.vector("model.norm.weight", d), head)


def linear_inputs(p: OlmoGDNParams, c: OlmoHybridConfig, x):
    """The GDN mixer's inputs over ``x [N, T, d]`` (normalised): ``([q | k | v] [N, T, conv_dim]`` before the
    conv, ``a``, ``b [N, T, HV])``."""
    mixed = jnp.concatenate([matmul(x, p.w_q), matmul(x, p.w_k), matmul(x, p.w_v)], -1)
    return mixed, matmul(x, p.w_a), matmul(x, p.w_b)


def linear_output(p: OlmoGDNParams, c: OlmoHybridConfig, x, o):
    """The GDN mixer's output from the recurrence's ``o [N, T, HV, V]``: the gated norm, ``o_proj``."""
    N, T, _ = x.shape
    z = matmul(x, p.w_g).reshape(N, T, c.num_v_heads, c.head_v_dim)
    return matmul(gated_rmsnorm(o, z, p.norm, GATED_NORM_EPS), p.w_o)


def _gdn_layer(p: OlmoGDNParams, c: OlmoHybridConfig, x):
    """The GDN mixer over ``x [N, T, d]`` (normalised), the recurrence from an empty state."""
    N, T, _ = x.shape
    H, HV, K, V = c.num_k_heads, c.num_v_heads, c.head_k_dim, c.head_v_dim
    pre, a, b = linear_inputs(p, c, x)
    mixed = causal_conv_silu(pre, p.conv)
    q = mixed[..., : H * K].reshape(N, T, H, K)
    k = mixed[..., H * K : 2 * H * K].reshape(N, T, H, K)
    v = mixed[..., 2 * H * K :].reshape(N, T, HV, V)
    qn, kn, g, beta = reference.prepare(q, k, a, b, p.A_log, p.dt_bias, K**-0.5)
    beta = beta * np.float32(c.beta_scale)  # exact: 1 or 2
    state0 = jnp.zeros((N, HV, V, K), F32)
    o, _ = reference.chain(state0, qn, kn, v, g, beta, record="tuples", out_dtype=x.dtype)
    return linear_output(p, c, x, o)


def _rope(x, c: OlmoHybridConfig, positions=None):
    """Full-width rotate-half RoPE at positions 0..T-1 (or ``positions [N, T]``), cos/sin in fp32 (not rounded
    to x's dtype), the result rounded to x's dtype. x ``[N, T, heads, hd]``."""
    hd, T = x.shape[-1], x.shape[1]
    inv = 1.0 / (np.float32(c.rope_theta) ** (np.arange(0, hd, 2, dtype=np.float32) / np.float32(hd)))
    if positions is None:
        ang = jnp.arange(T, dtype=F32)[:, None] * jnp.asarray(inv, F32)
        emb = jnp.concatenate([ang, ang], -1)[None, :, None, :]
    else:
        ang = positions.astype(F32)[..., None] * jnp.asarray(inv, F32)
        emb = jnp.concatenate([ang, ang], -1)[:, :, None, :]
    xf = x.astype(F32)
    rot = jnp.concatenate([-xf[..., hd // 2 :], xf[..., : hd // 2]], -1)
    return (xf * jnp.cos(emb) + rot * jnp.sin(emb)).astype(x.dtype)


def attention(p: OlmoAttentionParams, c: OlmoHybridConfig, x, mask=None, positions=None):
    """Full causal GQA over ``x [N, T, d]`` (the block's input: attention blocks are post-norm). ``mask [N, T, T]``
    bool (query, key), default causal, and ``positions [N, T]`` for RoPE, default ``0..T-1``: a draft tree's
    (each node sees its ancestors, at its depth)."""
    N, T, _ = x.shape
    nq, nkv, hd = c.attn_heads, c.kv_heads, c.attn_head_dim
    q = plain_rmsnorm(matmul(x, p.w_q), p.q_norm, c.rms_eps).reshape(N, T, nq, hd)
    k = plain_rmsnorm(matmul(x, p.w_k), p.k_norm, c.rms_eps).reshape(N, T, nkv, hd)
    v = matmul(x, p.w_v).reshape(N, T, nkv, hd)
    if c.rope_theta is not None:
        q, k = _rope(q, c, positions), _rope(k, c, positions)
    qg = q.reshape(N, T, nkv, nq // nkv, hd)
    scores = einsum("ntgrh,nsgh->ngrts", qg, k, preferred_element_type=F32) * np.float32(hd**-0.5)
    mask = jnp.tril(jnp.ones((T, T), bool)) if mask is None else mask[:, None, None]
    probs = softmax(jnp.where(mask, scores, -jnp.inf)).astype(x.dtype)
    out = einsum("ngrts,nsgh->ntgrh", probs, v, preferred_element_type=F32).astype(x.dtype)
    return matmul(out.reshape(N, T, nq * hd), p.w_o)


def block(blk: OlmoBlock, c: OlmoHybridConfig, h, mixer, kind: str):
    """One block over ``h``, its mixer ``mixer(x) -> y`` given: GDN blocks (``kind`` ``"linear_attention"``)
    pre-norm, the mixer called on the normalised ``h``; attention blocks post-norm, called on ``h``."""
    if kind == "linear_attention":
        h = h + mixer(plain_rmsnorm(h, blk.norm1, c.rms_eps))
        return h + mlp(blk.mlp, plain_rmsnorm(h, blk.norm2, c.rms_eps))
    h = h + plain_rmsnorm(mixer(h), blk.norm1, c.rms_eps)
    return h + plain_rmsnorm(mlp(blk.mlp, h), blk.norm2, c.rms_eps)


@functools.partial(jax.jit, static_argnums=1)
def _gdn_block(blk: OlmoBlock, c: OlmoHybridConfig, h):
    return block(blk, c, h, lambda x: _gdn_layer(blk.mixer, c, x), "linear_attention")


@functools.partial(jax.jit, static_argnums=1)
def _attention_block(blk: OlmoBlock, c: OlmoHybridConfig, h):
    return block(blk, c, h, lambda x: attention(blk.mixer, c, x), "full_attention")


@functools.partial(jax.jit, static_argnums=1)
def head(params: OlmoHybridParams, c: OlmoHybridConfig, h):
    h = plain_rmsnorm(h, params.final_norm, c.rms_eps)
    w = params.embed.T if params.head is None else params.head
    return matmul(h, w, preferred_element_type=F32)


def forward(params: OlmoHybridParams, c: OlmoHybridConfig, ids):
    """fp32 logits ``[B, T, vocab]`` of ``ids [B, T]`` from empty states. Each block is its own jitted program
    (blocks of one kind share one compilation)."""
    h = params.embed[jnp.asarray(ids)]
    for blk, t in zip(params.blocks, c.layer_types):
        h = (_gdn_block if t == "linear_attention" else _attention_block)(blk, c, h)
    return head(params, c, h)


def linear_weights(p: OlmoGDNParams) -> tuple:
    """``(conv [conv_dim, Kc], conv bias or None, A_log [HV], dt_bias [HV])`` of a GDN mixer, as the pool takes them."""
    return p.conv, None, p.A_log, p.dt_bias


def geometry(c: OlmoHybridConfig) -> Geometry:
    """The pool's geometry of the checkpoint's GDN layers."""
    return Geometry(c.name, gdn_layers=c.layer_types.count("linear_attention"), num_k_heads=c.num_k_heads,
                    num_v_heads=c.num_v_heads, head_k_dim=c.head_k_dim, head_v_dim=c.head_v_dim,
                    conv_kernel=c.conv_kernel, layers=len(c.layer_types), kv_heads=c.kv_heads,
                    kv_head_dim=c.attn_head_dim)  # fmt: skip
