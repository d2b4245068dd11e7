"""Wait for a GPU the way ``torch.cuda.synchronize()`` does.

``jax.block_until_ready`` learns that a computation finished from a host callback that the GPU
driver runs after the computation's last kernel; that callback then wakes the waiting thread,
which is slow where idle CPUs halt (``docs/step.md``). :func:`synchronize` instead asks the
driver to block until every stream of the device's context is idle (``cuCtxSynchronize`` on the
device's primary context, the one XLA and PyTorch share; ``hipDeviceSynchronize`` on ROCm); with
the driver's default schedule the calling thread spins, so it returns within microseconds.

What it does not do: tell JAX. An array computed before the call may still report
``is_ready() == False`` for a moment after it, and reading it (``np.asarray``,
``block_until_ready``) still waits for JAX's own notice. A loop that only needs the step to
be over before it dispatches the next one (or before it reads a clock) can use it; passing
the arrays to the next jitted call does not wait for that notice. It waits for everything
queued on the device's context: work of other JAX programs and of PyTorch in the same
process too, as ``torch.cuda.synchronize()`` does. Tested on CUDA; the ROCm path is written
to HIP's API and not yet run on an AMD GPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import jax

from .backends import is_rocm

__all__ = ["synchronize"]


def synchronize(device=None) -> None:
    """Block until all work queued on ``device``'s GPU has finished (see the module's doc).

    ``device``: a ``jax.Device``, a ``jax.Array`` (the devices that hold it, each waited for)
    or None (the default device). Raises ``ValueError`` for a device that is not a GPU, and
    ``RuntimeError`` naming the driver's error where the driver's call fails."""
    for d in _devices(device):
        if d.platform != "gpu":
            raise ValueError(
                f"synchronize: `device` must be a GPU (CUDA or ROCm) device; got {d} (platform {d.platform!r}). "
                "On other platforms use jax.block_until_ready."
            )
        if is_rocm(d):
            _hip_synchronize(d.local_hardware_id)
        else:
            _cuda_synchronize(d.local_hardware_id)


def _devices(device) -> list:
    if device is None:
        return [jax.local_devices()[0]]
    if isinstance(device, jax.Array):
        return sorted(device.devices(), key=lambda d: d.id)
    if isinstance(device, jax.Device):
        return [device]
    raise TypeError(
        f"synchronize: `device` must be a jax.Device, a jax.Array or None; got {type(device).__name__}"
    )


def _load(names: tuple[str, ...], what: str):
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    found = ctypes.util.find_library(what)
    if found:
        return ctypes.CDLL(found)
    raise RuntimeError(f"synchronize: cannot load the {what} library (tried {', '.join(names)})")


class _Driver:
    """The CUDA driver calls :func:`_cuda_synchronize` makes, by their ABI names: ``cuda.h`` maps
    ``cuCtxPushCurrent`` and ``cuCtxPopCurrent`` to their ``_v2`` symbols (the unversioned ones
    are the old API, which pushes only a context that no thread holds), and names
    ``cuCtxSynchronize`` as it is (CUDA 13's ``cuCtxSynchronize_v2`` takes a context)."""

    def __init__(self, lib):
        self.lib = lib
        self.init, self.device_get = lib.cuInit, lib.cuDeviceGet
        self.primary_ctx_retain = lib.cuDevicePrimaryCtxRetain
        self.ctx_push, self.ctx_pop = lib.cuCtxPushCurrent_v2, lib.cuCtxPopCurrent_v2
        self.ctx_synchronize, self.error_name = lib.cuCtxSynchronize, lib.cuGetErrorName


@functools.cache
def _cuda() -> _Driver:
    drv = _Driver(_load(("libcuda.so.1", "libcuda.so"), "cuda"))
    _check(drv, drv.init(0), "cuInit")
    return drv


def _check(drv, result: int, call: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        if drv.error_name(result, ctypes.byref(name)) != 0 or not name.value:
            raise RuntimeError(f"synchronize: {call} failed with CUresult {result}")
        raise RuntimeError(f"synchronize: {call} failed: {name.value.decode()} ({result})")


@functools.cache
def _primary_context(ordinal: int) -> ctypes.c_void_p:
    # Retained once per device and never released: XLA holds the same primary context for the
    # life of the process, so the retain costs nothing.
    drv = _cuda()
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    _check(drv, drv.device_get(ctypes.byref(dev), ordinal), f"cuDeviceGet({ordinal})")
    _check(drv, drv.primary_ctx_retain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    return ctx


def _cuda_synchronize(ordinal: int) -> None:
    drv, ctx = _cuda(), _primary_context(ordinal)
    _check(drv, drv.ctx_push(ctx), "cuCtxPushCurrent")  # the caller's current context kept
    try:
        _check(drv, drv.ctx_synchronize(), "cuCtxSynchronize")
    finally:
        _check(drv, drv.ctx_pop(ctypes.byref(ctypes.c_void_p())), "cuCtxPopCurrent")


@functools.cache
def _hip():
    return _load(("libamdhip64.so", "libamdhip64.so.6", "libamdhip64.so.7"), "amdhip64")


def _hip_synchronize(ordinal: int) -> None:
    lib = _hip()

    def check(result: int, call: str) -> None:
        if result != 0:
            lib.hipGetErrorName.restype = ctypes.c_char_p
            raise RuntimeError(f"synchronize: {call} failed: {lib.hipGetErrorName(result).decode()} ({result})")

    prev = ctypes.c_int()
    check(lib.hipGetDevice(ctypes.byref(prev)), "hipGetDevice")  # the caller's current device kept
    check(lib.hipSetDevice(ordinal), f"hipSetDevice({ordinal})")
    try:
        check(lib.hipDeviceSynchronize(), "hipDeviceSynchronize")
    finally:
        check(lib.hipSetDevice(prev.value), f"hipSetDevice({prev.value})")
