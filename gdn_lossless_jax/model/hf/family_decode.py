"""Speculative decoding of OLMo-Hybrid and Kimi Linear checkpoints through the state pool.

:class:`FamilyDecoder` runs a :class:`~gdn_lossless_jax.model.hf.family.FamilyModel` one step at a time: each
step feeds ``T`` tokens per request (the last accepted token and ``T - 1`` drafts) through every block; the
linear layers (OLMo-Hybrid's GDN with its beta scale, Kimi's KDA with its per-channel decay) verify them with
:func:`gdn_lossless_jax.pool.verify_layer` from the request's pool slot, recording the pool's tape (tuples or
snapshots; a KDA pool's tuples are :class:`~gdn_lossless_jax.tape.KDATuples`), and after the greedy acceptance
:func:`gdn_lossless_jax.pool.commit` writes the state after the last accepted token. So every state in the
pool comes from the library's verify and commit, as for Qwen's :mod:`gdn_lossless_jax.model.decode`.

The attention layers keep, per request, the block's attention input at each position (``[B, max_len, d]``)
and run the family's full-sequence causal attention over that buffer (positions past a query are masked out),
taking the rows of the step's positions: no separate KV cache code per family (O(max_len^2) a step; this
decoder is for checking the tape end to end on small models, not for speed). Rejected drafts' rows are
overwritten by the next step, which starts at the first rejected position.

Acceptance is greedy: draft ``j`` is accepted while it equals the target's argmax after the token before it;
the step emits the accepted drafts and the target's next token. The prompt is prefilled through the same step
in chunks of ``drafts`` tokens, every token accepted (the last chunk padded, committed after its last
prompt token). Not done here: draft trees, the device loop,
sampling, requests of different prompt lengths (a batch's prompts have one length).
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ... import pool as pool_mod

__all__ = ["FamilyDecoder", "prompt_lookup", "family_module"]


def family_module(model_type: str):
    """The family's module: ``linear_inputs``, ``linear_output``, ``linear_weights``, ``attention``, ``block``,
    ``head`` and ``geometry`` (:mod:`~gdn_lossless_jax.model.hf.olmo_hybrid`,
    :mod:`~gdn_lossless_jax.model.hf.kimi_linear`)."""
    from . import kimi_linear, olmo_hybrid

    return {"olmo_hybrid": olmo_hybrid, "kimi_linear": kimi_linear}[model_type]


def prompt_lookup(contexts: Sequence[np.ndarray], n: int, *, ngram: int = 2) -> np.ndarray:
    """A model-free draft (prompt lookup): for each context, the ``n`` tokens that followed the latest
    earlier occurrence of its last ``ngram`` tokens (then of its last token), repeated past the context's end;
    where there is none, the last token ``n`` times. Returns ``[B, n]`` int32."""
    out = np.zeros((len(contexts), n), np.int32)
    for i, ctx in enumerate(contexts):
        ctx = np.asarray(ctx)
        out[i] = ctx[-1]
        for m in range(min(ngram, len(ctx) - 1), 0, -1):
            tail = ctx[-m:]
            hits = [s for s in range(len(ctx) - m - 1, -1, -1) if np.array_equal(ctx[s : s + m], tail)]
            if hits:
                follow = ctx[hits[0] + m :]
                out[i] = np.resize(follow, n)
                break
    return out


@functools.partial(jax.jit, static_argnames=("c", "backend"), donate_argnums=(1, 2))
def _step(params, pool, attn, ids, pos, *, c, backend):
    """One step: ``ids [B, T]`` at positions ``pos[b] + [0, T)``. Returns ``(logits [B, T, vocab] fp32, pool with
    this step's tape, attention buffers)``; nothing is committed."""
    fam = family_module(c.model_type)
    B, T = ids.shape
    slots = jnp.arange(B, dtype=jnp.int32)
    at = pos[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
    beta_scale = getattr(c, "beta_scale", 1.0)
    h = params.embed[ids]
    li = ai = 0
    buffers = list(attn)
    for blk, kind in zip(params.blocks, c.layer_types):
        if kind == "linear_attention":

            def mixer(x, blk=blk, layer=li):
                nonlocal pool
                mixed, a, b = fam.linear_inputs(blk.mixer, c, x)
                conv, bias, A_log, dt_bias = fam.linear_weights(blk.mixer)
                o, pool = pool_mod.verify_layer(pool, layer, mixed, a, b, conv, bias, A_log, dt_bias, slots, slots,
                                                backend=backend, beta_scale=beta_scale)  # fmt: skip
                return fam.linear_output(blk.mixer, c, x, o)

            li += 1
        else:

            def mixer(x, blk=blk, i=ai):
                buf = buffers[i].at[slots[:, None], at].set(x.astype(buffers[i].dtype), mode="drop")
                buffers[i] = buf
                y = fam.attention(blk.mixer, c, buf)  # [B, max_len, d]: causal, rows past a query masked
                return jnp.take_along_axis(y, jnp.minimum(at, buf.shape[1] - 1)[..., None], axis=1)

            ai += 1
        h = fam.block(blk, c, h, mixer, kind)
    return fam.head(params, c, h), pool, tuple(buffers)


class FamilyDecoder:
    """Greedy speculative decoding of a :class:`~gdn_lossless_jax.model.hf.family.FamilyModel` through a
    :class:`~gdn_lossless_jax.pool.StatePool` (module docstring).

    Args:
      model: an ``olmo_hybrid`` or ``kimi_linear`` checkpoint (``load_pretrained``).
      requests: B, the batch (request b holds pool slot b and scratch row b).
      drafts: the tokens a step verifies (the last accepted one and ``drafts - 1`` drafts); 1 is plain greedy
        decoding through the pool.
      max_len: the longest sequence (prompt and new tokens).
      record: the pool's record mode, ``"tuples"`` or ``"snapshots"``.
      backend: the verify and commit backend (``"auto"``: the model's).
    After :meth:`generate`, ``pool`` holds each request's state after its last token and ``steps`` the number
    of decoding steps taken (prefill not counted). A decoder decodes once (its pool is not reset).
    """

    def __init__(self, model, *, requests: int, drafts: int, max_len: int, record: str = "tuples",
                 backend: str | None = None):  # fmt: skip
        for name, x in (("requests", requests), ("drafts", drafts), ("max_len", max_len)):
            if isinstance(x, bool) or not isinstance(x, int) or x < 1:
                raise ValueError(f"FamilyDecoder: argument {name!r} must be a positive integer, got {x!r}")
        self.model, self.c = model, model.config
        self.requests, self.drafts, self.max_len = requests, drafts, max_len
        self.backend = backend or getattr(model, "backend", "auto")
        fam = family_module(self.c.model_type)
        self.geometry = fam.geometry(self.c)
        self.pool = pool_mod.allocate(self.geometry, slots=requests, requests=requests, drafts=drafts,
                                      record=record, state_dtype=jnp.float32, conv_dtype=self.c.jnp_dtype,
                                      free_bytes=None)  # fmt: skip
        d = self.c.d_model
        n_attn = self.c.layer_types.count("full_attention")
        self.attn = tuple(jnp.zeros((requests, max_len, d), self.c.jnp_dtype) for _ in range(n_attn))
        self.steps = 0

    def _run(self, ids: np.ndarray, pos: np.ndarray, accept=None) -> tuple[np.ndarray, np.ndarray]:
        """One step and its commit of the state after token ``accept[b]`` of the step (None: the greedy
        acceptance of ``ids[:, 1:]``, the drafts). Returns the accepted counts ``[B]`` and the argmax ``[B, T]``."""
        logits, self.pool, self.attn = _step(self.model.params, self.pool, self.attn, jnp.asarray(ids, jnp.int32),
                                             jnp.asarray(pos, jnp.int32), c=self.c, backend=self.backend)  # fmt: skip
        g = np.asarray(jnp.argmax(logits, axis=-1))  # [B, T]
        if accept is None:  # the leading drafts equal to the target's argmax before them
            agree = np.concatenate([ids[:, 1:] == g[:, :-1], np.zeros((len(ids), 1), bool)], axis=1)
            accept = np.argmin(agree, axis=1)  # the first disagreement (the appended False: all agreed)
        slots = jnp.arange(self.requests, dtype=jnp.int32)
        self.pool = pool_mod.commit(self.pool, slots, jnp.asarray(accept, jnp.int32), backend=self.backend)
        return accept, g

    def generate(self, ids, max_new_tokens: int, draft: Callable | None = None) -> np.ndarray:
        """``ids [B, T0]`` (B = ``requests``) followed by ``max_new_tokens`` greedy tokens each, ``[B, T0 +
        max_new_tokens]``. ``draft(contexts, n) -> [B, n]``: the proposals after each request's tokens so far
        (a list of B arrays); default :func:`prompt_lookup`."""
        if self.steps:
            raise ValueError("generate: this FamilyDecoder has decoded already (its pool holds those states); make a "
                             "new one")  # fmt: skip
        ids = self.model._ids("generate", ids)
        B, T0 = ids.shape
        if B != self.requests:
            raise ValueError(f"generate: argument 'ids' must have B={self.requests} rows (the decoder's requests), "
                             f"got {B}")  # fmt: skip
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"generate: argument 'max_new_tokens' must be a positive integer, got {max_new_tokens!r}")
        if T0 + max_new_tokens + self.drafts > self.max_len + 1:
            raise ValueError(f"generate: a prompt of {T0} tokens, max_new_tokens={max_new_tokens} and drafts="
                             f"{self.drafts} need max_len >= {T0 + max_new_tokens + self.drafts - 1}, got "
                             f"{self.max_len}")  # fmt: skip
        draft = draft or prompt_lookup
        D = self.drafts
        pos = np.zeros(B, np.int64)
        for s in range(0, T0 - 1, D):  # prefill all but the last prompt token, every token accepted
            n = min(D, T0 - 1 - s)  # a short chunk padded to D (one compiled shape): committed after token n - 1,
            chunk = np.pad(ids[:, s : s + n], ((0, 0), (0, D - n)), mode="edge")  # its padding rows overwritten
            self._run(chunk, pos, np.full(B, n - 1))
            pos += n
        out = [list(r) for r in ids]
        last = ids[:, -1]
        while min(len(r) for r in out) < T0 + max_new_tokens:
            props = np.asarray(draft([np.asarray(r) for r in out], D - 1), np.int32).reshape(B, D - 1)
            step_ids = np.concatenate([last[:, None], props], axis=1)
            n_acc, g = self._run(step_ids, pos)
            for b in range(B):
                out[b].extend(int(x) for x in g[b, : n_acc[b] + 1])  # the accepted drafts and the target's next
            pos += n_acc + 1
            last = g[np.arange(B), n_acc]
            self.steps += 1
        return np.array([r[: T0 + max_new_tokens] for r in out], np.int32)
