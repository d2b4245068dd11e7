"""End-to-end greedy speculative decoding with the hybrid model (gdn_lossless_jax.model), CPU.

For D in {2, 8} (and 4 with GDN_FULL_TESTS=1), in both record modes, with fresh weights and
prompts per run (GDN_SEED): 8 prompts one at a time (300 tokens each), the same 8 prompts as
one batch of 4 rows with requests joining and leaving, and a two-turn conversation whose
second turn resumes from a prefix-cache state tracked at an interval boundary. Checked:

- the two record modes give identical tokens and bit-identical final states (SSM, conv, KV);
- every token sequence equals plain greedy decoding with the target alone (D = 1, fed the
  same tokens): where it does not, the plain target's top-2 logit gap there is below 1e-4
  (a near-tie that a different summation order flipped), and the count is printed;
- the second turn did resume from the tracked prefix, and its tokens equal a run that
  recomputes the prefix;
- each run repeated gives identical tokens and states; the step is traced once per mode (the
  repeat at D = 8 with tuples; at every D and in both modes with GDN_FULL_TESTS=1).

Controls the checks must catch: a wrong replay form in the commit
(``controls.CONTROLS["twice_rounded"]``) and the track state replayed after the in-place write
(``controls.commit_accepted_first``), injected through the engine's ``commit``.
"""

import dataclasses

import jax
import numpy as np
import pytest

from conftest import FULL_TESTS, full_only
from gdn_lossless_jax import conv, reference, rounding
from gdn_lossless_jax.tools.cli import main
from gdn_lossless_jax.model import Engine, ModelConfig, PrefixCache, Request, SpecStep, get_config, init_params
from gdn_lossless_jax.testing import assert_bitwise_differs, assert_bitwise_equal
from gdn_lossless_jax.testing import controls

CONFIG = get_config("tiny")
MODES = ("tuples", "snapshots")
TRACK = 32  # track interval of every engine here
ROWS = 4  # batch rows of every engine here (one shape: one compilation per D and mode)
NEW = 300
MAX_LEN = 80 + NEW + 8 + 2  # the longest prompt (turn 2 of the conversation) + new tokens + D
TIE = 1e-4


def _engine(params, D, record, commit=None, track=TRACK):
    return Engine(params, CONFIG, record=record, drafts=D, max_batch=ROWS, max_len=MAX_LEN, track_interval=track,
                  commit=commit)  # fmt: skip


def _prompts(rng):
    """8 prompts: random ones and adversarial ones (one token, one repeated token, the
    vocabulary's ends, exactly one and two track intervals long, a prefill that crosses
    two boundaries)."""
    V = CONFIG.vocab
    r = lambda n: [int(t) for t in rng.integers(0, V, n)]  # noqa: E731
    return [
        r(12),
        [int(rng.integers(V))],
        [int(rng.integers(V))] * 20,
        [0, V - 1] * 9,
        r(TRACK),
        r(TRACK + 1),
        r(2 * TRACK + 7),
        r(5),
    ]


def _states(engine):
    s = engine.state
    return jax.device_get((s.pool.ssm, s.pool.conv, s.kv))


@dataclasses.dataclass
class Run:
    """One record mode's scenarios: token lists and final states per scenario."""

    single: list  # Result per prompt, one at a time
    batch: list  # Result per request, as one batch
    turn1: object
    turn2: object
    recompute: object
    states: dict
    traces: int


def _scenarios(params, prompts, D, record, *, repeat_single=None, commit=None):
    step = SpecStep(CONFIG, D, TRACK, "auto", commit)
    before = step.traces
    states = {}
    eng = _engine(params, D, record, commit)
    single = [eng.generate([Request(p, NEW)])[0] for p in prompts[:repeat_single]]
    states["single"] = _states(eng)
    assert eng.compiles <= 1, f"the step was traced {eng.compiles} times in one decode loop"

    eng = _engine(params, D, record, commit)
    lens = [NEW, 40, 120, NEW, 7, 200, 60, 150]
    arrivals = [0, 0, 0, 2, 5, 9, 30, 31]
    batch = eng.generate([Request(p, n, a) for p, n, a in zip(prompts, lens, arrivals)])
    states["batch"] = _states(eng)
    assert eng.compiles <= 1

    eng = _engine(params, D, record, commit)
    t1 = eng.generate([Request(prompts[0], 90)])[0]
    prompt2 = [*prompts[0], *t1.tokens, *prompts[7]]
    t2 = eng.generate([Request(prompt2, 60)])[0]
    states["conversation"] = _states(eng)
    states["resumed_slot"] = jax.device_get(_slot(eng, eng.cache.lookup(prompt2)[1]))
    re = _engine(params, D, record, commit).generate([Request(prompt2, 60)])[0]
    return Run(single, batch, t1, t2, re, states, step.traces - before)


