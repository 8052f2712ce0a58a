"""Numerics shared by every implementation: compute dtypes, masks, garbage.

Shape glossary: T query length, S key/value length, F features; ``...``
leading dims.

Policies written once here: 16-bit and float32 inputs compute in float32,
float64 inputs in float64; masks are bool with True = may attend (integer
masks: non-zero).

Garbage (NaN or inf in a padded or masked slot: an uninitialised cache page,
a stale ring-buffer slot, another document's NaN) reaches only the rows that
may see it. Masking the logits is not enough, since a blocked entry still
meets its key and value in ``q @ k^T``, ``p @ v`` and every gradient, and
``0 * NaN`` is NaN. So every kernel computes on ``sanitize``'d operands
(non-finite entries replaced by 0: all products are finite) and records per
query row and per key column a *code* (``CLEAN``, ``BAD_VALUE``,
``BAD_KEY``); a row's code is the largest code of its own query (if it sees
any key) and of the keys it may see (``seen_codes``, or a kernel's block
walk), and ``poison`` then writes NaN into that row's output (and, for a
bad key or query, its lse, row maximum and weights). A poisoned row is a
constant: it passes no gradient back, so every other row's outputs and
gradients are those of the clean inputs, and a non-finite entry's own
gradient is 0. (The dense kernel's one-row case, a decoding step, keeps
its keys and values as given, zeroed where the row does not look, and
reads the row's code off its logits and output: the same answers, but
the gradients of entries only a poisoned row sees are NaN, not 0.)
A row that sees a bad key or value is never made finite:
that would be a silent wrong answer.
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


CLEAN, BAD_VALUE, BAD_KEY = 0.0, 1.0, 2.0  # codes; a bad query is BAD_KEY


def sanitize(query, key, value):
  """Non-finite entries replaced by 0, and the codes of rows and columns.

  ``query [..., T, H]``, ``key [..., S, H]``, ``value [..., S, Hv]``.
  Returns ``(query, key, value, q_code [..., T], kv_code [..., S])``,
  float32 codes: ``BAD_KEY`` for a query row or key row holding a NaN or
  inf, else ``BAD_VALUE`` for a value row holding one, else ``CLEAN``. The
  replacement has gradient 1 at finite entries, 0 at the others. O((T + S)
  * H): one elementwise pass each.
  """
  q_code, kv_code = codes(query, key, value)
  return (*finite_values(query, key, value), q_code, kv_code)


def finite_values(*arrays):
  """The arrays with NaN and inf replaced by 0 (gradient 1 at finite
  entries, 0 at the others): one elementwise pass each, which XLA fuses
  with a kernel's other selects on the same operand (``zero_unseen``)."""
  return tuple(jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))
               for x in arrays)


def codes(query, key, value):
  """``(q_code [..., T], kv_code [..., S])``, float32: ``BAD_KEY`` for a
  query or key row holding a NaN or inf, else ``BAD_VALUE`` for a value row
  holding one, else ``CLEAN``. A row reduction each.

  A row is bad exactly when the sum of ``x * 0`` over it is NaN (``0`` for
  a finite entry, NaN for NaN or inf): a float sum, which XLA:CPU
  vectorises, where ``all(isfinite(x), -1)`` (a boolean reduction over a
  short minor axis) runs about 4x slower."""
  def bad(x):
    return jnp.isnan(jnp.sum(x * jnp.zeros((), x.dtype), axis=-1))

  q_code = jnp.where(bad(query), BAD_KEY, CLEAN).astype(jnp.float32)
  kv_code = jnp.where(bad(key), BAD_KEY,
                      jnp.where(bad(value), BAD_VALUE, CLEAN))
  return q_code, kv_code.astype(jnp.float32)


def any_nonfinite(*arrays):
  """A bool scalar, True if any entry of the arrays may be NaN or inf: the
  predicate of a ``lax.cond`` that skips the search for the rows that see
  one when there is none.

  The sum of all entries is finite when every entry is (one read of each
  array, a reduction every backend vectorises; a per-entry test would need
  a pass writing its result, or a broadcast of zeros, on XLA:CPU). Finite
  entries whose float32 sum overflows also answer True: the search then
  runs and finds nothing, a cost and never a wrong answer.
  """
  total = jnp.zeros((), jnp.float32)
  for x in arrays:
    total = total + jnp.sum(x, dtype=jnp.float32)
  return ~jnp.isfinite(total)


