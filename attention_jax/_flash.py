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

Internal interface (what ``blockwise.py`` and ``ring.py`` use; nothing else
of this module is imported elsewhere):

* ``Static``: the static configuration of one head (scale, causality, true
  lengths, block sizes); hashable, a ``nondiff_argnums`` of custom VJPs.
* ``padded(q, k, v, *, scale, is_causal, block_q, block_k, window,
  softcap)``: builds the ``Static`` and pads q, k, v to whole blocks.
* ``forward(st, q, k, v, mask, bias, length, q_length, offset)``: float32
  ``(out [Tp, Hv], lse [Tp])`` of padded operands.
* ``backward(st, residuals, cotangents)``: float32 ``(dq, dk, dv, dbias)``
  from ``residuals = (q, k, v, mask, bias, length, q_length, offset, out,
  lse)`` and
  ``cotangents = (d_out, d_lse)``; ``out``/``lse`` may be those of a longer
  key sequence of which ``k``/``v`` are one block (ring attention).
* ``single_head(q, k, v, mask, bias, length, q_length, *, out_dtype,
  scale, is_causal, block_q, block_k, window, softcap)``: one head end to
  end, differentiable (``jax.custom_vjp``, gradients through ``lse`` too);
  returns
  ``(out [T, Hv], None, lse [T])``, the ``_broadcast.lift_heads`` contract.
* ``validate(name, query, key, value, mask, bias, key_value_seq_lengths,
  query_seq_lengths, local_window_size, logits_soft_cap, block_q, block_k,
  scale)``: the checks every flash entry point shares; returns
  ``(operands, scale, window, out_dtype)``.

Operands: ``mask`` bool and ``bias`` float are ``[T|1, S|1]`` (size-1 axes
broadcast), ``length``/``q_length`` int32 scalars (valid keys / queries) or
None. Causality and windows are written with an ``offset`` (``_patterns``):
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

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from attention_jax import _checks
from attention_jax import _numerics
from attention_jax import _patterns


class Static(NamedTuple):
  scale: float
  bounds: _patterns.Bounds  # causal and window bounds (None = open)
  softcap: float | None  # logits -> softcap * tanh(logits / softcap)
  t: int  # true (unpadded) lengths
  s: int
  bq: int
  bk: int


def _cdiv(a, b):
  return -(-a // b)


def pad_axis(x, axis: int, size: int, value):
  """Pads ``axis`` of ``x`` up to ``size``; size-1 (broadcast) axes stay."""
  if x is None or x.shape[axis] in (1, size):
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad, constant_values=value)


def _tile(x, i0, j0, bq: int, bk: int):
  """The ``[bq, bk]`` block of a ``[T|1, S|1]`` operand at ``(i0, j0)``."""
  rows, cols = x.shape
  block = jax.lax.dynamic_slice(
      x, (i0 if rows != 1 else 0, j0 if cols != 1 else 0),
      (bq if rows != 1 else 1, bk if cols != 1 else 1))
  return jnp.broadcast_to(block, (bq, bk))


def _key_rows(st: Static, x, j0, length):
  """Rows ``[j0, j0 + bk)`` of keys or values, zero past ``length``.

  Zeroing (not just masking the logits) keeps NaN or inf in padded key/value
  positions out of ``p @ v`` and of the gradients (0 * NaN is NaN). Rows past
  ``S`` are already the zeros ``_single_head`` padded with.
  """
  rows = jax.lax.dynamic_slice_in_dim(x, j0, st.bk)
  if length is None:
    return rows
  valid = j0 + jnp.arange(st.bk) < length
  return jnp.where(valid[:, None], rows, jnp.zeros_like(rows))


def _zero_like_all(*operands):
  """A float32 scalar 0 that varies over every manual mesh axis the operands do.

  Inside ``jax.shard_map`` a loop carry must keep its varying-axes type; fresh
  constants (``jnp.zeros``) vary over none, so loop inits add this zero.
  """
  zero = jnp.zeros((), jnp.float32)
  for x in operands:
    if x is not None:
      zero = zero + jnp.zeros_like(x, jnp.float32, shape=())
  return zero


