"""Optional peer baseline: SGLang's own verify and scatter kernels on identical inputs.

SGLang's verify for GDN (``fused_sigmoid_gating_delta_rule_update`` with an intermediate
state buffer: the snapshot path) and its post-accept scatter
(``fused_mamba_state_scatter_with_mask``) are Triton kernels called from PyTorch. Here they
get the benchmark's own JAX arrays through DLPack (no copy): the same states, q, k, v, a,
b, A_log, dt_bias, the same snapshot tape and indices; the pool they scatter into is a
torch copy of the benchmark's pool (it is written in place). Their launches are captured
in a CUDA graph and replayed, which only removes host launch gaps.

Where the kernels come from, in this order:
1. an installed ``sglang`` package (``import sglang...`` works);
2. a folder holding the kernel sources taken from an SGLang wheel (``--sglang-src``,
   default ``benchmarks/_peer``, git-ignored). The full ``sglang`` package cannot be
   imported without its heavy dependencies (its ``__init__`` pulls in transformers,
   FlashInfer, its Rust extensions ...), and its wheel is a 39 MB platform wheel, not pure
   Python; the two kernel modules need only torch, triton and five small helpers, which
   are given here as stand-ins while the modules load. Make the folder with::

       pip download --no-deps sglang==0.5.23 -d /tmp/sglang
       python -m benchmarks.peer_sglang extract /tmp/sglang/sglang-0.5.23-*.whl

Nothing of SGLang is committed to this repository. This module imports neither JAX nor
torch at import time.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import types
import zipfile
from pathlib import Path

__all__ = ["PeerUnavailable", "Peer", "load", "extract", "DEFAULT_SRC", "SOURCE_FILES"]

DEFAULT_SRC = Path(__file__).resolve().parent / "_peer"
VERIFY_MODULE = "sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent"
SCATTER_MODULE = "sglang.kernels.ops.mamba.mamba_state_scatter_triton"
PTR_TABLE_MODULE = "sglang.kernels.ops.memory.ptr_table"
SOURCE_FILES = tuple(m.replace(".", "/") + ".py" for m in (VERIFY_MODULE, SCATTER_MODULE, PTR_TABLE_MODULE)) + (
    "sglang/_version.py",
)


class PeerUnavailable(RuntimeError):
    pass


class Peer:
    """The two SGLang entry points and where they came from."""

    def __init__(self, verify, scatter, origin: str):
        self.verify = verify
        self.scatter = scatter
        self.origin = origin


# ---------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------
def _helpers():
    """Stand-ins for the SGLang helpers the two kernel modules import (same semantics as
    ``sglang.srt.utils.common`` for CUDA; PDL is reported off: there is no producer kernel
    to overlap with here, and it keeps the launch within what triton 3.6 accepts)."""
    import torch

    def is_hip():
        return torch.version.hip is not None

    def is_cuda():
        return torch.cuda.is_available() and torch.version.cuda is not None

    def get_device_sm():
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return major * 10 + minor
        return 0

    def is_sm90_supported():
        if not is_cuda():
            return False
        cuda = tuple(int(x) for x in torch.version.cuda.split(".")[:2])
        return torch.cuda.get_device_capability()[0] == 9 and cuda >= (12, 3)

    def is_gfx95_supported():
        return False if not torch.version.hip else "gfx95" in torch.cuda.get_device_properties(0).gcnArchName

    def get_device_core_count(device_id: int = 0) -> int:
        return torch.cuda.get_device_properties(device_id).multi_processor_count if torch.cuda.is_available() else 0

    return {
        "sglang.srt.utils": dict(
            is_hip=is_hip, is_cuda=is_cuda, get_device_sm=get_device_sm, is_sm90_supported=is_sm90_supported,
            is_gfx95_supported=is_gfx95_supported, get_device_core_count=get_device_core_count,
        ),
        "sglang.srt.utils.common": dict(get_device_core_count=get_device_core_count),
        "sglang.kernels.jit.utils": dict(is_arch_support_pdl=lambda: False),
    }  # fmt: skip


def _load_installed() -> Peer:
    v = importlib.import_module(VERIFY_MODULE)
    sc = importlib.import_module(SCATTER_MODULE)
    version = getattr(importlib.import_module("sglang"), "__version__", "?")
    return Peer(v.fused_sigmoid_gating_delta_rule_update, sc.fused_mamba_state_scatter_with_mask, f"sglang {version} (installed)")


def _exec_file(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _load_sources(src: Path) -> Peer:
    missing = [f for f in SOURCE_FILES[:3] if not (src / f).is_file()]
    if missing:
        raise PeerUnavailable(f"no SGLang kernel sources in {src} (missing {', '.join(missing)}); see benchmarks/peer_sglang.py")
    try:
        import torch  # noqa: F401
        import triton  # noqa: F401
    except ImportError as e:
        raise PeerUnavailable(f"the SGLang kernels need torch and triton: {e}") from e
    # Stand-in parent packages exist only while the modules load; the loaded modules keep
    # the names they imported.
    saved = {k: v for k, v in sys.modules.items() if k == "sglang" or k.startswith("sglang.")}
    for k in saved:
        del sys.modules[k]
    try:
        packages = ["sglang", "sglang.kernels", "sglang.kernels.jit", "sglang.kernels.ops", "sglang.kernels.ops.memory",
                    "sglang.kernels.ops.attention", "sglang.kernels.ops.attention.linear", "sglang.kernels.ops.mamba",
                    "sglang.srt"]  # fmt: skip
        for name in packages:
            m = types.ModuleType(name)
            m.__path__ = []
            sys.modules[name] = m
        for name, attrs in _helpers().items():
            m = types.ModuleType(name)
            m.__path__ = []
            m.__dict__.update(attrs)
            sys.modules[name] = m
        _exec_file(PTR_TABLE_MODULE, src / SOURCE_FILES[2])
        v = _exec_file(VERIFY_MODULE, src / SOURCE_FILES[0])
        sc = _exec_file(SCATTER_MODULE, src / SOURCE_FILES[1])
    finally:
        for k in [k for k in sys.modules if k == "sglang" or k.startswith("sglang.")]:
            del sys.modules[k]
        sys.modules.update(saved)
    version = "?"
    vf = src / SOURCE_FILES[3]
    if vf.is_file():
        ns: dict = {}
        exec(vf.read_text(), ns)  # noqa: S102 - the wheel's generated version file (no imports)
        version = ns.get("__version__", "?")
    return Peer(v.fused_sigmoid_gating_delta_rule_update, sc.fused_mamba_state_scatter_with_mask,
                f"sglang {version} kernel sources from {src}")  # fmt: skip


def _triton_cache_dir() -> None:
    """Give Triton a writable cache folder when it has none.

    Triton's cache folder can resolve to nothing inside the benchmark, with or without
    ``TRITON_CACHE_DIR`` ("Could not create or locate cache dir" at the first launch), and the
    peer would not run. A temporary folder set on ``triton.knobs`` works whatever the cause.
    """
    import tempfile

    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is not None and not knobs.cache.dir:
        knobs.cache.dir = tempfile.mkdtemp(prefix="triton_cache_")


def load(src: str | Path | None = None) -> Peer:
    """SGLang's verify and scatter entry points, or :class:`PeerUnavailable` with the reason."""
    try:
        _triton_cache_dir()
    except Exception:  # noqa: BLE001, S110 - no triton: the loaders below say so
        pass
    reasons = []
    try:
        return _load_installed()
    except Exception as e:  # noqa: BLE001 - ImportError, or a failure of the package's own imports
        reasons.append(f"'import sglang' failed ({type(e).__name__}: {str(e)[:200]})")
    src = Path(src) if src else DEFAULT_SRC
    try:
        return _load_sources(src)
    except PeerUnavailable as e:
        reasons.append(str(e))
    except Exception as e:  # noqa: BLE001
        reasons.append(f"loading the kernel sources from {src} failed: {type(e).__name__}: {str(e)[:300]}")
    raise PeerUnavailable("; ".join(reasons))


