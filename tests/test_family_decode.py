"""OLMo-Hybrid and Kimi Linear decoding through the state pool (gdn_lossless_jax.model.hf.family_decode).

Against the committed fixtures (transformers' greedy ``generate``, tests/fixtures/hf): speculative decoding in
both record modes gives transformers' tokens, and the two pools end with the same states bit for bit (the
linear layers' SSM states and conv states). The draft is transformers' own continuation with every fifth
position changed, so that steps accept 0 to D - 1 drafts. Controls the tuples == snapshots comparison must
catch: OLMo's commit replaying with the update rounded twice; Kimi's with the per-channel decay applied as
one factor per head (testing.kda_controls.scalar_decay). The device loop (steps_per_call=K) equals the host loop
with prompt lookup: tokens, steps and the final pool bit for bit (control: a finished request's slot written
on); its on-device prompt lookup equals prompt_lookup. Draft trees (topk=2, the host loop's chain on one branch):
transformers' tokens, tuples == snapshots bit for bit (control: the siblings' path committed). Full set: greedy
through the pool (one token a step) equals transformers' for all three fixtures, speculative equals greedy, and
OLMo's beta scale ignored changes the tokens; the device loop's other record modes; OLMo-Hybrid's tree with RoPE;
the tree's attention with siblings seen, or nodes at their index's position, changes the tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ON_GPU, full_only
from gdn_lossless_jax import pool, reference
from gdn_lossless_jax.backends import reference as reference_backend
from gdn_lossless_jax.model import load_pretrained
from gdn_lossless_jax.model.hf.family import FamilyModel
from gdn_lossless_jax.model.hf import family_decode
from gdn_lossless_jax.model.hf.family_decode import FamilyDecoder, lookup_draft, prompt_lookup
from gdn_lossless_jax.tape import KDATuples, Snapshots, Tuples
from gdn_lossless_jax.testing import assert_bitwise_differs, assert_bitwise_equal
from gdn_lossless_jax.testing.controls import twice_rounded_update
from gdn_lossless_jax.testing.kda_controls import scalar_decay

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
D = 4
_MODELS: dict = {}


def _model(name: str) -> FamilyModel:
    if name not in _MODELS:
        _MODELS[name] = load_pretrained(FIXTURES / name, "float32")
    return _MODELS[name]


def _expected(name: str):
    e = np.load(FIXTURES / name / "expected.npz")
    return e["prompts"], e["generated"]


def _draft(generated):
    """transformers' continuation, every fifth position changed (a wrong proposal there)."""

    def draft(contexts, n):
        out = np.zeros((len(contexts), n), np.int32)
        for i, ctx in enumerate(contexts):
            t = len(ctx)
            want = np.resize(generated[i, t : t + n], n) if t < generated.shape[1] else np.zeros(n, np.int32)
            out[i] = np.where((t + np.arange(n)) % 5 == 2, (want + 1) % 256, want)
        return out

    return draft


class ControlBackend:
    """The reference backend whose commit replays with a wrong update form ``rule``."""

    name = "control"
    capabilities = reference_backend.capabilities
    check_available = staticmethod(reference_backend.check_available)
    conv_kernels = staticmethod(reference_backend.conv_kernels)
    verify = staticmethod(reference_backend.verify)
    replay = staticmethod(reference_backend.replay)

    def __init__(self, rule):
        self.commit = jax.jit(functools.partial(reference.commit, rule=rule), static_argnames=("math",))


def _decode(name, record, new, *, drafts=D, model=None, backend=None, lookup=False, steps_per_call=1,
            cls=FamilyDecoder):
    """Decode the fixture's prompts: the draft is ``_draft`` (transformers' tokens, some changed), or with ``lookup``
    (and always with ``steps_per_call > 1``) prompt lookup."""
    prompts, generated = _expected(name)
    dec = cls(model or _model(name), requests=prompts.shape[0], drafts=drafts, record=record, backend=backend,
              max_len=prompts.shape[1] + new + drafts - 1, steps_per_call=steps_per_call)  # one compiled step
    plain = drafts == 1 or lookup or steps_per_call > 1
    got = dec.generate(prompts, new, None if plain else _draft(generated))
    return got, dec


