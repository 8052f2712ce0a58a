"""The chunked-prefill benchmark runs end to end at tiny sizes.

No timing is asserted: the paths agree before timing, every program is
traced once, the table has its rows, the docs section lands between its
markers, a wrong output is caught before anything is timed, and a memory
point measures a growth.
"""

import pathlib
import tempfile
from unittest import mock

from absl.testing import absltest
import numpy as np

from benchmarks import chunked_prefill as bench
from benchmarks import decode

TINY = dict(d_model=16, num_heads=4, num_kv_heads=2, window=8)


class ChunkedPrefillSmokeTest(absltest.TestCase):

  def test_tiny_run_checks_times_and_writes_docs(self):
    out = self.enterContext(tempfile.TemporaryDirectory())
    page = pathlib.Path(out) / "page.md"
    page.write_text(f"# Page\n\n{bench.START}\nold\n{bench.END}\n\ntail\n")
    self.enterContext(mock.patch.object(
        decode, "machine", lambda: "2-core CPU (Some CPU), jax 0.0 cpu "
        "backend, 1 x cpu"))
    rows = bench.run_benchmark(
        tokens=16, chunk=4, cache=64, repeats=1, decode_steps=3,
        memory=False, command="tiny smoke", docs_page=page, **TINY)

    self.assertEqual([r["path"] for r in rows],
                     ["chunked", "uncached", "decode step"])
    for r in rows:
      self.assertGreater(r["tokens_per_s"], 0.0)
      self.assertLessEqual(r["check_max_diff"], bench.CHECK_TOL)
      self.assertIsNone(r["rss_growth_mib"])
    self.assertEqual(rows[1]["ratio"], 1.0)
    text = page.read_text()
    self.assertTrue(text.startswith(f"# Page\n\n{bench.START}\n"))
    self.assertTrue(text.endswith(f"{bench.END}\n\ntail\n"))
    self.assertNotIn("old", text)
    flat = " ".join(text.split())
    self.assertIn("Measured on a 2-core CPU (Some CPU)", flat)
    self.assertIn("`tiny smoke`", flat)
    self.assertIn("| chunked | 4 x 4 tokens into 64 slots |", text)
    self.assertIn("| decode step | 1 token over 64 slots |", text)

  def test_a_wrong_output_is_caught(self):
    want = np.zeros((1, 4, 8), np.float32)
    with self.assertRaisesRegex(RuntimeError, "exceeds the tolerance"):
      bench.max_diff(want + 1e-2, want, "chunked")
    with self.assertRaisesRegex(RuntimeError, "exceeds the tolerance"):
      bench.max_diff(np.full_like(want, np.nan), want, "chunked")
    self.assertAlmostEqual(bench.max_diff(want + 1e-6, want, "chunked"),
                           1e-6)

  def test_sizes_that_do_not_fit_are_refused(self):
    with self.assertRaisesRegex(ValueError, "--chunk .* must divide"):
      bench.check_sizes(tokens=10, chunk=4, cache=64, decode_steps=1)
    with self.assertRaisesRegex(ValueError, "at least 20"):
      bench.check_sizes(tokens=16, chunk=4, cache=16, decode_steps=4)

  def test_memory_point_measures_growth(self):
    for path in bench.PATHS:
      res = bench.memory_point(f"{path},16,4,64,16,4,2,8")
      self.assertGreater(res["seconds"], 0.0)
      self.assertGreaterEqual(res["rss_growth_mib"], 0.0)


if __name__ == "__main__":
  absltest.main()
