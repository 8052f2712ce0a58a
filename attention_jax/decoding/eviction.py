"""KV-cache eviction: which slots each sequence keeps under a token budget.

Shape glossary: B sequences, K key/value heads, L slots a score vector
covers (a paged cache's ``M * Z``: ``aj.paged_key_importance``'s width), A
slots kept per sequence (the ``budget``), Z tokens per page.

A cache that keeps every token grows with the sequence; an eviction policy
keeps at most ``budget`` of a sequence's slots (per KV head where the policy
scores heads apart) and drops the rest, so attention reads, and the pool
holds, ``budget`` tokens however long the sequence grows. The policies here
choose; ``evict`` applies a choice to a ``PagedKVCache``:

- **StreamingLLM** (Xiao et al. 2024, "Efficient Streaming Language Models
  with Attention Sinks"), ``streaming_keep``: the first ``sinks`` tokens
  (the attention sinks, which absorb the mass a softmax must put somewhere)
  and the ``budget - sinks`` most recent ones. No scores; every KV head
  alike.
- **H2O** (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient
  Generative Inference of Large Language Models"), ``h2o_keep``: the
  ``recent`` newest slots, and among the rest the ``budget - recent`` heavy
  hitters: the largest accumulated attention scores, the weight each slot
  received summed over every query so far (``aj.paged_key_importance`` at
  each step, summed; ``moved_scores`` carries the sums through each
  eviction), per KV head.
- **SnapKV** (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for
  Before Generation"), ``snapkv_keep``: the prompt's last ``window`` tokens
  (the observation window) are kept, and among the slots before them the
  ``budget - window`` whose score (the attention the window's queries gave
  them, ``aj.paged_key_importance(last=window)``) pooled over ``kernel``
  neighbouring slots (max or average; pooling keeps a chosen token's
  neighbours with it) is largest, per KV head. Run once, after the prompt.

Each ``*_keep`` returns ``(source, count)``: ``source`` int32 ``[B, K, A]``
(``[B, A]`` for StreamingLLM, every KV head alike) the kept slots in
increasing slot order (the order the tokens came in), ``count [B] =
min(lengths, budget)``; entries ``j >= count`` are padding. A sequence
holding ``<= budget`` slots keeps them all, where they are. Ties between
equal scores go to the earlier slot.

``evict(cache, source, count)`` compacts the kept slots to the front
(``aj.move_slots`` from slot 0): the sequence's length becomes ``count``,
so evicted slots are never attended again, and every page past it returns
to the pool. A moved key keeps the rotary position it was written at (the
same vector moves). So the sequence's next token stands at the number of
tokens it has seen, not at its length: decode with ``positions = lengths +
evicted`` (``evict`` returns each call's ``evicted [B]``; sum them). Masks
and windows keep counting slots.

Everything is a pure function of arrays, usable inside ``jit``: lengths and
scores may be traced. ``budget`` is a Python int (``A = budget``) or, with
``width=A`` given, an integer array (scalar or ``[B]``: a budget per
sequence, traced too, so one compiled program serves every budget);
``sinks``, ``recent`` and ``window`` likewise ints or arrays; ``kernel``
and ``width`` are Python ints (they shape the result).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
import numpy as np

from attention_jax.core import checks
from attention_jax.decoding import paged_cache
from attention_jax.decoding import paged_edit

POOLINGS = ("max", "avg")


def streaming_keep(lengths: ArrayLike, budget: int | ArrayLike, *,
                   sinks: int | ArrayLike = 4,
                   width: int | None = None) -> tuple[jax.Array, jax.Array]:
  """StreamingLLM's choice: the first ``sinks`` slots and the newest rest.

  Args:
    lengths: int ``[B]``: slots each sequence holds.
    budget: slots kept per sequence: a positive Python int (``A =
      budget``), or with ``width`` an integer array, scalar or ``[B]``
      (traced too: one compiled program for every budget).
    sinks: the attention sinks, the first slots, always kept (``>= 0``, at
      most ``budget`` of them; an int, or an array as ``budget``).
    width: ``A``, the source's last dim, when ``budget`` is an array (its
      values are then clipped to ``[0, width]``); None: ``budget``.

  Returns:
    ``(source, count)``: int32 ``[B, A]`` (every KV head alike; ``evict``
    and ``moved_scores`` take it so) and int32 ``[B]``.

  Raises:
    TypeError, ValueError: a budget, sinks or width of the wrong type or
      range; lengths not integer ``[B]``.

  Example:
    >>> source, count = streaming_keep(jnp.array([10, 3]), 5, sinks=2)
    >>> source.tolist(), count.tolist()
    ([[0, 1, 7, 8, 9], [0, 1, 2, 3, 4]], [5, 3])
  """
  lengths = _lengths(lengths, None)
  b = lengths.shape[0]
  width, budget = _budget(budget, width, b)
  sinks = jnp.minimum(_count("sinks", sinks, b), budget)
  j = jnp.arange(width, dtype=jnp.int32)[None, :]  # [1, A]
  over = lengths > budget  # [B]
  # Past the sinks, entry j reads slot length - budget + j: the newest
  # budget - sinks.
  recent = (lengths - budget)[:, None] + j
  source = jnp.where(over[:, None] & (j >= sinks[:, None]), recent, j)
  source = jnp.where(j < budget[:, None], source, 0)  # padding
  return source, jnp.minimum(lengths, budget)


def h2o_keep(scores: ArrayLike, lengths: ArrayLike, budget: int | ArrayLike,
             *, recent: int | ArrayLike,
             width: int | None = None) -> tuple[jax.Array, jax.Array]:
  """H2O's choice: the ``recent`` newest slots and the heavy hitters.

  Args:
    scores: float ``[B, K, L]``: each slot's accumulated attention (the sum
      of ``aj.paged_key_importance`` over the steps so far, moved with the
      slots by ``moved_scores``); read below each sequence's length only.
    lengths: int ``[B]``: slots each sequence holds (``<= L``).
    budget: slots kept per sequence and KV head: a positive Python int
      (``A = budget``), or with ``width`` an integer array (scalar or
      ``[B]``, traced too).
    recent: the newest slots always kept (``>= 0``, at most ``budget``; an
      int or an array as ``budget``); the other ``budget - recent`` are the
      largest scores among the older slots (the paper splits the budget in
      halves).
    width: ``A`` when ``budget`` is an array (as ``streaming_keep``'s).

  Returns:
    ``(source, count)``: int32 ``[B, K, A]``, slots in increasing order
    per KV head, and int32 ``[B]``.

  Raises:
    TypeError, ValueError: scores not float ``[B, K, L]``, lengths not
      integer ``[B]`` of the same ``B``, a budget or recent out of range.

  Example:
    >>> scores = jnp.array([[[5.0, 0.1, 3.0, 0.2, 0.3, 0.4]]])  # [1, 1, 6]
    >>> source, count = h2o_keep(scores, jnp.array([6]), 4, recent=2)
    >>> source.tolist(), count.tolist()
    ([[[0, 2, 4, 5]]], [4])
  """
  scores = _scores(scores)
  b = scores.shape[0]
  lengths = _lengths(lengths, b)
  width, budget = _budget(budget, width, b)
  recent = jnp.minimum(_count("recent", recent, b), budget)
  return _keep(scores, lengths, budget, recent, width)


def snapkv_keep(scores: ArrayLike, lengths: ArrayLike,
                budget: int | ArrayLike, *, window: int | ArrayLike,
                kernel: int = 7, pooling: str = "max",
                width: int | None = None) -> tuple[jax.Array, jax.Array]:
  """SnapKV's choice: the observation window and the pooled top slots.

  Args:
    scores: float ``[B, K, L]``: the attention each slot received from the
      window's queries (``aj.paged_key_importance(..., last=window)`` of
      the prompt's step); read below ``lengths - window`` only.
    lengths: int ``[B]``: slots each sequence holds (the prompt, ``<= L``).
    budget: slots kept per sequence and KV head, as ``h2o_keep``'s.
    window: the observation window: the newest ``window`` slots, always
      kept (positive, at most ``budget`` of them; an int or an array as
      ``budget``).
    kernel: the pooling width over neighbouring slots (a positive odd
      Python int; 1: no pooling). Slot ``s`` scores the max (``"max"``) or
      the sum over ``kernel`` (``"avg"``, zero padding, as the paper's
      ``avg_pool1d``) of the scores of slots ``s - kernel // 2 .. s +
      kernel // 2`` before the window.
    pooling: ``"max"`` or ``"avg"``.
    width: ``A`` when ``budget`` is an array (as ``streaming_keep``'s).

  Returns:
    ``(source, count)``: int32 ``[B, K, A]``, slots in increasing order
    per KV head, and int32 ``[B]``.

  Raises:
    TypeError, ValueError: as ``h2o_keep``'s, and a kernel that is not a
      positive odd int, a pooling not in ``("max", "avg")``.

  Example:
    >>> scores = jnp.array([[[0.0, 0.0, 0.0, 9.0, 0.0, 0.0, 0.0, 1.0]]])
    >>> source, count = snapkv_keep(scores, jnp.array([8]), 4, window=2,
    ...                             kernel=3)
    >>> source.tolist()  # slot 3 and its neighbour 2 (a tie: the earlier)
    [[[2, 3, 6, 7]]]
  """
  checks.check_positive_int("kernel", kernel)
  if kernel % 2 == 0:
    raise ValueError(f"kernel must be odd (slots on both sides of each, "
                     f"the paper's padding kernel // 2), got {kernel}.")
  if pooling not in POOLINGS:
    raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}.")
  scores = _scores(scores)
  b = scores.shape[0]
  lengths = _lengths(lengths, b)
  width, budget = _budget(budget, width, b)
  if isinstance(window, (int, np.integer)) and not isinstance(window, bool):
    checks.check_positive_int("window", window)
  window = jnp.minimum(_count("window", window, b), budget)
  pooled = _pool(scores, lengths - window, kernel, pooling)
  return _keep(pooled, lengths, budget, window, width)


def evict(cache: paged_cache.PagedKVCache, source: ArrayLike,
          count: ArrayLike) -> tuple[paged_cache.PagedKVCache, jax.Array]:
  """Keeps the chosen slots, compacted to the front; frees the rest.

  ``aj.move_slots(cache, 0, source, count)``: slot ``j < count[b]`` of
  sequence ``b`` (per KV head with ``source [B, K, A]``) takes what slot
  ``source[b, (k,) j]`` held, the length becomes ``count``, the pages past
  it return to the pool. The keys keep their rotary positions: decode on
  with ``positions = lengths + evicted so far`` (the module docstring).

  Args:
    cache: the paged cache.
    source: int ``[B, A]`` or ``[B, K, A]``: a ``*_keep``'s choice (slots
      in ``[0, lengths)``, increasing: a slot is then never written before
      it is read by a later entry, and kept tokens stay in order).
    count: int ``[B]``: kept slots, ``<= lengths`` and ``<= A``.

  Returns:
    ``(cache, evicted)``: the cache after the move, and int32 ``[B]``: the
    slots each sequence dropped (its length before minus after; 0 for a
    sequence that kept all, and for one whose move was refused because it
    would write into a page another sequence shares: its ``overflow`` flag
    is then raised, as ``move_slots`` says).

  Raises:
    ValueError: what ``aj.move_slots`` raises (shapes; counts and slots
      out of range when known).

  Example:
    >>> c = paged_cache.init_paged_cache(4, 2, 1, 1, batch_size=1,
    ...                                  max_pages=4)
    >>> x = jnp.arange(7.0).reshape(1, 1, 7, 1)
    >>> c = paged_cache.append(c, x, x)
    >>> c, evicted = evict(c, *streaming_keep(c.lengths, 3, sinks=1))
    >>> evicted.tolist(), c.lengths.tolist(), int((c.refcount > 0).sum())
    ([4], [3], 2)
  """
  paged_cache.check_cache(cache)
  before = jnp.asarray(cache.lengths, jnp.int32)
  start = jnp.zeros(before.shape, jnp.int32)
  moved = paged_edit.move_slots(cache, start, source, count)
  return moved, before - moved.lengths


def moved_scores(scores: ArrayLike, source: ArrayLike,
                 count: ArrayLike) -> jax.Array:
  """The per-slot scores after ``evict(cache, source, count)``: slot ``j <
  count[b]`` takes the score of slot ``source[b, (k,) j]``, the slots past
  ``count`` 0 (H2O's accumulated scores follow their tokens).

  Args:
    scores: float ``[B, K, L]``.
    source: int ``[B, A]`` (every KV head alike) or ``[B, K, A]``, entries
      in ``[0, L)`` where kept.
    count: int ``[B]``, ``<= L``.

  Returns:
    ``[B, K, L]``, the scores' dtype. (A sequence whose move
    ``move_slots`` refused, its overflow flag raised, still has its scores
    moved: check the flag, as after any refused write.)

  Example:
    >>> s = jnp.array([[[1.0, 2.0, 3.0, 4.0]]])
    >>> moved_scores(s, jnp.array([[0, 3]]), jnp.array([2])).tolist()
    [[[1.0, 4.0, 0.0, 0.0]]]
  """
  scores = _scores(scores)
  b, k, n = scores.shape
  count = _lengths(count, b, name="count")
  source = checks.integer_array("source", source, " [B, A] or [B, K, A]")
  source = jnp.asarray(source, jnp.int32)
  if not ((source.ndim == 2 and source.shape[0] == b) or
          (source.ndim == 3 and source.shape[:2] == (b, k))):
    raise ValueError(
        f"source must be [B, A] or [B, K, A] = [{b}, {k}, A] (scores "
        f"[B, K, L] = {scores.shape}), got {source.shape}.")
  if source.ndim == 2:
    source = jnp.broadcast_to(source[:, None, :], (b, k, source.shape[-1]))
  a = source.shape[-1]
  taken = jnp.take_along_axis(scores, jnp.clip(source, 0, n - 1), -1)
  taken = jnp.where(jnp.arange(a)[None, None, :] < count[:, None, None],
                    taken, jnp.zeros((), scores.dtype))  # [B, K, A]
  if a >= n:  # (count <= L: the entries past L are padding)
    return taken[..., :n]
  return jnp.pad(taken, ((0, 0), (0, 0), (0, n - a)))


def _keep(priority: jax.Array, lengths: jax.Array, budget: jax.Array,
          recent: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
  """The newest ``recent [B]`` slots and the top ``budget - recent`` of
  ``priority [B, K, L]`` among the older ones, sorted, in ``[B, K,
  width]``; all of a sequence of ``<= budget [B]`` slots."""
  n = priority.shape[-1]
  s = jnp.arange(n, dtype=jnp.int32)[None, None, :]
  end = lengths[:, None, None]
  held = s < end
  newest = held & (s >= end - recent[:, None, None])
  # Kept first: the newest (+inf), then any held slot by its score (made
  # finite, so a held slot always ranks above one the sequence does not
  # hold, -inf); top_k takes the earlier slot of equal ones.
  finfo = jnp.finfo(priority.dtype)
  score = jnp.nan_to_num(priority, nan=finfo.min, posinf=finfo.max,
                         neginf=finfo.min)
  rank = jnp.where(newest, jnp.inf, jnp.where(held, score, -jnp.inf))
  picks = min(width, n)
  _, top = jax.lax.top_k(rank, picks)  # [B, K, picks]: best first
  # Only the first `budget` picks are kept; the rest (and a sequence's
  # picks past its length) become padding, sorted after the kept slots.
  top = top.astype(jnp.int32)
  kept = jnp.arange(picks)[None, None, :] < jnp.minimum(
      lengths, budget)[:, None, None]
  source = jnp.sort(jnp.where(kept, top, n), axis=-1)
  source = jnp.where(source < n, source, 0)
  if picks < width:  # a width above L: padding entries
    source = jnp.pad(source, ((0, 0), (0, 0), (0, width - picks)))
  return source, jnp.minimum(lengths, budget)


def _pool(scores: jax.Array, end: jax.Array, kernel: int,
          pooling: str) -> jax.Array:
  """``scores [B, K, L]`` pooled over ``kernel`` neighbours among the slots
  below ``end [B]`` (the others count as padding: -inf for max, 0 for
  avg)."""
  n = scores.shape[-1]
  r = kernel // 2
  s = jnp.arange(n)[None, None, :]
  inside = s < end[:, None, None]
  pad = -jnp.inf if pooling == "max" else 0.0
  x = jnp.where(inside, scores, pad)
  padded = jnp.pad(x, ((0, 0), (0, 0), (r, r)), constant_values=pad)
  shifted = [padded[..., d:d + n] for d in range(kernel)]
  if pooling == "max":
    return jnp.max(jnp.stack(shifted), axis=0)
  return sum(shifted) / kernel


def _budget(budget, width, b: int) -> tuple[int, jax.Array]:
  """``(A, budget [B])``: a Python int budget is ``A`` itself; an array
  needs ``width`` (clipped to ``[0, width]``)."""
  if width is not None:
    checks.check_positive_int("width", width)
  if isinstance(budget, (int, np.integer)) and not isinstance(budget, bool):
    checks.check_positive_int("budget", budget)
    if width is not None and budget > width:
      raise ValueError(f"budget={budget} is above width={width}: the source "
                       "has width slots per sequence; leave width out.")
    width = budget if width is None else width
    return width, jnp.full((b,), budget, jnp.int32)
  if width is None:
    raise TypeError(
        f"budget must be a Python int, got {type(budget).__name__}; an "
        "array budget (traced, or one per sequence) needs width= (the "
        "source's last dim, a Python int >= every budget).")
  return width, jnp.clip(_count("budget", budget, b), 0, width)


def _count(name: str, value, b: int) -> jax.Array:
  """An int ``>= 0`` or an integer array (scalar or ``[B]``) as int32
  ``[B]``."""
  if isinstance(value, bool) or (
      not isinstance(value, (int, np.integer)) and not hasattr(value,
                                                               "dtype")):
    raise TypeError(f"{name} must be a Python int or an integer array, got "
                    f"{value!r} ({type(value).__name__}).")
  if isinstance(value, (int, np.integer)):
    if value < 0:
      raise ValueError(f"{name} must be >= 0, got {value}.")
    return jnp.full((b,), value, jnp.int32)
  checks.integer_array(name, value, " (a scalar or [B])")
  if np.ndim(value) not in (0, 1) or (np.ndim(value) == 1 and
                                      np.shape(value)[0] != b):
    raise ValueError(f"{name} must be a scalar or [B] = [{b}], got shape "
                     f"{np.shape(value)}.")
  return jnp.broadcast_to(jnp.asarray(value, jnp.int32), (b,))


def _scores(scores) -> jax.Array:
  checks.check_float_array("scores", scores)
  if np.ndim(scores) != 3:
    raise ValueError(f"scores must be [B, K, L] (per sequence, KV head and "
                     f"slot: aj.paged_key_importance's), got shape "
                     f"{checks.shape_of(scores)}.")
  return jnp.asarray(scores)


def _lengths(lengths, b: int | None, name: str = "lengths") -> jax.Array:
  checks.integer_array(name, lengths, " [B]")
  shape = np.shape(lengths)
  if len(shape) != 1 or (b is not None and shape[0] != b):
    want = "[B]" if b is None else f"[B] = [{b}] (the scores' B)"
    raise ValueError(f"{name} must be an integer array {want}, got shape "
                     f"{shape}.")
  return jnp.asarray(lengths, jnp.int32)