def extract(wheel: str | Path, dest: str | Path = DEFAULT_SRC) -> list[Path]:
    """Copy the kernel sources (and the version file) out of an SGLang wheel into ``dest``."""
    dest = Path(dest)
    out = []
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for f in SOURCE_FILES:
            if f not in names:
                raise SystemExit(f"{wheel} has no {f}: this SGLang version lays its kernels out differently")
            target = dest / f
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(z.read(f))
            out.append(target)
    return out


# ---------------------------------------------------------------------------------
# Calls (torch tensors in, the layouts SGLang's GDN backend uses)
# ---------------------------------------------------------------------------------
def verify_call(peer: Peer, *, state0, q, k, v, a, b, A_log, dt_bias, buffer, state_idx, buffer_idx, cu_seqlens, scale):
    """One layer's target-verify as SGLang's GDN backend calls it (``gdn_triton.target_verify``).

    Shapes (torch, contiguous): state0 ``[N, HV, V, K]`` (the pool: slot i = request i),
    q, k ``[N, D, H, K]``, v ``[N, D, HV, V]``, a, b ``[N, D, HV]``, buffer
    ``[N + 1, D, HV, V, K]`` (the snapshots; SGLang's padding row at the end), state_idx and
    buffer_idx ``arange(N)`` int32, cu_seqlens ``arange(0, N*D + 1, D)`` int32.
    Returns the outputs ``[N, D, HV, V]``.
    """
    N, D, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    o = peer.verify(
        A_log=A_log, a=a.reshape(N * D, HV), dt_bias=dt_bias, softplus_beta=1.0, softplus_threshold=20.0,
        q=q.reshape(1, N * D, H, K), k=k.reshape(1, N * D, H, K), v=v.reshape(1, N * D, HV, V), b=b.reshape(N * D, HV),
        initial_state_source=state0, initial_state_indices=state_idx, scale=scale, use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu_seqlens, is_kda=False, disable_state_update=True, intermediate_states_buffer=buffer,
        intermediate_state_indices=buffer_idx, cache_steps=D, retrieve_parent_token=None,
    )  # fmt: skip
    return o.reshape(N, D, HV, V)


