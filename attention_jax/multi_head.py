"""Multi-head attention as pure functions over a parameter dict.

Shape glossary: B batch, T query length, S key/value length, N query heads,
K key/value heads (grouped-query attention; ``K == N`` is ordinary MHA,
``K == 1`` multi-query), G = N // K query heads per key/value head, H head
dim = D // N, D model dim.

Parameters follow the lesson's names: ``{"W_q", "W_k", "W_v", "W_o"}``, each
``{"kernel": [in, out], "bias": [out]}`` with ``y = x @ kernel + bias``.

How the heads are computed (the project's design, kept literal so readers can
follow it): a kernel's output features are split into per-head kernels
(``split_heads``), one pure per-head projection (``project``) is
``jax.vmap``-ed over them, the single-head attention of ``dot_product.py`` is
vmapped over the head axes, and the head outputs are concatenated again
(``merge_heads``) before ``W_o``. A key/value head is shared by its G query
heads through ``vmap`` (an unmapped operand), not copied. ``forward`` is the
one projection -> attention -> output path, used with a KV cache by
``MultiHeadAttention`` when decoding.
"""

from __future__ import annotations

from collections.abc import Callable
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
import numpy as np

from attention_jax import _checks
from attention_jax import _numerics
from attention_jax import _patterns
from attention_jax import dot_product
from attention_jax import kv_cache
from attention_jax import masks
from attention_jax import rope as rope_lib
from attention_jax import sharding

Params = dict[str, dict[str, jax.Array]]
# Anything with scaled_dot_product_attention's contract (see attend_heads).
AttentionFn = Callable[..., Any]


def init_multi_head_params(
    rng: jax.Array,
    d_model: int,
    num_heads: int,
    *,
    num_kv_heads: int | None = None,
    use_bias: bool = True,
    dtype: jnp.dtype = jnp.float32,
) -> Params:
  """Initialises ``W_q``, ``W_k``, ``W_v``, ``W_o`` for ``multi_head_attention``.

  Kernels are LeCun-normal (flax's ``nnx.Linear`` default), biases zero.

  Args:
    rng: ``jax.random.key``.
    d_model: ``D``, input and output features.
    num_heads: ``N``; must divide ``d_model``.
    num_kv_heads: ``K``; must divide ``num_heads``. ``None`` means ``N``.
    use_bias: whether each projection has a bias.
    dtype: parameter dtype.

  Returns:
    ``{"W_q": {"kernel": [D, N*H], "bias": [N*H]}, "W_k": {... [D, K*H]},
    "W_v": {... [D, K*H]}, "W_o": {"kernel": [N*H, D], "bias": [D]}}``
    (no ``"bias"`` entries when ``use_bias=False``).

  Example:
    >>> p = init_multi_head_params(jax.random.key(0), 8, 4, num_kv_heads=2)
    >>> p["W_k"]["kernel"].shape
    (8, 4)
  """
  num_kv_heads = _checks.check_head_counts(d_model, num_heads, num_kv_heads)
  head_dim = d_model // num_heads
  init = jax.nn.initializers.lecun_normal()
  shapes = {"W_q": (d_model, num_heads * head_dim),
            "W_k": (d_model, num_kv_heads * head_dim),
            "W_v": (d_model, num_kv_heads * head_dim),
            "W_o": (num_heads * head_dim, d_model)}
  params = {}
  for rng_i, (name, shape) in zip(jax.random.split(rng, 4), shapes.items()):
    params[name] = {"kernel": init(rng_i, shape, dtype)}
    if use_bias:
      params[name]["bias"] = jnp.zeros(shape[1:], dtype)
  return params


