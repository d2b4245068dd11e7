"""Hugging Face checkpoints (``load_pretrained``) against transformers' own outputs.

The fixtures (``tests/fixtures/hf/<model_type>/``) are tiny random checkpoints that transformers 5.x
wrote with ``save_pretrained``, plus its logits and greedy tokens (``scripts/make_hf_fixtures.py``,
run by hand with torch installed). This suite needs neither.

Tolerances (logits against transformers; everything between record modes is bit for bit):

- fp32: max abs difference <= 1e-3 on logits of magnitude up to ~7 (measured 3e-5 to 1.2e-4). The
  two compute the same functions in other orders: transformers' GDN runs its chunked form (a
  triangular solve per 64-token chunk) over a prompt, the library the recurrence step by step with
  a pinned fma; norms, softmax and matmuls sum in other orders.
- bf16: no fixed number: bf16 itself moves these logits by up to 2.3-4.0 (transformers' bf16 against
  its fp32, same weights: random weights at std 0.2 amplify the rounding, and a flipped MoE route
  jumps). The check is that ours is no further from transformers' bf16 than transformers' bf16 is
  from its fp32 (max and mean). Measured (the CPU's invariant mode): qwen3_next 3.96 (budget 3.98), qwen3_5
  1.16 (3.14), qwen3_5_moe 1.97 (2.34).
- greedy tokens must be equal; near-tie rule: a first difference is excused only where
  transformers' top-2 gap there was < 1e-4 (then the rest of that row is not compared). The
  fixtures' smallest gap is 1.2e-3, so the rule never fired.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import struct

import numpy as np
import pytest

from conftest import FULL_TESTS, full_only, requires_gpu
from gdn_lossless_jax.model import PretrainedModel, load_pretrained
from gdn_lossless_jax.model.hf.weights import Checkpoint
from gdn_lossless_jax.testing import assert_bitwise_differs, assert_bitwise_equal

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
FP32_TOL = 1e-3
NEAR_TIE = 1e-4
NEW = 64

pytestmark = pytest.mark.filterwarnings("ignore:load_pretrained.*vision tower:UserWarning")

_MODELS: dict = {}


def _model(mt: str, dtype: str = "float32", draft: str = "auto"):
    key = (mt, dtype, draft)
    if key not in _MODELS:
        _MODELS[key] = load_pretrained(FIXTURES / mt, dtype, draft=draft)
    return _MODELS[key]


def _expected(mt: str):
    return np.load(FIXTURES / mt / "expected.npz")


def _ci(*cases: str):
    """All model types with GDN_FULL_TESTS=1; only ``cases`` in CI."""
    return [pytest.param(t, marks=() if t in cases else full_only) for t in TYPES]


def _compare_tokens(got, want, gaps, T):
    """Rows equal, except after a first difference where transformers' gap was a near-tie.
    Returns (tokens compared, near-ties excused)."""
    compared = excused = 0
    for r, (g, w) in enumerate(zip(got, want)):
        diff = np.flatnonzero(g != w)
        if diff.size == 0:
            compared += len(g) - T
            continue
        i = int(diff[0])
        assert i >= T and gaps[r, i - T] < NEAR_TIE, (
            f"row {r}: token {i - T} differs ({g[i]} vs transformers' {w[i]}) where transformers' top-2 gap was "
            f"{gaps[r, i - T]:.2e} (near-tie rule: < {NEAR_TIE})"
        )
        compared += i - T
        excused += 1
    return compared, excused


@pytest.mark.parametrize("mt", TYPES)
def test_logits_fp32(mt):
    e = _expected(mt)
    m = _model(mt)
    lg = np.asarray(m.logits(e["prompts"]))
    diff = np.abs(lg - e["logits_fp32"]).max()
    print(f"{mt} fp32: max abs logit diff {diff:.2e}")
    assert diff <= FP32_TOL, f"{mt}: max abs logit difference {diff:.3e} > {FP32_TOL}"
    if mt == "qwen3_next":  # control: the norms applying `weight`, not `1 + weight`, must be caught
        import dataclasses

        p = m.params

        def shift(blk):
            return dataclasses.replace(blk, norm1=blk.norm1 - 1, norm2=blk.norm2 - 1)

        wrong = dataclasses.replace(p, blocks=tuple(shift(b) for b in p.blocks), final_norm=p.final_norm - 1)
        bad = PretrainedModel(m.config, wrong)
        off = np.abs(np.asarray(bad.logits(e["prompts"])) - e["logits_fp32"]).max()
        assert off > 100 * FP32_TOL, f"control: the norms without '1 +' moved the logits only {off:.2e}"


def _dot_precisions(lowered_text: str) -> list[str]:
    """The ``precision = [...]`` of every dot in a lowered program's text (``"none"`` where it has none)."""
    import re

    found = []
    for line in lowered_text.splitlines():
        if "dot_general" in line:
            m = re.search(r"precision = \[([^\]]*)\]", line)
            found.append(m.group(1) if m else "none")
    return found


