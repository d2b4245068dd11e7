"""The fuzzer's cases (:mod:`gdn_lossless_jax.tools.fuzz`): head geometries, shape groups, commit
indices with every masking rule in play, IEEE specials, and the pools, inputs and stale tape rows of
a case. Draws go through an integer source (:data:`IntSource`), NumPy's in the fuzzer and
Hypothesis's in the property tests."""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from ..tape import Snapshots, Tuples
from ..testing.asserts import bits
from ..testing.cases import KINDS, CommitIndices, Shape, verify_inputs_numpy

__all__ = ["IntSource", "numpy_source", "Family", "FAMILIES", "CPU_FAMILIES", "CaseShape", "CommitCase",
           "STATE_DTYPES", "INPUT_DTYPES", "VERIFY_INPUTS", "draw_shape", "draw_indices", "draw_case",
           "inject_specials"]  # fmt: skip


#: ``draw(lo, hi)``: an integer in ``[lo, hi]`` (both inclusive).
IntSource = Callable[[int, int], int]


def numpy_source(rng: np.random.Generator) -> IntSource:
    """An :data:`IntSource` from a NumPy generator."""
    return lambda lo, hi: int(rng.integers(lo, hi + 1))


@dataclasses.dataclass(frozen=True)
class Family:
    """A head geometry: H q/k heads, HV v-heads, K x V per head."""

    name: str
    H: int
    HV: int
    K: int
    V: int


#: The geometries fuzzed. Head dims are powers of 2, as the GPU kernels' tiles need.
FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("h2-hv4-k16-v16", 2, 4, 16, 16),  # the reduced Qwen3.6 family: HV = 2H
        Family("h4-hv64-k16-v8", 4, 64, 16, 8),  # HV = 64, 16 v-heads per k-head
        Family("h1-hv2-k256-v256", 1, 2, 256, 256),  # K = V = 256
        Family("h2-hv4-k32-v8", 2, 4, 32, 8),  # K > V
        Family("h2-hv8-k8-v32", 2, 8, 8, 32),  # K < V
        Family("h4-hv4-k16-v16", 4, 4, 16, 16),  # H = HV
        Family("h16-hv32-k128-v128", 16, 32, 128, 128),  # the real Qwen3-Next / Qwen3.6 heads (GPU)
    )
}
#: The families a CPU run draws by default (the real head geometry is for a GPU).
CPU_FAMILIES: tuple[str, ...] = tuple(n for n in FAMILIES if not n.startswith("h16-"))

STATE_DTYPES = ("float32", "bfloat16")
INPUT_DTYPES = ("bfloat16", "float32")
#: The verify arguments specials can be written into (``state0`` through the pool).
VERIFY_INPUTS = ("pool", "q", "k", "v", "a", "b", "A_log", "dt_bias")


@dataclasses.dataclass(frozen=True)
class CaseShape:
    """Everything that fixes the compiled functions: one shape group."""

    family: Family
    layers: int  # L
    requests: int  # N
    drafts: int  # D
    slots: int  # S, pool slots (>= 2N + 1: at least one slot nobody may write)
    rows: int  # R, tape rows (>= N; R > N: sparse rows among stale ones)
    state_dtype: str
    input_dtype: str

    @property
    def verify_shape(self) -> Shape:
        """All layers verified in one call: L * N requests (layer-major)."""
        f = self.family
        return Shape(N=self.layers * self.requests, D=self.drafts, H=f.H, HV=f.HV, K=f.K, V=f.V)

    @property
    def work(self) -> int:
        """Elements of the snapshot tape, ``L * R * D * HV * V * K``: what a case moves and replays."""
        f = self.family
        return self.layers * self.rows * self.drafts * f.HV * f.V * f.K

    def __str__(self) -> str:
        return (
            f"{self.family.name} L={self.layers} N={self.requests} D={self.drafts} S={self.slots} R={self.rows} "
            f"{self.state_dtype} pool, {self.input_dtype} inputs"
        )


