"""Split-KV (flash-decoding): the keys cut into chunks attended in parallel,
then merged by their log-sum-exps.

Shape glossary: C chunks (``splits``), T query length, S key/value length,
Sc = S / C keys per chunk, Z page size, M pages per sequence; ``...``
leading dims.

One query row over many keys is one long sequential walk in a flash
kernel: on a GPU it fills one block of the machine and leaves the rest
idle. ``SplitKV(inner, splits)`` runs ``inner`` (any kernel) on ``C``
chunks of the keys at once (``vmap``: a batch axis the inner kernel
parallelises like heads) and merges them exactly
(``core.merge.merge_attentions``; a sink is one more part with output 0).
Each chunk is the call's own problem restricted to its keys: the keys,
values and every per-key array (a dense mask's and a bias's columns, key
segment ids) sliced, the key lengths and positions shifted by the chunk's
start (``kv_offset + c * Sc``), so causality, windows, rules and score
modifiers see the same positions; a paged call's chunks are runs of its
page table. Chunk sizes are whole pages for a paged call; keys past ``S``
pad the last chunk and are hidden by the key lengths.

What it refuses, by name: dropout and the weights (a chunk's are not the
row's), a block mask's tables (built for the whole key axis: pass the
rule), and a bottom-right call with ``T != S`` and a score modifier or a
rule (a chunk is placed by positions; give the mask
``q_offset``/``kv_offset``, which the decoding paths do). It implements
what ``inner`` implements, less those.

The automatic choice does not pick it: on this CPU a split walk was
measured slower than one walk (``benchmarks/split_kv.py``: XLA:CPU runs the
vmapped chunks one after another, so splitting adds the merge and gains no
parallelism), and it has not run on a GPU or TPU yet.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from attention_jax.core import broadcast
from attention_jax.core import grouping
from attention_jax.core import merge
from attention_jax.kernels import base
from attention_jax.kernels import flash


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


@dataclasses.dataclass(frozen=True)
class SplitKV(base.Kernel):
  """``inner`` over ``splits`` chunks of the keys, merged (module doc)."""
  splits: int = 8
  inner: Any = dataclasses.field(default_factory=flash.Flash)
  name = "split_kv"

  def __post_init__(self):
    base.check_block_size("splits", self.splits)
    if not isinstance(self.inner, base.Kernel):
      raise TypeError(f"SplitKV's inner must be an aj.kernels kernel "
                      f"instance (e.g. aj.kernels.Flash()), got "
                      f"{self.inner!r}.")

  @property
  def implements(self) -> frozenset[str]:  # what its inner kernel does
    return self.inner.implements - {"dropout_rate", "return_weights"}

  @property
  def partitionable(self) -> bool:  # XLA splits it where it splits inner
    return self.inner.partitionable

  @property
  def forward_mode(self) -> bool:  # the merge is plain JAX: as inner
    return self.inner.forward_mode

  def supports(self, problem: base.Problem) -> str | None:
    ops = problem.ops
    bm = ops.block_mask
    if bm is not None and bm.kinds is not None:
      return ("it cuts the keys into chunks, so a BlockMask's tables (built "
              "for the whole key axis) do not apply: pass the rule itself")
    t, s = ops.query.shape[-2], ops.key.shape[-2]
    if not ops.positioned and t != s and (ops.score_mod is not None
                                          or bm is not None):
      # A chunk is placed by positions (kv_offset + its start); the rows of
      # a bottom-right call with T != S stand at r + S - T for causality
      # but at r for a score modifier or rule, which positions cannot say.
      return ("a chunk's keys stand at positions: a bottom-right call with "
              "T != S and a score modifier or rule needs the mask's "
              "q_offset/kv_offset (e.g. q_offset=S - T, kv_offset=0; the "
              "decoding paths give them)")
    return self.inner.supports(self._chunk_problem(problem))

  def declines(self, problem: base.Problem) -> str | None:
    del problem
    return ("on CPU one walk was measured faster than split chunks "
            "(benchmarks/split_kv.py), and it has not run on a GPU or TPU")

  def _chunks(self, problem: base.Problem) -> tuple[int, int]:
    """``(C, Sc)``: chunks and keys per chunk (whole pages when paged)."""
    s = problem.ops.key.shape[-2]
    if problem.pages is not None:
      z = problem.pages.page_size
      per = _cdiv(s // z, self.splits) * z
    else:
      per = _cdiv(s, self.splits)
    return _cdiv(s, per), per

  def _chunk_problem(self, problem: base.Problem) -> base.Problem:
    """The problem one chunk runs (shapes only matter here)."""
    _, per = self._chunks(problem)
    ops = problem.ops
    key = jax.ShapeDtypeStruct(ops.key.shape[:-2] + (per, ops.key.shape[-1]),
                               ops.key.dtype)
    value = jax.ShapeDtypeStruct(
        ops.value.shape[:-2] + (per, ops.value.shape[-1]), ops.value.dtype)
    return problem._replace(ops=ops._replace(key=key, value=value))

  def __call__(self, problem: base.Problem):
    ops, pages = problem.ops, problem.pages
    s, t = ops.key.shape[-2], ops.query.shape[-2]
    count, per = self._chunks(problem)
    starts = jnp.arange(count, dtype=jnp.int32) * per  # [C]

    def split_keys(x, axis, pad_value, per=per):
      """``x``'s key axis padded to ``C * per`` and cut: ``[C, ...]``."""
      if x is None or x.shape[axis] == 1:
        return None if x is None else jnp.broadcast_to(x, (count,) + x.shape)
      axis %= x.ndim
      pad = [(0, 0)] * x.ndim
      pad[axis] = (0, count * per - x.shape[axis])
      x = jnp.pad(x, pad, constant_values=pad_value)
      x = x.reshape(x.shape[:axis] + (count, per) + x.shape[axis + 1:])
      return jnp.moveaxis(x, axis, 0)

    lengths = ops.kv_lengths
    if lengths is None:  # the padding of the last chunk is hidden
      lengths = jnp.full((1,) * len(ops.batch_shape), s, jnp.int32)
    if ops.positioned:
      q_offset, kv_offset = ops.q_offset, ops.kv_offset
    else:  # bottom-right: query row r stands at key column r + S - T
      # (with a score modifier or rule, T == S: q_idx = r, kv_idx = c)
      q_offset = jnp.full((1,) * len(ops.batch_shape), s - t, jnp.int32)
      kv_offset = jnp.zeros_like(q_offset)
    arrays = dict(
        mask=split_keys(ops.mask, -1, False),
        bias=split_keys(ops.bias, -1, 0.0),
        k_seg=None if ops.k_seg is None else split_keys(
            ops.k_seg, -1, 0),  # (past the lengths: never compared)
        kv_lengths=jnp.clip(lengths[None] - starts.reshape(
            (count,) + (1,) * lengths.ndim), 0, per),
        kv_offset=kv_offset[None] + starts.reshape(
            (count,) + (1,) * kv_offset.ndim))
    if pages is None:
      arrays["key"] = split_keys(ops.key, -2, 0)
      arrays["value"] = split_keys(ops.value, -2, 0)
    else:  # runs of the page table; no page past the last
      arrays["table"] = split_keys(pages.table, 1, pages.key_pages.shape[0],
                                   per // pages.page_size)  # [C, B, M / C]
    chunk = self._chunk_problem(problem)

    def one(arrays):
      o = chunk.ops._replace(
          mask=arrays["mask"], bias=arrays["bias"], k_seg=arrays["k_seg"],
          kv_lengths=arrays["kv_lengths"], q_offset=q_offset,
          kv_offset=arrays["kv_offset"], sinks=None)
      if pages is None:
        o = o._replace(key=arrays["key"], value=arrays["value"])
      p = chunk._replace(ops=o, return_lse=True, pages=None if pages is None
                         else pages._replace(table=arrays["table"]))
      r = self.inner(p)
      return r.out, r.lse, r.max_logits

    outs, lses, maxes = jax.vmap(one)(arrays)  # [C, ..., N, T, ...]
    # A row that saw a NaN or inf in a chunk (its output, or its lse for a
    # key) is poisoned after the merge, which sees the chunk as clean: its
    # gradient then reaches no chunk (0 * NaN would, through the weights).
    out_bad = ~jnp.all(jnp.isfinite(outs), axis=-1)  # [C, ..., T]
    lse_bad = jnp.isnan(lses) | (lses == jnp.inf)
    outs = jnp.where(out_bad[..., None], jnp.zeros((), outs.dtype), outs)
    lses = jnp.where(lse_bad, -jnp.inf, lses)
    parts_out, parts_lse = list(outs), list(lses)
    if ops.sinks is not None:  # a sink is a part with output 0
      sinks = grouping.merge(ops.sinks, ops.groups, -1)
      parts_out.append(jnp.zeros_like(outs[0]))
      parts_lse.append(jnp.broadcast_to(
          sinks[..., None].astype(lses.dtype), lses.shape[1:]))
    out, lse = merge.merge_attentions(parts_out, parts_lse)
    if ops.q_lengths is not None:  # rows past them are not queries
      q_lengths = grouping.merge(ops.q_lengths, ops.groups, -1)
      rows = jnp.arange(t)[(None,) * q_lengths.ndim] < q_lengths[..., None]
      rows = jnp.broadcast_to(rows, lse.shape)  # [..., N, T]
      lse = jnp.where(rows, lse, -jnp.inf)
      out = jnp.where(rows[..., None], out, jnp.zeros((), out.dtype))
    out = jnp.where(jnp.any(out_bad, 0)[..., None], jnp.nan, out)
    lse = jnp.where(jnp.any(lse_bad, 0), jnp.nan, lse)
    max_logits = None if maxes is None else jnp.max(maxes, axis=0)
    return broadcast.Result(out.astype(problem.out_dtype), None,
                            lse if problem.return_lse else None, max_logits)
