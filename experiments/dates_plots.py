"""Figures of the dates experiment: accuracy bars, alignment share, heatmaps.

Shape glossary: T output characters (EOS included), S source characters.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # files only; no display needed
import matplotlib.patches as mpatches  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from experiments import dates_data  # noqa: E402

# Field -> colour of its tick labels and span boxes.
FIELD_COLOURS = {dates_data.LITERAL: "0.35", dates_data.DAY: "tab:red",
                 dates_data.MONTH: "tab:green", dates_data.YEAR: "tab:blue",
                 dates_data.WEEKDAY: "tab:purple"}
# The default font (DejaVu Sans) has no CJK glyphs: the Japanese characters
# of dates are shown romanised.
_ROMAJI = {"年": "nen", "月": "gatsu", "日": "nichi", "曜": "yō", "火": "ka",
           "水": "sui", "木": "moku", "金": "kin", "土": "do"}
_SPACES = {" ", "\u202f", "\xa0"}


def glyph(c: str) -> str:
  """A tick label the default font can draw for character ``c``."""
  if c in _SPACES:
    return "␣"
  return _ROMAJI.get(c, c)


def _bars(ax, groups: list[str], values: dict[str, list[float]], title: str):
  width = 0.8 / max(len(values), 1)
  x = np.arange(len(groups))
  for k, (name, vals) in enumerate(values.items()):
    ax.bar(x + (k - (len(values) - 1) / 2) * width, vals, width, label=name)
  ax.set_xticks(x, groups, rotation=30, ha="right")
  ax.axhline(0.95, color="0.3", lw=0.8, ls="--")
  ax.set(ylim=(0, 1.02), ylabel="exact match (held-out years)", title=title)
  ax.grid(alpha=0.3, axis="y")


def accuracy(path: str, held_out: dict[str, dict], locales: list[str],
             formats: list[str]) -> None:
  """Held-out exact match: by locale (with the reverse direction) and by
  format, one bar per model; the dashed line is 0.95."""
  fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2))
  groups = list(locales)
  has_reverse = all("reverse" in r for r in held_out.values())
  if has_reverse:
    groups.append("ISO->vi")
  _bars(a1, groups, {
      m: [r["by_locale"][loc]["exact"] for loc in locales]
      + ([r["reverse"]["exact"]] if has_reverse else [])
      for m, r in held_out.items()}, "by locale (mean over formats)")
  _bars(a2, formats, {m: [r["by_format"][f]["exact"] for f in formats]
                      for m, r in held_out.items()},
        "by format (mean over locales)")
  a1.legend(loc="lower left")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def alignment(path: str, by_locale: dict[str, dict],
              reverse: dict[str, dict | None]) -> None:
  """Alignment share per field (day, month, year) and locale, one panel per
  model; black ticks mark what uniform attention would score."""
  models = list(by_locale)
  fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4),
                           squeeze=False)
  fields = [dates_data.FIELDS[f] for f in
            (dates_data.DAY, dates_data.MONTH, dates_data.YEAR)]
  for ax, m in zip(axes[0], models):
    rows = dict(by_locale[m])
    if reverse.get(m):
      rows["ISO->vi"] = reverse[m]
    groups = list(rows)
    x = np.arange(len(groups))
    width = 0.8 / len(fields)
    for k, f in enumerate(fields):
      colour = FIELD_COLOURS[dates_data.FIELDS.index(f)]
      share = [rows[g]["share"].get(f, {}).get("share", np.nan) for g in groups]
      uniform = [rows[g]["share"].get(f, {}).get("uniform", np.nan)
                 for g in groups]
      pos = x + (k - 1) * width
      ax.bar(pos, share, width, color=colour, label=f)
      ax.scatter(pos, uniform, marker="_", color="k", s=120, zorder=3,
                 label="uniform attention" if k == 0 else None)
    ax.set_xticks(x, groups, rotation=30, ha="right")
    ax.set(ylim=(0, 1.02), title=m,
           ylabel="attention on the field's source span")
    ax.grid(alpha=0.3, axis="y")
  handles, labels = axes[0][0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
  fig.tight_layout(rect=(0, 0.07, 1, 1))
  fig.savefig(path, dpi=100)
  plt.close(fig)


def _heatmap(ax, m: dict, title: str):
  src, tgt = m["src"], m["tgt"] + "$"  # "$": the EOS step
  weights = np.asarray(m["weights"])[:len(tgt), :len(src)]  # [T, S]
  image = ax.imshow(weights, cmap="viridis", vmin=0.0, vmax=1.0,
                    aspect="auto", interpolation="nearest")
  src_fields = np.asarray(m["src_fields"])[:len(src)]
  tgt_fields = np.asarray(m["tgt_fields"])[:len(tgt)]
  ax.set_xticks(range(len(src)), [glyph(c) for c in src], fontsize=7,
                rotation=90)
  ax.set_yticks(range(len(tgt)), [glyph(c) for c in tgt[:-1]] + ["EOS"],
                fontsize=7)
  for label, f in zip(ax.get_xticklabels(), src_fields):
    label.set_color(FIELD_COLOURS[int(f)])
  for label, f in zip(ax.get_yticklabels(), tgt_fields):
    label.set_color(FIELD_COLOURS[int(f)])
  # A box where each output field's rows meet that field's source span:
  # where aligned attention should be.
  for f in (dates_data.DAY, dates_data.MONTH, dates_data.YEAR):
    rows, cols = np.nonzero(tgt_fields == f)[0], np.nonzero(src_fields == f)[0]
    if len(rows) and len(cols):
      ax.add_patch(mpatches.Rectangle(
          (cols.min() - 0.5, rows.min() - 0.5), cols.max() - cols.min() + 1,
          rows.max() - rows.min() + 1, fill=False, lw=1.5,
          edgecolor=FIELD_COLOURS[f]))
  ax.set_title(title, fontsize=9)
  return image


def heatmaps(path: str, maps: dict[str, dict], title: str) -> None:
  """One panel per task: source characters on x, output characters on y,
  tick labels and boxes coloured by field (red day, green month, blue year,
  purple weekday)."""
  n = len(maps)
  cols = min(3, n)
  rows = -(-n // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows),
                           squeeze=False)
  image = None
  for ax, (task, m) in zip(axes.flat, maps.items()):
    image = _heatmap(ax, m, task)
  for ax in list(axes.flat)[n:]:
    ax.axis("off")
  if image is not None:
    fig.colorbar(image, ax=axes, fraction=0.02, label="attention weight")
  handles = [mpatches.Patch(color=FIELD_COLOURS[f], label=dates_data.FIELDS[f])
             for f in FIELD_COLOURS]
  fig.legend(handles=handles, loc="lower left", ncol=len(handles), fontsize=8)
  fig.suptitle(title)
  fig.savefig(path, dpi=100)
  plt.close(fig)
