"""Draft trees: verify with parents, commit by the accepted path, the pool, the conv, the checks.

Every tree is random (fresh seeds, GDN_SEED) with adversarial non-zero inputs. For every node of
every request, the state committed from tuples along the node's root path equals the snapshot
tree's bit for bit, and equals a chain verify + commit of that path's inputs run separately (the
tree is exactly the chain's rounding). Controls: a wrong parent and an off-path replay differ.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import gdn_lossless_jax as gl
from gdn_lossless_jax import pool as P, testing, tree
from gdn_lossless_jax.config import get_geometry
from gdn_lossless_jax.testing.cases import Shape, verify_inputs

STEP_INPUTS = ("q", "k", "v", "a", "b")


def random_parents(rng, N: int, topk: int, depth: int, max_nodes: int = 16) -> np.ndarray:
    """``[N, D]`` random trees of one node count D: each node's parent drawn among the earlier nodes
    (and the root) that have fewer than ``topk`` children and are above ``depth``. Request 0's tree
    is built to reach ``depth`` with a full first branching."""
    full = sum(topk**i for i in range(1, depth + 1))
    D = min(max_nodes, full)
    out = []
    for n in range(N):
        parents, kids, dep = [], {-1: 0}, {-1: -1}
        for d in range(D):
            ok = [p for p in range(-1, d) if kids[p] < topk and dep[p] + 1 < depth]
            if n == 0 and d < depth:  # a spine to the full depth first
                p = d - 1
            elif n == 0 and kids[-1] < topk:  # then the root's top-k
                p = -1
            else:
                p = int(rng.choice(ok))
            parents.append(p)
            kids[p] += 1
            kids[d], dep[d] = 0, dep[p] + 1
        out.append(parents)
    return np.asarray(out, np.int32)


def paths_of(parents: np.ndarray):
    """Every (request, node): its root-to-node path as a list, the depth."""
    N, D = parents.shape
    paths = {}
    for n in range(N):
        for d in range(D):
            p, cur = [], d
            while cur >= 0:
                p.append(cur)
                cur = int(parents[n, cur])
            paths[n, d] = p[::-1]
    return paths


def _padded(paths, width, fill=None):
    """``[len(paths), width]``: each path, padded with ``fill`` (None: its last node, repeated)."""
    return np.asarray([p + [p[-1] if fill is None else fill] * (width - len(p)) for p in paths], np.int32)


@functools.partial(jax.jit, static_argnames=("record", "topk", "backend"))
def _tree_verify(x, parents, record, topk, backend="reference"):
    # parents traced: the tree's path even where the tree is a chain
    return gl.verify(**x, parents=parents, topk=topk, record=record, backend=backend)


CASES = [  # topk, depth, state dtype, input kind, parents given as host values (checked at call time), backend
    (1, 8, jnp.float32, "normal", False, "reference"),
    (2, 3, jnp.bfloat16, "mixed", True, "reference"),
    (3, 2, jnp.float32, "cancel", False, "reference"),
    (4, 4, jnp.bfloat16, "decay_extremes", False, "reference"),
    (2, 8, jnp.float32, "subnormal", True, "reference"),
    # the Pallas kernel's tree form (interpret mode here), each node's parent replayed on chip
    (3, 3, jnp.bfloat16, "mixed", True, "pallas"),
    (2, 5, jnp.float32, "cancel", False, "pallas"),
]


@pytest.mark.parametrize("topk, depth, state_dtype, kind, host, backend", CASES)
def test_every_path_is_the_chain(seed, topk, depth, state_dtype, kind, host, backend):
    rng = np.random.default_rng(seed)
    N = 2
    parents = random_parents(rng, N, topk, depth)
    D = parents.shape[1]
    x = verify_inputs(seed, Shape(N, D, 1, 2, 16, 16), kind=kind, state_dtype=state_dtype)
    if host:
        verify = lambda record: gl.verify(**x, parents=parents, topk=topk, record=record, backend=backend)  # noqa: E731
    else:
        verify = lambda record: _tree_verify(x, jnp.asarray(parents), record, topk, backend)  # noqa: E731
    out_t, tt = verify("tuples")
    out_s, ts = verify("snapshots")
    testing.assert_bitwise_equal(out_s, out_t, "outputs: snapshot vs tuple tree")

    # every (request, node) as one request of a commit: its own slot holding its request's state
    paths = paths_of(parents)
    keys = sorted(paths)
    NB, W = len(keys), max(len(p) for p in paths.values())
    owner = np.asarray([n for n, _ in keys], np.int32)
    depth_of = np.asarray([len(paths[k]) - 1 for k in keys], np.int32)
    path = _padded([paths[k] for k in keys], W, fill=-1)
    track = np.asarray([rng.integers(-1, s + 1) for s in depth_of], np.int32)  # a track copy on the path, or none
    track_slots = np.where(track >= 0, NB + np.arange(NB), -1).astype(np.int32)
    pool = jnp.concatenate([x["state0"][owner], x["state0"][owner]])[None]  # [1, 2 NB, HV, V, K]
    one = lambda t: jax.tree.map(lambda a: a[None], t)  # noqa: E731
    slots = np.arange(NB, dtype=np.int32)
    args = (slots, depth_of, track_slots, track, owner)
    from_tuples = gl.commit(pool, one(tt), *args, path=path, parents=parents[owner], backend=backend)
    from_snaps = gl.commit(pool, one(ts), *args, path=path, parents=parents[owner], backend=backend)
    testing.assert_bitwise_equal(from_snaps, from_tuples, "tree commit: tuples vs snapshots, every node")
    node = np.asarray([d for _, d in keys])
    testing.assert_bitwise_equal(ts.states[owner, node], from_tuples[0, :NB], "each node's snapshot")
    has = track >= 0
    tnode = path[np.arange(NB), np.maximum(track, 0)]
    testing.assert_bitwise_equal(ts.states[owner, tnode][has], from_tuples[0, NB:][has], "track copies")
    if backend == "reference":  # replay along a path: each node's snapshot
        replayed = gl.replay(x["state0"][owner], jax.tree.map(lambda t: t[owner], tt), depth_of, path=path)
        testing.assert_bitwise_equal(ts.states[owner, node], replayed, "replay along each path")

    # the chain of each path, verified and committed on its own
    cp = _padded([paths[k] for k in keys], W)
    xc = {k: (v[owner[:, None], cp] if k in STEP_INPUTS else v) for k, v in x.items()}
    xc["state0"] = x["state0"][owner]
    out_c, tc = gl.verify(**xc, record="tuples", backend=backend)
    chain = gl.commit(pool, one(tc), slots, depth_of, track_slots, track, slots, backend=backend)
    testing.assert_bitwise_equal(chain, from_tuples, "tree commit vs the chain of each path")
    testing.assert_bitwise_equal(out_c[slots, depth_of], out_t[owner, node], "outputs: tree vs chain")
    testing.assert_bitwise_equal(tc.u[slots, depth_of], tt.u[owner, node], "u: tree vs chain")
    if backend != "reference":  # exact against its own u; u's low bits are the kernel's sums, so close to the reference
        _, tr = gl.verify(**x, parents=parents, topk=topk, record="snapshots", backend="reference")
        np.testing.assert_allclose(np.asarray(ts.states, np.float32), np.asarray(tr.states, np.float32), rtol=2e-2,
                                   atol=2e-3)  # fmt: skip

    # controls: an off-path replay (a path without the node's parent) and a wrong parent
    deep = [i for i, s in enumerate(depth_of) if s >= 1]
    assert deep, "every case has a node below the root's children"
    off = path.copy()
    for i in deep:
        off[i, : depth_of[i]] = np.concatenate([path[i, : depth_of[i] - 1], path[i, depth_of[i] : depth_of[i] + 1]])
        off[i, depth_of[i]] = -1
    steps_off = np.where(depth_of >= 1, depth_of - 1, depth_of)
    wrong = gl.commit(pool, one(tt), slots, steps_off, rows=owner, path=off, backend=backend)
    testing.assert_bitwise_differs(from_tuples[0, deep], wrong[0, deep], "an off-path replay")
    d = int(np.flatnonzero(parents[0] >= 0)[-1])
    bad = parents.copy()
    bad[0, d] = -1 if parents[0, d] != -1 else 0
    if host:  # (the same shapes: no new compile)
        _, tb = gl.verify(**x, parents=bad, topk=D, record="snapshots", backend=backend)
    else:
        _, tb = _tree_verify(x, jnp.asarray(bad), "snapshots", topk, backend)
    testing.assert_bitwise_differs(ts.states[0, d], tb.states[0, d], "a wrong parent")


def test_a_chain_stays_the_chain(seed):
    """Parents of a chain as host values take the chain's own path (None); traced, the tree's scan
    gives the same bits."""
    x = verify_inputs(seed, Shape(2, 5, 1, 2, 16, 16), kind="mixed")
    ref_out, ref_tape = gl.verify(**x, record="snapshots", backend="reference")
    out, tape = gl.verify(**x, parents=tree.chain_parents(5), record="snapshots", backend="reference")
    testing.assert_bitwise_equal((ref_out, ref_tape), (out, tape))
    out, tape = _tree_verify(x, jnp.asarray(np.tile(tree.chain_parents(5), (2, 1))), "snapshots", 1)
    testing.assert_bitwise_equal((ref_out, ref_tape), (out, tape))
    call = gl.checks.verify_args("verify", *x.values(), parents=tree.chain_parents(5))
    assert call.parents is None, "a chain given as parents is the chain's fast path"


def test_path_to():
    parents = np.array([[-1, -1, 0, 0, 1, 2], [-1, 0, 1, 1, -1, 4]])
    path, steps = tree.path_to(parents, np.array([5, 3]))
    assert path.tolist() == [[0, 2, 5, -1, -1, -1], [0, 1, 3, -1, -1, -1]] and steps.tolist() == [2, 2]
    path, steps = jax.jit(tree.path_to, static_argnames="width")(parents, jnp.array([-1, 4]), width=3)
    assert path.tolist() == [[-1, -1, -1], [4, -1, -1]] and steps.tolist() == [-1, 0]
    assert tree.full_tree([2, 2, 2]).shape == (14,) and tree.beam_tree(4, 4).shape == (16,)
    assert tree.depths(tree.full_tree([2, 2, 2])).tolist() == [0] * 2 + [1] * 4 + [2] * 8


# ------------------------------------------------------------------------------------------
# The pool: conv and SSM, both record modes, the deferred (fused) commit
# ------------------------------------------------------------------------------------------
G = get_geometry("qwen3.6-35b-a3b").reduced(gdn_layers=2, heads_divisor=8, head_dim=16)


def _normal(rng, shape, scale=1.0, dtype=np.float32):
    return jnp.asarray((scale * rng.standard_normal(shape)).astype(np.float32).astype(dtype))


def _layer(rng, N, D):
    g = G
    return dict(
        mixed_qkv=_normal(rng, (N, D, g.conv_dim), 1.0, jnp.bfloat16),
        a=_normal(rng, (N, D, g.num_v_heads), 1.0, jnp.bfloat16),
        b=_normal(rng, (N, D, g.num_v_heads), 1.0, jnp.bfloat16),
        conv_weight=_normal(rng, (g.conv_dim, g.conv_kernel), 0.5, jnp.bfloat16),
        conv_bias=_normal(rng, (g.conv_dim,), 0.1),
        A_log=jnp.asarray(rng.uniform(-1.0, 1.0, g.num_v_heads).astype(np.float32)),
        dt_bias=_normal(rng, (g.num_v_heads,), 0.5),
    )


@pytest.mark.parametrize("state_dtype", [jnp.bfloat16])  # (fp32 pools: test_every_path_is_the_chain)
def test_pool_tree_step(seed, state_dtype):
    """verify_layer of a tree for every layer, commit of one accepted path per request: tuples,
    snapshots and the deferred tuple pool agree bit for bit (SSM and conv), and equal a chain pool
    stepped with each path's inputs."""
    rng = np.random.default_rng(seed)
    N, S, topk = 3, 8, 2
    parents = random_parents(rng, N, topk, 4, max_nodes=10)
    D = parents.shape[1]
    paths = paths_of(parents)
    nodes = rng.integers(0, D, N)
    path, steps = (np.asarray(a) for a in tree.path_to(parents, nodes))
    track = np.asarray([rng.integers(-1, s + 1) for s in steps], np.int32)
    track_slots = np.where(track >= 0, np.array([5, 6, 7]), -1).astype(np.int32)
    slots = np.array([3, 0, 1], np.int32)
    layers = [_layer(rng, N, D) for _ in range(G.gdn_layers)]
    ssm0 = _normal(rng, (G.gdn_layers, S + 1, G.num_v_heads, G.head_v_dim, G.head_k_dim), 0.5, state_dtype)
    conv0 = _normal(rng, (G.gdn_layers, S + 1, G.conv_dim, G.conv_kernel - 1), 1.0, jnp.bfloat16)

    def run(record, defer=False, tree_step=True, then=None):
        pl = P.allocate(G, slots=S, requests=N, drafts=D, record=record, state_dtype=state_dtype, topk=topk,
                        defer_commit=defer)  # fmt: skip
        pl = pl.replace(ssm=ssm0.copy(), conv=conv0.copy())
        outs = []
        for layer, x in enumerate(layers):
            if tree_step:
                o, pl = P.verify_layer(pl, layer, **x, slots=slots, parents=parents, topk=topk, backend="reference")
            else:  # the chain of each request's accepted path
                cp = _padded([paths[n, int(nodes[n])] for n in range(N)], D)
                xc = {k: (v[np.arange(N)[:, None], cp] if k in ("mixed_qkv", "a", "b") else v) for k, v in x.items()}
                o, pl = P.verify_layer(pl, layer, **xc, slots=slots, backend="reference")
            outs.append(o)
        if tree_step:
            pl = P.commit(pl, slots, steps, track_slots, track, path=path, parents=parents, backend="reference")
        else:
            pl = P.commit(pl, slots, steps, track_slots, track, backend="reference")
        for layer, x in enumerate(then or []):  # a next step (a chain): a deferred pool's verify commits first
            o, pl = P.verify_layer(pl, layer, **x, slots=slots, backend="reference")
            outs.append(o)
        return outs, P.flush(pl, backend="reference")

    outs_t, pt = run("tuples")
    outs_s, ps = run("snapshots")
    testing.assert_bitwise_equal(outs_s, outs_t, "outputs")
    testing.assert_bitwise_equal((ps.ssm, ps.conv), (pt.ssm, pt.conv), "tuples vs snapshots pool")
    assert not np.array_equal(testing.bits(pt.ssm), testing.bits(ssm0)), "slots were written"
    outs_c, pc = run("tuples", tree_step=False)
    testing.assert_bitwise_equal((pc.ssm, pc.conv), (pt.ssm, pt.conv), "tree pool vs a chain pool of the paths")
    for o_t, o_c in zip(outs_t, outs_c):
        testing.assert_bitwise_equal(o_c[np.arange(N), steps], o_t[np.arange(N), nodes], "outputs on the path")
    # the deferred (fused) commit of the tree's paths, applied by the next step's verify
    nxt = [_layer(rng, N, D) for _ in range(G.gdn_layers)]
    o1, p1 = run("tuples", then=nxt)
    o2, p2 = run("tuples", defer=True, then=nxt)
    testing.assert_bitwise_equal((o1, p1.ssm, p1.conv), (o2, p2.ssm, p2.conv), "fused vs separate after a tree")


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_commit_and_verify_with_a_tree_path(seed, backend):
    """commit_and_verify with Pending.path (a tree's accepted paths) and a tree to verify next
    equals commit, then verify (on Pallas: the fused kernel's chain replay, then the tree form)."""
    rng = np.random.default_rng(seed)
    N = 2
    parents = random_parents(rng, N, 2, 3, max_nodes=6)
    nxt = random_parents(rng, N, 2, 3, max_nodes=6)
    D = parents.shape[1]
    path, steps = (np.asarray(a) for a in tree.path_to(parents, rng.integers(0, D, N)))
    sh = Shape(N, D, 1, 2, 16, 16)
    xa, xb = verify_inputs(seed, sh, kind="mixed"), verify_inputs(seed + 1, sh, kind="normal")
    pool = jnp.concatenate([xa["state0"], xa["state0"]])[None]
    sl = np.array([1, 2], np.int32)
    _, prev = gl.verify(pool, *[xa[k] for k in list(xa)[1:]], slots=sl, layer=0, parents=parents, topk=2,
                        backend=backend)  # fmt: skip
    prev = jax.tree.map(lambda a: a[None], prev)
    none = np.full(N, -1, np.int32)
    pending = gl.Pending(prev, np.arange(N, dtype=np.int32), steps, none, none, path=path)
    inputs = [xb[k] for k in list(xb)[1:]]
    out_f, tape_f, pool_f = gl.commit_and_verify(pool, pending, *inputs, slots=sl, layer=0, parents=nxt, topk=2,
                                                 backend=backend)  # fmt: skip
    committed = gl.commit(pool, prev, sl, steps, path=path, backend=backend)
    out_s, tape_s = gl.verify(committed, *inputs, slots=sl, layer=0, parents=nxt, topk=2, backend=backend)
    testing.assert_bitwise_equal((out_s, tape_s, committed), (out_f, tape_f, pool_f))


