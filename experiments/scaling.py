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

Then a short training comparison: the same one-head Transformer (d_k =
``train_d_model``) learns the copy task with and without the scale.

Writes ``results.json``, ``summary.md``, ``scaling.png`` (metrics against
d_k) and ``scaling_training.png`` (the two loss curves) to the workdir.

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
from experiments import data
from experiments import metrics
from experiments import plots
from experiments import report
from experiments import training
from experiments import transformer


@dataclasses.dataclass(frozen=True)
class ScalingConfig:
  """What ``python run.py --experiment=scaling`` measures."""
  workdir: str = "runs/scaling"  # results.json and summary.md land here
  dims: tuple[int, ...] = (4, 8, 16, 32, 64, 128, 256, 512, 1024)  # d_k
  num_queries: int = 512  # B: independent queries averaged over
  num_keys: int = 64  # S: keys each query attends over
  seed: int = 0
  train_steps: int = 300  # per model in the training comparison; 0 skips it
  train_d_model: int = 128  # = d_k: one head, one layer
  train_max_len: int = 15  # copy task lengths 5..train_max_len


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
        q, key, value, bias=logit_offset, scale=scale)
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


def _train_comparison(config: ScalingConfig) -> dict:
  """Trains the same model with and without 1/sqrt(d_k); returns both runs."""
  train_config = training.TrainConfig(
      task="copy", steps=config.train_steps, max_len=config.train_max_len,
      min_len=min(5, config.train_max_len),
      seed=config.seed, checkpoint_every=0,
      log_every=max(1, config.train_steps // 20))
  runs = {}
  for label, scale in (("scaled", None), ("unscaled", 1.0)):
    model = transformer.TransformerSeq2Seq(transformer.TransformerConfig(
        d_model=config.train_d_model, num_heads=1, num_layers=1,
        ffn_dim=2 * config.train_d_model, attention_scale=scale),
        rngs=nnx.Rngs(config.seed))
    stats = training.train(f"scaling/{label}", model, train_config, None)
    length = config.train_max_len
    batch = data.eval_batch("copy", length, seed=config.seed,
                            num_examples=128, vocab_size=20)
    src, src_len, _, _, _ = training.batch_arrays(batch)
    tokens = nnx.jit(transformer.greedy, static_argnums=3)(
        model, src, src_len, length + 1)[0]
    stats["eval_length"] = length
    stats.update(metrics.sequence_metrics(jax.device_get(tokens), batch))
    runs[label] = stats
  return runs


def run(config: ScalingConfig) -> dict:
  """Measures saturation against d_k; writes results.json and summary.md.

  Returns:
    ``{"config": ..., "rows": [{"d_k", "scaled", "max_prob", "entropy",
    "grad_norm"}, ...]}``.
  """
  report.check_writable(config.workdir)
  measure = jax.jit(_measure, static_argnums=(1, 2, 3, 4))
  rows = []
  for i, dim in enumerate(config.dims):
    rng = jax.random.fold_in(jax.random.key(config.seed), i)
    for scaled in (True, False):
      scale = 1.0 / math.sqrt(dim) if scaled else 1.0
      metrics = measure(rng, dim, config.num_queries, config.num_keys, scale)
      rows.append({"d_k": dim, "scaled": scaled,
                   **{k: float(v) for k, v in metrics.items()}})

  metrics = ["max_prob", "entropy", "saturated", "logit_grad", "grad_norm"]
  headers = ["d_k"] + [f"{m} ({kind})" for m in metrics
                       for kind in ("scaled", "unscaled")]
  by_dim = {(r["d_k"], r["scaled"]): r for r in rows}
  table_rows = [[dim] + [by_dim[(dim, scaled)][m] for m in metrics
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
  plots.scaling_metrics(
      os.path.join(config.workdir, "scaling.png"), list(config.dims),
      *({m: [by_dim[(d, scaled)][m] for d in config.dims]
         for m in ("max_prob", "entropy", "saturated", "logit_grad")}
        for scaled in (True, False)))
  results = {"config": report.jsonable(dataclasses.asdict(config)),
             "rows": rows}
  if config.train_steps:
    runs = _train_comparison(config)
    results["training"] = runs
    plots.loss_curves(os.path.join(config.workdir, "scaling_training.png"),
                      {f"{k} (d_k={config.train_d_model})": v["loss_curve"]
                       for k, v in runs.items()})
    summary += (
        f"\n## Training with and without the scale\n\nOne-head, one-layer "
        f"Transformer, d_k = {config.train_d_model}, copy task, lengths "
        f"5-{config.train_max_len}, {config.train_steps} steps each.\n\n"
        + report.markdown_table(
            ["model", "loss at 25%", "loss at 50%", "final loss",
             f"token acc (len {config.train_max_len})", "seq acc"],
            [[k, v["loss_curve"][len(v["loss_curve"]) // 4][1],
              v["loss_curve"][len(v["loss_curve"]) // 2][1], v["final_loss"],
              v["token_acc"], v["seq_acc"]] for k, v in runs.items()])
        + "\n")
  report.write_json(os.path.join(config.workdir, "results.json"), results)
  report.write_text(os.path.join(config.workdir, "summary.md"), summary)
  print(summary)
  return results
