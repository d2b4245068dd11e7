"""Moved to :mod:`gdn_lossless_jax.tools.demo`; this alias is removed in the next release."""

from .. import _deprecated

_deprecated.moved_module(__name__, "gdn_lossless_jax.tools.demo")