# ------------------------------------------------------------------------------------------
# Checks
# ------------------------------------------------------------------------------------------
def _x():
    return verify_inputs(1, Shape(2, 4, 1, 2, 8, 8))


@pytest.mark.parametrize(
    "parents, match",
    [
        ([-1, 0, 5, 1], r"parents\[0, 2\] = 5, which is out of range"),
        ([-1, -2, 0, 1], r"parents\[0, 1\] = -2, which is out of range"),
        ([-1, 0, 2, 1], r"parents\[0, 2\] = 2, which is the node itself: a cycle"),
        ([-1, 2, 1, 1], r"parents\[0, 1\] = 2, which is after its child: nodes must be in topological order"),
        ([[-1, 0, 0, 1], [-1, 0, 1, 3]], r"parents\[1, 3\] = 3, which is the node itself"),
        ([-1, -1, -1, 0], r"gives the root of request 0 3 children, more than topk=2"),
        ([-1, 0, 1], r"argument 'parents' must have shape \[D\] = \[4\] or \[N, D\] = \[2, 4\]"),
        (np.array([-1.0, 0, 0, 1]), r"argument 'parents' must be an integer array"),
    ],
)
def test_bad_parents(parents, match):
    with pytest.raises((ValueError, TypeError), match=r"verify: .*" + match):
        gl.verify(**_x(), parents=np.asarray(parents) if isinstance(parents, list) else parents, topk=2)


