"""The splash kernel: JAX's Pallas TPU "splash attention", with our semantics.

Shape glossary: B batch, T query length, S key/value length, N query heads,
K key/value heads, G = N // K query heads per key/value head, H head dim,
Hv value head dim; Tp, Sp: T and S padded to whole blocks; ``...`` leading
dims.

``Splash`` is the kernel (``kernels.base``). It calls
``jax.experimental.pallas.ops.tpu.splash_attention`` (written against jax
0.10.2): one ``make_splash_mqa`` kernel per call shape, its G query heads
``[G, Tp, H]`` over one key/value head ``[Sp, H]`` (GQA and MQA share
keys without copies; MHA and a head axis that cannot be shared run G = 1),
vmapped over the other leading dims. On a non-TPU backend it runs only as
``Splash(interpret=True)`` (the Pallas interpreter: a check, not a speed).

Supported: causal and windows at any T, S (splash's ``CausalMask`` /
``LocalMask``), kv lengths, q lengths, segment ids, one ``aj.soft_cap``,
sinks, GQA/MQA/MHA, the log-sum-exp with gradients through it, and a rule
or dense mask whose values are concrete (evaluated here into NumPy masks,
exact: splash's lazy chunked mask is top-left aligned, so rules are not
mapped onto it; a mask that differs along a leading axis other than the
kernel's query heads runs one kernel per slice of that axis). Refused
(``supports`` says why): dropout and weights, float64, a bias, any other
score modifier, traced rules and traced dense masks (splash's mask is
static: it is turned into block tables on the host; under ``jax.jit`` a
dense mask array is traced), empty sequences.

Where splash's semantics differ from ours (read from jax 0.10.2's
``splash_attention_kernel.py`` and ``splash_attention_mask.py``), and the
bridge:

* Alignment. Splash's causal/local masks take an ``offset`` (query ``i``
  at key ``i + offset``); ours is bottom-right, so ``offset = S - T`` (a
  negative one leaves the first rows empty, which is handled below).
* Block shapes. Its blocks must be multiples of 128 and divide T and S.
  Queries and keys are padded to ``Tp``, ``Sp`` with zeros; padded keys
  get a segment id no query has, padded query rows are cut off.
* Lengths. Splash has none: keys past ``kv_lengths`` get that segment id
  too; rows past ``q_lengths`` are zeroed after the call (output 0, lse
  ``-inf``; their queries are zeroed first), so their cotangents are zero
  and they add nothing to any gradient.
* Garbage (``0 * NaN`` is NaN even where a weight is 0). Splash's kernels
  cannot carry a per-row flag, so NaN and inf are handled round them: q, k
  and v are ``checks.sanitize``'d before the call (every product
  finite), and when any entry was not finite (one ``lax.cond`` on the whole
  call: nothing is spent otherwise) each row's code is worked out in plain
  JAX from the same pattern (band, static mask, lengths, segment ids,
  ``checks.seen_codes_by_rows``), and the rows that may see a bad key,
  value or query are poisoned (``checks.poison``). Keys that no query
  may see by the band, the static mask, ``kv_lengths`` or their segment id
  are also zeroed before the call, as the dense kernel does.
* Segment ids. Splash compares int32 ids; ours too, but a padded key must
  match no query, so ids are renumbered per example: a query's id becomes
  its rank among the sorted query ids, a key's the rank of the same id
  (``-1`` when no query has it). Equality is unchanged.
* Rows that may see nothing. Splash fills blocked logits with a finite
  ``mask_value`` (``-0.7 * float32 max``), so such a row is the mean of the
  values of its visited blocks (or 0/0 when it visits none), with
  ``lse ~ mask_value`` (or ``-inf``). Ours is output 0, lse ``-inf``, zero
  gradients: rows with ``lse <= mask_value / 2`` are zeroed (a real row's
  lse is at least its largest logit, far above that). With sinks splash
  already gives output 0 and lse = the sink there, which is ours.
* Scale. Splash has none: the queries are multiplied by ``scale`` before
  the call (before the soft cap, as ours), in float32, then cast back.
* The log-sum-exp. Splash returns it only with ``save_residuals=True``, and
  then its VJP raises ("Higher-order AD not supported"); its backward takes
  no lse cotangent. So the call is our own ``custom_vjp``: the forward is
  splash's with residuals; the backward is splash's own backward kernels
  (``splash_attention_kernel._splash_attention_bwd``, private in jax: the
  only entry that takes residuals; ``supports`` refuses every problem if
  its signature is not the expected one) with the lse cotangent folded in
  exactly: ``dS = P * (dP - D + dlse)``, and splash forms ``D = rowsum(o *
  do)`` from the residual output, so the values get one zero column, the
  residual output the column ``-dlse`` and the output cotangent a column of
  ones (``dP`` is unchanged, ``D`` becomes ``D - dlse``; its sink gradient
  ``-exp(sink - lse) * D`` becomes exact too). The extra column of ``dV``
  is dropped.
* Sinks. Splash's are ours (``exp(sink)`` joins each row's denominator,
  uncapped, unscaled, its lse includes the sink); one per query head.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import typing

import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.core import checks
from attention_jax.kernels import base
from attention_jax.masking import intervals
from attention_jax.scores import score_mods

_LANES = 128  # splash's blocks are whole multiples of the TPU's 128 lanes
# The most booleans a rule may be evaluated into on the host (2 GiB): past
# it the automatic choice moves on to the flash core (tables on device).
HOST_MASK_LIMIT = 1 << 31

# The private backward this kernel calls, as jax 0.10.2 defines it.
_BWD_PARAMETERS = ("save_residuals", "mask_value", "is_mqa", "block_sizes",
                   "residual_checkpoint_name", "mask_function",
                   "attn_logits_soft_cap", "interpret", "res", "do")
_RESIDUALS = 9  # (q, k, v, segment_ids, sinks, out, lse, dq_info, dkv_info)


def _splash():
  """Splash's kernel and mask modules (imported on first use: Pallas' TPU
  backend costs import time every other user of the library would pay)."""
  from jax.experimental.pallas.ops.tpu import splash_attention
  return (splash_attention.splash_attention_kernel,
          splash_attention.splash_attention_mask)


def _backward_problem() -> str | None:
  """Why this jax's splash backward cannot be called as written, or None."""
  kernel_lib, _ = _splash()
  bwd = getattr(kernel_lib, "_splash_attention_bwd", None)
  residuals = getattr(kernel_lib, "SplashResidualsType", None)
  if (bwd is None or residuals is None
      or tuple(inspect.signature(bwd).parameters) != _BWD_PARAMETERS
      or len(typing.get_args(residuals)) != _RESIDUALS):
    return (f"this jax ({jax.__version__}) has another splash backward than "
            "the one this kernel calls (jax 0.10.2's _splash_attention_bwd, "
            "needed for the lse and empty rows)")
  return None


