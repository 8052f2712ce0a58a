"""Multi-head latent attention (MLA, DeepSeek-V2/V3) as pure functions.

Shape glossary: B batch, T query length (this call's tokens), S key length
(``S = T`` for the full forward), L cache slots, N query heads, D model
dim, Dout output features, Rq ``q_lora_rank``, R ``kv_lora_rank`` (the
latent width), Hn ``qk_nope_head_dim``, Hr ``qk_rope_head_dim``, Hv
``v_head_dim``.

MLA (DeepSeek-V2, arXiv 2405.04434, section 2.1) compresses each token's
keys and values into one latent vector, and carries positions in a small
rotary key shared by all heads. Per token ``h [D]``:

- query: ``c_q = RMSNorm(h @ W_dq)`` ``[Rq]``, ``q = c_q @ W_uq`` ``[N, Hn
  + Hr]`` (or ``q = h @ W_q`` without a query low-rank); each head splits
  into ``q_nope [Hn]`` and ``q_pe [Hr]``, and ``q_pe`` is rotated (RoPE)
  at the token's position;
- keys and values: ``[c_kv, k_pe] = h @ W_dkv`` ``[R + Hr]``, ``c_kv =
  RMSNorm(c_kv)``; ``k_pe`` is ONE rotary key head, rotated at the token's
  position and shared by every query head; ``[k_nope, v] = c_kv @ W_ukv``
  ``[N, Hn + Hv]``;
- attention per head over ``k = [k_nope, k_pe]`` and ``v``, scores scaled
  by ``1 / sqrt(Hn + Hr)``, then ``W_o [N, Hv, Dout]`` over the heads (as
  ``multi_head.output_projection``).

``latent_attention`` is that forward (training, prefill without a cache):
keys and values expanded per head, ordinary attention of N heads.

``latent_decode`` is the absorbed form, the point of MLA: the cache holds
only ``[c_kv, k_pe]`` per token (``R + Hr`` numbers, one "head"), never the
per-head keys and values. Since ``q_nope[n] . k_nope[n] = (W_uk[n] q_nope[n])
. c_kv``, ``W_uk`` (the key half of ``W_ukv``) is folded into the query,
``q_lat[n] = W_uk[n] q_nope[n]`` ``[R]``; scores are ``q_lat . c_kv + q_pe .
k_pe``, which is multi-query attention (one key/value head) with key
``[c_kv, k_pe]`` (width ``R + Hr``) and value ``c_kv`` (width ``R``); each
head's latent output ``[R]`` goes through ``W_uv[n]`` (the value half) to
``[Hv]`` and then ``W_o``. The scale stays the original ``1 / sqrt(Hn +
Hr)``, not ``1 / sqrt(R + Hr)`` of the absorbed query: the scores are the
same numbers, only computed in another order.

Parameters: ``latent_params`` (their layout, with DeepSeek's names and how
Hugging Face's weights map, ``init_latent_params``, ``latent_dims``), whose
names this module re-exports.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
import numpy as np

from attention_jax.core import checks
from attention_jax.decoding import cache_step
from attention_jax.decoding import kv_cache
from attention_jax.decoding import paged_cache
from attention_jax.layers import multi_head
from attention_jax.layers.latent_params import BIASED  # noqa: F401 (re-exported)
from attention_jax.layers.latent_params import LAYOUT  # noqa: F401 (re-exported)
from attention_jax.layers.latent_params import LatentDims
from attention_jax.layers.latent_params import Params
from attention_jax.layers.latent_params import check_latent_dims  # noqa: F401 (re-exported)
from attention_jax.layers.latent_params import init_latent_params  # noqa: F401 (re-exported)
from attention_jax.layers.latent_params import latent_dims
from attention_jax.layers.latent_params import param_shapes  # noqa: F401 (re-exported)
from attention_jax.masking import mask as mask_lib
from attention_jax.masking.mask import Mask
from attention_jax.scores import rope as rope_lib

# The default rotation: the paper's (base 10000; a frozen value).
_PLAIN_ROPE = rope_lib.Rope()


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["latent", "rope_key", "index", "overflow"],
                   meta_fields=["window"])
@dataclasses.dataclass(frozen=True)
class LatentCache:
  """What MLA caches per token: the normed latent and the rotated rope key.

  ``latent [B, L, R]`` holds ``c_kv`` and ``rope_key [B, L, Hr]`` holds
  ``k_pe`` (already rotated at its position), for ``L`` positions of a
  linear cache or ``L`` slots of a ring buffer when ``window`` is set (a
  sliding-window layer attending ``window`` positions back, ``window <
  L``). ``index [B]`` counts the tokens written per example; ``overflow``
  (bool ``[B]``, sticky) marks examples whose write did not fit a linear
  cache, as ``cache_step.KVCache``. A pytree whose ``window`` is static, so
  a cache passes through ``jax.jit`` as an argument.
  """
  latent: jax.Array
  rope_key: jax.Array
  index: jax.Array
  overflow: jax.Array | None = None
  window: int | None = None


def _yarn_mscale(factor: float, mscale: float) -> float:
  """YaRN's magnitude ``0.1 * mscale * ln(factor) + 1`` (1 if factor <= 1)."""
  return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def default_scale(qk_head_dim: int, rope: Any = None) -> float:
  """MLA's score scale: ``1 / sqrt(Hn + Hr)``, times YaRN's ``mscale**2``.

  With a YaRN ``aj.Rope`` that sets ``mscale_all_dim`` (DeepSeek-V3's
  long-context configs), the scale is multiplied by ``(0.1 *
  mscale_all_dim * ln(factor) + 1) ** 2``, as DeepSeek's reference code
  and Hugging Face's ``DeepseekV3Attention`` do (the rotary part is
  scaled separately, by the ``Rope``'s own attention factor on cos and
  sin). Any other rope: the plain ``1 / sqrt(Hn + Hr)``. A layer given
  ``scale=`` uses that number as it is (nothing multiplied in).

  Example:
    >>> default_scale(192) == 192 ** -0.5
    True
  """
  scale = qk_head_dim ** -0.5  # as DeepSeek and HF write it
  rope = rope_lib.as_rope(rope)
  if rope is not None and rope.scaling == "yarn" and rope.mscale_all_dim:
    scale *= _yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
  return scale


