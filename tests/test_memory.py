"""Memory accounting: equal to the pool's allocation byte for byte, and the seed's table (the three setups of
SGLang's lossless-verify pull request) reproduced."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest

from gdn_lossless_jax import pool as P
from gdn_lossless_jax.tools import memory
from gdn_lossless_jax.config import FAMILY_MODELS, MODELS, Geometry, get_geometry

F32, BF16 = jnp.float32, jnp.bfloat16


@pytest.mark.parametrize("model", sorted(MODELS))
def test_geometries_match_the_model_configs(model):
    spec = {  # the published configs (sources in gdn_lossless_jax/config.py)
        "qwen3-next-80b-a3b": dict(layers=48, gdn_layers=36, num_k_heads=16, num_v_heads=32),
        "qwen3.6-35b-a3b": dict(layers=40, gdn_layers=30, num_k_heads=16, num_v_heads=32, kv_heads=2, kv_head_dim=256),
        "qwen3.8-27b": dict(layers=64, gdn_layers=48, num_k_heads=16, num_v_heads=48),
    }[model]
    g = get_geometry(model)
    for field, value in {**spec, "head_k_dim": 128, "head_v_dim": 128, "conv_kernel": 4, "linear_attention": "gdn"}.items():
        assert getattr(g, field) == value, (model, field)
    assert get_geometry("qwen3.5-35b-a3b") is MODELS["qwen3.6-35b-a3b"]
    assert get_geometry("Qwen3.5-27B") is MODELS["qwen3.8-27b"]


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("D", [1, 4, 16])
def test_per_request_formulas(model, D):
    g = get_geometry(model)
    L, H, HV, K, V, C, Kc = g.gdn_layers, g.num_k_heads, g.num_v_heads, g.head_k_dim, g.head_v_dim, g.conv_dim, g.conv_kernel
    for dtype, size in ((F32, 4), (BF16, 2)):
        assert memory.scratch_bytes(g, D, "snapshots", state_dtype=dtype) == L * D * HV * V * K * size
        assert memory.conv_window_bytes(g, D, conv_dtype=dtype) == L * C * (D + Kc - 2) * size
        # The ring is fp32 whatever the state dtype.
        assert memory.scratch_bytes(g, D, "tuples", state_dtype=dtype) == L * D * (HV * V + H * K + HV) * 4
        assert memory.scratch_bytes(g, D, "seed_ring", state_dtype=dtype) == L * D * HV * (V + K + 1) * 4
    for mode in P.SCRATCH_MODES:
        assert memory.scratch_bytes(g, D, mode, requests=7) == 8 * memory.scratch_bytes(g, D, mode)


def test_ratios():
    # 60 MiB per draft token per request (30 layers, 32 heads, 128 x 128, fp32); the seed's ring
    # is 63.8x smaller at K = V = 128 (its own figure); ours 1/64 .. 1/95 of the snapshots.
    g35, g27 = get_geometry("qwen3.6-35b-a3b"), get_geometry("qwen3.8-27b")
    assert memory.scratch_bytes(g35, 1, "snapshots") == 60 * memory.MIB
    ratio = lambda g, m: memory.scratch_bytes(g, 1, "snapshots") / memory.scratch_bytes(g, 1, m)  # noqa: E731
    assert f"{ratio(g35, 'seed_ring'):.1f}" == "63.8"
    assert 64 < ratio(g35, "tuples") < ratio(g27, "tuples") < 96
    assert f"{ratio(g27, 'tuples'):.1f}" == "95.4"


def test_reduced_geometry_checks_its_arguments():
    g = get_geometry("qwen3.8-27b")  # H=16, HV=48: a divisor of H keeps HV // H = 3
    r = g.reduced(gdn_layers=48, heads_divisor=16, head_dim=1)
    assert (r.gdn_layers, r.num_k_heads, r.num_v_heads, r.head_k_dim, r.head_v_dim) == (48, 1, 3, 1, 1)
    assert g.reduced() == dataclasses.replace(g, name=g.name + " (reduced)")
    bad = [
        (dict(gdn_layers=0), r"argument 'gdn_layers' must be a positive integer, got 0"),
        (dict(gdn_layers=49), r"argument 'gdn_layers' must be at most 48 \(the model's GDN layers\), got 49"),
        (dict(heads_divisor=0), r"argument 'heads_divisor' must be a positive integer, got 0"),
        (dict(heads_divisor=3), r"argument 'heads_divisor' must divide H=16 \(one of 1, 2, 4, 8, 16\), got 3"),
        (dict(heads_divisor=32), r"argument 'heads_divisor' must divide H=16"),
        (dict(head_dim=0), r"argument 'head_dim' must be a positive integer, got 0"),
        (dict(head_dim=2.0), r"argument 'head_dim' must be a positive integer, got 2.0"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=r"Geometry.reduced \(Qwen3.5/3.8-27B\): " + message):
            g.reduced(**kwargs)


# Reduced geometries of each family: allocation is real here.
SMALL = [get_geometry(m).reduced(gdn_layers=2, heads_divisor=8, head_dim=8) for m in sorted(MODELS)]


@pytest.mark.parametrize("g", SMALL, ids=lambda g: g.name)
@pytest.mark.parametrize("record", P.POOL_RECORD_MODES)
@pytest.mark.parametrize("state_dtype, conv_dtype", [(F32, BF16), (BF16, BF16), (F32, F32), (BF16, jnp.float16)])
def test_allocation_equals_accounting_byte_for_byte(g, record, state_dtype, conv_dtype):
    slots, requests, drafts = 6, 3, 5
    pl = P.allocate(g, slots=slots, requests=requests, drafts=drafts, record=record, state_dtype=state_dtype, conv_dtype=conv_dtype)
    scratch = memory.scratch_bytes(g, drafts, record, requests=requests, state_dtype=state_dtype)
    windows = memory.conv_window_bytes(g, drafts, requests=requests, conv_dtype=conv_dtype)
    assert pl.scratch_nbytes == sum(x.nbytes for x in jax.tree.leaves(pl.tape)) == scratch
    assert pl.conv_windows.nbytes == windows
    assert pl.scratch_nbytes == (requests + 1) * memory.scratch_bytes(g, drafts, record, state_dtype=state_dtype)
    states = P.state_specs(g, slots, state_dtype=state_dtype, conv_dtype=conv_dtype)
    assert pl.ssm.nbytes == states["ssm"].nbytes and pl.conv.nbytes == states["conv"].nbytes
    assert pl.nbytes == scratch + windows + states["ssm"].nbytes + states["conv"].nbytes
    for name, spec in P.tape_specs(g, requests + 1, drafts, record, state_dtype=state_dtype).items():
        leaf = getattr(pl.tape, name)
        assert (leaf.shape, leaf.dtype) == (spec.shape, spec.dtype)
    report = memory.memory_report(g, drafts=drafts, requests=requests, state_dtype=state_dtype, conv_dtype=conv_dtype)
    assert report.total[record] == scratch and report.conv_total == windows


def test_kv_cache_tokens():
    g = get_geometry("qwen3.6-35b-a3b")
    assert memory.kv_bytes_per_token(g) == 20 * 1024  # 10 layers, 2 KV heads of 256, bf16
    assert memory.kv_bytes_per_token(g, kv_dtype=F32) == 40 * 1024
    assert memory.kv_tokens(g, 6 * memory.GIB) == 314_572  # "6 GiB is about 300k tokens"
    assert memory.kv_tokens(g, -5) == 0
    assert memory.kv_bytes_per_token(get_geometry("qwen3.8-27b")) == 16 * 2 * 4 * 256 * 2
    r = memory.memory_report(g, drafts=4, requests=25, budget=20 * memory.GIB)
    assert r.freed() == r.total["snapshots"] - r.total["tuples"]
    assert r.tokens_freed() == r.freed() // (20 * 1024)
    for mode in ("snapshots", "tuples"):
        assert r.budget_tokens(mode) == (20 * memory.GIB - r.total[mode] - r.conv_total) // (20 * 1024)
    assert r.budget_tokens("tuples") - r.budget_tokens("snapshots") in (r.tokens_freed(), r.tokens_freed() + 1)


def test_seed_table_reproduced_to_the_printed_digits():
    rows = memory.seed_table()
    assert [s.snapshots_printed for s, _ in rows] == ["6.09", "8.44", "10.12"]
    assert [s.ring_printed for s, _ in rows] == ["0.10", "0.13", "0.16"]
    for setup, r in rows:
        assert memory.gib(r.total["snapshots"]) == setup.snapshots_printed, setup.label
        assert memory.gib(r.total["seed_ring"]) == setup.ring_printed, setup.label
        # SGLang reserves (requests + 1) * D snapshots of L*HV*V*K*4 bytes.
        g = r.geometry
        assert r.total["snapshots"] == (setup.requests + 1) * setup.drafts * g.gdn_layers * g.num_v_heads * 128 * 128 * 4
        # The seed's "GB" are GiB: in 10**9 bytes they would not match.
        assert f"{r.total['snapshots'] / 1e9:.2f}" != setup.snapshots_printed
    text = memory.format_seed_table()
    for s, _ in rows:
        assert f"{s.snapshots_printed} / {s.snapshots_printed} ok" in text
        assert f"{s.ring_printed} / {s.ring_printed} ok" in text
    assert "DIFFERS" not in text


def test_rejections():
    with pytest.raises(ValueError, match=r"a KDA geometry has as many v-heads as q/k heads, got num_k_heads=16, "
                                         r"num_v_heads=32"):  # fmt: skip
        dataclasses.replace(get_geometry("qwen3.6-35b-a3b"), linear_attention="kda")
    kda = Geometry("kda", gdn_layers=2, num_k_heads=2, num_v_heads=2, linear_attention="kda")
    with pytest.raises(ValueError, match=r"tape_specs: a SeedRing tape records no channel decay \(geometry 'kda': "
                                         r"kda layers\)"):  # fmt: skip
        memory.scratch_bytes(kda, 4, "seed_ring")
    with pytest.raises(ValueError, match=r"scratch_bytes: record must be one of \('tuples', 'snapshots', 'seed_ring'\)"):
        memory.scratch_bytes(get_geometry("qwen3.8-27b"), 4, "ring")
    with pytest.raises(ValueError, match=r"memory_report: argument 'requests' must be a positive integer, got 0"):
        memory.memory_report(get_geometry("qwen3.8-27b"), drafts=4, requests=0)


@pytest.mark.parametrize("record", P.POOL_RECORD_MODES)
def test_tp_table_is_each_tensor_shard_of_the_pool(record):
    """Per-device bytes under tensor parallelism (gdn-lossless memory --tp) equal the pool that
    one device's H/tp heads allocate (sharding.local_geometry), and 1/tp of the whole pool."""
    from gdn_lossless_jax.sharding import local_geometry

    kw = dict(drafts=4, requests=5, slots=9)
    rows = memory.tp_table(None, (1, 2, 4, 8, 32), **kw)
    assert len(rows) == 5 * len(MODELS)
    whole = {r.geometry.name: r for r in rows if r.tp == 1}
    for r in rows:
        if r.tp == 32:  # H = 16 on every named model
            assert r.error == "H=16 is not a multiple of 32" and r.ssm is None
            continue
        local = jax.eval_shape(lambda r=r: P.allocate(local_geometry(r.geometry, r.tp), slots=9, requests=5, drafts=4,
                                                      record=record))  # fmt: skip
        nbytes = lambda x: math.prod(x.shape) * x.dtype.itemsize  # noqa: E731
        assert (r.ssm, r.conv, r.conv_windows) == (nbytes(local.ssm), nbytes(local.conv), nbytes(local.conv_windows))
        assert getattr(r, record) == sum(nbytes(x) for x in jax.tree.leaves(local.tape))
        w = whole[r.geometry.name]
        assert r.tp * r.total(record) == w.total(record)


