"""aj.BahdanauAttention and aj.LuongAttention against the papers' formulas."""

from absl.testing import absltest
from absl.testing import parameterized
import chex
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from tests import _data
from tests import reference

# float32 vs float64 through one tanh layer and a softmax: errors ~1e-6.
TOL = dict(atol=1e-5, rtol=1e-5)
B, T, S, DQ, DK = 2, 3, 5, 6, 4


def _inputs():
  # Masks carry the weights' rank: [B, 1, S] for [B, T, Dq] queries.
  pad = aj.padding_mask(jnp.array([S, 2]), S)[:, None, :]  # [B, 1, S]
  return (_data.normal(0, (B, T, DQ)), _data.normal(1, (B, S, DK)),
          _data.normal(2, (B, S, 3)), pad)


class BahdanauModuleTest(parameterized.TestCase):

  @parameterized.named_parameters(("bias", True), ("no_bias", False))
  def test_matches_numpy_e_ij(self, use_bias):
    attn = aj.BahdanauAttention(DQ, DK, 8, use_bias=use_bias,
                                rngs=nnx.Rngs(0))
    q, k, v, pad = _inputs()
    ctx, w = attn(q, k, v, pad, return_weights=True)
    params = jax.tree.map(np.asarray, attn.params_dict())
    self.assertEqual(set(params), {"W_q", "W_k", "v"} | (
        {"b"} if use_bias else set()))
    ref_ctx, ref_w = reference.additive(params, q, k, v, pad)
    chex.assert_trees_all_close(ctx, ref_ctx.astype(np.float32), **TOL)
    chex.assert_trees_all_close(w, ref_w.astype(np.float32), **TOL)

  def test_decoder_loop_with_precomputed_keys(self):
    attn = aj.BahdanauAttention(DQ, DK, 8, rngs=nnx.Rngs(0))
    q, k, v, pad = _inputs()
    keys = attn.precompute_keys(k)

    @nnx.jit
    @chex.assert_max_traces(n=1)
    def step(module, q_t):
      return module(q_t, k, v, pad[:, 0], projected_keys=keys,
                    return_weights=True)

    full_ctx, full_w = attn(q, k, v, pad, return_weights=True)
    for t in range(T):
      ctx, w = step(attn, q[:, t])
      chex.assert_trees_all_close((ctx, w), (full_ctx[:, t], full_w[:, t]),
                                  atol=1e-6, rtol=1e-6)

  def test_gradients_reach_every_parameter(self):
    attn = aj.BahdanauAttention(DQ, DK, 8, rngs=nnx.Rngs(0))
    q, k, v, pad = _inputs()
    grads = nnx.grad(lambda m: jnp.sum(m(q, k, v, pad) ** 2))(attn)
    leaves = jax.tree.leaves(nnx.state(grads, nnx.Param))
    self.assertLen(leaves, 4)
    chex.assert_tree_all_finite(leaves)
    for g in leaves:
      self.assertGreater(float(jnp.abs(g).max()), 0.0)


class LuongModuleTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("dot", "dot", False, None), ("general", "general", False, None),
      ("general_learned_scale", "general", True, None),
      ("concat", "concat", False, None), ("concat_fixed_scale", "concat",
                                          False, 0.5))
  def test_matches_numpy_scores(self, score, use_scale, scale):
    q, k, v, pad = _inputs()
    if score == "dot":
      q = q[..., :DK]
    attn = aj.LuongAttention(q.shape[-1], DK, score=score, hidden_features=8,
                             use_scale=use_scale, scale=scale,
                             rngs=nnx.Rngs(1))
    ctx, w = attn(q, k, v, pad, return_weights=True)
    ref_ctx, ref_w = reference.luong(
        q, k, v, pad, score=score, scale=scale,
        params=jax.tree.map(np.asarray, attn.params_dict()))
    chex.assert_trees_all_close(ctx, ref_ctx.astype(np.float32), **TOL)
    chex.assert_trees_all_close(w, ref_w.astype(np.float32), **TOL)
    if score != "dot" or use_scale:
      grads = nnx.grad(lambda m: jnp.sum(m(q, k, v, pad) ** 2))(attn)
      chex.assert_tree_all_finite(nnx.state(grads, nnx.Param))

  def test_precompute_keys_step(self):
    q, k, v, pad = _inputs()
    attn = aj.LuongAttention(DQ, DK, score="concat", hidden_features=8,
                             rngs=nnx.Rngs(1))
    keys = attn.precompute_keys(k)
    ctx, w = attn(q[:, 0], k, v, pad[:, 0], projected_keys=keys,
                  return_weights=True)
    full_ctx, full_w = attn(q, k, v, pad, return_weights=True)
    chex.assert_trees_all_close((ctx, w), (full_ctx[:, 0], full_w[:, 0]),
                                atol=1e-6, rtol=1e-6)

  @parameterized.named_parameters(
      ("unknown_score", dict(score="cosine"), r"score must be one of"),
      ("dot_features", dict(score="dot"), r"needs query_features == "
       r"key_features, got 6 and 4"),
      ("concat_hidden", dict(score="concat"), r"needs hidden_features"),
  )
  def test_invalid_construction(self, kwargs, pattern):
    with self.assertRaisesRegex(ValueError, pattern):
      aj.LuongAttention(DQ, DK, rngs=nnx.Rngs(0), **kwargs)

  def test_invalid_call(self):
    attn = aj.LuongAttention(DQ, DK, score="general", rngs=nnx.Rngs(0))
    with self.assertRaisesRegex(ValueError, r"params\['W'\] has shape "
                                r"\(6, 4\), expected \[Dq, Dk\] = \[5, 4\]"):
      attn(jnp.ones((B, 5)), jnp.ones((B, S, DK)))


if __name__ == "__main__":
  absltest.main()
