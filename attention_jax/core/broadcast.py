"""A head's view of the call: grouped-query heads, and one vmap per leading dim.

Shape glossary: T query length, S key/value length, N query heads, K
key/value heads (K divides N), G = N // K query heads per key/value head,
H head dim, Hv value head dim; ``...`` leading batch dims.

The attention maths in this package is written for one head and one example
(``[T, H]`` queries against ``[S, H]`` keys). ``broadcast_vmap`` lifts such a
function to operands with any leading batch dimensions that broadcast like
NumPy's: one ``jax.vmap`` per leading dimension, mapping the operands that
have that dimension and passing the others (size 1 or absent) unmapped. A
size-1 key/value head dimension against ``G`` query heads is therefore shared,
never copied, which is how grouped-query attention stays cheap.
``lift_heads`` runs a kernel's single-head function so, handing it a
``Head`` of that head's operands, and returns a ``Result``.

Grouped-query attention as a reshape (``find_groups``, ``split_groups``,
``merge_groups``): the attention functions take 4-D queries ``[B, N, T,
H]`` with keys/values ``[B, K, S, H]`` (jax.nn's rule, in our layout: only
in 4-D is axis 1 the head axis; in ``[B, T, H]`` or 5-D operands a size
mismatch is a broadcast error, never read as heads). When ``K`` is neither
``N`` nor 1 (those broadcast as they are), the head axis is split: queries
become ``[..., K, G, T, H]`` and keys/values ``[..., K, 1, S, H]``, so
ordinary broadcasting shares each key/value head with its G query heads,
unmapped by ``vmap`` and never copied; masks, biases and lengths with a
head axis of N are split the same way. Query head ``n`` uses key/value
head ``n // G``, as in jax.nn and torch.
"""


from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax


class Groups(NamedTuple):
  num_heads: int  # N
  num_kv_heads: int  # K


def find_groups(q_shape, k_shape) -> Groups | None:
  """The grouping of ``[..., N, T, H]`` over ``[..., K, S, H]``, or None.

  None when there is nothing to group: operands that are not both 4-D, or
  ``K`` in ``(1, N)``. A ``K`` that does not divide ``N`` is left to the
  broadcast check, whose error names both shapes.
  """
  if len(q_shape) != 4 or len(k_shape) != 4:
    return None
  n, k = q_shape[-3], k_shape[-3]
  if k in (1, n) or n % k:
    return None
  return Groups(n, k)


