"""Decode throughput, KV cache against recomputation: ``python -m benchmarks.decode``.

A stack of ``--layers`` ``aj.MultiHeadAttention`` self-attention layers
(``x + attention(x)`` per layer, nothing else: no embedding, FFN or
unembedding, so only attention and its projections are timed) generates
autoregressively until the context is full, in two ways:

* ``cache``: ``init_cache(B, C)`` per layer, one prefill call of the
  ``P``-token prompt with ``decode=True``, then one ``decode=True`` call per
  token, each reading the keys/values cached so far.
* ``recompute``: no cache; each step writes its token into a fixed
  ``[B, C, D]`` buffer and runs the full causal forward over it with
  ``mask=aj.Mask(q_lengths=t + 1, kv_lengths=t + 1)`` (a traced length per
  step), keeping row ``t``. The shapes never change, so it compiles once;
  the lengths let the blockwise kernel skip the blocks past ``t`` (the dense
  kernel computes all ``C x C`` scores and masks them), while the
  projections always run over all ``C`` rows.

The generated input is the model's own output: the next token is the last
output row normalised to unit RMS (no vocabulary), so each step depends on
the one before, as in greedy decoding. Each step is one ``jax.jit`` call of
``nnx.merge`` -> module -> ``nnx.state`` with the state (cache) or the buffer
(recompute) donated; every jitted function counts its traces and the run
raises unless each was traced exactly once. Before timing, the prefill and
the first ``--check_steps`` outputs of the two modes are compared (they must
agree within float32 rounding: a fast wrong decode is worthless); that run
is also the warm-up that compiles every program.

Then, unless switched off, the rows of ``benchmarks.decode_variants``:
shared-prefix (cascade) decoding against the concatenation
(``--shared_prefix=B,P,G``: B sequences sharing a P-token prompt, G tokens
each) and latent attention against ``MultiHeadAttention`` of the same width
(``--latent``).

Timed: the prefill call, and the ``C - P`` decode steps (``B * (C - P)``
tokens), compilation excluded; medians of ``--repeats`` runs, each from an
empty cache / buffer, the two modes interleaved. ``--layers`` defaults to 1:
a stack costs about ``layers`` times a layer per step, and one layer keeps
the per-call overhead of a small decode step visible. ``--write_docs``
rewrites the generated section of docs/performance.md.

Shape glossary: B batch, C context (cache capacity L = C), P prompt length,
D model dim, N heads, H = D // N head dim.
"""

from __future__ import annotations

import collections
import os
import pathlib
import platform
import statistics
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
from benchmarks import decode_variants
from benchmarks import host

DOCS_PAGE = (pathlib.Path(__file__).resolve().parent.parent / "docs"
             / "performance.md")
START, END = "<!-- decode:start -->", "<!-- decode:end -->"
MODES = ("cache", "recompute")
# Both modes compute in float32; they differ in the order of the roundings
# (a 1-key-row against a C x C causal forward, dense against blockwise
# kernels), ~1e-6 relative per layer, and the unit-RMS feedback carries a
# difference on to the next step without amplifying it. 1e-4 leaves room for
# a few layers and steps; a wrong cache (a shifted slot, a lost position)
# changes outputs at the 1e-1 scale.
CHECK_TOL = 1e-4


def _define_flags():
  """The command line's flags, defined only when run as a program."""
  global _BATCH_SIZES, _CONTEXT, _D_MODEL, _NUM_HEADS, _LAYERS, _PROMPT
  global _REPEATS, _IMPLEMENTATION, _CHECK_STEPS, _WRITE_DOCS
  global _SHARED_PREFIX, _LATENT
  _BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "8"],
                                   "Batch sizes B.")
  _CONTEXT = flags.DEFINE_integer("context", 1024,
                                  "C: prompt + generated tokens.",
                                  lower_bound=2)
  _D_MODEL = flags.DEFINE_integer("d_model", 256, "D.", lower_bound=1)
  _NUM_HEADS = flags.DEFINE_integer("num_heads", 8, "N.", lower_bound=1)
  _LAYERS = flags.DEFINE_integer(
      "layers", 1, "Attention layers in the stack.", lower_bound=1)
  _PROMPT = flags.DEFINE_integer("prompt", 1, "P: prompt tokens.",
                                 lower_bound=1)
  _REPEATS = flags.DEFINE_integer(
      "repeats", 1,
      "Timed generations per batch size and mode (the defaults take about "
      "3 minutes on 2 cores, nearly all of it B=8 recomputation).",
      lower_bound=1)
  _IMPLEMENTATION = flags.DEFINE_enum(
      "implementation", None, ["dense", "flash", "cudnn"],
      "MultiHeadAttention's attention_fn= (default: automatic).")
  _CHECK_STEPS = flags.DEFINE_integer(
      "check_steps", 4,
      "Decode steps compared between the modes (this run also compiles).",
      lower_bound=1)
  _SHARED_PREFIX = flags.DEFINE_list(
      "shared_prefix", ["8", "1024", "64"],
      "B,P,G of the shared-prefix row (B sequences sharing a P-token "
      "prompt, G generated each); empty to skip it.")
  _LATENT = flags.DEFINE_bool(
      "latent", True, "Time the latent-attention row (D, N as above).")
  _WRITE_DOCS = flags.DEFINE_bool(
      "write_docs", False,
      "Rewrite the generated decode section of docs/performance.md.")


