"""Custom attention patterns as block masks: ``block_mask(mask_fn, ...)``.

Shape glossary: B batch, N query heads, T query length, S key/value length;
bq/bk query and key block sizes; nq = ceil(T / bq) query blocks, nk =
ceil(S / bk) key blocks.

A rule the built-in mask fields (causal, window, lengths, segment ids)
cannot express — prefix-LM, chunked, dilated, any
predicate a user writes — is a vectorised ``mask_fn(b, h, q_idx, kv_idx) ->
bool`` (True = may attend) over the batch and query-head indices and the
query and key indices ``0 <= q_idx < T``, ``0 <= kv_idx < S``; a
``MaskRule(fn, params)`` carries the arrays such a rule reads, traced ones
included (per-example prefix lengths computed inside ``jax.jit``), as one
pytree. ``block_mask`` evaluates it once, by query blocks, and
classifies every ``[bq, bk]`` block as empty, partial or full, per ``(b,
h)`` when the rule depends on them (``batch=``): with NumPy when it is
concrete, on device when it is traced. The flash kernels then visit only
the non-empty blocks (forward and backward), evaluate ``mask_fn`` only
inside partial blocks, and the dense kernel materialises the same
predicate; ring attention evaluates it in every block it visits. A
``BlockMask`` (defined in ``mask``) is a pytree: build it once and reuse it
across layers and steps, or pass the rule as ``aj.Mask(rule=...)`` and the
blockwise kernel builds its tables at its own block sizes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.core import checks
from attention_jax.masking import intervals
from attention_jax.masking.mask import BlockMask
from attention_jax.masking.mask import MaskRule

EMPTY, PARTIAL, FULL = intervals.EMPTY, intervals.PARTIAL, intervals.FULL
MaskFn = intervals.MaskFn


def _compact(kinds: np.ndarray):
  """Per row: non-empty column indices (padded with the count), full flags."""
  rows, cols = kinds.shape
  width = max(1, int((kinds != EMPTY).sum(1).max(initial=0)))
  indices = np.full((rows, width), cols, np.int32)
  full = np.zeros((rows, width), bool)
  for r in range(rows):
    nonempty = np.flatnonzero(kinds[r] != EMPTY)
    indices[r, :nonempty.size] = nonempty
    full[r, :nonempty.size] = kinds[r, nonempty] == FULL
  return indices, full


def _compact_on_device(kinds: jax.Array):
  """``_compact`` of ``[..., rows, cols]`` kinds, traced: width ``cols``."""
  cols = kinds.shape[-1]
  order = jnp.argsort(kinds == EMPTY, axis=-1, stable=True)  # non-empty first
  kept = jnp.take_along_axis(kinds, order, -1)
  indices = jnp.where(kept != EMPTY, order, cols).astype(jnp.int32)
  return indices, kept == FULL


def _classify(allowed, kv_len: int, nk: int, bk: int, xp):
  """Kinds ``[..., nk]`` of the key blocks of one query block's rows."""
  pad = nk * bk - kv_len
  widths = [(0, 0)] * (allowed.ndim - 1) + [(0, pad)]
  blocks = xp.pad(allowed, widths).reshape(allowed.shape[:-1] + (nk, bk))
  valid = xp.pad(xp.ones(kv_len, bool), (0, pad)).reshape(
      (1,) * (blocks.ndim - 2) + (nk, bk))
  some = blocks.any(axis=(-3, -1))
  every = (blocks | ~valid).all(axis=(-3, -1))
  return xp.where(every, FULL, xp.where(some, PARTIAL, EMPTY)).astype(
      xp.int8)