def _step_text(model, drafts: int = 3) -> str:
    """The lowered text of the checkpoint's jitted speculative step (draft, verify, accept, commit)."""
    import jax.numpy as jnp

    from gdn_lossless_jax.model.decode import StepInputs, _jitted_step

    step = model.step(drafts)
    state = model.allocate(step, batch=2, record="tuples", max_len=16)
    i32 = lambda *v: jnp.asarray(np.array(v, np.int32))  # noqa: E731
    inputs = StepInputs(slots=i32(0, 1), rows=i32(0, 1), pos=i32(0, 0), tokens=jnp.ones((2, drafts), jnp.int32),
                        n_given=i32(1, 1), track_slots=i32(-1, -1))  # fmt: skip
    return _jitted_step.lower(step, model.params, state, inputs).as_text()


def test_fp32_dots_are_highest_precision():
    """A float32 checkpoint multiplies in float32 on every platform: every dot of the logits' program and of
    the speculative step (the MTP draft, the MoE, the attention, the head) asks for ``HIGHEST`` (JAX's
    default lets a GPU use TF32: logits 3.85 off transformers' on an H200). Control: a bf16 model's dots
    keep the default. The demo model's float32 step likewise."""
    import jax.numpy as jnp

    from gdn_lossless_jax.model import get_config, init_params
    from gdn_lossless_jax.model.decode import SpecStep, StepInputs, _jitted_step, allocate_state
    from gdn_lossless_jax.model.hf.pretrained import _forward

    def logits_text(m):
        ids = jnp.ones((1, 3), jnp.int32)
        step = m.step(3, draft="self") if m.config.draft == "mtp" else m.step(3)
        return _forward.lower(step, m.params, m.allocate(step, batch=1, record="tuples", max_len=3), ids).as_text()

    for dtype in ("float32", "bfloat16"):
        m = _model("qwen3_5_moe", dtype)
        assert m.config.draft == "mtp" and m.config.num_experts
        for what, text in (("logits", logits_text(m)), ("step", _step_text(m))):
            got = _dot_precisions(text)
            assert len(got) > 20, f"{dtype} {what}: expected the model's dots in the program, found {len(got)}"
            if dtype == "float32":
                bad = sorted(set(got) - {"HIGHEST, HIGHEST"})
                assert not bad, f"float32 {what}: {len(got)} dots, precisions other than HIGHEST: {bad}"
            else:  # control: bf16 keeps the default precision
                assert all("HIGHEST" not in g for g in got), f"bfloat16 {what}: dots forced to HIGHEST: {set(got)}"
    config = get_config("tiny")
    assert config.dtype == "float32"
    step = SpecStep(config, drafts=3)
    state = allocate_state(config, slots=2, requests=2, drafts=3, record="tuples", max_len=16)
    i32 = lambda *v: jnp.asarray(np.array(v, np.int32))  # noqa: E731
    inputs = StepInputs(slots=i32(0, 1), rows=i32(0, 1), pos=i32(0, 0), tokens=jnp.ones((2, 3), jnp.int32),
                        n_given=i32(1, 1), track_slots=i32(-1, -1))  # fmt: skip
    got = _dot_precisions(_jitted_step.lower(step, init_params(config, 0), state, inputs).as_text())
    assert got and set(got) == {"HIGHEST, HIGHEST"}, f"the demo model's float32 step: {set(got)}"


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("mt", TYPES)
def test_logits_fp32_on_gpu_without_precision_flags(mt):
    """On a GPU, float32 logits within 1e-4 of transformers' (relative to the largest logit) with JAX's
    default matmul precision (TF32 allowed) in force, as a user runs it: no JAX_DEFAULT_MATMUL_PRECISION."""
    import jax

    e = _expected(mt)
    m = _model(mt)
    with jax.default_matmul_precision("tensorfloat32"):  # what the GPU does when nothing is set
        lg = np.asarray(m.logits(e["prompts"]))
    rel = np.abs(lg - e["logits_fp32"]).max() / np.abs(e["logits_fp32"]).max()
    print(f"{mt} fp32 on {jax.devices()[0].device_kind}: max abs logit diff / max logit {rel:.2e}")
    assert rel <= 1e-4, f"{mt}: float32 logits {rel:.3e} (relative to the largest logit) from transformers' > 1e-4"


