"""The language-model experiment end to end, at a tiny size.

One run of all three variants serves most assertions, all in one test so
that pytest-xdist never splits it over workers (each would pay the run); the
checks after it build their models as ``lm.run`` does (under the mesh, state
placed on it), so they reuse its compiled programs.
"""

import dataclasses
import json
import math
import os
import tempfile
from unittest import mock

from absl.testing import absltest
import jax
import numpy as np

from experiments import checkpoints
from experiments import lm
from experiments import lm_data
from experiments import lm_generate
from experiments import lm_model
from experiments import parallel
from experiments import training


def _tiny(workdir, **changes):
  config = lm.LMConfig(
      workdir=workdir, seq_len=32, window=4, doc_start_chars=8,
      model=lm_model.LMModelConfig(d_model=16, num_heads=2, num_layers=1,
                                   ffn_dim=32),
      train=training.TrainConfig(steps=4, batch_size=4, learning_rate=1e-2,
                                 checkpoint_every=0, log_every=1),
      gen_tokens=6)
  return dataclasses.replace(config, **changes)


def _as_run_builds_it(config, variant, vocab_size):
  """A fresh model built and placed as ``lm.run`` does, and its mesh."""
  mesh = training.training_mesh(config.train)
  with jax.set_mesh(mesh):
    model = lm.build_model(variant, config, vocab_size, mesh)
  parallel.shard_state(model, mesh)
  return model, mesh


