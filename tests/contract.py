"""The one contract every attention implementation honours, as a test suite.

Each implementation is one line of ``IMPLEMENTATIONS``: a function with
``scaled_dot_product_attention``'s arguments (``query, key, value, mask,
*, bias, is_causal, key_value_seq_lengths, return_lse``) over
``[B, N, T, H]`` operands, and the features it does not take. Every case
below runs against every implementation: where the implementation takes
all the case's features it must match an independent float64 reference
(outputs, lse, gradients of q, k, v and bias, gradients through lse too);
where it does not, it must refuse with a ``ValueError``/``TypeError``, never
return a number.

``tests/test_contract.py`` runs the in-process implementations;
``tests/multidevice/test_contract_ring.py`` runs ``ring`` on 8 simulated
devices. Adding an implementation = adding one line to ``IMPLEMENTATIONS``
(and naming it in one of those two files).

Shape glossary: B batch, N query heads, K key/value heads, T query length,
S key/value length, H head dim.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

import attention_jax as aj
from tests import _data

# 4 devices: every case still crosses device blocks several times (T = 40
# is 10 rows a device, windows and segments reach over neighbours); 8
# compiled a third slower and found nothing more. test_ring.py runs 2, 4
# and 8 devices against the references.
RING_DEVICES = 4


def _ring(query, key, value, mask=None, *, bias=None,
          key_value_seq_lengths=None, query_seq_lengths=None,
          query_segment_ids=None, key_segment_ids=None, sinks=None,
          score_mod=None, return_lse=False, **static):
  """ring_attention with T and S split over RING_DEVICES devices."""
  mesh = jax.make_mesh((RING_DEVICES,), ("seq",),
                       devices=jax.devices()[:RING_DEVICES],
                       axis_types=(jax.sharding.AxisType.Auto,))
  seq = P(None, None, "seq")
  out_specs = (seq, P(None, None, "seq")) if return_lse else seq

  def local(q, k, v, lengths, q_lengths, q_seg, k_seg, sinks, score_mod,
            mask, bias):
    return aj.ring_attention(q, k, v, mask, axis_name="seq", bias=bias,
                             key_value_seq_lengths=lengths,
                             query_seq_lengths=q_lengths,
                             query_segment_ids=q_seg, key_segment_ids=k_seg,
                             sinks=sinks, score_mod=score_mod,
                             return_lse=return_lse, block_q=4, block_k=3,
                             **static)

  return jax.shard_map(local, mesh=mesh,
                       in_specs=(seq, seq, seq, P(), P(), seq, seq, P(), P(),
                                 P(), P()),
                       out_specs=out_specs)(
                           query, key, value, key_value_seq_lengths,
                           query_seq_lengths, query_segment_ids,
                           key_segment_ids, sinks, score_mod, mask, bias)


@dataclasses.dataclass(frozen=True)
class Implementation:
  fn: Any
  unsupported: frozenset[str] = frozenset()
  needs_gpu: bool = False


# name: (function, features it refuses). Block sizes are odd so that causal
# offsets and lengths straddle block edges.
IMPLEMENTATIONS = {
    "dense": Implementation(functools.partial(
        aj.scaled_dot_product_attention, implementation="dense")),
    "blockwise": Implementation(
        functools.partial(aj.blockwise_attention, block_q=5, block_k=7),
        frozenset({"float64"})),
    "dispatch_blockwise": Implementation(
        functools.partial(aj.scaled_dot_product_attention,
                          implementation="blockwise"),
        frozenset({"float64"})),
    "cudnn": Implementation(
        functools.partial(aj.scaled_dot_product_attention,
                          implementation="cudnn"),
        frozenset({"float32", "float64", "lse", "q_lengths", "window",
                   "softcap", "segments", "sinks", "alibi", "t5", "block_mask"}),
        needs_gpu=True),
    "ring": Implementation(_ring, frozenset({"mask", "bias", "float64"})),
}


@dataclasses.dataclass(frozen=True)
class Case:
  t: int = 24
  s: int = 40
  kv_heads: int = 2  # of N = 4 query heads
  causal: bool = False
  lengths: tuple[int, ...] | None = None  # per example, [B] -> [B, 1]
  mask: bool = False  # random mask with fully blocked rows
  bias: bool = False  # random bias with -inf entries
  lse: bool = False  # return_lse, and a loss through lse
  q_lengths: tuple[int, ...] | None = None  # query_seq_lengths per example
  window: tuple[int, int] | None = None  # local_window_size (left, right)
  softcap: float | None = None  # score_mod aj.soft_cap(c), after the others
  # Packed documents: "sorted" (contiguous, differing per example and
  # between queries and keys), "unsorted" ids, or "recurring": one-id
  # query blocks facing key blocks of that id on both sides of a block of
  # another id (a block between two of the same id is not full).
  segments: str | None = None
  sinks: bool = False  # per-head sink logits [N], differentiated
  alibi: bool = False  # score_mod aj.alibi(slopes [N]), differentiated
  t5: bool = False  # score_mod aj.t5_relative_bias(table [10, N]), learned
  block_mask: str | None = None  # "prefix_lm" or "chunked" (a BlockMask)
  nan_padding: bool = False  # NaN in keys/values past the lengths
  dtype: str = "float32"

  def features(self) -> set[str]:
    used = {self.dtype}
    for name in ("mask", "bias", "lse", "q_lengths", "window", "softcap",
                 "segments", "sinks", "alibi", "t5", "block_mask"):
      if getattr(self, name):
        used.add(name)
    return used


CASES = {
    "plain_t_ne_s": Case(),
    "causal_t_lt_s": Case(causal=True),
    "causal_t_gt_s_empty_rows": Case(t=40, s=24, causal=True, lse=True),
    "causal_square_lengths": Case(t=24, s=24, causal=True, lengths=(24, 13)),
    "zero_length_nan_padding": Case(lengths=(17, 0), nan_padding=True),
    "mqa_causal_lengths": Case(kv_heads=1, causal=True, lengths=(40, 29)),
    "mha": Case(kv_heads=4, lse=True),
    "lse_causal_lengths": Case(causal=True, lengths=(31, 9), lse=True),
    "mask_empty_rows": Case(mask=True, lse=True),
    "bias_neg_inf": Case(bias=True, causal=True),
    "bfloat16_causal_lengths": Case(causal=True, lengths=(40, 21),
                                    dtype="bfloat16"),
    "float16": Case(dtype="float16", lse=True),
    "float64": Case(dtype="float64", causal=True),
    "causal_sliding_window": Case(t=40, s=40, causal=True, window=(7, 0)),
    "two_sided_window_lengths": Case(window=(3, 5), lengths=(40, 30),
                                     lse=True),
    "window_t_gt_s_empty_rows": Case(t=40, s=24, window=(2, 1), lse=True),
    "query_lengths_causal": Case(causal=True, q_lengths=(24, 0),
                                 lengths=(33, 40), lse=True),
    "softcap_bias": Case(softcap=2.0, bias=True),
    "softcap_window_query_lengths": Case(
        t=40, s=40, softcap=1.5, causal=True, window=(5, 0),
        q_lengths=(29, 40), kv_heads=1, lse=True),
    "window_float64": Case(window=(4, 2), q_lengths=(20, 7),
                           dtype="float64"),
    "packed_documents_causal": Case(t=40, s=40, causal=True,
                                    segments="sorted", lse=True),
    "segments_unsorted_window_lengths": Case(
        t=24, s=40, segments="unsorted", window=(6, 3), lengths=(40, 27),
        q_lengths=(24, 19)),
    "segments_recurring_ids": Case(t=20, s=28, segments="recurring",
                                   lse=True),
    "sinks_causal_query_lengths": Case(t=40, s=40, causal=True, sinks=True,
                                       q_lengths=(40, 23), lse=True),
    "alibi_causal_gqa": Case(causal=True, alibi=True, lse=True),
    "t5_bias_bidirectional_gqa": Case(t=40, s=40, t5=True, lse=True),
    "block_mask_prefix_lm": Case(t=40, s=40, block_mask="prefix_lm",
                                 lse=True),
    "block_mask_chunked_causal_sinks": Case(t=40, s=40, causal=True,
                                            block_mask="chunked", sinks=True,
                                            kv_heads=1),
    "everything_combined": Case(
        t=40, s=40, causal=True, window=(11, 0), segments="sorted",
        lengths=(40, 35), q_lengths=(38, 40), softcap=3.0, sinks=True,
        alibi=True, kv_heads=1, lse=True),
}

PREFIX, CHUNK = 9, 8  # the block-mask cases' prefix length and chunk size
BLOCK_MASK_FNS = {  # the library's helpers; _allowed writes them out again
    "prefix_lm": lambda: aj.prefix_lm_mask_fn(PREFIX),
    "chunked": lambda: aj.chunked_mask_fn(CHUNK),
}


B, N, H = 2, 4, 8
# Relative error budget per dtype of the *inputs*: float32 compute
# accumulates over <= 40 keys (~1e-6) and the flash backward recomputes P
# from lse across blocks (a few more roundings); 16-bit outputs carry one
# final rounding (eps/2) plus, in the flash kernels, P rounded to the value
# dtype before P @ V (another eps/2 per term).
TOLERANCES = {
    "float64": dict(fwd=1e-10, grad=1e-9),
    "float32": dict(fwd=1e-5, grad=5e-5),
    "float16": dict(fwd=4e-3, grad=2e-2),
    "bfloat16": dict(fwd=3e-2, grad=1e-1),
}


def _operands(case: Case):
  dtype = jnp.dtype(case.dtype)
  q = _data.normal(0, (B, N, case.t, H))
  k = _data.normal(1, (B, case.kv_heads, case.s, H))
  v = _data.normal(2, (B, case.kv_heads, case.s, H))
  lengths = q_lengths = None
  if case.lengths is not None:
    lengths = jnp.array(case.lengths, jnp.int32)[:, None]  # [B, 1]
  if case.q_lengths is not None:
    q_lengths = jnp.array(case.q_lengths, jnp.int32)[:, None]  # [B, 1]
  mask = bias = None
  if case.mask:
    mask = np.array(_data.bernoulli(3, 0.6, (B, 1, case.t, case.s)))
    mask[0, 0, 5] = False  # a query row that may see nothing
    mask[1, 0, -1] = False
    mask = jnp.asarray(mask)
  if case.bias:
    bias = np.array(_data.normal(4, (1, N, case.t, case.s)))
    bias[0, 1, :, 3] = -np.inf  # a key no query of head 1 may see
    bias[0, 2, 7, :] = -np.inf  # a query of head 2 that sees nothing
    bias = jnp.asarray(bias)
  if dtype != jnp.float32:
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    bias = None if bias is None else bias.astype(dtype)
  return q, k, v, mask, bias, lengths, q_lengths


def _segment_ids(case: Case):
  """Query and key ids ``[B, 1, T]``, ``[B, 1, S]`` (numpy), or Nones."""
  if case.segments is None:
    return None, None
  if case.segments == "sorted":
    def ids(size, cuts):
      return np.searchsorted(np.array(cuts), np.arange(size), side="right")
    q = np.stack([ids(case.t, (13, 33)), ids(case.t, (5, 6, 30))])
    k = np.stack([ids(case.s, (13, 33)), ids(case.s, (5, 6, 30))])
    if case.t != case.s:  # cross-attention: other cut points for keys
      k = np.stack([ids(case.s, (11, 20)), ids(case.s, (3, 36))])
  elif case.segments == "recurring":  # runs of 5 queries, 7 keys: the
    # blockwise column's blocks (5, 7) each hold one id.
    runs = lambda ids, size: np.repeat(np.array(ids), size)
    q = np.stack([runs([1, 1, 2, 2], 5), runs([2, 1, 1, 1], 5)])
    k = np.stack([runs([1, 2, 1, 2], 7), runs([2, 1, 1, 2], 7)])
  else:
    q = np.asarray(_data.bernoulli(9, 0.5, (B, case.t)), np.int32)
    k = np.asarray(_data.bernoulli(10, 0.5, (B, case.s)), np.int32)
    q = q + 2 * np.asarray(_data.bernoulli(11, 0.3, (B, case.t)), np.int32)
  return q[:, None].astype(np.int32), k[:, None].astype(np.int32)


def _differentiable_extras(case: Case):
  """``{"sinks": [N], "slopes": [N], "t5_table": [10, N]}`` as used."""
  extras = {}
  if case.sinks:
    extras["sinks"] = 0.5 * _data.normal(12, (N,)) + 0.5
  if case.alibi:
    extras["slopes"] = jnp.abs(_data.normal(13, (N,))) * 0.3
  if case.t5:
    extras["t5_table"] = _data.normal(14, (T5_BUCKETS, N))
  return extras


def _allowed(case: Case, mask, lengths, q_lengths, bias):
  """Where query t may see key s, [B, N, T, S], written out from the case."""
  allowed = np.ones((B, N, case.t, case.s), bool)
  q_seg, k_seg = _segment_ids(case)
  if q_seg is not None:
    allowed &= q_seg[:, :, :, None] == k_seg[:, :, None, :]
  i, j = np.arange(case.t)[:, None], np.arange(case.s)[None, :]
  if case.block_mask == "prefix_lm":  # the prefix, then causal
    allowed &= (j < PREFIX) | (j <= i)
  if case.block_mask == "chunked":
    allowed &= (i // CHUNK) == (j // CHUNK)
  if mask is not None:
    allowed &= np.asarray(mask)
  if lengths is not None:
    allowed &= (np.arange(case.s) < np.asarray(lengths)[:, :1])[:, None,
                                                                None, :]
  if q_lengths is not None:
    allowed &= (np.arange(case.t) < np.asarray(q_lengths)[:, :1])[:, None,
                                                                  :, None]
  position = np.arange(case.t)[:, None] + (case.s - case.t)  # bottom-right
  j = np.arange(case.s)[None, :]
  if case.causal:  # key j visible to query i iff j <= i + (S - T)
    allowed &= j <= position
  if case.window is not None:
    left, right = case.window
    allowed &= (j >= position - left) & (j <= position + right)
  if bias is not None:
    allowed &= np.isfinite(np.asarray(bias, np.float64))
  return allowed


# T5 settings of the t5 case: no relative position within S = 40 lands near
# a bucket boundary (the float32 kernel and this float64 reference agree).
T5_BUCKETS, T5_MAX_DISTANCE = 10, 20


def _t5_bucket(relative_position):
  """mesh-tensorflow's _relative_position_bucket, bidirectional, in NumPy."""
  half = T5_BUCKETS // 2
  bucket = (relative_position > 0) * half
  n = np.abs(relative_position)
  max_exact = half // 2
  with np.errstate(divide="ignore"):
    large = max_exact + (np.log(n / max_exact) / np.log(
        T5_MAX_DISTANCE / max_exact) * (half - max_exact))
  large = np.minimum(np.where(n < max_exact, 0, large).astype(np.int64),
                     half - 1)
  return bucket + np.where(n < max_exact, n, large)


