"""Qwen4-Exp's text model (``model_type`` ``qwen4_exp``, its ``text_config``, or ``qwen4_exp_text``) in JAX, as
transformers 5.25 computes it.

The layers Qwen3.5-MoE has are Qwen3.5-MoE's (:mod:`~gdn_lossless_jax.model.hf.arch`, one
:class:`~gdn_lossless_jax.model.hf.config.HFConfig` ``base`` for their sizes): GDN (``in_proj_qkv``, ``in_proj_z``,
``in_proj_b``, ``in_proj_a``; its gated norm's gate SiLU or, by ``output_gate_type``, sigmoid), gated attention
(``q_proj`` per head ``[q | gate]``, zero-centred q/k norms, partial rotate-half RoPE; the text positions of the
interleaved M-RoPE are equal, so it is plain RoPE), the sparse MoE (softmax router, top-k renormalised, a shared
expert times ``sigmoid(shared_expert_gate(x))``). What is new:

- **Hyper-connections**: the residual stream is ``hc_count`` streams wide (``[..., hc * d]``, the embedding
  repeated). Each sub-layer's input is mixed from the streams by a :class:`GatedResidual`: ``n = hc_norm(h)`` (an
  RMSNorm per stream, ``1 + weight``), ``w = sigmoid(up(silu(down(n) / hc)))``, the input the streams' mean of
  ``w * n``; its output ``y`` goes back into every stream, ``h + y * 2 sigmoid(inject(n) / hc)`` (one weight a
  stream). No pre-norm and no final norm: the model's last mixer (without ``inject``) feeds the head.
- **PLE** (per-layer n-gram embeddings, on some GDN blocks, before the block): each token's 2..``ngram_size``-grams
  of token ids are hashed (``(t0 m0) xor (t1 m1) xor ...`` in 64-bit integers, modulo one prime a head,
  :func:`ngram_ids`) into one embedding table; a token at or after an EOS does not see tokens before it (they
  read as EOS), and before the sequence there are EOS tokens. The embedding gives a value and one key a stream;
  ``gate = signed sqrt(<key, rmsnorm(h)> / sqrt(d))`` per stream, ``v = sigmoid(gate) * value``; the block adds
  ``v + silu(conv(rmsnorm(v)))``, a depthwise causal conv of ``ple_conv_kernel_size`` taps dilated by
  ``ngram_size``. So a PLE block keeps two windows a request: the last ``ngram_size - 1`` token ids and the last
  ``(taps - 1) * ngram_size`` conv inputs: :class:`~gdn_lossless_jax.model.hf.family_decode.FamilyDecoder` keeps
  them beside the pool and commits them with it (:func:`windows`, :func:`pre_block`).
- **QSA indexed attention** on the attention blocks: an indexer (``index_qk_proj``: ``indexer_n_heads`` query heads
  and one key head, q normed and rotated at the query's position) splits the keys a query sees, in order, into
  blocks of ``indexer_compress_ratio`` (the incomplete last block is the *tail*); a block's key is the mean of its
  raw keys (fp32, rounded), normed and rotated at its first token's position; a block's score is
  ``sum_heads relu(q . k) / sqrt(head_dim)`` (fp32); the query attends to the tokens of its
  ``indexer_budget / indexer_compress_ratio`` best blocks and the tail only (:func:`select`). Which tokens a query
  sees is a function of the query and the keys before it: a verify step of D tokens chooses, for each, the blocks
  one-by-one decoding chooses (``tests/test_qwen4_exp.py``).

Checkpoints: the Hub's vision-language layout (``model.language_model.*``; ``model.visual.*`` and ``mtp.*`` are
skipped and reported, as transformers' ``Qwen4ExpForCausalLM`` skips them) or the text model's (``model.*``); the
n-gram table stored whole or in ``split_ngram_parts`` shards (``ngram_embedding.shard_<i>.weight``, what
``save_pretrained`` writes and the Hub ships); the stored hash buffers must equal the ones the config derives.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ... import reference
from ...config import Geometry
from ...reference import ksum
from ..model import AttentionParams, GDNParams, einsum, matmul, softmax
from . import arch
from .arch import MoEParams
from .config import HFConfig, config_from_dict as _base_config
from .family import Reader, causal_conv_silu, get, refuse

__all__ = ["Qwen4ExpConfig", "GatedResidual", "PLEParams", "IndexedAttentionParams", "Qwen4Block", "Qwen4ExpParams",
           "config_from_dict", "load_params", "forward", "RENAMES", "ngram_ids", "select", "linear_inputs",
           "linear_output", "linear_weights", "attention", "block", "head", "geometry", "windows", "pre_block", "embed",
           "indexer_choice", "chain_back"]  # fmt: skip

F32 = jnp.float32
U32 = jnp.uint32
#: Hub name -> the name read: the vision-language checkpoint's text model under ``model.``.
RENAMES = ((r"^model\.language_model\.", "model."),)
#: Skipped, and counted in the report: the vision tower and the MTP block (transformers' ``Qwen4ExpForCausalLM``
#: ignores both on load).
SKIPPED = ("model.visual.", "mtp.")
#: The primes of the n-gram heads must stay below this (:func:`_mod`'s 4-bit steps in 32-bit integers).
MAX_PRIME = 1 << 28


# ---------------------------------------------------------------------------------------------------------------
# The hash's constants, as transformers derives them from the config
# ---------------------------------------------------------------------------------------------------------------
_MASK64 = (1 << 64) - 1


def _splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def _multipliers(vocab: int, ngram: int, ple_index: int, seed: int) -> tuple[int, ...]:
    half = max(1, ((1 << 63) - 1) // max(vocab, 1) // 2)
    base = seed + 10007 * ple_index
    return tuple(2 * (_splitmix64((base + 0x9E3779B97F4A7C15 * (i + 1)) & _MASK64) % half) + 1 for i in range(ngram))


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def _primes_after(start: int, count: int) -> list[int]:
    out, p = [], start
    while len(out) < count:
        p += 1
        if _is_prime(p):
            out.append(p)
    return out


@dataclasses.dataclass(frozen=True)
class Qwen4ExpConfig:
    """A Qwen4-Exp text model's sizes (static, hashable). ``base``: the Qwen3.5-MoE layers' (GDN, attention, MoE).
    ``ple_layers``: 0-indexed blocks with a PLE; ``ngram_primes[j]``, ``multipliers[j]``: PLE ``j``'s heads' primes
    and hash multipliers; ``ngram_rows[j]``: its table's rows (padded)."""

    base: HFConfig
    layer_types: tuple[str, ...]  # "linear_attention" (GDN) or "full_attention" (QSA indexed attention)
    hc: int
    hc_rank: int
    ple_layers: tuple[int, ...]
    ple_dim: int
    ple_taps: int
    ngram: int
    heads_per_ngram: int
    ngram_primes: tuple[tuple[int, ...], ...]
    multipliers: tuple[tuple[int, ...], ...]
    ngram_rows: tuple[int, ...]
    eos: int
    index_heads: int
    index_dim: int
    index_budget: int
    index_ratio: int
    output_gate: str  # "silu" or "sigmoid"
    name: str = "checkpoint"
    model_type: str = "qwen4_exp"

    @property
    def vocab(self) -> int:
        return self.base.vocab

    @property
    def d_model(self) -> int:
        return self.base.d_model

    @property
    def dtype(self) -> str:
        return self.base.dtype

    @property
    def jnp_dtype(self):
        return self.base.jnp_dtype

    @property
    def tie_embeddings(self) -> bool:
        return self.base.tie_embeddings

    @property
    def ngram_heads(self) -> int:
        return (self.ngram - 1) * self.heads_per_ngram

    @property
    def conv_window(self) -> int:
        """The PLE conv's inputs kept a request: ``(taps - 1) * ngram_size`` (its dilation)."""
        return (self.ple_taps - 1) * self.ngram

    def describe(self) -> str:
        b = self.base
        return (f"qwen4_exp {self.name}: {len(self.layer_types)} blocks ({b.gdn_layers} GDN H={b.num_k_heads} "
                f"HV={b.num_v_heads} K={b.head_k_dim} V={b.head_v_dim}, {b.layers - b.gdn_layers} QSA attention "
                f"{b.attn_heads}q/{b.kv_heads}kv x {b.attn_head_dim}, indexer {self.index_heads} heads, blocks of "
                f"{self.index_ratio}, budget {self.index_budget}), {self.hc} hyper-connection streams, PLE on blocks "
                f"{list(self.ple_layers)} ({self.ngram}-grams), MoE {b.num_experts} experts top-{b.top_k}, d_model "
                f"{b.d_model}, vocab {b.vocab}, {b.dtype}")  # fmt: skip


