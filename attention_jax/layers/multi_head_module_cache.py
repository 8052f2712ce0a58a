"""A multi-head module's decoding caches, kept as ``nnx.Cache`` variables.

Shape glossary: B batch, K key/value heads, L linear cache slots (or W ring
slots), H head dim, P pages in a pool, Z tokens per page, M pages per
sequence, S memory length.

``DecodingCaches`` is what ``MultiHeadAttention`` inherits to decode: one
cache at a time, a linear KV cache or ring buffer (``init_cache``:
``cached_key``/``cached_value [B, K, L, H]``, ``cache_index [B]``, the
overflow and pad flags, ``cache_left_padding``), a paged cache
(``init_paged_cache``: the pools in ``cached_key``/``cached_value [P, K, Z,
H]``, ``cache_page_table [B, M]``, lengths in ``cache_index``, reference
counts, scales), or a cross-attention memory projected once
(``init_cross_cache``: ``memory_key``/``memory_value [B, K, S, H]``, and
``memory_options``, the qk-norm, clipping and value norm they were
projected with, so a layer whose options changed since is refused).
``decoding_cache`` reads the one held as the value ``layers.caches``
writes (a ``KVCache``, a ``PagedKVCache``, a ``Memory``) and
``store_cache`` keeps what the write returned.
"""

from __future__ import annotations

from flax import nnx
import jax.numpy as jnp
from jax.typing import ArrayLike

from attention_jax.core import checks
from attention_jax.decoding import cache_step
from attention_jax.decoding import kv_cache
from attention_jax.decoding import paged_cache
from attention_jax.layers import caches
from attention_jax.layers import multi_head
from attention_jax.layers import sharding

CACHE_ROWS = ("cache_rows picks sequences of a paged cache while decoding: "
              "pass decode=True after init_paged_cache(...) (a linear "
              "cache's rows are its batch: slice the cache instead).")
# Every variable a cache may hold (None when not held).
CACHE_VARIABLES = (
    "cached_key", "cached_value", "cache_index", "cache_overflow",
    "cache_pad_written", "cache_left_padding", "cache_page_table",
    "cache_refcount", "cache_key_scales", "cache_value_scales",
    "cache_nonfinite", "memory_key", "memory_value")


