"""Draft trees: parent indices, root-to-node paths, and their checks.

A draft tree of D nodes is given per request by ``parents [N, D]`` (or one ``[D]`` for every
request): ``parents[n, d]`` is node d's parent, in ``[0, d)``, or -1 for a child of the committed
state (the root). Nodes are in topological order, a parent before its children, so a tree can have
no cycle. The linear chain of D drafts is ``parents = [-1, 0, 1, ..., D-2]``.

Node d's state is its parent's state stepped by node d's inputs, with exactly the chain's rounding
(:func:`gdn_lossless_jax.reference.tree_chain`): the states along a root-to-node path are those a
chain verify of that path's inputs computes. The tape holds one entry per node. Commit takes the
accepted path per request, ``path [N, P]``: node indices from the root's child down, padded with -1;
``steps`` (and ``track_steps``) are then positions along the path, 0-based, exactly as a chain's
steps are positions along the chain (whose path is ``[0, 1, ..., D-1]``). :func:`path_to` gives the
path and step of an accepted node (the leaf) from ``parents``.

The checks here raise naming the function, the argument, the expected and the actual value:
:func:`check_parents_values` and :func:`check_path_values` on concrete values (NumPy, or jax
arrays that are not tracers, such as :func:`path_to`'s, pulled to the host), at call time;
:func:`checkify_parents` and :func:`checkify_path` on traced values, in ``checked=True`` mode
(:mod:`gdn_lossless_jax.checked` says how to run them under ``jax.jit``).
:func:`gdn_lossless_jax.checks.check_path_indices` picks which of the path checks run where.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

__all__ = [
    "chain_parents",
    "is_chain",
    "check_parents_values",
    "checkify_parents",
    "checkify_path",
    "check_path_values",
    "path_to",
    "depths",
    "ancestors",
    "greedy_accepted",
    "full_tree",
    "beam_tree",
]


def chain_parents(D: int) -> np.ndarray:
    """The parents of a linear chain of D drafts: ``[-1, 0, 1, ..., D-2]``."""
    return np.arange(-1, D - 1, dtype=np.int32)


def is_chain(parents: np.ndarray) -> bool:
    """Whether host ``parents [..., D]`` is the linear chain in every row."""
    p = np.asarray(parents)
    return p.ndim >= 1 and bool(np.array_equal(p, np.broadcast_to(chain_parents(p.shape[-1]), p.shape)))


def check_parents_values(fn: str, parents: np.ndarray, topk: int | None = None) -> None:
    """Raise ``ValueError`` unless every ``parents[n, d]`` is in ``[-1, d)`` and, with ``topk``, no
    node (the root included) has more than ``topk`` children. ``parents``: host ``[N, D]`` ints."""
    p = np.asarray(parents).reshape(-1, np.shape(parents)[-1])
    N, D = p.shape
    d = np.broadcast_to(np.arange(D), p.shape)
    for bad, what in (
        ((p < -1) | (p >= D), "is out of range: a parent is a node index in [0, D) or -1 for a child of the root"),
        (p == d, "is the node itself: a cycle"),
        ((p > d) & (p < D), "is after its child: nodes must be in topological order (each parent before its "
                            "children, which also rules out cycles)"),
    ):  # fmt: skip
        if bad.any():
            n, j = (int(x[0]) for x in np.nonzero(bad))
            raise ValueError(
                f"{fn}: argument 'parents' must have parents[n, d] in [-1, d) (topological order), got "
                f"parents[{n}, {j}] = {int(p[n, j])}, which {what}; request {n}'s parents: {p[n].tolist()}"
            )
    if topk is not None:
        for n in range(N):
            counts = np.bincount(p[n] + 1, minlength=D + 1)
            if counts.max() > topk:
                node = int(np.argmax(counts)) - 1
                raise ValueError(
                    f"{fn}: argument 'parents' gives {'the root' if node < 0 else f'node {node}'} of request {n} "
                    f"{int(counts.max())} children, more than topk={topk} (the most children a node may have); "
                    f"pass topk={int(counts.max())} or more"
                )


def checkify_parents(fn: str, parents: jax.Array, topk: int | None = None) -> None:
    """The checked mode of :func:`check_parents_values` on traced ``parents [N, D]``."""
    p = jnp.asarray(parents)
    N, D = p.shape
    d = jnp.arange(D)[None, :]
    bad = (p < -1) | (p >= d)
    flat = jnp.argmax(bad.ravel())
    n, j = flat // D, flat % D
    checkify.check(
        ~bad.any(),
        f"{fn} (checked): argument 'parents' must have parents[n, d] in [-1, d) (topological order: a parent "
        "before its children, no cycles, no index out of range), got parents[{n}, {j}] = {x}",
        n=n, j=j, x=p[n, j],
    )  # fmt: skip
    if topk is not None:
        counts = (p[:, :, None] == jnp.arange(-1, D)[None, None, :]).sum(1)  # [N, D+1]
        flat = jnp.argmax(counts.ravel())
        checkify.check(
            counts.max() <= topk,
            f"{fn} (checked): argument 'parents' gives node {{node}} of request {{n}} {{c}} children, more than "
            f"topk={topk} (node -1 is the root)",
            n=flat // (D + 1), node=flat % (D + 1) - 1, c=counts.max(),
        )  # fmt: skip


def _path_problems(path, steps, track_steps, D, parents):
    """``(bad [N, P], why)`` masks of path entries that break the rules (``jnp`` or ``np``)."""
    xp = np if isinstance(path, np.ndarray) else jnp
    N, P = path.shape
    pos = xp.arange(P)[None, :]
    used = pos <= xp.maximum(steps, track_steps)[:, None]  # the entries commit reads
    out = used & ((path < 0) | (path >= D))
    if parents is None:
        return [(out, "is not a node index in [0, D)")]
    safe = xp.clip(path, 0, D - 1)
    par = xp.take_along_axis(parents, safe, axis=1)  # each entry's parent
    prev = xp.concatenate([xp.full((N, 1), -1, path.dtype), path[:, :-1]], axis=1)  # the entry before it
    return [(out, "is not a node index in [0, D)"),
            (used & ~out & (par != prev), "is not a child of the entry before it (or, at position 0, of the root)")]  # fmt: skip


def check_path_values(fn: str, path, steps, track_steps, D: int, parents=None) -> None:
    """Concrete values (NumPy, or concrete jax arrays: read on the host): raise ``ValueError`` unless
    ``path[i, :max(steps[i], track_steps[i]) + 1]`` is a root-to-node path of the tree (with
    ``parents``; without, only the node range is checked)."""
    path, steps, track_steps = (np.asarray(x) for x in (path, steps, track_steps))
    parents = None if parents is None else np.broadcast_to(np.asarray(parents), (path.shape[0], D))
    for bad, why in _path_problems(path, steps, track_steps, D, parents):
        if bad.any():
            i, j = (int(x[0]) for x in np.nonzero(bad))
            raise ValueError(
                f"{fn}: argument 'path' must hold a root-to-node path of the tree up to the accepted step, got "
                f"path[{i}, {j}] = {int(path[i, j])}, which {why}; request {i}'s path: {path[i].tolist()}"
                + ("" if parents is None else f", its parents: {parents[i].tolist()}")
            )


def checkify_path(fn: str, path, steps, track_steps, D: int, parents=None) -> None:
    """The checked mode of :func:`check_path_values` on traced values."""
    path, steps, track_steps = (jnp.asarray(x) for x in (path, steps, track_steps))
    if parents is not None:
        parents = jnp.broadcast_to(jnp.asarray(parents), (path.shape[0], D))
    P = path.shape[1]
    for bad, why in _path_problems(path, steps, track_steps, D, parents):
        flat = jnp.argmax(bad.ravel())
        i, j = flat // P, flat % P
        checkify.check(
            ~bad.any(),
            f"{fn} (checked): argument 'path' must hold a root-to-node path of the tree up to the accepted step, "
            f"got path[{{i}}, {{j}}] = {{x}}, which {why}",
            i=i, j=j, x=path[i, j],
        )  # fmt: skip


def depths(parents) -> jax.Array:
    """Each node's depth, ``[N, D] -> [N, D]`` int32: 0 for a child of the root (a node's position
    on its root-to-node path). Parents must be in topological order."""
    p = jnp.asarray(parents, jnp.int32)
    D = p.shape[-1]
    dep = jnp.zeros(p.shape, jnp.int32)
    for d in range(D):  # a parent's depth is final before its children's (topological order)
        par = p[..., d]
        pd = jnp.take_along_axis(dep, jnp.clip(par, 0, D - 1)[..., None], axis=-1)[..., 0]
        dep = dep.at[..., d].set(jnp.where(par >= 0, pd + 1, 0))
    return dep


def ancestors(parents) -> jax.Array:
    """``[N, D] -> [N, D, D]`` bool: ``[n, i, j]`` when node j is on node i's root path (i itself included),
    the mask of a tree's attention (a node sees its ancestors, not its siblings). Parents must be in
    topological order. Jittable.

    >>> import numpy as np
    >>> ancestors(np.array([[-1, 0, 0, 1]])).astype(int)[0].tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    """
    p = jnp.asarray(parents, jnp.int32)
    N, D = p.shape
    rows = jnp.arange(N)
    anc = jnp.broadcast_to(jnp.eye(D, dtype=bool), (N, D, D))
    for i in range(D):  # a parent's row is final before its children's (topological order)
        par = p[:, i]
        anc = anc.at[:, i].set(anc[:, i] | (anc[rows, jnp.clip(par, 0, D - 1)] & (par >= 0)[:, None]))
    return anc


def greedy_accepted(parents, tokens, predictions) -> jax.Array:
    """Greedy acceptance along a draft tree whose node 0 is the given token (the root, always accepted) and
    whose other nodes descend from it (``parents[:, d]`` in ``[0, d)`` for ``d >= 1``): node d is accepted
    when its parent is and its token equals the target's prediction after the parent. ``parents``,
    ``tokens``, ``predictions``: ``[N, D]`` int. Returns ``[N, D]`` bool; the deepest accepted node (by
    :func:`depths`) is the accepted path's leaf (:func:`path_to`). Jittable.

    >>> import numpy as np  # node 1 (7) is not the target's 8 after the root; node 2 (8) is, and node 3 (9) after it
    >>> greedy_accepted(np.array([[-1, 0, 0, 2]]), np.array([[5, 7, 8, 9]]), np.array([[8, 9, 9, 0]])).tolist()
    [[True, False, True, True]]
    """
    p, x, y = (jnp.asarray(a, jnp.int32) for a in (parents, tokens, predictions))
    N, D = x.shape
    rows = jnp.arange(N)
    ok = jnp.zeros((N, D), bool).at[:, 0].set(True)
    for d in range(1, D):
        par = jnp.maximum(p[:, d], 0)
        ok = ok.at[:, d].set(ok[rows, par] & (x[:, d] == y[rows, par]))
    return ok


def path_to(parents, nodes, width: int | None = None) -> tuple[jax.Array, jax.Array]:
    """The root-to-node path of each request's accepted node, and its step, for :func:`gdn_lossless_jax.commit`.

    Args:
      parents: ``[N, D]`` or ``[D]`` int, as verify took them.
      nodes: ``[N]`` int, each request's last accepted node (the leaf of the accepted path);
        -1: nothing accepted.
      width: P, the path's width (default D); a node deeper than P - 1 is not representable
        (its step would be >= P: commit then writes nothing for it).
    Returns:
      ``(path [N, P], steps [N])`` int32: ``path[i, :steps[i] + 1]`` the nodes from the root's
      child down to ``nodes[i]``, -1 after them; ``steps[i]`` the node's depth (-1 for none).
      Jittable.

    >>> import numpy as np
    >>> path, steps = path_to(np.array([-1, -1, 0, 0, 1, 2]), np.array([5, 1, -1]))
    >>> path.tolist(), steps.tolist()
    ([[0, 2, 5, -1, -1, -1], [1, -1, -1, -1, -1, -1], [-1, -1, -1, -1, -1, -1]], [2, 0, -1])
    """
    nodes = jnp.asarray(nodes, jnp.int32)
    N = nodes.shape[0]
    p = jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (N, jnp.shape(parents)[-1]))
    D = p.shape[1]
    P = D if width is None else width
    dep = jnp.where(nodes >= 0, jnp.take_along_axis(depths(p), jnp.clip(nodes, 0, D - 1)[:, None], axis=1)[:, 0], -1)
    path = jnp.full((N, P), -1, jnp.int32)
    cur = nodes
    for j in range(D):  # walk up: the j-th ancestor sits at position depth - j
        pos = dep - j
        ok = (cur >= 0) & (pos >= 0) & (pos < P)
        path = path.at[jnp.arange(N), jnp.where(ok, pos, P)].set(cur, mode="drop")
        cur = jnp.where(cur >= 0, jnp.take_along_axis(p, jnp.clip(cur, 0, D - 1)[:, None], axis=1)[:, 0], -1)
    return path, dep


def full_tree(branching) -> np.ndarray:
    """The parents of the full tree with ``branching[i]`` children at each node of depth i - 1 (the
    root for i = 0), in breadth-first order: ``full_tree([2, 2, 2])`` has 2 + 4 + 8 = 14 nodes.

    >>> full_tree([2, 2]).tolist()
    [-1, -1, 0, 0, 1, 1]
    """
    parents, level = [], [-1]
    for k in branching:
        nxt = []
        for par in level:
            for _ in range(int(k)):
                nxt.append(len(parents))
                parents.append(par)
        level = nxt
    return np.asarray(parents, np.int32)


def beam_tree(topk: int, depth: int) -> np.ndarray:
    """An EAGLE-style top-k tree: ``topk`` nodes at each of ``depth`` depths (the top-k of the
    previous depth's expansions), ``topk * depth`` nodes; here each depth's nodes are children of
    the previous depth's first node, one valid shape among those a drafter may pick.

    >>> beam_tree(2, 3).tolist()
    [-1, -1, 0, 0, 2, 2]
    """
    parents = [-1] * topk
    for t in range(1, depth):
        parents += [(t - 1) * topk] * topk
    return np.asarray(parents, np.int32)
