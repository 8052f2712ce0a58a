"""move_slots against a NumPy model of what each sequence holds."""

from absl.testing import absltest
import chex
import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.decoding import paged_cache as pc
from attention_jax.decoding import paged_edit

B, K, Z, P, M = 3, 2, 4, 12, 4


def _logical(cache, b):
  """Sequence b's tokens as ``[K, L, 1]`` read through its page table."""
  n = int(cache.lengths[b])
  table = np.asarray(cache.page_table[b])
  pages = np.asarray(cache.key_pages)
  return np.stack([pages[table[i // Z], :, i % Z] for i in range(n)]
                  or [np.zeros((K, 1))], 1)[:, :n]


def _check_books(test, cache):
  """Reference counts equal the table's references; nothing else is held."""
  table = np.asarray(cache.page_table)
  held = np.bincount(table[table < P], minlength=P)
  np.testing.assert_array_equal(np.asarray(cache.refcount), held)
  lengths = np.asarray(cache.lengths)
  for b in range(B):  # a sequence holds exactly the pages its length needs
    test.assertEqual(int((table[b] < P).sum()), -(-int(lengths[b]) // Z))


@jax.jit
def _move(cache, start, source, count):
  return paged_edit.move_slots(cache, start, source, count)


class MoveSlotsTest(chex.TestCase):

  @hypothesis.settings(max_examples=8, deadline=None)
  @hypothesis.given(st.data())
  def test_equals_numpy_model(self, data):
    lengths = np.array([data.draw(st.integers(0, M * Z)) for _ in range(B)])
    cache = pc.init_paged_cache(P, Z, K, 1, batch_size=B, max_pages=M)
    x = jnp.asarray(np.random.default_rng(0).normal(
        size=(B, K, M * Z, 1)), jnp.float32)
    cache = pc.append(cache, x, x, new_lengths=jnp.asarray(lengths))
    hypothesis.assume(not np.asarray(cache.overflow).any())
    per_head = data.draw(st.booleans())
    a = 5
    start, count = np.zeros(B, np.int32), np.zeros(B, np.int32)
    source = np.zeros((B, K, a) if per_head else (B, a), np.int32)
    for b in range(B):
      start[b] = data.draw(st.integers(0, lengths[b]))
      count[b] = data.draw(st.integers(0, min(a, lengths[b] - start[b])))
      if lengths[b]:
        source[b] = np.asarray(data.draw(st.lists(
            st.integers(0, lengths[b] - 1), min_size=source[b].size,
            max_size=source[b].size))).reshape(source[b].shape)
    want = []
    for b in range(B):
      seq = _logical(cache, b)  # [K, L, 1]
      src = source[b] if per_head else np.broadcast_to(source[b], (K, a))
      kept = np.stack([seq[h, src[h, :count[b]]] for h in range(K)])
      want.append(np.concatenate([seq[:, :start[b]], kept], 1))
    moved = _move(cache, start, source, count)
    np.testing.assert_array_equal(np.asarray(moved.lengths), start + count)
    for b in range(B):
      np.testing.assert_array_equal(_logical(moved, b), want[b])
    _check_books(self, moved)
    self.assertFalse(np.asarray(moved.overflow).any())

  def test_freed_pages_are_reused(self):
    cache = pc.init_paged_cache(4, 2, 1, 1, batch_size=1, max_pages=4)
    x = jnp.ones((1, 1, 8, 1))
    cache = pc.append(cache, x, x)  # the whole pool
    cache = paged_edit.move_slots(cache, jnp.array([0]), jnp.array([[7, 6]]),
                                  jnp.array([2]))
    self.assertEqual(cache.refcount.tolist(), [1, 0, 0, 0])
    cache = pc.append(cache, x[:, :, :6], x[:, :, :6])  # fits again
    self.assertEqual(cache.lengths.tolist(), [8])
    self.assertFalse(bool(cache.overflow[0]))

  def test_shared_page_is_not_written(self):
    cache = pc.init_paged_cache(8, 2, 1, 1, batch_size=2, max_pages=4)
    x = jnp.arange(6.0).reshape(1, 1, 6, 1)
    cache = pc.append(cache, jnp.concatenate([x, x]), jnp.concatenate([x, x]),
                      new_lengths=jnp.array([6, 0]))
    cache = pc.share_prefix(cache, 0, 1, 4)  # row 1 holds pages of row 0
    before = np.asarray(cache.key_pages)
    # Traced: the row moves nothing and raises its overflow flag.
    moved = _move(cache, jnp.array([0, 0]), jnp.array([[5, 4], [0, 1]]),
                  jnp.array([2, 2]))
    np.testing.assert_array_equal(np.asarray(moved.key_pages), before)
    self.assertEqual(moved.overflow.tolist(), [True, False])
    with self.assertRaisesRegex(ValueError, r"sequences \[0\].*move_slots"):
      pc.check_overflow(moved)
    # Keeping a shared page's slots where they are writes nothing: allowed.
    kept = _move(cache, jnp.array([0, 0]), jnp.array([[0, 1], [0, 1]]),
                 jnp.array([2, 2]))
    self.assertEqual(kept.overflow.tolist(), [False, False])
    self.assertEqual(kept.lengths.tolist(), [2, 2])

  def test_refusals_name_the_argument(self):
    cache = pc.init_paged_cache(4, 2, 1, 1, batch_size=1, max_pages=4)
    x = jnp.ones((1, 1, 3, 1))
    cache = pc.append(cache, x, x)
    with self.assertRaisesRegex(ValueError, "start \\+ count <= lengths"):
      paged_edit.move_slots(cache, jnp.array([2]), jnp.array([[0, 1]]),
                            jnp.array([2]))
    with self.assertRaisesRegex(ValueError, "source slots in"):
      paged_edit.move_slots(cache, jnp.array([0]), jnp.array([[3]]),
                            jnp.array([1]))
    with self.assertRaisesRegex(ValueError, "source must be"):
      paged_edit.move_slots(cache, jnp.array([0]), jnp.zeros((1, 3, 1), int),
                            jnp.array([1]))
    with self.assertRaisesRegex(ValueError, "count must be"):
      paged_edit.move_slots(cache, jnp.array([0]), jnp.array([[0]]),
                            jnp.array([1.0]))
    traced = aj.checked(jax.jit(paged_edit.move_slots))
    with self.assertRaisesRegex(ValueError, "source slots in"):
      traced(cache, jnp.array([0]), jnp.array([[3]]), jnp.array([1]))


if __name__ == "__main__":
  absltest.main()
