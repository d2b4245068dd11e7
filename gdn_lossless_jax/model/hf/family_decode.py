"""Speculative decoding of OLMo-Hybrid, Kimi Linear and Qwen4-Exp checkpoints through the state pool.

:class:`FamilyDecoder` runs a :class:`~gdn_lossless_jax.model.hf.family.FamilyModel` step by step: each
step feeds ``T`` tokens per request (the last accepted token and ``T - 1`` drafts, a chain or a tree) through
every block; the linear layers (OLMo-Hybrid's GDN with its beta scale, Kimi's KDA with its per-channel decay)
verify them with :func:`gdn_lossless_jax.pool.verify_layer` from the request's pool slot, recording the pool's
tape (tuples or snapshots; a KDA pool's tuples are :class:`~gdn_lossless_jax.tape.KDATuples`), and after the
greedy acceptance :func:`gdn_lossless_jax.pool.commit` writes the state after the last accepted token. So every
state in the pool comes from the library's verify and commit, as for Qwen's :mod:`gdn_lossless_jax.model.decode`.

The attention layers keep, per request, the block's attention input at each position (``[B, max_len, d]``)
and run the family's full-sequence causal attention over that buffer (positions past a query are masked out),
taking the rows of the step's positions: no separate KV cache code per family (O(max_len^2) a step; this
decoder is for checking the tape end to end on small models, not for speed). Rejected drafts' rows are
overwritten by the next step, which starts at the first rejected position.

A family may keep per-request *rolling windows* beside the pool (its ``windows(c, B)``; Qwen4-Exp's PLE: the last
tokens and a PLE block's last conv inputs): its ``pre_block`` reads them along each node's path (``back(name, rows,
s)``: the entry ``s`` positions back, past the step's first node into the window), and after the acceptance
:func:`_commit_windows` keeps each window's entries that end at the last accepted node, with the pool's commit (masked
requests untouched). So they roll back with the GDN state; ``decoder.windows`` holds them.

Acceptance is greedy: draft ``j`` is accepted while it equals the target's argmax after the token before it;
the step emits the accepted drafts and the target's next token. The prompt is prefilled through the same step
in chunks of ``drafts`` tokens, every token accepted (the last chunk padded, committed after its last
prompt token). A request that has its ``max_new_tokens`` is masked for the remaining steps (slot -1: the pool
reads zeros for it and drops its writes; its attention rows are not written), so its state is the one after the
step that completed it, whatever the other requests still decode.

Draft trees (``topk > 1``, host loop): the draft may propose a tree each step, ``(tokens, parents)`` over the
step's D nodes, node 0 the last accepted token (the root) and every other node a descendant of it. Node i's
block input sits at position ``pos + i`` of the attention buffers; the attention layers see, for node i, the
committed prefix and its ancestors only (not its siblings: a mask built from the tree,
:func:`gdn_lossless_jax.tree.ancestors`), at position ``pos`` plus its depth (RoPE); the linear layers verify the
tree through ``pool.verify_layer(..., parents=)``. Acceptance follows the tree from the root, into the child whose
token equals the target's argmax at its parent (:func:`gdn_lossless_jax.tree.greedy_accepted`, the deepest such
node the leaf); ``pool.commit(..., path=)`` writes the state after the leaf, and the accepted path's block inputs
move to positions ``pos, pos + 1, ...`` for the next step.

The host loop (``steps_per_call=1``) runs one jitted step a call and accepts and drafts on the host (any
``draft(contexts, n)``). The device loop (``steps_per_call=K > 1``, :func:`_loop`) runs K steps a call in a
``lax.while_loop`` over the same step: the draft by prompt lookup over a token buffer on the device
(:func:`lookup_draft`, :func:`prompt_lookup`'s rule), the acceptance (:func:`~gdn_lossless_jax.model.decode.accept`)
and the commit there, the accepted tokens appended to the buffer; the host sees the lengths every K steps (the
prefill runs through the host loop's step). Shapes never change (masked requests, not smaller batches), and K is
a traced bound, so every K shares one compilation. Both give the same tokens and the same pool bit for bit
(``tests/test_family_decode.py``). Not done here: sampling, a draft of the caller's own or a draft tree in the
device loop, requests of different prompt lengths (a batch's prompts have one length).
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ... import pool as pool_mod, tree as tree_mod
from ..decode import accept
from .family import family_module

__all__ = ["FamilyDecoder", "prompt_lookup", "lookup_draft", "family_module"]

I32 = jnp.int32
NGRAM = 2  # prompt lookup's default tail: the last two tokens, then the last one


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


def _tree_mask(parents, pos, L: int):
    """A draft tree's attention over the buffers' ``L`` positions: ``(mask [B, L, L], positions [B, L])``. The
    step's node i sits at buffer position ``pos + i`` and sees the committed prefix (positions before ``pos``) and
    its ancestors (:func:`gdn_lossless_jax.tree.ancestors`, itself included), not its siblings; its position (for
    RoPE) is ``pos`` plus its depth. Elsewhere: causal, each position its own."""
    B, D = parents.shape
    anc = tree_mod.ancestors(parents)  # [B, D, D]
    depth = tree_mod.depths(parents)  # [B, D]: node 0 (the root) at depth 0
    r = jnp.arange(L, dtype=I32)
    rel = r[None, :] - pos[:, None]  # [B, L]: the node at each position
    node = (rel >= 0) & (rel < D)
    relc = jnp.clip(rel, 0, D - 1)
    seen = jnp.take_along_axis(jnp.take_along_axis(anc, relc[:, :, None], axis=1), relc[:, None, :], axis=2)
    mask = jnp.tril(jnp.ones((L, L), bool))[None] & ~(node[:, :, None] & node[:, None, :] & ~seen)
    positions = jnp.where(node, pos[:, None] + jnp.take_along_axis(depth, relc, axis=1), r[None, :])
    return mask, positions


def _walk(par, idx, S: int, s: int):
    """``s`` steps back along the paths of a step's nodes: ``idx [B, ...]`` positions in a window's ``S`` entries
    followed by the step's ``T`` rows (a node ``i`` at ``S + i``), each moved to its node's parent (``par [B, T]``;
    the root's, -1, is the window's last entry) or, inside the window, to the entry before."""
    T = par.shape[1]
    for _ in range(s):
        node = idx - S
        up = S + jnp.take_along_axis(par, jnp.clip(node, 0, T - 1).reshape(par.shape[0], -1), axis=1).reshape(idx.shape)
        idx = jnp.where(node >= 0, up, idx - 1)
    return idx


def _take(window, rows, idx):
    """``[window | rows]`` (along axis 1) at ``idx [B, M]``: ``[B, M, ...]``."""
    cat = jnp.concatenate([window, rows.astype(window.dtype)], axis=1)
    return jnp.take_along_axis(cat, idx.reshape(*idx.shape, *([1] * (cat.ndim - 2))), axis=1)


def _step_parents(parents, B: int, T: int):
    """A step's parents ``[B, T]``: a draft tree's, or a chain's (node i's parent i - 1)."""
    if parents is not None:
        return parents
    return jnp.broadcast_to(jnp.arange(-1, T - 1, dtype=I32), (B, T))


@functools.partial(jax.jit, donate_argnums=0)
def _commit_windows(wins, rows, slots, leaf, parents=None):
    """A family's rolling windows (:func:`~gdn_lossless_jax.model.hf.qwen4_exp.windows`) after a step: each window's
    last ``S`` entries along the path that ends at node ``leaf [B]`` (the last accepted one), reaching back into
    the window before the step; ``rows``: the step's entries of each window ``[B, T, ...]``. Masked requests
    (``slots`` -1) keep theirs. The state after the accepted tokens, as the pool's commit writes it."""
    out = {}
    for name, w in wins.items():
        B, S = w.shape[:2]
        par = _step_parents(parents, B, rows[name].shape[1])
        ends = (S + leaf.astype(I32))[:, None]
        idx = jnp.concatenate([_walk(par, ends, S, S - 1 - j) for j in range(S)], axis=1)  # oldest first
        new = _take(w, rows[name], idx)
        out[name] = jnp.where((slots >= 0).reshape(B, *([1] * (w.ndim - 1))), new, w)
    return out


