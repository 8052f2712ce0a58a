"""Custom attention patterns as block masks: ``block_mask(mask_fn, ...)``.

Shape glossary: T query length, S key/value length; bq/bk query and key
block sizes; nq = ceil(T / bq) query blocks, nk = ceil(S / bk) key blocks.

A rule the built-in arguments (``is_causal``, ``local_window_size``,
lengths, segment ids) cannot express — prefix-LM, chunked, dilated, any
predicate a user writes — is a vectorised ``mask_fn(q_idx, kv_idx) -> bool``
(True = may attend) over query and key indices ``0 <= q_idx < T``,
``0 <= kv_idx < S``. ``block_mask`` evaluates it once, in row blocks, and
classifies every ``[bq, bk]`` block as empty, partial or full; the flash
kernels then visit only the non-empty blocks (forward and backward),
evaluate ``mask_fn`` only inside partial blocks, and the dense kernel
materialises the same predicate. A ``BlockMask`` is a pytree: build it once
and reuse it across layers and steps (inside or outside ``jax.jit``).
"""

from __future__ import annotations

import jax
import numpy as np

from attention_jax import _checks
from attention_jax import _patterns

EMPTY, PARTIAL, FULL = _patterns.EMPTY, _patterns.PARTIAL, _patterns.FULL
BlockMask = _patterns.BlockMask
MaskFn = _patterns.MaskFn


def _compact(kinds: np.ndarray):
  """Per row: non-empty column indices (padded with the count), full flags."""
  rows, cols = kinds.shape
  width = max(1, int((kinds != EMPTY).sum(1).max(initial=0)))
  indices = np.full((rows, width), cols, np.int32)
  full = np.zeros((rows, width), bool)
  for r in range(rows):
    nonempty = np.flatnonzero(kinds[r] != EMPTY)
    indices[r, :nonempty.size] = nonempty
    full[r, :nonempty.size] = kinds[r, nonempty] == FULL
  return indices, full


def block_mask(mask_fn: MaskFn, q_len: int, kv_len: int, *,
               block_q: int = 256, block_k: int = 256) -> BlockMask:
  """Evaluates ``mask_fn`` once and classifies its blocks.

  Args:
    mask_fn: vectorised predicate ``mask_fn(q_idx, kv_idx) -> bool`` over
      broadcast integer index arrays (``[bq, 1]`` and ``[1, S]`` here,
      ``[bq, 1]`` and ``[1, bk]`` inside the kernels); True = may attend.
      Write it with ``jnp``/NumPy operations.
    q_len: ``T``, the query length of the calls it will serve.
    kv_len: ``S``, their key/value length.
    block_q: query block size of the blockwise kernels (clipped to ``T``).
    block_k: key block size (clipped to ``S``).

  Returns:
    A ``BlockMask`` to pass as ``mask=`` to ``scaled_dot_product_attention``,
    ``blockwise_attention``, ``multi_head_attention`` and the module.

  Raises:
    TypeError: ``mask_fn`` is not callable, returns a non-bool array, or
      depends on traced values (build the mask outside ``jax.jit``, or from
      constants).
    ValueError: non-positive lengths or block sizes, or a result that does
      not broadcast to ``[bq, S]``.

  Example:
    >>> bm = block_mask(prefix_lm_mask_fn(64), 256, 256, block_q=64,
    ...                 block_k=64)
    >>> np.asarray(bm.kinds)  # 0 empty, 1 partial, 2 full
    array([[2, 0, 0, 0],
           [2, 1, 0, 0],
           [2, 2, 1, 0],
           [2, 2, 2, 1]], dtype=int8)
  """
  if not callable(mask_fn):
    raise TypeError(f"mask_fn must be callable (q_idx, kv_idx) -> bool, got "
                    f"{type(mask_fn).__name__}.")
  for name, value in (("q_len", q_len), ("kv_len", kv_len),
                      ("block_q", block_q), ("block_k", block_k)):
    _checks.check_positive_int(name, value)
  bq, bk = min(block_q, q_len), min(block_k, kv_len)
  nq, nk = -(-q_len // bq), -(-kv_len // bk)
  cols = np.arange(kv_len)[None, :]
  kinds = np.zeros((nq, nk), np.int8)
  for i in range(nq):
    rows = np.arange(i * bq, min((i + 1) * bq, q_len))[:, None]
    try:
      allowed = np.asarray(mask_fn(rows, cols))
    except jax.errors.TracerArrayConversionError:
      raise TypeError(
          "block_mask evaluates mask_fn eagerly, once: it must not depend "
          "on traced values. Build the BlockMask outside jax.jit (or from "
          "constants) and pass it in.") from None
    if allowed.dtype != np.bool_:
      raise TypeError(f"mask_fn must return a bool array, got dtype "
                      f"{allowed.dtype} with shape {allowed.shape}.")
    try:
      allowed = np.broadcast_to(allowed, (rows.shape[0], kv_len))
    except ValueError:
      raise ValueError(
          f"mask_fn(q_idx [{rows.shape[0]}, 1], kv_idx [1, {kv_len}]) "
          f"returned shape {allowed.shape}, which does not broadcast to "
          f"[{rows.shape[0]}, {kv_len}].") from None
    pad = nk * bk - kv_len
    blocks = np.pad(allowed, ((0, 0), (0, pad))).reshape(-1, nk, bk)
    valid = np.pad(np.ones(kv_len, bool), (0, pad)).reshape(nk, bk)
    some = blocks.any(axis=(0, 2))
    every = (blocks | ~valid[None]).all(axis=(0, 2))
    kinds[i] = np.where(every, FULL, np.where(some, PARTIAL, EMPTY))
  kv_indices, kv_full = _compact(kinds)
  q_indices, q_full = _compact(kinds.T)
  return BlockMask(mask_fn, q_len, kv_len, bq, bk, kinds, kv_indices, kv_full,
                   q_indices, q_full)


def prefix_lm_mask_fn(prefix_len: int) -> MaskFn:
  """Prefix-LM: every query sees the first ``prefix_len`` keys, then causal.

  Query ``i`` may see key ``j`` iff ``j < prefix_len`` or ``j <= i`` (for
  ``T == S``: a bidirectional prefix followed by causal generation).

  Example:
    >>> prefix_lm_mask_fn(2)(np.arange(4)[:, None], np.arange(4)[None, :])
    array([[ True,  True, False, False],
           [ True,  True, False, False],
           [ True,  True,  True, False],
           [ True,  True,  True,  True]])
  """
  _checks.check_positive_int("prefix_len", prefix_len)

  def mask_fn(q_idx, kv_idx):
    return (kv_idx < prefix_len) | (kv_idx <= q_idx)

  return mask_fn


def chunked_mask_fn(chunk: int) -> MaskFn:
  """Chunked attention: query ``i`` sees key ``j`` iff both lie in one chunk.

  Chunks are ``[c * chunk, (c + 1) * chunk)``; with ``is_causal=True`` it is
  the chunked-causal attention of Llama 4's local layers.

  Example:
    >>> chunked_mask_fn(2)(np.arange(4)[:, None], np.arange(4)[None, :])
    array([[ True,  True, False, False],
           [ True,  True, False, False],
           [False, False,  True,  True],
           [False, False,  True,  True]])
  """
  _checks.check_positive_int("chunk", chunk)

  def mask_fn(q_idx, kv_idx):
    return (q_idx // chunk) == (kv_idx // chunk)

  return mask_fn
