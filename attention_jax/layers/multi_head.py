"""Multi-head attention as pure functions over a parameter dict.

Shape glossary: B batch, T query length, S key/value length (a cache's
slots while decoding), N query heads, K key/value heads (grouped-query
attention; ``K == N`` is ordinary MHA, ``K == 1`` multi-query), G = N // K
query heads per key/value head, H head dim (``D // N`` unless chosen), D
model (query) dim, Dkv key/value input features, Dout output features.

The parameters (``{"W_q", "W_k", "W_v", "W_o"}`` per head, as flax lays
them out) and their checks live in ``multi_head_params``; the static
options (attention function, scale, rope, the norms, clipping, mesh axes)
in ``multi_head_config.Config``, validated once. One call is a few pure
steps (``forward``):

1. ``check_call``: the call's own inputs, each checked once;
2. ``project_inputs``: ``W_q``, ``W_k``, ``W_v`` (``project`` vmapped over
   a kernel's heads axis, ``project_heads``), each clipped to ``clip_qkv``,
   the values through ``value_norm``; or a memory projected once so;
3. ``positions.normalize_and_rotate``: qk-norm and rotary positions, when
   the layer has them;
4. ``caches.write``: while decoding, the cache write (one interface for a
   linear cache, a ring buffer, a paged cache), giving what the queries
   attend over;
5. ``Keys.attend``: the layer's ``attention_fn`` (``layers/attention_fn.py``:
   ``attention_fn(q, k, v, mask, **options)``);
6. ``finish``: ``output_norm``, the output gate and ``W_o`` (each head's
   output weighted by its slice of ``W_o`` and the heads summed: the
   lesson's concat, then one linear layer). A key/value head serves its G
   query heads unrepeated.

``multi_head_attention`` configures and runs them; ``MultiHeadAttention``
configures once, when built, and runs ``forward`` per call.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
import numpy as np

from attention_jax.core import checks
from attention_jax.decoding.cache_step import KVCache
from attention_jax.decoding.paged_cache import PagedKVCache
from attention_jax.layers import attention_fn as attention_fn_lib
from attention_jax.layers import caches
from attention_jax.layers import multi_head_config
from attention_jax.layers import multi_head_params
from attention_jax.layers import positions as positions_lib
from attention_jax.layers import qk_norm as qk_norm_lib
from attention_jax.layers import sharding
from attention_jax.layers.attention_fn import AttentionFn
from attention_jax.layers.attention_fn import Keys
from attention_jax.layers.attention_fn import attend_heads  # noqa: F401 (aj.attend_heads)
from attention_jax.layers.caches import paged_step  # noqa: F401 (the latent layer's)
from attention_jax.layers.multi_head_config import Config
from attention_jax.layers.multi_head_params import init_multi_head_params  # noqa: F401 (doctests)
from attention_jax.layers.multi_head_params import param_dims
from attention_jax.layers.projections import Precision
from attention_jax.layers.projections import clip
from attention_jax.layers.projections import output_projection
from attention_jax.layers.projections import project  # noqa: F401 (the steps' primitive)
from attention_jax.layers.projections import project_heads
from attention_jax.layers.projections import project_keys_values
from attention_jax.layers.qk_norm import rms_norm  # noqa: F401 (the latent layer's)
from attention_jax.masking import mask as mask_lib
from attention_jax.masking.mask import Mask
from attention_jax.scores import rope as rope_lib
from attention_jax.scores import score_mods

Params = multi_head_params.Params


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["key", "value"],
                   meta_fields=["qk_norm", "clip_qkv", "value_norm",
                                "rotated"])
@dataclasses.dataclass(frozen=True)
class Memory:
  """Keys and values of a memory, projected once (``project_memory``).

  ``key``, ``value``: ``[B, K, S, H]``, after ``W_k``/``W_v`` (clipped,
  the key's qk-norm, the value norm): what cross-attention reuses at every
  decoding step. ``qk_norm``, ``clip_qkv``, ``value_norm``: what they were
  projected with (None: none), static; a call of other options is refused.
  ``rotated``: another layer's own keys and values (``shared_kv``: clipped,
  normalised and rotated at their positions as that layer does), which a
  layer built with ``kv_shared=True`` attends over with its own queries,
  qk-norm and rotary (key/value sharing across layers: Gemma 3n, YOCO).
  """
  key: jax.Array
  value: jax.Array
  qk_norm: qk_norm_lib.QKNorm | None = None
  clip_qkv: float | None = None
  value_norm: qk_norm_lib.QKNorm | None = None
  rotated: bool = False


def project_memory(params: Params, memory: ArrayLike, *,
                   precision: Precision = None,
                   qk_norm: qk_norm_lib.QKNorm | bool | None = None,
                   clip_qkv: float | None = None,
                   value_norm: qk_norm_lib.QKNorm | None = None) -> Memory:
  """Projects a memory (e.g. an encoder's output) to keys and values once.

  Cross-attention in a decoder attends to the same memory at every step;
  projecting it here once and passing ``memory=`` to
  ``multi_head_attention`` (or ``MultiHeadAttention.init_cross_cache``)
  gives the same numbers as projecting ``key``/``value`` in every call.

  Args:
    params: multi-head params (``W_k``, ``W_v``, and ``k_norm`` with
      qk-norm).
    memory: float ``[B, S, Dkv]``.
    precision: the projection einsums' precision.
    qk_norm: the layer's ``aj.QKNorm`` (as ``multi_head_attention``'s),
      applied to the keys.
    clip_qkv: the layer's clipping of the projections, applied to the keys
      and values before their norms.
    value_norm: the layer's value norm (weights ``v_norm``).

  Returns:
    ``Memory(key [B, K, S, H], value [B, K, S, H])``, recording the
    options.

  Example:
    >>> p = init_multi_head_params(jax.random.key(0), 8, 2)
    >>> mem = project_memory(p, jnp.ones((1, 5, 8)))
    >>> mem.key.shape
    (1, 2, 5, 4)
  """
  dims = param_dims(params)
  shape = _array3("memory", memory, "[B, S, Dkv]")
  if shape[-1] != dims.kv_features:
    raise ValueError(
        f"memory has {shape[-1]} features (shape {shape}), but "
        f"params['W_k']['kernel'] has shape "
        f"{multi_head_params.param_shape(params, 'W_k', 'kernel')}: [Dkv, K, "
        f"H] with Dkv={dims.kv_features}.")
  norm = qk_norm_lib.resolve(params, qk_norm)
  value_norm = qk_norm_lib.resolve(params, value_norm, "value_norm")
  clip_qkv = multi_head_config.check_clip_qkv(clip_qkv)
  memory = jnp.asarray(memory)
  k, v = project_keys_values(params, memory, memory, precision=precision,
                             clip_qkv=clip_qkv, value_norm=value_norm)
  if norm is not None:
    k = qk_norm_lib.normalize(k, params, "k_norm", norm)
  return Memory(k, v, norm, clip_qkv, value_norm)  # [B, K, S, H] each


class Call(NamedTuple):
  """One call's inputs: what ``check_call`` validates and the steps read."""
  query: ArrayLike  # [B, T, D]
  key: ArrayLike | None  # [B, S, Dkv]; the query itself in self-attention
  value: ArrayLike | None  # [B, S, Dkv]
  mask: Mask = attention_fn_lib.NO_MASK  # the call's, is_causal folded in
  bias: ArrayLike | None = None  # rank 4, broadcastable to [B, N, T, S]
  score_mod: Any = None  # the layer's (the T5 table's goes before it)
  positions: ArrayLike | None = None  # rotary, [B, T] or [T] ([P, B, T])
  kv_positions: ArrayLike | None = None  # rotary, [B, S] or [S]
  memory: Memory | None = None  # keys and values projected once
  cache: KVCache | PagedKVCache | None = None  # a decoding step's
  dropout_rate: float = 0.0
  dropout_rng: jax.Array | None = None
  asked: tuple[bool, bool, bool] = (False, False, False)  # weights, lse,
  # max_logits


