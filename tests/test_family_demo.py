"""``gdn-lossless demo --family``: OLMo-Hybrid and Kimi Linear decoded through the state pool by the demo
(gdn_lossless_jax.tools.family_demo), on the CPU.

Each family's random tiny model (the default) gives ``identical``, exit status 0: both record modes give the same
tokens, plain greedy decoding's on the CPU, and the same final SSM and conv states. Controls: the pool's commit replaying with a wrong
rule (OLMo: the update rounded twice; Kimi: the per-channel decay as one factor per head) must make the demo
report DIFFERENT, exit status 1. A committed fixture through ``--checkpoint`` (GDN_FULL_TESTS); the scratch the demo
prints equals the pool's allocation; the errors name the argument.
"""

from __future__ import annotations

import pathlib

import jax
import numpy as np
import pytest

from conftest import ON_GPU, full_only
from test_family_decode import ControlBackend  # the reference backend with a wrong commit rule
from gdn_lossless_jax import pool
from gdn_lossless_jax.model.hf.family import random_model
from gdn_lossless_jax.model.hf.family_decode import FamilyDecoder
from gdn_lossless_jax.pool import scratch_rows
from gdn_lossless_jax.testing.controls import twice_rounded_update
from gdn_lossless_jax.testing.kda_controls import scalar_decay
from gdn_lossless_jax.tools.cli import main
from gdn_lossless_jax.tools.family_demo import oracle_draft
from gdn_lossless_jax.tools.memory import conv_window_bytes, scratch_bytes

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
# 2 prompts of 6 tokens, 12 new tokens each, D = 3: the same shapes in every run of a family (one compile each)
ARGS = ["--prompts", "2", "--prompt-len", "6", "--tokens", "12", "--drafts", "3", "--progress", "off"]


def _demo(capsys, *argv) -> tuple[int, str]:
    status = main(["demo", *argv])
    return status, capsys.readouterr().out


# Kimi (KDA) in the CI run; OLMo-Hybrid with GDN_FULL_TESTS (~11 s each on 2 CPU cores: the suite's time)
@pytest.mark.parametrize("family,control", [pytest.param("olmo_hybrid", twice_rounded_update, marks=full_only),
                                            ("kimi_linear", scalar_decay)])
def test_demo_family_identical_and_control(family, control, capsys, monkeypatch):
    status, out = _demo(capsys, "--family", family, *ARGS)
    assert status == 0, out
    assert f"gdn-lossless demo: {family} random-tiny-seed0" in out
    assert "2 prompts of 6 tokens, 12 generated each, 2 at a time; D=3, draft: plain greedy decoding's tokens" in out
    assert f"{'KDA' if family == 'kimi_linear' else 'GDN'} layers' tuples as " \
           f"{'KDATuples' if family == 'kimi_linear' else 'Tuples'}" in out  # fmt: skip
    lines = {line.split()[0]: line for line in out.splitlines()}
    assert lines["none"].startswith("none       24 tokens in ") and "one token a step" in lines["none"]
    for mode in ("tuples", "snapshots"):
        assert lines[mode].startswith(f"{mode:<10} 24 tokens in ") and "mean accepted length" in lines[mode]
        assert "of 2 drafted" in lines[mode] and "tokens/s" in lines[mode] and "scratch" in lines[mode]
    accepted = float(lines["tuples"].split("mean accepted length ")[1].split()[0])
    assert 0 < accepted < 2, f"the oracle draft: steps accept some drafts, not all ({accepted})"
    assert "tokens     tuples vs snapshots: 24 of 24 tokens equal\n" in out
    if not ON_GPU:  # on a GPU plain greedy decoding is measured, not checked (a step of D tokens rounds otherwise)
        assert "tokens     tuples vs none: 24 of 24 tokens equal\n" in out
        assert "tokens     snapshots vs none: 24 of 24 tokens equal\n" in out
    assert "states     tuples vs snapshots, final SSM and conv states: bit-identical" in out
    greedy = "the same tokens" if ON_GPU else "plain greedy decoding's tokens"
    assert f"verdict    identical: tuples and snapshots gave {greedy}" in out
    assert f"the released model's: gdn-lossless memory --family {family}" in lines["memory"]

    wrong = ControlBackend(control)  # the commit only (every run's): the verify and its compiled step unchanged
    commit = pool.commit
    monkeypatch.setattr(pool, "commit", lambda *a, backend, **k: commit(*a, backend=wrong, **k))
    status, out = _demo(capsys, "--family", family, *ARGS)
    monkeypatch.undo()
    assert status == 1, out
    assert "states     tuples vs snapshots, final SSM and conv states: DIFFER" in out, out
    assert "verdict    DIFFERENT: the record modes" in out


@full_only  # ~20 s on 2 CPU cores: three more compiles (a bf16 model); the checkpoint checks run in the errors' test
def test_demo_family_checkpoint(capsys):
    """A committed fixture (bf16) through --checkpoint, with prompt lookup as the draft, one prompt at a time."""
    path = str(FIXTURES / "kimi_linear")
    status, out = _demo(capsys, "--family", "kimi_linear", "--checkpoint", path, "--draft", "lookup", "--prompts", "2",
                        "--batch", "1", "--prompt-len", "5", "--tokens", "6", "--drafts", "2", "--progress", "off")
    assert status == 0, out
    assert f"model      the checkpoint {path}" in out and "bfloat16" in out
    assert "2 prompts of 5 tokens, 6 generated each, 1 at a time; D=2, draft: prompt lookup" in out
    assert "tokens     tuples vs snapshots: 12 of 12 tokens equal" in out
    if not ON_GPU:  # on a GPU plain greedy decoding is measured, not checked (a step of D tokens rounds otherwise)
        assert "tokens     tuples vs none: 12 of 12 tokens equal" in out
    assert "verdict    identical" in out


