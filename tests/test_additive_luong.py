"""Bahdanau and Luong attention against NumPy references of their formulas."""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
from jax import test_util as jtu
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from tests import _data
from tests import reference

# float32 vs float64: one tanh layer of width <= 8 and a softmax over S <= 6;
# errors are ~1e-6, so 1e-5 is tight enough to catch any formula slip.
TOL = dict(atol=1e-5, rtol=1e-5)
B, T, S, DQ, DK, DV, A = 2, 3, 5, 6, 4, 3, 8


def _inputs(seed=0):
  return (_data.normal(seed, (B, T, DQ)), _data.normal(seed + 1, (B, S, DK)),
          _data.normal(seed + 2, (B, S, DV)))


def _masks():
  # Masks carry the weights' rank: key padding for every step is [B, 1, S].
  pad = aj.padding_mask(jnp.array([S, 2]), S)[:, None, :]  # [B, 1, S]
  return {"none": None, "padding": pad,
          "per_step": _data.bernoulli(9, 0.7, (B, T, S)),
          "int_padding": pad.astype(jnp.int32)}


class AdditiveTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
      ("no_mask", "none", True), ("padding", "padding", True),
      ("per_step_mask", "per_step", True), ("int_mask_no_bias", "int_padding",
                                            False))
  def test_matches_numpy(self, mask_kind, use_bias):
    q, k, v = _inputs()
    params = _data.params(aj.init_additive_params, 1, DQ, DK, A,
                          use_bias=use_bias)
    mask = _masks()[mask_kind]
    ctx, w = self.variant(functools.partial(
        aj.additive_attention, return_weights=True))(params, q, k, v, mask)
    ref_ctx, ref_w = reference.additive(params, q, k, v, mask)
    chex.assert_shape(ctx, (B, T, DV))
    chex.assert_trees_all_close(ctx, ref_ctx.astype(np.float32), **TOL)
    chex.assert_trees_all_close(w, ref_w.astype(np.float32), **TOL)

  @chex.variants(with_jit=True, without_jit=True)
  def test_single_step_with_precomputed_keys(self):
    q, k, v = _inputs()
    params = _data.params(aj.init_additive_params, 1, DQ, DK, A)
    mask = _masks()["padding"][:, 0]  # [B, S]: one step's weights' rank
    projected = aj.precompute_additive_keys(params, k)
    step = self.variant(functools.partial(aj.additive_attention,
                                          return_weights=True))
    for t in range(T):
      ctx, w = step(params, q[:, t], k, v, mask, projected_keys=projected)
      ref_ctx, ref_w = reference.additive(params, q[:, t:t + 1], k, v, mask)
      chex.assert_shape((ctx, w), ((B, DV), (B, S)))
      chex.assert_trees_all_close(ctx, ref_ctx[:, 0].astype(np.float32), **TOL)
      chex.assert_trees_all_close(w, ref_w[:, 0].astype(np.float32), **TOL)
    np.testing.assert_array_equal(w[1, 2:], 0.0)  # padding gets no weight

  def test_values_default_to_keys(self):
    q, k, _ = _inputs()
    params = _data.params(aj.init_additive_params, 1, DQ, DK, A)
    a = aj.additive_attention(params, q, k, return_weights=True)
    b = aj.additive_attention(params, q, k, k, return_weights=True)
    chex.assert_trees_all_close(a, b, atol=0, rtol=0)

  def test_check_grads_float64(self):
    with jax.enable_x64(True):
      q, k, v = (np.asarray(x, np.float64) for x in _inputs())
      params = jax.tree.map(lambda p: np.asarray(p, np.float64),
                            _data.params(aj.init_additive_params, 1, DQ, DK,
                                         A))
      mask = np.asarray(_masks()["padding"])
      fn = jax.jit(lambda params, q, k, v: aj.additive_attention(
          params, q, k, v, mask))
      jtu.check_grads(fn, (params, q, k, v), order=1, modes=("rev",))

  def test_fully_masked_step_gives_zero_context_and_finite_grads(self):
    q, k, v = _inputs()
    params = _data.params(aj.init_additive_params, 1, DQ, DK, A)
    mask = jnp.ones((B, 1, S), bool).at[0].set(False)
    ctx, w = aj.additive_attention(params, q, k, v, mask, return_weights=True)
    np.testing.assert_array_equal(ctx[0], 0.0)
    np.testing.assert_array_equal(w[0], 0.0)
    grads = jax.jit(jax.grad(
        lambda q: aj.additive_attention(params, q, k, v, mask).sum()))(q)
    chex.assert_tree_all_finite(grads)
    np.testing.assert_array_equal(grads[0], 0.0)


class LuongTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
      ("dot", "dot", "padding", None, False),
      ("dot_scaled", "dot", "none", 0.5, False),
      ("general", "general", "per_step", None, False),
      ("general_learned_scale", "general", "padding", None, True),
      # Dq == Dk: a transposed W has the right shape, only the numbers differ.
      ("general_square_w", "general", "padding", None, False),
      ("concat", "concat", "padding", None, False),
      ("concat_int_mask", "concat", "int_padding", 2.0, True),
  )
  def test_matches_numpy(self, score, mask_kind, scale, use_scale):
    q, k, v = _inputs()
    if score == "dot" or "square_w" in self._testMethodName:
      q = q[..., :DK]
    dq = q.shape[-1]
    params = _data.params(aj.init_luong_params, 2, dq, DK, score=score,
                          hidden_features=A, use_scale=use_scale)
    if score == "general" and dq == DK:  # W must not be symmetric
      w = params["W"]
      self.assertGreater(float(jnp.abs(w - w.T).max()), 0.1)
    mask = _masks()[mask_kind]
    fn = self.variant(functools.partial(aj.luong_attention, score=score,
                                        scale=scale, return_weights=True))
    ctx, w = fn(params, q, k, v, mask)
    ref_ctx, ref_w = reference.luong(q, k, v, mask, score=score,
                                     params=params, scale=scale)
    chex.assert_shape((ctx, w), ((B, T, DV), (B, T, S)))
    chex.assert_trees_all_close(ctx, ref_ctx.astype(np.float32), **TOL)
    chex.assert_trees_all_close(w, ref_w.astype(np.float32), **TOL)

  @parameterized.parameters("dot", "general", "concat")
  def test_precomputed_keys_single_step(self, score):
    q, k, v = _inputs()
    q = q[..., :DK] if score == "dot" else q
    params = _data.params(aj.init_luong_params, 2, q.shape[-1], DK,
                          score=score, hidden_features=A)
    projected = aj.precompute_luong_keys(params, k, score=score)
    ctx, w = aj.luong_attention(params, q[:, 1], k, v, score=score,
                                projected_keys=projected, return_weights=True)
    ref_ctx, ref_w = reference.luong(q[:, 1:2], k, v, score=score,
                                     params=params)
    chex.assert_trees_all_close(ctx, ref_ctx[:, 0].astype(np.float32), **TOL)
    chex.assert_trees_all_close(w, ref_w[:, 0].astype(np.float32), **TOL)

  def test_dot_equals_unscaled_sdpa(self):
    q, k, v = _inputs()
    q = q[..., :DK]
    ctx, w = aj.luong_attention(None, q, k, v, return_weights=True)
    out, weights = aj.scaled_dot_product_attention(q, k, v, scale=1.0,
                                                   return_weights=True)
    chex.assert_trees_all_close((ctx, w), (out, weights), **TOL)

  def test_bfloat16_inputs(self):
    q, k, v = (x.astype(jnp.bfloat16) for x in _inputs())
    params = _data.params(aj.init_luong_params, 2, DQ, DK, score="general")
    ctx, w = aj.luong_attention(params, q, k, v, score="general",
                                return_weights=True)
    self.assertEqual(ctx.dtype, jnp.bfloat16)
    self.assertEqual(w.dtype, jnp.float32)
    ref_ctx, ref_w = aj.luong_attention(
        params, *(x.astype(jnp.float32) for x in (q, k, v)), score="general",
        return_weights=True)
    # Scores are float32 either way; only the final cast of the context to
    # bfloat16 differs (half an ulp: 2^-9 relative).
    chex.assert_trees_all_close(w, ref_w, atol=1e-6, rtol=1e-6)
    chex.assert_trees_all_close(ctx.astype(jnp.float32), ref_ctx,
                                rtol=2.0**-8, atol=1e-6)


if __name__ == "__main__":
  absltest.main()
