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
- ``gaps [P, NEW]``: the top-2 logit gap of each generated token (near-ties show here);
- Qwen4-Exp only: ``indexer_selected [P, A, T + NEW, T + NEW]``, the QSA indexer's choice (the keys each query
  attends to, per attention block) in a full fp32 forward of ``generated``.

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

The other families (no MTP block: their checkpoints ship none):

- ``olmo_hybrid``: ``OlmoHybridForCausalLM`` with ``linear_allow_neg_eigval`` on (beta = 2 sigmoid(b)),
  no RoPE (``rope_parameters.rope_theta`` null, as the released checkpoints), GDN with H = 2, HV = 4,
  K = 16, V = 32; saved in bf16. **Post-processed to the Hub's layout**: ``save_pretrained`` splits the
  conv weight back into ``q_conv1d``/``k_conv1d``/``v_conv1d`` in equal thirds (``torch.chunk``, the
  reverse of the concatenation transformers loads with), which is not the Hub's split when the key and
  value widths differ; the script re-splits it by key/key/value width (H*K, H*K, HV*V rows).
- ``olmo_hybrid_noneg``: the same class with ``linear_allow_neg_eigval`` off (beta = sigmoid(b)), RoPE on
  (theta 10000), H = HV = 2, K = 16, V = 32; fp32, left as ``save_pretrained`` wrote it (the conv in
  equal thirds; the norms under the Hub's ``attention_layer_norm`` / ``feedforward_layer_norm`` names,
  transformers' reverse renaming).
- ``kimi_linear``: ``KimiLinearForCausalLM``: 3 KDA blocks (H = 2, K = V = 16) and one MLA block (4 heads,
  no q LoRA, kv rank 32, nope 16 + shared rope part 8, v 16), ``first_k_dense_replace`` 1 (block 0 a dense
  MLP, blocks 1-3 the sigmoid-routed group-limited MoE: 8 experts in 4 groups, top-2 groups, top-2 experts,
  a random ``e_score_correction_bias``, one shared expert); saved in bf16, experts one by one
  (``block_sparse_moe.experts.<e>.w1/w2/w3``, as ``save_pretrained`` writes them). **Post-processed to the
  Hub's config form**: ``config.json`` carries ``linear_attn_config`` (``kda_layers``, ``full_attn_layers``
  1-indexed, ``head_dim``, ``num_heads``, ``short_conv_kernel_size``) and ``first_k_dense_replace`` instead
  of ``layer_types``, ``mlp_layer_types`` and ``linear_*``; and the dense block's MLP is renamed from
  ``block_sparse_moe.*`` (transformers' reverse renaming applies to every ``mlp.``) to ``mlp.*``, as the Hub
  stores it.

- ``qwen4_exp_text``: ``Qwen4ExpForCausalLM`` (fp32): 3 GDN blocks and one QSA indexed-attention block (8 indexer
  heads of 16, blocks of 4 keys, a budget of 12: with the 76-token sequences a query chooses 3 of up to 19
  blocks), 3 hyper-connection streams, PLE on blocks 1 and 3 (1-indexed; 3-grams, 2 heads an order, primes from
  97, the table in 2 shards as ``save_pretrained`` writes it), the GDN gate SiLU; EOS (token 3) inside the prompts
  (the n-gram rule at an EOS), and ``generate`` without an EOS stop.
- ``qwen4_exp``: ``Qwen4ExpForConditionalGeneration`` as the Hub ships Qwen4-Exp (a ``text_config``, the text
  weights under ``model.language_model.``, a small vision tower), 4 streams, PLE on block 2 only, the GDN gate
  sigmoid (``output_gate_type``), EOS 5; saved in bf16.

Every post-processed folder is loaded back with ``from_pretrained`` and must give the same fp32 logits
(so the layout written is one transformers reads). The KDA and GDN layers run transformers' pure-torch
chunked and recurrent paths (no ``fla``: the script refuses to run where it is importable).

``--only NAME ...`` writes some fixtures only (the others are left as they are).
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


#: The families beside Qwen: tiny configs; pad token 0 (inside the vocabulary), no BOS/EOS.
OTHER = dict(vocab_size=VOCAB, hidden_size=D_MODEL, num_hidden_layers=4, initializer_range=0.2, pad_token_id=0,
             bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)  # fmt: skip
OLMO = dict(OTHER, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
            linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=32, linear_num_key_heads=2,
            layer_types=["linear_attention"] * 3 + ["full_attention"])  # fmt: skip
KIMI = dict(OTHER, intermediate_size=64, moe_intermediate_size=16, num_attention_heads=4, num_key_value_heads=4,
            kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            num_local_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
            routed_scaling_factor=2.446, norm_topk_prob=True, rms_norm_eps=1e-5, linear_head_dim=16,
            linear_num_heads=2, linear_conv_kernel_dim=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"], mlp_layer_types=["dense"] + ["sparse"] * 3)
#: Which fixtures are saved in bf16 (the fp32 reference then runs on the bf16-rounded weights).
BF16 = ("qwen3_5", "olmo_hybrid", "kimi_linear", "qwen4_exp")


def other_configs():
    """The olmo_hybrid and kimi_linear fixtures' configs (module docstring)."""
    from transformers import KimiLinearConfig, OlmoHybridConfig

    nope = dict(rope_type="default", rope_theta=None)  # the released checkpoints: no RoPE
    return {
        "olmo_hybrid": OlmoHybridConfig(**OLMO, linear_num_value_heads=4, linear_allow_neg_eigval=True,
                                        rope_parameters=nope),
        "olmo_hybrid_noneg": OlmoHybridConfig(**OLMO, linear_num_value_heads=2, linear_allow_neg_eigval=False,
                                              rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
        "kimi_linear": KimiLinearConfig(**KIMI),
    }  # fmt: skip


#: Qwen4-Exp's tiny text model (module docstring); EOS inside the vocabulary (PLE's n-gram rule needs one).
QWEN4 = dict(COMMON, **MOE, rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                                                 mrope_section=[2, 1, 1], mrope_interleaved=True),
             hc_lowrank=16, ple_embed_dim=32, ple_conv_kernel_size=4, ngram_size=3, heads_per_ngram=2,
             ngram_vocab_size_base=97, make_ngram_vocab_size_divisible_by=16, seed=1234, split_ngram_parts=2,
             indexer_n_heads=8, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=12, indexer_compress_ratio=4,
             pad_token_id=0, bos_token_id=None, tie_word_embeddings=False)  # fmt: skip


def qwen4_configs():
    from transformers import Qwen4ExpConfig, Qwen4ExpTextConfig

    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=D_MODEL, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)  # fmt: skip
    return {
        "qwen4_exp_text": Qwen4ExpTextConfig(**QWEN4, hc_count=3, ple_layer_ids=[1, 3], eos_token_id=3),
        "qwen4_exp": Qwen4ExpConfig(text_config=dict(QWEN4, hc_count=4, ple_layer_ids=[2], eos_token_id=5,
                                                     output_gate_type="sigmoid"),
                                    vision_config=vision, tie_word_embeddings=False),
    }  # fmt: skip


#: The Qwen4-Exp fixtures' weights' seed offset: one whose greedy top-2 gaps all sit above 1e-3 (fp32 noise is
#: ~1e-5), so that greedy tokens compare.
QWEN4_SEED = 3
#: The EOS token each Qwen4-Exp fixture's prompts carry (at a few places), for the n-gram rule.
QWEN4_EOS = {"qwen4_exp_text": 3, "qwen4_exp": 5}


def all_configs():
    return {**configs(), **other_configs(), **qwen4_configs()}


def _plain_norms(model, g):
    """The other families' norms multiply by a plain ``weight``: drawn near 1 (not all ones, so that a norm
    applying ``1 + weight`` or none at all is caught); ``dt_bias``, ``A_log`` and the MoE's correction bias
    at random."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.4 * (torch.rand(p.shape, generator=g) - 0.5))
        elif name.endswith("dt_bias"):
            p.copy_(torch.randn(p.shape, generator=g))
        elif name.endswith("A_log"):
            p.copy_(torch.log(torch.empty(p.shape).uniform_(0.5, 8.0, generator=g)))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.2 * torch.randn(b.shape, generator=g))


def build(model_type, config):
    from transformers import (KimiLinearForCausalLM, OlmoHybridForCausalLM, Qwen3_5ForConditionalGeneration,
                              Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM)  # fmt: skip

    other = {"olmo_hybrid": OlmoHybridForCausalLM, "olmo_hybrid_noneg": OlmoHybridForCausalLM,
             "kimi_linear": KimiLinearForCausalLM}  # fmt: skip
    if model_type in other:
        model = other[model_type](config).eval()
        with torch.no_grad():
            _plain_norms(model, torch.Generator().manual_seed(SEED + 1))
        return model
    if model_type in QWEN4_EOS:
        return _qwen4(model_type, config)
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


def _qwen4(model_type, config):
    """Qwen4-Exp: every RMSNorm zero-centred at random (hyper-connections, PLE, indexer included; the GDN's gated
    norm a plain weight near 1), the PLE conv (initialised to zeros) at random, ``dt_bias`` and ``A_log`` at random;
    no EOS stop in ``generate`` (the config's EOS stays, for PLE)."""
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpForConditionalGeneration

    cls = Qwen4ExpForCausalLM if model_type == "qwen4_exp_text" else Qwen4ExpForConditionalGeneration
    torch.manual_seed(SEED + QWEN4_SEED)
    model = cls(config).eval()
    g = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            last = name.rsplit(".", 2)[-2]
            if "visual" in name:
                continue
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.3 * (torch.rand(p.shape, generator=g) - 0.5))
            elif "norm" in last and name.endswith(".weight"):
                p.copy_(0.4 * (torch.rand(p.shape, generator=g) - 0.5))
            elif name.endswith("ple.conv1d.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.empty(p.shape).uniform_(0.5, 8.0, generator=g)))
    model.generation_config.eos_token_id = None
    return model


def qwen4_selected(model, sequences):
    """The QSA indexer's choice in a full fp32 forward of ``sequences``: ``[P, A, L, L]`` bool, per attention block
    the keys each query attends to (``indexer_selected`` in ``expected.npz``)."""
    text = getattr(model.model, "language_model", model.model)
    got = []
    for layer in text.layers:
        if getattr(layer, "self_attn", None) is None:
            continue
        ix = layer.self_attn.indexer
        orig = ix._select_tokens

        def hook(*a, _orig=orig, **kw):
            out = _orig(*a, **kw)
            got.append(out[:, 0].numpy().copy())
            return out

        ix._select_tokens = hook
    model(input_ids=sequences)
    for layer in text.layers:
        if getattr(layer, "self_attn", None) is not None:
            del layer.self_attn.indexer._select_tokens
    return np.stack(got, axis=1)


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


def _load_file(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def _save_file(tensors, path):
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


def olmo_hub_conv_split(folder: pathlib.Path, config):
    """The conv weights re-split by key/key/value width (the Hub's layout; module docstring)."""
    key, value = config.linear_num_key_heads * config.linear_key_head_dim, (
        config.linear_num_value_heads * config.linear_value_head_dim)
    t = _load_file(folder / "model.safetensors")
    for pre in sorted({k[: -len("q_conv1d.weight")] for k in t if k.endswith("q_conv1d.weight")}):
        parts = [t.pop(pre + f"{n}_conv1d.weight") for n in "qkv"]
        full = torch.cat(parts, 0)
        assert [p.shape[0] for p in parts] == [p.shape[0] for p in full.chunk(3, 0)]  # what save_pretrained wrote
        for n, part in zip("qkv", full.split([key, key, value], 0)):
            t[pre + f"{n}_conv1d.weight"] = part
    _save_file(t, folder / "model.safetensors")


def kimi_hub_layout(folder: pathlib.Path, config):
    """The Hub's config form (``linear_attn_config``, ``first_k_dense_replace``) and ``mlp.*`` names for the
    dense blocks (module docstring)."""
    path = folder / "config.json"
    c = json.loads(path.read_text())
    types, mlp_types = c.pop("layer_types"), c.pop("mlp_layer_types")
    dense = [i for i, t in enumerate(mlp_types) if t == "dense"]
    assert dense == list(range(len(dense))), mlp_types  # first_k_dense_replace describes it
    c["linear_attn_config"] = {
        "kda_layers": [i + 1 for i, t in enumerate(types) if t == "linear_attention"],
        "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"],
        "head_dim": c.pop("linear_head_dim"), "num_heads": c.pop("linear_num_heads"),
        "short_conv_kernel_size": c.pop("linear_conv_kernel_dim"),
    }  # fmt: skip
    c.update(first_k_dense_replace=len(dense), moe_layer_freq=1, mla_use_nope=True,
             moe_router_activation_func="sigmoid", use_grouped_topk=True)  # fmt: skip
    path.write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")
    t = _load_file(folder / "model.safetensors")
    for i in dense:
        for n in ("gate_proj", "up_proj", "down_proj"):
            t[f"model.layers.{i}.mlp.{n}.weight"] = t.pop(f"model.layers.{i}.block_sparse_moe.{n}.weight")
    _save_file(t, folder / "model.safetensors")


#: Post-processing to the Hub's layout, per fixture (module docstring).
POST = {"olmo_hybrid": olmo_hub_conv_split, "kimi_linear": kimi_hub_layout}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parents[1] / "tests/fixtures/hf"))
    ap.add_argument("--only", nargs="+", metavar="NAME", help="write these fixtures only")
    args = ap.parse_args()
    import importlib.util

    if importlib.util.find_spec("fla") is not None:
        raise SystemExit("make_hf_fixtures: flash-linear-attention (fla) is importable; the fixtures are written by "
                         "transformers' pure-torch GDN/KDA paths: run in an environment without it")  # fmt: skip
    torch.manual_seed(SEED)
    rng = np.random.default_rng(SEED)
    prompts = rng.integers(1, VOCAB, size=(PROMPTS, PROMPT_LEN)).astype(np.int64)
    todo = all_configs()
    if args.only:
        unknown = sorted(set(args.only) - set(todo))
        if unknown:
            raise SystemExit(f"make_hf_fixtures: unknown fixture(s) {unknown}; known: {sorted(todo)}")
        todo = {k: v for k, v in todo.items() if k in args.only}
    for model_type, config in todo.items():
        torch.manual_seed(SEED)
        folder = pathlib.Path(args.out) / model_type
        folder.mkdir(parents=True, exist_ok=True)
        for f in folder.iterdir():
            f.unlink()
        model = build(model_type, config)
        save_dtype = torch.bfloat16 if model_type in BF16 else torch.float32
        if save_dtype == torch.bfloat16:  # the fp32 reference runs on the bf16-rounded weights too
            model = model.to(torch.bfloat16).to(torch.float32)
        # qwen3_next: sharded (a small max_shard_size), so the loader reads an index file.
        shard = "200KB" if model_type == "qwen3_next" else "50MB"
        model.to(save_dtype).save_pretrained(folder, max_shard_size=shard)
        model = model.to(torch.float32)
        if model_type in POST:
            POST[model_type](folder, config)
        elif model_type.startswith("qwen3"):
            add_mtp(folder, mtp_weights(config, model_type, save_dtype, D_MODEL))
        rows = prompts
        if model_type in QWEN4_EOS:  # EOS at a few places: row 0 at 3, row 1 at 4 and 5, row 2 last
            rows = prompts.copy()
            rows[0, 3] = rows[1, 4] = rows[1, 5] = rows[2, -1] = QWEN4_EOS[model_type]
        ids = torch.from_numpy(rows)
        if model_type in QWEN4_EOS:  # from the folder: model.to(bf16) above also rounded RoPE's inv_freq buffers
            model = type(model).from_pretrained(folder, dtype=torch.float32).eval()
            model.generation_config.eos_token_id = None
        with torch.no_grad():
            lg32 = model(input_ids=ids).logits.float().numpy()
            if model_type in other_configs() or model_type in QWEN4_EOS:  # what was written is what transformers reads
                again = type(model).from_pretrained(folder, dtype=torch.float32).eval()
                back = again(input_ids=ids).logits.float().numpy()
                assert np.array_equal(back, lg32), f"{model_type}: reloaded logits off by {np.abs(back - lg32).max()}"
            out = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, output_scores=True, return_dict_in_generate=True)  # fmt: skip
            scores = torch.stack(out.scores, 1).float()
            top2 = torch.topk(scores, 2, dim=-1).values
            gaps = (top2[..., 0] - top2[..., 1]).numpy()
            extra = {"indexer_selected": qwen4_selected(model, out.sequences)} if model_type in QWEN4_EOS else {}
            lg16 = model.to(torch.bfloat16)(input_ids=ids).logits.float().numpy()
        np.savez_compressed(
            folder / "expected.npz", prompts=rows.astype(np.int32), logits_fp32=lg32.astype(np.float32),
            logits_bf16=lg16.astype(np.float32), generated=out.sequences.numpy().astype(np.int32),
            gaps=gaps.astype(np.float32), **extra,
        )  # fmt: skip
        size = sum(f.stat().st_size for f in folder.iterdir())
        print(f"{model_type}: {folder} ({size / 1024:.0f} KiB); min generate gap {gaps.min():.2e}, "
              f"logit range {lg32.min():.2f}..{lg32.max():.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
