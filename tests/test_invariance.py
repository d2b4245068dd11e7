"""Invariant decoding (``ModelConfig.invariant``, on by default on the CPU): a request's tokens and
final states do not depend on the mesh, its batch row, the batch size or the other requests.

* ``test_mesh_invariance_property`` (8 simulated CPU devices: ``test_mesh_suite_in_subprocess`` in
  ``tests/test_sharding.py`` runs it): a mesh of tensor 1, 2 or 4 x data 1 or 2, the requests in
  drawn rows of the batch (empty rows between them), D and the dtype drawn: every request's tokens,
  and its SSM, conv and KV states (its slot and its prefix-cache track slot) are one device's bit for
  bit (one device: the same requests in the first rows). Control: a matmul whose order of the sum
  over K depends on the number of rows it is given (``test_mesh_invariance_control``).
* ``test_batch_invariance_property`` (one device): a request decoded alone in a batch of one row,
  and in a drawn row of a batch of four with other requests (and empty rows): the same tokens and
  states bit for bit. Control: the invariant mode off, where XLA:CPU's dot of one row and of four
  rows differ (``test_batch_invariance_control``).

Each example runs a few steps of a small float32 or bfloat16 model (one GDN block, one attention
block, 4 q/k heads so that a tensor axis of 4 fits); more examples with GDN_FULL_TESTS=1.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import seed as hseed
from hypothesis import strategies as st

from conftest import FULL_TESTS, ON_GPU, examples, full_only
from gdn_lossless_jax import sharding
from gdn_lossless_jax.model import SpecStep, allocate_state, get_config, init_params
from gdn_lossless_jax.model import model as model_mod
from gdn_lossless_jax.model import numerics
from gdn_lossless_jax.model import treestep
from gdn_lossless_jax.model.treestep import TreeStep
from gdn_lossless_jax.model.decode import decode_steps, place_on_mesh, pool_from_mesh
from gdn_lossless_jax.testing import assert_bitwise_differs, assert_bitwise_equal

GDN_SEED = int(os.environ["GDN_SEED"])
SIMULATED = 8
needs_mesh = pytest.mark.skipif(
    len(jax.devices()) < SIMULATED,
    reason=f"needs {SIMULATED} devices, {len(jax.devices())} here (on a CPU, test_mesh_suite_in_subprocess in "
    "tests/test_sharding.py runs it on simulated devices)",
)
cpu_only = pytest.mark.skipif(ON_GPU, reason="the invariant mode is implemented for the CPU only")

CONFIG = model_mod.ModelConfig(
    "inv", vocab=256, d_model=64, layers=2, attention_interval=2, num_k_heads=4, num_v_heads=8, head_k_dim=16,
    head_v_dim=16, attn_heads=4, kv_heads=2, attn_head_dim=16, mlp_dim=128,
)  # fmt: skip
MESHES = [(tp, dp) for tp in (1, 2, 4) for dp in (1, 2)]
STEPS, MAX_LEN, TRACK = 5, 48, 4


def make_plan(tp: int, dp: int) -> sharding.MeshPlan:
    auto = jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((dp, tp), ("data", "tensor"), axis_types=(auto, auto), devices=jax.devices()[: tp * dp])
    return sharding.MeshPlan(mesh, tensor="tensor", data="data")


@dataclasses.dataclass
class Batch:
    """N batch rows over ``dp`` data shards; ``filled[i]``: the request in row i, or None (empty)."""

    filled: list
    dp: int = 1

    @property
    def N(self) -> int:
        return len(self.filled)

    def indices(self):
        """``(slots, track slots, scratch rows)`` (-1: an empty row's slots), each row's on its own
        data shard, and the pool's ``slots`` and ``requests``."""
        n = self.N // self.dp
        per_slots, per_rows = 2 * n + 1, n + 1
        slots, tracks, rows = [], [], []
        for i, r in enumerate(self.filled):
            d, j = divmod(i, n)
            slots.append(d * per_slots + j if r is not None else -1)
            tracks.append(d * per_slots + n + j if r is not None else -1)
            rows.append(d * per_rows + j)
        as32 = lambda x: np.array(x, np.int32)  # noqa: E731
        return as32(slots), as32(tracks), as32(rows), self.dp * per_slots - 1, self.dp * per_rows - 1


def decode(config, D: int, prompts: dict, batch: Batch, plan=None):
    """``decode_steps`` of ``batch`` (``prompts[r]``: request r's prompt) for STEPS steps, on one
    device or through ``plan``: ``{request: (tokens, its states)}``, the states its slot's and its
    track slot's SSM, conv and KV rows."""
    slots, tracks, rows, n_slots, n_requests = batch.indices()
    params = init_params(config, 0)

    def new():
        return allocate_state(config, slots=n_slots, requests=n_requests, drafts=D, record="tuples", max_len=MAX_LEN)

    row_prompts = [prompts[r] if r is not None else [0] for r in batch.filled]
    step = SpecStep(config, D, track_interval=TRACK)
    if plan is None:
        seqs, _, state = decode_steps(step, params, new(), row_prompts, slots, rows, tracks, STEPS)
        pool = jax.device_get(state.pool)
    else:
        mparams, mstate = place_on_mesh(plan, config, params, new())
        place = lambda x: place_on_mesh(plan, config, params, new(), x)[2]  # noqa: E731
        seqs, _, state = decode_steps(dataclasses.replace(step, mesh=plan), mparams, mstate, row_prompts, slots, rows,
                                      tracks, STEPS, place=place)  # fmt: skip
        pool = pool_from_mesh(state.pool, config.geometry, plan.tp)
    kv = jax.device_get(state.kv)
    out = {}
    for i, r in enumerate(batch.filled):
        if r is None:
            continue
        at = lambda s: (pool.ssm[:, s], pool.conv[:, s], kv.k[:, s], kv.v[:, s])  # noqa: E731
        out[r] = (seqs[i], (at(slots[i]), at(tracks[i])))
    return out


def assert_same_requests(want: dict, got: dict, what: str):
    assert want.keys() == got.keys()
    for r in want:
        assert got[r][0] == want[r][0], f"{what}: request {r}'s tokens"
        assert_bitwise_equal(want[r][1], got[r][1], f"{what}: request {r}'s states (slot, track slot: SSM, conv, KV)")


def draw_case(data, max_requests: int):
    dtype = data.draw(st.sampled_from(["float32", "bfloat16"]), label="dtype")
    D = data.draw(st.sampled_from([1, 2, 4]), label="D")
    n = data.draw(st.integers(1, max_requests), label="requests")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1), label="prompt seed"))
    prompts = {r: [int(t) for t in rng.integers(0, CONFIG.vocab, int(rng.integers(1, 9)))] for r in range(n)}
    return dataclasses.replace(CONFIG, dtype=dtype), D, prompts


