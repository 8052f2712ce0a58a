"""The Pallas GPU kernel: flash attention as fused Triton kernels.

Shape glossary: T query length, S key/value length, H head dim, Hv value
head dim; bq/bk query and key block sizes; Tp/Sp lengths padded to whole
blocks; nq/nk the numbers of query and key blocks.

The same block walk as the CPU flash core (``flash_core``), written with
``pl.pallas_call`` so that each pass is one kernel instead of a loop of
small XLA ops: one program per query block walks the key blocks it may see
(forward; the dq pass), one program per key block walks the query blocks
that see it (the dk/dv pass of the FlashAttention-2 backward). Which blocks
a block visits (causal and window bounds, lengths, segment ids, a block
mask's tables) and which of them are full is worked out before the kernels,
in plain JAX, with the flash core's own functions: a kernel reads one row
``(lo, hi, full_lo, full_hi, first, last)`` of that table and loops. Inside
a block the logits get everything the flash core applies: bias, score
modifier (with its gradient, also into the arrays it reads), causal and
window bounds, lengths, segment ids, a dense mask, a mask rule; sinks join
the softmax after the kernel, from its lse. Dropout (``dropout_rate``) is
the dense kernel's: each kernel draws a block's keep mask again from the
call's seed and the entries' ``(b, h, q_idx, kv_idx)`` (``core/dropout.py``;
no ``[T, S]`` bits are stored), so the same ``dropout_rng`` and rate give
the dense kernel's numbers. The forward kernel accumulates the kept
probabilities over ``1 - rate`` while its softmax total and lse stay
undropped; the backward kernels apply the same mask and scale to P (for
dv) and to ``dO V^T`` (for dP). The seed words and the rate (which may be
traced) are small operands of the kernels. As in the flash core, every
tile is made finite as it is loaded (NaN and inf replaced by 0), the
forward kernel also writes each row's ``checks`` code (the largest over
the keys and values it may see, and its own query), and those rows are
poisoned after the custom VJP: garbage reaches only the rows that may see
it.

Dots take the inputs' dtype with float32 accumulation (bfloat16 tensor-core
dots for bfloat16 inputs; the probabilities and their cotangents are rounded
to it before their dots, as in FlashAttention-2); softmax statistics,
accumulators and the score modifier are float32.

Written for one head (``[T, H]`` against ``[S, H]``) and lifted over heads
by ``base.lift_heads``; ``vmap`` of a ``pallas_call`` adds the heads
to its grid. Arrays a score modifier or a mask rule reads are passed to the
kernels as operands (a kernel may not close over arrays): the function is
traced once at block shapes (``jax.make_jaxpr``) and replayed inside.
This module is the kernel (what it implements and refuses, its launch)
and one head's driver (padding, block tables, the custom VJP, the three
``pallas_call`` launches); the kernels' bodies, with the block-level
helpers they share, are ``kernels/pallas_blocks.py``.

On a GPU it lowers through Triton (``num_warps``/``num_stages`` and block
sizes by head dim, ``_launch``); ``PallasGpu(interpret=True)`` runs the
same kernels anywhere, slowly, which is how the contract suite checks it on
CPU. A score modifier or mask rule that indexes arrays by value (ALiBi's
slopes[h], T5's table lookup) has no Triton lowering (``dynamic_slice`` and
``gather`` of a loaded value), so on a GPU ``supports`` refuses those and
the automatic choice moves on to the flash core.

Not yet run on a GPU: its numbers are checked in the interpreter (the
contract suite) and its Triton lowering for ``cuda`` from a CPU
(``tests/test_pallas_gpu.py``); speed and the block/warp choice are
unmeasured.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from attention_jax.core import checks
from attention_jax.kernels import base
from attention_jax.kernels import flash
from attention_jax.kernels import flash_core
from attention_jax.kernels import pallas_blocks
from attention_jax.masking import intervals
from attention_jax.scores import score_mods

_F32 = jnp.float32
# The primitives a score modifier or rule (and the modifier's VJP) may use:
# those Pallas's Triton lowering has rules for in jax 0.10, less those whose
# rules take only some shapes or directions (concatenate, cumsum, split,
# stack) and control flow. Reading an array at a traced index (gather,
# dynamic_slice: ALiBi's slopes[h], T5's table) has no rule.
_LOWERED = frozenset({
    "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan",
    "atan2", "atanh", "bitcast_convert_type", "broadcast_in_dim", "cbrt",
    "ceil", "clamp", "closed_call", "convert_element_type", "cos", "cosh",
    "custom_jvp_call", "div", "eq", "erf_inv", "exp", "exp2", "expm1",
    "floor", "ge", "gt", "integer_pow", "iota", "is_finite", "jit", "le",
    "log", "log1p", "logistic", "lt", "max", "min", "mul", "ne", "neg",
    "nextafter", "not", "or", "pow", "reduce_max", "reduce_min",
    "reduce_sum", "rem", "reshape", "rsqrt", "select_n", "shift_left",
    "shift_right_arithmetic", "shift_right_logical", "sign", "sin", "sinh",
    "sqrt", "square", "squeeze", "stop_gradient", "sub", "tan", "tanh",
    "transpose", "xor"})


@dataclasses.dataclass(frozen=True)
class PallasGpu(base.Kernel):
  """Fused flash attention for GPUs (Pallas, Triton lowering).

  ``block_q``/``block_k`` None pick by head dim (``_launch``); a block
  mask built at other sizes has its tables rebuilt at these from its rule.
  ``interpret=True`` runs the kernels on any backend in Pallas's
  interpreter (a correctness check, not a fast path).
  """
  block_q: int | None = None
  block_k: int | None = None
  num_warps: int | None = None
  num_stages: int = 2
  interpret: bool = False
  name = "pallas_gpu"
  float64 = False  # float32 compute
  min_scores = base.MIN_SCORES
  backend = "gpu"
  # One Pallas call: XLA cannot split it over sharded batch or heads, so
  # with a partition it runs per shard (kernels.per_shard).
  partitionable = False
  forward_mode = False  # its gradient is a custom VJP
  # The flash core's features but max logits and pages.
  implements = frozenset({"causal", "window", "q_lengths", "kv_lengths",
                          "q_segment_ids", "kv_segment_ids", "dense",
                          "rule", "q_offset", "kv_offset", "bias",
                          "score_mod", "sinks", "dropout_rate",
                          "return_lse"})

  def __post_init__(self):
    base.check_block_size("block_q", self.block_q)
    base.check_block_size("block_k", self.block_k)
    base.check_block_size("num_warps", self.num_warps)
    base.check_block_size("num_stages", self.num_stages)

  def supports(self, problem: base.Problem) -> str | None:
    reason = base.no_weights(problem) or base.no_max_logits(problem)
    if reason or self.interpret:
      return reason
    ops = problem.ops
    bq, bk = self._blocks(ops)
    for name, size in (("block_q", bq), ("block_k", bk)):
      if size < 16 or size & (size - 1):
        return f"{name}={size}: Triton's blocks are powers of two >= 16"
    return _unlowered(ops, bq, bk)

  def declines(self, problem: base.Problem) -> str | None:
    if self.interpret:
      return "interpret mode is a check, not a speed"
    return super().declines(problem)

  def _blocks(self, ops) -> tuple[int, int]:
    """The kernel's tile sizes (a block mask's own sizes are not used:
    its tables are rebuilt at these when they differ, ``_own_tables``)."""
    bq, bk, _ = _launch(ops.query.shape[-1], ops.query.shape[-2],
                        ops.key.shape[-2])
    return (bq if self.block_q is None else self.block_q,
            bk if self.block_k is None else self.block_k)

  def __call__(self, problem: base.Problem):
    ops = problem.ops
    bq, bk = self._blocks(ops)
    ops = flash.with_rule_tables(_own_tables(ops, bq, bk), bq, bk)
    _, _, warps = _launch(ops.query.shape[-1], bq, bk)
    launch = pallas_blocks.Launch(self.interpret, self.num_warps or warps,
                                  self.num_stages)
    head = functools.partial(
        _single_head, launch=launch, scale=problem.scale,
        is_causal=ops.causal, window=ops.window, score_mod=ops.score_mod,
        block_q=bq, block_k=bk, out_dtype=problem.out_dtype)
    # The dropout seed and rate (or None, None): unmapped, one per call.
    return base.lift_heads(head, ops, flash.drop_operands(problem),
                                (1, 0))


def _own_tables(ops, bq: int, bk: int):
  """``ops`` with a block mask's tables dropped unless they are at this
  kernel's blocks (``block_mask`` clips blocks to T and S, and a clipped
  block is the kernel's one padded block); ``flash.with_rule_tables`` then
  builds them from the rule at the kernel's sizes. A block mask's sizes
  are the flash core's; Triton needs its own tiles."""
  bm = ops.rule
  if bm is None or bm.kinds is None:
    return ops
  t, s = ops.query.shape[-2], ops.key.shape[-2]
  if (bm.block_q, bm.block_k) == (min(bq, t), min(bk, s)):
    return ops
  return ops._replace(rule=bm.with_tables((None,) * 5))