def _rotate(x: jax.Array, positions: jax.Array,
            rope: rope_lib.Rope | None) -> jax.Array:
  return x if rope is None else rope_lib.apply_rope(x, positions, rope=rope)


def _check_x(x, dims: LatentDims) -> jax.Array:
  return checks.layer_input(
      "x", x, dims.d_model, f"MLA params have d_model D = {dims.d_model} "
      "(W_dkv kernel [D, R + Hr])")


def _check_positions(positions, b: int, t: int) -> jax.Array:
  """``positions`` as int ``[B|1, T]``."""
  if isinstance(positions, (list, tuple)):
    positions = np.asarray(positions)
  dtype = jnp.result_type(positions)
  shape = checks.shape_of(positions)
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(
        f"positions must be integer [B, T] = [{b}, {t}] (or [T] shared), "
        f"got dtype {dtype} with shape {shape}.")
  if shape not in ((t,), (1, t), (b, t)):
    raise ValueError(
        f"positions must have shape [B, T] = [{b}, {t}] or [T] = [{t}] (each "
        f"token's rotary position), got {shape}.")
  positions = jnp.asarray(positions)
  return positions[None] if positions.ndim == 1 else positions


def _default_positions(mask: Mask | None, t: int) -> jax.Array:
  """Positions 0..T-1, restarting per document with segment ids."""
  if mask is not None and mask.q_segment_ids is not None:
    ids = jnp.asarray(mask.q_segment_ids)
    if ids.ndim > 2:
      raise ValueError(
          f"the mask's q_segment_ids have shape {ids.shape}; rotary "
          "positions restart per document only for [T] or [B, T] ids (one "
          "shared rotary key serves every head): pass positions= [B, T].")
    positions = rope_lib.segment_positions(ids)
    return positions[None] if positions.ndim == 1 else positions
  return jnp.arange(t)[None, :]  # [1, T]


