"""The fuzz module and ``gdn-lossless fuzz``: what the draws cover, the report, the exit status."""

import collections

import jax.numpy as jnp
import numpy as np
import pytest

from gdn_lossless_jax import api
from gdn_lossless_jax.tools import fuzz
from gdn_lossless_jax.tools.cli import main


def test_draws_cover_the_masking_rules(seed):
    """Over many draws: destination slots distinct, a slot always left untouched, every
    invalid form (negative slot, slot >= S, row out of range, negative and too-large steps,
    out-of-range track slot) and sparse, permuted rows appear."""
    draw = fuzz.numpy_source(np.random.default_rng(seed))
    hits = collections.Counter()
    for _ in range(300):
        shape = fuzz.draw_shape(draw)
        s = shape
        assert 1 <= s.drafts <= 32 and s.slots >= 2 * s.requests + 1 and s.rows >= s.requests
        idx = fuzz.draw_indices(draw, s.requests, s.drafts, s.slots, s.rows)
        writes = [fuzz.request_writes(idx, n, S=s.slots, R=s.rows, D=s.drafts) for n in range(s.requests)]
        dest = [w for pair in writes for w in pair if w is not None]
        assert len(dest) == len(set(dest)) and len(dest) < s.slots
        valid_rows = idx.rows[(idx.rows >= 0) & (idx.rows < s.rows)]
        assert len(valid_rows) == len(set(valid_rows.tolist()))
        hits.update({
            "slot < 0": (idx.slots < 0).any(),
            "slot >= S": (idx.slots >= s.slots).any(),
            "row out of range": ((idx.rows < 0) | (idx.rows >= s.rows)).any(),
            "step < 0": (idx.steps < 0).any(),
            "step >= D": (idx.steps >= s.drafts).any(),
            "track slot out of range": ((idx.track_slots < 0) & (idx.track_steps >= 0)).any(),
            "track write": any(t is not None for _, t in writes),
            "sparse rows": s.rows > s.requests,
            "permuted rows": (idx.rows[:-1] > idx.rows[1:]).any(),
            "D = 1": s.drafts == 1,
            "bf16 pool": s.state_dtype == "bfloat16",
        })  # fmt: skip
    assert not [name for name, n in hits.items() if n == 0], f"never drawn: {[k for k, n in hits.items() if n == 0]}"


def test_specials_are_bit_patterns_of_the_array_width(seed):
    draw = fuzz.numpy_source(np.random.default_rng(seed))
    for dtype in (np.float32, jnp.bfloat16):
        x = np.ones(4096, dtype)
        fuzz.inject_specials(draw, x, 400)
        f = x.astype(np.float32)
        assert np.isnan(f).any() and np.isinf(f).any() and (f == 0).any() and np.signbit(f[f == 0]).any()
        tiny = np.abs(f[np.isfinite(f) & (f != 0)])
        assert (tiny < np.finfo(np.float32).tiny).any(), "subnormals"


def test_fuzz_command_reports_and_passes(capsys, seed):
    assert main(["fuzz", "--cases", "4", "--group-size", "2", "--seed", str(seed), "--no-progress",
                 "--geometry", "h2-hv4-k16-v16", "--geometry", "h4-hv4-k16-v16"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert f"gdn-lossless fuzz: 4 cases, backend reference, seed {seed}" in out
    assert "cases         4 commit cases in 2 shape groups" in out
    for line in ("geometries", "D ", "dtypes", "requests", "slots", "specials", "held", "controls"):
        assert f"\n{line}" in out, line
    assert "corrupted slots: snapshots/addressed 0, snapshots/untouched 0, tuples/addressed 0, tuples/untouched 0" in out
    assert "result        OK: 0 corrupted slots" in out


def test_fuzz_command_fails_on_a_corrupting_commit(capsys, monkeypatch, seed):
    """A commit that also writes the last slot: exit status 1, the corrupted slots named."""
    real = api.commit

    def one_slot_too_many(pool, tape, *idx, backend):
        out = real(pool, tape, *idx, backend=backend)
        return out.at[:, -1].set(out[:, -1] * 3 + 1)

    monkeypatch.setattr(api, "commit", one_slot_too_many)
    assert main(["fuzz", "--cases", "2", "--group-size", "2", "--seed", str(seed), "--no-progress",
                 "--geometry", "h2-hv4-k16-v16"]) == 1  # fmt: skip
    out = capsys.readouterr().out
    assert "result        VIOLATIONS: " in out and "group 0 case 0: h2-hv4-k16-v16" in out
    assert "corrupted slots {'tuples/" in out


def test_fuzz_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"fuzz: unknown geometry 'h3'; choose from h2-hv4-k16-v16"):
        fuzz.run(1, families=["h3"])
    with pytest.raises(ValueError, match=r"fuzz: cases and group size must be positive and the first group >= 0, got 0, 100, 0"):
        fuzz.run(0)
