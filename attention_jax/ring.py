"""Ring attention: the sequence split across the devices of a mesh axis.

Shape glossary: T this device's query length, S this device's key/value
length, H head dim, Hv value head dim, P devices on the ring axis; ``...``
leading dims that broadcast (e.g. ``B, N``; size-1 dims for shared KV heads).

Call inside ``jax.shard_map`` with the sequence dimension split over
``axis_name``: device ``i`` holds query rows ``[i*T, (i+1)*T)`` and key/value
rows ``[i*S, (i+1)*S)`` of the global sequence (Liu et al. 2023, "Ring
Attention with Blockwise Transformers"). Each device keeps its queries and
passes its key/value block to the next device ``P - 1`` times
(``lax.ppermute``), folding each block into the result with the online
softmax of the flash core ``_flash`` (per block: ``out_j``, ``lse_j``; merged by
log-sum-exp). Within a block the work is blockwise too, so no device ever
holds more than ``[block_q, block_k]`` scores per head.

The backward pass is a ``jax.custom_vjp`` that goes round the ring again:
key/value blocks travel with their gradient accumulators, each device adds
its queries' share (``_flash.backward`` with the global ``lse``), and one
last shift brings every accumulator home. Saved per device: its own q, k, v,
output and ``lse`` — O(T + S), independent of P.

Causal masking is bottom-right aligned on the *global* lengths; a key block
wholly in a query block's future is skipped (no FLOPs), though the device
still waits for its neighbours (no load balancing: device 0 has the least
causal work).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from attention_jax import _broadcast
from attention_jax import _checks
from attention_jax import _flash


class _Ring(NamedTuple):
  block: _flash.Static  # local (per-device) lengths and block sizes
  axis_name: str
  size: int  # P


def _shift(x, rg: _Ring):
  """Sends ``x`` one step round the ring: device ``i`` -> ``i + 1``."""
  perm = [(i, (i + 1) % rg.size) for i in range(rg.size)]
  return jax.lax.ppermute(x, rg.axis_name, perm)


def _local_queries(rg: _Ring, q_length):
  """How many of this device's query rows are within the global length."""
  if q_length is None:
    return None
  index = jax.lax.axis_index(rg.axis_name)
  return jnp.clip(q_length - index * rg.block.t, 0, rg.block.t)


def _held_block(rg: _Ring, length, step):
  """The key block held at ``step``: its local valid length, causal offset."""
  st = rg.block
  index = jax.lax.axis_index(rg.axis_name)
  src = (index - step) % rg.size  # whose keys arrived after `step` shifts
  local = None if length is None else jnp.clip(length - src * st.s, 0, st.s)
  # global row index*T + r may see global column src*S + c when
  # src*S + c <= index*T + r + P*(S - T)  (bottom-right alignment).
  offset = index * st.t - src * st.s + rg.size * (st.s - st.t)
  return local, offset


def _merge(out, lse, out_j, lse_j):
  """Combines two normalised partial results by their log-sum-exps."""
  top = jnp.maximum(lse, lse_j)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  a, b = jnp.exp(lse - top), jnp.exp(lse_j - top)  # 0 for an empty part
  total = a + b
  seen = total > 0
  total = jnp.where(seen, total, 1.0)
  out = (out * a[:, None] + out_j * b[:, None]) / total[:, None]
  return out, jnp.where(seen, top + jnp.log(total), -jnp.inf)


def _ring_forward(rg: _Ring, q, k, v, length, q_length):
  """Float32 ``(out [Tp, Hv], lse [Tp])`` over the whole ring."""
  local_q = _local_queries(rg, q_length)

  def attend(step, k, v):
    local, offset = _held_block(rg, length, step)
    return _flash.forward(rg.block, q, k, v, None, None, local, local_q,
                          offset)

  def step_fn(step, carry):
    out, lse, k, v = carry
    k, v = _shift(k, rg), _shift(v, rg)
    out, lse = _merge(out, lse, *attend(step, k, v))
    return out, lse, k, v

  out, lse = attend(0, k, v)
  out, lse, _, _ = jax.lax.fori_loop(1, rg.size, step_fn, (out, lse, k, v))
  return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(rg: _Ring, q, k, v, length, q_length):
  out, lse = _ring_forward(rg, q, k, v, length, q_length)
  return out.astype(v.dtype), lse


def _ring_fwd(rg, q, k, v, length, q_length):
  out, lse = _ring_forward(rg, q, k, v, length, q_length)
  return (out.astype(v.dtype), lse), (q, k, v, length, q_length, out, lse)


def _ring_bwd(rg, residuals, cotangents):
  q, k, v, length, q_length, out, lse = residuals
  f32 = jnp.float32
  local_q = _local_queries(rg, q_length)

  def grads(step, k, v):
    local, offset = _held_block(rg, length, step)
    dq, dk, dv, _ = _flash.backward(
        rg.block, (q, k, v, None, None, local, local_q, offset, out, lse),
        cotangents)
    return dq, dk, dv

  def step_fn(step, carry):
    dq, k, v, dk, dv = carry
    k, v, dk, dv = (_shift(x, rg) for x in (k, v, dk, dv))
    dq_j, dk_j, dv_j = grads(step, k, v)
    return dq + dq_j, k, v, dk + dk_j, dv + dv_j

  dq, dk, dv = grads(0, k, v)
  dq, _, _, dk, dv = jax.lax.fori_loop(
      1, rg.size, step_fn, (dq, k, v, dk.astype(f32), dv.astype(f32)))
  dk, dv = _shift(dk, rg), _shift(dv, rg)  # each block's gradient goes home
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None,
          None)


