"""The Mosaic GPU backend's argument errors and launch choice (no kernel runs here).

Its kernel's results are tested in the shared suites: ``tests/test_fused.py`` and
``tests/test_equivalence.py`` (interpret mode on the CPU, the whole matrix on a GPU).
"""

import jax
import jax.numpy as jnp
import pytest

from gdn_lossless_jax.backends import BackendUnavailable, mosaic

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


def test_bf16_outputs_under_jax_0_12_raise_with_the_way_out(monkeypatch):
    if mosaic._jax_version() < (0, 12):
        assert _geometry(monkeypatch).out_dtype == "bfloat16"  # jax 0.11.2 stores them (the H200 runs)
        return
    with pytest.raises(BackendUnavailable, match=r"pass out_dtype=float32 \(got bfloat16\)"):
        _geometry(monkeypatch)
    assert _geometry(monkeypatch, out=F32).out_dtype == "float32"


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