def row_count_matmul(every: int):
    """A deliberately row-count-dependent matmul (a control, for ``numerics._blocked_matmul``): the sum
    over K in three chunks, associated ``(p0 + p1) + p2`` when the call has a multiple of ``every`` rows,
    else ``p0 + (p1 + p2)``."""

    def matmul(a, b, **kwargs):
        M, K = math.prod(a.shape[:-1]), a.shape[-1]
        c = [slice(0, K // 3), slice(K // 3, 2 * K // 3), slice(2 * K // 3, K)]
        prec = model_mod.dot_precision(a, b)
        p = [jnp.matmul(a[..., s], b[s], precision=prec, preferred_element_type=jnp.float32) for s in c]
        out = (p[0] + p[1]) + p[2] if M % every == 0 else p[0] + (p[1] + p[2])
        return out.astype(kwargs.get("preferred_element_type") or a.dtype)

    return matmul


control_matmul = row_count_matmul(4)


# ---------------------------------------------------------------------------------
# Meshes (8 simulated devices).
# ---------------------------------------------------------------------------------
@needs_mesh
@cpu_only
@hseed(GDN_SEED)
@settings(max_examples=examples(12 if FULL_TESTS else 2))
@given(st.data())
def test_mesh_invariance_property(data):
    """Tokens and final states of every request on a drawn mesh and batch layout == one device's."""
    config, D, prompts = draw_case(data, 4)
    tp, dp = data.draw(st.sampled_from(MESHES), label="mesh tensor x data")
    N = 4
    order = data.draw(st.permutations(range(N)), label="rows")  # request r in row order[r]
    filled = [None] * N
    for r in prompts:
        filled[order[r]] = r
    want = decode(config, D, prompts, Batch([*prompts, *[None] * (N - len(prompts))]))
    got = decode(config, D, prompts, Batch(filled, dp), make_plan(tp, dp))
    assert_same_requests(want, got, f"mesh {tp}x{dp}, rows {filled}, D={D}, {config.dtype}")


@needs_mesh
@cpu_only
def test_mesh_invariance_control(monkeypatch):
    """The control: the invariant mode's blocked dot replaced by one whose order depends on how
    many rows it gets (per device on a mesh: half of them over a data axis of 2) must differ."""
    prompts = {0: [5, 6, 7], 1: [9], 2: [1, 2, 3, 4, 5], 3: [8, 8]}
    monkeypatch.setattr(numerics, "_blocked_matmul", control_matmul)
    config = dataclasses.replace(CONFIG, name="inv-control")  # its own compile
    # D = 1: the dots get 4 rows on one device (a multiple of 4), 2 per device on the mesh
    want = decode(config, 1, prompts, Batch([0, 1, 2, 3]))
    got = decode(config, 1, prompts, Batch([0, 1, 2, 3], 2), make_plan(2, 2))
    assert_bitwise_differs([want[r][1] for r in prompts], [got[r][1] for r in prompts],
                           "control (a row-count-dependent matmul on a 2x2 mesh)")  # fmt: skip


# ---------------------------------------------------------------------------------
# Batch invariance (one device).
# ---------------------------------------------------------------------------------
@cpu_only
@hseed(GDN_SEED)
@settings(max_examples=examples(10 if FULL_TESTS else 2))
@given(st.data())
def test_batch_invariance_property(data):
    """A request alone in a batch of one row == the same request in a drawn row of a batch of four
    with 0-3 other requests (the rest empty), bit for bit: tokens and final states."""
    config, D, prompts = draw_case(data, 4)
    N = 4
    order = data.draw(st.permutations(range(N)), label="rows")
    filled = [None] * N
    for r in prompts:
        filled[order[r]] = r
    together = decode(config, D, prompts, Batch(filled))
    alone = decode(config, D, {0: prompts[0]}, Batch([0]))
    assert_same_requests(alone, {0: together[0]}, f"request 0 alone vs in row {order[0]} of {filled}, D={D}, "
                         f"{config.dtype}")  # fmt: skip


@cpu_only
def test_batch_invariance_control():
    """The control: with the invariant mode off, XLA:CPU's dots of one row and of four rows give a
    request other bits (D = 1: the projections get one row alone, four together)."""
    prompts = {0: [5, 6, 7, 1, 2], 1: [9, 4], 2: [1, 2, 3], 3: [8]}
    config = dataclasses.replace(CONFIG, name="inv-off", invariant=False)
    # D = 1: verify's dots get one row alone, four together
    together = decode(config, 1, prompts, Batch([3, 0, 1, 2]))
    alone = decode(config, 1, {0: prompts[0]}, Batch([0]))
    assert_bitwise_differs(alone[0][1], together[0][1], "control (the invariant mode off: request 0 alone vs with "
                           "three others): if this no longer differs, XLA:CPU's dots no longer depend on the row count "
                           "here and the property above is not exercised by it")  # fmt: skip


def test_invariant_mode_switch_and_errors():
    """The default follows the platform (on for the CPU); True elsewhere raises; the invariant
    einsum names the spec it cannot loop over; the blocked matmul equals a plain one's shape."""
    assert CONFIG.invariant is None and CONFIG.invariant_dots == (jax.default_backend() == "cpu")
    assert dataclasses.replace(CONFIG, invariant=False).invariant_dots is False
    if jax.default_backend() != "cpu":
        with pytest.raises(NotImplementedError, match="CPU only"):
            dataclasses.replace(CONFIG, invariant=True).invariant_dots
    with pytest.raises(ValueError, match="invariant must be None, True or False"):
        dataclasses.replace(CONFIG, invariant="yes")
    x = jnp.ones((3, 5, 7), jnp.float32)
    with pytest.raises(ValueError, match=r"share their leading axis .* got 'td,edi->tei'"):
        model_mod.einsum("td,edi->tei", x[0], x, invariant=True)
    with pytest.raises(ValueError, match=r"\[\.\.\., K\] and \[K, N\]"):
        model_mod.matmul(x, x, invariant=True)
    w = jnp.asarray(np.random.default_rng(0).standard_normal((7, 9)), jnp.float32)
    got = model_mod.matmul(x, w, invariant=True)
    assert got.shape == (3, 5, 9)
    np.testing.assert_allclose(np.asarray(got), np.asarray(x @ w), rtol=1e-6)


# ---------------------------------------------------------------------------------
# Speculative == plain greedy decoding, logits included (one device).
# ---------------------------------------------------------------------------------
#: Draft trees of at most 8 nodes (D = 1 + the tree's nodes).
TREES = [(1,), (2,), (3,), (1, 1), (1, 2), (2, 1), (2, 2), (3, 1), (1, 1, 1), (2, 1, 1), (1, 1, 1, 1)]
SPEC_STEPS = 3


def greedy_positions(config, step, prompts: dict, batch: Batch, n_steps: int, seed: int = 0):
    """``decode_steps`` of ``step`` (a chain's or a tree's) for ``n_steps``: ``{request: (tokens,
    gaps, predictions)}``, the last two per position of the request (its prompt's and its generated
    tokens'), in the order the positions were accepted: a step's ``gaps[i, :m]`` are the target's
    top-2 logit gaps at the m positions it accepted (a tree step's along its accepted path)."""
    slots, tracks, rows, n_slots, n_requests = batch.indices()
    params = init_params(config, seed)
    state = allocate_state(config, slots=n_slots, requests=n_requests, drafts=step.drafts, record="tuples",
                           max_len=MAX_LEN)  # fmt: skip
    row_prompts = [prompts[r] if r is not None else [0] for r in batch.filled]
    seqs, outs, _ = decode_steps(step, params, state, row_prompts, slots, rows, tracks, n_steps)
    out = {}
    for i, r in enumerate(batch.filled):
        if r is not None:
            take = lambda f: np.concatenate([np.asarray(getattr(o, f))[i, : int(o.accepted[i])] for o in outs])  # noqa: E731
            out[r] = (seqs[i], take("gaps"), take("predictions"))
    return out


def assert_spec_is_plain(config, spec_step, prompts: dict, batch: Batch, seed: int, what: str):
    """Speculative decoding (``spec_step``, SPEC_STEPS steps) against plain greedy decoding (D = 1,
    the same batch, as many steps as the longest speculative sequence needs): every request's
    tokens, and the top-2 logit gap and the prediction at every position the speculative run
    accepted, bit for bit. Returns the drafted tokens the speculative run accepted."""
    spec = greedy_positions(config, spec_step, prompts, batch, SPEC_STEPS, seed)
    longest = max(len(s[0]) for s in spec.values())
    plain = greedy_positions(config, SpecStep(config, 1, track_interval=TRACK), prompts, batch, longest - 1, seed)
    drafted = 0
    for r, (tokens, gaps, preds) in spec.items():
        p_tokens, p_gaps, p_preds = plain[r]
        assert tokens == p_tokens[: len(tokens)], f"{what}: request {r}'s tokens, speculative vs plain greedy"
        P = len(gaps)
        assert len(p_gaps) >= P
        assert_bitwise_equal(gaps, p_gaps[:P], f"{what}: request {r}'s top-2 logit gaps at its {P} positions, "
                             "speculative vs plain greedy")  # fmt: skip
        assert_bitwise_equal(preds, p_preds[:P], f"{what}: request {r}'s predictions")
        drafted += max(0, P - len(prompts[r]))
    return drafted


def draw_spec_case(data):
    """A chain of D = 1..8 or a tree of at most 8 nodes, float32 or bfloat16, 1-3 requests (prompts
    of 1-9 tokens) in drawn rows of a batch of 4 (the rest empty), a parameter seed."""
    dtype = data.draw(st.sampled_from(["float32", "bfloat16"]), label="dtype")
    tree = data.draw(st.none() | st.sampled_from(TREES), label="tree (None: a chain)")
    D = treestep.tree_nodes(tree) if tree else data.draw(st.integers(1, 8), label="D")
    n = data.draw(st.integers(1, 3), label="requests")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1), label="prompt seed"))
    prompts = {r: [int(t) for t in rng.integers(0, CONFIG.vocab, int(rng.integers(1, 10)))] for r in range(n)}
    order = data.draw(st.permutations(range(4)), label="rows")  # request r in row order[r]
    filled = [None] * 4
    for r in prompts:
        filled[order[r]] = r
    seed = data.draw(st.integers(0, 2**16), label="parameter seed")
    config = dataclasses.replace(CONFIG, dtype=dtype)
    step = TreeStep(config, D, track_interval=TRACK, tree=tree) if tree else SpecStep(config, D, track_interval=TRACK)
    return config, step, prompts, Batch(filled), seed