@pytest.mark.parametrize("name,control", [("olmo_hybrid", twice_rounded_update), ("kimi_linear", scalar_decay)])
def test_speculative_record_modes_agree(name, control, monkeypatch):
    new = 16
    prompts, generated = _expected(name)
    T = prompts.shape[1]
    want = generated[:, : T + new]
    got_t, tup = _decode(name, "tuples", new)
    got_s, snp = _decode(name, "snapshots", new)
    assert type(tup.pool.tape) is (KDATuples if name == "kimi_linear" else Tuples)
    assert type(snp.pool.tape) is Snapshots
    np.testing.assert_array_equal(got_t, want, err_msg=f"{name}: speculative (tuples) != transformers' generate")
    np.testing.assert_array_equal(got_s, want, err_msg=f"{name}: speculative (snapshots) != transformers' generate")
    assert tup.steps < new, f"{name}: no draft was accepted ({tup.steps} steps for {new} tokens)"
    assert_bitwise_equal(tup.pool.ssm, snp.pool.ssm, f"{name}: SSM states, tuples vs snapshots")
    assert_bitwise_equal(tup.pool.conv, snp.pool.conv, f"{name}: conv states, tuples vs snapshots")
    wrong = ControlBackend(control)  # the commit only: the verify (and its compiled step) unchanged
    commit = pool.commit
    monkeypatch.setattr(family_decode.pool_mod, "commit", lambda *a, backend, **k: commit(*a, backend=wrong, **k))
    _, ctl = _decode(name, "tuples", new)
    monkeypatch.undo()
    assert_bitwise_differs(ctl.pool.ssm, snp.pool.ssm, f"control {control.__name__}: caught by tuples vs snapshots")


class Unmasked(FamilyDecoder):
    """Control: the host loop with every request's slot written at every step, also after it reached its budget."""

    def _run(self, ids, pos, accept=None, active=None, parents=None):
        return super()._run(ids, pos, accept, parents=parents)


# Kimi's tuples in the CI run (each case compiles its loop, ~5 s on the CPU); the other three with GDN_FULL_TESTS.
@pytest.mark.parametrize("name,record", [pytest.param("olmo_hybrid", "snapshots", marks=full_only), ("kimi_linear", "tuples"),
                                         pytest.param("olmo_hybrid", "tuples", marks=full_only),
                                         pytest.param("kimi_linear", "snapshots", marks=full_only)])  # fmt: skip
def test_device_loop_equals_host_loop(name, record):
    """steps_per_call=K (the device loop: the draft by prompt lookup on the device, acceptance and commit there,
    requests at their budget masked mid-call) gives the host loop's tokens, step counts and final pool (SSM and
    conv states) bit for bit, for K = 4 and a K that does not divide the steps taken (the last call stops early;
    both K share one compiled loop). Control: the host loop writing a request's slot after its budget changes the
    pool."""
    new = 16
    prompts, generated = _expected(name)
    want, host = _decode(name, record, new, lookup=True)
    np.testing.assert_array_equal(want, generated[:, : prompts.shape[1] + new], err_msg=f"{name} {record}: host loop")
    assert (host.row_steps < host.steps).any(), f"{name}: every request ran every step ({host.row_steps}): no mask"
    odd = next(k for k in range(3, host.steps) if host.steps % k)
    for K in (4, odd):
        got, dec = _decode(name, record, new, steps_per_call=K)
        what = f"{name} {record}, steps_per_call={K} vs the host loop"
        np.testing.assert_array_equal(got, want, err_msg=f"{what}: tokens")
        assert (dec.steps, dec.row_steps.tolist()) == (host.steps, host.row_steps.tolist()), what
        assert_bitwise_equal(dec.pool.ssm, host.pool.ssm, f"{what}: SSM states")
        assert_bitwise_equal(dec.pool.conv, host.pool.conv, f"{what}: conv states")
    _, ctl = _decode(name, record, new, lookup=True, cls=Unmasked)
    assert_bitwise_differs(ctl.pool.ssm, dec.pool.ssm, "control: a request's slot written past its budget")


