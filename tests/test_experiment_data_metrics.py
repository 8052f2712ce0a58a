"""Experiment data and metrics on hand-made inputs."""

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from experiments import data
from experiments import metrics


def _batch(task="copy", step=0, seed=0):
  return data.train_batch(task, step, seed=seed, batch_size=6, min_len=2,
                          max_len=7, vocab_size=5)


class DataTest(parameterized.TestCase):

  def test_shapes_and_masks(self):
    b = _batch()
    self.assertEqual(b.src.shape, (6, 7))
    self.assertEqual(b.tgt_in.shape, (6, 8))
    self.assertEqual(b.tgt_out.shape, (6, 8))
    for row, n in enumerate(b.src_len):
      self.assertTrue(2 <= n <= 7)
      np.testing.assert_array_equal(b.src[row, n:], data.PAD)
      self.assertTrue(np.all(b.src[row, :n] >= data.NUM_SPECIAL))
      self.assertTrue(np.all(b.src[row, :n] < data.NUM_SPECIAL + 5))
      self.assertEqual(b.tgt_in[row, 0], data.BOS)
      self.assertEqual(b.tgt_out[row, n], data.EOS)
      np.testing.assert_array_equal(b.tgt_mask[row], np.arange(8) <= n)
      # Teacher forcing input is the output shifted right by one.
      np.testing.assert_array_equal(b.tgt_in[row, 1:n + 1], b.tgt_out[row, :n])

  def test_copy_and_reverse_targets(self):
    copy, rev = _batch("copy"), _batch("reverse")
    np.testing.assert_array_equal(copy.src, rev.src)  # same (seed, step)
    for row, n in enumerate(copy.src_len):
      np.testing.assert_array_equal(copy.tgt_out[row, :n], copy.src[row, :n])
      np.testing.assert_array_equal(rev.tgt_out[row, :n],
                                    rev.src[row, :n][::-1])

  def test_deterministic_per_seed_and_step(self):
    np.testing.assert_array_equal(_batch(step=3).src, _batch(step=3).src)
    self.assertFalse(np.array_equal(_batch(step=3).src, _batch(step=4).src))
    self.assertFalse(np.array_equal(_batch(seed=1).src, _batch(seed=2).src))

  def test_eval_batch_has_fixed_length(self):
    b = data.eval_batch("reverse", 9, seed=0, num_examples=4, vocab_size=5)
    self.assertEqual(b.src.shape, (4, 9))
    np.testing.assert_array_equal(b.src_len, 9)

  def test_gold_positions(self):
    np.testing.assert_array_equal(data.gold_position(4, "copy"), [0, 1, 2, 3])
    np.testing.assert_array_equal(data.gold_position(4, "reverse"),
                                  [3, 2, 1, 0])


class MetricsTest(parameterized.TestCase):

  @parameterized.parameters("copy", "reverse")
  def test_perfect_alignment(self, task):
    n = 6
    a = np.zeros((2, n + 1, n))
    a[:, np.arange(n), data.gold_position(n, task)] = 1.0
    m = metrics.alignment_metrics(a, n, task)
    self.assertEqual(m["align_acc"], 1.0)
    self.assertEqual(m["align_acc_pm1"], 1.0)
    self.assertEqual(m["gold_mass"], 1.0)
    self.assertEqual(m["offset"], 0.0)
    self.assertEqual(m["entropy"], 0.0)

  def test_shifted_diagonal_is_zero_strict_one_within_one(self):
    n = 6
    a = np.zeros((1, n, n))
    a[0, np.arange(n), np.minimum(np.arange(n) + 1, n - 1)] = 1.0
    a[0, n - 1] = 0.0
    a[0, n - 1, n - 2] = 1.0  # the last row shifts left instead
    m = metrics.alignment_metrics(a, n, "copy")
    self.assertEqual(m["align_acc"], 0.0)
    self.assertEqual(m["align_acc_pm1"], 1.0)
    self.assertAlmostEqual(m["offset"], (n - 1 - 1) / n)

  @parameterized.product(task=("copy", "reverse"), shift=(1, 2))
  def test_within_one_means_at_most_one_position_off(self, task, shift):
    # Every row's argmax exactly `shift` positions from gold (right, or left
    # where right runs off the end): 1 away counts for align_acc_pm1, 2
    # away does not, so a wider tolerance fails here.
    n = 8
    gold = data.gold_position(n, task)
    argmax = np.where(gold + shift < n, gold + shift, gold - shift)
    a = np.zeros((2, n + 1, n))
    a[:, np.arange(n), argmax] = 1.0
    m = metrics.alignment_metrics(a, n, task)
    self.assertEqual(m["align_acc"], 0.0)
    self.assertEqual(m["align_acc_pm1"], 1.0 if shift == 1 else 0.0)

  def test_uniform_has_entropy_one(self):
    a = np.full((3, 5, 5), 0.2)
    m = metrics.alignment_metrics(a, 5, "copy")
    self.assertAlmostEqual(m["entropy"], 1.0)
    self.assertAlmostEqual(m["gold_mass"], 0.2)

  def test_sequence_metrics(self):
    b = data.eval_batch("copy", 3, seed=0, num_examples=2, vocab_size=5)
    predicted = b.tgt_out.copy()
    predicted[1, 2] = data.PAD  # one wrong token in the second sequence
    m = metrics.sequence_metrics(predicted, b)
    self.assertAlmostEqual(m["token_acc"], 7 / 8)  # 4 targets each (EOS)
    self.assertAlmostEqual(m["seq_acc"], 0.5)


if __name__ == "__main__":
  absltest.main()
