"""Dates written out by Babel (CLDR), with the field each character belongs to.

Shape glossary: B batch, S source length (padded), T target length (padded,
EOS included).

A *task* is ``(locale, format)``: a date formatted by Babel in ``locale``
with ``format`` (a CLDR width, ``full``/``long``/``medium``/``short``, or
one of the ``CUSTOM`` patterns) is the source and its ISO ``YYYY-MM-DD`` the target; the
second direction, ``REVERSE = ("iso", "vi_long")``, has the ISO string as
source and Vietnamese long form (``7 tháng 3, 2024``) as target. Sources
start with a tag naming their language (``source_tag``: ``[en] 3/7/2024``
is March 7, ``[vi] 3/7/2024`` the 3rd of July). Every
pattern is tokenized (``babel.dates.tokenize_pattern``) and each field
formatted on its own (``babel.dates.DateTimeFormat``), so every character of
both strings carries its field: ``FIELDS`` (literal, day, month, year,
weekday). Two-digit years (``yy`` in some short patterns) are widened to
``y``: ``24`` could be 1924 or 2024, and held-out years are the point.

Characters are the tokens: one vocabulary over every locale's month and
weekday names, digits and literals (Vietnamese diacritics, Japanese,
Cyrillic), after ``data.py``'s PAD/BOS/EOS. Batches are a pure function of
``(seed, step)``, like ``data.py``: a resumed run sees the same data.
Training dates have years in ``TRAIN_YEARS``; held-out dates have years in
``HELD_OUT_YEARS`` (outside it on both sides) and never occur in training.
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import datetime
import functools

import babel
import babel.dates
import numpy as np

from experiments import data

LOCALES = ("vi", "en", "fr", "de", "es", "ja", "ru", "pt")
WIDTHS = ("full", "long", "medium", "short")
# Custom Babel patterns, applied in every locale: padded numeric day-first,
# an abbreviated weekday and month, and a wide month name first.
CUSTOM = {"numeric": "dd.MM.y", "abbreviated": "EEE, d MMM y",
          "month_first": "MMMM d, y"}
FORMATS = (*WIDTHS, *CUSTOM)
REVERSE = ("iso", "vi_long")  # the second direction: ISO -> Vietnamese long
FIELDS = ("literal", "day", "month", "year", "weekday")
LITERAL, DAY, MONTH, YEAR, WEEKDAY = range(len(FIELDS))
TRAIN_YEARS = (1100, 9899)  # inclusive
HELD_OUT_YEARS = ((1000, 1099), (9900, 9999))  # inclusive, both sides

# CLDR pattern letter -> field (weekday letters E/e/c; stand-alone month L).
_LETTER_FIELD = {"d": DAY, "M": MONTH, "L": MONTH, "y": YEAR, "Y": YEAR,
                 "E": WEEKDAY, "e": WEEKDAY, "c": WEEKDAY}


def task_name(task: tuple[str, str]) -> str:
  """``"vi/full"``; the reverse direction is ``"iso/vi_long"``."""
  return f"{task[0]}/{task[1]}"


def all_tasks(locales: Sequence[str] = LOCALES,
              formats: Sequence[str] = FORMATS,
              reverse: bool = True) -> list[tuple[str, str]]:
  """Every ``(locale, format)`` pair, then ``REVERSE`` if asked."""
  tasks = [(loc, fmt) for loc in locales for fmt in formats]
  return tasks + [REVERSE] if reverse else tasks


@functools.cache
def pattern(locale: str, fmt: str) -> str:
  """The CLDR pattern of ``fmt`` in ``locale`` (``yy`` widened to ``y``).

  Raises:
    ValueError: an unknown locale.
  """
  try:
    loc = babel.Locale.parse(locale)
  except (ValueError, babel.UnknownLocaleError) as e:
    raise ValueError(f"locale {locale!r} is not one Babel knows: {e}.") from None
  if fmt in WIDTHS:
    text = str(babel.dates.get_date_format(fmt, locale=loc).pattern)
  elif fmt in CUSTOM:
    text = CUSTOM[fmt]
  else:
    raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}.")
  tokens = babel.dates.tokenize_pattern(text)
  widened = [("field", ("y", 1)) if kind == "field" and value == ("y", 2)
             else (kind, value) for kind, value in tokens]
  return babel.dates.untokenize_pattern(widened)


@functools.cache
def _locale(locale: str) -> babel.Locale:
  return babel.Locale.parse(locale)


def format_fields(date: datetime.date, locale: str,
                  fmt: str) -> tuple[str, np.ndarray]:
  """``date`` in ``locale``'s ``fmt`` and each character's field.

  Returns:
    ``(text, fields)``: ``fields`` int8 ``[len(text)]`` of ``FIELDS``
    indices; ``text == babel.dates.format_date(date, pattern(locale, fmt),
    locale=locale)``.
  """
  formatter = babel.dates.DateTimeFormat(date, _locale(locale))
  pieces, fields = [], []
  for kind, value in babel.dates.tokenize_pattern(pattern(locale, fmt)):
    if kind == "chars":
      piece, field = value, LITERAL
    else:
      letter, count = value
      piece, field = formatter[letter * count], _LETTER_FIELD.get(
          letter, LITERAL)
    pieces.append(piece)
    fields.append(np.full(len(piece), field, np.int8))
  return "".join(pieces), np.concatenate(fields)


def iso_fields(date: datetime.date) -> tuple[str, np.ndarray]:
  """``"YYYY-MM-DD"`` and its fields."""
  fields = np.array([YEAR] * 4 + [LITERAL] + [MONTH] * 2 + [LITERAL]
                    + [DAY] * 2, np.int8)
  return date.isoformat(), fields


def source_tag(task: tuple[str, str]) -> str:
  """The prefix naming the source language, ``"[en] "`` (``"[iso] "``).

  Without it some sources are ambiguous: en's short ``3/7/2024`` is March 7,
  vi's and es's the 3rd of July.
  """
  return f"[{task[0]}] "


def example(date: datetime.date,
            task: tuple[str, str]) -> tuple[str, np.ndarray, str, np.ndarray]:
  """``(source, source fields, target, target fields)`` of ``task``; the
  source starts with ``source_tag(task)`` (literal characters)."""
  if task == REVERSE:
    (src, src_fields), tgt = iso_fields(date), format_fields(date, "vi",
                                                             "long")
  else:
    (src, src_fields), tgt = format_fields(date, *task), iso_fields(date)
  tag = source_tag(task)
  return (tag + src, np.concatenate(
      [np.full(len(tag), LITERAL, np.int8), src_fields]), *tgt)


@dataclasses.dataclass(frozen=True)
class Vocab:
  """Characters <-> token ids (after PAD/BOS/EOS)."""
  chars: tuple[str, ...]

  @property
  def size(self) -> int:
    """Content tokens (the models add the specials)."""
    return len(self.chars)

  @functools.cached_property
  def _ids(self) -> dict[str, int]:
    return {c: i + data.NUM_SPECIAL for i, c in enumerate(self.chars)}

  def encode(self, text: str) -> np.ndarray:
    """int32 ``[len(text)]``; ValueError naming a character not in it."""
    try:
      return np.array([self._ids[c] for c in text], np.int32)
    except KeyError as e:
      raise ValueError(f"character {e.args[0]!r} of {text!r} is not in the "
                       "vocabulary; build it over this task's locales "
                       "(build_vocab).") from None

  def decode(self, tokens) -> str:
    """Text up to the first EOS; PAD/BOS dropped."""
    out = []
    for t in np.asarray(tokens).tolist():
      if t == data.EOS:
        break
      if t >= data.NUM_SPECIAL and t - data.NUM_SPECIAL < len(self.chars):
        out.append(self.chars[t - data.NUM_SPECIAL])
    return "".join(out)


def _covering_dates() -> list[datetime.date]:
  """Dates with every month, every weekday and one- and two-digit days."""
  return [datetime.date(2024, m, d) for m in range(1, 13)
          for d in (*range(1, 8), *range(22, 29))]


def build_vocab(tasks: Sequence[tuple[str, str]]) -> tuple[Vocab, int, int]:
  """The vocabulary of ``tasks`` and the longest source and target.

  Formats dates covering every month name, weekday name and day width (a
  year always has 4 digits), so every string of these tasks fits.

  Returns:
    ``(vocab, max source length, max target length + 1 for EOS)``.
  """
  chars, max_src, max_tgt = set("0123456789"), 0, 0
  for task in tasks:
    for date in _covering_dates():
      src, _, tgt, _ = example(date, task)
      chars.update(src + tgt)
      max_src, max_tgt = max(max_src, len(src)), max(max_tgt, len(tgt))
  return Vocab(tuple(sorted(chars))), max_src, max_tgt + 1


def _ordinal_range(years: tuple[int, int]) -> tuple[int, int]:
  return (datetime.date(years[0], 1, 1).toordinal(),
          datetime.date(years[1], 12, 31).toordinal())


def sample_dates(rng: np.random.Generator, n: int,
                 year_ranges: Sequence[tuple[int, int]]) -> list[datetime.date]:
  """``n`` dates uniform over the days of ``year_ranges`` (inclusive)."""
  spans = [_ordinal_range(r) for r in year_ranges]
  sizes = np.array([hi - lo + 1 for lo, hi in spans])
  offsets = rng.integers(0, sizes.sum(), n)
  starts = np.cumsum(sizes) - sizes
  dates = []
  for k in offsets.tolist():
    i = int(np.searchsorted(starts, k, side="right") - 1)
    dates.append(datetime.date.fromordinal(spans[i][0] + k - int(starts[i])))
  return dates


@dataclasses.dataclass(frozen=True)
class DateBatch:
  """A ``data.Batch`` and the fields of its characters."""
  batch: data.Batch
  src_fields: np.ndarray  # int8 [B, S]: FIELDS of each source character
  tgt_fields: np.ndarray  # int8 [B, T]: FIELDS of tgt_out (EOS, PAD: literal)
  tasks: tuple[tuple[str, str], ...]  # [B]
  dates: tuple[datetime.date, ...]  # [B]


def make_batch(dates: Sequence[datetime.date],
               tasks: Sequence[tuple[str, str]], vocab: Vocab, max_src: int,
               max_tgt: int) -> DateBatch:
  """Sources and targets of ``dates[b]`` under ``tasks[b]``, padded to
  ``max_src`` and ``max_tgt`` (EOS included).

  Raises:
    ValueError: a string longer than its padded length.
  """
  b = len(dates)
  src = np.full((b, max_src), data.PAD, np.int32)
  tgt_in = np.full((b, max_tgt), data.PAD, np.int32)
  tgt_out = np.full((b, max_tgt), data.PAD, np.int32)
  src_fields = np.zeros((b, max_src), np.int8)
  tgt_fields = np.zeros((b, max_tgt), np.int8)
  src_len = np.zeros(b, np.int32)
  tgt_len = np.zeros(b, np.int32)
  for row, (date, task) in enumerate(zip(dates, tasks)):
    s, sf, t, tf = example(date, task)
    if len(s) > max_src or len(t) + 1 > max_tgt:
      raise ValueError(
          f"{task_name(task)} {date}: source {s!r} / target {t!r} do not fit "
          f"max_src={max_src}, max_tgt={max_tgt} (EOS included); use "
          "build_vocab's lengths for these tasks.")
    n, m = len(s), len(t)
    src[row, :n], src_fields[row, :n], src_len[row] = vocab.encode(s), sf, n
    target = vocab.encode(t)
    tgt_in[row, 0] = data.BOS
    tgt_in[row, 1:m + 1] = target
    tgt_out[row, :m], tgt_out[row, m] = target, data.EOS
    tgt_fields[row, :m], tgt_len[row] = tf, m + 1
  return DateBatch(data.Batch(src, src_len, tgt_in, tgt_out, tgt_len),
                   src_fields, tgt_fields, tuple(tasks), tuple(dates))


def train_batch(step: int, *, seed: int, batch_size: int,
                tasks: Sequence[tuple[str, str]], reverse_fraction: float,
                vocab: Vocab, max_src: int, max_tgt: int) -> DateBatch:
  """The training batch of ``step``: dates in ``TRAIN_YEARS``, tasks uniform
  over the formatting tasks, the reverse one (if in ``tasks``) with
  probability ``reverse_fraction``."""
  rng = np.random.default_rng([seed, step])
  forward = [t for t in tasks if t != REVERSE]
  p_reverse = reverse_fraction if REVERSE in tasks else 0.0
  if not forward:
    p_reverse = 1.0
  is_reverse = rng.random(batch_size) < p_reverse
  picks = rng.integers(0, max(len(forward), 1), batch_size)
  chosen = [REVERSE if r else forward[i]
            for r, i in zip(is_reverse.tolist(), picks.tolist())]
  dates = sample_dates(rng, batch_size, [TRAIN_YEARS])
  return make_batch(dates, chosen, vocab, max_src, max_tgt)


def eval_batch(task: tuple[str, str], *, held_out: bool, seed: int,
               num_examples: int, vocab: Vocab, max_src: int,
               max_tgt: int) -> DateBatch:
  """``num_examples`` dates of ``task`` (a seed no training step uses):
  held-out years (``HELD_OUT_YEARS``) or training-range ones."""
  rng = np.random.default_rng(
      [seed, 2_000_003, int(held_out), *map(ord, task_name(task))])
  years = HELD_OUT_YEARS if held_out else [TRAIN_YEARS]
  dates = sample_dates(rng, num_examples, years)
  return make_batch(dates, [task] * num_examples, vocab, max_src, max_tgt)
