"""The replay's rounding on AMD GPUs, checked in the compiled AMDGCN (no AMD GPU needed).

The triton backend's replay and verify kernels and the Pallas commit kernel are compiled for
gfx942 (MI300) and gfx950 (MI355) by Triton's AMD backend (``gdn_lossless_jax.tools.amdgcn``);
the state update must be one rounded multiply of the state (``v_mul_f32`` / ``v_pk_mul_f32``)
whose result is the addend of one fma (``v_fma_f32`` / ``v_fmac_f32`` / ``v_pk_fma_f32``) on
every element, with nothing else rounding it, no unfused multiply-add anywhere, denormals kept
and round-to-nearest-even in the kernel descriptor. The controls (forms that break the rule)
must be told apart, and the Pallas portable form must compile to integer emulation only. Skipped
where triton or its AMD backend is not installed (the test extra installs it on Linux x86_64).
"""

import pytest

from gdn_lossless_jax.tools import amdgcn

pytestmark = pytest.mark.skipif(amdgcn.available() is not None, reason=str(amdgcn.available()))

ARCHS = amdgcn.ARCHS


@pytest.mark.parametrize("arch", ARCHS)
def test_triton_replay_is_mul_then_fma(arch):
    asm = amdgcn.compile_triton("replay", arch, "rule")
    st = amdgcn.inner_step(asm)
    # BV = K = 16 on one wave of 64 lanes: 4 elements a lane, each multiplied once and fused once
    assert st.mul_lanes == st.fma_lanes == 4, (st.muls, st.fmas)
    assert st.addends_from_muls and st.muls_read_state, (st.muls, st.fmas)
    assert not st.adds and not st.unfused_mads, (st.adds, st.unfused_mads)
    assert (st.denorm_mode_32, st.round_mode_32) == (3, 0)
    assert st.rule
    # the same instructions with fp fusion on: the rule has no add the compiler could fuse
    fused = amdgcn.inner_step(amdgcn.compile_triton("replay", arch, "rule", fusion=True))
    assert (fused.muls, fused.fmas) == (st.muls, st.fmas)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("form", ["naive", "twice_rounded", "other_product"])
def test_triton_replay_controls_are_caught(arch, form):
    """The check must fail the forms that break the rule: the naive form fused by the compiler
    (on AMD too, Triton fuses the other product), two roundings, the other product."""
    st = amdgcn.inner_step(amdgcn.compile_triton("replay", arch, form))
    assert not st.rule
    if form == "twice_rounded":
        assert st.adds and not st.fmas
    else:  # an fma whose addend is a rounded product, but not the decayed state
        assert st.fmas and st.addends_from_muls and not st.muls_read_state


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("chain", ["rows", "chunks"])
def test_triton_verify_update(arch, chain):
    """The verify chain's update: as many fma lanes as multiply lanes, each fma's addend a
    rounded product, no add in the update. (Its first decay reads the loaded state, not an fma:
    ``muls_read_state`` does not apply to the unrolled chain.)"""
    st = amdgcn.inner_step(amdgcn.compile_triton("verify", arch, chain=chain), amdgcn.verify_update_lines())
    assert st.mul_lanes == st.fma_lanes > 0, (st.muls, st.fmas)
    assert st.addends_from_muls
    assert not st.adds and not st.unfused_mads
    assert (st.denorm_mode_32, st.round_mode_32) == (3, 0)


def _pallas(form, arch):
    return amdgcn.compile_pallas(form, arch)


@pytest.mark.parametrize("arch", ARCHS)
def test_pallas_amdgcn_form(arch):
    asm, lines = _pallas("amdgcn", arch)
    st = amdgcn.inner_step(asm, lines)
    assert [b.split()[0] for b in st.asm_blocks] == ["v_mul_f32", "v_fma_f32"], st.asm_blocks
    assert st.mul_lanes == st.fma_lanes == 1 and st.rule, amdgcn.excerpt(asm, lines)


@pytest.mark.parametrize("arch", ARCHS)
def test_pallas_portable_form_is_integer_emulation(arch):
    """The control: the portable form rounds with integer operations only (hundreds a step), no
    float multiply, fma or add in the update."""
    asm, lines = _pallas("portable", arch)
    st = amdgcn.inner_step(asm, lines)
    assert not st.muls and not st.fmas and not st.adds and not st.asm_blocks
    hardware = amdgcn.inner_step(*_pallas("amdgcn", arch))
    assert st.integer_ops > hardware.integer_ops + 100, (st.integer_ops, hardware.integer_ops)


@pytest.mark.parametrize("arch", ARCHS[:1])
def test_pallas_one_expression_form_is_not_the_rule(arch):
    """The compiler's one-expression form, as jax writes it, compiles to a separate add on ROCm."""
    asm, lines = _pallas("naive", arch)
    st = amdgcn.inner_step(asm, lines)
    assert not st.rule and st.adds


@pytest.mark.parametrize("arch", ARCHS[:1])
def test_pallas_twice_rounded_control(arch):
    """The Pallas control form, wrong by construction: two pinned products and an fma with 1 (the
    add), never the rule's one fma of k and u."""
    asm, lines = _pallas("twice_rounded", arch)
    st = amdgcn.inner_step(asm, lines)
    assert not st.rule
    assert sorted(b.split()[0] for b in st.asm_blocks) == ["v_fma_f32", "v_mul_f32", "v_mul_f32"], st.asm_blocks


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="arch must be one of .* got 'gfx90a'"):
        amdgcn.compile_triton("replay", "gfx90a")
    with pytest.raises(ValueError, match="kernel must be 'replay' or 'verify', got 'conv'"):
        amdgcn.compile_triton("conv", "gfx942")
