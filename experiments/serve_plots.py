"""The serving experiment's figure: cache memory held over the model steps."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def pages_in_use(path: str, paged_log: list[dict], static_log: list[dict],
                 num_pages: int, page_size: int) -> None:
  """Pages in use (and reserved) per step of continuous batching, with the
  pool's size and the static baseline's cache in pages of the same size;
  below, the paged system's active rows and waiting requests.

  Args:
    path: the PNG to write.
    paged_log: per step ``{"step", "pages_in_use", "pages_reserved",
      "active", "waiting"}``.
    static_log: per step ``{"step", "cache_tokens"}`` (the batch's
      ``rows x (longest prompt + longest output - 1)``).
    num_pages: the pool's pages.
    page_size: tokens per page.
  """
  fig, (ax, rows) = plt.subplots(
      2, 1, figsize=(7, 5.5), sharex=True,
      gridspec_kw={"height_ratios": (2, 1)})
  step = np.array([s["step"] for s in paged_log])
  ax.step(step, [s["pages_in_use"] for s in paged_log], where="post",
          label="paged: pages in use")
  ax.step(step, [s["pages_reserved"] for s in paged_log], where="post",
          linestyle=":", label="paged: pages reserved (prompt + output)")
  ax.axhline(num_pages, color="0.4", linestyle="--", linewidth=0.9,
             label=f"paged: pool ({num_pages} pages)")
  ax.step([s["step"] for s in static_log],
          [s["cache_tokens"] / page_size for s in static_log], where="post",
          color="C3", alpha=0.8,
          label="static: batch cache (its own steps)")
  ax.set_ylabel(f"pages of {page_size} tokens")
  top = max([num_pages] + [s["cache_tokens"] / page_size
                           for s in static_log])
  ax.set_ylim(0, 1.5 * top)  # room for the legend above the lines
  ax.legend(fontsize=8, loc="upper left", ncol=2)
  ax.set_title("KV cache held per model step")
  rows.step(step, [s["active"] for s in paged_log], where="post",
            label="paged: active rows")
  rows.step(step, [s["waiting"] for s in paged_log], where="post",
            linestyle="--", label="paged: requests waiting")
  rows.set_xlabel("model step (paged: a prefill and a decode call at most; "
                  "static: one call)")
  rows.set_ylabel("requests")
  rows.legend(fontsize=8, loc="upper right")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
