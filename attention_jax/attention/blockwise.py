"""``blockwise_attention``: the blockwise (flash) kernel, at chosen block sizes.

Shape glossary: T query length, S key/value length, N query heads, K
key/value heads, H head dim, Hv value head dim; ``...`` leading batch dims
that broadcast (e.g. ``B, N``).

``scaled_dot_product_attention`` with ``implementation=kernels.Flash(block_q,
block_k)``: the same contract and validation, no weights or dropout. The
kernel is ``kernels/flash.py``.
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

  Every mask field skips the blocks it rules out (no FLOPs, forward
  and backward) and runs blocks it fully allows without mask passes; see
  ``scaled_dot_product_attention`` for their exact meaning.

  Args:
    query: float ``[..., T, H]`` (float16, bfloat16 or float32).
    key: float ``[..., S, H]``; 4-D ``[B, K, S, H]`` against
      ``[B, N, T, H]`` queries with ``K`` dividing ``N`` is grouped-query
      attention.
    value: float ``[..., S, Hv]``.
    mask: an ``aj.Mask`` (each field skips the blocks it rules out, at no
      ``[T, S]`` cost: contiguous segment ids skip every cross-document
      block, a rule's empty blocks are skipped by its block tables), a
      dense bool/integer array broadcastable to ``[..., T, S]`` (``T x S``
      memory and a mask pass per block), or an ``aj.BlockMask``.
    bias: optional float broadcastable to ``[..., T, S]``; differentiable.
    scale: defaults to ``1/sqrt(H)``.
    is_causal: shorthand for ``mask & aj.Mask(causal=True)``.
    score_mod: ``score_mod(score, b, h, q_idx, kv_idx)`` (see
      ``scaled_dot_product_attention``), applied to each visited block's
      ``[bq, bk]`` scores with ``q_idx [bq, 1]`` and ``kv_idx [1, bk]``; the
      arrays it holds (``aj.ScoreMod``) or closes over are differentiated.
    sinks: float broadcastable to the leading dims (e.g. ``[N]``): a logit
      per head added to every row's softmax denominator; differentiable.
    block_q: query block size (clipped to T). Default by pattern (measured,
      see ``kernels.flash_core.block_sizes``): 256 for windows and segment
      ids, 512 for plain causal and a rule without tables, else 1024; a
      ``BlockMask`` fixes its own.
    block_k: key block size (clipped to S). Default 256. Lengths need not
      be multiples.
    return_lse: also return the log-sum-exp of each query row's logits.
    return_max_logits: also return each query row's largest raw logit
      ``scale * q . k`` over the keys it attends to, before the bias,
      ``score_mod`` and sinks (see ``scaled_dot_product_attention``); kept
      during the forward walk over the visited blocks.

  Returns:
    ``output [..., T, Hv]`` in the inputs' dtype, then ``lse [..., T]``
    with ``return_lse`` and ``max_logits [..., T]`` with
    ``return_max_logits``, in that order (float32; ``-inf`` for rows with
    nothing to attend to, whose output is 0). Gradients flow to query,
    key, value, bias, sinks and ``score_mod``'s arrays, through ``lse`` as
    well; ``max_logits`` has none (zero).

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