def _block_logits(st: Static, qi, kj, i0, j0, mask, bias, length, q_length,
                  offset, scale=None):
  """Float32 logits of one block, where they are allowed, the cap's slope.

  Logits are ``scale * q.k + bias``, then soft-capped. ``ok`` is None when
  every entry is allowed, statically: the common unmasked case then pays
  for no mask passes over the block. ``dcap`` is ``d capped / d raw`` (None
  without a cap). Padded query rows (past ``T``) need no mask: their
  outputs are dropped and their cotangents are zero.
  """
  scale = st.scale if scale is None else scale
  logits = jnp.einsum("TH,SH->TS", qi, kj,
                      preferred_element_type=jnp.float32)  # [bq, bk]
  if scale != 1.0:
    logits = logits * scale
  ok = None

  def both(extra):
    if extra is None:
      return ok
    return extra if ok is None else ok & extra

  rows = i0 + jnp.arange(st.bq)[:, None]  # [bq, 1]
  cols = j0 + jnp.arange(st.bk)[None, :]  # [1, bk]
  if bias is not None:
    logits = logits + _tile(bias, i0, j0, st.bq, st.bk).astype(jnp.float32)
    ok = both(logits > -jnp.inf)
  dcap = None
  if st.softcap is not None:
    capped = jnp.tanh(logits / st.softcap)
    logits, dcap = st.softcap * capped, 1.0 - capped * capped
  if st.s % st.bk:
    ok = both(cols < st.s)
  ok = both(_patterns.visible(rows, cols, offset, st.bounds, q_length,
                              length))
  if mask is not None:
    ok = both(_tile(mask, i0, j0, st.bq, st.bk))
  return logits, ok, dcap


def _masked_exp(logits, ok, shift, scale=1.0):
  """``exp((logits - shift) * scale)``, 0 where not ``ok`` (no inf - inf)."""
  if ok is None:
    return jnp.exp((logits - shift[:, None]) * scale)
  return jnp.where(
      ok, jnp.exp(jnp.where(ok, logits - shift[:, None], 0.0) * scale), 0.0)


