"""The tapes verify records: per-step tuples (the lossless way) or full state snapshots.

Both are frozen pytrees (``chex.dataclass``-style, registered with JAX), so they pass
through ``jax.jit``, ``lax.scan`` and ``jax.tree_util`` like any other tree of arrays.
Shapes are given per layer; a tape for ``commit`` carries a leading layer axis ``L``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Tuples", "Snapshots", "Tape", "Pending", "stack_tapes", "replace_fields"]


def replace_fields(obj: Any, fields: dict[str, Any]) -> Any:
    """``dataclasses.replace(obj, **fields)``, with an error that lists the fields on a typo."""
    names = [f.name for f in dataclasses.fields(obj)]
    unknown = [n for n in fields if n not in names]
    if unknown:
        raise TypeError(
            f"{type(obj).__name__}.replace: unknown field {unknown[0]!r}; the fields are {', '.join(names)}"
        )
    return dataclasses.replace(obj, **fields)


class _TapeFields:
    """What both tapes share: :meth:`replace`, and the step and row counts, read off the first
    field (``_trailing``: its axes after the step axis)."""

    _trailing: ClassVar[int]

    def replace(self, **fields: jax.Array):
        """A copy with the given fields replaced, e.g. ``tape.replace(g=g2)``."""
        return replace_fields(self, fields)

    def _lead_shape(self) -> tuple[int, ...]:
        return getattr(self, dataclasses.fields(self)[0].name).shape

    @property
    def num_steps(self) -> int:
        return self._lead_shape()[-1 - self._trailing]

    @property
    def num_rows(self) -> int:
        return self._lead_shape()[-2 - self._trailing]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tuples(_TapeFields):
    """The lossless tape: what replay needs to rebuild every draft step's state.

    Attributes:
      u: ``[..., N, D, HV, V]`` float32, ``beta_t * (v_t - rn(S_{t-1} * exp(g_t)) @ k_t)``.
      k: ``[..., N, D, H, K]`` float32, the l2-normalised key, once per q/k head (the
        ``HV // H`` v-heads of a group share it).
      g: ``[..., N, D, HV]`` float32, the log-decay ``-exp(A_log) * softplus(a + dt_bias)``.
    """

    u: jax.Array
    k: jax.Array
    g: jax.Array
    _trailing: ClassVar[int] = 2  # u [..., N, D, HV, V]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Snapshots(_TapeFields):
    """The dense tape: the state after every draft step.

    Attributes:
      states: ``[..., N, D, HV, V, K]`` in the state pool's dtype (float32 or bfloat16).
    """

    states: jax.Array
    _trailing: ClassVar[int] = 3  # states [..., N, D, HV, V, K]


Tape = Tuples | Snapshots


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Pending:
    """A commit not yet applied: the previous step's tape and, per request of the *next*
    verify, what to commit from it (:func:`gdn_lossless_jax.commit_and_verify`).

    Attributes:
      tape: the previous step's tape, :class:`Tuples` or :class:`Snapshots`, ``[L, R, D, ...]``
        (or ``[R, D, ...]`` for a one-layer pool).
      rows: ``[N]`` int, request n's row in ``tape``.
      steps: ``[N]`` int, the accepted step (0-based); negative: nothing pending (a request
        that just joined reads its state as it is).
      track_slots, track_steps: ``[N]`` int, the track copy (negative step: none).
      path: ``[N, P]`` int or None: for a draft tree, each request's accepted root-to-node path
        (node indices, -1 padded); ``steps`` and ``track_steps`` are then positions along it, as
        in :func:`gdn_lossless_jax.commit`.

    ``Pending.none(tape, N)`` is a pending commit that commits nothing.
    """

    tape: Tuples | Snapshots
    rows: jax.Array
    steps: jax.Array
    track_slots: jax.Array
    track_steps: jax.Array
    path: jax.Array | None = None

    @classmethod
    def none(cls, tape: "Tuples | Snapshots", n: int) -> "Pending":
        import numpy as np

        off = np.full((n,), -1, np.int32)
        return cls(tape, off, off, off, off)

    def replace(self, **fields: Any) -> "Pending":
        """A copy with the given fields replaced, e.g. ``pending.replace(steps=s2)``."""
        return replace_fields(self, fields)


def stack_tapes(tapes: Sequence[Tape]) -> Tape:
    """Stack per-layer tapes into one with a leading layer axis, as ``commit`` takes it.

    Args:
      tapes: one tape per GDN layer, all from :func:`gdn_lossless_jax.verify` in one record
        mode and of one shape: :class:`Tuples` (``u [N, D, HV, V]``, ``k [N, D, H, K]``,
        ``g [N, D, HV]``) or :class:`Snapshots` (``states [N, D, HV, V, K]``).
    Returns:
      The same kind of tape with every field stacked: ``[L, N, ...]`` for L tapes
      (``jnp.stack``; dtypes kept).
    """
    tapes = list(tapes)
    if not tapes:
        raise ValueError("stack_tapes: need at least one layer's tape, got an empty sequence")
    kind = type(tapes[0])
    if kind not in (Tuples, Snapshots):
        raise TypeError(f"stack_tapes: layer 0 must be a Tuples or Snapshots tape, got {kind.__name__}")
    for layer, tape in enumerate(tapes[1:], start=1):
        if type(tape) is not kind:
            raise TypeError(
                f"stack_tapes: layer {layer} is a {type(tape).__name__} tape but layer 0 a {kind.__name__} tape; "
                "record every layer in one mode"
            )
        for f in dataclasses.fields(kind):
            x, x0 = getattr(tape, f.name), getattr(tapes[0], f.name)
            if np.shape(x) != np.shape(x0) or jnp.result_type(x) != jnp.result_type(x0):
                raise ValueError(
                    f"stack_tapes: layer {layer}'s field {f.name!r} is {jnp.result_type(x)}{list(np.shape(x))}, "
                    f"layer 0's {jnp.result_type(x0)}{list(np.shape(x0))}; every layer's tape must have one shape "
                    "and dtype"
                )
    return jax.tree.map(lambda *xs: jnp.stack(xs), *tapes)
