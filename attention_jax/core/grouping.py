"""Grouped-query attention as a reshape: N query heads over K key/value heads.

Shape glossary: T query length, S key/value length, N query heads, K
key/value heads (K divides N), G = N // K query heads per key/value head,
H head dim; ``...`` leading batch dims.

The attention functions take 4-D queries ``[B, N, T, H]`` with keys/values
``[B, K, S, H]`` (jax.nn's rule, in our layout: only in 4-D is axis 1 the
head axis; in ``[B, T, H]`` or 5-D operands a size mismatch is a broadcast
error, never read as heads). When ``K`` is neither ``N`` nor 1 (those
broadcast as they are), the head axis is split: queries become ``[..., K, G, T, H]`` and
keys/values ``[..., K, 1, S, H]``, so ordinary broadcasting shares each
key/value head with its G query heads, unmapped by ``vmap`` and never
copied; masks, biases and lengths with a head axis of N are split the same
way. Query head ``n`` uses key/value head ``n // G``, as in jax.nn and torch.
"""

from __future__ import annotations

from typing import NamedTuple

import jax


class Groups(NamedTuple):
  num_heads: int  # N
  num_kv_heads: int  # K


def find(q_shape, k_shape) -> Groups | None:
  """The grouping of ``[..., N, T, H]`` over ``[..., K, S, H]``, or None.

  None when there is nothing to group: operands that are not both 4-D, or
  ``K`` in ``(1, N)``. A ``K`` that does not divide ``N`` is left to the
  broadcast check, whose error names both shapes.
  """
  if len(q_shape) != 4 or len(k_shape) != 4:
    return None
  n, k = q_shape[-3], k_shape[-3]
  if k in (1, n) or n % k:
    return None
  return Groups(n, k)


def split(x, groups: Groups | None, axis: int):
  """Splits ``x``'s head ``axis`` (negative) of size N, K or 1 into two."""
  if x is None or groups is None or x.ndim < -axis:
    return x
  size = x.shape[axis]
  if size == groups.num_heads:
    new = (groups.num_kv_heads, size // groups.num_kv_heads)
  elif size == groups.num_kv_heads:
    new = (size, 1)
  else:  # 1: broadcast over every head
    new = (1, 1)
  pos = x.ndim + axis
  return x.reshape(x.shape[:pos] + new + x.shape[pos + 1:])


def merge(x: jax.Array | None, groups: Groups | None, axis: int):
  """Inverse of ``split`` for results: ``[..., K, G, ...] -> [..., N, ...]``."""
  if x is None or groups is None:
    return x
  pos = x.ndim + axis  # the G axis
  return x.reshape(x.shape[:pos - 1] + (x.shape[pos - 1] * x.shape[pos],)
                   + x.shape[pos + 1:])
