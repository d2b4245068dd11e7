"""Memory accounting: speculative scratch per record mode, and the KV cache it could be.

Every byte count here comes from the shapes :mod:`gdn_lossless_jax.pool` allocates
(:func:`~gdn_lossless_jax.pool.tape_specs`, :func:`~gdn_lossless_jax.pool.conv_window_spec`),
so for the pool's record modes the accounting equals the allocation byte for byte. Per
request and per GDN layer and draft step that is::

    snapshots   HV*V*K * itemsize(state)        (SGLang's default intermediate_ssm)
    tuples      (HV*V + H*K + HV) * 4           (ours: k once per q/k head)
    seed_ring   HV*(V + K + 1) * 4              (the seed's ring: k per v-head)
    conv windows, per request and layer: conv_dim * (D + Kc - 2) * itemsize(conv)

The *seed* is SGLang's lossless-verify pull request (``--enable-linear-lossless-verify``),
where the tuple design started: its ring stores ``k`` once per v-head, where ours stores it
once per q/k head (the ``HV // H`` v-heads of a group share it), and its description sizes
three setups (:data:`SEED_SETUPS`), which :func:`seed_table` recomputes.

SGLang reserves ``requests + 1`` scratch rows (the padding row). The freed bytes become KV
cache at ``full_attention_layers * 2 * kv_heads * kv_head_dim * itemsize(kv)`` per token.
Sizes are printed in GiB (2**30 bytes): the seed's table says "GB" but its numbers are GiB
(in 10**9 bytes they would not match).

Draft trees (:mod:`gdn_lossless_jax.tree`): the scratch holds one entry a node in both modes (a
tuple, or a state: what SGLang's tree verify keeps), and the conv windows stay the chain's
buffer with one column a node, so a tree of n nodes costs what a chain of D = n drafts does
(:func:`tree_nodes`, :func:`tree_table`). SGLang's own tree path keeps a dense window a node
(``conv_dim * (Kc-1)``), counted beside ours.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ..config import MODELS, Geometry, get_geometry
from ..pool import (POOL_RECORD_MODES, SCRATCH, SCRATCH_MODES, _positive, check_supported, conv_window_spec,
                    scratch_rows, state_specs, tape_specs)  # fmt: skip

__all__ = [
    "GIB",
    "MIB",
    "SEED_SETUPS",
    "SeedSetup",
    "MemoryReport",
    "scratch_bytes",
    "conv_window_bytes",
    "kv_bytes_per_token",
    "kv_tokens",
    "memory_report",
    "seed_table",
    "format_report",
    "format_seed_table",
    "gib",
    "TPRow",
    "tp_sizes",
    "tp_table",
    "format_tp_table",
    "tree_nodes",
    "tree_shape",
    "TreeRow",
    "tree_table",
    "format_tree_table",
]

GIB = 2**30
MIB = 2**20


def _checked(fn: str, geometry: Geometry, drafts: int, requests: int | None) -> None:
    _positive(fn, drafts=drafts, **({} if requests is None else {"requests": requests}))
    check_supported(fn, geometry, drafts=drafts)


def _rows(requests: int | None) -> int:
    """``None``: per request (one row); else the rows SGLang reserves for that many requests."""
    return 1 if requests is None else scratch_rows(requests)


def scratch_bytes(
    geometry: Geometry, drafts: int, record: str, *, requests: int | None = None, state_dtype=jnp.float32
) -> int:
    """SSM scratch bytes of ``record`` mode: per request (``requests=None``) or for
    ``requests`` running requests (``requests + 1`` rows, as allocated).

    >>> g = get_geometry("qwen3.6-35b-a3b")
    >>> scratch_bytes(g, 1, "snapshots") / 2**20, scratch_bytes(g, 1, "tuples") / 2**20  # MiB per draft step
    (60.0, 0.70678710937...)
    >>> gib(scratch_bytes(g, 4, "snapshots", requests=25))  # 26 scratch rows of 4 steps
    '6.09'
    """
    _checked("scratch_bytes", geometry, drafts, requests)
    if record not in SCRATCH_MODES:
        raise ValueError(f"scratch_bytes: record must be one of {SCRATCH_MODES}, got {record!r}")
    specs = tape_specs(geometry, _rows(requests), drafts, record, state_dtype=state_dtype)
    return sum(s.nbytes for s in specs.values())


def conv_window_bytes(geometry: Geometry, drafts: int, *, requests: int | None = None, conv_dtype=jnp.bfloat16) -> int:
    """Deduplicated conv window bytes, per request or for ``requests`` requests (+1 row)."""
    _checked("conv_window_bytes", geometry, drafts, requests)
    return conv_window_spec(geometry, _rows(requests), drafts, conv_dtype=conv_dtype).nbytes


def kv_bytes_per_token(geometry: Geometry, *, kv_dtype=jnp.bfloat16) -> int:
    """KV cache bytes per token: ``full_attention_layers * kv_tensors (2: K and V) * kv_heads * kv_head_dim *
    itemsize``.

    >>> kv_bytes_per_token(get_geometry("qwen3.6-35b-a3b"))  # 10 layers x 2 x 2 heads x 256 x 2 bytes
    20480
    """
    g = geometry
    return g.full_attention_layers * g.kv_tensors * g.kv_heads * g.kv_head_dim * jnp.dtype(kv_dtype).itemsize


def kv_tokens(geometry: Geometry, nbytes: int, *, kv_dtype=jnp.bfloat16) -> int:
    """KV cache tokens that ``nbytes`` hold (0 for a negative budget, or a model without attention layers)."""
    per = kv_bytes_per_token(geometry, kv_dtype=kv_dtype)
    return max(0, nbytes) // per if per else 0


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Scratch bytes of one setup (``requests + 1`` rows), per record mode, and the KV trade."""

    geometry: Geometry
    drafts: int
    requests: int
    state_dtype: str
    conv_dtype: str
    kv_dtype: str
    per_request: dict[str, int]  # SSM scratch per request, by record mode
    total: dict[str, int]  # SSM scratch for requests + 1 rows, by record mode
    conv_per_request: int
    conv_total: int
    kv_per_token: int
    budget: int | None = None

    @property
    def rows(self) -> int:
        return scratch_rows(self.requests)

    def freed(self, record: str = "tuples") -> int:
        """Bytes ``record`` frees against snapshots (the conv windows are the same in both)."""
        return self.total["snapshots"] - self.total[record]

    def tokens_freed(self, record: str = "tuples") -> int:
        return kv_tokens(self.geometry, self.freed(record), kv_dtype=self.kv_dtype)

    def budget_tokens(self, record: str) -> int | None:
        """KV tokens left in the budget after ``record``'s scratch and the conv windows."""
        if self.budget is None:
            return None
        return kv_tokens(self.geometry, self.budget - self.total[record] - self.conv_total, kv_dtype=self.kv_dtype)


