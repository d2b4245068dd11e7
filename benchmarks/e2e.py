"""End to end: decoding tokens per second with the model, per record mode, as a user runs it.

``python -m benchmarks.e2e`` decodes the same prompts with the hybrid model
(:mod:`gdn_lossless_jax.model`) through :class:`~gdn_lossless_jax.model.Engine` with the
device loop (K steps per call, :class:`~gdn_lossless_jax.model.loop.DecodeLoop`), once per
record mode: ``tuples`` and ``snapshots`` (speculative, D inputs per step) and ``none``
(D = 1: plain greedy decoding, no speculation). Each row (``kind: "e2e"``):

  record, backend, batch, drafts, steps_per_call, size
  tokens_per_s        tokens generated / wall-clock of the timed run (compilation excluded)
  tokens_per_step     tokens a request gains per step (1 + accepted drafts): what acceptance
                      buys; tokens/s at another acceptance scales with it at the same step_ms
  mean_accepted       accepted drafts per step, of drafts - 1 proposed
  tokens_per_s_all_accepted    what the same steps would give if every draft were accepted
                      (batch x D tokens a step at step_ms): the bound a better draft approaches
  step_ms             wall-clock per step (batch-wide)
  host_fraction       share of the wall-clock the device had no work: on a GPU from a profiler
                      trace of a second run (1 - the union of the kernels' intervals / its
                      wall-clock), else None
  host_clock_fraction 1 - (time from each call's dispatch to its outputs on the host) /
                      wall-clock: the host's own work between calls, by the host's clock alone
                      (any platform; the device has nothing queued then)
  state_bytes, scratch_bytes   the pool's states (SSM + conv, its slots) and its scratch (tape
                      + conv windows), as allocated
  device_split_ms     on a GPU: device time per step by kernel family (``gdn``: the
                      library's kernels; ``matmul``; ``other``)

Fixed memory (``--budget-like snapshots:64``): the budget is what the snapshot path's state
plus scratch takes at batch 64; each record mode then runs at the largest batch whose state
plus scratch fits it (rows get ``budget_bytes``).

Checks in the result (the exit status: 1 if one fails): tuples and snapshots give the same tokens
and bit-identical final states. Speculative against plain greedy decoding (``none``) is a
measurement, not a check (``divergence``: per speculative mode, the tokens equal to ``none``'s, and
the first divergence: request, generated position, both tokens and both runs' top-2 logit gaps
there): at a near-tie the D-input verify and the 1-input decode may round to other tokens (on a GPU
they do; on the CPU the tests see none).

  python -m benchmarks.e2e --out /tmp/e2e                                   # CPU: tiny size
  python -m benchmarks.e2e --out $OUT/e2e --size deep --batch 25 --drafts 4 --steps-per-call 8
  python -m benchmarks.e2e --out $OUT/e2e-mem --size deep --drafts 4 --budget-like snapshots:64
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

RECORDS = ("tuples", "snapshots", "none")
MATMUL_HINTS = ("gemm", "nvjet", "cutlass", "xmma", "dot", "matmul", "cublas")


def _parse(argv=None) -> argparse.Namespace:
    from gdn_lossless_jax.model.model import SIZES

    p = argparse.ArgumentParser(prog="python -m benchmarks.e2e", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for results.json")
    p.add_argument("--size", choices=list(SIZES), default="tiny")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--drafts", type=int, default=4)
    p.add_argument("--steps-per-call", type=int, default=8)
    p.add_argument("--records", default=",".join(RECORDS))
    p.add_argument("--backend", default="auto")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    p.add_argument("--defer", choices=("auto", "on", "off"), default="auto",
                   help="the pool defers its commit into the next verify (auto: on a GPU)")
    p.add_argument("--budget-like", default=None, metavar="RECORD:BATCH",
                   help="fixed memory: the budget is RECORD's state + scratch at BATCH")
    p.add_argument("--draft-agreement", default=None, metavar="P[,P...]",
                   help="make the draft agree with the target on about P of drafted tokens (gdn_lossless_jax.model."
                        "agreement: the later blocks' output projections scaled, the scale calibrated on prompts of "
                        "their own); several values run one after the other on the same compiled steps")
    p.add_argument("--tokens-per-step", default=None, metavar="T[,T...]",
                   help="as --draft-agreement, calibrated on the tokens a decoding step gains at this run's drafts "
                        "(or tree), batch and steps per call: the unit trained drafts' acceptance is quoted in")
    p.add_argument("--residual-factor", default=None, metavar="F[,F...]",
                   help="the scale of the later blocks' output projections, as found by a calibration (skips it)")
    p.add_argument("--calibration-prompts", type=int, default=16)
    p.add_argument("--tree", default=None, metavar="B1,B2,...",
                   help="speculative records draft a tree of this branching per depth (e.g. 2,2,2: 14 nodes) "
                        "instead of a chain of --drafts")
    p.add_argument("--loop-graph", choices=("on", "off"), default="off",
                   help="the device loop and its body recorded as one CUDA graph (DecodeLoop.graph)")
    p.add_argument("--trace", choices=("auto", "on", "off"), default="auto",
                   help="profile a second run for host_fraction and the device split (auto: on a GPU)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def pool_bytes(config, batch: int, drafts: int, record: str, state_dtype="float32") -> tuple[int, int]:
    """``(state bytes, scratch bytes)`` of the engine's pool for ``batch`` rows (one slot each,
    no prefix cache), without allocating it."""
    from gdn_lossless_jax import pool as gpool

    g = config.geometry
    rows = gpool.scratch_rows(batch)
    state = sum(s.nbytes for s in gpool.state_specs(g, batch, state_dtype=state_dtype,
                                                   conv_dtype=config.jnp_dtype).values())  # fmt: skip
    tape = sum(s.nbytes for s in gpool.tape_specs(g, rows, drafts, record, state_dtype=state_dtype).values())
    return state, tape + gpool.conv_window_spec(g, rows, drafts, conv_dtype=config.jnp_dtype).nbytes


def _mode(record: str, drafts: int) -> tuple[str, int]:
    """The pool's record mode and D of a benchmark record (``none``: D = 1, a tuple tape)."""
    return ("tuples", 1) if record == "none" else (record, drafts)


