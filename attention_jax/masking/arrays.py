"""Attention masks: causal, padding, and their combinations.

Shape glossary: B batch, T query length, S key/value length.

Convention (everywhere in attention_jax): a mask is boolean and True means
"this query may attend to this key". Integer masks are accepted by the
attention functions, with 0 meaning blocked (the lesson's
``masked_fill(mask == 0, ...)``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from attention_jax.core import checks
from attention_jax.masking import intervals


def causal_mask(q_len: int, kv_len: int | None = None) -> jax.Array:
  """Causal mask aligned to the bottom-right corner.

  Query ``i`` may attend to key ``j`` when ``j <= i + (S - T)``: the last query
  sees every key, so a chunk of ``T`` new tokens at the end of a cache of
  ``S`` keys is causal against everything before it. With ``T == S`` this is
  the lower triangle. With ``T > S`` the first ``T - S`` rows see nothing
  (their attention output is 0; see ``masked_softmax``).

  Args:
    q_len: ``T``, number of queries (positive int).
    kv_len: ``S``, number of keys; defaults to ``q_len``.

  Returns:
    bool ``[T, S]``.

  Example:
    >>> causal_mask(2, 3).astype(int)
    Array([[1, 1, 0],
           [1, 1, 1]], dtype=int32)
  """
  kv_len = q_len if kv_len is None else kv_len
  checks.check_positive_int("q_len", q_len)
  checks.check_positive_int("kv_len", kv_len)
  rows = jnp.arange(q_len)[:, None]  # [T, 1]
  cols = jnp.arange(kv_len)[None, :]  # [1, S]
  return intervals.visible(rows, cols, kv_len - q_len,
                           intervals.bounds(True, None))  # [T, S]


def padding_mask(lengths: ArrayLike, max_len: int) -> jax.Array:
  """Marks the valid (non-padding) positions of right-padded sequences.

  Args:
    lengths: integer ``[B]``, the number of valid tokens in each sequence,
      in ``[0, max_len]`` (a concrete length outside it is refused: it
      would be a sequence longer than the padded one; traced lengths above
      ``max_len`` mark every position valid).
    max_len: the padded length (positive int).

  Returns:
    bool ``[B, max_len]``, True at positions ``< lengths[b]``.

  Example:
    >>> padding_mask(jnp.array([1, 3]), 3).astype(int)
    Array([[1, 0, 0],
           [1, 1, 1]], dtype=int32)
  """
  checks.check_positive_int("max_len", max_len)
  lengths = checks.integer_array("lengths", lengths)
  checks.check_rank("lengths", lengths, (1,), "[B]")
  checks.check_range(
      "lengths", lengths, max_len,
      f": a length past max_len={max_len} would be clipped silently; pass "
      "max_len >= the longest sequence")
  lengths = jnp.asarray(lengths)
  return jnp.arange(max_len)[None, :] < lengths[:, None]  # [B, max_len]


def make_attention_mask(query_valid: ArrayLike,
                        key_valid: ArrayLike) -> jax.Array:
  """Pairwise mask from per-token validity: query t may see key s iff both are valid.

  Args:
    query_valid: bool or integer ``[B, T]`` (non-zero = real token).
    key_valid: bool or integer ``[B, S]``.

  Returns:
    bool ``[B, 1, T, S]``, ready to broadcast over the head axis.

  Example:
    >>> q = padding_mask(jnp.array([2]), 2)
    >>> k = padding_mask(jnp.array([1]), 3)
    >>> make_attention_mask(q, k)[0, 0].astype(int)
    Array([[1, 0, 0],
           [1, 0, 0]], dtype=int32)
  """
  checks.check_mask_dtype("query_valid", query_valid)
  checks.check_mask_dtype("key_valid", key_valid)
  checks.check_rank("query_valid", query_valid, (2,), "[B, T]")
  checks.check_rank("key_valid", key_valid, (2,), "[B, S]")
  qb, kb = checks.shape_of(query_valid)[0], checks.shape_of(key_valid)[0]
  if qb != kb and 1 not in (qb, kb):
    raise ValueError(
        f"query_valid {checks.shape_of(query_valid)} and key_valid "
        f"{checks.shape_of(key_valid)} have different batch sizes.")
  q = checks.as_bool_mask(query_valid)
  k = checks.as_bool_mask(key_valid)
  return (q[:, None, :, None] & k[:, None, None, :])  # [B, 1, T, S]


def combine_masks(*masks: ArrayLike | None) -> jax.Array | None:
  """Logical AND of masks that broadcast together; ``None`` values are ignored.

  Args:
    *masks: bool or integer arrays (non-zero = may attend), or ``None``.

  Returns:
    The broadcast bool mask, or ``None`` when every argument is ``None``.

  Example:
    >>> pad = make_attention_mask(jnp.ones((1, 2), bool), jnp.array([[1, 0]]))
    >>> combine_masks(pad, None, causal_mask(2))[0, 0].astype(int)
    Array([[1, 0],
           [1, 0]], dtype=int32)
  """
  present = [m for m in masks if m is not None]
  if not present:
    return None
  for i, m in enumerate(present):
    checks.check_mask_dtype(f"masks[{i}]", m)
  shape = checks.broadcast_shapes(
      "combine_masks arguments",
      **{f"masks[{i}]": checks.shape_of(m) for i, m in enumerate(present)})
  # Explicit broadcast: callers may run with jax_numpy_rank_promotion="raise".
  out = jnp.ones(shape, bool)
  for m in present:
    out = out & jnp.broadcast_to(checks.as_bool_mask(m), shape)
  return out
