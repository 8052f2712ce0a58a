"""Checks of the static values a ``Rope`` is built from and read with.

Shape glossary: H head dim, R rotated features (the rotary dim), ``R / 2``
the rotated pairs (one frequency each).

A ``Rope`` is a static argument under ``jax.jit`` (hashed, compared), so
its fields must be concrete Python values: these checks refuse traced
values and arrays by name, and return the value normalised (floats, bools,
tuples) so that equal descriptions hash equal. ``check_rotary_width`` and
the ``check_*_dim`` ones need the head dim or the rotary dim ``R``, known
only where the head dim is (``apply_rope``, ``Rope.rotary_dim``, a layer
when it is configured, ``Rope.inverse_frequencies``). Each raises
``TypeError`` (a value's type) or ``ValueError`` (its value) with a message
that names the field. ``check_sections_interleaved`` needs the sections
only (they sum to ``R / 2``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.core import checks


def check_number(name: str, value) -> float:
  """A static real number (not a bool, not traced) as a Python float."""
  if isinstance(value, jax.core.Tracer):
    raise TypeError(f"{name} must be a Python number, got a traced value: "
                    "close over it or pass it as a static argument.")
  if isinstance(value, (bool, np.bool_)) or not isinstance(
      value, (int, float, np.integer, np.floating)):
    raise TypeError(f"{name} must be a real Python number, got {value!r} "
                    f"({type(value).__name__}).")
  value = float(value)
  if not np.isfinite(value):
    raise ValueError(f"{name} must be finite, got {value}.")
  return value


def check_choice(name: str, value, choices: tuple[str, ...], type_hint: str,
                 fix: str) -> None:
  """TypeError unless ``value`` is a string; ValueError unless in
  ``choices`` (``fix`` says which to use)."""
  if not isinstance(value, str):
    raise TypeError(
        f"{name} must be a string, one of {', '.join(map(repr, choices))}"
        f"{type_hint}, got {value!r} ({type(value).__name__}).")
  if value not in choices:
    raise ValueError(f"unknown {name} {value!r}: {fix}.")


def check_bool(name: str, value) -> bool:
  """A static Python bool (numpy bools accepted; ints, arrays refused)."""
  if isinstance(value, jax.core.Tracer) or not isinstance(
      value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a Python bool, got {value!r} "
                    f"({type(value).__name__}).")
  return bool(value)


def _as_static_tuple(name: str, value, example: str) -> list:
  """A list, tuple or 1-D NumPy array as a list (refused: traced, other)."""
  if isinstance(value, (jax.Array, jax.core.Tracer)):
    raise TypeError(f"{name} must be static (a tuple of Python numbers), got "
                    f"a JAX array of shape {checks.shape_of(value)}: pass "
                    f"tuple(...) of a concrete value, e.g. {example}.")
  if isinstance(value, np.ndarray) and value.ndim == 1:
    value = value.tolist()
  if not isinstance(value, (list, tuple)):
    raise TypeError(f"{name} must be a tuple (or list) of numbers, got "
                    f"{value!r} ({type(value).__name__}), e.g. {example}.")
  if not value:
    raise ValueError(f"{name} is empty: give one entry per rotated pair "
                     f"(R / 2 of them), e.g. {example}.")
  return list(value)


def check_factors(name: str, value) -> tuple[float, ...]:
  """LongRoPE's per-frequency divisors: positive finite Python floats."""
  values = _as_static_tuple(name, value, "(1.0, 1.05, 1.3, ...)")
  out = tuple(check_number(f"{name}[{i}]", v) for i, v in enumerate(values))
  bad = [(i, v) for i, v in enumerate(out) if v <= 0.0]
  if bad:
    raise ValueError(f"{name} must be positive (each divides a frequency), "
                     f"got {name}[{bad[0][0]}]={bad[0][1]}.")
  return out


def check_sections(value) -> tuple[int, ...]:
  """M-RoPE's section sizes: positive Python ints."""
  values = _as_static_tuple("sections", value, "(16, 24, 24) (Qwen2-VL)")
  for i, v in enumerate(values):
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
      raise TypeError(f"sections[{i}] must be a Python int (a count of "
                      f"frequencies), got {v!r} ({type(v).__name__}).")
    if v <= 0:
      raise ValueError(f"sections[{i}] must be positive (a count of "
                       f"frequencies), got {v}.")
  return tuple(int(v) for v in values)


def check_rotary_dim(rotary_dim) -> int:
  """``R`` given directly: a positive even Python int (pairs rotate)."""
  if isinstance(rotary_dim, (bool, np.bool_)) or not isinstance(
      rotary_dim, (int, np.integer)):
    raise TypeError(f"rotary_dim must be a Python int, got {rotary_dim!r} "
                    f"({type(rotary_dim).__name__}).")
  if rotary_dim <= 0 or rotary_dim % 2:
    raise ValueError(f"rotary_dim must be a positive even int (features "
                     f"rotate in pairs), got {rotary_dim}; "
                     f"Rope.rotary_dim(H) gives it for head dim H.")
  return int(rotary_dim)


def check_seq_len_array(seq_len) -> None:
  """An array ``seq_len`` (may be traced): a scalar, integer or float."""
  dtype = jnp.result_type(seq_len)
  if np.ndim(seq_len) != 0 or not (jnp.issubdtype(dtype, jnp.integer)
                                   or jnp.issubdtype(dtype, jnp.floating)):
    raise TypeError(
        f"seq_len must be a number or a scalar integer/float array, got "
        f"dtype {dtype} with shape {checks.shape_of(seq_len)}.")


