"""The backend contract: what :mod:`gdn_lossless_jax.api` hands a backend, once every argument is checked.

A backend is any object (a module, a class, a ``types.SimpleNamespace``) with::

    verify(call: VerifyCall, **options) -> (outputs, tape) or, with call.pending, (outputs, tape, pool)
    replay(state0, tuples, steps, **options) -> states
    commit(pool, tape, slots, steps, track_slots, track_steps, rows, **options) -> pool

and optionally ``check_available(op: str) -> None``, which raises
:class:`~gdn_lossless_jax.backends.BackendUnavailable` when it cannot run here. ``options`` are the
backend's own keywords (a launch config, a rounding form); the API passes none. Semantics are
the reference's (:mod:`gdn_lossless_jax.reference`), bit for bit where the reference pins them.

Draft trees: a backend whose verify takes a call with ``parents`` (``VerifyCall.parents``, node d's
parent per request) sets a module attribute ``TREES = True``; the API refuses a tree for any
other backend before it calls it. Commit needs nothing: the API turns a tree's accepted path into
the chain commit it is (:func:`gdn_lossless_jax.reference.along_path`).

:class:`VerifyCall` is verify in its one normal form: the state always a pool
``[L, S, HV, V, K]`` read at ``[layer, slots[n]]`` (a plain ``[N, HV, V, K]`` state0 arrives as
a one-layer pool whose slot n is request n), the tape and outputs buffers with a layer axis,
and the pending commit of the fused step as a :class:`PendingCommit`.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..tape import Tape

__all__ = ["VerifyCall", "PendingCommit", "run_verify", "legacy_arguments"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PendingCommit:
    """The previous step's commit, applied by the fused verify before it reads the pool.

    Attributes:
      tape: the previous step's tape ``[L', R', D', ...]``, read at ``layer``.
      layer: int32 scalar, the layer of ``tape`` this call commits.
      rows, steps, track_slots, track_steps: ``[N]`` int32, per request of this call (the
        arguments of :func:`gdn_lossless_jax.commit`, with its masks).
    """

    tape: Tape
    layer: jax.Array
    rows: jax.Array
    steps: jax.Array
    track_slots: jax.Array
    track_steps: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyCall:
    """One verify, checked and normalised (the arguments of :func:`gdn_lossless_jax.verify`).

    Attributes:
      pool: ``[L, S, HV, V, K]`` float32 or bfloat16, read at ``[layer, slots[n]]`` (zeros for
        a slot outside ``[0, S)``); never written, except by ``pending``.
      slots: ``[N]`` int32; layer: int32 scalar.
      q, k, v, a, b, A_log, dt_bias: one layer's inputs, or any of them stacked over the pool's
        layers (one leading axis more; read at ``layer``).
      record, scale, out_dtype: static: ``"tuples"`` or ``"snapshots"``, the query scale, the
        outputs' dtype.
      tape, tape_layer, rows: a tape buffer ``[L', R, Dmax, ...]`` to write request n's steps
        into at ``[tape_layer, rows[n], :D]``, or None (a fresh ``[N, D, ...]`` tape).
      out, out_layer: an outputs buffer ``[L', N, D, HV, V]`` written at ``out_layer``, or None.
      pending: the fused step's previous commit, or None.
      pool_form: static: whether the caller passed a pool (with ``slots``) rather than state0.
      math: static: ``"platform"`` or ``"portable"`` (:func:`gdn_lossless_jax.verify`); a backend
        that does not implement a mode is refused before it is called
        (:func:`gdn_lossless_jax.backends.check_math`).
    """

    pool: jax.Array
    slots: jax.Array
    layer: jax.Array
    q: jax.Array
    k: jax.Array
    v: jax.Array
    a: jax.Array
    b: jax.Array
    A_log: jax.Array
    dt_bias: jax.Array
    tape: Tape | None = None
    tape_layer: jax.Array | None = None
    rows: jax.Array | None = None
    out: jax.Array | None = None
    out_layer: jax.Array | None = None
    pending: PendingCommit | None = None
    parents: jax.Array | None = None
    record: str = dataclasses.field(default="tuples", metadata=dict(static=True))
    scale: float = dataclasses.field(default=1.0, metadata=dict(static=True))
    out_dtype: Any = dataclasses.field(default=jnp.dtype(jnp.float32), metadata=dict(static=True))
    pool_form: bool = dataclasses.field(default=True, metadata=dict(static=True))
    math: str = dataclasses.field(default="platform", metadata=dict(static=True))

    @property
    def inputs(self) -> tuple[jax.Array, ...]:
        """``(q, k, v, a, b, A_log, dt_bias)``."""
        return self.q, self.k, self.v, self.a, self.b, self.A_log, self.dt_bias

    def replace(self, **fields: Any) -> "VerifyCall":
        return dataclasses.replace(self, **fields)

    @classmethod
    def of_state(cls, state0: jax.Array, q, k, v, a, b, A_log, dt_bias, **kw) -> "VerifyCall":
        """The call for a plain ``[N, HV, V, K]`` state0: a one-layer pool whose slot n is request n."""
        n = state0.shape[0]
        return cls(state0[None], np.arange(n, dtype=np.int32), np.int32(0), q, k, v, a, b, A_log, dt_bias,
                   pool_form=False, **kw)  # fmt: skip


def _takes_call(fn) -> bool:
    """Whether ``fn`` is a contract verify (one positional parameter, the call)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) <= 1 and not any(p.kind is p.VAR_POSITIONAL for p in params)


def legacy_arguments(call: VerifyCall) -> tuple[tuple, dict]:
    """``call`` as the positional arguments and keywords of the earlier backend signature
    ``verify(state0, q, k, v, a, b, A_log, dt_bias, *, record, scale, out_dtype, slots, layer,
    tape, tape_layer, rows, pending, out, out_layer)``."""
    kw = dict(record=call.record, scale=call.scale, out_dtype=call.out_dtype)
    if call.pool_form:
        state = call.pool
        kw.update(slots=call.slots, layer=call.layer)
    else:
        state = call.pool[0]
    if call.tape is not None:
        kw.update(tape=call.tape, tape_layer=call.tape_layer, rows=call.rows)
    if call.pending is not None:
        p = call.pending
        kw["pending"] = (p.rows, p.steps, p.track_slots, p.track_steps, p.layer, p.tape)
    if call.out is not None:
        kw.update(out=call.out, out_layer=call.out_layer)
    return (state, *call.inputs), kw


def run_verify(backend, call: VerifyCall, **options):
    """``backend.verify(call, **options)``; a backend of the earlier signature (``verify(state0,
    q, ..., *, record, scale, out_dtype, ...)``) still runs, with a DeprecationWarning."""
    if _takes_call(backend.verify):
        return backend.verify(call, **options)
    warnings.warn(
        f"backend {getattr(backend, '__name__', backend)!r}: verify(state0, q, k, ...) is the earlier backend "
        "signature; write verify(call: gdn_lossless_jax.backends.contract.VerifyCall) instead (it is removed in "
        "the next release)", DeprecationWarning, stacklevel=3,
    )  # fmt: skip
    args, kw = legacy_arguments(call)
    result = backend.verify(*args, **kw, **options)
    if call.pending is not None and not call.pool_form:
        result = (*result[:2], result[2][None])
    return result
