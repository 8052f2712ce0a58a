"""Key importance for KV-cache eviction: the attention each key received.

Shape glossary: B batch, T query length, S key/value length, N query heads,
K key/value heads (``K`` dividing ``N``: grouped-query attention), H head
dim. ``...`` is any number of leading batch dimensions (e.g. ``B, N``).

H2O (Zhang et al. 2023) keeps the keys with the largest accumulated
attention; SnapKV (Li et al. 2024) scores the prompt's keys by the
attention of its last few queries (the observation window). Both need, per
key and head, the column sums of the softmax ``P [T, S]``:
``importance[s] = sum_t P[t, s]`` over the counted query rows.

``key_importance`` never forms ``P``. Column sums are a vector-Jacobian
product: with ``out = P @ V``, ``d<out, G>/dV = P^T G``, so a value of
ones ``[..., S, 1]`` and a cotangent ``G [..., T, 1]`` that is 1 on the
counted rows (0 elsewhere) give ``dV[s] = sum_t P[t, s] G[t]``. The call
runs ``scaled_dot_product_attention`` (any kernel, mask, scale, score
modifier, sinks) under ``jax.vjp`` with respect to that value: the kernel's
own backward computes the sums (the flash kernel recomputes ``P`` block by
block from its saved log-sum-exp). The cost is one forward and one
backward pass of the kernel with a value head dim of 1 (the ``Q K^T``
products dominate: about the cost of a training step's attention), and
``O(T + S)`` memory with a blockwise kernel.

A fully masked row receives no weight (its gradient is zero by the
contract), so it contributes 0. With learned sinks a row's mass over the
keys is below 1: the sink's share is given to no key.

Every kernel of the registry that takes the call computes it (the
contract's ``test_key_importance``), except cuDNN's, which refuses a value
head dim unlike the keys'; a kernel that runs forward but has no reverse
mode (an outside one without a backward) is refused by its name, JAX's
own error added.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
import numpy as np

from attention_jax.attention import dot_product
from attention_jax.core import checks
from attention_jax.kernels import base
from attention_jax.masking import mask as mask_lib
from attention_jax.masking.mask import BlockMask
from attention_jax.masking.mask import Mask


def counted_rows(t: int, last: int | None, q_lengths, rank: int):
  """Float ``[..., T]`` (``rank`` leading dims, size 1 where nothing
  varies): 1 on the query rows whose attention counts, else 0.

  Every row (``last`` None), or the last ``last`` real rows: rows ``i``
  with ``n - last <= i < n`` for ``n`` the row's real queries
  (``q_lengths``, left-aligned to the leading dims, clipped to ``[0, T]``
  as the kernels clip a traced one; ``T`` without them), so a right-padded
  prompt's window ends at its last real token, not at the padding.
  """
  rows = jnp.arange(t, dtype=jnp.int32).reshape((1,) * rank + (t,))
  if q_lengths is None:
    n = jnp.full((1,) * rank, t, jnp.int32)
  else:
    n = jnp.asarray(q_lengths, jnp.int32)
    n = jnp.clip(n.reshape(n.shape + (1,) * (rank - n.ndim)), 0, t)
  n = n[..., None]  # [..., 1] against rows [T]
  counted = rows < n
  if last is not None:
    counted &= rows >= n - last
  return counted


def check_last(last) -> None:
  """``last``: None or a positive Python int (static: it shapes nothing,
  but a traced window would hide a wrong value)."""
  if last is not None:
    checks.check_positive_int("last", last)


def _broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
  """The leading dims of query and key together; the key's when they do
  not broadcast (sdpa's own check then names both shapes)."""
  try:
    return tuple(np.broadcast_shapes(a, b))
  except ValueError:
    return b


# The starts of base.choose's refusals: a kernel that takes the call with
# its own value but not with key_importance's ones [..., S, 1] is named by
# them, and the value's shape is added (the caller never passed it).
_REFUSED = ("implementation=", "no implementation takes this call")


def _no_reverse_mode(name: str, error: Exception) -> str:
  """The refusal of a kernel that runs forward but cannot be
  differentiated in reverse mode (no backward)."""
  return (f"key_importance differentiates implementation={name!r} in "
          f"reverse mode (the vjp of its output with respect to a value of "
          f"ones, [..., S, 1]: the weights' column sums), which it cannot: "
          f"{type(error).__name__}: {error} Use a kernel with a backward: "
          "implementation='flash' (blockwise) or 'dense'.")


def _differentiated_kernel(attend, ones, query, key, mask, call):
  """The name of the kernel whose differentiation failed, or None when the
  call fails without it (its forward alone raises: a check or a refusal,
  re-raised as it is). Only on the error path: the forward traced
  abstractly, then the choice made again (nothing is computed)."""
  try:
    jax.eval_shape(attend, ones)
  except (ValueError, TypeError, NotImplementedError):
    return None
  problem, candidates, automatic = dot_product.prepare(query, key, ones,
                                                       mask, **call)
  return base.choose(candidates, problem, automatic).name


def key_importance(
    query: ArrayLike,
    key: ArrayLike,
    mask: Mask | ArrayLike | BlockMask | None = None,
    *,
    bias: ArrayLike | None = None,
    scale: float | ArrayLike | None = None,
    score_mod: Any = None,
    sinks: ArrayLike | None = None,
    implementation: Any = None,
    last: int | None = None,
    per_kv_head: bool = False,
    is_causal: bool = False,
) -> jax.Array:
  """The attention weight each key received, summed over the queries.

  ``importance[..., s] = sum_t softmax(query @ key^T * scale + ...)[..., t,
  s]`` over the counted query rows, computed by the kernel blockwise as the
  vector-Jacobian product of the attention with respect to a value of ones
  (see the module docstring): no ``[T, S]`` array with a blockwise kernel.
  The scores H2O accumulates and SnapKV pools.

  Args:
    query: float ``[..., T, H]``; ``[B, N, T, H]`` with 4-D keys ``[B, K,
      S, H]`` is grouped-query attention, as in sdpa.
    key: float ``[..., S, H]``.
    mask, bias, scale, is_causal, score_mod, sinks, implementation: as
      ``aj.scaled_dot_product_attention`` (docs/options.md); the weights
      are those of the call with these options. No dropout: the weights
      before it are the ones that rank keys.
    last: None (every query row counts), or a positive int: only the last
      ``last`` query rows count (SnapKV's observation window). With the
      mask's ``q_lengths`` (right-padded prompts) these are the last
      ``last`` real rows of each example: rows ``i`` with ``q_lengths -
      last <= i < q_lengths``. A mask union's members' ``q_lengths`` are
      not read (its rows are counted from ``T``); a ``last`` above the rows
      counts them all.
    per_kv_head: with 4-D grouped query heads, sum each key/value head's
      group of query heads: ``[B, K, S]``, the score a cache keyed by
      KV head evicts by (it costs nothing extra: the ones value has ``K``
      heads, so the backward sums the group). False: one score per query
      head (the keys repeated to ``N`` heads for the call).

  Returns:
    ``[..., S]`` (the query's and key's leading dims broadcast; ``[B, N,
    S]`` for 4-D inputs, ``[B, K, S]`` with ``per_kv_head``), float32
    (float64 for float64 inputs). Each counted row that sees a key adds a
    total of 1 (less with sinks); a row that sees none adds 0; a key no
    counted row may see gets 0.

  Raises:
    TypeError: ``last`` not an int, a non-bool ``per_kv_head``; and
      everything sdpa raises for the call.
    ValueError: ``last`` not positive, ``per_kv_head`` without 4-D query
      and key (no heads to group); a kernel that cannot run it, by name:
      one that refuses a value head dim of 1 (sdpa's refusal, the ones
      value's shape added) or runs forward but has no reverse mode (JAX's
      error added); and sdpa's.

  Example:
    >>> q = jnp.ones((2, 4, 6, 8))   # [B, N, T, H]
    >>> k = jnp.ones((2, 2, 10, 8))  # [B, K, S, H]
    >>> aj.key_importance(q, k, is_causal=True).shape
    (2, 4, 10)
    >>> aj.key_importance(q, k, last=2, per_kv_head=True).sum(-1)[0]
    Array([4., 4.], dtype=float32)
  """
  check_last(last)
  checks.check_static_bool("per_kv_head", per_kv_head)
  checks.check_float_array("query", query)
  checks.check_float_array("key", key)
  checks.check_min_rank("query", query, 2, "[..., T, H]")
  checks.check_min_rank("key", key, 2, "[..., S, H]")
  q_shape, k_shape = checks.shape_of(query), checks.shape_of(key)
  s = k_shape[-2]
  grouped = len(q_shape) == 4 and len(k_shape) == 4
  if per_kv_head and not grouped:
    raise ValueError(
        f"per_kv_head=True sums each key/value head's query heads, which "
        f"needs query [B, N, T, H] and key [B, K, S, H]; got query "
        f"{q_shape} and key {k_shape}: drop per_kv_head.")
  if grouped:
    batch = _broadcast(q_shape[:1], k_shape[:1])
    n, k = q_shape[1], k_shape[1]
    heads = k
    if not per_kv_head and n != k and k and n % k == 0:
      # One value head per query head: each head's mass is its own.
      key, heads = jnp.repeat(jnp.asarray(key), n // k, axis=1), n
    lead = batch + (heads,)
  else:
    lead = _broadcast(q_shape[:-2], k_shape[:-2])
  dtype = checks.compute_dtype(query, key)
  ones = jnp.ones(lead + (s, 1), dtype)
  q_lengths = None
  as_mask = mask if isinstance(mask, Mask) else mask_lib.as_mask(mask)
  if as_mask is not None:
    q_lengths = as_mask.q_lengths

  call = dict(bias=bias, scale=scale, is_causal=is_causal,
              score_mod=score_mod, sinks=sinks, implementation=implementation)

  def attend(value):
    return dot_product.scaled_dot_product_attention(query, key, value, mask,
                                                    **call)

  try:
    out, pullback = jax.vjp(attend, ones)
    rows = counted_rows(q_shape[-2], last, q_lengths, out.ndim - 2)
    cotangent = jnp.broadcast_to(rows[..., None], out.shape).astype(
        out.dtype)
    (d_value,) = pullback(cotangent)
  except (ValueError, TypeError, NotImplementedError) as e:
    name = _differentiated_kernel(attend, ones, query, key, mask, call)
    if name is None:  # the call's own error (sdpa's checks, a refusal)
      if isinstance(e, ValueError) and str(e).startswith(_REFUSED):
        raise ValueError(f"{str(e).rstrip('.')} (key_importance's call: "
                         f"a value of ones, {list(ones.shape)}).") from e
      raise
    raise ValueError(_no_reverse_mode(name, e)) from e
  return d_value[..., 0]

