"""The bitwise assertion helpers must see what tolerances and chex hide."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn_lossless_jax import Tuples
from gdn_lossless_jax.testing import (
    assert_bitwise_differs,
    assert_bitwise_equal,
    assert_trees_bitwise_equal,
    compare_bitwise,
    ulp_distance,
)


def test_signed_zero_and_nan_payload_are_differences():
    with pytest.raises(AssertionError, match="1 of 2 elements differ"):
        assert_bitwise_equal(np.float32([0.0, 1.0]), np.float32([-0.0, 1.0]))
    nan1 = np.uint32([0x7FC00000]).view(np.float32)
    nan2 = np.uint32([0x7FC00001]).view(np.float32)
    with pytest.raises(AssertionError):
        assert_bitwise_equal(nan1, nan2)
    assert_bitwise_equal(nan1, nan1.copy())


def test_message_names_leaf_index_count_and_ulp():
    a = Tuples(u=jnp.ones((2, 3)), k=jnp.zeros((2, 3)) + 2, g=jnp.full((2,), 0.5))
    b_u = np.ones((2, 3), np.float32)
    b_u[1, 2] = np.nextafter(np.float32(1), np.float32(2))
    b_u[0, 1] = np.nextafter(np.nextafter(b_u[1, 2], np.float32(2)), np.float32(2))
    b = Tuples(u=jnp.asarray(b_u), k=a.k, g=a.g)
    with pytest.raises(AssertionError) as e:
        assert_bitwise_equal(a, b, "tape")
    msg = str(e.value)
    assert ".u" in msg and "2 of 6 elements differ" in msg and "(0, 1)" in msg and "largest distance 3 ULP" in msg
    assert ".k" not in msg


def test_bf16_and_shape_dtype_mismatches():
    x = jnp.asarray([1.0, 2.0], jnp.bfloat16)
    y = x.at[0].set(jnp.asarray(1.0078125, jnp.bfloat16))
    r = compare_bitwise(x, y)
    assert not r.equal and r.max_ulp == 1
    assert "expected bfloat16[2], got float32[2]" in str(compare_bitwise(x, x.astype(jnp.float32)))
    assert "expected float32[2], got float32[3]" in str(compare_bitwise(np.zeros(2, np.float32), np.zeros(3, np.float32)))


def test_ulp_distance_crosses_zero():
    one_ulp_up = np.uint32([1]).view(np.float32)
    one_ulp_down = np.uint32([0x80000001]).view(np.float32)
    assert ulp_distance(one_ulp_down, one_ulp_up)[0] == 3  # -tiny, -0, +0, +tiny


def test_differs_helper():
    assert_bitwise_differs(np.float32([1.0]), np.float32([-1.0]))
    with pytest.raises(AssertionError, match="expected a bitwise difference"):
        assert_bitwise_differs(np.float32([1.0]), np.float32([1.0]))


def test_trees_bitwise_equal_chex_style():
    a = Tuples(u=jnp.ones((2, 3)), k=jnp.zeros((2, 3)) + 2, g=jnp.full((2,), 0.5))
    assert_trees_bitwise_equal(a, a, jax.tree.map(jnp.copy, a))
    b_u = np.ones((2, 3), np.float32)
    b_u[0, 1] = np.nextafter(np.nextafter(np.float32(1), np.float32(2)), np.float32(2))
    b = Tuples(u=jnp.asarray(b_u), k=a.k, g=a.g)
    with pytest.raises(AssertionError) as e:
        assert_trees_bitwise_equal(a, a, b)
    msg = str(e.value)
    assert "Trees 0 and 2 differ in leaves 'u': 1 of 6 elements differ; first at index (0, 1)" in msg
    assert "expected 1.0 (0x3f800000), got 1.0000002 (0x3f800002); largest distance 2 ULP" in msg
    # What chex's own assertion lets through, this one catches.
    chex.assert_trees_all_equal(np.float32([0.0]), np.float32([-0.0]))
    with pytest.raises(AssertionError, match=r"Trees \(arrays\) 0 and 1 differ: 1 of 1 elements differ"):
        assert_trees_bitwise_equal(np.float32([0.0]), np.float32([-0.0]))
    with pytest.raises(AssertionError, match=r"expected float32\[2\], got bfloat16\[2\]"):
        assert_trees_bitwise_equal(np.zeros(2, np.float32), jnp.zeros(2, jnp.bfloat16))
    with pytest.raises(AssertionError, match="trees 0 and 1 do not match"):
        assert_trees_bitwise_equal(a, (a.u, a.k, a.g))