@pytest.mark.parametrize("mt", _ci("qwen3_5"))
def test_logits_bf16(mt):
    e = _expected(mt)
    lg = np.asarray(_model(mt, "bfloat16").logits(e["prompts"]))
    ours = np.abs(lg - e["logits_bf16"])
    budget = np.abs(e["logits_bf16"] - e["logits_fp32"])
    print(f"{mt} bf16: max abs diff {ours.max():.3f} (mean {ours.mean():.4f}); transformers' bf16 vs fp32: max "
          f"{budget.max():.3f} (mean {budget.mean():.4f})")  # fmt: skip
    assert ours.max() <= budget.max() and ours.mean() <= budget.mean()


@pytest.mark.parametrize("mt", _ci("qwen3_next"))
def test_greedy_matches_transformers(mt):
    """No speculation (record=None): 64 new tokens on 4 prompts equal transformers' greedy generate."""
    e = _expected(mt)
    ids = _model(mt).generate(e["prompts"], NEW, record=None)
    compared, excused = _compare_tokens(ids, e["generated"], e["gaps"], e["prompts"].shape[1])
    print(f"{mt}: {compared} of {ids.shape[0] * NEW} tokens equal to transformers', near-tie rule fired {excused}x")
    assert excused == 0 or FULL_TESTS  # (the fixtures have no near-tie: the rule must not fire)


@pytest.mark.parametrize("draft", ["mtp", pytest.param("self", marks=full_only)])
@pytest.mark.parametrize("mt", _ci("qwen3_5_moe"))
def test_speculative_matches_transformers(mt, draft):
    """Speculation in both record modes: transformers' greedy tokens, and the record modes' final SSM,
    conv, KV (and MTP hidden) states bit-identical; the device loop (``steps_per_call=4``) gives the
    same tokens and states. Control: a commit with a wrong (twice-rounded) update rule."""
    from test_model import WRONG_FORM

    e = _expected(mt)
    m = _model(mt, draft=draft)
    assert m.config.draft == draft
    T = e["prompts"].shape[1]
    runs = {}
    for record in ("tuples", "snapshots"):
        ids, info = m.generate(e["prompts"], NEW, drafts=4, record=record, return_info=True)
        compared, excused = _compare_tokens(ids, e["generated"], e["gaps"], T)
        assert excused == 0
        print(f"{mt} {draft} {record}: {compared} tokens equal to transformers'; {info.steps} steps for "
              f"{ids.shape[0]} x {T + NEW} tokens, {info.drafted} drafted")  # fmt: skip
        runs[record] = (ids, info.states())
    assert np.array_equal(runs["tuples"][0], runs["snapshots"][0])
    assert_bitwise_equal(runs["tuples"][1], runs["snapshots"][1], f"{mt} {draft}: final states, tuples vs snapshots")
    # The device loop (4 steps a call): the same tokens and final states as a step a call.
    ids4, info4 = m.generate(e["prompts"], NEW, drafts=4, record="tuples", steps_per_call=4, return_info=True)
    assert np.array_equal(ids4, runs["tuples"][0])
    assert_bitwise_equal(runs["tuples"][1], info4.states(), f"{mt} {draft}: final states, device loop vs per step")
    _, wrong = m.generate(e["prompts"], NEW, drafts=4, record="tuples", return_info=True, commit=WRONG_FORM)
    assert_bitwise_differs(runs["snapshots"][1]["ssm"], wrong.states()["ssm"], "control: the twice-rounded commit")


