"""Why attention divides by sqrt(d_k): the softmax saturates without it.

For random queries and keys with unit-variance entries, ``q . k`` has
variance ``d_k``. Unscaled, the logits spread like ``sqrt(d_k)``, the softmax
puts almost all its mass on one key, and the gradient that reaches the query
vanishes. Scaled by ``1/sqrt(d_k)``, the logits keep unit variance whatever
``d_k`` is. This experiment measures, for each ``d_k``, with and without the
scale:

* ``max_prob``: mean over queries of the largest attention weight;
* ``entropy``: mean entropy of the weights divided by ``log S`` (1 = uniform,
  0 = one-hot);
* ``saturated``: fraction of queries whose largest weight exceeds 0.99;
* ``logit_grad``: mean L2 norm of d(loss)/d(logits), the gradient that gets
  through the softmax, for a random linear loss on the attention output
  (scaled so that d(loss)/d(weight_j) ~ N(0, 1) for every ``d_k``);
* ``grad_norm``: mean L2 norm of d(loss)/d(query). Unscaled logits multiply
  it by ``sqrt(d_k)`` while the softmax gradient collapses, so it is shown
  for completeness; the softmax gradient is what vanishes.

Then a short training comparison: the same Transformer (``transformer``;
one head, one layer, d_k = 128 by default) learns the task of ``train``
with and without the scale.

Writes ``results.json``, ``summary.md``, ``logit_scale.png`` (metrics
against d_k) and ``logit_scale_training.png`` (the two loss curves) to the
workdir.

Shape glossary: B queries (batch), S keys, H = d_k head dim.
"""

from __future__ import annotations

import dataclasses
import math
import os

from flax import nnx
import jax
import jax.numpy as jnp

import attention_jax as aj
from experiments import config_flags
from experiments import data
from experiments import metrics
from experiments import plots
from experiments import report
from experiments import training
from experiments import transformer


@dataclasses.dataclass(frozen=True)
class LogitScaleConfig:
  """What ``python run.py --experiment=logit_scale`` measures.

  ``train.seed`` seeds the measurement too; ``train.steps`` = 0 skips the
  training comparison (``--scaling_train_steps``).
  """
  workdir: str = config_flags.field("runs/logit_scale", config_flags.WORKDIR)
  dims: tuple[int, ...] = config_flags.field(  # d_k
      (4, 8, 16, 32, 64, 128, 256, 512, 1024),
      "logit_scale: head dims d_k to measure.")
  num_queries: int = config_flags.field(  # B
      512, "logit_scale: random queries averaged over.", lower_bound=1)
  num_keys: int = config_flags.field(  # S
      64, "logit_scale: keys per query.", lower_bound=2)
  # Each model of the comparison: 20 logged losses, no checkpoints, the copy
  # task at lengths 5..15.
  train: training.TrainConfig = config_flags.nested(
      training.TrainConfig(steps=300, max_len=15, checkpoint_every=0,
                           log_every=15),
      expose={"seed": None, "steps": config_flags.Flag(
          "logit_scale: steps per model of the scaled-vs-unscaled training "
          "run (0 skips it).", name="scaling_train_steps", lower_bound=0)})
  # attention_scale is set per model (1/sqrt(d_k), then 1).
  transformer: transformer.TransformerConfig = transformer.TransformerConfig(
      d_model=128, num_heads=1, num_layers=1, ffn_dim=256)


def _measure(rng: jax.Array, head_dim: int, num_queries: int, num_keys: int,
             scale: float) -> dict[str, jax.Array]:
  kq, kk, kv, kg = jax.random.split(rng, 4)
  query = jax.random.normal(kq, (num_queries, 1, head_dim))  # [B, 1, H]
  key = jax.random.normal(kk, (num_queries, num_keys, head_dim))  # [B, S, H]
  value = jax.random.normal(kv, (num_queries, num_keys, head_dim))
  # cotangent . value_j ~ N(0, 1) whatever head_dim is.
  cotangent = jax.random.normal(kg, (num_queries, 1, head_dim)) / math.sqrt(
      head_dim)

  def loss(q, logit_offset):
    # logit_offset is zero; its gradient is d(loss)/d(logits).
    out, weights = aj.scaled_dot_product_attention(
        q, key, value, bias=logit_offset, scale=scale, return_weights=True)
    return jnp.sum(out * cotangent), weights[:, 0]  # [B, S]

  offset = jnp.zeros((num_queries, 1, num_keys))  # [B, T=1, S]
  (grad_q, grad_logits), weights = jax.grad(loss, (0, 1), has_aux=True)(
      query, offset)
  entropy = -jnp.sum(weights * jnp.log(jnp.maximum(weights, 1e-30)), -1)
  max_prob = jnp.max(weights, -1)
  return {
      "max_prob": jnp.mean(max_prob),
      "entropy": jnp.mean(entropy) / math.log(num_keys),
      "saturated": jnp.mean(max_prob > 0.99),
      "logit_grad": jnp.mean(jnp.linalg.norm(grad_logits[:, 0], axis=-1)),
      "grad_norm": jnp.mean(jnp.linalg.norm(grad_q[:, 0], axis=-1)),
  }


