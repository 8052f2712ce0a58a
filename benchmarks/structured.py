"""Structured attention patterns against peers: ``python -m benchmarks.structured``.

Times forward and forward+backward (the gradient of the output's sum with
respect to q, k and v) of this library's structured paths — causal sliding
windows, packed documents (segment ids), causal against non-causal, score
modifiers (soft cap, sinks, ALiBi) — beside the same pattern written as a
dense boolean mask for torch's ``scaled_dot_product_attention`` (when
importable), ``jax.nn.dot_product_attention`` (XLA) and this library's own
dense-mask path. All implementations of one case run in one process,
interleaved, after a warm-up call each; times are medians of ``--repeats``
rounds; first-call minus steady time is reported as compile time. With
``--memory`` the single-head T=65,536 point runs in a fresh subprocess per
implementation and reports its peak RSS growth.

Layout everywhere: ``[B, N, T, H]`` (torch's), T = S, float32, everything
jitted. Writes ``structured.md`` and ``structured.json`` to ``--out``; with
``--write_docs`` also rewrites the generated section of
``docs/structured_performance.md``.

Arguments that are not in the library yet (segment ids, sinks, score
modifiers, ``aj.alibi_slopes``) are called as they will be spelled; where the
call fails for want of them, the row says "not available" and the rest runs.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import json
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import time
from typing import Any

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from benchmarks import host

CASES = ("window256_T4096", "window256_T16384", "packed8x512_T4096",
         "causal_T2048", "dense_causal_T1024", "score_mods_T2048",
         "prefix_lm_T4096", "memory_T65536")


def _define_flags():
  """The command line's flags, defined only when run as a program.

  ``benchmarks.attention`` defines flags of the same names; defining these
  at import would clash when both modules are imported (the tests).
  """
  global _PRESET, _CASES, _REPEATS, _OUT, _MEMORY, _WRITE_DOCS, _MEMORY_POINT
  _PRESET = flags.DEFINE_enum(
      "preset", "full", ["full", "tiny"],
      "full: the table of docs/structured_performance.md (tens of minutes "
      "here); tiny: the same cases at tiny shapes, seconds.")
  _CASES = flags.DEFINE_list(
      "cases", [], f"Only these cases (default all): {', '.join(CASES)}.")
  _REPEATS = flags.DEFINE_integer("repeats", 3, "Timed rounds per case.",
                                  lower_bound=1)
  _OUT = flags.DEFINE_string("out", "runs/structured", "Output directory.")
  _MEMORY = flags.DEFINE_bool(
      "memory", True,
      "Run memory_T65536 (when among --cases): one subprocess per point.")
  _WRITE_DOCS = flags.DEFINE_bool(
      "write_docs", False,
      "Rewrite the generated section of docs/structured_performance.md.")
  _MEMORY_POINT = flags.DEFINE_string(
      "memory_point", None, "Internal: measure one 'impl,T,H,window' point.")


DOCS_PAGE = (pathlib.Path(__file__).resolve().parent.parent / "docs"
             / "structured_performance.md")
START, END = "<!-- table:start -->", "<!-- table:end -->"
MODES = ("fwd", "fwd+bwd")


def _swap(x):
  return jnp.swapaxes(x, 1, 2)  # [B, N, T, H] <-> [B, T, N, H] (jax.nn's)


def _torch():
  try:
    import torch
  except ImportError:
    return None
  torch.set_num_threads(os.cpu_count() or 1)
  return torch


# --------------------------------------------------------------------------
# Masks (True = may attend), numpy [T, S].


def window_mask(t: int, window: int) -> np.ndarray:
  """Causal sliding window: query i sees keys i - window + 1 .. i."""
  i, j = np.arange(t)[:, None], np.arange(t)[None, :]
  return (j <= i) & (j > i - window)


def packed_mask(t: int, docs: int) -> np.ndarray:
  """``docs`` equal documents packed in ``t``, causal within each."""
  seg = np.repeat(np.arange(docs), t // docs)
  i, j = np.arange(t)[:, None], np.arange(t)[None, :]
  return (seg[:, None] == seg[None, :]) & (j <= i)


# --------------------------------------------------------------------------
# Callables: (call, args, block) triples, timed alike.


def _jax_entry(fn, mode, arrays, aux=()):
  """``fn(q, k, v, *aux)`` jitted; fwd+bwd is the gradient wrt q, k, v."""
  if mode == "fwd":
    call = jax.jit(fn)
  else:
    call = jax.jit(jax.grad(
        lambda q, k, v, *a: jnp.sum(fn(q, k, v, *a)), (0, 1, 2)))
  args = [jnp.asarray(x) for x in (*arrays, *aux)]
  return call, args, jax.block_until_ready


def _torch_entry(torch, mode, arrays, mask=None, is_causal=False):
  sdpa = torch.nn.functional.scaled_dot_product_attention
  attn_mask = None if mask is None else torch.from_numpy(mask)

  def run(q, k, v):
    if mode == "fwd":
      with torch.no_grad():
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal)
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal).sum().backward()
    return q.grad

  return run, [torch.from_numpy(a) for a in arrays], lambda out: out


def _time_once(call, args, block) -> float:
  start = time.perf_counter()
  block(call(*args))
  return time.perf_counter() - start


def _not_available(err: Exception) -> str | None:
  """Why a call failed for want of an API still being added, else None."""
  msg = str(err)
  if not ((isinstance(err, TypeError) and "unexpected keyword" in msg)
          or (isinstance(err, AttributeError) and "attention_jax" in msg)):
    return None
  names = re.findall(r"'(\w+)'", msg)
  return f"not available (no {names[-1]} yet)" if names else "not available"


def time_interleaved(entries: dict[str, Callable[[], tuple]],
                     repeats: int) -> dict[str, dict[str, Any]]:
  """Warm-up call each, then ``repeats`` interleaved rounds; medians.

  Args:
    entries: name -> a thunk building ``(call, args, block)``.
    repeats: timed rounds.

  Returns:
    name -> ``{"seconds", "compile_s"}``, or ``{"skipped": reason}`` where
    the implementation's API is not there yet.
  """
  prepared, first, out = {}, {}, {}
  for name, build in entries.items():
    try:
      entry = build()
      first[name] = _time_once(*entry)  # includes tracing and compiling
    except (TypeError, AttributeError) as err:
      reason = _not_available(err)
      if reason is None:
        raise
      out[name] = {"skipped": reason}
      continue
    prepared[name] = entry
  times = {name: [] for name in prepared}
  for _ in range(repeats):  # interleaved, so drift hits everyone alike
    for name, entry in prepared.items():
      times[name].append(_time_once(*entry))
  for name, ts in times.items():
    sec = statistics.median(ts)
    out[name] = {"seconds": sec, "compile_s": max(first[name] - sec, 0.0)}
  return {name: out[name] for name in entries}


# --------------------------------------------------------------------------
# Cases.


@dataclasses.dataclass
class Case:
  """One row group: a shape, its modes, and named implementations.

  ``impls`` maps a name to ``build(mode, arrays) -> (call, args, block)``;
  ``ours`` names the implementations whose compile time is a target.
  """
  name: str
  shape: tuple[int, int, int, int]  # B, N, T, H
  modes: tuple[str, ...]
  impls: dict[str, Callable]
  ours: tuple[str, ...]
  note: str = ""


def _sizes(preset: str) -> dict[str, Any]:
  if preset == "tiny":
    return {"bnh": (1, 2, 16), "window": 32, "t_window": 128,
            "t_long": 256, "long_bn": (1, 1), "docs": 4, "t_packed": 128,
            "t_causal": 128, "dense": (1, 2, 64, 16), "t_mods": 128,
            "t_prefix": 128, "memory": (512, 16, 32)}
  return {"bnh": (4, 8, 64), "window": 256, "t_window": 4096,
          "t_long": 16384, "long_bn": (1, 8), "docs": 8, "t_packed": 4096,
          "t_causal": 2048, "dense": (2, 8, 1024, 32), "t_mods": 2048,
          "t_prefix": 4096, "memory": (65536, 64, 256)}


def build_cases(preset: str, torch) -> dict[str, Case]:
  """Every case of ``preset`` (memory_T65536 is run by ``run_memory``)."""
  z = _sizes(preset)
  b, n, h = z["bnh"]
  w = z["window"]
  cases = {}

  def windowed(q, k, v):
    return aj.blockwise_attention(
        q, k, v, aj.Mask(causal=True, window=(w - 1, 0)))

  def dense_mask(q, k, v, m):
    return aj.blockwise_attention(q, k, v, aj.Mask(dense=m))

  def jax_nn(**kw):
    return lambda q, k, v, *m: _swap(jax.nn.dot_product_attention(
        _swap(q), _swap(k), _swap(v), mask=m[0] if m else None,
        implementation="xla", **kw))

  t = z["t_window"]
  mask = window_mask(t, w)
  impls = {"aj_window": lambda mode, x: _jax_entry(windowed, mode, x)}
  if torch is not None:
    impls["torch_mask"] = lambda mode, x, m=mask: _torch_entry(
        torch, mode, x, mask=m)
  impls["jax_nn_window"] = lambda mode, x: _jax_entry(
      jax_nn(is_causal=True, local_window_size=(w - 1, 0)), mode, x)
  impls["aj_dense_mask"] = lambda mode, x, m=mask: _jax_entry(
      dense_mask, mode, x, (m[None, None],))
  cases["window256_T4096"] = Case("window256_T4096", (b, n, t, h), MODES,
                                  impls, ("aj_window",))

  lb, ln = z["long_bn"]
  cases["window256_T16384"] = Case(
      "window256_T16384", (lb, ln, z["t_long"], h), MODES,
      {"aj_window": lambda mode, x: _jax_entry(windowed, mode, x)},
      ("aj_window",),
      note=f"B={lb}, N={ln}; its ratio to window256_T4096 is scaled by "
      f"{b * n // (lb * ln)} (same B*N)")

  t, docs = z["t_packed"], z["docs"]
  mask = packed_mask(t, docs)
  seg = np.repeat(np.arange(docs, dtype=np.int32), t // docs)[None, None]

  def segments(q, k, v, s):
    return aj.blockwise_attention(
        q, k, v, aj.Mask(causal=True, q_segment_ids=s, kv_segment_ids=s))

  impls = {"aj_segments": lambda mode, x: _jax_entry(segments, mode, x,
                                                     (seg,))}
  if torch is not None:
    impls["torch_mask"] = lambda mode, x, m=mask: _torch_entry(
        torch, mode, x, mask=m)
  impls["aj_dense_mask"] = lambda mode, x, m=mask: _jax_entry(
      dense_mask, mode, x, (m[None, None],))
  impls["jax_nn_mask"] = lambda mode, x, m=mask: _jax_entry(
      jax_nn(), mode, x, (m[None, None],))
  cases["packed8x512_T4096"] = Case("packed8x512_T4096", (b, n, t, h), MODES,
                                    impls, ("aj_segments",))

  impls = {
      "aj_causal": lambda mode, x: _jax_entry(
          lambda q, k, v: aj.blockwise_attention(q, k, v, is_causal=True),
          mode, x),
      "aj_noncausal": lambda mode, x: _jax_entry(
          aj.blockwise_attention, mode, x),
  }
  if torch is not None:
    impls["torch_causal"] = lambda mode, x: _torch_entry(
        torch, mode, x, is_causal=True)
    impls["torch_noncausal"] = lambda mode, x: _torch_entry(torch, mode, x)
  cases["causal_T2048"] = Case("causal_T2048", (b, n, z["t_causal"], h),
                               MODES, impls, ("aj_causal", "aj_noncausal"))

  def sdpa_dense(causal):
    return lambda q, k, v: aj.scaled_dot_product_attention(
        q, k, v, is_causal=causal, implementation="dense")

  cases["dense_causal_T1024"] = Case(
      "dense_causal_T1024", z["dense"], ("fwd",),
      {"aj_dense_causal": lambda mode, x: _jax_entry(sdpa_dense(True), mode,
                                                     x),
       "aj_dense_noncausal": lambda mode, x: _jax_entry(sdpa_dense(False),
                                                        mode, x)},
      ("aj_dense_causal", "aj_dense_noncausal"))

  def modded(**kw):
    return lambda q, k, v: aj.blockwise_attention(q, k, v, is_causal=True,
                                                  **kw)

  mods = {"aj_plain": modded(), "aj_soft_cap": modded(score_mod=aj.soft_cap(30.0)),
          "aj_sinks": modded(sinks=jnp.zeros((n,))),
          "aj_alibi": modded(score_mod=aj.alibi(aj.alibi_slopes(n)))}
  # Prefix-LM with one prefix per example (T/4, T/4 + 1, ...), as traced
  # data: the block tables are classified on device inside the jitted step,
  # against the same rule as a dense [B, 1, T, T] mask.
  t = z["t_prefix"]
  prefixes = (t // 4 + np.arange(b)).astype(np.int32)
  i, j = np.arange(t)[:, None], np.arange(t)[None, :]
  prefix_mask = np.stack([(j < p) | (j <= i) for p in prefixes])[:, None]

  def traced_prefix(q, k, v, p):
    bm = aj.block_mask(aj.prefix_lm_mask_fn(p), t, t, batch=(b, 1))
    return aj.blockwise_attention(q, k, v, bm)

  cases["prefix_lm_T4096"] = Case(
      "prefix_lm_T4096", (b, n, t, h), ("fwd+bwd",),
      {"aj_traced_prefix": lambda mode, x: _jax_entry(
          traced_prefix, mode, x, (prefixes,)),
       "aj_dense_mask": lambda mode, x: _jax_entry(
           dense_mask, mode, x, (prefix_mask,))},
      ("aj_traced_prefix",))
  cases["score_mods_T2048"] = Case(
      "score_mods_T2048", (b, n, z["t_mods"], h), ("fwd+bwd",),
      {name: lambda mode, x, f=f: _jax_entry(f, mode, x)
       for name, f in mods.items()},
      tuple(mods))
  return cases


def _inputs(b, n, t, h, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.standard_normal((b, n, t, h), np.float32) for _ in range(3)]


def run_case(case: Case, repeats: int) -> list[dict]:
  """Rows ``{case, mode, impl, B, N, T, H, seconds, compile_s, skipped}``."""
  b, n, t, h = case.shape
  arrays = _inputs(b, n, t, h)
  rows = []
  for mode in case.modes:
    results = time_interleaved(
        {name: (lambda build=build, mode=mode: build(mode, arrays))
         for name, build in case.impls.items()}, repeats)
    for name, res in results.items():
      rows.append({"case": case.name, "mode": mode, "impl": name, "B": b,
                   "N": n, "T": t, "H": h, "seconds": res.get("seconds"),
                   "compile_s": res.get("compile_s"),
                   "skipped": res.get("skipped")})
  return rows


# --------------------------------------------------------------------------
# Memory: one fresh process per point.






def memory_point(spec: str) -> dict:
  """Child process: peak RSS growth and time of one fwd+bwd call.

  The call is compiled ahead of time and the peak RSS reset afterwards (where
  Linux allows), so the growth is the execution's: inputs excluded, the
  gradients and every intermediate included.
  """
  impl, t, h, window = spec.split(",")
  t, h, window = int(t), int(h), int(window)
  mask = aj.Mask(causal=True)
  if impl == "aj_window":
    mask = aj.Mask(causal=True, window=(window - 1, 0))
  fn = lambda q, k, v: aj.blockwise_attention(q, k, v, mask)
  call, args, block = _jax_entry(fn, "fwd+bwd", _inputs(1, 1, t, h))
  compiled = call.lower(*args).compile()
  reset = host.reset_peak_rss()
  base = host.proc_status("VmRSS") if reset else host.proc_status("VmHWM")
  times = [_time_once(compiled, args, block)]
  growth = (host.proc_status("VmHWM") - base) / 2**30
  while len(times) < 3 and sum(times) < 20:  # cheap points: a median
    times.append(_time_once(compiled, args, block))
  return {"rss_growth_gib": growth, "seconds": statistics.median(times),
          "hwm_reset": reset}


def _measure_memory(impl: str, t: int, h: int, window: int) -> dict | None:
  spec = f"{impl},{t},{h},{window}"
  proc = subprocess.run(
      [sys.executable, "-m", "benchmarks.structured",
       f"--memory_point={spec}"],
      capture_output=True, text=True, timeout=1800,
      cwd=pathlib.Path(__file__).resolve().parent.parent)
  for line in proc.stdout.splitlines()[::-1]:
    if line.startswith("{"):
      return json.loads(line)
  print(f"memory point {spec} failed:\n{proc.stderr[-2000:]}", flush=True)
  return None


def run_memory(preset: str) -> list[dict]:
  """Window and full causal, B = N = 1, fwd+bwd, each in its own process."""
  t, h, window = _sizes(preset)["memory"]
  rows = []
  for impl in ("aj_window", "aj_causal"):
    res = _measure_memory(impl, t, h, window) or {}
    rows.append({"case": "memory_T65536", "mode": "fwd+bwd", "impl": impl,
                 "B": 1, "N": 1, "T": t, "H": h,
                 "seconds": res.get("seconds"), "compile_s": None,
                 "skipped": None if res else "failed (see log)",
                 "rss_growth_gib": res.get("rss_growth_gib")})
  return rows


# --------------------------------------------------------------------------
# Ratios and targets.


def _find(rows, case, mode, impl):
  for r in rows:
    if (r["case"], r["mode"], r["impl"]) == (case, mode, impl):
      return r
  return None


def _quotient(rows, num, den, factor=1.0):
  """``factor * num / den`` of two ``(case, mode, impl)`` times, or None."""
  a, b = _find(rows, *num), _find(rows, *den)
  if a is None or b is None or not a["seconds"] or not b["seconds"]:
    return None
  return factor * a["seconds"] / b["seconds"]


def compute_ratios(rows: list[dict], cases: dict[str, Case]) -> list[dict]:
  """The ratios of a run and the targets they are held to.

  Args:
    rows: the rows of ``run_case`` and ``run_memory``.
    cases: the cases that ran (their ``ours`` name the compile targets).

  Returns:
    Rows ``{case, mode, what, value, unit, target}``: ``unit`` is "x", "s" or
    "GiB"; ``target`` an upper bound, or None for a plain comparison with a
    peer; ``value`` None where a side was not measured.
  """
  out = []
  present = {(r["case"], r["mode"], r["impl"]) for r in rows}

  def add(case, mode, what, value, unit="x", target=None):
    out.append({"case": case, "mode": mode, "what": what, "value": value,
                "unit": unit, "target": target})

  def ratio(case, mode, what, num, den, target=None):
    if (case, mode, num) in present and (case, mode, den) in present:
      add(case, mode, what, _quotient(rows, (case, mode, num),
                                      (case, mode, den)), target=target)

  c = "window256_T4096"
  for mode in MODES:
    for peer, label in (("torch_mask", "torch SDPA, dense mask"),
                        ("jax_nn_window", "jax.nn xla, window"),
                        ("aj_dense_mask", "ours, dense mask")):
      ratio(c, mode, f"ours / {label}", "aj_window", peer)
  c = "window256_T16384"
  if c in cases:
    lb, ln = cases[c].shape[:2]
    full = cases.get("window256_T4096")
    b, n = full.shape[:2] if full else (lb, ln)
    for mode in MODES:
      if (c, mode, "aj_window") in present:
        add(c, mode, "T=16384 / T=4096 time, same B*N",
            _quotient(rows, (c, mode, "aj_window"),
                      ("window256_T4096", mode, "aj_window"),
                      factor=b * n / (lb * ln)), target=4.5)
  c = "packed8x512_T4096"
  for mode in MODES:
    for peer, label in (("torch_mask", "torch SDPA, dense mask"),
                        ("aj_dense_mask", "ours, dense mask"),
                        ("jax_nn_mask", "jax.nn xla, dense mask")):
      ratio(c, mode, f"ours (segment ids) / {label}", "aj_segments", peer)
  c = "causal_T2048"
  for mode in MODES:
    ratio(c, mode, "ours causal / non-causal", "aj_causal", "aj_noncausal",
          target=0.6)
    ratio(c, mode, "torch causal / non-causal", "torch_causal",
          "torch_noncausal")
    ratio(c, mode, "ours / torch, causal", "aj_causal", "torch_causal")
  ratio("dense_causal_T1024", "fwd", "dense causal / non-causal",
        "aj_dense_causal", "aj_dense_noncausal", target=1.1)
  for mod in ("soft_cap", "sinks", "alibi"):
    ratio("score_mods_T2048", "fwd+bwd", f"{mod} / plain", f"aj_{mod}",
          "aj_plain", target=1.15)
  ratio("prefix_lm_T4096", "fwd+bwd",
        "traced per-example prefix / same rule as a dense mask",
        "aj_traced_prefix", "aj_dense_mask", target=1 / 1.6)
  for name, case in cases.items():
    compiled = [r for r in rows if r["case"] == name and r["impl"] in case.ours
                and r["compile_s"] is not None]
    if compiled:
      worst = max(compiled, key=lambda r: r["compile_s"])
      add(name, "/".join(case.modes), f"compile, worst: {worst['impl']} "
          f"{worst['mode']}", worst["compile_s"], unit="s", target=5.0)
    else:
      add(name, "/".join(case.modes), f"compile of {', '.join(case.ours)}",
          None, unit="s", target=5.0)
  c = "memory_T65536"
  win = _find(rows, c, "fwd+bwd", "aj_window")
  if win is not None:
    add(c, "fwd+bwd", "window peak RSS growth", win.get("rss_growth_gib"),
        unit="GiB", target=0.4)
    add(c, "fwd+bwd", "window / full causal time",
        _quotient(rows, (c, "fwd+bwd", "aj_window"),
                  (c, "fwd+bwd", "aj_causal")), target=0.25)
  return out


# --------------------------------------------------------------------------
# Tables, files, docs.


def _fmt(x, spec):
  return "-" if x is None else format(x, spec)


def _value(r) -> str:
  if r["value"] is None:
    return "n/a"
  return {"x": f"{r['value']:.2f}x", "s": f"{r['value']:.2f} s",
          "GiB": f"{r['value']:.3f} GiB"}[r["unit"]]


def times_table(rows: list[dict]) -> str:
  lines = ["| case | B x N x T x H | mode | impl | time (s) | compile (s) "
           "| RSS growth (GiB) |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    shape = f"{r['B']}x{r['N']}x{r['T']}x{r['H']}"
    head = f"| {r['case']} | {shape} | {r['mode']} | {r['impl']} |"
    if r["skipped"]:
      lines.append(f"{head} {r['skipped']} | | |")
    else:
      lines.append(f"{head} {r['seconds']:.4g} | "
                   f"{_fmt(r['compile_s'], '.2f')} | "
                   f"{_fmt(r.get('rss_growth_gib'), '.3f')} |")
  return "\n".join(lines)


def peers_table(ratios: list[dict]) -> str:
  lines = ["| case | mode | ratio | measured |", "|---|---|---|---|"]
  lines += [f"| {r['case']} | {r['mode']} | {r['what']} | {_value(r)} |"
            for r in ratios if r["target"] is None]
  return "\n".join(lines)


def targets_table(ratios: list[dict]) -> str:
  lines = ["| case | mode | target | measured | |", "|---|---|---|---|---|"]
  for r in ratios:
    if r["target"] is None:
      continue
    unit = {"x": "x", "s": " s", "GiB": " GiB"}[r["unit"]]
    status = ("n/a" if r["value"] is None
              else "pass" if r["value"] <= r["target"] else "miss")
    lines.append(f"| {r['case']} | {r['mode']} | {r['what']} <= "
                 f"{r['target']:g}{unit} | {_value(r)} | {status} |")
  return "\n".join(lines)


def machine() -> str:
  name = platform.processor()
  if not name:
    try:
      with open("/proc/cpuinfo") as f:
        name = next((line.split(":", 1)[1].strip() for line in f
                     if line.startswith("model name")), "")
    except OSError:
      name = ""
  return f"{os.cpu_count()}-core CPU ({name or platform.machine()})"


def report(rows, ratios, command, repeats, torch) -> str:
  """The markdown of one run: what, where, the command, three tables."""
  versions = f"jax {jax.__version__}" + (
      f", torch {torch.__version__}" if torch is not None
      else ", torch not installed")
  return (
      f"Measured on a {machine()}, {jax.default_backend()} backend, "
      f"{versions}; `{command}`; medians of {repeats} interleaved rounds "
      "after a warm-up call, seconds.\n\n"
      f"### Times\n\n{times_table(rows)}\n\n"
      f"### Ratios against peers\n\nBelow 1 means ours is faster.\n\n"
      f"{peers_table(ratios)}\n\n"
      f"### Targets\n\n{targets_table(ratios)}\n")




def run_benchmark(preset: str, out_dir: str, repeats: int, cases=(),
                  memory: bool = True, command: str | None = None,
                  docs_page: os.PathLike | None = None):
  """Runs the cases, prints and writes the tables; returns (rows, ratios)."""
  unknown = set(cases) - set(CASES)
  if unknown:
    raise ValueError(f"unknown cases {sorted(unknown)}; known: {CASES}")
  chosen = [c for c in CASES if not cases or c in cases]
  command = command or f"python -m benchmarks.structured --preset={preset}"
  torch = _torch()
  all_cases = build_cases(preset, torch)
  rows = []
  for name in chosen:
    if name == "memory_T65536":
      if not memory:
        continue
      new = run_memory(preset)
    else:
      new = run_case(all_cases[name], repeats)
    rows += new
    print(times_table(new), flush=True)
  ran = {name: all_cases[name] for name in chosen if name in all_cases}
  ratios = compute_ratios(rows, ran)
  text = report(rows, ratios, command, repeats, torch)
  print(f"\n{peers_table(ratios)}\n\n{targets_table(ratios)}", flush=True)
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "structured.json"), "w") as f:
    json.dump({"command": command, "machine": machine(),
               "jax": jax.__version__, "rows": rows, "ratios": ratios}, f,
              indent=1)
  with open(os.path.join(out_dir, "structured.md"), "w") as f:
    f.write(text)
  if docs_page is not None:
    host.replace_section(docs_page, START, END, text)
  return rows, ratios


def main(argv):
  del argv
  if _MEMORY_POINT.value:
    print(json.dumps(memory_point(_MEMORY_POINT.value)), flush=True)
    return
  command = " ".join(["python -m benchmarks.structured", *sys.argv[1:]])
  run_benchmark(_PRESET.value, _OUT.value, _REPEATS.value, _CASES.value,
                _MEMORY.value, command,
                DOCS_PAGE if _WRITE_DOCS.value else None)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
