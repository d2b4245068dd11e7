"""Kimi Linear (``model_type`` ``kimi_linear``, moonshotai/Kimi-Linear-48B-A3B-Instruct) in JAX, as
transformers 5.x computes it.

Every block is pre-norm: ``h + mixer(input_layernorm(h))``, then ``h + ffn(post_attention_layernorm(h))``,
RMSNorm ``weight * rmsnorm(x).to(dtype)`` (a plain weight).

- KDA blocks (:mod:`gdn_lossless_jax.kda`): ``q_proj``, ``k_proj``, ``v_proj`` (H heads each, K = V =
  ``linear_head_dim``); the causal conv over ``[q | k | v]`` without bias, SiLU; the forget gate
  ``g = -exp(A_log[h]) softplus(f_b(f_a(x)) + dt_bias)`` per channel ``[H, K]``; ``beta = sigmoid(b_proj(x))``;
  l2-normalised q and k (divided by the square root); the output gated norm with a **sigmoid** gate,
  ``weight * rmsnorm(o) * sigmoid(g_b(g_a(x)))`` in fp32 (eps ``rms_norm_eps``); ``o_proj``.
- MLA blocks without RoPE: ``q_proj`` (no q LoRA) gives per head ``[q_nope | q_rot]``;
  ``kv_a_proj_with_mqa`` gives the latent ``[c_kv (kv_lora_rank) | k_rot (qk_rope_head_dim)]``, the
  latent normalised by ``kv_a_layernorm`` (what a cache holds), ``kv_b_proj`` of it gives per head
  ``[k_nope | v]``; the key is ``[k_nope | k_rot]`` with ``k_rot`` shared by every head, no rotation
  applied; causal softmax attention scaled by ``(nope + rope) ** -0.5``; ``o_proj``.
- MLP: a dense SwiGLU in the first ``first_k_dense_replace`` blocks; after them the MoE: fp32 router
  logits, ``scores = sigmoid(logits)``; the choice adds ``e_score_correction_bias`` (selection only);
  experts in ``num_expert_group`` groups, a group's score the sum of its two best choices, the
  ``topk_group`` best groups kept; the top ``num_experts_per_token`` experts among them, weighted by their
  *scores* (renormalised, ``+ 1e-20``, where ``moe_renormalize``) times ``routed_scaling_factor``; the
  experts' outputs summed in expert order in the model's dtype; plus the shared experts (a SwiGLU of
  ``moe_intermediate_size * num_shared_experts``).

The KDA recurrence runs as one full-sequence chain per layer through :func:`gdn_lossless_jax.kda.chain`
(the pinned rule). The layouts read: the Hub's (``config.json`` with ``linear_attn_config`` and
``first_k_dense_replace``; ``q_conv1d``/``k_conv1d``/``v_conv1d``; ``self_attn.f_a_proj`` etc.;
``block_sparse_moe.`` with experts one by one, ``experts.<e>.w1`` (gate), ``w3`` (up), ``w2`` (down)),
transformers' in-memory names (``mlp.``, ``forget_gate.``, fused ``experts.gate_up_proj [E, 2I, d]`` and
``experts.down_proj [E, d, I]``, ``layer_types`` / ``mlp_layer_types`` / ``linear_*`` in the config) and
what ``save_pretrained`` writes (Hub names throughout, the mapped config names).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ... import kda
from ...config import Geometry
from ..model import MLPParams, einsum, matmul, softmax
from .arch import mlp
from .family import Reader, causal_conv_silu, conv_weight, get, plain_rmsnorm, refuse

__all__ = ["KimiLinearConfig", "KDAParams", "MLAParams", "KimiMoEParams", "KimiBlock", "KimiLinearParams",
           "config_from_dict", "load_params", "forward", "RENAMES", "route", "linear_inputs", "linear_output",
           "linear_weights", "attention", "block", "head", "geometry"]  # fmt: skip

F32 = jnp.float32
#: transformers' conversion mapping for kimi_linear (Hub name -> in-memory name); the experts' per-expert
#: ``w1``/``w2``/``w3`` are read one by one (:func:`_moe`), not renamed.
RENAMES = (
    (r"self_attn\.f_a_proj\.", "self_attn.forget_gate.f_a_proj."),
    (r"self_attn\.f_b_proj\.", "self_attn.forget_gate.f_b_proj."),
    (r"self_attn\.dt_bias$", "self_attn.forget_gate.dt_bias"),
    (r"self_attn\.A_log$", "self_attn.forget_gate.A_log"),
    (r"\.block_sparse_moe\.", ".mlp."),
)


@dataclasses.dataclass(frozen=True)
class KimiLinearConfig:
    """A Kimi Linear checkpoint's sizes (static, hashable)."""

    vocab: int
    d_model: int
    layer_types: tuple[str, ...]
    mlp_types: tuple[str, ...]
    intermediate_size: int
    num_heads: int  # KDA heads H (q, k and v alike)
    head_dim: int  # KDA K = V
    conv_kernel: int
    attn_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    num_experts: int
    top_k: int
    num_groups: int
    topk_group: int
    moe_intermediate_size: int
    num_shared_experts: int
    routed_scaling_factor: float
    renormalize: bool
    rms_eps: float
    tie_embeddings: bool = False
    dtype: str = "float32"
    name: str = "checkpoint"
    model_type: str = "kimi_linear"

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def qkv_dim(self) -> int:
        return self.num_heads * self.head_dim

    def describe(self) -> str:
        kda_n, mla_n = self.layer_types.count("linear_attention"), self.layer_types.count("full_attention")
        return (f"kimi_linear {self.name}: {len(self.layer_types)} blocks ({kda_n} KDA H={self.num_heads} "
                f"K=V={self.head_dim}, {mla_n} MLA {self.attn_heads} heads, latent {self.kv_lora_rank}; "
                f"{self.mlp_types.count('sparse')} MoE {self.num_experts} experts in {self.num_groups} groups, top-"
                f"{self.topk_group} groups, top-{self.top_k}), d_model {self.d_model}, vocab {self.vocab}, "
                f"{self.dtype}")  # fmt: skip


