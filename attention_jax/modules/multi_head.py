"""``MultiHeadAttention``: the lesson's module in Flax NNX, with a KV cache.

Shape glossary: B batch, T query length, S key/value length, N query heads,
K key/value heads, H head dim = D // N, D model dim, L cache capacity.

The module owns its parameters as plain ``nnx.Param``s (``W_q``, ``W_k``,
``W_v``, ``W_o``, each a ``kernel`` and optional ``bias``, laid out as
``aj.multi_head_attention``'s params dict) and, after ``init_cache``, the
cache variables. The maths is ``attention_jax.multi_head.forward`` (projection
per head, attention of N query heads over K shared KV heads, ``W_o``), the
same path for the full call and for cached decoding.
"""

from __future__ import annotations

from flax import nnx
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from attention_jax import _checks
from attention_jax import _patterns
from attention_jax import multi_head
from attention_jax import sharding
from attention_jax.modules import _rngs

_LECUN_NORMAL = nnx.initializers.lecun_normal()  # nnx.Linear's default
_ZEROS = nnx.initializers.zeros_init()


class Projection(nnx.Module):
  """The parameters of one projection: ``kernel [in, out]``, ``bias [out]``.

  Only parameters: ``aj.multi_head_attention`` does the maths. Created in
  ``nnx.Linear``'s order (kernel, then bias, each from ``rngs.params()``), so
  the same seed gives the same numbers as a Linear layer would.
  """

  def __init__(self, n_in: int, n_out: int, *, use_bias: bool,
               param_dtype, kernel_init, bias_init, rngs: nnx.Rngs):
    self.kernel = nnx.Param(kernel_init(rngs.params(), (n_in, n_out),
                                        param_dtype))
    self.bias = nnx.data(None)
    if use_bias:
      self.bias = nnx.Param(bias_init(rngs.params(), (n_out,), param_dtype))

  def as_dict(self, dtype=None) -> dict[str, jax.Array]:
    """``{"kernel", "bias"}`` arrays, cast to ``dtype`` if given."""
    out = {"kernel": self.kernel[...]}
    if self.bias is not None:
      out["bias"] = self.bias[...]
    if dtype is not None:
      out = {k: v.astype(dtype) for k, v in out.items()}
    return out


