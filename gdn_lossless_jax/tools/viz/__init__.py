"""Analyses and plots behind the notebooks, for reuse: where the rounding forms differ, how far
a replay drifts, what the speculative scratch costs, the benchmark results.

The analyses need only JAX and NumPy; the ``plot_*`` functions import matplotlib when they are
called (``pip install 'gdn_lossless_jax[notebooks]'``), draw into the ``ax`` / ``axes`` they are
given (or a new figure) and return the figure.

Rounding, on one state element at a time (flat float32 arrays ``S, alpha, k, u`` of one shape
``[n]``, the inputs of one update ``S' = form(S, alpha, k, u)``):

* :func:`evaluate_forms` applies the forms of :data:`gdn_lossless_jax.testing.controls.FORMS`;
  :func:`match_forms` says which pinned form a result equals bit for bit;
* :func:`probe_platform` asks the current platform what it does with ``S*alpha + k*u``
  written plainly (eagerly, under ``jit``, in a ``lax.scan`` body, in a Pallas kernel), and
  :func:`probe_two_uses` what becomes of verify's update, where the decayed state has two uses;
* :func:`exp_on` computes the library's ``exp`` (or XLA's) on :func:`exp_grid`'s log-decays;
* :data:`REGIMES`, :func:`find_disagreements`, :func:`disagreement_map` and
  :func:`decay_sweep` find where on the number line two forms give other bits;
* :func:`replay_states` and :func:`drift_along_chain` replay a whole tape with each form and
  measure the ULP distance from the exact states, step by step.

Benchmarks: :func:`find_results` and :func:`newest_results` read the committed
``benchmarks/results/*/**/results.json`` files (kernel benchmarks and step benchmarks).
"""

from .forms import *  # noqa: F401,F403
from .forms import __all__ as _forms
from .plots import *  # noqa: F401,F403
from .plots import __all__ as _plots
from .results import *  # noqa: F401,F403
from .results import __all__ as _results

__all__ = [*_forms, *_results, *_plots]
