"""MoBA: Mixture of Block Attention (Lu et al. 2025, Moonshot AI).

Shape glossary: B batch, N query heads, K key/value heads (G = N / K query
heads per key/value head), T queries, S keys, H head dim, Hv value head dim;
``c`` the keys of a MoBA block (``block``; the axis ``C`` in einsums),
nks = ceil(S / c) key blocks (the axis ``M``), ``m`` a key block's index.

Keys are cut into blocks of ``c`` positions. Query ``t`` (at position
``p``) scores key block ``m`` by the gate ``q_t . mean(K_m)`` (its query
head's key/value head's keys), and attends only to the ``top_k`` blocks of
highest gate among those it may see: its own block ``p // c`` is always one
of them (causal inside it), a future block never is, and the ``top_k - 1``
others are the best past blocks (ties to the lower block index). Nothing
is learned: the gate reads the queries and keys the attention reads, and the
choice is not differentiated (gradients flow through the attention over the
chosen keys only).

The gate is computed blockwise: the block means ``[B, K, nks, H]``, then
gate scores ``[B, N, T, nks]`` (``T * S / c`` numbers, never ``[T, S]``),
chosen blocks by ``aj.top_k_mask``; ``aj.select_blocks`` turns them into a
``BlockMask`` that intersects the causal mask, so the flash kernel walks
only the chosen blocks and the dense kernel evaluates the choice exactly.

Query blocks (``query_block = g > 1``, not in the paper): rows of ``g``
consecutive queries share one choice, scored by the row's mean query (the
mean of its queries' gates: ``mean(q) . mean(K_m)``, over its real
queries), its own block always, then the best past blocks. A row lies in
one key block (``g`` divides ``block`` and ``S - T``), so every kernel
block a row's queries share is read wholly or not at all: the flash walk
visits exactly the chosen blocks (cost in proportion to ``top_k``), where
per-query choices make a kernel block of queries visit the union of their
choices (docs/performance.md). A decoding step, one query, is refused:
its row's mean needs the row's other queries.

Where keys stand: a key's block is its position ``// c``; positions are the
key columns ``0..S-1`` unless the mask gives them (``kv_offset``: a
KV-cache decoding step, where the layer places its queries at
``q_offset``), and query ``i`` stands at ``i + S - T`` (bottom-right: a
chunk of queries over a longer prefix) unless the mask places it. Padding
never enters the gate: a block's mean is over its real keys only (those
below ``kv_lengths``, those a key-padding ``dense`` mask keeps, positions
inside ``[0, S)``), so a padded example chooses as its tokens alone would,
and a block holding no real key is never chosen (a block cannot be chosen
for keys it does not have); a query's own block is chosen in any case (the
paper's rule; attention inside it is masked as usual).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.attention import dot_product
from attention_jax.core import checks
from attention_jax.core import traced_checks
from attention_jax.masking import mask as mask_lib
from attention_jax.masking import selection
from attention_jax.masking.mask import Mask
from attention_jax.masking.mask import MaskRule

# The largest flash blocks the defaults pick: rows of a query block are
# united (each query chooses its own blocks), so a larger one walks more.
# Rows of query_block queries choose together: their kernel blocks are
# read wholly or not at all, and the causal call's key block serves.
_MAX_BLOCK_Q = 128
_MAX_BLOCK_K = 128
_MAX_ROWS_BLOCK_K = 256


def _check_operands(q, k, v) -> None:
  for name, x, layout in (("q", q, "[B, N, T, H]"), ("k", k, "[B, K, S, H]"),
                          ("v", v, "[B, K, S, Hv]")):
    if np.ndim(x) != 4:
      raise ValueError(f"moba_attention's {name} must be {layout}, got shape "
                       f"{list(np.shape(x))}.")
  (b, n, _, h), (bk, kh, s, hk) = q.shape, k.shape
  if bk != b or v.shape[:3] != k.shape[:3] or hk != h or n % kh:
    raise ValueError(
        f"moba_attention takes q [B, N, T, H], k [B, K, S, H], v [B, K, S, "
        f"Hv] with K dividing N; got q {list(q.shape)}, k {list(k.shape)}, "
        f"v {list(v.shape)}.")
  del s


def _check_sizes(block, top_k, query_block=1) -> None:
  checks.check_positive_int("block", block)
  checks.check_positive_int("top_k", top_k)
  checks.check_positive_int("query_block", query_block)
  if block % query_block:
    raise ValueError(
        f"query_block={query_block} must divide block={block}: a row of "
        "queries sharing one choice must lie inside one key block (its own "
        "block). Pick a divisor of block, or query_block=1.")


def _as_causal_mask(mask, is_causal: bool) -> Mask:
  """The call's mask, causal, holding only what MoBA's gate can honour."""
  if mask is not None and not isinstance(mask, Mask):
    if isinstance(mask, (mask_lib.BlockMask, MaskRule)):
      raise ValueError(
          "mask is a rule (a BlockMask or MaskRule), but MoBA's block "
          "selection is the mask's rule: a second rule would be intersected "
          "with it unseen by the gate. Give the other fields as an aj.Mask "
          "(causal, kv_lengths, a key-padding dense mask).")
    raise TypeError(
        f"moba_attention's mask must be an aj.Mask or None (causal), got "
        f"{type(mask).__name__}; a key-padding array goes in as "
        "aj.Mask(causal=True, dense=keep[:, None, None, :]).")
  mask = Mask(causal=True) if mask is None else mask
  if is_causal:
    mask = mask & Mask(causal=True)
  if not mask.causal:
    raise ValueError(
        f"MoBA is defined for causal attention (a query's own block is "
        f"causal inside, future blocks are never chosen), but the mask is "
        f"not causal: {mask!r}. Pass mask=None, aj.Mask(causal=True, ...) or "
        "is_causal=True. (A ring-buffer KV cache, init_cache(window=), "
        "hands a non-causal visibility mask over its slots: decode MoBA "
        "with a linear cache.)")
  refused = (
      ("window", mask.window, "MoBA chooses among all past blocks; a "
       "window would hide blocks the gate chose: drop the window"),
      ("q_segment_ids", mask.q_segment_ids, "the gate's blocks span "
       "documents and would choose blocks the segment ids then hide: run "
       "documents apart"),
      ("rule", mask.rule, "MoBA's block selection is the mask's rule, and "
       "a mask holds one: express the other rule's keys as kv_lengths or a "
       "key-padding dense mask, or apply MoBA without it"),
  )
  for name, value, why in refused:
    if value is not None:
      raise ValueError(f"the mask holds {name}, which moba_attention does "
                       f"not support: {why}.")
  if mask.dense is not None:
    dense = np.shape(mask.dense)
    if len(dense) > 4 or (len(dense) >= 2 and dense[-2] != 1):
      raise ValueError(
          f"the mask's dense array has shape {list(dense)}; moba_attention "
          "reads a dense mask as key padding ([B|1, N|1, 1, S]: the keys "
          "every query of the example may see), which the gate honours: "
          "a mask that differs between queries would hide blocks the gate "
          "chose. Give key padding as kv_lengths or a [B, 1, 1, S] dense "
          "mask.")
  return mask


def _two_dims(name: str, x, b: int, n: int) -> jax.Array:
  """A per-example (``[B]``) or per-head (``[B, N]``) mask field, or a
  scalar, as ``[B|1, N|1]`` int32 (left-aligned, as the mask reads it)."""
  x = jnp.asarray(x, jnp.int32)
  if x.ndim > 2:
    raise ValueError(f"the mask's {name} has shape {list(x.shape)}; "
                     "moba_attention reads a scalar, [B] or [B, N].")
  x = jnp.reshape(x, x.shape + (1,) * (2 - x.ndim))
  if x.shape[0] not in (1, b) or x.shape[1] not in (1, n):
    raise ValueError(f"the mask's {name} has shape {list(x.shape)}, which "
                     f"does not fit B={b}, N={n}.")
  return x


def _key_columns(mask: Mask, b: int, n: int, s: int) -> jax.Array:
  """bool ``[B, 1|N, S]``: the key columns that are real (below
  ``kv_lengths``, kept by a key-padding dense mask)."""
  valid = jnp.ones((1, 1, s), bool)
  if mask.kv_lengths is not None:
    lengths = _two_dims("kv_lengths", mask.kv_lengths, b, n)
    valid = valid & (jnp.arange(s)[None, None, :] < lengths[..., None])
  if mask.dense is not None:
    dense = jnp.asarray(mask.dense) != 0
    dense = jnp.reshape(dense, (1,) * (4 - dense.ndim) + dense.shape)
    valid = valid & dense[:, :, 0, :]  # [B|1, N|1, S|1]
  heads = n if valid.shape[1] > 1 else 1
  return jnp.broadcast_to(valid, (b, heads, s))


def _at_positions(k, valid, kv_offset):
  """Keys and their validity by position ``p`` in ``[0, S)``: column ``p -
  kv_offset`` (keys at negative positions, a left-padded cache's pads,
  belong to no block; columns past ``S`` are not real)."""
  b, s = k.shape[0], k.shape[2]
  off = jnp.asarray(kv_offset, jnp.int32)
  if off.ndim and (off.ndim > 2 or (off.ndim == 2 and off.shape[1] > 1)):
    raise ValueError(
        f"the mask's kv_offset has shape {list(off.shape)}; moba_attention "
        "reads one key placement per example (a scalar or [B]): the block "
        "means are per key/value head.")
  off = jnp.broadcast_to(jnp.reshape(off, (-1, 1))[:, :1], (b, 1))  # [B, 1]
  try:
    concrete = np.asarray(off)
  except jax.errors.TracerArrayConversionError:
    traced_checks.traced_check(
        jnp.all(off <= 0), "moba_attention's kv_offset must be <= 0 (keys "
        "at positions past S would belong to no block); got {kv_offset}",
        kv_offset=off[:, 0])
  else:
    if (concrete > 0).any():
      raise ValueError(
          f"the mask's kv_offset is {concrete[:, 0].tolist()}; "
          "moba_attention takes kv_offset <= 0 (a left-padded cache's "
          "-pads): the key blocks cover positions [0, S), and keys placed "
          "past S would belong to no block.")
    if not concrete.any():
      return k, valid
  column = jnp.arange(s)[None, :] - off  # [B, S]: the column at position p
  inside = (column >= 0) & (column < s)
  column = jnp.clip(column, 0, s - 1)
  k = jnp.take_along_axis(k, column[:, None, :, None], axis=2)  # [B, K, S, H]
  valid = jnp.take_along_axis(valid, column[:, None, :], axis=2)
  return k, valid & inside[:, None, :]  # [B, 1|N, S]


def _query_positions(mask: Mask, b: int, n: int, t: int, s: int):
  """int32 ``[B|1, N|1, T]``: each query's position."""
  if mask.positioned:
    q_offset = 0 if mask.q_offset is None else mask.q_offset
    start = _two_dims("q_offset", q_offset, b, n)
  else:
    start = jnp.full((1, 1), s - t, jnp.int32)  # bottom-right
  return start[..., None] + jnp.arange(t, dtype=jnp.int32)[None, None, :]


