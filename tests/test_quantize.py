"""Quantised key/value storage against the bounds its formats promise.

The reference is float64 NumPy: int8 entries within half a scale step,
float8 entries within a relative 2**-4 (or 2**-10 scale steps below
float8's smallest normal), zero tokens exactly zero, garbage kept
non-finite, and the bytes a token takes.
"""

from absl.testing import parameterized
import chex
import jax.numpy as jnp
import numpy as np

from attention_jax.decoding import quantize as qz


def _tokens(seed, shape=(2, 3, 5, 16)):
  # [B, K, L, H]: magnitudes from 1e-3 to 1e3 per token, so the scales
  # differ by orders of magnitude between tokens.
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 3, shape[:-1] + (1,))
  return x.astype(np.float32)


class QuantizeTest(chex.TestCase, parameterized.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_int8_is_within_half_a_step(self):
    x = _tokens(0)
    q, scale = self.variant(lambda x: qz.quantize(x, "int8"))(x)
    self.assertEqual(q.dtype, jnp.int8)
    chex.assert_shape(scale, x.shape[:-1])
    want_scale = np.abs(x.astype(np.float64)).max(-1) / 127
    np.testing.assert_allclose(scale, want_scale, rtol=1e-6)  # float32 divide
    self.assertLessEqual(int(np.abs(np.asarray(q, int)).max()), 127)
    back = np.asarray(qz.dequantize(q, scale), np.float64)
    # Half a step, plus float32 rounding of x / scale and of q * scale.
    bound = scale[..., None] * (0.5 + 1e-5)
    self.assertTrue((np.abs(back - x) <= bound).all())

  @chex.variants(with_jit=True, without_jit=True)
  def test_float8_is_within_its_relative_precision(self):
    x = _tokens(1)
    q, scale = self.variant(lambda x: qz.quantize(x, "float8_e4m3fn"))(x)
    self.assertEqual(q.dtype, jnp.float8_e4m3fn)
    np.testing.assert_allclose(
        scale, np.abs(x.astype(np.float64)).max(-1) / 448, rtol=1e-6)
    back = np.asarray(qz.dequantize(q, scale), np.float64)
    s = np.asarray(scale, np.float64)[..., None]
    normal = np.abs(x) / s >= 2.0 ** -6
    err = np.abs(back - x)
    # 3 mantissa bits, round to nearest: 2**-4 relative (float32 slack).
    self.assertTrue((err[normal] <= np.abs(x)[normal] * (2 ** -4 + 1e-6)
                     ).all())
    # Subnormals are spaced 2**-9 apart: within half of that, in steps.
    sub = np.broadcast_to(s, x.shape)[~normal]
    self.assertTrue((err[~normal] <= sub * (2 ** -10 + 1e-6)).all())

  @parameterized.parameters("int8", "float8_e4m3fn")
  def test_a_zero_token_is_zero_and_garbage_stays_garbage(self, dtype):
    x = np.ones((3, 4), np.float32)
    x[0] = 0.0
    x[1, 2] = np.nan
    x[2, 0] = np.inf
    q, scale = qz.quantize(jnp.asarray(x), dtype)
    back = np.asarray(qz.dequantize(q, scale))
    np.testing.assert_array_equal(back[0], 0.0)
    self.assertEqual(float(scale[0]), 0.0)
    self.assertFalse(np.isfinite(back[1]).all())
    self.assertFalse(np.isfinite(back[2]).all())

  def test_dequantize_returns_the_asked_dtype(self):
    q, scale = qz.quantize(jnp.asarray(_tokens(2)), "int8")
    self.assertEqual(qz.dequantize(q, scale, jnp.bfloat16).dtype,
                     jnp.bfloat16)

  def test_bytes_per_token(self):
    # int8: H bytes + a float32 scale per head; float8 the same.
    self.assertEqual(qz.bytes_per_token(2, 64, "int8"), 2 * (64 + 4))
    self.assertEqual(qz.bytes_per_token(2, 64, "float8_e4m3fn"), 2 * 68)

  def test_bad_input_names_the_argument(self):
    x = jnp.ones((2, 4))
    with self.assertRaisesRegex(ValueError, r"dtype must be one of .*int4"):
      qz.quantize(x, "int4")
    with self.assertRaisesRegex(TypeError, "x must be a real floating-point array"):
      qz.quantize(jnp.ones((2, 4), jnp.int32), "int8")
    q, scale = qz.quantize(x, "int8")
    with self.assertRaisesRegex(ValueError, r"scale must be q's shape"):
      qz.dequantize(q, scale[:1])
    with self.assertRaisesRegex(TypeError, "head_dim must be a Python int"):
      qz.bytes_per_token(2, 64.0, "int8")
