"""The benchmark harness stays alive: its cases, its byte counts and a cpu-small run.

Timings on the CPU are not results; these tests check the harness (rows, columns, files,
the in-place commit, the checks it records), not speed.
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `benchmarks` lives at the repository root, beside gdn_lossless_jax/
    sys.path.insert(0, str(ROOT))

from benchmarks import cases as bc  # noqa: E402
from benchmarks import peer_sglang, traffic  # noqa: E402
from benchmarks.run import main  # noqa: E402
from conftest import FULL_TESTS, ON_GPU, full_only  # noqa: E402
from gdn_lossless_jax.testing.cases import CommitIndices, Shape  # noqa: E402

RECORDS = ("tuples", "snapshots")
ROW_KEYS = ("median_us", "p10_us", "p90_us", "min_us", "bytes", "gbps", "floor_us", "x_floor", "vs_snapshots", "samples_us")
COPY_RATE = 4.27e12  # the copy rate measured on the H200 (x * 2 over 2 GiB, 2026-11-30)


def test_cases_are_the_issue_cases():
    g = bc.MODES["h200"].geometry
    assert (g.gdn_layers, g.num_k_heads, g.num_v_heads, g.head_k_dim, g.head_v_dim) == (30, 16, 32, 128, 128)
    assert bc.H200_CONFIGS == ("25x4", "8x4", "8x8", "8x16")
    assert bc.MODES["h200"].configs == bc.H200_CONFIGS
    assert [c.label for c in bc.parse_configs("25x4, 8x16", ())] == ["25x4", "8x16"]
    assert bc.TRACK_FRACTION == 0.25
    with pytest.raises(ValueError, match="REQUESTSxDRAFTS"):
        bc.Config.parse("25-4")
    cfg = bc.Config(25, 4)
    sets = bc.commit_index_sets(cfg, 8)
    S = bc.pool_slots(25)
    for ix in sets:
        used = np.concatenate([ix.slots, ix.track_slots[ix.track_steps >= 0]])
        assert len(set(used.tolist())) == len(used) and used.max() < S  # unique destinations inside the pool
        assert np.all(ix.track_steps <= ix.steps) and np.all((ix.steps >= 0) & (ix.steps < 4))
    crossing = np.mean([np.mean(ix.track_steps >= 0) for ix in sets])
    assert 0.1 < crossing < 0.45  # about a quarter of the rows cross a track boundary


def test_byte_counts_match_the_spec_anchors():
    g = bc.MODES["h200"].geometry
    s = Shape.of(g, 25, 4)
    us = lambda t: t.total / COPY_RATE * 1e6  # noqa: E731
    assert 60 < us(traffic.verify_traffic(s, "snapshots")) < 63  # byte floor 61 us
    assert 12.5 < us(traffic.verify_traffic(s, "tuples")) < 14  # 13 us
    N, tracked = 25, 6
    ix = CommitIndices(
        slots=np.arange(N, dtype=np.int32), steps=np.full(N, 3, np.int32),
        track_slots=np.arange(N, 2 * N, dtype=np.int32),
        track_steps=np.where(np.arange(N) < tracked, 1, -1).astype(np.int32), rows=np.arange(N, dtype=np.int32),
    )  # fmt: skip
    replay = traffic.commit_traffic(s, 30, ix, "tuples", slots_in_pool=60)
    scatter = traffic.commit_traffic(s, 30, ix, "snapshots", slots_in_pool=60)
    assert 800 < us(replay) < 860  # single-pass replay floor 825 us
    state = 32 * 128 * 128 * 4
    assert scatter.write == 30 * (N + tracked) * state
    assert scatter.read == scatter.write + 5 * N * 4  # plus the five index arrays
    # Skipped requests move nothing: a negative step and no track copy.
    none = CommitIndices(*(np.asarray(x) for x in (ix.slots, np.full(N, -1), ix.track_slots, np.full(N, -1), ix.rows)))
    assert traffic.commit_traffic(s, 30, none, "tuples", slots_in_pool=60).write == 0


def _run(tmp_path, *extra):
    out = tmp_path / "bench"
    assert main(["--mode", "cpu-small", "--out", str(out), "--quiet", *extra]) == 0
    return out, json.loads((out / "results.json").read_text())


@pytest.mark.skipif(ON_GPU, reason="tests the CPU run, where the triton backend is skipped (on a GPU it runs)")
def test_cpu_small_run_writes_every_row(tmp_path):
    # Several calls per timed invocation and two state copies: the structure of the GPU run.
    out, res = _run(tmp_path, "--backends", "reference,triton", "--trials", "2", "--reps", "2", "--commit-reps", "2",
                    "--rotate-mib", "0.01")  # fmt: skip
    meta = res["meta"]
    assert meta["mode"] == "cpu-small" and meta["configs"] == list(bc.CPU_SMALL_CONFIGS)
    assert meta["backends_run"] == ["reference"]
    assert "triton" in meta["backends_skipped"]  # no GPU here: skipped with the reason
    assert "not run" in meta["peer"]
    assert res["copy"]["rate_gbps"] > 0
    rows = {(r["config"], r["backend"], r["op"], r["record"]): r for r in res["rows"]}
    for cfg in bc.CPU_SMALL_CONFIGS:
        assert (cfg, "xla", "copy", None) in rows
        for op in ("verify", "commit", "net"):
            for rec in RECORDS:
                r = rows[(cfg, "reference", op, rec)]
                for key in ROW_KEYS:
                    assert key in r, (cfg, op, rec, key)
                assert r["failed"] is None and r["n"] == 2 and r["bytes"] > 0 and r["median_us"] >= 0
                if op != "net":
                    assert r["calls_per_invocation"] == 2 and r["timed_compile_s"] > 0
        assert rows[(cfg, "reference", "net", "snapshots")]["vs_snapshots"] == pytest.approx(1.0)
        net = rows[(cfg, "reference", "net", "tuples")]
        v, c = rows[(cfg, "reference", "verify", "tuples")], rows[(cfg, "reference", "commit", "tuples")]
        L = meta["geometry"]["gdn_layers"]
        assert net["bytes"] == L * v["bytes"] + c["bytes"]
        assert net["samples_us"] == pytest.approx([L * a + b for a, b in zip(v["samples_us"], c["samples_us"])], abs=0.01)
    for check in res["checks"]:
        assert check["outputs_equal_across_modes"] is True
        for rec in RECORDS:  # the donated pool is updated in place
            assert check["commit_in_place"][rec] == {"aliased": True, "pool_copies": 0}
    assert res["config_info"][bc.CPU_SMALL_CONFIGS[0]]["state_copies"] == 2
    # The single-call compile time is measured at the first configuration only (by default).
    [comp] = res["compile"]
    assert comp["config"] == bc.CPU_SMALL_CONFIGS[0]
    assert set(comp["seconds"]) == {f"{op}_{rec}" for op in ("verify", "commit") for rec in RECORDS}

    md = (out / "results.md").read_text()
    assert "not results" in md
    for cfg in bc.CPU_SMALL_CONFIGS:
        assert f"## {cfg} (" in md
    table_rows = [line for line in md.splitlines() if line.startswith("| reference |") or line.startswith("| xla |")]
    assert len(table_rows) == len(res["rows"])
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    assert (out / "results.png").exists() == has_mpl

    again = tmp_path / "replot"
    assert main(["--replot", str(out / "results.json"), "--out", str(again)]) == 0
    assert (again / "results.md").read_text() == md


@pytest.mark.slow
@full_only  # the suite's time: the Pallas kernels' interpret mode is covered by their own tests
@pytest.mark.skipif(ON_GPU, reason="Pallas runs in interpret mode on the CPU only")
def test_cpu_small_run_with_pallas_interpret(tmp_path):
    _, res = _run(tmp_path, "--backends", "pallas", "--configs", "2x2", "--trials", "2")
    keys = {(r["backend"], r["op"], r["record"]) for r in res["rows"]}
    assert {("pallas", op, rec) for op in ("verify", "commit", "net") for rec in RECORDS} <= keys
    [check] = res["checks"]
    assert check["outputs_equal_across_modes"] is True
    assert check["outputs_rel_err_vs_reference"] < 1e-2  # bf16 outputs, against the reference backend
    assert check["commit_in_place"]["tuples"] == {"aliased": True, "pool_copies": 0}


def test_peer_without_sources_says_why(tmp_path):
    with pytest.raises(peer_sglang.PeerUnavailable) as e:
        peer_sglang.load(tmp_path)
    assert "sglang" in str(e.value).lower()


def test_device_columns_from_trace_dicts():
    """finish_rows derives the device ratios; the markdown lists each row's kernels."""
    from benchmarks import report
    from benchmarks.devtime import busy_us, device_time

    # On a CPU the trace has no GPU plane: no device time, and no error.
    assert device_time(lambda: None, 1, 1) is None
    # busy time: the union of kernel intervals (overlapping kernels counted once); control: the sum
    spans = [(5.0, 12.0), (0.0, 10.0), (20.0, 25.0), (21.0, 22.0)]
    assert busy_us(spans) == 17.0 and sum(e - s for s, e in spans) == 23.0 and busy_us([]) == 0.0
    kern = lambda us: {"us_per_call": us, "kernels": [  # noqa: E731
        {"name": "gdn_verify", "launches_per_call": 1.0, "median_us": us - 2, "p10_us": us - 3, "p90_us": us, "us_per_call": us - 2},
        {"name": "loop_fusion", "launches_per_call": 2.0, "median_us": 1.0, "p10_us": 1.0, "p90_us": 1.0, "us_per_call": 2.0}]}
    rows = [
        {"config": "c", "backend": "pallas", "op": "verify", "record": rec, "bytes": 4_000_000, "median_us": med,
         "device_us": dev, "device": kern(dev)}
        for rec, med, dev in (("tuples", 50.0, 20.0), ("snapshots", 80.0, 60.0))
    ]
    report.finish_rows(rows, copy_rate=4e12)  # floor: 1 us
    t, s = rows
    assert t["device_x_floor"] == pytest.approx(20.0) and s["device_x_floor"] == pytest.approx(60.0)
    assert t["device_vs_snapshots"] == pytest.approx(3.0) and s["device_vs_snapshots"] == pytest.approx(1.0)
    assert t["vs_snapshots"] == pytest.approx(1.6)
    lines = report._kernel_lines(rows)
    assert any("`gdn_verify` x1 18.0 us [17.0, 20.0]" in x for x in lines)
    assert any("`loop_fusion` x2" in x for x in lines)