def scatter_call(peer: Peer, *, pool, snapshots, slots, steps, track_slots, track_steps, rows):
    """SGLang's SSM commit after verify: the accepted state, then the track copy
    (``scatter_mamba_states_after_mtp_verify`` without its conv-window part).

    pool ``[L, S, HV, V, K]`` (written in place), snapshots ``[L, R, D, HV, V, K]``, indices ``[N]``.
    """
    peer.scatter(pool, snapshots, slots, steps, rows)
    peer.scatter(pool, snapshots, track_slots, track_steps, rows)


# ---------------------------------------------------------------------------------
# Timed rows (on a GPU; ``device="cpu"`` only for checking the plumbing)
# ---------------------------------------------------------------------------------
def _sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _graph_or_eager(fn, torch, device):
    """A CUDA graph of ``fn``'s launches (after an eager warm-up), or ``fn`` itself."""
    fn()  # compiles the Triton kernels
    _sync(torch, device)
    if device.type != "cuda":
        return fn, "eager launches (not on a CUDA device)"
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
        return graph.replay, "CUDA graph replay"
    except Exception as e:  # noqa: BLE001
        torch.cuda.synchronize()
        return fn, f"eager launches (graph capture failed: {type(e).__name__}: {str(e)[:120]})"


def peer_rows(peer: Peer, inp, clock, ref_out=None, device: str = "cuda"):
    """The peer's verify (snapshot path) and SSM scatter rows on ``inp``'s arrays
    (:class:`benchmarks.suite.ConfigInputs`), their first-call times and the checks."""
    import time

    import numpy as np
    import torch

    from . import traffic as tr
    from .timing import Row

    dev = torch.device(device)
    sync = lambda: _sync(torch, dev)  # noqa: E731
    t = torch.from_dlpack
    s, cfg, L = inp.shape, inp.config.label, inp.layers
    N, D = s.N, s.D
    states = [t(x) for x in inp.states]
    smalls = [[t(x) for x in set_] for set_ in inp.smalls]
    A_log, dt_bias = t(inp.A_log), t(inp.dt_bias)
    C = len(states)
    buffers = [torch.empty((N + 1, D, s.HV, s.V, s.K), dtype=states[0].dtype, device=dev) for _ in range(C)]
    ar = torch.arange(N, dtype=torch.int32, device=dev)
    cu = torch.arange(0, N * D + 1, D, dtype=torch.int32, device=dev)
    scale = s.K**-0.5
    tiny = torch.ones(1, device=dev)

    def one(r):
        q, k, v, a, b = smalls[r]
        return verify_call(peer, state0=states[r % C], q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias,
                           buffer=buffers[r % C], state_idx=ar, buffer_idx=ar, cu_seqlens=cu, scale=scale)  # fmt: skip

    checks = {}
    t0 = time.perf_counter()
    out0 = one(0)
    sync()
    first_verify = time.perf_counter() - t0
    if ref_out is not None:
        x = out0.float().cpu().numpy().astype(np.float64)
        checks["outputs_rel_err_vs_reference"] = float(np.linalg.norm(x - ref_out) / max(np.linalg.norm(ref_out), 1e-300))
    del out0

    def verify_all():
        for r in range(len(smalls)):
            one(r)

    run_v, how_v = _graph_or_eager(verify_all, torch, dev)

    def noop():
        tiny.add_(1)
        sync()

    rows = [
        Row(config=cfg, backend="sglang", op="verify", record="snapshots", calls=len(smalls),
            traffic=tr.verify_traffic(s, "snapshots"), compile_s=first_verify,
            run=lambda: (run_v(), sync()), noop=noop,
            notes=[f"{peer.origin}; {len(smalls)} calls per invocation over {C} state copies; {how_v}; PDL off"])
    ]  # fmt: skip

    pool = t(inp.pool_box[0]).clone()
    # The clone runs on torch's stream; JAX's commit rows later donate and overwrite the
    # pool on JAX's stream: let the clone finish first.
    sync()
    snaps = t(inp.snapshots.states)
    idx = [[t(x) for x in ix] for ix in inp.index_args]

    def commit_all():
        for slots, steps, tslots, tsteps, rws in idx:
            scatter_call(peer, pool=pool, snapshots=snaps, slots=slots, steps=steps, track_slots=tslots,
                         track_steps=tsteps, rows=rws)  # fmt: skip

    t0 = time.perf_counter()
    commit_all()
    sync()
    first_commit = time.perf_counter() - t0
    run_c, how_c = _graph_or_eager(commit_all, torch, dev)
    traffic = [tr.commit_traffic(s, L, ix, "snapshots", slots_in_pool=inp.slots) for ix in inp.index_sets]
    mean = tr.Traffic(sum(x.read for x in traffic) // len(traffic), sum(x.write for x in traffic) // len(traffic))
    rows.append(
        Row(config=cfg, backend="sglang", op="commit", record="snapshots", calls=len(idx), traffic=mean,
            compile_s=first_commit, run=lambda: (run_c(), sync()), noop=noop,
            notes=[f"{peer.origin}; fused_mamba_state_scatter_with_mask twice per commit (accepted, track); "
                   f"{len(idx)} commits per invocation; {how_c}"])
    )  # fmt: skip
    clock.log(f"{cfg} sglang: first verify call {first_verify:.2f} s, first commit {first_commit:.2f} s; {how_v}")
    times = {"verify_snapshots_first_call": first_verify, "commit_snapshots_first_call": first_commit}
    return rows, times, checks


def _main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.peer_sglang", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("extract", help="copy SGLang's kernel sources out of its wheel")
    e.add_argument("wheel")
    e.add_argument("dest", nargs="?", default=str(DEFAULT_SRC))
    sub.add_parser("check", help="say whether the peer kernels can be loaded here")
    args = p.parse_args(argv)
    if args.cmd == "extract":
        for f in extract(args.wheel, args.dest):
            print(f)
    else:
        try:
            print("peer available:", load().origin)
        except PeerUnavailable as err:
            print("peer unavailable:", err)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
