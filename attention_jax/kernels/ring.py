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
segment ids count this device's rows and columns. A key block travels
with its segment ids; every device's key position and length are
gathered once per call (``_Blocks``), so each step places the block it
holds at its owner's positions (``flash_core.Place``). ``Ring.localize``
turns a mask written for the whole sequence (what ``aj.ring_attention``
takes) into this device's, once.

Layouts (``ring_layout``): ``"contiguous"``, device ``i`` holds query rows
``[i*T, (i+1)*T)`` and key/value rows ``[i*S, (i+1)*S)``; ``"zigzag"``, the
global sequence is cut into ``2P`` chunks and device ``i`` holds chunks
``i`` and ``2P - 1 - i`` (``T / 2`` and ``S / 2`` rows each), so that under
a causal mask every device does the same work at every step (contiguous:
device ``P - 1`` does ``P`` times device 0's; ``block_work`` counts it).
One path serves both: a device holds ``n`` chunks (1 or 2), and each step
runs the flash core on every (query chunk, held key chunk) pair at their
global positions (a loop over the ``n * n`` pairs, so one walk is
compiled), merging by log-sum-exp per query chunk; a pair wholly in a
query chunk's future has empty key ranges and costs no block. Each chunk
is padded to whole blocks on its own.

A dense mask and a bias (``Columns``, put in the kernel by ``localize``)
hold this device's query rows and every key column, ``[..., T|1,
P*S|1]`` in the layout's order: each step slices the held chunks' columns
(by their owner and place); nothing travels. The bias's gradient is the
sum of the steps' windows, scattered into its columns (and summed over
the devices where its rows are replicated).

The ring steps whose held block no device may see (a window that reaches
only a few neighbours) are never made, neither their compute nor their
``ppermute``: ``needed_steps`` works them out from that layout's static
geometry, and ``localize`` gives the kernel those steps (``Ring.steps``);
a kernel built without them makes every step.

The ring is a ``jax.custom_jvp`` whose tangent is a ``core/linear_map.py``
map: forward mode goes round the ring with the key and value tangents
travelling beside their blocks (``flash_core.tangent`` per pair, against
the global ``out`` and ``lse``); reverse mode transposes it into the
backward pass, which goes round the ring again:
key/value blocks travel with their gradient accumulators, each device adds
its queries' share (``flash_core.backward`` with the global ``lse``, pair
by pair), and one last shift brings every accumulator home. Saved per
device: its own q, k, v, output and ``lse`` — O(T + S), independent of P.

With ``return_max_logits`` each step's raw row maxima (``flash_core.forward``)
are combined by ``max`` over the steps, which between them hold every
device's keys; no gradient flows through them.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.core import broadcast
from attention_jax.core import checks
from attention_jax.core import grouping
from attention_jax.core import linear_map
from attention_jax.core import merge as merge_lib
from attention_jax.core import numerics
from attention_jax.kernels import base
from attention_jax.kernels import flash_core
from attention_jax.kernels import ring_layout
from attention_jax.masking import intervals
from attention_jax.masking import mask as mask_lib
from attention_jax.masking.mask import BlockMask
from attention_jax.scores import score_mods