def memory_report(
    geometry: Geometry,
    *,
    drafts: int,
    requests: int,
    state_dtype=jnp.float32,
    conv_dtype=jnp.bfloat16,
    kv_dtype=jnp.bfloat16,
    budget: int | None = None,
) -> MemoryReport:
    """The scratch of every record mode for ``requests`` requests of ``drafts`` drafts.

    ``budget``: bytes for the speculative scratch plus the KV cache (optional).
    """
    _checked("memory_report", geometry, drafts, requests)
    # every record mode (a KDA geometry's tuples: KDATuples); the seed's ring where it records the decay (GDN)
    modes = [m for m in SCRATCH_MODES if m in POOL_RECORD_MODES or geometry.decay in SCRATCH[m].decays]
    per = {m: scratch_bytes(geometry, drafts, m, state_dtype=state_dtype) for m in modes}
    tot = {m: scratch_bytes(geometry, drafts, m, requests=requests, state_dtype=state_dtype) for m in modes}
    return MemoryReport(
        geometry=geometry,
        drafts=drafts,
        requests=requests,
        state_dtype=jnp.dtype(state_dtype).name,
        conv_dtype=jnp.dtype(conv_dtype).name,
        kv_dtype=jnp.dtype(kv_dtype).name,
        per_request=per,
        total=tot,
        conv_per_request=conv_window_bytes(geometry, drafts, conv_dtype=conv_dtype),
        conv_total=conv_window_bytes(geometry, drafts, requests=requests, conv_dtype=conv_dtype),
        kv_per_token=kv_bytes_per_token(geometry, kv_dtype=kv_dtype),
        budget=budget,
    )


