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

Shape glossary: B queries (batch), S keys, H = d_k head dim.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp

import attention_jax as aj
from experiments import report


@dataclasses.dataclass(frozen=True)
class ScalingConfig:
  """What ``python run.py --experiment=scaling`` measures."""
  workdir: str = "runs/scaling"  # results.json and summary.md land here
  dims: tuple[int, ...] = (4, 8, 16, 32, 64, 128, 256, 512, 1024)  # d_k
  num_queries: int = 512  # B: independent queries averaged over
  num_keys: int = 64  # S: keys each query attends over
  seed: int = 0


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


def run(config: ScalingConfig) -> dict:
  """Measures saturation against d_k; writes results.json and summary.md.

  Returns:
    ``{"config": ..., "rows": [{"d_k", "scaled", "max_prob", "entropy",
    "grad_norm"}, ...]}``.
  """
  os.makedirs(config.workdir, exist_ok=True)
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
  results = {"config": dataclasses.asdict(config), "rows": rows}
  report.write_json(os.path.join(config.workdir, "results.json"), results)
  with open(os.path.join(config.workdir, "summary.md"), "w") as f:
    f.write(summary)
  print(summary)
  return results
