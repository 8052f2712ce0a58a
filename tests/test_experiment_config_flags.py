"""Flags generated from config dataclasses (experiments/config_flags.py),
on a private FlagValues: kinds, nesting, shared names, cross-field rules, and
refusing a flag given that the chosen experiment does not read."""

from __future__ import annotations

import dataclasses
import re

from absl import flags
from absl.testing import absltest

from experiments import config_flags


@dataclasses.dataclass(frozen=True)
class _Inner:
  low: int = config_flags.field(1, "Low.", lower_bound=0, not_above="high")
  high: int = config_flags.field(5, "High.")
  rate: float = config_flags.field(0.5, "Rate.")
  hidden: int = 7  # no flag


@dataclasses.dataclass(frozen=True)
class _Outer:
  name: str | None = config_flags.field(None, "Name.")
  pick: str = config_flags.field("a", "Pick.", choices=("a", "b"))
  sizes: tuple[int, ...] = config_flags.field((2, 3), "Sizes.")
  tags: tuple[str, ...] = config_flags.field(("x",), "Tags.",
                                             choices=("x", "y"))
  on: bool = config_flags.field(False, "On.")
  inner: _Inner = _Inner()


@dataclasses.dataclass(frozen=True)
class _Exposing:
  """Exposes one field of _Inner, renamed and with another default."""
  inner: _Inner = config_flags.nested(
      _Inner(high=9), expose={"high": config_flags.Flag("Other high.",
                                                        name="top")})


def _parsed(config_classes, argv):
  values = flags.FlagValues()
  config_flags.define_flags(config_classes, values)
  values(["prog", *argv])
  return values


class ConfigFlagsTest(absltest.TestCase):

  def test_defaults_and_values_round_trip(self):
    values = _parsed([_Outer], [])
    self.assertEqual(config_flags.from_flags(_Outer, values), _Outer())
    self.assertEqual(values["sizes"].default, ["2", "3"])
    self.assertEqual(values["low"].help, "Low.")
    self.assertNotIn("hidden", values)
    values = _parsed([_Outer], ["--name=n", "--pick=b", "--sizes=4",
                                "--tags=y,x", "--on", "--low=2", "--rate=2"])
    self.assertEqual(config_flags.from_flags(_Outer, values), _Outer(
        name="n", pick="b", sizes=(4,), tags=("y", "x"), on=True,
        inner=_Inner(low=2, rate=2.0)))

  def test_validators(self):
    for argv, message in (
        (["--low=6"], "--low must not exceed --high."),
        (["--low=-1"], "not a non-negative integer"),
        (["--sizes=1,0"], "--sizes must be a comma-separated list of positive"),
        (["--tags="], "--tags must be a non-empty list from ['x', 'y']."),
        (["--tags=z"], "--tags must be a non-empty list"),
        (["--pick=c"], "value should be one of <a|b>")):
      with self.subTest(argv[0]), self.assertRaisesRegex(
          flags.Error, re.escape(message)):
        _parsed([_Outer], argv)

  def test_nested_expose_picks_renames_and_keeps_the_parent_default(self):
    values = _parsed([_Exposing], [])
    self.assertEqual(values["top"].default, 9)
    self.assertEqual(values["top"].help, "Other high.")
    self.assertNotIn("low", values)
    values = _parsed([_Exposing], ["--top=4"])
    self.assertEqual(config_flags.from_flags(_Exposing, values),
                     _Exposing(inner=_Inner(high=4)))

  def test_one_name_shared_only_with_one_meaning(self):
    # Both define --low, --high, --rate the same way: defined once.
    values = _parsed([_Outer, _Inner], ["--low=3"])
    self.assertEqual(config_flags.from_flags(_Inner, values).low, 3)

    @dataclasses.dataclass(frozen=True)
    class OtherDefault:
      low: int = config_flags.field(2, "Low.", lower_bound=0)

    with self.assertRaisesRegex(ValueError, "--low would mean two things"):
      config_flags.define_flags([_Outer, OtherDefault], flags.FlagValues())

  def test_one_config_cannot_claim_a_name_twice(self):
    @dataclasses.dataclass(frozen=True)
    class Twice:
      a: _Inner = _Inner()
      b: _Inner = _Inner()

    with self.assertRaisesRegex(ValueError, r"\['high', 'low', 'rate'\]"):
      config_flags.flag_specs(Twice)

  def test_unsupported_annotation(self):
    @dataclasses.dataclass(frozen=True)
    class Listy:
      items: list = config_flags.field(None, "Items.")

    with self.assertRaisesRegex(TypeError, "Listy.items: no flag type"):
      config_flags.flag_specs(Listy)


