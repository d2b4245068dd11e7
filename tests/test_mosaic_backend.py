"""The Mosaic GPU backend's argument errors, launch choice and lowering for CUDA (no kernel runs here).

Its kernel's results are tested in the shared suites: ``tests/test_fused.py`` and
``tests/test_equivalence.py`` (interpret mode on the CPU, the whole matrix on a GPU).
"""

import jax
import jax.numpy as jnp
import pytest

from gdn_lossless_jax.backends import BackendUnavailable, mosaic
from gdn_lossless_jax import checks
from gdn_lossless_jax.backends.contract import PendingCommit

F32, BF16 = jnp.float32, jnp.bfloat16


def _geometry(monkeypatch, *, V=128, K=128, HV=32, D=4, PD=4, state=F32, out=BF16, config=None):
    """The launch the backend would choose on a GPU (the shape checks of its GPU path)."""
    monkeypatch.setattr(mosaic, "_interpret", lambda: False)
    config = config or mosaic.VerifyConfig()
    v = jax.ShapeDtypeStruct((25, D, HV, V), BF16)
    return mosaic._geometry(25, D, 16, HV, V, K, state, v, out, out_into=False, snapshots=False, into=True, PD=PD,
                            config=config)  # fmt: skip


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"V": 96}, r"V=96 a multiple of 64"),
        ({"K": 48}, r"K=48 a multiple of 32 \(float32 pool\)"),
        ({"K": 96, "state": BF16}, r"K=96 a multiple of 64 \(bfloat16 pool\)"),
        ({"HV": 6}, r"HV=6 a multiple of 4"),
    ],
)
def test_shapes_the_gpu_kernel_cannot_take_are_named(monkeypatch, kw, match):
    with pytest.raises(ValueError, match=match):
        _geometry(monkeypatch, out=F32, **kw)


def test_bf16_outputs_leave_by_the_store_this_jax_takes(monkeypatch):
    """jax 0.11.2 (the H200's) stores them from registers; jax 0.12's Mosaic GPU refuses that store, so
    there they are staged in shared memory, and asking for registers raises with the way out."""
    registers = mosaic.VerifyConfig(outputs="registers")
    assert _geometry(monkeypatch, out=F32).outputs == "registers"
    assert _geometry(monkeypatch, out=BF16, config=mosaic.VerifyConfig(outputs="smem")).outputs == "smem"
    if mosaic._jax_version() < (0, 12):
        assert _geometry(monkeypatch).outputs == "registers"
        assert _geometry(monkeypatch, config=registers).outputs == "registers"
        return
    assert _geometry(monkeypatch).outputs == "smem"
    with pytest.raises(BackendUnavailable, match=r"use VerifyConfig\(outputs='smem'\) or None.*\(got bfloat16\)"):
        _geometry(monkeypatch, config=registers)
    assert _geometry(monkeypatch, out=F32, config=registers).out_dtype == "float32"


