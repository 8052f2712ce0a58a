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
checked by one shared test suite; docs/options.md states it with every
option.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
import numpy as np

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
  elif (kernel.jit and not isinstance(problem.ops.query, jax.core.Tracer)
        and not isinstance(jnp.zeros(()), jax.core.Tracer)):
    # An eager call (its query concrete, and no trace under way: a
    # constant made now is concrete; under jit or eval_shape it is not,
    # and the enclosing trace compiles the kernel anyway): one program.
    call = functools.partial(compiled, kernel)
  if kernel.forward_mode:
    result = call(problem)
  else:  # jax.jvp through it raises a ValueError naming it
    result = forward_mode.run(kernel, call, problem)
  return base.asked_result(kernel, problem, result)


def compiled(kernel: base.Kernel, problem: base.Problem):
  """``kernel(problem)`` (a kernel that says ``jit = True``) under
  ``jax.jit`` when no array of the problem is traced already (an eager
  call): one program for the kernel instead of one compiled and
  dispatched per operation (15% fewer CPU-seconds over four layer test
  files). The arrays are its arguments; everything else of the record
  (its structure, Python numbers, callables, the kernel) keys its cache,
  so an eager call with another mask structure or score modifier
  compiles once more. A record with something unhashable runs as it is.
  """
  leaves, tree = jax.tree.flatten(problem)
  arrays, static = [], []
  for x in leaves:
    if isinstance(x, jax.core.Tracer):  # (under a transformation)
      return kernel(problem)
    array = isinstance(x, (jax.Array, np.ndarray))
    arrays += [x] if array else []
    static.append(None if array else x)  # (a pytree has no None leaf)
  try:
    hash((kernel, tree, tuple(static)))
  except TypeError:
    return kernel(problem)
  return _jitted(kernel, tree, tuple(static), *arrays)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _jitted(kernel, tree, static, *arrays):
  leaves, arrays = list(static), iter(arrays)
  for i, x in enumerate(leaves):
    if x is None:  # an array's place
      leaves[i] = next(arrays)
  return kernel(jax.tree.unflatten(tree, leaves))