def test_lookup_draft_is_prompt_lookup(seed):
    """The device loop's draft (jnp, over a token buffer with per-row lengths) equals prompt_lookup's, on contexts
    of 1 to 24 tokens over small alphabets (repeats: n-gram hits of either length, none, short continuations)."""
    rng = np.random.default_rng(seed)
    W = 24
    for ngram in (1, 2, 3):
        for vocab in (2, 3, 6, 50):
            buf = rng.integers(0, vocab, (16, W)).astype(np.int32)
            lens = rng.integers(1, W + 1, 16).astype(np.int32)
            for n in (1, 6):
                want = prompt_lookup([buf[b, : lens[b]] for b in range(16)], n, ngram=ngram)
                got = jax.jit(lookup_draft, static_argnums=2, static_argnames="ngram")(buf, lens, n, ngram=ngram)
                np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"ngram={ngram} vocab={vocab} n={n}")


# A step's draft tree: the root (the last accepted token), then two branches of three nodes, 1 -> 3 -> 5 and
# 2 -> 4 -> 6 (breadth-first: the second branch's nodes are not at their depth's index). SIBLING: each node's
# counterpart on the other branch.
TREE = np.array([-1, 0, 0, 1, 2, 3, 4], np.int32)
SIBLING = np.array([0, 2, 1, 4, 3, 6, 5], np.int32)


def _tree_draft(generated):
    """A tree draft (tokens, TREE): the second branch is the chain the host loop drafts (``_draft``), the first
    transformers' continuation plus 2 (never the target's token)."""
    chain = _draft(generated)

    def draft(contexts, n):
        good = chain(contexts, 3)
        wrong = np.zeros_like(good)
        for i, ctx in enumerate(contexts):
            t = len(ctx)
            wrong[i] = (np.resize(generated[i, t : t + 3], 3) + 2) % 256 if t < generated.shape[1] else 1
        return np.stack([wrong[:, 0], good[:, 0], wrong[:, 1], good[:, 1], wrong[:, 2], good[:, 2]], 1), TREE

    return draft


def _decode_tree(name, record, new):
    prompts, generated = _expected(name)
    D = len(TREE)
    dec = FamilyDecoder(_model(name), requests=prompts.shape[0], drafts=D, record=record, topk=2,
                        max_len=prompts.shape[1] + new + D - 1)  # fmt: skip
    return dec.generate(prompts, new, _tree_draft(generated)), dec


def _sibling_commit(monkeypatch):
    """Control: every tree commit replays the path through the accepted nodes' siblings (the other branch)."""
    commit = pool.commit

    def wrong(p, slots, steps, *a, path=None, **k):
        if path is not None:
            path = jnp.where(path >= 0, jnp.asarray(SIBLING)[jnp.maximum(path, 0)], -1)
        return commit(p, slots, steps, *a, path=path, **k)

    monkeypatch.setattr(family_decode.pool_mod, "commit", wrong)


# Kimi Linear in the CI run (KDA trees, the attention's ancestor mask); OLMo-Hybrid with RoPE (each node at its
# depth's position) with GDN_FULL_TESTS. Each compiles the tree step per record mode (~5 s on the CPU).
@pytest.mark.parametrize("name", ["kimi_linear", pytest.param("olmo_hybrid_noneg", marks=full_only)])
def test_draft_tree(name, monkeypatch):
    """topk=2: each step verifies TREE (the linear layers through the pool with its parents, the attention along
    each node's ancestors at its depth), accepts greedily along it and commits the accepted path. With the host
    loop's chain on one branch and wrong tokens on the other: transformers' tokens, the chain decoder's steps,
    and the tuples and snapshots pools bit-identical. Control: committing the siblings' path changes the states."""
    new = 16
    prompts, generated = _expected(name)
    _, chain = _decode(name, "tuples", new)
    runs = {r: _decode_tree(name, r, new) for r in ("tuples", "snapshots")}
    for record, (got, dec) in runs.items():
        np.testing.assert_array_equal(got, generated[:, : prompts.shape[1] + new], err_msg=f"{name} tree {record}")
        assert (dec.steps, dec.row_steps.tolist()) == (chain.steps, chain.row_steps.tolist()), f"{name} {record}"
    (_, tup), (_, snp) = runs["tuples"], runs["snapshots"]
    assert tup.steps < new, f"{name}: no draft was accepted ({tup.steps} steps for {new} tokens)"
    assert type(tup.pool.tape) is (KDATuples if name == "kimi_linear" else Tuples)
    assert_bitwise_equal(tup.pool.ssm, snp.pool.ssm, f"{name} tree: SSM states, tuples vs snapshots")
    assert_bitwise_equal(tup.pool.conv, snp.pool.conv, f"{name} tree: conv states, tuples vs snapshots")
    _sibling_commit(monkeypatch)
    _, ctl = _decode_tree(name, "tuples", new)
    monkeypatch.undo()
    assert_bitwise_differs(ctl.pool.ssm, snp.pool.ssm, "control: the siblings' path committed")


