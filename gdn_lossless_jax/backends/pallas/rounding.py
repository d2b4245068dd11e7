"""The rule's two primitives inside a Pallas kernel: PTX on CUDA, AMDGCN on ROCm, or the portable form.

``"ptx"`` pins them with ``elementwise_inline_asm`` (``mul.rn.f32``, ``fma.rn.f32``): one
instruction each, which no compiler pass can contract or reorder. ``"amdgcn"`` does the same
on ROCm with ``v_mul_f32`` and ``v_fma_f32`` (``"v"`` registers): both round once to nearest
even, and the kernel keeps float32 denormals (its descriptor's ``float_denorm_mode_32`` is 3);
the compiled assembly for gfx942 and gfx950 shows the two instructions and nothing else
rounding the update (``tools/amdgcn.py``, ``tests/test_rocm_isa.py``). Never run: no AMD GPU was
available, and on ROCm XLA's own Triton compiles the kernel, not the one that assembly came from.
``"portable"`` uses :func:`gdn_lossless_jax.rounding.mul_rn` / ``fma_rn`` (integer operations
on the bit patterns, ~290 instructions a step on gfx942): it lowers in Pallas Triton on any GPU
and in interpret mode on a CPU, and stays the fallback on ROCm (``form="portable"``). All are
exact, so they give the same bits (PTX against portable checked on a GPU).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from ... import rounding

__all__ = ["Ops", "FORMS", "ISAS", "CONTROL_FORMS", "COMPILER_FORMS", "ops", "replay_update", "default_form"]


class Ops(NamedTuple):
    mul: Callable  # rn(x * y)
    fma: Callable  # rn(a * b + c)


def _asm(instr: str, n_args: int, reg: str = "f", end: str = ";") -> Callable:
    from jax.experimental.pallas import triton as plgpu

    operands = ", ".join(f"${i}" for i in range(n_args + 1))
    constraints = ",".join([f"={reg}"] + [reg] * n_args)

    def op(*args):
        shape = jnp.broadcast_shapes(*(jnp.shape(x) for x in args))
        args = [jnp.broadcast_to(jnp.asarray(x, jnp.float32), shape) for x in args]
        (out,) = plgpu.elementwise_inline_asm(
            f"{instr} {operands}{end}",
            args=args,
            constraints=constraints,
            pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float32)],
        )
        return out

    return op


def _ptx() -> Ops:
    return Ops(mul=_asm("mul.rn.f32", 2), fma=_asm("fma.rn.f32", 3))


def _amdgcn() -> Ops:
    # AMDGPU assembly: "v" is a 32-bit vector register; ";" would start a comment.
    return Ops(mul=_asm("v_mul_f32", 2, "v", ""), fma=_asm("v_fma_f32", 3, "v", ""))


def _portable() -> Ops:
    # The primal functions, without the public ones' custom_jvp: a kernel is never
    # differentiated, and Pallas Triton's lowering of a custom_jvp call rejects closed-over constants.
    return Ops(mul=rounding._mul_rn, fma=rounding._fma_rn)


#: How a backend pins the rule, in every backend's words: ``"pinned"``, the platform's own
#: instructions (here PTX on CUDA, AMDGCN on ROCm: :data:`ISAS`), or ``"portable"``, the integer form.
FORMS = ("pinned", "portable")
#: The instruction sets of the pinned form, which a caller may name to pick one explicitly (the
#: AMDGCN listings are compiled on a host without an AMD GPU: ``tools/amdgcn.py``).
ISAS = ("ptx", "amdgcn")
#: Forms that break the rule on purpose, for the controls of tests, each wrong by construction
#: (every operation pinned with the platform form's instructions): ``twice_rounded`` rounds the
#: update's product on its own, ``rn(rn(S * alpha) + rn(k * u))``; ``other_product`` fuses the
#: other product, ``fma(S, alpha, rn(k * u))``.
CONTROL_FORMS = ("twice_rounded", "other_product")
#: ``naive``: the update written as one expression, ``S * alpha + k * u``, rounded as the
#: compiler decides (Pallas Triton rounds twice; XLA:CPU in interpret mode contracted the other
#: product up to jax 0.12.0 and the rule's own product from 0.12.1 on). A measurement of the
#: compiler, never a control.
COMPILER_FORMS = ("naive",)


def ops(form: str) -> Ops:
    if form == "ptx":
        return _ptx()
    if form == "amdgcn":
        return _amdgcn()
    if form == "portable":
        return _portable()
    raise ValueError(f"pallas rounding form must be one of {ISAS + ('portable',)}, got {form!r}")


def replay_update(form: str, control: str | None = None) -> Callable:
    """``(S [BV, K], alpha, k [1, K], u [BV]) -> S'``: the rule with ``form``'s instructions, or,
    with ``control`` (:data:`CONTROL_FORMS`, :data:`COMPILER_FORMS`), a form that breaks it."""
    if control == "naive":
        return lambda S, alpha, k, u: S * alpha + k * u[:, None]
    mul, fma = ops(form)
    if control is None:
        return lambda S, alpha, k, u: fma(k, u[:, None], mul(S, alpha))
    if control == "twice_rounded":  # rn(Sd + rn(k u)): the add pinned as fma(x, 1, y)
        return lambda S, alpha, k, u: fma(mul(k, u[:, None]), jnp.float32(1.0), mul(S, alpha))
    if control == "other_product":
        return lambda S, alpha, k, u: fma(S, alpha, mul(k, u[:, None]))
    raise ValueError(f"pallas: control form must be one of {CONTROL_FORMS + COMPILER_FORMS}, got {control!r}")


def default_form(interpret: bool) -> str:
    """PTX on CUDA, AMDGCN on ROCm; the portable form in interpret mode."""
    if interpret:
        return "portable"
    from .. import is_rocm

    return "amdgcn" if is_rocm() else "ptx"