def _forward(params, pool, attn, wins, ids, pos, slots, parents=None, *, c, backend, topk=1):
    """The step's traced body: ``ids [B, T]`` at positions ``pos[b] + [0, T)``, request b in pool slot and
    attention row ``slots[b]`` (-1: masked, its pool slot reads zeros and its attention rows are not written).
    ``parents [B, T]`` (with ``topk``, the most children a node has): the step's inputs are a draft tree, node 0
    the root; the linear layers verify it (``pool.verify_layer``'s ``parents``), the attention layers attend
    along it (:func:`_tree_mask`; node i's block input kept at position ``pos + i``). ``wins``: the family's
    rolling windows (empty for most), read along each node's path by the family's ``pre_block``. Returns
    ``(logits [B, T, vocab] fp32, pool with this step's tape, attention buffers, the step's rows of each window)``;
    nothing is committed."""
    fam = family_module(c.model_type)
    B, T = ids.shape
    rows = jnp.where(slots >= 0, slots, B)  # the attention buffers' row; B: past the end, writes dropped
    at = pos[:, None] + jnp.arange(T, dtype=I32)[None, :]  # [B, T]
    tree = {} if parents is None else dict(parents=parents, topk=topk)
    if parents is not None and attn:
        mask, positions = _tree_mask(parents, pos, attn[0].shape[1])
    beta_scale = getattr(c, "beta_scale", 1.0)
    h = fam.embed(params, c, ids) if hasattr(fam, "embed") else params.embed[ids]
    wrows = {"tokens": ids} if "tokens" in wins else {}  # the step's entries of each window
    if wins:
        par = _step_parents(parents, B, T)

        def back(name, r, s):  # window `name`'s entries s positions back along each node's path
            S = wins[name].shape[1]
            return _take(wins[name], r, _walk(par, jnp.broadcast_to(S + jnp.arange(T, dtype=I32), (B, T)), S, s))

    li = ai = 0
    buffers = list(attn)
    for i, (blk, kind) in enumerate(zip(params.blocks, c.layer_types)):
        if kind == "linear_attention":

            def mixer(x, blk=blk, layer=li):
                nonlocal pool
                mixed, a, b = fam.linear_inputs(blk.mixer, c, x)
                conv, bias, A_log, dt_bias = fam.linear_weights(blk.mixer)
                o, pool = pool_mod.verify_layer(pool, layer, mixed, a, b, conv, bias, A_log, dt_bias, slots,
                                                jnp.arange(B, dtype=I32), backend=backend, beta_scale=beta_scale,
                                                **tree)  # fmt: skip
                return fam.linear_output(blk.mixer, c, x, o)

            li += 1
        else:

            def mixer(x, blk=blk, i=ai):
                buf = buffers[i].at[rows[:, None], at].set(x.astype(buffers[i].dtype), mode="drop")
                buffers[i] = buf
                if parents is None:  # [B, max_len, d]: causal, rows past a query masked
                    y = fam.attention(blk.mixer, c, buf)
                else:
                    y = fam.attention(blk.mixer, c, buf, mask, positions)
                return jnp.take_along_axis(y, jnp.minimum(at, buf.shape[1] - 1)[..., None], axis=1)

            ai += 1
        if wins:
            h, r = fam.pre_block(blk, c, i, h, ids, back)
            wrows.update(r)
        h = fam.block(blk, c, h, mixer, kind)
    return fam.head(params, c, h), pool, tuple(buffers), wrows


