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
              value=NEW_V)
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
    ("per_example_index", _with(index=jnp.array([1, 2], jnp.int32)),
     ValueError, r"index must be an integer scalar shared by the batch, got "
     r"shape \(2,\) \(the cache has batch B = 2\): per-example positions are "
     r"not supported by update_kv_cache"),
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

  def test_traced_negative_index_fails_at_run_time(self):
    # A jit argument is not known at trace time; the host callback refuses
    # it when the program runs instead of clamping the write to slot 0.
    update = jax.jit(aj.update_kv_cache)
    with self.assertRaisesRegex(Exception, r"index must be non-negative"):
      jax.block_until_ready(update(CK, CV, jnp.int32(-1), NEW_K, NEW_V))

  def test_traced_overflow_fails_at_run_time(self):
    update = jax.jit(aj.update_kv_cache)
    with self.assertRaisesRegex(Exception, r"KV cache overflow: 6 positions"):
      jax.block_until_ready(update(CK, CV, jnp.int32(6), NEW_K, NEW_V))


def _numpy_update(ck, cv, index, k, v):
  ck, cv = np.array(ck), np.array(cv)
  t = k.shape[2]
  ck[:, :, index:index + t] = k
  cv[:, :, index:index + t] = v
  visible = np.arange(ck.shape[2])[None, :] <= index + np.arange(t)[:, None]
  return ck, cv, visible


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

  def test_new_values_are_cast_to_the_cache_dtype(self):
    ck = jnp.zeros((B, K, L, H), jnp.bfloat16)
    new_k, new_v, _ = aj.update_kv_cache(ck, CV, 0, NEW_K, NEW_V)
    self.assertEqual(new_k.dtype, jnp.bfloat16)
    self.assertEqual(new_v.dtype, CV.dtype)


if __name__ == "__main__":
  absltest.main()
