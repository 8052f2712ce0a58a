"""aj.update_kv_cache: bad operands are refused, good ones match NumPy."""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj

B, K, L, H, HV = 2, 4, 8, 16, 6
CK = jnp.zeros((B, K, L, H))
CV = jnp.zeros((B, K, L, HV))
NEW_K = jnp.ones((B, K, 3, H))
NEW_V = jnp.ones((B, K, 3, HV))
I0 = jnp.int32(2)


def _with(**changes):
  """The update with one operand swapped for a bad one."""
  args = dict(cached_key=CK, cached_value=CV, index=I0, key=NEW_K,
              value=NEW_V, new_lengths=None)
  args.update(changes)
  return lambda: aj.update_kv_cache(**args)


CASES = [
    # (name, call, exception, message regex)
    ("key_heads", _with(key=jnp.ones((B, 2, 3, H))), ValueError,
     r"key with shape \(2, 2, 3, 16\) does not fit cached_key \(2, 4, 8, 16\)"
     r": expected \[B, K, T, H\] = \[2, 4, T, 16\].*K = 2"),
    ("key_batch", _with(key=jnp.ones((1, K, 3, H))), ValueError,
     r"key with shape \(1, 4, 3, 16\) does not fit cached_key.*B = 1"),
    ("key_head_dim", _with(key=jnp.ones((B, K, 3, 8))), ValueError,
     r"key with shape \(2, 4, 3, 8\) does not fit cached_key.*H = 8"),
    ("value_head_dim", _with(value=jnp.ones((B, K, 3, H))), ValueError,
     r"value with shape \(2, 4, 3, 16\) does not fit cached_value "
     r"\(2, 4, 8, 6\): expected \[B, K, T, Hv\] = \[2, 4, T, 6\]"),
    ("key_value_tokens", _with(value=jnp.ones((B, K, 2, HV))), ValueError,
     r"key \(2, 4, 3, 16\) and value \(2, 4, 2, 6\) must bring the same "
     r"number of new tokens T"),
    ("too_many_tokens", _with(key=jnp.ones((B, K, 9, H)),
                              value=jnp.ones((B, K, 9, HV))), ValueError,
     r"KV cache overflow: key \(2, 4, 9, 16\) brings 9 tokens but "
     r"max_length is 8 \(cached_key \(2, 4, 8, 16\)\)"),
    ("cache_lengths", _with(cached_value=jnp.zeros((B, K, 6, HV))),
     ValueError, r"cached_key \(2, 4, 8, 16\) and cached_value \(2, 4, 6, 6\) "
     r"must share \[B, K, L\]"),
    ("cache_heads", _with(cached_value=jnp.zeros((B, 2, L, HV))),
     ValueError, r"cached_key \(2, 4, 8, 16\) and cached_value \(2, 2, 8, 6\)"),
    ("cache_rank", _with(cached_key=jnp.zeros((K, L, H))), ValueError,
     r"cached_key must have rank 4 \(\[B, K, L, H\]\), got shape "
     r"\(4, 8, 16\): create it as jnp.zeros"),
    ("value_cache_rank", _with(cached_value=jnp.zeros((B, K, L))), ValueError,
     r"cached_value must have rank 4 \(\[B, K, L, Hv\]\), got shape "
     r"\(2, 4, 8\)"),
    ("key_rank", _with(key=jnp.ones((B, K, H))), ValueError,
     r"key must have rank 4 \(\[B, K, T, H\]\), got shape \(2, 4, 16\): .*"
     r"x\[:, :, None, :\]"),
    ("value_rank", _with(value=jnp.ones((B, K, 1, 1, HV))), ValueError,
     r"value must have rank 4 \(\[B, K, T, Hv\]\), got shape "
     r"\(2, 4, 1, 1, 6\)"),
    ("int_key", _with(key=jnp.ones((B, K, 3, H), jnp.int32)), TypeError,
     r"key must be a real floating-point array, got dtype int32 with shape "
     r"\(2, 4, 3, 16\)"),
    ("int_cache", _with(cached_value=jnp.zeros((B, K, L, HV), jnp.int32)),
     TypeError, r"cached_value must be a real floating-point array, got "
     r"dtype int32"),
    ("negative_index", _with(index=jnp.int32(-1)), ValueError,
     r"index must be non-negative .*got -1.*clamped to slot 0"),
    ("negative_python_index", _with(index=-3), ValueError,
     r"index must be non-negative .*got -3"),
    ("index_batch", _with(index=jnp.array([1, 2, 3], jnp.int32)),
     ValueError, r"index must be an integer scalar shared by the batch or one "
     r"per example \[B\] = \[2\], got shape \(3,\)"),
    ("per_example_overflow", _with(index=jnp.array([1, 6], jnp.int32)),
     ValueError, r"KV cache overflow in examples \[1\]: 6 positions"),
    ("new_lengths_too_long", _with(new_lengths=jnp.array([1, 4])),
     ValueError, r"new_lengths must lie in \[0, 3\]"),
    ("new_lengths_shape", _with(new_lengths=jnp.array([1, 2, 3])),
     ValueError, r"new_lengths must be integer \[B\] = \[2\]"),
    ("matrix_index", _with(index=jnp.zeros((1, 1), jnp.int32)), ValueError,
     r"index must be an integer scalar .*got shape \(1, 1\)"),
    ("float_index", _with(index=jnp.float32(2.0)), TypeError,
     r"index must be an integer scalar .*got dtype float32 with shape \(\)"),
    ("bool_index", _with(index=True), TypeError,
     r"index must be an integer scalar .*got dtype bool"),
    ("overflow", _with(index=jnp.int32(6)), ValueError,
     r"KV cache overflow: 6 positions are filled and this call brings 3 "
     r"more, but max_length is 8"),
]


