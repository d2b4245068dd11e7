"""What the OLMo-Hybrid, Kimi Linear and Qwen4-Exp checkpoints share: reading tensors under the Hub's names, the
plain-weight norms, the causal conv, :func:`family_module` (a family is the module of its name) and
:class:`FamilyModel` (full-sequence logits, and decoding through the state pool).

These families load through :func:`~gdn_lossless_jax.model.hf.load_pretrained` beside Qwen's.
:meth:`FamilyModel.logits` runs each GDN (:mod:`~gdn_lossless_jax.model.hf.olmo_hybrid`,
:mod:`~gdn_lossless_jax.model.hf.qwen4_exp`) or KDA (:mod:`~gdn_lossless_jax.model.hf.kimi_linear`) layer as one
full-sequence chain from an empty state, with the library's reference rule (:func:`gdn_lossless_jax.reference.chain`,
:func:`gdn_lossless_jax.kda.chain`).
:meth:`FamilyModel.generate` decodes through the state pool, speculatively, each linear layer verified and
committed by the library (:mod:`~gdn_lossless_jax.model.hf.family_decode`); :meth:`FamilyModel.greedy_reference`
decodes greedily by recomputing the whole forward for every token (a reference for tests, O(T^2)).
:func:`random_model` builds a tiny model of any of them with random weights, without a checkpoint file.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ...reference import ksum
from .weights import Checkpoint, _Reader

__all__ = ["FamilyModel", "family_module", "load_family", "random_model", "TINY_CONFIGS", "Reader", "plain_rmsnorm",
           "causal_conv_silu",
           "conv_weight", "refuse", "get"]

F32 = jnp.float32


def refuse(file: str, what: str):
    raise ValueError(f"load_pretrained: {file}: {what}")


def get(cfg: dict, keys: tuple[str, ...] | str, file: str, default: Any = None, required: bool = False):
    """The first of ``keys`` present in ``cfg`` (a config may use transformers' name or the Hub's); else
    ``default``, or an error naming the file and the key when ``required``."""
    keys = (keys,) if isinstance(keys, str) else keys
    for k in keys:
        if k in cfg:
            return cfg[k]
    if required:
        refuse(file, f"no key {' or '.join(repr(k) for k in keys)}, which is required")
    return default


class Reader(_Reader):
    """:class:`~gdn_lossless_jax.model.hf.weights._Reader` under transformers' names: each stored name is
    mapped by ``renames`` (``(pattern, replacement)`` regular expressions, applied in order, as
    transformers' conversion mapping renames a Hub checkpoint's tensors on load). Errors name the stored
    tensor, its file and the name it was read as."""

    def __init__(self, ckpt: Checkpoint, dtype, renames: tuple[tuple[str, str], ...], skip: tuple[str, ...] = ()):
        super().__init__(ckpt, dtype)
        self.stored: dict[str, str] = {}
        self.skipped = {n for n in ckpt.names() if n.startswith(tuple(skip))} if skip else set()
        for n in sorted(set(ckpt.names()) - self.skipped):
            c = n
            for pattern, repl in renames:
                c = re.sub(pattern, repl, c)
            if c in self.stored:
                refuse(ckpt.path, f"tensors {self.stored[c]!r} and {n!r} are both read as {c!r}; keep one")
            self.stored[c] = n

    def _where(self, name: str) -> str:
        s = self.stored[name]
        return f"tensor {s!r} (in {self.ckpt.where[s]}{'' if s == name else f', read as {name!r}'})"

    def has(self, name: str) -> bool:
        return name in self.stored

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.ckpt.shape(self.stored[name]))

    def raw(self, name: str, shape) -> np.ndarray:
        if name not in self.stored:
            refuse(self.ckpt.path, f"tensor {name!r} is missing (expected shape {list(shape)})")
        got = self.shape(name)
        if got != tuple(shape):
            refuse(self.ckpt.path, f"{self._where(name)} has shape {list(got)}, expected {list(shape)}")
        self.used.add(self.stored[name])
        return self.ckpt.get(self.stored[name])

    def any_of(self, name: str, shapes: list[tuple[int, ...]]) -> np.ndarray:
        """A tensor that may have one of ``shapes`` (e.g. ``A_log [H]`` or ``[1, 1, H, 1]``)."""
        if self.has(name) and self.shape(name) in [tuple(s) for s in shapes]:
            return self.raw(name, self.shape(name))
        want = " or ".join(str(list(s)) for s in shapes)
        if not self.has(name):
            refuse(self.ckpt.path, f"tensor {name!r} is missing (expected shape {want})")
        refuse(self.ckpt.path, f"{self._where(name)} has shape {list(self.shape(name))}, expected {want}")

    def check_all_used(self, model_type: str):
        """Every tensor of the checkpoint was read, or an error naming the first unexpected one and its file."""
        rest = sorted(set(self.ckpt.names()) - self.used - self.skipped)
        if rest:
            refuse(self.ckpt.path, f"unexpected tensor {rest[0]!r} (shape {list(self.ckpt.shape(rest[0]))}, in "
                                   f"{self.ckpt.where[rest[0]]}) for model_type {model_type!r} ({len(rest)} such "
                                   f"tensor(s))")  # fmt: skip


def _chunks(n: int, parts: int = 3) -> tuple[int, ...]:
    """``torch.chunk``'s sizes: ``ceil(n / parts)`` each, the last what is left."""
    c = -(-n // parts)
    sizes, left = [], n
    while left > 0:
        sizes.append(min(c, left))
        left -= sizes[-1]
    return tuple(sizes)


def conv_weight(r: Reader, prefix: str, widths: tuple[int, int, int], Kc: int) -> np.ndarray:
    """The depthwise conv over ``[q | k | v]`` as ``[conv_dim, Kc]``.

    Stored either fused (``conv1d.weight [conv_dim, 1, Kc]``, transformers' in-memory name) or as
    ``q_conv1d``/``k_conv1d``/``v_conv1d`` (the Hub's): split by the key/key/value widths, as the Hub's
    checkpoints store it, or in ``torch.chunk``'s equal thirds, as ``save_pretrained`` writes it back
    (transformers loads either by concatenating the three). Any other split is an error naming the tensors.
    """
    total = sum(widths)
    if r.has(prefix + "conv1d.weight"):
        return r.raw(prefix + "conv1d.weight", (total, 1, Kc))[:, 0]
    names = [prefix + f"{n}_conv1d.weight" for n in "qkv"]
    missing = [n for n in names if not r.has(n)]
    if missing:
        refuse(r.ckpt.path, f"tensor {prefix + 'conv1d.weight'!r} (or {', '.join(map(repr, names))}) is missing: "
                            f"no {missing[0]!r} (expected rows {list(widths)}, {Kc} taps)")  # fmt: skip
    rows = tuple(r.shape(n)[0] for n in names)
    if rows not in (tuple(widths), _chunks(total)):
        refuse(r.ckpt.path, f"tensors {', '.join(map(repr, names))} split the conv's {total} channels as {list(rows)}; "
                            f"expected the key/key/value widths {list(widths)} (the Hub's) or equal thirds "
                            f"{list(_chunks(total))} (what save_pretrained writes)")  # fmt: skip
    return np.concatenate([r.raw(n, (m, 1, Kc))[:, 0] for n, m in zip(names, rows)], axis=0)


def plain_rmsnorm(x, weight, eps, *, round_first: bool = False):
    """RMSNorm times a plain ``weight`` (not ``1 + weight``), its mean in a fixed order.

    ``round_first=False`` (OLMo): ``(weight * y).to(dtype)`` with ``y`` in fp32; ``True`` (Kimi):
    ``weight * y.to(dtype)``, the product in the model's dtype (as transformers' two classes do)."""
    dt = x.dtype
    xf = x.astype(F32)
    y = xf * jax.lax.rsqrt(ksum(xf * xf)[..., None] / x.shape[-1] + eps)
    if round_first:
        return weight.astype(dt) * y.astype(dt)
    return (weight.astype(F32) * y).astype(dt)


def causal_conv_silu(x, w):
    """transformers' ``causal_conv1d_fn`` from an empty state, then SiLU: ``x [N, T, C]``, ``w [C, Kc]``;
    the taps summed in fp32 in a fixed order, rounded to x's dtype, SiLU in fp32, rounded again."""
    N, T, C = x.shape
    Kc = w.shape[-1]
    xp = jnp.pad(x, ((0, 0), (Kc - 1, 0), (0, 0)))
    win = jnp.stack([xp[:, j : j + T] for j in range(Kc)], axis=-1)  # [N, T, C, Kc]
    y = ksum(win.astype(F32) * w.astype(F32)).astype(x.dtype)
    return jax.nn.silu(y.astype(F32)).astype(x.dtype)


def token_ids(fn: str, ids, vocab: int) -> np.ndarray:
    """``ids`` as int32 ``[B, T]`` token ids of a ``vocab``-token model, or a ValueError naming ``fn``."""
    ids = np.asarray(ids)
    if ids.ndim != 2 or ids.shape[1] < 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{fn}: argument 'ids' must be an integer array [B, T] with T >= 1, got "
                         f"{ids.dtype} {list(ids.shape)}")  # fmt: skip
    if ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(f"{fn}: argument 'ids' must be token ids in [0, {vocab}), got values "
                         f"{ids.min()}..{ids.max()}")  # fmt: skip
    return ids.astype(np.int32)


