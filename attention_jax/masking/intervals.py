"""Structured attention patterns, defined once for every implementation.

Shape glossary: T query length, S key/value length; r a query row, c a key
column; bq/bk query and key block sizes.

Positions are bottom-right aligned: query row ``r`` stands at position
``r + offset`` of the key sequence (``offset = S - T`` for one device; ring
attention passes each step's offset). With ``(left, right)`` the resolved
window bounds (``None`` = unbounded), query ``r`` may see key ``c`` iff

    r + offset - left <= c <= r + offset + right,
    c < kv_lengths,  r < q_lengths.

``causal`` is ``right = 0`` (with a wider ``right`` the causal bound wins);
a window ``(left, right)`` is jax.nn's ``local_window_size`` (an int ``w``
means ``(w, w)``). Packed sequences add segment ids: query ``r`` may see
key ``c`` only when ``q_segment_ids[r] == kv_segment_ids[c]``.

``jax_nn_band`` says how ``jax.nn.dot_product_attention`` (top-left
aligned: offset 0) expresses a band: its own ``is_causal`` and
``local_window_size`` where they are exact, else an explicit mask.

``visible`` is the element predicate the dense kernel materialises and the
flash core evaluates inside partial blocks. At block granularity each
(query block, key block) pair is *empty* (no allowed entry: never visited,
forward or backward), *full* (every entry allowed: visited without any mask
pass) or *partial*. ``key_blocks``/``query_blocks`` give the non-empty
blocks and the full ones among them, as intervals, from the bounds,
lengths and offset;
``segment_block_ranges`` does the same from per-block minimum and maximum
segment ids. Each is exact for its own pattern (for segments: packed
documents, the same non-decreasing ids on both sides; other ids still get
a covering interval and only full blocks they really have); combined
patterns intersect the intervals, which never calls a block with an allowed
entry empty nor a block with a blocked entry full.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

MaskFn = Callable[..., jax.Array]  # mask_fn(b, h, q_idx, kv_idx) -> bool
# score_mod(score, b, h, q_idx, kv_idx) -> modified score (scores/score_mods.py)
ScoreMod = Callable[..., jax.Array]
EMPTY, PARTIAL, FULL = 0, 1, 2  # block kinds


def rule_indices(batch: tuple[int, ...], xp=np):
  """``b`` and ``h`` of rank ``len(batch) + 2``, as the kernels number them.

  The index arrays a mask rule is evaluated over when its block tables are
  built (``block_mask``) or checked against the operands (``checks``).
  """
  if not batch:
    return xp.zeros((1, 1), np.int32), xp.zeros((1, 1), np.int32)
  if len(batch) == 1:
    return (xp.arange(batch[0], dtype=np.int32)[:, None, None],
            xp.zeros((1, 1, 1), np.int32))
  lead = (1,) * (len(batch) - 2)
  b = xp.arange(batch[-2], dtype=np.int32).reshape(lead + (-1, 1, 1, 1))
  h = xp.arange(batch[-1], dtype=np.int32).reshape(lead + (1, -1, 1, 1))
  return b, h



class Bounds(NamedTuple):
  """Resolved window: key columns ``[pos - left, pos + right]`` (None = open)."""
  left: int | None
  right: int | None


def check_window(local_window_size, name: str = "window"
                 ) -> tuple[int, int] | None:
  """A window as ``(left, right)`` non-negative ints, or None."""
  if local_window_size is None:
    return None
  sizes = local_window_size
  if isinstance(sizes, (int, np.integer)) and not isinstance(sizes, bool):
    sizes = (sizes, sizes)
  if (not isinstance(sizes, (tuple, list)) or len(sizes) != 2 or any(
      isinstance(x, bool) or not isinstance(x, (int, np.integer))
      for x in sizes)):
    raise TypeError(
        f"{name} must be a Python int or a (left, right) pair of "
        f"ints, got {local_window_size!r}. A causal window of W tokens is "
        "aj.Mask(causal=True, window=(W - 1, 0)).")
  left, right = (int(x) for x in sizes)
  if left < 0 or right < 0:
    raise ValueError(f"{name} must be non-negative, got "
                     f"{local_window_size!r}.")
  return left, right


def bounds(is_causal: bool, window: tuple[int, int] | None) -> Bounds:
  """The window bounds that ``is_causal`` and a checked window imply."""
  left, right = (None, None) if window is None else window
  if is_causal:
    right = 0 if right is None else min(right, 0)
  return Bounds(left, right)


def visible(rows, cols, offset, b: Bounds, q_lengths=None, kv_lengths=None,
            q_segment_ids=None, kv_segment_ids=None):
  """Bool of broadcast ``rows`` x ``cols`` where a query may see a key.

  ``q_segment_ids``/``kv_segment_ids`` are the segment ids of ``rows``/``cols`` (same
  shapes) or None. None when nothing is excluded (no bound, no length, no
  segments): callers then skip every mask pass.
  """
  parts = []
  if b.right is not None:
    parts.append(cols <= rows + offset + b.right)
  if b.left is not None:
    parts.append(cols >= rows + offset - b.left)
  if kv_lengths is not None:
    parts.append(cols < kv_lengths)
  if q_lengths is not None:
    parts.append(rows < q_lengths)
  if q_segment_ids is not None:
    parts.append(q_segment_ids == kv_segment_ids)
  ok = None
  for part in parts:
    ok = part if ok is None else ok & part
  return ok


class JaxNnBand(NamedTuple):
  """A band in ``jax.nn.dot_product_attention``'s terms (``jax_nn_band``)."""
  is_causal: bool
  local_window_size: tuple[int, int] | None
  mask: jax.Array | None  # bool [..., T, S] explicit band, or None


