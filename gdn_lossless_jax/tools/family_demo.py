"""``gdn-lossless demo --family olmo_hybrid|kimi_linear``: speculative decoding of an OLMo-Hybrid or Kimi Linear
model through the state pool in both record modes, against plain greedy decoding.

The model: ``--checkpoint DIR``, a checkpoint of that family (e.g. ``tests/fixtures/hf/kimi_linear``), or by
default a tiny model of the family with random weights built in memory
(:func:`gdn_lossless_jax.model.hf.family.random_model`: the test fixtures' sizes, no checkpoint file). Random
prompts are decoded by :class:`~gdn_lossless_jax.model.hf.family_decode.FamilyDecoder` three times: plain greedy
decoding (``none``: one token a step), then speculatively (D inputs a step) with the pool in each record mode
(``tuples``, for Kimi's KDA layers :class:`~gdn_lossless_jax.tape.KDATuples`; ``snapshots``). Printed: tokens per
second per run, the mean accepted length, the state and scratch of each run (the scratch as
:mod:`gdn_lossless_jax.tools.memory` counts it for the model's geometry, which is what the pool allocates), and a
verdict: ``identical`` when both record modes gave the same tokens, plain greedy decoding's on the CPU (on a GPU
that is measured, not checked: a step of D tokens rounds its matmuls otherwise), and the two pools end with the
same SSM and conv states bit for bit. Exit status 1 otherwise. The mean accepted length counts every step but each
batch's last (the decoder does not report acceptance; the demo reads it from the contexts its draft is given). (Plain greedy decoding's pool is not compared: a
speculative step may go past the last token asked for, so its pool holds other positions.)

The draft (``--draft``): ``oracle`` (the default) proposes plain greedy decoding's next tokens with the one at
every fifth position changed, so that steps accept 0 to D - 1 drafts (prompt lookup accepts next to nothing on
random weights, whose continuations do not repeat); ``lookup`` is the decoder's own prompt lookup. The tokens do
not depend on the draft: a wrong verify or commit changes them (a proposal accepted where greedy decoding
disagrees) or the states.
"""

from __future__ import annotations

import argparse
import os
import time

from .demo import NONE, memory_text, print_speeds, print_states, print_tokens, print_verdict, progress_bar

__all__ = ["add_family_options", "demo_family", "oracle_draft", "FAMILY_RUNS", "DRAFTS"]

#: The runs, in order: plain greedy decoding first (the oracle draft proposes its tokens), then each record mode.
FAMILY_RUNS = (NONE, "tuples", "snapshots")
DRAFTS = ("oracle", "lookup")
WRONG_EVERY = 5  # the oracle's proposal at every fifth position is wrong


def add_family_options(d: argparse.ArgumentParser) -> None:
    """``--family`` and ``--draft`` of ``gdn-lossless demo``."""
    from ..model.hf.config import FAMILY_TYPES

    d.add_argument("--family", choices=list(FAMILY_TYPES), default=None,
                   help="decode an OLMo-Hybrid (GDN, beta scale 2) or Kimi Linear (KDA) model instead: --checkpoint "
                        "DIR of that family, or by default a tiny one with random weights; plain greedy decoding "
                        "and both record modes, the verdict 'identical' when both modes gave greedy decoding's "
                        "tokens and the same final SSM and conv states bit for bit. --drafts, --prompts, "
                        "--prompt-len, --tokens, --batch, --backend, --seed and --progress apply")  # fmt: skip
    d.add_argument("--draft", choices=DRAFTS, default=None,
                   help="with --family, the proposals: oracle (default; plain greedy decoding's tokens, every fifth "
                        "one changed, so that steps accept 0 to D-1 drafts) or lookup (prompt lookup, which accepts "
                        "next to nothing on random weights)")  # fmt: skip


def oracle_draft(greedy, vocab: int, every: int = WRONG_EVERY):
    """A draft for :meth:`~gdn_lossless_jax.model.hf.family_decode.FamilyDecoder.generate` proposing the tokens of
    ``greedy [B, T]`` (plain greedy decoding of the same prompts, prompt included) after each context, the one at
    each position ``p`` with ``p % every == 2`` changed to ``(token + 1) % vocab``; past greedy's end, its last token.

    >>> import numpy as np
    >>> oracle_draft(np.array([[5, 6, 7, 8, 9, 10]]), 16)([np.array([5])], 3).tolist()
    [[6, 8, 8]]
    """
    import numpy as np

    greedy = np.asarray(greedy)

    def draft(contexts, n):
        out = np.zeros((len(contexts), n), np.int32)
        for i, ctx in enumerate(contexts):
            pos = len(ctx) + np.arange(n)
            want = greedy[i, np.minimum(pos, greedy.shape[1] - 1)]
            out[i] = np.where(pos % every == 2, (want + 1) % vocab, want)
        return out

    return draft


