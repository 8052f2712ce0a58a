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
from experiments import config_flags
from experiments import logit_scale
from experiments import parallel
from experiments import rnn
from experiments import seq2seq
from experiments import training
from experiments import transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(workdir, models, steps, checkpoint_every=0, **train):
  return seq2seq.Seq2SeqConfig(
      workdir=workdir, models=models,
      train=training.TrainConfig(steps=steps, batch_size=8,
                                 learning_rate=1e-2, min_len=2, max_len=5,
                                 vocab_size=5, log_every=2,
                                 checkpoint_every=checkpoint_every, **train),
      eval_lengths=(3,), eval_examples=4, heatmap_lengths=(3,),
      rnn=rnn.RNNConfig(embed_dim=8, encoder_dim=8, decoder_dim=16),
      transformer=transformer.TransformerConfig(d_model=16, num_heads=2,
                                                num_layers=1, ffn_dim=32))


class SmokeTest(absltest.TestCase):

  def test_every_model_trains_and_reports(self):
    # One run of all four models: the report, plots and eval are shared, as
    # in `python run.py`, and the suite pays the run's fixed cost once.
    names = ("none", "bahdanau", "luong", "transformer")
    workdir = self.enterContext(tempfile.TemporaryDirectory())
    payload = seq2seq.run(_config(workdir, names, steps=16))
    files = set(os.listdir(workdir))
    for f in ("results.json", "summary.md", "accuracy_vs_length.png",
              "loss_curves.png"):
      self.assertIn(f, files)
    with open(os.path.join(workdir, "summary.md")) as f:
      summary = f.read()
    for name in names:
      with self.subTest(name):
        curve = payload["models"][name]["train"]["loss_curve"]
        self.assertLen(curve, 8)
        # 16 steps at lr 1e-2 from a near-uniform start (log 8 = 2.08) must
        # help.
        self.assertLess(np.mean([loss for _, loss in curve[-2:]]),
                        curve[0][1])
        row = payload["models"][name]["eval"]["3"]
        self.assertBetween(row["token_acc"], 0.0, 1.0)
        if name != "none":
          self.assertBetween(row["align_acc"], 0.0, 1.0)
        if name == "transformer":
          self.assertLen(row["heads"], 2)
        heatmap = f"attention_{name}_len3.png"
        self.assertEqual(heatmap in files, name != "none")  # none: no map
        self.assertIn(f"### {name} (16 steps", summary)


class ResumeTest(absltest.TestCase):

  def test_checkpoint_of_other_flags_is_refused(self):
    workdir = self.enterContext(tempfile.TemporaryDirectory())
    seq2seq.run(_config(workdir, ("none",), steps=2))
    config = _config(workdir, ("none",), steps=2)
    config = dataclasses.replace(
        config, train=dataclasses.replace(config.train, batch_size=4))
    with self.assertRaisesRegex(ValueError,
                                r"other settings.*'train.batch_size'"):
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


def _other(value, choices=None):
  """Another value of a config field's type (another choice if it has any)."""
  if choices:
    return next(c for c in choices if c != value)
  if value is None:
    return 0.5  # attention_scale: None (1/sqrt(d_k)) -> a fixed scale
  if isinstance(value, bool):
    return not value
  if isinstance(value, (int, float)):
    return value * 2 + 1
  if isinstance(value, tuple):
    return value + value[:1]
  return value + "x"


def _variants(config, prefix=""):
  """``(dotted field name, config with only that field changed)`` for every
  leaf field, nested configs walked."""
  for f in dataclasses.fields(config):
    value = getattr(config, f.name)
    if dataclasses.is_dataclass(value):
      for path, inner in _variants(value, f"{prefix}{f.name}."):
        yield path, dataclasses.replace(config, **{f.name: inner})
    else:
      flag = f.metadata.get("flag")
      changed = _other(value, flag.choices if flag else None)
      yield f"{prefix}{f.name}", dataclasses.replace(config,
                                                     **{f.name: changed})


