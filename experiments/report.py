"""Writing results: a JSON file of every number and a markdown table."""

from __future__ import annotations

from collections.abc import Sequence
import json
import os
from typing import Any


def write_text(path: str, text: str) -> None:
  """Writes ``text`` atomically: a temporary file, fsync, then ``os.replace``.

  A reader (or a run killed half-way) sees the old file or the new one,
  never half of one.
  """
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def write_json(path: str, payload: Any) -> None:
  """Writes ``payload`` as JSON, atomically (``write_text``)."""
  write_text(path, json.dumps(payload, indent=2, sort_keys=True) + "\n")


def check_writable(directory: str) -> None:
  """Creates ``directory`` and proves it writable, or raises ValueError.

  Called before any training so a bad ``--workdir`` fails in a second, not
  after the first checkpoint is due.
  """
  try:
    os.makedirs(directory, exist_ok=True)
    probe = os.path.join(directory, f".write_test{os.getpid()}")
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    raise ValueError(f"--workdir {directory!r} is not writable: "
                     f"{e.strerror or e}.") from None


def markdown_table(headers: Sequence[str],
                   rows: Sequence[Sequence[Any]]) -> str:
  """A GitHub-flavoured markdown table; floats get 4 significant digits."""
  def fmt(x):
    return f"{x:.4g}" if isinstance(x, float) else str(x)

  lines = ["| " + " | ".join(headers) + " |",
           "|" + "|".join("---" for _ in headers) + "|"]
  lines += ["| " + " | ".join(fmt(x) for x in row) + " |" for row in rows]
  return "\n".join(lines)


def jsonable(value: Any) -> Any:
  """Tuples to lists, int keys to strings, NumPy scalars to Python numbers."""
  if isinstance(value, dict):
    return {str(k): jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [jsonable(v) for v in value]
  if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
    return value.item()
  return value
