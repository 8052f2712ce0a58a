"""MoBA (Lu et al. 2025) against a float64 NumPy reference from the paper.

The reference (``_reference``) follows the paper's text, not the library's
code: keys cut into blocks of ``c``; query ``t`` at position ``p`` scores
block ``m`` by ``q_t . mean(K_m)`` (its key/value head's keys, the real
ones only); it reads its own block ``p // c`` and the ``top_k - 1`` past
blocks of highest score (ties to the lower index), never a future one,
causally; softmax over the chosen keys. The dense and flash kernels must
give its outputs, lse and gradients (those against the same softmax in
float64 over the reference's choice: the choice is not differentiated);
GQA, a chunk of queries over a longer prefix (T != S), kv_lengths (per
example and per head), top_k covering every block (= causal attention),
the layer (MultiHeadAttention with moba_attention_fn, decoding from a KV
cache equal to the whole call) and the refusals. The query-block variant
(rows of ``query_block`` queries choosing by their mean query, not in the
paper) has the same reference with a row's mean in place of a query.
"""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.layers import moba
from tests import _data

# float32 kernels against float64: sums of at most 16 products of unit
# normals, so errors stay near 1e-6; 3e-5 leaves room for the flash
# kernel's blockwise rescaling (rounded once per visited block).
TOL = dict(atol=3e-5, rtol=3e-5)
# The float32 gate must rank blocks as the float64 one does: the test data
# keeps every chosen block this far above the best one left out (gates of
# size ~1 round at ~1e-7 in float32).
MARGIN = 1e-4


def is_exhaustive(test_name: str) -> bool:
  """conftest's hook: what repeats a default check on another kernel, at
  more shapes or through the layer (each compiles anew: 2-5 CPU-seconds;
  the default run keeps the flash kernel against the reference, a dense
  chunk and decoding step, the property, the ties and the refusals)."""
  return test_name in (
      "test_matches_reference_dense",
      "test_matches_reference_exhaustive_dense",
      "test_matches_reference_exhaustive_flash",
      "test_key_padding_dense_equals_kv_lengths",
      "test_query_blocks_match_reference_dense",
      "test_query_blocks_over_a_longer_prefix",
      "test_decoding_equals_the_whole_call",
      "test_a_left_padded_example_decodes_as_its_tokens_alone",
      "test_module_gradients",
      "test_caches_without_positions_in_order_are_refused",
  )


