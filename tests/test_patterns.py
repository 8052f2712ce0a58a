"""Block skipping is exact: block classifications against a brute-force mask.

The dense mask is written here from the conventions (bottom-right aligned
positions, jax.nn's (left, right) window, lengths, segment ids), not by
calling the library's predicate. A block is empty (never visited), full
(visited without a mask pass) or partial; for each pattern the library's
intervals must equal the brute-force classification.
"""

from absl.testing import absltest
import hypothesis
from hypothesis import strategies as st
import numpy as np

import attention_jax as aj
from attention_jax.masking import intervals


def _dense(t, s, causal, window, q_len, kv_len):
  i = np.arange(t)[:, None] + (s - t)  # aligned query positions
  j = np.arange(s)[None, :]
  ok = np.ones((t, s), bool)
  if causal:
    ok &= j <= i
  if window is not None:
    ok &= (j >= i - window[0]) & (j <= i + window[1])
  ok &= j < kv_len
  ok &= np.arange(t)[:, None] < q_len
  return ok


# The interval tests compute a few small arrays per example (milliseconds):
# far more examples than the suite's default, so that the ci profile's fixed
# examples reach the rare layouts (a block between two of the same segment).
_MANY = hypothesis.settings(
    max_examples=max(300, hypothesis.settings.default.max_examples))


@st.composite
def _segment_problems(draw):
  """Query and key ids with block sizes; packed self-attention or random."""
  s = draw(st.integers(1, 40))
  bq, bk = draw(st.integers(1, 9)), draw(st.integers(1, 9))
  k_ids = draw(st.lists(st.integers(0, 4), min_size=s, max_size=s))
  contiguous = draw(st.booleans())
  if contiguous:  # packed self-attention: the same non-decreasing ids
    k_ids = q_ids = sorted(k_ids)
  else:
    t = draw(st.integers(1, 40))
    q_ids = draw(st.lists(st.integers(0, 4), min_size=t, max_size=t))
  return dict(q_ids=q_ids, k_ids=k_ids, bq=bq, bk=bk, contiguous=contiguous)


@st.composite
def _problems(draw):
  t = draw(st.integers(1, 40))
  s = draw(st.integers(1, 40))
  window = draw(st.none() | st.tuples(st.integers(0, 12), st.integers(0, 12)))
  return dict(t=t, s=s, causal=draw(st.booleans()), window=window,
              q_len=draw(st.integers(0, t)), kv_len=draw(st.integers(0, s)),
              bq=draw(st.integers(1, 9)), bk=draw(st.integers(1, 9)))