def config_from_dict(full: dict, *, dtype: str, name: str, file: str) -> Qwen4ExpConfig:
    """transformers' reading of a ``qwen4_exp`` (its ``text_config``) or ``qwen4_exp_text`` ``config.json``."""
    text = full.get("text_config", full) if full.get("model_type") == "qwen4_exp" else full
    if not isinstance(text, dict):
        refuse(file, f"text_config must be a mapping, got {type(text).__name__}")
    g = lambda k, d=None, required=False: get(text, k, file, d, required)  # noqa: E731
    n = g("num_hidden_layers", required=True)
    types = g("layer_types")
    if types is None:
        every = g("full_attention_interval", 4)
        types = ["linear_attention" if (i + 1) % every else "indexed_attention" for i in range(n)]
    types = tuple("full_attention" if t in ("indexed_attention", "full_attention") else t for t in types)
    if len(types) != n or set(types) - {"linear_attention", "full_attention"}:
        refuse(file, f"layer_types must name each of num_hidden_layers={n} blocks 'linear_attention' or "
                     f"'indexed_attention', got {list(g('layer_types'))}")  # fmt: skip
    gate = g("output_gate_type") or g("hidden_act", "silu")
    if gate not in ("silu", "sigmoid"):
        refuse(file, f"output_gate_type {gate!r} is not supported (expected 'silu' or 'sigmoid')")
    if not g("num_experts"):
        refuse(file, "num_experts must be > 0 (every Qwen4-Exp block is a sparse MoE)")
    hc = g("hc_count", 4)
    if hc < 2:
        refuse(file, f"hc_count must be > 1, got {hc}")
    qsa = {k: g(k) for k in ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget",
                             "indexer_compress_ratio")}  # fmt: skip
    if "full_attention" in types:
        missing = [k for k, v in qsa.items() if not v]
        if missing:
            refuse(file, f"the attention blocks need the QSA indexer: {missing} missing or not positive")
        if qsa["indexer_kv_heads"] != 1:
            refuse(file, f"indexer_kv_heads must be 1, got {qsa['indexer_kv_heads']}")
        if qsa["indexer_budget"] % qsa["indexer_compress_ratio"]:
            refuse(file, f"indexer_budget {qsa['indexer_budget']} must be divisible by indexer_compress_ratio "
                         f"{qsa['indexer_compress_ratio']}")  # fmt: skip
    base_text = dict(text, layer_types=list(types), model_type="qwen3_5_moe_text")
    top = {"model_type": "qwen3_5_moe_text", **{k: v for k, v in full.items() if k == "tie_word_embeddings"}}
    base = _base_config(top, base_text, dtype=dtype, draft="mtp", draft_layers=None, name=name, source=file)
    base = dataclasses.replace(base, invariant=False)  # XLA's dots as they are, as the other families
    if "full_attention" in types and base.rotary_dim > qsa["indexer_head_dim"]:
        refuse(file, f"the rotary dims {base.rotary_dim} must fit the indexer's head_dim {qsa['indexer_head_dim']}")
    ple = sorted(set(g("ple_layer_ids") or []))
    bad = [i for i in ple if not 1 <= i <= n or types[i - 1] != "linear_attention"]
    if bad:
        refuse(file, f"ple_layer_ids must be 1-indexed ids of linear_attention blocks, got {bad}")
    ngram, per = g("ngram_size", 3), g("heads_per_ngram", 8)
    heads = (ngram - 1) * per
    ple_dim = g("ple_embed_dim") or base.d_model
    eos = g("eos_token_id", full.get("eos_token_id"))
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if ple and (heads <= 0 or ple_dim % heads):
        refuse(file, f"ple_embed_dim {ple_dim} must be a positive multiple of the n-gram heads {heads}")
    if ple and not isinstance(eos, int):
        refuse(file, f"eos_token_id must be set when ple_layer_ids is ({eos!r})")
    vocab_base, seed = g("ngram_vocab_size_base", 20_000_000), g("seed", 1234)
    div = g("make_ngram_vocab_size_divisible_by", 128)
    primes, mults, rows = [], [], []
    for j in range(len(ple)):
        ps = tuple(_primes_after(vocab_base - 1, (j + 1) * heads)[j * heads :])
        if ps and ps[-1] >= MAX_PRIME:
            refuse(file, f"ngram_vocab_size_base {vocab_base}: the n-gram heads' primes reach {ps[-1]}, over the "
                         f"{MAX_PRIME} this hash supports")  # fmt: skip
        primes.append(ps)
        mults.append(_multipliers(base.vocab, ngram, j, seed))
        rows.append(-(-sum(ps) // div) * div)
    return Qwen4ExpConfig(
        base=base, layer_types=types, hc=hc, hc_rank=g("hc_lowrank", 320), ple_layers=tuple(i - 1 for i in ple),
        ple_dim=ple_dim, ple_taps=g("ple_conv_kernel_size", 4), ngram=ngram, heads_per_ngram=per,
        ngram_primes=tuple(primes), multipliers=tuple(mults), ngram_rows=tuple(rows), eos=eos if ple else -1,
        index_heads=qsa["indexer_n_heads"] or 0, index_dim=qsa["indexer_head_dim"] or 0,
        index_budget=qsa["indexer_budget"] or 0, index_ratio=qsa["indexer_compress_ratio"] or 1, output_gate=gate,
        name=name,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------------------------------
def _pytree(cls):
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


@_pytree
class GatedResidual:
    """A hyper-connection mixer: ``norm [hc*d]``, ``down [hc*d, r]``, ``up [r, hc*d]``, ``inject [hc*d, hc]`` (None:
    the model's last mixer)."""

    norm: jax.Array
    down: jax.Array
    up: jax.Array
    inject: jax.Array | None


@_pytree
class PLEParams:
    """``table [rows, ple_dim / heads]``, ``key [ple_dim, hc*d]``, ``value [ple_dim, d]``, ``norm_key``,
    ``norm_query``, ``norm_conv [hc*d]``, ``conv [hc*d, taps]``."""

    table: jax.Array
    key: jax.Array
    value: jax.Array
    norm_key: jax.Array
    norm_query: jax.Array
    norm_conv: jax.Array
    conv: jax.Array


@_pytree
class IndexedAttentionParams:
    """The gated attention's and the indexer's: ``index_qk [d, (heads + 1) * index_dim]``, ``index_qnorm``,
    ``index_knorm [index_dim]``."""

    attn: AttentionParams
    index_qk: jax.Array
    index_qnorm: jax.Array
    index_knorm: jax.Array


@_pytree
class Qwen4Block:
    mixer: GDNParams | IndexedAttentionParams
    mlp: MoEParams
    attn_hc: GatedResidual
    mlp_hc: GatedResidual
    ple: PLEParams | None


@_pytree
class Qwen4ExpParams:
    embed: jax.Array
    blocks: tuple[Qwen4Block, ...]
    mixer: GatedResidual
    head: jax.Array | None


def _residual(r: Reader, p: str, c: Qwen4ExpConfig, inject: bool = True) -> GatedResidual:
    w = c.hc * c.d_model
    return GatedResidual(r.vector(p + "hc_norm.weight", w), r.linear(p + "input_mix_weight_down.weight", c.hc_rank, w),
                         r.linear(p + "input_mix_weight_up.weight", w, c.hc_rank),
                         r.linear(p + "block_inject_weight.weight", c.hc, w) if inject else None)  # fmt: skip


def _ngram_table(r: Reader, p: str, rows: int, width: int) -> np.ndarray:
    """The n-gram table, whole or in shards (``shard_<i>``, concatenated in order)."""
    if r.has(p + "weight"):
        return r.raw(p + "weight", (rows, width))
    i, parts = 0, []
    while r.has(p + f"shard_{i}.weight"):
        parts.append(r.raw(p + f"shard_{i}.weight", (r.shape(p + f"shard_{i}.weight")[0], width)))
        i += 1
    if not parts:
        refuse(r.ckpt.path, f"tensor {p + 'weight'!r} (or its shards {p + 'shard_0.weight'!r}, ...) is missing "
                            f"(expected shape [{rows}, {width}])")  # fmt: skip
    table = np.concatenate(parts, axis=0)
    if table.shape[0] != rows:
        refuse(r.ckpt.path, f"the {i} shards {p}shard_*.weight hold {table.shape[0]} rows, expected {rows}")
    return table


def _ple_params(r: Reader, p: str, c: Qwen4ExpConfig, j: int) -> PLEParams:
    w, d, e = c.hc * c.d_model, c.d_model, c.ple_dim
    q = p + "ple_embedding."
    for buf, want in (("layer_multipliers", c.multipliers[j]), ("ngram_heads_vocab_sizes", c.ngram_primes[j]),
                      ("ngram_heads_offsets", tuple(np.cumsum((0,) + c.ngram_primes[j][:-1])))):  # fmt: skip
        if r.has(q + buf):
            got = tuple(int(x) for x in np.asarray(r.raw(q + buf, (len(want),))))
            if got != tuple(int(x) for x in want):
                refuse(r.ckpt.path, f"tensor {q + buf!r} holds {list(got)}, but the config derives {list(want)} "
                                    f"(ngram_vocab_size_base, seed, vocab_size)")  # fmt: skip
    return PLEParams(
        table=r.arr(_ngram_table(r, q + "ngram_embedding.", c.ngram_rows[j], e // c.ngram_heads)),
        key=r.linear(p + "key_proj.weight", w, e), value=r.linear(p + "value_proj.weight", d, e),
        norm_key=r.vector(p + "norm_key.weight", w), norm_query=r.vector(p + "norm_query.weight", w),
        norm_conv=r.vector(p + "norm_conv.weight", w), conv=r.arr(r.raw(p + "conv1d.weight", (w, 1, c.ple_taps))[:, 0]),
    )  # fmt: skip


def load_params(r: Reader, c: Qwen4ExpConfig) -> Qwen4ExpParams:
    from .weights import _attention, _gdn, _moe

    b, d = c.base, c.d_model
    blocks = []
    for i, t in enumerate(c.layer_types):
        p = f"model.layers.{i}."
        if t == "linear_attention":
            mixer = _gdn(r, p + "linear_attn.", b)
        else:
            a = p + "self_attn."
            qk = (c.index_heads + 1) * c.index_dim
            mixer = IndexedAttentionParams(_attention(r, a, b), r.linear(a + "indexer.index_qk_proj.weight", qk, d),
                                           r.vector(a + "indexer.q_layernorm.weight", c.index_dim),
                                           r.vector(a + "indexer.k_layernorm.weight", c.index_dim))  # fmt: skip
        ple = _ple_params(r, p + "ple.", c, c.ple_layers.index(i)) if i in c.ple_layers else None
        blocks.append(Qwen4Block(mixer, _moe(r, p + "mlp.", b), _residual(r, p + "attn_hyper_connection.", c),
                                 _residual(r, p + "mlp_hyper_connection.", c), ple))  # fmt: skip
    embed = r.arr(r.raw("model.embed_tokens.weight", (b.vocab, d)))
    head = None if c.tie_embeddings else r.linear("lm_head.weight", b.vocab, d)
    return Qwen4ExpParams(embed, tuple(blocks), _residual(r, "model.hyper_connection_mixer.", c, inject=False), head)


# ---------------------------------------------------------------------------------------------------------------
# The n-gram hash in 32-bit integers
# ---------------------------------------------------------------------------------------------------------------
def _mul32(a, b):
    """``a * b`` of uint32 arrays as the 64-bit ``(hi, lo)`` (16-bit limbs: every partial product fits)."""
    m16 = U32(0xFFFF)
    a0, a1, b0, b1 = a & m16, a >> 16, b & m16, b >> 16
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> 16) + (p01 & m16) + (p10 & m16)
    return p11 + (p01 >> 16) + (p10 >> 16) + (mid >> 16), (p00 & m16) | (mid << 16)


def _mul64(t, m: int):
    """``t * m`` (t uint32, ``m`` a Python int, the product below 2**64) as ``(hi, lo)`` uint32."""
    h1, l1 = _mul32(t, U32(m & 0xFFFFFFFF))
    _, l2 = _mul32(t, U32(m >> 32))
    return h1 + l2, l1


def _mod(hi, lo, p: int):
    """``(hi * 2**32 + lo) mod p`` for ``p < 2**28``: Horner over the 16 nibbles (every step below 2**32)."""
    r = jnp.zeros_like(lo)
    for word in (hi, lo):
        for shift in range(28, -4, -4):
            r = (r * U32(16) + ((word >> shift) & U32(15))) % U32(p)
    return r


def ngram_ids(c: Qwen4ExpConfig, j: int, grams) -> jax.Array:
    """PLE ``j``'s table rows ``[..., heads]`` (int32) of each position's n-grams: ``grams [..., ngram_size]`` the
    token at the position and the ones 1, 2, ... before it (already EOS where the EOS rule says so:
    :func:`_grams`). The ``k``-gram's heads take ``(t0 m0) xor ... xor (t(k-1) m(k-1))`` modulo their primes, plus
    their offsets in the table, exactly as transformers' 64-bit integer arithmetic (here in 32-bit halves)."""
    t = grams.astype(U32)
    prods = [_mul64(t[..., s], m) for s, m in enumerate(c.multipliers[j])]
    primes = c.ngram_primes[j]
    offsets = np.cumsum((0,) + primes[:-1])
    out = []
    hi, lo = prods[0]
    for k in range(2, c.ngram + 1):
        hi, lo = hi ^ prods[k - 1][0], lo ^ prods[k - 1][1]
        for h in range((k - 2) * c.heads_per_ngram, (k - 1) * c.heads_per_ngram):
            out.append((_mod(hi, lo, primes[h]) + U32(offsets[h])).astype(jnp.int32))
    return jnp.stack(out, axis=-1)


def _grams(c: Qwen4ExpConfig, back):
    """Each position's token and the ``ngram_size - 1`` before it, ``[..., ngram_size]``; ``back(s)``: the tokens
    ``s`` positions back along the position's path (``s = 0``: its own). A token with an EOS among the ones after
    it up to the position reads as EOS (transformers' ``_shift_right_ignore_eos``)."""
    cols, seen_eos = [back(0)], None
    for s in range(1, c.ngram):
        prev = back(s)
        seen_eos = prev == c.eos if seen_eos is None else seen_eos | (prev == c.eos)
        cols.append(jnp.where(seen_eos, c.eos, prev))
    return jnp.stack(cols, axis=-1)


# ---------------------------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------------------------
def _norm(x, w, eps, group: int | None = None):
    """Qwen4's RMSNorm (fp32, ``1 + weight``, back to x's dtype), over groups of ``group`` channels."""
    if group is None:
        return arch.rmsnorm(x, w, eps)
    shape = x.shape
    return arch.rmsnorm(x.reshape(*shape[:-1], -1, group), w.reshape(-1, group), eps).reshape(shape)


def _sum_streams(x):
    """The sum over the streams axis (-2) in fp32, in a fixed order."""
    return ksum(jnp.swapaxes(x.astype(F32), -1, -2))


def gated_residual(p: GatedResidual, c: Qwen4ExpConfig, h):
    """``h [..., hc*d]`` -> the sub-layer's input ``[..., d]`` and the injection weights ``[..., hc]`` (None for the
    last mixer)."""
    d, dt = c.d_model, h.dtype
    n = _norm(h, p.norm, c.base.rms_eps, d)
    w = jax.nn.silu((matmul(n, p.down).astype(F32) / c.hc).astype(dt))
    w = jax.nn.sigmoid(matmul(w, p.up))
    x = (_sum_streams((w * n).reshape(*h.shape[:-1], c.hc, d)) / c.hc).astype(dt)
    if p.inject is None:
        return x, None
    return x, (2 * jax.nn.sigmoid((matmul(n, p.inject).astype(F32) / c.hc).astype(dt))).astype(dt)


def _inject(h, y, inj, c: Qwen4ExpConfig):
    """Every stream plus its weight times the sub-layer's output ``y [..., d]``."""
    return h + (y[..., None, :] * inj[..., :, None]).reshape(h.shape)


def linear_inputs(p: GDNParams, c: Qwen4ExpConfig, x):
    """The GDN mixer's inputs over ``x [N, T, d]``: ``([q | k | v]`` before the conv, ``a``, ``b [N, T, HV])``."""
    return matmul(x, p.w_qkv), matmul(x, p.w_a), matmul(x, p.w_b)


def linear_output(p: GDNParams, c: Qwen4ExpConfig, x, o):
    """The GDN mixer's output from the recurrence's ``o [N, T, HV, V]``: the gated norm (``weight * rmsnorm(o)``
    in o's dtype, times the gate's SiLU or sigmoid in fp32), ``out_proj``."""
    N, T, _ = x.shape
    b = c.base
    z = matmul(x, p.w_z).reshape(N, T, b.num_v_heads, b.head_v_dim).astype(F32)
    of, dt = o.astype(F32), o.dtype
    y = (of * jax.lax.rsqrt(ksum(of * of)[..., None] / of.shape[-1] + b.rms_eps)).astype(dt)
    act = jax.nn.silu(z) if c.output_gate == "silu" else jax.nn.sigmoid(z)
    y = ((p.norm * y).astype(F32) * act).astype(dt)
    return matmul(y.reshape(N, T, -1), p.w_out)


def linear_weights(p: GDNParams) -> tuple:
    """``(conv [conv_dim, Kc], conv bias or None, A_log [HV], dt_bias [HV])``, as the pool takes them."""
    return p.conv_weight, None, p.A_log, p.dt_bias


def _gdn_layer(p: GDNParams, c: Qwen4ExpConfig, x):
    """The GDN mixer over ``x [N, T, d]``, the recurrence from an empty state."""
    N, T, _ = x.shape
    b = c.base
    H, HV, K, V = b.num_k_heads, b.num_v_heads, b.head_k_dim, b.head_v_dim
    pre, a, bb = linear_inputs(p, c, x)
    mixed = causal_conv_silu(pre, p.conv_weight)
    q = mixed[..., : H * K].reshape(N, T, H, K)
    k = mixed[..., H * K : 2 * H * K].reshape(N, T, H, K)
    v = mixed[..., 2 * H * K :].reshape(N, T, HV, V)
    qn, kn, g, beta = reference.prepare(q, k, a, bb, p.A_log, p.dt_bias, K**-0.5)
    o, _ = reference.chain(jnp.zeros((N, HV, V, K), F32), qn, kn, v, g, beta, record="tuples", out_dtype=x.dtype)
    return linear_output(p, c, x, o)


def _gather_rows(x, idx):
    """``x [N, L, ...]`` at ``idx [N, ...]`` along axis 1."""
    N = x.shape[0]
    flat = idx.reshape(N, -1)
    out = jnp.take_along_axis(x, flat.reshape(N, -1, *([1] * (x.ndim - 2))), axis=1)
    return out.reshape(*idx.shape, *x.shape[2:])


def select(p: IndexedAttentionParams, c: Qwen4ExpConfig, x, mask, positions, *, score=jax.nn.relu):
    """The QSA indexer's choice over ``x [N, L, d]``: ``mask [N, L, L]`` (query, key) the keys each query may see
    (causal, or a draft tree's), ``positions [N, L]``. Returns ``[N, L, L]`` bool: the keys each query attends to
    (the tokens of its best blocks and its tail; module docstring). ``score``: applied to each head's ``q . k``
    before the heads' sum (transformers' ReLU; another function: a test's control). Blocks of equal scores (all
    heads negative: 0) go to the earlier block (``lax.top_k``; transformers leaves the order to ``torch.topk``)."""
    N, L, _ = x.shape
    b, R, hd = c.base, c.index_ratio, c.index_dim
    qk = matmul(x, p.index_qk)
    q = _norm(qk[..., : c.index_heads * hd].reshape(N, L, c.index_heads, hd), p.index_qnorm, b.rms_eps)
    q = arch._rope(q, positions, b)
    raw = qk[..., c.index_heads * hd :]  # [N, L, hd]
    nb_max = L // R
    ranks = jnp.cumsum(mask, axis=-1, dtype=jnp.int32) - 1  # [N, L, L]: each visible key's place in the query's list
    seen = mask.sum(-1, dtype=jnp.int32)  # [N, L]
    blocks = seen // R
    s = jnp.arange(L, dtype=jnp.int32)
    order = jnp.argsort(jnp.where(mask, s, L + s), axis=-1, stable=True)  # the visible keys first, in order
    toks = order[..., : nb_max * R].reshape(N, L, nb_max, R)  # [N, L(q), block, R]: the blocks' keys
    kb = _gather_rows(raw, toks)  # [N, L, nb, R, hd]
    pooled = (ksum(jnp.moveaxis(kb.astype(F32), -2, -1)) / R).astype(x.dtype)  # fp32 mean, rounded
    pooled = _norm(pooled, p.index_knorm, b.rms_eps)
    starts = _gather_rows(positions, toks[..., 0])  # [N, L, nb]: each block's first token's position
    pooled = arch._rope(pooled.reshape(N, L * nb_max, 1, hd), starts.reshape(N, L * nb_max), b)
    pooled = pooled.reshape(N, L, nb_max, hd)
    scores = einsum("nlhd,nlbd->nlbh", q.astype(F32), pooled.astype(F32))
    scores = ksum(score(scores)) / np.float32(math.sqrt(hd))  # [N, L, nb]
    valid = jnp.arange(nb_max)[None, None, :] < blocks[..., None]
    scores = jnp.where(valid, scores, -jnp.inf)
    k = min(c.index_budget // R, nb_max)
    if k:
        _, best = jax.lax.top_k(scores, k)  # [N, L, k]; a block past the query's complete ones is not chosen
        best = jnp.where(best < blocks[..., None], best, -1)
        in_best = (ranks[..., None] // R == best[..., None, :]).any(-1)  # [N, L, L]
    else:
        in_best = jnp.zeros(mask.shape, bool)
    tail = ranks >= (blocks * R)[..., None]
    return mask & (tail | in_best)


def attention(p: IndexedAttentionParams, c: Qwen4ExpConfig, x, mask=None, positions=None):
    """QSA indexed gated attention over ``x [N, L, d]``: causal (or ``mask [N, L, L]``, a draft tree's), at
    positions ``0..L-1`` (or ``positions [N, L]``), each query over the keys :func:`select` chooses."""
    N, L, _ = x.shape
    b, a = c.base, p.attn
    nq, nkv, hd = b.attn_heads, b.kv_heads, b.attn_head_dim
    if mask is None:
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((L, L), bool)), (N, L, L))
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (N, L))
    sel = select(p, c, x, mask, positions)
    q = _norm(matmul(x, a.w_q).reshape(N, L, nq, hd), a.q_norm, b.rms_eps)
    k = _norm(matmul(x, a.w_k).reshape(N, L, nkv, hd), a.k_norm, b.rms_eps)
    v = matmul(x, a.w_v).reshape(N, L, nkv, hd)
    q, k = arch._rope(q, positions, b), arch._rope(k, positions, b)
    qg = q.reshape(N, L, nkv, nq // nkv, hd)
    scores = einsum("ntgrh,nsgh->ngrts", qg, k, preferred_element_type=F32) * np.float32(hd**-0.5)
    probs = softmax(jnp.where(sel[:, None, None], scores, -jnp.inf)).astype(x.dtype)
    out = einsum("ngrts,nsgh->ntgrh", probs, v, preferred_element_type=F32).astype(x.dtype)
    out = out.reshape(N, L, nq * hd) * jax.nn.sigmoid(matmul(x, a.w_gate))
    return matmul(out, a.w_o)


def _ple(p: PLEParams, c: Qwen4ExpConfig, j: int, h, grams, taps):
    """PLE ``j`` over ``h [N, T, hc*d]``: ``(h + its output, the conv's inputs [N, T, hc*d])``. ``grams [N, T,
    ngram_size]`` (:func:`_grams`); ``taps(rows, s)``: the conv inputs ``s`` positions back along each position's
    path (the window before the step, then ``rows``)."""
    N, T, W = h.shape
    d, dt, eps = c.d_model, h.dtype, c.base.rms_eps
    emb = p.table[ngram_ids(c, j, grams)].reshape(N, T, -1)
    key = _norm(matmul(emb, p.key), p.norm_key, eps, d).reshape(N, T, c.hc, d)
    value = matmul(emb, p.value)
    query = _norm(h, p.norm_query, eps, d).reshape(N, T, c.hc, d)
    gate = (ksum((key * query).astype(F32))[..., None]).astype(dt)
    gate = (gate.astype(F32) / np.float32(math.sqrt(d))).astype(dt)
    gate = jnp.sqrt(jnp.maximum(jnp.abs(gate), np.asarray(1e-6, dt))) * jnp.sign(gate)
    v = (jax.nn.sigmoid(gate) * value[..., None, :]).reshape(N, T, W)
    rows = _norm(v, p.norm_conv, eps, d)
    K = c.ple_taps
    win = jnp.stack([taps(rows, (K - 1 - i) * c.ngram) for i in range(K)], axis=-1)  # [N, T, W, K]
    y = ksum(win.astype(F32) * p.conv.astype(F32)).astype(dt)
    return h + (v + jax.nn.silu(y.astype(F32)).astype(dt)), rows


def block(blk: Qwen4Block, c: Qwen4ExpConfig, h, mixer, kind: str):
    """One block over ``h [..., hc*d]`` after its PLE (:func:`pre_block`): the mixer ``mixer(x) -> y`` on the
    streams' mix, injected back; then the MoE likewise."""
    x, inj = gated_residual(blk.attn_hc, c, h)
    h = _inject(h, mixer(x), inj, c)
    x, inj = gated_residual(blk.mlp_hc, c, h)
    return _inject(h, arch.moe(blk.mlp, c.base, x), inj, c)


@functools.partial(jax.jit, static_argnums=1)
def head(params: Qwen4ExpParams, c: Qwen4ExpConfig, h):
    """fp32 logits from the streams: the last mixer, the LM head (or the embedding, tied)."""
    x, _ = gated_residual(params.mixer, c, h)
    w = params.embed.T if params.head is None else params.head
    return matmul(x, w, preferred_element_type=F32)


# ---------------------------------------------------------------------------------------------------------------
# The PLE windows (kept beside the pool by the family decoder) and the full-sequence forward
# ---------------------------------------------------------------------------------------------------------------
def windows(c: Qwen4ExpConfig, B: int) -> dict:
    """Each request's rolling windows before its first token: ``"tokens" [B, ngram_size - 1]`` (EOS, as
    transformers starts) and, per PLE block, ``"ple<i>" [B, (taps - 1) * ngram_size, hc*d]`` (zeros). Empty
    without PLE blocks."""
    if not c.ple_layers:
        return {}
    out = {"tokens": jnp.full((B, c.ngram - 1), c.eos, jnp.int32)}
    for i in c.ple_layers:
        out[f"ple{i}"] = jnp.zeros((B, c.conv_window, c.hc * c.d_model), c.jnp_dtype)
    return out


def pre_block(blk: Qwen4Block, c: Qwen4ExpConfig, i: int, h, ids, back):
    """Block ``i``'s PLE before it, where it has one: ``(h, {window name: the step's rows [B, T, ...]})``.
    ``ids [B, T]`` the step's tokens; ``back(name, rows, s)`` the entries of window ``name`` ``s`` positions back
    along each position's path (the window before the step, then ``rows``). Blocks without a PLE: ``(h, {})``."""
    if blk.ple is None:
        return h, {}
    j = c.ple_layers.index(i)
    grams = _grams(c, lambda s: back("tokens", ids, s))
    h, rows = _ple(blk.ple, c, j, h, grams, lambda r, s: back(f"ple{i}", r, s))
    return h, {f"ple{i}": rows}


def chain_back(window, rows, s: int):
    """The entries ``s`` positions before each of a chain's positions: ``window [N, S, ...]`` then ``rows [N, T,
    ...]``, read at ``S + t - s``."""
    S, T = window.shape[1], rows.shape[1]
    return jnp.concatenate([window, rows], axis=1)[:, S - s : S - s + T]


@functools.partial(jax.jit, static_argnums=(1, 2))
def _forward_block(blk: Qwen4Block, c: Qwen4ExpConfig, i: int, h, ids):
    """Block ``i`` over ``h`` from empty states (its PLE from transformers' start windows)."""
    win = windows(c, h.shape[0])
    h, _ = pre_block(blk, c, i, h, ids, lambda name, rows, s: chain_back(win[name], rows, s))
    if c.layer_types[i] == "linear_attention":
        return block(blk, c, h, lambda x: _gdn_layer(blk.mixer, c, x), "linear_attention")
    return block(blk, c, h, lambda x: attention(blk.mixer, c, x), "full_attention")


def forward(params: Qwen4ExpParams, c: Qwen4ExpConfig, ids):
    """fp32 logits ``[B, T, vocab]`` of ``ids [B, T]`` from empty states (each block a jitted program)."""
    ids = jnp.asarray(ids, jnp.int32)
    h = embed(params, c, ids)
    for i, blk in enumerate(params.blocks):
        h = _forward_block(blk, c, i, h, ids)
    return head(params, c, h)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _attention_input(blk: Qwen4Block, c: Qwen4ExpConfig, i: int, h, ids):
    win = windows(c, h.shape[0])
    h, _ = pre_block(blk, c, i, h, ids, lambda name, rows, s: chain_back(win[name], rows, s))
    return gated_residual(blk.attn_hc, c, h)[0]


def indexer_choice(params: Qwen4ExpParams, c: Qwen4ExpConfig, ids, rule=None) -> jax.Array:
    """The QSA indexer's choice in the full forward of ``ids [B, T]``: ``[B, A, T, T]`` bool, per attention block
    the keys each query attends to, by :func:`select` (or ``rule``, a function of the same arguments: a test's
    control), as transformers' fixtures record it."""
    ids = jnp.asarray(ids, jnp.int32)
    h, out = embed(params, c, ids), []
    N, T = ids.shape
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (N, T, T))
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (N, T))
    for i, blk in enumerate(params.blocks):
        if c.layer_types[i] == "full_attention":
            x = _attention_input(blk, c, i, h, ids)
            out.append((rule or select)(blk.mixer, c, x, mask, positions))
        h = _forward_block(blk, c, i, h, ids)
    return jnp.stack(out, axis=1)


def embed(params: Qwen4ExpParams, c: Qwen4ExpConfig, ids):
    """The streams' start: the token embedding repeated ``hc`` times, ``[..., hc*d]``."""
    return jnp.tile(params.embed[ids], (1,) * ids.ndim + (c.hc,))


def geometry(c: Qwen4ExpConfig) -> Geometry:
    """The pool's geometry of the checkpoint's GDN layers."""
    return dataclasses.replace(c.base.geometry, name=c.name)
