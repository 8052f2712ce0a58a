"""The blockwise (flash) kernel: online softmax over key blocks, O(T + S) memory.

Shape glossary: T query length, S key/value length, N query heads, K
key/value heads, H head dim, Hv value head dim; ``...`` leading dims.

Runs the single-head core of ``flash_core`` over the leading dims. Never
more than one ``[block_q, block_k]`` block of scores per head exists at a
time; every mask field skips the blocks it rules out (forward and backward)
and full blocks run without a mask pass; a rule without block tables gets
them here, at this kernel's block sizes (NumPy when concrete, on device
when traced). The backward pass is a custom VJP that recomputes the blocks
(FlashAttention-2). No weights, no dropout, float32 compute. With
``return_max_logits`` the forward walk also keeps each row's raw maximum
logit (``flash_core.forward``). NaN or inf in a key, value or query reaches
only the rows that may see it (``flash_core``: finite blocks, row codes,
poisoned rows).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

from attention_jax.core import broadcast
from attention_jax.core import checks
from attention_jax.core import grouping
from attention_jax.core import numerics
from attention_jax.kernels import base
from attention_jax.kernels import flash_core
from attention_jax.masking import block_tables as block_mask_lib


@dataclasses.dataclass(frozen=True)
class Flash(base.Kernel):
  """Blockwise attention; ``block_q``/``block_k`` None pick by pattern
  (``flash_core.block_sizes``)."""
  block_q: int | None = None
  block_k: int | None = None
  name = "flash"
  implements = base.MASK_FIELDS | {"bias", "sinks", "score_mod",
                                   "return_lse", "return_max_logits"}

  def __post_init__(self):
    base.check_block_size("block_q", self.block_q)
    base.check_block_size("block_k", self.block_k)

  def supports(self, problem: base.Problem) -> str | None:
    return (base.no_weights_or_dropout(problem)
            or base.float32_only(problem))

  def declines(self, problem: base.Problem) -> str | None:
    return base.too_small(problem)

  def __call__(self, problem: base.Problem):
    ops = problem.ops
    block_q, block_k = flash_core.block_sizes(ops, self.block_q,
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
    garbage = numerics.any_nonfinite(ops.query, ops.key, ops.value)
    return broadcast.lift_heads(head, ops, (garbage,), (0,))


def with_rule_tables(ops: checks.Operands, block_q: int, block_k: int):
  """``ops`` with a table-less rule's block tables built at these sizes.

  Per (b, h) where the rule depends on them (``checks.rule_batch``),
  split like the heads.
  """
  bm = ops.block_mask
  if bm is None or bm.kinds is not None:
    return ops
  if ops.positioned:
    # Tables classify blocks of row/column indices; at positions (a cache's
    # per-example offsets) the rule is evaluated in each block the band,
    # lengths and segments leave, as ring attention does.
    return ops
  t, s = bm.shape
  batch = checks.rule_batch(bm.mask_fn, ops.leading, s)
  if not batch and getattr(bm.mask_fn, "examples", None) is not None:
    batch = (1,) * len(ops.leading)  # a per-example rule at batch 1
  built = block_mask_lib.block_mask(bm.mask_fn, t, s, batch=batch,
                                    block_q=block_q, block_k=block_k)
  if batch:
    built = built.with_tables(
        grouping.split(jnp.asarray(x), ops.groups, -3) for x in built.tables)
  return ops._replace(block_mask=built)
