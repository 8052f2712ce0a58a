"""A one-line live progress report: step, loss, steps/s, ETA."""

from __future__ import annotations

import sys
import time


class Progress:
  """Rewrites one line on a terminal; prints a line per interval otherwise."""

  def __init__(self, name: str, total: int, start: int = 0,
               every: int = 50, stream=None):
    self.name, self.total, self.every = name, total, every
    self.stream = stream or sys.stdout
    self.live = getattr(self.stream, "isatty", lambda: False)()
    self.start_step, self.t0 = start, time.perf_counter()

  def update(self, step: int, loss: float) -> None:
    done = step - self.start_step
    if not self.live and step % self.every and step != self.total:
      return
    elapsed = time.perf_counter() - self.t0
    rate = done / elapsed if elapsed > 0 else 0.0
    eta = (self.total - step) / rate if rate > 0 else float("inf")
    line = (f"[{self.name}] step {step}/{self.total}  loss {loss:.4f}  "
            f"{rate:.1f} steps/s  ETA {eta:.0f}s")
    if self.live:
      self.stream.write("\r" + line + " " * 4)
      if step == self.total:
        self.stream.write("\n")
    else:
      self.stream.write(line + "\n")
    self.stream.flush()
