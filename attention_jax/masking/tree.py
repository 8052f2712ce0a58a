"""Tree masks: a draft's tree of candidate tokens verified in one call.

Shape glossary: B batch (rows, each with its own tree), T tree nodes (the
call's queries), S keys (the cached prefix, then the nodes' keys), N query
heads, H head dim; ``P`` a row's prefix length (the tokens cached before
its tree, ``prefix_lengths``).

Speculative decoding with a tree (SpecInfer, Medusa, EAGLE): a draft
proposes several continuations at once as a tree of ``T`` candidate tokens,
and the target model scores every node in one call. The tree is
``parents`` (integer ``[T]``, or ``[B, T]`` one tree per row):
``parents[i]`` is node ``i``'s parent node, ``-1`` for a root (whose parent
is the last prefix token). Nodes are in topological order, ``parents[i] in
[-1, i)``: each parent before its children (siblings in any order).

- Node ``i`` stands at position ``P + depth(i)`` (a root at depth 0): the
  position of its token on its own root-to-node path, which is what its
  rotary embedding must see (``tree_positions``: the layer's
  ``positions=``).
- Its key takes slot ``P + i`` (node order, as a cache appends the nodes):
  drafted siblings take slots but not positions.
- It attends to every prefix key (slots ``< P``) and to the keys of its
  ancestors and itself (slots ``P + j``, ``j`` an ancestor of ``i`` or
  ``i``), nothing else: exactly what it would see were its path decoded
  alone, one token at a time. Keys at slots ``>= P + T`` are never seen.

``tree_rule`` says this as an ``aj.MaskRule`` over positions: it reads
``q_idx``/``kv_idx`` as slots (query ``i`` at ``P + i``), which is where
a positioned call places them. ``tree_mask`` is the plain call's mask (the
``T`` nodes' queries over ``S >= P + T`` keys: the prefix, then the nodes'
keys): ``Mask(causal=True, rule=tree_rule(...), q_offset=P, kv_offset=0)``;
a decoding step (``aj.paged_attention``, or a layer with a paged cache)
places its queries at ``lengths - new + i``, which with the lengths before
the tree is ``P + i`` too, so it takes the rule itself:
``aj.Mask(rule=aj.tree_rule(parents, lengths_before))``. The rule is
evaluated at the positions in each block a kernel visits (no ``[T, S]``
table: the flash walk builds none for a positioned rule).

A sliding window must count positions, not slots (siblings between an
ancestor and a node would otherwise eat the window): ``tree_rule(...,
window=w)`` measures it by the nodes' positions ``P + depth``; the
``Mask``'s own ``window`` (slots) is refused beside a tree rule. A tree is
exact for rotary positions; a score modifier that reads ``q_idx``/``kv_idx``
sees the nodes' slots, not their depths, so one that does (ALiBi, T5's
bias, a query temperature) is refused beside a tree rule
(``check_score_mod``, where a call is canonicalized: its jaxpr's output
must not depend on them), while one that reads only the score and ``b``,
``h`` (a soft cap, Gemma 2's) is exact.

Memory: the ancestor table is bool ``[B, T, T]`` (``T`` is a draft's size:
tens of nodes), never ``[T, S]``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.core import checks
from attention_jax.core import elementwise
from attention_jax.core import traced_checks
from attention_jax.masking import mask as mask_lib
from attention_jax.masking.mask import Mask
from attention_jax.masking.mask import MaskRule

_ORDER = ("order nodes so each parent comes before its children (-1 for a "
          "root, whose parent is the last prefix token)")


def _known(x) -> np.ndarray | None:
  """``x``'s value if known while tracing (a concrete array closed over by
  ``jax.jit`` included), else None."""
  try:
    return np.asarray(x)
  except jax.errors.TracerArrayConversionError:
    return None


def _check_parents(parents) -> jax.Array:
  """``parents`` as int32 ``[T]`` or ``[B, T]``, checked: refused now when
  its values are known, else a condition ``aj.checked`` enforces."""
  if isinstance(parents, (list, tuple)):
    parents = np.asarray(parents)
  checks.integer_array("parents", parents, " [T] or [B, T]")
  shape = tuple(np.shape(parents))
  if len(shape) not in (1, 2):
    raise ValueError(
        f"parents must be [T] (one tree) or [B, T] (a tree per row), got "
        f"shape {shape}.")
  if shape[-1] == 0:
    raise ValueError(f"parents has shape {shape}: a tree needs a node.")
  t = shape[-1]
  values = _known(parents)
  if values is not None:
    bad = (values < -1) | (values >= np.arange(t))
    if bad.any():
      at = tuple(int(x) for x in np.argwhere(bad)[0])
      raise ValueError(
          f"parents[{', '.join(map(str, at))}] = {values[at]} is not in "
          f"[-1, {at[-1]}): node {at[-1]}'s parent must be an earlier node "
          f"or -1; {_ORDER}.")
    return jnp.asarray(values, jnp.int32)
  parents = jnp.asarray(parents, jnp.int32)
  node = jnp.broadcast_to(jnp.arange(t), parents.shape)
  bad = (parents < -1) | (parents >= node)
  first = jnp.argmax(bad.reshape(-1))
  traced_checks.traced_check(
      ~jnp.any(bad), "parents must satisfy -1 <= parents[i] < i; node "
      "{node} has parent {parent}: " + _ORDER + ".",
      node=first % t, parent=parents.reshape(-1)[first])
  return parents


def _ancestors(parents: jax.Array) -> jax.Array:
  """Bool ``[..., T, T]`` from checked ``parents [..., T]`` by pointer
  doubling: after step k a row holds the node and its ancestors fewer than
  2^k generations up, and its pointer the 2^k-th ancestor (T: none)."""
  t = parents.shape[-1]
  lead = parents.shape[:-1]
  # Row T is "no node": an empty row that points at itself, where a root's
  # pointer (and, traced and unchecked, a bad parent's) goes.
  pointer = jnp.where((parents >= 0) & (parents < t), parents, t)
  pointer = jnp.concatenate(
      [pointer, jnp.full(lead + (1,), t, pointer.dtype)], -1)  # [..., T + 1]
  reach = jnp.broadcast_to(jnp.eye(t + 1, t, dtype=bool), lead + (t + 1, t))
  for _ in range((t - 1).bit_length()):  # depth < T: 2^k > T - 1 suffices
    reach = reach | jnp.take_along_axis(reach, pointer[..., None], axis=-2)
    pointer = jnp.take_along_axis(pointer, pointer, axis=-1)
  return reach[..., :t, :]


def tree_ancestors(parents) -> jax.Array:
  """Which nodes of a tree are a node's ancestors (itself included).

  Args:
    parents: integer ``[T]`` or ``[B, T]``: ``parents[i]`` in ``[-1, i)``,
      node ``i``'s parent (``-1``: a root). Checked now when concrete (a
      ``ValueError`` naming the first bad node), under ``aj.checked`` when
      traced.

  Returns:
    bool ``[T, T]`` (``[B, T, T]``): ``[i, j]`` true iff ``j`` is ``i`` or
    an ancestor of ``i`` (computed by pointer doubling: ``ceil(log2 T)``
    steps).

  Example:
    >>> aj.tree_ancestors([-1, 0, 0, 1]).astype(int).tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
  """
  return _ancestors(_check_parents(parents))


def tree_depths(parents) -> jax.Array:
  """Each node's depth: int32 ``[T]`` (``[B, T]``), roots 0.

  Example:
    >>> aj.tree_depths([-1, 0, 0, 1, -1]).tolist()
    [0, 1, 1, 2, 0]
  """
  return _depths(tree_ancestors(parents))


def _depths(ancestors: jax.Array) -> jax.Array:
  return jnp.sum(ancestors, -1, dtype=jnp.int32) - 1  # itself not counted


def _check_prefix(prefix_lengths, parents_shape) -> jax.Array:
  """``prefix_lengths`` as int32, scalar or ``[B]`` matching ``parents``'
  batch; non-negative (now when known, else under ``aj.checked``)."""
  checks.integer_array("prefix_lengths", prefix_lengths, " (scalar or [B])")
  shape = tuple(np.shape(prefix_lengths))
  batch = parents_shape[:-1]
  if len(shape) > 1 or (shape and batch and shape != batch):
    want = f"[B] = {list(batch)}" if batch else "[B]"
    raise ValueError(
        f"prefix_lengths must be an integer scalar or {want} (one per row "
        f"of parents {list(parents_shape)}), got shape {shape}.")
  values = _known(prefix_lengths)
  if values is not None:
    if values.size and values.min() < 0:
      raise ValueError(f"prefix_lengths must be >= 0 (tokens cached before "
                       f"the tree), got {values.tolist()}.")
    return jnp.asarray(values, jnp.int32)
  prefix = jnp.asarray(prefix_lengths, jnp.int32)
  traced_checks.traced_check(
      jnp.all(prefix >= 0), "prefix_lengths must be >= 0 (tokens cached "
      "before the tree), got a minimum of {low}.", low=jnp.min(prefix))
  return prefix


def _tree(parents, prefix_lengths):
  """Checked ``(parents, prefix)``, both batched (``[B', T]``, ``[B']``)
  when either is (``B' = 1`` otherwise), and whether they are."""
  parents = _check_parents(parents)
  prefix = _check_prefix(prefix_lengths, parents.shape)
  batched = parents.ndim == 2 or prefix.ndim == 1
  rows = parents.shape[0] if parents.ndim == 2 else (
      prefix.shape[0] if prefix.ndim == 1 else 1)
  parents = jnp.broadcast_to(parents, (rows, parents.shape[-1]))
  prefix = jnp.broadcast_to(prefix, (rows,))
  return parents, prefix, batched


def tree_positions(parents, prefix_lengths) -> jax.Array:
  """The nodes' positions, ``prefix + depth``: their rotary positions.

  Args:
    parents: integer ``[T]`` or ``[B, T]`` (as ``tree_ancestors``).
    prefix_lengths: integer scalar or ``[B]``: tokens cached before each
      row's tree (a paged cache's ``lengths`` before the tree's write).

  Returns:
    int32 ``[B, T]``, or ``[T]`` for one tree (``[T]``) and a scalar
    prefix: what a layer's ``positions=`` takes.

  Example:
    >>> aj.tree_positions([-1, 0, 0, 1], 5).tolist()
    [5, 6, 6, 7]
  """
  parents, prefix, batched = _tree(parents, prefix_lengths)
  positions = prefix[:, None] + _depths(_ancestors(parents))
  return positions if batched else positions[0]


def _check_window(window) -> int | None:
  if window is None:
    return None
  if isinstance(window, (bool, np.bool_)) or not isinstance(
      window, (int, np.integer)):
    raise TypeError(
        f"window must be a non-negative int w (a node sees itself and the w "
        f"positions before it, as Mask(causal=True, window=(w, 0))), got "
        f"{window!r}.")
  if window < 0:
    raise ValueError(f"window must be >= 0 (positions before a node it "
                     f"sees), got {window}.")
  return int(window)


@dataclasses.dataclass(frozen=True)
class _TreeRule:
  """``tree_rule``'s predicate over positions (static settings: a value,
  hashable, so a Mask holding it is one static structure)."""
  window: int | None
  per_example: bool
  # Positions by depth, not slot: a Mask's window (slots) beside it is
  # refused (mask.Mask).
  depth_positions: ClassVar[bool] = True

  def __call__(self, b, h, q_idx, kv_idx, params):
    del h
    ancestors, prefix, depths = params  # [B', T, T], [B'], [B', T]
    t = ancestors.shape[-1]
    b = jnp.asarray(b)
    row = b if self.per_example else jnp.zeros_like(b)
    p = prefix[row]
    i, j = q_idx - p, kv_idx - p  # node indices (j < 0: a prefix key)
    # Clipped so every index is in range: rows that are no node (past the
    # call's T) read the last node's, and are no one's answer.
    ic, jc = jnp.clip(i, 0, t - 1), jnp.clip(j, 0, t - 1)
    ok = (j < 0) | ((j < t) & ancestors[row, ic, jc])
    if self.window is not None:  # in positions: prefix + depth for nodes
      q_pos = p + depths[row, ic]
      kv_pos = jnp.where(j < 0, kv_idx, p + depths[row, jc])
      ok = ok & (q_pos - kv_pos <= self.window)
    return ok


def tree_rule(parents, prefix_lengths, *, window: int | None = None
              ) -> MaskRule:
  """A tree's visibility as a mask rule over positions (see the module doc).

  Query ``q_idx`` is node ``i = q_idx - prefix``, key ``kv_idx`` the prefix
  (``kv_idx < prefix``) or node ``j = kv_idx - prefix``: visible iff a
  prefix key, or ``j`` is ``i`` or an ancestor of ``i`` (keys at ``prefix
  + T`` and beyond never are).

  Args:
    parents: integer ``[T]`` or ``[B, T]``: ``parents[i]`` in ``[-1, i)``
      (``-1``: a root). Checked now when concrete, under ``aj.checked``
      when traced.
    prefix_lengths: integer scalar or ``[B]``: tokens before each row's
      tree (for a paged step, the cache's lengths before it appends the
      nodes).
    window: None, or an int ``w``: a node sees itself and the ``w``
      positions before it, measured in positions (``prefix + depth`` for a
      node, its slot for a prefix key), as ``Mask(causal=True, window=(w,
      0))`` on its path alone. (The Mask's own window counts slots and is
      refused beside this rule.)

  Returns:
    An ``aj.MaskRule`` for ``aj.Mask(rule=...)`` at positions: a paged
    step's (``aj.paged_attention``, a layer's ``decode=True``), or
    ``tree_mask``'s for a plain call.

  Example:
    >>> rule = aj.tree_rule(jnp.array([-1, 0, 0]), 2)
    >>> rule(0, 0, jnp.arange(2, 5)[:, None],
    ...      jnp.arange(5)[None, :]).astype(int).tolist()
    [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 0, 1]]
  """
  window = _check_window(window)
  parents, prefix, batched = _tree(parents, prefix_lengths)
  ancestors = _ancestors(parents)
  return MaskRule(_TreeRule(window, batched),
                  (ancestors, prefix, _depths(ancestors)),
                  examples=parents.shape[0] if batched else None)


def tree_mask(parents, prefix_lengths, *, window: int | None = None
              ) -> Mask:
  """The mask of a plain call verifying a tree: the ``T`` nodes' queries
  over ``S >= prefix + T`` keys (each row's prefix, then its nodes' keys
  in node order; later slots are not seen).

  ``Mask(causal=True, rule=tree_rule(parents, prefix_lengths,
  window=window), q_offset=prefix_lengths, kv_offset=0)``: query ``i``
  stands at slot ``prefix + i``, where the rule reads it. Arguments as
  ``tree_rule``. Rotary positions are the caller's: ``tree_positions``.

  Example:
    >>> q = jnp.ones((1, 2, 3, 8))  # [B, N, T, H]: 3 nodes
    >>> kv = jnp.ones((1, 2, 7, 8))  # [B, K, S, H]: 4 prefix keys, 3 nodes
    >>> m = aj.tree_mask(jnp.array([-1, 0, 0]), 4)
    >>> aj.scaled_dot_product_attention(q, kv, kv, m).shape
    (1, 2, 3, 8)
  """
  rule = tree_rule(parents, prefix_lengths, window=window)
  return Mask(causal=True, rule=rule, q_offset=prefix_lengths, kv_offset=0)


def holds_tree(rule) -> bool:
  """Whether a Mask's ``rule`` is a tree rule, or holds one: in an ``&`` of
  rules (``mask.depth_positions``) or a union's member."""
  if isinstance(rule, mask_lib.Union):
    return any(holds_tree(m.rule) for m in rule.members())
  return rule is not None and mask_lib.depth_positions(rule)


_SLOTS = (
    "a tree is exact for rotary positions; a score modifier that reads "
    "q_idx/kv_idx sees the nodes' slots (prefix + node index), not their "
    "depths (prefix + depth), so its answer is not the path's decoded alone")


def check_score_mod(score_mod) -> None:
  """Refuses beside a tree rule a score modifier whose output depends on
  ``q_idx`` or ``kv_idx`` (ALiBi, T5's bias, a query temperature): traced
  abstractly on a ``[1, 1]`` block (nothing is computed), its jaxpr's
  output followed back to its inputs. One that reads only the score,
  ``b`` and ``h`` (a soft cap) is exact and passes. Called by
  ``kernels.base.canonicalize`` only for a mask that ``holds_tree``."""
  i32 = jnp.int32
  closed = jax.make_jaxpr(score_mod)(
      jax.ShapeDtypeStruct((1, 1), jnp.float32), jax.ShapeDtypeStruct((), i32),
      jax.ShapeDtypeStruct((), i32), jax.ShapeDtypeStruct((1, 1), i32),
      jax.ShapeDtypeStruct((1, 1), i32))
  if elementwise.reads(closed, (3, 4)):  # (score, b, h, q_idx, kv_idx)
    raise ValueError(
        f"score_mod reads q_idx/kv_idx, and the mask holds a tree "
        f"(aj.tree_rule / aj.tree_mask): {_SLOTS}. Drop the modifier, or "
        "keep one that reads only the score (aj.soft_cap) and b, h; a "
        "model whose positions enter through its scores (ALiBi, T5) "
        "verifies each drafted path as its own sequence.")