def _projections(params, x, x_kv, positions, rope, dims: LatentDims,
                 precision):
  """``q_nope [B, N, T, Hn]``, ``q_pe`` rotated, ``c_kv [B, T, R]``, ``k_pe``.

  ``positions [B|1, T]``; ``k_pe [B, T, Hr]`` is rotated like ``q_pe [B,
  N, T, Hr]``. ``x_kv`` is ``x`` with unseen tokens zeroed (or ``x``).
  """
  hn, r = dims.qk_nope_head_dim, dims.kv_lora_rank
  if dims.q_lora_rank is None:
    q = multi_head.project_heads(x, params["W_q"],
                                 precision=precision)  # [B, N, T, Hn + Hr]
  else:
    c_q = multi_head.project(x, params["W_dq"]["kernel"],
                             params["W_dq"].get("bias"),
                             precision=precision)  # [B, T, Rq]
    c_q = multi_head.rms_norm(c_q, params["q_norm"]["scale"])
    q = multi_head.project_heads(c_q, params["W_uq"],
                                 precision=precision)  # [B, N, T, Hn + Hr]
  q_nope, q_pe = q[..., :hn], q[..., hn:]
  kv = multi_head.project(x_kv, params["W_dkv"]["kernel"],
                          params["W_dkv"].get("bias"),
                          precision=precision)  # [B, T, R + Hr]
  c_kv = multi_head.rms_norm(kv[..., :r], params["kv_norm"]["scale"])
  k_pe = kv[..., r:]  # [B, T, Hr]: one key head for all N
  q_pe = _rotate(q_pe, positions[:, None, :], rope)  # [B|1, 1, T]
  k_pe = _rotate(k_pe, positions, rope)
  return q_nope, q_pe, c_kv, k_pe


