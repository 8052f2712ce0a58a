"""Score modifiers: one contract, and the built-ins (ALiBi).

Shape glossary: B batch, N query heads; T query length, S key/value length.

A score modifier is called as ``score_mod(score, b, h, q_idx, kv_idx)``:
float32 scores after scale and bias (``[T, S]`` in the dense kernel, one
visited ``[bq, bk]`` block in the blockwise ones), the int32 batch and
query-head indices of this head (scalars), and broadcast integer query and
key indices (``[T, 1]``/``[1, S]``, or the block's). It returns the
modified scores; ``-inf`` blocks an entry. Every implementation applies it
alike and differentiates the arrays it uses.

Arrays travel with the function as one value: ``ScoreMod(fn, params)`` is a
pytree (``fn`` static, ``params`` leaves), so it passes through ``jax.jit``
and into modules, and ``chain`` composes several. A plain function closing
over arrays works too (the flash kernels hoist what it closes over out of
their custom VJPs). ``alibi(slopes)`` is the built-in ALiBi.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from attention_jax import _checks


@functools.partial(jax.tree_util.register_dataclass, data_fields=["params"],
                   meta_fields=["fn"])
@dataclasses.dataclass(frozen=True, eq=False)
class ScoreMod:
  """A score modifier and the arrays it uses, as one pytree.

  Attributes:
    fn: ``fn(score, b, h, q_idx, kv_idx, params) -> score``; static (part
      of the pytree's structure, so keep one function object per rule).
    params: any pytree of arrays ``fn`` reads (e.g. a ``[buckets, N]``
      table, per-head slopes ``[N]``); differentiated like ``bias``.

  Example:
    >>> table = jnp.zeros((3,))  # [N] one learned offset per head
    >>> mod = ScoreMod(lambda s, b, h, q, k, t: s + t[h], table)
    >>> q = k = v = jnp.ones((1, 3, 4, 8))  # [B, N, T, H]
    >>> import attention_jax as aj
    >>> aj.scaled_dot_product_attention(q, k, v, score_mod=mod).shape
    (1, 3, 4, 8)
  """
  fn: Callable[..., jax.Array]
  params: Any = None

  def __call__(self, score, b, h, q_idx, kv_idx):
    return self.fn(score, b, h, q_idx, kv_idx, self.params)


def _chained(score, b, h, q_idx, kv_idx, mods):
  for mod in mods:
    score = mod(score, b, h, q_idx, kv_idx)
  return score


def chain(*mods: Callable[..., jax.Array]) -> ScoreMod:
  """Score modifiers applied in order, as one (e.g. ALiBi, then a cap).

  Example:
    >>> mod = chain(alibi(alibi_slopes(2)), lambda s, b, h, q, k: 2.0 * s)
    >>> # (1 - slope 0.0625 * distance 2) * 2, for head 0
    >>> float(mod(jnp.ones(()), 0, 0, jnp.int32(3), jnp.int32(1)))
    1.75
  """
  for n, mod in enumerate(mods):
    if not callable(mod):
      raise TypeError(f"chain's argument {n} must be a score modifier "
                      f"(callable), got {type(mod).__name__}.")
  # Plain functions become ScoreMods, so that the params are arrays only.
  return ScoreMod(_chained, tuple(
      m if isinstance(m, ScoreMod) else ScoreMod(functools.partial(plain_fn, m))
      for m in mods))


def plain_fn(mod, score, b, h, q_idx, kv_idx, params):
  """A plain ``mod(score, b, h, q_idx, kv_idx)`` as a ``ScoreMod.fn``."""
  del params  # a plain function carries no parameters of its own
  return mod(score, b, h, q_idx, kv_idx)


def alibi_slopes(num_heads: int) -> jax.Array:
  """ALiBi's per-head slopes (Press et al. 2022), float32 ``[N]``.

  A geometric sequence starting at ``2**(-8 / N)`` for ``N`` a power of
  two; otherwise the paper's interleaving of the two nearest powers.

  Example:
    >>> alibi_slopes(4)
    Array([0.25      , 0.0625    , 0.015625  , 0.00390625], dtype=float32)
  """
  _checks.check_positive_int("num_heads", num_heads)

  def powers(n):
    start = 2.0 ** (-8.0 / n)
    return [start ** (i + 1) for i in range(n)]

  closest = 2 ** math.floor(math.log2(num_heads))
  slopes = powers(closest)
  if closest < num_heads:
    slopes += powers(2 * closest)[0::2][:num_heads - closest]
  return jnp.asarray(slopes, jnp.float32)


def _alibi(score, b, h, q_idx, kv_idx, slopes):
  del b
  distance = (q_idx - kv_idx).astype(score.dtype)
  return score - slopes[h].astype(score.dtype) * distance


def alibi(slopes: jax.Array) -> ScoreMod:
  """ALiBi (Press et al. 2022): ``score - slopes[h] * (q_idx - kv_idx)``.

  Args:
    slopes: float ``[N]``, one per query head, e.g. ``alibi_slopes(N)``
      (or learned: they are differentiated).

  The penalty grows with distance into the past; a constant shift per row
  (e.g. the ``S - T`` of bottom-right alignment) does not change the
  softmax.

  Example:
    >>> import attention_jax as aj
    >>> q = k = v = jnp.ones((1, 2, 4, 8))  # [B, N, T, H]
    >>> out = aj.scaled_dot_product_attention(
    ...     q, k, v, is_causal=True, score_mod=alibi(alibi_slopes(2)))
    >>> out.shape
    (1, 2, 4, 8)
  """
  slopes = jnp.asarray(slopes)
  if slopes.ndim != 1 or not jnp.issubdtype(slopes.dtype, jnp.floating):
    raise ValueError(f"alibi takes float slopes [N], one per query head, got "
                     f"shape {slopes.shape} {slopes.dtype}: e.g. "
                     "aj.alibi(aj.alibi_slopes(num_heads)).")
  return ScoreMod(_alibi, slopes)
