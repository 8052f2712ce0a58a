"""Speculative decoding's pieces: drafted trees, greedy acceptance, and the
paged cache after verification against plain greedy decoding's."""

from absl.testing import absltest
import chex
from flax import nnx
import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.decoding import paged_cache as pc
from experiments import lm_model
from experiments import speculative

V = 5  # a small vocabulary: drafted tokens often agree with the target


def _random_tree(data, max_nodes=9) -> speculative.Tree:
  """A trie under a root: each node's parent drawn among earlier nodes."""
  n = data.draw(st.integers(1, max_nodes))
  branches = [np.asarray(data.draw(st.lists(st.integers(0, V - 1),
                                            min_size=1, max_size=4)))
              for _ in range(n)]
  return speculative.trie(data.draw(st.integers(0, V - 1)), branches)


def _brute_force_accept(tree, target_next):
  """The longest root path whose every drafted token is the target's next
  token after its parent (every path enumerated)."""
  best = [0]
  for leaf in range(tree.size):
    path = [leaf]
    while tree.parents[path[-1]] >= 0:
      path.append(int(tree.parents[path[-1]]))
    path = path[::-1]
    if all(tree.tokens[c] == target_next[p] for p, c in zip(path, path[1:])):
      best = max(best, path, key=len)
  return best


class TreeTest(absltest.TestCase):

  def test_trie_merges_shared_prefixes_in_topological_order(self):
    tree = speculative.trie(7, [np.array([1, 2, 3]), np.array([1, 2, 4]),
                                np.array([5])])
    np.testing.assert_array_equal(tree.tokens, [7, 1, 2, 3, 4, 5])
    np.testing.assert_array_equal(tree.parents, [-1, 0, 1, 2, 2, 0])

  def test_ngram_draft_proposes_what_followed_the_suffix(self):
    draft = speculative.NgramDraft(width=2, depth=3, max_n=2)
    history = np.array([1, 5, 6, 7, 8, 5, 6, 9, 3, 5, 6])
    # "5 6" occurred twice before: most recent first, then the older one.
    got = draft.branches(history)
    self.assertEqual([b.tolist() for b in got], [[9, 3, 5], [7, 8, 5]])
    # No earlier occurrence of any suffix: nothing drafted, the root alone.
    tree = draft.trees([np.array([1, 2, 3])])[0]
    self.assertEqual(tree.size, 1)


class ModelDraftTest(absltest.TestCase):

  def test_branches_are_the_models_top_k_extended_greedily(self):
    model = lm_model.DecoderLM(
        lm_model.LMModelConfig(d_model=16, num_heads=2, num_layers=1,
                               ffn_dim=32), vocab_size=11,
        rngs=nnx.Rngs(0))
    draft = speculative.ModelDraft(model, width=2, depth=3, window=6)
    histories = [np.array([1, 4, 5, 6, 7, 8, 9, 3], np.int32),
                 np.array([1, 2], np.int32)]
    trees = draft.trees(histories)
    for history, tree in zip(histories, trees):
      # Each branch by hand: the window's last logits, top-2 at the root,
      # then the argmax, the window sliding.
      for rank in range(2):
        window, chain = list(history[-6:]), []
        for d in range(3):
          logits = np.asarray(model(jnp.asarray([window])))[0, -1]
          token = (int(np.argsort(-logits, kind="stable")[rank]) if d == 0
                   else int(np.argmax(logits)))
          chain.append(token)
          window = (window + [token])[-6:]
        self.assertIn(chain, [_path_tokens(tree, i)[1:]
                              for i in range(tree.size)])
      self.assertEqual(tree.tokens[0], history[-1])


