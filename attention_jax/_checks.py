"""Input validation shared by the public functions.

Every check raises ``ValueError`` (shapes, values) or ``TypeError`` (dtypes)
with a message that names the argument and the shapes it got. Nothing here
uses ``assert``: validation must survive ``python -O``.

All checks look only at static information (shapes, dtypes, Python numbers),
so they run once at trace time and cost nothing inside ``jax.jit``.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


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


def shape_of(x) -> tuple[int, ...]:
  return tuple(np.shape(x))


def check_float_array(name: str, x) -> None:
  """Requires a real floating-point array (float16/bfloat16/float32/float64)."""
  dtype = jnp.result_type(x)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
        f"{name} must be a real floating-point array, got dtype {dtype} "
        f"with shape {shape_of(x)}.")


def check_min_rank(name: str, x, min_rank: int, layout: str) -> None:
  if np.ndim(x) < min_rank:
    raise ValueError(
        f"{name} must have rank >= {min_rank} ({layout}), got shape "
        f"{shape_of(x)}.")


def check_rank(name: str, x, ranks: Sequence[int], layout: str) -> None:
  if np.ndim(x) not in ranks:
    allowed = " or ".join(str(r) for r in ranks)
    raise ValueError(
        f"{name} must have rank {allowed} ({layout}), got shape "
        f"{shape_of(x)}.")


def check_mask_dtype(name: str, mask) -> None:
  """Masks are bool (True = may attend) or integer (0 = blocked)."""
  dtype = jnp.result_type(mask)
  if not (dtype == jnp.bool_ or jnp.issubdtype(dtype, jnp.integer)):
    raise TypeError(
        f"{name} must be a bool or integer array (True/non-zero = may "
        f"attend), got dtype {dtype} with shape {shape_of(mask)}. A float "
        "mask is ambiguous: pass additive values through `bias` instead.")


def compute_dtype(*xs) -> jnp.dtype:
  """float32 for float16/bfloat16/float32 inputs, float64 for float64 ones."""
  return jnp.promote_types(jnp.result_type(*xs), jnp.float32)


def as_bool_mask(mask) -> jax.Array:
  mask = jnp.asarray(mask)
  return mask if mask.dtype == jnp.bool_ else mask != 0


def broadcast_shapes(what: str, **shapes: tuple[int, ...]) -> tuple[int, ...]:
  """``jnp.broadcast_shapes`` with an error that names every operand."""
  try:
    return tuple(jnp.broadcast_shapes(*shapes.values()))
  except ValueError:
    listed = ", ".join(f"{k} {v}" for k, v in shapes.items())
    raise ValueError(f"{what} do not broadcast: {listed}.") from None


def check_broadcastable_to(name: str, shape: tuple[int, ...],
                           target: tuple[int, ...], layout: str) -> None:
  """Requires ``shape`` to broadcast to ``target`` without growing it."""
  shape = tuple(shape)
  ok = len(shape) <= len(target) and all(
      s in (1, t) for s, t in zip(reversed(shape), reversed(target)))
  if not ok:
    raise ValueError(
        f"{name} with shape {shape} is not broadcastable to {layout} = "
        f"{target}.")


def check_positive_int(name: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be a Python int, got {value!r} "
                    f"({type(value).__name__}).")
  if value <= 0:
    raise ValueError(f"{name} must be positive, got {value}.")


def check_dropout_rate(dropout_rate) -> None:
  """A Python-number rate must lie in [0, 1) (traced rates are not checked)."""
  if isinstance(dropout_rate, (int, float, np.number)) and not (
      0.0 <= float(dropout_rate) < 1.0):
    raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}.")


def check_dropout(dropout_rate, dropout_rng) -> None:
  """Rate in [0, 1); a positive rate needs a key (no silent no-op)."""
  check_dropout_rate(dropout_rate)
  if (isinstance(dropout_rate, (int, float, np.number)) and dropout_rate > 0.0
      and dropout_rng is None):
    raise ValueError(
        f"dropout_rate={dropout_rate} needs a dropout_rng (a "
        "jax.random.key); pass dropout_rate=0.0 for deterministic use.")
