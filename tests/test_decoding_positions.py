"""Cached decoding keeps the mask's structure: positions, not slot arrays.

A linear cache's slot ``j`` holds position ``j``, so a decoding step's mask
is the layer's own (causal, window, rule, lengths) with the queries placed
at ``q_offset = index``: no ``[T, L]`` array over the slots, and the
blockwise kernels skip the blocks outside the band. Checked here by what
reaches the kernel, and by chunked prefills equal to the uncached forward
(left padding and a rule at positions included).
"""

from __future__ import annotations

from absl.testing import absltest
import chex
from flax import nnx
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from tests import _data

D, N, K = 16, 4, 2


class Recording(aj.kernels.Flash):
  """The flash kernel, keeping the masks it was given."""
  name = "recording_flash"
  seen: list = []  # noqa: RUF012 - shared by the test's calls

  # It records each call's mask (a Python side effect, read as concrete
  # arrays by the tests): not under jit, where it would run once a trace.
  jit = False

  def __call__(self, problem):
    Recording.seen.append(problem.mask)
    return super().__call__(problem)


def _layer(mask, **kw):
  return aj.MultiHeadAttention(
      D, N, num_kv_heads=K, mask=mask, rngs=nnx.Rngs(0),
      attention_fn=Recording(block_q=4, block_k=8), **kw)


def _chunked(layer, x, chunk, max_length, left_padding=None):
  layer.init_cache(x.shape[0], max_length, left_padding=left_padding)
  outs = [layer(x[:, i:i + chunk], decode=True)
          for i in range(0, x.shape[1], chunk)]
  return jnp.concatenate(outs, axis=1)


class DecodingPositionsTest(chex.TestCase):

  def setUp(self):
    super().setUp()
    Recording.seen = []

  def test_cached_prefill_reaches_the_kernel_analytic(self):
    layer = _layer(aj.Mask(causal=True, window=(5, 0)))
    x = _data.normal(0, (2, 24, D))
    got = _chunked(layer, x, 8, 64)
    want = layer(x)  # uncached: the same weights, one call
    # float32 rounding over <= 6 keys per row, and a different summation
    # order (the cache's 64 slots against the call's 24 keys)
    chex.assert_trees_all_close(got, want, atol=2e-6, rtol=2e-6)
    cached = Recording.seen[:3]
    for mask in cached:
      self.assertIsNone(mask.dense)  # no [T, L] array over the slots
      self.assertTrue(mask.causal)
      self.assertEqual(mask.window, (5, 0))
    np.testing.assert_array_equal(
        [np.asarray(m.q_offset) for m in cached], [[0, 0], [8, 8], [16, 16]])

  def test_left_padding_is_one_key_row_and_positions(self):
    pads = jnp.array([0, 3])
    rule = aj.MaskRule(lambda b, h, q, kv, p: (kv < p) | (kv <= q),
                       jnp.int32(4))  # a prefix of 4 tokens, at positions
    layer = _layer(aj.Mask(causal=True, rule=rule), rope=aj.Rope(base=10_000.0))
    x = _data.normal(1, (2, 16, D))
    got = _chunked(layer, x, 8, 32, left_padding=pads)
    dense = Recording.seen[0].dense
    self.assertEqual(np.shape(dense), (2, 1, 1, 32))  # key padding only
    np.testing.assert_array_equal(
        np.asarray(Recording.seen[1].q_offset), [8, 5])
    # Example 1 is its 13 real tokens alone (positions from its first one).
    alone = layer(x[1:, 3:])
    chex.assert_trees_all_close(got[1:, 3:], alone, atol=2e-6, rtol=2e-6)
    full = layer(x[:1])
    chex.assert_trees_all_close(got[:1], full, atol=2e-6, rtol=2e-6)

  def test_positions_in_the_call_mask_are_refused_while_decoding(self):
    layer = _layer(aj.Mask(causal=True))
    layer.init_cache(1, 8)
    with self.assertRaisesRegex(ValueError, "cache places the queries"):
      layer(_data.normal(2, (1, 2, D)), mask=aj.Mask(q_offset=3), decode=True)


class MaskPositionsTest(chex.TestCase):
  """Positions as a Mask field: what combines, what is refused."""

  def test_positions_combine_once(self):
    m = aj.Mask(causal=True) & aj.Mask(q_offset=jnp.array([2, 5]))
    self.assertTrue(m.positioned and m.causal)
    np.testing.assert_array_equal(m.offsets(3, 8)[0], [2, 5])
    self.assertEqual(aj.Mask().offsets(3, 8), (5, 0))  # bottom-right
    with self.assertRaisesRegex(ValueError, "give the positions once"):
      aj.Mask(q_offset=1) & aj.Mask(kv_offset=0)

  def test_unions_and_block_tables_are_refused_with_positions(self):
    rule = aj.block_mask(lambda b, h, q, kv: kv <= q, 4, 4)
    with self.assertRaisesRegex(ValueError, "cannot hold a union"):
      aj.Mask(q_offset=1, rule=rule)
    with self.assertRaisesRegex(ValueError, "cannot hold a union"):
      aj.Mask(q_offset=1) | aj.Mask(causal=True)
    with self.assertRaisesRegex(ValueError, "cannot hold a union"):
      aj.Mask(q_offset=1) & aj.Mask(rule=rule)

  def test_positions_must_fit_the_leading_dims(self):
    q = _data.normal(3, (2, 2, 4, 8))
    with self.assertRaisesRegex(ValueError, "the mask's q_offset \\(3, 1\\)"):
      aj.scaled_dot_product_attention(
          q, q, q, aj.Mask(causal=True, q_offset=jnp.array([0, 1, 2])))
    with self.assertRaisesRegex(TypeError, "q_offset"):
      aj.Mask(q_offset=1.5)

  def test_jax_nn_arguments_turn_positions_into_a_band(self):
    m = aj.Mask(causal=True, q_offset=jnp.array([0, 2]))
    args = m.jax_nn_arguments(3, 5)
    self.assertNotIn("is_causal", args)
    band = np.asarray(args["mask"])  # [B, 1, T, S]
    want = np.arange(5)[None, None, None, :] <= (
        np.array([0, 2])[:, None, None, None] + np.arange(3)[:, None])
    np.testing.assert_array_equal(band, want)


if __name__ == "__main__":
  absltest.main()
