"""A decoding step's cache write: one interface for every cache a layer writes.

Shape glossary: B batch, N query heads, K key/value heads, T this call's
tokens, L linear cache slots, W ring-buffer slots, S' the slots the queries
attend over (``L``, ``W + T`` for a ring buffer, ``M * Z`` for a paged
cache of ``M`` pages of ``Z`` tokens per sequence), H head dim.

Two generic functions, one implementation per kind of cache
(``functools.singledispatch``: a new cache registers its own):

- ``place(cache, mask, b, t) -> Step``: where this call's ``T`` tokens go
  (each example's tokens so far, its real new tokens: the mask's
  ``q_lengths``, their positions), what a dense mask is over, and the
  cache's batch; read before the projections, since rotary positions
  default to the cache's. It checks the cache's fields first (a
  hand-built cache's too: ``cache_step.check_cache``,
  ``paged_cache.check_cache``).
- ``write(cache, keys, step, num_heads) -> (cache, attended)``: writes this
  call's keys and values (``attention_fn.Keys``) and returns the new cache
  and what the queries attend over: ``Keys`` over the slots (the mask, the
  bias and the score modifier restated there) or ``PagedKeys``, which read
  a paged cache's pages. Either has ``attend(attention_fn, q, options)``.

Implemented for ``KVCache`` (linear, or a ring buffer with ``window``:
``cache_step.write``) and ``PagedKVCache`` (``paged_cache.append``, then
``aj.paged_attention``). The latent layer writes its ``LatentCache`` as a
``KVCache`` of one head (``[k_pe]`` keys, ``[c_kv]`` values) and its paged
latent cache as a ``PagedKVCache`` whose values are its keys.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from attention_jax.decoding import cache_step
from attention_jax.decoding import paged_attention as paged_lib
from attention_jax.decoding import paged_cache
from attention_jax.decoding.cache_step import KVCache
from attention_jax.decoding.paged_cache import PagedKVCache
from attention_jax.layers import attention_fn as attention_fn_lib
from attention_jax.layers.attention_fn import Keys
from attention_jax.masking.mask import Mask


class Step(NamedTuple):
  """Where one decoding call's tokens go (``place``)."""
  index: jax.Array  # [B] tokens each example held before this call
  lengths: jax.Array | None  # [B] real new tokens (q_lengths); None: all T
  positions: jax.Array  # [B, T] the new tokens' slots: index + i
  rotary: jax.Array  # [B, T] default rotary positions (from the first real
  # token of a left-padded example)
  slots: int  # S': a dense mask and a bias are [B, N, T, S']
  layout: str  # S' in words, for messages
  batch: int  # the cache's B


@functools.singledispatch
def place(cache, mask: Mask, b: int, t: int) -> Step:
  """Where this call's tokens go in ``cache`` (see the module docstring)."""
  del mask, b, t
  raise TypeError(f"cache must be an aj KVCache or PagedKVCache (or a cache "
                  f"that registers caches.place and caches.write), got "
                  f"{type(cache).__name__}.")


@functools.singledispatch
def write(cache, keys: Keys, step: Step, num_heads: int):
  """Writes ``keys`` into ``cache``: ``(new cache, what the queries attend
  over)`` (see the module docstring)."""
  del keys, step, num_heads
  raise TypeError(f"no caches.write for {type(cache).__name__}.")


def _positions(index: jax.Array, t: int) -> jax.Array:
  return index[:, None] + jnp.arange(t)[None, :]  # [B, T]


@place.register
def _place_linear(cache: KVCache, mask: Mask, b: int, t: int) -> Step:
  cache_step.check_cache(cache)
  # The cache's batch: check_call names a query of another one.
  index = jnp.broadcast_to(jnp.asarray(cache.index, jnp.int32),
                           (cache.key.shape[0],))
  positions = _positions(index, t)
  rotary = positions  # counted from each example's first real token
  if cache.left_padding is not None:
    rotary = positions - jnp.asarray(cache.left_padding, jnp.int32)[:, None]
  return Step(index, cache_step.new_lengths(mask, b, t), positions, rotary,
              cache.key.shape[2], "[B, N, T, L] (decoding: L cache slots)",
              cache.key.shape[0])


@write.register
def _write_linear(cache: KVCache, keys: Keys, step: Step, num_heads: int):
  k, v, mask, score_mod, cache = cache_step.write(
      cache, keys.key, keys.value, keys.mask, keys.bias, keys.score_mod,
      step.index, step.lengths, step.positions, num_heads)
  return cache, Keys(k, v, mask, keys.bias, score_mod)


@place.register
def _place_paged(cache: PagedKVCache, mask: Mask, b: int, t: int) -> Step:
  paged_cache.check_cache(cache)
  positions = _positions(cache.lengths, t)
  return Step(cache.lengths, cache_step.new_lengths(mask, b, t), positions,
              positions, cache.max_pages * cache.page_size,
              "[B, N, T, M * Z] (decoding: a paged cache's slots)",
              cache.page_table.shape[0])


def _unsupported(name: str) -> ValueError:
  return ValueError(
      f"{name} is not supported while decoding from a paged cache (its "
      "kernel reads pages block by page and forms no [T, S] array): say a "
      "bias with a score modifier, decode without dropout.")


