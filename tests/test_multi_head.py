"""multi_head_attention against the lesson's MultiHeadAttention in NumPy."""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.layers import multi_head_params
from tests import _data
from tests import reference

# float32 vs float64 through four D x D projections and an attention: each
# output sums ~D = 16 products of O(1) terms after two rounded matmuls, so
# errors are ~1e-6; 2e-5 leaves headroom without hiding a wrong head order.
TOL = dict(atol=2e-5, rtol=2e-5)


def _inputs(b=2, t=4, s=6, d=16, seed=0):
  return _data.normal(seed, (b, t, d)), _data.normal(seed + 1, (b, s, d))


class MultiHeadTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
      ("self_attention", 4, None, "self", False, None, True),
      ("cross_attention_s_ne_t", 4, None, "cross", False, "padding", True),
      ("causal_self", 2, None, "self", True, None, True),
      ("causal_self_padded", 4, None, "self", True, "padding", True),
      ("gqa", 4, 2, "cross", False, "padding", True),
      ("mqa_causal", 4, 1, "self", True, None, True),
      ("no_bias", 2, None, "cross", False, None, False),
  )
  def test_matches_numpy_lesson(self, num_heads, num_kv_heads, kind,
                                is_causal, mask_kind, use_bias):
    x, y = _inputs()
    key = x if kind == "self" else y
    value = _data.normal(9, key.shape)  # distinct: W_v must project value
    b, t, s = x.shape[0], x.shape[1], key.shape[1]
    params = _data.params(aj.init_multi_head_params, 1, 16, num_heads,
                          num_kv_heads=num_kv_heads, use_bias=use_bias)
    mask = None
    if mask_kind == "padding":
      mask = aj.make_attention_mask(
          aj.padding_mask(jnp.array([t, t - 1]), t),
          aj.padding_mask(jnp.array([s, 2]), s))
    # The head counts are read from the params.
    fn = self.variant(functools.partial(
        aj.multi_head_attention, is_causal=is_causal, return_weights=True))
    out, weights = fn(params, x, key, value, mask)
    ref_out, ref_w = reference.multi_head_attention(
        params, x, key, value, mask, num_heads=num_heads,
        num_kv_heads=num_kv_heads, is_causal=is_causal)
    chex.assert_shape(out, (b, t, 16))
    chex.assert_shape(weights, (b, num_heads, t, s))
    chex.assert_trees_all_close(out, ref_out.astype(np.float32), **TOL)
    chex.assert_trees_all_close(weights, ref_w.astype(np.float32), **TOL)

  def test_gqa_equals_mha_with_repeated_kv_heads(self):
    x, y = _inputs()
    gqa = _data.params(aj.init_multi_head_params, 2, 16, 4, num_kv_heads=2)
    # Repeat each KV head's projection for its 2 query heads: kernels
    # [D, K, H] and biases [K, H] along their heads axis.
    mha = dict(gqa)
    for name in ("W_k", "W_v"):
      mha[name] = {"kernel": jnp.repeat(gqa[name]["kernel"], 2, axis=1),
                   "bias": jnp.repeat(gqa[name]["bias"], 2, axis=0)}
    got = aj.multi_head_attention(gqa, x, y, y, return_weights=True)
    want = aj.multi_head_attention(mha, x, y, y, return_weights=True)
    chex.assert_trees_all_close(got, want, atol=1e-6, rtol=1e-6)

  def test_per_head_loop_equals_vmapped_heads(self):
    x, y = _inputs()
    params = _data.params(aj.init_multi_head_params, 3, 16, 4)
    _, weights = aj.multi_head_attention(params, x, y, y,
                                         return_weights=True)
    def head(x, name, n):  # x @ kernel[:, n] + bias[n]: [B, T, H]
      layer = params[name]
      return x @ layer["kernel"][:, n] + layer["bias"][n][None, None]

    for n in range(4):
      _, w = aj.scaled_dot_product_attention(
          head(x, "W_q", n), head(y, "W_k", n), head(y, "W_v", n),
          return_weights=True)
      chex.assert_trees_all_close(weights[:, n], w, atol=1e-6, rtol=1e-6)

  def test_init_shapes_and_scale(self):
    key = jax.random.key(0)
    params = aj.init_multi_head_params(key, 64, 8, num_kv_heads=2)
    shapes = jax.tree.map(jnp.shape, params)
    self.assertEqual(shapes, {
        "W_q": {"kernel": (64, 8, 8), "bias": (8, 8)},
        "W_k": {"kernel": (64, 2, 8), "bias": (2, 8)},
        "W_v": {"kernel": (64, 2, 8), "bias": (2, 8)},
        "W_o": {"kernel": (8, 8, 64), "bias": (64,)}})
    np.testing.assert_array_equal(params["W_o"]["bias"], 0.0)
    # LeCun normal: std 1/sqrt(fan_in) = 0.125; 4096 draws put the sample
    # std within ~3% of it (a 10% band is > 3 sigma).
    self.assertAlmostEqual(float(params["W_q"]["kernel"].std()), 0.125,
                           delta=0.0125)
    # Drawn as flax's LinearGeneral draws: on the flat 2-D shape (fan-in D
    # for W_q, N*H for W_o), then reshaped; so the numbers are the flat
    # [in, out] layout's, split per head.
    init = jax.nn.initializers.lecun_normal()
    keys = jax.random.split(key, 4)
    np.testing.assert_array_equal(
        params["W_q"]["kernel"], init(keys[0], (64, 64)).reshape(64, 8, 8))
    np.testing.assert_array_equal(
        params["W_o"]["kernel"], init(keys[3], (64, 64)).reshape(8, 8, 64))
    no_bias = aj.init_multi_head_params(key, 8, 2, use_bias=False)
    self.assertEqual(set(no_bias["W_q"]), {"kernel"})
    options = aj.init_multi_head_params(key, 8, 2, head_dim=3, kv_features=5,
                                        out_features=7, normalize_qk=True)
    self.assertEqual(jax.tree.map(jnp.shape, options), {
        "W_q": {"kernel": (8, 2, 3), "bias": (2, 3)},
        "W_k": {"kernel": (5, 2, 3), "bias": (2, 3)},
        "W_v": {"kernel": (5, 2, 3), "bias": (2, 3)},
        "W_o": {"kernel": (2, 3, 7), "bias": (7,)},
        "q_norm": {"scale": (3,)}, "k_norm": {"scale": (3,)}})
    np.testing.assert_array_equal(options["q_norm"]["scale"], 1.0)

  def test_options_match_numpy_lesson(self):
    # H != D / N, keys of their own width, another output width, qk-norm
    # and GQA at once, against the float64 lesson with the same options.
    params = _data.params(aj.init_multi_head_params, 5, 16, 4,
                          num_kv_heads=2, head_dim=3, kv_features=6,
                          out_features=5, normalize_qk=True)
    x, mem = _data.normal(0, (2, 4, 16)), _data.normal(1, (2, 6, 6))
    val = _data.normal(2, (2, 6, 6))
    mask = aj.make_attention_mask(jnp.ones((2, 4), bool),
                                  aj.padding_mask(jnp.array([6, 3]), 6))
    fn = functools.partial(aj.multi_head_attention, is_causal=True,
                           return_weights=True,
                           precision=jax.lax.Precision.HIGHEST)
    out, weights = jax.jit(fn)(params, x, mem, val, mask)
    # The precision reaches the projections' dot products.
    jaxpr = str(jax.make_jaxpr(fn)(params, x, mem, val, mask))
    self.assertGreaterEqual(jaxpr.count("Precision.HIGHEST"), 4)
    ref_out, ref_w = reference.multi_head_attention(params, x, mem, val, mask,
                                                    is_causal=True)
    chex.assert_shape((out, weights), ((2, 4, 5), (2, 4, 4, 6)))
    chex.assert_trees_all_close(out, ref_out.astype(np.float32), **TOL)
    chex.assert_trees_all_close(weights, ref_w.astype(np.float32), **TOL)

  def test_head_counts_must_agree_with_the_params(self):
    # Params for 8 heads of 2 dims with num_heads=4 used to run silently
    # (16 = 4 * 4 = 8 * 2 columns either way); the heads now live in the
    # params' shapes and a disagreeing count is an error. (The public
    # function reads them from the params only; the module checks its own
    # counts against its params with param_dims.)
    params = _data.params(aj.init_multi_head_params, 0, 16, 8,
                          num_kv_heads=4)
    with self.assertRaisesRegex(
        ValueError, r"num_heads=4 but params\['W_q'\]\['kernel'\] has shape "
        r"\(16, 8, 2\): 8 heads"):
      multi_head_params.param_dims(params, num_heads=4)
    with self.assertRaisesRegex(
        ValueError, r"num_kv_heads=2 but params\['W_k'\]\['kernel'\] has "
        r"shape \(16, 4, 2\): 4 key/value heads"):
      multi_head_params.param_dims(params, num_heads=8, num_kv_heads=2)

  def test_dropout_is_reproducible_and_keeps_weights(self):
    x, _ = _inputs()
    params = _data.params(aj.init_multi_head_params, 4, 16, 4)
    clean = aj.multi_head_attention(params, x, x, x, return_weights=True)
    run = lambda rng: aj.multi_head_attention(
        params, x, x, x, dropout_rate=0.3, dropout_rng=rng,
        return_weights=True)
    a, b = run(jax.random.key(5)), run(jax.random.key(5))
    chex.assert_trees_all_close(a, b, atol=0, rtol=0)
    np.testing.assert_array_equal(a[1], clean[1])
    self.assertGreater(float(jnp.abs(a[0] - clean[0]).max()), 1e-3)

  def test_causality_by_gradient(self):
    x, _ = _inputs(b=1, t=5)
    params = _data.params(aj.init_multi_head_params, 6, 16, 4,
                                       num_kv_heads=2)
    fn = lambda x: aj.multi_head_attention(params, x, x, x, is_causal=True)
    jac = jax.jit(jax.jacrev(fn))(x)  # [1, T, D, 1, T, D]
    for t in range(5):
      np.testing.assert_array_equal(jac[0, t, :, 0, t + 1:], 0.0)
      self.assertGreater(float(jnp.abs(jac[0, t, :, 0, : t + 1]).max()), 0.0)

  def test_no_retrace(self):
    params = _data.params(aj.init_multi_head_params, 7, 16, 4)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def fn(params, x):
      return aj.multi_head_attention(params, x, x, x, is_causal=True)

    for seed in range(3):
      fn(params, _inputs(seed=seed)[0])


if __name__ == "__main__":
  absltest.main()
