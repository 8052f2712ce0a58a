"""Speculative decoding: draft a token tree, verify it in one call, keep the
longest path the target agrees with.

Shape glossary: R rows decoding in a step, T nodes of a row's tree (its
root included), D depth of a drafted branch, W the draft model's window,
V vocabulary size.

A step of a row starts from its **root**: the last token it emitted, not
yet in its cache. A draft proposes continuations; they are merged into a
trie under the root (node 0), so a token shared by two branches is one
node. Nodes are numbered in topological order (every parent before its
children): ``parents[i]`` in ``[-1, i)``, ``-1`` for the root. The target
model appends all ``T`` nodes to the row's cache in one call with
``aj.tree_rule`` (node ``i`` sees the cached prefix, its ancestors and
itself) at positions ``prefix + depth`` (``aj.tree_positions``), and
returns its greedy next token after every node.

Greedy acceptance (``aj.greedy_accept`` inside the jitted verification;
``accept`` here is its host-side reference): from the root, follow the
child whose token equals the target's next token after the current node,
as long as there is one. Every token on that path is what plain greedy
decoding would have produced, so the step emits the path's drafted tokens
and the target's next token after the path's last node (the bonus token,
the next step's root). The cache keeps only the path's nodes, moved to the
slots right after the prefix in path order (``aj.move_slots``); the other
nodes' slots are dropped and pages past the new length return to the pool.
The output equals plain greedy decoding token for token (up to float32
near ties, as any change of kernel shapes).

Two drafts:

- ``NgramDraft`` (prompt lookup; no model): the most recent earlier
  occurrences of the row's last ``n`` tokens (``n`` from ``max_n`` down to
  1) in its prompt and output, each proposing the ``depth`` tokens that
  followed it; the first ``width`` distinct continuations become branches.
- ``ModelDraft``: a small ``DecoderLM`` trained on the same text. It reads
  the last ``W`` tokens of the row (no cache: a window recomputed each
  step), branches into its ``width`` most likely next tokens and extends
  each greedily to ``depth`` tokens: one jitted call of ``depth`` forward
  passes (``R`` rows, then ``R * width``).
"""

from __future__ import annotations

import dataclasses
import functools

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from experiments import lm_data


@dataclasses.dataclass(frozen=True)
class Tree:
  """A row's drafted tree: ``tokens [T]`` and ``parents [T]`` (node 0 is the
  root, parent -1; topological order)."""
  tokens: np.ndarray
  parents: np.ndarray

  @property
  def size(self) -> int:
    return len(self.tokens)


def trie(root: int, branches: list[np.ndarray]) -> Tree:
  """The root and ``branches`` (token sequences after it) merged into one
  tree, shared prefixes once, in insertion (topological) order."""
  tokens, parents = [int(root)], [-1]
  children: dict[tuple[int, int], int] = {}
  for branch in branches:
    node = 0
    for token in branch:
      key = (node, int(token))
      if key not in children:
        children[key] = len(tokens)
        tokens.append(int(token))
        parents.append(node)
      node = children[key]
  return Tree(np.asarray(tokens, np.int32), np.asarray(parents, np.int32))


def accept(tree: Tree, target_next: np.ndarray) -> tuple[np.ndarray,
                                                          np.ndarray]:
  """Greedy acceptance (see the module doc).

  Args:
    tree: the verified tree.
    target_next: int ``[T]``: the target's greedy token after each node.

  Returns:
    ``(path, emitted)``: the accepted nodes from the root (``[A]``, ``A >=
    1``), and the tokens the step emits (``[A]``: the path's drafted tokens,
    then the target's token after the path's last node).
  """
  kids: dict[int, list[int]] = {}
  for i, parent in enumerate(tree.parents[1:], 1):
    kids.setdefault(int(parent), []).append(i)
  path = [0]
  while True:
    want = int(target_next[path[-1]])
    nxt = [c for c in kids.get(path[-1], []) if tree.tokens[c] == want]
    if not nxt:
      break
    path.append(nxt[0])  # a trie has at most one child per token
  emitted = [int(tree.tokens[i]) for i in path[1:]]
  emitted.append(int(target_next[path[-1]]))
  return np.asarray(path, np.int32), np.asarray(emitted, np.int32)


