"""Bytes that must move through device memory: each input read once, each output written once.

Counted from shapes (and, for commit, from the indices: which requests write, how far
each replays). Over a measured device-to-device copy rate they give the byte floor of
every row. Shapes per GDN layer: N requests, D draft steps, H q/k heads, HV v-heads, K, V.

verify (one layer), both modes:
  read   state0 ``N*HV*V*K*s`` + q, k ``2*N*D*H*K*b`` + v ``N*D*HV*V*b`` + a, b ``2*N*D*HV*b``
         + A_log, dt_bias ``2*HV*4``
  write  outputs ``N*D*HV*V*o``
  tuples    also write u ``N*D*HV*V*4``, k ``N*D*H*K*4``, g ``N*D*HV*4``
  snapshots also write ``N*D*HV*V*K*s``
commit (all L layers), per request that writes anything (SGLang's masks):
  tuples     read the pre-verify state (``HV*V*K*s``) and the tuples of steps ``0..last``
             (``last = max(accepted step, track step)``; ``HV*V + H*K + HV`` fp32 per step),
             write the accepted state and the track state where there is one
  snapshots  read and write each state it copies (the accepted one and the track one)
  plus the five ``[N]`` int32 index arrays.
s, b, o: itemsizes of the state, the inputs and the outputs.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from gdn_lossless_jax.testing.cases import CommitIndices, Shape

__all__ = ["Traffic", "verify_traffic", "commit_traffic", "copy_traffic", "net_traffic"]

F32 = 4


@dataclasses.dataclass(frozen=True)
class Traffic:
    read: int
    write: int

    @property
    def total(self) -> int:
        return self.read + self.write

    def __add__(self, other: "Traffic") -> "Traffic":
        return Traffic(self.read + other.read, self.write + other.write)

    def scale(self, k: float) -> "Traffic":
        return Traffic(int(round(self.read * k)), int(round(self.write * k)))


def verify_traffic(shape: Shape, record: str, *, state_itemsize: int = 4, input_itemsize: int = 2, out_itemsize: int | None = None) -> Traffic:
    """Bytes of one layer's verify (see the module docstring)."""
    s = shape
    o = input_itemsize if out_itemsize is None else out_itemsize
    read = (
        s.N * s.HV * s.V * s.K * state_itemsize
        + 2 * s.N * s.D * s.H * s.K * input_itemsize
        + s.N * s.D * s.HV * s.V * input_itemsize
        + 2 * s.N * s.D * s.HV * input_itemsize
        + 2 * s.HV * F32
    )
    write = s.N * s.D * s.HV * s.V * o
    if record == "tuples":
        write += s.N * s.D * (s.HV * s.V + s.H * s.K + s.HV) * F32
    elif record == "snapshots":
        write += s.N * s.D * s.HV * s.V * s.K * state_itemsize
    else:
        raise ValueError(f"record must be 'tuples' or 'snapshots', got {record!r}")
    return Traffic(read, write)


def _masks(idx: CommitIndices, slots_in_pool: int, rows_in_tape: int, drafts: int):
    """Which requests write their accepted and track states (api.commit's rules)."""
    S, R, D = slots_in_pool, rows_in_tape, drafts
    valid = (idx.slots >= 0) & (idx.slots < S) & (idx.rows >= 0) & (idx.rows < R)
    accept = valid & (idx.steps >= 0) & (idx.steps < D)
    track = valid & (idx.track_steps >= 0) & (idx.track_steps < D) & (idx.track_slots >= 0) & (idx.track_slots < S)
    return accept, track


def commit_traffic(
    shape: Shape, layers: int, idx: CommitIndices, record: str, *, slots_in_pool: int, rows_in_tape: int | None = None, state_itemsize: int = 4
) -> Traffic:
    """Bytes of one commit of all ``layers`` layers with the indices ``idx`` (``shape.N`` requests)."""
    s = shape
    state = s.HV * s.V * s.K * state_itemsize
    accept, track = _masks(idx, slots_in_pool, rows_in_tape or s.N, s.D)
    n_acc, n_trk = int(accept.sum()), int(track.sum())
    index_bytes = 5 * len(idx.slots) * 4
    if record == "snapshots":
        per_layer = Traffic((n_acc + n_trk) * state, (n_acc + n_trk) * state)
    elif record == "tuples":
        any_ = accept | track
        last = np.maximum(np.where(accept, idx.steps, -1), np.where(track, idx.track_steps, -1))
        steps_read = int(np.sum(np.where(any_, last + 1, 0)))
        per_step = (s.HV * s.V + s.H * s.K + s.HV) * F32
        per_layer = Traffic(int(any_.sum()) * state + steps_read * per_step, (n_acc + n_trk) * state)
    else:
        raise ValueError(f"record must be 'tuples' or 'snapshots', got {record!r}")
    return Traffic(per_layer.read * layers + index_bytes, per_layer.write * layers)


def copy_traffic(nbytes: int) -> Traffic:
    """A streaming copy-like op (``x * 2``) reads and writes every byte once."""
    return Traffic(nbytes, nbytes)


def net_traffic(verify: Traffic, commit: Traffic, layers: int) -> Traffic:
    """One verify step of the whole model: every layer's verify, then the commit of all layers."""
    return verify.scale(layers) + commit