class Stack(nnx.Module):
  """``layers`` residual self-attention layers: ``x + attention(x)`` each."""

  def __init__(self, layers: int, d_model: int, num_heads: int, *,
               implementation: str | None, rngs: nnx.Rngs):
    self.layers = nnx.List([
        aj.MultiHeadAttention(d_model, num_heads, rngs=rngs,
                              attention_fn=implementation)
        for _ in range(layers)])

  def init_cache(self, batch_size: int, max_length: int) -> None:
    for layer in self.layers:
      layer.init_cache(batch_size, max_length)

  def __call__(self, x, **kwargs):  # [B, T, D] -> [B, T, D]
    for layer in self.layers:
      x = x + layer(x, **kwargs)
    return x


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


class Programs:
  """One mode's jitted ``prefill`` and ``step``, and a fresh carry.

  ``prefill(carry, prompt [B, P, D]) -> (carry, token [B, 1, D], out)``;
  ``step(carry, token, t) -> (carry, token, out)`` for position ``t``.
  ``traces`` counts how often each function was traced.
  """

  def __init__(self, mode: str, model_fn, batch: int, context: int,
               prompt_len: int, d_model: int):
    self.traces = collections.Counter()
    model = model_fn()
    if mode == "cache":
      model.init_cache(batch, context)
      graphdef, state = nnx.split(model)
      self._initial = state

      def prefill(state, prompt):
        self.traces["prefill"] += 1
        m = nnx.merge(graphdef, state)
        out = m(prompt, decode=True)[:, -1:]  # [B, 1, D]
        return nnx.state(m), decode_variants.next_token(out), out

      def step(state, token):
        self.traces["step"] += 1
        m = nnx.merge(graphdef, state)
        out = m(token, decode=True)  # [B, 1, D]
        return nnx.state(m), decode_variants.next_token(out), out

      jit_prefill = jax.jit(prefill, donate_argnums=0)
      jit_step = jax.jit(step, donate_argnums=0)
      self.prefill = jit_prefill
      self.step = lambda carry, token, t: jit_step(carry, token)
      self.fresh = lambda: _copy(self._initial)
    else:
      graphdef, params = nnx.split(model)

      def last_row(params, buffer, t):  # the causal forward over rows <= t
        m = nnx.merge(graphdef, params)
        n = jnp.full((batch,), t + 1, jnp.int32)  # [B]
        y = m(buffer, mask=aj.Mask(q_lengths=n, kv_lengths=n),
              is_causal=True)  # [B, C, D]
        return jax.lax.dynamic_slice_in_dim(y, t, 1, axis=1)  # [B, 1, D]

      def prefill(params, buffer, prompt):
        self.traces["prefill"] += 1
        buffer = jax.lax.dynamic_update_slice(buffer, prompt, (0, 0, 0))
        out = last_row(params, buffer, prompt.shape[1] - 1)
        return buffer, decode_variants.next_token(out), out

      def step(params, buffer, token, t):
        self.traces["step"] += 1
        buffer = jax.lax.dynamic_update_slice(buffer, token, (0, t, 0))
        out = last_row(params, buffer, t)
        return buffer, decode_variants.next_token(out), out

      jit_prefill = jax.jit(prefill, donate_argnums=1)
      jit_step = jax.jit(step, donate_argnums=1)
      self.prefill = lambda buffer, prompt: jit_prefill(params, buffer,
                                                        prompt)
      self.step = lambda buffer, token, t: jit_step(params, buffer, token, t)
      self.fresh = lambda: jnp.zeros((batch, context, d_model), jnp.float32)
    self.prompt_len = prompt_len
    self.context = context

  def generate(self, prompt, steps: int, keep: bool = False):
    """Prefill and ``steps`` steps; ``(prefill_s, decode_s, outputs)``.

    ``outputs`` (the prefill's last row and each step's, NumPy) only with
    ``keep``; otherwise nothing is read back before the last token.
    """
    carry = self.fresh()
    jax.block_until_ready(carry)
    start = time.perf_counter()
    carry, token, out = self.prefill(carry, prompt)
    jax.block_until_ready(token)
    prefill_s = time.perf_counter() - start
    outs = [np.asarray(out)] if keep else []
    start = time.perf_counter()
    for t in range(self.prompt_len, self.prompt_len + steps):
      carry, token, out = self.step(carry, token, np.int32(t))
      if keep:
        outs.append(np.asarray(out))
    jax.block_until_ready(token)
    return prefill_s, time.perf_counter() - start, outs


