"""The one contract every attention kernel honours, as a test suite.

Every kernel of ``aj.kernels.REGISTRY`` (and ``aj.kernels.Ring``, on
simulated devices) is a column: each case below is built as one ``aj.Mask``
(causal, window, lengths, segment ids, a dense mask, a rule) with a bias,
sinks and score modifiers, and run through ``scaled_dot_product_attention``
with ``implementation=`` that kernel, over ``[B, N, T, H]`` operands. Where
the kernel takes all the case's features it must match the independent
float64 reference ``tests/reference.masked_attention`` (outputs, lse,
gradients of q, k, v, bias and the differentiable extras, gradients through
lse too; the row maxima of the raw logits against a NumPy float64 one,
with no gradient through them); where it does not, it must refuse with a
``ValueError`` / ``TypeError``, never return a number. On
``IMPORTANCE_CASES`` ``aj.key_importance`` through the kernel (its
backward at a value head dim of 1) must equal the reference weights'
column sums, or be refused naming the kernel (in process only).

``tests/test_contract.py`` runs the registry's kernels in process;
``tests/multidevice/test_contract_ring.py`` runs the sequence-parallel
columns (``SEQUENCE_PARALLEL``: ``ring``, ``ring_zigzag``, ``ulysses``,
each a harness that shards the whole call, runs it and gathers the
results) on
``RING_DEVICES`` of the 8 simulated devices. A kernel added to the
registry is a new column by itself; it must say here what it refuses
(``REFUSES``; the suite fails until it does; a case refused for its shapes
rather than its features goes in ``REFUSES_SHAPES``) and, if it has block
sizes, how to run it on these tiny shapes (``CONFIGURED``). A kernel
outside the registry (written outside the library) runs the same cases
through ``outside_suite(kernel, refuses, cases)``.

Shape glossary: B batch, N query heads, K key/value heads, T query length,
S key/value length, H head dim.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types

from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

import attention_jax as aj
from attention_jax.attention import dot_product
from attention_jax.kernels import ring_layout
from tests import _data
from tests import reference as reference_lib
from tests import sequence_parallel_harness

# 4 devices: every case still crosses device blocks several times (T = 40
# is 10 rows a device, windows and segments reach over neighbours); 8
# compiled a third slower and found nothing more. test_ring.py runs 2, 4
# and 8 devices against the references.
RING_DEVICES = 4

# Kernels with block sizes run odd ones, so that causal offsets, lengths and
# rules straddle block edges.
CONFIGURED = {
    "flash": aj.kernels.Flash(block_q=5, block_k=7),
    "ring": aj.kernels.Ring("seq", block_q=4, block_k=3),
    # The load-balanced layout: chunks i and 2P - 1 - i on device i.
    "ring_zigzag": aj.kernels.Ring("seq", block_q=4, block_k=3,
                                   layout="zigzag"),
    # Accelerator kernels run in Pallas's interpreter here.
    # Triton's smallest tiles (powers of two >= 16: what a GPU would run,
    # padding included); block masks' 5 x 7 tables are rebuilt at them.
    "pallas_gpu": aj.kernels.PallasGpu(block_q=16, block_k=16,
                                       interpret=True),
    "splash": aj.kernels.Splash(interpret=True),  # 128-blocks: one each here
    "paged_tpu": aj.kernels.PagedTpu(interpret=True),
    # Two partitions of the pages (split-KV inside the kernel).
    "paged_gpu": aj.kernels.PagedGpu(splits=2, interpret=True),
    # Chunks of 16 queries: T = 40 leaves a padded last chunk.
    "gathered": aj.kernels.Gathered(chunk=16),
}

# The case features each kernel refuses (its ``supports`` must say so).
REFUSES = {
    "dense": frozenset({"paged"}),
    "flash": frozenset({"float64"}),
    "cudnn": frozenset({"float32", "float64", "lse", "q_lengths", "window",
                        "softcap", "segments", "sinks", "alibi", "t5",
                        "rule", "max_logits", "paged", "dropout"}),
    "ring": frozenset({"float64", "paged", "dropout"}),
    "ring_zigzag": frozenset({"float64", "paged", "dropout"}),
    "pallas_gpu": frozenset({"float64", "max_logits", "paged"}),
    # Splash has no bias, no modifier but a soft cap, and a static mask (a
    # dense mask is traced under jit).
    "splash": frozenset({"float64", "bias", "mask", "alibi", "t5",
                         "max_logits", "positions", "paged", "dropout"}),
}
# A TPU paged decoding step: one bfloat16 query per sequence, seeing the
# keys up to its position (its columns run only SUBSETS' cases).
REFUSES["paged_tpu"] = frozenset({
    "float32", "float64", "float16", "mask", "bias", "lse", "q_lengths",
    "window", "softcap", "segments", "sinks", "alibi", "t5", "rule",
    "max_logits", "dropout"})
# A GPU paged decoding step: one query per sequence, its visible slots one
# interval (length, causality and a window at its position).
REFUSES["paged_gpu"] = frozenset({
    "float64", "mask", "bias", "q_lengths", "softcap", "segments", "alibi",
    "t5", "rule", "max_logits", "dropout"})
# Each query over its chosen tokens: a token selection and what can be
# evaluated at the gathered pairs; a call without one it refuses for its
# rule (REFUSES_SHAPES).
REFUSES["gathered"] = frozenset({"mask", "bias", "max_logits", "positions",
                                 "paged", "dropout"})
NEEDS_GPU = frozenset({"cudnn"})
# Cases a kernel refuses for their shapes (or their kind of rule), not
# their features: name -> (predicate on the case, what its ValueError
# says). Zigzag cuts each global length into 2 * RING_DEVICES chunks: T =
# 20 or S = 28 leaves a device odd lengths (5, 7), which it refuses; the
# gathered kernel takes no rule but a token selection.
# Ulysses runs whatever kernel fits each device's whole-sequence call (the
# dense one takes float64); it reads no pages.
REFUSES["ulysses"] = frozenset({"paged", "dropout"})
REFUSES_SHAPES = {
    "ring_zigzag": (lambda case: bool(case.t % (2 * RING_DEVICES)
                                      or case.s % (2 * RING_DEVICES)),
                    r"layout='zigzag' .* lengths must be even"),
    "gathered": (lambda case: case.rule != "selected_tokens",
                 r"token selection only|Gathered.requires"),
}


# Interpret mode is slow (a case costs seconds): these kernels run the
# cases that exercise each feature once (MQA, query lengths and a window
# with key lengths inside softcap_window_query_lengths and
# segments_unsorted_window_lengths) and their refusals. Both kernels also
# pass every other case (run with SUBSETS emptied).
SUBSETS = {
    "pallas_gpu": (
        "causal_t_gt_s_empty_rows", "zero_length_nan_padding",
        "mask_empty_rows", "bias_neg_inf", "bfloat16_causal_lengths",
        "float64", "softcap_window_query_lengths",
        "segments_unsorted_window_lengths", "sinks_causal_query_lengths",
        "t5_bias_bidirectional_gqa", "block_mask_prefix_lm",
        "rule_per_example_prefix_window", "everything_combined",
        "max_logits_modified_patterned", "positions_causal_window_rule",
        "positions_causal_alibi", "garbage_causal_window_lengths",
        "dropout_causal_gqa_lse",
        "garbage_mask_bias_sinks", "paged_decode_alibi_rule_mqa",
        "selected_blocks_causal_gqa_lengths_sinks", "tree_prefix_gqa_sinks"),
    "splash": (
        "causal_t_gt_s_empty_rows", "zero_length_nan_padding",
        "mask_empty_rows", "bias_neg_inf", "bfloat16_causal_lengths",
        "float64", "softcap_window_query_lengths",
        "segments_unsorted_window_lengths", "sinks_causal_query_lengths",
        "alibi_causal_gqa", "block_mask_prefix_lm",
        "rule_per_example_prefix_window", "union_prefix_lm_segments",
        "max_logits_modified_patterned", "positions_causal_window_rule",
        "garbage_causal_window_lengths", "paged_decode_alibi_rule_mqa",
        "dropout_causal_gqa_lse", "selected_blocks_causal_gqa_lengths_sinks",
        "tree_prefix_gqa_sinks"),
    # It reads paged caches only: the paged cases (the float32 ones are
    # refused) and two refusals.
    "paged_tpu": (
        "paged_prefill_window_gqa_sinks", "paged_decode_alibi_rule_mqa",
        "paged_decode_bfloat16_gqa", "mask_empty_rows", "float64"),
    # It takes token selections only: that case, and its refusals.
    "gathered": (
        "selected_tokens_window_segments", "plain_t_ne_s", "mask_empty_rows",
        "bias_neg_inf", "max_logits_modified_patterned",
        "positions_causal_alibi", "paged_decode_bfloat16_gqa",
        "dropout_causal_gqa_lse"),
    "paged_gpu": (
        "paged_prefill_window_gqa_sinks", "paged_decode_alibi_rule_mqa",
        "paged_decode_bfloat16_gqa", "paged_decode_window_sinks_gqa",
        "mask_empty_rows", "float64"),
}


def case_names(kernel: str) -> tuple[str, ...]:
  """The cases a kernel's column runs (the exhaustive run)."""
  return SUBSETS.get(kernel, tuple(CASES))


