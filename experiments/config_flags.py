"""Command-line flags generated from the config dataclasses, and back.

A config field becomes a flag when its metadata carries a ``Flag`` (declared
with ``field``): the flag's name is the field's (unless ``Flag.name`` says
otherwise), its default is the value the experiment's default config holds
there, its help and bounds are the ``Flag``'s, and its type follows the
field's annotation (``int``, ``float``, ``str``, ``bool``, ``X | None``,
``tuple[int, ...]``, ``tuple[str, ...]``). A ``str`` or ``tuple[str, ...]``
field with ``choices`` becomes an enum or a list checked against them.
Nested config fields are walked: every flagged field inside becomes a flag,
unless the parent field (``nested``) names which ones, possibly with other
``Flag``s (a second experiment exposing only some of ``TrainConfig``).

Several experiments share one command line: ``define_flags`` defines each
name once and refuses two fields that would give one flag different
defaults, help or bounds, so no flag can mean two things.

All of them parse whichever experiment runs; ``check_flags_read`` refuses
a flag given on the command line that the chosen experiment would ignore.

This is the only module that touches absl flags; ``run.py`` hands it
``absl.flags.FLAGS``. Experiments themselves only ever see configs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import dataclasses
import types
import typing
from typing import Any

from absl import flags

_FLAG = "flag"  # field metadata key: this field's Flag
_NESTED = "nested_flags"  # field metadata key: the flags of a nested config


@dataclasses.dataclass(frozen=True)
class Flag:
  """How a config field shows on the command line.

  Attributes:
    help: the flag's help text (and the field's documentation).
    name: the flag's name; default: the field's.
    lower_bound: smallest accepted value (numbers).
    choices: accepted values (``str``: an enum; ``tuple[str, ...]``: a
      non-empty list of them).
    not_above: a sibling field this one must not exceed (``min_len`` of
      ``max_len``); checked when both are flags.
    divides: a sibling field this one must divide (heads of a model
      width); checked when both are flags.
    default_none: the flag defaults to None, meaning "the experiment's own
      default" (``--workdir``: ``runs/<experiment>``).
  """
  help: str
  name: str | None = None
  lower_bound: float | None = None
  choices: tuple[str, ...] | None = None
  not_above: str | None = None
  divides: str | None = None
  default_none: bool = False


def field(default: Any, help: str | Flag, **options: Any) -> Any:
  """A dataclass field with ``default`` that is also a flag.

  Args:
    default: the field's default (and so the flag's).
    help: the flag's help text, or a whole ``Flag`` (one shared by several
      configs, such as ``WORKDIR``).
    **options: the other ``Flag`` attributes (``lower_bound``, ``choices``,
      ...), when ``help`` is a string.
  """
  flag = help if isinstance(help, Flag) else Flag(help, **options)
  return dataclasses.field(default=default, metadata={_FLAG: flag})


def nested(default: Any, expose: Mapping[str, Flag | None]) -> Any:
  """A nested config field exposing only some of its fields as flags.

  Args:
    default: the nested config's default value.
    expose: field name -> the ``Flag`` to use there, or None for the field's
      own ``Flag``. Fields not named are not flags of this experiment.
  """
  return dataclasses.field(default=default, metadata={_NESTED: dict(expose)})


def training_flags(prefix: str, steps: str, batch_size: str
                   ) -> dict[str, Flag | None]:
  """``nested``'s ``expose`` for a ``TrainConfig`` under its own flag names.

  An experiment with its own budget names its training flags
  ``<prefix>_steps``, ``<prefix>_batch_size``, ``<prefix>_learning_rate``,
  ``<prefix>_checkpoint_every`` and ``<prefix>_log_every`` (``steps`` and
  ``batch_size`` say what one step and one batch are); ``seed`` and
  ``mesh`` stay the shared ``--seed`` and ``--mesh``.
  """
  return {
      "steps": Flag(f"{prefix}: {steps}", name=f"{prefix}_steps",
                    lower_bound=1),
      "batch_size": Flag(f"{prefix}: {batch_size}",
                         name=f"{prefix}_batch_size", lower_bound=1),
      "learning_rate": Flag(
          f"{prefix}: peak Adam learning rate (cosine decay to 10%).",
          name=f"{prefix}_learning_rate", lower_bound=1e-8),
      "checkpoint_every": Flag(
          f"{prefix}: steps between checkpoints (0: at the end only).",
          name=f"{prefix}_checkpoint_every", lower_bound=0),
      "log_every": Flag(f"{prefix}: steps between logged losses.",
                        name=f"{prefix}_log_every", lower_bound=1),
      "seed": None, "mesh": None}


@dataclasses.dataclass(frozen=True)
class FlagSpec:
  """One flag of one config: where its value goes and what it accepts."""
  name: str
  path: tuple[str, ...]  # field names from the top config to the leaf
  kind: str  # bool | int | float | str | enum | ints | strs
  default: Any  # the value at ``path`` in the default config
  flag: Flag

  @property
  def flag_default(self) -> Any:
    """The absl default: lists as strings, None for ``default_none``."""
    if self.flag.default_none:
      return None
    if self.kind in ("ints", "strs"):
      return [str(v) for v in self.default]
    return self.default

  def to_field(self, value: Any) -> Any:
    """The parsed flag value as the field's type."""
    if self.kind == "ints":
      return tuple(int(v) for v in value)
    if self.kind == "strs":
      return tuple(value)
    return value


