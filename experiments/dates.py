"""Translating dates: real language data, reordering, and where attention looks.

``python run.py --experiment=dates`` trains the copy task's models (``none``,
``bahdanau``, ``luong``, ``transformer``; the same architectures, optimizer
and step budget flags) to translate dates written out by Babel
(``dates_data``: 8 locales x 7 formats) into ISO ``YYYY-MM-DD``, and, as a
second direction, ISO into the Vietnamese long form. One model per kind
learns every task; characters are the tokens. Then, per task, on held-out
dates (years outside the training range) and on training-range dates:

* ``exact``: greedy output equal to the target (EOS included);
* ``field_acc``: per field (day, month, year), the share of outputs whose
  characters at that field's target positions are all right;
* ``share``: the alignment share. For each output digit of field ``f``
  (teacher-forced), the attention mass on the source characters of field
  ``f`` (day, month name or number, year), averaged per field; the
  Transformer's is the last decoder layer's cross-attention averaged over
  heads. ``uniform`` is what attention spread evenly over the source would
  score (the span's share of the source length).

Writes to the workdir:

* ``results.json``: every number; ``summary.md``: the tables;
* ``accuracy.png``: held-out exact match by locale and by format;
* ``alignment.png``: alignment share per field and model;
* ``attention_<model>.png``: a held-out example per locale (full format)
  and of the reverse direction, field spans marked;
* ``loss_curves.png``; ``checkpoints/<model>/``: orbax checkpoints
  (rerunning resumes).

Shape glossary: B batch, S source length, T target length (EOS included),
N heads.
"""

from __future__ import annotations

import dataclasses
import functools
import os

from flax import nnx
import jax
import numpy as np

from experiments import checkpoints
from experiments import config_flags
from experiments import dates_data
from experiments import dates_plots
from experiments import metrics
from experiments import plots
from experiments import report
from experiments import rnn
from experiments import seq2seq
from experiments import training
from experiments import transformer

MODELS = seq2seq.MODELS
SCORED_FIELDS = (dates_data.DAY, dates_data.MONTH, dates_data.YEAR)
_EVAL_CHUNK = 256  # rows per evaluation call: one compiled shape


@dataclasses.dataclass(frozen=True)
class DatesConfig:
  """What ``python run.py --experiment=dates`` runs; flagged fields are flags.

  ``models``, ``rnn`` and ``transformer`` are the copy task's flags
  (``--models``, ``--encoder``, ``--luong_score``); the training budget has
  ``dates_`` flags of its own.
  """
  workdir: str = config_flags.field("runs/dates", config_flags.WORKDIR)
  models: tuple[str, ...] = config_flags.field(
      ("none", "bahdanau"),
      f"Models to train, comma-separated, from {list(MODELS)}.",
      choices=MODELS)
  locales: tuple[str, ...] = config_flags.field(
      dates_data.LOCALES, "dates: Babel locales whose dates are translated "
      "to ISO.", name="dates_locales")
  formats: tuple[str, ...] = config_flags.field(
      dates_data.FORMATS, "dates: formats: CLDR widths (full, long, medium, "
      "short) and custom patterns (numeric: dd.MM.y, abbreviated: EEE, d "
      "MMM y, month_first: MMMM d, y).", name="dates_formats",
      choices=dates_data.FORMATS)
  reverse: bool = config_flags.field(
      True, "dates: also train and evaluate ISO -> Vietnamese long form.",
      name="dates_reverse")
  reverse_fraction: float = 0.125  # of each batch, when reverse is on
  train: training.TrainConfig = config_flags.nested(
      training.TrainConfig(steps=1000, batch_size=64, learning_rate=3e-3,
                           checkpoint_every=500, log_every=50),
      expose=config_flags.training_flags(
          "dates", "training steps per model.", "batch size."))
  rnn: rnn.RNNConfig = rnn.RNNConfig()
  transformer: transformer.TransformerConfig = transformer.TransformerConfig()
  eval_examples: int = config_flags.field(
      32, "dates: held-out (and training-range) dates per locale and format.",
      name="dates_eval_examples", lower_bound=1)


# Settings a checkpoint's run and the run resuming it may differ in.
RESUMABLE_CHANGES = frozenset({
    "workdir", "models", "eval_examples", "train.log_every",
    "train.checkpoint_every", "train.mesh"})
