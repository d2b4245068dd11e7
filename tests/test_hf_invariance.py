"""Invariant decoding for the checkpoint models (``HFConfig.invariant``, on by default on the CPU), as
``tests/test_invariance.py`` shows it for the demo model; on the tiny random checkpoints of
``tests/fixtures/hf/`` (4 blocks: 3 GDN, 1 gated attention; ``qwen3_5_moe`` and ``qwen3_next`` with the
sparse MoE, ``qwen3_5`` a dense MLP; each with an MTP block).

* ``test_speculative_is_plain_greedy_property``: speculative greedy decoding (the MTP draft or the
  self-draft, D of 1, 2 or 4; the checkpoint step has no draft trees) against plain greedy decoding (D = 1)
  of the same requests in the same batch rows: every request's tokens, the top-2 logit gap and the
  prediction at every position the speculative run accepted, and its final SSM, conv and KV states (plain
  decoding stopped at the same position) bit for bit. Control: the mode off
  (``test_speculative_is_plain_greedy_control_mode_off``).
* ``test_batch_invariance_property``: a request decoded alone in a batch of one row and in a drawn row of
  a batch of four with other requests and empty rows: the same tokens, gaps and states (the MTP block's
  hidden state and KV rows included) bit for bit. Control: the mode off
  (``test_batch_invariance_control_mode_off``).

Each example decodes a few steps of a float32 or bfloat16 checkpoint; more examples with GDN_FULL_TESTS=1.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import seed as hseed
from hypothesis import strategies as st

from conftest import FULL_TESTS, examples
from gdn_lossless_jax.model import PretrainedModel, load_pretrained
from gdn_lossless_jax.model.decode import StepInputs, allocate_state
from gdn_lossless_jax.model.hf import HFConfig
from gdn_lossless_jax.model.hf.step import MTPSpecStep, MTPState
from gdn_lossless_jax.testing import assert_bitwise_differs, assert_bitwise_equal
from test_invariance import Batch, cpu_only

GDN_SEED = int(os.environ["GDN_SEED"])
FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
#: The fixtures the default run draws from (the MoE and the MTP block); GDN_FULL_TESTS=1 adds the others.
MODELS = ("qwen3_5_moe",) + (("qwen3_next", "qwen3_5") if FULL_TESTS else ())
STEPS, MAX_LEN = 3, 40

pytestmark = pytest.mark.filterwarnings("ignore:load_pretrained.*vision tower:UserWarning")

_MODELS: dict = {}


def model(mt: str, dtype: str, draft: str, invariant: bool | None = None) -> PretrainedModel:
    """The fixture ``mt`` in ``dtype`` with ``draft`` (``"mtp"`` or ``"self"``), its config's ``invariant``
    set (the name records it: each setting compiles its own step)."""
    key = (mt, dtype, draft, invariant)
    if key not in _MODELS:
        m = load_pretrained(FIXTURES / mt, dtype, draft=draft)
        config = dataclasses.replace(m.config, invariant=invariant, name=f"{mt}-inv-{invariant}")
        _MODELS[key] = PretrainedModel(config, m.params)
    return _MODELS[key]


def decode(m: PretrainedModel, D: int, prompts: dict, batch: Batch, n_steps: int, stop: dict | None = None):
    """Greedy decoding of ``batch`` (``prompts[r]``: request r's prompt) by ``m``'s step of D inputs for
    ``n_steps`` steps, or with ``stop`` (``{request: position}``) until each request has that many tokens
    in its state (a request that has them sits out the remaining steps: an empty row).

    Returns ``{request: (tokens, gaps, predictions, states)}``: its tokens (prompt, then accepted), the
    top-2 logit gap and the prediction at each position it accepted, in order, and its slot's final
    states: SSM, conv, the KV cache's positions in its state (per attention layer; the entries past them
    are a rejected draft's), and with the MTP draft the block's hidden state."""
    step = m.step(D)
    slots, _, rows, n_slots, n_requests = batch.indices()
    state = allocate_state(step.config, slots=n_slots, requests=n_requests, drafts=D, record="tuples",
                           max_len=MAX_LEN)  # fmt: skip
    if isinstance(step, MTPSpecStep):
        state = MTPState(state.pool, state.kv, jnp.zeros((n_slots + 1, step.config.d_model), step.config.jnp_dtype))
    N = batch.N
    seqs = [list(prompts[r]) if r is not None else [0] for r in batch.filled]
    pos = np.zeros(N, np.int32)
    gaps, preds = [[] for _ in range(N)], [[] for _ in range(N)]
    t = 0
    while True:
        active = np.array([r is not None and (pos[i] < stop[r] if stop else t < n_steps)
                           for i, r in enumerate(batch.filled)])  # fmt: skip
        if not active.any():
            break
        known = [s[p:] for s, p in zip(seqs, pos)]
        n_given = np.array([min(D, len(k)) for k in known], np.int32)
        inputs = StepInputs(slots=np.where(active, slots, -1).astype(np.int32), rows=rows, pos=pos.copy(),
                            tokens=np.array([(k[:D] + [0] * D)[:D] for k in known], np.int32), n_given=n_given,
                            track_slots=np.full(N, -1, np.int32))  # fmt: skip
        state, out = step(m.params, state, jax.tree.map(jnp.asarray, inputs))
        out = jax.device_get(out)
        for i in np.flatnonzero(active):
            k = int(out.accepted[i])
            seqs[i] += [int(x) for x in out.inputs[i, n_given[i] : k]]  # accepted drafts
            gaps[i] += list(out.gaps[i, :k])
            preds[i] += [int(x) for x in out.predictions[i, :k]]
            pos[i] += k
            if pos[i] == len(seqs[i]):
                seqs[i].append(int(out.predictions[i, k - 1]))  # the bonus token
        t += 1
    host = jax.device_get(state)
    result = {}
    for i, r in enumerate(batch.filled):
        if r is None:
            continue
        s, p = slots[i], int(pos[i])
        states = {"ssm": host.pool.ssm[:, s], "conv": host.pool.conv[:, s], "kv_k": host.kv.k[:, s, :p],
                  "kv_v": host.kv.v[:, s, :p]}  # fmt: skip
        if isinstance(host, MTPState):
            states["hidden"] = host.hidden[s]
        result[r] = (seqs[i], np.array(gaps[i], np.float32), np.array(preds[i], np.int32), states)
    return result


def _target(states: dict, m: PretrainedModel) -> dict:
    """The target's states: SSM, conv and its own attention layers' KV (not the MTP block's)."""
    A = m.config.kinds.count("attention")
    return {"ssm": states["ssm"], "conv": states["conv"], "kv_k": states["kv_k"][:A], "kv_v": states["kv_v"][:A]}


def assert_spec_is_plain(m: PretrainedModel, D: int, prompts: dict, batch: Batch, what: str) -> int:
    """Speculative decoding (D inputs a step, STEPS steps) against plain greedy decoding (D = 1) of the
    same batch, each request stopped where the speculative run left it: tokens, gaps and predictions at
    every accepted position, and the target's final states, bit for bit. Returns the drafted tokens the
    speculative run accepted."""
    spec = decode(m, D, prompts, batch, STEPS)
    plain = decode(m, 1, prompts, batch, 0, stop={r: len(v[1]) for r, v in spec.items()})
    drafted = 0
    for r, (tokens, gaps, preds, states) in spec.items():
        p_tokens, p_gaps, p_preds, p_states = plain[r]
        assert tokens == p_tokens, f"{what}: request {r}'s tokens, speculative vs plain greedy"
        assert_bitwise_equal(gaps, p_gaps, f"{what}: request {r}'s top-2 logit gaps at its {len(gaps)} positions, "
                             "speculative vs plain greedy")  # fmt: skip
        assert_bitwise_equal(preds, p_preds, f"{what}: request {r}'s predictions")
        assert_bitwise_equal(_target(states, m), _target(p_states, m), f"{what}: request {r}'s final SSM, conv "
                             "and KV states, speculative vs plain greedy")  # fmt: skip
        drafted += max(0, len(gaps) - len(prompts[r]))
    return drafted


def assert_same_requests(want: dict, got: dict, what: str):
    assert want.keys() == got.keys()
    for r in want:
        assert got[r][0] == want[r][0], f"{what}: request {r}'s tokens"
        assert_bitwise_equal(want[r][1:], got[r][1:], f"{what}: request {r}'s gaps, predictions and states")


def draw_case(data, max_requests: int):
    mt = data.draw(st.sampled_from(MODELS), label="checkpoint")
    draft = data.draw(st.sampled_from(["mtp", "self"]), label="draft")
    dtype = data.draw(st.sampled_from(["float32", "bfloat16"]), label="dtype")
    D = data.draw(st.sampled_from([1, 2, 4]), label="D")
    n = data.draw(st.integers(1, max_requests), label="requests")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1), label="prompt seed"))
    vocab = model(mt, dtype, draft).config.vocab
    prompts = {r: [int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 10)))] for r in range(n)}
    order = data.draw(st.permutations(range(4)), label="rows")  # request r in row order[r]
    filled = [None] * 4
    for r in prompts:
        filled[order[r]] = r
    return model(mt, dtype, draft), D, prompts, Batch(filled)


