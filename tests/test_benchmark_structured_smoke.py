"""The structured-pattern benchmark runs end to end on its tiny preset.

No timing is asserted: only that every case produces its rows, ratios and
targets, and that the generated docs section lands between the markers.
Every row of this library must run; only peers that are not installed (or
need a GPU) may show up as "not available" rows.
"""

import json
import os
import pathlib
import tempfile

from absl.testing import absltest

from benchmarks import structured as bench

# window256_T16384 is window256_T4096's program at another shape; the
# memory point's subprocesses are left to test_memory_point_measures_growth.
CASES = [c for c in bench.CASES
         if c not in ("window256_T16384", "memory_T65536")]


class StructuredBenchmarkSmokeTest(absltest.TestCase):

  def test_tiny_preset_writes_its_tables(self):
    # One test, so that parallel workers do not each run the benchmark.
    out = self.enterContext(tempfile.TemporaryDirectory())
    page = pathlib.Path(out) / "page.md"
    page.write_text(f"# Page\n\nintro\n\n{bench.START}\nold\n{bench.END}\n"
                    "\ntail\n")
    rows, ratios = bench.run_benchmark(
        "tiny", out, repeats=1, cases=CASES, memory=False,
        command="tiny smoke", docs_page=page)

    seen = {(r["case"], r["mode"]) for r in rows}
    for name in CASES:
      for mode in bench.build_cases("tiny", None)[name].modes:
        self.assertIn((name, mode), seen)
    for r in rows:
      if r["skipped"]:
        self.assertStartsWith(r["skipped"], "not available")
        self.assertIsNone(r["seconds"])
      else:
        self.assertGreater(r["seconds"], 0.0)
        self.assertGreaterEqual(r["compile_s"], 0.0)
    works_today = {("window256_T4096", "aj_window"),
                   ("window256_T4096", "jax_nn_window"),
                   ("window256_T4096", "aj_dense_mask"),
                   ("packed8x512_T4096", "aj_dense_mask"),
                   ("causal_T2048", "aj_causal"),
                   ("dense_causal_T1024", "aj_dense_noncausal"),
                   ("score_mods_T2048", "aj_soft_cap")}
    for r in rows:
      if (r["case"], r["impl"]) in works_today or r["impl"].startswith("aj_"):
        self.assertIsNone(r["skipped"], r)

    whats = {(r["case"], r["what"]) for r in ratios}
    self.assertIn(("window256_T4096", "ours / jax.nn xla, window"), whats)
    self.assertIn(("causal_T2048", "ours causal / non-causal"), whats)
    self.assertIn(("dense_causal_T1024", "dense causal / non-causal"), whats)
    compile_targets = [r for r in ratios if r["unit"] == "s"]
    self.assertLen(compile_targets, len(CASES))
    for r in ratios:
      if r["what"] == "ours causal / non-causal":
        self.assertGreater(r["value"], 0.0)

    with open(os.path.join(out, "structured.json")) as f:
      self.assertLen(json.load(f)["rows"], len(rows))
    with open(os.path.join(out, "structured.md")) as f:
      md = f.read()
    self.assertIn("| window256_T4096 | 1x2x128x16 | fwd+bwd | aj_window |", md)
    self.assertIn("`tiny smoke`", md)
    text = page.read_text()
    self.assertTrue(text.startswith(f"# Page\n\nintro\n\n{bench.START}\n"))
    self.assertTrue(text.endswith(f"{bench.END}\n\ntail\n"))
    self.assertNotIn("old", text)
    self.assertIn("### Targets", text)

  def test_memory_point_measures_growth(self):
    res = bench.memory_point("aj_window,256,16,32")
    self.assertGreater(res["seconds"], 0.0)
    self.assertGreaterEqual(res["rss_growth_gib"], 0.0)


if __name__ == "__main__":
  absltest.main()
