"""Figures of a run: accuracy against length, attention heatmaps, losses."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

# Distinct per line, so that overlapping curves stay apart in print too.
STYLES = ({"linestyle": "-", "marker": "o"}, {"linestyle": "--", "marker": "s"},
          {"linestyle": ":", "marker": "^"}, {"linestyle": "-.", "marker": "D"},
          {"linestyle": (0, (5, 1, 1, 1)), "marker": "v"})


def _style(index: int, points: int) -> dict:
  """Line style ``index``; about ten markers along ``points`` points,
  staggered per line so that coinciding lines still show each marker."""
  step = max(1, points // 10)
  return {**STYLES[index % len(STYLES)],
          "markevery": (index * max(1, step // 3) % step, step),
          "color": f"C{index}"}


def accuracy_vs_length(path: str, lengths, curves: dict[str, list[float]],
                       train_range: tuple[int, int], ylabel: str,
                       title: str) -> None:
  """One line per model (the analogue of Bahdanau et al.'s Fig. 2)."""
  fig, ax = plt.subplots(figsize=(6, 4))
  ax.axvspan(train_range[0], train_range[1], color="0.92",
             label="training lengths")
  for index, (name, values) in enumerate(curves.items()):
    ax.plot(lengths, values, label=name, **{**_style(index, len(values)),
                                             "markevery": 1})
  ax.set(xlabel="source length", ylabel=ylabel, title=title, ylim=(0, 1.02))
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def attention_heatmap(path: str, weights: np.ndarray, title: str) -> None:
  """``weights [T, S]``: source position on x, output position on y (from
  1), with a colourbar."""
  fig, ax = plt.subplots(figsize=(5, 4.4))
  rows, cols = weights.shape
  image = ax.imshow(weights, cmap="viridis", vmin=0.0, vmax=1.0,
                    aspect="auto", interpolation="nearest",
                    extent=(0.5, cols + 0.5, rows + 0.5, 0.5))
  # Integer positions: every one up to 10, else 1 and each multiple of 5.
  for set_ticks, count in ((ax.set_xticks, cols), (ax.set_yticks, rows)):
    set_ticks(np.arange(1, count + 1) if count <= 10 else
              np.r_[1, np.arange(5, count + 1, 5)])
  ax.set(xlabel="source position", ylabel="output position", title=title)
  fig.colorbar(image, ax=ax, fraction=0.046, label="attention weight")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def loss_curves(path: str, curves: dict[str, list[list[float]]]) -> None:
  """``curves[name] = [[step, loss], ...]`` on a log scale."""
  fig, ax = plt.subplots(figsize=(6, 4))
  for index, (name, points) in enumerate(c for c in curves.items() if c[1]):
    steps, losses = zip(*points)
    ax.plot(steps, losses, label=name, markersize=4,
            **_style(index, len(steps)))
  ax.set(xlabel="step", ylabel="training loss (cross-entropy)", yscale="log")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def logit_scale_metrics(path: str, dims, scaled: dict[str, list[float]],
                    unscaled: dict[str, list[float]]) -> None:
  """One panel per metric, scaled vs unscaled against d_k (log x)."""
  names = list(scaled)
  fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3.2))
  for ax, name in zip(np.atleast_1d(axes), names):
    ax.plot(dims, scaled[name], marker="o", label="1/sqrt(d_k)")
    ax.plot(dims, unscaled[name], marker="s", label="unscaled")
    ax.set(xscale="log", xlabel="d_k", title=name)
    ax.grid(alpha=0.3)
  np.atleast_1d(axes)[0].legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