# ---------------------------------------------------------------------------------
# The seed's table: the three setups SGLang's lossless-verify pull request sizes.
# ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SeedSetup:
    """One row of the seed's table, with the numbers it prints (its "GB", which are GiB)."""

    label: str
    model: str
    drafts: int
    requests: int
    snapshots_printed: str
    ring_printed: str


SEED_SETUPS: tuple[SeedSetup, ...] = (
    SeedSetup("Qwen3.6-35B-A3B, MTP D=4, 25 requests", "qwen3.6-35b-a3b", 4, 25, "6.09", "0.10"),
    SeedSetup("Qwen3.6-35B-A3B, DFLASH D=16, 8 requests", "qwen3.6-35b-a3b", 16, 8, "8.44", "0.13"),
    SeedSetup("Qwen3.8-27B, DFlash2/DSpark D=8, 8 requests", "qwen3.8-27b", 8, 8, "10.12", "0.16"),
)


def gib(nbytes: int) -> str:
    """Bytes in GiB with two decimals, as the seed prints them."""
    return f"{nbytes / GIB:.2f}"


def seed_table() -> list[tuple[SeedSetup, MemoryReport]]:
    """The seed's three setups (fp32 state, bf16 conv and KV), recomputed from our shapes."""
    return [(s, memory_report(get_geometry(s.model), drafts=s.drafts, requests=s.requests)) for s in SEED_SETUPS]


def format_seed_table() -> str:
    """The seed's table reproduced (its printed GiB beside ours), with our ring and the conv windows."""
    rows = seed_table()
    w = max(len(s.label) for s, _ in rows)
    mark = lambda ours, printed: "ok" if ours == printed else "DIFFERS"  # noqa: E731
    lines = [
        "The seed's table (SGLang's lossless-verify pull request), recomputed from the pool's shapes; GiB, "
        "(requests + 1) * D scratch steps",
        f"{'setup':<{w}}  {'snapshots':>16}  {'seed ring':>16}  {'our ring':>8}  {'conv win':>8}  {'KV tokens freed':>15}",
        f"{'':<{w}}  {'ours / seed':>16}  {'ours / seed':>16}  {'':>8}  {'':>8}  {'(our ring)':>15}",
    ]
    for s, r in rows:
        snap, ring = gib(r.total["snapshots"]), gib(r.total["seed_ring"])
        lines.append(
            f"{s.label:<{w}}  {snap + ' / ' + s.snapshots_printed + ' ' + mark(snap, s.snapshots_printed):>16}"
            f"  {ring + ' / ' + s.ring_printed + ' ' + mark(ring, s.ring_printed):>16}"
            f"  {gib(r.total['tuples']):>8}  {gib(r.conv_total):>8}  {r.tokens_freed('tuples'):>15,}"
        )
    decimal = " / ".join(f"{r.total['snapshots'] / 1e9:.2f}" for _, r in rows)
    lines.append(f"(in 10**9-byte GB the snapshots would read {decimal}: the seed's \"GB\" are GiB)")
    return "\n".join(lines)


