"""gdn_lossless_jax.sync.synchronize: the driver's wait on a GPU (as torch.cuda.synchronize)."""

import ctypes
import time
import types

import jax
import jax.numpy as jnp
import pytest

from conftest import ON_GPU, requires_gpu
from gdn_lossless_jax import backends, sync


@pytest.mark.skipif(ON_GPU, reason="checks the error on a CPU device")
def test_a_cpu_device_is_refused_by_name():
    with pytest.raises(ValueError, match=r"`device` must be a GPU .*platform 'cpu'.*block_until_ready"):
        sync.synchronize()
    with pytest.raises(ValueError, match="`device` must be a GPU"):
        sync.synchronize(jnp.ones(3))


def test_a_wrong_argument_type_is_refused_by_name():
    with pytest.raises(TypeError, match=r"`device` must be a jax.Device, a jax.Array or None; got str"):
        sync.synchronize("gpu:0")


def test_rocm_is_told_from_the_platform_version():
    dev = lambda v: types.SimpleNamespace(platform_version=v, client=types.SimpleNamespace(platform_version=""))  # noqa: E731
    assert backends.is_rocm(dev("rocm 6.4.1"))
    assert not backends.is_rocm(dev("cuda 13000"))


class _FakeDriver:
    """The driver calls _cuda_synchronize makes; ``fail`` the CUresult of cuCtxSynchronize."""

    def __init__(self, fail: int):
        self.fail, self.calls = fail, []

    def ctx_push(self, ctx):
        self.calls.append("push")
        return 0

    def ctx_synchronize(self):
        self.calls.append("sync")
        return self.fail

    def ctx_pop(self, ref):
        self.calls.append("pop")
        return 0

    def error_name(self, result, ref):
        ref._obj.value = {700: b"CUDA_ERROR_ILLEGAL_ADDRESS"}.get(result)
        return 0 if result == 700 else 1


def test_the_driver_is_called_by_its_abi_names():
    """cuda.h maps cuCtxPushCurrent/cuCtxPopCurrent to their _v2 symbols; the unversioned ones push
    only a context no thread holds (CUDA_ERROR_INVALID_CONTEXT on the primary context XLA holds)."""
    names = ("cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2",
             "cuCtxSynchronize", "cuGetErrorName")
    lib = types.SimpleNamespace(**{n: n for n in names})
    drv = sync._Driver(lib)
    assert (drv.ctx_push, drv.ctx_pop, drv.ctx_synchronize) == ("cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2",
                                                                "cuCtxSynchronize")  # fmt: skip


def test_a_driver_error_is_raised_by_name_and_the_callers_context_restored(monkeypatch):
    for fail, message in [(700, r"cuCtxSynchronize failed: CUDA_ERROR_ILLEGAL_ADDRESS \(700\)"),
                          (999, r"cuCtxSynchronize failed with CUresult 999")]:  # fmt: skip
        fake = _FakeDriver(fail)
        monkeypatch.setattr(sync, "_cuda", lambda fake=fake: fake)
        monkeypatch.setattr(sync, "_primary_context", lambda ordinal: ctypes.c_void_p(1))
        with pytest.raises(RuntimeError, match=message):
            sync._cuda_synchronize(0)
        assert fake.calls == ["push", "sync", "pop"]  # popped after the failure too
    fake = _FakeDriver(0)
    monkeypatch.setattr(sync, "_cuda", lambda: fake)
    sync._cuda_synchronize(0)
    assert fake.calls == ["push", "sync", "pop"]


@requires_gpu
def test_synchronize_waits_for_the_gpu():
    """After synchronize() the GPU is done: JAX's own notice follows (within 1 s), and a step whose
    arrays are passed on at once (donated) computes the same values as one waited for by JAX."""
    step = jax.jit(lambda x: x * 1.0000001 + 1.0, donate_argnums=0)
    x = jnp.ones((1 << 28,), jnp.float32)  # 1 GiB: ~0.5 ms a pass on an H200
    expect = jax.block_until_ready(step(step(jnp.ones((1 << 28,), jnp.float32))))
    for _ in range(2):
        x = step(x)
        sync.synchronize(x)
    deadline = time.perf_counter() + 1.0
    while not x.is_ready() and time.perf_counter() < deadline:
        pass
    assert x.is_ready()
    assert bool(jnp.array_equal(x, expect))
    sync.synchronize(jax.devices()[0])