# Columns whose every case runs by default; the others (the
# sequence-parallel harnesses, the interpreted Pallas kernels: seconds a
# case) run ``covering_cases`` by default and the rest under
# ``-m exhaustive``.
EVERY_CASE_BY_DEFAULT = frozenset({"dense", "flash", "cudnn"})

# Columns that run one kernel in several layouts (ring and ring_zigzag:
# aj.kernels.Ring, the sequence cut into P contiguous chunks or 2P chunks
# laid out in pairs; 5-17 CPU-seconds a case on 4 simulated devices) and
# share their default cases: each facet the kernel takes runs by default
# in one of the layouts (the greedy alternates between them, zigzag first:
# its two chunks a device are where positions, masks and lengths are
# easiest to get wrong), each refusal in each. Every case still runs in
# every layout in the exhaustive run; the contiguous layout's other
# features run by default in tests/multidevice/test_ring.py and
# test_sequence_parallel.py.
COVERED_TOGETHER = (("ring_zigzag", "ring"),)


def facets(case: Case) -> frozenset[str]:
  """What a case exercises, finer than ``Case.features`` (what a kernel
  refuses): the kind of segment ids and of rule, garbage and NaN
  padding."""
  found = set(case.features())
  if case.segments:
    found.add(f"segments:{case.segments}")
  if case.rule:
    found.add(f"rule:{case.rule}")
  for name in ("garbage", "nan_padding"):
    if getattr(case, name):
      found.add(name)
  return frozenset(found)


def refused(kernel: str, case: Case) -> frozenset[str]:
  """Why column ``kernel`` refuses ``case``: the features it refuses, or
  ``{"shape"}`` for a case it refuses for its shapes (empty: it takes
  it)."""
  features = frozenset(case.features() & REFUSES.get(kernel, frozenset()))
  if features:
    return features
  shaped = REFUSES_SHAPES.get(kernel, (lambda case: False,))[0]
  return frozenset({"shape"}) if shaped(case) else frozenset()


def group(kernel: str) -> tuple[str, ...]:
  """The columns that share ``kernel``'s default cases (itself alone
  unless ``COVERED_TOGETHER`` names it)."""
  return next((g for g in COVERED_TOGETHER if kernel in g), (kernel,))


@functools.cache
def _cover(columns: tuple[str, ...]) -> frozenset[tuple[str, str]]:
  """The fewest ``(column, case)`` pairs (greedy: most new goals first;
  on ties the column with fewer so far, then ``columns`` and case order)
  whose cases exercise every facet that the columns' taken cases do, and
  each column's refusals: every feature it refuses, and its shapes."""

  def goals(column, name):
    why = refused(column, CASES[name])
    if why:  # a refusal: each column's own
      return {f"{column} refuses {f}" for f in why}
    return set(facets(CASES[name]))

  pairs = [(c, n) for c in columns for n in case_names(c)]
  left = set().union(*(goals(*p) for p in pairs))
  chosen, count = set(), dict.fromkeys(columns, 0)
  while left:
    best = max(pairs, key=lambda p: (len(goals(*p) & left), -count[p[0]]))
    chosen.add(best)
    count[best[0]] += 1
    left -= goals(*best)
  return frozenset(chosen)


def covering_cases(kernel: str) -> tuple[str, ...]:
  """The column's default cases: every case for ``EVERY_CASE_BY_DEFAULT``,
  else its share of ``_cover`` over its ``group``: with the other
  columns' shares they exercise every facet its cases exercise, and it
  refuses every feature it refuses (each at least once) and, if it has
  one, a case for its shapes."""
  names = case_names(kernel)
  if kernel in EVERY_CASE_BY_DEFAULT:
    return names
  chosen = _cover(group(kernel))
  return tuple(n for n in names if (kernel, n) in chosen)


_CASE_TEST = re.compile(
    r"^test_(contract|forward_mode|key_importance)_(.+?)__(.+)$")


def is_exhaustive(test_name: str) -> bool:
  """Whether a contract test (``test_contract_<kernel>__<case>``,
  ``test_forward_mode_<kernel>__<case>``) runs only in the exhaustive run:
  its case is not among its column's ``covering_cases``; a key importance
  test (``test_key_importance_<kernel>__<case>``) unless its case is its
  column's ``importance_default`` (sdpa's refusals are the contract's own,
  and tests/test_importance.py's carry them through key_importance)."""
  found = _CASE_TEST.match(test_name)
  if not found:
    return False
  if found[1] == "key_importance":
    return found[3] != importance_default(found[2])
  return found[3] not in covering_cases(found[2])


# aj.key_importance through each column's kernel (the vjp of the case's call
# with a value of ones [..., S, 1]) against the column sums of the
# reference's weights: case -> last= (None: every row counts). One case a
# column runs by default (``importance_default``); the rest, refusals
# included, in the exhaustive run. Every facet is the contract's own: this
# is key importance reaching each kernel whole.
IMPORTANCE_CASES = {
    # MQA (a query head's own mass: the keys repeated to N heads), key and
    # query lengths, sinks, ALiBi then a soft cap, a window and packed
    # documents; the last 7 real rows of each example (SnapKV's window).
    "everything_combined": 7,
    "softcap_window_query_lengths": None,  # what splash takes: a soft cap
    "selected_tokens_window_segments": None,  # the gathered kernel's
    "tree_prefix_gqa_sinks": None,  # positions and a positioned rule
    # 16-bit inputs (float32 sums); the cudnn column's only case it would
    # take by its features: it refuses the value head dim of 1.
    "bfloat16_causal_lengths": None,
}
# Columns that refuse every key importance call they would otherwise run,
# and what their error says (besides ``implementation='<name>'``).
IMPORTANCE_REFUSES = {
    "cudnn": r"equal key/value shapes.*key_importance's call: a value of "
             r"ones",
}


def importance_refused(kernel: str, case: Case) -> frozenset[str]:
  """Why column ``kernel`` refuses ``case``'s key importance (as
  ``refused``; key_importance asks for no lse and no max logits)."""
  return refused(kernel, dataclasses.replace(case, lse=False,
                                             max_logits=False))


def importance_default(kernel: str) -> str | None:
  """The column's default key importance case: the first of
  ``IMPORTANCE_CASES`` it runs and takes (None: none)."""
  return next((n for n in IMPORTANCE_CASES if n in case_names(kernel)
               and not importance_refused(kernel, CASES[n])), None)