def test_tp_sizes():
    assert memory.tp_sizes("8") == (1, 2, 4, 8) and memory.tp_sizes("1") == (1,) and memory.tp_sizes("2,6") == (2, 6)
    for bad in ("0", "a", "1,,2", "-2"):
        with pytest.raises(ValueError, match="tensor sizes must be"):
            memory.tp_sizes(bad)


def test_draft_trees():
    """A tree of n nodes: one scratch entry a node in both modes, the chain's conv buffer of n
    columns; the [2,2,2] and top-4 depth-4 trees at the seed geometry (25 requests)."""
    from gdn_lossless_jax import tree

    assert memory.tree_nodes([2, 2, 2]) == 14 == len(tree.full_tree([2, 2, 2]))
    assert memory.tree_nodes(topk=4, depth=4) == 16 == len(tree.beam_tree(4, 4))
    assert memory.tree_nodes([4, 4, 4, 4]) == 340
    g = get_geometry("qwen3.6-35b-a3b")
    (r,) = memory.tree_table([g], nodes=14, requests=25)
    assert r.snapshots == 26 * 14 * 60 * memory.MIB  # a state a node: 21.33 GiB
    assert r.tuples == memory.scratch_bytes(g, 14, "tuples", requests=25)
    assert (memory.gib(r.snapshots), memory.gib(r.tuples), memory.gib(r.conv_windows)) == ("21.33", "0.25", "0.19")
    (r,) = memory.tree_table([g], nodes=16, requests=25)
    assert (memory.gib(r.snapshots), memory.gib(r.tuples), memory.gib(r.conv_windows)) == ("24.38", "0.29", "0.21")
    # the pool a tree allocates is what is counted
    small = g.reduced(gdn_layers=2, heads_divisor=8, head_dim=16)
    pl = P.allocate(small, slots=2, requests=3, drafts=14, parents=tree.full_tree([2, 2, 2]), topk=2)
    (r,) = memory.tree_table([small], nodes=14, requests=3)
    assert pl.scratch_nbytes == r.tuples and pl.conv_windows.nbytes == r.conv_windows
    with pytest.raises(ValueError, match="not both"):
        memory.tree_nodes([2], topk=2, depth=2)


