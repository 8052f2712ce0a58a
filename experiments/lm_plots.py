"""Figures of the language-model experiment: losses, attention maps, bars.

Shape glossary: L layers, N heads, T tokens of the example shown.
"""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _label(char: str) -> str:
  """A tick label for one character (BOS and whitespace made visible)."""
  return {"\n": "\\n", " ": "\u2423", "\t": "\\t"}.get(char, char)


def loss_curves(path: str, curves: dict[str, list[list[float]]],
                baseline: float, valid: dict[str, float]) -> None:
  """Training bits/char per variant, the unigram baseline, final validation.

  Args:
    path: the PNG to write.
    curves: ``{variant: [[step, bits/char], ...]}``.
    baseline: the unigram entropy (bits/char), drawn as a line.
    valid: ``{variant: validation bits/char}``, drawn at the last step.
  """
  fig, ax = plt.subplots(figsize=(6, 4))
  for name, points in curves.items():
    if not points:
      continue
    steps, bits = zip(*points)
    line, = ax.plot(steps, bits, label=f"{name} (train)")
    if name in valid:
      ax.plot([steps[-1]], [valid[name]], marker="o", color=line.get_color(),
              linestyle="none", label=f"{name} (validation)")
  ax.axhline(baseline, color="0.5", linestyle="--",
             label=f"unigram entropy ({baseline:.2f})")
  ax.set(xlabel="step", ylabel="bits per character", ylim=(0, None))
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def attention_grid(path: str, weights: np.ndarray, chars: list[str],
                   title: str, boundary: int | None = None) -> None:
  """Every layer's and head's map of one example, characters on both axes.

  Args:
    path: the PNG to write.
    weights: ``[L, N, T, T]`` (query on y, key on x).
    chars: the ``T`` characters (``"<s>"`` for BOS).
    title: the figure title.
    boundary: index of the first token of a new document, marked with lines.
  """
  layers, heads = weights.shape[:2]
  side = 2.6 + 0.035 * len(chars)
  fig, axes = plt.subplots(layers, heads, figsize=(side * heads,
                                                   side * layers + 0.4),
                           squeeze=False)
  ticks = np.arange(len(chars))
  labels = [_label(c) for c in chars]
  for layer in range(layers):
    for head in range(heads):
      ax = axes[layer, head]
      ax.imshow(weights[layer, head], cmap="viridis", vmin=0.0, vmax=1.0,
                interpolation="nearest")
      if boundary is not None:
        ax.axvline(boundary - 0.5, color="red", linewidth=0.8)
        ax.axhline(boundary - 0.5, color="red", linewidth=0.8)
      ax.set_xticks(ticks, labels, fontsize=4, fontfamily="monospace")
      ax.set_yticks(ticks, labels, fontsize=4, fontfamily="monospace")
      ax.set_title(f"layer {layer + 1}, head {head + 1}", fontsize=8)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def boundary_comparison(path: str, maps: dict[str, np.ndarray],
                        chars: list[str], boundary: int,
                        layer: int) -> None:
  """One head-averaged map per variant, side by side, at a document start.

  ``maps[variant]`` is ``[T, T]`` (query on y, key on x).
  """
  count = len(maps)
  side = 2.5 + 0.06 * len(chars)
  fig, axes = plt.subplots(1, count, figsize=(side * count, side + 0.3),
                           squeeze=False)
  ticks = np.arange(len(chars))
  labels = [_label(c) for c in chars]
  for ax, (name, weights) in zip(axes[0], maps.items()):
    ax.imshow(weights, cmap="viridis", vmin=0.0,
              vmax=float(weights.max()) or 1.0, interpolation="nearest")
    ax.axvline(boundary - 0.5, color="red", linewidth=0.8)
    ax.axhline(boundary - 0.5, color="red", linewidth=0.8)
    ax.set_xticks(ticks, labels, fontsize=5, fontfamily="monospace")
    ax.set_yticks(ticks, labels, fontsize=5, fontfamily="monospace")
    ax.set(xlabel="key (attended to)", ylabel="query")
    ax.set_title(f"{name}: layer {layer + 1}, mean over heads", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def where_it_looks(path: str, weights: np.ndarray, chars: list[str],
                   query: int, title: str) -> None:
  """Bars: how much one token attends to each earlier one, per layer.

  Args:
    path: the PNG to write.
    weights: ``[L, N, T]``: each layer's and head's weights of the query
      row over the keys up to it (``T = query + 1``).
    chars: the ``T`` characters.
    query: index of the chosen token (the last of ``chars``).
    title: the figure title.
  """
  layers, heads = weights.shape[:2]
  fig, axes = plt.subplots(layers, 1, figsize=(max(6, 0.32 * len(chars)),
                                                2.2 * layers + 0.4),
                           squeeze=False)
  x = np.arange(len(chars))
  labels = [_label(c) for c in chars]
  for layer, ax in enumerate(axes[:, 0]):
    mean = weights[layer].mean(0)
    ax.bar(x, mean, color="tab:blue", label="mean over heads")
    for head in range(heads):
      ax.plot(x, weights[layer, head], linestyle="none", marker="_",
              markersize=8, color=f"C{head + 1}", label=f"head {head + 1}")
    ax.set_xticks(x, labels, fontfamily="monospace")
    ax.get_xticklabels()[query].set_color("red")
    ax.set(ylabel=f"layer {layer + 1}",
           ylim=(0, max(1e-3, float(weights[layer].max())) * 1.1))
    ax.grid(alpha=0.3, axis="y")
  axes[0, 0].legend(fontsize=7, ncol=math.ceil((heads + 1) / 2))
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
