"""``load_pretrained``: a Hugging Face checkpoint folder as a model with ``logits`` and ``generate``."""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from ..decode import DecodeState, StepInputs, allocate_state
from ..loop import DecodeLoop, LoopInputs
from .arch import HFParams
from .config import FAMILY_TYPES, MODEL_TYPES, HFConfig, config_from_dict, read_config
from .family import FamilyModel, load_family, token_ids
from .step import HFSpecStep, MTPSpecStep, MTPState
from .weights import Checkpoint, has_mtp, load_params

__all__ = ["PretrainedModel", "GenerateInfo", "load_pretrained"]

I32 = jnp.int32


@dataclasses.dataclass
class GenerateInfo:
    """What :meth:`PretrainedModel.generate` did: ``steps`` (jitted step calls), ``accepted`` (inputs
    accepted per step, summed over rows), ``drafted`` (drafted inputs verified, summed), ``gaps``
    (``[B, new]``, the target's top-2 logit gap at each generated token), ``state`` (the final
    :class:`~gdn_lossless_jax.model.decode.DecodeState`: pool, KV cache and, with the MTP draft,
    hidden states)."""

    steps: int
    accepted: int
    drafted: int
    gaps: np.ndarray
    state: DecodeState

    def states(self) -> dict:
        """The final SSM, conv and KV states (and the MTP draft's hidden states) on the host: what
        the two record modes must agree on bit for bit (the scratch differs by design)."""
        s = jax.device_get(self.state)
        out = {"ssm": s.pool.ssm, "conv": s.pool.conv, "kv_k": s.kv.k, "kv_v": s.kv.v}
        if isinstance(s, MTPState):
            out["hidden"] = s.hidden
        return out


@functools.partial(jax.jit, static_argnums=0)
def _forward(step: HFSpecStep, params, state, ids):
    B, T = ids.shape
    rows = jnp.arange(B, dtype=I32)
    inputs = StepInputs(slots=rows, rows=rows, pos=jnp.zeros(B, I32), tokens=ids, n_given=jnp.full(B, T, I32),
                        track_slots=jnp.full(B, -1, I32))  # fmt: skip
    return step._verify(params, state, ids, inputs)[0]


