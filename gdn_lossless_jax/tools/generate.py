"""``gdn-lossless generate`` and ``gdn-lossless demo --checkpoint``: a Hugging Face checkpoint
(:func:`gdn_lossless_jax.model.load_pretrained`) decoding greedily with speculation."""

from __future__ import annotations

import argparse
import time

from .options import positive_int

__all__ = ["add_parser", "run", "demo_checkpoint", "refuse_options"]


def _ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids like 1,2,3, got {text!r}") from e
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one token id")
    return ids


def _record(text: str):
    if text not in ("tuples", "snapshots", "none"):
        raise argparse.ArgumentTypeError(f"expected tuples, snapshots or none, got {text!r}")
    return None if text == "none" else text


def add_parser(subparsers) -> argparse.ArgumentParser:
    from ..backends import BACKENDS

    g = subparsers.add_parser(
        "generate",
        help="greedy decoding from a Hugging Face checkpoint (qwen3_next, qwen3_5, qwen3_5_moe)",
        description="Load a Hugging Face checkpoint folder (config.json, *.safetensors) and decode greedily from "
        "the given token ids with speculation (the checkpoint's MTP block, else a layer-skipping self-draft, "
        "proposes D-1 tokens; the GDN layers verify through the state pool). Prints the generated ids.",
    )
    g.add_argument("--checkpoint", required=True, help="the checkpoint folder")
    g.add_argument("--prompt-ids", type=_ids, required=True, action="append",
                   help="a prompt as comma-separated token ids (repeat for a batch of equal-length prompts)")
    g.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    g.add_argument("--drafts", "-D", type=int, default=4, help="D, inputs verified per step (default 4)")
    g.add_argument("--record", type=_record, default="tuples",
                   help="tuples (default), snapshots, or none (no speculation: one token a step)")
    g.add_argument("--steps-per-call", type=positive_int, default=1, metavar="K",
                   help="steps per jitted call: K > 1 runs the device loop (acceptance and the next inputs on the "
                        "device, tokens back every K steps; the same tokens for any K); default 1")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="compute dtype (default: the checkpoint's)")
    g.add_argument("--draft", choices=["auto", "mtp", "self"], default="auto",
                   help="the draft: the MTP block (auto: where the checkpoint has one) or the self-draft")
    g.add_argument("--backend", choices=["auto", *BACKENDS], default="auto", help="the library's backend")
    g.set_defaults(func=run)
    return g


def _load(args):
    from ..model import load_pretrained

    return load_pretrained(args.checkpoint, None if args.dtype == "auto" else args.dtype, draft=args.draft,
                           backend=args.backend)  # fmt: skip


def run(args: argparse.Namespace) -> int:
    import numpy as np

    if len({len(p) for p in args.prompt_ids}) != 1:
        raise ValueError(f"--prompt-ids: the prompts must have one length, got lengths {[len(p) for p in args.prompt_ids]}")
    model = _load(args)
    print(f"gdn-lossless generate: {model.config.describe()}", flush=True)
    t0 = time.perf_counter()
    ids, info = model.generate(np.array(args.prompt_ids), args.max_new_tokens, drafts=args.drafts,
                               record=args.record, steps_per_call=args.steps_per_call, return_info=True)  # fmt: skip
    dt = time.perf_counter() - t0
    T = len(args.prompt_ids[0])
    for row in ids:
        print(",".join(str(int(t)) for t in row[T:]))
    mean = info.accepted / max(info.steps * len(ids), 1)
    print(f"{info.steps} steps in {dt:.2f} s (compile included), mean accepted {mean:.2f} of D={args.drafts if args.record else 1}, "
          f"record {args.record or 'none'}, {args.steps_per_call} step(s) per call", flush=True)  # fmt: skip
    return 0


def add_demo_options(d: argparse.ArgumentParser) -> None:
    d.add_argument("--checkpoint", default=None,
                   help="decode a Hugging Face checkpoint folder instead of the random model (qwen3_next, qwen3_5, "
                        "qwen3_5_moe; with --family, a checkpoint of that family): random prompts once per record "
                        "mode, the same verdict; --steps-per-call and --batch apply, --size, --turns > 1, "
                        "--track-interval, --tree, --mesh and --defer on are refused")  # fmt: skip


def refuse_options(args: argparse.Namespace, where: str, decoder: str, size: str, more=()) -> None:
    """The demo's options that a checkpoint's decoder (``decoder``, named in the messages) cannot honour: a
    ValueError naming the first one given, prefixed ``where``. ``size``: why ``--size`` is left out; ``more``:
    further ``(option, given, value, expected)``."""
    tree, mesh = getattr(args, "tree", None), getattr(args, "mesh", None)
    refused = [
        ("--size", args.size is not None, args.size, f"left out ({size})"),
        ("--turns", args.turns not in (None, 1), args.turns,
         f"1 (each prompt is decoded once: {decoder} has no conversation and no prefix cache)"),
        ("--track-interval", args.track_interval not in (None, 0), args.track_interval,
         f"0 or left out ({decoder} has no prefix cache)"),
        ("--tree", tree is not None, ",".join(map(str, tree or ())),
         f"left out ({decoder} drafts a chain of --drafts inputs)"),
        ("--mesh", mesh is not None, "x".join(map(str, mesh or ())),
         "left out (a checkpoint decodes on one device)"),
        ("--defer", getattr(args, "defer", "auto") == "on", "on",
         f"auto or off ({decoder} commits in each step)"),
        *more,
    ]  # fmt: skip
    for option, given, value, expected in refused:
        if given:
            raise ValueError(f"{where}: argument {option} must be {expected}, got {value}")


def _refuse(args: argparse.Namespace) -> None:
    refuse_options(args, "demo --checkpoint", "PretrainedModel.generate", "the checkpoint's config.json gives the size")


