"""Luong (multiplicative) attention, Luong et al. 2015.

Shape glossary: B batch, T decoder steps, S encoder length, Dq query
(decoder state) features, Dk key (encoder state) features, Dv value
features, A hidden features (``concat`` only).

Scores of encoder state ``k_j`` for decoder state ``q``:

* ``"dot"``: ``q . k_j`` (needs ``Dq == Dk``), no parameters;
* ``"general"``: ``q @ W @ k_j``, params ``{"W": [Dq, Dk]}``;
* ``"concat"``: ``v . tanh([q; k_j] @ W)``, params ``{"W": [Dq + Dk, A],
  "v": [A]}``: the additive score with ``W`` split into a query half and a
  key half.

Any score may be multiplied by a scale: an explicit ``scale=`` and/or a
learned scalar ``params["scale"]`` (``init_luong_params(use_scale=True)``).

The key side of ``general`` (``k_j @ W^T``) and ``concat`` (``k_j @ W[Dq:]``)
does not depend on the decoder step: ``precompute_luong_keys`` computes it
once per sequence for decoders that attend at every step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from attention_jax.core import checks
from attention_jax.layers import additive
from attention_jax.layers import decoder_attention

Params = dict[str, jax.Array]
SCORES = ("dot", "general", "concat")


def _check_score(score) -> None:
  if score not in SCORES:
    raise ValueError(f"score must be one of {SCORES}, got {score!r}.")


def init_luong_params(rng: jax.Array, query_features: int, key_features: int,
                      *, score: str = "dot",
                      hidden_features: int | None = None,
                      use_scale: bool = False,
                      dtype: jnp.dtype = jnp.float32) -> Params:
  """Initialises the parameters of a Luong score.

  Args:
    rng: ``jax.random.key``.
    query_features: ``Dq``.
    key_features: ``Dk``.
    score: ``"dot"``, ``"general"`` or ``"concat"``.
    hidden_features: ``A`` for ``"concat"`` (required there, unused
      elsewhere).
    use_scale: add a learned scalar ``"scale"`` (initialised to 1).
    dtype: parameter dtype.

  Returns:
    ``{}`` for ``dot``, ``{"W": [Dq, Dk]}`` for ``general``,
    ``{"W": [Dq + Dk, A], "v": [A]}`` for ``concat``; plus ``"scale": []``.

  Example:
    >>> p = init_luong_params(jax.random.key(0), 6, 4, score="general")
    >>> p["W"].shape
    (6, 4)
  """
  _check_score(score)
  checks.check_positive_int("query_features", query_features)
  checks.check_positive_int("key_features", key_features)
  if score == "dot" and query_features != key_features:
    raise ValueError(f"score='dot' needs query_features == key_features, got "
                     f"{query_features} and {key_features}.")
  kw, kv = jax.random.split(rng)
  init = jax.nn.initializers.lecun_normal()
  params: Params = {}
  if score == "general":
    params["W"] = init(kw, (query_features, key_features), dtype)
  elif score == "concat":
    if hidden_features is None:
      raise ValueError("score='concat' needs hidden_features (A).")
    checks.check_positive_int("hidden_features", hidden_features)
    params["W"] = init(kw, (query_features + key_features, hidden_features),
                       dtype)
    params["v"] = (jax.random.normal(kv, (hidden_features,), dtype)
                   / jnp.sqrt(hidden_features).astype(dtype))
  if use_scale:
    params["scale"] = jnp.ones((), dtype)
  return params


def _check_params(score: str, params, dq: int | None, dk: int) -> int:
  """Validates params against the features; returns the key-side width."""
  params = {} if params is None else params
  needed = {"dot": (), "general": ("W",), "concat": ("W", "v")}[score]
  for name in needed:
    if name not in params:
      raise ValueError(f"score={score!r} needs params['{name}'], got keys "
                       f"{sorted(params)}.")
  if "scale" in params and checks.shape_of(params["scale"]) not in ((), (1,)):
    raise ValueError("params['scale'] must be a scalar, got shape "
                     f"{checks.shape_of(params['scale'])}.")
  if score == "dot":
    if dq is not None and dq != dk:
      raise ValueError(f"score='dot' needs query and keys with the same "
                       f"features, got Dq={dq} and Dk={dk}.")
    return dk
  w = checks.shape_of(params["W"])
  if score == "general":
    if len(w) != 2 or w[1] != dk or (dq is not None and w[0] != dq):
      raise ValueError(f"params['W'] has shape {w}, expected [Dq, Dk] = "
                       f"[{dq if dq is not None else 'Dq'}, {dk}].")
    return w[0]
  v = checks.shape_of(params["v"])
  if len(w) != 2 or len(v) != 1 or w[1] != v[0] or (
      dq is not None and w[0] != dq + dk) or w[0] <= dk:
    raise ValueError(f"params must be W [Dq + Dk, A] and v [A]: got W {w}, "
                     f"v {v} for Dq={dq}, Dk={dk}.")
  return w[1]


def precompute_luong_keys(params: Params | None, keys: ArrayLike, *,
                          score: str = "dot") -> jax.Array:
  """The step-independent key side of a Luong score.

  Args:
    params: the score's parameters (``init_luong_params``); None or ``{}``
      for ``dot``.
    keys: float ``[B, S, Dk]``.
    score: ``"dot"``, ``"general"`` or ``"concat"``.

  Returns:
    ``[B, S, F]`` in float32 (float64 for float64 inputs): the keys
    themselves for ``dot`` (``F = Dk``), ``keys @ W^T`` for ``general``
    (``F = Dq``), ``keys @ W[Dq:]`` for ``concat`` (``F = A``).

  Example:
    >>> p = init_luong_params(jax.random.key(0), 6, 4, score="concat",
    ...                       hidden_features=8)
    >>> precompute_luong_keys(p, jnp.ones((2, 5, 4)), score="concat").shape
    (2, 5, 8)
  """
  _check_score(score)
  checks.check_float_array("keys", keys)
  checks.check_rank("keys", keys, (3,), "[B, S, Dk]")
  dk = checks.shape_of(keys)[-1]
  _check_params(score, params, None, dk)
  compute_dtype = checks.compute_dtype(keys, *(params or {}).values())
  keys = jnp.asarray(keys, compute_dtype)
  if score == "dot":
    return keys
  w = params["W"].astype(compute_dtype)
  if score == "general":
    return jnp.einsum("BSK,QK->BSQ", keys, w)  # [B, S, Dq]
  return jnp.einsum("BSK,KA->BSA", keys, w[w.shape[0] - dk:])  # [B, S, A]


def luong_attention(
    params: Params | None,
    query: ArrayLike,
    keys: ArrayLike,
    values: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    *,
    score: str = "dot",
    scale: float | None = None,
    projected_keys: ArrayLike | None = None,
    return_weights: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Luong attention of decoder state(s) over encoder states.

  Args:
    params: the score's parameters (``init_luong_params``); None or ``{}``
      for ``dot``.
    query: float ``[B, Dq]`` (one decoder step) or ``[B, T, Dq]``.
    keys: float ``[B, S, Dk]`` encoder states.
    values: float ``[B, S, Dv]``; defaults to ``keys``.
    mask: bool/integer with the weights' rank: ``[B, S]`` for a ``[B, Dq]``
      query, ``[B, T, S]`` for ``[B, T, Dq]`` (size-1 axes broadcast: key
      padding for every step is ``mask[:, None, :]``); True (non-zero) = may
      attend.
    score: ``"dot"``, ``"general"`` or ``"concat"``.
    scale: optional explicit multiplier of the scores (e.g.
      ``1/sqrt(Dk)``); a learned ``params["scale"]`` multiplies as well.
    projected_keys: optional ``precompute_luong_keys(params, keys,
      score=...)``, reused across decoder steps.
    return_weights: also return the attention weights.

  Returns:
    ``context`` ``[B, Dv]`` for a single-step query, else ``[B, T, Dv]``;
    with ``return_weights``, ``(context, weights)`` with float32 (float64
    for float64 inputs) weights ``[B, S]`` or ``[B, T, S]``.

  Example:
    >>> ctx, w = luong_attention(None, jnp.ones((2, 3, 4)),
    ...                          jnp.ones((2, 5, 4)), return_weights=True)
    >>> ctx.shape, w.shape
    ((2, 3, 4), (2, 3, 5))
  """
  _check_score(score)
  inputs = decoder_attention.prepare(query, keys, values, mask)
  dq, dk = checks.shape_of(query)[-1], checks.shape_of(keys)[-1]
  width = _check_params(score, params, dq, dk)
  if projected_keys is None:
    projected_keys = precompute_luong_keys(
        params, decoder_attention.hide_unseen(inputs, keys), score=score)
  else:
    checks.check_float_array("projected_keys", projected_keys)
    decoder_attention.check_projected_keys(
        projected_keys, keys, width, "precompute_luong_keys")
  compute_dtype = inputs.compute_dtype
  params = {} if params is None else params
  multiplier = jnp.asarray(1.0 if scale is None else scale, compute_dtype)
  if "scale" in params:
    multiplier = multiplier * params["scale"].astype(compute_dtype).reshape(())

  if score == "concat":
    w_query = params["W"][:dq].astype(compute_dtype)  # [Dq, A]
    v = params["v"].astype(compute_dtype)

    def score_one(q, key_side):  # [Dq], [S, A] -> [S]
      return multiplier * additive.additive_score(q @ w_query, key_side, v)
  else:

    def score_one(q, key_side):  # [Dq], [S, Dq] -> [S]
      return multiplier * (key_side @ q)

  context, weights = decoder_attention.attend(
      score_one, inputs, jnp.asarray(projected_keys, compute_dtype))
  return (context, weights) if return_weights else context
