"""Chunked prefill into a long KV cache: ``python -m benchmarks.chunked_prefill``.

One ``aj.MultiHeadAttention`` layer (D=512, N=8 query heads over K=2
key/value heads, layer mask ``aj.Mask(causal=True, window=(W - 1, 0))``
with W=1024, B=1, float32) takes a ``T``-token prompt in two ways:

* ``chunked``: ``init_cache(batch_size=1, max_length=L)`` (a linear cache
  of ``L`` slots), then ``T / C`` calls of ``C`` tokens each with
  ``decode=True``; each call is one ``jax.jit`` of ``nnx.merge`` -> layer ->
  ``nnx.state`` with the state donated.
* ``uncached``: one jitted call of the same layer on all ``T`` tokens (no
  cache; the layer mask makes it causal within the window).

Then one-token ``decode=True`` steps continue from the chunked prefill's
cache (position ``T`` on, over all ``L`` slots).

Before anything is timed, the concatenated chunk outputs are compared with
the uncached output, and the decode steps' outputs with the uncached layer's
rows over the prompt plus those tokens; both must agree within
``CHECK_TOL`` (the max |diff| is printed), else the run raises. That run is
also the warm-up that compiles every program; each jitted function counts
its traces and the run raises unless each was traced once.

Timed, compilation excluded: a whole chunked prefill from a fresh (copied)
empty cache and one uncached call, interleaved, medians of ``--repeats``;
then ``--decode_steps`` single decode steps after a prefill, each timed on
its own (dispatch included: the latency a generation loop sees), their
median.

Memory (``--memory``, on by default): each prefill path runs in a fresh
subprocess (``--memory_point``) that builds its inputs and fresh cache,
compiles ahead of time, resets the peak RSS (Linux ``/proc/self/clear_refs``)
and runs the path once: the reported peak RSS growth is that execution's
(every intermediate and the outputs; the inputs, parameters and the empty
cache are the baseline), as ``benchmarks.structured``'s ``--memory`` does.
Where the reset is refused the baseline is the peak so far, which can only
under-count; the table says so.

``--write_docs`` rewrites the generated section "Chunked prefill into a
long cache" of docs/performance.md.

Shape glossary: B batch (1), T prompt tokens (``--tokens``), C chunk tokens
(``--chunk``), L cache slots (``--cache``), D model dim, N query heads, K
key/value heads, H = D // N head dim, W window.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import statistics
import subprocess
import sys
import textwrap
import time

from absl import app
from absl import flags
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from benchmarks import decode
from benchmarks import host

DOCS_PAGE = (pathlib.Path(__file__).resolve().parent.parent / "docs"
             / "performance.md")
START, END = "<!-- chunked_prefill:start -->", "<!-- chunked_prefill:end -->"
# Both paths compute in float32 on inputs and outputs of order 1 and differ
# in the kernel's summation order (a dense mask over L cache slots in
# blocks, against the window over T keys): ~1e-6 absolute. A wrong cache (a
# shifted slot, a lost window edge, a position restarting per chunk)
# changes outputs at the 1e-1 scale.
CHECK_TOL = 1e-4
PATHS = ("chunked", "uncached")


def _define_flags():
  """The command line's flags, defined only when run as a program."""
  global _REPEATS, _TOKENS, _CHUNK, _CACHE, _DECODE_STEPS, _MEMORY
  global _WRITE_DOCS, _MEMORY_POINT
  _REPEATS = flags.DEFINE_integer(
      "repeats", 3, "Timed prefills per path (medians).", lower_bound=1)
  _TOKENS = flags.DEFINE_integer("tokens", 4096, "T: prompt tokens.",
                                 lower_bound=1)
  _CHUNK = flags.DEFINE_integer("chunk", 512,
                                "C: tokens per prefill call (divides T).",
                                lower_bound=1)
  _CACHE = flags.DEFINE_integer("cache", 32768, "L: cache slots.",
                                lower_bound=1)
  _DECODE_STEPS = flags.DEFINE_integer(
      "decode_steps", 64, "Single-token decode steps timed (median).",
      lower_bound=1)
  _MEMORY = flags.DEFINE_bool(
      "memory", True,
      "Measure each prefill path's peak RSS growth in a fresh subprocess.")
  _WRITE_DOCS = flags.DEFINE_bool(
      "write_docs", False,
      "Rewrite the generated chunked-prefill section of docs/performance.md.")
  _MEMORY_POINT = flags.DEFINE_string(
      "memory_point", None,
      "Internal: measure one 'path,T,C,L,D,N,K,W' point and print JSON.")


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


