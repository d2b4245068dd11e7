"""Decode a Hugging Face checkpoint folder with speculation in each record mode; time it and check that tuples and snapshots agree.

    python scripts/checkpoint_run.py CHECKPOINT --out result.json [--prompts 8 --prompt-len 32 --tokens 128
        --drafts 4 --steps-per-call 8 --records tuples,snapshots,none --dtype bfloat16]

Loads the folder with ``load_pretrained(dtype=...)`` (bf16 by default), draws random prompts (ids in
[0, vocab), ``--seed``) and decodes them with ``PretrainedModel.generate`` once per record mode:
``tuples`` and ``snapshots`` (speculative: D inputs a step, the checkpoint's MTP block drafting) and
``none`` (plain greedy decoding, one token a step). Each mode runs the identical call twice: the first
compiles (``warmup_s``), the second is timed (``wall_s``, ``tokens_per_s``: new tokens over that
wall-clock; ``generate`` returns host arrays, so the time includes the device work). ``--repeats n``
times n runs and reports the fastest (all of them in ``wall_s_all``).

Checks (exit status 1 if one fails): each mode's timed runs give its warm-up's tokens (the device
work is deterministic), and tuples and snapshots give the same tokens and bit-identical final states
(SSM, conv, KV, the MTP block's hidden states; ``gdn_lossless_jax.testing.compare_bitwise``).

Speculative against plain greedy decoding (``none``) is measured, not checked: at a near-tie the
D-input verify and the one-input decode may round to other tokens (bf16 matmuls of another shape sum in
another order), and on a GPU they do. ``divergence`` gives, per speculative mode, the new tokens equal
to ``none``'s, the first divergence (request, position, both tokens, the target's top-2 logit gap there
in each mode) and, per differing row, its first difference; ``gap_quantiles`` gives each mode's gaps
over all generated tokens (min, 1st and 10th percentile, median): a divergence at a gap in the lowest
tail points at rounding, one at a typical gap at a bug.

The result (``--out``, JSON): ``meta`` (command, device, jax version, backend, the checkpoint, its
geometry, parameters and bytes, load time), ``rows`` (per mode: tokens/s, wall-clock, warm-up, steps
(batch-wide), ``accepted`` (inputs accepted, summed over steps and rows, the prompt's chunks included),
``mean_accepted`` (that per step and row: D at most, 1 without speculation)), ``ratios``, ``checks``,
``mismatches`` (what a failed check saw), ``divergence``, ``gap_quantiles``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's package when run as a script

import numpy as np

RECORDS = ("tuples", "snapshots", "none")


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="the checkpoint folder (config.json, *.safetensors)")
    ap.add_argument("--out", required=True, help="the result's JSON file")
    ap.add_argument("--prompts", type=int, default=8, help="prompts, decoded as one batch (default 8)")
    ap.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt (default 32)")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    ap.add_argument("--drafts", "-D", type=int, default=4, help="D, inputs verified a step (default 4)")
    ap.add_argument("--steps-per-call", type=int, default=None,
                    help="steps per jitted call, the device loop when > 1 (default 8 on a GPU, 1 elsewhere)")
    ap.add_argument("--records", default=",".join(RECORDS), help="record modes, of tuples,snapshots,none (all)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="compute dtype (bfloat16)")
    ap.add_argument("--backend", default="auto", help="the library's backend (auto)")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per mode after the warm-up (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.records = [r for r in args.records.split(",") if r]
    bad = [r for r in args.records if r not in RECORDS]
    if bad or not args.records:
        ap.error(f"--records: each must be one of {','.join(RECORDS)}, got {args.records}")
    if min(args.prompts, args.prompt_len, args.tokens, args.drafts, args.repeats) < 1:
        ap.error("--prompts, --prompt-len, --tokens, --drafts and --repeats must be positive")
    return args


def _first_differences(a: np.ndarray, b: np.ndarray, gaps_a: np.ndarray, gaps_b: np.ndarray, T: int) -> list[dict]:
    """Per differing row: the first differing new token and both modes' top-2 gaps there."""
    out = []
    for r in range(a.shape[0]):
        diff = np.flatnonzero(a[r] != b[r])
        if diff.size:
            j = int(diff[0]) - T
            out.append({"row": r, "position": j, "tokens": [int(a[r, T + j]), int(b[r, T + j])],
                        "gaps": [float(gaps_a[r, j]), float(gaps_b[r, j])]})  # fmt: skip
    return out


