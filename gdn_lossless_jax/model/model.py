"""A small hybrid GDN language model (Qwen3-Next / Qwen3.5 style) with random weights.

Layers: token embedding; ``layers`` decoder blocks, each a mixer and a SwiGLU MLP behind
pre-RMSNorms, where every ``attention_interval``-th block's mixer is gated full attention
(q/k RMSNorm, rotary positions, grouped KV heads, a sigmoid output gate, a KV cache) and the
others are Gated DeltaNet (GDN) layers; a final RMSNorm and an untied LM head.

A GDN mixer, as in Qwen3-Next: in-projections to ``mixed_qkv = [q | k | v]``, ``z``, ``b``
and ``a``; the causal conv (SiLU) over ``mixed_qkv``; the gates from ``a``, ``b``, ``A_log``
and ``dt_bias``; the recurrence; a gated RMSNorm per v-head (``rmsnorm(o) * w * silu(z)``);
the out-projection. The conv and the recurrence are *not* written here: a mixer takes a
``core(mixed_qkv, a, b, layer_params) -> o [N, T, HV, V]`` callback, which the target fills
with :func:`gdn_lossless_jax.pool.verify_layer` (the state pool, its scratch and, later, its
commit) and the draft with one step of the reference recurrence from a carried state
(:mod:`gdn_lossless_jax.model.decode`). So every state that lands in the pool comes from the
library's verify and commit.

Parameters are plain pytrees (frozen dataclasses registered with JAX), not Flax NNX: the model
has no training and no mutable module state, so parameters pass through ``jax.jit`` and
``lax.scan`` as they are, and the arithmetic (which matmul, in which dtype) stays visible.

Initialisation is deterministic from a seed (``jax.random`` threefry, the same bits on every
platform). So that a layer-skipping draft of random weights agrees with the target often but
not always, the output projections of the blocks the draft skips are scaled by
``residual_scale`` (0.2): the residual stream is dominated by the embedding and the draft's own
blocks, which target and draft share.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ..config import Geometry
from ..reference import ksum
from . import numerics
from .numerics import (  # noqa: F401  (the invariant mode's primitives, re-exported)
    INVARIANT_ROWS,
    _blocked_matmul,
    _per_device,
    dot_precision,
    einsum,
    matmul,
    per_query_attention,
    rows_mesh,
    settle,
    softmax,
    transcendental,
)

__all__ = [
    "ModelConfig",
    "SIZES",
    "get_config",
    "Params",
    "GDNParams",
    "AttentionParams",
    "MLPParams",
    "init_params",
    "rmsnorm",
    "gated_rmsnorm",
    "mlp",
    "gdn_mixer",
    "attention",
    "tree_attention",
    "logits",
    *numerics.__all__,
]

F32 = jnp.float32
RMS_EPS = 1e-6
ROPE_THETA = 10_000.0
DT_RANGE = (math.log(1e-3), math.log(1e-1))  # Mamba2's dt_min, dt_max


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes of the hybrid model (all static).

    Attributes:
      name: the size's name.
      vocab: vocabulary size.
      d_model: width of the residual stream.
      layers: decoder blocks; block ``i`` is full attention when ``(i + 1) %
        attention_interval == 0`` (Qwen3-Next's ``full_attention_interval``), else GDN.
      num_k_heads, num_v_heads, head_k_dim, head_v_dim, conv_kernel: the GDN layers
        (H, HV, K, V, Kc).
      attn_heads, kv_heads, attn_head_dim: the full-attention layers (grouped KV heads).
      mlp_dim: hidden width of the SwiGLU MLPs.
      draft_layers: the leading blocks the layer-skipping draft runs (all GDN).
      residual_scale: scale of the output projections of the blocks the draft skips, at
        initialisation (see the module docstring: smaller means a draft that agrees more often).
      draft_scale: the same for the draft's blocks.
      logit_scale: scale of the LM head (logits of a few units: top-2 gaps far above 1e-4).
      dtype: parameter and activation dtype (norms, gates and softmax run in fp32).
      invariant: the *invariant decoding mode* (:attr:`invariant_dots`): every matmul and
        einsum of the model computes each row in dots of one fixed shape (:func:`matmul`,
        :func:`einsum`; on a mesh per device, :func:`rows_mesh`), and the values its functions
        hand on are rounded to their dtype in every program, so that a request's tokens and
        states do not depend on how many rows the step has, which row it is in, what the other
        rows hold or how a mesh splits the work (on the CPU: ``tests/test_invariance.py``).
        None (the default): on when JAX's default backend is the CPU, off elsewhere (XLA's dots
        as they are; a GPU implementation is not written yet). True on another platform raises.
    """

    name: str
    vocab: int
    d_model: int
    layers: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    attn_heads: int
    kv_heads: int
    attn_head_dim: int
    mlp_dim: int
    conv_kernel: int = 4
    attention_interval: int = 4
    draft_layers: int = 1
    residual_scale: float = 0.2
    draft_scale: float = 1.0
    logit_scale: float = 4.0
    dtype: str = "float32"
    invariant: bool | None = None

    def __post_init__(self):
        for f in ("vocab", "d_model", "layers", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim",
                  "attn_heads", "kv_heads", "attn_head_dim", "mlp_dim", "conv_kernel", "attention_interval"):
            if getattr(self, f) < 1:
                raise ValueError(f"ModelConfig {self.name!r}: {f} must be positive, got {getattr(self, f)}")
        if self.attn_heads % self.kv_heads:
            raise ValueError(
                f"ModelConfig {self.name!r}: kv_heads={self.kv_heads} must divide attn_heads={self.attn_heads}"
            )
        if self.attn_head_dim % 2:
            raise ValueError(
                f"ModelConfig {self.name!r}: attn_head_dim must be even (rotary pairs), got {self.attn_head_dim}"
            )
        if not 0 <= self.draft_layers < self.layers:
            raise ValueError(
                f"ModelConfig {self.name!r}: draft_layers must be in [0, layers={self.layers}), got {self.draft_layers}"
            )
        attn_in_draft = [i for i in range(self.draft_layers) if self.is_attention(i)]
        if attn_in_draft:
            raise ValueError(
                f"ModelConfig {self.name!r}: the draft's blocks must all be GDN layers, but block(s) {attn_in_draft} "
                f"of the first draft_layers={self.draft_layers} are full attention "
                f"(attention_interval={self.attention_interval})"
            )
        if not self.gdn_layers:
            raise ValueError(f"ModelConfig {self.name!r}: no GDN layer (layers={self.layers}, "
                             f"attention_interval={self.attention_interval})")
        if jnp.dtype(self.dtype) not in (jnp.dtype(F32), jnp.dtype(jnp.bfloat16)):
            raise ValueError(f"ModelConfig {self.name!r}: dtype must be float32 or bfloat16, got {self.dtype!r}")
        numerics.check_invariant(self.invariant, f"ModelConfig {self.name!r}")

    @property
    def invariant_dots(self) -> bool:
        """Whether the model's dots run in the invariant mode (see ``invariant``): ``invariant``,
        or when it is None, whether JAX's default backend is the CPU (read when a step is traced).

        Raises NotImplementedError for ``invariant=True`` on another platform: only XLA:CPU's
        blocked dots are established (a GPU needs its own, e.g. a Pallas matmul of fixed tiles)."""
        return numerics.invariant_mode(self.invariant, f"ModelConfig {self.name!r}")

    def is_attention(self, block: int) -> bool:
        return (block + 1) % self.attention_interval == 0

    @property
    def kinds(self) -> tuple[str, ...]:
        """``"gdn"`` or ``"attention"`` per block."""
        return tuple("attention" if self.is_attention(i) else "gdn" for i in range(self.layers))

    @property
    def gdn_layers(self) -> int:
        return self.kinds.count("gdn")

    @property
    def attention_layers(self) -> int:
        return self.kinds.count("attention")

    @property
    def geometry(self) -> Geometry:
        """The GDN part, as the state pool takes it."""
        return Geometry(
            f"model-{self.name}",
            gdn_layers=self.gdn_layers,
            num_k_heads=self.num_k_heads,
            num_v_heads=self.num_v_heads,
            head_k_dim=self.head_k_dim,
            head_v_dim=self.head_v_dim,
            conv_kernel=self.conv_kernel,
            layers=self.layers,
            kv_heads=self.kv_heads,
            kv_head_dim=self.attn_head_dim,
        )

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    def describe(self) -> str:
        return (
            f"{self.name}: {self.layers} blocks ({self.gdn_layers} GDN H={self.num_k_heads} HV={self.num_v_heads} "
            f"K={self.head_k_dim} V={self.head_v_dim}, {self.attention_layers} attention {self.attn_heads}q/"
            f"{self.kv_heads}kv x {self.attn_head_dim}), d_model {self.d_model}, vocab {self.vocab}, {self.dtype}; "
            f"draft: the first {self.draft_layers} block(s)"
            + (f"; invariant={self.invariant}" if self.invariant is not None else "")
        )