# TrainConfig fields of the copy task that do not shape this experiment.
_UNUSED_TRAIN = frozenset({"train.task", "train.min_len", "train.max_len",
                           "train.vocab_size"})


def check_config(config: DatesConfig) -> None:
  """ValueError naming a bad model, locale or format (before any training)."""
  bad = [m for m in config.models if m not in MODELS]
  if bad or not config.models:
    raise ValueError(f"models must be a non-empty list from {list(MODELS)}, "
                     f"got {list(config.models)}.")
  if not config.locales or not config.formats:
    raise ValueError("dates needs at least one locale and one format, got "
                     f"locales={list(config.locales)}, "
                     f"formats={list(config.formats)}.")
  for locale in config.locales:
    for fmt in config.formats:
      dates_data.pattern(locale, fmt)  # ValueError if unknown
  if not 0.0 <= config.reverse_fraction <= 1.0:
    raise ValueError(f"reverse_fraction must be in [0, 1], got "
                     f"{config.reverse_fraction}.")


def tasks_of(config: DatesConfig) -> list[tuple[str, str]]:
  return dates_data.all_tasks(config.locales, config.formats, config.reverse)


def build_model(name: str, config: DatesConfig, vocab_size: int,
                mesh: jax.sharding.Mesh | None = None) -> nnx.Module:
  """A fresh model of kind ``name`` over ``vocab_size`` characters."""
  return seq2seq.make_model(name, config, vocab_size, mesh)


def fingerprint(name: str, config: DatesConfig) -> dict:
  """Every setting but ``RESUMABLE_CHANGES``, the copy task's and the other
  model family's architecture, and the year ranges of the data."""
  unused = "rnn." if name == "transformer" else "transformer."
  settings = {
      k: v for k, v in checkpoints.flatten(dataclasses.asdict(config)).items()
      if k not in RESUMABLE_CHANGES | _UNUSED_TRAIN
      and not k.startswith(unused)}
  # The data's year ranges are module constants, not flags: recorded too.
  return report.jsonable({"model": name, **settings,
                          "train_years": dates_data.TRAIN_YEARS,
                          "held_out_years": dates_data.HELD_OUT_YEARS})


def _batches(config: DatesConfig, vocab: dates_data.Vocab, max_src: int,
             max_tgt: int, step: int) -> tuple[np.ndarray, ...]:
  b = dates_data.train_batch(
      step, seed=config.train.seed, batch_size=config.train.batch_size,
      tasks=tasks_of(config), reverse_fraction=config.reverse_fraction,
      vocab=vocab, max_src=max_src, max_tgt=max_tgt).batch
  return b.src, b.src_len, b.tgt_in, b.tgt_out, b.tgt_mask


def alignment_share(attention: np.ndarray, src_fields: np.ndarray,
                    tgt_fields: np.ndarray, tgt_digits: np.ndarray) -> dict:
  """Attention mass each output digit puts on its own field's source span.

  Args:
    attention: ``[B, T, S]`` teacher-forced weights; row ``i`` is the step
      that predicts output ``i``.
    src_fields: int ``[B, S]`` field of each source character.
    tgt_fields: int ``[B, T]`` field of each output.
    tgt_digits: bool ``[B, T]``, True at output digits.

  Returns:
    ``{field name: {"share", "share_pm1", "uniform", "count"}}`` for the
    day, month and year fields that have output digits: ``share`` the mean
    over those digits of ``sum_j a[i, j] [src_field(j) = f]``;
    ``share_pm1`` the same over the span widened by one character each side
    (a GRU state just after a field holds it); ``uniform`` the same for
    attention spread evenly over the source's real characters (padding has
    field literal and no weight).
  """
  a = np.asarray(attention, np.float64)
  src_fields, tgt_fields = np.asarray(src_fields), np.asarray(tgt_fields)
  out = {}
  for f in SCORED_FIELDS:
    rows = (tgt_fields == f) & np.asarray(tgt_digits)  # [B, T]
    if not rows.any():
      continue
    in_span = (src_fields == f).astype(np.float64)  # [B, S]
    mass = np.einsum("bts,bs->bt", a, in_span)  # [B, T]
    # The span and one character either side: a GRU state just after a
    # field (its separator) already holds the field.
    near = np.maximum(in_span, np.maximum(
        np.pad(in_span[:, 1:], ((0, 0), (0, 1))),
        np.pad(in_span[:, :-1], ((0, 0), (1, 0)))))  # [B, S]
    mass_pm1 = np.einsum("bts,bs->bt", a, near)  # [B, T]
    b = np.nonzero(rows)[0]
    # Uniform attention's share: the span's characters over the source's.
    src_len = np.maximum((src_fields >= 0).sum(-1), 1)
    span = in_span.sum(-1) / src_len
    out[dates_data.FIELDS[f]] = {
        "share": float(mass[rows].mean()),
        "share_pm1": float(mass_pm1[rows].mean()),
        "uniform": float(span[b].mean()), "count": int(rows.sum())}
  return out