# ---------------------------------------------------------------------------------
# Speculative == plain greedy decoding.
# ---------------------------------------------------------------------------------
@cpu_only
@hseed(GDN_SEED)
@settings(max_examples=examples(12 if FULL_TESTS else 2))
@given(st.data())
def test_speculative_is_plain_greedy_property(data):
    """Speculative greedy decoding (the MTP draft or the self-draft, a chain of drawn D) == plain greedy
    decoding: tokens, top-2 gaps and predictions at every accepted position, final states, bit for bit."""
    m, D, prompts, batch = draw_case(data, 3)
    c = m.config
    drafted = assert_spec_is_plain(m, D, prompts, batch, f"{c.name} {c.draft} D={D}, rows {batch.filled}, {c.dtype}")
    event("drafted tokens accepted" if drafted else "no drafted token accepted")


#: The controls' case: two requests of 12 prompt tokens, verified as three chunks of D = 4.
CONTROL_PROMPTS = {0: [int(t) for t in np.random.default_rng(0).integers(0, 256, 12)],
                   1: [int(t) for t in np.random.default_rng(1).integers(0, 256, 12)]}  # fmt: skip


@cpu_only
def test_speculative_is_plain_greedy_control_mode_off():
    """The control: with the mode off, the 4-token verify's logits are not the one-token decode's."""
    m = model("qwen3_5_moe", "float32", "mtp", invariant=False)
    with pytest.raises(AssertionError, match="speculative vs plain greedy"):
        assert_spec_is_plain(m, 4, CONTROL_PROMPTS, Batch([0, 1]), "control (the mode off)")