def _array3(name: str, x, layout: str) -> tuple[int, ...]:
  """A float array of rank 3; its shape."""
  checks.check_float_array(name, x)
  shape = checks.shape_of(x)
  if len(shape) != 3:
    raise ValueError(f"{name} must have rank 3 ({layout}), got shape "
                     f"{shape}.")
  return shape


def _check_keys(config: Config, call: Call, q_shape) -> Call:
  """Key and value ``[B, S, Dkv]`` (not when they are the query, already
  checked); the call with them as arrays."""
  key, value = call.key, call.value
  for name, x in (("key", key), ("value", value)):
    if x is None:
      raise TypeError(f"{name} is None: pass [B, S, Dkv] (or memory= from "
                      "project_memory).")
  k_shape = _array3("key", key, "[B, S, Dkv]")
  v_shape = k_shape if value is key else _array3("value", value,
                                                 "[B, S, Dkv]")
  if k_shape != v_shape:
    raise ValueError(f"key {k_shape} and value {v_shape} must have the same "
                     "shape [B, S, Dkv] (one W_k/W_v input width Dkv).")
  if k_shape[-1] != config.dims.kv_features:
    name = "key has" if value is key else "key and value have"
    raise ValueError(f"{name} {k_shape[-1]} features (shape {k_shape}), but "
                     f"{config.widths[1]}.")
  if q_shape[0] != k_shape[0]:
    raise ValueError(f"query {q_shape} and key {k_shape} must have the same "
                     "batch size B.")
  key = jnp.asarray(key)
  return call._replace(key=key, value=key if value is call.key
                       else jnp.asarray(value))


