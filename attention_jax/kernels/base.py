"""The kernel interface: one validated problem, and kernels that say what they take.

Shape glossary: B batch, T query length, S key/value length, N query heads,
K key/value heads (G = N // K per key/value head), H head dim, Hv value
head dim, P pages, Z page size, M pages per row; ``...`` leading dims.

``canonicalize`` checks a call once, in the caller's terms (query heads N
against key/value heads K), and builds a ``Problem``: the operands
(``attention_operands`` -> ``Operands``: the query, key, value, the
``Mask``'s fields under their own names, per-example ones aligned to the
left of the leading dims, int32, the bias, sinks, score modifier and the
(b, h) indices they see, every array with a head axis split for
grouped-query attention, ``split_groups``, ready for
``lift_heads``), the scale (a float; a traced one is folded into the
queries), dropout (a key only
when entries may drop) and what to return. Every check raises
``ValueError`` (shapes, values) or ``TypeError`` (dtypes) naming the
argument and the shapes. A kernel is a ``Kernel``:

* ``name``: what ``implementation=`` calls it;
* ``implements``: the features (``Problem.features``: the mask's fields,
  ``bias``/``sinks``/``score_mod``, the options set) it implements; a call
  asking for any other is refused with the feature's name, so a field
  added later can never be dropped by a kernel that does not know it;
* ``supports(problem) -> None | reason``: whether it gives the contract's
  numbers for this problem (a reason is a phrase for an error message);
* ``declines(problem) -> None | reason``: only for the automatic choice, a
  problem it can run but should not (too small to pay off);
* ``__call__(problem) -> Result``: ``out [..., N, T, Hv]``, heads merged
  again, and ``weights``/``lse``/``max_logits`` where asked for (None
  otherwise). Kernels never re-validate;
* ``forward_mode``: whether JAX can differentiate it forward (plain JAX
  or a custom JVP); one that cannot (a custom VJP) is refused by name
  under ``jax.jvp`` (``kernels.forward_mode``), reverse mode unchanged;
* ``partitionable``: whether XLA can split it over sharded batch and
  heads (pure JAX: yes); one that cannot (a Pallas call) runs per shard
  of the problem's ``Partition`` inside ``jax.shard_map``
  (``kernels.per_shard``), seeing the shard's problem.

``max_logits`` (QK-clip, logit-growth monitoring): per query row, the
maximum of the raw scaled logits ``scale * q . k`` over the keys the row
attends to (every mask field; ``-inf`` bias or ``score_mod`` entries block
like a mask), before the bias, ``score_mod`` and sinks; ``-inf`` for a row
with nothing to attend to. Float32 (float64 for float64 inputs), and not
differentiated: its gradient is zero (``lax.stop_gradient``).

The registry (``kernels/__init__.py``) lists them in the automatic choice's
order; the dispatcher (``dot_product``) walks it.

A head's view. The attention maths in this package is written for one head
and one example (``[T, H]`` queries against ``[S, H]`` keys).
``broadcast_vmap`` lifts such a function to operands with any leading batch
dimensions that broadcast like NumPy's: one ``jax.vmap`` per leading
dimension, mapping the operands that have that dimension and passing the
others (size 1 or absent) unmapped. A size-1 key/value head dimension
against ``G`` query heads is therefore shared, never copied, which is how
grouped-query attention stays cheap. ``lift_heads`` runs a kernel's
single-head function so, handing it a ``Head`` of that head's operands, and
returns a ``Result``.

Grouped-query attention as a reshape (``head_axes``, ``split_groups``,
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
import math
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.core import checks
from attention_jax.kernels import partition as partition_lib
from attention_jax.masking import intervals
from attention_jax.masking import mask as mask_lib
from attention_jax.masking import tree as tree_lib

# (re-exported: the public names live in kernels/__init__.py)
Partition = partition_lib.Partition
check_partition = partition_lib.check_partition
split_dims = partition_lib.split_dims

# A head's view of the call: grouped-query heads, one vmap per leading
# dim (see the module docstring).

class Groups(NamedTuple):
  num_heads: int  # N
  num_kv_heads: int  # K


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
  # float32 [Tp] / [Sp]: each query row's / key row's garbage code
  # (``core/checks.py``), made
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
  """Runs a single-head kernel over validated operands (``base.Operands``).

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
  if ops.groups is None:
    return Result(out, weights, lse, max_logits)
  return Result(merge_groups(out, ops.groups, -3),
                merge_groups(weights, ops.groups, -3),
                merge_groups(lse, ops.groups, -2),
                merge_groups(max_logits, ops.groups, -2))


# The call's operands, validated once and grouped (what ``Problem.ops``
# holds); ``canonicalize`` below builds them.

class Operands(NamedTuple):
  """Validated attention operands, heads grouped (``split_groups``)."""
  query: jax.Array  # [..., T, H]
  key: jax.Array  # [..., S, H]
  value: jax.Array  # [..., S, Hv]
  dense: jax.Array | None  # bool [..., T|1, S|1], at least 2-D
  bias: jax.Array | None  # float [..., T|1, S|1], at least 2-D
  kv_lengths: jax.Array | None  # int32 [...] key/value lengths
  q_lengths: jax.Array | None  # int32 [...] query lengths
  q_segment_ids: jax.Array | None  # int32 [..., T] query segment ids
  kv_segment_ids: jax.Array | None  # int32 [..., S] key segment ids
  sinks: jax.Array | None  # float [...] per-head sink logits
  # int32 (b, h) indices for score_mod, each broadcastable to the leading
  # dims (grouped like the heads), or None without a score_mod.
  head_index: tuple[jax.Array, jax.Array] | None
  groups: Groups | None
  batch_shape: tuple[int, ...]  # broadcast leading dims (grouped)
  # Static parts of the pattern.
  window: tuple[int, int] | None = None  # (left, right)
  score_mod: Any = None
  rule: Any = None  # a BlockMask (kinds None: tables to build)
  causal: bool = False
  leading: tuple[int, ...] = ()  # the caller's broadcast leading dims
  # int32 [...] positions of query row 0 / key column 0 (Mask.q_offset,
  # kv_offset), or None for the bottom-right alignment.
  q_offset: jax.Array | None = None
  kv_offset: jax.Array | None = None

  @property
  def positioned(self) -> bool:
    return self.q_offset is not None


