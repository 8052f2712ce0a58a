"""Block skipping is exact: block ranges against a brute-force dense mask.

The dense mask is written here from the conventions (bottom-right aligned
positions, jax.nn's (left, right) window, lengths), not by calling the
library's predicate.
"""

from absl.testing import absltest
import hypothesis
from hypothesis import strategies as st
import numpy as np

from attention_jax import _patterns


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


@st.composite
def _problems(draw):
  t = draw(st.integers(1, 40))
  s = draw(st.integers(1, 40))
  window = draw(st.none() | st.tuples(st.integers(0, 12), st.integers(0, 12)))
  return dict(t=t, s=s, causal=draw(st.booleans()), window=window,
              q_len=draw(st.integers(0, t)), kv_len=draw(st.integers(0, s)),
              bq=draw(st.integers(1, 9)), bk=draw(st.integers(1, 9)))


class BlockRangeTest(absltest.TestCase):

  @hypothesis.given(_problems())
  def test_ranges_equal_brute_force(self, p):
    t, s, bq, bk = p["t"], p["s"], p["bq"], p["bk"]
    dense = _dense(t, s, p["causal"], p["window"], p["q_len"], p["kv_len"])
    num_q, num_k = -(-t // bq), -(-s // bk)
    blocks = np.zeros((num_q, num_k), bool)  # does block (i, j) hold any?
    for i in range(num_q):
      for j in range(num_k):
        blocks[i, j] = dense[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk].any()
    b = _patterns.bounds(p["causal"], p["window"])
    for i in range(num_q):
      lo, hi = (int(x) for x in _patterns.key_block_range(
          b, i * bq, bq, bk, num_k, s - t, p["kv_len"], p["q_len"]))
      want = np.flatnonzero(blocks[i])
      got = np.arange(lo, hi)
      # Exact: the visible key blocks of a query block are one interval.
      np.testing.assert_array_equal(got, want, err_msg=f"query block {i}")
    for j in range(num_k):
      lo, hi = (int(x) for x in _patterns.query_block_range(
          b, j * bk, bq, bk, num_q, s - t, p["kv_len"], p["q_len"]))
      np.testing.assert_array_equal(np.arange(lo, hi),
                                    np.flatnonzero(blocks[:, j]),
                                    err_msg=f"key block {j}")

  def test_visible_matches_brute_force(self):
    for t, s, causal, window in ((5, 9, True, (2, 0)), (9, 5, False, (1, 3)),
                                 (7, 7, True, None)):
      rows, cols = np.arange(t)[:, None], np.arange(s)[None, :]
      got = _patterns.visible(rows, cols, s - t,
                              _patterns.bounds(causal, window), 4, 6)
      np.testing.assert_array_equal(
          np.broadcast_to(got, (t, s)), _dense(t, s, causal, window, 4, 6))

  def test_bad_windows_are_refused(self):
    for bad, error in (((-1, 2), ValueError), ((1, 2, 3), TypeError),
                       (1.5, TypeError), (True, TypeError)):
      with self.assertRaises(error):
        _patterns.check_window(bad)


if __name__ == "__main__":
  absltest.main()
