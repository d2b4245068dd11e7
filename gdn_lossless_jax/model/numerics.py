"""The model's arithmetic primitives, and its invariant decoding mode.

:func:`matmul`, :func:`einsum` and :func:`softmax` at the model's precision; with
``invariant=True`` (:attr:`~gdn_lossless_jax.model.model.ModelConfig.invariant_dots`) each
computes a row (a query) in an operation of one shape whatever the number of rows (queries) a
call has, so that a position's bits depend on the position only: across meshes, batches and the
number of tokens a step verifies (docs/sharding.md, docs/decoding.md).
:func:`transcendental` computes the model's elementwise functions in float64 in that mode;
:func:`per_query_attention` is its attention. The layers in :mod:`.model` call these.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp
import numpy as np

from ..reference import pairwise_sum

__all__ = [
    "settle",
    "softmax",
    "transcendental",
    "dot_precision",
    "INVARIANT_ROWS",
    "rows_mesh",
    "matmul",
    "einsum",
    "per_query_attention",
]

F32 = jnp.float32


def check_invariant(invariant, owner: str) -> None:
    """A model config's ``invariant`` field must be None, True or False (``owner`` names the config in
    the ValueError). :class:`~gdn_lossless_jax.model.model.ModelConfig` and
    :class:`~gdn_lossless_jax.model.hf.config.HFConfig` check theirs with it."""
    if invariant not in (None, True, False):
        raise ValueError(f"{owner}: invariant must be None, True or False, got {invariant!r}")


def invariant_mode(invariant: bool | None, owner: str) -> bool:
    """Whether a model's dots run in the invariant mode, given its config's ``invariant``: that value,
    or when it is None, whether JAX's default backend is the CPU (read when a step is traced).
    :attr:`ModelConfig.invariant_dots <gdn_lossless_jax.model.model.ModelConfig.invariant_dots>` and
    :attr:`HFConfig.invariant_dots <gdn_lossless_jax.model.hf.config.HFConfig.invariant_dots>` are this.

    Raises NotImplementedError (naming ``owner``) for ``invariant=True`` on another platform: only
    XLA:CPU's blocked dots are established (a GPU needs its own, e.g. a Pallas matmul of fixed tiles)."""
    platform = jax.default_backend()
    if invariant is None:
        return platform == "cpu"
    if invariant and platform != "cpu":
        raise NotImplementedError(
            f"{owner}: invariant=True is implemented for the CPU only (JAX's default backend is "
            f"{platform!r}); use invariant=None or False there"
        )
    return invariant


def settle(x, invariant: bool):
    """In the invariant mode (``invariant``), ``x`` behind an optimization barrier: rounded to its dtype
    here in every program. XLA may otherwise drop a bfloat16 rounding between two float32 computations
    (a ``convert`` to bf16 and straight back: its *excess precision*) in one program and keep it in
    another, where a sharding constraint, a ``shard_map`` or a fusion boundary sits between them; and no
    product before the barrier is contracted into an add after it."""
    return jax.lax.optimization_barrier(x) if invariant else x


def _float64_scope():
    try:
        from jax import enable_x64
    except ImportError:  # older JAX: the experimental name
        from jax.experimental import enable_x64
    return enable_x64(True)


_TRANSCENDENTALS = {
    "exp": (jnp.exp, jnp.exp),
    "rsqrt": (jax.lax.rsqrt, lambda v: 1.0 / jnp.sqrt(v)),
    "sigmoid": (jax.nn.sigmoid, lambda v: 1.0 / (1.0 + jnp.exp(-v))),
    "silu": (jax.nn.silu, lambda v: v / (1.0 + jnp.exp(-v))),
    "cos": (jnp.cos, jnp.cos),
    "sin": (jnp.sin, jnp.sin),
}


def transcendental(name: str, x: jax.Array, invariant: bool = False) -> jax.Array:
    """The model's elementwise ``name`` (``"exp"``, ``"rsqrt"``, ``"sigmoid"``, ``"silu"``, ``"cos"``,
    ``"sin"``) of an fp32 ``x``: XLA's float32 function, or in the invariant mode (``invariant``) the
    same in float64, rounded to float32 once.

    XLA:CPU's float32 functions can give an element other bits depending on the array they run over
    (the vectorised loop's body and remainder, an approximate ``rsqrt`` refined by Newton steps in
    large fusions), and the D-token verify's arrays ``[N, D, ...]`` are not the one-token decode's
    ``[N, 1, ...]``. Measured in isolation: ``jax.lax.rsqrt`` over ``[64, 1]`` and element by
    element, 10 of 64 differ under jax 0.11.2; ``jax.nn.sigmoid`` over ``[3, 8, 5]`` and ``[3, 1,
    5]``, 1 of 120 under 0.12.1; ``jnp.exp``: :func:`gdn_lossless_jax.rounding.exp`. In float64 (as
    ``rounding.exp`` computes the library's gates and conv), a result that differs between two loops
    by an ULP of its own rounds to the same float32 except within that ULP of a float32 rounding
    boundary: an element's bits depend on the element only.
    """
    platform_fn, f64_fn = _TRANSCENDENTALS[name]
    if not invariant:
        return platform_fn(x)
    with _float64_scope():
        return f64_fn(x.astype(F32).astype(jnp.float64)).astype(F32)