def _lower_for_cuda(monkeypatch, out_dtype, config):
    """Lower the fused verify (a pending tuple commit, the tape into a buffer) for CUDA here, as the
    GPU would compile it: Mosaic GPU builds the kernel's code while it lowers. The prologue (Pallas
    Triton, which needs a device to lower) is replaced by a stand-in of its shapes."""
    from gdn_lossless_jax.tape import Tuples

    monkeypatch.setattr(mosaic, "_interpret", lambda: False)

    def prep(q, k, a, b, A_log, dt_bias, *, into, **_):
        N, D, H, K = q.shape
        HV = a.shape[-1]
        z = jnp.sum(q.astype(F32))
        return [jnp.zeros((N, D, H, K)) + z] * 2 + [jnp.zeros((N, D, HV)) + z] * 2 + list(into[2:])

    monkeypatch.setattr(mosaic, "prep", prep)
    N, D, H, HV, K, V, L, S, R = 2, 2, 2, 4, 64, 64, 2, 6, 3
    sds, i32 = jax.ShapeDtypeStruct, jnp.int32
    tuples = lambda *s: Tuples(sds((*s, HV, V), F32), sds((*s, H, K), F32), sds((*s, HV), F32))  # noqa: E731
    q, v, a = sds((N, D, H, K), BF16), sds((N, D, HV, V), BF16), sds((N, D, HV), BF16)
    ix = sds((N,), i32)

    def f(pool, q, v, a, A, slots, tape, prev, idx):
        call = checks.verify_args("lower", pool, q, q, v, a, a, A, A, record="tuples", scale=K**-0.5,
                                  out_dtype=out_dtype, slots=slots, layer=1, tape=tape, rows=idx)  # fmt: skip
        return mosaic.verify(call.replace(pending=PendingCommit(prev, jnp.int32(0), idx, idx, idx, idx)), config=config)

    args = (sds((L, S, HV, V, K), F32), q, v, a, sds((HV,), F32), ix, tuples(L, R, D), tuples(L, R, D), ix)
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("out_dtype", [BF16, F32], ids=["bf16", "f32"])
def test_the_gpu_kernel_lowers_for_cuda_with_this_jax(monkeypatch, out_dtype):
    """The kernel as the GPU builds it, lowered on the CPU with this JAX (CI's is 0.12; the H200 runs
    0.11.2), both ways out for the outputs; the control, bf16 outputs stored from registers with the
    backend's refusal taken away, must fail under jax 0.12 (its Mosaic GPU refuses 2-byte stores
    from the row layout), which shows that the lowering builds the stores."""
    for outputs in (None, "smem"):
        assert "mosaic_gpu" in _lower_for_cuda(monkeypatch, out_dtype, mosaic.VerifyConfig(outputs=outputs))
    if out_dtype == F32:  # without the next layer's prefetch (the fused kernel's default has it)
        assert "mosaic_gpu" in _lower_for_cuda(monkeypatch, out_dtype, mosaic.VerifyConfig(prefetch_next_layer=False))
    if out_dtype == F32 or mosaic._jax_version() < (0, 12):
        return
    monkeypatch.setattr(mosaic, "_jax_version", lambda: (0, 11))
    with pytest.raises(Exception, match="smaller than 4 bytes"):
        _lower_for_cuda(monkeypatch, out_dtype, mosaic.VerifyConfig(outputs="registers"))


def test_the_fused_kernel_prefetches_the_next_layer_by_default(monkeypatch):
    on, off = mosaic.VerifyConfig(prefetch_next_layer=True), mosaic.VerifyConfig(prefetch_next_layer=False)
    assert _geometry(monkeypatch, out=F32, PD=4).prefetch_next_layer
    assert not _geometry(monkeypatch, out=F32, PD=0).prefetch_next_layer  # the verify alone
    assert _geometry(monkeypatch, out=F32, PD=0, config=on).prefetch_next_layer
    assert not _geometry(monkeypatch, out=F32, config=off).prefetch_next_layer


def test_launch_double_buffers_the_inputs_where_two_ctas_fit(monkeypatch):
    # 25x4: two CTAs of ~82 KB fit an SM's 227 KB; 8x16 (16 steps each side) does not: single-buffered
    assert _geometry(monkeypatch, out=F32, D=4, PD=4).small_slots == 2
    assert _geometry(monkeypatch, out=F32, D=16, PD=16).small_slots == 1
    forced = mosaic.VerifyConfig(small_slots=1)
    assert _geometry(monkeypatch, out=F32, config=forced).small_slots == 1


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"ctas": 0}, "ctas must be >= 1, got 0"),
        ({"small_slots": 3}, "small_slots must be 1, 2 or None, got 3"),
        ({"form": "ptx"}, "form must be one of"),
        ({"replay": "scan"}, "replay must be one of"),
        ({"outputs": "gmem"}, "outputs must be None or one of"),
        ({"prefetch_next_layer": "yes"}, r"prefetch_next_layer must be None, True or False, got 'yes'"),
    ],
)
def test_config_errors_name_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        mosaic.VerifyConfig(**kw)


def test_the_pinned_form_is_refused_in_interpret_mode():
    if jax.default_backend() != "cpu":
        pytest.skip("interpret mode is the CPU's")
    v = jax.ShapeDtypeStruct((2, 2, 4, 16), F32)
    with pytest.raises(BackendUnavailable, match="'pinned' form needs a CUDA GPU"):
        mosaic._geometry(2, 2, 2, 4, 16, 16, F32, v, F32, out_into=False, snapshots=False, into=False, PD=0,
                         config=mosaic.VerifyConfig(form="pinned"))  # fmt: skip