class FamilyModel:
    """A loaded OLMo-Hybrid, Kimi Linear or Qwen4-Exp checkpoint: ``config``, ``params``, ``path``, ``report``.

    ``forward(params, config, ids [B, T]) -> fp32 logits [B, T, vocab]`` is the family's full-sequence
    forward (module docstring), a sequence of jitted per-block programs."""

    def __init__(self, config, params, forward: Callable, *, path: str = "", report: dict | None = None,
                 backend: str = "auto"):  # fmt: skip
        self.config, self.params, self.forward = config, params, forward
        self.path, self.report, self.backend = path, report or {}, backend

    def __repr__(self) -> str:
        return f"FamilyModel({self.config.describe()})"

    def _ids(self, fn: str, ids) -> np.ndarray:
        return token_ids(fn, ids, self.config.vocab)

    def logits(self, ids) -> jax.Array:
        """``ids [B, T]`` -> fp32 logits ``[B, T, vocab]``: the full forward from empty states."""
        return self.forward(self.params, self.config, jnp.asarray(self._ids("logits", ids)))

    def greedy_reference(self, ids, max_new_tokens: int) -> np.ndarray:
        """Greedy decoding by a full forward per token (every layer is causal, so the logits at a position
        do not depend on the zeros padded after it: one compiled shape serves every step). A reference for
        tests, O(T^2); :meth:`generate` decodes through the pool."""
        ids = self._ids("greedy_reference", ids)
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"greedy_reference: argument 'max_new_tokens' must be a positive integer, got "
                             f"{max_new_tokens!r}")  # fmt: skip
        B, T = ids.shape
        buf = np.zeros((B, T + max_new_tokens), np.int32)
        buf[:, :T] = ids
        for t in range(T, T + max_new_tokens):
            lg = self.forward(self.params, self.config, jnp.asarray(buf))
            buf[:, t] = np.asarray(jnp.argmax(lg[:, t - 1], axis=-1))
        return buf

    def generate(self, ids, max_new_tokens: int, *, drafts: int = 4, record: str = "tuples",
                 draft: Callable | None = None, backend: str | None = None, steps_per_call: int = 1,
                 topk: int = 1) -> np.ndarray:
        """Greedy decoding of ``ids [B, T]`` through the state pool, speculative with ``drafts - 1`` drafts a
        step (``drafts=1``: one token a step): ``[B, T + max_new_tokens]``. ``draft(contexts, n) -> [B, n]``
        proposes (default: prompt lookup); the tokens do not depend on it, nor on ``record`` (``"tuples"``,
        ``"snapshots"``). ``steps_per_call > 1``: the device loop, that many steps a jitted call (prompt lookup
        only). ``topk > 1``: ``draft`` may propose a tree of ``drafts`` nodes each step, ``(tokens, parents)``.
        See :class:`~gdn_lossless_jax.model.hf.family_decode.FamilyDecoder`."""
        from .family_decode import FamilyDecoder

        ids = self._ids("generate", ids)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"generate: argument 'max_new_tokens' must be a positive integer, got {max_new_tokens!r}")
        dec = FamilyDecoder(self, requests=ids.shape[0], drafts=drafts, record=record, backend=backend,
                            max_len=ids.shape[1] + max_new_tokens + drafts - 1,
                            steps_per_call=steps_per_call, topk=topk)  # fmt: skip
        return dec.generate(ids, max_new_tokens, draft)


