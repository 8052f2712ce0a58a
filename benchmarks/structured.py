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

Every timed row also gets its useful FLOPs — ``4 * H`` per visible (query,
key) pair and head forward (QK^T and PV), times 3.5 for forward+backward, as
``benchmarks.attention`` counts — and their rate as a share of a float32
2048^3 matmul timed in the same process (``peak_share``), so that rows
compare across machines. Rows of ours that run the flash kernel with its
automatic blocks name the ``(block_q, block_k)`` they ran and where they came
from (``aj.kernels.flash_blocks``).

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


def prefix_lm_mask(t: int, prefix: int) -> np.ndarray:
  """Keys before ``prefix`` seen by every query, the rest causally."""
  i, j = np.arange(t)[:, None], np.arange(t)[None, :]
  return (j < prefix) | (j <= i)


# --------------------------------------------------------------------------
# Visible (query, key) pairs of one head, in closed form: the long cases
# (T = 16,384 and 65,536) build no mask to count, and the tests hold these
# to the masks above.


def causal_pairs(t: int) -> int:
  return t * (t + 1) // 2


def window_pairs(t: int, window: int) -> int:
  """``window_mask``'s: row i sees min(i + 1, window) keys."""
  ramp = min(t, window)  # the rows not yet a full window from the start
  return causal_pairs(ramp) + (t - ramp) * window