def kernel_names() -> list[str]:
  """The registry's kernels, by name."""
  return [kernel.name for kernel in aj.kernels.REGISTRY]


def _kernel(name: str):
  if name in SEQUENCE_PARALLEL:  # (run by its harness, not a kernel)
    return None
  if name in CONFIGURED:
    return CONFIGURED[name]
  return aj.kernels.by_name(name)


def _ring(kernel, query, key, value, mask_parts, *, pages=None, **kw):
  """``kernel`` (a ``Ring``) with T and S split over RING_DEVICES devices,
  on the whole call's operands; a harness of ``SEQUENCE_PARALLEL``.

  The mask's arrays enter ``shard_map`` as operands (segment ids sharded
  like the sequence, a dense mask and the bias by rows when they have
  ``T`` rows, else replicated, lengths replicated); its structure and
  rule stay closed over (concrete), and so do keywords that hold no arrays
  (a plain ``score_mod`` function). Under the zigzag layout q, k, v,
  segment ids and the dense mask's and the bias's rows and columns are
  permuted into it before ``shard_map`` and the results back after, inside
  the differentiated function, so gradients compare with the reference as
  they are; global lengths that the layout cannot cut are not permuted
  (the kernel must refuse them). A paged call (``pages``) goes to the
  dispatcher as for any kernel (refused).
  """
  if pages is not None:
    return dot_product.run(query, None, None, _mask(mask_parts), pages=pages,
                           implementation=kernel, **kw)
  seq = P(None, None, "seq")  # also [B, N, T] lse and max logits
  return_lse = kw.pop("return_lse", False)
  return_max_logits = kw.pop("return_max_logits", False)
  returned = 1 + return_lse + return_max_logits
  out_specs = (seq,) * returned if returned > 1 else seq
  t, s = query.shape[-2], key.shape[-2]
  arrays = {n: x for n, x in mask_parts.items()
            if n in ("q_lengths", "kv_lengths", "q_segment_ids",
                     "kv_segment_ids", "dense") and x is not None}
  if kw.get("bias") is not None:
    arrays["bias"] = kw.pop("bias")
  fixed = {n: x for n, x in mask_parts.items() if n not in arrays}
  # keywords of arrays (sinks, a ScoreMod's params) are operands
  closed = {n: x for n, x in kw.items() if not all(
      isinstance(leaf, (jax.Array, np.ndarray, float, int))
      for leaf in jax.tree.leaves(x))}
  kw = {n: x for n, x in kw.items() if n not in closed}
  zigzag = kernel.layout == "zigzag" and not (t % (2 * RING_DEVICES)
                                              or s % (2 * RING_DEVICES))
  if zigzag:  # the caller's permutation, once
    order = functools.partial(ring_layout.zigzag, devices=RING_DEVICES)
    query, key, value = order(query), order(key), order(value)
    for n in ("q_segment_ids", "kv_segment_ids"):
      if n in arrays:
        arrays[n] = order(arrays[n], axis=-1)
    for n in ("dense", "bias"):
      for axis in (-2, -1):
        if n in arrays and arrays[n].shape[axis] > 1:
          arrays[n] = order(arrays[n], axis=axis)

  def spec(name, x):
    if name.endswith("segment_ids"):
      return P(None, "seq")
    if name in ("dense", "bias") and x.shape[-2] == t:
      return P(None, None, "seq", None)  # this device's rows, every key
    return P()

  def local(q, k, v, arrays, kw):
    # The case's mask is the whole sequence's: in this device's terms once
    # (what aj.ring_attention does), then the dispatcher as for any kernel.
    bias = arrays.pop("bias", None)
    kw = {**kw, **closed}
    mask, score_mod, localized = _localize(
        kernel, _mask({**fixed, **arrays}), kw.pop("score_mod", None), q, k,
        bias)
    return aj.scaled_dot_product_attention(
        q, k, v, mask, score_mod=score_mod, implementation=localized,
        return_lse=return_lse, return_max_logits=return_max_logits, **kw)

  result = jax.shard_map(
      local, mesh=_ring_mesh(),
      in_specs=(seq, seq, seq, {n: spec(n, x) for n, x in arrays.items()},
                {n: P() for n in kw}),
      out_specs=out_specs)(query, key, value, arrays, kw)
  if not zigzag:
    return result
  result = result if returned > 1 else (result,)
  result = tuple(ring_layout.unzigzag(x, RING_DEVICES,
                                      axis=-2 if x.ndim == 4 else -1)
                 for x in result)  # out [B, N, T, H]; lse, max [B, N, T]
  return result if returned > 1 else result[0]


# The sequence-parallel columns: name -> harness(query, key, value,
# mask_parts, **kw) on the whole call's operands (the case's mask fields,
# scaled_dot_product_attention's keywords, pages= in the paged cases),
# returning the global results; it shards, runs and gathers.
SEQUENCE_PARALLEL = {
    "ring": functools.partial(_ring, CONFIGURED["ring"]),
    "ring_zigzag": functools.partial(_ring, CONFIGURED["ring_zigzag"]),
    # all-to-all over RING_DEVICES devices, the automatic kernel on each
    "ulysses": sequence_parallel_harness.ulysses,
}


def _localize(kernel, mask, score_mod, q, k, bias=None):
  """``kernel.localize`` for ``[B, N, T, H]`` operands of this device."""
  return kernel.localize(mask, score_mod, q.shape[-2], k.shape[-2],
                         q.shape[:-2], bias=bias)


def _ring_mesh():
  return jax.make_mesh((RING_DEVICES,), ("seq",),
                       devices=jax.devices()[:RING_DEVICES],
                       axis_types=(jax.sharding.AxisType.Auto,))


# User callables that no kernel may run, since their answer would depend
# on the kernel (the dense one sees a head's [T, S] scores, the blockwise
# ones a block): every kernel refuses them at the call, with one message.
NOT_ELEMENTWISE = {
    "summed_score_mod": dict(score_mod=lambda s, b, h, q, k: s.sum()),
    "row_wise_score_mod": dict(
        score_mod=lambda s, b, h, q, k: s / s.std(-1, keepdims=True)),
    "integer_rule": dict(mask=aj.Mask(
        causal=True, rule=lambda b, h, q, k: (k < PREFIX).astype(jnp.int32))),
    "integer_rule_in_union": dict(mask=aj.Mask(causal=True) | aj.Mask(
        rule=lambda b, h, q, k: jnp.int32(2) * (k < PREFIX))),
}


def _call_refused(name, kernel, q, k, v, call) -> str:
  """The message of the error that ``kernel`` (``None``: the automatic
  choice) raises for ``call``, under jit; a sequence-parallel column
  through its harness (the mask's fields as its parts; the callable
  closed over)."""
  mask, score_mod = call.get("mask"), call.get("score_mod")

  def attend(q, k, v):
    if name in SEQUENCE_PARALLEL:
      parts = {} if mask is None else dict(vars(mask))
      return SEQUENCE_PARALLEL[name](q, k, v, parts, score_mod=score_mod)
    return aj.scaled_dot_product_attention(
        q, k, v, mask, score_mod=score_mod, implementation=kernel)

  try:
    jax.jit(attend)(q, k, v)
  except (ValueError, TypeError) as e:
    return type(e).__name__ + ": " + str(e)
  raise AssertionError(f"kernel {name!r} ran a call it must refuse")


