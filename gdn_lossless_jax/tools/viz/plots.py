"""The ``plot_*`` functions of :mod:`gdn_lossless_jax.tools.viz` (matplotlib imported when one is called)."""

from __future__ import annotations

from typing import Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from .. import memory
from ...config import Geometry
from ...testing import ulp_distance
from .forms import F32, ulp_histogram

__all__ = ["plot_ulp_histogram", "plot_drift", "plot_disagreement_map", "plot_decay_sweep", "plot_exp_differences",
           "plot_scratch", "plot_kv_budget", "plot_kernels_vs_floor", "plot_step"]


def _pyplot():
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - exercised by a test that hides matplotlib
        raise ImportError(
            "gdn_lossless_jax.viz needs matplotlib to plot: pip install 'gdn_lossless_jax[notebooks]' "
            "(the 'notebooks' extra), or pip install matplotlib"
        ) from e
    return plt


def _figure_and_axes(axes, n: int = 1, *, figsize=(6.4, 4.0)):
    """``(figure, [n axes])``: the axes given (one or a sequence of n), or a new row of n."""
    plt = _pyplot()
    if axes is None:
        fig, new = plt.subplots(1, n, figsize=(figsize[0] * n, figsize[1]), squeeze=False)
        return fig, list(new[0])
    axes = [axes] if not isinstance(axes, (list, tuple, np.ndarray)) else list(np.ravel(axes))
    if len(axes) != n:
        raise ValueError(f"argument 'axes' must hold {n} axes, got {len(axes)}")
    return axes[0].figure, axes


def _finish(axes, xlabel: str, *, legend: bool = True) -> None:
    for ax in axes:
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3, which="both")
        if legend:
            ax.legend(fontsize=8)


# ---------------------------------------------------------------------------------
# Plots.
# ---------------------------------------------------------------------------------
def plot_ulp_histogram(distances: Mapping[str, np.ndarray], *, ax=None, title: str | None = None):
    """Bars of ULP-distance counts per named array of distances (:func:`ulp_histogram` bins,
    the union of every array's bins), on a log scale."""
    fig, (ax,) = _figure_and_axes(ax)
    hists = {name: ulp_histogram(d) for name, d in distances.items()}
    labels = max((h[0] for h in hists.values()), key=len, default=["0"])
    width = 0.8 / max(len(hists), 1)
    for j, (name, (lab, counts)) in enumerate(hists.items()):
        c = np.zeros(len(labels))
        c[: len(counts)] = counts
        ax.bar(np.arange(len(labels)) - 0.4 + width * (j + 0.5), np.where(c > 0, c, np.nan), width, label=name)
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("ULP distance")
    ax.set_ylabel("elements")
    ax.legend(fontsize=8)
    ax.set_title(title or "ULP distance from the exact states")
    return fig


def plot_drift(drift: Mapping[str, Mapping[str, np.ndarray]], *, axes=None, title: str | None = None):
    """Two panels against the chain length: the largest ULP distance and the fraction of state
    elements that differ, one line per form (the output of :func:`drift_along_chain`)."""
    fig, (ax_max, ax_frac) = _figure_and_axes(axes, 2)
    for name, d in drift.items():
        steps = np.arange(1, len(d["max_ulp"]) + 1)
        ax_max.plot(steps, np.where(d["max_ulp"] > 0, d["max_ulp"], np.nan), label=name, marker=".", ms=3)
        ax_frac.plot(steps, 100 * d["fraction"], label=name, marker=".", ms=3)
    ax_max.set_yscale("log")
    ax_max.set_ylabel("largest ULP distance (none drawn: 0)")
    ax_frac.set_ylabel("% of state elements that differ")
    _finish((ax_max, ax_frac), "replayed steps")
    if title:
        fig.suptitle(title)
    return fig


