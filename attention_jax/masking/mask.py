"""``Mask``: which (query, key) pairs may interact, as one value.

Shape glossary: B batch, N query heads, T query length, S key/value length;
``...`` the operands' leading dims (e.g. ``B, N``).

One alignment rule for everything in a mask: query ``i`` stands at key
position ``i + S - T`` (bottom-right: the last query meets the last key, so
a query over a longer cache of keys sees all of its past). Causality and
windows are written against that position; lengths and segment ids count
absolute positions ``0..T-1`` and ``0..S-1``; a rule sees the raw indices
``q_idx`` and ``kv_idx``. Positions given in the mask (``q_offset``,
``kv_offset``: query row ``i`` at ``q_offset + i``, key column ``j`` at
``kv_offset + j``) replace that alignment: causality, windows, rules and
score modifiers then compare and see positions (a decoding step's queries
over its cache slots), while lengths, segment ids and a dense array still
count rows and columns.

A ``Mask`` is a pytree: the structure (``causal``, ``window``, a rule's
function) is static auxiliary data, the arrays (lengths, segment ids, a
dense mask, a rule's parameters) are leaves, so masks are built inside
``jax.jit`` from traced values and travel through ``jax.vmap``/``scan``.
Masks combine: ``a & b`` intersects them field by field (the structure
stays, so kernels still skip blocks analytically); ``a | b`` becomes a rule
evaluated from both, whose blocks the kernels classify on device.

Per-example arrays align to the *left* of the leading dims: lengths ``[B]``
(or ``[B, N]``, or a scalar) and segment ids ``[B, T]`` (or ``[T]`` shared,
or ``[B, N, T]``) against ``[B, N, T, H]`` operands mean the same at the
multi-head layer and below it. A dense mask is logits-shaped, of the
logits' full rank (size-1 axes broadcast).
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.core import checks
from attention_jax.masking import intervals

MaskFn = Callable[..., jax.Array]  # mask_fn(b, h, q_idx, kv_idx) -> bool

_POSITIONED_RULE = (
    "a mask that gives positions (q_offset/kv_offset) cannot hold a union "
    "(|) or a BlockMask: their members and block tables are built over row "
    "and column indices, not positions. Write the rule as one "
    "aj.MaskRule(fn, params) (kernels evaluate it at the positions) or "
    "drop the positions.")

_TREE_WINDOW = (
    "the Mask's window counts slots; a tree's drafted siblings take slots "
    "but not positions: give the window to aj.tree_rule(window=) (or "
    "aj.tree_mask(window=)), which measures it by the nodes' positions.")


def depth_positions(rule) -> bool:
  """Whether ``rule`` (or a rule of an ``&`` of rules) places queries by
  tree depth (``aj.tree_rule``, marked ``depth_positions``): a window over
  slots is then refused beside it."""
  if isinstance(rule, Both):
    return depth_positions(rule.a) or depth_positions(rule.b)
  fn = _rule_fn(rule)
  return bool(getattr(getattr(fn, "fn", fn), "depth_positions", False))


def key_only(rule) -> bool:
  """Whether ``rule`` is a ``BlockMask`` whose rule reads key columns only
  (a selection of key blocks with one row for every query, marked
  ``key_only`` by ``select_blocks``): with key positions equal to columns
  (no ``kv_offset``) its tables hold at any query positions, so a decoding
  step (a paged cache's) may carry it and the walk reads only the chosen
  blocks."""
  fn = getattr(getattr(rule, "mask_fn", None), "fn", None)
  return isinstance(rule, BlockMask) and bool(getattr(fn, "key_only", False))


def _positioned_rule(rule, kv_offset) -> bool:
  """A union or a block mask at positions (refused), a key-only selection
  with key columns at their positions excepted."""
  if key_only(rule) and kv_offset is None:
    return False
  return isinstance(rule, (Union, BlockMask))


_FIELDS = ("q_lengths", "kv_lengths", "q_segment_ids", "kv_segment_ids",
           "dense", "q_offset", "kv_offset")
# A Mask's array fields, for the code that rebuilds one from its parts (a
# shard's arrays inside shard_map).
ARRAY_FIELDS = _FIELDS


def _integer_array(name: str, x):
  return checks.integer_array(f"Mask's {name}", x)


@jax.tree_util.register_pytree_node_class
class MaskRule:
  """A mask rule and the arrays it reads, as one pytree.

  ``rule(b, h, q_idx, kv_idx)`` is ``fn(b, h, q_idx, kv_idx, params)``:
  ``fn`` is static, ``params`` (e.g. per-example prefix lengths ``[B]``,
  traced ones too) are leaves, so they reach the kernels as operands
  rather than as a closure, which a custom VJP or a ``shard_map`` cannot
  carry. ``examples``, when set, is the batch size the rule is written for
  (``block_mask`` then requires per-example tables).
  """

  def __init__(self, fn, params=None, examples: int | None = None):
    if not callable(fn):
      raise TypeError(f"MaskRule's fn must be callable (b, h, q_idx, kv_idx, "
                      f"params) -> bool, got {type(fn).__name__}.")
    self.fn, self.params, self.examples = fn, params, examples

  def __call__(self, b, h, q_idx, kv_idx):
    return self.fn(b, h, q_idx, kv_idx, self.params)

  def tree_flatten(self):
    return (self.params,), (self.fn, self.examples)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(aux[0], children[0], aux[1])


@jax.tree_util.register_pytree_node_class
class BlockMask:
  """A ``mask_fn`` classified by ``[block_q, block_k]`` blocks.

  Attributes:
    mask_fn: the predicate ``mask_fn(b, h, q_idx, kv_idx) -> bool``.
    q_len, kv_len: ``T`` and ``S`` it was built for.
    block_q, block_k: block sizes (clipped to ``T`` and ``S``).
    kinds: int8 ``[..., nq, nk]``: ``EMPTY``, ``PARTIAL`` or ``FULL`` per
      block; the leading dims (``batch_shape``, e.g. ``[B, 1]``) broadcast
      against the operands' leading dims (none: one table for all).
    kv_indices: int32 ``[..., nq, m]``: each query block's non-empty key
      blocks in increasing order, padded with ``nk``; ``kv_full`` bool
      ``[..., nq, m]`` marks the full ones.
    q_indices, q_full: the same per key block (``[..., nk, m']``, padded
      with ``nq``), for the backward pass.
    The tables are None in a rule without tables (``rule_only``: ring
    attention evaluates the rule in every block it visits).
  """

  def __init__(self, mask_fn, q_len, kv_len, block_q, block_k, kinds,
               kv_indices, kv_full, q_indices, q_full):
    self.mask_fn = mask_fn
    self.q_len, self.kv_len = q_len, kv_len
    self.block_q, self.block_k = block_q, block_k
    self.kinds = kinds
    self.kv_indices, self.kv_full = kv_indices, kv_full
    self.q_indices, self.q_full = q_indices, q_full

  @property
  def tables(self) -> tuple:
    """``(kinds, kv_indices, kv_full, q_indices, q_full)``."""
    return (self.kinds, self.kv_indices, self.kv_full, self.q_indices,
            self.q_full)

  def with_tables(self, tables) -> BlockMask:
    """The same rule with other (e.g. one head's) tables."""
    return BlockMask(self.mask_fn, self.q_len, self.kv_len, self.block_q,
                     self.block_k, *tables)

  def tree_flatten(self):
    # A MaskRule's arrays are leaves; a plain function is static.
    rule = isinstance(self.mask_fn, MaskRule)
    children = self.tables + ((self.mask_fn,) if rule else ())
    aux = (None if rule else self.mask_fn, self.q_len, self.kv_len,
           self.block_q, self.block_k)
    return children, aux

  @classmethod
  def tree_unflatten(cls, aux, children):
    fn = children[5] if aux[0] is None else aux[0]
    return cls(fn, *aux[1:], *children[:5])

  @property
  def shape(self) -> tuple[int, int]:
    """``(T, S)``, the lengths the mask was built for."""
    return (self.q_len, self.kv_len)

  @property
  def batch_shape(self) -> tuple[int, ...]:
    """The leading dims of the tables (``()``: one table for every head)."""
    return () if self.kinds is None else tuple(np.shape(self.kinds)[:-2])

  def __repr__(self):
    if self.kinds is None or isinstance(self.kinds, jax.core.Tracer):
      return (f"BlockMask(q_len={self.q_len}, kv_len={self.kv_len}, "
              f"block_q={self.block_q}, block_k={self.block_k}, "
              f"batch_shape={self.batch_shape})")
    kinds = np.asarray(self.kinds)
    counts = {name: int((kinds == k).sum()) for name, k in
              (("empty", intervals.EMPTY), ("partial", intervals.PARTIAL),
               ("full", intervals.FULL))}
    return (f"BlockMask(q_len={self.q_len}, kv_len={self.kv_len}, "
            f"block_q={self.block_q}, block_k={self.block_k}, blocks={counts})")


@jax.tree_util.register_pytree_node_class
class Mask:
  """Which (query, key) pairs may attend: causal, windows, lengths, segments,
  a dense array and a rule, intersected.

  Args:
    causal: query ``i`` sees key ``j`` only when ``j <= i + S - T``.
    window: ``w`` or ``(left, right)`` (static ints, jax.nn's
      ``local_window_size``): query ``i`` sees keys ``i' - left <= j <= i'
      + right`` with ``i' = i + S - T``; ``causal=True, window=(W - 1, 0)``
      is the causal sliding window of ``W`` tokens. An int ``w`` is
      ``(w, w)``. It counts slots: beside a tree's rule (whose nodes'
      positions are depths) it is refused; ``aj.tree_rule(window=)``.
    q_lengths: integer, a scalar or one per example (``[B]``, left-aligned
      to the leading dims; ``[B, N]`` per head): query rows at positions
      ``>=`` the length get output 0, lse ``-inf``. Checked against ``T``
      when concrete; traced values clip.
    kv_lengths: the same for keys: keys at positions ``>=`` the length are
      padding. Costs no ``[T, S]`` memory in the blockwise kernels.
    q_segment_ids: integer ``[T]`` (shared) or ``[B, T]`` (``[B, N, T]``):
      packed documents; a query sees only keys with its id. Contiguous ids
      make the blockwise kernels skip every cross-document block.
    kv_segment_ids: integer ``[S]`` / ``[B, S]``; None means the query ids
      (packed self-attention).
    dense: bool (or integer, 0 = blocked) array broadcastable to the logits
      ``[..., T, S]``, of their full rank. Costs a ``[T, S]`` pass per head.
    rule: a predicate ``mask_fn(b, h, q_idx, kv_idx) -> bool`` over the
      batch and query-head indices and the query and key indices; an
      ``aj.MaskRule(fn, params)`` when it reads arrays (traced per-example
      prefix lengths, document boundaries), or an ``aj.BlockMask`` with its
      block tables precomputed. Kernels classify its blocks (NumPy when
      concrete, on device when traced) and skip the empty ones.
    q_offset: integer position of query row 0, a scalar or one per example
      (``[B]``, left-aligned; ``[B, N]`` per head): query row ``i`` stands
      at position ``q_offset + i``. Given (with or without ``kv_offset``),
      causality and windows compare positions (query ``i`` sees key ``j``
      when ``kv_offset + j <= q_offset + i`` for causal, within the window
      around it), and a rule and a score modifier see positions as
      ``q_idx``/``kv_idx``; lengths, segment ids and ``dense`` still index
      rows and columns. None: the bottom-right alignment above. A decoding
      step over a cache of ``S`` slots is ``q_offset=index`` (the tokens
      cached before it): no dense mask over the slots, and the blockwise
      kernels skip every block outside the band.
    kv_offset: the position of key column 0 (default 0 when ``q_offset``
      is given; giving ``kv_offset`` alone means ``q_offset=0``); a
      left-padded cache counts positions from each example's first real
      token with ``kv_offset=-pads``.

  Example:
    >>> m = Mask(causal=True, kv_lengths=jnp.array([5, 3]))
    >>> (m & Mask(window=(2, 0))).window
    (2, 0)
    >>> q = jnp.ones((2, 4, 6, 8))  # [B, N, T, H]
    >>> out = aj.scaled_dot_product_attention(q, q, q, m)
    >>> out.shape
    (2, 4, 6, 8)
  """

  def __init__(self, *, causal: bool = False,
               window: int | tuple[int, int] | None = None,
               q_lengths=None, kv_lengths=None, q_segment_ids=None,
               kv_segment_ids=None, dense=None, rule=None, q_offset=None,
               kv_offset=None):
    if not isinstance(causal, (bool, np.bool_)):
      raise TypeError(f"Mask's causal must be a Python bool (static), got "
                      f"{causal!r}.")
    self.causal = bool(causal)
    self.window = None if window is None else intervals.check_window(window)
    self.q_lengths = None if q_lengths is None else _integer_array(
        "q_lengths", q_lengths)
    self.kv_lengths = None if kv_lengths is None else _integer_array(
        "kv_lengths", kv_lengths)
    if q_segment_ids is None and kv_segment_ids is not None:
      raise ValueError("Mask's kv_segment_ids need q_segment_ids (the "
                       "queries' documents); pass both.")
    self.q_segment_ids = None if q_segment_ids is None else _integer_array(
        "q_segment_ids", q_segment_ids)
    if q_segment_ids is not None and kv_segment_ids is None:
      kv_segment_ids = self.q_segment_ids
    self.kv_segment_ids = None if kv_segment_ids is None else _integer_array(
        "kv_segment_ids", kv_segment_ids)
    if dense is not None:
      if isinstance(dense, (list, tuple)):
        dense = np.asarray(dense)
      dtype = jnp.result_type(dense)
      if not (dtype == jnp.bool_ or jnp.issubdtype(dtype, jnp.integer)):
        raise TypeError(f"Mask's dense must be a bool (or integer, 0 = "
                        f"blocked) array, got dtype {dtype} with shape "
                        f"{np.shape(dense)}; additive (float) terms go "
                        "through bias.")
    self.dense = dense
    if rule is not None and not (callable(rule) or isinstance(rule,
                                                              BlockMask)):
      raise TypeError(
          f"Mask's rule must be callable mask_fn(b, h, q_idx, kv_idx) -> "
          f"bool, an aj.MaskRule(fn, params) or an aj.BlockMask, got "
          f"{type(rule).__name__}.")
    self.rule = rule
    self.q_offset = None if q_offset is None else _integer_array(
        "q_offset", q_offset)
    self.kv_offset = None if kv_offset is None else _integer_array(
        "kv_offset", kv_offset)
    if (isinstance(rule, (Union, BlockMask)) and self.positioned
        and _positioned_rule(rule, self.kv_offset)):
      raise ValueError(_POSITIONED_RULE)
    # (only a mask with both a window and a rule looks at the rule)
    if self.window is not None and rule is not None and depth_positions(
        rule):
      raise ValueError(_TREE_WINDOW)

  @property
  def positioned(self) -> bool:
    """Whether the mask gives positions (``q_offset``/``kv_offset``)."""
    return self.q_offset is not None or self.kv_offset is not None

  def offsets(self, t: int, s: int):
    """``(q_offset, kv_offset)``: the given positions, or the bottom-right
    alignment's ``(S - T, 0)`` (where rules see raw indices)."""
    if not self.positioned:
      return s - t, 0
    return (0 if self.q_offset is None else self.q_offset,
            0 if self.kv_offset is None else self.kv_offset)

  # NumPy arrays defer to Mask's & and | (instead of an object array).
  __array_ufunc__ = None

  # -- pytree ----------------------------------------------------------
  def tree_flatten(self):
    rule_is_data = _is_pytree_rule(self.rule)
    children = tuple(getattr(self, f) for f in _FIELDS) + (
        self.rule if rule_is_data else None,)
    aux = (self.causal, self.window, None if rule_is_data else self.rule)
    return children, aux

  @classmethod
  def tree_unflatten(cls, aux, children):
    mask = object.__new__(cls)
    mask.causal, mask.window, rule = aux
    for name, x in zip(_FIELDS, children[:-1]):
      setattr(mask, name, x)
    mask.rule = children[-1] if rule is None else rule
    return mask

  # -- combination -----------------------------------------------------
  def __and__(self, other) -> Mask:
    other = as_mask(other)
    if other is None:
      return self
    if (self.q_segment_ids is not None
        and other.q_segment_ids is not None):
      raise ValueError(
          "both masks hold segment ids; a Mask holds one pair: combine the "
          "ids into one numbering, or express one side as a rule "
          "(aj.MaskRule(lambda b, h, q, kv, ids: ..., ids)).")
    if self.positioned and other.positioned:
      raise ValueError(
          "both masks give positions (q_offset/kv_offset): a mask holds one "
          "placement of its rows and columns; give the positions once.")
    kv_offset = _first(self.kv_offset, other.kv_offset)
    if (self.positioned or other.positioned) and (
        _positioned_rule(self.rule, kv_offset)
        or _positioned_rule(other.rule, kv_offset)):
      raise ValueError(_POSITIONED_RULE)
    window = _intersect_windows(self.window, other.window)
    rule = _and_rules(self.rule, other.rule)
    if window is not None and rule is not None and depth_positions(rule):
      raise ValueError(_TREE_WINDOW)
    return _replace(
        self,
        q_offset=_first(self.q_offset, other.q_offset),
        kv_offset=_first(self.kv_offset, other.kv_offset),
        causal=self.causal or other.causal,
        window=window,
        q_lengths=_min_lengths(self.q_lengths, other.q_lengths),
        kv_lengths=_min_lengths(self.kv_lengths, other.kv_lengths),
        q_segment_ids=_first(self.q_segment_ids, other.q_segment_ids),
        kv_segment_ids=_first(self.kv_segment_ids, other.kv_segment_ids),
        dense=_and_dense(self.dense, other.dense),
        rule=rule)

  __rand__ = __and__

  def __or__(self, other) -> Mask:
    other = as_mask(other)
    if other is None:
      raise ValueError("mask | None: None allows every pair, so the union "
                       "would be no mask; pass mask=None instead.")
    if self.positioned or other.positioned:
      raise ValueError(_POSITIONED_RULE)
    return Mask(rule=Union(self, other))

  __ror__ = __or__

  def __repr__(self):
    parts = []
    if self.causal:
      parts.append("causal=True")
    if self.window is not None:
      parts.append(f"window={self.window}")
    for name in _FIELDS:
      x = getattr(self, name)
      if x is not None:
        parts.append(f"{name}=<{list(np.shape(x))}>")
    if self.rule is not None:
      parts.append(f"rule={self.rule!r}")
    return f"Mask({', '.join(parts)})"

  def jax_nn_arguments(self, t: int, s: int,
                       batch: int | None = None) -> dict[str, Any]:
    """This mask as ``jax.nn.dot_product_attention``'s keywords, for
    ``[B, N, T, S]`` logits (``mask`` then in jax.nn's ``[B, N, T, S]``).

    jax.nn aligns causality and windows top-left (offset 0); its own
    ``is_causal``/``local_window_size`` are passed where they are exact,
    i.e. where query row ``i`` stands at key position ``i`` (``T == S``
    without positions, or positions whose ``q_offset - kv_offset`` is
    concretely 0), and otherwise the
    band becomes an explicit ``mask`` (``intervals.jax_nn_band``).
    Lengths become one per example (``[B]``; a scalar needs ``batch``).
    Segment ids and rules have no jax.nn counterpart: a ``ValueError`` says
    so. (A row that may see no key is the mean of the values in jax.nn, 0
    here.)

    Example:
      >>> Mask(causal=True, window=(3, 0)).jax_nn_arguments(5, 5)
      {'is_causal': True, 'local_window_size': (3, 0)}
    """
    for name, x in (("segment ids", self.q_segment_ids),
                    ("a rule", self.rule)):
      if x is not None:
        raise ValueError(
            f"jax.nn.dot_product_attention has no counterpart for {name}; "
            "use an attention function of this library for this layer "
            "(e.g. aj.scaled_dot_product_attention or "
            "aj.blockwise_attention).")
    out: dict[str, Any] = {}
    dense = None if self.dense is None else jnp.asarray(self.dense) != 0
    q_off, kv_off = self.offsets(t, s)
    if np.ndim(q_off) or np.ndim(kv_off):  # per example: [B, 1] (or [B, N])
      q_off, kv_off = (_left_aligned(x, 2) for x in (q_off, kv_off))
    band = intervals.jax_nn_band(t, s, q_off - kv_off,
                                 intervals.bounds(self.causal, self.window))
    if band.is_causal:
      out["is_causal"] = True
    if band.local_window_size is not None:
      out["local_window_size"] = band.local_window_size
    if band.mask is not None:  # [T, S] or [B, N|1, T, S]
      dense = band.mask if dense is None else dense & band.mask
    if dense is not None:
      out["mask"] = dense
    for name, x in (("query_seq_lengths", self.q_lengths),
                    ("key_value_seq_lengths", self.kv_lengths)):
      if x is not None:
        if np.ndim(x) > 1 and np.shape(x)[1:] != (1,) * (np.ndim(x) - 1):
          raise ValueError(
              f"jax.nn takes one length per example ([B]); this mask's "
              f"{name} has shape {np.shape(x)}.")
        x = jnp.reshape(jnp.asarray(x, jnp.int32), (-1,))
        if np.ndim(x) == 1 and x.shape[0] == 1 and batch != 1:
          if batch is None:
            raise ValueError(
                f"jax.nn takes one length per example ([B]); this mask's "
                f"{name} is one for all: pass batch=B to broadcast it.")
          x = jnp.broadcast_to(x, (batch,))
        out[name] = x
    return out

  def evaluate(self, b, h, q_idx, kv_idx, t: int, s: int) -> jax.Array:
    """The element predicate: may query ``q_idx`` see key ``kv_idx``?

    ``b``/``h`` are int32 scalars (batch, then query head; broadcast index
    arrays when the mask holds no arrays, as a rule gets them); ``t``/``s``
    are the lengths (for the bottom-right alignment). Used for unions;
    kernels evaluate intersections field by field.
    """
    q_idx, kv_idx = jnp.asarray(q_idx), jnp.asarray(kv_idx)
    ok = jnp.ones(jnp.broadcast_shapes(jnp.shape(q_idx), jnp.shape(kv_idx)),
                  bool)
    bounds = intervals.bounds(self.causal, self.window)
    band = intervals.visible(q_idx, kv_idx, s - t, bounds)
    if band is not None:
      ok = ok & band
    if self.q_lengths is not None:
      ok = ok & (q_idx < _per_index(self.q_lengths, b, h, 0))
    if self.kv_lengths is not None:
      ok = ok & (kv_idx < _per_index(self.kv_lengths, b, h, 0))
    if self.q_segment_ids is not None:
      q_ids = _per_index(self.q_segment_ids, b, h, 1)
      k_ids = _per_index(self.kv_segment_ids, b, h, 1)
      ok = ok & (jnp.take(q_ids, q_idx, mode="clip", axis=-1)
                 == jnp.take(k_ids, kv_idx, mode="clip", axis=-1))
    if self.dense is not None:  # [T|1, S|1] for this (b, h)
      dense = _per_index(jnp.asarray(self.dense), b, h, 2) != 0
      rows = jnp.minimum(q_idx, dense.shape[0] - 1)
      cols = jnp.minimum(kv_idx, dense.shape[1] - 1)
      ok = ok & dense[rows, cols]
    if self.rule is not None:
      rule = self.rule
      if isinstance(rule, Union):
        rule = rule.bound(t, s)
      ok = ok & _rule_fn(rule)(b, h, q_idx, kv_idx)
    return ok


def _is_pytree_rule(rule) -> bool:
  return isinstance(rule, (MaskRule, BlockMask, Union, Both))


def _rule_fn(rule):
  """The predicate of a rule value (a BlockMask's is its ``mask_fn``)."""
  return getattr(rule, "mask_fn", rule)


def rule_function(rule):
  """The callable of a rule value (None for none or a union)."""
  if rule is None or isinstance(rule, Union):
    return None
  return _rule_fn(rule)


def _has_arrays(m: Mask) -> bool:
  return any(getattr(m, f) is not None for f in _FIELDS)


def _per_index(x, b, h, core: int):
  """``x``'s entry for example ``b``, head ``h`` (its last ``core`` axes
  kept); ``x`` is left-aligned to the leading dims, size 1 broadcasts."""
  x = jnp.asarray(x)
  lead = x.ndim - core
  if lead > 2:
    raise ValueError(
        f"a mask union indexes its arrays by (b, h); an array with {lead} "
        f"leading axes (shape {x.shape}) has more: express the mask as one "
        "rule (aj.MaskRule) instead of a union.")
  # With one leading axis it is the batch (as for b); with two, (b, h).
  for index in (b, h)[:lead]:
    x = x[0] if x.shape[0] == 1 else x[jnp.reshape(jnp.asarray(index), ())]
  return x


def _replace(mask: Mask, **fields) -> Mask:
  new = object.__new__(Mask)
  new.__dict__.update(mask.__dict__)
  new.__dict__.update(fields)
  return new


def _first(a, b):
  return a if a is not None else b


def _intersect_windows(a, b):
  if a is None or b is None:
    return a if b is None else b
  return (min(a[0], b[0]), min(a[1], b[1]))


def _left_aligned(x, rank: int):
  x = jnp.asarray(x)
  return jnp.reshape(x, x.shape + (1,) * (rank - x.ndim))


def _min_lengths(a, b):
  if a is None or b is None:
    return a if b is None else b
  rank = max(np.ndim(a), np.ndim(b))
  return jnp.minimum(_left_aligned(a, rank), _left_aligned(b, rank))


def _and_dense(a, b):
  if a is None or b is None:
    return a if b is None else b
  return (jnp.asarray(a) != 0) & (jnp.asarray(b) != 0)


def _and_rules(a, b):
  if a is None or b is None:
    return a if b is None else b
  return Both(a, b)


@jax.tree_util.register_pytree_node_class
class Both:
  """``a & b`` of two rules: one vectorised rule (tables built afresh)."""

  def __init__(self, a, b):
    self.a, self.b = a, b
    sizes = {getattr(r, "examples", None) for r in (a, b)} - {None}
    self.examples = sizes.pop() if len(sizes) == 1 else None
    if len(sizes) > 1:
      raise ValueError(f"the two rules are written for different batch sizes "
                       f"({sorted(sizes)} examples).")

  def __call__(self, b, h, q_idx, kv_idx):
    return (_rule_fn(self.a)(b, h, q_idx, kv_idx)
            & _rule_fn(self.b)(b, h, q_idx, kv_idx))

  def tree_flatten(self):
    rules = (self.a, self.b)
    children = tuple(r if _is_pytree_rule(r) else None for r in rules)
    aux = tuple(None if _is_pytree_rule(r) else r for r in rules)
    return children, aux

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(*(c if f is None else f for c, f in zip(children, aux)))


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Union:
  """``a | b`` of two masks, evaluated elementwise; ``bound(t, s)`` is its
  rule at given lengths (the alignment of causality and windows)."""
  a: Mask
  b: Mask

  def tree_flatten(self):
    return (self.a, self.b), None

  @classmethod
  def tree_unflatten(cls, aux, children):
    del aux
    return cls(*children)

  def members(self):
    """Every mask inside this union, nested unions opened (a mask holding a
    union comes first, then the union's members)."""
    for m in (self.a, self.b):
      yield m
      if isinstance(m.rule, Union):
        yield from m.rule.members()

  def bound(self, t: int, s: int) -> MaskRule:
    return MaskRule(Bound(t, s), (self.a, self.b))

  def __call__(self, *args):
    raise TypeError("a mask union needs the lengths to be evaluated; the "
                    "kernels bind them (Union.bound(T, S)).")


@dataclasses.dataclass(frozen=True)
class Bound:
  """A union's predicate at lengths ``(t, s)``; hashable by value."""
  t: int
  s: int

  def __call__(self, b, h, q_idx, kv_idx, masks):
    a, c = (_member(m, b, h, q_idx, kv_idx, self.t, self.s) for m in masks)
    return a | c


def _member(m: Mask, b, h, q_idx, kv_idx, t: int, s: int):
  """One member of a union at index arrays that broadcast.

  A member without arrays is its band (and rule, called vectorised, as
  rules are written), so it depends on ``b``/``h`` only as its rule does and
  its block tables stay shared; one with arrays is evaluated per ``(b,
  h)`` (its arrays are indexed by scalars).
  """
  b, h = jnp.asarray(b), jnp.asarray(h)
  if (b.ndim == 0 and h.ndim == 0) or not _has_arrays(m):
    return m.evaluate(b, h, q_idx, kv_idx, t, s)
  # Index arrays [..., 1, 1] over the batch axes (building block tables).
  shape = jnp.broadcast_shapes(b.shape, h.shape)
  q = jnp.reshape(jnp.asarray(q_idx), jnp.shape(q_idx)[-2:])  # [bq, 1]
  kv = jnp.reshape(jnp.asarray(kv_idx), jnp.shape(kv_idx)[-2:])  # [1, S]
  rows, cols = q.shape[0], kv.shape[1]
  out = jax.vmap(lambda b, h: jnp.broadcast_to(
      m.evaluate(b, h, q, kv, t, s), (rows, cols)))(
          jnp.broadcast_to(b, shape).reshape(-1),
          jnp.broadcast_to(h, shape).reshape(-1))
  return out.reshape(shape[:-2] + (rows, cols))


def as_mask(mask: Any, *, is_causal: bool = False) -> Mask | None:
  """Any accepted ``mask=`` value as a ``Mask`` (None when it allows all).

  An array is ``Mask(dense=...)``, a ``BlockMask``/``MaskRule`` a rule;
  ``is_causal`` (the shorthand of jax.nn and torch) intersects causality.
  """
  if mask is None:
    out = None
  elif isinstance(mask, Mask):
    out = mask
  elif isinstance(mask, (BlockMask, MaskRule)):
    out = Mask(rule=mask)
  elif callable(mask) and not hasattr(mask, "shape"):
    raise TypeError(
        "mask is a function: pass a rule as aj.Mask(rule=mask_fn) (or "
        "aj.block_mask(mask_fn, T, S) to classify its blocks once).")
  else:
    out = Mask(dense=mask)
  if is_causal:
    out = Mask(causal=True) if out is None else out & Mask(causal=True)
  return out
