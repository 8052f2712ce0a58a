"""blockwise_attention and the implementation dispatch against references."""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax import kernels
from attention_jax.kernels import base
from tests import _data
from tests import reference

# Forward: float32 online softmax vs float64, sums over <= 70 keys: ~1e-6.
FWD_TOL = dict(atol=1e-5, rtol=1e-5)
# Gradients recompute P from the saved log-sum-exp and accumulate over blocks
# in float32: a few more roundings than the forward.
GRAD_TOL = dict(atol=5e-5, rtol=5e-5)
BLOCKS = dict(block_q=8, block_k=16)  # several blocks, ragged last ones


def _qkv(t, s, lead=(2, 3), kv_lead=None, h=8, hv=6, seed=0):
  kv_lead = lead if kv_lead is None else kv_lead
  return (_data.normal(seed, lead + (t, h)),
          _data.normal(seed + 1, kv_lead + (s, h)),
          _data.normal(seed + 2, kv_lead + (s, hv)))


def _length_mask(lengths, s):
  """``[B, 1]`` key lengths as a ``[B, 1, 1, S]`` mask for the reference."""
  return (np.arange(s)[None, :] < np.asarray(lengths)[:, :1])[:, None, None]


class BlockwiseTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
      ("square", 32, 32, False, False, None),
      ("odd_t_ne_s", 21, 37, False, True, None),
      ("causal_chunk", 13, 37, True, True, None),
      ("causal_more_queries", 37, 21, True, False, None),
      ("gqa_causal_lengths", 29, 29, True, True, (2, 1)),
      ("dense_mask", 19, 33, False, False, None),
  )
  def test_forward_and_grads_match_references(self, t, s, causal,
                                              use_lengths, kv_lead):
    q, k, v = _qkv(t, s, kv_lead=kv_lead)
    lengths = jnp.array([[s], [max(1, s - 11)]]) if use_lengths else None
    mask = None
    if self._testMethodName.find("dense_mask") >= 0:
      mask = _data.bernoulli(4, 0.7, (2, 1, t, s))
    ref_mask = None if lengths is None else _length_mask(lengths, s)
    if mask is not None:
      ref_mask = mask
    fn = self.variant(functools.partial(
        aj.blockwise_attention, is_causal=causal, **BLOCKS))
    pattern = aj.Mask(dense=mask, kv_lengths=lengths)
    out = fn(q, k, v, mask=pattern)
    ref, _ = reference.sdpa(q, k, v, ref_mask, is_causal=causal)
    chex.assert_shape(out, (2, 3, t, 6))
    chex.assert_trees_all_close(out, ref.astype(np.float32), **FWD_TOL)

    cot = _data.normal(9, out.shape)
    dense_mask = None if ref_mask is None else jnp.asarray(ref_mask)

    def ours(q, k, v):
      return jnp.sum(fn(q, k, v, mask=pattern) * cot)

    def dense(q, k, v):  # float64 dense attention (tested against NumPy)
      return jnp.sum(aj.scaled_dot_product_attention(
          q, k, v, dense_mask, is_causal=causal) * cot)

    got = jax.jit(jax.grad(ours, (0, 1, 2)))(q, k, v)
    with jax.enable_x64(True):
      want = jax.jit(jax.grad(dense, (0, 1, 2)))(
          *(np.asarray(x, np.float64) for x in (q, k, v)))
    chex.assert_tree_all_finite(got)
    chex.assert_trees_all_close(got, jax.tree.map(
        lambda x: np.asarray(x, np.float32), want), **GRAD_TOL)

  def test_bias_forward_and_gradient(self):
    q, k, v = _qkv(12, 20, lead=(1,))
    bias = _data.normal(5, (1, 12, 20))  # [1, T, S]: the logits' rank
    out = aj.blockwise_attention(q, k, v, bias=bias, **BLOCKS)
    ref, _ = reference.sdpa(q, k, v, bias=bias)
    chex.assert_trees_all_close(out, ref.astype(np.float32), **FWD_TOL)
    g_block = jax.jit(jax.grad(lambda b: aj.blockwise_attention(
        q, k, v, bias=b, **BLOCKS).sum()))(bias)
    g_dense = jax.jit(jax.grad(lambda b: aj.scaled_dot_product_attention(
        q, k, v, bias=b).sum()))(bias)
    chex.assert_trees_all_close(g_block, g_dense, **GRAD_TOL)

  def test_fully_masked_rows_are_zero_with_finite_grads(self):
    q, k, v = _qkv(9, 5, lead=(1,))  # causal, T > S: rows 0-3 see nothing
    out, lse = aj.blockwise_attention(q, k, v, is_causal=True,
                                      return_lse=True, block_q=4, block_k=2)
    np.testing.assert_array_equal(out[0, :4], 0.0)
    np.testing.assert_array_equal(lse[0, :4], -np.inf)
    grads = jax.jit(jax.grad(lambda q, k, v: aj.blockwise_attention(
        q, k, v, is_causal=True, block_q=4, block_k=2).sum(), (0, 1, 2)))(
            q, k, v)
    chex.assert_tree_all_finite(grads)
    np.testing.assert_array_equal(grads[0][0, :4], 0.0)

  def test_nan_in_padded_keys_does_not_leak(self):
    q, k, v = _qkv(10, 16, lead=(1,))
    lengths = jnp.array([11])
    k = k.at[0, 11:].set(jnp.nan)
    v = v.at[0, 11:].set(jnp.inf)
    fn = lambda q, k, v: aj.blockwise_attention(
        q, k, v, aj.Mask(kv_lengths=lengths), **BLOCKS)
    out = fn(q, k, v)
    ref, _ = reference.sdpa(q[:, :, :], k[:, :11], v[:, :11])
    chex.assert_trees_all_close(out, ref.astype(np.float32), **FWD_TOL)
    grads = jax.jit(jax.grad(lambda *a: fn(*a).sum(), (0, 1, 2)))(q, k, v)
    chex.assert_tree_all_finite(grads)

  def test_lse_matches_logsumexp(self):
    q, k, v = _qkv(7, 9, lead=(1,))
    _, lse = aj.blockwise_attention(q, k, v, return_lse=True, **BLOCKS)
    logits = np.einsum("bth,bsh->bts", q, k) / np.sqrt(8.0)
    want = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    chex.assert_trees_all_close(lse, want.astype(np.float32), **FWD_TOL)

  def test_bfloat16_close_to_float32_on_the_same_inputs(self):
    q, k, v = (x.astype(jnp.bfloat16) for x in _qkv(40, 40, lead=(1,)))
    out = aj.blockwise_attention(q, k, v, is_causal=True, **BLOCKS)
    ref = aj.blockwise_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                 is_causal=True, **BLOCKS)
    self.assertEqual(out.dtype, jnp.bfloat16)
    # Probabilities meet the values as bf16 (8-bit mantissa) with float32
    # accumulation: 2e-3 absolute (the bound the issue sets); on top, the
    # output itself is rounded to bf16 once (half an ulp, 2^-9 relative).
    chex.assert_trees_all_close(out.astype(jnp.float32), ref, atol=2e-3,
                                rtol=2.0**-8)

  def test_reruns_are_bitwise_identical(self):
    q, k, v = _qkv(30, 30)
    fn = jax.jit(functools.partial(aj.blockwise_attention, is_causal=True,
                                   **BLOCKS))
    np.testing.assert_array_equal(fn(q, k, v), fn(q, k, v))

  def test_invalid_inputs(self):
    q, k, v = _qkv(4, 4)
    with self.assertRaisesRegex(TypeError,
                                r"Mask's kv_lengths must be an integer"):
      aj.blockwise_attention(q, k, v, aj.Mask(kv_lengths=jnp.ones((2, 1))))
    with self.assertRaisesRegex(
        ValueError, r"leading.*the mask's kv_lengths \(4, 1\)"):
      aj.blockwise_attention(
          q, k, v, aj.Mask(kv_lengths=jnp.ones((4, 1), jnp.int32)))
    # [B] lengths now align to the left of the leading dims (per example):
    # 4 examples against a batch of 2 is a batch mismatch; more axes than
    # the leading dims are refused.
    with self.assertRaisesRegex(
        ValueError, r"leading.*do not broadcast.*the mask's kv_lengths"):
      aj.blockwise_attention(
          q, k, v, aj.Mask(kv_lengths=jnp.ones((4,), jnp.int32)))
    with self.assertRaisesRegex(
        ValueError, r"Mask's kv_lengths with shape \(2, 3, 1\) has 3 leading "
        r"axes, but the operands have 2 leading dims"):
      aj.blockwise_attention(
          q, k, v, aj.Mask(kv_lengths=jnp.ones((2, 3, 1), jnp.int32)))
    with self.assertRaisesRegex(ValueError, r"block_q must be positive"):
      aj.blockwise_attention(q, k, v, block_q=0)


