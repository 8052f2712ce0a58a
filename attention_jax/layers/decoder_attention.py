"""What Bahdanau and Luong attention share: inputs, masking, the weighted sum.

Shape glossary: B batch, T decoder steps (queries), S encoder length, Dq query
features, Dk key features, Dv value features.

Both mechanisms score one decoder state against every encoder state. The
score is written for one query vector (``score_one(q [Dq]) -> [S]``), vmapped
over the T decoder steps and the B examples; the rest (mask, softmax,
context) is the same for every score and lives here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from attention_jax.core import checks
from attention_jax.core import softmax


class Inputs(NamedTuple):
  query: jax.Array  # [B, T, Dq] in compute_dtype
  keys: jax.Array  # [B, S, Dk] in compute_dtype
  values: jax.Array  # [B, S, Dv] in compute_dtype
  mask: jax.Array | None  # [B|1, T|1, S] bool
  seen: jax.Array | None  # [B|1, S]: some step may attend to key j
  single_step: bool  # the query came as [B, Dq]
  out_dtype: jnp.dtype  # the inputs' promoted dtype
  compute_dtype: jnp.dtype  # float32, or float64 for float64 inputs


def prepare(query, keys, values, mask) -> Inputs:
  """Validates and normalises ``(query, keys, values, mask)``."""
  values = keys if values is None else values
  for name, x in (("query", query), ("keys", keys), ("values", values)):
    checks.check_float_array(name, x)
  checks.check_rank("query", query, (2, 3), "[B, Dq] or [B, T, Dq]")
  checks.check_rank("keys", keys, (3,), "[B, S, Dk]")
  checks.check_rank("values", values, (3,), "[B, S, Dv]")
  q_shape, k_shape, v_shape = map(checks.shape_of, (query, keys, values))
  if k_shape[:2] != v_shape[:2]:
    raise ValueError(f"keys {k_shape} and values {v_shape} must have the same "
                     "[B, S].")
  if q_shape[0] != k_shape[0]:
    raise ValueError(f"query {q_shape} and keys {k_shape} must have the same "
                     "batch size B.")
  single_step = len(q_shape) == 2
  out_dtype = jnp.result_type(query, keys, values)
  compute_dtype = checks.compute_dtype(out_dtype)
  query = jnp.asarray(query, compute_dtype)
  if single_step:
    query = query[:, None, :]  # [B, 1, Dq]
  b, t = query.shape[:2]
  s = k_shape[1]
  if mask is not None:
    # The package's one rule: a mask has the weights' full rank ([B, S] for
    # a [B, Dq] query, [B, T, S] for [B, T, Dq]; size-1 axes broadcast).
    checks.check_mask_dtype("mask", mask)
    m_shape = checks.shape_of(mask)
    weights = (b, s) if single_step else (b, t, s)
    layout = "[B, S]" if single_step else "[B, T, S]"
    checks.check_logits_rank("mask", m_shape, weights, layout)
    checks.check_broadcastable_to("mask", m_shape, weights, layout)
    mask = checks.as_bool_mask(mask)
    if single_step:
      mask = mask[:, None, :]  # [B, 1, S]
  keys = jnp.asarray(keys, compute_dtype)
  values = jnp.asarray(values, compute_dtype)
  seen = None
  if mask is not None:  # padding may hold NaN: zero keys no step may see
    seen = jnp.any(mask, axis=1)  # [B|1, S]
    keys, values = checks.zero_unseen(seen, keys, values)
  return Inputs(query, keys, values, mask, seen, single_step, out_dtype,
                compute_dtype)


def hide_unseen(inputs: Inputs, x):
  """``x [B, S, F]`` with the rows of keys no step may see zeroed."""
  if inputs.seen is None:
    return x
  return checks.zero_unseen(inputs.seen, jnp.asarray(x))[0]


def attend(score_one: Callable[[jax.Array, jax.Array], jax.Array],
           inputs: Inputs, key_features: jax.Array
           ) -> tuple[jax.Array, jax.Array]:
  """Scores, masked softmax and context for every step and example.

  Args:
    score_one: ``(q [Dq], key_features [S, F]) -> scores [S]`` for one query
      vector of one example.
    inputs: from ``prepare``.
    key_features: ``[B, S, F]`` what ``score_one`` compares against (raw or
      projected keys).

  Returns:
    ``(context, weights)``: ``[B, T, Dv]`` and ``[B, T, S]`` in the compute
    dtype (float32, or float64 for float64 inputs), or
    ``[B, Dv]`` and ``[B, S]`` for a single-step query.
  """
  key_features = hide_unseen(inputs, key_features)
  per_step = jax.vmap(score_one, in_axes=(0, None))  # over T
  scores = jax.vmap(per_step)(inputs.query, key_features)  # [B, T, S]
  mask = inputs.mask
  if mask is not None:
    mask = jnp.broadcast_to(mask, scores.shape)
  weights = softmax.masked_softmax(scores, mask)  # [B, T, S]
  context = jnp.einsum("BTS,BSV->BTV", weights, inputs.values)  # [B, T, Dv]
  context = context.astype(inputs.out_dtype)
  if inputs.single_step:
    return context[:, 0], weights[:, 0]
  return context, weights


def check_projected_keys(projected, keys, features: int, how: str) -> None:
  expected = checks.shape_of(keys)[:2] + (features,)
  got = checks.shape_of(projected)
  if got != expected:
    raise ValueError(f"projected_keys has shape {got}, expected {expected} "
                     f"([B, S] of keys, {features} features) from {how}.")