def format_report(r: MemoryReport) -> str:
    """A table of one setup: every record mode per request and in total, conv windows, KV trade."""
    g = r.geometry
    snap = r.total["snapshots"]
    names = {"snapshots": "snapshots", "tuples": "tuples (ours)", "seed_ring": "seed's ring"}
    kind = "KDA" if g.linear_attention == "kda" else "GDN"
    lines = [
        f"model         {g.name}: {g.gdn_layers} {kind} layers of {g.gdn_layers + g.full_attention_layers}, "
        f"H={g.num_k_heads}, HV={g.num_v_heads}, K={g.head_k_dim}, V={g.head_v_dim}, conv_dim={g.conv_dim}, Kc={g.conv_kernel}",
        f"setup         D={r.drafts} draft tokens, {r.requests} requests ({r.rows} scratch rows), "
        f"state {r.state_dtype}, conv {r.conv_dtype}",
        f"{'record mode':<14}{'per request':>14}{'total':>12}{'vs snapshots':>14}",
    ]
    for m in (m for m in ("snapshots", "tuples", "seed_ring") if m in r.total):
        lines.append(
            f"{names[m]:<14}{r.per_request[m] / MIB:>10.2f} MiB{r.total[m] / GIB:>8.2f} GiB"
            f"{snap / r.total[m]:>13.1f}x"
        )
    lines.append(f"{'conv windows':<14}{r.conv_per_request / MIB:>10.2f} MiB{r.conv_total / GIB:>8.2f} GiB  (both modes)")
    lines.append(
        f"KV cache      {r.kv_per_token / 1024:.1f} KiB per token ({g.full_attention_layers} full-attention layers"
        f" x {g.kv_tensors} x {g.kv_heads} KV heads x {g.kv_head_dim} x {r.kv_dtype})"
    )
    ring = (f" (seed's ring: {gib(r.freed('seed_ring'))} GiB = {r.tokens_freed('seed_ring'):,})"
            if "seed_ring" in r.total else "")  # fmt: skip
    lines.append(
        f"freed         snapshots -> tuples: {gib(r.freed('tuples'))} GiB = {r.tokens_freed('tuples'):,} KV "
        f"tokens{ring}"
    )
    if "seed_ring" in r.total:
        lines.append("note          seed's ring: the ring of SGLang's lossless-verify pull request, k once per v-head")
    else:
        lines.append(f"note          {kind} tuples: u [HV, V], k [H, K], g [HV, K] fp32 a layer, request and step "
                     "(one decay per key channel); the seed's ring is GDN's only")  # fmt: skip
    if r.budget is not None:
        lines.append(_format_budget(r))
    return "\n".join(lines)


def _format_budget(r: MemoryReport) -> str:
    """The budget line: KV tokens left per mode, or which scratch does not fit at all."""
    head = f"budget        {r.budget / GIB:.4g} GiB for scratch + conv windows + KV cache: "
    need = {m: r.total[m] + r.conv_total for m in ("snapshots", "tuples")}
    if need["tuples"] > r.budget:
        return head + (
            f"does not fit: the scratch and conv windows alone need {need['tuples'] / GIB:.2f} GiB with tuples "
            f"({need['snapshots'] / GIB:.2f} GiB with snapshots), so no KV token is left"
        )
    ts, tt = r.budget_tokens("snapshots"), r.budget_tokens("tuples")
    if need["snapshots"] > r.budget:
        return head + (
            f"snapshots do not fit (with the conv windows they need {need['snapshots'] / GIB:.2f} GiB); "
            f"{tt:,} KV tokens with tuples"
        )
    gain = f"+{tt - ts:,} tokens" + (f", +{100 * (tt - ts) / ts:.0f}%" if ts else "")
    return head + f"{ts:,} KV tokens with snapshots, {tt:,} with tuples ({gain})"


# ---------------------------------------------------------------------------------
# Per device under tensor parallelism (gdn_lossless_jax.sharding: heads over a tensor axis).
# ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TPRow:
    """One model at one tensor size: bytes per device, or why the heads do not split.

    ``ssm``, ``conv``: the state pool (``slots + 1`` slots); ``tuples``, ``snapshots``: the SSM
    scratch of each record mode and ``conv_windows`` (``requests + 1`` rows), each for the
    H/tp q/k heads and HV/tp v-heads one device holds (:func:`gdn_lossless_jax.sharding.local_geometry`).
    """

    geometry: Geometry
    tp: int
    ssm: int | None = None
    conv: int | None = None
    tuples: int | None = None
    snapshots: int | None = None
    conv_windows: int | None = None
    error: str | None = None

    def total(self, record: str) -> int:
        """Pool plus ``record``'s scratch plus the conv windows, per device."""
        return self.ssm + self.conv + getattr(self, record) + self.conv_windows


def tp_sizes(text: str) -> tuple[int, ...]:
    """Tensor sizes from ``"1,2,4,8"`` (as given) or ``"N"`` (the powers of two up to N, and N).

    >>> tp_sizes("8"), tp_sizes("6"), tp_sizes("1,3")
    ((1, 2, 4, 8), (1, 2, 4, 6), (1, 3))
    """
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"tensor sizes must be integers (N or a list like 1,2,4,8), got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"tensor sizes must be positive integers, got {text!r}")
    if len(values) > 1:
        return tuple(values)
    n = values[0]
    return tuple(sorted({*(2**i for i in range(n.bit_length()) if 2**i <= n), n}))