def _soft_cap(score_mod) -> tuple[float | None, str | None]:
  """``(cap, None)`` for exactly one ``aj.soft_cap``; ``(None, reason)``
  for any other modifier; ``(None, None)`` without one."""
  if score_mod is None:
    return None, None
  fn = getattr(score_mod, "fn", None)
  cap = getattr(fn, "cap", None)
  if (isinstance(score_mod, score_mods.ScoreMod) and isinstance(cap, float)
      and score_mod.params is None and fn == score_mods.soft_cap(cap).fn):
    return cap, None
  return None, ("its only score modifier is one aj.soft_cap(c) (splash's "
                "attn_logits_soft_cap); other modifiers, chains included, "
                "need 'flash' or 'dense'")


def _concrete(x) -> np.ndarray | None:
  """``x`` as NumPy, or None when it is traced."""
  try:
    return np.asarray(x)
  except (jax.errors.TracerArrayConversionError,
          jax.errors.ConcretizationTypeError):
    return None


def _rule_mask(ops, t: int, s: int) -> np.ndarray | None:
  """The rule evaluated on every ``(b, h, q_idx, kv_idx)``: bool NumPy over
  the grouped leading dims ``[..., T|1, S|1]``; None when it is traced."""
  lead = ops.leading
  b, h = intervals.rule_indices(lead, np)
  rank = len(lead) + 2
  rows = np.arange(t, dtype=np.int32).reshape((1,) * len(lead) + (t, 1))
  cols = np.arange(s, dtype=np.int32).reshape((1,) * len(lead) + (1, s))
  # A rule written with jnp on concrete arrays is evaluated now, not staged
  # into the caller's jit (splash needs its mask on the host).
  with jax.ensure_compile_time_eval():
    try:
      allowed = ops.rule.mask_fn(b, h, rows, cols)
    except (jax.errors.TracerArrayConversionError,
            jax.errors.ConcretizationTypeError,
            jax.errors.TracerBoolConversionError):
      return None
    allowed = _concrete(allowed)
  if allowed is None:
    return None
  allowed = allowed.astype(bool)
  allowed = allowed.reshape((1,) * (rank - allowed.ndim) + allowed.shape)
  return base.split_groups(allowed, ops.groups, -3)


