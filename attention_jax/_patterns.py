"""Structured attention patterns, defined once for every implementation.

Shape glossary: T query length, S key/value length; r a query row, c a key
column; bq/bk query and key block sizes.

Positions are bottom-right aligned: query row ``r`` stands at position
``r + offset`` of the key sequence (``offset = S - T`` for one device; ring
attention passes each step's offset). With ``(left, right)`` the resolved
window bounds (``None`` = unbounded), query ``r`` may see key ``c`` iff

    r + offset - left <= c <= r + offset + right,
    c < kv_length,  r < q_length.

``is_causal`` is ``right = 0`` (with a wider ``right`` the causal bound wins);
``local_window_size=(left, right)`` is jax.nn's argument (an int ``w`` means
``(w, w)``). ``visible`` is the element predicate the dense kernel
materialises and the flash core evaluates inside partial blocks;
``key_block_range``/``query_block_range`` are the same predicate at block
granularity, so blocks it rules out are never visited, forward or backward.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np


class Bounds(NamedTuple):
  """Resolved window: key columns ``[pos - left, pos + right]`` (None = open)."""
  left: int | None
  right: int | None


def check_window(local_window_size) -> tuple[int, int] | None:
  """``local_window_size`` as ``(left, right)`` non-negative ints, or None."""
  if local_window_size is None:
    return None
  sizes = local_window_size
  if isinstance(sizes, (int, np.integer)) and not isinstance(sizes, bool):
    sizes = (sizes, sizes)
  if (not isinstance(sizes, (tuple, list)) or len(sizes) != 2 or any(
      isinstance(x, bool) or not isinstance(x, (int, np.integer))
      for x in sizes)):
    raise TypeError(
        "local_window_size must be a Python int or a (left, right) pair of "
        f"ints, got {local_window_size!r}. A causal window of W tokens is "
        "is_causal=True, local_window_size=(W - 1, 0).")
  left, right = (int(x) for x in sizes)
  if left < 0 or right < 0:
    raise ValueError(f"local_window_size must be non-negative, got "
                     f"{local_window_size!r}.")
  return left, right


def bounds(is_causal: bool, window: tuple[int, int] | None) -> Bounds:
  """The window bounds that ``is_causal`` and a checked window imply."""
  left, right = (None, None) if window is None else window
  if is_causal:
    right = 0 if right is None else min(right, 0)
  return Bounds(left, right)


def visible(rows, cols, offset, b: Bounds, q_length=None, kv_length=None):
  """Bool of broadcast ``rows`` x ``cols`` where a query may see a key.

  None when nothing is excluded (no bound, no length): callers then skip
  every mask pass.
  """
  ok = None

  def both(extra):
    return extra if ok is None else ok & extra

  if b.right is not None:
    ok = both(cols <= rows + offset + b.right)
  if b.left is not None:
    ok = both(cols >= rows + offset - b.left)
  if kv_length is not None:
    ok = both(cols < kv_length)
  if q_length is not None:
    ok = both(rows < q_length)
  return ok


def _blocks(first, last, size: int, count: int):
  """Blocks ``[lo, hi)`` of ``size`` covering indices ``[first, last]``."""
  first = jnp.clip(first, 0, count * size)
  last = jnp.clip(last, -1, count * size - 1)
  lo = jnp.clip(first // size, 0, count)
  hi = jnp.where(last >= first, last // size + 1, lo)
  return lo, jnp.clip(hi, lo, count)


def key_block_range(b: Bounds, i0, bq: int, bk: int, num_k: int, offset,
                    kv_length=None, q_length=None):
  """Key blocks ``[lo, hi)`` that query rows ``[i0, i0 + bq)`` may see.

  Exact for these patterns: the columns the rows may see form one interval,
  and the range is exactly the blocks it touches (tested by brute force).
  """
  last_row = i0 + bq - 1
  if q_length is not None:
    last_row = jnp.minimum(last_row, q_length - 1)
  first = 0 if b.left is None else i0 + offset - b.left
  last = num_k * bk - 1
  if b.right is not None:
    last = last_row + offset + b.right
  if kv_length is not None:
    last = jnp.minimum(last, kv_length - 1)
  if q_length is not None:  # rows past the length see nothing
    last = jnp.where(last_row >= i0, last, first - 1)
  return _blocks(first, last, bk, num_k)


def query_block_range(b: Bounds, j0, bq: int, bk: int, num_q: int, offset,
                      kv_length=None, q_length=None):
  """Query blocks ``[lo, hi)`` whose rows may see key columns ``[j0, j0 + bk)``."""
  last_col = j0 + bk - 1
  if kv_length is not None:
    last_col = jnp.minimum(last_col, kv_length - 1)
  first = 0 if b.right is None else j0 - offset - b.right
  last = num_q * bq - 1
  if b.left is not None:
    last = last_col - offset + b.left
  if q_length is not None:
    last = jnp.minimum(last, q_length - 1)
  if kv_length is not None:  # columns past the length are seen by nobody
    last = jnp.where(last_col >= j0, last, first - 1)
  return _blocks(first, last, bq, num_q)
