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
  if mask is not None:  # padding may hold NaN: keep it out of every product
    seen = jnp.any(jnp.broadcast_to(mask, (t, s)), axis=0)  # [S]
    key, value = _checks.zero_unseen(seen, key, value)
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
  if allowed is None and bias is None:
    # Nothing can be blocked (finite inputs give finite logits): the plain
    # stable softmax, same float32 numbers, fewer passes over [T, S].
    weights = jax.nn.softmax(logits, axis=-1)  # [T, S] in f32
  else:
    weights = softmax.masked_softmax(logits, allowed)  # [T, S] in f32
  probs = weights
  if keep is not None:  # inverted dropout: E[probs] == weights
    probs = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
  out = jnp.einsum("TS,SV->TV", probs, value.astype(f32),
                   preferred_element_type=f32)  # [T, Hv]
  return out.astype(out_dtype), weights


IMPLEMENTATIONS = ("dense", "blockwise", "cudnn")
# Below this many scores per head the dense path is as fast (see the README's
# benchmark) and also yields the weights.
BLOCKWISE_MIN_SCORES = 1024 * 1024


def _cudnn_problem(query, key, value, mask, bias) -> str | None:
  """Why jax.nn's cuDNN kernel cannot take these inputs, or None if it can."""
  if jax.default_backend() != "gpu":
    return f"it needs a GPU, the backend is {jax.default_backend()!r}"
  dtype = jnp.result_type(query, key, value)
  if dtype not in (jnp.float16, jnp.bfloat16):
    return f"it needs float16/bfloat16 inputs, got {dtype}"
  shapes = [_checks.shape_of(x) for x in (query, key, value)]
  if any(len(s) != 4 for s in shapes) or shapes[1] != shapes[2]:
    return f"it needs [B, N, T, H] inputs with equal key/value shapes: {shapes}"
  h = shapes[0][-1]
  if h > 128 or h % 8:
    return f"it needs a head dim <= 128 and a multiple of 8, got {h}"
  for name, x in (("mask", mask), ("bias", bias)):
    if x is not None and x.ndim != 4:
      return f"{name} must be 4-D [B|1, N|1, T|1, S|1], got {x.shape}"
  return None


def _choose_implementation(implementation, query, key, value, mask, bias,
                           need_weights, dropout_on) -> str:
  if implementation is not None and implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be None or one of "
                     f"{IMPLEMENTATIONS}, got {implementation!r}.")
  if implementation in ("blockwise", "cudnn") and dropout_on:
    raise ValueError(f"implementation={implementation!r} has no dropout; "
                     "use 'dense' or dropout_rate=0.")
  if implementation == "cudnn":
    problem = _cudnn_problem(query, key, value, mask, bias)
    if problem:
      raise ValueError(f"implementation='cudnn' is not possible: {problem}.")
  if implementation is not None:
    return implementation
  t, s = _checks.shape_of(query)[-2], _checks.shape_of(key)[-2]
  if need_weights or dropout_on or t * s < BLOCKWISE_MIN_SCORES:
    return "dense"
  if _cudnn_problem(query, key, value, mask, bias) is None:
    return "cudnn"
  if jnp.result_type(query, key, value) == jnp.float64:
    return "dense"  # blockwise computes in float32
  return "blockwise"


def _cudnn_attention(query, key, value, mask, bias, scale, is_causal):
  """jax.nn's fused kernel; our bottom-right causal mask made explicit."""
  t, s = query.shape[-2], key.shape[-2]
  if is_causal and t != s:  # jax.nn aligns top-left; ours is bottom-right
    causal = masks.causal_mask(t, s)[None, None]
    mask = causal if mask is None else mask & causal
    is_causal = False
  swap = lambda x: jnp.swapaxes(x, 1, 2)  # [B, N, T, H] <-> [B, T, N, H]
  if mask is not None:
    mask = jnp.broadcast_to(mask, mask.shape[:2] + (t, s))
  out = jax.nn.dot_product_attention(
      swap(query), swap(key), swap(value), bias=bias, mask=mask, scale=scale,
      is_causal=is_causal, implementation="cudnn")
  return swap(out)


def validate_operands(query, key, value, mask, bias, **extra_leading):
  """Checks the attention operands; returns ``(mask, bias, batch_shape)``.

  ``mask`` comes back bool and ``mask``/``bias`` at least 2-D; ``batch_shape``
  is the broadcast of every operand's leading dims (and of
  ``extra_leading``'s shapes, e.g. key lengths).
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
  t, s = q_shape[-2], k_shape[-2]
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
  leading.update(extra_leading)
  batch_shape = _checks.broadcast_shapes(
      "leading (batch) dimensions of the attention operands", **leading)
  return mask, bias, batch_shape


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
    implementation: str | None = None,
    need_weights: bool = True,
) -> tuple[jax.Array, jax.Array | None]:
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
    implementation: ``"dense"`` (materialises the ``[T, S]`` weights),
      ``"blockwise"`` (``blockwise_attention``: O(T + S) memory, no weights,
      no dropout), ``"cudnn"`` (``jax.nn.dot_product_attention``'s fused GPU
      kernel: GPU, float16/bfloat16, ``[B, N, T, H]`` inputs, H <= 128 and a
      multiple of 8, no weights, no dropout) or ``None``: dense when
      ``need_weights`` or dropout is on or ``T * S`` is below
      ``BLOCKWISE_MIN_SCORES``; otherwise cuDNN where its constraints hold,
      else blockwise. Every path gives the same numbers within float32
      rounding (tested).
    need_weights: whether the caller uses ``weights``. With False, the
      returned weights may be ``None`` (the non-dense paths never form them).

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
  mask, bias, batch_shape = validate_operands(query, key, value, mask, bias)
  t, s = _checks.shape_of(query)[-2], _checks.shape_of(key)[-2]
  h = _checks.shape_of(query)[-1]
  _checks.check_dropout(dropout_rate, dropout_rng)
  dropout_on = not (isinstance(dropout_rate, (int, float))
                    and dropout_rate == 0.0)
  implementation = _choose_implementation(
      implementation, query, key, value, mask, bias, need_weights, dropout_on)

  if scale is None:
    scale = 1.0 / math.sqrt(h)
  if implementation == "blockwise":
    from attention_jax import blockwise  # noqa: PLC0415 - import cycle
    return blockwise.blockwise_attention(
        query, key, value, mask=mask, bias=bias, is_causal=is_causal,
        scale=scale), None
  if implementation == "cudnn":
    return _cudnn_attention(query, key, value, mask, bias, scale,
                            is_causal), None
  keep = None
  if dropout_rng is not None and dropout_on:
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