class PretrainedModel:
    """A loaded checkpoint. ``config`` (:class:`~gdn_lossless_jax.model.hf.config.HFConfig`),
    ``params`` (:class:`~gdn_lossless_jax.model.hf.arch.HFParams`), ``path``, ``report`` (skipped
    tensors, whether an MTP block was found)."""

    def __init__(self, config: HFConfig, params: HFParams, *, path: str = "", report: dict | None = None,
                 backend: str = "auto"):  # fmt: skip
        self.config, self.params, self.path, self.report, self.backend = config, params, path, report or {}, backend

    def __repr__(self) -> str:
        return f"PretrainedModel({self.config.describe()})"

    def _ids(self, fn: str, ids) -> np.ndarray:
        return token_ids(fn, ids, self.config.vocab)

    def step(self, drafts: int, *, draft: str | None = None, commit=None) -> HFSpecStep:
        """The jitted step verifying ``drafts`` inputs (the checkpoint's draft, or ``draft``); ``commit``
        as :class:`~gdn_lossless_jax.model.decode.SpecStep`'s (None: the pool's)."""
        c = self.config if draft is None else dataclasses.replace(self.config, draft=draft)
        cls = MTPSpecStep if c.draft == "mtp" and drafts > 1 else HFSpecStep
        if cls is HFSpecStep and c.draft == "mtp":
            c = dataclasses.replace(c, draft="self", draft_layers=1)  # D = 1 drafts nothing
        return cls(c, drafts=drafts, backend=self.backend, commit=commit)

    def allocate(self, step: HFSpecStep, *, batch: int, record: str, max_len: int) -> DecodeState:
        state = allocate_state(step.config, slots=batch, requests=batch, drafts=step.drafts, record=record,
                               max_len=max_len)  # fmt: skip
        if isinstance(step, MTPSpecStep):
            state = MTPState(state.pool, state.kv, jnp.zeros((batch + 1, step.config.d_model), step.config.jnp_dtype))
        return state

    def logits(self, ids) -> jax.Array:
        """``ids [B, T]`` int -> fp32 logits ``[B, T, vocab]``: the full forward of the prompts from
        empty states (the GDN layers through the state pool's verify, as in decoding)."""
        ids = self._ids("logits", ids)
        B, T = ids.shape
        step = self.step(T, draft="self") if self.config.draft == "mtp" else self.step(T)
        state = self.allocate(step, batch=B, record="tuples", max_len=T)
        return _forward(step, self.params, state, jnp.asarray(ids))

    def generate(self, ids, max_new_tokens: int, *, drafts: int = 4, record: str | None = "tuples",
                 steps_per_call: int = 1, return_info: bool = False, commit=None):  # fmt: skip
        """Greedy decoding: ``ids [B, T]`` -> ``[B, T + max_new_tokens]`` (a NumPy int32 array).

        Each step verifies ``drafts`` inputs (the prompt in chunks of ``drafts`` given tokens, then
        the last token and ``drafts - 1`` drafted ones) in the pool's record mode ``record``
        (``"tuples"`` or ``"snapshots"``); ``record=None`` decodes without speculation (one token a
        step). Every token is the target's argmax at its position, whatever the draft proposes; the two
        record modes give the same tokens and bit-identical states. Against ``record=None``: in the
        invariant decoding mode (``config.invariant``, on by default on the CPU) a position's logits are
        the same bits in the D-input verify and the one-input decode, and the tokens were equal in
        ``tests/test_hf_invariance.py``'s runs (tokens and states bit for bit); with the mode off (on a
        GPU) they are not guaranteed: at a near-tie the two may round to other tokens (on a GPU they do;
        docs/decoding.md).

        Args:
          steps_per_call: steps per jitted call: K > 1 runs the device loop
            (:class:`~gdn_lossless_jax.model.loop.DecodeLoop`: acceptance and the next inputs on the
            device, tokens back every K steps); the tokens are the same for any K.
          return_info: also return a :class:`GenerateInfo`.
          commit: the step's commit (tests inject wrong ones); None: :func:`gdn_lossless_jax.pool.commit`.
        """
        fn = "generate"
        ids = self._ids(fn, ids)
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"{fn}: argument 'max_new_tokens' must be a positive integer, got {max_new_tokens!r}")
        if record not in ("tuples", "snapshots", None):
            raise ValueError(f"{fn}: argument 'record' must be 'tuples', 'snapshots' or None, got {record!r}")
        if not isinstance(drafts, int) or drafts < 1:
            raise ValueError(f"{fn}: argument 'drafts' must be a positive integer, got {drafts!r}")
        if not isinstance(steps_per_call, int) or steps_per_call < 1:
            raise ValueError(f"{fn}: argument 'steps_per_call' must be a positive integer, got {steps_per_call!r}")
        D = drafts if record is not None else 1
        step = self.step(D, commit=commit)
        B, T = ids.shape
        total = T + max_new_tokens
        state = self.allocate(step, batch=B, record=record or "tuples", max_len=total + D + 1)
        seqs, pos = [list(map(int, r)) for r in ids], np.zeros(B, np.int32)
        gaps = [[] for _ in range(B)]
        rows = np.arange(B, dtype=np.int32)
        steps = accepted = drafted = 0
        K = steps_per_call
        loop = DecodeLoop(step, K) if K > 1 else None
        W = K * D  # the known tokens a call may consume
        while any(len(s) < total for s in seqs):
            done = np.array([len(s) >= total for s in seqs])
            known = [s[p:] for s, p in zip(seqs, pos)]
            slots = np.where(done, -1, rows).astype(np.int32)
            if loop is None:
                n_given = np.array([min(D, len(k)) for k in known], np.int32)
                tokens = np.array([(k[:D] + [0] * D)[:D] for k in known], np.int32)
                inputs = StepInputs(slots=slots, rows=rows, pos=pos.copy(), tokens=tokens, n_given=n_given,
                                    track_slots=np.full(B, -1, np.int32))  # fmt: skip
                state, out = step(self.params, state, jax.tree.map(jnp.asarray, inputs))
                outs = [(jax.device_get(out), ~done)]
            else:
                inputs = LoopInputs(
                    slots=slots, rows=rows, track_slots=np.full(B, -1, np.int32), pos=pos.copy(),
                    tokens=np.array([(k[:W] + [0] * W)[:W] for k in known], np.int32),
                    known=np.array([min(W, len(k)) for k in known], np.int32),
                    budget=np.array([total - len(s) for s in seqs], np.int32), ids=rows,
                )  # fmt: skip
                state, out = loop(self.params, state, jax.tree.map(jnp.asarray, inputs))
                out = jax.device_get(out)
                outs = [(jax.tree.map(lambda x, t=t: x[t], out.steps), out.active[t]) for t in range(K)]
            for out, ran in outs:  # each step's outputs, for the rows it ran
                steps += int(ran.any())
                for i in np.flatnonzero(ran):
                    n_given, m = min(D, len(seqs[i]) - int(pos[i])), int(out.accepted[i])
                    accepted += m
                    drafted += D - n_given
                    seqs[i] += [int(t) for t in out.inputs[i, n_given:m]]  # accepted drafts
                    pos[i] += m
                    if pos[i] == len(seqs[i]):  # every known token is in the state: the bonus token
                        seqs[i].append(int(out.predictions[i, m - 1]))
                        gaps[i] += [float(out.gaps[i, j]) for j in range(n_given - 1, m)]
        result = np.array([s[:total] for s in seqs], np.int32)
        if not return_info:
            return result
        gap_arr = np.array([g[:max_new_tokens] for g in gaps], np.float32)
        return result, GenerateInfo(steps, accepted, drafted, gap_arr, state)


