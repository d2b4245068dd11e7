"""The command-line tool: output, exit status, one-line errors, --help."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jaxlib
import jax.numpy as jnp
import pytest

import gdn_lossless_jax
from conftest import ON_GPU
from gdn_lossless_jax.tools import check
from gdn_lossless_jax.testing.cases import Shape
from gdn_lossless_jax.tools.cli import main
from gdn_lossless_jax.config import get_geometry

SRC = str(Path(__file__).resolve().parents[1])


def test_memory_table(capsys):
    assert main(["memory", "--model", "qwen3.6-35b-a3b", "-D", "4", "-R", "25", "--budget", "20"]) == 0
    out = capsys.readouterr().out
    assert "Qwen3.5/3.6-35B-A3B: 30 GDN layers of 40, H=16, HV=32" in out
    assert "D=4 draft tokens, 25 requests (26 scratch rows)" in out
    lines = {line.split()[0]: line for line in out.splitlines()}
    assert "240.00 MiB" in lines["snapshots"] and "6.09 GiB" in lines["snapshots"]
    assert "0.07 GiB" in lines["tuples"] and "84.9x" in lines["tuples"]
    assert "0.10 GiB" in lines["seed's"] and "63.8x" in lines["seed's"]
    assert "seed's ring: the ring of SGLang's lossless-verify pull request, k once per v-head" in lines["note"]
    assert "20.0 KiB per token" in out
    assert "snapshots -> tuples: 6.02 GiB = 315,724 KV tokens" in out
    assert "budget        20 GiB for scratch + conv windows + KV cache: 725,344 KV tokens with snapshots, " \
        "1,041,068 with tuples (+315,724 tokens, +44%)" in out
    assert "seed's table" not in out


def test_memory_seed_table(capsys):
    assert main(["memory", "--model", "qwen3.8-27b", "--drafts", "8", "--requests", "8", "--seed-table"]) == 0
    out = capsys.readouterr().out
    assert "Qwen3.5/3.8-27B: 48 GDN layers of 64" in out and "95.4x" in out
    for printed in ("6.09 / 6.09 ok", "8.44 / 8.44 ok", "10.12 / 10.12 ok", "0.10 / 0.10 ok", "0.13 / 0.13 ok", "0.16 / 0.16 ok"):
        assert printed in out
    assert "the seed's \"GB\" are GiB" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["memory", "--model", "qwen9"], "gdn-lossless memory: error: argument --model: unknown model 'qwen9'; known models:"),
        (["memory", "-D", "0"], "gdn-lossless memory: error: argument --drafts/-D: must be a positive integer, got 0"),
        (["memory", "-R", "0"], "gdn-lossless memory: error: argument --requests/-R: must be a positive integer, got 0"),
        (["memory", "--budget", "-1"], "gdn-lossless memory: error: argument --budget: must be a positive number of GiB, got -1"),
        (["memory", "--budget", "0"], "gdn-lossless memory: error: argument --budget: must be a positive number of GiB, got 0"),
        (["memory", "--budget", "inf"], "gdn-lossless memory: error: argument --budget: must be a positive number of GiB, got inf"),
        (["check", "--drafts", "0"], "gdn-lossless check: error: argument --drafts: must be a positive integer, got 0"),
        (["check", "--requests", "0"], "gdn-lossless check: error: argument --requests: must be a positive integer, got 0"),
        (["check", "--heads-divisor", "0"], "gdn-lossless check: error: argument --heads-divisor: must be a positive integer, got 0"),
        (["check", "--heads-divisor", "3"],
         "gdn-lossless check: error: argument --heads-divisor: must be a divisor of H=16 (1, 2, 4, 8, 16), so that HV // H stays 2, got 3"),
        (["check", "--layers", "0"], "gdn-lossless check: error: argument --layers: must be a positive integer, got 0"),
        (["check", "--layers", "99"],
         "gdn-lossless check: error: argument --layers: must be from 1 to 30 (Qwen3.5/3.6-35B-A3B has 30 GDN layers), got 99"),
        (["check", "--model", "qwen3.8-27b", "--layers", "49"], "gdn-lossless check: error: argument --layers: must be from 1 to 48"),
        (["check", "--head-dim", "0"], "gdn-lossless check: error: argument --head-dim: must be a positive integer, got 0"),
        (["check", "--drafts", "two"], "gdn-lossless check: error: argument --drafts: must be a positive integer, got 'two'"),
        (["check", "--seed", "-1"], "gdn-lossless check: error: argument --seed: must be a non-negative integer, got -1"),
        (["check", "--backend", "cuda"], "gdn-lossless check: error: argument --backend: invalid choice: 'cuda'"),
        (["check", "--backend", "triton", "--layers", "1"], "gdn-lossless check: error: verify: backend 'triton' runs Triton kernels"),
        ([], "gdn-lossless: error: the following arguments are required: command"),
        (["demo", "--checkpoint", "ckpt", "--turns", "2"],
         "gdn-lossless demo: error: demo --checkpoint: argument --turns must be 1 (each prompt is decoded once: "
         "PretrainedModel.generate has no conversation and no prefix cache), got 2"),
        (["demo", "--checkpoint", "ckpt", "--tree", "2,2"],
         "gdn-lossless demo: error: demo --checkpoint: argument --tree must be left out (PretrainedModel.generate "
         "drafts a chain of --drafts inputs), got 2,2"),
        (["demo", "--checkpoint", "ckpt", "--mesh", "2x1"],
         "gdn-lossless demo: error: demo --checkpoint: argument --mesh must be left out (a checkpoint decodes on one "
         "device), got 2x1"),
        (["demo", "--checkpoint", "ckpt", "--size", "gpu"],
         "gdn-lossless demo: error: demo --checkpoint: argument --size must be left out (the checkpoint's config.json "
         "gives the size), got gpu"),
        (["demo", "--checkpoint", "ckpt", "--track-interval", "64"],
         "gdn-lossless demo: error: demo --checkpoint: argument --track-interval must be 0 or left out"),
        (["demo", "--checkpoint", "ckpt", "--defer", "on"],
         "gdn-lossless demo: error: demo --checkpoint: argument --defer must be auto or off"),
        (["demo", "--checkpoint", "ckpt", "--batch", "0"],
         "gdn-lossless demo: error: demo --checkpoint: argument --batch must be a positive integer, got 0"),
        (["demo", "--checkpoint", "ckpt", "--steps-per-call", "0"],
         "gdn-lossless demo: error: demo --checkpoint: argument --steps-per-call must be a positive integer, got 0"),
        (["generate", "--checkpoint", "ckpt", "--prompt-ids", "1", "--steps-per-call", "0"],
         "gdn-lossless generate: error: argument --steps-per-call: must be a positive integer, got 0"),
        (["demo", "--draft-agreement", "1.5"], "gdn-lossless demo: error: --draft-agreement must be in (0, 1), got 1.5"),
        (["demo", "--tokens-per-step", "0.5"], "gdn-lossless demo: error: --tokens-per-step must be > 1, got 0.5"),
    ],
)
def test_errors_are_one_line(capsys, argv, message):
    """Every bad option stops before any work with one line on stderr and exit status 2 (the
    triton case runs on a CPU only: on a GPU machine it would run)."""
    if "triton" in argv and ON_GPU:
        pytest.skip("the triton backend is available on a GPU")
    try:
        status = main(argv)
    except SystemExit as e:  # argparse's usage errors exit from inside parse_args
        status = e.code
    assert status == 2
    captured = capsys.readouterr()
    err = captured.err
    assert err.startswith(message), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "result" not in captured.out


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out == f"gdn-lossless {gdn_lossless_jax.__version__} (jax {jax.__version__}, jaxlib {jaxlib.__version__})\n"


@pytest.mark.parametrize(
    "budget, expected",
    [
        ("0.01", "0.01 GiB for scratch + conv windows + KV cache: does not fit: the scratch and conv windows alone "
                 "need 0.14 GiB with tuples (6.17 GiB with snapshots), so no KV token is left"),
        ("3", "3 GiB for scratch + conv windows + KV cache: snapshots do not fit (with the conv windows they need "
              "6.17 GiB); 149,778 KV tokens with tuples"),
    ],
)
def test_memory_budget_that_does_not_fit(capsys, budget, expected):
    assert main(["memory", "-D", "4", "-R", "25", "--budget", budget]) == 0
    budget_line = [line for line in capsys.readouterr().out.splitlines() if line.startswith("budget")]
    assert budget_line == ["budget        " + expected]


@pytest.mark.parametrize("argv", [[], ["check"], ["memory"]])
def test_help(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: gdn-lossless")
    if argv == ["memory"]:
        assert "--seed-table" in out and "--budget" in out


def _fake_result(ok: bool):
    g = get_geometry("qwen3.6-35b-a3b").reduced(gdn_layers=1, heads_divisor=8, head_dim=8)
    stats = {"elements": 10, "differing": 3, "fraction": 0.3, "max_ulp": 2, "mean_ulp": 0.4}
    return check.CheckResult(
        geometry=g, shape=Shape.of(g, 5, 2), state_dtype="float32", backend="auto", outputs_equal=True,
        pool_equal=ok, replay_equal=True, untouched_equal=True, naive_ulp={"naive": stats},
        scratch_bytes={"snapshots": 10240, "tuples": 2080}, seconds=0.1,
    )  # fmt: skip


@pytest.mark.parametrize("ok, status", [(True, 0), (False, 1)])
def test_check_exit_status(monkeypatch, capsys, ok, status):
    """The check's exit status follows its result (the run itself is stubbed: it is the
    equivalence suite's job, and takes too long for a CLI test)."""
    seen = {}

    def fake_run_check(geometry, **kwargs):
        seen.update(geometry=geometry, **kwargs)
        return _fake_result(ok)

    monkeypatch.setattr(check, "run_check", fake_run_check)
    argv = ["check", "--layers", "1", "--heads-divisor", "8", "--head-dim", "8", "--requests", "5", "--drafts", "2"]
    assert main(argv) == status
    out = capsys.readouterr().out
    assert ("result        PASS" in out) == ok and ("MISMATCH" in out) == (not ok)
    assert "snapshots 60.00 MiB, tuples 0.707 MiB (84.9x smaller)" in out
    assert seen["geometry"].gdn_layers == 1 and seen["requests"] == 5 and seen["drafts"] == 2


