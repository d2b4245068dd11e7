"""The benchmark cases, defined once: geometry, configurations, modes, commit indices, pool size.

The cases: the Qwen3.5/3.6-35B-A3B geometry (30 GDN layers, H=16, HV=32, K=V=128, fp32
state, bf16 inputs; the model SGLang's lossless-verify pull request measured) and four
request x draft configurations (25x4, 8x4, 8x8, 8x16), with about 25% of the requests
crossing a track boundary at commit. The ``cpu-small`` mode runs the same code on a reduced geometry so CI keeps the harness alive;
its timings are not results. Tests import these names (``tests/test_benchmarks.py``).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from gdn_lossless_jax.testing import cases as lib_cases
from gdn_lossless_jax.config import FAMILY_MODELS, Geometry, get_geometry

__all__ = [
    "MODEL",
    "TRACK_FRACTION",
    "STATE_DTYPE",
    "INPUT_DTYPE",
    "H200_CONFIGS",
    "CPU_SMALL_CONFIGS",
    "Config",
    "Mode",
    "MODES",
    "parse_configs",
    "pool_slots",
    "commit_index_sets",
    "state_copies",
]

MODEL = "qwen3.6-35b-a3b"  # 30 GDN layers, H=16, HV=32, K=V=128
TRACK_FRACTION = 0.25  # about a quarter of the requests cross a mamba-track boundary
STATE_DTYPE = jnp.float32
INPUT_DTYPE = jnp.bfloat16

H200_CONFIGS = ("25x4", "8x4", "8x8", "8x16")
CPU_SMALL_CONFIGS = ("4x2", "2x4")


@dataclasses.dataclass(frozen=True)
class Config:
    """One configuration: ``requests`` running requests of ``drafts`` draft tokens each."""

    requests: int
    drafts: int

    @property
    def label(self) -> str:
        return f"{self.requests}x{self.drafts}"

    @classmethod
    def parse(cls, text: str) -> "Config":
        try:
            n, d = (int(x) for x in text.lower().split("x"))
        except ValueError:
            raise ValueError(f"a configuration is REQUESTSxDRAFTS (e.g. 25x4), got {text!r}") from None
        if n < 1 or d < 1:
            raise ValueError(f"configuration {text!r}: requests and drafts must be positive")
        return cls(n, d)


def parse_configs(text: str | None, default: tuple[str, ...]) -> tuple[Config, ...]:
    """``"25x4,8x4"`` -> configurations (the mode's default when ``text`` is empty)."""
    items = [s.strip() for s in (text or "").split(",") if s.strip()] or list(default)
    return tuple(Config.parse(s) for s in items)


@dataclasses.dataclass(frozen=True)
class Mode:
    """How a run is sized.

    Attributes:
      geometry: the GDN layers' shapes.
      configs: default configurations.
      trials: timed rounds; every round runs every row once, in a shuffled order.
      warmup: untimed calls per row after compiling.
      reps: verify calls per timed invocation (one jitted function of ``reps`` calls over
        ``reps`` different small-input sets and rotating state copies).
      commit_reps: commit calls per timed invocation (``commit_reps`` index sets, chained
        on the donated pool).
      rotate_bytes: the state copies of a verify row hold at least this many bytes (so the
        L2 cache, 50 MB on the H200, cannot keep a state between its uses); at most ``reps``.
      copy_bytes: size of the array of the copy-rate row (read + write are counted).
      budget_s: wall time for the timed rounds of all configurations (compiles excluded);
        rounds stop early (after at least ``min_trials``) when it is spent.
      min_trials: rounds always run, whatever the budget.
      device_invocations: invocations of every row traced with the profiler after the rounds,
        for the device time (the GPU's kernel durations; :mod:`benchmarks.devtime`); 0: none.
    """

    name: str
    geometry: Geometry
    configs: tuple[str, ...]
    trials: int
    warmup: int
    reps: int
    commit_reps: int
    rotate_bytes: int
    copy_bytes: int
    budget_s: float
    min_trials: int = 3
    device_invocations: int = 0


def _small_geometry() -> Geometry:
    # H=2, HV=4 (two v-heads per k-head, as in the model), K=V=32, two layers.
    return get_geometry(MODEL).reduced(gdn_layers=2, heads_divisor=8, head_dim=32)


MODES: dict[str, Mode] = {
    "h200": Mode(
        name="h200",
        geometry=get_geometry(MODEL),
        configs=H200_CONFIGS,
        trials=40,
        warmup=3,
        reps=16,
        commit_reps=4,
        rotate_bytes=192 * 2**20,
        copy_bytes=2 * 2**30,
        budget_s=150.0,
        min_trials=8,
        device_invocations=4,
    ),
    "cpu-small": Mode(
        name="cpu-small",
        geometry=_small_geometry(),
        configs=CPU_SMALL_CONFIGS,
        trials=3,
        warmup=1,
        reps=1,  # one call per invocation: the timed function is the compiled single call
        commit_reps=1,
        rotate_bytes=0,
        copy_bytes=8 * 2**20,
        device_invocations=1,  # keeps the trace path alive in CI (no GPU plane: no device times)
        budget_s=30.0,
        min_trials=2,
    ),
}

#: The families a benchmark can run beside the mode's GDN model (``--families``): the released models'
#: linear layers (:data:`gdn_lossless_jax.config.FAMILY_MODELS`; Kimi Linear's KDA, a per-channel decay).
FAMILIES = ("model", *FAMILY_MODELS)


def family_geometry(mode: Mode, family: str) -> Geometry:
    """The geometry of ``family`` in ``mode``: ``"model"`` the mode's own; a released family's model, reduced
    as the mode reduces its own (``cpu-small``: two layers, heads divided by 8, K = V = 32)."""
    if family == "model":
        return mode.geometry
    if family not in FAMILY_MODELS:
        raise ValueError(f"--families: unknown family {family!r}; choose from {FAMILIES}")
    g = FAMILY_MODELS[family]
    return g.reduced(gdn_layers=2, heads_divisor=8, head_dim=32) if mode.name == "cpu-small" else g


# The reference backend on the CPU, for a small geometry (reported beside a GPU run).
CPU_REFERENCE_MODE = MODES["cpu-small"]


def pool_slots(requests: int) -> int:
    """Slots of the benchmark's state pool: each request's own slot and a track slot, plus spares
    (SGLang's padding slot among them). 60 slots at 25 requests: 30 layers x 60 x 2 MiB = 3.5 GiB."""
    return 2 * requests + 10


def commit_index_sets(config: Config, reps: int, *, seed: int = 0) -> list[lib_cases.CommitIndices]:
    """``reps`` index sets for commit (different slots, steps and track crossings per set),
    from :func:`gdn_lossless_jax.testing.cases.commit_indices` with ``track_fraction=0.25``."""
    S = pool_slots(config.requests)
    return [
        lib_cases.commit_indices(
            seed * 1000 + r, N=config.requests, D=config.drafts, slots_in_pool=S, track_fraction=TRACK_FRACTION
        )
        for r in range(reps)
    ]


def state_copies(state_bytes: int, mode: Mode) -> int:
    """How many copies of one layer's state a verify row rotates through."""
    if mode.rotate_bytes <= 0:
        return 1
    return max(2, min(mode.reps, math.ceil(mode.rotate_bytes / state_bytes)))