# ---------------------------------------------------------------------------------------
# Loading: what is reported and what raises (no compile).
# ---------------------------------------------------------------------------------------
def _write_safetensors(path, tensors: dict):
    header, blobs, off = {}, [], 0
    for k, v in tensors.items():
        b = np.ascontiguousarray(v).tobytes()
        header[k] = {"dtype": {"float32": "F32"}[str(v.dtype)], "shape": list(v.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def _copy(tmp_path, mt) -> pathlib.Path:
    dst = tmp_path / mt
    shutil.copytree(FIXTURES / mt, dst)
    return dst


def _add_tensor(folder, name, array):
    _write_safetensors(folder / "extra.safetensors", {name: array})
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"][name] = "extra.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def test_load_report_and_config():
    m = _model("qwen3_5")
    assert m.config.model_type == "qwen3_5" and m.config.tie_embeddings and m.params.head is None
    assert m.report["skipped"] == {"model.visual.": 21} and m.report["mtp"]
    n = _model("qwen3_next")
    assert n.config.moe_layers == (True, False, True, True) and n.config.packed_gdn and n.params.head is not None
    assert len(Checkpoint(FIXTURES / "qwen3_next").files) == 6  # five shards and the MTP file, through the index
    with pytest.warns(UserWarning, match="skipped 21 tensors under 'model.visual.'"):
        load_pretrained(FIXTURES / "qwen3_5", "float32")
    with pytest.raises(ValueError, match="model.visual.*vision tower"):
        load_pretrained(FIXTURES / "qwen3_5", vision="error")


def test_load_errors(tmp_path):
    d = _copy(tmp_path, "qwen3_5_moe")
    name = "model.layers.0.linear_attn.A_log"
    _add_tensor(d, "model.layers.9.mlp.gate.weight", np.ones((4, 64), np.float32))
    with pytest.raises(ValueError, match=r"unexpected tensor 'model.layers.9.mlp.gate.weight' \(shape \[4, 64\]\)"):
        load_pretrained(d)
    d = _copy(tmp_path / "b", "qwen3_5_moe")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"][name] = "extra.safetensors"
    _write_safetensors(d / "extra.safetensors", {name: np.full(5, 0.5, np.float32)})
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    # The index maps the tensor to the new file, but the old file still has it: reported as such.
    with pytest.raises(ValueError, match=name):
        Checkpoint(d)
    d = _copy(tmp_path / "c", "qwen3_5_moe")
    cfg = json.loads((d / "config.json").read_text())
    cfg["linear_num_value_heads"] = 8  # in_proj_qkv [128, 64] in the file, [192, 64] expected
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"'model.layers.0.linear_attn.in_proj_qkv.weight' has shape \[128, 64\], "
                                         r"expected \[192, 64\]"):  # fmt: skip
        load_pretrained(d)
    cfg["linear_num_value_heads"] = 4
    cfg["model_type"] = "qwen3_moe"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="model_type 'qwen3_moe' is not supported"):
        load_pretrained(d)
    cfg["model_type"] = "qwen3_5_moe_text"
    cfg["rope_parameters"]["rope_type"] = "yarn"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        load_pretrained(d)
    d = _copy(tmp_path / "e", "qwen3_next")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = index["weight_map"].pop("model.layers.2.linear_attn.dt_bias")
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="dt_bias"):  # in a shard but not in the index
        Checkpoint(d)
    assert shard.startswith("model-")
    d = _copy(tmp_path / "f", "qwen3_5")
    os.remove(d / "mtp.safetensors")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith("mtp.")}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="has no mtp"):
        load_pretrained(d, draft="mtp")
    with pytest.raises(ValueError, match="argument 'steps_per_call' must be a positive integer, got 0"):
        _model("qwen3_5").generate(np.ones((1, 3), np.int32), 4, steps_per_call=0)
    with pytest.raises(ValueError, match=r"argument 'ids' must be token ids in \[0, 256\)"):
        _model("qwen3_5").logits(np.full((1, 3), 256))