def reference(q, k, v, bias, allowed, softcap=None, sinks=None, slopes=None,
              t5_table=None, rows=None):
  """Float64 attention with explicit head repetition; ``(out, lse)``.

  Written independently of the library: repeated K/V heads, ALiBi as a
  distance penalty, a plain masked softmax whose denominator also holds
  ``exp(sink)``; ``lse = -inf`` and output 0 for rows that may see nothing
  (with a sink: output 0 and ``lse = sink``, except ``-inf`` for rows past
  the query length, ``rows`` False).
  """
  group = q.shape[1] // k.shape[1]
  k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
  logits = jnp.einsum("BNTH,BNSH->BNTS", q, k) / np.sqrt(q.shape[-1])
  if bias is not None:
    logits = logits + jnp.where(allowed, bias, 0.0)
  if slopes is not None:  # [N] times the distance i - j
    distance = np.arange(q.shape[2])[:, None] - np.arange(k.shape[2])[None]
    logits = logits - slopes[None, :, None, None] * distance[None, None]
  if t5_table is not None:  # table[bucket(j - i), n] added per head
    rel = np.arange(k.shape[2])[None, :] - np.arange(q.shape[2])[:, None]
    logits = logits + jnp.moveaxis(t5_table[_t5_bucket(rel)], -1, 0)[None]
  if softcap is not None:
    logits = softcap * jnp.tanh(logits / softcap)
  top = jnp.max(jnp.where(allowed, logits, -jnp.inf), -1, keepdims=True)
  if sinks is not None:
    top = jnp.maximum(top, sinks[None, :, None, None])
  top = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))
  e = jnp.where(allowed, jnp.exp(jnp.where(allowed, logits - top, 0.0)), 0.0)
  total = e.sum(-1, keepdims=True)
  if sinks is not None:
    total = total + jnp.exp(sinks[None, :, None, None] - top)
  seen = total > 0
  out = (e / jnp.where(seen, total, 1.0)) @ v
  lse = jnp.where(seen, top + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
  lse = lse[..., 0]
  if rows is not None:
    lse = jnp.where(rows, lse, -jnp.inf)
  return out, lse


def _loss(out, lse, cot, cot_lse):
  total = jnp.sum(out.astype(jnp.float64 if out.dtype == jnp.float64
                             else jnp.float32) * cot)
  if lse is not None:  # through lse too; -inf rows contribute nothing
    total = total + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * cot_lse)
  return total


