"""The Pallas GPU paged decode kernel (``kernels/paged_gpu.py``) beyond the
contract.

No GPU here: its numbers are checked in Pallas's interpreter by the contract
(``tests/contract.py``'s paged cases) and below against the flash kernel
over the same pages (partitions, quantised pages, gradients). What a GPU
would meet first is checked too: that a decoding step lowers to one Triton
kernel for ``cuda`` (lowered from this CPU, never compiled or run), and
what ``supports`` refuses there (the backend patched to ``gpu``).
"""

from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj

B, N, K, H, Z, M, P = 2, 4, 2, 16, 16, 4, 10


def _cache(dtype=jnp.bfloat16, lengths=(50, 7)):
  rng = np.random.default_rng(0)
  cache = aj.init_paged_cache(P, Z, K, H, batch_size=B, max_pages=M,
                              dtype=dtype)
  x = jnp.asarray(rng.standard_normal((B, K, 50, H)), jnp.float32)
  cache = aj.paged_cache.append(cache, x, -x,
                                new_lengths=jnp.array(lengths))
  q = jnp.asarray(rng.standard_normal((B, N, 1, H)), jnp.float32)
  return cache, q


def _on_gpu():
  return mock.patch.object(jax, "default_backend", return_value="gpu")


class PagedGpuTest(parameterized.TestCase):

  @parameterized.product(dtype=["float32", "int8"], splits=[1, 3])
  def test_equals_the_flash_kernel_over_the_same_pages(self, dtype, splits):
    cache, q = _cache(jnp.float32 if dtype == "float32" else dtype)
    mask = aj.Mask(causal=True, window=(20, 0))
    kw = dict(sinks=jnp.linspace(-1.0, 1.0, N), return_lse=True)
    want = aj.paged_attention(q, cache, mask, implementation="flash", **kw)
    got = aj.paged_attention(q, cache, mask, implementation=aj.kernels.PagedGpu(
        splits=splits, interpret=True), **kw)
    for x, y in zip(got, want):  # float32, <= 50 keys, other block order
      np.testing.assert_allclose(x, y, atol=2e-6, rtol=2e-6)

  def test_gradients_are_the_flash_kernels(self):
    cache, q = _cache(jnp.float32)

    def loss(q, impl):
      return aj.paged_attention(q, cache, aj.Mask(causal=True),
                                implementation=impl).sum()

    want = jax.grad(loss)(q, "flash")
    got = jax.grad(loss)(q, aj.kernels.PagedGpu(interpret=True))
    np.testing.assert_allclose(got, want, atol=1e-6)

  def test_a_decoding_step_lowers_to_one_triton_kernel(self):
    for dtype in (jnp.bfloat16, "int8"):
      cache, q = _cache(dtype)
      q = q.astype(jnp.bfloat16)
      step = jax.jit(lambda q, c: aj.paged_attention(
          q, c, aj.Mask(causal=True, window=(20, 0)),
          implementation=aj.kernels.PagedGpu(splits=2)))
      with _on_gpu():
        text = step.trace(q, cache).lower(
            lowering_platforms=("cuda",)).as_text()
      self.assertEqual(text.count("__gpu$xla.gpu.triton"), 1, text[:2000])

  def test_refuses_what_triton_or_a_decoding_step_cannot_take(self):
    cache, q = _cache(jnp.float32)
    gpu = aj.kernels.PagedGpu()
    with self.assertRaisesRegex(ValueError, "needs a GPU"):
      aj.paged_attention(q, cache, implementation=gpu)
    small = aj.init_paged_cache(4, 8, 1, 8, batch_size=1, max_pages=2)
    with _on_gpu(), self.assertRaisesRegex(ValueError, "power of two >= 16"):
      aj.paged_attention(jnp.ones((1, 2, 1, 8)), small, implementation=gpu)
    with self.assertRaisesRegex(ValueError, "one query per sequence, got T"):
      aj.paged_attention(jnp.ones((B, N, 2, H)), cache,
                         implementation=aj.kernels.PagedGpu(interpret=True))


if __name__ == "__main__":
  absltest.main()