def _run_chunks(fn, model, arrays, chunk: int) -> np.ndarray:
  """``fn(model, *arrays)`` in fixed-size chunks (one compile), rows kept."""
  n = arrays[0].shape[0]
  outs = []
  for i in range(0, n, chunk):
    part = [x[i:i + chunk] for x in arrays]
    pad = chunk - part[0].shape[0]
    if pad:  # repeat the first row: a real example, dropped again below
      part = [np.concatenate([x, np.repeat(x[:1], pad, 0)]) for x in part]
    outs.append(np.asarray(fn(model, *part))[:chunk - pad])
  return np.concatenate(outs)


def evaluate(model: nnx.Module, config: DatesConfig,
             vocab: dates_data.Vocab, max_src: int, max_tgt: int) -> dict:
  """Per task and split: exact match, field accuracy, alignment share; one
  attention map per task of the held-out split for the heatmaps."""
  per_split, maps = {}, {}
  for split in ("held_out", "in_range"):
    batches = {t: dates_data.eval_batch(
        t, held_out=split == "held_out", seed=config.train.seed,
        num_examples=config.eval_examples, vocab=vocab, max_src=max_src,
        max_tgt=max_tgt) for t in tasks_of(config)}
    src, src_len, tgt_in = (
        np.concatenate([getattr(b.batch, attr) for b in batches.values()])
        for attr in ("src", "src_len", "tgt_in"))
    chunk = min(_EVAL_CHUNK, src.shape[0])  # both splits: the same shape
    tokens = _run_chunks(
        lambda m, s, n: seq2seq.greedy_tokens(m, s, n, max_tgt), model,
        (src, src_len), chunk)
    attention = _run_chunks(seq2seq.teacher_forced_attention, model,
                            (src, src_len, tgt_in), chunk)
    if attention.ndim == 4:  # transformer: [B, N, T, S], mean over heads
      attention = attention.mean(1)
    rows, start = {}, 0
    for task, b in batches.items():
      n = b.batch.src.shape[0]
      rows[dates_data.task_name(task)] = task_metrics(
          tokens[start:start + n], attention[start:start + n], b, vocab)
      if split == "held_out":
        maps[dates_data.task_name(task)] = {
            "weights": attention[start], "src": vocab.decode(b.batch.src[0]),
            "tgt": vocab.decode(b.batch.tgt_out[0]),
            "src_fields": b.src_fields[0], "tgt_fields": b.tgt_fields[0]}
      start += n
    per_split[split] = rows
  return {"tasks": per_split, "maps": maps}


def task_metrics(tokens: np.ndarray, attention: np.ndarray,
                 batch: dates_data.DateBatch, vocab: dates_data.Vocab) -> dict:
  """Exact match, per-field accuracy and (if any) the alignment share."""
  gold = batch.batch.tgt_out
  tokens = np.asarray(tokens)[:, :gold.shape[1]]
  mask = batch.batch.tgt_mask
  correct = (tokens == gold) | ~mask
  row = {"exact": metrics.sequence_metrics(tokens, batch.batch)["seq_acc"]}
  row["field_acc"] = {
      dates_data.FIELDS[f]: float(np.mean(np.all(
          correct | (batch.tgt_fields != f), axis=1)))
      for f in SCORED_FIELDS}
  digits = np.isin(gold, vocab.encode("0123456789"))
  if np.any(attention):  # the no-attention model has no maps
    row["share"] = alignment_share(attention, np.where(
        batch.batch.src != 0, batch.src_fields, -1), batch.tgt_fields, digits)
  row["src_len"] = float(batch.batch.src_len.mean())
  return row


def _mean(rows: list[dict], key: str) -> float:
  return float(np.mean([r[key] for r in rows]))


