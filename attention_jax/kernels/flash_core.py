"""The flash-attention core shared by ``blockwise`` and ``ring``.

Shape glossary: T query length, S key/value length, H head dim, Hv value
head dim; bq/bk query and key block sizes; Tp/Sp lengths padded to whole
blocks. Everything here is written for one head (``[T, H]`` queries against
``[S, H]`` keys); the public entry points lift it over leading dims.

Never more than one ``[bq, bk]`` block of scores exists at a time
(Rabe & Staats 2021; FlashAttention-2, Dao 2023). The forward pass walks the
query blocks; for each it runs the online softmax over the key blocks it may
see (causal attention stops at the diagonal, key lengths at the last valid
block) and keeps only the output and the row log-sum-exp. The backward pass
recomputes each block's probabilities from that log-sum-exp
(``D = rowsum(dO * O) - dlse``, ``dS = P * (dP - D)``), walking the key
blocks and, for each, only the query blocks that can see it.

Internal interface (what ``kernels/flash.py``, the ring kernel's files,
``kernels/pallas_gpu.py`` and ``kernels/pallas_blocks.py`` use; nothing
else of this module is imported elsewhere):

* ``Static``: one head's static configuration (scale, causal/window bounds,
  score modifier, true lengths, block sizes, whether to return the row
  maxima); hashable, the ``nondiff_argnums`` of the custom JVPs.
* ``ex``, a ``base.Head``: one head's other operands, padded (mask,
  bias, lengths, segment ids, block mask, ``(b, h)``, the score modifier's
  arrays, the garbage flag); a pytree. ``Place``: where the local rows and
  columns stand.
* ``static(t, s, *, scale, is_causal, block_q, block_k, window,
  score_mod, max_logits)`` builds the ``Static`` (``single_head`` then pads
  q, k, v to whole blocks); ``padded_head(st, tp, sp, head)`` pads a
  ``base.Head``;
  ``hoist_score_mod(st, ex, like, replay_closures=)`` makes the modifier's
  arrays operands.
* ``forward(st, q, k, v, ex, place)``: float32 ``(out [Tp, Hv], lse [Tp],
  max_logits [Tp] or None, code [Tp])``; ``max_logits`` (``st.max_logits``)
  is each row's largest raw ``scale * q . k`` over the keys it attends to in
  the visited blocks (``-inf`` if none), before bias and ``score_mod``;
  ``code`` the largest ``checks`` code among them and the row's own
  query (which rows saw a NaN or inf). Both passes replace non-finite
  entries of the blocks they load by 0 (``_finite``), so every product is
  finite.
* ``backward(st, residuals, cotangents, drop=None)``: float32 ``(dq, dk,
  dv, dbias, dargs)`` from ``residuals = (q, k, v, ex, place, out, lse)``
  and ``cotangents = (d_out, d_lse)``; ``out``/``lse`` may be those of a
  longer key sequence of which ``k``/``v`` are one block (ring attention).
* ``tangent(st, residuals, linear)``: forward-mode AD, float32 ``(d_out,
  d_lse)`` from the tangents of q, k, v, the bias and the modifier's
  arrays (None: a symbolic zero, whose dots are not made); as
  ``backward``, its share when ``k``/``v`` are one block of a longer key
  sequence (the ring sums the shares).
* ``const_tangents``/``const_cotangents``: the score modifier's arrays'
  tangents and cotangents in the structure ``tangent`` takes them.
* ``Dropout(seed, rate)``: a call's dropout, each block's keep mask drawn
  in every pass (``core/dropout.py``); ``forward``/``backward`` take it.
* ``single_head(q, k, v, head, garbage=None, seed=None, rate=None, *,
  out_dtype, **blocks)`` (``garbage``: ``base.Head.garbage``): one
  head end to end, differentiable both ways (a ``jax.custom_jvp`` whose
  tangent is a ``core/linear_map.py`` map: ``tangent`` forward,
  ``backward`` its transpose; gradients through ``lse`` too;
  the rows that see a NaN or inf are ``checks.poison``'d after it),
  returning ``(out [T, Hv], None, lse [T])`` and, with
  ``max_logits=True``, ``max_logits [T]`` (zero gradient), the
  ``base.lift_heads`` contract.
* ``patterned``, ``segment_summary``, ``key_ranges``, ``query_ranges``:
  which blocks a block visits (the Pallas GPU kernel computes them outside
  its kernels with these); ``masked_exp``, also used inside its kernels.
* ``block_sizes(ops, block_q, block_k)`` picks blocks. (Validation happened
  once, before any kernel: ``kernels.base.canonicalize``.)

Operands: ``mask`` bool and ``bias`` float are ``[T|1, S|1]`` (size-1 axes
broadcast), ``kv_lengths``/``q_lengths`` int32 scalars (valid keys / queries) or
None. Causality and windows are written with an ``offset`` (``intervals``):
query row ``r`` stands at key position ``r + offset``, and the key blocks a
query block may see form one interval, the only ones visited.
``single_head`` passes the static ``S - T``
(bottom-right alignment); ``ring`` passes, per step, the offset of the key
block it holds relative to its query block, so blocks wholly in the future
cost no work.

Conventions are the package's: masks True = may attend, a query with
nothing to attend to gets output 0, lse ``-inf`` and zero gradients, float32
logits and accumulation for 16-bit inputs (the probabilities meet the values
in the values' dtype, so bf16 runs bf16 dots with float32 accumulation).
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from attention_jax.core import checks
from attention_jax.core import dropout
from attention_jax.core import linear_map
from attention_jax.kernels import base
from attention_jax.masking import intervals
from attention_jax.masking import selection
from attention_jax.scores import score_mods


class Static(NamedTuple):
  scale: float
  bounds: intervals.Bounds  # causal and window bounds (None = open)
  # score_mod(score, b, h, q_idx, kv_idx, *consts) (after hoist_score_mod)
  score_mod: Callable | None
  t: int  # true (unpadded) lengths
  s: int
  bq: int
  bk: int
  # forward also returns each row's raw max logit (return_max_logits)
  max_logits: bool = False


class Place(NamedTuple):
  """Where the local rows and columns stand (ring attention moves them).

  Query row ``r`` stands at key column ``r + offset`` (causality and
  windows); ``score_mod`` and a block mask's predicate see the global
  indices ``q_start + r`` and ``kv_start + c``.
  """
  offset: Any
  q_start: Any = 0
  kv_start: Any = 0


class Dropout(NamedTuple):
  """A call's dropout (``core/dropout.py``): the seed and the rate; a pytree.

  Each block's keep mask is drawn from ``(seed, b, h, q_idx, kv_idx)``
  (the head's ``Head.index`` and the global indices a ``score_mod`` sees)
  in the forward pass and drawn again in the backward and tangent passes:
  never stored, and the dense kernel's mask for the same seed and rate.
  """
  seed: jax.Array  # uint32 [2]
  rate: jax.Array  # float32 scalar

  def rows(self, ex: base.Head, place: Place, i0, bq: int):
    """The row keys of query block ``i0``: ``[bq, 1]`` uint32."""
    b, h = ex.index
    q_idx = i0 + jnp.arange(bq)[:, None] + place.q_start
    return dropout.row_keys(self.seed, b, h, q_idx)

  def keep(self, rows, place: Place, j0, bk: int):
    """The ``[bq, bk]`` keep mask of key block ``j0`` for ``rows``."""
    kv_idx = j0 + jnp.arange(bk)[None, :] + place.kv_start
    return dropout.keep(rows, kv_idx, dropout.threshold(self.rate))

  @property
  def inverse(self):
    """``1 / (1 - rate)``: kept probabilities are scaled by it."""
    return 1.0 / (1.0 - self.rate)


def pad_axis(x, axis: int, size: int, value):
  """Pads ``axis`` of ``x`` up to ``size``; size-1 (broadcast) axes stay."""
  if x is None or x.shape[axis] in (1, size):
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad, constant_values=value)


def _edge_pad(ids, size: int):
  """Segment ids padded by repeating the last (block min/max unchanged)."""
  if ids is None or ids.shape[0] == size:
    return ids
  return jnp.pad(ids, (0, size - ids.shape[0]), mode="edge")


def _tile_keep(x, i0, j0, bq: int, bk: int):
  """The block of a ``[T|1, S|1]`` operand at ``(i0, j0)``; size-1 axes kept."""
  rows, cols = x.shape
  return jax.lax.dynamic_slice(
      x, (i0 if rows != 1 else 0, j0 if cols != 1 else 0),
      (bq if rows != 1 else 1, bk if cols != 1 else 1))


def _tile(x, i0, j0, bq: int, bk: int):
  """The ``[bq, bk]`` block of a ``[T|1, S|1]`` operand at ``(i0, j0)``."""
  return jnp.broadcast_to(_tile_keep(x, i0, j0, bq, bk), (bq, bk))


def _add_tile(acc, tile, i0, j0):
  """Adds a block's cotangent into ``acc [T|1, S|1]`` (summing broadcasts)."""
  rows, cols = acc.shape
  if rows == 1 and tile.shape[0] != 1:
    tile = tile.sum(0, keepdims=True)
  if cols == 1 and tile.shape[1] != 1:
    tile = tile.sum(1, keepdims=True)
  tile = jnp.broadcast_to(tile, (rows if rows == 1 else tile.shape[0],
                                 cols if cols == 1 else tile.shape[1]))
  at = (i0 if rows != 1 else 0, j0 if cols != 1 else 0)
  return jax.lax.dynamic_update_slice(
      acc, jax.lax.dynamic_slice(acc, at, tile.shape) + tile, at)


def _finite(rows):
  """``(rows with NaN and inf replaced by 0, [n] bool: the rows that held
  one)``: a block's operands as every product meets them (``0 * NaN`` is
  NaN even where a weight is 0). Fused with the block's load, so it costs
  no pass of its own."""
  ok = jnp.isfinite(rows)
  return jnp.where(ok, rows, jnp.zeros_like(rows)), ~jnp.all(ok, axis=-1)


class PagedRows(NamedTuple):
  """One head's keys (or values) in a paged cache's pool; a pytree.

  Stands for the ``[M * Z, H]`` rows ``pool[row[j], head]`` (page by page)
  without building them: ``_key_rows`` loads the ``bk / Z`` pages of one
  key block (``bk`` a multiple of ``Z``; ``M`` a multiple of ``bk / Z``).
  ``row`` entries ``>= P`` (no page) lie past the head's length; their
  load is clamped to a real page and zeroed there. With
  ``scales`` the pool is quantised (int8, float8_e4m3fn) and a page is
  dequantised as it is loaded (float32 ``q * scale``): no dequantised
  copy of the pool or of a sequence exists. ``finite``
  (``base.Pages.finite``, the same for every head) True: the rows below
  the head's length are finite, so a loaded block is not searched for NaN
  or inf (it is still zeroed past the length).
  """
  pool: jax.Array  # [P, K, Z, H]
  head: jax.Array  # int32 scalar: the key/value head
  row: jax.Array  # int32 [M]: this example's pages
  scales: jax.Array | None = None  # float32 [P, K, Z]: quantised pool
  finite: jax.Array | None = None  # bool scalar, unmapped over heads

  @property
  def shape(self) -> tuple[int, int]:
    return (self.row.shape[0] * self.pool.shape[2], self.pool.shape[3])

  @property
  def dtype(self):
    return jnp.dtype(jnp.float32) if self.scales is not None else (
        self.pool.dtype)

  def page(self, j0, bk: int):
    """The rows ``[j0, j0 + bk)``: the ``g = bk / Z`` pages of one block."""
    z, h = self.pool.shape[2:]
    if bk == z:  # one page: a slice of the pool
      p = jax.lax.dynamic_index_in_dim(self.row, j0 // z, keepdims=False)
      pages = jax.lax.dynamic_slice(self.pool, (p, self.head, 0, 0),
                                    (1, 1, z, h))[:, 0]  # [1, Z, H]
      scales = None if self.scales is None else jax.lax.dynamic_slice(
          self.scales, (p, self.head, 0), (1, 1, z))[:, 0]  # [1, Z]
    else:  # g pages by index, clamped (past the length: zeroed later)
      p = jnp.minimum(jax.lax.dynamic_slice_in_dim(self.row, j0 // z, bk // z),
                      self.pool.shape[0] - 1)  # [g]
      pages = self.pool[p, self.head]  # [g, Z, H]
      scales = None if self.scales is None else self.scales[p, self.head]
    if scales is not None:
      pages = pages.astype(jnp.float32) * scales[..., None]
    return pages.reshape(bk, h)  # [bk, H]

  def cotangent(self, d_rows) -> PagedRows:
    """The pool's share of a cotangent of the ``[M * Z, H]`` rows (none
    for a quantised pool: it is a store, not a parameter)."""
    if self.scales is not None:
      return PagedRows(None, None, None, None)
    m, z = self.row.shape[0], self.pool.shape[2]
    d_pool = jnp.zeros(self.pool.shape, d_rows.dtype).at[
        self.row, self.head].add(d_rows.reshape(m, z, -1), mode="drop")
    return PagedRows(d_pool.astype(self.pool.dtype), None, None)


def _key_rows(st: Static, x, j0, length):
  """Rows ``[j0, j0 + bk)`` of keys or values, zero past ``length``, finite
  (``_finite``), and ``[bk]`` bool: the rows below ``length`` that held a
  NaN or inf.

  Rows past ``S`` are already the zeros ``_single_head`` padded with. ``x``
  may be ``PagedRows`` (whole pages per block), which need ``length``.
  """
  if isinstance(x, PagedRows):
    if x.finite is not None and length is not None:
      # One branch for the whole call: the search for NaN and inf (two
      # passes over the block) only where the cache cannot vouch.
      return jax.lax.cond(
          x.finite,
          lambda: _cleaned(st, x.page(j0, st.bk), j0, length, search=False),
          lambda: _cleaned(st, x.page(j0, st.bk), j0, length))
    rows = x.page(j0, st.bk)
  else:
    rows = jax.lax.dynamic_slice_in_dim(x, j0, st.bk)
  if length is None:
    return _finite(rows)
  return _cleaned(st, rows, j0, length)


def _cleaned(st: Static, rows, j0, length, *, search: bool = True):
  """``_key_rows`` of loaded rows: zero past ``length`` (unused page
  slots may hold anything) or, with ``search``, not finite; and the rows
  below it that held a NaN or inf (none without ``search``: the caller
  knows them finite). One select for both: two cost XLA:CPU a pass each."""
  valid = (j0 + jnp.arange(st.bk) < length)[:, None]  # [bk, 1]
  if not search:
    return (jnp.where(valid, rows, jnp.zeros_like(rows)),
            jnp.zeros((st.bk,), bool))
  ok = jnp.isfinite(rows)
  return (jnp.where(ok & valid, rows, jnp.zeros_like(rows)),
          valid[:, 0] & ~jnp.all(ok, axis=-1))


def _zero_like_all(*operands):
  """A float32 scalar 0 that varies over every manual mesh axis the operands do.

  Inside ``jax.shard_map`` a loop carry must keep its varying-axes type; fresh
  constants (``jnp.zeros``) vary over none, so loop inits add this zero.
  """
  zero = jnp.zeros((), jnp.float32)
  for x in jax.tree.leaves(operands):
    zero = zero + jnp.zeros_like(x, jnp.float32, shape=())
  return zero


def patterned(st: Static, ex: base.Head) -> bool:
  """Whether any entry can be blocked by a pattern or mask (static)."""
  return (st.bounds != (None, None) or st.s % st.bk != 0
          or any(x is not None for x in (ex.dense, ex.kv_lengths, ex.q_lengths,
                                         ex.q_segment_ids, ex.rule)))


def _block_logits(st: Static, qi, kj, i0, j0, ex: base.Head, place: Place,
                  full: bool, scale=None, want_vjp: bool = False,
                  want_jvp: bool = False):
  """Float32 logits of one block, where they are allowed, a VJP, raw logits.

  Logits are ``scale * q.k + bias``, then ``score_mod`` (a soft cap is one);
  ``raw`` is ``scale * q.k`` alone (the same array without either).
  ``ok`` is None when every entry is allowed, statically; ``full`` says the
  block is known to hold no blocked entry (no pattern or mask pass is
  made; ``-inf`` from a bias or ``score_mod`` still blocks). ``mod_vjp`` is
  the VJP of the score modifier in ``(raw logits, *its arrays)`` (when
  asked), or with ``want_jvp`` its JVP, ``mod_jvp(d_logits, d_arrays)``.
  Padded query rows (past ``T``) need no mask: their outputs are dropped
  and their cotangents are zero.
  """
  scale = st.scale if scale is None else scale
  logits = jnp.einsum("TH,SH->TS", qi, kj,
                      preferred_element_type=jnp.float32)  # [bq, bk]
  if scale != 1.0:
    logits = logits * scale
  raw = logits
  ok = None

  def both(extra):
    if extra is None:
      return ok
    return extra if ok is None else ok & extra

  rows = i0 + jnp.arange(st.bq)[:, None]  # [bq, 1]
  cols = j0 + jnp.arange(st.bk)[None, :]  # [1, bk]
  if ex.bias is not None:
    logits = logits + _tile(ex.bias, i0, j0, st.bq, st.bk).astype(jnp.float32)
    ok = both(logits > -jnp.inf)
  mod_vjp = None
  if st.score_mod is not None:
    # The values and indices vary over every mesh axis the scores do, as
    # in hoist_score_mod's trace (a shard_map-invariant argument would make
    # the VJP below all-reduce inside the block loop, whose trip count
    # differs between devices; the converted function replays primitives
    # that need their operands alike).
    varying = jnp.zeros_like(logits, shape=())
    vary = lambda x: x + varying.astype(x.dtype)  # noqa: E731
    q_idx, kv_idx = vary(rows + place.q_start), vary(cols + place.kv_start)
    b, h = map(vary, ex.index)
    consts = list(ex.mod_consts)
    if isinstance(st.score_mod, _Direct):  # (a replayed jaxpr varies its own)
      consts = list(map(vary, consts))

    def mod(score, *consts):
      return jnp.broadcast_to(st.score_mod(
          score, b, h, q_idx, kv_idx, *consts).astype(jnp.float32),
                              score.shape)

    safe = logits if ok is None else jnp.where(ok, logits, 0.0)
    if want_vjp:
      logits, mod_vjp = jax.vjp(mod, safe, *consts)
    elif want_jvp:
      primals = (safe, *consts)
      direct = isinstance(st.score_mod, _Direct)

      def mod_vjp(d, d_consts):  # (the tangents vary as their values do)
        d_consts = [vary(t) if direct and linear_map.inexact(t) else t
                    for t in d_consts]
        return jax.jvp(mod, primals, (d, *d_consts))[1]

      logits = mod(*primals)
    else:
      logits = mod(safe, *consts)
    if getattr(st.score_mod, "blocks", True):  # (a replayed closure may)
      ok = both(logits > -jnp.inf)
  if full:
    return logits, ok, mod_vjp, raw
  if st.s % st.bk:
    ok = both(cols < st.s)
  q_segment_ids = kv_segment_ids = None
  if ex.q_segment_ids is not None:
    q_segment_ids = jax.lax.dynamic_slice_in_dim(ex.q_segment_ids, i0, st.bq)[:, None]
    kv_segment_ids = jax.lax.dynamic_slice_in_dim(ex.kv_segment_ids, j0, st.bk)[None, :]
  ok = both(intervals.visible(rows, cols, place.offset, st.bounds,
                              ex.q_lengths, ex.kv_lengths, q_segment_ids,
                              kv_segment_ids))
  if ex.dense is not None:
    ok = both(_tile(ex.dense, i0, j0, st.bq, st.bk))
  if ex.rule is not None and not selection.exact_tables(ex.rule):
    ok = both(jnp.broadcast_to(ex.rule.mask_fn(
        *ex.index, rows + place.q_start, cols + place.kv_start),
                               (st.bq, st.bk)))
  return logits, ok, mod_vjp, raw


def masked_exp(logits, ok, shift, scale=1.0):
  """``exp((logits - shift) * scale)``, 0 where not ``ok`` (no inf - inf)."""
  if ok is None:
    return jnp.exp((logits - shift[:, None]) * scale)
  return jnp.where(
      ok, jnp.exp(jnp.where(ok, logits - shift[:, None], 0.0) * scale), 0.0)


def segment_summary(st: Static, ex: base.Head):
  """Per-block min/max segment ids ``(q_min, q_max, k_min, k_max)`` or None."""
  if ex.q_segment_ids is None:
    return None
  return (*intervals.block_min_max(ex.q_segment_ids, st.bq),
          *intervals.block_min_max(ex.kv_segment_ids, st.bk))


def _intersect(pattern, segments):
  """Pattern intervals ``(lo, hi, full_lo, full_hi)`` and the segment ones,
  the full blocks kept within the visited ones."""
  lo, hi, full_lo, full_hi = pattern
  a, b, c, d = segments
  lo, hi = jnp.maximum(lo, a), jnp.minimum(hi, b)
  full_lo, full_hi = jnp.maximum(full_lo, c), jnp.minimum(full_hi, d)
  hi = jnp.maximum(hi, lo)
  full_lo = jnp.clip(full_lo, lo, hi)
  return lo, hi, full_lo, jnp.clip(full_hi, full_lo, hi)


def key_ranges(st: Static, ex: base.Head, place: Place, seg, i, num_k: int):
  """Key blocks query block ``i`` visits, and the full ones among them."""
  ranges = intervals.key_blocks(st.bounds, i * st.bq, st.bq, st.bk, num_k,
                                place.offset, ex.kv_lengths, ex.q_lengths,
                                st.s)
  if seg is None:  # (no segment ids)
    return ranges
  q_min, q_max, k_min, k_max = seg
  return _intersect(ranges, intervals.segment_block_ranges(
      q_min[i], q_max[i], k_min, k_max))


def query_ranges(st: Static, ex: base.Head, place: Place, seg, j, num_q: int):
  """Query blocks that visit key block ``j``, and those that see all of it."""
  ranges = intervals.query_blocks(st.bounds, j * st.bk, st.bq, st.bk, num_q,
                                  place.offset, ex.kv_lengths, ex.q_lengths,
                                  st.s)
  if seg is None:  # (no segment ids)
    return ranges
  q_min, q_max, k_min, k_max = seg
  return _intersect(ranges, intervals.segment_block_ranges(
      k_min[j], k_max[j], q_min, q_max))


def _walk(st: Static, ex: base.Head, ranges, listed, count: int, body, carry):
  """Runs ``body(index, full, carry)`` over the blocks one block visits.

  ``ranges`` are ``key_ranges``' nested intervals; ``listed`` is a block mask's row
  ``(indices, full flags)`` or None. Empty blocks are never visited; full
  ones run the body without mask passes (``full=True``, static). A
  selection whose tables are exact (``selection.exact_tables``: every
  listed block wholly selected) is walked as the pattern alone would be:
  the ranges split its list into masked, full and masked runs.
  """
  if not patterned(st, ex):
    return jax.lax.fori_loop(0, count, lambda j, c: body(j, True, c), carry)
  lo, hi, full_lo, full_hi = ranges
  masked = lambda j, c: body(j, False, c)
  if listed is not None:  # the block mask's non-empty blocks in [lo, hi)
    indices, flags = listed
    first = jnp.searchsorted(indices, lo)
    last = jnp.searchsorted(indices, hi)
    if ex.dense is None and selection.exact_tables(ex.rule):
      # Every listed block is wholly selected: the pattern's ranges alone
      # say which need a mask pass, so no per-block choice (under the
      # heads' vmap a cond would run both bodies).
      at = lambda f: lambda n, c: f(indices[n], c)  # noqa: E731
      mid_lo = jnp.searchsorted(indices, full_lo)
      mid_hi = jnp.searchsorted(indices, full_hi)
      carry = jax.lax.fori_loop(first, mid_lo, at(masked), carry)
      carry = jax.lax.fori_loop(
          mid_lo, mid_hi, at(lambda j, c: body(j, True, c)), carry)
      return jax.lax.fori_loop(mid_hi, last, at(masked), carry)

    def step(n, c):
      j = indices[n]
      if ex.dense is not None:
        return masked(j, c)
      full = flags[n] & (j >= full_lo) & (j < full_hi)
      return jax.lax.cond(full, lambda c: body(j, True, c),
                          lambda c: masked(j, c), c)

    return jax.lax.fori_loop(first, last, step, carry)
  rule_only = ex.rule is not None  # a rule without tables (ring)
  if ex.dense is not None or rule_only:  # every visited block is checked
    return jax.lax.fori_loop(lo, hi, masked, carry)
  carry = jax.lax.fori_loop(lo, full_lo, masked, carry)
  carry = jax.lax.fori_loop(full_lo, full_hi,
                            lambda j, c: body(j, True, c), carry)
  return jax.lax.fori_loop(full_hi, hi, masked, carry)


def _online_block(st: Static, ex: base.Head, place: Place, k, v, qi, i0,
                  drop, drop_rows, defer: bool, raw_carry: bool, j, full,
                  carry):
  """One key block of ``forward``'s online softmax: the carry (row maxima,
  row sums, accumulated values ``[bq, Hv]``, codes, raw maxima when kept)
  after key block ``j``; ``full`` (static) says it needs no mask pass."""
  later = st.scale if defer else 1.0
  row_max, total, acc, code, *raw_max = carry
  j0 = j * st.bk
  kj, k_bad = _key_rows(st, k, j0, ex.kv_lengths)  # [bk, H]
  vj, v_bad = _key_rows(st, v, j0, ex.kv_lengths)  # [bk, Hv]
  if ex.kv_code is None:  # reduce the loaded block (ring: keys travel)
    bad = jnp.where(k_bad, checks.BAD_KEY, jnp.where(
        v_bad, checks.BAD_VALUE, checks.CLEAN))  # [bk]
  else:  # the head's codes (a row reduction per loaded block costs more
    # than the block's other work on XLA:CPU; then dead code). Keys past
    # the length need no clearing: a full block lies below it, and a
    # partial block's `ok` leaves them out.
    bad = jax.lax.dynamic_slice_in_dim(ex.kv_code, j0, st.bk)  # [bk]
  logits, ok, _, raw = _block_logits(st, qi, kj, i0, j0, ex, place, full,
                                     scale=1.0 if defer else None)
  bad = bad[None, :]  # [1, bk]
  if ok is None:  # every row sees every column
    code = jnp.maximum(code, jnp.max(bad))
  else:  # a [bq, bk] pass, made only when there is garbage
    seen = lambda c, ok, bad: jnp.maximum(c, jnp.max(  # noqa: E731
        jnp.where(ok, bad, checks.CLEAN), -1))
    code = seen(code, ok, bad) if ex.garbage is None else jax.lax.cond(
        ex.garbage, seen, lambda c, ok, bad: c, code, ok, bad)  # [bq]
  if raw_carry:
    seen = raw if ok is None else jnp.where(ok, raw, -jnp.inf)
    raw_max = [jnp.maximum(raw_max[0], jnp.max(seen, -1))]  # [bq]
  allowed = logits if ok is None else jnp.where(ok, logits, -jnp.inf)
  new_max = jnp.maximum(row_max, jnp.max(allowed, -1))  # [bq]
  shift = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
  p = masked_exp(logits, ok, shift, later)  # [bq, bk]
  rescale = jnp.exp((row_max - shift) * later)  # 0 while row_max = -inf
  total = total * rescale + p.sum(-1)
  if drop is not None:  # the dropped probabilities meet the values
    p = jnp.where(drop.keep(drop_rows, place, j0, st.bk), p, 0.0)
  acc = acc * rescale[:, None] + jnp.einsum(
      "TS,SV->TV", p.astype(v.dtype), vj, preferred_element_type=jnp.float32)
  return new_max, total, acc, code, *raw_max


def _row_results(st: Static, carry, q_bad, drop, later, raw_carry: bool):
  """A query block's ``(out [bq, Hv], lse, max_logits or None, code)``
  from the walk's final carry."""
  row_max, total, acc, code, *raw_max = carry
  max_logits = None
  if st.max_logits:  # raw_max, or row_max in raw-logit units
    max_logits = raw_max[0] if raw_carry else row_max * later
  seen = total > 0
  out = acc / jnp.where(seen, total, 1.0)[:, None]
  if drop is not None:
    out = out * drop.inverse
  lse = jnp.where(seen, jnp.where(jnp.isfinite(row_max), row_max, 0.0)
                  * later + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
  # A bad query spoils its row where it sees a key (seen: total >= 1).
  code = jnp.maximum(code, jnp.where(seen & q_bad, checks.BAD_KEY,
                                     checks.CLEAN))
  return out, lse, max_logits, code


def forward(st: Static, q, k, v, ex: base.Head, place: Place,
            drop: Dropout | None = None):
  """Online softmax; ``(out [Tp, Hv], lse [Tp], max_logits [Tp] or None,
  code [Tp])``.

  With ``drop`` the probabilities meet the values through the block's keep
  mask, scaled by ``1 / (1 - rate)`` (inverted dropout); the row sums and
  ``lse`` are those without dropout.

  All float32; ``max_logits`` only with ``st.max_logits``; ``code`` each
  row's ``checks`` code: the largest of the keys it attends to (a NaN
  or inf in a key or its value) and of its own query if it attends to any.
  """
  num_q, num_k = q.shape[0] // st.bq, k.shape[0] // st.bk
  hv = v.shape[-1]
  # Without a bias or score modifier, softmax(scale * l) is computed on the
  # raw logits l with the scale applied inside exp(): max(scale * l) =
  # scale * max(l) for scale > 0, and XLA:CPU then runs no separate multiply
  # pass over each [bq, bk] block (it would not fuse it into the dot). Row
  # maxima are in raw-logit units; lse is converted back at the end.
  defer = (ex.bias is None and st.score_mod is None
           and st.scale > 0)
  later = st.scale if defer else 1.0
  # max_logits: without a bias or score modifier the running maximum is
  # the raw one (times `later`); otherwise a second carry keeps it.
  raw_carry = st.max_logits and not (ex.bias is None
                                     and st.score_mod is None)
  seg = None if ex.q_segment_ids is None else segment_summary(st, ex)
  zero = _zero_like_all(q, k, v, ex, place)

  def query_block(i):
    i0 = i * st.bq
    qi, q_bad = _finite(jax.lax.dynamic_slice_in_dim(q, i0, st.bq))  # [bq, H]
    if ex.q_code is not None:  # (then the reduction above is dead code)
      q_bad = jax.lax.dynamic_slice_in_dim(ex.q_code, i0, st.bq) > 0
    drop_rows = None if drop is None else drop.rows(ex, place, i0, st.bq)
    key_block = functools.partial(_online_block, st, ex, place, k, v, qi, i0,
                                  drop, drop_rows, defer, raw_carry)
    init = (jnp.full((st.bq,), -jnp.inf, jnp.float32) + zero,
            jnp.zeros((st.bq,), jnp.float32) + zero,
            jnp.zeros((st.bq, hv), jnp.float32) + zero,
            jnp.zeros((st.bq,), jnp.float32) + zero)
    if raw_carry:
      init += (init[0],)
    listed = None
    if ex.rule is not None and ex.rule.kinds is not None:
      listed = (ex.rule.kv_indices[i], ex.rule.kv_full[i])
    ranges = key_ranges(st, ex, place, seg, i, num_k)
    carry = _walk(st, ex, ranges, listed, num_k, key_block, init)
    return _row_results(st, carry, q_bad, drop, later, raw_carry)

  out, lse, max_logits, code = jax.lax.map(query_block, jnp.arange(num_q))
  if max_logits is not None:
    max_logits = max_logits.reshape(-1)
  return out.reshape(-1, hv), lse.reshape(-1), max_logits, code.reshape(-1)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _attend(st: Static, q, k, v, ex: base.Head, place: Place,
            drop: Dropout | None):
  out, lse, max_logits, code = forward(st, q, k, v, ex, place, drop)
  return out.astype(v.dtype), lse, max_logits, code


@functools.partial(_attend.defjvp, symbolic_zeros=True)
def _attend_jvp(st, primals, tangents):
  """Both modes of AD through one rule (``core/linear_map.py``).

  The outputs' tangent is ``linear_map(tangent, transpose)``: forward mode
  runs ``tangent`` (a second blockwise pass over the saved ``lse``);
  reverse mode transposes it, which runs ``backward``, the
  FlashAttention-2 backward, on the same residuals. Inputs JAX knows to
  be unperturbed (symbolic zeros: ``jax.jacfwd(f, argnums=0)`` leaves
  keys and values constant) are no linear inputs at all, so the tangent
  pass makes none of their dots.
  """
  q, k, v, ex, place, drop = primals
  dq, dk, dv, d_ex = tangents[:4]
  out, lse, max_logits, code = _attend(st, q, k, v, ex, place, drop)
  residuals = (q, k, v, ex, place, drop, out, lse)
  linear = (_perturbed(dq), _rows_tangent(k, dk), _rows_tangent(v, dv),
            None if ex.bias is None else _perturbed(d_ex.bias),
            const_tangents(ex.mod_consts, d_ex.mod_consts))
  zeros = lambda x: None if x is None else jnp.zeros_like(x)  # noqa: E731
  if not jax.tree.leaves(linear):  # (only a dropout rate, say, perturbed)
    d_out, d_lse = zeros(out), zeros(lse)
  else:
    present = jax.tree.map(lambda x: x is not None, linear,
                           is_leaf=lambda x: x is None)
    d_out, d_lse = linear_map.linear_map(
        functools.partial(tangent, st),
        functools.partial(_transpose, st, present), residuals, linear,
        outputs=(jax.ShapeDtypeStruct(out.shape, out.dtype),  # [Tp, Hv]
                 jax.ShapeDtypeStruct(lse.shape, jnp.float32)))  # [Tp]
  return (out, lse, max_logits, code), (d_out, d_lse, zeros(max_logits),
                                        zeros(code))


def _perturbed(t):
  """A tangent, or None for JAX's symbolic zero (an unperturbed input)."""
  return None if isinstance(t, jax.custom_derivatives.SymbolicZero) else t


def const_tangents(consts, d_consts):
  """The score modifier's arrays' tangents as ``linear_map`` takes them:
  None for an integer array (it has none) or an unperturbed one."""
  return tuple(_perturbed(d) if linear_map.inexact(c) else None
               for c, d in zip(consts, d_consts))


def const_cotangents(consts, d_consts):
  """Their cotangents in that structure, each in its array's dtype."""
  return tuple(d.astype(c.dtype) if linear_map.inexact(c) else None
               for c, d in zip(consts, d_consts))


def _rows_tangent(x, dx):
  """The tangent of keys or values as ``linear_map`` takes it: the array's,
  or a paged pool's (None for a quantised pool: a store, not a parameter;
  None for an unperturbed one)."""
  if isinstance(x, PagedRows):
    return None if x.scales is not None else _perturbed(dx.pool)
  return _perturbed(dx)


def _transpose(st: Static, present, residuals, cotangents):
  """The transpose of ``tangent``: ``backward``'s cotangents, in the
  structure of ``tangent``'s linear inputs (``present``: True where there
  is one; None where its tangent was a symbolic zero)."""
  q, k, v, ex, place, drop, out, lse = residuals
  d_out, d_lse = cotangents
  dq, dk, dv, dbias, dargs = backward(st, (q, k, v, ex, place, out, lse),
                                      (d_out, d_lse), drop)

  def rows(x, dx):
    if isinstance(x, PagedRows):  # gradients into the pool, page by page
      return None if x.scales is not None else x.cotangent(dx).pool
    return dx.astype(x.dtype)

  full = (dq.astype(q.dtype), rows(k, dk), rows(v, dv),
          None if ex.bias is None else dbias.astype(ex.bias.dtype),
          const_cotangents(ex.mod_consts, dargs))
  return jax.tree.map(lambda keep, d: d if keep else None, present, full,
                      is_leaf=lambda x: x is None)


def tangent(st: Static, residuals, linear):
  """Forward-mode AD: ``(d_out [Tp, Hv], d_lse [Tp])`` from the tangents
  ``linear = (dq, dk, dv, dbias, dargs)`` (None: zero) at ``residuals =
  (q, k, v, ex, place, drop, out, lse)``.

  With ``P = exp(S - lse)`` (the saved lse: no running maximum) and ``dS``
  the logits' tangent (``scale (dq k + q dk)`` and ``dbias``, through
  ``score_mod``'s JVP with its arrays' tangents), the softmax's tangent is
  ``P * (dS - m)`` with ``m = rowsum(P * dS)``, so that

      d_out = (P' * dS) @ v + P' @ dv - m * out,    d_lse = m,

  ``P'`` the probabilities as they met the values (dropped and scaled
  under dropout; ``m`` uses ``P``). One walk over the blocks the forward
  visited, one ``[bq, bk]`` block at a time.
  """
  q, k, v, ex, place, drop, out, lse = residuals
  dq, dk, dv, dbias, dargs = linear
  f32 = jnp.float32
  num_q, num_k = q.shape[0] // st.bq, k.shape[0] // st.bk
  hv = v.shape[-1]
  # A row that sees nothing (lse = -inf) gets exp(logits - inf) = 0: no
  # [bq, bk] pass to leave it out of a block that needs no mask.
  lse_safe = jnp.where(jnp.isfinite(lse), lse, jnp.inf)
  seg = segment_summary(st, ex)
  zero = _zero_like_all(q, k, v, ex, place, out, lse, linear)
  # Whether the logits have a tangent (else dS = 0: no dS dots, and no
  # (P * dS) @ v; only the values' term P @ dv).
  logits_move = (dq is not None or dk is not None or dbias is not None
                 or any(d is not None for d in dargs))
  if dk is not None and isinstance(k, PagedRows):
    dk = k._replace(pool=dk, scales=None, finite=None)
  if dv is not None and isinstance(v, PagedRows):
    dv = v._replace(pool=dv, scales=None, finite=None)

  def query_block(i):
    i0 = i * st.bq
    qi, _ = _finite(jax.lax.dynamic_slice_in_dim(q, i0, st.bq))  # [bq, H]
    dqi = None if dq is None else jax.lax.dynamic_slice_in_dim(
        dq, i0, st.bq).astype(f32)
    lse_i = jax.lax.dynamic_slice_in_dim(lse_safe, i0, st.bq)
    drop_rows = None if drop is None else drop.rows(ex, place, i0, st.bq)

    def key_block(j, full, carry):
      acc, m = carry
      j0 = j * st.bk
      kj, _ = _key_rows(st, k, j0, ex.kv_lengths)  # [bk, H]
      vj, _ = _key_rows(st, v, j0, ex.kv_lengths)  # [bk, Hv]
      logits, ok, mod_jvp, _ = _block_logits(
          st, qi, kj, i0, j0, ex, place, full,
          want_jvp=st.score_mod is not None)
      p = masked_exp(logits, ok, lse_i)  # [bq, bk]
      pds = None  # P * dS, None while the logits have no tangent
      if logits_move:
        ds = jnp.zeros_like(p)
        if dqi is not None:
          ds = ds + jnp.einsum("TH,SH->TS", dqi, kj.astype(f32))
        if dk is not None:
          dkj, _ = _key_rows(st, dk, j0, ex.kv_lengths)
          ds = ds + jnp.einsum("TH,SH->TS", qi.astype(f32), dkj.astype(f32))
        ds = ds * st.scale
        if dbias is not None:
          ds = ds + _tile(dbias, i0, j0, st.bq, st.bk).astype(f32)
        if mod_jvp is not None:
          ds = mod_jvp(ds, tuple(
              linear_map.zero_tangent(c) if d is None else d
              for c, d in zip(ex.mod_consts, dargs)))
        if ok is not None:  # (blocked: no probability, any tangent)
          ds = jnp.where(ok, ds, 0.0)
        pds = p * ds
        m = m + pds.sum(-1)
      if drop is not None:  # both meet the values dropped
        keep = drop.keep(drop_rows, place, j0, st.bk)
        p, pds = (None if x is None else jnp.where(keep, x, 0.0) * drop.inverse
                  for x in (p, pds))
      if pds is not None:
        acc = acc + jnp.einsum("TS,SV->TV", pds, vj.astype(f32))
      if dv is not None:
        dvj, _ = _key_rows(st, dv, j0, ex.kv_lengths)
        acc = acc + jnp.einsum("TS,SV->TV", p, dvj.astype(f32))
      return acc, m

    init = (jnp.zeros((st.bq, hv), f32) + zero, jnp.zeros((st.bq,), f32) + zero)
    listed = None
    if ex.rule is not None and ex.rule.kinds is not None:
      listed = (ex.rule.kv_indices[i], ex.rule.kv_full[i])
    ranges = key_ranges(st, ex, place, seg, i, num_k)
    acc, m = _walk(st, ex, ranges, listed, num_k, key_block, init)
    out_i = jax.lax.dynamic_slice_in_dim(out, i0, st.bq).astype(f32)
    return acc - m[:, None] * out_i, m

  d_out, d_lse = jax.lax.map(query_block, jnp.arange(num_q))
  return d_out.reshape(-1, hv).astype(out.dtype), d_lse.reshape(-1)


def backward(st, residuals, cotangents, drop: Dropout | None = None):
  """FlashAttention-2 backward; float32 ``(dq, dk, dv, dbias, dargs)``.

  With ``drop`` each block's keep mask is drawn again: the values'
  gradient takes the dropped probabilities, and the probabilities' the
  dropped ``d_out @ v.T`` (``delta = rowsum(d_out * out)`` holds as is:
  ``out`` is the dropped output).

  ``dargs`` are the cotangents of the values ``score_mod`` closes over
  (``ex.mod_consts``, a tuple).
  ``out`` and ``lse`` in ``residuals`` may be those of a longer key sequence
  of which ``k``/``v`` are one block (ring attention): ``P = exp(S - lse)``
  are then that block's share of the global probabilities, and the returned
  gradients are its share of the global ones. Blocks are made finite as
  they are loaded (``_finite``); an entry that was not finite gets
  gradient 0 once every row that sees it has a zero cotangent (as
  ``single_head``'s poisoned rows do).
  """
  q, k, v, ex, place, out, lse = residuals
  d_out, d_lse = cotangents  # (max_logits has no cotangent here)
  f32 = jnp.float32
  num_q, num_k = q.shape[0] // st.bq, k.shape[0] // st.bk
  d_out = d_out.astype(f32)
  delta = jnp.sum(d_out * out.astype(f32), -1) - d_lse  # [Tp]
  row_ok = jnp.isfinite(lse)
  lse_safe = jnp.where(row_ok, lse, 0.0)
  seg = segment_summary(st, ex)
  zero = _zero_like_all(q, k, v, ex, place, d_out, lse)

  def key_block(carry, j):
    dq, dbias, dargs = carry
    j0 = j * st.bk
    kj, _ = _key_rows(st, k, j0, ex.kv_lengths)
    vj, _ = _key_rows(st, v, j0, ex.kv_lengths)

    def query_block(i, full, inner):
      dkj, dvj, dq, dbias, dargs = inner
      i0 = i * st.bq
      qi, _ = _finite(jax.lax.dynamic_slice_in_dim(q, i0, st.bq))
      doi = jax.lax.dynamic_slice_in_dim(d_out, i0, st.bq)
      keep = None
      if drop is not None:
        keep = drop.keep(drop.rows(ex, place, i0, st.bq), place, j0, st.bk)
      logits, ok, mod_vjp, _ = _block_logits(
          st, qi, kj, i0, j0, ex, place, full,
          want_vjp=st.score_mod is not None)
      if ok is not None:  # rows with nothing to attend have lse = -inf
        ok = ok & jax.lax.dynamic_slice_in_dim(row_ok, i0, st.bq)[:, None]
      lse_i = jax.lax.dynamic_slice_in_dim(lse_safe, i0, st.bq)
      p = masked_exp(logits, ok, lse_i)  # [bq, bk]
      dropped = p if keep is None else jnp.where(keep, p, 0.0) * drop.inverse
      dvj = dvj + jnp.einsum("TS,TV->SV", dropped, doi)
      dp = jnp.einsum("TV,SV->TS", doi, vj.astype(f32))
      if keep is not None:
        dp = jnp.where(keep, dp, 0.0) * drop.inverse
      ds = p * (dp - jax.lax.dynamic_slice_in_dim(delta, i0, st.bq)[:, None])
      if mod_vjp is not None:  # back through score_mod, to its values too
        ds, *d_consts = mod_vjp(ds)
        dargs = tuple(acc + d.astype(f32) for acc, d in zip(dargs, d_consts))
      dkj = dkj + jnp.einsum("TS,TH->SH", ds, qi.astype(f32)) * st.scale
      dqi = jnp.einsum("TS,SH->TH", ds, kj.astype(f32)) * st.scale
      dq = jax.lax.dynamic_update_slice_in_dim(
          dq, jax.lax.dynamic_slice_in_dim(dq, i0, st.bq) + dqi, i0, 0)
      if dbias is not None:
        dbias = _add_tile(dbias, ds, i0, j0)
      return dkj, dvj, dq, dbias, dargs

    init = (jnp.zeros(kj.shape, f32) + zero, jnp.zeros(vj.shape, f32) + zero,
            dq, dbias, dargs)
    listed = None
    if ex.rule is not None and ex.rule.kinds is not None:
      listed = (ex.rule.q_indices[j], ex.rule.q_full[j])
    ranges = query_ranges(st, ex, place, seg, j, num_q)
    dkj, dvj, dq, dbias, dargs = _walk(st, ex, ranges, listed, num_q,
                                       query_block, init)
    return (dq, dbias, dargs), (dkj, dvj)

  dbias0 = None if ex.bias is None else jnp.zeros(ex.bias.shape, f32) + zero
  dargs0 = tuple(jnp.zeros(c.shape, f32) + zero for c in ex.mod_consts)
  (dq, dbias, dargs), (dk, dv) = jax.lax.scan(
      key_block, (jnp.zeros(q.shape, f32) + zero, dbias0, dargs0),
      jnp.arange(num_k))
  return dq, dk.reshape(k.shape), dv.reshape(v.shape), dbias, dargs  # [Sp, H]


def static(t: int, s: int, *, scale, is_causal, block_q, block_k,
           window=None, score_mod=None, max_logits: bool = False) -> Static:
  """One head's static config for ``T = t`` queries over ``S = s`` keys."""
  return Static(float(scale), intervals.bounds(bool(is_causal), window),
                score_mod, t, s, min(block_q, t), min(block_k, s),
                bool(max_logits))


def padded_head(st: Static, tp: int, sp: int, h: base.Head
                ) -> base.Head:
  """A head's operands padded to whole blocks (segment ids edge-padded;
  a block mask's tables as arrays, indexed by traced blocks)."""
  fields = {}  # (only those the call sets)
  if h.dense is not None:
    fields["dense"] = pad_axis(pad_axis(h.dense, 0, tp, False), 1, sp, False)
  if h.bias is not None:
    fields["bias"] = pad_axis(pad_axis(h.bias, 0, tp, 0.0), 1, sp, 0.0)
  if h.q_segment_ids is not None:
    fields["q_segment_ids"] = _edge_pad(h.q_segment_ids, tp)
    fields["kv_segment_ids"] = _edge_pad(h.kv_segment_ids, sp)
  if h.rule is not None:
    fields["rule"] = jax.tree.map(jnp.asarray, h.rule)
  return h._replace(**fields)


@dataclasses.dataclass(frozen=True)
class _Direct:
  """A score modifier called with its parameters as explicit leaves.

  ``fn(score, b, h, q_idx, kv_idx, params)``, e.g. a ``ScoreMod``'s.

  Hashable (a ``Static`` field): the function and the parameters' tree
  structure, not the arrays, which travel in ``Head.mod_consts``.
  """
  fn: Callable[..., jax.Array]  # fn(score, b, h, q_idx, kv_idx, params)
  treedef: Any
  blocks: bool = True  # whether fn may write -inf (ScoreMod.blocks)

  def __call__(self, score, b, h, q_idx, kv_idx, *leaves):
    return self.fn(score, b, h, q_idx, kv_idx,
                   jax.tree.unflatten(self.treedef, leaves))


def hoist_score_mod(st: Static, ex: base.Head, like, *,
                    replay_closures: bool = True) -> tuple[Static, base.Head]:
  """``score_mod`` with every array it uses made an operand of the kernel.

  A custom VJP cannot differentiate a closure over a traced value (JAX
  raises an ``UnexpectedTracerError``). An ``aj.ScoreMod``'s parameters are
  passed as explicit leaves (``_Direct``). Traced values a function closes
  over besides are found with ``jax.closure_convert`` (traced at this
  kernel's block shapes, ``like`` giving the example arguments the mesh
  axes the scores vary over) and, with ``replay_closures``, passed too: the
  converted function replays the traced program. Without it (ring
  attention, whose replay would mix invariant and device-varying values)
  such a closure is refused with the fix. Either way ``st.score_mod``
  becomes hashable and takes ``(score, b, h, q_idx, kv_idx, *consts)``.
  """
  mod = st.score_mod
  if mod is None:
    return st, ex
  blocks = True
  if isinstance(mod, score_mods.ScoreMod):
    fn, params, blocks = mod.fn, mod.params, mod.blocks
  else:
    fn, params = functools.partial(score_mods.plain_fn, mod), None
  leaves, treedef = jax.tree.flatten(params)
  direct = _Direct(fn, treedef, blocks)
  zero = jnp.zeros_like(like, jnp.int32, shape=())
  example = lambda shape, dtype: jnp.zeros(shape, dtype) + zero.astype(  # noqa: E731
      dtype)
  i32 = jnp.int32
  replayed, hidden = jax.closure_convert(
      lambda *a: direct(*a), example((st.bq, st.bk), jnp.float32),
      example((), i32), example((), i32), example((st.bq, 1), i32),
      example((1, st.bk), i32), *leaves)
  if not hidden:
    return st._replace(score_mod=direct), ex._replace(
        mod_consts=tuple(leaves))
  if not replay_closures:
    raise ValueError(
        f"score_mod closes over {len(hidden)} traced array(s) (shapes "
        f"{[tuple(jnp.shape(c)) for c in hidden]}) that ring_attention "
        "cannot carry round the ring as a closure: pass them explicitly, "
        "aj.ScoreMod(lambda score, b, h, q_idx, kv_idx, params: ..., "
        "params), and they are differentiated (their gradients summed over "
        "the devices).")
  return st._replace(score_mod=replayed), ex._replace(
      mod_consts=tuple(leaves) + tuple(hidden))


def single_head(q, k, v, h, garbage=None, seed=None, rate=None, *,
                out_dtype, **blocks):
  """One head (``base.Head`` operands): pad, attend, strip, sink.

  ``garbage``: ``base.Head.garbage``; ``seed``/``rate``: the call's
  dropout (``Dropout``), or None. Returns ``(out, None, lse)``, and
  ``max_logits [T]`` too with ``max_logits=True`` among ``blocks``.
  """
  if h.dense is not None:  # keys no query sees (finite garbage): zero them
    k, v = checks.zero_unseen(jnp.any(h.dense, axis=0), k, v)  # [S|1]
  st = static(q.shape[0], k.shape[0], **blocks)
  tp, sp = -(-st.t // st.bq) * st.bq, -(-st.s // st.bk) * st.bk  # whole
  if (tp, sp) != (st.t, st.s):  # blocks: q, k, v padded with zeros
    q, k, v = pad_axis(q, 0, tp, 0), pad_axis(k, 0, sp, 0), pad_axis(
        v, 0, sp, 0)
  q_code, kv_code = checks.codes(q, k, v)  # [Tp], [Sp]: once per head
  ex = padded_head(st, q.shape[0], k.shape[0], h)._replace(
      garbage=garbage, q_code=q_code, kv_code=kv_code)
  drop = None if seed is None else Dropout(seed, rate)
  return _attend_head(st, q, k, v, ex, h, out_dtype, drop)


def paged_head(q, k: PagedRows, v: PagedRows, h, drop=None, *, out_dtype,
               **blocks):
  """One head over a paged cache's pages (``PagedRows``), key blocks of
  whole pages (``block_k`` a multiple of the page size dividing the row's
  ``M * Z``); as ``single_head`` otherwise.

  Keys and values are never padded or gathered: each key block loads its
  page, zero past the head's ``kv_lengths`` (which a paged call has), and
  the block ranges visit only the pages below it that the pattern lets a
  query block see. Garbage is looked for in each loaded block (the
  per-head codes of ``single_head`` would read the whole pool).
  """
  st = static(q.shape[0], k.shape[0], **blocks)
  q = pad_axis(q, 0, -(-st.t // st.bq) * st.bq, 0)  # whole blocks
  ex = padded_head(st, q.shape[0], k.shape[0], h)
  return _attend_head(st, q, k, v, ex, h, out_dtype, drop)


def _attend_head(st: Static, q, k, v, ex: base.Head, h, out_dtype,
                 drop: Dropout | None = None):
  """The differentiable walk of one padded head, stripped, sinks,
  poisoned."""
  if st.score_mod is not None:
    st, ex = hoist_score_mod(st, ex, q)
  out, lse, max_logits, code = _attend(st, q, k, v, ex,
                                       Place(*h.offsets(st.t, st.s)), drop)
  out, lse, code = out[:st.t], lse[:st.t], code[:st.t]
  if h.sink is not None:
    out, _, lse = checks.with_sink(out, lse, h.sink, h.q_lengths)
  if st.max_logits:  # the sink is no logit of a key: it changes nothing
    max_logits = max_logits[:st.t]
  # NaN or inf reaches only the rows that may see it (the walk's codes):
  # poisoned after the custom VJP, those rows pass no cotangent back.
  out, lse, max_logits = checks.poison(code, out.astype(out_dtype), lse,
                                         max_logits)
  if st.max_logits:
    return out, None, lse, max_logits
  return out, None, lse


# Heads run in groups whose blocks hold together at most this many
# entries (4 MiB of float32 logits): see head_group.
HEAD_GROUP_ENTRIES = 1 << 20


def head_group(heads: int, t: int, s: int, block_q: int, block_k: int) -> int:
  """How many heads' block walks run together (0: all, under ``vmap``).

  Under ``vmap`` every pass of the block loop (the logits dot, the row
  maximum, ``exp``, the row sum, the values dot, and the backward's) works
  on the blocks of all heads at once, written and read back through memory
  by each pass. Heads run ``g`` at a time instead (``lax.map`` with
  ``vmap`` inside), ``g`` such that ``g`` blocks fit in cache yet ``g`` is
  large enough for XLA to split each op over the cores (docs/performance.md,
  "Default blocks").
  """
  g = max(1, HEAD_GROUP_ENTRIES // (min(t, block_q) * min(s, block_k)))
  return 0 if g >= heads else g


def block_sizes(ops, block_q, block_k) -> tuple[int, int]:
  """The block sizes of a call: the caller's, the block mask's, or the rule.

  Fine patterns (windows, segment ids) take small blocks, so that skipping
  and full blocks bite at their edges; plain causal takes 512 x 256; the
  rest 1024 x 256 (fewer, larger matmuls). XLA:CPU runs a dot of a small
  per-head block on one core, so finer blocks would lose more than they
  skip. A block mask fixes its own sizes; a rule without tables (built at
  these sizes) takes 512 x 256, or the window's or segment ids' blocks with
  one. The measurements: docs/performance.md, "Default blocks".
  """
  bm = ops.rule
  if bm is not None and bm.kinds is not None:
    for size_name, given, own in (("block_q", block_q, bm.block_q),
                                  ("block_k", block_k, bm.block_k)):
      if given is not None and given != own:
        raise ValueError(
            f"{size_name}={given} differs from the block mask's {own}: "
            f"build it with block_mask(..., {size_name}={given}) or leave "
            f"{size_name} unset.")
    return bm.block_q, bm.block_k
  # Small blocks waste little at a window's edges; 16 or more heads'
  # blocks together still make ops XLA splits over the cores.
  many_heads = math.prod(ops.query.shape[:-2]) >= 16
  if ops.q_segment_ids is not None:
    rule = (256, 256)
  elif ops.window is not None:
    rule = (128, 128) if many_heads else (256, 256)
  elif bm is not None or ops.causal:  # (each measured: docs/performance.md)
    rule = (512, 256)
  else:
    rule = (1024, 256)
  return (rule[0] if block_q is None else block_q,
          rule[1] if block_k is None else block_k)