def _run(*args):
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "gdn_lossless_jax", *args], capture_output=True, text=True, env=env, timeout=120)


def test_python_dash_m():
    ok = _run("memory", "--seed-table")
    assert ok.returncode == 0, ok.stderr
    assert "6.09 / 6.09 ok" in ok.stdout and "tuples (ours)" in ok.stdout
    bad = _run("memory", "--model", "nope")
    assert bad.returncode == 2
    assert bad.stderr.startswith("gdn-lossless memory: error: argument --model: unknown model 'nope'")
    assert "Traceback" not in bad.stderr and bad.stderr.count("\n") == 1


def test_check_progress_and_bf16_ulp(seed):
    """A real (tiny) run on a bf16 pool: the progress counter counts every step once, and the
    naive forms' drift is counted in bf16 ULP. Any bf16 difference spans 65536 fp32 ULP, so a
    count in fp32 units shows as max_ulp >= 65536; seeds are tried until some element differs
    (a third of the seeds show none at this size)."""
    g = get_geometry("qwen3.6-35b-a3b").reduced(gdn_layers=1, heads_divisor=4, head_dim=32)
    for attempt in range(10):
        calls = []
        r = check.run_check(g, requests=4, drafts=3, state_dtype=jnp.bfloat16, seed=seed + attempt,
                            progress=lambda i, n, what: calls.append((i, n)))  # fmt: skip
        assert r.ok
        assert [i for i, _ in calls] == list(range(1, len(calls) + 1)) and {n for _, n in calls} == {len(calls)}
        assert len(calls) == g.gdn_layers + 3
        if any(st["differing"] for st in r.naive_ulp.values()):
            break
    else:
        pytest.fail(f"no naive form differed from the rule in bf16 for seeds {seed}..{seed + 9}")
    for name, st in r.naive_ulp.items():
        assert (st["differing"] == 0) == (st["max_ulp"] == 0), name
        assert st["max_ulp"] < 2**10, (name, st)  # in bf16 ULP: a few at most
    assert "naive forms   replay of the last step vs the pinned rule (ULP of bfloat16):" in check.format_result(r)


