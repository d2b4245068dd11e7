"""Lossless speculative verify for Gated DeltaNet layers in JAX.

Verify records ``(u, k, g)`` per draft step instead of a full state snapshot; commit
replays the accepted chain from the untouched pool state with exactly the rounding verify
used, so the committed state is bit-identical to the snapshot path.
"""

from . import _deprecated, autodiff, checked, checks, conv, pool, portable, reference, rounding, sharding, sync, testing
from . import tree
from .api import MATH_MODES, RECORD_MODES, commit, commit_and_verify, replay, verify
from .backends import BACKENDS, BackendUnavailable
from .config import MODELS, Geometry, get_geometry
from .tape import KDATuples, Pending, Snapshots, Tape, Tuples, stack_tapes

__version__ = "0.1.0"

__all__ = [
    "verify",
    "replay",
    "commit",
    "commit_and_verify",
    "Pending",
    "Tuples",
    "KDATuples",
    "Snapshots",
    "Tape",
    "stack_tapes",
    "RECORD_MODES",
    "MATH_MODES",
    "BACKENDS",
    "BackendUnavailable",
    "Geometry",
    "MODELS",
    "get_geometry",
    "autodiff",
    "checked",
    "checks",
    "conv",
    "pool",
    "portable",
    "reference",
    "rounding",
    "sharding",
    "sync",
    "testing",
    "tree",
]

# Modules that moved to the tools and testing subpackages: one release under their old name.
_moved = _deprecated.alias(__name__, {
    "cases": "gdn_lossless_jax.testing.cases",
    "memory": "gdn_lossless_jax.tools.memory",
    "equivalence": "gdn_lossless_jax.testing.equivalence",
    "cli": "gdn_lossless_jax.tools.cli",
    "check": "gdn_lossless_jax.tools.check",
    "fuzz": "gdn_lossless_jax.tools.fuzz",
    "viz": "gdn_lossless_jax.tools.viz",
})  # fmt: skip


def __getattr__(name: str):
    if name == "tools":  # imported on first use: the core does not need it
        import importlib

        return importlib.import_module(f"{__name__}.tools")
    return _moved(name)