@cpu_only
@hseed(GDN_SEED)
@settings(max_examples=examples(20 if FULL_TESTS else 3))
@given(st.data())
def test_speculative_is_plain_greedy_property(data):
    """Speculative greedy decoding (a chain of drawn D or a drawn tree) == plain greedy decoding by
    construction: every request's tokens, and the logits' top-2 gaps at every accepted position bit
    for bit (tokens alone would pass by luck away from near-ties)."""
    config, step, prompts, batch, seed = draw_spec_case(data)
    tree = getattr(step, "tree", None)
    drafted = assert_spec_is_plain(config, step, prompts, batch, seed, f"{'tree ' + str(tree) if tree else 'chain'} "
                                   f"D={step.drafts}, rows {batch.filled}, {config.dtype}")  # fmt: skip
    event("drafted tokens accepted" if drafted else "no drafted token accepted")


#: The control's case: two requests of 12 prompt tokens verified as three chunks of D = 4 (in a
#: batch of two rows: the draft proposes nothing until the prompts are in).
CONTROL_PROMPTS = {0: [int(t) for t in np.random.default_rng(0).integers(0, 512, 12)],
                   1: [int(t) for t in np.random.default_rng(1).integers(0, 512, 12)]}  # fmt: skip


def _spec_differs(config, step=None):
    step = step or SpecStep(config, 4, track_interval=TRACK)
    with pytest.raises(AssertionError, match="top-2 logit gaps|tokens"):
        assert_spec_is_plain(config, step, CONTROL_PROMPTS, Batch([0, 1]), 0, f"control ({config.name})")


