"""OLMo-Hybrid and Kimi Linear checkpoints: ``load_pretrained`` against transformers.

The fixtures (``tests/fixtures/hf/{olmo_hybrid,olmo_hybrid_noneg,kimi_linear}``) are tiny random checkpoints that
transformers 5.25.0 wrote (``scripts/make_hf_fixtures.py``, which documents each one's layout), with its logits and
greedy tokens. This suite needs neither torch nor transformers.

- fp32: the logits within 1e-4 of the largest logit (relative). Measured: olmo_hybrid 1.4e-5, olmo_hybrid_noneg
  5.3e-6, kimi_linear 3.3e-6.
- bf16: OLMo-Hybrid's logits no further from transformers' bf16 than transformers' bf16 is from its fp32 (max
  and mean), as for Qwen (tests/test_pretrained.py). Kimi Linear's MoE routes by a near-tie now and then: a
  token whose route flips in bf16 jumps by ~2.5 (transformers' own bf16 flips one, at another position than
  ours). So for it a flip is counted (a position more than FLIP from the fp32 logits) and may not occur more
  often than in transformers' bf16 run, plus one; every other position is held to the rule above.
- Greedy tokens (GDN_FULL_TESTS): ``greedy_reference`` (a full forward per token) equals transformers' greedy
  ``generate``, the near-tie rule of tests/test_pretrained.py (no near-tie fired: the smallest gap is 3.7e-4).
- The loader's layouts: the same parameters from the Hub's layout and from transformers' (and from what
  ``save_pretrained`` writes); errors name the tensor and the file.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import struct

import jax
import ml_dtypes
import numpy as np
import pytest

from conftest import full_only
from gdn_lossless_jax.model import load_pretrained
from gdn_lossless_jax.model.hf.family import FamilyModel
from gdn_lossless_jax.model.hf.safetensors import SafetensorsFile
from gdn_lossless_jax.testing import assert_bitwise_equal

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
FAMILIES = ("olmo_hybrid", "olmo_hybrid_noneg", "kimi_linear")
REL_TOL = 1e-4
FLIP = 1.0  # a logit row this far from fp32: a MoE route flipped
NEAR_TIE = 1e-4
NEW = 64

_MODELS: dict = {}


def _model(name: str, dtype: str = "float32") -> FamilyModel:
    if (name, dtype) not in _MODELS:
        _MODELS[name, dtype] = load_pretrained(FIXTURES / name, dtype)
    return _MODELS[name, dtype]


def _expected(name: str):
    return np.load(FIXTURES / name / "expected.npz")


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_fp32(name):
    e = _expected(name)
    lg = np.asarray(_model(name).logits(e["prompts"]))
    rel = np.abs(lg - e["logits_fp32"]).max() / np.abs(e["logits_fp32"]).max()
    print(f"{name} fp32: max abs logit diff relative to the largest logit {rel:.2e}")
    assert rel <= REL_TOL, f"{name}: fp32 logits {rel:.3e} (relative) from transformers' > {REL_TOL}"


def _off(e, model) -> float:
    return np.abs(np.asarray(model.logits(e["prompts"])) - e["logits_fp32"]).max() / np.abs(e["logits_fp32"]).max()


def test_controls_fp32():
    """What the fixtures catch (parameters changed, nothing recompiled): the norms applying ``1 + weight``
    (Qwen's form) instead of ``weight``, and Kimi's correction bias left out of the expert choice."""
    e, m = _expected("olmo_hybrid"), _model("olmo_hybrid")
    shifted = dataclasses.replace(m.params, final_norm=m.params.final_norm + 1)
    assert _off(e, FamilyModel(m.config, shifted, m.forward)) > 100 * REL_TOL
    e, k = _expected("kimi_linear"), _model("kimi_linear")
    blocks = tuple(dataclasses.replace(b, mlp=dataclasses.replace(b.mlp, bias=0 * b.mlp.bias)) if hasattr(b.mlp, "bias")
                   else b for b in k.params.blocks)  # fmt: skip
    nobias = FamilyModel(k.config, dataclasses.replace(k.params, blocks=blocks), k.forward)
    assert _off(e, nobias) > 100 * REL_TOL, "control: the correction bias must change some route in the fixture"


@full_only
def test_control_beta_scale():
    """OLMo-Hybrid's beta scale read as 1 where the checkpoint has neg eigenvalues on (2) moves the logits far
    past the tolerance. (In CI the two fixtures, one with each scale, both passing shows the scale applied.)"""
    e, m = _expected("olmo_hybrid"), _model("olmo_hybrid")
    assert m.config.beta_scale == 2.0 and _model("olmo_hybrid_noneg").config.beta_scale == 1.0
    off = _off(e, FamilyModel(dataclasses.replace(m.config, beta_scale=1.0), m.params, m.forward))
    assert off > 100 * REL_TOL, f"control: beta scale 1 moved the logits only {off:.2e}"


def _bf16_gaps(name):
    e = _expected(name)
    ours = np.asarray(_model(name, "bfloat16").logits(e["prompts"]))
    return e, np.abs(ours - e["logits_bf16"]).max(-1), np.abs(e["logits_bf16"] - e["logits_fp32"]).max(-1), ours


@pytest.mark.parametrize("name", [pytest.param("olmo_hybrid", marks=full_only), "kimi_linear"])
def test_logits_bf16(name):
    e, ours_vs_tf, budget, ours = _bf16_gaps(name)
    mean = np.abs(ours - e["logits_bf16"]).mean(-1)
    budget_mean = np.abs(e["logits_bf16"] - e["logits_fp32"]).mean(-1)
    ok = np.ones(ours_vs_tf.shape, bool)
    if name == "kimi_linear":  # route flips (module docstring)
        ours_flips = np.abs(ours - e["logits_fp32"]).max(-1) > FLIP
        tf_flips = budget > FLIP
        print(f"{name} bf16: route flips at {np.argwhere(ours_flips).tolist()} (transformers': "
              f"{np.argwhere(tf_flips).tolist()})")  # fmt: skip
        assert ours_flips.sum() <= tf_flips.sum() + 1
        ok = ~(ours_flips | tf_flips)
    print(f"{name} bf16: max abs diff {ours_vs_tf[ok].max():.3f} (mean {mean[ok].mean():.4f}); transformers' bf16 vs "
          f"fp32: max {budget[ok].max():.3f} (mean {budget_mean[ok].mean():.4f})")  # fmt: skip
    assert ours_vs_tf[ok].max() <= budget[ok].max() and mean[ok].mean() <= budget_mean[ok].mean()


@full_only
@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_reference_matches_transformers(name):
    """transformers' greedy ``generate`` (its cache: chunked prefill, then the recurrent step) against a full
    forward per token: equal, except after a near-tie (transformers' top-2 gap < 1e-4)."""
    e = _expected(name)
    T = e["prompts"].shape[1]
    got = _model(name).greedy_reference(e["prompts"], NEW)
    for r, (g, w) in enumerate(zip(got, e["generated"])):
        diff = np.flatnonzero(g != w)
        assert diff.size == 0 or (diff[0] >= T and e["gaps"][r, diff[0] - T] < NEAR_TIE), (name, r, diff[:1])
    print(f"{name}: {(got == e['generated'])[:, T:].sum()} of {got.shape[0] * NEW} tokens equal")


# ---------------------------------------------------------------------------------------
# The loader's layouts and errors (no compile).
# ---------------------------------------------------------------------------------------
_ST = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16"}


def _tensors(folder) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(pathlib.Path(folder).glob("*.safetensors")):
        st = SafetensorsFile(f)
        out.update({k: np.array(st.get(k)) for k in st.keys()})
    return out


def _write(folder: pathlib.Path, tensors: dict, config: dict):
    """A one-file checkpoint folder (``model.safetensors``, ``config.json``)."""
    folder.mkdir(parents=True)
    header, blobs, off = {}, [], 0
    for k, v in tensors.items():
        b = np.ascontiguousarray(v).tobytes()
        header[k] = {"dtype": _ST[v.dtype], "shape": list(v.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    (folder / "config.json").write_text(json.dumps(config))


def _variant(tmp_path, name, tensors=None, config=None, tag="v") -> pathlib.Path:
    t, c = _tensors(FIXTURES / name), json.loads((FIXTURES / name / "config.json").read_text())
    _write(tmp_path / tag, tensors(t) if tensors else t, config(c) if config else c)
    return tmp_path / tag


def _same_params(a: FamilyModel, b: FamilyModel, what: str):
    assert a.config == dataclasses.replace(b.config, name=a.config.name), what
    assert_bitwise_equal(jax.device_get(a.params), jax.device_get(b.params), what)


def _load(d) -> FamilyModel:
    return load_pretrained(d, "float32")


def test_olmo_layouts(tmp_path):
    """The conv split by key/key/value width (the Hub's, the fixture), in equal thirds (save_pretrained's), fused
    (transformers' in-memory name), and the norms under transformers' names: the same parameters."""
    base = _model("olmo_hybrid")
    c = base.config
    widths = (c.key_dim, c.key_dim, c.value_dim)
    assert widths == (32, 32, 128)

    def resplit(sizes, fuse=False):
        def fn(t):
            for pre in sorted({k[: -len("q_conv1d.weight")] for k in t if k.endswith("q_conv1d.weight")}):
                full = np.concatenate([t.pop(pre + f"{n}_conv1d.weight") for n in "qkv"])
                if fuse:
                    t[pre + "conv1d.weight"] = full
                else:
                    for n, part in zip("qkv", np.split(full, np.cumsum(sizes)[:-1])):
                        t[pre + f"{n}_conv1d.weight"] = part
            return t

        return fn

    _same_params(base, _load(_variant(tmp_path, "olmo_hybrid", resplit((64, 64, 64)), tag="thirds")), "equal thirds")
    _same_params(base, _load(_variant(tmp_path, "olmo_hybrid", resplit(None, fuse=True), tag="fused")), "fused conv")
    names = lambda t: {k.replace("attention_layer_norm", "input_layernorm").replace(  # noqa: E731
        "feedforward_layer_norm", "post_attention_layernorm"): v for k, v in t.items()}
    _same_params(base, _load(_variant(tmp_path, "olmo_hybrid", names, tag="names")), "transformers' norm names")
    with pytest.raises(ValueError, match=r"'model.layers.0.linear_attn.q_conv1d.weight', .* split the conv's 192 "
                                         r"channels as \[32, 128, 32\]; expected the key/key/value widths "
                                         r"\[32, 32, 128\]"):  # fmt: skip
        _load(_variant(tmp_path, "olmo_hybrid", resplit((32, 128, 32)), tag="bad"))

    def both(t):
        t["model.layers.1.input_layernorm.weight"] = t["model.layers.1.attention_layer_norm.weight"]
        return t

    with pytest.raises(ValueError, match="tensors 'model.layers.1.attention_layer_norm.weight' and "
                                         "'model.layers.1.input_layernorm.weight' are both read as"):  # fmt: skip
        _load(_variant(tmp_path, "olmo_hybrid", both, tag="both"))


def test_olmo_config(tmp_path):
    """linear_allow_neg_eigval (default true, as transformers), RoPE off only where rope_theta is null."""
    m, n = _model("olmo_hybrid").config, _model("olmo_hybrid_noneg").config
    assert (m.beta_scale, m.rope_theta, n.beta_scale, n.rope_theta) == (2.0, None, 1.0, 10000.0)

    def drop(*keys):
        return lambda c: {k: v for k, v in c.items() if k not in keys}

    d = _load(_variant(tmp_path, "olmo_hybrid_noneg", config=drop("linear_allow_neg_eigval", "rope_parameters"),
                       tag="a"))  # fmt: skip
    assert (d.config.beta_scale, d.config.rope_theta) == (2.0, 10000.0)
    with pytest.raises(ValueError, match="config.json: rope_type 'yarn' is not supported"):
        _load(_variant(tmp_path, "olmo_hybrid_noneg", config=lambda c: {**c, "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 1e4}}, tag="b"))  # fmt: skip


def _kimi_mapped_config(c: dict) -> dict:
    """The config in transformers' mapped names (what save_pretrained writes), from the Hub's form."""
    c = dict(c)
    lac = c.pop("linear_attn_config")
    n = c["num_hidden_layers"]
    c["layer_types"] = ["full_attention" if i + 1 in lac["full_attn_layers"] else "linear_attention" for i in range(n)]
    k = c.pop("first_k_dense_replace")
    c["mlp_layer_types"] = ["dense" if i < k else "sparse" for i in range(n)]
    c.update(linear_head_dim=lac["head_dim"], linear_num_heads=lac["num_heads"],
             linear_conv_kernel_dim=lac["short_conv_kernel_size"])  # fmt: skip
    for k in ("moe_layer_freq", "mla_use_nope", "moe_router_activation_func", "use_grouped_topk"):
        c.pop(k)
    return c


def _kimi_in_memory(t: dict) -> dict:
    """transformers' in-memory names: mlp., forget_gate., fused conv, fused experts, A_log as [H]."""
    out = {}
    for k, v in t.items():
        k = k.replace(".block_sparse_moe.", ".mlp.")
        for n in ("f_a_proj.", "f_b_proj.", "dt_bias", "A_log"):
            k = k.replace(f"self_attn.{n}", f"self_attn.forget_gate.{n}")
        out[k] = v.reshape(-1) if k.endswith("A_log") else v
    for pre in sorted({k[: -len("q_conv1d.weight")] for k in out if k.endswith("q_conv1d.weight")}):
        out[pre + "conv1d.weight"] = np.concatenate([out.pop(pre + f"{n}_conv1d.weight") for n in "qkv"])
    for pre in sorted({k[: k.index("experts.")] for k in out if ".experts.0.w1" in k}):
        E = len([k for k in out if k.startswith(pre + "experts.") and k.endswith(".w1.weight")])
        take = lambda w: np.stack([out.pop(f"{pre}experts.{e}.{w}.weight") for e in range(E)])  # noqa: E731
        out[pre + "experts.gate_up_proj"] = np.concatenate([take("w1"), take("w3")], axis=1)
        out[pre + "experts.down_proj"] = take("w2")
    return out


def test_kimi_layouts(tmp_path):
    """The Hub's config form (the fixture) and the mapped names (save_pretrained's); the dense MLP under
    ``block_sparse_moe.`` (save_pretrained's renaming) and ``mlp.`` (the Hub's, the fixture); experts one by one
    (the fixture) and fused, with the forget gate, the conv and A_log as transformers holds them: the same
    configuration and parameters."""
    base = _model("kimi_linear")
    assert base.config.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert base.config.mlp_types == ("dense", "sparse", "sparse", "sparse")
    assert "model.layers.1.block_sparse_moe.experts.7.w2.weight" in _tensors(FIXTURES / "kimi_linear")
    mapped = _load(_variant(tmp_path, "kimi_linear", config=_kimi_mapped_config, tag="mapped"))
    _same_params(base, mapped, "mapped config")
    dense = lambda t: {k.replace("layers.0.mlp.", "layers.0.block_sparse_moe."): v for k, v in t.items()}  # noqa: E731
    _same_params(base, _load(_variant(tmp_path, "kimi_linear", dense, tag="dense")), "save_pretrained's dense name")
    _same_params(base, _load(_variant(tmp_path, "kimi_linear", _kimi_in_memory, _kimi_mapped_config, tag="mem")),
                 "transformers' in-memory layout")  # fmt: skip


def test_errors(tmp_path):
    def extra(t):
        t["model.layers.9.mlp.gate.weight"] = np.ones((8, 64), np.float32)
        return t

    with pytest.raises(ValueError, match=r"unexpected tensor 'model.layers.9.mlp.gate.weight' \(shape \[8, 64\], in "
                                         r"model.safetensors\) for model_type 'kimi_linear'"):  # fmt: skip
        _load(_variant(tmp_path, "kimi_linear", extra, tag="a"))

    def shape(t):
        t["model.layers.2.block_sparse_moe.experts.3.w3.weight"] = np.ones((8, 64), np.float32)
        return t

    with pytest.raises(ValueError, match=r"tensor 'model.layers.2.block_sparse_moe.experts.3.w3.weight' \(in "
                                         r"model.safetensors, read as 'model.layers.2.mlp.experts.3.w3.weight'\) has "
                                         r"shape \[8, 64\], expected \[16, 64\]"):  # fmt: skip
        _load(_variant(tmp_path, "kimi_linear", shape, tag="b"))
    with pytest.raises(ValueError, match="q_lora_rank 16 is not supported"):
        _load(_variant(tmp_path, "kimi_linear", config=lambda c: {**c, "q_lora_rank": 16}, tag="c"))
    with pytest.raises(ValueError, match="config.json: no key 'num_experts' or 'num_local_experts', which is required"):
        _load(_variant(tmp_path, "kimi_linear", config=lambda c: {k: v for k, v in c.items() if k != "num_experts"},
                       tag="d"))  # fmt: skip

    def no_conv(t):
        del t["model.layers.0.linear_attn.v_conv1d.weight"]
        return t

    with pytest.raises(ValueError, match=r"no 'model.layers.0.linear_attn.v_conv1d.weight' \(expected rows \[32, 32, "
                                         r"128\], 4 taps\)"):  # fmt: skip
        _load(_variant(tmp_path, "olmo_hybrid", no_conv, tag="e"))
    with pytest.raises(ValueError, match="has no draft yet"):
        load_pretrained(FIXTURES / "olmo_hybrid", draft="self")
    m = _model("kimi_linear")
    with pytest.raises(ValueError, match=r"argument 'ids' must be token ids in \[0, 256\)"):
        m.logits(np.full((1, 3), 256))
    assert "3 KDA H=2 K=V=16, 1 MLA" in repr(m) and "beta scale 2" in repr(_model("olmo_hybrid"))
    shutil.rmtree(tmp_path)
