"""The copy/reverse experiment: the bottleneck, and attention learning alignment.

Trains each requested model with the same step budget on random-token
sequences (``training.py``), then, for each evaluation length (longer ones
than any seen in training included): greedy-decoding accuracy, and the
alignment of teacher-forced attention with the gold positions
(``metrics.py``). Writes to the workdir:

* ``results.json``: every number; ``summary.md``: the tables;
* ``accuracy_vs_length.png``: token accuracy per length, one line per model;
* ``attention_<model>_len<L>.png``: attention heatmaps;
* ``loss_curves.png``; ``checkpoints/<model>/``: orbax checkpoints.
"""

from __future__ import annotations

import dataclasses
import os

from flax import nnx
import jax
import numpy as np

from experiments import checkpoints
from experiments import config_flags
from experiments import data
from experiments import metrics
from experiments import parallel
from experiments import plots
from experiments import report
from experiments import rnn
from experiments import training
from experiments import transformer

MODELS = (*rnn.ATTENTIONS, "transformer")


@dataclasses.dataclass(frozen=True)
class Seq2SeqConfig:
  """What ``python run.py`` (``--experiment=seq2seq``) runs.

  Every model trains with ``train``; the GRU models share ``rnn``, the
  Transformer is ``transformer``. Fields declared with ``config_flags.field``
  (here and inside the nested configs) are ``run.py``'s flags.
  """
  workdir: str = config_flags.field("runs/seq2seq", config_flags.WORKDIR)
  models: tuple[str, ...] = config_flags.field(
      ("none", "bahdanau"),
      f"Models to train, comma-separated, from {list(MODELS)}.",
      choices=MODELS)
  train: training.TrainConfig = training.TrainConfig()
  # These two fields share their modules' names: below them, `rnn` and
  # `transformer` in this class body are the default configs, not modules.
  rnn: rnn.RNNConfig = rnn.RNNConfig()
  transformer: transformer.TransformerConfig = transformer.TransformerConfig()
  eval_lengths: tuple[int, ...] = config_flags.field(
      (5, 10, 15, 20, 25, 30, 35, 40),
      "Source lengths to evaluate (longer than --max_len tests "
      "extrapolation).")
  eval_examples: int = config_flags.field(
      128, "Examples per evaluation length.", lower_bound=1)
  heatmap_lengths: tuple[int, ...] = config_flags.field(
      (10, 30), "Lengths to draw attention maps for.")


# Settings a checkpoint's run and the run resuming it may differ in: where
# results go, what is evaluated, how often it logs and saves, and the devices
# (a mesh changes only the order of float sums). Every other field shapes the
# trained numbers and is fingerprinted.
RESUMABLE_CHANGES = frozenset({
    "workdir", "models", "eval_lengths", "eval_examples", "heatmap_lengths",
    "train.log_every", "train.checkpoint_every", "train.mesh"})


def build_model(name: str, config: Seq2SeqConfig,
                mesh: jax.sharding.Mesh | None = None) -> nnx.Module:
  """A fresh model; with a ``mesh`` whose ``model`` axis is > 1, the
  Transformer's heads and FFN units are annotated to split over it (build
  under ``jax.set_mesh(mesh)``)."""
  return make_model(name, config, config.train.vocab_size, mesh)


def make_model(name: str, config, vocab_size: int,
               mesh: jax.sharding.Mesh | None = None) -> nnx.Module:
  """Model ``name`` from a config with ``rnn``, ``transformer`` and
  ``train.seed`` fields (this task's or another's) over ``vocab_size``."""
  rngs = nnx.Rngs(config.train.seed)
  if name == "transformer":
    return transformer.TransformerSeq2Seq(
        config.transformer, vocab_size=vocab_size, rngs=rngs,
        model_axis=parallel.model_axis(mesh) if mesh else None)
  if name not in rnn.ATTENTIONS:
    raise ValueError(f"model must be one of {MODELS}, got {name!r}.")
  return rnn.RNNSeq2Seq(config.rnn, attention=name, vocab_size=vocab_size,
                        rngs=rngs)


@nnx.jit
def teacher_forced_attention(model, src, src_len, tgt_in):
  """The model's teacher-forced attention ``[B, T, S]`` (jitted)."""
  return model(src, src_len, tgt_in)[1]


@nnx.jit(static_argnums=3)
def greedy_tokens(model, src, src_len, num_steps):
  """Greedy decoding, ``[B, num_steps]`` tokens (jitted; any seq2seq model)."""
  if isinstance(model, transformer.TransformerSeq2Seq):
    return transformer.greedy(model, src, src_len, num_steps)[0]
  return model.greedy(src, src_len, num_steps)[0]


def evaluate(model: nnx.Module, config: Seq2SeqConfig) -> dict:
  """Per-length accuracy and alignment; attention maps for the heatmaps."""
  task, per_length, maps = config.train.task, {}, {}
  for length in config.eval_lengths:
    batch = data.eval_batch(task, length, seed=config.train.seed,
                            num_examples=config.eval_examples,
                            vocab_size=config.train.vocab_size)
    src, src_len, tgt_in, _, _ = training.batch_arrays(batch)
    tokens = np.asarray(greedy_tokens(model, src, src_len, length + 1))
    row = metrics.sequence_metrics(tokens, batch)
    attention = np.asarray(teacher_forced_attention(model, src, src_len, tgt_in))
    if attention.ndim == 4:  # transformer: [B, N, T, S], one map per head
      heads = [metrics.alignment_metrics(attention[:, n], length, task)
               for n in range(attention.shape[1])]
      best = int(np.argmax([h["align_acc"] for h in heads]))
      row.update(heads[best], best_head=best, heads=heads)
      attention = attention[:, best]
    elif attention.any():  # the no-attention model has no maps
      row.update(metrics.alignment_metrics(attention, length, task))
    per_length[length] = row
    maps[length] = attention[0, :length + 1, :length]
  return {"per_length": per_length, "maps": maps}


