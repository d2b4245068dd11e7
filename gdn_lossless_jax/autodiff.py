"""Derivatives of verify, replay and commit: the gated delta rule's own, in plain floats.

The kernels compute the rule with pinned roundings, built from integer operations on the
bit patterns (or PTX, or Triton): autodiff cannot see through them (a ``pallas_call`` has
no useful derivative, and a bitcast to an integer is a constant to autodiff, which gives
a silent zero). So each public entry point is wrapped in a ``jax.custom_jvp`` whose

* primal value is the backend's exact result (bit for bit what it returns undifferentiated),
* tangent is that of the *plain formulation* (:func:`plain_verify`, :func:`plain_replay`,
  :func:`plain_commit`): the same math in ordinary floating-point JAX, ``S * exp(g) + k u``
  with no pinned rounding, differentiated by JAX.

A ``custom_jvp`` rather than a ``custom_vjp``, so that both modes work: ``jax.jvp`` uses the
rule directly, ``jax.grad``/``jax.vjp`` transpose its linear part (a ``custom_vjp`` has no
forward mode). The rule calls the wrapped function again for its primal value, so
higher-order derivatives are those of the plain formulation too.

Accuracy and memory: the derivative is evaluated along the plain formulation's
trajectory, which differs from the exact one by rounding (a few ULP per step, more after
cancellation); it is the derivative of the exact function up to that. Memory: the plain
formulation, like the reference it is built from (:func:`gdn_lossless_jax.reference.chain`),
materialises the state after every step (``[N, D, HV, V, K]`` in fp32, like a snapshot
tape) and reverse mode keeps it as a residual: a derivative costs the memory the tuple tape
saves. The undifferentiated call costs nothing extra (the rule only runs under autodiff).

Integer inputs (steps, slots, rows, layer) have no derivative (their tangents are
``float0``). Every floating input of every entry point has its derivative, in every form
(the pool form of verify included): none is a silent zero.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Callable

import jax
import jax.numpy as jnp

from . import reference, rounding
from .backends.contract import VerifyCall, run_verify
from .tape import Tape, Tuples

__all__ = ["plain_verify", "plain_replay", "plain_commit", "verify", "replay", "commit"]


def _plain_fma(a, b, c):
    return a * b + c


# The rule without pinned rounding: ``S * alpha + k u``, whatever the compiler makes of it.
_plain_step = lambda S, x: reference.gdn_step(S, x, mul=operator.mul, fma=_plain_fma)  # noqa: E731


def _plain_rule(S, alpha, k, u):
    return rounding.apply_rule(S, alpha, k, u, mul=operator.mul, fma=_plain_fma)


def _compute_dtype(*trees) -> jnp.dtype:
    """float32, or float64 where a floating input is float64 (under ``jax.enable_x64``)."""
    dtype = jnp.dtype(jnp.float32)
    for x in jax.tree.leaves(trees):
        if jnp.issubdtype(jnp.result_type(x), jnp.floating):
            dtype = jnp.promote_types(dtype, jnp.result_type(x))
    return dtype


def _plain_gates(a, b, A_log, dt_bias, dtype, beta_scale: float = 1.0):
    """:func:`gdn_lossless_jax.reference.gates` with derivatives that stay finite.

    ``log(1 + exp(x))`` and ``1 / (1 + exp(-b))`` are right in value but their derivatives
    are ``inf / inf`` once ``exp`` overflows (and ``jnp.where`` multiplies the unused
    branch's NaN by 0, which stays NaN); ``jax.nn.softplus`` and ``jax.nn.sigmoid`` are the
    same functions with stable derivatives.
    """
    x = a.astype(dtype) + dt_bias.astype(dtype)
    sp = jnp.where(x > reference.SOFTPLUS_THRESHOLD, x, jax.nn.softplus(x))
    A = jnp.exp(A_log.astype(dtype))
    g = -(A[..., None] if jnp.ndim(a) > jnp.ndim(b) else A) * sp  # a per-channel decay: A per head over K
    beta = jax.nn.sigmoid(b.astype(dtype))
    return g, (beta if beta_scale == 1.0 else beta * jnp.asarray(beta_scale, dtype))


def plain_verify(
    state0: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    a: jax.Array,
    b: jax.Array,
    A_log: jax.Array,
    dt_bias: jax.Array,
    *,
    record: str | type[Tape] = "tuples",
    scale: float | None = None,
    out_dtype: Any = None,
    parents: Any = None,
    math: str = "platform",
    beta_scale: float = 1.0,
) -> tuple[jax.Array, Tape]:
    """The plain-float formulation of :func:`gdn_lossless_jax.verify`, differentiable by JAX.

    ``math`` is accepted and has no effect: the derivative of both modes is this formulation's.

    Same arguments, shapes and output dtypes (outputs in ``out_dtype`` or q's dtype,
    snapshots in state0's dtype). It computes in float32, or in float64 where an input is
    float64 (under ``jax.enable_x64``: the tape is then float64 too), which is how the
    derivatives are checked against finite differences. No argument checks: this is the
    derivative's specification, not an entry point.
    """
    dtype = _compute_dtype(state0, q, k, v, a, b, A_log, dt_bias)
    K = q.shape[-1]
    scale = K**-0.5 if scale is None else scale
    qn = reference.l2norm(q.astype(dtype)) * jnp.asarray(scale, dtype)
    kn = reference.l2norm(k.astype(dtype))
    g, beta = _plain_gates(a, b, A_log, dt_bias, dtype, beta_scale)
    if parents is not None:  # a draft tree (gdn_lossless_jax.tree)
        return reference.tree_chain(state0, qn, kn, v, g, beta, parents, record=record, out_dtype=out_dtype or q.dtype,
                                    step=_plain_step)  # fmt: skip
    return reference.chain(state0, qn, kn, v, g, beta, record=record, out_dtype=out_dtype or q.dtype, step=_plain_step)


def plain_replay(state0: jax.Array, tuples: Tuples, steps: jax.Array, math: str = "platform") -> jax.Array:
    """The plain-float formulation of :func:`gdn_lossless_jax.replay` (shapes as there).

    ``S_t = S_{t-1} * exp(g_t) + k_t u_t``, in the tape's precision (float32, or float64
    under x64); the result in state0's dtype.
    """
    return reference.replay(state0, tuples, steps, rule=_plain_rule)


def plain_commit(pool, tape: Tape, slots, steps, track_slots, track_steps, rows, math: str = "platform") -> jax.Array:
    """The plain-float formulation of :func:`gdn_lossless_jax.commit` (all ``[N]`` int indices given).

    The snapshot commit is a gather and a scatter, already differentiable; the tuple
    commit replays with the plain rule. Skipped requests and untouched slots as there.
    """
    pool, tape = jax.tree.map(jnp.asarray, (pool, tape))
    return reference.commit(pool, tape, slots, steps, track_slots, track_steps, rows, rule=_plain_rule)


def _match(primal, tangent):
    """The tangent in the primal's dtype (the plain formulation already gives it; this is cheap insurance)."""
    return tangent.astype(primal.dtype) if tangent.dtype != primal.dtype else tangent


def _with_plain_derivative(exact: Callable, plain: Callable) -> Callable:
    """``exact``'s values with ``plain``'s derivatives (same arguments, same output tree)."""

    @jax.custom_jvp
    def f(*args):
        return exact(*args)

    @f.defjvp
    def f_jvp(primals, tangents):
        _, t_out = jax.jvp(plain, primals, tangents)
        out = f(*primals)  # through f, not exact: a second derivative is plain's too
        return out, jax.tree.map(_match, out, t_out)

    return f


def verify(impl, call: VerifyCall):
    """``impl.verify(call)`` (a backend's exact kernel) with the derivatives of :func:`plain_verify`.

    The plain formulation of the call's forms (gathers by slot, the scatter into the tape
    buffer, the pending commit's scatter into the pool) is
    :func:`gdn_lossless_jax.reference.verify_form` with :func:`plain_verify` and
    :func:`plain_commit`: they are differentiated as they are.
    """

    def exact(c):
        return run_verify(impl, c)

    def plain(c):
        return reference.verify_form(c, verify_fn=plain_verify, commit_fn=plain_commit)

    return _with_plain_derivative(exact, plain)(call)


def replay(impl, state0, tuples: Tuples, steps, math: str = "platform") -> jax.Array:
    """``impl.replay`` (``math=`` passed, as the backend contract says) with the derivatives of
    :func:`plain_replay`."""
    return _with_plain_derivative(functools.partial(impl.replay, math=math), plain_replay)(state0, tuples, steps)


def commit(impl, pool, tape: Tape, slots, steps, track_slots, track_steps, rows, math: str = "platform") -> jax.Array:
    """``impl.commit`` (``math=`` passed) with the derivatives of :func:`plain_commit`."""
    return _with_plain_derivative(functools.partial(impl.commit, math=math), plain_commit)(
        pool, tape, slots, steps, track_slots, track_steps, rows)

