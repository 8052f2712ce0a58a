"""Block-sparse attention from data against full causal flash attention.

Shape glossary: B batch, N heads, T = S sequence length, H head dim; bq/bk
the flash blocks; nq = T / bq query blocks, nk = S / bk key blocks; k the
key blocks each query block reads.

One process, one call shape (B1 N8 H64 float32, causal, the flash kernel
at bq x bk blocks): the full causal call against the same call whose
mask holds a selection computed inside the timed function (a MoBA-style
gate at query-block granularity: each query block's mean query against
each key block's mean key, top-k among the past blocks, its own block
always), so the times include the selection. Forward and forward +
backward (the gradient of ``sum(out)`` w.r.t. q, k, v), timed in turns
(full, selected, full, ...), the median of the repeats reported with the
spread. The compiled programs' temporary memory (XLA's own count,
``memory_analysis``) at each T shows how memory grows with T.

  python -m benchmarks.sparse                       # T = 4096, 16384
  python -m benchmarks.sparse --lengths=16384 --repeats=3 --write_docs

``--write_docs`` rewrites the table in docs/performance.md.
"""

from __future__ import annotations

import pathlib
import statistics
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

import attention_jax as aj
from benchmarks import decode
from benchmarks import host

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "performance.md"
START = "<!-- sparse-benchmark:start -->"
END = "<!-- sparse-benchmark:end -->"


