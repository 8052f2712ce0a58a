"""MoBA's block selection against full causal flash attention, at length.

Shape glossary: B batch, N heads, T = S sequence length, H head dim; bq/bk
the flash blocks; c the keys of a MoBA block, nks = T / c of them; k the
blocks a query reads.

One process, one call shape (B1 N8 H64 float32, causal): the full causal
flash call against ``aj.moba_attention`` reading ``k = nks / 8`` of the
blocks (its own included), the gate and the selection computed inside the
timed function, two ways:

- ``rows``: rows of ``c`` queries choose together by their mean query
  (``query_block=c``), so the flash walk (bq x bk = c x 256) reads the
  chosen blocks wholly and nothing else: the selection at query-block
  granularity;
- ``per query``: the paper's gate, each query choosing for itself, so a
  kernel block of queries (128 x 128) visits the union of its queries'
  choices, with the choice evaluated inside each visited block.

Forward and forward + backward (the gradient of ``sum(out)`` w.r.t. q, k,
v), timed in turns (every program once a turn), the median of the turns
reported with the spread of the per-turn ratio. "Blocks visited" is the
kernel blocks the walk visits (non-empty in its tables, averaged over
heads) against those causality leaves. The compiled programs' temporary
memory (XLA's own count, ``memory_analysis``) at each T shows how memory
grows with T.

  python -m benchmarks.sparse                       # T = 8192, 16384
  python -m benchmarks.sparse --lengths=8192,16384 --repeats=5 --write_docs

``--write_docs`` rewrites the table in docs/performance.md.
"""

from __future__ import annotations

import math
import pathlib
import statistics
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.layers import moba
from benchmarks import decode
from benchmarks import host

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "performance.md"
START = "<!-- sparse-benchmark:start -->"
END = "<!-- sparse-benchmark:end -->"
# The ways of choosing: name -> (query_block (0: the MoBA block), the
# flash blocks (0: the MoBA block)): rows walk blocks of a row by 256 keys,
# as the full call; per query moba_attention's defaults, 128 x 128.
WAYS = {"rows": (0, 0, 256), "per query": (1, 128, 128)}


def _options(way: str, block: int):
  """``moba_attention``'s ``query_block``, ``block_q`` and ``block_k``."""
  query_block, block_q, block_k = WAYS[way]
  return dict(query_block=query_block or block,
              block_q=min(block_q or block, block),
              block_k=math.gcd(block_k, block))


def programs(*, block: int, top_k: int, ways):
  """``{name: jitted fn(q, k, v)}``: the full call and each way, forward
  and forward + backward."""
  flash = aj.kernels.Flash(block_q=block, block_k=math.gcd(256, block))

  def full(q, k, v):
    return aj.scaled_dot_product_attention(q, k, v, aj.Mask(causal=True),
                                           implementation=flash)

  def chosen(way):
    def fn(q, k, v):
      return aj.moba_attention(q, k, v, block=block, top_k=top_k,
                               implementation="flash",
                               **_options(way, block))
    return fn

  def both(fn):
    return jax.grad(lambda q, k, v: fn(q, k, v).sum(), argnums=(0, 1, 2))

  calls = {"full": full} | {way: chosen(way) for way in ways}
  fns = {}
  for name, fn in calls.items():
    fns[(name, "fwd")] = jax.jit(fn)
    fns[(name, "fwd+bwd")] = jax.jit(both(fn))
  return fns