def _static_mask(ops, t: int, s: int) -> tuple[np.ndarray | None, str | None]:
  """The dense mask and the rule as one bool NumPy ``[..., T|1, S|1]``
  (None without them), or the reason they cannot be static."""
  mask = None
  if ops.dense is not None:
    mask = _concrete(ops.dense)
    if mask is None:
      return None, ("its mask is static (block tables built on the host), "
                    "and this dense mask is traced (under jax.jit every mask "
                    "array is): express it as lengths, segment ids or a "
                    "rule, or use 'flash'")
    mask = mask.astype(bool)
  if ops.rule is not None:
    rule = _rule_mask(ops, t, s)
    if rule is None:
      return None, ("its mask is static (block tables built on the host), "
                    "and this mask rule reads traced values: use "
                    "'flash', which builds its tables on device")
    if mask is None:
      mask = rule
    else:
      rank = max(mask.ndim, rule.ndim)
      mask = (mask.reshape((1,) * (rank - mask.ndim) + mask.shape)
              & rule.reshape((1,) * (rank - rule.ndim) + rule.shape))
  return mask, None


@dataclasses.dataclass(frozen=True)
class Splash(base.Kernel):
  """Splash attention (TPU Pallas), where it gives the contract's numbers.

  Attributes:
    interpret: run the Pallas kernels in the interpreter (any backend; for
      tests: slow).
    block_q: query block (a multiple of 128), forward and backward alike.
    block_kv: key/value block (a multiple of 128). One size for the forward
      and both backward kernels keeps a row's visited blocks the same in
      each, which the empty-row handling relies on.
  """
  interpret: bool = False
  block_q: int = 128
  block_kv: int = 128
  name = "splash"
  float64 = False  # float32 compute
  min_scores = base.MIN_SCORES
  backend = "tpu"
  # One Pallas call: XLA cannot split it over sharded batch or heads, so
  # with a partition it runs per shard (kernels.per_shard).
  partitionable = False
  forward_mode = False  # its gradient is a custom VJP
  # Positions (q_offset/kv_offset) are not mapped onto splash's masks.
  implements = frozenset({"causal", "window", "q_lengths", "kv_lengths",
                          "q_segment_ids", "kv_segment_ids", "dense",
                          "rule", "score_mod", "sinks", "return_lse"})

  def __post_init__(self):
    if not isinstance(self.interpret, bool):
      raise TypeError(f"interpret must be a Python bool, got "
                      f"{self.interpret!r}.")
    for name in ("block_q", "block_kv"):
      size = getattr(self, name)
      base.check_block_size(name, size)
      if size % _LANES:
        raise ValueError(f"{name} must be a multiple of {_LANES} (splash's "
                         f"blocks are whole lane tiles), got {size}.")

  def supports(self, problem: base.Problem) -> str | None:
    reason = (base.no_weights_or_dropout(problem)
              or base.no_max_logits(problem))
    if reason:
      return reason
    ops = problem.ops
    if ops.bias is not None:
      return ("splash takes no additive bias (use 'flash' or 'dense', "
              "or a mask for -inf entries)")
    _, reason = _soft_cap(ops.score_mod)
    if reason:
      return reason
    t, s = ops.query.shape[-2], ops.key.shape[-2]
    if t == 0 or s == 0:
      return f"it needs T and S >= 1, got T={t}, S={s}"
    if ops.rule is not None:
      batch = base.rule_batch(ops.rule.mask_fn, ops.leading, s)
      cells = math.prod(batch) * t * s
      if cells > HOST_MASK_LIMIT:
        return (f"its mask is static: this rule would be evaluated on the "
                f"host into {cells} booleans ({math.prod(batch)} slices of "
                f"T x S = {t} x {s}), over its limit of {HOST_MASK_LIMIT}; "
                "'flash' builds the rule's tables on device")
    _, reason = _static_mask(ops, t, s)
    return reason or _backward_problem()

  def declines(self, problem: base.Problem) -> str | None:
    if self.interpret:
      return "interpret mode is a check, not a speed"
    return super().declines(problem)

  def __call__(self, problem: base.Problem):
    ops = problem.ops
    t, s = ops.query.shape[-2], ops.key.shape[-2]
    lead = ops.batch_shape
    rank = len(lead)

    def full(x, core):  # leading dims right-aligned to the batch's rank
      if x is None:
        return None
      x = jnp.asarray(x) if not isinstance(x, np.ndarray) else x
      return x.reshape((1,) * (rank + core - x.ndim) + x.shape)

    dtype = problem.out_dtype
    q, k, v = (full(x, 2).astype(dtype)
               for x in (ops.query, ops.key, ops.value))
    rows = dict(q_segment_ids=full(ops.q_segment_ids, 1),
                kv_segment_ids=full(ops.kv_segment_ids, 1),
                kv_len=full(ops.kv_lengths, 0), q_len=full(ops.q_lengths, 0))
    sinks = full(ops.sinks, 0)
    static, _ = _static_mask(ops, t, s)
    if static is not None:
      static = static.reshape((1,) * (rank + 2 - static.ndim) + static.shape)
    # The last leading axis becomes the kernel's query heads when keys,
    # values and every per-row array are shared along it (GQA's G, MQA's
    # N); otherwise each slice is its own one-head call.
    shared = (rank >= 1 and lead[-1] > 1
              and k.shape[rank - 1] == v.shape[rank - 1] == 1
              and all(x is None or x.shape[rank - 1] == 1
                      for x in rows.values()))
    if not shared:
      q, k, v = (x[..., None, :, :] for x in (q, k, v))
      rows = {n: None if x is None else
              (x[..., None, :] if n.endswith("seg") else x[..., None])
              for n, x in rows.items()}
      sinks = None if sinks is None else sinks[..., None]
      if static is not None:
        static = static[..., None, :, :]
    heads = q.shape[-3]
    cap, _ = _soft_cap(ops.score_mod)
    settings = dict(t=t, s=s, scale=problem.scale, cap=cap, causal=ops.causal,
                    window=ops.window, lse_grad=problem.return_lse)
    out, lse = self._split(q, k, v, rows, sinks, static, settings)
    out_lead = lead if shared else lead + (1,)
    out = jnp.broadcast_to(out, out_lead[:-1] + (heads, t, v.shape[-1]))
    lse = jnp.broadcast_to(lse, out_lead[:-1] + (heads, t))
    if not shared:
      out, lse = out[..., 0, :, :], lse[..., 0, :]
    out = base.merge_groups(out.astype(dtype), ops.groups, -3)
    lse = base.merge_groups(lse, ops.groups, -2)
    return base.Result(out, lse=lse if problem.return_lse else None)

  def _split(self, q, k, v, rows, sinks, static, settings):
    """Runs one kernel per distinct slice of the static mask.

    Splash's mask is one static value per kernel (it may differ per query
    head within a call), so the leading axes along which it differs are
    cut here, in Python, and the results stacked again.
    """
    if static is None:
      return self._run(q, k, v, rows, sinks, None, **settings)
    for axis in range(static.ndim - 3):  # the leading axes but the heads'
      if static.shape[axis] == 1:
        continue

      def take(x, i, axis=axis):  # slice i of axis (size 1: shared, kept)
        if x is None or x.shape[axis] == 1:
          return x
        return x[(slice(None),) * axis + (slice(i, i + 1),)]

      parts = [self._split(take(q, i), take(k, i), take(v, i),
                           {n: take(x, i) for n, x in rows.items()},
                           take(sinks, i), take(static, i), settings)
               for i in range(static.shape[axis])]
      return tuple(jnp.concatenate(p, axis) for p in zip(*parts))
    static = static[(0,) * (static.ndim - 3)]  # [G|1, T, S]
    return self._run(q, k, v, rows, sinks, static, **settings)

  def _run(self, q, k, v, rows, sinks, static, *, t, s, scale, cap, causal,
           window, lse_grad):
    """One splash kernel over ``q [..., G, T, H]`` and ``k, v [..., 1, S,
    H|Hv]``, vmapped over the other leading dims."""
    tp = -(-t // self.block_q) * self.block_q  # whole blocks
    sp = -(-s // self.block_kv) * self.block_kv
    bounds = intervals.bounds(causal, window)
    masks, pattern, key_seen = _head_masks(static, bounds, t, s, tp, sp,
                                           q.shape[-3])
    segmented = (rows["q_segment_ids"] is not None or rows["kv_len"] is not None
                 or sp > s)
    # One predicate for the whole call, outside the vmap below (where a
    # per-slice cond would run both branches).
    garbage = checks.any_nonfinite(q, k, v)
    call = _Call(self._kernel(masks, cap), t, s, tp, sp, bounds, pattern,
                 key_seen, segmented, garbage, scale, lse_grad)
    operands = (q, k[..., 0, :, :], v[..., 0, :, :],
                *(_drop_head(rows[n], 1) for n in ("q_segment_ids", "kv_segment_ids")),
                *(_drop_head(rows[n], 0) for n in ("kv_len", "q_len")),
                sinks)
    return base.broadcast_vmap(functools.partial(_one_slice, call),
                                    (3, 2, 2, 1, 1, 0, 0, 1), operands)

  def _kernel(self, masks, cap):
    """Splash's MQA kernel over ``masks`` (one per query head), at our blocks."""
    kernel_lib, mask_lib = _splash()
    sizes = kernel_lib.BlockSizes(
        block_q=self.block_q, block_kv=self.block_kv,
        block_kv_compute=self.block_kv, block_q_dkv=self.block_q,
        block_kv_dkv=self.block_kv, block_kv_dkv_compute=self.block_kv,
        block_q_dq=self.block_q, block_kv_dq=self.block_kv)
    return kernel_lib.make_splash_mqa(
        mask_lib.MultiHeadMask(masks), block_sizes=sizes,
        save_residuals=True, attn_logits_soft_cap=cap, head_shards=1,
        q_seq_shards=1, interpret=self.interpret)


class _Call(typing.NamedTuple):
  """What every slice of one ``_run`` shares: the vmap closes over it."""
  kernel: typing.Any  # splash's kernel (make_splash_mqa)
  t: int
  s: int
  tp: int  # T and S padded to whole blocks
  sp: int
  bounds: typing.Any  # intervals.bounds of causal and window
  pattern: np.ndarray | None  # [G|1, T, S]: static mask & band, or None
  key_seen: np.ndarray | None  # [S]: keys some row may see, or None (all)
  segmented: bool  # splash gets segment ids (ours, kv lengths, padding)
  garbage: jax.Array  # bool scalar: some q, k or v entry is not finite
  scale: typing.Any  # float or a traced scalar
  lse_grad: bool


def _head_masks(static, bounds, t: int, s: int, tp: int, sp: int,
                heads: int):
  """Splash's masks per head (lazy, or NumPy [Tp, Sp]), pattern and key_seen."""
  _, mask_lib = _splash()
  if static is None:
    shape = (tp, sp)
    if bounds.left is None and bounds.right is None:
      head_mask = mask_lib.FullMask(shape)
    elif bounds.left is None and bounds.right == 0:
      head_mask = mask_lib.CausalMask(shape, offset=s - t)
    else:
      head_mask = mask_lib.LocalMask(shape, (bounds.left, bounds.right),
                                     offset=s - t)
    # The rows' bands overlap, so together they see keys from the first
    # row's left bound on (the last row's right bound is past S - 1).
    first = 0 if bounds.left is None else s - t - bounds.left
    key_seen = np.arange(s) >= first if first > 0 else None
    return [head_mask] * heads, None, key_seen
  band = intervals.visible(np.arange(t)[:, None], np.arange(s)[None, :],
                           s - t, bounds)
  allowed = np.broadcast_to(static, static.shape[:1] + (t, s))
  if band is not None:
    allowed = allowed & band
  key_seen = allowed.any(axis=(0, 1))  # [S]: shared keys, any head
  padded = np.zeros(allowed.shape[:1] + (tp, sp), bool)
  padded[:, :t, :s] = allowed
  masks = [mask_lib.NumpyMask(m) for m in padded]
  return (masks * heads if len(masks) == 1 else masks), allowed, key_seen


def _one_slice(c: _Call, q, k, v, q_segment_ids, kv_segment_ids, kv_len,
               q_len, sink):
  """One slice's call: q ``[G, T, H]``, k ``[S, H]``, v ``[S, Hv]``, sink ``[G|1]``."""
  t, s = c.t, c.s
  q, k, v, q_code, kv_code = checks.sanitize(q, k, v)
  code = _slice_codes(c, q_code, kv_code, q_segment_ids, kv_segment_ids,
                      kv_len, q_len)  # [G, T]
  q = (q.astype(jnp.float32) * jnp.asarray(c.scale, jnp.float32)).astype(
      q.dtype)
  if q_len is not None:  # rows past q_len are not queries (may be NaN)
    q = jnp.where((jnp.arange(t) < q_len)[None, :, None], q, 0)
  segment_ids, seen = _kernel_segments(c, q_segment_ids, kv_segment_ids,
                                       kv_len)
  if seen is not None:  # padding may hold NaN: no product may meet it
    k = jnp.where(seen[:, None], k, 0)
    v = jnp.where(seen[:, None], v, 0)
  q = jnp.pad(q, ((0, 0), (0, c.tp - t), (0, 0)))
  k, v = (jnp.pad(x, ((0, c.sp - s), (0, 0))) for x in (k, v))
  sink = None if sink is None else jnp.broadcast_to(
      sink.astype(jnp.float32), (q.shape[0],))
  out, lse = _attend(c.kernel, c.lse_grad, q, k, v, segment_ids, sink)
  out, lse = out[:, :t], lse[:, :t]
  if sink is None:  # rows that see nothing: ours are 0 and -inf
    sees = lse > c.kernel.kwargs["mask_value"] / 2
    out = jnp.where(sees[..., None], out, 0)
    lse = jnp.where(sees, lse, -jnp.inf)
  if q_len is not None:
    inside = jnp.arange(t) < q_len
    out = jnp.where(inside[None, :, None], out, 0)
    lse = jnp.where(inside[None, :], lse, -jnp.inf)
  return checks.poison(code, out, lse)


def _slice_codes(c: _Call, q_code, kv_code, q_segment_ids, kv_segment_ids,
                 kv_len, q_len):
  """Each row's garbage code ``[G, T]``, which splash cannot carry (0:
  clean)."""
  t, s = c.t, c.s

  def visible(start, size):  # rows [start, start + size): [G|1, size, S]
    rows = start + jnp.arange(size)[:, None]
    ids = None if q_segment_ids is None else (
        jax.lax.dynamic_slice_in_dim(q_segment_ids, start, size)[:, None],
        kv_segment_ids[None, :])
    ok = intervals.visible(rows, jnp.arange(s)[None, :], s - t, c.bounds,
                           q_len, kv_len, *(ids or (None, None)))
    if c.pattern is not None:
      tile = jax.lax.dynamic_slice_in_dim(jnp.asarray(c.pattern), start,
                                          size, axis=1)
      ok = tile if ok is None else tile & ok[None]
    return ok

  return jax.lax.cond(
      c.garbage,
      lambda: checks.seen_codes_by_rows(visible, q_code, kv_code, t),
      lambda: jnp.zeros(q_code.shape, jnp.float32))


def _kernel_segments(c: _Call, q_segment_ids, kv_segment_ids, kv_len):
  """Splash's SegmentIds, lengths and padding as ids no query has; keys seen."""
  t, s = c.t, c.s
  seen = None if c.key_seen is None else jnp.asarray(c.key_seen)
  if not c.segmented:
    return None, seen
  if q_segment_ids is not None:
    q_ids, k_ids = _renumber(q_segment_ids, kv_segment_ids)
  else:
    q_ids = jnp.zeros((t,), jnp.int32)
    k_ids = jnp.zeros((s,), jnp.int32)
  if kv_len is not None:
    k_ids = jnp.where(jnp.arange(s) < kv_len, k_ids, -1)
  valid = k_ids >= 0
  seen = valid if seen is None else seen & valid
  kernel_lib, _ = _splash()
  segment_ids = kernel_lib.SegmentIds(
      jnp.pad(q_ids, (0, c.tp - t), constant_values=-2),
      jnp.pad(k_ids, (0, c.sp - s), constant_values=-1))
  return segment_ids, seen


def _drop_head(x, core: int):
  """A per-row array ``[..., 1, *core]`` without its (size-1) head axis."""
  return None if x is None else x[(Ellipsis, 0) + (slice(None),) * core]


def _renumber(q_segment_ids, kv_segment_ids):
  """Segment ids as ranks among the sorted query ids: equal ids stay equal,
  a key id that no query has becomes -1 (so -1 and -2 match nothing)."""
  t = q_segment_ids.shape[0]
  ordered = jnp.sort(q_segment_ids)
  q_ids = jnp.searchsorted(ordered, q_segment_ids, side="left")
  at = jnp.searchsorted(ordered, kv_segment_ids, side="left")
  found = (at < t) & (ordered[jnp.minimum(at, t - 1)] == kv_segment_ids)
  return q_ids.astype(jnp.int32), jnp.where(found, at, -1).astype(jnp.int32)


def _attend(kernel, lse_grad: bool, q, k, v, segment_ids, sinks):
  """Splash with residuals: ``(out [G, Tp, Hv], raw lse [G, Tp])``,
  differentiable in both (through lse only when ``lse_grad``)."""
  fn = _WITH_LSE if lse_grad else _WITHOUT_LSE
  return fn(kernel, q, k, v, segment_ids, sinks)


def _make(lse_grad: bool):
  """The custom VJP: splash's forward with residuals, splash's backward
  kernels with the lse cotangent folded in (module docstring)."""

  @jax.custom_vjp
  def attend(kernel, q, k, v, segment_ids, sinks):
    out, (lse,) = kernel(q, k, v, segment_ids=segment_ids, sinks=sinks)
    return out, lse

  def fwd(kernel, q, k, v, segment_ids, sinks):
    out, lse = attend(kernel, q, k, v, segment_ids, sinks)
    return (out, lse), (kernel, q, k, v, segment_ids, sinks, out, lse)

  def bwd(res, cotangents):
    kernel, q, k, v, segment_ids, sinks, out, lse = res
    d_out, d_lse = cotangents
    # A row that visits no block is 0/0 in splash's forward; its cotangent
    # is zero (cut off after the call), so its output may be read as 0.
    out = jnp.where(jnp.isfinite(out), out, 0).astype(jnp.float32)
    d_out = d_out.astype(q.dtype)
    hv = v.shape[-1]
    if lse_grad:  # D = rowsum(o * do) becomes D - dlse; dP is unchanged
      v = jnp.concatenate([v, jnp.zeros(v.shape[:-1] + (1,), v.dtype)], -1)
      out = jnp.concatenate([out, -d_lse.astype(jnp.float32)[..., None]], -1)
      d_out = jnp.concatenate(
          [d_out, jnp.ones(d_out.shape[:-1] + (1,), d_out.dtype)], -1)
    kernel_lib, _ = _splash()
    infos = [_collapsed(info)
             for info in (kernel.dq_mask_info, kernel.dkv_mask_info)]
    kwargs = dict(kernel.kwargs, save_residuals=False)
    grads = kernel_lib._splash_attention_bwd(
        **kwargs, res=(q, k, v, segment_ids, sinks, out, lse, *infos),
        do=d_out)
    _, _, _, dq, dk, dv, _, d_sinks = grads
    dv = dv[..., :hv]
    d_sinks = None if sinks is None else d_sinks.astype(sinks.dtype)
    return None, dq, dk, dv, None, d_sinks

  attend.defvjp(fwd, bwd)
  return attend


def _collapsed(info):
  """A MaskInfo with its partial blocks ``[-1, bq, bkv]``, as splash's own
  entry (``_splash_attention``) hands them to its kernels."""
  if info is None or info.partial_mask_blocks is None:
    return info
  blocks = info.partial_mask_blocks
  return info._replace(partial_mask_blocks=blocks.reshape(
      (-1,) + blocks.shape[-2:]))


_WITH_LSE = _make(True)
_WITHOUT_LSE = _make(False)
