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
  """A tick label for one character: one glyph each for a newline, a
  space and a tab (BOS stays ``<s>``)."""
  return {"\n": "\u21b5", " ": "\u2423", "\t": "\u21e5"}.get(char, char)


# Distinct per variant, so that overlapping curves stay apart in print too.
STYLES = ({"linestyle": "-", "marker": "o"}, {"linestyle": "--", "marker": "s"},
          {"linestyle": ":", "marker": "^"}, {"linestyle": "-.", "marker": "D"})


def _style(index: int, points: int) -> dict:
  """Line style ``index``; about ten markers along ``points`` points,
  staggered per line so that coinciding lines still show each marker."""
  step = max(1, points // 10)
  return {**STYLES[index % len(STYLES)],
          "markevery": (index * max(1, step // 3) % step, step),
          "markersize": 4, "color": f"C{index}"}


def loss_curves(path: str, curves: dict[str, list[list[float]]],
                baseline: float, valid: dict[str, float]) -> None:
  """Training bits/char per variant, the unigram baseline, final validation;
  below, each variant minus the first (where the curves overlap).

  Args:
    path: the PNG to write.
    curves: ``{variant: [[step, bits/char], ...]}``.
    baseline: the unigram entropy (bits/char), drawn as a line.
    valid: ``{variant: validation bits/char}``, drawn at the last step.
  """
  curves = {k: np.asarray(v, np.float64) for k, v in curves.items() if v}
  fig, (ax, diff) = plt.subplots(
      2, 1, figsize=(6, 5.5), sharex=True,
      gridspec_kw={"height_ratios": (2.2, 1)})
  for index, (name, points) in enumerate(curves.items()):
    style = _style(index, len(points))
    ax.plot(points[:, 0], points[:, 1], label=f"{name} (train)", **style)
    if name in valid:
      ax.plot([points[-1, 0]], [valid[name]], marker="*", markersize=11,
              color=style["color"], linestyle="none",
              label=f"{name} (validation {valid[name]:.3f})")
  ax.axhline(baseline, color="0.5", linestyle="--", linewidth=0.8,
             label=f"unigram entropy ({baseline:.2f})")
  ax.set(ylabel="bits per character", ylim=(0, None))
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, ncol=2)
  names = list(curves)
  if len(names) > 1:
    first = curves[names[0]]
    for index, name in enumerate(names[1:], 1):
      points = curves[name]
      steps = np.intersect1d(points[:, 0], first[:, 0])
      delta = (points[np.isin(points[:, 0], steps), 1]
               - first[np.isin(first[:, 0], steps), 1])
      diff.plot(steps, delta, label=f"{name} \u2212 {names[0]}",
                **_style(index, len(steps)))
    diff.axhline(0.0, color="C0", linewidth=0.8)
    diff.legend(fontsize=7)
  diff.set(xlabel="step", ylabel="difference (bits)")
  diff.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def _char_ticks(ax, labels: list[str], fontsize: float, x: bool = True,
                y: bool = True) -> None:
  """Every character as a tick label, monospace (or no labels on an axis
  whose flag is False); ``<s>`` in red, upright along x, so a document
  start stands out."""
  ticks = np.arange(len(labels))
  for axis, show in (("x", x), ("y", y)):
    set_ticks = ax.set_xticks if axis == "x" else ax.set_yticks
    if not show:
      set_ticks(ticks, [""] * len(labels))
      continue
    set_ticks(ticks, labels, fontsize=fontsize, fontfamily="monospace")
    get = ax.get_xticklabels if axis == "x" else ax.get_yticklabels
    for label in get():
      if len(label.get_text()) > 1:
        label.set_color("red")
        if axis == "x":
          label.set_rotation(90)
  ax.tick_params(length=1.5, pad=1)


def attention_grid(path: str, weights: np.ndarray, chars: list[str],
                   title: str, boundary: int | None = None) -> None:
  """Every layer's and head's map of one example, characters on both axes,
  one colour scale (0 to 1) for all, with its colourbar.

  Args:
    path: the PNG to write.
    weights: ``[L, N, T, T]`` (query on y, key on x).
    chars: the ``T`` characters (``"<s>"`` for BOS).
    title: the figure title.
    boundary: index of the first token of a new document, marked with lines.
  """
  layers, heads = weights.shape[:2]
  # About 0.1 inch per character: 7-point labels fit beside each other.
  side = 0.8 + 0.1 * len(chars)
  fig, axes = plt.subplots(layers, heads, figsize=(side * heads + 1.0,
                                                   side * layers + 0.6),
                           squeeze=False, layout="constrained")
  labels = [_label(c) for c in chars]
  for layer in range(layers):
    for head in range(heads):
      ax = axes[layer, head]
      image = ax.imshow(weights[layer, head], cmap="viridis", vmin=0.0,
                        vmax=1.0, interpolation="nearest")
      if boundary is not None:
        ax.axvline(boundary - 0.5, color="red", linewidth=0.8)
        ax.axhline(boundary - 0.5, color="red", linewidth=0.8)
      # Characters on the outer axes only; the panels share them.
      _char_ticks(ax, labels, 7, x=layer == layers - 1, y=head == 0)
      ax.set_title(f"layer {layer + 1}, head {head + 1}", fontsize=10)
  for ax in axes[-1]:
    ax.set_xlabel("key (attended to)", fontsize=9)
  for ax in axes[:, 0]:
    ax.set_ylabel("query", fontsize=9)
  fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
  fig.suptitle(title, fontsize=12)
  fig.savefig(path, dpi=100)
  plt.close(fig)


def boundary_comparison(path: str, maps: dict[str, np.ndarray],
                        chars: list[str], boundary: int,
                        layer: int) -> None:
  """One head-averaged map per variant, side by side, at a document start,
  on one colour scale (0 to the largest weight shown) with its colourbar.

  ``maps[variant]`` is ``[T, T]`` (query on y, key on x).
  """
  count = len(maps)
  side = 0.8 + 0.11 * len(chars)
  fig, axes = plt.subplots(1, count, figsize=(side * count + 1.2, side + 0.5),
                           squeeze=False, layout="constrained")
  labels = [_label(c) for c in chars]
  top = max(float(w.max()) for w in maps.values()) or 1.0
  for ax, (name, weights) in zip(axes[0], maps.items()):
    image = ax.imshow(weights, cmap="viridis", vmin=0.0, vmax=top,
                      interpolation="nearest")
    ax.axvline(boundary - 0.5, color="red", linewidth=0.8)
    ax.axhline(boundary - 0.5, color="red", linewidth=0.8)
    _char_ticks(ax, labels, 7)
    ax.set(xlabel="key (attended to)", ylabel="query")
    ax.set_title(f"{name}: layer {layer + 1}, mean over heads", fontsize=10)
  fig.colorbar(image, ax=axes, shrink=0.8, label="attention weight")
  fig.savefig(path, dpi=100)
  plt.close(fig)


def leakage(path: str, per_variant: dict[str, dict], title: str) -> None:
  """Per position of a document's first characters: how much its
  predictions change with the document before it in the row.

  Args:
    path: the PNG to write.
    per_variant: ``{variant: lm.leakage(...)}`` (``kl_bits_per_position``
      and ``abs_bits_diff_per_position``, ``[C]`` each).
    title: the figure title.
  """
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
  panels = (("kl_bits_per_position", "KL(after A \u2016 after B), bits"),
            ("abs_bits_diff_per_position",
             "|\u0394 bits| of the actual next character"))
  for ax, (key, ylabel) in zip(axes, panels):
    for index, (name, leak) in enumerate(per_variant.items()):
      values = np.asarray(leak[key])
      exact = "exactly 0" if leak["bitwise_equal"] else (
          f"mean {values.mean():.3g}")
      ax.plot(np.arange(1, len(values) + 1), values,
              label=f"{name} ({exact})", **_style(index, len(values)))
    # A little room below 0, so that a line at exactly 0 is not the axis.
    top = max(max(np.max(v[key]) for v in per_variant.values()), 1e-3)
    ax.set(xlabel="character of the document (1 = first after BOS)",
           ylabel=ylabel, ylim=(-0.04 * top, 1.08 * top))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
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
