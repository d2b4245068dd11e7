"""The ``pallas`` backend: Pallas kernels (Triton backend) for verify and commit.

On a GPU they compile through Pallas Triton with the rule pinned in PTX on CUDA (the
portable integer form on ROCm, or on request); on a CPU the same kernel bodies run in
Pallas interpret mode with the portable form, so CI covers their logic. JAX 0.11
deprecates Pallas Triton (it still ships and is the GPU default in 0.12); this module is
the only place that depends on it.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp

from ..contract import Capabilities, ConvKernels, VerifyCall
from .. import BackendUnavailable, platform
from .commit import CommitConfig, commit_snapshots, commit_tuples
from .conv import conv_commit, conv_verify
from .rounding import COMPILER_FORMS, CONTROL_FORMS, FORMS, ISAS, default_form
from .verify import VerifyConfig
from .verify import verify as _verify

__all__ = ["name", "capabilities", "verify", "replay", "commit", "check_available", "check_math", "conv_kernels",
           "VerifyConfig", "CommitConfig", "FORMS", "ISAS", "conv_verify", "conv_commit", "kernel_form"]  # fmt: skip

name = "pallas"
#: Both record modes; the beta scale (OLMo-Hybrid's, applied in the gate prologue); draft trees (each
#: node's parent state replayed from the program's own tuples, no state stored a node:
#: ``verify._tree_loop``); ``math="portable"`` in interpret mode (the CPU) only: on a GPU the kernels'
#: prologue and chain would need the portable functions lowered by Pallas Triton (not done;
#: :func:`check_math` refuses). KDA's per-channel decay too (``decay="channel"``: the gates in XLA,
#: ``reference.prepare_call``; each chunk of the state decayed by its own key channels' factors,
#: ``tiles._decays``; the chain algorithm only). On a GPU K must be a power of two: the prologue and the
#: commit load whole ``[K]`` rows, and Pallas Triton takes power-of-two arrays only (Olmo-Hybrid-7B's
#: K = 96 runs on the reference there: ``"auto"`` picks it).
capabilities = Capabilities(trees=True, math_modes=("platform", "portable"), control_forms=CONTROL_FORMS,
                            decays=("scalar", "channel"), beta_scale=True, powers_of_two=("K",))  # fmt: skip


def _interpret() -> bool:
    return platform() == "cpu"


def check_available(op: str, math: str = "platform") -> None:
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
    check_math(op, math)


def check_math(op: str, math: str) -> None:
    """Refuse ``math="portable"`` on a GPU (the kernels run it in interpret mode only)."""
    if math == "portable" and not _interpret():
        raise BackendUnavailable(
            f"{op}: backend 'pallas' implements math='portable' in interpret mode (on the CPU) only, not on a GPU "
            "yet. Alternatives: backend='reference' (any platform), or math='platform'."
        )


def kernel_form() -> str | None:
    """The instruction set the conv kernel pins its fma with here (:data:`ISAS`): ``"ptx"`` on
    CUDA, ``"portable"`` in interpret mode; None where it does not run (ROCm: its division is
    not pinned there, so the conv stays in XLA), or where Pallas Triton is missing."""
    try:
        check_available("conv")
    except BackendUnavailable:
        return None
    form = default_form(_interpret())
    return form if form == "ptx" or _interpret() else None


def conv_kernels() -> ConvKernels | None:
    """The Pallas conv kernels where they run here (:func:`kernel_form`), else None (XLA)."""
    form = kernel_form()
    if form is None:
        return None
    interpret = form == "portable"
    return ConvKernels(functools.partial(conv_verify, form=form, interpret=interpret),
                       functools.partial(conv_commit, interpret=interpret))  # fmt: skip


def _form(form: str | None, allowed=FORMS) -> str:
    """The kernels' instruction set for a rounding ``form``: ``"pinned"`` (and None) is the
    platform's pinned form, PTX on CUDA and AMDGCN on ROCm (:func:`default_form`); ``"ptx"`` and
    ``"amdgcn"`` name one of them explicitly (:data:`ISAS`); ``"portable"`` the integer form."""
    interpret = _interpret()
    if form is None:
        form = default_form(interpret)
    elif form == "pinned":
        if interpret:
            raise BackendUnavailable("pallas: the 'pinned' rounding form needs a GPU; interpret mode uses 'portable'")
        form = default_form(False)
    if form not in allowed + ISAS:
        raise ValueError(f"pallas: rounding form must be one of {allowed} (or an instruction set, {ISAS}), "
                         f"got {form!r}")  # fmt: skip
    if interpret and form in ISAS:
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
        if tape.stores_states:
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


# The earlier contract's attributes (capabilities.trees, capabilities.math_modes): one release.
def __getattr__(attr: str):
    from ..contract import _old_capability

    return _old_capability(__name__, capabilities, attr)
