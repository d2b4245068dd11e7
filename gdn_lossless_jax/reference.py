"""The pure-JAX reference: the specification every backend is tested against.

Runs on any XLA platform. Shapes (per GDN layer; N requests, D draft steps, H q/k
heads, HV v-heads, K key dim, V value dim)::

    state0 [N, HV, V, K]  q, k [N, D, H, K]  v [N, D, HV, V]  a, b [N, D, HV]
    A_log, dt_bias [HV]   outputs [N, D, HV, V]

One step, per request n, v-head hv (q/k head ``h = hv // (HV // H)``) and draft step t,
on the fp32 state ``S [V, K]`` (the numbers are the ones other modules cite as "step N")::

    1. gates    g_t = -exp(A_log) * softplus(a_t + dt_bias)   (softplus(x) = x above 20)
                beta_t = 1 / (1 + exp(-b_t))                   (kept in fp32)
    2. norms    q = q / sqrt(sum(q*q) + 1e-6) * scale,  k = k / sqrt(sum(k*k) + 1e-6)
    3. decay    Sd = rn(S * exp(g_t))                          (one rounded multiply)
    4. delta    u = beta_t * (v_t - Sd @ k)                    (a reduction over K)
    5. update   S' = fma(k, u, Sd)  elementwise: S'[v, k] = fma(k[k], u[v], Sd[v, k])
    6. output   o_t = S' @ q                                   (reads the updated state)

The state update (steps 3 and 5) goes through :func:`gdn_lossless_jax.rounding.apply_rule`,
pinned, so a tuple replay ``S_t = fma(k_t, u_t, rn(S_{t-1} * exp(g_t)))`` reproduces the
snapshots bit for bit on every platform. Everything else (gates, norms, the ``Sd @ k`` and
``S' @ q`` reductions) is plain fp32 XLA: it feeds the tape, so replay never recomputes it. Its
sums over K (the norms', ``Sd @ k`` and ``S' @ q``) are a fixed pairwise tree (:func:`ksum`) on
every platform, so that every program (each record mode, each shard of a mesh of any shape)
gives one device's bits.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from . import _deprecated, portable, rounding
from .tape import Tape, Tuples, record_type

__all__ = [
    "gates",
    "ksum",
    "pairwise_sum",
    "l2norm",
    "prepare",
    "gdn_step",
    "verify",
    "tree_chain",
    "replay",
    "replay_two",
    "commit",
    "commit_masks",
    "in_range",
    "scatter_slots",
    "apply_pending",
    "path_steps",
    "along_path",
    "read_slots",
    "write_rows",
    "verify_form",
    "scale_beta",
    "DECAYS",
    "input_ranks",
]

F32 = jnp.float32
SOFTPLUS_THRESHOLD = 20.0
L2NORM_EPS = 1e-6
#: The ``math=`` modes: ``"platform"`` (the platform's exp and log, XLA's arithmetic outside the
#: pinned rule: bit-exact on the platform that recorded) and ``"portable"``
#: (:mod:`gdn_lossless_jax.portable`: the same bits on every platform).
MATH_MODES = ("platform", "portable")


def exp_fn(math: str = "platform") -> Callable:
    """The decay's ``exp`` of a ``math=`` mode: verify and replay call the same one."""
    return portable.exp if math == "portable" else rounding.exp


def gates(a, b, A_log, dt_bias, *, math: str = "platform", beta_scale: float = 1.0):
    """Decay and write gates, in fp32 (step 1 of the module docstring).

    ``g = -exp(A_log) * softplus(a + dt_bias)`` with softplus ``log(1 + exp(x))`` up to
    ``x > 20`` and ``x`` above; ``beta = 1 / (1 + exp(-b))`` times ``beta_scale`` (:func:`scale_beta`), kept
    in fp32.

    Args:
      a, b: ``[..., HV]``; or, for a per-channel decay (KDA, :mod:`gdn_lossless_jax.kda`), a
        ``[..., HV, K]`` (one axis more than ``b``: each key channel its own decay).
      A_log: ``[HV]``. dt_bias: ``[HV]`` (``[HV, K]`` with a per-channel decay).
      beta_scale: a static factor of beta (OLMo-Hybrid's ``linear_allow_neg_eigval``: 2.0, beta
        in (0, 2)); applied after the sigmoid, exactly for a power of two.
    Returns:
      ``(g, beta)``: g shaped like ``a``, beta like ``b``, float32.
    """
    if math == "portable":
        g, beta = portable.gates(a, b, A_log, dt_bias)
    else:
        x = a.astype(F32) + dt_bias.astype(F32)
        sp = jnp.where(x > SOFTPLUS_THRESHOLD, x, rounding.log(1.0 + rounding.exp(x)))
        A = rounding.exp(A_log.astype(F32))
        g = -(A[..., None] if jnp.ndim(a) > jnp.ndim(b) else A) * sp
        beta = 1.0 / (1.0 + rounding.exp(-b.astype(F32)))
    return g, scale_beta(beta, beta_scale, math)


