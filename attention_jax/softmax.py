"""Masked softmax with a defined answer for rows that may attend to nothing.

Shape glossary: T query length, S key length.

Policy for fully masked rows: a query row whose every key is blocked (by the
mask, or by a ``-inf`` logit) gets weights that are all exactly 0, so its
attention output is 0 and every gradient through it is 0 and finite. This is
neither NaN (0/0) nor a silent uniform average over keys it was told to
ignore (what a ``-1e9`` fill gives, and what several peers return).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike


def _shifted_exp(logits, mask, axis):
  """``(exp(logits - row_max) or 0 where blocked, row sums, row_max)``."""
  logits = jnp.asarray(logits)
  allowed = logits > -jnp.inf
  if mask is not None:
    allowed = allowed & jnp.asarray(mask, dtype=bool)
  row_max = jnp.max(jnp.where(allowed, logits, -jnp.inf), axis=axis,
                    keepdims=True)
  # A fully blocked row has max -inf; any finite shift works there. The shift
  # cancels in the ratio, so it carries no gradient.
  row_max = jax.lax.stop_gradient(
      jnp.where(jnp.isfinite(row_max), row_max, 0.0))
  # The inner `where` keeps exp() away from blocked entries (which may be
  # -inf or garbage), so their cotangents are 0 rather than 0 * inf = NaN.
  shifted = jnp.where(allowed, logits - row_max, 0.0)
  unnormalised = jnp.where(allowed, jnp.exp(shifted), 0.0)
  return unnormalised, jnp.sum(unnormalised, axis=axis, keepdims=True), row_max


def masked_softmax(logits: ArrayLike, mask: ArrayLike | None = None,
                   axis: int = -1) -> jax.Array:
  """Softmax over ``axis`` that ignores blocked entries.

  Args:
    logits: float array, e.g. ``[T, S]`` attention scores. Computed in its own
      dtype; attention functions pass float32.
    mask: optional bool array broadcastable to ``logits``; True = may attend.
      Entries whose logit is ``-inf`` are blocked too.
    axis: the axis to normalise over.

  Returns:
    Weights with the shape and dtype of ``logits``: non-negative, exactly 0 at
    blocked entries, summing to 1 along ``axis``, or to 0 where every entry of
    the row is blocked.

  Example:
    >>> masked_softmax(jnp.array([1.0, 2.0, 3.0]), jnp.array([True, True, False]))
    Array([0.26894143, 0.7310586 , 0.        ], dtype=float32)
  """
  unnormalised, total, _ = _shifted_exp(logits, mask, axis)
  return unnormalised / jnp.where(total > 0, total, 1.0)


def masked_logsumexp(logits: ArrayLike, mask: ArrayLike | None = None,
                     axis: int = -1) -> jax.Array:
  """``log(sum(exp(logits)))`` over the allowed entries of ``axis``.

  The normaliser of ``masked_softmax``: ``-inf`` for a fully blocked row,
  whose gradient is then 0 (not NaN).

  Example:
    >>> masked_logsumexp(jnp.array([0.0, 0.0, 5.0]), jnp.array([1, 1, 0]))
    Array(0.6931472, dtype=float32)
  """
  _, total, row_max = _shifted_exp(logits, mask, axis)
  lse = jnp.where(total > 0, row_max + jnp.log(jnp.where(total > 0, total,
                                                         1.0)), -jnp.inf)
  return jnp.squeeze(lse, axis)