class _Counted:
    """A draft wrapped: each call after the first measures the tokens the step before emitted per request (the
    contexts' growth: the accepted drafts and the target's token) and moves the progress bar. The last step is
    followed by no call: its acceptance is not counted."""

    def __init__(self, draft, bar, prompt_len: int, new: int):
        self.draft, self.bar, self.T, self.new = draft, bar, prompt_len, new
        self.last, self.accepted, self.shown = None, [], 0

    def show(self, lengths) -> None:
        import numpy as np

        done = int(np.minimum(np.asarray(lengths) - self.T, self.new).sum())
        self.bar.update(done - self.shown)
        self.shown = done

    def __call__(self, contexts, n):
        import numpy as np

        lengths = np.array([len(c) for c in contexts])
        if self.last is not None:
            self.accepted.append(lengths - self.last - 1)
        self.last = lengths
        self.show(lengths)
        return self.draft(contexts, n)


def _model(args, where: str):
    """The checkpoint of ``--checkpoint`` (checked: a folder whose config.json names this family) or the random
    tiny model; and a line saying which."""
    from ..model import load_pretrained
    from ..model.hf.config import FAMILY_TYPES, read_json
    from ..model.hf.family import random_model

    fam, path = args.family, args.checkpoint
    if path is None:
        return random_model(fam, seed=args.seed, backend=args.backend), (
            f"random weights (seed {args.seed}), built in memory at the test fixtures' sizes; --checkpoint DIR "
            "decodes a checkpoint")  # fmt: skip
    if not os.path.isdir(path):
        raise ValueError(f"{where}: argument --checkpoint: no folder {path!r}")
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise ValueError(f"{where}: argument --checkpoint: {path!r} has no config.json (not a Hugging Face "
                         f"checkpoint folder)")  # fmt: skip
    content = read_json(config, f"{where}: argument --checkpoint")
    mt = content.get("model_type") if isinstance(content, dict) else None
    if mt != fam:
        hint = f"; decode it with --family {mt}" if mt in FAMILY_TYPES else ""
        raise ValueError(f"{where}: argument --checkpoint: {path!r} is a {mt!r} checkpoint (its config.json's "
                         f"model_type), not {fam!r}{hint}")  # fmt: skip
    return load_pretrained(path, backend=args.backend), f"the checkpoint {path}"


