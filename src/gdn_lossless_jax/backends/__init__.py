"""Backend registry: one interface (``verify``, ``replay``, ``commit``) per implementation.

``reference`` is pure JAX/XLA and runs on any platform. ``pallas`` (Pallas Triton on
CUDA/ROCm, interpret mode on a CPU) and ``triton`` (jax-triton) are GPU kernels behind the
same interface, so either can be replaced without touching the API.
"""

from __future__ import annotations

import importlib

import jax

__all__ = ["BACKENDS", "resolve", "platform", "BackendUnavailable"]

BACKENDS = ("reference", "pallas", "triton")


class BackendUnavailable(RuntimeError):
    """A backend was asked for where it cannot run (platform, JAX build or missing package)."""


def platform() -> str:
    """The platform JAX computes on by default: ``cpu``, ``gpu`` (CUDA or ROCm) or ``tpu``."""
    return jax.default_backend()


def _auto() -> str:
    # The fastest exact backend for the platform; kernels register themselves as they land.
    return "reference"


def resolve(name: str, op: str):
    """Return the module implementing ``op`` for backend ``name`` (``"auto"`` picks one)."""
    if name == "auto":
        name = _auto()
    if name not in BACKENDS:
        raise ValueError(f"{op}: unknown backend {name!r}; choose one of {('auto', *BACKENDS)}")
    try:
        module = importlib.import_module(f"{__name__}.{name}")
    except ImportError as e:
        raise BackendUnavailable(
            f"{op}: backend {name!r} is not available on platform {platform()!r}: {e}. "
            f"Alternatives: 'reference' (any platform), 'auto'."
        ) from e
    check = getattr(module, "check_available", None)
    if check is not None:
        check(op)
    return module
