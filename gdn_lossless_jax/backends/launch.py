"""Launch configurations: the fields the Triton-compiled kernels of the ``pallas`` and ``triton``
backends share, defined and checked once. Each backend's ``VerifyConfig`` and ``CommitConfig``
extend these with the fields of its own kernels."""

from __future__ import annotations

import dataclasses

__all__ = ["LaunchConfig", "VerifyLaunch", "ORDERS"]

#: The verify grid's orders: ``"requests"`` ``(N, HV, V / block_v)`` or ``"tiles"`` ``(V / block_v, HV, N)``.
ORDERS = ("requests", "tiles")


def _power_of_two(config, *names: str, zero: bool = False) -> None:
    for name in names:
        n = getattr(config, name)
        if not isinstance(n, int) or n < (0 if zero else 1) or n & (n - 1):
            what = "a power of 2 (or 0)" if zero else "a power of 2"
            raise ValueError(f"{type(config).__name__}: {name} must be {what}, got {n!r}")


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """A kernel's tile and Triton launch.

    Attributes:
      block_v: V rows per program (a power of 2; :meth:`fit` caps it at V).
      num_warps: warps a program (a power of 2).
      num_stages: Triton's software-pipelining stages (>= 1).
    """

    block_v: int = 8
    num_warps: int = 1
    num_stages: int = 1

    def __post_init__(self):
        _power_of_two(self, "block_v", "num_warps")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"{type(self).__name__}: num_stages must be >= 1, got {self.num_stages!r}")

    def fit(self, V: int):
        """The config with ``block_v`` at most V."""
        return dataclasses.replace(self, block_v=min(self.block_v, V))


@dataclasses.dataclass(frozen=True)
class VerifyLaunch(LaunchConfig):
    """The fields both verify kernels share (the same arithmetic for both record modes).

    Attributes:
      k_chunk: columns a chunk of the ``[block_v, K]`` state tile (a power of 2); a K-reduction
        sums the chunks elementwise, then reduces once.
      order: the grid's order (:data:`ORDERS`); None: tiles first for snapshots, requests first
        for tuples. Changes no arithmetic.
      prep_heads: q/k heads a program of the prologue kernel (0: all heads in one; else a power of 2).
    """

    k_chunk: int = 16
    order: str | None = None
    prep_heads: int = 2

    def __post_init__(self):
        super().__post_init__()
        _power_of_two(self, "k_chunk")
        _power_of_two(self, "prep_heads", zero=True)
        if self.order not in (None, *ORDERS):
            raise ValueError(f"{type(self).__name__}: order must be None or one of {ORDERS}, got {self.order!r}")
