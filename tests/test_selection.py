"""Selections from data (``masking/selection.py``) beyond the contract.

The contract (``tests/contract.py``: the ``selected_*`` cases) checks
outputs, lse, gradients and forward mode of a selection in every kernel;
here: a selection of everything is the unselected call (property), the
flash walk visits exactly the selected blocks (the tables, and ``explain``'s
count), the top-k helpers against NumPy, and the refusals.
"""

from absl.testing import absltest
import chex
import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.masking import selection
from tests import _data

B, N, K, H = 2, 4, 2, 8


def _qkv(t, s, seed=0):
  return (_data.normal(seed, (B, N, t, H)), _data.normal(seed + 1, (B, K, s, H)),
          _data.normal(seed + 2, (B, K, s, H)))


class EverythingSelectedTest(chex.TestCase):
  """Selecting every block (or every token) changes nothing."""

  @hypothesis.settings(max_examples=3, deadline=None, derandomize=True)
  @hypothesis.given(t=st.integers(1, 24), extra=st.integers(0, 12),
                    key_block=st.sampled_from([1, 3, 4, 8]),
                    query_block=st.sampled_from([1, 2, 5]),
                    causal=st.booleans())
  def test_all_blocks_equal_the_unselected_call(self, t, extra, key_block,
                                                query_block, causal):
    s = t + extra
    q, k, v = _qkv(t, s)
    chosen = jnp.ones((B, K, -(-t // query_block), -(-s // key_block)), bool)
    sel = aj.select_blocks(chosen, q_len=t, kv_len=s, key_block=key_block,
                           query_block=query_block, group=N // K)
    flash = aj.kernels.Flash(block_q=sel.block_q, block_k=sel.block_k)
    plain = aj.scaled_dot_product_attention(
        q, k, v, aj.Mask(causal=causal), implementation=flash,
        return_lse=True)
    got = aj.scaled_dot_product_attention(
        q, k, v, aj.Mask(causal=causal, rule=sel), implementation=flash,
        return_lse=True)
    # The same walk over the same blocks (full ones stay full): equal up
    # to the order XLA sums in (a few float32 roundings).
    for a, b in zip(got, plain):
      np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)

  def test_all_tokens_equal_the_unselected_call(self):
    t, s = 12, 17
    q, k, v = _qkv(t, s, seed=3)
    every = jnp.broadcast_to(jnp.arange(s), (B, 1, t, s))
    sel = aj.select_tokens(every, kv_len=s, block_q=4, block_k=8)
    mask = aj.Mask(causal=True, kv_lengths=jnp.array([17, 9]))
    for kernel in ("dense", aj.kernels.Flash(block_q=4, block_k=8)):
      plain = aj.scaled_dot_product_attention(q, k, v, mask,
                                              implementation=kernel)
      got = aj.scaled_dot_product_attention(
          q, k, v, mask & aj.Mask(rule=sel), implementation=kernel)
      np.testing.assert_allclose(got, plain, rtol=1e-6, atol=1e-6)


class WalkTest(chex.TestCase):
  """The flash walk visits the selected blocks and no others."""

  def test_tables_are_the_selection(self):
    t, s, bq, c = 32, 48, 8, 8
    chosen = np.asarray(_data.normal(5, (B, K, t // bq, s // c)) > 0.5)
    sel = aj.select_blocks(jnp.asarray(chosen), q_len=t, kv_len=s,
                           key_block=c, query_block=bq, group=N // K,
                           block_q=bq)
    kinds = np.asarray(sel.kinds)  # [B, N, nq, nk]: one table per head
    self.assertEqual(kinds.shape, (B, N, t // bq, s // c))
    want = np.repeat(chosen, N // K, axis=1)
    np.testing.assert_array_equal(kinds != aj.kernels.base.intervals.EMPTY,
                                  want)
    # A whole selected block is full (no mask pass) unless causality cuts.
    np.testing.assert_array_equal(kinds == aj.kernels.base.intervals.FULL,
                                  want)

  def test_explain_counts_only_selected_blocks(self):
    t = s = 64
    bq = c = 8
    q, k, v = _qkv(t, s)
    nq = nk = t // bq
    # Each query block reads its own block and block 0: 2 of the causal
    # blocks (1 for the first).
    chosen = (np.eye(nq, nk, dtype=bool) | (np.arange(nk) == 0))[None, None]
    chosen = np.broadcast_to(chosen, (B, K, nq, nk))
    sel = aj.select_blocks(jnp.asarray(chosen), q_len=t, kv_len=s,
                           key_block=c, query_block=bq, group=N // K,
                           block_q=bq)
    why = aj.explain(q, k, v, aj.Mask(causal=True, rule=sel),
                     implementation=aj.kernels.Flash(block_q=bq, block_k=c))
    visited = why.full + why.partial
    self.assertEqual(visited, B * N * (2 * nq - 1))
    self.assertEqual(why.partial, B * N * nq)  # the diagonal blocks


class ExactTablesTest(chex.TestCase):
  """Rows of a kernel block's size choosing whole kernel blocks: the flash
  walk follows the tables alone (no rule evaluated, no per-block branch)
  and must still equal the dense kernel, which evaluates the rule."""

  def test_whole_blocks_equal_dense_in_every_mode(self):
    t = s = 40
    bq, c, bk = 8, 8, 4  # a selected block is two kernel key blocks
    q, k, v = _qkv(t, s, seed=9)
    nqs = nks = t // bq
    # Per key/value head: the own block and random past ones; a window of
    # 17 cuts blocks at both ends of each row's range (masked, full and
    # masked again), key lengths and sinks too.
    past = np.tril(np.ones((nqs, nks), bool))
    chosen = (np.asarray(_data.normal(10, (B, K, nqs, nks))) > 0) & past
    chosen |= np.eye(nqs, nks, dtype=bool)
    sel = aj.select_blocks(jnp.asarray(chosen), q_len=t, kv_len=s,
                           key_block=c, query_block=bq, group=N // K,
                           block_q=bq, block_k=bk)
    self.assertTrue(selection.exact_tables(sel))
    mask = aj.Mask(causal=True, window=(17, 0),
                   kv_lengths=jnp.array([40, 29]), rule=sel)
    sinks = _data.normal(11, (N,))
    cot = _data.normal(12, (B, N, t, H))
    tangents = tuple(_data.normal(13 + i, x.shape)
                     for i, x in enumerate((q, k, v)))

    def run(kernel):
      def attend(q, k, v):
        return aj.scaled_dot_product_attention(
            q, k, v, mask, sinks=sinks, implementation=kernel,
            return_lse=True)
      (out, lse), pull = jax.vjp(attend, q, k, v)
      grads = pull((cot, jnp.zeros_like(lse)))
      _, (d_out, d_lse) = jax.jvp(attend, (q, k, v), tangents)
      return out, lse, grads, d_out, d_lse

    got = jax.jit(lambda: run(aj.kernels.Flash(block_q=bq, block_k=bk)))()
    want = jax.jit(lambda: run("dense"))()
    # float32 both ways, sums of at most 40 terms in another order.
    chex.assert_trees_all_close(got, want, atol=2e-5, rtol=2e-5)

  def test_rows_finer_than_a_kernel_block_are_not_exact(self):
    chosen = jnp.ones((4, 2), bool)
    sel = aj.select_blocks(chosen, q_len=16, kv_len=16, key_block=8,
                           query_block=4, block_q=8)
    self.assertFalse(selection.exact_tables(sel))


class PagedStepTest(chex.TestCase):
  """A decoding step over a paged cache reads only the selected pages."""

  def test_a_key_selection_over_pages(self):
    z, m, t = 4, 6, 1  # page size, pages a sequence may hold, new tokens
    s = z * m
    lengths = np.array([20, 13])
    keys, values = (_data.normal(20 + i, (B, K, 20, H)) for i in range(2))
    cache = aj.paged_cache.append(
        aj.init_paged_cache(16, z, K, H, batch_size=B, max_pages=m),
        keys, values, new_lengths=jnp.asarray(lengths))
    q = _data.normal(22, (B, N, t, H))
    chosen = np.asarray(_data.normal(23, (B, K, 1, m)) > 0)  # per KV head
    sel = aj.select_blocks(jnp.asarray(chosen), q_len=t, kv_len=s,
                           key_block=z, query_block=t, group=N // K,
                           block_q=t, block_k=z)
    out = aj.paged_attention(q, cache, aj.Mask(causal=True, rule=sel),
                             implementation="flash")
    # float64: the step's query at position length - 1 over the keys it
    # holds, in the chosen pages of its key/value head.
    allowed = (np.arange(s) < lengths[:, None])[:, None, None] & np.repeat(
        chosen, N // K, 1)[..., np.arange(s) // z]  # [B, N, 1, S]
    pad = lambda x: np.pad(np.repeat(np.asarray(x, np.float64), N // K, 1),  # noqa: E731
                           ((0, 0), (0, 0), (0, s - 20), (0, 0)))
    logits = np.einsum("bnth,bnsh->bnts", np.asarray(q, np.float64),
                       pad(keys)) / np.sqrt(H)
    logits = np.where(allowed, logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    want = np.einsum("bnts,bnsh->bnth", weights / weights.sum(-1, keepdims=True),
                     pad(values))
    np.testing.assert_allclose(out, want, atol=1e-6)  # float32 sums of 24
    # The walk follows the tables: with every block marked empty it reads
    # no page at all (output 0), though the rule would allow them.
    kinds, kv_indices, kv_full, q_indices, q_full = sel.tables
    none = sel.with_tables((jnp.zeros_like(kinds), jnp.full_like(kv_indices, m),
                            kv_full & False, jnp.full_like(q_indices, 1),
                            q_full & False))
    out = aj.paged_attention(q, cache, aj.Mask(causal=True, rule=none),
                             implementation="flash")
    np.testing.assert_array_equal(out, 0.0)

  def test_only_a_key_selection_stands_at_positions(self):
    key_rows = aj.select_blocks(jnp.ones((1, 3), bool), q_len=4, kv_len=12,
                                key_block=4, query_block=4)
    aj.Mask(rule=key_rows, q_offset=3)  # one row for every query: taken
    with self.assertRaisesRegex(ValueError, r"BlockMask"):
      aj.Mask(rule=key_rows, q_offset=3, kv_offset=2)  # keys moved
    with self.assertRaisesRegex(ValueError, r"block_k = 8"):
      cache = aj.init_paged_cache(8, 8, 1, 4, batch_size=1, max_pages=2)
      aj.paged_attention(jnp.ones((1, 1, 1, 4)), cache, aj.Mask(
          rule=aj.select_blocks(jnp.ones((1, 4), bool), q_len=1, kv_len=16,
                                key_block=4, query_block=1, block_q=1)),
          implementation="flash")


class TopKTest(chex.TestCase):

  def test_top_k_mask_and_indices_against_numpy(self):
    scores = np.array([[3., 1., 3., -np.inf, 2.],
                       [-np.inf, -np.inf, 0., -np.inf, -np.inf]], np.float32)
    mask = np.asarray(aj.top_k_mask(jnp.asarray(scores), 2))
    # ties go to the lower index; -inf is never chosen (row 2 has one).
    np.testing.assert_array_equal(mask, [[1, 0, 1, 0, 0], [0, 0, 1, 0, 0]])
    idx = np.asarray(aj.top_k_indices(jnp.asarray(scores), 2))
    np.testing.assert_array_equal(idx, [[0, 2], [2, -1]])
    np.testing.assert_array_equal(
        np.asarray(aj.top_k_mask(jnp.asarray(scores), 9)),
        np.isfinite(scores))

  def test_no_gradient_through_the_choice(self):
    g = jax.grad(lambda x: jnp.sum(
        aj.top_k_mask(x, 2) * x))(jnp.array([1., 3., 2.]))
    np.testing.assert_array_equal(g, [0., 1., 1.])  # only the product's


class RefusalTest(chex.TestCase):

  def test_bad_selections_are_refused_by_name(self):
    ok = jnp.ones((B, K, 4, 3), bool)
    with self.assertRaisesRegex(TypeError, r"chosen must be a bool"):
      aj.select_blocks(ok.astype(jnp.int32), q_len=4, kv_len=12, key_block=4)
    with self.assertRaisesRegex(ValueError, r"\[4, 6\]"):
      aj.select_blocks(ok, q_len=4, kv_len=24, key_block=4)
    with self.assertRaisesRegex(ValueError, r"block_k=3 must divide"):
      aj.select_blocks(ok, q_len=4, kv_len=12, key_block=4, block_k=3)
    with self.assertRaisesRegex(ValueError, r"no head axis"):
      aj.select_blocks(jnp.ones((B, 4, 3), bool), q_len=4, kv_len=12,
                       key_block=4, group=2)
    with self.assertRaisesRegex(ValueError, r"at most two"):
      aj.select_blocks(jnp.ones((1, B, K, 4, 3), bool), q_len=4, kv_len=12,
                       key_block=4)
    with self.assertRaisesRegex(TypeError, r"indices must be integer"):
      aj.select_tokens(jnp.ones((4, 2)), kv_len=8)

  def test_a_selection_at_positions_is_refused(self):
    sel = aj.select_blocks(jnp.ones((4, 3), bool), q_len=4, kv_len=12,
                           key_block=4)
    with self.assertRaisesRegex(ValueError, r"BlockMask"):
      aj.Mask(rule=sel, q_offset=3)

  def test_a_selection_in_a_cached_step_is_refused(self):
    # Its rows are the call's rows; a cache step's queries stand at
    # positions (a prefill at an offset would read the wrong rows).
    layer = aj.MultiHeadAttention(8, 2, rngs=__import__("flax").nnx.Rngs(0))
    layer.init_cache(1, 16)
    x = _data.normal(7, (1, 4, 8))
    sel = aj.select_blocks(jnp.ones((4, 2), bool), q_len=4, kv_len=16,
                           key_block=8)
    with self.assertRaisesRegex(ValueError, r"holds a selection"):
      layer(x, decode=True, mask=aj.Mask(rule=sel))


if __name__ == "__main__":
  absltest.main()
