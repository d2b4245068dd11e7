"""The sizes of a Qwen3-Next / Qwen3.5 checkpoint, read from its ``config.json``."""

from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp

from ...config import Geometry
from .. import numerics

__all__ = ["HFConfig", "MODEL_TYPES", "FAMILY_TYPES", "read_config"]

#: ``model_type`` values that load, and the family each belongs to. ``*_text`` is what
#: ``save_pretrained`` writes for the text-only classes; ``qwen3_5`` and ``qwen3_5_moe`` nest the
#: text model's sizes in ``text_config`` (the Hub's vision-language checkpoints).
MODEL_TYPES = {
    "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "olmo_hybrid": "olmo_hybrid",
    "kimi_linear": "kimi_linear",
    "qwen4_exp": "qwen4_exp",
    "qwen4_exp_text": "qwen4_exp",
}
#: The families loaded as a :class:`~gdn_lossless_jax.model.hf.family.FamilyModel` (their own forward and decoder,
#: not Qwen's engine): each is the module of its name in this package (``family_module``).
FAMILY_TYPES = ("olmo_hybrid", "kimi_linear", "qwen4_exp")


@dataclasses.dataclass(frozen=True)
class HFConfig:
    """A checkpoint's text model (all static, hashable: part of the jitted step).

    Attributes follow transformers' names where they exist; the GDN and attention sizes are also
    exposed under the names :mod:`gdn_lossless_jax.model.decode` reads (``geometry``,
    ``attention_layers``, ``kv_heads``, ``attn_head_dim``, ``jnp_dtype``, ``num_k_heads`` ...).

    Attributes:
      model_type: the family, ``qwen3_next``, ``qwen3_5`` or ``qwen3_5_moe``.
      layer_types: per block, ``"linear_attention"`` (GDN) or ``"full_attention"``.
      moe_layers: per block, True where the MLP is the sparse MoE block.
      packed_gdn: True for qwen3_next (``in_proj_qkvz``/``in_proj_ba``, head-grouped).
      rotary_dim: rotated dims of each attention head (``head_dim * partial_rotary_factor``).
      norm_topk_prob: renormalise the top-k routing weights (always on in qwen3_5_moe).
      draft: ``"mtp"`` (the checkpoint's MTP block) or ``"self"`` (the first ``draft_layers``
        blocks, all GDN, then the final norm and head).
      dtype: parameters and activations (norms, gates, softmax, the GDN state in fp32).
      invariant: the *invariant decoding mode* (:attr:`invariant_dots`), as the demo model's
        (:class:`~gdn_lossless_jax.model.model.ModelConfig`): every matmul and einsum computes each
        row (token) in dots of one fixed shape (:func:`~gdn_lossless_jax.model.numerics.matmul`; the
        MoE's experts one at a time), the attention each query alone
        (:func:`~gdn_lossless_jax.model.numerics.per_query_attention`), the elementwise functions in
        float64 rounded once (:func:`~gdn_lossless_jax.model.numerics.transcendental`), and every
        rounding to ``dtype`` is pinned (an optimization barrier), at the points where transformers
        rounds. On the CPU ``tests/test_hf_invariance.py`` shows on tiny random checkpoints that
        speculative greedy decoding (the MTP draft or the self-draft, D of 1, 2 or 4) ends with plain
        greedy decoding's tokens and states bit for bit, and that a request alone and beside others in a
        batch gets the same bits (the mode off: they differ). None (the
        default): on when JAX's default backend is the CPU, off elsewhere (XLA's dots as they are).
        True on another platform raises NotImplementedError.
    """

    model_type: str
    vocab: int
    d_model: int
    layer_types: tuple[str, ...]
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    attn_heads: int
    kv_heads: int
    attn_head_dim: int
    rotary_dim: int
    rope_theta: float
    rms_eps: float
    intermediate_size: int
    moe_layers: tuple[bool, ...]
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    tie_embeddings: bool = False
    packed_gdn: bool = False
    draft: str = "self"
    draft_layers: int = 1
    dtype: str = "float32"
    name: str = "checkpoint"
    invariant: bool | None = None

    def __post_init__(self):
        if self.draft not in ("mtp", "self"):
            raise ValueError(f"HFConfig: draft must be 'mtp' or 'self', got {self.draft!r}")
        if self.draft == "self":
            lead = next((i for i, t in enumerate(self.layer_types) if t != "linear_attention"), self.layers)
            if not 1 <= self.draft_layers <= lead or self.draft_layers >= self.layers:
                raise ValueError(
                    f"HFConfig: the self-draft runs the first draft_layers blocks, which must all be GDN layers and "
                    f"fewer than all {self.layers}: expected 1 <= draft_layers <= {min(lead, self.layers - 1)}, "
                    f"got {self.draft_layers}"
                )
        if jnp.dtype(self.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
            raise ValueError(f"HFConfig: dtype must be float32 or bfloat16, got {self.dtype!r}")
        numerics.check_invariant(self.invariant, "HFConfig")

    @property
    def invariant_dots(self) -> bool:
        """Whether the model runs in the invariant mode (see ``invariant``): ``invariant``, or when it
        is None, whether JAX's default backend is the CPU (read when a step is traced).

        Raises NotImplementedError for ``invariant=True`` on another platform: only XLA:CPU's
        blocked dots are established (a GPU needs its own, e.g. a Pallas matmul of fixed tiles)."""
        return numerics.invariant_mode(self.invariant, "HFConfig")

    @property
    def layers(self) -> int:
        return len(self.layer_types)

    @property
    def kinds(self) -> tuple[str, ...]:
        """``"gdn"`` or ``"attention"`` per block."""
        return tuple("gdn" if t == "linear_attention" else "attention" for t in self.layer_types)

    @property
    def gdn_layers(self) -> int:
        return self.kinds.count("gdn")

    @property
    def attention_layers(self) -> int:
        """KV cache layers: the target's attention blocks, plus the MTP block's when it drafts."""
        return self.kinds.count("attention") + (self.draft == "mtp")

    @property
    def geometry(self) -> Geometry:
        return Geometry(
            f"{self.model_type}-{self.name}", gdn_layers=self.gdn_layers, num_k_heads=self.num_k_heads,
            num_v_heads=self.num_v_heads, head_k_dim=self.head_k_dim, head_v_dim=self.head_v_dim,
            conv_kernel=self.conv_kernel, layers=self.layers, kv_heads=self.kv_heads, kv_head_dim=self.attn_head_dim,
        )  # fmt: skip

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    def describe(self) -> str:
        moe = (f", MoE {self.num_experts} experts top-{self.top_k} in {sum(self.moe_layers)} blocks"
               if any(self.moe_layers) else "")  # fmt: skip
        draft = "the MTP block" if self.draft == "mtp" else f"the first {self.draft_layers} block(s)"
        return (
            f"{self.model_type} {self.name}: {self.layers} blocks ({self.gdn_layers} GDN H={self.num_k_heads} "
            f"HV={self.num_v_heads} K={self.head_k_dim} V={self.head_v_dim}, {self.kinds.count('attention')} attention "
            f"{self.attn_heads}q/{self.kv_heads}kv x {self.attn_head_dim}, rotary {self.rotary_dim}){moe}, d_model "
            f"{self.d_model}, vocab {self.vocab}, {self.dtype}{', tied head' if self.tie_embeddings else ''}; "
            f"draft: {draft}" + (f"; invariant={self.invariant}" if self.invariant is not None else "")
        )


def _get(cfg: dict, key: str, where: str, default=None, required: bool = True):
    if key in cfg:
        return cfg[key]
    if required and default is None:
        raise ValueError(f"load_pretrained: {where} has no key {key!r}, which is required")
    return default


def read_json(file: str, what: str = "load_pretrained"):
    """A JSON file's content; a file that does not parse raises a ValueError naming it and where it breaks."""
    with open(file) as f:
        text = f.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what}: {file} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno} "
                         f"(char {e.pos} of {len(text)})") from None  # fmt: skip


