"""Bahdanau (additive) attention, Bahdanau et al. 2015.

Shape glossary: B batch, T decoder steps, S encoder length, Dq query
(decoder state) features, Dk key (encoder state) features, Dv value
features, A hidden (alignment) features.

Score of encoder state ``k_j`` for decoder state ``q``:
``e_j = v . tanh(q @ W_q + k_j @ W_k + b)``; weights ``softmax(e)`` over the
valid ``j``; context ``sum_j weights_j * value_j``.

The key term ``k_j @ W_k + b`` does not depend on the decoder step, so a
decoder computes it once per sequence with ``precompute_additive_keys`` and
passes it as ``projected_keys`` at every step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from attention_jax.core import checks
from attention_jax.layers import decoder_attention

Params = dict[str, jax.Array]


def init_additive_params(rng: jax.Array, query_features: int,
                         key_features: int, hidden_features: int, *,
                         use_bias: bool = True,
                         dtype: jnp.dtype = jnp.float32) -> Params:
  """Initialises ``{"W_q": [Dq, A], "W_k": [Dk, A], "v": [A], "b": [A]}``.

  Kernels are LeCun-normal, ``v`` is normal with std ``1/sqrt(A)``, ``b`` is
  zero (omitted when ``use_bias=False``).

  Example:
    >>> p = init_additive_params(jax.random.key(0), 6, 4, 8)
    >>> {k: v.shape for k, v in p.items()}
    {'W_q': (6, 8), 'W_k': (4, 8), 'v': (8,), 'b': (8,)}
  """
  for name, n in (("query_features", query_features),
                  ("key_features", key_features),
                  ("hidden_features", hidden_features)):
    checks.check_positive_int(name, n)
  kq, kk, kv = jax.random.split(rng, 3)
  init = jax.nn.initializers.lecun_normal()
  params = {"W_q": init(kq, (query_features, hidden_features), dtype),
            "W_k": init(kk, (key_features, hidden_features), dtype),
            "v": jax.random.normal(kv, (hidden_features,), dtype)
                 / jnp.sqrt(hidden_features).astype(dtype)}
  if use_bias:
    params["b"] = jnp.zeros((hidden_features,), dtype)
  return params


def _check_params(params, query_shape, keys_shape) -> int:
  for name in ("W_q", "W_k", "v"):
    if name not in params:
      raise ValueError(f"params must have '{name}', got keys {sorted(params)}.")
  wq, wk, v = (checks.shape_of(params[n]) for n in ("W_q", "W_k", "v"))
  if len(v) != 1 or wq[-1:] != v or wk[-1:] != v:
    raise ValueError(f"params must be W_q [Dq, A], W_k [Dk, A], v [A] with "
                     f"one A: got W_q {wq}, W_k {wk}, v {v}.")
  if "b" in params and checks.shape_of(params["b"]) != v:
    raise ValueError(f"params['b'] has shape {checks.shape_of(params['b'])}, "
                     f"expected {v}.")
  if query_shape is not None and query_shape[-1] != wq[0]:
    raise ValueError(f"query has {query_shape[-1]} features (shape "
                     f"{query_shape}) but params['W_q'] is {wq}.")
  if keys_shape is not None and keys_shape[-1] != wk[0]:
    raise ValueError(f"keys have {keys_shape[-1]} features (shape "
                     f"{keys_shape}) but params['W_k'] is {wk}.")
  return v[0]


def additive_score(query_hidden: jax.Array, key_hidden: jax.Array,
                   v: jax.Array) -> jax.Array:
  """``v . tanh(query_hidden + key_hidden_j)`` for one query: ``[A], [S, A] -> [S]``.

  Example:
    >>> keys = jnp.array([[0.0, 0.0], [1.0, -1.0], [2.0, 2.0]])  # [S, A]
    >>> additive_score(jnp.zeros(2), keys, jnp.ones(2)).round(4).tolist()
    [0.0, 0.0, 1.9281]
  """
  return jnp.tanh(query_hidden[None, :] + key_hidden) @ v  # [S]


def precompute_additive_keys(params: Params, keys: ArrayLike) -> jax.Array:
  """``keys @ W_k + b``, the step-independent half of the score.

  Args:
    params: from ``init_additive_params``.
    keys: float ``[B, S, Dk]``.

  Returns:
    ``[B, S, A]`` in float32 (float64 for float64 inputs).

  Example:
    >>> p = init_additive_params(jax.random.key(0), 6, 4, 8)
    >>> keys = jnp.ones((2, 5, 4))
    >>> pk = precompute_additive_keys(p, keys)  # once per sequence
    >>> ctx = additive_attention(p, jnp.ones((2, 6)), keys, projected_keys=pk)
    >>> pk.shape, ctx.shape
    ((2, 5, 8), (2, 4))
  """
  checks.check_float_array("keys", keys)
  checks.check_rank("keys", keys, (3,), "[B, S, Dk]")
  _check_params(params, None, checks.shape_of(keys))
  compute_dtype = checks.compute_dtype(keys, params["W_k"])
  projected = jnp.einsum("BSK,KA->BSA", jnp.asarray(keys, compute_dtype),
                         params["W_k"].astype(compute_dtype))
  if "b" in params:
    projected = projected + params["b"].astype(compute_dtype)[None, None, :]
  return projected


def additive_attention(
    params: Params,
    query: ArrayLike,
    keys: ArrayLike,
    values: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    *,
    projected_keys: ArrayLike | None = None,
    return_weights: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Bahdanau attention of decoder state(s) over encoder states.

  Args:
    params: from ``init_additive_params``.
    query: float ``[B, Dq]`` (one decoder step) or ``[B, T, Dq]``.
    keys: float ``[B, S, Dk]`` encoder states.
    values: float ``[B, S, Dv]``; defaults to ``keys``.
    mask: bool/integer with the weights' rank: ``[B, S]`` for a ``[B, Dq]``
      query, ``[B, T, S]`` for ``[B, T, Dq]`` (size-1 axes broadcast: key
      padding for every step is ``mask[:, None, :]``); True (non-zero) = may
      attend.
    projected_keys: optional ``precompute_additive_keys(params, keys)``,
      reused across decoder steps.
    return_weights: also return the attention weights.

  Returns:
    ``context`` ``[B, Dv]`` for a single-step query, else ``[B, T, Dv]``, in
    the inputs' promoted dtype; with ``return_weights``, ``(context,
    weights)`` with float32 weights ``[B, S]`` or ``[B, T, S]``. Scores and
    softmax run in float32 (float64 for float64 inputs, as are the weights).
    A row with nothing to attend to gets zero weights and a zero context.

  Example:
    >>> p = init_additive_params(jax.random.key(0), 6, 4, 8)
    >>> ctx, w = additive_attention(p, jnp.ones((2, 6)), jnp.ones((2, 5, 4)),
    ...                             return_weights=True)
    >>> ctx.shape, w.shape
    ((2, 4), (2, 5))
  """
  inputs = decoder_attention.prepare(query, keys, values, mask)
  hidden = _check_params(params, checks.shape_of(query),
                         checks.shape_of(keys))
  if projected_keys is None:
    projected_keys = precompute_additive_keys(
        params, decoder_attention.hide_unseen(inputs, keys))
  else:
    checks.check_float_array("projected_keys", projected_keys)
    decoder_attention.check_projected_keys(
        projected_keys, keys, hidden, "precompute_additive_keys")
  compute_dtype = inputs.compute_dtype
  w_q = params["W_q"].astype(compute_dtype)
  v = params["v"].astype(compute_dtype)

  def score_one(q, key_hidden):  # [Dq], [S, A] -> [S]
    return additive_score(q @ w_q, key_hidden, v)

  context, weights = decoder_attention.attend(
      score_one, inputs, jnp.asarray(projected_keys, compute_dtype))
  return (context, weights) if return_weights else context