def test_generate_and_errors():
    m = _model("olmo_hybrid")
    prompts, generated = _expected("olmo_hybrid")
    got = m.generate(prompts, 16, drafts=D)  # the default draft: prompt lookup
    np.testing.assert_array_equal(got, generated[:, : prompts.shape[1] + 16])
    assert prompt_lookup([np.array([5, 6, 7, 5, 6])], 3).tolist() == [[7, 5, 6]]
    assert prompt_lookup([np.array([1, 2, 3])], 2).tolist() == [[3, 3]]
    with pytest.raises(ValueError, match=r"generate: argument 'max_new_tokens' must be a positive integer, got 0"):
        m.generate(prompts, 0)
    with pytest.raises(ValueError, match=r"FamilyDecoder: argument 'drafts' must be a positive integer, got 0"):
        FamilyDecoder(m, requests=1, drafts=0, max_len=8)
    dec = FamilyDecoder(m, requests=2, drafts=2, max_len=20)
    with pytest.raises(ValueError, match=r"generate: argument 'ids' must have B=2 rows .*got 4"):
        dec.generate(prompts, 4)
    with pytest.raises(ValueError, match=r"need max_len >= 21, got 20"):
        dec.generate(prompts[:2], 8)
    dec.steps = 1
    with pytest.raises(ValueError, match=r"generate: this FamilyDecoder has decoded already"):
        dec.generate(prompts[:2], 4)
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match=rf"FamilyDecoder: argument 'steps_per_call' must be a positive integer, "
                                             rf"got {bad!r}"):  # fmt: skip
            FamilyDecoder(m, requests=1, drafts=2, max_len=8, steps_per_call=bad)
    loop = FamilyDecoder(m, requests=4, drafts=2, max_len=24, steps_per_call=4)
    with pytest.raises(ValueError, match=r"generate: argument 'draft' must be None \(prompt lookup\) with "
                                         r"steps_per_call=4: .*a host callable cannot run"):  # fmt: skip
        loop.generate(prompts, 4, _draft(generated))
    with pytest.raises(ValueError, match=r"FamilyDecoder: argument 'topk' must be a positive integer, got 0"):
        FamilyDecoder(m, requests=1, drafts=2, max_len=8, topk=0)
    with pytest.raises(ValueError, match=r"FamilyDecoder: arguments topk=2 and steps_per_call=4: the device loop "
                                         r"drafts a chain"):  # fmt: skip
        FamilyDecoder(m, requests=1, drafts=3, max_len=8, topk=2, steps_per_call=4)
    one = prompts[:, :1]  # a one-token prompt: no prefill step, the draft is asked first (nothing compiled)
    for parents, err in (([-1, 0, 0, 0], r"generate \(the draft's tree\): argument 'parents' gives node 0 of request 0 "
                                         r"3 children, more than topk=2"),
                         ([-1, -1, 0, 1], r"generate: the draft's tree must have node 0 \(the last accepted token\) as "
                                          r"its only root: .*got request 0's parents \[-1, -1, 0, 1\]"),
                         ([[-1, 0, 1]], r"generate: the draft's tree must be integer parents of shape \[D\] = \[4\] "
                                        r"or \[B, D\] = \[4, 4\] .*got int64 \[1, 3\]")):  # fmt: skip
        tree = FamilyDecoder(m, requests=4, drafts=4, max_len=8, topk=2)
        with pytest.raises(ValueError, match=err):
            tree.generate(one, 2, lambda ctx, n, p=parents: (np.zeros((4, n), np.int32), np.array(p)))


