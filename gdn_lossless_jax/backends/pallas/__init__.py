"""The ``pallas`` backend: Pallas kernels (Triton backend) for verify and commit.

On a GPU they compile through Pallas Triton with the rule pinned in PTX on CUDA (the
portable integer form on ROCm, or on request); on a CPU the same kernel bodies run in
Pallas interpret mode with the portable form, so CI covers their logic. JAX 0.11
deprecates Pallas Triton (it still ships and is the GPU default in 0.12); this module is
the only place that depends on it.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from ...tape import Snapshots
from ..contract import VerifyCall
from .. import BackendUnavailable, platform
from .commit import CommitConfig, commit_snapshots, commit_tuples
from .conv import conv_commit, conv_verify
from .rounding import COMPILER_FORMS, CONTROL_FORMS, FORMS, default_form
from .verify import VerifyConfig
from .verify import verify as _verify

__all__ = ["verify", "replay", "commit", "check_available", "check_math", "MATH_MODES", "VerifyConfig", "CommitConfig",
           "FORMS", "conv_verify", "conv_commit", "kernel_form", "TREES"]

#: The verify kernel takes draft trees (``VerifyCall.parents``): each node's parent state replayed from
#: the program's own tuples, no state stored a node (``verify._tree_loop``).
TREES = True


def _interpret() -> bool:
    return platform() == "cpu"


def check_available(op: str) -> None:
    p = platform()
    if p not in ("cpu", "gpu"):
        raise BackendUnavailable(
            f"{op}: backend 'pallas' runs Pallas Triton on CUDA/ROCm GPUs (or in interpret mode on a CPU), "
            f"not on platform {p!r}. Alternatives: 'reference' (any platform)."
        )
    try:
        from jax.experimental.pallas import triton as _  # noqa: F401
    except ImportError as e:
        raise BackendUnavailable(
            f"{op}: backend 'pallas' needs Pallas Triton, which this JAX ({jax.__version__}) lacks on platform {p!r} "
            f"({e}). Alternatives: 'triton' (jax-triton, on a GPU) or 'reference'."
        ) from e




#: ``math="portable"`` runs in interpret mode (the CPU) only: on a GPU, the kernels' prologue and
#: chain would need the portable functions lowered by Pallas Triton (not done; check_math refuses).
MATH_MODES = ("platform", "portable")


def check_math(op: str, math: str) -> None:
    if math == "portable" and not _interpret():
        raise BackendUnavailable(
            f"{op}: backend 'pallas' implements math='portable' in interpret mode (on the CPU) only, not on a GPU "
            "yet. Alternatives: backend='reference' (any platform), or math='platform'."
        )


def kernel_form() -> str | None:
    """The rounding form the conv kernel runs with here: ``"ptx"`` on CUDA, ``"portable"`` in
    interpret mode; None where it does not run (ROCm: its division is not pinned there, so
    the conv stays in XLA), or where Pallas Triton is missing."""
    try:
        check_available("conv")
    except BackendUnavailable:
        return None
    form = default_form(_interpret())
    return form if form == "ptx" or _interpret() else None


def _form(form: str | None, allowed=FORMS) -> str:
    interpret = _interpret()
    form = form or default_form(interpret)
    if form not in allowed:
        raise ValueError(f"pallas: rounding form must be one of {allowed}, got {form!r}")
    if interpret and form in ("ptx", "amdgcn"):
        raise BackendUnavailable(f"pallas: the {form!r} rounding form needs a GPU ({'CUDA' if form == 'ptx' else 'ROCm'}); "
                                 "interpret mode uses 'portable'")
    return form


def verify(call: VerifyCall, *, form=None, config=None, pending_control=None):
    """See :func:`gdn_lossless_jax.verify`; ``config`` (a :class:`VerifyConfig`) sets the kernel's tile
    and launch, by default :func:`~gdn_lossless_jax.backends.pallas.verify.tuned_config` of the shape."""
    allowed = (None, *CONTROL_FORMS, *COMPILER_FORMS, "track_after_write")
    if pending_control not in allowed:
        raise ValueError(f"pallas verify: argument 'pending_control' (tests only) must be one of {allowed}, "
                         f"got {pending_control!r}")  # fmt: skip
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
        return _verify(call, config=config, form=_form(form), interpret=_interpret(), pending_control=pending_control)


def commit(pool, tape, slots, steps, track_slots, track_steps, rows, *, form=None, config=CommitConfig(),
           math="platform"):
    """``form``: a rounding form (:data:`FORMS`; None: the platform's) or, in tests, a control
    (:data:`CONTROL_FORMS`, wrong by construction, or the compiler's ``"naive"``) built from the
    platform form's instructions."""
    idx = (slots, steps, track_slots, track_steps, rows)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
        if isinstance(tape, Snapshots):
            return commit_snapshots(pool, tape.states, *idx, config=config, interpret=_interpret())
        control = None
        if form in CONTROL_FORMS + COMPILER_FORMS:  # the control forms are for tests
            control, form = form, None
        return commit_tuples(pool, tape.u, tape.k, tape.g, *idx, config=config, form=_form(form),
                             interpret=_interpret(), math=math, control=control)


def replay(state0, tuples, steps, *, form=None, config=CommitConfig(), math="platform"):
    """The commit kernel on a one-layer pool made of state0 (slot i = request i)."""
    N = state0.shape[0]
    ar = jnp.arange(N, dtype=jnp.int32)
    none = jnp.full((N,), -1, jnp.int32)
    tape = jax.tree.map(lambda t: t[None], tuples)
    return commit(state0[None], tape, ar, steps, none, none, ar, form=form, config=config, math=math)[0]
