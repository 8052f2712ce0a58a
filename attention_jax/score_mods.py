"""Score modifiers for ``score_mod``: ALiBi and its slopes.

Shape glossary: N heads; T query length, S key/value length.

A score modifier is ``score_mod(score, q_idx, kv_idx, *score_mod_args)``:
float32 scores after scale and bias, broadcast integer query and key
indices, and the caller's arrays (each broadcast over the leading dims like
``bias``, so a per-head value is passed as ``values[:, None, None]``). It
runs on the whole ``[T, S]`` score matrix in the dense kernel and on each
visited ``[bq, bk]`` block in the blockwise ones, and is differentiated
through (its arguments get gradients).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from attention_jax import _checks


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


def alibi(score: jax.Array, q_idx: jax.Array, kv_idx: jax.Array,
          slope: jax.Array) -> jax.Array:
  """ALiBi as a ``score_mod``: ``score - slope * (q_idx - kv_idx)``.

  Pass ``score_mod=alibi, score_mod_args=(alibi_slopes(N)[:, None, None],)``
  with ``[B, N, T, H]`` inputs. The penalty grows with distance into the
  past; a constant shift per row (e.g. the ``S - T`` of bottom-right
  alignment) does not change the softmax.

  Example:
    >>> import attention_jax as aj
    >>> q = k = v = jnp.ones((1, 2, 4, 8))  # [B, N, T, H]
    >>> out = aj.scaled_dot_product_attention(
    ...     q, k, v, is_causal=True, score_mod=alibi,
    ...     score_mod_args=(alibi_slopes(2)[:, None, None],))
    >>> out.shape
    (1, 2, 4, 8)
  """
  return score - slope * (q_idx - kv_idx).astype(score.dtype)
