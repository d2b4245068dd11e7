"""gdn_lossless_jax.tools.viz: the analyses against the oracles and the library, with controls; every
plot drawn without a display (Agg); the benchmark-result finder on files made here."""

import importlib.util
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: no display in CI

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import pytest

import gdn_lossless_jax as gl
from gdn_lossless_jax import get_geometry, rounding
from gdn_lossless_jax.tools import viz
from gdn_lossless_jax.testing.cases import Shape, verify_inputs
from gdn_lossless_jax.testing import controls
from gdn_lossless_jax.testing import (
    assert_bitwise_differs,
    assert_bitwise_equal,
    bits,
    fma_oracle,
    mul_oracle,
    ulp_distance,
)

ON_CPU = jax.default_backend() == "cpu"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _rule_oracle(S, alpha, k, u):
    return fma_oracle(k, u, mul_oracle(S, alpha))


@pytest.mark.parametrize("regime", list(viz.REGIMES))
def test_forms_on_flat_inputs_against_the_oracle(regime, seed):
    S, alpha, k, u = viz.regime_inputs(regime, 4000, seed)
    f = viz.evaluate_forms(S, alpha, k, u)
    assert_bitwise_equal(_rule_oracle(S, alpha, k, u), f["rule"])
    assert_bitwise_equal(fma_oracle(S, alpha, mul_oracle(k, u)), f["other_product"])
    m = viz.match_forms(f["rule"], S, alpha, k, u)
    assert m["rule"] == 1.0
    assert viz.match_forms(f["twice_rounded"], S, alpha, k, u)["rule"] < 1.0  # the control


def test_finder_reports_real_disagreements(seed):
    d = viz.find_disagreements("rule", "twice_rounded", regime="cancellation", n=5000, seed=seed, limit=4)
    assert d.differing > 0.5 * d.tried and len(d.examples) == 4
    for e in d.examples:
        want = _rule_oracle(*(np.float32(e[x]) for x in ("S", "alpha", "k", "u")))
        assert bits(np.float32(e["a"])) == bits(want)  # the reported rule value is the exact one
        assert e["ulp"] == int(ulp_distance(np.float32(e["a"]), np.float32(e["b"]))) > 0
    assert [e["ulp"] for e in d.examples] == sorted((e["ulp"] for e in d.examples), reverse=True)
    assert "twice_rounded" in str(d) and "0x" in str(d)
    # The control: a form against itself never differs.
    same = viz.find_disagreements("rule", "rule", regime="cancellation", n=5000, seed=seed)
    assert same.differing == 0 and same.examples == [] and same.max_ulp == 0


def test_disagreement_map_and_decay_sweep(seed):
    es = (-140, -126, -60, 0)
    # 512 samples a cell: the forms disagree in about 5% of the samples of two of these cells, so
    # at 32 samples one seed in about 50 drew no disagreement at all (seen with GDN_SEED=796528).
    m = viz.disagreement_map("twice_rounded", s_exponents=es, u_exponents=es, samples=512, seed=seed)
    assert m["fraction"].shape == m["max_ulp"].shape == (4, 4)
    assert m["fraction"].max() > 0 and np.all((0 <= m["fraction"]) & (m["fraction"] <= 1))
    control = viz.disagreement_map("rule", s_exponents=es, u_exponents=es, samples=512, seed=seed)
    assert not control["fraction"].any()
    s = viz.decay_sweep(neg_g=[1e-9, 1e-8, 0.5, 50.0], samples=256, seed=seed)
    assert s["fraction"]["twice_rounded"].shape == (4,)
    # exp(g) rounds to exactly 1 there, and fma(S, 1, rn(k*u)) = rn(S + rn(k*u)): the two forms agree.
    assert np.all(s["alpha"][:2] == 1)
    np.testing.assert_array_equal(s["fraction"]["other_product"][:2], s["fraction"]["twice_rounded"][:2])
    assert s["fraction"]["other_product"][2] > 0


def test_replay_states_are_the_snapshots(seed):
    x = verify_inputs(seed, Shape(N=2, D=6, H=1, HV=2, K=8, V=8), kind="mixed")
    _, snaps = gl.verify(**x, record="snapshots", backend="reference")
    _, tape = gl.verify(**x, record="tuples", backend="reference")
    assert_bitwise_equal(snaps.states, viz.replay_states(x["state0"], tape, "rule"))
    assert_bitwise_differs(snaps.states, viz.replay_states(x["state0"], tape, "twice_rounded"), "the control")
    drift = viz.drift_along_chain(x["state0"], tape, snaps.states, ("rule", "twice_rounded"))
    assert not drift["rule"]["max_ulp"].any() and drift["rule"]["max_ulp"].shape == (6,)
    assert drift["twice_rounded"]["fraction"].max() > 0
    with pytest.raises(ValueError, match=r"unknown form 'fused'; known forms: rule, naive"):
        viz.replay_states(x["state0"], tape, "fused")


