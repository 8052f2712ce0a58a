"""Quantised paged caches: int8 and float8_e4m3fn pages with a float32
scale per token and key/value head, dequantised page by page inside the
flash walk.

The reference is float64 attention over the *dequantised* keys and values
(``quantize.dequantize`` of what the cache stored): the kernel must equal
it to float32 rounding, so any copy, scale or page mix-up shows; the error
against the float cache is then the storage's alone, bounded by what each
format promises.
"""

from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.decoding import quantize
from tests import reference as reference_lib

B, N, K, H, Z, M, P = 2, 4, 2, 16, 4, 6, 14
LENGTHS = (21, 9)


def _cache(dtype, rng):
  k = rng.standard_normal((B, K, 21, H)).astype(np.float32)
  v = rng.standard_normal((B, K, 21, H)).astype(np.float32)
  cache = aj.init_paged_cache(P, Z, K, H, batch_size=B, max_pages=M,
                              dtype=dtype)
  # Two writes, so that pages are shared out between the sequences.
  n1 = np.array([12, 5], np.int32)
  cache = aj.paged_cache.append(cache, jnp.asarray(k[:, :, :12]),
                                jnp.asarray(v[:, :, :12]),
                                new_lengths=jnp.asarray(n1))
  cache = aj.paged_cache.append(cache, jnp.asarray(k[:, :, 12:]),
                                jnp.asarray(v[:, :, 12:]),
                                new_lengths=jnp.asarray(np.array(LENGTHS)
                                                        - n1))
  return cache, k, v


def _stored(cache, b):
  """Sequence ``b``'s keys and values as the cache holds them, float64
  ``[K, len, H]`` (dequantised)."""
  n = int(cache.lengths[b])
  pos = np.arange(n)
  page = np.asarray(cache.page_table[b])[pos // Z]
  out = []
  for pages, scales in ((cache.key_pages, cache.key_scales),
                        (cache.value_pages, cache.value_scales)):
    x = np.asarray(pages.astype(jnp.float32))[page, :, pos % Z]  # [n, K, H]
    if scales is not None:
      x = x * np.asarray(scales)[page, :, pos % Z][..., None]
    out.append(np.swapaxes(x, 0, 1).astype(np.float64))
  return out


class QuantizedPagesTest(chex.TestCase):

  @parameterized.parameters("int8", "float8_e4m3fn")
  def test_equals_attention_over_what_was_stored(self, dtype):
    rng = np.random.default_rng(0)
    cache, k, v = _cache(dtype, rng)
    self.assertEqual(cache.quantized, dtype)
    q = rng.standard_normal((B, N, 3, H)).astype(np.float32)
    out, lse = jax.jit(lambda q, c: aj.paged_attention(
        q, c, aj.Mask(causal=True, window=(10, 0)), implementation="flash",
        sinks=jnp.linspace(-1.0, 1.0, N), return_lse=True))(
            jnp.asarray(q), cache)
    for b, n in enumerate(LENGTHS):
      sk, sv = _stored(cache, b)
      pos = n - 3 + np.arange(3)[:, None]
      j = np.arange(n)[None, :]
      allowed = np.broadcast_to((j <= pos) & (j >= pos - 10), (1, N, 3, n))
      with jax.enable_x64(True):
        want, want_lse = (np.asarray(x[0]) for x in
                          reference_lib.masked_attention(
                              jnp.asarray(q[b:b + 1], jnp.float64),
                              jnp.asarray(sk[None]), jnp.asarray(sv[None]),
                              None, allowed,
                              sinks=jnp.linspace(-1.0, 1.0, N,
                                                 dtype=jnp.float64)))
      # float32 attention over <= 21 keys against float64
      np.testing.assert_allclose(out[b], want, atol=2e-6, rtol=2e-6)
      np.testing.assert_allclose(lse[b], want_lse, atol=2e-6, rtol=2e-6)
      # ... and the storage error alone against the float keys
      first = (12, 5)[b]  # the first write's tokens, then the second's
      written = np.concatenate([k[b, :, :first], k[b, :, 12:12 + n - first]],
                               axis=1)
      exact = quantize.dequantize(*quantize.quantize(jnp.asarray(written),
                                                     dtype))
      np.testing.assert_allclose(sk, exact, atol=1e-6)

  def test_int8_error_against_the_float_cache_is_small(self):
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((B, N, 1, H)), jnp.float32)
    f = aj.paged_attention(q, _cache(jnp.float32, np.random.default_rng(2))[0])
    i8 = aj.paged_attention(q, _cache("int8", np.random.default_rng(2))[0])
    # int8 keys within scale / 2 = max|x| / 254 per entry: logits move by
    # ~1e-2 at H = 16, outputs by less
    self.assertLess(float(jnp.abs(i8 - f).max()), 2e-2)
    self.assertGreater(float(jnp.abs(i8 - f).max()), 0.0)  # it is int8

  def test_copy_on_write_copies_the_scales(self):
    cache = aj.init_paged_cache(4, 2, 1, 2, batch_size=2, max_pages=2,
                                dtype="int8")
    x = jnp.array([[[[1.0, 2.0]]], [[[0.0, 0.0]]]])  # [B, K, 1, H]
    cache = aj.paged_cache.append(cache, x, x, new_lengths=jnp.array([1, 0]))
    cache = aj.paged_cache.share_prefix(cache, 0, 1, 1)
    y = 3 * x[:1].repeat(2, 0)
    cache = aj.paged_cache.append(cache, y, y, new_lengths=jnp.array([0, 1]))
    sk0, _ = _stored(cache, 0)
    sk1, _ = _stored(cache, 1)
    np.testing.assert_allclose(sk0[0], [[1.0, 2.0]], atol=0.01)
    np.testing.assert_allclose(sk1[0], [[1.0, 2.0], [3.0, 6.0]], atol=0.03)

  def test_a_kernel_without_page_scales_refuses_by_name(self):
    class NoScales(aj.kernels.Flash):
      name = "no_scales"
      implements = aj.kernels.Flash.implements - {"page_scales"}

    cache, _, _ = _cache("int8", np.random.default_rng(0))
    with self.assertRaisesRegex(ValueError, "does not implement page_scales"):
      aj.paged_attention(jnp.ones((B, N, 1, H)), cache,
                         implementation=NoScales())

  def test_bad_storage_is_refused(self):
    with self.assertRaisesRegex(TypeError, "float dtype or one of"):
      aj.init_paged_cache(2, 2, 1, 2, batch_size=1, max_pages=1,
                          dtype=jnp.int32)