def tp_table(
    models=None,
    sizes=(1, 2, 4, 8),
    *,
    drafts: int,
    requests: int,
    slots: int,
    state_dtype=jnp.float32,
    conv_dtype=jnp.bfloat16,
) -> list[TPRow]:
    """Per-device pool and scratch bytes for each model (default: every named model) and tensor size.

    The bytes come from the pool's own shape functions (:func:`~gdn_lossless_jax.pool.state_specs`,
    :func:`~gdn_lossless_jax.pool.tape_specs`, :func:`~gdn_lossless_jax.pool.conv_window_spec`) of
    the geometry one device holds, so they equal the shard each device allocates byte for byte.

    >>> r = tp_table([get_geometry("qwen3.6-35b-a3b")], (1, 2), drafts=4, requests=25, slots=50)
    >>> [x.snapshots // 2**20 for x in r], r[0].ssm == 2 * r[1].ssm
    ([6240, 3120], True)
    """
    from ..sharding import local_geometry

    _positive("tp_table", drafts=drafts, requests=requests, slots=slots)
    rows, geometries = [], [MODELS[m] if isinstance(m, str) else m for m in (models or MODELS)]
    for g in geometries:
        check_supported("tp_table", g, drafts=drafts)
        for tp in sizes:
            try:
                local = local_geometry(g, tp)
            except ValueError:
                rows.append(TPRow(g, tp, error=f"H={g.num_k_heads} is not a multiple of {tp}"))
                continue
            state = state_specs(local, slots, state_dtype=state_dtype, conv_dtype=conv_dtype)
            n = scratch_rows(requests)
            tape = {m: sum(x.nbytes for x in tape_specs(local, n, drafts, m, state_dtype=state_dtype).values())
                    for m in ("tuples", "snapshots")}  # fmt: skip
            windows = conv_window_spec(local, n, drafts, conv_dtype=conv_dtype).nbytes
            rows.append(TPRow(g, tp, state["ssm"].nbytes, state["conv"].nbytes, tape["tuples"], tape["snapshots"], windows))
    return rows


def format_tp_table(rows: list[TPRow], *, drafts: int, requests: int, slots: int, state_dtype="float32",
                    conv_dtype="bfloat16") -> str:  # fmt: skip
    """The per-device table of :func:`tp_table` (MiB per device)."""
    head = (
        f"per device, heads over a tensor axis of size tp: D={drafts} draft tokens, {requests} requests "
        f"({scratch_rows(requests)} scratch rows), {slots} slots (+1 padding), state {jnp.dtype(state_dtype).name}, "
        f"conv {jnp.dtype(conv_dtype).name}; MiB per device"
    )
    w = max(len(r.geometry.name) for r in rows)
    cols = ("ssm pool", "conv pool", "tuples", "snapshots", "conv win", "total tuples", "total snaps")
    lines = [head, f"{'model':<{w}}  {'tp':>2} {'H':>3} {'HV':>3}" + "".join(f"{c:>13}" for c in cols)]
    for r in rows:
        g = r.geometry
        lead = f"{g.name:<{w}}  {r.tp:>2}"
        if r.error:
            lines.append(f"{lead}   -   -  heads do not split: {r.error}")
            continue
        vals = (r.ssm, r.conv, r.tuples, r.snapshots, r.conv_windows, r.total("tuples"), r.total("snapshots"))
        lines.append(f"{lead} {g.num_k_heads // r.tp:>3} {g.num_v_heads // r.tp:>3}"
                     + "".join(f"{v / MIB:>13,.1f}" for v in vals))  # fmt: skip
    lines.append("total: the pool (ssm + conv) + that record mode's scratch + the conv windows; the data axis, if "
                 "any, divides the slots and the rows further")  # fmt: skip
    return "\n".join(lines)