class FingerprintTest(parameterized.TestCase):

  def test_only_logging_saving_eval_and_devices_may_change(self):
    # Pinned: widening this set lets a resume mix two different runs.
    self.assertEqual(seq2seq.RESUMABLE_CHANGES, {
        "workdir", "models", "eval_lengths", "eval_examples",
        "heatmap_lengths", "train.log_every", "train.checkpoint_every",
        "train.mesh"})

  @parameterized.parameters(*seq2seq.MODELS)
  def test_every_field_that_shapes_training_is_fingerprinted(self, name):
    base = seq2seq.Seq2SeqConfig()
    want = seq2seq._fingerprint(name, base)
    # The other family's architecture does not shape this model.
    unused = "rnn." if name == "transformer" else "transformer."
    variants = dict(_variants(base))
    self.assertContainsSubset({"train.steps", "train.log_every",
                               "rnn.encoder", "transformer.d_model"},
                              variants)
    for path, config in variants.items():
      got = seq2seq._fingerprint(name, config)
      with self.subTest(path):
        if path in seq2seq.RESUMABLE_CHANGES or path.startswith(unused):
          self.assertEqual(got, want)
        else:
          self.assertNotEqual(got, want)

  def test_log_every_does_not_change_it(self):
    base = seq2seq.Seq2SeqConfig()
    config = dataclasses.replace(
        base, train=dataclasses.replace(base.train, log_every=7))
    self.assertEqual(seq2seq._fingerprint("bahdanau", config),
                     seq2seq._fingerprint("bahdanau", base))


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
      ("old_experiment_name", ["--experiment=scaling"],
       "value should be one of <seq2seq|logit_scale|lm|dates|serve|sparse>"),
      ("score", ["--luong_score=additive"], "value should be one of"),
  )
  def test_validators(self, argv, message):
    import run  # registers the flags on absl's global FLAGS once
    try:
      with self.assertRaisesRegex(absl_flags.Error, re.escape(message)):
        run.flags.FLAGS(["run.py", *argv])
    finally:
      run.flags.FLAGS.unparse_flags()

  def test_flag_defaults_are_the_config_defaults(self):
    import run
    configs = [parallel.DistributedConfig,
               *(c for c, _ in run.EXPERIMENTS.values())]
    try:
      run.flags.FLAGS(["run.py"])
      for config_cls in configs:
        # No flags given: exactly the dataclass defaults, nested ones too.
        self.assertEqual(
            config_flags.from_flags(config_cls, run.flags.FLAGS),
            config_cls())
        for spec in config_flags.flag_specs(config_cls):
          flag = run.flags.FLAGS[spec.name]
          with self.subTest(f"{config_cls.__name__} --{spec.name}"):
            # (absl puts an enum's choices in front: "<copy|reverse>: ...")
            self.assertEndsWith(flag.help, spec.flag.help)
            if spec.flag.default_none:  # --workdir: runs/<experiment>
              self.assertIsNone(flag.default)
            else:
              self.assertEqual(spec.to_field(flag.default), spec.default)
    finally:
      run.flags.FLAGS.unparse_flags()

  def test_flags_land_in_the_nested_configs(self):
    import run
    try:
      run.flags.FLAGS([
          "run.py", "--steps=7", "--encoder=bidirectional", "--seed=3",
          "--eval_lengths=3,4", "--workdir=/w", "--scaling_train_steps=0",
          "--models=transformer"])
      got = config_flags.from_flags(seq2seq.Seq2SeqConfig, run.flags.FLAGS)
      scale = config_flags.from_flags(logit_scale.LogitScaleConfig,
                                      run.flags.FLAGS)
    finally:
      run.flags.FLAGS.unparse_flags()
    want = seq2seq.Seq2SeqConfig()
    self.assertEqual(got, dataclasses.replace(
        want, workdir="/w", models=("transformer",), eval_lengths=(3, 4),
        train=dataclasses.replace(want.train, steps=7, seed=3),
        rnn=dataclasses.replace(want.rnn, encoder="bidirectional")))
    want = logit_scale.LogitScaleConfig()
    self.assertEqual(scale, dataclasses.replace(
        want, workdir="/w",
        train=dataclasses.replace(want.train, steps=0, seed=3)))

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