#: Named sizes. ``tiny`` decodes in seconds on a CPU; ``gpu`` has the real head geometry
#: of Qwen3-Next / Qwen3.5 (H=16, HV=32, K=V=128; attention 16 q and 2 KV heads of 256) at
#: four blocks. ``deep`` has Qwen3.5/3.6-35B-A3B's depth too: 40 blocks, 30 GDN and 10
#: gated attention, with a small dense MLP and vocabulary (it compiles and fits quickly: the
#: GDN layers' share of a step is larger than in the real model). ``deep-a3b`` sizes the rest
#: like that model's per-token work: a dense MLP of 9 x 512 (its 8 routed experts and the shared
#: one, each 512 wide: the same weights read per token), its 248,320-token vocabulary and untied
#: head; about 3.4 B parameters (6.9 GB in bf16).
SIZES: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        "tiny", vocab=512, d_model=64, layers=4, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16,
        attn_heads=4, kv_heads=2, attn_head_dim=16, mlp_dim=128,
    ),
    "gpu": ModelConfig(
        "gpu", vocab=4096, d_model=2048, layers=4, num_k_heads=16, num_v_heads=32, head_k_dim=128,
        head_v_dim=128, attn_heads=16, kv_heads=2, attn_head_dim=256, mlp_dim=4096, dtype="bfloat16",
    ),
    "deep": ModelConfig(
        "deep", vocab=8192, d_model=2048, layers=40, num_k_heads=16, num_v_heads=32, head_k_dim=128,
        head_v_dim=128, attn_heads=16, kv_heads=2, attn_head_dim=256, mlp_dim=1024, dtype="bfloat16",
    ),
    "deep-a3b": ModelConfig(
        "deep-a3b", vocab=248_320, d_model=2048, layers=40, num_k_heads=16, num_v_heads=32, head_k_dim=128,
        head_v_dim=128, attn_heads=16, kv_heads=2, attn_head_dim=256, mlp_dim=9 * 512, dtype="bfloat16",
    ),
}  # fmt: skip


