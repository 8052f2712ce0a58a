"""A kernel XLA cannot partition, run per shard inside ``jax.shard_map``.

Shape glossary: B batch, N query heads, K key/value heads, G = N / K query
heads per key/value head, T query length, S key/value length, H head dim,
Hv value head dim, P devices along the partition's axes; ``...`` leading
dims.

A Pallas call (``PallasGpu``, ``Splash``, the paged kernels) is one opaque
custom call: XLA's SPMD partitioner cannot split it over sharded batch and
head dims, so it refuses ("cannot be automatically partitioned") or
all-gathers the operands. Attention is independent per example and per
key/value head, so a call whose ``Problem`` carries a
``base.Partition`` runs the kernel on each device's ``[B / P_b, N / P_h]``
slice instead: ``run`` maps the problem's arrays into ``jax.shard_map``
over the partition's axes, each leaf's spec read from its role (the
leading dims it has, right-aligned to the call's grouped leading dims
``[..., B, K, G]``: after grouping the heads split is a split of ``K``;
size-1 dims are shared, so replicated), and rebuilds the ``Problem`` with
the shard's shapes inside. What is split: the query, keys and values,
the dense mask and bias ``[B|1, N|1, T, S]``, lengths and positions
``[B|1, N|1]``, segment ids, sinks, per-(b, h) block tables, the (b, h)
indices ``score_mod`` and rules see (so each shard's ``score_mod`` sees
the global ``(b, h)``), and a paged call's pools (along ``K``) and page
table (along ``B``; a traced scale is already in the queries). Replicated:
a ``ScoreMod``'s or ``MaskRule``'s params (their gradients are summed over the shards by
``shard_map``'s transpose). Static parts (callables, window, causality,
groups, shapes) stay closed over, with the global shapes rewritten to the
shard's. The results come back split as ``[B, N]``.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec
import numpy as np

from attention_jax.kernels import base
from attention_jax.masking import mask as mask_lib


def run(kernel: base.Kernel, problem: base.Problem) -> base.Result:
  """``kernel(problem)`` on each shard of ``problem.partition``.

  Raises:
    ValueError: dropout (each shard would draw its own masks, unlike the
      unsharded call), or a kernel that refuses the shard's problem (e.g.
      ``Splash`` with a rule reading ``b``/``h`` along a split axis: it
      evaluates rules on the host, and a shard's offset is known only on
      device).
  """
  partition = problem.partition
  if problem.dropout_on:
    raise ValueError(
        f"kernel {kernel.name!r} runs per shard of {partition} (XLA cannot "
        "partition it), and dropout there would draw each shard's mask from "
        "the same key at the shard's shape: not the unsharded call's masks. "
        "Use a kernel XLA partitions (implementation='dense') for dropout, "
        "or partition=None.")
  mesh = jax.sharding.get_abstract_mesh()
  ops = problem.ops
  batch_dim, head_dim = base.split_dims(ops)
  # Per caller leading dim: the mesh axes it is split over (or None).
  entries = [None] * len(ops.leading)
  sizes = [1] * len(ops.leading)
  for dim, axes in ((batch_dim, partition.batch), (head_dim, partition.heads)):
    if axes:
      entries[dim] = axes if len(axes) > 1 else axes[0]
      sizes[dim] = math.prod(mesh.shape[a] for a in axes)
  # The same over the grouped leading dims [..., B, K, G]: G is not split.
  grouped_entries, grouped_sizes = list(entries), list(sizes)
  if ops.groups is not None:
    grouped_entries.append(None)
    grouped_sizes.append(1)
  grouped = _Layout(tuple(ops.batch_shape), tuple(grouped_entries),
                    tuple(grouped_sizes))
  caller = _Layout(tuple(ops.leading), tuple(entries), tuple(sizes))

  # The rule's (b, h) as the shard's global indices, when it reads one
  # along a split axis (the kernels build tables over the shard's own).
  bm = ops.rule
  if bm is not None and _reads_split(bm.mask_fn, ops, sizes):
    local_b = ops.leading[batch_dim] // sizes[batch_dim]
    local_h = 1 if head_dim is None else (
        ops.leading[head_dim] // sizes[head_dim])
    bm = _globalized(bm, local_b, local_h)

  # Every array leaf becomes an operand with its spec; the rest is static.
  # Concrete arrays every shard sees whole stay constants (Splash reads
  # its masks and rules' arrays on the host).
  leaves = _roles(ops._replace(rule=bm), problem, grouped)
  constant = [not isinstance(x, jax.core.Tracer) and not any(spec)
              for _, x, spec in leaves]
  arrays = [x for (_, x, _), c in zip(leaves, constant) if not c]
  specs = tuple(spec for (_, _, spec), c in zip(leaves, constant) if not c)
  shifted = bm is not ops.rule

  def shard(*arrays):
    given = iter(arrays)
    values = [x if c else next(given)
              for (_, x, _), c in zip(leaves, constant)]
    local = _rebuild(problem, ops, bm, leaves, values, grouped, caller)
    if shifted:
      local = _with_offsets(local, partition, batch_dim, head_dim, caller)
    reason = base.refusal(kernel, local)
    if reason is not None:
      raise ValueError(
          f"kernel {kernel.name!r} runs per shard of {partition} (XLA cannot "
          f"partition it), and refuses the shard's problem: {reason}.")
    # Only what the call asked for leaves the shards (out_specs).
    return base.asked_result(kernel, local, kernel(local))

  out_specs = _result_specs(problem, caller)
  # Manual over every axis not manual already: the mesh's other axes see
  # each operand whole (replicated along them, as XLA would have to place
  # an opaque call), and eager calls work (JAX runs a shard_map with some
  # axes left auto only under jit). check_vma off: a pallas_call's outputs
  # carry no varying-axes type.
  manual = frozenset(
      name for name, kind in zip(mesh.axis_names, mesh.axis_types)
      if kind != jax.sharding.AxisType.Manual)
  return jax.shard_map(shard, mesh=mesh, in_specs=specs, out_specs=out_specs,
                       axis_names=manual, check_vma=False)(*arrays)


class _Layout:
  """Leading dims, the mesh axes each is split over, and by how much."""

  def __init__(self, shape, entries, sizes):
    self.shape, self.entries, self.sizes = shape, entries, sizes

  def spec(self, x_shape, core: int) -> PartitionSpec:
    """The spec of an array whose last ``core`` dims are its own and whose
    leading dims right-align to these (size 1: shared, so replicated)."""
    lead = x_shape[:len(x_shape) - core]
    skip = len(self.shape) - len(lead)
    spec = [self.entries[skip + i] if n > 1 else None
            for i, n in enumerate(lead)]
    return PartitionSpec(*spec, *(None,) * core)

  def local(self, x_shape, core: int) -> tuple[int, ...]:
    """A shape as one shard holds it."""
    lead = x_shape[:len(x_shape) - core]
    skip = len(self.shape) - len(lead)
    return tuple(n // self.sizes[skip + i] if n > 1 else n
                 for i, n in enumerate(lead)) + tuple(x_shape[len(lead):])


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, jax.core.Tracer))


# The core dims (what is not a leading dim) of each per-head operand.
_CORE = {"query": 2, "key": 2, "value": 2, "dense": 2, "bias": 2,
         "kv_lengths": 0, "q_lengths": 0, "q_segment_ids": 1,
         "kv_segment_ids": 1, "sinks": 0, "q_offset": 0, "kv_offset": 0}


def _roles(ops, problem, grouped: _Layout):
  """``[(where, array, spec)]`` for every array the kernel reads."""
  found = []
  for name, core in _CORE.items():
    x = getattr(ops, name)
    if _is_array(x):
      found.append((("ops", name), x, grouped.spec(np.shape(x), core)))
  if ops.head_index is not None:
    for i, x in enumerate(ops.head_index):
      found.append((("head_index", i), x, grouped.spec(np.shape(x), 0)))
  bm = ops.rule
  if bm is not None:
    for i, x in enumerate(bm.tables):
      if x is not None:  # [..., nq, nk|m]: per (b, h) like a mask
        found.append((("tables", i), x, grouped.spec(np.shape(x), 2)))
    if isinstance(bm.mask_fn, mask_lib.MaskRule):
      for i, x in enumerate(jax.tree.leaves(bm.mask_fn)):
        found.append((("rule", i), x, PartitionSpec()))  # global indices
  if ops.score_mod is not None:
    for i, x in enumerate(jax.tree.leaves(ops.score_mod)):
      if _is_array(x):
        found.append((("score_mod", i), x, PartitionSpec()))
  pages = problem.pages
  if pages is not None:
    b_entry = grouped.entries[0] if len(grouped.entries) > 1 else None
    k_entry = grouped.entries[1] if len(grouped.entries) > 1 else None
    for name, spec in (("key_pages", (None, k_entry)),
                       ("value_pages", (None, k_entry)),
                       ("table", (b_entry,)),
                       ("key_scales", (None, k_entry)),
                       ("value_scales", (None, k_entry)),
                       ("finite", ())):
      x = getattr(pages, name)
      if x is not None:
        found.append((("pages", name), x, PartitionSpec(*spec)))
  return found


def _rebuild(problem, ops, bm, leaves, values, grouped, caller):
  """The shard's ``Problem``: its arrays, and the shapes it holds."""
  got = {where: x for (where, _, _), x in zip(leaves, values)}
  fields = {name: got.get(("ops", name), getattr(ops, name))
            for name in _CORE}
  for name in ("key", "value"):  # a paged call's stand-ins: shapes only
    x = fields[name]
    if isinstance(x, jax.ShapeDtypeStruct):
      fields[name] = jax.ShapeDtypeStruct(grouped.local(x.shape, 2), x.dtype)
  head_index = ops.head_index
  if head_index is not None:
    head_index = tuple(got[("head_index", i)] for i in range(2))
  if bm is not None:
    tables = tuple(got.get(("tables", i)) for i in range(5))
    fn = bm.mask_fn
    if isinstance(fn, mask_lib.MaskRule):
      rule_leaves = [got[("rule", i)]
                     for i in range(len(jax.tree.leaves(fn)))]
      fn = jax.tree.unflatten(jax.tree.structure(fn), rule_leaves)
    bm = mask_lib.BlockMask(fn, bm.q_len, bm.kv_len, bm.block_q, bm.block_k,
                            *tables)
  score_mod = ops.score_mod
  if score_mod is not None:
    mod_leaves, tree = jax.tree.flatten(score_mod)
    mod_leaves = [got.get(("score_mod", i), x)
                  for i, x in enumerate(mod_leaves)]
    score_mod = jax.tree.unflatten(tree, mod_leaves)
  groups = ops.groups
  if groups is not None:
    heads = caller.sizes[-1]
    groups = base.Groups(groups.num_heads // heads,
                             groups.num_kv_heads // heads)
  local_ops = ops._replace(
      **fields, head_index=head_index, rule=bm, score_mod=score_mod,
      groups=groups, batch_shape=grouped.local(ops.batch_shape, 0),
      leading=caller.local(ops.leading, 0))
  pages = problem.pages
  if pages is not None:
    pages = pages._replace(**{
        name: got[("pages", name)] for name in pages._fields
        if ("pages", name) in got})
  return problem._replace(
      ops=local_ops, pages=pages,
      mask=_shapes_only(problem.mask), partition=None)


def _shapes_only(mask):
  """The call's whole mask with its arrays as ``ShapeDtypeStruct``s: the
  shard's problem still lists its fields (``Problem.features``), and a
  kernel reading its global arrays would fail rather than misread them."""
  if mask is None:
    return None
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype)
      if _is_array(x) else x, mask)


