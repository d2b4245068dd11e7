"""The speculative step for a checkpoint: :class:`~gdn_lossless_jax.model.decode.SpecStep` with the
checkpoint's architecture.

:class:`HFSpecStep` overrides only the model-specific parts, ``_draft`` (the layer-skipping
self-draft: the first ``draft_layers`` GDN blocks, the final norm and the head) and ``_verify`` (the
target through the state pool: every GDN layer by :func:`gdn_lossless_jax.pool.verify_layer`, every
attention layer through the KV cache). The acceptance, the commit (:func:`gdn_lossless_jax.pool.commit`),
the prefix-cache tracking and the jitted step are SpecStep's own.

:class:`MTPSpecStep` drafts with the checkpoint's MTP block. The block needs the target's last
hidden state (after the final norm) and has a KV cache of its own (one more layer of the state's KV
cache), so its state is an :class:`MTPState` (a :class:`~gdn_lossless_jax.model.decode.DecodeState`
with ``hidden [S+1, d]``) and it overrides ``_step``. The MTP entry at position q is built from the
target's hidden state at q - 1 and the token at q (vLLM's convention): after each verify the step
writes the entries of the accepted tokens and of the bonus token with the target's hidden states; the
chain inside a draft feeds the block's own output forward, as vLLM and SGLang do.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .. import decode
from ...reference import in_range as _in_range
from ..decode import DecodeState, KVCache, SpecStep, StepInputs, StepOutputs
from . import arch
from .arch import HFParams
from .config import HFConfig

__all__ = ["HFSpecStep", "MTPSpecStep", "MTPState"]

I32 = jnp.int32
F32 = jnp.float32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MTPState(DecodeState):
    """A :class:`DecodeState` plus each slot's last target hidden state ``hidden [S+1, d]`` (what the
    MTP block drafts from)."""

    hidden: jax.Array


def _attend(p, c: HFConfig, xn, kv: KVCache, layer: int, s_kv, positions):
    """Attention layer ``layer`` of the KV cache over ``xn``; writes this step's entries back."""
    rows_k = kv.k.at[layer, s_kv].get(mode="fill", fill_value=0)
    rows_v = kv.v.at[layer, s_kv].get(mode="fill", fill_value=0)
    out, (rows_k, rows_v) = arch.attention(p, c, xn, rows_k, rows_v, positions)
    new_k = jnp.take_along_axis(rows_k, positions[:, :, None, None], axis=1, mode="clip")
    new_v = jnp.take_along_axis(rows_v, positions[:, :, None, None], axis=1, mode="clip")
    idx = (layer, s_kv[:, None], positions)
    return KVCache(kv.k.at[idx].set(new_k, mode="drop"), kv.v.at[idx].set(new_v, mode="drop")), out


@dataclasses.dataclass(frozen=True)
class HFSpecStep(SpecStep):
    """:class:`~gdn_lossless_jax.model.decode.SpecStep` for a checkpoint's architecture
    (``config`` an :class:`~gdn_lossless_jax.model.hf.config.HFConfig`), with the self-draft."""

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.config, HFConfig):
            raise TypeError(f"{type(self).__name__}: argument 'config' must be an HFConfig, got "
                            f"{type(self.config).__name__}")  # fmt: skip
        if self.mesh is not None:
            raise ValueError(f"{type(self).__name__}: argument 'mesh' is not supported for checkpoints, got {self.mesh!r}")

    def _hidden(self, params: HFParams, state: DecodeState, x, inputs: StepInputs):
        """The target's blocks over ``x [N, D]``: ``(h [N, D, d] before the final norm, pool, kv)``."""
        c, D = self.config, x.shape[1]
        kv = state.kv
        positions = inputs.pos[:, None] + jnp.arange(D, dtype=I32)[None, :]
        s_kv = _in_range(inputs.slots, kv.k.shape[1])

        def gdn_block(blk, h, core):
            return arch.block(blk, c, h, lambda xn: arch.gdn_mixer(blk.mixer, c, xn, core))

        def attention_block(blk, h, layer):
            def mixer(xn):
                nonlocal kv
                kv, out = _attend(blk.mixer, c, xn, kv, layer, s_kv, positions)
                return out

            return arch.block(blk, c, h, mixer)

        h, pool = self._layers(params.blocks, c.kinds, params.embed[x], state.pool, inputs, gdn_block, attention_block)
        return h, pool, kv

    def _verify(self, params: HFParams, state: DecodeState, x, inputs: StepInputs):
        h, pool, kv = self._hidden(params, state, x, inputs)
        return arch.head_logits(params, arch.final_hidden(params, self.config, h), self.config), pool, kv

    def _draft(self, params: HFParams, pool, inputs: StepInputs):
        """``[N, D]`` inputs: the given ones, then the self-draft's greedy chain (as SpecStep's draft)."""
        c = self.config

        def layer(l, h, core):
            blk = params.blocks[l]
            return arch.block(blk, c, h, lambda xn: arch.gdn_mixer(blk.mixer, c, xn, core))

        head = lambda h: arch.head_logits(params, arch.final_hidden(params, c, h), c)[:, 0]  # noqa: E731
        return self._draft_chain(params.embed, pool, inputs, layer, head)


