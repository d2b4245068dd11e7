"""The device decode loop (gdn_lossless_jax.model.loop), CPU, the tiny model.

K steps per call (drafting, verify, acceptance, commit and the next inputs on the device) must
give what the per-step engine gives: the same tokens, the same logits (their top-2 gaps, bit
for bit) and, where the schedule is the same, the same final states bit for bit; in both record
modes, with the commit deferred into the next verify, and with sampling. Requests join and
leave (between calls), finish mid-call (masked), resume from the prefix cache with boundaries
crossed twice in one call. Controls: a wrong replay form (twice rounded) in the commit must change the states;
a loop fed a wrong token buffer must change the tokens.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FULL_TESTS, full_only
from gdn_lossless_jax import conv, reference
from gdn_lossless_jax.model import Engine, Request, get_config, init_params
from gdn_lossless_jax.model.decode import SpecStep, accept
from gdn_lossless_jax.model.loop import DecodeLoop, LoopInputs
from gdn_lossless_jax.testing import assert_bitwise_differs, assert_bitwise_equal, controls

CONFIG = get_config("tiny")
ROWS, D, K = 4, 4, 4
TRACK = 8  # a call moves up to K * D = 16 tokens: two boundaries in one call
MAX_LEN = 160


def _engine(params, K, record="tuples", **kw):
    kw = {"track_interval": TRACK, **kw}
    return Engine(params, CONFIG, record=record, drafts=kw.pop("drafts", D), max_batch=ROWS, max_len=MAX_LEN,
                  steps_per_call=K, **kw)  # fmt: skip


def _requests(rng):
    """Six requests for four rows: a prompt longer than a call consumes (K * D = 16), one token,
    a repeated token, the vocabulary's ends; budgets that end mid-call; late arrivals."""
    V = CONFIG.vocab
    r = lambda n: [int(t) for t in rng.integers(0, V, n)]  # noqa: E731
    prompts = [r(41), [int(rng.integers(V))], [int(rng.integers(V))] * 9, [0, V - 1] * 5, r(7), r(18)]
    return [Request(p, n, a) for p, n, a in zip(prompts, [37, 50, 9, 23, 30, 13], [0, 0, 0, 0, 3, 5])]


def _states(engine):
    return engine.host_states()


def _run(engine, requests):
    res = engine.generate(requests)
    return res, _states(engine)


@pytest.fixture(scope="module")
def params():
    return init_params(CONFIG, 11)


def test_loop_equals_the_per_step_engine(params, seed):
    """Joins, leaves and prefix-cache tracking: tokens, predictions and logit gaps equal."""
    reqs = _requests(np.random.default_rng(seed))
    one, _ = _run(_engine(params, 1), reqs)
    eng = _engine(params, K)
    loop, _ = _run(eng, reqs)
    assert eng.compiles == 1
    for a, b in zip(one, loop):
        assert a.tokens == b.tokens
        n = len(a.request.prompt) + len(a.tokens)
        np.testing.assert_array_equal(a.predictions[:n], b.predictions[:n])
        assert_bitwise_equal(a.gaps[: n - 1], b.gaps[: n - 1], "top-2 logit gaps, per step vs the device loop")
        assert a.tracked == b.tracked or (a.tracked and b.tracked and a.tracked[-1] == b.tracked[-1])
    # A second turn resumes from a state the loop tracked: equal to recomputing the prefix.
    # (request 1 ends at 51 tokens, at most 54 in its state: its last boundary, 48, is in its tokens)
    prompt2 = [*reqs[1].prompt, *loop[1].tokens, 5, 6, 7]
    turn2 = eng.generate([Request(prompt2, 20)])[0]
    assert turn2.resumed > 0
    fresh = _engine(params, K, track_interval=0).generate([Request(prompt2, 20)])[0]
    assert turn2.tokens == fresh.tokens