def _result_specs(problem, caller: _Layout) -> base.Result:
  """``Result`` of specs: ``out [..., N, T, Hv]`` and the rest split as
  ``[B, N]``; None where the problem asks for nothing."""
  lead = tuple(caller.shape)
  two = caller.spec(lead + (1, 1), 2)
  one = caller.spec(lead + (1,), 1)
  return base.Result(two, two if problem.return_weights else None,
                     one if problem.return_lse else None,
                     one if problem.return_max_logits else None)


def _reads_split(mask_fn, ops, sizes) -> bool:
  """Whether a rule reads ``b`` or ``h`` along a split leading dim."""
  s = ops.key.shape[-2]
  needed = base.rule_batch(mask_fn, ops.leading, s)
  return any(n > 1 and split > 1 for n, split in zip(needed, sizes))


class _GlobalIndices:
  """A rule evaluated at the global ``(b, h)`` of a shard's local or
  global ones: ``b0 + b % Bl`` (``b0`` the shard's first example, a
  multiple of its ``Bl`` examples), so the kernels' table building (over
  the shard's ``0..Bl-1``) and the per-head evaluation (the sharded, global
  indices) both reach the caller's ``b``; ``h`` likewise."""

  def __init__(self, rule, local_b: int, local_h: int):
    self.rule, self.local_b, self.local_h = rule, local_b, local_h

  def __call__(self, b, h, q_idx, kv_idx, params):
    inner, b0, h0 = params
    b = b0 + b % self.local_b
    h = h0 + h % self.local_h
    if inner is None:
      return self.rule(b, h, q_idx, kv_idx)
    return self.rule(b, h, q_idx, kv_idx, inner)

  def __eq__(self, other):
    return (type(other) is _GlobalIndices and other.rule == self.rule
            and other.local_b == self.local_b
            and other.local_h == self.local_h)

  def __hash__(self):
    return hash((_GlobalIndices, self.rule, self.local_b, self.local_h))


