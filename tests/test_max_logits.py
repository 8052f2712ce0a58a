"""``return_max_logits=True``: each query row's largest raw logit.

``max_logits [..., T]`` is, per query row, the maximum of the raw scaled
logits ``scale * q . k`` over the keys the row may attend to (every mask
field; a ``-inf`` bias entry blocks like the mask), before the bias, any
score modifier and sinks; ``-inf`` for a row that sees nothing; no
gradient. The reference below writes that out in float64 NumPy from the
mask's definition (bottom-right causal and windows, lengths, segment ids),
never calling the library. The shared contract (``tests/contract.py``,
case ``max_logits_modified_patterned``) runs it on every kernel, ring on
4 devices included; this file covers what the contract does not: a bias,
the deferred-scale path, return orders, refusals, the automatic choice.

Shape glossary: B batch, N query heads, K key/value heads, T query length,
S key/value length, H head dim.
"""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

import attention_jax as aj
from attention_jax.kernels import base
from tests import _data

B, N, K, T, S, H = 2, 4, 2, 12, 20, 8  # GQA: 2 query heads per KV head
WINDOW = (6, 0)
KV_LENGTHS, Q_LENGTHS = (20, 13), (12, 9)
# Blocks of 4 x 5: 3 x 4 blocks, of which the window skips some (query block
# 0 sees keys [2, 11] only) and cuts others.
BLOCKS = aj.kernels.Flash(block_q=4, block_k=5)
CAP = 2.0  # the soft cap: raw logits above it must still be reported
# float32 logits are dots of H = 8 products: their rounding is ~1e-6 of
# |q||k| (~10 here); the reference is float64.
TOL = dict(atol=2e-5, rtol=2e-5)


def _segment_ids():
  """Query ids ``[B, T]`` and key ids ``[B, S]``; query 5 of example 0 has
  an id no key has (a row emptied by segments alone)."""
  q = np.stack([np.repeat([0, 1], [4, 8]), np.repeat([0, 1, 2], [3, 5, 4])])
  q[0, 5] = 7
  k = np.stack([np.repeat([0, 1], [10, 10]), np.repeat([0, 1, 2], [8, 6, 6])])
  return q.astype(np.int32), k.astype(np.int32)


def _mask():
  q_segment_ids, kv_segment_ids = _segment_ids()
  return aj.Mask(causal=True, window=WINDOW,
                 kv_lengths=jnp.array(KV_LENGTHS, jnp.int32),
                 q_lengths=jnp.array(Q_LENGTHS, jnp.int32),
                 q_segment_ids=jnp.asarray(q_segment_ids),
                 kv_segment_ids=jnp.asarray(kv_segment_ids))


def _allowed():
  """``[B, 1, T, S]``: query i may see key j, from the mask's definition."""
  i, j = np.arange(T)[:, None], np.arange(S)[None, :]
  position = i + (S - T)  # bottom-right alignment
  left, right = WINDOW
  allowed = (j <= position) & (j >= position - left) & (j <= position + right)
  allowed = np.broadcast_to(allowed, (B, T, S)).copy()
  allowed &= j[None] < np.array(KV_LENGTHS)[:, None, None]
  allowed &= i[None] < np.array(Q_LENGTHS)[:, None, None]
  q_segment_ids, kv_segment_ids = _segment_ids()
  allowed &= q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
  return allowed[:, None]


def _raw_logits(q, k):
  """Float64 ``q . k / sqrt(H)`` ``[B, N, T, S]``; query head n reads key
  head n // (N / K)."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  k = np.repeat(k, q.shape[1] // k.shape[1], axis=1)  # [B, N, S, H]
  return np.einsum("bnth,bnsh->bnts", q, k) / np.sqrt(q.shape[-1])


def _reference(q, k, allowed):
  """Each row's max raw logit where allowed; -inf where nothing is."""
  return np.where(allowed, _raw_logits(q, k), -np.inf).max(-1)


def _operands():
  q = 3.0 * _data.normal(0, (B, N, T, H))  # raw logits beyond the cap
  k = _data.normal(1, (B, K, S, H))
  v = _data.normal(2, (B, K, S, H))
  return q, k, v


