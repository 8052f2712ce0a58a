"""``MultiHeadAttention`` decoding from a paged cache, against the linear
cache and against generating each request alone.

The same layer (GQA, rotary positions, qk-norm, learned sinks, a soft cap,
a causal window) decodes a ragged batch from a paged cache and from a linear one:
every real row agrees. A finished sequence's pages are released and a new
request is admitted into its row while the other keeps decoding (a mixed
step: one row prefills, the other decodes), and the newcomer's outputs are
those of running it alone.
"""

import chex
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj

D, N, K, B = 16, 4, 2, 2
# float32 over <= 20 keys, two paths of different block order
TOL = dict(atol=2e-5, rtol=2e-5)


def _layer(seed=0, window=None, **options):
  mha = aj.MultiHeadAttention(
      D, N, num_kv_heads=K, rope=aj.Rope(base=100.0), normalize_qk=True,
      attention_sinks=True, logits_soft_cap=3.0,
      mask=aj.Mask(causal=True, window=window), rngs=nnx.Rngs(seed),
      **options)
  params = mha.params_dict()
  params["sinks"]["logits"] = params["sinks"]["logits"] + 0.3  # not zero
  mha.load_params(params)
  return mha


@nnx.jit
def _decode(m, x, n=None):
  """``m`` appends ``x [B, T, D]`` (``n [B]`` real per row, None: all)."""
  return m(x, decode=True, mask=None if n is None else aj.Mask(q_lengths=n))


def _tokens(seed, t, b=B):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(
      (b, t, D)), jnp.float32)


