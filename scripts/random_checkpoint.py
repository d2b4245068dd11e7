"""Write a random Hugging Face checkpoint of a Qwen3.5-MoE model (Qwen3.6-35B-A3B's head geometry).

NumPy and json only (no torch, no transformers): ``config.json`` as the Hub's Qwen3.6-35B-A3B ships it
(``model_type`` ``qwen3_5_moe``, the text model's sizes under ``text_config``, the weights under
``model.language_model.``), sharded ``*.safetensors`` with ``model.safetensors.index.json``, and the
MTP block's ``mtp.*`` tensors (vLLM's and SGLang's layout, one full-attention MoE block), every
tensor named and shaped as the real checkpoint names and shapes them: the experts fused
(``mlp.experts.gate_up_proj [E, 2I, d]``, ``mlp.experts.down_proj [E, d, I]``). No vision tower.

    python scripts/random_checkpoint.py --out /tmp/ckpt-a3b                  # a3b: 8 blocks, 16 experts
    python scripts/random_checkpoint.py --out /tmp/ckpt --size tiny          # a CPU smoke test (~1 MB)
    python scripts/random_checkpoint.py --out /tmp/ckpt --layers 2 --full-attention-interval 2 --vocab 8192

Sizes (``--size a3b``, the real model's head geometry; the real model in brackets where reduced):
hidden 2048; GDN 16 q/k heads, 32 v-heads, K = V = 128, conv kernel 4; attention 16 q heads and 2 KV heads
of 256 with the output gate, partial rotary 0.25 (64 dims), rope_theta 1e7; vocab 248320; MoE with the
shared expert (512) and experts of 512; ``--layers`` 8 [40] (a full-attention block every
``--full-attention-interval`` 4: 6 GDN + 2 attention), ``--experts`` 16 [256] top-``--top-k`` 8.
That default is 1.79e9 parameters, 3.6 GB in bf16 (the embedding and the head 1.02e9 of them; printed at the
end, with the shards); ``--layers 40`` is the real depth at 4.53e9 parameters, 9.1 GB.

Weights (finite in bf16 through the whole forward at the real geometry, checked on a CPU): every matrix
N(0, 1/fan_in) (unit-scale activations out of unit-scale inputs), the embedding N(0, 1), the zero-centred
norms' weights U(-0.1, 0.1) (so ``1 + weight`` is near 1 but a norm applying ``weight`` alone would show),
the GDN gated norm's U(0.9, 1.1), ``A_log = log U(1, 16)`` and ``dt_bias = softplus^-1(dt)``,
``dt`` log-uniform in [1e-3, 1e-1] (Mamba's and transformers' initialisation), the depthwise conv
N(0, 1/kernel). Each tensor is drawn from its own generator (the seed and the tensor's name), so its
values do not depend on the shard layout; the tensors are drawn and written a slice at a time (the
memory is one slice, not the checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time
import zlib

import numpy as np

SIZES = {
    # Qwen3.6-35B-A3B's (and Qwen3.5-35B-A3B's) text model, layers and experts reduced.
    "a3b": dict(hidden_size=2048, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                linear_value_head_dim=128, linear_conv_kernel_dim=4, num_attention_heads=16, num_key_value_heads=2,
                head_dim=256, partial_rotary_factor=0.25, rope_theta=10000000, vocab_size=248320,
                moe_intermediate_size=512, shared_expert_intermediate_size=512, num_hidden_layers=8, num_experts=16,
                num_experts_per_tok=8, full_attention_interval=4, max_position_embeddings=262144),
    # As the test fixtures (tests/fixtures/hf): seconds on a CPU.
    "tiny": dict(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                 linear_value_head_dim=16, linear_conv_kernel_dim=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, partial_rotary_factor=0.25, rope_theta=10000000, vocab_size=256,
                 moe_intermediate_size=32, shared_expert_intermediate_size=32, num_hidden_layers=4, num_experts=4,
                 num_experts_per_tok=2, full_attention_interval=4, max_position_embeddings=4096),
}  # fmt: skip

SLICE = 1 << 24  # elements drawn and written at a time (64 MiB of fp32)


def text_config(size: str, *, layers=None, experts=None, top_k=None, vocab=None, interval=None,
                dtype="bfloat16") -> dict:  # fmt: skip
    """The ``text_config`` of a size, with overrides; keys as the Hub's Qwen3.6-35B-A3B config.json."""
    s = dict(SIZES[size])
    for key, v in (("num_hidden_layers", layers), ("num_experts", experts), ("num_experts_per_tok", top_k),
                   ("vocab_size", vocab), ("full_attention_interval", interval)):  # fmt: skip
        if v is not None:
            s[key] = int(v)
    n, every = s["num_hidden_layers"], s["full_attention_interval"]
    if n < 1 or every < 1 or not 1 <= s["num_experts_per_tok"] <= s["num_experts"] or s["vocab_size"] < 2:
        raise SystemExit(f"random_checkpoint: need layers >= 1, interval >= 1, 1 <= top-k <= experts, vocab >= 2; "
                         f"got {n}, {every}, {s['num_experts_per_tok']}, {s['num_experts']}, {s['vocab_size']}")
    types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    rope = {"mrope_interleaved": True, "mrope_section": [11, 11, 10],
            "partial_rotary_factor": s["partial_rotary_factor"], "rope_theta": s["rope_theta"], "rope_type": "default"}
    eos = 248044 if s["vocab_size"] > 248044 else None  # the real model's <|endoftext|> (generate ignores it)
    return {
        "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True, "bos_token_id": eos,
        "dtype": dtype, "eos_token_id": eos, "full_attention_interval": every, "head_dim": s["head_dim"],
        "hidden_act": "silu", "hidden_size": s["hidden_size"], "initializer_range": 0.02, "layer_types": types,
        "linear_conv_kernel_dim": s["linear_conv_kernel_dim"], "linear_key_head_dim": s["linear_key_head_dim"],
        "linear_num_key_heads": s["linear_num_key_heads"], "linear_num_value_heads": s["linear_num_value_heads"],
        "linear_value_head_dim": s["linear_value_head_dim"], "mamba_ssm_dtype": "float32",
        "max_position_embeddings": s["max_position_embeddings"], "model_type": "qwen3_5_moe_text",
        "moe_intermediate_size": s["moe_intermediate_size"], "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False, "num_attention_heads": s["num_attention_heads"],
        "num_experts": s["num_experts"], "num_experts_per_tok": s["num_experts_per_tok"], "num_hidden_layers": n,
        "num_key_value_heads": s["num_key_value_heads"], "output_router_logits": False, "pad_token_id": None,
        "partial_rotary_factor": s["partial_rotary_factor"], "rms_norm_eps": 1e-06, "rope_parameters": rope,
        "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": s["shared_expert_intermediate_size"],
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": s["vocab_size"],
    }  # fmt: skip


