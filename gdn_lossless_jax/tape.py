"""The tapes verify records: per-step tuples (the lossless way) or full state snapshots.

Both are frozen pytrees (``chex.dataclass``-style, registered with JAX), so they pass
through ``jax.jit``, ``lax.scan`` and ``jax.tree_util`` like any other tree of arrays.
Shapes are given per layer; a tape for ``commit`` carries a leading layer axis ``L``.
"""

from __future__ import annotations

import dataclasses

import jax

__all__ = ["Tuples", "Snapshots", "Tape", "Pending"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tuples:
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

    @property
    def num_steps(self) -> int:
        return self.u.shape[-3]

    @property
    def num_rows(self) -> int:
        return self.u.shape[-4]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Snapshots:
    """The dense tape: the state after every draft step.

    Attributes:
      states: ``[..., N, D, HV, V, K]`` in the state pool's dtype (float32 or bfloat16).
    """

    states: jax.Array

    @property
    def num_steps(self) -> int:
        return self.states.shape[-4]

    @property
    def num_rows(self) -> int:
        return self.states.shape[-5]


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

    ``Pending.none(tape, N)`` is a pending commit that commits nothing.
    """

    tape: Tuples | Snapshots
    rows: jax.Array
    steps: jax.Array
    track_slots: jax.Array
    track_steps: jax.Array

    @classmethod
    def none(cls, tape: "Tuples | Snapshots", n: int) -> "Pending":
        import numpy as np

        off = np.full((n,), -1, np.int32)
        return cls(tape, off, off, off, off)
