"""Multi-head attention as pure functions over a parameter dict.

Shape glossary: B batch, T query length, S key/value length, N query heads,
K key/value heads (grouped-query attention; ``K == N`` is ordinary MHA,
``K == 1`` multi-query), G = N // K query heads per key/value head, H head
dim (``D // N`` unless chosen), D model (query) dim, Dkv key/value input
features, Dout output features.

The parameters (``{"W_q", "W_k", "W_v", "W_o"}`` per head, as flax lays
them out) and their checks live in ``multi_head_params``; everything (N, K,
H, D, Dkv, Dout, qk-norm) is read from their shapes (``param_dims``).

How the heads are computed (kept literal so readers can follow it): one pure
projection (``project``) is ``jax.vmap``-ed over the heads axis of a kernel
(``project_heads``), the attention function runs
(``scaled_dot_product_attention``: a kernel's single-head attention vmapped
over the head axes), and the per-head outputs are weighted by their slice
of ``W_o`` and summed over heads (``output_projection``), which is the
lesson's concat followed by one linear layer. A key/value head is shared by
its G query heads through ``vmap`` (an unmapped operand), not copied.
``forward`` is the one projection -> attention -> output path, used with a KV
cache (``decoding``) by ``MultiHeadAttention`` when decoding. The call's
pattern is one ``aj.Mask``, handed to the attention function as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from attention_jax import _checks
from attention_jax import _numerics
from attention_jax import decoding
from attention_jax import dot_product
from attention_jax import kernels
from attention_jax import mask as mask_lib
from attention_jax import multi_head_params
from attention_jax import rope as rope_lib
from attention_jax import sharding
from attention_jax.decoding import KVCache
from attention_jax.mask import Mask
from attention_jax.multi_head_params import init_multi_head_params  # noqa: F401 (doctests)
from attention_jax.multi_head_params import param_dims

# Anything with scaled_dot_product_attention's contract (see attend_heads).
AttentionFn = Callable[..., Any]
# jnp.einsum's precision: None, a jax.lax.Precision, or a pair of them.
Precision = Any
Params = multi_head_params.Params
QK_NORM_EPSILON = 1e-6  # flax nnx.RMSNorm's default


def project(x: jax.Array, kernel: jax.Array, bias: jax.Array | None, *,
            precision: Precision = None) -> jax.Array:
  """One dense projection ``x @ kernel + bias``: ``[B, T, D] @ [D, F] -> [B, T, F]``.

  Example:
    >>> project(jnp.ones((2, 5, 8)), jnp.ones((8, 4)), jnp.zeros(4)).shape
    (2, 5, 4)
  """
  y = jnp.einsum("BTD,DF->BTF", x, kernel, precision=precision)
  return y if bias is None else y + bias[None, None, :]


def project_heads(x: jax.Array, layer: Mapping[str, jax.Array], *,
                  precision: Precision = None) -> jax.Array:
  """Per-head projection, ``project`` vmapped over the kernel's heads axis.

  Args:
    x: ``[B, T, D]``.
    layer: ``{"kernel": [D, N, H], "bias": [N, H]}`` (bias optional).
    precision: ``jnp.einsum``'s precision for the projection.

  Returns:
    ``[B, N, T, H]``: head ``n`` is ``x @ kernel[:, n] + bias[n]``.

  Example:
    >>> layer = {"kernel": jnp.ones((8, 3, 4))}
    >>> project_heads(jnp.ones((2, 5, 8)), layer).shape
    (2, 3, 5, 4)
  """
  bias = layer.get("bias")
  per_head = functools.partial(project, precision=precision)
  return jax.vmap(per_head, in_axes=(None, 1, 0 if bias is not None else None),
                  out_axes=1)(x, layer["kernel"], bias)  # [B, N, T, H]


def output_projection(heads: jax.Array, layer: Mapping[str, jax.Array], *,
                      precision: Precision = None) -> jax.Array:
  """``W_o`` over per-head outputs: ``[B, N, T, H] x [N, H, Dout] -> [B, T, Dout]``.

  Each head's output meets its own ``[H, Dout]`` slice of the kernel and the
  heads are summed, which equals the lesson's concat (``[B, T, N*H]``)
  followed by one linear layer with the kernel flattened to ``[N*H, Dout]``.

  Args:
    heads: ``[B, N, T, H]``.
    layer: ``{"kernel": [N, H, Dout], "bias": [Dout]}`` (bias optional).
    precision: ``jnp.einsum``'s precision.

  Returns:
    ``[B, T, Dout]``.

  Example:
    >>> heads = jnp.ones((2, 3, 5, 4))                  # [B, N, T, H]
    >>> w_o = {"kernel": jnp.ones((3, 4, 6))}           # [N, H, Dout]
    >>> concat = jnp.swapaxes(heads, 1, 2).reshape(2, 5, 12)
    >>> bool(jnp.allclose(output_projection(heads, w_o),
    ...                   concat @ w_o["kernel"].reshape(12, 6)))
    True
  """
  y = jnp.einsum("BNTH,NHD->BTD", heads, layer["kernel"],
                 precision=precision)  # [B, T, Dout]
  bias = layer.get("bias")
  return y if bias is None else y + bias[None, None, :]


def rms_norm(x: jax.Array, scale: jax.Array, *,
             epsilon: float = QK_NORM_EPSILON) -> jax.Array:
  """RMSNorm over the last (head) axis, computed in float32 (or float64).

  ``x / sqrt(mean(x**2) + epsilon) * scale``, as flax's ``nnx.RMSNorm``:
  qk-norm as Gemma applies it to each projected query and key head.
  (flax's ``nnx.MultiHeadAttention(normalize_qk=True)`` uses a bias-free
  LayerNorm instead, which also subtracts the mean.)

  Args:
    x: ``[..., H]``.
    scale: ``[H]``, learned.
    epsilon: added to the mean square.

  Returns:
    ``[..., H]`` in ``x``'s dtype.

  Example:
    >>> y = rms_norm(jnp.array([[3.0, 4.0]]), jnp.ones(2))
    >>> bool(jnp.allclose(jnp.mean(y ** 2), 1.0, atol=1e-5))
    True
  """
  dtype = jnp.promote_types(x.dtype, jnp.float32)
  x32 = x.astype(dtype)
  mean_square = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
  scale = jnp.asarray(scale, dtype).reshape((1,) * (x.ndim - 1) + (-1,))
  return (x32 * jax.lax.rsqrt(mean_square + epsilon) * scale).astype(x.dtype)


def _check_mask_and_bias(mask, bias, full: tuple[int, ...], layout: str):
  """Validates per-head ``mask``/``bias`` against ``full``; returns them as arrays.

  Both must have the logits' full rank 4 (size-1 axes broadcast): a lower
  rank could be read two ways (a ``[B, S]`` padding mask aligned to the
  right would be taken as ``[T, S]``). The mask comes back bool, the bias as
  a float array; ``None`` stays None.
  """
  for name, x in (("mask", mask), ("bias", bias)):
    if x is None:
      continue
    shape = _checks.shape_of(x)
    _checks.check_logits_rank(name, shape, full, layout)
    _checks.check_broadcastable_to(name, shape, full, layout)
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
    mask: Mask | ArrayLike | None = None,
    *,
    bias: jax.Array | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    score_mod: Any = None,
    sinks: jax.Array | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    attention_fn: AttentionFn | Any = None,
    return_weights: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Attention of N query heads over K shared key/value heads.

  Args:
    query: ``[B, N, T, H]`` projected queries.
    key: ``[B, K, S, H]`` projected keys; ``K`` divides ``N``.
    value: ``[B, K, S, H]`` projected values.
    mask: an ``aj.Mask`` (lengths ``[B]`` and segment ids ``[B, T]`` align
      to the left, so they read per example), or a dense bool array of rank
      4 broadcastable to ``[B, N, T, S]``.
    bias: optional float of rank 4, broadcastable to ``[B, N, T, S]``.
    scale: multiplier of ``q . k``; None leaves it to ``attention_fn``'s
      default (``1 / sqrt(H)`` for the package's functions), so a
      ``functools.partial(fn, scale=...)`` is honoured. Giving both is
      refused: one of them would be silently ignored.
    is_causal: shorthand for ``mask & aj.Mask(causal=True)``.
    score_mod: ``score_mod(score, b, h, q_idx, kv_idx)``.
    sinks: per-head sink logits ``[N]``.
    dropout_rate: dropout on the attention weights.
    dropout_rng: key for dropout.
    attention_fn: a replacement for ``scaled_dot_product_attention`` with
      its contract: called as ``attention_fn(query, key, value, mask=...,
      bias=..., scale=..., score_mod=..., sinks=...)`` on these
      ``[B, N, T, H]`` / ``[B, K, S, H]`` operands, each keyword only when
      given (``mask`` is one ``aj.Mask``; ``dropout_rate``/``dropout_rng``
      only when dropout is on; ``return_weights=True`` only when weights
      are asked for), returning the output (and the weights with
      ``return_weights``); so ``aj.blockwise_attention`` plugs in as it is.
      Or an ``implementation`` of ``scaled_dot_product_attention`` (a
      kernel name, a kernel or a list of them). None: that function,
      automatic.
    return_weights: also return the weights.

  Returns:
    ``out [B, N, T, H]``, or ``(out, weights [B, N, T, S])`` with
    ``return_weights``.

  Example:
    >>> q, kv = jnp.ones((2, 4, 3, 8)), jnp.ones((2, 2, 5, 8))  # N=4, K=2
    >>> out, w = attend_heads(q, kv, kv, return_weights=True)
    >>> out.shape, w.shape
    ((2, 4, 3, 8), (2, 4, 3, 5))
  """
  _checks.check_static_bool("is_causal", is_causal)
  mask = mask_lib.as_mask(mask, is_causal=is_causal)
  if isinstance(attention_fn, type):
    raise TypeError(
        f"attention_fn is the class {attention_fn.__name__}; pass a function "
        f"with scaled_dot_product_attention's contract or an implementation "
        f"(a kernel name, or an instance such as {attention_fn.__name__}()).")
  if isinstance(attention_fn, (list, tuple)) and not all(
      isinstance(x, (str, kernels.Kernel)) for x in attention_fn):
    raise TypeError(
        f"attention_fn as a list is implementations to try in order (kernel "
        f"names or aj.kernels instances), got {attention_fn!r}; a function "
        "with scaled_dot_product_attention's contract is passed alone.")
  if attention_fn is None or not callable(attention_fn) or isinstance(
      attention_fn, kernels.Kernel):
    attention_fn = functools.partial(
        dot_product.scaled_dot_product_attention,
        implementation=attention_fn)
  kwargs = {}
  if scale is not None:
    fixed = _partial_keywords(attention_fn)
    if "scale" in fixed:
      raise ValueError(
          f"scale={scale!r} was given, and attention_fn fixes "
          f"scale={fixed['scale']!r} (functools.partial): set the scale in "
          "one place.")
    kwargs["scale"] = scale
  for name, x in (("mask", mask), ("bias", bias), ("score_mod", score_mod),
                  ("sinks", sinks)):
    if x is not None:
      kwargs[name] = x
  if not (isinstance(dropout_rate, (int, float)) and dropout_rate == 0.0):
    kwargs.update(dropout_rate=dropout_rate, dropout_rng=dropout_rng)
  if return_weights:
    kwargs["return_weights"] = True
  _check_accepts(attention_fn, kwargs)
  return attention_fn(query, key, value, **kwargs)