def _slot(engine, slot):
    s = engine.state
    return s.pool.ssm[:, slot], s.pool.conv[:, slot], s.kv.k[:, slot], s.kv.v[:, slot]


_PLAIN: dict = {}


def _plain_predictions(params, key, seqs):
    """The target alone (D = 1) fed each (prompt, tokens): its greedy token and top-2 gap
    after every position. Cached per weights."""
    todo = [s for s in seqs if (key, s) not in _PLAIN]
    if todo:
        eng = _engine(params, 1, "tuples", track=0)
        res = eng.generate([Request([*p, *t[:-1]], 1) for p, t in todo])
        for s, r in zip(todo, res):
            _PLAIN[key, s] = (r.predictions, r.gaps)
    return [_PLAIN[key, s] for s in seqs]


def _check_greedy(params, key, pairs, what):
    """Every sequence equals plain greedy decoding wherever the target is not near a tie.
    Returns the number of tokens that differ (all at near-ties)."""
    seqs = [(tuple(p), tuple(t)) for p, t in pairs]
    ties = 0
    for (p, t), (pred, gap) in zip(seqs, _plain_predictions(params, key, seqs)):
        L, n = len(p), len(t)
        want, g = pred[L - 1 : L - 1 + n], gap[L - 1 : L - 1 + n]
        bad = np.nonzero(want != np.asarray(t))[0]
        for i in bad:
            assert g[i] < TIE, (
                f"{what}: token {i} is {t[i]}, plain greedy decoding gives {want[i]}, and the target's top-2 logit "
                f"gap there is {g[i]:.3g} (not a near-tie below {TIE})"
            )
        ties += len(bad)
    return ties