def _pytree(cls):
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


@_pytree
class KDAParams:
    """``w_q``, ``w_k``, ``w_v [d, H*K]``, ``conv [3*H*K, Kc]``, ``w_fa [d, K]``, ``w_fb [K, H*K]``, ``A_log [H]``,
    ``dt_bias [H, K]`` (fp32), ``w_b [d, H]``, ``w_ga [d, K]``, ``w_gb [K, H*K]``, ``norm [K]``, ``w_o [H*K, d]``."""

    w_q: jax.Array
    w_k: jax.Array
    w_v: jax.Array
    conv: jax.Array
    w_fa: jax.Array
    w_fb: jax.Array
    A_log: jax.Array
    dt_bias: jax.Array
    w_b: jax.Array
    w_ga: jax.Array
    w_gb: jax.Array
    norm: jax.Array
    w_o: jax.Array


@_pytree
class MLAParams:
    """``w_q [d, nh*(nope+rope)]``, ``w_kva [d, rank+rope]``, ``kv_norm [rank]``, ``w_kvb [rank, nh*(nope+v)]``,
    ``w_o [nh*v, d]``."""

    w_q: jax.Array
    w_kva: jax.Array
    kv_norm: jax.Array
    w_kvb: jax.Array
    w_o: jax.Array


@_pytree
class KimiMoEParams:
    """``router [d, E]`` and ``bias [E]`` (fp32), ``w_gate``, ``w_up [E, d, I]``, ``w_down [E, I, d]``, ``shared``."""

    router: jax.Array
    bias: jax.Array
    w_gate: jax.Array
    w_up: jax.Array
    w_down: jax.Array
    shared: MLPParams


@_pytree
class KimiBlock:
    norm1: jax.Array
    mixer: KDAParams | MLAParams
    norm2: jax.Array
    mlp: MLPParams | KimiMoEParams


@_pytree
class KimiLinearParams:
    embed: jax.Array
    blocks: tuple[KimiBlock, ...]
    final_norm: jax.Array
    head: jax.Array | None