def test_ulp_histogram_bins():
    labels, counts = viz.ulp_histogram([0, 0, 1, 2, 3, 4, 5, 8, 9, 1000])
    assert labels[:6] == ["0", "1", "2", "3-4", "5-8", "9-16"] and labels[-1] == "513-1024"
    assert list(counts[:6]) == [2, 1, 1, 2, 2, 1] and counts[-1] == 1 and counts.sum() == 10


@pytest.mark.skipif(not ON_CPU, reason="the expected verdicts are XLA:CPU's (a GPU's are recorded by the notebook)")
def test_platform_probe_and_script(tmp_path):
    """``python -m gdn_lossless_jax.tools.viz`` on the CPU: the probe's verdicts are what docs/rounding.md
    says of XLA:CPU, and the recorded exp bits are XLA:CPU's."""
    platform_facts = importlib.import_module("gdn_lossless_jax.tools.viz.__main__")
    assert platform_facts.main(["--out", str(tmp_path)]) == 0
    facts = json.loads((tmp_path / "platform.json").read_text())
    rows = {r["context"]: r for r in facts["rows"]}
    assert rows["eager (op by op)"]["S*alpha + k*u"] == viz.FORM_LABELS["twice_rounded"]
    for ctx in ("jax.jit", "lax.scan body under jit", "Pallas kernel (interpret mode)"):
        assert rows[ctx]["S*alpha + k*u"] == viz.FORM_LABELS["other_product"], ctx
        assert rows[ctx]["k*u + S*alpha"] == viz.FORM_LABELS["rule"], ctx
    assert all(r["subnormals"] == "flushed to zero" for r in facts["rows"])
    uses = {r["program"]: r["form"] for r in facts["two_uses"]}
    assert uses["verify: Sd = S*alpha; u = beta*(v - Sd@k); k*u + Sd"] == viz.FORM_LABELS["rule"]
    exp = np.load(tmp_path / "exp.npz")
    g = viz.exp_grid(facts["exp"]["points"])
    np.testing.assert_array_equal(exp["cpu"], bits(viz.exp_on(g)))
    np.testing.assert_array_equal(exp["cpu_xla"], bits(viz.exp_on(g, "cpu", library=False)))
    # The library's exp on the CPU is float64's, rounded once, except that XLA:CPU flushes the
    # subnormal results to zero; XLA:CPU's float32 exp differs elsewhere too.
    f64 = np.exp(g.astype(np.float64)).astype(np.float32)
    normal = f64 >= np.finfo(np.float32).tiny
    np.testing.assert_array_equal(exp["cpu"][normal], bits(f64[normal]))
    assert not exp["cpu"][~normal].any() and (~normal).any()
    assert np.mean(exp["cpu_xla"][normal] != exp["cpu"][normal]) > 0.01


def test_exp_on_names_missing_platforms():
    with pytest.raises(RuntimeError, match=r"no 'tpu' device here"):
        viz.exp_on(viz.exp_grid(8), "tpu")
    if not ON_CPU:
        with pytest.raises(RuntimeError, match=r"the library's exp runs on the default backend"):
            viz.exp_on(viz.exp_grid(8), "cpu")


def _kernel_result(date, configs=("2x2",), peer=True):
    rows = []
    for c in configs:
        for be in ("pallas", "sglang") if peer else ("pallas",):
            for op in ("verify", "commit", "net"):
                for rec in ("tuples", "snapshots") if be == "pallas" else ("snapshots",):
                    rows.append({"config": c, "backend": be, "op": op, "record": rec, "device_us": 10.0,
                                 "median_us": 12.0, "floor_us": 5.0})  # fmt: skip
    return {"meta": {"configs": list(configs), "device": "NVIDIA H200 (gpu)", "date": date, "command": "x"},
            "rows": rows, "copy": {"rate_gbps": 4000.0}}  # fmt: skip


def _step_result(date=None, device="NVIDIA H200"):
    kinds = (("pallas", "scan"), ("pallas", "pool-jit"), ("sglang", "step"))
    rows = [{"config": "2x2", "backend": be, "kind": k, "record": "tuples", "wall": {"n": 3, "median_us": 100.0},
             "device_us": 80.0} for be, k in kinds]  # fmt: skip
    env = {"device": device} | ({"date": date} if date else {})
    return {"command": "python -m benchmarks.step", "env": env, "rows": rows}


