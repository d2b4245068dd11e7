"""The replay's rounding on AMD GPUs, read from the compiled AMDGCN, on a machine without one.

Triton's AMD backend compiles without a GPU: :func:`compile_triton` compiles the ``triton``
backend's kernels (plain ``@triton.jit`` functions) for a ``gfx`` target, and
:func:`compile_pallas` lowers a Pallas Triton kernel for ROCm under an abstract ``gfx`` device
(``jax.sharding.AbstractDevice``), takes the Triton IR jax emits and compiles it with the same
backend. Both stop at the assembly (``asm["amdgcn"]``), which :func:`inner_step` reads: the
instructions of the replay's loop that come from the decay's multiply and the update's fma,
where each one's addend comes from, and what else the loop computes. :func:`report` writes the
excerpts kept in ``docs/rocm/`` (``python -m gdn_lossless_jax.tools.amdgcn``).

What this shows is the instruction sequence, not a result: nothing here runs on an AMD GPU. The
Pallas kernels run on ROCm through XLA's own Triton (the one built into the ROCm plugin), not the
``triton`` package compiled with here; the inline-asm form (``pallas.rounding``'s ``"amdgcn"``)
reaches the assembly verbatim whichever compiles it, the other forms only as this Triton
compiles them.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import re
import tempfile
import warnings
from collections import Counter
from pathlib import Path

__all__ = [
    "ARCHS",
    "available",
    "compile_triton",
    "compile_pallas",
    "InnerStep",
    "inner_step",
    "loop_body",
    "report",
]

ARCHS = ("gfx942", "gfx950")  # MI300 (CDNA3), MI355 (CDNA4)

#: Float32 multiplies and fused multiply-adds, each with how many lanes of one register it rounds.
MULS = {"v_mul_f32": 1, "v_pk_mul_f32": 2}
FMAS = {"v_fma_f32": 1, "v_fmac_f32": 1, "v_pk_fma_f32": 2}
#: Multiply-adds that are not one IEEE fma (rounded or flushed in between): must never appear.
UNFUSED_MADS = ("v_mad_f32", "v_mac_f32", "v_mad_legacy_f32", "v_fma_legacy_f32", "v_fma_mix", "v_mad_mix")


def available() -> str | None:
    """None where Triton and its AMD backend are importable; else why not."""
    try:
        import triton  # noqa: F401
        from triton.backends.amd.compiler import HIPBackend  # noqa: F401
    except ImportError as e:
        return f"needs triton with its AMD backend ({e})"
    return None


def _target(arch: str):
    from triton.backends.compiler import GPUTarget

    if arch not in ARCHS:
        raise ValueError(f"amdgcn: arch must be one of {ARCHS}, got {arch!r}")
    return GPUTarget("hip", arch, 64)


# ---------------------------------------------------------------------------------------------
# The triton backend's kernels
# ---------------------------------------------------------------------------------------------
def _signature(fn, ints: tuple[str, ...], constexprs: dict) -> dict:
    """Every ``*_ptr`` argument a pointer (``*i32`` where named in ``ints``, else ``*fp32``), the
    rest constexpr."""
    sig = {}
    for name in fn.arg_names:
        if name.endswith("_ptr"):
            sig[name] = "*i32" if name in ints else "*fp32"
        elif name in constexprs or fn.params[fn.arg_names.index(name)].is_constexpr:
            sig[name] = "constexpr"
        else:
            raise ValueError(f"amdgcn: argument {name!r} of {fn.__name__} is neither a pointer nor a constexpr")
    return sig


def _with_defaults(fn, constexprs: dict) -> dict:
    out = dict(constexprs)
    for p in fn.params:
        if p.is_constexpr and p.name not in out and p.default is not inspect.Parameter.empty:
            out[p.name] = p.default
    return out


_COMMIT_INTS = ("slots_ptr", "steps_ptr", "track_slots_ptr", "track_steps_ptr", "rows_ptr")
_VERIFY_INTS = ("slots_ptr", "layer_ptr", "tape_layer_ptr", "rows_ptr", "prows_ptr", "psteps_ptr", "ptslots_ptr",
                "ptsteps_ptr", "player_ptr", "out_layer_ptr")  # fmt: skip


def triton_kernel(kernel: str, form: str = "rule", *, V: int = 16, K: int = 16, D: int = 4, chain: str = "rows",
                  pending: bool = False):  # fmt: skip
    """``(fn, signature, constexprs, options)`` of a triton-backend kernel on a small geometry, as its
    wrapper would launch it. ``kernel``: ``"replay"`` (the tuple commit's kernel; ``form`` one of
    the commit's forms) or ``"verify"`` (the tuple verify's chain; ``pending``: fused with a
    pending tuple commit, replayed on the same tile)."""
    cm = importlib.import_module("gdn_lossless_jax.backends.triton.commit")
    vm = importlib.import_module("gdn_lossless_jax.backends.triton.verify")
    if kernel == "replay":
        config = cm.CommitConfig(block_v=V)
        sizes, _ = cm.tuple_launch((1, 4, 1, V, K), (1, 4, D, 1, K), 4, D, 4, config)
        fn = cm.commit_tuples_kernel
        const = dict(sizes, INTERPRET=False, FORM=cm._FORM_CODE[form], EVICT=config.evict)
        options = dict(num_warps=config.num_warps, num_stages=config.num_stages, enable_fp_fusion=form == "naive")
        return fn, _signature(fn, _COMMIT_INTS, const), _with_defaults(fn, const), options
    if kernel == "verify":
        if form != "rule":
            raise ValueError(f"amdgcn: the verify kernel has only the form 'rule', got {form!r}")
        config = vm.VerifyConfig(block_v=V, chain=chain)
        sizes, _ = vm.launch_sizes((1, 4, 1, V, K), (4, D, 1, K), config, "tuples")
        fn = vm.verify_kernel
        const = dict(sizes, SNAPSHOTS=False, EVICT=config.evict, INTERPRET=False)
        if pending:
            const |= dict(PENDING=1, PR=4, PD=D, PREFETCH=False, PDP=D, KL=1, ROWS=True)
        options = dict(num_warps=config.num_warps, num_stages=config.num_stages, enable_fp_fusion=False)
        return fn, _signature(fn, _VERIFY_INTS, const), _with_defaults(fn, const), options
    raise ValueError(f"amdgcn: kernel must be 'replay' or 'verify', got {kernel!r}")


def compile_triton(kernel: str, arch: str, form: str = "rule", *, fusion: bool | None = None, **geometry) -> str:
    """The AMDGCN assembly of a triton-backend kernel (:func:`triton_kernel`) for ``arch``.

    ``fusion`` overrides the launch's ``enable_fp_fusion`` (None: the wrapper's: off, except for
    the ``naive`` form)."""
    import triton
    from triton.compiler import ASTSource

    fn, sig, const, options = triton_kernel(kernel, form, **geometry)
    if fusion is not None:
        options["enable_fp_fusion"] = fusion
    compiled = triton.compile(ASTSource(fn, signature=sig, constexprs=const), target=_target(arch), options=options)
    return compiled.asm["amdgcn"]


# ---------------------------------------------------------------------------------------------
# The pallas backend's kernels
# ---------------------------------------------------------------------------------------------
def pallas_ttir(form: str, arch: str = "gfx942", *, V: int = 16, K: int = 16, D: int = 4) -> str:
    """The Triton IR (text) that jax emits for the Pallas tuple commit on ROCm, lowered here for
    an abstract ``arch`` device; ``form`` is a ``pallas.rounding`` form."""
    from unittest import mock

    import jax
    import jax.numpy as jnp
    from jax._src.pallas.triton import lowering as pallas_lowering
    from jax._src.pallas.triton import pallas_call_registration  # noqa: F401  (pallas_call's GPU lowering)
    from jax.sharding import AbstractDevice, AbstractMesh

    commit = importlib.import_module("gdn_lossless_jax.backends.pallas.commit")
    modules = []
    lower = pallas_lowering.lower_jaxpr_to_triton_module

    def keep(*args, **kwargs):
        result = lower(*args, **kwargs)
        modules.append(result.module.operation.get_asm())
        return result

    f32, i32 = jnp.float32, jnp.int32
    shapes = [(1, 4, 1, V, K), (1, 4, D, 1, V), (1, 4, D, 1, K), (1, 4, D, 1)]
    args = [jax.ShapeDtypeStruct(s, f32) for s in shapes] + [jax.ShapeDtypeStruct((4,), i32)] * 5
    device = AbstractDevice(device_kind=arch, num_cores=None, platform="rocm")
    config = commit.CommitConfig(block_v=V)
    jax.clear_caches()  # a cached lowering would not call the lowering caught here
    # rounding.exp picks its function by jax's default backend: the GPU's here, as on the device.
    with (
        warnings.catch_warnings(),
        mock.patch.object(pallas_lowering, "lower_jaxpr_to_triton_module", keep),
        mock.patch.object(jax, "default_backend", lambda: "gpu"),
        jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=device)),
    ):
        warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
        # A control form (tests) is built from the ROCm form's instructions, as the backend builds it.
        control, form = (form, "amdgcn") if form in ("naive", "twice_rounded", "other_product") else (None, form)
        commit.commit_tuples.trace(*args, config=config, form=form, interpret=False, control=control).lower(
            lowering_platforms=("rocm",)
        )
    if len(modules) != 1:
        raise RuntimeError(f"amdgcn: expected one Triton module from the Pallas commit, got {len(modules)}")
    return modules[0]


def pallas_update_lines(ttir: str) -> frozenset[tuple[str, int]]:
    """The ``.loc`` lines of the Pallas commit's update: jax's Triton IR has no source lines, so the
    assembly names lines of the IR file :func:`compile_pallas` compiles; all of them but the decay's
    ``exp`` (its call, and the loads and masks around the update are no float multiply or add)."""
    return frozenset((_PALLAS_FILE, n + 1) for n, line in enumerate(ttir.splitlines())
                     if not re.search(r"__ocml_exp_f32|math\.exp\b", line))  # fmt: skip


_PALLAS_FILE = "gdn_commit_replay.ttir"


def compile_pallas(form: str, arch: str, **geometry) -> tuple[str, frozenset[tuple[str, int]]]:
    """The AMDGCN of the Pallas tuple commit in ``form`` for ``arch``: jax's Triton IR
    (:func:`pallas_ttir`) compiled by the ``triton`` package's AMD backend, one stage pipeline
    and 4 warps as jax launches it on ROCm (fp fusion off: the option XLA's Triton does not
    expose; the inline-asm form does not depend on it), and the update's lines
    (:func:`pallas_update_lines`) for :func:`inner_step`."""
    import triton

    ttir = pallas_ttir(form, arch, **geometry)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / _PALLAS_FILE
        path.write_text(ttir)
        compiled = triton.compile(str(path), target=_target(arch),
                                  options=dict(num_warps=4, num_stages=1, enable_fp_fusion=False))  # fmt: skip
    return compiled.asm["amdgcn"], pallas_update_lines(ttir)


# ---------------------------------------------------------------------------------------------
# Reading the assembly
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Instr:
    op: str
    operands: tuple[str, ...]
    text: str
    loc: tuple[str, int] | None  # (file name, line) of the innermost .loc, where the kernel has them
    calls: tuple[tuple[str, int], ...] = ()  # the lines it was inlined at, innermost first

    @property
    def where(self) -> tuple[tuple[str, int], ...]:
        return ((self.loc,) if self.loc else ()) + self.calls

    @property
    def base(self) -> str:
        """The opcode without its encoding suffix (``_e32``, ``_e64``, ``_sdwa``, ``_dpp``)."""
        return re.sub(r"_(e32|e64|sdwa|dpp)$", "", self.op)


_BLOCK = re.compile(r"^(\.LBB\d+_\d+:|; %bb\.\d+:)")


def _parse(lines, files):
    loc, calls = None, ()
    out = []
    for line in lines:
        s = line.strip()
        if s.startswith(".file"):
            m = re.match(r'\.file\s+(\d+)\s+"[^"]*"\s+"([^"]+)"', s)
            if m:
                files[m.group(1)] = m.group(2)
        elif s.startswith(".loc"):
            m = re.match(r"\.loc\s+(\d+)\s+(\d+)", s)
            loc = (files.get(m.group(1), m.group(1)), int(m.group(2)))
            # the comment names the inlined-at chain: "; _lang.py:138:28 @[ commit.py:160:107 ]"
            chain = tuple((f, int(n)) for f, n in re.findall(r"([\w.]+):(\d+):\d+", s.partition(";")[2]))
            calls = chain[1:] if chain and chain[0] == loc else chain
        elif s and not s.startswith((";", ".")) and not s.endswith(":"):
            body = s.split(";", 1)[0].strip()
            if not body:
                continue
            op, _, rest = body.partition(" ")
            operands = tuple(x.strip() for x in re.split(r",(?![^\[]*\])", rest) if x.strip())
            out.append(Instr(op, operands, body, loc, calls if loc else ()))
    return out


def loop_body(asm: str) -> list[Instr]:
    """The instructions of the kernel's loops, in program order: the basic blocks LLVM's loop
    comments mark (``Loop Header`` or ``in Loop:``); the replay's chain is the commit kernel's only
    loop."""
    lines = asm.splitlines()
    files: dict[str, str] = {}
    _parse([line for line in lines if line.strip().startswith(".file")], files)
    kept, inside = [], False
    for line in lines:
        s = line.strip()
        if _BLOCK.match(s):
            inside = "Loop Header" in s or "in Loop:" in s
        elif s.startswith((".Lfunc_end", ".section")):
            inside = False
        if inside or s.startswith((".loc", ".file")):
            kept.append(line)
    return [i for i in _parse(kept, files) if i.op != "s_endpgm"]


def _regs(operand: str) -> tuple[str, ...]:
    """The 32-bit VGPRs an operand names (``v3``, ``v[2:3]``; modifiers stripped)."""
    op = operand.split()[0].lstrip("-|").rstrip("|") if operand.split() else ""
    m = re.fullmatch(r"v\[(\d+):(\d+)\]", op)
    if m:
        return tuple(f"v{i}" for i in range(int(m.group(1)), int(m.group(2)) + 1))
    return (op,) if re.fullmatch(r"v\d+", op) else ()


def _line_of(path: Path, needle: str) -> int:
    lines = path.read_text().splitlines()
    hits = [i + 1 for i, line in enumerate(lines) if needle in line]
    if len(hits) != 1:
        raise RuntimeError(f"amdgcn: expected one line of {path.name} containing {needle!r}, found {len(hits)}")
    return hits[0]


@functools.cache
def _triton_update_lines() -> frozenset[tuple[str, int]]:
    """The source lines of the triton replay's state update, as ``.loc`` names them: the commit
    kernel's update in every form (after the decay's ``exp``, before the store's conversion; an
    instruction inlined from ``_lang.fma`` there counts by its call site)."""
    pkg = Path(__file__).resolve().parents[1] / "backends" / "triton"
    first = _line_of(pkg / "commit.py", "u = tl.load(u_ptr + ((tape_row * D + t)") + 1
    last = _line_of(pkg / "commit.py", "value = _from_f32(state, out_ptr.dtype.element_ty, INTERPRET)") - 1
    return frozenset(("commit.py", n) for n in range(first, last + 1))


def verify_update_lines() -> frozenset[tuple[str, int]]:
    """The source lines of the triton verify chains' state update (both chains): the decay's
    multiply ``Sd = S * alpha`` and the update ``S = _fma(..., Sd, ...)``."""
    path = Path(__file__).resolve().parents[1] / "backends" / "triton" / "verify.py"
    found = [i + 1 for i, line in enumerate(path.read_text().splitlines())
             if line.split("#")[0].strip() == "Sd = S * alpha" or line.strip().startswith("S = _fma(")]  # fmt: skip
    if len(found) != 4:
        raise RuntimeError(f"amdgcn: expected 4 update lines in verify.py (2 chains), found {len(found)}")
    return frozenset(("verify.py", n) for n in found)


@dataclasses.dataclass(frozen=True)
class InnerStep:
    """What the replay loop's state update compiled to.

    Attributes:
      muls, fmas: the float32 multiply and fma instructions of the update, as written in the
        assembly: those the ``.loc`` lines attribute to the update, where the kernel has line
        information; else every one in the loop (Pallas: jax's Triton IR carries no lines).
      mul_lanes, fma_lanes: the elements they round (a packed instruction counts 2).
      addends_from_muls: every fma's addend (``v_fmac``: its destination) is a register one of the
        multiplies wrote: the product is rounded, then fused.
      muls_read_state: every multiply reads a register an fma of the loop writes (the state
        carried from the step before): the rounded product is the decayed state, not ``k * u``.
      unfused_mads: multiply-adds that are not one IEEE fma, anywhere in the kernel.
      adds: float32 adds and subtracts of the update (a twice-rounded update has one).
      asm_blocks: inline-asm texts of the kernel (``;;#ASMSTART`` .. ``;;#ASMEND``).
      histogram: every opcode in the loop, with its count.
      denorm_mode_32, round_mode_32: the kernel descriptor's float32 modes (3: denormals kept on
        input and output; 0: round to nearest even).
    """

    muls: tuple[str, ...]
    fmas: tuple[str, ...]
    mul_lanes: int
    fma_lanes: int
    addends_from_muls: bool
    muls_read_state: bool
    unfused_mads: tuple[str, ...]
    adds: tuple[str, ...]
    asm_blocks: tuple[str, ...]
    histogram: dict[str, int]
    denorm_mode_32: int | None
    round_mode_32: int | None

    @property
    def integer_ops(self) -> int:
        """VALU integer and bit operations in the loop (the portable form's emulation)."""
        return sum(n for op, n in self.histogram.items() if _INTEGER.match(op))

    @property
    def rule(self) -> bool:
        """The update is the rule: one rounded multiply of the state, then one fma into it, on
        every element (``lanes`` of them), nothing else rounded, denormals kept, nearest even."""
        return (self.mul_lanes == self.fma_lanes > 0 and self.addends_from_muls and self.muls_read_state
                and not self.adds and not self.unfused_mads and self.denorm_mode_32 == 3
                and self.round_mode_32 == 0)  # fmt: skip


_INTEGER = re.compile(r"v_(lshl|lshr|ashr|and|or|xor|not|bfe|bfi|ffbh|ffbl|alignbit|med3_[iu]|min_[iu]|max_[iu]|"
                      r"mul_u|mul_i|mul_hi|mad_u|mad_i|add_u|add_co|add3|addc|sub_u|sub_co|subb|subrev_u|"
                      r"subrev_co|cndmask|lshl_add|lshl_or|and_or|or3|xad)")  # fmt: skip
_ADDS = re.compile(r"v_(pk_)?(add|sub|subrev)_f32$")


def _mode(asm: str, name: str) -> int | None:
    m = re.search(rf"\.amdhsa_{name}\s+(\d+)", asm)
    return int(m.group(1)) if m else None


def _update(asm: str, lines) -> tuple[list[Instr], list[Instr]]:
    """The loop, and its instructions that belong to the update (see :class:`InnerStep`)."""
    lines = _triton_update_lines() if lines is None else frozenset(lines)
    body = loop_body(asm) or _parse(asm.splitlines(), {})  # an unrolled chain: the whole kernel
    if lines:
        return body, [i for i in body if lines.intersection(i.where)]
    return body, [i for i in body if i.base in MULS or i.base in FMAS or _ADDS.match(i.base)]


def inner_step(asm: str, lines=None) -> InnerStep:
    """Read the replay's state update from the assembly of a replay kernel.

    ``lines``: the ``(file, line)`` pairs of the update's source (default: the triton backend's
    commit kernel, :func:`_triton_update_lines`); empty: every float multiply, fma and add of the
    loop (kernels without line information: Pallas)."""
    body, update = _update(asm, lines)
    muls = [i for i in update if i.base in MULS]
    fmas = [i for i in update if i.base in FMAS]
    mul_dsts = {r for i in muls for r in _regs(i.operands[0])}
    fma_dsts = {r for i in fmas for r in _regs(i.operands[0])}

    def addend(i):
        return _regs(i.operands[0] if i.base == "v_fmac_f32" else i.operands[3])

    addends = [addend(i) for i in fmas]
    asm_blocks, in_asm, block = [], False, []
    for line in asm.splitlines():
        s = line.strip()
        if s.startswith(";;#ASMSTART"):
            in_asm, block = True, []
        elif s.startswith(";;#ASMEND"):
            in_asm = False
            asm_blocks.append(" ".join(block))
        elif in_asm and s:
            block.append(s)
    everything = _parse(asm.splitlines(), {})
    return InnerStep(
        muls=tuple(i.text for i in muls),
        fmas=tuple(i.text for i in fmas),
        mul_lanes=sum(MULS[i.base] for i in muls),
        fma_lanes=sum(FMAS[i.base] for i in fmas),
        addends_from_muls=bool(addends) and all(a and set(a) <= mul_dsts for a in addends),
        muls_read_state=bool(muls) and all(any(set(_regs(x)) & fma_dsts for x in i.operands[1:]) for i in muls),
        unfused_mads=tuple(i.text for i in everything if i.base.startswith(UNFUSED_MADS)),
        adds=tuple(i.text for i in update if _ADDS.match(i.base)),
        asm_blocks=tuple(asm_blocks),
        histogram=dict(Counter(i.base for i in body)),
        denorm_mode_32=_mode(asm, "float_denorm_mode_32"),
        round_mode_32=_mode(asm, "float_round_mode_32"),
    )


def excerpt(asm: str, lines=None, limit: int = 40) -> list[str]:
    """The update's float32 instructions (as :func:`inner_step` selects them), in order, at most
    ``limit``."""
    _, update = _update(asm, lines)
    keep = [i for i in update if re.match(r"v_\w*f32", i.base)]  # the float arithmetic
    return [f"{i.text}" + ("  ; " + " @ ".join(f"{f}:{n}" for f, n in i.where) if i.where else "")
            for i in keep][:limit]


# ---------------------------------------------------------------------------------------------
# The listings
# ---------------------------------------------------------------------------------------------
def _summary(st: InnerStep) -> str:
    return (f"rule={st.rule} mul_lanes={st.mul_lanes} fma_lanes={st.fma_lanes} "
            f"addends_from_muls={st.addends_from_muls} muls_read_state={st.muls_read_state} adds={len(st.adds)} "
            f"unfused_mads={len(st.unfused_mads)} loop_integer_ops={st.integer_ops} "
            f"denorm_mode_32={st.denorm_mode_32} round_mode_32={st.round_mode_32}")  # fmt: skip


def report(arch: str) -> str:
    """The listing of one target: for each kernel and form, the update's float instructions and
    what :func:`inner_step` reads from them."""
    import triton

    import jax

    out = [f"# {arch}: triton {triton.__version__} (AMD backend), jax {jax.__version__}; compiled on a CPU, nothing here ran",
           "# made by: python -m gdn_lossless_jax.tools.amdgcn --out docs/rocm",
           "# per section: what inner_step reads, then the update's float32 instructions ('; file:line' is the .loc,",
           "# '@' the line it was inlined at; the Pallas lines are lines of jax's Triton IR)", ""]  # fmt: skip

    def section(title, asm, lines, note=""):
        st = inner_step(asm, lines)
        out.extend([f"## {title}", f"# {_summary(st)}"] + ([f"# {note}"] if note else []))
        out.extend(excerpt(asm, lines, limit=16) or ["(no float multiply, fma or add: integer emulation)"])
        out.append("")

    for form, note in (("rule", "the backend's form: _lang.fma (tl.fma) into a separately rounded decay, fp fusion off"),
                       ("naive", "the compiler's form (not a control): S * alpha + k * u with fp fusion on: Triton fuses the other product"),
                       ("twice_rounded", "control: the same, fp fusion off: two roundings"),
                       ("other_product", "control: fma(S, alpha, rn(k * u)) written out")):  # fmt: skip
        section(f"triton replay (commit_tuples_kernel), form {form}", compile_triton("replay", arch, form), None, note)
    asm = compile_triton("replay", arch, "rule", fusion=True)
    section("triton replay, form rule, fp fusion on", asm, None, "the rule has no add to fuse: the same instructions")
    for chain in ("rows", "chunks"):
        section(f"triton verify (verify_kernel, tuples, chain {chain})", compile_triton("verify", arch, chain=chain),
                verify_update_lines(), "the chain's decay and update (the K sums are left out); muls_read_state "
                "can be False: the unrolled chain's first decay reads the loaded state")  # fmt: skip
    for form, note in (("amdgcn", "the ROCm form: v_mul_f32 and v_fma_f32 as inline asm"),
                       ("portable", "the integer form (rounding.mul_rn, fma_rn): no float instruction"),
                       ("naive", "the compiler's form (not a control): S * alpha + k * u as jax writes it")):  # fmt: skip
        asm, lines = compile_pallas(form, arch)
        section(f"pallas commit (jax's Triton IR for ROCm), form {form}", asm, lines, note)
    return "\n".join(out)


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="a folder for <arch>.txt (default: print)")
    parser.add_argument("--arch", nargs="*", default=list(ARCHS), choices=ARCHS)
    args = parser.parse_args(argv)
    reason = available()
    if reason:
        parser.error(reason)
    for arch in args.arch:
        text = report(arch)
        if args.out is None:
            print(text)
        else:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"{arch}.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
