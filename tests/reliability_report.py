"""The reliability table: ``python -m tests.reliability_report [--write]``.

Runs the hardening tests (property, extreme-value, bad-input and
experiment-reliability files) with pytest, collects what they tried — each
property example and kill trial is logged through ``record`` to the file
named by ``AJ_RELIABILITY_LOG`` — and prints a markdown table of cases and
outcomes. ``--write`` also replaces the table between the ``reliability``
markers of ``docs/reliability.md`` (``PAGE``), so the page shows what the
command printed.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "reliability.md"  # the page that carries the table
BEGIN, END = "<!-- reliability:begin -->", "<!-- reliability:end -->"
FILES = {
    "properties": "tests/test_properties.py",
    "extremes": "tests/test_extremes.py",
    "bad_input": "tests/test_validation.py",
    "experiments": "tests/test_experiment_reliability.py",
}


def record(kind: str, **fields) -> None:
  """Appends one tried case to the log, when a report is being made."""
  path = os.environ.get("AJ_RELIABILITY_LOG")
  if path:
    with open(path, "a") as f:
      f.write(json.dumps({"kind": kind, **fields}) + "\n")


def _outcomes(junit: str) -> dict[str, collections.Counter]:
  """Per test file: counts of passed / failed / skipped test items."""
  counts = collections.defaultdict(collections.Counter)
  for case in ET.parse(junit).getroot().iter("testcase"):
    file = case.get("classname", "").split(".")[1] if "." in case.get(
        "classname", "") else case.get("file", "")
    state = "passed"
    for child in case:
      if child.tag in ("failure", "error"):
        state = "failed"
      elif child.tag == "skipped":
        state = "skipped"
    counts[file][state] += 1
  return counts


def _cell(counter: collections.Counter) -> str:
  # The outcome, not a count: documents carry no test counts (they go stale).
  failed = counter["failed"]
  if failed:
    return f"**{failed} failed**"
  return "all passed" if counter["passed"] else "not run"


def make_table() -> tuple[str, int]:
  """Runs the tests; returns ``(markdown, pytest's exit code)``."""
  with tempfile.TemporaryDirectory() as tmp:
    log = os.path.join(tmp, "cases.jsonl")
    junit = os.path.join(tmp, "junit.xml")
    env = dict(os.environ, AJ_RELIABILITY_LOG=log)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"--junitxml={junit}", *FILES.values()], cwd=ROOT, env=env,
        capture_output=True, text=True)
    cases = []
    if os.path.exists(log):
      with open(log) as f:
        cases = [json.loads(line) for line in f]
    outcomes = _outcomes(junit)
  props = [c for c in cases if c["kind"] == "property"]
  by_impl = collections.Counter(c["implementation"] for c in props)
  by_dtype = collections.Counter(c["dtype"] for c in props)
  by_mask = collections.Counter(c["mask"] for c in props)
  kills = [c for c in cases if c["kind"] == "kill"]
  kill_text = ", ".join(f"{c['signal']} at step {c['saved']} -> exit "
                        f"{c['returncode']}" for c in kills) or "none"
  resumed = [c for c in cases if c["kind"] == "resumed"]

  def row(what, tried, key):
    return f"| {what} | {tried} | {_cell(outcomes[key])} |"

  lines = [
      "| area | what was tried | outcome |",
      "|---|---|---|",
      row("property tests (hypothesis, `ci` profile)",
          f"{len(props)} random cases — implementations "
          f"{dict(sorted(by_impl.items()))}; dtypes "
          f"{dict(sorted(by_dtype.items()))}; masks "
          f"{dict(sorted(by_mask.items()))}; biases up to 1e3 — through "
          "`scaled_dot_product_attention` (both paths, random ranks and "
          "broadcast KV dims), `multi_head_attention` (random N, K heads, "
          "causal), Bahdanau and Luong; checked for shape/dtype, weights "
          ">= 0 summing to 1 or 0 and 0 where blocked, float64 agreement, "
          "key permutation, causal future, finite gradients",
          "test_properties"),
      row("numerical extremes",
          "logits ~1e4 (fp32), q.k near fp16's max, NaN/+inf/-inf in padded "
          "keys and values (dense, blockwise by mask and by lengths, "
          "multi-head with its params, Bahdanau, Luong), a 65,536-key row",
          "test_extremes"),
      row("bad input",
          "wrong ranks, mismatched dims, unbroadcastable masks, float masks, "
          "complex/int inputs, non-positive sizes, unknown options, module "
          "constructors and calls — eagerly and under jit; no `assert` in "
          "the code; `python -O` raises the same", "test_validation"),
      row("experiments lose nothing",
          f"a real `run.py` training interrupted: {kill_text}; then resumed: "
          f"{'bitwise equal to an uninterrupted run' if resumed else 'n/a'}; "
          "a corrupt checkpoint reported, not loaded; an unwritable workdir "
          "refused before training", "test_experiment_reliability"),
  ]
  return "\n".join(lines), proc.returncode


def main(argv: list[str]) -> int:
  table, code = make_table()
  print(table)
  if "--write" in argv:
    text = PAGE.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    PAGE.write_text(text[:start] + "\n" + table + "\n" + text[end:])
  return code


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
