"""The serving experiment end to end, at a tiny size: continuous batching
over a paged cache and the static baseline give every request the tokens
of generating it alone.

One run serves every assertion about it, in one test so that pytest-xdist
never splits it over workers (each would pay the run's compiles).
"""

import dataclasses
import json
import os
import re
import tempfile

from absl import flags as absl_flags
from absl.testing import absltest
import numpy as np

from experiments import config_flags
from experiments import lm_data
from experiments import lm_model
from experiments import serve
from experiments import training
import run


def _tiny(workdir, **changes):
  # 6 requests of 4-24 prompt tokens and 2-10 outputs over 2 rows: rows
  # are freed and reused; a pool of 12 pages of 4 tokens (longest request
  # 33 tokens and a drafted tree of 9 nodes: 11 pages) makes admission wait
  # for pages too; prompts in chunks of 4 (three compiled paged shapes, T =
  # 1, 2, 4); both drafts, the draft model trained 3 steps.
  config = serve.ServeConfig(
      workdir=workdir, requests=6, min_prompt=4, max_prompt=24,
      min_output=2, max_output=10, arrival_rate=0.5, slots=2, page_size=4,
      num_pages=12, prefill_chunk=4, lm_checkpoint="", accuracy_rows=3,
      draft_steps=3, eviction_rows=2,
      model=lm_model.LMModelConfig(d_model=16, num_heads=2, num_layers=1,
                                   ffn_dim=32),
      train=training.TrainConfig(steps=3, batch_size=4, learning_rate=1e-2,
                                 checkpoint_every=0, log_every=1))
  return dataclasses.replace(config, **changes)


