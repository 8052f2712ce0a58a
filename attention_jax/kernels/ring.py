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
softmax of the flash core ``flash_core`` (per block: ``out_j``, ``lse_j``; merged by
log-sum-exp). Within a block the work is blockwise too, so no device ever
holds more than ``[block_q, block_k]`` scores per head.

The backward pass is a ``jax.custom_vjp`` that goes round the ring again:
key/value blocks travel with their gradient accumulators, each device adds
its queries' share (``flash_core.backward`` with the global ``lse``), and one
last shift brings every accumulator home. Saved per device: its own q, k, v,
output and ``lse`` — O(T + S), independent of P.

With ``return_max_logits`` each step's raw row maxima (``flash_core.forward``)
are combined by ``max`` over the steps, which between them hold every
device's keys; no gradient flows through them.

Causal masking is bottom-right aligned on the *global* lengths; a key block
wholly in a query block's future is skipped (no FLOPs), though the device
still waits for its neighbours (no load balancing: device 0 has the least
causal work).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from attention_jax.core import broadcast
from attention_jax.core import merge as merge_lib
from attention_jax.core import numerics
from attention_jax.kernels import base
from attention_jax.kernels import flash_core
from attention_jax.masking import mask as mask_lib
from attention_jax.masking.mask import BlockMask


class _Ring(NamedTuple):
  block: flash_core.Static  # local (per-device) lengths and block sizes
  axis_name: str
  size: int  # P
  steps: tuple[int, ...]  # the ring steps some device has work in


def _shift(x, rg: _Ring, by: int = 1):
  """Sends ``x`` ``by`` steps round the ring: device ``i`` -> ``i + by``."""
  if x is None or by % rg.size == 0:
    return x
  perm = [(i, (i + by) % rg.size) for i in range(rg.size)]
  return jax.lax.ppermute(x, rg.axis_name, perm)


def needed_steps(st: flash_core.Static, size: int) -> tuple[int, ...]:
  """The ring steps at which some device may see a key of the held block.

  At step ``k`` device ``i`` holds the keys of device ``(i - k) mod P``;
  its rows see local columns ``[offset - left, offset + T - 1 + right]``
  (the union of their windows). A step no device needs is never made:
  neither its compute nor its ``ppermute`` (the next needed step's shift
  jumps over it). Static: only bounds and shapes decide.
  """
  left, right = st.bounds
  if left is None and right is None:
    return tuple(range(size))
  steps = []
  for k in range(size):
    for i in range(size):
      src = (i - k) % size
      offset = i * st.t - src * st.s + size * (st.s - st.t)
      first = float("-inf") if left is None else offset - left
      last = float("inf") if right is None else offset + st.t - 1 + right
      if first <= st.s - 1 and last >= 0:
        steps.append(k)
        break
  return tuple(steps) or (0,)


def _held_block(rg: _Ring, ex: broadcast.Head, k_seg, step):
  """The held key block's ``Head`` (length, segment ids) and ``Place``."""
  st = rg.block
  index = jax.lax.axis_index(rg.axis_name)
  src = (index - step) % rg.size  # whose keys arrived after `step` shifts
  local = None
  if ex.kv_length is not None:
    local = jnp.clip(ex.kv_length - src * st.s, 0, st.s)
  # global row index*T + r may see global column src*S + c when
  # src*S + c <= index*T + r + P*(S - T)  (bottom-right alignment).
  offset = index * st.t - src * st.s + rg.size * (st.s - st.t)
  return (ex._replace(kv_length=local, k_seg=k_seg),
          flash_core.Place(offset, index * st.t, src * st.s))


def _local(rg: _Ring, ex: broadcast.Head) -> broadcast.Head:
  """This device's rows of the query lengths."""
  if ex.q_length is None:
    return ex
  index = jax.lax.axis_index(rg.axis_name)
  return ex._replace(
      q_length=jnp.clip(ex.q_length - index * rg.block.t, 0, rg.block.t))


def _merge(acc, part):
  """Two partial ``(out, lse, max_logits or None, code)`` combined: outputs
  by their log-sum-exps, row maxima and codes by max."""
  out, lse = merge_lib.merge_attentions([acc[0], part[0]], [acc[1], part[1]])
  max_logits = acc[2] if acc[2] is None else jnp.maximum(acc[2], part[2])
  return out, lse, max_logits, jnp.maximum(acc[3], part[3])