def _divergence(a: np.ndarray, b: np.ndarray, gaps_a: np.ndarray, gaps_b: np.ndarray, T: int) -> dict:
    """A measurement of two modes' new tokens: how many are equal, the first divergence (the first request
    that differs: its position, both tokens, both top-2 gaps) and each differing row's first difference."""
    rows = _first_differences(a, b, gaps_a, gaps_b, T)
    first = None if not rows else {"request": rows[0]["row"], **{k: rows[0][k] for k in ("position", "tokens", "gaps")}}
    return {"tokens_equal": int((a[:, T:] == b[:, T:]).sum()), "tokens": int(a[:, T:].size), "first": first,
            "rows": rows}  # fmt: skip


def main(argv=None) -> int:
    args = _parse(argv)
    import jax

    from gdn_lossless_jax.model import load_pretrained
    from gdn_lossless_jax.testing import compare_bitwise

    gpu = jax.default_backend() == "gpu"
    K = args.steps_per_call if args.steps_per_call is not None else (8 if gpu else 1)
    t0 = time.perf_counter()
    model = load_pretrained(args.checkpoint, args.dtype, backend=args.backend)
    jax.block_until_ready(model.params)
    load_s = time.perf_counter() - t0
    c = model.config
    n_params = sum(int(x.size) for x in jax.tree.leaves(model.params))
    n_bytes = sum(int(x.nbytes) for x in jax.tree.leaves(model.params))
    device = f"{jax.devices()[0].device_kind} ({jax.default_backend()})"
    print(f"checkpoint_run: {c.describe()}", flush=True)
    print(f"  {n_params:,} parameters, {n_bytes / 1e9:.2f} GB on {device}, loaded in {load_s:.1f} s; "
          f"{args.prompts} prompts x {args.prompt_len} tokens, {args.tokens} new, D={args.drafts}, K={K}", flush=True)
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(0, c.vocab, (args.prompts, args.prompt_len)).astype(np.int32)
    rows, tokens, states, gaps, repeatable = [], {}, {}, {}, {}
    for rec in args.records:
        record = None if rec == "none" else rec
        D = args.drafts if record else 1

        def run():
            t = time.perf_counter()
            out = model.generate(prompts, args.tokens, drafts=args.drafts, record=record, steps_per_call=K,
                                 return_info=True)  # fmt: skip
            jax.block_until_ready(out[1].state)
            return out, time.perf_counter() - t

        (first_ids, _), warm = run()
        walls, result, repeats = [], None, True
        for _ in range(args.repeats):
            out, wall = run()
            walls.append(wall)
            result = out
            repeats &= bool(np.array_equal(out[0], first_ids))
        ids, info = result
        repeatable[rec] = repeats
        wall = min(walls)
        new = args.prompts * args.tokens
        row = {
            "record": rec, "drafts": D, "steps_per_call": K, "batch": args.prompts, "prompt_len": args.prompt_len,
            "new_tokens": new, "tokens_per_s": new / wall, "wall_s": wall, "wall_s_all": walls, "warmup_s": warm,
            "steps": info.steps, "step_ms": wall / max(info.steps, 1) * 1e3, "accepted": info.accepted,
            "drafted": info.drafted, "mean_accepted": info.accepted / max(info.steps * args.prompts, 1),
        }  # fmt: skip
        rows.append(row)
        tokens[rec], states[rec], gaps[rec] = ids, info.states(), info.gaps
        print(f"  {rec:<10} {row['tokens_per_s']:>10,.1f} tokens/s ({new:,} in {wall:.3f} s, warm-up {warm:.1f} s); "
              f"{info.steps} steps, {row['step_ms']:.2f} ms/step, mean accepted {row['mean_accepted']:.2f} of "
              f"D={D}", flush=True)  # fmt: skip
    checks, mismatches = {"each mode repeats its tokens (warm-up == timed runs)": all(repeatable.values())}, {}
    if not all(repeatable.values()):
        mismatches["each mode repeats its tokens (warm-up == timed runs)"] = repeatable
    if "tuples" in states and "snapshots" in states:
        key = "tokens tuples == snapshots"
        checks[key] = bool(np.array_equal(tokens["tuples"], tokens["snapshots"]))
        if not checks[key]:
            mismatches[key] = _first_differences(tokens["tuples"], tokens["snapshots"], gaps["tuples"],
                                                 gaps["snapshots"], args.prompt_len)  # fmt: skip
        rep = compare_bitwise(states["tuples"], states["snapshots"])
        checks["final states tuples == snapshots"] = rep.equal
        if not rep.equal:
            mismatches["final states tuples == snapshots"] = str(rep)
    # Speculative vs plain greedy decoding: measured, not checked (near-ties may round otherwise).
    divergence = {f"{rec} vs none": _divergence(tokens[rec], tokens["none"], gaps[rec], gaps["none"], args.prompt_len)
                  for rec in args.records if rec != "none" and "none" in tokens}  # fmt: skip
    diverged = any(d["first"] is not None for d in divergence.values())
    # Where tokens differ, how rare the gap at the difference is among all generated tokens' gaps.
    gap_quantiles = {rec: {q: float(np.quantile(g, p)) for q, p in (("min", 0.0), ("p01", 0.01), ("p10", 0.1),
                                                                     ("median", 0.5))}
                     for rec, g in gaps.items()} if mismatches or diverged else {}  # fmt: skip
    by = {r["record"]: r for r in rows}
    pairs = (("tuples", "snapshots"), ("tuples", "none"), ("snapshots", "none"))
    ratios = {f"{a}/{b}": by[a]["tokens_per_s"] / by[b]["tokens_per_s"] for a, b in pairs if a in by and b in by}
    geometry = {k: getattr(c, k) for k in (
        "model_type", "vocab", "d_model", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel",
        "attn_heads", "kv_heads", "attn_head_dim", "rotary_dim", "num_experts", "top_k", "moe_intermediate_size",
        "shared_expert_intermediate_size", "draft", "dtype")}  # fmt: skip
    geometry.update(layers=c.layers, gdn_layers=c.gdn_layers, attention_layers=c.kinds.count("attention"))
    result = {
        "meta": {
            "command": "python scripts/checkpoint_run.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "device": device, "jax": jax.__version__, "backend": args.backend,
            "checkpoint": os.path.abspath(args.checkpoint),
            "describe": c.describe(), "geometry": geometry, "parameters": n_params, "param_bytes": n_bytes,
            "load_s": load_s, "seed": args.seed,
        },
        "rows": rows, "ratios": ratios, "checks": checks, "mismatches": mismatches, "divergence": divergence,
        "gap_quantiles": gap_quantiles,
    }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if ratios:
        print("  ratios " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    for name, d in divergence.items():
        f = d["first"]
        print(f"  divergence {name}: {d['tokens_equal']:,} of {d['tokens']:,} new tokens equal"
              + ("" if f is None else f"; first at request {f['request']}, position {f['position']} (ids "
                 f"{f['tokens'][0]} vs {f['tokens'][1]}), top-2 logit gap there {f['gaps'][0]:.3g} / {f['gaps'][1]:.3g}"
                 f" ({len(d['rows'])} row(s) differ)")
              + " (measured, not checked)")  # fmt: skip
    if gap_quantiles:
        print("  gap quantiles " + "; ".join(f"{rec}: " + ", ".join(f"{q} {v:.3g}" for q, v in qs.items())
                                             for rec, qs in gap_quantiles.items()))  # fmt: skip
    print("  checks " + ", ".join(f"{k}: {'ok' if v else 'FAILED'}" for k, v in checks.items()))
    for k, v in mismatches.items():
        print(f"  mismatch {k}: {v}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
