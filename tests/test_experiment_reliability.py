"""Experiments lose nothing: kills, SIGTERM, corrupt checkpoints, bad workdirs.

Determinism is part of the kill test: the killed-and-resumed run (several
processes) must match an uninterrupted run in this process bitwise.
"""

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from unittest import mock

from absl.testing import absltest

from experiments import checkpoints
from experiments import seq2seq
from experiments import training
from tests import reliability_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# SIGKILL trials per run (more with AJ_KILL_TRIALS for a long local run).
KILL_TRIALS = int(os.environ.get("AJ_KILL_TRIALS", "1"))
_CACHE = tempfile.mkdtemp(prefix="aj_jax_cache_")
FLAGS = ["--models=none", "--steps=64", "--batch_size=8", "--min_len=2",
         "--max_len=5", "--vocab_size=5", "--log_every=4",
         "--checkpoint_every=4", "--eval_lengths=3", "--eval_examples=4",
         "--heatmap_lengths=3", "--seed=3"]


def _same_config(workdir, checkpoint_every=4):
  """``seq2seq.Seq2SeqConfig`` equal to what ``FLAGS`` make in run.py."""
  return seq2seq.Seq2SeqConfig(
      workdir=workdir, models=("none",),
      train=training.TrainConfig(steps=64, batch_size=8, min_len=2,
                                 max_len=5, vocab_size=5, log_every=4,
                                 checkpoint_every=checkpoint_every, seed=3),
      eval_lengths=(3,), eval_examples=4, heatmap_lengths=(3,))


def _env():
  """The runs share JAX's persistent compilation cache: only the first of
  them compiles (the kill trials are about training, not XLA)."""
  return dict(os.environ, JAX_COMPILATION_CACHE_DIR=_CACHE,
              JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")


def _start(workdir):
  return subprocess.Popen(
      [sys.executable, "run.py", *FLAGS, f"--workdir={workdir}"], cwd=ROOT,
      env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _steps_saved(workdir) -> list[int]:
  directory = os.path.join(workdir, "checkpoints", "none")
  if not os.path.isdir(directory):
    return []
  return sorted(int(d) for d in os.listdir(directory) if d.isdigit())


def _wait_for_checkpoint(proc, workdir, timeout=120.0) -> bool:
  """True once this run saved a new checkpoint; False if it ended first."""
  before = (_steps_saved(workdir) or [0])[-1]
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if (_steps_saved(workdir) or [0])[-1] > before:
      return True
    if proc.poll() is not None:
      return False
    time.sleep(0.05)
  proc.kill()
  raise AssertionError("no checkpoint within the timeout")


class KillAndResumeTest(absltest.TestCase):

  def test_killed_runs_resume_to_the_uninterrupted_result(self):
    workdir = self.enterContext(tempfile.TemporaryDirectory())
    rng = random.Random(0)  # seeded: the same kill times every run
    outcomes = []

    # SIGTERM first: the run saves its last finished step and exits 130.
    proc = _start(workdir)
    if _wait_for_checkpoint(proc, workdir):
      proc.send_signal(signal.SIGTERM)
      out, _ = proc.communicate(timeout=120)
      if proc.returncode != 0:  # 0: it finished before the signal landed
        self.assertEqual(proc.returncode, 130, out)
        self.assertIn("interrupted: saving step", out)
        saved = int(out.split("interrupted: saving step")[1].split()[0])
        self.assertEqual(_steps_saved(workdir)[-1], saved)
      outcomes.append(("SIGTERM", proc.returncode))
      reliability_report.record("kill", signal="SIGTERM",
                                returncode=proc.returncode,
                                saved=_steps_saved(workdir)[-1])

    # SIGKILL at random moments (mid-step, mid-save): whatever was
    # finalised stays restorable.
    for _ in range(KILL_TRIALS):
      proc = _start(workdir)
      if _wait_for_checkpoint(proc, workdir):
        time.sleep(rng.uniform(0.0, 0.6))
        proc.kill()
      proc.communicate(timeout=120)
      outcomes.append(("SIGKILL", proc.returncode))
      reliability_report.record("kill", signal="SIGKILL",
                                returncode=proc.returncode,
                                saved=(_steps_saved(workdir) or [0])[-1])

    final = subprocess.run(
        [sys.executable, "run.py", *FLAGS, f"--workdir={workdir}"], cwd=ROOT,
        env=_env(), capture_output=True, text=True, timeout=300)
    self.assertEqual(final.returncode, 0, final.stdout + final.stderr)
    with open(os.path.join(workdir, "results.json")) as f:
      got = json.load(f)["models"]["none"]

    straight = self.enterContext(tempfile.TemporaryDirectory())
    # Checkpoint intervals change no number (and are not fingerprinted).
    want = seq2seq.run(_same_config(straight, checkpoint_every=0))[
        "models"]["none"]
    # Bitwise: the data of a step is a function of (seed, step) and the
    # restored state is the saved one.
    self.assertEqual(got["train"]["loss_curve"],
                     [list(p) for p in want["train"]["loss_curve"]])
    self.assertEqual(got["eval"], json.loads(json.dumps(want["eval"])))
    self.assertNotEmpty(outcomes)
    reliability_report.record("resumed", equal=True)


class CheckpointAndWorkdirTest(absltest.TestCase):

  def _saved(self, workdir):
    config = _same_config(workdir)
    model = seq2seq.build_model("none", config)
    optimizer = training.make_optimizer(model, config.train)
    ckpt = checkpoints.Checkpointer(workdir, {"run": 1})
    ckpt.save(4, model, optimizer, [[4, 1.5]])
    ckpt.wait()
    ckpt.close()
    return model, optimizer

  def test_corrupt_checkpoint_is_reported_not_loaded(self):
    workdir = self.enterContext(tempfile.TemporaryDirectory())
    model, optimizer = self._saved(workdir)
    step_dir = os.path.join(workdir, "4")
    for root, _, files in os.walk(step_dir):  # garble every stored byte
      for name in files:
        with open(os.path.join(root, name), "r+b") as f:
          size = f.seek(0, 2)
          f.seek(0)
          f.write(b"\xff" * max(size, 1))
    ckpt = checkpoints.Checkpointer(workdir, {"run": 1})
    with self.assertRaisesRegex(ValueError, r"checkpoint .*4 cannot be read"):
      ckpt.restore(model, optimizer)
    ckpt.close()

  def test_unwritable_workdir_fails_before_training(self):
    parent = self.enterContext(tempfile.TemporaryDirectory())
    blocker = os.path.join(parent, "a_file")
    with open(blocker, "w") as f:
      f.write("not a directory")
    with (mock.patch.object(training, "train") as train,
          self.assertRaisesRegex(ValueError, r"--workdir .* is not writable")):
      seq2seq.run(_same_config(os.path.join(blocker, "run")))
    train.assert_not_called()  # refused before any training


class ReliabilityPageTest(absltest.TestCase):

  def test_page_carries_the_generated_table(self):
    text = reliability_report.PAGE.read_text()
    self.assertIn("python -m tests.reliability_report --write", text)
    begin = text.index(reliability_report.BEGIN)
    block = text[begin:text.index(reliability_report.END)]
    self.assertIn("| area | what was tried | outcome |", block)
    for area in ("property tests", "numerical extremes", "bad input",
                 "experiments lose nothing"):
      self.assertIn(f"| {area}", block)


if __name__ == "__main__":
  absltest.main()