_JAX_NN_LAYOUT = (
    " The operands are read as [..., N, T, H] queries over [..., K, S, H] "
    "keys/values; jax.nn's [B, T, N, H] layout converts with "
    "jnp.swapaxes(x, 1, 2) (or call aj.dot_product_attention, which takes "
    "it as it is).")




def _arrays(query, key, value):
  """Query, key and value as float arrays of rank >= 2 whose head dims
  (H) and lengths (S) agree."""
  arrays = []
  for name, x, layout in (("query", query, "[..., T, H]"),
                          ("key", key, "[..., S, H]"),
                          ("value", value, "[..., S, Hv]")):
    if x is None:
      raise TypeError(f"{name} is None: pass a float array {layout}.")
    x = np.asarray(x) if isinstance(x, (list, tuple)) else x
    checks.check_float_array(name, x)
    if np.ndim(x) < 2:
      raise ValueError(f"{name} must have rank >= 2 ({layout}), got shape "
                       f"{np.shape(x)}.")
    arrays.append(x)
  q_shape, k_shape, v_shape = map(np.shape, arrays)
  if q_shape[-1] != k_shape[-1]:
    raise ValueError(
        f"query and key must have the same head dim H (last axis): query "
        f"{q_shape}, key {k_shape}."
        + (_JAX_NN_LAYOUT if len(q_shape) == 4 else ""))
  if k_shape[-2] != v_shape[-2]:
    raise ValueError(
        f"key and value must have the same length S (axis -2): key "
        f"{k_shape}, value {v_shape}.")
  return arrays


def head_axes(shapes) -> tuple[Groups | None, dict[str, tuple[int, ...]]]:
  """``(groups, leading)`` of the query, key and value ``shapes``.

  ``groups``: the grouping of ``[..., N, T, H]`` queries over ``[..., K, S,
  H]`` keys, or None when there is nothing to group (operands that are not
  both 4-D, or ``K`` in ``(1, N)``; a ``K`` that does not divide ``N`` is
  left to the broadcast check, whose error names both shapes).
  ``leading``: each operand's leading dims, the key/value heads ``K`` read
  as the ``N`` query heads they serve (so they broadcast against the
  query's).
  """
  q_shape, k_shape = shapes[0], shapes[1]
  groups = None
  if len(q_shape) == 4 and len(k_shape) == 4:
    n, k = q_shape[-3], k_shape[-3]
    if k not in (1, n) and not n % k:
      groups = Groups(n, k)
  leading = {}
  for name, shape in zip(("query", "key", "value"), shapes):
    if (name != "query" and groups is not None and len(shape) >= 3
        and shape[-3] == groups.num_kv_heads):
      shape = shape[:-3] + (groups.num_heads,) + shape[-2:]
    leading[name] = tuple(shape[:-2])
  return groups, leading


def _batch_shape(leading, q_shape, k_shape, groups) -> tuple[int, ...]:
  """The broadcast of every operand's leading dims; a ValueError naming
  each when they do not broadcast."""
  try:
    return tuple(jnp.broadcast_shapes(*leading.values()))
  except ValueError:
    pass
  what = "leading (batch) dimensions of the attention operands"
  if len(q_shape) == 4 and len(k_shape) == 4 and groups is None:
    what += (" (4-D operands are [B, N, T, H] queries over [B, K, S, H] "
             "keys/values: K must be 1, N or a divisor of N. jax.nn's "
             "[B, T, N, H] layout converts with jnp.swapaxes(x, 1, 2), or "
             "call aj.dot_product_attention, which takes it as it is)")
  listed = ", ".join(f"{k} {v}" for k, v in leading.items())
  raise ValueError(f"{what} do not broadcast: {listed}.")


# The mask's per-example fields: lengths, and positions (Mask.offsets).
_PER_EXAMPLE = ("kv_lengths", "q_lengths", "q_offset", "kv_offset")


def _per_example(m: mask_lib.Mask, t: int, s: int, leading_rank: int,
                 batch_shape, leading):
  """The mask's lengths and positions (None where unset), aligned to the
  left of the leading dims, int32, one axis per leading dim (or a scalar),
  lengths within ``[0, T]`` / ``[0, S]`` when concrete; their shapes join
  ``leading``."""
  q_offset, kv_offset = m.offsets(t, s) if m.positioned else (None, None)
  given = (m.kv_lengths, m.q_lengths, q_offset, kv_offset)
  out = dict.fromkeys(_PER_EXAMPLE)
  for name, x, upper in zip(_PER_EXAMPLE, given, (s, t, None, None)):
    if x is None:
      continue
    x = _left_aligned(f"Mask's {name}", x, 0, leading_rank,
                      "a scalar or [B]")
    what = f"the mask's {name}"
    lengths = jnp.asarray(x, jnp.int32)  # (Mask checked: integers)
    # One axis per leading dim (or a scalar): a [B] array against [B, N]
    # leading dims would otherwise be read as per-head values when B == N.
    if lengths.ndim not in (0, len(batch_shape)):
      raise ValueError(
          f"{what} with shape {lengths.shape} does not fit the leading dims "
          f"{batch_shape}: it is a scalar, [B] per example (aligned to the "
          f"left of the leading dims) or [B, N] per head.")
    if upper is not None:  # positions may be any integer
      checks.check_range(what, x, upper)
    leading[what] = lengths.shape
    out[name] = lengths
  return out


def _segment_pair(m: mask_lib.Mask, t: int, s: int, leading_rank: int,
                  leading):
  """The mask's segment ids as int32 ``[..., T]`` / ``[..., S]`` (None
  without); their leading shapes join ``leading``."""
  q_ids, kv_ids = m.q_segment_ids, m.kv_segment_ids
  if (q_ids is None) != (kv_ids is None):
    raise ValueError("segment ids come in pairs: pass q_segment_ids with "
                     "kv_segment_ids (or q_segment_ids alone for packed "
                     "self-attention).")
  pair = []
  for name, ids, size, letter in (("q_segment_ids", q_ids, t, "T"),
                                  ("kv_segment_ids", kv_ids, s, "S")):
    if np.ndim(ids) > 1:
      ids = _left_aligned(f"Mask's {name}", ids, 1, leading_rank,
                          f"[{letter}] or [B, {letter}]")
    ids = _segment_ids(f"the mask's {name}", ids, size, letter,
                       leading_rank)
    leading[f"the mask's {name}"] = ids.shape[:-1]
    pair.append(ids)
  return tuple(pair)