def plot_disagreement_map(result: Mapping, *, ax=None, value: str = "fraction"):
    """A heat map of :func:`disagreement_map` (``value``: ``"fraction"``, ``"max_ulp"`` or
    ``"mean_ulp"``; ULP values on a log scale), the smallest normal float32 marked."""
    plt = _pyplot()
    from matplotlib.colors import LogNorm

    fig, (ax,) = _figure_and_axes(ax)
    data = np.asarray(result[value], np.float64)
    es, eu = result["s_exponents"], result["u_exponents"]
    step_s, step_u = (es[1] - es[0] if len(es) > 1 else 1), (eu[1] - eu[0] if len(eu) > 1 else 1)
    extent = (eu[0], eu[-1] + step_u, es[0], es[-1] + step_s)
    if value == "fraction":
        im = ax.imshow(100 * data, origin="lower", extent=extent, aspect="auto", cmap="magma", vmin=0)
        label = "% of samples that differ"
    else:
        masked = np.ma.masked_less_equal(data, 0)
        im = ax.imshow(masked, origin="lower", extent=extent, aspect="auto", cmap="magma",
                       norm=LogNorm(vmin=1, vmax=max(float(data.max()), 2)))  # fmt: skip
        label = value.replace("_", " ")
    plt.colorbar(im, ax=ax, label=label)
    for line in (ax.axhline, ax.axvline):
        line(-126, color="cyan", ls="--", lw=0.8)
    ax.set_xlabel("log2 |u|  (|k*u| is about 2**-3.5 of it)")
    ax.set_ylabel("log2 |S|  (dashed: smallest normal, 2**-126)")
    ax.set_title(f"{result['form']} vs {result['reference']}")
    return fig


def plot_decay_sweep(sweep: Mapping, *, axes=None):
    """Two panels against ``-g`` (log scale): the fraction of samples where each form
    differs from the reference, and the largest ULP distance (:func:`decay_sweep`)."""
    fig, (ax_f, ax_m) = _figure_and_axes(axes, 2)
    ng = sweep["neg_g"]
    for name in sweep["fraction"]:
        ax_f.plot(ng, 100 * sweep["fraction"][name], label=name)
        m = sweep["max_ulp"][name]
        ax_m.plot(ng, np.where(m > 0, m, np.nan), label=name)
    tiny = float(np.log(np.finfo(F32).tiny))  # where exp(g) leaves the normal range (-87.3)
    for ax in (ax_f, ax_m):
        ax.set_xscale("log")
        ax.axvline(6e-8, color="grey", ls=":", lw=1)
        ax.axvline(-tiny, color="grey", ls="--", lw=1)
    _finish((ax_f, ax_m), "-g  (decay alpha = exp(g))")
    ax_f.set_ylabel(f"% of samples that differ from {sweep['reference']}")
    ax_m.set_yscale("log")
    ax_m.set_ylabel("largest ULP distance")
    ax_f.set_title("dotted: exp(g) rounds to 1; dashed: exp(g) subnormal", fontsize=9)
    return fig


def plot_exp_differences(g, results: Mapping[str, np.ndarray], reference: np.ndarray, *, axes=None):
    """Where platforms' ``exp`` differ from a reference (e.g. float64 ``exp`` rounded to
    float32): the fraction of inputs that differ per decade of ``-g`` and the ULP histogram."""
    fig, (ax_w, ax_h) = _figure_and_axes(axes, 2)
    ng = -np.asarray(g, np.float64)
    decades = np.floor(np.log10(ng)).astype(int)
    dist = {name: ulp_distance(np.asarray(reference, F32), np.asarray(r, F32)) for name, r in results.items()}
    xs = np.unique(decades)
    for name, d in dist.items():
        ax_w.plot(10.0**xs, [100 * np.mean(d[decades == x] > 0) for x in xs], marker="o", label=name)
    plot_ulp_histogram(dist, ax=ax_h, title="ULP distance of exp")
    ax_w.set_xscale("log")
    ax_w.set_ylabel("% of exp(g) that differ")
    _finish((ax_w,), "-g (per decade)")
    return fig