def block_gate_selection(q, k, *, block_q: int, block_k: int, top_k: int):
  """``aj.select_blocks`` of each query block's top-``top_k`` key blocks by
  ``mean(Q_block) . mean(K_block)`` (past blocks only, its own block
  always): bool ``[B, N, nq, nk]`` tables, no ``[T, S]`` array."""
  b, n, t, h = q.shape
  s = k.shape[-2]
  nq, nk = t // block_q, s // block_k
  q_mean = q.reshape(b, n, nq, block_q, h).mean(-2)  # [B, N, nq, H]
  k_mean = k.reshape(b, k.shape[1], nk, block_k, h).mean(-2)  # [B, K, nk, H]
  k_mean = jnp.repeat(k_mean, n // k.shape[1], axis=1)
  gate = jnp.einsum("BNQH,BNKH->BNQK", q_mean, k_mean)  # [B, N, nq, nk]
  # Query block i ends at key (i + 1) * bq - 1 (S = T): key blocks that
  # start after it are the future; the block holding that key is its own.
  last = ((jnp.arange(nq) + 1) * block_q - 1) // block_k  # [nq]
  cols = jnp.arange(nk)
  gate = jnp.where(cols[None, :] > last[:, None], -jnp.inf, gate)
  gate = jnp.where(cols[None, :] == last[:, None], jnp.inf, gate)
  chosen = aj.top_k_mask(gate, top_k)
  return aj.select_blocks(chosen, q_len=t, kv_len=s, key_block=block_k,
                          query_block=block_q, block_q=block_q,
                          block_k=block_k)


def programs(t: int, *, heads: int, head_dim: int, block_q: int,
             block_k: int, top_k: int):
  """``{name: jitted fn(q, k, v)}`` for the four timed calls."""
  flash = aj.kernels.Flash(block_q=block_q, block_k=block_k)

  def full(q, k, v):
    return aj.scaled_dot_product_attention(q, k, v, aj.Mask(causal=True),
                                           implementation=flash)

  def selected(q, k, v):
    sel = block_gate_selection(q, k, block_q=block_q, block_k=block_k,
                               top_k=top_k)
    return aj.scaled_dot_product_attention(
        q, k, v, aj.Mask(causal=True, rule=sel), implementation=flash)

  def both(fn):
    return jax.grad(lambda q, k, v: fn(q, k, v).sum(), argnums=(0, 1, 2))

  del t, heads, head_dim
  return {"full fwd": jax.jit(full), "selected fwd": jax.jit(selected),
          "full fwd+bwd": jax.jit(both(full)),
          "selected fwd+bwd": jax.jit(both(selected))}


def visited_share(t: int, block_q: int, block_k: int, top_k: int) -> float:
  """The selected blocks' share of the causal ones (per query block)."""
  nq = t // block_q
  causal = [((i + 1) * block_q - 1) // block_k + 1 for i in range(nq)]
  return sum(min(top_k, c) for c in causal) / sum(causal)


def run(lengths, *, heads=8, head_dim=64, block_q=512, block_k=256,
        fraction=8, repeats=3):
  rows = []
  for t in lengths:
    nk = t // block_k
    top_k = max(1, nk // fraction)
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (1, heads, t, head_dim), jnp.float32)
               for key in keys)
    fns = programs(t, heads=heads, head_dim=head_dim, block_q=block_q,
                   block_k=block_k, top_k=top_k)
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
    med = {n: statistics.median(x) for n, x in times.items()}
    rows.append(dict(
        t=t, top_k=top_k, nk=nk, share=visited_share(t, block_q, block_k,
                                                     top_k),
        times=times, median=med, temp=temp,
        fwd_ratio=med["selected fwd"] / med["full fwd"],
        both_ratio=med["selected fwd+bwd"] / med["full fwd+bwd"],
        ratios=[s / f for s, f in zip(times["selected fwd+bwd"],
                                      times["full fwd+bwd"])]))
  return rows


def table(rows, *, heads, head_dim, block_q, block_k, repeats) -> str:
  lines = [
      f"B1 N{heads} H{head_dim} float32, causal, flash blocks {block_q} x "
      f"{block_k}; selected: 1/8 of the key blocks per query block (its "
      f"own included), the selection computed in the timed call; median of "
      f"{repeats} turns (min-max of the per-turn ratio in brackets). "
      f"Machine: {decode.machine()}; load average "
      f"{host.format_load([host.load_average()])}.",
      "",
      "| T | blocks read / causal | full fwd s | selected fwd s | ratio | "
      "full fwd+bwd s | selected fwd+bwd s | ratio | temp MiB full / "
      "selected (fwd+bwd) |",
      "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    m = r["median"]
    mib = lambda x: "n/a" if x is None else f"{x / 2**20:.0f}"  # noqa: E731
    fwd = [s / f for s, f in zip(r["times"]["selected fwd"],
                                 r["times"]["full fwd"])]
    lines.append(
        f"| {r['t']} | {r['top_k']}/{r['nk']} blocks, {r['share']:.2f} of "
        f"causal | {m['full fwd']:.2f} | {m['selected fwd']:.2f} | "
        f"{r['fwd_ratio']:.2f} ({min(fwd):.2f}-{max(fwd):.2f}) | "
        f"{m['full fwd+bwd']:.2f} | {m['selected fwd+bwd']:.2f} | "
        f"{r['both_ratio']:.2f} ({min(r['ratios']):.2f}-"
        f"{max(r['ratios']):.2f}) | {mib(r['temp']['full fwd+bwd'])} / "
        f"{mib(r['temp']['selected fwd+bwd'])} |")
  return "\n".join(lines) + "\n"


_LENGTHS = flags.DEFINE_list("lengths", ["4096", "16384"], "T values.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed turns.", lower_bound=1)
_HEADS = flags.DEFINE_integer("heads", 8, "N.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 64, "H.")
_BLOCK_Q = flags.DEFINE_integer("block_q", 512, "Flash query block.")
_BLOCK_K = flags.DEFINE_integer("block_k", 256, "Flash key block.")
_WRITE_DOCS = flags.DEFINE_bool("write_docs", False,
                                "Rewrite the table in docs/performance.md.")


def main(argv):
  del argv
  kw = dict(heads=_HEADS.value, head_dim=_HEAD_DIM.value,
            block_q=_BLOCK_Q.value, block_k=_BLOCK_K.value)
  rows = run([int(x) for x in _LENGTHS.value], repeats=_REPEATS.value, **kw)
  text = table(rows, repeats=_REPEATS.value, **kw)
  print(text)
  if _WRITE_DOCS.value:
    host.replace_section(DOC, START, END, text)


if __name__ == "__main__":
  app.run(main)