# D = 4 takes the code paths of D = 2 and 8 (and runs in the controls, bf16 and soak tests below);
# CI's CPU run keeps D = 8 (the suite's time, docs/testing.md).
@pytest.mark.parametrize("D", [pytest.param(2, marks=full_only), pytest.param(4, marks=full_only), 8])
def test_speculative_decoding(D, seed):
    rng = np.random.default_rng(seed)
    params = init_params(CONFIG, seed)
    prompts = _prompts(rng)
    runs = {mode: _scenarios(params, prompts, D, mode) for mode in MODES}
    tup, snap = runs["tuples"], runs["snapshots"]

    # The record modes: identical tokens, bit-identical final states.
    for name in ("single", "batch"):
        for i, (a, b) in enumerate(zip(getattr(tup, name), getattr(snap, name))):
            assert a.tokens == b.tokens, f"{name} prompt {i}: tuples and snapshots tokens differ"
    for name in ("turn1", "turn2", "recompute"):
        assert getattr(tup, name).tokens == getattr(snap, name).tokens, f"{name}: tuples and snapshots differ"
    for name in tup.states:
        assert_bitwise_equal(snap.states[name], tup.states[name], f"{name}: final states, snapshots vs tuples")
    assert tup.traces == snap.traces == 1, f"traces per mode: tuples {tup.traces}, snapshots {snap.traces}"

    # The conversation: the first turn crossed >= 2 boundaries, the second resumed from the
    # last one it shares, and gives the tokens of a run that recomputes the prefix.
    t1, t2, re = tup.turn1, tup.turn2, tup.recompute
    assert len(t1.tracked) >= 2, f"the first turn crossed {t1.tracked} track boundaries"
    shared = len(prompts[0]) + len(t1.tokens)
    assert t2.resumed == max(b for b in t1.tracked if b <= shared) > 0, (t2.resumed, t1.tracked)
    assert re.resumed == 0
    if t2.tokens != re.tokens:
        i = next(i for i, (a, b) in enumerate(zip(t2.tokens, re.tokens)) if a != b)
        pos = len(prompts[0]) + len(t1.tokens) + len(prompts[7]) - 1 + i
        assert min(t2.gaps[pos], re.gaps[pos]) < TIE, f"turn 2 resumed vs recomputed differ at token {i}, no near-tie"

    # Requests joined and left: rows and slots were reused, batch positions compacted.
    batch = tup.batch
    assert max(r.joined for r in batch) > 0 and len({r.left for r in batch}) > 1
    assert len({r.row for r in batch}) == ROWS < len(batch), "scratch rows are reassigned as requests leave"
    for r, n in zip(batch, [NEW, 40, 120, NEW, 7, 200, 60, 150]):
        assert len(r.tokens) == n

    # Lossless: the same tokens as plain greedy decoding with the target alone.
    pairs = [(p, r.tokens) for p, r in zip(prompts, tup.single)]
    pairs += [(p, r.tokens) for p, r in zip(prompts, tup.batch)]
    pairs += [(prompts[0], t1.tokens), ([*prompts[0], *t1.tokens, *prompts[7]], t2.tokens)]
    ties = _check_greedy(params, seed, pairs, f"D={D}")
    if D == 2:  # the check itself: a wrong token where the target is not near a tie fails it
        p, t = pairs[0]
        wrong = [*t[:5], (t[5] + 1) % CONFIG.vocab, *t[6:]]
        with pytest.raises(AssertionError, match=r"token 5 is .*not a near-tie"):
            _check_greedy(params, seed, [(p, wrong)], "control")
    total = sum(len(t) for _, t in pairs)
    acc = np.concatenate([r.accepted for r in tup.single])
    print(f"\nD={D}: {ties} of {total} tokens differ from plain greedy decoding, each at a near-tie "
          f"(top-2 gap < {TIE}); mean accepted {acc.mean():.2f} of {D - 1} drafts")
    assert 0 < acc.mean() < D - 1, f"mean accepted length {acc.mean()} of {D - 1}: the demo shows nothing"

    # Each run repeated gives identical tokens and states (the one-at-a-time run on 2 prompts); in CI
    # at one D and for tuples (the same steps at every D and in both modes).
    for mode in MODES if FULL_TESTS else ("tuples",) if D == 8 else ():
        again = _scenarios(params, prompts, D, mode, repeat_single=2)
        first = runs[mode]
        assert [r.tokens for r in again.single] == [r.tokens for r in first.single[:2]]
        assert [r.tokens for r in again.batch] == [r.tokens for r in first.batch]
        assert (again.turn2.tokens, again.recompute.tokens) == (first.turn2.tokens, first.recompute.tokens)
        for name in ("batch", "conversation", "resumed_slot"):
            assert_bitwise_equal(first.states[name], again.states[name], f"{mode} {name}, repeated")
        assert again.traces == 0, "a repeated run retraced the step"


# ---------------------------------------------------------------------------------------
# Controls: the wrong commits, injected through the engine's commit.
# ---------------------------------------------------------------------------------------
def _with_ssm_commit(ssm_commit):
    def commit(pool, slots, steps, track_slots, track_steps, rows):
        ssm = ssm_commit(pool.ssm, pool.tape, slots, steps, track_slots, track_steps, rows)
        cv = conv.conv_commit(pool.conv, pool.conv_windows, slots, steps, track_slots, track_steps, rows)
        return dataclasses.replace(pool, ssm=ssm, conv=cv)

    return commit


WRONG_FORM = _with_ssm_commit(lambda *a: reference.commit(*a, rule=controls.CONTROLS["twice_rounded"]))
ACCEPTED_FIRST = _with_ssm_commit(controls.commit_accepted_first)
CORRECT = _with_ssm_commit(reference.commit)  # the reference's commit, through the same wrapper