def _mask(parts):
  """An ``aj.Mask`` from its parts (None when there are none)."""
  if not any(x is not None and x is not False for x in parts.values()):
    return None
  return aj.Mask(**parts)


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
  # A rule: "prefix_lm" or "chunked" as a BlockMask (tables for the
  # blockwise column's blocks); "prefix_lm_rule" without tables (the kernel
  # builds them); "per_example_prefix" (a MaskRule over [B] prefix lengths);
  # "union_prefix_lm" (Mask(causal) | Mask(rule: the prefix)); "tree"
  # (aj.tree_mask: TREE_PARENTS' nodes over each row's prefix, positioned
  # at the case's positions, which must be (TREE_PREFIXES, 0)).
  rule: str | None = None
  nan_padding: bool = False  # NaN in keys/values past the lengths
  # NaN and inf planted in keys, values and a query (PLANTS) that some rows
  # may see and others may not: rows that see one are not finite, every
  # other row (and every gradient) is the clean inputs' run.
  garbage: bool = False
  dtype: str = "float32"
  # return_max_logits: each row's largest raw scale * q.k where allowed
  max_logits: bool = False
  # Positions in the mask: (q_offset, kv_offset) per example ([B] each):
  # query row i at q_offset + i, key column j at kv_offset + j, for
  # causality, windows and the rule (a decoding step over cache slots).
  positions: tuple[tuple[int, ...], tuple[int, ...]] | None = None
  # Keys and values in a paged cache's pool of pages of this many tokens
  # (S a multiple of it), read through a scrambled page table
  # (``_paged``): pages out of order, NaN in every slot past a length and
  # in the pages nobody holds.
  paged: int | None = None
  # Attention dropout at this rate (DROPOUT_KEY): each kernel's draw is the
  # library's counter-based one, checked entry by entry against
  # reference.dropout_keep.
  dropout: float = 0.0

  def features(self) -> set[str]:
    used = {self.dtype}
    for name in ("mask", "bias", "lse", "q_lengths", "window", "softcap",
                 "segments", "sinks", "alibi", "t5", "rule", "max_logits",
                 "positions", "paged", "dropout"):
      if getattr(self, name):
        used.add(name)
    return used


# The tree case's drafts, one per row (parents[i] < i; -1: a root), and
# each row's prefix before them.
TREE_PARENTS = ((-1, 0, 0, 1, 1, 2, -1, 6),  # two roots
                (-1, 0, 1, 2, 0, 4, 3, 3))
TREE_PREFIXES = (5, 16)


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
    "block_mask_prefix_lm": Case(t=40, s=40, rule="prefix_lm", lse=True),
    "block_mask_chunked_causal_sinks": Case(t=40, s=40, causal=True,
                                            rule="chunked", sinks=True,
                                            kv_heads=1),
    "rule_tables_by_kernel_lengths": Case(t=40, s=40, rule="prefix_lm_rule",
                                          lengths=(40, 31), lse=True),
    "rule_per_example_prefix_window": Case(
        t=40, s=40, rule="per_example_prefix", window=(13, 0), lse=True),
    "union_prefix_lm_segments": Case(t=40, s=40, rule="union_prefix_lm",
                                     segments="sorted", lse=True),
    # Selections from data (trainable sparse attention): key blocks of 7
    # chosen per query and key/value head (a GQA group shares them) with
    # causality, key lengths, sinks and ALiBi; and top-k key tokens per
    # query (every head shares them) with a window, packed documents and a
    # soft cap.
    "selected_blocks_causal_gqa_lengths_sinks": Case(
        t=40, s=40, causal=True, rule="selected_blocks", lengths=(40, 33),
        sinks=True, alibi=True, lse=True),
    "selected_tokens_window_segments": Case(
        t=40, s=40, causal=True, window=(19, 0), rule="selected_tokens",
        segments="sorted", softcap=2.0, sinks=True, lse=True),
    # Speculative decoding's tree verification (aj.tree_mask): each row's
    # 8 drafted nodes (its own tree) over its prefix (5 or 16 keys) and its
    # ancestors' keys; row 0's slots past its tree (13..23) never seen;
    # GQA and sinks.
    "tree_prefix_gqa_sinks": Case(
        t=8, s=24, causal=True, rule="tree",
        positions=(TREE_PREFIXES, (0, 0)), sinks=True, lse=True),
    "everything_combined": Case(
        t=40, s=40, causal=True, window=(11, 0), segments="sorted",
        lengths=(40, 35), q_lengths=(38, 40), softcap=3.0, sinks=True,
        alibi=True, kv_heads=1, lse=True),
    # Max logits ignore the modifiers and sinks but not the pattern (rows
    # past the query lengths see nothing: -inf); no mask or bias, which
    # ring refuses.
    "max_logits_modified_patterned": Case(
        t=40, s=40, causal=True, window=(9, 0), segments="sorted",
        lengths=(40, 33), q_lengths=(37, 40), softcap=2.0, sinks=True,
        alibi=True, lse=True, max_logits=True),
    # A chunk of 16 queries at each example's own place in 40 slots (one
    # example's keys counted from -2: left padding), a causal window and a
    # per-example prefix rule at those positions, key lengths: rows before
    # a key's position and past the window see nothing.
    "positions_causal_window_rule": Case(
        t=16, s=40, causal=True, window=(9, 0), lengths=(40, 30),
        rule="per_example_prefix", positions=((3, 21), (0, -2)), lse=True),
    # ALiBi sees positions too (its distance is q_pos - kv_pos), and the
    # gradients of a positioned call.
    "positions_causal_alibi": Case(
        t=16, s=40, causal=True, lengths=(40, 35), alibi=True,
        positions=((24, 9), (0, -3)), lse=True),
    # Garbage that a causal window shows to a few rows of some heads (and a
    # NaN key past a length, which no row sees)...
    "garbage_causal_window_lengths": Case(
        t=40, s=40, causal=True, window=(5, 0), lengths=(40, 33), lse=True,
        garbage=True),
    # ... and that a random dense mask and a bias with -inf entries show
    # to some rows (the dense kernel's select path, the flash walk's mask).
    "garbage_mask_bias_sinks": Case(mask=True, bias=True, sinks=True,
                                    softcap=2.0, lse=True, garbage=True),
    # A chunked prefill into a paged cache: 14 queries at each sequence's
    # place, a causal window, GQA, sinks and a soft cap, over pages of 7
    # (the flash column's key blocks) that hold other sequences' tokens
    # and NaN where nobody wrote.
    "paged_prefill_window_gqa_sinks": Case(
        t=14, s=42, causal=True, window=(12, 0), lengths=(42, 23),
        positions=((28, 9), (0, 0)), sinks=True, softcap=2.5, lse=True,
        paged=7),
    # One decoding query per sequence over its pages: MQA, ALiBi and a
    # per-example prefix rule at positions, one sequence empty.
    "paged_decode_alibi_rule_mqa": Case(
        t=1, s=42, kv_heads=1, causal=True, lengths=(31, 0),
        positions=((30, -1), (0, 0)), alibi=True, rule="per_example_prefix",
        lse=True, max_logits=True, paged=7),
    # A bfloat16 decoding step over pages (what a TPU kernel multiplies
    # exactly): GQA, one sequence empty.
    # A float32 decoding step with a window (a lower bound inside a page),
    # sinks and the lse, over pages.
    "paged_decode_window_sinks_gqa": Case(
        t=1, s=42, causal=True, window=(16, 0), lengths=(40, 11),
        positions=((39, 10), (0, 0)), sinks=True, lse=True, paged=7),
    "paged_decode_bfloat16_gqa": Case(
        t=1, s=42, causal=True, lengths=(29, 0), positions=((28, -1), (0, 0)),
        dtype="bfloat16", paged=7),
    # Dropout: the kept entries of each (b, h, q, kv) the reference draws,
    # through every pattern pass, the bias and a modifier, and the
    # gradients (each pass draws the block's mask again).
    "dropout_causal_gqa_lse": Case(causal=True, lengths=(40, 29), lse=True,
                                   dropout=0.3),
    "dropout_window_bias_softcap_sinks": Case(
        t=40, s=40, causal=True, window=(9, 0), segments="sorted",
        bias=True, softcap=2.0, sinks=True, q_lengths=(40, 31), lse=True,
        dropout=0.5),
}

