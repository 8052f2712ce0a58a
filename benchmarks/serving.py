"""Decode-step attention for serving: ``python -m benchmarks.serving``.

Flags are prefixed ``--serving_`` (other benchmarks share absl's flags).
Two tables, one process, each row a median of ``--serving_repeats`` timed
calls after a compiling one, the rows of a table timed in turns (outputs
checked against each other first):

* **one query**: one query per sequence (``B=1``) over ``S`` keys, the
  keys in one linear buffer: the dense kernel (one ``[1, S]`` row) and the
  flash kernel's single walk; ratio to the single walk.
* **paged vs linear**: a decode step of ``B`` sequences at the same lengths
  (``--lengths``), through ``aj.paged_attention`` (pages of ``Z`` tokens,
  each sequence's pages scattered over the pool; the automatic choice, a
  page per flash key block, and blocks of 8 pages) and over
  a linear ``[B, K, L, H]`` cache with the same mask at positions (the
  automatic choice and the flash kernel); ratio to the linear automatic
  choice.

Shape glossary: B sequences, N query heads, K key/value heads, H head dim,
S keys, Z page size, L linear cache slots.
"""

from __future__ import annotations

import platform
import statistics
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj

_KEYS = flags.DEFINE_list("serving_keys", ["8192", "32768"],
                          "one query: key counts S.")
_BATCH = flags.DEFINE_integer("serving_batch", 8, "paged vs linear: sequences B.")
_LENGTHS = flags.DEFINE_list("serving_lengths", ["1024", "4096"],
                             "paged vs linear: each sequence's length.")
_PAGE = flags.DEFINE_integer("serving_page_size", 256, "paged: tokens per page Z.")
_HEADS = flags.DEFINE_integer("serving_heads", 8, "query heads N.")
_KV_HEADS = flags.DEFINE_integer("serving_kv_heads", 2, "key/value heads K.")
_HEAD_DIM = flags.DEFINE_integer("serving_head_dim", 64, "head dim H.")
_REPEATS = flags.DEFINE_integer("serving_repeats", 7, "timed calls per row.")


def _time(fns: dict, repeats: int) -> dict:
  """``{name: median seconds}`` of ``repeats`` calls of each ``(fn, args)``
  (after one that compiles), taken in turns (one call of each per round):
  drift of a shared machine's speed lands on every row alike, not on
  whichever ran during it."""
  for fn, args in fns.values():
    jax.block_until_ready(fn(*args))
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, (fn, args) in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[name].append(time.perf_counter() - start)
  return {name: statistics.median(t) for name, t in times.items()}


def one_query_rows(s: int, *, n: int, k: int, h: int, repeats: int):
  """``[(name, seconds, ratio to the single walk)]`` for one query over
  ``s`` keys."""
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((1, n, 1, h)), jnp.float32)
  kv = jnp.asarray(rng.standard_normal((2, 1, k, s, h)), jnp.float32)
  mask = aj.Mask(causal=True)
  impls = {"dense (one row)": "dense", "flash (one walk)": "flash"}
  fns = {name: jax.jit(lambda q, kv, impl=impl: aj.scaled_dot_product_attention(
      q, kv[0], kv[1], mask, implementation=impl)) for name, impl in
         impls.items()}
  want = fns["dense (one row)"](q, kv)
  for name, fn in fns.items():  # a fast wrong answer is worthless
    np.testing.assert_allclose(fn(q, kv), want, atol=1e-5, rtol=1e-5,
                               err_msg=name)
  times = _time({name: (fn, (q, kv)) for name, fn in fns.items()}, repeats)
  walk = times["flash (one walk)"]
  return [(name, t, t / walk) for name, t in times.items()]


def paged_rows(b: int, length: int, z: int, *, n: int, k: int, h: int,
               repeats: int):
  """``[(name, seconds, ratio to the linear cache's automatic choice)]``:
  one decode step of ``b`` sequences of ``length`` tokens, paged and
  linear."""
  rng = np.random.default_rng(1)
  m = -(-length // z) + 1  # room for the step's token
  p = b * m
  keys = rng.standard_normal((b, k, length, h)).astype(np.float32)
  values = rng.standard_normal((b, k, length, h)).astype(np.float32)
  cache = aj.init_paged_cache(p, z, k, h, batch_size=b, max_pages=m)
  # Scatter the sequences over the pool: write them round-robin in chunks.
  for start in range(0, length, z):
    chunk = slice(start, min(start + z, length))
    cache = aj.paged_cache.append(cache, jnp.asarray(keys[:, :, chunk]),
                                  jnp.asarray(values[:, :, chunk]))
  q = jnp.asarray(rng.standard_normal((b, n, 1, h)), jnp.float32)
  lengths = jnp.full((b,), length, jnp.int32)
  slots = m * z
  pad = [(0, 0), (0, 0), (0, slots - length), (0, 0)]
  lin_k, lin_v = (jnp.asarray(np.pad(x, pad)) for x in (keys, values))
  mask = aj.Mask(causal=True, kv_lengths=lengths, q_offset=lengths - 1,
                 kv_offset=jnp.zeros_like(lengths))
  def paged(kernel):
    return jax.jit(lambda q, c: aj.paged_attention(
        q, c, aj.Mask(causal=True), implementation=kernel)), (q, cache)

  def linear(kernel):
    return jax.jit(lambda q, k_, v_: aj.scaled_dot_product_attention(
        q, k_, v_, mask, implementation=kernel)), (q, lin_k, lin_v)

  fns = {
      "linear (automatic)": linear(None),
      "linear (flash)": linear("flash"),
      "paged (automatic: one page per key block)": paged(None),
      "paged (flash, 8 pages per key block)": paged(
          aj.kernels.Flash(block_k=8 * z)),
  }
  want = fns["linear (automatic)"][0](*fns["linear (automatic)"][1])
  for name, (fn, args) in fns.items():
    np.testing.assert_allclose(fn(*args), want, atol=1e-5, rtol=1e-5,
                               err_msg=name)
  times = _time(fns, repeats)
  base = times["linear (automatic)"]
  return [(name, t, t / base) for name, t in times.items()]


def _table(header, rows) -> str:
  lines = ["| " + " | ".join(header) + " |",
           "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(r) + " |" for r in rows]
  return "\n".join(lines)


def main(argv):
  del argv
  n, k, h = _HEADS.value, _KV_HEADS.value, _HEAD_DIM.value
  print(f"{platform.processor() or platform.machine()}, "
        f"{jax.devices()[0].device_kind}, jax {jax.__version__}; "
        f"N={n} K={k} H={h} float32, medians of {_REPEATS.value}")
  rows = []
  for s in map(int, _KEYS.value):
    for name, t, ratio in one_query_rows(s, n=n, k=k, h=h,
                                         repeats=_REPEATS.value):
      rows.append((str(s), name, f"{t * 1e3:.2f}", f"{ratio:.2f}"))
  print("\nOne query over S keys (B=1):\n")
  print(_table(("S", "kernel", "ms", "/ one walk"), rows))
  rows = []
  for length in map(int, _LENGTHS.value):
    for name, t, ratio in paged_rows(_BATCH.value, length, _PAGE.value, n=n,
                                     k=k, h=h, repeats=_REPEATS.value):
      rows.append((str(length), name, f"{t * 1e3:.2f}", f"{ratio:.2f}"))
  print(f"\nA decode step, B={_BATCH.value} sequences at equal lengths, "
        f"Z={_PAGE.value}:\n")
  print(_table(("length", "cache", "ms", "/ linear (automatic)"), rows))


if __name__ == "__main__":
  app.run(main)