@dataclasses.dataclass(frozen=True)
class _Train:
  steps: int = config_flags.field(10, "Steps.", lower_bound=1)
  seed: int = config_flags.field(0, "Seed.")


@dataclasses.dataclass(frozen=True)
class _ExperimentA:
  train: _Train = _Train()
  only_a: int = config_flags.field(1, "A's own.")
  both: int = config_flags.field(2, "A's and C's.")


@dataclasses.dataclass(frozen=True)
class _ExperimentB:
  """A's ``train.steps`` under another name; ``seed`` shared."""
  train: _Train = config_flags.nested(_Train(steps=20), expose={
      "steps": config_flags.Flag("B steps.", name="b_steps", lower_bound=1),
      "seed": None})


@dataclasses.dataclass(frozen=True)
class _ExperimentC:
  both: int = config_flags.field(2, "A's and C's.")


@dataclasses.dataclass(frozen=True)
class _Shared:
  hosts: int = config_flags.field(1, "Hosts.")


_EXPERIMENTS = {"a": _ExperimentA, "b": _ExperimentB, "c": _ExperimentC}


class FlagsReadTest(absltest.TestCase):
  """check_flags_read: a flag given that the chosen experiment ignores."""

  def _check(self, chosen, argv):
    values = flags.FlagValues()
    flags.DEFINE_string("other", "", "Of no config.", flag_values=values)
    config_flags.define_flags([_Shared, *_EXPERIMENTS.values()], values)
    values(["prog", *argv])
    config_flags.check_flags_read(chosen, _EXPERIMENTS, values,
                                  shared=[_Shared])

  def test_another_experiments_flag_names_owner_and_equivalent(self):
    with self.assertRaisesRegex(ValueError, re.escape(
        "--experiment=b would ignore flags given on the command line:\n"
        "  --steps is the a experiment's; --experiment=b reads --b_steps "
        "instead.\n")):
      self._check("b", ["--steps=3"])
    with self.assertRaisesRegex(ValueError, re.escape(
        "--b_steps is the b experiment's; --experiment=a reads --steps "
        "instead.")):
      self._check("a", ["--b_steps=3"])

  def test_no_equivalent_and_several_owners(self):
    with self.assertRaisesRegex(ValueError, re.escape(
        "  --only_a is the a experiment's; --experiment=b has no such flag.\n"
        "  --both is the a and c experiments'; --experiment=b has no such "
        "flag.\n")):
      self._check("b", ["--both=5", "--only_a=4"])

  def test_given_even_at_its_default_value(self):
    # Explicit on the command line is what counts, not a changed value.
    with self.assertRaisesRegex(ValueError, "--steps is the a experiment's"):
      self._check("b", ["--steps=10"])

  def test_read_shared_and_configless_flags_are_accepted(self):
    self._check("b", ["--b_steps=3", "--seed=2", "--hosts=4", "--other=x"])
    self._check("a", ["--steps=3", "--seed=2", "--both=1", "--hosts=4"])
    self._check("c", ["--both=1"])
    self._check("b", [])  # every flag at its default, none given

  def test_unknown_experiment(self):
    with self.assertRaisesRegex(ValueError, r"chosen='d' is not one of the "
                                r"experiments \['a', 'b', 'c'\]"):
      self._check("d", [])


if __name__ == "__main__":
  absltest.main()