def seen_codes(allowed, q_code, kv_code):
  """Each row's code: the largest of the keys it may see, and of its own
  query if it sees any key.

  ``allowed`` is bool ``[..., T, S]`` or None (every entry allowed);
  ``q_code [..., T]``, ``kv_code [..., S]`` from ``sanitize``. Returns
  float32 ``[..., T]``. One select and reduction over ``[T, S]``.
  """
  parts = [q_code[..., :, None], kv_code[..., None, :]]
  if allowed is not None:
    parts.append(allowed)
  rank = max(x.ndim for x in parts)  # leading dims broadcast from the left
  parts = [x.reshape((1,) * (rank - x.ndim) + x.shape) for x in parts]
  both = jnp.maximum(parts[0], parts[1])
  if allowed is not None:
    both = jnp.where(parts[2], both, CLEAN)
  return jnp.max(both, axis=-1, initial=CLEAN)


def seen_codes_by_rows(visible, q_code, kv_code, t: int, chunk: int = 256):
  """``seen_codes`` without a ``[T, S]`` array: ``chunk`` rows at a time.

  ``visible(start, size)`` gives rows ``[start, start + size)``'s bool
  ``[..., size, S]`` (or None: all allowed); ``q_code [..., T]``,
  ``kv_code [..., S]``. For kernels that cannot carry codes through their
  own block walk (splash, cuDNN): O(T * S) work, O(chunk * S) memory.
  """
  if t == 0:
    return jnp.zeros(q_code.shape, jnp.float32)
  size = min(chunk, t)
  count = -(-t // size)
  # The last chunk ends at row T (it may overlap the one before).
  starts = jnp.minimum(jnp.arange(count) * size, t - size)

  def part(start):
    q = jax.lax.dynamic_slice_in_dim(q_code, start, size, axis=-1)
    return seen_codes(visible(start, size), q, kv_code)  # [..., size]

  parts = jnp.moveaxis(jax.lax.map(part, starts), 0, -2)  # [..., n, size]
  rows = jnp.arange(t)
  which = jnp.minimum(rows // size, count - 1)
  return parts[..., which, rows - starts[which]]  # [..., T]


def poison(code, out, *key_stats):
  """NaN in the rows whose ``code`` (``[..., T]``) is not ``CLEAN``.

  ``out [..., T, Hv]`` becomes NaN where a row saw a bad key, value or
  query; each of ``key_stats`` (``[..., T]`` like lse and row maxima, or
  ``[..., T, S]`` like weights; None passes) only where it saw a bad key or
  query (they do not depend on the values). The NaN is a constant: those
  rows' cotangents stop here. Returns ``(out, *key_stats)``.
  """
  poisoned = []
  for i, x in enumerate((out, *key_stats)):
    bad = code >= (BAD_VALUE if i == 0 else BAD_KEY)
    if x is not None:
      bad = bad.reshape(bad.shape + (1,) * (x.ndim - bad.ndim))
      x = jnp.where(bad, jnp.asarray(jnp.nan, x.dtype), x)
    poisoned.append(x)
  return tuple(poisoned)


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


def with_sink(out, lse, sink, q_lengths=None):
  """Adds ``exp(sink)`` to each row's softmax denominator (an attention sink).

  ``out [T, Hv]`` and ``lse [T]`` are one head's attention over its keys;
  with the sink the weights become ``exp(logit - lse')`` with
  ``lse' = logaddexp(lse, sink)``, so ``out`` scales by ``exp(lse - lse')``
  (rows then sum to less than 1; a row with no visible key keeps output 0
  and gets ``lse' = sink``). Rows past ``q_lengths`` are not queries: their
  ``lse'`` stays ``-inf``. Differentiable in every argument (the gradient
  reaches the kernel through ``lse``). Returns ``(out, keep [T], lse')``,
  ``keep`` the factor applied to each row's weights.
  """
  sink = jnp.asarray(sink, lse.dtype)
  total = jnp.logaddexp(lse, sink)  # [T]
  keep = jnp.exp(lse - total)  # 0 where lse = -inf
  out = out * keep[:, None].astype(out.dtype)
  if q_lengths is not None:
    total = jnp.where(jnp.arange(lse.shape[0]) < q_lengths, total, -jnp.inf)
  return out, keep, total
