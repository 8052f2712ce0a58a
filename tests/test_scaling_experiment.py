"""The scaling experiment, shrunk: it runs end to end and shows the claim."""

import json
import os
import tempfile

from absl.testing import absltest

from experiments import scaling


class ScalingExperimentTest(absltest.TestCase):

  def test_unscaled_softmax_saturates_and_scaled_does_not(self):
    workdir = self.enterContext(tempfile.TemporaryDirectory())
    config = scaling.ScalingConfig(workdir=workdir, dims=(4, 256),
                                   num_queries=64, num_keys=16, train_steps=4,
                                   train_d_model=16, train_max_len=6)
    results = scaling.run(config)
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
    for name in ("scaling.png", "scaling_training.png"):
      self.assertTrue(os.path.exists(os.path.join(workdir, name)))
    with open(os.path.join(workdir, "summary.md")) as f:
      self.assertIn("| 256 |", f.read())


if __name__ == "__main__":
  absltest.main()
