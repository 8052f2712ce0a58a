"""Greedy acceptance of a verified token tree (speculative decoding).

Shape glossary: R rows, T nodes of a row's drafted tree (its root
included), D the deepest drafted branch.

A draft proposes a tree of tokens under each row's root (its last emitted
token, not yet cached); the target verifies every node in one call with a
tree mask (``aj.tree_rule``: node ``i`` sees the cached prefix and its
ancestors, at position ``prefix + depth``) and gives its greedy next token
after each node. ``greedy_accept`` follows, from the root, the child whose
token is the target's next token after the current node, as long as there
is one: every token on that path is what plain greedy decoding would have
produced. The step emits the path's drafted tokens and the target's token
after the path's last node; the cache keeps the path's nodes, moved to the
slots after the prefix (``aj.move_slots(cache, prefix, prefix + path,
count)``), and drops the rest.

Trees are padded: ``tokens``/``parents [R, T]``, nodes in topological
order (``parents[i]`` in ``[-1, i)``, the root first with ``-1``),
``lengths [R]`` real nodes (0: a row that verifies nothing). Runs inside
``jit`` (a static ``depth``): no host round trip between verification and
the cache update.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.typing import ArrayLike

from attention_jax.core import checks


def greedy_accept(tokens: ArrayLike, parents: ArrayLike, lengths: ArrayLike,
                  target_next: ArrayLike, depth: int):
  """The accepted path of each row's tree (see the module doc).

  Args:
    tokens, parents: int ``[R, T]`` padded trees (module doc); among
      children with the same token the first is followed (a trie has one).
    lengths: int ``[R]``: nodes per row (0: the row verifies nothing).
    target_next: int ``[R, T]``: the target's greedy token after each node.
    depth: the deepest branch (static): the path has at most ``depth + 1``
      nodes.

  Returns:
    ``(path [R, depth + 1], count [R])``: the accepted nodes from the root
    (entries past ``count`` are 0) and how many (0 for an idle row).
  """
  checks.check_positive_int("depth", depth)
  tokens, parents, lengths, target_next = (
      jnp.asarray(x) for x in (tokens, parents, lengths, target_next))
  if tokens.ndim != 2 or parents.shape != tokens.shape or (
      target_next.shape != tokens.shape) or lengths.shape != tokens.shape[:1]:
    raise ValueError(
        f"greedy_accept needs tokens, parents and target_next [R, T] and "
        f"lengths [R], got {tokens.shape}, {parents.shape}, "
        f"{target_next.shape} and {lengths.shape}.")
  r, t = tokens.shape
  node = jnp.arange(t)[None, :]
  real = node < lengths[:, None]
  current = jnp.zeros(r, jnp.int32)
  alive = lengths > 0
  path = [current]
  count = alive.astype(jnp.int32)
  for _ in range(depth):
    want = jnp.take_along_axis(target_next, current[:, None], 1)  # [R, 1]
    match = real & (parents == current[:, None]) & (tokens == want)
    found = alive & match.any(1)
    current = jnp.where(found, jnp.argmax(match, 1), current).astype(
        jnp.int32)
    alive = found
    path.append(jnp.where(found, current, 0))
    count = count + found
  return jnp.stack(path, 1), count
