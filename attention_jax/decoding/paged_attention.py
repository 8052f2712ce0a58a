"""Attention over a paged KV cache, read page by page.

Shape glossary: B sequences, N query heads, K key/value heads, T new tokens
(queries) per sequence, Z tokens per page, M pages a sequence may hold, P
pages in the pool, H (Hv) key (value) head dim.

``paged_attention`` is a decoding step's attention after
``paged_cache.append``: each sequence's queries are its newest tokens and
attend over everything it holds, read from the pool through its page
table. The layer's mask (causal, window, rule, ``q_lengths`` for ragged new
tokens) is placed at the sequences' positions, as a linear cache places it
(``cache_step``): query ``i`` of sequence ``b`` stands at position
``lengths[b] - new[b] + i``, key slot ``p`` at ``p``, and nothing past
``lengths[b]`` is seen. The call reaches the kernels as one record
(``kernels.base.Pages`` in the ``Problem``): the flash kernel declares
pages and loads whole pages per key block; a kernel that does not is refused
by name.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
import numpy as np

from attention_jax.attention import dot_product
from attention_jax.core import checks
from attention_jax.decoding import cache_step
from attention_jax.decoding import paged_cache
from attention_jax.kernels import base
from attention_jax.masking import mask as mask_lib


def placed_mask(mask: mask_lib.Mask | None, lengths, t: int):
  """The layer's mask at a paged cache's positions (see the module doc).

  ``lengths [B]`` are the sequences' lengths after this call's write; the
  mask's ``q_lengths [B]`` (if any) their real new tokens, else all ``T``.
  """
  mask = mask_lib.Mask() if mask is None else _check_mask(mask)
  # The linear cache's refusals; a selection of key blocks (one row for
  # every query) passes: its blocks are the slots', which the walk then
  # reads alone (slot p is position p: no kv_offset).
  cache_step.check_unplaced(mask, key_selection=True)
  keys_chosen = mask_lib.key_only(mask.rule)
  if mask.kv_lengths is not None:
    raise ValueError(
        "the mask gives kv_lengths, but a paged cache's lengths say how "
        "many keys each sequence holds: drop them from the mask.")
  lengths = jnp.asarray(lengths, jnp.int32)
  new = cache_step.new_lengths(mask, lengths.shape[0], t)
  new = jnp.int32(t) if new is None else new
  return mask_lib.Mask(
      causal=mask.causal, window=mask.window, q_lengths=mask.q_lengths,
      kv_lengths=lengths, dense=mask.dense,
      rule=mask.rule if keys_chosen else mask_lib.rule_function(mask.rule),
      q_offset=lengths - new,
      kv_offset=None if keys_chosen else jnp.zeros_like(lengths))


def _check_mask(mask: Any) -> mask_lib.Mask:
  """A ``Mask``, else a TypeError saying which one to write instead."""
  if isinstance(mask, mask_lib.Mask):
    return mask
  if isinstance(mask, (mask_lib.BlockMask, mask_lib.MaskRule)):
    fix = ("a rule goes in a Mask, at the sequences' positions: "
           "mask=aj.Mask(rule=mask)")
  elif callable(mask) and not hasattr(mask, "shape"):
    fix = ("a rule function goes in a Mask, at the sequences' positions: "
           "mask=aj.Mask(rule=mask_fn)")
  elif hasattr(mask, "shape") or isinstance(mask, (list, tuple)):
    fix = ("a dense array cannot be placed over a paged cache's slots (its "
           "kernels read pages and form no [T, M * Z] array): say it with "
           "the Mask's fields (causal, window, q_lengths), a rule "
           "(aj.Mask(rule=...)) or a score modifier")
  else:
    fix = "e.g. mask=aj.Mask(causal=True, q_lengths=new_tokens)"
  raise TypeError(
      f"mask must be an aj.Mask (placed at each sequence's positions) or "
      f"None, got {type(mask).__name__}{_shape(mask)}: {fix}.")


def _shape(x) -> str:
  return f" with shape {np.shape(x)}" if hasattr(x, "shape") else ""


def paged_attention(
    query: ArrayLike,
    cache: paged_cache.PagedKVCache,
    mask: mask_lib.Mask | None = None,
    *,
    scale: float | ArrayLike | None = None,
    score_mod: Any = None,
    sinks: ArrayLike | None = None,
    implementation: Any = None,
    return_lse: bool = False,
    return_max_logits: bool = False,
) -> jax.Array | tuple[jax.Array, ...]:
  """Each sequence's newest tokens attend over what its pages hold.

  Args:
    query: float ``[B, N, T, H]``: the queries of the ``T`` tokens just
      written with ``paged_cache.append`` (right-padded when the mask's
      ``q_lengths`` says how many are real).
    cache: the ``PagedKVCache`` after that write (``K`` dividing ``N``:
      grouped-query attention).
    mask: an ``aj.Mask`` or None: the layer's mask (``causal``,
      ``window``, a rule, ``q_lengths``), placed at the sequences'
      positions; no positions, ``kv_lengths`` or segment ids (the cache
      gives them). Another value (an array, a bare rule) is a TypeError
      naming the Mask to write.
    implementation: as in sdpa; a kernel that does not read pages
      (``"flash"``, ``"paged_gpu"`` and ``"paged_tpu"`` do) is refused by
      name.

  Other arguments (scale, score_mod, sinks, return_lse,
  return_max_logits): as ``aj.scaled_dot_product_attention``
  (docs/options.md); a score modifier and a rule see positions in the
  sequence. No bias, ``is_causal`` (the mask's ``causal``), dropout or
  weights.

  Returns:
    ``[B, N, T, Hv]`` (``H`` for a cache whose values are its keys), then
    lse and max_logits as asked for. A sequence
    with no tokens (length 0) gets output 0 and lse ``-inf``; rows past
    ``q_lengths`` are not meaningful.

  Example:
    >>> c = aj.init_paged_cache(8, 4, 1, 16, batch_size=2, max_pages=4)
    >>> kv = jnp.ones((2, 1, 6, 16))
    >>> c = aj.paged_cache.append(c, kv, kv, new_lengths=jnp.array([6, 3]))
    >>> q = jnp.ones((2, 4, 6, 16))
    >>> out = aj.paged_attention(q, c, aj.Mask(causal=True,
    ...                          q_lengths=jnp.array([6, 3])))
    >>> out.shape
    (2, 4, 6, 16)
  """
  paged_cache.check_cache(cache)
  t = np.shape(query)[-2] if np.ndim(query) >= 2 else 0
  checks.check_min_rank("query", query, 2, "[B, N, T, H]")
  placed = placed_mask(mask, cache.lengths, t)
  in_keys = cache.value_pages is None  # values_in_keys: the keys are values
  pages = base.Pages(
      cache.key_pages, cache.key_pages if in_keys else cache.value_pages,
      cache.page_table, cache.key_scales,
      cache.key_scales if in_keys else cache.value_scales,
      paged_cache.all_finite(cache))
  out, _, lse, max_logits = dot_product.run(
      query, None, None, placed, scale=scale, score_mod=score_mod,
      sinks=sinks, implementation=implementation, return_lse=return_lse,
      return_max_logits=return_max_logits, pages=pages)
  extra = (lse,) * bool(return_lse) + (max_logits,) * bool(
      return_max_logits)
  return (out, *extra) if extra else out