@functools.partial(jax.jit, static_argnames=("c", "backend", "topk"), donate_argnums=(1, 2))
def _step(params, pool, attn, wins, ids, pos, slots, parents=None, *, c, backend, topk=1):
    """One step (:func:`_forward`), one jitted call: the host loop's."""
    return _forward(params, pool, attn, wins, ids, pos, slots, parents, c=c, backend=backend, topk=topk)


@functools.partial(jax.jit, donate_argnums=0)
def _keep_path(attn, slots, pos, path, steps):
    """After a tree step's commit: the accepted path's block inputs (node ``path[b, j]`` at position ``pos[b] +
    path[b, j]``) moved to positions ``pos[b] + j``, ``j <= steps[b]``, in every attention buffer (masked
    requests, slot -1, untouched), where the next step's attention reads them as the committed prefix."""
    B, L = attn[0].shape[:2] if attn else (0, 0)
    j = jnp.arange(path.shape[1], dtype=I32)[None, :]
    src = jnp.clip(pos[:, None] + jnp.maximum(path, 0), 0, L - 1)
    dst = jnp.where((slots[:, None] >= 0) & (j <= steps[:, None]), pos[:, None] + j, L)  # L: dropped
    req = jnp.arange(B)[:, None]
    return tuple(buf.at[req, dst].set(jnp.take_along_axis(buf, src[..., None], axis=1), mode="drop") for buf in attn)