def _launch(h: int, t: int, s: int) -> tuple[int, int, int]:
  """``(block_q, block_k, num_warps)`` for head dim ``h``.

  Following jax's ``pallas/ops/gpu/attention.py`` and FlashAttention-2's
  Triton kernel: 128 x 64 blocks and 4 warps up to H = 64; 64 x 64 and 8
  warps beyond (a [bq, H] query tile and [bk, H] key tile stay in
  registers/shared memory). Short sequences take one block (a power of
  two >= 16). Not tuned on hardware.
  """
  bq, bk = (128, 64) if h <= 64 else (64, 64)
  fit = lambda n, b: min(b, max(16, 1 << max(n - 1, 0).bit_length()))  # noqa: E731
  return fit(t, bq), fit(s, bk), 4 if h <= 64 else 8


def _unlowered(ops, bq: int, bk: int) -> str | None:
  """Why a score modifier or rule has no Triton lowering, or None.

  Both are traced at one block's shapes (the modifier with its VJP, which
  the backward kernels run) and every primitive must be in ``_LOWERED``;
  every array they read must have power-of-two dims.
  """
  i32 = jnp.int32
  idx = (jnp.zeros((), i32), jnp.zeros((), i32), jnp.zeros((bq, 1), i32),
         jnp.zeros((1, bk), i32))
  checks = []
  mod = ops.score_mod
  if mod is not None:
    score = jnp.zeros((bq, bk), _F32)
    if isinstance(mod, score_mods.ScoreMod):  # its params are differentiated
      fn, args = (lambda x, p: mod.fn(x, *idx, p)), (score, mod.params)
    else:
      fn, args = (lambda x: mod(x, *idx)), (score,)

    def with_vjp():
      out, vjp = jax.vjp(lambda *a: jnp.broadcast_to(fn(*a), score.shape)
                         .astype(_F32), *args)
      return out, vjp(jnp.ones_like(out))

    checks.append(("score_mod", with_vjp))
  if ops.rule is not None:
    checks.append(("the mask rule", lambda: ops.rule.mask_fn(*idx)))
  for what, traced in checks:
    try:
      closed = jax.make_jaxpr(traced)()
    except Exception:  # noqa: BLE001 (e.g. a rule over per-head arrays)
      return (f"{what} could not be traced at one block's shapes, which "
              "the Triton lowering needs")
    missing = sorted(_primitives(closed.jaxpr) - _LOWERED)
    if missing:
      return (f"{what} uses {', '.join(missing)} (its VJP included), which "
              "Pallas's Triton lowering lacks (gather and dynamic_slice read "
              "an array at a traced index, e.g. ALiBi's slopes[h])")
    arrays = list(closed.consts)
    if mod is not None and isinstance(mod, score_mods.ScoreMod):
      arrays += jax.tree.leaves(mod.params)
    for const in arrays:
      if any(d & (d - 1) for d in jnp.shape(const)):
        return (f"{what} reads an array of shape {jnp.shape(const)}; "
                "Triton's tensors have power-of-two dims")
  return None