class RunTest(absltest.TestCase):

  def test_one_run_of_every_variant(self):
    self.workdir = self.enterContext(tempfile.TemporaryDirectory())
    self.config = _tiny(self.workdir)
    self.payload = lm.run(self.config)
    self.files = set(os.listdir(self.workdir))
    with open(os.path.join(self.workdir, "summary.md")) as f:
      self.summary = f.read()
    self.corpus = lm_data.build_corpus(self.config.seq_len,
                                       self.config.valid_fraction, 0)
    for check in (self._writes_the_report,
                  self._every_variant_trains_one_step_after_another,
                  self._validation_bits_per_character,
                  self._bits_per_character_recomputed_from_logits,
                  self._cached_generation_equals_recomputation,
                  self._only_naive_attends_across_documents,
                  self._only_naive_predictions_depend_on_the_predecessor,
                  self._leakage_recomputed_from_logits,
                  self._ragged_cached_greedy_of_a_fresh_model,
                  self._interrupted_and_resumed_run_equals_uninterrupted,
                  self._checkpoint_of_other_flags_is_refused):
      with self.subTest(check.__name__):
        check()

  def _writes_the_report(self):
    self.assertContainsSubset(
        {"results.json", "summary.md", "loss_curves.png",
         "boundary_attention.png", "where_it_looks.png", "leakage.png",
         *(f"attention_{v}.png" for v in lm.VARIANTS)}, self.files)
    self.assertCountEqual(os.listdir(os.path.join(self.workdir,
                                                  "checkpoints")),
                          lm.VARIANTS)
    summary = self.summary
    for variant in lm.VARIANTS:
      self.assertIn(f"### {variant}, greedy", summary)
      self.assertIn(f"### {variant}, sampled", summary)
    self.assertIn(f"{lm.PROMPTS[0]}\u2502", summary)
    self.assertIn("## Leakage across documents", summary)

  def _every_variant_trains_one_step_after_another(self):
    for variant in lm.VARIANTS:
      with self.subTest(variant):
        train = self.payload["variants"][variant]["train"]
        curve = np.array(train["loss_curve"])
        np.testing.assert_array_equal(curve[:, 0], [1, 2, 3, 4])
        self.assertTrue(np.isfinite(curve).all())
        # From about log(106) = 4.66 nats (plus what random logits add),
        # four Adam steps at lr 1e-2 must help.
        self.assertLess(curve[-1, 1], curve[0, 1])

  def _validation_bits_per_character(self):
    valid_docs = len(self.corpus.valid_names)
    for variant in lm.VARIANTS:
      with self.subTest(variant):
        valid = self.payload["variants"][variant]["valid"]
        self.assertEqual(valid["chars"],
                         int(self.corpus.valid.target_weights().sum()))
        # Every validation document has its first 8 characters scored.
        self.assertEqual(valid["doc_start_chars"], 8 * valid_docs)
        for key in ("bits_per_char", "bits_per_char_doc_start",
                    "bits_per_char_rest"):
          # Near-uniform after 4 steps: below log2(V) plus slack, above 0.
          self.assertBetween(valid[key], 0.5,
                             math.log2(self.corpus.vocab.size) + 1.0)

  def _fresh_model_logits(self):
    """A fresh segments model, and its float64 logits ``[B, T, V]`` of
    four validation rows and of the naive leakage rows, from one (eager,
    so slow to dispatch) call for both checks that need them."""
    if not hasattr(self, "_fresh"):
      model, mesh = _as_run_builds_it(self.config, "segments",
                                      self.corpus.vocab.size)
      valid = self.corpus.valid
      rows = lm_data.Packed(valid.tokens[:4], valid.segment_ids[:4],
                            valid.doc_positions[:4])
      leak = lm.leakage_rows(valid, self.config.seq_len, 8)
      inputs, _, _, ids = lm_data.batch(rows, np.arange(4))
      with jax.set_mesh(mesh):
        logits = np.asarray(model(
            np.concatenate([inputs, leak.inputs.reshape(-1, 32)]),
            np.concatenate([ids, np.ones_like(leak.inputs).reshape(-1, 32)])),
            np.float64)
      self._fresh = (model, mesh, rows, logits[:4], leak, logits[4:])
    return self._fresh

  def _bits_per_character_recomputed_from_logits(self):
    # evaluate's numbers against -log2 p(target) written out in float64
    # from one batch's logits: four validation rows, every target weighted
    # by whether it belongs to its input's document.
    model, mesh, rows, logits, _, _ = self._fresh_model_logits()
    with jax.set_mesh(mesh):
      got = lm.evaluate(model, "segments", rows, 4, start_chars=8)
    _, targets, weights, _ = lm_data.batch(rows, np.arange(4))
    top = logits.max(-1, keepdims=True)
    log_p = logits - top - np.log(np.exp(logits - top).sum(-1,
                                                           keepdims=True))
    nats = -np.take_along_axis(log_p, targets[..., None], -1)[..., 0]
    bits = nats / np.log(2.0)
    start = weights * (rows.doc_positions[:, 1:] <= 8)
    for key, w in (("bits_per_char", weights), ("bits_per_char_doc_start",
                                                start),
                   ("bits_per_char_rest", weights - start)):
      # float32 logits and log-softmax against float64: ~1e-6 relative.
      self.assertAlmostEqual(got[key], float((bits * w).sum() / w.sum()),
                             delta=1e-5 * got[key], msg=key)
    self.assertEqual(got["chars"], int(weights.sum()))

  def _cached_generation_equals_recomputation(self):
    lengths = {len(p) for p in self.config.prompts}
    self.assertLen(lengths, len(self.config.prompts))  # ragged prompts
    for variant in lm.VARIANTS:
      with self.subTest(variant):
        gen = self.payload["variants"][variant]["generation"]
        check = gen["check"]
        self.assertTrue(check["passed"], check)
        self.assertTrue(check["tokens_equal"], check)
        self.assertLessEqual(check["max_abs_logit_diff"],
                             lm_generate.LOGIT_TOL)
        self.assertLen(gen["greedy"], len(self.config.prompts))
        self.assertTrue(all(len(s) <= 6 for s in gen["sampled"]))
        rates = gen["throughput"]["greedy"]
        self.assertEqual(rates["prefill_tokens"],
                         sum(len(p) + 1 for p in self.config.prompts))
        self.assertEqual(rates["decode_tokens"], 4 * 5)
        self.assertGreater(rates["decode_tokens_per_s"], 0.0)

  def _only_naive_attends_across_documents(self):
    mass = {v: self.payload["variants"][v]["cross_document_mass"]
            for v in lm.VARIANTS}
    # Segment ids mask the other document exactly (weights are 0, not
    # small); the naive model spreads weight over it from the start.
    self.assertEqual(mass["segments"], [0.0])
    self.assertEqual(mass["window"], [0.0])
    self.assertGreater(mass["naive"][0], 0.05)

  def _only_naive_predictions_depend_on_the_predecessor(self):
    with open(os.path.join(self.workdir, "results.json")) as f:
      saved = json.load(f)
    self.assertLen(saved["leakage_documents"], lm.LEAKAGE_TRIPLES)
    for variant in lm.VARIANTS:
      with self.subTest(variant):
        leak = saved["variants"][variant]["leakage"]
        self.assertEqual(leak["chars"], 8)  # doc_start_chars of _tiny
        self.assertEqual(leak["triples"], lm.LEAKAGE_TRIPLES)
        if variant == "naive":
          # One undivided row: D's first characters see A or B.
          self.assertFalse(leak["bitwise_equal"])
          self.assertGreater(leak["max_abs_log_prob_diff"], 1e-3)
          self.assertGreater(leak["mean_kl_bits"], 0.0)
          self.assertGreater(leak["kl_bits_per_position"][0], 0.0)
        else:
          # Segment ids, D at the same offset: the same operations on the
          # same numbers, so exactly equal, not merely close.
          self.assertTrue(leak["bitwise_equal"])
          for key in ("max_abs_log_prob_diff", "mean_kl_bits",
                      "mean_abs_bits_diff", "bits_per_char_abs_diff"):
            self.assertEqual(leak[key], 0.0, key)
          self.assertEqual(leak["kl_bits_per_position"], [0.0] * 8)

  def _leakage_recomputed_from_logits(self):
    # leakage's numbers against KL and -log2 p written out in float64 from
    # the logits of a fresh (untrained) naive model; its segment-id twin
    # exactly 0 on the same rows.
    model, mesh, _, _, rows, logits = self._fresh_model_logits()
    with jax.set_mesh(mesh):
      twin = lm.leakage(model, "segments", rows)
      got = lm.leakage(model, "naive", rows)
    self.assertTrue(twin["bitwise_equal"])
    self.assertEqual(twin["mean_kl_bits"], 0.0)
    logits = logits.reshape(2, lm.LEAKAGE_TRIPLES, 32, -1)[
        :, :, rows.offset:rows.offset + 8]  # [2, K, C, V]
    top = logits.max(-1, keepdims=True)
    log_p = logits - top - np.log(np.exp(logits - top).sum(-1,
                                                           keepdims=True))
    p, q = log_p
    kl = (np.exp(p) * (p - q)).sum(-1) / np.log(2.0)  # [K, C] bits
    bits = -np.take_along_axis(log_p, np.broadcast_to(
        rows.targets[None, ..., None], (2, *rows.targets.shape, 1)),
        -1)[..., 0] / np.log(2.0)  # [2, K, C]
    self.assertFalse(got["bitwise_equal"])
    self.assertGreater(kl.mean(), 1e-3)
    # float32 log-softmax against float64: ~1e-6 on values of ~0.01-1.
    self.assertAlmostEqual(got["mean_kl_bits"], kl.mean(), delta=1e-5)
    self.assertAlmostEqual(got["max_abs_log_prob_diff"],
                           np.abs(p - q).max(), delta=1e-5)
    self.assertAlmostEqual(got["mean_abs_bits_diff"],
                           np.abs(bits[0] - bits[1]).mean(), delta=1e-5)
    self.assertAlmostEqual(
        got["bits_per_char_abs_diff"],
        np.abs(bits[0].mean(1) - bits[1].mean(1)).mean(), delta=1e-5)
    np.testing.assert_allclose(got["kl_bits_per_position"], kl.mean(0),
                               atol=1e-5, rtol=0)

  def _interrupted_and_resumed_run_equals_uninterrupted(self):
    workdir = self.enterContext(tempfile.TemporaryDirectory())
    config = dataclasses.replace(self.config, workdir=workdir,
                                 variants=("segments",))
    original = lm.train_batch

    def interrupted(corpus, config, variant, step, **layout):
      if step == 2:  # as Ctrl-C (or SIGTERM) after two finished steps
        raise KeyboardInterrupt
      return original(corpus, config, variant, step, **layout)

    with (mock.patch.object(lm, "train_batch", interrupted),
          self.assertRaises(KeyboardInterrupt)):
      lm.run(config)
    self.assertEqual(os.listdir(os.path.join(workdir, "checkpoints",
                                             "segments")), ["2"])
    got = lm.run(config)["variants"]["segments"]
    want = self.payload["variants"]["segments"]
    self.assertEqual(got["train"]["resumed_from"], 2)
    # Every number the weights produce, to the last bit.
    self.assertEqual(got["train"]["loss_curve"], want["train"]["loss_curve"])
    self.assertEqual(got["valid"], want["valid"])
    self.assertEqual(got["generation"]["greedy"],
                     want["generation"]["greedy"])
    self.assertEqual(got["generation"]["sampled"],
                     want["generation"]["sampled"])
    self.assertEqual(got["cross_document_mass"], want["cross_document_mass"])

  def _checkpoint_of_other_flags_is_refused(self):
    config = _tiny(self.workdir, variants=("naive",))
    config = dataclasses.replace(
        config, model=dataclasses.replace(config.model, normalize_qk=True))
    with self.assertRaisesRegex(ValueError,
                                r"other settings.*'model.normalize_qk'"):
      lm.run(config)

  def _ragged_cached_greedy_of_a_fresh_model(self):
    # A fresh model (near-flat logits make ties likelier, not rarer) with
    # prompts of the experiment's ragged lengths.
    config = _tiny("")
    model, mesh = _as_run_builds_it(config, "segments", 106)
    rng = np.random.default_rng(0)
    prompts = [np.concatenate([[lm_data.BOS],
                               rng.integers(3, 106, len(p))])
               for p in config.prompts]
    with jax.set_mesh(mesh):
      cached, check = lm_generate.check_cached_greedy(model, prompts, 6)
    self.assertTrue(check["passed"], check)
    self.assertTrue(check["tokens_equal"], check)
    self.assertEqual(cached.tokens.shape, (4, 6))
    # Each example decoded from its own position: its prompt length plus
    # the 5 tokens fed back.
    np.testing.assert_array_equal(
        model.blocks[0].attention.cache_index[...],
        [len(p) + 5 for p in prompts])
    # The tolerance tells a wrong context apart: one changed prompt
    # character moves that example's logits far beyond it, and no other's.
    changed = [p.copy() for p in prompts]
    changed[2][1] = 3 if changed[2][1] != 3 else 4
    with jax.set_mesh(mesh):
      _, logits = lm_generate.recompute_greedy(model, changed, 6)
    self.assertGreater(np.abs(logits[2] - cached.logits[2]).max(),
                       100 * lm_generate.LOGIT_TOL)
    np.testing.assert_allclose(logits[0], cached.logits[0],
                               atol=lm_generate.LOGIT_TOL, rtol=0)