def demo_family(args: argparse.Namespace) -> int:
    """``demo --family``: the module docstring. Returns the exit status (0: identical, 1: not)."""
    import jax
    import numpy as np

    from ..model.hf.family_decode import FamilyDecoder, prompt_lookup
    from ..pool import scratch_rows
    from .generate import refuse_options
    from .memory import conv_window_bytes, scratch_bytes

    fam = args.family
    where = f"demo --family {fam}"
    left_out = "left out (the family demo's draft is --draft's)"
    more = [
        ("--steps-per-call", args.steps_per_call not in (None, 1), args.steps_per_call,
         "1 or left out (FamilyDecoder has no device loop: the host accepts between steps)"),
        ("--record", args.record is not None, " ".join(args.record or ()),
         "left out (the family demo runs plain greedy decoding and both record modes, and its verdict compares all "
         "three)"),
        ("--draft-agreement", args.draft_agreement is not None, args.draft_agreement, left_out),
        ("--tokens-per-step", args.tokens_per_step is not None, args.tokens_per_step, left_out),
    ]  # fmt: skip
    refuse_options(args, where, "FamilyDecoder", "the family's random model, or --checkpoint's config.json, gives the "
                   "size", more)  # fmt: skip
    if args.batch is None:
        args.batch = args.prompts
    for name in ("drafts", "prompts", "prompt_len", "tokens", "batch"):
        if getattr(args, name) < 1:
            raise ValueError(f"{where}: argument --{name.replace('_', '-')} must be a positive integer, got "
                             f"{getattr(args, name)}")  # fmt: skip
    draft_kind = args.draft or "oracle"
    model, source = _model(args, where)
    c = model.config
    D, P, T, N = args.drafts, args.prompts, args.prompt_len, args.tokens
    B = min(args.batch, P)
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(0, c.vocab, (P, T)).astype(np.int32)
    chunks = [prompts[i : i + B] for i in range(0, P, B)]
    total = P * N
    kda = fam == "kimi_linear"
    print(f"gdn-lossless demo: {c.describe()}")
    print(f"model      {source}")
    draft_text = (f"plain greedy decoding's tokens, every {WRONG_EVERY}th one changed (an oracle: steps accept 0 to "
                  f"D-1 drafts)" if draft_kind == "oracle" else "prompt lookup")  # fmt: skip
    print(f"{P} prompts of {T} tokens, {N} generated each, {B} at a time; D={D}, draft: {draft_text}; "
          f"{'KDA' if kda else 'GDN'} layers' tuples as {'KDATuples' if kda else 'Tuples'}; backend {args.backend} "
          f"({jax.default_backend()})", flush=True)  # fmt: skip
    tokens, pools, speeds, memory = {}, {}, {}, {}
    for mode in FAMILY_RUNS:
        d = 1 if mode == NONE else D
        record = "tuples" if mode == NONE else mode
        max_len = T + N + d - 1

        def decoder(rows: int):
            return FamilyDecoder(model, requests=rows, drafts=d, max_len=max_len, record=record, backend=args.backend)

        t0 = time.perf_counter()
        for rows in sorted({len(ch) for ch in chunks}):  # compile: one shape per batch size
            decoder(rows).generate(next(ch for ch in chunks if len(ch) == rows), 1)
        compile_s = time.perf_counter() - t0
        out, decoders, steps, accepted = [], [], 0, []
        with progress_bar(args.progress, total, mode) as bar:
            t0 = time.perf_counter()
            for i, chunk in enumerate(chunks):
                proposals = oracle_draft(tokens[NONE][i], c.vocab) if mode != NONE and draft_kind == "oracle" else None
                counted = _Counted(proposals or prompt_lookup, bar, T, N)
                dec = decoder(len(chunk))
                decoders.append(dec)
                out.append(dec.generate(chunk, N, counted))
                jax.block_until_ready(dec.pool)
                counted.show(np.full(len(chunk), T + N))
                steps += dec.steps
                accepted += counted.accepted
            wall = time.perf_counter() - t0
        states = [{"ssm": np.asarray(x.pool.ssm), "conv": np.asarray(x.pool.conv),
                   **{f"window {k}": np.asarray(v) for k, v in x.windows.items()}} for x in decoders]  # fmt: skip
        tokens[mode], pools[mode], speeds[mode] = out, states, total / wall
        first = decoders[0]  # the full batch's (a smaller last one may follow)
        g = first.geometry
        tape = scratch_bytes(g, d, record, requests=len(chunks[0]))
        windows = conv_window_bytes(g, d, requests=len(chunks[0]), conv_dtype=c.jnp_dtype)
        memory[mode] = tape
        acc = np.concatenate(accepted) if accepted else np.zeros(1)
        gain = ("one token a step" if d == 1 else
                f"mean accepted length {acc.mean():.2f} of {d - 1} drafted ({acc.mean() + 1:.2f} tokens per step)")
        print(f"{mode:<10} {total} tokens in {wall:.2f} s: {total / wall:,.1f} tokens/s (compile {compile_s:.1f} s); "
              f"{steps} steps of {wall / steps * 1e3:.2f} ms, {gain}; "
              f"{memory_text(first.pool.ssm.nbytes + first.pool.conv.nbytes, tape, windows)}", flush=True)  # fmt: skip
    print_speeds({m: speeds[m] for m in ("tuples", "snapshots", NONE)})
    rows = scratch_rows(len(chunks[0]))
    print(f"memory     D={D}, {len(chunks[0])} requests ({rows} scratch rows): SSM tape {memory['tuples'] / 2**20:.3f} "
          f"MiB with tuples, {memory['snapshots'] / 2**20:.3f} MiB with snapshots "
          f"({memory['snapshots'] / memory['tuples']:.1f}x); the released model's: gdn-lossless memory --family "
          f"{fam}")  # fmt: skip
    generated = {m: [row[T:] for o in tokens[m] for row in o] for m in FAMILY_RUNS}
    # Plain greedy decoding is checked on the CPU only: on a GPU a step of D tokens multiplies other matrix shapes
    # than a step of one (other roundings), and a near tie between two tokens can go the other way.
    exact = jax.default_backend() == "cpu"
    note = "" if exact else " (measured, not checked: on a GPU a step of D tokens rounds its matmuls otherwise)"
    equal = print_tokens("tuples", "snapshots", generated["tuples"], generated["snapshots"], total)
    for mode in ("tuples", "snapshots"):
        same = print_tokens(mode, NONE, generated[mode], generated[NONE], total, note)
        equal &= same or not exact
    what = "SSM and conv states" + (" and PLE windows" if decoders[0].windows else "")
    equal &= print_states("tuples", "snapshots", pools["tuples"], pools["snapshots"], what)
    greedy = "plain greedy decoding's tokens" if exact else "the same tokens"
    return print_verdict(equal, f"tuples and snapshots gave {greedy} and the same final {what}",
                         "the record modes" + (" and plain greedy decoding" if exact else "") + " disagree")