def first_divergence(a, b, gaps_a, gaps_b) -> dict | None:
    """Where two runs' generated ids ``[B, new]`` first differ: the first row that differs, its first
    differing position, both ids and both runs' top-2 logit gaps there (``gaps_* [B, new]``); None if equal."""
    import numpy as np

    rows = np.flatnonzero((a != b).any(axis=1))
    if rows.size == 0:
        return None
    r = int(rows[0])
    j = int(np.flatnonzero(a[r] != b[r])[0])
    return {"request": r, "position": j, "tokens": [int(a[r, j]), int(b[r, j])],
            "gaps": [float(gaps_a[r, j]), float(gaps_b[r, j])]}  # fmt: skip


def demo_checkpoint(args: argparse.Namespace) -> int:
    """``demo --checkpoint``: random prompts through the checkpoint once per record mode (``none``: plain
    greedy decoding). The verdict, and the exit status, is whether tuples and snapshots gave the same tokens
    and the same final states bit for bit; speculative against plain greedy decoding is reported (generated
    ids equal, the first divergence and the top-2 logit gap there), not checked: at a near-tie the D-input
    verify and the one-input decode may round to other tokens."""
    import os

    import jax
    import numpy as np

    from ..model import load_pretrained
    from ..model.hf.config import FAMILY_TYPES, read_json
    from .demo import NONE, print_states, print_verdict

    _refuse(args)
    config = os.path.join(args.checkpoint, "config.json")
    content = read_json(config) if os.path.isfile(config) else None
    mt = content.get("model_type") if isinstance(content, dict) else None
    if mt in FAMILY_TYPES:
        raise ValueError(f"demo --checkpoint: argument --checkpoint: {args.checkpoint!r} is a {mt} checkpoint; "
                         f"decode it with --family {mt} --checkpoint {args.checkpoint}")  # fmt: skip
    if args.steps_per_call is None:
        args.steps_per_call = 8 if jax.default_backend() == "gpu" else 1
    if args.batch is None:
        args.batch = args.prompts
    for name in ("drafts", "prompts", "prompt_len", "tokens", "batch", "steps_per_call"):
        if getattr(args, name) < 1:
            raise ValueError(f"demo --checkpoint: argument --{name.replace('_', '-')} must be a positive integer, "
                             f"got {getattr(args, name)}")  # fmt: skip
    model = load_pretrained(args.checkpoint, backend=args.backend)
    c = model.config
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(0, c.vocab, (args.prompts, args.prompt_len))
    K, B, T = args.steps_per_call, min(args.batch, args.prompts), args.prompt_len
    chunks = [prompts[i : i + B] for i in range(0, args.prompts, B)]
    print(f"gdn-lossless demo: {c.describe()}")
    print(f"{args.prompts} prompts of {T} tokens, {args.tokens} generated each, {B} at a time; D={args.drafts}, "
          f"{K} step{'s' if K > 1 else ''} per call, backend {args.backend} ({jax.default_backend()})",
          flush=True)  # fmt: skip
    modes = list(dict.fromkeys(args.record))
    results = {}
    for mode in modes:
        record = None if mode == NONE else mode
        D = args.drafts if record else 1
        model.generate(prompts[:1, :1], 1, drafts=args.drafts, record=record, steps_per_call=K)  # compile (B=1)
        ids, gaps, states, steps, accepted, row_steps = [], [], [], 0, 0, 0
        t0 = time.perf_counter()
        for chunk in chunks:
            out, info = model.generate(chunk, args.tokens, drafts=args.drafts, record=record, steps_per_call=K,
                                       return_info=True)  # fmt: skip
            ids.append(out[:, T:])
            gaps.append(info.gaps)
            states.append(info.states())
            steps += info.steps
            accepted += info.accepted
            row_steps += info.steps * len(chunk)
        dt = time.perf_counter() - t0
        results[mode] = (np.concatenate(ids), np.concatenate(gaps), states)
        n = args.prompts * args.tokens
        print(f"{mode:<10} {n:,} tokens in {dt:.2f} s: {n / dt:,.1f} tokens/s (compile included for this batch); "
              f"{steps} steps, mean accepted length {accepted / max(row_steps, 1):.2f} of D={D}", flush=True)  # fmt: skip
    if len(results) < 2:
        print("verdict    one record mode run: nothing to compare")
        return 0
    order = sorted(results, key=lambda m: m == NONE)  # plain greedy decoding last: each pair reads spec vs none
    for i, a in enumerate(order):
        for b in order[i + 1 :]:
            (ta, ga, _), (tb, gb, _) = results[a], results[b]
            line = f"tokens     {a} vs {b}: {int((ta == tb).sum()):,} of {ta.size:,} generated ids equal"
            if b == NONE:
                line += " (speculative vs plain greedy decoding: measured, not checked)"
            div = first_divergence(ta, tb, ga, gb)
            if div is not None:
                line += (f"; first divergence: prompt {div['request']}, generated token {div['position']} (ids "
                         f"{div['tokens'][0]} vs {div['tokens'][1]}), top-2 logit gap there {div['gaps'][0]:.3g} "
                         f"({a}) / {div['gaps'][1]:.3g} ({b})")  # fmt: skip
            print(line)
    if "tuples" not in results or "snapshots" not in results:
        print("verdict    tuples and snapshots not both run: nothing checked")
        return 0
    (ta, _, sa), (tb, _, sb) = results["tuples"], results["snapshots"]
    same_states = print_states("tuples", "snapshots", sa, sb, "SSM, conv and KV states")
    return print_verdict(np.array_equal(ta, tb) and same_states,
                         "tuples and snapshots gave the same tokens and the same final states",
                         "tuples and snapshots gave other tokens or other final states")
