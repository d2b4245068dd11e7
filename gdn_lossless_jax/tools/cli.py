"""Command-line tool: ``gdn-lossless`` / ``python -m gdn_lossless_jax``."""

from __future__ import annotations

import argparse
import sys

from .options import model_name, non_negative_int, positive_gib, positive_int, tensor_sizes, tree_branching

__all__ = ["main", "build_parser", "positive_int", "non_negative_int", "positive_gib", "model_name", "tensor_sizes",
           "version_string"]


class _Parser(argparse.ArgumentParser):
    """Usage errors on one line (argparse prints the whole usage block first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def version_string() -> str:
    """``gdn-lossless <version> (jax <version>, jaxlib <version>)``, read from the installed metadata."""
    from importlib.metadata import PackageNotFoundError, version

    from .. import __version__

    def installed(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "not installed"

    return f"gdn-lossless {__version__} (jax {installed('jax')}, jaxlib {installed('jaxlib')})"


def _option_range(option: str, value: int, allowed, why: str) -> None:
    if value not in allowed:
        raise ValueError(f"argument {option}: must be {why}, got {value}")


def _check(args) -> int:
    import jax.numpy as jnp

    from .check import format_result, run_check
    from ..config import get_geometry
    from .memory import scratch_bytes

    full = get_geometry(args.model)
    # The reduced geometry keeps every option's meaning; values beyond the model are errors,
    # not silently clamped (a --layers of 99 would otherwise run the model's 30 layers).
    _option_range("--layers", args.layers, range(1, full.gdn_layers + 1),
                  f"from 1 to {full.gdn_layers} ({full.name} has {full.gdn_layers} GDN layers)")  # fmt: skip
    divisors = full.head_divisors()
    _option_range("--heads-divisor", args.heads_divisor, divisors,
                  f"a divisor of H={full.num_k_heads} ({', '.join(map(str, divisors))}), so that HV // H stays "
                  f"{full.num_v_heads // full.num_k_heads}")  # fmt: skip
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

    from ..config import FAMILY_MODELS, get_geometry
    from .memory import GIB, format_report, format_seed_table, format_tp_table, memory_report, tp_table

    if args.family is not None and (args.tp is not None or args.tree is not None or args.topk is not None
                                    or args.depth is not None or args.seed_table):  # fmt: skip
        raise ValueError("--family prints one report: --tp, --tree, --topk, --depth and --seed-table are Qwen's "
                         "GDN geometries' (--model)")  # fmt: skip
    if args.tree is not None or args.topk is not None or args.depth is not None:
        return _memory_tree(args)
    if args.tp is not None:
        slots = 2 * args.requests if args.slots is None else args.slots
        kw = dict(drafts=args.drafts, requests=args.requests, slots=slots, state_dtype=jnp.dtype(args.state_dtype),
                  conv_dtype=jnp.dtype(args.conv_dtype))  # fmt: skip
        print(format_tp_table(tp_table(None if args.model is None else [get_geometry(args.model)], args.tp, **kw), **kw))
        if args.seed_table:
            print()
            print(format_seed_table())
        return 0
    if args.family is not None and args.model is not None:
        raise ValueError("give --model or --family, not both")
    report = memory_report(
        FAMILY_MODELS[args.family] if args.family is not None else get_geometry(args.model or "qwen3.6-35b-a3b"),
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


def _memory_tree(args) -> int:
    import jax.numpy as jnp

    from .memory import format_report, format_tree_table, memory_report, tree_nodes, tree_table
    from ..config import get_geometry

    if args.tree is not None and (args.topk is not None or args.depth is not None):
        raise ValueError("give --tree, or --topk and --depth, not both")
    if args.tree is None and (args.topk is None or args.depth is None):
        raise ValueError("--topk and --depth go together (an EAGLE-style tree of topk nodes a depth)")
    if args.tree is not None:
        nodes, label = tree_nodes(args.tree), "[" + ",".join(map(str, args.tree)) + "] (branching per depth)"
    else:
        nodes = tree_nodes(topk=args.topk, depth=args.depth)
        label = f"top-{args.topk} depth-{args.depth} ({args.topk} nodes a depth, EAGLE-style)"
    kw = dict(state_dtype=jnp.dtype(args.state_dtype), conv_dtype=jnp.dtype(args.conv_dtype))
    models = None if args.model is None else [args.model]
    print(format_tree_table(tree_table(models, nodes=nodes, requests=args.requests, **kw), label))
    if args.model is not None:
        print()
        print(format_report(memory_report(get_geometry(args.model), drafts=nodes, requests=args.requests, **kw)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``gdn-lossless`` parser; subcommands share the option types above."""
    from ..backends import BACKENDS
    from ..testing.cases import KINDS
    from ..config import FAMILY_MODELS, MODELS

    p = _Parser(prog="gdn-lossless", description=__doc__)
    p.add_argument("--version", action="version", version=version_string())
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser(
        "check",
        help="verify + commit in both record modes; report bit-exactness, naive-form drift and scratch bytes",
        description="Run verify and commit in both record modes on a named model geometry at reduced size and "
        "report whether every output and every pool slot matched bit for bit. Exit status 1 on any mismatch, "
        "2 on a bad argument.",
    )
    c.add_argument("--model", type=model_name, default="qwen3.6-35b-a3b", help=f"model geometry ({', '.join(MODELS)})")
    c.add_argument("--layers", type=positive_int, default=3,
                   help="GDN layers to run, at most the model's (default 3)")
    c.add_argument("--heads-divisor", type=positive_int, default=4,
                   help="divide H and HV by this; it must divide H (default 4)")
    c.add_argument("--head-dim", type=positive_int, default=64, help="K = V for the run (default 64)")
    c.add_argument("--requests", type=positive_int, default=5, help="N requests (default 5)")
    c.add_argument("--drafts", type=positive_int, default=4, help="D draft tokens (default 4)")
    c.add_argument("--state-dtype", choices=["float32", "bfloat16"], default="float32")
    c.add_argument("--kind", choices=KINDS, default="mixed", help="input kind (default mixed)")
    c.add_argument("--seed", type=non_negative_int, default=0, help="seed of the inputs (default 0)")
    c.add_argument("--backend", choices=("auto", *BACKENDS), default="auto", help="backend (default auto)")
    c.set_defaults(func=_check)

    m = sub.add_parser(
        "memory",
        help="speculative scratch per record mode for a model, D and requests, and the KV cache it could be",
        description="Print the speculative scratch of each record mode (snapshots, our tuples, and the seed's "
        "ring: the (u, k, g) ring of SGLang's lossless-verify pull request, where this design started, which "
        "stores k once per v-head) and the deduplicated conv windows for a named model, "
        "D draft tokens and R running requests (R + 1 scratch rows, as SGLang reserves), computed from the "
        "shapes the state pool allocates; the KV cache tokens the freed bytes hold; and, with --budget, the KV "
        "tokens left in a memory budget in each mode.",
    )
    m.add_argument("--model", type=model_name, default=None,
                   help=f"model geometry ({', '.join(MODELS)}; default qwen3.6-35b-a3b, or all of them with --tp)")
    m.add_argument("--family", choices=sorted(FAMILY_MODELS), default=None,
                   help="another family's released model instead of --model: olmo_hybrid (Olmo-Hybrid-7B, GDN with "
                        "K=96, V=192) or kimi_linear (Kimi-Linear-48B-A3B, KDA: the tuples' g per key channel)")
    m.add_argument("--drafts", "-D", type=positive_int, default=4, help="D draft tokens per request (default 4)")
    m.add_argument("--requests", "-R", type=positive_int, default=25, help="R running requests (default 25)")
    m.add_argument("--budget", type=positive_gib, default=None, metavar="GIB",
                   help="GiB for speculative scratch + conv windows + KV cache: report the KV tokens left per mode")
    m.add_argument("--state-dtype", choices=["float32", "bfloat16"], default="float32", help="SSM state dtype")
    m.add_argument("--conv-dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16", help="conv dtype")
    m.add_argument("--kv-dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16", help="KV cache dtype")
    m.add_argument("--tp", type=tensor_sizes, nargs="?", const=(1, 2, 4, 8), default=None, metavar="SIZES",
                   help="print the pool and scratch bytes per device with the heads split over a tensor axis of these "
                        "sizes instead (N: the powers of two up to N; or a list like 1,2,4,8; alone: 1,2,4,8), for "
                        "--model or every named model")
    m.add_argument("--slots", type=positive_int, default=None,
                   help="mamba slots of the pool, for --tp (default 2 x requests: each request's own and a track slot)")
    m.add_argument("--tree", type=tree_branching, default=None, metavar="B1,B2,...",
                   help="a draft tree by its branching per depth (2,2,2: 2 + 4 + 8 = 14 nodes): print both modes' "
                        "scratch for it, one entry a node, for the seed's models (or --model)")
    m.add_argument("--topk", type=positive_int, default=None,
                   help="with --depth: an EAGLE-style tree of topk nodes at each depth (topk * depth nodes)")
    m.add_argument("--depth", type=positive_int, default=None, help="with --topk: the tree's depth")
    m.add_argument("--seed-table", action="store_true",
                   help="also print the seed's table (the three setups of SGLang's lossless-verify pull request) "
                        "recomputed from our shapes, the GiB it printed beside ours")
    m.set_defaults(func=_memory)

    from .demo import add_parser as add_demo

    add_demo(sub)

    from .generate import add_parser as add_generate

    add_generate(sub)

    from .fuzz import add_command as add_fuzz

    add_fuzz(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, KeyError, RuntimeError, OSError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"gdn-lossless {args.command}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