def _segment_ids(name, ids, size, letter, leading_rank):
  """Ids ``[size]`` or ``[..., size]`` with one axis per leading dim, int32
  (``Mask`` checked that they are integers)."""
  shape = checks.shape_of(ids)
  if len(shape) not in (1, leading_rank + 1) or shape[-1] != size:
    raise ValueError(
        f"{name} with shape {shape} must be [{letter}] = [{size}] (shared) "
        f"or [B, {letter}] (per example; [B, N, {letter}] per head), "
        f"aligned to the left of the operands' leading dims.")
  return jnp.asarray(ids, jnp.int32)


def _logits_shape(leading, t: int, s: int) -> tuple[int, ...]:
  """The logits' shape ``[..., T, S]`` for messages (leading dims as given
  when they do not broadcast; the broadcast check reports that)."""
  try:
    lead = tuple(jnp.broadcast_shapes(*leading.values()))
  except ValueError:
    lead = max(leading.values(), key=len)
  return lead + (t, s)


def _check_pair_axes(name, shape, t, s, q_shape, k_shape) -> None:
  """The last two axes fit ``[T, S]``; says so when jax.nn's layout would."""
  try:
    checks.check_broadcastable_to(name, shape[-2:], (t, s), "[T, S]", shape)
  except ValueError as e:
    hint = ""
    if len(q_shape) == 4 and len(k_shape) == 4:
      swapped = (q_shape[1], k_shape[1])  # T, S if read as [B, T, N, H]
      if all(m in (1, w) for m, w in zip(shape[-2:], swapped)):
        hint = (" It would fit if the operands were jax.nn's [B, T, N, H] "
                "layout." + _JAX_NN_LAYOUT)
    raise ValueError(str(e) + hint) from None


def _left_aligned(name: str, x, core: int, leading_rank: int, layout: str):
  """``x`` (``[...lead, *core]``) with size-1 axes appended to its leading
  axes up to ``leading_rank``: per-example arrays align to the left."""
  if x is None:
    return None
  shape = checks.shape_of(x)
  lead = len(shape) - core
  if lead > leading_rank:
    raise ValueError(
        f"{name} with shape {shape} has {lead} leading axes, but the "
        f"operands have {leading_rank} leading dims: it must be {layout}, "
        f"aligned to the left of the leading dims (e.g. [B] lengths or "
        f"[B, T] segment ids for [B, N, T, H] operands).")
  shape = shape[:lead] + (1,) * (leading_rank - lead) + shape[lead:]
  try:  # concrete values stay NumPy (their range is checked at trace time)
    return np.asarray(x).reshape(shape)
  except jax.errors.TracerArrayConversionError:
    return jnp.reshape(x, shape)


def _pair_operand(name, x, logits, t, s, q_shape, k_shape, leading):
  """A dense mask (bool or integer, as ``Mask`` checked: bool back) or a
  bias (float) of the logits' full rank whose last two axes fit ``[T,
  S]``; its leading shape joins ``leading``."""
  if name == "bias":
    checks.check_float_array(name, x)
    checks.check_no_nan_or_inf(name, x, neg_inf="masks the entry")
  checks.check_logits_rank(name, tuple(np.shape(x)), logits)
  x = checks.as_bool_mask(x) if name == "mask" else jnp.asarray(x)
  _check_pair_axes(name, x.shape, t, s, q_shape, k_shape)
  leading[name] = x.shape[:-2]
  return x


def _normalised_rule(rule, query, key, value, q_shape, t: int, s: int,
                     leading):
  """A rule as a ``BlockMask`` (tables as given, or ``kinds`` None: the
  kernel builds them at its block sizes), checked at the call's indices;
  tables' batch shape joins ``leading``."""
  if isinstance(rule, mask_lib.Union):
    # Each member is held to what it would be held to alone (its arrays are
    # read elementwise, where a misfit would clamp instead of raising).
    for member in rule.members():
      attention_operands(query, key, value, member)
  examples = getattr(mask_lib.rule_function(rule), "examples", None)
  if examples is not None:
    lead = q_shape[:-2]
    batch = lead[-2] if len(lead) > 1 else (lead[0] if lead else None)
    if batch != examples:
      raise ValueError(
          f"the mask's rule holds one rule per example ({examples} examples, "
          f"e.g. per-example prefix lengths [{examples}]), but the operands "
          f"{q_shape} have batch {batch}: give the rule one entry per "
          "example of this batch.")
  if not isinstance(rule, mask_lib.BlockMask):
    fn = rule.bound(t, s) if isinstance(rule, mask_lib.Union) else rule
    rule = mask_lib.BlockMask(fn, t, s, None, None, None, None, None, None,
                              None)
  check_rule(rule.mask_fn, q_shape[:-2], t, s)
  if rule.shape != (t, s):
    raise ValueError(
        f"mask is a BlockMask built for [T, S] = {list(rule.shape)}, "
        f"but its rule indices here run over T = {t}, S = {s}: build it "
        f"with block_mask(mask_fn, {t}, {s}, ...).")
  batch = rule.batch_shape
  if batch and len(batch) != len(q_shape) - 2:
    raise ValueError(
        f"mask is a BlockMask with tables for batch={batch}, but the "
        f"operands have {len(q_shape) - 2} leading dims {q_shape[:-2]}: "
        f"build it with one batch entry per leading dim (size 1 to "
        f"broadcast), e.g. batch=(B, 1) for [B, N, T, H].")
  if batch:
    leading["mask"] = batch
  _check_rule_covered(rule, q_shape[:-2], s)
  return rule


