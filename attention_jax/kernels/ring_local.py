"""Ring attention's mask in one device's terms, and the work it leaves.

Shape glossary: T this device's query length, S this device's key/value
length, P devices on the ring axis, n chunks a device holds (1 contiguous,
2 zigzag; ``ring_layout``); ``...`` leading dims that broadcast (e.g.
``B, N``).

``aj.ring_attention`` takes a mask written for the whole sequence (``P *
T`` queries, ``P * S`` keys); the ``Ring`` kernel reads it in one
device's terms, like any kernel. ``localize`` (what ``Ring.localize``
runs) restates it once per call: the positions of the device's first
query row and key column (the kernel places a second chunk from the
layout), its lengths (the global ones, checked against the whole
sequence, clipped to its chunks: ``ring_layout.local_length``), a union
bound and a ``BlockMask``'s rule kept, both evaluated at global
positions; without positions in a ``T != S`` call a rule and
``score_mod`` are shifted so that they still see row indices. The dense
mask and the bias are checked as ``[..., T|1, P*S|1]`` (this device's
query rows, every key column in the layout's order) and handed to the
kernel as ``Columns``: each ring step slices the held chunks' columns
from them, so nothing travels.

The ring steps whose held block no device may see (a window that reaches
only a few neighbours) are never made, neither their compute nor their
``ppermute``: ``needed_steps`` works them out from the layout's static
geometry, and ``localize`` gives them to the kernel (``Ring.steps``).
``block_work`` counts the (query block, key block) pairs each device
computes at each step, with the flash core's own walk: under a causal
mask the contiguous layout gives device ``P - 1`` about ``P`` times
device 0's work, zigzag the same to every device.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.core import checks
from attention_jax.core import traced_checks
from attention_jax.kernels import base
from attention_jax.kernels import flash_core
from attention_jax.kernels import ring_layout
from attention_jax.masking import intervals
from attention_jax.masking import mask as mask_lib
from attention_jax.masking.mask import BlockMask
from attention_jax.scores import score_mods


class Columns(NamedTuple):
  """A ring call's dense mask and bias over every key column (``Ring.
  localize`` puts them in the kernel): bool / float ``[..., T|1,
  P*S|1]``, this device's query rows and the global key columns in the
  layout's order; None when absent."""
  mask: jax.Array | None = None
  bias: jax.Array | None = None


def _global_columns(name: str, x, t: int, s: int, size: int,
                    leading: tuple[int, ...]):
  """``x`` checked as ``[..., T|1, P*S|1]`` with the operands' leading
  dims (or size 1); None stays None."""
  if x is None:
    return None
  if name == "bias":
    checks.check_float_array("bias", x)
  else:
    checks.check_mask_dtype("mask", x)
  shape = checks.shape_of(x)
  fits = (len(shape) == len(leading) + 2 and shape[-2] in (1, t)
          and shape[-1] in (1, size * s)
          and all(m in (1, w) for m, w in zip(shape[:-2], leading)))
  if not fits:
    what = "mask's dense field" if name == "mask" else "bias"
    want = ", ".join([*map(str, leading), f"{t}|1", f"{size * s}|1"])
    raise ValueError(
        f"the {what} has shape {shape}, but ring attention (inside "
        f"shard_map) takes this device's query rows and every key column: "
        f"[..., T_local|1, P*S_local|1] = [{want}] (T_local = {t} query rows "
        f"of this device, P*S_local = {size} * {s} = {size * s} key columns "
        f"of the whole sequence, in the layout's order; leading dims those "
        f"of the operands or 1). Pass it with its rows sharded like the "
        f"queries (or size 1) and its columns whole (replicated).")
  return jnp.asarray(x)


class Local(NamedTuple):
  """A whole-sequence call in one device's terms (``localize``)."""
  mask: mask_lib.Mask  # positions, its lengths; no dense field
  score_mod: Any  # seeing row indices where the mask gives no positions
  columns: Columns | None  # the dense mask and the bias; None if neither
  steps: tuple[int, ...] | None  # those the band needs; None: every one