def split_groups(x, groups: Groups | None, axis: int):
  """Splits ``x``'s head ``axis`` (negative) of size N, K or 1 into two."""
  if x is None or groups is None or x.ndim < -axis:
    return x
  size = x.shape[axis]
  if size == groups.num_heads:
    new = (groups.num_kv_heads, size // groups.num_kv_heads)
  elif size == groups.num_kv_heads:
    new = (size, 1)
  else:  # 1: broadcast over every head
    new = (1, 1)
  pos = x.ndim + axis
  return x.reshape(x.shape[:pos] + new + x.shape[pos + 1:])


def merge_groups(x: jax.Array | None, groups: Groups | None, axis: int):
  """Inverse of ``split`` for results: ``[..., K, G, ...] -> [..., N, ...]``."""
  if x is None or groups is None:
    return x
  pos = x.ndim + axis  # the G axis
  return x.reshape(x.shape[:pos - 1] + (x.shape[pos - 1] * x.shape[pos],)
                   + x.shape[pos + 1:])


def broadcast_vmap(fn: Callable[..., Any], core_ndims: Sequence[int],
                   operands: Sequence[Any], sequential: Any = (),
                   group: int = 1) -> Any:
  """Applies ``fn`` to operands with broadcast leading (batch) dimensions.

  Args:
    fn: function of the per-example operands (``None`` operands are passed
      through as ``None``).
    core_ndims: for each operand, how many trailing dimensions ``fn`` sees.
    operands: arrays (or ``None``) whose leading dims, beyond their core dims,
      broadcast against each other. The caller has validated that they do.
    sequential: indices of operands whose non-trivial leading dims are
      mapped with ``lax.map`` (one slice after another) instead of
      ``vmap``: under ``vmap`` a kernel's data-dependent control flow (block
      loops and ``cond`` over per-example block tables) would run every
      branch and the longest loop for every slice.
    group: with ``sequential``, the innermost mapped dim runs ``group``
      slices at a time (``lax.map``'s ``batch_size``: ``vmap`` inside).

  Returns:
    ``fn``'s outputs with the broadcast batch shape prepended to each leaf.
  """
  batch_ndim = max((op.ndim - c for op, c in zip(operands, core_ndims)
                    if op is not None), default=0)
  padded = []
  for op, c in zip(operands, core_ndims):
    if op is not None:
      op = op.reshape((1,) * (batch_ndim - (op.ndim - c)) + op.shape)
    padded.append(op)
  return _map_leading(fn, batch_ndim, tuple(padded), frozenset(sequential),
                      group)


def _map_leading(fn, depth: int, ops: tuple[Any, ...], sequential,
                 group: int = 1) -> Any:
  if depth == 0:
    return fn(*ops)
  # Operands whose leading size is 1 are shared across this dimension.
  in_axes = tuple(None if op is None or op.shape[0] == 1 else 0 for op in ops)
  ops = tuple(op[0] if op is not None and ax is None else op
              for op, ax in zip(ops, in_axes))
  inner = lambda *o: _map_leading(fn, depth - 1, o, sequential, group)
  if all(ax is None for ax in in_axes):
    return jax.tree.map(lambda x: x[None], inner(*ops))
  if any(in_axes[i] == 0 for i in sequential):
    mapped = [i for i, ax in enumerate(in_axes) if ax == 0]

    def one(slices):
      full = list(ops)
      for i, x in zip(mapped, slices):
        full[i] = x
      return inner(*full)

    # Slices a group at a time (vmap inside) at the innermost leading dim.
    return jax.lax.map(one, [ops[i] for i in mapped],
                       batch_size=group if depth == 1 and group > 1 else None)
  return jax.vmap(inner, in_axes=in_axes)(*ops)


class Result(NamedTuple):
  """What every kernel returns: named, absent values None.

  ``out [..., N, T, Hv]``; ``weights [..., N, T, S]`` (only a kernel that
  forms them, when ``return_weights``), ``lse [..., N, T]`` and
  ``max_logits [..., N, T]`` when asked for. Heads merged again.
  """
  out: jax.Array
  weights: jax.Array | None = None
  lse: jax.Array | None = None
  max_logits: jax.Array | None = None


class Head(NamedTuple):
  """One head's operands besides q, k, v, as the kernels see them (None =
  absent); a pytree.

  ``lift_heads`` slices them per head; the flash core pads the arrays to
  whole blocks (``flash_core.padded_head``) and adds the last four fields.
  """
  dense: jax.Array | None = None  # bool [T|1, S|1]
  bias: jax.Array | None = None  # float [T|1, S|1]
  kv_lengths: jax.Array | None = None  # int32 scalar: valid keys
  q_lengths: jax.Array | None = None  # int32 scalar: valid queries
  q_segment_ids: jax.Array | None = None  # int32 [T]
  kv_segment_ids: jax.Array | None = None  # int32 [S]
  sink: jax.Array | None = None  # float scalar
  index: tuple | None = None  # int32 scalars (b, h) for score_mod, or None
  rule: Any = None  # a BlockMask (this head's [nq, nk] tables) or None
  # int32 scalars: positions of query row 0 and key column 0 (the mask's
  # q_offset/kv_offset), or None for the bottom-right alignment
  q_offset: jax.Array | None = None
  kv_offset: jax.Array | None = None
  # The values score_mod closes over that may carry gradients
  # (flash_core.hoist_score_mod), passed whole.
  mod_consts: tuple = ()
  # bool scalar: whether any of the call's q, k, v holds a NaN or inf; when
  # False the flash walk skips looking for the rows that see one (a
  # lax.cond per block: unbatched, so it stays a branch under the heads'
  # vmap). None: always look.
  garbage: jax.Array | None = None
  # float32 [Tp] / [Sp]: each query row's / key row's numerics code, made
  # once per head (flash_core.single_head) so the walk reads them per block
  # instead of reducing each loaded block; None: the walk reduces.
  q_code: jax.Array | None = None
  kv_code: jax.Array | None = None

  def offsets(self, t: int, s: int):
    """``(offset, q_start, kv_start)``: query row ``r`` stands at key column
    ``r + offset`` (causality, windows); rules and score modifiers see
    ``q_start + r`` and ``kv_start + c``."""
    if self.q_offset is None:
      return s - t, 0, 0
    return self.q_offset - self.kv_offset, self.q_offset, self.kv_offset


def lift_heads(head_fn: Callable[..., Any], ops, extra: Sequence[Any] = (),
               extra_core_ndims: Sequence[int] = (), *,
               one_at_a_time: int = 0):
  """Runs a single-head kernel over validated operands (``operands.Operands``).

  ``head_fn(q, k, v, head, *extra)`` sees ``[T, H]``, ``[S, H]``,
  ``[S, Hv]`` and a ``Head`` of the other operands, and returns
  ``(out [T, Hv], weights [T, S] or None, lse [T] or None)``, or those and
  ``max_logits [T]`` (``return_max_logits``). The results come back over
  the leading dims with grouped heads merged again (``[..., N, T, Hv]``),
  as the kernel's ``Result`` (what ``head_fn`` did not return is None).
  ``one_at_a_time`` > 0: the heads run that many at a time, one group
  after another (``lax.map`` over every leading dim the queries have, its
  ``batch_size`` at the innermost) instead of all under ``vmap``: a block
  loop then works on one head's ``[bq, bk]`` block at a time, which stays
  in cache, where ``vmap`` makes every pass of the loop body walk the
  blocks of all heads at once through memory.
  """
  b, h = (None, None) if ops.head_index is None else ops.head_index
  # A block mask with per-(b, h) tables is sliced per head like a mask;
  # one without leading dims is shared.
  bm = ops.rule
  per_head_tables = bm is not None and bm.batch_shape
  tables = bm.tables if per_head_tables else ()
  # (operand, its core ndims): what one head sees of each
  fixed = ((ops.query, 2), (ops.key, 2), (ops.value, 2), (ops.dense, 2),
           (ops.bias, 2), (ops.kv_lengths, 0), (ops.q_lengths, 0),
           (ops.q_segment_ids, 1), (ops.kv_segment_ids, 1), (ops.sinks, 0),
           (b, 0), (h, 0),
           (ops.q_offset, 0), (ops.kv_offset, 0))
  operands = (*(x for x, _ in fixed), *tables, *extra)
  core = (*(c for _, c in fixed), *(2,) * len(tables), *extra_core_ndims)

  def per_head(q, k, v, mask, bias, kv_lengths, q_lengths, q_segment_ids,
               kv_segment_ids, sink,
               b, h, q_offset, kv_offset, *rest):
    head_bm = bm
    if per_head_tables:
      head_bm = bm.with_tables(rest[:len(tables)])
    head = Head(mask, bias, kv_lengths, q_lengths, q_segment_ids, kv_segment_ids, sink,
                None if b is None else (b, h), head_bm, q_offset, kv_offset)
    return head_fn(q, k, v, head, *rest[len(tables):])

  first_table = len(fixed)  # the index of the tables among the operands
  sequential = tuple(range(first_table, first_table + len(tables)))
  if one_at_a_time:
    sequential = (0, *sequential)  # every leading dim the queries have
  out, weights, *rows = broadcast_vmap(per_head, core, operands,
                                       sequential=sequential,
                                       group=max(one_at_a_time, 1))
  lse, max_logits = (*rows, None)[:2]  # one value per query row each
  return Result(merge_groups(out, ops.groups, -3),
                merge_groups(weights, ops.groups, -3),
                merge_groups(lse, ops.groups, -2),
                merge_groups(max_logits, ops.groups, -2))