def test_step_benchmark_runs_on_the_cpu(tmp_path):
    """benchmarks/step.py end to end on the reduced geometry (its timings are not results)."""
    from benchmarks import step

    out = tmp_path / "step"
    argv = ["--out", str(out), "--mode", "cpu-small", "--configs", "2x2", "--backends", "reference", "--records",
            "tuples", "--kinds", "pool-python,scan,scan-out,unrolled-out,fused,fused-out,scan-mesh", "--mesh", "1x1", "--rounds", "2", "--warmup", "1",
            "--device-invocations", "0", "--peer", "off"]  # fmt: skip
    assert step.main(argv) == 0
    result = json.loads((out / "results.json").read_text())
    kinds = {r["kind"]: r for r in result["rows"]}
    assert set(kinds) == {"pool-python", "scan", "scan-out", "unrolled-out", "fused", "fused-out", "scan-mesh"}
    assert kinds["scan-mesh"]["notes"] == ["2 layers", "mesh 1x1 (tensor x data)"] and result["env"]["mesh"] == "1x1"
    assert all(r["wall"]["n"] == 2 and r["failed"] is None for r in kinds.values())
    assert all(r["wall_ahead"]["n"] == 5 for k, r in kinds.items() if k not in ("pool-python", "scan-mesh"))  # runs ahead
    assert all(r["wall_polled"]["n"] == r["wall_back_to_back"]["n"] > 0 for r in kinds.values())  # waits by polling
    synced = [r["wall_synced"]["n"] for r in kinds.values()]  # the driver's wait: GPUs only
    assert all(n == r["wall_back_to_back"]["n"] for n, r in zip(synced, kinds.values())) if ON_GPU else not any(synced)
    assert "| 2x2 | reference | tuples | scan |" in (out / "results.md").read_text()