def _bucket_rows(config: Seq2SeqConfig, results: dict) -> list[list]:
  """Token accuracy by length bucket, the shape the README reports."""
  lo, hi = config.train.min_len, config.train.max_len
  edges = [(lo, min(10, hi)), (11, min(20, hi)), (21, hi), (hi + 1, 10**9)]
  names = [f"{a}-{b}" if b < 10**9 else f">{hi} (unseen)" for a, b in edges]
  rows = []
  for model, res in results.items():
    row = [model]
    for a, b in edges:
      accs = [r["token_acc"] for n, r in res["eval"].items() if a <= n <= b]
      row.append(float(np.mean(accs)) if accs else "-")
    rows.append(row)
  return [["model"] + names] + rows


def _summary(config: Seq2SeqConfig, results: dict) -> str:
  header, *bucket_rows = _bucket_rows(config, results)
  parts = [
      f"# {config.train.task} task: {', '.join(results)}\n",
      f"{config.train.steps} steps, batch {config.train.batch_size}, lr "
      f"{config.train.learning_rate}, training lengths "
      f"{config.train.min_len}-{config.train.max_len}, encoder "
      f"{config.rnn.encoder}, seed {config.train.seed}.\n",
      "## Greedy token accuracy by length bucket\n",
      report.markdown_table(header, bucket_rows) + "\n",
      "## Per length\n",
  ]
  columns = ["token_acc", "seq_acc", "align_acc", "align_acc_pm1",
             "gold_mass", "offset", "entropy"]
  for model, res in results.items():
    rows = [[n] + [r.get(c, "-") for c in columns]
            for n, r in res["eval"].items()]
    train = res["train"]
    parts.append(f"### {model} ({train['steps']} steps, final loss "
                 f"{train['final_loss']:.4g}; "
                 f"{training.throughput_text(train)})\n")
    parts.append(report.markdown_table(["length"] + columns, rows) + "\n")
  return "\n".join(parts)


def _fingerprint(name: str, config: Seq2SeqConfig) -> dict:
  """The settings a checkpoint must share with the run that resumes it.

  Every field of ``config`` but ``RESUMABLE_CHANGES`` and the architecture of
  the other model family (a GRU model's numbers do not depend on
  ``transformer``, nor the Transformer's on ``rnn``), as dotted names.
  """
  unused = "rnn." if name == "transformer" else "transformer."
  settings = {k: v for k, v in checkpoints.flatten(dataclasses.asdict(config)).items()
              if k not in RESUMABLE_CHANGES and not k.startswith(unused)}
  return report.jsonable({"model": name, **settings})


def run(config: Seq2SeqConfig) -> dict:
  """Trains and evaluates every model in ``config.models``; writes the report."""
  report.check_writable(config.workdir)
  results, maps = {}, {}
  mesh = training.training_mesh(config.train)
  for name in config.models:
    with jax.set_mesh(mesh):
      model = build_model(name, config, mesh)
    ckpt = checkpoints.Checkpointer(
        os.path.join(config.workdir, "checkpoints", name),
        _fingerprint(name, config))
    try:
      train_stats = training.train(name, model, config.train, ckpt, mesh)
    finally:
      ckpt.close()
    with jax.set_mesh(mesh):
      evaluation = evaluate(model, config)
    results[name] = {"train": train_stats, "eval": evaluation["per_length"]}
    maps[name] = evaluation["maps"]
  payload = {"config": report.jsonable(dataclasses.asdict(config)),
             "models": report.jsonable(results)}
  if jax.process_index() == 0:  # one writer when several hosts run this
    _write_report(config, results, maps, payload)
  return payload


def _write_report(config: Seq2SeqConfig, results: dict, maps: dict,
                  payload: dict) -> None:
  """The plots, results.json and summary.md (also printed)."""
  lengths = list(config.eval_lengths)
  train_range = (config.train.min_len, config.train.max_len)
  plots.accuracy_vs_length(
      os.path.join(config.workdir, "accuracy_vs_length.png"), lengths,
      {m: [r["eval"][n]["token_acc"] for n in lengths]
       for m, r in results.items()}, train_range, "greedy token accuracy",
      f"{config.train.task}: accuracy vs source length")
  for name in results:
    if name == "none":
      continue  # no attention to show
    for length in config.heatmap_lengths:
      if length in maps[name]:
        plots.attention_heatmap(
            os.path.join(config.workdir, f"attention_{name}_len{length}.png"),
            maps[name][length], f"{name}, {config.train.task}, length {length}")
  plots.loss_curves(os.path.join(config.workdir, "loss_curves.png"),
                    {m: r["train"]["loss_curve"] for m, r in results.items()})
  report.write_json(os.path.join(config.workdir, "results.json"), payload)
  summary = _summary(config, results)
  report.write_text(os.path.join(config.workdir, "summary.md"), summary)
  print(summary)
