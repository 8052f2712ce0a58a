"""Dropout and forward-mode AD in the flash kernel (``-m benchmarks.flash_autodiff``).

Two tables (docs/performance.md, "Dropout and forward mode"):

* **Dropout's memory**: one head (``[1, 1, T, 64]``, float32) trained with
  ``dropout_rate=0.1`` (forward + backward), peak RSS growth of the call
  in a fresh subprocess per point, the flash kernel (the mask drawn per
  block, never stored) against the dense one (``[T, T]`` weights and
  mask), at T = 2048, 4096, 8192.
* **Forward mode**: ``jax.jvp`` of a causal call (``[B, N, T, 64]``),
  with tangents in q, k and v, in q only and in v only, against the
  forward alone and forward + backward, all compiled, medians
  of ``--repeats`` interleaved runs, in one process; the tangent's largest
  difference from the dense kernel's ``jax.jvp`` (float32) and from a
  float64 dense one; and dropout's cost in the flash forward + backward.

Shape glossary: B batch, N heads, T = S sequence length, H = 64 head dim.
"""

from __future__ import annotations

import json
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

_LENGTHS = flags.DEFINE_list("lengths", ["2048", "4096", "8192"],
                             "T of the dropout memory points.")
_JVP_SHAPE = flags.DEFINE_list("jvp_shape", ["1", "8", "4096"],
                               "B, N, T of the forward-mode point.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs per point.",
                                lower_bound=1)
_POINT = flags.DEFINE_string("point", "", "Internal: impl,T (a child).")
_SKIP_MEMORY = flags.DEFINE_bool("skip_memory", False,
                                 "Only the forward-mode table.")

H = 64
RATE = 0.1


def _normal(seed, shape, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape),
                     dtype)


def _train_step(impl: str, rate: float, mask=None):
  """jit(grad) of a loss through one attention call with dropout."""
  def loss(q, k, v, rng):
    out = aj.scaled_dot_product_attention(
        q, k, v, mask, implementation=impl, dropout_rate=rate,
        dropout_rng=rng if rate else None)
    return jnp.sum(out * out)
  return jax.jit(jax.grad(loss, (0, 1, 2)))


def _memory_point(spec: str) -> None:
  """Child process: one fwd+bwd with dropout; prints the peak RSS growth."""
  impl, t = spec.split(",")
  q, k, v = (_normal(i, (1, 1, int(t), H)) for i in range(3))
  step = _train_step(impl, RATE).lower(q, k, v, jax.random.key(0)).compile()
  host.reset_peak_rss()
  before = host.proc_status("VmHWM")
  jax.block_until_ready(step(q, k, v, jax.random.key(0)))
  after = host.proc_status("VmHWM")
  print(json.dumps({"rss_growth_gib": (after - before) / 2**30}))


def _measure(impl: str, t: int) -> float | None:
  proc = subprocess.run(
      [sys.executable, "-m", "benchmarks.flash_autodiff",
       f"--point={impl},{t}"], capture_output=True, text=True, timeout=1800)
  for line in proc.stdout.splitlines()[::-1]:
    if line.startswith("{"):
      return json.loads(line)["rss_growth_gib"]
  print(proc.stderr[-2000:], file=sys.stderr)
  return None


def memory_table(lengths) -> list[str]:
  rows = ["| T | flash (GiB) | dense (GiB) |", "|---|---|---|"]
  for t in lengths:
    got = {impl: _measure(impl, t) for impl in ("flash", "dense")}
    fmt = lambda x: "failed" if x is None else f"{x:.3f}"  # noqa: E731
    rows.append(f"| {t} | {fmt(got['flash'])} | {fmt(got['dense'])} |")
    print(rows[-1], flush=True)
  return rows


def _time(calls: dict, repeats: int) -> dict:
  """Median seconds of each compiled call, run interleaved."""
  for call in calls.values():
    jax.block_until_ready(call())
  times = {name: [] for name in calls}
  for _ in range(repeats):
    for name, call in calls.items():
      start = time.perf_counter()
      jax.block_until_ready(call())
      times[name].append(time.perf_counter() - start)
  return {name: statistics.median(x) for name, x in times.items()}


def forward_mode_table(b: int, n: int, t: int, repeats: int) -> list[str]:
  shape = (b, n, t, H)
  q, k, v, dq, dk, dv = (_normal(i, shape) for i in range(6))
  causal = aj.Mask(causal=True)

  def attend(impl, rate=0.0):
    return lambda q, k, v, rng=None: aj.scaled_dot_product_attention(
        q, k, v, causal, implementation=impl, dropout_rate=rate,
        dropout_rng=rng)

  flash = attend("flash")
  fwd = jax.jit(flash)
  jvp = jax.jit(lambda p, t: jax.jvp(flash, p, t))
  # Keys and values held constant (symbolic zeros: no dots of theirs).
  jvp_q = jax.jit(lambda q, t: jax.jvp(lambda q: flash(q, k, v), (q,), (t,)))
  jvp_v = jax.jit(lambda v, t: jax.jvp(lambda v: flash(q, k, v), (v,), (t,)))
  grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(flash(q, k, v) * dq),
                          (0, 1, 2)))
  drop = _train_step("flash", RATE, causal)
  plain = _train_step("flash", 0.0, causal)
  key = jax.random.key(0)
  times = _time({
      "fwd": lambda: fwd(q, k, v),
      "jvp": lambda: jvp((q, k, v), (dq, dk, dv)),
      "jvp, tangent in q only": lambda: jvp_q(q, dq),
      "jvp, tangent in v only": lambda: jvp_v(v, dv),
      "fwd+bwd": lambda: grad(q, k, v),
      "fwd+bwd, dropout 0.1": lambda: drop(q, k, v, key),
      "fwd+bwd, no dropout": lambda: plain(q, k, v, None),
  }, repeats)
  _, tangent = jvp((q, k, v), (dq, dk, dv))
  _, dense32 = jax.jit(lambda p, t: jax.jvp(attend("dense"), p, t))(
      (q, k, v), (dq, dk, dv))
  with jax.enable_x64(True):
    f64 = lambda x: jnp.asarray(x, jnp.float64)  # noqa: E731
    _, dense64 = jax.jit(lambda p, t: jax.jvp(attend("dense"), p, t))(
        tuple(map(f64, (q, k, v))), tuple(map(f64, (dq, dk, dv))))
    dense64 = np.asarray(dense64)
  scale = float(np.abs(dense64).max())
  err = lambda x: float(np.abs(np.asarray(x, np.float64) - dense64).max())  # noqa: E731
  rows = [f"B={b}, N={n}, T={t}, H={H}, causal, float32; "
          f"{jax.devices()[0].device_kind}, load "
          f"{host.format_load([host.load_average()])}",
          "", "| call | seconds | / forward |", "|---|---|---|"]
  for name, sec in times.items():
    rows.append(f"| {name} | {sec:.3f} | {sec / times['fwd']:.2f} |")
  rows += ["", f"jvp tangent, largest difference from a float64 dense "
           f"jvp (largest |tangent| {scale:.3g}): flash {err(tangent):.2e}, "
           f"float32 dense {err(dense32):.2e}"]
  for row in rows:
    print(row, flush=True)
  return rows


def main(argv):
  del argv
  if _POINT.value:
    _memory_point(_POINT.value)
    return
  b, n, t = (int(x) for x in _JVP_SHAPE.value)
  forward_mode_table(b, n, t, _REPEATS.value)
  if not _SKIP_MEMORY.value:
    print()
    memory_table([int(x) for x in _LENGTHS.value])


if __name__ == "__main__":
  app.run(main)
