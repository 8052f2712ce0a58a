"""``python run.py``: a flag given that the chosen experiment does not read is
refused before anything runs (``run.check_flags``)."""

import os
import re
import subprocess
import sys
import tempfile

from absl import app
from absl.testing import absltest
from absl.testing import parameterized

import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class CheckFlagsTest(parameterized.TestCase):

  def tearDown(self):
    run.flags.FLAGS.unparse_flags()
    super().tearDown()

  def _check(self, argv):
    run.flags.FLAGS(["run.py", *argv])
    run.check_flags(run.flags.FLAGS)

  @parameterized.named_parameters(
      ("steps_to_lm", ["--experiment=lm", "--steps=10"],
       "--steps is the seq2seq experiment's; --experiment=lm reads "
       "--lm_steps instead."),
      ("lm_steps_to_copy", ["--lm_steps=10"],
       "--lm_steps is the lm experiment's; --experiment=seq2seq reads "
       "--steps instead."),
      ("dates_batch_to_lm", ["--experiment=lm", "--dates_batch_size=8"],
       "--dates_batch_size is the dates experiment's; --experiment=lm reads "
       "--lm_batch_size instead."),
      ("models_to_logit_scale", ["--experiment=logit_scale", "--models=none"],
       "--models is the seq2seq and dates experiments'; "
       "--experiment=logit_scale has no such flag."),
      ("task_to_dates", ["--experiment=dates", "--task=reverse"],
       "--task is the seq2seq experiment's; --experiment=dates has no such "
       "flag."),
  )
  def test_refused(self, argv, message):
    with self.assertRaisesRegex(app.UsageError, re.escape(message)):
      self._check(argv)

  @parameterized.named_parameters(
      ("lm", ["--experiment=lm", "--lm_steps=10", "--seed=1", "--mesh=data:1",
              "--workdir=/w", "--window=8"]),
      ("copy", ["--steps=10", "--models=luong", "--encoder=bidirectional"]),
      ("dates", ["--experiment=dates", "--models=none", "--encoder=forward",
                 "--dates_steps=5"]),
      ("logit_scale", ["--experiment=logit_scale", "--scaling_train_steps=0",
                       "--seed=2"]),
      # DistributedConfig's flags and absl's own are every experiment's.
      ("shared", ["--experiment=lm", "--distributed", "--num_processes=1",
                  "--process_id=0", "--coordinator_address=h:1",
                  "--verbosity=1"]),
  )
  def test_accepted(self, argv):
    self._check(argv)

  def test_run_py_exits_before_training(self):
    with tempfile.TemporaryDirectory() as tmp:
      workdir = os.path.join(tmp, "lm")
      # Would train for minutes if --steps were silently ignored; the
      # timeout turns that into a failure instead of a hang.
      proc = subprocess.run(
          [sys.executable, "run.py", "--experiment=lm", "--steps=10",
           f"--workdir={workdir}"], cwd=ROOT, capture_output=True, text=True,
          timeout=120)
      self.assertEqual(proc.returncode, 1, proc.stderr[-2000:])
      self.assertIn("--experiment=lm reads --lm_steps instead.", proc.stderr)
      self.assertFalse(os.path.exists(workdir))


if __name__ == "__main__":
  absltest.main()