class _Ring(NamedTuple):
  block: flash_core.Static  # one chunk's true lengths and block sizes
  axis_name: str
  size: int  # P
  steps: tuple[int, ...]  # the ring steps made (the others' blocks unseen)
  layout: str  # ring_layout.LAYOUTS

  @property
  def chunks(self) -> int:
    """Chunks per device (n): 1 contiguous, 2 zigzag."""
    return ring_layout.num_chunks(self.layout)

  @property
  def padded(self) -> tuple[int, int]:
    """A query chunk's and a key chunk's length padded to whole blocks."""
    st = self.block
    return -(-st.t // st.bq) * st.bq, -(-st.s // st.bk) * st.bk


def _shift(x, rg: _Ring, by: int = 1):
  """Sends ``x`` ``by`` steps round the ring: device ``i`` -> ``i + by``."""
  if x is None or by % rg.size == 0:
    return x
  perm = [(i, (i + by) % rg.size) for i in range(rg.size)]
  return jax.lax.ppermute(x, rg.axis_name, perm)


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
  if not flash_core.patterned(st, broadcast.Head()):  # every block
    counts = np.full(len(offsets), num_q * num_k)
  else:  # the walk's key ranges, for every pair and query block at once
    lo, hi, _, _ = flash_core.key_ranges(
        st, broadcast.Head(), flash_core.Place(np.array(offsets)[:, None]),
        None, np.arange(num_q)[None, :], num_k)
    counts = np.asarray(hi - lo).sum(-1)
  for (k, d), count in zip(where, counts):
    work[k, d] += count
  return work


class _Held(NamedTuple):
  """A key block and its segment ids, which travel round the ring."""
  k: jax.Array
  v: jax.Array
  kv_segment_ids: jax.Array | None  # int32 [n * Csp]


class _Blocks(NamedTuple):
  """Every device's key-block length and position (int32 ``[P]`` each, or
  None), gathered once per call: a held block's are indexed by whose it
  is, not sent round with it at every step."""
  kv_lengths: jax.Array | None
  kv_offset: jax.Array | None


def _gather(rg: _Ring, ex: broadcast.Head) -> _Blocks:
  return _Blocks(*(None if x is None else jax.lax.all_gather(x, rg.axis_name)
                   for x in (ex.kv_lengths, ex.kv_offset)))


def _travel(rg: _Ring, held: _Held, by: int = 1) -> _Held:
  return _Held(*(_shift(x, rg, by) for x in held))


def _window(x, r0, c0, rows: int, cols: int):
  """The ``[rows, cols]`` window of a ``[R|1, C|1]`` operand at ``(r0,
  c0)``; size-1 axes kept (they broadcast)."""
  if x is None:
    return None
  n_rows, n_cols = x.shape
  return jax.lax.dynamic_slice(
      x, (r0 if n_rows != 1 else 0, c0 if n_cols != 1 else 0),
      (rows if n_rows != 1 else 1, cols if n_cols != 1 else 1))


def _add_window(acc, tile, r0, c0):
  """``acc [R|1, C|1]`` with ``tile`` (a ``_window`` of it) added at its
  place: a chunk pair's bias gradient into the call's."""
  at = (r0 if acc.shape[0] != 1 else 0, c0 if acc.shape[1] != 1 else 0)
  return jax.lax.dynamic_update_slice(
      acc, jax.lax.dynamic_slice(acc, at, tile.shape) + tile, at)


def _chunk(x, c, size: int):
  """Chunk ``c`` (``size`` rows; ``c`` may be traced) of a ``[n * size,
  ...]`` array."""
  return None if x is None else jax.lax.dynamic_slice_in_dim(
      x, c * size, size)


def _add_chunk(acc, c, size: int, part):
  """``acc [n * size, ...]`` with ``part`` added to chunk ``c``."""
  return jax.lax.dynamic_update_slice_in_dim(
      acc, _chunk(acc, c, size) + part, c * size, 0)


def _chunk_length(length, c, chunk: int):
  """Chunk ``c``'s valid rows of a device's length (a prefix of its rows,
  ``ring_layout.local_length``)."""
  return None if length is None else jnp.clip(length - c * chunk, 0, chunk)


class _Pair(NamedTuple):
  """One query chunk of this device against one key chunk it holds."""
  a: jax.Array  # int32: the query chunk (local)
  b: jax.Array  # int32: the key chunk (local, of the held block)
  ex: broadcast.Head  # the pair's operands: lengths, ids, mask, bias
  place: flash_core.Place
  column: jax.Array  # int32: the key chunk's first padded column


def _pair(rg: _Ring, ex: broadcast.Head, blocks: _Blocks, held: _Held,
          step, p) -> _Pair:
  """Chunk pair ``p`` (of ``n * n``) at ``step``: query chunk ``p // n``
  of this device meets key chunk ``p % n`` of device ``(i - step) mod P``
  at their global positions; a dense mask and a bias give the pair its
  window of columns (by the key chunk's owner and place: nothing
  travels)."""
  me = jax.lax.axis_index(rg.axis_name)
  src = (me - step) % rg.size
  n, (tp, sp) = rg.chunks, rg.padded
  ct, cs = rg.block.t, rg.block.s
  a, b = p // n, p % n
  length, offset = (None if x is None else x[src] for x in blocks)
  column = (src * n + b) * sp  # of the [P * n * Csp] columns, layout order
  ex_ab = ex._replace(
      dense=_window(ex.dense, a * tp, column, tp, sp),
      bias=_window(ex.bias, a * tp, column, tp, sp),
      q_lengths=_chunk_length(ex.q_lengths, a, ct),
      q_segment_ids=_chunk(ex.q_segment_ids, a, tp),
      kv_segment_ids=_chunk(held.kv_segment_ids, b, sp),
      kv_lengths=_chunk_length(length, b, cs), kv_offset=offset)
  if ex.q_offset is None:  # nothing placed: no causality, window or rule
    return _Pair(a, b, ex_ab, flash_core.Place(0), column)
  # a chunk stands (its global index - the device's first) chunks further
  q_chunks = jnp.stack(ring_layout.chunk_indices(rg.layout, me, rg.size))
  k_chunks = jnp.stack(ring_layout.chunk_indices(rg.layout, src, rg.size))
  q_at = ex.q_offset + (q_chunks[a] - q_chunks[0]) * ct
  kv_at = offset + (k_chunks[b] - k_chunks[0]) * cs
  return _Pair(a, b, ex_ab, flash_core.Place(q_at - kv_at, q_at, kv_at),
               column)


def _merge(acc, part):
  """Two partial ``(out, lse, max_logits or None, code)`` combined: outputs
  by their log-sum-exps, row maxima and codes by max."""
  out, lse = merge_lib.merge_attentions([acc[0], part[0]], [acc[1], part[1]])
  max_logits = acc[2] if acc[2] is None else jnp.maximum(acc[2], part[2])
  return out, lse, max_logits, jnp.maximum(acc[3], part[3])


def _fold(rg: _Ring, q, ex, blocks, held, step, result):
  """``result`` (the rows' partial attention so far) merged with the held
  block's, pair by pair: each query chunk over each key chunk with the
  flash core (a pair wholly in the future has empty key ranges: no block
  is computed). A loop over the pairs, so that one flash walk is
  compiled, not ``n * n``."""
  tp, sp = rg.padded

  def pair(p, result):
    pr = _pair(rg, ex, blocks, held, step, p)
    part = flash_core.forward(
        rg.block, _chunk(q, pr.a, tp), _chunk(held.k, pr.b, sp),
        _chunk(held.v, pr.b, sp), pr.ex, pr.place)
    rows = _merge([_chunk(x, pr.a, tp) for x in result], part)
    return tuple(None if x is None else jax.lax.dynamic_update_slice_in_dim(
        x, r, pr.a * tp, 0) for x, r in zip(result, rows))

  return jax.lax.fori_loop(0, rg.chunks ** 2, pair, tuple(result))


def _ring_forward(rg: _Ring, q, k, v, ex, blocks):
  """Float32 ``(out [n*Tp, Hv], lse [n*Tp], max_logits [n*Tp] or None,
  code [n*Tp])`` over the whole ring (``max_logits`` with
  ``rg.block.max_logits``; ``code`` each row's largest ``numerics`` code
  over the steps: which rows saw a NaN or inf)."""
  rows = q.shape[0]
  zero = _varying_zero(q, k, v, ex, blocks)
  none = jnp.full((rows,), -jnp.inf, jnp.float32) + zero  # nothing seen
  result = (jnp.zeros((rows, v.shape[-1]), jnp.float32) + zero, none,
            none if rg.block.max_logits else None,
            jnp.zeros((rows,), jnp.float32) + zero)
  held = _Held(k, v, ex.kv_segment_ids)
  if rg.steps == tuple(range(rg.size)):  # every step: one shift each
    def step_fn(step, carry):
      result, held = carry
      held = _travel(rg, held)
      return _fold(rg, q, ex, blocks, held, step, result), held

    result, _ = jax.lax.fori_loop(
        1, rg.size, step_fn,
        (_fold(rg, q, ex, blocks, held, 0, result), held))
    return result
  # A window: only the steps that hold visible keys, unrolled.
  at = 0
  for step in rg.steps:
    held, at = _travel(rg, held, step - at), step
    result = _fold(rg, q, ex, blocks, held, step, result)
  return result


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _ring(rg: _Ring, q, k, v, ex, blocks):
  out, lse, max_logits, code = _ring_forward(rg, q, k, v, ex, blocks)
  return out.astype(v.dtype), lse, max_logits, code


@_ring.defjvp
def _ring_jvp(rg, primals, tangents):
  """Both modes of AD (``core/linear_map.py``, as the flash core's):
  forward mode runs ``_ring_tangent`` round the ring, reverse mode
  transposes it into ``_ring_bwd``."""
  q, k, v, ex, blocks = primals
  dq, dk, dv, d_ex, _ = tangents
  out, lse, max_logits, code = _ring_forward(rg, q, k, v, ex, blocks)
  residuals = (q, k, v, ex, blocks, out, lse)
  linear = (dq, dk, dv, None if ex.bias is None else d_ex.bias,
            flash_core.const_tangents(ex.mod_consts, d_ex.mod_consts))
  d_out, d_lse = linear_map.linear_map(
      functools.partial(_ring_tangent, rg),
      functools.partial(_ring_transpose, rg), residuals, linear)
  zeros = lambda x: None if x is None else jnp.zeros_like(x)  # noqa: E731
  return ((out.astype(v.dtype), lse, max_logits, code),
          (d_out.astype(v.dtype), d_lse, zeros(max_logits), zeros(code)))


def _ring_transpose(rg, residuals, cotangents):
  """``_ring_bwd``'s cotangents in the structure of the linear inputs."""
  ex = residuals[3]
  dq, dk, dv, d_ex, _ = _ring_bwd(rg, residuals, cotangents)
  return (dq, dk, dv, d_ex.bias,
          flash_core.const_cotangents(ex.mod_consts, d_ex.mod_consts))


def _ring_tangent(rg, residuals, linear):
  """Forward-mode AD round the ring: float32 ``(d_out [n*Tp, Hv], d_lse
  [n*Tp])``. Each pair's ``flash_core.tangent`` against the global
  ``out`` and ``lse`` is its share (the tangent is linear in the key
  blocks: ``sum (acc - m * out) = sum acc - (sum m) * out``); the key
  and value tangents travel with their blocks, the bias's tangent is
  windowed like the bias."""
  q, k, v, ex, blocks, out, lse = residuals
  dq, dk, dv, dbias, dargs = linear
  tp, sp = rg.padded
  zero = _varying_zero(q, k, v, ex, blocks, out, linear)
  rows = out.shape[0]
  acc = (jnp.zeros((rows, out.shape[-1]), jnp.float32) + zero,
         jnp.zeros((rows,), jnp.float32) + zero)
  zeros_like_k = lambda x: jnp.zeros(x.shape, x.dtype) + zero.astype(  # noqa: E731
      x.dtype)
  # The key and value tangents travel beside the blocks (zeros if none).
  held_t = _Held(zeros_like_k(k) if dk is None else dk,
                 zeros_like_k(v) if dv is None else dv, None)

  def fold(step, held, held_t, acc):
    def pair(p, acc):
      d_out, m = acc
      pr = _pair(rg, ex, blocks, held, step, p)
      chunk = functools.partial(_chunk, c=pr.a, size=tp)
      # the bias's tangent windowed as the pair windows the bias
      tangent_bias = _window(dbias, pr.a * tp, pr.column, tp, sp)
      part, m_part = flash_core.tangent(
          rg.block, (chunk(q), _chunk(held.k, pr.b, sp),
                     _chunk(held.v, pr.b, sp), pr.ex, pr.place, None,
                     chunk(out), chunk(lse)),
          (None if dq is None else chunk(dq), _chunk(held_t.k, pr.b, sp),
           _chunk(held_t.v, pr.b, sp), tangent_bias, dargs))
      return (_add_chunk(d_out, pr.a, tp, part.astype(jnp.float32)),
              _add_chunk(m, pr.a, tp, m_part))

    return jax.lax.fori_loop(0, rg.chunks ** 2, pair, acc)

  held = _Held(k, v, ex.kv_segment_ids)
  if rg.steps == tuple(range(rg.size)):
    def step_fn(step, carry):
      held, held_t, acc = carry
      held, held_t = _travel(rg, held), _travel(rg, held_t)
      return held, held_t, fold(step, held, held_t, acc)

    _, _, acc = jax.lax.fori_loop(
        1, rg.size, step_fn, (held, held_t, fold(0, held, held_t, acc)))
  else:  # the window's steps only, unrolled, as in the forward pass
    at = 0
    for step in rg.steps:
      held = _travel(rg, held, step - at)
      held_t = _travel(rg, held_t, step - at)
      at = step
      acc = fold(step, held, held_t, acc)
  return acc


def _ring_bwd(rg, residuals, cotangents):
  q, k, v, ex, blocks, out, lse = residuals
  # max_logits and the codes have no gradient: dropped
  d_out, d_lse = cotangents[:2]
  f32 = jnp.float32
  tp, sp = rg.padded

  def grads(step, held, acc):
    """The accumulators ``(dq, dk, dv, dbias, dargs)`` with the held
    block's share added, pair by pair (as in ``_fold``): dq per query
    chunk, dk and dv (the held block's, travelling with it) per key
    chunk, the bias's window of each pair into dbias."""
    def pair(p, acc):
      dq, dk, dv, dbias, dargs = acc
      pr = _pair(rg, ex, blocks, held, step, p)
      rows = functools.partial(_chunk, c=pr.a, size=tp)
      dq_j, dk_j, dv_j, dbias_j, dargs_j = flash_core.backward(
          rg.block, (rows(q), _chunk(held.k, pr.b, sp),
                     _chunk(held.v, pr.b, sp), pr.ex, pr.place, rows(out),
                     rows(lse)), (rows(d_out), rows(d_lse)))
      dq = _add_chunk(dq, pr.a, tp, dq_j)
      dk, dv = _add_chunk(dk, pr.b, sp, dk_j), _add_chunk(dv, pr.b, sp, dv_j)
      if dbias is not None:
        dbias = _add_window(dbias, dbias_j, pr.a * tp, pr.column)
      return dq, dk, dv, dbias, tuple(x + y for x, y in zip(dargs, dargs_j))

    return jax.lax.fori_loop(0, rg.chunks ** 2, pair, acc)

  zero = _varying_zero(q, k, v, ex, blocks, out, d_out)
  zeros = lambda x: jnp.zeros(x.shape, f32) + zero  # noqa: E731
  acc = (zeros(q), zeros(k), zeros(v),
         None if ex.bias is None else zeros(ex.bias),
         tuple(map(zeros, ex.mod_consts)))
  held = _Held(k, v, ex.kv_segment_ids)
  if rg.steps == tuple(range(rg.size)):
    def step_fn(step, carry):
      held, (dq, dk, dv, dbias, dargs) = carry
      held, dk, dv = _travel(rg, held), _shift(dk, rg), _shift(dv, rg)
      return held, grads(step, held, (dq, dk, dv, dbias, dargs))

    _, acc = jax.lax.fori_loop(1, rg.size, step_fn,
                               (held, grads(0, held, acc)))
    at = rg.size - 1
  else:  # the window's steps only, unrolled, as in the forward pass
    at = 0
    for step in rg.steps:
      held = _travel(rg, held, step - at)
      if step != rg.steps[0]:  # (before the first, dk and dv are zeros)
        acc = (acc[0], _shift(acc[1], rg, step - at),
               _shift(acc[2], rg, step - at), *acc[3:])
      at = step
      acc = grads(step, held, acc)
  dq, dk, dv, dbias, dargs = acc
  # each block's gradient goes home
  dk, dv = _shift(dk, rg, rg.size - at), _shift(dv, rg, rg.size - at)
  # What is replicated over the ring (score_mod's arrays; a bias whose
  # rows are shared, e.g. a [1, P*S] key bias) gets every device's share:
  # summed. A bias sharded like the queries keeps its own rows' gradient.
  # (The queries always vary over the ring unless shard_map checks no
  # types, check_vma=False: then its transpose sums what is replicated.)
  shared_bias = (dbias is not None and _varies(q, rg.axis_name)
                 and not _varies(ex.bias, rg.axis_name))
  if dargs or shared_bias:
    # The barrier orders the all-reduce after the last shift
    # (independent collectives may otherwise run in different orders on
    # different devices and deadlock).
    dk, dv, dargs, dbias = jax.lax.optimization_barrier(
        (dk, dv, dargs, dbias))
    dargs = tuple(jax.lax.psum(d, rg.axis_name).astype(c.dtype)
                  for d, c in zip(dargs, ex.mod_consts))
    if shared_bias:
      dbias = jax.lax.psum(dbias, rg.axis_name)
  d_ex = broadcast.Head(
      bias=None if dbias is None else dbias.astype(ex.bias.dtype),
      mod_consts=dargs)
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_ex,
          None)