def read_config(path: str | os.PathLike) -> tuple[dict, dict]:
    """``(config.json as a dict, the text model's part)``; checks ``model_type``."""
    file = os.path.join(os.fspath(path), "config.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"load_pretrained: argument 'path' must be a Hugging Face checkpoint folder with a "
                                f"config.json, got {os.fspath(path)!r} (no {file})")  # fmt: skip
    full = read_json(file)
    if not isinstance(full, dict):
        raise ValueError(f"load_pretrained: {file} must hold a JSON object, got a {type(full).__name__}")
    mt = full.get("model_type")
    if mt not in MODEL_TYPES:
        raise ValueError(f"load_pretrained: {file}: model_type {mt!r} is not supported; expected one of "
                         f"{sorted(MODEL_TYPES)}")  # fmt: skip
    text = full.get("text_config", full) if mt in ("qwen3_5", "qwen3_5_moe") else full
    if not isinstance(text, dict):
        raise ValueError(f"load_pretrained: {file}: text_config must be a mapping, got {type(text).__name__}")
    return full, text


def config_from_dict(full: dict, text: dict, *, dtype: str, draft: str, draft_layers: int | None,
                     name: str, source: str = "config.json") -> HFConfig:  # fmt: skip
    """The :class:`HFConfig` of a ``config.json`` (unsupported options raise); ``source``: the file's path,
    named in errors."""
    family = MODEL_TYPES[full["model_type"]]
    where = source + (" (its text_config)" if text is not full else "")
    g = lambda k, d=None, required=True: _get(text, k, where, d, required)  # noqa: E731
    n_layers = g("num_hidden_layers")
    types = g("layer_types", None, required=False)
    if types is None:
        interval = g("full_attention_interval", 4, required=False)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)]
    types = tuple(types)
    if len(types) != n_layers or set(types) - {"linear_attention", "full_attention"}:
        raise ValueError(f"load_pretrained: {where}: layer_types must list num_hidden_layers={n_layers} entries "
                         f"'linear_attention' or 'full_attention', got {list(types)}")  # fmt: skip
    if g("hidden_act", "silu", required=False) != "silu":
        raise ValueError(f"load_pretrained: {where}: hidden_act {g('hidden_act')!r} is not supported (expected 'silu')")
    if g("attention_bias", False, required=False):
        raise ValueError(f"load_pretrained: {where}: attention_bias=true is not supported")
    rope = dict(g("rope_parameters", None, required=False) or {})
    rope.setdefault("rope_theta", g("rope_theta", 10000.0, required=False))
    rope.setdefault("partial_rotary_factor", g("partial_rotary_factor", 0.25, required=False))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default" or g("rope_scaling", None, required=False):
        raise ValueError(f"load_pretrained: {where}: rope_type {rope_type!r} / rope_scaling "
                         f"{g('rope_scaling', None, required=False)!r} is not supported (only 'default' RoPE)")  # fmt: skip
    d = g("hidden_size")
    hd = g("head_dim", None, required=False) or d // g("num_attention_heads")
    experts = g("num_experts", 0, required=False) if family != "qwen3_5" else 0
    if family == "qwen3_next":
        step, only = g("decoder_sparse_step", 1, required=False), set(g("mlp_only_layers", None, required=False) or [])
        moe = tuple(bool(experts) and i not in only and (i + 1) % step == 0 for i in range(n_layers))
    else:
        moe = (bool(experts),) * n_layers
    lead = next((i for i, t in enumerate(types) if t != "linear_attention"), n_layers)
    return HFConfig(
        model_type=family, vocab=g("vocab_size"), d_model=d, layer_types=types,
        num_k_heads=g("linear_num_key_heads"), num_v_heads=g("linear_num_value_heads"),
        head_k_dim=g("linear_key_head_dim"), head_v_dim=g("linear_value_head_dim"),
        conv_kernel=g("linear_conv_kernel_dim", 4, required=False), attn_heads=g("num_attention_heads"),
        kv_heads=g("num_key_value_heads"), attn_head_dim=hd,
        rotary_dim=int(hd * float(rope["partial_rotary_factor"])), rope_theta=float(rope["rope_theta"]),
        rms_eps=float(g("rms_norm_eps", 1e-6, required=False)),
        intermediate_size=g("intermediate_size", 0, required=False) or 0, moe_layers=moe,
        num_experts=experts or 0, top_k=g("num_experts_per_tok", 0, required=False) if experts else 0,
        moe_intermediate_size=g("moe_intermediate_size", 0, required=False) if experts else 0,
        shared_expert_intermediate_size=g("shared_expert_intermediate_size", 0, required=False) if experts else 0,
        norm_topk_prob=bool(g("norm_topk_prob", True, required=False)) if family == "qwen3_next" else True,
        tie_embeddings=bool(full.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        packed_gdn=family == "qwen3_next", draft=draft,
        draft_layers=draft_layers if draft_layers is not None else max(1, min(lead, n_layers - 1)),
        dtype=dtype, name=name,
    )  # fmt: skip
