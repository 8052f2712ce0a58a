"""Floor of a blockwise forward on XLA:CPU: ``python -m benchmarks.blockwise_bound``.

Times, interleaved, medians of ``--repeats``, fp32, ``[B, N, T, H]`` =
``[4, 8, T, 64]``, not causal:

* ``blockwise``: ``aj.blockwise_attention`` forward;
* ``dots_only``: the same loop structure (``lax.map`` over query blocks,
  ``fori_loop`` over key blocks, the same block sizes) doing only the two
  matmuls per block (``q k^T``, then ``s v``), no softmax at all — a lower
  bound for any blockwise forward XLA:CPU runs this way, since XLA does not
  fuse the exp/max/sum passes into its dot kernels;
* ``softmax_only``: the loop with the per-block softmax passes and no dots;
* ``torch``: ``torch.nn.functional.scaled_dot_product_attention`` (fused C++
  kernel) when torch is importable.

If ``dots_only`` alone exceeds the target multiple of torch's time, no
rearrangement of the pure-JAX program reaches that target on this backend.
"""

from __future__ import annotations

import statistics
import time

from absl import app
from absl import flags
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj

_T = flags.DEFINE_integer("t", 2048, "T = S.", lower_bound=64)
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed runs each.",
                                lower_bound=1)
_BQ = flags.DEFINE_integer("block_q", 1024, "Query block.", lower_bound=1)
_BK = flags.DEFINE_integer("block_k", 256, "Key block.", lower_bound=1)


def _loop(q, k, v, bq, bk, body):
  """``lax.map`` over query blocks of a ``fori_loop`` over key blocks."""
  t = q.shape[2]

  def query_block(i):
    qi = lax.dynamic_slice_in_dim(q, i * bq, bq, axis=2)  # [B, N, bq, H]

    def key_block(j, acc):
      kj = lax.dynamic_slice_in_dim(k, j * bk, bk, axis=2)
      vj = lax.dynamic_slice_in_dim(v, j * bk, bk, axis=2)
      return body(qi, kj, vj, acc)

    acc = jnp.zeros(qi.shape, jnp.float32)
    return lax.fori_loop(0, t // bk, key_block, acc)

  return lax.map(query_block, jnp.arange(t // bq))


def _dots(qi, kj, vj, acc):
  s = jnp.einsum("BNTH,BNSH->BNTS", qi, kj)  # [B, N, bq, bk]
  return acc + jnp.einsum("BNTS,BNSH->BNTH", s, vj)


def _softmax(qi, kj, vj, acc):
  del vj
  # Stand-in scores of the block's shape built without a matmul.
  s = qi[..., :1] * kj[..., 0][:, :, None, :]  # [B, N, bq, bk]
  m = jnp.max(s, -1)
  p = jnp.exp(s - m[..., None])
  return acc * jnp.exp(m)[..., None] * 0.5 + p.sum(-1)[..., None]


def main(argv):
  del argv
  t, bq, bk = _T.value, min(_BQ.value, _T.value), min(_BK.value, _T.value)
  rng = np.random.default_rng(0)
  arrays = [rng.standard_normal((4, 8, t, 64), dtype=np.float32)
            for _ in range(3)]
  q, k, v = (jnp.asarray(a) for a in arrays)
  fns = {
      "blockwise": jax.jit(lambda q, k, v: aj.blockwise_attention(
          q, k, v, block_q=bq, block_k=bk)),
      "dots_only": jax.jit(lambda q, k, v: _loop(q, k, v, bq, bk, _dots)),
      "softmax_only": jax.jit(lambda q, k, v: _loop(q, k, v, bq, bk,
                                                    _softmax)),
  }
  calls = {name: (lambda f=f: jax.block_until_ready(f(q, k, v)))
           for name, f in fns.items()}
  try:
    import torch  # noqa: PLC0415 - optional peer

    tq, tk, tv = (torch.from_numpy(a) for a in arrays)
    calls["torch"] = lambda: torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv)
  except ImportError:
    pass
  times = {name: [] for name in calls}
  for call in calls.values():
    call()  # compile / warm up
  for _ in range(_REPEATS.value):
    for name, call in calls.items():
      start = time.perf_counter()
      call()
      times[name].append(time.perf_counter() - start)
  med = {name: statistics.median(ts) for name, ts in times.items()}
  base = med.get("torch")
  print(f"B=4 N=8 T=S={t} H=64 fp32 forward, blocks {bq}x{bk}, medians of "
        f"{_REPEATS.value} ({jax.devices()[0].device_kind})")
  print("| program | seconds | x torch |\n|---|---|---|")
  for name, sec in med.items():
    ratio = f"{sec / base:.2f}" if base else "-"
    print(f"| {name} | {sec:.3f} | {ratio} |")


if __name__ == "__main__":
  app.run(main)
