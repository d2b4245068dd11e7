"""Model geometries: the shapes of a hybrid model's GDN layers, named once.

Tests, benchmarks, the memory tables and the command-line tool all take their shapes
from here.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Geometry", "MODELS", "FAMILY_MODELS", "LINEAR_ATTENTION_TYPES", "get_geometry"]

LINEAR_ATTENTION_TYPES = ("gdn", "kda")


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
      kv_tensors: tensors cached per KV head and token: 2 (K and V), 1 for MLA (Kimi Linear: the
        normalised latent and the shared rope key, one ``kv_head_dim`` vector).
      linear_attention: the linear-attention layer type, ``"gdn"`` (Gated DeltaNet) or
        ``"kda"`` (Kimi Delta Attention: H == HV, one decay per key channel; the pool records its
        tuples as :class:`~gdn_lossless_jax.tape.KDATuples`, ``decay="channel"``).
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
    linear_attention: str = "gdn"
    kv_tensors: int = 2

    def __post_init__(self):
        for f in ("gdn_layers", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel"):
            if getattr(self, f) <= 0:
                raise ValueError(f"Geometry {self.name!r}: {f} must be positive, got {getattr(self, f)}")
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"Geometry {self.name!r}: num_k_heads H={self.num_k_heads} must divide "
                f"num_v_heads HV={self.num_v_heads}"
            )
        if self.linear_attention not in LINEAR_ATTENTION_TYPES:
            raise ValueError(
                f"Geometry {self.name!r}: linear_attention must be one of {LINEAR_ATTENTION_TYPES}, "
                f"got {self.linear_attention!r}"
            )
        if self.linear_attention == "kda" and self.num_v_heads != self.num_k_heads:
            raise ValueError(f"Geometry {self.name!r}: a KDA geometry has as many v-heads as q/k heads, got "
                             f"num_k_heads={self.num_k_heads}, num_v_heads={self.num_v_heads}")  # fmt: skip

    @property
    def decay(self) -> str:
        """The ``decay=`` form of its linear layers: ``"scalar"`` (GDN) or ``"channel"`` (KDA)."""
        return "channel" if self.linear_attention == "kda" else "scalar"

    @property
    def full_attention_layers(self) -> int:
        return (self.layers or self.gdn_layers) - self.gdn_layers

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv1d: ``HV*V + 2*H*K`` (order ``[q | k | v]``)."""
        return self.num_v_heads * self.head_v_dim + 2 * self.num_k_heads * self.head_k_dim

    def head_divisors(self) -> tuple[int, ...]:
        """The values :meth:`reduced` accepts as ``heads_divisor``: the divisors of H."""
        return tuple(d for d in range(1, self.num_k_heads + 1) if self.num_k_heads % d == 0)

    def reduced(
        self, *, gdn_layers: int | None = None, heads_divisor: int = 1, head_dim: int | None = None
    ) -> "Geometry":
        """A smaller geometry of the same shape family, for CPU runs.

        Args:
          gdn_layers: L, from 1 to this geometry's GDN layers (None: all of them).
          heads_divisor: H and HV are both divided by it; it must divide H (one of
            :meth:`head_divisors`), so that the v-heads per q/k head, HV // H, stay the same.
          head_dim: K = V of the reduced geometry (None: unchanged).
        Returns:
          A :class:`Geometry` named ``"<name> (reduced)"``; the KV cache geometry is unchanged.

        >>> g = get_geometry("qwen3.6-35b-a3b").reduced(gdn_layers=2, heads_divisor=8, head_dim=16)
        >>> (g.gdn_layers, g.num_k_heads, g.num_v_heads, g.head_k_dim, g.conv_dim)
        (2, 2, 4, 16, 128)
        """
        where = f"Geometry.reduced ({self.name})"
        for name, value in (("gdn_layers", gdn_layers), ("heads_divisor", heads_divisor), ("head_dim", head_dim)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{where}: argument {name!r} must be a positive integer, got {value!r}")
        if gdn_layers is not None and gdn_layers > self.gdn_layers:
            raise ValueError(
                f"{where}: argument 'gdn_layers' must be at most {self.gdn_layers} (the model's GDN layers), "
                f"got {gdn_layers}"
            )
        if heads_divisor not in self.head_divisors():
            raise ValueError(
                f"{where}: argument 'heads_divisor' must divide H={self.num_k_heads} "
                f"(one of {', '.join(map(str, self.head_divisors()))}), got {heads_divisor}"
            )
        return dataclasses.replace(
            self,
            name=f"{self.name} (reduced)",
            gdn_layers=self.gdn_layers if gdn_layers is None else gdn_layers,
            num_k_heads=self.num_k_heads // heads_divisor,
            num_v_heads=self.num_v_heads // heads_divisor,
            head_k_dim=self.head_k_dim if head_dim is None else head_dim,
            head_v_dim=self.head_v_dim if head_dim is None else head_dim,
        )


# Sources of the layers, GDN layers, H, HV, K, V, Kc and KV heads below:
# - Qwen3-Next-80B-A3B: HF config Qwen/Qwen3-Next-80B-A3B-Instruct: num_hidden_layers 48,
#   full_attention_interval 4 (12 full-attention layers, 36 GDN), linear_num_key_heads 16,
#   linear_num_value_heads 32, linear_key/value_head_dim 128, linear_conv_kernel_dim 4,
#   num_key_value_heads 2, head_dim 256.
# - Qwen3.5/3.6-35B-A3B: Qwen's model card ("40 layers, 10 x (3 x Gated DeltaNet + 1 x Gated
#   Attention); 32 heads for V and 16 for QK, head dim 128; 16 Q heads and 2 KV heads, head dim
#   256"): 10 full-attention layers x 2 (K and V) x 2 KV heads x 256 x 2 bytes = 20 KiB per bf16 token.
# - Qwen3.5/3.8-27B: 64 layers, full_attention_interval 4 (48 GDN), linear heads 16/48 of 128,
#   conv 4 (MAX's Qwen3_5Config defaults for the 27B); 4 KV heads (num-query-groups 4) of 256
#   (kv-channels 256) per THUDM/slime scripts/models/qwen3.5-27B.sh.
MODELS: dict[str, Geometry] = {
    "qwen3-next-80b-a3b": Geometry("Qwen3-Next-80B-A3B", gdn_layers=36, num_k_heads=16, num_v_heads=32, layers=48),
    "qwen3.6-35b-a3b": Geometry("Qwen3.5/3.6-35B-A3B", gdn_layers=30, num_k_heads=16, num_v_heads=32, layers=40),
    "qwen3.8-27b": Geometry("Qwen3.5/3.8-27B", gdn_layers=48, num_k_heads=16, num_v_heads=48, layers=64, kv_heads=4),
}
# The other families' released models, by model_type: not in MODELS, whose tools (the seed's
# table, --tp, trees) are Qwen's GDN ones.
# - Olmo-Hybrid-7B (allenai): 32 layers, layer_types [linear x 3, full] x 8 (24 GDN, 8 attention),
#   linear heads 30/30, linear_key_head_dim 96, linear_value_head_dim 192, conv 4; 30 attention heads, 30 KV
#   heads of 128 (hidden 3840 / 30).
# - Kimi-Linear-48B-A3B (moonshotai): 27 layers, full_attn_layers [4, 8, 12, 16, 20, 24, 27] (20 KDA, 7 MLA),
#   KDA num_heads 32, head_dim 128, short_conv_kernel_size 4; MLA kv_lora_rank 512 + qk_rope_head_dim 64 cached
#   per token (one latent for K and V).
# - Qwen4-Exp (Qwen): transformers' Qwen4ExpTextConfig defaults (the class documents Qwen/Qwen4-Exp): 40 layers,
#   every 4th an indexed attention layer (30 GDN, 10 attention), linear heads 16 k / 32 v of 128, conv 4; 16
#   attention heads, 2 KV heads of 256. Its PLE windows (the last 2 tokens, 9 conv inputs of hc x hidden a PLE
#   block) are kept beside the pool, not in it.
FAMILY_MODELS: dict[str, Geometry] = {
    "olmo_hybrid": Geometry("Olmo-Hybrid-7B", gdn_layers=24, num_k_heads=30, num_v_heads=30, head_k_dim=96,
                            head_v_dim=192, layers=32, kv_heads=30, kv_head_dim=128),
    "kimi_linear": Geometry("Kimi-Linear-48B-A3B", gdn_layers=20, num_k_heads=32, num_v_heads=32, layers=27,
                            kv_heads=1, kv_head_dim=576, kv_tensors=1, linear_attention="kda"),
    "qwen4_exp": Geometry("Qwen4-Exp", gdn_layers=30, num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128,
                          layers=40, kv_heads=2, kv_head_dim=256),
}
_ALIASES = {"qwen3.5-35b-a3b": "qwen3.6-35b-a3b", "qwen3.5-27b": "qwen3.8-27b"}


def get_geometry(name: str) -> Geometry:
    """Look up a named geometry (case-insensitive; aliases accepted).

    >>> g = get_geometry("Qwen3.5-35B-A3B")
    >>> g.name, g.gdn_layers, g.num_k_heads, g.num_v_heads, g.full_attention_layers
    ('Qwen3.5/3.6-35B-A3B', 30, 16, 32, 10)
    """
    key = name.lower()
    key = _ALIASES.get(key, key)
    if key not in MODELS:
        names = ", ".join(sorted([*MODELS, *_ALIASES]))
        raise KeyError(f"unknown model {name!r}; known models: {names}")
    return MODELS[key]