def _check_accepts(attention_fn, kwargs: dict[str, Any]) -> None:
  """Refuses, by name, what a custom ``attention_fn`` cannot take.

  Python's own error ("unexpected keyword argument") would not say that the
  layer passes it, nor what to do; a function with ``**kwargs`` (or one
  whose signature cannot be read) is trusted.
  """
  try:
    params = inspect.signature(attention_fn).parameters.values()
  except (TypeError, ValueError):
    return
  if any(p.kind is p.VAR_KEYWORD for p in params):
    return
  names = {p.name for p in params
           if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
  missing = [k for k in kwargs if k not in names]
  if missing:
    given = ", ".join(f"{k}={_short(kwargs[k])}" for k in missing)
    fn_name = getattr(attention_fn, "__name__", type(attention_fn).__name__)
    hint = (" (a layer's score_mod, logits_soft_cap and t5_bias all travel "
            "as score_mod)" if "score_mod" in missing else "")
    if "mask" in missing:
      hint += (" (the mask is one aj.Mask; mask.jax_nn_arguments(T, S) "
               "gives jax.nn's keywords for it)")
    raise ValueError(
        f"attention_fn {fn_name} takes no {', '.join(missing)}, which this "
        f"call passes ({given}){hint}: accept it in attention_fn (with "
        "scaled_dot_product_attention's meaning), or leave it out of the "
        "layer and the call.")


def _short(x) -> str:
  """A value for a message: arrays by shape, the rest by repr."""
  shape = getattr(x, "shape", None)
  return f"<array {list(shape)}>" if shape is not None else repr(x)


def _partial_keywords(fn) -> dict[str, Any]:
  """The keywords a (nested) ``functools.partial`` fixes."""
  fixed = {}
  while isinstance(fn, functools.partial):
    fixed = {**fn.keywords, **fixed}
    fn = fn.func
  return fixed


def _rope_positions(t: int, s: int, mask: Mask | None):
  """Positions of this call's queries and keys for rotary embeddings.

  Packed documents: restarting per segment (``segment_positions``,
  ``[B, 1, T]``). Otherwise ``arange``, queries bottom-right aligned
  (``S - T + i``, the package's convention). (Decoding uses each example's
  cache positions, see ``forward``.)
  """
  if mask is not None and mask.q_segment_ids is not None:
    def as_heads(ids):
      ids = jnp.asarray(ids)
      positions = rope_lib.segment_positions(ids)
      return positions[:, None, :] if ids.ndim == 2 else positions
    return as_heads(mask.q_segment_ids), as_heads(mask.kv_segment_ids)
  return s - t + jnp.arange(t), jnp.arange(s)


def _check_inputs(query, key, value, cache: KVCache | None,
                  params: Mapping[str, Any], dims: multi_head_params.HeadDims) -> None:
  for name, x in (("query", query), ("key", key), ("value", value)):
    _checks.check_float_array(name, x)
  _checks.check_rank("query", query, (3,), "[B, T, D]")
  _checks.check_rank("key", key, (3,), "[B, S, Dkv]")
  _checks.check_rank("value", value, (3,), "[B, S, Dkv]")
  q_shape, k_shape, v_shape = map(_checks.shape_of, (query, key, value))
  if k_shape != v_shape:
    raise ValueError(
        f"key {k_shape} and value {v_shape} must have the same shape "
        f"[B, S, Dkv] (one W_k/W_v input width Dkv).")
  if q_shape[-1] != dims.d_model:
    raise ValueError(
        f"query has {q_shape[-1]} features (shape {q_shape}), but "
        f"params['W_q']['kernel'] has shape "
        f"{multi_head_params.param_shape(params, 'W_q', 'kernel')}: [D, N, H] "
        f"with D={dims.d_model}.")
  if k_shape[-1] != dims.kv_features:
    raise ValueError(
        f"key and value have {k_shape[-1]} features (shape {k_shape}), but "
        f"params['W_k']['kernel'] has shape "
        f"{multi_head_params.param_shape(params, 'W_k', 'kernel')}: [Dkv, K, H] "
        f"with Dkv={dims.kv_features}. Keys of another width "
        f"need params built with kv_features={k_shape[-1]}.")
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
    mask: Mask | ArrayLike | None = None,
    *,
    bias: ArrayLike | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    score_mod: Any = None,
    sinks: ArrayLike | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    attention_fn: AttentionFn | Any = None,
    return_weights: bool = False,
    rope: float | None = None,
    precision: Precision = None,
    head_axis: str | None = None,
    cache: KVCache | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
) -> tuple[jax.Array, jax.Array | None, KVCache | None]:
  """The one projection -> attention -> output path, with or without a cache.

  ``multi_head_attention`` is this without a cache; ``MultiHeadAttention``
  calls it with its cache when decoding. The sizes (N, K, H, D, Dkv, Dout,
  qk-norm) come from ``params`` (``param_dims``); ``num_heads`` /
  ``num_kv_heads``, when given, must agree with them. With ``cache``, this
  call's keys and values are written at ``cache.index``
  (``decoding.write``) and the queries attend causally to every filled
  slot; a dense mask and the bias are then over the ``L`` cache slots
  (``[B, N, T, L]``, rank 4). Order per head: projection, qk-norm, rotary
  positions (``rope``, the base; ``_rope_positions`` says which positions),
  cache write, attention, ``W_o``.

  Returns:
    ``(output [B, T, Dout], weights [B, N, T, S or L] or None, updated
    cache or None)``.

  Example:
    >>> p = init_multi_head_params(jax.random.key(0), 8, 2)
    >>> x = jnp.ones((1, 3, 8))
    >>> out, _, _ = forward(p, x, x, x, is_causal=True)
    >>> out.shape
    (1, 3, 8)
  """
  dims = param_dims(params, num_heads=num_heads, num_kv_heads=num_kv_heads)
  _check_inputs(query, key, value, cache, params, dims)
  _checks.check_static_bool("is_causal", is_causal)
  q_shape, k_shape = _checks.shape_of(query), _checks.shape_of(key)
  sharding.check_heads_divide(dims.num_heads, dims.num_kv_heads, head_axis)
  b, t = q_shape[:2]
  if cache is None:
    full, layout = (b, dims.num_heads, t, k_shape[1]), "[B, N, T, S]"
  else:
    full = (b, dims.num_heads, t, cache.key.shape[2])
    layout = "[B, N, T, L] (decoding: L cache slots)"
  m = mask_lib.as_mask(mask, is_causal=is_causal and cache is None)
  dense, bias = _check_mask_and_bias(None if m is None else m.dense, bias,
                                     full, layout)
  if dense is not None:
    m = mask_lib.Mask(**{**_fields(m), "dense": dense})
  query, key, value = map(jnp.asarray, (query, key, value))
  if dense is not None and cache is None:
    # Padded inputs may hold NaN: zero them before W_k/W_v.
    seen = jnp.any(dense, axis=(1, 2))  # [B|1, S|1]
    key, value = _numerics.zero_unseen(seen, key, value)
  q = project_heads(query, params["W_q"], precision=precision)  # [B, N, T, H]
  k = project_heads(key, params["W_k"], precision=precision)  # [B, K, S, H]
  v = project_heads(value, params["W_v"], precision=precision)  # [B, K, S, H]
  q, k, v = (sharding.constrain_heads(x, head_axis) for x in (q, k, v))
  if dims.normalize_qk:  # Gemma's order: norm, then rotary positions
    q = rms_norm(q, params["q_norm"]["scale"])
    k = rms_norm(k, params["k_norm"]["scale"])
  if cache is not None:  # every example at its own position
    index = jnp.broadcast_to(jnp.asarray(cache.index, jnp.int32), (b,))
    lengths = decoding.new_lengths(m, b, t)
    q_pos = index[:, None] + jnp.arange(t)[None, :]  # [B, T] absolute
  if rope is not None:
    if cache is not None:  # keys are rotated before they enter the cache
      q_rot = k_rot = q_pos[:, None, :]  # [B, 1, T]
    else:
      q_rot, k_rot = _rope_positions(t, k.shape[2], m)
    q = rope_lib.apply_rope(q, q_rot, base=rope)
    k = rope_lib.apply_rope(k, k_rot, base=rope)
  if cache is not None:
    k, v, m, score_mod, cache = decoding.write(
        cache, k, v, m, bias, score_mod, index, lengths, q_pos,
        dims.num_heads)
  result = attend_heads(
      q, k, v, m, bias=bias, scale=scale, score_mod=score_mod, sinks=sinks,
      dropout_rate=dropout_rate, dropout_rng=dropout_rng,
      attention_fn=attention_fn, return_weights=return_weights)
  out, weights = result if return_weights else (result, None)
  output = output_projection(out, params["W_o"],
                             precision=precision)  # [B, T, Dout]
  return output, weights, cache


