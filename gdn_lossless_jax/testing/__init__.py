"""The testing side of the library: what a test of a backend, a model or a pipeline needs.

* :mod:`~.asserts`: bitwise assertions (bit patterns, never tolerances) and NumPy oracles;
  re-exported here (``gl.testing.assert_bitwise_equal``, ...).
* :mod:`~.equivalence`: the shared equivalence suite, :func:`run_equivalence_suite`, that
  holds a backend (yours too) to its own snapshot path and to the controls.
* :mod:`~.cases`: case factories (adversarial inputs, commit indices) for tests and benchmarks.
* :mod:`~.expect`: what a commit must write, in NumPy.
* :mod:`~.controls`: the wrong rounding forms and the wrong commit ordering a test must catch.
* :func:`backend_verify`: a backend's verify called directly, with its own options.
"""

from . import asserts, cases, controls, equivalence, expect
from .asserts import (
    BitwiseReport,
    assert_bitwise_differs,
    assert_bitwise_equal,
    assert_trees_bitwise_equal,
    bits,
    compare_bitwise,
    fma_oracle,
    mul_oracle,
    replay_oracle,
    ulp_distance,
    ulp_stats,
)
from .calls import backend_verify
from .equivalence import DEFAULT_SHAPES, run_equivalence_suite

__all__ = [*asserts.__all__, "run_equivalence_suite", "DEFAULT_SHAPES", "backend_verify", "cases", "controls",
           "equivalence", "expect"]