def attention_operands(query, key, value, mask=None, bias=None, *,
                       sinks=None, score_mod=None,
                       head_index: bool = False) -> Operands:
  """Checks the operands of an attention call and normalises them.

  ``mask`` is a ``Mask`` or None (the public functions convert what they
  accept, once, with ``mask.as_mask``). The checks are stated in the
  caller's terms (query heads N against key/value heads K); the operands
  come back with the head axis split when ``K`` divides ``N``
  (``split_groups``), ready for ``lift_heads``. A rule becomes a
  ``BlockMask`` with tables as given, or one without tables (``kinds is
  None``) whose tables the kernel builds at its own block sizes.
  ``head_index``: give every head its ``(b, h)`` even without a score
  modifier or rule (dropout draws its mask from them).
  """
  m = mask_lib.Mask() if mask is None else mask
  query, key, value = _arrays(query, key, value)
  shapes = q_shape, k_shape, _ = tuple(map(np.shape, (query, key, value)))
  t, s = q_shape[-2], k_shape[-2]
  groups, leading = head_axes(shapes)
  leading_rank = max(map(len, shapes)) - 2
  rule = m.rule if m.rule is None else _normalised_rule(
      m.rule, query, key, value, q_shape, t, s, leading)
  dense = None
  if m.dense is not None or bias is not None:
    logits = _logits_shape(leading, t, s)
    if m.dense is not None:
      dense = _pair_operand("mask", m.dense, logits, t, s, q_shape, k_shape,
                            leading)
    if bias is not None:
      bias = _pair_operand("bias", bias, logits, t, s, q_shape, k_shape,
                           leading)
  if score_mod is not None:
    checks.check_score_mod(score_mod, t, s, checks.compute_dtype(query, key))
  batch_shape = _batch_shape(leading, q_shape, k_shape, groups)
  fields = dict.fromkeys(_PER_EXAMPLE)
  if any(getattr(m, name) is not None for name in _PER_EXAMPLE):
    fields = _per_example(m, t, s, leading_rank, batch_shape, leading)
  q_ids = kv_ids = None
  if m.q_segment_ids is not None or m.kv_segment_ids is not None:
    q_ids, kv_ids = _segment_pair(m, t, s, leading_rank, leading)
  if sinks is not None:
    checks.check_float_array("sinks", sinks)
    checks.check_no_nan_or_inf("sinks", sinks, neg_inf="is no sink")
    sinks = jnp.asarray(sinks)
    checks.check_broadcastable_to("sinks", sinks.shape, batch_shape,
                                  "the leading dims (e.g. [B, N] or [N])")
  # Again, now with the per-example fields among the leading dims (a
  # length for another batch does not broadcast).
  caller_leading = _batch_shape(leading, q_shape, k_shape, groups)
  return _grouped(Operands(
      query, key, value, dense, bias, fields["kv_lengths"],
      fields["q_lengths"], q_ids, kv_ids, sinks, None, groups,
      caller_leading, m.window, score_mod, rule, bool(m.causal),
      caller_leading, fields["q_offset"], fields["kv_offset"]),
                  head_index or score_mod is not None or rule is not None)