def _fields(m: Mask) -> dict[str, Any]:
  """A mask's constructor arguments (to rebuild it with one changed)."""
  return dict(causal=m.causal, window=m.window, q_lengths=m.q_lengths,
              kv_lengths=m.kv_lengths, q_segment_ids=m.q_segment_ids,
              kv_segment_ids=m.kv_segment_ids, dense=m.dense, rule=m.rule)


def multi_head_attention(
    params: Params,
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    mask: Mask | ArrayLike | None = None,
    *,
    bias: ArrayLike | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    score_mod: Any = None,
    sinks: ArrayLike | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    attention_fn: AttentionFn | Any = None,
    return_weights: bool = False,
    rope: float | None = None,
    precision: Precision = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """The lesson's ``MultiHeadAttention.forward`` as a pure function.

  The head structure is read from ``params`` (see ``init_multi_head_params``
  for the layout): ``N`` and ``H`` from ``W_q``, ``K`` from ``W_k``, the
  output width from ``W_o``, qk-norm from ``q_norm``/``k_norm``.

  Args:
    params: from ``init_multi_head_params`` (or a converter such as
      ``from_torch_multihead_attention``).
    query: float ``[B, T, D]``.
    key: float ``[B, S, Dkv]``.
    value: float ``[B, S, Dkv]``.
    mask: an ``aj.Mask`` (e.g. ``aj.Mask(kv_lengths=lengths [B])``,
      ``aj.Mask(q_segment_ids=ids [B, T])`` for packed documents,
      ``aj.Mask(causal=True, window=(W - 1, 0))``, a rule), or a dense
      bool/integer array of rank 4 broadcastable to ``[B, N, T, S]`` (True
      = may attend), e.g. from ``make_attention_mask``; a ``[B, S]``
      key-padding mask is ``mask[:, None, None, :]``.
    bias: optional float of rank 4 broadcastable to ``[B, N, T, S]``, added
      to the logits.
    scale: multiplier of ``q . k`` (static); None means ``1 / sqrt(H)``
      (or ``attention_fn``'s own default). Gemma 2 uses
      ``query_pre_attn_scalar ** -0.5``.
    is_causal: shorthand for ``mask & aj.Mask(causal=True)`` (static).
    score_mod: ``score_mod(score, b, h, q_idx, kv_idx)``, e.g.
      ``aj.alibi(slopes)``; see ``scaled_dot_product_attention``.
    sinks: optional float ``[N]``: per-head sink logits.
    dropout_rate: dropout on attention weights, in ``[0, 1)`` (static).
    dropout_rng: ``jax.random.key``, required when ``dropout_rate > 0``.
    attention_fn: a replacement for ``scaled_dot_product_attention`` with
      its contract (see ``attend_heads``), e.g. ``aj.blockwise_attention``;
      or its ``implementation`` (``"dense"``, ``"blockwise"``, ``"cudnn"``,
      a kernel, a list); None: automatic.
    return_weights: also return the attention weights (static).
    rope: base of rotary position embeddings (e.g. ``10000.0``) applied to
      the projected queries and keys (``apply_rope``; positions restart per
      document with segment ids, queries bottom-right aligned otherwise);
      None for none. With qk-norm, the norm comes first.
    precision: ``jax.lax.Precision`` (or None) of the projection einsums
      (``W_q``, ``W_k``, ``W_v``, ``W_o``); the attention itself runs at
      ``scaled_dot_product_attention``'s precision, which takes none.

  Returns:
    ``output [B, T, Dout]``, or ``(output, weights float32 [B, N, T, S])``
    with ``return_weights``.

  Example:
    >>> p = init_multi_head_params(jax.random.key(0), 16, 4)
    >>> x = jnp.ones((2, 5, 16))
    >>> multi_head_attention(p, x, x, x, is_causal=True).shape
    (2, 5, 16)
    >>> out, w = multi_head_attention(p, x, x, x, return_weights=True)
    >>> w.shape
    (2, 4, 5, 5)
    >>> q = init_multi_head_params(jax.random.key(0), 16, 2, head_dim=3,
    ...                            kv_features=6, out_features=4,
    ...                            normalize_qk=True)
    >>> multi_head_attention(q, x, jnp.ones((2, 7, 6)), jnp.ones((2, 7, 6)),
    ...                      aj.Mask(kv_lengths=jnp.array([7, 3]))).shape
    (2, 5, 4)
  """
  output, weights, _ = forward(
      params, query, key, value, mask, bias=bias, scale=scale,
      is_causal=is_causal, score_mod=score_mod, sinks=sinks,
      dropout_rate=dropout_rate, dropout_rng=dropout_rng,
      attention_fn=attention_fn, return_weights=return_weights, rope=rope,
      precision=precision)
  return (output, weights) if return_weights else output