def packed_pairs(t: int, docs: int) -> int:
  """``packed_mask``'s: ``docs`` causal documents of ``t // docs``."""
  return docs * causal_pairs(t // docs)


def prefix_lm_pairs(t: int, prefix: int) -> int:
  """``prefix_lm_mask``'s: the first ``prefix`` rows see the whole prefix,
  the others are causal rows."""
  p = min(max(prefix, 0), t)
  return p * p + causal_pairs(t) - causal_pairs(p)


def attention_flops(pairs: int | None, n: int, h: int, mode: str
                    ) -> float | None:
  """Useful FLOPs of ``pairs`` visible pairs (summed over the batch) in each
  of ``n`` heads: ``benchmarks.attention``'s count, restricted to them."""
  if pairs is None:
    return None
  return 4 * pairs * n * h * (3.5 if mode == "fwd+bwd" else 1.0)


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


def _blocks_of(fn, arrays, aux=()) -> aj.kernels.FlashBlocks:
  """The blocks ``fn(q, k, v, *aux)`` runs.

  ``fn`` is traced abstractly, as under ``jax.jit``, with
  ``aj.kernels.flash_blocks`` in place of its attention call: the very mask
  and arguments it times, and nothing runs.
  """
  found = []
  jax.eval_shape(
      lambda *a: found.append(fn(*a, attend=aj.kernels.flash_blocks)),
      *arrays, *aux)
  return found[0]


def _ours(fn, aux=()):
  """``(build, blocks)`` of an implementation of ours on the flash kernel.

  ``fn(q, k, v, *aux, attend=...)`` is timed with its default ``attend``
  (``aj.blockwise_attention``) and asked its blocks with ``flash_blocks``.
  """
  return (lambda mode, x: _jax_entry(fn, mode, x, aux),
          lambda x: _blocks_of(fn, x, aux))


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
  ``ours`` names the implementations whose compile time is a target;
  ``pairs`` maps a name to the visible (query, key) pairs of one head summed
  over the batch (absent: not counted); ``blocks`` maps the names that run
  the flash kernel to ``blocks(arrays) -> FlashBlocks``.
  """
  name: str
  shape: tuple[int, int, int, int]  # B, N, T, H
  modes: tuple[str, ...]
  impls: dict[str, Callable]
  ours: tuple[str, ...]
  note: str = ""
  pairs: dict[str, int] = dataclasses.field(default_factory=dict)
  blocks: dict[str, Callable] = dataclasses.field(default_factory=dict)


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

  # Ours on the flash kernel take the attention call as ``attend`` so that
  # the same code, with ``flash_blocks`` there, says which blocks it runs.
  def windowed(q, k, v, attend=aj.blockwise_attention):
    return attend(q, k, v, aj.Mask(causal=True, window=(w - 1, 0)))

  def dense_mask(q, k, v, m, attend=aj.blockwise_attention):
    return attend(q, k, v, aj.Mask(dense=m))

  def jax_nn(**kw):
    return lambda q, k, v, *m: _swap(jax.nn.dot_product_attention(
        _swap(q), _swap(k), _swap(v), mask=m[0] if m else None,
        implementation="xla", **kw))

  t = z["t_window"]
  mask = window_mask(t, w)
  impls, blocks = {}, {}
  impls["aj_window"], blocks["aj_window"] = _ours(windowed)
  if torch is not None:
    impls["torch_mask"] = lambda mode, x, m=mask: _torch_entry(
        torch, mode, x, mask=m)
  impls["jax_nn_window"] = lambda mode, x: _jax_entry(
      jax_nn(is_causal=True, local_window_size=(w - 1, 0)), mode, x)
  impls["aj_dense_mask"], blocks["aj_dense_mask"] = _ours(
      dense_mask, (mask[None, None],))
  cases["window256_T4096"] = Case(
      "window256_T4096", (b, n, t, h), MODES, impls, ("aj_window",),
      pairs=dict.fromkeys(impls, b * window_pairs(t, w)), blocks=blocks)

  lb, ln = z["long_bn"]
  t = z["t_long"]
  impls, blocks = {}, {}
  impls["aj_window"], blocks["aj_window"] = _ours(windowed)
  cases["window256_T16384"] = Case(
      "window256_T16384", (lb, ln, t, h), MODES, impls, ("aj_window",),
      note=f"B={lb}, N={ln}; its ratio to window256_T4096 is scaled by "
      f"{b * n // (lb * ln)} (same B*N)",
      pairs={"aj_window": lb * window_pairs(t, w)}, blocks=blocks)

  t, docs = z["t_packed"], z["docs"]
  mask = packed_mask(t, docs)
  seg = np.repeat(np.arange(docs, dtype=np.int32), t // docs)[None, None]

  def segments(q, k, v, s, attend=aj.blockwise_attention):
    return attend(
        q, k, v, aj.Mask(causal=True, q_segment_ids=s, kv_segment_ids=s))

  impls, blocks = {}, {}
  impls["aj_segments"], blocks["aj_segments"] = _ours(segments, (seg,))
  if torch is not None:
    impls["torch_mask"] = lambda mode, x, m=mask: _torch_entry(
        torch, mode, x, mask=m)
  impls["aj_dense_mask"], blocks["aj_dense_mask"] = _ours(
      dense_mask, (mask[None, None],))
  impls["jax_nn_mask"] = lambda mode, x, m=mask: _jax_entry(
      jax_nn(), mode, x, (m[None, None],))
  cases["packed8x512_T4096"] = Case(
      "packed8x512_T4096", (b, n, t, h), MODES, impls, ("aj_segments",),
      pairs=dict.fromkeys(impls, b * packed_pairs(t, docs)), blocks=blocks)

  def causal(q, k, v, attend=aj.blockwise_attention):
    return attend(q, k, v, is_causal=True)

  def noncausal(q, k, v, attend=aj.blockwise_attention):
    return attend(q, k, v)

  t = z["t_causal"]
  impls, blocks = {}, {}
  impls["aj_causal"], blocks["aj_causal"] = _ours(causal)
  impls["aj_noncausal"], blocks["aj_noncausal"] = _ours(noncausal)
  if torch is not None:
    impls["torch_causal"] = lambda mode, x: _torch_entry(
        torch, mode, x, is_causal=True)
    impls["torch_noncausal"] = lambda mode, x: _torch_entry(torch, mode, x)
  cases["causal_T2048"] = Case(
      "causal_T2048", (b, n, t, h), MODES, impls,
      ("aj_causal", "aj_noncausal"),
      pairs={name: b * (t * t if name.endswith("noncausal")
                        else causal_pairs(t)) for name in impls},
      blocks=blocks)

  def sdpa_dense(causal):
    return lambda q, k, v: aj.scaled_dot_product_attention(
        q, k, v, is_causal=causal, implementation="dense")

  db, dn, dt, dh = z["dense"]
  cases["dense_causal_T1024"] = Case(
      "dense_causal_T1024", z["dense"], ("fwd",),
      {"aj_dense_causal": lambda mode, x: _jax_entry(sdpa_dense(True), mode,
                                                     x),
       "aj_dense_noncausal": lambda mode, x: _jax_entry(sdpa_dense(False),
                                                        mode, x)},
      ("aj_dense_causal", "aj_dense_noncausal"),
      # Useful pairs only: the dense causal call computes all T * S scores.
      pairs={"aj_dense_causal": db * causal_pairs(dt),
             "aj_dense_noncausal": db * dt * dt})

  def modded(**kw):
    return lambda q, k, v, attend=aj.blockwise_attention: attend(
        q, k, v, is_causal=True, **kw)

  mods = {"aj_plain": modded(), "aj_soft_cap": modded(score_mod=aj.soft_cap(30.0)),
          "aj_sinks": modded(sinks=jnp.zeros((n,))),
          "aj_alibi": modded(score_mod=aj.alibi(aj.alibi_slopes(n)))}
  # Prefix-LM with one prefix per example (T/4, T/4 + 1, ...), as traced
  # data: the block tables are classified on device inside the jitted step,
  # against the same rule as a dense [B, 1, T, T] mask.
  t = z["t_prefix"]
  prefixes = (t // 4 + np.arange(b)).astype(np.int32)
  prefix_mask = np.stack([prefix_lm_mask(t, p) for p in prefixes])[:, None]

  def traced_prefix(q, k, v, p, attend=aj.blockwise_attention):
    t = q.shape[-2]  # (not the enclosing t, which moves on below)
    bm = aj.block_mask(aj.prefix_lm_mask_fn(p), t, t, batch=(b, 1))
    return attend(q, k, v, bm)

  impls, blocks = {}, {}
  impls["aj_traced_prefix"], blocks["aj_traced_prefix"] = _ours(
      traced_prefix, (prefixes,))
  impls["aj_dense_mask"], blocks["aj_dense_mask"] = _ours(
      dense_mask, (prefix_mask,))
  cases["prefix_lm_T4096"] = Case(
      "prefix_lm_T4096", (b, n, t, h), ("fwd+bwd",), impls,
      ("aj_traced_prefix",),
      pairs=dict.fromkeys(impls, sum(prefix_lm_pairs(t, int(p))
                                     for p in prefixes)),
      blocks=blocks)
  t = z["t_mods"]
  impls, blocks = {}, {}
  for name, f in mods.items():
    impls[name], blocks[name] = _ours(f)
  # Sinks and score modifiers add no matmul: the causal pairs' FLOPs.
  cases["score_mods_T2048"] = Case(
      "score_mods_T2048", (b, n, t, h), ("fwd+bwd",), impls, tuple(mods),
      pairs=dict.fromkeys(impls, b * causal_pairs(t)), blocks=blocks)
  return cases


def _inputs(b, n, t, h, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.standard_normal((b, n, t, h), np.float32) for _ in range(3)]


def _blocks_field(blocks) -> dict | None:
  return None if blocks is None else blocks._asdict()


def _case_blocks(case: Case, arrays) -> dict[str, dict | None]:
  """Each flash implementation's blocks; None where its API is missing (its
  row then says "not available" too)."""
  out = {}
  for name, fn in case.blocks.items():
    try:
      out[name] = _blocks_field(fn(arrays))
    except (TypeError, AttributeError) as err:
      if _not_available(err) is None:
        raise
      out[name] = None
  return out


def _timed_fields(seconds, flops, peak_gflops) -> dict:
  """``flops`` and ``peak_share``: achieved FLOP/s over the matmul peak."""
  share = None
  if seconds and flops is not None and peak_gflops:
    share = flops / seconds / 1e9 / peak_gflops
  return {"flops": flops, "peak_share": share}


def run_case(case: Case, repeats: int,
             peak_gflops: float | None = None) -> list[dict]:
  """Rows ``{case, mode, impl, B, N, T, H, seconds, compile_s, skipped,
  flops, peak_share, blocks}``; ``peak_share`` None without a peak."""
  b, n, t, h = case.shape
  arrays = _inputs(b, n, t, h)
  # Per implementation, not per mode: the backward walks the same blocks.
  blocks = _case_blocks(case, arrays)
  rows = []
  for mode in case.modes:
    results = time_interleaved(
        {name: (lambda build=build, mode=mode: build(mode, arrays))
         for name, build in case.impls.items()}, repeats)
    for name, res in results.items():
      flops = attention_flops(case.pairs.get(name), n, h, mode)
      rows.append({"case": case.name, "mode": mode, "impl": name, "B": b,
                   "N": n, "T": t, "H": h, "seconds": res.get("seconds"),
                   "compile_s": res.get("compile_s"),
                   "skipped": res.get("skipped"),
                   **_timed_fields(res.get("seconds"), flops, peak_gflops),
                   "blocks": blocks.get(name)})
  return rows


# --------------------------------------------------------------------------
# Memory: one fresh process per point.


def _memory_fn(impl: str, window: int):
  """The call of a memory point, ``attend`` as in ``build_cases``."""
  mask = aj.Mask(causal=True)
  if impl == "aj_window":
    mask = aj.Mask(causal=True, window=(window - 1, 0))
  return lambda q, k, v, attend=aj.blockwise_attention: attend(q, k, v, mask)


def memory_point(spec: str) -> dict:
  """Child process: peak RSS growth and time of one fwd+bwd call.

  The call is compiled ahead of time and the peak RSS reset afterwards (where
  Linux allows), so the growth is the execution's: inputs excluded, the
  gradients and every intermediate included.
  """
  impl, t, h, window = spec.split(",")
  t, h, window = int(t), int(h), int(window)
  call, args, block = _jax_entry(_memory_fn(impl, window), "fwd+bwd",
                                 _inputs(1, 1, t, h))
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


def run_memory(preset: str, peak_gflops: float | None = None) -> list[dict]:
  """Window and full causal, B = N = 1, fwd+bwd, each in its own process.

  Their ``peak_share`` is against this (the parent) process's peak: the
  same machine, measured in the same run.
  """
  t, h, window = _sizes(preset)["memory"]
  shape = jax.ShapeDtypeStruct((1, 1, t, h), jnp.float32)
  rows = []
  for impl in ("aj_window", "aj_causal"):
    res = _measure_memory(impl, t, h, window) or {}
    pairs = window_pairs(t, window) if impl == "aj_window" else causal_pairs(t)
    rows.append({"case": "memory_T65536", "mode": "fwd+bwd", "impl": impl,
                 "B": 1, "N": 1, "T": t, "H": h,
                 "seconds": res.get("seconds"), "compile_s": None,
                 "skipped": None if res else "failed (see log)",
                 "rss_growth_gib": res.get("rss_growth_gib"),
                 **_timed_fields(res.get("seconds"),
                                 attention_flops(pairs, 1, h, "fwd+bwd"),
                                 peak_gflops),
                 "blocks": _blocks_field(_blocks_of(
                     _memory_fn(impl, window), (shape,) * 3))})
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


def blocks_cell(blocks: dict | None) -> str:
  """``1024x256 (defaults)``, or "-" for a row not on the flash kernel."""
  if blocks is None:
    return "-"
  return f"{blocks['block_q']}x{blocks['block_k']} ({blocks['source']})"


def times_table(rows: list[dict]) -> str:
  lines = ["| case | B x N x T x H | mode | impl | time (s) "
           "| share of matmul peak | blocks | compile (s) "
           "| RSS growth (GiB) |", "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    shape = f"{r['B']}x{r['N']}x{r['T']}x{r['H']}"
    head = f"| {r['case']} | {shape} | {r['mode']} | {r['impl']} |"
    if r["skipped"]:
      lines.append(f"{head} {r['skipped']} | | | | |")
    else:
      lines.append(f"{head} {r['seconds']:.4g} | "
                   f"{_fmt(r.get('peak_share'), '.1%')} | "
                   f"{blocks_cell(r.get('blocks'))} | "
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


def peak_line(peak_gflops: float) -> str:
  return (f"Matmul peak here: {peak_gflops:.0f} GFLOP/s (float32 2048^3 "
          "`jnp.dot`, best of 5, this run).")


def report(rows, ratios, command, repeats, torch, peak_gflops) -> str:
  """The markdown of one run: what, where, the command, three tables."""
  versions = f"jax {jax.__version__}" + (
      f", torch {torch.__version__}" if torch is not None
      else ", torch not installed")
  return (
      f"Measured on a {machine()}, {jax.default_backend()} backend, "
      f"{versions}; `{command}`; medians of {repeats} interleaved rounds "
      "after a warm-up call, seconds.\n\n"
      f"{peak_line(peak_gflops)} Share of matmul peak: useful FLOPs (4 H "
      "per visible query-key pair and head forward, x3.5 fwd+bwd) per "
      "second over that peak. Blocks: for ours on the flash kernel, the "
      "(block_q, block_k) and source `aj.kernels.flash_blocks` gives (the "
      "walk clips them to T and S).\n\n"
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
  peak = host.matmul_peak()  # before the cases, on the same quiet process
  print(peak_line(peak), flush=True)
  rows = []
  for name in chosen:
    if name == "memory_T65536":
      if not memory:
        continue
      new = run_memory(preset, peak)
    else:
      new = run_case(all_cases[name], repeats, peak)
    rows += new
    print(times_table(new), flush=True)
  ran = {name: all_cases[name] for name in chosen if name in all_cases}
  ratios = compute_ratios(rows, ran)
  text = report(rows, ratios, command, repeats, torch, peak)
  print(f"\n{peers_table(ratios)}\n\n{targets_table(ratios)}", flush=True)
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "structured.json"), "w") as f:
    json.dump({"command": command, "machine": machine(),
               "jax": jax.__version__,
               "matmul_peak_gflops": {"float32": peak}, "rows": rows,
               "ratios": ratios}, f, indent=1)
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