def test_step_benchmark_families(tmp_path):
    """``--families model,kimi_linear``: Kimi Linear's KDA layers (a per-channel decay, its own pool and tapes) get
    their own rows, labelled by family, beside the model's GDN rows; an unknown family is refused by name."""
    from benchmarks import step

    out = tmp_path / "step"
    argv = ["--out", str(out), "--mode", "cpu-small", "--configs", "2x2", "--backends", "reference", "--records",
            "tuples,snapshots", "--kinds", "scan", "--families", "model,kimi_linear", "--rounds", "2",
            "--warmup", "1", "--b2b-calls", "2", "--device-invocations", "0", "--peer", "off"]  # fmt: skip
    assert step.main(argv) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert {r["config"] for r in rows} == {"2x2", "2x2 kimi_linear"}
    assert len(rows) == 4 and all(r["failed"] is None and r["wall"]["n"] == 2 for r in rows)
    assert "| 2x2 kimi_linear | reference | snapshots | scan |" in (out / "results.md").read_text()
    with pytest.raises(SystemExit, match=r"--families: expected a comma list of \('model', 'olmo_hybrid', "):
        step.main(argv[:-8] + ["--families", "kimi"])


def test_step_kinds_with_compiler_options_and_busy_column():
    """A kind's suffix names its compiler options (``-nocb``, ``-conc``); the table shows the busy time
    where the GPU was busy for less than the kernels' sum (kernels that overlapped), else the sum alone."""
    from benchmarks import step

    assert step.split_kind("unrolled-out-conc") == ("unrolled-out", step.CONCURRENT)
    assert step.split_kind("fused-nocb") == ("fused", step.NO_COMMAND_BUFFERS)
    assert step.split_kind("fused-out") == ("fused-out", None)
    assert all(step.split_kind(k)[0] in step.DIRECT_FORMS + tuple(step.FUSED_FORMS) or k.startswith("pool")
               for k in step.OLD_KINDS)
    row = {"config": "c", "backend": "mosaic", "record": "tuples", "kind": "fused-out-conc", "our_kernels_us": 9.0,
           "wall": {"n": 3, "median_us": 20.0, "p10_us": 19.0, "p90_us": 21.0}, "wall_over_device": 2.0}
    overlapped, serial = dict(row, device_us=10.0, device_busy_us=8.0), dict(row, device_us=10.0, device_busy_us=10.0)
    assert "| 10 (busy 8) | 9 |" in step._table([overlapped])[2]
    assert "| 10 | 9 |" in step._table([serial])[2]


