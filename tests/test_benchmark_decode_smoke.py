"""The decode benchmark and the GPU check run end to end at tiny sizes.

No timing is asserted. decode: both modes agree before timing, every program
is traced once, the table has its rows, and the docs section lands between
its markers. gpu_check: on CPU every row that runs passes, cuDNN and ring
say why they are skipped, and an implementation that drops the causal mask
is reported as a FAIL.
"""

import functools
import pathlib
import tempfile
from unittest import mock

from absl.testing import absltest
import jax
import numpy as np

import attention_jax as aj
from benchmarks import decode
from benchmarks import gpu_check


class DecodeSmokeTest(absltest.TestCase):

  def test_tiny_run_checks_times_and_writes_docs(self):
    out = self.enterContext(tempfile.TemporaryDirectory())
    page = pathlib.Path(out) / "page.md"
    page.write_text(f"# Page\n\n{decode.START}\nold\n{decode.END}\n\ntail\n")
    # The paragraph wraps at 76 columns, so where the command lands depends
    # on the machine's description: a long CPU name stands in for any.
    self.enterContext(mock.patch.object(
        decode, "machine", lambda: "64-core CPU (AMD EPYC 9654 96-Core "
        "Processor with a long name), jax 0.0 cpu backend, 1 x cpu"))
    rows = decode.run_benchmark(
        batch_sizes=(2,), context=6, d_model=8, num_heads=2, layers=2,
        prompt_len=2, repeats=1, check_steps=3, command="tiny smoke",
        docs_page=page, shared_prefix=(2, 5, 3), latent=True)

    self.assertEqual([(r["batch"], r["mode"]) for r in rows],
                     [(2, "cache"), (2, "recompute")])
    for r in rows:
      self.assertEqual(r["steps"], 4)  # context - prompt
      self.assertGreater(r["tokens_per_s"], 0.0)
      self.assertLessEqual(r["check_max_diff"], decode.CHECK_TOL)
      self.assertEqual(r["speedup"] is None, r["mode"] == "recompute")
    text = page.read_text()
    self.assertTrue(text.startswith(f"# Page\n\n{decode.START}\n"))
    self.assertTrue(text.endswith(f"{decode.END}\n\ntail\n"))
    self.assertNotIn("old", text)
    self.assertIn("`tiny smoke`", " ".join(text.split()))  # any wrapping
    self.assertIn("| 2 | recompute |", text)
    # The variant rows: each checked against its plain path, then timed.
    self.assertIn("| shared prefix | 2 | 5 | 3 |", text)
    self.assertIn("| MultiHeadLatentAttention | 2 | 6 |", text)

  def test_report_names_the_command_on_any_machine(self):
    rows = [dict(batch=1, mode=m, prefill_ms=1.0, tokens_per_s=1.0,
                 ms_per_token=1.0, speedup=None, steps=1, check_max_diff=0.0)
            for m in decode.MODES]
    config = dict(context=2, d_model=8, num_heads=2, layers=1, prompt_len=1,
                  repeats=1, implementation=None, load=[None, 1.5])
    for name in ("CPU", "2-core CPU (Intel(R) Xeon(R) CPU @ 2.20GHz)",
                 "2-core CPU (AMD EPYC)",
                 "96-core CPU (" + "a-very-long-model-name " * 5 + ")"):
      with mock.patch.object(decode, "machine", lambda name=name: name):
        text = decode.report(rows, config, "python -m benchmarks.decode "
                             "--batch_sizes=1,8 --repeats=3")
      flat = " ".join(text.split())
      self.assertIn(f"Measured on a {name};", flat)
      self.assertIn("`python -m benchmarks.decode --batch_sizes=1,8 "
                    "--repeats=3`", flat)

  def test_a_wrong_cache_is_caught(self):
    # Outputs off by more than the tolerance at one step must raise before
    # anything is timed (stand-ins for the programs: no compile needed).
    def outputs(shift):
      return lambda prompt, steps, keep: (0.0, 0.0, [
          np.full((1, 1, 4), float(i) + (shift if i == steps else 0.0))
          for i in range(steps + 1)])

    programs = {"cache": mock.Mock(generate=outputs(0.0)),
                "recompute": mock.Mock(generate=outputs(1e-2))}
    with self.assertRaisesRegex(RuntimeError, "differs from recomputation"):
      decode.check_equal(programs, None, 3)
    programs["recompute"] = mock.Mock(generate=outputs(1e-6))
    self.assertAlmostEqual(decode.check_equal(programs, None, 3), 1e-6)