# ---------------------------------------------------------------------------------
# Batch invariance.
# ---------------------------------------------------------------------------------
@cpu_only
@hseed(GDN_SEED)
@settings(max_examples=examples(12 if FULL_TESTS else 2))
@given(st.data())
def test_batch_invariance_property(data):
    """A request alone in a batch of one row == the same request in a drawn row of a batch of four with
    0-3 other requests (the rest empty), bit for bit: tokens, gaps, predictions and final states."""
    m, D, prompts, batch = draw_case(data, 4)
    c = m.config
    together = decode(m, D, prompts, batch, STEPS)
    alone = decode(m, D, {0: prompts[0]}, Batch([0]), STEPS)
    row = batch.filled.index(0)
    assert_same_requests(alone, {0: together[0]}, f"{c.name} {c.draft} D={D}: request 0 alone vs in row {row} of "
                         f"{batch.filled}, {c.dtype}")  # fmt: skip


@cpu_only
def test_batch_invariance_control_mode_off():
    """The control: with the mode off, a request alone and beside three others get other bits (XLA:CPU's
    dots of one row and of four)."""
    m = model("qwen3_5_moe", "float32", "mtp", invariant=False)
    prompts = {0: [5, 6, 7, 1, 2], 1: [9, 4], 2: [1, 2, 3], 3: [8]}
    together = decode(m, 1, prompts, Batch([3, 0, 1, 2]), STEPS)
    alone = decode(m, 1, {0: prompts[0]}, Batch([0]), STEPS)
    assert_bitwise_differs(alone[0][1:], together[0][1:], "control (the mode off: request 0 alone vs with three "
                           "others)")  # fmt: skip


def test_invariant_mode_switch_and_errors():
    """HFConfig's ``invariant`` as ModelConfig's: the default follows the platform, True elsewhere raises,
    other values are refused; the fixtures' configs leave it None."""
    c = model("qwen3_5_moe", "float32", "mtp").config
    assert isinstance(c, HFConfig) and c.invariant is None
    assert c.invariant_dots == (jax.default_backend() == "cpu")
    assert dataclasses.replace(c, invariant=False).invariant_dots is False
    if jax.default_backend() == "cpu":
        assert dataclasses.replace(c, invariant=True).invariant_dots is True
    else:
        with pytest.raises(NotImplementedError, match="CPU only"):
            dataclasses.replace(c, invariant=True).invariant_dots
    with pytest.raises(ValueError, match="HFConfig: invariant must be None, True or False, got 'yes'"):
        dataclasses.replace(c, invariant="yes")
