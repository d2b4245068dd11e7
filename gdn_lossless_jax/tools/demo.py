"""``gdn-lossless demo``: greedy speculative decoding on the hybrid model in both record modes.

Decodes a few random conversations (a later turn appends the answer and a new message, and
resumes from the prefix cache) with the layer-skipping self-draft, once with the pool in
each record mode, and prints tokens per second, the mean accepted length, the scratch memory of
each mode, and a verdict: ``identical`` when both modes gave the same tokens and the same
final states (SSM, conv and KV, bit for bit). Exit status 1 otherwise. With
``--tokens 10000`` it is the long-decode soak.

``--mesh TPxDP`` decodes each record mode on a device mesh (the GDN heads with their q/k
groups over a tensor axis of size TP; DP must be 1) and once more on one device (tuples
mode); the verdict is then ``identical`` when every run gave the same tokens and the same
final states, the mesh's conv states read back in the usual channel order.

``--family olmo_hybrid|kimi_linear`` decodes an OLMo-Hybrid or Kimi Linear model instead
(:mod:`gdn_lossless_jax.tools.family_demo`), with the report pieces below (:func:`progress_bar`,
:func:`memory_text`, :func:`print_speeds`, :func:`print_tokens`, :func:`print_states`, :func:`print_verdict`).
"""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["add_parser", "mesh_plan", "run", "progress_bar", "memory_text", "print_speeds", "print_tokens",
           "print_states", "print_verdict"]

MODES = ("tuples", "snapshots")
NONE = "none"  # the run without speculation (D = 1): plain greedy decoding
ONE_DEVICE = "1 device"  # the label of the one-device run beside a mesh


def _name(device) -> str:
    return f"{device.platform}:{device.id}"


def _mesh_size(text: str) -> tuple[int, int]:
    try:
        tp, dp = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be TPxDP, tensor x data sizes (e.g. 2x1), got {text!r}") from None
    if tp < 1 or dp < 1:
        raise argparse.ArgumentTypeError(f"the sizes must be positive integers, got {text!r}")
    return tp, dp


def mesh_plan(tp: int, dp: int, config, devices=None):
    """The demo's :class:`~gdn_lossless_jax.sharding.MeshPlan` for ``--mesh TPxDP``: a mesh of
    axes ``("data", "tensor")`` (``Auto`` axis types) over the first ``tp * dp`` devices.

    Raises a ValueError naming ``--mesh`` when DP > 1 (the engine allocates slots and rows from
    one free list, not per data shard), when TP does not divide the model's H (with the sizes
    that fit), or when there are too few devices.

    >>> from gdn_lossless_jax.model import get_config
    >>> plan = mesh_plan(1, 1, get_config("tiny"))
    >>> plan.tp, plan.dp, plan.mesh.axis_names
    (1, 1, ('data', 'tensor'))
    >>> mesh_plan(4, 1, get_config("tiny"))
    Traceback (most recent call last):
    ...
    ValueError: --mesh 4x1 with --size tiny: H=2 q/k heads cannot be split ... tensor sizes that fit: 1, 2
    """
    import jax
    import numpy as np

    from .. import sharding

    devices = jax.devices() if devices is None else devices
    arg = f"--mesh {tp}x{dp}"
    if dp != 1:
        raise ValueError(
            f"{arg}: the demo splits heads only (DP must be 1, got {dp}); the data axis is exercised by "
            f"tests/test_sharding.py. Use --mesh {tp}x1"
        )
    H, HV = config.num_k_heads, config.num_v_heads
    sharding._check_heads_split(f"{arg} with --size {config.name}", H, HV, tp, "tensor")
    if tp * dp > len(devices):
        here = ", ".join(_name(d) for d in devices[:8]) + (", ..." if len(devices) > 8 else "")
        raise ValueError(
            f"{arg} needs {tp * dp} devices, {len(devices)} here ({here}); on a CPU, set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={tp * dp} before JAX starts"
        )
    mesh = jax.sharding.Mesh(np.array(devices[: tp * dp]).reshape(dp, tp), ("data", "tensor"))
    return sharding.MeshPlan(mesh, tensor="tensor", data="data")