def split_heads(x: jax.Array, num_heads: int) -> jax.Array:
  """Splits the last axis into heads, heads first: ``[..., N*H] -> [N, ..., H]``.

  Example:
    >>> split_heads(jnp.ones((2, 5, 12)), 3).shape  # [B, T, N*H] -> [N, B, T, H]
    (3, 2, 5, 4)
  """
  *lead, features = x.shape
  x = x.reshape(*lead, num_heads, features // num_heads)
  return jnp.moveaxis(x, -2, 0)


def merge_heads(x: jax.Array) -> jax.Array:
  """Concatenates heads: ``[B, N, T, H] -> [B, T, N*H]`` (the lesson's concat).

  Example:
    >>> merge_heads(jnp.ones((2, 3, 5, 4))).shape
    (2, 5, 12)
  """
  b, n, t, h = x.shape
  return jnp.transpose(x, (0, 2, 1, 3)).reshape(b, t, n * h)


def project(x: jax.Array, kernel: jax.Array,
            bias: jax.Array | None) -> jax.Array:
  """One dense projection ``x @ kernel + bias``: ``[B, T, D] @ [D, F] -> [B, T, F]``.

  Example:
    >>> project(jnp.ones((2, 5, 8)), jnp.ones((8, 4)), jnp.zeros(4)).shape
    (2, 5, 4)
  """
  y = jnp.einsum("BTD,DF->BTF", x, kernel)
  return y if bias is None else y + bias[None, None, :]


def project_heads(x: jax.Array, layer: dict[str, jax.Array],
                  num_heads: int) -> jax.Array:
  """Per-head projection, vmapped over heads: ``[B, T, D] -> [B, N, T, H]``.

  Args:
    x: ``[B, T, D]``.
    layer: ``{"kernel": [D, N*H], "bias": [N*H]}`` (bias optional).
    num_heads: ``N``.

  Returns:
    ``[B, N, T, H]``: ``project`` applied with each head's kernel slice.

  Example:
    >>> layer = {"kernel": jnp.ones((8, 12))}
    >>> project_heads(jnp.ones((2, 5, 8)), layer, 3).shape
    (2, 3, 5, 4)
  """
  kernels = split_heads(layer["kernel"], num_heads)  # [N, D, H]
  bias = layer.get("bias")
  biases = None if bias is None else split_heads(bias, num_heads)  # [N, H]
  return jax.vmap(project, in_axes=(None, 0, 0 if biases is not None else None),
                  out_axes=1)(x, kernels, biases)  # [B, N, T, H]


def _check_params(params, d_model: int, num_heads: int,
                  num_kv_heads: int) -> None:
  head_dim = d_model // num_heads
  expected = {"W_q": (d_model, num_heads * head_dim),
              "W_k": (d_model, num_kv_heads * head_dim),
              "W_v": (d_model, num_kv_heads * head_dim),
              "W_o": (num_heads * head_dim, d_model)}
  for name, shape in expected.items():
    if name not in params or "kernel" not in params[name]:
      raise ValueError(f"params must have {name}['kernel'], got keys "
                       f"{sorted(params)}.")
    got = _checks.shape_of(params[name]["kernel"])
    if got != shape:
      raise ValueError(
          f"params['{name}']['kernel'] has shape {got}, expected {shape} for "
          f"d_model={d_model}, num_heads={num_heads}, "
          f"num_kv_heads={num_kv_heads}.")
    if "bias" in params[name]:
      got = _checks.shape_of(params[name]["bias"])
      if got != shape[1:]:
        raise ValueError(f"params['{name}']['bias'] has shape {got}, "
                         f"expected {shape[1:]}.")


def _check_mask_and_bias(mask, bias, full: tuple[int, ...], layout: str):
  """Validates per-head ``mask``/``bias`` against ``full``; returns them as arrays.

  The mask comes back bool, the bias as a float array; ``None`` stays None.
  """
  for name, x in (("mask", mask), ("bias", bias)):
    if x is not None:
      _checks.check_broadcastable_to(name, _checks.shape_of(x), full, layout)
  if mask is not None:
    _checks.check_mask_dtype("mask", mask)
    mask = _numerics.as_bool_mask(mask)
  if bias is not None:
    _checks.check_float_array("bias", bias)
    bias = jnp.asarray(bias)
  return mask, bias


def attend_heads(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array | None = None,
    *,
    bias: jax.Array | None = None,
    is_causal: bool = False,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    attention_fn: AttentionFn | None = None,
    implementation: str | None = None,
    return_weights: bool = False,
    **pattern: Any,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Attention of N query heads over K shared key/value heads.

  Args:
    query: ``[B, N, T, H]`` projected queries.
    key: ``[B, K, S, H]`` projected keys; ``K`` divides ``N``.
    value: ``[B, K, S, H]`` projected values.
    mask: optional bool broadcastable to ``[B, N, T, S]``.
    bias: optional float broadcastable to ``[B, N, T, S]``.
    is_causal: bottom-right aligned causal masking.
    dropout_rate: dropout on the attention weights.
    dropout_rng: key for dropout.
    attention_fn: replaces ``scaled_dot_product_attention``, with its
      contract: called as ``attention_fn(query, key, value, mask=...,
      bias=..., scale=..., is_causal=...)`` on these ``[B, N, T, H]`` /
      ``[B, K, S, H]`` operands (``mask``/``bias`` only when given;
      ``dropout_rate``/``dropout_rng`` only when dropout is on;
      ``return_weights=True`` only when weights are asked for), returning
      the output (and the weights with ``return_weights``). So
      ``aj.blockwise_attention`` plugs in as it is.
    implementation: passed to ``scaled_dot_product_attention`` (``None``
      picks; ``"dense"``, ``"blockwise"``, ``"cudnn"``) when ``attention_fn``
      is not given.
    return_weights: also return the weights.
    **pattern: the structured-attention arguments of
      ``scaled_dot_product_attention`` (``key_value_seq_lengths``,
      ``query_seq_lengths``, ``local_window_size``, ``query_segment_ids``,
      ``key_segment_ids``, ``logits_soft_cap``, ``sinks``, ``score_mod``,
      ``score_mod_args``) in its 4-D conventions (e.g. lengths ``[B, 1]``);
      passed to ``attention_fn`` only when not None.

  Returns:
    ``out [B, N, T, H]``, or ``(out, weights [B, N, T, S])`` with
    ``return_weights``.

  Example:
    >>> q, kv = jnp.ones((2, 4, 3, 8)), jnp.ones((2, 2, 5, 8))  # N=4, K=2
    >>> out, w = attend_heads(q, kv, kv, return_weights=True)
    >>> out.shape, w.shape
    ((2, 4, 3, 8), (2, 4, 3, 5))
  """
  if attention_fn is None:
    attention_fn = functools.partial(
        dot_product.scaled_dot_product_attention,
        implementation=implementation)
  kwargs = {"scale": 1.0 / math.sqrt(query.shape[-1]), "is_causal": is_causal}
  if mask is not None:
    kwargs["mask"] = mask
  if bias is not None:
    kwargs["bias"] = bias
  if not (isinstance(dropout_rate, (int, float)) and dropout_rate == 0.0):
    kwargs.update(dropout_rate=dropout_rate, dropout_rng=dropout_rng)
  if return_weights:
    kwargs["return_weights"] = True
  unknown = set(pattern) - set(PATTERN_ARGS)
  if unknown:
    raise TypeError(f"attend_heads got unexpected keyword arguments "
                    f"{sorted(unknown)}; the pattern arguments are "
                    f"{list(PATTERN_ARGS)}.")
  kwargs.update({k: x for k, x in pattern.items()
                 if x is not None and not (k == "score_mod_args" and not x)})
  return attention_fn(query, key, value, **kwargs)


ScoreMod = _patterns.ScoreMod

# The structured-attention arguments multi-head attention passes through.
PATTERN_ARGS = ("key_value_seq_lengths", "query_seq_lengths",
                "local_window_size", "query_segment_ids", "key_segment_ids",
                "logits_soft_cap", "sinks", "score_mod", "score_mod_args")


def _heads_layout(pattern: dict[str, Any]) -> dict[str, Any]:
  """``[B, T, D]``-call pattern arguments in the 4-D ``[B, N, T, H]`` layout.

  Lengths ``[B]`` gain a head axis (``[B, 1]``), segment ids ``[B, T]``
  become ``[B, 1, T]``; shapes that are not per-example pass unchanged (the
  attention function checks them).
  """
  out = dict(pattern)
  for name in ("key_value_seq_lengths", "query_seq_lengths"):
    x = out.get(name)
    if x is not None and np.ndim(x) == 1:
      out[name] = jnp.asarray(x)[:, None]  # [B] -> [B, 1]
  for name in ("query_segment_ids", "key_segment_ids"):
    x = out.get(name)
    if x is not None and np.ndim(x) == 2:
      out[name] = jnp.asarray(x)[:, None, :]  # [B, T] -> [B, 1, T]
  return out


def _decode_pattern(pattern: dict[str, Any], visible, index):
  """Pattern arguments for queries over cache slots; the visibility mask.

  The window becomes part of the ``[T, L]`` visibility mask (slot positions
  are absolute, the queries stand at ``index + i``), and ``score_mod`` sees
  absolute query positions through one extra argument, so cached decoding
  equals the full forward. Segment ids would need a cache of their own.
  """
  pattern = dict(pattern)
  for name in ("query_segment_ids", "key_segment_ids"):
    if pattern.get(name) is not None:
      raise ValueError(
          f"{name} is not supported while decoding with a KV cache (the "
          "cache holds no segment ids): mask cache slots with `mask` "
          "instead.")
  window = _patterns.check_window(pattern.pop("local_window_size", None))
  if window is not None:
    t, length = visible.shape
    position = index + jnp.arange(t)[:, None]  # [T, 1] absolute
    slots = jnp.arange(length)[None, :]  # [1, L]
    visible = visible & (slots >= position - window[0]) & (
        slots <= position + window[1])
  score_mod = pattern.get("score_mod")
  if score_mod is not None:
    shift = jnp.asarray(index, jnp.float32).reshape(1, 1)

    def absolute(score, q_idx, kv_idx, *args):
      *args, offset = args
      return score_mod(score, q_idx + offset.astype(q_idx.dtype), kv_idx,
                       *args)

    pattern["score_mod"] = absolute
    pattern["score_mod_args"] = tuple(pattern.get("score_mod_args")
                                      or ()) + (shift,)
  return pattern, visible


def _rope_positions(t: int, s: int, cache, pattern):
  """Positions of this call's queries and keys for rotary embeddings.

  Decoding: both at ``index + i`` (keys are rotated before they enter the
  cache). Packed documents: restarting per segment (``segment_positions``,
  ``[B, 1, T]``). Otherwise ``arange``, queries bottom-right aligned
  (``S - T + i``, the package's convention).
  """
  if cache is not None:
    here = cache.index + jnp.arange(t)
    return here, here
  q_ids, k_ids = (pattern.get(n) for n in ("query_segment_ids",
                                            "key_segment_ids"))
  if q_ids is not None and k_ids is not None:
    as_heads = lambda ids: rope_lib.segment_positions(
        jnp.asarray(ids))[:, None, :] if np.ndim(ids) == 2 else (
            rope_lib.segment_positions(jnp.asarray(ids)))
    return as_heads(q_ids), as_heads(k_ids)
  return s - t + jnp.arange(t), jnp.arange(s)


class KVCache(NamedTuple):
  """A key/value cache: buffers ``[B, K, L, H]`` and the filled count."""
  key: jax.Array
  value: jax.Array
  index: jax.Array  # int32 scalar


def _check_inputs(query, key, value, cache: KVCache | None) -> None:
  for name, x in (("query", query), ("key", key), ("value", value)):
    _checks.check_float_array(name, x)
  _checks.check_rank("query", query, (3,), "[B, T, D]")
  _checks.check_rank("key", key, (3,), "[B, S, D]")
  _checks.check_rank("value", value, (3,), "[B, S, D]")
  q_shape, k_shape, v_shape = map(_checks.shape_of, (query, key, value))
  d_model = q_shape[-1]
  if k_shape[-1] != d_model or v_shape[-1] != d_model:
    raise ValueError(
        f"query, key and value must share the model dim D: query {q_shape}, "
        f"key {k_shape}, value {v_shape}.")
  if k_shape[:2] != v_shape[:2]:
    raise ValueError(f"key {k_shape} and value {v_shape} must have the same "
                     "[B, S].")
  if q_shape[0] != k_shape[0]:
    raise ValueError(f"query {q_shape} and key {k_shape} must have the same "
                     "batch size B.")
  if cache is not None and (k_shape[:2] != q_shape[:2]
                            or q_shape[0] != cache.key.shape[0]):
    raise ValueError(
        f"decoding appends this call's tokens: query {q_shape} and key "
        f"{k_shape} must share [B, T], and B must equal the cache's batch "
        f"{cache.key.shape[0]}.")


def forward(
    params: Params,
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    mask: ArrayLike | None = None,
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    bias: ArrayLike | None = None,
    is_causal: bool = False,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    attention_fn: AttentionFn | None = None,
    implementation: str | None = None,
    return_weights: bool = False,
    head_axis: str | None = None,
    cache: KVCache | None = None,
    rope: float | None = None,
    **pattern: Any,
) -> tuple[jax.Array, jax.Array | None, KVCache | None]:
  """The one projection -> attention -> output path, with or without a cache.

  ``multi_head_attention`` is this without a cache; ``MultiHeadAttention``
  calls it with its cache when decoding. With ``cache``, this call's keys and
  values are written at ``cache.index`` (``update_kv_cache``) and the
  queries attend causally to every filled slot; ``mask``/``bias`` are then
  over the ``L`` cache slots (``[B, N, T, L]``). ``pattern`` holds the
  structured-attention arguments (``PATTERN_ARGS``) in the ``[B, T, D]``
  layout (lengths ``[B]``, segment ids ``[B, T]``). ``rope`` is the base of
  rotary position embeddings applied to the projected queries and keys
  (``_rope_positions`` says which positions), None for none.

  Returns:
    ``(output [B, T, D], weights [B, N, T, S or L] or None, updated cache or
    None)``.
  """
  _check_inputs(query, key, value, cache)
  q_shape, k_shape = _checks.shape_of(query), _checks.shape_of(key)
  num_kv_heads = _checks.check_head_counts(q_shape[-1], num_heads,
                                           num_kv_heads)
  _check_params(params, q_shape[-1], num_heads, num_kv_heads)
  sharding.check_heads_divide(num_heads, num_kv_heads, head_axis)
  b, t = q_shape[:2]
  if cache is None:
    full, layout = (b, num_heads, t, k_shape[1]), "[B, N, T, S]"
  else:
    full = (b, num_heads, t, cache.key.shape[2])
    layout = "[B, N, T, L] (decoding: L cache slots)"
  mask, bias = _check_mask_and_bias(mask, bias, full, layout)
  query, key, value = map(jnp.asarray, (query, key, value))
  if mask is not None and cache is None:
    # Padded inputs may hold NaN: zero them before W_k/W_v.
    m = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)  # [B|1, N|1, T|1, S|1]
    key, value = _numerics.zero_unseen(jnp.any(m, axis=(1, 2)), key, value)
  q = project_heads(query, params["W_q"], num_heads)  # [B, N, T, H]
  k = project_heads(key, params["W_k"], num_kv_heads)  # [B, K, S, H]
  v = project_heads(value, params["W_v"], num_kv_heads)  # [B, K, S, H]
  q, k, v = (sharding.constrain_heads(x, head_axis) for x in (q, k, v))
  if rope is not None:
    q_pos, k_pos = _rope_positions(t, k.shape[2], cache, pattern)
    q = rope_lib.apply_rope(q, q_pos, base=rope)
    k = rope_lib.apply_rope(k, k_pos, base=rope)  # cached keys stay rotated
  if cache is not None:
    k, v, visible = kv_cache.update_kv_cache(cache.key, cache.value,
                                             cache.index, k, v)  # [B, K, L, H]
    pattern, visible = _decode_pattern(pattern, visible, cache.index)
    cache = KVCache(k, v, cache.index + t)
    mask = masks.combine_masks(mask, visible)  # the causal part, over slots
    is_causal = False
  result = attend_heads(
      q, k, v, mask, bias=bias, is_causal=is_causal,
      dropout_rate=dropout_rate, dropout_rng=dropout_rng,
      attention_fn=attention_fn, implementation=implementation,
      return_weights=return_weights, **_heads_layout(pattern))
  out, weights = result if return_weights else (result, None)
  output = project(merge_heads(out), params["W_o"]["kernel"],
                   params["W_o"].get("bias"))  # [B, T, D]
  return output, weights, cache


def multi_head_attention(
    params: Params,
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    mask: ArrayLike | None = None,
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    bias: ArrayLike | None = None,
    is_causal: bool = False,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    attention_fn: AttentionFn | None = None,
    implementation: str | None = None,
    return_weights: bool = False,
    head_axis: str | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    query_seq_lengths: ArrayLike | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    query_segment_ids: ArrayLike | None = None,
    key_segment_ids: ArrayLike | None = None,
    logits_soft_cap: float | None = None,
    sinks: ArrayLike | None = None,
    score_mod: Any = None,
    score_mod_args: tuple[ArrayLike, ...] = (),
    rope: float | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """The lesson's ``MultiHeadAttention.forward`` as a pure function.

  Args:
    params: from ``init_multi_head_params``.
    query: float ``[B, T, D]``.
    key: float ``[B, S, D]``.
    value: float ``[B, S, D]``.
    mask: optional bool/integer broadcastable to ``[B, N, T, S]`` (True =
      may attend), e.g. from ``make_attention_mask``.
    num_heads: ``N`` (static).
    num_kv_heads: ``K`` (static); ``None`` means ``N``.
    bias: optional float broadcastable to ``[B, N, T, S]`` added to logits.
    is_causal: bottom-right aligned causal masking (static).
    dropout_rate: dropout on attention weights, in ``[0, 1)`` (static).
    dropout_rng: ``jax.random.key``, required when ``dropout_rate > 0``.
    attention_fn: optional replacement for ``scaled_dot_product_attention``
      with its contract (see ``attend_heads``), e.g.
      ``aj.blockwise_attention``.
    implementation: ``None`` | ``"dense"`` | ``"blockwise"`` | ``"cudnn"``;
      see ``scaled_dot_product_attention``.
    return_weights: also return the attention weights (static).
    head_axis: mesh axis the heads are split over (head parallelism, see
      ``attention_jax.sharding``); under ``jax.set_mesh`` with that axis the
      projected heads are pinned to it, elsewhere it is ignored. ``N`` and
      ``K`` must divide its size.
    key_value_seq_lengths: optional integer ``[B]``: keys at positions
      ``>=`` the length are padding (no ``[T, S]`` mask needed).
    query_seq_lengths: optional integer ``[B]``: rows past it get output 0.
    local_window_size: ``w`` or ``(left, right)``, as in
      ``scaled_dot_product_attention`` (static).
    query_segment_ids: optional integer ``[B, T]`` (packed documents).
    key_segment_ids: optional integer ``[B, S]``, with the query ids.
    logits_soft_cap: ``c``: logits become ``c * tanh(logits / c)``.
    sinks: optional float ``[N]``: per-head sink logits.
    score_mod: ``score_mod(score, q_idx, kv_idx, *score_mod_args)``.
    score_mod_args: arrays broadcastable to ``[B, N, T, S]``.
    rope: base of rotary position embeddings (e.g. ``10000.0``) applied to
      the projected queries and keys (``apply_rope``; positions restart per
      document with segment ids, queries bottom-right aligned otherwise);
      None for none.

  Returns:
    ``output [B, T, D]``, or ``(output, weights float32 [B, N, T, S])`` with
    ``return_weights``.

  Example:
    >>> p = init_multi_head_params(jax.random.key(0), 16, 4)
    >>> x = jnp.ones((2, 5, 16))
    >>> multi_head_attention(p, x, x, x, num_heads=4, is_causal=True).shape
    (2, 5, 16)
    >>> out, w = multi_head_attention(p, x, x, x, num_heads=4,
    ...                               return_weights=True)
    >>> w.shape
    (2, 4, 5, 5)
  """
  output, weights, _ = forward(
      params, query, key, value, mask, num_heads=num_heads,
      num_kv_heads=num_kv_heads, bias=bias, is_causal=is_causal,
      dropout_rate=dropout_rate, dropout_rng=dropout_rng,
      attention_fn=attention_fn, implementation=implementation,
      return_weights=return_weights, head_axis=head_axis,
      key_value_seq_lengths=key_value_seq_lengths,
      query_seq_lengths=query_seq_lengths,
      local_window_size=local_window_size,
      query_segment_ids=query_segment_ids, key_segment_ids=key_segment_ids,
      logits_soft_cap=logits_soft_cap, sinks=sinks, score_mod=score_mod,
      score_mod_args=score_mod_args, rope=rope)
  return (output, weights) if return_weights else output
