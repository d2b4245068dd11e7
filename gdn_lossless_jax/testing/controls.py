"""Controls: the wrong rounding forms and the wrong commit ordering.

Every bit-exactness test must catch one of these, or it proves nothing. They are kept here,
apart from the product: :data:`CONTROLS` names the wrong update forms a test must catch,
:data:`FORMS` every update form (the rule first) for the reports that measure them, and
:func:`commit_accepted_first` the ordering bug a commit must not have.

A control differs from the rule *by construction*: each of its operations is pinned
(:func:`~gdn_lossless_jax.rounding.mul_rn`, :func:`~gdn_lossless_jax.rounding.add_rn`,
:func:`~gdn_lossless_jax.rounding.fma_rn`), so it rounds where the rule does not (the update's
product rounded on its own) or fuses the other product, on every platform and jax release.
The one-expression form ``S * alpha + k * u`` (:func:`naive_update`) is *not* a control: how
it rounds is the compiler's choice, and XLA:CPU from jax 0.12.1 on contracts it into the
rule's own fma, so a test built on it would catch nothing there. It stays in :data:`FORMS`
for the reports (``gdn-lossless check``, :mod:`gdn_lossless_jax.tools.viz`), which measure
what a platform does with it.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp

from ..reference import commit
from ..rounding import add_rn, apply_rule, decay_factor, fma_rn, mul_rn
from ..tape import Tuples

__all__ = ["CONTROLS", "FORMS", "naive_update", "twice_rounded_update", "other_product_update",
           "commit_accepted_first"]


def commit_accepted_first(pool, tape: Tuples, slots, steps, track_slots, track_steps, rows):
    """Control, not for use: the accepted-first ordering bug.

    Writes the accepted state in place first, then replays the track state from the
    *pool* (which now holds the advanced state). The track state comes out wrong whenever
    a request has both. (SGLang's lossless-verify pull request, where this design started,
    had to order its two replays to avoid exactly this.) Tests keep it to show the suite
    catches it.
    """
    none = jnp.full_like(slots, -1)
    pool = commit(pool, tape, slots, steps, none, none, rows)
    return commit(pool, tape, slots, none, track_slots, track_steps, rows)


def naive_update(S, alpha, k, u):
    """Not a control: the one-expression form ``S * alpha + k * u``, rounded as the compiler
    decides (XLA:GPU rounds twice, XLA:CPU under jit contracts one product into an fma; which
    one changed between jax releases). For measuring a platform, never for a test's control."""
    return S * decay_factor(S, alpha) + k[..., None, :] * u[..., :, None]


def twice_rounded_update(S, alpha, k, u):
    """Control: ``rn(rn(S * alpha) + rn(k * u))``, each step pinned (what XLA:GPU does)."""
    Sd = mul_rn(S, decay_factor(S, alpha))
    return add_rn(Sd, mul_rn(k[..., None, :], u[..., :, None]))


def other_product_update(S, alpha, k, u):
    """Control: ``fma(S, alpha, rn(k * u))``, the product Triton's fp fusion fuses."""
    return fma_rn(S, decay_factor(S, alpha), mul_rn(k[..., None, :], u[..., :, None]))


#: The wrong update forms ``(S, alpha, k, u) -> S'`` a bit-exactness test must catch, each
#: different from the rule by construction: the product rounded on its own, and the other
#: product fused.
CONTROLS: dict[str, Callable] = {
    "twice_rounded": twice_rounded_update,
    "other_product": other_product_update,
}

#: Every named update form (the rule first): the rule, the compiler's one-expression form
#: (measured, not a control) and the controls.
FORMS: dict[str, Callable] = {
    "rule": apply_rule,
    "naive": naive_update,
    **CONTROLS,
}
