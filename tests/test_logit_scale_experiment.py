"""The logit-scale experiment, shrunk: it runs end to end, shows the claim."""

import dataclasses
import json
import os
import tempfile

from absl.testing import absltest

from experiments import logit_scale
from experiments import transformer


class LogitScaleExperimentTest(absltest.TestCase):

  def test_unscaled_softmax_saturates_and_scaled_does_not(self):
    workdir = self.enterContext(tempfile.TemporaryDirectory())
    default = logit_scale.LogitScaleConfig()
    config = logit_scale.LogitScaleConfig(
        workdir=workdir, dims=(4, 256), num_queries=64, num_keys=16,
        train=dataclasses.replace(default.train, steps=4, max_len=6,
                                  log_every=1),
        transformer=transformer.TransformerConfig(
            d_model=16, num_heads=1, num_layers=1, ffn_dim=32))
    results = logit_scale.run(config)
    rows = {(r["d_k"], r["scaled"]): r for r in results["rows"]}
    # With unit-variance logits (scaled) the weights do not depend on d_k; at
    # d_k=256 unscaled logits have std 16, so the softmax is nearly one-hot.
    # Bands are wide: 64 queries give means within a few percent.
    self.assertAlmostEqual(rows[(4, True)]["max_prob"],
                           rows[(256, True)]["max_prob"], delta=0.05)
    self.assertGreater(rows[(256, False)]["max_prob"], 0.8)
    self.assertLess(rows[(256, True)]["max_prob"], 0.4)
    self.assertLess(rows[(256, False)]["logit_grad"],
                    0.7 * rows[(256, True)]["logit_grad"])
    with open(os.path.join(workdir, "results.json")) as f:
      self.assertEqual(json.load(f)["rows"], results["rows"])
    self.assertEqual(set(results["training"]), {"scaled", "unscaled"})
    self.assertLen(results["training"]["scaled"]["loss_curve"], 4)
    for name in ("logit_scale.png", "logit_scale_training.png"):
      self.assertTrue(os.path.exists(os.path.join(workdir, name)))
    with open(os.path.join(workdir, "summary.md")) as f:
      summary = f.read()
    self.assertIn("| 256 |", summary)
    self.assertIn("d_k = 16, copy task, lengths 5-6, 4 steps each", summary)


if __name__ == "__main__":
  absltest.main()
