"""How a call's leading dims are split over mesh axes: ``Partition``, checked.

Shape glossary: B batch, N query heads, K key/value heads; ``...`` leading
dims.

``base.canonicalize`` checks a call's ``partition=`` here (only when one is
given); ``per_shard`` runs a kernel XLA cannot partition per shard of it.
"""

from __future__ import annotations

import dataclasses
import math

import jax


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Partition:
  """How a call's leading dims are split over mesh axes (static, hashable).

  ``batch``: the mesh axes the batch ``B`` is split over (of ``[B, N, T,
  H]`` operands the axis before the heads; of ``[B, T, H]`` the one
  leading axis); ``heads``: those the heads are split over (``N``, and
  ``K`` for grouped keys and values: after grouping, ``K``). A name or a
  tuple of names each, ``()``/None for none. A kernel XLA cannot partition
  (``Kernel.partitionable`` False: a Pallas call) then runs per shard
  inside ``jax.shard_map`` over these axes (``kernels.per_shard``); the
  others are left to XLA's partitioner, which splits them by itself.

  Example:
    >>> Partition(batch="data", heads="model")
    Partition(batch=('data',), heads=('model',))
  """
  batch: tuple[str, ...] = ()
  heads: tuple[str, ...] = ()

  def __post_init__(self):
    for name in ("batch", "heads"):
      value = getattr(self, name)
      value = () if value is None else (
          (value,) if isinstance(value, str) else value)
      if not isinstance(value, (tuple, list)) or not all(
          isinstance(a, str) and a for a in value):
        raise TypeError(
            f"Partition's {name} must be a mesh axis name or a tuple of "
            f"them (None for none), got {getattr(self, name)!r}.")
      object.__setattr__(self, name, tuple(value))
    twice = sorted({a for a in self.axes if self.axes.count(a) > 1})
    if twice:
      raise ValueError(
          f"Partition uses mesh axis {twice} more than once (batch="
          f"{self.batch}, heads={self.heads}): a mesh axis splits one "
          "dimension.")

  @property
  def axes(self) -> tuple[str, ...]:
    return self.batch + self.heads

  def __bool__(self) -> bool:
    return bool(self.axes)


def split_dims(ops) -> tuple[int | None, int | None]:
  """``(batch, heads)``: the positions of ``B`` and ``N`` among the
  caller's leading dims (``ops.leading``), as ``score_mod``'s ``(b, h)``
  count them: the last two of ``[..., B, N]``, the only one of ``[B]``
  (no heads), none without leading dims."""
  rank = len(ops.leading)
  if rank == 0:
    return None, None
  if rank == 1:
    return 0, None
  return rank - 2, rank - 1


def check_partition(partition, ops) -> Partition | None:
  """``partition`` checked against the ambient mesh and the operands:
  the ``Partition`` (None when it splits nothing).

  Every axis must be in the mesh (``jax.set_mesh``) and not manual (inside
  a ``jax.shard_map`` over it the operands are already one device's
  shard: refused, as splitting them again would be wrong); the product of
  the batch axes' sizes must divide ``B``, that of the heads axes ``N``
  and ``K``.
  """
  if partition is None:
    return None
  if not isinstance(partition, Partition):
    raise TypeError(
        f"partition must be an aj.kernels.Partition (e.g. Partition(batch="
        f"'data', heads='model')) or None, got {partition!r}.")
  if not partition:
    return None
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    raise ValueError(
        f"{partition} names mesh axes, but no mesh is set: call inside "
        "`with jax.set_mesh(mesh):` (or pass partition=None).")
  for axis in partition.axes:
    if axis not in mesh.axis_names:
      raise ValueError(
          f"{partition} names mesh axis {axis!r}, which the mesh does not "
          f"have (its axes: {tuple(mesh.axis_names)}).")
    kind = mesh.axis_types[mesh.axis_names.index(axis)]
    if kind == jax.sharding.AxisType.Manual:
      raise ValueError(
          f"{partition} names mesh axis {axis!r}, which is manual here "
          "(inside a jax.shard_map over it): the operands are already one "
          "device's shard along it; leave it out of the partition.")
  batch_dim, head_dim = split_dims(ops)
  lead = ops.leading
  for what, axes, dim in (("batch", partition.batch, batch_dim),
                          ("heads", partition.heads, head_dim)):
    if not axes:
      continue
    if dim is None:
      layout = ("[B, N, T, H] operands (4-D: the heads are axis 1)"
                if what == "heads" else "operands with a batch axis")
      raise ValueError(
          f"{partition} splits the {what} over {axes}, but the operands' "
          f"leading dims are {lead}: it needs {layout}.")
    size = math.prod(mesh.shape[a] for a in axes)
    counts = {"B": lead[dim]} if what == "batch" else {"N": lead[dim]}
    if what == "heads" and ops.groups is not None:
      counts["K"] = ops.groups.num_kv_heads
    for letter, n in counts.items():
      if n % size:
        raise ValueError(
            f"{partition} splits the {what} over mesh axes {axes} of size "
            f"{size}, which does not divide {letter} = {n} (leading dims "
            f"{lead}): each device must hold whole {what}; use axes whose "
            f"sizes divide {letter}, or leave the {what} unsplit.")
  return partition