class AcceptTest(chex.TestCase):

  @hypothesis.settings(max_examples=40, deadline=None)
  @hypothesis.given(st.data())
  def test_greedy_accept_is_the_longest_agreeing_path(self, data):
    trees = [_random_tree(data) for _ in range(3)]
    trees[1] = None if data.draw(st.booleans()) else trees[1]  # idle row
    size = 1 + 9 * 4
    tokens, parents, lengths = speculative.pad_trees(trees, size)
    target = np.asarray(data.draw(st.lists(
        st.integers(0, V - 1), min_size=3 * size, max_size=3 * size)),
                        np.int32).reshape(3, size)
    path, count = jax.jit(aj.greedy_accept, static_argnums=4)(
        tokens, parents, lengths, target, 4)
    for r, tree in enumerate(trees):
      if tree is None:
        self.assertEqual(int(count[r]), 0)
        continue
      want = _brute_force_accept(tree, target[r])
      self.assertEqual(path[r, :count[r]].tolist(), want)
      host_path, emitted = speculative.accept(tree, target[r])
      self.assertEqual(host_path.tolist(), want)
      # The step emits the path's drafted tokens, then the target's own.
      self.assertEqual(emitted.tolist(), [int(tree.tokens[i]) for i in
                                          want[1:]] + [int(target[r,
                                                                  want[-1]])])

  def test_refuses_mismatched_shapes(self):
    with self.assertRaisesRegex(ValueError, "greedy_accept needs"):
      aj.greedy_accept(jnp.zeros((2, 3), int), jnp.zeros((2, 4), int),
                       jnp.zeros(2, int), jnp.zeros((2, 3), int), 2)


B, K, Z, P, M = 3, 1, 4, 40, 10


def _kv(token, position):
  """A token's key at a position: what a model would cache for it (the same
  token at the same position after the same path caches the same key)."""
  return np.sin(1.0 + 3.0 * token + 0.37 * position).astype(np.float32)