def _branching(text: str) -> tuple[int, ...]:
    try:
        tree = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be children per depth, e.g. 2,2,2, got {text!r}") from None
    if not tree or min(tree) < 1:
        raise argparse.ArgumentTypeError(f"the children per depth must be positive integers, got {text!r}")
    return tree


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``demo`` subcommand to an ``argparse`` subparsers object."""
    from ..backends import BACKENDS
    from ..model.model import SIZES

    d = subparsers.add_parser(
        "demo",
        help="speculative decoding with a small hybrid GDN model in both record modes; tokens/s, acceptance, memory",
        description="Greedy speculative decoding with a small hybrid GDN model (random weights, Qwen3-Next style; "
        "a layer-skipping self-draft proposes D-1 tokens, the target verifies D inputs through the state pool). "
        "Runs the same prompts once per record mode and prints tokens per second, the mean accepted length, the "
        "scratch memory of each mode and a verdict: 'identical' when both modes gave the same tokens and the "
        "same final SSM, conv and KV states bit for bit (exit status 1 otherwise). Sizes: "
        + "; ".join(c.describe() for c in SIZES.values())
        + ". With --mesh TPxDP the record modes run on a device mesh (GDN heads over the tensor axis) and once more "
        "on one device, and 'identical' also means the mesh gave one device's tokens and states. With --family "
        "olmo_hybrid|kimi_linear an OLMo-Hybrid or Kimi Linear model (a tiny random one, or --checkpoint of that "
        "family) decodes in both record modes and by plain greedy decoding, and 'identical' means both modes gave "
        "greedy decoding's tokens and the same final SSM and conv states.",
    )
    d.add_argument("--size", choices=list(SIZES), default=None,
                   help="model size (default tiny; 'gpu' has H=16, HV=32, K=V=128); not with --checkpoint")
    d.add_argument("--drafts", "-D", type=int, default=4,
                   help="D, inputs verified per step: 1 given + D-1 drafted (default 4)")
    d.add_argument("--prompts", type=int, default=4, help="number of prompts (conversations; default 4)")
    d.add_argument("--prompt-len", type=int, default=16, help="new prompt tokens per turn (default 16)")
    d.add_argument("--tokens", type=int, default=200,
                   help="generated tokens per turn (default 200; 10000 for the soak)")
    d.add_argument("--turns", type=int, default=None,
                   help="turns per conversation: turn t+1 resumes from the prefix cache (default 2; with "
                        "--checkpoint only 1)")
    d.add_argument("--batch", type=int, default=None,
                   help="batch rows: prompts join as others leave (default 2); with --checkpoint, the prompts are "
                        "decoded --batch at a time (default: all in one batch)")
    d.add_argument("--track-interval", type=int, default=None,
                   help="prefix-cache track interval in tokens (0: off; default 64); not with --checkpoint")
    d.add_argument("--backend", choices=["auto", *BACKENDS], default="auto",
                   help="the library's backend (default auto: pallas on a GPU, else reference)")
    d.add_argument("--record", choices=[*MODES, NONE], nargs="+", default=None,
                   help="record modes to run (default both; not with --family, which runs all three); 'none' adds "
                        "a run without speculation (D = 1, plain greedy decoding): its tokens are compared with the "
                        "speculative runs' and reported, not part of the verdict (at a near-tie the D-input verify "
                        "and the 1-input decode may round to other tokens)")  # fmt: skip
    d.add_argument("--steps-per-call", type=int, default=None, metavar="K",
                   help="steps per call of the device: K > 1 runs drafting, verify, acceptance and the next inputs "
                        "on the device K steps at a time (the device loop; requests join and leave every K steps); "
                        "default 8 on a GPU, 1 (a step per call, the host deciding between steps) elsewhere")
    d.add_argument("--tree", type=_branching, default=None, metavar="K1,K2,...",
                   help="draft a tree instead of a chain: the draft's top K1 tokens after the given one, its top K2 "
                        "after each of those, ... (e.g. 2,2,2: 14 drafted nodes, D = 15); the longest root path the "
                        "target agrees with is committed. Greedy, one device; --drafts is then the node count")
    d.add_argument("--defer", choices=["auto", "on", "off"], default="auto",
                   help="commit into the next step's verify (the pool's defer_commit; with K > 1, K must be even); "
                        "auto: on a GPU without --mesh")
    agree = d.add_mutually_exclusive_group()
    agree.add_argument("--draft-agreement", type=float, default=None, metavar="P",
                       help="make the draft agree with the target on about P of drafted tokens (0 < P < 1): the "
                            "later blocks' output projections scaled by a factor calibrated on prompts of its own "
                            "(gdn_lossless_jax.model.agreement; docs/decoding.md)")
    agree.add_argument("--tokens-per-step", type=float, default=None, metavar="T",
                       help="as --draft-agreement, calibrated on the tokens a decoding step gains at this run's "
                            "drafts (T > 1)")
    d.add_argument("--seed", type=int, default=0, help="seed of the weights and the prompts (default 0)")
    d.add_argument("--progress", choices=["auto", "on", "off"], default="auto",
                   help="progress bar on stderr (auto: when stderr is a terminal)")
    fits = "; ".join(f"{n}: {', '.join(str(t) for t in range(1, c.num_k_heads + 1) if c.num_k_heads % t == 0)}"
                     for n, c in SIZES.items())  # fmt: skip
    d.add_argument("--mesh", type=_mesh_size, default=None, metavar="TPxDP",
                   help="decode each record mode on a mesh of TP x DP devices: the GDN heads with their q/k groups "
                        f"over a tensor axis of size TP (it must divide H; {fits}), DP "
                        "must be 1; plus one run on one device (tuples) that the verdict compares bit for bit "
                        "(default: one device). On a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N "
                        "simulates N devices")  # fmt: skip
    from .family_demo import add_family_options
    from .generate import add_demo_options

    add_demo_options(d)
    add_family_options(d)
    d.set_defaults(func=run)
    return d


def _mib(n: int) -> str:
    return f"{n / 2**20:.3f} MiB"


# The report's pieces, shared with the family demo (gdn_lossless_jax.tools.family_demo).
def progress_bar(setting: str, total: int, label: str):
    """The progress bar of one run on stderr (``--progress``: auto, when stderr is a terminal; on; off)."""
    from tqdm import tqdm

    disable = {"auto": None, "on": False, "off": True}[setting]
    return tqdm(total=total, desc=f"{label:<10}", unit="tok", disable=disable, file=sys.stderr)


def memory_text(state: int, tape: int, windows: int) -> str:
    """``state X MiB, scratch Y MiB (SSM tape ..., conv windows ...)``: a run's pool and its scratch."""
    return f"state {_mib(state)}, scratch {_mib(tape + windows)} (SSM tape {_mib(tape)}, conv windows {_mib(windows)})"


