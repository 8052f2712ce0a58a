"""``--experiment=sparse``'s figure: which key blocks a query read.

Shape glossary: T context, c key block, nk = T / c key blocks, N heads.

For a few queries of one validation row (late in it, where most blocks
lie in the past): the trained dense model's first-layer attention mass per
key block in head 0 (a share of 1), beside the blocks each sparse
variant's first layer read for that query in head 0 (NSA: key/value head
0, whose query heads share the choice; DSA: every head, a block counting
as read when a chosen token lies in it).
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from matplotlib import pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def dense_block_mass(model, tokens, queries, block: int) -> np.ndarray:
  """``[len(queries), nk]``: the first layer's softmax mass per key block
  (head 0)."""
  first = model.blocks[0]
  q, k, _ = first.attention._heads(first.norm1(model.embed(tokens)))
  q = q[0][:, queries]  # [N, Q, H]
  scores = jnp.einsum("NQH,NSH->NQS", q, k[0]) / jnp.sqrt(q.shape[-1])
  t = k.shape[2]
  visible = jnp.arange(t)[None, :] <= jnp.asarray(queries)[:, None]
  weights = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), -1)
  mass = weights[0].reshape(len(queries), t // block, block).sum(-1)
  return np.asarray(mass)


def read_blocks(variant: str, chosen, queries, block: int,
                t: int) -> np.ndarray:
  """``[len(queries), nk]`` bool: the blocks the variant read."""
  chosen = np.asarray(chosen)
  nk = t // block
  if variant == "dsa":  # [B, T, k] token indices
    out = np.zeros((len(queries), nk), bool)
    for i, q in enumerate(queries):
      picks = chosen[0, q]
      out[i, picks[picks >= 0] // block] = True
    return out
  return chosen[0, 0, queries]  # [B, heads, T, nk] -> [Q, nk]


def selection_figure(path: str, models: dict, config, tokens) -> None:
  t, c = config.seq_len, config.block
  queries = [t - 1, (3 * t) // 4, t // 2]
  panels = [("dense", None)] + [(v, m) for v, m in models.items()
                                if v != "dense"]
  fig, axes = plt.subplots(len(panels), 1, figsize=(10, 1.2 + 1.0 * len(
      panels)), squeeze=False)
  for ax, (variant, model) in zip(axes[:, 0], panels):
    if variant == "dense":
      if "dense" not in models:
        ax.set_visible(False)
        continue
      image = dense_block_mass(models["dense"], tokens, queries, c)
      shown = ax.imshow(image, aspect="auto", cmap="viridis",
                        interpolation="nearest")
      fig.colorbar(shown, ax=ax, label="mass")
      ax.set_title("dense: attention mass per key block (layer 1, head 0)",
                   fontsize=9)
    else:
      _, _, chosen = model(tokens)
      image = read_blocks(variant, chosen, queries, c, t)
      ax.imshow(image, aspect="auto", cmap="Greys", vmin=0, vmax=1,
                interpolation="nearest")
      ax.set_title(f"{variant}: key blocks read (layer 1, head 0)",
                   fontsize=9)
    ax.set_yticks(range(len(queries)), [f"q={q}" for q in queries],
                  fontsize=8)
  axes[-1, 0].set_xlabel(f"key block ({c} characters each)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
