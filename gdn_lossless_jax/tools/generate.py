"""``gdn-lossless generate`` and ``gdn-lossless demo --checkpoint``: a Hugging Face checkpoint
(:func:`gdn_lossless_jax.model.load_pretrained`) decoding greedily with speculation."""

from __future__ import annotations

import argparse
import time

__all__ = ["add_parser", "run", "demo_checkpoint"]


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
                               record=args.record, return_info=True)  # fmt: skip
    dt = time.perf_counter() - t0
    T = len(args.prompt_ids[0])
    for row in ids:
        print(",".join(str(int(t)) for t in row[T:]))
    mean = info.accepted / max(info.steps * len(ids), 1)
    print(f"{info.steps} steps in {dt:.2f} s (compile included), mean accepted {mean:.2f} of D={args.drafts if args.record else 1}, "
          f"record {args.record or 'none'}", flush=True)  # fmt: skip
    return 0


def add_demo_options(d: argparse.ArgumentParser) -> None:
    d.add_argument("--checkpoint", default=None,
                   help="decode a Hugging Face checkpoint folder instead of the random model (qwen3_next, qwen3_5, "
                        "qwen3_5_moe): random prompts, both record modes, the same verdict")  # fmt: skip


def demo_checkpoint(args: argparse.Namespace) -> int:
    """``demo --checkpoint``: random prompts through the checkpoint once per record mode; the verdict
    is 'identical' when both modes gave the same tokens and the same final states bit for bit."""
    import jax
    import numpy as np

    from ..model import load_pretrained
    from ..testing import compare_bitwise

    model = load_pretrained(args.checkpoint, backend=args.backend)
    c = model.config
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(0, c.vocab, (args.prompts, args.prompt_len))
    print(f"gdn-lossless demo: {c.describe()}")
    print(f"{args.prompts} prompts of {args.prompt_len} tokens, {args.tokens} generated each; D={args.drafts}, "
          f"backend {args.backend} ({jax.default_backend()})", flush=True)  # fmt: skip
    results = {}
    for mode in args.record:
        model.generate(prompts[:, :1], 1, drafts=args.drafts, record=mode)  # compile outside the timing (B=1)
        t0 = time.perf_counter()
        ids, info = model.generate(prompts, args.tokens, drafts=args.drafts, record=mode, return_info=True)
        dt = time.perf_counter() - t0
        results[mode] = (ids, info.states())
        n = args.prompts * args.tokens
        print(f"{mode:<10} {n:,} tokens in {dt:.2f} s: {n / dt:,.1f} tokens/s (compile included for this batch); "
              f"{info.steps} steps, mean accepted length {info.accepted / (info.steps * args.prompts):.2f} of "
              f"D={args.drafts}", flush=True)  # fmt: skip
    if len(results) < 2:
        print("verdict    one record mode run: nothing to compare")
        return 0
    (ma, (ta, sa)), (mb, (tb, sb)) = list(results.items())[:2]
    same_tokens = np.array_equal(ta, tb)
    rep = compare_bitwise(sa, sb)
    print(f"tokens     {ma} vs {mb}: {int((ta == tb).sum()):,} of {ta.size:,} ids equal")
    print(f"states     {ma} vs {mb}, final SSM, conv and KV states: {'bit-identical' if rep.equal else rep}")
    ok = same_tokens and rep.equal
    print(f"verdict    {'identical' if ok else 'DIFFERENT'}")
    return 0 if ok else 1