class ServeRunTest(absltest.TestCase):

  def test_one_run(self):
    self.workdir = self.enterContext(tempfile.TemporaryDirectory())
    self.config = _tiny(self.workdir)
    self.payload = serve.run(self.config)
    for check in (self._writes_the_report,
                  self._every_request_matches_its_alone_generation,
                  self._the_static_baseline_gives_the_same_tokens,
                  self._pages_are_freed_at_the_end,
                  self._a_later_request_reuses_released_pages,
                  self._a_new_row_prefills_while_another_decodes,
                  self._requests_follow_the_workload,
                  self._metrics_are_consistent,
                  self._speculative_decoding_gives_the_same_tokens,
                  self._reports_the_quantised_caches):
      with self.subTest(check.__name__):
        check()

  def _writes_the_report(self):
    self.assertContainsSubset({"report.md", "results.json",
                               "pages_in_use.png"},
                              set(os.listdir(self.workdir)))
    with open(os.path.join(self.workdir, "results.json")) as f:
      saved = json.load(f)
    self.assertEqual(saved["systems"]["paged"]["check"]["matching"], 6)
    # Three timed rounds (the default), each system's pass in each.
    for name in ("paged", "static"):
      self.assertLen(saved["systems"][name]["timed_pass_wall_s"], 3)
    self.assertLen(saved["comparison"]["tokens_per_s_ratio_by_round"], 3)
    with open(os.path.join(self.workdir, "report.md")) as f:
      text = f.read()
    self.assertIn("| paged |", text)
    self.assertIn("| static |", text)
    self.assertIn("6/6", text)

  def _every_request_matches_its_alone_generation(self):
    check = self.payload["systems"]["paged"]["check"]
    self.assertEqual(check, {"requests": 6, "matching": 6, "near_ties": [],
                             "mismatches": []})
    self.assertTrue(self.payload["systems"]["paged"]["passes_equal"])
    records = self.payload["requests"]["paged"]
    wanted = self.payload["workload"]["max_tokens"]
    self.assertEqual([len(r["tokens"]) for r in records], wanted)

  def _the_static_baseline_gives_the_same_tokens(self):
    check = self.payload["systems"]["static"]["check"]
    self.assertEqual(check["matching"], 6, check)
    self.assertTrue(self.payload["systems"]["static"]["passes_equal"])
    paged, static = (self.payload["requests"][s] for s in ("paged", "static"))
    self.assertEqual([r["tokens"] for r in paged],
                     [r["tokens"] for r in static])

  def _pages_are_freed_at_the_end(self):
    paged = self.payload["systems"]["paged"]
    self.assertEqual(paged["pages_in_use_at_end"], 0)
    self.assertGreater(paged["peak_pages_in_use"], 0)
    self.assertLessEqual(paged["peak_pages_in_use"], self.config.num_pages)

  def _a_later_request_reuses_released_pages(self):
    records = self.payload["requests"]["paged"]
    reused = []
    for later in records:
      for earlier in records:
        if (earlier["finish_step"] < later["admit_step"]
            and set(earlier["pages"]) & set(later["pages"])):
          reused.append((earlier["index"], later["index"]))
    self.assertNotEmpty(reused)
    self.assertGreater(
        self.payload["systems"]["paged"]["requests_reusing_freed_pages"], 0)
    # Two rows for six requests: some row served three or more requests.
    rows = [r["row"] for r in records]
    self.assertGreaterEqual(max(rows.count(0), rows.count(1)), 3)
    # Each request held the pages of its cache: prompt + output - 1 tokens.
    for r in records:
      need = -(-(r["prompt_tokens"] + r["max_tokens"] - 1) // 4)
      self.assertLen(r["pages"], need)

  def _a_new_row_prefills_while_another_decodes(self):
    # A mixed step: b admitted (its prompt fed from admit_step on) while a
    # is past its first token and not finished.
    records = self.payload["requests"]["paged"]
    mixed = [(a["index"], b["index"]) for a in records for b in records
             if a["first_token_step"] < b["admit_step"] < a["finish_step"]]
    self.assertNotEmpty(mixed)
    # Such a step makes two calls: the prefilling row alone (1 x T), then
    # every row decoding one token (2 x 1).
    steps = [s for s in self.payload["paged_log"]
             if s["prefilling"] == 1 and s["decoding"] == 1]
    self.assertNotEmpty(steps)
    for s in steps:
      self.assertEqual([(c["rows"], c["T"] if c["rows"] == 2 else "T")
                        for c in s["calls"]], [(1, "T"), (2, 1)])

  def _requests_follow_the_workload(self):
    corpus = lm_data.build_corpus(self.config.seq_len,
                                  self.config.valid_fraction, 0)
    requests = serve.workload(self.config, corpus)
    # The workload is a pure function of the config.
    again = serve.workload(self.config, corpus)
    for a, b in zip(requests, again):
      np.testing.assert_array_equal(a.prompt, b.prompt)
    arrivals = [r.arrival for r in requests]
    self.assertEqual(arrivals[0], 0)
    self.assertEqual(arrivals, sorted(arrivals))
    for r in requests:
      self.assertBetween(len(r.prompt), 4, 24)
      self.assertBetween(r.max_tokens, 2, 10)
      self.assertEqual(r.prompt[0], lm_data.BOS)
      # Real text of the named validation document.
      text = corpus.vocab.decode(r.prompt)
      self.assertIn(text, lm_data.load_documents()[r.document])
    for record in self.payload["requests"]["paged"]:
      self.assertGreaterEqual(record["admit_step"], record["arrival_step"])
      self.assertGreaterEqual(record["first_token_s"], record["arrival_s"])
      self.assertGreaterEqual(record["finish_s"], record["first_token_s"])

  def _metrics_are_consistent(self):
    for name in ("paged", "static"):
      s = self.payload["systems"][name]
      self.assertEqual(s["generated_tokens"],
                       sum(self.payload["workload"]["max_tokens"]))
      self.assertGreater(s["tokens_per_s"], 0.0)
      self.assertBetween(s["useful_share"], 0.0, 1.0)
    # Paged: the pool; static: 2 rows x its longest batch, 1 layer of 2
    # heads of 8 dims, keys and values in float32.
    per_token = 2 * 8 * 2 * 4
    self.assertEqual(self.payload["bytes_per_token"], per_token)
    self.assertEqual(self.payload["systems"]["paged"]["cache_bytes"],
                     12 * 4 * per_token)
    longest = max(b["length"] for b in self.payload["static_batches"])
    self.assertEqual(self.payload["systems"]["static"]["cache_bytes"],
                     2 * longest * per_token)

  def _speculative_decoding_gives_the_same_tokens(self):
    plain = [r["tokens"] for r in self.payload["requests"]["paged"]]
    for name in ("paged+ngram", "paged+model"):
      s = self.payload["systems"][name]
      self.assertEqual(s["check"]["matching"], 6, s["check"])
      self.assertTrue(s["passes_equal"])
      self.assertEqual(s["pages_in_use_at_end"], 0)  # no leaked page
      self.assertEqual(s["generated_tokens"],
                       sum(self.payload["workload"]["max_tokens"]))
      # Each verification emits its accepted drafted tokens and one more.
      self.assertAlmostEqual(s["mean_tokens_per_verify"],
                             s["mean_accepted"] + 1)
      self.assertGreater(s["verified_trees"], 0)
      self.assertLen(self.payload["comparison"][
          f"{name}_tokens_per_s_ratio_by_round"], 3)
      self.assertEqual(plain, [r["tokens"] for r in self.payload[
          "requests"][name]])
    with open(os.path.join(self.workdir, "report.md")) as f:
      text = f.read()
    self.assertIn("## Speculative decoding", text)
    self.assertIn("eviction.png", os.listdir(self.workdir))
    eviction = self.payload["eviction"]
    self.assertEqual(eviction["protocol"]["rows"], 2)
    self.assertContainsSubset({"full", "streaming", "h2o", "snapkv"},
                              set(eviction))
    self.assertIn("## Evicting keys", text)
    self.assertIn("| paged+ngram |", text)

  def _reports_the_quantised_caches(self):
    accuracy = self.payload["cache_accuracy"]
    self.assertEqual(list(accuracy), ["float32", "bfloat16", "int8",
                                      "float8_e4m3fn"])
    # 3 rows of at most seq_len transitions, the same positions for each.
    positions = {a["positions"] for a in accuracy.values()}
    self.assertLen(positions, 1)
    self.assertBetween(positions.pop(), 3, 3 * self.config.seq_len)
    self.assertEqual(accuracy["float32"]["greedy_agreement"], 1.0)
    self.assertEqual(accuracy["float32"]["attention_max_abs_error"], [0.0])
    # 2 heads of 8 dims, keys and values: int8 values and a float32 scale
    # per token and head.
    self.assertEqual(accuracy["int8"]["bytes_per_token"], 2 * 2 * (8 + 4))
    with open(os.path.join(self.workdir, "report.md")) as f:
      self.assertIn("| int8 |", f.read())


class ServeConfigTest(absltest.TestCase):

  def test_a_pool_smaller_than_the_longest_request_is_refused(self):
    with self.assertRaisesRegex(ValueError, "cannot hold the longest"):
      serve.check_config(_tiny("", num_pages=8))

  def test_lengths_are_drawn_log_uniform_or_uniform_within_bounds(self):
    n = 4000
    log_uniform = serve.draw_lengths(np.random.default_rng(0), "log_uniform",
                                     16, 1024, n)
    uniform = serve.draw_lengths(np.random.default_rng(0), "uniform", 16,
                                 1024, n)
    for x in (log_uniform, uniform):
      self.assertEqual((x.min(), x.max()), (16, x.max()))
      self.assertBetween(x.max(), 1000, 1024)
    # Medians: the bounds' geometric mean (128) against their midpoint
    # (520); the ranges are about three standard errors of 4000 draws.
    self.assertBetween(np.median(log_uniform), 115, 143)
    self.assertBetween(np.median(uniform), 490, 550)
    with self.assertRaisesRegex(ValueError, "distribution must be one of"):
      serve.draw_lengths(np.random.default_rng(0), "normal", 1, 2, 3)

  def test_bucket(self):
    self.assertEqual([serve.bucket(n, 64) for n in (1, 2, 3, 5, 33, 64)],
                     [1, 2, 4, 8, 64, 64])
    self.assertEqual(serve.bucket(40, 48), 48)


class ServeFlagsTest(absltest.TestCase):

  def tearDown(self):
    run.flags.FLAGS.unparse_flags()
    super().tearDown()

  def test_flags_land_in_the_config(self):
    run.flags.FLAGS([
        "run.py", "--experiment=serve", "--serve_requests=5",
        "--serve_slots=3", "--serve_page_size=8", "--serve_num_pages=50",
        "--serve_max_prompt=100", "--serve_prefill_chunk=0", "--seed=2",
        "--serve_steps=7", "--lm_d_model=32", "--workdir=/w",
        "--serve_lengths=uniform"])
    run.check_flags(run.flags.FLAGS)
    got = config_flags.from_flags(serve.ServeConfig, run.flags.FLAGS)
    want = serve.ServeConfig()
    self.assertEqual(got, dataclasses.replace(
        want, workdir="/w", requests=5, slots=3, page_size=8, num_pages=50,
        max_prompt=100, prefill_chunk=0, lengths="uniform",
        model=dataclasses.replace(want.model, d_model=32),
        train=dataclasses.replace(want.train, steps=7, seed=2)))

  def test_defaults_and_refusals(self):
    run.flags.FLAGS(["run.py", "--experiment=serve"])
    self.assertEqual(config_flags.from_flags(serve.ServeConfig,
                                             run.flags.FLAGS),
                     serve.ServeConfig())
    run.flags.FLAGS.unparse_flags()
    with self.assertRaisesRegex(
        absl_flags.Error,
        re.escape("--serve_min_prompt must not exceed --serve_max_prompt.")):
      run.flags.FLAGS(["run.py", "--experiment=serve",
                       "--serve_min_prompt=300", "--serve_max_prompt=200"])
    run.flags.FLAGS.unparse_flags()
    run.flags.FLAGS(["run.py", "--experiment=serve", "--lm_steps=3"])
    with self.assertRaisesRegex(run.app.UsageError,
                                "--experiment=serve reads --serve_steps"):
      run.check_flags(run.flags.FLAGS)


if __name__ == "__main__":
  absltest.main()