def aggregate(tasks: dict[str, dict]) -> dict:
  """Means over formats per locale, over locales per format, and overall
  (the reverse direction on its own)."""
  forward = {k: v for k, v in tasks.items()
             if k != dates_data.task_name(dates_data.REVERSE)}
  by = {"locale": {}, "format": {}}
  for name, row in forward.items():
    locale, fmt = name.split("/", 1)
    by["locale"].setdefault(locale, []).append(row)
    by["format"].setdefault(fmt, []).append(row)
  out = {}
  for axis, groups in by.items():
    out[f"by_{axis}"] = {k: _summary_row(v) for k, v in groups.items()}
  out["forward"] = _summary_row(list(forward.values()))
  reverse = tasks.get(dates_data.task_name(dates_data.REVERSE))
  if reverse is not None:
    out["reverse"] = _summary_row([reverse])
  return out


def _summary_row(rows: list[dict]) -> dict:
  out = {"exact": _mean(rows, "exact"),
         "min_exact": float(min(r["exact"] for r in rows)),
         "src_len": _mean(rows, "src_len"),
         "field_acc": {f: float(np.mean([r["field_acc"][f] for r in rows]))
                       for f in rows[0]["field_acc"]}}
  if "share" in rows[0]:
    fields = sorted({f for r in rows for f in r["share"]})
    out["share"] = {
        f: {k: float(np.mean([r["share"][f][k] for r in rows
                              if f in r["share"]]))
            for k in ("share", "share_pm1", "uniform")} for f in fields}
  return out


def run(config: DatesConfig) -> dict:
  """Trains and evaluates every model in ``config.models``; writes the report."""
  check_config(config)
  report.check_writable(config.workdir)
  vocab, max_src, max_tgt = dates_data.build_vocab(tasks_of(config))
  mesh = training.training_mesh(config.train)
  results, maps = {}, {}
  for name in config.models:
    with jax.set_mesh(mesh):
      model = build_model(name, config, vocab.size, mesh)
    ckpt = checkpoints.Checkpointer(
        os.path.join(config.workdir, "checkpoints", name),
        fingerprint(name, config))
    try:
      stats = training.train(
          name, model, config.train, ckpt, mesh,
          batches=functools.partial(_batches, config, vocab, max_src,
                                    max_tgt))
    finally:
      ckpt.close()
    with jax.set_mesh(mesh):
      evaluation = evaluate(model, config, vocab, max_src, max_tgt)
    tasks = evaluation["tasks"]
    results[name] = {
        "train": stats, "tasks": tasks,
        **{split: aggregate(rows) for split, rows in tasks.items()}}
    maps[name] = evaluation["maps"]
  payload = {"config": report.jsonable(dataclasses.asdict(config)),
             "data": {"vocab_size": vocab.size, "max_src": max_src,
                      "max_tgt": max_tgt,
                      "train_years": dates_data.TRAIN_YEARS,
                      "held_out_years": dates_data.HELD_OUT_YEARS,
                      "patterns": {dates_data.task_name(t): dates_data.pattern(
                          *t) for t in tasks_of(config)
                          if t != dates_data.REVERSE}},
             "models": report.jsonable(results)}
  if jax.process_index() == 0:  # one writer when several hosts run this
    _write_report(config, results, maps, payload)
  return payload


def _write_report(config: DatesConfig, results: dict, maps: dict,
                  payload: dict) -> None:
  workdir = config.workdir
  held = {m: r["held_out"] for m, r in results.items()}
  dates_plots.accuracy(os.path.join(workdir, "accuracy.png"), held,
                       list(config.locales), list(config.formats))
  shares = {m: r["held_out"]["by_locale"] for m, r in results.items()
            if "share" in r["held_out"]["forward"]}
  if shares:
    dates_plots.alignment(os.path.join(workdir, "alignment.png"), shares,
                          {m: r["held_out"].get("reverse")
                           for m, r in results.items() if m in shares})
  shown = [dates_data.task_name((loc, "full" if "full" in config.formats
                                 else config.formats[0]))
           for loc in config.locales]
  if config.reverse:
    shown.append(dates_data.task_name(dates_data.REVERSE))
  for name in shares:
    dates_plots.heatmaps(
        os.path.join(workdir, f"attention_{name}.png"),
        {t: maps[name][t] for t in shown},
        f"{name}: teacher-forced attention on held-out dates"
        + (" (last layer, mean over heads)" if name == "transformer" else ""))
  plots.loss_curves(os.path.join(workdir, "loss_curves.png"),
                    {m: r["train"]["loss_curve"] for m, r in results.items()})
  report.write_json(os.path.join(workdir, "results.json"), payload)
  summary = _summary(config, results)
  report.write_text(os.path.join(workdir, "summary.md"), summary)
  print(summary)


