"""Numerics shared by every implementation: compute dtypes, masks, padding.

Shape glossary: S key/value length, F features.

Policies written once here: 16-bit and float32 inputs compute in float32,
float64 inputs in float64; masks are bool with True = may attend (integer
masks: non-zero); keys that no query may see are zeroed before any product,
because a NaN or inf stored in padding would otherwise meet a zero weight and
``0 * NaN`` is NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def integer_array(name: str, x, layout: str = ""):
  """``x`` (a list read as an array) if its dtype is integer, else a
  ``TypeError`` naming ``name``, the dtype and the shape."""
  if isinstance(x, (list, tuple)):
    x = np.asarray(x)
  dtype = jnp.result_type(x)
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array{layout}, got dtype "
                    f"{dtype} with shape {np.shape(x)}.")
  return x


def compute_dtype(*xs) -> jnp.dtype:
  """float32 for float16/bfloat16/float32 inputs, float64 for float64 ones."""
  return jnp.promote_types(jnp.result_type(*xs), jnp.float32)


def as_bool_mask(mask) -> jax.Array:
  """A bool mask from a bool or integer one (0 = blocked)."""
  mask = jnp.asarray(mask)
  return mask if mask.dtype == jnp.bool_ else mask != 0


def zero_unseen(seen, *arrays):
  """Zeroes the rows of ``[..., S, F]`` arrays whose key no query may see.

  ``seen`` is ``[..., S]`` bool (True where some query may attend to key j),
  broadcastable against the arrays' leading dims. Masking the logits is not
  enough: a NaN or inf stored in a padded key or value still meets a zero
  weight in ``p @ v`` or in a gradient, and ``0 * NaN`` is NaN.
  """
  return tuple(None if x is None else
               jnp.where(seen[..., None], x, jnp.zeros((), x.dtype))
               for x in arrays)


def with_sink(out, lse, sink, q_length=None):
  """Adds ``exp(sink)`` to each row's softmax denominator (an attention sink).

  ``out [T, Hv]`` and ``lse [T]`` are one head's attention over its keys;
  with the sink the weights become ``exp(logit - lse')`` with
  ``lse' = logaddexp(lse, sink)``, so ``out`` scales by ``exp(lse - lse')``
  (rows then sum to less than 1; a row with no visible key keeps output 0
  and gets ``lse' = sink``). Rows past ``q_length`` are not queries: their
  ``lse'`` stays ``-inf``. Differentiable in every argument (the gradient
  reaches the kernel through ``lse``). Returns ``(out, keep [T], lse')``,
  ``keep`` the factor applied to each row's weights.
  """
  sink = jnp.asarray(sink, lse.dtype)
  total = jnp.logaddexp(lse, sink)  # [T]
  keep = jnp.exp(lse - total)  # 0 where lse = -inf
  out = out * keep[:, None].astype(out.dtype)
  if q_length is not None:
    total = jnp.where(jnp.arange(lse.shape[0]) < q_length, total, -jnp.inf)
  return out, keep, total
