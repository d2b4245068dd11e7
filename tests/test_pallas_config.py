"""Launch configurations of the Pallas verify kernel change speed, never the tape.

Runs in interpret mode on the CPU (portable form) and compiled on a GPU.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from gdn_lossless_jax import backends
from gdn_lossless_jax.backends.pallas import VerifyConfig
from gdn_lossless_jax.cases import Shape, verify_inputs
from gdn_lossless_jax.testing import assert_bitwise_differs, assert_bitwise_equal

SHAPE = Shape(N=2, D=3, H=2, HV=4, K=16, V=16)


def _verify(x, record, config):
    pal = backends.resolve("pallas", "verify")
    return pal.verify(**x, record=record, scale=SHAPE.K**-0.5, out_dtype=jnp.float32, config=config)


@pytest.mark.parametrize("config", [VerifyConfig(block_v=8, num_warps=1, one_pass=True), VerifyConfig(block_v=16, num_warps=4)],
                         ids=["bv8-w1-one_pass", "bv16-w4"])  # fmt: skip
def test_config_keeps_the_tape_and_mode_identical_outputs(config, seed):
    x = verify_inputs(seed, SHAPE, kind="mixed")
    base = {rec: _verify(x, rec, VerifyConfig()) for rec in ("tuples", "snapshots")}
    got = {rec: _verify(x, rec, config) for rec in ("tuples", "snapshots")}
    # The tape (u, k, g; the snapshots) does not depend on the configuration.
    assert_bitwise_equal(base["tuples"][1], got["tuples"][1], "tuples")
    assert_bitwise_equal(base["snapshots"][1], got["snapshots"][1], "snapshots")
    # Outputs: identical across record modes (one body); within fp32 rounding of the default.
    assert_bitwise_equal(got["tuples"][0], got["snapshots"][0], "outputs")
    a, b = np.asarray(got["tuples"][0]), np.asarray(base["tuples"][0])
    assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()
    # Control: the comparison sees a one-ULP change of one state element.
    bumped = dict(x, state0=x["state0"].at[0, 0, 0, 0].set(jnp.nextafter(x["state0"][0, 0, 0, 0], jnp.inf)))
    assert_bitwise_differs(got["snapshots"][1], _verify(bumped, "snapshots", config)[1], "bumped state")
