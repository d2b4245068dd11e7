"""The command-line tool: output, exit status, one-line errors, --help."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gdn_lossless_jax import check
from gdn_lossless_jax.cases import Shape
from gdn_lossless_jax.cli import main
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
    assert "20.0 KiB per token" in out
    assert "snapshots -> tuples: 6.02 GiB = 315,724 KV tokens" in out
    assert "725,344 KV tokens with snapshots, 1,041,068 with tuples (+315,724 tokens, +44%)" in out
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
        (["memory", "--model", "qwen9"], "gdn-lossless memory: error: unknown model 'qwen9'; known models:"),
        (["memory", "-D", "0"], "gdn-lossless memory: error: memory_report: argument 'drafts' must be a positive integer, got 0"),
        (["memory", "--budget", "-1"], "gdn-lossless memory: error: --budget must be a non-negative number of GiB, got -1.0"),
    ],
)
def test_errors_are_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1 and "Traceback" not in err


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
    assert bad.stderr.startswith("gdn-lossless memory: error: unknown model 'nope'")
    assert "Traceback" not in bad.stderr and bad.stderr.count("\n") == 1