def _primitives(jaxpr) -> set[str]:
  """The primitives of ``jaxpr`` and of the jaxprs inside it."""
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    for param in eqn.params.values():
      for inner in param if isinstance(param, (tuple, list)) else (param,):
        inner = getattr(inner, "jaxpr", inner)
        if hasattr(inner, "eqns"):
          names |= _primitives(inner)
  return names


def _as_operand(x):
  """A kernel operand: 0-d arrays become ``[1]`` (read back reshaped)."""
  x = jnp.asarray(x)
  return x.reshape(1) if x.ndim == 0 else x


def _call(kernel, sp: pallas_blocks.Spec, grid: int, inputs, in_specs,
          out_shape, out_specs, aliases=None):
  return pl.pallas_call(
      kernel, grid=(grid,), in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape, input_output_aliases=aliases or {},
      interpret=sp.launch.interpret,
      compiler_params=plgpu.CompilerParams(
          num_warps=sp.launch.num_warps, num_stages=sp.launch.num_stages),
  )(*inputs)


def _whole(x):
  """A BlockSpec giving every program the whole array."""
  return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def _rows(block: int, width: int | None = None):
  """A BlockSpec giving program ``n`` rows ``[n * block, (n + 1) * block)``."""
  if width is None:
    return pl.BlockSpec((block,), lambda n: (n,))
  return pl.BlockSpec((block, width), lambda n: (n, 0))


