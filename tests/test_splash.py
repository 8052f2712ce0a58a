"""The splash kernel (``kernels/splash.py``) beyond the shared contract.

The contract suite (``tests/contract.py``) checks its numbers case by case;
here: a per-head dense mask, a per-example rule, the gradient through the
lse alone, each refusal's reason, and the TPU path.

No TPU here: splash's Pallas kernels run in the interpreter
(``Splash(interpret=True)``); tiny shapes (one 128 block after padding),
since the interpreter is slow. ``supports`` is reached past its TPU check by
mocking the backend, and the real (non-interpret) kernel is lowered for TPU
from this CPU machine. Shape glossary: B batch, N query heads, K key/value
heads, T query length, S key/value length, H head dim.
"""

from unittest import mock

from absl.testing import absltest
import chex
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.kernels import base
from attention_jax.kernels import splash
from tests import _data

# Both sides compute in float32 over <= 40 keys (roundings of ~1.2e-7 each,
# in another order: splash scales q before q.k, accumulates blockwise and
# recomputes P from lse in its backward): ~1e-6; 1e-5 leaves headroom.
FWD_TOL = dict(atol=1e-5, rtol=1e-5)
# Gradients add a few more roundings (dS = P * (dP - D), then dS @ K).
GRAD_TOL = dict(atol=5e-5, rtol=5e-5)
B, N, H = 2, 4, 8
SPLASH = splash.Splash(interpret=True)


def _qkv(t, s, kv_heads=2, seed=0):
  return (_data.normal(seed, (B, N, t, H)),
          _data.normal(seed + 1, (B, kv_heads, s, H)),
          _data.normal(seed + 2, (B, kv_heads, s, H)))


def _run(implementation, q, k, v, mask, extras=None, *, score_mod=None):
  """``(out, lse), grads`` of a loss through the output and the lse."""
  cot = _data.normal(7, q.shape)
  cot_lse = _data.normal(8, q.shape[:-1])

  def loss(q, k, v, extras):
    out, lse = aj.scaled_dot_product_attention(
        q, k, v, mask, implementation=implementation, return_lse=True,
        score_mod=score_mod, **extras)
    total = jnp.sum(out * cot) + jnp.sum(
        jnp.where(jnp.isfinite(lse), lse, 0.0) * cot_lse)
    return total, (out, lse)

  (_, outputs), grads = jax.jit(jax.value_and_grad(
      loss, (0, 1, 2, 3), has_aux=True))(q, k, v, extras or {})
  return outputs, grads


class SplashTest(chex.TestCase):

  def _matches_dense(self, q, k, v, mask, extras=None, *, score_mod=None):
    (out, lse), grads = _run(SPLASH, q, k, v, mask, extras,
                             score_mod=score_mod)
    (want, want_lse), want_grads = _run("dense", q, k, v, mask, extras,
                                        score_mod=score_mod)
    self.assertEqual(out.dtype, q.dtype)
    chex.assert_tree_all_finite(out)
    np.testing.assert_allclose(out, want, **FWD_TOL)
    np.testing.assert_allclose(lse, want_lse, **FWD_TOL)  # -inf == -inf
    for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
      self.assertTrue(np.isfinite(np.asarray(got)).all())
      np.testing.assert_allclose(got, ref, **GRAD_TOL)
    return out, lse, grads

  def test_rules_per_example_and_mha(self):
    # A per-example rule and a per-head dense mask (concrete, eager) run one
    # kernel per distinct slice.
    q, k, v = _qkv(40, 40, kv_heads=4)
    rule = aj.prefix_lm_mask_fn(jnp.array([6, 23], jnp.int32))
    self._matches_dense(q, k, v, aj.Mask(rule=rule))
    dense = np.array(_data.bernoulli(3, 0.6, (1, N, 40, 40)))
    dense[0, 2, 5] = False  # a row that sees nothing
    q, k, v = _qkv(40, 40, kv_heads=2)
    out = aj.scaled_dot_product_attention(q, k, v, aj.Mask(dense=dense),
                                          implementation=SPLASH)
    want = aj.scaled_dot_product_attention(q, k, v, aj.Mask(dense=dense),
                                           implementation="dense")
    np.testing.assert_allclose(out, want, **FWD_TOL)
    np.testing.assert_array_equal(out[:, 2, 5], 0.0)

  def test_gradient_through_lse_alone(self):
    # Splash's own VJP takes no lse cotangent: ours folds it into its D.
    q, k, v = _qkv(24, 40)

    def grads(implementation):
      return jax.grad(lambda q, k: jnp.sum(aj.scaled_dot_product_attention(
          q, k, v, aj.Mask(causal=True), implementation=implementation,
          return_lse=True)[1]), (0, 1))(q, k)

    for got, want in zip(grads(SPLASH), grads("dense")):
      np.testing.assert_allclose(got, want, **GRAD_TOL)

  def test_refusals_name_the_reason(self):
    q, k, v = _qkv(8, 8)
    bias = _data.normal(4, (1, N, 8, 8))
    with self.assertRaisesRegex(ValueError, "bias"):
      aj.scaled_dot_product_attention(q, k, v, bias=bias,
                                      implementation=SPLASH)
    with self.assertRaisesRegex(ValueError, "soft_cap"):
      aj.scaled_dot_product_attention(
          q, k, v, score_mod=aj.alibi(aj.alibi_slopes(N)),
          implementation=SPLASH)

    @jax.jit
    def traced_rule(q, k, v, prefix):
      return aj.scaled_dot_product_attention(
          q, k, v, aj.Mask(rule=aj.prefix_lm_mask_fn(prefix)),
          implementation=SPLASH)

    with self.assertRaisesRegex(ValueError, "rule reads traced values"):
      traced_rule(q, k, v, jnp.array([3, 5], jnp.int32))
    with self.assertRaisesRegex(ValueError, "dense mask is traced"):
      jax.jit(lambda q, k, v, m: aj.scaled_dot_product_attention(
          q, k, v, m, implementation=SPLASH))(
              q, k, v, jnp.ones((B, 1, 8, 8), bool))
    with mock.patch.object(splash, "HOST_MASK_LIMIT", 8 * 8 - 1), \
        self.assertRaisesRegex(ValueError, "evaluated on the host into 64"):
      aj.scaled_dot_product_attention(
          q, k, v, aj.Mask(rule=aj.prefix_lm_mask_fn(3)),
          implementation=SPLASH)
    with self.assertRaisesRegex(ValueError, "needs a TPU.*interpret=True"):
      aj.scaled_dot_product_attention(q, k, v, is_causal=True,
                                      implementation=splash.Splash())

  def test_tpu_takes_causal_bfloat16(self):
    q, k, v = (x.astype(jnp.bfloat16) for x in _qkv(256, 256))
    problem = base.canonicalize(q, k, v, aj.Mask(causal=True))
    with mock.patch.object(jax, "default_backend", return_value="tpu"):
      self.assertIsNone(splash.Splash().supports(problem))
      # The real kernel (not the interpreter) lowers for TPU from here.
      lowered = jax.jit(lambda q, k, v: aj.scaled_dot_product_attention(
          q, k, v, is_causal=True, implementation=splash.Splash())).trace(
              q, k, v).lower(lowering_platforms=("tpu",))
    self.assertIn("tpu_custom_call", lowered.as_text())


if __name__ == "__main__":
  absltest.main()