def softmax(x: jax.Array, *, invariant: bool = False) -> jax.Array:
    """Softmax over the last axis (fp32 in, fp32 out), its sum in a fixed order.

    ``jax.nn.softmax`` leaves two choices to XLA, and XLA:CPU made them per program: in the
    demo's attention (scores ``[N, nkv, r, T, Tmax]``, Tmax = 64) one device's step (N = 4)
    handed the max to YNNPACK in one fusion with the subtract and the ``exp`` behind it, and the
    sum of the exponentials to YNNPACK whole; a step on a mesh with a data axis of 2 (N = 2 per
    device) computed the max as a 32-wide ``reduce-window`` and a ``reduce``, the ``exp`` in an
    XLA loop fusion and the sum again split in two. So the ``exp`` came from two implementations
    and the sum in two orders: other bits in the probabilities, the logits and the top-2 gaps.
    Here the max goes through an optimization barrier (the max is exact in any order, but the
    barrier keeps the ``exp`` out of its fusion: the barrier that made the 1 x 2 and 2 x 2
    meshes identical to one device), the exponentials through another (computed once, and no
    later fusion takes them in: a precaution), and they are summed as a fixed pairwise tree
    (:func:`gdn_lossless_jax.reference.pairwise_sum`). A row must have a finite entry (the
    attention's always has: position 0). ``invariant``: the ``exp`` in float64 (:func:`transcendental`).
    """
    m = jax.lax.optimization_barrier(jnp.max(x, axis=-1, keepdims=True))
    e = jax.lax.optimization_barrier(transcendental("exp", x - m, invariant))
    return e / pairwise_sum(e)[..., None]


def dot_precision(*operands) -> jax.lax.Precision | None:
    """The precision of a matmul of ``operands``: ``Precision.HIGHEST`` when they are all float32,
    else None (the default).

    JAX's default precision lets a GPU multiply float32 operands in TF32 (or bf16 passes): a
    float32 model's logits then moved by up to 3.85 against transformers' on an H200. HIGHEST
    keeps float32 products in float32 on every platform (XLA:CPU computes float32 dots in float32
    either way); bf16 operands keep the default, as a bf16 model wants.
    """
    return jax.lax.Precision.HIGHEST if all(jnp.result_type(x) == F32 for x in operands) else None


#: Rows of the fixed-shape blocks of the invariant mode's matmuls (:func:`matmul`): every row of
#: ``a`` is computed in a ``[INVARIANT_ROWS, K] x [K, N]`` dot, whatever the number of rows.
INVARIANT_ROWS = 8


_ROWS_MESH: contextvars.ContextVar = contextvars.ContextVar("gdn_lossless_jax_rows_mesh", default=None)


@contextlib.contextmanager
def rows_mesh(mesh: jax.sharding.Mesh | None, axis: str | None):
    """While tracing inside: the invariant mode's dots (:func:`matmul`, :func:`einsum` with
    ``invariant=True``) run per device under ``shard_map`` over all of ``mesh``'s axes, their
    leading (row) axis split over ``axis`` (when it divides; else every device computes all rows)
    and everything else whole: XLA's partitioner can then split neither a dot's contraction
    (partial sums and an all-reduce) nor its columns (a narrower dot: another blocking) over the
    other axes; an operand split over them is gathered first. :class:`~gdn_lossless_jax.model.decode.SpecStep`
    traces its body inside this on a mesh. ``mesh=None``: no effect."""
    token = _ROWS_MESH.set(None if mesh is None else (mesh, axis))
    try:
        yield
    finally:
        _ROWS_MESH.reset(token)


