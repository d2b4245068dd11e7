"""Speculative decoding of OLMo-Hybrid and Kimi Linear checkpoints through the state pool.

:class:`FamilyDecoder` runs a :class:`~gdn_lossless_jax.model.hf.family.FamilyModel` step by step: each
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
prompt token). A request that has its ``max_new_tokens`` is masked for the remaining steps (slot -1: the pool
reads zeros for it and drops its writes; its attention rows are not written), so its state is the one after the
step that completed it, whatever the other requests still decode.

The host loop (``steps_per_call=1``) runs one jitted step a call and accepts and drafts on the host (any
``draft(contexts, n)``). The device loop (``steps_per_call=K > 1``, :func:`_loop`) runs K steps a call in a
``lax.while_loop`` over the same step: the draft by prompt lookup over a token buffer on the device
(:func:`lookup_draft`, :func:`prompt_lookup`'s rule), the acceptance (:func:`~gdn_lossless_jax.model.decode.accept`)
and the commit there, the accepted tokens appended to the buffer; the host sees the lengths every K steps (the
prefill runs through the host loop's step). Shapes
never change (masked requests, not smaller batches), and K is a traced bound, so every K shares one compilation.
Both give the same tokens and the same pool bit for bit (``tests/test_family_decode.py``). Not done here: draft
trees, sampling, a draft of the caller's own in the device loop, requests of different prompt lengths (a batch's
prompts have one length).
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ... import pool as pool_mod
from ..decode import accept

__all__ = ["FamilyDecoder", "prompt_lookup", "lookup_draft", "family_module"]

I32 = jnp.int32
NGRAM = 2  # prompt lookup's default tail: the last two tokens, then the last one


def family_module(model_type: str):
    """The family's module: ``linear_inputs``, ``linear_output``, ``linear_weights``, ``attention``, ``block``,
    ``head`` and ``geometry`` (:mod:`~gdn_lossless_jax.model.hf.olmo_hybrid`,
    :mod:`~gdn_lossless_jax.model.hf.kimi_linear`)."""
    from . import kimi_linear, olmo_hybrid

    return {"olmo_hybrid": olmo_hybrid, "kimi_linear": kimi_linear}[model_type]


def prompt_lookup(contexts: Sequence[np.ndarray], n: int, *, ngram: int = NGRAM) -> np.ndarray:
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


def lookup_draft(buf: jax.Array, lens: jax.Array, n: int, *, ngram: int = NGRAM) -> jax.Array:
    """:func:`prompt_lookup` on the device: ``buf [B, W]`` int32 holds each request's tokens, the first
    ``lens[b]`` (>= 1) of row b real (the rest ignored). Returns the same ``[B, n]`` int32 drafts as
    ``prompt_lookup([buf[b, :lens[b]] for b in range(B)], n, ngram=ngram)``. Jittable."""
    B, W = buf.shape
    lens = lens.astype(I32)
    take = lambda idx: jnp.take_along_axis(buf, jnp.clip(idx, 0, W - 1), axis=1)  # noqa: E731
    starts = jnp.arange(W, dtype=I32)[None, :]  # [1, W]: where an earlier occurrence may start
    out = jnp.broadcast_to(take(lens[:, None] - 1), (B, n))  # no occurrence: the last token repeated
    found = jnp.zeros((B,), bool)
    for m in range(ngram, 0, -1):  # the longest tail with an occurrence wins
        ok = starts <= lens[:, None] - m - 1  # the occurrence is followed by at least one token (implies m < len)
        for i in range(m):
            ok &= take(starts + i) == take(lens[:, None] - m + i)
        start = jnp.max(jnp.where(ok, starts, -1), axis=1)  # the latest occurrence
        follow = jnp.maximum(lens - start - m, 1)  # the tokens after it, repeated past the context's end
        got = take(start[:, None] + m + jnp.arange(n, dtype=I32)[None, :] % follow[:, None])
        hit = ok.any(axis=1) & ~found
        out = jnp.where(hit[:, None], got, out)
        found |= hit
    return out.astype(I32)


def _forward(params, pool, attn, ids, pos, slots, *, c, backend):
    """The step's traced body: ``ids [B, T]`` at positions ``pos[b] + [0, T)``, request b in pool slot and
    attention row ``slots[b]`` (-1: masked, its pool slot reads zeros and its attention rows are not written).
    Returns ``(logits [B, T, vocab] fp32, pool with this step's tape, attention buffers)``; nothing is committed."""
    fam = family_module(c.model_type)
    B, T = ids.shape
    rows = jnp.where(slots >= 0, slots, B)  # the attention buffers' row; B: past the end, writes dropped
    at = pos[:, None] + jnp.arange(T, dtype=I32)[None, :]  # [B, T]
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
                o, pool = pool_mod.verify_layer(pool, layer, mixed, a, b, conv, bias, A_log, dt_bias, slots,
                                                jnp.arange(B, dtype=I32), backend=backend,
                                                beta_scale=beta_scale)  # fmt: skip
                return fam.linear_output(blk.mixer, c, x, o)

            li += 1
        else:

            def mixer(x, blk=blk, i=ai):
                buf = buffers[i].at[rows[:, None], at].set(x.astype(buffers[i].dtype), mode="drop")
                buffers[i] = buf
                y = fam.attention(blk.mixer, c, buf)  # [B, max_len, d]: causal, rows past a query masked
                return jnp.take_along_axis(y, jnp.minimum(at, buf.shape[1] - 1)[..., None], axis=1)

            ai += 1
        h = fam.block(blk, c, h, mixer, kind)
    return fam.head(params, c, h), pool, tuple(buffers)


@functools.partial(jax.jit, static_argnames=("c", "backend"), donate_argnums=(1, 2))
def _step(params, pool, attn, ids, pos, slots, *, c, backend):
    """One step (:func:`_forward`), one jitted call: the host loop's."""
    return _forward(params, pool, attn, ids, pos, slots, c=c, backend=backend)


@functools.partial(jax.jit, static_argnames=("c", "backend", "drafts"), donate_argnums=(1, 2, 3, 4, 5))
def _loop(params, pool, attn, tokens, lens, ran, target, steps, *, c, backend, drafts):
    """Up to ``steps`` decoding steps in one call (a ``lax.while_loop``; ``steps`` is traced, so every K shares
    one compilation), stopping early once every request has ``target`` tokens. Each step: the drafts by
    :func:`lookup_draft` over ``tokens [B, max_len]`` (``lens [B]`` real), the step (:func:`_forward`), the
    greedy acceptance (:func:`~gdn_lossless_jax.model.decode.accept`), the commit, the accepted drafts and the
    target's next token appended to ``tokens``. A request with ``lens >= target`` is masked (slot -1: its pool
    slot is neither read nor written, its tokens and attention rows are not written). ``ran [B]`` counts the
    steps each request ran. Returns ``(pool, attn, tokens, lens, ran, steps taken)``."""
    B, W = tokens.shape
    req = jnp.arange(B, dtype=I32)
    j = jnp.arange(drafts, dtype=I32)[None, :]

    def running(carry):
        t, _, _, _, lens, _ = carry
        return (t < steps) & (lens < target).any()

    def one(carry):
        t, pool, attn, tokens, lens, ran = carry
        active = lens < target
        slots = jnp.where(active, req, -1)
        last = jnp.take_along_axis(tokens, lens[:, None] - 1, axis=1)
        ids = jnp.concatenate([last, lookup_draft(tokens, lens, drafts - 1)], axis=1)
        logits, pool, attn = _forward(params, pool, attn, ids, lens - 1, slots, c=c, backend=backend)
        y, _, m = accept(logits, ids, jnp.ones((B,), I32))  # m: inputs accepted (the last token and m - 1 drafts)
        pool = pool_mod.commit(pool, slots, m - 1, backend=backend)
        dst = jnp.where(active[:, None] & (j < m[:, None]), lens[:, None] + j, W)  # the accepted drafts, the next
        tokens = tokens.at[req[:, None], dst].set(y, mode="drop")
        return t + 1, pool, attn, tokens, jnp.where(active, lens + m, lens), ran + active

    t, pool, attn, tokens, lens, ran = jax.lax.while_loop(running, one, (jnp.int32(0), pool, attn, tokens, lens, ran))
    return pool, attn, tokens, lens, ran, t


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
      steps_per_call: K, the decoding steps a jitted call runs. 1: the host loop (one call a step, the draft on
        the host). K > 1: the device loop (K steps a call, the draft by prompt lookup on the device,
        :func:`lookup_draft`); the same tokens and states as the host loop with :func:`prompt_lookup`.
    After :meth:`generate`, ``pool`` holds each request's state after its last decoded token, ``steps`` the
    number of decoding steps taken (prefill not counted) and ``row_steps [B]`` the steps each request ran (a
    request that reached its budget is masked for the rest: its slot -1, nothing of it read or written). A
    decoder decodes once (its pool is not reset).
    """

    def __init__(self, model, *, requests: int, drafts: int, max_len: int, record: str = "tuples",
                 backend: str | None = None, steps_per_call: int = 1):  # fmt: skip
        for name, x in (("requests", requests), ("drafts", drafts), ("max_len", max_len),
                        ("steps_per_call", steps_per_call)):  # fmt: skip
            if isinstance(x, bool) or not isinstance(x, int) or x < 1:
                raise ValueError(f"FamilyDecoder: argument {name!r} must be a positive integer, got {x!r}")
        self.model, self.c = model, model.config
        self.requests, self.drafts, self.max_len = requests, drafts, max_len
        self.steps_per_call = steps_per_call
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
        self.row_steps = np.zeros(requests, np.int64)

    def _run(self, ids: np.ndarray, pos: np.ndarray, accept=None, active=None) -> tuple[np.ndarray, np.ndarray]:
        """One step and its commit of the state after token ``accept[b]`` of the step (None: the greedy
        acceptance of ``ids[:, 1:]``, the drafts); requests not ``active`` (default all) are masked (slot -1).
        Returns the accepted counts ``[B]`` and the argmax ``[B, T]``."""
        req = np.arange(self.requests, dtype=np.int32)
        slots = jnp.asarray(req if active is None else np.where(active, req, -1), jnp.int32)
        logits, self.pool, self.attn = _step(self.model.params, self.pool, self.attn, jnp.asarray(ids, jnp.int32),
                                             jnp.asarray(pos, jnp.int32), slots, c=self.c,
                                             backend=self.backend)  # fmt: skip
        g = np.asarray(jnp.argmax(logits, axis=-1))  # [B, T]
        if accept is None:  # the leading drafts equal to the target's argmax before them
            agree = np.concatenate([ids[:, 1:] == g[:, :-1], np.zeros((len(ids), 1), bool)], axis=1)
            accept = np.argmin(agree, axis=1)  # the first disagreement (the appended False: all agreed)
        self.pool = pool_mod.commit(self.pool, slots, jnp.asarray(accept, jnp.int32), backend=self.backend)
        return accept, g

    def generate(self, ids, max_new_tokens: int, draft: Callable | None = None) -> np.ndarray:
        """``ids [B, T0]`` (B = ``requests``) followed by ``max_new_tokens`` greedy tokens each, ``[B, T0 +
        max_new_tokens]``. ``draft(contexts, n) -> [B, n]``: the proposals after each request's tokens so far
        (a list of B arrays); default :func:`prompt_lookup` (the only draft of the device loop,
        ``steps_per_call > 1``)."""
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
        K = self.steps_per_call
        if K > 1 and draft not in (None, prompt_lookup):
            raise ValueError(f"generate: argument 'draft' must be None (prompt lookup) with steps_per_call={K}: the "
                             f"device loop drafts on the device (lookup_draft), where a host callable cannot run; got "
                             f"{draft!r} (use steps_per_call=1 for a draft of your own)")  # fmt: skip
        draft = draft or prompt_lookup
        D = self.drafts
        pos = np.zeros(B, np.int64)
        for s in range(0, T0 - 1, D):  # prefill all but the last prompt token, every token accepted
            n = min(D, T0 - 1 - s)  # a short chunk padded to D (one compiled shape): committed after token n - 1,
            chunk = np.pad(ids[:, s : s + n], ((0, 0), (0, D - n)), mode="edge")  # its padding rows overwritten
            self._run(chunk, pos, np.full(B, n - 1))
            pos += n
        target = T0 + max_new_tokens
        if K > 1:
            return self._device_loop(ids, target)
        out = [list(r) for r in ids]
        last = ids[:, -1]
        while True:
            active = np.array([len(r) < target for r in out])
            if not active.any():
                break
            props = np.asarray(draft([np.asarray(r) for r in out], D - 1), np.int32).reshape(B, D - 1)
            step_ids = np.concatenate([last[:, None], props], axis=1)
            n_acc, g = self._run(step_ids, pos, active=active)
            for b in np.flatnonzero(active):
                out[b].extend(int(x) for x in g[b, : n_acc[b] + 1])  # the accepted drafts and the target's next
            pos += np.where(active, n_acc + 1, 0)
            last = np.where(active, g[np.arange(B), n_acc], last)
            self.steps += 1
            self.row_steps += active
        return np.array([r[:target] for r in out], np.int32)

    def _device_loop(self, ids: np.ndarray, target: int) -> np.ndarray:
        """The decoding steps after the prefill, ``steps_per_call`` a jitted call (:func:`_loop`); the host reads
        the requests' lengths after each call and the tokens at the end."""
        B, T0 = ids.shape
        tokens = jnp.zeros((B, self.max_len), I32).at[:, :T0].set(jnp.asarray(ids, I32))
        lens = jnp.full((B,), T0, I32)
        ran = jnp.zeros((B,), I32)
        goal = jnp.full((B,), target, I32)
        K = jnp.int32(self.steps_per_call)
        while True:
            self.pool, self.attn, tokens, lens, ran, t = _loop(self.model.params, self.pool, self.attn, tokens, lens,
                                                               ran, goal, K, c=self.c, backend=self.backend,
                                                               drafts=self.drafts)  # fmt: skip
            self.steps += int(t)
            if (np.asarray(lens) >= target).all():
                break
        self.row_steps = np.asarray(ran).astype(np.int64)
        return np.asarray(tokens[:, :target])
