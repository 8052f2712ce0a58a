"""Tree masks (``masking/tree.py``): speculative decoding's verification.

The contract (``tests/contract.py``: ``tree_prefix_gqa_sinks``) checks
outputs, lse, gradients and forward mode of ``aj.tree_mask`` in every kernel
that takes a positioned rule (refusals by name elsewhere); here: the tree's
structure against a hand-drawn one, the mask against a float64 NumPy
reference (with a window in positions), the meaning of verification (a
node's answer is its root-to-node chain's, property), the flash walk builds
no table, a paged step and a rotary layer decoding a tree in a paged cache
against its paths decoded alone, and the refusals.
"""

from unittest import mock

from absl.testing import absltest
import chex
from flax import nnx
import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.kernels import flash as flash_lib
from tests import _data

B, N, K, H = 2, 4, 2, 8
# Two rows, two trees: row 0 has two roots; row 1 is deeper.
PARENTS = np.array([[-1, 0, 0, 1, 1, 2, -1, 6],
                    [-1, 0, 1, 2, 0, 4, 3, 3]])
PREFIX = np.array([3, 7])
T = PARENTS.shape[1]
# Blocks that straddle the prefix/tree boundary and the rows.
FLASH = aj.kernels.Flash(block_q=3, block_k=5)


def _path(parents, i) -> list[int]:
  """Node i's ancestors and itself, root first (parent by parent)."""
  path = []
  while i >= 0:
    path.append(int(i))
    i = parents[i]
  return path[::-1]


def _visible(parents, prefix, s, window=None) -> np.ndarray:
  """bool ``[T, S]`` from the definition: node i sees the prefix slots and
  the slots prefix + a of its path; with a window, only keys within w
  positions of its own (prefix + depth; a prefix key's is its slot)."""
  t = len(parents)
  seen = np.zeros((t, s), bool)
  for i in range(t):
    path = _path(parents, i)
    where = list(range(prefix)) + [prefix + a for a in path]
    at = list(range(prefix)) + [prefix + d for d in range(len(path))]
    for slot, position in zip(where, at):
      if window is None or prefix + len(path) - 1 - position <= window:
        seen[i, slot] = True
  return seen


