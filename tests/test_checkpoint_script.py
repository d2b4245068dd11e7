"""``scripts/random_checkpoint.py`` and ``scripts/checkpoint_run.py`` (the H200 checkpoint run)
on a tiny random checkpoint: the writer's files load with ``load_pretrained`` as the Hub's
Qwen3.6-35B-A3B layout (nested ``text_config``, ``model.language_model.``, fused experts, ``mtp.*``),
and the run's checks pass."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import ml_dtypes
import numpy as np

from gdn_lossless_jax.model import load_pretrained
from gdn_lossless_jax.model.hf.weights import Checkpoint

SCRIPTS = pathlib.Path(__file__).resolve().parents[1] / "scripts"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


rc = _script("random_checkpoint")


def test_bf16_rounding_matches_ml_dtypes():
    x = np.random.default_rng(0).standard_normal(1 << 16).astype(np.float32) * np.float32(7.0)
    x[:4] = [0.0, -0.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8]  # ties round to even
    assert np.array_equal(rc.to_bf16_bits(x), x.astype(ml_dtypes.bfloat16).view(np.uint16))


def test_a3b_sizes_are_the_real_head_geometry():
    t = rc.text_config("a3b")
    assert t["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 2
    n = sum(int(np.prod(s)) for _, s, _ in rc.tensors(t))
    assert 1.7e9 < n < 1.9e9  # the docstring's 1.79e9
    names = {name: s for name, s, _ in rc.tensors(t)}
    lm = "model.language_model.layers."
    assert names[lm + "0.linear_attn.in_proj_qkv.weight"] == (8192, 2048)
    assert names[lm + "0.linear_attn.conv1d.weight"] == (8192, 1, 4)
    assert names[lm + "3.self_attn.q_proj.weight"] == (8192, 2048)
    assert names[lm + "3.self_attn.k_proj.weight"] == (512, 2048)
    assert names[lm + "3.mlp.experts.gate_up_proj"] == (16, 1024, 2048)
    assert names["mtp.layers.0.mlp.experts.down_proj"] == (16, 2048, 512)
    assert names["lm_head.weight"] == (248320, 2048)


def test_tiny_checkpoint_loads_and_the_run_agrees(tmp_path):
    ckpt = tmp_path / "ckpt"
    # --size tiny, 2 blocks (GDN then attention) and 2 experts: the compile stays short on a CPU.
    assert rc.main(["--out", str(ckpt), "--size", "tiny", "--layers", "2", "--full-attention-interval", "2",
                    "--experts", "2", "--top-k", "1", "--shard-gb", "0.0002"]) == 0  # fmt: skip
    config = json.loads((ckpt / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe" and config["text_config"]["model_type"] == "qwen3_5_moe_text"
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    assert index["metadata"]["total_size"] == sum(
        int(np.prod(Checkpoint(ckpt).shape(n))) * 2 for n in index["weight_map"]
    )
    model = load_pretrained(ckpt, "bfloat16")
    c = model.config
    assert (c.model_type, c.layer_types, c.draft, c.num_experts, c.top_k) == (
        "qwen3_5_moe", ("linear_attention", "full_attention"), "mtp", 2, 1)  # fmt: skip
    assert (c.num_k_heads, c.num_v_heads, c.head_k_dim, c.attn_heads, c.kv_heads, c.rotary_dim) == (2, 4, 16, 4, 2, 8)
    assert model.report == {"skipped": {}, "mtp": True}

    run = _script("checkpoint_run")
    out = tmp_path / "run.json"
    code = run.main([str(ckpt), "--out", str(out), "--prompts", "2", "--prompt-len", "3", "--tokens", "6",
                     "--drafts", "2", "--steps-per-call", "1"])  # fmt: skip
    result = json.loads(out.read_text())
    assert code == 0, result["mismatches"]
    assert result["checks"] == {"each mode repeats its tokens (warm-up == timed runs)": True,
                                "tokens tuples == snapshots": True, "final states tuples == snapshots": True}
    # Speculative vs plain greedy decoding: a measurement (on the CPU here, every token equal).
    assert result["divergence"] == {f"{r} vs none": {"tokens_equal": 12, "tokens": 12, "first": None, "rows": []}
                                    for r in ("tuples", "snapshots")}  # fmt: skip
    assert [r["record"] for r in result["rows"]] == ["tuples", "snapshots", "none"]
    assert all(r["tokens_per_s"] > 0 and r["new_tokens"] == 12 for r in result["rows"])
    assert result["meta"]["geometry"]["gdn_layers"] == 1 and result["meta"]["parameters"] > 0


def _faked_run(tmp_path, monkeypatch, flip=None, snapshot_state=1.0):
    """checkpoint_run on a tiny checkpoint with ``generate`` faked (no compile): ``flip`` (record, row, new
    position) changes one new token; the final ssm state is ``snapshot_state`` in snapshots, 0 elsewhere.
    Returns (exit status, the result JSON, stdout lines)."""
    import types

    import jax.numpy as jnp

    import gdn_lossless_jax.model as gm

    ckpt = tmp_path / "ckpt"
    rc.main(["--out", str(ckpt), "--size", "tiny"])
    model = load_pretrained(ckpt)

    def generate(ids, new, *, drafts, record, steps_per_call, return_info):
        out = np.concatenate([ids, np.tile(np.arange(new, dtype=np.int32), (len(ids), 1))], axis=1)
        if flip is not None and flip[0] == record:
            out[flip[1], ids.shape[1] + flip[2]] += 1
        states = {"ssm": np.full(3, snapshot_state if record == "snapshots" else 0.0, np.float32)}
        gaps = np.tile(np.linspace(0.1, 0.5, new, dtype=np.float32), (len(ids), 1))
        info = types.SimpleNamespace(steps=new, accepted=new * len(ids), drafted=0, gaps=gaps, state=jnp.zeros(1),
                                     states=lambda: states)  # fmt: skip
        return out, info

    model.generate = generate
    monkeypatch.setattr(gm, "load_pretrained", lambda *a, **k: model)
    out = tmp_path / "run.json"
    code = _script("checkpoint_run").main([str(ckpt), "--out", str(out), "--prompts", "2", "--tokens", "5"])
    return code, json.loads(out.read_text())


def test_run_measures_a_divergence_from_plain_greedy(tmp_path, monkeypatch, capsys):
    """A token that differs without speculation (forced) is a measurement: located (request, position, both
    tokens, both gaps), printed, exit status 0 while tuples and snapshots agree."""
    code, result = _faked_run(tmp_path, monkeypatch, flip=(None, 1, 2), snapshot_state=0.0)
    assert code == 0, result
    assert result["checks"] == {"each mode repeats its tokens (warm-up == timed runs)": True,
                                "tokens tuples == snapshots": True, "final states tuples == snapshots": True}
    first = {"request": 1, "position": 2, "tokens": [2, 3], "gaps": [0.3, 0.3]}
    for rec in ("tuples", "snapshots"):
        d = result["divergence"][f"{rec} vs none"]
        assert d["tokens_equal"] == 9 and d["tokens"] == 10 and len(d["rows"]) == 1
        assert {**d["first"], "gaps": [round(g, 6) for g in d["first"]["gaps"]]} == first
    assert result["mismatches"] == {} and set(result["gap_quantiles"]) == {"tuples", "snapshots", "none"}
    out = capsys.readouterr().out
    assert ("divergence tuples vs none: 9 of 10 new tokens equal; first at request 1, position 2 (ids 2 vs 3), "
            "top-2 logit gap there 0.3 / 0.3 (1 row(s) differ) (measured, not checked)") in out  # fmt: skip


def test_run_fails_on_a_disagreement(tmp_path, monkeypatch):
    """tuples and snapshots disagreeing: exit status 1 for other final states (the first case) and for other
    tokens (the second, the first differing token located); no compile: generate is faked."""
    code, result = _faked_run(tmp_path, monkeypatch)
    assert code == 1
    assert result["checks"] == {"each mode repeats its tokens (warm-up == timed runs)": True,
                                "tokens tuples == snapshots": True, "final states tuples == snapshots": False}
    assert "ssm" in result["mismatches"]["final states tuples == snapshots"]
    code, result = _faked_run(tmp_path / "b", monkeypatch, flip=("snapshots", 0, 4), snapshot_state=0.0)
    assert code == 1
    assert result["checks"]["tokens tuples == snapshots"] is False
    assert result["checks"]["final states tuples == snapshots"] is True
    assert result["mismatches"]["tokens tuples == snapshots"] == [
        {"row": 0, "position": 4, "tokens": [4, 5], "gaps": [0.5, 0.5]}]  # fmt: skip
