"""Masked softmax with a defined answer for rows that may attend to nothing.

Shape glossary: T query length, S key length.

Policy for fully masked rows: a query row whose every key is blocked (by the
mask, or by a ``-inf`` logit) gets weights that are all exactly 0, so its
attention output is 0 and every gradient through it is 0 and finite. This is
neither NaN (0/0) nor a silent uniform average over keys it was told to
ignore (what a ``-1e9`` fill gives, and what several peers return).
"""

from __future__ import annotations

import functools

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
    >>> w = masked_softmax(jnp.array([1.0, 2.0, 3.0]),
    ...                    jnp.array([True, True, False]))
    >>> w
    Array([0.26894143, 0.7310586 , 0.        ], dtype=float32)
    >>> (w == 0).tolist()  # exactly 0 where blocked
    [False, False, True]
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


def softmax_and_lse(logits: ArrayLike, allowed: ArrayLike | None = None,
                    axis: int = -1) -> tuple[jax.Array, jax.Array]:
  """``(masked_softmax, masked_logsumexp)`` for logits with no garbage.

  The fast form of the pair, for callers that know every blocked logit is
  finite or ``-inf`` (e.g. a structural mask such as causal, with padding
  zeroed). ``allowed`` becomes a ``0``/``-inf`` bias added to the logits,
  so no select sits between the scores and the softmax and XLA fuses the
  whole row pass with the products around it; a NaN or ``+inf`` logit at a
  blocked entry is therefore NOT ignored (it gives NaN), which is why
  ``masked_softmax`` keeps its selects. Otherwise the same numbers and the
  same policy: a row with nothing allowed (or all ``-inf``) gets weights 0
  and lse ``-inf``, with zero gradients. The gradient is the softmax's own,
  ``y * (dx - sum(y * dx))``, as for ``jax.nn.softmax``.

  Args:
    logits: float array, e.g. ``[T, S]`` attention scores.
    allowed: optional bool array broadcastable to ``logits``; True = may
      attend.
    axis: the axis to normalise over.

  Returns:
    ``(weights, lse)``: weights with the shape and dtype of ``logits``, lse
    without ``axis``.

  Example:
    >>> w, lse = softmax_and_lse(jnp.array([[0.0, 0.0, 5.0], [1.0, 2.0, 3.0]]),
    ...                          jnp.array([[1, 1, 0], [0, 0, 0]]))
    >>> w.tolist()  # a fully blocked row is 0, not a uniform 1/3
    [[0.5, 0.5, 0.0], [0.0, 0.0, 0.0]]
    >>> lse
    Array([0.6931472,      -inf], dtype=float32)
  """
  logits = jnp.asarray(logits)
  if allowed is not None:
    blocked = jnp.where(jnp.asarray(allowed, dtype=bool),
                        jnp.zeros((), logits.dtype),
                        jnp.asarray(-jnp.inf, logits.dtype))
    logits = logits + jnp.broadcast_to(blocked, logits.shape)
  return _softmax_and_lse(logits, axis)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _softmax_and_lse(logits, axis):
  """``softmax_and_lse`` of biased logits (blocked entries ``-inf``)."""
  finfo = jnp.finfo(logits.dtype)
  # An all -inf row has max -inf; any finite shift works there (every exp is
  # then 0). A maximum rather than a select, which would split XLA's fusion.
  row_max = jnp.maximum(jnp.max(logits, axis=axis, keepdims=True), finfo.min)
  unnormalised = jnp.exp(logits - row_max)
  # The max entry contributes exp(0) = 1, so the total is >= 1 unless the
  # row is empty: total 0, weights 0 / tiny = 0, lse finfo.min + log(0).
  total = jnp.sum(unnormalised, axis=axis, keepdims=True)
  lse = jnp.squeeze(row_max + jnp.log(total), axis)
  return unnormalised / jnp.maximum(total, finfo.tiny), lse


@_softmax_and_lse.defjvp
def _softmax_and_lse_jvp(axis, primals, tangents):
  (logits,), (dlogits,) = primals, tangents
  weights, lse = _softmax_and_lse(logits, axis)
  # Blocked entries have weight 0, so their (finite) tangents drop out.
  dlse = jnp.sum(weights * dlogits, axis=axis, keepdims=True)
  return ((weights, lse),
          (weights * (dlogits - dlse), jnp.squeeze(dlse, axis)))
