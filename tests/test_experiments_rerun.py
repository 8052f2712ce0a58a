"""Rerunning an experiment reports the training it restored, not zero steps.

A rerun of a finished training restores the last checkpoint and trains no
step; its report must state the throughput measured when the steps were
trained (kept in the checkpoint), labelled as restored, never 0.0 steps/s.
A run that trains some steps reports the throughput over those steps.
"""

import json
import os
import tempfile
from unittest import mock

from absl.testing import absltest
from flax import nnx
import numpy as np
import orbax.checkpoint as ocp

from experiments import checkpoints
from experiments import dates
from experiments import lm
from experiments import lm_data
from experiments import lm_model
from experiments import rnn
from experiments import seq2seq
from experiments import serve
from experiments import training

# What a restoring rerun must report exactly as the run that trained.
TRAINING_NUMBERS = ("steps", "final_loss", "seconds", "steps_per_s",
                    "timed_steps", "loss_curve")


def is_exhaustive(test_name: str) -> bool:
  """conftest's hook: the LM's and the dates' whole experiments and the
  serve model's, each run twice, are left to the exhaustive run, as their
  other end-to-end runs are; every rerun goes through training.train,
  which the seq2seq cases run by default."""
  return test_name in ("test_lm_rerun", "test_dates_rerun",
                       "test_serve_rerun_says_the_model_was_restored")


def _seq2seq(workdir, checkpoint_every):
  return seq2seq.Seq2SeqConfig(
      workdir=workdir, models=("none",),
      train=training.TrainConfig(steps=4, batch_size=4, min_len=2,
                                 max_len=4, vocab_size=4, log_every=1,
                                 checkpoint_every=checkpoint_every),
      eval_lengths=(3,), eval_examples=2, heatmap_lengths=(),
      rnn=rnn.RNNConfig(embed_dim=4, encoder_dim=4, decoder_dim=8))


def _results(workdir):
  with open(os.path.join(workdir, "results.json")) as f:
    return json.load(f)


def _summary(workdir, name="summary.md"):
  with open(os.path.join(workdir, name)) as f:
    return f.read()