def get_config(name: str) -> ModelConfig:
    """Look up a named size."""
    if name not in SIZES:
        raise KeyError(f"unknown model size {name!r}; known sizes: {', '.join(SIZES)}")
    return SIZES[name]


def _pytree(cls):
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


@_pytree
class GDNParams:
    """One GDN mixer. ``w_qkv [d, 2*H*K + HV*V]``, ``w_z [d, HV*V]``, ``w_b``, ``w_a [d, HV]``,
    ``conv_weight [conv_dim, Kc]``, ``A_log``, ``dt_bias [HV]`` (fp32), ``norm [V]``,
    ``w_out [HV*V, d]``."""

    w_qkv: jax.Array
    w_z: jax.Array
    w_b: jax.Array
    w_a: jax.Array
    conv_weight: jax.Array
    A_log: jax.Array
    dt_bias: jax.Array
    norm: jax.Array
    w_out: jax.Array


@_pytree
class AttentionParams:
    """One gated full-attention mixer. ``w_q``, ``w_gate [d, nq*hd]``, ``w_k``, ``w_v
    [d, nkv*hd]``, ``q_norm``, ``k_norm [hd]``, ``w_o [nq*hd, d]``."""

    w_q: jax.Array
    w_gate: jax.Array
    w_k: jax.Array
    w_v: jax.Array
    q_norm: jax.Array
    k_norm: jax.Array
    w_o: jax.Array


