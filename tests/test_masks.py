"""Mask helpers against literal expectations and NumPy."""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj


class CausalMaskTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("square", 4, None), ("chunk_at_end", 2, 5), ("more_queries", 5, 3),
      ("single_query", 1, 6))
  def test_matches_bottom_right_definition(self, t, s):
    got = aj.causal_mask(t, s)
    s = t if s is None else s
    expected = np.array([[j <= i + (s - t) for j in range(s)]
                         for i in range(t)])
    np.testing.assert_array_equal(got, expected)
    self.assertEqual(got.dtype, jnp.bool_)

  def test_square_is_lower_triangle(self):
    np.testing.assert_array_equal(aj.causal_mask(5),
                                  np.tril(np.ones((5, 5), bool)))

  def test_last_query_sees_every_key(self):
    self.assertTrue(bool(aj.causal_mask(3, 9)[-1].all()))


class PaddingMaskTest(parameterized.TestCase):

  def test_marks_valid_prefix(self):
    got = aj.padding_mask([0, 2, 4], 4)  # a list works like an array
    expected = np.array([[0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]], bool)
    np.testing.assert_array_equal(got, expected)

  def test_concrete_length_past_max_len_is_refused(self):
    # A length past max_len would be clipped: a sequence longer than the
    # padded one is a caller's bug, not a full row.
    with self.assertRaisesRegex(ValueError, r"lengths must lie in \[0, 7\].*"
                                r"max_len >= the longest"):
      aj.padding_mask([9, 3], 7)
    with self.assertRaisesRegex(ValueError, r"lengths must lie in"):
      aj.padding_mask(jnp.array([-1, 3]), 7)
    # Traced lengths cannot be checked; they clip, as documented.
    got = jax.jit(aj.padding_mask, static_argnums=1)(jnp.array([9, 0]), 4)
    np.testing.assert_array_equal(got, np.array([[1] * 4, [0] * 4], bool))

  def test_make_attention_mask_is_outer_and(self):
    q_valid = aj.padding_mask(jnp.array([1, 3]), 3)
    k_valid = aj.padding_mask(jnp.array([2, 4]), 4)
    got = aj.make_attention_mask(q_valid, k_valid)
    chex.assert_shape(got, (2, 1, 3, 4))
    expected = np.asarray(q_valid)[:, None, :, None] & np.asarray(
        k_valid)[:, None, None, :]
    np.testing.assert_array_equal(got, expected)

  def test_make_attention_mask_accepts_int_validity(self):
    got = aj.make_attention_mask(jnp.array([[1, 0]]), jnp.array([[2, 0, 1]]))
    np.testing.assert_array_equal(
        got[0, 0], np.array([[1, 0, 1], [0, 0, 0]], bool))


class CombineMasksTest(parameterized.TestCase):

  def test_all_none_is_none(self):
    self.assertIsNone(aj.combine_masks(None, None))

  def test_and_with_broadcast_and_ints(self):
    pad = aj.make_attention_mask(jnp.ones((2, 3), bool),
                                 jnp.array([[1, 1, 0], [1, 1, 1]]))
    got = aj.combine_masks(pad, None, aj.causal_mask(3).astype(jnp.int32))
    expected = np.asarray(pad) & np.tril(np.ones((3, 3), bool))
    chex.assert_shape(got, (2, 1, 3, 3))
    np.testing.assert_array_equal(got, expected)


if __name__ == "__main__":
  absltest.main()
