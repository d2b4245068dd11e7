"""A backend's verify called directly, for tests of a backend's own options."""

from __future__ import annotations

from ..checks import verify_args

__all__ = ["backend_verify", "BACKEND_OPTIONS"]

#: Keywords that belong to a backend, not to :func:`gdn_lossless_jax.verify`.
BACKEND_OPTIONS = ("config", "form", "pending_control")


def backend_verify(backend, *args, **kwargs):
    """``backend.verify`` of the call :func:`gdn_lossless_jax.verify` would make of ``args`` and
    ``kwargs`` (checked as it checks them), with the backend's own options (``config``, ``form``,
    ``pending_control``) passed to the backend: ``backend_verify(pallas, **x, config=cfg)``."""
    options = {name: kwargs.pop(name) for name in BACKEND_OPTIONS if name in kwargs}
    return backend.verify(verify_args("backend_verify", *args, **kwargs), **options)