def _head_dim(config: LogitScaleConfig) -> int:
  """d_k of the comparison's Transformer."""
  return config.transformer.d_model // config.transformer.num_heads


def _train_comparison(config: LogitScaleConfig) -> dict:
  """Trains the same model with and without 1/sqrt(d_k); returns both runs."""
  train = config.train
  runs = {}
  for label, scale in (("scaled", None), ("unscaled", 1.0)):
    model = transformer.TransformerSeq2Seq(
        dataclasses.replace(config.transformer, attention_scale=scale),
        vocab_size=train.vocab_size, rngs=nnx.Rngs(train.seed))
    stats = training.train(f"logit_scale/{label}", model, train, None)
    length = train.max_len
    batch = data.eval_batch(train.task, length, seed=train.seed,
                            num_examples=128, vocab_size=train.vocab_size)
    src, src_len, _, _, _ = training.batch_arrays(batch)
    tokens = nnx.jit(transformer.greedy, static_argnums=3)(
        model, src, src_len, length + 1)[0]
    stats["eval_length"] = length
    stats.update(metrics.sequence_metrics(jax.device_get(tokens), batch))
    runs[label] = stats
  return runs


def run(config: LogitScaleConfig) -> dict:
  """Measures saturation against d_k; writes results.json and summary.md.

  Returns:
    ``{"config": ..., "rows": [{"d_k", "scaled", "max_prob", "entropy",
    "grad_norm"}, ...]}``.
  """
  report.check_writable(config.workdir)
  measure = jax.jit(_measure, static_argnums=(1, 2, 3, 4))
  rows = []
  for i, dim in enumerate(config.dims):
    rng = jax.random.fold_in(jax.random.key(config.train.seed), i)
    for scaled in (True, False):
      scale = 1.0 / math.sqrt(dim) if scaled else 1.0
      measured = measure(rng, dim, config.num_queries, config.num_keys, scale)
      rows.append({"d_k": dim, "scaled": scaled,
                   **{k: float(v) for k, v in measured.items()}})

  names = ["max_prob", "entropy", "saturated", "logit_grad", "grad_norm"]
  headers = ["d_k"] + [f"{m} ({kind})" for m in names
                       for kind in ("scaled", "unscaled")]
  by_dim = {(r["d_k"], r["scaled"]): r for r in rows}
  table_rows = [[dim] + [by_dim[(dim, scaled)][m] for m in names
                         for scaled in (True, False)]
                for dim in config.dims]
  table = report.markdown_table(headers, table_rows)
  summary = (
      "# Why attention divides by sqrt(d_k)\n\n"
      f"{config.num_queries} random queries, {config.num_keys} random keys "
      "each, unit-variance entries; 'scaled' uses 1/sqrt(d_k), 'unscaled' 1. "
      "entropy is normalised by log S (1 = uniform, 0 = one-hot); saturated "
      "is the share of queries with a weight > 0.99; logit_grad is "
      "|d loss / d logits|, the gradient that passes the softmax; grad_norm "
      "is |d loss / d query|.\n\n" + table + "\n")
  plots.logit_scale_metrics(
      os.path.join(config.workdir, "logit_scale.png"), list(config.dims),
      *({m: [by_dim[(d, scaled)][m] for d in config.dims]
         for m in ("max_prob", "entropy", "saturated", "logit_grad")}
        for scaled in (True, False)))
  results = {"config": report.jsonable(dataclasses.asdict(config)),
             "rows": rows}
  if config.train.steps:
    runs = _train_comparison(config)
    results["training"] = runs
    d_k, train, arch = _head_dim(config), config.train, config.transformer
    plots.loss_curves(
        os.path.join(config.workdir, "logit_scale_training.png"),
        {f"{k} (d_k={d_k})": v["loss_curve"] for k, v in runs.items()})
    summary += (
        f"\n## Training with and without the scale\n\nTransformer with "
        f"{arch.num_heads} head(s) and {arch.num_layers} layer(s), d_k = "
        f"{d_k}, {train.task} task, lengths {train.min_len}-{train.max_len}, "
        f"{train.steps} steps each.\n\n"
        + report.markdown_table(
            ["model", "loss at 25%", "loss at 50%", "final loss",
             f"token acc (len {train.max_len})", "seq acc"],
            [[k, v["loss_curve"][len(v["loss_curve"]) // 4][1],
              v["loss_curve"][len(v["loss_curve"]) // 2][1], v["final_loss"],
              v["token_acc"], v["seq_acc"]] for k, v in runs.items()])
        + "\n")
  report.write_json(os.path.join(config.workdir, "results.json"), results)
  report.write_text(os.path.join(config.workdir, "summary.md"), summary)
  print(summary)
  return results