def full_config(text: dict) -> dict:
    """The top-level config.json: Qwen3_5MoeForConditionalGeneration's, without a vision tower (no
    ``vision_config``, no image or video token ids)."""
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe", "dtype": text["dtype"],
        "text_config": text, "tie_word_embeddings": False, "transformers_version": "5.25.0",
    }  # fmt: skip


# -- the tensors: (name, shape, init) with init ("normal", std) | ("uniform", lo, hi) | ("A_log",) | ("dt_bias",)


def _linear(name, n_out, n_in):
    return (name, (n_out, n_in), ("normal", n_in**-0.5))


def _norm(name, n):  # zero-centred: the model applies 1 + weight
    return (name, (n,), ("uniform", -0.1, 0.1))


def _attention(p, t):
    d, nq, nkv, hd = t["hidden_size"], t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    return [
        _linear(p + "self_attn.q_proj.weight", 2 * nq * hd, d),  # per head [q | output gate]
        _linear(p + "self_attn.k_proj.weight", nkv * hd, d), _linear(p + "self_attn.v_proj.weight", nkv * hd, d),
        _linear(p + "self_attn.o_proj.weight", d, nq * hd),
        _norm(p + "self_attn.q_norm.weight", hd), _norm(p + "self_attn.k_norm.weight", hd),
    ]  # fmt: skip


