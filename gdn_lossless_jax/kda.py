"""KDA (Kimi Delta Attention) in pure JAX: the specification of its lossless verify and commit.

KDA is the gated delta rule with a **per-channel** decay: where GDN decays a head's whole state by one
factor ``exp(g_t)``, KDA's ``g_t`` has one entry per key channel, so the state's K columns (in the
library's ``[V, K]`` layout; the K rows of transformers' ``[K, V]``) decay by different factors. q, k
and v have H heads each (no grouped value heads). Shapes, per KDA layer (N requests, D draft steps)::

    state0 [N, H, V, K]   q, k [N, D, H, K]   v [N, D, H, V]   f [N, D, H, K]   b [N, D, H]
    A_log [H]   dt_bias [H, K]   outputs [N, D, H, V]

One step, per request n, head h and draft step t, on the fp32 state ``S [V, K]`` (the step numbers
of :mod:`gdn_lossless_jax.reference`; only steps 1 and 3 differ)::

    1. gates    g_t = -exp(A_log[h]) * softplus(f_t + dt_bias[h])   [K]  (softplus(x) = x above 20)
                beta_t = 1 / (1 + exp(-b_t))                         (kept in fp32)
    2. norms    q = q / sqrt(sum(q*q) + 1e-6) * scale,  k = k / sqrt(sum(k*k) + 1e-6)
    3. decay    Sd[v, c] = rn(S[v, c] * exp(g_t[c]))               (one rounded multiply per element)
    4. delta    u = beta_t * (v_t - Sd @ k)                          (a reduction over K)
    5. update   S' = fma(k, u, Sd)  elementwise: S'[v, c] = fma(k[c], u[v], Sd[v, c])
    6. output   o_t = S' @ q

``f`` is the forget gate's low-rank projection ``f_b(f_a(x))`` before the bias (transformers'
``KimiLinearForgetGate``); the norms divide by the square root (as the library's GDN reference and
FLA's KDA kernels do). The rule is steps 3 and 5, as for GDN: ``S' = fma(k, u, rn(S * exp(g)))`` with
``exp(g)`` broadcast over the V rows (:func:`rule`). So a replay of the tape ``(u [V], k [K], g [K])``
per head and step from the untouched pre-verify state gives every snapshot bit for bit, provided it
rounds each element's decay as verify did: one rounded multiply by that element's own channel's
``exp(g[c])``, then one fma.

The tape per head and step is ``V + 2K`` fp32 values against ``V * K`` for a snapshot: 384 against
16,384 at K = V = 128 (42.7x smaller). This module is the specification the backends are tested
against (verify, replay, commit, with SGLang's masking rules as :func:`gdn_lossless_jax.reference.commit`).
Its tape is the record variant :class:`~gdn_lossless_jax.tape.KDATuples`, which the API takes
(:func:`gdn_lossless_jax.verify` with ``decay="channel"``): the reference and Triton backends run it.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from . import reference, rounding
from .reference import SOFTPLUS_THRESHOLD, ksum, l2norm
from .tape import KDATuples, Snapshots

__all__ = [
    "KDATuples",
    "gates",
    "prepare",
    "rule",
    "kda_step",
    "chain",
    "verify",
    "replay_two",
    "replay",
    "commit",
    "tape_floats",
    "snapshot_floats",
]

F32 = jnp.float32


def tape_floats(H: int, K: int, V: int) -> int:
    """fp32 values of the tuple tape per layer, request and draft step: ``H * (V + 2K)``."""
    return H * (V + 2 * K)


def snapshot_floats(H: int, K: int, V: int) -> int:
    """Values of one snapshot per layer, request and draft step: ``H * V * K``."""
    return H * V * K


def gates(f, b, A_log, dt_bias):
    """Per-channel decay and write gate, in fp32 (step 1 of the module docstring).

    Args:
      f: ``[..., H, K]`` the forget gate's projection before the bias. b: ``[..., H]``.
      A_log: ``[H]``. dt_bias: ``[H, K]``.
    Returns:
      ``(g [..., H, K], beta [..., H])``, float32.
    """
    x = f.astype(F32) + dt_bias.astype(F32)
    sp = jnp.where(x > SOFTPLUS_THRESHOLD, x, rounding.log(1.0 + rounding.exp(x)))
    g = -rounding.exp(A_log.astype(F32))[:, None] * sp
    beta = 1.0 / (1.0 + rounding.exp(-b.astype(F32)))
    return g, beta


def prepare(q, k, f, b, A_log, dt_bias, scale):
    """Everything outside the state chain: ``(qn, kn [N, D, H, K], g [N, D, H, K], beta [N, D, H])``."""
    qn = l2norm(q) * jnp.asarray(scale, F32)
    kn = l2norm(k)
    g, beta = gates(f, b, A_log, dt_bias)
    return qn, kn, g, beta


def rule(S, alpha, k, u, *, mul: Callable = rounding.mul_rn, fma: Callable = rounding.fma_rn):
    """One replayed KDA state update: ``fma(k, u, rn(S * alpha))`` with a per-channel decay.

    Args:
      S: ``[..., V, K]`` float32 state.
      alpha: ``[..., K]`` float32 decay ``exp(g)``, one factor per key channel (broadcast over V).
      k: ``[..., K]`` float32 l2-normalised key.
      u: ``[..., V]`` float32 ``beta * (v - Sd @ k)``.
    """
    return rounding.update(rounding.decay(S, alpha[..., None, :], mul=mul), k, u, fma=fma)


def kda_step(S, x, *, mul: Callable = rounding.mul_rn, fma: Callable = rounding.fma_rn):
    """One KDA step as a state transition ``S -> S'`` (steps 3-6), per request and head.

    Args:
      S: ``[..., H, V, K]`` float32 state before the step.
      x: ``(q, k, v, g, beta)``: q, k, g ``[..., H, K]`` (q normalised and scaled, k normalised),
        v ``[..., H, V]``, beta ``[..., H]``, all float32.
    Returns:
      ``(S', (o, u))``, o and u ``[..., H, V]``.
    """
    q, k, v, g, beta = x
    Sd = rounding.decay(S, rounding.exp(g)[..., None, :], mul=mul)
    u = beta[..., None] * (v - ksum(Sd * k[..., None, :]))
    S_new = rounding.update(Sd, k, u, fma=fma)
    o = ksum(S_new * q[..., None, :])
    return S_new, (o, u)


def chain(state0, qn, kn, v, g, beta, *, record: str, out_dtype, step: Callable = kda_step):
    """The state chain of :func:`verify` from prepared inputs, as a ``lax.scan`` of ``step``.

    As :func:`gdn_lossless_jax.reference.chain`: one program for both record modes (the scan emits the
    outputs, u and the fp32 states; the barrier keeps XLA from pruning the unused ones), the states
    rounded to the pool dtype after the loop. Returns ``(outputs [N, D, H, V], tape)``: a
    :class:`KDATuples` or a :class:`~gdn_lossless_jax.tape.Snapshots` tape.
    """
    dtype = qn.dtype
    xs = jax.tree.map(lambda t: jnp.moveaxis(t, 1, 0), (qn, kn, v.astype(dtype), g, beta))

    def body(S, x):
        S_new, (o, u) = step(S, x)
        return S_new, (o, u, S_new)

    _, ys = lax.scan(body, state0.astype(dtype), xs)
    o, u, states = (jnp.moveaxis(y, 0, 1) for y in lax.optimization_barrier(ys))
    outputs = o.astype(out_dtype)
    tape = Snapshots(states.astype(state0.dtype)) if record == "snapshots" else KDATuples(u=u, k=kn, g=g)
    return outputs, tape


def _check(state0, q, k, v, f, b, A_log, dt_bias, record):
    if record not in ("tuples", "snapshots"):
        raise ValueError(f"kda.verify: argument 'record' must be 'tuples' or 'snapshots', got {record!r}")
    N, D, H, K = q.shape
    V = v.shape[-1]
    want = {"state0": (N, H, V, K), "k": (N, D, H, K), "v": (N, D, H, V), "f": (N, D, H, K), "b": (N, D, H),
            "A_log": (H,), "dt_bias": (H, K)}  # fmt: skip
    got = {"state0": state0, "k": k, "v": v, "f": f, "b": b, "A_log": A_log, "dt_bias": dt_bias}
    for name, shape in want.items():
        if tuple(jnp.shape(got[name])) != shape:
            raise ValueError(f"kda.verify: argument {name!r} must have shape {list(shape)} (from q {list(q.shape)} "
                             f"and v {list(v.shape)}), got {list(jnp.shape(got[name]))}")  # fmt: skip


def verify(state0, q, k, v, f, b, A_log, dt_bias, *, record: str = "tuples", scale: float | None = None,
           out_dtype=None):  # fmt: skip
    """Run D draft steps of a KDA layer; ``state0`` is not modified.

    Args:
      state0: ``[N, H, V, K]`` float32 or bfloat16 (upcast; snapshots rounded back).
      q, k: ``[N, D, H, K]``; v: ``[N, D, H, V]``; f: ``[N, D, H, K]``; b: ``[N, D, H]``;
        A_log: ``[H]``; dt_bias: ``[H, K]`` (module docstring).
      record: ``"tuples"`` (a :class:`KDATuples` tape) or ``"snapshots"`` (the state after every step).
      scale: the query scale; None: ``K ** -0.5``.
    Returns:
      ``(outputs [N, D, H, V] in out_dtype (default q's), tape)``; the outputs do not depend on ``record``.
    """
    _check(state0, q, k, v, f, b, A_log, dt_bias, record)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qn, kn, g, beta = prepare(q, k, f, b, A_log, dt_bias, scale)
    return chain(state0, qn, kn, v, g, beta, record=record, out_dtype=out_dtype or q.dtype)


def replay_two(state0, tuples: KDATuples, steps, track_steps, *, form: Callable = rule):
    """One pass over the chain that yields the states after ``steps`` and ``track_steps``.

    Args:
      state0: ``[N, H, V, K]`` (float32 or bfloat16; upcast, results rounded back).
      tuples: ``u [N, D, H, V]``, ``k [N, D, H, K]``, ``g [N, D, H, K]``.
      steps, track_steps: ``[N]`` int; a value outside ``[0, D)`` means no step (state0).
      form: the update ``(S, alpha, k, u) -> S'`` (:func:`rule`; tests pass controls).
    Returns:
      ``(state after steps, state after track_steps)``, both in state0's dtype.
    """
    # The reference's scan: its rule applies a [..., K] decay to each key channel's column, as ``form`` does.
    return reference.replay_two(state0, tuples, steps, track_steps, rule=form)


def replay(state0, tuples: KDATuples, steps, *, form: Callable = rule):
    """The state after draft step ``steps[i]`` (0-based) per request; a step outside ``[0, D)`` leaves
    state0 unchanged. Shapes as in :func:`replay_two`."""
    final, _ = replay_two(state0, tuples, steps, jnp.full_like(jnp.asarray(steps), -1), form=form)
    return final


def _masks(pool, R, D, slots, steps, track_slots, track_steps, rows):
    """Which requests write their accepted and track states (SGLang's scatter rules, as the reference's)."""
    S = pool.shape[1]
    valid = (slots >= 0) & (slots < S) & (rows >= 0) & (rows < R)
    accept = valid & (steps >= 0) & (steps < D)
    track = valid & (track_steps >= 0) & (track_steps < D) & (track_slots >= 0) & (track_slots < S)
    return valid, accept, track


def _scatter(pool, dst, ok, states):
    idx = jnp.where(ok, dst, pool.shape[1])  # out of range: dropped (negative would wrap)
    return pool.at[:, idx].set(states.astype(pool.dtype), mode="drop")


def commit(pool, tape, slots, steps, track_slots=None, track_steps=None, rows=None, *, form: Callable = rule):
    """Write the accepted (and track) states into the pool; every other bit is kept.

    The masking rules are :func:`gdn_lossless_jax.reference.commit`'s (SGLang's
    ``fused_mamba_state_scatter_with_mask``): request i writes ``pool[:, slots[i]]`` = the state after
    ``steps[i]`` where the slot and ``rows[i]`` are in range and ``0 <= steps[i] < D``, and
    ``pool[:, track_slots[i]]`` = the state after ``track_steps[i]`` where that slot is in range too;
    both from the pre-verify state of ``slots[i]`` (a request whose own slot is out of range is skipped,
    its track copy included).

    Args:
      pool: ``[L, S, H, V, K]`` float32 or bfloat16 (all KDA layers).
      tape: :class:`KDATuples` (``u [L, R, D, H, V]``, ``k``, ``g [L, R, D, H, K]``) or
        :class:`~gdn_lossless_jax.tape.Snapshots` (``[L, R, D, H, V, K]``).
      slots, steps: ``[N]`` int; track_slots, track_steps: ``[N]`` int or None (no track copy);
        rows: ``[N]`` int or None (``arange(N)``).
    Returns:
      the new pool.
    """
    slots = jnp.asarray(slots, jnp.int32)
    N = slots.shape[0]
    none = jnp.full((N,), -1, jnp.int32)
    steps = jnp.asarray(steps, jnp.int32)
    track_slots = none if track_slots is None else jnp.asarray(track_slots, jnp.int32)
    track_steps = none if track_steps is None else jnp.asarray(track_steps, jnp.int32)
    rows = jnp.arange(N, dtype=jnp.int32) if rows is None else jnp.asarray(rows, jnp.int32)
    R, D = tape.num_rows, tape.num_steps
    valid, accept, track = _masks(pool, R, D, slots, steps, track_slots, track_steps, rows)
    slot_i, row_i = jnp.where(valid, slots, 0), jnp.where(valid, rows, 0)
    if isinstance(tape, Snapshots):
        pick = lambda s: tape.states[:, row_i, jnp.clip(s, 0, D - 1)]  # noqa: E731
        final, tracked = pick(steps), pick(track_steps)
    else:
        L = pool.shape[0]
        state0 = pool[:, slot_i].reshape(L * N, *pool.shape[2:])
        tuples = jax.tree.map(lambda t: t[:, row_i].reshape(L * N, *t.shape[2:]), tape)
        final, tracked = replay_two(state0, tuples, jnp.tile(steps, L), jnp.tile(track_steps, L), form=form)
        final, tracked = (x.reshape(L, N, *pool.shape[2:]) for x in (final, tracked))
    # Both states were computed from the pre-verify pool above, before either write.
    pool = _scatter(pool, track_slots, track, tracked)
    return _scatter(pool, slots, accept, final)
