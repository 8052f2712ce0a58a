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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike


def _raise_if_full(index, num_new: int, max_length: int) -> None:
  if int(index) + num_new > max_length:
    raise ValueError(
        f"KV cache overflow: {int(index)} positions are filled and this call "
        f"brings {num_new} more, but max_length is {max_length}. Call "
        "init_cache with a larger max_length.")


def check_room(index: ArrayLike, num_new: int, max_length: int) -> None:
  """Raises ``ValueError`` if ``num_new`` tokens do not fit after ``index``.

  Eagerly it raises at once. Under ``jit`` the index is not known until run
  time, so the check runs as a host callback and the error surfaces as a
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


def update_kv_cache(
    cached_key: jax.Array,
    cached_value: jax.Array,
    index: jax.Array,
    key: jax.Array,
    value: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Writes new keys/values at ``index`` and says what each query may see.

  Args:
    cached_key: ``[B, K, L, H]``.
    cached_value: ``[B, K, L, H]``.
    index: int32 scalar, filled positions so far.
    key: ``[B, K, T, H]`` keys of the new tokens.
    value: ``[B, K, T, H]`` values of the new tokens.

  Returns:
    ``(cached_key, cached_value, visible)``: the updated buffers and a bool
    ``[T, L]`` mask, True where new query ``i`` may attend to cache slot
    ``j`` (``j <= index + i``). The caller advances the index by ``T``.

  Example:
    >>> ck = cv = jnp.zeros((1, 1, 4, 2))
    >>> new = jnp.ones((1, 1, 2, 2))
    >>> ck, cv, visible = update_kv_cache(ck, cv, jnp.int32(1), new, new)
    >>> ck[0, 0, :, 0], visible.astype(int)
    (Array([0., 1., 1., 0.], dtype=float32), Array([[1, 1, 0, 0],
           [1, 1, 1, 0]], dtype=int32))
  """
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