def _gdn(p, t):
    d, H, HV = t["hidden_size"], t["linear_num_key_heads"], t["linear_num_value_heads"]
    K, V, Kc = t["linear_key_head_dim"], t["linear_value_head_dim"], t["linear_conv_kernel_dim"]
    conv = 2 * H * K + HV * V
    a = p + "linear_attn."
    return [
        _linear(a + "in_proj_qkv.weight", conv, d), _linear(a + "in_proj_z.weight", HV * V, d),
        _linear(a + "in_proj_b.weight", HV, d), _linear(a + "in_proj_a.weight", HV, d),
        (a + "conv1d.weight", (conv, 1, Kc), ("normal", Kc**-0.5)),
        (a + "A_log", (HV,), ("A_log",)), (a + "dt_bias", (HV,), ("dt_bias",)),
        (a + "norm.weight", (V,), ("uniform", 0.9, 1.1)),  # the gated norm: a plain weight
        _linear(a + "out_proj.weight", d, HV * V),
    ]  # fmt: skip


def _moe(p, t):
    d, E, I, Is = t["hidden_size"], t["num_experts"], t["moe_intermediate_size"], t["shared_expert_intermediate_size"]
    m = p + "mlp."
    return [
        _linear(m + "gate.weight", E, d),
        (m + "experts.gate_up_proj", (E, 2 * I, d), ("normal", d**-0.5)),  # [gate | up] per expert
        (m + "experts.down_proj", (E, d, I), ("normal", I**-0.5)),
        _linear(m + "shared_expert.gate_proj.weight", Is, d), _linear(m + "shared_expert.up_proj.weight", Is, d),
        _linear(m + "shared_expert.down_proj.weight", d, Is), _linear(m + "shared_expert_gate.weight", 1, d),
    ]  # fmt: skip


def _block(p, t, kind):
    d = t["hidden_size"]
    mixer = _gdn(p, t) if kind == "linear_attention" else _attention(p, t)
    return [_norm(p + "input_layernorm.weight", d), *mixer, _norm(p + "post_attention_layernorm.weight", d),
            *_moe(p, t)]  # fmt: skip


def tensors(t: dict) -> list[tuple[str, tuple[int, ...], tuple]]:
    """Every tensor of the checkpoint, in the order written."""
    d, vocab = t["hidden_size"], t["vocab_size"]
    lm = "model.language_model."
    out = [(lm + "embed_tokens.weight", (vocab, d), ("normal", 1.0))]
    for i, kind in enumerate(t["layer_types"]):
        out += _block(f"{lm}layers.{i}.", t, kind)
    out += [_norm(lm + "norm.weight", d), _linear("lm_head.weight", vocab, d)]
    out += [_linear("mtp.fc.weight", d, 2 * d), _norm("mtp.pre_fc_norm_embedding.weight", d),
            _norm("mtp.pre_fc_norm_hidden.weight", d)]  # fmt: skip
    out += _block("mtp.layers.0.", t, "full_attention")
    out += [_norm("mtp.norm.weight", d)]
    return out


def _draw(rng: np.random.Generator, init: tuple, n: int) -> np.ndarray:
    kind = init[0]
    if kind == "normal":
        return rng.standard_normal(n, dtype=np.float32) * np.float32(init[1])
    if kind == "uniform":
        return rng.uniform(init[1], init[2], n).astype(np.float32)
    if kind == "A_log":
        return np.log(rng.uniform(1.0, 16.0, n)).astype(np.float32)
    if kind == "dt_bias":
        dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), n))
        return (dt + np.log(-np.expm1(-dt))).astype(np.float32)  # softplus^-1(dt)
    raise ValueError(f"unknown init {init!r}")


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bit patterns (uint16), round to nearest even (finite inputs)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16).astype(np.uint16)