def latent_attention(
    params: Params,
    x: ArrayLike,
    mask: Mask | ArrayLike | None = None,
    *,
    positions: ArrayLike | None = None,
    rope: rope_lib.Rope | None = _PLAIN_ROPE,
    scale: float | None = None,
    is_causal: bool = False,
    attention_fn: Any = None,
    precision: multi_head.Precision = None,
    return_weights: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """MLA self-attention without a cache (training, prefill): the paper's form.

  Keys and values are expanded per head (``[k_nope, k_pe]`` and ``v``,
  ``[B, N, S, Hn + Hr]`` and ``[B, N, S, Hv]``) and attended by ``N``
  ordinary heads; ``latent_decode`` gives the same numbers from the cache.

  Args:
    params: from ``init_latent_params`` (or ``MultiHeadLatentAttention
      .params_dict()``).
    x: float ``[B, T, D]``.
    mask: an ``aj.Mask`` (``kv_lengths``, ``causal``, ``window``, segment
      ids, a rule...) or a dense bool array of rank 4 broadcastable to ``[B,
      N, T, T]``; handed to the attention function.
    positions: integer ``[B, T]`` (or ``[T]``) rotary positions, e.g. from 0
      at each left-padded example's first real token; None: ``0..T-1``,
      restarting per document with segment ids.
    rope: an ``aj.Rope`` (by default ``aj.Rope()``, base 10000) or None
      (no rotation; ``k_pe`` stays a shared position-free head).
    scale: multiplier of ``q . k``: a positive number or a float scalar
      array (a traced one too, e.g. learned), as
      ``aj.multi_head_attention``'s; None is ``default_scale(Hn + Hr,
      rope)``.
    is_causal: shorthand for ``mask & aj.Mask(causal=True)``.
    attention_fn: as ``aj.attend_heads``: a function with
      ``scaled_dot_product_attention``'s contract or an implementation; it
      always receives ``scale=``.
    precision: the projection einsums' precision.
    return_weights: also return the weights ``[B, N, T, T]``.

  Returns:
    ``output [B, T, Dout]``, or ``(output, weights)``.

  Example:
    >>> p = init_latent_params(jax.random.key(0), 32, 4, q_lora_rank=16,
    ...                        kv_lora_rank=24, qk_nope_head_dim=8,
    ...                        qk_rope_head_dim=4, v_head_dim=8)
    >>> attend = jax.jit(latent_attention, static_argnames="is_causal")
    >>> attend(p, jnp.ones((2, 5, 32)), is_causal=True).shape
    (2, 5, 32)
  """
  dims = latent_dims(params)
  x = _check_x(x, dims)
  checks.check_static_bool("is_causal", is_causal)
  checks.check_static_bool("return_weights", return_weights)
  checks.check_call_scale(scale)
  rope = rope_lib.as_rope(rope)
  b, t, _ = x.shape
  n = dims.num_heads
  m = mask_lib.as_mask(mask, is_causal=is_causal)
  x_kv = x
  if m is not None and m.dense is not None:
    full, layout = (b, n, t, t), "[B, N, T, S]"
    shape = checks.shape_of(m.dense)
    checks.check_logits_rank("mask", shape, full, layout)
    checks.check_broadcastable_to("mask", shape, full, layout)
    # Padded tokens may hold NaN: zero them before W_dkv.
    seen = jnp.any(checks.as_bool_mask(m.dense), axis=(1, 2))  # [B|1, S|1]
    (x_kv,) = checks.zero_unseen(seen, x)
  positions = (_default_positions(m, t) if positions is None
               else _check_positions(positions, b, t))
  q_nope, q_pe, c_kv, k_pe = _projections(params, x, x_kv, positions, rope,
                                          dims, precision)
  kv = multi_head.project_heads(c_kv, params["W_ukv"],
                                precision=precision)  # [B, N, S, Hn + Hv]
  hn, hr = dims.qk_nope_head_dim, dims.qk_rope_head_dim
  k_nope, v = kv[..., :hn], kv[..., hn:]
  k_pe = jnp.broadcast_to(k_pe[:, None], (b, n, t, hr))  # [B, N, S, Hr]
  q = jnp.concatenate([q_nope, q_pe], axis=-1)  # [B, N, T, Hn + Hr]
  k = jnp.concatenate([k_nope, k_pe.astype(k_nope.dtype)], axis=-1)
  if scale is None:
    scale = default_scale(hn + hr, rope)
  result = multi_head.attend_heads(q, k, v, m, scale=scale,
                                   attention_fn=attention_fn,
                                   return_weights=return_weights)
  out, weights = result if return_weights else (result, None)
  output = multi_head.output_projection(out, params["W_o"],
                                        precision=precision)  # [B, T, Dout]
  return (output, weights) if return_weights else output


def init_latent_cache(params: Params, batch_size: int, max_length: int, *,
                      window: int | None = None,
                      dtype: jnp.dtype | None = None) -> LatentCache:
  """An empty ``LatentCache`` of ``max_length`` slots for ``latent_decode``.

  Args:
    params: MLA params (R and Hr are read from them).
    batch_size: ``B``.
    max_length: ``L``, the positions a linear cache holds, or the slots of
      a ring buffer when ``window`` is given.
    window: a ring buffer for a sliding-window layer that attends
      ``window`` positions back (the left side of its mask's window),
      ``window < max_length``: each query then sees its ``window`` previous
      positions and itself, as ``aj.Mask(causal=True, window=(window, 0))``
      in the full forward. None: a linear cache.
    dtype: the buffers' float dtype; None: the dtype of ``W_dkv``'s
      kernel. A quantised one (``"int8"``, ``"float8_e4m3fn"``) is kept in
      pages, ``init_paged_latent_cache`` (with
      ``aj.paged_cache.linear_pages``' sizes for a linear cache's room), as
      ``MultiHeadLatentAttention.init_cache`` keeps it: a ``TypeError``
      here naming that call. Any other dtype (``"int4"``, an integer one)
      is a ``TypeError`` too (``paged_cache.storage_dtype``'s check).

  Example:
    >>> p = jax.eval_shape(lambda: init_latent_params(  # shapes suffice
    ...     jax.random.key(0), 32, 4, kv_lora_rank=16, qk_nope_head_dim=8,
    ...     qk_rope_head_dim=4, v_head_dim=8))
    >>> c = init_latent_cache(p, 2, 10)
    >>> c.latent.shape, c.rope_key.shape, c.index.tolist()
    ((2, 10, 16), (2, 10, 4), [0, 0])
  """
  dims = latent_dims(params)
  checks.check_positive_int("batch_size", batch_size)
  checks.check_positive_int("max_length", max_length)
  if window is not None and (isinstance(window, bool) or not isinstance(
      window, int) or not 0 <= window < max_length):
    raise ValueError(
        f"window must be an int in [0, max_length) = [0, {max_length}) (a "
        f"ring buffer keeps a key until the last query that may see it), "
        f"got {window!r}.")
  dtype = _float_storage(dtype or params["W_dkv"]["kernel"].dtype)
  return LatentCache(
      jnp.zeros((batch_size, max_length, dims.kv_lora_rank), dtype),
      jnp.zeros((batch_size, max_length, dims.qk_rope_head_dim), dtype),
      jnp.zeros((batch_size,), jnp.int32), jnp.zeros((batch_size,), bool),
      window)


def _float_storage(dtype) -> jnp.dtype:
  """A linear latent cache's dtype: float (``storage_dtype``'s words for
  the rest); a quantised one names the paged cache that stores it."""
  stored, quantized = paged_cache.storage_dtype(dtype)
  if quantized is not None:
    raise TypeError(
        f"init_latent_cache keeps c_kv and k_pe as they are: dtype must be "
        f"a float dtype, got {dtype!r}. Quantised storage (int8 or "
        f"float8_e4m3fn, a scale per token) is kept in pages: "
        f"init_paged_latent_cache(params, B, dtype={quantized!r}, "
        f"**aj.paged_cache.linear_pages({quantized!r}, B, L)) gives every "
        f"row room for L tokens, as MultiHeadLatentAttention.init_cache("
        f"dtype={quantized!r}) does.")
  return stored


def _check_cache(cache, dims: LatentDims, b: int) -> None:
  """A ``LatentCache`` whose fields fit x's batch and the params, checked
  before its index is read (a hand-built one is refused by field)."""
  if not isinstance(cache, LatentCache):
    raise TypeError(f"cache must be an aj LatentCache (init_latent_cache), "
                    f"got {type(cache).__name__}.")
  # Integer buffers would round every written latent (silently).
  checks.check_float_array("cache.latent", cache.latent)
  checks.check_float_array("cache.rope_key", cache.rope_key)
  lat, rk = checks.shape_of(cache.latent), checks.shape_of(cache.rope_key)
  want = (b, lat[1] if len(lat) == 3 else None)
  if (len(lat) != 3 or len(rk) != 3 or lat[:2] != want or rk[:2] != want
      or lat[2] != dims.kv_lora_rank or rk[2] != dims.qk_rope_head_dim):
    raise ValueError(
        f"cache.latent {lat} and cache.rope_key {rk} must be [B, L, R] = "
        f"[{b}, L, {dims.kv_lora_rank}] and [B, L, Hr] = [{b}, L, "
        f"{dims.qk_rope_head_dim}] for x's batch B = {b} and these params.")
  kv_cache.check_index(cache.index, b, "cache.index")
  if cache.overflow is not None and (
      jnp.result_type(cache.overflow) != jnp.bool_
      or checks.shape_of(cache.overflow) != (b,)):
    raise ValueError(
        f"cache.overflow must be bool [B] = [{b}] (B from x and "
        f"cache.latent {lat}), or None, got "
        f"{jnp.result_type(cache.overflow)} "
        f"{checks.shape_of(cache.overflow)}.")


def latent_decode(
    params: Params,
    x: ArrayLike,
    cache: LatentCache,
    mask: Mask | ArrayLike | None = None,
    *,
    positions: ArrayLike | None = None,
    rope: rope_lib.Rope | None = _PLAIN_ROPE,
    scale: float | None = None,
    attention_fn: Any = None,
    precision: multi_head.Precision = None,
    return_weights: bool = False,
) -> tuple[jax.Array, LatentCache] | tuple[jax.Array, jax.Array, LatentCache]:
  """A decoding step of MLA over the latent cache, in the absorbed form.

  Writes this call's ``c_kv``/``k_pe`` at each example's ``cache.index``
  and attends causally over every filled slot: ``W_uk`` folded into the
  query (``q_lat [B, N, T, R]``), one shared key ``[c_kv, k_pe]`` (width
  ``R + Hr``) and value ``c_kv`` (multi-query attention), then ``W_uv`` and
  ``W_o``. Any number of tokens per call; the result equals
  ``latent_attention(..., is_causal=True)`` over the whole sequence.

  Args:
    params: MLA params.
    x: float ``[B, T, D]``, this call's tokens.
    cache: a ``LatentCache`` (``init_latent_cache``), or a paged latent
      cache (``init_paged_latent_cache``): the tokens' ``[c_kv, k_pe]``
      are appended to each sequence's pages (``q_lengths`` of them per
      row, 0: idle) and attended through its page table
      (``aj.paged_attention``, the pages serving as keys and, their first
      ``R`` columns, as values; no weights, ``attention_fn`` a kernel or
      None).
    mask: an ``aj.Mask`` restated over cache slots as
      ``MultiHeadAttention`` decodes (``cache_step.write``): a window and a
      rule at absolute slot positions, ``q_lengths [B]`` the real new
      tokens of a right-padded ragged prefill, ``kv_lengths``; a dense
      mask is over the slots (``[B, N, T, L]``). Segment ids are refused.
    positions: integer ``[B, T]`` rotary positions; None: the slots
      (``cache.index + 0..T-1``). Visibility always follows the slots.
    rope: as ``latent_attention``.
    scale: as ``latent_attention``; None is ``default_scale(Hn + Hr,
      rope)``, the full forward's, never ``1 / sqrt(R + Hr)``.
    attention_fn: as ``latent_attention``; it sees ``[B, N, T, R + Hr]``
      queries over one ``[B, 1, S', R + Hr]`` key head and ``[B, 1, S', R]``
      values (``S' = L``, or ``L + T`` for a ring buffer).
    precision: the projection einsums' precision.
    return_weights: also return the weights ``[B, N, T, S']``.

  Returns:
    ``(output [B, T, Dout], cache)``, or ``(output, weights, cache)``.

  Example:
    >>> p = init_latent_params(jax.random.key(0), 32, 4, q_lora_rank=16,
    ...                        kv_lora_rank=24, qk_nope_head_dim=8,
    ...                        qk_rope_head_dim=4, v_head_dim=8)
    >>> x = jax.random.normal(jax.random.key(1), (1, 4, 32))
    >>> step = jax.jit(latent_decode)  # callers jit (one compile per T)
    >>> first, cache = step(p, x[:, :3], init_latent_cache(p, 1, 8))
    >>> last, cache = step(p, x[:, 3:], cache)          # one more token
    >>> cache.index.tolist()
    [4]
    >>> full = jax.jit(latent_attention, static_argnames="is_causal")(
    ...     p, x, is_causal=True)
    >>> bool(jnp.allclose(last, full[:, 3:], atol=1e-5))
    True
  """
  dims = latent_dims(params)
  x = _check_x(x, dims)
  checks.check_static_bool("return_weights", return_weights)
  checks.check_call_scale(scale)
  rope = rope_lib.as_rope(rope)
  b, t, _ = x.shape
  if isinstance(cache, paged_cache.PagedKVCache):
    return _paged_decode(params, x, cache, mask_lib.as_mask(mask), dims,
                         positions=positions, rope=rope, scale=scale,
                         attention_fn=attention_fn, precision=precision,
                         return_weights=return_weights)
  _check_cache(cache, dims, b)
  m = mask_lib.as_mask(mask)
  if m is not None and m.dense is not None:
    full = (b, dims.num_heads, t, cache.latent.shape[1])
    layout = "[B, N, T, L] (decoding: L cache slots)"
    shape = checks.shape_of(m.dense)
    checks.check_logits_rank("mask", shape, full, layout)
    checks.check_broadcastable_to("mask", shape, full, layout)
  index = jnp.broadcast_to(jnp.asarray(cache.index, jnp.int32), (b,))
  lengths = cache_step.new_lengths(m, b, t)
  q_pos = index[:, None] + jnp.arange(t)[None, :]  # [B, T] slot positions
  rot = q_pos if positions is None else _check_positions(positions, b, t)
  q_nope, q_pe, c_kv, k_pe = _projections(params, x, x, rot, rope, dims,
                                          precision)
  kv_cache = cache_step.KVCache(cache.rope_key[:, None], cache.latent[:, None],
                                index, cache.overflow, cache.window)
  rope_keys, latents, m, _, written = cache_step.write(
      kv_cache, k_pe[:, None], c_kv[:, None], m, None, None, index, lengths,
      q_pos, dims.num_heads,
      left_padding_hint=False)  # [B, 1, S', Hr], [B, 1, S', R]
  query = _absorbed_query(params, q_nope, q_pe, dims, precision)
  key = jnp.concatenate([latents, rope_keys], axis=-1)  # [B, 1, S', R + Hr]
  if scale is None:  # the full forward's scale, not 1 / sqrt(R + Hr)
    scale = default_scale(dims.qk_nope_head_dim + dims.qk_rope_head_dim, rope)
  result = multi_head.attend_heads(query, key, latents, m, scale=scale,
                                   attention_fn=attention_fn,
                                   return_weights=return_weights)
  out_lat, weights = result if return_weights else (result, None)
  output = _absorbed_output(params, out_lat, dims, precision)  # [B, T, Dout]
  new_cache = LatentCache(written.value[:, 0], written.key[:, 0],
                          written.index, written.overflow, written.window)
  if return_weights:
    return output, weights, new_cache
  return output, new_cache


def init_paged_latent_cache(params: Params, batch_size: int, *,
                            num_pages: int, page_size: int, max_pages: int,
                            dtype=None) -> paged_cache.PagedKVCache:
  """An empty paged latent cache for ``latent_decode``: one pool of
  ``num_pages`` pages of ``page_size`` tokens, each token's ``[c_kv, k_pe]``
  (``R + Hr`` numbers, once: ``values_in_keys``, a single key head),
  shared by ``batch_size`` sequences of at most ``max_pages`` pages.

  Args:
    params: MLA params (R and Hr are read from them).
    batch_size, num_pages, page_size, max_pages: as ``aj.init_paged_cache``.
    dtype: the pages' dtype (None: ``W_dkv``'s kernel's), or ``"int8"`` /
      ``"float8_e4m3fn"``: quantised with a scale per token.

  Example:
    >>> p = jax.eval_shape(lambda: init_latent_params(  # shapes suffice
    ...     jax.random.key(0), 32, 4, kv_lora_rank=16, qk_nope_head_dim=8,
    ...     qk_rope_head_dim=4, v_head_dim=8))
    >>> c = init_paged_latent_cache(p, 2, num_pages=6, page_size=4,
    ...                             max_pages=3)
    >>> c.key_pages.shape, c.value_pages  # [P, 1, Z, R + Hr]: no values
    ((6, 1, 4, 20), None)
  """
  dims = latent_dims(params)
  return paged_cache.init_paged_cache(
      num_pages, page_size, 1, dims.kv_lora_rank + dims.qk_rope_head_dim,
      batch_size, max_pages, dtype=dtype or params["W_dkv"]["kernel"].dtype,
      values_in_keys=True)


def _paged_decode(params, x, cache: paged_cache.PagedKVCache, m, dims, *,
                  positions, rope, scale, attention_fn, precision,
                  return_weights):
  """``latent_decode`` over a paged latent cache (see there)."""
  paged_cache.check_cache(cache)  # before its lengths are read below
  b, t, _ = x.shape
  r, hr = dims.kv_lora_rank, dims.qk_rope_head_dim
  kp = checks.shape_of(cache.key_pages)
  if (cache.value_pages is not None or len(kp) != 4 or kp[1] != 1
      or kp[3] != r + hr or cache.page_table.shape[0] != b):
    raise ValueError(
        f"a paged latent cache must hold [P, 1, Z, R + Hr] = [P, 1, Z, "
        f"{r + hr}] key pages, no value pages (values_in_keys) and {b} "
        f"sequences for x's batch: make it with init_paged_latent_cache; "
        f"got key_pages {kp}, value_pages "
        f"{None if cache.value_pages is None else cache.value_pages.shape}, "
        f"page_table {cache.page_table.shape}.")
  lengths = cache_step.new_lengths(m, b, t)
  index = cache.lengths  # [B]: each sequence's tokens before this call
  rot = (index[:, None] + jnp.arange(t)[None, :] if positions is None
         else _check_positions(positions, b, t))  # [B, T]
  q_nope, q_pe, c_kv, k_pe = _projections(params, x, x, rot, rope, dims,
                                          precision)
  key = jnp.concatenate([c_kv, k_pe.astype(c_kv.dtype)],
                        axis=-1)[:, None]  # [B, 1, T, R + Hr]
  if scale is None:  # the full forward's scale, not 1 / sqrt(R + Hr)
    scale = default_scale(dims.qk_nope_head_dim + hr, rope)
  cache, attend = multi_head.paged_step(
      key, None, m, cache, lengths, bias=None, scale=scale, dropout_rate=0.0,
      attention_fn=attention_fn, return_weights=return_weights,
      return_lse=False, return_max_logits=False)
  query = _absorbed_query(params, q_nope, q_pe, dims, precision)
  # The pages are the values too: the weighted [c_kv, k_pe], of which the
  # first R columns are the weighted latents.
  out = attend(query, None, None, None, None, None, None,
               None)  # [B, N, T, R + Hr]
  return _absorbed_output(params, out[..., :r], dims, precision), cache


def _absorbed_query(params, q_nope, q_pe, dims: LatentDims, precision):
  """``[q_nope W_uk, q_pe]`` ``[B, N, T, R + Hr]``: ``W_uk`` (the key half
  of ``W_ukv``) folded into the query."""
  w_uk = params["W_ukv"]["kernel"][..., :dims.qk_nope_head_dim]  # [R, N, Hn]
  q_lat = jnp.einsum("BNTH,RNH->BNTR", q_nope, w_uk,
                     precision=precision)  # [B, N, T, R]
  return jnp.concatenate([q_lat, q_pe.astype(q_lat.dtype)], axis=-1)


def _absorbed_output(params, out_lat, dims: LatentDims, precision):
  """Each head's latent output ``[B, N, T, R]`` through ``W_uv`` (the
  value half of ``W_ukv``), then ``W_o``: ``[B, T, Dout]``."""
  w_uv = params["W_ukv"]["kernel"][..., dims.qk_nope_head_dim:]  # [R, N, Hv]
  heads = jnp.einsum("BNTR,RNH->BNTH", out_lat, w_uv.astype(out_lat.dtype),
                     precision=precision)  # [B, N, T, Hv]
  return multi_head.output_projection(heads, params["W_o"],
                                      precision=precision)
