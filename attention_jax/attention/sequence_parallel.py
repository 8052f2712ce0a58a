"""``SequenceParallel``: attention over a sequence split across mesh axes.

Shape glossary: B batch, N query heads, K key/value heads, T query length,
S key/value length, H head dim, Hv value head dim; P devices on the
sequence axis (or axes).

``aj.ring_attention`` and ``aj.ulysses_attention`` run inside
``jax.shard_map`` on one device's shard. ``SequenceParallel`` is what a
model calls instead, on the whole (global) arrays inside an ordinary
``jit`` under ``jax.set_mesh(mesh)``: it opens the ``shard_map`` itself, over
the sequence axis and the batch and head axes the arrays are split over,
and runs one of

* ``"ring"``: ``ring_attention`` round ``axis`` (key/value blocks travel);
* ``"ulysses"``: ``ulysses_attention`` over ``axis`` (all-to-all to whole
  sequences of ``N / P`` heads, any kernel, all-to-all back);
* ``"hybrid"``: all-to-all over ``axis`` inside each group, ring across the
  groups along ``ring_axis``; the sequence is split over ``(ring_axis,
  axis)``, ``ring_axis`` major.

It has ``scaled_dot_product_attention``'s contract and options (``mask``,
``bias``, ``scale``, ``is_causal``, ``score_mod``, ``sinks``,
``return_lse``: docs/options.md), so
``aj.MultiHeadAttention(attention_fn=aj.SequenceParallel("seq"))`` trains
a model with its sequence split; the projections, norms and feed-forward
blocks around it are per token, and XLA splits them over the same axis.

The mask speaks of the whole sequence (causality, windows, lengths,
positions, rules: global positions; lengths are checked against the whole
``T`` and ``S``); its per-token arrays (segment ids, ``[B, T]``), the
dense mask and the bias (``[B|1, N|1, T|1, S|1]``) are in the order the
tokens are.

``layout="zigzag"`` (the ring's load-balanced layout, ``ring_layout``)
takes the arrays in their natural order and permutes them itself: the
query, keys and values, the segment ids, the dense mask's and the bias's
rows and key columns go into the zigzag order over the ring's devices
(``aj.zigzag``: chunk moves between devices), the output and lse come
back in order. ``permuted=True`` says the caller did that once, before
the model (tokens, positions, segment ids and targets with ``aj.zigzag``;
a dense mask or bias on axis -2, then -1), and reads the outputs back
with ``aj.unzigzag`` (a per-token loss needs neither): no permutation per
call. The all-to-all (``"ulysses"``) attends over whole sequences, so on
natural-order arrays it runs as ``"contiguous"``. The mesh's axes are
Auto ones (``jax.sharding.AxisType.Auto``).

Each shard's ``score_mod`` and rule see the global ``(b, h)``: this
function shifts them by the shard's first example and head
(``shifted_indices``), so ``aj.alibi`` slopes and per-example rules read
the right entries.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp  # noqa: F401 (doctests)
from jax.sharding import PartitionSpec
import numpy as np

from attention_jax.attention import ring as ring_lib
from attention_jax.attention import ulysses as ulysses_lib
from attention_jax.core import checks
from attention_jax.kernels import ring_layout
from attention_jax.kernels import ring_local
from attention_jax.masking import mask as mask_lib
from attention_jax.masking.mask import BlockMask
from attention_jax.masking.mask import Mask
from attention_jax.scores import score_mods

METHODS = ("ring", "ulysses", "hybrid")
LAYOUTS = ("contiguous", "zigzag")
# The Mask's array fields that run along the sequence (last axis) and those
# with one value per example (and head).
_PER_TOKEN = ("q_segment_ids", "kv_segment_ids")
_PER_EXAMPLE = ("q_lengths", "kv_lengths", "q_offset", "kv_offset")


def _shifted_mod(score, b, h, q_idx, kv_idx, params):
  inner, b0, h0 = params
  return inner(score, b + b0, h + h0, q_idx, kv_idx)


@dataclasses.dataclass(frozen=True)
class _ShiftedRule:
  """A rule at ``(b + b0, h + h0)``: ``plain`` a function (static), or
  None when the rule is a pytree (a ``MaskRule``: its arrays are leaves of
  the params)."""
  plain: Any = None

  def __call__(self, b, h, q_idx, kv_idx, params):
    inner, b0, h0 = params
    rule = inner if self.plain is None else self.plain
    return mask_lib.rule_function(rule)(b + b0, h + h0, q_idx, kv_idx)


def shifted_indices(score_mod: Any, rule: Any, b0, h0):
  """``(score_mod, rule)`` seeing ``b + b0`` and ``h + h0``.

  A shard of the batch or the heads indexes its examples and heads from 0;
  what it calls reads the whole call's (``aj.alibi``'s slopes ``[N]``, a
  rule's per-example prefix lengths ``[B]``). The shift travels as an
  operand (``b0``/``h0`` may be traced, e.g. from ``lax.axis_index``): the
  modifier becomes an ``aj.ScoreMod`` whose params hold the original (its
  arrays keep their gradients), a rule an ``aj.MaskRule``; a
  ``BlockMask``'s tables are laid out per global ``(b, h)``, so only its
  ``mask_fn`` is kept, shifted (the kernels evaluate it per block). A union
  of masks is refused here (its members' arrays are the whole batch's).

  Example:
    >>> mod, _ = shifted_indices(lambda s, b, h, q, k: s + h, None, 0, 2)
    >>> float(mod(jnp.float32(1.0), 0, 1, 0, 0))
    4.0
  """
  if score_mod is not None:
    if not isinstance(score_mod, score_mods.ScoreMod):
      score_mod = score_mods.ScoreMod(
          functools.partial(score_mods.plain_fn, score_mod))
    score_mod = score_mods.ScoreMod(_shifted_mod, (score_mod, b0, h0),
                                    score_mod.blocks)
  if isinstance(rule, mask_lib.Union):
    raise ValueError(
        "SequenceParallel with the batch or heads split takes no union of "
        "masks (a | b): its members' arrays and rules are the whole "
        "call's. Write it as one Mask(rule=aj.MaskRule(fn, params)).")
  if rule is not None:
    if isinstance(rule, BlockMask):
      rule = rule.mask_fn
    if jax.tree.leaves(rule) and _is_pytree(rule):
      rule = mask_lib.MaskRule(_ShiftedRule(), (rule, b0, h0))
    else:  # a function: static, not a leaf
      rule = mask_lib.MaskRule(_ShiftedRule(rule), (None, b0, h0))
  return score_mod, rule


def _is_pytree(x) -> bool:
  """Whether ``x`` is a pytree node (a ``MaskRule``), not a leaf."""
  return not jax.tree_util.treedef_is_leaf(jax.tree.structure(x))


def _arrays_apart(tree):
  """``(arrays, rebuild)``: a pytree's array leaves, and a function putting
  (new) arrays back among its other leaves (functions, static values), so
  that only the arrays enter ``shard_map`` as operands."""
  leaves, treedef = jax.tree.flatten(tree)
  is_array = [isinstance(x, (jax.Array, np.ndarray, np.generic))
              for x in leaves]
  arrays = [x for x, a in zip(leaves, is_array) if a]

  def rebuild(new):
    new = iter(new)
    return jax.tree.unflatten(
        treedef, [next(new) if a else x for x, a in zip(leaves, is_array)])

  return arrays, rebuild


@dataclasses.dataclass(frozen=True)
class SequenceParallel:
  """Attention with the sequence split over ``axis`` of the ambient mesh.

  Args:
    axis: the mesh axis the sequence is split over (the all-to-all axis of
      ``"hybrid"``).
    method: ``"ring"``, ``"ulysses"`` or ``"hybrid"`` (module docstring).
    layout: ``"contiguous"`` (device ``i`` holds rows ``[i*T/P,
      (i+1)*T/P)``) or ``"zigzag"`` (the ring's load-balanced layout:
      device ``i`` of the ring's ``R`` holds chunks ``i`` and ``2R - 1 - i``
      of ``2R``; ``T`` and ``S`` multiples of ``2R``). The arrays come in
      their natural order; this call permutes them (module docstring).
    ring_axis: ``"hybrid"``'s outer axis (the ring across the groups).
    batch_axis: mesh axis (or axes) the batch is split over; None: the
      batch is not split here.
    head_axis: mesh axis the heads are split over (``aj.MultiHeadAttention
      (head_axis=...)``'s); None: not split.
    implementation: the kernel each device runs in ``"ulysses"`` (any of
      ``scaled_dot_product_attention``'s; None: automatic).
    block_q, block_k: the ring's per-device block sizes.
    permuted: with ``layout="zigzag"`` only: the caller already put every
      per-token array in the zigzag order (``aj.zigzag(x, R)``, ``R`` the
      ring's devices: ``axis``'s, or ``ring_axis``'s in the hybrid; a dense
      mask or bias on its rows and key columns) and reads the outputs
      with ``aj.unzigzag``: nothing is permuted per call (a model permutes
      its tokens, positions and targets once instead of every layer's
      q, k, v and output). Code written before ``permuted`` existed, when
      ``layout="zigzag"`` meant pre-permuted arrays, adds
      ``permuted=True`` (or drops its ``aj.zigzag``/``aj.unzigzag``).

  Called as ``aj.scaled_dot_product_attention`` is, with its ``mask``,
  ``bias``, ``scale``, ``is_causal``, ``score_mod``, ``sinks`` and
  ``return_lse`` (docs/options.md; the mask and bias laid out as in the
  module docstring), on the whole ``[B, N, T, H]`` / ``[B, K, S, H]``
  arrays, inside ``jit`` under ``jax.set_mesh``. It takes no dropout,
  weights or max logits (no split attention forms them), and no
  ``implementation`` or ``partition`` at the call (its fields say both).
  Lengths beyond the whole ``T`` / ``S`` are refused (a ValueError when
  concrete; traced ones under ``aj.checked``).

  Example:
    >>> mesh = jax.make_mesh((1,), ("seq",),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> x = jnp.ones((2, 4, 8, 16))  # [B, N, T, H]
    >>> with jax.set_mesh(mesh):
    ...   split = SequenceParallel("seq", layout="zigzag")
    ...   out = jax.jit(lambda q, k, v: split(q, k, v, is_causal=True))(
    ...       x, x, x)
    >>> out.shape
    (2, 4, 8, 16)
  """
  axis: str
  method: str = "ring"
  layout: str = "contiguous"
  ring_axis: str | None = None
  batch_axis: str | tuple[str, ...] | None = None
  head_axis: str | None = None
  implementation: Any = None
  block_q: int | None = None
  block_k: int | None = None
  permuted: bool = False

  def __post_init__(self):
    for name, value, choices in (("method", self.method, METHODS),
                                 ("layout", self.layout, LAYOUTS)):
      if value not in choices:
        raise ValueError(f"SequenceParallel's {name} must be one of "
                         f"{choices}, got {value!r}.")
    if not isinstance(self.permuted, bool):
      raise TypeError(f"SequenceParallel's permuted must be a Python bool, "
                      f"got {self.permuted!r}.")
    if self.permuted and self.layout != "zigzag":
      raise ValueError(
          f"SequenceParallel(permuted=True) says the arrays come already in "
          f"the zigzag order (aj.zigzag); it goes with layout='zigzag', got "
          f"layout={self.layout!r}. Drop permuted=True (contiguous arrays "
          "are in their natural order).")
    if (self.method == "hybrid") != (self.ring_axis is not None):
      raise ValueError(
          f"SequenceParallel(method={self.method!r}, ring_axis="
          f"{self.ring_axis!r}): the hybrid needs ring_axis (the outer axis "
          "the ring crosses) and the other methods take none.")
    if self.implementation is not None and self.method == "ring":
      raise ValueError(
          "SequenceParallel(method='ring') runs the ring kernel: "
          f"implementation={self.implementation!r} would be ignored; use "
          "method='ulysses' to run another kernel per device.")

  @property
  def _sequence(self):
    return (self.axis if self.ring_axis is None
            else (self.ring_axis, self.axis))

  def _mesh_sizes(self) -> dict[str, int]:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
      raise ValueError(
          f"SequenceParallel({self.axis!r}) needs a mesh: call it under "
          "jax.set_mesh(mesh) with that axis.")
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    kinds = dict(zip(mesh.axis_names, mesh.axis_types))
    for name in (self.axis, self.ring_axis, self.head_axis,
                 *_names(self.batch_axis)):
      if name is not None and name not in sizes:
        raise ValueError(
            f"SequenceParallel names mesh axis {name!r}, which the mesh "
            f"{sizes} does not have.")
      if name is not None and kinds[name] != jax.sharding.AxisType.Auto:
        raise ValueError(
            f"SequenceParallel splits over Auto mesh axes; {name!r} is "
            f"{kinds[name]}: build the mesh with axis_types="
            "(jax.sharding.AxisType.Auto, ...) (or call ring_attention / "
            "ulysses_attention inside your own jax.shard_map).")
    return sizes

  def __call__(self, query, key, value, mask=None, *, bias=None,
               scale=None, is_causal: bool = False, score_mod=None,
               sinks=None, return_lse: bool = False):
    checks.check_static_bool("is_causal", is_causal)
    mask = mask_lib.as_mask(mask, is_causal=is_causal)
    sizes = self._mesh_sizes()
    dims = self._dims(query, key, sizes)
    _check_lengths(mask, dims)
    split = functools.partial(self._split, sizes=sizes, dims=dims,
                              scale=scale, score_mod=score_mod, sinks=sinks,
                              return_lse=return_lse)
    return self._in_layout(split, sizes, dims, query, key, value, mask, bias,
                           return_lse)

  def _in_layout(self, split, sizes, dims, query, key, value, mask, bias,
                 return_lse):
    """``split`` on the arrays in the layout's order: natural-order arrays
    permuted into zigzag and the results back, unless ``permuted``."""
    if self.layout == "contiguous" or self.permuted:
      return split(query, key, value, mask, bias, layout=self.layout)
    if self.method == "ulysses":
      # Whole sequences per device: no causal imbalance to even out, and
      # contiguous gives the zigzag layout's result without permuting.
      return split(query, key, value, mask, bias, layout="contiguous")
    devices = sizes[self.ring_axis or self.axis]
    _check_zigzag_lengths(dims, devices)
    out = split(*_zigzagged(devices, query, key, value, mask, bias),
                layout="zigzag")
    if return_lse:  # [B, N, T, Hv], [B, N, T]
      return (ring_layout.unzigzag(out[0], devices, axis=-2),
              ring_layout.unzigzag(out[1], devices, axis=-1))
    return ring_layout.unzigzag(out, devices, axis=-2)

  def _dims(self, query, key, sizes) -> tuple[int, ...]:
    """``(B, N, T, K, S)``, checked against the mesh's splits."""
    q_shape, k_shape = checks.shape_of(query), checks.shape_of(key)
    if len(q_shape) != 4 or len(k_shape) != 4:
      raise ValueError(
          f"SequenceParallel takes [B, N, T, H] queries and [B, K, S, H] "
          f"keys, got {q_shape} and {k_shape}.")
    (b, n, t, _), (_, k, s, _) = q_shape, k_shape
    heads = _size(sizes, self.head_axis)
    for what, length, axes in (
        ("the query length T", t, self._sequence),
        ("the key length S", s, self._sequence),
        ("the batch B", b, self.batch_axis),
        ("the query heads N", n, self.head_axis)):
      parts = _size(sizes, axes)
      if length % parts:
        raise ValueError(
            f"SequenceParallel: {what} = {length} does not split over mesh "
            f"axes {axes!r} ({parts} devices); pad it to a multiple of "
            f"{parts} or use fewer devices.")
    if k % heads and k != 1:
      raise ValueError(
          f"SequenceParallel: the key/value heads K = {k} do not split over "
          f"head axis {self.head_axis!r} ({heads} devices) and are not one "
          "shared head; use a head axis that divides K.")
    return b, n, t, k, s

  def _split(self, query, key, value, mask, bias, *, layout, sizes, dims,
             scale, score_mod, sinks, return_lse):
    """The shard_map over the sequence, batch and head axes, with the
    arrays in ``layout``'s order."""
    b, n, _, k, _ = dims
    batch = _size(sizes, self.batch_axis)
    heads = _size(sizes, self.head_axis)
    # Key/value heads split with the queries', or one head every shard reads.
    kv_heads = self.head_axis if k % heads == 0 else None
    spec = functools.partial(_spec, self.batch_axis, b, self.head_axis, n)
    q_spec = PartitionSpec(self.batch_axis, self.head_axis, self._sequence,
                           None)
    kv_spec = PartitionSpec(self.batch_axis, kv_heads, self._sequence, None)
    arrays = {}
    if mask is not None:
      for name in _PER_TOKEN + _PER_EXAMPLE + ("dense",):
        x = getattr(mask, name)
        if x is not None and not (name == "kv_segment_ids"
                                  and x is mask.q_segment_ids):
          arrays[name] = x
    specs = {name: spec(x, self._sequence if name in _PER_TOKEN + (
        "dense",) else None, name) for name, x in arrays.items()}
    if bias is not None:
      arrays["bias"], specs["bias"] = bias, spec(bias, self._sequence, "bias")
    if sinks is not None:  # [N] or [B, N]: aligned to the right
      rank = len(checks.shape_of(sinks))
      padded = jax.ShapeDtypeStruct(
          (1,) * (2 - rank) + tuple(checks.shape_of(sinks)), jnp.float32)
      arrays["sinks"] = sinks
      specs["sinks"] = PartitionSpec(
          *spec(padded, None, "sinks")[2 - rank:]) if rank <= 2 else (
              PartitionSpec())  # (refused by the call's own checks)
    if (isinstance(scale, (np.ndarray, np.generic, jax.Array))
        and not isinstance(scale, jax.core.Tracer) and np.ndim(scale) == 0):
      scale = float(scale)  # concrete: a constant, as the kernels take it
    # What the rule, score_mod and a traced scale read is replicated.
    shared, rebuild = _arrays_apart(
        (None if mask is None else mask.rule, score_mod, scale))
    local = functools.partial(
        self._local, mask=mask, rebuild=rebuild, return_lse=return_lse,
        b_local=b // batch, n_local=n // heads, layout=layout)
    row_spec = PartitionSpec(self.batch_axis, self.head_axis,
                             self._sequence)
    out_specs = (q_spec, row_spec) if return_lse else q_spec
    return jax.shard_map(
        local, in_specs=(q_spec, kv_spec, kv_spec, specs,
                         [PartitionSpec()] * len(shared)),
        out_specs=out_specs)(query, key, value, arrays, shared)

  def _local(self, q, k, v, arrays, shared, *, mask, rebuild, return_lse,
             b_local, n_local, layout):
    """One device's call: its shard of every array, the whole mask."""
    # Replicated arrays meet batch and head shards in the kernels' custom
    # VJPs, whose cotangents then vary over those axes: typed as varying
    # over them here, their gradients are summed over the shards on the way
    # out (pcast's transpose). The sequence axes are the ring's and the
    # all-to-all's own (they sum over them themselves).
    split = (*_names(self.batch_axis), *_names(self.head_axis))
    rule, score_mod, scale = rebuild([_varying(x, split) for x in shared])
    if self.batch_axis is not None or self.head_axis is not None:
      score_mod, rule = shifted_indices(score_mod, rule,
                                        _first(self.batch_axis, b_local),
                                        _first(self.head_axis, n_local))
    if mask is not None:
      fields = {f: arrays.get(f) for f in mask_lib.ARRAY_FIELDS}
      if mask.kv_segment_ids is mask.q_segment_ids:
        fields["kv_segment_ids"] = None  # the queries' again
      mask = Mask(causal=mask.causal, window=mask.window, rule=rule, **fields)
    # The bias and sinks may be shared by the batch or head shards (size-1
    # axes): typed as varying there too, for the same reason.
    bias, sinks = (None if x is None else _varying(x, split)
                   for x in (arrays.get("bias"), arrays.get("sinks")))
    common = dict(scale=scale, score_mod=score_mod, sinks=sinks, bias=bias,
                  return_lse=return_lse, layout=layout)
    if self.method == "ring":
      return ring_lib.ring_attention(
          q, k, v, mask, axis_name=self.axis, block_q=self.block_q,
          block_k=self.block_k, **common)
    return ulysses_lib.ulysses_attention(
        q, k, v, mask, axis_name=self.axis, ring_axis=self.ring_axis,
        implementation=self.implementation, block_q=self.block_q,
        block_k=self.block_k, **common)


def _check_lengths(mask, dims) -> None:
  """The mask's lengths within the whole arrays' ``T`` and ``S``, before
  the ``shard_map`` (where concrete arrays are still concrete): a
  ValueError when concrete, a ``traced_check`` when traced."""
  if mask is None:
    return
  _, _, t, _, s = dims
  for name, given, total, letter in (("q_lengths", mask.q_lengths, t, "T"),
                                     ("kv_lengths", mask.kv_lengths, s, "S")):
    if given is not None:
      ring_local.check_global_length(
          f"the mask's {name}", given, total,
          f"{letter} = {total}, the whole sequence SequenceParallel splits")


def _check_zigzag_lengths(dims, devices: int) -> None:
  _, _, t, _, s = dims
  if t % (2 * devices) or s % (2 * devices):
    raise ValueError(
        f"SequenceParallel(layout='zigzag') cuts the sequence into 2 * "
        f"{devices} chunks (two per ring device): T = {t} and S = {s} must "
        f"be multiples of {2 * devices}; pad the sequence to a multiple or "
        "use layout='contiguous'.")


def _zigzagged(devices: int, query, key, value, mask, bias):
  """The call's arrays in the zigzag order over ``devices``: tokens, the
  mask's segment ids, and the dense mask's and the bias's rows and key
  columns (size-1 axes broadcast as they are). Lengths, positions, rules
  and ``score_mod`` speak of global positions: they stay."""
  t, s = checks.shape_of(query)[-2], checks.shape_of(key)[-2]
  order = functools.partial(ring_layout.zigzag, devices=devices)
  query, key, value = (order(x, axis=-2) for x in (query, key, value))
  bias = _zigzag_pair(bias, t, s, devices)
  if mask is not None:
    fields = {f: getattr(mask, f) for f in mask_lib.ARRAY_FIELDS}
    for name, length in (("q_segment_ids", t), ("kv_segment_ids", s)):
      ids = fields[name]
      # (ids of another length: refused by the call's own checks)
      if ids is not None and checks.shape_of(ids)[-1:] == (length,):
        fields[name] = order(ids, axis=-1)
    if mask.kv_segment_ids is mask.q_segment_ids:
      fields["kv_segment_ids"] = None  # the queries' again
    fields["dense"] = _zigzag_pair(mask.dense, t, s, devices)
    mask = Mask(causal=mask.causal, window=mask.window, rule=mask.rule,
                **fields)
  return query, key, value, mask, bias


def _zigzag_pair(x, t: int, s: int, devices: int):
  """A dense mask or bias ``[..., T|1, S|1]`` with its rows and columns in
  the zigzag order."""
  shape = () if x is None else checks.shape_of(x)
  if len(shape) < 2:
    return x  # (None; a misshapen one is refused by the call's checks)
  if shape[-2] == t:
    x = ring_layout.zigzag(x, devices, axis=-2)
  if shape[-1] == s:
    x = ring_layout.zigzag(x, devices, axis=-1)
  return x


def _varying(x, axes: tuple[str, ...]):
  """``x`` typed as varying over ``axes`` (those it does not vary over
  yet)."""
  manual = jax.typeof(x).manual_axis_type
  if manual is None:
    return x
  missing = tuple(a for a in axes if a not in manual.varying)
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def _names(axes) -> tuple[str, ...]:
  if axes is None:
    return ()
  return (axes,) if isinstance(axes, str) else tuple(axes)


def _size(sizes: dict[str, int], axes) -> int:
  total = 1
  for name in _names(axes):
    total *= sizes[name]
  return total


def _first(axes, per_shard: int):
  """The first global index of this shard along ``axes`` (major first)."""
  index = 0
  for name in _names(axes):
    index = index * jax.lax.axis_size(name) + jax.lax.axis_index(name)
  return jnp.asarray(index * per_shard, jnp.int32)  # (an operand, not 0)


def _spec(batch_axis, b, head_axis, n, x, sequence, name) -> PartitionSpec:
  """Where the mesh splits an array of the mask, the bias or the sinks.

  ``[B|1, N|1, T|1, S|1]`` dense masks and biases (rows over the sequence
  axes: this device's rows, every key), ``[T]`` / ``[B, T]`` / ``[B, N,
  T]`` segment ids, ``[]`` / ``[B]`` / ``[B, N]`` lengths and positions:
  a leading axis of size ``B`` (``N``) goes with the batch (heads), size 1
  is replicated.
  """
  shape = checks.shape_of(x)
  if name in ("dense", "bias") and len(shape) != 4:
    raise ValueError(
        f"SequenceParallel takes a {name} of the logits' rank, [B|1, N|1, "
        f"T|1, S|1], got shape {shape}: add the missing axes (e.g. "
        f"{name}[None, None] for a [T, S] one).")
  lead = (shape[:-2] if name in ("dense", "bias") else
          shape[:-1] if sequence is not None else shape)
  entries = []
  for i, size in enumerate(lead):
    axis, full = ((batch_axis, b), (head_axis, n), (None, None))[min(i, 2)]
    if size == 1 or axis is None:
      entries.append(None)
    elif size == full:
      entries.append(axis)
    else:
      raise ValueError(
          f"SequenceParallel: the {name}'s shape {shape} does not line up "
          f"with [B, N] = [{b}, {n}] (size-1 axes broadcast).")
  if name in ("dense", "bias"):
    rows = shape[-2]
    entries += [None if rows == 1 else sequence, None]
  elif sequence is not None:
    entries.append(sequence)
  return PartitionSpec(*entries)
