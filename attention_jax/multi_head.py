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
(``merge_heads``) before ``W_o``. There is no reshape-and-broadcast shortcut:
a key/value head is shared by its G query heads through ``vmap`` (unmapped
operand), not copied.
"""

from __future__ import annotations

from collections.abc import Callable
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from attention_jax import _checks
from attention_jax import dot_product
from attention_jax import sharding

Params = dict[str, dict[str, jax.Array]]
# Anything with scaled_dot_product_attention's signature and return value.
AttentionFn = Callable[..., tuple[jax.Array, Any]]


def _check_heads(d_model: int, num_heads: int,
                 num_kv_heads: int | None) -> int:
  _checks.check_positive_int("d_model", d_model)
  _checks.check_positive_int("num_heads", num_heads)
  if num_kv_heads is None:
    num_kv_heads = num_heads
  _checks.check_positive_int("num_kv_heads", num_kv_heads)
  if d_model % num_heads:
    raise ValueError(f"d_model={d_model} must be divisible by num_heads="
                     f"{num_heads}.")
  if num_heads % num_kv_heads:
    raise ValueError(f"num_heads={num_heads} must be divisible by "
                     f"num_kv_heads={num_kv_heads}.")
  return num_kv_heads


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
  num_kv_heads = _check_heads(d_model, num_heads, num_kv_heads)
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


def check_mask_and_bias(mask, bias, full: tuple[int, ...], layout: str):
  """Validates per-head ``mask``/``bias`` against ``full``; returns them as arrays.

  The mask comes back bool, the bias as a float array; ``None`` stays None.
  """
  for name, x in (("mask", mask), ("bias", bias)):
    if x is not None:
      _checks.check_broadcastable_to(name, _checks.shape_of(x), full, layout)
  if mask is not None:
    _checks.check_mask_dtype("mask", mask)
    mask = _checks.as_bool_mask(mask)
  if bias is not None:
    _checks.check_float_array("bias", bias)
    bias = jnp.asarray(bias)
  return mask, bias


def _group_heads(x, num_kv_heads: int):
  """``[B|1, N|1, ...] -> [B|1, K|1, G|1, ...]`` so K/V heads can be shared."""
  if x is None:
    return None
  x = x.reshape((1,) * (4 - x.ndim) + x.shape)  # [B?, N?, T?, S?]
  b, n, t, s = x.shape
  if n == 1:
    return x.reshape(b, 1, 1, t, s)
  return x.reshape(b, num_kv_heads, n // num_kv_heads, t, s)


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
    need_weights: bool = True,
) -> tuple[jax.Array, jax.Array | None]:
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
    attention_fn: replaces ``scaled_dot_product_attention`` (same signature
      and return value); it sees ``[B, K, G, T, H]`` queries and
      ``[B, K, 1, S, H]`` keys/values.
    implementation: passed to ``scaled_dot_product_attention`` (``None``
      picks; ``"dense"``, ``"blockwise"``, ``"cudnn"``) when ``attention_fn``
      is not given.
    need_weights: whether the weights are used (``False`` lets the automatic
      choice take a path that never forms them; weights may then be None).

  Returns:
    ``(out [B, N, T, H], weights [B, N, T, S] or None)``.

  Example:
    >>> q, kv = jnp.ones((2, 4, 3, 8)), jnp.ones((2, 2, 5, 8))  # N=4, K=2
    >>> out, w = attend_heads(q, kv, kv)
    >>> out.shape, w.shape
    ((2, 4, 3, 8), (2, 4, 3, 5))
  """
  b, num_heads, t, head_dim = query.shape
  num_kv_heads, s = key.shape[1], key.shape[2]
  group = num_heads // num_kv_heads
  if attention_fn is None:
    attention_fn = functools.partial(
        dot_product.scaled_dot_product_attention,
        implementation=implementation, need_weights=need_weights)
  q = query.reshape(b, num_kv_heads, group, t, head_dim)  # [B, K, G, T, H]
  k = key[:, :, None]  # [B, K, 1, S, H]: shared by the group's G query heads
  v = value[:, :, None]  # [B, K, 1, S, H]
  out, weights = attention_fn(
      q, k, v, _group_heads(mask, num_kv_heads),
      bias=_group_heads(bias, num_kv_heads), scale=1.0 / math.sqrt(head_dim),
      is_causal=is_causal, dropout_rate=dropout_rate, dropout_rng=dropout_rng)
  out = out.reshape(b, num_heads, t, value.shape[-1])  # [B, N, T, H]
  if weights is not None:
    weights = weights.reshape(b, num_heads, t, s)  # [B, N, T, S]
  return out, weights


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
    need_weights: bool = True,
    head_axis: str | None = None,
) -> tuple[jax.Array, jax.Array | None]:
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
      (same signature and return value), e.g. a memory-efficient kernel.
    implementation: ``None`` | ``"dense"`` | ``"blockwise"`` | ``"cudnn"``;
      see ``scaled_dot_product_attention``.
    need_weights: False allows a path that returns weights None.
    head_axis: mesh axis the heads are split over (head parallelism, see
      ``attention_jax.sharding``); under ``jax.set_mesh`` with that axis the
      projected heads are pinned to it, elsewhere it is ignored. ``N`` and
      ``K`` must divide its size.

  Returns:
    ``(output [B, T, D], weights float32 [B, N, T, S] or None)``.

  Example:
    >>> p = init_multi_head_params(jax.random.key(0), 16, 4)
    >>> x = jnp.ones((2, 5, 16))
    >>> out, w = multi_head_attention(p, x, x, x, num_heads=4, is_causal=True)
    >>> out.shape, w.shape
    ((2, 5, 16), (2, 4, 5, 5))
  """
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
  num_kv_heads = _check_heads(d_model, num_heads, num_kv_heads)
  _check_params(params, d_model, num_heads, num_kv_heads)
  b, t, s = q_shape[0], q_shape[1], k_shape[1]
  mask, bias = check_mask_and_bias(mask, bias, (b, num_heads, t, s),
                                   "[B, N, T, S]")

  sharding.check_heads_divide(num_heads, num_kv_heads, head_axis)
  if mask is not None:  # padded inputs may hold NaN: zero them before W_k/W_v
    m = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)  # [B|1, N|1, T|1, S|1]
    key, value = _checks.zero_unseen(jnp.any(m, axis=(1, 2)), key, value)
  q = project_heads(query, params["W_q"], num_heads)  # [B, N, T, H]
  k = project_heads(key, params["W_k"], num_kv_heads)  # [B, K, S, H]
  v = project_heads(value, params["W_v"], num_kv_heads)  # [B, K, S, H]
  q, k, v = (sharding.constrain_heads(x, head_axis) for x in (q, k, v))
  out, weights = attend_heads(
      q, k, v, mask, bias=bias, is_causal=is_causal, dropout_rate=dropout_rate,
      dropout_rng=dropout_rng, attention_fn=attention_fn,
      implementation=implementation, need_weights=need_weights)
  output = project(merge_heads(out), params["W_o"]["kernel"],
                   params["W_o"].get("bias"))  # [B, T, D]
  return output, weights