# The dispatcher forwards these cases' arguments to blockwise_attention
# unchanged (no pattern argument to route or block size rule to pick), and
# the blockwise column runs every one of them: its column keeps the cases
# whose arguments it has to route.
_DISPATCH_SKIPS = frozenset({
    "plain_t_ne_s", "causal_t_lt_s", "causal_t_gt_s_empty_rows", "mha",
    "float16", "mask_empty_rows", "bias_neg_inf", "zero_length_nan_padding",
    "bfloat16_causal_lengths", "mqa_causal_lengths"})


def suite(names):
  """A ``chex.TestCase`` running every case on each named implementation."""
  params = [(f"{name}__{case_name}", name, case_name)
            for name in names for case_name in CASES
            if not (name == "dispatch_blockwise"
                    and case_name in _DISPATCH_SKIPS)]

  class ContractTest(chex.TestCase):

    @parameterized.named_parameters(*params)
    def test_contract(self, name, case_name):
      impl, case = IMPLEMENTATIONS[name], CASES[case_name]
      if impl.needs_gpu and jax.default_backend() != "gpu":
        self.skipTest("needs a GPU")
      if case.dtype == "float64":
        with jax.enable_x64(True):
          self._check(impl, case)
      else:
        self._check(impl, case)

    def _check(self, impl, case):
      q, k, v, mask, bias, lengths, q_lengths = _operands(case)
      extra = {}
      if q_lengths is not None:
        extra["query_seq_lengths"] = q_lengths
      if case.window is not None:
        extra["local_window_size"] = case.window
      q_seg, k_seg = _segment_ids(case)
      if q_seg is not None:
        extra["query_segment_ids"] = jnp.asarray(q_seg)
        extra["key_segment_ids"] = jnp.asarray(k_seg)
      mask_in = mask
      if case.block_mask is not None:  # built for the odd blockwise blocks
        mask_in = aj.block_mask(BLOCK_MASK_FNS[case.block_mask](), case.t,
                                case.s, block_q=5, block_k=7)
      fn = functools.partial(impl.fn, is_causal=case.causal,
                             key_value_seq_lengths=lengths,
                             return_lse=case.lse, **extra)
      diff = _differentiable_extras(case)

      def ours(q, k, v, bias, diff):
        kw = {} if bias is None else {"bias": bias}
        if "sinks" in diff:
          kw["sinks"] = diff["sinks"]
        mods = []
        if "slopes" in diff:
          mods.append(aj.alibi(diff["slopes"]))
        if "t5_table" in diff:
          mods.append(aj.t5_relative_bias(diff["t5_table"],
                                          max_distance=T5_MAX_DISTANCE))
        if case.softcap is not None:
          mods.append(aj.soft_cap(case.softcap))
        if mods:
          kw["score_mod"] = mods[0] if len(mods) == 1 else aj.chain(*mods)
        result = fn(q, k, v, mask_in, **kw)
        return result if case.lse else (result, None)

      if case.features() & impl.unsupported:
        with self.assertRaises((ValueError, TypeError)):
          jax.jit(ours)(q, k, v, bias, diff)
        return

      allowed = _allowed(case, mask, lengths, q_lengths, bias)
      rows = None
      if q_lengths is not None:  # [B, 1, T]: rows that are queries
        rows = (np.arange(case.t) < np.asarray(q_lengths))[:, None]
      q_in, k_in, v_in = q, k, v
      if case.nan_padding:  # keys and values no query may see hold NaN
        seen = allowed.any(axis=(1, 2))[:, None, :, None]  # [B, 1, S, 1]
        k_in = jnp.where(seen, k, jnp.nan)
        v_in = jnp.where(seen, v, jnp.nan)

      # One compile each for ours and the reference: outputs ride along
      # with the gradient as auxiliary values.
      cot = _data.normal(7, (B, N, case.t, H))
      cot_lse = _data.normal(8, (B, N, case.t)) if case.lse else None
      argnums = (0, 1, 2, 4) + ((3,) if bias is not None else ())

      def loss_and_outputs(*a):
        out, lse = ours(*a)
        return _loss(out, lse, cot, cot_lse), (out, lse)

      (_, (out, lse)), grads = jax.jit(jax.value_and_grad(
          loss_and_outputs, argnums, has_aux=True))(q_in, k_in, v_in, bias,
                                                     diff)
      f64 = lambda x: None if x is None else np.asarray(x, np.float64)
      diff64 = {name: f64(x) for name, x in diff.items()}

      def reference_loss_and_outputs(q, k, v, bias, diff):
        out, lse = reference(q, k, v, bias, allowed, case.softcap, rows=rows,
                             **diff)
        return _loss(out, None if cot_lse is None else lse, f64(cot),
                     f64(cot_lse)), (out, lse)

      with jax.enable_x64(True):
        (_, (ref_out, ref_lse)), want = jax.jit(jax.value_and_grad(
            reference_loss_and_outputs, argnums, has_aux=True))(
                f64(q), f64(k), f64(v), f64(bias), diff64)
      tol = TOLERANCES[case.dtype]
      chex.assert_shape(out, (B, N, case.t, H))
      self.assertEqual(out.dtype, q.dtype)
      chex.assert_tree_all_finite(out)
      np.testing.assert_allclose(np.asarray(out, np.float64), ref_out,
                                 atol=tol["fwd"], rtol=tol["fwd"])
      empty = ~allowed.any(-1)  # [B, N, T]: queries that see nothing
      np.testing.assert_array_equal(np.asarray(out)[empty], 0.0)
      if case.lse:
        np.testing.assert_allclose(np.asarray(lse, np.float64), ref_lse,
                                   atol=tol["fwd"], rtol=tol["fwd"])

      names = ["dq", "dk", "dv"] + [f"d{n}" for n in diff] + (
          ["dbias"] if bias is not None else [])
      got_all = list(grads[:3]) + [grads[3][n] for n in diff] + list(
          grads[4:])
      want_all = list(want[:3]) + [want[3][n] for n in diff] + list(want[4:])
      for name, got, ref in zip(names, got_all, want_all):
        got = np.asarray(got, np.float64)
        self.assertTrue(np.isfinite(got).all(), f"{name} is not finite")
        scale = max(1.0, float(np.abs(ref).max()))
        np.testing.assert_allclose(got, ref, atol=tol["grad"] * scale,
                                   rtol=tol["grad"], err_msg=name)
      # A query that may see nothing has exactly zero gradient.
      np.testing.assert_array_equal(np.asarray(grads[0])[empty], 0.0)

  return ContractTest