def plot_scratch(
    geometries: Sequence[Geometry], *, x: str = "drafts", values: Sequence[int] = tuple(range(1, 17)),
    drafts: int = 4, requests: int = 25, records: Sequence[str] = ("snapshots", "seed_ring", "tuples"),
    state_dtype=jnp.float32, axes=None,
):  # fmt: skip
    """Speculative SSM scratch (GiB, log scale) of each record mode, one panel per model,
    against the draft tokens D (``x="drafts"``, at ``requests``) or the running requests
    (``x="requests"``, at ``drafts``), as :func:`gdn_lossless_jax.memory.scratch_bytes` counts it."""
    if x not in ("drafts", "requests"):
        raise ValueError(f"plot_scratch: argument 'x' must be 'drafts' or 'requests', got {x!r}")
    fig, axs = _figure_and_axes(axes, len(geometries), figsize=(4.8, 3.8))
    styles = {"snapshots": "-", "seed_ring": "--", "tuples": "-"}
    for ax, g in zip(axs, geometries):
        for rec in records:
            ys = [
                memory.scratch_bytes(g, v if x == "drafts" else drafts, rec, requests=requests if x == "drafts" else v,
                                     state_dtype=state_dtype) / memory.GIB  # fmt: skip
                for v in values
            ]
            ax.plot(values, ys, styles.get(rec, "-"), marker=".", label=rec)
        ax.set_yscale("log")
        if x == "requests":
            ax.set_xscale("log", base=2)
        ax.set_xlabel("draft tokens D" if x == "drafts" else "running requests")
        ax.set_ylabel("SSM scratch, GiB")
        ax.set_title(f"{g.name}\n({requests if x == 'drafts' else drafts} {'requests' if x == 'drafts' else 'drafts'})",
                     fontsize=9)  # fmt: skip
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_kv_budget(
    geometry: Geometry, *, drafts: int, requests: int, budgets_gib: Sequence[float] = tuple(range(8, 81, 4)), axes=None
):
    """KV-cache tokens left in a memory budget (scratch + conv windows + KV) with snapshots and
    with tuples, and the tokens gained, against the budget (:func:`memory.memory_report`)."""
    fig, (ax, ax_gain) = _figure_and_axes(axes, 2)
    snap, tup = [], []
    for b in budgets_gib:
        r = memory.memory_report(geometry, drafts=drafts, requests=requests, budget=int(b * memory.GIB))
        snap.append(r.budget_tokens("snapshots"))
        tup.append(r.budget_tokens("tuples"))
    ax.plot(budgets_gib, np.asarray(snap) / 1e6, marker=".", label="snapshots")
    ax.plot(budgets_gib, np.asarray(tup) / 1e6, marker=".", label="tuples")
    ax.set_ylabel("KV tokens that fit (millions)")
    snap, tup = np.asarray(snap), np.asarray(tup)
    gain = tup - snap
    # Where the snapshots leave no KV token at all the relative gain is unbounded: not drawn.
    pct = np.where(snap > 0, 100 * gain / np.maximum(snap, 1), np.nan)
    ax_gain.plot(budgets_gib, pct, marker=".", color="tab:green")
    ax_gain.set_yscale("log")
    ax_gain.set_ylabel("KV tokens gained with tuples, %")
    _finish((ax, ax_gain), "budget for scratch + conv windows + KV cache, GiB", legend=False)
    ax.legend(fontsize=8)
    ax.set_title(f"{geometry.name}: D={drafts}, {requests} requests", fontsize=9)
    ax_gain.set_title(f"+{gain[-1]:,} tokens at any budget that fits both", fontsize=9)
    fig.tight_layout()
    return fig