class LeakageRowsTest(absltest.TestCase):

  def test_one_document_after_two_predecessors_at_one_offset(self):
    corpus = lm_data.build_corpus(32, 0.2, 0)
    docs = lm.documents_of(corpus.valid)
    self.assertLen(docs, len(corpus.valid_names))
    # The documents back, as the help topics' own text.
    texts = lm_data.load_documents()
    self.assertEqual(corpus.vocab.decode(docs[3]),
                     texts[corpus.valid_names[3]])
    rows = lm.leakage_rows(corpus.valid, 32, 8, count=3)
    self.assertEqual(rows.inputs.shape, (2, 3, 32))
    self.assertEqual(rows.offset, 24)
    for k, (a, b, d) in enumerate(rows.triples):
      self.assertLen({a, b, d}, 3)
      for i, pred in enumerate((a, b)):
        np.testing.assert_array_equal(rows.inputs[i, k, :24], docs[pred][-24:])
        np.testing.assert_array_equal(rows.inputs[i, k, 24:], docs[d][:8])
      np.testing.assert_array_equal(rows.targets[k], docs[d][1:9])
    np.testing.assert_array_equal(rows.segment_ids[0, 0],
                                  [1] * 24 + [2] * 8)
    self.assertEqual(rows.inputs[0, 0, 24], lm_data.BOS)

  def test_bad_sizes_are_refused(self):
    corpus = lm_data.build_corpus(32, 0.2, 0)
    with self.assertRaisesRegex(ValueError, "chars must lie in"):
      lm.leakage_rows(corpus.valid, 32, 32)
    with self.assertRaisesRegex(ValueError, "three documents"):
      lm.leakage_rows(corpus.valid, 100_000, 50_000)
    # Rows longer than the third-longest document: predecessors shortened
    # to it, so that three documents can take each role.
    lengths = sorted(len(d) for d in lm.documents_of(corpus.valid))
    rows = lm.leakage_rows(corpus.valid, 100_000, 8, count=1)
    self.assertEqual(rows.offset, lengths[-3])
    self.assertEqual(rows.inputs.shape, (2, 1, lengths[-3] + 8))


