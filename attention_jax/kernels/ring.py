"""Ring attention: the sequence split across the devices of a mesh axis.

Shape glossary: T this device's query length, S this device's key/value
length, H head dim, Hv value head dim, P devices on the ring axis, n chunks
a device holds (1 contiguous, 2 zigzag), Tp/Sp a chunk's length padded to
whole blocks; ``...`` leading dims that broadcast (e.g. ``B, N``; size-1
dims for shared KV heads).

Call inside ``jax.shard_map`` with the sequence dimension split over
``axis_name`` (Liu et al. 2023, "Ring Attention with Blockwise
Transformers"). Each device keeps its queries and passes its key/value
block to the next device ``P - 1`` times (``lax.ppermute``), folding each
block into the result with the online softmax of the flash core
``flash_core`` (per block: ``out_j``, ``lse_j``; merged by log-sum-exp).
Within a block the work is blockwise too, so no device ever holds more
than ``[block_q, block_k]`` scores per head.

The kernel reads the call's mask in this device's terms, like any kernel:
its positions (``q_offset``, ``kv_offset``) say where this device's first
query row and key column stand in the global sequence, its lengths and
segment ids count this device's rows and columns. ``Ring.localize``
(``ring_local``) turns a mask written for the whole sequence (what
``aj.ring_attention`` takes) into this device's, once, with the dense
mask and bias over every key column (``Columns``) and the ring steps the
band needs (``needed_steps``: the others are never made).

Layouts (``ring_layout``): ``"contiguous"``, device ``i`` holds query rows
``[i*T, (i+1)*T)`` and key/value rows ``[i*S, (i+1)*S)``; ``"zigzag"``, the
global sequence is cut into ``2P`` chunks and device ``i`` holds chunks
``i`` and ``2P - 1 - i`` (``T / 2`` and ``S / 2`` rows each), so that under
a causal mask every device does the same work at every step (contiguous:
device ``P - 1`` does ``P`` times device 0's; ``block_work`` counts it).
Each chunk is padded to whole blocks on its own (``_single_head``).

Here: the kernel (``Ring``: its checks, what it supports, one head's call);
``ring_passes``: the passes round the ring (forward; the tangent, forward
mode, transposed into the backward, reverse mode); ``ring_local``:
``localize``, ``Columns``, ``needed_steps``, ``block_work`` (the last
three reached here too).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from attention_jax.core import checks
from attention_jax.kernels import base
from attention_jax.kernels import flash_core
from attention_jax.kernels import ring_layout
from attention_jax.kernels import ring_local
from attention_jax.kernels import ring_passes
from attention_jax.masking import mask as mask_lib
from attention_jax.masking.mask import BlockMask

# What callers reach as ring.Columns, ring.needed_steps and ring.block_work.
Columns = ring_local.Columns
needed_steps = ring_local.needed_steps
block_work = ring_local.block_work

# What a ring call cannot place without positions: every feature that
# compares or reads where rows and keys stand, and lengths, which would
# otherwise be read as this device's (a global length would clip).
_PLACED = frozenset({"causal", "window", "rule", "score_mod", "q_lengths",
                     "kv_lengths"})


@dataclasses.dataclass(frozen=True)
class Ring(base.Kernel):
  """The flash kernel across the devices of ``axis_name`` (see the module
  docstring); call inside ``jax.shard_map``, with the mask in this
  device's terms (``localize``; ``aj.ring_attention`` does both).

  ``steps``: the ring steps to make (at step ``k`` device ``i`` holds the
  keys of device ``(i - k) mod P``), as ``localize`` works them out for
  its layout; the keys of the others must be invisible to every device.
  None makes every step.

  ``layout``: how the sequence lies over the devices
  (``ring_layout``): ``"contiguous"`` (device ``i`` holds rows ``[i*T,
  (i+1)*T)``) or ``"zigzag"`` (device ``i`` holds chunks ``i`` and ``2P -
  1 - i`` of ``2P``: the same causal work on every device).

  ``columns``: the call's dense mask and bias over every key column
  (``Columns``), put here by ``localize`` (the dispatcher checks a mask
  against this device's keys, not the whole sequence's); not compared,
  hashed or printed.
  """
  axis_name: str
  block_q: int | None = None
  block_k: int | None = None
  steps: tuple[int, ...] | None = None
  layout: str = "contiguous"
  columns: Columns | None = dataclasses.field(default=None, compare=False,
                                              repr=False)
  name = "ring"
  float64 = False  # float32 compute
  implements = frozenset({"causal", "window", "q_lengths", "kv_lengths",
                          "q_segment_ids", "kv_segment_ids", "rule",
                          "q_offset", "kv_offset", "score_mod", "sinks",
                          "return_lse", "return_max_logits"})

  def __post_init__(self):
    if not isinstance(self.axis_name, str):
      raise TypeError(f"Ring's axis_name must be a mesh axis name (str), got "
                      f"{self.axis_name!r}.")
    base.check_block_size("block_q", self.block_q)
    base.check_block_size("block_k", self.block_k)
    if self.steps is not None and (
        not isinstance(self.steps, tuple) or not self.steps
        or any(type(k) is not int or k < 0 for k in self.steps)
        or list(self.steps) != sorted(set(self.steps))):
      raise ValueError(f"Ring's steps must be a non-empty increasing tuple "
                       f"of ring steps (ints >= 0), got {self.steps!r}; "
                       "None makes every step.")
    if not isinstance(self.layout, str) or (
        self.layout not in ring_layout.LAYOUTS):
      raise ValueError(f"Ring's layout must be one of "
                       f"{ring_layout.LAYOUTS}, got {self.layout!r}.")
    if self.columns is not None and not isinstance(self.columns, Columns):
      raise TypeError(f"Ring's columns must be a ring.Columns (what "
                      f"localize puts there), got {type(self.columns)}.")

  def size(self) -> int:
    """``P``, the devices on the ring axis (a ValueError outside it)."""
    try:
      return jax.lax.axis_size(self.axis_name)
    except NameError as e:
      raise ValueError(
          f"axis_name={self.axis_name!r} is not bound: call ring_attention "
          "inside jax.shard_map over a mesh with that axis (the sequence "
          f"dimension sharded over it). ({e})") from None

  def localize(self, mask: mask_lib.Mask | None, score_mod: Any, t: int,
               s: int, leading: tuple[int, ...] = (), bias=None):
    """A mask and score modifier written for the whole sequence, in this
    device's terms; ``(mask, score_mod, kernel)`` (``ring_local.localize``).

    The global call has ``P * T`` queries and ``P * S`` keys; this device
    holds query rows ``[i*T, (i+1)*T)`` and key rows ``[i*S, (i+1)*S)``
    (contiguous), or the global chunks ``i`` and ``2P - 1 - i`` of ``T / 2``
    and ``S / 2`` rows (zigzag, ``ring_layout``). Its mask gets the position
    of its first row and column (the global mask's, or the bottom-right
    alignment's; the kernel places its second chunk from the layout), its
    lengths (the global ones, refused beyond the whole sequence when
    concrete and under ``aj.checked`` when traced, clipped to its chunks: a
    prefix of its rows, ``ring_layout.local_length``); segment ids are
    already this device's; a union is bound and a ``BlockMask``'s rule kept
    (its tables are laid out for the global sequence), each evaluated at
    global positions; without positions in a ``T != S`` call, where rows
    stand ``P * (S - T)`` ahead of their indices, the rule and ``score_mod``
    still see the indices. The mask's dense field and ``bias`` (``[..., T|1,
    P*S|1]``: this device's rows, every key column in the layout's order)
    are checked and moved into the kernel (``Columns``); the returned mask
    has no dense field and the call passes no bias. The kernel comes back
    with the steps the global band needs (every step when the positions are
    traced). ``leading`` are the operands' leading dims (a union's members
    are checked at the global lengths against them; a dense mask's and a
    bias's leading dims are theirs or 1).
    """
    local = ring_local.localize(
        mask, score_mod, t, s, size=self.size(),
        index=jax.lax.axis_index(self.axis_name), layout=self.layout,
        leading=leading, bias=bias)
    kernel = dataclasses.replace(self, columns=local.columns,
                                 steps=local.steps)
    return local.mask, local.score_mod, kernel

  def supports(self, problem: base.Problem) -> str | None:
    ops = problem.ops
    t, s = ops.query.shape[-2], ops.key.shape[-2]
    for name, x in (("dense mask", ops.dense), ("bias", ops.bias)):
      if x is not None:
        return (f"it takes a {name} only over every key column of the "
                f"sequence ([..., T|1, P*S|1]), which the call's checks "
                f"against this device's S = {s} keys cannot pass (got "
                f"shape {tuple(x.shape)}): give it to aj.ring_attention "
                "(mask=aj.Mask(dense=...), bias=) or to Ring.localize(mask, "
                "score_mod, T, S, bias=...), which put it in the kernel")
    unplaced = sorted(problem.features & _PLACED)
    if unplaced and not ops.positioned:
      return (f"it needs this device's positions in the mask (q_offset/"
              f"kv_offset: where its query rows and key columns stand in "
              f"the whole sequence) for {', '.join(unplaced)}: call "
              "aj.ring_attention with the mask of the whole sequence, or "
              "Ring.localize(mask, score_mod, T, S) inside shard_map")
    size = self.size()
    if self.steps is not None and self.steps[-1] >= size:
      return (f"its steps {self.steps} run past the ring's "
              f"{size} devices")
    n = ring_layout.num_chunks(self.layout)
    if t % n or s % n:
      return (f"layout='zigzag' needs even lengths on each device, got T = "
              f"{t}, S = {s}")
    for name, x in zip(("dense mask", "bias"), self.columns or ()):
      if x is not None and (x.shape[-2] not in (1, t)
                            or x.shape[-1] not in (1, size * s)):
        return (f"its {name} has shape {tuple(x.shape)}, built for other "
                f"lengths than this call's T = {t}, P*S = {size * s}: "
                "localize it for this call")
    return base.no_weights_or_dropout(problem)

  def __call__(self, problem: base.Problem):
    ops = problem.ops
    size = self.size()
    rule = ops.rule
    if rule is not None:
      # A rule is evaluated at positions in every block a device visits
      # (no tables: the held block changes every step).
      t, s = ops.query.shape[-2], ops.key.shape[-2]
      ops = ops._replace(rule=BlockMask(
          rule.mask_fn, t, s, t, s, None, None, None, None, None))
    if self.columns is not None:  # split by head groups as the call's are
      mask, bias = self.columns
      ops = ops._replace(
          dense=None if mask is None else base.split_groups(
              checks.as_bool_mask(mask), ops.groups, -3),
          bias=base.split_groups(bias, ops.groups, -3))
    block_q, block_k = flash_core.block_sizes(ops, self.block_q,
                                              self.block_k)
    head = functools.partial(
        _single_head, axis_name=self.axis_name, size=size, steps=self.steps,
        layout=self.layout, scale=problem.scale, is_causal=ops.causal,
        window=ops.window, score_mod=ops.score_mod, block_q=block_q,
        block_k=block_k, max_logits=problem.return_max_logits,
        out_dtype=problem.out_dtype)
    # Whether any device holds a NaN or inf (keys travel): one scalar
    # all-reduce, so that a clean call's walks skip looking for the rows
    # that see one (base.Head.garbage).
    garbage = jax.lax.pmax(checks.any_nonfinite(
        ops.query, ops.key, ops.value).astype(jnp.int32), self.axis_name) > 0
    return base.lift_heads(head, ops, (garbage,), (0,))


def _pad_chunks(x, axis: int, chunks: int, size: int, padded: int, value,
                edge: bool = False):
  """``x``'s ``axis`` of ``chunks * size`` as ``chunks * padded``: each
  chunk padded at its end (``value``, or its last entry with ``edge``);
  a size-1 (broadcast) axis stays."""
  if x is None or x.shape[axis] == 1 or padded == size:
    return x
  axis %= x.ndim
  y = x.reshape(x.shape[:axis] + (chunks, size) + x.shape[axis + 1:])
  pad = [(0, 0)] * y.ndim
  pad[axis + 1] = (0, padded - size)
  y = jnp.pad(y, pad, mode="edge") if edge else jnp.pad(
      y, pad, constant_values=value)
  return y.reshape(x.shape[:axis] + (chunks * padded,) + x.shape[axis + 1:])


def _strip_chunks(x, chunks: int, size: int, padded: int):
  """The inverse of ``_pad_chunks`` on axis 0 (results' rows)."""
  if x is None or padded == size:
    return x
  y = x.reshape((chunks, padded) + x.shape[1:])[:, :size]
  return y.reshape((chunks * size,) + x.shape[1:])


def _single_head(q, k, v, h, garbage, *, axis_name, size, steps, layout,
                 out_dtype, **blocks):
  """One head's ring call: its chunks padded to whole blocks, the passes
  round the ring (``ring_passes``), then sinks and poison."""
  n = ring_layout.num_chunks(layout)
  st = flash_core.static(q.shape[0] // n, k.shape[0] // n, **blocks)
  rg = ring_passes.Static(st, axis_name, size, steps or tuple(range(size)),
                          layout)
  tp, sp = rg.padded
  # Each chunk padded to whole blocks on its own (a chunk is a flash
  # core's operand); a dense mask's and a bias's columns are the call's
  # P * n key chunks.
  q = _pad_chunks(q, 0, n, st.t, tp, 0)
  k, v = (_pad_chunks(x, 0, n, st.s, sp, 0) for x in (k, v))
  mask, bias = h.dense, h.bias
  if mask is not None:
    mask = _pad_chunks(_pad_chunks(mask, 0, n, st.t, tp, False), 1,
                       size * n, st.s, sp, False)
  if bias is not None:
    bias = _pad_chunks(_pad_chunks(bias, 0, n, st.t, tp, 0.0), 1, size * n,
                       st.s, sp, 0.0)
  ex = h._replace(
      dense=mask, bias=bias, garbage=garbage,
      q_segment_ids=_pad_chunks(h.q_segment_ids, 0, n, st.t, tp, 0, edge=True),
      kv_segment_ids=_pad_chunks(h.kv_segment_ids, 0, n, st.s, sp, 0, edge=True),
      rule=None if h.rule is None else jax.tree.map(
          jnp.asarray, h.rule))
  st, ex = flash_core.hoist_score_mod(st, ex, q, replay_closures=False)
  rg = rg._replace(block=st)
  out, lse, max_logits, code = ring_passes.attend(
      rg, q, k, v, ex, ring_passes.gather(rg, ex))
  out, lse, code, max_logits = (_strip_chunks(x, n, st.t, tp)
                                for x in (out, lse, code, max_logits))
  if h.sink is not None:
    out, _, lse = checks.with_sink(out, lse, h.sink, h.q_lengths)
  # NaN or inf reaches only the rows that may see it (flash_core's blocks
  # are made finite as they are loaded; each step's codes merge by max):
  # poisoned after the custom VJP, those rows pass no cotangent back.
  out, lse, max_logits = checks.poison(code, out.astype(out_dtype), lse,
                                         max_logits)
  if st.max_logits:
    return out, None, lse, max_logits
  return out, None, lse