class Programs:
  """The layer's jitted programs and a fresh cache.

  ``chunk(state, x [B, C, D]) -> (state, out [B, C, D])`` and
  ``step(state, x [B, 1, D]) -> (state, out [B, 1, D])`` write into the
  cache (``state`` donated); ``uncached(x [B, T, D]) -> out [B, T, D]``;
  ``check`` is ``uncached`` jitted apart, for the decode check's longer
  input. ``traces`` counts how often each function was traced.
  """

  def __init__(self, cache: int, d_model: int, num_heads: int,
               num_kv_heads: int, window: int):
    self.traces = collections.Counter()
    layer = aj.MultiHeadAttention(
        d_model, num_heads, num_kv_heads=num_kv_heads,
        mask=aj.Mask(causal=True, window=(window - 1, 0)), rngs=nnx.Rngs(0))
    plain_def, params = nnx.split(layer)  # before the cache exists
    layer.init_cache(batch_size=1, max_length=cache)
    graphdef, self._initial = nnx.split(layer)

    def decoding(name):
      def call(state, x):
        self.traces[name] += 1
        m = nnx.merge(graphdef, state)
        out = m(x, decode=True)
        return nnx.state(m), out
      return jax.jit(call, donate_argnums=0)

    def plain(name):
      def call(params, x):
        self.traces[name] += 1
        return nnx.merge(plain_def, params)(x)
      return jax.jit(call)

    self.params = params
    self.chunk, self.step = decoding("chunk"), decoding("step")
    self.uncached_jit, self.check_jit = plain("uncached"), plain("check")

  def uncached(self, x):
    return self.uncached_jit(self.params, x)

  def check(self, x):
    return self.check_jit(self.params, x)

  def fresh(self):
    """A copy of the empty cache's state (the donated calls consume it)."""
    return jax.block_until_ready(_copy(self._initial))

  def prefill(self, chunks, chunk_fn=None, state=None):
    """All chunks into a cache: ``(seconds, state, [out [B, C, D]])``.

    ``state`` (consumed) defaults to a fresh one, made before the clock
    starts; ``chunk_fn`` to ``chunk``. Nothing is read back before the last
    chunk's output and the cache are ready, so the calls queue as they
    would in a serving loop.
    """
    chunk_fn = chunk_fn or self.chunk
    state = self.fresh() if state is None else state
    outs = []
    start = time.perf_counter()
    for x in chunks:
      state, out = chunk_fn(state, x)
      outs.append(out)
    jax.block_until_ready((state, outs))
    return time.perf_counter() - start, state, outs