class GenerationTest(absltest.TestCase):

  def test_sampling(self):
    logits = np.log(np.array([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]], np.float32))
    keys = jax.random.split(jax.random.key(0), 40)
    sample = jax.jit(jax.vmap(lm_generate.sample, (None, 0, None, None)))
    greedy = np.asarray(sample(logits, keys[:1], 0.0, 0))[0]
    np.testing.assert_array_equal(greedy, [1, 0])
    draws = np.asarray(sample(logits, keys, 1.0, 2))  # [40, 2]
    # top-2: the least likely token of each row is never drawn.
    self.assertNotIn(0, draws[:, 0])
    self.assertNotIn(1, draws[:, 1])
    self.assertLen(set(draws[:, 0]), 2)

  def test_empty_prompt_is_refused(self):
    with self.assertRaisesRegex(ValueError, "each of one token or more"):
      lm_generate.pad_prompts([np.array([1]), np.array([], np.int32)])


class FingerprintTest(absltest.TestCase):

  def test_every_field_that_shapes_training_is_fingerprinted(self):
    base = lm.LMConfig()
    flat = checkpoints.flatten(dataclasses.asdict(base))
    unused = {"train.task", "train.min_len", "train.max_len",
              "train.vocab_size"}
    for path, value in flat.items():
      if path in unused:
        continue
      changed = (value + ("x",) if isinstance(value, tuple) else
                 not value if isinstance(value, bool) else
                 value * 2 + 1 if isinstance(value, (int, float)) else
                 value + "x")
      config = _set(base, path.split("."), changed)
      for variant in lm.VARIANTS:
        with self.subTest(path=path, variant=variant):
          same = (path in lm.RESUMABLE_CHANGES
                  or (path == "window" and variant != "window"))
          self.assertEqual(lm.fingerprint(variant, config)
                           == lm.fingerprint(variant, base), same)

  def test_variants_differ(self):
    base = lm.LMConfig()
    self.assertLen({str(lm.fingerprint(v, base)) for v in lm.VARIANTS}, 3)


def _set(config, path, value):
  if len(path) == 1:
    return dataclasses.replace(config, **{path[0]: value})
  return dataclasses.replace(
      config, **{path[0]: _set(getattr(config, path[0]), path[1:], value)})


if __name__ == "__main__":
  absltest.main()
