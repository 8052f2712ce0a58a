"""``flax_attention_fn``: flax's ``attention_fn`` contract over this library's
kernels, for ``nnx.MultiHeadAttention(attention_fn=...)`` (see its docstring).

Shape glossary: B batch, T query length, S key/value length, N query heads,
K key/value heads (``K`` divides ``N``), H head dim.
"""

from __future__ import annotations

import contextlib
import math

from flax import nnx
from flax.nnx.nn import dtypes as flax_dtypes
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from attention_jax.attention import dot_product
from attention_jax.core import checks
from attention_jax.interop import jax_nn


def _matmul_precision(precision) -> str | None:
  """flax's ``precision`` as a ``jax.default_matmul_precision`` name."""
  if precision is None:
    return None
  pair = (tuple(precision) if isinstance(precision, (tuple, list))
          else (precision, precision))
  try:
    first, second = (jax.lax.Precision(p) for p in pair)
  except (TypeError, ValueError):
    raise TypeError(
        "precision must be None, a jax.lax.Precision or its name (e.g. "
        f"'highest'), or a pair of equal ones, got {precision!r}; dot "
        "algorithms are not supported.") from None
  if first != second:
    raise ValueError(
        f"precision {precision!r} gives the two operands different "
        "precisions; flax_attention_fn applies one precision to every "
        "product (pass a single jax.lax.Precision).")
  return first.name.lower()


def _flat_pair(name: str, x, batch: tuple[int, ...],
               target: tuple[int, ...]) -> jax.Array | None:
  """flax's ``[batch..., N, T, S]`` mask/bias as ``[B|1, N|1, T|1, S|1]``."""
  if x is None:
    return None
  layout = "[batch..., num_heads, q_length, kv_length]"
  x = jnp.asarray(checks.as_array_operand(name, x, layout))
  full = batch + target
  if x.ndim > len(full):
    raise ValueError(f"{name} must have rank <= {len(full)} (broadcastable "
                     f"to {layout} = {full}), got shape {x.shape}.")
  x = x.reshape((1,) * (len(full) - x.ndim) + x.shape)
  checks.check_broadcastable_to(name, x.shape, full, layout)
  lead = x.shape[:len(batch)]
  if any(d != 1 for d in lead):  # shared axes would not survive the flatten
    x = jnp.broadcast_to(x, batch + x.shape[len(batch):])
  return x.reshape((math.prod(x.shape[:len(batch)]),) + x.shape[len(batch):])