def family_module(model_type: str):
    """The module of a :data:`~gdn_lossless_jax.model.hf.config.FAMILY_TYPES` family (``model_type`` may be any of
    its :data:`~gdn_lossless_jax.model.hf.config.MODEL_TYPES`): ``config_from_dict``, ``RENAMES``, ``load_params``,
    ``forward`` for loading; ``linear_inputs``, ``linear_output``, ``linear_weights``, ``attention``, ``block``,
    ``head``, ``geometry`` for :class:`~gdn_lossless_jax.model.hf.family_decode.FamilyDecoder`; optionally
    ``embed``, ``windows`` and ``pre_block`` (per-request rolling windows beside the pool: Qwen4-Exp's PLE) and
    ``SKIPPED`` (name prefixes a checkpoint may hold that are not loaded). A new family is a module of its name."""
    import importlib

    from .config import FAMILY_TYPES, MODEL_TYPES

    name = MODEL_TYPES.get(model_type, model_type)
    if name not in FAMILY_TYPES:
        raise ValueError(f"family_module: argument 'model_type' must be one of {sorted(FAMILY_TYPES)}, got "
                         f"{model_type!r}")  # fmt: skip
    return importlib.import_module(f".{name}", __package__)


def load_family(path: str, full: dict, dtype: str, *, draft: str = "auto", draft_layers: int | None = None,
                backend: str = "auto", vision: str = "skip") -> FamilyModel:
    """:func:`~gdn_lossless_jax.model.hf.load_pretrained` for the families of
    :data:`~gdn_lossless_jax.model.hf.config.FAMILY_TYPES` (``full``: the folder's ``config.json``; ``dtype``
    resolved): the family module's config, parameters and forward; every tensor used, or an error naming the first
    unexpected one; tensors under the family's ``SKIPPED`` prefixes (a vision tower, an MTP block) counted in the
    report (``vision="error"``: they raise). These checkpoints have no draft yet: ``draft`` must be ``"auto"`` and
    ``draft_layers`` None."""
    import os
    import warnings

    mt = full["model_type"]
    if draft != "auto" or draft_layers is not None:
        raise ValueError(f"load_pretrained: arguments draft={draft!r}, draft_layers={draft_layers!r}: a {mt} "
                         f"checkpoint has no draft yet; leave them at 'auto' and None")  # fmt: skip
    family = family_module(mt)
    ckpt = Checkpoint(path)
    c = family.config_from_dict(full, dtype=dtype, name=os.path.basename(os.path.normpath(path)),
                                file=os.path.join(path, "config.json"))  # fmt: skip
    skip = getattr(family, "SKIPPED", ())
    skipped: dict[str, int] = {}
    for n in sorted(ckpt.names()):
        pre = next((p for p in skip if n.startswith(p)), None)
        if pre is not None:
            if vision == "error":
                refuse(ckpt.path, f"tensor {n!r} belongs to a part that is not supported (vision='error'; "
                                  f"vision='skip' loads the text model alone)")  # fmt: skip
            skipped[pre] = skipped.get(pre, 0) + 1
    r = Reader(ckpt, c.jnp_dtype, family.RENAMES, skip=skip)
    params = family.load_params(r, c)
    if c.tie_embeddings and r.has("lm_head.weight"):
        stored = r.raw("lm_head.weight", (c.vocab, c.d_model))
        if not np.array_equal(np.asarray(stored), np.asarray(ckpt.get(r.stored["model.embed_tokens.weight"]))):
            refuse(ckpt.path, "tie_word_embeddings is true, but tensor 'lm_head.weight' differs from "
                              "'model.embed_tokens.weight'")  # fmt: skip
    r.check_all_used(mt)
    if skipped:
        what = ", ".join(f"{n} tensors under {p!r}" for p, n in skipped.items())
        warnings.warn(f"load_pretrained: {ckpt.path}: skipped {what} (the text model is loaded)", stacklevel=3)
    return FamilyModel(c, params, family.forward, path=ckpt.path, report={"skipped": skipped, "mtp": False},
                       backend=backend)  # fmt: skip