# ---------------------------------------------------------------------------------
# Draft trees: the scratch of a tree of n nodes (one tape entry and one conv column a node).
# ---------------------------------------------------------------------------------
def tree_nodes(branching=None, *, topk: int | None = None, depth: int | None = None) -> int:
    """The nodes of a draft tree: the full tree of ``branching`` (``[2, 2, 2]``: 2 + 4 + 8 = 14), or
    an EAGLE-style top-k tree of ``depth`` levels with ``topk`` nodes each (the top-k of the previous
    level's expansions: ``topk * depth``).

    >>> tree_nodes([2, 2, 2]), tree_nodes(topk=4, depth=4), tree_nodes([4, 4, 4, 4])
    (14, 16, 340)
    """
    if branching is not None:
        if topk is not None or depth is not None:
            raise ValueError("tree_nodes: give the branching per depth, or topk and depth, not both")
        n, level = 0, 1
        for k in branching:
            _positive("tree_nodes", branching=int(k))
            level *= int(k)
            n += level
        return n
    if topk is None or depth is None:
        raise ValueError("tree_nodes: give the branching per depth, or both topk and depth")
    _positive("tree_nodes", topk=topk, depth=depth)
    return topk * depth


def tree_shape(text: str) -> tuple[int, ...]:
    """Branching per depth from ``"2,2,2"``.

    >>> tree_shape("2,2,2")
    (2, 2, 2)
    """
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"a tree is its branching per depth, positive integers like 2,2,2, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"a tree's branching per depth must be positive integers, got {text!r}")
    return values


@dataclasses.dataclass(frozen=True)
class TreeRow:
    """One model's scratch for a tree of ``nodes`` nodes and ``requests`` requests (``requests + 1`` rows)."""

    geometry: Geometry
    nodes: int
    requests: int
    snapshots: int  # one state a node (SGLang's tree verify)
    tuples: int  # one (u, k, g) a node (ours)
    conv_windows: int  # ours: the chain's deduplicated buffer, one column a node
    conv_dense: int  # SGLang's tree layout: a full window a node


def tree_table(models=None, *, nodes: int, requests: int, state_dtype=jnp.float32, conv_dtype=jnp.bfloat16) -> list[TreeRow]:
    """Both modes' scratch for a tree of ``nodes`` nodes, per model (default: the seed's models).

    >>> r = tree_table(["qwen3.6-35b-a3b"], nodes=14, requests=25)[0]
    >>> gib(r.snapshots), gib(r.tuples), r.snapshots // r.tuples
    ('21.33', '0.25', 84)
    """
    names = models or tuple(dict.fromkeys(s.model for s in SEED_SETUPS))
    rows = []
    for m in names:
        g = MODELS[m] if isinstance(m, str) else m
        kw = dict(requests=requests, state_dtype=state_dtype)
        itemsize = jnp.dtype(conv_dtype).itemsize
        dense = g.gdn_layers * scratch_rows(requests) * nodes * g.conv_dim * (g.conv_kernel - 1) * itemsize
        rows.append(TreeRow(g, nodes, requests, scratch_bytes(g, nodes, "snapshots", **kw),
                            scratch_bytes(g, nodes, "tuples", **kw),
                            conv_window_bytes(g, nodes, requests=requests, conv_dtype=conv_dtype), dense))  # fmt: skip
    return rows


def format_tree_table(rows: list[TreeRow], label: str) -> str:
    """The table of :func:`tree_table` (GiB), one line a model."""
    r0 = rows[0]
    w = max(len(r.geometry.name) for r in rows)
    lines = [
        f"draft tree {label}: {r0.nodes} nodes, {r0.requests} requests ({scratch_rows(r0.requests)} scratch rows); "
        "GiB; one scratch entry a node in each mode",
        f"{'model':<{w}}  {'snapshots':>10}  {'tuples':>8}  {'vs snapshots':>12}  {'conv win':>8}  {'dense conv win':>14}",
    ]
    for r in rows:
        lines.append(f"{r.geometry.name:<{w}}  {gib(r.snapshots):>10}  {gib(r.tuples):>8}  {r.snapshots / r.tuples:>11.1f}x"
                     f"  {gib(r.conv_windows):>8}  {gib(r.conv_dense):>14}")  # fmt: skip
    lines.append("snapshots: a state a node (SGLang's tree verify); tuples: (u, k, g) a node (ours); conv win: ours, "
                 "the chain's buffer, a column a node; dense conv win: a full window a node (SGLang's tree layout)")  # fmt: skip
    return "\n".join(lines)