def draw_shape(
    draw: IntSource,
    families: Iterable[str] = CPU_FAMILIES,
    *,
    max_work: int | None = 1 << 20,
    max_drafts: int = 32,
    max_layers: int = 3,
    max_requests: int = 8,
    state_dtypes: Iterable[str] = STATE_DTYPES,
) -> CaseShape:
    """A shape group: family, D in [1, 32], L in [1, 3], N in [1, 8], S in [2N+1, 2N+6],
    R in [N, N+6], fp32 or bf16 pool and inputs. ``max_work`` caps :attr:`CaseShape.work` by
    lowering the spare rows, then N, then L (never D), so that large heads stay affordable."""
    names, dtypes = list(families), list(state_dtypes)
    family = FAMILIES[names[draw(0, len(names) - 1)]]
    D, L, N, spare = draw(1, max_drafts), draw(1, max_layers), draw(1, max_requests), draw(0, 6)
    if max_work is not None:
        rows = max(1, max_work // (family.HV * family.V * family.K * D))  # L * R within the cap
        spare = max(0, min(spare, rows // L - N))
        N = max(1, min(N, rows // L))
        L = max(1, min(L, rows // (N + spare)))
    return CaseShape(
        family=family, layers=L, requests=N, drafts=D, slots=2 * N + draw(1, 6), rows=N + spare,
        state_dtype=dtypes[draw(0, len(dtypes) - 1)], input_dtype=INPUT_DTYPES[draw(0, 1)],
    )  # fmt: skip


def _shuffled(draw: IntSource, n: int, k: int) -> np.ndarray:
    """The first k of a Fisher-Yates shuffle of ``range(n)`` (shrinks to the identity)."""
    p = np.arange(n)
    for i in range(k):
        j = i + draw(0, n - 1 - i)
        p[i], p[j] = p[j], p[i]
    return p[:k].copy()


def draw_indices(draw: IntSource, N: int, D: int, S: int, R: int) -> CommitIndices:
    """Commit indices with every masking rule in play.

    Distinct destination slots (own and track; duplicates are undefined), rows the identity,
    a permutation or a sparse subset of ``range(R)``; about a third of the requests cross a
    track boundary (sometimes at a step past the accepted one, which the API allows), and
    about 40% are made invalid in one way: slot out of range (``-1``, ``S``, far above, ``-S``:
    must not wrap), row out of range, a negative or too-large step, a track slot out of range
    or a track step of D.
    """
    perm = _shuffled(draw, S, 2 * N)
    slots, track_slots = perm[:N].copy(), perm[N:].copy()
    rows = np.arange(N) if R == N and draw(0, 1) else _shuffled(draw, R, N)
    steps = np.array([draw(0, D - 1) for _ in range(N)])
    track_steps = np.full(N, -1)
    for n in range(N):
        crossing = draw(0, 2)
        if crossing == 1:
            track_steps[n] = draw(0, steps[n])
        elif crossing == 2 and draw(0, 3) == 0:
            track_steps[n] = draw(0, D - 1)  # past the accepted step: allowed, replayed all the same
        invalid = draw(0, 14)
        if invalid == 0:
            slots[n] = (-1, S, S + 1 + draw(0, 99), -S)[draw(0, 3)]
        elif invalid == 1:
            rows[n] = (-1, R, R + 1 + draw(0, 9))[draw(0, 2)]
        elif invalid == 2:
            steps[n] = -1 - draw(0, 2)
        elif invalid == 3:
            steps[n] = D + draw(0, 2)
        elif invalid == 4:
            track_slots[n], track_steps[n] = (-1, S, -S)[draw(0, 2)], draw(0, D - 1)
        elif invalid == 5:
            track_steps[n] = D
    i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    return CommitIndices(i32(slots), i32(steps), i32(track_slots), i32(track_steps), i32(rows))


# ---------------------------------------------------------------------------------
# IEEE specials, as bit patterns of the array's own width.
# ---------------------------------------------------------------------------------
def _special_bits(draw: IntSource, width: int) -> int:
    """A special value's bit pattern for a 16-bit (bfloat16) or 32-bit float."""
    m = 7 if width == 16 else 23  # fraction bits
    sign = draw(0, 1) << (width - 1)
    exp_all = ((1 << (width - 1 - m)) - 1) << m
    quiet = 1 << (m - 1)
    which = draw(0, 6)
    if which == 0:  # quiet NaN with a payload
        return sign | exp_all | quiet | draw(0, quiet - 1)
    if which == 1:  # signalling NaN (payload != 0, quiet bit clear)
        return sign | exp_all | draw(1, quiet - 1)
    if which == 2:
        return sign | exp_all  # +-Inf
    if which == 3:
        return sign  # +-0
    if which == 4:
        return sign | draw(1, (1 << m) - 1)  # subnormal
    if which == 5:
        return sign | 1  # the smallest subnormal
    return sign | (exp_all - (1 << m)) | ((1 << m) - 1)  # the largest finite


def inject_specials(draw: IntSource, x: np.ndarray, count: int) -> None:
    """Write ``count`` specials (NaN payloads, Inf, +-0, subnormals, the largest finite) at
    drawn positions of the float array ``x``, in place, through its bit pattern."""
    b = bits(x).reshape(-1)
    width = x.dtype.itemsize * 8
    for _ in range(count):
        b[draw(0, b.size - 1)] = _special_bits(draw, width)


# ---------------------------------------------------------------------------------
# Cases.
# ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CommitCase:
    """One commit case's host data (NumPy), before anything ran."""

    shape: CaseShape
    pool: np.ndarray  # [L, S, HV, V, K], state dtype
    inputs: dict[str, np.ndarray]  # q, k, v, a, b [L*N, D, ...], input dtype; A_log, dt_bias [HV] f32
    idx: CommitIndices
    filler: tuple[Tuples, Snapshots]  # stale scratch rows [L, R, D, ...], never zeros
    kind: str
    specials: dict[str, int]  # input name -> specials written

    @property
    def state0(self) -> np.ndarray:
        """``[L*N, HV, V, K]``: each request's pre-verify state (an in-range slot's stand-in if
        its slot is out of range: commit skips that request)."""
        sl = np.clip(self.idx.slots, 0, self.shape.slots - 1)
        return self.pool[:, sl].reshape(-1, *self.pool.shape[2:])


def draw_case(draw: IntSource, shape: CaseShape, *, specials: int = 0, where: Iterable[str] = VERIFY_INPUTS) -> CommitCase:
    """One case of ``shape``: data from a drawn seed, indices from :func:`draw_indices`.

    The pool holds random states (``N(0, 0.25)``) with each valid request's state0 (of a
    drawn input kind: normal, cancel, decay extremes, subnormal, mixed) in its slot.
    ``specials`` > 0 writes up to that many specials into each input named in ``where``.
    """
    s, f = shape, shape.family
    L, N, D, S, R = s.layers, s.requests, s.drafts, s.slots, s.rows
    idx = draw_indices(draw, N, D, S, R)
    kind = KINDS[draw(0, len(KINDS) - 1)]
    rng = np.random.default_rng(draw(0, 2**31 - 1))
    x = verify_inputs_numpy(rng, s.verify_shape, kind=kind)
    sdt, idt = jnp.dtype(s.state_dtype), jnp.dtype(s.input_dtype)
    normal = lambda *shp: rng.standard_normal(shp, dtype=np.float32)  # noqa: E731

    pool = (0.5 * normal(L, S, f.HV, f.V, f.K)).astype(sdt)
    ok = (idx.slots >= 0) & (idx.slots < S)
    state0 = x["state0"].astype(sdt).reshape(L, N, *pool.shape[2:])
    pool[:, idx.slots[ok]] = state0[:, ok]
    inputs = {n: x[n].astype(idt) for n in ("q", "k", "v", "a", "b")}
    inputs |= {n: x[n].astype(np.float32) for n in ("A_log", "dt_bias")}
    written = {}
    if specials:
        for name in where:
            arr = pool if name == "pool" else inputs[name]
            written[name] = draw(1, specials)
            inject_specials(draw, arr, written[name])
    filler = (
        Tuples(u=normal(L, R, D, f.HV, f.V), k=normal(L, R, D, f.H, f.K), g=-np.abs(normal(L, R, D, f.HV))),
        Snapshots(normal(L, R, D, f.HV, f.V, f.K).astype(sdt)),
    )
    return CommitCase(s, pool, inputs, idx, filler, kind, written)


def _place_rows(filler, tape, idx: CommitIndices, L: int, N: int):
    """The scratch buffer ``[L, R, ...]``: ``tape`` (``[L*N, ...]``, layer-major) at each
    request's in-range row, the stale filler elsewhere."""

    def place(buf, t):
        out = np.array(buf, copy=True)
        t = np.asarray(t).reshape(L, N, *t.shape[1:])
        ok = (idx.rows >= 0) & (idx.rows < out.shape[1])
        out[:, idx.rows[ok]] = t[:, ok]
        return out

    return jax.tree.map(place, filler, tape)
