"""Backend registry: one interface (``verify``, ``replay``, ``commit``) per implementation.

``reference`` is pure JAX/XLA and runs on any platform. ``pallas`` (Pallas Triton on
CUDA/ROCm, interpret mode on a CPU), ``triton`` (jax-triton) and ``mosaic`` (Pallas Mosaic GPU
on CUDA sm_90+, interpret mode on a CPU) are GPU kernels behind the same interface, so any
can be replaced without touching the API.

A backend is a module ``gdn_lossless_jax.backends.<name>`` with three functions, called
by :mod:`gdn_lossless_jax.api` after every argument check (shapes and dtypes are valid,
indices are int32, ``scale`` is a float and ``out_dtype`` a numpy dtype)::

    verify(state0, q, k, v, a, b, A_log, dt_bias, *, record, scale, out_dtype) -> (outputs, tape)
    replay(state0, tuples, steps) -> states
    commit(pool, tape, slots, steps, track_slots, track_steps, rows) -> pool

and optionally ``check_available(op: str) -> None``, which raises
:class:`BackendUnavailable` with a message naming the backend, the platform and the
alternatives when it cannot run here. Semantics are those of the reference
(:mod:`gdn_lossless_jax.reference`), bit for bit where the reference is pinned.

A backend of your own is any object with these functions (a module, a class, a
``types.SimpleNamespace``), passed as ``backend=`` instead of a name; it must be hashable
to be passed through ``gdn_lossless_jax.pool`` (a module is). Check it with
:func:`gdn_lossless_jax.testing.run_equivalence_suite`.
"""

from __future__ import annotations

import importlib

import jax

__all__ = ["BACKENDS", "resolve", "resolve_name", "platform", "is_rocm", "check_math", "BackendUnavailable"]

BACKENDS = ("reference", "pallas", "triton", "mosaic")


class BackendUnavailable(RuntimeError):
    """A backend was asked for where it cannot run (platform, JAX build or missing package)."""


def platform() -> str:
    """The platform JAX computes on by default: ``cpu``, ``gpu`` (CUDA or ROCm) or ``tpu``."""
    return jax.default_backend()


def is_rocm(device=None) -> bool:
    """Whether ``device`` (default: JAX's first device) is an AMD GPU under ROCm: its platform
    reads ``gpu`` for CUDA and ROCm alike, its platform version names ROCm."""
    d = jax.devices()[0] if device is None else device
    text = f"{getattr(d, 'platform_version', '')} {getattr(d.client, 'platform_version', '')}"
    return "rocm" in text.lower()


def _auto(op: str = "verify", math: str = "platform") -> str:
    # The fastest exact backend for the platform that implements ``math`` there: the Pallas
    # kernels on a GPU (math="platform"; "portable" runs in their interpret mode only), else the
    # reference, which implements every mode on every platform.
    if platform() != "gpu":
        return "reference"
    if math != "platform":
        try:
            check_math(importlib.import_module(f"{__name__}.pallas"), op, math)
        except (BackendUnavailable, ImportError):
            return "reference"
    return "pallas"


def resolve_name(name, math: str = "platform") -> str:
    """The backend ``name`` stands for (``"auto"`` picks one for ``math``); the name is not
    checked (a backend object of your own is returned as it is)."""
    return _auto("verify", math) if isinstance(name, str) and name == "auto" else name


def check_math(backend, op: str, math: str) -> None:
    """Raise :class:`BackendUnavailable` unless ``backend`` (a resolved backend) implements the
    ``math=`` mode ``math`` here. ``"platform"`` is every backend's; another mode is one a backend
    lists in its ``MATH_MODES`` and, where it has one, its ``check_math(op, math)`` accepts."""
    if math == "platform":
        return
    name = getattr(backend, "__name__", repr(backend)).rsplit(".", 1)[-1]
    if math not in getattr(backend, "MATH_MODES", ("platform",)):
        raise BackendUnavailable(
            f"{op}: backend {name!r} does not implement math={math!r} (its kernels use the platform's exp, "
            f"division and order of sums). Alternatives: backend='reference' (any platform), or math='platform'."
        )
    check = getattr(backend, "check_math", None)
    if check is not None:
        check(op, math)


def resolve(name, op: str, math: str = "platform"):
    """Return the module implementing ``op`` for backend ``name`` (``"auto"`` picks the fastest
    that implements the ``math=`` mode ``math`` on this platform).

    ``name`` may also be a backend object of your own (see the module docstring): it is
    returned as it is, once it has a callable ``op``.
    """
    if not isinstance(name, str):
        if not callable(getattr(name, op, None)):
            raise TypeError(
                f"{op}: backend must be one of {('auto', *BACKENDS)} or an object with verify, replay and commit "
                f"functions (see gdn_lossless_jax.backends); {name!r} has no callable {op!r}"
            )
        check = getattr(name, "check_available", None)
        if check is not None:
            check(op)
        return name
    if name == "auto":
        name = _auto(op, math)
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