def scale_beta(beta, beta_scale: float, math: str = "platform"):
    """``beta * beta_scale`` (a static Python float; 1.0 leaves beta as it is, no multiply). One
    rounded multiply (``math="portable"``: :func:`gdn_lossless_jax.rounding.mul_rn`); exact for a power
    of two."""
    if beta_scale == 1.0:
        return beta
    scale = jnp.asarray(beta_scale, F32)
    return rounding.mul_rn(beta, scale) if math == "portable" else beta * scale


def ksum(x):
    """Sum over the last axis in a fixed order, on every platform: the terms behind an
    optimization barrier, then :func:`pairwise_sum`.

    Not ``jnp.sum``: XLA picks the order of a ``reduce`` per compiled program, from its
    operand's shape and layout. On a GPU the two record modes' programs summed in different
    orders; on XLA:CPU one device's program and each shard's of a mesh did (the K terms handed
    to YNNPACK whole for one shape, split into a 32-wide ``reduce-window`` and a second
    ``reduce`` for another: other bits in the outputs and the tape on an 8-way tensor axis).
    Elementwise adds leave the compiler no order to choose. The barrier materialises the terms
    (``x`` is a product: ``q * q``, ``Sd * k``, ``S' * q``), so that no program contracts one of
    them into the first add (XLA:CPU makes an FMA where a multiply and an add land in one
    fusion; XLA:GPU never contracts, so there the barrier changes no bit) and XLA does not fuse
    the pinned state update that produces ``Sd`` and ``S'`` into every level of the tree. (These
    sums feed the tape; the replay rule never recomputes them.)
    """
    return pairwise_sum(lax.optimization_barrier(x))


def pairwise_sum(x):
    """Sum over the last axis as a fixed pairwise tree of elementwise adds, on every platform.

    The last axis is zero-padded to a power of two ``p``, then halved: ``x[..., :p/2] +
    x[..., p/2:]`` until one element is left. The order is the program's, not the compiler's:
    XLA picks the order of a ``reduce`` per compiled program (:func:`ksum` says where that bit).

    >>> import numpy as np
    >>> float(pairwise_sum(jnp.array([1.0, 2.0, 3.0])))
    6.0
    >>> x = np.float32([1e8, 1.0, -1e8, 1.0])  # (1e8 + -1e8) + (1 + 1), not ((1e8 + 1) + -1e8) + 1
    >>> float(pairwise_sum(jnp.asarray(x)))
    2.0
    """
    n = x.shape[-1]
    p = 1 << max(n - 1, 0).bit_length()
    if p != n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, p - n)])
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


def l2norm(x, *, math: str = "platform"):
    """``x / sqrt(sum(x * x) + 1e-6)`` over the last axis, in fp32 (step 2).

    (In float64 for a float64 ``x``: the plain formulation of gdn_lossless_jax.autodiff.)
    """
    if math == "portable":
        return portable.l2norm(x, L2NORM_EPS)
    x = x.astype(jnp.promote_types(F32, x.dtype))
    return x / jnp.sqrt(ksum(x * x)[..., None] + L2NORM_EPS)