def _check_memory(config: Config, call: Call, b: int) -> int:
  """A projected memory for ``b`` examples, in place of key and value."""
  memory = call.memory
  if call.key is not None or call.value is not None:
    raise ValueError("memory holds the projected keys and values; pass "
                     "key=None and value=None with it (or pass key/value and "
                     "no memory).")
  if call.cache is not None:
    raise ValueError("memory (cross-attention) and a KV cache (causal "
                     "self-attention) are two kinds of layer; pass one.")
  if not isinstance(memory, Memory):
    raise TypeError(f"memory must be an aj Memory from project_memory(params, "
                    f"memory [B, S, Dkv]), got {type(memory).__name__}.")
  dims = config.dims
  want = (b, dims.num_kv_heads, None, dims.head_dim)
  for name, x in (("memory.key", memory.key), ("memory.value", memory.value)):
    shape = checks.shape_of(x)
    if len(shape) != 4 or any(w is not None and w != g
                              for w, g in zip(want, shape)):
      raise ValueError(
          f"{name} has shape {shape}, but this call needs [B, K, S, H] with "
          f"B={b} (the query's batch), K={dims.num_kv_heads}, "
          f"H={dims.head_dim} (the params): project it with these params.")
  if memory.key.shape != memory.value.shape:
    raise ValueError(f"memory.key {memory.key.shape} and memory.value "
                     f"{memory.value.shape} differ.")
  if memory.rotated:  # another layer's keys: its norms, its positions
    return memory.key.shape[2]
  for name, what in (("qk_norm", "keys were normalised"),
                     ("clip_qkv", "keys and values were clipped"),
                     ("value_norm", "values were normalised")):
    if getattr(memory, name) != getattr(config, name):
      raise ValueError(
          f"memory's {what} with {name}={getattr(memory, name)}, but this "
          f"call has {name}={getattr(config, name)}: pass project_memory the "
          f"same {name}= as this call.")
  if config.rope is not None:
    raise ValueError(
        "rope with a projected memory is not supported: the memory's keys "
        "are projected once, without positions. Rotate them yourself or "
        "attend with key/value (a layer's own rotated keys, shared with "
        "another layer, come from shared_kv).")
  return memory.key.shape[2]


def _check_mask_and_bias(call: Call, full: tuple[int, ...],
                         layout: str) -> Call:
  """A dense mask and a bias of the logits' full rank 4, broadcastable to
  ``full`` (a lower rank could be read two ways: a ``[B, S]`` padding mask
  aligned to the right would be taken as ``[T, S]``); the call with the
  bias an array. (The mask's dtype is ``aj.Mask``'s to check.)"""
  bias = call.bias
  for name, x in (("mask", call.mask.dense), ("bias", bias)):
    if x is not None:
      shape = checks.shape_of(x)
      checks.check_logits_rank(name, shape, full, layout)
      checks.check_broadcastable_to(name, shape, full, layout)
  if bias is None:
    return call
  checks.check_float_array("bias", bias)
  return call._replace(bias=jnp.asarray(bias))


