"""Input validation shared by the public functions.

Shape glossary: T query length, S key/value length, N query heads, K
key/value heads, H head dim, Hv value head dim; ``...`` leading batch dims.

Every check raises ``ValueError`` (shapes, values) or ``TypeError`` (dtypes)
with a message that names the argument and the shapes it got. Nothing here
uses ``assert``: validation must survive ``python -O``.

All checks look only at static information (shapes, dtypes, Python numbers),
so they run once at trace time and cost nothing inside ``jax.jit``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.core import elementwise
from attention_jax.core import grouping
from attention_jax.core import numerics
from attention_jax.masking import intervals
from attention_jax.masking import mask as mask_lib


def shape_of(x) -> tuple[int, ...]:
  return tuple(np.shape(x))


def check_float_array(name: str, x) -> None:
  """Requires a real floating-point array (float16/bfloat16/float32/float64)."""
  dtype = jnp.result_type(x)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
        f"{name} must be a real floating-point array, got dtype {dtype} "
        f"with shape {shape_of(x)}.")


def check_min_rank(name: str, x, min_rank: int, layout: str) -> None:
  if np.ndim(x) < min_rank:
    raise ValueError(
        f"{name} must have rank >= {min_rank} ({layout}), got shape "
        f"{shape_of(x)}.")


def check_rank(name: str, x, ranks: Sequence[int], layout: str) -> None:
  if np.ndim(x) not in ranks:
    allowed = " or ".join(str(r) for r in ranks)
    raise ValueError(
        f"{name} must have rank {allowed} ({layout}), got shape "
        f"{shape_of(x)}.")


def check_module_input(name: str, x, width: int, option: str,
                       layout: str = "[B, T, features]") -> None:
  """A module call's input: rank 3 with the ``width`` features the module
  was built with (``option`` names the constructor argument)."""
  check_rank(name, x, (3,), layout)
  if shape_of(x)[-1] != width:
    raise ValueError(
        f"{name} has {shape_of(x)[-1]} features (shape {shape_of(x)}), but "
        f"the module was built with {option}={width}.")


def check_mask_dtype(name: str, mask) -> None:
  """Masks are bool (True = may attend) or integer (0 = blocked)."""
  dtype = jnp.result_type(mask)
  if not (dtype == jnp.bool_ or jnp.issubdtype(dtype, jnp.integer)):
    raise TypeError(
        f"{name} must be a bool or integer array (True/non-zero = may "
        f"attend), got dtype {dtype} with shape {shape_of(mask)}. A float "
        "mask is ambiguous: pass additive values through `bias` instead.")


def broadcast_shapes(what: str, **shapes: tuple[int, ...]) -> tuple[int, ...]:
  """``jnp.broadcast_shapes`` with an error that names every operand."""
  try:
    return tuple(jnp.broadcast_shapes(*shapes.values()))
  except ValueError:
    listed = ", ".join(f"{k} {v}" for k, v in shapes.items())
    raise ValueError(f"{what} do not broadcast: {listed}.") from None


def check_broadcastable_to(name: str, shape: tuple[int, ...],
                           target: tuple[int, ...], layout: str,
                           full_shape: tuple[int, ...] | None = None) -> None:
  """Requires ``shape`` to broadcast to ``target`` without growing it.

  ``full_shape`` is the operand's whole shape when ``shape`` is a part of
  it (the message shows what the caller passed).
  """
  shape = tuple(shape)
  ok = len(shape) <= len(target) and all(
      s in (1, t) for s, t in zip(reversed(shape), reversed(target)))
  if not ok:
    whole = shape if full_shape is None else tuple(full_shape)
    part = "" if whole == shape else f" (its last axes {shape})"
    raise ValueError(
        f"{name} with shape {whole}{part} is not broadcastable to {layout} = "
        f"{target}.")


def check_static_bool(name: str, value) -> None:
  """A flag that changes the program must be a Python bool, not traced."""
  if isinstance(value, jax.core.Tracer):
    raise TypeError(
        f"{name} must be a Python bool, got a traced value: pass it as a "
        f"static argument (jax.jit(..., static_argnames=['{name}'])) or "
        "close over it.")
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a Python bool, got {value!r} "
                    f"({type(value).__name__}).")


def as_array_operand(name: str, x, layout: str):
  """``x`` as an array: None is refused by name, lists become arrays."""
  if x is None:
    raise TypeError(f"{name} is None: pass a float array {layout}.")
  if isinstance(x, (list, tuple)):
    return np.asarray(x)
  return x


def check_positive_int(name: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be a Python int, got {value!r} "
                    f"({type(value).__name__}).")
  if value <= 0:
    raise ValueError(f"{name} must be positive, got {value}.")


def check_dropout_rate(dropout_rate) -> None:
  """A Python-number rate must lie in [0, 1) (traced rates are not checked)."""
  if isinstance(dropout_rate, (int, float, np.number)) and not (
      0.0 <= float(dropout_rate) < 1.0):
    raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}.")


def check_dropout(dropout_rate, dropout_rng) -> None:
  """Rate in [0, 1); a positive rate needs a key (no silent no-op).

  A rate given as an array (traced, so it may be positive) needs a key too:
  without one it would be ignored.
  """
  check_dropout_rate(dropout_rate)
  python_number = isinstance(dropout_rate, (int, float, np.number))
  if dropout_rng is None and (not python_number or dropout_rate > 0.0):
    what = (f"dropout_rate={dropout_rate}" if python_number else
            f"a dropout_rate given as an array (shape "
            f"{shape_of(dropout_rate)})")
    raise ValueError(
        f"{what} needs a dropout_rng (a jax.random.key); pass the Python "
        "float dropout_rate=0.0 for deterministic use.")


def check_lengths(name: str, lengths) -> jax.Array | None:
  """Integer per-example lengths as int32 (``None`` stays None)."""
  if lengths is None:
    return None
  return jnp.asarray(numerics.integer_array(name, lengths), jnp.int32)


class Operands(NamedTuple):
  """Validated attention operands, heads grouped (see ``grouping``)."""
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
  groups: grouping.Groups | None
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


def _logits_layout(rank: int) -> str:
  return {2: "[T, S]", 3: "[B, T, S]", 4: "[B, N, T, S]"}.get(
      rank, "[" + ", ".join(["..."] * (rank - 2)) + ", T, S]")


def _rank_fix(name: str, shape: tuple[int, ...],
              logits: tuple[int, ...]) -> str:
  """How to give ``shape`` the rank of ``logits``, said for the likely intent."""
  rank, gap = len(logits), len(logits) - len(shape)
  lead = ", ".join(["None"] * gap)
  hints = []
  if len(shape) == 2 and rank >= 3 and shape[-1] in (1, logits[-1]):
    if shape[0] in (1, logits[0]):  # a [B, S] key-padding mask
      middle = ", ".join(["None"] * (rank - 2))
      hints.append(f"a [B, S] padding {name} becomes {name}[:, {middle}, :]")
    if shape[0] in (1, logits[-2]):  # a [T, S] mask shared by the batch
      hints.append(f"a [T, S] {name} becomes {name}[{lead}]")
  elif gap > 0:
    hints.append(f"leading size-1 axes: {name}[{lead}]")
  return "; ".join(hints)


def check_logits_rank(name: str, shape: tuple[int, ...],
                      logits: tuple[int, ...],
                      layout: str | None = None) -> None:
  """Masks and biases carry the logits' full rank (size-1 axes broadcast).

  NumPy would align a lower-rank operand to the right, so a ``[B, S]``
  padding mask against ``[B, N, T, S]`` logits would be read as ``[T, S]``
  whenever ``T == B``: a silent wrong answer. jax.nn requires 4-D masks for
  the same reason; here the rank must be at least the logits' (more
  leading axes broadcast the batch, as they do for the operands).
  """
  shape = tuple(shape)
  if len(shape) >= len(logits):  # more leading axes extend the batch
    return
  layout = layout or _logits_layout(len(logits))
  fix = _rank_fix(name, shape, logits)
  fix = f" ({fix})" if fix else ""
  other = (", or build it with aj.make_attention_mask(query_valid, "
           "key_valid); for key padding alone pass aj.Mask(kv_lengths=...) "
           "instead of a dense mask") if name == "mask" else ""
  raise ValueError(
      f"{name} with shape {shape} has rank {len(shape)}, but the logits are "
      f"{layout} = {logits} (rank {len(logits)}): a {name} must have the "
      f"logits' full rank, with size-1 axes where it is shared, so its axes "
      f"cannot be read two ways. Add the missing axes{fix}{other}.")


_JAX_NN_LAYOUT = (
    " The operands are read as [..., N, T, H] queries over [..., K, S, H] "
    "keys/values; jax.nn's [B, T, N, H] layout converts with "
    "jnp.swapaxes(x, 1, 2) (or call aj.dot_product_attention, which takes "
    "it as it is).")


def _segment_ids(name, ids, size, letter, leading_rank):
  """Integer ids ``[size]`` or ``[..., size]`` with one axis per leading dim."""
  ids = numerics.integer_array(name, ids, f" [..., {letter}]")
  shape = shape_of(ids)
  if len(shape) not in (1, leading_rank + 1) or shape[-1] != size:
    raise ValueError(
        f"{name} with shape {shape} must be [{letter}] = [{size}] (shared) "
        f"or [B, {letter}] (per example; [B, N, {letter}] per head), "
        f"aligned to the left of the operands' leading dims.")
  return jnp.asarray(ids, jnp.int32)


def check_concrete_range(name, lengths, upper: int, fix: str = "") -> None:
  """Concrete lengths must lie in ``[0, upper]`` (traced ones clip)."""
  try:
    values = np.asarray(lengths)
  except jax.errors.TracerArrayConversionError:
    return
  if values.size and (values.min() < 0 or values.max() > upper):
    raise ValueError(
        f"{name} must lie in [0, {upper}], got values from {values.min()} "
        f"to {values.max()} (shape {values.shape}){fix}.")


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
    check_broadcastable_to(name, shape[-2:], (t, s), "[T, S]", shape)
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
  shape = shape_of(x)
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
  check_float_array("query", query)
  q_shape, k_shape, v_shape = map(shape_of, (query, key_pages, value_pages))
  dtypes = []
  for name, x, scales in (("key_pages", key_pages, key_scales),
                          ("value_pages", value_pages, value_scales)):
    if scales is None:
      check_float_array(name, x)
      dtypes.append(jnp.result_type(x))
      continue
    stored = jnp.result_type(x)
    if stored not in (jnp.int8, jnp.float8_e4m3fn):
      raise TypeError(f"{name} with scales must be int8 or float8_e4m3fn "
                      f"(quantised pages), got {stored}.")
    check_float_array(f"{name}' scales", scales)
    if shape_of(scales) != shape_of(x)[:3]:
      raise ValueError(f"{name}' scales must be [P, K, Z] = "
                       f"{list(shape_of(x)[:3])}, got {shape_of(scales)}.")
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
  t_shape = shape_of(table)
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


def _split_heads(x, groups):
  """``grouping.split`` of a key or value, or of the ``ShapeDtypeStruct``
  a paged call's pages stand for."""
  if isinstance(x, jax.ShapeDtypeStruct):
    if groups is None:
      return x
    shape = x.shape[:-3] + (groups.num_kv_heads, 1) + x.shape[-2:]
    return jax.ShapeDtypeStruct(shape, x.dtype)
  return grouping.split(jnp.asarray(x), groups, -3)


