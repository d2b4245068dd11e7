"""Controls for KDA (:mod:`gdn_lossless_jax.kda`): the wrong update forms a bit-exactness test must catch.

Each is a replay form ``(S [..., V, K], alpha [..., K], k [..., K], u [..., V]) -> S'`` for
:func:`gdn_lossless_jax.kda.replay` / :func:`~gdn_lossless_jax.kda.commit` (``form=``), wrong *by
construction* with every operation pinned (:func:`~gdn_lossless_jax.rounding.mul_rn`,
:func:`~gdn_lossless_jax.rounding.add_rn`, :func:`~gdn_lossless_jax.rounding.fma_rn`), as
:mod:`gdn_lossless_jax.testing.controls` keeps GDN's:

- ``scalar_decay``: the per-channel decay applied as one factor per head, ``exp(mean(g))`` (what a GDN
  kernel given KDA's tape would do if it averaged or took one channel's ``g``);
- ``twice_rounded``: ``rn(rn(S * alpha) + rn(k * u))`` (the rule's product rounded on its own);
- ``other_product``: ``fma(S, alpha, rn(k * u))`` (the other product fused);
- ``wrong_axis``: the decay broadcast over the V rows instead of the K columns (only where V == K:
  the layout mistake between transformers' ``[K, V]`` state and the library's ``[V, K]``).
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp

from ..kda import rule
from ..rounding import add_rn, fma_rn, mul_rn

__all__ = ["CONTROLS", "FORMS", "scalar_decay", "twice_rounded", "other_product", "wrong_axis"]


def scalar_decay(S, alpha, k, u):
    """Control: one decay per head, ``exp(mean(log(alpha)))`` (the mean of g), then the rule."""
    one = jnp.exp(jnp.mean(jnp.log(alpha), axis=-1, keepdims=True))
    return rule(S, jnp.broadcast_to(one, alpha.shape), k, u)


def twice_rounded(S, alpha, k, u):
    """Control: ``rn(rn(S * alpha) + rn(k * u))``, each step pinned."""
    return add_rn(mul_rn(S, alpha[..., None, :]), mul_rn(k[..., None, :], u[..., :, None]))


def other_product(S, alpha, k, u):
    """Control: ``fma(S, alpha, rn(k * u))``."""
    return fma_rn(S, alpha[..., None, :], mul_rn(k[..., None, :], u[..., :, None]))


def wrong_axis(S, alpha, k, u):
    """Control (V == K only): the decay of channel c applied to row c (``S * alpha[:, None]``)."""
    if S.shape[-1] != S.shape[-2]:
        raise ValueError(f"kda_controls.wrong_axis: needs V == K, got a state of shape {list(S.shape)}")
    return fma_rn(k[..., None, :], u[..., :, None], mul_rn(S, alpha[..., :, None]))


#: The wrong forms a KDA bit-exactness test must catch.
CONTROLS: dict[str, Callable] = {
    "scalar_decay": scalar_decay,
    "twice_rounded": twice_rounded,
    "other_product": other_product,
    "wrong_axis": wrong_axis,
}

#: The rule first, then the controls.
FORMS: dict[str, Callable] = {"rule": rule, **CONTROLS}