def load_pretrained(path: str | os.PathLike, dtype=None, *, draft: str = "auto", draft_layers: int | None = None,
                    vision: str = "skip", backend: str = "auto") -> PretrainedModel | FamilyModel:  # fmt: skip
    """Load a Hugging Face checkpoint folder of ``model_type`` ``qwen3_next``, ``qwen3_5`` (its text
    model) or ``qwen3_5_moe``; or ``olmo_hybrid``, ``kimi_linear`` or ``qwen4_exp`` (its text model), as a
    :class:`~gdn_lossless_jax.model.hf.family.FamilyModel` (full-sequence logits, speculative decoding
    through the pool by :class:`~gdn_lossless_jax.model.hf.family_decode.FamilyDecoder`).

    Args:
      path: the folder (``config.json``, ``*.safetensors``, ``model.safetensors.index.json`` if sharded).
      dtype: ``"float32"`` or ``"bfloat16"`` (or the jnp dtypes); None: the checkpoint's own
        (``config.json``'s ``dtype`` / ``torch_dtype``, float32 if absent or other).
      draft: ``"mtp"`` (the checkpoint's MTP block; an error if it has none), ``"self"`` (the
        layer-skipping self-draft) or ``"auto"`` (the MTP block where there is one).
      draft_layers: the self-draft's blocks (the leading GDN blocks, all of them by default).
      vision: ``"skip"`` (a vision tower's tensors are left out, with a warning naming how many) or
        ``"error"``.
      backend: the library's backend for verify and commit.
    """
    path = os.fspath(path)
    if draft not in ("auto", "mtp", "self"):
        raise ValueError(f"load_pretrained: argument 'draft' must be 'auto', 'mtp' or 'self', got {draft!r}")
    if vision not in ("skip", "error"):
        raise ValueError(f"load_pretrained: argument 'vision' must be 'skip' or 'error', got {vision!r}")
    full, text = read_config(path)
    if dtype is None:
        dtype = str(full.get("dtype") or full.get("torch_dtype") or text.get("dtype") or "float32")
        dtype = dtype if dtype in ("float32", "bfloat16") else "float32"
    try:
        dtype = jnp.dtype(dtype).name
    except TypeError as e:
        raise ValueError(f"load_pretrained: argument 'dtype' must be float32 or bfloat16, got {dtype!r}") from e
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"load_pretrained: argument 'dtype' must be float32 or bfloat16, got {dtype!r}")
    if MODEL_TYPES[full["model_type"]] in FAMILY_TYPES:  # OLMo-Hybrid, Kimi Linear, Qwen4-Exp: model/hf/family.py
        return load_family(path, full, dtype, draft=draft, draft_layers=draft_layers, backend=backend, vision=vision)
    ckpt = Checkpoint(path)
    mtp = has_mtp(ckpt)
    if draft == "mtp" and not mtp:
        raise ValueError(f"load_pretrained: argument draft='mtp', but {path!r} has no mtp.* tensors")
    use = "mtp" if (draft == "mtp" or (draft == "auto" and mtp)) else "self"
    config = config_from_dict(full, text, dtype=dtype, draft=use, draft_layers=draft_layers,
                              name=os.path.basename(os.path.normpath(path)),
                              source=os.path.join(path, "config.json"))  # fmt: skip
    params, report = load_params(ckpt, config, vision=vision)
    if report["skipped"]:
        what = ", ".join(f"{n} tensors under {p!r}" for p, n in report["skipped"].items())
        warnings.warn(f"load_pretrained: {path}: the vision tower is not supported; skipped {what} "
                      f"(the text model is loaded)", stacklevel=2)  # fmt: skip
    return PretrainedModel(config, params, path=path, report=report, backend=backend)
