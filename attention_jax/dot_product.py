"""Scaled dot-product attention: ``softmax(Q K^T / sqrt(d_k)) V``, and dispatch.

Shape glossary: B batch, T query length, S key/value length, N query heads,
K key/value heads, H head dim (of queries and keys), Hv value head dim, D
model dim. ``...`` is any number of leading batch dimensions (e.g. ``B, N``)
that broadcast.

``scaled_dot_product_attention`` is the one public entry point over every
implementation: it validates the operands (``_checks``), picks an
implementation and runs it. The kernels never import this module:

* ``dense`` (``_dense``): the ``[T, S]`` scores of one head at once; weights,
  dropout and float64 live only here.
* ``blockwise`` (``blockwise`` over ``_flash``): online softmax by blocks,
  O(T + S) memory, the FlashAttention-2 backward.
* ``cudnn`` (``_cudnn``): jax.nn's fused GPU kernel.

``ring_attention`` runs the same ``_flash`` core across devices. Every
implementation honours one contract (masks True = may attend, bottom-right
causal, a query with nothing to attend to gets output 0 and lse ``-inf``
with zero gradients, float32 compute for 16-bit inputs), checked by one
shared test suite.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from attention_jax import _broadcast
from attention_jax import _checks
from attention_jax import _cudnn
from attention_jax import _dense
from attention_jax import _numerics
from attention_jax import blockwise
from attention_jax._patterns import BlockMask
from attention_jax._patterns import ScoreMod

IMPLEMENTATIONS = ("dense", "blockwise", "cudnn")
# Below this many scores per head the dense path is as fast (see the
# performance page of the docs) and also yields the weights.
BLOCKWISE_MIN_SCORES = 1024 * 1024


def choose_implementation(implementation, query, key, value, mask, bias,
                          lengths, *, return_weights: bool, dropout_on: bool,
                          return_lse: bool, structured=None,
                          is_causal: bool = False) -> str:
  """The implementation to run, or a ``ValueError`` saying why not.

  ``structured`` maps the pattern arguments in use to their values; the
  automatic choice only picks an implementation that takes all of them.
  """
  structured = structured or {}
  if implementation is not None and implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be None or one of "
                     f"{IMPLEMENTATIONS}, got {implementation!r}.")
  if implementation in ("blockwise", "cudnn"):
    if dropout_on:
      raise ValueError(f"implementation={implementation!r} has no dropout; "
                       "use 'dense' or dropout_rate=0.")
    if return_weights:
      raise ValueError(f"implementation={implementation!r} never forms the "
                       "attention weights; use implementation='dense' (or "
                       "None) with return_weights=True.")
  if implementation == "cudnn":
    problem = _cudnn.problem(query, key, value, mask, bias, lengths,
                             return_lse, structured, is_causal=is_causal)
    if problem:
      raise ValueError(f"implementation='cudnn' is not possible: {problem}.")
  if implementation is not None:
    return implementation
  t, s = _checks.shape_of(query)[-2], _checks.shape_of(key)[-2]
  if return_weights or dropout_on or t * s < BLOCKWISE_MIN_SCORES:
    return "dense"
  if _cudnn.problem(query, key, value, mask, bias, lengths, return_lse,
                    structured, is_causal=is_causal) is None:
    return "cudnn"
  if jnp.result_type(query, key, value) == jnp.float64:
    return "dense"  # blockwise computes in float32
  return "blockwise"


def scaled_dot_product_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    mask: ArrayLike | BlockMask | None = None,
    *,
    bias: ArrayLike | None = None,
    scale: float | ArrayLike | None = None,
    is_causal: bool = False,
    key_value_seq_lengths: ArrayLike | None = None,
    query_seq_lengths: ArrayLike | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    query_segment_ids: ArrayLike | None = None,
    key_segment_ids: ArrayLike | None = None,
    sinks: ArrayLike | None = None,
    score_mod: ScoreMod | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    implementation: str | None = None,
    return_weights: bool = False,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, ...]:
  """``softmax(query @ key^T * scale + bias, where=mask) @ value``.

  Args:
    query: float ``[..., T, H]``.
    key: float ``[..., S, H]``. 4-D queries ``[B, N, T, H]`` against keys
      ``[B, K, S, H]`` with ``K`` dividing ``N`` is grouped-query
      attention: query head ``n`` uses key/value head ``n // (N / K)``
      (only in 4-D is axis 1 read as heads, as in jax.nn).
    value: float ``[..., S, Hv]``; ``Hv`` may differ from ``H``.
    mask: optional bool, or integer with 0 = blocked, broadcastable to
      ``[..., T, S]``. True (non-zero) = the query may attend to the key.
      Or a ``BlockMask`` from ``block_mask(mask_fn, T, S)`` (any rule
      ``mask_fn(b, h, q_idx, kv_idx)``, evaluated once; the blockwise path skips
      its empty blocks).
    bias: optional float added to the logits (after scaling), broadcastable to
      ``[..., T, S]``; e.g. ALiBi or relative-position terms. ``-inf`` entries
      block like a False mask.
    scale: multiplier of ``query @ key^T``; defaults to ``1 / sqrt(H)``.
    is_causal: if True, query ``i`` may attend to key ``j`` only when
      ``j <= i + (S - T)`` (bottom-right aligned; see ``causal_mask``).
      Combined with ``mask`` by logical AND.
    key_value_seq_lengths: optional integer array with one axis per leading
      dim of the operands (size 1 broadcasts; e.g. ``[B, 1]`` for
      ``[B, N, T, H]`` inputs) or a scalar, in ``[0, S]`` (checked when
      concrete; traced values clip): keys at positions ``>=`` the length are
      padding. Costs no ``[T, S]`` memory in the blockwise path.
    query_seq_lengths: the same for queries: rows at positions ``>=`` the
      length get output 0, weights 0 and lse ``-inf``.
    local_window_size: ``w`` or ``(left, right)`` (jax.nn's argument,
      static): query ``i``, at key position ``i' = i + S - T``, sees keys
      ``i' - left <= j <= i' + right``. With ``is_causal=True`` and
      ``(W - 1, 0)`` it is the causal sliding window of ``W`` tokens.
    query_segment_ids: integer ``[T]`` (shared) or ``[..., T]`` (one axis
      per leading dim, e.g. ``ids[:, None, :]`` for ``[B, N, T, H]``):
      packed documents. A query sees only keys with the same id; combines
      with causal, windows and lengths. Contiguous segments make the
      blockwise path skip every cross-document block.
    key_segment_ids: integer ``[S]`` or ``[..., S]``; required with
      ``query_segment_ids`` (the same array for packed self-attention).
    sinks: float broadcastable to the leading dims (``[N]`` or ``[B, N]``
      for ``[B, N, T, H]``): per-head sink logits; ``exp(sink)`` joins every
      row's softmax denominator, so weights sum to less than 1 (gpt-oss's
      learned sinks). Differentiable. The returned lse includes the sink.
    score_mod: ``score_mod(score, b, h, q_idx, kv_idx)`` returns modified
      float32 scores (after scale and bias; ``aj.soft_cap(c)`` caps): ``b`` and
      ``h`` are the int32 batch and query-head indices (of ``[B, N, T, H]``
      operands: the last leading axis is ``h``, the one before ``b``; with
      one leading axis, ``b`` and ``h = 0``), ``q_idx``/``kv_idx`` broadcast
      integer query/key indices (``[T, 1]`` and ``[1, S]``, or one block's).
      ``-inf`` blocks an entry. Arrays travel inside it: ``aj.ScoreMod(fn,
      params)`` (a pytree; ``aj.alibi(slopes)``, ``aj.t5_relative_bias``)
      or a plain closure (not in ``ring_attention``, which needs them as a
      ``ScoreMod``); they are differentiated in every implementation.
    dropout_rate: probability of dropping an attention weight, in ``[0, 1)``.
      Kept weights are scaled by ``1 / (1 - dropout_rate)``.
    dropout_rng: ``jax.random.key``; required when ``dropout_rate > 0``.
    implementation: ``"dense"`` (materialises the ``[T, S]`` weights),
      ``"blockwise"`` (``blockwise_attention``: O(T + S) memory, no weights,
      no dropout), ``"cudnn"`` (``jax.nn.dot_product_attention``'s fused GPU
      kernel: GPU, float16/bfloat16, ``[B, N, T, H]`` inputs, H <= 128 and a
      multiple of 8, lengths ``[B, 1]`` and causal windows with ``T == S``;
      no weights, dropout, lse, segment ids, sinks, ``score_mod``
      or block masks) or ``None``: dense when
      weights or dropout are asked for or ``T * S`` is below
      ``BLOCKWISE_MIN_SCORES``; otherwise cuDNN where its constraints hold,
      else blockwise. Every path gives the same numbers within float32
      rounding (tested).
    return_weights: also return the attention weights (dense only).
    return_lse: also return the log-sum-exp of each row's allowed logits.

  The leading dimensions ``...`` of all operands broadcast like NumPy's.
  Static arguments for ``jax.jit``: ``scale`` (if a Python float),
  ``is_causal``, ``dropout_rate``, ``implementation``, ``return_weights``,
  ``return_lse``.

  Returns:
    ``output`` ``[..., T, Hv]`` in the promoted dtype of the inputs; with
    ``return_weights=True`` also ``weights`` ``[..., T, S]``, the softmax
    probabilities before dropout (rows sum to 1, or are all 0 for a query
    that may attend to nothing, whose output is then 0); with
    ``return_lse=True`` also ``lse`` ``[..., T]`` (``-inf`` for such rows).
    Weights and lse are float32 (float64 for float64 inputs). Order:
    ``output``, ``(output, weights)``, ``(output, lse)`` or
    ``(output, weights, lse)``.

  Raises:
    TypeError: non-float query/key/value/bias, a mask that is neither bool
      nor integer, non-integer lengths.
    ValueError: ranks below 2, ``H`` or ``S`` mismatches, leading dims or
      masks/biases that do not broadcast, a dropout rate outside ``[0, 1)``
      or a positive rate without ``dropout_rng``, an implementation that
      cannot do what was asked.

  Example:
    >>> q = jnp.ones((2, 4, 8))   # [B, T, H]
    >>> kv = jnp.ones((2, 6, 8))  # [B, S, H]
    >>> scaled_dot_product_attention(q, kv, kv, is_causal=True).shape
    (2, 4, 8)
    >>> out, w = scaled_dot_product_attention(q, kv, kv, return_weights=True)
    >>> w.shape
    (2, 4, 6)
  """
  query, key, value = (_checks.as_array_operand(name, x, layout)
                       for name, x, layout in (("query", query, "[..., T, H]"),
                                               ("key", key, "[..., S, H]"),
                                               ("value", value,
                                                "[..., S, Hv]")))
  for name, flag in (("is_causal", is_causal),
                     ("return_weights", return_weights),
                     ("return_lse", return_lse)):
    _checks.check_static_bool(name, flag)
  ops = _checks.attention_operands(
      query, key, value, mask, bias,
      key_value_seq_lengths=key_value_seq_lengths,
      query_seq_lengths=query_seq_lengths,
      local_window_size=local_window_size,
      query_segment_ids=query_segment_ids, key_segment_ids=key_segment_ids,
      sinks=sinks, score_mod=score_mod)
  _checks.check_dropout(dropout_rate, dropout_rng)
  dropout_on = not (isinstance(dropout_rate, (int, float))
                    and dropout_rate == 0.0)
  # The cuDNN kernel takes the caller's operands (jax.nn groups heads
  # itself), not the grouped ones.
  raw_mask = None
  if mask is not None and ops.block_mask is None:
    raw_mask = _numerics.as_bool_mask(mask)
  raw_lengths = _checks.check_lengths("key_value_seq_lengths",
                                      key_value_seq_lengths)
  structured = {"query_seq_lengths": query_seq_lengths,
                "local_window_size": ops.window,
                "query_segment_ids": query_segment_ids,
                "key_segment_ids": key_segment_ids,
                "sinks": sinks,
                "score_mod": score_mod, "block_mask": ops.block_mask}
  implementation = choose_implementation(
      implementation, query, key, value, raw_mask, bias, raw_lengths,
      return_weights=return_weights, dropout_on=dropout_on,
      return_lse=return_lse, is_causal=is_causal,
      structured={k: x for k, x in structured.items() if x is not None})
  if scale is None:
    scale = 1.0 / math.sqrt(_checks.shape_of(query)[-1])
  if implementation == "blockwise":
    return blockwise.blockwise_attention(
        query, key, value, mask, bias=bias, scale=scale, is_causal=is_causal,
        key_value_seq_lengths=key_value_seq_lengths,
        query_seq_lengths=query_seq_lengths, local_window_size=ops.window,
        query_segment_ids=query_segment_ids, key_segment_ids=key_segment_ids,
        sinks=sinks, score_mod=score_mod, return_lse=return_lse)
  if implementation == "cudnn":
    q_lengths = _checks.check_lengths("query_seq_lengths", query_seq_lengths)
    return _cudnn.attention(
        jnp.asarray(query), jnp.asarray(key), jnp.asarray(value), raw_mask,
        None if bias is None else jnp.asarray(bias), raw_lengths, q_lengths,
        scale=scale, is_causal=is_causal, window=ops.window)
  keep = None
  if dropout_rng is not None and dropout_on:
    t, s = _checks.shape_of(query)[-2], _checks.shape_of(key)[-2]
    keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate,
                                ops.batch_shape + (t, s))  # [..., T, S]
  out_dtype = jnp.result_type(query, key, value)

  def head(q, k, v, h, kp):
    return _dense.single_head(
        q, k, v, h, kp, scale=scale, is_causal=is_causal, window=ops.window,
        score_mod=ops.score_mod,
        dropout_rate=dropout_rate, out_dtype=out_dtype,
        compute_dtype=_numerics.compute_dtype(out_dtype),
        want_lse=return_lse)

  out, weights, lse = _broadcast.lift_heads(head, ops, (keep,), (2,))
  return _broadcast.results(out, weights, lse, return_weights=return_weights,
                            return_lse=return_lse)