_ring.defvjp(_ring_fwd, _ring_bwd)


def _single_head(q, k, v, length, q_length, *, axis_name, size, out_dtype,
                 **blocks):
  st, q, k, v = _flash.padded(q, k, v, **blocks)
  out, lse = _ring(_Ring(st, axis_name, size), q, k, v, length, q_length)
  return out[:st.t].astype(out_dtype), None, lse[:st.t]


def ring_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    mask: ArrayLike | None = None,
    *,
    axis_name: str,
    bias: ArrayLike | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    key_value_seq_lengths: ArrayLike | None = None,
    query_seq_lengths: ArrayLike | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    block_q: int = 1024,
    block_k: int = 256,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Attention over a sequence split across the devices of ``axis_name``.

  Call inside ``jax.shard_map`` (or anything that binds ``axis_name``), with
  the query and key/value sequence dimension sharded over that axis in
  order; the result is this device's rows of full attention over the global
  sequence. Numbers match ``blockwise_attention`` on the gathered arrays.

  Args:
    query: float ``[..., T, H]``, this device's queries.
    key: float ``[..., S, H]``, this device's keys (4-D ``[B, K, S, H]``
      with ``K`` dividing the query heads ``N``: grouped-query attention).
    value: float ``[..., S, Hv]``.
    mask: not supported (a dense mask would have to travel round the ring
      with its keys): pass None, and express padding with
      ``key_value_seq_lengths`` and causality with ``is_causal``.
    axis_name: the mesh axis the sequence is split over (``P`` devices).
    bias: not supported, as ``mask``.
    scale: defaults to ``1/sqrt(H)``.
    is_causal: bottom-right aligned causal mask on the global lengths
      ``P*T`` and ``P*S``; key blocks wholly in the future are skipped.
    key_value_seq_lengths: optional integer array with one axis per leading
      dim (size 1 broadcasts): the valid length of the *global* key sequence
      (keys at global positions ``>= key_value_seq_lengths`` are padding).
      Replicated, not sharded.
    query_seq_lengths: the same for the *global* query sequence: rows at
      global positions ``>=`` the length get output 0.
    local_window_size: ``w`` or ``(left, right)`` on the global positions,
      as in ``blockwise_attention``; key blocks outside every window are
      skipped within each step (the ring still makes all its steps).
    logits_soft_cap: ``c``: logits become ``c * tanh(logits / c)``.
    block_q, block_k: block sizes of the per-device blockwise computation.
    return_lse: also return the global log-sum-exp of each query row.

  Returns:
    ``output [..., T, Hv]`` in the inputs' dtype, or ``(output, lse)`` with
    ``return_lse`` (``lse [..., T]`` float32). Differentiable in query, key
    and value (through ``lse`` too); the backward pass goes round the ring
    blockwise.

  Raises:
    ValueError: ``axis_name`` is not bound (not inside ``shard_map``), a
      ``mask`` or ``bias`` is given, or operand shapes do not fit (as for
      ``blockwise_attention``).
    TypeError: non-float operands, float64, non-integer lengths.

  Example:
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("seq",),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> x = jnp.ones((2, 64, 16))  # [B, T, H], T split over "seq"
    >>> ring = jax.shard_map(
    ...     lambda q, k, v: ring_attention(q, k, v, axis_name="seq"),
    ...     mesh=mesh, in_specs=P(None, "seq"), out_specs=P(None, "seq"))
    >>> ring(x, x, x).shape
    (2, 64, 16)
  """
  for name, x in (("mask", mask), ("bias", bias)):
    if x is not None:
      raise ValueError(
          f"ring_attention takes no {name} (got shape "
          f"{_checks.shape_of(x)}): a dense [T, S] {name} would have to "
          "travel round the ring with its keys. Express padding with "
          "key_value_seq_lengths and causality with is_causal, or gather the "
          "sequence and call blockwise_attention.")
  ops, scale, window, out_dtype = _flash.validate(
      "ring_attention", query, key, value, None, None, key_value_seq_lengths,
      query_seq_lengths, local_window_size, logits_soft_cap, block_q, block_k,
      scale)
  try:
    size = jax.lax.axis_size(axis_name)
  except NameError as e:
    raise ValueError(
        f"axis_name={axis_name!r} is not bound: call ring_attention inside "
        "jax.shard_map over a mesh with that axis (the sequence dimension "
        f"sharded over it). ({e})") from None
  head = functools.partial(
      _single_head, axis_name=axis_name, size=size, scale=scale,
      is_causal=is_causal, window=window, softcap=logits_soft_cap,
      block_q=block_q, block_k=block_k, out_dtype=out_dtype)
  out, _, lse = _broadcast.lift_heads(
      lambda q, k, v, mask, bias, length, q_length: head(q, k, v, length,
                                                         q_length), ops)
  return _broadcast.results(out, None, lse, return_weights=False,
                            return_lse=return_lse)
