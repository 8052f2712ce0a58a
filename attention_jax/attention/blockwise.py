"""``blockwise_attention``: the blockwise (flash) kernel, at chosen block sizes.

Shape glossary: T query length, S key/value length, N query heads, K
key/value heads, H head dim, Hv value head dim; ``...`` leading batch dims
that broadcast (e.g. ``B, N``).

``scaled_dot_product_attention`` with ``implementation=kernels.Flash(block_q,
block_k)``: the same options (docs/options.md), contract and validation, no
weights or dropout. The kernel is ``kernels/flash.py``.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.typing import ArrayLike

from attention_jax.attention import dot_product
from attention_jax.kernels import flash
from attention_jax.masking.mask import BlockMask
from attention_jax.masking.mask import Mask


def blockwise_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    mask: Mask | ArrayLike | BlockMask | None = None,
    *,
    bias: ArrayLike | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    score_mod: Any = None,
    sinks: ArrayLike | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    return_lse: bool = False,
    return_max_logits: bool = False,
) -> jax.Array | tuple[jax.Array, ...]:
  """Attention in O(T + S) memory: ``softmax(q k^T * scale + bias) v`` by blocks.

  ``aj.scaled_dot_product_attention`` with
  ``implementation=aj.kernels.Flash(block_q, block_k)``: every mask field
  but a dense array skips the blocks it rules out (no FLOPs, forward and
  backward) and runs the blocks it fully allows without a mask pass; a
  dense mask costs ``[T, S]`` memory and a mask pass per block. No
  weights, dropout or float64 (use sdpa).

  Args:
    block_q: query block size (clipped to T). None: the pair
      ``aj.kernels.autotune`` cached for this machine and call, else a
      default by pattern (``kernels.flash_core.block_sizes``); a
      ``BlockMask`` fixes its own.
    block_k: key block size (clipped to S), chosen likewise. Lengths need
      not be multiples of either.

  Other arguments (query, key, value, mask, bias, scale, is_causal,
  score_mod, sinks, return_lse, return_max_logits), the return values
  (output, then lse and max_logits as asked) and the errors: as
  ``aj.scaled_dot_product_attention`` (docs/options.md).

  Example:
    >>> q = jnp.ones((2, 4, 100, 16))   # [B, N, T, H]
    >>> kv = jnp.ones((2, 2, 300, 16))  # K=2 KV heads for the N=4 (GQA)
    >>> padding = aj.Mask(kv_lengths=jnp.array([300, 120]))  # [B]
    >>> blockwise_attention(q, kv, kv, padding, block_k=128).shape
    (2, 4, 100, 16)
  """
  out, _, lse, max_logits = dot_product.run(
      query, key, value, mask, bias=bias, scale=scale, is_causal=is_causal,
      score_mod=score_mod, sinks=sinks, return_lse=return_lse,
      return_max_logits=return_max_logits,
      implementation=flash.Flash(block_q, block_k))
  extra = (lse,) * bool(return_lse) + (max_logits,) * bool(return_max_logits)
  return (out, *extra) if extra else out