def prepare(query, key, value, mask=None, *, bias=None, scale=None,
            is_causal: bool = False, score_mod=None, sinks=None,
            dropout_rate=0.0, dropout_rng=None, implementation: Any = None,
            return_weights: bool = False, return_lse: bool = False,
            return_max_logits: bool = False, pages=None, partition=None):
  """A call normalised once: ``(problem, kernels to try, automatic)``
  (what ``run`` runs and ``aj.explain`` reports). ``partition`` None is
  read off the query's type on a mesh of explicit axes
  (``typed_partition``)."""
  if is_causal is not False:
    checks.check_static_bool("is_causal", is_causal)
  if is_causal or not isinstance(mask, Mask):  # (a Mask is converted)
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

  The one complete in-code statement of the options every attention entry
  point shares; docs/options.md gives each at length (shapes, defaults,
  which kernels implement it), the contract and what differs per entry
  point.

  Args:
    query: float ``[..., T, H]``.
    key: float ``[..., S, H]``. 4-D queries ``[B, N, T, H]`` against keys
      ``[B, K, S, H]`` with ``K`` dividing ``N`` is grouped-query
      attention: query head ``n`` reads key/value head ``n // (N / K)``
      (only in 4-D is axis 1 read as heads, as in jax.nn).
    value: float ``[..., S, Hv]``; ``Hv`` may differ from ``H``.
    mask: which (query, key) pairs may attend. None: all; an ``aj.Mask``
      (causal, window, lengths, segment ids, positions, a dense array and a
      rule, intersected; the blockwise kernels skip the blocks it rules
      out); a bool/integer array broadcastable to ``[..., T, S]``, of the
      logits' full rank (True / non-zero = may attend:
      ``Mask(dense=...)``); or an ``aj.BlockMask``.
    bias: float broadcastable to ``[..., T, S]``, added to the logits after
      scaling; ``-inf`` entries block like a False mask. Differentiable.
    scale: multiplier of ``query @ key^T``: a positive finite number or a
      float scalar array (a learned one may be traced); default ``1 /
      sqrt(H)``.
    is_causal: shorthand for ``mask & aj.Mask(causal=True)``: query ``i``
      attends to key ``j`` only when ``j <= i + (S - T)`` (bottom-right
      aligned).
    score_mod: ``score_mod(score, b, h, q_idx, kv_idx)`` returning the
      modified float32 scores (after scale and bias; ``-inf`` blocks):
      ``b``, ``h`` the batch and query-head indices, ``q_idx``/``kv_idx``
      broadcast query/key indices (positions when the mask gives them).
      It must be elementwise (checked at the call); its arrays travel in an
      ``aj.ScoreMod(fn, params)`` or a closure and are differentiated
      (``aj.soft_cap``, ``aj.alibi``, ``aj.t5_relative_bias``).
    sinks: per-head sink logits broadcastable to the leading dims (``[N]``
      or ``[B, N]``): ``exp(sink)`` joins each row's softmax denominator
      (the lse includes it). Differentiable.
    dropout_rate: probability of dropping a weight, in ``[0, 1)``; kept
      weights are scaled by ``1 / (1 - dropout_rate)``. Every kernel with
      dropout draws the same bits.
    dropout_rng: ``jax.random.key``; required when ``dropout_rate > 0``.
    implementation: None (automatic: the first kernel of
      ``aj.kernels.REGISTRY`` that takes the call; all but dense decline
      below ``T * S`` = 1024 * 1024 scores), a kernel name (``"dense"``,
      ``"flash"``, ``"cudnn"``, ``"splash"``, ``"pallas_gpu"``,
      ``"paged_gpu"``, ``"paged_tpu"``), an ``aj.kernels`` kernel
      (``aj.kernels.Flash(block_q=512)``, one of your own) or a sequence of
      them to try in order. When none fits, the error gives each one's
      reason; ``aj.explain(...)`` shows the choice without running it.
    return_weights: also return the attention weights (dense only).
    return_lse: also return the log-sum-exp of each row's allowed scores.
    return_max_logits: also return each row's largest raw logit ``scale *
      q . k`` over the keys it may attend to, before bias, ``score_mod``
      and sinks (QK-clip, logit-growth monitoring; dense, flash and ring).
    partition: an ``aj.kernels.Partition(batch=, heads=)`` of axes of the
      ambient mesh (``jax.set_mesh``) the leading dims are split over: a
      kernel XLA cannot partition (a Pallas call) then runs per shard
      inside ``jax.shard_map``; their sizes must divide ``B``, ``N`` and
      ``K``. None: read off the query's type on explicit mesh axes, else
      no partition.

  Static under ``jax.jit``: ``is_causal``, ``implementation``, the
  ``return_*`` flags, ``dropout_rate`` and a Python-float ``scale``; a
  ``Mask`` and a ``ScoreMod`` are pytrees (structure static, arrays
  traced).

  Returns:
    ``output [..., T, Hv]`` in the inputs' promoted dtype; then, as asked
    and in this order, ``weights [..., T, S]`` (the softmax before
    dropout), ``lse [..., T]`` and ``max_logits [..., T]`` (float32;
    float64 for float64 inputs), e.g. ``(output, lse)``. A query that may
    attend to nothing gets output and weights 0, lse and max_logits
    ``-inf``, and zero gradients; ``max_logits`` has no gradient.

  Raises:
    TypeError: non-float query/key/value/bias, a mask that is neither a
      ``Mask``, a ``BlockMask`` nor a bool/integer array, non-integer
      lengths or segment ids, a rule that does not return booleans, a
      ``score_mod`` that returns non-float scores, a non-number ``scale``.
    ValueError: ranks below 2, ``H`` or ``S`` mismatches, leading dims or
      masks/biases that do not broadcast, a dropout rate outside ``[0, 1)``
      or a positive rate without ``dropout_rng``, a ``scale`` that is not
      positive and finite, a ``score_mod`` that is not elementwise, a call
      no candidate kernel takes (each one's reason).

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