class BlockRangeTest(absltest.TestCase):

  @_MANY
  @hypothesis.given(_problems())
  def test_ranges_equal_brute_force(self, p):
    t, s, bq, bk = p["t"], p["s"], p["bq"], p["bk"]
    dense = _dense(t, s, p["causal"], p["window"], p["q_len"], p["kv_len"])
    num_q, num_k = -(-t // bq), -(-s // bk)
    blocks = np.zeros((num_q, num_k), bool)  # does block (i, j) hold any?
    for i in range(num_q):
      for j in range(num_k):
        blocks[i, j] = dense[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk].any()
    b = intervals.bounds(p["causal"], p["window"])
    for i in range(num_q):
      lo, hi, _, _ = (int(x) for x in intervals.key_blocks(
          b, i * bq, bq, bk, num_k, s - t, p["kv_len"], p["q_len"], s))
      want = np.flatnonzero(blocks[i])
      got = np.arange(lo, hi)
      # Exact: the visible key blocks of a query block are one interval.
      np.testing.assert_array_equal(got, want, err_msg=f"query block {i}")
    for j in range(num_k):
      lo, hi, _, _ = (int(x) for x in intervals.query_blocks(
          b, j * bk, bq, bk, num_q, s - t, p["kv_len"], p["q_len"], s))
      np.testing.assert_array_equal(np.arange(lo, hi),
                                    np.flatnonzero(blocks[:, j]),
                                    err_msg=f"key block {j}")

  @_MANY
  @hypothesis.given(_problems())
  def test_full_ranges_equal_brute_force(self, p):
    t, s, bq, bk = p["t"], p["s"], p["bq"], p["bk"]
    num_q, num_k = -(-t // bq), -(-s // bk)
    # Padded grid: rows past T keep their positions (their outputs are
    # dropped), columns past S are padding and never allowed.
    rows = np.arange(num_q * bq)[:, None] + (s - t)
    cols = np.arange(num_k * bk)[None, :]
    ok = (cols < s) & (cols < p["kv_len"]) & (
        np.arange(num_q * bq)[:, None] < p["q_len"])
    if p["causal"]:
      ok = ok & (cols <= rows)
    if p["window"] is not None:
      ok = ok & (cols >= rows - p["window"][0]) & (cols <= rows
                                                   + p["window"][1])
    full = ok.reshape(num_q, bq, num_k, bk).all(axis=(1, 3))
    b = intervals.bounds(p["causal"], p["window"])
    for i in range(num_q):
      _, _, lo, hi = (int(x) for x in intervals.key_blocks(
          b, i * bq, bq, bk, num_k, s - t, p["kv_len"], p["q_len"], s))
      np.testing.assert_array_equal(np.arange(lo, hi),
                                    np.flatnonzero(full[i]),
                                    err_msg=f"query block {i}")
    for j in range(num_k):
      _, _, lo, hi = (int(x) for x in intervals.query_blocks(
          b, j * bk, bq, bk, num_q, s - t, p["kv_len"], p["q_len"], s))
      np.testing.assert_array_equal(np.arange(lo, hi),
                                    np.flatnonzero(full[:, j]),
                                    err_msg=f"key block {j}")

  @_MANY
  @hypothesis.given(_segment_problems())
  # Query ids of one segment against key blocks of that id on both sides of
  # a block of another: the middle block is not full.
  @hypothesis.example(dict(q_ids=[0], k_ids=[0, 1, 0], bq=1, bk=1,
                           contiguous=False))
  @hypothesis.example(dict(q_ids=[1, 1, 1, 1], k_ids=[1, 1, 2, 2, 1, 1],
                           bq=4, bk=2, contiguous=False))
  def test_segment_ranges_equal_brute_force(self, p):
    q_ids, k_ids = np.array(p["q_ids"]), np.array(p["k_ids"])
    bq, bk, contiguous = p["bq"], p["bk"], p["contiguous"]
    t, s = len(q_ids), len(k_ids)
    num_q, num_k = -(-t // bq), -(-s // bk)
    q_pad = np.pad(q_ids, (0, num_q * bq - t), mode="edge")
    k_pad = np.pad(k_ids, (0, num_k * bk - s), mode="edge")
    same = q_pad[:, None] == k_pad[None, :]
    some = same.reshape(num_q, bq, num_k, bk).any(axis=(1, 3))
    every = same.reshape(num_q, bq, num_k, bk).all(axis=(1, 3))
    q_min, q_max = intervals.block_min_max(q_pad, bq)
    k_min, k_max = intervals.block_min_max(k_pad, bk)
    for i in range(num_q):
      lo, hi, flo, fhi = (int(x) for x in intervals.segment_block_ranges(
          q_min[i], q_max[i], k_min, k_max))
      visited, full = np.arange(lo, hi), np.arange(flo, fhi)
      # Never skip a block with an allowed entry, never call one with a
      # blocked entry full; for packed documents, exactly.
      self.assertTrue(set(np.flatnonzero(some[i])) <= set(visited))
      self.assertTrue(set(full) <= set(np.flatnonzero(every[i])),
                      f"query block {i}: full {full.tolist()}, but only "
                      f"{np.flatnonzero(every[i]).tolist()} are")
      if contiguous:
        np.testing.assert_array_equal(visited, np.flatnonzero(some[i]))
        np.testing.assert_array_equal(full, np.flatnonzero(every[i]))

  @hypothesis.given(st.data())
  def test_block_mask_classification_equals_brute_force(self, data):
    t, s = data.draw(st.integers(1, 30)), data.draw(st.integers(1, 30))
    bq, bk = data.draw(st.integers(1, 8)), data.draw(st.integers(1, 8))
    kind = data.draw(st.sampled_from(["random", "dilated", "prefix"]))
    if kind == "random":
      dense = np.array(data.draw(st.lists(st.booleans(), min_size=t * s,
                                          max_size=t * s))).reshape(t, s)
      mask_fn = lambda b, h, q, k: dense[q, k]
    elif kind == "dilated":  # every other key, within a window of 6
      mask_fn = lambda b, h, q, k: (abs(q - k) <= 6) & ((q - k) % 2 == 0)
    else:
      mask_fn = aj.prefix_lm_mask_fn(data.draw(st.integers(1, s)))
    bm = aj.block_mask(mask_fn, t, s, block_q=bq, block_k=bk)
    bq, bk = bm.block_q, bm.block_k
    num_q, num_k = -(-t // bq), -(-s // bk)
    allowed = np.broadcast_to(
        mask_fn(0, 0, np.arange(t)[:, None], np.arange(s)[None, :]), (t, s))
    want = np.zeros((num_q, num_k), int)
    for i in range(num_q):
      for j in range(num_k):
        block = allowed[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
        want[i, j] = 2 if block.all() else (1 if block.any() else 0)
    np.testing.assert_array_equal(bm.kinds, want)
    for i in range(num_q):  # the per-row lists the kernels walk
      listed = bm.kv_indices[i][bm.kv_indices[i] < num_k]
      np.testing.assert_array_equal(listed, np.flatnonzero(want[i]))
      np.testing.assert_array_equal(bm.kv_full[i][:listed.size],
                                    want[i, listed] == 2)
    for j in range(num_k):
      listed = bm.q_indices[j][bm.q_indices[j] < num_q]
      np.testing.assert_array_equal(listed, np.flatnonzero(want[:, j]))

  def test_visible_matches_brute_force(self):
    for t, s, causal, window in ((5, 9, True, (2, 0)), (9, 5, False, (1, 3)),
                                 (7, 7, True, None)):
      rows, cols = np.arange(t)[:, None], np.arange(s)[None, :]
      got = intervals.visible(rows, cols, s - t,
                              intervals.bounds(causal, window), 4, 6)
      np.testing.assert_array_equal(
          np.broadcast_to(got, (t, s)), _dense(t, s, causal, window, 4, 6))

  def test_bad_windows_are_refused(self):
    for bad, error in (((-1, 2), ValueError), ((1, 2, 3), TypeError),
                       (1.5, TypeError), (True, TypeError)):
      with self.assertRaises(error):
        intervals.check_window(bad)


if __name__ == "__main__":
  absltest.main()