def _real_queries(mask: Mask, b: int, n: int, t: int) -> jax.Array:
  """bool ``[B|1, N|1, T]``: the queries below ``q_lengths`` (all without)."""
  if mask.q_lengths is None:
    return jnp.ones((1, 1, t), bool)
  lengths = _two_dims("q_lengths", mask.q_lengths, b, n)
  return jnp.arange(t)[None, None, :] < lengths[..., None]


def _row_queries(q, mask: Mask, query_block: int):
  """``(mean query [B, N, nqs, H], bool [B|1, N|1, nqs]: rows holding a
  real query)``: each row's mean over its real queries (padding, which
  may hold anything, is zeroed, not weighted by 0)."""
  (b, n, t, h), g = q.shape, query_block
  nqs = -(-t // g)
  real = _real_queries(mask, b, n, t)  # [B|1, N|1, T]
  pad = ((0, 0), (0, 0), (0, nqs * g - t))
  real = jnp.pad(real, pad)
  q = jnp.where(real[..., None], jnp.pad(q, pad + ((0, 0),)), 0)
  count = real.reshape(real.shape[:2] + (nqs, g)).sum(-1)  # [B|1, N|1, nqs]
  sums = q.reshape(b, n, nqs, g, h).sum(-2)  # [B, N, nqs, H]
  return sums / jnp.maximum(count, 1)[..., None].astype(q.dtype), count > 0


def gate_scores(q, k, mask: Mask | None = None, *, block: int,
                query_block: int = 1) -> jax.Array:
  """MoBA's gate ``[B, N, nqs, nks]``: ``q_t . mean(K_m)`` over each
  block's real keys, ``+inf`` at a query's own block, ``-inf`` at future
  blocks and at blocks with no real key (never chosen). Not
  differentiated.

  Args:
    q: ``[B, N, T, H]`` queries; k: ``[B, K, S, H]`` keys.
    mask: a causal ``aj.Mask`` (None: causal): its positions, ``kv_lengths``
      and key-padding ``dense`` array place and pad the keys.
    block: ``c``, the keys per block.
    query_block: ``g``, queries per row (``nqs = ceil(T / g)`` rows; 1: a
      row per query, the paper's gate): a row scores blocks by its mean
      real query (below ``q_lengths``); a row with none chooses only its
      own block. ``g`` divides ``block`` and ``S - T``; no positions.
  """
  _check_sizes(block, 1, query_block)
  mask = _as_causal_mask(mask, False)
  (b, n, t, _), (_, kh, s, _) = q.shape, k.shape
  g, nks = n // kh, -(-s // block)
  _check_rows(query_block, mask, t, s)
  dtype = checks.compute_dtype(q, k)
  q, k = (jax.lax.stop_gradient(jnp.asarray(x, dtype)) for x in (q, k))
  positions = _query_positions(mask, b, n, t, s)  # [B|1, N|1, T]
  if query_block > 1:  # a row's mean query, placed at its first query
    q, rows_real = _row_queries(q, mask, query_block)  # [B, N, nqs, H]
    positions = positions[..., ::query_block]
    t = q.shape[2]
  valid = _key_columns(mask, b, n, s)  # [B, 1|N, S]
  if mask.kv_offset is not None:
    k, valid = _at_positions(k, valid, mask.kv_offset)
  # Padding may hold anything (NaN too): it is zeroed, not weighted by 0.
  k = jnp.where(valid.any(1)[:, None, :, None], k, 0)
  pad = nks * block - s
  k = jnp.pad(k, ((0, 0), (0, 0), (0, pad), (0, 0)))
  k = k.reshape(b, kh, nks, block, -1)  # [B, K, nks, c, H]
  weights = jnp.pad(valid, ((0, 0), (0, 0), (0, pad))).astype(dtype)
  weights = weights.reshape(b, -1, nks, block)  # [B, 1|N, nks, c]
  count = weights.sum(-1)  # [B, 1|N, nks]
  qg = q.reshape(b, kh, g, t, -1)  # [B, K, G, T, H]
  if weights.shape[1] == 1:  # one set of real keys for every head
    sums = jnp.einsum("BMC,BKMCH->BKMH", weights[:, 0], k)
    means = sums / jnp.maximum(count, 1)[:, :, :, None]  # [B, K, nks, H]
    gate = jnp.einsum("BKGTH,BKMH->BKGTM", qg, means)
  else:  # per query head: [B, K, G, nks, H]
    weights = weights.reshape(b, kh, g, nks, block)
    sums = jnp.einsum("BKGMC,BKMCH->BKGMH", weights, k)
    means = sums / jnp.maximum(count, 1).reshape(b, kh, g, nks, 1)
    gate = jnp.einsum("BKGTH,BKGMH->BKGTM", qg, means)
  gate = gate.reshape(b, n, t, nks)  # [B, N, T|nqs, nks]
  own = (positions // block)[..., None]
  blocks = jnp.arange(nks)[None, None, None, :]  # [1, 1, 1, nks]
  empty = (count == 0)[:, :, None, :]  # [B, 1|N, 1, nks]
  # A gate that is not a number (NaN queries on a padded row) chooses
  # nothing rather than poisoning the top-k.
  gate = jnp.where(jnp.isnan(gate) | (blocks > own) | empty, -jnp.inf, gate)
  if query_block > 1:  # a row of padding alone: its own block only
    gate = jnp.where(rows_real[..., None], gate, -jnp.inf)
  return jnp.where(blocks == own, jnp.inf, gate)


def _check_rows(query_block: int, mask: Mask, t: int, s: int) -> None:
  """Rows of ``query_block`` queries must each lie in one key block."""
  if query_block == 1:
    return
  if mask.positioned:
    raise ValueError(
        f"query_block={query_block} chooses per row of {query_block} "
        "queries by their mean, but the mask places its queries "
        "(q_offset/kv_offset: a KV-cache decoding step), whose rows the "
        "call does not hold whole. Train and prefill with query_block; "
        "decode with query_block=1.")
  if (s - t) % query_block:
    raise ValueError(
        f"query_block={query_block} must divide S - T = {s} - {t} (queries "
        "stand bottom-right, at i + S - T): a row of queries must start at "
        "a multiple of query_block to lie inside one key block.")


@dataclasses.dataclass(frozen=True)
class _ChosenAtPositions:
  """The selection as a rule over positions (a mask that places its rows
  cannot hold a BlockMask): query position ``q`` reads key position ``kv``
  iff row ``q - q_offset`` chose block ``kv // block``."""
  block: int
  blocks: int

  def __call__(self, b, h, q_idx, kv_idx, params):
    chosen, q_offset = params  # [B, N, T, nks], [B|1, N|1]
    at = (b if q_offset.shape[0] > 1 else jnp.zeros_like(b),
          h if q_offset.shape[1] > 1 else jnp.zeros_like(h))
    # Padded kernel rows (past T) clip: their outputs are dropped.
    row = jnp.clip(q_idx - q_offset[at], 0, chosen.shape[2] - 1)
    col = kv_idx // self.block
    inside = (kv_idx >= 0) & (col < self.blocks)
    return inside & chosen[b, h, row, jnp.clip(col, 0, self.blocks - 1)]


def _default_block_k(block: int, most: int = _MAX_BLOCK_K) -> int:
  """The largest divisor of ``block`` up to ``most`` (a flash key block
  lies in one MoBA block); ``block`` itself when that divisor is below
  16."""
  best = max(d for d in range(1, min(block, most) + 1) if block % d == 0)
  return best if best >= 16 or best == block else block


def moba_selection(q, k, mask: Mask | None = None, *, block: int,
                   top_k: int, query_block: int = 1) -> jax.Array:
  """bool ``[B, N, nqs, nks]``: the key blocks each row of queries reads
  (its own block and the ``top_k - 1`` past blocks of highest gate; see
  ``gate_scores``; ``nqs = T`` with ``query_block=1``)."""
  _check_sizes(block, top_k, query_block)
  return selection.top_k_mask(
      gate_scores(q, k, mask, block=block, query_block=query_block), top_k)


def moba_attention(q, k, v, mask: Mask | None = None, *, block: int,
                   top_k: int, scale: Any = None, implementation: Any = None,
                   block_q: int | None = None, block_k: int | None = None,
                   query_block: int = 1, **options):
  """MoBA: causal attention over each query's ``top_k`` gated key blocks.

  Args:
    q: ``[B, N, T, H]`` queries (rotary positions applied, as the layers
      do before attention).
    k: ``[B, K, S, H]`` keys, ``K`` dividing ``N``; v: ``[B, K, S, Hv]``.
    mask: an ``aj.Mask`` that is causal (None: causal), optionally with
      ``q_lengths``, ``kv_lengths`` and a key-padding ``dense`` mask
      ``[B|1, N|1, 1, S]`` (both kept out of the gate), and positions
      (``q_offset``/``kv_offset <= 0``: a KV-cache step). Refused: a
      non-causal mask, a window, segment ids, a rule.
    block: ``c``, the keys per MoBA block (the paper: 512 to 4096).
    top_k: blocks per query, its own block included (the paper: 3).
    scale: the logits' scale (default ``1 / sqrt(H)``). The gate is the
      paper's plain dot product, unscaled (a positive scale ranks the
      blocks the same).
    implementation: the kernel (``"dense"``: the choice evaluated exactly;
      ``"flash"``: walks only the chosen blocks; None: automatic).
    block_q, block_k: the blockwise kernels' blocks when no positions are
      given (default ``min(block, 128)`` queries and the largest divisor of
      ``block`` up to 128 keys; with ``query_block``, ``aj.select_blocks``'
      rows and up to 256 keys); ``block_k`` divides ``block``.
    query_block: ``g``, queries that share one choice by their mean query
      (1: the paper's per-query gate; see the module docstring). ``g``
      divides ``block`` and ``S - T``; a decoding step (positions) is
      refused.
    **options: ``scaled_dot_product_attention``'s other options (``bias``,
      ``score_mod``, ``sinks``, dropout, ``return_lse``, ...), passed on:
      they change the scores the attention reads, not the gate.

  Returns:
    ``scaled_dot_product_attention``'s return over the chosen keys:
    ``out [B, N, T, Hv]``, or it and the extras asked for.

  Raises:
    ValueError: bad ranks or shapes, a mask MoBA does not support (named),
      a positive ``kv_offset``.
    TypeError: ``block``/``top_k`` not ints, a mask that is not an
      ``aj.Mask``.
  """
  _check_sizes(block, top_k, query_block)
  q, k, v = (jnp.asarray(x) for x in (q, k, v))
  _check_operands(q, k, v)
  mask = _as_causal_mask(mask, options.pop("is_causal", False))
  (_, _, t, _), s = q.shape, k.shape[2]
  _check_rows(query_block, mask, t, s)
  for name, value in (("block_q", block_q), ("block_k", block_k)):
    if value is not None and mask.positioned:
      raise ValueError(
          f"{name}={value} sets a block table's blocks, but a mask with "
          "positions (q_offset/kv_offset) holds the selection as a plain "
          "rule without tables: leave it out while decoding.")
  chosen = moba_selection(q, k, mask, block=block, top_k=top_k,
                          query_block=query_block)
  if mask.positioned:  # a decoding step: the choice evaluated at positions
    q_offset = _two_dims("q_offset", 0 if mask.q_offset is None
                         else mask.q_offset, *q.shape[:2])
    rule = MaskRule(_ChosenAtPositions(block, chosen.shape[-1]),
                    (chosen, q_offset))
  else:  # rows of query_block queries (1: each query) choose blocks
    rows = query_block > 1  # whole kernel blocks: select_blocks' rows
    if block_q is None and not rows:
      block_q = min(block, _MAX_BLOCK_Q)
    if block_k is None:
      block_k = _default_block_k(
          block, _MAX_ROWS_BLOCK_K if rows else _MAX_BLOCK_K)
    rule = selection.select_blocks(
        chosen, q_len=t, kv_len=s, key_block=block, query_block=query_block,
        block_q=block_q, block_k=block_k)
  return dot_product.scaled_dot_product_attention(
      q, k, v, mask & Mask(rule=rule), scale=scale,
      implementation=implementation, **options)


@dataclasses.dataclass(frozen=True)
class MobaAttentionFn:
  """``moba_attention`` as a layer's ``attention_fn`` (its protocol:
  ``fn(q, k, v, mask, **options)``)."""
  block: int
  top_k: int
  implementation: Any = None
  block_q: int | None = None
  block_k: int | None = None
  query_block: int = 1

  def __call__(self, q, k, v, mask, **options):
    # A decoding step's mask gives positions: its selection is a rule
    # without tables, which the kernel blocks itself (the same numbers).
    whole = not (isinstance(mask, Mask) and mask.positioned)
    return moba_attention(
        q, k, v, mask, block=self.block, top_k=self.top_k,
        implementation=self.implementation,
        block_q=self.block_q if whole else None,
        block_k=self.block_k if whole else None,
        query_block=self.query_block, **options)


def moba_attention_fn(block: int, top_k: int, implementation: Any = None, *,
                      block_q: int | None = None,
                      block_k: int | None = None,
                      query_block: int = 1) -> MobaAttentionFn:
  """An ``attention_fn`` running MoBA, for the attention layers.

  ``aj.MultiHeadAttention(..., attention_fn=aj.moba_attention_fn(64, 3))``
  trains with MoBA: the layer's mask must be causal (``is_causal=True`` or
  a causal ``mask=``), and decoding from a linear KV cache chooses the
  same blocks as the whole call (the selection is evaluated at the
  cache's positions). A paged or ring-buffer cache is refused. Arguments
  as ``moba_attention``'s, checked here, once; ``block_q``/``block_k``
  set the whole calls' flash blocks (a decoding step's selection is a
  rule without tables, blocked by the kernel). With ``query_block > 1``
  the layer trains and prefills, and refuses to decode (one query is not
  a row).

  Example:
    >>> fn = moba_attention_fn(64, 3, "flash")
    >>> fn.block, fn.top_k
    (64, 3)
  """
  _check_sizes(block, top_k, query_block)
  for name, value in (("block_q", block_q), ("block_k", block_k)):
    if value is not None:
      checks.check_positive_int(name, value)
  if block_k is not None and block % block_k:
    raise ValueError(f"block_k={block_k} must divide block={block}.")
  return MobaAttentionFn(block, top_k, implementation, block_q, block_k,
                         query_block)