def test_memory_command_takes_a_tree(capsys):
    from gdn_lossless_jax.tools import cli

    assert cli.main(["memory", "--tree", "2,2,2"]) == 0
    out = capsys.readouterr().out
    assert "draft tree [2,2,2] (branching per depth): 14 nodes, 25 requests" in out
    assert "Qwen3.5/3.6-35B-A3B       21.33      0.25         84.9x" in out and "Qwen3.5/3.8-27B" in out
    assert cli.main(["memory", "--topk", "4", "--depth", "4", "--model", "qwen3.6-35b-a3b"]) == 0
    out = capsys.readouterr().out
    assert "top-4 depth-4 (4 nodes a depth, EAGLE-style): 16 nodes" in out and "D=16 draft tokens" in out
    assert cli.main(["memory", "--topk", "4"]) == 2
    assert "--topk and --depth go together" in capsys.readouterr().err


@pytest.mark.parametrize("family", sorted(FAMILY_MODELS))
def test_family_geometries(family, capsys):
    """The other families' released geometries (gdn_lossless_jax/config.py gives the sources): the scratch of
    each record mode by formula (a KDA layer's tuples keep g per key channel, ``[HV, K]``), and the report that
    ``gdn-lossless memory --family`` prints."""
    from gdn_lossless_jax.tools.cli import main

    g, D = FAMILY_MODELS[family], 4
    L, H, HV, K, V = g.gdn_layers, g.num_k_heads, g.num_v_heads, g.head_k_dim, g.head_v_dim
    want = {"olmo_hybrid": dict(L=24, H=30, HV=30, K=96, V=192, layers=32, kv=8 * 2 * 30 * 128 * 2),
            "kimi_linear": dict(L=20, H=32, HV=32, K=128, V=128, layers=27, kv=7 * 576 * 2),
            "qwen4_exp": dict(L=30, H=16, HV=32, K=128, V=128, layers=40, kv=10 * 2 * 2 * 256 * 2)}[family]  # fmt: skip
    assert (L, H, HV, K, V, g.layers) == tuple(want[k] for k in ("L", "H", "HV", "K", "V", "layers"))
    assert memory.kv_bytes_per_token(g) == want["kv"]
    g_floats = HV * K if family == "kimi_linear" else HV
    assert memory.scratch_bytes(g, D, "tuples") == L * D * (HV * V + H * K + g_floats) * 4
    assert memory.scratch_bytes(g, D, "snapshots") == L * D * HV * V * K * 4
    r = memory.memory_report(g, drafts=D, requests=25)
    assert main(["memory", "--family", family]) == 0
    out = capsys.readouterr().out
    assert out.strip() == memory.format_report(r).strip()
    ratio = f"{r.total['snapshots'] / r.total['tuples']:.1f}x"
    assert ratio == {"olmo_hybrid": "63.8x", "kimi_linear": "42.7x", "qwen4_exp": "84.9x"}[family] and ratio in out
    assert any(line.startswith("seed's ring") for line in out.splitlines()) == (family != "kimi_linear")
    assert main(["memory", "--family", family, "--model", "qwen3.8-27b"]) == 2
    assert "gdn-lossless memory: error: give --model or --family, not both" in capsys.readouterr().err
    assert main(["memory", "--family", family, "--tp"]) == 2
    assert "--family prints one report: --tp, --tree" in capsys.readouterr().err