def print_speeds(speeds: dict[str, float]) -> None:
    """The ``speed`` line: the first run's tokens per second over each other run's."""
    if len(speeds) > 1:
        first = next(iter(speeds))
        print("speed      tokens/s, " + ", ".join(f"{first} / {label}: {speeds[first] / v:.2f}x"
                                                  for label, v in speeds.items() if label != first))  # fmt: skip


def print_tokens(label_a: str, label_b: str, ta, tb, total: int, note: str = "") -> bool:
    """The ``tokens`` line of two runs' token sequences (one per prompt): how many are equal and the first
    prompt that differs. Returns whether all ``total`` are equal."""
    import numpy as np

    same = sum(int(np.sum(np.asarray(x) == np.asarray(y))) for x, y in zip(ta, tb))
    first = next((i for i, (x, y) in enumerate(zip(ta, tb)) if not np.array_equal(x, y)), None)
    print(f"tokens     {label_a} vs {label_b}: {same:,} of {total:,} tokens equal"
          + ("" if first is None else f"; prompt {first} differs first") + note)  # fmt: skip
    return same == total


def print_states(label_a: str, label_b: str, sa, sb, what: str) -> bool:
    """The ``states`` line: two runs' final states (pytrees) compared bit for bit. Returns whether equal."""
    from ..testing import compare_bitwise

    report = compare_bitwise(sa, sb)
    print(f"states     {label_a} vs {label_b}, final {what}: "
          + ("bit-identical" if report.equal else f"DIFFER\n  {report}"))  # fmt: skip
    return report.equal