def fit_batch(config, budget: int, drafts: int, record: str) -> int:
    """The largest batch whose state plus scratch fits ``budget`` bytes (0 if none)."""
    mode, D = _mode(record, drafts)
    lo = 0
    hi = 1
    while sum(pool_bytes(config, hi, D, mode)) <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if sum(pool_bytes(config, mid, D, mode)) <= budget else (lo, mid)
    return lo


def _family(name: str) -> str:
    from benchmarks.step import _ours

    return "gdn" if _ours(name) else "matmul" if any(h in name.lower() for h in MATMUL_HINTS) else "other"


def _split(kernels: dict[str, list[float]], steps: int) -> dict[str, float]:
    out = {"gdn": 0.0, "matmul": 0.0, "other": 0.0}
    for name, durs in kernels.items():
        out[_family(name)] += sum(durs) / 1e3 / steps
    return out


def _top_kernels(kernels: dict[str, list[float]], steps: int, n: int = 24) -> list[dict]:
    """The kernels that took the most device time: name, family, launches and ms a step."""
    rows = [{"name": name[:100], "family": _family(name), "launches_per_step": len(d) / steps,
             "ms_per_step": sum(d) / 1e3 / steps} for name, d in kernels.items()]  # fmt: skip
    return sorted(rows, key=lambda r: -r["ms_per_step"])[:n]


