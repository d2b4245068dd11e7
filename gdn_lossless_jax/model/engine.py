"""The host side of decoding: requests join and leave a fixed-shape batch between steps.

:class:`Engine` owns a :class:`~gdn_lossless_jax.model.decode.DecodeState` (the state pool
and the KV cache) and calls one :class:`~gdn_lossless_jax.model.decode.SpecStep` per step on
a batch of ``max_batch`` rows. Between steps it admits waiting requests into free rows
(each takes a free mamba slot and a free scratch row, so slots and rows are reassigned as
requests come and go; batch positions are compacted, so a request's batch position and its
scratch row differ), feeds each request its next inputs (a prompt chunk of up to D tokens,
or its last token), reads back what was accepted, and retires finished requests. Shapes
never change, so the step is traced once per record mode (:attr:`Engine.compiles`).

The prefix cache (``track_interval > 0``): each active request holds a spare *track slot*;
when a step's commit crosses a multiple of the interval, the state at that boundary
(SSM, conv and the KV row) lands in the track slot and the slot becomes a cache entry keyed
by the exact token prefix; it supersedes the request's previous entry (one entry per
request: its longest tracked prefix). A request whose prompt starts with a cached prefix
copies that entry into its own slot and skips the prefix (:attr:`Result.resumed`). Entries
are evicted least recently used when slots run out.

On a device mesh (``Engine(..., mesh=plan)``, a :class:`~gdn_lossless_jax.sharding.MeshPlan`
with a tensor axis only): the GDN heads with their q/k groups are split over the tensor axis,
everything else is replicated. ``gdn-lossless demo --mesh 2x1`` compares the run with one
device: the tokens and final states must be one device's bit for bit, which is why the
reference's K sums and the model's norms and softmax sum in a fixed order (see
``docs/sharding.md``). Not yet checked on two GPUs.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import pool as pool_mod, sharding
from .decode import CommitFn, SpecStep, StepInputs, allocate_state, place_on_mesh, row_keys
from .loop import DecodeLoop, LoopInputs
from .treestep import TreeStep, tree_nodes
from .model import ModelConfig, Params

__all__ = ["Request", "Result", "PrefixCache", "Engine"]

_row_keys = jax.jit(row_keys)


@functools.partial(jax.jit, donate_argnums=0)
def _copy_slots(state, src, dst):
    """Slot ``src[i]``'s SSM, conv and KV states into slot ``dst[i]`` for every i at once (the state
    donated): a ``src`` past the last slot gives zeros, a ``dst`` past it writes nothing; every
    source is read before any destination is written."""

    def move(x):
        return x.at[:, dst].set(x.at[:, src].get(mode="fill", fill_value=0), mode="drop")

    p = state.pool
    pool = dataclasses.replace(p, ssm=move(p.ssm), conv=move(p.conv))
    return dataclasses.replace(state, pool=pool, kv=dataclasses.replace(state.kv, k=move(state.kv.k),
                                                                        v=move(state.kv.v)))  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Request:
    """A prompt to continue.

    Attributes:
      prompt: token ids (at least one).
      max_new_tokens: tokens to generate.
      arrival: the engine step (counted from the start of :meth:`Engine.generate`) from
        which the request may join the batch.
    """

    prompt: tuple[int, ...]
    max_new_tokens: int
    arrival: int = 0

    def __post_init__(self):
        object.__setattr__(self, "prompt", tuple(int(t) for t in self.prompt))


@dataclasses.dataclass
class Result:
    """What a request got.

    Attributes:
      tokens: the ``max_new_tokens`` generated tokens.
      resumed: prompt tokens taken from the prefix cache (0: the whole prompt was computed).
      joined, left: the engine steps at which it joined and left the batch.
      slot, row: the mamba slot and the scratch row it held.
      accepted: drafted tokens accepted, per step that emitted tokens.
      proposed: drafted tokens verified, per step that emitted tokens.
      predictions, gaps: ``[positions]``, the target's greedy token and top-2 logit gap after
        each position the request computed (-1 and NaN for resumed positions).
      tracked: the prefix lengths whose states went to the prefix cache.
    """

    request: Request
    tokens: list[int]
    resumed: int
    joined: int
    left: int
    slot: int
    row: int
    accepted: list[int]
    proposed: list[int]
    predictions: np.ndarray
    gaps: np.ndarray
    tracked: list[int]

    @property
    def decode_steps(self) -> int:
        return len(self.accepted)


@dataclasses.dataclass
class _Active:
    request: Request
    seq: list[int]  # prompt + generated: seq[pos:] are known tokens not yet in the state
    pos: int
    slot: int
    row: int
    track_slot: int
    result: Result
    id: int = 0  # the request's number in this engine (its sampling keys)
    done: bool = False


class PrefixCache:
    """Token prefix -> the slot holding the state after it; least recently used first out."""

    def __init__(self, interval: int):
        self.interval = interval
        self._entries: collections.OrderedDict[bytes, int] = collections.OrderedDict()

    @staticmethod
    def _key(tokens: Sequence[int]) -> bytes:
        return np.asarray(tokens, np.int32).tobytes()

    def __len__(self) -> int:
        return len(self._entries)

    def slots(self) -> list[int]:
        return list(self._entries.values())

    def insert(self, tokens: Sequence[int], slot: int, supersedes: Sequence[int] | None = None) -> list[int]:
        """Add an entry, dropping an entry of the same tokens and the entry for
        ``supersedes`` (a shorter prefix of the same sequence). Returns the dropped slots."""
        key = self._key(tokens)
        dropped = [self._entries.pop(k) for k in {key, self._key(supersedes or ())} if k in self._entries]
        self._entries[key] = slot
        return dropped

    def lookup(self, prompt: Sequence[int]) -> tuple[int, int] | None:
        """The longest cached prefix of ``prompt`` that leaves at least one token to feed:
        ``(length, slot)``, or None."""
        if not self.interval:
            return None
        for b in range(((len(prompt) - 1) // self.interval) * self.interval, 0, -self.interval):
            key = self._key(prompt[:b])
            if key in self._entries:
                self._entries.move_to_end(key)
                return b, self._entries[key]
        return None

    def evict(self) -> int | None:
        """Drop the least recently used entry; returns its slot (None if empty)."""
        if not self._entries:
            return None
        return self._entries.popitem(last=False)[1]


class Engine:
    """Batched greedy (speculative) decoding over the state pool.

    Args:
      params, config: the model (:func:`~gdn_lossless_jax.model.model.init_params`).
      record: the pool's record mode, ``"tuples"`` or ``"snapshots"``.
      drafts: D, inputs verified per step (1: plain greedy decoding with the target alone).
      max_batch: R, batch rows (and scratch rows; the pool has R + 1).
      max_len: KV positions per slot; a request needs ``len(prompt) + max_new_tokens + D``.
      track_interval: prefix-cache interval in tokens (0: no prefix cache).
      cache_entries: prefix-cache entries kept (default: ``2 * max_batch``).
      backend: the library's backend (``"auto"``, ``"reference"``, ``"pallas"``, ``"triton"``).
      commit: the commit the step uses (tests inject controls; default the pool's).
      state_dtype: SSM state dtype.
      mesh: a :class:`~gdn_lossless_jax.sharding.MeshPlan` to decode on, or None (one device).
        The parameters and the state are placed with
        :func:`~gdn_lossless_jax.model.decode.place_on_mesh` (so :attr:`params` then holds the
        conv channels of ``w_qkv`` and ``conv_weight`` in the tensor-parallel order, and the
        pool's conv states are in that order too: :meth:`host_states` reads them back), each
        step's inputs are placed by row, and the step is ``SpecStep(..., mesh=mesh)``. The
        data axis must have size 1: slots and scratch rows are allocated from one free list,
        not per data shard, so a request's slot could live on another shard than its row.
      steps_per_call: K, steps per call of the device (1: one :class:`SpecStep` per call,
        the host deciding between steps; K > 1: a :class:`~gdn_lossless_jax.model.loop.DecodeLoop`
        runs K steps, acceptance and next inputs on the device, and requests join and leave
        every K steps). The tokens and states are the same for any K.
      temperature: 0 for greedy decoding, else speculative sampling at this temperature
        (:func:`~gdn_lossless_jax.model.decode.accept`), with keys from ``seed``: the i-th
        request this engine admits draws at position p with ``fold_in(fold_in(key(seed), i), p)``
        (:func:`~gdn_lossless_jax.model.decode.row_keys`), so its tokens do not depend on K or
        on the other requests.
      seed: the sampling key's seed.
      defer_commit: allocate the pool with ``defer_commit=True``: each step's SSM commit goes
        into the next step's verify (the fused commit-into-next-verify); ``steps_per_call``
        must then be even, and :meth:`host_states` flushes the last commit first.
      tree: draft a tree instead of a chain: branching per depth, e.g. ``(2, 2, 2)``
        (:class:`~gdn_lossless_jax.model.treestep.TreeStep`); ``drafts`` is then the tree's
        node count plus the root, whatever was passed.
      loop_graph: with ``steps_per_call > 1`` on a GPU, record the device loop and its body as
        one CUDA graph (:attr:`~gdn_lossless_jax.model.loop.DecodeLoop.graph`).
    """

    def __init__(
        self,
        params: Params,
        config: ModelConfig,
        *,
        record: str = "tuples",
        drafts: int = 4,
        max_batch: int = 4,
        max_len: int = 1024,
        track_interval: int = 0,
        cache_entries: int | None = None,
        backend: str = "auto",
        commit: CommitFn | None = None,
        state_dtype=jnp.float32,
        mesh: sharding.MeshPlan | None = None,
        steps_per_call: int = 1,
        temperature: float = 0.0,
        seed: int = 0,
        defer_commit: bool = False,
        tree: tuple[int, ...] | None = None,
        loop_graph: bool = False,
    ):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"Engine: argument 'max_batch' must be a positive integer, got {max_batch!r}")
        if mesh is not None and mesh.dp != 1:
            raise ValueError(
                f"Engine: argument 'mesh' must have a data axis of size 1 (heads over the tensor axis only: the "
                f"engine does not allocate slots and rows per data shard), got data axis {mesh.data!r} of size {mesh.dp}"
            )
        self.params, self.config, self.mesh = params, config, mesh
        self.drafts = tree_nodes(tuple(tree)) if tree is not None else drafts
        self.max_batch, self.max_len = max_batch, max_len
        self.cache_entries = 2 * max_batch if cache_entries is None else cache_entries
        # Each active request holds its slot (and, with a prefix cache, a spare track slot); the
        # cache holds the rest.
        n_slots = max_batch + (max_batch + self.cache_entries if track_interval else 0)
        if tree is not None:
            tree = tuple(tree)
            drafts = tree_nodes(tree)
            self.step_fn = TreeStep(config, drafts, track_interval, backend, commit, mesh, temperature, tree=tree)
        else:
            self.step_fn = SpecStep(config, drafts, track_interval, backend, commit, mesh, temperature)
        self.loop = DecodeLoop(self.step_fn, steps_per_call, graph=loop_graph) if steps_per_call != 1 else None
        if defer_commit and steps_per_call % 2:
            raise ValueError(f"Engine: argument 'steps_per_call' must be even with defer_commit=True (the pool's "
                             f"two scratch tapes alternate), got {steps_per_call}")  # fmt: skip
        self.steps_per_call = steps_per_call
        self._key = jax.random.key(seed) if temperature else None
        self.state = allocate_state(
            config, slots=n_slots, requests=max_batch, drafts=drafts, record=record, max_len=max_len,
            state_dtype=state_dtype, defer_commit=defer_commit,
        )  # fmt: skip
        if mesh is not None:
            self.params, self.state = place_on_mesh(mesh, config, params, self.state)
        self.cache = PrefixCache(track_interval)
        self._traces0 = self._traces()
        self._free_slots = collections.deque(range(n_slots))
        self._free_rows = collections.deque(range(max_batch))
        self.steps = 0  # steps run by this engine, over all generate() calls
        self._admitted = 0  # requests admitted, over all generate() calls (their ids)
        # Wall-clock from each call's dispatch to its outputs on the host; the rest of generate()'s
        # wall-clock the host works (inputs, acceptance bookkeeping) while the device has nothing queued.
        self.step_seconds = 0.0

    @property
    def record(self) -> str:
        return self.state.record

    @property
    def compiles(self) -> int:
        """How often the step was traced since this engine was made: 1 after the first step,
        and still 1 after any number of steps (0 if an equal engine had compiled it)."""
        return self._traces() - self._traces0

    def _traces(self) -> int:
        return self.step_fn.traces if self.loop is None else self.loop.traces

    def host_states(self):
        """The pool's SSM and conv states and the KV cache, ``(ssm, conv, KVCache)``, as NumPy
        arrays on the host; on a mesh, the conv channels back in the usual ``[q | k | v]`` order
        (what one device holds after the same requests)."""
        if self.state.pool.deferred is not None:  # the last step's SSM commit is still pending
            self.state = dataclasses.replace(self.state, pool=pool_mod.flush(self.state.pool,
                                                                             backend=self.step_fn.backend))
        ssm, conv, kv = jax.device_get((self.state.pool.ssm, self.state.pool.conv, self.state.kv))
        if self.mesh is not None:
            conv = np.asarray(sharding.from_tp_layout(conv, self.config.geometry, self.mesh.tp, -2))
        return ssm, conv, kv

    # -- slots -------------------------------------------------------------------------
    @property
    def _no_slot(self) -> int:
        """An index past the pool's last slot (the padding slot included): reads zeros, writes nothing."""
        return int(self.state.pool.ssm.shape[1])

    def _take_slot(self) -> int:
        if not self._free_slots:
            slot = self.cache.evict()
            if slot is None:
                raise RuntimeError("Engine: out of mamba slots (every slot holds a request or its track slot)")
            self._free_slots.append(slot)
        return self._free_slots.popleft()

    def _free(self, slot: int) -> None:
        if slot >= 0:
            self._free_slots.append(slot)

    # -- the loop ----------------------------------------------------------------------
    def _check(self, r: Request) -> None:
        if not isinstance(r, Request):
            raise TypeError(f"Engine.generate: requests must be Request objects, got {type(r).__name__}")
        if not r.prompt:
            raise ValueError("Engine.generate: a request's prompt must hold at least one token, got an empty prompt")
        if r.max_new_tokens < 1:
            raise ValueError(f"Engine.generate: a request's max_new_tokens must be >= 1, got {r.max_new_tokens}")
        bad = [t for t in r.prompt if not 0 <= t < self.config.vocab]
        if bad:
            raise ValueError(f"Engine.generate: prompt tokens must be in [0, vocab={self.config.vocab}), got {bad[:5]}")
        need = len(r.prompt) + r.max_new_tokens + self.drafts
        if need > self.max_len:
            raise ValueError(
                f"Engine.generate: a request needs len(prompt) + max_new_tokens + D = {len(r.prompt)} + "
                f"{r.max_new_tokens} + {self.drafts} = {need} KV positions, but max_len={self.max_len}"
            )

    def _admit(self, requests: Sequence[Request], now: int) -> list[_Active]:
        """Admit requests into free rows: each takes a slot (its states copied from a prefix-cache
        entry, or zeros) and a scratch row. One flush of a pending commit (it may write a slot
        being reused) and one copy of every slot, whatever the number of requests: admitting a
        batch costs two device calls, not two a request."""
        copies, admitted = [], []
        for r in requests:
            hit = self.cache.lookup(r.prompt)  # first: a hit becomes the most recently used entry
            resumed, src = hit if hit is not None else (0, None)
            slot, row = self._take_slot(), self._free_rows.popleft()
            copies.append((self._no_slot if src is None else src, slot))
            track = self._take_slot() if self.cache.interval else -1
            n = len(r.prompt) + r.max_new_tokens + self.drafts  # accepted drafts may run past the end
            res = Result(
                r, tokens=[], resumed=resumed, joined=now, left=-1, slot=slot, row=row, accepted=[], proposed=[],
                predictions=np.full(n, -1, np.int32), gaps=np.full(n, np.nan, np.float32), tracked=[],
            )  # fmt: skip
            self._admitted += 1
            admitted.append(_Active(r, list(r.prompt), resumed, slot, row, track, res, id=self._admitted - 1))
        if not copies:
            return admitted
        if self.state.pool.deferred is not None:  # a pending commit may write src or dst: apply it first
            self.state = dataclasses.replace(self.state, pool=pool_mod.flush(self.state.pool,
                                                                             backend=self.step_fn.backend))
        # Every source is read before any destination is written (a slot freed by an eviction in
        # this round may be both), as the copies one at a time would read it.
        src, dst = (np.full(self.max_batch, self._no_slot, np.int32) for _ in range(2))
        src[: len(copies)], dst[: len(copies)] = zip(*copies)
        self.state = _copy_slots(self.state, jnp.asarray(src), jnp.asarray(dst))
        return admitted

    def _retire(self, a: _Active, now: int) -> Result:
        self._free(a.slot)
        self._free(a.track_slot)
        self._free_rows.append(a.row)
        a.result.tokens = a.result.tokens[: a.request.max_new_tokens]
        a.result.left = now
        return a.result

    def _inputs(self, active: list[_Active]) -> StepInputs:
        N, D = self.max_batch, self.drafts
        slots = np.full(N, -1, np.int32)
        rows = np.full(N, N, np.int32)  # the discard row
        pos = np.zeros(N, np.int32)
        tokens = np.zeros((N, D), np.int32)
        n_given = np.ones(N, np.int32)
        track = np.full(N, -1, np.int32)
        ids = np.zeros(N, np.int32)
        for i, a in enumerate(active):
            given = a.seq[a.pos : a.pos + D]
            slots[i], rows[i], pos[i], n_given[i], track[i] = a.slot, a.row, a.pos, len(given), a.track_slot
            ids[i] = a.id
            tokens[i, : len(given)] = given
        key = None if self._key is None else _row_keys(self._key, jnp.asarray(ids), jnp.asarray(pos))
        if self.mesh is None:
            return StepInputs(*(jnp.asarray(x) for x in (slots, rows, pos, tokens, n_given, track)), key=key)
        by_row = jax.sharding.NamedSharding(self.mesh.mesh, jax.sharding.PartitionSpec(self.mesh.data))
        return dataclasses.replace(jax.device_put(StepInputs(slots, rows, pos, tokens, n_given, track), by_row),
                                   key=key)  # fmt: skip

    def _loop_inputs(self, active: list[_Active]) -> LoopInputs:
        N, W = self.max_batch, self.steps_per_call * self.drafts
        slots = np.full(N, -1, np.int32)
        rows = np.full(N, N, np.int32)  # the discard row
        track = np.full(N, -1, np.int32)
        pos, known, budget, ids = (np.zeros(N, np.int32) for _ in range(4))
        tokens = np.zeros((N, W), np.int32)
        for i, a in enumerate(active):
            given = a.seq[a.pos : a.pos + W]
            slots[i], rows[i], track[i], pos[i], ids[i] = a.slot, a.row, a.track_slot, a.pos, a.id
            known[i], budget[i] = len(given), a.request.max_new_tokens - len(a.result.tokens)
            tokens[i, : len(given)] = given
        inputs = LoopInputs(slots, rows, track, pos, tokens, known, budget, ids)
        if self.mesh is None:
            inputs = jax.tree.map(jnp.asarray, inputs)
        else:
            by_row = jax.sharding.NamedSharding(self.mesh.mesh, jax.sharding.PartitionSpec(self.mesh.data))
            inputs = jax.device_put(inputs, by_row)
        return dataclasses.replace(inputs, key=self._key)

    def _absorb(self, a: _Active, out, i: int, track: bool = True) -> None:
        """Update a request from row i of the step's outputs (NumPy arrays); ``track``: whether
        a track state this step reports is the one in the request's track slot (a later step of
        the same device call may have replaced it)."""
        m, n_given = int(out.accepted[i]), min(self.drafts, len(a.seq) - a.pos)
        x, y, g = out.inputs[i], out.predictions[i], out.gaps[i]
        res = a.result
        res.predictions[a.pos : a.pos + m] = y[:m]
        res.gaps[a.pos : a.pos + m] = g[:m]
        ts = int(out.track_steps[i])
        if ts >= 0 and track:
            b = a.pos + ts + 1
            prefix = [*a.seq[: a.pos], *(int(t) for t in x[: b - a.pos])]
            # A request keeps its latest tracked state: the longer prefix supersedes its last one.
            last = prefix[: res.tracked[-1]] if res.tracked else None
            for slot in self.cache.insert(prefix, a.track_slot, supersedes=last):
                self._free(slot)
            res.tracked.append(b)
            a.track_slot = self._take_slot()
        if a.pos + n_given == len(a.seq):  # every known token is in: this step decoded
            drafted = [int(t) for t in x[n_given:m]]
            a.seq.extend(drafted)
            a.seq.append(int(y[m - 1]))
            res.tokens.extend([*drafted, int(y[m - 1])])
            res.accepted.append(m - n_given)
            res.proposed.append(self.drafts - n_given)
        a.pos += m

    def warmup(self) -> float:
        """Compile the step (or the device loop) on an empty batch (every row empty: nothing in
        the pool changes but scratch) and the slot copy (zeros into a free slot). Returns the
        seconds it took."""
        t0 = time.perf_counter()
        if self._free_slots:  # compile the slot copy a request's admission makes (a free slot: zeros)
            pad = jnp.full((self.max_batch,), self._no_slot, jnp.int32)
            self.state = _copy_slots(self.state, pad, pad.at[0].set(self._free_slots[0]))
        if self.loop is None:
            self.state, out = self.step_fn(self.params, self.state, self._inputs([]))
        else:
            self.state, out = self.loop(self.params, self.state, self._loop_inputs([]))
        jax.block_until_ready(out)
        return time.perf_counter() - t0

    def generate(self, requests: Sequence[Request], on_step: Callable[[int], None] | None = None) -> list[Result]:
        """Decode every request to its ``max_new_tokens``; results in the requests' order.

        ``on_step(tokens)`` is called after every step with the tokens it generated (for a
        progress bar).
        """
        for r in requests:
            self._check(r)
        waiting = collections.deque(sorted(range(len(requests)), key=lambda i: requests[i].arrival))
        active: list[tuple[int, _Active]] = []
        results: list[Result | None] = [None] * len(requests)
        clock = 0
        while waiting or active:
            joining = []
            while waiting and len(joining) < len(self._free_rows) and requests[waiting[0]].arrival <= clock:
                joining.append(waiting.popleft())
            active.extend(zip(joining, self._admit([requests[i] for i in joining], clock)))
            if not active:  # nobody has arrived yet
                clock = requests[waiting[0]].arrival
                continue
            t0 = time.perf_counter()
            if self.loop is None:
                self.state, out = self.step_fn(self.params, self.state, self._inputs([a for _, a in active]))
            else:
                self.state, out = self.loop(self.params, self.state, self._loop_inputs([a for _, a in active]))
            out = jax.device_get(out)
            self.step_seconds += time.perf_counter() - t0
            if self.loop is None:
                steps = [(out, None)]
            else:
                steps = [(jax.tree.map(lambda x, t=t: x[t], out.steps), out.active[t])
                         for t in range(self.steps_per_call)]  # fmt: skip
            # On the device a request's track slot takes every boundary crossed in the call: the
            # last crossing is the state it holds.
            last_track = {b: max((t for t, (o, _) in enumerate(steps) if o.track_steps[b] >= 0), default=-1)
                          for b in range(len(active))}  # fmt: skip
            emitted = 0
            for t, (out, ran) in enumerate(steps):
                self.steps += 1
                clock += 1
                still = []
                for b, (i, a) in enumerate(active):
                    if ran is not None and not ran[b]:
                        still.append((i, a))
                        continue
                    before = len(a.result.tokens)
                    self._absorb(a, out, b, track=t == last_track[b])
                    emitted += min(len(a.result.tokens), a.request.max_new_tokens) - min(before, a.request.max_new_tokens)
                    if len(a.result.tokens) >= a.request.max_new_tokens:
                        results[i] = self._retire(a, clock)
                        a.done = True
                    else:
                        still.append((i, a))
                if ran is None:
                    active = still
            active = [(i, a) for i, a in active if not a.done]
            if on_step is not None:
                on_step(emitted)
        return results