def _fraction_for(width: int, head_dim: int) -> float:
  """The fraction whose ``int(H * fraction)`` is ``width``: ``width / H``,
  nudged up one ulp where the product rounds just below ``width``."""
  fraction = width / head_dim
  if int(head_dim * fraction) != width:
    fraction = math.nextafter(fraction, math.inf)
  return fraction


def _even_head_dims(fraction: float, head_dim: int) -> list[int]:
  """The nearest even head dims below and above ``H`` (at most one each)
  where ``int(H' * fraction)`` is even and positive."""
  def fits(h):
    return int(h * fraction) >= 2 and int(h * fraction) % 2 == 0
  lo = head_dim - 1 - (head_dim - 1) % 2  # the even ones round H
  hi = head_dim + 1 + (head_dim + 1) % 2
  below = [h for h in range(lo, 1, -2) if fits(h)][:1]
  above = [h for h in range(hi, 4 * hi, 2) if fits(h)][:1]
  return below + above


def check_rotary_width(fraction: float, head_dim: int, rot: int) -> None:
  """``R = int(H * fraction)`` must be even: features rotate in pairs.

  Rounding an odd ``R`` either way would rotate another model's features
  (down: one feature left unrotated; up: one more). transformers computes
  the same ``int(H * partial_rotary_factor)`` and has no one answer for an
  odd one either: recent versions rotate ``R + 1`` features at frequencies
  ``base**(-2 i / R)``, older ones fail on shapes (GPT-NeoX, Phi). Its
  published configs give even widths (GPT-NeoX/Pythia 0.25, Phi-2 0.4 of
  80, Phi-4-mini 0.75 of 128, MiMo 0.334 of 192 -> 64), so an odd one is
  refused rather than guessed.
  """
  if rot % 2 == 0:
    return
  fractions = [f"{_fraction_for(w, head_dim)!r} ({w} of {head_dim})"
               for w in (rot - 1, rot + 1) if 2 <= w <= head_dim]
  dims = " or ".join(f"H={h}" for h in _even_head_dims(fraction, head_dim))
  raise ValueError(
      f"fraction={fraction} of head dim H={head_dim} gives int(H * fraction)"
      f" = {rot} rotated features, an odd count: features rotate in pairs, "
      f"so the rotary width must be even (rounding it would rotate another "
      f"model's features; transformers has no one answer for it either). "
      f"Use fraction={' or '.join(fractions)}"
      + (f", or a head dim where int(H * {fraction}) is even ({dims})"
         if dims else "") + ".")


def _where(fraction: float, head_dim: int | None) -> str:
  """Where ``R`` came from, for the messages (empty without a head dim)."""
  if head_dim is None:
    return ""
  return f" (head dim H={head_dim}, fraction={fraction})"


def check_longrope_dim(short_factor, long_factor, fraction: float, rot: int,
                       head_dim: int | None = None) -> None:
  """LongRoPE's factor lists must have one entry per rotated pair."""
  for name, factors in (("short_factor", short_factor),
                        ("long_factor", long_factor)):
    n = len(factors)
    if n != rot // 2:
      raise ValueError(
          f"{name} has {n} entries, but the rotary dim R={rot}"
          f"{_where(fraction, head_dim)} has R / 2 = {rot // 2} frequencies: "
          f"give one factor per frequency (HF: head_dim * "
          f"partial_rotary_factor / 2).")


def check_sections_dim(sections, fraction: float, rot: int,
                       head_dim: int | None = None) -> None:
  """M-RoPE's sections must split the rotated pairs exactly."""
  if sections is None or sum(sections) == rot // 2:
    return
  raise ValueError(
      f"sections={sections} sum to {sum(sections)}, but the rotary dim "
      f"R={rot}{_where(fraction, head_dim)} has R / 2 = {rot // 2} "
      f"frequencies: the sections must split them exactly (Qwen2-VL: "
      f"(16, 24, 24) for H=128).")


def check_dynamic_dim(rot: int, what: str = "scaling='dynamic'") -> None:
  """Dynamic NTK's base exponent ``R / (R - 2)`` (``what``: that scaling's,
  or ``ntk_alpha``'s) needs ``R >= 4``."""
  if rot < 4:
    raise ValueError(
        f"{what} needs a rotary dim R >= 4 (its base exponent "
        f"R / (R - 2) is undefined at R = 2), got R={rot}: raise the head "
        f"dim or fraction.")


def check_sections_interleaved(sections: tuple[int, ...]) -> None:
  """Qwen3-VL's interleaved sections: exactly three (time, height, width),
  each of height's and width's pairs inside the ``sum(sections)`` pairs.

  HF's ``slice(a, 3 * sections[a], 3)`` would silently give an axis fewer
  pairs than its section names where the slice runs past the end, so
  such sections are refused rather than read differently.
  """
  if len(sections) != 3:
    raise ValueError(
        f"sections_interleaved=True needs three sections (time, height, "
        f"width: Qwen3-VL's THWTHW... pattern is defined for those), got "
        f"sections={sections}: give three (e.g. (24, 20, 20) for H=128) or "
        f"set sections_interleaved=False for the blocked layout.")
  pairs = sum(sections)
  for a, name in ((1, "height"), (2, "width")):
    last = a + 3 * (sections[a] - 1)  # its last pair, HF's slice's
    if last >= pairs:
      raise ValueError(
          f"sections={sections} with sections_interleaved=True: the "
          f"{name} axis's {sections[a]} pairs sit at {a}, {a + 3}, ..., "
          f"{last}, past the last of the {pairs} pairs (R / 2 = "
          f"sum(sections)): with {pairs} pairs sections[{a}] may be at most "
          f"{(pairs + 2 - a) // 3}. Raise sections[0] or lower "
          f"sections[{a}].")
