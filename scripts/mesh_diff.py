"""Where the demo model's speculative step on a mesh first differs from one device.

Runs the same prompts through ``SpecStep`` on one device and on a ``TPxDP`` mesh (default 2x1:
the GDN heads over two devices; a data axis splits the batch rows, each row's slots and scratch
rows on its own shard) and compares every step's outputs bit for bit: first a *forced* phase
(every row is given all D inputs, so the draft proposes nothing and only the target's verify,
accept and commit run), then a *drafting* phase (one given input, D-1 drafted). A difference in
the forced phase is the target's; one that starts in the drafting phase with the draft chain
(``inputs``) is the draft's. Prints the first difference of each field and the final states'
comparison::

    python scripts/mesh_diff.py --size gpu --mesh 2x1 --steps 12
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python scripts/mesh_diff.py --size tiny --mesh 2x2 \\
        --rows 4 --prompt-lengths 9,1,14,5 --steps 2 --taps --hlo /tmp/hlo

``--taps`` bisects op by op: the model's functions (``matmul``, ``einsum``, the norms, the
softmax, the mixers, the MLP, the LM head, the GDN core) are wrapped so that each call hands its
operands and result to the host (``jax.debug.callback``, gathered from the mesh; conv channels
put back in the usual order), both runs are repeated, and every call whose operands are equal bit
for bit but whose result is not is an *origin* of the difference; the innermost origin that runs
first is the first diverging operation. (The taps add outputs to the program, so XLA may fuse it
otherwise: the script says whether the run with taps still differs.) ``--hlo DIR`` writes both
programs' compiled HLO (without taps; each tapped call is a ``jax.named_scope``, so its HLO
instructions carry its name) and prints the instructions of the first origin in each.
``--invariant on|off`` sets the model's invariant mode (``ModelConfig.invariant``) for both runs.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import os
import re

import jax
import numpy as np

from gdn_lossless_jax import sharding
from gdn_lossless_jax.model import SpecStep, allocate_state, get_config, init_params
from gdn_lossless_jax.model import decode as decode_mod
from gdn_lossless_jax.model import model as model_mod
from gdn_lossless_jax.model.decode import decode_steps, place_on_mesh, pool_from_mesh
from gdn_lossless_jax.testing import compare_bitwise

_SEEN: set = set()
FIELDS = ("inputs", "predictions", "accepted", "track_steps", "gaps")


def replicas(out, t):
    """Report (once per field) a step output whose copies on two devices hold different bits."""
    for f in FIELDS:
        x = getattr(out, f)
        shards = x.addressable_shards
        if len(shards) < 2 or f in _SEEN:
            continue
        index = [s.index for s in shards]
        groups = collections.defaultdict(list)
        for s in shards:
            groups[str(s.index)].append(np.asarray(s.data))
        if any(d.tobytes() != g[0].tobytes() for g in groups.values() for d in g[1:]):
            _SEEN.add(f)
            print(f"step {t}: copies of {f} on two devices differ ({len(set(map(str, index)))} distinct shards)")


def make_plan(tp: int, dp: int) -> sharding.MeshPlan:
    """A (data, tensor) mesh over the first ``tp * dp`` devices (Auto axes, as the tests')."""
    n = tp * dp
    if len(jax.devices()) < n:
        raise SystemExit(f"--mesh {tp}x{dp} needs {n} devices, {len(jax.devices())} here; on a CPU set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={n}")  # fmt: skip
    auto = jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((dp, tp), ("data", "tensor"), axis_types=(auto, auto), devices=jax.devices()[:n])
    return sharding.MeshPlan(mesh, tensor="tensor", data="data")


def layout(N: int, dp: int):
    """Each data shard's rows own their slots, track slots and scratch rows: ``(slots, track
    slots, rows, pool slots, pool requests)`` (global indices)."""
    if N % dp:
        raise SystemExit(f"--rows {N} must be a multiple of the data axis {dp}")
    n = N // dp
    shard, local = np.arange(N) // n, np.arange(N) % n
    per_slots, per_rows = 2 * n + 1, n + 1  # with each shard's share of the padding slot and row
    slots = (shard * per_slots + local).astype(np.int32)
    return slots, (slots + n).astype(np.int32), (shard * per_rows + local).astype(np.int32), \
        dp * per_slots - 1, dp * per_rows - 1  # fmt: skip


# ---------------------------------------------------------------------------------
# Taps: each wrapped call's operands and result, per run.
# ---------------------------------------------------------------------------------
class Taps:
    """Records, per run label, every execution of every tapped call: ``{key: [(seq, leaves)]}``.

    A key is the call's place in the trace: the enclosing tapped calls and the count of this
    call among its siblings (``verify/block#2/gdn_mixer#1/matmul#4``), the same in both runs
    (they trace the same Python code)."""

    def __init__(self):
        self.label = None
        self.values: dict = {}
        self.seq = 0
        self.stack: list = []  # [(name, Counter of children)]
        self.order: list = []  # keys in trace order
        self.meta: dict = {}  # key -> (names of the leaves, their conv-channel axes)
        self.tp, self.geometry = 1, None
        self.enabled = True  # False: named scopes only (for --hlo)
        self.opaque = 0  # > 0: inside an opaque tapped call (its loop's calls are not tapped)
        self.current_w_qkv = []

    def reset_trace(self):
        self.stack = [("", collections.Counter())]

    @contextlib.contextmanager
    def scope(self, name: str):
        if not self.stack:
            self.reset_trace()
        counter = self.stack[-1][1]
        counter[name] += 1
        key = "/".join([s for s, _ in self.stack[1:]] + [f"{name}#{counter[name]}"])
        self.stack.append((f"{name}#{counter[name]}", collections.Counter()))
        try:
            with jax.named_scope(key.replace("#", "_")):
                yield key
        finally:
            self.stack.pop()

    def record(self, key: str, names, leaves, axes):
        if not self.enabled or self.opaque:
            return
        if key not in self.meta:
            self.order.append(key)
            self.meta[key] = (names, axes)

        def host(*xs, key=key):
            self.seq += 1
            self.values.setdefault(self.label, {}).setdefault(key, []).append((self.seq, [np.asarray(x) for x in xs]))

        jax.debug.callback(host, *leaves, partitioned=False)

    def normalise(self, label, key, leaves):
        """The mesh's conv channels back in the usual order."""
        _, axes = self.meta[key]
        if label != "mesh" or self.tp == 1:
            return leaves
        g = self.geometry
        back = lambda x, ax: np.asarray(sharding.from_tp_layout(x, g, self.tp, ax))  # noqa: E731
        return [x if ax is None else back(x, ax) for x, ax in zip(leaves, axes)]


TAPS = Taps()


def _arrays(args, prefix):
    """The array arguments (not parameter pytrees), named ``prefix[i]``."""
    return [(f"{prefix}{i}", a) for i, a in enumerate(args) if isinstance(a, jax.Array)]


def _tapped(name, fn, conv_axes=None, results=None, opaque=False):
    """``fn`` with its array operands and result tapped; ``conv_axes(args, leaves)``: the
    conv-channel axis of each leaf (operands, then results), or None; ``results``: how many
    leading results to tap (None: all); ``opaque``: the calls inside ``fn`` are not tapped (they
    run in a loop, once per query: a tap there would run once per iteration)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with TAPS.scope(name) as key:
            TAPS.opaque += opaque
            try:
                out = fn(*args, **kwargs)
            finally:
                TAPS.opaque -= opaque
            ins = _arrays(args, "in")
            res = jax.tree.leaves(out if results is None else tuple(out)[:results])
            outs = [(f"out{i}", x) for i, x in enumerate(res) if isinstance(x, jax.Array)]
            leaves = ins + outs
            axes = conv_axes(args, leaves) if conv_axes else [None] * len(leaves)
            TAPS.record(key, [n for n, _ in leaves], [x for _, x in leaves], axes)
        return out

    return wrapped


def _matmul_axes(args, leaves):
    # the in-projection to [q | k | v]: its weight's columns and its result in the tp order on a mesh
    b = args[1] if len(args) > 1 else None
    is_qkv = any(b is w for w in TAPS.current_w_qkv)
    return [(-1 if is_qkv and n != "in0" else None) for n, _ in leaves]


def instrument():
    """Wrap the model's functions (in model.py and where decode.py imported them)."""
    for name in ("matmul", "einsum"):
        setattr(model_mod, name, _tapped(name, getattr(model_mod, name), _matmul_axes if name == "matmul" else None))
    for name in ("rmsnorm", "gated_rmsnorm", "softmax", "transcendental", "_rope", "logits", "mlp", "attention",
                 "tree_attention", "per_query_attention"):
        if not hasattr(model_mod, name):  # (an older model)
            continue
        w = _tapped(name, getattr(model_mod, name), opaque=name == "per_query_attention")
        setattr(model_mod, name, w)
        if hasattr(decode_mod, name):
            setattr(decode_mod, name, w)
    original_mixer = model_mod.gdn_mixer

    def gdn_mixer(p, config, x, core, rows=None):
        core = _tapped("core", core, lambda args, leaves: [-1 if n == "in0" else None for n, _ in leaves])
        TAPS.current_w_qkv.append(p.w_qkv)
        try:
            return original_mixer(p, config, x, core, rows)
        finally:
            TAPS.current_w_qkv.pop()

    w = _tapped("gdn_mixer", gdn_mixer)
    model_mod.gdn_mixer = decode_mod.gdn_mixer = w
    # the draft's GDN step: mixed [N, 1, C] and the conv state / window [N, C, Kc-1 | Kc] in the tp order
    decode_mod._draft_gdn = _tapped("draft_gdn", decode_mod._draft_gdn, lambda args, leaves: [
        {"in2": -2, "in3": -1, "out2": -2}.get(n) for n, _ in leaves])  # fmt: skip
    for name in ("_block", "_draft", "_verify"):  # (_verify: its logits, not the pool and KV cache)
        setattr(decode_mod.SpecStep, name, _tapped(name.strip("_"), getattr(decode_mod.SpecStep, name),
                                                   results=1 if name == "_verify" else None))
    original_step = decode_mod.SpecStep._step

    def _step(self, *a):
        TAPS.reset_trace()
        return original_step(self, *a)

    decode_mod.SpecStep._step = _step


def bisect() -> list:
    """Compare the two runs' taps; print the origins (operands equal, result not) and return
    them as ``(seq, key, execution, what differs)``, first first."""
    one, mesh = TAPS.values.get("one", {}), TAPS.values.get("mesh", {})
    origins, first_diff = [], None
    for key in TAPS.order:
        a, b = one.get(key, []), mesh.get(key, [])
        if len(a) != len(b):
            print(f"  {key}: {len(a)} executions on one device, {len(b)} on the mesh")
        names, _ = TAPS.meta[key]
        for e, ((seq, xa), (_, xb)) in enumerate(zip(a, b)):
            xb = TAPS.normalise("mesh", key, xb)
            same = [x.shape == y.shape and x.tobytes() == y.tobytes() for x, y in zip(xa, xb)]
            ins = [s for n, s in zip(names, same) if n.startswith("in")]
            outs = [s for n, s in zip(names, same) if n.startswith("out")]
            if not all(outs) and (first_diff is None or seq < first_diff[0]):
                first_diff = (seq, key, e)
            if all(ins) and not all(outs):
                diff = []
                for n, s, x, y in zip(names, same, xa, xb):
                    if not s and n.startswith("out"):
                        neq = np.asarray(x != y)
                        ulp = np.abs(x.view(np.int32).astype(np.int64) - y.view(np.int32).astype(np.int64)) \
                            if x.dtype == np.float32 else None  # fmt: skip
                        diff.append(f"{n} {list(x.shape)} {x.dtype}: {int(neq.sum())} of {x.size} differ"
                                    + (f", up to {int(ulp.max())} ULP" if ulp is not None else ""))  # fmt: skip
                shapes = ", ".join(f"{n} {list(x.shape)}" for n, x in zip(names, xa) if n.startswith("in"))
                origins.append((seq, key, e, f"({shapes}): " + "; ".join(diff)))
    origins.sort()
    # innermost: an origin whose key is no prefix of another origin's at the same execution
    inner = [o for o in origins
             if not any(p is not o and p[1].startswith(o[1] + "/") and p[2] == o[2] for p in origins)]
    print(f"taps: {len(TAPS.order)} tapped calls; {len(origins)} executions with equal operands and other results "
          f"({len(inner)} innermost)")  # fmt: skip
    if first_diff:
        print(f"  the first tapped result that differs (execution order on one device): {first_diff[1]} "
              f"(execution {first_diff[2]})")  # fmt: skip
    for seq, key, e, what in inner[:12]:
        print(f"  origin: {key} (execution {e}) {what}")
    return inner


def hlo_of(step, params, state, inputs):
    """The compiled HLO of the jitted step for these arguments."""
    return decode_mod._jitted_step.lower(step, params, state, inputs).compile().as_text()


def instructions(text: str, key: str) -> list:
    """The HLO instructions (and fused computations' roots) whose op_name carries ``key``'s scope."""
    scope = key.replace("#", "_")
    out = []
    for line in text.splitlines():
        m = re.search(r'op_name="([^"]*)"', line)
        if m and (scope + "/") in m.group(1) + "/" and not re.search(re.escape(scope) + r"/\w+_\d+/", m.group(1)):
            out.append(re.sub(r", metadata=\{.*?\}", "", line.strip())[:220])
    return out


def save_and_show(folder: str, texts: dict, origins) -> None:
    """Write each program's HLO (``texts``: name -> text) to ``folder/step_<name>.hlo.txt`` and print
    the instructions of the first three differing operations (``origins``) in each program."""
    for name, text in texts.items():
        path = os.path.join(folder, f"step_{name.replace('=', '')}.hlo.txt")
        with open(path, "w") as f:
            f.write(text)
        print(f"HLO ({name}): {path}")
    for key in list(dict.fromkeys(o[1] for o in origins))[:3]:
        for name, text in texts.items():
            ins = instructions(text, key)
            print(f"--- {key} in the {name} program: {len(ins)} instruction(s)")
            for line in ins[:12]:
                print("   ", line)


# ---------------------------------------------------------------------------------
# --against A: the D-token program against the A-token one (draft lengths), position by position.
# ---------------------------------------------------------------------------------
def token_views(x: np.ndarray, y: np.ndarray, tx: int, ty: int, position: int, max_len: int):
    """The parts of two tapped leaves that belong to one position: ``x`` of the D-token run (the
    position its token ``tx``), ``y`` of the A-token run (token ``ty``). Where their shapes differ
    (on one axis: the tokens of a step) each is sliced at its token; on an axis of the KV cache's
    length (``max_len``) only the positions up to ``position`` are kept (later ones are masked, and
    the two runs have written other ones there). None: not comparable (more than one axis differs)."""
    if x.shape != y.shape:
        axes = [i for i, (m, n) in enumerate(zip(x.shape, y.shape)) if m != n]
        if x.ndim != y.ndim or len(axes) != 1:
            return None
        x, y = np.take(x, [tx], axis=axes[0]), np.take(y, [ty], axis=axes[0])
    for ax in [i for i, n in enumerate(x.shape) if n == max_len]:
        x, y = np.take(x, np.arange(position + 1), axis=ax), np.take(y, np.arange(position + 1), axis=ax)
    return x, y


def _ulps(x: np.ndarray, y: np.ndarray) -> str:
    """The largest distance in units in the last place of two float32 or bfloat16 arrays, as text."""
    if x.dtype.name not in ("float32", "bfloat16"):
        return ""
    ints = np.int32 if x.dtype.itemsize == 4 else np.int16
    return f", up to {int(np.abs(x.view(ints).astype(np.int64) - y.view(ints).astype(np.int64)).max())} ULP"


def bisect_positions(D: int, A: int, tokens: int, max_len: int) -> list:
    """Compare the D-token run's taps with the A-token run's position by position: for every
    position p of the forced phase, execution ``p // D`` of a tapped call in the D run at its token
    ``p % D`` against execution ``p // A`` of the A run at token ``p % A`` (:func:`token_views`).
    Prints the origins (operands equal, a result not), innermost, first in the A run's execution
    order, and returns them as ``(seq, key, position, what differs)``."""
    wide, narrow = TAPS.values.get("D", {}), TAPS.values.get("A", {})
    origins, first_diff, compared, skipped = [], None, 0, set()
    for key in TAPS.order:
        a, b = wide.get(key, []), narrow.get(key, [])
        if not a or not b:
            continue  # e.g. the draft (in the D run only)
        if len(a) != tokens // D or len(b) != tokens // A:  # not once a step: inside a loop
            skipped.add(key)
            continue
        names, _ = TAPS.meta[key]
        for p in range(tokens):
            _, xa = a[p // D]
            seq, xb = b[p // A]
            views = [token_views(x, y, p % D, p % A, p, max_len) for x, y in zip(xa, xb)]
            if any(v is None for v in views):
                skipped.add(key)
                continue
            compared += 1
            same = [x.shape == y.shape and x.tobytes() == y.tobytes() for x, y in views]
            ins = [s for n, s in zip(names, same) if n.startswith("in")]
            outs = [s for n, s in zip(names, same) if n.startswith("out")]
            if not all(outs) and (first_diff is None or seq < first_diff[0]):
                first_diff = (seq, key, p)
            if all(ins) and not all(outs):
                diff = [f"{n} {list(x.shape)} {x.dtype}: {int(np.sum(x != y))} of {x.size} differ{_ulps(x, y)}"
                        for n, s, (x, y) in zip(names, same, views) if not s and n.startswith("out")]  # fmt: skip
                shapes = ", ".join(f"{n} {list(x.shape)} | {list(y.shape)}" for n, x, y in zip(names, xa, xb)
                                   if n.startswith("in"))  # fmt: skip
                origins.append((seq, key, p, f"(operands D | {A}: {shapes}): " + "; ".join(diff)))
    origins.sort()
    inner = [o for o in origins
             if not any(q is not o and q[1].startswith(o[1] + "/") and q[2] == o[2] for q in origins)]
    print(f"taps: {len(TAPS.order)} tapped calls, {compared} (call, position) pairs compared"
          + (f" ({len(skipped)} calls not comparable: {sorted(skipped)[:4]})" if skipped else "")
          + f"; {len(origins)} with equal operands and other results ({len(inner)} innermost)")  # fmt: skip
    if first_diff:
        print(f"  the first tapped result that differs (in the {A}-token run's order): {first_diff[1]} "
              f"(position {first_diff[2]})")  # fmt: skip
    by_key = collections.defaultdict(list)
    for o in inner:
        by_key[o[1]].append(o)
    for key, os_ in list(by_key.items())[:12]:
        seq, _, p, what = os_[0]
        more = f" and {len(os_) - 1} more positions" if len(os_) > 1 else ""
        print(f"  origin: {key} at position {p}{more}: {what}")
    return inner


def against_main(a, config) -> int:
    """``--against A``: the same prompts as D-token chunks and as A-token ones (A = 1: plain
    decoding), one device; every position's top-2 gap and prediction, the final states, then
    ``--taps`` / ``--hlo`` as for a mesh."""
    D, A = a.drafts, a.against
    if A < 1 or D <= A or D % A:
        raise SystemExit(f"--against {A}: must be a positive divisor of --drafts {D}, smaller than it")
    N, steps = a.rows, a.steps
    tokens = steps * D  # every step of the D run is a prompt chunk: nothing drafted, only the target
    rng = np.random.default_rng(a.seed)
    prompts = [[int(t) for t in rng.integers(0, config.vocab, tokens)] for _ in range(N)]
    params = init_params(config, a.seed)
    slots, tslots, rows, n_slots, n_requests = layout(N, 1)
    # the KV cache's length: none of the model's other sizes, so that token_views finds its axis
    max_len = tokens + 1
    sizes = {config.vocab, config.d_model, config.mlp_dim, config.attn_head_dim, config.head_k_dim, config.head_v_dim,
             config.num_v_heads, config.num_k_heads, config.attn_heads, config.kv_heads, config.conv_kernel,
             config.geometry.conv_dim, N, D, A}  # fmt: skip
    while max_len in sizes:
        max_len += 1
    steppers = {"D": SpecStep(config, D, track_interval=a.track_interval, backend=a.backend),
                "A": SpecStep(config, A, track_interval=a.track_interval, backend=a.backend)}  # fmt: skip
    n_steps = {"D": steps, "A": tokens // A}

    def new(label):
        return allocate_state(config, slots=n_slots, requests=n_requests, drafts=steppers[label].drafts,
                              record="tuples", max_len=max_len)  # fmt: skip

    def run(label, enabled):
        TAPS.label, TAPS.enabled = label, enabled
        seen = []
        _, outs, state = decode_steps(steppers[label], params, new(label), prompts, slots, rows, tslots,
                                      n_steps[label], on_step=lambda t, inputs, out: seen.append(inputs))  # fmt: skip
        return outs, state, seen

    def per_position(outs, width, field):
        return np.concatenate([np.asarray(getattr(o, field))[:, :width] for o in outs], axis=1)[:, :tokens]

    def compare(wide, narrow, quiet=False):
        bad = {}
        for f in ("predictions", "gaps"):
            x, y = per_position(wide, D, f), per_position(narrow, A, f)
            neq = x.view(np.uint32) != y.view(np.uint32) if f == "gaps" else x != y
            if neq.any():
                bad[f] = np.argwhere(neq)
                if not quiet:
                    r, p = bad[f][0]
                    print(f"{f}: {int(neq.sum())} of {neq.size} (row, position) differ; first at position {p} (row "
                          f"{r}, step {p // D} token {p % D} of the {D}-token run): {x[r, p]!r} vs {y[r, p]!r}")  # fmt: skip
        return bad

    wide, wide_state, inputs_seen = run("D", False)
    narrow, narrow_state, _ = run("A", False)
    print(f"{a.size} ({config.dtype}, invariant={config.invariant}: {config.invariant_dots}), {N} rows, {tokens} "
          f"given tokens each: {steps} steps of D={D} against {tokens // A} of D={A}, jax {jax.__version__}")  # fmt: skip
    bad = compare(wide, narrow)
    if not bad:
        print(f"every position's prediction and top-2 gap identical bit for bit ({N} x {tokens})")
    print("final pool:", compare_bitwise(jax.device_get(wide_state.pool.ssm), jax.device_get(narrow_state.pool.ssm)),
          "(SSM);", compare_bitwise(jax.device_get(wide_state.pool.conv), jax.device_get(narrow_state.pool.conv)),
          "(conv)")  # fmt: skip
    print("final KV:", compare_bitwise(jax.device_get(wide_state.kv), jax.device_get(narrow_state.kv)))

    origins = []
    if a.taps:
        if not bad:
            print("taps: nothing differs to bisect")
        else:
            jax.clear_caches()  # the steps were traced without taps
            tw, _, _ = run("D", True)
            tn, _, _ = run("A", True)
            still = compare(tw, tn, quiet=True)
            print("with taps the positions " + ("still differ" if still else "are IDENTICAL (the taps changed the "
                                                                              "programs)"))  # fmt: skip
            origins = bisect_positions(D, A, tokens, max_len)
    if a.hlo:
        os.makedirs(a.hlo, exist_ok=True)
        TAPS.enabled = False
        jax.clear_caches()
        texts = {}
        for label in ("D", "A"):
            TAPS.reset_trace()
            x = jax.tree.map(jax.numpy.asarray, inputs_seen[0])
            if label == "A":
                x = dataclasses.replace(x, tokens=x.tokens[:, :A], n_given=np.minimum(x.n_given, A))
            texts[label] = hlo_of(steppers[label], params, new(label), x)
        save_and_show(a.hlo, {f"D={steppers[label].drafts}": text for label, text in texts.items()}, origins)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--size", default="gpu", help="the model size (default gpu)")
    ap.add_argument("--dtype", default=None, help="the model's dtype (default: the size's); float32 shows the "
                    "differences that bfloat16 rounding hides")  # fmt: skip
    ap.add_argument("--mesh", default="2x1", help="TPxDP: heads over TP devices, rows over DP (default 2x1)")
    ap.add_argument("--drafts", "-D", type=int, default=4)
    ap.add_argument("--rows", type=int, default=8, help="batch rows (a multiple of DP)")
    ap.add_argument("--forced-tokens", type=int, default=40, help="prompt length: forced steps = this / D")
    ap.add_argument("--prompt-lengths", default=None, help="comma-separated prompt length per row (overrides "
                    "--forced-tokens and --rows)")  # fmt: skip
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--track-interval", type=int, default=16)
    ap.add_argument("--invariant", choices=("default", "on", "off"), default="default",
                    help="the model's invariant mode for both runs (default: the config's)")
    ap.add_argument("--against", type=int, default=None, metavar="A",
                    help="compare the D-token step with the A-token one (A = 1: plain decoding) position by position "
                         "on one device instead of a mesh (see above)")
    ap.add_argument("--taps", action="store_true", help="bisect op by op (see above)")
    ap.add_argument("--hlo", metavar="DIR", default=None, help="write both compiled programs' HLO here; with "
                    "--taps, print the first origin's instructions in each")  # fmt: skip
    a = ap.parse_args()
    tp, dp = (int(x) for x in a.mesh.split("x"))
    config, D = get_config(a.size), a.drafts
    if a.dtype is not None:
        config = dataclasses.replace(config, dtype=a.dtype)
    if a.invariant != "default":
        config = dataclasses.replace(config, invariant=a.invariant == "on")
    if a.against is not None:
        if a.taps or a.hlo:
            instrument()
        return against_main(a, config)
    plan = make_plan(tp, dp)
    rng = np.random.default_rng(a.seed)
    lengths = [int(n) for n in a.prompt_lengths.split(",")] if a.prompt_lengths else [a.forced_tokens] * a.rows
    N = len(lengths)
    prompts = [[int(t) for t in rng.integers(0, config.vocab, n)] for n in lengths]
    params = init_params(config, a.seed)
    slots, tslots, rows, n_slots, n_requests = layout(N, dp)
    max_len = max(lengths) + a.steps * D + 8

    def new():
        return allocate_state(config, slots=n_slots, requests=n_requests, drafts=D, record="tuples", max_len=max_len)

    TAPS.tp, TAPS.geometry = tp, config.geometry
    if a.taps or a.hlo:
        instrument()
    single = SpecStep(config, D, track_interval=a.track_interval, backend=a.backend)
    on_mesh = dataclasses.replace(single, mesh=plan)

    def place(x):
        return place_on_mesh(plan, config, params, new(), x)[2]

    def run(label, enabled):
        TAPS.label, TAPS.enabled = label, enabled
        forced, seen = [], []

        def on_step(t, inputs, out):
            if label == "mesh":
                replicas(out, t)
            forced.append(bool((inputs.n_given == D).all()))
            seen.append(inputs)

        if label == "one":
            _, outs, state = decode_steps(single, params, new(), prompts, slots, rows, tslots, a.steps, on_step=on_step)
        else:
            mparams, mstate = place_on_mesh(plan, config, params, new())
            _, outs, state = decode_steps(on_mesh, mparams, mstate, prompts, slots, rows, tslots, a.steps, place=place,
                                          on_step=on_step)  # fmt: skip
        return outs, forced, state, seen

    def compare(want, got, forced, quiet=False):
        first = {}
        for t, (w, g) in enumerate(zip(want, got)):
            for f in FIELDS:
                x, y = np.asarray(getattr(w, f)), np.asarray(getattr(g, f))
                same = x.tobytes() == y.tobytes()
                if not same and f not in first:
                    rows_d = sorted({int(i) for i in np.argwhere(x != y)[:, 0]})
                    first[f] = t
                    if not quiet:
                        print(f"step {t} ({'forced' if forced[t] else 'drafting'}): {f} differ first, rows {rows_d}"
                              + (f"; gaps {x[rows_d[0]]} vs {y[rows_d[0]]}" if f == "gaps" else ""))  # fmt: skip
        return first

    want, forced, want_state, inputs_seen = run("one", False)
    got, _, got_state, _ = run("mesh", False)
    print(f"{a.size} ({config.dtype}, invariant={config.invariant}), D={D}, {N} rows, mesh {a.mesh} (tensor x data) "
          f"over {[str(d) for d in plan.mesh.devices.flat]}, jax {jax.__version__}; {sum(forced)} forced steps, then "
          f"{a.steps - sum(forced)} drafting steps")  # fmt: skip
    first = compare(want, got, forced)
    if not first:
        print(f"all {a.steps} steps' outputs identical (inputs, predictions, accepted, track steps, gaps bit for bit)")
    back = pool_from_mesh(got_state.pool, config.geometry, tp)
    print("final pool:", compare_bitwise(jax.device_get(want_state.pool), back))
    print("final KV:", compare_bitwise(jax.device_get(want_state.kv), jax.device_get(got_state.kv)))

    origins = []
    if a.taps:
        if not first:
            print("taps: nothing differs to bisect")
        else:
            jax.clear_caches()  # the steps were traced without taps
            tw, _, _, _ = run("one", True)
            tg, _, _, _ = run("mesh", True)
            still = compare(tw, tg, forced, quiet=True)
            verdict = f"still differ (first at step {min(still.values())})" if still else \
                "are IDENTICAL (the taps changed the programs)"  # fmt: skip
            print(f"with taps the step outputs {verdict}")
            origins = bisect()
    if a.hlo:
        os.makedirs(a.hlo, exist_ok=True)
        TAPS.enabled = False
        jax.clear_caches()
        host_inputs = jax.tree.map(jax.numpy.asarray, inputs_seen[0])
        texts = {}
        for label, step, p, s, x in (
            ("one", single, params, new(), host_inputs),
            ("mesh", on_mesh, *place_on_mesh(plan, config, params, new(), host_inputs)),
        ):
            TAPS.reset_trace()
            texts[label] = hlo_of(step, p, s, x)
        save_and_show(a.hlo, texts, origins)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