def config_from_dict(full: dict, *, dtype: str, name: str, file: str) -> KimiLinearConfig:
    """transformers' reading of a ``config.json``: the mapped names or the Hub's (``linear_attn_config`` wins
    over ``linear_*``; ``layer_types`` over ``linear_attn_config``'s layer lists; ``mlp_layer_types`` over
    ``first_k_dense_replace``)."""
    g = lambda k, d=None, required=False: get(full, k, file, d, required)  # noqa: E731
    n = g("num_hidden_layers", required=True)
    lac = g("linear_attn_config") or {}
    if not isinstance(lac, dict):
        refuse(file, f"linear_attn_config must be a mapping, got {lac!r}")
    types = g("layer_types")
    if types is None and "kda_layers" in lac and "full_attn_layers" in lac:  # 1-indexed in the Hub's config
        types = [None] * n
        for i in lac["full_attn_layers"]:
            types[i - 1] = "full_attention"
        for i in lac["kda_layers"]:
            types[i - 1] = "linear_attention"
    elif types is None:  # transformers' default
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    types = tuple(types)
    if len(types) != n or set(types) - {"linear_attention", "full_attention"}:
        refuse(file, f"the layer types must name each of num_hidden_layers={n} blocks 'linear_attention' or "
                     f"'full_attention', got {list(types)}")  # fmt: skip
    mlp_types = g("mlp_layer_types")
    if mlp_types is None:
        k = g("first_k_dense_replace", 1)
        mlp_types = ["dense" if i < k else "sparse" for i in range(n)]
    mlp_types = tuple(mlp_types)
    if len(mlp_types) != n or set(mlp_types) - {"dense", "sparse"}:
        refuse(file, f"mlp_layer_types must list num_hidden_layers={n} entries 'dense' or 'sparse', got "
                     f"{list(mlp_types)}")  # fmt: skip
    if g("moe_layer_freq", 1) != 1:
        refuse(file, f"moe_layer_freq {g('moe_layer_freq')!r} is not supported (transformers reads 1)")
    if g("moe_router_activation_func", "sigmoid") != "sigmoid":
        refuse(file, f"moe_router_activation_func {g('moe_router_activation_func')!r} is not supported (expected "
                     f"'sigmoid')")  # fmt: skip
    if g("hidden_act", "silu") != "silu":
        refuse(file, f"hidden_act {g('hidden_act')!r} is not supported (expected 'silu')")
    if g("attention_bias", False):
        refuse(file, "attention_bias=true is not supported")
    if g("q_lora_rank") is not None:
        refuse(file, f"q_lora_rank {g('q_lora_rank')!r} is not supported (the released checkpoints: null)")
    nh = g("num_attention_heads", required=True)
    if (g("num_key_value_heads") or nh) != nh:
        refuse(file, f"num_key_value_heads {g('num_key_value_heads')} must equal num_attention_heads {nh} (MLA "
                     f"expands the latent to every head)")  # fmt: skip
    groups, experts = g(("num_expert_group", "n_group"), 1), g(("num_experts", "num_local_experts"), required=True)
    if experts % groups:
        refuse(file, f"num_expert_group {groups} must divide num_experts {experts}")
    return KimiLinearConfig(
        vocab=g("vocab_size", required=True), d_model=g("hidden_size", required=True), layer_types=types,
        mlp_types=mlp_types, intermediate_size=g("intermediate_size", required=True),
        num_heads=lac.get("num_heads", g("linear_num_heads", 32)),
        head_dim=lac.get("head_dim", g("linear_head_dim", 128)),
        conv_kernel=lac.get("short_conv_kernel_size", g("linear_conv_kernel_dim", 4)), attn_heads=nh,
        kv_lora_rank=g("kv_lora_rank", 512), qk_nope_head_dim=g("qk_nope_head_dim", 128),
        qk_rope_head_dim=g("qk_rope_head_dim", 64), v_head_dim=g("v_head_dim", 128), num_experts=experts,
        top_k=g(("num_experts_per_token", "num_experts_per_tok"), 8), num_groups=groups,
        topk_group=g("topk_group", 1), moe_intermediate_size=g("moe_intermediate_size", 1024),
        num_shared_experts=g(("num_shared_experts", "n_shared_experts"), 1),
        routed_scaling_factor=float(g("routed_scaling_factor", 2.446)),
        renormalize=bool(g(("moe_renormalize", "norm_topk_prob"), True)), rms_eps=float(g("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(g("tie_word_embeddings", False)), dtype=dtype, name=name,
    )  # fmt: skip


def _mlp(r: Reader, p: str, d: int, i: int) -> MLPParams:
    return MLPParams(r.linear(p + "gate_proj.weight", i, d), r.linear(p + "up_proj.weight", i, d),
                     r.linear(p + "down_proj.weight", d, i))  # fmt: skip


def _kda(r: Reader, p: str, c: KimiLinearConfig) -> KDAParams:
    d, H, K = c.d_model, c.num_heads, c.head_dim
    f = p + "forget_gate."
    return KDAParams(
        w_q=r.linear(p + "q_proj.weight", H * K, d), w_k=r.linear(p + "k_proj.weight", H * K, d),
        w_v=r.linear(p + "v_proj.weight", H * K, d), conv=r.arr(conv_weight(r, p, (H * K,) * 3, c.conv_kernel)),
        w_fa=r.linear(f + "f_a_proj.weight", K, d), w_fb=r.linear(f + "f_b_proj.weight", H * K, K),
        A_log=jnp.asarray(r.any_of(f + "A_log", [(1, 1, H, 1), (H,)]).reshape(H), F32),
        dt_bias=jnp.asarray(r.any_of(f + "dt_bias", [(H * K,), (H, K)]).reshape(H, K), F32),
        w_b=r.linear(p + "b_proj.weight", H, d), w_ga=r.linear(p + "g_a_proj.weight", K, d),
        w_gb=r.linear(p + "g_b_proj.weight", H * K, K), norm=r.vector(p + "o_norm.weight", K),
        w_o=r.linear(p + "o_proj.weight", d, H * K),
    )  # fmt: skip


def _mla(r: Reader, p: str, c: KimiLinearConfig) -> MLAParams:
    d, nh, rank = c.d_model, c.attn_heads, c.kv_lora_rank
    nope, rope, v = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    return MLAParams(
        w_q=r.linear(p + "q_proj.weight", nh * (nope + rope), d),
        w_kva=r.linear(p + "kv_a_proj_with_mqa.weight", rank + rope, d),
        kv_norm=r.vector(p + "kv_a_layernorm.weight", rank),
        w_kvb=r.linear(p + "kv_b_proj.weight", nh * (nope + v), rank),
        w_o=r.linear(p + "o_proj.weight", d, nh * v),
    )  # fmt: skip


def _moe(r: Reader, p: str, c: KimiLinearConfig) -> KimiMoEParams:
    d, E, I = c.d_model, c.num_experts, c.moe_intermediate_size  # noqa: E741
    if r.has(p + "experts.gate_up_proj"):  # transformers' fused in-memory layout
        gu = r.raw(p + "experts.gate_up_proj", (E, 2 * I, d))
        w_gate, w_up = np.swapaxes(gu[:, :I], 1, 2), np.swapaxes(gu[:, I:], 1, 2)
        w_down = np.swapaxes(r.raw(p + "experts.down_proj", (E, d, I)), 1, 2)
    else:  # one by one, the Hub's names: w1 gate, w3 up, w2 down
        w_gate = np.stack([r.raw(p + f"experts.{e}.w1.weight", (I, d)).T for e in range(E)])
        w_up = np.stack([r.raw(p + f"experts.{e}.w3.weight", (I, d)).T for e in range(E)])
        w_down = np.stack([r.raw(p + f"experts.{e}.w2.weight", (d, I)).T for e in range(E)])
    return KimiMoEParams(
        router=jnp.asarray(r.raw(p + "gate.weight", (E, d)).T, F32),
        bias=jnp.asarray(r.raw(p + "gate.e_score_correction_bias", (E,)), F32),
        w_gate=r.arr(w_gate), w_up=r.arr(w_up), w_down=r.arr(w_down),
        shared=_mlp(r, p + "shared_experts.", d, I * c.num_shared_experts),
    )  # fmt: skip


def load_params(r: Reader, c: KimiLinearConfig) -> KimiLinearParams:
    d = c.d_model
    blocks = []
    for i, (t, m) in enumerate(zip(c.layer_types, c.mlp_types)):
        p = f"model.layers.{i}."
        mixer = _kda(r, p + "self_attn.", c) if t == "linear_attention" else _mla(r, p + "self_attn.", c)
        ffn = _mlp(r, p + "mlp.", d, c.intermediate_size) if m == "dense" else _moe(r, p + "mlp.", c)
        blocks.append(KimiBlock(r.vector(p + "input_layernorm.weight", d), mixer,
                                r.vector(p + "post_attention_layernorm.weight", d), ffn))  # fmt: skip
    embed = r.arr(r.raw("model.embed_tokens.weight", (c.vocab, d)))
    head = None if c.tie_embeddings else r.linear("lm_head.weight", c.vocab, d)
    return KimiLinearParams(embed, tuple(blocks), r.vector("model.norm.weight", d), head)


def linear_inputs(p: KDAParams, c: KimiLinearConfig, x):
    """The KDA mixer's inputs over ``x [N, T, d]`` (normalised): ``([q | k | v] [N, T, 3*H*K]`` before the conv,
    the forget gate's ``f [N, T, H, K]`` before its bias, ``b [N, T, H])``."""
    N, T, _ = x.shape
    mixed = jnp.concatenate([matmul(x, p.w_q), matmul(x, p.w_k), matmul(x, p.w_v)], -1)
    f = matmul(matmul(x, p.w_fa), p.w_fb).reshape(N, T, c.num_heads, c.head_dim)
    return mixed, f, matmul(x, p.w_b)


def linear_output(p: KDAParams, c: KimiLinearConfig, x, o):
    """The KDA mixer's output from the recurrence's ``o [N, T, H, V]``: the sigmoid-gated norm, ``o_proj``."""
    N, T, _ = x.shape
    H, K = c.num_heads, c.head_dim
    gate = matmul(matmul(x, p.w_ga), p.w_gb).reshape(N, T, H, K)
    of = o.astype(F32)
    y = of * jax.lax.rsqrt(kda.ksum(of * of)[..., None] / K + c.rms_eps) * p.norm.astype(F32)
    y = (y * jax.nn.sigmoid(gate.astype(F32))).astype(x.dtype)
    return matmul(y.reshape(N, T, H * K), p.w_o)


def _kda_layer(p: KDAParams, c: KimiLinearConfig, x):
    """The KDA mixer over ``x [N, T, d]`` (normalised), the recurrence from an empty state."""
    N, T, _ = x.shape
    H, K = c.num_heads, c.head_dim
    pre, f, b = linear_inputs(p, c, x)
    mixed = causal_conv_silu(pre, p.conv)
    q, k, v = (mixed[..., i * H * K : (i + 1) * H * K].reshape(N, T, H, K) for i in range(3))
    qn, kn, g, beta = kda.prepare(q, k, f, b, p.A_log, p.dt_bias, K**-0.5)
    o, _ = kda.chain(jnp.zeros((N, H, K, K), F32), qn, kn, v, g, beta, record="tuples", out_dtype=x.dtype)
    return linear_output(p, c, x, o)


def attention(p: MLAParams, c: KimiLinearConfig, x, mask=None, positions=None):
    """MLA without RoPE over ``x [N, T, d]``: causal, or ``mask [N, T, T]`` bool (query, key; a draft tree's).
    ``positions`` is ignored (no RoPE: attention here does not depend on positions, only on the mask)."""
    N, T, _ = x.shape
    nh, rank, nope, rope, vd = c.attn_heads, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    q = matmul(x, p.w_q).reshape(N, T, nh, nope + rope)
    ckv = matmul(x, p.w_kva)
    latent = plain_rmsnorm(ckv[..., :rank], p.kv_norm, 1e-6, round_first=True)  # KimiLinearRMSNorm's default eps
    k_rot = ckv[..., rank:]
    kv = matmul(latent, p.w_kvb).reshape(N, T, nh, nope + vd)
    k = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(k_rot[:, :, None], (N, T, nh, rope))], -1)
    v = kv[..., nope:]
    scores = einsum("nthd,nshd->nhts", q, k, preferred_element_type=F32) * np.float32((nope + rope) ** -0.5)
    mask = jnp.tril(jnp.ones((T, T), bool)) if mask is None else mask[:, None]
    probs = softmax(jnp.where(mask, scores, -jnp.inf)).astype(x.dtype)
    out = einsum("nhts,nshd->nthd", probs, v, preferred_element_type=F32).astype(x.dtype)
    return matmul(out.reshape(N, T, nh * vd), p.w_o)