@cpu_only
def test_speculative_is_plain_greedy_control_mode_off():
    """The control: with the invariant mode off, the 4-token verify's logits are not the one-token
    decode's (XLA:CPU's attention dots depend on how many queries a step has)."""
    _spec_differs(dataclasses.replace(get_config("tiny"), name="tiny-spec-off", invariant=False))


def batched_attention(q, cache_k, cache_v, positions, tree=None):
    """The control: the invariant mode's attention before per-query attention, a row's T queries in
    one dot (``model.einsum(invariant=True)``: one batch row at a time)."""
    assert tree is None
    hd, Tmax = q.shape[-1], cache_k.shape[1]
    ein = functools.partial(model_mod.einsum, preferred_element_type=jnp.float32, invariant=True)
    scores = ein("ntgrh,nsgh->ngrts", q, cache_k) / math.sqrt(hd)
    mask = jnp.arange(Tmax)[None, None, :] <= positions[:, :, None]
    probs = model_mod.softmax(jnp.where(mask[:, None, None], scores, -jnp.inf))
    return ein("ngrts,nsgh->ntgrh", probs.astype(cache_v.dtype), cache_v)


@cpu_only
@full_only  # the mode-off control runs in the default set
def test_speculative_is_plain_greedy_control_batched_attention(monkeypatch):
    """The control: the invariant mode with the attention's T queries in one dot a row (the mode's
    first version) gives the 4-token verify other logits than the one-token decode."""
    monkeypatch.setattr(model_mod, "per_query_attention", batched_attention)
    _spec_differs(dataclasses.replace(get_config("tiny"), name="tiny-spec-batched"))


