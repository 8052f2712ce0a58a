"""Flags generated from config dataclasses (experiments/config_flags.py),
on a private FlagValues: kinds, nesting, shared names, cross-field rules."""

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


if __name__ == "__main__":
  absltest.main()