def _per_device(fn, rows: tuple, whole: tuple = ()):
    """``fn(*rows, *whole)`` under :func:`rows_mesh`'s ``shard_map`` (``rows``: split by their
    leading axis; ``whole``: on every device whole), or as it is outside one."""
    ctx = _ROWS_MESH.get()
    if ctx is None:
        return fn(*rows, *whole)
    from ..sharding import shard_map

    mesh, axis = ctx
    P = jax.sharding.PartitionSpec
    split = P(axis) if axis is not None and rows[0].shape[0] % mesh.shape[axis] == 0 else P()
    return shard_map(fn, mesh=mesh, in_specs=(split,) * len(rows) + (P(),) * len(whole), out_specs=split,
                     check_vma=False)(*rows, *whole)  # fmt: skip


def matmul(a: jax.Array, b: jax.Array, *, invariant: bool = False, **kwargs) -> jax.Array:
    """``a @ b`` at :func:`dot_precision` (float32 products in float32); ``kwargs`` to ``jnp.matmul``.

    ``invariant=True`` (the model's invariant mode, :attr:`ModelConfig.invariant_dots`; ``b`` a
    matrix ``[K, N]``): each row of ``a`` is computed in the same dot whatever the number of rows.
    XLA:CPU picks a dot's blocking (YNNPACK's, Eigen's) per shape, and so the order of each
    element's sum over K: a row of a ``[2, 64] x [64, 4]`` dot got other bits than the same row
    of a ``[4, 64] x [64, 4]`` one (jax 0.12.1). Here the rows of ``a`` (all leading axes, M of
    them) are padded with zeros to whole blocks of :data:`INVARIANT_ROWS` and the blocks run one
    at a time in a loop (``lax.map``), each block's dot ``[INVARIANT_ROWS, K] x [K, N]`` between
    optimization barriers (no fusion takes a producer or consumer into it): one shape, so one
    blocking, for every row of every call. A row's bits then depend on the row and ``b`` only
    (in the runs: not on its place in the block or the other rows), not on M. Inside
    :func:`rows_mesh` (a step on a mesh) the blocks run per device, the rows split over the data
    axis, so that the partitioner cannot split a block's dot either.
    """
    if invariant:
        if np.ndim(a) < 2:
            return _blocked_matmul(a, b, **kwargs)
        return _per_device(lambda x, w: _blocked_matmul(x, w, **kwargs), (a,), (b,))
    return jnp.matmul(a, b, precision=dot_precision(a, b), **kwargs)