class GpuCheckSmokeTest(absltest.TestCase):

  def test_quick_mode_passes_and_says_why_it_skips(self):
    out = self.enterContext(tempfile.TemporaryDirectory())
    # dense is left out: "auto" runs it at these sizes (without the lse).
    results = gpu_check.run_check(
        quick=True, cases=("segments",), repeats=1, dtypes=("float32",),
        impls=("auto", "flash", "cudnn", "ring"),
        out=str(pathlib.Path(out) / "r.json"))
    self.assertEqual(results["failed"], 0)
    rows = {(r["level"], r["case"], r["impl"]): r for r in results["checks"]}
    for impl in ("auto", "flash"):
      for level in ("sdpa", "mha"):
        self.assertEqual(rows[level, "segments", impl]["status"], "PASS")
    self.assertIsNotNone(rows["sdpa", "segments", "flash"]["lse_err"])
    if jax.default_backend() != "gpu":
      self.assertIn("needs a GPU", rows["sdpa", "segments", "cudnn"]["reason"])
    if len(jax.devices()) == 1:
      self.assertIn("device", rows["sdpa", "segments", "ring"]["reason"])
    timed = {(r["impl"], r["mode"]) for r in results["timings"] if r["ms"]}
    self.assertContainsSubset(
        {("auto", "fwd"), ("flash", "fwd+bwd")}, timed)
    self.assertTrue((pathlib.Path(out) / "r.json").exists())

  def test_the_paged_level_checks_a_decoding_step(self):
    rows = gpu_check.check_paged(
        "float32", ("auto", "flash", "paged_gpu", "paged_tpu"), quick=True)
    by = {(r["case"], r["impl"]): r for r in rows}
    for case in gpu_check.PAGED_CASES:
      for impl in ("auto", "flash"):
        self.assertEqual(by[case, impl]["status"], "PASS", (case, impl))
        self.assertIsNotNone(by[case, impl]["lse_err"])
    if jax.default_backend() == "cpu":
      self.assertIn("needs a GPU", by["decode_causal", "paged_gpu"]["reason"])
      self.assertIn("needs a TPU", by["decode_causal", "paged_tpu"]["reason"])
    # The paged kernels are checked here only: a dense call is not theirs.
    for level in ("sdpa", "mha"):
      self.assertNotIn("paged_gpu", gpu_check.implementations(level))

  def test_pattern_timings_run_or_say_why(self):
    rows = gpu_check.time_patterns(quick=True, repeats=1,
                                   impls=("flash", "jax.nn"),
                                   patterns=("causal", "sinks"))
    by = {(r["pattern"], r["impl"], r["mode"]): r for r in rows}
    for impl in ("flash", "jax.nn"):
      self.assertGreater(by["causal", impl, "fwd+bwd"]["ms"], 0)
    self.assertIsNone(by["sinks", "jax.nn", "fwd"]["ms"])
    self.assertIn("sinks", by["sinks", "jax.nn", "fwd"]["reason"])
    self.assertIn("(1.00x)", gpu_check.patterns_table(rows))
    late = gpu_check.time_patterns(quick=True, repeats=1,
                                   impls=("flash",), budget_s=0.0,
                                   patterns=("causal",))
    self.assertTrue(all("budget" in r["reason"] for r in late))

  def test_a_dropped_causal_mask_fails(self):
    def no_causal(impl):
      fn = functools.partial(aj.scaled_dot_product_attention,
                             implementation=impl)
      return lambda q, k, v, is_causal=False, **kw: fn(q, k, v, **kw)

    case = gpu_check.build_case("causal", gpu_check.sizes(quick=True))
    with mock.patch.object(gpu_check, "_sdpa_fn", no_causal):
      (row,) = gpu_check.check_sdpa(case, "float32", ("dense",))
    self.assertEqual(row["status"], "FAIL")
    self.assertGreater(row["out_err"], gpu_check.TOLERANCES["float32"]["fwd"])


if __name__ == "__main__":
  absltest.main()