def test_memory_tp_table(capsys):
    assert main(["memory", "--tp"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("per device, heads over a tensor axis of size tp: D=4 draft tokens, 25 requests (26 scratch")
    rows = [line.split() for line in out if line.startswith("Qwen")]
    assert [(r[0], r[1]) for r in rows[:4]] == [("Qwen3-Next-80B-A3B", t) for t in ("1", "2", "4", "8")]
    assert len(rows) == 12
    # Qwen3.5/3.6-35B-A3B at tp 1 and 8: the snapshots scratch (26 rows x 4 drafts x 60 MiB) and its eighth
    snaps = {r[1]: r[7] for r in rows if r[0] == "Qwen3.5/3.6-35B-A3B"}
    assert snaps["1"] == "6,240.0" and snaps["8"] == "780.0"
    assert main(["memory", "--model", "qwen3.8-27b", "--tp", "3,4"]) == 0
    out = capsys.readouterr().out
    assert "Qwen3.5/3.8-27B   3   -   -  heads do not split: H=16 is not a multiple of 3" in out
    with pytest.raises(SystemExit) as exit_:
        main(["memory", "--tp", "0"])
    assert exit_.value.code == 2
    assert "argument --tp: tensor sizes must be positive integers, got '0'" in capsys.readouterr().err


class _FakeCheckpoint:
    """A stand-in for a loaded checkpoint (``demo --checkpoint`` and ``generate`` without a compile): each
    call is recorded; ``flip``: (record, row, position) of a generated id changed by one; ``state_of``:
    the ssm value a record mode's final state holds."""

    def __init__(self, flip=None, state_of=None):
        import types

        self.calls, self.flip, self.state_of = [], flip, state_of or {}
        self.config = types.SimpleNamespace(vocab=50, describe=lambda: "fake checkpoint")

    def generate(self, ids, new, *, drafts=4, record="tuples", steps_per_call=1, return_info=False):
        import types

        import numpy as np

        assert record in ("tuples", "snapshots", None), record
        self.calls.append({"batch": len(ids), "new": new, "record": record, "steps_per_call": steps_per_call})
        out = np.concatenate([ids, (ids[:, -1:] + np.arange(1, new + 1)) % 50], axis=1).astype(np.int32)
        if self.flip is not None and self.flip[0] == record and len(ids) > self.flip[1] and new > self.flip[2]:
            out[self.flip[1], ids.shape[1] + self.flip[2]] += 1
        gaps = np.tile(np.linspace(1.0, 2.0, new, dtype=np.float32), (len(ids), 1))
        state = {"ssm": np.full(2, self.state_of.get(record, 0.0), np.float32)}
        info = types.SimpleNamespace(steps=new, accepted=new * len(ids), drafted=0, gaps=gaps, states=lambda: state)
        return (out, info) if return_info else out


def _demo_checkpoint(monkeypatch, fake, *argv):
    import gdn_lossless_jax.model as gm

    monkeypatch.setattr(gm, "load_pretrained", lambda *a, **k: fake)
    return main(["demo", "--checkpoint", "ckpt", "--prompts", "3", "--prompt-len", "2", "--tokens", "5", *argv])


def test_demo_checkpoint_options_and_none(monkeypatch, capsys):
    """``demo --checkpoint``: 'none' decodes without speculation (record=None), --steps-per-call reaches
    generate, --batch splits the prompts, and the counts are of generated ids only."""
    fake = _FakeCheckpoint()
    assert _demo_checkpoint(monkeypatch, fake, "--record", "tuples", "none", "--steps-per-call", "3",
                            "--batch", "2") == 0  # fmt: skip
    out = capsys.readouterr().out
    timed = [c for c in fake.calls if c["new"] == 5]
    assert [(c["record"], c["batch"]) for c in timed] == [("tuples", 2), ("tuples", 1), (None, 2), (None, 1)]
    assert {c["steps_per_call"] for c in fake.calls} == {3}
    assert "3 prompts of 2 tokens, 5 generated each, 2 at a time; D=4, 3 steps per call" in out
    assert ("tokens     tuples vs none: 15 of 15 generated ids equal (speculative vs plain greedy decoding: "
            "measured, not checked)") in out  # fmt: skip
    assert "verdict    tuples and snapshots not both run: nothing checked" in out
    fake = _FakeCheckpoint()
    assert _demo_checkpoint(monkeypatch, fake, "--record", "tuples") == 0
    assert {(c["batch"], c["steps_per_call"]) for c in fake.calls if c["new"] == 5} == {(3, 1)}  # defaults


def test_demo_checkpoint_divergence_is_measured_not_failed(monkeypatch, capsys):
    """Plain greedy decoding differing from the speculative modes (forced here) is reported with its place and
    top-2 gaps, exit status 0; tuples and snapshots differing (tokens, or final states) is exit status 1."""
    fake = _FakeCheckpoint(flip=(None, 1, 3))
    assert _demo_checkpoint(monkeypatch, fake, "--record", "none", "tuples", "snapshots") == 0
    out = capsys.readouterr().out
    assert ("tokens     tuples vs none: 14 of 15 generated ids equal (speculative vs plain greedy decoding: measured, "
            "not checked); first divergence: prompt 1, generated token 3") in out  # fmt: skip
    assert "top-2 logit gap there 1.75 (tuples) / 1.75 (none)" in out
    assert "tokens     tuples vs snapshots: 15 of 15 generated ids equal\n" in out
    assert "verdict    identical" in out
    fake = _FakeCheckpoint(flip=("snapshots", 0, 0))
    assert _demo_checkpoint(monkeypatch, fake, "--record", "tuples", "snapshots") == 1
    out = capsys.readouterr().out
    assert "tokens     tuples vs snapshots: 14 of 15 generated ids equal; first divergence: prompt 0" in out
    assert "verdict    DIFFERENT" in out
    fake = _FakeCheckpoint(state_of={"snapshots": 1.0})
    assert _demo_checkpoint(monkeypatch, fake, "--record", "tuples", "snapshots") == 1
    out = capsys.readouterr().out
    assert "states     tuples vs snapshots, final SSM, conv and KV states: " in out and "bit-identical" not in out
    assert "verdict    DIFFERENT" in out


def test_generate_steps_per_call(monkeypatch, capsys):
    import gdn_lossless_jax.model as gm

    fake = _FakeCheckpoint()
    monkeypatch.setattr(gm, "load_pretrained", lambda *a, **k: fake)
    assert main(["generate", "--checkpoint", "ckpt", "--prompt-ids", "1,2", "--max-new-tokens", "3",
                 "--steps-per-call", "4", "--record", "none"]) == 0  # fmt: skip
    assert fake.calls == [{"batch": 1, "new": 3, "record": None, "steps_per_call": 4}]
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "3,4,5" and "record none, 4 step(s) per call" in out[2]
