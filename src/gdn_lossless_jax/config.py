"""Model geometries: the shapes of a hybrid model's GDN layers, named once.

Tests, benchmarks, the memory tables and the command-line tool all take their shapes
from here.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Geometry", "MODELS", "get_geometry"]


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The GDN part of a model (per tensor-parallel rank).

    Attributes:
      name: a short name.
      gdn_layers: L, the number of Gated DeltaNet layers.
      num_k_heads: H, q/k heads.
      num_v_heads: HV, v heads (a multiple of H; v-heads ``[h*r, (h+1)*r)`` share k-head h).
      head_k_dim: K.
      head_v_dim: V.
      conv_kernel: Kc, the causal conv1d width.
      layers: all decoder layers (GDN and full attention).
      kv_heads, kv_head_dim: the full-attention layers' KV cache geometry.
    """

    name: str
    gdn_layers: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int = 128
    head_v_dim: int = 128
    conv_kernel: int = 4
    layers: int | None = None
    kv_heads: int = 2
    kv_head_dim: int = 256

    def __post_init__(self):
        for f in ("gdn_layers", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel"):
            if getattr(self, f) <= 0:
                raise ValueError(f"Geometry {self.name!r}: {f} must be positive, got {getattr(self, f)}")
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"Geometry {self.name!r}: num_k_heads H={self.num_k_heads} must divide "
                f"num_v_heads HV={self.num_v_heads}"
            )

    @property
    def full_attention_layers(self) -> int:
        return (self.layers or self.gdn_layers) - self.gdn_layers

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv1d: ``HV*V + 2*H*K`` (order ``[q | k | v]``)."""
        return self.num_v_heads * self.head_v_dim + 2 * self.num_k_heads * self.head_k_dim

    def reduced(self, *, gdn_layers: int | None = None, heads_divisor: int = 1, head_dim: int | None = None):
        """A smaller geometry of the same shape family, for CPU runs."""
        return dataclasses.replace(
            self,
            name=f"{self.name} (reduced)",
            gdn_layers=gdn_layers or self.gdn_layers,
            num_k_heads=max(1, self.num_k_heads // heads_divisor),
            num_v_heads=max(1, self.num_v_heads // heads_divisor),
            head_k_dim=head_dim or self.head_k_dim,
            head_v_dim=head_dim or self.head_v_dim,
        )


MODELS: dict[str, Geometry] = {
    "qwen3-next-80b-a3b": Geometry("Qwen3-Next-80B-A3B", gdn_layers=36, num_k_heads=16, num_v_heads=32, layers=48),
    "qwen3.6-35b-a3b": Geometry("Qwen3.5/3.6-35B-A3B", gdn_layers=30, num_k_heads=16, num_v_heads=32, layers=40),
    "qwen3.8-27b": Geometry("Qwen3.5/3.8-27B", gdn_layers=48, num_k_heads=16, num_v_heads=48, layers=64, kv_heads=4),
}
_ALIASES = {"qwen3.5-35b-a3b": "qwen3.6-35b-a3b", "qwen3.5-27b": "qwen3.8-27b"}


def get_geometry(name: str) -> Geometry:
    """Look up a named geometry (case-insensitive; aliases accepted)."""
    key = name.lower()
    key = _ALIASES.get(key, key)
    if key not in MODELS:
        names = ", ".join(sorted([*MODELS, *_ALIASES]))
        raise KeyError(f"unknown model {name!r}; known models: {names}")
    return MODELS[key]