@pytest.mark.parametrize("variant", ["snapshots", "deferred", pytest.param("none", marks=full_only)])
def test_loop_states_bitwise(params, seed, variant):
    """One schedule (every request admitted at once): the final states of the device loop equal
    the per-step engine's (tuples) bit for bit; the snapshot path and the deferred commit too.
    ``none`` (D = 1, no speculation) gives plain greedy decoding's tokens."""
    rng = np.random.default_rng(seed)
    reqs = [Request(r.prompt, r.max_new_tokens) for r in _requests(rng)[:ROWS]]
    base, base_states = _run(_engine(params, 1, track_interval=0), reqs)
    kw = {"snapshots": {"record": "snapshots"}, "deferred": {"defer_commit": True}, "none": {"drafts": 1}}[variant]
    # (no prefix cache: the loop keeps a request's last boundary of a call only, so slots are taken in
    # another order and the pools would be laid out otherwise)
    res, states = _run(_engine(params, K, track_interval=0, **kw), reqs)
    assert [r.tokens for r in res] == [r.tokens for r in base]
    if variant != "none":  # (speculation runs past a request's end: other positions in the state)
        assert_bitwise_equal(base_states, states, f"final states, per-step tuples vs the device loop ({variant})")


def _wrong_commit(pool, slots, steps, track_slots, track_steps, rows):
    ssm = reference.commit(pool.ssm, pool.tape, slots, steps, track_slots, track_steps, rows,
                           rule=controls.CONTROLS["twice_rounded"])  # fmt: skip
    cv = conv.conv_commit(pool.conv, pool.conv_windows, slots, steps, track_slots, track_steps, rows)
    return dataclasses.replace(pool, ssm=ssm, conv=cv)


def test_controls_are_caught(params, seed):
    """A wrong replay form in the loop's commit changes the final states; a token buffer shifted
    by one changes the tokens."""
    reqs = [Request(r.prompt, r.max_new_tokens) for r in _requests(np.random.default_rng(seed))[:ROWS]]
    _, snap = _run(_engine(params, K, "snapshots", track_interval=0), reqs)
    _, wrong = _run(_engine(params, K, commit=_wrong_commit, track_interval=0), reqs)
    assert_bitwise_differs(snap, wrong, "twice-rounded replay form in the device loop's commit")
    eng = _engine(params, K, track_interval=0)
    good = eng.generate(reqs)
    eng2 = _engine(params, K, track_interval=0)
    shifted = [Request(r.prompt[1:] + r.prompt[:1], r.max_new_tokens) for r in reqs]
    bad = eng2.generate(shifted)
    assert [r.tokens for r in good] != [r.tokens for r in bad]


def test_sampling_same_tokens_for_any_k_and_record_mode(params, seed):
    """Speculative sampling: the draws depend on the request and its position only, so the
    tokens equal with K = 1 and K = 4 (and in both record modes: GDN_FULL_TESTS=1), joins
    included; and they differ from greedy decoding's and with another seed (the control)."""
    reqs = _requests(np.random.default_rng(seed))
    cases = ((1, "tuples"), (K, "tuples"), *(((K, "snapshots"),) if FULL_TESTS else ()))
    runs = [_engine(params, k, rec, temperature=0.7, seed=seed).generate(reqs) for k, rec in cases]
    toks = [[r.tokens for r in run] for run in runs]
    assert all(t == toks[0] for t in toks)
    other = [r.tokens for r in _engine(params, K, temperature=0.7, seed=seed + 1).generate(reqs)]
    greedy = [r.tokens for r in _engine(params, K).generate(reqs)]
    assert other != toks[0] and greedy != toks[0]