@full_only
@pytest.mark.parametrize("name", ["olmo_hybrid", "olmo_hybrid_noneg", "kimi_linear"])
def test_greedy_and_speculative_match_transformers(name):
    """Greedy through the pool (one token a step) equals transformers' generate on all 64 tokens, and the
    speculative run in both record modes equals greedy."""
    prompts, generated = _expected(name)
    new = generated.shape[1] - prompts.shape[1]
    greedy, _ = _decode(name, "tuples", new, drafts=1)
    np.testing.assert_array_equal(greedy, generated, err_msg=f"{name}: greedy through the pool != transformers")
    for record in ("tuples", "snapshots"):
        spec, _ = _decode(name, record, new)
        np.testing.assert_array_equal(spec, greedy, err_msg=f"{name}: speculative ({record}) != greedy")


# Pallas's interpret mode in a whole model: ~30 s a record mode on the CPU (GDN_FULL_TESTS=1 there; on a GPU always)
@pytest.mark.parametrize("backend", [pytest.param("pallas", marks=() if ON_GPU else full_only)])
def test_kimi_through_the_kernels(backend):
    """Kimi Linear speculative decoding with its KDA layers on a kernel backend (stacked inputs read at each layer,
    the tape written into the pool's buffer, the fused commit): transformers' tokens, tuples == snapshots bit for
    bit; in interpret mode (the CPU) the reference backend's states bit for bit too."""
    new = 8
    prompts, generated = _expected("kimi_linear")
    runs = {r: _decode("kimi_linear", r, new, backend=backend) for r in ("tuples", "snapshots")}
    for record, (got, _) in runs.items():
        np.testing.assert_array_equal(got, generated[:, : prompts.shape[1] + new], err_msg=f"{backend} {record}")
    (_, tup), (_, snp) = runs["tuples"], runs["snapshots"]
    assert type(tup.pool.tape) is KDATuples
    assert_bitwise_equal(tup.pool.ssm, snp.pool.ssm, f"{backend}: SSM states, tuples vs snapshots")
    if not ON_GPU:
        _, ref = _decode("kimi_linear", "tuples", new, backend="reference")
        assert_bitwise_equal(tup.pool.ssm, ref.pool.ssm, f"{backend} (interpret mode) == the reference backend")


@full_only
def test_control_beta_scale_ignored():
    """OLMo-Hybrid decoded with beta_scale 1 where the checkpoint has 2: other tokens than transformers'."""
    m = _model("olmo_hybrid")
    wrong = FamilyModel(dataclasses.replace(m.config, beta_scale=1.0), m.params, m.forward)
    prompts, generated = _expected("olmo_hybrid")
    got, _ = _decode("olmo_hybrid", "tuples", 16, model=wrong)
    assert (got != generated[:, : got.shape[1]]).any(), "control: beta scale ignored left every token unchanged"


# Last in the file: it clears the compiled steps (its wrong attention must not stay cached).
@full_only
@pytest.mark.parametrize("name,wrong", [("kimi_linear", "mask"), ("olmo_hybrid_noneg", "positions")])
def test_control_tree_attention(name, wrong, monkeypatch):
    """The tree step's attention with every earlier position seen (a causal mask: siblings too), or each node at
    its index's position instead of its depth's (RoPE): other tokens than transformers'."""
    mask_and_positions = family_decode._tree_mask

    def bad(parents, pos, L):
        mask, positions = mask_and_positions(parents, pos, L)
        if wrong == "mask":
            return jnp.broadcast_to(jnp.tril(jnp.ones((L, L), bool)), mask.shape), positions
        return mask, jnp.broadcast_to(jnp.arange(L), positions.shape)

    monkeypatch.setattr(family_decode, "_tree_mask", bad)
    family_decode._step.clear_cache()  # traced anew with the wrong attention, and dropped after
    try:
        got, _ = _decode_tree(name, "tuples", 16)
    finally:
        family_decode._step.clear_cache()
    prompts, generated = _expected(name)
    assert (got != generated[:, : got.shape[1]]).any(), f"control: the tree's attention {wrong} left the tokens"