def check_call(config: Config, call: Call) -> tuple[Call, caches.Step | None]:
  """The call's own inputs, each checked once (the options were, by
  ``configure``); the call with its arrays as arrays, and the cache's
  ``Step`` while decoding (else None)."""
  dims = config.dims
  checks.check_float_array("query", call.query)
  q_shape = np.shape(call.query)
  if len(q_shape) != 3:
    raise ValueError(f"query must have rank 3 ([B, T, D]), got shape "
                     f"{q_shape}.")
  if q_shape[-1] != dims.d_model:
    raise ValueError(f"query has {q_shape[-1]} features (shape {q_shape}), "
                     f"but {config.widths[0]}.")
  if config.rope is None and (call.positions is not None
                              or call.kv_positions is not None):
    raise ValueError(
        "positions/kv_positions place rotary embeddings, and this layer has "
        "rope=None: pass rope= (e.g. aj.Rope(base=10000.0)) or leave the "
        "positions out (masks and score modifiers see token indices).")
  b, t = q_shape[:2]
  query = jnp.asarray(call.query)
  if call.memory is not None:
    s = _check_memory(config, call, b)
  elif call.key is call.query and call.value is call.query:
    if dims.kv_features != dims.d_model:  # checked as the query, but for Dkv
      raise ValueError(f"key has {q_shape[-1]} features (shape {q_shape}), "
                       f"but {config.widths[1]}.")
    s = t
    call = call._replace(key=query, value=query)
  else:
    call = _check_keys(config, call, q_shape)
    s = call.key.shape[1]
  call = call._replace(query=query)
  full, layout, step = (b, dims.num_heads, t, s), "[B, N, T, S]", None
  if call.cache is not None:
    step = caches.place(call.cache, call.mask, b, t)
    if s != t or step.batch != b:
      raise ValueError(
          f"decoding appends this call's tokens: query {q_shape} and key "
          f"{call.key.shape} must share [B, T], and B must equal the "
          f"cache's batch {step.batch}.")
    full, layout = (b, dims.num_heads, t, step.slots), step.layout
  if call.mask.dense is not None or call.bias is not None:
    call = _check_mask_and_bias(call, full, layout)
  return call, step


def project_inputs(config: Config, params: Params, call: Call):
  """``q [B, N, T, H]``, ``k`` and ``v [B, K, S, H]``: the call's inputs
  through ``W_q``, ``W_k``, ``W_v`` (clipped; the values normalised), or
  the memory's keys and values.
  Padding may hold NaN: keys no query may see (a dense mask) are zeroed
  first (while decoding the cache hides them)."""
  precision, dense = config.precision, call.mask.dense
  q = clip(project_heads(call.query, params["W_q"], precision=precision),
           config.clip_qkv)
  if isinstance(call.cache, caches.Shared):  # another layer's cache:
    k = v = jnp.zeros(q.shape[:1] + (config.dims.num_kv_heads,) + q.shape[2:],
                      q.dtype)  # placeholders, never read (caches.Shared)
    return q, k, v
  if call.memory is not None:
    k, v = call.memory.key, call.memory.value  # clipped and normed already
    if dense is not None:
      seen = jnp.any(dense, axis=(1, 2))[:, None, :, None]  # [B|1, 1, S|1, 1]
      k, v = (jnp.where(seen, x, jnp.zeros((), x.dtype)) for x in (k, v))
    return q, k, v
  key, value = call.key, call.value
  if dense is not None and call.cache is None:
    seen = jnp.any(dense, axis=(1, 2))  # [B|1, S|1]
    key, value = checks.zero_unseen(seen, key, value)
  k, v = project_keys_values(params, key, value, precision=precision,
                             clip_qkv=config.clip_qkv,
                             value_norm=config.value_norm)
  return q, k, v


def layer_score_mod(config: Config, params: Params, score_mod: Any) -> Any:
  """The call's score modifier after the layer's T5 table
  (``t5_bias.score_mod(params["t5_bias"]["table"])``, first)."""
  t5 = config.t5_bias.score_mod(params["t5_bias"]["table"])
  return t5 if score_mod is None else score_mods.chain(t5, score_mod)


def finish(config: Config, params: Params, query: jax.Array,
           out: jax.Array) -> jax.Array:
  """The heads' outputs ``[B, N, T, H]`` through the output norm
  (``o_norm``), the output gate (``sigmoid(query W_g)``, ``[B, N, T,
  H|1]``) and ``W_o``: ``[B, T, Dout]``."""
  if config.output_norm is not None:  # BitNet's sub-norm, before the gate
    out = qk_norm_lib.normalize(out, params, "o_norm", config.output_norm)
  if config.dims.output_gate is not None:
    gate = project_heads(query, params["W_g"], precision=config.precision)
    out = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(out.dtype)
  return output_projection(out, params["W_o"], precision=config.precision)


