"""Backend registry: the built-in backends by name, and a call checked against a backend's capabilities.

The contract every backend implements is stated once, in :mod:`gdn_lossless_jax.backends.contract`
(the :class:`~gdn_lossless_jax.backends.contract.Backend` protocol). The built-in backends are
modules of this package: ``reference`` (pure JAX/XLA, any platform), ``pallas`` (Pallas Triton on
CUDA/ROCm, interpret mode on a CPU), ``triton`` (jax-triton) and ``mosaic`` (Pallas Mosaic GPU on
CUDA sm_90+, interpret mode on a CPU). Any can be replaced without touching the API; a backend of
your own is passed as ``backend=`` instead of a name.
"""

from __future__ import annotations

import importlib

import jax

from .contract import Backend, BackendUnavailable, as_backend, backend_name

__all__ = ["BACKENDS", "resolve", "resolve_name", "call_needs", "call_sizes", "lookup", "platform", "is_rocm",
           "check_math", "check_call", "check_sizes", "check_trees", "check_tape", "BackendUnavailable",
           "Backend"]  # fmt: skip

#: The built-in backends: ``gdn_lossless_jax.backends.<name>`` (registering one is a name here).
BACKENDS = ("reference", "pallas", "triton", "mosaic")


def platform() -> str:
    """The platform JAX computes on by default: ``cpu``, ``gpu`` (CUDA or ROCm) or ``tpu``."""
    return jax.default_backend()


def is_rocm(device=None) -> bool:
    """Whether ``device`` (default: JAX's first device) is an AMD GPU under ROCm: its platform
    reads ``gpu`` for CUDA and ROCm alike, its platform version names ROCm."""
    d = jax.devices()[0] if device is None else device
    text = f"{getattr(d, 'platform_version', '')} {getattr(d.client, 'platform_version', '')}"
    return "rocm" in text.lower()


def _auto(op: str = "verify", math: str = "platform", needs=None) -> str:
    # The fastest exact backend for the platform that implements ``math`` there and whose
    # capabilities satisfy ``needs`` (a per-channel decay, a beta scale): the Pallas kernels on a
    # GPU (math="platform"; "portable" runs in their interpret mode only), else the reference,
    # which implements every mode and decay on every platform.
    if platform() != "gpu":
        return "reference"
    if math != "platform":
        try:
            check_math(lookup("pallas"), op, math)
        except (BackendUnavailable, ImportError):
            return "reference"
    if needs is not None and not needs(lookup("pallas").capabilities):
        return "reference"
    return "pallas"


def resolve_name(name, math: str = "platform", needs=None) -> str:
    """The backend ``name`` stands for (``"auto"`` picks one for ``math`` and ``needs``, as
    :func:`resolve`); the name is not checked (a backend object of your own is returned as it is)."""
    return _auto("verify", math, needs) if isinstance(name, str) and name == "auto" else name


def _off_powers(c, sizes) -> list[str]:
    """The sizes ``c.powers_of_two`` names that are not powers of two, where kernels compile (a GPU)."""
    if not sizes or platform() != "gpu":
        return []
    return [f"{d}={sizes[d]}" for d in c.powers_of_two if d in sizes and sizes[d] & (sizes[d] - 1)]


def call_needs(decay: str = "scalar", beta_scale: float = 1.0, sizes=None):
    """The capabilities a call needs, as :func:`resolve`'s ``needs``: its ``decay=`` form among
    ``capabilities.decays``, for a beta scale other than 1 ``capabilities.beta_scale``, and on a GPU
    ``sizes`` (``{"H", "HV", "K", "V"}``: ints) powers of two where ``capabilities.powers_of_two`` says."""
    return lambda c: decay in c.decays and (beta_scale == 1.0 or c.beta_scale) and not _off_powers(c, sizes)


def check_sizes(backend: Backend, fn: str, sizes) -> None:
    """Refuse sizes ``backend`` cannot compile here (``capabilities.powers_of_two``, on a GPU), naming
    the backends that take them."""
    bad = _off_powers(backend.capabilities, sizes)
    if bad:
        raise BackendUnavailable(f"{fn}: backend {backend_name(backend)!r} needs {', '.join(bad)} a power of two on "
                                 f"this platform; the backends that take it: "
                                 f"{_names(lambda c: not _off_powers(c, sizes))}")  # fmt: skip


def lookup(name) -> Backend:
    """The backend ``name`` (a built-in name, ``"auto"``, or a backend object) as a
    :class:`~gdn_lossless_jax.backends.contract.Backend`, without asking whether it runs here."""
    if not isinstance(name, str):
        return as_backend(name)
    if name == "auto":
        name = _auto()
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {('auto', *BACKENDS)}")
    return importlib.import_module(f"{__name__}.{name}")


def resolve(name, op: str, math: str = "platform", needs=None) -> Backend:
    """The backend implementing ``op`` for ``name`` (``"auto"`` picks the fastest that
    implements the ``math=`` mode ``math`` on this platform and whose capabilities satisfy
    ``needs``, a predicate: :func:`call_needs`, or a tape class's ``takes``), once it can run ``op`` here
    (its ``check_available``). ``name`` may also be a backend object
    (:class:`~gdn_lossless_jax.backends.contract.Backend`; an object of the earlier contract is
    adapted, :func:`~gdn_lossless_jax.backends.contract.as_backend`)."""
    if not isinstance(name, str):
        backend = as_backend(name, op)
        backend.check_available(op)
        return backend
    if name == "auto":
        name = _auto(op, math, needs)
    if name not in BACKENDS:
        raise ValueError(f"{op}: unknown backend {name!r}; choose one of {('auto', *BACKENDS)}")
    try:
        backend = importlib.import_module(f"{__name__}.{name}")
    except ImportError as e:
        raise BackendUnavailable(
            f"{op}: backend {name!r} is not available on platform {platform()!r}: {e}. "
            f"Alternatives: 'reference' (any platform), 'auto'."
        ) from e
    backend.check_available(op)
    return backend