def _shapes(sp: pallas_blocks.Spec, mod_diff):
  mod_shapes = () if sp.mod is None else tuple(
      jnp.shape(c) for c in sp.mod.consts)
  rule_shapes = () if sp.rule is None else tuple(
      jnp.shape(c) for c in sp.rule.consts)
  return mod_shapes, tuple(jnp.shape(c) for c in mod_diff), rule_shapes


def _forward(sp: pallas_blocks.Spec, q, k, v, fixed: pallas_blocks.Refs):
  st = sp.st
  flat = [_as_operand(x) for x in pallas_blocks.flatten(fixed)]
  shapes = _shapes(sp, fixed.mod_diff)
  kernel = functools.partial(pallas_blocks.forward_kernel, sp, shapes,
                             len(flat))
  hv = v.shape[-1]
  out, lse, code = _call(
      kernel, sp, q.shape[0] // st.bq, [q, k, v, *flat],
      [_rows(st.bq, q.shape[-1]), _whole(k), _whole(v),
       *map(_whole, flat)],
      [jax.ShapeDtypeStruct((q.shape[0], hv), v.dtype),
       jax.ShapeDtypeStruct((q.shape[0],), _F32),
       jax.ShapeDtypeStruct((q.shape[0],), _F32)],
      [_rows(st.bq, hv), _rows(st.bq), _rows(st.bq)])
  return out, lse, code


def _backward(sp: pallas_blocks.Spec, q, k, v, out, lse, d_out, d_lse,
              key_fixed: pallas_blocks.Refs, query_fixed: pallas_blocks.Refs):
  """dq, dk, dv, dbias, d(mod arrays) from the two backward kernels."""
  st = sp.st
  delta = jnp.sum(d_out.astype(_F32) * out.astype(_F32), -1) - d_lse  # [Tp]
  common = [q, k, v, d_out, lse, delta]
  shapes = _shapes(sp, key_fixed.mod_diff)
  num_k = k.shape[0] // st.bk
  # dk, dv (and dbias, d(mod arrays)): one program per key block.
  flat = [_as_operand(x) for x in pallas_blocks.flatten(key_fixed)]
  out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype),
               jax.ShapeDtypeStruct(v.shape, v.dtype)]
  out_specs = [_rows(st.bk, k.shape[-1]), _rows(st.bk, v.shape[-1])]
  inputs = [*common, *flat]
  in_specs = [*map(_whole, common), *map(_whole, flat)]
  aliases = {}
  if sp.bias:  # each program writes the tiles it visits; the rest stay 0
    zeros = jnp.zeros(key_fixed.bias.shape, _F32)
    aliases[len(inputs)] = 2
    inputs.append(zeros)
    in_specs.append(_whole(zeros))
    out_shape.append(jax.ShapeDtypeStruct(zeros.shape, _F32))
    out_specs.append(_whole(zeros))
  for c in key_fixed.mod_diff:  # one partial sum per key block
    shape = (num_k,) + (jnp.shape(c) or (1,))
    out_shape.append(jax.ShapeDtypeStruct(shape, _F32))
    out_specs.append(pl.BlockSpec((1,) + shape[1:], _slab_index(len(shape))))
  kernel = functools.partial(pallas_blocks.dkdv_kernel, sp, shapes, len(flat))
  results = _call(kernel, sp, num_k, inputs, in_specs, out_shape, out_specs,
                  aliases)
  dk, dv = results[:2]
  dbias = results[2] if sp.bias else None
  d_diff = tuple(d.sum(0).reshape(jnp.shape(c)) for d, c in
                 zip(results[2 + sp.bias:], key_fixed.mod_diff))
  # dq: one program per query block.
  flat = [_as_operand(x) for x in pallas_blocks.flatten(query_fixed)]
  kernel = functools.partial(pallas_blocks.dq_kernel, sp, shapes, len(flat))
  dq, = _call(
      kernel, sp, q.shape[0] // st.bq, [*common, *flat],
      [_rows(st.bq, q.shape[-1]), _whole(k), _whole(v),
       _rows(st.bq, d_out.shape[-1]), _rows(st.bq), _rows(st.bq),
       *map(_whole, flat)],
      [jax.ShapeDtypeStruct(q.shape, q.dtype)], [_rows(st.bq, q.shape[-1])])
  return dq, dk, dv, dbias, d_diff


