"""Rounding forms on one state element at a time, the platform probe, the library's exp, where two
forms disagree, and a tape replayed with each form (:mod:`gdn_lossless_jax.tools.viz`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ...testing import controls
from ... import rounding
from ...tape import Tuples
from ...testing import bits, ulp_distance

__all__ = ["FORM_LABELS", "REGIMES", "Disagreements", "evaluate_forms", "match_forms", "probe_platform",
           "probe_two_uses", "format_table", "exp_grid", "exp_on", "regime_inputs", "find_disagreements",
           "disagreement_map", "decay_sweep", "replay_states", "drift_along_chain", "ulp_histogram"]


F32 = np.float32

#: How each named form rounds, in words (the keys of :data:`gdn_lossless_jax.testing.controls.FORMS`).
FORM_LABELS: dict[str, str] = {
    "rule": "fma(k, u, rn(S*alpha)): the rule",
    "naive": "S*alpha + k*u as written: the compiler decides",
    "twice_rounded": "rn(rn(S*alpha) + rn(k*u))",
    "other_product": "fma(S, alpha, rn(k*u))",
}

# The forms whose rounding is pinned (the naive one is whatever the compiler made of it).
_PINNED = ("rule", "twice_rounded", "other_product")


# ---------------------------------------------------------------------------------
# The forms on flat inputs: one state element per entry.
# ---------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames="name")
def _form_flat(S, alpha, k, u, *, name: str):
    # The inputs are arguments, never closed-over constants: XLA would fold them (alpha == 1
    # turns S*alpha into S) and the compiled form would not be the one a replay runs.
    return controls.FORMS[name](S[:, None, None], alpha, k[:, None], u[:, None])[:, 0, 0]


def _flat_inputs(fn: str, S, alpha, k, u):
    arrs = [np.asarray(x, F32) for x in (S, alpha, k, u)]
    shapes = {a.shape for a in arrs}
    if len(shapes) != 1 or arrs[0].ndim != 1:
        got = ", ".join(f"{n} {list(a.shape)}" for n, a in zip(("S", "alpha", "k", "u"), arrs))
        raise ValueError(f"{fn}: arguments S, alpha, k, u must be flat float32 arrays of one shape [n], got {got}")
    return arrs


def evaluate_forms(S, alpha, k, u, forms: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """Each named form of :data:`gdn_lossless_jax.testing.controls.FORMS` on one state element per entry.

    Args:
      S, alpha, k, u: float32 arrays ``[n]``: the state element, its decay ``exp(g)``, the key
        element and the ``u`` element of one update each.
      forms: names to evaluate (default: all of them).
    Returns:
      ``{name: S' [n] float32}``, each computed under ``jax.jit`` on the default device.
    """
    S, alpha, k, u = _flat_inputs("evaluate_forms", S, alpha, k, u)
    names = list(controls.FORMS if forms is None else forms)
    for n in names:
        if n not in controls.FORMS:
            raise ValueError(f"evaluate_forms: unknown form {n!r}; known forms: {', '.join(controls.FORMS)}")
    return {n: np.asarray(_form_flat(S, alpha, k, u, name=n)) for n in names}


def match_forms(result, S, alpha, k, u) -> dict[str, float]:
    """The fraction of entries where ``result [n]`` equals each pinned form bit for bit
    (``rule``, ``twice_rounded``, ``other_product``)."""
    pinned = evaluate_forms(S, alpha, k, u, _PINNED)
    r = bits(np.asarray(result, F32))
    return {n: float(np.mean(bits(v) == r)) for n, v in pinned.items()}


def _verdict(matches: Mapping[str, float]) -> str:
    exact = [n for n, f in matches.items() if f == 1.0]
    if exact:
        return FORM_LABELS[exact[0]]
    parts = ", ".join(f"{n} {100 * f:.0f}%" for n, f in matches.items() if f > 0)
    return f"no single form ({parts or 'none matches'})"


# ---------------------------------------------------------------------------------
# The platform probe.
# ---------------------------------------------------------------------------------
_EXPRESSIONS: dict[str, Callable] = {
    "S*alpha + k*u": lambda S, a, k, u: S * a + k * u,
    "k*u + S*alpha": lambda S, a, k, u: k * u + S * a,
}


def _pallas(expr: Callable) -> Callable:
    from jax.experimental import pallas as pl

    def kernel(s_ref, a_ref, k_ref, u_ref, o_ref):
        o_ref[...] = expr(s_ref[...], a_ref[...], k_ref[...], u_ref[...])

    interpret = jax.default_backend() == "cpu"  # compiled on a GPU, interpreted (by XLA) on the CPU
    return lambda *xs: pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(xs[0].shape, jnp.float32),
                                      interpret=interpret)(*xs)  # fmt: skip


def _contexts(expr: Callable) -> dict[str, Callable]:
    def scan(S, a, k, u):  # the expression as a loop body, where replays run it
        return lax.scan(lambda c, x: (c, expr(*x)), 0.0, (S, a, k, u))[1]

    return {
        "eager (op by op)": expr,
        "jax.jit": jax.jit(expr),
        "lax.scan body under jit": jax.jit(scan),
        "Pallas kernel" + (" (interpret mode)" if jax.default_backend() == "cpu" else ""): _pallas(expr),
    }


def _probe_inputs(samples: int, seed: int):
    """Normal-range inputs on which the three pinned forms give three different results (so one
    comparison tells which form a compiled expression is), tiled to ``samples`` entries."""
    rng = np.random.default_rng(seed)
    n = 40 * samples
    S = rng.standard_normal(n, F32)
    alpha = rng.uniform(0.5, 1.0, n).astype(F32)
    k = (0.1 * rng.standard_normal(n)).astype(F32)
    u = rng.standard_normal(n, F32)
    f = evaluate_forms(S, alpha, k, u, _PINNED)
    b = {name: bits(v) for name, v in f.items()}
    r, t, o = b["rule"], b["twice_rounded"], b["other_product"]
    keep = (r != t) & (r != o) & (t != o)
    idx = np.resize(np.nonzero(keep)[0], samples)  # a power of two: Pallas on a GPU needs one
    return S[idx], alpha[idx], k[idx], u[idx]


def _subnormal_verdict(fn: Callable) -> str:
    # S*alpha with a subnormal product (1e-20 * 1e-20), or a subnormal input (1e-40 * 1); k*u = 0.
    n = 128
    S = np.resize(np.array([1e-20, 1e-40, 3e-39, -2e-20], F32), n)
    a = np.resize(np.array([1e-20, 1.0, 0.5, 3e-19], F32), n)
    z = np.zeros(n, F32)
    got = np.asarray(fn(S, a, z, z))
    want = (S.astype(np.float64) * a).astype(F32)
    if np.array_equal(bits(got), bits(want)):
        return "kept"
    if np.all(got == 0):
        return "flushed to zero"
    return "partly flushed"


def probe_platform(samples: int = 1024, seed: int = 0) -> dict:
    """What the current platform does with ``S*alpha + k*u`` written plainly.

    The expression (and its mirror ``k*u + S*alpha``) runs eagerly, under ``jax.jit``, as a
    ``lax.scan`` body and in a Pallas kernel (interpret mode on a CPU), on ``samples`` inputs
    where the three pinned forms all differ; each result is matched bit for bit against
    them. A third column says whether subnormal products and inputs survive a multiply.

    Returns:
      ``{"platform", "device", "jax", "rows": [{"context", "S*alpha + k*u", "k*u + S*alpha",
      "subnormals"}], "matches": {context: {expression: {form: fraction}}}, "two_uses":
      probe_two_uses()}`` (JSON-ready).
    """
    S, a, k, u = _probe_inputs(samples, seed)
    rows, matches = [], {}
    by_context: dict[str, dict[str, Callable]] = {}
    for name, expr in _EXPRESSIONS.items():
        for context, fn in _contexts(expr).items():
            by_context.setdefault(context, {})[name] = fn
    for context, fns in by_context.items():
        row = {"context": context}
        matches[context] = {}
        for name, fn in fns.items():
            m = match_forms(np.asarray(fn(*map(jnp.asarray, (S, a, k, u)))), S, a, k, u)
            matches[context][name] = m
            row[name] = _verdict(m)
        row["subnormals"] = _subnormal_verdict(lambda *xs: fns["S*alpha + k*u"](*map(jnp.asarray, xs)))
        rows.append(row)
    dev = jax.devices()[0]
    return {"platform": jax.default_backend(), "device": dev.device_kind, "jax": jax.__version__, "rows": rows,
            "matches": matches, "two_uses": probe_two_uses()}  # fmt: skip


_PROGRAMS: dict[str, tuple[bool, Callable]] = {
    # (computes u itself, update): verify's step as GDN kernels write it, where the decayed state
    # Sd has two uses (the delta's reduction and the update), and a replay that is given u.
    "verify: Sd = S*alpha; u = beta*(v - Sd@k); Sd + k*u": (True, lambda Sd, k, u: Sd + k * u),
    "verify: Sd = S*alpha; u = beta*(v - Sd@k); k*u + Sd": (True, lambda Sd, k, u: k * u + Sd),
    "replay: S*alpha + k*u (u from the tape)": (False, None),
    "replay: k*u + S*alpha (u from the tape)": (False, None),
}


def _program(name: str) -> Callable:
    computes_u, update = _PROGRAMS[name]

    def run(S, alpha, k, v, beta, u):
        a = alpha[:, None, None]
        if computes_u:
            Sd = S * a
            u = beta[:, None] * (v - jnp.sum(Sd * k[:, None, :], axis=-1))
            return update(Sd, k[:, None, :], u[:, :, None]), u
        if name.startswith("replay: S*alpha"):
            return S * a + k[:, None, :] * u[:, :, None], u
        return k[:, None, :] * u[:, :, None] + S * a, u

    return jax.jit(run)


@functools.partial(jax.jit, static_argnames="name")
def _form_state(S, alpha, k, u, *, name: str):
    return controls.FORMS[name](S, alpha, k, u)


def probe_two_uses(heads: int = 64, dim: int = 32, seed: int = 0) -> list[dict]:
    """Which pinned form the state update becomes when it is written plainly, on this platform,
    in verify (the decayed state ``Sd = S*alpha`` has two uses: the delta ``u = beta*(v - Sd@k)``
    and the update) and in a replay (``u`` comes from the tape: ``S*alpha`` has one use).

    Each program is jitted with its inputs as arguments (``heads`` states ``[dim, dim]``); its
    new state is matched bit for bit against the pinned forms applied to the same ``S, alpha,
    k`` and the ``u`` the program itself used. Returns rows ``{"program", "form", "matches"}``.
    """
    rng = np.random.default_rng(seed)
    S = rng.standard_normal((heads, dim, dim), F32)
    alpha = rng.uniform(0.5, 1.0, heads).astype(F32)
    k = rng.standard_normal((heads, dim), F32)
    k = (k / np.linalg.norm(k, axis=-1, keepdims=True)).astype(F32)
    v = rng.standard_normal((heads, dim), F32)
    beta = rng.uniform(0.2, 1.0, heads).astype(F32)
    u0 = rng.standard_normal((heads, dim), F32)
    rows = []
    for name in _PROGRAMS:
        new, u = _program(name)(*map(jnp.asarray, (S, alpha, k, v, beta, u0)))
        got = bits(np.asarray(new))
        m = {f: float(np.mean(bits(np.asarray(_form_state(S, alpha, k, u, name=f))) == got)) for f in _PINNED}
        rows.append({"program": name, "form": _verdict(m), "matches": m})
    return rows


def format_table(rows: Sequence[Mapping], columns: Sequence[str] | None = None) -> str:
    """A Markdown table of dicts (the keys of the first row, or ``columns``)."""
    if not rows:
        return "(no rows)"
    cols = list(columns or rows[0].keys())
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------
# exp on each platform.
# ---------------------------------------------------------------------------------
def exp_grid(n: int = 1 << 16) -> np.ndarray:
    """``n`` log-decays ``g`` from ``-1e-9`` to ``-104`` (log-spaced), float32: every decay
    regime, from ``exp(g) == 1`` to subnormal decays. Deterministic (no random draw), so that a
    recorded result of one platform can be compared with another's bit for bit."""
    return (-np.logspace(-9, np.log10(104.0), n)).astype(F32)


def exp_on(g, platform: str | None = None, *, library: bool = True) -> np.ndarray:
    """``exp(g)`` in float32, under ``jax.jit``.

    Args:
      g: float32 log-decays.
      platform: ``"cpu"``, ``"gpu"``, ...; default: the default backend.
      library: ``True``: :func:`gdn_lossless_jax.rounding.exp`, the ``exp`` verify and replay
        call (on the CPU, float64 ``exp`` rounded once; on a GPU, libdevice's); only on the
        default backend, where it runs. ``False``: XLA's own ``jnp.exp`` on ``platform``.
    Raises:
      RuntimeError naming the platform when there is no such device, or when ``library`` asks
      for another platform than the default backend.
    """
    here = jax.default_backend()
    try:
        dev = jax.devices(platform)[0] if platform else jax.devices()[0]
    except RuntimeError as e:
        raise RuntimeError(f"exp_on: no {platform!r} device here (JAX's default backend: {here})") from e
    if library and dev.platform != here:
        raise RuntimeError(f"exp_on: the library's exp runs on the default backend ({here}), not on {platform!r}; "
                           "pass library=False for XLA's exp there")  # fmt: skip
    x = jax.device_put(jnp.asarray(np.asarray(g, F32)), dev)
    return np.asarray(jax.jit(rounding.exp if library else jnp.exp)(x))


# ---------------------------------------------------------------------------------
# Where the forms disagree.
# ---------------------------------------------------------------------------------
def _signed(rng, n, lo_exp, hi_exp):
    """Random float32 with random sign, mantissa, and binary exponent in ``[lo_exp, hi_exp)``."""
    e = rng.uniform(lo_exp, hi_exp, n)
    return (rng.choice([-1.0, 1.0], n) * np.exp2(e)).astype(F32)


def _regime_normal(rng, n):
    return rng.standard_normal(n, F32), np.exp(-rng.uniform(0, 1, n)).astype(F32), \
        (rng.standard_normal(n) / np.sqrt(128)).astype(F32), rng.standard_normal(n, F32)  # fmt: skip


def _regime_cancellation(rng, n):
    S, alpha, k, _ = _regime_normal(rng, n)
    # k*u within a relative 1e-6 of -S*alpha: the sum keeps only the low bits of the products.
    u = (-(S.astype(np.float64) * alpha) / k * (1 + 1e-6 * rng.standard_normal(n))).astype(F32)
    return S, alpha, k, u


def _regime_subnormal(rng, n):
    S = _signed(rng, n, -130, -120)  # S*alpha lands among the subnormals (below 2**-126)
    alpha = rng.uniform(0.01, 1.0, n).astype(F32)
    k = (rng.standard_normal(n) / np.sqrt(128)).astype(F32)
    u = _signed(rng, n, -135, -120)
    return S, alpha, k, u


def _regime_decay(lo, hi, *, scale_u: bool):
    def sample(rng, n):
        S, _, k, u = _regime_normal(rng, n)
        g = -np.exp(rng.uniform(np.log(lo), np.log(hi), n)).astype(F32)
        alpha = exp_on(g)
        if scale_u:  # a k*u as small as the decayed state, else the update alone decides
            u = (u * np.maximum(alpha, np.finfo(F32).smallest_subnormal) * 8).astype(F32)
        return S, alpha, k, u

    return sample


#: Named input regimes, ``sampler(rng, n) -> (S, alpha, k, u)``, flat float32 ``[n]``.
REGIMES: dict[str, Callable] = {
    "normal": _regime_normal,
    "cancellation": _regime_cancellation,
    "subnormal": _regime_subnormal,
    "decay near 0": _regime_decay(20.0, 104.0, scale_u=True),  # exp(g) from 2e-9 down to the subnormals
    "decay near 1": _regime_decay(1e-9, 1e-5, scale_u=False),  # exp(g) within a few ulp of 1, or exactly 1
}


def regime_inputs(regime: str, n: int, seed: int = 0):
    """``(S, alpha, k, u)``, flat float32 ``[n]``, drawn from a :data:`REGIMES` regime."""
    if regime not in REGIMES:
        raise ValueError(f"regime_inputs: unknown regime {regime!r}; known regimes: {', '.join(REGIMES)}")
    return REGIMES[regime](np.random.default_rng(seed), n)


@dataclasses.dataclass(frozen=True)
class Disagreements:
    """What :func:`find_disagreements` found: ``differing`` of ``tried`` entries differ, and
    the ``examples`` (dicts of the inputs, both results and their ULP distance) that differ most."""

    regime: str
    form_a: str
    form_b: str
    tried: int
    differing: int
    max_ulp: int
    examples: list[dict]

    def __str__(self) -> str:
        share = 100 * self.differing / max(self.tried, 1)
        lines = [f"{self.form_a} vs {self.form_b}, regime {self.regime!r}: {self.differing:,} of {self.tried:,} "
                 f"inputs differ ({share:.2f}%), max {self.max_ulp:,} ULP"]  # fmt: skip
        for e in self.examples:
            hx = lambda v: f"{float(v):.9g} (0x{int(bits(np.float32(v))):08x})"  # noqa: E731
            lines.append(
                f"  S={float(e['S']):.9g} alpha={float(e['alpha']):.9g} k={float(e['k']):.9g} u={float(e['u']):.9g}:"
                f" {self.form_a} {hx(e['a'])}, {self.form_b} {hx(e['b'])}, {e['ulp']:,} ULP"
            )
        return "\n".join(lines)


def find_disagreements(
    form_a: str = "rule", form_b: str = "naive", *, regime: str = "cancellation", n: int = 100_000, seed: int = 0,
    limit: int = 3,
) -> Disagreements:  # fmt: skip
    """Draw ``n`` inputs of a regime and keep those where two forms give different bits.

    Returns a :class:`Disagreements` with the ``limit`` examples of largest ULP distance.
    """
    S, alpha, k, u = regime_inputs(regime, n, seed)
    r = evaluate_forms(S, alpha, k, u, (form_a, form_b))
    a, b = r[form_a], r[form_b]
    d = ulp_distance(a, b)
    order = np.argsort(-d, kind="stable")[: max(int(np.sum(d > 0)), 0)][:limit]
    ex = [dict(S=S[i], alpha=alpha[i], k=k[i], u=u[i], a=a[i], b=b[i], ulp=int(d[i])) for i in order]
    return Disagreements(regime, form_a, form_b, n, int(np.sum(d > 0)), int(d.max(initial=0)), ex)


def disagreement_map(
    form: str = "naive", reference: str = "rule", *, s_exponents: Sequence[int] = tuple(range(-140, 21, 5)),
    u_exponents: Sequence[int] = tuple(range(-140, 21, 5)), samples: int = 64, seed: int = 0,
) -> dict:  # fmt: skip
    """Where on the number line ``form`` differs from ``reference``: a grid over the binary
    exponents of the state ``|S|`` and of ``|u|``.

    Each cell draws ``samples`` updates with ``|S|`` in ``[2**e_s, 2**(e_s+1))``, ``|u|`` in
    ``[2**e_u, 2**(e_u+1))``, random signs (half the cells' samples cancel), a decay
    ``alpha`` in ``[0.5, 1)`` and a key element of a unit key of 128 (``|k|`` about 0.09).

    Returns:
      ``{"s_exponents", "u_exponents", "fraction", "max_ulp", "mean_ulp"}``: the last three
      ``[len(s_exponents), len(u_exponents)]`` arrays (fraction of samples that differ).
    """
    rng = np.random.default_rng(seed)
    es, eu = np.asarray(s_exponents), np.asarray(u_exponents)
    shape = (len(es), len(eu), samples)
    grid_s = np.broadcast_to(es[:, None, None], shape) + rng.uniform(0, 1, shape)
    grid_u = np.broadcast_to(eu[None, :, None], shape) + rng.uniform(0, 1, shape)
    sign = lambda: rng.choice([-1.0, 1.0], shape)  # noqa: E731
    S = (sign() * np.exp2(grid_s)).astype(F32).ravel()
    u = (sign() * np.exp2(grid_u)).astype(F32).ravel()
    alpha = rng.uniform(0.5, 1.0, S.size).astype(F32)
    k = (rng.standard_normal(S.size) / np.sqrt(128)).astype(F32)
    r = evaluate_forms(S, alpha, k, u, (form, reference))
    d = ulp_distance(r[reference], r[form]).reshape(shape).astype(np.float64)
    return {"form": form, "reference": reference, "s_exponents": es, "u_exponents": eu,
            "fraction": (d > 0).mean(-1), "max_ulp": d.max(-1), "mean_ulp": d.mean(-1)}  # fmt: skip


def decay_sweep(
    forms: Sequence[str] = ("naive", "twice_rounded", "other_product"), reference: str = "rule", *,
    neg_g: Sequence[float] | None = None, samples: int = 512, seed: int = 0,
) -> dict:  # fmt: skip
    """How often each form differs from ``reference`` as the decay ``alpha = exp(g)`` goes
    from exactly 1 (``-g`` below 6e-8) to subnormal (``-g`` above 87) and zero (above 104).

    Args:
      neg_g: the values of ``-g`` (default: 120 log-spaced from 1e-9 to 110).
    Returns:
      ``{"neg_g", "alpha", "fraction": {form: [len(neg_g)]}, "max_ulp": {form: [...]}}``.
    """
    ng = np.logspace(-9, np.log10(110.0), 120) if neg_g is None else np.asarray(neg_g, np.float64)
    rng = np.random.default_rng(seed)
    S, _, k, u = _regime_normal(rng, ng.size * samples)
    alpha = exp_on(np.repeat(-ng.astype(F32), samples))
    r = evaluate_forms(S, alpha, k, u, (*forms, reference))
    out = {"neg_g": ng, "alpha": alpha[::samples], "reference": reference, "fraction": {}, "max_ulp": {}}
    for f in forms:
        d = ulp_distance(r[reference], r[f]).reshape(ng.size, samples)
        out["fraction"][f] = (d > 0).mean(-1)
        out["max_ulp"][f] = d.max(-1)
    return out


# ---------------------------------------------------------------------------------
# Replay chains.
# ---------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames="form")
def _replay_states(state0, u, k, g, *, form: str):
    HV = u.shape[2]
    k = jnp.repeat(k, HV // k.shape[2], axis=2)  # v-head hv reads q/k head hv // (HV // H)

    def body(S, x):
        u_t, k_t, g_t = x
        S = controls.FORMS[form](S, rounding.exp(g_t), k_t, u_t)
        return S, S

    xs = tuple(jnp.moveaxis(t, 1, 0) for t in (u, k, g))
    _, states = lax.scan(body, state0.astype(jnp.float32), xs)
    return jnp.moveaxis(states, 0, 1).astype(state0.dtype)


def replay_states(state0: jax.Array, tuples: Tuples, form: str = "rule") -> jax.Array:
    """The state after every step of a tape, replayed with a named form.

    Args:
      state0: ``[N, HV, V, K]`` float32 or bfloat16, the pre-verify states.
      tuples: one layer's tape (``u [N, D, HV, V]``, ``k [N, D, H, K]``, ``g [N, D, HV]``).
      form: a key of :data:`gdn_lossless_jax.testing.controls.FORMS`.
    Returns:
      ``[N, D, HV, V, K]`` in state0's dtype: with ``"rule"``, verify's snapshots bit for bit.
    """
    if form not in controls.FORMS:
        raise ValueError(f"replay_states: unknown form {form!r}; known forms: {', '.join(controls.FORMS)}")
    return _replay_states(state0, tuples.u, tuples.k, tuples.g, form=form)


def drift_along_chain(
    state0: jax.Array, tuples: Tuples, exact: jax.Array, forms: Iterable[str] | None = None
) -> dict[str, dict[str, np.ndarray]]:
    """ULP distance of each form's replay from the exact states, step by step.

    Args:
      state0, tuples: as for :func:`replay_states`.
      exact: ``[N, D, HV, V, K]``, the exact states (verify's snapshots).
      forms: names of :data:`gdn_lossless_jax.testing.controls.FORMS` (default: all).
    Returns:
      ``{form: {"max_ulp", "mean_ulp", "fraction"}}``, each ``[D]`` (over requests and
      elements; ULP of the state's dtype).
    """
    exact = np.asarray(exact)
    out = {}
    for f in controls.FORMS if forms is None else forms:
        d = ulp_distance(exact, np.asarray(replay_states(state0, tuples, f))).astype(np.float64)
        d = np.moveaxis(d, 1, 0).reshape(d.shape[1], -1)
        out[f] = {"max_ulp": d.max(-1), "mean_ulp": d.mean(-1), "fraction": (d > 0).mean(-1)}
    return out


def ulp_histogram(distances) -> tuple[list[str], np.ndarray]:
    """Counts of ULP distances in bins ``0, 1, 2, 3-4, 5-8, ..., 2**(j-1)+1 - 2**j``.

    Returns ``(labels, counts)``.
    """
    d = np.asarray(distances).ravel().astype(np.int64)
    top = max(int(d.max(initial=0)), 1)
    edges = [0, 1, 2] + [2**j for j in range(2, max(int(np.ceil(np.log2(top))), 1) + 1)]
    labels, counts = [], []
    lo = 0
    for hi in edges:
        labels.append(str(hi) if hi == lo else f"{lo}-{hi}")
        counts.append(int(np.sum((d >= lo) & (d <= hi))))
        lo = hi + 1
    return labels, np.asarray(counts)