def forward(st: Static, q, k, v, mask, bias, length, q_length, offset):
  """Online softmax; returns ``(out [Tp, Hv] f32, lse [Tp] f32)``."""
  num_q, num_k = q.shape[0] // st.bq, k.shape[0] // st.bk
  hv = v.shape[-1]
  # Without a bias, softmax(scale * l) is computed on the raw logits l with
  # the scale applied inside exp(): max(scale * l) = scale * max(l) for
  # scale > 0, and XLA:CPU then runs no separate multiply pass over each
  # [bq, bk] block (it would not fuse it into the dot). Row maxima are in
  # raw-logit units; lse is converted back at the end.
  defer = bias is None and st.softcap is None and st.scale > 0
  later = st.scale if defer else 1.0

  def query_block(i):
    i0 = i * st.bq
    qi = jax.lax.dynamic_slice_in_dim(q, i0, st.bq)  # [bq, H]

    def key_block(j, carry):
      row_max, total, acc = carry
      j0 = j * st.bk
      kj = _key_rows(st, k, j0, length)  # [bk, H]
      vj = _key_rows(st, v, j0, length)  # [bk, Hv]
      logits, ok, _ = _block_logits(st, qi, kj, i0, j0, mask, bias, length,
                                    q_length, offset,
                                    scale=1.0 if defer else None)
      allowed = logits if ok is None else jnp.where(ok, logits, -jnp.inf)
      new_max = jnp.maximum(row_max, jnp.max(allowed, -1))  # [bq]
      shift = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
      p = _masked_exp(logits, ok, shift, later)  # [bq, bk]
      rescale = jnp.exp((row_max - shift) * later)  # 0 while row_max = -inf
      total = total * rescale + p.sum(-1)
      acc = acc * rescale[:, None] + jnp.einsum(
          "TS,SV->TV", p.astype(v.dtype), vj,
          preferred_element_type=jnp.float32)
      return new_max, total, acc

    zero = _zero_like_all(q, k, v, mask, bias, length, q_length, offset)
    init = (jnp.full((st.bq,), -jnp.inf, jnp.float32) + zero,
            jnp.zeros((st.bq,), jnp.float32) + zero,
            jnp.zeros((st.bq, hv), jnp.float32) + zero)
    lo, hi = _patterns.key_block_range(st.bounds, i0, st.bq, st.bk, num_k,
                                       offset, length, q_length)
    row_max, total, acc = jax.lax.fori_loop(lo, hi, key_block, init)
    seen = total > 0
    out = acc / jnp.where(seen, total, 1.0)[:, None]
    lse = jnp.where(seen, jnp.where(jnp.isfinite(row_max), row_max, 0.0)
                    * later + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
    return out, lse

  out, lse = jax.lax.map(query_block, jnp.arange(num_q))
  return out.reshape(-1, hv), lse.reshape(-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(st: Static, q, k, v, mask, bias, length, q_length, offset):
  out, lse = forward(st, q, k, v, mask, bias, length, q_length, offset)
  return out.astype(v.dtype), lse


def _attend_fwd(st, q, k, v, mask, bias, length, q_length, offset):
  out, lse = forward(st, q, k, v, mask, bias, length, q_length, offset)
  out = out.astype(v.dtype)
  return (out, lse), (q, k, v, mask, bias, length, q_length, offset, out,
                      lse)


def _attend_bwd(st, residuals, cotangents):
  q, k, v, mask, bias = residuals[:5]
  dq, dk, dv, dbias = backward(st, residuals, cotangents)
  dbias = None if bias is None else dbias.astype(bias.dtype)
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None,
          dbias, None, None, None)


def backward(st, residuals, cotangents):
  """FlashAttention-2 backward; float32 ``(dq, dk, dv, dbias)``.

  ``out`` and ``lse`` in ``residuals`` may be those of a longer key sequence
  of which ``k``/``v`` are one block (ring attention): ``P = exp(S - lse)``
  are then that block's share of the global probabilities, and the returned
  gradients are its share of the global ones.
  """
  q, k, v, mask, bias, length, q_length, offset, out, lse = residuals
  d_out, d_lse = cotangents
  f32 = jnp.float32
  num_q, num_k = q.shape[0] // st.bq, k.shape[0] // st.bk
  d_out = d_out.astype(f32)
  delta = jnp.sum(d_out * out.astype(f32), -1) - d_lse  # [Tp]
  row_ok = jnp.isfinite(lse)
  lse_safe = jnp.where(row_ok, lse, 0.0)

  def key_block(carry, j):
    dq, dbias = carry
    j0 = j * st.bk
    kj = _key_rows(st, k, j0, length)
    vj = _key_rows(st, v, j0, length)
    lo, hi = _patterns.query_block_range(st.bounds, j0, st.bq, st.bk, num_q,
                                         offset, length, q_length)

    def query_block(i, inner):
      dkj, dvj, dq, dbias = inner
      i0 = i * st.bq
      qi = jax.lax.dynamic_slice_in_dim(q, i0, st.bq)
      doi = jax.lax.dynamic_slice_in_dim(d_out, i0, st.bq)
      logits, ok, dcap = _block_logits(st, qi, kj, i0, j0, mask, bias,
                                       length, q_length, offset)
      if ok is not None:  # rows with nothing to attend have lse = -inf
        ok = ok & jax.lax.dynamic_slice_in_dim(row_ok, i0, st.bq)[:, None]
      lse_i = jax.lax.dynamic_slice_in_dim(lse_safe, i0, st.bq)
      p = _masked_exp(logits, ok, lse_i)  # [bq, bk]
      dvj = dvj + jnp.einsum("TS,TV->SV", p, doi)
      dp = jnp.einsum("TV,SV->TS", doi, vj.astype(f32))
      ds = p * (dp - jax.lax.dynamic_slice_in_dim(delta, i0, st.bq)[:, None])
      if dcap is not None:  # back through softcap * tanh(raw / softcap)
        ds = ds * dcap
      dkj = dkj + jnp.einsum("TS,TH->SH", ds, qi.astype(f32)) * st.scale
      dqi = jnp.einsum("TS,SH->TH", ds, kj.astype(f32)) * st.scale
      dq = jax.lax.dynamic_update_slice_in_dim(
          dq, jax.lax.dynamic_slice_in_dim(dq, i0, st.bq) + dqi, i0, 0)
      if dbias is not None:
        rows, cols = dbias.shape
        tile = ds
        if rows == 1:
          tile = tile.sum(0, keepdims=True)
        if cols == 1:
          tile = tile.sum(1, keepdims=True)
        at = (i0 if rows != 1 else 0, j0 if cols != 1 else 0)
        dbias = jax.lax.dynamic_update_slice(
            dbias, jax.lax.dynamic_slice(dbias, at, tile.shape) + tile, at)
      return dkj, dvj, dq, dbias

    init = (jnp.zeros(kj.shape, f32) + zero, jnp.zeros(vj.shape, f32) + zero,
            dq, dbias)
    dkj, dvj, dq, dbias = jax.lax.fori_loop(lo, hi, query_block, init)
    return (dq, dbias), (dkj, dvj)

  zero = _zero_like_all(q, k, v, mask, bias, length, q_length, offset, d_out,
                        lse)
  dbias0 = None if bias is None else jnp.zeros(bias.shape, f32) + zero
  (dq, dbias), (dk, dv) = jax.lax.scan(
      key_block, (jnp.zeros(q.shape, f32) + zero, dbias0), jnp.arange(num_k))
  return dq, dk.reshape(k.shape), dv.reshape(v.shape), dbias


_attend.defvjp(_attend_fwd, _attend_bwd)


def padded(q, k, v, *, scale, is_causal, block_q, block_k, window=None,
           softcap=None):
  """One head's static config and q, k, v padded to whole blocks."""
  t, s = q.shape[0], k.shape[0]
  bq, bk = min(block_q, t), min(block_k, s)
  tp, sp = _cdiv(t, bq) * bq, _cdiv(s, bk) * bk
  st = Static(float(scale), _patterns.bounds(bool(is_causal), window),
              None if softcap is None else float(softcap), t, s, bq, bk)
  return st, pad_axis(q, 0, tp, 0), pad_axis(k, 0, sp, 0), pad_axis(
      v, 0, sp, 0)


def single_head(q, k, v, mask, bias, length, q_length, *, out_dtype,
                **blocks):
  """One head: pads to whole blocks, attends, strips the padding."""
  if mask is not None:  # keys no query sees may hold NaN: zero them
    k, v = _numerics.zero_unseen(jnp.any(mask, axis=0), k, v)  # [S|1]
  st, q, k, v = padded(q, k, v, **blocks)
  tp, sp = q.shape[0], k.shape[0]
  if mask is not None:
    mask = pad_axis(pad_axis(mask, 0, tp, False), 1, sp, False)
  if bias is not None:
    bias = pad_axis(pad_axis(bias, 0, tp, 0.0), 1, sp, 0.0)
  out, lse = _attend(st, q, k, v, mask, bias, length, q_length, st.s - st.t)
  return out[:st.t].astype(out_dtype), None, lse[:st.t]


def validate(name, query, key, value, mask, bias, key_value_seq_lengths,
             query_seq_lengths, local_window_size, logits_soft_cap, block_q,
             block_k, scale):
  """Checks shared by the flash entry points (blockwise, ring).

  Returns ``(operands, scale, window, out_dtype)``: the
  ``_checks.Operands``, the scale (``1/sqrt(H)`` by default), the window as
  ``(left, right)`` or None, and the output dtype.
  """
  ops = _checks.attention_operands(query, key, value, mask, bias,
                                   key_value_seq_lengths, query_seq_lengths)
  window = _patterns.check_window(local_window_size)
  _checks.check_soft_cap(logits_soft_cap)
  _checks.check_positive_int("block_q", block_q)
  _checks.check_positive_int("block_k", block_k)
  h = _checks.shape_of(query)[-1]
  scale = 1.0 / math.sqrt(h) if scale is None else scale
  out_dtype = jnp.result_type(query, key, value)
  if jnp.promote_types(out_dtype, jnp.float32) != jnp.float32:
    raise TypeError(f"{name} computes in float32; got float64 inputs (use "
                    "scaled_dot_product_attention for float64).")
  return ops, scale, window, out_dtype