class RerunTest(absltest.TestCase):

  def assert_rerun_restores(self, first, second, steps):
    """``second`` (a rerun's train stats) reports ``first``'s training."""
    self.assertEqual(first["timing"],
                     f"measured in this run over steps 0-{steps}")
    self.assertEqual(first["trained_steps"], steps)
    self.assertEqual(second["trained_steps"], 0)
    self.assertEqual(second["resumed_from"], steps)
    self.assertStartsWith(second["timing"],
                          f"restored from the checkpoint of step {steps}")
    for key in TRAINING_NUMBERS:
      with self.subTest(key):
        self.assertEqual(second[key], first[key])
    self.assertGreater(second["steps_per_s"], 0.0)
    self.assertEqual(second["timed_steps"], steps)
    # The throughput is the steps over the seconds, both stated (exact: the
    # same two floats divided).
    self.assertEqual(second["steps_per_s"], steps / second["seconds"])

  def test_seq2seq_rerun(self):
    # checkpoint_every=2 divides the 4 steps: the last step's checkpoint
    # must still hold the time the report states.
    for every in (0, 2):
      with self.subTest(checkpoint_every=every):
        workdir = self.enterContext(tempfile.TemporaryDirectory())
        config = _seq2seq(workdir, every)
        seq2seq.run(config)
        first = _results(workdir)["models"]["none"]["train"]
        seq2seq.run(config)
        second = _results(workdir)["models"]["none"]["train"]
        self.assert_rerun_restores(first, second, steps=4)
        summary = _summary(workdir)
        self.assertIn(f"{second['steps_per_s']:.1f} steps/s, restored from "
                      "the checkpoint of step 4", summary)
        # A whole number, not a suffix: "330.0 steps/s" is a real rate.
        self.assertNotRegex(summary, r"(?<![\d.])0\.0 steps/s")

  def test_resumed_run_times_the_steps_it_trained(self):
    workdir = self.enterContext(tempfile.TemporaryDirectory())
    config = _seq2seq(workdir, checkpoint_every=0)
    original = training._task_batch

    def interrupted(train_config, step):
      if step == 2:  # as Ctrl-C after two finished steps
        raise KeyboardInterrupt
      return original(train_config, step)

    with (mock.patch.object(training, "_task_batch", interrupted),
          self.assertRaises(KeyboardInterrupt)):
      seq2seq.run(config)
    resumed = seq2seq.run(config)["models"]["none"]["train"]
    self.assertEqual((resumed["resumed_from"], resumed["trained_steps"],
                      resumed["timed_steps"]), (2, 2, 2))
    self.assertEqual(resumed["timing"], "measured in this run over steps 2-4 "
                     "(resumed at step 2: earlier runs' steps not included)")
    self.assertEqual(resumed["steps_per_s"], 2 / resumed["seconds"])
    # The checkpoint keeps both runs' time: a rerun reports all 4 steps,
    # over more seconds than the second run's alone.
    again = seq2seq.run(config)["models"]["none"]["train"]
    self.assertEqual(again["timed_steps"], 4)
    self.assertGreater(again["seconds"], resumed["seconds"])
    self.assertGreater(again["steps_per_s"], 0.0)

  def test_checkpoint_without_timing_is_not_measured(self):
    # A checkpoint written before timings were kept, restored whole: the
    # throughput is unknown, said in words, never 0.0.
    workdir = self.enterContext(tempfile.TemporaryDirectory())
    config = _seq2seq(workdir, checkpoint_every=0)
    model = seq2seq.build_model("none", config)
    ckpt = checkpoints.Checkpointer(
        os.path.join(workdir, "checkpoints", "none"),
        seq2seq._fingerprint("none", config))
    ckpt.save(4, model, training.make_optimizer(model, config.train),
              [[4, 1.25]])
    ckpt.wait()
    ckpt.close()
    train = seq2seq.run(config)["models"]["none"]["train"]
    self.assertIsNone(train["steps_per_s"])
    self.assertEqual((train["seconds"], train["timed_steps"]), (0.0, 0))
    self.assertStartsWith(train["timing"], "not measured")
    self.assertIn("steps/s not measured", _summary(workdir))

  def test_malformed_timing_is_refused(self):
    workdir = self.enterContext(tempfile.TemporaryDirectory())
    config = _seq2seq(workdir, checkpoint_every=0)
    model = seq2seq.build_model("none", config)
    ckpt = checkpoints.Checkpointer(workdir, {"run": 1})
    optimizer = training.make_optimizer(model, config.train)
    for bad in ({"seconds": 0.0, "steps": 4}, {"seconds": 1.0, "steps": 0},
                {"seconds": float("nan"), "steps": 4}, {"seconds": 1.0}):
      with self.subTest(bad=bad), self.assertRaisesRegex(
          ValueError, r"timing must be .*got"):
        ckpt.save(4, model, optimizer, [[4, 1.0]], bad)
    # A record edited by hand is refused on restore, as unreadable.
    state = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
    ckpt.manager.save(4, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(
            {"step": 4, "history": [], "fingerprint": {"run": 1},
             "timing": {"seconds": -1.0, "steps": 4}})))
    ckpt.wait()
    with self.assertRaisesRegex(ValueError,
                                r"cannot be read.*timing must be"):
      ckpt.restore_run(model, optimizer)
    ckpt.close()

  def test_dates_rerun(self):
    workdir = self.enterContext(tempfile.TemporaryDirectory())
    config = dates.DatesConfig(
        workdir=workdir, models=("bahdanau",), locales=("vi",),
        formats=("short",), reverse=False, eval_examples=2,
        train=training.TrainConfig(steps=2, batch_size=4, log_every=1,
                                   checkpoint_every=0),
        rnn=rnn.RNNConfig(embed_dim=4, encoder_dim=4, decoder_dim=8))
    dates.run(config)
    first = _results(workdir)["models"]["bahdanau"]["train"]
    dates.run(config)
    second = _results(workdir)["models"]["bahdanau"]["train"]
    self.assert_rerun_restores(first, second, steps=2)
    self.assertIn("restored from the checkpoint of step 2", _summary(workdir))

  def test_lm_rerun(self):
    workdir = self.enterContext(tempfile.TemporaryDirectory())
    config = lm.LMConfig(
        workdir=workdir, seq_len=32, window=4, doc_start_chars=8,
        variants=("segments",),
        model=lm_model.LMModelConfig(d_model=16, num_heads=2, num_layers=1,
                                     ffn_dim=32),
        train=training.TrainConfig(steps=3, batch_size=4, learning_rate=1e-2,
                                   checkpoint_every=0, log_every=1),
        gen_tokens=4)
    lm.run(config)
    first = _results(workdir)["variants"]["segments"]["train"]
    lm.run(config)
    second = _results(workdir)["variants"]["segments"]["train"]
    self.assert_rerun_restores(first, second, steps=3)

  def test_serve_rerun_says_the_model_was_restored(self):
    workdir = self.enterContext(tempfile.TemporaryDirectory())
    config = serve.ServeConfig(
        workdir=workdir, lm_checkpoint="",
        model=lm_model.LMModelConfig(d_model=16, num_heads=2, num_layers=1,
                                     ffn_dim=32),
        train=training.TrainConfig(steps=2, batch_size=4, learning_rate=1e-2,
                                   checkpoint_every=0, log_every=1))
    corpus = lm_data.build_corpus(config.seq_len, config.valid_fraction,
                                        config.train.seed)
    _, first = serve.build_model(config, corpus)
    _, second = serve.build_model(config, corpus)
    self.assertStartsWith(first["source"], "trained here")
    self.assertStartsWith(second["source"], "restored from this workdir's")
    self.assertEqual(second["train_steps_per_s"], first["train_steps_per_s"])
    self.assertGreater(second["train_steps_per_s"], 0.0)
    self.assertStartsWith(second["train_timing"], "restored from the")
    np.testing.assert_equal(second["valid_bits_per_char"],
                            first["valid_bits_per_char"])


if __name__ == "__main__":
  absltest.main()