def _reference(q, k, v, allowed):
  """float64 softmax attention ``[B, N, T, H]`` and lse over ``allowed [B,
  T, S]`` (every row sees a key); key head n // (N / K) for query head n."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  k, v = (np.repeat(x, N // K, axis=1) for x in (k, v))
  logits = np.einsum("bnth,bnsh->bnts", q, k) / np.sqrt(H)
  logits = np.where(allowed[:, None], logits, -np.inf)
  top = logits.max(-1, keepdims=True)
  weights = np.exp(logits - top)
  total = weights.sum(-1, keepdims=True)
  out = np.einsum("bnts,bnsh->bnth", weights / total, v)
  return out, (top + np.log(total))[..., 0]


def _qkv(t, s, seed=0):
  return (_data.normal(seed, (B, N, t, H)),
          _data.normal(seed + 1, (B, K, s, H)),
          _data.normal(seed + 2, (B, K, s, H)))


class StructureTest(chex.TestCase):

  def test_a_hand_drawn_tree(self):
    #        prefix
    #       /      \
    #      0        6
    #     / \       |
    #    1   2      7
    #   / \  |
    #  3   4 5
    parents = PARENTS[0]
    want = np.zeros((T, T), bool)
    for i, above in enumerate([[0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 4],
                               [0, 2, 5], [6], [6, 7]]):
      want[i, above] = True
    np.testing.assert_array_equal(aj.tree_ancestors(parents), want)
    np.testing.assert_array_equal(aj.tree_depths(parents),
                                  [0, 1, 1, 2, 2, 2, 0, 1])
    np.testing.assert_array_equal(aj.tree_positions(parents, 10),
                                  [10, 11, 11, 12, 12, 12, 10, 11])
    # Traced (pointer doubling on device): the same.
    np.testing.assert_array_equal(jax.jit(aj.tree_ancestors)(parents), want)

  def test_batched_trees(self):
    ancestors = np.asarray(aj.tree_ancestors(PARENTS))
    self.assertEqual(ancestors.shape, (B, T, T))
    for b in range(B):
      for i in range(T):
        np.testing.assert_array_equal(np.flatnonzero(ancestors[b, i]),
                                      sorted(_path(PARENTS[b], i)))
    depths = np.asarray(aj.tree_depths(PARENTS))
    np.testing.assert_array_equal(  # row 1: a chain 0-1-2-3 with branches
        depths, [[0, 1, 1, 2, 2, 2, 0, 1], [0, 1, 2, 3, 1, 2, 4, 4]])
    positions = aj.tree_positions(PARENTS, PREFIX)
    self.assertEqual(positions.dtype, jnp.int32)
    np.testing.assert_array_equal(positions, PREFIX[:, None] + depths)
    # One tree, a prefix per row: [B, T].
    np.testing.assert_array_equal(aj.tree_positions(PARENTS[0], PREFIX),
                                  PREFIX[:, None] + depths[0])


class MaskTest(chex.TestCase):
  """tree_mask through sdpa against the definition, in float64."""

  def test_equals_the_float64_reference(self):
    s = int((PREFIX + T).max()) + 3  # slots past each tree are never seen
    q, k, v = _qkv(T, s)
    allowed = np.stack([_visible(p, n, s) for p, n in zip(PARENTS, PREFIX)])
    want, want_lse = _reference(q, k, v, allowed)
    mask = aj.tree_mask(jnp.asarray(PARENTS), jnp.asarray(PREFIX))
    for kernel in ("dense", FLASH):
      out, lse = aj.scaled_dot_product_attention(
          q, k, v, mask, implementation=kernel, return_lse=True)
      # float32 sums over <= 18 keys
      np.testing.assert_allclose(out, want, atol=2e-6, err_msg=str(kernel))
      np.testing.assert_allclose(lse, want_lse, atol=2e-6)

  def test_a_window_counts_positions(self):
    # Row 1 (prefix 7): node 6 (path 0-1-2-3-6) stands at position 7 + 4,
    # slot 13: a window of 3 keeps nodes 1, 2, 3 and itself (slots 8..10,
    # 13), though node 4's and 5's slots lie between; node 4 (path 0-4, at
    # position 8) keeps prefix slots 5, 6, node 0 and itself.
    w, s = 3, 16
    q, k, v = _qkv(T, s, seed=3)
    allowed = np.stack([_visible(p, n, s, w) for p, n in zip(PARENTS,
                                                              PREFIX)])
    np.testing.assert_array_equal(np.flatnonzero(allowed[1, 6]),
                                  [8, 9, 10, 13])
    np.testing.assert_array_equal(np.flatnonzero(allowed[1, 4]),
                                  [5, 6, 7, 11])
    want, _ = _reference(q, k, v, allowed)
    mask = aj.tree_mask(jnp.asarray(PARENTS), jnp.asarray(PREFIX), window=w)
    for kernel in ("dense", FLASH):
      out = aj.scaled_dot_product_attention(q, k, v, mask,
                                            implementation=kernel)
      np.testing.assert_allclose(out, want, atol=2e-6, err_msg=str(kernel))

  def test_flash_builds_no_table(self):
    # The rule is positioned: evaluated in each visited block, never
    # classified over a [T, S] grid.
    q, k, v = _qkv(T, 16)
    mask = aj.tree_mask(jnp.asarray(PARENTS), jnp.asarray(PREFIX))
    with mock.patch.object(flash_lib.block_mask_lib, "block_mask",
                           side_effect=AssertionError("a table was built")):
      aj.scaled_dot_product_attention(q, k, v, mask, implementation=FLASH)


@st.composite
def _trees(draw):
  t = draw(st.integers(1, 6))
  parents = [[draw(st.integers(-1, i - 1)) for i in range(t)]
             for _ in range(B)]
  prefix = [draw(st.integers(0, 4)) for _ in range(B)]
  return np.array(parents), np.array(prefix)


class VerificationTest(chex.TestCase):
  """A node's answer is its chain's: the prefix keys, then its ancestors'
  keys root first, as if its path had been decoded alone."""

  @hypothesis.settings(max_examples=3, deadline=None, derandomize=True)
  @hypothesis.given(tree=_trees())
  def test_each_node_is_its_chain(self, tree):
    parents, prefix = tree
    t = parents.shape[1]
    s = int((prefix + t).max())
    q, k, v = _qkv(t, s, seed=6)
    out, lse = aj.scaled_dot_product_attention(
        q, k, v, aj.tree_mask(jnp.asarray(parents), jnp.asarray(prefix)),
        implementation=FLASH, return_lse=True)
    # One plain call over every node's chain (rows b * t + i), padded to
    # the longest: the node's query is the chain's last, so it sees all of
    # its chain (kv_lengths) and nothing else.
    chains = [[*range(prefix[b]), *(prefix[b] + a for a in _path(parents[b],
                                                                 i))]
              for b in range(B) for i in range(t)]
    longest = max(map(len, chains))
    rows = np.repeat(np.arange(B), t)
    index = np.array([c + [0] * (longest - len(c)) for c in chains])
    take = lambda x: np.asarray(x)[rows[:, None], :, index].transpose(  # noqa: E731
        0, 2, 1, 3)  # [B * t, K, longest, H]
    chain_q = np.asarray(q).transpose(0, 2, 1, 3).reshape(B * t, N, 1, H)
    want, want_lse = aj.scaled_dot_product_attention(
        jnp.asarray(chain_q), jnp.asarray(take(k)), jnp.asarray(take(v)),
        aj.Mask(kv_lengths=jnp.array([len(c) for c in chains])),
        implementation="dense", return_lse=True)
    # float32, the same keys summed in another order
    np.testing.assert_allclose(
        np.asarray(out).transpose(0, 2, 1, 3).reshape(B * t, N, H),
        np.asarray(want)[:, :, 0], atol=2e-6)
    np.testing.assert_allclose(
        np.asarray(lse).transpose(0, 2, 1).reshape(B * t, N),
        np.asarray(want_lse)[:, :, 0], atol=2e-6)


class PagedTest(chex.TestCase):
  """A decoding step over a paged cache: the nodes appended after each
  row's prefix, the rule at the step's positions."""

  def test_paged_step_equals_the_dense_tree_mask(self):
    z, pages = 4, 5  # page size, pages a row may hold
    prefix_k, prefix_v = (_data.normal(10 + i, (B, K, 7, H)) for i in (0, 1))
    node_k, node_v = (_data.normal(12 + i, (B, K, T, H)) for i in (0, 1))
    q = _data.normal(14, (B, N, T, H))

    @jax.jit  # (one program: eager, each cache operation compiles alone)
    def verify(prefix_k, prefix_v, node_k, node_v, q):
      cache = aj.init_paged_cache(12, z, K, H, batch_size=B,
                                  max_pages=pages)
      cache = aj.paged_cache.append(cache, prefix_k, prefix_v,
                                    new_lengths=jnp.asarray(PREFIX))
      before = cache.lengths  # the tree's prefix: traced
      cache = aj.paged_cache.append(cache, node_k, node_v)
      return aj.paged_attention(
          q, cache, aj.Mask(causal=True, rule=aj.tree_rule(PARENTS, before)),
          implementation="flash", return_lse=True)

    out = verify(prefix_k, prefix_v, node_k, node_v, q)
    # The same keys laid out as slots: each row's prefix, then its nodes.
    s = z * pages
    k, v = np.zeros((2, B, K, s, H), np.float32)
    for b, n in enumerate(PREFIX):
      k[b, :, :n], v[b, :, :n] = prefix_k[b, :, :n], prefix_v[b, :, :n]
      k[b, :, n:n + T], v[b, :, n:n + T] = node_k[b], node_v[b]
    want = aj.scaled_dot_product_attention(
        q, jnp.asarray(k), jnp.asarray(v),
        aj.tree_mask(jnp.asarray(PARENTS), jnp.asarray(PREFIX)),
        implementation="dense", return_lse=True)
    for got, ref in zip(out, want):  # float32 sums of <= 18 terms
      np.testing.assert_allclose(got, ref, atol=2e-6)


class LayerTest(chex.TestCase):
  """A rotary layer verifying a tree in a paged cache gives every node the
  output of its path decoded alone, one token at a time."""

  def test_a_tree_in_a_paged_cache_is_its_paths(self):
    d, parents, prefix = 16, PARENTS[:, :6], PREFIX

    def layer():
      return aj.MultiHeadAttention(d_model=d, num_heads=N, num_kv_heads=K,
                                   rope=aj.Rope(), rngs=nnx.Rngs(0))

    x_prefix = _data.normal(20, (B, int(prefix.max()), d))
    x_tree = _data.normal(21, (B, 6, d))
    step = nnx.jit(lambda m, x, mask, positions: m(
        x, decode=True, mask=mask, positions=positions))
    tree = layer()
    tree.init_paged_cache(B, num_pages=12, page_size=4, max_pages=5)
    step(tree, x_prefix, aj.Mask(q_lengths=jnp.asarray(prefix)), None)
    got = step(tree, x_tree, aj.Mask(rule=aj.tree_rule(parents, prefix),
                                     q_lengths=jnp.full((B,), 6)),
               aj.tree_positions(parents, prefix))
    # Each path alone in a fresh linear cache: its prefix, then its nodes
    # one token each (rotary positions from the cache: prefix + depth).
    path_step = nnx.jit(lambda m, x: m(x, decode=True))
    alone = layer()
    for b in range(B):
      for i in range(6):
        alone.init_cache(1, 16)
        path_step(alone, x_prefix[b:b + 1, :prefix[b]])
        for node in _path(parents[b], i):
          want = path_step(alone, x_tree[b:b + 1, node:node + 1])
        # float32: the same sums in another order and blocks
        np.testing.assert_allclose(got[b, i], want[0, 0], atol=1e-5,
                                   err_msg=f"row {b}, node {i}")


class RefusalTest(chex.TestCase):

  def test_a_mask_window_beside_a_tree(self):
    rule = aj.tree_rule(PARENTS[0], 3)
    with self.assertRaisesRegex(ValueError, r"window counts slots.*"
                                r"aj.tree_rule\(window=\)"):
      aj.Mask(causal=True, window=(4, 0), rule=rule)
    with self.assertRaisesRegex(ValueError, r"window counts slots"):
      aj.Mask(window=(4, 0)) & aj.tree_mask(PARENTS[0], 3)
    with self.assertRaisesRegex(ValueError, r"window counts slots"):
      aj.Mask(window=4, rule=lambda b, h, q, k: k <= q) & aj.Mask(rule=rule)
    aj.Mask(causal=True, window=(4, 0), rule=lambda b, h, q, k: k <= q)

  def test_bad_parents(self):
    with self.assertRaisesRegex(TypeError, r"parents must be an integer "
                                r"array.*float32.*\(3,\)"):
      aj.tree_ancestors(jnp.array([-1.0, 0.0, 1.0]))
    with self.assertRaisesRegex(ValueError, r"parents must be \[T\].*"
                                r"\(1, 2, 3\)"):
      aj.tree_mask(np.zeros((1, 2, 3), int), 0)
    with self.assertRaisesRegex(
        ValueError, r"parents\[2\] = 2 is not in \[-1, 2\).*order nodes so "
        "each parent comes before its children"):
      aj.tree_rule([-1, 0, 2], 4)
    with self.assertRaisesRegex(ValueError, r"parents\[1, 1\] = -2"):
      aj.tree_positions([[-1, 0], [-1, -2]], 0)
    # Traced: a condition aj.checked enforces (unchecked: well defined).
    bad = jnp.array([-1, 3, 0])
    with self.assertRaisesRegex(ValueError, r"node 1 has parent 3: order "
                                "nodes"):
      aj.checked(jax.jit(aj.tree_depths))(bad)

  def test_bad_prefixes_and_windows(self):
    with self.assertRaisesRegex(TypeError, r"prefix_lengths must be an "
                                "integer"):
      aj.tree_mask(PARENTS, 2.0)
    with self.assertRaisesRegex(ValueError, r"\[B\] = \[2\].*shape \(3,\)"):
      aj.tree_rule(PARENTS, np.array([1, 2, 3]))
    with self.assertRaisesRegex(ValueError, r"prefix_lengths must be >= 0"):
      aj.tree_positions(PARENTS, np.array([1, -1]))
    with self.assertRaisesRegex(ValueError, r"window must be >= 0"):
      aj.tree_rule(PARENTS, PREFIX, window=-1)
    with self.assertRaisesRegex(TypeError, r"window must be a non-negative "
                                "int"):
      aj.tree_mask(PARENTS, PREFIX, window=(3, 0))
    # A rule for two rows refuses another batch.
    q = jnp.ones((3, N, T, H))
    with self.assertRaisesRegex(ValueError, r"2 examples"):
      aj.scaled_dot_product_attention(q, q, q, aj.tree_mask(PARENTS, 0))


def _per_head(score, b, h, q_idx, kv_idx):
  """A modifier that reads the head (and b), never the indices."""
  del b, q_idx, kv_idx
  return score * (1.0 + 0.25 * h)


class ScoreModTest(chex.TestCase):
  """A tree's nodes stand at slots (prefix + node index), not positions
  (prefix + depth): a score modifier that reads q_idx/kv_idx is refused
  beside a tree rule; one that reads the score (and b, h) is exact."""

  def test_a_modifier_reading_positions_is_refused(self):
    s = int((PREFIX + T).max())
    q, k, _ = (jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in _qkv(T, s))
    mods = {"alibi": aj.alibi(jnp.full((N,), 0.5)),
            "t5": aj.t5_relative_bias(jnp.ones((8, N))),
            "temperature": aj.query_temperature(floor_scale=4.0,
                                                attn_scale=0.1),
            "after a soft cap": aj.chain(aj.soft_cap(3.0),
                                         aj.alibi(jnp.full((N,), 0.5))),
            "one index": lambda s, b, h, q_idx, kv_idx: jnp.where(
                kv_idx > 2, s, s - 1.0)}
    tree = aj.tree_mask(jnp.asarray(PARENTS), jnp.asarray(PREFIX))
    refused = (r"score_mod reads q_idx/kv_idx, and the mask holds a tree "
               r"\(aj.tree_rule / aj.tree_mask\): a tree is exact for rotary "
               r"positions; .*sees the nodes' slots .*not their depths")
    for name, mod in mods.items():
      with self.assertRaisesRegex(ValueError, refused, msg=name):
        jax.eval_shape(lambda q, k, mod=mod: aj.scaled_dot_product_attention(
            q, k, k, tree, score_mod=mod), q, k)
    # A tree rule inside an & of rules.
    with self.assertRaisesRegex(ValueError, refused):
      jax.eval_shape(lambda q, k: aj.scaled_dot_product_attention(
          q, k, k, tree & aj.Mask(rule=lambda b, h, q, kv: kv >= 0),
          score_mod=mods["alibi"]), q, k)
    # A paged step (the rule at the cache's positions), traced only.
    with self.assertRaisesRegex(ValueError, refused):
      jax.eval_shape(lambda q: aj.paged_attention(
          q, aj.init_paged_cache(8, 4, K, H, batch_size=B, max_pages=4),
          aj.Mask(causal=True, rule=aj.tree_rule(PARENTS, PREFIX)),
          score_mod=mods["alibi"]), q)
    # A layer's modifier reaches the same check.
    layer = aj.MultiHeadAttention(d_model=16, num_heads=N, num_kv_heads=K,
                                  score_mod=mods["alibi"], rngs=nnx.Rngs(0))
    with self.assertRaisesRegex(ValueError, refused):
      layer(jnp.ones((B, T, 16)), mask=aj.tree_mask(PARENTS, 0))
    # Without a tree, the same modifiers are an ordinary call's.
    jax.eval_shape(lambda q, k: aj.scaled_dot_product_attention(
        q, k, k, is_causal=True, score_mod=mods["alibi"]), q, k)

  def test_a_soft_cap_is_each_nodes_chain(self):
    # Gemma 2's soft cap (and a per-head scale: b, h are no positions)
    # reads only the score: each node's answer is its chain's, decoded
    # alone with the same modifier.
    s = int((PREFIX + T).max())
    q, k, v = _qkv(T, s, seed=30)
    mod = aj.chain(_per_head, aj.soft_cap(0.5))  # a cap that bites
    got = aj.scaled_dot_product_attention(
        q, k, v, aj.tree_mask(jnp.asarray(PARENTS), jnp.asarray(PREFIX)),
        score_mod=mod, implementation=FLASH)
    chains = [[*range(PREFIX[b]), *(PREFIX[b] + a for a in _path(PARENTS[b],
                                                                 i))]
              for b in range(B) for i in range(T)]
    longest = max(map(len, chains))
    rows = np.repeat(np.arange(B), T)
    index = np.array([c + [0] * (longest - len(c)) for c in chains])
    take = lambda x: np.asarray(x)[rows[:, None], :, index].transpose(  # noqa: E731
        0, 2, 1, 3)  # [B * T, K, longest, H]
    want = aj.scaled_dot_product_attention(
        jnp.asarray(np.asarray(q).transpose(0, 2, 1, 3).reshape(B * T, N, 1,
                                                                H)),
        jnp.asarray(take(k)), jnp.asarray(take(v)),
        aj.Mask(kv_lengths=jnp.array([len(c) for c in chains])),
        score_mod=mod, implementation="dense")
    uncapped = aj.scaled_dot_product_attention(
        q, k, v, aj.tree_mask(jnp.asarray(PARENTS), jnp.asarray(PREFIX)),
        implementation=FLASH)
    self.assertGreater(float(jnp.abs(got - uncapped).max()), 1e-2)
    # float32, the same keys summed in another order
    np.testing.assert_allclose(
        np.asarray(got).transpose(0, 2, 1, 3).reshape(B * T, N, H),
        np.asarray(want)[:, :, 0], atol=2e-6)


if __name__ == "__main__":
  absltest.main()