def values(name: str, shape, init, seed: int, dtype: str):
    """The tensor's bytes, a slice at a time (each tensor from its own generator)."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    n = int(np.prod(shape))
    for start in range(0, n, SLICE):
        x = _draw(rng, init, min(SLICE, n - start))
        yield (to_bf16_bits(x) if dtype == "bfloat16" else x.astype("<f4")).tobytes()


def write_safetensors(path: str, entries, seed: int, dtype: str) -> int:
    """One ``.safetensors`` file of ``entries`` [(name, shape, init)], streamed; returns its data bytes."""
    item = 2 if dtype == "bfloat16" else 4
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, _ in entries:
        n = int(np.prod(shape)) * item
        header[name] = {"dtype": "BF16" if item == 2 else "F32", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape, init in entries:
            for chunk in values(name, shape, init, seed, dtype):
                f.write(chunk)
    return off


def write_checkpoint(out: str, t: dict, *, seed: int = 0, shard_bytes: int = 2 << 30, log=print) -> dict:
    """Write config.json, the shards and the index into ``out``; returns a summary."""
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(out):  # a previous checkpoint's shards would confuse the loader
        if f.endswith(".safetensors") or f in ("model.safetensors.index.json", "config.json"):
            os.remove(os.path.join(out, f))
    item = 2 if t["dtype"] == "bfloat16" else 4
    shards, cur, cur_bytes = [], [], 0
    for e in tensors(t):
        n = int(np.prod(e[1])) * item
        if cur and cur_bytes + n > shard_bytes:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(e)
        cur_bytes += n
    shards.append(cur)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(full_config(t), f, indent=2, sort_keys=True)
        f.write("\n")
    weight_map, total, t0 = {}, 0, time.perf_counter()
    for i, entries in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += write_safetensors(os.path.join(out, fname), entries, seed, t["dtype"])
        weight_map.update({name: fname for name, _, _ in entries})
        log(f"  {fname}: {len(entries)} tensors, {total / 1e9:.2f} GB so far ({time.perf_counter() - t0:.0f} s)")
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
        f.write("\n")
    params = sum(int(np.prod(s)) for _, s, _ in tensors(t))
    mtp = sum(int(np.prod(s)) for n, s, _ in tensors(t) if n.startswith("mtp."))
    return {"parameters": params, "mtp_parameters": mtp, "bytes": total, "shards": len(shards),
            "tensors": len(weight_map), "seconds": time.perf_counter() - t0}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the checkpoint folder (created; old shards in it are removed)")
    ap.add_argument("--size", choices=list(SIZES), default="a3b", help="a3b (default) or tiny")
    ap.add_argument("--layers", type=int, default=None, help="decoder blocks (a3b: 8; the real model has 40)")
    ap.add_argument("--full-attention-interval", type=int, default=None,
                    help="every n-th block is full attention (default 4, as the real model)")
    ap.add_argument("--experts", type=int, default=None, help="routed experts (a3b: 16; the real model has 256)")
    ap.add_argument("--top-k", type=int, default=None, help="experts per token (a3b: 8, as the real model)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary (a3b: 248320, as the real model)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="stored dtype (bfloat16)")
    ap.add_argument("--shard-gb", type=float, default=2.0, help="largest shard in GB (default 2)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t = text_config(args.size, layers=args.layers, experts=args.experts, top_k=args.top_k, vocab=args.vocab,
                    interval=args.full_attention_interval, dtype=args.dtype)  # fmt: skip
    kinds = t["layer_types"]
    print(f"random_checkpoint: {args.size}: {len(kinds)} blocks ({kinds.count('linear_attention')} GDN, "
          f"{kinds.count('full_attention')} attention), d {t['hidden_size']}, GDN H={t['linear_num_key_heads']} "
          f"HV={t['linear_num_value_heads']} K={t['linear_key_head_dim']} V={t['linear_value_head_dim']}, attention "
          f"{t['num_attention_heads']}q/{t['num_key_value_heads']}kv x {t['head_dim']}, {t['num_experts']} experts "
          f"top-{t['num_experts_per_tok']} + shared, vocab {t['vocab_size']}, {args.dtype}, MTP block; -> {args.out}",
          flush=True)  # fmt: skip
    s = write_checkpoint(args.out, t, seed=args.seed, shard_bytes=int(args.shard_gb * 1e9),
                         log=lambda m: print(m, flush=True))  # fmt: skip
    print(f"random_checkpoint: {s['parameters']:,} parameters ({s['parameters'] / 1e9:.2f}e9, of which MTP "
          f"{s['mtp_parameters']:,}), {s['bytes'] / 1e9:.2f} GB in {s['shards']} shard(s), {s['tensors']} tensors, "
          f"{s['seconds']:.0f} s", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