@_pytree
class MLPParams:
    """SwiGLU: ``w_gate``, ``w_up [d, mlp_dim]``, ``w_down [mlp_dim, d]``."""

    w_gate: jax.Array
    w_up: jax.Array
    w_down: jax.Array


@_pytree
class Block:
    """One decoder block: ``norm1``, ``norm2 [d]``, a mixer and an MLP."""

    norm1: jax.Array
    mixer: GDNParams | AttentionParams
    norm2: jax.Array
    mlp: MLPParams


@_pytree
class Params:
    """The whole model: ``embed [vocab, d]``, ``blocks``, ``final_norm [d]``, ``head [d, vocab]``."""

    embed: jax.Array
    blocks: tuple[Block, ...]
    final_norm: jax.Array
    head: jax.Array


def _inverse_softplus(y):
    return y + jnp.log(-jnp.expm1(-y))


def init_params(config: ModelConfig, seed: int = 0) -> Params:
    """Random weights, deterministic in ``seed`` (fan-in scaled normals).

    Gates as Mamba2 initialises them: ``A_log = log(U(1, 16))`` and ``dt_bias`` the inverse
    softplus of ``dt = exp(U(log 1e-3, log 1e-1))``, so the decays ``exp(g)`` sit mostly in
    0.6-0.999 and the states remember many tokens (Qwen3-Next's placeholder ``dt_bias = 1``
    decays by ``exp(-1.3 A)`` per token: a state that forgets within a token or two would
    hide a wrong committed state). Output projections (the GDN and attention
    out-projections, the MLP's down-projection) are scaled by ``draft_scale`` in the draft's
    blocks and ``residual_scale`` in the others.
    """
    c = config
    dt = c.jnp_dtype
    keys = iter(jax.random.split(jax.random.key(seed), 16 * c.layers + 4))

    def normal(shape, std):
        return (std * jax.random.normal(next(keys), shape, F32)).astype(dt)

    def dense(fan_in, fan_out, scale=1.0):
        return normal((fan_in, fan_out), scale / math.sqrt(fan_in))

    d, g = c.d_model, c.geometry
    blocks = []
    for i, kind in enumerate(c.kinds):
        out_scale = c.draft_scale if i < c.draft_layers else c.residual_scale
        if kind == "gdn":
            HV, V = c.num_v_heads, c.head_v_dim
            mixer = GDNParams(
                w_qkv=dense(d, g.conv_dim),
                w_z=dense(d, HV * V),
                w_b=dense(d, HV),
                w_a=dense(d, HV),
                conv_weight=(jax.random.uniform(next(keys), (g.conv_dim, c.conv_kernel), F32, -1.0, 1.0)
                             / math.sqrt(c.conv_kernel)).astype(dt),
                A_log=jnp.log(jax.random.uniform(next(keys), (HV,), F32, 1.0, 16.0)),
                dt_bias=_inverse_softplus(jnp.exp(jax.random.uniform(next(keys), (HV,), F32, *DT_RANGE))),
                norm=jnp.ones((V,), dt),
                w_out=dense(HV * V, d, out_scale),
            )  # fmt: skip
        else:
            nq, nkv, hd = c.attn_heads, c.kv_heads, c.attn_head_dim
            mixer = AttentionParams(
                w_q=dense(d, nq * hd),
                w_gate=dense(d, nq * hd),
                w_k=dense(d, nkv * hd),
                w_v=dense(d, nkv * hd),
                q_norm=jnp.ones((hd,), dt),
                k_norm=jnp.ones((hd,), dt),
                w_o=dense(nq * hd, d, out_scale),
            )
        mlp_p = MLPParams(dense(d, c.mlp_dim), dense(d, c.mlp_dim), dense(c.mlp_dim, d, out_scale))
        blocks.append(Block(jnp.ones((d,), dt), mixer, jnp.ones((d,), dt), mlp_p))
    return Params(
        embed=normal((c.vocab, d), 1.0),
        blocks=tuple(blocks),
        final_norm=jnp.ones((d,), dt),
        head=dense(d, c.vocab, c.logit_scale),
    )