class DispatchTest(chex.TestCase):

  @parameterized.named_parameters(
      ("weights_needed", 1024, True, 0.0, None, "dense"),
      ("small", 512, False, 0.0, None, "dense"),
      ("dropout", 1024, False, 0.1, None, "flash"),  # in the walk now
      ("long_no_weights", 1024, False, 0.0, None, "flash"),
      ("explicit", 8, False, 0.0, "flash", "flash"),
  )
  def test_choice(self, t, return_weights, rate, asked, expected):
    q = jnp.zeros((1, 2, t, 8), jnp.float32)
    problem = base.canonicalize(
        q, q, q, None, return_weights=return_weights, dropout_rate=rate,
        dropout_rng=jax.random.key(0) if rate > 0 else None,
        return_lse=False)
    candidates, automatic = kernels.candidates(asked)
    got = kernels.choose(candidates, problem, automatic)
    self.assertEqual(got.name, expected)  # on CPU: never cudnn

  def test_errors(self):
    q, k, v = _qkv(4, 4)
    with self.assertRaisesRegex(ValueError, r"implementation='cudnn' is not "
                                r"possible: it needs a GPU"):
      aj.scaled_dot_product_attention(q, k, v, implementation="cudnn")
    with self.assertRaisesRegex(ValueError, r"implementation='splash' is "
                                r"not possible: it has no dropout"):
      aj.scaled_dot_product_attention(
          q, k, v, implementation=aj.kernels.Splash(interpret=True),
          dropout_rate=0.1, dropout_rng=jax.random.key(0))
    with self.assertRaisesRegex(ValueError, r"implementation must be None, a "
                                r"kernel, a sequence of them, or one of"):
      aj.scaled_dot_product_attention(q, k, v, implementation="flashy")
    # (cuDNN says first that it needs a GPU, above.)
    with self.assertRaisesRegex(
        ValueError, r"implementation='flash' is not possible: it never forms "
        r"the attention weights"):
      aj.scaled_dot_product_attention(q, k, v, implementation="flash",
                                      return_weights=True)

  def test_paths_agree_in_functions_and_module(self):
    q, k, v = _qkv(24, 40, lead=(2, 4), kv_lead=(2, 1), hv=8)
    mask = _data.bernoulli(3, 0.8, (2, 1, 24, 40))
    dense = aj.scaled_dot_product_attention(q, k, v, mask, is_causal=True,
                                            implementation="dense")
    block = aj.scaled_dot_product_attention(
        q, k, v, mask, is_causal=True, implementation="flash")
    with self.assertRaisesRegex(ValueError, r"never forms the attention "
                                r"weights"):
      aj.scaled_dot_product_attention(q, k, v, mask, is_causal=True,
                                      implementation="flash",
                                      return_weights=True)
    chex.assert_trees_all_close(block, dense, **FWD_TOL)
    params = _data.params(aj.init_multi_head_params, 1, 16, 4, num_kv_heads=2)
    x = _data.normal(7, (2, 24, 16))
    outs = [aj.multi_head_attention(params, x, x, x, is_causal=True,
                                    attention_fn=impl)
            for impl in ("dense", "flash")]
    chex.assert_trees_all_close(outs[0], outs[1], **FWD_TOL)


if __name__ == "__main__":
  absltest.main()
