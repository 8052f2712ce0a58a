"""aj.update_kv_cache: bad operands are refused, good ones match NumPy;
left-padded batches in either cache; right-padded prefills without
q_lengths are reported."""

from absl.testing import absltest
from absl.testing import parameterized
import chex
from flax import nnx
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
    ("left_padding_shape", _with(left_padding=jnp.array([1, 2, 0])),
     ValueError, r"left_padding must be integer \[B\] = \[2\].*\(3,\)"),
    ("left_padding_float", _with(left_padding=jnp.array([1.0, 0.0])),
     ValueError, r"left_padding must be integer .*float32"),
    ("left_padding_negative", _with(left_padding=jnp.array([-1, 0])),
     ValueError, r"left_padding must be non-negative .*got -1"),
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

  def test_left_padding_hides_the_pad_positions_in_either_cache(self):
    # Example 1 starts with 3 pads: no query ever sees positions 0..2, in a
    # linear cache or in a ring buffer whose slots they keep until wrapped.
    pads, slots, window = np.array([0, 3]), 4, 2
    ring = lin = jnp.zeros((B, 1, slots, 1))
    lin = jnp.zeros((B, 1, L, 1))
    index = jnp.zeros((B,), jnp.int32)
    for t in (5, 1, 1, 1):
      pos = (index[:, None] + jnp.arange(t)[None, :]).astype(jnp.float32)
      new = pos[:, None, :, None]  # a key's value is its position
      keys, _, visible, key_pos, ring, _ = aj.update_ring_cache(
          ring, ring, index, new, new, window=window,
          left_padding=jnp.asarray(pads))
      lin, _, lin_visible = aj.update_kv_cache(
          lin, lin, index, new, new, left_padding=jnp.asarray(pads))
      for b in range(B):
        for i in range(t):
          q = int(index[b]) + i
          want = {p for p in range(q - window, q + 1) if p >= pads[b]}
          got = np.asarray(keys[b, 0, :, 0])[np.asarray(visible[b, i])]
          self.assertEqual(set(got.tolist()), want)
          self.assertEqual(
              set(np.flatnonzero(np.asarray(lin_visible[b, i])).tolist()),
              set(range(pads[b], q + 1)))
      index = index + t

  def test_new_values_are_cast_to_the_cache_dtype(self):
    ck = jnp.zeros((B, K, L, H), jnp.bfloat16)
    new_k, new_v, _ = aj.update_kv_cache(ck, CV, 0, NEW_K, NEW_V)
    self.assertEqual(new_k.dtype, jnp.bfloat16)
    self.assertEqual(new_v.dtype, CV.dtype)


def _module(**kwargs):
  return aj.MultiHeadAttention(16, 4, num_kv_heads=2, rngs=nnx.Rngs(0),
                               **kwargs)


def _x(seed=0, b=2, t=6):
  return jax.random.normal(jax.random.key(seed), (b, t, 16))


@nnx.jit
def _decode(mha, x):
  return mha(x, decode=True)


def _absolute_key_bias(score, b, h, q_idx, kv_idx):
  # Depends on absolute key positions, not their differences: it sees
  # positions counted from each example's first real token or the test
  # below fails.
  del b, h, q_idx
  return score + 0.5 * jnp.cos(kv_idx.astype(score.dtype))


# Decoding against the full forward, both float32, the same maths over
# other shapes: only reduction order differs (as in test_modules_multi_head).
STEP_TOL = dict(atol=3e-6, rtol=3e-6)


class LeftPaddingTest(parameterized.TestCase):

  @parameterized.named_parameters(("ring_buffer", None), ("linear", 12))
  def test_a_left_padded_example_decodes_as_its_tokens_alone(
      self, max_length):
    # Example 1 is 2 pads (NaN: pads may hold anything) then the 10 tokens
    # of `alone`. Prefill of 5 (longer than the 4-slot ring), then 7 steps,
    # so the ring wraps twice; rotary positions and a score modifier of
    # absolute positions count from the first real token.
    mha = _module(rope=aj.Rope(base=100.0),
                  mask=aj.Mask(causal=True, window=(3, 0)),
                  score_mod=_absolute_key_bias)
    x = _x(seed=3, t=12)
    alone = x[1:, 2:]
    padded = x.at[1, :2].set(jnp.nan)
    mha.init_cache(2, max_length, left_padding=jnp.array([0, 2]))
    if max_length is None:
      self.assertEqual(mha.cached_key.shape[2], 4)  # W = window + 1 slots
    pieces = [_decode(mha, padded[:, :5])]
    pieces += [_decode(mha, padded[:, i:i + 1]) for i in range(5, 12)]
    got = jnp.concatenate(pieces, 1)
    chex.assert_trees_all_close(got[1, 2:], mha(alone, is_causal=True)[0],
                                **STEP_TOL)
    chex.assert_trees_all_close(got[0], mha(x[:1], is_causal=True)[0],
                                **STEP_TOL)
    np.testing.assert_array_equal(got[1, :2], 0.0)  # pad rows see nothing
    np.testing.assert_array_equal(mha.cache_index[...], [12, 12])
    mha.check_cache()

  def test_a_ring_buffer_points_dense_masks_to_left_padding(self):
    mha = _module(mask=aj.Mask(causal=True, window=(3, 0)))
    mha.init_cache(2)
    keep = jnp.ones((2, 1, 1, 4), bool)  # over the 4 slots
    with self.assertRaisesRegex(ValueError, r"a dense mask is not supported "
                                r"with a ring-buffer.*init_cache\(\.\.\., "
                                r"left_padding=pads\)"):
      mha(_x(t=5), mask=keep, decode=True)


