"""``ulysses_attention``: the sequence split across devices, heads swapped in.

Shape glossary: B batch, N query heads, K key/value heads, T this device's
query length, S this device's key/value length, H head dim, Hv value head
dim; P devices on ``axis_name``, R devices on ``ring_axis`` (the hybrid);
``T_g = P * T`` and ``S_g = P * S`` (``R * P * T``, ``R * P * S`` in the
hybrid) the whole sequence's lengths.

DeepSpeed-Ulysses (Jacobs et al. 2023): inside ``jax.shard_map`` every device
holds ``[B, N, T, H]`` queries of its share of the sequence. One
``all_to_all`` trades the sequence split for a head split: each device then
holds the *whole* sequence of ``N / P`` heads, ``[B, N/P, T_g, H]``, and
runs any kernel on it unchanged (``scaled_dot_product_attention``'s
``implementation=``: the fused ones too, since they see an ordinary
full-sequence call), and a last ``all_to_all`` brings its output back to
``[B, N, T, Hv]``. Keys and values go the same way (``K / P`` heads each;
with fewer key/value heads than devices each head is repeated ``P / K``
times first, so that every device receives the one its query heads share).

Cost: four ``all_to_all`` forward (q, k, v, out), each moving ``(P - 1) /
P`` of the local tensor; the same four backward. Ring attention instead
sends ``K`` and ``V`` ``P - 1`` times round the ring (``aj.ring_attention``):
Ulysses moves less when ``P`` is large and the heads many, and lets any
kernel run; it needs ``P`` to divide ``N``, and its memory per device is
that of a full-sequence call of ``N / P`` heads. The hybrid (``ring_axis``,
USP: Fang & Zhao 2024) splits the sequence over ``(ring_axis,
axis_name)``: an all-to-all within each group of ``axis_name`` gives every
device its group's sequence of ``N / P`` heads, and a ring over
``ring_axis`` crosses the ``R`` groups.

The mask speaks of the whole sequence, as in ``ring_attention``: causality,
windows, lengths, positions, rules and ``score_mod`` see global indices and
the global head; sinks are every head's (replicated). What runs along the
sequence arrives as this device's shard and is gathered: segment ids
``[B, T]`` (over ``axis_name`` only in the hybrid: the ring takes its
group's), and the dense mask and bias ``[B|1, N|1, T|1, S_g|1]`` (this
device's rows, every key column, in the keys' layout order).
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
import numpy as np

from attention_jax import kernels
from attention_jax.attention import dot_product
from attention_jax.attention import ring as ring_lib
from attention_jax.core import checks
from attention_jax.kernels import ring_layout
from attention_jax.masking import mask as mask_lib
from attention_jax.masking.mask import BlockMask
from attention_jax.masking.mask import Mask
from attention_jax.scores import score_mods


def ulysses_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    mask: Mask | ArrayLike | BlockMask | None = None,
    *,
    axis_name: str,
    ring_axis: str | None = None,
    layout: str = "contiguous",
    bias: ArrayLike | None = None,
    scale: float | ArrayLike | None = None,
    is_causal: bool = False,
    score_mod: Any = None,
    sinks: ArrayLike | None = None,
    implementation: Any = None,
    block_q: int | None = None,
    block_k: int | None = None,
    return_lse: bool = False,
    return_max_logits: bool = False,
) -> jax.Array | tuple[jax.Array, ...]:
  """Attention over a sequence split across devices, by all-to-all.

  Call inside ``jax.shard_map`` (or anything that binds the axes), with
  the query and key/value sequence dimension sharded over ``axis_name`` in
  order (over ``(ring_axis, axis_name)``, ``ring_axis`` major, in the
  hybrid); the result is this device's rows of attention over the whole
  sequence (module docstring: how, and what it costs).

  Args:
    query: float ``[B, N, T, H]``, this device's queries; ``P`` must divide
      ``N``.
    key: float ``[B, K, S, H]``, this device's keys; ``K`` divides ``N``
      (grouped-query attention) and either ``P`` divides ``K`` (each device
      takes ``K / P`` heads) or ``K`` divides ``P``: then each key/value
      head is repeated ``P / K`` times before the all-to-all (sending ``P /
      K`` times this device's keys and values), so every device receives
      the one head its query heads share.
    value: float ``[B, K, S, Hv]``.
    mask: on the *whole* sequence (``T_g`` queries, ``S_g`` keys), as in
      ``ring_attention``: ``causal`` and ``window`` bottom-right aligned on
      the global lengths, ``q_lengths`` / ``kv_lengths`` global
      (replicated), positions those of the whole sequence's row 0 and
      column 0, a rule (or a ``BlockMask`` built for ``[T_g, S_g]``, its
      per-head tables cut to this device's heads) called with global
      indices and the global head. Segment ids are this device's ``[T]`` /
      ``[B, T]`` and ``[S]`` / ``[B, S]``. The dense mask is ``[B|1, N|1,
      T|1, S_g|1]``: this device's rows (or 1) and every key column, in
      the keys' layout order. Per-head arrays (``[B, N]`` lengths, a dense
      mask's ``N``) are every head's.
    axis_name: the mesh axis of the all-to-all (``P`` devices).
    ring_axis: None, or the hybrid's outer mesh axis (``R`` devices): the
      all-to-all runs within each group of ``axis_name`` and
      ``aj.ring_attention`` crosses the groups over ``ring_axis``.
    layout: ``"contiguous"`` (device ``i`` holds rows ``[i*T, (i+1)*T)``)
      or ``"zigzag"`` (the caller permuted every per-token array with
      ``aj.zigzag(x, devices)``: ``devices = P`` here, the ring's ``R`` in
      the hybrid, where it is the ring's layout; ``T`` and ``S`` even).
      Running on shards, this function cannot permute: natural-order
      shards under ``"zigzag"`` give wrong numbers with no error
      (``aj.SequenceParallel`` permutes whole arrays itself).
      Without a ring it only reorders: the whole sequence is put back in
      order after the all-to-all (one static gather) and the output back
      in the layout's before it returns.
    bias: float ``[B|1, N|1, T|1, S_g|1]``, laid out like the dense mask.
    score_mod: called with global indices and the global head ``h``;
      arrays it reads are replicated (an ``aj.ScoreMod``'s gradients are
      summed over the devices).
    sinks: ``[N]`` or ``[B, N]``, every head's (replicated).
    implementation: the kernel each device runs on its heads' whole
      sequence (as in sdpa). Not with ``ring_axis`` (the ring is the
      kernel there).
    block_q, block_k: the flash kernel's block sizes
      (``aj.kernels.Flash(block_q, block_k)``; not with
      ``implementation``), or the ring's in the hybrid.

  Other arguments (scale, is_causal, return_lse, return_max_logits: over
  the whole sequence; a kernel without max logits refuses), the return
  values (``[B, N, T, Hv]``: this device's rows, every head; ``lse`` and
  ``max_logits`` ``[B, N, T]``) and the errors: as
  ``aj.scaled_dot_product_attention`` (docs/options.md). No dropout,
  weights or ``partition``.

  Raises:
    ValueError: besides the kernel's: ``axis_name`` or ``ring_axis`` not
      bound (outside ``shard_map``), operands not 4-D, ``P`` not dividing
      ``N``, ``K`` neither divisible by ``P`` nor dividing it, a dense mask
      or bias not laid out as above, ``implementation`` or block sizes
      where they would be ignored, an odd ``T`` or ``S`` with
      ``layout="zigzag"``, a union holding segment ids or a dense mask.

  Example:
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("seq",),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> x = jnp.ones((2, 4, 64, 16))  # [B, N, T, H], T split over "seq"
    >>> spec = P(None, None, "seq")
    >>> fn = jax.shard_map(
    ...     lambda q, k, v: ulysses_attention(q, k, v, axis_name="seq",
    ...                                       is_causal=True),
    ...     mesh=mesh, in_specs=spec, out_specs=spec)
    >>> fn(x, x, x).shape
    (2, 4, 64, 16)
  """
  checks.check_static_bool("is_causal", is_causal)
  ring_layout.check_layout(layout)
  mask = mask_lib.as_mask(mask, is_causal=is_causal)
  p = _axis_size("axis_name", axis_name)
  rings = 1 if ring_axis is None else _axis_size("ring_axis", ring_axis)
  _check_kernel_options(ring_axis, implementation, block_q, block_k)
  n, t, kv_heads, s = _head_split(query, key, value, p, axis_name, layout,
                                  ring_axis)
  s_global = s * p * rings
  index = jax.lax.axis_index(axis_name)
  heads = _Heads(axis_name, index * (n // p), n // p, n)
  # Put the sequence back in order only where the kernel reads it whole.
  order = ring_layout.unzigzag if (layout == "zigzag"
                                   and ring_axis is None) else None

  query = _to_heads(query, axis_name)  # [B, N/P, P*T, H]
  if kv_heads % p:  # fewer key/value heads than devices: one each
    key, value = (jnp.repeat(x, p // kv_heads, axis=1) for x in (key, value))
  key, value = (_to_heads(x, axis_name) for x in (key, value))
  mask = None if mask is None else _group_mask(mask, heads, t, t * p * rings,
                                               s_global)
  bias = None if bias is None else _rows_and_heads(
      "bias", bias, heads, t, s_global)
  score_mod = _shift_score_mod(score_mod, heads)
  sinks = None if sinks is None else _sinks(sinks, heads)
  # What is replicated over the axis now serves this device's heads alone:
  # marked as varying over it, its gradient is the sum over the devices
  # (the kernels' custom VJPs return per-device gradients).
  bias, sinks, scale, score_mod = _varying((bias, sinks, scale, score_mod),
                                           axis_name)
  if order is not None:
    query, key, value = (order(x, p) for x in (query, key, value))
    mask, bias = _in_order(mask, bias, p)

  out, lse, max_logits = _attend(
      query, key, value, mask, bias=bias, scale=scale, score_mod=score_mod,
      sinks=sinks, implementation=implementation, ring_axis=ring_axis,
      layout=layout, block_q=block_q, block_k=block_k, return_lse=return_lse,
      return_max_logits=return_max_logits)
  rows = [out] + [x for x in (lse, max_logits) if x is not None]
  if order is not None:  # back to the layout's order, [.., P*T(, Hv)]
    rows = [ring_layout.zigzag(x, p, axis=-2 if x.ndim == 4 else -1)
            for x in rows]
  # [B, N, T, Hv], then [B, N, T] each
  out, *extra = [_to_sequence(x, axis_name) for x in rows]
  return (out, *extra) if extra else out


def _check_kernel_options(ring_axis, implementation, block_q, block_k):
  """Refuses options the chosen path would silently ignore."""
  if ring_axis is not None and implementation is not None:
    raise ValueError(
        f"ulysses_attention(ring_axis={ring_axis!r}) runs the ring kernel "
        f"across the groups: implementation={implementation!r} would be "
        "ignored. Drop it (block_q/block_k set the ring's blocks), or drop "
        "ring_axis to run that kernel on whole sequences.")
  if ring_axis is None and implementation is not None and (
      block_q is not None or block_k is not None):
    raise ValueError(
        f"ulysses_attention: block_q={block_q}, block_k={block_k} are the "
        "flash kernel's block sizes, but implementation="
        f"{implementation!r} was given too: pass the sizes to that kernel "
        "(e.g. aj.kernels.Flash(block_q, block_k)) or drop implementation.")


def _head_split(query, key, value, p: int, axis_name, layout: str,
                ring_axis) -> tuple[int, int, int, int]:
  """``(N, T, K, S)``, checked before any collective runs (a clear error)."""
  q_shape, k_shape = checks.shape_of(query), checks.shape_of(key)
  v_shape = checks.shape_of(value)
  if len(q_shape) != 4 or len(k_shape) != 4 or len(v_shape) != 4:
    raise ValueError(
        f"ulysses_attention splits the heads: query, key and value must be "
        f"[B, N, T, H], [B, K, S, H] and [B, K, S, Hv], got shapes "
        f"{q_shape}, {k_shape} and {v_shape}.")
  n, t, kv_heads, s = q_shape[1], q_shape[2], k_shape[1], k_shape[2]
  if n % p:
    raise ValueError(
        f"ulysses_attention: the query heads N = {n} do not split over the "
        f"P = {p} devices of axis_name={axis_name!r}: each device attends "
        f"with N / P whole heads. Use an axis whose size divides {n}, or "
        "ring_attention (no head constraint).")
  if kv_heads % p and p % kv_heads:
    raise ValueError(
        f"ulysses_attention: the key/value heads K = {kv_heads} neither "
        f"split over the P = {p} devices of axis_name={axis_name!r} (K % P "
        f"!= 0) nor divide them (P % K != 0, which would repeat each head "
        "P / K times): a device's query heads would need parts of several "
        "key/value heads. Use an axis whose size divides K or is a "
        "multiple of it.")
  if layout == "zigzag" and ring_axis is None and (t % 2 or s % 2):
    raise ValueError(
        f"ulysses_attention(layout='zigzag'): this device's T = {t} and "
        f"S = {s} must be even (two chunks each, of the 2 * devices chunks "
        "the zigzag layout cuts the sequence into); pad the sequence to a "
        f"multiple of 2 * {p} tokens.")
  return n, t, kv_heads, s


def _attend(query, key, value, mask, *, bias, scale, score_mod, sinks,
            implementation, ring_axis, layout, block_q, block_k, return_lse,
            return_max_logits):
  """The kernel, or the hybrid's ring: ``(out, lse|None, max_logits|None)``."""
  if ring_axis is None:
    if implementation is None and (block_q is not None
                                   or block_k is not None):
      implementation = kernels.Flash(block_q, block_k)
    out, _, lse, max_logits = dot_product.run(
        query, key, value, mask, bias=bias, scale=scale,
        score_mod=score_mod, sinks=sinks, implementation=implementation,
        return_lse=return_lse, return_max_logits=return_max_logits)
  else:
    result = ring_lib.ring_attention(
        query, key, value, mask, axis_name=ring_axis, bias=bias,
        scale=scale, score_mod=score_mod, sinks=sinks, block_q=block_q,
        block_k=block_k, return_lse=return_lse,
        return_max_logits=return_max_logits, layout=layout)
    result = result if isinstance(result, tuple) else (result,)
    out, *rest = result
    lse = rest.pop(0) if return_lse else None
    max_logits = rest.pop(0) if return_max_logits else None
  return out, lse, max_logits


def _axis_size(name: str, axis) -> int:
  """The size of a bound mesh axis (a ValueError naming ``name`` outside
  ``shard_map``)."""
  try:
    return jax.lax.axis_size(axis)
  except NameError as e:
    raise ValueError(
        f"{name}={axis!r} is not bound: call ulysses_attention inside "
        "jax.shard_map over a mesh with that axis (the sequence dimension "
        f"sharded over it). ({e})") from None


@dataclasses.dataclass(frozen=True)
class _Heads:
  """Which query heads this device attends with after the all-to-all:
  ``[first, first + local)`` of ``total`` (``first`` traced)."""
  axis_name: str
  first: Any
  local: int
  total: int

  def take(self, x, axis: int):
    """``x``'s slice of this device's heads along ``axis`` (size ``total``;
    a size-1 axis broadcasts and is kept)."""
    if np.shape(x)[axis] == 1 or self.local == self.total:
      return x
    return jax.lax.dynamic_slice_in_dim(jnp.asarray(x), self.first,
                                        self.local, axis)


def _varying(tree, axis_name: str):
  """``tree``'s arrays marked as varying over ``axis_name`` (those that do
  not already; under ``shard_map(check_vma=False)`` nothing is tracked)."""
  def vary(x):
    if not isinstance(x, jax.Array):
      return x
    manual = jax.typeof(x).manual_axis_type
    if manual is None or axis_name in manual.varying:
      return x
    return jax.lax.pcast(x, axis_name, to="varying")
  return jax.tree.map(vary, tree)


def _to_heads(x, axis_name: str):
  """``[B, N, T, H]`` split over the sequence -> ``[B, N/P, P*T, H]``."""
  return jax.lax.all_to_all(x, axis_name, 1, 2, tiled=True)


def _to_sequence(x, axis_name: str):
  """The inverse: ``[B, N/P, P*T(, Hv)]`` -> ``[B, N, T(, Hv)]``."""
  return jax.lax.all_to_all(x, axis_name, 2, 1, tiled=True)


def _rows_and_heads(name: str, x, heads: _Heads, t: int, s_global: int):
  """A dense mask or bias ``[B|1, N|1, T|1, S_g|1]`` (this device's rows)
  as the group's: ``[B|1, N/P|1, P*T|1, S_g|1]``."""
  shape = checks.shape_of(x)
  if (len(shape) != 4 or shape[1] not in (1, heads.total)
      or shape[2] not in (1, t) or shape[3] not in (1, s_global)):
    raise ValueError(
        f"ulysses_attention's {name} has shape {shape}; it must be "
        f"[B|1, N|1, T|1, S_g|1] = [B|1, {heads.total}|1, {t}|1, "
        f"{s_global}|1]: this device's {t} query rows (or 1) and every one "
        f"of the {s_global} keys (or 1), sharded over the sequence axis "
        "like the queries.")
  x = jnp.asarray(x)
  if shape[2] == 1:  # the same for every row: only the heads change
    return heads.take(x, 1)
  if shape[1] == 1:  # every head's: the group's rows
    return jax.lax.all_gather(x, heads.axis_name, axis=2, tiled=True)
  # per head: the queries' all-to-all (this device's heads, every row)
  return _to_heads(x, heads.axis_name)


def _gather_ids(x, heads: _Heads):
  """Segment ids ``[T]`` / ``[B, T]`` / ``[B, N, T]`` (this device's) as
  the group's, with this device's heads."""
  x = jax.lax.all_gather(jnp.asarray(x), heads.axis_name, axis=-1,
                         tiled=True)
  return heads.take(x, 1) if x.ndim == 3 else x


def _per_example(x, heads: _Heads):
  """Lengths or positions ``[]`` / ``[B]`` / ``[B, N]`` (left-aligned)
  with this device's heads."""
  return heads.take(x, 1) if np.ndim(x) == 2 else x


def _group_mask(m: Mask, heads: _Heads, t: int, t_global: int,
                s_global: int) -> Mask:
  """The whole sequence's mask as this device's heads see it after the
  all-to-all: sequence-long arrays gathered, per-head arrays cut to its
  heads, rules seeing the global head."""
  fields = {}
  for name in ("q_lengths", "kv_lengths", "q_offset", "kv_offset"):
    x = getattr(m, name)
    fields[name] = None if x is None else _per_example(x, heads)
  if m.q_segment_ids is not None:
    fields["q_segment_ids"] = _gather_ids(m.q_segment_ids, heads)
    fields["kv_segment_ids"] = (
        fields["q_segment_ids"] if m.kv_segment_ids is m.q_segment_ids
        else _gather_ids(m.kv_segment_ids, heads))
  if m.dense is not None:
    fields["dense"] = _rows_and_heads("dense mask", m.dense, heads, t,
                                      s_global)
  return Mask(causal=m.causal, window=m.window,
              rule=_shift_rule(m.rule, heads, t_global, s_global), **fields)


def _in_order(m: Mask | None, bias, devices: int):
  """The group's mask and bias with zigzag rows, columns and segment ids
  put back in the sequence's order (what the kernel reads)."""
  def rows_cols(x):
    for axis in (-2, -1):
      if np.shape(x)[axis] > 1:
        x = ring_layout.unzigzag(x, devices, axis=axis)
    return x

  if m is not None:
    fields = {name: getattr(m, name) for name in mask_lib.ARRAY_FIELDS}
    for name in ("q_segment_ids", "kv_segment_ids"):
      if fields[name] is not None and np.shape(fields[name])[-1] > 1:
        fields[name] = ring_layout.unzigzag(fields[name], devices, axis=-1)
    if fields["dense"] is not None:
      fields["dense"] = rows_cols(fields["dense"])
    m = Mask(causal=m.causal, window=m.window, rule=m.rule, **fields)
  return m, None if bias is None else rows_cols(bias)


def _sinks(sinks, heads: _Heads):
  """Sinks ``[..., N]`` (right-aligned to the leading dims, replicated):
  this device's heads'."""
  sinks = jnp.asarray(sinks)
  return sinks if sinks.ndim == 0 else heads.take(sinks, -1)


def _reads_head(fn: Callable[..., Any], *args) -> bool:
  """Whether ``fn(*args)`` depends on its argument ``h`` (``args``'
  placeholder None): a rule or modifier that does not keeps its block
  tables concrete and the fused kernels' recognised forms."""
  at = next(i for i, a in enumerate(args) if a is None)
  try:
    closed = jax.make_jaxpr(
        lambda h: fn(*args[:at], h, *args[at + 1:]))(jnp.int32(0))
  except Exception:  # noqa: BLE001 (the kernel's own checks will say why)
    return True
  head = closed.jaxpr.invars[0]
  return (head in closed.jaxpr.outvars
          or any(head in eqn.invars for eqn in closed.jaxpr.eqns))


@dataclasses.dataclass(frozen=True)
class _ShiftedMod:
  """A ``ScoreMod.fn`` seeing the global head: params ``(its own, first)``."""
  fn: Callable[..., Any]

  def __call__(self, score, b, h, q_idx, kv_idx, params):
    inner, first = params
    return self.fn(score, b, h + first, q_idx, kv_idx, inner)


@dataclasses.dataclass(frozen=True)
class _ShiftedRule:
  """A ``MaskRule.fn`` seeing the global head: params ``(its own, first)``."""
  fn: Callable[..., Any]

  def __call__(self, b, h, q_idx, kv_idx, params):
    inner, first = params
    return self.fn(b, h + first, q_idx, kv_idx, inner)


@dataclasses.dataclass(frozen=True)
class _Plain:
  """A plain ``rule(b, h, q_idx, kv_idx)`` as a ``MaskRule.fn``."""
  rule: Callable[..., Any]

  def __call__(self, b, h, q_idx, kv_idx, params):
    del params  # it reads none
    return self.rule(b, h, q_idx, kv_idx)


def _call_rule(b, h, q_idx, kv_idx, rule):
  """A rule that is itself a pytree (``a & b`` of rules) as a
  ``MaskRule.fn`` over it."""
  return rule(b, h, q_idx, kv_idx)


def _shift_score_mod(mod, heads: _Heads):
  """``score_mod`` seeing the global head (``h + first``); ``first``
  travels in a ``ScoreMod``'s params (it is traced), which keep the
  original's arrays as leaves, so their gradients flow. One that reads no
  head is kept as it is (a fused kernel may recognise it)."""
  if mod is None or heads.local == heads.total:
    return mod
  score, index = jnp.zeros((1, 1), jnp.float32), jnp.zeros((1, 1), jnp.int32)
  if not _reads_head(mod, score, jnp.int32(0), None, index, index):
    return mod
  if not isinstance(mod, score_mods.ScoreMod):
    mod = score_mods.ScoreMod(_PlainMod(mod))
  return score_mods.ScoreMod(_ShiftedMod(mod.fn), (mod.params, heads.first),
                             mod.blocks)


@dataclasses.dataclass(frozen=True)
class _PlainMod:
  """A plain ``mod(score, b, h, q_idx, kv_idx)`` as a ``ScoreMod.fn``."""
  mod: Callable[..., Any]

  def __call__(self, score, b, h, q_idx, kv_idx, params):
    del params  # it reads none
    return self.mod(score, b, h, q_idx, kv_idx)


def _shift_rule(rule, heads: _Heads, t_global: int, s_global: int):
  """A mask's rule seeing the global head; one that reads none is kept as
  given (a union then stays one: the kernels bind it). A ``BlockMask``
  keeps its tables, cut to this device's heads when they are per head.
  """
  if isinstance(rule, mask_lib.Union):
    for m in rule.members():
      if m.dense is not None or m.q_segment_ids is not None:
        raise ValueError(
            "ulysses_attention takes no dense mask or segment ids inside a "
            "union of masks (a | b): a union is evaluated on global "
            "indices, where this device's rows and ids do not apply. Put "
            "them in the mask itself, not in a union.")
  if rule is None or heads.local == heads.total:
    return rule
  fn = mask_lib.rule_function(rule)
  if isinstance(rule, mask_lib.Union):  # at the lengths the kernels would
    fn = rule.bound(t_global, s_global)
  index = jnp.zeros((1, 1), jnp.int32)
  if not _reads_head(fn, jnp.int32(0), None, index, index):
    rule_fn = None  # kept
  elif isinstance(fn, mask_lib.MaskRule):
    rule_fn = mask_lib.MaskRule(_ShiftedRule(fn.fn),
                                (fn.params, heads.first), fn.examples)
  elif isinstance(fn, mask_lib.Both):
    rule_fn = mask_lib.MaskRule(_ShiftedRule(_call_rule),
                                (fn, heads.first), fn.examples)
  else:  # a plain function
    rule_fn = mask_lib.MaskRule(_ShiftedRule(_Plain(fn)),
                                (None, heads.first))
  if not isinstance(rule, BlockMask):
    return rule if rule_fn is None else rule_fn
  batch = rule.batch_shape
  if batch and batch[-1] not in (1, heads.total):
    raise ValueError(
        f"ulysses_attention: the BlockMask's tables have leading dims "
        f"{batch}, whose last (the heads) is neither 1 nor N = "
        f"{heads.total}: build it with block_mask(..., batch=(B, N)) or "
        "(B, 1).")
  tables = rule.tables
  if batch and batch[-1] == heads.total:  # per head: this device's heads
    tables = tuple(heads.take(x, len(batch) - 1) for x in tables)
  return BlockMask(rule.mask_fn if rule_fn is None else rule_fn, rule.q_len,
                   rule.kv_len, rule.block_q, rule.block_k, *tables)
