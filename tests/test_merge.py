"""``aj.merge_attentions`` against attending to the union of the keys.

The reference is ``tests/reference.masked_attention`` over all the keys
(float64), never the merge's own formula. Shape glossary: B batch, N
heads, T query length, S key length, H head dim.
"""

from absl.testing import absltest
import chex
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from tests import _data
from tests import reference

B, N, T, S, H = 2, 3, 5, 12, 4
# float64 throughout: both sides round at ~1e-16 over <= 12 keys.
TOL = dict(atol=1e-12, rtol=1e-12)


def _parts(q, k, v, allowed, pieces):
  """Each piece's attention ``(out, lse)`` over its keys (``allowed`` holds
  the rest of the pattern), by the dense kernel."""
  outs, lses = [], []
  for cols in pieces:
    out, lse = aj.scaled_dot_product_attention(
        q, k[:, :, cols], v[:, :, cols], allowed[..., cols],
        implementation="dense", return_lse=True)
    outs.append(out)
    lses.append(lse)
  return outs, lses


class MergeTest(chex.TestCase):

  def setUp(self):
    super().setUp()
    self.enter_context(jax.enable_x64(True))
    self.q = _data.normal(0, (B, N, T, H)).astype(jnp.float64)
    self.k = _data.normal(1, (B, N, S, H)).astype(jnp.float64)
    self.v = _data.normal(2, (B, N, S, H)).astype(jnp.float64)
    allowed = np.array(_data.bernoulli(3, 0.7, (B, N, T, S)))
    allowed[0, 0, 1] = False  # a query that sees no key at all
    allowed[1, 2, :, 8:] = False  # a head that sees nothing of the last part
    self.allowed = jnp.asarray(allowed)

  @chex.variants(with_jit=True, without_jit=True)
  def test_equals_attention_over_the_union(self):
    # Disjoint pieces, interleaved and of uneven sizes.
    pieces = (np.array([0, 3, 4, 9]), np.array([1, 2, 5]),
              np.array([6, 7, 8, 10, 11]))

    @self.variant
    def merged(q, k, v):
      return aj.merge_attentions(*_parts(q, k, v, self.allowed, pieces))

    out, lse = merged(self.q, self.k, self.v)
    want, want_lse = reference.masked_attention(
        self.q, self.k, self.v, None, np.asarray(self.allowed))
    chex.assert_trees_all_close(out, want, **TOL)
    chex.assert_trees_all_close(lse, want_lse, **TOL)  # -inf where empty
    self.assertEqual(float(out[0, 0, 1].sum()), 0.0)
    self.assertEqual(float(lse[0, 0, 1]), -np.inf)

  def test_gradients_equal_the_unions(self):
    pieces = (np.arange(0, 5), np.arange(5, 8), np.arange(8, 12))
    cot = _data.normal(4, (B, N, T, H)).astype(jnp.float64)
    cot_lse = _data.normal(5, (B, N, T)).astype(jnp.float64)

    def loss(out, lse):
      return jnp.sum(out * cot) + jnp.sum(
          jnp.where(jnp.isfinite(lse), lse, 0.0) * cot_lse)

    def merged(q, k, v):
      return loss(*aj.merge_attentions(*_parts(q, k, v, self.allowed,
                                                pieces)))

    def union(q, k, v):
      return loss(*reference.masked_attention(q, k, v, None,
                                              np.asarray(self.allowed)))

    got = jax.grad(merged, (0, 1, 2))(self.q, self.k, self.v)
    want = jax.grad(union, (0, 1, 2))(self.q, self.k, self.v)
    chex.assert_trees_all_close(got, want, atol=1e-10, rtol=1e-10)
    chex.assert_tree_all_finite(got)
    self.assertEqual(float(jnp.abs(got[0][0, 0, 1]).sum()), 0.0)

  def test_one_part_and_empty_parts(self):
    out = self.v[:, :, :T]
    lse = jnp.zeros((B, N, T))
    empty = jnp.full((B, N, T), -jnp.inf)
    got, got_lse = aj.merge_attentions([out, jnp.full_like(out, 7.0)],
                                       [lse, empty])
    chex.assert_trees_all_close(got, out, **TOL)  # the empty part adds 0
    chex.assert_trees_all_close(got_lse, lse, **TOL)
    got, got_lse = aj.merge_attentions([out], [empty])
    self.assertEqual(float(jnp.abs(got).sum()), 0.0)
    self.assertTrue(bool(jnp.all(got_lse == -jnp.inf)))
    g = jax.grad(lambda o, x: aj.merge_attentions([o, o], [x, empty])[0]
                 .sum(), (0, 1))(out, empty)
    chex.assert_tree_all_finite(g)

  def test_bad_parts_are_named(self):
    out, lse = self.v[:, :, :T], jnp.zeros((B, N, T))
    with self.assertRaisesRegex(ValueError, "one lse per output"):
      aj.merge_attentions([out, out], [lse])
    with self.assertRaisesRegex(ValueError, r"outputs\[0\] .* and lses\[0\]"):
      aj.merge_attentions([out], [lse[..., :2]])
    with self.assertRaisesRegex(TypeError, "sequences of parts"):
      aj.merge_attentions(out, lse)
    with self.assertRaisesRegex(ValueError, "do not broadcast"):
      aj.merge_attentions([out, out[:1, :2]], [lse, lse[:1, :2]])


if __name__ == "__main__":
  absltest.main()
