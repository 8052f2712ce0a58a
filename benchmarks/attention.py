"""Attention speed and memory against peers: ``python -m benchmarks.attention``.

Times forward and forward+backward of this library's dense and blockwise
paths, a naive ``jnp`` softmax(QK^T)V, ``jax.nn.dot_product_attention``,
flax's ``nnx.dot_product_attention`` and, when importable,
``torch.nn.functional.scaled_dot_product_attention`` — all in one process,
interleaved, after a warm-up call, medians of ``--repeats`` runs. Reports the
time ratio against torch and against jax.nn, achieved FLOP/s as a share of
the same run's measured matmul peak (``peak_share``), the flash kernel's
``(block_q, block_k)`` and their source for ``aj_blockwise``
(``aj.kernels.flash_blocks``; ``blocks``), first-call (compile) time, and,
with ``--memory``, peak RSS growth per configuration measured in a fresh
subprocess per point. Writes ``benchmark.md``, ``benchmark.json`` and
``benchmark.png`` to ``--out``.

Layout everywhere: ``[B, N, T, H]`` (torch's), T = S, not causal.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from benchmarks import host

_PRESET = flags.DEFINE_enum(
    "preset", "full", ["full", "tiny"],
    "full: the table of docs/performance.md (minutes); tiny: a "
    "seconds-long smoke run.")
_OUT = flags.DEFINE_string("out", "runs/benchmark", "Output directory.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs per point.",
                                lower_bound=1)
_MEMORY = flags.DEFINE_bool("memory", True,
                            "Measure peak RSS per point (subprocesses).")
_IMPLS = flags.DEFINE_list("impls", [], "Only these implementations.")
_LENGTHS = flags.DEFINE_list("lengths", [], "Only these T = S (full preset).")
_DTYPES = flags.DEFINE_list("dtypes", [], "Only these dtypes (full preset).")
_MEMORY_ONLY = flags.DEFINE_bool(
    "memory_only", False,
    "Only the peak-RSS points (single head), each in its own process.")
_MEMORY_POINT = flags.DEFINE_string(
    "memory_point", None, "Internal: measure one 'impl,B,N,T,H,mode' point.")

# Dense paths materialise B*N*T*S float32 scores (several copies in the
# backward): skip them where that would not fit comfortably in 24 GiB.
DENSE_SCORE_BUDGET = 2**29  # scores (2 GiB in float32)
DENSE = ("aj_dense", "naive", "jax_nn", "flax_nnx")


def _swap(x):
  return jnp.swapaxes(x, 1, 2)  # [B, N, T, H] <-> [B, T, N, H]


def _naive(q, k, v):
  scores = jnp.einsum("BNTH,BNSH->BNTS", q, k,
                      preferred_element_type=jnp.float32)
  weights = jax.nn.softmax(scores / np.sqrt(q.shape[-1]), axis=-1)
  return jnp.einsum("BNTS,BNSH->BNTH", weights.astype(v.dtype), v)


def _blockwise(q, k, v, attend=aj.blockwise_attention):
  return attend(q, k, v)


# The implementations on the flash kernel with its automatic blocks, called
# with ``attend=aj.kernels.flash_blocks`` to say which blocks they run.
FLASH = {"aj_blockwise": _blockwise}


def jax_impls():
  from flax import nnx
  return {
      "aj_blockwise": _blockwise,
      "aj_dense": lambda q, k, v: aj.scaled_dot_product_attention(
          q, k, v, implementation="dense"),
      "naive": _naive,
      "jax_nn": lambda q, k, v: _swap(jax.nn.dot_product_attention(
          _swap(q), _swap(k), _swap(v))),
      "flax_nnx": lambda q, k, v: _swap(nnx.dot_product_attention(
          _swap(q), _swap(k), _swap(v))),
  }


def _torch():
  try:
    import torch
  except ImportError:
    return None
  torch.set_num_threads(os.cpu_count() or 1)
  return torch


def _configs(preset: str, lengths=(), dtypes=()):
  """(B, N, T, H, dtype, mode) points, optionally only some T / dtypes."""
  points = _all_configs(preset)
  return [p for p in points
          if (not lengths or str(p[2]) in lengths)
          and (not dtypes or p[4] in dtypes)]


def _all_configs(preset: str):
  if preset == "tiny":
    return [(1, 2, 64, 16, "float32", mode) for mode in ("fwd", "fwd+bwd")]
  points = []
  for dtype in ("float32", "bfloat16"):
    for t in (512, 2048, 8192):
      for mode in ("fwd", "fwd+bwd"):
        points.append((4, 8, t, 64, dtype, mode))
  for t in (16384, 65536):
    for mode in ("fwd", "fwd+bwd"):
      points.append((1, 1, t, 64, "float32", mode))
  return points


def _flops(b, n, t, h, mode):
  fwd = 4 * b * n * t * t * h  # QK^T and PV
  return fwd * (3.5 if mode == "fwd+bwd" else 1.0)  # bwd: 5 matmuls


def _inputs(b, n, t, h, dtype, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.standard_normal((b, n, t, h), np.float32) for _ in range(3)]


def _jax_callable(fn, mode):
  if mode == "fwd":
    return jax.jit(fn)
  return jax.jit(jax.grad(
      lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32)), (0, 1, 2)))


def _torch_callable(torch, mode):
  sdpa = torch.nn.functional.scaled_dot_product_attention

  def run(q, k, v):
    if mode == "fwd":
      with torch.no_grad():
        return sdpa(q, k, v)
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    sdpa(q, k, v).float().sum().backward()
    return q.grad

  return run


def _prepare(name, point, arrays, torch):
  """(callable, args, block) for one implementation at one point."""
  b, n, t, h, dtype, mode = point
  if name == "torch":
    tdtype = getattr(torch, dtype)
    args = [torch.from_numpy(a).to(tdtype) for a in arrays]
    return _torch_callable(torch, mode), args, lambda out: out
  fn = jax_impls()[name]
  args = [jnp.asarray(a, getattr(jnp, dtype)) for a in arrays]
  return _jax_callable(fn, mode), args, jax.block_until_ready


def _time_once(call, args, block):
  start = time.perf_counter()
  block(call(*args))
  return time.perf_counter() - start


def _blocks(name, point) -> dict | None:
  """``{block_q, block_k, source}`` of ``name`` at ``point``, or None for
  an implementation not on the flash kernel. Shapes only: nothing runs."""
  if name not in FLASH:
    return None
  b, n, t, h, dtype, _ = point
  qkv = (jax.ShapeDtypeStruct((b, n, t, h), getattr(jnp, dtype)),) * 3
  return FLASH[name](*qkv, attend=aj.kernels.flash_blocks)._asdict()


def _peak_rss_bytes() -> int:
  """This process's peak RSS. Linux's VmHWM belongs to the address space, so
  unlike ``ru_maxrss`` it does not inherit the parent's peak across exec."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _memory_point(spec: str) -> None:
  """Child process: prints the peak RSS growth (GiB) of one call."""
  name, b, n, t, h, mode = spec.split(",")
  point = (int(b), int(n), int(t), int(h), "float32", mode)
  torch = _torch() if name == "torch" else None
  arrays = _inputs(*point[:5])
  call, args, block = _prepare(name, point, arrays, torch)
  base = _peak_rss_bytes()
  block(call(*args))
  print(json.dumps({"rss_growth_gib": (_peak_rss_bytes() - base) / 2**30}))