def localize(mask: mask_lib.Mask | None, score_mod: Any, t: int, s: int, *,
             size: int, index, layout: str, leading: tuple[int, ...] = (),
             bias=None) -> Local:
  """What ``Ring.localize`` does (its docstring says what each part
  means), for device ``index`` (traced) of the ``size`` on the ring in
  ``layout``."""
  check_even(layout, t, s, size)
  n = ring_layout.num_chunks(layout)
  big_t, big_s = size * t, size * s
  m = mask_lib.Mask() if mask is None else mask
  if m.positioned:
    q_at, kv_at = m.offsets(big_t, big_s)
    shift = 0
  else:  # bottom-right: rules and modifiers see indices, not positions
    shift = big_s - big_t
    q_at, kv_at = shift, 0
  rule = _global_rule(m.rule, leading, big_t, big_s, size)
  if shift and rule is not None:
    rule = _at_indices_rule(rule, shift)
  if shift and score_mod is not None:
    score_mod = _at_indices_mod(score_mod, shift)
  columns = Columns(
      _global_columns("mask", m.dense, t, s, size, tuple(leading)),
      _global_columns("bias", bias, t, s, size, tuple(leading)))
  lengths = _local_lengths(m, t, s, size, index, layout)
  # the positions of this device's first row and column (the kernel
  # places a second chunk from the layout)
  q_first = ring_layout.chunk_starts(layout, index, size, t // n)[0]
  kv_first = ring_layout.chunk_starts(layout, index, size, s // n)[0]
  local = mask_lib.Mask(
      causal=m.causal, window=m.window, q_segment_ids=m.q_segment_ids,
      kv_segment_ids=m.kv_segment_ids, rule=rule, q_offset=q_at + q_first,
      kv_offset=kv_at + kv_first, **lengths)
  return Local(local, score_mod,
               None if all(x is None for x in columns) else columns,
               _band_steps(m, q_at, kv_at, t, s, size, layout))


def _local_lengths(m: mask_lib.Mask, t: int, s: int, size: int, index,
                   layout: str) -> dict:
  """The mask's global lengths, checked against the whole sequence, as
  this device's (``ring_layout.local_length``)."""
  n = ring_layout.num_chunks(layout)
  lengths = {}
  for name, given, rows, letter in (("q_lengths", m.q_lengths, t, "T"),
                                    ("kv_lengths", m.kv_lengths, s, "S")):
    if given is not None:
      check_global_length(
          f"the mask's {name}", given, size * rows,
          f"the global {letter} = P * {letter}_local = {size} * {rows}: "
          "ring attention's lengths count rows of the whole sequence")
      lengths[name] = ring_layout.local_length(
          layout, jnp.asarray(given), index, size, rows // n)
  return lengths


def check_global_length(name: str, given, total: int, what: str) -> None:
  """Lengths of the whole sequence lie in ``[0, total]``: a ValueError
  when concrete, a ``traced_check`` when traced (outside ``aj.checked`` a
  traced length past the sequence clips to it). ``what`` says where
  ``total`` comes from."""
  short = name.split()[-1]
  fix = (f" ({what}); clip them ({short}=jnp.minimum({short}, {total})) or "
         "give the sequence's true length")
  try:
    np.asarray(given)
  except jax.errors.TracerArrayConversionError:
    traced_checks.traced_check(
        jnp.all((given >= 0) & (given <= total)),
        f"{name} must lie in [0, {total}] ({what}), got {{v}}", v=given)
    return
  checks.check_range(name, given, total, fix)


def check_even(layout: str, t: int, s: int, size: int) -> None:
  """A ValueError unless this device's lengths split into the layout's
  chunks (zigzag: two each)."""
  n = ring_layout.num_chunks(layout)
  if t % n or s % n:
    raise ValueError(
        f"layout='zigzag' holds two chunks of the sequence per device, so "
        f"this device's lengths must be even: T = {t}, S = {s} on {size} "
        f"devices (global {size * t} and {size * s}). Pad the global "
        f"lengths to multiples of 2 * {size} = {2 * size} "
        f"(ring_layout.zigzag_indices refuses others) or use "
        f"layout='contiguous'.")


def _global_rule(rule, leading, big_t: int, big_s: int, size: int):
  """The mask's rule as the kernel evaluates it at global positions: a
  union checked and bound, a ``BlockMask``'s rule (its tables are laid
  out for the global sequence, not this device's blocks)."""
  if isinstance(rule, mask_lib.Union):
    _check_union(rule, leading, big_t, big_s)
    return rule.bound(big_t, big_s)
  if isinstance(rule, BlockMask):
    if rule.shape != (big_t, big_s):
      raise ValueError(
          f"mask is a BlockMask built for [T, S] = {list(rule.shape)}, but "
          f"ring attention indexes rules over the global sequence of all "
          f"{size} devices, T = {big_t}, S = {big_s}: build it with "
          f"block_mask(mask_fn, {big_t}, {big_s}, ...).")
    return rule.mask_fn
  return rule


def _band_steps(m: mask_lib.Mask, q_at, kv_at, t: int, s: int, size: int,
                layout: str) -> tuple[int, ...] | None:
  """The ring steps the mask's band needs for every example's positions
  (None, every step, when the positions are traced)."""
  bounds = intervals.bounds(m.causal, m.window)
  try:
    relative = np.unique(np.asarray(q_at) - np.asarray(kv_at))
  except jax.errors.TracerArrayConversionError:  # traced: every step
    return None
  return tuple(sorted(set().union(*(
      needed_steps(bounds, t, s, size, int(r), layout)
      for r in relative.reshape(-1)))))


def _check_union(union: mask_lib.Union, leading, big_t: int, big_s: int):
  """A union's members as the call would check them, at the global lengths
  (their arrays are read elementwise there, where a misfit would clamp)."""
  for m in union.members():
    if m.dense is not None or m.q_segment_ids is not None:
      raise ValueError(
          "implementation='ring' is not possible: it takes no dense mask or "
          "segment ids inside a union of masks (a union is evaluated on "
          "global indices, where this device's ids and a local dense mask "
          "do not apply); put segment ids in the mask itself, not in a "
          "union.")
  shape = tuple(leading) + (big_t, 1)
  whole = jax.ShapeDtypeStruct(shape, jnp.float32)
  keys = jax.ShapeDtypeStruct(tuple(leading) + (big_s, 1), jnp.float32)
  for m in union.members():
    jax.eval_shape(
        lambda q, k, m=m: (base.attention_operands(q, k, k, m), 0)[1],
        whole, keys)


@dataclasses.dataclass(frozen=True)
class _AtIndices:
  """A rule or score modifier written for row indices, called at positions
  ``shift`` ahead of them (argument ``at`` is the query index)."""
  fn: Callable[..., Any]
  shift: int
  at: int

  def __call__(self, *args):
    args = list(args)
    args[self.at] = args[self.at] - self.shift
    return self.fn(*args)


def _at_indices_rule(rule, shift: int):
  """``rule(b, h, q_idx, kv_idx)`` seeing ``q_idx - shift``."""
  if isinstance(rule, mask_lib.MaskRule):
    return mask_lib.MaskRule(_AtIndices(rule.fn, shift, 2), rule.params,
                             rule.examples)
  return _AtIndices(rule, shift, 2)


def _at_indices_mod(mod, shift: int):
  """``score_mod(score, b, h, q_idx, kv_idx)`` seeing ``q_idx - shift``."""
  if isinstance(mod, score_mods.ScoreMod):
    return score_mods.ScoreMod(_AtIndices(mod.fn, shift, 3), mod.params,
                               mod.blocks)
  return _AtIndices(mod, shift, 3)


def needed_steps(bounds: intervals.Bounds, t: int, s: int, size: int,
                 relative: int, layout: str = "contiguous"
                 ) -> tuple[int, ...]:
  """The ring steps at which some device may see a key of the held block.

  The layout ``Ring.localize`` makes: device ``i`` holds the query chunks
  ``ring_layout.chunk_indices(layout, i, P)`` of ``T / n`` rows each (``n``
  chunks: 1 contiguous, 2 zigzag), chunk ``c`` at positions ``relative +
  c*T/n + r`` (``relative``: the global query position of row 0 less the
  global key position of column 0), and key chunks alike at ``c*S/n +
  col``; at step ``k`` it holds the keys of device ``(i - k) mod P``, and
  a query chunk's rows see the key chunk's columns ``[offset - left,
  offset + T/n - 1 + right]`` (the union of their windows). A step no
  device needs is never made: neither its compute nor its ``ppermute``
  (the next needed step's shift jumps over it). Static: only bounds,
  shapes and the layout decide.
  """
  left, right = bounds
  if left is None and right is None:
    return tuple(range(size))
  n = ring_layout.num_chunks(layout)
  ct, cs = t // n, s // n
  steps = []
  for k in range(size):
    if any(_sees(bounds, relative + qc * ct - kc * cs, ct, cs)
           for i in range(size)
           for qc in ring_layout.chunk_indices(layout, i, size)
           for kc in ring_layout.chunk_indices(layout, (i - k) % size,
                                               size)):
      steps.append(k)
  return tuple(steps) or (0,)


def _sees(bounds: intervals.Bounds, offset: int, ct: int, cs: int) -> bool:
  """Whether ``ct`` query rows at key column ``r + offset`` see any of
  ``cs`` columns through the band ``bounds``."""
  left, right = bounds
  first = float("-inf") if left is None else offset - left
  last = float("inf") if right is None else offset + ct - 1 + right
  return first <= cs - 1 and last >= 0


def block_work(mask: mask_lib.Mask | intervals.Bounds | None, t: int, s: int,
               devices: int, layout: str = "contiguous", block_q: int = 256,
               block_k: int = 512) -> np.ndarray:
  """The work of a ring call: int ``[P, P]``, the (query block, key block)
  pairs device ``d`` computes at ring step ``k`` (row ``k``, column ``d``).

  Worked out with the kernel's own walk (``flash_core.key_ranges``, the
  blocks it visits; the steps ``needed_steps`` makes, other rows 0) for a
  global call of ``T = t`` queries over ``S = s`` keys on ``P = devices``
  in ``layout``, at the flash core's block sizes ``block_q`` x ``block_k``
  (clipped to a chunk, as the kernel clips them). Under a causal mask the
  contiguous layout gives device ``P - 1`` about ``P`` times device 0's
  work; zigzag gives every device the same at every step.

  Args:
    mask: None, an ``aj.Mask`` with only ``causal``, ``window`` and scalar
      concrete positions (``q_offset``/``kv_offset``), or ``Bounds``
      ``(left, right)`` (``intervals.bounds``; bottom-right aligned).
    t, s: the global query and key lengths (multiples of ``devices``, of
      ``2 * devices`` for zigzag).
    devices: ``P``.
    layout: ``"contiguous"`` or ``"zigzag"``.
    block_q, block_k: the flash core's block sizes.

  Returns:
    int64 ``[P, P]`` (steps x devices).

  Raises:
    ValueError: a mask with other fields or traced positions, lengths
      that do not divide, an unknown layout.
  """
  n = ring_layout.num_chunks(layout)
  relative = s - t  # bottom-right: global row r stands at key r + S - T
  if mask is None or isinstance(mask, mask_lib.Mask):
    m = mask_lib.Mask() if mask is None else mask
    other = sorted(name for name, x in vars(m).items()
                   if x is not None and x is not False
                   and name not in ("causal", "window", "q_offset",
                                    "kv_offset"))
    if other:
      raise ValueError(f"block_work counts a band's blocks (causal, window, "
                       f"positions); the mask also sets {other}.")
    bounds = intervals.bounds(m.causal, m.window)
    if m.positioned:
      try:
        q_at, kv_at = (int(np.asarray(x)) for x in m.offsets(t, s))
      except (TypeError, jax.errors.TracerArrayConversionError):
        raise ValueError("block_work needs scalar concrete positions "
                         "(q_offset, kv_offset).") from None
      relative = q_at - kv_at
  else:
    bounds = intervals.Bounds(*mask)
  for name, length in (("t", t), ("s", s)):
    if length % (n * devices):
      raise ValueError(f"{name}={length} is not a multiple of "
                       f"{n * devices} (devices={devices}, layout="
                       f"{layout!r}: {n} chunk(s) a device).")
  ct, cs = t // (n * devices), s // (n * devices)
  st = flash_core.static(ct, cs, scale=1.0, is_causal=False,
                         block_q=block_q, block_k=block_k)._replace(
                             bounds=bounds)
  num_q, num_k = -(-ct // st.bq), -(-cs // st.bk)
  work = np.zeros((devices, devices), np.int64)
  where, offsets = [], []
  for k in needed_steps(bounds, t // devices, s // devices, devices,
                        relative, layout):
    for d in range(devices):
      for qc in ring_layout.chunk_indices(layout, d, devices):
        for kc in ring_layout.chunk_indices(layout, (d - k) % devices,
                                            devices):
          where.append((k, d))
          offsets.append(relative + qc * ct - kc * cs)
  if not flash_core.patterned(st, base.Head()):  # every block
    counts = np.full(len(offsets), num_q * num_k)
  else:  # the walk's key ranges, for every pair and query block at once
    lo, hi, _, _ = flash_core.key_ranges(
        st, base.Head(), flash_core.Place(np.array(offsets)[:, None]),
        None, np.arange(num_q)[None, :], num_k)
    counts = np.asarray(hi - lo).sum(-1)
  for (k, d), count in zip(where, counts):
    work[k, d] += count
  return work