def _inputs(tokens: int, chunk: int, steps: int, d_model: int):
  """Prompt ``[1, T, D]``, its chunks, and ``steps`` tokens ``[1, 1, D]``."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((1, tokens + steps, d_model), np.float32)
  prompt = jnp.asarray(x[:, :tokens])
  chunks = [jnp.asarray(x[:, i:i + chunk]) for i in range(0, tokens, chunk)]
  new = [jnp.asarray(x[:, tokens + i:tokens + i + 1]) for i in range(steps)]
  return x, prompt, chunks, new


def check_sizes(tokens: int, chunk: int, cache: int, decode_steps: int):
  """Raises ValueError unless the chunks tile the prompt and all fits."""
  if tokens % chunk:
    raise ValueError(f"--chunk ({chunk}) must divide --tokens ({tokens}): "
                     "every prefill call has the same shape (one compile); "
                     f"e.g. --tokens={tokens - tokens % chunk or chunk}.")
  if tokens + decode_steps > cache:
    raise ValueError(
        f"--cache ({cache} slots) must hold the prompt ({tokens}) and the "
        f"--decode_steps ({decode_steps}) tokens after it: raise --cache to "
        f"at least {tokens + decode_steps}.")


def max_diff(got, want, what: str) -> float:
  """Max |got - want|; raises RuntimeError above ``CHECK_TOL``."""
  got, want = np.asarray(got), np.asarray(want)
  if got.shape != want.shape:
    raise RuntimeError(f"{what}: shapes {got.shape} and {want.shape} differ")
  diff = float(np.max(np.abs(got - want)))
  if not diff <= CHECK_TOL:  # NaN fails too
    raise RuntimeError(f"{what}: max |diff| {diff:.3g} exceeds the "
                       f"tolerance {CHECK_TOL}; nothing was timed.")
  return diff


def run_benchmark(tokens: int = 4096, chunk: int = 512, cache: int = 32768,
                  repeats: int = 3, decode_steps: int = 64,
                  memory: bool = True, command: str | None = None,
                  docs_page: os.PathLike | None = None, *,
                  d_model: int = 512, num_heads: int = 8,
                  num_kv_heads: int = 2, window: int = 1024) -> list[dict]:
  """Checks, times and prints the three rows; returns them.

  Rows: ``{path, seconds, tokens_per_s, ratio, rss_growth_mib, hwm_reset,
  check_max_diff}``; ``ratio`` is the time over the uncached call's (None
  for the decode row), ``rss_growth_mib`` None where not measured.
  """
  check_sizes(tokens, chunk, cache, decode_steps)
  command = command or "python -m benchmarks.chunked_prefill"
  load = [host.load_average()]
  programs = Programs(cache, d_model, num_heads, num_kv_heads, window)
  x, prompt, chunks, new = _inputs(tokens, chunk, decode_steps, d_model)

  # The check is also the warm-up that compiles every program.
  _, state, outs = programs.prefill(chunks)
  index = np.asarray(state["cache_index"][...])
  if index.tolist() != [tokens]:
    raise RuntimeError(f"after the prefill the cache index is {index}, "
                       f"expected [{tokens}]")
  prefill_diff = max_diff(jnp.concatenate(outs, axis=1),
                          programs.uncached(prompt),
                          "chunked prefill vs the uncached call")
  steps_out = []
  for token in new:
    state, out = programs.step(state, token)
    steps_out.append(out)
  decode_diff = max_diff(
      jnp.concatenate(steps_out, axis=1),
      programs.check(jnp.asarray(x))[:, tokens:],
      "decode steps vs the uncached call over prompt + tokens")
  print(f"chunked == uncached (max |diff| {prefill_diff:.2g}); decode steps "
        f"== uncached (max |diff| {decode_diff:.2g}); tolerance {CHECK_TOL}",
        flush=True)

  times = {path: [] for path in PATHS}
  for _ in range(repeats):  # interleaved, so drift hits both alike
    seconds, state, _ = programs.prefill(chunks)
    times["chunked"].append(seconds)
    start = time.perf_counter()
    jax.block_until_ready(programs.uncached(prompt))
    times["uncached"].append(time.perf_counter() - start)
  step_times = []
  for token in new:  # continues from the last timed prefill's cache
    start = time.perf_counter()
    state, out = programs.step(state, token)
    jax.block_until_ready(out)
    step_times.append(time.perf_counter() - start)
  if dict(programs.traces) != {"chunk": 1, "uncached": 1, "step": 1,
                               "check": 1}:
    raise RuntimeError(f"traced {dict(programs.traces)}, expected each "
                       "program once (a retrace would time compilation).")

  spec = (tokens, chunk, cache, d_model, num_heads, num_kv_heads, window)
  mem = {path: (measure_memory(path, *spec) if memory else None)
         for path in PATHS}
  uncached_s = statistics.median(times["uncached"])
  rows = []
  for path in PATHS:
    sec = statistics.median(times[path])
    rows.append({"path": path, "seconds": sec, "tokens_per_s": tokens / sec,
                 "ratio": sec / uncached_s,
                 "rss_growth_mib": (mem[path] or {}).get("rss_growth_mib"),
                 "hwm_reset": (mem[path] or {}).get("hwm_reset"),
                 "check_max_diff": prefill_diff})
  step_s = statistics.median(step_times)
  rows.append({"path": "decode step", "seconds": step_s,
               "tokens_per_s": 1 / step_s, "ratio": None,
               "rss_growth_mib": None, "hwm_reset": None,
               "check_max_diff": decode_diff})
  load.append(host.load_average())
  text = report(rows, dict(tokens=tokens, chunk=chunk, cache=cache,
                           repeats=repeats, decode_steps=decode_steps,
                           d_model=d_model, num_heads=num_heads,
                           num_kv_heads=num_kv_heads, window=window,
                           memory=memory, load=load), command)
  print(f"\n{text}", flush=True)
  if docs_page is not None:
    host.replace_section(docs_page, START, END, text)
  return rows


# --------------------------------------------------------------------------
# Memory: one fresh process per path.


def memory_point(spec: str) -> dict:
  """In a fresh process: one path's peak RSS growth (MiB) and time.

  ``spec`` is ``"path,T,C,L,D,N,K,W"``. The path's program is compiled
  ahead of time and the peak RSS reset afterwards (where Linux allows), so
  the growth is the first execution's: inputs, parameters and the empty
  cache excluded, intermediates and outputs included.
  """
  path, *sizes = spec.split(",")
  tokens, chunk, cache, d_model, num_heads, num_kv_heads, window = map(
      int, sizes)
  if path not in PATHS:
    raise ValueError(f"memory point path {path!r}: expected one of {PATHS}")
  check_sizes(tokens, chunk, cache, 0)
  programs = Programs(cache, d_model, num_heads, num_kv_heads, window)
  _, prompt, chunks, _ = _inputs(tokens, chunk, 0, d_model)
  if path == "chunked":
    state = programs.fresh()  # the baseline: allocated before the reset
    compiled = programs.chunk.lower(state, chunks[0]).compile()
    run = lambda: programs.prefill(chunks, compiled, state)[0]
  else:
    compiled = programs.uncached_jit.lower(programs.params, prompt).compile()

    def run():
      start = time.perf_counter()
      jax.block_until_ready(compiled(programs.params, prompt))
      return time.perf_counter() - start
  reset = host.reset_peak_rss()
  base = host.proc_status("VmRSS") if reset else host.proc_status("VmHWM")
  seconds = run()
  growth = (host.proc_status("VmHWM") - base) / 2**20
  return {"rss_growth_mib": growth, "seconds": seconds, "hwm_reset": reset}


def measure_memory(path: str, *sizes: int) -> dict | None:
  """``memory_point`` of ``path`` in a subprocess; None (logged) on failure."""
  spec = ",".join([path, *map(str, sizes)])
  proc = subprocess.run(
      [sys.executable, "-m", "benchmarks.chunked_prefill",
       f"--memory_point={spec}"],
      capture_output=True, text=True, timeout=1800,
      cwd=pathlib.Path(__file__).resolve().parent.parent)
  for line in proc.stdout.splitlines()[::-1]:
    if line.startswith("{"):
      return json.loads(line)
  print(f"memory point {spec} failed:\n{proc.stderr[-2000:]}", flush=True)
  return None


# --------------------------------------------------------------------------
# Tables, docs.


def table(rows: list[dict], config: dict) -> str:
  c = config
  calls = {"chunked": f"{c['tokens'] // c['chunk']} x {c['chunk']} tokens "
                      f"into {c['cache']} slots",
           "uncached": f"1 x {c['tokens']} tokens, no cache",
           "decode step": f"1 token over {c['cache']} slots"}
  lines = ["| path | calls | time (ms) | tokens/s | x uncached | peak RSS "
           "growth (MiB) |", "|---|---|---|---|---|---|"]
  for r in rows:
    ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}x"
    if r["rss_growth_mib"] is None:
      mem = "-"
    else:
      mem = f"{r['rss_growth_mib']:.0f}" + ("" if r["hwm_reset"] else
                                            " (no reset: a lower bound)")
    lines.append(f"| {r['path']} | {calls[r['path']]} | "
                 f"{1e3 * r['seconds']:.4g} | {r['tokens_per_s']:.4g} | "
                 f"{ratio} | {mem} |")
  return "\n".join(lines)


def report(rows: list[dict], config: dict, command: str) -> str:
  """The markdown of one run: where, what, the command, the table."""
  c = config
  by = {r["path"]: r for r in rows}
  memory = ("peak RSS growth of one execution, each prefill path in a fresh "
            "subprocess, compiled ahead of time, peak reset before running "
            "(inputs, parameters and the empty cache are the baseline)"
            if c["memory"] else "memory not measured (--nomemory)")
  text = (
      f"Measured on a {decode.machine()}; `{command}`: one "
      f"MultiHeadAttention layer, D={c['d_model']}, N={c['num_heads']}, "
      f"K={c['num_kv_heads']}, layer mask causal with a window of "
      f"{c['window']} tokens, B=1, float32, automatic implementation. "
      f"Prefill of T={c['tokens']} tokens: chunked, {c['tokens'] // c['chunk']}"
      f" decode=True calls of {c['chunk']} tokens into a linear cache of "
      f"L={c['cache']} slots, against one uncached call; medians of "
      f"{c['repeats']} interleaved prefills after a compiling warm-up, each "
      f"chunked prefill from a fresh cache. Decode step: the median of "
      f"{c['decode_steps']} one-token steps after a prefill, each timed "
      f"alone. Before timing, the chunked outputs agreed with the uncached "
      f"call (max |diff| {by['chunked']['check_max_diff']:.2g}) and the "
      f"decode steps with the uncached call over prompt and tokens (max "
      f"|diff| {by['decode step']['check_max_diff']:.2g}). Memory: {memory}. "
      f"1-minute load average {host.format_load(c['load'])} (start, end; other "
      "processes share the cores).")
  # Whole words only: a flag or a CPU model name is never split.
  text = textwrap.fill(text, 76, break_long_words=False,
                       break_on_hyphens=False)
  return f"{text}\n\n{table(rows, config)}\n"


def main(argv):
  del argv
  if _MEMORY_POINT.value:
    print(json.dumps(memory_point(_MEMORY_POINT.value)), flush=True)
    return
  command = " ".join(["python -m benchmarks.chunked_prefill", *sys.argv[1:]])
  run_benchmark(_TOKENS.value, _CHUNK.value, _CACHE.value, _REPEATS.value,
                _DECODE_STEPS.value, _MEMORY.value, command,
                DOCS_PAGE if _WRITE_DOCS.value else None)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
