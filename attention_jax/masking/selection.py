"""Selections from data: which key blocks (or tokens) each query may read.

Shape glossary: B batch, N query heads, K key/value heads (G = N / K query
heads per group), T query length, S key/value length; ``g`` the queries a
selection row covers (1: per query, or a query block), ``c`` the keys of a
selected block; nqs = ceil(T / g), nks = ceil(S / c) selection rows and
key blocks; bq/bk the blockwise kernels' blocks; k the tokens a query
keeps.

Trainable sparse attention (MoBA, NSA, DeepSeek's DSA) decides from traced
scores which keys a query reads. The decision is a mask: ``select_blocks``
and ``select_tokens`` turn it into an ``aj.BlockMask`` whose rule is the
selection and whose block tables are computed from it on device, so every
kernel that takes a block mask takes a selection: the flash walk visits
only the selected blocks (forward, backward and the tangent pass: cost in
proportion to what is selected, not to S), the dense kernel evaluates the
rule exactly (the reference), the others take it or refuse block masks by
name. A selection intersects with the rest of the mask as any rule does:
``aj.Mask(causal=True, window=..., kv_lengths=..., rule=selection)``.

The selection is data, not a function of the inputs the kernels
differentiate: gradients flow through the attention over the selected keys
and never through the choice (an integer or boolean table has no
gradient). Methods that train their selector do it through a loss of their
own (``aj.indexer_loss``) or through a branch that uses the scores
(NSA's compressed attention).

Memory: a block selection is ``[..., nqs, nks]`` booleans and its tables
``[..., nq, nk]``; a token selection ``[..., T, k]`` indices and tables
``[..., nq, nk]``. Neither holds a ``[T, S]`` array.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.core import checks
from attention_jax.masking import block_tables
from attention_jax.masking import intervals
from attention_jax.masking.mask import BlockMask
from attention_jax.masking.mask import MaskRule

EMPTY, PARTIAL, FULL = intervals.EMPTY, intervals.PARTIAL, intervals.FULL


def _head_index(b, h, lead: tuple[int, ...], group: int):
  """Indices into a selection's leading dims (``()``, ``[B]`` or ``[B, Hs]``)
  for the kernels' ``b`` and query head ``h`` (size-1 dims broadcast; a
  ``Hs = K`` head axis is read by query head ``h // group``)."""
  index = []
  if len(lead) >= 1:
    index.append(b if lead[0] > 1 else 0)
  if len(lead) == 2:
    index.append(h // group if lead[1] > 1 else 0)
  return tuple(index)


@dataclasses.dataclass(frozen=True)
class _SelectedBlocks:
  """The rule of ``select_blocks``: query ``q`` reads key ``kv`` iff its
  row ``q // rows`` chose block ``kv // cols`` (static settings: a value,
  hashable, so a Mask holding it is one static structure)."""
  rows: int
  cols: int
  lead: tuple[int, ...]
  group: int
  # One row for every query (query_block >= T): the rule reads key
  # columns only, so a decoding step's positioned mask may hold it.
  key_only: bool = False

  def __call__(self, b, h, q_idx, kv_idx, chosen):
    index = _head_index(b, h, self.lead, self.group)
    if self.key_only:  # the one row, whatever the query's position
      return chosen[index + (0, kv_idx // self.cols)]
    return chosen[index + (q_idx // self.rows, kv_idx // self.cols)]


@dataclasses.dataclass(frozen=True)
class _SelectedTokens:
  """The rule of ``select_tokens``: query ``q`` reads key ``kv`` iff ``kv``
  is among its indices."""
  lead: tuple[int, ...]
  group: int

  def __call__(self, b, h, q_idx, kv_idx, indices):
    index = _head_index(b, h, self.lead, self.group)
    rows = indices[index + (q_idx,)]  # [..., bq, 1, k]
    return jnp.any(rows == kv_idx[..., None], axis=-1)


def _check_lead(name: str, shape: tuple[int, ...], core: int) -> tuple:
  lead = tuple(shape[:-core])
  if len(lead) > 2:
    raise ValueError(
        f"{name} has shape {list(shape)}: its leading dims are the batch and "
        f"heads it varies over, at most two ([B, Hs, ...] with Hs = N query "
        f"heads, K key/value heads (group=N // K) or 1); got {len(lead)}.")
  return lead


def _check_group(group, lead) -> int:
  checks.check_positive_int("group", group)
  if group > 1 and (len(lead) < 2 or lead[1] == 1):
    raise ValueError(
        f"group={group} says the selection's head axis counts key/value "
        f"heads, but its leading dims {list(lead)} have no head axis: give "
        f"it [B, K, ...] or leave group=1.")
  return int(group)


def _tables(hits, q_len: int, kv_len: int, block_q: int, block_k: int,
            lead: tuple[int, ...], group: int, full_ok: bool):
  """Kinds and compact tables from per-query hits ``[..., T, nk]``
  (True: the query reads some of key block j; with ``full_ok``: all of
  it). Rows of one query block are united: a block some rows read is
  partial, one every row reads wholly is full."""
  nq = -(-q_len // block_q)
  pad = nq * block_q - q_len
  widths = [(0, 0)] * (hits.ndim - 2) + [(0, pad), (0, 0)]
  # Rows past T repeat the last row (as block_mask's device path does).
  hits = jnp.pad(hits, widths, mode="edge")
  blocks = hits.reshape(hits.shape[:-2] + (nq, block_q, hits.shape[-1]))
  some = blocks.any(-2)
  kinds = jnp.where(some, PARTIAL, EMPTY)
  if full_ok:
    kinds = jnp.where(blocks.all(-2), FULL, kinds)
  kinds = kinds.astype(jnp.int8)  # [..., nq, nk]
  if group > 1:  # one table per query head
    kinds = jnp.repeat(kinds, group, axis=-3)
  kv_indices, kv_full, q_indices, q_full = block_tables.compact_tables(
      kinds, jnp)
  del kv_len, lead
  return kinds, kv_indices, kv_full, q_indices, q_full


def select_blocks(chosen, *, q_len: int, kv_len: int, key_block: int,
                  query_block: int = 1, group: int = 1,
                  block_q: int | None = None,
                  block_k: int | None = None) -> BlockMask:
  """A block selection as a ``BlockMask``: query ``q`` may read the keys of
  the blocks its row chose.

  Args:
    chosen: bool ``[..., nqs, nks]``: row ``r`` (queries ``[r * query_block,
      (r + 1) * query_block)``) reads key block ``j`` (keys ``[j *
      key_block, (j + 1) * key_block)``). Leading dims: none, ``[B]`` or
      ``[B, Hs]`` (``Hs``: 1, the query heads, or the key/value heads with
      ``group``); traced values welcome (``top_k_blocks`` of gate scores).
    q_len, kv_len: ``T`` and ``S`` of the calls it serves.
    key_block: ``c``, the keys a selected block holds.
    query_block: ``g``, the queries one row of ``chosen`` stands for
      (1: every query chooses for itself, MoBA's gate; a block: NSA per
      query block).
    group: query heads per row of a key/value-head axis (``N // K``: the
      heads of a GQA group share their selection, as NSA's and DSA's do).
    block_q: the blockwise kernels' query block (default: the multiple of
      ``query_block`` nearest 64 from below, at least ``query_block``;
      clipped to ``T``).
    block_k: their key block, a divisor of ``key_block`` (default
      ``key_block``, clipped to ``S``).

  Returns:
    A ``BlockMask`` (``aj.Mask(causal=True, rule=...)`` intersects it with
    causality and the other fields); its rule reads ``chosen``, its tables
    are built from ``chosen`` on device (no ``[T, S]`` array).

  Raises:
    ValueError: ``chosen`` of the wrong rank or trailing shape, a
      ``block_k`` that does not divide ``key_block``, bad sizes.
    TypeError: ``chosen`` not boolean.
  """
  for name, value in (("q_len", q_len), ("kv_len", kv_len),
                      ("key_block", key_block), ("query_block", query_block)):
    checks.check_positive_int(name, value)
  chosen = jnp.asarray(chosen) if isinstance(chosen, (list, np.ndarray)
                                             ) else chosen
  if chosen.dtype != jnp.bool_:
    raise TypeError(f"chosen must be a bool array [..., nqs, nks], got dtype "
                    f"{chosen.dtype} with shape {list(chosen.shape)}: compare "
                    "scores or use aj.sparse.top_k_blocks.")
  if chosen.ndim < 2:
    raise ValueError(f"chosen must be [..., nqs, nks], got shape "
                     f"{list(chosen.shape)}.")
  lead = _check_lead("chosen", chosen.shape, 2)
  group = _check_group(group, lead)
  nqs, nks = -(-q_len // query_block), -(-kv_len // key_block)
  if chosen.shape[-2:] != (nqs, nks):
    raise ValueError(
        f"chosen has shape {list(chosen.shape)}; for q_len={q_len}, "
        f"kv_len={kv_len}, query_block={query_block}, key_block={key_block} "
        f"its last two dims must be [ceil(T / query_block), ceil(S / "
        f"key_block)] = [{nqs}, {nks}].")
  if block_q is None:  # a whole number of rows, about 64 queries
    block_q = query_block * max(1, 64 // query_block)
  block_k = key_block if block_k is None else block_k
  checks.check_positive_int("block_q", block_q)
  checks.check_positive_int("block_k", block_k)
  bq, bk = min(block_q, q_len), min(block_k, kv_len)
  if key_block % bk and bk != kv_len:
    raise ValueError(
        f"block_k={block_k} must divide key_block={key_block} (a kernel key "
        f"block lies inside one selected block); pass block_k={key_block} "
        "or a divisor of it.")
  # Per query, per kernel key block: the selection row's choice.
  rows = jnp.minimum(jnp.arange(q_len) // query_block, nqs - 1)
  nk = -(-kv_len // bk)
  cols = jnp.minimum(jnp.arange(nk) * bk // key_block, nks - 1)
  hits = chosen[..., rows, :][..., cols]  # [..., T, nk]
  tables = _tables(hits, q_len, kv_len, bq, bk, lead, group, full_ok=True)
  rule = MaskRule(_SelectedBlocks(query_block, key_block, lead, group,
                                  key_only=nqs == 1), chosen)
  return BlockMask(rule, q_len, kv_len, bq, bk, *tables)


def select_tokens(indices, *, kv_len: int, group: int = 1,
                  block_q: int = 64, block_k: int = 64) -> BlockMask:
  """A token selection as a ``BlockMask``: query ``t`` may read the keys
  ``indices[..., t, :]`` (DSA's top-k tokens).

  Args:
    indices: integer ``[..., T, k]``; entries outside ``[0, S)`` (e.g. -1,
      where fewer than k keys are visible) select nothing; repeats are
      harmless. Leading dims as ``select_blocks``'s ``chosen``.
    kv_len: ``S``.
    group: query heads per row of a key/value-head axis.
    block_q, block_k: the blockwise kernels' blocks (clipped to T and S).
      A kernel block is visited when some query of the block chose some
      key in it; inside it the rule compares indices (``k`` compares per
      entry), so token selection costs more per visited block than a
      block selection.

  Returns:
    A ``BlockMask`` whose rule is membership in ``indices`` and whose
    tables come from them (``[..., T, nk]`` hits, never ``[T, S]``).
  """
  checks.check_positive_int("kv_len", kv_len)
  checks.check_positive_int("block_q", block_q)
  checks.check_positive_int("block_k", block_k)
  indices = jnp.asarray(indices)
  if not jnp.issubdtype(indices.dtype, jnp.integer):
    raise TypeError(f"indices must be integer [..., T, k], got dtype "
                    f"{indices.dtype} with shape {list(indices.shape)}.")
  if indices.ndim < 2:
    raise ValueError(f"indices must be [..., T, k], got shape "
                     f"{list(indices.shape)}.")
  lead = _check_lead("indices", indices.shape, 2)
  group = _check_group(group, lead)
  q_len = indices.shape[-2]
  indices = indices.astype(jnp.int32)
  bq, bk = min(block_q, q_len), min(block_k, kv_len)
  nk = -(-kv_len // bk)
  valid = (indices >= 0) & (indices < kv_len)
  block = jnp.where(valid, indices // bk, nk)  # nk: a dropped column
  flat = block.reshape(-1, block.shape[-1])  # a scatter per query: [T, nk]
  hits = jax.vmap(lambda row: jnp.zeros(nk + 1, bool).at[row].set(True))(
      flat)[:, :nk].reshape(block.shape[:-1] + (nk,))
  tables = _tables(hits, q_len, kv_len, bq, bk, lead, group, full_ok=False)
  # Invalid entries never match a key index.
  rule = MaskRule(_SelectedTokens(lead, group),
                  jnp.where(valid, indices, -1))
  return BlockMask(rule, q_len, kv_len, bq, bk, *tables)


def top_k_mask(scores, k: int):
  """The ``k`` largest entries of ``scores`` along the last axis as a bool
  mask of its shape (ties to the lower index); ``-inf`` entries (blocks a
  query may not read) are never chosen, so a row with fewer than ``k``
  finite scores chooses fewer. Not differentiated: a choice.

  ``scores`` ``[..., n]`` (e.g. gate scores ``[B, N, T, nks]`` for
  ``select_blocks``); ``k`` a static int (``k >= n`` chooses every finite
  entry).
  """
  checks.check_positive_int("k", k)
  scores = jax.lax.stop_gradient(jnp.asarray(scores))
  n = scores.shape[-1]
  if k >= n:
    return scores > -jnp.inf
  _, top = jax.lax.top_k(scores, k)  # [..., k]
  picked = jnp.take_along_axis(scores, top, -1) > -jnp.inf
  flat = top.reshape(-1, k)
  ok = picked.reshape(-1, k)
  chosen = jax.vmap(lambda i, o: jnp.zeros(n + 1, bool).at[
      jnp.where(o, i, n)].set(True))(flat, ok)[:, :n]
  return chosen.reshape(scores.shape)


def top_k_indices(scores, k: int):
  """``[..., k]`` indices of the ``k`` largest entries of ``scores`` along
  the last axis, ``-1`` where fewer than ``k`` are finite (what
  ``select_tokens`` reads: DSA's top-k tokens). Not differentiated."""
  checks.check_positive_int("k", k)
  scores = jax.lax.stop_gradient(jnp.asarray(scores))
  k = min(k, scores.shape[-1])
  values, top = jax.lax.top_k(scores, k)
  return jnp.where(values > -jnp.inf, top, -1).astype(jnp.int32)


def is_selection(rule) -> bool:
  """Whether ``rule`` (a Mask's rule) is a selection of ``select_blocks`` or
  ``select_tokens``: its rows are the call's query rows, not positions,
  so a KV-cache step, whose queries stand at positions, refuses it."""
  fn = getattr(rule, "mask_fn", None)
  return isinstance(getattr(fn, "fn", None), (_SelectedBlocks,
                                              _SelectedTokens))


def exact_tables(rule) -> bool:
  """Whether ``rule`` (a kernel's per-head ``BlockMask``) is a block
  selection whose tables say everything: each kernel block lies inside one
  selection row and one selected key block, so its kind is ``FULL`` or
  ``EMPTY``, and a walk that follows the tables need not evaluate the rule
  (static: read off the selection's settings and the blocks)."""
  fn = getattr(getattr(rule, "mask_fn", None), "fn", None)
  if not isinstance(fn, _SelectedBlocks) or rule.kinds is None:
    return False
  rows_whole = fn.key_only or fn.rows % rule.block_q == 0
  return rows_whole and fn.cols % rule.block_k == 0


def is_token_selection(rule) -> bool:
  """Whether ``rule`` is a token selection (``select_tokens``)."""
  fn = getattr(rule, "mask_fn", None)
  return isinstance(getattr(fn, "fn", None), _SelectedTokens)


def head_tokens(rule, b, h):
  """A token selection's indices for head ``(b, h)``: int32 ``[T, k]``,
  ``-1`` for none (what the gathered kernel reads)."""
  fn = rule.mask_fn
  return fn.params[_head_index(b, h, fn.fn.lead, fn.fn.group)]