class PagedModuleTest(chex.TestCase):

  def test_a_ragged_batch_decodes_as_with_the_linear_cache(self):
    for window in (None, (4, 0)):
      linear, paged = _layer(window=window), _layer(window=window)
      linear.init_cache(B, max_length=16)
      paged.init_paged_cache(B, num_pages=9, page_size=3, max_pages=6)
      lengths = jnp.array([5, 2])
      prompt = _tokens(1, 5)
      want = _decode(linear, prompt, lengths)
      got = _decode(paged, prompt, lengths)
      for b, n in enumerate(lengths.tolist()):
        np.testing.assert_allclose(got[b, :n], want[b, :n], **TOL)
      for step in range(6):
        x = _tokens(10 + step, 1)
        np.testing.assert_allclose(_decode(paged, x), _decode(linear, x),
                                   **TOL,
                                   err_msg=f"window {window} step {step}")
      self.assertEqual(paged.cache_index[...].tolist(), [11, 8])
      # 11 and 8 tokens in pages of 3: 4 + 3 pages held
      self.assertEqual(int((paged.cache_refcount[...] > 0).sum()), 7)
      paged.check_cache()  # nothing overflowed

  def test_a_released_row_admits_a_request_that_decodes_as_alone(self):
    paged = _layer()
    paged.init_paged_cache(B, num_pages=6, page_size=2, max_pages=5)
    _decode(paged, _tokens(1, 4))  # two requests of 4 tokens
    paged.update_paged_cache(aj.paged_cache.release, jnp.array([True, False]))
    self.assertEqual(paged.cache_index[...].tolist(), [0, 4])
    # A mixed step: row 0 prefills a new 3-token prompt while row 1 decodes
    # one token (right-padded to T = 3).
    newcomer = _tokens(2, 3, b=1)
    x = jnp.concatenate([newcomer, _tokens(3, 3, b=1)])
    out = _decode(paged, x, jnp.array([3, 1]))
    follow = _tokens(4, 1, b=1)
    later = _decode(paged, jnp.concatenate([follow, follow]))
    alone = _layer()
    alone.init_cache(1, max_length=8)
    np.testing.assert_allclose(out[:1], _decode(alone, newcomer), **TOL)
    np.testing.assert_allclose(later[:1], _decode(alone, follow), **TOL)

  def test_a_shared_prompt_is_stored_once_and_read_by_both(self):
    paged = _layer()
    paged.init_paged_cache(B, num_pages=8, page_size=2, max_pages=4)
    prompt = _tokens(1, 5, b=1)
    _decode(paged, jnp.concatenate([prompt, prompt]), jnp.array([5, 0]))
    paged.update_paged_cache(aj.paged_cache.share_prefix, 0, 1, 5)
    self.assertEqual(int((paged.cache_refcount[...] > 0).sum()), 3)
    x = _tokens(2, 1)
    out = _decode(paged, x)
    alone = _layer()
    alone.init_cache(1, max_length=8)
    _decode(alone, prompt)
    for b in range(B):  # each continues the shared prompt with its token
      np.testing.assert_allclose(
          out[b:b + 1], _decode(_copy(alone), x[b:b + 1]), **TOL)

  def test_an_int8_cache_decodes_close_to_the_float_one(self):
    outs = {}
    for dtype in (jnp.float32, "int8"):
      paged = _layer()
      paged.init_paged_cache(B, num_pages=9, page_size=3, max_pages=6,
                             dtype=dtype)
      outs[str(dtype)] = [_decode(paged, _tokens(1, 5))]
      outs[str(dtype)] += [_decode(paged, _tokens(2 + i, 1))
                           for i in range(3)]
      self.assertEqual(paged.cached_key[...].dtype,
                       jnp.int8 if dtype == "int8" else jnp.float32)
    for f, q in zip(outs[str(jnp.float32)], outs["int8"]):
      # int8 keys/values within max|x| / 254 per entry; D = 16 outputs
      # move by a few 1e-3
      np.testing.assert_allclose(q, f, atol=2e-2)

  def test_a_quantised_linear_cache_is_kept_in_pages(self):
    linear, quantised = _layer(), _layer()
    linear.init_cache(B, max_length=12)
    quantised.init_cache(B, max_length=12, dtype="float8_e4m3fn")
    self.assertEqual(quantised.cached_key[...].dtype, jnp.float8_e4m3fn)
    self.assertEqual(quantised.cache_page_table[...].shape, (B, 1))
    lengths = jnp.array([5, 3])
    want = _decode(linear, _tokens(1, 5), lengths)
    got = _decode(quantised, _tokens(1, 5), lengths)
    # float8 keys/values: 3 mantissa bits, outputs within a few 1e-2
    np.testing.assert_allclose(got[0], want[0], atol=6e-2)
    np.testing.assert_allclose(got[1, :3], want[1, :3], atol=6e-2)
    with self.assertRaisesRegex(ValueError, "ring buffer .* not supported"):
      _layer(window=(3, 0)).init_cache(B, dtype="int8")
    with self.assertRaisesRegex(ValueError, "left_padding is not supported"):
      _layer().init_cache(B, 8, dtype="int8",
                          left_padding=jnp.zeros((B,), jnp.int32))

  def test_under_jit_and_overflow_is_reported(self):
    paged = _layer()
    paged.init_paged_cache(B, num_pages=3, page_size=2, max_pages=2)

    @nnx.jit
    def step(m, x):
      return m(x, decode=True)

    step(paged, _tokens(1, 3))  # 2 pages each: only the first fits
    self.assertEqual(paged.cache_index[...].tolist(), [3, 0])
    with self.assertRaisesRegex(ValueError, r"overflow in sequences \[1\]"):
      paged.check_cache()

  def test_a_call_over_some_rows_equals_the_full_batch_with_others_idle(self):
    # Row 1 prefills a 4-token prompt, computed alone (cache_rows) in one
    # layer and as a full-batch call with rows 0 and 2 idle in the other;
    # then every row decodes a token in both.
    full, part = _layer(), _layer()
    for m in (full, part):
      m.init_paged_cache(3, num_pages=9, page_size=2, max_pages=3)
      _decode(m, _tokens(1, 1, b=3))  # every row holds one token
    step = nnx.jit(lambda m, x, n, rows: m(
        x, decode=True, mask=aj.Mask(q_lengths=n), cache_rows=rows))
    prompt = _tokens(2, 4, b=1)
    want = _decode(full, jnp.concatenate([prompt] * 3), jnp.array([0, 4, 0]))
    got = step(part, prompt, jnp.array([4]), jnp.array([1]))
    np.testing.assert_allclose(got[0], want[1], **TOL)
    for name in ("cache_index", "cache_page_table", "cache_refcount",
                 "cached_key"):
      np.testing.assert_array_equal(getattr(part, name)[...],
                                    getattr(full, name)[...], err_msg=name)
    x = _tokens(3, 1, b=3)
    np.testing.assert_allclose(_decode(part, x), _decode(full, x), **TOL)
    # Rows 2 and 0, in that order: each its own sequence.
    two = _tokens(4, 2, b=2)
    got = step(part, two, jnp.array([2, 1]), jnp.array([2, 0]))
    want = _decode(full, jnp.concatenate([two[1:], two[1:], two[:1]]),
                   jnp.array([1, 0, 2]))
    np.testing.assert_allclose(got[0], want[2], **TOL)
    np.testing.assert_allclose(got[1, :1], want[0, :1], **TOL)
    self.assertEqual(part.cache_index[...].tolist(), [3, 6, 4])
    part.check_cache()

  def test_cache_rows_refuses_repeats_and_flags_them_under_jit(self):
    paged = _layer()
    paged.init_paged_cache(3, num_pages=9, page_size=2, max_pages=3)
    x = _tokens(1, 1)
    with self.assertRaisesRegex(ValueError, r"distinct sequences in \[0, B\) "
                                r"= \[0, 3\), got \[1, 1\]"):
      paged(x, decode=True, cache_rows=jnp.array([1, 1]))
    with self.assertRaisesRegex(ValueError, "got \\[3\\]"):
      paged(x[:1], decode=True, cache_rows=jnp.array([3]))
    nnx.jit(lambda m, x, r: m(x, decode=True, cache_rows=r))(
        paged, x, jnp.array([1, 1]))
    # The first mention wrote its token; the repeat wrote nothing.
    self.assertEqual(paged.cache_index[...].tolist(), [0, 1, 0])
    self.assertEqual(int((paged.cache_refcount[...] > 0).sum()), 1)
    with self.assertRaisesRegex(ValueError, r"overflow in sequences \[1\]"):
      paged.check_cache()
    linear = _layer()
    linear.init_cache(B, max_length=4)
    with self.assertRaisesRegex(ValueError, "cache_rows picks sequences of "
                                "a paged cache"):
      linear(x, decode=True, cache_rows=jnp.array([0]))

  def test_what_a_paged_step_cannot_take_is_refused_by_name(self):
    paged = _layer()
    paged.init_paged_cache(B, num_pages=4, page_size=2, max_pages=2)
    x = _tokens(1, 1)
    with self.assertRaisesRegex(ValueError, "return_weights is not supported"):
      paged(x, decode=True, return_weights=True)
    with self.assertRaisesRegex(ValueError, "bias is not supported"):
      paged(x, decode=True, bias=jnp.zeros((B, N, 1, 4)))
    custom = _layer(attention_fn=aj.scaled_dot_product_attention)
    custom.init_paged_cache(B, num_pages=4, page_size=2, max_pages=2)
    with self.assertRaisesRegex(ValueError, "stay in its pages"):
      custom(x, decode=True)


def _copy(module):
  """A copy of ``module`` with its cache (each branch decodes on its own)."""
  graphdef, state = nnx.split(module)
  return nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