def check_equal(programs: dict[str, Programs], prompt, steps: int) -> float:
  """Max |cache - recompute| over the prefill and ``steps`` steps; raises."""
  outs = {mode: p.generate(prompt, steps, keep=True)[2]
          for mode, p in programs.items()}
  cache, recompute = (np.stack(outs[m]) for m in MODES)
  diff = float(np.max(np.abs(cache - recompute)))
  if not np.allclose(cache, recompute, atol=CHECK_TOL, rtol=CHECK_TOL):
    raise RuntimeError(
        f"cached decoding differs from recomputation: max |diff| {diff:.3g} "
        f"over the prefill and {steps} steps (tolerance {CHECK_TOL}).")
  return diff


def machine() -> str:
  """CPU count and model, JAX backend and device kind."""
  name = platform.processor()
  if not name:
    try:
      with open("/proc/cpuinfo") as f:
        name = next((line.split(":", 1)[1].strip() for line in f
                     if line.startswith("model name")), "")
    except OSError:
      name = ""
  device = jax.devices()[0]
  return (f"{os.cpu_count()}-core CPU ({name or platform.machine()}), "
          f"jax {jax.__version__} {jax.default_backend()} backend, "
          f"{len(jax.devices())} x {device.device_kind}")


def run_benchmark(batch_sizes=(1, 8), context: int = 1024,
                  d_model: int = 256, num_heads: int = 8, layers: int = 1,
                  prompt_len: int = 1, repeats: int = 1,
                  implementation: str | None = None, check_steps: int = 4,
                  command: str | None = None,
                  docs_page: os.PathLike | None = None,
                  shared_prefix: tuple[int, int, int] | None = None,
                  latent: bool = False) -> list[dict]:
  """Checks, times and prints both modes per batch size; returns the rows.

  Rows: ``{batch, mode, prefill_ms, tokens_per_s, ms_per_token, speedup,
  steps, check_max_diff}`` (``speedup`` of cache over recompute on the cache
  row, None on the recompute row). ``shared_prefix`` ``(B, P, G)`` and
  ``latent`` add the tables of ``decode_variants`` to the report (latent
  at the largest batch size).
  """
  if not 1 <= prompt_len < context:
    raise ValueError(f"prompt ({prompt_len}) must be in [1, context "
                     f"{context}): at least one token is generated.")
  steps = context - prompt_len
  # The check is also the warm-up that compiles prefill and step.
  check_steps = min(max(check_steps, 1), steps)
  command = command or "python -m benchmarks.decode"
  load = [host.load_average()]

  def model_fn():  # the same parameters for every mode and batch size
    return Stack(layers, d_model, num_heads, implementation=implementation,
                 rngs=nnx.Rngs(0))

  rows = []
  rng = np.random.default_rng(0)
  for batch in batch_sizes:
    prompt = jnp.asarray(rng.standard_normal((batch, prompt_len, d_model),
                                             np.float32))
    programs = {mode: Programs(mode, model_fn, batch, context, prompt_len,
                               d_model) for mode in MODES}
    diff = check_equal(programs, prompt, check_steps)  # compiles both
    print(f"B={batch}: cache == recompute over the prefill and "
          f"{check_steps} steps (max |diff| {diff:.2g}, tolerance "
          f"{CHECK_TOL})", flush=True)
    timed = {mode: [] for mode in MODES}
    for _ in range(repeats):  # interleaved, so drift hits both alike
      for mode, p in programs.items():
        timed[mode].append(p.generate(prompt, steps)[:2])
    for mode, p in programs.items():
      if dict(p.traces) != {"prefill": 1, "step": 1}:
        raise RuntimeError(f"B={batch} {mode}: traced {dict(p.traces)}, "
                           "expected each program once (a retrace per step "
                           "would time compilation).")
    by_mode = {}
    for mode in MODES:
      prefill_s = statistics.median(t[0] for t in timed[mode])
      decode_s = statistics.median(t[1] for t in timed[mode])
      by_mode[mode] = {
          "batch": batch, "mode": mode, "prefill_ms": 1e3 * prefill_s,
          "tokens_per_s": batch * steps / decode_s,
          "ms_per_token": 1e3 * decode_s / steps, "speedup": None,
          "steps": steps, "check_max_diff": diff}
    by_mode["cache"]["speedup"] = (by_mode["cache"]["tokens_per_s"]
                                   / by_mode["recompute"]["tokens_per_s"])
    rows += [by_mode[mode] for mode in MODES]
    print(table(rows[-2:]), flush=True)
  sections = []
  if shared_prefix:
    b, p, g = shared_prefix
    sp_rows = decode_variants.shared_prefix_rows(
        b, p, g, d_model, num_heads, repeats, check_steps)
    sections.append(decode_variants.shared_prefix_report(sp_rows))
    print(sections[-1], flush=True)
  if latent:
    lat_rows = decode_variants.latent_rows(
        max(batch_sizes), context, d_model, num_heads, prompt_len, repeats,
        check_steps)
    sections.append(decode_variants.latent_report(lat_rows))
    print(sections[-1], flush=True)
  load.append(host.load_average())
  text = report(rows, dict(context=context, d_model=d_model,
                           num_heads=num_heads, layers=layers,
                           prompt_len=prompt_len, repeats=repeats,
                           implementation=implementation, load=load),
                command)
  text = "\n".join([text, *sections])
  print(f"\n{text}", flush=True)
  if docs_page is not None:
    host.replace_section(docs_page, START, END, text)
  return rows