def shared_kv(config: Config, params: Params, call: Call) -> Memory:
  """The keys and values ``forward`` would attend over for ``call`` (no
  cache), as a ``Memory(rotated=True)`` another layer attends over:
  projected, clipped, normalised and rotated at the call's positions."""
  if call.memory is not None or call.cache is not None:
    raise ValueError("shared_kv gives a layer's own keys and values: call "
                     "it with the layer's input, no memory or cache.")
  call, step = check_call(config, call)
  q, k, v = project_inputs(config, params, call)
  if config.qk_norm is not None or config.rope is not None:
    _, k = positions_lib.normalize_and_rotate(config, params, q, k, call,
                                              step)
  return Memory(k, v, rotated=True)


def forward(config: Config, params: Params, call: Call) -> Any:
  """The steps of this module's docstring over one call: ``call``'s inputs
  checked, never ``config``'s options or ``params`` (``configure``'s)."""
  call, step = check_call(config, call)
  q, k, v = project_inputs(config, params, call)
  # A mesh in play: heads pinned to head_axis; attention with explicit axes
  # made auto, its results sharded as the queries' [B, N, T].
  sharded = not jax.sharding.get_abstract_mesh().empty
  if sharded and config.head_axis is not None:
    q, k, v = (sharding.constrain_heads(x, config.head_axis)
               for x in (q, k, v))
  if config.qk_norm is not None or config.rope is not None:
    q, k = positions_lib.normalize_and_rotate(config, params, q, k, call,
                                              step)
  score_mod = call.score_mod
  if config.t5_bias is not None:
    score_mod = layer_score_mod(config, params, score_mod)
  keys = Keys(k, v, call.mask, call.bias, score_mod)
  cache = call.cache
  if cache is not None:
    cache, keys = caches.write(cache, keys, step, config.dims.num_heads)
  options = attention_fn_lib.call_options(
      scale=config.scale, sinks=params["sinks"]["logits"] if "sinks" in params
      else None, dropout_rate=call.dropout_rate, dropout_rng=call.dropout_rng,
      asked=call.asked)
  attend = type(keys).attend
  if sharded:
    attend = sharding.auto_like(attend, q)
  result = attend(keys, config.attention_fn, q, options)
  output = finish(config, params, call.query, result.out)
  returned = result._replace(out=output).returned(call.asked)
  return returned if cache is None else (returned, cache)