def _fmt_share(row: dict, field: str) -> str:
  s = row.get("share", {}).get(field)
  return (f"{s['share']:.2f} / {s['share_pm1']:.2f} ({s['uniform']:.2f})"
          if s else "-")


def _summary(config: DatesConfig, results: dict) -> str:
  t = config.train
  models = list(results)
  lo, hi = dates_data.TRAIN_YEARS
  parts = [
      f"# Dates -> ISO (and ISO -> Vietnamese long form): {', '.join(models)}"
      "\n",
      f"{len(config.locales)} locales ({', '.join(config.locales)}) x "
      f"{len(config.formats)} formats ({', '.join(config.formats)})"
      + (", plus ISO -> vi long" if config.reverse else "") +
      f"; training years {lo}-{hi}, held-out years "
      + ", ".join(f"{a}-{b}" for a, b in dates_data.HELD_OUT_YEARS) +
      f"; {t.steps} steps, batch {t.batch_size}, lr {t.learning_rate}, "
      f"seed {t.seed}; {config.eval_examples} dates per task and split.\n",
      "## Exact match on held-out dates, by locale (mean over formats; "
      "worst format in brackets)\n"]
  rows = [[loc] + [f"{results[m]['held_out']['by_locale'][loc]['exact']:.3f}"
                   f" ({results[m]['held_out']['by_locale'][loc]['min_exact']:.2f})"
                   for m in models] for loc in config.locales]
  if config.reverse:
    rows.append(["ISO -> vi long"] + [
        f"{results[m]['held_out']['reverse']['exact']:.3f}" for m in models])
  rows.append(["all (training-range dates)"] + [
      f"{results[m]['in_range']['forward']['exact']:.3f}" for m in models])
  parts.append(report.markdown_table(["locale"] + models, rows) + "\n")
  parts.append("## Exact match on held-out dates, by format (mean over "
               "locales)\n")
  some = results[models[0]]["held_out"]["by_format"]
  rows = [[fmt, some[fmt]["src_len"]] + [
      results[m]["held_out"]["by_format"][fmt]["exact"] for m in models]
      for fmt in config.formats]
  parts.append(report.markdown_table(["format", "mean source chars"] + models,
                                     rows) + "\n")
  parts.append("## Per-field accuracy on held-out dates (all formats)\n")
  fields = [dates_data.FIELDS[f] for f in SCORED_FIELDS]
  rows = [[m] + [results[m]["held_out"]["forward"]["field_acc"][f]
                 for f in fields]
          + ([results[m]["held_out"]["reverse"]["field_acc"][f]
              for f in fields] if config.reverse else [])
          for m in models]
  parts.append(report.markdown_table(
      ["model"] + fields + ([f"{f} (-> vi)" for f in fields]
                            if config.reverse else []), rows) + "\n")
  attn = [m for m in models if "share" in results[m]["held_out"]["forward"]]
  if attn:
    parts.append(
        "## Alignment share on held-out dates: attention mass each output "
        "digit puts on its field's source span / on the span widened by one "
        "character each side (uniform attention's share in brackets)\n")
    header = ["locale"] + [f"{m} {f}" for m in attn for f in fields]
    rows = [[loc] + [_fmt_share(results[m]["held_out"]["by_locale"][loc], f)
                     for m in attn for f in fields]
            for loc in config.locales]
    if config.reverse:
      rows.append(["ISO -> vi long"] + [
          _fmt_share(results[m]["held_out"]["reverse"], f)
          for m in attn for f in fields])
    rows.append(["all locales"] + [
        _fmt_share(results[m]["held_out"]["forward"], f)
        for m in attn for f in fields])
    parts.append(report.markdown_table(header, rows) + "\n")
  parts.append("## Training\n")
  parts.append(report.markdown_table(
      ["model", "steps", "final loss", "seconds", "steps/s", "timed"],
      [[m, r["train"]["steps"], r["train"]["final_loss"],
        r["train"]["seconds"], _or_dash(r["train"]["steps_per_s"]),
        r["train"]["timing"]]
       for m, r in results.items()]) + "\n")
  return "\n".join(parts)


def _or_dash(value):
  """None (not measured) as "-" in a table, not as a number."""
  return "-" if value is None else value