def _ring_forward(rg: _Ring, q, k, v, ex):
  """Float32 ``(out [Tp, Hv], lse [Tp], max_logits [Tp] or None, code
  [Tp])`` over the whole ring (``max_logits`` with ``rg.block.max_logits``;
  ``code`` each row's largest ``numerics`` code over the steps: which rows
  saw a NaN or inf)."""
  ex = _local(rg, ex)

  def attend(step, k, v, k_seg):
    ex_j, place = _held_block(rg, ex, k_seg, step)
    return flash_core.forward(rg.block, q, k, v, ex_j, place)

  if rg.steps == tuple(range(rg.size)):  # every step: one shift each
    def step_fn(step, carry):
      result, k, v, k_seg = carry
      k, v, k_seg = (_shift(x, rg) for x in (k, v, k_seg))
      result = _merge(result, attend(step, k, v, k_seg))
      return result, k, v, k_seg

    result = attend(0, k, v, ex.k_seg)
    result, *_ = jax.lax.fori_loop(1, rg.size, step_fn,
                                   (result, k, v, ex.k_seg))
    return result
  # A window: only the steps that hold visible keys, unrolled.
  k_seg, held = ex.k_seg, 0
  result = None
  for step in rg.steps:
    k, v, k_seg = (_shift(x, rg, step - held) for x in (k, v, k_seg))
    held = step
    part = attend(step, k, v, k_seg)
    result = part if result is None else _merge(result, part)
  return result


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(rg: _Ring, q, k, v, ex):
  out, lse, max_logits, code = _ring_forward(rg, q, k, v, ex)
  return out.astype(v.dtype), lse, max_logits, code


def _ring_fwd(rg, q, k, v, ex):
  out, lse, max_logits, code = _ring_forward(rg, q, k, v, ex)
  return ((out.astype(v.dtype), lse, max_logits, code),
          (q, k, v, ex, out, lse))


def _ring_bwd(rg, residuals, cotangents):
  q, k, v, ex0, out, lse = residuals
  # max_logits and the codes have no gradient: dropped
  cotangents = cotangents[:2]
  f32 = jnp.float32
  ex = _local(rg, ex0)

  def grads(step, k, v, k_seg):
    ex_j, place = _held_block(rg, ex, k_seg, step)
    dq, dk, dv, _, dargs = flash_core.backward(
        rg.block, (q, k, v, ex_j, place, out, lse), cotangents)
    return dq, dk, dv, dargs

  if rg.steps == tuple(range(rg.size)):
    def step_fn(step, carry):
      dq, dargs, k, v, k_seg, dk, dv = carry
      k, v, k_seg, dk, dv = (_shift(x, rg) for x in (k, v, k_seg, dk, dv))
      dq_j, dk_j, dv_j, dargs_j = grads(step, k, v, k_seg)
      dargs = tuple(a + b for a, b in zip(dargs, dargs_j))
      return dq + dq_j, dargs, k, v, k_seg, dk + dk_j, dv + dv_j

    dq, dk, dv, dargs = grads(0, k, v, ex.k_seg)
    dq, dargs, _, _, _, dk, dv = jax.lax.fori_loop(
        1, rg.size, step_fn,
        (dq, dargs, k, v, ex.k_seg, dk.astype(f32), dv.astype(f32)))
    held = rg.size - 1
  else:  # the window's steps only, unrolled, as in the forward pass
    k_seg, held = ex.k_seg, 0
    dq = dk = dv = dargs = None
    for step in rg.steps:
      k, v, k_seg, dk, dv = (_shift(x, rg, step - held)
                             for x in (k, v, k_seg, dk, dv))
      held = step
      dq_j, dk_j, dv_j, dargs_j = grads(step, k, v, k_seg)
      if dq is None:
        dq, dk, dv, dargs = dq_j, dk_j, dv_j, dargs_j
      else:
        dq, dk, dv = dq + dq_j, dk + dk_j, dv + dv_j
        dargs = tuple(a + b for a, b in zip(dargs, dargs_j))
  # each block's gradient goes home
  dk, dv = _shift(dk, rg, rg.size - held), _shift(dv, rg, rg.size - held)
  if dargs:
    # What score_mod closes over is replicated: every device's share adds
    # up. The barrier orders the all-reduce after the last shift
    # (independent collectives may otherwise run in different orders on
    # different devices and deadlock).
    dk, dv, dargs = jax.lax.optimization_barrier((dk, dv, dargs))
    dargs = tuple(jax.lax.psum(d, rg.axis_name).astype(c.dtype)
                  for d, c in zip(dargs, ex0.mod_consts))
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
          broadcast.Head(mod_consts=dargs))


_ring.defvjp(_ring_fwd, _ring_bwd)


