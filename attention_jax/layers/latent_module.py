"""``MultiHeadLatentAttention``: DeepSeek-V2/V3's MLA in Flax NNX, with its cache.

Shape glossary: B batch, T this call's tokens, L cache slots, N query heads,
D model dim, Dout output features, Rq ``q_lora_rank``, R ``kv_lora_rank``,
Hn ``qk_nope_head_dim``, Hr ``qk_rope_head_dim``, Hv ``v_head_dim``.

The module owns its parameters as ``Projection``/``NormScale`` holders of
``nnx.Param``s, laid out as ``aj.latent_attention``'s params dict:

- ``W_dq.kernel [D, Rq]`` (``.bias [Rq]`` with ``use_bias``),
  ``q_norm.scale [Rq]``, ``W_uq.kernel [Rq, N, Hn + Hr]``; without a query
  low-rank (``q_lora_rank=None``) ``W_q.kernel [D, N, Hn + Hr]`` instead;
- ``W_dkv.kernel [D, R + Hr]`` (``.bias``), ``kv_norm.scale [R]``,
  ``W_ukv.kernel [R, N, Hn + Hv]``;
- ``W_o.kernel [N, Hv, Dout]`` (``.bias [Dout]``),

and, after ``init_cache``, the cache: ``cached_latent [B, L, R]`` (the
normed ``c_kv``), ``cached_rope_key [B, L, Hr]`` (the rotated shared key),
``cache_index [B]`` and ``cache_overflow [B]``. Cache per token: ``(R + Hr)
* itemsize`` bytes per layer, vs ``2 * K * H * itemsize`` for
``MultiHeadAttention`` (DeepSeek-V2: 576 numbers against 2 * 128 * 128 =
32768 for its 128 heads). The full call is ``latent.latent_attention``
(per-head keys and values, the paper's form); ``decode=True`` is
``latent.latent_decode`` (``W_uk`` folded into the query, multi-query
attention over the latent cache, then ``W_uv`` and ``W_o``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
import numpy as np

from attention_jax.core import checks
from attention_jax.decoding import cache_step
from attention_jax.decoding import paged_cache
from attention_jax.layers import attention_fn as attention_fn_lib
from attention_jax.layers import latent
from attention_jax.layers import multi_head
from attention_jax.layers import multi_head_config
from attention_jax.layers.multi_head_module import NormScale
from attention_jax.layers.multi_head_module import Projection
from attention_jax.layers.multi_head_module import assign_params
from attention_jax.layers.multi_head_module import check_fit
from attention_jax.masking import mask as mask_lib
from attention_jax.masking.mask import Mask
from attention_jax.scores import rope as rope_lib

_LECUN_NORMAL = nnx.initializers.lecun_normal()  # nnx.Linear's default
_ZEROS = nnx.initializers.zeros_init()

# The default rotation: the paper's (base 10000; a frozen value).
_PLAIN_ROPE = rope_lib.Rope()


class MultiHeadLatentAttention(nnx.Module):
  """Multi-head latent attention (DeepSeek-V2/V3): a small cache per token.

  Self-attention only (keys and values come from the same tokens as the
  queries), causal when decoding.

  Args:
    d_model: ``D``, input features (and output features by default).
    num_heads: ``N``.
    rngs: ``nnx.Rngs`` for parameter init (``params`` stream).
    kv_lora_rank: ``R``, the width of the cached latent ``c_kv`` (DeepSeek:
      512).
    qk_nope_head_dim: ``Hn``, each head's position-free query/key features
      (DeepSeek: 128).
    qk_rope_head_dim: ``Hr``, the rotary query features per head and the
      width of the one shared rotary key (even; DeepSeek: 64).
    v_head_dim: ``Hv``, each head's value width (DeepSeek: 128).
    q_lora_rank: ``Rq``, the query's low rank (DeepSeek-V2/V3: 1536), or
      None for a full-rank ``W_q`` (DeepSeek-V2-Lite).
    out_features: ``Dout``; None means ``d_model``.
    rope: an ``aj.Rope`` (DeepSeek-V3 long context: ``aj.Rope(base,
      scaling="yarn", factor=40, original_max_positions=4096,
      mscale=1.0, mscale_all_dim=1.0, interleaved=True)``; by default
      ``aj.Rope()``, base 10000), or None; applied to ``q_pe`` and ``k_pe``
      only.
    scale: multiplier of ``q . k``, a positive number or a concrete float
      scalar array (kept as its Python float, as ``MultiHeadAttention``
      keeps it: ``multi_head_config.static_scale``; a traced one is
      refused); None means ``1 / sqrt(Hn + Hr)``,
      multiplied by YaRN's ``(0.1 * mscale_all_dim * ln(factor) + 1) ** 2``
      when ``rope`` is a YaRN ``Rope`` with ``mscale_all_dim`` (as DeepSeek
      and Hugging Face do; ``latent.default_scale``). A number is used as
      given (nothing multiplied in). Decoding uses the same scale.
    use_bias: biases on ``W_dq``, ``W_dkv`` and ``W_o`` (DeepSeek's
      ``attention_bias``; the up-projections never have one).
    precision: ``jax.lax.Precision`` of the projection einsums.
    dtype: computation dtype (inputs and parameters are cast to it); None:
      inferred. Attention runs in float32 for <=32-bit inputs.
    param_dtype: parameter dtype.
    kernel_init: initialiser for the kernels (LeCun normal), called on the
      flat 2-D shapes (``[D, Rq]``, ``[Rq, N*(Hn+Hr)]``, ``[D, R + Hr]``,
      ``[R, N*(Hn+Hv)]``, ``[N*Hv, Dout]``) then reshaped per head.
    bias_init: initialiser for the biases (zeros).
    attention_fn: a function of the ``attention_fn`` protocol
      (``layers/attention_fn.py``: ``attention_fn(q, k, v, mask,
      **options)``), or a kernel choice; it always receives ``scale=``.
    mask: an ``aj.Mask`` every call is intersected with, e.g.
      ``aj.Mask(causal=True, window=(W - 1, 0))`` (decoding honours it; the
      cache may then be a ring buffer of ``W`` slots).

  Example:
    >>> mla = MultiHeadLatentAttention(
    ...     32, 4, q_lora_rank=16, kv_lora_rank=24, qk_nope_head_dim=8,
    ...     qk_rope_head_dim=4, v_head_dim=8, rngs=nnx.Rngs(0))
    >>> x = jax.random.normal(jax.random.key(1), (2, 6, 32))
    >>> forward = nnx.jit(lambda m, x: m(x, is_causal=True))  # training
    >>> decode = nnx.jit(lambda m, x: m(x, decode=True))  # cached, absorbed
    >>> full = forward(mla, x)
    >>> mla.init_cache(batch_size=2, max_length=8)
    >>> prompt = decode(mla, x[:, :5])               # prefill the cache
    >>> step = decode(mla, x[:, 5:])                 # then a token at a time
    >>> bool(jnp.allclose(step, full[:, 5:], atol=1e-5))
    True
    >>> mla.cached_latent.shape, mla.cached_rope_key.shape  # [B, L, R], Hr
    ((2, 8, 24), (2, 8, 4))
    >>> mla.cache_bytes_per_token                    # (24 + 4) * 4 bytes
    112
  """

  def __init__(
      self,
      d_model: int,
      num_heads: int,
      *,
      rngs: nnx.Rngs,
      kv_lora_rank: int,
      qk_nope_head_dim: int,
      qk_rope_head_dim: int,
      v_head_dim: int,
      q_lora_rank: int | None = None,
      out_features: int | None = None,
      rope: rope_lib.Rope | None = _PLAIN_ROPE,
      scale: float | None = None,
      use_bias: bool = False,
      precision: multi_head.Precision = None,
      dtype: jnp.dtype | None = None,
      param_dtype: jnp.dtype = jnp.float32,
      kernel_init: nnx.Initializer = _LECUN_NORMAL,
      bias_init: nnx.Initializer = _ZEROS,
      attention_fn: Any = None,
      mask: Mask | None = None,
  ):
    dims = latent.check_latent_dims(
        d_model, num_heads, q_lora_rank=q_lora_rank,
        kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim,
        qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim,
        out_features=out_features)
    checks.check_static_bool("use_bias", use_bias)
    scale = multi_head_config.static_scale(scale)  # a concrete array: float
    if mask is not None and not isinstance(mask, Mask):
      raise TypeError(f"mask must be an aj.Mask (the layer's pattern, e.g. "
                      f"aj.Mask(causal=True, window=(W - 1, 0))), got "
                      f"{type(mask).__name__}; per-call masks go to the "
                      "call.")
    self.dims = dims
    self.d_model = d_model
    self.num_heads = num_heads
    self.q_lora_rank = q_lora_rank
    self.kv_lora_rank = kv_lora_rank
    self.qk_nope_head_dim = qk_nope_head_dim
    self.qk_rope_head_dim = qk_rope_head_dim
    self.v_head_dim = v_head_dim
    self.out_features = dims.out_features
    self.rope = rope_lib.as_rope(rope)
    self.scale = scale
    self.use_bias = use_bias
    self.precision = precision
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.attention_fn = attention_fn
    # Checked once, here; a call checks it again only if reassigned.
    self._attention = attention_fn_lib.as_attention_fn(attention_fn)
    self._attention_given = attention_fn
    self.mask = nnx.data(mask)
    for name, shape, _ in latent.param_shapes(dims):
      if name.endswith("_norm"):
        layer = NormScale(shape[0], param_dtype=param_dtype)
      else:
        split = 1 if name in ("W_dq", "W_dkv", "W_q", "W_uq", "W_ukv") else 2
        layer = Projection(shape[:split], shape[split:],
                           use_bias=use_bias and name in latent.BIASED,
                           param_dtype=param_dtype, kernel_init=kernel_init,
                           bias_init=bias_init, rngs=rngs)
      setattr(self, name, layer)
    for name in ("W_dq", "q_norm", "W_uq", "W_q"):
      if not hasattr(self, name):
        setattr(self, name, nnx.data(None))
    self.cached_latent: nnx.Cache | None = nnx.data(None)
    self.cached_rope_key: nnx.Cache | None = nnx.data(None)
    self.cache_index: nnx.Cache | None = nnx.data(None)
    self.cache_overflow: nnx.Cache | None = nnx.data(None)
    self.cache_window: int | None = None
    # A paged latent cache (init_paged_cache): one aj.PagedKVCache whose
    # key pages hold [c_kv, k_pe] per token (values_in_keys).
    self.cache_pages: nnx.Cache | None = nnx.data(None)

  def _layers(self) -> dict[str, Projection | NormScale]:
    return {name: getattr(self, name)
            for name, _, _ in latent.param_shapes(self.dims)}

  def params_dict(self) -> latent.Params:
    """The parameters in ``aj.latent_attention``'s layout, in ``dtype``."""
    return {name: layer.as_dict(self.dtype)
            for name, layer in self._layers().items()}

  def load_params(self, params: Mapping[str, Mapping[str, Any]]) -> None:
    """Assigns a params dict (e.g. converted DeepSeek weights) to this module.

    Args:
      params: ``aj.latent_attention``'s layout (see the module docstring for
        the mapping of Hugging Face's names), with this module's entries,
        biases and shapes; cast to ``param_dtype``.

    Raises:
      ValueError: naming the first entry that differs from the module's,
        its shape and the module's (with the sizes it was built with).

    Example:
      >>> kw = dict(q_lora_rank=16, kv_lora_rank=24, qk_nope_head_dim=8,
      ...           qk_rope_head_dim=4, v_head_dim=8)
      >>> a = MultiHeadLatentAttention(32, 4, rngs=nnx.Rngs(0), **kw)
      >>> b = MultiHeadLatentAttention(32, 4, rngs=nnx.Rngs(1), **kw)
      >>> b.load_params(a.params_dict())
      >>> bool(np.array_equal(a.W_ukv.kernel[...], b.W_ukv.kernel[...]))
      True
    """
    described = dict(
        entries=(f"q_lora_rank={self.q_lora_rank}, "
                 f"use_bias={self.use_bias}"),
        sizes=", ".join(f"{k}={v}" for k, v in self.dims._asdict().items()))
    # The module's own shapes first: they say which entry is wrong, where
    # the params alone (latent_dims) can only say which ones disagree; a
    # fit is then a valid layout, so latent_dims has nothing left to say.
    check_fit(self._layers(), params, latent.LAYOUT, **described)
    assign_params(self._layers(), params, latent.LAYOUT, **described)

  def init_cache(self, batch_size: int, max_length: int | None = None, *,
                 window: int | None = None,
                 dtype: jnp.dtype | None = None) -> None:
    """Creates an empty latent cache: linear, or a ring buffer for a window.

    Each example keeps its own position (``cache_index [B]``), as in
    ``MultiHeadAttention.init_cache``.

    Args:
      batch_size: ``B``.
      max_length: ``L``, the most tokens a linear cache holds. Leave it out
        for a layer whose mask has a causal window ``(w, 0)`` to get a ring
        buffer of ``w + 1`` slots.
      window: ``W`` slots of a ring buffer; needs a layer mask window ``(w,
        0)`` with ``w < W``.
      dtype: cache dtype; defaults to ``dtype`` or ``param_dtype``.
        ``"int8"`` or ``"float8_e4m3fn"``: a quantised linear cache, kept
        in pages as ``MultiHeadAttention``'s (``init_paged_cache`` with
        ``B * ceil(L / Z)`` pages of ``Z = min(L, 128)`` tokens: every row
        room for ``L`` tokens), a scale per token; not with a ring buffer.
        Any other dtype is a ``TypeError`` here, as for
        ``init_paged_cache``.
    """
    checks.check_positive_int("batch_size", batch_size)
    length, window = cache_step.cache_slots(self.mask, max_length, window)
    dtype, quantized = paged_cache.storage_dtype(
        dtype or self.dtype or self.param_dtype)
    if quantized is not None:
      self.init_paged_cache(batch_size, dtype=quantized,
                            **paged_cache.linear_pages(
                                quantized, batch_size, length, window=window))
      return
    cache = latent.LatentCache(
        *(jnp.zeros((batch_size, length, width), dtype)
          for width in (self.kv_lora_rank, self.qk_rope_head_dim)),
        jnp.zeros((batch_size,), jnp.int32), jnp.zeros((batch_size,), bool))
    self.cached_latent = nnx.Cache(cache.latent)  # [B, L, R]
    self.cached_rope_key = nnx.Cache(cache.rope_key)  # [B, L, Hr]
    self.cache_index = nnx.Cache(cache.index)  # [B]
    self.cache_overflow = nnx.Cache(cache.overflow)  # [B]
    self.cache_window = window
    self.cache_pages = None  # one cache at a time

  def init_paged_cache(self, batch_size: int, *, num_pages: int,
                       page_size: int, max_pages: int,
                       dtype: jnp.dtype | str | None = None) -> None:
    """Creates an empty paged latent cache (``aj.init_paged_latent_cache``).

    One pool of ``num_pages`` pages of ``page_size`` tokens, each token's
    ``[c_kv, k_pe]`` once, serves ``batch_size`` sequences of at most
    ``max_pages`` pages; ``decode=True`` then appends each call's tokens
    (``q_lengths [B]`` of them per row, 0: idle) and attends through the
    page table, as ``MultiHeadAttention``'s paged cache.
    ``update_paged_cache(aj.paged_cache.release, done)`` returns finished
    rows' pages. ``dtype``: as ``init_cache``'s, or ``"int8"`` /
    ``"float8_e4m3fn"`` (quantised, a scale per token).

    Example:
      >>> mla = MultiHeadLatentAttention(
      ...     32, 4, kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4,
      ...     v_head_dim=8, rngs=nnx.Rngs(0))
      >>> mla.init_paged_cache(2, num_pages=6, page_size=4, max_pages=3)
      >>> out = mla(jnp.ones((2, 5, 32)), decode=True,
      ...           mask=aj.Mask(q_lengths=jnp.array([5, 2])))
      >>> pages = mla.cache_pages.get_value()  # an aj.PagedKVCache
      >>> pages.lengths.tolist(), mla.cache_bytes_per_token
      ([5, 2], 112)
    """
    checks.check_positive_int("batch_size", batch_size)
    self.cache_pages = nnx.Cache(latent.init_paged_latent_cache(
        self.params_dict(), batch_size, num_pages=num_pages,
        page_size=page_size, max_pages=max_pages,
        dtype=dtype or self.dtype or self.param_dtype))
    self.cached_latent = self.cached_rope_key = None
    self.cache_index = self.cache_overflow = None
    self.cache_window = None

  def update_paged_cache(self, fn, *args, **kwargs) -> None:
    """Replaces the paged cache by ``fn(cache, *args, **kwargs)``: one of
    ``aj.paged_cache``'s pure updates (``release``, ``share_prefix``)."""
    if self.cache_pages is None:
      raise ValueError("update_paged_cache needs a paged cache: call "
                       "init_paged_cache(...) first.")
    cache = fn(self.cache_pages.get_value(), *args, **kwargs)
    if not isinstance(cache, paged_cache.PagedKVCache):
      raise TypeError(f"{getattr(fn, '__name__', fn)} returned "
                      f"{type(cache).__name__}, not a PagedKVCache.")
    self.cache_pages.set_value(cache)

  @property
  def cache_bytes_per_token(self) -> int:
    """Bytes the cache spends per token and example (one layer).

    Measured from the cache buffers: ``(nbytes of cached_latent and
    cached_rope_key) / (B * L)``, i.e. ``(R + Hr) * itemsize``; for a
    paged cache the pool's pages (and scales) over its ``P * Z`` slots.
    """
    if self.cache_pages is not None:
      return paged_cache.bytes_per_slot(self.cache_pages.get_value())
    if self.cached_latent is None:
      raise ValueError("no cache: call init_cache(batch_size, max_length) "
                       "first.")
    buffers = (self.cached_latent, self.cached_rope_key)
    total = sum(int(np.prod(v.shape)) * jnp.dtype(v.dtype).itemsize
                for v in buffers)
    b, slots = self.cached_latent.shape[:2]
    return total // (b * slots)

  def check_cache(self) -> None:
    """Raises ``ValueError`` if a decoding call overflowed the cache.

    Overflow is recorded inside the step (``cache_overflow [B]``, sticky);
    call this where a host sync is cheap, as ``MultiHeadAttention``'s.
    """
    if self.cache_pages is not None:
      paged_cache.check_overflow(self.cache_pages.get_value())
      return
    if self.cache_overflow is None:
      cache_step.raise_if_overflowed(None, None, 0, "latent cache")
    cache_step.raise_if_overflowed(
        self.cache_overflow[...], self.cache_index[...],
        self.cached_latent.shape[1], "latent cache")

  def _resolved_attention(self) -> attention_fn_lib.AttentionFn:
    if self._attention_given is self.attention_fn:
      return self._attention
    return attention_fn_lib.as_attention_fn(self.attention_fn)

  def __call__(
      self,
      x: ArrayLike,
      mask: Mask | ArrayLike | None = None,
      *,
      positions: ArrayLike | None = None,
      is_causal: bool = False,
      decode: bool = False,
      return_weights: bool = False,
  ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attends ``x`` to itself.

    Args:
      x: ``[B, T, D]``.
      mask: an ``aj.Mask`` (``kv_lengths``, causal, window, segment ids
        (not while decoding), a rule) or a dense bool array of rank 4 (``[B,
        N, T, T]``; over cache slots ``[B, N, T, L]`` when decoding, where
        ``q_lengths [B]`` is each example's real new tokens of a right-padded
        ragged prefill). Intersected with the layer's ``mask``.
      positions: integer ``[B, T]`` (or ``[T]``) rotary positions of this
        call's tokens (e.g. counted from each left-padded example's first
        real token); None: ``0..T-1`` (restarting per document with segment
        ids), or the cache slots ``cache_index + 0..T-1`` when decoding.
      is_causal: shorthand for ``mask & aj.Mask(causal=True)`` (implied by
        ``decode``).
      decode: write this call's latents to the cache (``init_cache`` first)
        and attend causally over everything cached, in the absorbed form.
        Any number of tokens per call; equals the full causal forward.
      return_weights: also return the attention weights ``[B, N, T, S]``
        (``S = L`` when decoding; ``L + T`` for a ring buffer).

    Returns:
      ``output [B, T, Dout]``, or ``(output, weights)``.
    """
    checks.check_static_bool("is_causal", is_causal)
    checks.check_static_bool("decode", decode)
    checks.check_module_input("x", x, self.d_model, "d_model", "[B, T, D]")
    if self.dtype is not None:
      x = jnp.asarray(x, self.dtype)
    call_mask = mask_lib.as_mask(mask, is_causal=is_causal and not decode)
    if self.mask is not None:
      call_mask = self.mask if call_mask is None else self.mask & call_mask
    if not decode:
      return latent.latent_attention(
          self.params_dict(), x, call_mask, positions=positions,
          rope=self.rope, scale=self.scale, attention_fn=self._resolved_attention(),
          precision=self.precision, return_weights=return_weights)
    if self.cache_pages is not None:
      *result, cache = latent.latent_decode(
          self.params_dict(), x, self.cache_pages.get_value(), call_mask,
          positions=positions, rope=self.rope, scale=self.scale,
          attention_fn=self._resolved_attention(), precision=self.precision,
          return_weights=return_weights)
      self.cache_pages.set_value(cache)
      return tuple(result) if return_weights else result[0]
    if self.cache_index is None:
      raise ValueError("decode=True needs a cache: call "
                       "init_cache(batch_size, max_length) first.")
    cache = latent.LatentCache(
        self.cached_latent[...], self.cached_rope_key[...],
        self.cache_index[...], self.cache_overflow[...], self.cache_window)
    *result, cache = latent.latent_decode(
        self.params_dict(), x, cache, call_mask, positions=positions,
        rope=self.rope, scale=self.scale, attention_fn=self._resolved_attention(),
        precision=self.precision, return_weights=return_weights)
    self.cached_latent[...] = cache.latent
    self.cached_rope_key[...] = cache.rope_key
    self.cache_index[...] = cache.index
    self.cache_overflow[...] = cache.overflow
    return tuple(result) if return_weights else result[0]
