"""Controls: the wrong rounding forms and the wrong commit ordering.

Every bit-exactness test must catch one of these, or it proves nothing. They are kept here,
apart from the product: :data:`FORMS` names the update forms (the rule first, then the forms
the rule must not be), :func:`commit_accepted_first` the ordering bug a commit must not have.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp

from ..reference import commit
from ..rounding import add_rn, apply_rule, fma_rn, mul_rn
from ..tape import Tuples

__all__ = ["FORMS", "naive_update", "twice_rounded_update", "other_product_update", "commit_accepted_first"]


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
    """Control: the one-expression form ``S * alpha + k * u``; the compiler decides."""
    return S * alpha[..., None, None] + k[..., None, :] * u[..., :, None]


def twice_rounded_update(S, alpha, k, u):
    """Control: ``rn(rn(S * alpha) + rn(k * u))``, each step pinned (what XLA:GPU does)."""
    Sd = mul_rn(S, alpha[..., None, None])
    return add_rn(Sd, mul_rn(k[..., None, :], u[..., :, None]))


def other_product_update(S, alpha, k, u):
    """Control: ``fma(S, alpha, rn(k * u))``, the product Triton's fp fusion fuses."""
    return fma_rn(S, alpha[..., None, None], mul_rn(k[..., None, :], u[..., :, None]))


#: The named update forms ``(S, alpha, k, u) -> S'`` (the rule first).
FORMS: dict[str, Callable] = {
    "rule": apply_rule,
    "naive": naive_update,
    "twice_rounded": twice_rounded_update,
    "other_product": other_product_update,
}