def _single_head(q, k, v, h, garbage, *, axis_name, size, out_dtype,
                 **blocks):
  st, q, k, v = flash_core.padded(q, k, v, **blocks)
  ex = flash_core.padded_head(st, q.shape[0], k.shape[0], h)._replace(
      garbage=garbage)
  st, ex = flash_core.hoist_score_mod(st, ex, q, replay_closures=False)
  out, lse, max_logits, code = _ring(
      _Ring(st, axis_name, size, needed_steps(st, size)), q, k, v, ex)
  out, lse, code = out[:st.t], lse[:st.t], code[:st.t]
  if h.sink is not None:
    q_length = None
    if h.q_length is not None:  # this device's rows of the global length
      index = jax.lax.axis_index(axis_name)
      q_length = jnp.clip(h.q_length - index * st.t, 0, st.t)
    out, _, lse = numerics.with_sink(out, lse, h.sink, q_length)
  if st.max_logits:
    max_logits = max_logits[:st.t]
  # NaN or inf reaches only the rows that may see it (flash_core's blocks
  # are made finite as they are loaded; each step's codes merge by max):
  # poisoned after the custom VJP, those rows pass no cotangent back.
  out, lse, max_logits = numerics.poison(code, out.astype(out_dtype), lse,
                                         max_logits)
  if st.max_logits:
    return out, None, lse, max_logits
  return out, None, lse


@dataclasses.dataclass(frozen=True)
class Ring(base.Kernel):
  """The flash kernel across the devices of ``axis_name`` (see the module
  docstring); call inside ``jax.shard_map`` (``aj.ring_attention``)."""
  axis_name: str
  block_q: int | None = None
  block_k: int | None = None
  name = "ring"
  # Its own global placement of each step's blocks; positions in the mask
  # would have to travel round the ring with the keys.
  implements = frozenset({"causal", "window", "q_lengths", "kv_lengths",
                          "q_segment_ids", "kv_segment_ids", "rule",
                          "score_mod", "sinks", "return_lse",
                          "return_max_logits"})

  def __post_init__(self):
    if not isinstance(self.axis_name, str):
      raise TypeError(f"Ring's axis_name must be a mesh axis name (str), got "
                      f"{self.axis_name!r}.")
    base.check_block_size("block_q", self.block_q)
    base.check_block_size("block_k", self.block_k)

  def size(self) -> int:
    """``P``, the devices on the ring axis (a ValueError outside it)."""
    try:
      return jax.lax.axis_size(self.axis_name)
    except NameError as e:
      raise ValueError(
          f"axis_name={self.axis_name!r} is not bound: call ring_attention "
          "inside jax.shard_map over a mesh with that axis (the sequence "
          f"dimension sharded over it). ({e})") from None

  def lengths(self, t: int, s: int) -> tuple[int, int]:
    """A rule's indices are global: ``P * T`` queries, ``P * S`` keys."""
    size = self.size()
    return size * t, size * s

  def supports(self, problem: base.Problem) -> str | None:
    ops = problem.ops
    for name, x in (("dense mask", ops.mask), ("bias", ops.bias)):
      if x is not None:
        return (f"it takes no {name} (shape {tuple(x.shape)}): it would "
                "have to travel round the ring with its keys. Express "
                "padding with Mask(kv_lengths=...), causality, windows and "
                "documents as Mask fields and other rules as "
                "Mask(rule=...) over the global indices, or gather the "
                "sequence and use the blockwise kernel")
    rule = None if ops.block_mask is None else ops.block_mask.mask_fn
    masks = getattr(rule, "params", None)
    if isinstance(getattr(rule, "fn", None), mask_lib.Bound):  # a union
      for m in mask_lib.Union(*masks).members():
        if m.dense is not None or m.q_segment_ids is not None:
          return ("it takes no dense mask or segment ids inside a union of "
                  "masks (a union is evaluated on global indices, where "
                  "this device's ids and a local dense mask do not apply); "
                  "put segment ids in the mask itself, not in a union")
    return (base.no_weights_or_dropout(problem)
            or base.float32_only(problem))

  def __call__(self, problem: base.Problem):
    ops = problem.ops
    size = self.size()
    rule = ops.block_mask
    if rule is not None:
      # Each device evaluates the rule on global indices in the blocks it
      # visits; tables (laid out for the global sequence) are not used.
      t, s = ops.query.shape[-2], ops.key.shape[-2]
      bq = t if rule.block_q is None else min(t, rule.block_q)
      bk = s if rule.block_k is None else min(s, rule.block_k)
      ops = ops._replace(block_mask=BlockMask(
          rule.mask_fn, t, s, bq, bk, None, None, None, None, None))
    block_q, block_k = flash_core.block_sizes(ops, self.block_q,
                                              self.block_k)
    head = functools.partial(
        _single_head, axis_name=self.axis_name, size=size,
        scale=problem.scale, is_causal=ops.causal, window=ops.window,
        score_mod=ops.score_mod, block_q=block_q, block_k=block_k,
        max_logits=problem.return_max_logits, out_dtype=problem.out_dtype)
    # Whether any device holds a NaN or inf (keys travel): one scalar
    # all-reduce, so that a clean call's walks skip looking for the rows
    # that see one (broadcast.Head.garbage).
    garbage = jax.lax.pmax(numerics.any_nonfinite(
        ops.query, ops.key, ops.value).astype(jnp.int32), self.axis_name) > 0
    return broadcast.lift_heads(head, ops, (garbage,), (0,))
