"""``python run.py --experiment=lm``'s flags: checked by absl before anything
runs, and landing in ``lm.LMConfig``."""

import dataclasses
import re

from absl import app as absl_app
from absl import flags as absl_flags
from absl.testing import absltest
from absl.testing import parameterized

from experiments import config_flags
from experiments import lm
import run


class LMFlagsTest(parameterized.TestCase):

  def tearDown(self):
    run.flags.FLAGS.unparse_flags()
    super().tearDown()

  @parameterized.named_parameters(
      ("variants", ["--lm_variants=segments,packed"],
       "--lm_variants must be a non-empty list from ['segments', 'naive', "
       "'window']"),
      ("no_variants", ["--lm_variants="], "--lm_variants must be a non-empty"),
      ("heads", ["--lm_heads=3"], "--lm_heads must divide --lm_d_model."),
      ("heads_of_width", ["--lm_d_model=20", "--lm_heads=8"],
       "--lm_heads must divide --lm_d_model."),
      ("seq_len", ["--seq_len=1"], "--seq_len=1: 1 is not integer >= 2"),
      ("window", ["--window=0"], "--window=0: 0 is not a positive integer"),
      ("steps", ["--lm_steps=0"], "--lm_steps=0: 0 is not a positive"),
      ("temperature", ["--temperature=-0.5"], "is not a non-negative number"),
      ("top_k", ["--top_k=-1"], "is not a non-negative integer"),
      ("experiment", ["--experiment=gpt"],
       "value should be one of <seq2seq|logit_scale|lm|dates|serve|sparse>"),
  )
  def test_bad_flags_are_refused_at_parsing(self, argv, message):
    with self.assertRaisesRegex(absl_flags.Error, re.escape(message)):
      run.flags.FLAGS(["run.py", "--experiment=lm", *argv])

  def test_flags_land_in_the_config(self):
    run.flags.FLAGS([
        "run.py", "--experiment=lm", "--lm_steps=7", "--seed=3",
        "--lm_variants=naive,window", "--window=8", "--qk_norm",
        "--lm_heads=8", "--lm_batch_size=4", "--workdir=/w",
        "--mesh=data:1", "--gen_tokens=9", "--steps=5"])
    # --steps is the copy task's: run.py refuses it with --experiment=lm.
    with self.assertRaisesRegex(absl_app.UsageError, "--lm_steps instead"):
      run.check_flags()
    got = config_flags.from_flags(lm.LMConfig, run.flags.FLAGS)
    want = lm.LMConfig()
    self.assertEqual(got, dataclasses.replace(
        want, workdir="/w", variants=("naive", "window"), window=8,
        gen_tokens=9,
        model=dataclasses.replace(want.model, normalize_qk=True,
                                  num_heads=8),
        # The LM's budget is --lm_steps.
        train=dataclasses.replace(want.train, steps=7, seed=3, batch_size=4,
                                  mesh="data:1")))

  def test_defaults(self):
    run.flags.FLAGS(["run.py", "--experiment=lm"])
    config = config_flags.from_flags(lm.LMConfig, run.flags.FLAGS)
    self.assertEqual(config, lm.LMConfig())
    self.assertEqual(config.variants, lm.VARIANTS)
    self.assertEqual(config.workdir, "runs/lm")


class DividesRuleTest(absltest.TestCase):

  def test_divides_is_checked_between_sibling_flags(self):
    @dataclasses.dataclass(frozen=True)
    class Shape:
      parts: int = config_flags.field(2, "Parts.", lower_bound=1,
                                      divides="total")
      total: int = config_flags.field(8, "Total.", lower_bound=1)

    values = absl_flags.FlagValues()
    config_flags.define_flags([Shape], values)
    values(["prog", "--parts=4"])
    self.assertEqual(config_flags.from_flags(Shape, values), Shape(parts=4))
    values.unparse_flags()
    with self.assertRaisesRegex(absl_flags.Error,
                                re.escape("--parts must divide --total.")):
      values(["prog", "--parts=3"])


if __name__ == "__main__":
  absltest.main()