def test_the_triton_backends_kernels_count_as_ours():
    """The step report counts the Triton backend's kernels (named after their Triton functions
    by the profiler) as ours, and every name it knows is a kernel of that backend."""
    import importlib

    from benchmarks import step as bstep

    modules = [importlib.import_module(f"gdn_lossless_jax.backends.triton.{m}") for m in ("verify", "commit")]
    assert all(any(hasattr(m, n) for m in modules) for n in bstep.TRITON_KERNELS)
    kernels = [{"name": n} for n in ("verify_kernel", "gdn_verify_tuples", "loop_select_fusion_4")]
    assert [k["name"] for k in bstep._kernels_not_ours({"kernels": kernels})] == ["loop_select_fusion_4"]


@pytest.mark.parametrize("policy", ["idle", "pause"])
def test_idle_spinners_run_the_command_and_stop(policy):
    """``python -m benchmarks.dev idle-spinners`` keeps a spinner of the lowest priority on each CPU while the command
    runs (the command itself in the normal class), returns the command's status, and leaves no spinner
    behind."""
    import platform
    import shutil
    import subprocess

    if policy == "pause" and (shutil.which("cc") is None or platform.machine() not in ("x86_64", "AMD64")):
        pytest.skip("the pause spinner is x86 code built with cc: this machine lacks one or the other")
    root = Path(__file__).resolve().parents[1]
    probe = "import os; print(os.sched_getscheduler(0) == os.SCHED_OTHER); raise SystemExit(3)"
    r = subprocess.run([sys.executable, "-m", "benchmarks.dev", "idle-spinners", "--cpus", "0", "--policy", policy, "--",
                        sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=root)  # fmt: skip
    assert r.returncode == 3 and r.stdout.strip() == "True", (r.stdout, r.stderr)
    assert f"1 spinners ({policy}) on CPUs [0], pids [" in r.stderr
    (pid,) = json.loads(r.stderr.split("pids ")[1].split("\n")[0])
    with pytest.raises(ProcessLookupError):  # killed and reaped
        os.kill(pid, 0)


def test_step_synced_pass_dispatches_then_waits_with_the_driver(monkeypatch):
    """``back_to_back(wait="sync")``: a row that runs ahead is dispatched, then waited for with the
    driver's wait (SGLang's with its own ``torch.cuda.synchronize``); its dispatch times are kept.
    A row that cannot run ahead runs its blocking call with the driver's wait."""
    from benchmarks import step
    from benchmarks.timing import Row
    from benchmarks.traffic import Traffic

    log = []
    monkeypatch.setattr(step, "synchronize", lambda: log.append("sync"))
    row = lambda backend, ahead, run=lambda: log.append("run"): Row(  # noqa: E731
        config="2x2", backend=backend, op="step", record=None, calls=1, traffic=Traffic(0, 0), run=run, ahead=ahead)
    rows = [row("mosaic", (lambda: log.append("go"), lambda: log.append("block"))),
            row("sglang", (lambda: log.append("replay"), lambda: log.append("torch"))),
            row("reference", None, lambda: step.wait(log.append("blocking run")))]  # fmt: skip
    dispatched = {}
    out = step.back_to_back(rows, 2, wait="sync", dispatch=dispatched)
    assert log == ["go", "sync"] * 2 + ["replay", "torch"] * 2 + ["blocking run", "sync"] * 2
    assert set(out) == {r.key for r in rows} and set(dispatched) == {rows[0].key, rows[1].key}
    assert all(len(v) == 2 for v in [*out.values(), *dispatched.values()])
    assert step._WAIT[0] is step.jax.block_until_ready  # restored


def test_fused_call_alternates_executables_and_swaps_the_tapes():
    """``fused_call``: executables taken in turn, and the next call writes the tape just committed
    and commits the one just written (the decode loop's roles)."""
    from benchmarks import step

    seen = []

    def exe(name):
        def fn(ssm, tape, prev, params, xs, ix, *obuf):
            seen.append((name, tape, prev, obuf))
            return "outs", ssm + 1, tape, prev  # (outs, ssm, written, old)

        return fn

    call = step.fused_call([exe("even"), exe("odd")])
    ssm, tape, prev = 0, "A", "B"
    for _ in range(3):
        _, ssm, tape, prev = call(ssm, tape, prev, None, None, None, "obuf")
    assert [s[:3] for s in seen] == [("even", "A", "B"), ("odd", "B", "A"), ("even", "A", "B")]
    assert ssm == 3 and seen[0][3] == ("obuf",)


def test_e2e_benchmark_runs_on_the_cpu(tmp_path):
    """``python -m benchmarks.e2e`` at the tiny size: a row per record mode with the fields the docs
    name; tuples against no speculation measured (on the CPU: every token equal), not checked; with
    GDN_FULL_TESTS=1 snapshots too, the checks (tuples == snapshots, tokens and final states) passing."""
    from benchmarks import e2e

    records = ["tuples", "none", *(["snapshots"] if FULL_TESTS else [])]
    assert e2e.main(["--out", str(tmp_path), "--records", ",".join(records), "--batch", "2", "--tokens", "6",
                     "--steps-per-call", "2", "--prompt-len", "5"]) == 0  # fmt: skip
    result = json.loads((tmp_path / "results.json").read_text())
    rows = {r["record"]: r for r in result["rows"]}
    assert set(rows) == set(records) and rows["none"]["drafts"] == 1
    for r in rows.values():
        assert r["kind"] == "e2e" and r["tokens"] == 12 and r["tokens_per_s"] > 0 and r["steps_per_call"] == 2
        assert r["state_bytes"] > 0 and r["scratch_bytes"] > 0 and 0 <= r["host_clock_fraction"] <= 1
    div = result["divergence"]["tuples vs none"]
    assert div == {"tokens_equal": 12, "tokens": 12, "first": None}  # speculative == plain greedy here (the CPU)
    assert all(result["checks"].values()) and not any("none" in k for k in result["checks"])
    assert set(result["checks"]) == ({"tokens tuples == snapshots", "final states tuples == snapshots"}
                                     if FULL_TESTS else set())  # fmt: skip
    assert "tuples/none" in result["ratios"]


def _fake_e2e(monkeypatch, flip=None, states_of=None):
    """benchmarks.e2e with run_record faked (no compile): tokens ``[i, i+1, ...]`` per request, ``flip``
    (record, request, position) changed by one, gaps ``0.01 * (position + 1)``, final states per record."""
    from benchmarks import e2e

    def run_record(config, params, prompts, *, record, batch, tokens, **kw):
        toks = [[i + j for j in range(tokens)] for i in range(len(prompts))]
        if flip is not None and flip[0] == record:
            toks[flip[1]][flip[2]] += 1
        gaps = [[0.01 * (j + 1) for j in range(tokens)] for _ in prompts]
        row = {"record": record, "batch": batch, "tokens_per_s": 1.0, "step_ms": 1.0, "tokens_per_step": 1.0,
               "host_clock_fraction": 0.0, "host_fraction": None, "state_bytes": 1, "scratch_bytes": 1}  # fmt: skip
        return row, toks, {"ssm": np.full(2, (states_of or {}).get(record, 0.0), np.float32)}, gaps

    monkeypatch.setattr(e2e, "run_record", run_record)
    return e2e


def test_e2e_divergence_is_a_measurement(tmp_path, monkeypatch, capsys):
    """Speculative decoding differing from plain greedy decoding (forced) is reported where it first diverges,
    with the top-2 gaps there, and the exit status stays 0; tuples != snapshots (tokens or final states)
    is exit status 1."""
    argv = ["--out", str(tmp_path), "--batch", "3", "--tokens", "5", "--trace", "off"]
    e2e = _fake_e2e(monkeypatch, flip=("none", 2, 3))
    assert e2e.main(argv) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    first = {"request": 2, "position": 3, "tokens": [5, 6], "gaps": [0.04, 0.04]}
    assert result["divergence"] == {f"{r} vs none": {"tokens_equal": 14, "tokens": 15, "first": first}
                                    for r in ("tuples", "snapshots")}  # fmt: skip
    assert result["checks"] == {"tokens tuples == snapshots": True, "final states tuples == snapshots": True}
    out = capsys.readouterr().out
    assert ("divergence tuples vs none: 14 of 15 tokens equal; first at request 2, generated token 3 (ids 5 vs 6), "
            "top-2 logit gap there 0.04 / 0.04 (measured, not checked)") in out  # fmt: skip
    assert "checks tokens tuples == snapshots: ok, final states tuples == snapshots: ok" in out
    e2e = _fake_e2e(monkeypatch, flip=("snapshots", 0, 0))
    assert e2e.main(argv) == 1
    assert json.loads((tmp_path / "results.json").read_text())["checks"]["tokens tuples == snapshots"] is False
    e2e = _fake_e2e(monkeypatch, states_of={"snapshots": 1.0})
    assert e2e.main(argv) == 1
    assert "final states tuples == snapshots: FAILED" in capsys.readouterr().out


def test_e2e_fixed_memory_batches():
    """The fixed-memory mode: each record mode's batch is the largest whose state plus scratch fits
    the budget (one more row does not), and tuples fit more rows than snapshots."""
    from benchmarks import e2e
    from gdn_lossless_jax.model import get_config

    config = get_config("deep")
    budget = sum(e2e.pool_bytes(config, 64, 4, "snapshots"))
    fits = {r: e2e.fit_batch(config, budget, 4, r) for r in e2e.RECORDS}
    assert fits["snapshots"] == 64 and fits["tuples"] > 2 * fits["snapshots"] and fits["none"] >= fits["tuples"]
    for r, n in fits.items():
        mode, D = e2e._mode(r, 4)
        assert sum(e2e.pool_bytes(config, n, D, mode)) <= budget < sum(e2e.pool_bytes(config, n + 1, D, mode))


def test_e2e_draft_settings(tmp_path, monkeypatch):
    """Several draft settings run one after the other, each with its own ratios, checks and rows tagged with
    the setting; ``--tree`` reaches every speculative record; bad settings are refused naming the option."""
    argv = ["--out", str(tmp_path), "--batch", "2", "--tokens", "4", "--trace", "off", "--residual-factor", "0.5,1",
            "--tree", "2,2"]  # fmt: skip
    seen = []
    e2e = _fake_e2e(monkeypatch)
    fake = e2e.run_record

    def run_record(*a, tree=None, **kw):
        seen.append((kw["record"], tree))
        return fake(*a, **kw)

    monkeypatch.setattr(e2e, "run_record", run_record)
    assert e2e.main(argv) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert [r["residual_factor"] for r in result["runs"]] == [0.5, 1.0]
    assert [r["residual_factor"] for r in result["rows"]] == [0.5] * 3 + [1.0] * 3
    assert all(r["checks"] for r in result["runs"]) and set(seen) == {(r, (2, 2)) for r in e2e.RECORDS}
    for bad, msg in ((["--draft-agreement", "1.2"], "--draft-agreement: expected numbers in"),
                     (["--tokens-per-step", "0.5"], "--tokens-per-step: expected numbers > 1"),
                     (["--tree", "2,0"], "--tree: expected positive branching factors"),
                     (["--draft-agreement", "0.7", "--residual-factor", "1"], "give one of them")):  # fmt: skip
        with pytest.raises(SystemExit, match=msg):
            e2e.main(["--out", str(tmp_path), *bad])


def test_floor_benchmark_rows_on_the_cpu(tmp_path):
    """``python -m benchmarks.floor`` at the reduced geometry (reference backend): a row per op with the
    bytes the op must move (separate = verify + commit; fused moves less: the states are read once);
    on the CPU no device time and so no floor ratio."""
    from benchmarks import floor

    assert floor.main(["--out", str(tmp_path), "--mode", "cpu-small", "--configs", "2x2", "--backends",
                       "reference", "--invocations", "1"]) == 0  # fmt: skip
    rows = {r["op"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    assert set(rows) == {"separate", "verify", "commit", "fused"}
    assert all(r["kind"] == "kernel-floor" and r["batch"] == 2 and r["drafts"] == 2 for r in rows.values())
    assert rows["separate"]["bytes"] == rows["verify"]["bytes"] + rows["commit"]["bytes"]
    assert rows["verify"]["bytes"] < rows["fused"]["bytes"] < rows["separate"]["bytes"]
    assert all(r["device_ms"] is None and r["ratio"] is None for r in rows.values())
    with pytest.raises(SystemExit, match="--kinds: each must be one of"):
        floor.main(["--out", str(tmp_path), "--kinds", "scan"])