def run_record(config, params, prompts, *, record, batch, drafts, steps_per_call, backend, tokens, defer, trace,
               seed, tree=None, loop_graph=False) -> tuple[dict, list, tuple, list]:  # fmt: skip
    """One row: the timed run (and a traced one); returns ``(row, tokens, final states, gaps)``: per request its
    generated tokens and the target's top-2 logit gap at each (the gap of the logits that chose it)."""
    import jax

    from gdn_lossless_jax.model import Engine, Request

    from gdn_lossless_jax.model.treestep import tree_nodes

    mode, D = _mode(record, drafts)
    tree = None if record == "none" else tree
    if tree is not None:
        D = tree_nodes(tree)
    K = steps_per_call + (steps_per_call % 2 if defer else 0)
    max_len = max(len(p) for p in prompts) + tokens + D

    def engine():
        e = Engine(params, config, record=mode, drafts=D, max_batch=batch, max_len=max_len, backend=backend,
                   steps_per_call=K, defer_commit=defer, tree=tree, loop_graph=loop_graph)  # fmt: skip
        return e, e.warmup()

    reqs = [Request(p, tokens) for p in prompts]
    e, compile_s = engine()
    # An untimed run first, then the timed one on a fresh engine (the compiled programs cached): the warm-up
    # compiles the step, and a fresh compile's first run still spent 20-22% of its wall-clock on the host where a
    # cached one spent 3-4% (H100, deep 25x4: the none and snapshots rows of the first draft setting only).
    e.generate(reqs)
    jax.block_until_ready(e.state)
    del e
    e, _ = engine()
    t0 = time.perf_counter()
    results = e.generate(reqs)
    jax.block_until_ready(e.state)
    wall = time.perf_counter() - t0
    accepted = np.concatenate([r.accepted for r in results]) if D > 1 else np.zeros(1)
    gen = sum(len(r.tokens) for r in results)
    pool = e.state.pool
    row = {
        "kind": "e2e", "size": config.name, "record": record, "backend": backend, "batch": batch, "drafts": D,
        "tree": None if tree is None else list(tree),
        "steps_per_call": K, "defer_commit": defer, "loop_graph": loop_graph, "requests": len(prompts), "tokens": gen,
        "wall_s": wall,
        "compile_s": compile_s, "steps": e.steps, "tokens_per_s": gen / wall, "step_ms": wall / e.steps * 1e3,
        "mean_accepted": float(accepted.mean()), "tokens_per_step": float(1 + accepted.mean()),
        "tokens_per_s_all_accepted": batch * D / (wall / e.steps),
        "host_clock_fraction": max(0.0, 1 - e.step_seconds / wall),
        "state_bytes": int(pool.ssm.nbytes + pool.conv.nbytes),
        "scratch_bytes": int(pool.scratch_nbytes + pool.conv_windows.nbytes),
        "host_fraction": None, "device_split_ms": None, "device_kernels": None,
    }  # fmt: skip
    states = e.host_states()
    if trace:
        from benchmarks.devtime import busy_us, trace_kernels

        e2, _ = engine()
        spans: list = []
        box = {}

        def run():
            t = time.perf_counter()
            e2.generate(reqs)
            jax.block_until_ready(e2.state)
            box["wall"] = time.perf_counter() - t

        kernels = trace_kernels(run, 1, intervals=spans)
        if kernels:
            row["host_fraction"] = max(0.0, 1 - busy_us(spans) / 1e6 / box["wall"])
            row["device_split_ms"] = _split(kernels, e2.steps)
            row["device_kernels"] = _top_kernels(kernels, e2.steps)
    gaps = [[float(r.gaps[len(p) - 1 + j]) for j in range(len(r.tokens))] for p, r in zip(prompts, results)]
    return row, [r.tokens for r in results], states, gaps


