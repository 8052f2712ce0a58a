"""Quantised key/value storage: int8 or float8 with a scale per token and head.

Shape glossary: ``...`` leading dims (e.g. B, K key/value heads), L tokens,
H head dim.

A cache that stores keys or values ``x [..., L, H]`` quantised holds
``q [..., L, H]`` (int8 or float8_e4m3fn) and ``scale [..., L]`` float32,
one per token and key/value head, with ``x ≈ q * scale[..., None]``:

- ``int8``: symmetric, ``scale = max|x| / 127`` over H and ``q =
  round(x / scale)``; every entry is within ``scale / 2`` of ``x`` (-128 is
  never used, so ``-q`` is representable too).
- ``float8_e4m3fn``: ``scale = max|x| / 448`` (its largest finite value) and
  ``q = x / scale`` rounded to float8; an entry whose ``|x| / scale`` is at
  least 2**-6 (float8's smallest normal) is within a relative 2**-4 of
  ``x`` (3 mantissa bits, round to nearest), a smaller one within
  ``2**-10 * scale``.

A token of zeros gets scale 0 and dequantises to zeros (never 0/0). A token
with a NaN or inf gets a non-finite scale and dequantises to non-finite
values, so it stays garbage (which attention keeps from rows that may not
see it) instead of becoming a finite number made up.

These are the write and read of a quantised cache: the paged cache stores
its pages so (``init_paged_cache(..., dtype="int8")``: quantised on
``append``, dequantised page by page inside the flash walk); the linear
cache does not yet.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.core import checks

# name -> (storage dtype, the largest value q may take)
FORMATS = {"int8": (jnp.int8, 127.0),
           "float8_e4m3fn": (jnp.float8_e4m3fn, 448.0)}


def _format(name):
  if name not in FORMATS:
    raise ValueError(f"dtype must be one of {sorted(FORMATS)} (a quantised "
                     f"cache's storage), got {name!r}.")
  return FORMATS[name]


def quantize(x: jax.Array, dtype: str) -> tuple[jax.Array, jax.Array]:
  """``(q [..., L, H], scale [..., L] float32)`` with ``x ≈ q * scale``.

  Args:
    x: float ``[..., L, H]`` keys or values.
    dtype: ``"int8"`` or ``"float8_e4m3fn"``.

  Example:
    >>> q, s = quantize(jnp.array([[1.0, -0.5, 0.25], [0.0, 0.0, 0.0]]),
    ...                 "int8")
    >>> q.tolist(), s.tolist()
    ([[127, -64, 32], [0, 0, 0]], [0.007874, 0.0])
  """
  storage, top = _format(dtype)
  checks.check_float_array("x", x)
  if np.ndim(x) < 1:
    raise ValueError(f"x must be [..., L, H], got shape {np.shape(x)}.")
  x = jnp.asarray(x, jnp.float32)
  scale = jnp.max(jnp.abs(x), axis=-1) / top  # [..., L]
  # A zero token divides by 1 instead of 0 (its q is 0 either way); a
  # non-finite one keeps its NaN/inf scale.
  y = x / jnp.where(scale == 0, 1.0, scale)[..., None]
  if storage == jnp.int8:
    y = jnp.clip(jnp.round(y), -top, top)
  return y.astype(storage), scale


def dequantize(q: jax.Array, scale: jax.Array, dtype=jnp.float32
               ) -> jax.Array:
  """``q * scale[..., None]`` in ``dtype``: the inverse of ``quantize``.

  Example:
    >>> q, s = quantize(jnp.array([[1.0, -0.5, 0.25]]), "int8")
    >>> dequantize(q, s).round(3).tolist()
    [[1.0, -0.504, 0.252]]
  """
  if np.shape(scale) != np.shape(q)[:-1]:
    raise ValueError(f"scale must be q's shape without its last axis, "
                     f"{np.shape(q)[:-1]}, got {np.shape(scale)}.")
  return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)


def bytes_per_token(num_kv_heads: int, head_dim: int, dtype: str) -> int:
  """Bytes one token's keys (or values) take per layer, scales included.

  Example:
    >>> bytes_per_token(8, 128, "int8"), 8 * 128 * 2  # against bfloat16
    (1056, 2048)
  """
  checks.check_positive_int("num_kv_heads", num_kv_heads)
  checks.check_positive_int("head_dim", head_dim)
  storage, _ = _format(dtype)
  return num_kv_heads * (head_dim * jnp.dtype(storage).itemsize + 4)
