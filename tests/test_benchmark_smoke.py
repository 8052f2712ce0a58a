"""The benchmark script runs end to end on a tiny config (no timing asserted)."""

import json
import os
import pathlib
import subprocess
import sys
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

  def test_ring_memory_writes_its_table(self):
    # Its own process: the script sets the simulated device count.
    out = self.enterContext(tempfile.TemporaryDirectory())
    root = pathlib.Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, "-m", "benchmarks.ring_memory",
                    "--lengths=256", "--heads=1", "--devices=2",
                    f"--out={out}"], cwd=root, check=True,
                   capture_output=True, timeout=300)
    with open(os.path.join(out, "ring_memory.json")) as f:
      (row,) = json.load(f)
    # The dense backward holds several T x S score matrices (256 KiB each);
    # a device of the ring holds blocks and its half of q, k, v only.
    self.assertGreater(row["dense_1dev"], 256 * 256 * 4)
    self.assertLess(row["ring_per_device"], row["dense_1dev"])

  def test_blockwise_bound_prints_its_table(self):
    root = pathlib.Path(__file__).resolve().parent.parent
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.blockwise_bound", "--t=128",
         "--block_q=64", "--block_k=32", "--repeats=1"], cwd=root,
        check=True, capture_output=True, text=True, timeout=300)
    for name in ("blockwise", "dots_only", "softmax_only"):
      self.assertRegex(result.stdout, rf"\| {name} \| \d+\.\d+ \|")


if __name__ == "__main__":
  absltest.main()