def _slab_index(ndim: int):
  """Program ``j`` writes slab ``j`` of an ``ndim``-D output."""
  return lambda j: (j,) + (0,) * (ndim - 1)


def _ranges(st: flash_core.Static, ex, num_q: int, num_k: int, rows: bool,
            table):
  """``[n, 6]`` int32 ``(lo, hi, full_lo, full_hi, first, last)`` per block.

  Query blocks' key ranges (``rows``) or key blocks' query ranges; with a
  block mask's row ``table`` the listed blocks' span ``[first, last)``.
  """
  place = flash_core.Place(*ex.offsets(st.t, st.s))
  seg = flash_core.segment_summary(st, ex)
  if rows:
    fn = lambda n: flash_core.key_ranges(st, ex, place, seg, n, num_k)  # noqa: E731
    count = num_q
  else:
    fn = lambda n: flash_core.query_ranges(st, ex, place, seg, n, num_q)  # noqa: E731
    count = num_k
  lo, hi, full_lo, full_hi = jax.vmap(fn)(jnp.arange(count))
  if table is None:
    first = last = jnp.zeros_like(lo)
  else:
    search = jax.vmap(jnp.searchsorted)
    first, last = search(table, lo), search(table, hi)
  return jnp.stack([lo, hi, full_lo, full_hi, first, last],
                   -1).astype(jnp.int32)


def _single_head(q, k, v, h, seed, rate, *, launch: pallas_blocks.Launch,
                 out_dtype, **blocks):
  """One head (``base.Head``): pad, attend in the kernels, strip, sink,
  poison the rows that saw a NaN or inf.

  ``seed`` (uint32 ``[2]``) and ``rate`` (float32 scalar) are the call's
  dropout (``flash.drop_operands``), or None without dropout.
  """
  if h.dense is not None:  # keys no query sees (finite garbage): zero them
    k, v = checks.zero_unseen(jnp.any(h.dense, axis=0), k, v)
  hv = v.shape[-1]
  st, q, k, v = _padded(q, k, v, **blocks)
  ex = flash_core.padded_head(st, q.shape[0], k.shape[0], h)
  st, ex = flash_core.hoist_score_mod(st, ex, q)
  num_q, num_k = q.shape[0] // st.bq, k.shape[0] // st.bk
  i32 = jnp.int32
  bias = None
  if ex.bias is not None:  # whole tiles; the broadcast's cotangent sums
    bias = jnp.broadcast_to(ex.bias, (q.shape[0], k.shape[0]))
  mod_diff = tuple(ex.mod_consts)
  sp = _spec(st, ex, bias is not None, seed is not None, launch)
  bm, listed = ex.rule, sp.listed
  zero = jnp.zeros((), i32)
  b_idx, h_idx = (zero, zero) if ex.index is None else ex.index
  ints = jnp.stack([
      jnp.asarray(st.s if ex.kv_lengths is None else ex.kv_lengths, i32),
      jnp.asarray(st.t if ex.q_lengths is None else ex.q_lengths, i32),
      jnp.asarray(b_idx, i32), jnp.asarray(h_idx, i32),
      *(jnp.asarray(x, i32) for x in ex.offsets(st.t, st.s))])

  def fixed(rows: bool):
    table = (bm.kv_indices if rows else bm.q_indices) if listed else None
    return pallas_blocks.Refs(
        ints, _ranges(st, ex, num_q, num_k, rows, table), table,
        ex.q_segment_ids, ex.kv_segment_ids,
        None if ex.dense is None else ex.dense.astype(jnp.int8), None, seed,
        rate, () if sp.mod is None else sp.mod.consts, (),
        () if sp.rule is None else sp.rule.consts)

  # The custom VJP closes over nothing traced (vmap's tracers would leak
  # into the backward pass): the block tables travel as arguments.
  @jax.custom_vjp
  def attend(q, k, v, bias, mod_diff, by_rows, by_cols):
    del by_cols
    return _forward(sp, q, k, v, by_rows._replace(bias=bias,
                                                  mod_diff=mod_diff))

  def attend_fwd(q, k, v, bias, mod_diff, by_rows, by_cols):
    out, lse, code = attend(q, k, v, bias, mod_diff, by_rows, by_cols)
    return (out, lse, code), (q, k, v, bias, mod_diff, by_rows, by_cols,
                              out, lse)

  def attend_bwd(res, cotangents):
    q, k, v, bias, mod_diff, by_rows, by_cols, out, lse = res
    d_out, d_lse, _ = cotangents  # the codes have no gradient
    dq, dk, dv, dbias, d_diff = _backward(
        sp, q, k, v, out, lse, d_out, d_lse,
        by_cols._replace(bias=bias, mod_diff=mod_diff),
        by_rows._replace(bias=bias, mod_diff=mod_diff))
    return (dq, dk, dv,
            None if bias is None else dbias.astype(bias.dtype),
            tuple(d.astype(c.dtype) for d, c in zip(d_diff, mod_diff)),
            None, None)

  attend.defvjp(attend_fwd, attend_bwd)
  out, lse, code = attend(q, k, v, bias, mod_diff, fixed(True), fixed(False))
  out, lse, code = out[:st.t, :hv], lse[:st.t], code[:st.t]
  if h.sink is not None:
    out, _, lse = checks.with_sink(out, lse, h.sink, h.q_lengths)
  # poisoned after the custom VJP: those rows pass no cotangent back
  out, lse = checks.poison(code, out.astype(out_dtype), lse)
  return out, None, lse