def _grouped(ops: Operands, head_index: bool) -> Operands:
  """``ops`` with every head axis split by its ``groups`` (``[..., K, G,
  ...]``) and, when asked, each head's ``(b, h)``."""
  groups, split = ops.groups, split_groups
  index = _head_index(ops.leading, groups) if head_index else None
  rule = ops.rule
  if rule is not None and rule.batch_shape:
    rule = rule.with_tables(split(jnp.asarray(x), groups, -3)
                            for x in rule.tables)
  if groups is None:  # nothing to split: the arrays as they are
    key, value = ops.key, ops.value  # (a paged call's stand as shapes)
    if not isinstance(key, jax.ShapeDtypeStruct):
      key, value = jnp.asarray(key), jnp.asarray(value)
    return ops._replace(query=jnp.asarray(ops.query), key=key, value=value,
                        head_index=index, rule=rule)
  batch_shape = ops.leading[:-1] + (groups.num_kv_heads,
                                    groups.num_heads // groups.num_kv_heads)
  return ops._replace(
      query=split(jnp.asarray(ops.query), groups, -3),
      key=_split_heads(ops.key, groups),
      value=_split_heads(ops.value, groups),
      dense=split(ops.dense, groups, -3), bias=split(ops.bias, groups, -3),
      kv_lengths=split(ops.kv_lengths, groups, -1),
      q_lengths=split(ops.q_lengths, groups, -1),
      q_segment_ids=split(ops.q_segment_ids, groups, -2),
      kv_segment_ids=split(ops.kv_segment_ids, groups, -2),
      sinks=split(ops.sinks, groups, -1),
      head_index=index, batch_shape=batch_shape, rule=rule,
      q_offset=split(ops.q_offset, groups, -1),
      kv_offset=split(ops.kv_offset, groups, -1))


def _split_heads(x, groups):
  """``split_groups`` of a key or value, or of the ``ShapeDtypeStruct``
  a paged call's pages stand for."""
  if isinstance(x, jax.ShapeDtypeStruct):
    shape = x.shape[:-3] + (groups.num_kv_heads, 1) + x.shape[-2:]
    return jax.ShapeDtypeStruct(shape, x.dtype)
  return split_groups(jnp.asarray(x), groups, -3)


def paged_operands(query, key_pages, value_pages, table, mask,
                   key_scales=None, value_scales=None):
  """Checks a paged call; the logical keys and values the pages stand for.

  ``query [B, N, T, H]`` against ``key_pages [P, K, Z, H]``,
  ``value_pages [P, K, Z, Hv]`` and ``table`` int ``[B, M]``; the mask
  must give ``kv_lengths`` (each example's length: what lies past it in
  its pages is not its own). Returns ``ShapeDtypeStruct``s ``[B, K, M * Z,
  H]`` and ``[B, K, M * Z, Hv]`` for ``attention_operands`` to check like
  keys and values (nothing of that size is built). Quantised pages (int8,
  float8_e4m3fn) come with float32 scales ``[P, K, Z]`` and stand for
  float32 keys and values.
  """
  checks.check_float_array("query", query)
  q_shape, k_shape, v_shape = map(checks.shape_of,
                                  (query, key_pages, value_pages))
  dtypes = []
  for name, x, scales in (("key_pages", key_pages, key_scales),
                          ("value_pages", value_pages, value_scales)):
    if scales is None:
      checks.check_float_array(name, x)
      dtypes.append(jnp.result_type(x))
      continue
    stored = jnp.result_type(x)
    if stored not in (jnp.int8, jnp.float8_e4m3fn):
      raise TypeError(f"{name} with scales must be int8 or float8_e4m3fn "
                      f"(quantised pages), got {stored}.")
    checks.check_float_array(f"{name}' scales", scales)
    if checks.shape_of(scales) != checks.shape_of(x)[:3]:
      raise ValueError(f"{name}' scales must be [P, K, Z] = "
                       f"{list(checks.shape_of(x)[:3])}, got "
                       f"{checks.shape_of(scales)}.")
    dtypes.append(jnp.dtype(jnp.float32))
  if len(q_shape) != 4:
    raise ValueError(f"a paged call takes query [B, N, T, H], got "
                     f"{q_shape}.")
  if len(k_shape) != 4 or len(v_shape) != 4 or k_shape[:3] != v_shape[:3]:
    raise ValueError(
        f"key_pages and value_pages must be [P, K, Z, H] and [P, K, Z, Hv] "
        f"with the same P, K, Z, got {k_shape} and {v_shape}.")
  if not jnp.issubdtype(jnp.result_type(table), jnp.integer):
    raise TypeError(f"the page table must be integer [B, M], got "
                    f"{jnp.result_type(table)}.")
  t_shape = checks.shape_of(table)
  if len(t_shape) != 2 or t_shape[0] != q_shape[0]:
    raise ValueError(
        f"the page table must be [B, M] with the query's B = {q_shape[0]}, "
        f"got {t_shape}.")
  if mask is None or mask.kv_lengths is None:
    raise ValueError(
        "a paged call needs the mask's kv_lengths (each example's length; "
        "its pages hold nothing of its own past it): "
        "aj.paged_attention gives the cache's lengths.")
  b, m = t_shape
  k, z = k_shape[1], k_shape[2]
  return (jax.ShapeDtypeStruct((b, k, m * z, k_shape[3]), dtypes[0]),
          jax.ShapeDtypeStruct((b, k, m * z, v_shape[3]), dtypes[1]))


def check_rule(mask_fn, leading, t: int, s: int) -> None:
  """A mask rule returns booleans (True = may attend), whatever kernel
  runs it; checked abstractly at the call's indices."""
  checks.check_arity("the mask's rule", mask_fn, "b, h, q_idx, kv_idx")
  b, h = intervals.rule_indices(tuple(leading), jnp)
  lead = (1,) * len(leading)
  q_idx = jax.ShapeDtypeStruct(lead + (t, 1), jnp.int32)
  kv_idx = jax.ShapeDtypeStruct(lead + (1, s), jnp.int32)
  out = jax.eval_shape(mask_fn, b, h, q_idx, kv_idx)
  dtype = getattr(out, "dtype", None)
  shape = tuple(getattr(out, "shape", ()))
  whole = tuple(leading) + (t, s)
  try:
    fits = np.broadcast_shapes(shape, whole) == whole
  except ValueError:
    fits = False
  if not fits:
    raise ValueError(
        f"the mask's rule returned shape {shape} for q_idx {lead + (t, 1)} "
        f"and kv_idx {lead + (1, s)} (b and h {tuple(b.shape)}, "
        f"{tuple(h.shape)}): it must broadcast to the call's [..., T, S] = "
        f"{whole}. Combine the indices elementwise (e.g. kv_idx <= q_idx) "
        "and index per-example arrays with b (arr[b] is [..., 1, 1, 1]).")
  if dtype != jnp.bool_:
    raise TypeError(
        f"the mask's rule must return a bool array (True = may attend), got "
        f"dtype {dtype} with shape {shape} for q_idx [{t}, 1], kv_idx [1, "
        f"{s}]: return a comparison, e.g. kv_idx <= q_idx, or (x != 0) for "
        "a number x. Every kernel refuses a rule that returns numbers.")


def rule_batch(mask_fn, leading, s: int) -> tuple[int, ...]:
  """The leading dims a rule depends on: ``leading`` with 1 where it does
  not (``()`` when it depends on none); read from the rule's output shape
  over the operands' indices (abstract: nothing is computed)."""
  if not leading:
    return ()
  lead = (1,) * len(leading)
  b, h = intervals.rule_indices(tuple(leading), jnp)
  q_idx = jnp.zeros(lead + (1, 1), jnp.int32)
  kv_idx = jnp.zeros(lead + (1, s), jnp.int32)
  out = jax.eval_shape(mask_fn, b, h, q_idx, kv_idx).shape
  out = (1,) * (len(leading) + 2 - len(out)) + tuple(out)
  batch = tuple(size if dep > 1 else 1
                for size, dep in zip(leading, out[:-2]))
  return batch if any(n > 1 for n in batch) else ()


def _check_rule_covered(block_mask, leading, s: int) -> None:
  """Refuses block tables that a rule's use of ``b``/``h`` outruns.

  Tables built for fewer (b, h) than the rule distinguishes would be
  trusted for every head (full blocks skip the rule, empty ones are never
  visited): a silent wrong answer.
  """
  if not leading or block_mask.kinds is None:  # tables built by the kernel
    return
  needed = rule_batch(block_mask.mask_fn, leading, s)
  tables = block_mask.batch_shape or (1,) * len(leading)
  for axis, (size, covered) in enumerate(zip(needed, tables)):
    if size > 1 and covered == 1:
      raise ValueError(
          f"mask's rule depends on leading axis {axis} (size {size} of the "
          f"operands' {tuple(leading)}: "
          f"{'b' if axis == len(leading) - 2 or len(leading) == 1 else 'h'}"
          f"), but its BlockMask was built with batch="
          f"{block_mask.batch_shape}, so its block tables would be trusted "
          f"for every index: build it with batch={tuple(leading)} (or 1 "
          "where the rule does not depend on the axis).")


def _head_index(batch_shape, groups):
  """``(b, h)``: int32 indices over the leading dims, for ``score_mod``.

  ``h`` runs over the last leading axis (the query heads of ``[B, N, T,
  H]``), ``b`` over the one before (the batch); with one leading axis that
  axis is ``b`` and ``h`` is 0; with none both are 0. Shaped to broadcast
  against the leading dims, and split like the heads when they are grouped
  (query head ``n`` keeps its own ``h``).
  """
  zero = jnp.zeros((), jnp.int32)
  if not batch_shape:
    return zero, zero
  if len(batch_shape) == 1:
    return jnp.arange(batch_shape[0], dtype=jnp.int32), zero
  b = jnp.arange(batch_shape[-2], dtype=jnp.int32)[:, None]  # [B, 1]
  h = jnp.arange(batch_shape[-1], dtype=jnp.int32)[None, :]  # [1, N]
  return split_groups(b, groups, -1), split_groups(h, groups, -1)



class Pages(NamedTuple):
  """Keys and values read through a page table (a paged cache); a pytree.

  Position ``p`` of example ``b`` lives in page ``table[b, p // Z]``, slot
  ``p % Z``; an entry ``>= P`` (no page) is past the example's length.
  The call's ``ops.key``/``ops.value`` are then ``ShapeDtypeStruct``s of
  the logical ``[B, K, M * Z, H]`` the pages stand for: nothing the size
  of the keys is gathered; a kernel that declares ``pages`` reads them
  page by page.
  """
  key_pages: jax.Array  # [P, K, Z, H]
  value_pages: jax.Array  # [P, K, Z, Hv]
  table: jax.Array  # int32 [B, M]
  # float32 [P, K, Z]: quantised pages (int8, float8_e4m3fn) hold
  # ``x / scale`` per token and head; a kernel declaring "page_scales"
  # dequantises each page as it loads it.
  key_scales: jax.Array | None = None
  value_scales: jax.Array | None = None
  # bool scalar: True vouches that every key and value below each
  # example's length is finite (the paged cache tracks what it was
  # written), so a kernel need not search loaded pages for NaN or inf;
  # False or None: it must (garbage a row may not see never reaches it).
  finite: jax.Array | None = None

  @property
  def page_size(self) -> int:
    return self.key_pages.shape[2]


class Problem(NamedTuple):
  """One attention call, validated."""
  ops: Operands  # operands, heads grouped, the mask's fields
  scale: float  # (a traced scale is folded into ops.query)
  out_dtype: Any
  dropout_rate: Any = 0.0
  dropout_rng: jax.Array | None = None
  return_weights: bool = False
  return_lse: bool = False
  return_max_logits: bool = False
  mask: mask_lib.Mask | None = None  # the call's normalised mask, whole
  pages: Pages | None = None  # keys and values in pages (a paged cache)
  # How the leading dims are split over the ambient mesh's axes (None:
  # not split, or left to XLA); checked against the mesh and the shapes.
  partition: Partition | None = None

  @property
  def features(self) -> frozenset[str]:
    """What this call asks of a kernel, by name (``Kernel.implements``).

    Every field the mask sets (its attributes, so a field added to ``Mask``
    is a feature without a line here), ``bias``, ``sinks`` and
    ``score_mod`` when given, and every option of this record that differs
    from its default (``dropout_rate``, ``return_weights``, ``return_lse``,
    ``return_max_logits``, and any option added to it later).
    """
    given = {} if self.mask is None else dict(vars(self.mask))
    for name in _CALL_OPERANDS:
      given[name] = getattr(self.ops, name)
    found = set()
    for name, x in given.items():
      if x is not None and x is not False:
        found.add(name)
    if self.pages is not None and self.pages.key_scales is not None:
      found.add("page_scales")  # quantised pages: dequantised on load
    for name, default in type(self)._field_defaults.items():
      if name in _NOT_FEATURES:
        continue
      value = getattr(self, name)
      if name == "dropout_rate":
        if self.dropout_rng is not None:  # (canonicalize: rate 0, no key)
          found.add(name)
      elif value is not default and (isinstance(value, tuple)
                                     or value != default):
        found.add(name)
    return frozenset(found)

  @property
  def dropout_on(self) -> bool:
    """Whether entries are dropped: ``canonicalize`` keeps a key only
    with a rate that may be positive (a Python 0.0 drops the key)."""
    return self.dropout_rng is not None


# The call's operands besides q, k, v that are features (Problem.features);
# the record's own fields that are not (the mask is read field by field).
_CALL_OPERANDS = ("bias", "sinks", "score_mod")
_NOT_FEATURES = ("mask", "dropout_rng", "partition")

# Every field a Mask can set, and everything a call can ask for: what a
# kernel declares it implements (``Kernel.implements``) is a subset.
MASK_FIELDS = frozenset({
    "causal", "window", "q_lengths", "kv_lengths", "q_segment_ids",
    "kv_segment_ids", "dense", "rule", "q_offset", "kv_offset"})
OPTIONS = frozenset({
    "bias", "sinks", "score_mod", "dropout_rate", "return_weights",
    "return_lse", "return_max_logits", "pages", "page_scales"})


# Below this many scores per head the dense kernel is as fast (see the
# performance page of the docs) and also yields the weights: the blockwise
# kernels' ``min_scores``.
MIN_SCORES = 1024 * 1024


class Kernel:
  """What every implementation provides (see the module docstring)."""
  name: ClassVar[str] = "kernel"
  # The features (Problem.features) this kernel implements; the choice
  # refuses a call asking for any other, naming it, before ``supports``
  # is trusted (a field or option added later reaches no kernel silently).
  implements: ClassVar[frozenset[str]] = frozenset()
  # Whether XLA's SPMD partitioner can split this kernel's computation over
  # sharded batch and head dims (pure JAX: it can). A kernel that is one
  # opaque call (a Pallas kernel) cannot: with a partition in the problem
  # it runs per shard inside jax.shard_map (kernels.per_shard).
  partitionable: ClassVar[bool] = True
  # Whether JAX can differentiate it forward (jax.jvp, jax.jacfwd): plain
  # JAX or a custom JVP. A kernel whose gradient is a custom VJP says
  # False, and the dispatcher refuses forward mode by its name
  # (kernels/forward_mode.py) instead of JAX's anonymous error.
  forward_mode: ClassVar[bool] = True
  # The backend it runs on ("gpu", "tpu"), None for any. Elsewhere it is
  # refused by that reason before ``supports`` is asked (``refusal``),
  # unless it runs in the Pallas interpreter (an ``interpret`` of True).
  backend: ClassVar[str | None] = None
  # Whether it computes float64 inputs in float64. One that computes in
  # float32 says False and is refused float64 inputs by that reason
  # (``float32_only``) before ``supports`` is asked.
  float64: ClassVar[bool] = True
  # The automatic choice passes over (``declines``) a call with fewer
  # scores per head than this (T * S), leaving it to a later kernel: the
  # blockwise kernels set ``MIN_SCORES``, below which the dense kernel is
  # as fast and also yields the weights (docs/performance.md). 0: never.
  min_scores: ClassVar[int] = 0
  # The features a call must ask for (a kernel for one kind of call: the
  # gathered kernel needs a rule); a call without them is refused by that
  # reason before ``supports`` is asked, so other calls never reach it.
  requires: ClassVar[frozenset[str]] = frozenset()
  # Whether an eager call runs it under ``jax.jit`` (one program instead of
  # one per operation; ``dot_product.compiled``): for a kernel that is a
  # pure function of the problem's arrays, with no Python side effects
  # (under jit they happen when it is traced, not at every call) and no
  # concrete reads of them (they are traced). The library's dense and
  # flash kernels say True; a subclass that records calls says False.
  jit: ClassVar[bool] = False

  def supports(self, problem: Problem) -> str | None:
    """Why this kernel cannot run a call it declares (shapes, dtypes,
    backend), or None; what it does not declare is refused before."""
    del problem
    return None

  def declines(self, problem: Problem) -> str | None:
    """Why the automatic choice passes over a call this kernel takes, or
    None: by default fewer than ``min_scores`` scores per head, unless the
    keys are in pages (which no other kernel may read)."""
    scores = problem.ops.query.shape[-2] * problem.ops.key.shape[-2]  # T*S
    if scores < self.min_scores and problem.pages is None:
      return (f"T * S = {scores} is below {self.min_scores}, where the "
              "dense kernel is as fast")
    return None

  def __call__(self, problem: Problem):
    raise NotImplementedError


def canonicalize(query, key, value, mask, *, bias=None, scale=None,
                 score_mod=None, sinks=None, dropout_rate=0.0,
                 dropout_rng=None, return_weights: bool = False,
                 return_lse: bool = False,
                 return_max_logits: bool = False,
                 pages: Pages | None = None,
                 partition: Partition | None = None) -> Problem:
  """Every check of an attention call, once; the ``Problem`` kernels run.

  ``mask`` is a ``Mask`` or None (``mask.as_mask`` converts the other
  accepted values); ``scale`` None means ``1 / sqrt(H)``. With ``pages``
  (a paged cache) ``key`` and ``value`` are None: the pages stand for
  them (``paged_operands``). ``partition`` (a ``Partition`` or
  None) is checked against the ambient mesh and the operands
  (``check_partition``).
  """
  if mask is None:
    mask = mask_lib.Mask()
  if not isinstance(mask, mask_lib.Mask):
    raise TypeError(
        f"canonicalize takes the call's mask as an aj.Mask (or None), got "
        f"{type(mask).__name__}: the public functions convert what they "
        "accept once (masking.mask.as_mask); convert it the same way first.")
  for name, flag in (("return_weights", return_weights),
                     ("return_lse", return_lse),
                     ("return_max_logits", return_max_logits)):
    if flag is not True and flag is not False:  # traced, or not a bool
      checks.check_static_bool(name, flag)
  if pages is not None:
    if key is not None or value is not None:
      raise TypeError("a paged call reads its keys and values from the "
                      "pages: pass key=None and value=None with pages=.")
    key, value = paged_operands(
        query, pages.key_pages, pages.value_pages, pages.table, mask,
        pages.key_scales, pages.value_scales)
  if dropout_rng is not None or not (isinstance(dropout_rate, float)
                                     and dropout_rate == 0.0):
    checks.check_dropout(dropout_rate, dropout_rng)  # (given: checked)
    if isinstance(dropout_rate, (int, float, np.number)) and not dropout_rate:
      dropout_rate, dropout_rng = 0.0, None  # off: one way to say it
  # Dropout draws each entry's bit from its head's (b, h): core/dropout.py.
  ops = attention_operands(query, key, value, mask,
                                  bias, sinks=sinks, score_mod=score_mod,
                                  head_index=dropout_rng is not None)
  # A tree's nodes stand at slots, not depths: a modifier that reads the
  # indices is refused (traced again only beside a tree rule).
  if score_mod is not None and mask.rule is not None and tree_lib.holds_tree(
      mask.rule):
    tree_lib.check_score_mod(score_mod)
  if scale is None:
    scale = 1.0 / math.sqrt(ops.query.shape[-1])
  elif not isinstance(scale, (int, float)):
    checks.check_call_scale(scale)
    try:
      scale = float(scale)  # a concrete array: a constant
    except jax.errors.ConcretizationTypeError:
      # A traced scale (a learned one under jit) joins the queries
      # (scale * q . k == (scale * q) . k): every kernel compiles a float
      # scale in, and the gradient flows through this product, outside
      # any kernel's custom VJP.
      q = ops.query
      ops = ops._replace(query=(q * scale.astype(jnp.float32)).astype(
          q.dtype))
      scale = 1.0
  else:
    checks.check_call_scale(scale)
  out_dtype = jnp.result_type(ops.query, ops.key, ops.value)
  if pages is not None:
    pages = Pages(*(None if x is None else jnp.asarray(x) for x in pages))
  if partition is not None:
    partition = partition_lib.check_partition(partition, ops)
  return Problem(ops, scale, out_dtype, dropout_rate, dropout_rng,
                 bool(return_weights), bool(return_lse),
                 bool(return_max_logits), mask, pages, partition)


def refusal(kernel: Kernel, problem: Problem) -> str | None:
  """Why ``kernel`` cannot run ``problem``, or None: keys and values in
  pages it does not read, then off its backend, then float64 inputs to a
  float32 kernel (``Kernel.float64``), then a feature it requires that the
  call does not ask for (``Kernel.requires``), then its ``supports``, then
  any feature it does not declare (``undeclared``)."""
  # A paged call's keys and values are pages, which only a kernel that
  # declares them may read: the others are not asked.
  if problem.pages is not None and "pages" not in kernel.implements:
    return undeclared(kernel, problem.features - kernel.implements)
  here = jax.default_backend()
  if kernel.backend not in (None, here) and not getattr(
      kernel, "interpret", False):
    hint = (f" ({type(kernel).__name__}(interpret=True) runs it in the "
            "Pallas interpreter anywhere, slowly)"
            if hasattr(kernel, "interpret") else "")
    return (f"it needs a {kernel.backend.upper()}, the backend is "
            f"{here!r}{hint}")
  if not kernel.float64 and problem.out_dtype == jnp.float64:
    return float32_only(problem)
  needed = kernel.requires and kernel.requires - problem.features
  if needed:  # (features are computed only for a kernel that requires)
    return (f"it runs only calls that give {', '.join(sorted(needed))} "
            f"({type(kernel).__name__}.requires)")
  reason = kernel.supports(problem)
  missing = problem.features - kernel.implements
  if reason is None and missing:
    reason = undeclared(kernel, missing)
  return reason


def undeclared(kernel: Kernel, missing) -> str:
  """The reason ``kernel`` refuses the features ``missing`` (a non-empty
  set: ``problem.features - kernel.implements``), which it does not
  declare."""
  # The common ones say what to use instead; the rest are named.
  reasons = [_HINTS[name] for name in sorted(missing) if name in _HINTS]
  unhinted = sorted(missing - _HINTS.keys())
  if unhinted:
    reasons.append(
        f"it does not implement {', '.join(unhinted)} (not in "
        f"{type(kernel).__name__}.implements); a kernel runs only what it "
        "declares")
  return "; ".join(reasons)


# What to do instead, for the features a call asks for most often of a
# kernel that does not have them.
_HINTS = {
    "return_weights": ("it never forms the attention weights (use "
                       "implementation='dense' or None with "
                       "return_weights=True)"),
    "dropout_rate": "it has no dropout (use 'flash', 'dense' or "
                    "dropout_rate=0)",
    "return_max_logits": ("it does not return max logits (use 'dense', "
                          "'flash' or ring attention)"),
}


def by_name(name: str, registry: Sequence[Kernel]) -> Kernel:
  """The kernel of ``registry`` called ``name``."""
  for kernel in registry:
    if kernel.name == name:
      return kernel
  raise ValueError(
      f"implementation must be None, a kernel, a sequence of them, or one of "
      f"{[k.name for k in registry]}, got {name!r}.")


def candidates(implementation, registry: Sequence[Kernel]
               ) -> tuple[tuple[Kernel, ...], bool]:
  """``(kernels to try in order, automatic)`` for an ``implementation=``:
  None is ``registry`` (``kernels.REGISTRY``), in its order."""
  if implementation is None:
    return tuple(registry), True
  if isinstance(implementation, (str, Kernel)):
    implementation = (implementation,)
  if not isinstance(implementation, Sequence) or not implementation:
    raise ValueError(
        f"implementation must be None, a kernel name "
        f"({[k.name for k in registry]}), a Kernel, or a non-empty sequence "
        f"of them; got {implementation!r}.")
  kernels = []
  for item in implementation:
    if isinstance(item, str):
      item = by_name(item, registry)
    if not isinstance(item, Kernel):
      raise TypeError(
          f"implementation entries must be kernel names or "
          f"attention_jax.kernels.Kernel instances, got {item!r}.")
    kernels.append(item)
  return tuple(kernels), False


def verdicts(kernels: Sequence[Kernel], problem: Problem, automatic: bool):
  """Yields ``(kernel, verdict, reason)`` in order: ``"refuses"``
  (``supports``' reason), ``"declines"`` (``declines``' reason, asked only
  when automatic) or ``"takes"`` (reason None), past the first that
  takes it too (``aj.explain`` reports what ``choose`` would have met)."""
  for kernel in kernels:
    # supports' reasons say most (and suggest a fix); what a kernel does not
    # declare is refused even when its supports() does not know the feature.
    reason = refusal(kernel, problem)
    if reason is not None:
      yield kernel, "refuses", reason
      continue
    reason = kernel.declines(problem) if automatic else None
    yield kernel, "takes" if reason is None else "declines", reason


def choose(kernels: Sequence[Kernel], problem: Problem,
           automatic: bool) -> Kernel:
  """The first kernel that takes ``problem``; else a ValueError with each
  kernel's reason."""
  reasons = []
  for kernel in kernels:  # (``verdicts``' walk, stopping at the first)
    reason = refusal(kernel, problem)
    if reason is None and automatic:
      reason = kernel.declines(problem)
    if reason is None:
      return kernel
    reasons.append((kernel.name, reason))
  if len(reasons) == 1:
    name, reason = reasons[0]
    raise ValueError(f"implementation={name!r} is not possible: {reason}.")
  listed = "; ".join(f"{name}: {reason}" for name, reason in reasons)
  raise ValueError(f"no implementation takes this call ({listed}).")


def asked_result(kernel: Kernel, problem: Problem, result) -> Result:
  """``result`` checked to be a named ``Result`` holding what ``problem``
  asked for, with nothing else (what the dispatcher and each shard of
  ``per_shard`` return). TypeError naming the kernel otherwise."""
  if not isinstance(result, Result):
    raise TypeError(
        f"kernel {kernel.name!r} returned {type(result).__name__}, not an "
        "aj.kernels.Result(out, weights, lse, max_logits) (absent values "
        "None): every kernel returns one named result.")
  for name in ("weights", "lse", "max_logits"):
    if getattr(problem, f"return_{name}") and getattr(result, name) is None:
      raise TypeError(  # a kernel that accepted the flag and ignored it
          f"kernel {kernel.name!r} was asked for {name} (return_{name}="
          f"True) but returned none: it must compute it or not declare "
          f"return_{name} in its implements.")
  return Result(result.out,
                result.weights if problem.return_weights else None,
                result.lse if problem.return_lse else None,
                result.max_logits if problem.return_max_logits else None)


def check_block_size(name: str, size) -> None:
  if size is not None:
    checks.check_positive_int(name, size)


def float32_only(problem: Problem) -> str | None:
  """The reason a float32-compute kernel refuses float64 inputs, or None."""
  if jnp.promote_types(problem.out_dtype, jnp.float32) != jnp.float32:
    return ("it computes in float32; float64 inputs need the dense kernel "
            "(implementation='dense')")
  return None


def no_max_logits(problem: Problem) -> str | None:
  """The reason a kernel without the raw row maxima refuses, or None."""
  if problem.return_max_logits:
    return ("it does not return max logits (return_max_logits=True); use "
            "'dense', 'flash' or ring attention")
  return None


def no_weights_or_dropout(problem: Problem) -> str | None:
  if problem.dropout_on:
    return ("it has no dropout (use 'flash', 'dense' or dropout_rate=0)")
  return no_weights(problem)


def no_weights(problem: Problem) -> str | None:
  """The reason a kernel that never forms ``[T, S]`` weights refuses."""
  if problem.return_weights:
    return ("it never forms the attention weights (use implementation="
            "'dense' or None with return_weights=True)")
  return None