def test_malformed_files_name_the_file(tmp_path):
    """A config.json, an index or a safetensors header that does not parse, and a missing config key: errors
    that name the file (or folder) and the key, not a bare JSONDecodeError or KeyError."""
    d = _copy(tmp_path, "qwen3_5_moe")
    good = (d / "config.json").read_text()
    (d / "config.json").write_text(good[:-20])
    with pytest.raises(ValueError, match=rf"load_pretrained: {d / 'config.json'} is not valid JSON: .* at line \d+"):
        load_pretrained(d)
    cfg = json.loads(good)
    del cfg["hidden_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=rf"load_pretrained: {d / 'config.json'} has no key 'hidden_size', which is "
                                         rf"required"):  # fmt: skip
        load_pretrained(d)
    (d / "config.json").write_text(good)
    (d / "model.safetensors.index.json").write_text('{"weight_map": {')
    with pytest.raises(ValueError, match=rf"{d / 'model.safetensors.index.json'} is not valid JSON"):
        load_pretrained(d)
    (d / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match="must hold a JSON object with a 'weight_map'"):
        load_pretrained(d)
    d = _copy(tmp_path / "b", "qwen3_5")
    blob = (d / "mtp.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    (d / "mtp.safetensors").write_bytes(blob[:8] + b"[" + blob[9 : 8 + n] + blob[8 + n :])  # '{' -> '['
    with pytest.raises(ValueError, match=rf"safetensors: file '{d / 'mtp.safetensors'}': the header \({n} bytes "
                                         rf"after the 8-byte length\) is not valid JSON"):  # fmt: skip
        load_pretrained(d)
    header = json.loads(blob[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    del header[name]["data_offsets"]
    h = json.dumps(header).encode()
    (d / "mtp.safetensors").write_bytes(struct.pack("<Q", len(h)) + h + blob[8 + n :])
    with pytest.raises(ValueError, match=rf"tensor '{name}' must have 'dtype', 'shape' \(a list\) and 'data_offsets'"):
        load_pretrained(d)


def test_missing_tensor(tmp_path):
    d = _copy(tmp_path, "qwen3_next")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    name = "model.layers.3.self_attn.q_norm.weight"
    shard = index["weight_map"][name]
    from gdn_lossless_jax.model.hf.safetensors import SafetensorsFile

    f = SafetensorsFile(d / shard)
    kept = {k: np.array(f.get(k)) for k in f.keys() if k != name}
    del f
    _write_safetensors(d / shard, kept)
    del index["weight_map"][name]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"tensor '{name}' is missing \(expected shape \[32\]\)"):
        load_pretrained(d)


def test_against_transformers_directly(tmp_path):
    """With torch and transformers installed: a fresh random Qwen3-Next checkpoint, logits compared."""
    torch = pytest.importorskip("torch", reason="torch is not installed (scripts/make_hf_fixtures.py needs it too)")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    import importlib.util

    spec = importlib.util.spec_from_file_location("mk", pathlib.Path(__file__).parents[1] / "scripts/make_hf_fixtures.py")
    mk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mk)
    config = mk.configs()["qwen3_next"]
    torch.manual_seed(int(os.environ.get("GDN_SEED", "1")))
    model = mk.build("qwen3_next", config)
    model.save_pretrained(tmp_path)
    ids = np.random.default_rng(int(os.environ.get("GDN_SEED", "1"))).integers(1, 256, (2, 9))
    with torch.no_grad():
        want = model(input_ids=torch.from_numpy(ids)).logits.numpy()
    got = np.asarray(load_pretrained(tmp_path).logits(ids))
    assert transformers.__version__.split(".")[0] >= "5"
    assert np.abs(got - want).max() <= FP32_TOL


def test_cli_generate(capsys):
    from gdn_lossless_jax.tools.cli import main

    e = _expected("qwen3_next")
    prompt = ",".join(str(int(t)) for t in e["prompts"][0])
    assert main(["generate", "--checkpoint", str(FIXTURES / "qwen3_next"), "--prompt-ids", prompt,
                 "--max-new-tokens", "8", "--record", "none"]) == 0  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    T = e["prompts"].shape[1]
    assert out[1] == ",".join(str(int(t)) for t in e["generated"][0, T : T + 8])
    assert main(["generate", "--checkpoint", str(FIXTURES / "nope"), "--prompt-ids", "1"]) == 2


@full_only
def test_cli_demo_checkpoint(capsys):
    from gdn_lossless_jax.tools.cli import main

    assert main(["demo", "--checkpoint", str(FIXTURES / "qwen3_5_moe"), "--prompts", "2", "--prompt-len", "5",
                 "--tokens", "12", "--drafts", "3", "--record", "tuples", "snapshots", "none", "--steps-per-call",
                 "2"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "verdict    identical" in out and "tokens     tuples vs none: " in out
    assert "tokens     tuples vs snapshots: 24 of 24 generated ids equal" in out