def concatenated_tree_attention(q, cache_k, cache_v, positions, tree=None):
    """The control for trees: each node's query alone, but over the cache and the tree's T nodes
    after it (``tree_attention``'s layout outside the mode: ``Tmax + T`` keys, not the cache's
    ``Tmax`` with the root path at its positions as in plain decoding)."""
    if tree is None:
        return _PER_QUERY_ATTENTION(q, cache_k, cache_v, positions)
    k, v, anc = tree
    keys, vals = jnp.concatenate([cache_k, k], axis=1), jnp.concatenate([cache_v, v], axis=1)
    N, T, Tmax = q.shape[0], q.shape[1], cache_k.shape[1]
    root = positions[:, :1, None]  # the root's position: the committed prefix ends before it
    prefix = jnp.broadcast_to(jnp.arange(Tmax)[None, None, :] < root, (N, T, Tmax))
    mask = jnp.concatenate([prefix, anc], axis=-1)
    hd = q.shape[-1]
    scores = jnp.einsum("ntgrh,nsgh->ngrts", q, keys, preferred_element_type=jnp.float32) / math.sqrt(hd)
    probs = model_mod.softmax(jnp.where(mask[:, None, None], scores, -jnp.inf), invariant=True)
    return jnp.einsum("ngrts,nsgh->ntgrh", probs.astype(vals.dtype), vals, preferred_element_type=jnp.float32)


_PER_QUERY_ATTENTION = model_mod.per_query_attention


@cpu_only
def test_speculative_is_plain_greedy_control_tree_keys_after_the_cache(monkeypatch):
    """The control for trees: a [2, 2] tree step whose attention takes the nodes' keys after the
    cache (T more of them) gives its positions other logits than plain decoding (the prompts go in
    as chains of 7: the same layout)."""
    monkeypatch.setattr(model_mod, "per_query_attention", concatenated_tree_attention)
    config = dataclasses.replace(get_config("tiny"), name="tiny-spec-tree-concat")
    _spec_differs(config, TreeStep(config, 7, track_interval=TRACK, tree=(2, 2)))