def test_results_finder(tmp_path):
    def put(rel, data):
        p = tmp_path / rel / "results.json"
        p.parent.mkdir(parents=True)
        p.write_text(json.dumps(data) if isinstance(data, dict) else data)
        return p

    put("h200-2026-11-30/bench", _kernel_result("2026-11-30T10:00:00+00:00"))
    newest_k = put("h200-2026-11-30b/bench", _kernel_result("2026-11-30T12:00:00+00:00"))
    put("h200-2026-12-01-step/first", _step_result())
    put("h200-2026-12-01-step/final-no-command-buffers", _step_result())
    newest_s = put("h200-2026-12-01-step/final", _step_result())
    put("h200-2026-11-29-step/final", _step_result("2026-12-02T00:00:00+00:00"))  # its own date wins
    put("tune/x", {"configs": []})  # not a benchmark result
    put("broken/x", "{not json")
    found = viz.find_results(tmp_path)
    assert len(found) == 6
    newest = viz.newest_results(tmp_path)
    assert newest["kernels"].path == newest_k
    assert newest["step"].path.parent.parent.name == "h200-2026-11-29-step"
    put("h200-2026-11-29-step/final-x", _step_result("2026-12-03T00:00:00+00:00", device="CPU"))
    assert viz.newest_results(tmp_path, device="H200")["step"].path.parent.parent.name == "h200-2026-11-29-step"
    assert viz.newest_results(tmp_path)["step"].path.parent.name == "final-x"
    # Among results of one day without a time of their own, "final" is the newest.
    only_day = [r for r in found if r.path.parent.parent.name == "h200-2026-12-01-step"]
    assert only_day[-1].path == newest_s
    (newest_s.parent / "results.md").write_text("| a |\n")
    assert [r.markdown for r in viz.find_results(tmp_path) if r.path == newest_s] == ["| a |\n"]
    assert viz.newest_results(tmp_path / "none") == {}


def test_plots_draw_without_a_display(seed):
    S, alpha, k, u = viz.regime_inputs("normal", 500, seed)
    f = viz.evaluate_forms(S, alpha, k, u)
    figs = [viz.plot_ulp_histogram({n: ulp_distance(f["rule"], v) for n, v in f.items()})]
    drift = {"rule": {"max_ulp": np.zeros(3), "mean_ulp": np.zeros(3), "fraction": np.zeros(3)},
             "naive": {"max_ulp": np.array([0.0, 2, 9]), "mean_ulp": np.ones(3),
                       "fraction": np.full(3, 0.2)}}  # fmt: skip
    figs.append(viz.plot_drift(drift, title="t"))
    es = (-130, -60, 0)
    m = viz.disagreement_map("twice_rounded", s_exponents=es, u_exponents=es, samples=8, seed=seed)
    figs += [viz.plot_disagreement_map(m), viz.plot_disagreement_map(m, value="max_ulp")]
    figs.append(viz.plot_decay_sweep(viz.decay_sweep(neg_g=[1e-8, 1.0, 90.0], samples=16, seed=seed)))
    g = viz.exp_grid(256)
    figs.append(viz.plot_exp_differences(g, {"cpu": viz.exp_on(g)}, np.exp(g.astype(np.float64)).astype(np.float32)))
    geo = get_geometry("qwen3.6-35b-a3b")
    figs.append(viz.plot_scratch([geo, get_geometry("qwen3.8-27b")], values=[1, 4]))
    figs.append(viz.plot_scratch([geo], x="requests", values=[1, 8], state_dtype=jnp.bfloat16))
    figs.append(viz.plot_kv_budget(geo, drafts=4, requests=25, budgets_gib=[6.5, 20]))
    figs.append(viz.plot_kernels_vs_floor(_kernel_result("2026-11-30", configs=("2x2", "4x4"))))
    figs.append(viz.plot_step(_step_result()))
    for fig in figs:
        assert isinstance(fig, matplotlib.figure.Figure)
        assert any(ax.has_data() for ax in fig.axes), fig
    # Drawing into given axes: the figure they belong to comes back.
    fig, axes = plt.subplots(1, 2)
    assert viz.plot_drift(drift, axes=axes) is fig
    with pytest.raises(ValueError, match=r"argument 'axes' must hold 2 axes, got 1"):
        viz.plot_drift(drift, axes=axes[0])


def test_errors_name_the_argument(monkeypatch):
    with pytest.raises(ValueError, match=r"flat float32 arrays of one shape \[n\], got S \[3\], alpha \[2\]"):
        viz.evaluate_forms(np.ones(3), np.ones(2), np.ones(3), np.ones(3))
    with pytest.raises(ValueError, match=r"unknown form 'fused'"):
        viz.evaluate_forms(np.ones(3), np.ones(3), np.ones(3), np.ones(3), ["fused"])
    with pytest.raises(ValueError, match=r"unknown regime 'huge'; known regimes: normal, cancellation"):
        viz.regime_inputs("huge", 3)
    with pytest.raises(ValueError, match=r"argument 'x' must be 'drafts' or 'requests', got 'layers'"):
        viz.plot_scratch([get_geometry("qwen3.6-35b-a3b")], x="layers")
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)  # as if matplotlib were not installed
    with pytest.raises(ImportError, match=r"pip install 'gdn_lossless_jax\[notebooks\]'"):
        viz.plot_ulp_histogram({"a": np.zeros(3)})


def test_forms_are_the_library_forms():
    """viz evaluates controls.FORMS themselves (no copy of the rule)."""
    assert list(viz.FORM_LABELS) == list(controls.FORMS)
