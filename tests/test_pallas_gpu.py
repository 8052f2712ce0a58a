"""The Pallas GPU kernel (``kernels/pallas_gpu.py``) beyond the contract.

No GPU here: its numbers are checked in Pallas's interpreter by the shared
contract suite (``tests/contract.py``), its dropout against the dense
kernel's in ``tests/test_pallas_gpu_dropout.py``. This file checks what a
GPU would meet first: that each pattern, and dropout, lowers to Triton
kernels (lowered for ``cuda`` from this CPU, never compiled or run), and
what ``supports`` refuses there, with the backend patched to ``gpu`` as in
the cuDNN wiring test.
"""

from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp

import attention_jax as aj
from attention_jax.kernels import base
from attention_jax.kernels import pallas_gpu
from tests import _data

B, N, K, T, S, H = 1, 2, 1, 64, 64, 16


def _qkv(dtype=jnp.bfloat16):
  return (_data.normal(0, (B, N, T, H), dtype),
          _data.normal(1, (B, K, S, H), dtype),
          _data.normal(2, (B, K, S, H), dtype))


def _on_gpu():
  return mock.patch.object(jax, "default_backend", return_value="gpu")


PATTERN_ARGS = {
    "causal_lengths_softcap_sinks": dict(
        mask=aj.Mask(causal=True, kv_lengths=jnp.array([40])),
        score_mod=aj.soft_cap(30.0), sinks=jnp.zeros((N,))),
    "window_segments": dict(
        mask=aj.Mask(window=(15, 3), q_segment_ids=jnp.zeros((B, T),
                                                             jnp.int32))),
    "dense_mask_bias": dict(
        mask=aj.Mask(dense=jnp.ones((B, 1, 1, S), bool)),
        bias=jnp.zeros((1, N, T, S), jnp.float32)),
    "block_mask_rule": dict(mask=aj.Mask(rule=aj.block_mask(
        aj.prefix_lm_mask_fn(20), T, S, block_q=16, block_k=16))),
}


PATTERNS = [(name, name) for name in PATTERN_ARGS]


class LoweringTest(parameterized.TestCase):

  @parameterized.named_parameters(*PATTERNS)
  def test_forward_and_backward_lower_to_triton(self, name):
    kw = PATTERN_ARGS[name]
    kernel = pallas_gpu.PallasGpu(block_q=16, block_k=16)

    def loss(q, k, v):
      out, lse = aj.scaled_dot_product_attention(
          q, k, v, implementation=kernel, return_lse=True, **kw)
      return jnp.sum(out.astype(jnp.float32)) + jnp.sum(
          jnp.where(jnp.isfinite(lse), lse, 0.0))

    with _on_gpu():
      text = jax.jit(jax.grad(loss, (0, 1, 2))).trace(*_qkv()).lower(
          lowering_platforms=("cuda",)).as_text()
    # One Triton kernel each: forward, dk/dv, dq.
    self.assertEqual(text.count("__gpu$xla.gpu.triton"), 3, text[:2000])

  def test_dropout_lowers_to_triton(self):
    # The keep mask is drawn inside each kernel (uint32 multiply, xor,
    # shift); the rate is traced here, as a jitted training step passes it.
    kernel = pallas_gpu.PallasGpu(block_q=16, block_k=16)

    def loss(q, k, v, rate):
      out = aj.scaled_dot_product_attention(
          q, k, v, implementation=kernel, dropout_rate=rate,
          dropout_rng=jax.random.key(0), **PATTERN_ARGS[
              "causal_lengths_softcap_sinks"])
      return jnp.sum(out.astype(jnp.float32))

    with _on_gpu():
      text = jax.jit(jax.grad(loss, (0, 1, 2))).trace(
          *_qkv(), jnp.float32(0.1)).lower(
              lowering_platforms=("cuda",)).as_text()
    self.assertEqual(text.count("__gpu$xla.gpu.triton"), 3, text[:2000])


class SupportsTest(chex.TestCase):

  def _problem(self, t=T, s=S, dtype=jnp.bfloat16, **kw):
    q = jnp.zeros((B, N, t, H), dtype)
    k = jnp.zeros((B, K, s, H), dtype)
    return base.canonicalize(q, k, k, kw.pop("mask", None), **kw)

  def test_needs_a_gpu_or_interpret(self):
    q, k, v = _qkv()
    with self.assertRaisesRegex(ValueError, "needs a GPU.*interpret=True"):
      aj.scaled_dot_product_attention(q, k, v,
                                      implementation=pallas_gpu.PallasGpu())
    interpreted = pallas_gpu.PallasGpu(interpret=True)
    self.assertIsNone(interpreted.supports(self._problem()))

  def test_refuses_what_has_no_triton_lowering(self):
    kernel = pallas_gpu.PallasGpu()
    with _on_gpu():
      self.assertIsNone(kernel.supports(self._problem(
          score_mod=aj.soft_cap(5.0))))
      reason = kernel.supports(self._problem(
          score_mod=aj.alibi(aj.alibi_slopes(N))))
      self.assertRegex(reason, "score_mod uses dynamic_slice.* Triton lowering lacks")
      odd = aj.ScoreMod(lambda s, b, h, q_idx, kv_idx, p: s + p.sum(),
                        jnp.ones((12,)))
      self.assertRegex(kernel.supports(self._problem(score_mod=odd)),
                       r"shape \(12,\); Triton's tensors have power-of-two")
      # A modifier whose VJP alone has no lowering rule (slice's transpose
      # pads) is refused too.
      first = aj.ScoreMod(lambda s, b, h, q_idx, kv_idx, p: s + p[0],
                          jnp.ones((4,)))
      self.assertRegex(kernel.supports(self._problem(score_mod=first)),
                       "score_mod uses .*slice.* Triton lowering lacks")
      reason = pallas_gpu.PallasGpu(block_q=24).supports(self._problem())
      self.assertRegex(reason, "block_q=24: Triton's blocks are powers of two")
      # A block mask at the flash core's sizes is rebuilt at Triton's.
      self.assertIsNone(kernel.supports(self._problem(mask=aj.Mask(
          rule=aj.block_mask(aj.prefix_lm_mask_fn(20), T, S, block_q=24,
                             block_k=8)))))
      self.assertRegex(kernel.supports(self._problem(return_weights=True)),
                       "never forms the attention weights")
      self.assertIsNone(kernel.supports(self._problem(
          dropout_rate=0.1, dropout_rng=jax.random.key(0))))

  def test_blocks_and_warps_follow_the_head_dim(self):
    self.assertEqual(pallas_gpu._launch(64, 4096, 4096), (128, 64, 4))
    self.assertEqual(pallas_gpu._launch(128, 4096, 4096), (64, 64, 8))
    self.assertEqual(pallas_gpu._launch(64, 40, 20), (64, 32, 4))

  def test_bad_configuration_named(self):
    with self.assertRaisesRegex(ValueError, "num_warps"):
      pallas_gpu.PallasGpu(num_warps=0)


if __name__ == "__main__":
  absltest.main()
