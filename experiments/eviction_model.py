"""A ``DecoderLM`` decoding over paged caches that evict keys.

Shape glossary: B rows (sequences), T new tokens per row this call, D model
width, N query heads, K key/value heads, H head dim, L slots a row's page
table covers (``max_pages * page_size``), A slots a row keeps.

H2O and SnapKV rank a layer's cached slots by the attention they received
(``aj.paged_key_importance``), which needs the layer's queries of the step:
``decode_with_importance`` runs ``DecoderLM``'s blocks as ``decode`` does
and, per layer, recomputes the rotated queries from the same normed input
with the layer's own projection, qk-norm and rope (``layer_queries``: the
library's own steps, so they are the queries the layer attended with) and
scores the layer's cache after its write (``layer_importance``: the
weights of ``aj.paged_key_importance``, by default computed over each
row's keys gathered from its pages, which is much faster on a CPU for
small pools). Nothing in ``lm_model`` or the layers changes: this module
takes a built ``DecoderLM``.

``evict`` applies each layer's choice (``aj.evict``): every layer's pool
keeps its own slots (H2O and SnapKV score layers apart), and every layer of
a row keeps the same number, so lengths stay equal across layers.

After an eviction a row's slots are fewer than the tokens it has seen; its
next tokens stand at ``positions = lengths + evicted`` (the keys kept their
rotary positions), which ``positions`` builds.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

import attention_jax as aj
from attention_jax.decoding import paged_attention
from attention_jax.decoding import quantize
from attention_jax.layers import attention_fn as attention_fn_lib
from attention_jax.layers import multi_head
from attention_jax.layers import positions as positions_lib
from experiments import lm_model


def positions(seen: jax.Array, t: int) -> jax.Array:
  """int32 ``[B, T]``: the rotary positions of a call's ``T`` new tokens
  for rows that have seen ``seen [B]`` tokens (their lengths plus what was
  evicted)."""
  return (seen[:, None].astype(jnp.int32)
          + jnp.arange(t, dtype=jnp.int32)[None, :])


def layer_queries(attention: aj.MultiHeadAttention, h: jax.Array,
                  rotary: jax.Array) -> jax.Array:
  """``[B, N, T, H]``: the queries ``attention`` computes for its input
  ``h [B, T, D]`` at rotary positions ``rotary [B, T]`` (projected,
  clipped, qk-normed and rotated by the layer's own steps; the keys it
  also projects are dropped)."""
  config = attention._config  # pylint: disable=protected-access
  call = multi_head.Call(h, h, h, positions=rotary)
  call, step = multi_head.check_call(config, call)
  params = attention.params_dict()
  q, k, _ = multi_head.project_inputs(config, params, call)
  if config.qk_norm is not None or config.rope is not None:
    q, _ = positions_lib.normalize_and_rotate(config, params, q, k, call,
                                              step)
  return q


def gathered_keys(cache: aj.PagedKVCache) -> jax.Array:
  """``[B, K, L, H]``: each row's keys read through its page table
  (dequantised; 0 where it holds no page), slot ``p`` at ``p``."""
  keys = cache.key_pages.at[cache.page_table].get(mode="fill",
                                                  fill_value=0)
  if cache.key_scales is not None:  # [B, M, K, Z] scales, per token
    scales = cache.key_scales.at[cache.page_table].get(mode="fill",
                                                       fill_value=0)
    keys = quantize.dequantize(keys, scales)
  b, m, k, z, h = keys.shape  # [B, M, K, Z, H]
  return jnp.swapaxes(keys, 1, 2).reshape(b, k, m * z, h)


def layer_importance(attention: aj.MultiHeadAttention, q: jax.Array,
                     lengths: jax.Array | None, *, last: int | None = None,
                     paged: bool = False) -> jax.Array:
  """float32 ``[B, K, L]``: the attention each slot of ``attention``'s
  paged cache received from the queries ``q [B, N, T, H]`` of the step
  just written (the layer's mask, scale, sinks and kernel); ``last``: only
  each row's last ``last`` real queries.

  ``paged=True`` runs ``aj.paged_key_importance`` over the pages. The
  default gathers each row's keys (``gathered_keys``) and runs
  ``aj.key_importance`` over them with the same mask at the same slots
  (``paged_attention.placed_mask``): the same weights (a test compares
  them), much faster on a CPU for a pool this small (the paged call's
  gradient is a ``[P, K, Z, B]`` pool per row: ~0.7 s a call at B = 32,
  where this takes ~10 ms).
  """
  config = attention._config  # pylint: disable=protected-access
  cache = attention._paged()  # pylint: disable=protected-access
  mask = aj.Mask(causal=True, q_lengths=lengths)
  if attention.mask is not None:
    mask = attention.mask & mask
  params = attention.params_dict()
  sinks = params["sinks"]["logits"] if "sinks" in params else None
  fn = config.attention_fn
  implementation = (fn.implementation if isinstance(
      fn, attention_fn_lib.Implementation) else None)
  if paged:
    return aj.paged_key_importance(
        q, cache, mask, scale=config.scale, sinks=sinks,
        implementation=implementation, last=last)
  placed = paged_attention.placed_mask(mask, cache.lengths, q.shape[2])
  return aj.key_importance(
      q, gathered_keys(cache), placed, scale=config.scale, sinks=sinks,
      implementation=implementation, last=last,
      per_kv_head=True).astype(jnp.float32)


def decode_with_queries(model: lm_model.DecoderLM, tokens: jax.Array,
                        lengths: jax.Array | None, rotary: jax.Array
                        ) -> tuple[jax.Array, list[jax.Array]]:
  """``model.decode(tokens, lengths, positions=rotary)`` and each layer's
  queries ``[B, N, T, H]`` (``layer_queries`` of the block's normed
  input): the logits equal ``model.decode``'s."""
  x = model.embed(tokens)
  queries = []
  for block in model.blocks:
    h = block.norm1(x)
    x, _ = block(x, decode=True, lengths=lengths, positions=rotary)
    queries.append(layer_queries(block.attention, h, rotary))
  return model._logits(x), queries  # pylint: disable=protected-access


def decode_with_importance(model: lm_model.DecoderLM, tokens: jax.Array,
                           lengths: jax.Array | None, rotary: jax.Array, *,
                           last: int | None = None, paged: bool = False
                           ) -> tuple[jax.Array, list[jax.Array]]:
  """``model.decode(tokens, lengths, positions=rotary)`` and each layer's
  key importance.

  Args:
    model: a ``DecoderLM`` with a paged cache (``init_paged_cache``).
    tokens: int ``[B, T]``.
    lengths: int ``[B]``: real tokens each row appends (0: idle), or None
      (all ``T``).
    rotary: int ``[B, T]``: the new tokens' rotary positions
      (``positions(lengths_before + evicted, T)``).
    last: count only each row's last ``last`` real queries (SnapKV's
      observation window); None: all (H2O).
    paged: ``layer_importance``'s.

  Returns:
    ``(logits [B, T, V], [float32 [B, K, L] per layer])``: the logits equal
    ``model.decode``'s; each layer's slots' importance from this call's
    queries (0 past a row's length).
  """
  logits, queries = decode_with_queries(model, tokens, lengths, rotary)
  return logits, [
      layer_importance(block.attention, q, lengths, last=last, paged=paged)
      for block, q in zip(model.blocks, queries)]


def evict(model: lm_model.DecoderLM,
          choices: Sequence[tuple[jax.Array, jax.Array]]) -> jax.Array:
  """Applies one ``(source, count)`` per layer (``aj.evict``); int32
  ``[B]``: the slots each row dropped (the same in every layer: the counts
  must agree across layers, which every ``aj.*_keep`` of one budget
  gives)."""
  if len(choices) != len(model.blocks):
    raise ValueError(f"evict needs one (source, count) per layer: "
                     f"{len(model.blocks)}, got {len(choices)}.")
  dropped = None
  for block, (source, count) in zip(model.blocks, choices):
    box = []

    def apply(cache, source=source, count=count, box=box):
      cache, evicted = aj.evict(cache, source, count)
      box.append(evicted)
      return cache

    block.attention.update_paged_cache(apply)
    dropped = box[0] if dropped is None else dropped
  return dropped


def lengths(model: lm_model.DecoderLM) -> jax.Array:
  """int32 ``[B]``: the slots each row holds (the first layer's; every
  layer holds as many)."""
  return model.blocks[0].attention.cache_index[...]
