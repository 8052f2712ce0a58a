"""The dates experiment: Babel field spans, data, the alignment share, a tiny run."""

import dataclasses
import datetime
import json
import os
import tempfile

from absl.testing import absltest
import babel.dates
import numpy as np

from experiments import data
from experiments import dates
from experiments import dates_data
from experiments import rnn
from experiments import training

L, D, M, Y, W = (dates_data.LITERAL, dates_data.DAY, dates_data.MONTH,
                 dates_data.YEAR, dates_data.WEEKDAY)
MARCH_7 = datetime.date(2024, 3, 7)


def _spans(*pieces):
  """``(text, fields)`` from hand-written ``(piece, field)`` segments."""
  text = "".join(p for p, _ in pieces)
  fields = [f for p, f in pieces for _ in p]
  return text, fields


class SpansTest(absltest.TestCase):

  def test_known_strings(self):
    cases = {
        ("vi", "full"): _spans(("Thứ Năm", W), (", ", L), ("7", D), (" ", L),
                               ("tháng 3", M), (", ", L), ("2024", Y)),
        ("ja", "long"): _spans(("2024", Y), ("年", L), ("3", M), ("月", L),
                               ("7", D), ("日", L)),
        ("de", "full"): _spans(("Donnerstag", W), (", ", L), ("7", D),
                               (". ", L), ("März", M), (" ", L), ("2024", Y)),
        ("es", "long"): _spans(("7", D), (" de ", L), ("marzo", M),
                               (" de ", L), ("2024", Y)),
        # en's short pattern is M/d/yy: the year is widened to four digits.
        ("en", "short"): _spans(("3", M), ("/", L), ("7", D), ("/", L),
                                ("2024", Y)),
    }
    for (locale, fmt), (text, fields) in cases.items():
      with self.subTest(f"{locale}/{fmt}"):
        got_text, got_fields = dates_data.format_fields(MARCH_7, locale, fmt)
        self.assertEqual(got_text, text)
        self.assertEqual(got_fields.tolist(), fields)

  def test_every_task_matches_babel(self):
    date = datetime.date(1987, 11, 23)
    for locale, fmt in dates_data.all_tasks(reverse=False):
      text, fields = dates_data.format_fields(date, locale, fmt)
      # Babel's own formatting of the whole pattern; for widths without a
      # two-digit year, also of the width itself.
      self.assertEqual(text, babel.dates.format_date(
          date, dates_data.pattern(locale, fmt), locale=locale))
      if fmt in dates_data.WIDTHS and "yy" not in str(
          babel.dates.get_date_format(fmt, locale=locale).pattern):
        self.assertEqual(text, babel.dates.format_date(date, fmt,
                                                       locale=locale))
      self.assertLen(fields, len(text))
      # The year's digits sit in the year span, whatever the order.
      year = "".join(c for c, f in zip(text, fields) if f == Y)
      self.assertEqual(year, "1987", f"{locale}/{fmt}: {text!r}")

  def test_bad_locale(self):
    with self.assertRaisesRegex(ValueError, "locale 'xx_nope'"):
      dates_data.pattern("xx_nope", "long")


class DataTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tasks = dates_data.all_tasks()
    cls.vocab, cls.max_src, cls.max_tgt = dates_data.build_vocab(cls.tasks)
    cls.kw = dict(seed=0, batch_size=64, tasks=cls.tasks,
                  reverse_fraction=0.125, vocab=cls.vocab,
                  max_src=cls.max_src, max_tgt=cls.max_tgt)

  def test_targets(self):
    b = dates_data.train_batch(3, **self.kw)
    for row, (date, task) in enumerate(zip(b.dates, b.tasks)):
      tgt = self.vocab.decode(b.batch.tgt_out[row])
      src = self.vocab.decode(b.batch.src[row])
      if task == dates_data.REVERSE:
        self.assertEqual(src, f"[iso] {date.year:04d}-{date.month:02d}-"
                         f"{date.day:02d}")
        self.assertEqual(tgt, babel.dates.format_date(date, "long",
                                                      locale="vi"))
      else:
        self.assertEqual(src, f"[{task[0]}] " + babel.dates.format_date(
            date, dates_data.pattern(*task), locale=task[0]))
        self.assertEqual(tgt, f"{date.year:04d}-{date.month:02d}-"
                         f"{date.day:02d}")
        self.assertEqual(b.tgt_fields[row, :10].tolist(),
                         [Y] * 4 + [L] + [M] * 2 + [L] + [D] * 2)
      n = len(tgt)
      self.assertEqual(b.batch.tgt_out[row, n], data.EOS)
      self.assertEqual(b.batch.tgt_in[row, 0], data.BOS)
      np.testing.assert_array_equal(b.batch.tgt_in[row, 1:n + 1],
                                    b.batch.tgt_out[row, :n])

  def test_deterministic(self):
    a, b = (dates_data.train_batch(5, **self.kw) for _ in range(2))
    np.testing.assert_array_equal(a.batch.src, b.batch.src)
    self.assertEqual(a.dates, b.dates)
    c = dates_data.train_batch(6, **self.kw)
    self.assertNotEqual(a.dates, c.dates)

  def test_held_out_years_never_in_training(self):
    lo, hi = dates_data.TRAIN_YEARS
    seen_tasks, years = set(), set()
    for step in range(40):
      b = dates_data.train_batch(step, **self.kw)
      seen_tasks.update(b.tasks)
      years.update(d.year for d in b.dates)
    self.assertTrue(all(lo <= y <= hi for y in years))
    # Every locale and format (and the reverse direction) is trained on.
    self.assertEqual(seen_tasks, set(self.tasks))
    self.assertLen(self.tasks, 8 * 7 + 1)
    held = dates_data.eval_batch(
        ("vi", "full"), held_out=True, seed=0, num_examples=64,
        vocab=self.vocab, max_src=self.max_src, max_tgt=self.max_tgt)
    held_years = [d.year for d in held.dates]
    self.assertTrue(all(y < lo or y > hi for y in held_years))
    self.assertTrue(any(y < lo for y in held_years))
    self.assertTrue(any(y > hi for y in held_years))

  def test_vocab(self):
    text = "Thứ Năm, 7 tháng 3, 2024"
    self.assertEqual(self.vocab.decode(self.vocab.encode(text)), text)
    with self.assertRaisesRegex(ValueError, "not in the vocabulary"):
      self.vocab.encode("☃")


