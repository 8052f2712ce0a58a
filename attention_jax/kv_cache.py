"""A key/value cache for autoregressive decoding, as pure functions.

Shape glossary: B batch, K key/value heads, L cache capacity (max_length),
T new tokens in this call, H head dim.

The cache is a fixed-size buffer ``[B, K, L, H]`` for keys and one for values,
plus a scalar ``index``: how many positions are filled. A decoding call
writes its ``T`` new keys/values at ``[index, index + T)`` and its queries
attend to every filled position up to their own: query ``i`` (absolute
position ``index + i``) sees key ``j`` iff ``j <= index + i``. That is the
bottom-right aligned causal mask over the filled prefix, so a prompt of any
length can be prefilled in one call and then extended a token at a time, and
the result equals full causal attention over the whole sequence.

``update_kv_cache`` checks its operands before writing: the buffers are
``[B, K, L, H]`` / ``[B, K, L, Hv]`` float arrays, the new keys/values fit
them (same ``B``, ``K`` and head dims, ``T <= L``) and ``index`` is one
integer scalar. Without these checks ``dynamic_update_slice`` would broadcast,
clamp or partially fill the buffer without a word.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
import numpy as np

from attention_jax import _checks


def _raise_if_full(index, num_new: int, max_length: int) -> None:
  if int(index) < 0:
    raise ValueError(
        f"index must be non-negative (the number of filled cache positions), "
        f"got {int(index)}: a negative start would be clamped to slot 0 and "
        "overwrite the start of the cache. Start an empty cache at "
        "jnp.int32(0) and advance it by T after each call.")
  if int(index) + num_new > max_length:
    raise ValueError(
        f"KV cache overflow: {int(index)} positions are filled and this call "
        f"brings {num_new} more, but max_length is {max_length}. Call "
        "init_cache with a larger max_length.")


def check_room(index: ArrayLike, num_new: int, max_length: int) -> None:
  """Raises ``ValueError`` if ``num_new`` tokens do not fit after ``index``.

  Also raises for a negative ``index``. A concrete index (a Python int, a
  NumPy or a concrete JAX array, closed over by ``jit`` or not) is checked
  at once. A traced index (a ``jit`` argument) is not known until run time,
  so the check runs as a host callback and the error surfaces as a
  ``JaxRuntimeError`` carrying the same message, never as a silent
  wrap-around or clamped write.
  """
  if num_new > max_length:
    raise ValueError(f"KV cache overflow: a call brings {num_new} tokens but "
                     f"max_length is {max_length}.")
  if isinstance(index, jax.core.Tracer):
    jax.debug.callback(_raise_if_full, index, num_new, max_length)
  else:
    _raise_if_full(index, num_new, max_length)


def _check_index(index, batch: int) -> None:
  """``index`` is one integer scalar shared by the batch."""
  shape = _checks.shape_of(index)
  dtype = jnp.result_type(index)
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(
        f"index must be an integer scalar (the number of filled cache "
        f"positions), got dtype {dtype} with shape {shape}. Pass e.g. "
        "jnp.int32(n).")
  if len(shape) == 1:
    raise ValueError(
        f"index must be an integer scalar shared by the batch, got shape "
        f"{shape} (the cache has batch B = {batch}): per-example positions "
        "are not supported by update_kv_cache. Write every row at the same "
        "index and hide each row's unused slots with a mask or "
        "key_value_seq_lengths.")
  if shape:
    raise ValueError(
        f"index must be an integer scalar (the number of filled cache "
        f"positions), got shape {shape}.")


def _check_operands(cached_key, cached_value, index, key, value) -> None:
  """The checks of ``update_kv_cache``, all at trace time but the index's."""
  arrays = (("cached_key", cached_key), ("cached_value", cached_value),
            ("key", key), ("value", value))
  for name, x in arrays:
    _checks.check_float_array(name, x)
  layouts = {"cached_key": "[B, K, L, H]", "cached_value": "[B, K, L, Hv]",
             "key": "[B, K, T, H]", "value": "[B, K, T, Hv]"}
  for name, x in arrays:
    if np.ndim(x) != 4:
      hint = ("create it as jnp.zeros((B, K, max_length, H))"
              if name.startswith("cached") else
              "one token per head [B, K, H] becomes x[:, :, None, :]")
      raise ValueError(
          f"{name} must have rank 4 ({layouts[name]}), got shape "
          f"{_checks.shape_of(x)}: {hint}.")
  ck, cv, k, v = (_checks.shape_of(x) for _, x in arrays)
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
  if k[2] > length:
    raise ValueError(
        f"KV cache overflow: key {k} brings {k[2]} tokens but max_length is "
        f"{length} (cached_key {ck}). Create the cache with max_length >= "
        f"{k[2]} or feed the tokens in chunks.")
  _check_index(index, b)


def update_kv_cache(
    cached_key: jax.Array,
    cached_value: jax.Array,
    index: jax.Array,
    key: jax.Array,
    value: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Writes new keys/values at ``index`` and says what each query may see.

  Args:
    cached_key: float ``[B, K, L, H]``.
    cached_value: float ``[B, K, L, Hv]``, the same ``B``, ``K``, ``L``.
    index: integer scalar, filled positions so far (one for the whole batch;
      a per-example ``[B]`` index is refused).
    key: float ``[B, K, T, H]`` keys of the new tokens, ``T <= L``; cast to
      ``cached_key``'s dtype.
    value: float ``[B, K, T, Hv]`` values of the new tokens; cast to
      ``cached_value``'s dtype.

  Returns:
    ``(cached_key, cached_value, visible)``: the updated buffers and a bool
    ``[T, L]`` mask, True where new query ``i`` may attend to cache slot
    ``j`` (``j <= index + i``). The caller advances the index by ``T``.

  Raises:
    TypeError: a non-float array or a non-integer ``index``.
    ValueError: wrong ranks, shapes that do not fit the cache, a non-scalar
      ``index``, or a concrete ``index`` that is negative or leaves no room
      for ``T`` tokens. All of these are found at trace time. A traced
      ``index`` (an argument of ``jit``) cannot be: it is checked at run time
      by a host callback (``check_room``), and a negative or overflowing one
      surfaces as a ``JaxRuntimeError`` carrying the same message.

  Example:
    >>> ck = cv = jnp.zeros((1, 1, 4, 2))
    >>> new = jnp.ones((1, 1, 2, 2))
    >>> ck, cv, visible = update_kv_cache(ck, cv, jnp.int32(1), new, new)
    >>> ck[0, 0, :, 0], visible.astype(int)
    (Array([0., 1., 1., 0.], dtype=float32), Array([[1, 1, 0, 0],
           [1, 1, 1, 0]], dtype=int32))
  """
  _check_operands(cached_key, cached_value, index, key, value)
  t, max_length = key.shape[2], cached_key.shape[2]
  check_room(index, t, max_length)
  start = (0, 0, index, 0)
  cached_key = jax.lax.dynamic_update_slice(
      cached_key, key.astype(cached_key.dtype), start)
  cached_value = jax.lax.dynamic_update_slice(
      cached_value, value.astype(cached_value.dtype), start)
  positions = jnp.arange(max_length)[None, :]  # [1, L]
  visible = positions <= index + jnp.arange(t)[:, None]  # [T, L]
  return cached_key, cached_value, visible
