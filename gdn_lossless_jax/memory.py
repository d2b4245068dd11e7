"""Moved to :mod:`gdn_lossless_jax.tools.memory`; this alias is removed in the next release."""

import sys
import warnings

from .tools.memory import __name__ as _new

warnings.warn(f"{__name__} moved to {_new}; the old name is removed in the next release", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = sys.modules[_new]