def test_bad_parents_elsewhere():
    with pytest.raises(ValueError, match=r"topk=2 is not supported without parents"):
        gl.verify(**_x(), topk=2)
    with pytest.raises(ValueError, match=r"allocate: argument 'parents' .* parents\[0, 1\] = 1, which is the node"):
        P.allocate(G, slots=2, requests=2, drafts=3, parents=np.array([-1, 1, 0]), topk=2)
    with pytest.raises(ValueError, match=r"argument 'topk' must be a positive integer"):
        P.allocate(G, slots=2, requests=2, drafts=3, topk=0)
    P.allocate(G, slots=2, requests=2, drafts=14, parents=tree.full_tree([2, 2, 2]), topk=2)
    P.allocate(G, slots=2, requests=2, drafts=4, topk=4)  # a pool for top-4 trees given per step
    with pytest.raises(ValueError, match=r"verify: backend 'mosaic' does not verify draft trees .* "
                                         r"pass backend=\"reference\" or backend=\"pallas\", which do"):  # fmt: skip
        gl.verify(**_x(), parents=np.array([-1, 0, 0, 1]), topk=2, backend="mosaic")
    pl = P.allocate(G, slots=4, requests=2, drafts=4)
    x = _layer(np.random.default_rng(0), 2, 4)
    with pytest.raises(ValueError, match=r"verify_layer: backend 'mosaic' does not verify draft trees"):
        P.verify_layer(pl, 0, **x, slots=np.arange(2), parents=np.array([-1, 0, 0, 1]), topk=2, backend="mosaic")
    with pytest.raises(ValueError, match=r"verify_layer: argument 'parents' .* parents\[0, 3\] = 3"):
        P.verify_layer(pl, 0, **x, slots=np.arange(2), parents=np.array([-1, 0, 0, 3]), topk=2)