def _conversation(params, prompts, commit, record="tuples", D=4):
    eng = _engine(params, D, record, commit)
    t1 = eng.generate([Request(prompts[0], 90)])[0]
    prompt2 = [*prompts[0], *t1.tokens, *prompts[7]]
    b, slot = eng.cache.lookup(prompt2)
    resumed_state = jax.device_get(_slot(eng, slot))
    t2 = eng.generate([Request(prompt2, 60)])[0]
    return t1, t2, resumed_state, _states(eng)


def test_controls_are_caught(seed):
    """The twice-rounded replay form makes the committed states diverge from the snapshot path;
    the accepted-first ordering makes the resumed (tracked) state diverge."""
    params = init_params(CONFIG, seed)
    prompts = _prompts(np.random.default_rng(seed))
    snap = _conversation(params, prompts, None, "snapshots")
    good = _conversation(params, prompts, CORRECT)
    assert good[0].tokens == snap[0].tokens and good[1].tokens == snap[1].tokens
    assert_bitwise_equal(snap[3], good[3], "the wrapped reference commit vs the snapshot path")
    assert_bitwise_equal(snap[2], good[2], "the resumed state, wrapped reference commit vs the snapshot path")
    for name, control in (("twice-rounded form", WRONG_FORM), ("accepted first", ACCEPTED_FIRST)):
        t1, t2, resumed, states = _conversation(params, prompts, control)
        rep = assert_bitwise_differs(snap[2], resumed, f"{name}: the resumed state")
        diverged = (t1.tokens, t2.tokens) != (snap[0].tokens, snap[1].tokens)
        # Caught by the resumed state's bits; whether a wrong state also flips a greedy token
        # depends on the draw (with GDN_SEED=885234 the accepted-first state kept every token).
        print(f"\n{name}: resumed state {rep.differing} elements differ (max {rep.max_ulp} ULP); "
              f"tokens {'diverge' if diverged else 'still equal'}")


