"""The blockwise (flash) kernel: online softmax over key blocks, O(T + S) memory.

Shape glossary: T query length, S key/value length, N query heads, K
key/value heads, H head dim, Hv value head dim; ``...`` leading dims.

Runs the single-head core of ``flash_core`` over the leading dims, the
heads in cache-sized groups (``flash_core.head_group``; all under ``vmap``
when a partition splits them). Never more than one ``[block_q, block_k]``
block of scores per head exists at a time; every mask field skips the
blocks it rules out (forward and backward) and full blocks run without a
mask pass; a rule without block tables gets them here, at this kernel's
block sizes (NumPy when concrete, on device when traced). Block sizes:
given, a block mask's, this machine's tuned pair (``block_cache``), else
``flash_core.block_sizes``. Differentiable both ways: the backward pass
recomputes the blocks (FlashAttention-2), forward mode runs a tangent
pass (``flash_core.tangent``). Dropout is drawn per block
(``core/dropout.py``: the dense kernel's mask). No weights, float32
compute. With
``return_max_logits`` the forward walk also keeps each row's raw maximum
logit (``flash_core.forward``). NaN or inf in a key, value or query reaches
only the rows that may see it (``flash_core``: finite blocks, row codes,
poisoned rows).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp

from attention_jax.core import checks
from attention_jax.core import dropout
from attention_jax.kernels import base
from attention_jax.kernels import block_cache
from attention_jax.kernels import flash_core
from attention_jax.masking import block_tables as block_mask_lib
from attention_jax.masking import mask as mask_lib


@dataclasses.dataclass(frozen=True)
class Flash(base.Kernel):
  """Blockwise attention; ``block_q``/``block_k`` None pick by pattern
  (``flash_core.block_sizes``)."""
  block_q: int | None = None
  block_k: int | None = None
  name = "flash"
  jit = True  # pure: eager calls compile it whole
  float64 = False  # float32 compute
  min_scores = base.MIN_SCORES
  implements = base.MASK_FIELDS | {"bias", "sinks", "score_mod",
                                   "dropout_rate", "return_lse",
                                   "return_max_logits", "pages",
                                   "page_scales"}

  def __post_init__(self):
    base.check_block_size("block_q", self.block_q)
    base.check_block_size("block_k", self.block_k)

  def supports(self, problem: base.Problem) -> str | None:
    # (weights are not in `implements`, float64 not computed: refused by
    # the choice with the hint)
    return self._paged(problem) if problem.pages is not None else None

  def _paged(self, problem: base.Problem) -> str | None:
    """What it cannot do with pages: arrays over the logical key axis."""
    ops, z = problem.ops, problem.pages.page_size
    if ops.dense is not None or ops.bias is not None:
      return ("it reads a paged cache page by page and takes no dense mask "
              "or bias over its slots (a [T, M * Z] array): say it with "
              "the mask's fields, a rule or a score modifier")
    if ops.rule is not None and ops.rule.kinds is not None:
      key_block = (1 if self.block_k is None else self.block_k // z) * z
      t = ops.query.shape[-2]
      if not (mask_lib.key_only(ops.rule) and ops.rule.block_k == key_block
              and ops.rule.block_q >= t):
        return ("it reads a paged cache page by page, so a BlockMask's "
                "tables (built for other blocks) do not apply: pass the "
                "rule itself, aj.MaskRule(fn), or a selection of key blocks "
                f"(aj.select_blocks with query_block >= T = {t}, block_q >= "
                f"T and block_k = {key_block}, its pages)")
    if self.block_k is not None and self.block_k % z:
      return (f"over a paged cache its key blocks are whole pages: block_k="
              f"{self.block_k} is not a multiple of the page size {z} "
              "(leave block_k unset)")
    return None

  def __call__(self, problem: base.Problem):
    if problem.pages is not None:
      return self._paged_call(problem)
    ops = problem.ops
    # The given sizes, a block mask's, this machine's tuned pair, else the
    # defaults by pattern (block_cache.blocks).
    block_q, block_k, _ = block_cache.blocks(problem, self.block_q,
                                             self.block_k)
    ops = with_rule_tables(ops, block_q, block_k)
    head = functools.partial(flash_core.single_head, scale=problem.scale,
                             is_causal=ops.causal, window=ops.window,
                             score_mod=ops.score_mod, block_q=block_q,
                             block_k=block_k,
                             max_logits=problem.return_max_logits,
                             out_dtype=problem.out_dtype)
    # One scalar for the call (unmapped by the heads' vmap): without NaN or
    # inf anywhere the walk makes no pass looking for rows that see one.
    garbage = checks.any_nonfinite(ops.query, ops.key, ops.value)
    # Heads in cache-sized groups, one group after another; all under
    # vmap when a partition splits them (XLA's partitioner splits the
    # vmapped dims; a loop over them would gather them).
    group = 0 if problem.partition else flash_core.head_group(
        math.prod(ops.query.shape[:-2]), ops.query.shape[-2],
        ops.key.shape[-2], block_q, block_k)
    return base.lift_heads(head, ops, (garbage, *drop_operands(problem)),
                           (0, 1, 0), one_at_a_time=group)


  def _paged_call(self, problem: base.Problem):
    """Every head reads its example's pages from the shared pool.

    The pool is not mapped over heads: each head gets its key/value head
    index and its example's page-table row (in place of the keys and
    values ``lift_heads`` would slice) and loads whole pages per key block.
    """
    ops, pages = problem.ops, problem.pages
    block_q, _ = flash_core.block_sizes(ops, self.block_q, None)
    z = pages.page_size
    # Key blocks of g whole pages: one unless block_k asks for more (one
    # page is a slice of the pool, more are gathered: docs/performance.md).
    g = 1 if self.block_k is None else self.block_k // z
    table = jnp.asarray(pages.table, jnp.int32)  # [B, M]
    m = table.shape[-1]
    # The row padded to whole blocks with "no page" (past every length).
    table = jnp.pad(table, ((0, 0), (0, -m % g)),
                    constant_values=pages.key_pages.shape[0])
    lead = ops.key.shape[:-2]  # [B, K|N|1, 1?]: the logical keys' heads
    heads = jnp.arange(lead[1], dtype=jnp.int32).reshape(
        (1, lead[1]) + (1,) * (len(lead) - 2) + (1, 1))  # core [1, 1]
    rows = table.reshape(
        (lead[0],) + (1,) * (len(lead) - 1) + (1, -1))  # core [1, M']
    config = dict(scale=problem.scale, is_causal=ops.causal,
                  window=ops.window, score_mod=ops.score_mod,
                  block_q=block_q, block_k=g * z,
                  max_logits=problem.return_max_logits,
                  out_dtype=problem.out_dtype)

    def head(q, kv_head, row, h, seed, rate):
      kv_head, row = kv_head[0, 0], row[0]
      return flash_core.paged_head(
          q, flash_core.PagedRows(pages.key_pages, kv_head, row,
                                  pages.key_scales, pages.finite),
          flash_core.PagedRows(pages.value_pages, kv_head, row,
                               pages.value_scales, pages.finite), h,
          None if seed is None else flash_core.Dropout(seed, rate), **config)

    return base.lift_heads(head, ops._replace(key=heads, value=rows),
                           drop_operands(problem), (1, 0))


def drop_operands(problem: base.Problem):
  """``(seed [2] uint32, rate float32)`` of a call with dropout, or
  ``(None, None)``: unmapped operands of every head (``core/dropout.py``)."""
  if problem.dropout_rng is None:  # (canonicalize: no key, no dropout)
    return None, None
  return (dropout.seed_words(problem.dropout_rng),
          jnp.asarray(problem.dropout_rate, jnp.float32))


def with_rule_tables(ops: base.Operands, block_q: int, block_k: int):
  """``ops`` with a table-less rule's block tables built at these sizes.

  Per (b, h) where the rule depends on them (``base.rule_batch``),
  split like the heads.
  """
  bm = ops.rule
  if bm is None or bm.kinds is not None:
    return ops
  if ops.positioned:
    # Tables classify blocks of row/column indices; at positions (a cache's
    # per-example offsets) the rule is evaluated in each block the band,
    # lengths and segments leave, as ring attention does.
    return ops
  t, s = bm.shape
  batch = base.rule_batch(bm.mask_fn, ops.leading, s)
  if not batch and getattr(bm.mask_fn, "examples", None) is not None:
    batch = (1,) * len(ops.leading)  # a per-example rule at batch 1
  built = block_mask_lib.block_mask(bm.mask_fn, t, s, batch=batch,
                                    block_q=block_q, block_k=block_k)
  if batch:
    built = built.with_tables(
        base.split_groups(jnp.asarray(x), ops.groups, -3) for x in built.tables)
  return ops._replace(rule=built)