def block_mask(mask_fn: MaskFn, q_len: int, kv_len: int, *,
               batch: tuple[int, ...] = (), block_q: int = 512,
               block_k: int = 256) -> BlockMask:
  """Evaluates ``mask_fn`` once and classifies its blocks.

  Args:
    mask_fn: vectorised predicate ``mask_fn(b, h, q_idx, kv_idx) -> bool``,
      or a ``MaskRule(fn, params)`` carrying the arrays it reads (traced
      ones must travel so: a plain function closing over a traced value is
      refused)
      over broadcast integer index arrays (of rank ``len(batch) + 2`` here:
      ``b``/``h`` over the batch axes, ``q_idx`` ``[.., bq, 1]``, ``kv_idx``
      ``[.., 1, S]``; inside the kernels ``b``/``h`` are int32 scalars and
      ``q_idx``/``kv_idx`` ``[bq, 1]``/``[1, bk]``); True = may
      attend. ``b`` and ``h`` number the operands' leading dims as for
      ``score_mod`` (batch, then query head). Write it with ``jnp``
      operations.
    q_len: ``T``, the query length of the calls it will serve.
    kv_len: ``S``, their key/value length.
    batch: the leading dims the rule depends on, e.g. ``(B, 1)`` for a
      per-example rule over ``[B, N, T, H]`` operands or ``(B, N)`` per head
      too; ``()`` (default) when it depends on neither (one table for all).
    block_q: query block size of the blockwise kernels (clipped to ``T``);
      the default 512 x 256 was the fastest for a per-example prefix-LM
      (docs/performance.md, "Default blocks").
    block_k: key block size (clipped to ``S``).

  Returns:
    A ``BlockMask`` to pass as ``mask=`` to ``scaled_dot_product_attention``,
    ``blockwise_attention``, ``ring_attention`` (as a rule on global
    indices), ``multi_head_attention`` and the module. Its tables are NumPy
    arrays for a concrete rule (inside or outside ``jax.jit``), device
    arrays for a traced one.

  Raises:
    TypeError: ``mask_fn`` is not callable, returns a non-bool array, or
      closes over traced values (use a ``MaskRule``).
    ValueError: non-positive lengths or block sizes, a ``batch`` that is
      not a tuple of positive ints, or a result that does not broadcast to
      ``batch + [bq, S]``.

  Example:
    >>> bm = block_mask(prefix_lm_mask_fn(64), 256, 256, block_q=64,
    ...                 block_k=64)
    >>> np.asarray(bm.kinds)  # 0 empty, 1 partial, 2 full
    array([[2, 0, 0, 0],
           [2, 1, 0, 0],
           [2, 2, 1, 0],
           [2, 2, 2, 1]], dtype=int8)
    >>> per_example = jax.jit(lambda p: block_mask(
    ...     prefix_lm_mask_fn(p), 8, 8, batch=(2, 1), block_q=4,
    ...     block_k=4).kinds)(jnp.array([2, 6]))  # traced prefix lengths
    >>> per_example[:, 0].tolist()  # [B, nq, nk]
    [[[1, 0], [2, 1]], [[2, 1], [2, 1]]]
  """
  if not callable(mask_fn):
    raise TypeError(f"mask_fn must be callable (b, h, q_idx, kv_idx) -> bool, "
                    f"got {type(mask_fn).__name__}.")
  for name, value in (("q_len", q_len), ("kv_len", kv_len),
                      ("block_q", block_q), ("block_k", block_k)):
    checks.check_positive_int(name, value)
  if not isinstance(batch, tuple) or any(
      isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in batch):
    raise ValueError(f"batch must be a tuple of positive ints (the leading "
                     f"dims the rule depends on, e.g. (B, 1)), got {batch!r}.")
  examples = getattr(mask_fn, "examples", None)  # a MaskRule per example
  if examples is not None and (not batch or batch[-2 if len(batch) > 1 else 0]
                               != examples):
    raise ValueError(
        f"mask_fn holds one rule per example ({examples} examples), so the "
        f"block tables must be per example too: pass batch=({examples}, 1) "
        f"for [B, N, T, H] operands (or ({examples},) for [B, T, H]); got "
        f"batch={batch}.")
  bq, bk = min(block_q, q_len), min(block_k, kv_len)
  nq, nk = -(-q_len // bq), -(-kv_len // bk)
  try:
    kinds = _kinds_numpy(mask_fn, batch, q_len, kv_len, bq, nq, nk, bk)
    kv_indices, kv_full, q_indices, q_full = compact_tables(kinds, np)
  except jax.errors.TracerArrayConversionError:  # a traced rule: on device
    if not isinstance(mask_fn, MaskRule) and _closes_over_tracers(
        mask_fn, batch, kv_len):
      raise TypeError(
          "mask_fn depends on traced values it closes over, which the "
          "kernels' custom VJPs (and shard_map) cannot carry: pass them "
          "explicitly, aj.MaskRule(lambda b, h, q_idx, kv_idx, params: ..., "
          "params), e.g. aj.prefix_lm_mask_fn(prefix_lengths) for "
          "per-example prefixes.") from None
    kinds = _kinds_on_device(mask_fn, batch, q_len, kv_len, bq, nq, nk, bk)
    kv_indices, kv_full, q_indices, q_full = compact_tables(kinds, jnp)
  return BlockMask(mask_fn, q_len, kv_len, bq, bk, kinds, kv_indices,
                   kv_full, q_indices, q_full)


def _closes_over_tracers(mask_fn, batch, kv_len: int) -> bool:
  """Whether ``mask_fn`` reads traced values from its closure.

  Inside ``jax.jit`` even ``jnp`` operations on constants are traced; only
  closed-over traced values (the consts of the rule's program) are refused.
  """
  b, h = intervals.rule_indices(batch, np)
  lead = (1,) * len(batch)
  program = jax.make_jaxpr(mask_fn)(b, h, np.zeros(lead + (1, 1), np.int32),
                                    np.arange(kv_len).reshape(lead + (1, -1)))
  return any(isinstance(c, jax.core.Tracer) for c in program.consts)


def _check_result(allowed, batch, rows: int, kv_len: int, xp):
  if allowed.dtype != np.bool_:
    raise TypeError(f"mask_fn must return a bool array, got dtype "
                    f"{allowed.dtype} with shape {allowed.shape}.")
  want = tuple(batch) + (rows, kv_len)
  try:
    return xp.broadcast_to(allowed, want)
  except ValueError:
    raise ValueError(
        f"mask_fn(b, h, q_idx [{rows}, 1], kv_idx [1, {kv_len}]) returned "
        f"shape {allowed.shape}, which does not broadcast to {list(want)} "
        f"(batch={batch}).") from None


def _kinds_numpy(mask_fn, batch, q_len, kv_len, bq, nq, nk, bk):
  """``batch + [nq, nk]`` kinds with NumPy (raises on a traced rule)."""
  b, h = intervals.rule_indices(batch, np)
  lead = (1,) * len(batch)  # indices of the rule's full rank
  cols = np.arange(kv_len).reshape(lead + (1, -1))
  kinds = np.zeros(tuple(batch) + (nq, nk), np.int8)
  for i in range(nq):
    rows = np.arange(i * bq, min((i + 1) * bq, q_len)).reshape(lead + (-1, 1))
    allowed = np.asarray(mask_fn(b, h, rows, cols))
    allowed = _check_result(allowed, batch, rows.shape[-2], kv_len, np)
    kinds[..., i, :] = _classify(allowed, kv_len, nk, bk, np)
  return kinds


def _kinds_on_device(mask_fn, batch, q_len, kv_len, bq, nq, nk, bk):
  """``batch + [nq, nk]`` kinds, one query block at a time (``lax.map``).

  Rows past ``T`` in the last block repeat row ``T - 1`` (``clip``), which
  leaves that block's kinds unchanged.
  """
  b, h = intervals.rule_indices(batch, jnp)
  lead = (1,) * len(batch)  # indices of the rule's full rank
  cols = jnp.arange(kv_len).reshape(lead + (1, -1))

  def one(i):
    rows = jnp.minimum(i * bq + jnp.arange(bq), q_len - 1).reshape(
        lead + (-1, 1))
    allowed = jnp.asarray(mask_fn(b, h, rows, cols))
    allowed = _check_result(allowed, batch, bq, kv_len, jnp)
    return _classify(allowed, kv_len, nk, bk, jnp)

  kinds = jax.lax.map(one, jnp.arange(nq))  # [nq, *batch, nk]
  return jnp.moveaxis(kinds, 0, -2)


def compact_tables(kinds, xp):
  """Per query block and per key block lists of ``batch + [nq, nk]`` kinds."""
  if xp is np:
    flat = kinds.reshape((-1,) + kinds.shape[-2:])
    rows = [_compact(k) for k in flat]
    cols = [_compact(k.T) for k in flat]
    width = max(r[0].shape[1] for r in rows)
    width_t = max(c[0].shape[1] for c in cols)
    nq, nk = kinds.shape[-2:]

    def stack(parts, w, pad):
      idx = np.stack([np.pad(p[0], ((0, 0), (0, w - p[0].shape[1])),
                             constant_values=pad) for p in parts])
      full = np.stack([np.pad(p[1], ((0, 0), (0, w - p[1].shape[1])))
                       for p in parts])
      shape = kinds.shape[:-2]
      return (idx.reshape(shape + idx.shape[1:]),
              full.reshape(shape + full.shape[1:]))

    return (*stack(rows, width, nk), *stack(cols, width_t, nq))
  kv_indices, kv_full = _compact_on_device(kinds)
  q_indices, q_full = _compact_on_device(jnp.swapaxes(kinds, -1, -2))
  return kv_indices, kv_full, q_indices, q_full


def prefix_lm_mask_fn(prefix_len) -> MaskFn:
  """Prefix-LM: every query sees the first ``prefix_len`` keys, then causal.

  Query ``i`` may see key ``j`` iff ``j < prefix_len`` or ``j <= i`` (for
  ``T == S``: a bidirectional prefix followed by causal generation).

  Args:
    prefix_len: a positive int, an integer scalar array (traced too), or an
      integer array ``[B]`` of per-example prefix lengths (traced ones too:
      build the mask with ``batch=(B, 1)`` inside ``jax.jit``).

  Example:
    >>> prefix_lm_mask_fn(2)(0, 0, np.arange(4)[:, None],
    ...                      np.arange(4)[None, :]).astype(int).tolist()
    [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
  """
  if np.ndim(prefix_len) == 0 and not isinstance(prefix_len, jax.Array):
    checks.check_positive_int("prefix_len", prefix_len)
    return _PrefixLM(int(prefix_len))
  if np.ndim(prefix_len) == 0 and jnp.issubdtype(jnp.result_type(prefix_len),
                                                 jnp.integer):
    return MaskRule(_prefix_shared, prefix_len)  # one (traced) length
  if not jnp.issubdtype(jnp.result_type(prefix_len), jnp.integer) or (
      np.ndim(prefix_len) != 1):
    raise TypeError(f"prefix_len must be a positive int or an integer array "
                    f"[B], got {jnp.result_type(prefix_len)} with shape "
                    f"{np.shape(prefix_len)}.")
  return MaskRule(_prefix_per_example, prefix_len,
                  examples=int(np.shape(prefix_len)[0]))


def _prefix_shared(b, h, q_idx, kv_idx, length):
  del b, h
  return (kv_idx < length) | (kv_idx <= q_idx)


def _prefix_per_example(b, h, q_idx, kv_idx, lengths):
  del h
  return (kv_idx < lengths[b]) | (kv_idx <= q_idx)


def chunked_mask_fn(chunk: int) -> MaskFn:
  """Chunked attention: query ``i`` sees key ``j`` iff both lie in one chunk.

  Chunks are ``[c * chunk, (c + 1) * chunk)``; with ``is_causal=True`` it is
  the chunked-causal attention of Llama 4's local layers.

  Example:
    >>> chunked_mask_fn(2)(0, 0, np.arange(4)[:, None],
    ...                    np.arange(4)[None, :]).astype(int).tolist()
    [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]]
  """
  checks.check_positive_int("chunk", chunk)
  return _Chunked(int(chunk))


# The built-in rules with Python-int settings are values (hashable by their
# settings), so a Mask holding one is the same static structure on every
# call: jit traces once, not once per freshly built closure.
@dataclasses.dataclass(frozen=True)
class _PrefixLM:
  length: int

  def __call__(self, b, h, q_idx, kv_idx):
    del b, h
    return (kv_idx < self.length) | (kv_idx <= q_idx)


@dataclasses.dataclass(frozen=True)
class _Chunked:
  chunk: int

  def __call__(self, b, h, q_idx, kv_idx):
    del b, h
    return (q_idx // self.chunk) == (kv_idx // self.chunk)