def attention_operands(query, key, value, mask=None, bias=None, *,
                       sinks=None, score_mod=None,
                       head_index: bool = False) -> Operands:
  """Checks the operands of an attention function and normalises them.

  ``mask`` is a ``Mask`` or None (the public functions convert what they
  accept, once, with ``mask.as_mask``). The checks are stated in the
  caller's terms (query heads N against key/value heads K); the operands
  come back with the head axis split when ``K`` divides ``N``
  (``grouping``), ready for ``broadcast_vmap``. A rule becomes
  ``rule``: a ``BlockMask`` with tables as given, or one without
  tables (``kinds is None``) whose tables the kernel builds at its own block
  sizes. ``head_index``: give every head its ``(b, h)`` even without a
  score modifier or rule (dropout draws its mask from them).
  """
  m = mask_lib.Mask() if mask is None else mask
  dense, kv_lengths, q_lengths = m.dense, m.kv_lengths, m.q_lengths
  q_segment_ids, kv_segment_ids, rule = (m.q_segment_ids, m.kv_segment_ids,
                                         m.rule)
  query, key, value = (as_array_operand(name, x, layout) for name, x, layout
                       in (("query", query, "[..., T, H]"),
                           ("key", key, "[..., S, H]"),
                           ("value", value, "[..., S, Hv]")))
  for name, x in (("query", query), ("key", key), ("value", value)):
    check_float_array(name, x)
  check_min_rank("query", query, 2, "[..., T, H]")
  check_min_rank("key", key, 2, "[..., S, H]")
  check_min_rank("value", value, 2, "[..., S, Hv]")
  q_shape, k_shape, v_shape = map(shape_of, (query, key, value))
  if q_shape[-1] != k_shape[-1]:
    raise ValueError(
        f"query and key must have the same head dim H (last axis): query "
        f"{q_shape}, key {k_shape}."
        + (_JAX_NN_LAYOUT if len(q_shape) == 4 else ""))
  if k_shape[-2] != v_shape[-2]:
    raise ValueError(
        f"key and value must have the same length S (axis -2): key "
        f"{k_shape}, value {v_shape}.")
  t, s = q_shape[-2], k_shape[-2]
  groups = grouping.find(q_shape, k_shape)

  def as_query_heads(shape):  # K key/value heads checked as N query heads
    if groups is None or len(shape) < 3 or shape[-3] != groups.num_kv_heads:
      return shape
    return shape[:-3] + (groups.num_heads,) + shape[-2:]

  leading = {"query": q_shape[:-2], "key": as_query_heads(k_shape)[:-2],
             "value": as_query_heads(v_shape)[:-2]}
  leading_rank = max(len(q_shape), len(k_shape), len(v_shape)) - 2
  q_offset, kv_offset = (None, None) if not m.positioned else (
      m.offsets(t, s))
  kv_lengths, q_lengths, q_offset, kv_offset = (
      _left_aligned(f"Mask's {n}", x, 0, leading_rank, "a scalar or [B]")
      for n, x in (("kv_lengths", kv_lengths),
                   ("q_lengths", q_lengths),
                   ("q_offset", q_offset), ("kv_offset", kv_offset)))
  if q_segment_ids is not None and np.ndim(q_segment_ids) > 1:
    q_segment_ids = _left_aligned("Mask's q_segment_ids", q_segment_ids, 1,
                                  leading_rank, "[T] or [B, T]")
  if kv_segment_ids is not None and np.ndim(kv_segment_ids) > 1:
    kv_segment_ids = _left_aligned("Mask's kv_segment_ids", kv_segment_ids,
                                   1, leading_rank, "[S] or [B, S]")
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
  if rule is not None and not isinstance(rule, mask_lib.BlockMask):
    fn = rule.bound(t, s) if isinstance(rule, mask_lib.Union) else rule
    rule = mask_lib.BlockMask(fn, t, s, None, None, None, None, None, None,
                              None)
  if rule is not None:
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
  logits = _logits_shape(leading, t, s)
  if dense is not None:
    check_mask_dtype("mask", dense)
    check_logits_rank("mask", shape_of(dense), logits)
    dense = numerics.as_bool_mask(dense)
    _check_pair_axes("mask", dense.shape, t, s, q_shape, k_shape)
    leading["mask"] = dense.shape[:-2]
  if bias is not None:
    check_float_array("bias", bias)
    check_logits_rank("bias", shape_of(bias), logits)
    bias = jnp.asarray(bias)
    _check_pair_axes("bias", bias.shape, t, s, q_shape, k_shape)
    leading["bias"] = bias.shape[:-2]
  check_score_mod(score_mod, t, s, numerics.compute_dtype(query, key))
  what = "leading (batch) dimensions of the attention operands"
  if len(q_shape) == 4 and len(k_shape) == 4 and groups is None:
    what += (" (4-D operands are [B, N, T, H] queries over [B, K, S, H] "
             "keys/values: K must be 1, N or a divisor of N. jax.nn's "
             "[B, T, N, H] layout converts with jnp.swapaxes(x, 1, 2), or "
             "call aj.dot_product_attention, which takes it as it is)")
  batch_shape = broadcast_shapes(what, **leading)
  all_lengths = {}  # lengths and positions: per example (or head) integers
  for name, given, upper in (
      ("the mask's kv_lengths", kv_lengths, s),
      ("the mask's q_lengths", q_lengths, t),
      ("the mask's q_offset", q_offset, None),  # positions: any integer
      ("the mask's kv_offset", kv_offset, None)):
    lengths = all_lengths[name] = check_lengths(name, given)
    if lengths is None:
      continue
    # One axis per leading dim (or a scalar): a [B] array against [B, N]
    # leading dims would otherwise be read as per-head values when B == N.
    if lengths.ndim not in (0, len(batch_shape)):
      raise ValueError(
          f"{name} with shape {lengths.shape} does not fit the leading dims "
          f"{batch_shape}: it is a scalar, [B] per example (aligned to the "
          f"left of the leading dims) or [B, N] per head.")
    if upper is not None:
      check_concrete_range(name, given, upper)
    leading[name] = lengths.shape
  q_offset = all_lengths.pop("the mask's q_offset")
  kv_offset = all_lengths.pop("the mask's kv_offset")
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("segment ids come in pairs: pass q_segment_ids with "
                     "kv_segment_ids (or q_segment_ids alone for packed "
                     "self-attention).")
  if q_segment_ids is not None:
    q_segment_ids = _segment_ids("the mask's q_segment_ids", q_segment_ids,
                                 t, "T", len(batch_shape))
    kv_segment_ids = _segment_ids("the mask's kv_segment_ids",
                                  kv_segment_ids, s, "S", len(batch_shape))
    leading["the mask's q_segment_ids"] = q_segment_ids.shape[:-1]
    leading["the mask's kv_segment_ids"] = kv_segment_ids.shape[:-1]
  if sinks is not None:
    check_float_array("sinks", sinks)
    sinks = jnp.asarray(sinks)
    check_broadcastable_to("sinks", sinks.shape, batch_shape,
                           "the leading dims (e.g. [B, N] or [N])")
  batch_shape = broadcast_shapes(what, **leading)
  caller_leading = batch_shape
  index_wanted, head_index = head_index, None
  if index_wanted or score_mod is not None or rule is not None:
    head_index = _head_index(batch_shape, groups)
  query = grouping.split(jnp.asarray(query), groups, -3)
  key, value = (_split_heads(x, groups) for x in (key, value))
  dense, bias = (grouping.split(x, groups, -3) for x in (dense, bias))
  if rule is not None and rule.batch_shape:
    rule = rule.with_tables(
        grouping.split(jnp.asarray(x), groups, -3)
        for x in rule.tables)
  kv_lengths, q_lengths = (grouping.split(x, groups, -1)
                           for x in all_lengths.values())
  q_segment_ids, kv_segment_ids = (grouping.split(x, groups, -2)
                                   for x in (q_segment_ids, kv_segment_ids))
  sinks = grouping.split(sinks, groups, -1)
  q_offset, kv_offset = (grouping.split(x, groups, -1)
                         for x in (q_offset, kv_offset))
  if groups is not None:
    batch_shape = batch_shape[:-1] + (groups.num_kv_heads,
                                      groups.num_heads // groups.num_kv_heads)
  return Operands(query, key, value, dense, bias, kv_lengths, q_lengths,
                  q_segment_ids, kv_segment_ids, sinks, head_index, groups,
                  batch_shape, m.window, score_mod, rule, bool(m.causal),
                  caller_leading, q_offset, kv_offset)


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


_ELEMENTWISE_MEANS = (
    "a score modifier must be elementwise: its output at (i, j) may read "
    "score[i, j], b, h, q_idx[i], kv_idx[j] and arrays indexed by them, "
    "never other scores (each kernel calls it on the scores it holds: the "
    "dense kernel on a head's whole [T, S], the blockwise ones on each "
    "block, so anything else would change with the kernel)")


def check_score_mod(score_mod, t: int | None = None, s: int | None = None,
                    dtype: Any = jnp.float32) -> None:
  """A score modifier is callable as ``(score, b, h, q_idx, kv_idx)`` and,
  given the lengths, elementwise: float scores of the score's shape for a
  head's ``[T, S]`` and for a ``[1, 1]`` block, computed from each entry
  alone (``elementwise``). Abstract: nothing is computed."""
  if score_mod is None:
    return
  if not callable(score_mod):
    raise TypeError(
        f"score_mod must be callable as score_mod(score, b, h, q_idx, "
        f"kv_idx) (e.g. aj.alibi(slopes), or aj.ScoreMod(fn, params)), got "
        f"{type(score_mod).__name__}.")
  if t is None:
    return
  i32 = jnp.int32
  for rows, cols in dict.fromkeys(((t, s), (1, 1))):
    shapes = f"score [{rows}, {cols}], q_idx [{rows}, 1], kv_idx [1, {cols}]"
    args = (jax.ShapeDtypeStruct((rows, cols), dtype),
            jax.ShapeDtypeStruct((), i32), jax.ShapeDtypeStruct((), i32),
            jax.ShapeDtypeStruct((rows, 1), i32),
            jax.ShapeDtypeStruct((1, cols), i32))
    try:
      closed = jax.make_jaxpr(score_mod)(*args)
    except Exception as e:  # noqa: BLE001 - only the block probe is ours
      if (rows, cols) == (t, s):
        raise
      raise TypeError(
          f"score_mod failed on one block of scores ({shapes}; b, h int32 "
          f"scalars) with {type(e).__name__}: {e}. The blockwise kernels "
          f"call it on blocks: {_ELEMENTWISE_MEANS}.") from e
    outs = closed.out_avals
    if len(outs) != 1:
      raise TypeError(
          f"score_mod must return one array of modified scores, got "
          f"{len(outs)} outputs for {shapes}.")
    out = outs[0]
    if not jnp.issubdtype(out.dtype, jnp.floating):
      raise TypeError(
          f"score_mod must return float scores, got dtype {out.dtype} (shape "
          f"{tuple(out.shape)}) for {shapes}: return a float array (-inf "
          "blocks an entry).")
    if tuple(out.shape) != (rows, cols):
      raise ValueError(
          f"score_mod returned shape {tuple(out.shape)} for {shapes}; it "
          f"must return the score's shape [{rows}, {cols}]: "
          f"{_ELEMENTWISE_MEANS}.")
    culprit = elementwise.mixing_primitive(closed)
    if culprit is not None:
      raise ValueError(
          f"score_mod is not elementwise: it applies {culprit!r} to the "
          f"scores ({shapes}); {_ELEMENTWISE_MEANS}. Row-wise statistics "
          "(a sum or standard deviation over keys) cannot be a score "
          "modifier.")


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
  return grouping.split(b, groups, -1), grouping.split(h, groups, -1)


def check_soft_cap(value, name: str = "logits_soft_cap",
                   optional: bool = True) -> None:
  """A soft cap is a positive Python number (static), or None if optional."""
  if value is None and optional:
    return
  if isinstance(value, bool) or not isinstance(
      value, (int, float, np.integer, np.floating)):
    raise TypeError(f"{name} must be a positive Python number, got "
                    f"{value!r} ({type(value).__name__}).")
  if not value > 0 or not np.isfinite(value):
    raise ValueError(f"{name} must be positive and finite, got {value}.")


def check_scale(scale) -> None:
  """A layer's ``scale`` is a positive, finite Python number or None."""
  if scale is None:
    return
  if isinstance(scale, bool) or not isinstance(
      scale, (int, float, np.integer, np.floating)):
    raise TypeError(f"scale must be a positive Python number (the multiplier "
                    f"of q . k) or None, got {scale!r} "
                    f"({type(scale).__name__}).")
  if not scale > 0 or not np.isfinite(scale):
    raise ValueError(f"scale must be positive and finite, got {scale}; None "
                     "means 1 / sqrt(head_dim).")


def check_call_scale(scale) -> None:
  """An attention call's ``scale``: None, a positive finite number, or a
  float scalar array (positive and finite when concrete; a traced one, a
  learned scale, cannot be checked)."""
  if scale is None:
    return
  if isinstance(scale, (int, float, np.integer, np.floating, bool,
                        np.bool_)):
    check_scale(scale)
    return
  if not hasattr(scale, "dtype") or not hasattr(scale, "shape"):
    raise TypeError(
        f"scale must be a positive number (the multiplier of q . k), a float "
        f"scalar array or None (1 / sqrt(H)), got {scale!r} "
        f"({type(scale).__name__}).")
  if not jnp.issubdtype(scale.dtype, jnp.floating) or np.shape(scale):
    raise TypeError(
        f"scale must be a positive number or a float scalar array (shape "
        f"()), got dtype {scale.dtype} with shape {np.shape(scale)}.")
  try:
    value = float(np.asarray(scale))
  except jax.errors.TracerArrayConversionError:
    return
  if not value > 0 or not np.isfinite(value):
    raise ValueError(f"scale must be positive and finite, got an array "
                     f"holding {value}; None means 1 / sqrt(head_dim).")


def check_head_counts(d_model: int, num_heads: int,
                      num_kv_heads: int | None) -> int:
  """Validates ``D``, ``N`` and ``K``; returns ``K`` (``N`` when None)."""
  check_positive_int("d_model", d_model)
  check_positive_int("num_heads", num_heads)
  if num_kv_heads is None:
    num_kv_heads = num_heads
  check_positive_int("num_kv_heads", num_kv_heads)
  if d_model % num_heads:
    raise ValueError(f"d_model={d_model} must be divisible by num_heads="
                     f"{num_heads}.")
  if num_heads % num_kv_heads:
    raise ValueError(f"num_heads={num_heads} must be divisible by "
                     f"num_kv_heads={num_kv_heads}.")
  return num_kv_heads
