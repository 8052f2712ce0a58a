"""The benchmark script runs end to end on a tiny config (no timing asserted)."""

import os
import tempfile

from absl.testing import absltest

from benchmarks import attention as bench


class BenchmarkSmokeTest(absltest.TestCase):

  def test_tiny_preset_writes_its_table(self):
    out = self.enterContext(tempfile.TemporaryDirectory())
    rows = bench.run_benchmark("tiny", out, repeats=1, memory=False,
                               only=["aj_blockwise", "aj_dense", "jax_nn"])
    self.assertEqual({r["impl"] for r in rows},
                     {"aj_blockwise", "aj_dense", "jax_nn"})
    for r in rows:
      self.assertGreater(r["seconds"], 0.0)
      self.assertGreater(r["peak_share"], 0.0)
      self.assertIsNotNone(r["vs_jax_nn"])
    for name in ("benchmark.md", "benchmark.json", "benchmark.png"):
      self.assertTrue(os.path.exists(os.path.join(out, name)))
    with open(os.path.join(out, "benchmark.md")) as f:
      self.assertIn("| aj_blockwise | 1x2 | 64 | float32 | fwd+bwd |", f.read())


if __name__ == "__main__":
  absltest.main()