def _concretely_zero(offset) -> bool:
  """Whether ``offset`` is known, now, to be 0 everywhere (not traced)."""
  try:
    return not np.any(np.asarray(offset))
  except jax.errors.TracerArrayConversionError:
    return False


def jax_nn_flags_exact(t: int, s: int, offset, b: Bounds, *,
                       cudnn: bool = False) -> bool:
  """Whether jax.nn's own ``is_causal``/``local_window_size`` express the
  band ``b`` at ``offset`` exactly (``jax_nn_band`` then builds no mask).

  ``cudnn``: for jax.nn's cuDNN path, which has only a left window (a
  right bound of 0) and whose causal alignment for ``T != S`` no GPU run of
  this library has checked: its flags only where ``T == S`` too.
  """
  if cudnn and (b.right != 0 or t != s):
    return False
  return _concretely_zero(offset)


def jax_nn_band(t: int, s: int, offset, b: Bounds, *,
                cudnn: bool = False) -> JaxNnBand:
  """The band ``b`` at ``offset`` as jax.nn expresses it.

  jax.nn aligns top-left for any ``T``, ``S``: its ``is_causal`` is ``j <=
  i`` and its ``local_window_size=(left, right)`` is ``i - left <= j <= i +
  right``, i.e. ``visible`` at offset 0. So its own flags are exact only
  when ``offset`` (``q_offset - kv_offset``, or ``S - T`` for the
  bottom-right alignment) is concretely 0; a traced offset may not be.
  ``cudnn`` asks for more (``jax_nn_flags_exact``). Everywhere else
  ``mask`` is the band itself, ``visible`` over the ``[T, S]`` grid.

  Args:
    t, s: query and key/value lengths.
    offset: query row ``r`` stands at key column ``r + offset``; an int or
      an integer array over the leading dims (e.g. ``[B, 1]``).
    b: the resolved bounds (``bounds``).
    cudnn: the target is jax.nn's cuDNN path (``jax_nn_flags_exact``).

  Returns:
    ``JaxNnBand(is_causal, local_window_size, mask)``: ``mask`` is bool
    ``offset.shape + (T, S)``, or None where the flags say it all (also
    when nothing is bounded). A left bound that excludes no key is dropped
    from ``local_window_size``.
  """
  if b.left is None and b.right is None:
    return JaxNnBand(False, None, None)
  if jax_nn_flags_exact(t, s, offset, b, cudnn=cudnn):
    causal = b.right == 0
    # At offset 0 row T - 1 reaches back furthest: under causality a left
    # bound >= T - 1 excludes no key (and cuDNN is spared a window).
    if b.left is None or (causal and b.left >= t - 1):
      return JaxNnBand(causal, None, None)
    # jax.nn's window takes both sides; a right bound of S excludes nothing.
    right = s if b.right is None else b.right
    return JaxNnBand(causal, (b.left, right), None)
  offset = jnp.asarray(offset)
  lead = (1,) * offset.ndim  # rows and columns of the offset's rank
  rows = jnp.arange(t).reshape(lead + (t, 1))
  cols = jnp.arange(s).reshape(lead + (1, s))
  return JaxNnBand(False, None, visible(rows, cols, offset[..., None, None],
                                        b))


