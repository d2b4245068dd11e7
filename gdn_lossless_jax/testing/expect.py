"""What a commit must write, by SGLang's masking rules, computed in NumPy: the oracle the
equivalence suite and the fuzzer hold every backend's commit to."""

from __future__ import annotations

import numpy as np

from .cases import CommitIndices

__all__ = ["request_writes", "expected_pool"]


def request_writes(idx: CommitIndices, n: int, *, S: int, R: int, D: int) -> tuple[int | None, int | None]:
    """(accepted slot, track slot) that request n may write by SGLang's masking rules, or None.

    An out-of-range slot or row skips the request entirely (its track copy too); a step
    outside ``[0, D)`` skips that write; an out-of-range track slot skips the track write.
    """
    if not (0 <= idx.slots[n] < S and 0 <= idx.rows[n] < R):
        return None, None
    acc = int(idx.slots[n]) if 0 <= idx.steps[n] < D else None
    trk = int(idx.track_slots[n]) if 0 <= idx.track_steps[n] < D and 0 <= idx.track_slots[n] < S else None
    return acc, trk


def expected_pool(pool: np.ndarray, snapshots: np.ndarray, idx: CommitIndices) -> np.ndarray:
    """The pool a commit must leave, from the snapshot tape ``[L, R, D, HV, V, K]``, in NumPy."""
    out = pool.copy()
    S, (R, D) = pool.shape[1], snapshots.shape[1:3]
    for n in range(len(idx.slots)):
        acc, trk = request_writes(idx, n, S=S, R=R, D=D)
        if trk is not None:
            out[:, trk] = snapshots[:, idx.rows[n], idx.track_steps[n]]
        if acc is not None:
            out[:, acc] = snapshots[:, idx.rows[n], idx.steps[n]]
    return out