def _reference(q, k, v, *, block, top_k, scale=None, kv_lengths=None,
               query_block=1):
  """MoBA in float64 from the paper: ``(out, lse, chosen, allowed,
  margin)``; ``chosen`` ``[B, N, nqs, nks]`` (a row per query, or per
  ``query_block`` queries scored by their mean query), ``allowed``
  ``[B, N, T, S]``, ``margin`` the smallest gap between a chosen past
  block's score and the best unchosen one's (how safely float32 ranks the
  same)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b_, n_, t_, h_ = q.shape
  kh, s_ = k.shape[1], k.shape[2]
  g = n_ // kh
  nks = -(-s_ // block)
  scale = 1 / np.sqrt(h_) if scale is None else scale
  lengths = np.broadcast_to(
      np.reshape(s_ if kv_lengths is None else np.asarray(kv_lengths),
                 (-1, 1) if np.ndim(kv_lengths) < 2 else np.shape(kv_lengths)),
      (b_, n_))
  nqs = -(-t_ // query_block)
  chosen = np.zeros((b_, n_, nqs, nks), bool)
  allowed = np.zeros((b_, n_, t_, s_), bool)
  out = np.zeros(q.shape[:3] + v.shape[3:])
  lse = np.full((b_, n_, t_), -np.inf)
  margin = np.inf
  for b in range(b_):
    for n in range(n_):
      keys, values = k[b, n // g], v[b, n // g]
      real = [[j for j in range(m * block, min((m + 1) * block, s_))
               if j < lengths[b, n]] for m in range(nks)]
      for r in range(nqs):
        rows = range(r * query_block, min((r + 1) * query_block, t_))
        # Bottom-right: the last query meets the last key; a row lies in
        # the block of its first query.
        own = (rows[0] + s_ - t_) // block
        past = [m for m in range(own) if real[m]]
        query = q[b, n, list(rows)].mean(0)
        score = {m: query @ keys[real[m]].mean(0) for m in past}
        ranked = sorted(past, key=lambda m: (-score[m], m))
        picked = ranked[:top_k - 1]
        if picked and len(ranked) > len(picked):
          margin = min(margin, score[picked[-1]] - score[ranked[len(picked)]])
        for m in [own] + picked:
          chosen[b, n, r, m] = True
      for t in range(t_):
        p = t + s_ - t_
        cols = [j for j in range(s_) if j <= p and j < lengths[b, n]
                and chosen[b, n, t // query_block, j // block]]
        allowed[b, n, t, cols] = True
        if cols:
          logits = scale * keys[cols] @ q[b, n, t]
          top = logits.max()
          w = np.exp(logits - top)
          out[b, n, t] = w @ values[cols] / w.sum()
          lse[b, n, t] = top + np.log(w.sum())
  return out, lse, chosen, allowed, margin


def _reference_grads(q, k, v, allowed, cot, scale=None):
  """d sum(out * cot) / d(q, k, v) in float64, the choice held fixed."""
  h = q.shape[-1]
  scale = 1 / np.sqrt(h) if scale is None else scale
  g = q.shape[1] // k.shape[1]

  def attend(q, k, v):
    k, v = (jnp.repeat(x, g, axis=1) for x in (k, v))
    logits = jnp.einsum("BNTH,BNSH->BNTS", q, k) * scale
    w = jax.nn.softmax(jnp.where(allowed, logits, -jnp.inf), -1)
    w = jnp.where(allowed.any(-1, keepdims=True), w, 0.0)
    return jnp.sum(jnp.einsum("BNTS,BNSH->BNTH", w, v) * cot)

  with jax.enable_x64(True):
    grads = jax.grad(attend, (0, 1, 2))(
        *(np.asarray(x, np.float64) for x in (q, k, v)))
    return [np.asarray(x) for x in grads]


@functools.partial(jax.jit, static_argnames=("block", "top_k",
                                             "implementation", "query_block"))
def _run(q, k, v, cot, kv_lengths, *, block, top_k, implementation,
         query_block=1):
  """Outputs, lse, the gradient of ``sum(out * cot)`` and the chosen
  blocks, one compile."""
  mask = aj.Mask(causal=True, kv_lengths=kv_lengths)

  def attend(q, k, v):
    return aj.moba_attention(q, k, v, mask, block=block, top_k=top_k,
                             implementation=implementation, return_lse=True,
                             query_block=query_block)

  (out, lse), pull = jax.vjp(attend, q, k, v)
  chosen = moba.moba_selection(q, k, mask, block=block, top_k=top_k,
                               query_block=query_block)
  return out, lse, pull((cot, jnp.zeros_like(lse))), chosen


def _inputs(seed, b, n, kh, t, s, h):
  q = _data.normal(seed, (b, n, t, h))
  k = _data.normal(seed + 1, (b, kh, s, h))
  v = _data.normal(seed + 2, (b, kh, s, h))
  cot = _data.normal(seed + 3, (b, n, t, h))
  return q, k, v, cot


class MobaAttentionTest(parameterized.TestCase):

  def _check(self, implementation, *, b, n, kh, t, s, h, block, top_k,
             kv_lengths, seed=0, query_block=1):
    q, k, v, cot = _inputs(seed, b, n, kh, t, s, h)
    want, want_lse, chosen, allowed, margin = _reference(
        q, k, v, block=block, top_k=top_k, kv_lengths=kv_lengths,
        query_block=query_block)
    self.assertGreater(margin, MARGIN)  # the data ranks blocks clearly
    # The choice leaves blocks out (else this is plain causal attention).
    self.assertLess(chosen.sum(-1).max(), -(-s // block))
    out, lse, grads, got_chosen = _run(
        q, k, v, cot, jnp.asarray(kv_lengths), block=block, top_k=top_k,
        implementation=implementation, query_block=query_block)
    np.testing.assert_array_equal(got_chosen, chosen)
    chex.assert_trees_all_close(out, want, **TOL)
    seen = allowed.any(-1)  # rows that see no key: lse -inf
    chex.assert_trees_all_close(np.where(seen, lse, 0), np.where(
        seen, want_lse, 0), **TOL)
    self.assertTrue(np.all(np.isneginf(np.asarray(lse)[~seen])))
    for got, ref in zip(grads, _reference_grads(q, k, v, allowed, cot)):
      chex.assert_trees_all_close(got, ref, **TOL)

  @parameterized.named_parameters(("_dense", "dense"), ("_flash", "flash"))
  def test_matches_reference(self, implementation):
    # GQA (N=4 over K=2), T=S=14 (a partial last block of 2), blocks of 4,
    # top 2; example 1 padded to 9 keys (a block partly padding, one
    # wholly).
    self._check(implementation, b=2, n=4, kh=2, t=14, s=14, h=8, block=4,
                top_k=2, kv_lengths=np.array([14, 9]))

  @parameterized.named_parameters(("_dense", "dense"), ("_flash", "flash"))
  def test_matches_reference_exhaustive(self, implementation):
    # A chunk of 6 queries over 19 keys (T != S), per-head lengths, top 3.
    self._check(implementation, b=2, n=2, kh=1, t=6, s=19, h=4, block=3,
                top_k=3, kv_lengths=np.array([[19, 12], [17, 19]]), seed=7)

  @parameterized.named_parameters(("_flash", "flash"), ("_dense", "dense"))
  def test_query_blocks_match_reference(self, implementation):
    # Rows of 4 queries choose together by their mean query: GQA, T=S=26
    # (a last row of 2, a partial last block), blocks of 8, top 2, example
    # 1 padded to 19 keys.
    self._check(implementation, b=2, n=4, kh=2, t=26, s=26, h=8, block=8,
                top_k=2, kv_lengths=np.array([26, 19]), query_block=4,
                seed=30)

  def test_query_blocks_over_a_longer_prefix(self):
    # A chunk of 8 queries over 24 keys: rows start at S - T = 16 + 4r.
    self._check("flash", b=1, n=2, kh=1, t=8, s=24, h=4, block=8, top_k=2,
                kv_lengths=np.array([24]), query_block=4, seed=31)

  def test_query_blocks_leave_padded_queries_out_of_the_gate(self):
    # q_lengths = 10 of 16: the row of queries 8..11 scores by the mean of
    # 8 and 9 alone, whatever the padding holds (NaN, or large values that
    # would move its mean); the last row, all padding, reads its own block.
    q, k, v, _ = _inputs(33, 1, 2, 1, 16, 16, 4)
    mask = aj.Mask(causal=True, q_lengths=jnp.array([10]))
    run = jax.jit(lambda q: (
        aj.moba_attention(q, k, v, mask, block=4, top_k=2, query_block=4,
                          implementation="dense"),
        moba.moba_selection(q, k, mask, block=4, top_k=2, query_block=4)))
    out_nan, chosen_nan = run(q.at[:, :, 10:].set(jnp.nan))
    out_big, chosen_big = run(q.at[:, :, 10:].set(100 * q[:, :, :6]))
    np.testing.assert_array_equal(chosen_nan, chosen_big)
    np.testing.assert_array_equal(out_nan[:, :, :10], out_big[:, :, :10])
    want = _reference(q[:, :, :10], k[:, :, :10], v[:, :, :10], block=4,
                      top_k=2, query_block=4)[2]
    np.testing.assert_array_equal(chosen_nan[:, :, :3, :3], want)
    np.testing.assert_array_equal(chosen_nan[0, :, 3], [[0, 0, 0, 1]] * 2)

  def test_query_blocks_walk_only_the_chosen_blocks(self):
    # Rows of a kernel block's size choose whole kernel blocks: the flash
    # walk's tables hold no partly chosen block, and it visits top_k of
    # them per row (fewer near the start), the diagonal partly.
    t, block, g, top_k = 64, 16, 8, 2
    q, k, _, _ = _inputs(32, 1, 2, 2, t, t, 4)
    chosen = moba.moba_selection(q, k, block=block, top_k=top_k,
                                 query_block=g)
    sel = aj.select_blocks(chosen, q_len=t, kv_len=t, key_block=block,
                           query_block=g, block_q=g, block_k=block)
    kinds = np.asarray(sel.kinds)
    self.assertFalse(np.any(kinds == aj.kernels.base.intervals.PARTIAL))
    np.testing.assert_array_equal(kinds == aj.kernels.base.intervals.FULL,
                                  np.asarray(chosen))
    rows = np.minimum(top_k, np.arange(t // g) * g // block + 1)
    np.testing.assert_array_equal(np.asarray(chosen).sum(-1),
                                  np.broadcast_to(rows, (1, 2, t // g)))

  def test_a_chunk_over_a_longer_prefix_and_a_decoding_step(self):
    # T != S: query i stands at i + S - T (bottom-right); per-head lengths
    # [B, N] read per query head (the block means differ within a group).
    # The same queries as a decoding step: placed at q_offset = 8 over a
    # cache of 16 slots whose 3 unwritten ones hold NaN (they lie in the
    # last query's own block and in a future one: never in a gate that
    # counts); the selection is then a rule over positions.
    t, s, slots = 5, 13, 16
    q, k, v, _ = _inputs(3, 2, 2, 1, t, s, 4)
    lengths = np.array([[13, 10], [11, 13]])
    want, _, chosen, _, margin = _reference(q, k, v, block=3, top_k=2,
                                            kv_lengths=lengths)
    self.assertGreater(margin, MARGIN)
    pad = ((0, 0), (0, 0), (0, slots - s), (0, 0))
    ck, cv = (jnp.pad(x, pad, constant_values=np.nan) for x in (k, v))
    whole = aj.Mask(causal=True, kv_lengths=lengths)
    # Lengths of 13 (every key) become the cache's 16 slots: the unwritten
    # slots are then hidden by causality alone, as in a layer's cache.
    step = aj.Mask(causal=True, kv_lengths=np.where(lengths == s, slots,
                                                    lengths),
                   q_offset=s - t)

    @jax.jit
    def run(q, k, v, ck, cv):
      return (aj.moba_attention(q, k, v, whole, block=3, top_k=2,
                                implementation="dense"),
              moba.moba_selection(q, k, whole, block=3, top_k=2),
              aj.moba_attention(q, ck, cv, step, block=3, top_k=2,
                                implementation="dense"))

    out, got_chosen, out_step = run(q, k, v, ck, cv)
    np.testing.assert_array_equal(got_chosen, chosen)
    chex.assert_trees_all_close(out, want, **TOL)
    chex.assert_trees_all_close(out_step, want, **TOL)

  def test_top_k_covering_every_block_is_causal_attention(self):
    # A property: with top_k >= the number of blocks nothing is left out
    # (T != S, a partial last block, top_k above the 3 blocks).
    q, k, v, _ = _inputs(5, 1, 2, 2, 4, 10, 4)
    run = jax.jit(lambda q, k, v: (
        aj.moba_attention(q, k, v, block=4, top_k=5, implementation="dense"),
        aj.scaled_dot_product_attention(q, k, v, is_causal=True,
                                        implementation="dense")))
    got, want = run(q, k, v)
    np.testing.assert_array_equal(got, want)  # the same maths exactly

  def test_ties_go_to_the_lower_block(self):
    # Every block mean equal (constant keys): the past blocks tie, and
    # top_k - 1 = 2 of them are the lowest indices, as aj.top_k_mask does.
    q = jnp.ones((1, 1, 12, 2))
    k = jnp.ones((1, 1, 12, 2))
    chosen = jax.jit(functools.partial(moba.moba_selection, block=2,
                                       top_k=3))(q, k)
    for t in range(12):
      own = t // 2
      want = {own} | set(range(min(own, 2)))
      self.assertEqual(set(np.flatnonzero(chosen[0, 0, t]).tolist()), want)

  def test_key_padding_dense_equals_kv_lengths(self):
    q, k, v, _ = _inputs(11, 2, 2, 1, 9, 9, 4)
    lengths = np.array([9, 5])
    keep = np.arange(9)[None, :] < lengths[:, None]  # [B, S]
    run = jax.jit(lambda mask: aj.moba_attention(
        q, k, v, mask, block=3, top_k=2, implementation="dense"))
    chex.assert_trees_all_close(
        run(aj.Mask(causal=True, dense=keep[:, None, None, :])),
        run(aj.Mask(causal=True, kv_lengths=lengths)), atol=0, rtol=0)


def _module(fn):
  return aj.MultiHeadAttention(16, 4, num_kv_heads=2, rngs=nnx.Rngs(0),
                               attention_fn=fn)


@nnx.jit
def _decode(mha, x):
  return mha(x, decode=True)


@nnx.jit
def _whole(mha, x):
  return mha(x, is_causal=True)


class MobaLayerTest(absltest.TestCase):

  def test_decoding_equals_the_whole_call(self):
    # A prefill of 5 then one token at a time: each step's queries choose
    # among the cache's blocks at their positions, as in the whole call
    # (block_q sets the whole call's flash blocks; the steps' rule has no
    # tables to block).
    mha = _module(aj.moba_attention_fn(4, 2, "flash", block_q=2))
    x = _data.normal(20, (2, 11, 16))
    whole = _whole(mha, x)
    mha.init_cache(2, 12)
    pieces = [_decode(mha, x[:, :5])]
    pieces += [_decode(mha, x[:, i:i + 1]) for i in range(5, 11)]
    # float32 both ways over other shapes: only reduction order differs.
    chex.assert_trees_all_close(jnp.concatenate(pieces, 1), whole,
                                atol=3e-6, rtol=3e-6)
    # The layer's whole call is moba_attention over its heads: less than
    # causal attention when blocks are left out.
    causal = _module("dense")(x, is_causal=True)
    self.assertGreater(float(jnp.abs(whole - causal).max()), 1e-3)

  def test_a_left_padded_example_decodes_as_its_tokens_alone(self):
    # Blocks count positions from each example's first real token; the
    # pads (NaN) never reach the gate.
    mha = _module(aj.moba_attention_fn(4, 2, "dense"))
    x = _data.normal(21, (2, 12, 16))
    padded = x.at[1, :2].set(jnp.nan)
    mha.init_cache(2, 12, left_padding=jnp.array([0, 2]))
    pieces = [_decode(mha, padded[:, :5])]
    pieces += [_decode(mha, padded[:, i:i + 1]) for i in range(5, 12)]
    got = jnp.concatenate(pieces, 1)
    chex.assert_trees_all_close(got[1, 2:], _whole(mha, x[1:, 2:])[0],
                                atol=3e-6, rtol=3e-6)
    chex.assert_trees_all_close(got[0], _whole(mha, x[:1])[0],
                                atol=3e-6, rtol=3e-6)
    np.testing.assert_array_equal(got[1, :2], 0.0)  # pad rows see nothing

  def test_module_gradients(self):
    # Training: the parameters get finite, non-zero gradients through the
    # chosen blocks (the choice itself has none).
    mha = _module(aj.moba_attention_fn(4, 2, "flash"))
    x = _data.normal(22, (2, 12, 16))
    grads = nnx.grad(lambda m: jnp.sum(m(x, is_causal=True) ** 2))(mha)
    for leaf in jax.tree.leaves(grads):
      self.assertTrue(np.all(np.isfinite(leaf)))
    self.assertGreater(float(jnp.abs(grads["W_k"]["kernel"][...]).sum()), 0)


class MobaRefusalTest(parameterized.TestCase):

  Q = jnp.ones((1, 2, 6, 4))
  KV = jnp.ones((1, 1, 6, 4))

  @parameterized.named_parameters(
      ("not_causal", dict(mask=aj.Mask(kv_lengths=3)), ValueError,
       "MoBA is defined for causal attention"),
      ("window", dict(mask=aj.Mask(causal=True, window=(2, 0))), ValueError,
       "holds window"),
      ("segment_ids", dict(mask=aj.Mask(causal=True, q_segment_ids=jnp.zeros(
          6, jnp.int32))), ValueError, "holds q_segment_ids"),
      ("rule", dict(mask=aj.Mask(causal=True, rule=lambda b, h, q, kv: q >= 0
                                 )), ValueError, "holds rule"),
      ("block_mask", dict(mask=aj.block_mask(lambda b, h, q, kv: q >= kv, 6,
                                             6)), ValueError,
       "MoBA's block selection is the mask's rule"),
      ("array", dict(mask=jnp.ones((6, 6), bool)), TypeError,
       "must be an aj.Mask or None"),
      ("dense_rows", dict(mask=aj.Mask(causal=True, dense=jnp.ones(
          (1, 1, 6, 6), bool))), ValueError, "reads a dense mask as key "
       "padding"),
      ("positive_kv_offset", dict(mask=aj.Mask(causal=True, q_offset=4,
                                               kv_offset=1)), ValueError,
       "takes kv_offset <= 0"),
      ("block_q_with_positions", dict(mask=aj.Mask(causal=True, q_offset=0),
                                      block_q=2), ValueError,
       "block_q=2 sets a block table"),
      ("block_type", dict(block=2.0), TypeError, "block must be a Python int"),
      ("top_k_zero", dict(top_k=0), ValueError, "top_k must be positive"),
      ("query_block_not_dividing_block", dict(block=3, query_block=2),
       ValueError, "query_block=2 must divide block=3"),
      ("query_block_offset", dict(k=jnp.ones((1, 1, 9, 4)),
                                  v=jnp.ones((1, 1, 9, 4)), block=4,
                                  query_block=2), ValueError,
       r"query_block=2 must divide S - T = 9 - 6"),
      ("query_block_while_decoding", dict(
          mask=aj.Mask(causal=True, q_offset=0), query_block=2), ValueError,
       "decode with query_block=1"),
      ("rank", dict(q=jnp.ones((2, 6, 4))), ValueError,
       r"q must be \[B, N, T, H\]"),
      ("heads", dict(q=jnp.ones((1, 3, 6, 4)), k=jnp.ones((1, 2, 6, 4)),
                     v=jnp.ones((1, 2, 6, 4))), ValueError,
       "K dividing N"),
  )
  def test_refused(self, changes, error, message):
    args = dict(q=self.Q, k=self.KV, v=self.KV, mask=None, block=2, top_k=2)
    args.update(changes)
    with self.assertRaisesRegex(error, message):
      aj.moba_attention(args.pop("q"), args.pop("k"), args.pop("v"),
                        args.pop("mask"), **args)

  def test_attention_fn_checks_its_arguments(self):
    with self.assertRaisesRegex(ValueError, "block_k=3 must divide block=4"):
      aj.moba_attention_fn(4, 2, block_k=3)
    with self.assertRaisesRegex(TypeError, "top_k must be a Python int"):
      aj.moba_attention_fn(4, None)
    with self.assertRaisesRegex(ValueError, "query_block=3 must divide"):
      aj.moba_attention_fn(4, 2, query_block=3)

  def test_a_layer_of_query_blocks_refuses_to_decode(self):
    mha = _module(aj.moba_attention_fn(4, 2, "dense", query_block=2))
    mha.init_cache(1, 8)
    with self.assertRaisesRegex(ValueError, "decode with query_block=1"):
      mha(jnp.ones((1, 2, 16)), decode=True)

  def test_caches_without_positions_in_order_are_refused(self):
    x = jnp.ones((1, 3, 16))
    # A ring buffer's slots hold changing positions: the layer hands a
    # non-causal visibility mask over them (and its window is refused).
    ring = aj.MultiHeadAttention(
        16, 4, num_kv_heads=2, rngs=nnx.Rngs(0),
        mask=aj.Mask(causal=True, window=(3, 0)),
        attention_fn=aj.moba_attention_fn(2, 2))
    ring.init_cache(1)
    with self.assertRaisesRegex(ValueError, "ring-buffer KV cache"):
      ring(x, decode=True)
    # A paged cache's keys stay in its pages: no function reads them.
    paged = _module(aj.moba_attention_fn(2, 2))
    paged.init_cache(1, 8, dtype="int8")
    with self.assertRaisesRegex(ValueError, "is a function over keys"):
      paged(x, decode=True)


if __name__ == "__main__":
  absltest.main()