def _kind(annotation: Any, flag: Flag, where: str) -> str:
  """The flag kind of a field annotation; TypeError for unsupported ones."""
  if typing.get_origin(annotation) in (typing.Union, types.UnionType):
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if len(args) == 1:
      return _kind(args[0], flag, where)
  elif typing.get_origin(annotation) is tuple:
    args = typing.get_args(annotation)
    if len(args) == 2 and args[1] is Ellipsis and args[0] in (int, str):
      return "ints" if args[0] is int else "strs"
  elif annotation in (bool, int, float):
    return annotation.__name__
  elif annotation is str:
    return "enum" if flag.choices else "str"
  raise TypeError(f"{where}: no flag type for the annotation {annotation!r}.")


def flag_specs(config_cls: type) -> list[FlagSpec]:
  """Every flag of ``config_cls`` (walking nested configs), in field order.

  Raises:
    TypeError: a flagged field whose annotation has no flag type.
    ValueError: two fields of ``config_cls`` claim one flag name.
  """
  specs = _specs(config_cls, config_cls(), (), None)
  names = [s.name for s in specs]
  repeated = sorted({n for n in names if names.count(n) > 1})
  if repeated:
    raise ValueError(f"{config_cls.__name__}: flags {repeated} are claimed "
                     "by more than one field.")
  return specs


def _specs(cls: type, default: Any, path: tuple[str, ...],
           only: Mapping[str, Flag | None] | None) -> list[FlagSpec]:
  hints = typing.get_type_hints(cls)
  specs = []
  for f in dataclasses.fields(cls):
    value = getattr(default, f.name)
    if dataclasses.is_dataclass(hints[f.name]):
      specs += _specs(hints[f.name], value, path + (f.name,),
                      f.metadata.get(_NESTED))
      continue
    flag = f.metadata.get(_FLAG)
    if only is not None:
      if f.name not in only:
        continue
      flag = only[f.name] or flag
    if flag is None:
      continue
    where = f"{cls.__name__}.{f.name}"
    specs.append(FlagSpec(name=flag.name or f.name, path=path + (f.name,),
                          kind=_kind(hints[f.name], flag, where),
                          default=value, flag=flag))
  return specs


def _rules(specs: Sequence[FlagSpec]) -> list[tuple[str, str, str]]:
  """``(kind, a, b)``: flag ``a`` must not exceed (``not_above``) or must
  divide (``divides``) flag ``b``."""
  by_path = {s.path: s for s in specs}
  rules = []
  for s in specs:
    for kind in ("not_above", "divides"):
      sibling = getattr(s.flag, kind)
      other = by_path.get(s.path[:-1] + (sibling,)) if sibling else None
      if other is not None:
        rules.append((kind, s.name, other.name))
  return rules


def _positive_ints(values) -> bool:
  return all(v.strip().isdigit() and int(v) > 0 for v in values)


def _define(spec: FlagSpec, flag_values: flags.FlagValues) -> None:
  f, name, default = spec.flag, spec.name, spec.flag_default
  common = {"flag_values": flag_values}
  if spec.kind == "bool":
    flags.DEFINE_bool(name, default, f.help, **common)
  elif spec.kind == "int":
    flags.DEFINE_integer(name, default, f.help, lower_bound=f.lower_bound,
                         **common)
  elif spec.kind == "float":
    flags.DEFINE_float(name, default, f.help, lower_bound=f.lower_bound,
                       **common)
  elif spec.kind == "str":
    flags.DEFINE_string(name, default, f.help, **common)
  elif spec.kind == "enum":
    flags.DEFINE_enum(name, default, list(f.choices), f.help, **common)
  else:
    flags.DEFINE_list(name, default, f.help, **common)
    if spec.kind == "ints":
      flags.register_validator(
          name, _positive_ints, flag_values=flag_values,
          message=f"--{name} must be a comma-separated list of positive "
          "integers.")
    elif f.choices:
      choices = f.choices
      flags.register_validator(
          name, lambda vs: bool(vs) and all(v in choices for v in vs),
          flag_values=flag_values,
          message=f"--{name} must be a non-empty list from {list(choices)}.")


def _same_flag(a: FlagSpec, b: FlagSpec) -> bool:
  return (a.kind, a.flag_default, a.flag) == (b.kind, b.flag_default, b.flag)


