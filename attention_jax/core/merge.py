"""Merging attentions over disjoint key sets by their log-sum-exps.

Shape glossary: P parts, T query length, Hv value head dim; ``...`` leading
dims (e.g. ``[B, N]``).

Softmax attention over keys ``K = K_1 ∪ ... ∪ K_P`` (disjoint) is a convex
combination of the attentions over each part: with ``o_i`` the output over
``K_i`` and ``l_i`` its log-sum-exp of logits,

    l = log sum_i exp(l_i),    o = sum_i exp(l_i - l) o_i.

This is exact (no approximation beyond rounding) and is how ring attention
combines its steps; ``merge_attentions`` gives it to users, e.g. for
shared-prefix (cascade) decoding: attend once to a prefix every example
shares (its keys broadcast over the batch, never copied) and to each
example's own suffix, then merge. A part that saw no key (``l_i = -inf``)
contributes nothing; a row that saw none in any part gets output 0 and lse
``-inf``, with zero gradients, the package's convention.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from attention_jax.core import checks


def merge_attentions(outputs: Sequence[jax.Array],
                     lses: Sequence[jax.Array]) -> tuple[jax.Array, jax.Array]:
  """The attention over the union of disjoint key sets, from each set's.

  Args:
    outputs: ``P >= 1`` arrays ``[..., T, Hv]``, each the (normalised)
      attention output over one part of the keys, as
      ``scaled_dot_product_attention(..., return_lse=True)`` returns it.
    lses: the matching log-sum-exps ``[..., T]`` (``-inf`` where a query saw
      no key of that part). Leading dims broadcast across parts.

  Returns:
    ``(out [..., T, Hv], lse [..., T])``: ``out`` in the outputs' dtype,
    ``lse`` in float32 (float64 for float64 inputs). Differentiable in
    every output and lse.

  Example:
    >>> q = jnp.ones((1, 4)); k = jnp.arange(12.0).reshape(3, 4) / 10
    >>> v = jnp.eye(3)
    >>> parts = [aj.scaled_dot_product_attention(q, k[s], v[s],
    ...                                          return_lse=True)
    ...          for s in (slice(0, 1), slice(1, 3))]
    >>> out, lse = merge_attentions(*zip(*parts))
    >>> full = aj.scaled_dot_product_attention(q, k, v)
    >>> bool(jnp.allclose(out, full, atol=1e-6))
    True
  """
  outputs, lses = _checked(outputs, lses)
  out_dtype = jnp.result_type(*outputs)
  dtype = checks.compute_dtype(jnp.result_type(out_dtype, *lses))
  lse = [x.astype(dtype) for x in lses]
  top = lse[0]
  for x in lse[1:]:
    top = jnp.maximum(top, x)
  # Any shift gives the same result; a constant one keeps max's subgradient
  # out of the derivative, and 0 where every part is empty (no inf - inf).
  top = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))
  weights = [jnp.exp(x - top) for x in lse]  # 0 for an empty part
  total = sum(weights[1:], weights[0])
  seen = total > 0
  safe = jnp.where(seen, total, 1.0)
  out = sum((w[..., None] * o.astype(dtype) for w, o in
             zip(weights[1:], outputs[1:])), weights[0][..., None]
            * outputs[0].astype(dtype))
  out = out / safe[..., None]  # [..., T, Hv]
  merged = jnp.where(seen, top + jnp.log(safe), -jnp.inf)  # [..., T]
  return out.astype(out_dtype), merged


def _checked(outputs, lses):
  """The parts as arrays, or a ValueError/TypeError naming what is wrong."""
  for name, parts in (("outputs", outputs), ("lses", lses)):
    if isinstance(parts, (jax.Array, jnp.ndarray)) or not isinstance(
        parts, Sequence):
      raise TypeError(
          f"merge_attentions takes sequences of parts ({name}=[part, ...]), "
          f"got {type(parts).__name__}; for stacked parts pass list(x).")
  if not outputs or len(outputs) != len(lses):
    raise ValueError(
        f"merge_attentions needs one lse per output and at least one part, "
        f"got {len(outputs)} outputs and {len(lses)} lses.")
  outputs = [jnp.asarray(o) for o in outputs]
  lses = [jnp.asarray(x) for x in lses]
  for i, (o, x) in enumerate(zip(outputs, lses)):
    for name, a in (("outputs", o), ("lses", x)):
      if not jnp.issubdtype(a.dtype, jnp.floating):
        raise TypeError(f"{name}[{i}] must be floating, got {a.dtype}.")
    if o.ndim < 2 or o.ndim != x.ndim + 1 or o.shape[-2] != x.shape[-1]:
      raise ValueError(
          f"outputs[{i}] {o.shape} and lses[{i}] {x.shape} do not match: an "
          "output is [..., T, Hv] and its lse [..., T] (as "
          "scaled_dot_product_attention(..., return_lse=True) returns).")
  if len({o.ndim for o in outputs}) > 1:
    raise ValueError(
        f"the parts' outputs have different ranks {[o.shape for o in outputs]}"
        ": give each the same leading dims (size 1 where shared).")
  try:
    jnp.broadcast_shapes(*(o.shape for o in outputs))
    jnp.broadcast_shapes(*(x.shape for x in lses))
  except ValueError:
    raise ValueError(
        "the parts' shapes do not broadcast: outputs "
        f"{[o.shape for o in outputs]}, lses {[x.shape for x in lses]}."
    ) from None
  return outputs, lses