def _varying_zero(*operands):
  """A float32 0 that varies over every mesh axis the operands do (a loop
  carry keeps its shard_map type; a fresh constant varies over none)."""
  zero = jnp.zeros((), jnp.float32)
  for x in jax.tree.leaves(operands):
    zero = zero + jnp.zeros_like(x, jnp.float32, shape=())
  return zero


def _varies(x, axis_name: str) -> bool:
  """Whether ``x``'s shard_map type varies over ``axis_name``."""
  return axis_name in jax.typeof(x).manual_axis_type.varying



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
  n = ring_layout.num_chunks(layout)
  st = flash_core.static(q.shape[0] // n, k.shape[0] // n, **blocks)
  rg = _Ring(st, axis_name, size, steps or tuple(range(size)), layout)
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
  out, lse, max_logits, code = _ring(rg, q, k, v, ex, _gather(rg, ex))
  out, lse, code, max_logits = (_strip_chunks(x, n, st.t, tp)
                                for x in (out, lse, code, max_logits))
  if h.sink is not None:
    out, _, lse = numerics.with_sink(out, lse, h.sink, h.q_lengths)
  # NaN or inf reaches only the rows that may see it (flash_core's blocks
  # are made finite as they are loaded; each step's codes merge by max):
  # poisoned after the custom VJP, those rows pass no cotangent back.
  out, lse, max_logits = numerics.poison(code, out.astype(out_dtype), lse,
                                         max_logits)
  if st.max_logits:
    return out, None, lse, max_logits
  return out, None, lse


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

  def _check_even(self, t: int, s: int, size: int) -> None:
    n = ring_layout.num_chunks(self.layout)
    if t % n or s % n:
      raise ValueError(
          f"layout='zigzag' holds two chunks of the sequence per device, so "
          f"this device's lengths must be even: T = {t}, S = {s} on {size} "
          f"devices (global {size * t} and {size * s}). Pad the global "
          f"lengths to multiples of 2 * {size} = {2 * size} "
          f"(ring_layout.zigzag_indices refuses others) or use "
          f"layout='contiguous'.")

  def localize(self, mask: mask_lib.Mask | None, score_mod: Any, t: int,
               s: int, leading: tuple[int, ...] = (), bias=None):
    """A mask and score modifier written for the whole sequence, in this
    device's terms; ``(mask, score_mod, kernel)``.

    The global call has ``P * T`` queries and ``P * S`` keys; this device
    holds query rows ``[i*T, (i+1)*T)`` and key rows ``[i*S, (i+1)*S)``
    (contiguous), or the global chunks ``i`` and ``2P - 1 - i`` of ``T /
    2`` and ``S / 2`` rows (zigzag, ``ring_layout``). Its mask gets the
    position of its first row and column (the global mask's, or the
    bottom-right alignment's; the kernel places its second chunk from the
    layout), its lengths (the global ones, clipped to its chunks: a prefix
    of its rows, ``ring_layout.local_length``); segment ids are already
    this device's; a union is bound and a ``BlockMask``'s rule kept (its
    tables are laid out for the global sequence), each evaluated at
    global positions; without positions in a ``T != S`` call, where rows
    stand ``P * (S - T)`` ahead of their indices, the rule and
    ``score_mod`` still see the indices. The mask's dense field and
    ``bias`` (``[..., T|1, P*S|1]``: this device's rows, every key column
    in the layout's order) are checked and moved into the kernel
    (``Columns``); the returned mask has no dense field and the call
    passes no bias. The kernel comes back with the steps the global band
    needs (every step when the positions are traced). ``leading`` are the
    operands' leading dims (a union's members are checked at the global
    lengths against them; a dense mask's and a bias's leading dims are
    theirs or 1).
    """
    size = self.size()
    index = jax.lax.axis_index(self.axis_name)
    self._check_even(t, s, size)
    n = ring_layout.num_chunks(self.layout)
    big_t, big_s = size * t, size * s
    m = mask_lib.Mask() if mask is None else mask
    rule, shift = m.rule, 0
    if m.positioned:
      q_at, kv_at = m.offsets(big_t, big_s)
    else:  # bottom-right: rules and modifiers see indices, not positions
      shift = big_s - big_t
      q_at, kv_at = shift, 0
    if isinstance(rule, mask_lib.Union):
      _check_union(rule, leading, big_t, big_s)
      rule = rule.bound(big_t, big_s)
    elif isinstance(rule, BlockMask):
      if rule.shape != (big_t, big_s):
        raise ValueError(
            f"mask is a BlockMask built for [T, S] = {list(rule.shape)}, but "
            f"ring attention indexes rules over the global sequence of all "
            f"{size} devices, T = {big_t}, S = {big_s}: build it with "
            f"block_mask(mask_fn, {big_t}, {big_s}, ...).")
      rule = rule.mask_fn
    if shift and rule is not None:
      rule = _at_indices_rule(rule, shift)
    if shift and score_mod is not None:
      score_mod = _at_indices_mod(score_mod, shift)
    columns = Columns(
        _global_columns("mask", m.dense, t, s, size, tuple(leading)),
        _global_columns("bias", bias, t, s, size, tuple(leading)))
    lengths = {}
    for name, given, rows, total in (("q_lengths", m.q_lengths, t, big_t),
                                     ("kv_lengths", m.kv_lengths, s, big_s)):
      if given is not None:
        checks.check_concrete_range(f"the mask's {name}", given, total)
        lengths[name] = ring_layout.local_length(
            self.layout, jnp.asarray(given), index, size, rows // n)
    # the positions of this device's first row and column (the kernel
    # places a second chunk from the layout)
    q_first = ring_layout.chunk_starts(self.layout, index, size, t // n)[0]
    kv_first = ring_layout.chunk_starts(self.layout, index, size, s // n)[0]
    local = mask_lib.Mask(
        causal=m.causal, window=m.window, q_segment_ids=m.q_segment_ids,
        kv_segment_ids=m.kv_segment_ids, rule=rule, q_offset=q_at + q_first,
        kv_offset=kv_at + kv_first, **lengths)
    kernel = dataclasses.replace(
        self, columns=None if all(x is None for x in columns) else columns)
    bounds = intervals.bounds(m.causal, m.window)
    try:
      relative = np.unique(np.asarray(q_at) - np.asarray(kv_at))
    except jax.errors.TracerArrayConversionError:  # traced: every step
      return local, score_mod, dataclasses.replace(kernel, steps=None)
    steps = sorted(set().union(*(
        needed_steps(bounds, t, s, size, int(r), self.layout)
        for r in relative.reshape(-1))))
    return local, score_mod, dataclasses.replace(kernel, steps=tuple(steps))

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
    return (base.no_weights_or_dropout(problem)
            or base.float32_only(problem))

  def __call__(self, problem: base.Problem):
    problem = base.scale_in_query(problem)  # a traced scale too
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
          dense=None if mask is None else grouping.split(
              numerics.as_bool_mask(mask), ops.groups, -3),
          bias=grouping.split(bias, ops.groups, -3))
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
    # that see one (broadcast.Head.garbage).
    garbage = jax.lax.pmax(numerics.any_nonfinite(
        ops.query, ops.key, ops.value).astype(jnp.int32), self.axis_name) > 0
    return broadcast.lift_heads(head, ops, (garbage,), (0,))


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
        lambda q, k, m=m: (checks.attention_operands(q, k, k, m), 0)[1],
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
