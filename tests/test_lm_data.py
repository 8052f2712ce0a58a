"""The language model's data: split by document, vocabulary, packing, batches.

NumPy only (nothing compiles), except one call of the library's
``segment_positions`` to check that the packed rows give RoPE the positions
the packing promises.
"""

from absl.testing import absltest
import numpy as np

from attention_jax.scores import rope
from experiments import lm_data

BOS, PAD = lm_data.BOS, lm_data.PAD


def _docs(*lengths):
  """Documents ``d0, d1, ...`` of the given lengths (letters cycling)."""
  return {f"d{i}": "".join(chr(97 + (i + j) % 26) for j in range(n))
          for i, n in enumerate(lengths)}


class SplitTest(absltest.TestCase):

  def test_split_is_by_document_deterministic_and_seeded(self):
    names = [f"doc{i:02d}" for i in range(40)]
    train, valid = lm_data.split_documents(names, 0.2, seed=0)
    self.assertEqual(len(valid), 8)
    self.assertEmpty(set(train) & set(valid))
    self.assertCountEqual(train + valid, names)
    self.assertEqual((train, valid),
                     lm_data.split_documents(reversed(names), 0.2, seed=0))
    self.assertNotEqual(valid, lm_data.split_documents(names, 0.2, seed=1)[1])

  def test_each_side_keeps_a_document(self):
    self.assertEqual(lm_data.split_documents(["a", "b"], 0.01, 0)[1].__len__(),
                     1)
    self.assertLen(lm_data.split_documents(["a", "b"], 0.99, 0)[0], 1)
    with self.assertRaisesRegex(ValueError, "at least two documents"):
      lm_data.split_documents(["a"], 0.5, 0)
    with self.assertRaisesRegex(ValueError, r"valid_fraction must lie in"):
      lm_data.split_documents(["a", "b"], 1.0, 0)

  def test_the_help_topics_split(self):
    corpus = lm_data.build_corpus(64, 0.2, seed=0)
    docs = lm_data.load_documents()
    self.assertGreater(len(docs), 50)  # CPython ships ~80 topics
    self.assertEmpty(set(corpus.train_names) & set(corpus.valid_names))
    self.assertCountEqual(corpus.train_names + corpus.valid_names, docs)
    # Every character of a side is a target exactly once.
    for names, packed in ((corpus.train_names, corpus.train),
                          (corpus.valid_names, corpus.valid)):
      self.assertEqual(packed.target_weights().sum(),
                       sum(len(docs[n]) for n in names))
    # The vocabulary is the training split's characters.
    self.assertEqual(set(corpus.vocab.chars),
                     set("".join(docs[n] for n in corpus.train_names)))
    # English with code has a unigram entropy of ~4.7 bits; a character
    # model's job is to get well below it.
    self.assertBetween(corpus.unigram_entropy, 4.0, 5.5)
    self.assertGreaterEqual(corpus.unigram_valid, corpus.unigram_entropy - 0.3)


class VocabTest(absltest.TestCase):

  def test_round_trip_and_unknown_characters(self):
    vocab = lm_data.Vocab.from_texts(["hello", "world"])
    self.assertEqual(vocab.chars, "dehlorw")
    self.assertEqual(vocab.size, lm_data.NUM_SPECIAL + 7)
    ids = vocab.encode("hold!")
    self.assertEqual(ids.dtype, np.int32)
    self.assertEqual(ids[-1], lm_data.UNK)
    self.assertEqual(vocab.decode([BOS, *ids, PAD]), "hold\ufffd")

  def test_unigram_entropy(self):
    # p = (2/3, 1/3): -(2/3 log2 2/3 + 1/3 log2 1/3) = 0.9183 bits.
    self.assertAlmostEqual(lm_data.unigram_entropy("aab"), 0.918296, places=5)
    self.assertEqual(lm_data.unigram_entropy("aaaa"), 0.0)
    vocab = lm_data.Vocab.from_texts(["ab"])
    # Add-one counts over a, b and UNK: a 2/4, b 1/4, UNK 1/4.
    self.assertAlmostEqual(
        lm_data.unigram_cross_entropy("a", vocab, "abz"),
        -(np.log2(0.5) + 2 * np.log2(0.25)) / 3, places=6)