class MultiHeadAttention(nnx.Module):
  """Multi-head attention for self-, cross- and causal (cached) attention.

  Args:
    d_model: ``D``, input and output features.
    num_heads: ``N``; divides ``d_model``.
    rngs: ``nnx.Rngs`` for parameter init (``params`` stream) and dropout
      (``dropout`` stream, falling back to the default one).
    num_kv_heads: ``K`` key/value heads (grouped-query attention); divides
      ``num_heads``. ``None`` means ``N``; 1 is multi-query attention.
    dropout_rate: dropout on the attention weights, in ``[0, 1)``.
    deterministic: default for calls; ``True`` disables dropout. ``model.eval()``
      and ``nnx.view(model, deterministic=...)`` set it, as for flax's modules.
    use_bias: biases in the four projections.
    dtype: computation dtype of the projections (``None``: inferred from
      inputs and params). Attention itself runs in float32 for <=32-bit
      inputs.
    param_dtype: parameter dtype.
    kernel_init: initialiser for the four kernels (LeCun normal).
    bias_init: initialiser for the biases (zeros).
    attention_fn: replacement for ``aj.scaled_dot_product_attention`` with the
      same signature and return value.
    implementation: ``None`` (automatic: dense when weights are returned or
      the problem is small, else cuDNN on GPU or blockwise), ``"dense"``,
      ``"blockwise"`` or ``"cudnn"``; see ``aj.scaled_dot_product_attention``.
    head_axis: mesh axis for head (tensor) parallelism, e.g. ``"model"``:
      ``W_q/W_k/W_v`` kernels are annotated ``(None, head_axis)`` (whole
      heads per device), ``W_o`` ``(head_axis, None)``, so attention needs no
      communication and ``W_o`` ends in one all-reduce. Build the module under
      ``jax.set_mesh(mesh)`` (flax then shards the parameters as it creates
      them); ``N`` and ``K`` must divide the axis size.
    local_window_size: ``w`` or ``(left, right)``: every call attends within
      this window (a sliding-window layer); see
      ``aj.scaled_dot_product_attention``. Decoding honours it.
    logits_soft_cap: ``c``: logits become ``c * tanh(logits / c)``.
    attention_sinks: learn one sink logit per head (``sinks``, an
      ``nnx.Param [N]`` initialised to 0) joining every row's softmax
      denominator.
    score_mod: ``score_mod(score, q_idx, kv_idx, *score_mod_args)`` applied
      in every call (``score_mod_args`` per call); e.g. ``aj.alibi``.
    rope: base of rotary position embeddings (e.g. ``10000.0``) on the
      projected queries and keys, None for none. Positions come from the
      cache while decoding and restart per document with segment ids.

  Example:
    >>> mha = MultiHeadAttention(16, 4, rngs=nnx.Rngs(0))
    >>> x = jnp.ones((2, 5, 16))
    >>> mha(x).shape                                   # self-attention
    (2, 5, 16)
    >>> out, w = mha(x, jnp.ones((2, 7, 16)), return_weights=True)  # cross
    >>> w.shape
    (2, 4, 5, 7)
    >>> mha.init_cache(batch_size=2, max_length=8)     # causal decoding
    >>> prompt = mha(x, decode=True)                   # prefill 5 tokens
    >>> step = mha(jnp.ones((2, 1, 16)), decode=True)  # then one at a time
    >>> int(mha.cache_index[...])
    6
  """

  def __init__(
      self,
      d_model: int,
      num_heads: int,
      *,
      rngs: nnx.Rngs,
      num_kv_heads: int | None = None,
      dropout_rate: float = 0.0,
      deterministic: bool = False,
      use_bias: bool = True,
      dtype: jnp.dtype | None = None,
      param_dtype: jnp.dtype = jnp.float32,
      kernel_init: nnx.Initializer = _LECUN_NORMAL,
      bias_init: nnx.Initializer = _ZEROS,
      attention_fn: multi_head.AttentionFn | None = None,
      implementation: str | None = None,
      head_axis: str | None = None,
      local_window_size: int | tuple[int, int] | None = None,
      logits_soft_cap: float | None = None,
      attention_sinks: bool = False,
      score_mod: multi_head.ScoreMod | None = None,
      rope: float | None = None,
  ):
    num_kv_heads = _checks.check_head_counts(d_model, num_heads,
                                             num_kv_heads)
    if (head_axis and nnx.using_eager_sharding()
        and sharding.mesh_axis_size(head_axis) is None):
      raise ValueError(
          f"head_axis={head_axis!r} shards the parameters as they are "
          "created, which needs a mesh with that axis: build the module "
          "under `with jax.set_mesh(mesh):` (mesh axes: "
          f"{jax.sharding.get_abstract_mesh().axis_names or 'none'}).")
    sharding.check_heads_divide(num_heads, num_kv_heads, head_axis)
    _checks.check_dropout_rate(dropout_rate)
    self.d_model = d_model
    self.num_heads = num_heads
    self.num_kv_heads = num_kv_heads
    self.head_dim = d_model // num_heads
    self.dropout_rate = dropout_rate
    self.deterministic = deterministic
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.attention_fn = attention_fn
    self.implementation = implementation
    self.head_axis = head_axis
    self.local_window_size = _patterns.check_window(local_window_size)
    _checks.check_soft_cap(logits_soft_cap)
    self.logits_soft_cap = logits_soft_cap
    self.score_mod = score_mod
    if rope is not None and (isinstance(rope, bool) or not isinstance(
        rope, (int, float)) or not rope > 0):
      raise ValueError(f"rope is the rotary base, a positive number such as "
                       f"10000.0, or None; got {rope!r}.")
    self.rope = rope
    self.sinks = nnx.data(None)
    if attention_sinks:
      self.sinks = nnx.Param(jnp.zeros((num_heads,), param_dtype))  # [N]
    kv_features = num_kv_heads * self.head_dim
    specs = sharding.projection_specs(head_axis) if head_axis else {}

    def linear(name, n_in, n_out):
      k_init, b_init = kernel_init, bias_init
      if name in specs:  # flax shards these as it creates them
        k_init = nnx.with_partitioning(k_init, specs[name]["kernel"])
        b_init = nnx.with_partitioning(b_init, specs[name]["bias"])
      return Projection(n_in, n_out, use_bias=use_bias,
                        param_dtype=param_dtype, kernel_init=k_init,
                        bias_init=b_init, rngs=rngs)

    self.W_q = linear("W_q", d_model, d_model)
    self.W_k = linear("W_k", d_model, kv_features)
    self.W_v = linear("W_v", d_model, kv_features)
    self.W_o = linear("W_o", d_model, d_model)
    self.rngs = _rngs.dropout_stream(rngs, dropout_rate)
    self.cached_key: nnx.Cache | None = nnx.data(None)
    self.cached_value: nnx.Cache | None = nnx.data(None)
    self.cache_index: nnx.Cache | None = nnx.data(None)

  def params_dict(self) -> multi_head.Params:
    """The parameters in ``aj.multi_head_attention``'s layout, in ``dtype``."""
    return {name: getattr(self, name).as_dict(self.dtype)
            for name in ("W_q", "W_k", "W_v", "W_o")}

  def init_cache(self, batch_size: int, max_length: int,
                 dtype: jnp.dtype | None = None) -> None:
    """Creates an empty KV cache of ``max_length`` positions.

    Args:
      batch_size: ``B``.
      max_length: ``L``, the most tokens (prompt + generated) it will hold.
      dtype: cache dtype; defaults to the module's ``dtype`` or
        ``param_dtype``.
    """
    _checks.check_positive_int("batch_size", batch_size)
    _checks.check_positive_int("max_length", max_length)
    dtype = dtype or self.dtype or self.param_dtype
    shape = (batch_size, self.num_kv_heads, max_length, self.head_dim)
    meta = {}
    if sharding.mesh_axis_size(self.head_axis) is not None:  # K heads split
      meta["out_sharding"] = (None, self.head_axis, None, None)
    self.cached_key = nnx.Cache(jnp.zeros(shape, dtype), **meta)  # [B, K, L, H]
    self.cached_value = nnx.Cache(jnp.zeros(shape, dtype), **meta)
    self.cache_index = nnx.Cache(jnp.array(0, jnp.int32))

  def __call__(
      self,
      query: ArrayLike,
      key: ArrayLike | None = None,
      value: ArrayLike | None = None,
      mask: ArrayLike | None = None,
      *,
      bias: ArrayLike | None = None,
      is_causal: bool = False,
      deterministic: bool | None = None,
      rngs: nnx.Rngs | jax.Array | None = None,
      return_weights: bool = False,
      decode: bool = False,
      key_value_seq_lengths: ArrayLike | None = None,
      query_seq_lengths: ArrayLike | None = None,
      query_segment_ids: ArrayLike | None = None,
      key_segment_ids: ArrayLike | None = None,
      score_mod_args: tuple[ArrayLike, ...] = (),
  ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attends ``query`` to ``key``/``value``.

    Args:
      query: ``[B, T, D]``.
      key: ``[B, S, D]``; defaults to ``query`` (self-attention).
      value: ``[B, S, D]``; defaults to ``key`` (cross-attention passes the
        encoder output once).
      mask: bool/integer broadcastable to ``[B, N, T, S]`` (True = may
        attend); with ``decode=True``, to ``[B, N, T, L]`` over cache slots.
      bias: float broadcastable like ``mask``, added to the logits.
      is_causal: bottom-right aligned causal masking (implied by ``decode``).
      deterministic: overrides the constructor's; True disables dropout.
      rngs: overrides the module's dropout stream for this call.
      return_weights: also return the attention weights.
      decode: append this call's keys/values to the cache (``init_cache``
        first) and attend causally to everything cached. Any number of tokens
        per call; the result equals full causal attention over the sequence.
      key_value_seq_lengths: integer ``[B]``: keys (cache slots when
        decoding) at positions ``>=`` the length are padding.
      query_seq_lengths: integer ``[B]``: rows past it get output 0.
      query_segment_ids: integer ``[B, T]``: packed documents (not while
        decoding).
      key_segment_ids: integer ``[B, S]``, with the query ids.
      score_mod_args: arrays for the constructor's ``score_mod``,
        broadcastable to ``[B, N, T, S]``.

    Returns:
      ``output [B, T, D]``, or ``(output, weights [B, N, T, S])`` (``S = L``
      when decoding) with ``return_weights=True``.
    """
    key = query if key is None else key
    value = key if value is None else value
    for name, x in (("query", query), ("key", key), ("value", value)):
      _checks.check_rank(name, x, (3,), "[B, T or S, D]")
      if _checks.shape_of(x)[-1] != self.d_model:
        raise ValueError(
            f"{name} has {_checks.shape_of(x)[-1]} features (shape "
            f"{_checks.shape_of(x)}), but the module was built with "
            f"d_model={self.d_model}.")
    if self.dtype is not None:  # as nnx.Linear: compute in `dtype`
      query, key, value = (jnp.asarray(x, self.dtype)
                           for x in (query, key, value))
    if deterministic is None:
      deterministic = self.deterministic
    rate = 0.0 if deterministic else self.dropout_rate
    dropout_rng = _rngs.dropout_key(rngs, self.rngs) if rate > 0 else None
    cache = None
    if decode:
      if self.cache_index is None:
        raise ValueError("decode=True needs a cache: call "
                         "init_cache(batch_size, max_length) first.")
      cache = multi_head.KVCache(self.cached_key[...],
                                 self.cached_value[...],
                                 self.cache_index[...])
    out, weights, cache = multi_head.forward(
        self.params_dict(), query, key, value, mask, num_heads=self.num_heads,
        num_kv_heads=self.num_kv_heads, bias=bias, is_causal=is_causal,
        dropout_rate=rate, dropout_rng=dropout_rng,
        attention_fn=self.attention_fn, implementation=self.implementation,
        return_weights=return_weights, head_axis=self.head_axis, cache=cache,
        key_value_seq_lengths=key_value_seq_lengths,
        query_seq_lengths=query_seq_lengths,
        local_window_size=self.local_window_size,
        query_segment_ids=query_segment_ids, key_segment_ids=key_segment_ids,
        logits_soft_cap=self.logits_soft_cap,
        sinks=None if self.sinks is None else self.sinks[...],
        score_mod=self.score_mod, score_mod_args=score_mod_args,
        rope=self.rope)
    if decode:
      self.cached_key[...] = cache.key
      self.cached_value[...] = cache.value
      self.cache_index[...] = cache.index
    return (out, weights) if return_weights else out