#: The ``config.json`` of :func:`random_model`'s tiny models, in the Hub's form: the sizes of the test fixtures
#: (tests/fixtures/hf/olmo_hybrid, tests/fixtures/hf/kimi_linear).
TINY_CONFIGS = {
    "olmo_hybrid": {
        "model_type": "olmo_hybrid", "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"], "linear_allow_neg_eigval": True,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_value_head_dim": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta": None, "rope_type": "default"},
        "tie_word_embeddings": False, "vocab_size": 256,
    },
    "kimi_linear": {
        "model_type": "kimi_linear", "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 4,
        "first_k_dense_replace": 1, "kv_lora_rank": 32,
        "linear_attn_config": {"full_attn_layers": [4], "kda_layers": [1, 2, 3], "head_dim": 16, "num_heads": 2,
                               "short_conv_kernel_size": 4},
        "moe_intermediate_size": 16, "moe_renormalize": True, "num_attention_heads": 4, "num_expert_group": 4,
        "num_experts": 8, "num_experts_per_token": 2, "num_key_value_heads": 4, "num_shared_experts": 1,
        "q_lora_rank": None, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "rms_norm_eps": 1e-05,
        "routed_scaling_factor": 2.446, "tie_word_embeddings": False, "topk_group": 2, "v_head_dim": 16,
        "vocab_size": 256,
    },
    "qwen4_exp": {
        "model_type": "qwen4_exp_text", "hidden_size": 64, "num_hidden_layers": 4, "eos_token_id": 3,
        "layer_types": ["linear_attention"] * 3 + ["indexed_attention"], "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_value_head_dim": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
        "rms_norm_eps": 1e-06, "hc_count": 3, "hc_lowrank": 16, "ple_layer_ids": [1, 3], "ple_embed_dim": 32,
        "ple_conv_kernel_size": 4, "ngram_size": 3, "heads_per_ngram": 2, "ngram_vocab_size_base": 97,
        "make_ngram_vocab_size_divisible_by": 16, "seed": 1234, "indexer_n_heads": 2, "indexer_kv_heads": 1,
        "indexer_head_dim": 16, "indexer_budget": 12, "indexer_compress_ratio": 4,
        "rope_parameters": {"partial_rotary_factor": 0.25, "rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": False, "vocab_size": 256,
    },
}  # fmt: skip