# (tensor, example, its head, row, feature, value) of each planted entry;
# a key/value head is taken modulo the case's kv_heads.
PLANTS = (("key", 0, 0, 12, 3, np.nan), ("key", 1, 1, 20, 0, np.inf),
          ("value", 0, 1, 27, 5, np.nan), ("value", 1, 0, 9, 2, -np.inf),
          ("key", 1, 0, 36, 1, np.nan), ("query", 0, 2, 17, 4, np.nan))


def _plant(case: Case, q, k, v, allowed):
  """The operands with PLANTS written in, where they were written
  (bool like q, k, v), and the rows ``[B, N, T]`` that may see a planted
  key or query (``key_rows``: their lse is not finite either) or any
  planted entry (``rows``), written out from ``allowed [B, N, T, S]``."""
  arrays = {"query": np.array(q), "key": np.array(k), "value": np.array(v)}
  where = {n: np.zeros(x.shape, bool) for n, x in arrays.items()}
  for name, b, head, row, feature, value in PLANTS:
    if name != "query":
      head %= case.kv_heads
    arrays[name][b, head, row, feature] = value
    where[name][b, head, row, feature] = True
  group = N // case.kv_heads  # query head n uses key/value head n // group
  bad = {n: np.repeat(where[n].any(-1), group, axis=1)  # [B, N, S]
         for n in ("key", "value")}
  sees = {n: (allowed & bad[n][:, :, None, :]).any(-1) for n in bad}
  key_rows = sees["key"] | (where["query"].any(-1) & allowed.any(-1))
  planted = tuple(jnp.asarray(arrays[n], q.dtype)
                  for n in ("query", "key", "value"))
  return (planted, tuple(where[n] for n in ("query", "key", "value")),
          key_rows | sees["value"], key_rows)

PREFIX, CHUNK = 9, 8  # the rule cases' prefix length and chunk size
PREFIXES = (6, 23)  # per example, for "per_example_prefix"


def _tree_allowed(case: Case) -> np.ndarray:
  """``[B, 1, T, S]``: node i sees its row's prefix slots and the slots
  prefix + a of the nodes a on its path up to a root (itself included),
  followed parent by parent."""
  seen = np.zeros((B, 1, case.t, case.s), bool)
  for b, (parents, prefix) in enumerate(zip(TREE_PARENTS, TREE_PREFIXES)):
    for i in range(case.t):
      seen[b, 0, i, :prefix] = True
      node = i
      while node >= 0:
        seen[b, 0, i, prefix + node] = True
        node = parents[node]
  return seen