def flax_attention_fn(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype=None,
    precision=None,
    module=None,
    promote_dtype=None,
    is_causal: bool = False,
) -> jax.Array:
  """flax's ``attention_fn`` contract over ``scaled_dot_product_attention``.

  The signature of ``flax.nnx.dot_product_attention`` in flax's
  ``[batch..., length, num_heads, head_dim]`` layout, so
  ``nnx.MultiHeadAttention(..., attention_fn=aj.flax_attention_fn)`` runs
  this library's kernels (chosen as in ``scaled_dot_product_attention``,
  whose contract it keeps: docs/options.md). Wherever flax's answer is
  defined the same way, outputs and gradients match flax's default
  ``attention_fn`` within float32 rounding, also for cross-attention,
  grouped-query heads and the decode cache (tested). What differs or is
  refused:

  * A query that may see no key (a fully masked row, e.g. a padding query
    under a padding mask) gets output 0, zero gradients and, when sown,
    weights 0. flax fills masked logits with a large finite negative, so its
    output there is the mean of the values (and its weights uniform).
  * Dropout (``dropout_rate > 0`` and not ``deterministic``) is this
    library's: an independent draw per example, head, query and key, kept
    weights scaled by ``1 / (1 - dropout_rate)``. That is flax's
    ``broadcast_dropout=False``; flax's default ``broadcast_dropout=True``
    (one ``[q_length, kv_length]`` pattern shared by the batch and heads) is
    refused rather than silently replaced: build the module with
    ``broadcast_dropout=False``.
  * ``precision`` (one ``jax.lax.Precision`` or its name) is applied as
    ``jax.default_matmul_precision`` around the call and selects the dense
    kernel, whose products (forward and backward) all follow it. flax's
    own fast path ignores ``precision``.
  * ``module`` (``sow_weights=True``) selects the dense kernel and sows the
    ``[batch..., num_heads, q_length, kv_length]`` softmax weights (before
    dropout, in the computation dtype) as ``nnx.Intermediate``
    ``'attention_weights'``, as flax does.

  Args:
    query: float ``[batch..., T, N, H]`` (any number of batch dims, also
      none).
    key: float ``[batch..., S, K, H]`` with the same batch dims; ``K``
      dividing ``N`` is grouped-query attention (query head ``n`` uses
      key/value head ``n // (N / K)``), as flax's ``num_kv_heads`` (where
      the installed flax has it).
    value: float ``[batch..., S, K, Hv]``.
    bias: as sdpa's (docs/options.md), broadcastable to ``[batch..., N, T,
      S]``.
    mask: broadcastable to ``[batch..., N, T, S]``; non-zero = may attend
      (flax's float 0/1 masks, bool and integer alike).
    broadcast_dropout: must be False when dropout is on (see above).
    dropout_rng, dropout_rate: as sdpa's; dropout is on when
      ``dropout_rate > 0`` and not ``deterministic``.
    deterministic: True turns dropout off.
    dtype: computation and output dtype; None promotes the inputs'.
    precision: None, a ``jax.lax.Precision`` (or its name) or a pair of
      equal ones.
    module: the module to sow the weights into, or None.
    promote_dtype: flax's ``promote_dtype(arrays, dtype=...)`` hook for
      query/key/value; None is flax's default.
    is_causal: query ``i`` sees keys ``j <= i`` (flax's top-left alignment,
      also when ``T != S``).

  Returns:
    ``[batch..., T, N, Hv]`` in the promoted dtype (``dtype`` if given).

  Raises:
    TypeError: non-float operands, non-bool flags, an unknown precision.
    ValueError: mismatched ranks or batch dims, masks/biases that do not
      broadcast, ``broadcast_dropout=True`` or no ``dropout_rng`` with
      dropout on, a pair of different precisions.

  Example:
    >>> layer = nnx.MultiHeadAttention(
    ...     num_heads=4, in_features=16, decode=False,
    ...     attention_fn=flax_attention_fn, rngs=nnx.Rngs(0))
    >>> x = jnp.ones((2, 5, 16))  # [B, T, D]
    >>> layer(x, mask=nnx.make_causal_mask(jnp.ones((2, 5)))).shape
    (2, 5, 16)
  """
  for name, flag in (("broadcast_dropout", broadcast_dropout),
                     ("deterministic", deterministic),
                     ("is_causal", is_causal)):
    checks.check_static_bool(name, flag)
  checks.check_dropout_rate(dropout_rate)
  promote = promote_dtype or flax_dtypes.promote_dtype
  operands = [checks.as_array_operand(name, x, layout) for name, x, layout in
              (("query", query, "[batch..., T, N, H]"),
               ("key", key, "[batch..., S, K, H]"),
               ("value", value, "[batch..., S, K, Hv]"))]
  q, k, v = promote(tuple(operands), dtype=dtype)
  for name, x in (("query", q), ("key", k), ("value", v)):
    checks.check_float_array(name, x)
  if not 3 <= q.ndim == k.ndim == v.ndim:
    raise ValueError(
        "query, key and value must have the same rank >= 3 ([batch..., "
        f"length, num_heads, head_dim]), got shapes {q.shape}, {k.shape}, "
        f"{v.shape}.")
  batch, (t, n, h), (s, kh, hk) = q.shape[:-3], q.shape[-3:], k.shape[-3:]
  if (k.shape[:-3] != batch or v.shape[:-1] != k.shape[:-1] or hk != h
      or n % kh):
    raise ValueError(
        f"expected query [batch..., T, N, H] = {q.shape}, key [batch..., S, "
        f"K, H] = {k.shape} and value [batch..., S, K, Hv] = {v.shape} with "
        "the same batch dims, S, K and (query/key) H, and K dividing N.")
  target = (n, t, s)
  bias, mask = (_flat_pair(name, x, batch, target)
                for name, x in (("bias", bias), ("mask", mask)))
  if mask is not None and mask.dtype != jnp.bool_:
    mask = mask != 0  # flax's masks are float 0/1
  mask = jax_nn.top_left(t, s, causal=is_causal, dense=mask)
  dropout_on = not deterministic and not (
      isinstance(dropout_rate, (int, float)) and dropout_rate == 0.0)
  if dropout_on and broadcast_dropout:
    raise ValueError(
        "broadcast_dropout=True (flax's default: one dropout pattern shared "
        "by the batch and the heads) is not what this library's dropout "
        "does (an independent draw per example and head); build the module "
        "with broadcast_dropout=False, or turn dropout off "
        "(deterministic=True or dropout_rate=0).")
  if dropout_on and dropout_rng is None:
    raise ValueError(f"dropout_rate={dropout_rate} with deterministic=False "
                     "needs a dropout_rng (a jax.random.key).")
  matmul_precision = _matmul_precision(precision)
  flat = lambda x: x.reshape((math.prod(batch),) + x.shape[len(batch):])
  swap = lambda x: jnp.swapaxes(x, 1, 2)  # [B, T, N, H] <-> [B, N, T, H]
  context = (contextlib.nullcontext() if matmul_precision is None
             else jax.default_matmul_precision(matmul_precision))
  with context:
    result = dot_product.scaled_dot_product_attention(
        swap(flat(q)), swap(flat(k)), swap(flat(v)), mask, bias=bias,
        dropout_rate=dropout_rate if dropout_on else 0.0,
        dropout_rng=dropout_rng if dropout_on else None,
        implementation=None if module is None and matmul_precision is None
        else "dense",
        return_weights=module is not None)
  out, weights = result if module is not None else (result, None)
  if weights is not None:  # [B, N, T, S] -> [batch..., N, T, S]
    module.sow(nnx.Intermediate, "attention_weights",
               weights.reshape(batch + weights.shape[1:]).astype(q.dtype))
  return swap(out).reshape(batch + (t, n, v.shape[-1]))