def _measure_memory(name, point) -> float | None:
  b, n, t, h, _, mode = point
  spec = ",".join(map(str, (name, b, n, t, h, mode)))
  proc = subprocess.run(
      [sys.executable, "-m", "benchmarks.attention", f"--memory_point={spec}"],
      capture_output=True, text=True, timeout=1800)
  for line in proc.stdout.splitlines()[::-1]:
    if line.startswith("{"):
      return json.loads(line)["rss_growth_gib"]
  return None


def run_benchmark(preset: str, out_dir: str, repeats: int, memory: bool,
                  only: list[str], lengths=(), dtypes=()) -> list[dict]:
  torch = _torch()
  names = list(jax_impls()) + (["torch"] if torch is not None else [])
  if only:
    names = [n for n in names if n in only]
  peaks = {d: host.matmul_peak(d) for d in ("float32", "bfloat16")}
  print(f"matmul peak here: float32 {peaks['float32']:.0f} GFLOP/s, bf16 "
        f"(float32 accumulation) {peaks['bfloat16']:.0f} GFLOP/s", flush=True)
  rows = []
  for point in _configs(preset, lengths, dtypes):
    b, n, t, h, dtype, mode = point
    arrays = _inputs(b, n, t, h, dtype)
    live = [x for x in names
            if not (x in DENSE and b * n * t * t > DENSE_SCORE_BUDGET)
            and not (b * n == 1 and x not in ("aj_blockwise", "torch")
                     and t > 16384)]
    prepared, compile_s = {}, {}
    for name in live:
      call, args, block = _prepare(name, point, arrays, torch)
      compile_s[name] = _time_once(call, args, block)  # includes compile
      prepared[name] = (call, args, block)
    times = {name: [] for name in live}
    for _ in range(repeats):  # interleaved, so drift hits everyone alike
      for name in live:
        times[name].append(_time_once(*prepared[name]))
    medians = {name: statistics.median(v) for name, v in times.items()}
    for name in names:
      row = {"impl": name, "B": b, "N": n, "T": t, "H": h, "dtype": dtype,
             "mode": mode, "seconds": medians.get(name),
             "blocks": _blocks(name, point)}
      if name in medians:
        sec = medians[name]
        row["compile_s"] = compile_s[name] - sec
        row["vs_torch"] = sec / medians["torch"] if "torch" in medians else None
        row["vs_jax_nn"] = (sec / medians["jax_nn"] if "jax_nn" in medians
                            else None)
        row["peak_share"] = _flops(b, n, t, h, mode) / sec / 1e9 / peaks[dtype]
        if memory and b * n == 1:
          row["rss_growth_gib"] = _measure_memory(name, point)
      rows.append(row)
    print(_table([r for r in rows if r["T"] == t and r["mode"] == mode
                  and r["dtype"] == dtype and r["B"] == b]), flush=True)
  _write(out_dir, rows, peaks)
  return rows