def _spec(st: flash_core.Static, ex, bias: bool, dropout: bool,
          launch: pallas_blocks.Launch) -> pallas_blocks.Spec:
  """The head's layout for the kernels, its modifier and rule traced at blocks."""
  i32 = jnp.int32
  idx = (jnp.zeros((), i32), jnp.zeros((), i32), jnp.zeros((st.bq, 1), i32),
         jnp.zeros((1, st.bk), i32))
  mod = rule = None
  mod_diff = tuple(ex.mod_consts)
  if st.score_mod is not None:
    mod = pallas_blocks.replay(
        st.score_mod, jnp.zeros((st.bq, st.bk), _F32), *idx, *mod_diff,
        blocks=getattr(st.score_mod, "blocks", True))
  bm = ex.rule
  if bm is not None:
    rule = pallas_blocks.replay(bm.mask_fn, *idx)
  listed = bm is not None and bm.kinds is not None
  return pallas_blocks.Spec(
      st, None if ex.dense is None else ex.dense.shape, bias,
      ex.q_segment_ids is not None, ex.kv_lengths is not None,
      ex.q_lengths is not None, listed,
      ex.dense is not None or (bm is not None and not listed),
      flash_core.patterned(st, ex), mod, len(mod_diff), rule, dropout, launch)


def _padded(q, k, v, *, scale, is_causal, block_q, block_k, window,
            score_mod):
  """One head's static config and q, k, v padded to whole blocks.

  Unlike the flash core, blocks are not clipped to short sequences (a
  Triton tile keeps its power-of-two shape); the head dims are padded with
  zeros to a power of two >= 16, which changes no dot product.
  """
  t, s = q.shape[0], k.shape[0]
  tp, sp = -(-t // block_q) * block_q, -(-s // block_k) * block_k
  st = flash_core.Static(float(scale), intervals.bounds(bool(is_causal),
                                                        window),
                         score_mod, t, s, block_q, block_k)

  def pad(x, rows):
    width = x.shape[-1]
    cols = max(16, 1 << max(width - 1, 0).bit_length())
    return jnp.pad(x, ((0, rows - x.shape[0]), (0, cols - width)))

  return st, pad(q, tp), pad(k, sp), pad(v, sp)
