"""Ring attention's passes round the ring: forward, tangent and backward.

Shape glossary: T this device's query length, S this device's key/value
length, H head dim, Hv value head dim, P devices on the ring axis, n chunks
a device holds (1 contiguous, 2 zigzag), Tp/Sp a chunk's length padded to
whole blocks. One head at a time (``Ring`` lifts them): q ``[n*Tp, H]``,
k ``[n*Sp, H]``, v ``[n*Sp, Hv]``; a dense mask and a bias ``[n*Tp|1,
P*n*Sp|1]`` (``ring_local.Columns``, padded per chunk).

Each device keeps its queries and passes its key/value block (with its
segment ids: ``_Held``) to the next device (``lax.ppermute``), folding the
block it holds into its rows' result with the flash core (per pair:
``out_j``, ``lse_j``, merged by log-sum-exp). Every device's key lengths
and positions are gathered once per call (``gather``), so each step
places the held block at its owner's positions (``flash_core.Place``).
One path serves both layouts: each step runs the flash core on every
(query chunk, held key chunk) pair at their global positions (a loop over
the ``n * n`` pairs, so one walk is compiled); a pair wholly in a query
chunk's future has empty key ranges and costs no block. A dense mask and
a bias hold every key column: each pair slices its window of columns (by
the key chunk's owner and place), nothing travels; the bias's gradient is
the sum of the windows, scattered into its columns (and summed over the
devices where its rows are replicated). Only ``Static.steps`` are made:
the shift before a step jumps over the steps left out (every step: a
``fori_loop`` of single shifts).

``attend`` is a ``jax.custom_jvp`` whose tangent is a ``core/linear_map.py``
map: forward mode goes round the ring with the key and value tangents
travelling beside their blocks (``flash_core.tangent`` per pair, against
the global ``out`` and ``lse``); reverse mode transposes it into the
backward pass, which goes round the ring again: key/value blocks travel
with their gradient accumulators, each device adds its queries' share
(``flash_core.backward`` with the global ``lse``, pair by pair), and one
last shift brings every accumulator home. Saved per device: its own q,
k, v, output and ``lse``: O(T + S), independent of P. With
``max_logits`` each step's raw row maxima are combined by ``max``; no
gradient flows through them.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from attention_jax.core import linear_map
from attention_jax.core import merge as merge_lib
from attention_jax.kernels import base
from attention_jax.kernels import flash_core
from attention_jax.kernels import ring_layout


class Static(NamedTuple):
  """A ring call's static description: one chunk's flash statics, the
  axis, the steps made and the layout."""
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


def _shift(x, rg: Static, by: int = 1):
  """Sends ``x`` ``by`` steps round the ring: device ``i`` -> ``i + by``."""
  if x is None or by % rg.size == 0:
    return x
  perm = [(i, (i + by) % rg.size) for i in range(rg.size)]
  return jax.lax.ppermute(x, rg.axis_name, perm)


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


def gather(rg: Static, ex: base.Head) -> _Blocks:
  """Every device's key-block lengths and positions (``_Blocks``), once
  per call."""
  return _Blocks(*(None if x is None else jax.lax.all_gather(x, rg.axis_name)
                   for x in (ex.kv_lengths, ex.kv_offset)))


def _travel(rg: Static, held: _Held, by: int = 1) -> _Held:
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
  ex: base.Head  # the pair's operands: lengths, ids, mask, bias
  place: flash_core.Place
  column: jax.Array  # int32: the key chunk's first padded column


def _pair(rg: Static, ex: base.Head, blocks: _Blocks, held: _Held,
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


def _fold(rg: Static, q, ex, blocks, held, step, result):
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


def _ring_forward(rg: Static, q, k, v, ex, blocks):
  """Float32 ``(out [n*Tp, Hv], lse [n*Tp], max_logits [n*Tp] or None,
  code [n*Tp])`` over the whole ring (``max_logits`` with
  ``rg.block.max_logits``; ``code`` each row's largest ``checks`` code
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
def attend(rg: Static, q, k, v, ex, blocks):
  """One head's attention over the whole ring, ``(out [n*Tp, Hv]`` in
  ``v``'s dtype``, lse, max_logits or None, code)`` as ``_ring_forward``'s;
  differentiable in q, k, v, the bias and ``score_mod``'s arrays."""
  out, lse, max_logits, code = _ring_forward(rg, q, k, v, ex, blocks)
  return out.astype(v.dtype), lse, max_logits, code


@attend.defjvp
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
      functools.partial(_ring_transpose, rg), residuals, linear,
      outputs=(jax.ShapeDtypeStruct(out.shape, jnp.float32),  # [n*Tp, Hv]
               jax.ShapeDtypeStruct(lse.shape, jnp.float32)))  # [n*Tp]
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
  d_ex = base.Head(
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