def _modifiers(q, k):
  """A bias whose ``-inf`` hides one row's best key, ALiBi, a soft cap and
  sinks; and where the bias leaves keys visible."""
  allowed = np.broadcast_to(_allowed(), (B, N, T, S)).copy()
  bias = np.array(_data.normal(4, (1, N, T, S)))
  raw = np.where(allowed[:1], _raw_logits(q, k)[:1], -np.inf)
  best = int(np.argmax(raw[0, 1, 6]))  # example 0, head 1, query 6
  bias[0, 1, 6, best] = -np.inf  # now its second best is its max
  allowed[:, 1, 6, best] = False
  kw = dict(bias=jnp.asarray(bias), sinks=_data.normal(5, (N,)),
            score_mod=aj.chain(aj.alibi(0.5 * jnp.abs(_data.normal(6, (N,)))),
                               aj.soft_cap(CAP)))
  return kw, allowed


def _attend(kernel, q, k, v, kw):
  """``(out, lse, max_logits)`` through the kernel's public entry point."""
  if kernel == "flash":
    return aj.blockwise_attention(q, k, v, _mask(), block_q=BLOCKS.block_q,
                                  block_k=BLOCKS.block_k, return_lse=True,
                                  return_max_logits=True, **kw)
  return aj.scaled_dot_product_attention(
      q, k, v, _mask(), implementation=kernel, return_lse=True,
      return_max_logits=True, **kw)


