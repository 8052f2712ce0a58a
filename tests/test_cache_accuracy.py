"""The quantised-cache accuracy study: its rows cover the text once, and
its float32 cache reads the text as the model's full forward does."""

from absl.testing import absltest
from flax import nnx
import numpy as np

from experiments import cache_accuracy
from experiments import lm_data
from experiments import lm_model

_DOCS = [np.array([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]),
         np.array([20, 21, 22]), np.array([30, 31, 32, 33, 34, 35, 36, 37])]


def _model():
  config = lm_model.LMModelConfig(d_model=16, num_heads=2, num_layers=2,
                                  ffn_dim=32)
  return lm_model.DecoderLM(config, vocab_size=40, rngs=nnx.Rngs(0))


class ValidationRowsTest(absltest.TestCase):

  def test_every_transition_once_and_no_row_crosses_a_document(self):
    rows = cache_accuracy.validation_rows(lm_data.pack(_DOCS, 6), 5)
    pairs = [(int(r[i]), int(r[i + 1]))
             for r, n in zip(rows.tokens, rows.lengths) for i in range(n)]
    wanted = []
    for doc in _DOCS:
      full = [lm_data.BOS, *doc.tolist()]
      wanted += list(zip(full[:-1], full[1:]))
    self.assertEqual(pairs, wanted)
    # Rows of one document overlap by one token; a row starts at BOS or
    # inside its document, and is padded after its last target.
    self.assertEqual(rows.lengths.tolist(), [5, 5, 2, 3, 5, 3])
    self.assertTrue((rows.tokens[2, 3:] == lm_data.PAD).all())

  def test_bad_row_length(self):
    with self.assertRaisesRegex(ValueError, "row_tokens"):
      cache_accuracy.validation_rows(lm_data.pack(_DOCS, 6), 0)


class CacheAccuracyTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.model = _model()
    cls.rows = cache_accuracy.validation_rows(lm_data.pack(_DOCS, 6), 7)
    # 5 rows in batches of 2 (the last batch half empty), 3 tokens a call
    # over pages of 2: appends straddle pages.
    cls.result = cache_accuracy.cache_accuracy(
        cls.model, cls.rows, batch_rows=2, chunk=3, page_size=2)

  def test_float32_cache_equals_the_full_forward(self):
    # One causal forward of every row (padding after a row's last input
    # changes none of its positions).
    logits = np.asarray(self.model(self.rows.tokens[:, :-1]), np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    bits = []
    for r, (tokens, n) in enumerate(zip(self.rows.tokens, self.rows.lengths)):
      bits += list(-logp[r, np.arange(n), tokens[1:n + 1]] / np.log(2))
    # float32 attention through pages against one float32 forward: the
    # sums run in other orders (a few ulps of bits of order 5).
    np.testing.assert_allclose(self.result["float32"]["bits_per_char"],
                               np.mean(bits), rtol=1e-5)
    self.assertEqual(self.result["float32"]["positions"], len(bits))

  def test_quantised_formats_differ_a_little_and_store_fewer_bytes(self):
    r = self.result
    self.assertEqual(r["float32"]["attention_max_abs_error"], [0.0, 0.0])
    for f in ("bfloat16", "int8", "float8_e4m3fn"):
      errors = np.array(r[f]["attention_max_abs_error"])
      scale = np.array(r[f]["attention_max_abs"])
      # Rounding happened (not a float32 cache in disguise) and stayed
      # small against the outputs (float8 keeps 3 mantissa bits: ~6%).
      self.assertTrue((errors > 0).all(), f)
      self.assertTrue((errors < 0.1 * scale).all(), f)
    # float8's rounding (3 mantissa bits) flips the argmax of this untrained
    # model's flat logits somewhere among the 23 positions (1 here); the
    # agreement counts positions, so it is a multiple of 1 / 23.
    agreement = r["float8_e4m3fn"]["greedy_agreement"]
    self.assertBetween(agreement, 0.5, 1 - 1 / 23)
    self.assertAlmostEqual(agreement * 23, round(agreement * 23))
    # 2 layers x keys and values x 1 KV head per query head (2) x 8 dims.
    self.assertEqual(r["float32"]["bytes_per_token"], 2 * 2 * 2 * 8 * 4)
    self.assertEqual(r["bfloat16"]["bytes_per_token"], 2 * 2 * 2 * 8 * 2)
    for f in ("int8", "float8_e4m3fn"):  # a float32 scale per token, head
      self.assertEqual(r[f]["bytes_per_token"], 2 * 2 * 2 * (8 + 4))


if __name__ == "__main__":
  absltest.main()