class PackTest(absltest.TestCase):

  def test_rows_segment_ids_positions_and_targets_by_hand(self):
    # Stream BOS a b c BOS d e, rows of T + 1 = 5 overlapping by one.
    packed = lm_data.pack([np.array([10, 11, 12]), np.array([13, 14])], 4)
    np.testing.assert_array_equal(packed.tokens, [[BOS, 10, 11, 12, BOS],
                                                  [BOS, 13, 14, PAD, PAD]])
    np.testing.assert_array_equal(packed.segment_ids, [[1, 1, 1, 1, 2],
                                                       [1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(packed.doc_positions, [[0, 1, 2, 3, 0],
                                                         [0, 1, 2, -1, -1]])
    # Targets a b c d e, once each; never BOS from the last character.
    np.testing.assert_array_equal(packed.target_weights(), [[1, 1, 1, 0],
                                                            [1, 1, 0, 0]])
    inputs, targets, weights, ids = lm_data.batch(packed, [1, 0])
    np.testing.assert_array_equal(inputs[1], [BOS, 10, 11, 12])
    np.testing.assert_array_equal(targets[1], [10, 11, 12, BOS])
    np.testing.assert_array_equal(ids, packed.segment_ids[[1, 0], :-1])
    np.testing.assert_array_equal(weights, packed.target_weights()[[1, 0]])

  def test_rope_positions_restart_at_every_document(self):
    docs = [np.arange(n) % 20 + lm_data.NUM_SPECIAL for n in (7, 30, 2, 11)]
    packed = lm_data.pack(docs, 8)
    self.assertEqual(packed.target_weights().sum(), 50)
    positions = np.asarray(rope.segment_positions(packed.segment_ids))
    real = packed.segment_ids > 0
    # A document starting in the row: its own positions (BOS at 0); one
    # continued from the row before: offsets from where the row picks it
    # up (RoPE sees only differences).
    for row in range(packed.num_rows):
      for seg in np.unique(packed.segment_ids[row][real[row]]):
        at = packed.segment_ids[row] == seg
        want = packed.doc_positions[row][at] - packed.doc_positions[row][at][0]
        np.testing.assert_array_equal(positions[row][at], want)
        if packed.tokens[row][at][0] == BOS:
          np.testing.assert_array_equal(positions[row][at],
                                        packed.doc_positions[row][at])

  def test_bad_arguments(self):
    with self.assertRaisesRegex(ValueError, "seq_len must be positive"):
      lm_data.pack([np.array([3])], 0)
    with self.assertRaisesRegex(ValueError, "no documents"):
      lm_data.pack([], 4)

  def test_boundary_window(self):
    corpus = lm_data.build_corpus(16, 0.5, 0, documents=_docs(20, 9, 30, 5))
    tokens, ids, boundary = lm_data.boundary_window(corpus.train, 4)
    self.assertLen(tokens, 8)
    self.assertEqual(boundary, 4)
    self.assertEqual(tokens[boundary], BOS)
    self.assertNotIn(BOS, tokens[:boundary])
    self.assertEqual(len(set(ids[:boundary])), 1)
    self.assertTrue((ids[boundary:] == ids[boundary]).all())
    self.assertNotEqual(ids[0], ids[boundary])
    # Less room than asked: the most context on both sides that one row
    # holds (here 3: BOS d e | BOS ...), from the row that has it.
    packed = lm_data.pack([np.array([5, 6]), np.arange(5, 12)], 8)
    tokens, ids, boundary = lm_data.boundary_window(packed, 6)
    np.testing.assert_array_equal(tokens, [BOS, 5, 6, BOS, 5, 6])
    np.testing.assert_array_equal(ids, [1, 1, 1, 2, 2, 2])
    self.assertEqual(boundary, 3)


class BatchRowsTest(absltest.TestCase):

  def test_pure_function_of_seed_and_step_covering_each_epoch(self):
    rows = [lm_data.batch_rows(10, step, 4, seed=3) for step in range(5)]
    again = [lm_data.batch_rows(10, step, 4, seed=3) for step in (4, 2, 0)]
    for got, step in zip(again, (4, 2, 0)):
      np.testing.assert_array_equal(got, rows[step])
    flat = np.concatenate(rows)  # 20 rows = two epochs of 10
    self.assertCountEqual(flat[:10], range(10))
    self.assertCountEqual(flat[10:], range(10))
    self.assertFalse(np.array_equal(flat[:10], flat[10:]))  # reshuffled
    self.assertFalse(np.array_equal(rows[0],
                                    lm_data.batch_rows(10, 0, 4, seed=4)))


if __name__ == "__main__":
  absltest.main()
