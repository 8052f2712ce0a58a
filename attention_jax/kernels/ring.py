"""Ring attention: the sequence split across the devices of a mesh axis.

Shape glossary: T this device's query length, S this device's key/value
length, H head dim, Hv value head dim, P devices on the ring axis; ``...``
leading dims that broadcast (e.g. ``B, N``; size-1 dims for shared KV heads).

Call inside ``jax.shard_map`` with the sequence dimension split over
``axis_name`` (Liu et al. 2023, "Ring Attention with Blockwise
Transformers"). Each device keeps its queries and passes its key/value
block to the next device ``P - 1`` times (``lax.ppermute``), folding each
block into the result with the online softmax of the flash core
``flash_core`` (per block: ``out_j``, ``lse_j``; merged by log-sum-exp).
Within a block the work is blockwise too, so no device ever holds more
than ``[block_q, block_k]`` scores per head.

The kernel reads the call's mask in this device's terms, like any kernel:
its positions (``q_offset``, ``kv_offset``) say where this device's query
rows and key columns stand in the global sequence, its lengths and
segment ids count this device's rows and columns. A key block travels
with its segment ids; every device's key position and length are
gathered once per call (``_Blocks``), so each step places the block it
holds at its owner's positions (``flash_core.Place``). ``Ring.localize``
turns a mask written for the whole sequence (what ``aj.ring_attention``
takes) into this device's, once: device ``i`` holds query rows ``[i*T,
(i+1)*T)`` and key/value rows ``[i*S, (i+1)*S)``.

The ring steps whose held block no device may see (a window that reaches
only a few neighbours) are never made, neither their compute nor their
``ppermute``: ``needed_steps`` works them out from that layout's static
geometry, and ``localize`` gives the kernel those steps (``Ring.steps``);
a kernel built without them makes every step.

The backward pass is a ``jax.custom_vjp`` that goes round the ring again:
key/value blocks travel with their gradient accumulators, each device adds
its queries' share (``flash_core.backward`` with the global ``lse``), and one
last shift brings every accumulator home. Saved per device: its own q, k, v,
output and ``lse`` — O(T + S), independent of P.

With ``return_max_logits`` each step's raw row maxima (``flash_core.forward``)
are combined by ``max`` over the steps, which between them hold every
device's keys; no gradient flows through them.

A key block wholly in a query block's future is skipped (no FLOPs), though
the device still waits for its neighbours (no load balancing: device 0 has
the least causal work).
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
from attention_jax.core import merge as merge_lib
from attention_jax.core import numerics
from attention_jax.kernels import base
from attention_jax.kernels import flash_core
from attention_jax.masking import intervals
from attention_jax.masking import mask as mask_lib
from attention_jax.masking.mask import BlockMask
from attention_jax.scores import score_mods


class _Ring(NamedTuple):
  block: flash_core.Static  # local (per-device) lengths and block sizes
  axis_name: str
  size: int  # P
  steps: tuple[int, ...]  # the ring steps made (the others' blocks unseen)


def _shift(x, rg: _Ring, by: int = 1):
  """Sends ``x`` ``by`` steps round the ring: device ``i`` -> ``i + by``."""
  if x is None or by % rg.size == 0:
    return x
  perm = [(i, (i + by) % rg.size) for i in range(rg.size)]
  return jax.lax.ppermute(x, rg.axis_name, perm)


def needed_steps(bounds: intervals.Bounds, t: int, s: int, size: int,
                 relative: int) -> tuple[int, ...]:
  """The ring steps at which some device may see a key of the held block.

  The layout ``Ring.localize`` makes: device ``i`` holds query rows at
  positions ``relative + i*T + r`` (``relative``: the global query
  position of row 0 less the global key position of column 0) and key
  columns at ``i*S + c``; at step ``k`` it holds the keys of device
  ``(i - k) mod P``, and its rows see local columns ``[offset - left,
  offset + T - 1 + right]`` (the union of their windows). A step no device
  needs is never made: neither its compute nor its ``ppermute`` (the next
  needed step's shift jumps over it). Static: only bounds and shapes
  decide.
  """
  left, right = bounds
  if left is None and right is None:
    return tuple(range(size))
  steps = []
  for k in range(size):
    for i in range(size):
      src = (i - k) % size
      offset = relative + i * t - src * s
      first = float("-inf") if left is None else offset - left
      last = float("inf") if right is None else offset + t - 1 + right
      if first <= s - 1 and last >= 0:
        steps.append(k)
        break
  return tuple(steps) or (0,)


class _Held(NamedTuple):
  """A key block and its segment ids, which travel round the ring."""
  k: jax.Array
  v: jax.Array
  k_seg: jax.Array | None  # int32 [Sp]


class _Blocks(NamedTuple):
  """Every device's key-block length and position (int32 ``[P]`` each, or
  None), gathered once per call: a held block's are indexed by whose it
  is, not sent round with it at every step."""
  kv_length: jax.Array | None
  kv_offset: jax.Array | None


def _gather(rg: _Ring, ex: broadcast.Head) -> _Blocks:
  return _Blocks(*(None if x is None else jax.lax.all_gather(x, rg.axis_name)
                   for x in (ex.kv_length, ex.kv_offset)))


def _travel(rg: _Ring, held: _Held, by: int = 1) -> _Held:
  return _Held(*(_shift(x, rg, by) for x in held))


def _at(rg: _Ring, ex: broadcast.Head, blocks: _Blocks, held: _Held, step):
  """The held block's ``Head`` (its length, ids, position) and ``Place``:
  this device's rows meet the keys of device ``(i - step) mod P`` at their
  positions."""
  src = (jax.lax.axis_index(rg.axis_name) - step) % rg.size
  length, offset = (None if x is None else x[src] for x in blocks)
  ex = ex._replace(k_seg=held.k_seg, kv_length=length, kv_offset=offset)
  if ex.q_offset is None:  # nothing placed: no causality, window or rule
    return ex, flash_core.Place(0)
  return ex, flash_core.Place(ex.q_offset - offset, ex.q_offset, offset)


def _merge(acc, part):
  """Two partial ``(out, lse, max_logits or None, code)`` combined: outputs
  by their log-sum-exps, row maxima and codes by max."""
  out, lse = merge_lib.merge_attentions([acc[0], part[0]], [acc[1], part[1]])
  max_logits = acc[2] if acc[2] is None else jnp.maximum(acc[2], part[2])
  return out, lse, max_logits, jnp.maximum(acc[3], part[3])


def _ring_forward(rg: _Ring, q, k, v, ex, blocks):
  """Float32 ``(out [Tp, Hv], lse [Tp], max_logits [Tp] or None, code
  [Tp])`` over the whole ring (``max_logits`` with ``rg.block.max_logits``;
  ``code`` each row's largest ``numerics`` code over the steps: which rows
  saw a NaN or inf)."""

  def attend(step, held):
    ex_j, place = _at(rg, ex, blocks, held, step)
    return flash_core.forward(rg.block, q, held.k, held.v, ex_j, place)

  held = _Held(k, v, ex.k_seg)
  if rg.steps == tuple(range(rg.size)):  # every step: one shift each
    def step_fn(step, carry):
      result, held = carry
      held = _travel(rg, held)
      return _merge(result, attend(step, held)), held

    result, _ = jax.lax.fori_loop(1, rg.size, step_fn,
                                  (attend(0, held), held))
    return result
  # A window: only the steps that hold visible keys, unrolled.
  at, result = 0, None
  for step in rg.steps:
    held, at = _travel(rg, held, step - at), step
    part = attend(step, held)
    result = part if result is None else _merge(result, part)
  return result


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(rg: _Ring, q, k, v, ex, blocks):
  out, lse, max_logits, code = _ring_forward(rg, q, k, v, ex, blocks)
  return out.astype(v.dtype), lse, max_logits, code


def _ring_fwd(rg, q, k, v, ex, blocks):
  out, lse, max_logits, code = _ring_forward(rg, q, k, v, ex, blocks)
  return ((out.astype(v.dtype), lse, max_logits, code),
          (q, k, v, ex, blocks, out, lse))


def _ring_bwd(rg, residuals, cotangents):
  q, k, v, ex, blocks, out, lse = residuals
  # max_logits and the codes have no gradient: dropped
  cotangents = cotangents[:2]
  f32 = jnp.float32

  def grads(step, held):
    ex_j, place = _at(rg, ex, blocks, held, step)
    dq, dk, dv, _, dargs = flash_core.backward(
        rg.block, (q, held.k, held.v, ex_j, place, out, lse), cotangents)
    return dq, dk, dv, dargs

  held = _Held(k, v, ex.k_seg)
  if rg.steps == tuple(range(rg.size)):
    def step_fn(step, carry):
      dq, dargs, held, dk, dv = carry
      held, dk, dv = _travel(rg, held), _shift(dk, rg), _shift(dv, rg)
      dq_j, dk_j, dv_j, dargs_j = grads(step, held)
      dargs = tuple(a + b for a, b in zip(dargs, dargs_j))
      return dq + dq_j, dargs, held, dk + dk_j, dv + dv_j

    dq, dk, dv, dargs = grads(0, held)
    dq, dargs, _, dk, dv = jax.lax.fori_loop(
        1, rg.size, step_fn,
        (dq, dargs, held, dk.astype(f32), dv.astype(f32)))
    at = rg.size - 1
  else:  # the window's steps only, unrolled, as in the forward pass
    at = 0
    dq = dk = dv = dargs = None
    for step in rg.steps:
      held = _travel(rg, held, step - at)
      dk, dv = _shift(dk, rg, step - at), _shift(dv, rg, step - at)
      at = step
      dq_j, dk_j, dv_j, dargs_j = grads(step, held)
      if dq is None:
        dq, dk, dv, dargs = dq_j, dk_j, dv_j, dargs_j
      else:
        dq, dk, dv = dq + dq_j, dk + dk_j, dv + dv_j
        dargs = tuple(a + b for a, b in zip(dargs, dargs_j))
  # each block's gradient goes home
  dk, dv = _shift(dk, rg, rg.size - at), _shift(dv, rg, rg.size - at)
  if dargs:
    # What score_mod closes over is replicated: every device's share adds
    # up. The barrier orders the all-reduce after the last shift
    # (independent collectives may otherwise run in different orders on
    # different devices and deadlock).
    dk, dv, dargs = jax.lax.optimization_barrier((dk, dv, dargs))
    dargs = tuple(jax.lax.psum(d, rg.axis_name).astype(c.dtype)
                  for d, c in zip(dargs, ex.mod_consts))
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
          broadcast.Head(mod_consts=dargs), None)


_ring.defvjp(_ring_fwd, _ring_bwd)


def _single_head(q, k, v, h, garbage, *, axis_name, size, steps, out_dtype,
                 **blocks):
  st, q, k, v = flash_core.padded(q, k, v, **blocks)
  ex = flash_core.padded_head(st, q.shape[0], k.shape[0], h)._replace(
      garbage=garbage)
  st, ex = flash_core.hoist_score_mod(st, ex, q, replay_closures=False)
  rg = _Ring(st, axis_name, size, steps or tuple(range(size)))
  out, lse, max_logits, code = _ring(rg, q, k, v, ex, _gather(rg, ex))
  out, lse, code = out[:st.t], lse[:st.t], code[:st.t]
  if h.sink is not None:
    out, _, lse = numerics.with_sink(out, lse, h.sink, h.q_length)
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
  """
  axis_name: str
  block_q: int | None = None
  block_k: int | None = None
  steps: tuple[int, ...] | None = None
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
               s: int, leading: tuple[int, ...] = ()):
    """A mask and score modifier written for the whole sequence, in this
    device's terms; ``(mask, score_mod, kernel)``.

    The global call has ``P * T`` queries and ``P * S`` keys; this device
    holds query rows ``[i*T, (i+1)*T)`` and key rows ``[i*S, (i+1)*S)``.
    Its mask gets their positions (the global mask's, or the
    bottom-right alignment's), its lengths (the global ones, clipped to
    its rows and keys); segment ids are already this device's; a union is
    bound and a ``BlockMask``'s rule kept (its tables are laid out for the
    global sequence), each evaluated at global indices; without positions
    in a ``T != S`` call, where rows stand ``P * (S - T)`` ahead of their
    indices, the rule and ``score_mod`` still see the indices. The kernel
    comes back with the steps the global band needs (every step when the
    positions are traced). ``leading`` are the operands' leading dims
    (a union's members are checked at the global lengths against them).
    """
    size = self.size()
    index = jax.lax.axis_index(self.axis_name)
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
    lengths = {}
    for name, given, rows, total in (("q_lengths", m.q_lengths, t, big_t),
                                     ("kv_lengths", m.kv_lengths, s, big_s)):
      if given is not None:
        checks.check_concrete_range(f"the mask's {name}", given, total)
        lengths[name] = jnp.clip(jnp.asarray(given) - index * rows, 0, rows)
    local = mask_lib.Mask(
        causal=m.causal, window=m.window, q_segment_ids=m.q_segment_ids,
        kv_segment_ids=m.kv_segment_ids, dense=m.dense, rule=rule,
        q_offset=q_at + index * t, kv_offset=kv_at + index * s, **lengths)
    bounds = intervals.bounds(m.causal, m.window)
    try:
      relative = np.unique(np.asarray(q_at) - np.asarray(kv_at))
    except jax.errors.TracerArrayConversionError:  # traced: every step
      return local, score_mod, dataclasses.replace(self, steps=None)
    steps = sorted(set().union(*(needed_steps(bounds, t, s, size, int(r))
                                 for r in relative.reshape(-1))))
    return local, score_mod, dataclasses.replace(self, steps=tuple(steps))

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
    unplaced = sorted(problem.features & _PLACED)
    if unplaced and not ops.positioned:
      return (f"it needs this device's positions in the mask (q_offset/"
              f"kv_offset: where its query rows and key columns stand in "
              f"the whole sequence) for {', '.join(unplaced)}: call "
              "aj.ring_attention with the mask of the whole sequence, or "
              "Ring.localize(mask, score_mod, T, S) inside shard_map")
    if self.steps is not None and self.steps[-1] >= self.size():
      return (f"its steps {self.steps} run past the ring's "
              f"{self.size()} devices")
    return (base.no_weights_or_dropout(problem)
            or base.float32_only(problem))

  def __call__(self, problem: base.Problem):
    ops = problem.ops
    size = self.size()
    rule = ops.block_mask
    if rule is not None:
      # A rule is evaluated at positions in every block a device visits
      # (no tables: the held block changes every step).
      t, s = ops.query.shape[-2], ops.key.shape[-2]
      ops = ops._replace(block_mask=BlockMask(
          rule.mask_fn, t, s, t, s, None, None, None, None, None))
    block_q, block_k = flash_core.block_sizes(ops, self.block_q,
                                              self.block_k)
    head = functools.partial(
        _single_head, axis_name=self.axis_name, size=size, steps=self.steps,
        scale=problem.scale, is_causal=ops.causal, window=ops.window,
        score_mod=ops.score_mod, block_q=block_q, block_k=block_k,
        max_logits=problem.return_max_logits, out_dtype=problem.out_dtype)
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
