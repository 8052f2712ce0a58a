"""Numerical extremes: huge logits, fp16 range, NaN/inf hidden in padding,
very long rows."""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from tests import _data
from tests import reference

IMPLS = ("dense", "flash")


def _sdpa(implementation, q, k, v, mask=None, **kw):
  return aj.scaled_dot_product_attention(
      q, k, v, mask, implementation=implementation, **kw)


class HugeLogitsTest(parameterized.TestCase):

  @parameterized.parameters(*IMPLS)
  def test_logits_of_1e4_in_float32(self, implementation):
    q = 100.0 * _data.normal(0, (2, 6, 16))  # |logits| ~ 1e4 after 1/sqrt(16)
    k = 100.0 * _data.normal(1, (2, 9, 16))
    v = _data.normal(2, (2, 9, 5))
    out = jax.jit(lambda q, k, v: _sdpa(implementation, q, k, v))(q, k, v)
    ref, _ = reference.sdpa(q, k, v)
    chex.assert_tree_all_finite(out)
    # float32 logits of 1e4 carry ~1e4 * 6e-8 = 6e-4 rounding into exp().
    np.testing.assert_allclose(out, ref, atol=2e-3, rtol=2e-3)

  @parameterized.parameters(*IMPLS)
  def test_float16_at_the_edge_of_its_range(self, implementation):
    # q.k reaches 64 * 30 * 30 = 57,600, near fp16's max of 65,504: the dot
    # must accumulate in float32 or it overflows to inf.
    q = (30.0 * jnp.sign(_data.normal(3, (1, 4, 64)))).astype(jnp.float16)
    k = (30.0 * jnp.sign(_data.normal(4, (1, 7, 64)))).astype(jnp.float16)
    v = _data.normal(5, (1, 7, 8), jnp.float16)
    out = jax.jit(lambda q, k, v: _sdpa(implementation, q, k, v,
                                        scale=1.0))(q, k, v)
    self.assertEqual(out.dtype, jnp.float16)
    chex.assert_tree_all_finite(out)
    ref, _ = reference.sdpa(q, k, v, scale=1.0)
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=3e-3,
                               rtol=3e-3)  # one fp16 rounding (2^-11)

  def test_row_of_65536_keys_sums_to_one(self):
    q = _data.normal(6, (1, 8))
    # Bigger than the shared pool: NumPy's generator (no compile either).
    k = jnp.asarray(np.random.default_rng(7).standard_normal(
        (65536, 8), dtype=np.float32) * 0.01)  # near-uniform weights
    v = jnp.ones((65536, 1))
    out, w = jax.jit(functools.partial(aj.scaled_dot_product_attention,
                                       return_weights=True))(q, k, v)
    # 65,536 float32 terms of ~1.5e-5: pairwise summation keeps ~1e-6.
    np.testing.assert_allclose(np.asarray(w, np.float64).sum(), 1.0,
                               atol=1e-5)
    np.testing.assert_allclose(out, 1.0, atol=1e-5)  # weighted mean of ones
    block = jax.jit(aj.blockwise_attention)(q, k, v)
    np.testing.assert_allclose(block, 1.0, atol=1e-5)


def _poison(x, lengths, value):
  """``x [B, S, F]`` with ``value`` written past each example's length."""
  pad = np.arange(x.shape[1])[None, :] >= np.asarray(lengths)[:, None]
  return jnp.where(pad[..., None], value, x)


class PoisonedPaddingTest(parameterized.TestCase):
  """NaN/inf in key/value positions nobody may see must reach nothing."""

  LENGTHS = (9, 5)

  def _keys(self):
    k = _data.normal(10, (2, 9, 16))
    v = _data.normal(11, (2, 9, 16))
    mask = np.arange(9)[None, :] < np.asarray(self.LENGTHS)[:, None]  # [B, S]
    return k, v, jnp.asarray(mask)

  def _check(self, fn, args, poisoned_args):
    clean = jax.jit(jax.value_and_grad(fn, argnums=tuple(range(len(args)))))
    (out, grads) = clean(*args)
    (p_out, p_grads) = clean(*poisoned_args)
    chex.assert_tree_all_finite((p_out, p_grads))
    chex.assert_trees_all_close(p_out, out, atol=0, rtol=0)
    # Gradients at the poisoned positions are exactly 0; elsewhere the same.
    chex.assert_trees_all_close(
        jax.tree.map(lambda g: jnp.where(jnp.isfinite(g), g, 0.0), p_grads),
        jax.tree.map(lambda g: jnp.where(jnp.isfinite(g), g, 0.0), grads),
        atol=1e-6, rtol=1e-6)

  @parameterized.product(implementation=IMPLS,
                         poison=(np.nan, np.inf, -np.inf))
  def test_scaled_dot_product_attention(self, implementation, poison):
    q = _data.normal(12, (2, 6, 16))
    k, v, mask = self._keys()

    def fn(q, k, v):
      return jnp.sum(_sdpa(implementation, q, k, v, mask[:, None, :]) ** 2)

    self._check(fn, (q, k, v), (q, _poison(k, self.LENGTHS, poison),
                                _poison(v, self.LENGTHS, poison)))

  def test_blockwise_key_value_seq_lengths(self):
    q = _data.normal(13, (2, 6, 16))
    k, v, _ = self._keys()
    lengths = jnp.array(self.LENGTHS)

    def fn(q, k, v):
      return jnp.sum(aj.blockwise_attention(
          q, k, v, aj.Mask(kv_lengths=lengths), block_k=4) ** 2)

    self._check(fn, (q, k, v), (q, _poison(k, self.LENGTHS, np.nan),
                                _poison(v, self.LENGTHS, np.nan)))

  def test_multi_head_attention_and_its_params(self):
    params = _data.params(aj.init_multi_head_params, 0, 16, 4)
    x = _data.normal(14, (2, 6, 16))
    k, _, mask = self._keys()

    def fn(params, x, kv):
      out = aj.multi_head_attention(params, x, kv, kv,
                                    mask[:, None, None, :])
      return jnp.sum(out ** 2)

    self._check(fn, (params, x, k),
                (params, x, _poison(k, self.LENGTHS, np.nan)))

  @parameterized.parameters("additive", "luong")
  def test_decoder_attention_and_its_params(self, kind):
    k, v, mask = self._keys()
    mask = mask[:, None, :]  # [B, 1, S]: the weights' rank
    q = _data.normal(15, (2, 3, 16))
    if kind == "additive":
      params = _data.params(aj.init_additive_params, 1, 16, 16, 8)

      def fn(params, q, k, v):
        return jnp.sum(aj.additive_attention(params, q, k, v, mask) ** 2)
    else:
      params = _data.params(aj.init_luong_params, 1, 16, 16, score="general")

      def fn(params, q, k, v):
        return jnp.sum(aj.luong_attention(params, q, k, v, mask,
                                          score="general") ** 2)

    self._check(fn, (params, q, k, v),
                (params, q, _poison(k, self.LENGTHS, np.nan),
                 _poison(v, self.LENGTHS, np.inf)))


if __name__ == "__main__":
  absltest.main()
