"""Command-line tool: ``gdn-lossless`` / ``python -m gdn_lossless_jax``."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _check(args) -> int:
    import jax.numpy as jnp

    from .check import format_result, run_check
    from .config import get_geometry
    from .memory import scratch_bytes

    full = get_geometry(args.model)
    geom = full.reduced(gdn_layers=args.layers, heads_divisor=args.heads_divisor, head_dim=args.head_dim)
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.state_dtype]
    print(f"gdn-lossless check: {full.name} at reduced size", flush=True)
    result = run_check(
        geom,
        requests=args.requests,
        drafts=args.drafts,
        state_dtype=dtype,
        kind=args.kind,
        seed=args.seed,
        backend=args.backend,
    )
    print(format_result(result))
    per_step_snap = scratch_bytes(full, 1, "snapshots", state_dtype=dtype)
    per_step_tup = scratch_bytes(full, 1, "tuples")
    print(
        f"full size     {full.name}, per request and draft step: snapshots {per_step_snap / 2**20:.2f} MiB, "
        f"tuples {per_step_tup / 2**20:.3f} MiB ({per_step_snap / per_step_tup:.1f}x smaller)"
    )
    return 0 if result.ok else 1


def _memory(args) -> int:
    import jax.numpy as jnp

    from .config import get_geometry
    from .memory import GIB, format_report, format_seed_table, memory_report

    if args.budget is not None and args.budget < 0:
        raise ValueError(f"--budget must be a non-negative number of GiB, got {args.budget}")
    report = memory_report(
        get_geometry(args.model),
        drafts=args.drafts,
        requests=args.requests,
        state_dtype=jnp.dtype(args.state_dtype),
        conv_dtype=jnp.dtype(args.conv_dtype),
        kv_dtype=jnp.dtype(args.kv_dtype),
        budget=None if args.budget is None else round(args.budget * GIB),
    )
    print(format_report(report))
    if args.seed_table:
        print()
        print(format_seed_table())
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .cases import KINDS
    from .config import MODELS

    p = argparse.ArgumentParser(prog="gdn-lossless", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser(
        "check",
        help="verify + commit in both record modes; report bit-exactness, naive-form drift and scratch bytes",
        description="Run verify and commit in both record modes on a named model geometry at reduced size and "
        "report whether every output and every pool slot matched bit for bit. Exit status 1 on any mismatch.",
    )
    c.add_argument("--model", default="qwen3.6-35b-a3b", help=f"model geometry ({', '.join(MODELS)})")
    c.add_argument("--layers", type=int, default=3, help="GDN layers to run (default 3)")
    c.add_argument("--heads-divisor", type=int, default=4, help="divide H and HV by this (default 4)")
    c.add_argument("--head-dim", type=int, default=64, help="K = V for the run (default 64)")
    c.add_argument("--requests", type=int, default=5, help="N requests (default 5)")
    c.add_argument("--drafts", type=int, default=4, help="D draft tokens (default 4)")
    c.add_argument("--state-dtype", choices=["float32", "bfloat16"], default="float32")
    c.add_argument("--kind", choices=KINDS, default="mixed", help="input kind (default mixed)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--backend", default="auto", help="auto, reference, pallas or triton")
    c.set_defaults(func=_check)

    m = sub.add_parser(
        "memory",
        help="speculative scratch per record mode for a model, D and requests, and the KV cache it could be",
        description="Print the speculative scratch of each record mode (snapshots, our tuples, the seed's ring) "
        "and the deduplicated conv windows for a named model, D draft tokens and R running requests (R + 1 "
        "scratch rows, as SGLang reserves), computed from the shapes the state pool allocates; the KV cache "
        "tokens the freed bytes hold; and, with --budget, the KV tokens left in a memory budget in each mode.",
    )
    m.add_argument("--model", default="qwen3.6-35b-a3b", help=f"model geometry ({', '.join(MODELS)})")
    m.add_argument("--drafts", "-D", type=int, default=4, help="D draft tokens per request (default 4)")
    m.add_argument("--requests", "-R", type=int, default=25, help="R running requests (default 25)")
    m.add_argument("--budget", type=float, default=None, metavar="GIB",
                   help="GiB for speculative scratch + conv windows + KV cache: report the KV tokens left per mode")
    m.add_argument("--state-dtype", choices=["float32", "bfloat16"], default="float32", help="SSM state dtype")
    m.add_argument("--conv-dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16", help="conv dtype")
    m.add_argument("--kv-dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16", help="KV cache dtype")
    m.add_argument("--seed-table", action="store_true",
                   help="also print the seed's table (SPEC section 6) recomputed, its printed GiB beside ours")
    m.set_defaults(func=_memory)

    from .fuzz import add_command as add_fuzz

    add_fuzz(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, KeyError, RuntimeError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"gdn-lossless {args.command}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
