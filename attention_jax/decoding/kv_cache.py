"""A key/value cache for autoregressive decoding, as pure functions.

Shape glossary: B batch, K key/value heads, L cache capacity (max_length),
W ring-buffer slots, T new tokens in this call, H head dim.

A linear cache is a fixed-size buffer ``[B, K, L, H]`` for keys and one for
values, plus ``index``: how many positions are filled, one integer for the
batch or one per example (``[B]``, ragged batches). A decoding call writes
its ``T`` new keys/values at ``[index, index + T)`` and its queries attend to
every filled position up to their own: query ``i`` (absolute position
``index + i``) sees key ``j`` iff ``j <= index + i``. That is the
bottom-right aligned causal mask over the filled prefix, so a prompt of any
length can be prefilled in one call and then extended a token at a time, and
the result equals full causal attention over the whole sequence. Prompts of
different lengths are right-padded to ``T`` and given as ``new_lengths``.

A ring buffer (``update_ring_cache``) serves a sliding-window layer with
``W`` slots whatever the length: position ``p`` lives in slot ``p % W``.

Left-padded prompts give ``left_padding [B]``, each example's number of
leading pad tokens: the pads are written like any token (every example
advances by ``T``), but a key at a position below the example's
``left_padding`` is never visible, in either cache, now or in a later call.

The writes are scatters with ``mode="drop"``: a write that does not fit is
dropped, never clamped onto earlier slots as ``dynamic_update_slice`` would.
Concrete misfits raise at trace time; traced ones are reported as a value
(``cache_overflow``), so a decoding step pays no host callback.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
import numpy as np

from attention_jax.core import checks


def _raise_if_full(index, num_new, max_length: int) -> None:
  index, num_new = np.asarray(index), np.asarray(num_new)
  if (index < 0).any():
    raise ValueError(
        f"index must be non-negative (the number of filled cache positions), "
        f"got {index.min()}: a negative start would be clamped to slot 0 and "
        "overwrite the start of the cache. Start an empty cache at "
        "jnp.int32(0) and advance it by T after each call.")
  full = index + num_new > max_length
  if full.any():
    at = f" in examples {np.flatnonzero(full).tolist()}" if index.ndim else ""
    raise ValueError(
        f"KV cache overflow{at}: {np.max(np.where(full, index, 0))} positions "
        f"are filled and this call brings {np.max(num_new)} more, but "
        f"max_length is {max_length}. Call init_cache with a larger "
        "max_length.")


def is_concrete(x) -> bool:
  """Not None and not a tracer: a value checks can read at trace time."""
  return x is not None and not isinstance(x, jax.core.Tracer)


def check_room(index: ArrayLike, num_new: ArrayLike, max_length: int) -> None:
  """Raises ``ValueError`` if ``num_new`` tokens do not fit after ``index``.

  Also raises for a negative ``index``. Only concrete values are checked
  (a Python int, a NumPy or a concrete JAX array, closed over by ``jit`` or
  not): that costs nothing at run time. A traced index (a ``jit`` argument)
  is not known until the program runs; ``update_kv_cache`` then drops the
  write of an example that does not fit (never wrapping or clamping it onto
  earlier slots) and ``cache_overflow`` reports them as a value, so the decoding
  step pays no host callback.
  """
  if np.max(num_new) > max_length if is_concrete(num_new) else False:
    raise ValueError(f"KV cache overflow: a call brings {np.max(num_new)} "
                     f"tokens but max_length is {max_length}.")
  if is_concrete(index) and (num_new is None or is_concrete(num_new)):
    _raise_if_full(index, num_new, max_length)


def cache_overflow(index: ArrayLike, num_new: ArrayLike,
                   max_length: int) -> jax.Array:
  """True where ``num_new`` tokens after ``index`` do not fit ``max_length``.

  The error value of a traced write: elementwise over ``index`` (a scalar
  or ``[B]``) and ``num_new``; a negative index counts as overflow too.
  ``MultiHeadAttention`` keeps it (sticky) in its cache and
  ``check_cache()`` raises from it, outside the decoding step.

  Example:
    >>> cache_overflow(jnp.array([3, 7]), 2, 8)
    Array([False,  True], dtype=bool)
  """
  index = jnp.asarray(index)
  return (index < 0) | (index + jnp.asarray(num_new) > max_length)


def check_index(index, batch: int, name: str = "index") -> None:
  """``index`` is an integer scalar (shared) or ``[B]`` (one per example)."""
  shape = checks.shape_of(index)
  dtype = jnp.result_type(index)
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(
        f"{name} must be an integer scalar or [B] array (the number of "
        f"filled cache positions), got dtype {dtype} with shape {shape}. "
        "Pass e.g. jnp.int32(n).")
  if shape not in ((), (batch,)):
    raise ValueError(
        f"{name} must be an integer scalar shared by the batch or one per "
        f"example [B] = [{batch}], got shape {shape}.")


def _per_example_counts(name: str, x, batch: int, meaning: str):
  """Integer counts, a scalar or one per example ``[B]`` (lists become
  arrays); a ValueError naming ``meaning`` for another dtype or shape."""
  if isinstance(x, (list, tuple)):
    x = np.asarray(x)
  dtype = jnp.result_type(x)
  shape = checks.shape_of(x)
  if not jnp.issubdtype(dtype, jnp.integer) or shape not in ((), (batch,)):
    raise ValueError(
        f"{name} must be integer [B] = [{batch}] ({meaning}), got dtype "
        f"{dtype} with shape {shape}.")
  return x


def check_new_lengths(new_lengths, batch: int, t: int):
  """``[B]`` counts of real new tokens (right-padded), or None."""
  if new_lengths is None:
    return None
  new_lengths = _per_example_counts(
      "new_lengths", new_lengths, batch,
      "real new tokens per example, right-padded")
  checks.check_range("new_lengths", new_lengths, t)
  return jnp.asarray(new_lengths, jnp.int32)


def check_left_padding(left_padding, batch: int):
  """``[B]`` (or scalar) counts of leading pad tokens as int32 ``[B]``, or
  None; a ValueError for another dtype or shape, or a concrete negative."""
  if left_padding is None:
    return None
  left_padding = _per_example_counts(
      "left_padding", left_padding, batch,
      "leading pad tokens per example, left-padded prompts")
  if is_concrete(left_padding) and np.asarray(left_padding).min() < 0:
    raise ValueError(
        f"left_padding must be non-negative (leading pad tokens per "
        f"example), got {np.asarray(left_padding).min()}.")
  return jnp.broadcast_to(jnp.asarray(left_padding, jnp.int32), (batch,))


def _check_operands(cached_key, cached_value, index, key, value,
                    ring: bool = False) -> None:
  """The checks of ``update_kv_cache``, all at trace time but the index's."""
  arrays = (("cached_key", cached_key), ("cached_value", cached_value),
            ("key", key), ("value", value))
  for name, x in arrays:
    checks.check_float_array(name, x)
  layouts = {"cached_key": "[B, K, L, H]", "cached_value": "[B, K, L, Hv]",
             "key": "[B, K, T, H]", "value": "[B, K, T, Hv]"}
  for name, x in arrays:
    if np.ndim(x) != 4:
      hint = ("create it as jnp.zeros((B, K, max_length, H))"
              if name.startswith("cached") else
              "one token per head [B, K, H] becomes x[:, :, None, :]")
      raise ValueError(
          f"{name} must have rank 4 ({layouts[name]}), got shape "
          f"{checks.shape_of(x)}: {hint}.")
  ck, cv, k, v = (checks.shape_of(x) for _, x in arrays)
  if cv[:3] != ck[:3]:
    raise ValueError(
        f"cached_key {ck} and cached_value {cv} must share [B, K, L]: create "
        "both buffers with the same batch, heads and max_length.")
  b, heads, length = ck[:3]
  for name, shape, cache_name, cache_shape in (
      ("key", k, "cached_key", ck), ("value", v, "cached_value", cv)):
    if (shape[0], shape[1], shape[3]) != (b, heads, cache_shape[3]):
      letter = "H" if name == "key" else "Hv"
      raise ValueError(
          f"{name} with shape {shape} does not fit {cache_name} "
          f"{cache_shape}: expected [B, K, T, {letter}] = [{b}, {heads}, T, "
          f"{cache_shape[3]}] (the cache's batch, key/value heads and head "
          f"dim), got B = {shape[0]}, K = {shape[1]}, {letter} = "
          f"{shape[3]}.")
  if k[2] != v[2]:
    raise ValueError(
        f"key {k} and value {v} must bring the same number of new tokens T "
        "(axis 2).")
  if k[2] > length and not ring:
    raise ValueError(
        f"KV cache overflow: key {k} brings {k[2]} tokens but max_length is "
        f"{length} (cached_key {ck}). Create the cache with max_length >= "
        f"{k[2]} or feed the tokens in chunks.")
  check_index(index, b)


