"""What the benchmarks read off the host, and how they rewrite a docs section.

One home for the helpers every benchmark report needs: the load average
(other processes share the cores), the peak-RSS counters of
``/proc/self/status`` (Linux), the matmul peak rows are measured against,
and the replacement of a generated section between two markers of a docs
page.
"""

from __future__ import annotations

import os
import pathlib
import time

import jax
import jax.numpy as jnp


def load_average() -> float | None:
  """The 1-minute load average (other processes share the cores), or None."""
  try:
    return os.getloadavg()[0]
  except OSError:
    return None


def format_load(load) -> str:
  """Load averages (None where unknown) as ``"0.2, 1.0"``."""
  return ", ".join("n/a" if x is None else f"{x:.1f}" for x in load)


def matmul_peak(dtype: str = "float32") -> float:
  """GFLOP/s of a 2048^3 ``jnp.dot`` (bf16 inputs accumulate in float32),
  best of 5 after a warm-up: the peak a row's FLOP/s is a share of."""
  a = jnp.ones((2048, 2048), dtype)
  f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
  jax.block_until_ready(f(a, a))
  best = float("inf")
  for _ in range(5):
    start = time.perf_counter()
    jax.block_until_ready(f(a, a))
    best = min(best, time.perf_counter() - start)
  return 2 * 2048**3 / best / 1e9


def proc_status(field: str) -> int | None:
  """A ``/proc/self/status`` size field (``VmRSS``, ``VmHWM``) in bytes, or
  None where there is none."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith(field + ":"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


def reset_peak_rss() -> bool:
  """Linux: set the peak RSS (VmHWM) back to the current RSS; False where
  that cannot be done."""
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


def replace_section(path: os.PathLike, start: str, end: str,
                    section: str) -> None:
  """Replace the text between the page's ``start`` and ``end`` markers with
  ``section``; a ``ValueError`` if the page lacks either."""
  text = pathlib.Path(path).read_text()
  if start not in text or end not in text:
    raise ValueError(f"{path} lacks the markers {start} / {end}")
  head, rest = text.split(start, 1)
  _, tail = rest.split(end, 1)
  pathlib.Path(path).write_text(f"{head}{start}\n{section}{end}{tail}")