class BadInputTest(parameterized.TestCase):

  @parameterized.named_parameters(*CASES)
  def test_eager(self, call, error, regex):
    with self.assertRaisesRegex(error, regex):
      call()

  @parameterized.named_parameters(*CASES)
  def test_under_jit(self, call, error, regex):
    # The operands are closed over, so they stay concrete: every check,
    # the index's included, fires at trace time with the same error.
    with self.assertRaisesRegex(error, regex):
      jax.jit(call)()

  @parameterized.named_parameters(("negative", [-1, 2]), ("overflow", [6, 2]))
  def test_traced_misfit_is_dropped_and_reported_as_a_value(self, index):
    # A jit argument is not known at trace time. No host callback in the
    # step: what does not fit is not written (never clamped onto slot 0 or
    # the last slots), and cache_overflow says where.
    index = jnp.array(index, jnp.int32)
    ck, _, _ = jax.jit(aj.update_kv_cache)(CK, CV, index, NEW_K, NEW_V)
    np.testing.assert_array_equal(ck[0], 0.0)  # row 0 untouched
    np.testing.assert_array_equal(ck[1, :, 2:5], 1.0)  # row 1 written at 2
    np.testing.assert_array_equal(
        aj.cache_overflow(index, 3, L), [True, False])


def _numpy_update(ck, cv, index, k, v):
  ck, cv = np.array(ck), np.array(cv)
  t = k.shape[2]
  ck[:, :, index:index + t] = k
  cv[:, :, index:index + t] = v
  visible = np.arange(ck.shape[2])[None, :] <= index + np.arange(t)[:, None]
  return ck, cv, visible


def _numpy_ragged(ck, cv, index, lengths, k, v):
  """Per example: write its first lengths[b] tokens at index[b]."""
  ck, cv = np.array(ck), np.array(cv)
  t, length = k.shape[2], ck.shape[2]
  visible = np.zeros((len(index), t, length), bool)
  for b, (i, n) in enumerate(zip(index, lengths)):
    ck[b, :, i:i + n] = k[b, :, :n]
    cv[b, :, i:i + n] = v[b, :, :n]
    for q in range(n):
      visible[b, q, :i + q + 1] = True
  return ck, cv, visible


def _numpy_ring(slots, window, chunks):
  """Feeds [B, T] position chunks token by token into W slots: returns, per
  call, what each query may see ({absolute key position}) and the slots."""
  held = [[-1] * slots for _ in chunks[0][0]]
  seen, tokens = [], [0] * len(chunks[0][0])
  for chunk_lengths in chunks:
    per_call = []
    for b, n in enumerate(chunk_lengths[0]):
      start = tokens[b]
      per_call.append([{p for p in range(max(0, start + i - window),
                                         start + i + 1)} for i in range(n)])
      for i in range(n):
        held[b][(start + i) % slots] = start + i
      tokens[b] += n
    seen.append(per_call)
  return seen, held


class MatchesNumpyTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("start_jnp", 0, 3, jnp.int32, False),
      ("middle_python_int", 2, 3, int, False),
      ("fills_to_the_end", 5, 3, np.int32, False),
      ("one_token_jit", 4, 1, jnp.int32, True),
      ("prefill_all_jit", 0, L, jnp.int32, True),
  )
  def test_buffer_and_visibility(self, index, t, as_index, jit):
    rng = np.random.default_rng(index + t)
    ck = rng.normal(size=(B, K, L, H)).astype(np.float32)
    cv = rng.normal(size=(B, K, L, HV)).astype(np.float32)
    k = rng.normal(size=(B, K, t, H)).astype(np.float32)
    v = rng.normal(size=(B, K, t, HV)).astype(np.float32)
    update = jax.jit(aj.update_kv_cache) if jit else aj.update_kv_cache
    got = update(jnp.asarray(ck), jnp.asarray(cv), as_index(index),
                 jnp.asarray(k), jnp.asarray(v))
    want = _numpy_update(ck, cv, index, k, v)
    for g, w in zip(got, want):
      chex.assert_trees_all_equal(np.asarray(g), w)
    self.assertEqual(got[2].dtype, jnp.bool_)

  def test_ragged_rows_write_and_see_from_their_own_positions(self):
    rng = np.random.default_rng(0)
    ck = rng.normal(size=(B, K, L, H)).astype(np.float32)
    cv = rng.normal(size=(B, K, L, HV)).astype(np.float32)
    k = rng.normal(size=(B, K, 3, H)).astype(np.float32)
    v = rng.normal(size=(B, K, 3, HV)).astype(np.float32)
    index, lengths = np.array([5, 1]), np.array([2, 3])
    got = jax.jit(aj.update_kv_cache)(ck, cv, jnp.asarray(index), k, v,
                                      new_lengths=jnp.asarray(lengths))
    for g, w in zip(got, _numpy_ragged(ck, cv, index, lengths, k, v)):
      chex.assert_trees_all_equal(np.asarray(g), w)

  def test_ring_buffer_keeps_the_window_and_sees_what_full_attention_sees(
      self):
    slots, window = 4, 2
    ck = jnp.zeros((B, 1, slots, 1))
    index = jnp.zeros((B,), jnp.int32)
    # A prompt longer than the buffer (ragged), then one token at a time.
    chunks = [(np.array([6, 3]),)] + [(np.array([1, 1]),)] * 5
    seen, held = _numpy_ring(slots, window, chunks)
    for (lengths,), want in zip(chunks, seen):
      t = int(lengths.max())
      pos = (index[:, None] + jnp.arange(t)[None, :]).astype(jnp.float32)
      new = pos[:, None, :, None]  # a key's value is its position
      keys, _, visible, key_pos, ck, _ = aj.update_ring_cache(
          ck, ck, index, new, new, window=window,
          new_lengths=jnp.asarray(lengths))
      for b in range(B):
        for i in range(int(lengths[b])):
          got = set(np.asarray(key_pos[b])[np.asarray(visible[b, i])])
          self.assertEqual(got, want[b][i])
          self.assertEqual(  # the keys there are the right ones
              set(np.asarray(keys[b, 0, :, 0])[np.asarray(visible[b, i])]),
              {float(p) for p in want[b][i]})
        self.assertFalse(np.asarray(visible[b, int(lengths[b]):]).any())
      index = index + jnp.asarray(lengths)
      # The whole buffer after each call: slot j holds the latest position
      # p < index with p % W == j (a key's value is its position), and the
      # initial 0 where none was written yet.
      for b in range(B):
        written = int(index[b])
        want_slots = [max((p for p in range(written) if p % slots == j),
                          default=0) for j in range(slots)]
        np.testing.assert_array_equal(np.asarray(ck[b, 0, :, 0]),
                                      np.array(want_slots, np.float32),
                                      err_msg=f"example {b} after {written}")
    for b in range(B):
      filled = [p for p in held[b] if p >= 0]
      np.testing.assert_array_equal(
          np.asarray(ck[b, 0, :, 0])[[p % slots for p in filled]], filled)

  def test_new_values_are_cast_to_the_cache_dtype(self):
    ck = jnp.zeros((B, K, L, H), jnp.bfloat16)
    new_k, new_v, _ = aj.update_kv_cache(ck, CV, 0, NEW_K, NEW_V)
    self.assertEqual(new_k.dtype, jnp.bfloat16)
    self.assertEqual(new_v.dtype, CV.dtype)


if __name__ == "__main__":
  absltest.main()
