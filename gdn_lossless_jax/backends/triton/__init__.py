"""The ``triton`` backend: Triton kernels for verify and commit, called through jax-triton.

Optional: it needs a GPU, ``triton`` and ``jax-triton`` (``pip install
'gdn_lossless_jax[triton]'``; jax-triton 0.3.1 pairs with jax 0.11.2 and triton 3.6).
Importing this package never fails; :func:`check_available` (called by the backend
registry before any use) raises :class:`~gdn_lossless_jax.backends.BackendUnavailable`
where it cannot run.

Kernels (``verify.py``, ``commit.py``) pin the rounding rule with ``tl.fma`` and use
libdevice's ``exp`` (the one XLA and Pallas call on the GPU), so tapes recorded here replay
bit for bit in the other backends on the same device (see ``_lang.py``).

It runs GDN layers (one decay per v-head) and KDA layers (``decay="channel"``: one decay per
key channel, the :class:`~gdn_lossless_jax.tape.KDATuples` tape; KDA's norms and gates are
computed in XLA, then the same chain kernel decays each column of the state by its own
channel's factor), both record modes, the fused commit (``commit_and_verify``) with either
tape pending; linear chains only (no draft trees), ``math="platform"`` only, beta unscaled.
"""

from __future__ import annotations

import warnings

from ..contract import Capabilities, VerifyCall
from .. import BackendUnavailable, platform
from ._lang import IMPORT_ERROR, import_jax_triton
from .commit import COMPILER_FORMS, CONTROL_FORMS, FORMS, CommitConfig, commit_snapshots, commit_tuples
from .commit import replay as _replay
from .verify import VerifyConfig
from .verify import verify as _verify

__all__ = ["name", "capabilities", "verify", "replay", "commit", "check_available", "conv_kernels", "VerifyConfig",
           "CommitConfig", "FORMS", "CONTROL_FORMS"]  # fmt: skip

name = "triton"
#: Both record modes; GDN's scalar decay and KDA's per-channel one; chains only (its verify kernels
#: take no tree); the platform's math.
capabilities = Capabilities(control_forms=CONTROL_FORMS, decays=("scalar", "channel"))

_INSTALL = "pip install 'gdn_lossless_jax[triton]' (jax-triton 0.3.1, for jax 0.11.2 and triton 3.6)"
_ALTERNATIVES = "Alternatives: 'pallas' (Pallas Triton), 'reference' (pure JAX, any platform), 'auto'."


def conv_kernels():
    """The Pallas backend's conv kernels on a GPU (jax-triton has no conv here), else None (XLA)."""
    if platform() != "gpu":
        return None
    from .. import pallas

    return pallas.conv_kernels()


def check_available(op: str, math: str = "platform") -> None:
    """Raise :class:`BackendUnavailable` unless a GPU, triton and jax-triton are all here."""
    p = platform()
    if p != "gpu":
        raise BackendUnavailable(
            f"{op}: backend 'triton' runs Triton kernels on a CUDA or ROCm GPU through jax-triton, "
            f"but JAX's default platform here is {p!r}. {_ALTERNATIVES} On a GPU machine, install it with: {_INSTALL}."
        )
    if IMPORT_ERROR is not None:
        raise BackendUnavailable(
            f"{op}: backend 'triton' needs the 'triton' package, which cannot be imported on platform {p!r} "
            f"({IMPORT_ERROR}). Install it with: {_INSTALL}. {_ALTERNATIVES}"
        ) from IMPORT_ERROR
    try:
        import_jax_triton()  # restores os.environ (jax-triton sets TRITON_CACHE_DIR; _lang.py)
    except ImportError as e:
        raise BackendUnavailable(
            f"{op}: backend 'triton' needs 'jax-triton', which cannot be imported on platform {p!r} ({e}). "
            f"Install it with: {_INSTALL}. {_ALTERNATIVES}"
        ) from e


def verify(call: VerifyCall, *, config: VerifyConfig = VerifyConfig()):
    """See :func:`gdn_lossless_jax.verify`; ``config`` sets the kernel's tile and launch."""
    check_available("verify")
    outputs, fields, *pool = _verify(call, config=config)
    return (outputs, call.record(*fields), *pool)


def _form(form: str) -> str:
    if form == "rule":
        warnings.warn("triton: form='rule' is now form='pinned' (every backend's name for the rule pinned by the "
                      "platform's instructions); the old name is removed in the next release", DeprecationWarning,
                      stacklevel=3)  # fmt: skip
        return "pinned"
    allowed = FORMS + CONTROL_FORMS + COMPILER_FORMS
    if form not in allowed:
        raise ValueError(f"triton: replay form must be one of {allowed}, got {form!r}")
    return form


def replay(state0, tuples, steps, *, config: CommitConfig = CommitConfig(), form: str = "pinned",
           math: str = "platform"):
    """See :func:`gdn_lossless_jax.replay`: the commit kernel on a one-layer pool made of state0
    (a :class:`~gdn_lossless_jax.tape.KDATuples` tape: each key channel's own decay, from g's rank).

    ``form`` other than ``"pinned"`` (:data:`CONTROL_FORMS`, ``"naive"``) is for tests only.
    """
    check_available("replay")
    return _replay(state0, tuples.u, tuples.k, tuples.g, steps, config=config, form=_form(form))


def commit(
    pool,
    tape,
    slots,
    steps,
    track_slots,
    track_steps,
    rows,
    *,
    config: CommitConfig = CommitConfig(),
    form: str = "pinned",
    math: str = "platform",
):
    """See :func:`gdn_lossless_jax.commit`: one launch for all layers, in place on the pool.

    ``form`` (tuple tapes only) as in :func:`replay`.
    """
    check_available("commit")
    idx = (slots, steps, track_slots, track_steps, rows)
    if tape.stores_states:
        return commit_snapshots(pool, tape.states, *idx, config=config)
    return commit_tuples(pool, tape.u, tape.k, tape.g, *idx, config=config, form=_form(form))