def table(rows: list[dict]) -> str:
  lines = ["| B | mode | prefill (ms) | decode tokens/s | ms/token | "
           "cache speed-up |", "|---|---|---|---|---|---|"]
  for r in rows:
    speedup = "" if r["speedup"] is None else f"{r['speedup']:.1f}x"
    lines.append(f"| {r['batch']} | {r['mode']} | {r['prefill_ms']:.3g} | "
                 f"{r['tokens_per_s']:.4g} | {r['ms_per_token']:.3g} | "
                 f"{speedup} |")
  return "\n".join(lines)


def report(rows: list[dict], config: dict, command: str) -> str:
  """The markdown of one run: where, what, the command, the table."""
  c = config
  impl = c["implementation"] or "automatic"
  runs = ("one generation" if c["repeats"] == 1
          else f"medians of {c['repeats']} generations")
  text = (
      f"Measured on a {machine()}; `{command}`: C={c['context']}, "
      f"D={c['d_model']}, N={c['num_heads']}, {c['layers']} layer(s), "
      f"prompt P={c['prompt_len']}, implementation {impl}, float32; "
      f"{c['context'] - c['prompt_len']} decode steps per generation, "
      f"{runs} per row after a compiling warm-up; 1-minute load average "
      f"{host.format_load(c['load'])} (start, end; other processes share the "
      "cores). tokens/s = B x steps / decode time; ms/token = decode time / "
      "steps (one step gives every sequence of the batch its next token). "
      "The two modes' first outputs agreed before timing (max |diff| "
      f"{max(r['check_max_diff'] for r in rows):.2g}).")
  # Whole words only: a flag or a CPU model name is never split.
  text = textwrap.fill(text, 76, break_long_words=False,
                       break_on_hyphens=False)
  return f"{text}\n\n{table(rows)}\n"


def main(argv):
  del argv
  command = " ".join(["python -m benchmarks.decode", *sys.argv[1:]])
  run_benchmark([int(b) for b in _BATCH_SIZES.value], _CONTEXT.value,
                _D_MODEL.value, _NUM_HEADS.value, _LAYERS.value,
                _PROMPT.value, _REPEATS.value, _IMPLEMENTATION.value,
                _CHECK_STEPS.value, command,
                DOCS_PAGE if _WRITE_DOCS.value else None,
                tuple(int(x) for x in _SHARED_PREFIX.value) or None,
                _LATENT.value)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
