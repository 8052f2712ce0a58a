"""Scaled dot-product attention: ``softmax(Q K^T / sqrt(d_k)) V``.

Shape glossary: B batch, T query length, S key/value length, N query heads,
K key/value heads, H head dim (of queries and keys), D model dim. ``...`` is
any number of leading batch dimensions (e.g. ``B, N``) that broadcast.

The maths is written once, for a single head (``_single_head_attention``:
``[T, H]`` queries, ``[S, H]`` keys), and lifted to any leading dimensions by
one ``jax.vmap`` per dimension (``_broadcast.broadcast_vmap``).

Numerics: whatever the input dtype (float16, bfloat16 included), logits are
accumulated, scaled, biased, masked and soft-maxed in float32 (float64 when
the inputs are float64); the weighted sum of values accumulates in that
precision and is cast back to the inputs' dtype at the very end. There is one
path: the numbers do not change when the weights are returned or dropout is
switched on.

Fully masked rows: a query that may attend to no key gets all-zero weights
and a zero output, with zero (finite) gradients; see ``softmax.py``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from attention_jax import _broadcast
from attention_jax import _checks
from attention_jax import masks
from attention_jax import softmax


def _single_head_attention(query, key, value, mask, bias, keep, *, scale,
                           is_causal, dropout_rate, out_dtype, f32):
  """One head, one example. Shapes: q [T, H], k [S, H], v [S, Hv].

  ``f32`` is the compute dtype: float32, or float64 for float64 inputs.
  """
  t, s = query.shape[0], key.shape[0]
  logits = jnp.einsum("TH,SH->TS", query, key,
                      preferred_element_type=f32)  # [T, S]
  logits = logits * jnp.asarray(scale, f32)
  if bias is not None:
    logits = logits + jnp.broadcast_to(bias.astype(f32), (t, s))
  allowed = None
  if mask is not None:
    allowed = jnp.broadcast_to(mask, (t, s))
  if is_causal:
    causal = masks.causal_mask(t, s)
    allowed = causal if allowed is None else allowed & causal
  weights = softmax.masked_softmax(logits, allowed)  # [T, S] in f32
  probs = weights
  if keep is not None:  # inverted dropout: E[probs] == weights
    probs = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
  out = jnp.einsum("TS,SV->TV", probs, value.astype(f32),
                   preferred_element_type=f32)  # [T, Hv]
  return out.astype(out_dtype), weights


def scaled_dot_product_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    mask: ArrayLike | None = None,
    *,
    bias: ArrayLike | None = None,
    scale: float | ArrayLike | None = None,
    is_causal: bool = False,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """``softmax(query @ key^T * scale + bias, where=mask) @ value``.

  Args:
    query: float ``[..., T, H]``.
    key: float ``[..., S, H]``.
    value: float ``[..., S, Hv]``; ``Hv`` may differ from ``H``.
    mask: optional bool, or integer with 0 = blocked, broadcastable to
      ``[..., T, S]``. True (non-zero) = the query may attend to the key.
    bias: optional float added to the logits (after scaling), broadcastable to
      ``[..., T, S]``; e.g. ALiBi or relative-position terms. ``-inf`` entries
      block like a False mask.
    scale: multiplier of ``query @ key^T``; defaults to ``1 / sqrt(H)``.
    is_causal: if True, query ``i`` may attend to key ``j`` only when
      ``j <= i + (S - T)`` (bottom-right aligned; see ``causal_mask``).
      Combined with ``mask`` by logical AND.
    dropout_rate: probability of dropping an attention weight, in ``[0, 1)``.
      Kept weights are scaled by ``1 / (1 - dropout_rate)``.
    dropout_rng: ``jax.random.key``; required when ``dropout_rate > 0``.

  The leading dimensions ``...`` of all operands broadcast like NumPy's.
  Static arguments for ``jax.jit``: ``scale`` (if a Python float),
  ``is_causal``, ``dropout_rate``.

  Returns:
    ``(output, weights)``: ``output`` ``[..., T, Hv]`` in the promoted dtype of
    the inputs; ``weights`` float32 (float64 for float64 inputs)
    ``[..., T, S]``, the softmax probabilities
    before dropout (rows sum to 1, or are all 0 for a query that may attend
    to nothing, whose output is then 0).

  Raises:
    TypeError: non-float query/key/value/bias, a mask that is neither bool nor
      integer.
    ValueError: ranks below 2, ``H`` or ``S`` mismatches, leading dims or
      masks/biases that do not broadcast, a dropout rate outside ``[0, 1)`` or
      a positive rate without ``dropout_rng``.

  Example:
    >>> q = jnp.ones((2, 4, 8))   # [B, T, H]
    >>> kv = jnp.ones((2, 6, 8))  # [B, S, H]
    >>> out, w = scaled_dot_product_attention(q, kv, kv, is_causal=True)
    >>> out.shape, w.shape
    ((2, 4, 8), (2, 4, 6))
  """
  for name, x in (("query", query), ("key", key), ("value", value)):
    _checks.check_float_array(name, x)
  _checks.check_min_rank("query", query, 2, "[..., T, H]")
  _checks.check_min_rank("key", key, 2, "[..., S, H]")
  _checks.check_min_rank("value", value, 2, "[..., S, Hv]")
  q_shape, k_shape, v_shape = map(_checks.shape_of, (query, key, value))
  if q_shape[-1] != k_shape[-1]:
    raise ValueError(
        f"query and key must have the same head dim H (last axis): query "
        f"{q_shape}, key {k_shape}.")
  if k_shape[-2] != v_shape[-2]:
    raise ValueError(
        f"key and value must have the same length S (axis -2): key "
        f"{k_shape}, value {v_shape}.")
  t, s, h = q_shape[-2], k_shape[-2], q_shape[-1]
  leading = {"query": q_shape[:-2], "key": k_shape[:-2],
             "value": v_shape[:-2]}

  if mask is not None:
    _checks.check_mask_dtype("mask", mask)
    mask = _checks.as_bool_mask(mask)
    if mask.ndim < 2:
      mask = mask.reshape((1,) * (2 - mask.ndim) + mask.shape)
    _checks.check_broadcastable_to("mask", mask.shape[-2:], (t, s),
                                   "[T, S]")
    leading["mask"] = mask.shape[:-2]
  if bias is not None:
    _checks.check_float_array("bias", bias)
    bias = jnp.asarray(bias)
    if bias.ndim < 2:
      bias = bias.reshape((1,) * (2 - bias.ndim) + bias.shape)
    _checks.check_broadcastable_to("bias", bias.shape[-2:], (t, s), "[T, S]")
    leading["bias"] = bias.shape[:-2]
  batch_shape = _checks.broadcast_shapes(
      "leading (batch) dimensions of the attention operands", **leading)
  _checks.check_dropout(dropout_rate, dropout_rng)

  if scale is None:
    scale = 1.0 / math.sqrt(h)
  keep = None
  if dropout_rng is not None and not (
      isinstance(dropout_rate, (int, float)) and dropout_rate == 0.0):
    keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate,
                                batch_shape + (t, s))  # [..., T, S]
  out_dtype = jnp.result_type(query, key, value)
  f32 = _checks.compute_dtype(out_dtype)

  def head_fn(q, k, v, m, b, kp):
    return _single_head_attention(
        q, k, v, m, b, kp, scale=scale, is_causal=is_causal,
        dropout_rate=dropout_rate, out_dtype=out_dtype, f32=f32)

  operands = (jnp.asarray(query), jnp.asarray(key), jnp.asarray(value), mask,
              bias, keep)
  return _broadcast.broadcast_vmap(head_fn, (2, 2, 2, 2, 2, 2), operands)
