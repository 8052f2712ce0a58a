"""Scaled dot-product attention: ``softmax(Q K^T / sqrt(d_k)) V``, and dispatch.

Shape glossary: B batch, T query length, S key/value length, N query heads,
K key/value heads, H head dim (of queries and keys), Hv value head dim, D
model dim. ``...`` is any number of leading batch dimensions (e.g. ``B, N``)
that broadcast.

``scaled_dot_product_attention`` is the one public entry point over every
kernel: it resolves ``implementation=`` to the kernels to try
(``base.candidates`` over ``kernels.REGISTRY``), validates the call once
(``kernels.base.canonicalize``: a ``Problem``), picks the first kernel that
supports it (``base.choose``) and runs it. The kernels never import this
module. Every kernel honours one contract (masks True = may attend,
bottom-right causal, a query with nothing to attend to gets output 0 and
lse ``-inf`` with zero gradients, float32 compute for 16-bit inputs),
checked by one shared test suite.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax.typing import ArrayLike

from attention_jax import kernels
from attention_jax.core import checks
from attention_jax.kernels import base
from attention_jax.kernels import forward_mode
from attention_jax.kernels import per_shard
from attention_jax.masking import mask as mask_lib
from attention_jax.masking.mask import BlockMask
from attention_jax.masking.mask import Mask


def run(query, key, value, mask=None, *, bias=None, scale=None,
        is_causal: bool = False, score_mod=None, sinks=None,
        dropout_rate=0.0, dropout_rng=None, implementation: Any = None,
        return_weights: bool = False, return_lse: bool = False,
        return_max_logits: bool = False, pages=None, partition=None):
  """``scaled_dot_product_attention`` returning one ``kernels.Result``
  (weights, lse, max_logits None unless asked for): the path every entry
  point shares. ``pages`` (``kernels.base.Pages``, key and value None):
  a paged cache's keys and values (``aj.paged_attention``). A kernel XLA
  cannot partition (``Kernel.partitionable`` False) runs per shard of the
  problem's partition (``kernels.per_shard``)."""
  problem, candidates, automatic = prepare(
      query, key, value, mask, bias=bias, scale=scale, is_causal=is_causal,
      score_mod=score_mod, sinks=sinks, dropout_rate=dropout_rate,
      dropout_rng=dropout_rng, implementation=implementation,
      return_weights=return_weights, return_lse=return_lse,
      return_max_logits=return_max_logits, pages=pages, partition=partition)
  kernel = base.choose(candidates, problem, automatic)
  call = kernel
  if problem.partition is not None and not kernel.partitionable:
    call = functools.partial(per_shard.run, kernel)
  if kernel.forward_mode:
    result = call(problem)
  else:  # jax.jvp through it raises a ValueError naming it
    result = forward_mode.run(kernel, call, problem)
  return base.asked_result(kernel, problem, result)


def prepare(query, key, value, mask=None, *, bias=None, scale=None,
            is_causal: bool = False, score_mod=None, sinks=None,
            dropout_rate=0.0, dropout_rng=None, implementation: Any = None,
            return_weights: bool = False, return_lse: bool = False,
            return_max_logits: bool = False, pages=None, partition=None):
  """A call normalised once: ``(problem, kernels to try, automatic)``
  (what ``run`` runs and ``aj.explain`` reports). ``partition`` None is
  read off the query's type on a mesh of explicit axes
  (``typed_partition``)."""
  checks.check_static_bool("is_causal", is_causal)
  mask = mask_lib.as_mask(mask, is_causal=is_causal)
  candidates, automatic = base.candidates(implementation, kernels.REGISTRY)
  if partition is None and not jax.sharding.get_abstract_mesh().empty:
    partition = typed_partition(query)
  problem = base.canonicalize(
      query, key, value, mask, bias=bias, scale=scale, score_mod=score_mod,
      sinks=sinks, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
      return_weights=return_weights, return_lse=return_lse,
      return_max_logits=return_max_logits, pages=pages, partition=partition)
  return problem, candidates, automatic