def _globalized(bm, local_b: int, local_h: int):
  """``bm`` whose rule sees global ``(b, h)`` (offsets filled in per shard,
  ``_with_offsets``; zeros until then)."""
  fn = bm.mask_fn
  zero = np.zeros((), np.int32)
  if isinstance(fn, mask_lib.MaskRule):
    rule = mask_lib.MaskRule(_GlobalIndices(fn.fn, local_b, local_h),
                             (fn.params, zero, zero), fn.examples)
  else:
    rule = mask_lib.MaskRule(_GlobalIndices(fn, local_b, local_h),
                             (None, zero, zero),
                             getattr(fn, "examples", None))
  return mask_lib.BlockMask(rule, bm.q_len, bm.kv_len, bm.block_q,
                            bm.block_k, *bm.tables)


def _with_offsets(problem, partition, batch_dim, head_dim, caller):
  """The shard's first ``(b, h)`` put into its globalized rule."""
  ops = problem.ops
  bm = ops.rule
  rule = bm.mask_fn
  inner = rule.params[0]
  b0 = h0 = np.zeros((), np.int32)
  local = caller.local(caller.shape, 0)  # [..., B / P_b, N / P_h]
  if partition.batch:
    b0 = (jax.lax.axis_index(partition.batch)
          * local[batch_dim]).astype(np.int32)
  if partition.heads:
    h0 = (jax.lax.axis_index(partition.heads)
          * local[head_dim]).astype(np.int32)
  rule = mask_lib.MaskRule(rule.fn, (inner, b0, h0), rule.examples)
  bm = mask_lib.BlockMask(rule, bm.q_len, bm.kv_len, bm.block_q, bm.block_k,
                          *bm.tables)
  return problem._replace(ops=ops._replace(rule=bm))