class AlignmentShareTest(absltest.TestCase):

  def test_hand_made_attention(self):
    # Source "7/3/2024"-like fields: day, lit, month, lit, year x4, then PAD.
    src_fields = np.array([[D, L, M, L, Y, Y, Y, Y, -1]])
    # Outputs: year digits x4, '-', month x2, '-', day x2, EOS.
    tgt_fields = np.array([[Y, Y, Y, Y, L, M, M, L, D, D, L]])
    digits = np.array([[1, 1, 1, 1, 0, 1, 1, 0, 1, 1, 0]], bool)
    rng = np.random.default_rng(0)
    a = rng.random((1, 11, 9))
    a[..., -1] = 0.0  # no weight on padding
    a /= a.sum(-1, keepdims=True)
    got = dates.alignment_share(a, src_fields, tgt_fields, digits)
    # Reference: loops over digits and source positions.
    for name, f in (("day", D), ("month", M), ("year", Y)):
      masses = [sum(a[0, i, j] for j in range(9) if src_fields[0, j] == f)
                for i in range(11) if tgt_fields[0, i] == f and digits[0, i]]
      # Float64 sums of <= 9 terms in another order: rounding only.
      self.assertAlmostEqual(got[name]["share"], np.mean(masses), places=12)
      self.assertEqual(got[name]["count"], len(masses))
      span = [j for j in range(9) if src_fields[0, j] == f]
      near = [j for j in range(9) if min(abs(j - k) for k in span) <= 1]
      masses = [sum(a[0, i, j] for j in near)
                for i in range(11) if tgt_fields[0, i] == f and digits[0, i]]
      self.assertAlmostEqual(got[name]["share_pm1"], np.mean(masses),
                             places=12)
    self.assertAlmostEqual(got["year"]["uniform"], 4 / 8)
    self.assertAlmostEqual(got["day"]["uniform"], 1 / 8)
    # Perfect alignment scores 1.
    perfect = np.zeros_like(a)
    for i in range(11):
      span = np.nonzero(src_fields[0] == tgt_fields[0, i])[0]
      perfect[0, i, span if tgt_fields[0, i] != L else 1] = 1.0
    perfect /= perfect.sum(-1, keepdims=True)
    got = dates.alignment_share(perfect, src_fields, tgt_fields, digits)
    for name in ("day", "month", "year"):
      self.assertAlmostEqual(got[name]["share"], 1.0)


class RunTest(absltest.TestCase):

  def test_bad_config(self):
    with self.assertRaisesRegex(ValueError, "locale 'zz_bad'"):
      dates.check_config(dates.DatesConfig(locales=("vi", "zz_bad")))
    with self.assertRaisesRegex(ValueError, "models must be"):
      dates.check_config(dates.DatesConfig(models=("gru",)))

  def test_fingerprint(self):
    base = dates.DatesConfig()
    want = dates.fingerprint("bahdanau", base)
    same = dataclasses.replace(base, workdir="/elsewhere", eval_examples=3,
                               train=dataclasses.replace(base.train,
                                                         log_every=7))
    self.assertEqual(dates.fingerprint("bahdanau", same), want)
    for other in (dataclasses.replace(base, locales=("vi",)),
                  dataclasses.replace(base, reverse=False),
                  dataclasses.replace(base, train=dataclasses.replace(
                      base.train, steps=5))):
      self.assertNotEqual(dates.fingerprint("bahdanau", other), want)
    self.assertEqual(want["train_years"], list(dates_data.TRAIN_YEARS))

  def test_tiny_run_writes_the_report(self):
    workdir = self.enterContext(tempfile.TemporaryDirectory())
    config = dates.DatesConfig(
        workdir=workdir, models=("bahdanau",), locales=("vi", "ja"),
        formats=("full", "short"), eval_examples=2,
        train=training.TrainConfig(steps=2, batch_size=4, log_every=1,
                                   checkpoint_every=0),
        rnn=rnn.RNNConfig(embed_dim=4, encoder_dim=4, decoder_dim=8))
    payload = dates.run(config)
    files = set(os.listdir(workdir))
    for f in ("results.json", "summary.md", "accuracy.png", "alignment.png",
              "attention_bahdanau.png", "loss_curves.png"):
      self.assertIn(f, files)
    with open(os.path.join(workdir, "results.json")) as f:
      saved = json.load(f)
    self.assertEqual(saved["models"].keys(), {"bahdanau"})
    res = saved["models"]["bahdanau"]
    self.assertEqual(set(res["held_out"]["by_locale"]), {"vi", "ja"})
    self.assertEqual(set(res["held_out"]["by_format"]), {"full", "short"})
    self.assertLen(res["tasks"]["held_out"], 2 * 2 + 1)
    self.assertEqual(set(res["held_out"]["forward"]["share"]),
                     {"day", "month", "year"})
    self.assertIn("iso/vi_long", res["tasks"]["in_range"])
    self.assertBetween(res["held_out"]["forward"]["exact"], 0.0, 1.0)
    self.assertEqual(payload["models"]["bahdanau"]["train"]["steps"], 2)


if __name__ == "__main__":
  absltest.main()
