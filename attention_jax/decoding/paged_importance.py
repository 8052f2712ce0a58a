"""Key importance over a paged cache: the attention each cached slot received.

Shape glossary: B sequences, N query heads, K key/value heads, T new tokens
(queries) per sequence, Z tokens per page, M pages a sequence may hold, P
pages in the pool, H key head dim.

``paged_key_importance`` is ``attention.importance.key_importance`` for
``aj.paged_attention``'s step (it lives here because it reads a
``PagedKVCache``, which the attention layer below does not know): the
column sums of each sequence's softmax, as the vector-Jacobian product of
the paged call with respect to a value pool of ones, read back through the
page tables. One forward and one backward pass of the paged kernel.

The value pool is ``[P, K, Z, B]``: one column per sequence, and sequence
``b``'s cotangent is 1 on its own column only. A page several sequences
hold (``share_prefix``) receives every holder's attention in the pool's
gradient; the columns keep them apart, so each sequence reads its own mass
(a pool of width 1 would give a shared page their sum). The price is a
value head dim of ``B`` in the kernel's ``P V`` and ``P^T dO`` products
(beside ``Q K^T``'s ``H``) and a ``[P, K, Z, B]`` float32 gradient.
The cache's values are never read: the weights depend on the keys alone,
so a quantised cache (its keys dequantised per page as usual) and a
``values_in_keys`` cache (MLA's latent) are scored alike.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
import numpy as np

from attention_jax.attention import dot_product
from attention_jax.attention import importance
from attention_jax.core import checks
from attention_jax.decoding import paged_attention
from attention_jax.decoding import paged_cache
from attention_jax.kernels import base
from attention_jax.masking import mask as mask_lib


def paged_key_importance(
    query: ArrayLike,
    cache: paged_cache.PagedKVCache,
    mask: mask_lib.Mask | None = None,
    *,
    scale: float | ArrayLike | None = None,
    score_mod: Any = None,
    sinks: ArrayLike | None = None,
    implementation: Any = None,
    last: int | None = None,
) -> jax.Array:
  """The attention each sequence's cached slots received from its queries.

  For sequence ``b``, key/value head ``k`` and position ``p`` of the
  sequence (its slot ``p % Z`` of page ``page_table[b, p // Z]``): the sum
  over the counted query rows and the ``N / K`` query heads of head ``k``
  of ``aj.paged_attention``'s weights at that position (H2O's accumulated
  score is the sum of these over decoding steps; SnapKV's the prompt's
  last rows, ``last``).

  Args:
    query: float ``[B, N, T, H]``: the step's queries, as
      ``aj.paged_attention`` takes them (after ``paged_cache.append``).
    cache: the ``PagedKVCache`` after that write; quantised and
      ``values_in_keys`` caches included (values are not read).
    mask, scale, score_mod, sinks, implementation: as
      ``aj.paged_attention`` (the mask placed at the sequences' positions).
      A kernel that needs the value head dim to be a power of two >= 16
      (``"paged_gpu"`` compiled for a GPU) refuses the pool of ``B``
      columns; the automatic choice then runs flash.
    last: None (every real query row counts) or a positive int: the last
      ``last`` real rows of each sequence (``q_lengths - last <= i <
      q_lengths`` with the mask's ``q_lengths``, else the last ``last`` of
      ``T``).

  Returns:
    float32 ``[B, K, M * Z]`` (float64 for float64 queries and pages),
    indexed by position in the sequence: 0 past its length and where it
    holds no page. Each counted row that sees a slot adds a total of ``N /
    K`` per head (less with sinks). A page shared by several sequences
    gives each its own mass (see the module docstring).

  Raises:
    TypeError: ``last`` not an int; and what ``aj.paged_attention``
      raises.
    ValueError: ``last`` not positive; and ``aj.paged_attention``'s.

  Example:
    >>> c = aj.init_paged_cache(8, 4, 1, 16, batch_size=2, max_pages=4)
    >>> kv = jnp.ones((2, 1, 6, 16))
    >>> c = aj.paged_cache.append(c, kv, kv, new_lengths=jnp.array([6, 3]))
    >>> q = jnp.ones((2, 4, 6, 16))
    >>> m = aj.Mask(causal=True, q_lengths=jnp.array([6, 3]))
    >>> score = aj.paged_key_importance(q, c, m, last=2)
    >>> score.shape, score.sum(-1).tolist()  # 2 rows x 4 heads per row
    ((2, 1, 16), [[8.0], [8.0]])
  """
  paged_cache.check_cache(cache)
  importance.check_last(last)
  checks.check_float_array("query", query)
  checks.check_rank("query", query, (4,), "[B, N, T, H]")
  t = np.shape(query)[-2]
  placed = paged_attention.placed_mask(mask, cache.lengths, t)
  p, k, z = cache.key_pages.shape[:3]
  b = cache.page_table.shape[0]
  keys = (jnp.float32 if cache.key_scales is not None
          else cache.key_pages.dtype)  # what the kernel reads them as
  dtype = checks.compute_dtype(jnp.result_type(query), keys)
  ones = jnp.ones((p, k, z, b), dtype)  # a column per sequence

  def attend(value_pages):
    pages = base.Pages(cache.key_pages, value_pages, cache.page_table,
                       cache.key_scales, None, paged_cache.all_finite(cache))
    out, *_ = dot_product.run(
        query, None, None, placed, scale=scale, score_mod=score_mod,
        sinks=sinks, implementation=implementation, pages=pages)
    return out

  out, pullback = jax.vjp(attend, ones)  # out [B, N, T, B]
  rows = importance.counted_rows(t, last, placed.q_lengths, 2)  # [B|1, N|1, T]
  own = jnp.eye(b, dtype=bool)[:, None, None, :]  # [B, 1, 1, B]: b's column
  cotangent = (rows[..., None] & own).astype(out.dtype)
  (d_pool,) = pullback(jnp.broadcast_to(cotangent, out.shape))
  # Sequence b's column, read through its page table ([M] pages; P: none).
  per_row = jax.vmap(lambda d, row: d.at[row].get(mode="fill", fill_value=0))
  slots = per_row(jnp.moveaxis(d_pool, -1, 0), cache.page_table)  # [B,M,K,Z]
  return jnp.swapaxes(slots, 1, 2).reshape(b, k, -1)