def plot_kernels_vs_floor(result: Mapping, *, time: str = "device_us", axes=None):
    """Kernel time against the byte floor per configuration, from a ``benchmarks.run`` result:
    one panel per work item (verify of one layer, commit of all layers, net per step), bars per
    backend and record mode, black ticks at the byte floor (bytes / measured copy rate).

    ``time``: ``"device_us"`` (the GPU's own kernel durations) or ``"median_us"`` (wall-clock).
    """
    ops = [("verify", "verify, one layer"), ("commit", "commit, all layers"), ("net", "net per step")]
    fig, axs = _figure_and_axes(axes, len(ops), figsize=(5.5, 4.2))
    meta = result["meta"]
    configs = list(meta["configs"])
    rows = [r for r in result["rows"] if r.get(time)]
    series = sorted({(r["backend"], r["record"]) for r in rows if r["op"] != "copy"},
                    key=lambda s: (s[0] == "sglang", s[0], s[1]))  # fmt: skip
    plt = _pyplot()
    colors = plt.get_cmap("tab10")
    width = 0.8 / max(len(series), 1)
    for ax, (op, title) in zip(axs, ops):
        for j, (be, rec) in enumerate(series):
            pts = [(i, r) for i, c in enumerate(configs) for r in rows
                   if (r["config"], r["backend"], r["op"], r["record"]) == (c, be, op, rec)]  # fmt: skip
            if not pts:
                continue
            xs = [i - 0.4 + width * (j + 0.5) for i, _ in pts]
            ax.bar(xs, [r[time] / 1e3 for _, r in pts], width, color=colors(j % 10),
                   hatch="//" if rec == "snapshots" else None, edgecolor="white", label=f"{be} {rec}")  # fmt: skip
            floors = [(x, r["floor_us"] / 1e3) for x, (_, r) in zip(xs, pts) if r.get("floor_us")]
            if floors:
                ax.scatter(*zip(*floors), marker="_", s=200, color="black", zorder=3)
        ax.set_xticks(range(len(configs)), configs)
        ax.set_xlabel("requests x drafts")
        ax.set_ylabel(f"ms ({'device time' if time == 'device_us' else 'wall-clock median'})")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axs[0].legend(fontsize=7)
    rate = (result.get("copy") or {}).get("rate_gbps")
    fig.suptitle(f"{meta.get('device', '?')}, {meta.get('date', '')[:10]}: black ticks = byte floor"
                 + (f" at {rate:.0f} GB/s" if rate else ""))  # fmt: skip
    return fig


def plot_step(result: Mapping, *, axes=None):
    """A ``benchmarks.step`` result: per configuration, wall-clock medians and device time of
    every step variant, SGLang's step as a dashed line."""
    rows = [r for r in result["rows"] if (r.get("wall") or {}).get("n")]
    # "25x4", or "25x4 kimi_linear" (another family's layers): by size, then family
    configs = sorted({r["config"] for r in rows}, key=lambda c: ([int(x) for x in c.split()[0].split("x")], c))
    per = max((sum(r["config"] == c for r in rows) for c in configs), default=1)
    fig, axs = _figure_and_axes(axes, max(len(configs), 1), figsize=(6.0, 1.5 + 0.28 * per))
    for ax, cfg in zip(axs, configs):
        rs = [r for r in rows if r["config"] == cfg]
        y = np.arange(len(rs))
        ax.barh(y + 0.2, [r["wall"]["median_us"] / 1e3 for r in rs], 0.4, label="wall-clock (median)")
        ax.barh(y - 0.2, [(r.get("device_us") or 0) / 1e3 for r in rs], 0.4, label="device time (all kernels)")
        peer = [r for r in rs if r["backend"] == "sglang"]
        if peer:
            ax.axvline(peer[0]["wall"]["median_us"] / 1e3, color="black", ls="--", lw=1, label="SGLang step (wall)")
        ax.set_yticks(y, [f"{r['backend']} {r['record'][:4]} {r['kind']}" for r in rs], fontsize=7)
        ax.invert_yaxis()  # the rows in the table's order, top down
        ax.set_xlabel("ms per speculative step (all layers)")
        ax.set_title(cfg)
        ax.grid(axis="x", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"speculative step, {(result.get('env') or {}).get('device', '?')}")
    fig.tight_layout()
    return fig
