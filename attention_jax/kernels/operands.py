"""The call's operands, validated once and grouped: what ``Problem.ops`` holds.

Shape glossary: B batch, T query length, S key/value length, N query heads,
K key/value heads (G = N // K per key/value head), H head dim, Hv value
head dim, P pages, Z page size, M pages per row; ``...`` leading dims.

``attention_operands`` is called once per attention call, by
``base.canonicalize``: it checks the query, key, value, the ``Mask``'s
fields, the bias, sinks, score modifier and rule in the caller's terms
(query heads N against key/value heads K), and returns ``Operands``: the
same values under the ``Mask``'s own field names, per-example ones
aligned to the left of the leading dims, int32, and every array with a
head axis split for grouped-query attention (``core/broadcast.py``: ``split_groups``),
ready for ``lift_heads``. Every check raises ``ValueError`` (shapes,
values) or ``TypeError`` (dtypes) naming the argument and the shapes.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.core import broadcast
from attention_jax.core import checks
from attention_jax.core import numerics
from attention_jax.masking import intervals
from attention_jax.masking import mask as mask_lib


class Operands(NamedTuple):
  """Validated attention operands, heads grouped (``broadcast.split_groups``)."""
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
  groups: broadcast.Groups | None
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


def _leading(shapes, groups) -> dict[str, tuple[int, ...]]:
  """Each operand's leading dims, key/value heads K read as the N query
  heads they serve (so they broadcast against the query's)."""
  leading = {}
  for name, shape in zip(("query", "key", "value"), shapes):
    if (name != "query" and groups is not None and len(shape) >= 3
        and shape[-3] == groups.num_kv_heads):
      shape = shape[:-3] + (groups.num_heads,) + shape[-2:]
    leading[name] = tuple(shape[:-2])
  return leading


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
      checks.check_concrete_range(what, x, upper)
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
  checks.check_logits_rank(name, tuple(np.shape(x)), logits)
  x = numerics.as_bool_mask(x) if name == "mask" else jnp.asarray(x)
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
  (``broadcast.split_groups``), ready for ``lift_heads``. A rule becomes a
  ``BlockMask`` with tables as given, or one without tables (``kinds is
  None``) whose tables the kernel builds at its own block sizes.
  ``head_index``: give every head its ``(b, h)`` even without a score
  modifier or rule (dropout draws its mask from them).
  """
  m = mask_lib.Mask() if mask is None else mask
  query, key, value = _arrays(query, key, value)
  shapes = q_shape, k_shape, _ = tuple(map(np.shape, (query, key, value)))
  t, s = q_shape[-2], k_shape[-2]
  groups = broadcast.find_groups(q_shape, k_shape)
  leading = _leading(shapes, groups)
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
    checks.check_score_mod(score_mod, t, s, numerics.compute_dtype(query, key))
  batch_shape = _batch_shape(leading, q_shape, k_shape, groups)
  fields = dict.fromkeys(_PER_EXAMPLE)
  if m.kv_lengths is not None or m.q_lengths is not None or m.positioned:
    fields = _per_example(m, t, s, leading_rank, batch_shape, leading)
  q_ids = kv_ids = None
  if m.q_segment_ids is not None or m.kv_segment_ids is not None:
    q_ids, kv_ids = _segment_pair(m, t, s, leading_rank, leading)
  if sinks is not None:
    checks.check_float_array("sinks", sinks)
    sinks = jnp.asarray(sinks)
    checks.check_broadcastable_to("sinks", sinks.shape, batch_shape,
                                  "the leading dims (e.g. [B, N] or [N])")
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
  groups, split = ops.groups, broadcast.split_groups
  rule = ops.rule
  if rule is not None and rule.batch_shape:
    rule = rule.with_tables(split(jnp.asarray(x), groups, -3)
                            for x in rule.tables)
  batch_shape = ops.leading
  if groups is not None:
    batch_shape = batch_shape[:-1] + (groups.num_kv_heads,
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
      head_index=_head_index(ops.leading, groups) if head_index else None,
      batch_shape=batch_shape, rule=rule,
      q_offset=split(ops.q_offset, groups, -1),
      kv_offset=split(ops.kv_offset, groups, -1))


def _split_heads(x, groups):
  """``broadcast.split_groups`` of a key or value, or of the ``ShapeDtypeStruct``
  a paged call's pages stand for."""
  if isinstance(x, jax.ShapeDtypeStruct):
    if groups is None:
      return x
    shape = x.shape[:-3] + (groups.num_kv_heads, 1) + x.shape[-2:]
    return jax.ShapeDtypeStruct(shape, x.dtype)
  return broadcast.split_groups(jnp.asarray(x), groups, -3)


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
  b, h = intervals.rule_indices(tuple(leading), jnp)
  lead = (1,) * len(leading)
  q_idx = jax.ShapeDtypeStruct(lead + (t, 1), jnp.int32)
  kv_idx = jax.ShapeDtypeStruct(lead + (1, s), jnp.int32)
  out = jax.eval_shape(mask_fn, b, h, q_idx, kv_idx)
  dtype = getattr(out, "dtype", None)
  if dtype != jnp.bool_:
    shape = tuple(getattr(out, "shape", ()))
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
  return broadcast.split_groups(b, groups, -1), broadcast.split_groups(h, groups, -1)