def print_verdict(equal: bool, identical: str, different: str) -> int:
    """The ``verdict`` line; returns the exit status (0: identical, 1: not)."""
    print(f"verdict    identical: {identical}" if equal else f"verdict    DIFFERENT: {different}")
    return 0 if equal else 1


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit status (0: identical, 1: the runs differ)."""
    if getattr(args, "family", None):
        from .family_demo import demo_family

        return demo_family(args)
    if getattr(args, "draft", None) is not None:
        raise ValueError(f"argument --draft {args.draft} goes with --family (the demo model drafts with its own "
                         f"layer-skipping draft)")  # fmt: skip
    if getattr(args, "record", None) is None:
        args.record = list(MODES)
    if getattr(args, "checkpoint", None):
        from .generate import demo_checkpoint

        return demo_checkpoint(args)
    for name, default in (("size", "tiny"), ("turns", 2), ("batch", 2), ("track_interval", 64)):
        if getattr(args, name, None) is None:
            setattr(args, name, default)
    import jax
    import numpy as np

    from ..model.engine import Engine, Request
    from ..model.model import get_config, init_params

    gpu = jax.default_backend() == "gpu"
    if getattr(args, "steps_per_call", None) is None:
        args.steps_per_call = 8 if gpu else 1
    for name in ("drafts", "prompts", "prompt_len", "tokens", "turns", "batch", "steps_per_call"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.track_interval < 0:
        raise ValueError(f"--track-interval must be >= 0, got {args.track_interval}")
    config = get_config(args.size)
    tree = getattr(args, "tree", None)
    if tree is not None:
        from ..model.treestep import tree_nodes

        args.drafts = tree_nodes(tree)
    plan = None if getattr(args, "mesh", None) is None else mesh_plan(*args.mesh, config)
    defer = {"auto": gpu and plan is None, "on": True, "off": False}[getattr(args, "defer", "auto")]
    if defer and args.steps_per_call > 1 and args.steps_per_call % 2:
        raise ValueError(f"--steps-per-call must be even when the commit is deferred (--defer), got {args.steps_per_call}")
    params = init_params(config, args.seed)
    asked = getattr(args, "draft_agreement", None), getattr(args, "tokens_per_step", None)
    if asked[0] is not None and not 0 < asked[0] < 1:
        raise ValueError(f"--draft-agreement must be in (0, 1), got {asked[0]}")
    if asked[1] is not None and not asked[1] > 1:
        raise ValueError(f"--tokens-per-step must be > 1, got {asked[1]}")
    if asked != (None, None):
        from ..model import agreement

        metric, target = ("agreement", asked[0]) if asked[0] is not None else ("tokens_per_step", asked[1])
        where = {} if metric == "agreement" else {"drafts": args.drafts if tree is None else 2, "tree": tree}
        params, cal = agreement.calibrate(params, config, target, metric=metric, backend=args.backend,
                                          prompt_len=args.prompt_len, seed=args.seed + 1, **where)  # fmt: skip
        print(f"draft: the later blocks' output projections scaled by {cal.factor:.4g} ({metric} {cal.measured:.3f} "
              f"measured on prompts of the calibration's own, {target} asked)")  # fmt: skip
    rng = np.random.default_rng(args.seed)
    # Turn 1 is a random prompt; each later turn appends the answer and a new random message.
    messages = [[rng.integers(0, config.vocab, args.prompt_len).tolist() for _ in range(args.prompts)]
                for _ in range(args.turns)]  # fmt: skip
    total = args.prompts * args.tokens * args.turns
    print(f"gdn-lossless demo: {config.describe()}")
    print(
        f"{args.prompts} conversations of {args.turns} turn(s): {args.prompt_len} new prompt tokens and "
        f"{args.tokens} generated tokens per turn; D={args.drafts}"
        + (f" (a tree {','.join(map(str, tree))}: the root and {args.drafts - 1} drafted nodes)" if tree else "")
        + f", batch {args.batch}, track interval "
        f"{args.track_interval}, backend {args.backend} ({jax.default_backend()}), {args.steps_per_call} step"
        f"{'s' if args.steps_per_call > 1 else ''} per call{', commit deferred into the next verify' if defer else ''}",
        flush=True,
    )
    if plan is not None:
        devices = list(plan.mesh.devices.flat)
        print(
            f"mesh {plan.tp}x{plan.dp} (tensor x data) over {len(devices)} device{'s' if len(devices) > 1 else ''}: "
            f"{', '.join(map(_name, devices))}; GDN heads H={config.num_k_heads} "
            f"HV={config.num_v_heads}, {config.num_k_heads // plan.tp} q/k head(s) with their v-heads per device; "
            f"the record modes run on the mesh, '{ONE_DEVICE}' (tuples) on {_name(devices[0])} alone",
            flush=True,
        )
    # (label, record mode, mesh): each record mode (on the mesh if any), then one device beside a mesh.
    runs = [(mode, mode, plan) for mode in args.record]
    if plan is not None:
        runs.append((ONE_DEVICE, "tuples", None))
    outcome, speeds = {}, {}
    for label, mode, mesh in runs:
        drafts = 1 if mode == NONE else args.drafts
        engine = Engine(
            params, config, record="tuples" if mode == NONE else mode, drafts=drafts, max_batch=args.batch,
            max_len=args.turns * (args.prompt_len + args.tokens) + args.drafts, track_interval=args.track_interval,
            cache_entries=args.prompts + args.batch, backend=args.backend, mesh=mesh,
            steps_per_call=args.steps_per_call, defer_commit=defer, tree=None if mode == NONE else tree,
        )  # fmt: skip
        compile_s = engine.warmup()
        history = [[] for _ in range(args.prompts)]
        results = []
        with progress_bar(args.progress, total, label) as bar:
            t0 = time.perf_counter()
            for turn in range(args.turns):
                prompts = [h + m for h, m in zip(history, messages[turn])]
                done = engine.generate([Request(p, args.tokens) for p in prompts], on_step=bar.update)
                history = [p + r.tokens for p, r in zip(prompts, done)]
                results += done
            jax.block_until_ready(engine.state)
            wall = time.perf_counter() - t0
        accepted = np.concatenate([r.accepted for r in results]) if drafts > 1 else np.zeros(1)
        proposed = np.concatenate([r.proposed for r in results]) if drafts > 1 else np.zeros(1)
        pool = engine.state.pool
        windows = pool.conv_windows.nbytes
        resumed = [r.resumed for r in results if r.resumed]
        print(
            f"{label:<10} {total} tokens in {wall:.2f} s: {total / wall:,.1f} tokens/s (compile {compile_s:.1f} s, "
            f"{engine.compiles} trace{'s' if engine.compiles != 1 else ''}); {engine.steps} steps of "
            f"{wall / engine.steps * 1e3:.2f} ms, mean accepted length {accepted.mean():.2f} of {proposed.mean():.2f} "
            f"drafted ({(accepted + 1).mean():.2f} tokens per step); host {max(0.0, 1 - engine.step_seconds / wall):.1%} "
            f"of the wall-clock between calls; "
            f"{memory_text(pool.ssm.nbytes + pool.conv.nbytes, pool.scratch_nbytes, windows)}; prefix cache: "
            f"{sum(len(r.tracked) for r in results)} states tracked, "
            f"{len(resumed)} of {args.prompts * (args.turns - 1)} later turns resumed "
            f"({sum(resumed):,} prompt tokens not recomputed)",
            flush=True,
        )
        outcome[label] = ([r.tokens for r in results], None if mode == NONE else engine.host_states())
        speeds[label] = total / wall
    if len(outcome) < 2:
        print("verdict    one record mode run: nothing to compare")
        return 0
    print_speeds(speeds)
    # Plain greedy decoding (none) last: its tokens against the first speculative run's are a measurement
    # (near-ties may round otherwise at D inputs than at 1), not part of the verdict.
    (first_label, (ta, sa)), *others = sorted(outcome.items(), key=lambda kv: kv[0] == NONE)
    equal = True
    for label, (tb, _) in others:
        measured = NONE in (label, first_label)
        same = print_tokens(first_label, label, ta, tb, total,
                            " (speculative vs plain greedy decoding: measured, not checked)" if measured else "")
        equal &= measured or same
    with_states = [(label, sb) for label, (_, sb) in outcome.items() if sb is not None]
    for label, sb in with_states[1:]:  # (none: no speculation, other positions in the state: not compared)
        equal &= print_states(with_states[0][0], label, with_states[0][1], sb, "SSM, conv and KV states")
    if len(with_states) < 2:
        print("verdict    one speculative run: nothing checked (plain greedy decoding is measured, not checked)")
        return 0
    if plan is None:
        return print_verdict(equal, "both record modes gave the same tokens and the same final states",
                             "the record modes disagree")
    where = f"{' and '.join(args.record)} on the {plan.tp}x{plan.dp} mesh and {ONE_DEVICE}"
    return print_verdict(equal, f"{where} gave the same tokens and the same final states", f"{where} disagree")
