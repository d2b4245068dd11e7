"""Tree drafting in the demo model (gdn_lossless_jax.model.treestep), CPU, the tiny model.

A tree step (the draft's top-k at each depth, every node verified at once through the pool with
the tree's parents, the longest matching root path committed) must give plain greedy decoding's
tokens, the same final states in both record modes bit for bit, and the same with the device
loop (GDN_FULL_TESTS=1). Control: committing a path one node short of the accepted one changes the states.
"""

import dataclasses

import numpy as np
import pytest

from conftest import FULL_TESTS
from gdn_lossless_jax.model import Engine, Request, get_config, init_params
from gdn_lossless_jax.model import treestep
from gdn_lossless_jax.model.treestep import TreeStep, tree_nodes
from gdn_lossless_jax.testing import assert_bitwise_differs, assert_bitwise_equal

CONFIG = get_config("tiny")
TREE = (2, 2)


def _requests(rng):
    V = CONFIG.vocab
    return [Request([int(t) for t in rng.integers(0, V, n)], k) for n, k in ((5, 24), (21, 17), (1, 30), (9, 11))]


def _run(params, reqs, config=CONFIG, **kw):
    eng = Engine(params, config, max_batch=4, max_len=96, backend="reference", **kw)
    res = eng.generate(reqs)
    return [r.tokens for r in res], eng.host_states(), np.concatenate([r.accepted for r in res])


def test_tree_drafting_is_lossless(seed):
    params = init_params(CONFIG, seed % 2**31)
    reqs = _requests(np.random.default_rng(seed))
    greedy = _run(params, reqs, drafts=1)[0]
    t_tok, t_states, t_acc = _run(params, reqs, tree=TREE, record="tuples")
    s_tok, s_states, _ = _run(params, reqs, tree=TREE, record="snapshots")
    assert t_tok == greedy and s_tok == greedy
    assert_bitwise_equal(s_states, t_states, "tree: final states, tuples vs snapshots")
    if FULL_TESTS:  # the device loop runs the same body (test_loop.py checks it for chains)
        l_tok, l_states, _ = _run(params, reqs, tree=TREE, steps_per_call=4)
        assert l_tok == greedy
        assert_bitwise_equal(t_states, l_states, "tree: final states, per step vs the device loop")
    assert t_acc.max() >= 2, "some step must accept a path of two drafted nodes"
    print(f"\ntree {TREE}: mean accepted {t_acc.mean():.2f} of depth {len(TREE)}")


def test_control_a_short_path_is_caught(seed, monkeypatch):
    params = init_params(CONFIG, seed % 2**31)
    reqs = _requests(np.random.default_rng(seed))
    _, good, _ = _run(params, reqs, tree=TREE, record="snapshots")
    path_to = treestep.tree_mod.path_to

    def short(parents, nodes, width=None):  # the accepted path without its last node, the step kept
        path, steps = path_to(parents, nodes, width)
        return path.at[np.arange(path.shape[0]), steps].set(-1, mode="drop"), steps

    monkeypatch.setattr(treestep.tree_mod, "path_to", short)
    _, bad, _ = _run(params, reqs, config=dataclasses.replace(CONFIG, name="tiny-tree-control"), tree=TREE)
    assert_bitwise_differs(good, bad, "control: a path one node short")


def test_tree_errors_name_the_argument():
    assert tree_nodes((2, 2, 2)) == 15 and tree_nodes((4,)) == 5
    with pytest.raises(ValueError, match=r"'drafts' must be 1 \+ the tree's nodes = 7 for tree=\(2, 2\), got 4"):
        TreeStep(CONFIG, 4, tree=(2, 2))
    with pytest.raises(ValueError, match="'tree' must be a non-empty tuple of positive integers"):
        TreeStep(CONFIG, 1, tree=())
    with pytest.raises(ValueError, match="'temperature' is not supported with a draft tree"):
        TreeStep(CONFIG, 7, temperature=0.5, tree=(2, 2))
    step = TreeStep(CONFIG, 7, tree=(2, 2))
    assert step.parents.tolist() == [-1, 0, 0, 1, 1, 2, 2] and step.depths.tolist() == [0, 1, 1, 2, 2, 2, 2]
    assert step.ancestors[5].tolist() == [True, False, True, False, False, True, False]
