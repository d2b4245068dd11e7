"""Launch variants named by tags, and the commit case, shared by the tuning and profiling scripts.

A tag list adds to or overrides fixed fields of :class:`VerifyConfig`: ``gram`` (the Gram
form), ``one_pass``, ``kcN`` (``k_chunk=N``), ``unN`` (``unroll=N``), ``nsN`` (``num_stages=N``),
``phN`` (``prep_heads=N``), ``noef`` (``evict=None``), ``lq`` (``prefetch_q=False``), ``mma``
(``products="mma"``), ``tf`` / ``rf`` (``order="tiles"`` / ``"requests"``), ``dfn`` / ``dfu`` / ``dfb``
(``dot_fma="none"`` / ``"u"`` / ``"both"``), ``prc`` / ``prs`` / ``prr`` (``pending_replay="carry"`` / ``"split"`` / ``"rows"``),
``psv`` (``pending_slice_v=True``: the fused tuple kernel reads ``v`` sliced out by XLA); other tags are ignored
(a script's own, such as ``portable``). Fields not given keep ``VerifyConfig``'s defaults.
"""


_NUMBERED = {"kc": "k_chunk", "un": "unroll", "ns": "num_stages", "ph": "prep_heads"}  # tag prefix -> field
_ORDERS = {"tf": {"order": "tiles"}, "rf": {"order": "requests"}}
_DOT_FMA = {"dfn": {"dot_fma": "none"}, "dfu": {"dot_fma": "u"}, "dfb": {"dot_fma": "both"}}
_REPLAYS = {"prc": {"pending_replay": "carry"}, "prs": {"pending_replay": "split"}, "prr": {"pending_replay": "rows"},
            "psv": {"pending_slice_v": True}}


def _apply(tags, fields: dict, named: dict, numbered) -> dict:
    """``fields`` with each tag applied in turn: a name from ``named`` (its field values), or a
    prefix from ``numbered`` (prefix -> field) followed by a number; other tags are ignored."""
    for tag in tags:
        if tag in named:
            fields.update(named[tag])
        elif tag[:2] in numbered and tag[2:].isdigit():
            fields[numbered[tag[:2]]] = int(tag[2:])
    return fields


def verify_config(tags, **fields):
    from gdn_lossless_jax.backends.pallas import VerifyConfig

    named = {"gram": {"algorithm": "gram"}, "one_pass": {"one_pass": True}, "noef": {"evict": None},
             "lq": {"prefetch_q": False}, "mma": {"products": "mma"}, **_ORDERS, **_DOT_FMA, **_REPLAYS}  # fmt: skip
    return VerifyConfig(**_apply(tags, fields, named, _NUMBERED))


def triton_verify_config(tags, **fields):
    """The triton backend's :class:`VerifyConfig` with the tags that apply to it (``kcN``, ``nsN``,
    ``phN``, ``bvN`` (``block_v=N``), ``chr`` / ``chc`` (``chain="rows"`` / ``"chunks"``),
    ``unr`` / ``unl`` (``unroll=True`` / ``False``), ``tf`` / ``rf``, ``noef`` (``evict=""``), ``prs`` / ``prr``)."""
    from gdn_lossless_jax.backends.triton import VerifyConfig

    numbered = {k: _NUMBERED[k] for k in ("kc", "ns", "ph")} | {"bv": "block_v"}
    named = {"noef": {"evict": ""}, "prs": {"pending_replay": "split"}, "prr": {"pending_replay": "rows"},
             "chr": {"chain": "rows"}, "chc": {"chain": "chunks"}, "unr": {"unroll": True},
             "unl": {"unroll": False}, **_ORDERS}  # fmt: skip
    return VerifyConfig(**_apply(tags, fields, named, numbered))


def commit_case(N: int, D: int, layers: int = 30):
    """The scripts' commit case on the benchmark geometry (H=16, HV=32, K=V=128): ``(pool, tuples,
    snapshots, index args)``, a pool of ``2 N + 8`` slots, a quarter of the requests crossing a
    track boundary."""
    from gdn_lossless_jax.cases import Shape, commit_indices, commit_tapes

    S = 2 * N + 8
    pool, tup, snp = commit_tapes(0, Shape(N=N, D=D, H=16, HV=32, K=128, V=128), layers=layers, slots_in_pool=S)
    return pool, tup, snp, commit_indices(0, N=N, D=D, slots_in_pool=S, track_fraction=0.25).as_args()
