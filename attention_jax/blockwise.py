"""Memory-efficient (flash-style) attention: online softmax over key blocks.

Shape glossary: T query length, S key/value length, N query heads, K
key/value heads, H head dim, Hv value head dim; ``...`` leading batch dims
that broadcast (e.g. ``B, N``).

The public entry point of ``_flash``, the block core it shares with
``ring_attention``: validation, then the single-head core lifted over the
leading dims. Never more than one ``[block_q, block_k]`` block of scores per
head exists at a time; the backward pass is a custom VJP that recomputes the
blocks (FlashAttention-2).
"""

from __future__ import annotations

import functools

import jax
from jax.typing import ArrayLike

from attention_jax import _broadcast
from attention_jax import _flash
from attention_jax._patterns import BlockMask
from attention_jax._patterns import ScoreMod


def blockwise_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    mask: ArrayLike | BlockMask | None = None,
    *,
    bias: ArrayLike | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    key_value_seq_lengths: ArrayLike | None = None,
    query_seq_lengths: ArrayLike | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    query_segment_ids: ArrayLike | None = None,
    key_segment_ids: ArrayLike | None = None,
    sinks: ArrayLike | None = None,
    score_mod: ScoreMod | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Attention in O(T + S) memory: ``softmax(q k^T * scale + bias) v`` by blocks.

  Every pattern argument skips the blocks it rules out (no FLOPs, forward
  and backward) and runs blocks it fully allows without mask passes; see
  ``scaled_dot_product_attention`` for their exact meaning.

  Args:
    query: float ``[..., T, H]`` (float16, bfloat16 or float32).
    key: float ``[..., S, H]``; 4-D ``[B, K, S, H]`` against
      ``[B, N, T, H]`` queries with ``K`` dividing ``N`` is grouped-query
      attention.
    value: float ``[..., S, Hv]``.
    mask: optional bool/integer broadcastable to ``[..., T, S]`` (True = may
      attend), or a ``BlockMask`` (``block_mask``): its empty blocks are
      skipped. A dense mask costs ``T x S`` memory and a mask pass per
      block: prefer the pattern arguments, which cost neither.
    bias: optional float broadcastable to ``[..., T, S]``; differentiable.
    scale: defaults to ``1/sqrt(H)``.
    is_causal: bottom-right aligned causal mask.
    key_value_seq_lengths: optional integer array with one axis per leading
      dim (size 1 broadcasts; e.g. ``[B, 1]`` for ``[B, N, T, H]`` inputs):
      keys at positions ``>= key_value_seq_lengths`` are padding.
    query_seq_lengths: like ``key_value_seq_lengths`` for queries: rows at
      positions ``>=`` the length get output 0 (and lse ``-inf``).
    local_window_size: ``w`` or ``(left, right)`` (static): query ``i`` (at
      key position ``i' = i + S - T``) sees keys ``i' - left <= j <= i' +
      right``; with ``is_causal`` the usual causal sliding window.
    query_segment_ids: integer ``[T]`` or ``[..., T]`` (one axis per leading
      dim): packed documents; a query sees only keys of its segment.
      Contiguous segments skip every cross-document block.
    key_segment_ids: integer ``[S]`` or ``[..., S]``, with the query ids.
    sinks: float broadcastable to the leading dims (e.g. ``[N]``): a logit
      per head added to every row's softmax denominator; differentiable.
    score_mod: ``score_mod(score, b, h, q_idx, kv_idx)`` (see
      ``scaled_dot_product_attention``), applied to each visited block's
      ``[bq, bk]`` scores with ``q_idx [bq, 1]`` and ``kv_idx [1, bk]``; the
      arrays it holds (``aj.ScoreMod``) or closes over are differentiated.
    block_q: query block size (clipped to T). Default by pattern (measured,
      see ``_flash.block_sizes``): 256 for windows and segment ids, 256 for
      causal, else 1024; a ``BlockMask`` fixes its own.
    block_k: key block size (clipped to S). Default 256, 512 for plain
      causal. Lengths need not be multiples.
    return_lse: also return the log-sum-exp of each query row's logits.

  Returns:
    ``output [..., T, Hv]`` in the inputs' dtype, or ``(output, lse)`` with
    ``return_lse`` (``lse [..., T]`` float32; ``-inf`` for rows with nothing
    to attend to, whose output is 0). Gradients flow to query, key, value,
    bias, sinks and ``score_mod``'s arrays, through ``lse`` as well.

  Example:
    >>> q = jnp.ones((2, 4, 100, 16))   # [B, N, T, H]
    >>> kv = jnp.ones((2, 2, 300, 16))  # K=2 KV heads for the N=4 (GQA)
    >>> lengths = jnp.array([[300], [120]])  # [B, 1]
    >>> blockwise_attention(q, kv, kv, key_value_seq_lengths=lengths,
    ...                     block_k=128).shape
    (2, 4, 100, 16)
  """
  ops, scale, out_dtype = _flash.validate(
      "blockwise_attention", query, key, value, mask, bias, block_q, block_k,
      scale, flags={"is_causal": is_causal, "return_lse": return_lse},
      key_value_seq_lengths=key_value_seq_lengths,
      query_seq_lengths=query_seq_lengths,
      local_window_size=local_window_size,
      query_segment_ids=query_segment_ids, key_segment_ids=key_segment_ids,
      sinks=sinks, score_mod=score_mod)
  block_q, block_k = _flash.block_sizes(ops, is_causal, block_q, block_k)
  head = functools.partial(_flash.single_head, scale=scale,
                           is_causal=is_causal, window=ops.window,
                           score_mod=ops.score_mod,
                           block_q=block_q, block_k=block_k,
                           out_dtype=out_dtype)
  out, _, lse = _broadcast.lift_heads(head, ops)
  return _broadcast.results(out, None, lse, return_weights=False,
                            return_lse=return_lse)
