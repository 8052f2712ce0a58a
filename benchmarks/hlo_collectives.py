"""What a compiled program sends between devices, read off its HLO text.

``collectives(hlo_text)`` walks the optimised HLO module from its entry
computation: every collective instruction (``collective-permute``,
``all-to-all``, ``all-gather``, ``all-reduce``, ``reduce-scatter`` and their
``-start`` halves) counts once per execution, and the body of a ``while``
loop as many times as XLA's ``known_trip_count`` says (a loop without one is
reported in ``unknown_loops``, its body counted once). Conditional branches
count once each (an upper bound). Per device, the bytes an instruction
*sends* are estimated from its result shape ``R`` bytes and the number of
participants ``P`` of its replica groups, as the usual algorithms do:

* ``collective-permute``: ``R`` (each device sends its block once);
* ``all-to-all``: ``R * (P - 1) / P`` (all but its own slice);
* ``all-gather``: ``R * (P - 1) / P`` (the others' shares of the result);
* ``all-reduce``: ``2 * R * (P - 1) / P`` (reduce-scatter + all-gather);
* ``reduce-scatter``: ``R * (P - 1)``.

Nothing runs: ``jax.jit(f).lower(*args).compile().as_text()`` is enough, so
shapes far beyond a machine's memory can be measured.
"""

from __future__ import annotations

import collections
import math
import re

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
                "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
                "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
KINDS = ("collective-permute", "all-to-all", "all-gather", "all-reduce",
         "reduce-scatter")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s"
                          r"([a-z][a-z\-]*)\(")
_SHAPE = re.compile(r"\b([a-z]+\d*[a-z\d]*)\[([\d,]*)\]")
_CALLS = re.compile(r"(?:body|to_apply|calls|branch_computations|"
                    r"true_computation|false_computation)=\{?([^}]*?)\}?"
                    r"(?:,\s*[a-z_]+=|$)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_GROUPS = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_PAIRS = re.compile(r"source_target_pairs=\{([^}]*(?:\}[^}]*)*?)\}\}")


def _bytes(result_type: str) -> int:
  total = 0
  for dtype, dims in _SHAPE.findall(result_type):
    if dtype not in _DTYPE_BYTES:
      continue
    size = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
    total += size * _DTYPE_BYTES[dtype]
  return total


def _participants(line: str) -> int:
  m = _GROUPS.search(line)
  if m:
    return len([x for x in m.group(1).split(",") if x])
  m = _GROUPS_IOTA.search(line)
  if m:
    return int(m.group(2))
  return 1


def _sent(kind: str, result: int, p: int) -> float:
  if kind == "collective-permute":
    return float(result)
  if kind in ("all-to-all", "all-gather"):
    return result * (p - 1) / max(p, 1)
  if kind == "all-reduce":
    return 2 * result * (p - 1) / max(p, 1)
  return float(result * (p - 1))  # reduce-scatter


def _computations(text: str):
  """``{name: [lines]}`` and the entry computation's name."""
  comps, entry, current = {}, None, None
  for line in text.splitlines():
    m = _HEADER.match(line.strip())
    if m and line.rstrip().endswith("{"):
      current = m.group(1)
      comps[current] = []
      if line.lstrip().startswith("ENTRY"):
        entry = current
    elif current is not None:
      if line.strip() == "}":
        current = None
      else:
        comps[current].append(line)
  return comps, entry


def collectives(hlo_text: str) -> dict:
  """``{"ops": {kind: count}, "bytes": {kind: result bytes}, "sent":
  {kind: estimated bytes each device sends}, "total_sent": float,
  "unknown_loops": int}`` of one execution of the module."""
  comps, entry = _computations(hlo_text)
  ops = collections.Counter()
  result_bytes = collections.Counter()
  sent = collections.Counter()
  unknown = [0]

  def visit(name: str, times: int, depth: int = 0):
    if name not in comps or depth > 50:
      return
    for line in comps[name]:
      m = _INSTRUCTION.match(line)
      if not m:
        continue
      result_type, op = m.groups()
      kind = op[:-len("-start")] if op.endswith("-start") else op
      if kind in KINDS:
        size = _bytes(result_type)
        if op.endswith("-start") and result_type.startswith("("):
          # an async start's result holds the operand and the result
          size = size // 2 if kind == "collective-permute" else size
        ops[kind] += times
        result_bytes[kind] += times * size
        sent[kind] += times * _sent(kind, size, _participants(line))
      callees = []
      for group in _CALLS.findall(line):
        callees += [c.strip().lstrip("%") for c in group.split(",")
                    if c.strip()]
      if op == "while":
        trip = _TRIP.search(line)
        count = int(trip.group(1)) if trip else 1
        if not trip:
          unknown[0] += 1
        for callee in callees:
          visit(callee, times * count, depth + 1)
      elif op in ("call", "conditional", "async-start"):
        for callee in callees:
          visit(callee, times, depth + 1)

  visit(entry, 1)
  return {"ops": dict(ops), "bytes": dict(result_bytes),
          "sent": dict(sent), "total_sent": float(sum(sent.values())),
          "unknown_loops": unknown[0]}