class DecodingCaches(nnx.Module):
  """The caches of a multi-head module (see the module docstring); the
  module provides ``num_kv_heads``, ``head_dim``, ``kv_features``,
  ``head_axis``, ``mask``, ``rope``, ``qk_norm``, ``clip_qkv``,
  ``value_norm``, ``precision``, ``dtype``, ``param_dtype`` and
  ``params_dict()``."""

  def _no_cache(self) -> None:
    """Drops whatever cache is held (a layer holds one at a time)."""
    for name in CACHE_VARIABLES:
      setattr(self, name, nnx.data(None))
    self.cache_window: int | None = None
    self.memory_options: tuple = ()  # init_cross_cache's (qk_norm, ...)

  def decoding_cache(self, key, value, cache_rows):
    """The cache a ``decode=True`` call writes: ``(memory, cache, full)``,
    one of ``memory``/``cache`` None; ``full`` the whole paged cache when
    ``cache_rows`` picks some of its sequences (else None)."""
    if cache_rows is not None and self.cache_page_table is None:
      raise ValueError(CACHE_ROWS)
    if self.memory_key is not None:
      if key is not None or value is not None:
        raise ValueError(
            "this layer holds a cross-attention memory (init_cross_cache): "
            "decode=True attends to it, so pass no key/value (or call "
            "without decode=True to attend to other keys).")
      return multi_head.Memory(self.memory_key[...], self.memory_value[...],
                               *self.memory_options), None, None
    if self.cache_index is None:
      raise ValueError("decode=True needs a cache: call "
                       "init_cache(batch_size, max_length) first (causal "
                       "self-attention), or init_cross_cache(memory) "
                       "(cross-attention).")
    if self.cache_page_table is not None:
      full = self._paged()
      if cache_rows is None:
        return None, full, None
      return None, paged_cache.take_rows(full, cache_rows), full
    pads = (None if self.cache_left_padding is None
            else self.cache_left_padding[...])
    return None, cache_step.KVCache(
        self.cached_key[...], self.cached_value[...], self.cache_index[...],
        self.cache_overflow[...], self.cache_window, pads,
        self.cache_pad_written[...]), None

  def _shared(self, shared_kv, key, value, decode, cache_rows):
    """``(memory, cache)`` of a ``kv_shared`` layer's call (one None)."""
    if not self.kv_shared:
      raise ValueError(
          "shared_kv is for a layer built with kv_shared=True (no W_k/W_v "
          "of its own); this layer projects its own keys and values.")
    if key is not None or value is not None:
      raise ValueError("a kv_shared layer attends over another layer's "
                       "keys and values: pass shared_kv=, not key/value.")
    if decode:
      if not isinstance(shared_kv, DecodingCaches):
        raise TypeError(
            f"with decode=True, shared_kv is the layer whose cache this "
            f"step wrote (a MultiHeadAttention), got "
            f"{type(shared_kv).__name__}.")
      memory, cache, _ = shared_kv.decoding_cache(None, None, cache_rows)
      if cache is None:
        raise ValueError("shared_kv's layer holds a cross-attention memory, "
                         "not a self-attention cache: nothing to share.")
      return None, caches.Shared(cache)
    if not (isinstance(shared_kv, multi_head.Memory) and shared_kv.rotated):
      raise TypeError(
          "a kv_shared layer needs shared_kv=other.shared_kv(x) (the other "
          "layer's keys and values for the same tokens) or, while decoding, "
          f"shared_kv=other; got {type(shared_kv).__name__}.")
    if cache_rows is not None:
      raise ValueError(CACHE_ROWS)
    return shared_kv, None

  def store_cache(self, cache, full, cache_rows) -> None:
    """Keeps a decoding call's written cache (``decoding_cache``'s)."""
    if isinstance(cache, paged_cache.PagedKVCache):
      if cache_rows is not None:
        cache = paged_cache.put_rows(full, cache, cache_rows)
      self._store_paged(cache)
      return
    self.cached_key[...] = cache.key
    self.cached_value[...] = cache.value
    self.cache_index[...] = cache.index
    self.cache_overflow[...] = cache.overflow
    self.cache_pad_written[...] = cache.pad_written

  def init_cache(self, batch_size: int, max_length: int | None = None, *,
                 window: int | None = None,
                 dtype: jnp.dtype | None = None,
                 left_padding: ArrayLike | None = None) -> None:
    """Creates an empty KV cache: linear, or a ring buffer for a window.

    Every example of the batch has its own position (``cache_index [B]``):
    a ragged prefill (``mask=aj.Mask(q_lengths=`` the prompt lengths``)``,
    prompts right-padded) leaves each example where its prompt ended, and each
    then decodes from there. Left-padded prompts give ``left_padding``
    instead.

    Args:
      batch_size: ``B``.
      max_length: ``L``, the most tokens (prompt + generated) a linear
        cache holds. Leave it out for a layer whose mask has a causal window
        to get a ring buffer instead.
      window: ``W`` slots of a ring buffer (sliding-window cache): memory
        independent of the generated length, equal to full attention with
        the module's window. Needs a layer mask with ``window=(w, 0)`` (or
        ``w`` with causal decoding) with ``w < W``; defaults to ``w + 1``
        when neither ``max_length`` nor ``window`` is given.
      dtype: cache dtype; defaults to the module's ``dtype`` or
        ``param_dtype``. ``"int8"`` or ``"float8_e4m3fn"``: a quantised
        linear cache, kept in pages (``init_paged_cache`` with ``B *
        ceil(L / Z)`` pages of ``Z = min(L, 128)`` tokens: the bytes of a
        linear cache, every row room for ``L`` tokens), quantised on
        write with a scale per token and key/value head and dequantised
        page by page as attention reads it; not with a ring buffer or
        ``left_padding``. Any other dtype (``"int4"``, an integer one) is a
        ``TypeError`` here (``paged_cache.storage_dtype``, the check of
        every cache's dtype).
      left_padding: optional integer ``[B]``: each example's leading pad
        tokens, for prompts left-padded to one length ``T`` and prefilled
        with ``decode=True`` (pads included: every example advances by
        ``T``). The cache never shows those positions to any query, rotary
        positions (unless ``positions=`` is given), masks and score
        modifiers count from each example's first real token, so a
        left-padded example decodes as its tokens alone; in a linear cache
        or a ring buffer (which refuses a dense padding mask). Stored as
        ``cache_left_padding``.
    """
    checks.check_positive_int("batch_size", batch_size)
    length, window = cache_step.cache_slots(self.mask, max_length, window)
    dtype, quantized = paged_cache.storage_dtype(
        dtype or self.dtype or self.param_dtype)
    if quantized is not None:
      self.init_paged_cache(batch_size, dtype=quantized,
                            **paged_cache.linear_pages(
                                quantized, batch_size, length, window=window,
                                left_padding=left_padding))
      return
    if left_padding is not None:
      left_padding = kv_cache.check_left_padding(left_padding, batch_size)
    self._no_cache()  # one cache at a time
    shape = (batch_size, self.num_kv_heads, length, self.head_dim)
    meta = {}
    if sharding.mesh_axis_size(self.head_axis) is not None:  # K heads split
      meta["out_sharding"] = (None, self.head_axis, None, None)
    self.cached_key = nnx.Cache(jnp.zeros(shape, dtype), **meta)  # [B, K, L, H]
    self.cached_value = nnx.Cache(jnp.zeros(shape, dtype), **meta)
    self.cache_index = nnx.Cache(jnp.zeros((batch_size,), jnp.int32))  # [B]
    self.cache_overflow = nnx.Cache(jnp.zeros((batch_size,), bool))  # [B]
    self.cache_pad_written = nnx.Cache(jnp.zeros((batch_size,), bool))  # [B]
    self.cache_left_padding = (None if left_padding is None
                               else nnx.Cache(left_padding))  # [B]
    self.cache_window = window

  def init_paged_cache(self, batch_size: int, *, num_pages: int,
                       page_size: int, max_pages: int,
                       dtype: jnp.dtype | None = None) -> None:
    """Creates an empty paged KV cache (``aj.init_paged_cache``).

    One pool of ``num_pages`` pages of ``page_size`` tokens serves the
    ``batch_size`` sequences (rows), each holding at most ``max_pages``
    pages: memory follows the tokens held, not ``B`` times the longest.
    ``decode=True`` then appends each call's tokens to each sequence's
    pages and attends causally through its page table (ragged new tokens
    with the mask's ``q_lengths``). ``dtype="int8"`` or
    ``"float8_e4m3fn"`` stores quantised pages with a scale per token and
    key/value head (dequantised page by page as attention reads them). A
    finished sequence's pages return to
    the pool with ``update_paged_cache(aj.paged_cache.release, done)``;
    ``update_paged_cache(aj.paged_cache.share_prefix, src, dst, n)``
    gives a new sequence another's prompt without copying it.

    Example:
      >>> mha = aj.MultiHeadAttention(8, 2, rngs=nnx.Rngs(0))
      >>> mha.init_paged_cache(2, num_pages=6, page_size=4, max_pages=3)
      >>> out = mha(jnp.ones((2, 5, 8)), decode=True,
      ...           mask=aj.Mask(q_lengths=jnp.array([5, 2])))
      >>> mha.cache_index[...].tolist()
      [5, 2]
      >>> mha.update_paged_cache(aj.paged_cache.release,
      ...                        jnp.array([True, False]))
      >>> mha.cache_index[...].tolist()
      [0, 2]
    """
    checks.check_positive_int("batch_size", batch_size)
    dtype = dtype or self.dtype or self.param_dtype
    self._no_cache()  # one cache at a time
    cache = paged_cache.init_paged_cache(
        num_pages, page_size, self.num_kv_heads, self.head_dim, batch_size,
        max_pages, dtype=dtype)
    self.cached_key = nnx.Cache(cache.key_pages)  # [P, K, Z, H]
    self.cached_value = nnx.Cache(cache.value_pages)
    self.cache_index = nnx.Cache(cache.lengths)  # [B]
    self.cache_overflow = nnx.Cache(cache.overflow)  # [B]
    self.cache_page_table = nnx.Cache(cache.page_table)  # [B, M]
    self.cache_refcount = nnx.Cache(cache.refcount)  # [P]
    scales = cache.key_scales is not None
    self.cache_key_scales = nnx.Cache(cache.key_scales) if scales else None
    self.cache_value_scales = (nnx.Cache(cache.value_scales) if scales
                               else None)  # [P, K, Z]
    self.cache_nonfinite = nnx.Cache(cache.nonfinite)  # [P]

  def _paged(self) -> paged_cache.PagedKVCache:
    scales = (None, None) if self.cache_key_scales is None else (
        self.cache_key_scales[...], self.cache_value_scales[...])
    return paged_cache.PagedKVCache(
        self.cached_key[...], self.cached_value[...],
        self.cache_page_table[...], self.cache_index[...],
        self.cache_refcount[...], self.cache_overflow[...], *scales,
        self.cache_nonfinite[...])

  def _store_paged(self, cache: paged_cache.PagedKVCache) -> None:
    self.cached_key[...] = cache.key_pages
    self.cached_value[...] = cache.value_pages
    self.cache_page_table[...] = cache.page_table
    self.cache_index[...] = cache.lengths
    self.cache_refcount[...] = cache.refcount
    self.cache_overflow[...] = cache.overflow
    self.cache_nonfinite[...] = cache.nonfinite
    if self.cache_key_scales is not None:
      self.cache_key_scales[...] = cache.key_scales
      self.cache_value_scales[...] = cache.value_scales

  def update_paged_cache(self, fn, *args, **kwargs) -> None:
    """Replaces the paged cache by ``fn(cache, *args, **kwargs)``: one of
    ``aj.paged_cache``'s pure updates (``release``, ``share_prefix``,
    ``append``)."""
    if self.cache_page_table is None:
      raise ValueError("update_paged_cache needs a paged cache: call "
                       "init_paged_cache(...) first.")
    cache = fn(self._paged(), *args, **kwargs)
    if not isinstance(cache, paged_cache.PagedKVCache):
      raise TypeError(f"{getattr(fn, '__name__', fn)} returned "
                      f"{type(cache).__name__}, not a PagedKVCache.")
    self._store_paged(cache)

  def init_cross_cache(self, memory: ArrayLike, *,
                       dtype: jnp.dtype | None = None) -> None:
    """Projects a memory (an encoder's output) once, for cross-attention.

    After this, ``layer(query, decode=True)`` attends to the stored keys and
    values without projecting the memory again: the same numbers as
    ``layer(query, memory)`` (a decoder's cross-attention then costs one
    query projection per step instead of two ``[S, Dkv]`` projections).
    Masks and biases are per call, over ``[B, N, T, S]`` as without the
    cache (e.g. ``aj.Mask(kv_lengths=source_lengths)``). Replaces any KV
    cache of this layer (one layer is either causal self-attention or
    cross-attention).

    Args:
      memory: float ``[B, S, Dkv]``.
      dtype: dtype of the stored keys and values, a float dtype; defaults
        to the module's ``dtype`` or ``param_dtype`` (another dtype rounds
        them: the numbers then differ from projecting the memory per call
        by that rounding).

    Example:
      >>> cross = aj.MultiHeadAttention(8, 2, rngs=nnx.Rngs(0))
      >>> memory, x = jnp.ones((1, 6, 8)), jnp.ones((1, 1, 8))
      >>> cross.init_cross_cache(memory)
      >>> bool(jnp.allclose(cross(x, decode=True), cross(x, memory)))
      True
    """
    if self.rope is not None:
      raise ValueError(
          "init_cross_cache projects the memory once, without positions; "
          "this layer has rope, which would rotate the keys at each call's "
          "positions. Build the cross-attention layer with rope=None.")
    checks.check_float_array("memory", memory)
    checks.check_module_input("memory", memory, self.kv_features,
                              "kv_features", "[B, S, Dkv]")
    dtype = dtype or self.dtype or self.param_dtype
    try:
      quantized = paged_cache.storage_dtype(dtype)[1]
    except TypeError:  # not a float dtype either
      quantized = dtype
    if quantized is not None:
      raise TypeError(
          f"init_cross_cache keeps the projected memory as it is: dtype must "
          f"be a float dtype, got {dtype!r} (quantised storage, int8 or "
          "float8_e4m3fn, is for init_cache and init_paged_cache).")
    self._no_cache()  # one cache at a time
    if self.dtype is not None:
      memory = jnp.asarray(memory, self.dtype)
    projected = multi_head.project_memory(
        self.params_dict(), memory, precision=self.precision,
        qk_norm=self.qk_norm, clip_qkv=self.clip_qkv,
        value_norm=self.value_norm)
    self.memory_options = (projected.qk_norm, projected.clip_qkv,
                           projected.value_norm)
    self.memory_key = nnx.Cache(projected.key.astype(dtype))  # [B, K, S, H]
    self.memory_value = nnx.Cache(projected.value.astype(dtype))

  def check_cache(self) -> None:
    """Raises ``ValueError`` if a decoding call overflowed the cache, or
    cached right padding.

    The step itself records overflow as a value (``cache_overflow [B]``,
    sticky) instead of a host callback; call this where a host sync is
    cheap (after generating, or every n steps). An example that overflowed
    did not write the tokens that did not fit, and its outputs since then
    are not meaningful. ``cache_pad_written [B]`` (sticky) marks examples
    whose prefill (``T > 1``) had no ``q_lengths`` but a mask hiding its
    last token from its own query (``kv_lengths`` or a key-padding mask
    shorter than ``T``): right-padded prompts whose pads were cached as
    tokens. That raises at trace time when the values are concrete; under
    ``jit`` this reports it.
    """
    if self.cache_overflow is None:
      cache_step.raise_if_overflowed(None, None, 0, "KV cache")
    if self.cache_page_table is not None:
      paged_cache.check_overflow(self._paged())
      return
    cache_step.raise_if_overflowed(
        self.cache_overflow[...], self.cache_index[...],
        self.cached_key.shape[2], "KV cache",
        " (or use a ring buffer: a layer mask with a causal window)")
    if self.cache_pad_written is not None:
      cache_step.raise_if_pads_written(self.cache_pad_written[...])
