"""Write tiny random Hugging Face checkpoints and transformers' outputs on them, as test fixtures.

Run by hand in a virtual environment with ``transformers`` (5.x) and ``torch`` (CPU is enough):

    python scripts/make_hf_fixtures.py [--out tests/fixtures/hf]

For each model type it writes ``<out>/<model_type>/``: the checkpoint as ``save_pretrained`` writes it
(``config.json``, ``*.safetensors``), random ``mtp.*`` weights in the layout vLLM's and SGLang's
Qwen3-Next MTP code reads (``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``,
``mtp.layers.0.*`` one full-attention decoder block, ``mtp.norm``) in a file of their own, listed in a
sharded ``model.safetensors.index.json`` where the model has one; and ``expected.npz``:

- ``prompts [P, T]``: the prompts (int32);
- ``logits_fp32``, ``logits_bf16 [P, T, vocab]``: transformers' logits of a full forward (fp32, and
  the same weights cast to bf16);
- ``generated [P, T + NEW]``: transformers' greedy ``generate`` in fp32 (no EOS stop);
- ``gaps [P, NEW]``: the top-2 logit gap of each generated token (near-ties show here).

The three checkpoints differ on purpose, to cover the loader's cases:

- ``qwen3_next``: ``Qwen3NextForCausalLM``, fp32, untied head, sparse MoE blocks and one dense MLP
  (``mlp_only_layers``), the packed ``in_proj_qkvz``/``in_proj_ba``; sharded (an index file).
- ``qwen3_5``: ``Qwen3_5ForConditionalGeneration`` as the Hub ships Qwen3.5 (a ``text_config``,
  the text weights under ``model.language_model.``, a small vision tower under ``model.visual.``),
  saved in bf16, tied embeddings, dense MLPs.
- ``qwen3_5_moe``: ``Qwen3_5MoeForCausalLM``, fp32, every block sparse MoE.

Weights: transformers' initialisation with a larger ``initializer_range`` (0.2, so that logits are
a few units wide and greedy top-2 gaps sit far above fp32 noise), and the norms' zero-centred weights,
the gated norms' weights, ``dt_bias`` and ``A_log`` drawn at random (an all-zero ``weight`` would hide
a norm applying ``weight`` instead of ``1 + weight``).
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np
import torch

SEED = 20261205
VOCAB = 256
PROMPTS, PROMPT_LEN, NEW = 4, 12, 64
D_MODEL = 64

COMMON = dict(
    vocab_size=VOCAB, hidden_size=D_MODEL, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6,
    initializer_range=0.2,
)  # fmt: skip
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)


def configs():
    from transformers import Qwen3_5Config, Qwen3_5MoeTextConfig, Qwen3NextConfig

    rope = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)
    nxt = Qwen3NextConfig(**COMMON, **MOE, intermediate_size=96, decoder_sparse_step=1, mlp_only_layers=[1],
                          norm_topk_prob=True, tie_word_embeddings=False, rope_parameters=rope)  # fmt: skip
    text = dict(COMMON, intermediate_size=96, tie_word_embeddings=True,
                rope_parameters=dict(rope, mrope_section=[2, 1, 1], mrope_interleaved=True))  # fmt: skip
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=D_MODEL, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)  # fmt: skip
    q35 = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True)
    moe = Qwen3_5MoeTextConfig(**COMMON, **MOE, tie_word_embeddings=False, rope_parameters=rope)
    return {"qwen3_next": nxt, "qwen3_5": q35, "qwen3_5_moe": moe}


def build(model_type, config):
    from transformers import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM

    cls = {"qwen3_next": Qwen3NextForCausalLM, "qwen3_5": Qwen3_5ForConditionalGeneration,
           "qwen3_5_moe": Qwen3_5MoeForCausalLM}[model_type]  # fmt: skip
    model = cls(config).eval()
    g = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):  # gated norm: plain weight, near 1
                p.copy_(1.0 + 0.3 * (torch.rand(p.shape, generator=g) - 0.5))
            elif name.endswith("norm.weight") and "visual" not in name:  # zero-centred: 1 + weight
                p.copy_(0.4 * (torch.rand(p.shape, generator=g) - 0.5))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.empty(p.shape).uniform_(0.5, 8.0, generator=g)))
    return model


def mtp_weights(config, model_type, dtype, hidden):
    """Random ``mtp.*`` tensors: vLLM's/SGLang's Qwen3-Next MTP layout (one full-attention block)."""
    text = getattr(config, "text_config", config)
    g = torch.Generator().manual_seed(SEED + 2)
    d, nq, nkv, hd = text.hidden_size, text.num_attention_heads, text.num_key_value_heads, text.head_dim

    def w(*shape, std=0.2):
        return (std * torch.randn(shape, generator=g)).to(dtype)

    def norm(n):
        return (0.4 * (torch.rand(n, generator=g) - 0.5)).to(dtype)

    out = {
        "mtp.fc.weight": w(d, 2 * d, std=0.1),
        "mtp.pre_fc_norm_embedding.weight": norm(d),
        "mtp.pre_fc_norm_hidden.weight": norm(d),
        "mtp.norm.weight": norm(d),
    }
    p = "mtp.layers.0."
    out.update({
        p + "input_layernorm.weight": norm(d), p + "post_attention_layernorm.weight": norm(d),
        p + "self_attn.q_proj.weight": w(2 * nq * hd, d), p + "self_attn.k_proj.weight": w(nkv * hd, d),
        p + "self_attn.v_proj.weight": w(nkv * hd, d), p + "self_attn.o_proj.weight": w(d, nq * hd),
        p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd),
    })  # fmt: skip
    if getattr(text, "num_experts", 0):
        E, I, Is = text.num_experts, text.moe_intermediate_size, text.shared_expert_intermediate_size
        out[p + "mlp.gate.weight"] = w(E, d)
        for e in range(E):
            for n, shape in (("gate_proj", (I, d)), ("up_proj", (I, d)), ("down_proj", (d, I))):
                out[p + f"mlp.experts.{e}.{n}.weight"] = w(*shape)
        for n, shape in (("gate_proj", (Is, d)), ("up_proj", (Is, d)), ("down_proj", (d, Is))):
            out[p + f"mlp.shared_expert.{n}.weight"] = w(*shape)
        out[p + "mlp.shared_expert_gate.weight"] = w(1, d)
    else:
        I = text.intermediate_size
        for n, shape in (("gate_proj", (I, d)), ("up_proj", (I, d)), ("down_proj", (d, I))):
            out[p + f"mlp.{n}.weight"] = w(*shape)
    return out


def add_mtp(folder: pathlib.Path, tensors):
    """Write the MTP tensors to a shard of their own and list every tensor in an index file."""
    from safetensors.torch import save_file
    from safetensors import safe_open

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "mtp.safetensors"), metadata={"format": "pt"})
    index_path = folder / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
    else:
        index = {"metadata": {}, "weight_map": {}}
        for f in sorted(folder.glob("*.safetensors")):
            if f.name == "mtp.safetensors":
                continue
            with safe_open(str(f), "pt") as fh:
                index["weight_map"].update({k: f.name for k in fh.keys()})
    index["weight_map"].update({k: "mtp.safetensors" for k in tensors})
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parents[1] / "tests/fixtures/hf"))
    args = ap.parse_args()
    torch.manual_seed(SEED)
    rng = np.random.default_rng(SEED)
    prompts = rng.integers(1, VOCAB, size=(PROMPTS, PROMPT_LEN)).astype(np.int64)
    for model_type, config in configs().items():
        torch.manual_seed(SEED)
        folder = pathlib.Path(args.out) / model_type
        folder.mkdir(parents=True, exist_ok=True)
        for f in folder.iterdir():
            f.unlink()
        model = build(model_type, config)
        save_dtype = torch.bfloat16 if model_type == "qwen3_5" else torch.float32
        if save_dtype == torch.bfloat16:  # the fp32 reference runs on the bf16-rounded weights too
            model = model.to(torch.bfloat16).to(torch.float32)
        # qwen3_next: sharded (a small max_shard_size), so the loader reads an index file.
        shard = "200KB" if model_type == "qwen3_next" else "50MB"
        model.to(save_dtype).save_pretrained(folder, max_shard_size=shard)
        model = model.to(torch.float32)
        add_mtp(folder, mtp_weights(config, model_type, save_dtype, D_MODEL))
        ids = torch.from_numpy(prompts)
        with torch.no_grad():
            lg32 = model(input_ids=ids).logits.float().numpy()
            out = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, output_scores=True, return_dict_in_generate=True)  # fmt: skip
            scores = torch.stack(out.scores, 1).float()
            top2 = torch.topk(scores, 2, dim=-1).values
            gaps = (top2[..., 0] - top2[..., 1]).numpy()
            lg16 = model.to(torch.bfloat16)(input_ids=ids).logits.float().numpy()
        np.savez_compressed(
            folder / "expected.npz", prompts=prompts.astype(np.int32), logits_fp32=lg32.astype(np.float32),
            logits_bf16=lg16.astype(np.float32), generated=out.sequences.numpy().astype(np.int32),
            gaps=gaps.astype(np.float32),
        )  # fmt: skip
        size = sum(f.stat().st_size for f in folder.iterdir())
        print(f"{model_type}: {folder} ({size / 1024:.0f} KiB); min generate gap {gaps.min():.2e}, "
              f"logit range {lg32.min():.2f}..{lg32.max():.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
