"""Tree drafting: the draft proposes its top-k tokens at each depth, the target verifies every
node at once, and the longest root-to-leaf path that matches the target's greedy tokens is
committed.

:class:`TreeStep` is a :class:`~gdn_lossless_jax.model.decode.SpecStep` whose D inputs are a
tree: node 0 is the given token (the root, a child of the committed state), then the full tree
of ``tree = (k_1, k_2, ...)`` branches in breadth-first order (``k_1`` children of the root, the
draft's top ``k_1`` tokens after it; ``k_2`` children of each of those; ...), so ``D = 1 + k_1 +
k_1 k_2 + ...``. The GDN layers verify it through the pool with the tree's ``parents``
(:func:`gdn_lossless_jax.pool.verify_layer`: one tape entry a node, the chain's rounding along
every root path), the attention layers attend over the committed cache and each node's
ancestors (:func:`~gdn_lossless_jax.model.model.tree_attention`), and commit replays the
accepted path (:func:`gdn_lossless_jax.pool.commit`'s ``path``); the accepted path's keys and
values go into the KV cache at their positions. A row that feeds more than one given token (a
prompt chunk) verifies them as a chain and drafts nothing in that step.

The step's outputs are laid out along the accepted path (``inputs[:, j]``, ``predictions[:, j]``
the path's j-th node), so the engine, the device loop and their bookkeeping are the chain's.
Greedy only, one device.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from .. import pool as pool_mod, tree as tree_mod
from ..pool import StatePool
from .decode import DecodeState, KVCache, SpecStep, StepInputs, StepOutputs, _draft_gdn, _in_range
from .model import Params, gdn_mixer, logits, tree_attention

__all__ = ["TreeStep", "tree_nodes"]

I32 = jnp.int32


def tree_nodes(tree) -> int:
    """Inputs a tree step verifies: the root and the full tree of ``tree``'s branching."""
    n, width = 1, 1
    for k in tree:
        width *= int(k)
        n += width
    return n