# ---------------------------------------------------------------------------------
# Layer functions. Activations ``[N, T, ...]``: N rows, T tokens per row.
# ---------------------------------------------------------------------------------
def _mean_sq(x: jax.Array) -> jax.Array:
    """``mean(x * x)`` over the last axis of an fp32 ``x``, keeping the axis: the squares summed in
    a fixed order (:func:`gdn_lossless_jax.reference.ksum`: behind an optimization barrier, then a
    pairwise tree), not ``jnp.mean``, whose order XLA chooses per program from the operand's shape
    and layout (see :func:`gated_rmsnorm`): a mesh's program would get other bits than one
    device's."""
    return ksum(x * x)[..., None] / x.shape[-1]


def rmsnorm(x: jax.Array, weight: jax.Array, *, invariant: bool = False) -> jax.Array:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last axis, in fp32; x's dtype out.

    The mean in a fixed order (:func:`_mean_sq`), as in :func:`gated_rmsnorm`; ``invariant``: the
    reciprocal square root in float64 (:func:`transcendental`)."""
    xf = x.astype(F32)
    y = xf * transcendental("rsqrt", _mean_sq(xf) + RMS_EPS, invariant)
    return (y * weight.astype(F32)).astype(x.dtype)


def gated_rmsnorm(o: jax.Array, z: jax.Array, weight: jax.Array, dtype, *, invariant: bool = False) -> jax.Array:
    """Qwen3-Next's output gate: ``rmsnorm(o) * weight * silu(z)`` per v-head.

    The mean of ``o * o`` over V is summed in a fixed order (:func:`gdn_lossless_jax.reference.pairwise_sum`),
    not with ``jnp.mean``: ``o`` comes out of the verify, and XLA chooses the order of a
    ``reduce`` per program from its operand. On XLA:CPU a ``reduce`` over more than 32
    elements is either handed to YNNPACK whole or split into a 32-wide ``reduce-window``
    and a second ``reduce``, depending on the operand's layout; one device's step (verify's
    output in a transposed layout) and a mesh's (the same output gathered over the tensor
    axis, in the default layout) got the two orders at V = 128, and so other bits. (A
    precaution, not needed in the runs so far: the squares go through an optimization barrier,
    so that XLA:CPU cannot contract one of them into the first add, an FMA where both land in
    one fusion, which is again the program's choice.)

    Args: o, z ``[N, T, HV, V]``; weight ``[V]``; invariant: the reciprocal square root and the
    SiLU in float64 (:func:`transcendental`). Returns ``[N, T, HV * V]`` in ``dtype``.
    """
    of = o.astype(F32)
    y = of * transcendental("rsqrt", _mean_sq(of) + RMS_EPS, invariant) * weight.astype(F32)
    y = y * transcendental("silu", z.astype(F32), invariant)
    return y.reshape(*y.shape[:-2], -1).astype(dtype)


def _settle(x: jax.Array, config: ModelConfig) -> jax.Array:
    """:func:`~gdn_lossless_jax.model.numerics.settle` in ``config``'s invariant mode."""
    return settle(x, config.invariant_dots)


def mlp(p: MLPParams, x: jax.Array, *, invariant: bool = False) -> jax.Array:
    """SwiGLU: ``(silu(x Wg) * (x Wu)) Wd``; ``x [N, T, d]``; ``invariant``: :func:`matmul`'s, and the
    gate ``silu(x Wg) * (x Wu)`` in fp32 from the SiLU in float64 (:func:`transcendental`), rounded to
    the model's dtype once (not the dtype's own elementwise ops, which XLA may or may not round
    between: excess precision)."""
    mm = functools.partial(matmul, invariant=invariant)
    if not invariant:
        return mm(jax.nn.silu(mm(x, p.w_gate)) * mm(x, p.w_up), p.w_down)
    g, u = mm(x, p.w_gate), mm(x, p.w_up)
    return mm((transcendental("silu", g.astype(F32), True) * u.astype(F32)).astype(g.dtype), p.w_down)


def gdn_mixer(p: GDNParams, config: ModelConfig, x: jax.Array, core, rows=None) -> jax.Array:
    """A GDN mixer over T tokens per row.

    Args:
      p: the layer's parameters; x: ``[N, T, d]``, the normalised residual stream.
      core: ``core(mixed_qkv [N, T, conv_dim], a [N, T, HV], b [N, T, HV], p) -> o
        [N, T, HV, V]``: the causal conv and the recurrence (the state pool's verify for the
        target, a carried-state step for the draft).
      rows: applied to the gated norm's output before the out-projection (on a mesh: split by
        row only, so that XLA does not split the projection's sum over the tensor axis); None:
        nothing.
    Returns:
      ``[N, T, d]``, the mixer's contribution to the residual stream.
    """
    c = config
    N, T, _ = x.shape
    mm = functools.partial(matmul, invariant=c.invariant_dots)
    o = _settle(core(mm(x, p.w_qkv), mm(x, p.w_a), mm(x, p.w_b), p), c)
    z = mm(x, p.w_z).reshape(N, T, c.num_v_heads, c.head_v_dim)
    y = gated_rmsnorm(o, z, p.norm, x.dtype, invariant=c.invariant_dots)
    return mm(y if rows is None else rows(y), p.w_out)


def _rope(x: jax.Array, positions: jax.Array, invariant: bool = False) -> jax.Array:
    """Rotary embedding (rotate-half form) of ``x [N, T, heads, hd]`` at ``positions [N, T]``.

    ``invariant``: cos and sin in float64 (:func:`transcendental`), and the four products behind an
    optimization barrier, so that no program contracts one of them into the add or subtract after
    it (an FMA: XLA:CPU makes one where a multiply and an add land in one fusion)."""
    hd = x.shape[-1]
    inv = 1.0 / (ROPE_THETA ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    ang = positions.astype(F32)[..., None, None] * jnp.asarray(inv)  # [N, T, 1, hd/2]
    cos, sin = transcendental("cos", ang, invariant), transcendental("sin", ang, invariant)
    xf = x.astype(F32)
    x1, x2 = xf[..., : hd // 2], xf[..., hd // 2 :]
    products = (x1 * cos, x2 * sin, x2 * cos, x1 * sin)
    if invariant:
        products = jax.lax.optimization_barrier(products)
    a, b, c, d = products
    return jnp.concatenate([a - b, c + d], axis=-1).astype(x.dtype)


def _qkv(p: AttentionParams, c: ModelConfig, x: jax.Array, positions: jax.Array):
    """The attention's queries, keys (normalised, rotated to ``positions``) and values of ``x [N, T, d]``."""
    N, T, _ = x.shape
    inv = c.invariant_dots
    mm = functools.partial(matmul, invariant=inv)
    q = _settle(rmsnorm(mm(x, p.w_q).reshape(N, T, c.attn_heads, c.attn_head_dim), p.q_norm, invariant=inv), c)
    k = _settle(rmsnorm(mm(x, p.w_k).reshape(N, T, c.kv_heads, c.attn_head_dim), p.k_norm, invariant=inv), c)
    v = mm(x, p.w_v).reshape(N, T, c.kv_heads, c.attn_head_dim)
    return _rope(q, positions, inv), _rope(k, positions, inv), v


def attention(
    p: AttentionParams,
    config: ModelConfig,
    x: jax.Array,
    cache_k: jax.Array,
    cache_v: jax.Array,
    positions: jax.Array,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Gated causal attention of T new tokens per row over the row's KV cache.

    The new keys and values are written into the cache at ``positions`` first (speculative
    entries past the accepted length are never read: the mask is by position, and a later
    step overwrites them), then every query attends to the cache up to its own position.

    Args:
      x: ``[N, T, d]``, the normalised residual stream.
      cache_k, cache_v: ``[N, Tmax, nkv, hd]``, each row's cache (gathered by slot).
      positions: ``[N, T]`` int32, the tokens' absolute positions.
    Returns:
      ``(out [N, T, d], (cache_k, cache_v) with the new entries)``.
    """
    c = config
    N, T, _ = x.shape
    nq, nkv, hd = c.attn_heads, c.kv_heads, c.attn_head_dim
    q, k, v = _qkv(p, c, x, positions)
    n_idx = jnp.arange(N)[:, None]
    cache_k = cache_k.at[n_idx, positions].set(k.astype(cache_k.dtype), mode="drop")
    cache_v = cache_v.at[n_idx, positions].set(v.astype(cache_v.dtype), mode="drop")
    Tmax = cache_k.shape[1]
    qg = q.reshape(N, T, nkv, nq // nkv, hd)
    inv = c.invariant_dots
    if inv:
        out = per_query_attention(qg, cache_k, cache_v, positions)
    else:
        scores = einsum("ntgrh,nsgh->ngrts", qg, cache_k, preferred_element_type=F32) / math.sqrt(hd)
        mask = jnp.arange(Tmax)[None, None, :] <= positions[:, :, None]  # [N, T, Tmax]
        scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
        probs = softmax(scores)
        out = einsum("ngrts,nsgh->ntgrh", probs.astype(cache_v.dtype), cache_v, preferred_element_type=F32)
    out = out.reshape(N, T, nq * hd) * transcendental("sigmoid", matmul(x, p.w_gate, invariant=inv).astype(F32), inv)
    return matmul(out.astype(x.dtype), p.w_o, invariant=inv), (cache_k, cache_v)


def tree_attention(
    p: AttentionParams,
    config: ModelConfig,
    x: jax.Array,
    cache_k: jax.Array,
    cache_v: jax.Array,
    pos: jax.Array,
    positions: jax.Array,
    ancestors: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gated attention of a draft tree's T nodes over the row's committed cache and their ancestors.

    Node i attends to the cache's positions before ``pos`` (the committed prefix) and to the nodes
    ``ancestors[:, i]`` marks (its root path, itself included); its rotary position is
    ``positions[:, i]`` (``pos`` plus its depth). Nothing is written: the new keys and values come
    back, and the caller writes the accepted path's.

    Args:
      x: ``[N, T, d]``; cache_k, cache_v: ``[N, Tmax, nkv, hd]``; pos: ``[N]``; positions:
        ``[N, T]``; ancestors: ``[N, T, T]`` bool, ``[n, i, j]``: node j is on node i's root path.
    Returns:
      ``(out [N, T, d], k [N, T, nkv, hd], v [N, T, nkv, hd])``, k and v in the cache's dtype.
    """
    c = config
    N, T, _ = x.shape
    nq, nkv, hd = c.attn_heads, c.kv_heads, c.attn_head_dim
    q, k, v = _qkv(p, c, x, positions)
    k, v = k.astype(cache_k.dtype), v.astype(cache_v.dtype)
    Tmax = cache_k.shape[1]
    qg = q.reshape(N, T, nkv, nq // nkv, hd)
    inv = c.invariant_dots
    if inv:
        # each node attends as a chain's query at its position does: over the cache with its root path
        # written at positions pos .. pos + depth (the cache's length, so the dots of plain decoding)
        out = per_query_attention(qg, cache_k, cache_v, positions, tree=(k, v, ancestors))
    else:
        keys, vals = jnp.concatenate([cache_k, k], axis=1), jnp.concatenate([cache_v, v], axis=1)
        scores = einsum("ntgrh,nsgh->ngrts", qg, keys, preferred_element_type=F32) / math.sqrt(hd)
        prefix = jnp.broadcast_to(jnp.arange(Tmax)[None, None, :] < pos[:, None, None], (N, T, Tmax))
        mask = jnp.concatenate([prefix, ancestors], axis=-1)  # [N, T, Tmax + T]
        probs = softmax(jnp.where(mask[:, None, None], scores, -jnp.inf))
        out = einsum("ngrts,nsgh->ntgrh", probs.astype(vals.dtype), vals, preferred_element_type=F32)
    out = out.reshape(N, T, nq * hd) * transcendental("sigmoid", matmul(x, p.w_gate, invariant=inv).astype(F32), inv)
    return matmul(out.astype(x.dtype), p.w_o, invariant=inv), k, v


def logits(params: Params, h: jax.Array, *, invariant: bool = False) -> jax.Array:
    """``[N, T, d] -> [N, T, vocab]`` fp32 logits (final norm, LM head); ``invariant``: :func:`matmul`'s
    and :func:`rmsnorm`'s."""
    return matmul(rmsnorm(h, params.final_norm, invariant=invariant), params.head, preferred_element_type=F32,
                  invariant=invariant)