@functools.partial(jax.jit, static_argnames=("c", "backend", "drafts"), donate_argnums=(1, 2, 3, 4, 5, 6))
def _loop(params, pool, attn, wins, tokens, lens, ran, target, steps, *, c, backend, drafts):
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
        t, _, _, _, _, lens, _ = carry
        return (t < steps) & (lens < target).any()

    def one(carry):
        t, pool, attn, wins, tokens, lens, ran = carry
        active = lens < target
        slots = jnp.where(active, req, -1)
        last = jnp.take_along_axis(tokens, lens[:, None] - 1, axis=1)
        ids = jnp.concatenate([last, lookup_draft(tokens, lens, drafts - 1)], axis=1)
        logits, pool, attn, rows = _forward(params, pool, attn, wins, ids, lens - 1, slots, c=c, backend=backend)
        y, _, m = accept(logits, ids, jnp.ones((B,), I32))  # m: inputs accepted (the last token and m - 1 drafts)
        pool = pool_mod.commit(pool, slots, m - 1, backend=backend)
        wins = _commit_windows(wins, rows, slots, m - 1)
        dst = jnp.where(active[:, None] & (j < m[:, None]), lens[:, None] + j, W)  # the accepted drafts, the next
        tokens = tokens.at[req[:, None], dst].set(y, mode="drop")
        return t + 1, pool, attn, wins, tokens, jnp.where(active, lens + m, lens), ran + active

    carry = (jnp.int32(0), pool, attn, wins, tokens, lens, ran)
    t, pool, attn, wins, tokens, lens, ran = jax.lax.while_loop(running, one, carry)
    return pool, attn, wins, tokens, lens, ran, t


