"""Hugging Face checkpoints of Qwen3-Next and Qwen3.5 models, and of OLMo-Hybrid, Kimi Linear and Qwen4-Exp
(docs/checkpoints.md).

- :func:`load_pretrained`: a checkpoint folder -> :class:`PretrainedModel` (``logits``, ``generate``).
- :mod:`~gdn_lossless_jax.model.hf.config`: the sizes from ``config.json``.
- :mod:`~gdn_lossless_jax.model.hf.weights`: tensors by name (safetensors, sharded or not).
- :mod:`~gdn_lossless_jax.model.hf.arch`: the layers as transformers computes them.
- :mod:`~gdn_lossless_jax.model.hf.step`: the speculative step (self-draft or the MTP block).
- :mod:`~gdn_lossless_jax.model.hf.family`, :mod:`~.olmo_hybrid`, :mod:`~.kimi_linear`, :mod:`~.qwen4_exp`: the
  OLMo-Hybrid, Kimi Linear and Qwen4-Exp checkpoints (:class:`FamilyModel`, decoded by
  :class:`~gdn_lossless_jax.model.hf.family_decode.FamilyDecoder`).
"""

from .arch import HFParams
from .config import MODEL_TYPES, HFConfig
from .family import FamilyModel
from .pretrained import GenerateInfo, PretrainedModel, load_pretrained
from .safetensors import SafetensorsFile
from .step import HFSpecStep, MTPSpecStep, MTPState

__all__ = [
    "load_pretrained", "PretrainedModel", "GenerateInfo", "HFConfig", "HFParams", "MODEL_TYPES", "HFSpecStep",
    "MTPSpecStep", "MTPState", "SafetensorsFile", "FamilyModel",
]  # fmt: skip
