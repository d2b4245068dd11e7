"""``gdn-lossless demo``: greedy speculative decoding on the hybrid model in both record modes.

Decodes a few random conversations (a later turn appends the answer and a new message, and
resumes from the prefix cache) with the layer-skipping self-draft, once with the pool in
each record mode, and prints tokens per second, the mean accepted length, the scratch memory of
each mode, and a verdict: ``identical`` when both modes gave the same tokens and the same
final states (SSM, conv and KV, bit for bit). Exit status 1 otherwise. With
``--tokens 10000`` it is the long-decode soak.
"""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["add_parser", "run"]

MODES = ("tuples", "snapshots")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``demo`` subcommand to an ``argparse`` subparsers object."""
    from ..backends import BACKENDS
    from .model import SIZES

    d = subparsers.add_parser(
        "demo",
        help="speculative decoding with a small hybrid GDN model in both record modes; tokens/s, acceptance, memory",
        description="Greedy speculative decoding with a small hybrid GDN model (random weights, Qwen3-Next style; "
        "a layer-skipping self-draft proposes D-1 tokens, the target verifies D inputs through the state pool). "
        "Runs the same prompts once per record mode and prints tokens per second, the mean accepted length, the "
        "scratch memory of each mode and a verdict: 'identical' when both modes gave the same tokens and the "
        "same final SSM, conv and KV states bit for bit (exit status 1 otherwise). Sizes: "
        + "; ".join(c.describe() for c in SIZES.values()),
    )
    d.add_argument("--size", choices=list(SIZES), default="tiny",
                   help="model size (default tiny; 'gpu' has H=16, HV=32, K=V=128)")
    d.add_argument("--drafts", "-D", type=int, default=4,
                   help="D, inputs verified per step: 1 given + D-1 drafted (default 4)")
    d.add_argument("--prompts", type=int, default=4, help="number of prompts (conversations; default 4)")
    d.add_argument("--prompt-len", type=int, default=16, help="new prompt tokens per turn (default 16)")
    d.add_argument("--tokens", type=int, default=200,
                   help="generated tokens per turn (default 200; 10000 for the soak)")
    d.add_argument("--turns", type=int, default=2,
                   help="turns per conversation: turn t+1 resumes from the prefix cache (default 2)")
    d.add_argument("--batch", type=int, default=2, help="batch rows: prompts join as others leave (default 2)")
    d.add_argument("--track-interval", type=int, default=64,
                   help="prefix-cache track interval in tokens (0: off; default 64)")
    d.add_argument("--backend", choices=["auto", *BACKENDS], default="auto",
                   help="the library's backend (default auto: pallas on a GPU, else reference)")
    d.add_argument("--record", choices=MODES, nargs="+", default=list(MODES), help="record modes to run (default both)")
    d.add_argument("--seed", type=int, default=0, help="seed of the weights and the prompts (default 0)")
    d.add_argument("--progress", choices=["auto", "on", "off"], default="auto",
                   help="progress bar on stderr (auto: when stderr is a terminal)")
    d.set_defaults(func=run)
    return d


def _mib(n: int) -> str:
    return f"{n / 2**20:.3f} MiB"


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit status (0: identical, 1: the modes differ)."""
    import jax
    import numpy as np
    from tqdm import tqdm

    from ..testing import compare_bitwise
    from .engine import Engine, Request
    from .model import get_config, init_params

    for name in ("drafts", "prompts", "prompt_len", "tokens", "turns", "batch"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.track_interval < 0:
        raise ValueError(f"--track-interval must be >= 0, got {args.track_interval}")
    config = get_config(args.size)
    params = init_params(config, args.seed)
    rng = np.random.default_rng(args.seed)
    # Turn 1 is a random prompt; each later turn appends the answer and a new random message.
    messages = [[rng.integers(0, config.vocab, args.prompt_len).tolist() for _ in range(args.prompts)]
                for _ in range(args.turns)]  # fmt: skip
    total = args.prompts * args.tokens * args.turns
    print(f"gdn-lossless demo: {config.describe()}")
    print(
        f"{args.prompts} conversations of {args.turns} turn(s): {args.prompt_len} new prompt tokens and "
        f"{args.tokens} generated tokens per turn; D={args.drafts}, batch {args.batch}, track interval "
        f"{args.track_interval}, backend {args.backend} ({jax.default_backend()})",
        flush=True,
    )
    disable = {"auto": None, "on": False, "off": True}[args.progress]
    outcome = {}
    for mode in args.record:
        engine = Engine(
            params, config, record=mode, drafts=args.drafts, max_batch=args.batch,
            max_len=args.turns * (args.prompt_len + args.tokens) + args.drafts, track_interval=args.track_interval,
            cache_entries=args.prompts + args.batch, backend=args.backend,
        )  # fmt: skip
        compile_s = engine.warmup()
        history = [[] for _ in range(args.prompts)]
        results = []
        with tqdm(total=total, desc=f"{mode:<10}", unit="tok", disable=disable, file=sys.stderr) as bar:
            t0 = time.perf_counter()
            for turn in range(args.turns):
                prompts = [h + m for h, m in zip(history, messages[turn])]
                done = engine.generate([Request(p, args.tokens) for p in prompts], on_step=bar.update)
                history = [p + r.tokens for p, r in zip(prompts, done)]
                results += done
            jax.block_until_ready(engine.state)
            wall = time.perf_counter() - t0
        accepted = np.concatenate([r.accepted for r in results])
        proposed = np.concatenate([r.proposed for r in results])
        pool = engine.state.pool
        windows = pool.conv_windows.nbytes
        resumed = [r.resumed for r in results if r.resumed]
        print(
            f"{mode:<10} {total} tokens in {wall:.2f} s: {total / wall:,.1f} tokens/s (compile {compile_s:.1f} s, "
            f"{engine.compiles} trace{'s' if engine.compiles != 1 else ''}); {engine.steps} steps, mean accepted "
            f"length {accepted.mean():.2f} of {proposed.mean():.2f} drafted ({(accepted + 1).mean():.2f} tokens per "
            f"step); scratch {_mib(pool.scratch_nbytes + windows)} (SSM tape {_mib(pool.scratch_nbytes)}, conv "
            f"windows {_mib(windows)}); prefix cache: {sum(len(r.tracked) for r in results)} states tracked, "
            f"{len(resumed)} of {args.prompts * (args.turns - 1)} later turns resumed "
            f"({sum(resumed):,} prompt tokens not recomputed)",
            flush=True,
        )
        states = jax.device_get((pool.ssm, pool.conv, engine.state.kv))
        outcome[mode] = ([r.tokens for r in results], states)
    if len(outcome) < 2:
        print("verdict    one record mode run: nothing to compare")
        return 0
    (ta, sa), (tb, sb) = outcome["tuples"], outcome["snapshots"]
    same = sum(int(np.sum(np.asarray(x) == np.asarray(y))) for x, y in zip(ta, tb))
    first = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
    print(f"tokens     tuples vs snapshots: {same:,} of {total:,} tokens equal"
          + ("" if first is None else f"; prompt {first} differs first"))
    report = compare_bitwise(sa, sb)
    print("states     tuples vs snapshots, final SSM, conv and KV states: "
          + ("bit-identical" if report.equal else f"DIFFER\n  {report}"))
    if same == total and report.equal:
        print("verdict    identical: both record modes gave the same tokens and the same final states")
        return 0
    print("verdict    DIFFERENT: the record modes disagree")
    return 1