@dataclasses.dataclass(frozen=True)
class MTPSpecStep(HFSpecStep):
    """:class:`HFSpecStep` drafting with the checkpoint's MTP block; its state is an :class:`MTPState`."""

    def __post_init__(self):
        super().__post_init__()
        if self.config.draft != "mtp":
            raise ValueError(f"MTPSpecStep: argument 'config' must have draft='mtp', got {self.config.draft!r}")

    def __call__(self, params: HFParams, state: MTPState, inputs: StepInputs):
        if not isinstance(state, MTPState):
            raise TypeError(f"MTPSpecStep: argument 'state' must be an MTPState, got {type(state).__name__}")
        return super().__call__(params, state, inputs)

    @property
    def _mtp_layer(self) -> int:
        return self.config.attention_layers - 1

    def _mtp(self, params: HFParams, tokens, hidden, rows_k, rows_v, positions):
        """The MTP block over ``tokens [N, T]`` with hidden states ``[N, T, d]`` at ``positions``:
        ``(normalised output [N, T, d], rows_k, rows_v)``."""
        c, m = self.config, params.mtp
        u = arch.mtp_input(params, c, tokens, hidden)
        kv = {}

        def mixer(xn):
            out, kv["rows"] = arch.attention(m.block.mixer, c, xn, rows_k, rows_v, positions)
            return out

        u = arch.block(m.block, c, u, mixer)
        inv = c.invariant_dots
        return arch._settle(arch.rmsnorm(u, m.norm, c.rms_eps, invariant=inv), inv), *kv["rows"]

    def _draft_mtp(self, params: HFParams, state: MTPState, inputs: StepInputs):
        D = self.drafts
        tokens, n_given = inputs.tokens.astype(I32), inputs.n_given
        if D == 1:
            return tokens
        kv, L = state.kv, self._mtp_layer
        s = _in_range(inputs.slots, kv.k.shape[1])
        rows_k = kv.k.at[L, s].get(mode="fill", fill_value=0)
        rows_v = kv.v.at[L, s].get(mode="fill", fill_value=0)
        hid0 = state.hidden.at[s].get(mode="fill", fill_value=0)

        def body(carry, xs):
            rows_k, rows_v, tok, hid = carry
            j, given_next = xs
            pos = (inputs.pos + j)[:, None]
            out, rows_k, rows_v = self._mtp(params, tok[:, None], hid[:, None], rows_k, rows_v, pos)
            proposal = jnp.argmax(arch.head_logits(params, out, self.config)[:, 0], axis=-1).astype(I32)
            nxt = jnp.where(j + 1 < n_given, given_next, proposal)
            return (rows_k, rows_v, nxt, out[:, 0]), nxt

        xs = (jnp.arange(D - 1, dtype=I32), tokens[:, 1:].T)
        _, chain = jax.lax.scan(body, (rows_k, rows_v, tokens[:, 0], hid0), xs)
        return jnp.concatenate([tokens[:, :1], chain.T], axis=1)

    def body(self, params: HFParams, state: MTPState, inputs: StepInputs):
        """The step's traced body with the MTP draft: the state carries each slot's last hidden state."""
        c, D = self.config, self.drafts
        x = self._draft_mtp(params, state, inputs)
        h, pool, kv = self._hidden(params, state, x, inputs)
        hn = arch.final_hidden(params, c, h)
        lg = arch.head_logits(params, hn, c)
        y, gaps, m = decode.accept(lg, x, inputs.n_given, temperature=self.temperature, key=inputs.key)
        j = jnp.arange(1, D)[None, :]
        track_steps = self._track_steps(inputs, m)
        pool = self._commit(pool, inputs.slots, m - 1, inputs.track_slots, track_steps, inputs.rows)
        kv = self._track_kv(kv, inputs, track_steps)
        # The MTP entries at positions pos .. pos + D: token x_0 with the slot's carried hidden state,
        # then each next token (accepted input, or the bonus prediction) with the target's hidden
        # state before it. Entries past the accepted length are masked later and rewritten.
        S1 = kv.k.shape[1]
        s = _in_range(inputs.slots, S1)
        hid0 = state.hidden.at[s].get(mode="fill", fill_value=0)
        nxt = jnp.where(j < m[:, None], x[:, 1:], y[:, :-1])  # the token after input i, i < D - 1
        toks = jnp.concatenate([x[:, :1], nxt, y[:, -1:]], axis=1)  # [N, D + 1]
        hids = jnp.concatenate([hid0[:, None], hn], axis=1)
        positions = inputs.pos[:, None] + jnp.arange(D + 1, dtype=I32)[None, :]
        L = self._mtp_layer
        rows_k = kv.k.at[L, s].get(mode="fill", fill_value=0)
        rows_v = kv.v.at[L, s].get(mode="fill", fill_value=0)
        _, rows_k, rows_v = self._mtp(params, toks, hids, rows_k, rows_v, positions)
        take = lambda r: jnp.take_along_axis(r, positions[:, :, None, None], axis=1, mode="clip")  # noqa: E731
        idx = (L, s[:, None], positions)
        kv = KVCache(kv.k.at[idx].set(take(rows_k), mode="drop"), kv.v.at[idx].set(take(rows_v), mode="drop"))
        last = jnp.take_along_axis(hn, (m - 1)[:, None, None], axis=1)[:, 0]
        hidden = state.hidden.at[s].set(last.astype(state.hidden.dtype), mode="drop")
        return MTPState(pool, kv, hidden), StepOutputs(x, y, gaps, m, track_steps)