@dataclasses.dataclass(frozen=True)
class TreeStep(SpecStep):
    """A :class:`~gdn_lossless_jax.model.decode.SpecStep` drafting a tree (see the module).

    Attributes:
      tree: branching per depth, e.g. ``(2, 2, 2)`` (14 drafted nodes, D = 15).
    """

    tree: tuple[int, ...] = (2, 2)

    def __post_init__(self):
        super().__post_init__()
        t = self.tree
        if not isinstance(t, tuple) or not t or not all(isinstance(k, int) and k >= 1 for k in t):
            raise ValueError(f"TreeStep: argument 'tree' must be a non-empty tuple of positive integers (children per "
                             f"node at each depth), got {t!r}")  # fmt: skip
        if self.drafts != tree_nodes(t):
            raise ValueError(f"TreeStep: argument 'drafts' must be 1 + the tree's nodes = {tree_nodes(t)} for "
                             f"tree={t}, got {self.drafts}")  # fmt: skip
        for name, bad in (("mesh", self.mesh is not None), ("temperature", bool(self.temperature)),
                          ("commit", self.commit is not None)):  # fmt: skip
            if bad:
                raise ValueError(f"TreeStep: argument {name!r} is not supported with a draft tree (greedy, one "
                                 f"device, the pool's commit), got {getattr(self, name)!r}")  # fmt: skip

    # -- the tree's static shape -----------------------------------------------------------
    @property
    def parents(self) -> np.ndarray:
        """``[D]``: -1 for the root, then the full tree's parents shifted past it."""
        return np.concatenate([[-1], tree_mod.full_tree(self.tree) + 1]).astype(np.int32)

    @property
    def depths(self) -> np.ndarray:
        """``[D]``: each node's depth (the root's 0), in NumPy: static in the traced step."""
        par, dep = self.parents, np.zeros(self.drafts, np.int32)
        for i in range(self.drafts):
            dep[i] = dep[par[i]] + 1 if par[i] >= 0 else 0
        return dep

    @property
    def ancestors(self) -> np.ndarray:
        """``[D, D]`` bool: ``[i, j]`` when node j is on node i's root path (i itself included)."""
        par, D = self.parents, self.drafts
        anc = np.eye(D, dtype=bool)
        for i in range(D):
            if par[i] >= 0:
                anc[i] |= anc[par[i]]
        return anc

    # -- the traced step --------------------------------------------------------------------
    def body(self, params: Params, state: DecodeState, inputs: StepInputs) -> tuple[DecodeState, StepOutputs]:
        D = self.drafts
        prefill = inputs.n_given > 1  # a prompt chunk: verified as a chain, nothing drafted
        chain = np.arange(D, dtype=np.int32) - 1
        parents = jnp.where(prefill[:, None], chain, self.parents).astype(I32)
        anc = jnp.where(prefill[:, None, None], np.tril(np.ones((D, D), bool)), self.ancestors)
        depth = jnp.where(prefill[:, None], np.arange(D, dtype=np.int32), self.depths).astype(I32)
        x = jnp.where(prefill[:, None], inputs.tokens.astype(I32), self._draft_tree(params, state.pool, inputs))
        lg, pool, new_kv = self._verify_tree(params, state, x, inputs, parents, anc, depth)
        y = jnp.argmax(lg, axis=-1).astype(I32)
        top2 = jax.lax.top_k(lg, 2)[0]
        gaps = top2[..., 0] - top2[..., 1]
        # A node is accepted when its parent is and its token is the target's after the parent.
        given = jnp.arange(D)[None, :] < inputs.n_given[:, None]
        ok = jnp.where(prefill[:, None], given, tree_mod.greedy_accepted(parents, x, y))
        leaf = jnp.argmax(jnp.where(ok, depth, -1), axis=1).astype(I32)  # the deepest accepted node
        path, steps = tree_mod.path_to(parents, leaf)
        m = steps + 1
        track_steps = self._track_steps(inputs, m)
        pool = pool_mod.commit(pool, inputs.slots, steps, inputs.track_slots, track_steps, inputs.rows, path=path,
                               backend=self.backend)  # fmt: skip
        kv = self._write_path(state.kv, new_kv, inputs, path, m)
        kv = self._track_kv(kv, inputs, track_steps)
        along = lambda a: jnp.take_along_axis(a, jnp.maximum(path, 0), axis=1)  # noqa: E731
        return DecodeState(pool, kv), StepOutputs(along(x), along(y), along(gaps), m, track_steps)

    def _draft_tree(self, params: Params, pool: StatePool, inputs: StepInputs):
        """``[N, D]``: the root (the given token), then each depth's top-k children of every node
        of the depth above, from the draft's greedy logits along each node's own path."""
        c = self.config
        N = inputs.tokens.shape[0]
        s = _in_range(inputs.slots, pool.ssm.shape[1])
        ssm = [self._committed(pool, l, inputs.slots).astype(jnp.float32) for l in range(c.draft_layers)]
        convs = [pool.conv.at[l, s].get(mode="fill", fill_value=0) for l in range(c.draft_layers)]
        level = inputs.tokens[:, :1].astype(I32)  # [N, W]
        out, W, kernel = [level], 1, self._draft_kernel
        for k in self.tree:
            tok = level.reshape(N * W)
            h = params.embed[tok][:, None]
            new_ssm, new_conv = [], []
            for l in range(c.draft_layers):

                def core(mixed, a, b, p, l=l):
                    o, S, window = _draft_gdn(c, ssm[l], convs[l], mixed, a, b, p, kernel=kernel)
                    new_ssm.append(S)
                    new_conv.append(window)
                    return o

                blk = params.blocks[l]
                h = self._block(blk, h, functools.partial(gdn_mixer, blk.mixer, c, core=core))
            lg = logits(params, h, invariant=c.invariant_dots)
            children = jax.lax.top_k(lg[:, 0], k)[1].astype(I32)  # [N * W, k]
            grow = lambda a: jnp.repeat(a, k, axis=0)  # noqa: E731  (each node's state to its k children)
            ssm, convs = [grow(a) for a in new_ssm], [grow(a) for a in new_conv]
            W *= k
            level = children.reshape(N, W)
            out.append(level)
        return jnp.concatenate(out, axis=1)

    def _verify_tree(self, params: Params, state: DecodeState, x, inputs: StepInputs, parents, anc, depth):
        """The target over the tree: logits ``[N, D, vocab]``, the pool with the tree's tape, and
        each attention layer's new keys and values ``[N, D, nkv, hd]`` (not yet in the cache)."""
        c = self.config
        pool, kv = state.pool, state.kv
        positions = inputs.pos[:, None] + depth
        s_kv = _in_range(inputs.slots, kv.k.shape[1])
        h = params.embed[x]
        new_kv, gdn_i, attn_i = [], 0, 0
        topk = max(self.tree)
        for blk, kind in zip(params.blocks, c.kinds):
            if kind == "gdn":

                def core(mixed, a, b, p, layer=gdn_i):
                    nonlocal pool
                    o, pool = pool_mod.verify_layer(
                        pool, layer, mixed, a, b, p.conv_weight, None, p.A_log, p.dt_bias, inputs.slots, inputs.rows,
                        backend=self.backend, parents=parents, topk=topk,
                    )  # fmt: skip
                    return o

                h = self._block(blk, h, functools.partial(gdn_mixer, blk.mixer, c, core=core))
                gdn_i += 1
            else:

                def mixer(xn, blk=blk, layer=attn_i):
                    rows_k = kv.k.at[layer, s_kv].get(mode="fill", fill_value=0)
                    rows_v = kv.v.at[layer, s_kv].get(mode="fill", fill_value=0)
                    out, k_new, v_new = tree_attention(blk.mixer, c, xn, rows_k, rows_v, inputs.pos, positions, anc)
                    new_kv.append((k_new, v_new))
                    return out

                h = self._block(blk, h, mixer)
                attn_i += 1
        return logits(params, h, invariant=c.invariant_dots), pool, new_kv

    def _write_path(self, kv: KVCache, new_kv, inputs: StepInputs, path, m) -> KVCache:
        """The accepted path's keys and values into the cache at positions ``pos .. pos + m - 1``."""
        if not new_kv:
            return kv
        D = self.drafts
        s_kv = _in_range(inputs.slots, kv.k.shape[1])
        j = jnp.arange(D, dtype=I32)[None, :]
        Tmax = kv.k.shape[2]
        positions = jnp.where(j < m[:, None], inputs.pos[:, None] + j, Tmax)  # past the end: dropped
        gather = lambda a: jnp.take_along_axis(a, jnp.maximum(path, 0)[:, :, None, None], axis=1)  # noqa: E731
        k, v = kv.k, kv.v
        for layer, (k_new, v_new) in enumerate(new_kv):
            idx = (layer, s_kv[:, None], positions)
            k = k.at[idx].set(gather(k_new), mode="drop")
            v = v.at[idx].set(gather(v_new), mode="drop")
        return KVCache(k, v)
