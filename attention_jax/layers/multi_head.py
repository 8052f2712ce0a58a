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
``multi_head_attention`` is the one projection -> attention -> output path,
with a KV cache (``decoding.cache_step``) too: ``MultiHeadAttention`` calls
it, with its cache when decoding. The
call's pattern is one ``aj.Mask``, handed to the attention function as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import dataclasses
import functools
import inspect
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from attention_jax import kernels
from attention_jax.attention import dot_product
from attention_jax.core import checks
from attention_jax.core import numerics
from attention_jax.decoding import cache_step
from attention_jax.decoding import paged_attention as paged_lib
from attention_jax.decoding import paged_cache
from attention_jax.decoding.cache_step import KVCache
from attention_jax.decoding.paged_cache import PagedKVCache
from attention_jax.layers import multi_head_params
from attention_jax.layers import qk_norm as qk_norm_lib
from attention_jax.layers import sharding
from attention_jax.layers.multi_head_params import init_multi_head_params  # noqa: F401 (doctests)
from attention_jax.layers.multi_head_params import param_dims
from attention_jax.masking import mask as mask_lib
from attention_jax.masking.mask import Mask
from attention_jax.scores import rope as rope_lib
from attention_jax.scores import score_mods

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
  # Explicitly sharded heads: the sum over devices must name its sharding.
  out_sharding = sharding.head_sum_sharding(heads, layer["kernel"])
  y = jnp.einsum("BNTH,NHD->BTD", heads, layer["kernel"], precision=precision,
                 out_sharding=out_sharding)  # [B, T, Dout]
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
    shape = checks.shape_of(x)
    checks.check_logits_rank(name, shape, full, layout)
    checks.check_broadcastable_to(name, shape, full, layout)
  if mask is not None:
    checks.check_mask_dtype("mask", mask)
    mask = numerics.as_bool_mask(mask)
  if bias is not None:
    checks.check_float_array("bias", bias)
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
    return_lse: bool = False,
    return_max_logits: bool = False,
    partition: Any = None,
) -> jax.Array | tuple[jax.Array, ...]:
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
    return_lse: also return each row's log-sum-exp (passed on only when
      True, like ``return_weights``).
    return_max_logits: also return each row's largest raw logit (passed on
      only when True).
    partition: an ``aj.kernels.Partition``: how ``B`` and the heads are
      split over the mesh (``sharding.attention_partition``), so a kernel
      XLA cannot partition runs per shard. Passed on only when given and
      ``attention_fn`` is an implementation or names ``partition`` in its
      signature (a function with ``**kwargs`` does not get it: it may not
      know it).

  Returns:
    ``out [B, N, T, H]``, followed, in this order and only when asked, by
    ``weights [B, N, T, S]``, ``lse [B, N, T]``, ``max_logits [B, N, T]``.

  Example:
    >>> q, kv = jnp.ones((2, 4, 3, 8)), jnp.ones((2, 2, 5, 8))  # N=4, K=2
    >>> out, w = attend_heads(q, kv, kv, return_weights=True)
    >>> out.shape, w.shape
    ((2, 4, 3, 8), (2, 4, 3, 5))
  """
  checks.check_static_bool("is_causal", is_causal)
  mask = mask_lib.as_mask(mask, is_causal=is_causal)
  resolved = resolve_attention_fn(attention_fn)
  kwargs = {}
  if scale is not None:
    if "scale" in resolved.fixed:
      raise ValueError(
          f"scale={scale!r} was given, and attention_fn fixes "
          f"scale={resolved.fixed['scale']!r} (functools.partial): set the "
          "scale in one place.")
    kwargs["scale"] = scale
  for name, x in (("mask", mask), ("bias", bias), ("score_mod", score_mod),
                  ("sinks", sinks)):
    if x is not None:
      kwargs[name] = x
  if not (isinstance(dropout_rate, (int, float)) and dropout_rate == 0.0):
    kwargs.update(dropout_rate=dropout_rate, dropout_rng=dropout_rng)
  for name, flag in (("return_weights", return_weights),
                     ("return_lse", return_lse),
                     ("return_max_logits", return_max_logits)):
    checks.check_static_bool(name, flag)
    if flag:
      kwargs[name] = True
  if partition is not None and resolved.accepts is not None and (
      "partition" in resolved.accepts):
    kwargs["partition"] = partition
  _check_accepts(resolved, kwargs)
  return resolved.fn(query, key, value, **kwargs)


@dataclasses.dataclass(frozen=True, eq=False)
class ResolvedAttentionFn:
  """An ``attention_fn`` read once: the function called, the keywords it
  takes (None: any, ``**kwargs`` or an unreadable signature) and those a
  ``functools.partial`` fixes. Modules resolve theirs when built."""
  fn: Callable[..., Any]
  accepts: frozenset[str] | None
  fixed: dict[str, Any]
  given: Any = None  # what was passed (the layer compares it per call)


def resolve_attention_fn(attention_fn) -> ResolvedAttentionFn:
  """``attention_fn`` (None, a kernel name/instance/list, or a function
  with ``scaled_dot_product_attention``'s contract) resolved once."""
  if isinstance(attention_fn, ResolvedAttentionFn):
    return attention_fn
  given = attention_fn
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
  accepts = None
  try:
    params = inspect.signature(attention_fn).parameters.values()
  except (TypeError, ValueError):
    params = None
  if params is not None and not any(p.kind is p.VAR_KEYWORD for p in params):
    accepts = frozenset(p.name for p in params if p.kind in (
        p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
  return ResolvedAttentionFn(attention_fn, accepts,
                             _partial_keywords(attention_fn), given)


def _check_accepts(resolved: ResolvedAttentionFn,
                   kwargs: dict[str, Any]) -> None:
  """Refuses, by name, what a custom ``attention_fn`` cannot take.

  Python's own error ("unexpected keyword argument") would not say that the
  layer passes it, nor what to do; a function with ``**kwargs`` (or one
  whose signature cannot be read) is trusted.
  """
  if resolved.accepts is None:
    return
  missing = [k for k in kwargs if k not in resolved.accepts]
  if missing:
    attention_fn = resolved.fn
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


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["key", "value"], meta_fields=["qk_norm"])
@dataclasses.dataclass(frozen=True)
class Memory:
  """Keys and values of a memory, projected once (``project_memory``).

  ``key``, ``value``: ``[B, K, S, H]``, after ``W_k``/``W_v`` (and the
  key's qk-norm): what cross-attention reuses at every decoding step.
  ``qk_norm``: the ``aj.QKNorm`` the keys were normalised with (None: none),
  static; a call whose queries are normalised otherwise is refused.
  """
  key: jax.Array
  value: jax.Array
  qk_norm: qk_norm_lib.QKNorm | None = None


class Forward(NamedTuple):
  """One call's results; the fields not asked for are None."""
  output: jax.Array  # [B, T, Dout]
  weights: jax.Array | None = None  # [B, N, T, S or L]
  cache: KVCache | None = None
  lse: jax.Array | None = None  # [B, N, T] float32
  max_logits: jax.Array | None = None  # [B, N, T] float32

  def returned(self, weights: bool, lse: bool, max_logits: bool):
    """The public functions' return: the output alone, or a tuple with
    the asked-for extras in the order weights, lse, max_logits."""
    extra = tuple(x for x, asked in ((self.weights, weights), (self.lse, lse),
                                     (self.max_logits, max_logits)) if asked)
    return (self.output, *extra) if extra else self.output


def project_memory(params: Params, memory: ArrayLike, *,
                   precision: Precision = None,
                   qk_norm: qk_norm_lib.QKNorm | bool | None = None) -> Memory:
  """Projects a memory (e.g. an encoder's output) to keys and values once.

  Cross-attention in a decoder attends to the same memory at every step;
  projecting it here once and passing ``memory=`` to
  ``multi_head_attention`` (or
  ``MultiHeadAttention.init_cross_cache``) gives the same numbers as
  projecting ``key``/``value`` in every call.

  Args:
    params: multi-head params (``W_k``, ``W_v``, and ``k_norm`` with
      qk-norm).
    memory: float ``[B, S, Dkv]``.
    precision: the projection einsums' precision.
    qk_norm: the layer's ``aj.QKNorm`` (as ``multi_head_attention``'s),
      applied to the keys.

  Returns:
    ``Memory(key [B, K, S, H], value [B, K, S, H])``.

  Example:
    >>> p = init_multi_head_params(jax.random.key(0), 8, 2)
    >>> mem = project_memory(p, jnp.ones((1, 5, 8)))
    >>> mem.key.shape
    (1, 2, 5, 4)
  """
  dims = param_dims(params)
  checks.check_float_array("memory", memory)
  checks.check_rank("memory", memory, (3,), "[B, S, Dkv]")
  if checks.shape_of(memory)[-1] != dims.kv_features:
    raise ValueError(
        f"memory has {checks.shape_of(memory)[-1]} features (shape "
        f"{checks.shape_of(memory)}), but params['W_k']['kernel'] has shape "
        f"{multi_head_params.param_shape(params, 'W_k', 'kernel')}: [Dkv, K, "
        f"H] with Dkv={dims.kv_features}.")
  memory = jnp.asarray(memory)
  k = project_heads(memory, params["W_k"], precision=precision)  # [B, K, S, H]
  v = project_heads(memory, params["W_v"], precision=precision)  # [B, K, S, H]
  norm = qk_norm_lib.resolve(params, qk_norm)
  if norm is not None:
    k = qk_norm_lib.normalize(k, params, "k_norm", norm)
  return Memory(k, v, norm)


def _check_memory(memory, b: int, dims: multi_head_params.HeadDims):
  if not isinstance(memory, Memory):
    raise TypeError(f"memory must be an aj Memory from project_memory(params, "
                    f"memory [B, S, Dkv]), got {type(memory).__name__}.")
  want = (b, dims.num_kv_heads, None, dims.head_dim)
  for name, x in (("memory.key", memory.key), ("memory.value", memory.value)):
    shape = checks.shape_of(x)
    if len(shape) != 4 or any(w is not None and w != g
                              for w, g in zip(want, shape)):
      raise ValueError(
          f"{name} has shape {shape}, but this call needs [B, K, S, H] with "
          f"B={b} (the query's batch), K={dims.num_kv_heads}, "
          f"H={dims.head_dim} (the params): project it with these params.")
  if checks.shape_of(memory.key) != checks.shape_of(memory.value):
    raise ValueError(f"memory.key {checks.shape_of(memory.key)} and "
                     f"memory.value {checks.shape_of(memory.value)} differ.")


def _rope_positions(t: int, s: int, mask: Mask | None):
  """Default positions of this call's queries and keys for rotary embeddings.

  Packed documents: restarting per segment (``segment_positions``,
  ``[B, 1, T]``). Otherwise ``arange``, queries bottom-right aligned
  (``S - T + i``, the package's convention). (Decoding uses each example's
  cache positions, see ``multi_head_attention``'s ``cache``.)
  """
  if mask is not None and mask.q_segment_ids is not None:
    def as_heads(ids):
      ids = jnp.asarray(ids)
      positions = rope_lib.segment_positions(ids)
      return positions[:, None, :] if ids.ndim == 2 else positions
    return as_heads(mask.q_segment_ids), as_heads(mask.kv_segment_ids)
  return s - t + jnp.arange(t), jnp.arange(s)


def _as_positions(name: str, positions, b: int, length: int, what: str):
  """``[B, T]`` or ``[T]`` integer positions as ``[B|1, 1, T]`` (head axis).

  Multimodal positions (``Rope(sections=...)``), ``[P, B, T]`` or ``[P, 1,
  T]``, become ``[P, B|1, 1, T]``; ``apply_rope`` checks ``P`` against the
  sections, and refuses plain positions (rank 3 here) for them.
  """
  if isinstance(positions, (list, tuple)):
    positions = jnp.asarray(positions)
  dtype = jnp.result_type(positions)
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array [B, {what}] (or "
                    f"[{what}] shared by the batch), got dtype {dtype}.")
  shape = checks.shape_of(positions)
  if len(shape) == 3 and shape[1:] in ((b, length), (1, length)):
    return jnp.asarray(positions)[:, :, None, :]  # [P, B|1, 1, T]
  if shape not in ((b, length), (length,), (1, length)):
    raise ValueError(
        f"{name} has shape {shape}, expected [B, {what}] = {(b, length)} (or "
        f"[{what}] = ({length},) shared by the batch): one position per "
        f"token; multimodal ones (Rope(sections=...)) [P, B, {what}] = "
        f"(len(sections), {b}, {length}) or [P, 1, {what}].")
  positions = jnp.asarray(positions)
  return positions.reshape((-1, 1, length))  # [B|1, 1, T]


def _rotary_positions(positions, kv_positions, t: int, s: int, b: int,
                      mask: Mask | None, cache: KVCache | None, q_pos,
                      self_attention: bool):
  """The positions queries and keys are rotated at."""
  if cache is not None:  # keys are this call's tokens, rotated before caching
    if kv_positions is not None:
      raise ValueError(
          "kv_positions is for attention over keys other than this call's "
          "tokens; while decoding the cached keys are this call's tokens, "
          "at `positions`.")
    if positions is None:  # each example's cache position, counted from
      # its first real token when it is left-padded. Plain: apply_rope
      # refuses them for Rope(sections=...), which needs explicit positions.
      pads = getattr(cache, "left_padding", None)  # (a paged cache: none)
      rot = q_pos if pads is None else (
          q_pos - jnp.asarray(pads, jnp.int32)[:, None])
      rot = rot[:, None, :]  # [B, 1, T]
    else:
      rot = _as_positions("positions", positions, b, t, "T")
    return rot, rot
  q_rot, k_rot = _rope_positions(t, s, mask)
  if positions is not None:
    q_rot = _as_positions("positions", positions, b, t, "T")
  if kv_positions is not None:
    k_rot = _as_positions("kv_positions", kv_positions, b, s, "S")
  elif positions is not None:
    if not self_attention:
      raise ValueError(
          f"positions gives the queries' positions; with keys other than the "
          f"queries (S={s}, T={t}) pass kv_positions [B, S] too (the keys "
          "take the queries' positions only in self-attention, key and value "
          "the query itself).")
    k_rot = q_rot
  return q_rot, k_rot


def _check_inputs(query, key, value, cache: KVCache | None,
                  params: Mapping[str, Any], dims: multi_head_params.HeadDims,
                  memory: Memory | None) -> None:
  checks.check_float_array("query", query)
  checks.check_rank("query", query, (3,), "[B, T, D]")
  q_shape = checks.shape_of(query)
  if q_shape[-1] != dims.d_model:
    raise ValueError(
        f"query has {q_shape[-1]} features (shape {q_shape}), but "
        f"params['W_q']['kernel'] has shape "
        f"{multi_head_params.param_shape(params, 'W_q', 'kernel')}: [D, N, H] "
        f"with D={dims.d_model}.")
  if memory is not None:
    if key is not None or value is not None:
      raise ValueError(
          "memory holds the projected keys and values; pass key=None and "
          "value=None with it (or pass key/value and no memory).")
    if cache is not None:
      raise ValueError("memory (cross-attention) and a KV cache (causal "
                       "self-attention) are two kinds of layer; pass one.")
    _check_memory(memory, q_shape[0], dims)
    return
  for name, x in (("key", key), ("value", value)):
    if x is None:
      raise TypeError(f"{name} is None: pass [B, S, Dkv] (or memory= from "
                      "project_memory).")
    checks.check_float_array(name, x)
  checks.check_rank("key", key, (3,), "[B, S, Dkv]")
  checks.check_rank("value", value, (3,), "[B, S, Dkv]")
  k_shape, v_shape = map(checks.shape_of, (key, value))
  if k_shape != v_shape:
    raise ValueError(
        f"key {k_shape} and value {v_shape} must have the same shape "
        f"[B, S, Dkv] (one W_k/W_v input width Dkv).")
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
  batch = None if cache is None else _cache_batch(cache)
  if cache is not None and (k_shape[:2] != q_shape[:2]
                            or q_shape[0] != batch):
    raise ValueError(
        f"decoding appends this call's tokens: query {q_shape} and key "
        f"{k_shape} must share [B, T], and B must equal the cache's batch "
        f"{batch}.")


def _cache_batch(cache: KVCache | PagedKVCache) -> int:
  if isinstance(cache, PagedKVCache):
    return cache.page_table.shape[0]
  return cache.key.shape[0]


def paged_step(k, v, m: Mask | None, cache: PagedKVCache, lengths, *,
               bias, scale, dropout_rate, attention_fn, return_weights,
               return_lse, return_max_logits):
  """A decoding step on a paged cache: the write, and the function that
  attends over it (``attend``'s signature; the layer's mask is causal).
  ``v`` None: a cache whose values are its keys (``values_in_keys``; the
  latent layer's)."""
  for name, bad in (("bias", bias is not None),
                    ("dropout_rate", not (isinstance(dropout_rate, (int, float))
                                          and dropout_rate == 0)),
                    ("return_weights", return_weights)):
    if bad:
      raise ValueError(
          f"{name} is not supported while decoding from a paged cache (its "
          "kernel reads pages block by page and forms no [T, S] array): "
          "say a bias with a score modifier, decode without dropout.")
  given = resolve_attention_fn(attention_fn).given
  if callable(given) and not isinstance(given, kernels.Kernel):
    raise ValueError(
        f"attention_fn={given!r} is a function over keys and values, but a "
        "paged cache's keys and values stay in its pages: give a kernel "
        "(a name such as 'flash', an aj.kernels instance) or None, which "
        "aj.paged_attention runs.")
  cache = paged_cache.append(cache, k, v, new_lengths=lengths)
  fields = {} if m is None else _fields(m)
  placed = mask_lib.Mask(**{**fields, "causal": True})

  def attend(q, k, v, m, bias, score_mod, sinks, dropout_rng):
    del k, v, m, bias, dropout_rng  # the pages, the placed layer mask
    return paged_lib.paged_attention(
        q, cache, placed, scale=scale, score_mod=score_mod, sinks=sinks,
        implementation=given, return_lse=return_lse,
        return_max_logits=return_max_logits)

  return cache, attend


def _has_t5(mod) -> bool:
  """Whether a score modifier is (or chains) a T5 relative bias."""
  if not isinstance(mod, score_mods.ScoreMod):
    return False
  if isinstance(mod.fn, score_mods.T5Bias):
    return True
  inner = mod.params if isinstance(mod.params, tuple) else ()
  return any(_has_t5(m) for m in inner)  # a chain holds its modifiers


def layer_extras(params: Params, score_mod: Any,
                 t5_bias: score_mods.T5Bias | None) -> tuple[Any, Any]:
  """The layer's ``(sinks, score_mod)``, read off its parameters.

  ``params["sinks"]["logits"] [N]`` are the sinks (None without them);
  ``params["t5_bias"]["table"] [R, N]`` becomes ``t5_bias.score_mod(table)``,
  applied before ``score_mod`` (the module's order: T5 bias, score modifier,
  soft cap). What ``params`` holds is not given again: a T5 bias in
  ``score_mod`` beside a table in ``params`` is refused rather than one
  silently winning; a table needs ``t5_bias`` (its buckets' settings) and
  ``t5_bias`` needs a table.

  Example:
    >>> p = init_multi_head_params(jax.random.key(0), 8, 2,
    ...                            attention_sinks=True)
    >>> layer_extras(p, None, None)[0].shape
    (2,)
  """
  multi_head_params.check_t5_bias(t5_bias)
  sinks = params["sinks"]["logits"] if "sinks" in params else None
  table = params.get("t5_bias", {}).get("table")
  if table is None and t5_bias is not None:
    raise ValueError(
        f"t5_bias={t5_bias!r} describes a learned table that params does "
        f"not hold: add params['t5_bias'] = {{'table': [{t5_bias.num_buckets},"
        f" N]}} (init_multi_head_params(..., t5_bias=...) or a module's "
        "params_dict()), or leave t5_bias out.")
  if table is None:
    return sinks, score_mod
  shape = checks.shape_of(table)
  if t5_bias is None:
    raise ValueError(
        f"params['t5_bias']['table'] {list(shape)} is a learned T5 relative "
        f"position bias: pass t5_bias=aj.T5Bias(num_buckets={shape[0]}, "
        "max_distance=..., bidirectional=...) (the layer's t5_bias) to say "
        "how distances fall into its buckets.")
  if t5_bias.num_buckets != shape[0]:
    raise ValueError(
        f"t5_bias={t5_bias!r} has num_buckets={t5_bias.num_buckets}, but "
        f"params['t5_bias']['table'] has shape {shape}: [num_buckets, N] "
        f"with {shape[0]} buckets. Pass the settings the table was learned "
        "with.")
  if _has_t5(score_mod):
    raise ValueError(
        "score_mod holds a T5 relative bias, and params['t5_bias']['table'] "
        f"{list(shape)} is the layer's own, which the call applies: give "
        "the table in one place (drop it from score_mod, or the params "
        "entry and t5_bias).")
  t5 = t5_bias.score_mod(table)
  return sinks, t5 if score_mod is None else score_mods.chain(t5, score_mod)


def _fields(m: Mask) -> dict[str, Any]:
  """A mask's constructor arguments (to rebuild it with one changed)."""
  return dict(causal=m.causal, window=m.window, q_lengths=m.q_lengths,
              kv_lengths=m.kv_lengths, q_segment_ids=m.q_segment_ids,
              kv_segment_ids=m.kv_segment_ids, dense=m.dense, rule=m.rule)


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
    rope: rope_lib.Rope | float | None = None,
    positions: ArrayLike | None = None,
    kv_positions: ArrayLike | None = None,
    memory: Memory | None = None,
    precision: Precision = None,
    head_axis: str | None = None,
    cache: KVCache | PagedKVCache | None = None,
    qk_norm: qk_norm_lib.QKNorm | bool | None = None,
    batch_axis: str | tuple[str, ...] | None = None,
) -> Any:
  """The lesson's ``MultiHeadAttention.forward`` as a pure function.

  The head structure is read from ``params`` (see ``init_multi_head_params``
  for the layout): ``N`` and ``H`` from ``W_q``, ``K`` from ``W_k``, the
  output width from ``W_o``, qk-norm from ``q_norm``/``k_norm``, the
  output gate from ``W_g``; learned sinks (``params["sinks"]["logits"]
  [N]``, the layer's only source of sinks) and a T5 table (with its
  settings ``t5_bias``) are used when present, so a module's
  ``params_dict()`` gives the module's numbers.

  Args:
    params: from ``init_multi_head_params`` (or a converter such as
      ``from_torch_multihead_attention``).
    query: float ``[B, T, D]``.
    key: float ``[B, S, Dkv]`` (None with ``memory``).
    value: float ``[B, S, Dkv]`` (None with ``memory``).
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
    t5_bias: an ``aj.T5Bias`` (static): how distances fall into the buckets
      of ``params["t5_bias"]["table"] [R, N]``, T5's learned relative bias,
      added before ``score_mod``; required with that table, refused
      without it.
    dropout_rate: dropout on attention weights, in ``[0, 1)`` (static).
    dropout_rng: ``jax.random.key``, required when ``dropout_rate > 0``.
    attention_fn: a replacement for ``scaled_dot_product_attention`` with
      its contract (see ``attend_heads``), e.g. ``aj.blockwise_attention``;
      or its ``implementation`` (``"dense"``, ``"flash"``, ``"cudnn"``,
      a kernel, a list); None: automatic.
    return_weights: also return the attention weights (static).
    return_lse: also return each row's log-sum-exp ``[B, N, T]`` float32
      (``-inf`` for a row with nothing to attend to), e.g. to merge
      attentions over other keys with ``aj.merge_attentions`` (static).
    return_max_logits: also return each row's largest raw logit ``scale *
      q . k`` over the keys it may attend to, ``[B, N, T]`` float32, before
      bias, score modifiers and soft cap (``-inf`` for empty rows; no
      gradient): what QK-clip and logit-growth monitoring read, e.g.
      ``max_logits.max(axis=(0, 2))`` per head (static).
    rope: rotary position embeddings on the projected queries and keys: an
      ``aj.Rope`` (base, scaling, partial rotary, layout) or a base (e.g.
      ``10000.0``, the plain formula); None for none. Positions are
      ``positions``/``kv_positions`` if given; else they restart per
      document with segment ids, with queries bottom-right aligned
      otherwise. With qk-norm, the norm comes first unless its
      ``after_rope``.
    positions: integer ``[B, T]`` (or ``[T]``) positions of the queries for
      ``rope``: left-padded batches (each example's first real token at 0;
      mask the padded keys, e.g. a dense ``[B, 1, 1, S]`` mask) or custom
      position ids. Only rotary embeddings read them; masks and score
      modifiers see token indices. With ``rope.sections`` (M-RoPE,
      Qwen2-VL): ``[P, B, T]`` (or ``[P, 1, T]``), ``P = len(sections)``,
      required, also while decoding (the default positions are plain).
    kv_positions: integer ``[B, S]`` positions of the keys (``[P, B, S]``
      with ``rope.sections``); default ``positions`` in self-attention
      (``key`` and ``value`` are ``query`` itself), required otherwise.
    memory: keys and values projected once by ``project_memory`` (e.g. an
      encoder's output for cross-attention at every decoding step), with
      ``key``/``value`` None.
    precision: ``jax.lax.Precision`` (or None) of the projection einsums
      (``W_q``, ``W_k``, ``W_v``, ``W_o``); the attention itself runs at
      ``scaled_dot_product_attention``'s precision, which takes none.
    head_axis: a mesh axis the heads are split over (tensor parallelism):
      the projected heads are constrained to it, so attention runs on each
      device's heads and only ``W_o``'s partial products are summed. The
      attention function gets ``partition=`` (heads over ``head_axis``,
      the batch over ``batch_axis``) when it takes it, so a kernel XLA
      cannot partition (``pallas_gpu``, ``splash``) runs on each device's
      heads inside ``jax.shard_map`` rather than on gathered operands.
    cache: a decoding step (what ``MultiHeadAttention(decode=True)``
      passes): this call's keys and values are written at ``cache.index``
      and the queries attend to every filled slot, at their positions
      (``cache_step.write``); a dense mask and the bias are then over the
      ``L`` cache slots (``[B, N, T, L]``). A ``PagedKVCache``: the tokens
      are appended to each sequence's pages (``paged_cache.append``) and
      the queries attend causally over them through the page table
      (``aj.paged_attention``; no bias, dropout or weights; ``attention_fn``
      a kernel or None).
    qk_norm: how the projected queries and keys are normalised (static):
      an ``aj.QKNorm`` (RMS or layer norm, per head or over all heads,
      weight shared ``[H]``, per head ``[N, H]`` or none, epsilon, ``1 +
      w``, before or after rotary). None: ``aj.QKNorm()`` (RMSNorm per
      head, epsilon ``1e-6``) when ``params`` has ``q_norm``/``k_norm``
      ``[H]``, else none. Its weights are ``params``' ``q_norm`` and
      ``k_norm``; a weight the ``QKNorm`` does not read is refused.
    batch_axis: the mesh axes the batch ``B`` is split over, for the
      attention function's ``partition`` (a name, a tuple, or ``()`` for
      none). None: with ``head_axis``, the mesh's other non-manual axes
      when their sizes' product divides ``B`` (``data`` of a ``data x
      model`` mesh), else none (``sharding.attention_partition``).

  Order per head: projection, qk-norm, rotary positions (qk-norm after
  them with ``after_rope``), cache write, attention, output gate
  (``W_g``), ``W_o``. Cached keys are normalised once, before they are
  written.

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
  dims = param_dims(params)
  _check_inputs(query, key, value, cache, params, dims, memory)
  norm = qk_norm_lib.resolve(params, qk_norm)
  if memory is not None and memory.qk_norm != norm:
    raise ValueError(
        f"memory's keys were normalised with qk_norm={memory.qk_norm}, but "
        f"this call normalises the queries with {norm}: pass project_memory "
        "the same qk_norm= as this call.")
  sinks, score_mod = layer_extras(params, score_mod, t5_bias)
  checks.check_static_bool("is_causal", is_causal)
  rope = rope_lib.as_rope(rope)
  if rope is None and (positions is not None or kv_positions is not None):
    raise ValueError(
        "positions/kv_positions place rotary embeddings, and this call has "
        "rope=None: pass rope= (e.g. aj.Rope(base=10000.0)) or leave the "
        "positions out (masks and score modifiers see token indices).")
  if rope is not None and memory is not None:
    raise ValueError(
        "rope with a projected memory is not supported: the memory's keys "
        "are projected once, without positions. Rotate them yourself or "
        "attend with key/value.")
  q_shape = checks.shape_of(query)
  s = (memory.key.shape[2] if memory is not None
       else checks.shape_of(key)[1])
  sharding.check_heads_divide(dims.num_heads, dims.num_kv_heads, head_axis)
  b, t = q_shape[:2]
  paged = isinstance(cache, PagedKVCache)
  if cache is None:
    full, layout = (b, dims.num_heads, t, s), "[B, N, T, S]"
  elif paged:
    full = (b, dims.num_heads, t, cache.max_pages * cache.page_size)
    layout = "[B, N, T, M * Z] (decoding: a paged cache's slots)"
  else:
    full = (b, dims.num_heads, t, cache.key.shape[2])
    layout = "[B, N, T, L] (decoding: L cache slots)"
  m = mask_lib.as_mask(mask, is_causal=is_causal and cache is None)
  dense, bias = _check_mask_and_bias(None if m is None else m.dense, bias,
                                     full, layout)
  if dense is not None:
    m = mask_lib.Mask(**{**_fields(m), "dense": dense})
  # Keys default to the queries' positions only when they are the queries.
  self_attention = key is query and value is query
  query = jnp.asarray(query)
  q = project_heads(query, params["W_q"], precision=precision)  # [B, N, T, H]
  if memory is None:
    key, value = jnp.asarray(key), jnp.asarray(value)
    if dense is not None and cache is None:
      # Padded inputs may hold NaN: zero them before W_k/W_v.
      seen = jnp.any(dense, axis=(1, 2))  # [B|1, S|1]
      key, value = numerics.zero_unseen(seen, key, value)
    k = project_heads(key, params["W_k"], precision=precision)  # [B, K, S, H]
    v = project_heads(value, params["W_v"], precision=precision)  # [B, K, S, H]
  else:
    k, v = memory.key, memory.value  # [B, K, S, H], normed already
    if dense is not None:  # masked memory may hold NaN: zero what is unseen
      seen = jnp.any(dense, axis=(1, 2))[:, None, :, None]  # [B|1, 1, S|1, 1]
      k, v = (jnp.where(seen, x, jnp.zeros((), x.dtype)) for x in (k, v))
  q, k, v = (sharding.constrain_heads(x, head_axis) for x in (q, k, v))
  def normalize_qk(q, k):
    q = qk_norm_lib.normalize(q, params, "q_norm", norm)
    if memory is None:  # a memory's keys were normalised as projected
      k = qk_norm_lib.normalize(k, params, "k_norm", norm)
    return q, k

  if norm is not None and not norm.after_rope:  # Gemma's order
    q, k = normalize_qk(q, k)
  q_pos = None
  if cache is not None:  # every example at its own position
    index = cache.lengths if paged else jnp.broadcast_to(
        jnp.asarray(cache.index, jnp.int32), (b,))
    lengths = cache_step.new_lengths(m, b, t)
    q_pos = index[:, None] + jnp.arange(t)[None, :]  # [B, T] absolute
  if rope is not None:
    q_rot, k_rot = _rotary_positions(positions, kv_positions, t, s, b, m,
                                     cache, q_pos, self_attention)
    seq_len = None
    if rope.scaling in ("dynamic", "longrope"):  # one length: q and k share
      # frequencies
      seq_len = jnp.maximum(jnp.max(q_rot), jnp.max(k_rot)) + 1
    q = rope_lib.apply_rope(q, q_rot, rope=rope, seq_len=seq_len)
    k = rope_lib.apply_rope(k, k_rot, rope=rope, seq_len=seq_len)
  if norm is not None and norm.after_rope:  # Llama 4's order
    q, k = normalize_qk(q, k)
  partition = sharding.attention_partition(head_axis, batch_axis, b)

  def attend(q, k, v, m, bias, score_mod, sinks, dropout_rng):
    return attend_heads(
        q, k, v, m, bias=bias, scale=scale, score_mod=score_mod, sinks=sinks,
        dropout_rate=dropout_rate, dropout_rng=dropout_rng,
        attention_fn=attention_fn, return_weights=return_weights,
        return_lse=return_lse, return_max_logits=return_max_logits,
        partition=partition)

  if paged:
    cache, attend = paged_step(
        k, v, m, cache, lengths, bias=bias, scale=scale,
        dropout_rate=dropout_rate, attention_fn=attention_fn,
        return_weights=return_weights, return_lse=return_lse,
        return_max_logits=return_max_logits)
  elif cache is not None:
    k, v, m, score_mod, cache = cache_step.write(
        cache, k, v, m, bias, score_mod, index, lengths, q_pos,
        dims.num_heads)

  # Explicit mesh axes: the per-head attention runs with them auto, its
  # results sharded as the queries' [B, N, T] (sharding.auto_like).
  result = sharding.auto_like(attend, q)(q, k, v, m, bias, score_mod, sinks,
                                         dropout_rng)
  result = result if isinstance(result, tuple) else (result,)
  asked = 1 + return_weights + return_lse + return_max_logits
  if len(result) != asked:
    names = [n for n, on in (("weights", return_weights), ("lse", return_lse),
                             ("max_logits", return_max_logits)) if on]
    raise TypeError(
        f"attention_fn returned {len(result)} value(s), but this call asked "
        f"for (out, {', '.join(names)}): an attention_fn that accepts a "
        "return_* flag must return what it asks for, in the order weights, "
        "lse, max_logits.")
  out, extra = result[0], list(result[1:])
  weights = extra.pop(0) if return_weights else None
  lse = extra.pop(0) if return_lse else None
  max_logits = extra.pop(0) if return_max_logits else None
  if dims.output_gate is not None:  # sigmoid(query W_g): [B, N, T, H|1]
    gate = project_heads(query, params["W_g"], precision=precision)
    out = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(out.dtype)
  output = output_projection(out, params["W_o"],
                             precision=precision)  # [B, T, Dout]
  returned = Forward(output, weights, cache, lse, max_logits).returned(
      return_weights, return_lse, return_max_logits)
  return returned if cache is None else (returned, cache)