_KV_LENGTHS = aj.Mask(kv_lengths=jnp.array([5, 3]))
_KEY_PADDING = jnp.array(  # [B, 1, 1, L] over the 8 slots
    [[True] * 8, [True] * 3 + [False] * 5])[:, None, None, :]
_HINT = (r"prefill of T=5 tokens without the mask's q_lengths .* in "
         r"examples \[1\] .*mask=aj.Mask\(q_lengths=lengths\)")


class RightPaddedPrefillTest(parameterized.TestCase):
  # Prompts of 5 and 3 tokens right-padded to T = 5, prefilled with a mask
  # that hides the pads as keys but no q_lengths: every token, pads too,
  # would be cached (cache_index [5, 5]).

  @parameterized.named_parameters(("kv_lengths", _KV_LENGTHS),
                                  ("key_padding_mask", _KEY_PADDING))
  def test_raises_with_the_fix_when_the_values_are_concrete(self, mask):
    mha = _module()
    mha.init_cache(2, 8)
    with self.assertRaisesRegex(ValueError, _HINT):
      mha(_x(t=5), mask=mask, decode=True)

  def test_a_layer_rule_does_not_hide_the_padding(self):
    # The mask stays analytic over the slots (a rule at positions beside
    # the key padding): the pads still show as hidden from their queries.
    mha = _module(mask=aj.Mask(causal=True, rule=aj.prefix_lm_mask_fn(2)))
    mha.init_cache(2, 8)
    with self.assertRaisesRegex(ValueError, _HINT):
      mha(_x(t=5), mask=_KEY_PADDING, decode=True)

  def test_concrete_kv_lengths_raise_under_jit_whatever_the_index(self):
    # The cache index is traced under jit, but a kv_lengths below T hides the
    # last token from any start.
    mha = _module()
    mha.init_cache(2, 8)
    with self.assertRaisesRegex(ValueError, _HINT):
      nnx.jit(lambda m, x: m(x, mask=_KV_LENGTHS, decode=True))(mha, _x(t=5))

  @parameterized.named_parameters(
      ("traced_kv_lengths", lambda n: aj.Mask(kv_lengths=n)),
      ("key_padding_mask", lambda n: _KEY_PADDING))  # traced index
  def test_under_jit_check_cache_reports_it(self, mask):
    mha = _module()
    mha.init_cache(2, 8)
    prefill = nnx.jit(lambda m, x, n: m(x, mask=mask(n), decode=True))
    prefill(mha, _x(t=5), jnp.array([5, 3]))
    np.testing.assert_array_equal(mha.cache_index[...], [5, 5])
    np.testing.assert_array_equal(mha.cache_pad_written[...], [False, True])
    _decode(mha, _x(t=1))  # single steps keep the flag
    with self.assertRaisesRegex(ValueError, r"examples \[1\] cached pad "
                                r"tokens.*mask=aj.Mask\(q_lengths=lengths\)"):
      mha.check_cache()

  def test_q_lengths_and_left_padding_are_not_flagged(self):
    mha = _module()
    mha.init_cache(2, 8)
    lengths = jnp.array([5, 3])
    mha(_x(t=5), mask=aj.Mask(q_lengths=lengths, kv_lengths=lengths),
        decode=True)
    np.testing.assert_array_equal(mha.cache_index[...], [5, 3])
    # Left padding hides the first slots, not the last token.
    mha.init_cache(2, 8)
    keep = jnp.array([[True] * 8, [False] * 2 + [True] * 6])
    mha(_x(t=5), mask=keep[:, None, None, :], decode=True)
    mha.check_cache()


if __name__ == "__main__":
  absltest.main()