def _fmt(x, spec):
  return "-" if x is None else format(x, spec)


def _blocks_cell(blocks) -> str:
  if blocks is None:
    return "-"
  return f"{blocks['block_q']}x{blocks['block_k']} ({blocks['source']})"


def _table(rows) -> str:
  head = ("| impl | B x N | T | dtype | mode | time (s) | x torch | x jax.nn "
          "| % matmul peak | blocks | compile (s) | RSS growth (GiB) |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")
  lines = [head]
  for r in rows:
    if r["seconds"] is None:
      lines.append(f"| {r['impl']} | {r['B']}x{r['N']} | {r['T']} | "
                   f"{r['dtype']} | {r['mode']} | skipped (dense scores do "
                   "not fit) | | | | | | |")
      continue
    lines.append(
        f"| {r['impl']} | {r['B']}x{r['N']} | {r['T']} | {r['dtype']} | "
        f"{r['mode']} | {r['seconds']:.4g} | {_fmt(r.get('vs_torch'), '.2f')} "
        f"| {_fmt(r.get('vs_jax_nn'), '.2f')} | "
        f"{100 * r['peak_share']:.1f} | {_blocks_cell(r.get('blocks'))} | "
        f"{_fmt(r.get('compile_s'), '.2f')} | "
        f"{_fmt(r.get('rss_growth_gib'), '.3f')} |")
  return "\n".join(lines)


def _peaks_text(peaks) -> str:
  return ", ".join(f"{dtype} {gflops:.0f}" for dtype, gflops in peaks.items())


def _write(out_dir, rows, peaks) -> None:
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "benchmark.json"), "w") as f:
    json.dump({"matmul_peak_gflops": peaks, "rows": rows}, f, indent=1)
  with open(os.path.join(out_dir, "benchmark.md"), "w") as f:
    f.write(f"Matmul peak (GFLOP/s, 2048^3 `jnp.dot`, this run): "
            f"{_peaks_text(peaks)}\n\n{_table(rows)}\n")
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  for ax, mode in zip(axes, ("fwd", "fwd+bwd")):
    shown = [r for r in rows if r["mode"] == mode and r["seconds"]
             and r["dtype"] == "float32" and r["B"] * r["N"] > 1]
    for impl in sorted({r["impl"] for r in rows}):
      pts = [(r["T"], r["seconds"]) for r in shown if r["impl"] == impl]
      if pts:
        ax.plot(*zip(*pts), marker="o", label=impl)
    shapes = sorted({(r["B"], r["N"], r["H"]) for r in shown})  # as measured
    ax.set(xscale="log", yscale="log", xlabel="T = S", ylabel="seconds",
           title=f"{mode}, float32, " + ("; ".join(
               f"B={b}, N={n}, H={h}" for b, n, h in shapes) or "no points"))
    ax.grid(alpha=0.3)
  axes[0].legend()
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, "benchmark.png"), dpi=100)
  plt.close(fig)


def run_memory(preset: str, out_dir: str, only: list[str]) -> list[dict]:
  """Peak RSS growth of every single-head point, one subprocess each."""
  names = list(jax_impls()) + (["torch"] if _torch() is not None else [])
  names = [n for n in names if not only or n in only]
  rows = []
  for b, n, t, h, dtype, mode in _configs(preset):
    if b * n != 1:
      continue
    for name in names:
      if name not in ("aj_blockwise", "torch") and t > 16384:
        continue  # dense scores alone would be 16 GiB
      gib = _measure_memory(name, (b, n, t, h, dtype, mode))
      rows.append({"impl": name, "T": t, "mode": mode, "rss_growth_gib": gib})
      print(f"| {name} | {t} | {mode} | {_fmt(gib, '.3f')} |", flush=True)
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "memory.json"), "w") as f:
    json.dump(rows, f, indent=1)
  return rows


def main(argv):
  del argv
  if _MEMORY_POINT.value:
    _memory_point(_MEMORY_POINT.value)
    return
  if _MEMORY_ONLY.value:
    run_memory(_PRESET.value, _OUT.value, _IMPLS.value)
    return
  run_benchmark(_PRESET.value, _OUT.value, _REPEATS.value, _MEMORY.value,
                _IMPLS.value, _LENGTHS.value, _DTYPES.value)


if __name__ == "__main__":
  app.run(main)
