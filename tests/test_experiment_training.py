"""The real training loop on a shrunk config: report, resume, bad flags."""

import dataclasses
import os
import re
import subprocess
import sys
import tempfile

from absl import flags as absl_flags
from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx
import jax
import numpy as np

from experiments import checkpoints
from experiments import seq2seq
from experiments import training

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(workdir, models, steps, checkpoint_every=0, **train):
  return seq2seq.Seq2SeqConfig(
      workdir=workdir, models=models,
      train=training.TrainConfig(steps=steps, batch_size=8,
                                 learning_rate=1e-2, min_len=2, max_len=5,
                                 vocab_size=5, log_every=2,
                                 checkpoint_every=checkpoint_every, **train),
      eval_lengths=(3,), eval_examples=4, heatmap_lengths=(3,),
      embed_dim=8, encoder_dim=8, decoder_dim=16, d_model=16, num_heads=2,
      num_layers=1)


class SmokeTest(parameterized.TestCase):

  @parameterized.parameters("none", "bahdanau", "luong", "transformer")
  def test_model_trains_and_reports(self, name):
    workdir = self.enterContext(tempfile.TemporaryDirectory())
    payload = seq2seq.run(_config(workdir, (name,), steps=16))
    curve = payload["models"][name]["train"]["loss_curve"]
    self.assertLen(curve, 8)
    # 16 steps at lr 1e-2 from a near-uniform start (log 8 = 2.08) must help.
    self.assertLess(np.mean([loss for _, loss in curve[-2:]]), curve[0][1])
    row = payload["models"][name]["eval"]["3"]
    self.assertBetween(row["token_acc"], 0.0, 1.0)
    if name != "none":
      self.assertBetween(row["align_acc"], 0.0, 1.0)
    if name == "transformer":
      self.assertLen(payload["models"][name]["eval"]["3"]["heads"], 2)
    files = set(os.listdir(workdir))
    for f in ("results.json", "summary.md", "accuracy_vs_length.png",
              "loss_curves.png"):
      self.assertIn(f, files)
    heatmap = f"attention_{name}_len3.png"
    self.assertEqual(heatmap in files, name != "none")  # none has no map
    with open(os.path.join(workdir, "summary.md")) as f:
      self.assertIn(f"### {name} (16 steps", f.read())


class ResumeTest(absltest.TestCase):

  def test_checkpoint_of_other_flags_is_refused(self):
    workdir = self.enterContext(tempfile.TemporaryDirectory())
    seq2seq.run(_config(workdir, ("none",), steps=2))
    with self.assertRaisesRegex(ValueError, r"other settings.*'batch_size'"):
      config = _config(workdir, ("none",), steps=2)
      config = config.__class__(**{
          **config.__dict__,
          "train": training.TrainConfig(**{**config.train.__dict__,
                                           "batch_size": 4})})
      seq2seq.run(config)

  def test_restored_parameters_are_identical(self):
    workdir = self.enterContext(tempfile.TemporaryDirectory())
    config = _config(workdir, ("luong",), steps=3)
    model = seq2seq.build_model("luong", config)
    ckpt = checkpoints.Checkpointer(os.path.join(workdir, "c"), {"a": 1})
    optimizer = training.make_optimizer(model, config.train)
    ckpt.save(3, model, optimizer, [[3, 1.0]])
    ckpt.wait()
    fresh = seq2seq.build_model("luong", dataclasses.replace(
        config, train=dataclasses.replace(config.train, seed=1)))
    step, history = ckpt.restore(fresh, training.make_optimizer(
        fresh, config.train))
    ckpt.close()
    self.assertEqual((step, history), (3, [[3, 1.0]]))
    jax.tree.map(np.testing.assert_array_equal, nnx.state(fresh, nnx.Param),
                 nnx.state(model, nnx.Param))


class FlagsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("steps", ["--steps=0"], "--steps=0: 0 is not a positive integer"),
      ("models", ["--models=none,attentive"],
       "--models must be a non-empty list"),
      ("lengths", ["--min_len=9", "--max_len=3"], "--min_len must not exceed"),
      ("eval_lengths", ["--eval_lengths=5,x"],
       "--eval_lengths must be a comma-separated"),
      ("task", ["--task=sort"], "value should be one of"),
      ("dims", ["--dims=4,-8"], "--dims must be a comma-separated list"),
  )
  def test_validators(self, argv, message):
    import run  # registers the flags on absl's global FLAGS once
    try:
      with self.assertRaisesRegex(absl_flags.Error, re.escape(message)):
        run.flags.FLAGS(["run.py", *argv])
    finally:
      run.flags.FLAGS.unparse_flags()

  def test_bad_flag_exits_non_zero_before_running(self):
    proc = subprocess.run(
        [sys.executable, "run.py", "--models=none,attentive",
         "--workdir=/nonexistent/never-created"], cwd=ROOT,
        capture_output=True, text=True, timeout=120)
    self.assertNotEqual(proc.returncode, 0)
    self.assertIn("--models must be a non-empty list", proc.stderr)
    self.assertFalse(os.path.exists("/nonexistent/never-created"))


if __name__ == "__main__":
  absltest.main()