def prepare(q, k, a, b, A_log, dt_bias, scale, *, math: str = "platform", beta_scale: float = 1.0):
    """Everything outside the state chain: normalised q (scaled), k, and the gates (:func:`gates`).

    Returns ``(qn [N, D, H, K], kn [N, D, H, K], g [N, D, HV] (or [N, D, HV, K]: a per-channel
    decay), beta [N, D, HV])``, fp32.
    """
    if math == "portable":  # q and k normed as one array: one compiled norm
        qn, kn = l2norm(jnp.stack([portable.to_float32(q), portable.to_float32(k)]), math=math)
        qn = rounding.mul_rn(qn, jnp.asarray(scale, F32))
        g, beta = gates(a, b, A_log, dt_bias, math=math, beta_scale=beta_scale)
        return qn, kn, g, beta
    qn = l2norm(q) * jnp.asarray(scale, F32)
    kn = l2norm(k)
    g, beta = gates(a, b, A_log, dt_bias, beta_scale=beta_scale)
    return qn, kn, g, beta


def _expand_heads(x, hv: int):
    """``[..., H, K] -> [..., HV, K]``: v-head ``hv`` reads q/k head ``hv // (HV // H)``."""
    return jnp.repeat(x, hv // x.shape[-2], axis=-2)


def gdn_step(S, x, *, mul: Callable = rounding.mul_rn, fma: Callable = rounding.fma_rn, math: str = "platform"):
    """One GDN step as a state transition ``S -> S'`` (steps 3-6), per request and v-head.

    Args:
      S: ``[..., HV, V, K]`` float32 state before the step.
      x: ``(q, k, v, g, beta)`` with q, k ``[..., HV, K]`` (normalised, q scaled),
        v ``[..., HV, V]``, g and beta ``[..., HV]`` (g ``[..., HV, K]``: a per-channel decay,
        KDA's; :func:`gdn_lossless_jax.rounding.decay_factor`), all float32.
      mul, fma: the rounding primitives (the portable, pinned ones by default).
      math: ``"portable"``: the decay by :func:`gdn_lossless_jax.portable.exp`, every other
        operation correctly rounded too (``mul_rn``, ``add_rn``, the sums by
        :func:`gdn_lossless_jax.portable.pairwise_sum`, :func:`ksum`'s tree).
    Returns:
      ``(S', (o, u))``: the new state and the step's output ``o = S' @ q`` and
      ``u = beta * (v - Sd @ k)``, both ``[..., HV, V]``.
    """
    q, k, v, g, beta = x
    if math == "portable":
        return _portable_step(S, x)
    alpha = rounding.exp(g)
    Sd = rounding.decay(S, rounding.decay_factor(S, alpha), mul=mul)
    u = beta[..., None] * (v - ksum(Sd * k[..., None, :]))
    S_new = rounding.update(Sd, k, u, fma=fma)
    o = ksum(S_new * q[..., None, :])
    return S_new, (o, u)


def _portable_step(S, x):
    """:func:`gdn_step` with ``math="portable"``: the same bits on every platform."""
    q, k, v, g, beta = x
    Sd = rounding.decay(S, rounding.decay_factor(S, portable.exp(g)))
    u = rounding.mul_rn(beta[..., None], rounding.add_rn(v, portable.neg(portable.dot(Sd, k))))
    S_new = rounding.update(Sd, k, u)
    return S_new, (portable.dot(S_new, q), u)


def verify(state0, q, k, v, a, b, A_log, dt_bias, *, record: str | type[Tape] = Tuples, scale: float, out_dtype=None,
           parents=None, math: str = "platform", beta_scale: float = 1.0):  # fmt: skip
    """Run the D draft steps as a ``lax.scan`` of :func:`gdn_step`; ``state0`` is not modified.

    Returns ``(outputs [N, D, HV, V], tape)``: the tape of the record mode ``record`` (its class,
    or its name), e.g. :class:`Tuples` (``u``, ``k`` per q/k head, ``g``; fp32) or
    :class:`~gdn_lossless_jax.tape.Snapshots` (the state after every step, rounded to
    ``state0.dtype``); :meth:`~gdn_lossless_jax.tape.Tape.recorded` keeps what the mode keeps of
    the steps. The outputs do not depend on ``record``. With ``parents``
    (``[N, D]`` int32, :mod:`gdn_lossless_jax.tree`) the D drafts are the nodes of a tree
    (:func:`tree_chain`); None is the linear chain. ``math``: one of :data:`MATH_MODES`
    (:func:`gdn_lossless_jax.verify`). A per-channel decay (KDA: ``a [N, D, HV, K]``, ``dt_bias
    [HV, K]``) records ``g [N, D, HV, K]``, its tuples a :class:`~gdn_lossless_jax.tape.KDATuples`
    tape (``record`` the class, or ``"tuples"`` resolved for the decay by the API);
    ``beta_scale`` multiplies beta (:func:`gates`).
    """
    qn, kn, g, beta = prepare(q, k, a, b, A_log, dt_bias, scale, math=math, beta_scale=beta_scale)
    step = gdn_step if math == "platform" else functools.partial(gdn_step, math=math)
    if parents is not None:
        return tree_chain(state0, qn, kn, v, g, beta, parents, record=record, out_dtype=out_dtype or q.dtype, step=step)
    return chain(state0, qn, kn, v, g, beta, record=record, out_dtype=out_dtype or q.dtype, step=step)


def chain(state0, qn, kn, v, g, beta, *, record: str | type[Tape], out_dtype, step: Callable = gdn_step):
    """The state chain of :func:`verify` from prepared inputs (:func:`prepare`), in ``qn``'s dtype.

    ``step`` is the state transition (:func:`gdn_step` with the pinned rule; the plain-float
    formulation of :mod:`gdn_lossless_jax.autodiff` passes one without pinned rounding).
    """
    dtype = qn.dtype
    HV = v.shape[2]
    xs = (_expand_heads(qn, HV), _expand_heads(kn, HV), v.astype(dtype), g, beta)
    xs = jax.tree.map(lambda t: jnp.moveaxis(t, 1, 0), xs)  # scan over D

    def body(S, x):
        S_new, (o, u) = step(S, x)
        return S_new, (o, u, S_new)

    # One program for both record modes: the scan emits the outputs, u and the fp32 states,
    # and the barrier keeps XLA from pruning the unused ones. Otherwise XLA compiles the
    # two modes' loops differently (on XLA:GPU that changes the order of the K-term
    # reductions: outputs and u differ between modes). The states are rounded to the pool
    # dtype after the loop: rounding bf16 inside it makes XLA:CPU's compile hang.
    # The reference thus materialises the snapshots in tuples mode too: it is the
    # specification, not the memory-lean path.
    _, ys = lax.scan(body, state0.astype(dtype), xs)
    o, u, states = (jnp.moveaxis(y, 0, 1) for y in lax.optimization_barrier(ys))
    states = states.astype(state0.dtype)
    outputs = o.astype(out_dtype)
    return outputs, record_type(record).recorded(u=u, k=kn, g=g, states=states)


def tree_chain(state0, qn, kn, v, g, beta, parents, *, record: str | type[Tape], out_dtype,
               step: Callable = gdn_step):
    """:func:`chain` for a draft tree: node d's state is ``step`` of its parent's state (``state0`` for
    a parent of -1) and node d's inputs.

    ``parents`` ``[N, D]`` int32, each ``parents[n, d]`` in ``[-1, d)`` (topological order;
    :mod:`gdn_lossless_jax.tree`; a value outside is clipped into ``[-1, d)``, so an unchecked bad
    parent gives some other node's state, never garbage memory). The scan walks the nodes in order,
    carrying every node's fp32 state (``[N, D+1, HV, V, K]``, slot 0 the root): the state a node
    reads is the very fp32 value its parent's step produced, and each step is :func:`gdn_step`, so
    the states along a root-to-node path are bit for bit those of :func:`chain` run on that path's
    inputs. The tape and the outputs are per node, as :func:`chain`'s are per step.
    """
    dtype = qn.dtype
    N, D = v.shape[:2]
    HV = v.shape[2]
    xs = (_expand_heads(qn, HV), _expand_heads(kn, HV), v.astype(dtype), g, beta)
    xs = jax.tree.map(lambda t: jnp.moveaxis(t, 1, 0), xs)
    par = jnp.moveaxis(jnp.asarray(parents, jnp.int32), 1, 0)  # [D, N]
    d_idx = jnp.arange(D, dtype=jnp.int32)
    buf = jnp.zeros((N, D + 1, *state0.shape[1:]), dtype).at[:, 0].set(state0.astype(dtype))
    rows = jnp.arange(N)

    def body(buf, x):
        x, p, d = x
        S = buf[rows, jnp.clip(p + 1, 0, d)]  # the parent's state (slot 0: the root)
        S_new, (o, u) = step(S, x)
        return lax.dynamic_update_index_in_dim(buf, S_new, d + 1, 1), (o, u, S_new)

    # As in chain: one program for both record modes, the states rounded after the loop.
    _, ys = lax.scan(body, buf, (xs, par, d_idx))
    o, u, states = (jnp.moveaxis(y, 0, 1) for y in lax.optimization_barrier(ys))
    states = states.astype(state0.dtype)
    outputs = o.astype(out_dtype)
    return outputs, record_type(record).recorded(u=u, k=kn, g=g, states=states)


#: Each verify input's rank for one layer (in verify's argument order); one more means the input
#: is stacked over the pool's layers and read at ``layer`` (:func:`gdn_lossless_jax.verify`).
INPUT_RANKS = {"q": 4, "k": 4, "v": 4, "a": 3, "b": 3, "A_log": 1, "dt_bias": 1}
#: The ``decay=`` forms: ``"scalar"`` (GDN: one decay per v-head and step) and ``"channel"`` (KDA:
#: one per key channel, ``a [N, D, HV, K]``, ``dt_bias [HV, K]``, the tape's ``g [..., HV, K]``).
DECAYS = ("scalar", "channel")
#: :data:`INPUT_RANKS` of a per-channel decay.
CHANNEL_INPUT_RANKS = {**INPUT_RANKS, "a": 4, "dt_bias": 2}


def input_ranks(decay: str = "scalar") -> dict[str, int]:
    """:data:`INPUT_RANKS` for the ``decay=`` form (:data:`DECAYS`)."""
    return CHANNEL_INPUT_RANKS if decay == "channel" else INPUT_RANKS


def stacked(name: str, x, decay: str = "scalar") -> bool:
    """Whether verify input ``name`` carries a leading layer axis (rank one above one layer's)."""
    return jnp.ndim(x) == input_ranks(decay)[name] + 1


def read_slots(pool, layer, slots):
    """``pool[layer, slots[n]]`` for each request: ``[L, S, HV, V, K] -> [N, HV, V, K]``; a slot
    outside ``[0, S)`` reads zeros (SGLang's padding slots)."""
    S = pool.shape[1]
    idx = jnp.where((slots >= 0) & (slots < S), slots, S)
    return pool.at[layer, idx].get(mode="fill", fill_value=0)


def write_rows(buffer, layer, rows, tape):
    """Request n's tape ``[N, D, ...]`` (a tape, or any pytree of such fields) into ``buffer[layer,
    rows[n], :D]`` (``[L, R, Dmax, ...]``); out-of-range rows write nothing, everything else keeps its bits."""
    R = jax.tree.leaves(buffer)[0].shape[1]
    idx = jnp.where((rows >= 0) & (rows < R), rows, R)
    D = jax.tree.leaves(tape)[0].shape[1]
    return jax.tree.map(lambda b, t: b.at[layer, idx, :D].set(t.astype(b.dtype), mode="drop"), buffer, tape)


def verify_form(call, *, verify_fn: Callable = verify, commit_fn: Callable | None = None):
    """:func:`verify` of a :class:`~gdn_lossless_jax.backends.contract.VerifyCall`, as the backends take it.

    With ``call.pending``, the previous step's commit of this layer first (:func:`commit`), then
    the verify from the pool it leaves; inputs stacked over layers are taken at ``call.layer``;
    the states gathered from the pool (:func:`read_slots`); with ``call.tape``, the tape
    scattered into that buffer (:func:`write_rows`); with ``call.out``, the outputs written into
    it at ``call.out_layer``. Returns ``(outputs, tape)``, and the pool after the pending commit
    when there is one. ``verify_fn`` and ``commit_fn`` (default :func:`verify` and
    :func:`commit`) are what runs: gdn_lossless_jax.autodiff passes its plain formulations.
    """
    commit_fn = commit_fn or commit
    pool, layer = call.pool, jnp.reshape(call.layer, ())
    q, k, v, a, b, A_log, dt_bias = layer_inputs(call)
    p = call.pending
    if p is not None:  # the previous step's commit of this layer, then the verify from the pool it leaves
        pool = apply_pending(call, functools.partial(commit_fn, **_math_kw(call)))
    # a plain state0 (a one-layer pool whose slot n is request n) is read as it is: no gather to partition
    state = read_slots(pool, layer, call.slots) if call.pool_form else pool[0]
    tree = {} if getattr(call, "parents", None) is None else {"parents": call.parents}
    beta = {} if getattr(call, "beta_scale", 1.0) == 1.0 else {"beta_scale": call.beta_scale}
    outputs, new = verify_fn(state, q, k, v, a, b, A_log, dt_bias, record=call.record, scale=call.scale,
                             out_dtype=call.out_dtype, **tree, **_math_kw(call), **beta)  # fmt: skip
    if call.tape is not None:
        new = write_rows(call.tape, call.tape_layer, call.rows, new)
    if call.out is not None:
        out = call.out
        outputs = lax.dynamic_update_index_in_dim(out, outputs.astype(out.dtype), jnp.reshape(call.out_layer, ()), 0)
    return (outputs, new) if p is None else (outputs, new, pool)


def layer_inputs(call) -> tuple:
    """``(q, k, v, a, b, A_log, dt_bias)`` of the call's layer: the inputs stacked over the pool's layers
    (one axis more than one layer's, for the call's decay form) read at ``call.layer``, the others as they are."""
    layer, decay = jnp.reshape(call.layer, ()), getattr(call, "decay", "scalar")
    return tuple(lax.dynamic_index_in_dim(x, layer, 0, keepdims=False) if stacked(n, x, decay) else x
                 for n, x in zip(INPUT_RANKS, call.inputs))  # fmt: skip


def prepare_call(call, rows=None) -> tuple:
    """The kernels' prologue of a call in XLA (KDA's, whose per-channel gates no prologue kernel computes):
    :func:`prepare` of the layer's inputs (:func:`layer_inputs`), and with a tuple tape buffer its ``k`` and
    ``g`` fields with ``kn`` and ``g`` written at ``[tape_layer, rows[n], :D]`` (:func:`write_rows`; ``rows``
    None: ``call.rows``, else ``arange(N)``). Returns ``(qn, kn, g, beta, k buffer, g buffer)``, the buffers
    None without a tuple tape buffer."""
    q, k, _, a, b, A_log, dt_bias = layer_inputs(call)
    qn, kn, g, beta = prepare(q, k, a, b, A_log, dt_bias, call.scale, math=getattr(call, "math", "platform"),
                              beta_scale=getattr(call, "beta_scale", 1.0))  # fmt: skip
    tape = call.tape
    if tape is None or tape.stores_states:
        return qn, kn, g, beta, None, None
    rows = call.rows if rows is None else rows
    rows = jnp.arange(qn.shape[0], dtype=jnp.int32) if rows is None else rows
    tape_layer = jnp.reshape(0 if call.tape_layer is None else call.tape_layer, ())
    kbuf, gbuf = write_rows((tape.k, tape.g), tape_layer, rows, (kn, g))
    return qn, kn, g, beta, kbuf, gbuf


def apply_pending(call, commit_fn: Callable):
    """The pool after ``call.pending``'s commit of the call's layer: ``commit_fn(pool, tape, slots,
    steps, track_slots, track_steps, rows)`` (a one-layer pool and that layer's tape) written back
    at ``call.layer``. What a fused verify computes first; for a backend that does not fuse it
    (:class:`~gdn_lossless_jax.backends.contract.Capabilities` ``fused=False``), what the API runs."""
    p, pool, layer = call.pending, call.pool, jnp.reshape(call.layer, ())
    one = jax.tree.map(lambda x: x[p.layer][None], p.tape)
    committed = commit_fn(pool[layer][None], one, call.slots, p.steps, p.track_slots, p.track_steps, p.rows)
    return lax.dynamic_update_index_in_dim(pool, committed[0], layer, 0)


def _math_kw(call) -> dict:
    """``math=`` for the functions :func:`verify_form` calls, given only where it is not the default."""
    math = getattr(call, "math", "platform")
    return {} if math == "platform" else {"math": math}


def replay_two(state0, tuples: Tuples, steps, track_steps, *, rule: Callable = rounding.apply_rule,
               math: str = "platform"):
    """One pass over the chain that yields the states after ``steps`` and ``track_steps``.

    Args:
      state0: ``[N, HV, V, K]`` (float32 or bfloat16; upcast, results rounded back).
      tuples: ``u [N, D, HV, V]``, ``k [N, D, H, K]``, ``g [N, D, HV]`` (:class:`Tuples`) or
        ``g [N, D, HV, K]`` (:class:`~gdn_lossless_jax.tape.KDATuples`: each key channel's decay
        applied to its column, :func:`gdn_lossless_jax.rounding.decay_factor`).
      steps, track_steps: ``[N]`` int; a value outside ``[0, D)`` means no step (state0).
      rule: the update form (the library's rule; tests pass the controls of
        :data:`gdn_lossless_jax.testing.controls.CONTROLS`).
      math: the decay's ``exp`` (:func:`exp_fn`): the verify's that recorded the tape.
    Returns:
      ``(state after steps, state after track_steps)``, both ``[N, HV, V, K]`` in
      state0's dtype.
    """
    D, HV = tuples.u.shape[1], tuples.u.shape[2]
    # The chain runs in the tape's precision: float32 (the library's tapes are fp32); the
    # plain formulation of gdn_lossless_jax.autodiff runs it in float64 under x64.
    dtype = jnp.promote_types(F32, tuples.u.dtype)
    xs = (
        jnp.moveaxis(tuples.u, 1, 0),
        jnp.moveaxis(_expand_heads(tuples.k, HV), 1, 0),
        jnp.moveaxis(tuples.g, 1, 0),
        jnp.arange(D, dtype=jnp.int32),
    )
    S0 = state0.astype(dtype)
    steps, track_steps = jnp.asarray(steps, jnp.int32), jnp.asarray(track_steps, jnp.int32)
    sel = lambda t, idx: (t == idx)[:, None, None, None]  # noqa: E731

    def body(carry, x):
        S, final, track = carry
        u, k, g, t = x
        # The barrier keeps XLA from fusing the integer fma graph into its three consumers:
        # at D = 1 the scan is inlined and XLA:CPU's compile of a bf16 replay never ends.
        S = lax.optimization_barrier(rule(S, exp_fn(math)(g), k, u))
        return (S, jnp.where(sel(t, steps), S, final), jnp.where(sel(t, track_steps), S, track)), None

    (_, final, track), _ = lax.scan(body, (S0, S0, S0), xs)
    return final.astype(state0.dtype), track.astype(state0.dtype)


def replay(state0, tuples: Tuples, steps, *, rule: Callable = rounding.apply_rule, math: str = "platform"):
    """The state after draft step ``steps[i]`` (0-based) for each request, from ``state0``.

    A step outside ``[0, D)`` (a negative step: nothing accepted) leaves state0 unchanged.
    Shapes as in :func:`replay_two`.
    """
    final, _ = replay_two(state0, tuples, steps, jnp.full_like(jnp.asarray(steps), -1), rule=rule, math=math)
    return final


def in_range(idx, n):
    """Indices outside ``[0, n)`` become ``n`` (dropped by scatters, filled by gathers; never wrapped)."""
    return jnp.where((idx >= 0) & (idx < n), idx, n)


def commit_masks(pool, tape, slots, steps, track_slots, track_steps, rows):
    """Which requests write their accepted and track states (SGLang's scatter rules), the one
    statement of them every commit (SSM, conv, the kernels') follows: ``(valid, accept, track)``,
    ``[N]`` bool. ``tape`` needs only ``num_rows`` and ``num_steps``; ``pool`` only its slots
    (axis 1).

    ``valid``: slot and row in range (else the whole request is skipped); ``accept``: valid and
    the step in ``[0, D)``; ``track``: valid, the track step in ``[0, D)`` and the track slot in
    range."""
    S = pool.shape[1]
    R, D = tape.num_rows, tape.num_steps
    valid = (slots >= 0) & (slots < S) & (rows >= 0) & (rows < R)
    accept = valid & (steps >= 0) & (steps < D)
    track = valid & (track_steps >= 0) & (track_steps < D) & (track_slots >= 0) & (track_slots < S)
    return valid, accept, track


_masks = commit_masks  # (the name other modules used before it was public)


def scatter_slots(pool, dst, ok, states):
    """``pool[:, dst[i]] = states[:, i]`` where ``ok[i]``; other slots keep their bits."""
    idx = jnp.where(ok, dst, pool.shape[1])  # out of range: dropped (negative would wrap)
    return pool.at[:, idx].set(states.astype(pool.dtype), mode="drop")


def path_steps(path, steps, D: int):
    """``steps`` (positions along ``path [N, P]``) where ``path[i, :steps[i]+1]`` are all nodes in
    ``[0, D)``, else -1 (nothing written: a path that does not reach its step is skipped, as a step
    out of range is)."""
    P = path.shape[1]
    steps = jnp.asarray(steps, jnp.int32)
    node = (path >= 0) & (path < D)
    reach = jnp.cumprod(node.astype(jnp.int32), axis=1).sum(1)  # the leading entries that are nodes
    return jnp.where((steps >= 0) & (steps < P) & (steps < reach), steps, -1)


def along_path(tape, rows, path, steps, track_steps):
    """A tree commit as the chain commit it is: the arguments of :func:`commit` for ``tape``'s nodes
    ``path [N, P]`` (node indices from the root's child down, -1 padded; ``steps`` and
    ``track_steps`` positions along it). Returns ``(tape, rows, steps, track_steps)``.

    The record mode's own (:meth:`~gdn_lossless_jax.tape.Tape.along_path`). Snapshots: the same
    tape, and each position mapped to its node (the snapshot of node ``path[i, s]``). Tuples: the
    path's tuples gathered into a chain tape ``[L, N, P, ...]`` (row i request i's path; an
    out-of-range row becomes row N, skipped), so that a chain replay of it applies exactly the
    path's steps, in order. Positions whose path does not reach them are -1 (:func:`path_steps`).
    Any backend's chain commit then commits the tree.
    """
    D = tape.num_steps
    path = jnp.asarray(path, jnp.int32)
    steps, track_steps = path_steps(path, steps, D), path_steps(path, track_steps, D)
    return tape.along_path(rows, path, steps, track_steps)


def commit(pool, tape, slots, steps, track_slots, track_steps, rows, *, rule: Callable = rounding.apply_rule,
           math: str = "platform"):
    """Write the accepted (and track) states into the pool; every other bit is kept.

    Args:
      pool: ``[L, S, HV, V, K]`` float32 or bfloat16 state pool (all GDN layers).
      tape: :class:`Tuples` (``u [L, R, D, HV, V]``, ``k [L, R, D, H, K]``,
        ``g [L, R, D, HV]``) or :class:`~gdn_lossless_jax.tape.Snapshots` (``[L, R, D, HV, V, K]``): its
        record mode gives the states (:meth:`~gdn_lossless_jax.tape.Tape.states_at`).
      slots, steps, track_slots, track_steps, rows: ``[N]`` int32.
    Returns:
      the new pool. Request i writes ``pool[:, slots[i]]`` = state after ``steps[i]``
      and ``pool[:, track_slots[i]]`` = state after ``track_steps[i]``, both from the
      pre-verify state ``pool[:, slots[i]]``; see :func:`gdn_lossless_jax.commit`.
    """
    valid, accept, track = commit_masks(pool, tape, slots, steps, track_slots, track_steps, rows)
    slot_i = jnp.where(valid, slots, 0)
    row_i = jnp.where(valid, rows, 0)
    replay = functools.partial(replay_two, rule=rule, math=math)
    final, tracked = tape.states_at(pool, slot_i, row_i, steps, track_steps, replay=replay)
    # Both states were computed from the pre-verify pool above, before either write.
    pool = scatter_slots(pool, track_slots, track, tracked)
    return scatter_slots(pool, slots, accept, final)


__getattr__ = _deprecated.alias(__name__, {"commit_accepted_first": "gdn_lossless_jax.testing.controls:commit_accepted_first"})