# ---------------------------------------------------------------------------------------
# Smaller pieces.
# ---------------------------------------------------------------------------------------
def test_demo_soak_reduced(capsys):
    """The soak at a reduced length (CI): 2 conversations of 2 turns x 250 tokens, the
    second turn resumed from the prefix cache, both modes; the full length is a committed log."""
    args = ["demo", "--tokens", "250", "--turns", "2", "--prompts", "2", "--batch", "2", "--track-interval", "128",
            "--progress", "off"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "verdict    identical" in out
    assert "1,000 of 1,000 tokens equal" in out and "bit-identical" in out
    for mode in MODES:
        assert f"{mode:<10} 1000 tokens" in out
    assert out.count("2 of 2 later turns resumed") == 2


def test_pallas_backend_in_the_model(capsys):
    """The model through the Pallas kernels (interpret mode on a CPU: tiny and short)."""
    args = ["demo", "--backend", "pallas", "--tokens", "10", "--turns", "2", "--prompts", "1", "--batch", "1",
            "-D", "2", "--prompt-len", "4", "--track-interval", "8", "--progress", "off"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "verdict    identical" in out and "1 of 1 later turns resumed" in out


def test_demo_help(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    for flag in ("--size", "tiny", "gpu", "--drafts", "--prompts", "--tokens", "--backend", "pallas", "--record",
                 "tuples", "snapshots", "H=16 HV=32 K=128 V=128"):
        assert flag in out


def test_prefix_cache_lru():
    c = PrefixCache(4)
    assert c.insert([1, 2, 3, 4], 7) == [] and c.insert([1, 2, 3, 4, 5, 6, 7, 8], 9) == []
    assert c.lookup([1, 2, 3, 4, 5, 6, 7, 8, 9]) == (8, 9)
    assert c.lookup([1, 2, 3, 4, 5, 6, 7, 8]) == (4, 7), "a prefix must leave one token to feed"
    assert c.lookup([1, 2, 3, 5, 5]) is None
    assert c.evict() == 9 and c.insert([1, 2, 3, 4], 3) == [7] and c.slots() == [3]
    assert c.insert([1, 2, 3, 4, 0, 0, 0, 0], 5, supersedes=[1, 2, 3, 4]) == [3] and c.slots() == [5]
    assert PrefixCache(0).lookup([1, 2, 3]) is None


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"draft's blocks must all be GDN layers, but block\(s\) \[3\]"):
        dataclasses.replace(CONFIG, draft_layers=4, layers=8)
    with pytest.raises(ValueError, match=r"kv_heads=3 must divide attn_heads=4"):
        dataclasses.replace(CONFIG, kv_heads=3)
    params = init_params(CONFIG, 0)
    eng = Engine(params, CONFIG, drafts=4, max_batch=1, max_len=32)
    with pytest.raises(ValueError, match=r"\+ D = 20 \+ 10 \+ 4 = 34 KV positions, but max_len=32"):
        eng.generate([Request([1] * 20, 10)])
    with pytest.raises(ValueError, match=r"prompt tokens must be in \[0, vocab=512\), got \[512\]"):
        eng.generate([Request([512], 1)])
    with pytest.raises(ValueError, match=r"argument 'drafts' must be a positive integer, got 0"):
        SpecStep(CONFIG, 0)
    with pytest.raises(KeyError, match=r"unknown model size 'huge'; known sizes: tiny, gpu"):
        get_config("huge")
    assert isinstance(CONFIG, ModelConfig)


def test_bf16_state_pool_gives_identical_tokens_in_both_modes(seed):
    """A bfloat16 SSM pool (snapshots rounded to bf16 on store, the replay rounded the same way):
    the two record modes decode the same tokens and leave bit-identical states."""
    import jax.numpy as jnp

    params = init_params(CONFIG, seed)
    prompts = _prompts(np.random.default_rng(seed))[:3]
    runs = {}
    for record in ("tuples", "snapshots"):
        eng = Engine(params, CONFIG, record=record, drafts=4, max_batch=ROWS, max_len=MAX_LEN, track_interval=TRACK,
                     state_dtype=jnp.bfloat16)  # fmt: skip
        out = eng.generate([Request(p, 40, 0) for p in prompts])
        runs[record] = ([r.tokens for r in out], _states(eng))
    assert runs["tuples"][0] == runs["snapshots"][0]
    assert_bitwise_equal(runs["snapshots"][1], runs["tuples"][1], "bf16 pool: final states")
    assert runs["tuples"][1][0].dtype == jnp.bfloat16


def test_draft_recurrence_through_a_kernel(monkeypatch):
    """The draft's GDN step (``decode._draft_gdn``) with a kernel backend runs the one-token verify and takes its
    snapshot: Pallas (interpret mode) gives the reference backend's bits, and both the plain fp32 step's values to
    its rounding (the plumbing: the conv, the q/k/v split, the scale). Control: a wrong query scale is not close."""
    from gdn_lossless_jax import api
    from gdn_lossless_jax.model import decode

    c = get_config("tiny")
    p = init_params(c, 3).blocks[0].mixer
    g = c.geometry
    rng = np.random.default_rng(11)
    N = 3
    arr = lambda shape, dtype, s=1.0: jax.numpy.asarray(s * rng.standard_normal(shape), dtype)  # noqa: E731
    S = arr((N, g.num_v_heads, g.head_v_dim, g.head_k_dim), "float32", 0.3)
    conv_state = arr((N, g.conv_dim, c.conv_kernel - 1), c.jnp_dtype)
    mixed, a, b = arr((N, 1, g.conv_dim), c.jnp_dtype), arr((N, 1, g.num_v_heads), c.jnp_dtype), arr((N, 1, g.num_v_heads), c.jnp_dtype)
    run = lambda **kw: decode._draft_gdn(c, S, conv_state, mixed, a, b, p, **kw)  # noqa: E731
    by_pallas, by_reference, plain = run(kernel="pallas"), run(kernel="reference"), run()
    assert_bitwise_equal(by_reference, by_pallas, "draft step: Pallas == reference")
    close = lambda x, y: np.allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=2e-2, atol=1e-4)  # noqa: E731
    assert all(close(got, want) for got, want in zip(by_pallas, plain)), "the kernel's draft step is the plain step's"
    verify = api.verify
    monkeypatch.setattr(api, "verify", lambda *args, scale=None, **kw: verify(*args, scale=1.0, **kw))
    assert not close(run(kernel="reference")[0], plain[0]), "control: the query scale 1 not caught"
