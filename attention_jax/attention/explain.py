"""``explain``: which kernel a call takes and why, and how its blocks run.

Shape glossary: B batch, N query heads, T query length, S key/value length,
H head dim; bq/bk query and key block sizes; nq = ceil(T / bq) and nk =
ceil(S / bk) blocks; ``...`` leading dims.

``explain(q, k, v, mask, **kwargs)`` takes what
``scaled_dot_product_attention`` takes and runs nothing: it normalises the
call with ``dot_product.run``'s own ``dot_product.prepare``
(``mask.as_mask``, ``kernels.candidates``, ``kernels.base.canonicalize``),
asks every candidate kernel what it makes of the problem
(``base.verdicts``, the walk ``base.choose`` makes),
and for the flash kernel counts the (query block, key block) pairs of every
head the way its walk classifies them (``flash_core.key_ranges``, or a
block mask's tables): *empty* (skipped), *full* (run without a mask pass)
or *partial* (run masked). ``jax.ShapeDtypeStruct`` operands stand for
arrays that are never allocated: the call is explained as made with arrays
of those shapes (the concrete ones, e.g. a mask's lengths, stay concrete).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attention_jax import kernels
from attention_jax.attention import dot_product
from attention_jax.core import checks
from attention_jax.kernels import base
from attention_jax.kernels import block_cache
from attention_jax.kernels import flash
from attention_jax.kernels import flash_core
from attention_jax.masking import intervals


@dataclasses.dataclass(frozen=True)
class Verdict:
  """What one candidate kernel makes of the call.

  ``verdict``: ``"runs"`` (the chosen one), ``"refuses"`` (its
  ``supports`` says why), ``"declines"`` (automatic choice only: it could
  run it but leaves it to a later kernel) or ``"not tried"`` (after the
  chosen one; ``reason`` then says what it would have said).
  """
  name: str
  verdict: str
  reason: str | None = None


@dataclasses.dataclass(frozen=True)
class Explanation:
  """Why ``scaled_dot_product_attention`` runs the kernel it runs.

  Attributes:
    kernel: the name of the kernel that runs, None when none takes the call
      (the call raises; ``verdicts`` say why).
    automatic: whether the registry's automatic choice was asked
      (``implementation=None``) or the caller's list.
    verdicts: every candidate kernel in the order tried.
    query_shape, key_shape: the operands' shapes.
    block_sizes: ``(bq, bk)`` the chosen kernel runs (the flash kernel's
      ``flash_core.block_sizes``, clipped to ``T`` and ``S``; splash's
      blocks), None for kernels without blocks (dense) or that do not say.
    pairs: (query block, key block) pairs over every head (``nq * nk`` per
      head), None when not counted.
    empty, full, partial: how many of ``pairs`` the kernel's walk skips,
      runs unmasked and runs masked (a dense mask makes every visited pair
      partial: it is checked entry by entry).
    note: why the pairs were not counted, when they were not.
  """
  kernel: str | None
  automatic: bool
  verdicts: tuple[Verdict, ...]
  query_shape: tuple[int, ...]
  key_shape: tuple[int, ...]
  block_sizes: tuple[int, int] | None = None
  pairs: int | None = None
  empty: int | None = None
  full: int | None = None
  partial: int | None = None
  note: str | None = None

  def fractions(self) -> dict[str, float] | None:
    """``{"empty": .., "full": .., "partial": ..}`` of ``pairs``, or None."""
    if not self.pairs:
      return None
    return {name: getattr(self, name) / self.pairs
            for name in ("empty", "full", "partial")}

  def reason(self, name: str) -> str | None:
    """The reason kernel ``name`` gave (None if it gave none)."""
    for v in self.verdicts:
      if v.name == name:
        return v.reason
    raise KeyError(f"{name!r} was not a candidate: "
                   f"{[v.name for v in self.verdicts]}")

  def __str__(self) -> str:
    how = "automatic choice" if self.automatic else "implementation="
    runs = self.kernel or "nothing (the call raises)"
    lines = [f"query {list(self.query_shape)}, keys {list(self.key_shape)}: "
             f"{runs} runs ({how})"]
    width = max(len(v.name) for v in self.verdicts)
    lines.append(f"  {'kernel':<{width}}  {'verdict':<9}  reason")
    for v in self.verdicts:
      lines.append(f"  {v.name:<{width}}  {v.verdict:<9}  {v.reason or ''}"
                   .rstrip())
    if self.block_sizes is not None:
      lines.append(f"  blocks {self.block_sizes[0]} x {self.block_sizes[1]}")
    fractions = self.fractions()
    if fractions is not None:
      lines.append(f"  {self.pairs} (query block, key block) pairs over "
                   "the heads:")
      for name, says in (("empty", "skipped"), ("full", "run unmasked"),
                         ("partial", "run masked")):
        lines.append(f"    {name:<8} {getattr(self, name):>10}  "
                     f"{fractions[name]:7.2%}  {says}")
    if self.note:
      lines.append(f"  {self.note}")
    return "\n".join(lines)


def explain(query, key, value, mask=None, *, bias=None, scale=None,
            is_causal: bool = False, score_mod=None, sinks=None,
            dropout_rate=0.0, dropout_rng=None, implementation: Any = None,
            return_weights: bool = False, return_lse: bool = False,
            return_max_logits: bool = False) -> Explanation:
  """Which kernel ``scaled_dot_product_attention`` runs for this call, and why.

  Takes ``aj.scaled_dot_product_attention``'s arguments, with their
  meanings (docs/options.md), but ``partition``, and runs no attention.
  Any array, a mask's included, may be a ``jax.ShapeDtypeStruct`` (a call
  too big to allocate is explained from its shapes); those are traced
  abstractly (``jax.eval_shape``), the rest are used as given, so the
  answer is that of the call made eagerly with arrays of those shapes
  (under ``jax.jit`` a kernel may judge traced values otherwise, e.g.
  splash refuses a traced dense mask). Blocks shaped by an abstract mask
  array are not counted.

  Returns:
    An ``Explanation``: the kernel that runs (None if none takes the call,
    which ``scaled_dot_product_attention`` would refuse with these
    reasons), every candidate's verdict and reason, the block sizes, and
    for the flash kernel how many (query block, key block) pairs are
    skipped, run unmasked and run masked. ``print`` it for a table.

  Raises:
    ValueError, TypeError: what ``scaled_dot_product_attention`` raises
      for bad arguments (not for a call no kernel takes).

  Example:
    >>> q = jax.ShapeDtypeStruct((1, 4, 1024, 64), jnp.float32)  # [B, N, T, H]
    >>> why = aj.explain(q, q, q, is_causal=True)
    >>> why.kernel, why.block_sizes
    ('flash', (512, 256))
    >>> why.fractions()
    {'empty': 0.25, 'full': 0.25, 'partial': 0.5}
  """
  args = dict(query=query, key=key, value=value, mask=mask, bias=bias,
              scale=scale, score_mod=score_mod, sinks=sinks,
              dropout_rate=dropout_rate, dropout_rng=dropout_rng)
  static = dict(is_causal=is_causal, implementation=implementation,
                return_weights=return_weights, return_lse=return_lse,
                return_max_logits=return_max_logits)
  abstract = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
  leaves, treedef = jax.tree.flatten(args, is_leaf=abstract)
  where = [i for i, x in enumerate(leaves) if abstract(x)]
  if not where:
    return _explain(**args, **static)
  found = []

  def traced(*values):
    full = list(leaves)
    for i, x in zip(where, values):
      full[i] = x
    # Only the abstract operands are traced: every other value keeps its
    # concrete numbers, as in an eager call (the block counts read them).
    with jax.ensure_compile_time_eval():
      found.append(_explain(**jax.tree.unflatten(treedef, full), **static))

  jax.eval_shape(traced, *[leaves[i] for i in where])
  return found[0]


def _explain(query, key, value, mask, *, bias, scale, is_causal, score_mod,
             sinks, dropout_rate, dropout_rng, implementation,
             return_weights, return_lse, return_max_logits) -> Explanation:
  problem, candidates, automatic = dot_product.prepare(
      query, key, value, mask, bias=bias, scale=scale, is_causal=is_causal,
      score_mod=score_mod, sinks=sinks, dropout_rate=dropout_rate,
      dropout_rng=dropout_rng, implementation=implementation,
      return_weights=return_weights, return_lse=return_lse,
      return_max_logits=return_max_logits)
  chosen = None
  verdicts = []
  for kernel, verdict, reason in base.verdicts(candidates, problem,
                                                  automatic):
    if chosen is not None:  # choose stops here; say what it would have met
      reason = {"refuses": f"would refuse: {reason}",
                "declines": f"would decline: {reason}"}.get(
                    verdict, "would take it")
      verdict = "not tried"
    elif verdict == "takes":
      chosen, verdict = kernel, "runs"
    verdicts.append(Verdict(kernel.name, verdict, reason))
  explained = Explanation(
      None if chosen is None else chosen.name, automatic, tuple(verdicts),
      checks.shape_of(query), checks.shape_of(key))
  if chosen is None:
    return explained
  if isinstance(chosen, flash.Flash):
    return _flash_blocks(explained, chosen, problem)
  if isinstance(chosen, kernels.Splash):
    return dataclasses.replace(
        explained, block_sizes=(chosen.block_q, chosen.block_kv),
        note="splash classifies its blocks itself (not counted here)")
  if isinstance(chosen, kernels.Dense):
    note = "dense forms each head's whole [T, S] scores: no blocks"
  else:
    note = f"{chosen.name} does not report its blocks"
  return dataclasses.replace(explained, note=note)


def _flash_blocks(explained: Explanation, kernel: flash.Flash,
                  problem: base.Problem) -> Explanation:
  """``explained`` with the flash kernel's blocks and its walk's counts."""
  # What Flash.__call__ runs: given, a block mask's, tuned (not with
  # dropout: the key says so), else defaults.
  bq, bk, _ = block_cache.blocks(problem, kernel.block_q, kernel.block_k)
  ops = flash.with_rule_tables(problem.ops, bq, bk)  # what the kernel runs with
  t, s = ops.query.shape[-2], ops.key.shape[-2]
  bq, bk = min(bq, t), min(bk, s)  # as flash_core.static clips them
  explained = dataclasses.replace(explained, block_sizes=(bq, bk))
  bm = ops.rule
  per_head_tables = bm is not None and bool(bm.batch_shape)
  tables = bm.tables if per_head_tables else ()
  operands = (ops.kv_lengths, ops.q_lengths, ops.q_segment_ids, ops.kv_segment_ids,
              ops.q_offset, ops.kv_offset, *tables)
  named = dict(kv_lengths=ops.kv_lengths, q_lengths=ops.q_lengths,
               segment_ids=ops.q_segment_ids, q_offset=ops.q_offset,
               kv_offset=ops.kv_offset,
               block_tables=None if bm is None else bm.kinds)
  traced = [name for name, x in named.items()
            if isinstance(x, jax.core.Tracer)]
  if traced:
    return dataclasses.replace(
        explained, note=f"pairs not counted: they depend on the values of "
        f"{', '.join(traced)}, which are traced here")
  num_q, num_k = -(-t // bq), -(-s // bk)
  # The kernel's Static as flash_core.static builds it; the scale and
  # score modifier place no block.
  st = flash_core.Static(1.0, intervals.bounds(ops.causal, ops.window), None,
                         t, s, bq, bk)
  # A dense mask only matters by its presence: every visited block is
  # checked against it (flash_core._walk).
  mask = None if ops.dense is None else jnp.ones((1, 1), bool)

  def head(length, q_lengths, q_segment_ids, kv_segment_ids, q_offset, kv_offset,
           *head_tables):
    head_bm = bm.with_tables(head_tables) if per_head_tables else bm
    ex = flash_core.padded_head(st, num_q * bq, num_k * bk, base.Head(
        dense=mask, kv_lengths=length, q_lengths=q_lengths, q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids, rule=head_bm, q_offset=q_offset,
        kv_offset=kv_offset))
    place = flash_core.Place(*ex.offsets(t, s))  # positions, as the kernel
    if not flash_core.patterned(st, ex):  # every block runs unmasked
      return jnp.array([num_q * num_k, num_q * num_k], jnp.int32)
    seg = flash_core.segment_summary(st, ex)
    lo, hi, full_lo, full_hi = jax.vmap(
        lambda i: flash_core.key_ranges(st, ex, place, seg, i, num_k))(
            jnp.arange(num_q))  # [nq] each
    checked = mask is not None  # every visited block takes a mask pass
    if ex.rule is not None:  # the tables' non-empty blocks in range
      j = ex.rule.kv_indices  # [nq, m], padded with nk
      seen = (j >= lo[:, None]) & (j < hi[:, None])
      full = (seen & ex.rule.kv_full & (j >= full_lo[:, None])
              & (j < full_hi[:, None]))
      visited, full = seen.sum(), full.sum()
    else:
      visited, full = (hi - lo).sum(), (full_hi - full_lo).sum()
    if checked:
      full = jnp.zeros_like(full)
    return jnp.stack([visited, full]).astype(jnp.int32)

  counts = base.broadcast_vmap(
      head, (0, 0, 1, 1, 0, 0) + (2,) * len(tables), operands)  # [..., 2]
  # Each entry stands for as many heads (the size-1 dims were shared).
  counts = np.asarray(counts).reshape(-1, 2)
  heads = int(np.prod(ops.batch_shape, dtype=np.int64))
  share = heads // counts.shape[0]
  visited, full = (int(x) * share for x in counts.sum(0))
  pairs = heads * num_q * num_k
  return dataclasses.replace(explained, pairs=pairs, empty=pairs - visited,
                             full=full, partial=visited - full)
