"""Writing results: a JSON file of every number and a markdown table."""

from __future__ import annotations

from collections.abc import Sequence
import json
import os
from typing import Any


def write_json(path: str, payload: Any) -> None:
  """Writes ``payload`` as JSON via a temporary file, so a reader never sees half."""
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(payload, f, indent=2, sort_keys=True)
    f.write("\n")
  os.replace(tmp, path)


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
