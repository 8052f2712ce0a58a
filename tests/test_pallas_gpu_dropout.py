"""Attention dropout in the Pallas GPU kernel (``kernels/pallas_gpu.py``).

Every kernel with dropout draws its keep mask from ``(seed, b, h, q_idx,
kv_idx)`` (``core/dropout.py``), so the same ``dropout_rng`` and rate must
give the dense kernel's numbers: output, lse and the gradients wrt q, k, v
and bias, to float32 rounding. Run in Pallas's interpreter
(``interpret=True``) on small GQA shapes whose lengths are not whole blocks;
its Triton lowering with dropout is checked in ``tests/test_pallas_gpu.py``.

Shape glossary: B batch, N query heads, K key/value heads, T query length,
S key/value length, H head dim.
"""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp

import attention_jax as aj
from tests import _data

B, N, K, T, S, H = 2, 4, 2, 40, 48, 16  # GQA: 2 query heads per KV head
RATE = 0.3
# Triton's smallest tiles: 3 x 3 blocks, the last query block padded
# (T = 40 is not whole 16-blocks).
KERNEL = aj.kernels.PallasGpu(block_q=16, block_k=16, interpret=True)
# float32 throughout: the kernel sums the softmax and the dots block by
# block (online softmax) where the dense kernel sums whole rows, so results
# differ by rounding in the order of the sums; outputs and gradients here
# are O(1) sums of <= 48 terms, ~1e-6 apart (seen: <= 2e-6).
TOL = dict(atol=1e-5, rtol=1e-5)

# name -> (mask, whether a bias [B, N, T, S] is passed and differentiated)
CASES = {
    "causal": (lambda: aj.Mask(causal=True), False),
    # Every row sees a key (i - 16 + S - T < 37): no -inf lse in the loss.
    "window_lengths_bias": (
        lambda: aj.Mask(window=(16, 4), kv_lengths=jnp.array([48, 37])),
        True),
}


def _inputs(bias=False):
  qkv = (_data.normal(0, (B, N, T, H)), _data.normal(1, (B, K, S, H)),
         _data.normal(2, (B, K, S, H)))
  return qkv + ((_data.normal(7, (B, N, T, S)),) if bias else ())


def _loss(impl, mask, rate, seed, q, k, v, bias=None):
  """A loss with random cotangents for the output and the lse (the lse's
  cotangent enters the backward pass's ``D = rowsum(dO * O) - dlse``)."""
  out, lse = aj.scaled_dot_product_attention(
      q, k, v, mask, bias=bias, implementation=impl, dropout_rate=rate,
      # (no key with the Python rate 0: a key says dropout is on)
      dropout_rng=(None if isinstance(rate, float) and rate == 0.0
                   else jax.random.key(seed)),
      return_lse=True)
  loss = jnp.sum(out * _data.normal(3, out.shape)) + jnp.sum(
      lse * _data.normal(4, lse.shape))
  return loss, (out, lse)


def _grads(impl, mask, rate, seed, *args):
  """``(d/dq, d/dk, d/dv[, d/dbias]), (out, lse)``."""
  fn = lambda *a: _loss(impl, mask, rate, seed, *a)  # noqa: E731
  return jax.grad(fn, tuple(range(len(args))), has_aux=True)(*args)


class DropoutTest(parameterized.TestCase):

  @parameterized.named_parameters(*((name, name) for name in CASES))
  def test_matches_dense_kernel(self, name):
    make_mask, bias = CASES[name]
    mask, args = make_mask(), _inputs(bias)
    got = _grads(KERNEL, mask, RATE, 5, *args)
    want = _grads("dense", mask, RATE, 5, *args)
    chex.assert_trees_all_close(got, want, **TOL)
    # The dropout is on: without it the output is another one.
    _, (undropped, _) = _grads("dense", mask, 0.0, 5, *args)
    self.assertGreater(float(jnp.max(jnp.abs(got[1][0] - undropped))), 0.1)

  def test_traced_rate_under_jit(self):
    mask = CASES["causal"][0]()

    @jax.jit
    def run(rate, q, k, v):
      return _grads(KERNEL, mask, rate, 6, q, k, v)

    got = run(jnp.float32(RATE), *_inputs())
    want = _grads("dense", mask, RATE, 6, *_inputs())
    chex.assert_trees_all_close(got, want, **TOL)


if __name__ == "__main__":
  absltest.main()