def pad_trees(trees: list[Tree | None], size: int):
  """``(tokens [R, size], parents [R, size], lengths [R])``: each row's
  tree right-padded (PAD tokens, parent -1; length 0 for None)."""
  r = len(trees)
  tokens = np.full((r, size), lm_data.PAD, np.int32)
  parents = np.full((r, size), -1, np.int32)
  lengths = np.zeros(r, np.int32)
  for i, tree in enumerate(trees):
    if tree is not None:
      tokens[i, :tree.size] = tree.tokens
      parents[i, :tree.size] = tree.parents
      lengths[i] = tree.size
  return tokens, parents, lengths


@dataclasses.dataclass(frozen=True)
class NgramDraft:
  """Prompt-lookup drafting (see the module doc)."""
  width: int = 2
  depth: int = 4
  max_n: int = 4
  name: str = "ngram"

  @property
  def max_nodes(self) -> int:
    return 1 + self.width * self.depth

  def trees(self, histories: list[np.ndarray]) -> list[Tree]:
    """One tree per row; ``histories[r]`` ends with the row's root."""
    return [trie(h[-1], self.branches(h)) for h in histories]

  def branches(self, history: np.ndarray) -> list[np.ndarray]:
    found: list[np.ndarray] = []
    seen: set[tuple[int, ...]] = set()
    for n in range(min(self.max_n, len(history) - 1), 0, -1):
      suffix = history[-n:]
      # Earlier occurrences ending before the last token, most recent first.
      ends = _occurrences(history[:-1], suffix)
      for end in ends[::-1]:
        cont = history[end:end + self.depth]
        key = tuple(int(t) for t in cont)
        if len(cont) and key not in seen:
          seen.add(key)
          found.append(cont)
          if len(found) == self.width:
            return found
    return found


def _occurrences(history: np.ndarray, suffix: np.ndarray) -> np.ndarray:
  """Positions just after each occurrence of ``suffix`` in ``history``."""
  n = len(suffix)
  if len(history) < n:
    return np.zeros(0, int)
  windows = np.lib.stride_tricks.sliding_window_view(history, n)
  return np.flatnonzero((windows == suffix).all(1)) + n


class ModelDraft:
  """A small model's top-``width`` branching tree (see the module doc)."""

  def __init__(self, model, *, width: int = 2, depth: int = 4,
               window: int = 32):
    self.width, self.depth, self.window = width, depth, window
    self.name = "model"
    graphdef, self._state = nnx.split(model)
    self._chains = functools.partial(_draft_chains, graphdef)

  @property
  def max_nodes(self) -> int:
    return 1 + self.width * self.depth

  def trees(self, histories: list[np.ndarray]) -> list[Tree]:
    """One tree per row; ``histories[r]`` ends with the row's root."""
    r, w = len(histories), self.window
    rows = np.full((r, w), lm_data.PAD, np.int32)
    lengths = np.zeros(r, np.int32)
    for i, h in enumerate(histories):
      tail = h[-w:]
      rows[i, :len(tail)] = tail
      lengths[i] = len(tail)
    chains = np.asarray(self._chains(self._state, jnp.asarray(rows),
                                     jnp.asarray(lengths), self.width,
                                     self.depth))  # [R, width, depth]
    return [trie(h[-1], list(chains[i])) for i, h in enumerate(histories)]


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _draft_chains(graphdef, state, rows, lengths, width: int, depth: int):
  """``[R, width, depth]``: each row's ``width`` most likely next tokens,
  each extended greedily to ``depth`` tokens (the window ``rows [R, W]``
  sliding once full), in one call."""
  model = nnx.merge(graphdef, state)

  def last_logits(rows, lengths):
    logits = model(rows)  # [R', W, V]
    return logits[jnp.arange(rows.shape[0]), jnp.maximum(lengths - 1, 0)]

  top = jax.lax.top_k(last_logits(rows, lengths), width)[1]  # [R, width]
  rows = jnp.repeat(rows, width, 0)  # [R * width, W]
  lengths = jnp.repeat(lengths, width, 0)
  chain = [top.reshape(-1)]
  w = rows.shape[1]
  for _ in range(depth - 1):
    full = lengths == w
    rows = jnp.where(full[:, None], jnp.roll(rows, -1, 1), rows)
    lengths = jnp.where(full, lengths, lengths + 1)
    rows = rows.at[jnp.arange(rows.shape[0]), lengths - 1].set(chain[-1])
    chain.append(jnp.argmax(last_logits(rows, lengths), -1).astype(
        top.dtype))
  return jnp.stack(chain, 1).reshape(top.shape[0], width, depth)