def define_flags(config_classes: Sequence[type],
                 flag_values: flags.FlagValues) -> None:
  """Defines the flags of every config in ``config_classes``, each once.

  Args:
    config_classes: dataclasses whose fields (nested ones walked) carry
      ``Flag``s; a flag name may recur across them only with the same kind,
      default and ``Flag``.
    flag_values: where to define them (``absl.flags.FLAGS``). They belong
      to this module: ``flags.adopt_module_key_flags(config_flags)`` in the
      main module makes ``--help`` list them.

  Raises:
    ValueError: one flag name with two meanings.
  """
  defined, rules = {}, []
  for cls in config_classes:
    specs = flag_specs(cls)
    for spec in specs:
      if spec.name in defined:
        if not _same_flag(defined[spec.name], spec):
          raise ValueError(
              f"--{spec.name} would mean two things: {defined[spec.name]} "
              f"and {spec} ({cls.__name__}).")
        continue
      defined[spec.name] = spec
      _define(spec, flag_values)
    rules += [r for r in _rules(specs) if r not in rules]
  for kind, a, b in rules:
    if kind == "not_above":
      check = lambda v, a=a, b=b: v[a] <= v[b]  # noqa: E731
      message = f"--{a} must not exceed --{b}."
    else:
      check = lambda v, a=a, b=b: v[a] > 0 and v[b] % v[a] == 0  # noqa: E731
      message = f"--{a} must divide --{b}."
    flags.register_multi_flags_validator([a, b], check, message=message,
                                         flag_values=flag_values)


def _replace(config: Any, path: tuple[str, ...], value: Any) -> Any:
  if len(path) == 1:
    return dataclasses.replace(config, **{path[0]: value})
  inner = _replace(getattr(config, path[0]), path[1:], value)
  return dataclasses.replace(config, **{path[0]: inner})


def check_flags_read(chosen: str, experiments: Mapping[str, type],
                     flag_values: flags.FlagValues,
                     shared: Sequence[type] = ()) -> None:
  """Refuses a flag set on the command line that ``chosen`` would ignore.

  Every experiment's flags are defined on one command line, so
  ``--experiment=lm --steps=10`` parses, yet the LM reads ``--lm_steps`` and
  would silently train its own default budget. A flag of some experiment's
  config that was given explicitly (absl's ``present``) and that neither
  ``chosen``'s config nor a ``shared`` config reads is refused. Flags of no
  config (``--experiment``, absl's ``--help``, ``--verbosity``) are not
  looked at.

  Args:
    chosen: the ``--experiment`` value, a key of ``experiments``.
    experiments: experiment name -> its config dataclass.
    flag_values: the parsed flags (``absl.flags.FLAGS``).
    shared: configs every experiment reads (``DistributedConfig``).

  Raises:
    ValueError: naming each such flag, the experiment(s) whose flag it is,
      and the flag at the same config field in ``chosen``, where there is
      one (``--steps`` -> ``--lm_steps``).
  """
  if chosen not in experiments:
    raise ValueError(f"chosen={chosen!r} is not one of the experiments "
                     f"{list(experiments)}.")
  specs = {name: flag_specs(cls) for name, cls in experiments.items()}
  read = {s.name for s in specs[chosen]}
  read |= {s.name for cls in shared for s in flag_specs(cls)}
  by_path = {s.path: s.name for s in specs[chosen]}
  owners, paths = {}, {}  # unread flag name -> its experiments, its field
  for name, experiment_specs in specs.items():
    for s in experiment_specs:
      if s.name not in read:
        owners.setdefault(s.name, []).append(name)
        paths.setdefault(s.name, s.path)
  problems = []
  for name, names in owners.items():
    if name not in flag_values or not flag_values[name].present:
      continue
    whose = (f"the {names[0]} experiment's" if len(names) == 1 else
             f"the {', '.join(names[:-1])} and {names[-1]} experiments'")
    equivalent = by_path.get(paths[name])
    reads = (f"--experiment={chosen} reads --{equivalent} instead"
             if equivalent else f"--experiment={chosen} has no such flag")
    problems.append(f"  --{name} is {whose}; {reads}.\n")
  if problems:
    raise ValueError(
        f"--experiment={chosen} would ignore flags given on the command "
        f"line:\n{''.join(problems)}Drop them, or choose the experiment they "
        "belong to.")


def from_flags(config_cls: type, flag_values: flags.FlagValues) -> Any:
  """``config_cls`` built from parsed flags (its defaults where unflagged)."""
  config = config_cls()
  for spec in flag_specs(config_cls):
    value = flag_values[spec.name].value
    if value is None and spec.flag.default_none:
      continue
    config = _replace(config, spec.path, spec.to_field(value))
  return config


WORKDIR = Flag(
    "Where results and checkpoints go (default: runs/<experiment>). "
    "Rerunning with the same flags resumes.", default_none=True)