def _scatter(buffer, new, slots):
  """Writes ``new [B, K, T, H]`` at ``slots [B, T]``; slots ``>= L`` are dropped.

  A scatter with ``mode="drop"``: a slot outside the buffer writes nothing,
  where ``dynamic_update_slice`` would clamp the start and overwrite earlier
  positions.
  """
  rows = jnp.arange(buffer.shape[0])[:, None]  # [B, 1]
  new = jnp.swapaxes(new.astype(buffer.dtype), 1, 2)  # [B, T, K, H]
  return buffer.at[rows, :, slots].set(new, mode="drop")


def update_kv_cache(
    cached_key: jax.Array,
    cached_value: jax.Array,
    index: ArrayLike,
    key: jax.Array,
    value: jax.Array,
    *,
    new_lengths: ArrayLike | None = None,
    left_padding: ArrayLike | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Writes new keys/values at ``index`` and says what each query may see.

  Args:
    cached_key: float ``[B, K, L, H]``.
    cached_value: float ``[B, K, L, Hv]``, the same ``B``, ``K``, ``L``.
    index: filled positions so far: an integer scalar shared by the batch,
      or ``[B]``, one per example (ragged batches: each example writes and
      attends from its own position).
    key: float ``[B, K, T, H]`` keys of the new tokens, ``T <= L``; cast to
      ``cached_key``'s dtype.
    value: float ``[B, K, T, Hv]`` values of the new tokens; cast to
      ``cached_value``'s dtype.
    new_lengths: optional integer ``[B]``: how many of the ``T`` new tokens
      are real in each example (prompts right-padded to ``T``). Tokens past
      it are not written and their rows see nothing; the caller advances
      each example's index by its length. None means all ``T``. A
      right-padded prefill needs it: without it the pads are cached as
      tokens.
    left_padding: optional integer ``[B]``: leading pad tokens per example
      (left-padded prompts). Slots below it are never visible (the pads are
      written, and the index counts them); pass the same value at every
      call.

  Returns:
    ``(cached_key, cached_value, visible)``: the updated buffers and a bool
    mask, True where new query ``i`` may attend to cache slot ``j``
    (``left_padding <= j <= index + i``, and ``i < new_lengths``): ``[T,
    L]`` for a scalar index without ``new_lengths`` or ``left_padding``,
    else ``[B, T, L]``.

  Raises:
    TypeError: a non-float array or a non-integer ``index``.
    ValueError: wrong ranks, shapes that do not fit the cache, an index
      that is neither a scalar nor ``[B]``, or a concrete ``index`` that is
      negative or leaves no room for the new tokens. All of these are found
      at trace time. A traced ``index`` (an argument of ``jit``) cannot be:
      then an example whose write does not fit writes nothing (never
      wrapped or clamped onto earlier slots) and ``cache_overflow(index,
      new_lengths, L)`` says where, as a value, without a host callback in
      the step.

  Example:
    >>> ck = cv = jnp.zeros((1, 1, 4, 2))
    >>> new = jnp.array([5.0, 7.0])[None, None, :, None].repeat(2, -1)
    >>> ck, cv, visible = update_kv_cache(ck, cv, jnp.int32(1), new, new)
    >>> ck[0, 0, :, 0].astype(int).tolist()  # slots 1 and 2 written
    [0, 5, 7, 0]
    >>> visible.astype(int).tolist()
    [[1, 1, 0, 0], [1, 1, 1, 0]]
  """
  _check_operands(cached_key, cached_value, index, key, value)
  b, t, max_length = key.shape[0], key.shape[2], cached_key.shape[2]
  lengths = check_new_lengths(new_lengths, b, t)
  pads = check_left_padding(left_padding, b)
  check_room(index, t if lengths is None else new_lengths, max_length)
  per_example = (np.ndim(index) == 1 or lengths is not None
                 or pads is not None)
  start = jnp.broadcast_to(jnp.asarray(index, jnp.int32), (b,))[:, None]
  new = jnp.arange(t)[None, :]  # [1, T]
  real = new < (t if lengths is None else lengths[:, None])  # [B|1, T]
  slots = start + new  # [B, T]
  count = t if lengths is None else lengths[:, None]
  fits = ~cache_overflow(start, count, max_length)  # [B, 1]
  slots = jnp.where(real & fits, slots, max_length)  # else dropped
  cached_key = _scatter(cached_key, key, slots)
  cached_value = _scatter(cached_value, value, slots)
  positions = jnp.arange(max_length)[None, None, :]  # [1, 1, L]
  visible = (positions <= (start + new)[:, :, None]) & real[:, :, None]
  if pads is not None:  # pad slots stay hidden whatever the query
    visible = visible & (positions >= pads[:, None, None])
  if not per_example:
    visible = visible[0]  # [T, L], the same for every example
  return cached_key, cached_value, visible


def ring_slot_positions(index: jax.Array, num_slots: int) -> jax.Array:
  """Absolute position held by each slot of a ring buffer; -1 where empty.

  After ``index[b]`` tokens, slot ``j`` holds the latest position ``p <
  index[b]`` with ``p % W == j``.

  Args:
    index: integer ``[B]`` tokens written so far.
    num_slots: ``W``.

  Returns:
    int32 ``[B, W]``.

  Example:
    >>> ring_slot_positions(jnp.array([2, 7]), 4)
    Array([[ 0,  1, -1, -1],
           [ 4,  5,  6,  3]], dtype=int32)
  """
  slot = jnp.arange(num_slots)[None, :]  # [1, W]
  last = jnp.asarray(index, jnp.int32)[:, None] - 1  # [B, 1]
  held = slot + num_slots * jnp.floor_divide(last - slot, num_slots)
  return jnp.where(held >= 0, held, -1).astype(jnp.int32)


def update_ring_cache(
    cached_key: jax.Array,
    cached_value: jax.Array,
    index: ArrayLike,
    key: jax.Array,
    value: jax.Array,
    *,
    window: int,
    new_lengths: ArrayLike | None = None,
    left_padding: ArrayLike | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
  """A sliding-window cache: a ring buffer of ``W`` slots, any ``T`` per call.

  Position ``p`` lives in slot ``p % W``, so memory does not grow with the
  generated length. A query at position ``q`` sees keys ``q - window ..
  q``; the call's queries attend over the buffer as it was *plus* the new
  keys (``W + T`` of them), so a prompt longer than the buffer is
  prefilled in one call; afterwards only the last ``W`` real tokens are
  kept. ``window < W`` is required (a key must survive until the last
  query that may see it).

  Args:
    cached_key: float ``[B, K, W, H]``.
    cached_value: float ``[B, K, W, Hv]``.
    index: integer scalar or ``[B]``: tokens written so far per example.
    key: float ``[B, K, T, H]``.
    value: float ``[B, K, T, Hv]``.
    window: how many earlier positions a query sees (the left side of the
      layer mask's window).
    new_lengths: optional integer ``[B]``: real new tokens per example
      (right-padded), as in ``update_kv_cache``.
    left_padding: optional integer ``[B]``: leading pad tokens per example
      (left-padded prompts), as in ``update_kv_cache``: keys at positions
      below it are never visible, however the slots wrap. Pass the same
      value at every call.

  Returns:
    ``(keys [B, K, W + T, H], values [B, K, W + T, Hv], visible bool [B, T,
    W + T], key_positions int32 [B, W + T], cached_key, cached_value)``:
    what the queries attend over (the old slots, then the new tokens), what
    each query may see there, the absolute position of each of those keys
    (-1 for empty slots), and the updated buffers.

  Example:
    >>> ck = cv = jnp.zeros((1, 1, 3, 1))
    >>> new = jnp.arange(4.0).reshape(1, 1, 4, 1)  # positions 0..3
    >>> *_, ck, cv = update_ring_cache(ck, cv, 0, new, new, window=2)
    >>> ck[0, 0, :, 0].astype(int).tolist()  # slots hold positions 3, 1, 2
    [3, 1, 2]
  """
  _check_operands(cached_key, cached_value, index, key, value, ring=True)
  b, t, slots_n = key.shape[0], key.shape[2], cached_key.shape[2]
  if isinstance(window, bool) or not isinstance(window, int) or not (
      0 <= window < slots_n):
    raise ValueError(
        f"window must be an int in [0, W) = [0, {slots_n}) for a ring buffer "
        f"of W = {slots_n} slots, got {window!r}: a key must stay in the "
        "buffer until the last query that may see it.")
  lengths = check_new_lengths(new_lengths, b, t)
  pads = check_left_padding(left_padding, b)
  check_room(index, 0, np.iinfo(np.int32).max)  # refuses a negative index
  start = jnp.broadcast_to(jnp.asarray(index, jnp.int32), (b,))  # [B]
  count = jnp.full((b,), t, jnp.int32) if lengths is None else lengths
  new = jnp.arange(t)[None, :]  # [1, T]
  real = new < count[:, None]  # [B, T]
  new_pos = start[:, None] + new  # [B, T]
  old_pos = ring_slot_positions(start, slots_n)  # [B, W]
  key_pos = jnp.concatenate([old_pos, jnp.where(real, new_pos, -1)], 1)
  q_pos = new_pos[:, :, None]  # [B, T, 1]
  k_pos = key_pos[:, None, :]  # [B, 1, W + T]
  visible = ((k_pos >= 0) & (k_pos <= q_pos) & (k_pos >= q_pos - window)
             & real[:, :, None])  # [B, T, W + T]
  if pads is not None:  # pads hold positions below it, in whichever slot
    visible = visible & (k_pos >= pads[:, None, None])
  keys = jnp.concatenate([cached_key, key.astype(cached_key.dtype)], 2)
  values = jnp.concatenate([cached_value, value.astype(cached_value.dtype)], 2)
  # Only the last W real tokens are written: two of them never share a slot.
  kept = real & (new >= count[:, None] - slots_n)
  slots = jnp.where(kept, jnp.mod(new_pos, slots_n), slots_n)  # else dropped
  cached_key = _scatter(cached_key, key, slots)
  cached_value = _scatter(cached_value, value, slots)
  return keys, values, visible, key_pos, cached_key, cached_value
