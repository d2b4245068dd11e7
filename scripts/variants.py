"""Launch variants named by tags, shared by the tuning and profiling scripts.

A tag list adds to or overrides fixed fields of :class:`VerifyConfig`: ``gram`` (the Gram
form), ``one_pass``, ``kcN`` (``k_chunk=N``), ``unN`` (``unroll=N``), ``nsN`` (``num_stages=N``),
``phN`` (``prep_heads=N``), ``noef`` (``evict=None``), ``lq`` (``prefetch_q=False``), ``mma``
(``products="mma"``), ``tf`` / ``rf`` (``order="tiles"`` / ``"requests"``); other tags are ignored
(a script's own, such as ``portable``). Fields not given keep ``VerifyConfig``'s defaults.
"""


def verify_config(tags, **fields):
    from gdn_lossless_jax.backends.pallas import VerifyConfig

    for tag in tags:
        if tag == "gram":
            fields["algorithm"] = "gram"
        elif tag == "one_pass":
            fields["one_pass"] = True
        elif tag == "noef":
            fields["evict"] = None
        elif tag == "lq":
            fields["prefetch_q"] = False
        elif tag == "mma":
            fields["products"] = "mma"
        elif tag in ("tf", "rf"):
            fields["order"] = "tiles" if tag == "tf" else "requests"
        elif tag[:2] in ("kc", "un", "ns", "ph") and tag[2:].isdigit():
            fields[{"kc": "k_chunk", "un": "unroll", "ns": "num_stages", "ph": "prep_heads"}[tag[:2]]] = int(tag[2:])
    return VerifyConfig(**fields)


def triton_verify_config(tags, **fields):
    """The triton backend's :class:`VerifyConfig` with the tags that apply to it (``nsN``, ``phN``,
    ``tf`` / ``rf``, ``noef`` (``evict=""``))."""
    from gdn_lossless_jax.backends.triton import VerifyConfig

    for tag in tags:
        if tag == "noef":
            fields["evict"] = ""
        elif tag in ("tf", "rf"):
            fields["order"] = "tiles" if tag == "tf" else "requests"
        elif tag[:2] in ("ns", "ph") and tag[2:].isdigit():
            fields[{"ns": "num_stages", "ph": "prep_heads"}[tag[:2]]] = int(tag[2:])
    return VerifyConfig(**fields)