def _held(cache):
  """Each row's cached keys, read through its page table."""
  table, pages = np.asarray(cache.page_table), np.asarray(cache.key_pages)
  return [[float(pages[table[b, i // Z], 0, i % Z, 0])
           for i in range(int(cache.lengths[b]))] for b in range(B)]


@jax.jit
def _verify(cache, tokens, parents, lengths, target):
  """Append every tree node's key at prefix + depth, accept, keep the path."""
  prefix = cache.lengths
  depth = aj.tree_positions(parents, prefix) - prefix[:, None]
  keys = jnp.sin(1.0 + 3.0 * tokens + 0.37 * (prefix[:, None] + depth))
  keys = keys[:, None, :, None]  # [B, K, T, 1]
  cache = pc.append(cache, keys, keys, new_lengths=lengths)
  path, count = aj.greedy_accept(tokens, parents, lengths, target, 4)
  return aj.move_slots(cache, prefix, prefix[:, None] + path, count), path, count


class VerifiedCacheTest(chex.TestCase):

  @hypothesis.settings(max_examples=12, deadline=None)
  @hypothesis.given(st.data())
  def test_equals_plain_greedy_decodings_cache(self, data):
    """Rounds of drafting and verification over B rows (idle rows, rows
    that finish and are released) leave the cache that appending the
    accepted tokens one by one leaves: the same keys per row, lengths,
    pages held, reference counts, and every other page free."""
    spec = pc.init_paged_cache(P, Z, K, 1, batch_size=B, max_pages=M)
    plain = spec
    # The target's greedy continuation of each row, known in advance.
    greedy = [np.asarray(data.draw(st.lists(st.integers(0, V - 1),
                                            min_size=20, max_size=20)))
              for _ in range(B)]
    fed = [0] * B  # tokens of greedy[b] each row holds
    for _ in range(3):
      trees = []
      for b in range(B):
        if data.draw(st.booleans()) or fed[b] >= 12:
          trees.append(None)
          continue
        tree = _random_tree(data)
        # The root is the row's next real token; a branch may follow the
        # greedy path for a while (accepted) before it strays.
        agree = data.draw(st.integers(0, 4))
        branch = greedy[b][fed[b] + 1:fed[b] + 1 + agree]
        tree = speculative.trie(greedy[b][fed[b]],
                                [branch] + _branches_of(tree))
        trees.append(tree)
      tokens, parents, lengths = speculative.pad_trees(trees, 1 + 10 * 5)
      target = np.zeros_like(tokens)
      for b, tree in enumerate(trees):
        if tree is None:
          continue
        for i in range(tree.size):  # greedy's next token after node i's
          d = _depth(tree, i)       # path, where that path is greedy's
          on_path = _path_tokens(tree, i) == greedy[b][fed[b]:fed[b] + d + 1
                                                      ].tolist()
          target[b, i] = (greedy[b][fed[b] + d + 1] if on_path
                          else data.draw(st.integers(0, V - 1)))
      spec, path, count = _verify(spec, tokens, parents, lengths, target)
      # Plain decoding appends the accepted tokens (in one call: appending
      # them one by one fills the same slots of the same pages).
      x = np.zeros((B, K, 5, 1), np.float32)
      for b in range(B):
        n = int(count[b])
        pos = fed[b] + np.arange(n)
        x[b, :, :n, 0] = _kv(greedy[b][pos], pos)
        fed[b] += n
      plain = _append(plain, x, np.asarray(count))
      done = np.array([fed[b] >= 12 for b in range(B)])
      if done.any() and data.draw(st.booleans()):
        spec, plain = _release(spec, done), _release(plain, done)
        fed = [0 if d else f for d, f in zip(done, fed)]
      self.assertEqual(spec.lengths.tolist(), plain.lengths.tolist())
      for got, want in zip(_held(spec), _held(plain)):
        np.testing.assert_allclose(got, want, atol=1e-6)  # the same keys
      table = np.asarray(spec.page_table)
      np.testing.assert_array_equal(  # counts are the tables' references
          np.asarray(spec.refcount),
          np.bincount(table[table < P], minlength=P))
      np.testing.assert_array_equal((table < P).sum(1),
                                    (np.asarray(plain.page_table) < P).sum(1))
      self.assertEqual(int((spec.refcount > 0).sum()),
                       int((plain.refcount > 0).sum()))  # no leaked page
      self.assertFalse(bool(spec.overflow.any()))

  def test_one_row_keeps_the_same_page_table(self):
    """With one row, the pages a verification releases are the last it
    took, so its table is plain decoding's, page for page."""
    spec = pc.init_paged_cache(8, 2, 1, 1, batch_size=1, max_pages=8)
    plain = spec
    x = jnp.ones((1, 1, 3, 1))
    spec = plain = _append(spec, x, jnp.array([3]))
    tree = speculative.trie(1, [np.array([2, 3, 4]), np.array([2, 0]),
                                np.array([4])])
    tokens, parents, lengths = speculative.pad_trees([tree], tree.size)
    target = np.array([[2, 3, 0, 1, 0, 0]])  # accepts 2 -> 3, then stops
    spec, path, count = jax.jit(
        lambda c: _verify_one(c, tokens, parents, lengths, target))(spec)
    self.assertEqual(path[0, :count[0]].tolist(), [0, 1, 2])
    plain = _append(plain, jnp.ones((1, 1, 3, 1)), jnp.array([3]))
    np.testing.assert_array_equal(spec.page_table, plain.page_table)
    np.testing.assert_array_equal(spec.refcount, plain.refcount)


def _verify_one(cache, tokens, parents, lengths, target):
  prefix = cache.lengths
  keys = jnp.ones(tokens.shape)[:, None, :, None]
  cache = pc.append(cache, keys, keys, new_lengths=lengths)
  path, count = aj.greedy_accept(tokens, parents, lengths, target, 3)
  return aj.move_slots(cache, prefix, prefix[:, None] + path, count), path, count


@jax.jit
def _append(cache, x, lengths):
  return pc.append(cache, x, x, new_lengths=lengths)


_release = jax.jit(pc.release)


def _branches_of(tree):
  """A tree's root-to-leaf token paths (its root excluded)."""
  leaves = set(range(tree.size)) - set(int(p) for p in tree.parents)
  return [np.asarray(_path_tokens(tree, leaf)[1:], np.int32)
          for leaf in sorted(leaves) if leaf]


def _path_tokens(tree, i):
  path = [i]
  while tree.parents[path[-1]] >= 0:
    path.append(int(tree.parents[path[-1]]))
  return [int(tree.tokens[j]) for j in path[::-1]]


def _depth(tree, i):
  return len(_path_tokens(tree, i)) - 1


if __name__ == "__main__":
  absltest.main()