class MaxLogitsTest(chex.TestCase):

  def _check(self, max_logits, allowed, q, k):
    want = _reference(q, k, allowed)
    chex.assert_shape(max_logits, (B, N, T))
    self.assertEqual(max_logits.dtype, jnp.float32)
    np.testing.assert_allclose(np.asarray(max_logits, np.float64), want,
                               **TOL)  # -inf in the same places
    # The test has teeth: rows emptied by lengths and by segments alone,
    # and raw maxima the soft cap would have cut.
    empty = ~np.broadcast_to(allowed, (B, N, T, S)).any(-1)
    self.assertTrue(empty[1, :, 9:].all() and empty[0, :, 5].all())
    self.assertTrue(np.isneginf(np.asarray(max_logits))[empty].all())
    self.assertGreater(want[np.isfinite(want)].max(), CAP + 1.0)

  @parameterized.named_parameters(
      ("dense_modified", "dense", True),
      ("blockwise_plain", "flash", False),  # the deferred-scale maxima
      ("blockwise_modified", "flash", True))  # a second carry
  def test_matches_reference(self, kernel, modified):
    q, k, v = _operands()
    kw, allowed = _modifiers(q, k) if modified else ({}, _allowed())
    out, lse, max_logits = jax.jit(
        lambda q, k, v, kw: _attend(kernel, q, k, v, kw))(q, k, v, kw)
    self._check(max_logits, allowed, q, k)
    chex.assert_shape((out, lse), [(B, N, T, H), (B, N, T)])

  def test_without_jit(self):
    q, k, v = _operands()
    _, _, max_logits = _attend("dense", q, k, v, {})
    self._check(max_logits, _allowed(), q, k)

  def test_gradients_unchanged_and_none_through_max_logits(self):
    # The contract checks the blockwise and ring gradients the same way
    # (max logits in its loss), against the float64 reference.
    q, k, v = _operands()

    def loss(q, k, v, with_max):
      result = aj.scaled_dot_product_attention(
          q, k, v, _mask(), implementation="dense",
          return_max_logits=with_max)
      if not with_max:
        return jnp.sum(result)
      out, max_logits = result
      finite = jnp.where(jnp.isfinite(max_logits), max_logits, 0.0)
      return jnp.sum(out) + 10.0 * jnp.sum(finite)  # adds no gradient

    grads = jax.jit(lambda q, k, v: [
        jax.grad(loss, (0, 1, 2))(q, k, v, flag) for flag in (True, False)])
    got, want = grads(q, k, v)
    # The same operations for the output; only XLA's fusion may differ.
    chex.assert_trees_all_close(got, want, atol=1e-6, rtol=1e-6)
    self.assertGreater(float(jnp.abs(want[0]).max()), 1e-3)

  def test_return_orders(self):
    q, k, v = (x[:, 0] for x in _operands())  # [B, T, H] / [B, S, H]

    @jax.jit
    def both(q, k, v):
      return (aj.scaled_dot_product_attention(
          q, k, v, _mask(), implementation="dense", return_weights=True,
          return_lse=True, return_max_logits=True),
              aj.scaled_dot_product_attention(  # automatic: dense here
                  q, k, v, _mask(), return_max_logits=True))

    (out, weights, lse, max_logits), (out2, max2) = both(q, k, v)
    chex.assert_shape((out, weights, lse, max_logits),
                      [(B, T, H), (B, T, S), (B, T), (B, T)])
    np.testing.assert_allclose(
        np.asarray(max_logits, np.float64),
        _reference(q[:, None], k[:, None], _allowed())[:, 0], **TOL)
    chex.assert_trees_all_close((out2, max2), (out, max_logits), atol=1e-6)

  def test_ring_and_blockwise_return_orders(self):
    # Their numbers: the contract (ring on 4 devices) and the tests above.
    q, k, v = _operands()
    mesh = jax.make_mesh((1,), ("seq",),
                         axis_types=(jax.sharding.AxisType.Auto,))
    seq = P(None, None, "seq")

    def ring(**kw):
      return jax.shard_map(
          lambda q, k, v: aj.ring_attention(q, k, v, axis_name="seq", **kw),
          mesh=mesh, in_specs=seq,
          out_specs=(seq,) * (1 + len(kw)))

    shapes = jax.eval_shape(ring(return_lse=True, return_max_logits=True),
                            q, k, v)  # traced, not compiled
    chex.assert_shape(shapes, [(B, N, T, H), (B, N, T), (B, N, T)])
    for fn in (ring(return_max_logits=True),
               lambda q, k, v: aj.blockwise_attention(
                   q, k, v, return_max_logits=True)):
      out, max_logits = jax.eval_shape(fn, q, k, v)
      chex.assert_shape((out, max_logits), [(B, N, T, H), (B, N, T)])
      self.assertEqual(max_logits.dtype, jnp.float32)

  def test_fused_kernels_refuse_and_the_automatic_choice_skips_them(self):
    def problem(t, s, **kw):
      q = jnp.zeros((1, 2, t, 8), jnp.bfloat16)
      k = jnp.zeros((1, 2, s, 8), jnp.bfloat16)
      return base.canonicalize(q, k, k, None, **kw)

    asked = problem(16, 16, return_max_logits=True)
    for kernel in (aj.kernels.Cudnn(), aj.kernels.Splash(interpret=True),
                   aj.kernels.PallasGpu(interpret=True)):
      self.assertIn("does not return max logits", kernel.supports(asked))
      self.assertNotIn("max logits", kernel.supports(problem(16, 16)) or "")
    for kernel in (aj.kernels.Dense(), aj.kernels.Flash()):
      self.assertIsNone(kernel.supports(asked))
    big = problem(1024, 1024, return_max_logits=True)  # where fused ones run
    chosen = aj.kernels.choose(aj.kernels.REGISTRY, big, automatic=True)
    self.assertEqual(chosen.name, "flash")

  def test_a_kernel_that_ignores_the_flag_is_an_error(self):
    class Ignoring(aj.kernels.Dense):
      name = "ignoring"

      def __call__(self, problem):
        return super().__call__(problem)._replace(max_logits=None)

    q, k, v = _operands()
    with self.assertRaisesRegex(TypeError, "'ignoring' was asked for "
                                "max_logits.*not declare return_max_logits"):
      jax.eval_shape(lambda q, k, v: aj.scaled_dot_product_attention(
          q, k, v, implementation=Ignoring(), return_max_logits=True),
                     q, k, v)

  def test_flag_must_be_a_python_bool(self):
    q, k, v = _operands()
    with self.assertRaisesRegex((TypeError, ValueError), "return_max_logits"):
      jax.eval_shape(lambda q, k, v: aj.scaled_dot_product_attention(
          q, k, v, return_max_logits="yes"), q, k, v)


if __name__ == "__main__":
  absltest.main()
