"""Launch a Triton kernel as XLA's own Triton custom call, so that XLA captures it in its CUDA graphs.

jax-triton 0.3.1 lowers a launch to a legacy custom call (``triton_kernel_call``, API version 2),
which XLA never records into a command buffer: every launch leaves XLA's CUDA graph and costs the
host a launch of its own. Pallas' Triton kernels go to XLA as ``__gpu$xla.gpu.triton`` (Triton IR
that XLA compiles with its own Triton and records like any fusion). :func:`triton_call` takes
jax-triton's arguments and hands the kernel's Triton IR to XLA the same way.

The Triton IR comes from the installed ``triton`` (its front end and its ``make_ttir`` passes: one
inlined function, every pointer argument 16-byte aligned, as jax-triton assumes); XLA parses it
and compiles the rest with the Triton it was built with. XLA's LLVM never contracts a multiply and
an add, which is what ``enable_fp_fusion=False`` asks of Triton's (the kernels' one fma is explicit).
Only pointer arguments (the inputs, then the outputs, as jax-triton passes them) and constexprs.
"""

from __future__ import annotations

import functools
import re

import jax
import numpy as np
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax.extend import core as jex_core

__all__ = ["triton_call", "ttir"]

_TYPES = {np.dtype(np.float32): "*fp32", np.dtype(np.float16): "*fp16", np.dtype(jax.numpy.bfloat16): "*bf16",
          np.dtype(np.int32): "*i32", np.dtype(np.int64): "*i64", np.dtype(np.uint32): "*u32",
          np.dtype(np.int8): "*i8", np.dtype(np.uint8): "*u8", np.dtype(np.bool_): "*i1"}  # fmt: skip


@functools.cache
def ttir(kernel, dtypes: tuple, metaparams: tuple, num_warps: int, num_stages: int, capability: int) -> tuple[str, str]:
    """``(entry name, Triton IR text)`` of ``kernel`` for pointer arguments of ``dtypes`` (in order)
    and the constexprs ``metaparams`` (sorted ``(name, value)`` pairs), after Triton's ``make_ttir``."""
    import triton
    import triton._C.libtriton as libtriton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import code_generator, compiler

    backend = CUDABackend(GPUTarget("cuda", capability, 32))
    options = backend.parse_options({"num_warps": num_warps, "num_stages": num_stages, "num_ctas": 1,
                                     "enable_fp_fusion": False})  # fmt: skip
    names = kernel.arg_names
    constexprs = dict(metaparams)
    pointers = [n for n in names if n not in constexprs]
    if len(pointers) != len(dtypes):
        raise TypeError(f"{kernel.__name__}: {len(pointers)} pointer parameters ({pointers}) but {len(dtypes)} arrays")
    signature = {n: _TYPES[np.dtype(d)] for n, d in zip(pointers, dtypes)}
    signature.update({n: "constexpr" for n in constexprs})
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in pointers}
    context = libtriton.ir.context()
    libtriton.ir.load_dialects(context)
    backend.load_dialects(context)
    module = code_generator.ast_to_ttir(
        kernel, compiler.ASTSource(kernel, signature, constexprs, attrs), context=context, options=options,
        codegen_fns=backend.get_codegen_implementation(options), module_map=backend.get_module_map())  # fmt: skip
    module = backend.make_ttir(module, {}, options, capability)
    del triton
    return module.get_entry_func_name(), _portable(module.str_nodebug())


# Load and store hints as the installed Triton prints them (``evictionPolicy = evict_first``) and as
# attributes that XLA's Triton parses whether or not its ops spell them so (``{evict = 2 : i32}``).
_HINTS = {"evictionPolicy": ("evict", {"evict_normal": 1, "evict_first": 2, "evict_last": 3}),
          "cacheModifier": ("cache", {"ca": 2, "cg": 3, "wb": 4, "cs": 5, "wt": 6, "cv": 7})}  # fmt: skip


def _portable(text: str) -> str:
    def hint(m):
        attr, values = _HINTS[m.group(1)]
        return "{" + f"{attr} = {values[m.group(2)]} : i32" + "}"

    return re.sub(r"\b(evictionPolicy|cacheModifier) = (\w+)", hint, text)


_call_p = jex_core.Primitive("gdn_xla_triton_call")
_call_p.multiple_results = True
_call_p.def_impl(functools.partial(jax._src.dispatch.apply_primitive, _call_p))
_call_p.def_abstract_eval(lambda *avals, out_avals, **_: out_avals)


@functools.cache
def _capability() -> int:
    major, minor = jax.devices("gpu")[0].compute_capability.split(".")
    return int(major) * 10 + int(minor)


def _lowering(ctx, *args, kernel, out_avals, grid, aliases, num_warps, num_stages, metaparams):
    dtypes = tuple(a.dtype for a in ctx.avals_in) + tuple(a.dtype for a in out_avals)
    name, text = ttir(kernel, dtypes, metaparams, num_warps, num_stages, _capability())
    layouts = lambda avals: [tuple(range(len(a.shape) - 1, -1, -1)) for a in avals]  # noqa: E731 (row-major)
    i32 = lambda n: ir.IntegerAttr.get(ir.IntegerType.get_signless(32), n)  # noqa: E731
    backend_config = dict(name=ir.StringAttr.get(name), ir=ir.StringAttr.get(text), num_stages=i32(num_stages),
                          num_warps=i32(num_warps), grid_x=i32(grid[0]), grid_y=i32(grid[1]), grid_z=i32(grid[2]),
                          debug=ir.BoolAttr.get(False))  # fmt: skip
    return mlir.custom_call(
        call_target_name="__gpu$xla.gpu.triton",
        result_types=[mlir.aval_to_ir_type(a) for a in out_avals],
        operands=list(args),
        backend_config=backend_config,
        api_version=4,
        operand_layouts=layouts(ctx.avals_in),
        result_layouts=layouts(out_avals),
        operand_output_aliases=dict(aliases),
    ).results


mlir.register_lowering(_call_p, _lowering, platform="cuda")


def triton_call(*args, kernel, out_shape, grid, input_output_aliases=None, enable_fp_fusion=False, num_warps=4,
                num_stages=3, name="", **metaparams):  # fmt: skip
    """``jax_triton.triton_call``'s arguments (arrays only, no scalars; ``name`` unused: XLA names
    the kernel after its Triton function) -> the outputs, launched as XLA's Triton custom call."""
    if enable_fp_fusion:
        raise ValueError("triton_call: XLA's Triton never contracts; enable_fp_fusion=True cannot be honoured")
    single = not isinstance(out_shape, (list, tuple))
    shapes = [out_shape] if single else list(out_shape)
    out_avals = tuple(jax.core.ShapedArray(s.shape, s.dtype) for s in shapes)
    grid = tuple(grid) + (1,) * (3 - len(grid))
    outs = _call_p.bind(*args, kernel=kernel, out_avals=out_avals, grid=grid,
                        aliases=tuple(sorted((input_output_aliases or {}).items())), num_warps=num_warps,
                        num_stages=num_stages, metaparams=tuple(sorted(metaparams.items())))  # fmt: skip
    return outs[0] if single else outs


def launch(how: str, *args, **kwargs):
    """``jax_triton.triton_call(*args, **kwargs)``, or :func:`triton_call` where ``how`` is ``"xla"``
    (a kernel built with fp fusion on, a test's control form, always goes through jax-triton)."""
    if how == "xla" and not kwargs.get("enable_fp_fusion", True):
        return triton_call(*args, **kwargs)
    import jax_triton as jt

    return jt.triton_call(*args, **kwargs)
