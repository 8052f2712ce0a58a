"""``--experiment=sparse`` (experiments/sparse_lm.py).

The block share it reports against a hand count; a length that is not a
whole number of blocks refused; the whole experiment, tiny, in the
exhaustive run (every variant trains, scores and draws its figure).
"""

import dataclasses
import json
import os
import tempfile

from absl.testing import absltest
import numpy as np

from experiments import sparse_lm
from experiments import training


def is_exhaustive(test_name: str) -> bool:
  """conftest's hook: the whole (tiny) run compiles four models."""
  return test_name == "test_the_whole_run_tiny"


TINY = sparse_lm.SparseConfig(
    seq_len=64, d_model=16, num_heads=2, num_layers=1, block=16,
    top_k_blocks=3, nsa_stride=8, nsa_window=16, top_k_tokens=8,
    indexer_heads=2, indexer_dim=4, warmup_steps=1, eval_rows=2,
    timed_turns=2,
    train=training.TrainConfig(steps=3, batch_size=2, log_every=1))


class BlockShareTest(absltest.TestCase):

  def test_share_of_the_causal_blocks(self):
    config = dataclasses.replace(TINY, seq_len=32, block=16)
    # Queries 0-15 see block 0 only, 16-31 blocks 0 and 1: 48 causal
    # (query, block) pairs. Reading only the own block: 32 of them.
    own = np.zeros((1, 1, 32, 2), bool)
    own[0, 0, :16, 0] = own[0, 0, 16:, 1] = True
    self.assertAlmostEqual(sparse_lm.block_share("moba", own, config),
                           32 / 48)
    # A future block chosen does not count.
    future = own.copy()
    future[0, 0, :16, 1] = True
    self.assertAlmostEqual(sparse_lm.block_share("moba", future, config),
                           32 / 48)
    # DSA's tokens: query t chose key 0 (block 0) and, from 16 on, key 20
    # too (block 1); -1 chooses nothing.
    tokens = np.full((1, 32, 3), -1)
    tokens[0, :, 0] = 0
    tokens[0, 16:, 1] = 20
    self.assertAlmostEqual(sparse_lm.block_share("dsa", tokens, config),
                           1.0)
    self.assertEqual(sparse_lm.block_share("dense", None, config), 1.0)

  def test_a_length_not_a_whole_number_of_blocks_is_refused(self):
    config = dataclasses.replace(TINY, seq_len=60)
    with self.assertRaisesRegex(ValueError, "multiple of --sparse_block"):
      sparse_lm.run(config)

  def test_the_whole_run_tiny(self):
    with tempfile.TemporaryDirectory() as workdir:
      payload = sparse_lm.run(dataclasses.replace(TINY, workdir=workdir))
      variants = payload["variants"]
      self.assertEqual(set(variants), set(sparse_lm.VARIANTS))
      for name, result in variants.items():
        self.assertTrue(np.isfinite(result["bits_per_char"]), name)
        self.assertGreater(result["step_seconds"], 0, name)
        self.assertLen(result["step_seconds_turns"], TINY.timed_turns)
      self.assertEqual(variants["dense"]["block_share"], 1.0)
      for name in ("moba", "moba_rows", "nsa"):  # 3 of up to 4: some unread
        self.assertLess(variants[name]["block_share"], 1.0, name)
      # DSA's indexer learns by its KL loss (reported every step).
      kl = [h["indexer_loss"] for h in variants["dsa"]["history"]]
      self.assertTrue(all(x > 0 for x in kl), kl)
      for name in ("results.json", "summary.md", "selection.png"):
        self.assertTrue(os.path.exists(os.path.join(workdir, name)), name)
      with open(os.path.join(workdir, "results.json")) as f:
        self.assertIn("variants", json.load(f))


if __name__ == "__main__":
  absltest.main()
