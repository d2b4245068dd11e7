"""Map a checkpoint's tensors by name onto :class:`~gdn_lossless_jax.model.hf.arch.HFParams`.

Every tensor of the checkpoint is either used, or skipped and reported (a vision tower's), or an
error: a missing, misshapen or unexpected tensor raises with its name. Names follow transformers'
``save_pretrained``: the text model under ``model.`` (or ``model.language_model.``, Qwen3.5's
vision-language checkpoints), ``lm_head.weight``, experts one by one (``mlp.experts.<e>.gate_proj``)
or fused (``mlp.experts.gate_up_proj [E, 2I, d]``, ``mlp.experts.down_proj [E, d, I]``), and the MTP
block under ``mtp.`` (vLLM's and SGLang's layout).
"""

from __future__ import annotations

import os
import re

import jax.numpy as jnp
import numpy as np

from ..model import GDNParams, MLPParams
from .arch import AttentionParams, Block, HFParams, MoEParams, MTPParams
from .config import HFConfig, read_json
from .safetensors import SafetensorsFile

__all__ = ["Checkpoint", "load_params", "VISION_PREFIXES"]

#: Name prefixes of a vision tower (Qwen3.5's ``model.visual.``): skipped and reported.
VISION_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.")


def _brief(value, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Checkpoint:
    """The tensors of a checkpoint folder: one ``model.safetensors``, or the shards an index lists
    (``model.safetensors.index.json``), or every ``*.safetensors`` file."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        index = os.path.join(self.path, "model.safetensors.index.json")
        if os.path.isfile(index):
            content = read_json(index)
            weight_map = content.get("weight_map") if isinstance(content, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ValueError(f"load_pretrained: {index} must hold a JSON object with a 'weight_map' of tensor "
                                 f"names to file names, got {_brief(content)}")  # fmt: skip
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
            weight_map = None
        if not files:
            raise FileNotFoundError(f"load_pretrained: no *.safetensors file in {self.path!r}")
        self.files = {}
        for name in files:
            full = os.path.join(self.path, name)
            if not os.path.isfile(full):
                raise FileNotFoundError(f"load_pretrained: {index} lists shard {name!r}, which is not in {self.path!r}")
            self.files[name] = SafetensorsFile(full)
        self.where: dict[str, str] = {}
        for fname, f in self.files.items():
            for k in f.keys():
                if k in self.where:
                    raise ValueError(f"load_pretrained: tensor {k!r} is in both {self.where[k]} and {fname}")
                self.where[k] = fname
        if weight_map is not None:
            for k, fname in weight_map.items():
                if self.where.get(k) != fname:
                    raise ValueError(f"load_pretrained: the index maps tensor {k!r} to {fname}, but it is in "
                                     f"{self.where.get(k, 'no shard')}")  # fmt: skip
            unlisted = sorted(set(self.where) - set(weight_map))
            if unlisted:
                raise ValueError(f"load_pretrained: tensor {unlisted[0]!r} is in {self.where[unlisted[0]]} but not in "
                                 f"{index} ({len(unlisted)} such tensor(s))")  # fmt: skip

    def names(self) -> set[str]:
        return set(self.where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.files[self.where[name]].shape(name)

    def get(self, name: str) -> np.ndarray:
        return self.files[self.where[name]].get(name)


class _Reader:
    """Takes tensors by name, checking shapes, and remembers which were used."""

    def __init__(self, ckpt: Checkpoint, dtype):
        self.ckpt, self.dtype, self.used = ckpt, jnp.dtype(dtype), set()

    def has(self, name: str) -> bool:
        return name in self.ckpt.where

    def raw(self, name: str, shape) -> np.ndarray:
        if name not in self.ckpt.where:
            raise ValueError(f"load_pretrained: {self.ckpt.path}: tensor {name!r} is missing (expected shape "
                             f"{list(shape)})")  # fmt: skip
        got = self.ckpt.shape(name)
        if tuple(got) != tuple(shape):
            raise ValueError(f"load_pretrained: {self.ckpt.path}: tensor {name!r} has shape {list(got)}, expected "
                             f"{list(shape)}")  # fmt: skip
        self.used.add(name)
        return self.ckpt.get(name)

    def arr(self, x: np.ndarray):
        return jnp.asarray(np.asarray(x).astype(self.dtype))

    def linear(self, name: str, n_out: int, n_in: int):
        """A ``nn.Linear`` weight ``[out, in]`` as ``[in, out]``."""
        return self.arr(self.raw(name, (n_out, n_in)).T)

    def vector(self, name: str, n: int):
        return self.arr(self.raw(name, (n,)))


def _mlp(r: _Reader, p: str, d: int, i: int) -> MLPParams:
    return MLPParams(r.linear(p + "gate_proj.weight", i, d), r.linear(p + "up_proj.weight", i, d),
                     r.linear(p + "down_proj.weight", d, i))  # fmt: skip


def _moe(r: _Reader, p: str, c: HFConfig) -> MoEParams:
    d, E, I = c.d_model, c.num_experts, c.moe_intermediate_size
    if r.has(p + "experts.gate_up_proj"):  # transformers' fused in-memory layout
        gu = r.raw(p + "experts.gate_up_proj", (E, 2 * I, d))
        w_gate, w_up = np.swapaxes(gu[:, :I], 1, 2), np.swapaxes(gu[:, I:], 1, 2)
        w_down = np.swapaxes(r.raw(p + "experts.down_proj", (E, d, I)), 1, 2)
    else:
        w_gate = np.stack([r.raw(p + f"experts.{e}.gate_proj.weight", (I, d)).T for e in range(E)])
        w_up = np.stack([r.raw(p + f"experts.{e}.up_proj.weight", (I, d)).T for e in range(E)])
        w_down = np.stack([r.raw(p + f"experts.{e}.down_proj.weight", (d, I)).T for e in range(E)])
    Is = c.shared_expert_intermediate_size
    return MoEParams(
        router=r.linear(p + "gate.weight", E, d), w_gate=r.arr(w_gate), w_up=r.arr(w_up), w_down=r.arr(w_down),
        shared=_mlp(r, p + "shared_expert.", d, Is), shared_gate=r.linear(p + "shared_expert_gate.weight", 1, d),
    )  # fmt: skip


def _attention(r: _Reader, p: str, c: HFConfig) -> AttentionParams:
    d, nq, nkv, hd = c.d_model, c.attn_heads, c.kv_heads, c.attn_head_dim
    qg = r.raw(p + "q_proj.weight", (2 * nq * hd, d)).reshape(nq, 2, hd, d)  # per head [q | gate]
    return AttentionParams(
        w_q=r.arr(qg[:, 0].reshape(nq * hd, d).T), w_gate=r.arr(qg[:, 1].reshape(nq * hd, d).T),
        w_k=r.linear(p + "k_proj.weight", nkv * hd, d), w_v=r.linear(p + "v_proj.weight", nkv * hd, d),
        q_norm=r.vector(p + "q_norm.weight", hd), k_norm=r.vector(p + "k_norm.weight", hd),
        w_o=r.linear(p + "o_proj.weight", d, nq * hd),
    )  # fmt: skip


def _gdn(r: _Reader, p: str, c: HFConfig) -> GDNParams:
    d, H, HV, K, V, Kc = c.d_model, c.num_k_heads, c.num_v_heads, c.head_k_dim, c.head_v_dim, c.conv_kernel
    rr = HV // H
    conv_dim = 2 * H * K + HV * V
    if c.packed_gdn:
        # qwen3_next: rows grouped by q/k head h: [q_h (K) | k_h (K) | v of its rr v-heads | z of them],
        # and [b of its rr v-heads | a of them] (transformers' fix_query_key_value_ordering).
        w = r.raw(p + "in_proj_qkvz.weight", (H * (2 * K + 2 * rr * V), d)).reshape(H, 2 * K + 2 * rr * V, d)
        q, k = w[:, :K].reshape(H * K, d), w[:, K : 2 * K].reshape(H * K, d)
        v, z = w[:, 2 * K : 2 * K + rr * V].reshape(HV * V, d), w[:, 2 * K + rr * V :].reshape(HV * V, d)
        qkv = np.concatenate([q, k, v], axis=0)
        ba = r.raw(p + "in_proj_ba.weight", (2 * HV, d)).reshape(H, 2 * rr, d)
        b, a = ba[:, :rr].reshape(HV, d), ba[:, rr:].reshape(HV, d)
        w_qkv, w_z, w_b, w_a = (r.arr(x.T) for x in (qkv, z, b, a))
    else:
        w_qkv = r.linear(p + "in_proj_qkv.weight", conv_dim, d)
        w_z = r.linear(p + "in_proj_z.weight", HV * V, d)
        w_b, w_a = r.linear(p + "in_proj_b.weight", HV, d), r.linear(p + "in_proj_a.weight", HV, d)
    return GDNParams(
        w_qkv=w_qkv, w_z=w_z, w_b=w_b, w_a=w_a, conv_weight=r.arr(r.raw(p + "conv1d.weight", (conv_dim, 1, Kc))[:, 0]),
        A_log=r.vector(p + "A_log", HV), dt_bias=r.vector(p + "dt_bias", HV), norm=r.vector(p + "norm.weight", V),
        w_out=r.linear(p + "out_proj.weight", d, HV * V),
    )  # fmt: skip


def _block(r: _Reader, p: str, c: HFConfig, kind: str, is_moe: bool) -> Block:
    d = c.d_model
    mixer = _gdn(r, p + "linear_attn.", c) if kind == "gdn" else _attention(r, p + "self_attn.", c)
    ffn = _moe(r, p + "mlp.", c) if is_moe else _mlp(r, p + "mlp.", d, c.intermediate_size)
    return Block(r.vector(p + "input_layernorm.weight", d), mixer, r.vector(p + "post_attention_layernorm.weight", d), ffn)


def has_mtp(ckpt: Checkpoint) -> bool:
    return any(n.startswith("mtp.") for n in ckpt.names())


def load_params(ckpt: Checkpoint, c: HFConfig, *, vision: str = "skip") -> tuple[HFParams, dict]:
    """The parameters, and a report: ``{"skipped": {prefix: count}, "mtp": bool}``.

    Args:
      vision: ``"skip"`` (a vision tower's tensors are not loaded; their count is reported) or
        ``"error"`` (they raise).
    """
    r = _Reader(ckpt, c.jnp_dtype)
    names = ckpt.names()
    text = "model.language_model." if any(n.startswith("model.language_model.") for n in names) else "model."
    d = c.d_model
    blocks = tuple(_block(r, f"{text}layers.{i}.", c, kind, c.moe_layers[i]) for i, kind in enumerate(c.kinds))
    embed = r.arr(r.raw(text + "embed_tokens.weight", (c.vocab, d)))
    final_norm = r.vector(text + "norm.weight", d)
    head = None
    if not c.tie_embeddings:
        head = r.linear("lm_head.weight", c.vocab, d)
    elif r.has("lm_head.weight"):  # tied: the head is the embedding; a stored copy must agree
        stored = r.raw("lm_head.weight", (c.vocab, d))
        if not np.array_equal(np.asarray(stored), np.asarray(ckpt.get(text + "embed_tokens.weight"))):
            raise ValueError(f"load_pretrained: {ckpt.path}: tie_word_embeddings is true, but tensor 'lm_head.weight' "
                             f"differs from {text + 'embed_tokens.weight'!r}")  # fmt: skip
    mtp = None
    if has_mtp(ckpt):
        mtp_moe = r.has("mtp.layers.0.mlp.gate.weight") and c.num_experts > 0
        mc = HFConfig(**{**c.__dict__, "layer_types": ("full_attention",), "moe_layers": (mtp_moe,), "draft": "mtp"})
        mtp = MTPParams(
            fc=r.linear("mtp.fc.weight", d, 2 * d), norm_embedding=r.vector("mtp.pre_fc_norm_embedding.weight", d),
            norm_hidden=r.vector("mtp.pre_fc_norm_hidden.weight", d),
            block=_block(r, "mtp.layers.0.", mc, "attention", mtp_moe), norm=r.vector("mtp.norm.weight", d),
        )  # fmt: skip
    skipped: dict[str, int] = {}
    rest = names - r.used
    for n in sorted(rest):
        pre = next((v for v in VISION_PREFIXES if n.startswith(v)), None)
        if pre is not None:
            if vision == "error":
                raise ValueError(f"load_pretrained: {ckpt.path}: tensor {n!r} belongs to a vision tower, which is "
                                 f"not supported (vision='error'; vision='skip' loads the text model alone)")  # fmt: skip
            skipped[pre] = skipped.get(pre, 0) + 1
            continue
        if re.match(r"mtp\.layers\.[1-9]", n):
            raise ValueError(f"load_pretrained: {ckpt.path}: tensor {n!r}: only one MTP block (mtp.layers.0) is "
                             f"supported")  # fmt: skip
        raise ValueError(f"load_pretrained: {ckpt.path}: unexpected tensor {n!r} (shape {list(ckpt.shape(n))}) for "
                         f"model_type {c.model_type!r}")  # fmt: skip
    return HFParams(embed, blocks, final_norm, head, mtp), {"skipped": skipped, "mtp": mtp is not None}