class _RandomReader(Reader):
    """A :class:`Reader` without a checkpoint: every tensor the family's ``load_params`` asks for is drawn at
    random in the shape it asks (each from its own generator, seeded by ``seed`` and the tensor's name), in the
    first layout the loader tries (the fused conv and experts). Linear weights and embeddings normal with std 0.2
    (the fixtures' ``initializer_range``), the conv normal with std ``Kc**-0.5``, norm weights uniform in [0.9,
    1.1] (plain weights), ``A_log`` ``log U(1, 16)``, ``dt_bias`` ``softplus^-1`` of a dt log-uniform in [1e-3,
    1e-1], the router's correction bias ``U(0, 0.1)``. Tensors a loader only checks where a checkpoint has them
    (:data:`CHECKED_ONLY`: Qwen4-Exp's hash buffers, which its config derives) are absent."""

    #: Name endings of tensors that are not parameters: a loader compares them with what the config derives.
    CHECKED_ONLY = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")

    def __init__(self, dtype, seed: int, label: str):
        self.dtype, self.seed, self.used, self.stored = jnp.dtype(dtype), seed, set(), {}
        self.ckpt = type("RandomWeights", (), {"path": label})()

    def has(self, name: str) -> bool:
        return not name.endswith(self.CHECKED_ONLY)

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError  # not asked for: any_of draws its first shape

    def any_of(self, name: str, shapes: list[tuple[int, ...]]) -> np.ndarray:
        return self.raw(name, shapes[0])

    def raw(self, name: str, shape) -> np.ndarray:
        import zlib

        self.used.add(name)
        rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
        shape, base = tuple(shape), name.removesuffix(".weight")
        if base.endswith("A_log"):
            return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
        if base.endswith("dt_bias"):
            dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), shape))
            return (dt + np.log(-np.expm1(-dt))).astype(np.float32)
        if base.endswith("e_score_correction_bias"):
            return rng.uniform(0.0, 0.1, shape).astype(np.float32)
        if "norm" in base.rsplit(".", 1)[-1]:
            return rng.uniform(0.9, 1.1, shape).astype(np.float32)
        std = shape[-1] ** -0.5 if base.endswith("conv1d") else 0.2
        return (rng.standard_normal(shape) * std).astype(np.float32)


