"""Mask rules from traced data: per-example prefix-LM under jit.

``aj.prefix_lm_mask_fn(lengths)`` with per-example prefix lengths computed
inside ``jax.jit`` builds a ``BlockMask`` whose per-example block tables are
classified on device; dense and blockwise attention (and their gradients)
must equal a float64 NumPy reference written from the rule, and the tables
must list exactly the non-empty blocks (what the kernels visit). Ring
attention runs the same rule in ``tests/multidevice/test_ring.py``.
"""

import functools

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from tests import _data
from tests import reference

B, N, T, H = 2, 2, 24, 8
BQ = BK = 4


def _allowed(prefix):
  """``[B, 1, T, T]``: key j visible to query i iff j < prefix[b] or j <= i."""
  i, j = np.arange(T)[:, None], np.arange(T)[None, :]
  return np.stack([(j < p) | (j <= i) for p in prefix])[:, None]


def _attend(q, k, v, prefix, implementation):
  bm = aj.block_mask(aj.prefix_lm_mask_fn(prefix), T, T, batch=(B, 1),
                     block_q=BQ, block_k=BK)
  out = aj.scaled_dot_product_attention(q, k, v, bm,
                                        implementation=implementation)
  return out, bm


class TracedPrefixLMTest(absltest.TestCase):

  def test_outputs_gradients_and_tables_under_jit(self):
    q, k, v = (_data.normal(i, (B, N, T, H)) for i in (60, 61, 62))
    cot = _data.normal(63, (B, N, T, H))
    prefix = np.array([5, 14])  # per example, traced below
    allowed = _allowed(prefix)
    want, _ = reference.sdpa(q, k, v, allowed)

    def loss(q, k, v, p, implementation):
      return jnp.sum(_attend(q, k, v, p, implementation)[0] * cot)

    with jax.enable_x64(True):
      ref_grads = jax.grad(lambda q, k, v: jnp.sum(jnp.einsum(
          "BNTS,BNSH->BNTH", jnp.where(allowed, jax.nn.softmax(jnp.where(
              allowed, jnp.einsum("BNTH,BNSH->BNTS", q, k) / np.sqrt(H),
              -jnp.inf), -1), 0.0), v) * cot), (0, 1, 2))(
                  *(np.asarray(x, np.float64) for x in (q, k, v)))
    for implementation in ("dense", "flash"):
      run = jax.jit(functools.partial(_attend, implementation=implementation))
      out, bm = run(q, k, v, jnp.asarray(prefix))
      # float32 against float64 over <= 24 keys: 1e-5.
      np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5,
                                 err_msg=implementation)
      grads = jax.jit(jax.grad(loss, (0, 1, 2)), static_argnums=4)(
          q, k, v, jnp.asarray(prefix), implementation)
      for name, g, w in zip(("dq", "dk", "dv"), grads, ref_grads):
        np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5,
                                   err_msg=f"{implementation} {name}")

    # The tables, computed on device, are the brute-force classification
    # per example, and each query block lists exactly its non-empty blocks.
    kinds = np.asarray(bm.kinds)
    self.assertEqual(kinds.shape, (B, 1, T // BQ, T // BK))
    blocks = allowed[:, 0].reshape(B, T // BQ, BQ, T // BK, BK)
    brute = np.where(blocks.all((2, 4)), 2, np.where(blocks.any((2, 4)), 1, 0))
    np.testing.assert_array_equal(kinds[:, 0], brute)
    self.assertGreater(int((kinds == 0).sum()), 0)  # there is work to skip
    listed = np.asarray(bm.kv_indices)[:, 0]
    for b in range(B):
      for i in range(T // BQ):
        row = listed[b, i]
        np.testing.assert_array_equal(row[row < T // BK],
                                      np.flatnonzero(brute[b, i]))

  def test_a_rule_per_example_and_head(self):
    # A MaskRule reading a [B, N] table: a window per (example, head).
    q, k, v = (_data.normal(i, (B, N, T, H)) for i in (64, 65, 66))
    widths = jnp.array([[1, 3], [6, 2]])

    def local(b, h, q_idx, kv_idx, w):
      return (kv_idx <= q_idx) & (kv_idx >= q_idx - w[b, h])

    @jax.jit
    def run(w):
      bm = aj.block_mask(aj.MaskRule(local, w), T, T, batch=(B, N),
                         block_q=BQ, block_k=BK)
      return aj.blockwise_attention(q, k, v, bm)

    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    allowed = np.stack([np.stack([(j <= i) & (j >= i - int(w)) for w in row])
                        for row in np.asarray(widths)])
    want, _ = reference.sdpa(q, k, v, allowed)
    np.testing.assert_allclose(run(widths), want, atol=1e-5, rtol=1e-5)


class RuleCoverageTest(absltest.TestCase):

  def test_tables_built_for_fewer_heads_than_the_rule_reads_are_refused(self):
    # Tables for (b, h) = (0, 0) only, trusted for every head, would skip
    # blocks other heads need: refused at the call, naming the fix.
    q = _data.normal(67, (B, N, T, H))
    rule = aj.MaskRule(lambda b, h, qi, ki, w: (ki <= qi) & (ki >= qi - w[b, h]),
                       jnp.array([[1, 3], [6, 2]]))
    for batch, axis in (((), "b"), ((B, 1), "h")):
      bm = aj.block_mask(rule, T, T, batch=batch, block_q=BQ, block_k=BK)
      with self.assertRaisesRegex(ValueError, rf"depends on leading axis .*"
                                  rf"{axis}\).*batch=\({B}, {N}\)"):
        aj.blockwise_attention(q, q, q, bm)

  def test_jnp_rules_and_traced_scalar_prefixes_under_jit(self):
    # A rule written with jnp (traced inside jit though it closes over no
    # traced value) and one traced prefix length for every example.
    q = _data.normal(68, (B, N, T, H))
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]

    @jax.jit
    def run(p):
      band = aj.block_mask(lambda b, h, qi, ki: jnp.abs(qi - ki) < 3, T, T,
                           block_q=BQ, block_k=BK)
      prefix = aj.block_mask(aj.prefix_lm_mask_fn(p), T, T, block_q=BQ,
                             block_k=BK)
      return (aj.blockwise_attention(q, q, q, band),
              aj.blockwise_attention(q, q, q, prefix))

    band, prefix = run(jnp.int32(7))
    for got, allowed in ((band, np.abs(i - j) < 3), (prefix, (j < 7) | (j <= i))):
      want, _ = reference.sdpa(q, q, q, allowed[None, None])
      np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


if __name__ == "__main__":
  absltest.main()