def multi_head_attention(
    params: Params,
    query: ArrayLike,
    key: ArrayLike | None,
    value: ArrayLike | None,
    mask: Mask | ArrayLike | None = None,
    *,
    bias: ArrayLike | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    score_mod: Any = None,
    t5_bias: score_mods.T5Bias | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    attention_fn: AttentionFn | Any = None,
    return_weights: bool = False,
    return_lse: bool = False,
    return_max_logits: bool = False,
    rope: rope_lib.Rope | None = None,
    positions: ArrayLike | None = None,
    kv_positions: ArrayLike | None = None,
    memory: Memory | None = None,
    precision: Precision = None,
    head_axis: str | None = None,
    cache: KVCache | PagedKVCache | None = None,
    qk_norm: qk_norm_lib.QKNorm | bool | None = None,
    batch_axis: str | tuple[str, ...] | None = None,
    clip_qkv: float | None = None,
    value_norm: qk_norm_lib.QKNorm | None = None,
    output_norm: qk_norm_lib.QKNorm | None = None,
) -> Any:
  """The lesson's ``MultiHeadAttention.forward`` as a pure function.

  The head structure is read from ``params`` (``init_multi_head_params``'
  layout): ``N`` and ``H`` from ``W_q``, ``K`` from ``W_k``, the output
  width from ``W_o``, norm weights from ``q_norm``/``k_norm``, ``v_norm``,
  ``o_norm``, the output gate from ``W_g``; learned sinks
  (``params["sinks"]["logits"] [N]``) and a T5 table (with its settings
  ``t5_bias``) are used when present, so a module's ``params_dict()``
  gives the module's numbers.

  Args:
    params: from ``init_multi_head_params`` (or a converter such as
      ``from_torch_multihead_attention``).
    query: float ``[B, T, D]``.
    key: float ``[B, S, Dkv]`` (None with ``memory``); the query itself
      for self-attention.
    value: float ``[B, S, Dkv]`` (None with ``memory``).
    mask: an ``aj.Mask`` (e.g. ``aj.Mask(kv_lengths=lengths [B])``,
      ``aj.Mask(q_segment_ids=ids [B, T])`` for packed documents,
      ``aj.Mask(causal=True, window=(W - 1, 0))``, a rule), or a dense
      bool/integer array of rank 4 broadcastable to ``[B, N, T, S]`` (True
      = may attend); a ``[B, S]`` key-padding mask is
      ``mask[:, None, None, :]``.
    bias: optional float of rank 4 broadcastable to ``[B, N, T, S]``, added
      to the logits.
    is_causal: shorthand for ``mask & aj.Mask(causal=True)`` (static).
    score_mod: ``score_mod(score, b, h, q_idx, kv_idx)``, e.g.
      ``aj.alibi(slopes)``, after the T5 table's.
    dropout_rate: dropout on attention weights, in ``[0, 1)`` (static).
    dropout_rng: ``jax.random.key``, required when ``dropout_rate > 0``.
    return_weights: also return the attention weights (static).
    return_lse: also return each row's log-sum-exp ``[B, N, T]`` float32
      (``-inf`` for a row with nothing to attend to), e.g. to merge
      attentions over other keys with ``aj.merge_attentions`` (static).
    return_max_logits: also return each row's largest raw logit ``scale *
      q . k`` over the keys it may attend to, ``[B, N, T]`` float32, before
      bias and score modifiers (``-inf`` for empty rows; no gradient): what
      QK-clip and logit-growth monitoring read (static).
    positions: integer ``[B, T]`` (or ``[T]``) rotary positions of the
      queries (needs ``rope``): left-padded batches, custom position ids;
      ``[P, B, T]`` with ``rope.sections`` (required then, also while
      decoding). Masks and score modifiers see token indices.
    kv_positions: integer ``[B, S]`` rotary positions of the keys
      (``[P, B, S]`` with sections); default ``positions`` in
      self-attention, required otherwise; not while decoding.
    memory: keys and values projected once by ``project_memory`` (e.g. an
      encoder's output for cross-attention at every decoding step), with
      ``key``/``value`` None.
    cache: a decoding step (what ``MultiHeadAttention(decode=True)``
      passes): this call's keys and values are written into it and the
      queries attend to every filled slot, at their positions
      (``layers/caches.py``): a ``KVCache`` (linear, or a ring buffer),
      whose dense masks and bias are over its ``L`` slots (``[B, N, T,
      L]``), or a ``PagedKVCache`` (no bias, dropout or weights;
      ``attention_fn`` a kernel choice). Right-padded new tokens: the
      mask's ``q_lengths [B]``.
    **options: the layer's static options (``scale``, ``t5_bias``,
      ``attention_fn``, ``rope``, ``qk_norm``, ``clip_qkv``,
      ``value_norm``, ``output_norm``, ``precision``, ``head_axis``,
      ``batch_axis``), described once in ``multi_head_config.Config``.
      ``qk_norm`` None is ``aj.QKNorm()`` when ``params`` has
      ``q_norm``/``k_norm`` ``[H]`` (without biases), else none;
      ``value_norm``/``output_norm`` None with a ``v_norm``/``o_norm`` in
      ``params`` is refused (say how it normalises).

  Returns:
    ``output [B, T, Dout]``; with any ``return_*`` flag a tuple: output,
    then ``weights float32 [B, N, T, S]``, ``lse``, ``max_logits``, each
    only when asked, in that order. With ``cache``: ``(that, the updated
    cache)``.

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
  config = multi_head_config.configure_params(
      params, qk_norm=qk_norm, value_norm=value_norm, output_norm=output_norm,
      t5_bias=t5_bias, score_mod=score_mod, attention_fn=attention_fn,
      scale=scale, rope=rope, precision=precision, head_axis=head_axis,
      batch_axis=batch_axis, clip_qkv=clip_qkv)
  checks.check_static_bool("is_causal", is_causal)
  # While decoding the cache places the causal band (at the positions).
  mask = mask_lib.as_mask(mask, is_causal=is_causal and cache is None)
  call = Call(query, key, value, attention_fn_lib.NO_MASK if mask is None
              else mask, bias, score_mod, positions, kv_positions, memory,
              cache, dropout_rate, dropout_rng,
              (return_weights, return_lse, return_max_logits))
  return forward(config, params, call)
