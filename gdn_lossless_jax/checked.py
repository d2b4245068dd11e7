"""The checked mode of commit and replay: requests that would be skipped raise instead.

By default commit follows SGLang's masking: a request whose slot or tape row is out of
range is skipped entirely, a negative step writes nothing, a track copy with a negative
step or an out-of-range track slot is skipped, and duplicate destination slots are
undefined. That is right for a serving loop with padding requests, and silent for a bug.
With ``checked=True`` (:func:`gdn_lossless_jax.commit`, :func:`gdn_lossless_jax.replay`,
:func:`gdn_lossless_jax.pool.commit`) every request must be valid, and the first one
that is not raises an error that names it:

* ``0 <= slots[i] < S`` and ``0 <= rows[i] < R`` (S pool slots, R tape rows);
* ``-1 <= steps[i] < D``: -1 means nothing accepted; ``steps[i] == D`` gets its own
  message, since it is what an accepted *length* looks like where the 0-based *step* is
  expected (a fully accepted request of D drafts has step D - 1);
* ``-1 <= track_steps[i] < D``, and ``0 <= track_slots[i] < S`` where ``track_steps[i] >= 0``;
* ``track_steps[i] <= steps[i]`` where ``track_steps[i] >= 0``: a track state is never after the accepted
  step (it would hold a rejected token);
* distinct destinations: no two requests share a slot, no two track copies share a
  track slot, and no track copy goes to a request's own slot.

Padding requests (out-of-range slots) are therefore not allowed in checked mode.

The checks are :mod:`jax.experimental.checkify` checks. Called eagerly they raise at once
(``checkify.JaxRuntimeError``). Under ``jax.jit`` a check must be functionalized::

    err, pool = checkify.checkify(jax.jit(step_fn))(pool, ...)
    err.throw()

(without it, JAX refuses to lower the check: "Cannot abstractly evaluate a checkify.check which
was not functionalized". JAX raises that when it lowers the caller's jit, outside this library,
so the message cannot name this fix.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import checkify

__all__ = ["check_steps", "check_commit"]

_LENGTHS_HINT = (
    "steps are 0-based (the last accepted draft step, -1 for none); "
    "an accepted length n is step n - 1: pass lengths - 1"
)


def _first(bad):
    """The index of the first True of a 1-D mask (0 if none)."""
    return jnp.argmax(bad)


def check_steps(fn: str, name: str, steps: jax.Array, D: int) -> None:
    """Every ``steps[i]`` in ``[-1, D)``; ``D`` itself with the lengths-vs-steps hint."""
    steps = jnp.asarray(steps)  # checkify takes JAX predicates only (indices may come as NumPy)
    is_len = steps == D
    i = _first(is_len)
    checkify.check(
        ~is_len.any(),
        f"{fn} (checked): request {{i}}: {name}[{{i}}] = {D} = D, the number of draft steps; {_LENGTHS_HINT}",
        i=i,
    )
    bad = (steps < -1) | (steps >= D)
    i = _first(bad)
    message = f"{fn} (checked): request {{i}}: {name}[{{i}}] = {{x}} is not in [-1, {D})"
    checkify.check(~bad.any(), message, i=i, x=steps[i])


def _check_range(fn: str, name: str, x: jax.Array, n: int, what: str, where=None) -> None:
    bad = (x < 0) | (x >= n)
    if where is not None:
        bad = bad & where
    i = _first(bad)
    checkify.check(
        ~bad.any(),
        f"{fn} (checked): request {{i}}: {name}[{{i}}] = {{x}} is not in [0, {n}) ({what}); it would be skipped",
        i=i,
        x=x[i],
    )


def _check_distinct(fn: str, a: jax.Array, b: jax.Array, ok: jax.Array, message: str) -> None:
    """No ``a[i] == b[j]`` where ``ok[i, j]``; the message gets the requests i, j and the slot."""
    n = a.shape[0]
    eq = (a[:, None] == b[None, :]) & ok
    flat = jnp.argmax(eq.ravel())
    i, j = flat // n, flat % n
    checkify.check(~eq.any(), f"{fn} (checked): {message}", i=i, j=j, s=a[i])


def check_commit(fn: str, S: int, R: int, D: int, slots, steps, track_slots, track_steps, rows) -> None:
    """The checked mode of commit (see the module docstring). Indices are ``[N]`` int32."""
    slots, steps, track_slots, track_steps, rows = map(jnp.asarray, (slots, steps, track_slots, track_steps, rows))
    N = slots.shape[0]
    if N == 0:
        return
    _check_range(fn, "slots", slots, S, "the pool's slots")
    _check_range(fn, "rows", rows, R, "the tape's rows")
    check_steps(fn, "steps", steps, D)
    check_steps(fn, "track_steps", track_steps, D)
    tracks = track_steps >= 0
    _check_range(fn, "track_slots", track_slots, S, "the pool's slots", where=tracks)
    late = tracks & (track_steps > steps)
    i = _first(late)
    checkify.check(
        ~late.any(),
        f"{fn} (checked): request {{i}}: track_steps[{{i}}] = {{t}} is after the accepted step steps[{{i}}] = {{a}}: "
        "the track state would hold a rejected token",
        i=i, t=track_steps[i], a=steps[i],
    )  # fmt: skip
    ar = jnp.arange(N)
    later = ar[:, None] < ar[None, :]
    _check_distinct(
        fn, slots, slots, later, "requests {i} and {j} have the same slot {s} (duplicate destination slots)"
    )
    _check_distinct(
        fn,
        track_slots,
        track_slots,
        later & tracks[:, None] & tracks[None, :],
        "requests {i} and {j} copy their track states to the same slot {s} (duplicate destination slots)",
    )
    _check_distinct(
        fn,
        track_slots,
        slots,
        tracks[:, None],
        "request {i} copies its track state to slot {s}, which is request {j}'s own slot (duplicate destination slots)",
    )