class FamilyDecoder:
    """Greedy speculative decoding of a :class:`~gdn_lossless_jax.model.hf.family.FamilyModel` through a
    :class:`~gdn_lossless_jax.pool.StatePool` (module docstring).

    Args:
      model: an ``olmo_hybrid``, ``kimi_linear`` or ``qwen4_exp`` checkpoint (``load_pretrained``, ``random_model``).
      requests: B, the batch (request b holds pool slot b and scratch row b).
      drafts: the tokens a step verifies (the last accepted one and ``drafts - 1`` drafts; with ``topk > 1``
        the nodes of a step's tree, the root included); 1 is plain greedy decoding through the pool.
      max_len: the longest sequence (prompt and new tokens).
      record: the pool's record mode, ``"tuples"`` or ``"snapshots"``.
      backend: the verify and commit backend (``"auto"``: the model's).
      steps_per_call: K, the decoding steps a jitted call runs. 1: the host loop (one call a step, the draft on
        the host). K > 1: the device loop (K steps a call, the draft by prompt lookup on the device,
        :func:`lookup_draft`); the same tokens and states as the host loop with :func:`prompt_lookup`.
      topk: the most children a node of a step's draft tree may have; ``topk > 1`` lets the draft propose a
        tree each step (:meth:`generate`), verified by the linear layers through the pool with its parents,
        attended along by the attention layers, its accepted path committed. Host loop only.
    After :meth:`generate`, ``pool`` (and ``windows``, the family's rolling windows: empty for OLMo-Hybrid and Kimi
    Linear) holds each request's state after its last decoded token, ``steps`` the
    number of decoding steps taken (prefill not counted) and ``row_steps [B]`` the steps each request ran (a
    request that reached its budget is masked for the rest: its slot -1, nothing of it read or written). A
    decoder decodes once (its pool is not reset).
    """

    def __init__(self, model, *, requests: int, drafts: int, max_len: int, record: str = "tuples",
                 backend: str | None = None, steps_per_call: int = 1, topk: int = 1):  # fmt: skip
        for name, x in (("requests", requests), ("drafts", drafts), ("max_len", max_len),
                        ("steps_per_call", steps_per_call), ("topk", topk)):  # fmt: skip
            if isinstance(x, bool) or not isinstance(x, int) or x < 1:
                raise ValueError(f"FamilyDecoder: argument {name!r} must be a positive integer, got {x!r}")
        if topk > 1 and steps_per_call > 1:
            raise ValueError(f"FamilyDecoder: arguments topk={topk} and steps_per_call={steps_per_call}: the device "
                             "loop drafts a chain (prompt lookup on the device); draft trees run in the host loop "
                             "(steps_per_call=1)")  # fmt: skip
        self.model, self.c = model, model.config
        self.requests, self.drafts, self.max_len = requests, drafts, max_len
        self.steps_per_call, self.topk = steps_per_call, topk
        self.backend = backend or getattr(model, "backend", "auto")
        fam = family_module(self.c.model_type)
        self.geometry = fam.geometry(self.c)
        self.pool = pool_mod.allocate(self.geometry, slots=requests, requests=requests, drafts=drafts,
                                      record=record, state_dtype=jnp.float32, conv_dtype=self.c.jnp_dtype,
                                      topk=topk, free_bytes=None)  # fmt: skip
        self.windows = fam.windows(self.c, requests) if hasattr(fam, "windows") else {}
        d = self.c.d_model
        n_attn = self.c.layer_types.count("full_attention")
        self.attn = tuple(jnp.zeros((requests, max_len, d), self.c.jnp_dtype) for _ in range(n_attn))
        self.steps = 0
        self.row_steps = np.zeros(requests, np.int64)

    def _run(self, ids: np.ndarray, pos: np.ndarray, accept=None, active=None, parents=None):
        """One step and its commit. ``accept[b]``: commit the state after token ``accept[b]`` of the step (a
        prompt chunk); None: the greedy acceptance of the drafts, along the chain ``ids[:, 1:]`` or, with
        ``parents [B, D]``, the tree (:func:`gdn_lossless_jax.tree.greedy_accepted`; its accepted path
        committed with ``pool.commit``'s ``path`` and its block inputs moved to the path's positions). Requests
        not ``active`` (default all) are masked (slot -1). Returns the accepted drafts ``[B]`` and the target's
        argmax ``[B, D]`` along the accepted path (the chain's: in step order)."""
        B, D = ids.shape
        req = np.arange(B, dtype=np.int32)
        slots = jnp.asarray(req if active is None else np.where(active, req, -1), jnp.int32)
        tree = {}
        if self.topk > 1:  # the compiled tree step (a chain's parents for a prompt chunk or a chain draft)
            parents = np.broadcast_to(tree_mod.chain_parents(D) if parents is None else parents, (B, D))
            tree = dict(parents=jnp.asarray(parents, jnp.int32), topk=self.topk)
        logits, self.pool, self.attn, rows = _step(self.model.params, self.pool, self.attn, self.windows,
                                                   jnp.asarray(ids, jnp.int32), jnp.asarray(pos, jnp.int32), slots,
                                                   c=self.c, backend=self.backend, **tree)  # fmt: skip
        g = np.asarray(jnp.argmax(logits, axis=-1))  # [B, D]
        if accept is not None or parents is None or tree_mod.is_chain(parents):
            if accept is None:  # the leading drafts equal to the target's argmax before them
                agree = np.concatenate([ids[:, 1:] == g[:, :-1], np.zeros((B, 1), bool)], axis=1)
                accept = np.argmin(agree, axis=1)  # the first disagreement (the appended False: all agreed)
            self.pool = pool_mod.commit(self.pool, slots, jnp.asarray(accept, jnp.int32), backend=self.backend)
            if self.windows:
                self.windows = _commit_windows(self.windows, rows, slots, jnp.asarray(accept, jnp.int32))
            return accept, g
        ok = np.asarray(tree_mod.greedy_accepted(parents, ids, g))
        depth = np.asarray(tree_mod.depths(parents))
        leaf = np.argmax(np.where(ok, depth, -1), axis=1)  # the deepest accepted node
        path, steps = (np.asarray(x) for x in tree_mod.path_to(parents, leaf))
        self.pool = pool_mod.commit(self.pool, slots, jnp.asarray(steps), path=jnp.asarray(path), parents=parents,
                                    backend=self.backend)  # fmt: skip
        if self.windows:
            self.windows = _commit_windows(self.windows, rows, slots, jnp.asarray(leaf, I32),
                                           jnp.asarray(parents, I32))  # fmt: skip
        self.attn = _keep_path(self.attn, slots, jnp.asarray(pos, jnp.int32), jnp.asarray(path), jnp.asarray(steps))
        return steps, np.take_along_axis(g, np.maximum(path, 0), axis=1)

    def _proposals(self, out, B: int, D: int, draft: Callable):
        """The draft's proposals after each request's tokens: ``(tokens [B, D - 1], parents [B, D] or None)``."""
        props = draft([np.asarray(r) for r in out], D - 1)
        if not isinstance(props, tuple):
            return np.asarray(props, np.int32).reshape(B, D - 1), None
        tokens, parents = props
        tokens = np.asarray(tokens, np.int32).reshape(B, D - 1)
        parents = np.asarray(parents)
        if not np.issubdtype(parents.dtype, np.integer) or parents.shape not in ((D,), (B, D)):
            raise ValueError(f"generate: the draft's tree must be integer parents of shape [D] = [{D}] or [B, D] = "
                             f"[{B}, {D}] (node 0 the last accepted token), got {parents.dtype} "
                             f"{list(parents.shape)}")  # fmt: skip
        parents = np.broadcast_to(parents, (B, D)).astype(np.int32)
        tree_mod.check_parents_values("generate (the draft's tree)", parents, self.topk)
        if (parents[:, 0] != -1).any() or (parents[:, 1:] < 0).any():
            b = int(np.flatnonzero((parents[:, 0] != -1) | (parents[:, 1:] < 0).any(axis=1))[0])
            raise ValueError(f"generate: the draft's tree must have node 0 (the last accepted token) as its only "
                             f"root: parents[:, 0] = -1 and every other node's parent in [0, d), got request {b}'s "
                             f"parents {parents[b].tolist()}")  # fmt: skip
        return tokens, parents

    def generate(self, ids, max_new_tokens: int, draft: Callable | None = None) -> np.ndarray:
        """``ids [B, T0]`` (B = ``requests``) followed by ``max_new_tokens`` greedy tokens each, ``[B, T0 +
        max_new_tokens]``. ``draft(contexts, n)``: the proposals after each request's tokens so far (a list of
        B arrays), ``[B, n]`` (a chain of ``n = drafts - 1``), or with ``topk > 1`` a tree of ``drafts`` nodes,
        ``(tokens [B, n], parents [drafts] or [B, drafts])``: node 0 is the last accepted token (parent -1),
        node ``d >= 1`` has token ``tokens[:, d - 1]`` and parent in ``[0, d)``, at most ``topk`` children a
        node. Default :func:`prompt_lookup` (the only draft of the device loop, ``steps_per_call > 1``)."""
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
            props, parents = self._proposals(out, B, D, draft)
            step_ids = np.concatenate([last[:, None], props], axis=1)
            n_acc, g = self._run(step_ids, pos, active=active, parents=parents)
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
            self.pool, self.attn, self.windows, tokens, lens, ran, t = _loop(
                self.model.params, self.pool, self.attn, self.windows, tokens, lens, ran, goal, K, c=self.c,
                backend=self.backend, drafts=self.drafts)  # fmt: skip
            self.steps += int(t)
            if (np.asarray(lens) >= target).all():
                break
        self.row_steps = np.asarray(ran).astype(np.int64)
        return np.asarray(tokens[:, :target])