def _block_interval(first, last, full_first, full_last, size: int,
                    count: int):
  """``(lo, hi, full_lo, full_hi)`` over ``count`` blocks of ``size``:
  blocks ``[lo, hi)`` touch indices ``[first, last]``; blocks ``[full_lo,
  full_hi)`` lie wholly inside ``[full_first, full_last]``, clipped into
  ``[lo, hi)`` (a full block is a visited one)."""
  first = jnp.clip(first, 0, count * size)
  last = jnp.clip(last, -1, count * size - 1)
  lo = jnp.clip(first // size, 0, count)
  hi = jnp.where(last >= first, last // size + 1, lo)
  hi = jnp.clip(hi, lo, count)
  full_lo = jnp.clip(-((-full_first) // size), lo, hi)
  full_hi = jnp.clip((full_last + 1) // size, 0, count)
  return lo, hi, full_lo, jnp.clip(full_hi, full_lo, hi)


def key_blocks(b: Bounds, i0, bq: int, bk: int, num_k: int, offset,
               kv_lengths=None, q_lengths=None, s: int | None = None):
  """Key blocks of query rows ``[i0, i0 + bq)``: ``(lo, hi, full_lo,
  full_hi)``, ``[lo, hi)`` the blocks they may see, ``[full_lo, full_hi)``
  those every entry of which every row sees.

  ``s`` is the true key length (columns past it are padding). Exact for
  these patterns: the columns the rows may see form one interval, and
  those every row sees another (tested by brute force).
  """
  last_row = i0 + bq - 1
  if q_lengths is not None:
    last_row = jnp.minimum(last_row, q_lengths - 1)
  first = 0 if b.left is None else i0 + offset - b.left
  last = num_k * bk - 1
  if b.right is not None:
    last = last_row + offset + b.right
  if kv_lengths is not None:
    last = jnp.minimum(last, kv_lengths - 1)
  if q_lengths is not None:  # rows past the length see nothing
    last = jnp.where(last_row >= i0, last, first - 1)
  # What every row sees: from the last row's left bound to the first's right.
  full_first = 0 if b.left is None else i0 + bq - 1 + offset - b.left
  full_last = num_k * bk - 1 if b.right is None else i0 + offset + b.right
  if s is not None:
    full_last = jnp.minimum(full_last, s - 1)
  if kv_lengths is not None:
    full_last = jnp.minimum(full_last, kv_lengths - 1)
  if q_lengths is not None:  # a row past the length sees nothing
    full_last = jnp.where(i0 + bq <= q_lengths, full_last, full_first - 1)
  return _block_interval(first, last, full_first, full_last, bk, num_k)


def query_blocks(b: Bounds, j0, bq: int, bk: int, num_q: int, offset,
                 kv_lengths=None, q_lengths=None, s: int | None = None):
  """Query blocks of key columns ``[j0, j0 + bk)``: ``(lo, hi, full_lo,
  full_hi)``, ``[lo, hi)`` the blocks whose rows may see them, ``[full_lo,
  full_hi)`` those every row of which sees all of them (``key_blocks``
  from the keys' side)."""
  last_col = j0 + bk - 1
  if kv_lengths is not None:
    last_col = jnp.minimum(last_col, kv_lengths - 1)
  first = 0 if b.right is None else j0 - offset - b.right
  last = num_q * bq - 1
  if b.left is not None:
    last = last_col - offset + b.left
  if q_lengths is not None:
    last = jnp.minimum(last, q_lengths - 1)
  if kv_lengths is not None:  # columns past the length are seen by nobody
    last = jnp.where(last_col >= j0, last, first - 1)
  full_first = 0 if b.right is None else j0 + bk - 1 - offset - b.right
  full_last = num_q * bq - 1 if b.left is None else j0 - offset + b.left
  if q_lengths is not None:
    full_last = jnp.minimum(full_last, q_lengths - 1)
  for limit in (s, kv_lengths):  # a column past a length is seen by nobody
    if limit is not None:
      full_last = jnp.where(j0 + bk <= limit, full_last, full_first - 1)
  return _block_interval(first, last, full_first, full_last, bq, num_q)


def block_min_max(ids, size: int):
  """Per-block minimum and maximum of segment ids ``[n * size]`` -> ``[n]``."""
  blocks = ids.reshape(-1, size)
  return blocks.min(-1), blocks.max(-1)


def segment_block_ranges(lo_id, hi_id, other_min, other_max):
  """Blocks of the other side a block with ids in ``[lo_id, hi_id]`` meets.

  ``other_min``/``other_max`` are the other side's per-block minimum and
  maximum ids. Returns ``(lo, hi, full_lo, full_hi)``: blocks ``[lo, hi)``
  may share a segment with this block (exact for packed documents, a
  covering interval otherwise), blocks ``[full_lo, full_hi)`` hold only this block's
  single segment (empty unless this block has one segment and those blocks
  are contiguous).
  """
  count = other_min.shape[0]
  index = jnp.arange(count)
  meets = (other_max >= lo_id) & (other_min <= hi_id)
  lo = jnp.min(jnp.where(meets, index, count))
  hi = jnp.max(jnp.where(meets, index + 1, 0))
  hi = jnp.maximum(hi, lo)
  same = (lo_id == hi_id) & (other_min == lo_id) & (other_max == lo_id)
  full_lo = jnp.min(jnp.where(same, index, count))
  full_hi = jnp.max(jnp.where(same, index + 1, 0))
  contiguous = jnp.sum(same) == full_hi - full_lo
  full_hi = jnp.where(contiguous & (full_hi > full_lo), full_hi, full_lo)
  return lo, hi, full_lo, full_hi