def _rule(case: Case):
  """The case's rule as the library spells it; ``_allowed`` writes it out."""
  if case.rule == "prefix_lm":
    return aj.block_mask(aj.prefix_lm_mask_fn(PREFIX), case.t, case.s,
                         block_q=5, block_k=7)
  if case.rule == "chunked":
    return aj.block_mask(aj.chunked_mask_fn(CHUNK), case.t, case.s,
                         block_q=5, block_k=7)
  if case.rule == "prefix_lm_rule":
    return aj.prefix_lm_mask_fn(PREFIX)
  if case.rule == "per_example_prefix":
    return aj.prefix_lm_mask_fn(jnp.array(PREFIXES, jnp.int32))
  if case.rule == "selected_blocks":
    return aj.select_blocks(jnp.asarray(_chosen_blocks(case)), q_len=case.t,
                            kv_len=case.s, key_block=SELECT_BLOCK,
                            group=N // case.kv_heads, block_q=5)
  if case.rule == "selected_tokens":
    return aj.select_tokens(jnp.asarray(_chosen_tokens(case)),
                            kv_len=case.s, block_q=5, block_k=7)
  if case.rule == "tree":
    return aj.tree_rule(jnp.array(TREE_PARENTS), jnp.array(TREE_PREFIXES))
  return None


SELECT_BLOCK, SELECT_TOKENS = 7, 6  # the selection cases' key block and k


def _chosen_blocks(case: Case) -> np.ndarray:
  """Bool ``[B, K, T, ceil(S / 7)]``: each query's chosen key blocks per
  key/value head (about 40% of them)."""
  blocks = -(-case.s // SELECT_BLOCK)
  return np.asarray(_data.normal(21, (B, case.kv_heads, case.t, blocks))
                    > 0.25)


def _chosen_tokens(case: Case) -> np.ndarray:
  """Int ``[B, 1, T, 6]``: each query's chosen keys, -1 (none) and repeats
  among them."""
  return np.asarray(jax.random.randint(jax.random.key(22),
                                       (B, 1, case.t, SELECT_TOKENS), -1,
                                       case.s))


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
  if case.lengths is not None:  # [B]: per example (left-aligned)
    lengths = jnp.array(case.lengths, jnp.int32)
  if case.q_lengths is not None:
    q_lengths = jnp.array(case.q_lengths, jnp.int32)
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


def _paged(case: Case, k, v, lengths):
  """``k``, ``v`` ``[B, K, S, H]`` written into a pool of pages of
  ``case.paged`` tokens through a scrambled page table: ``(Pages, table)``.

  Sequence ``b``'s page ``j`` is a random page of the pool (every sequence's
  pages interleaved, out of order); slots past its length, its table
  entries past them (``P``: none) and the pages nobody holds are NaN. The
  write is differentiable: the pool's gradients reach ``k`` and ``v``.
  """
  z = case.paged
  b, kh, s, h = k.shape
  m = s // z
  p = b * m + 3  # three pages nobody holds
  order = np.random.default_rng(21).permutation(p)[:b * m].reshape(b, m)
  held = np.arange(m)[None, :] * z < np.asarray(lengths)[:, None]  # [B, M]
  table = jnp.asarray(np.where(held, order, p), jnp.int32)
  real = (jnp.arange(s)[None, :] < lengths[:, None])[:, None, :, None]

  def pool(x):  # [B, K, S, H] -> [P, K, Z, H]
    x = jnp.where(real, x, jnp.nan).reshape(b, kh, m, z, h)
    x = jnp.moveaxis(x, 2, 1).reshape(b * m, kh, z, h)  # page b * M + j
    return jnp.full((p, kh, z, h), jnp.nan, x.dtype).at[
        order.reshape(-1)].set(x)

  # The decoding cases vouch that what the rows hold is finite (as a
  # paged cache does while nothing held was written a NaN or inf), so a
  # kernel may skip its search for them; the prefill case does not, so
  # the search runs. The pool's NaN past the lengths must stay out either
  # way.
  finite = jnp.bool_(True) if case.t == 1 else None
  return aj.kernels.Pages(pool(k), pool(v), table, finite=finite)


def _segment_ids(case: Case):
  """Query and key ids ``[B, T]``, ``[B, S]`` (numpy), or Nones."""
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
  return q.astype(np.int32), k.astype(np.int32)


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
  q_segment_ids, kv_segment_ids = _segment_ids(case)
  if q_segment_ids is not None:
    allowed &= (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])[:, None]
  i, j = np.arange(case.t)[:, None], np.arange(case.s)[None, :]
  if case.positions is not None:  # [B, 1, T, 1], [B, 1, 1, S] positions
    q_off, kv_off = (np.array(x)[:, None, None, None] for x in case.positions)
    i, j = i + q_off, j + kv_off
  if case.rule in ("prefix_lm", "prefix_lm_rule", "union_prefix_lm"):
    allowed &= (j < PREFIX) | (j <= i)  # the prefix, then causal
  if case.rule == "per_example_prefix":
    prefix = np.array(PREFIXES)[:, None, None, None]  # [B, 1, 1, 1]
    allowed &= (j < prefix) | (j <= i)
  if case.rule == "chunked":
    allowed &= (i // CHUNK) == (j // CHUNK)
  if case.rule == "selected_blocks":  # query head n reads kv head n // G's
    chosen = np.repeat(_chosen_blocks(case), N // case.kv_heads, axis=1)
    allowed &= chosen[..., np.arange(case.s) // SELECT_BLOCK]
  if case.rule == "selected_tokens":  # [B, 1, T, S]: j among t's indices
    picks = _chosen_tokens(case)
    allowed &= (picks[..., None, :] == np.arange(case.s)[:, None]).any(-1)
  if case.rule == "tree":
    allowed &= _tree_allowed(case)
  if mask is not None:
    allowed &= np.asarray(mask)
  if lengths is not None:
    allowed &= (np.arange(case.s) < np.asarray(lengths)[:, None])[:, None,
                                                                  None, :]
  if q_lengths is not None:
    allowed &= (np.arange(case.t) < np.asarray(q_lengths)[:, None])[:, None,
                                                                    :, None]
  position = np.arange(case.t)[:, None] + (case.s - case.t)  # bottom-right
  j = np.arange(case.s)[None, :]
  if case.positions is not None:  # query i stands at key column i + q - kv
    position, j = i, j + kv_off  # as positions: compare them directly
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


def _max_logits(q, k, allowed):
  """Each row's max of the raw ``q.k / sqrt(H)`` where allowed, ``[B, N, T]``
  (float64; ``-inf`` for a row that sees nothing); query head ``n`` uses
  key head ``n // (N / K)``."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  k = np.repeat(k, q.shape[1] // k.shape[1], axis=1)  # [B, N, S, H]
  raw = np.einsum("bnth,bnsh->bnts", q, k) / np.sqrt(q.shape[-1])
  return np.where(allowed, raw, -np.inf).max(-1)


# Forward-mode AD (jax.jvp) against the reference's: empty rows and the lse,
# a bias and a modifier, every pattern with sinks and ALiBi's slopes, a
# learned table, a dense mask, dropout, a paged cache's pool.
FORWARD_CASES = ("causal_t_gt_s_empty_rows", "softcap_bias",
                 "everything_combined", "t5_bias_bidirectional_gqa",
                 "mask_empty_rows", "dropout_window_bias_softcap_sinks",
                 "paged_prefill_window_gqa_sinks",
                 "paged_decode_window_sinks_gqa", "paged_decode_bfloat16_gqa",
                 "selected_blocks_causal_gqa_lengths_sinks",
                 "selected_tokens_window_segments", "tree_prefix_gqa_sinks")
# The sequence-parallel harnesses whose kernel has no forward mode.
FORWARD_MODE_REFUSED = frozenset()


def _numbered(tree):
  """The tree with each leaf replaced by its index (distinct seeds)."""
  leaves, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(treedef, list(range(len(leaves))))


# The dropout cases' key: its two uint32 words seed every entry's draw.
DROPOUT_KEY = 11


def _dropout_keep(case: Case):
  """``[B, N, T, S]`` kept weights' factor, ``1 / (1 - rate)`` where kept
  and 0 where dropped (None without dropout): ``reference.dropout_keep``
  at each entry's (b, h, q, kv) from the key's two words."""
  if not case.dropout:
    return None
  seed = np.asarray(jax.random.bits(jax.random.key(DROPOUT_KEY), (2,),
                                    jnp.uint32))
  b, h, i, j = np.ix_(np.arange(B), np.arange(N), np.arange(case.t),
                      np.arange(case.s))
  if case.positions is not None:  # the indices a score_mod would see
    i = i + np.asarray(case.positions[0])[:, None, None, None]
    j = j + np.asarray(case.positions[1])[:, None, None, None]
  keep = reference_lib.dropout_keep(seed, b, h, i, j, case.dropout)
  return keep / (1.0 - case.dropout)


def _loss(out, lse, cot, cot_lse):
  total = jnp.sum(out.astype(jnp.float64 if out.dtype == jnp.float64
                             else jnp.float32) * cot)
  if lse is not None:  # through lse too; -inf rows contribute nothing
    total = total + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * cot_lse)
  return total


def suite(names, *, kernels=None, refuses=None, cases=None):
  """A ``chex.TestCase`` running every case on each named kernel.

  ``kernels`` (name -> kernel), ``refuses`` (name -> features) and
  ``cases`` (case names) stand in for ``CONFIGURED``, ``REFUSES`` and
  ``SUBSETS`` where given (``outside_suite``).
  """
  kernels = dict(kernels or {})
  refuses = {**REFUSES, **(refuses or {})}
  params = [(f"{name}__{case_name}", name, case_name)
            for name in names
            for case_name in (case_names(name) if cases is None else cases)]
  importance = [
      (f"{name}__{case_name}", name, case_name) for name in names
      if name not in SEQUENCE_PARALLEL  # (their harness takes sdpa's call)
      for case_name in IMPORTANCE_CASES
      if case_name in (case_names(name) if cases is None else cases)]

  class ContractTest(chex.TestCase):

    def test_every_kernel_states_what_it_refuses(self):
      for name in names:
        self.assertIn(name, refuses, f"kernel {name!r}: add what it refuses "
                      "to REFUSES in tests/contract.py")

    @parameterized.named_parameters(*[
        (f"{name}__{bad}", name, bad) for name in names
        for bad in NOT_ELEMENTWISE])
    def test_refuses_what_is_not_elementwise(self, name, bad):
      if name in NEEDS_GPU and jax.default_backend() != "gpu":
        self.skipTest("needs a GPU")
      t = 4 * RING_DEVICES  # a few rows per ring device
      q, k, v = (_data.normal(30 + i, (B, N, t, H)) for i in range(3))
      call = NOT_ELEMENTWISE[bad]
      got = _call_refused(name, kernels.get(name) or _kernel(name), q, k, v,
                          call)
      automatic = _call_refused(None, None, q, k, v, call)
      # Ring names its device's [T / devices, S / devices] blocks (and
      # their shapes, (...)): the message is compared with them left out.
      unshaped = lambda m: re.sub(r"\(\d+(, \d+)*,?\)", "(...)", re.sub(
          r"\[\d+(, \d+)*\]", "[...]", m))
      self.assertEqual(unshaped(got), unshaped(automatic))

    @parameterized.named_parameters(*[
        (f"{name}__{case_name}", name, case_name) for name in names
        for case_name in FORWARD_CASES
        if case_name in (case_names(name) if cases is None else cases)])
    def test_forward_mode(self, name, case_name):
      """``jax.jvp`` equals the reference's (float64), or is refused by the
      kernel's name (a kernel whose gradient is a custom VJP)."""
      case = CASES[case_name]
      if name in NEEDS_GPU and jax.default_backend() != "gpu":
        self.skipTest("needs a GPU")
      c = self._setup(name, case)
      refused_shape = REFUSES_SHAPES.get(name, (None,))[0]
      if c.refused or (refused_shape is not None and refused_shape(case)):
        self.skipTest("the kernel refuses the case (test_contract checks)")
      q, k, v, mask, bias, lengths, q_lengths = c.operands
      primals = (q, k, v, bias, c.diff)
      tangents = jax.tree.map(
          lambda x, i: _data.normal(40 + i, x.shape).astype(x.dtype), primals,
          _numbered(primals))
      jvp = jax.jit(lambda p, t: jax.jvp(c.ours, p, t))
      kernel = kernels.get(name) or _kernel(name)
      takes = (name not in FORWARD_MODE_REFUSED if kernel is None
               else kernel.forward_mode)
      if not takes:
        with self.assertRaisesRegex(
            ValueError, rf"implementation='{kernel.name if kernel else name}"
            r"' has no forward-mode AD"):
          jvp(primals, tangents)
        return
      (out, lse, _), (d_out, d_lse, _) = jvp(primals, tangents)
      allowed = _allowed(case, mask, lengths, q_lengths, bias)
      rows = None
      if q_lengths is not None:
        rows = (np.arange(case.t) < np.asarray(q_lengths)[:, None])[:, None]
      keep = _dropout_keep(case)
      f64 = lambda x: None if x is None else np.asarray(x, np.float64)

      def reference(q, k, v, bias, diff):
        return reference_lib.masked_attention(
            q, k, v, bias, allowed, case.softcap, rows=rows,
            t5_max_distance=T5_MAX_DISTANCE, positions=case.positions,
            keep=keep, **diff)

      with jax.enable_x64(True):
        _, (want_out, want_lse) = jax.jvp(
            reference, jax.tree.map(f64, primals),
            jax.tree.map(f64, tangents))
      tol = TOLERANCES[case.dtype]
      pairs = [("d_out", d_out, want_out)] + (
          [("d_lse", d_lse, want_lse)] if case.lse else [])
      for what, got, want in pairs:
        got, want = np.asarray(got, np.float64), np.asarray(want)
        self.assertTrue(np.isfinite(got).all(), f"{what} is not finite")
        scale = max(1.0, float(np.abs(want).max()))
        # (a tangent is a sum of products like a gradient's: its tolerance)
        np.testing.assert_allclose(got, want, atol=tol["grad"] * scale,
                                   rtol=tol["grad"], err_msg=what)

    if importance:  # (absl refuses a parameterized test with no cases)

      @parameterized.named_parameters(*importance)
      def test_key_importance(self, name, case_name):
        """``aj.key_importance`` through the column's kernel equals the
        float64 column sums of the reference's weights over the counted
        rows, or is refused naming the kernel."""
        case = CASES[case_name]
        if name in NEEDS_GPU and jax.default_backend() != "gpu":
          self.skipTest("needs a GPU")
        c = self._setup(name, case)
        q, k, _, mask, bias, lengths, q_lengths = c.operands
        kernel = kernels.get(name) or _kernel(name)
        last = IMPORTANCE_CASES[case_name]
        kw = c.keywords(bias, c.diff)
        run = jax.jit(lambda q, k: aj.key_importance(
            q, k, _mask(c.parts), implementation=kernel, last=last, **kw))
        why = (case.features() - {"lse", "max_logits"}) & refuses.get(
            name, frozenset())
        shaped = REFUSES_SHAPES.get(name, (lambda case: False,))[0]
        if why or shaped(case) or name in IMPORTANCE_REFUSES:
          said = "" if why or shaped(case) else IMPORTANCE_REFUSES[name]
          with self.assertRaisesRegex(
              ValueError, rf"implementation='{kernel.name}'.*{said}"):
            run(q, k)
          return
        got = run(q, k)
        chex.assert_shape(got, (B, N, case.s))
        self.assertEqual(got.dtype, jnp.promote_types(q.dtype, jnp.float32))
        # The reference's weights: its output with the identity for a value.
        allowed = _allowed(case, mask, lengths, q_lengths, bias)
        rows = None
        if q_lengths is not None:
          rows = (np.arange(case.t) < np.asarray(q_lengths)[:, None])[:, None]
        f64 = lambda x: None if x is None else np.asarray(x, np.float64)  # noqa: E731
        eye = np.broadcast_to(np.eye(case.s), (B, case.kv_heads, case.s,
                                               case.s))
        with jax.enable_x64(True):
          weights, _ = reference_lib.masked_attention(
              f64(q), f64(k), eye, f64(bias), allowed, case.softcap,
              rows=rows, t5_max_distance=T5_MAX_DISTANCE,
              positions=case.positions,
              **{n: f64(x) for n, x in c.diff.items()})
        # The counted rows: the last ``last`` of each example's real ones.
        real = np.full(B, case.t) if q_lengths is None else np.minimum(
            np.asarray(q_lengths), case.t)
        i = np.arange(case.t)[None, :]
        counted = i < real[:, None]
        if last is not None:
          counted &= i >= real[:, None] - last
        want = (np.asarray(weights) * counted[:, None, :, None]).sum(2)
        # (sums of <= 40 weights, each a gradient's error: its tolerance)
        tol = TOLERANCES[case.dtype]["grad"]
        np.testing.assert_allclose(
            np.asarray(got, np.float64), want, rtol=tol,
            atol=tol * max(1.0, float(np.abs(want).max())))

    @parameterized.named_parameters(*params)
    def test_contract(self, name, case_name):
      case = CASES[case_name]
      if name in NEEDS_GPU and jax.default_backend() != "gpu":
        self.skipTest("needs a GPU")
      if case.dtype == "float64":
        with jax.enable_x64(True):
          self._check(name, case)
      else:
        self._check(name, case)

    def _check(self, name, case):
      c = self._setup(name, case)
      q, k, v, mask, bias, lengths, q_lengths = c.operands
      diff, ours = c.diff, c.ours
      if c.refused:
        with self.assertRaises((ValueError, TypeError)):
          jax.jit(ours)(q, k, v, bias, diff)
        return
      refused_shape, message = REFUSES_SHAPES.get(name, (None, None))
      if refused_shape is not None and refused_shape(case):
        with self.assertRaisesRegex(ValueError, message):
          jax.jit(ours)(q, k, v, bias, diff)
        return
      self._compare(case, c)

    def _setup(self, name, case, extra=None):
      """The case's operands and ``ours(q, k, v, bias, diff)`` on kernel
      ``name`` (``extra``: more keywords of the call), whether the kernel
      refuses the case's features."""
      q, k, v, mask, bias, lengths, q_lengths = _operands(case)
      q_segment_ids, kv_segment_ids = _segment_ids(case)
      parts = dict(causal=case.causal, window=case.window,
                   kv_lengths=lengths, q_lengths=q_lengths, dense=mask,
                   q_segment_ids=None if q_segment_ids is None else jnp.asarray(
                       q_segment_ids),
                   kv_segment_ids=None if kv_segment_ids is None else jnp.asarray(
                       kv_segment_ids), rule=_rule(case))
      if case.positions is not None:
        parts["q_offset"], parts["kv_offset"] = (
            jnp.array(x, jnp.int32) for x in case.positions)
      if case.rule == "tree":  # the mask is aj.tree_mask's, as a user's
        tree = aj.tree_mask(jnp.array(TREE_PARENTS), jnp.array(TREE_PREFIXES))
        parts.update(causal=tree.causal, rule=tree.rule,
                     q_offset=tree.q_offset, kv_offset=tree.kv_offset)
      if case.rule == "union_prefix_lm":  # causal | the prefix, as a union
        union = aj.Mask(causal=True) | aj.Mask(
            rule=lambda b, h, q_idx, kv_idx: kv_idx < PREFIX)
        parts["rule"] = union.rule
      diff = _differentiable_extras(case)

      def keywords(bias, diff):
        """The call's bias, sinks and score modifier."""
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
        return kw

      def ours(q, k, v, bias, diff):
        kw = keywords(bias, diff)
        kw["return_lse"] = case.lse
        if case.max_logits:
          kw["return_max_logits"] = True
        if case.dropout:
          kw.update(dropout_rate=case.dropout,
                    dropout_rng=jax.random.key(DROPOUT_KEY))
        kw.update(extra or {})
        if name in SEQUENCE_PARALLEL:  # sharded, run, gathered
          if case.paged:
            kw["pages"] = _paged(case, k, v, lengths)
          result = SEQUENCE_PARALLEL[name](q, k, v, parts, **kw)
          result = tuple(x for x in result[:1] + result[2:] if x is not None
                         ) if case.paged else result
        elif case.paged:  # keys and values read through the page table
          result = dot_product.run(
              q, None, None, _mask(parts), pages=_paged(case, k, v, lengths),
              implementation=kernels.get(name) or _kernel(name), **kw)
          result = tuple(x for x in result[:1] + result[2:] if x is not None)
        else:
          result = aj.scaled_dot_product_attention(
              q, k, v, _mask(parts),
              implementation=kernels.get(name) or _kernel(name), **kw)
        result = list(result) if isinstance(result, tuple) else [result]
        out = result.pop(0)
        lse = result.pop(0) if case.lse else None
        return out, lse, (result.pop(0) if case.max_logits else None)

      return types.SimpleNamespace(
          operands=(q, k, v, mask, bias, lengths, q_lengths), diff=diff,
          ours=ours, parts=parts, keywords=keywords,
          refused=bool(case.features() & refuses.get(name, frozenset())))

    def _compare(self, case, c):
      """Outputs, lse, row maxima and gradients against the reference."""
      q, k, v, mask, bias, lengths, q_lengths = c.operands
      diff, ours = c.diff, c.ours
      allowed = _allowed(case, mask, lengths, q_lengths, bias)
      rows = None
      if q_lengths is not None:  # [B, 1, T]: rows that are queries
        rows = (np.arange(case.t) < np.asarray(q_lengths)[:, None])[:, None]
      q_in, k_in, v_in = q, k, v
      if case.nan_padding:  # keys and values no query may see hold NaN
        seen = allowed.any(axis=(1, 2))[:, None, :, None]  # [B, 1, S, 1]
        k_in = jnp.where(seen, k, jnp.nan)
        v_in = jnp.where(seen, v, jnp.nan)
      dirty = np.zeros((B, N, case.t), bool)  # rows that see garbage
      key_dirty = dirty  # ... in a key or their query: lse too
      planted = (False, False, False)
      if case.garbage:
        (q_in, k_in, v_in), planted, dirty, key_dirty = _plant(
            case, q, k, v, allowed)
        # the pattern shows the garbage to some rows, not to all
        self.assertTrue(dirty.any() and not dirty.all())

      # One compile each for ours and the reference: outputs ride along
      # with the gradient as auxiliary values. Rows that see garbage get
      # no cotangent (in both): every other gradient is the clean run's.
      cot = jnp.where(dirty[..., None], 0.0, _data.normal(7, (B, N, case.t,
                                                             H)))
      cot_lse = jnp.where(key_dirty, 0.0, _data.normal(8, (B, N, case.t))
                          ) if case.lse else None
      cot_max = _data.normal(15, (B, N, case.t)) if case.max_logits else None
      argnums = (0, 1, 2, 4) + ((3,) if bias is not None else ())

      def loss_and_outputs(*a):
        out, lse, max_logits = ours(*a)
        # (NaN rows carry a zero cotangent; they stay out of the value)
        loss = _loss(jnp.where(dirty[..., None], 0, out),
                     None if lse is None else jnp.where(key_dirty, 0, lse),
                     cot, cot_lse)
        if max_logits is not None:  # no gradient: the grads must not move
          loss = loss + jnp.sum(jnp.where(jnp.isfinite(max_logits),
                                          max_logits, 0.0) * cot_max)
        return loss, (out, lse, max_logits)

      (_, (out, lse, max_logits)), grads = jax.jit(jax.value_and_grad(
          loss_and_outputs, argnums, has_aux=True))(q_in, k_in, v_in, bias,
                                                     diff)
      f64 = lambda x: None if x is None else np.asarray(x, np.float64)
      diff64 = {name: f64(x) for name, x in diff.items()}

      keep = _dropout_keep(case)  # (NumPy, outside the trace)

      def reference_loss_and_outputs(q, k, v, bias, diff):
        out, lse = reference_lib.masked_attention(
            q, k, v, bias, allowed, case.softcap, rows=rows,
            t5_max_distance=T5_MAX_DISTANCE, positions=case.positions,
            keep=keep, **diff)
        return _loss(out, None if cot_lse is None else lse, f64(cot),
                     f64(cot_lse)), (out, lse)

      with jax.enable_x64(True):
        (_, (ref_out, ref_lse)), want = jax.jit(jax.value_and_grad(
            reference_loss_and_outputs, argnums, has_aux=True))(
                f64(q), f64(k), f64(v), f64(bias), diff64)
      tol = TOLERANCES[case.dtype]
      chex.assert_shape(out, (B, N, case.t, H))
      self.assertEqual(out.dtype, q.dtype)
      out = np.asarray(out, np.float64)
      # Rows that see garbage are not finite (never a finite number made
      # up); every other row is finite and the clean inputs' answer.
      self.assertFalse(np.isfinite(out[dirty]).all(-1).any(),
                       "a row that sees NaN or inf is finite")
      chex.assert_tree_all_finite(out[~dirty])
      np.testing.assert_allclose(out[~dirty], ref_out[~dirty],
                                 atol=tol["fwd"], rtol=tol["fwd"])
      empty = ~allowed.any(-1)  # [B, N, T]: queries that see nothing
      np.testing.assert_array_equal(out[empty], 0.0)
      if case.lse:
        lse = np.asarray(lse, np.float64)
        self.assertFalse(np.isfinite(lse[key_dirty]).any(),
                         "a row that sees a NaN or inf key has a finite lse")
        np.testing.assert_allclose(lse[~key_dirty], ref_lse[~key_dirty],
                                   atol=tol["fwd"], rtol=tol["fwd"])
      if case.max_logits:  # -inf exactly where a row sees nothing
        chex.assert_shape(max_logits, (B, N, case.t))
        self.assertEqual(max_logits.dtype, jnp.promote_types(q.dtype,
                                                             jnp.float32))
        np.testing.assert_allclose(
            np.asarray(max_logits, np.float64), _max_logits(q, k, allowed),
            atol=tol["fwd"], rtol=tol["fwd"])

      names = ["dq", "dk", "dv"] + [f"d{n}" for n in diff] + (
          ["dbias"] if bias is not None else [])
      got_all = list(grads[:3]) + [grads[3][n] for n in diff] + list(
          grads[4:])
      want_all = list(want[:3]) + [want[3][n] for n in diff] + list(want[4:])
      # The planted entries themselves are compared nowhere (their
      # gradient is the kernel's choice); each must still be finite.
      clean = [~np.asarray(x) for x in planted] + [True] * (len(names) - 3)
      for name, got, ref, at in zip(names, got_all, want_all, clean):
        got = np.asarray(got, np.float64)
        self.assertTrue(np.isfinite(got).all(), f"{name} is not finite")
        scale = max(1.0, float(np.abs(ref).max()))
        np.testing.assert_allclose(np.where(at, got, 0), np.where(at, ref, 0),
                                   atol=tol["grad"] * scale,
                                   rtol=tol["grad"], err_msg=name)
      # A query that may see nothing has exactly zero gradient.
      np.testing.assert_array_equal(np.asarray(grads[0])[empty], 0.0)

  return ContractTest


def outside_suite(kernel, refuses, cases=None):
  """The contract for one kernel instance, e.g. one written outside the
  library (``docs/usage.md``, "Writing a kernel").

  Args:
    kernel: an ``aj.kernels.Kernel`` instance, run as ``implementation=``
      (registered or not).
    refuses: the case features it refuses (its ``supports`` must refuse
      every case with one of them, with a ValueError): a subset of
      ``FEATURES``.
    cases: names of ``CASES`` to run (None: all).

  Returns:
    A ``chex.TestCase`` class; assign it to a module-level name of a test
    file for pytest to collect.
  """
  if not isinstance(kernel, aj.kernels.Kernel):
    raise TypeError(f"kernel must be an aj.kernels.Kernel instance, got "
                    f"{kernel!r}.")
  unknown = set(refuses) - FEATURES
  if unknown:
    raise ValueError(f"refuses names no case feature: {sorted(unknown)}; "
                     f"the features are {sorted(FEATURES)}.")
  missing = set(cases or ()) - set(CASES)
  if missing:
    raise ValueError(f"no such contract cases: {sorted(missing)}.")
  return suite([kernel.name], kernels={kernel.name: kernel},
               refuses={kernel.name: frozenset(refuses)},
               cases=None if cases is None else tuple(cases))


# Every feature a case can have (what REFUSES and outside_suite name).
FEATURES = frozenset(TOLERANCES).union(*(c.features() for c in CASES.values()))