def visited_share(q, k, *, block: int, top_k: int, way: str) -> float:
  """Kernel blocks the walk visits (its tables' non-empty ones, mean over
  heads) over those causality leaves."""
  t = q.shape[2]
  opts = _options(way, block)
  chosen = moba.moba_selection(q, k, block=block, top_k=top_k,
                               query_block=opts["query_block"])
  bq, bk = opts["block_q"], opts["block_k"]
  sel = aj.select_blocks(chosen, q_len=t, kv_len=t, key_block=block,
                         query_block=opts["query_block"], block_q=bq,
                         block_k=bk)
  rows = np.arange(t // bq)
  causal = ((rows + 1) * bq - 1) // bk + 1  # key blocks up to the diagonal
  cols = np.arange(t // bk)
  inside = cols[None, :] < causal[:, None]
  visited = (np.asarray(sel.kinds) != aj.kernels.base.intervals.EMPTY)
  return float((visited & inside).sum(axis=(-2, -1)).mean() / inside.sum())


def run(lengths, *, heads=8, head_dim=64, block=512, fraction=8, repeats=5,
        ways=tuple(WAYS)):
  rows = []
  for t in lengths:
    nks = t // block
    top_k = max(1, nks // fraction)
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (1, heads, t, head_dim), jnp.float32)
               for key in keys)
    fns = programs(block=block, top_k=top_k, ways=ways)
    temp = {}
    for name, fn in fns.items():
      compiled = fn.lower(q, k, v).compile()
      analysis = compiled.memory_analysis()
      temp[name] = getattr(analysis, "temp_size_in_bytes", None)
      jax.block_until_ready(fn(q, k, v))  # warm-up, untimed
    times = {name: [] for name in fns}
    for _ in range(repeats):  # in turns: load shifts hit every call alike
      for name, fn in fns.items():
        start = time.perf_counter()
        jax.block_until_ready(fn(q, k, v))
        times[name].append(time.perf_counter() - start)
    for way in ways:
      row = dict(t=t, way=way, top_k=top_k, nks=nks, temp=temp,
                 share=visited_share(q, k, block=block, top_k=top_k,
                                     way=way))
      for part in ("fwd", "fwd+bwd"):
        full, mine = times[("full", part)], times[(way, part)]
        ratios = [m / f for m, f in zip(mine, full)]
        row[part] = (statistics.median(full), statistics.median(mine),
                     statistics.median(mine) / statistics.median(full),
                     min(ratios), max(ratios))
      rows.append(row)
  return rows


def table(rows, *, heads, head_dim, block, repeats) -> str:
  lines = [
      f"B1 N{heads} H{head_dim} float32, causal; `aj.moba_attention` with "
      f"blocks of {block} keys, 1/8 of them read per query (its own "
      f"included), the gate and the selection computed in the timed call; "
      f"rows: {block} queries choose together (`query_block={block}`, flash "
      f"blocks {block} x 256, as the full call's); per query: the paper's "
      f"gate (flash blocks 128 x 128). Median of {repeats} turns (min-max "
      f"of the per-turn ratio in brackets). Machine: {decode.machine()}; "
      f"load average {host.format_load([host.load_average()])}.",
      "",
      "| T | MoBA choice | kernel blocks visited / causal | full fwd s | "
      "MoBA fwd s | ratio | full fwd+bwd s | MoBA fwd+bwd s | ratio | temp "
      "MiB full / MoBA (fwd+bwd) |",
      "|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    mib = lambda x: "n/a" if x is None else f"{x / 2**20:.0f}"  # noqa: E731
    cells = []
    for part in ("fwd", "fwd+bwd"):
      full, mine, ratio, low, high = r[part]
      cells.append(f"{full:.2f} | {mine:.2f} | {ratio:.2f} ({low:.2f}-"
                   f"{high:.2f})")
    lines.append(
        f"| {r['t']} | {r['way']}: top {r['top_k']} of {r['nks']} | "
        f"{r['share']:.2f} | {cells[0]} | {cells[1]} | "
        f"{mib(r['temp'][('full', 'fwd+bwd')])} / "
        f"{mib(r['temp'][(r['way'], 'fwd+bwd')])} |")
  return "\n".join(lines) + "\n"


def _define_flags():
  """The command line's flags, defined only when run as a program (other
  benchmarks define flags of the same names; the tests import several)."""
  global _LENGTHS, _REPEATS, _HEADS, _HEAD_DIM, _BLOCK, _WAYS, _WRITE_DOCS
  _LENGTHS = flags.DEFINE_list("lengths", ["8192", "16384"], "T values.")
  _REPEATS = flags.DEFINE_integer("repeats", 5, "Timed turns.",
                                  lower_bound=1)
  _HEADS = flags.DEFINE_integer("heads", 8, "N.")
  _HEAD_DIM = flags.DEFINE_integer("head_dim", 64, "H.")
  _BLOCK = flags.DEFINE_integer("block", 512, "MoBA's block of keys.")
  _WAYS = flags.DEFINE_multi_enum("ways", list(WAYS), list(WAYS),
                                  "The ways of choosing to time.")
  _WRITE_DOCS = flags.DEFINE_bool(
      "write_docs", False, "Rewrite the table in docs/performance.md.")


def main(argv):
  del argv
  kw = dict(heads=_HEADS.value, head_dim=_HEAD_DIM.value, block=_BLOCK.value)
  rows = run([int(x) for x in _LENGTHS.value], repeats=_REPEATS.value,
             ways=tuple(_WAYS.value), **kw)
  text = table(rows, repeats=_REPEATS.value, **kw)
  print(text)
  if _WRITE_DOCS.value:
    host.replace_section(DOC, START, END, text)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
