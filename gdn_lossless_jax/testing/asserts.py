"""Bitwise assertions and independent NumPy oracles, for chex-based tests.

Bit-exactness is compared on bit patterns (``uint32`` views of float32, ``uint16`` of
bfloat16), never with tolerances: ``chex.assert_trees_all_equal`` treats ``NaN == NaN``
and ``+0 == -0``, which hides exactly the differences this library is about.

The oracles here share no code with the library: the fused multiply-add is computed in
float64 with round-to-odd (an f64 product of two f32 is exact; a sum rounded to odd in 53
bits and then to nearest in 24 bits is correctly rounded), in NumPy, which keeps
subnormals.
"""

from __future__ import annotations

from typing import Any

import chex
import jax
import numpy as np

__all__ = [
    "bits",
    "ulp_distance",
    "BitwiseReport",
    "compare_bitwise",
    "assert_bitwise_equal",
    "assert_trees_bitwise_equal",
    "assert_bitwise_differs",
    "fma_oracle",
    "mul_oracle",
    "replay_oracle",
    "ulp_stats",
]

_UINT_OF = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def bits(x) -> np.ndarray:
    """The bit pattern of a float array as an unsigned-integer NumPy array."""
    a = np.asarray(x)
    if a.dtype.kind not in "fV" and a.dtype.name != "bfloat16":
        return a
    return a.view(_UINT_OF[a.dtype.itemsize])


def _ordered(a: np.ndarray) -> np.ndarray:
    """Map float bits to integers in float order, with ``-0`` one below ``+0``."""
    if a.dtype.itemsize > 4:
        raise TypeError(f"ulp_distance supports 16- and 32-bit floats, got {a.dtype}")
    u = bits(a).astype(np.int64)
    sign = np.int64(1) << (a.dtype.itemsize * 8 - 1)
    return np.where(u >= sign, sign - u - 1, u)


def ulp_distance(a, b) -> np.ndarray:
    """Elementwise distance in units in the last place (0 where the bits are equal).

    ``+0`` and ``-0`` are 1 apart here, on purpose: they are different bit patterns.
    """
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype:
        raise TypeError(f"ulp_distance: dtypes differ ({a.dtype} vs {b.dtype})")
    return np.abs(_ordered(a) - _ordered(b))


class BitwiseReport:
    """The outcome of comparing two pytrees bit for bit."""

    def __init__(self, mismatches: list[str], leaves: int, max_ulp: int, differing: int):
        self.mismatches = mismatches
        self.leaves = leaves
        self.max_ulp = max_ulp
        self.differing = differing

    @property
    def equal(self) -> bool:
        return not self.mismatches

    def __str__(self) -> str:
        if self.equal:
            return f"bitwise equal ({self.leaves} leaves)"
        head = f"{len(self.mismatches)} of {self.leaves} leaves differ bitwise"
        return head + ":\n  " + "\n  ".join(self.mismatches)


def _leaf_name(path) -> str:
    return jax.tree_util.keystr(path) or "<root>"


def _leaf_mismatch(e, a) -> tuple[str, int, int] | None:
    """None if two arrays are bitwise equal; else (message, differing elements, largest ULP)."""
    e, a = np.asarray(e), np.asarray(a)
    if e.shape != a.shape or e.dtype != a.dtype:
        return f"expected {e.dtype}{list(e.shape)}, got {a.dtype}{list(a.shape)}", 0, 0
    diff = bits(e) != bits(a)
    n = int(diff.sum())
    if not n:
        return None
    idx = np.unravel_index(int(np.argmax(diff)), e.shape) if e.ndim else ()
    msg = (
        f"{n} of {e.size} elements differ; first at index {tuple(int(i) for i in idx)}: "
        f"expected {e[idx]!s} (0x{int(bits(e)[idx]):x}), got {a[idx]!s} (0x{int(bits(a)[idx]):x})"
    )
    ulp = 0
    if e.dtype.kind == "f" or e.dtype.name == "bfloat16":
        ulp = int(ulp_distance(e, a).max())
        msg += f"; largest distance {ulp} ULP"
    return msg, n, ulp


def compare_bitwise(expected: Any, actual: Any) -> BitwiseReport:
    """Compare two pytrees leaf by leaf on bit patterns; see :func:`assert_bitwise_equal`."""
    e_leaves, e_tree = jax.tree_util.tree_flatten_with_path(expected)
    a_leaves, a_tree = jax.tree_util.tree_flatten_with_path(actual)
    if e_tree != a_tree:
        return BitwiseReport([f"tree structures differ: {e_tree} vs {a_tree}"], len(e_leaves), 0, 0)
    mismatches, max_ulp, differing = [], 0, 0
    for (path, e), (_, a) in zip(e_leaves, a_leaves):
        found = _leaf_mismatch(e, a)
        if found is None:
            continue
        msg, n, ulp = found
        mismatches.append(f"{_leaf_name(path)}: {msg}")
        differing += n
        max_ulp = max(max_ulp, ulp)
    return BitwiseReport(mismatches, len(e_leaves), max_ulp, differing)


