"""The paged KV cache's bookkeeping against a plain model of the sequences.

A random schedule of appends (ragged, some sequences idle), releases and
prefix shares runs through the jitted pure functions; after every step each
sequence's tokens, read through its page table, are the model's list, each
page's reference count is the number of table entries naming it, and pages
past a sequence's length are not held. Copy on write is what keeps a
shared prompt intact when one of its holders writes on. A prefix of whole
pages (0, 1, 2 of them) is run explicitly: the random draws of the default
profile do not reach that boundary.
"""

from absl.testing import parameterized
import chex
import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.decoding import paged_cache as pc

B, K, Z, M, T, H = 3, 2, 2, 4, 3, 2  # sequences, heads, page size, ...

_append = jax.jit(lambda c, k, v, n: pc.append(c, k, v, new_lengths=n))
_release = jax.jit(pc.release)
_share = jax.jit(pc.share_prefix)


def _tokens(cache, b):
  """Sequence ``b``'s keys and values ``[len, K, H]``, read page by page."""
  n = int(cache.lengths[b])
  pages = np.asarray(cache.page_table[b])
  pos = np.arange(n)
  page, slot = pages[pos // Z], pos % Z
  kp, vp = np.asarray(cache.key_pages), np.asarray(cache.value_pages)
  return kp[page, :, slot], vp[page, :, slot]


def _check_against(test, cache, model):
  p = cache.num_pages
  table = np.asarray(cache.page_table)
  counts = np.zeros(p, int)
  for b in range(B):
    n = len(model[b])
    test.assertEqual(int(cache.lengths[b]), n)
    used = -(-n // Z)
    test.assertTrue((table[b, :used] < p).all(), (b, table[b]))
    test.assertTrue((table[b, used:] == p).all(), (b, table[b]))
    np.add.at(counts, table[b, :used], 1)
    k, v = _tokens(cache, b)
    want = np.array(model[b]).reshape(n, 1, 1)
    np.testing.assert_array_equal(k, np.broadcast_to(want, (n, K, H)))
    np.testing.assert_array_equal(v, -np.broadcast_to(want, (n, K, H)))
  np.testing.assert_array_equal(np.asarray(cache.refcount), counts)


def _whole_page_prefix(k):
  """A schedule sharing ``k`` whole pages of a 5-token source (3 pages), the
  target writing on, then both released: ``share_prefix``'s boundary case,
  which the ci profile's random draws do not reach."""
  return [("append", [3, 0, 0], 0, 0, 0), ("append", [2, 0, 0], 0, 0, 0),
          ("share", [0, 0, 0], 0, 1, k * Z), ("append", [0, 1, 0], 0, 0, 0),
          ("release", [0, 0, 0], 0, 0, 0), ("release", [0, 0, 0], 1, 0, 0)]


class PagedCacheTest(chex.TestCase):

  @hypothesis.example(num_pages=8, schedule=_whole_page_prefix(0))
  @hypothesis.example(num_pages=8, schedule=_whole_page_prefix(1))
  @hypothesis.example(num_pages=8, schedule=_whole_page_prefix(2))
  @hypothesis.given(
      num_pages=st.integers(4, 12),
      schedule=st.lists(st.tuples(
          st.sampled_from(["append", "append", "release", "share"]),
          st.lists(st.integers(0, T), min_size=B, max_size=B),
          st.integers(0, B - 1), st.integers(0, B - 1),
          st.integers(0, M * Z)), min_size=1, max_size=12))
  def test_a_random_schedule_keeps_every_sequence_and_count(
      self, num_pages, schedule):
    cache = pc.init_paged_cache(num_pages, Z, K, H, B, M)
    model = [[] for _ in range(B)]
    next_value = 1.0
    for op, counts, src, dst, length in schedule:
      if op == "append":
        values = next_value + np.arange(B * T, dtype=np.float32).reshape(
            B, 1, T, 1)
        next_value += B * T
        key = jnp.broadcast_to(jnp.asarray(values), (B, K, T, H))
        # Which writes must fit: pages are served in batch order, a miss
        # takes none; a write into a shared half-full page needs a copy.
        refcount, table = np.asarray(cache.refcount), np.asarray(
            cache.page_table)
        left = int((refcount == 0).sum())
        fits = []
        for b in range(B):
          start, end = len(model[b]), len(model[b]) + counts[b]
          need = -(-end // Z) - -(-start // Z)
          if counts[b] and start % Z and refcount[table[b, start // Z]] > 1:
            need += 1
          fits.append(end <= M * Z and need <= left)
          left -= need if fits[-1] else 0
        cache = _append(cache, key, -key, jnp.array(counts, jnp.int32))
        for b in range(B):
          if fits[b]:
            model[b] += values[b, 0, :counts[b], 0].tolist()
          elif counts[b]:
            self.assertTrue(bool(cache.overflow[b]), "a miss is flagged")
      elif op == "release":
        done = np.zeros(B, bool)
        done[src] = True
        cache = _release(cache, jnp.asarray(done))
        model[src] = []
      elif src != dst and not model[dst] and length <= len(model[src]):
        cache = _share(cache, jnp.int32(src), jnp.int32(dst),
                       jnp.int32(length))
        model[dst] = model[src][:length]
      _check_against(self, cache, model)

  @parameterized.parameters(0, 1, 2)
  def test_a_prefix_of_whole_pages_hands_over_those_pages_alone(self, k):
    # The source's page after a whole-page prefix holds only its own later
    # tokens. Handed over too, the target's first write would start a page
    # in its place and that page would stay held once both rows are gone.
    cache = pc.init_paged_cache(8, Z, K, H, B, M)
    ones = jnp.ones((B, K, T, H))
    cache = _append(cache, ones, ones, jnp.array([3, 0, 0]))
    cache = _append(cache, ones, ones, jnp.array([2, 0, 0]))  # pages 0-2
    cache = _share(cache, jnp.int32(0), jnp.int32(1), jnp.int32(k * Z))
    self.assertEqual(cache.page_table.tolist()[1], list(range(k)) + [8] * (
        M - k))
    self.assertEqual(cache.refcount.tolist(), [2] * k + [1] * (3 - k) + [0] * 5)
    cache = _append(cache, 2 * ones, 2 * ones, jnp.array([0, 1, 0]))
    self.assertEqual(cache.refcount.tolist(), [2] * k + [1] * (4 - k) + [0] * 4)
    cache = _release(cache, jnp.array([True, True, False]))
    self.assertEqual(cache.refcount.tolist(), [0] * 8)  # every page free

  def test_a_large_enough_pool_never_overflows(self):
    cache = pc.init_paged_cache(B * M, Z, K, H, B, M)
    rng = np.random.default_rng(0)
    for _ in range(3):
      key = jnp.asarray(rng.standard_normal((B, K, T, H)), jnp.float32)
      cache = _append(cache, key, key, jnp.array([1, 2, 2]))
    self.assertFalse(np.asarray(cache.overflow).any())
    pc.check_overflow(cache)  # raises nothing
    self.assertEqual(cache.lengths.tolist(), [3, 6, 6])

  def test_a_shared_prompt_is_copied_before_either_holder_writes(self):
    cache = pc.init_paged_cache(6, Z, K, H, B, M)
    ones = jnp.ones((B, K, T, H))
    cache = _append(cache, ones, ones, jnp.array([3, 0, 0]))  # pages 0, 1
    cache = _share(cache, jnp.int32(0), jnp.int32(1), jnp.int32(3))
    self.assertEqual(cache.refcount.tolist()[:2], [2, 2])
    cache = _append(cache, 2 * ones, 2 * ones, jnp.array([0, 1, 0]))
    # Sequence 1 wrote into the shared half-full page 1: it now holds a
    # copy (page 2) and page 1 is sequence 0's alone, unchanged.
    self.assertEqual(cache.page_table.tolist()[:2], [[0, 1, 6, 6],
                                                     [0, 2, 6, 6]])
    self.assertEqual(cache.refcount.tolist()[:3], [2, 1, 1])
    k0, _ = _tokens(cache, 0)
    k1, _ = _tokens(cache, 1)
    np.testing.assert_array_equal(k0[:, 0, 0], [1, 1, 1])
    np.testing.assert_array_equal(k1[:, 0, 0], [1, 1, 1, 2])

  def test_pages_run_out_then_a_release_makes_room(self):
    cache = pc.init_paged_cache(3, Z, K, H, B, M)
    ones = jnp.ones((B, K, T, H))
    cache = _append(cache, ones, ones, jnp.array([3, 3, 1]))
    # 0 takes 2 pages, 1 needs 2 of the 1 left (nothing written, flagged),
    # 2 takes the last one: pages are served in order, a miss takes none.
    self.assertEqual(cache.lengths.tolist(), [3, 0, 1])
    self.assertEqual(cache.overflow.tolist(), [False, True, False])
    with self.assertRaisesRegex(ValueError, r"sequences \[1\].*Release"):
      pc.check_overflow(cache)
    cache = _release(cache, jnp.array([True, True, False]))
    cache = _append(cache, ones, ones, jnp.array([0, 3, 0]))
    self.assertEqual(cache.lengths.tolist(), [0, 3, 1])
    self.assertFalse(np.asarray(cache.overflow).any())

  def test_a_write_past_max_pages_is_dropped_and_flagged(self):
    cache = pc.init_paged_cache(B * M, Z, K, H, B, M)  # pages to spare
    ones = jnp.ones((B, K, T, H))
    for _ in range(2):
      cache = _append(cache, ones, ones, jnp.array([3, 0, 0]))  # 6 of 8
    table = cache.page_table
    cache = _append(cache, 2 * ones, 2 * ones, jnp.array([3, 1, 0]))
    # 9 tokens do not fit 4 pages of 2: nothing written, not even the
    # two that would; the other sequence's write goes ahead.
    self.assertEqual(cache.lengths.tolist(), [6, 1, 0])
    self.assertEqual(cache.overflow.tolist(), [True, False, False])
    np.testing.assert_array_equal(cache.page_table[0], table[0])
    k0, _ = _tokens(cache, 0)
    np.testing.assert_array_equal(k0, 1.0)

  def test_pages_written_a_nan_are_marked_until_they_are_handed_out_again(
      self):
    # all_finite is what lets attention skip searching each block for NaN
    # and inf: it must be False exactly while a held page was written one.
    c = pc.init_paged_cache(4, 2, 1, 1, batch_size=2, max_pages=2)
    x = jnp.ones((2, 1, 3, 1))
    c = pc.append(c, x.at[0, 0, 2].set(jnp.inf), x,
                  new_lengths=jnp.array([3, 1]))
    # Sequence 0 holds pages 0, 1 (the inf in page 1), sequence 1 page 2.
    self.assertEqual(c.nonfinite.tolist(), [False, True, False, False])
    self.assertFalse(bool(pc.all_finite(c)))
    # Sequence 1 shares sequence 0's first 3 tokens and writes: the shared
    # partly filled page 1 is copied (to page 2, free again), mark and all.
    c = pc.release(c, jnp.array([False, True]))
    c = pc.share_prefix(c, 0, 1, 3)
    c = pc.append(c, x, x, new_lengths=jnp.array([0, 1]))
    self.assertEqual(c.page_table.tolist(), [[0, 1], [0, 2]])
    self.assertEqual(c.nonfinite.tolist(), [False, True, True, False])
    # Released, the marked pages are nobody's: the cache is finite again,
    # and a page handed out anew starts unmarked.
    c = pc.release(c, jnp.array([True, True]))
    self.assertTrue(bool(pc.all_finite(c)))
    c = pc.append(c, x, x, new_lengths=jnp.array([3, 3]))
    self.assertEqual(c.nonfinite.tolist(), [False] * 4)
    self.assertIsNone(pc.all_finite(c._replace(nonfinite=None)))

  def test_bad_input_names_the_argument(self):
    cache = pc.init_paged_cache(4, Z, K, H, B, M)
    with self.assertRaisesRegex(ValueError, r"key must be \[B, K, T, H\]"):
      pc.append(cache, jnp.ones((B, K + 1, T, H)), jnp.ones((B, K, T, H)))
    with self.assertRaisesRegex(ValueError, r"new_lengths must be integer \[B\]"):
      pc.append(cache, jnp.ones((B, K, T, H)), jnp.ones((B, K, T, H)),
                new_lengths=jnp.ones(B))
    with self.assertRaisesRegex(ValueError, r"new_lengths must lie in"):
      pc.append(cache, jnp.ones((B, K, T, H)), jnp.ones((B, K, T, H)),
                new_lengths=jnp.array([0, T + 1, 0]))
    with self.assertRaisesRegex(ValueError, r"length must be in \[0, 0\]"):
      pc.share_prefix(cache, 0, 1, 2)
    with self.assertRaisesRegex(ValueError, "done must be bool"):
      pc.release(cache, jnp.array([1, 0, 0]))
    with self.assertRaisesRegex(TypeError, "PagedKVCache"):
      pc.release((1, 2), jnp.array([True, False, False]))
