"""A draft that agrees with the target like a trained one: a construction, not training.

With random weights a layer-skipping draft almost never proposes the target's token, so a
speculative step buys nothing and the end-to-end comparison users care about (speculation
against plain decoding) is not measured. Trained drafts (Qwen3.5/3.6's MTP block) propose the
target's greedy token most of the time: 2.4-3.8 tokens a step with 3 drafts, prose to code.

The construction. The draft runs the target's first ``draft_layers`` blocks, its final norm and
its head; the target adds the contributions of every later block to the same residual stream.
:func:`scale_residuals` multiplies the output projections of those later blocks (the GDN and
attention out-projections, the MLPs' down-projections) by one factor ``c``: at ``c = 0`` the
target's logits are the draft's (every proposal accepted), at ``c = 1`` the model as
initialised (random agreement). In between, the later blocks perturb the draft's logits, and
the target's argmax moves away from the draft's exactly where the draft's top two are close:
as with a trained draft, disagreements sit at near-ties, and the runner-up is often the
target's token (draft trees pay). Every block is still computed at full cost; only the values
of a few weight matrices change.

:func:`calibrate` picks ``c`` by bisection on ``log c``, each probe a greedy run of the engine
over prompts of its own (never the benchmark's), for one of two targets: an *agreement* ``p``,
the share of drafted tokens the target accepts, measured with one draft a step (``D = 2``: each
decoding step proposes one token, whose acceptance is a draw of the agreement at that position);
or *tokens per step* at the run's own ``D`` (or tree), what the published acceptance of trained
drafts is quoted in. Independent draws would give ``1 + p + ... + p^(D-1)`` tokens a step; the
construction's disagreements cluster (a near-tie in one position makes the next harder), so at
``D = 4`` an agreement of 0.7 gives fewer than 2.5: calibrate on tokens per step for a bar quoted
in them. Runs report what they measured.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import numpy as np

from .model import ModelConfig, Params

__all__ = ["scale_residuals", "Calibration", "calibrate", "measure", "measure_agreement"]


def scale_residuals(params: Params, config: ModelConfig, factor: float) -> Params:
    """``params`` with the output projections of every block after the draft's scaled by
    ``factor`` (the embedding, the draft's blocks, the norms and the head unchanged)."""
    if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor >= 0):
        raise ValueError(f"scale_residuals: argument 'factor' must be a finite number >= 0, got {factor!r}")
    f = float(factor)

    def scaled(i, blk):
        if i < config.draft_layers:
            return blk
        mixer = blk.mixer
        out = "w_out" if hasattr(mixer, "w_out") else "w_o"
        w = getattr(mixer, out)
        mixer = dataclasses.replace(mixer, **{out: (w * f).astype(w.dtype)})
        mlp = dataclasses.replace(blk.mlp, w_down=(blk.mlp.w_down * f).astype(blk.mlp.w_down.dtype))
        return dataclasses.replace(blk, mixer=mixer, mlp=mlp)

    return dataclasses.replace(params, blocks=tuple(scaled(i, b) for i, b in enumerate(params.blocks)))


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What :func:`calibrate` found.

    Attributes:
      metric: ``"agreement"`` or ``"tokens_per_step"`` (:func:`calibrate`).
      target: the value asked for.
      factor: the scale of the later blocks' output projections chosen.
      measured: the metric measured at ``factor``.
      samples: decoding steps behind ``measured``.
      probes: ``(factor, metric)`` of every probe, in order.
    """

    metric: str
    target: float
    factor: float
    measured: float
    samples: int
    probes: tuple[tuple[float, float], ...]

    def as_dict(self) -> dict:
        return {"metric": self.metric, "target": self.target, "factor": self.factor, "measured": self.measured, "samples": self.samples,
                "probes": [list(p) for p in self.probes]}  # fmt: skip


def measure(params: Params, config: ModelConfig, *, drafts: int = 2, tree=None, prompts: int = 16,
            prompt_len: int = 16, tokens: int = 48, seed: int = 1, backend: str = "auto", steps_per_call: int = 1,
            **engine_kwargs) -> dict:  # fmt: skip
    """A greedy run of the engine over ``prompts`` random prompts of ``seed`` (``tokens`` new tokens
    each), ``drafts`` inputs a step (or a ``tree``). Returns ``agreement`` (drafted tokens accepted
    / drafted tokens verified, over the steps that decoded: the per-token agreement at ``drafts =
    2``), ``tokens_per_step`` (1 + the mean accepted drafts a decoding step) and ``samples`` (the
    decoding steps)."""
    from .engine import Engine, Request

    rng = np.random.default_rng(seed)
    reqs = [Request(rng.integers(0, config.vocab, prompt_len).tolist(), tokens) for _ in range(prompts)]
    D = drafts if tree is None else None
    e = Engine(params, config, record="tuples", drafts=D or 2, max_batch=prompts, backend=backend, tree=tree,
               max_len=prompt_len + tokens + (D or 64), steps_per_call=steps_per_call, **engine_kwargs)  # fmt: skip
    results = e.generate(reqs)
    accepted = np.concatenate([np.asarray(r.accepted, np.float64) for r in results])
    proposed = np.concatenate([np.asarray(r.proposed, np.float64) for r in results])
    # Steps that decoded; a prompt chunk's given inputs are not drafts. With one draft a step, each
    # decoding step proposes one token: its acceptance is the agreement at that position.
    full = proposed == proposed.max(initial=0)  # steps that drafted every input (not a prompt's last chunk)
    return {"agreement": float(accepted.sum() / max(proposed.sum(), 1)) if D == 2 else None,
            "tokens_per_step": float(1 + accepted[full].mean()) if full.any() else 1.0, "samples": int(accepted.size)}


def measure_agreement(params: Params, config: ModelConfig, **kwargs) -> tuple[float, int]:
    """``(agreement, samples)`` of :func:`measure` with one draft a step."""
    m = measure(params, config, drafts=2, **kwargs)
    return m["agreement"], m["samples"]


def calibrate(params: Params, config: ModelConfig, target: float, *, metric: str = "agreement", tol: float | None = None,
              max_probes: int = 12, lo: float = 1e-3, hi: float = 4.0, log: Callable[[str], None] | None = None,
              **measure_kwargs) -> tuple[Params, Calibration]:  # fmt: skip
    """Parameters whose draft agrees with the target about as asked.

    ``metric="agreement"``: ``target`` is the share of drafted tokens accepted, measured with one
    draft a step (:func:`measure`, ``drafts=2``); ``metric="tokens_per_step"``: ``target`` is the
    mean tokens a decoding step gains, measured at the ``drafts`` (or ``tree``) of
    ``measure_kwargs`` (pass the run's own batch, steps per call and backend to measure on its
    compiled step). Bisection on ``log factor`` in ``[lo, hi]`` (both fall as the factor grows),
    stopping within ``tol`` (default 0.02, or 0.05 tokens a step) or after ``max_probes`` probes;
    the closest probe is kept. Returns ``(params scaled, Calibration)``.
    """
    if metric == "agreement":
        if not (isinstance(target, (int, float)) and 0.0 < target < 1.0):
            raise ValueError(f"calibrate: argument 'target' (an agreement) must be in (0, 1), got {target!r}")
        measure_kwargs = {**measure_kwargs, "drafts": 2, "tree": None}
    elif metric == "tokens_per_step":
        if not (isinstance(target, (int, float)) and target > 1.0):
            raise ValueError(f"calibrate: argument 'target' (tokens a step) must be a number > 1, got {target!r}")
    else:
        raise ValueError(f"calibrate: argument 'metric' must be 'agreement' or 'tokens_per_step', got {metric!r}")
    tol = (0.02 if metric == "agreement" else 0.05) if tol is None else tol
    probes: list[tuple[float, float, int]] = []

    def probe(f):
        m = measure(scale_residuals(params, config, f), config, **measure_kwargs)
        probes.append((f, m[metric], m["samples"]))
        if log:
            log(f"calibrate: factor {f:.4g} -> {metric} {m[metric]:.3f} ({m['samples']} decoding steps)")
        return m[metric]

    a_lo, a_hi = probe(lo), probe(hi)
    if a_hi <= target <= a_lo:  # else out of reach: the closer end is kept
        l, h = math.log(lo), math.log(hi)
        for _ in range(max_probes - 2):
            if min(abs(a - target) for _, a, _ in probes) <= tol:
                break
            mid = math.exp((l + h) / 2)
            if probe(mid) > target:
                l = math.log(mid)
            else:
                h = math.log(mid)
    f, a, n = min(probes, key=lambda p: abs(p[1] - target))
    cal = Calibration(metric, float(target), float(f), float(a), int(n),
                      tuple((float(x), float(y)) for x, y, _ in probes))  # fmt: skip
    return jax.block_until_ready(scale_residuals(params, config, f)), cal