def assert_bitwise_equal(expected: Any, actual: Any, msg: str = "") -> None:
    """Assert that two pytrees have the same structure, shapes, dtypes and bit patterns.

    On failure the message names each mismatching leaf, how many elements differ, the
    first mismatching index with both values and bit patterns, and the largest ULP
    distance.
    """
    report = compare_bitwise(expected, actual)
    if not report.equal:
        raise AssertionError((msg + ": " if msg else "") + str(report))


def assert_trees_bitwise_equal(*trees: Any) -> None:
    """Assert that all trees equal the first one bit for bit: chex's
    ``assert_trees_all_equal``, on bit patterns.

    Named and reported as chex does (it is built on
    ``chex.assert_trees_all_equal_comparator``, so ``chex.disable_asserts`` turns it off
    too): on failure, ``Trees 0 and 1 differ in leaves 'u': 2 of 6 elements differ; first
    at index (0, 1): expected 1.0 (0x3f800000), got 1.0000002 (0x3f800002); largest distance
    2 ULP.`` Unlike ``chex.assert_trees_all_equal``, ``+0`` and ``-0`` differ, and so do NaNs
    with different payloads; shapes and dtypes must match exactly.

    Args:
      *trees: at least two pytrees of arrays with one structure.
    Raises:
      AssertionError: naming the first tree and leaf that differ.
    """
    chex.assert_trees_all_equal_comparator(
        lambda e, a: _leaf_mismatch(e, a) is None, lambda e, a: _leaf_mismatch(e, a)[0], *trees
    )


def assert_bitwise_differs(expected: Any, actual: Any, msg: str = "") -> BitwiseReport:
    """Assert that two pytrees differ somewhere bitwise (for controls); returns the report."""
    report = compare_bitwise(expected, actual)
    if report.equal:
        raise AssertionError((msg + ": " if msg else "") + "expected a bitwise difference, found none")
    return report


def ulp_stats(reference, other) -> dict[str, float]:
    """Summary of the ULP distances of ``other`` from ``reference`` (float arrays)."""
    d = ulp_distance(np.asarray(reference), np.asarray(other)).astype(np.float64).ravel()
    return {
        "elements": int(d.size),
        "differing": int((d > 0).sum()),
        "fraction": float((d > 0).mean()) if d.size else 0.0,
        "max_ulp": int(d.max()) if d.size else 0,
        "mean_ulp": float(d.mean()) if d.size else 0.0,
    }


# ---------------------------------------------------------------------------------
# Oracles (NumPy, float64 round-to-odd).
# ---------------------------------------------------------------------------------
def fma_oracle(a, b, c) -> np.ndarray:
    """``rn(a * b + c)`` for float32 inputs, exactly, in NumPy (float64 round-to-odd)."""
    with np.errstate(all="ignore"):  # NaN/inf inputs are part of the domain
        a, b, c = (np.asarray(x, np.float32).astype(np.float64) for x in (a, b, c))
        p = a * b  # exact: 24 + 24 bits < 53
        s = p + c
        bb = s - p
        err = (p - (s - bb)) + (c - bb)  # TwoSum: p + c == s + err exactly
        sb = s.view(np.uint64)
        inexact = np.isfinite(s) & (err != 0) & ((sb & np.uint64(1)) == 0)
        toward_larger = np.signbit(err) == np.signbit(s)
        step = np.where(toward_larger, np.uint64(1), np.uint64(0) - np.uint64(1))
        odd = np.where(inexact, sb + step, sb).view(np.float64)
        return odd.astype(np.float32)


def mul_oracle(x, y) -> np.ndarray:
    """``rn(x * y)`` in float32 (NumPy keeps subnormals)."""
    with np.errstate(all="ignore"):
        return np.asarray(x, np.float32) * np.asarray(y, np.float32)


def replay_oracle(state0, u, k, alpha, steps, *, heads_per_group: int | None = None) -> np.ndarray:
    """The replay rule in NumPy: ``S_t = fma(k_t, u_t, rn(S_{t-1} * alpha_t))``.

    Args:
      state0: ``[N, HV, V, K]`` float32 (or bfloat16: upcast, and the result rounded back).
      u: ``[N, D, HV, V]`` float32; k: ``[N, D, H, K]`` float32.
      alpha: ``[N, D, HV]`` float32, the decay ``exp(g)`` *as the library computed it*
        (the oracle checks the rounding rule, not the exponential); ``[N, D, HV, K]`` for a
        per-channel decay (KDA): column c of the state decays by ``alpha[..., c]``.
      steps: ``[N]`` int, the 0-based step to stop after; negative or >= D: no step.
    Returns:
      ``[N, HV, V, K]`` in state0's dtype.
    """
    state0 = np.asarray(state0)
    S = state0.astype(np.float32).copy()
    u, k, alpha = (np.asarray(x, np.float32) for x in (u, k, alpha))
    N, D, HV, _ = u.shape
    r = heads_per_group or HV // k.shape[2]
    for n in range(N):
        last = int(steps[n])
        if not 0 <= last < D:
            continue
        for t in range(last + 1):
            for hv in range(HV):
                Sd = mul_oracle(S[n, hv], alpha[n, t, hv])
                S[n, hv] = fma_oracle(k[n, t, hv // r][None, :], u[n, t, hv][:, None], Sd)
    return S.astype(state0.dtype)