def first_divergence(tokens_a: list, tokens_b: list, gaps_a: list, gaps_b: list) -> dict | None:
    """Where two runs' tokens first differ: the first request (in order) that differs, its first differing
    generated position, both tokens and both runs' top-2 logit gaps there; None if they are equal."""
    for i, (ta, tb) in enumerate(zip(tokens_a, tokens_b)):
        j = next((k for k, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        if j is not None:
            return {"request": i, "position": j, "tokens": [int(ta[j]), int(tb[j])],
                    "gaps": [gaps_a[i][j], gaps_b[i][j]]}  # fmt: skip
    return None


def divergence(tokens_a: list, tokens_b: list, gaps_a: list, gaps_b: list) -> dict:
    """A measurement of two runs' tokens: how many are equal (of how many) and the first divergence."""
    equal = sum(int(x == y) for ta, tb in zip(tokens_a, tokens_b) for x, y in zip(ta, tb))
    return {"tokens_equal": equal, "tokens": sum(len(t) for t in tokens_a),
            "first": first_divergence(tokens_a, tokens_b, gaps_a, gaps_b)}  # fmt: skip


def format_divergence(name: str, d: dict) -> str:
    """The printed line of a :func:`divergence`."""
    line = f"divergence {name}: {d['tokens_equal']:,} of {d['tokens']:,} tokens equal"
    f = d["first"]
    if f is not None:
        line += (f"; first at request {f['request']}, generated token {f['position']} (ids {f['tokens'][0]} vs "
                 f"{f['tokens'][1]}), top-2 logit gap there {f['gaps'][0]:.3g} / {f['gaps'][1]:.3g}")  # fmt: skip
    return line + " (measured, not checked)"


def _settings(args) -> list[tuple[str | None, float | None, float | None]]:
    """``(metric, value asked for, factor)`` per draft setting: the model as initialised, agreements
    or tokens per step to calibrate, or factors given."""
    if sum(bool(x) for x in (args.draft_agreement, args.tokens_per_step, args.residual_factor)) > 1:
        raise SystemExit("--draft-agreement, --tokens-per-step and --residual-factor: give one of them")

    def floats(text, name, ok, want):
        try:
            vals = [float(x) for x in text.split(",") if x.strip()]
        except ValueError:
            vals = None
        if not vals or not all(ok(v) for v in vals):
            raise SystemExit(f"{name}: expected {want}, got {text!r}")
        return vals

    if args.draft_agreement:
        return [("agreement", p, None) for p in floats(args.draft_agreement, "--draft-agreement",
                                                       lambda v: 0 < v < 1, "numbers in (0, 1), comma-separated")]
    if args.tokens_per_step:
        return [("tokens_per_step", t, None) for t in floats(args.tokens_per_step, "--tokens-per-step",
                                                             lambda v: v > 1, "numbers > 1, comma-separated")]
    if args.residual_factor:
        return [(None, None, f) for f in floats(args.residual_factor, "--residual-factor", lambda v: v >= 0,
                                                "numbers >= 0, comma-separated")]  # fmt: skip
    return [(None, None, None)]


def _tree(text):
    if not text:
        return None
    try:
        tree = tuple(int(x) for x in text.split(","))
    except ValueError:
        tree = ()
    if not tree or min(tree) < 1:
        raise SystemExit(f"--tree: expected positive branching factors, comma-separated (e.g. 2,2,2), got {text!r}")
    return tree


def main(argv=None) -> int:
    args = _parse(argv)
    if args.trace != "off":
        # The traced run must run as the timed one: XLA turns its command buffers (CUDA graphs) off under
        # the profiler unless told otherwise, and the launch gaps the trace measures would be another
        # program's. (Read when the backend starts: before anything here touches a device.)
        flag = "--xla_enable_command_buffers_during_profiling=true"
        if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    import jax

    from gdn_lossless_jax.model import agreement, get_config, init_params
    from gdn_lossless_jax.model.treestep import tree_nodes
    from gdn_lossless_jax.testing import compare_bitwise

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = get_config(args.size)
    gpu = jax.default_backend() == "gpu"
    defer = {"auto": gpu, "on": True, "off": False}[args.defer]
    trace = {"auto": gpu, "on": True, "off": False}[args.trace]
    records = [r for r in args.records.split(",") if r]
    bad = [r for r in records if r not in RECORDS]
    if bad:
        raise SystemExit(f"--records: each must be one of {RECORDS}, got {bad}")
    settings, tree = _settings(args), _tree(args.tree)
    drafts = tree_nodes(tree) if tree else args.drafts
    batches = {r: args.batch for r in records}
    budget = None
    if args.budget_like:
        rec, _, b = args.budget_like.partition(":")
        mode, D = _mode(rec, drafts)
        budget = sum(pool_bytes(config, int(b), D, mode))
        batches = {r: fit_batch(config, budget, drafts, r) for r in records}
    print(f"e2e: {config.describe()}; backend {args.backend} ({jax.default_backend()}), "
          + (f"tree {args.tree} ({drafts} inputs)" if tree else f"D={drafts}")
          + f", K={args.steps_per_call}, defer commit {defer}; batches {batches}"
          + (f"; budget {budget / 2**30:.2f} GiB ({args.budget_like})" if budget else ""), flush=True)  # fmt: skip
    t = time.perf_counter()
    params0 = init_params(config, args.seed)
    jax.block_until_ready(params0)
    print(f"parameters in {time.perf_counter() - t:.1f} s", flush=True)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, config.vocab, args.prompt_len).tolist() for _ in range(max(batches.values()))]
    rows, runs = [], []
    K = args.steps_per_call + (args.steps_per_call % 2 if defer else 0)
    for metric, asked, factor in settings:
        calibration = None
        if asked is not None:  # on prompts of their own (another seed)
            t = time.perf_counter()
            where = (dict(prompts=args.calibration_prompts) if metric == "agreement" else  # one draft a step
                     dict(prompts=batches.get("tuples", args.batch), drafts=args.drafts, tree=tree, steps_per_call=K,
                          defer_commit=defer, loop_graph=args.loop_graph == "on"))  # this run's step  # fmt: skip
            params, cal = agreement.calibrate(
                params0, config, asked, metric=metric, backend=args.backend, prompt_len=args.prompt_len,
                tokens=args.tokens, seed=args.seed + 1, log=lambda m: print(m, flush=True), **where)  # fmt: skip
            calibration, factor = {**cal.as_dict(), "seconds": time.perf_counter() - t}, cal.factor
        elif factor is not None:
            params = agreement.scale_residuals(params0, config, factor)
        else:
            params = params0
        setting = {"draft_agreement": asked if metric == "agreement" else None,
                   "tokens_per_step_asked": asked if metric == "tokens_per_step" else None,
                   "residual_factor": factor, "calibration": calibration}  # fmt: skip
        tokens, states, gaps, by = {}, {}, {}, {}
        for rec in records:
            row, toks, st, gp = run_record(
                config, params, prompts[: batches[rec]], record=rec, batch=batches[rec], drafts=args.drafts,
                steps_per_call=args.steps_per_call, backend=args.backend, tokens=args.tokens, defer=defer,
                trace=trace, seed=args.seed, tree=tree, loop_graph=args.loop_graph == "on",
            )  # fmt: skip
            row.update(setting)
            if budget:
                row["budget_bytes"] = budget
            rows.append(row)
            by[rec] = row
            tokens[rec], states[rec], gaps[rec] = toks, st, gp
            split = row.get("device_split_ms")
            print(f"{rec:<10} batch {row['batch']:>4}: {row['tokens_per_s']:>10,.1f} tokens/s, {row['step_ms']:.2f} "
                  f"ms/step, {row['tokens_per_step']:.2f} tokens/step, host {row['host_clock_fraction']:.1%} (clock)"
                  + ("" if row["host_fraction"] is None else f", GPU idle {row['host_fraction']:.1%} (trace)")
                  + ("" if split is None else ", device ms/step " + " ".join(f"{k} {v:.2f}" for k, v in split.items()))
                  + f"; state {row['state_bytes'] / 2**20:,.1f} MiB, scratch {row['scratch_bytes'] / 2**20:,.2f} MiB"
                  + ("" if factor is None else f"; {metric or 'factor given'} {asked or ''} factor {factor:.4g}"),
                  flush=True)  # fmt: skip
        # Checks: tuples and snapshots agree (tokens, final states bit for bit). Speculative vs plain greedy
        # decoding: measured (near-ties may round otherwise), not checked. Only at equal batches: at other
        # batches the rows' matmuls may round otherwise.
        checks, diverge = {}, {}
        if "tuples" in states and "snapshots" in states and batches["tuples"] == batches["snapshots"]:
            checks["tokens tuples == snapshots"] = tokens["tuples"] == tokens["snapshots"]
            checks["final states tuples == snapshots"] = compare_bitwise(states["tuples"], states["snapshots"]).equal
        for rec in records:
            if rec != "none" and "none" in tokens and batches[rec] == batches["none"]:
                diverge[f"{rec} vs none"] = divergence(tokens[rec], tokens["none"], gaps[rec], gaps["none"])
        ratios = {}
        for a, b in (("tuples", "snapshots"), ("tuples", "none"), ("snapshots", "none")):
            if a in by and b in by:
                ratios[f"{a}/{b}"] = by[a]["tokens_per_s"] / by[b]["tokens_per_s"]
        runs.append({**setting, "ratios": ratios, "checks": checks, "divergence": diverge})
        print("ratios " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
        for name, d in diverge.items():
            print(format_divergence(name, d))
        print("checks " + (", ".join(f"{k}: {'ok' if v else 'FAILED'}" for k, v in checks.items())
                           or "none (tuples and snapshots not both run at one batch)"), flush=True)  # fmt: skip
    result = {
        "meta": {"device": f"{jax.devices()[0].device_kind} ({jax.default_backend()})", "jax": jax.__version__,
                 "command": "python -m benchmarks.e2e " + " ".join(sys.argv[1:] if argv is None else argv),
                 "size": config.describe()},
        "rows": rows, "runs": runs,
        # the first setting's, as before several settings could run
        "ratios": runs[0]["ratios"], "checks": runs[0]["checks"], "divergence": runs[0]["divergence"],
    }  # fmt: skip
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0 if all(all(r["checks"].values()) for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