def route(p: KimiMoEParams, c: KimiLinearConfig, xf):
    """The router over ``xf [T, d]``: ``(weights [T, E] fp32, zero off the chosen experts; chosen [T, top_k])``."""
    T, E, G = xf.shape[0], c.num_experts, c.num_groups
    scores = jax.nn.sigmoid(matmul(xf.astype(F32), p.router))  # [T, E], fp32
    choice = scores + p.bias
    group_scores = jax.lax.top_k(choice.reshape(T, G, E // G), 2)[0].sum(-1)  # the two best of each group
    _, groups = jax.lax.top_k(group_scores, c.topk_group)
    keep = jnp.zeros((T, G), bool).at[jnp.arange(T)[:, None], groups].set(True)
    choice = jnp.where(jnp.repeat(keep, E // G, axis=1), choice, -jnp.inf)
    _, chosen = jax.lax.top_k(choice, c.top_k)
    w = jnp.take_along_axis(scores, chosen, axis=1)
    if c.renormalize:
        w = w / (w.sum(-1, keepdims=True) + np.float32(1e-20))
    w = w * np.float32(c.routed_scaling_factor)
    return jnp.zeros((T, E), F32).at[jnp.arange(T)[:, None], chosen].set(w), chosen


def _moe_layer(p: KimiMoEParams, c: KimiLinearConfig, x):
    """The MoE over ``x [N, T, d]``: every expert on every token (tiny experts), the chosen ones weighted,
    summed in expert order in x's dtype (as transformers' ``index_add_`` loop), plus the shared experts."""
    shape, dt = x.shape, x.dtype
    xf = x.reshape(-1, shape[-1])
    weights, _ = route(p, c, xf)
    h = jax.nn.silu(einsum("td,edi->tei", xf, p.w_gate)) * einsum("td,edi->tei", xf, p.w_up)
    out = einsum("tei,eid->ted", h, p.w_down)  # [T, E, d] in x's dtype
    weighted = (out.astype(F32) * weights[..., None]).astype(dt)
    add = lambda acc, y: ((acc + y).astype(dt), None)  # noqa: E731
    routed, _ = jax.lax.scan(add, jnp.zeros_like(xf), jnp.moveaxis(weighted, 1, 0))
    return (routed + mlp(p.shared, xf)).reshape(shape)


def _norm(x, w, c: KimiLinearConfig):
    return plain_rmsnorm(x, w, c.rms_eps, round_first=True)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _sublayer(fn, p, c: KimiLinearConfig, h, norm):
    """``h + fn(p, c, norm(h))``: one jitted program per kind of sub-layer (KDA, MLA, dense MLP, MoE), shared by
    the blocks that have it."""
    return h + fn(p, c, _norm(h, norm, c))


def _dense(p: MLPParams, c: KimiLinearConfig, x):
    return mlp(p, x)


@functools.partial(jax.jit, static_argnums=1)
def head(params: KimiLinearParams, c: KimiLinearConfig, h):
    h = _norm(h, params.final_norm, c)
    w = params.embed.T if params.head is None else params.head
    return matmul(h, w, preferred_element_type=F32)


def forward(params: KimiLinearParams, c: KimiLinearConfig, ids):
    """fp32 logits ``[B, T, vocab]`` of ``ids [B, T]`` from empty states (each sub-layer a jitted program,
    :func:`_sublayer`)."""
    h = params.embed[jnp.asarray(ids)]
    for blk in params.blocks:
        h = _sublayer(_kda_layer if isinstance(blk.mixer, KDAParams) else attention, blk.mixer, c, h, blk.norm1)
        h = _sublayer(_moe_layer if isinstance(blk.mlp, KimiMoEParams) else _dense, blk.mlp, c, h, blk.norm2)
    return head(params, c, h)


def block(blk: KimiBlock, c: KimiLinearConfig, h, mixer, kind: str):
    """One block over ``h``, its mixer ``mixer(x) -> y`` given (called on the normalised ``h``; both kinds
    pre-norm), then its MLP (dense or MoE)."""
    h = h + mixer(_norm(h, blk.norm1, c))
    return h + (_moe_layer if isinstance(blk.mlp, KimiMoEParams) else _dense)(blk.mlp, c, _norm(h, blk.norm2, c))


def linear_weights(p: KDAParams) -> tuple:
    """``(conv [3*H*K, Kc], conv bias or None, A_log [H], dt_bias [H, K])`` of a KDA mixer, as the pool takes them."""
    return p.conv, None, p.A_log, p.dt_bias


def geometry(c: KimiLinearConfig) -> Geometry:
    """The pool's geometry of the checkpoint's KDA layers (``linear_attention="kda"``; the MLA cache's latent
    as one KV head of ``kv_lora_rank + qk_rope_head_dim``)."""
    return Geometry(c.name, gdn_layers=c.layer_types.count("linear_attention"), num_k_heads=c.num_heads,
                    num_v_heads=c.num_heads, head_k_dim=c.head_dim, head_v_dim=c.head_dim, conv_kernel=c.conv_kernel,
                    layers=len(c.layer_types), kv_heads=1, kv_head_dim=c.kv_lora_rank + c.qk_rope_head_dim,
                    linear_attention="kda")  # fmt: skip
