"""The benchmarks' roofline and blocks columns, without timing anything.

The visible-pair counts behind ``peak_share`` are closed forms (the long
cases build no mask); here they are held to brute-force NumPy masks at tiny
sizes, and each tiny case's counts to the masks its peers are given.
"""

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from benchmarks import attention as bench_attention
from benchmarks import structured as bench


def _tril(t):
  return np.tril(np.ones((t, t), bool))


class PairCountTest(parameterized.TestCase):

  @parameterized.product(t=[1, 7, 16, 33], window=[1, 2, 5, 16, 40])
  def test_window(self, t, window):
    self.assertEqual(bench.window_pairs(t, window),
                     np.count_nonzero(bench.window_mask(t, window)))

  @parameterized.product(t=[1, 8, 24, 64], docs=[1, 2, 4, 8])
  def test_packed(self, t, docs):
    if t % docs:
      self.skipTest("packed_mask packs equal documents")
    self.assertEqual(bench.packed_pairs(t, docs),
                     np.count_nonzero(bench.packed_mask(t, docs)))

  @parameterized.product(t=[1, 9, 32], prefix=[0, 1, 4, 9, 32, 50])
  def test_prefix_lm(self, t, prefix):
    self.assertEqual(bench.prefix_lm_pairs(t, prefix),
                     np.count_nonzero(bench.prefix_lm_mask(t, prefix)))

  @parameterized.parameters(1, 2, 17, 64)
  def test_causal(self, t):
    self.assertEqual(bench.causal_pairs(t), np.count_nonzero(_tril(t)))

  @parameterized.parameters("fwd", "fwd+bwd")
  def test_flops_match_attention_benchmark_when_nothing_is_masked(self, mode):
    b, n, t, h = 2, 3, 40, 8
    self.assertEqual(bench.attention_flops(b * t * t, n, h, mode),
                     bench_attention._flops(b, n, t, h, mode))


class TinyCasesTest(absltest.TestCase):

  def test_case_pairs_match_their_masks(self):
    cases = bench.build_cases("tiny", None)
    z = bench._sizes("tiny")
    b = z["bnh"][0]
    window = cases["window256_T4096"]
    t = window.shape[2]
    self.assertEqual(window.pairs["aj_window"],
                     b * np.count_nonzero(bench.window_mask(t, z["window"])))
    packed = cases["packed8x512_T4096"]
    t = packed.shape[2]
    self.assertEqual(packed.pairs["aj_segments"],
                     b * np.count_nonzero(bench.packed_mask(t, z["docs"])))
    prefix = cases["prefix_lm_T4096"]
    t = prefix.shape[2]
    masks = [bench.prefix_lm_mask(t, p) for p in t // 4 + np.arange(b)]
    self.assertEqual(prefix.pairs["aj_traced_prefix"],
                     sum(np.count_nonzero(m) for m in masks))
    causal = cases["causal_T2048"]
    t = causal.shape[2]
    self.assertEqual(causal.pairs["aj_causal"],
                     b * np.count_nonzero(_tril(t)))
    self.assertEqual(causal.pairs["aj_noncausal"], b * t * t)
    for case in cases.values():  # every timed implementation is counted
      self.assertEqual(set(case.pairs), set(case.impls), case.name)

  def test_blocks_of_flash_rows_and_none_of_dense(self):
    cases = bench.build_cases("tiny", None)
    arrays = bench._inputs(*cases["window256_T4096"].shape)
    got = cases["window256_T4096"].blocks["aj_window"](arrays)
    self.assertIn(got.source, ("given", "block_mask", "cache", "defaults"))
    self.assertNotIn("jax_nn_window", cases["window256_T4096"].blocks)
    self.assertEqual(cases["dense_causal_T1024"].blocks, {})
    prefix = cases["prefix_lm_T4096"]
    got = prefix.blocks["aj_traced_prefix"](bench._inputs(*prefix.shape))
    self.assertEqual(got.source, "block_mask")
    point = (1, 2, 64, 16, "float32", "fwd")
    self.assertIsNone(bench_attention._blocks("aj_dense", point))
    self.assertIn("source", bench_attention._blocks("aj_blockwise", point))

  def test_times_table_shows_share_and_blocks(self):
    row = {"case": "c", "mode": "fwd", "impl": "aj_x", "B": 1, "N": 1,
           "T": 8, "H": 4, "seconds": 1.0, "compile_s": 0.0, "skipped": None,
           "peak_share": 0.125,
           "blocks": {"block_q": 1024, "block_k": 256, "source": "defaults"}}
    table = bench.times_table([row, {**row, "impl": "peer", "blocks": None,
                                     "peak_share": None}])
    self.assertIn("| 1 | 12.5% | 1024x256 (defaults) | 0.00 |", table)
    self.assertIn("| peer | 1 | - | - | 0.00 |", table)


if __name__ == "__main__":
  absltest.main()