def check_math(backend: Backend, op: str, math: str) -> None:
    """Raise :class:`BackendUnavailable` unless ``backend`` implements the ``math=`` mode ``math``
    here: one its ``capabilities.math_modes`` declares, which its ``check_available(op, math)``
    does not refuse. ``"platform"`` is every backend's."""
    if math == "platform":
        return
    if math not in backend.capabilities.math_modes:
        raise BackendUnavailable(
            f"{op}: backend {backend_name(backend)!r} does not implement math={math!r} (its kernels use the "
            "platform's exp, division and order of sums). Alternatives: backend='reference' (any platform), or "
            "math='platform'."
        )
    backend.check_available(op, math)


def _takers(what) -> list[str]:
    """The built-in backends whose capabilities satisfy ``what``."""
    names = []
    for name in BACKENDS:
        try:
            if what(lookup(name).capabilities):
                names.append(name)
        except ImportError:
            pass
    return names


def check_trees(backend: Backend, fn: str) -> None:
    """A ``ValueError`` unless ``backend`` verifies draft trees, naming the backends that do."""
    if not backend.capabilities.trees:
        which = " or ".join(f'backend="{n}"' for n in _takers(lambda c: c.trees))
        raise ValueError(
            f"{fn}: backend {backend_name(backend)!r} does not verify draft trees ('parents' describes a tree, not a "
            f"linear chain): pass {which}, which do; the Triton and Mosaic GPU kernels run linear chains only "
            "(parents None or [-1, 0, ..., D-2])"
        )


def _names(what) -> str:
    return ", ".join(repr(n) for n in _takers(what)) or "none"


def check_tape(backend: Backend, fn: str, tape: type) -> None:
    """Refuse a tape class ``backend`` does not take (``capabilities.takes``: its record mode and
    decay), naming the backend and those that take it."""
    caps, name = backend.capabilities, backend_name(backend)
    if caps.takes(tape):
        return
    if tape in caps.records:  # the mode, not its decay: a KDA tape on a GDN-only backend
        raise BackendUnavailable(f"{fn}: backend {name!r} does not run KDA layers (a per-channel decay: "
                                 f"{tape.__name__} tapes, decay='channel'); the backends that do: "
                                 f"{_names(lambda c: c.takes(tape))}")  # fmt: skip
    raise BackendUnavailable(f"{fn}: backend {name!r} does not take {tape.mode!r} tapes; the backends that do: "
                             f"{_names(lambda c: c.takes(tape))}")  # fmt: skip


def call_sizes(call) -> dict[str, int]:
    """``{"H", "HV", "K", "V"}`` of a :class:`~gdn_lossless_jax.backends.contract.VerifyCall`."""
    H, K = call.q.shape[-2:]
    return {"H": H, "HV": call.pool.shape[-3], "K": K, "V": call.pool.shape[-2]}


def check_call(backend: Backend, fn: str, call) -> None:
    """Refuse a :class:`~gdn_lossless_jax.backends.contract.VerifyCall` outside ``backend``'s
    capabilities, before it runs, naming the backend and those that take it: a record mode it
    does not record, a decay form (KDA's per-channel decay), a beta scale, a draft tree, a
    ``math=`` mode, a state dtype, more draft steps than it takes, or (where its kernels compile)
    a shape off its multiples or its powers of two."""
    caps, name = backend.capabilities, backend_name(backend)
    if call.decay not in caps.decays:
        raise BackendUnavailable(f"{fn}: backend {name!r} does not run KDA layers (decay={call.decay!r}: one decay "
                                 f"per key channel); the backends that do: "
                                 f"{_names(lambda c: call.decay in c.decays)}")  # fmt: skip
    if call.beta_scale != 1.0 and not caps.beta_scale:
        raise BackendUnavailable(f"{fn}: backend {name!r} does not scale beta (beta_scale={call.beta_scale}, "
                                 f"OLMo-Hybrid's negative eigenvalues); the backends that do: "
                                 f"{_names(lambda c: c.beta_scale)}")  # fmt: skip
    if call.parents is not None:
        check_trees(backend, fn)
    check_tape(backend, fn, call.record)
    check_math(backend, fn, call.math)
    dtype = call.pool.dtype
    if dtype not in caps.state_dtypes:
        raise BackendUnavailable(f"{fn}: backend {name!r} takes state pools of {[str(d) for d in caps.state_dtypes]}, "
                                 f"got {dtype}")  # fmt: skip
    D = call.q.shape[-3]
    if caps.max_drafts is not None and D > caps.max_drafts:
        raise BackendUnavailable(f"{fn}: backend {name!r} verifies at most {caps.max_drafts} draft steps, got D={D}")
    check_sizes(backend, fn, call_sizes(call))
    if caps.multiples and platform() == "gpu":
        H, K = call.q.shape[-2:]
        HV, V = call.pool.shape[-3], call.pool.shape[-2]
        sizes = {"H": H, "HV": HV, "K": K, "V": V}
        bad = [f"{d}={sizes[d]} a multiple of {m}" for d, m in caps.multiples.items() if sizes[d] % m]
        if bad:
            raise ValueError(f"{fn}: backend {name!r} needs {', '.join(bad)} on this platform; use backend 'pallas' or "
                             "'triton'")  # fmt: skip
