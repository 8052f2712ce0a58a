"""The Pallas GPU kernel's programs: one head's block walk, block by block.

Shape glossary: T query length, S key/value length, H head dim, Hv value
head dim; bq/bk query and key block sizes; Tp/Sp lengths padded to whole
blocks; nq/nk the numbers of query and key blocks.

What runs inside ``pl.pallas_call`` for ``kernels/pallas_gpu.py`` (which
pads a head, builds the block tables, launches these and holds the custom
VJP): three kernels, each one program per block of a 1-D grid,

* ``forward_kernel``: query block ``i`` (``q [bq, H]``) walks the key
  blocks it may see with the online softmax; writes ``out [bq, Hv]``, the
  row ``lse [bq]`` and each row's ``checks`` code ``[bq]``;
* ``dkdv_kernel``: key block ``j`` walks the query blocks that see it;
  writes ``dk [bk, H]``, ``dv [bk, Hv]``, its tiles of ``dbias [Tp, Sp]``
  and its share of the score modifier's array cotangents;
* ``dq_kernel``: query block ``i`` walks its key blocks again; writes
  ``dq [bq, H]``;

and the block-level helpers they share: ``Spec``, a head's static layout
(which operands are present, the block sizes, the launch); ``Refs``, the
operands besides q, k, v, passed flat (``flatten``) and read back per
block (``_tiles``); ``Replay``, a score modifier or mask rule traced at
block shapes and replayed in a kernel (a kernel may not close over
arrays: what it reads comes in as operands); ``_walk``, the loop over a
row of ``(lo, hi, full_lo, full_hi, first, last)``; ``_logits``, a
block's logits and where they are allowed, as the flash core's (bias,
score modifier and its VJP, causal/window bounds, lengths, segment ids,
a dense mask, a rule; ``full`` blocks skip the pattern); ``_dropper``, a
block's dropout mask drawn again from the call's seed and the entries'
``(b, h, q_idx, kv_idx)`` (``core/dropout.py``), so no ``[T, S]`` bits
pass between kernels. Tiles are made finite as they are loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from attention_jax.core import checks
from attention_jax.core import dropout
from attention_jax.kernels import flash_core
from attention_jax.masking import intervals

_F32 = jnp.float32


class Launch(NamedTuple):
  """How ``pallas_call`` runs the kernels: interpreted, or Triton's
  warps and pipeline stages."""
  interpret: bool
  num_warps: int
  num_stages: int


class Replay(NamedTuple):
  """A function traced at block shapes, to be replayed inside a kernel.

  ``fn(consts, *args)`` evaluates the traced program; ``consts`` are the
  arrays it read (passed to the kernel as operands).
  """
  jaxpr: Any
  consts: tuple
  blocks: bool = True  # whether it may write -inf (score modifiers)

  def __call__(self, consts, *args):
    out, = jax.core.eval_jaxpr(self.jaxpr, list(consts), *args)
    return out


def replay(fn: Callable, *examples, blocks: bool = True) -> Replay:
  """``fn`` traced at the shapes of ``examples`` (one block's)."""
  closed = jax.make_jaxpr(fn)(*examples)
  return Replay(closed.jaxpr, tuple(closed.consts), blocks)


class Spec(NamedTuple):
  """A head's static layout: what each kernel receives and how to read it."""
  st: flash_core.Static
  mask_shape: tuple[int, int] | None
  bias: bool
  segments: bool
  length: bool
  q_lengths: bool
  listed: bool  # a block mask's tables
  every_block_checked: bool  # a dense mask or a rule: no full blocks
  patterned: bool
  mod: Replay | None  # (score, b, h, q_idx, kv_idx, *diff) -> score
  num_diff: int  # the score modifier's differentiable arrays
  rule: Replay | None  # (b, h, q_idx, kv_idx) -> bool
  dropout: bool  # the kernels receive a seed and a rate
  launch: Launch


class Refs(NamedTuple):
  """The kernel operands besides q, k, v (None = absent): refs in a kernel,
  or one block's values read from them (``_tiles``; ``ints`` then scalars,
  ``ranges``/``table`` None)."""
  ints: Any  # int32 [7]: kv length, q length, b, h, offset, q_start, kv_start
  ranges: Any
  table: Any
  q_segment_ids: Any
  kv_segment_ids: Any
  mask: Any
  bias: Any
  seed: Any  # dropout's uint32 [2] (a tile: its two words)
  rate: Any  # dropout's float32 [1] (a tile: the scalar)
  mod_consts: tuple
  mod_diff: tuple
  rule_consts: tuple


def flatten(r: Refs) -> list:
  """The present operands of ``r`` in order (the kernels' refs)."""
  flat = [r.ints, r.ranges]
  for x in (r.table, r.q_segment_ids, r.kv_segment_ids, r.mask, r.bias,
            r.seed, r.rate):
    if x is not None:
      flat.append(x)
  return flat + [*r.mod_consts, *r.mod_diff, *r.rule_consts]


def _unflatten(refs, sp: Spec) -> list:
  """``Refs``' fields from the kernel's refs (``flatten``'s inverse)."""
  refs = list(refs)
  take = lambda present: refs.pop(0) if present else None  # noqa: E731
  ints, ranges = refs.pop(0), refs.pop(0)
  table = take(sp.listed)
  q_segment_ids, kv_segment_ids = take(sp.segments), take(sp.segments)
  mask = take(sp.mask_shape is not None)
  bias = take(sp.bias)
  seed, rate = take(sp.dropout), take(sp.dropout)
  n_mod = 0 if sp.mod is None else len(sp.mod.consts)
  n_rule = 0 if sp.rule is None else len(sp.rule.consts)
  mod_consts = tuple(refs.pop(0) for _ in range(n_mod))
  mod_diff = tuple(refs.pop(0) for _ in range(sp.num_diff))
  rule_consts = tuple(refs.pop(0) for _ in range(n_rule))
  return [ints, ranges, table, q_segment_ids, kv_segment_ids, mask, bias,
          seed, rate, mod_consts, mod_diff, rule_consts]


def _load_const(ref, shape):
  """An array operand read whole, at its own shape (0-d came as [1])."""
  return ref[...].reshape(shape)


def _tiles(sp: Spec, r: Refs, shapes, i0, j0) -> Refs:
  """Reads one block's operands at rows ``i0``, columns ``j0``."""
  st = sp.st
  ints = tuple(r.ints[n] for n in range(7))
  q_segment_ids = kv_segment_ids = mask = bias = seed = rate = None
  if sp.dropout:
    seed, rate = (r.seed[0], r.seed[1]), r.rate[0]
  if sp.segments:
    q_segment_ids = r.q_segment_ids[pl.ds(i0, st.bq)]
    kv_segment_ids = r.kv_segment_ids[pl.ds(j0, st.bk)]
  if sp.mask_shape is not None:
    rows, cols = sp.mask_shape
    mask = r.mask[pl.ds(i0, st.bq) if rows != 1 else pl.ds(0, 1),
                  pl.ds(j0, st.bk) if cols != 1 else pl.ds(0, 1)]
  if sp.bias:
    bias = r.bias[pl.ds(i0, st.bq), pl.ds(j0, st.bk)]
  mod_shapes, diff_shapes, rule_shapes = shapes
  return Refs(ints, None, None, q_segment_ids, kv_segment_ids, mask, bias,
              seed, rate, tuple(map(_load_const, r.mod_consts, mod_shapes)),
              tuple(map(_load_const, r.mod_diff, diff_shapes)),
              tuple(map(_load_const, r.rule_consts, rule_shapes)))


def _finite(rows):
  """``(rows with NaN and inf as 0, [n] bool: rows that held one)``."""
  ok = jnp.isfinite(rows)
  return jnp.where(ok, rows, jnp.zeros_like(rows)), jnp.min(
      ok.astype(jnp.int32), axis=-1) == 0


def _key_rows(st, ref, j0, length, has_length):
  """A key/value tile, zero past ``length``, finite, and its bad rows."""
  rows = ref[pl.ds(j0, st.bk), :]
  if has_length:
    valid = j0 + jax.lax.broadcasted_iota(jnp.int32, (st.bk, 1), 0) < length
    rows = jnp.where(valid, rows, jnp.zeros_like(rows))
  return _finite(rows)


def _logits(sp: Spec, qi, kj, i0, j0, tiles: Refs, full: bool,
            want_vjp: bool = False):
  """Float32 logits of one block, where allowed (``ok``), and a VJP.

  As ``flash_core``'s block logits: ``scale * q.k + bias``, then the score
  modifier; ``full`` blocks skip the pattern; padded query rows need no
  mask (their outputs are dropped, their cotangents zero).
  """
  st = sp.st
  logits = jax.lax.dot_general(qi, kj, (((1,), (1,)), ((), ())),
                               preferred_element_type=_F32)  # [bq, bk]
  logits = logits * st.scale
  ok = None

  def both(extra):
    if extra is None:
      return ok
    return extra if ok is None else ok & extra

  rows = i0 + jax.lax.broadcasted_iota(jnp.int32, (st.bq, 1), 0)
  cols = j0 + jax.lax.broadcasted_iota(jnp.int32, (1, st.bk), 1)
  # (offset: query row r stands at key column r + offset; the score
  # modifier and the rule see positions q_start + r, kv_start + c)
  length, q_lengths, b, h, offset, q_start, kv_start = tiles.ints
  if tiles.bias is not None:
    logits = logits + tiles.bias.astype(_F32)
    ok = both(logits > -jnp.inf)
  mod_vjp = None
  if sp.mod is not None:
    consts = tiles.mod_consts

    def mod(score, *diff):
      return jnp.broadcast_to(
          sp.mod(consts, score, b, h, q_start + rows, kv_start + cols,
                 *diff).astype(_F32),
          score.shape)

    safe = logits if ok is None else jnp.where(ok, logits, 0.0)
    if want_vjp:
      logits, mod_vjp = jax.vjp(mod, safe, *tiles.mod_diff)
    else:
      logits = mod(safe, *tiles.mod_diff)
    if sp.mod.blocks:
      ok = both(logits > -jnp.inf)
  if full:
    return logits, ok, mod_vjp
  if st.s % st.bk:
    ok = both(cols < st.s)
  q_segment_ids = kv_segment_ids = None
  if tiles.q_segment_ids is not None:
    q_segment_ids = tiles.q_segment_ids[:, None]
    kv_segment_ids = tiles.kv_segment_ids[None, :]
  ok = both(intervals.visible(rows, cols, offset, st.bounds,
                              q_lengths if sp.q_lengths else None,
                              length if sp.length else None, q_segment_ids,
                              kv_segment_ids))
  if tiles.mask is not None:
    ok = both(jnp.broadcast_to(tiles.mask != 0, (st.bq, st.bk)))
  if sp.rule is not None:
    ok = both(jnp.broadcast_to(sp.rule(tiles.rule_consts, b, h,
                                       q_start + rows, kv_start + cols),
                               (st.bq, st.bk)))
  return logits, ok, mod_vjp


def _probabilities(sp, qi, kj, i0, j0, tiles, full, lse_i, want_vjp):
  """``P = exp(logits - lse)`` of one block (0 where blocked), and the VJP."""
  logits, ok, mod_vjp = _logits(sp, qi, kj, i0, j0, tiles, full, want_vjp)
  row_ok = (lse_i > -jnp.inf)[:, None]
  ok = row_ok if ok is None else ok & row_ok
  shift = jnp.where(lse_i > -jnp.inf, lse_i, 0.0)
  return flash_core.masked_exp(logits, ok, shift), mod_vjp


def _dropper(sp: Spec, tiles: Refs, i0, j0) -> Callable:
  """The block's dropout: ``x [bq, bk] -> x / (1 - rate)`` where kept, else
  0 (the identity without dropout).

  Inverted dropout as the dense kernel applies it to the probabilities
  (and, in the backward pass, to their cotangent ``dO V^T``). The keep
  mask is drawn again from ``(seed, b, h, q_idx, kv_idx)`` in every kernel
  (``core/dropout.py``): no ``[T, S]`` bits are stored between passes. One
  draw per block, shared by the block's uses.
  """
  if not sp.dropout:
    return lambda x: x
  st = sp.st
  _, _, b, h, _, q_start, kv_start = tiles.ints
  rows = q_start + i0 + jax.lax.broadcasted_iota(jnp.int32, (st.bq, 1), 0)
  cols = kv_start + j0 + jax.lax.broadcasted_iota(jnp.int32, (1, st.bk), 1)
  keep = dropout.keep(dropout.row_keys(tiles.seed, b, h, rows), cols,
                      dropout.threshold(tiles.rate))  # [bq, bk]
  return lambda x: jnp.where(keep, x / (1.0 - tiles.rate), 0.0)


def _walk(sp: Spec, ranges_ref, idx, table_ref, count: int, body, carry):
  """``body(block, full, carry)`` over the blocks block ``idx`` visits.

  ``ranges_ref[idx]`` is ``(lo, hi, full_lo, full_hi, first, last)``;
  with a block mask ``table_ref[idx, first:last]`` lists the blocks (each
  checked: Triton has no ``cond`` on a flag here, and a full block's mask
  is all True).
  """
  if not sp.patterned:
    return jax.lax.fori_loop(0, count, lambda j, c: body(j, True, c), carry)
  lo, hi, full_lo, full_hi, first, last = (ranges_ref[idx, n]
                                           for n in range(6))
  masked = lambda j, c: body(j, False, c)  # noqa: E731
  if sp.listed:
    return jax.lax.fori_loop(first, last,
                             lambda n, c: masked(table_ref[idx, n], c), carry)
  if sp.every_block_checked:
    return jax.lax.fori_loop(lo, hi, masked, carry)
  carry = jax.lax.fori_loop(lo, full_lo, masked, carry)
  carry = jax.lax.fori_loop(full_lo, full_hi,
                            lambda j, c: body(j, True, c), carry)
  return jax.lax.fori_loop(full_hi, hi, masked, carry)


def forward_kernel(sp: Spec, shapes, num_refs: int, q_ref, k_ref, v_ref,
                   *refs):
  """Query block ``i``: its output, lse and each row's garbage code."""
  st = sp.st
  r = Refs(*_unflatten(refs[:num_refs], sp))
  out_ref, lse_ref, code_ref = refs[num_refs:]
  i = pl.program_id(0)
  i0 = i * st.bq
  qi, q_bad = _finite(q_ref[...])  # [bq, H]
  length = r.ints[0]

  def key_block(j, full, carry):
    row_max, total, acc, code = carry
    j0 = j * st.bk
    kj, k_bad = _key_rows(st, k_ref, j0, length, sp.length)  # [bk, H]
    vj, v_bad = _key_rows(st, v_ref, j0, length, sp.length)  # [bk, Hv]
    tiles = _tiles(sp, r, shapes, i0, j0)
    logits, ok, _ = _logits(sp, qi, kj, i0, j0, tiles, full)
    bad = jnp.where(k_bad, checks.BAD_KEY, jnp.where(
        v_bad, checks.BAD_VALUE, checks.CLEAN))[None, :]  # [1, bk]
    seen = bad if ok is None else jnp.where(ok, bad, checks.CLEAN)
    code = jnp.maximum(code, jnp.max(seen, -1))  # [bq]
    allowed = logits if ok is None else jnp.where(ok, logits, -jnp.inf)
    new_max = jnp.maximum(row_max, jnp.max(allowed, -1))  # [bq]
    shift = jnp.where(new_max > -jnp.inf, new_max, 0.0)
    p = flash_core.masked_exp(logits, ok, shift)  # [bq, bk]
    rescale = jnp.exp(row_max - shift)  # 0 while row_max = -inf
    total = total * rescale + p.sum(-1)  # undropped: the lse is too
    acc = acc * rescale[:, None] + jax.lax.dot_general(
        _dropper(sp, tiles, i0, j0)(p).astype(vj.dtype), vj,
        (((1,), (0,)), ((), ())), preferred_element_type=_F32)
    return new_max, total, acc, code

  hv = v_ref.shape[-1]
  init = (jnp.full((st.bq,), -jnp.inf, _F32), jnp.zeros((st.bq,), _F32),
          jnp.zeros((st.bq, hv), _F32), jnp.zeros((st.bq,), _F32))
  row_max, total, acc, code = _walk(sp, r.ranges, i, r.table,
                                    k_ref.shape[0] // st.bk, key_block, init)
  seen = total > 0
  # a bad query spoils its row where it sees a key
  code_ref[...] = jnp.maximum(code, jnp.where(seen & q_bad, checks.BAD_KEY,
                                              checks.CLEAN))
  safe_total = jnp.where(seen, total, 1.0)
  out_ref[...] = (acc / safe_total[:, None]).astype(out_ref.dtype)
  lse_ref[...] = jnp.where(
      seen, jnp.where(row_max > -jnp.inf, row_max, 0.0) + jnp.log(safe_total),
      -jnp.inf)


def dkdv_kernel(sp: Spec, shapes, num_refs: int, q_ref, k_ref, v_ref,
                 do_ref, lse_ref, delta_ref, *refs):
  """Key block ``j``: dk, dv, its column of dbias, its share of d(mod)."""
  st = sp.st
  r = Refs(*_unflatten(refs[:num_refs], sp))
  outs = list(refs[num_refs + sp.bias:])  # (past dbias's zeros, aliased)
  dk_ref, dv_ref = outs[:2]
  dbias_ref = outs[2] if sp.bias else None
  ddiff_refs = outs[2 + sp.bias:]
  j = pl.program_id(0)
  j0 = j * st.bk
  length = r.ints[0]
  kj, _ = _key_rows(st, k_ref, j0, length, sp.length)
  vj, _ = _key_rows(st, v_ref, j0, length, sp.length)
  diff_shapes = shapes[1]

  def query_block(i, full, carry):
    dkj, dvj, ddiff = carry
    i0 = i * st.bq
    qi, _ = _finite(q_ref[pl.ds(i0, st.bq), :])
    doi = do_ref[pl.ds(i0, st.bq), :]
    tiles = _tiles(sp, r, shapes, i0, j0)
    p, mod_vjp = _probabilities(sp, qi, kj, i0, j0, tiles, full,
                                lse_ref[pl.ds(i0, st.bq)], sp.mod is not None)
    drop = _dropper(sp, tiles, i0, j0)
    dvj = dvj + jax.lax.dot_general(
        drop(p).astype(doi.dtype), doi,
        (((0,), (0,)), ((), ())), preferred_element_type=_F32)
    dp = jax.lax.dot_general(doi, vj.astype(doi.dtype),
                             (((1,), (1,)), ((), ())),
                             preferred_element_type=_F32)
    dp = drop(dp)  # dP = d(dropped P) * M / (1 - rate)
    ds = p * (dp - delta_ref[pl.ds(i0, st.bq)][:, None])  # [bq, bk]
    if mod_vjp is not None:
      ds, *d_diff = mod_vjp(ds)
      ddiff = tuple(acc + d.astype(_F32) for acc, d in zip(ddiff, d_diff))
    dkj = dkj + jax.lax.dot_general(ds.astype(qi.dtype), qi,
                                    (((0,), (0,)), ((), ())),
                                    preferred_element_type=_F32) * st.scale
    if dbias_ref is not None:
      plgpu.store(dbias_ref.at[pl.ds(i0, st.bq), pl.ds(j0, st.bk)],
                  ds.astype(dbias_ref.dtype))
    return dkj, dvj, ddiff

  init = (jnp.zeros(kj.shape, _F32), jnp.zeros(vj.shape, _F32),
          tuple(jnp.zeros(s, _F32) for s in diff_shapes))
  dkj, dvj, ddiff = _walk(sp, r.ranges, j, r.table, q_ref.shape[0] // st.bq,
                          query_block, init)
  dk_ref[...] = dkj.astype(dk_ref.dtype)
  dv_ref[...] = dvj.astype(dv_ref.dtype)
  for ref, d in zip(ddiff_refs, ddiff):
    ref[...] = d.reshape(ref.shape)


def dq_kernel(sp: Spec, shapes, num_refs: int, q_ref, k_ref, v_ref,
               do_ref, lse_ref, delta_ref, *refs):
  """Query block ``i``: dq."""
  st = sp.st
  r = Refs(*_unflatten(refs[:num_refs], sp))
  dq_ref, = refs[num_refs:]
  i = pl.program_id(0)
  i0 = i * st.bq
  qi, _ = _finite(q_ref[...])
  doi = do_ref[...]
  lse_i = lse_ref[...]
  delta_i = delta_ref[...]
  length = r.ints[0]

  def key_block(j, full, dqi):
    j0 = j * st.bk
    kj, _ = _key_rows(st, k_ref, j0, length, sp.length)
    vj, _ = _key_rows(st, v_ref, j0, length, sp.length)
    tiles = _tiles(sp, r, shapes, i0, j0)
    p, mod_vjp = _probabilities(sp, qi, kj, i0, j0, tiles, full, lse_i,
                                sp.mod is not None)
    dp = jax.lax.dot_general(doi, vj.astype(doi.dtype),
                             (((1,), (1,)), ((), ())),
                             preferred_element_type=_F32)
    dp = _dropper(sp, tiles, i0, j0)(dp)  # dP = d(dropped P) * M / (1 - rate)
    ds = p * (dp - delta_i[:, None])
    if mod_vjp is not None:
      ds = mod_vjp(ds)[0]
    return dqi + jax.lax.dot_general(ds.astype(kj.dtype), kj,
                                     (((1,), (0,)), ((), ())),
                                     preferred_element_type=_F32) * st.scale

  dqi = _walk(sp, r.ranges, i, r.table, k_ref.shape[0] // st.bk, key_block,
              jnp.zeros(qi.shape, _F32))
  dq_ref[...] = dqi.astype(dq_ref.dtype)