def _blocked_matmul(a: jax.Array, b: jax.Array, **kwargs) -> jax.Array:
    if np.ndim(b) != 2 or np.ndim(a) < 1 or a.shape[-1] != b.shape[0]:
        raise ValueError(f"matmul(invariant=True): arguments must be [..., K] and [K, N], got shapes "
                         f"{list(np.shape(a))} and {list(np.shape(b))}")  # fmt: skip
    lead, (K, N), B = a.shape[:-1], b.shape, INVARIANT_ROWS
    M = math.prod(lead)
    blocks = max(1, -(-M // B))
    x = jnp.pad(a.reshape(M, K), ((0, blocks * B - M), (0, 0))).reshape(blocks, B, K)
    precision = dot_precision(a, b)

    def block(xb):
        xb = jax.lax.optimization_barrier(xb)
        return jax.lax.optimization_barrier(jnp.matmul(xb, b, precision=precision, **kwargs))

    y = jax.lax.map(block, x)
    return y.reshape(blocks * B, N)[:M].reshape(*lead, N)


def einsum(spec: str, a: jax.Array, b: jax.Array, *, invariant: bool = False, **kwargs) -> jax.Array:
    """``jnp.einsum`` of two operands at :func:`dot_precision`.

    ``invariant=True``: the leading axis of both operands and the result must be one batch axis
    (the model's rows: ``"ntgrh,nsgh->ngrts"``); the einsum runs one row at a time in a loop
    (``lax.map``, each row's einsum between optimization barriers), so each row's dot has one
    shape whatever the number of rows (see :func:`matmul`; inside :func:`rows_mesh` per device too)."""
    if not invariant:
        return jnp.einsum(spec, a, b, precision=dot_precision(a, b), **kwargs)
    ins, _, out = spec.replace(" ", "").partition("->")
    sa, _, sb = ins.partition(",")
    if not (out and sa and sb and sa[0] == sb[0] == out[0]) or sa[0] in sa[1:] + sb[1:] + out[1:]:
        raise ValueError(f"einsum(invariant=True): the operands and the result must share their leading axis (the "
                         f"rows), as in 'ntgrh,nsgh->ngrts'; got {spec!r}")  # fmt: skip
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"einsum(invariant=True): the operands' leading axes differ: shapes {list(a.shape)} and "
                         f"{list(b.shape)}")  # fmt: skip
    row_spec, precision = f"{sa[1:]},{sb[1:]}->{out[1:]}", dot_precision(a, b)

    def row(xy):
        x, y = jax.lax.optimization_barrier(xy)
        return jax.lax.optimization_barrier(jnp.einsum(row_spec, x, y, precision=precision, **kwargs))

    return _per_device(lambda x, y: jax.lax.map(row, (x, y)), (a, b))


def _query_attention(q: jax.Array, keys: jax.Array, vals: jax.Array, position: jax.Array,
                     scale: float | None = None) -> jax.Array:  # fmt: skip
    """One query's attention, ``q [nkv, r, hd]`` over ``keys``, ``vals [Tmax, nkv, hd]`` up to
    ``position`` (a scalar): ``[nkv, r, hd]`` fp32. Its operands and result behind optimization
    barriers: every query of every program computes this same function of the same shapes. The
    values past ``position`` are zeroed (another step may have written other ones there: a chunk's
    later tokens, a rejected draft's), so the value dot's operands are the same bits in every
    program, its masked terms included. ``scale``: None, the scores divided by ``sqrt(hd)``; a number,
    the scores multiplied by it (transformers' ``scaling``, as the checkpoint models have it)."""
    q, keys, vals, position = jax.lax.optimization_barrier((q, keys, vals, position))
    hd, Tmax = q.shape[-1], keys.shape[0]
    seen = jnp.arange(Tmax) <= position
    scores = jnp.einsum("grh,sgh->grs", q, keys, precision=dot_precision(q, keys), preferred_element_type=F32)
    scores = jnp.where(seen, scores / math.sqrt(hd) if scale is None else scores * scale, -jnp.inf)
    probs = softmax(scores, invariant=True).astype(vals.dtype)
    vals = jnp.where(seen[:, None, None], vals, jnp.zeros((), vals.dtype))
    out = jnp.einsum("grs,sgh->grh", probs, vals, precision=dot_precision(probs, vals), preferred_element_type=F32)
    return jax.lax.optimization_barrier(out)


def per_query_attention(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, positions: jax.Array,
                        tree=None, *, scale: float | None = None) -> jax.Array:  # fmt: skip
    """The invariant mode's attention: each query alone (:func:`_query_attention`), whatever the
    number of queries a step carries.

    The batched einsums (``"ntgrh,nsgh->ngrts"`` and back) put a row's T queries into one dot whose
    XLA:CPU blocking, and so each score's order over ``hd``, depends on T: the D-token verify and the
    one-token decode got other scores for the same query (``scripts/mesh_diff.py --against 1``). Here
    a loop over the rows and, inside, over their queries (``lax.map``) computes each query's scores,
    softmax and value sum in dots of one shape over the whole cache row, masked at its position.

    Args:
      q: ``[N, T, nkv, r, hd]``; cache_k, cache_v: ``[N, Tmax, nkv, hd]``, with a chain's new
        entries written; positions: ``[N, T]``, each query's position (it attends to ``<=``).
      tree: None (a chain), or ``(k, v [N, T, nkv, hd], ancestors [N, T, T])`` for a draft tree whose
        nodes are not in the cache: each node's query sees the cache with its root path's keys and
        values written at their positions (its ancestors', ``positions`` of them), as the chain of
        that path would have written them.
      scale: the scores' scale: None, divided by ``sqrt(hd)`` (the demo model's); a number, multiplied
        by it (the checkpoint models': transformers' ``head_dim ** -0.5``).
    Returns:
      ``[N, T, nkv, r, hd]`` fp32.
    """
    Tmax = cache_k.shape[1]

    def row(args):
        if tree is None:
            qr, kr, vr, pr = args
            return jax.lax.map(lambda qp: _query_attention(qp[0], kr, vr, qp[1], scale), (qr, pr))
        qr, kr, vr, pr, kn, vn, anc = args

        def node(qpa):
            qi, pi, ai = qpa
            at = jnp.where(ai, pr, Tmax)  # the node's root path at its positions; the rest dropped
            keys, vals = kr.at[at].set(kn, mode="drop"), vr.at[at].set(vn, mode="drop")
            return _query_attention(qi, keys, vals, pi, scale)

        return jax.lax.map(node, (qr, pr, anc))

    rows = (q, cache_k, cache_v, positions) + (() if tree is None else tuple(tree))
    return _per_device(lambda *xs: jax.lax.map(row, xs), rows)