def random_model(model_type: str, *, seed: int = 0, dtype: str = "float32", backend: str = "auto",
                 config: dict | None = None) -> FamilyModel:  # fmt: skip
    """A tiny ``olmo_hybrid``, ``kimi_linear`` or ``qwen4_exp`` model with random weights, built in memory (no
    checkpoint file, no torch): the family's config reader and ``load_params`` over a reader that draws each tensor
    it asks for (:class:`_RandomReader`), so the parameters have the shapes and layout a checkpoint would give. ``config``:
    a ``config.json`` dict (default :data:`TINY_CONFIGS`, the test fixtures' sizes).

    >>> m = random_model("kimi_linear")
    >>> m.config.num_heads, m.config.head_dim, m.config.layer_types.count("linear_attention")
    (2, 16, 3)
    """
    if model_type not in TINY_CONFIGS:
        raise ValueError(f"random_model: argument 'model_type' must be one of {sorted(TINY_CONFIGS)}, got "
                         f"{model_type!r}")  # fmt: skip
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"random_model: argument 'dtype' must be 'float32' or 'bfloat16', got {dtype!r}")
    family = family_module(model_type)
    full = dict(TINY_CONFIGS[model_type] if config is None else config, model_type=model_type)
    label = f"random {model_type} (seed {seed})"
    c = family.config_from_dict(full, dtype=dtype, name=f"random-tiny-seed{seed}", file=f"<{label} config>")
    params = family.load_params(_RandomReader(c.jnp_dtype, seed, f"<{label}>"), c)
    return FamilyModel(c, params, family.forward, path="", report={"skipped": {}, "mtp": False, "random": True},
                       backend=backend)  # fmt: skip
