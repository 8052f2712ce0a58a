"""Rotary position embeddings (RoPE, Su et al. 2021) as pure functions.

Shape glossary: B batch, T length, N heads, H head dim; ``...`` leading
batch dims.

RoPE encodes a token's position ``m`` by rotating pairs of query/key
features through angles ``m * theta_i``. A rotation is orthogonal, so norms
are kept, and the dot product of a query rotated by ``m`` with a key rotated
by ``n`` depends on the positions only through ``m - n``: attention scores
see relative positions. Apply it to queries and keys (not values), after
the projections and before the scores, e.g. ``apply_rope(q, pos[:, None])``
for ``[B, N, T, H]`` queries and ``[B, T]`` positions.

Packed sequences (several documents in one row, told apart by segment ids)
need positions that restart at each document: ``segment_positions``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
import numpy as np

from attention_jax import _checks


def _check_number(name: str, value) -> float:
  """A static real number (not a bool, not traced) as a Python float."""
  if isinstance(value, jax.core.Tracer):
    raise TypeError(f"{name} must be a Python number, got a traced value: "
                    "close over it or pass it as a static argument.")
  if isinstance(value, (bool, np.bool_)) or not isinstance(
      value, (int, float, np.integer, np.floating)):
    raise TypeError(f"{name} must be a real Python number, got {value!r} "
                    f"({type(value).__name__}).")
  value = float(value)
  if not np.isfinite(value):
    raise ValueError(f"{name} must be finite, got {value}.")
  return value


def _rotary_dim(head_dim: int, fraction) -> int:
  """Features rotated: ``int(H * fraction)`` rounded down to even."""
  fraction = _check_number("fraction", fraction)
  if not 0.0 < fraction <= 1.0:
    raise ValueError(f"fraction must be in (0, 1], got {fraction}.")
  rot = int(head_dim * fraction) // 2 * 2
  if rot == 0:
    raise ValueError(
        f"fraction={fraction} rotates no features of head dim H={head_dim} "
        f"(int(H * fraction) rounded down to even is 0); raise fraction.")
  return rot


def apply_rope(x: ArrayLike, positions: ArrayLike, *, base: float = 10000.0,
               fraction: float = 1.0) -> jax.Array:
  """Rotates the features of ``x`` by angles proportional to ``positions``.

  Convention ("half-split", as in Gemma, flax and most llama-in-JAX code):
  with ``rot = int(H * fraction)`` rounded down to even and ``h = rot / 2``,
  feature ``i < h`` is paired with feature ``i + h`` and the pair is
  rotated by the angle ``p * base**(-2 i / rot)`` for position ``p``::

    out[i]     = x[i] * cos - x[i + h] * sin
    out[i + h] = x[i + h] * cos + x[i] * sin

  Features ``rot:`` (partial rotary, ``fraction < 1``) pass unchanged.
  Checkpoints trained with interleaved pairs ``(x[2i], x[2i + 1])`` (GPT-J,
  GPT-NeoX's ``rotate_every_two``, Meta's original llama) need their query
  and key projection columns permuted (even features first, then odd)
  before they match this convention.

  Angles, cos and sin and the rotation are computed in float32 (float64 for
  float64 ``x``, which needs ``jax_enable_x64``); the result is cast back to
  ``x``'s dtype. float32 angles lose absolute precision at large positions
  (about ``p * 1.2e-7`` radians).

  Args:
    x: float ``[..., T, H]`` (e.g. queries or keys ``[B, N, T, H]``), ``H``
      even.
    positions: integer or float ``[..., T]``, broadcastable to
      ``x.shape[:-1]`` without growing it: ``[T]`` shared by the batch,
      ``[B, 1, T]`` per example for ``[B, N, T, H]``, ``[B, N, T]``, or a
      scalar position for every token.
    base: the wavelength base, a positive Python number (10000 in the
      paper; long-context models use larger values).
    fraction: the share of the head dim to rotate, in ``(0, 1]``.

  Returns:
    ``x`` rotated, same shape and dtype.

  Raises:
    TypeError: ``x`` not floating point, ``positions`` not integer or
      float, ``base`` or ``fraction`` not a Python number.
    ValueError: odd ``H``, ``x`` of rank < 2, ``positions`` not
      broadcastable, ``base <= 0``, ``fraction`` outside ``(0, 1]`` or
      rotating no features.

  Example:
    >>> from attention_jax.rope import apply_rope
    >>> q = jnp.ones((1, 2, 4, 8))  # [B, N, T, H]
    >>> out = apply_rope(q, jnp.arange(4))  # positions [T]
    >>> out.shape, out.dtype
    ((1, 2, 4, 8), dtype('float32'))
    >>> bool(jnp.all(out[:, :, 0] == q[:, :, 0]))  # position 0: identity
    True
    >>> apply_rope(jnp.array([[1.0, 0.0]]), jnp.array([1]), base=1.0)
    Array([[0.5403023 , 0.84147096]], dtype=float32)
  """
  x = _checks.as_array_operand("x", x, "[..., T, H]")
  _checks.check_float_array("x", x)
  _checks.check_min_rank("x", x, 2, "[..., T, H]")
  x = jnp.asarray(x)
  head_dim = x.shape[-1]
  if head_dim % 2:
    raise ValueError(f"x must have an even head dim H (features are rotated "
                     f"in pairs), got shape {x.shape} with H={head_dim}.")
  base = _check_number("base", base)
  if base <= 0.0:
    raise ValueError(f"base must be positive, got {base}.")
  rot = _rotary_dim(head_dim, fraction)

  if positions is None:
    raise TypeError("positions is None: pass integer positions [..., T].")
  if isinstance(positions, (list, tuple)):
    positions = np.asarray(positions)
  pos_dtype = jnp.result_type(positions)
  if not (jnp.issubdtype(pos_dtype, jnp.integer)
          or jnp.issubdtype(pos_dtype, jnp.floating)):
    raise TypeError(
        f"positions must be an integer or float array [..., T], got dtype "
        f"{pos_dtype} with shape {_checks.shape_of(positions)}.")
  _checks.check_broadcastable_to("positions", _checks.shape_of(positions),
                                 x.shape[:-1], "x.shape[:-1] ([..., T])")

  compute = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
  half = rot // 2
  lead = x.ndim - 1
  # Inverse frequencies in float64 NumPy (exact up to one final rounding),
  # a constant of the program: [1, ..., 1, h].
  inv_freq = base ** (-2.0 * np.arange(half, dtype=np.float64) / rot)
  inv_freq = jnp.asarray(inv_freq.reshape((1,) * lead + (half,)), compute)
  pos = jnp.asarray(positions).astype(compute)
  pos = pos.reshape((1,) * (lead - pos.ndim) + pos.shape)[..., None]
  angle = pos * inv_freq  # [..., T, h] (leading dims of 1 where shared)
  cos, sin = jnp.cos(angle), jnp.sin(angle)

  x1 = x[..., :half].astype(compute)
  x2 = x[..., half:rot].astype(compute)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin],
                            axis=-1).astype(x.dtype)
  if rot == head_dim:
    return rotated
  return jnp.concatenate([rotated, x[..., rot:]], axis=-1)


def segment_positions(segment_ids: ArrayLike) -> jax.Array:
  """Positions that restart at 0 at each new segment along the last axis.

  A segment is a run: a maximal block of equal consecutive ids, so
  ``[0, 0, 1, 1, 0]`` has three segments (positions ``[0, 1, 0, 1, 0]``).
  Padding tokens get positions like any other run; mask them out of the
  attention as usual. Vectorised: the start index of each run is carried
  forward with a cumulative maximum.

  Args:
    segment_ids: integer ``[..., T]`` ids of packed documents (e.g. ``[T]``
      or ``[B, T]``).

  Returns:
    int32 ``[..., T]``: each token's offset from the start of its run.
    Pass ``positions[:, None, :]`` to ``apply_rope`` for ``[B, N, T, H]``.

  Raises:
    TypeError: ``segment_ids`` not an integer array.
    ValueError: ``segment_ids`` a scalar.

  Example:
    >>> from attention_jax.rope import segment_positions
    >>> segment_positions(jnp.array([3, 3, 3, 7, 7, 1]))
    Array([0, 1, 2, 0, 1, 0], dtype=int32)
  """
  if segment_ids is None:
    raise TypeError("segment_ids is None: pass integer ids [..., T].")
  if isinstance(segment_ids, (list, tuple)):
    segment_ids = np.asarray(segment_ids)
  dtype = jnp.result_type(segment_ids)
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(
        f"segment_ids must be an integer array [..., T], got dtype {dtype} "
        f"with shape {_checks.shape_of(segment_ids)}.")
  _checks.check_min_rank("segment_ids", segment_ids, 1, "[..., T]")
  ids = jnp.asarray(segment_ids)
  t = ids.shape[-1]
  index = jnp.arange(t, dtype=jnp.int32).reshape((1,) * (ids.ndim - 1) + (t,))
  first = jnp.ones(ids.shape[:-1] + (min(t, 1),), jnp.bool_)
  starts = jnp.concatenate([first, ids[..., 1:] != ids[..., :-1]], axis=-1)
  run_start = jax.lax.cummax(jnp.where(starts, index, 0), axis=ids.ndim - 1)
  return index - run_start
