"""A small hybrid GDN model and greedy speculative decoding through the state pool.

- :mod:`~gdn_lossless_jax.model.model`: the model (sizes, parameters, layer functions).
- :mod:`~gdn_lossless_jax.model.decode`: the jitted step (draft, verify, accept, commit).
- :mod:`~gdn_lossless_jax.model.engine`: requests joining and leaving a batch, the prefix cache.
- :mod:`~gdn_lossless_jax.model.agreement`: a draft that agrees like a trained one (a construction).
- :mod:`~gdn_lossless_jax.model.hf`: Hugging Face checkpoints (:func:`load_pretrained`).
- :mod:`gdn_lossless_jax.tools.demo`: ``gdn-lossless demo``.
"""

from . import agreement
from .decode import DecodeState, KVCache, SpecStep, StepInputs, StepOutputs, allocate_state, copy_slot
from .engine import Engine, PrefixCache, Request, Result
from .hf import PretrainedModel, load_pretrained
from .model import SIZES, ModelConfig, Params, get_config, init_params

__all__ = [
    "ModelConfig",
    "SIZES",
    "get_config",
    "Params",
    "init_params",
    "DecodeState",
    "KVCache",
    "StepInputs",
    "StepOutputs",
    "SpecStep",
    "allocate_state",
    "copy_slot",
    "Engine",
    "PrefixCache",
    "Request",
    "Result",
    "load_pretrained",
    "PretrainedModel",
    "agreement",
]