def test_accept_sampling_is_lossless():
    """With a one-hot draft, the first emitted token has exactly the target's distribution:
    the frequencies over 40,000 keys match ``softmax(logits / T)`` (chi-square, 7 degrees of
    freedom, p > 1e-4), whatever the draft proposed; the control (accepting every draft) fails."""
    V, n, T = 8, 40_000, 0.9
    rng = np.random.default_rng(1)
    lg = jnp.asarray(np.repeat(rng.normal(0, 1.5, (1, 2, V)).astype(np.float32), n, axis=0))
    p = np.asarray(jax.nn.softmax(lg[0, 0] / T))
    draft = int(np.argsort(p)[-2])  # a likely but not the likeliest token
    x = jnp.tile(jnp.asarray([[3, draft]], jnp.int32), (n, 1))
    keys = jax.random.split(jax.random.key(7), n)
    y, _, m = jax.jit(lambda lg, x, k: accept(lg, x, jnp.ones((n,), jnp.int32), temperature=T, key=k))(lg, x, keys)
    first = np.where(np.asarray(m) == 2, draft, np.asarray(y)[:, 0])  # accepted: the draft; else the residual draw
    counts = np.bincount(first, minlength=V)
    chi2 = float(np.sum((counts - n * p) ** 2 / (n * p)))
    assert chi2 < 33.0, f"chi-square {chi2:.1f} over {V - 1} degrees of freedom: not the target's distribution"
    wrong = np.full(n, draft)  # control: a greedy-style acceptance of every draft
    assert float(np.sum((np.bincount(wrong, minlength=V) - n * p) ** 2 / (n * p))) > 33.0


def test_errors_name_the_argument(params):
    step = SpecStep(CONFIG, D)
    with pytest.raises(ValueError, match="'steps_per_call' must be a positive integer, got 0"):
        DecodeLoop(step, 0)
    with pytest.raises(ValueError, match="'steps_per_call' must be even .* got 3"):
        _engine(params, 3, defer_commit=True)
    eng = _engine(params, K)
    inp = eng._loop_inputs([])
    with pytest.raises(ValueError, match=r"'inputs.tokens' must have W columns, a multiple of D=4 and >= K \* D = 16"):
        eng.loop(eng.params, eng.state, dataclasses.replace(inp, tokens=inp.tokens[:, :8]))
    with pytest.raises(ValueError, match="'temperature' must be a number >= 0"):
        SpecStep(CONFIG, D, temperature=-1.0)
    sampling = DecodeLoop(SpecStep(CONFIG, D, temperature=0.5), K)
    with pytest.raises(ValueError, match="'inputs.key' must be a jax.random key, got None"):
        sampling(eng.params, eng.state, inp)
    assert isinstance(inp, LoopInputs)


def test_admission_is_one_flush_and_one_copy_a_round(params, monkeypatch, seed):
    """Requests admitted together cost one flush of the pending commit and one slot copy, whatever
    their number (one of each a request made a batch of 293 flush the whole pool 293 times: 25 ms a
    step on an H100), and give the tokens and states that admitting them one call at a time gives.
    Control: the counter sees a flush the engine makes outside admission (host_states)."""
    from gdn_lossless_jax import pool as pool_mod
    from gdn_lossless_jax.model import engine as engine_mod

    rng = np.random.default_rng(seed)
    reqs = [Request([int(t) for t in rng.integers(0, CONFIG.vocab, 5)], 6) for _ in range(ROWS)]
    calls = {"flush": 0, "copy": 0}
    flush, copy = pool_mod.flush, engine_mod._copy_slots

    def counted(name, fn):
        def wrapped(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)

        return wrapped

    e = _engine(params, 2, defer_commit=True, track_interval=0)
    e.warmup()
    monkeypatch.setattr(pool_mod, "flush", counted("flush", flush))
    monkeypatch.setattr(engine_mod, "_copy_slots", counted("copy", copy))
    res = e.generate(reqs)
    assert calls == {"flush": 1, "copy": 1}, calls
    e.host_states()
    assert calls["flush"] == 2  # the control: a flush outside admission is counted
    # One request a round (arrivals one step apart): the same tokens for each request.
    staggered = [dataclasses.replace(r, arrival=i) for i, r in enumerate(reqs)]
    res1 = _engine(params, 2, defer_commit=True, track_interval=0).generate(staggered)
    assert [r.tokens for r in res] == [r.tokens for r in res1]