@write.register
def _write_paged(cache: PagedKVCache, keys: Keys, step: Step,
                 num_heads: int, append: bool = True):
  del num_heads
  if keys.bias is not None:
    raise _unsupported("bias")
  if append:  # (a shared layer reads what another appended)
    cache = paged_cache.append(cache, keys.key, keys.value,
                               new_lengths=step.lengths)
  m = keys.mask  # the layer's, placed at the sequences' positions there
  placed = Mask(causal=True, window=m.window, q_lengths=m.q_lengths,
                kv_lengths=m.kv_lengths, q_segment_ids=m.q_segment_ids,
                kv_segment_ids=m.kv_segment_ids, dense=m.dense, rule=m.rule,
                q_offset=m.q_offset, kv_offset=m.kv_offset)
  return cache, PagedKeys(cache, placed, keys.score_mod)


class PagedKeys(NamedTuple):
  """What the queries attend over after a paged write: the cache's pages
  (read page by page by ``aj.paged_attention``), the layer's mask."""
  cache: PagedKVCache
  mask: Mask
  score_mod: Any = None

  def attend(self, fn, q: jax.Array, options: dict[str, Any]):
    """``aj.paged_attention`` with ``fn``'s kernel choice; refuses what
    a paged step cannot honour, by name."""
    for name in ("dropout_rate", "return_weights"):
      if name in options:
        raise _unsupported(name)
    if not isinstance(fn, attention_fn_lib.Implementation):
      raise ValueError(
          f"attention_fn={fn!r} is a function over keys and values, but a "
          "paged cache's keys and values stay in its pages: give a kernel "
          "(a name such as 'flash', an aj.kernels instance) or None, which "
          "aj.paged_attention runs.")
    result = paged_lib.paged_attention(
        q, self.cache, self.mask, scale=options.get("scale"),
        score_mod=self.score_mod, sinks=options.get("sinks"),
        implementation=fn.implementation,
        return_lse=options.get("return_lse", False),
        return_max_logits=options.get("return_max_logits", False))
    return attention_fn_lib.results(result, options)


class Shared(NamedTuple):
  """Another layer's cache, already written this step, read as this layer's
  keys and values (key/value sharing across layers: Gemma 3n's shared
  layers, cross-layer attention, YOCO): ``place`` finds this call's tokens
  where that layer wrote them and ``write`` writes nothing, so the queries
  attend over exactly what that layer's queries did."""
  cache: KVCache | PagedKVCache


def _written(step_index, mask: Mask, b: int, t: int):
  """Tokens each example held before this step, from the count after it."""
  lengths = cache_step.new_lengths(mask, b, t)
  new = t if lengths is None else jnp.asarray(lengths, jnp.int32)
  return step_index - new


@place.register
def _place_shared(shared: Shared, mask: Mask, b: int, t: int) -> Step:
  cache = shared.cache
  if isinstance(cache, KVCache) and cache.window is not None:
    raise ValueError(
        "a shared layer reads another layer's linear or paged cache; a ring "
        "buffer (init_cache(window=)) has already overwritten the slots "
        "its window forgot, which the sharing layer's own keys may still "
        "see. Give the layer that owns the keys a linear cache.")
  step = place(cache, mask, b, t)  # the cache's checks, its sizes
  index = _written(step.index, mask, b, t)
  positions = _positions(index, t)
  rotary = positions - (step.positions - step.rotary)
  return step._replace(index=index, positions=positions, rotary=rotary)


@write.register
def _write_shared(shared: Shared, keys: Keys, step: Step, num_heads: int):
  cache = shared.cache
  if isinstance(cache, PagedKVCache):
    if keys.bias is not None:
      raise _unsupported("bias")
    _, attended = _write_paged(cache, keys._replace(key=None, value=None),
                               step, num_heads, append=False)
    return shared, attended
  # The keys that layer wrote this step, written again where they are: the
  # same slots, the same mask, nothing changed.
  slots = jnp.clip(step.positions, 0, cache.key.shape[2] - 1)  # [B, T]
  take = lambda x: jnp.take_along_axis(x, slots[:, None, :, None], axis=2)
  again = keys._replace(key=take(cache.key), value=take(cache.value))
  _, attended = _write_linear(cache, again, step, num_heads)
  return shared, attended


def paged_step(k, v, m: Mask | None, cache: PagedKVCache, lengths, *,
               bias, scale, dropout_rate, attention_fn, return_weights,
               return_lse, return_max_logits):
  """A paged decoding step as ``place``/``write``/``attend`` run it, for
  callers that place the tokens themselves (the latent layer): the write,
  and ``attend(q, k, v, m, bias, score_mod, sinks, dropout_rng)`` over the
  pages (the arguments but ``q``, ``score_mod`` and ``sinks`` unused).
  ``v`` None: a cache whose values are its keys (``values_in_keys``)."""
  step = Step(cache.lengths, lengths, None, None, 0, "", 0)
  mask = attention_fn_lib.NO_MASK if m is None else m
  cache, pages = write(cache, Keys(k, v, mask, bias), step, 0)
  fn = attention_fn_lib.as_attention_fn(attention_fn)
  asked = (return_weights, return_lse, return_max_logits)

  def attend(q, k, v, m, bias, score_mod, sinks, dropout_rng):
    del k, v, m, bias
    options = attention_fn_lib.call_options(
        scale=scale, sinks=sinks, dropout_rate=dropout_rate,
        dropout_rng=dropout_rng, asked=asked)
    return pages._replace(score_mod=score_mod).attend(
        fn, q, options).returned(asked)

  return cache, attend