@pytest.mark.parametrize("family", ["olmo_hybrid", "kimi_linear"])
def test_demo_scratch_is_the_pools(family):
    """The scratch the demo prints (tools.memory for the geometry) is what the decoder's pool allocates."""
    model = random_model(family)
    for record, drafts in (("tuples", 3), ("snapshots", 3), ("tuples", 1)):
        dec = FamilyDecoder(model, requests=2, drafts=drafts, max_len=20, record=record)
        assert dec.pool.scratch_nbytes == scratch_bytes(dec.geometry, drafts, record, requests=2)
        assert dec.pool.conv_windows.nbytes == conv_window_bytes(dec.geometry, drafts, requests=2,
                                                                 conv_dtype=model.config.jnp_dtype)  # fmt: skip
        assert dec.pool.conv_windows.shape[1] == scratch_rows(2)


def test_random_model_is_the_fixtures_geometry():
    """The random tiny models have the fixtures' configs (the loader's own reading of both)."""
    from gdn_lossless_jax.model import load_pretrained

    for family in ("olmo_hybrid", "kimi_linear"):
        got, want = random_model(family).config, load_pretrained(FIXTURES / family, "float32").config
        assert got == type(want)(**{**want.__dict__, "name": got.name})
    a, b = random_model("kimi_linear", seed=1), random_model("kimi_linear", seed=1)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)))
    c = random_model("kimi_linear", seed=2)
    assert not np.array_equal(a.params.embed, c.params.embed)


def test_oracle_draft():
    greedy = np.array([[1, 2, 3, 4, 5, 6, 7, 8]])
    draft = oracle_draft(greedy, 10)
    assert draft([np.array([1, 2])], 4).tolist() == [[4, 4, 5, 6]]  # position 2 changed (3 -> 4)
    assert draft([greedy[0, :7]], 3).tolist() == [[9, 8, 8]]  # position 7 changed (8 -> 9), then past the end


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--family", "mamba"], "gdn-lossless demo: error: argument --family: invalid choice: 'mamba' (choose from "),
        (["--family", "kimi_linear", "--checkpoint", "no/such/dir"],
         "gdn-lossless demo: error: demo --family kimi_linear: argument --checkpoint: no folder 'no/such/dir'"),
        (["--family", "kimi_linear", "--checkpoint", str(FIXTURES)],
         f"gdn-lossless demo: error: demo --family kimi_linear: argument --checkpoint: {str(FIXTURES)!r} has no "
         "config.json"),
        (["--family", "kimi_linear", "--checkpoint", str(FIXTURES / "olmo_hybrid")],
         f"gdn-lossless demo: error: demo --family kimi_linear: argument --checkpoint: "
         f"{str(FIXTURES / 'olmo_hybrid')!r} is a 'olmo_hybrid' checkpoint (its config.json's model_type), not "
         "'kimi_linear'; decode it with --family olmo_hybrid"),
        (["--family", "olmo_hybrid", "--checkpoint", str(FIXTURES / "qwen3_next")],
         "gdn-lossless demo: error: demo --family olmo_hybrid: argument --checkpoint: "),
        (["--checkpoint", str(FIXTURES / "kimi_linear")],
         f"gdn-lossless demo: error: demo --checkpoint: argument --checkpoint: {str(FIXTURES / 'kimi_linear')!r} is a "
         f"kimi_linear checkpoint; decode it with --family kimi_linear"),
        (["--family", "olmo_hybrid", "--record", "tuples"],
         "gdn-lossless demo: error: demo --family olmo_hybrid: argument --record must be left out"),
        (["--family", "olmo_hybrid", "--steps-per-call", "4"],
         "gdn-lossless demo: error: demo --family olmo_hybrid: argument --steps-per-call must be 1 or left out"),
        (["--family", "olmo_hybrid", "--turns", "2"],
         "gdn-lossless demo: error: demo --family olmo_hybrid: argument --turns must be 1 (each prompt is decoded "
         "once: FamilyDecoder has no conversation and no prefix cache), got 2"),
        (["--family", "olmo_hybrid", "--size", "gpu"],
         "gdn-lossless demo: error: demo --family olmo_hybrid: argument --size must be left out"),
        (["--family", "olmo_hybrid", "--draft-agreement", "0.5"],
         "gdn-lossless demo: error: demo --family olmo_hybrid: argument --draft-agreement must be left out"),
        (["--family", "olmo_hybrid", "--tokens", "0"],
         "gdn-lossless demo: error: demo --family olmo_hybrid: argument --tokens must be a positive integer, got 0"),
        (["--draft", "lookup"], "gdn-lossless demo: error: argument --draft lookup goes with --family"),
    ],
)
def test_demo_family_errors(capsys, argv, message):
    try:
        status = main(["demo", *argv])
    except SystemExit as e:  # argparse's usage errors exit from inside parse_args
        status = e.code
    assert status == 2
    err = capsys.readouterr().err
    assert err.startswith(message), err
    assert err.count("\n") == 1 and "Traceback" not in err
