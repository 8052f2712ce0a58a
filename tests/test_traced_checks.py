"""Traced values: checked under ``aj.checked``, documented when not.

A value traced under ``jax.jit`` cannot be checked while tracing; each
documented condition is a ``checkify`` check that ``aj.checked`` turns on.
Here: every condition fails under it with the argument's name, the same
calls with valid values pass and give the unchecked answer, gradients and
the flash walk (a loop whose bound differs per example) work under it, and
what each value does with the checks off is what docs/options.md says.

Shape glossary: B batch, N heads, T query length, S key length, H head dim.
"""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from tests import _data

Q = _data.normal(0, (2, 2, 4, 8))  # [B, N, T, H]
KV = _data.normal(1, (2, 2, 6, 8))  # [B, N, S, H]
sdpa = aj.scaled_dot_product_attention
KEY = jax.random.key(0)


def _call(impl="dense", **fixed):
  """sdpa over Q, KV with one traced option ``value`` named by ``name``."""
  def run(name, value):
    options = dict(fixed)
    if name in ("kv_lengths", "q_lengths"):
      options["mask"] = aj.Mask(**{name: value})
    else:
      options[name] = value
    return sdpa(Q, KV, KV, implementation=impl, **options)
  return run


# (name, traced bad value, valid value, message, extra fixed options)
CASES = [
    ("dropout_rate", 1.5, 0.25, r"dropout_rate must be in \[0, 1\), got 1.5",
     dict(dropout_rng=KEY)),
    ("dropout_rate_negative", -0.5, 0.25, r"dropout_rate must be in \[0, 1\)",
     dict(dropout_rng=KEY)),
    ("kv_lengths", np.array([7, 3]), np.array([6, 3]),
     r"kv_lengths must lie in \[0, 6\], got values from 3 to 7", {}),
    ("q_lengths", np.array([2, -1]), np.array([2, 4]),
     r"q_lengths must lie in \[0, 4\], got values from -1 to 2", {}),
    ("scale", np.float32(np.nan), np.float32(0.5),
     r"scale must be positive and finite, got nan", {}),
    ("scale_negative", np.float32(-1.0), np.float32(0.5),
     r"scale must be positive and finite, got -1", {}),
    ("sinks", np.array([0.0, np.nan], np.float32),
     np.array([0.0, -np.inf], np.float32), r"sinks must be finite", {}),
    ("bias", np.zeros((1, 1, 4, 6), np.float32) + np.float32(np.inf),
     np.zeros((1, 1, 4, 6), np.float32) - np.float32(np.inf),
     r"bias must be finite \(-inf masks the entry\)", {}),
]


def _named(name):
  return name.replace("_negative", "")


class CheckedTest(parameterized.TestCase):

  @parameterized.product(case=CASES, impl=("dense", "flash"))
  def test_bad_traced_value_raises_and_a_valid_one_passes(self, case, impl):
    name, bad, good, pattern, fixed = case
    run = jax.jit(lambda x: _call(impl, **fixed)(_named(name), x))
    with self.assertRaisesRegex(ValueError, pattern):
      aj.checked(run)(bad)
    chex.assert_trees_all_close(aj.checked(run)(good), run(good),
                                atol=0, rtol=0)  # the same program

  def test_gradient_under_checked(self):
    loss = lambda q, n: sdpa(  # noqa: E731
        q, KV, KV, aj.Mask(kv_lengths=n), implementation="flash").sum()
    grad = jax.jit(jax.grad(loss))
    with self.assertRaisesRegex(ValueError, r"kv_lengths must lie"):
      aj.checked(grad)(Q, np.array([9, 1]))
    chex.assert_trees_all_close(aj.checked(grad)(Q, np.array([5, 1])),
                                grad(Q, np.array([5, 1])), atol=0, rtol=0)

  def test_jax_nn_lengths(self):
    nn = lambda n: aj.dot_product_attention(  # noqa: E731
        Q[0][..., None, :], KV[0][..., None, :], KV[0][..., None, :],
        key_value_seq_lengths=n)
    with self.assertRaisesRegex(ValueError, r"key_value_seq_lengths must"):
      aj.checked(jax.jit(nn))(np.array([2, 8]))

  def test_checkify_keeps_the_error_as_a_value(self):
    run = jax.jit(lambda r: sdpa(Q, KV, KV, dropout_rate=r, dropout_rng=KEY))
    error, _ = jax.jit(checkify.checkify(run, errors=checkify.user_checks))(
        jnp.float32(2.0))
    self.assertIn("dropout_rate must be in [0, 1)", error.get())


class OffTest(chex.TestCase):
  """Without ``aj.checked``: what docs/options.md says each value does."""

  def test_rate_of_one_or_more_drops_everything(self):
    out = jax.jit(lambda r: sdpa(Q, KV, KV, dropout_rate=r,
                                 dropout_rng=KEY))(jnp.float32(1.5))
    chex.assert_trees_all_close(out, jnp.zeros_like(out), atol=0, rtol=0)

  def test_lengths_clip(self):
    run = jax.jit(lambda n: sdpa(Q, KV, KV, aj.Mask(kv_lengths=n)))
    chex.assert_trees_all_close(run(np.array([9, 3])), run(np.array([6, 3])),
                                atol=0, rtol=0)

  def test_nan_scale_and_sinks_and_inf_bias_give_nan(self):
    for name, value in (("scale", jnp.float32(jnp.nan)),
                        ("sinks", jnp.array([0.0, jnp.nan])),
                        ("bias", jnp.full((1, 1, 4, 6), jnp.inf))):
      out = jax.jit(lambda x, name=name: sdpa(Q, KV, KV, **{name: x}))(value)
      self.assertTrue(bool(jnp.isnan(out).any()), name)


if __name__ == "__main__":
  absltest.main()
