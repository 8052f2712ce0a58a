"""Rewriting what a paged cache's sequences hold: keep some slots, drop the rest.

Shape glossary: B sequences, K key/value heads, Z tokens per page, P pages
in the pool, M pages a sequence may hold, A slots a call keeps per sequence,
H (Hv) key (value) head dim.

Two serving techniques edit a sequence's tail after it was written:

- **Speculative decoding** appends a tree of drafted tokens, verifies them
  in one call, and keeps only the accepted path: its nodes move to the
  slots right after the prefix, in path order, and the rest is dropped.
- **KV eviction** keeps a budget of each sequence's (or each KV head's)
  most useful slots and compacts them to the front, so the pages past the
  budget return to the pool.

Both are ``move_slots``: slot ``start[b] + j`` of sequence ``b`` takes
what slot ``source[b, j]`` held (``j < count[b]``; per KV head with
``source [B, K, A]``), the sequence's length becomes ``start + count``, and
every page past the new length goes back to the pool (free when its last
holder lets go). Keys keep the rotary positions they were written at: a
moved key is the same vector, so the caller decodes on at the original
positions (``positions=`` of the next step), not at the new slots.

A page another sequence also holds (``share_prefix``) is never written in
place: a sequence whose move would write into one moves nothing, keeps its
length and raises its ``overflow`` flag (``check_overflow`` then names it);
with concrete arguments it is a ValueError at once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
import numpy as np

from attention_jax.core import traced_checks
from attention_jax.decoding import paged_cache


def move_slots(cache: paged_cache.PagedKVCache, start: ArrayLike,
               source: ArrayLike, count: ArrayLike
               ) -> paged_cache.PagedKVCache:
  """Keeps ``count[b]`` slots of sequence ``b``, moved to ``start[b]`` on.

  Args:
    cache: the paged cache.
    start: int ``[B]``: where each sequence's kept slots go; slots before it
      stay as they are.
    source: int ``[B, A]`` (every KV head alike) or ``[B, K, A]`` (each KV
      head its own): the slot each kept entry is read from, in ``[0,
      lengths[b])``; entries ``j >= count[b]`` are ignored. Every source is
      read before anything is written, so sources and destinations may
      overlap.
    count: int ``[B]``: kept slots per sequence, ``start + count <=
      lengths`` (a sequence with ``start + count == lengths`` and
      ``source`` its own slots is unchanged).

  Returns:
    The cache with the slots moved, ``lengths = start + count`` and the
    pages past it released.

  Example:
    >>> c = paged_cache.init_paged_cache(4, 2, 1, 1, batch_size=1,
    ...                                  max_pages=4)
    >>> x = jnp.arange(5.0).reshape(1, 1, 5, 1)
    >>> c = paged_cache.append(c, x, x)
    >>> c = move_slots(c, jnp.array([1]), jnp.array([[4, 2]]),
    ...                jnp.array([2]))
    >>> c.lengths.tolist(), c.refcount.tolist()
    ([3], [1, 1, 0, 0])
    >>> c.key_pages[c.page_table[0, 1], 0, 0, 0].tolist()  # slot 2: old 2
    2.0
  """
  paged_cache.check_cache(cache)
  b, m = cache.page_table.shape
  k = cache.key_pages.shape[1]
  p, z = cache.num_pages, cache.page_size
  start, count = (_rows("start", start, b), _rows("count", count, b))
  source = _source(source, b, k)  # [B, K, A]
  a = source.shape[-1]
  _check_values(cache, start, source, count)

  j = jnp.arange(a)
  kept = j[None, :] < count[:, None]  # [B, A]
  src = jnp.clip(source, 0, m * z - 1)
  src_page = jnp.take_along_axis(cache.page_table[:, None, :],
                                 src // z, -1)  # [B, K, A]
  dst = start[:, None] + j[None, :]  # [B, A]
  dst_page = jnp.take_along_axis(cache.page_table,
                                 jnp.clip(dst // z, 0, m - 1), 1)  # [B, A]
  dst_page = jnp.broadcast_to(dst_page[:, None, :], src.shape)
  moved = kept[:, None, :] & (src != dst[:, None, :])  # [B, K, A]
  # A move into a page someone else holds would change their tokens too.
  shared = jnp.where(dst_page < p, cache.refcount[jnp.clip(dst_page, 0,
                                                           p - 1)], 0) > 1
  ok = ~(moved & shared).any((1, 2))  # [B]
  write = moved & ok[:, None, None]
  page_to = jnp.where(write, dst_page, p)  # P: dropped
  slot_to = jnp.broadcast_to((dst % z)[:, None, :], src.shape)
  heads = jnp.broadcast_to(jnp.arange(k)[None, :, None], src.shape)

  def moved_field(x):
    if x is None:
      return None
    taken = x[jnp.clip(src_page, 0, p - 1), heads, src % z]  # [B, K, A, ...]
    return x.at[page_to, heads, slot_to].set(taken, mode="drop")

  key_pages, value_pages, key_scales, value_scales = map(
      moved_field, (cache.key_pages, cache.value_pages, cache.key_scales,
                    cache.value_scales))
  nonfinite = cache.nonfinite
  if nonfinite is not None:  # a page takes its sources' flags
    nonfinite = nonfinite.at[page_to.reshape(-1)].max(
        nonfinite[jnp.clip(src_page, 0, p - 1)].reshape(-1), mode="drop")

  lengths = jnp.where(ok, start + count, cache.lengths)
  # Pages wholly past the new length go back to the pool.
  past = jnp.arange(m)[None, :] * z >= lengths[:, None]  # [B, M]
  drop = jnp.where(past, cache.page_table, p)
  refcount = cache.refcount.at[drop.reshape(-1)].add(-1, mode="drop")
  return cache._replace(
      key_pages=key_pages, value_pages=value_pages, key_scales=key_scales,
      value_scales=value_scales, nonfinite=nonfinite,
      page_table=jnp.where(past, p, cache.page_table), lengths=lengths,
      refcount=refcount, overflow=cache.overflow | ~ok)


def _rows(name: str, x, b: int) -> jax.Array:
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.integer) or x.shape != (b,):
    raise ValueError(f"{name} must be an integer array [B] = [{b}] (one per "
                     f"sequence), got {x.dtype} {x.shape}.")
  return x.astype(jnp.int32)


def _source(source, b: int, k: int) -> jax.Array:
  source = jnp.asarray(source)
  if not jnp.issubdtype(source.dtype, jnp.integer) or not (
      (source.ndim == 2 and source.shape[0] == b) or
      (source.ndim == 3 and source.shape[:2] == (b, k))):
    raise ValueError(
        f"source must be an integer array [B, A] (every KV head alike) or "
        f"[B, K, A] = [{b}, {k}, A] (each KV head its own), got "
        f"{source.dtype} {source.shape}.")
  source = source.astype(jnp.int32)
  if source.ndim == 2:
    source = jnp.broadcast_to(source[:, None, :], (b, k, source.shape[-1]))
  return source


def _check_values(cache, start, source, count) -> None:
  """Raised now where the values are known, else ``aj.checked``'s."""
  a = source.shape[-1]
  lengths = cache.lengths
  kept = jnp.arange(a)[None, None, :] < count[:, None, None]
  bad_range = (start < 0) | (count < 0) | (count > a) | (
      start + count > lengths)
  bad_source = (kept & ((source < 0) | (source >= lengths[:, None, None]))
                ).any((1, 2))
  range_message = ("move_slots needs 0 <= start, 0 <= count <= A = "
                   f"{a} and start + count <= lengths for every sequence")
  source_message = ("move_slots reads source slots in [0, lengths[b]): "
                    "a kept entry points outside its sequence")
  known = _known((bad_range, bad_source, start, count, lengths))
  if known is None:
    traced_checks.traced_check(~bad_range.any(), range_message)
    traced_checks.traced_check(~bad_source.any(), source_message)
    return
  bad_range, bad_source, start, count, lengths = known
  for bad, message in ((bad_range, range_message),
                       (bad_source, source_message)):
    if bad.any():
      row = int(np.argmax(bad))
      raise ValueError(
          f"{message}; sequence {row} has start {int(start[row])}, count "
          f"{int(count[row])}, length {int(lengths[row])}.")


def _known(xs):
  try:
    return tuple(np.asarray(x) for x in xs)
  except jax.errors.TracerArrayConversionError:
    return None