def test_traced_parents_in_checked_mode():
    x = _x()

    @jax.jit
    def f(parents):
        return gl.verify(**x, parents=parents, topk=2, checked=True, backend="reference")[0]

    err, _ = checkify.checkify(f)(jnp.array([[-1, 0, 0, 1], [-1, 0, 1, 1]]))
    err.throw()
    err, _ = checkify.checkify(f)(jnp.array([[-1, 0, 0, 1], [-1, 0, 3, 1]]))
    with pytest.raises(checkify.JaxRuntimeError, match=r"verify \(checked\): argument 'parents' .* "
                                                       r"parents\[1, 2\] = 3"):  # fmt: skip
        err.throw()
    err, _ = checkify.checkify(f)(jnp.array([[-1, -1, -1, 1], [-1, 0, 1, 1]]))
    with pytest.raises(checkify.JaxRuntimeError, match=r"more than topk=2"):
        err.throw()


def test_bad_paths():
    x = _x()
    parents = np.array([[-1, 0, 0, 1], [-1, -1, 0, 2]])
    _, tape = gl.verify(**x, parents=parents, topk=2, backend="reference")
    tape = jax.tree.map(lambda a: a[None], tape)
    pool = x["state0"][None]
    slots = np.arange(2, dtype=np.int32)
    good = np.array([[0, 1, 3], [0, 2, 3]], np.int32)
    gl.commit(pool, tape, slots, np.array([2, 2]), path=good, parents=parents)
    checked_commit = checkify.checkify(jax.jit(functools.partial(gl.commit, checked=True)))
    for path, match in (
        ([[0, 2, 3], [0, 2, 3]], r"path\[0, 2\] = 3, which is not a child of the entry before it"),
        ([[1, 3, 2], [0, 2, 3]], r"path\[0, 0\] = 1, which is not a child of the entry before it \(or, at position 0, of the root\)"),
        ([[0, -1, 3], [0, 2, 3]], r"path\[0, 1\] = -1, which is not a node index in \[0, D\)"),
        ([[0, 1, 4], [0, 2, 3]], r"path\[0, 2\] = 4, which is not a node index"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=r"commit: argument 'path' must hold a root-to-node path .*" + match):
            gl.commit(pool, tape, slots, np.array([2, 2]), path=np.array(path, np.int32), parents=parents)
        # concrete jax arrays: at call time too, checked or not
        with pytest.raises(ValueError, match=r"commit: argument 'path' must hold a root-to-node path .*" + match):
            gl.commit(pool, tape, slots, jnp.array([2, 2]), path=jnp.array(path), parents=jnp.asarray(parents),
                      checked=True)  # fmt: skip
        # traced: in checked mode
        err, _ = checked_commit(pool, tape, slots, jnp.array([2, 2]), path=jnp.array(path),
                                parents=jnp.asarray(parents))  # fmt: skip
        with pytest.raises(checkify.JaxRuntimeError, match=r"commit \(checked\): argument 'path'"):
            err.throw()
    # entries after the step are not read
    gl.commit(pool, tape, slots, np.array([0, 1]), path=np.array([[0, 2, 9], [0, 2, 7]]), parents=parents)
    with pytest.raises(ValueError, match=r"commit: argument 'path' must have shape \[N, P\] with N=2"):
        gl.commit(pool, tape, slots, np.array([2, 2]), path=good[0])
    with pytest.raises(ValueError, match=r"commit: parents= checks a tree's accepted paths: pass path= too"):
        gl.commit(pool, tape, slots, np.array([2, 2]), parents=parents)
    with pytest.raises(checkify.JaxRuntimeError, match=r"steps\[0\] = 3 is not in \[-1, 3\)|steps\[0\] = 3 = D"):
        gl.commit(pool, tape, slots, jnp.array([3, 2]), path=jnp.asarray(good), checked=True)


def test_tree_gradients(seed):
    """A tree verify is differentiable like a chain's: the plain formulation's derivatives, the
    tree's own (a tree's gradient equals the gradient of the same loss through its path's chain)."""
    x = verify_inputs(seed, Shape(1, 3, 1, 2, 8, 8))
    parents = np.array([[-1, -1, 1]])

    def loss(state0, parents, idx):
        out, _ = gl.verify(**dict(x, state0=state0), parents=parents, topk=1 if parents is None else 2,
                           backend="reference")
        return out[:, idx].astype(jnp.float32).sum()

    g_tree = jax.grad(loss)(x["state0"], parents, np.array([1, 2]))
    g_chain = jax.grad(loss)(x["state0"], None, np.array([1, 2]))
    assert np.isfinite(np.asarray(g_tree)).all()
    # node 2's path is [1, 2]: the chain of nodes 1 and 2 from the same state
    xc = {k: (v[:, [1, 2]] if k in STEP_INPUTS else v) for k, v in x.items()}
    g_path = jax.grad(lambda s: gl.verify(**dict(xc, state0=s), backend="reference")[0].astype(jnp.float32).sum())(
        x["state0"])
    np.testing.assert_allclose(np.asarray(g_tree), np.asarray(g_path), rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(g_tree), np.asarray(g_chain)), "control: the chain's nodes 1, 2 differ"


# ------------------------------------------------------------------------------------------
# Path checks in every form: every concrete index argument (NumPy or a jax array that
# is not a tracer, such as path_to's) is checked at call time, traced ones with checked=True;
# commit, replay and pool.commit alike, for a chain and a tree
# ------------------------------------------------------------------------------------------
_TREE = np.array([[-1, 0, 0, 1], [-1, -1, 0, 2]], np.int32)
KINDS = {  # the parents; accepted nodes; a path with no root (each request's path with its first node cut); the
    # parents path_to takes for a path of another tree, which is no root-to-node path of these parents
    "tree": (_TREE, [3, 3], ([[1, 3, -1], [2, 3, -1]], [1, 1]), _TREE[::-1]),
    "chain": (tree.chain_parents(4), [2, 1], ([[1, 2, -1], [1, -1, -1]], [1, 0]), _TREE),
}
FORMS = {  # how path, steps (and track_steps) are given: (path as a jax array, steps as jax arrays)
    "numpy": (False, False),
    "jax": (True, True),
    "numpy path, jax steps": (False, True),
    "jax path, numpy steps": (True, False),
}
TARGETS = ("commit", "replay", "pool.commit")
_TRACK_SLOTS = np.array([2, 3], np.int32)


@functools.lru_cache(maxsize=None)
def _recorded(kind):
    """A chain or tree verified once (N=2, D=4): the API's inputs and tapes, and a pool's."""
    parents, nodes, _, _ = KINDS[kind]
    topk = 1 if kind == "chain" else 2
    x = verify_inputs(3, Shape(2, 4, 1, 2, 8, 8), kind="mixed")
    _, tt = gl.verify(**x, parents=parents, topk=topk, backend="reference")
    _, ts = gl.verify(**x, parents=parents, topk=topk, record="snapshots", backend="reference")
    rng = np.random.default_rng(3)
    pl = P.allocate(G, slots=4, requests=2, drafts=4, topk=topk)
    pl = pl.replace(ssm=_normal(rng, pl.ssm.shape, 0.5), conv=_normal(rng, pl.conv.shape, 1.0, jnp.bfloat16))
    for layer in range(G.gdn_layers):
        _, pl = P.verify_layer(pl, layer, **_layer(rng, 2, 4), slots=np.arange(2), parents=parents, topk=topk,
                               backend="reference")  # fmt: skip
    good = tuple(np.asarray(a) for a in tree.path_to(parents, np.array(nodes), width=3))
    return x, tt, ts, pl, good


def _call(target, kind, path, steps, parents, checked=False, track=None):
    """``target`` with ``path``, ``steps`` and the parents; track_steps ``track`` (default [0, -1], as
    steps are given) for the commits. Returns the states it writes (replay: returns)."""
    x, tt, _, pl, _ = _recorded(kind)
    if track is None:
        track = jnp.array([0, -1]) if isinstance(steps, jax.Array) else np.array([0, -1])
    slots = np.arange(2, dtype=np.int32)
    kw = dict(path=path, parents=parents, backend="reference", checked=checked)
    if target == "replay":
        return gl.replay(x["state0"], tt, steps, **kw)
    if target == "commit":
        pool = jnp.concatenate([x["state0"], x["state0"]])[None]
        return gl.commit(pool, jax.tree.map(lambda a: a[None], tt), slots, steps, _TRACK_SLOTS, track, **kw)
    fresh = jax.tree.map(jnp.copy, pl)  # (commit donates the pool)
    new = P.commit(fresh, slots, steps, _TRACK_SLOTS, track, **kw)
    return new.ssm, new.conv


def _form(form, path, steps):
    jp, js = FORMS[form]
    return (jnp.asarray(path) if jp else np.asarray(path, np.int32)), (jnp.asarray(steps) if js else np.asarray(steps))


def _bad_paths(kind):
    """The paths that are no root-to-node paths of the kind's parents, and their steps: one with no root,
    and path_to's of another tree (a jax array)."""
    parents, nodes, (no_root, no_root_steps), other = KINDS[kind]
    path, steps = tree.path_to(other, np.array(nodes if kind == "tree" else [3, 2]), width=3)
    return {"no root": (np.array(no_root), np.array(no_root_steps)), "another tree's": (path, steps)}


_MESSAGE = r"{}: argument 'path' must hold a root-to-node path of the tree up to the accepted step, got path\[\d, \d\]"


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("target", TARGETS)
def test_concrete_bad_paths_raise_at_call_time(target, kind, form):
    """A path that is no root-to-node path of the parents raises at call time (ValueError) whether it and
    its steps are NumPy, concrete jax arrays or a mix, and whatever form the parents take, checked or not.
    Controls: the accepted paths in the same forms pass, and give the NumPy form's bits."""
    parents = KINDS[kind][0]
    for path, steps in _bad_paths(kind).values():
        for pform in (np.asarray, jnp.asarray):
            for checked in (False, True):
                p, s = _form(form, path, steps)
                with pytest.raises(ValueError, match=_MESSAGE.format(target)):
                    _call(target, kind, p, s, pform(parents), checked=checked)
    # controls: the good paths in this form (and parents as a jax array) pass, with the NumPy form's bits
    path, steps = _recorded(kind)[4]
    want = _call(target, kind, path, steps, parents)
    testing.assert_bitwise_equal(want, _call(target, kind, *_form(form, path, steps), jnp.asarray(parents)), form)
    testing.assert_bitwise_equal(want, _call(target, kind, *_form(form, path, steps), parents, checked=True), form)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("target", ["commit", "replay"])  # (pool.commit's bits: test_pool_tree_step)
def test_the_paths_are_the_nodes(target, kind):
    """The good paths write (replay: return) each accepted node's snapshot, its track copy the first node's:
    the bits of before (the state a node has); a path with no root gives a state that is no node's (the
    check's reason)."""
    _, _, ts, _, (path, steps) = _recorded(kind)
    got = _call(target, kind, path, steps, KINDS[kind][0])
    want = ts.states[np.arange(2), path[np.arange(2), steps]]
    testing.assert_bitwise_equal(want, got if target == "replay" else got[0, :2], "accepted nodes")
    if target == "commit":
        testing.assert_bitwise_equal(ts.states[0, path[0, 0]], got[0, 2], "the track copy")
    (no_root, s), _ = _bad_paths(kind).values()
    wrong = _call(target, kind, no_root, s, None)  # (without parents: only the node range is checked)
    nodes = ts.states[np.arange(2)[:, None], np.arange(4)[None, :]]  # [N, D, ...]: every node's state
    for i in range(2):
        state = wrong[i] if target == "replay" else wrong[0, i]
        assert not any(np.array_equal(testing.bits(state), testing.bits(n)) for n in nodes[i]), "a state no node has"


def _old_gate(x, raw=None):
    """The host check's earlier gate: NumPy values only (a jax array, concrete or not, skipped it)."""
    for v in (raw, x):
        if isinstance(v, (np.ndarray, list)):
            return np.asarray(v)
    return None


@pytest.mark.parametrize("target", TARGETS)
def test_control_the_old_gate_commits_silently(monkeypatch, target):
    """Control: with the gate of before (NumPy values only), path_to's path (a jax array) of another tree is
    committed silently, so test_concrete_bad_paths_raise_at_call_time fails on it."""
    path, steps = _bad_paths("tree")["another tree's"]
    monkeypatch.setattr(gl.checks, "host_value", _old_gate)
    _call(target, "tree", path, steps, KINDS["tree"][0])
    with pytest.raises(ValueError, match=_MESSAGE.format(target)):  # (NumPy: checked then too)
        _call(target, "tree", np.asarray(path), np.asarray(steps), KINDS["tree"][0])


# which arguments a jit traces (the others it closes over as NumPy): each mix leaves the path check to checked=True
TRACED = {
    "all": ("path", "steps", "parents"),
    "path": ("path",),
    "steps": ("steps",),
    "parents": ("parents",),  # (path and steps concrete: their node range at call time, the tree's part traced)
}


def _jitted(target, kind, traced, checked):
    """``run(path, steps, parents)``: ``target`` under ``jax.jit`` (and checkify with ``checked``), the
    ``traced`` arguments its arguments, the others closed over as NumPy (a new function each run: a jit
    caches its trace by the function, whatever it closes over)."""

    def run(path, steps, parents):
        _recorded(kind)  # (built outside the trace)
        fixed = dict(zip(("path", "steps", "parents"), (np.asarray(path), np.asarray(steps), np.asarray(parents))))
        args = {k: jnp.asarray(v) for k, v in fixed.items() if k in traced}

        def f(args):
            given = {**fixed, **args}
            return _call(target, kind, given["path"], given["steps"], given["parents"], checked=checked,
                         track=jnp.array([0, -1]) if "steps" in args else np.array([0, -1]))  # fmt: skip

        return checkify.checkify(jax.jit(f))(args) if checked else jax.jit(f)(args)

    return run


@pytest.mark.parametrize("traced", TRACED)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("target", TARGETS)
def test_traced_bad_paths_raise_in_checked_mode(target, kind, traced):
    """Traced (inside jax.jit), alone or mixed with concrete values, a path that is no root-to-node path
    raises with checked=True (the error comes back from checkify); the good path passes, with the bits of
    the eager NumPy call. Control: without checked=True the traced bad path commits silently."""
    parents = KINDS[kind][0]
    path, steps = _bad_paths(kind)["another tree's"]
    run = _jitted(target, kind, TRACED[traced], checked=True)
    err, _ = run(path, steps, parents)
    with pytest.raises(checkify.JaxRuntimeError, match=r"\(checked\): argument '(path|parents)'"):
        err.throw()
    good, gsteps = _recorded(kind)[4]
    err, got = run(good, gsteps, parents)
    err.throw()
    testing.assert_bitwise_equal(_call(target, kind, good, gsteps, parents), got, "jitted, checked")
    if traced == "all":  # the control: unchecked, nothing is checked on tracers
        _jitted(target, kind, TRACED[traced], checked=False)(path, steps, parents)


@pytest.mark.parametrize("target", TARGETS)
def test_traced_parents_concrete_path_out_of_range(target):
    """With traced parents, concrete path and steps still get their node range checked at call time (at
    trace time, inside the jit)."""
    bad = np.array([[0, 1, 7], [0, 2, 3]], np.int32)
    with pytest.raises(ValueError, match=_MESSAGE.format(target) + r" = 7, which is not a node index"):
        _jitted(target, "tree", ("parents",), checked=False)(bad, np.array([2, 2]), KINDS["tree"][0])


@pytest.mark.parametrize("form", FORMS)
def test_pending_path_checks(seed, form):
    """commit_and_verify's pending path (no parents: the node range up to the steps) is checked at call time
    in every concrete form, traced with checked=True; control: entries after the steps are not read."""
    x = verify_inputs(seed, Shape(2, 4, 1, 2, 8, 8))
    _, prev = gl.verify(**x, parents=_TREE, topk=2, backend="reference")
    pool = x["state0"]  # [S, HV, V, K]: the pending tape [R, D, ...]
    inputs = [x[k] for k in list(x)[1:]]
    none = np.full(2, -1, np.int32)
    rows = np.arange(2, dtype=np.int32)

    def run(path, steps, checked=False):
        pending = gl.Pending(prev, rows, steps, none, none, path=path)
        return gl.commit_and_verify(pool, pending, *inputs, slots=rows, backend="reference", checked=checked)

    bad, steps = np.array([[0, 1, 3], [0, -1, 3]], np.int32), np.array([2, 2])
    with pytest.raises(ValueError, match=r"commit_and_verify: argument 'path' .* got path\[1, 1\] = -1, which is not "
                                         r"a node index in \[0, D\)"):  # fmt: skip
        run(*_form(form, bad, steps))
    want = run(bad, np.array([2, 0]))  # control: the entry after request 1's step is not read
    testing.assert_bitwise_equal(want, run(*_form(form, bad, np.array([2, 0]))), form)
    if form == "jax":  # traced, in checked mode
        f = checkify.checkify(jax.jit(functools.partial(run, checked=True)))
        err, _ = f(jnp.asarray(bad), jnp.asarray(steps))
        with pytest.raises(checkify.JaxRuntimeError, match=r"commit_and_verify \(checked\): argument 'path'"):
            err.throw()
        err, got = f(jnp.asarray(bad), jnp.array([2, 0]))
        err.throw()
        testing.assert_bitwise_equal(want, got, "traced")