def typed_partition(query) -> base.Partition | None:
  """The ``Partition`` a query's type states on explicit mesh axes.

  With ``AxisType.Explicit`` axes a sharding is part of the array's type
  (``jax.typeof(query).sharding.spec``): its batch and head entries (of
  ``[B, N, T, H]``: axes 0 and 1; of ``[B, T, H]``: axis 0) name the axes.
  On auto axes the sharding is chosen by XLA after tracing, invisible
  here: None (pass ``partition=`` there). Axes of other entries (the
  sequence) are not a partition's.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not hasattr(query, "shape"):  # (the caller checks too)
    return None
  explicit = {name for name, kind in zip(mesh.axis_names, mesh.axis_types)
              if kind == jax.sharding.AxisType.Explicit}
  if not explicit:
    return None
  try:
    spec = tuple(jax.typeof(query).sharding.spec)
  except (AttributeError, TypeError):
    return None
  rank = len(query.shape)
  spec += (None,) * (rank - len(spec))
  lead = spec[:rank - 2]
  dims = ((rank - 4, rank - 3) if rank >= 4 else
          (0, None) if rank == 3 else (None, None))

  def axes(dim):
    if dim is None:
      return ()
    entry = lead[dim]
    entry = () if entry is None else (
        (entry,) if isinstance(entry, str) else tuple(entry))
    return tuple(a for a in entry if a in explicit)

  batch, heads = axes(dims[0]), axes(dims[1])
  if not batch and not heads:
    return None
  return base.Partition(batch=batch, heads=heads)


def scaled_dot_product_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    mask: Mask | ArrayLike | BlockMask | None = None,
    *,
    bias: ArrayLike | None = None,
    scale: float | ArrayLike | None = None,
    is_causal: bool = False,
    score_mod: Any = None,
    sinks: ArrayLike | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    implementation: Any = None,
    return_weights: bool = False,
    return_lse: bool = False,
    return_max_logits: bool = False,
    partition: base.Partition | None = None,
) -> jax.Array | tuple[jax.Array, ...]:
  """``softmax(query @ key^T * scale + bias, where=mask) @ value``.

  Args:
    query: float ``[..., T, H]``.
    key: float ``[..., S, H]``. 4-D queries ``[B, N, T, H]`` against keys
      ``[B, K, S, H]`` with ``K`` dividing ``N`` is grouped-query
      attention: query head ``n`` uses key/value head ``n // (N / K)``
      (only in 4-D is axis 1 read as heads, as in jax.nn).
    value: float ``[..., S, Hv]``; ``Hv`` may differ from ``H``.
    mask: which (query, key) pairs may attend: an ``aj.Mask`` (causal,
      windows, query/key lengths, segment ids, a dense array and rules, in
      one value; the blockwise kernels skip the blocks it rules out), or a
      bool/integer array broadcastable to ``[..., T, S]`` of the logits'
      full rank (True / non-zero = may attend; ``Mask(dense=...)``), or an
      ``aj.BlockMask`` (a rule with precomputed block tables).
    bias: optional float added to the logits (after scaling), broadcastable to
      ``[..., T, S]``; ``-inf`` entries block like a False mask.
    scale: multiplier of ``query @ key^T``: a positive finite number or a
      float scalar array (a learned one may be traced); defaults to ``1 /
      sqrt(H)``.
    is_causal: shorthand for ``mask & aj.Mask(causal=True)`` (jax.nn's and
      torch's habit): query ``i`` may attend to key ``j`` only when ``j <= i
      + (S - T)`` (bottom-right aligned).
    score_mod: ``score_mod(score, b, h, q_idx, kv_idx)`` returns modified
      float32 scores (after scale and bias; ``aj.soft_cap(c)`` caps): ``b`` and
      ``h`` are the int32 batch and query-head indices (of ``[B, N, T, H]``
      operands: the last leading axis is ``h``, the one before ``b``; with
      one leading axis, ``b`` and ``h = 0``), ``q_idx``/``kv_idx`` broadcast
      integer query/key indices (``[T, 1]`` and ``[1, S]``, or one block's).
      ``-inf`` blocks an entry. It must be elementwise: its output at ``(i,
      j)`` reads ``score[i, j]``, ``b``, ``h``, ``q_idx[i]``, ``kv_idx[j]``
      and arrays indexed by them, never other scores (no sums, row
      statistics or sorts: each kernel holds other scores), and returns
      float scores of the score's shape; checked at the call (a jaxpr
      walk), for every kernel alike. Arrays travel inside it: ``aj.ScoreMod(fn,
      params)`` (a pytree; ``aj.alibi(slopes)``, ``aj.t5_relative_bias``)
      or a plain closure (not in ``ring_attention``, which needs them as a
      ``ScoreMod``); they are differentiated in every implementation.
    sinks: float broadcastable to the leading dims (``[N]`` or ``[B, N]``
      for ``[B, N, T, H]``): per-head sink logits; ``exp(sink)`` joins every
      row's softmax denominator, so weights sum to less than 1 (gpt-oss's
      learned sinks). Differentiable. The returned lse includes the sink.
    dropout_rate: probability of dropping an attention weight, in ``[0, 1)``.
      Kept weights are scaled by ``1 / (1 - dropout_rate)``.
    dropout_rng: ``jax.random.key``; required when ``dropout_rate > 0``.
    implementation: ``None`` (automatic), a kernel name (``"dense"``,
      ``"flash"``, ``"cudnn"``, ``"splash"``, ``"paged_tpu"``,
      ``"paged_gpu"`` (those two: paged calls only), ``"pallas_gpu"``), an
      ``aj.kernels`` kernel
      (``aj.kernels.Flash(block_q=512)``, ``aj.kernels.Ring("seq")``, one
      of your own) or a sequence of them to try in order. ``None`` walks
      ``aj.kernels.REGISTRY``: cuDNN (GPU), splash (TPU), Pallas GPU, the
      flash core (O(T + S) memory; no weights, dropout or float64), then
      dense (everything; the ``[T, S]`` scores), the others skipped below
      ``T * S`` = 1024 * 1024 scores; each kernel's ``supports`` says what
      it refuses. When nothing fits, the error lists each kernel's reason;
      ``aj.explain(...)`` shows the choice without running it. Every kernel
      gives the same numbers within float32 rounding (tested).
    return_weights: also return the attention weights (dense only).
    return_lse: also return the log-sum-exp of each row's allowed logits.
    return_max_logits: also return each row's largest raw logit (what
      QK-clip and logit-growth monitoring read; ``dense``, ``flash``
      and ring attention; the fused kernels refuse it and the automatic
      choice skips them).
    partition: how the leading dims are split over the ambient mesh
      (``jax.set_mesh``): an ``aj.kernels.Partition(batch=, heads=)`` of
      mesh axis names. A kernel XLA cannot partition (a Pallas call:
      ``pallas_gpu``, ``splash``, the paged kernels) then runs on each
      device's ``[B / P_b, N / P_h]`` slice inside ``jax.shard_map``
      instead of having its operands all-gathered (or refused on TPU);
      the pure-JAX kernels are split by XLA as they are. None: read off
      the query's type on a mesh of explicit axes (``AxisType.Explicit``:
      its batch and head axes' entries); on auto axes the sharding is not
      visible while tracing, so None there means no partition. The axes
      must be in the mesh and not manual (inside a ``jax.shard_map`` over
      them), their sizes must divide ``B``, ``N`` and ``K``; dropout is
      refused with a partition for a kernel that runs per shard.

  The leading dimensions ``...`` of all operands broadcast like NumPy's.
  Static arguments for ``jax.jit``: ``scale`` (if a Python float),
  ``is_causal``, ``dropout_rate``, ``implementation``, ``return_weights``,
  ``return_lse``, ``return_max_logits``; a ``Mask`` and a ``ScoreMod`` are
  pytrees (their structure static, their arrays traced).

  Returns:
    ``output`` ``[..., T, Hv]`` in the promoted dtype of the inputs; with
    ``return_weights=True`` also ``weights`` ``[..., T, S]``, the softmax
    probabilities before dropout (rows sum to 1, or are all 0 for a query
    that may attend to nothing, whose output is then 0); with
    ``return_lse=True`` also ``lse`` ``[..., T]`` (``-inf`` for such rows);
    with ``return_max_logits=True`` also ``max_logits`` ``[..., T]``: per
    query row, the maximum of the raw scaled logits ``scale * q . k`` over
    the keys it may attend to (after every mask field; ``-inf`` bias or
    ``score_mod`` entries block like the mask), before the bias, any
    ``score_mod`` (ALiBi, T5, soft cap) and sinks; ``-inf`` for a row with
    nothing to attend to. It does not depend on the values and is not
    differentiated (zero gradient, as ``lax.stop_gradient``). Weights, lse
    and max_logits are float32 (float64 for float64 inputs). Order: the
    output, then weights, lse and max_logits as asked for, e.g.
    ``(output, weights)``, ``(output, lse)``, ``(output, weights, lse)``,
    ``(output, lse, max_logits)`` or ``(output, max_logits)``.

  Raises:
    TypeError: non-float query/key/value/bias, a mask that is neither a
      ``Mask``, a ``BlockMask`` nor a bool/integer array, non-integer
      lengths or segment ids, a mask rule that does not return booleans, a
      ``score_mod`` that returns non-float scores, a non-number ``scale``.
    ValueError: ranks below 2, ``H`` or ``S`` mismatches, leading dims or
      masks/biases that do not broadcast, a dropout rate outside ``[0, 1)``
      or a positive rate without ``dropout_rng``, a ``scale`` that is not
      positive and finite, a ``score_mod`` that is not elementwise, an
      implementation that cannot do what was asked.

  Example:
    >>> q = jnp.ones((2, 4, 8))   # [B, T, H]
    >>> kv = jnp.ones((2, 6, 8))  # [B, S, H]
    >>> scaled_dot_product_attention(q, kv, kv, is_causal=True).shape
    (2, 4, 8)
    >>> out, w = scaled_dot_product_attention(q, kv, kv, return_weights=True)
    >>> w.shape
    (2, 4, 6)
    >>> out, max_logits = scaled_dot_product_attention(
    ...     q, kv, kv, is_causal=True, return_max_logits=True)
    >>> max_logits.shape  # [B, T]; per head: max_logits.max(axis=(0, -1))
    (2, 4)
  """
  out, weights, lse, max_logits = run(
      query, key, value, mask, bias=bias, scale=scale, is_causal=is_causal,
      score_mod=score_mod, sinks=sinks, dropout_rate=dropout_rate,
      dropout_rng=dropout_rng, implementation=implementation,
      return_weights=return_weights, return_lse=return_lse,
      return_max_logits=return_max_logits, partition=partition)
  extra = ((weights,) * bool(return_weights) + (lse,) * bool(return_lse)
           + (max_logits,) * bool(return_max_logits))
  return (out, *extra) if extra else out
