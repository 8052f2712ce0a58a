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
      mask = aj.Mask(q_lengths=lengths)
      want = linear(prompt, decode=True, mask=mask)
      got = paged(prompt, decode=True, mask=mask)
      for b, n in enumerate(lengths.tolist()):
        np.testing.assert_allclose(got[b, :n], want[b, :n], **TOL)
      for step in range(6):
        x = _tokens(10 + step, 1)
        np.testing.assert_allclose(paged(x, decode=True),
                                   linear(x, decode=True), **TOL,
                                   err_msg=f"window {window} step {step}")
      self.assertEqual(paged.cache_index[...].tolist(), [11, 8])
      # 11 and 8 tokens in pages of 3: 4 + 3 pages held
      self.assertEqual(int((paged.cache_refcount[...] > 0).sum()), 7)
      paged.check_cache()  # nothing overflowed

  def test_a_released_row_admits_a_request_that_decodes_as_alone(self):
    paged = _layer()
    paged.init_paged_cache(B, num_pages=6, page_size=2, max_pages=5)
    paged(_tokens(1, 4), decode=True)  # two requests of 4 tokens
    paged.update_paged_cache(aj.paged_cache.release, jnp.array([True, False]))
    self.assertEqual(paged.cache_index[...].tolist(), [0, 4])
    # A mixed step: row 0 prefills a new 3-token prompt while row 1 decodes
    # one token (right-padded to T = 3).
    newcomer = _tokens(2, 3, b=1)
    x = jnp.concatenate([newcomer, _tokens(3, 3, b=1)])
    out = paged(x, decode=True, mask=aj.Mask(q_lengths=jnp.array([3, 1])))
    follow = _tokens(4, 1, b=1)
    later = paged(jnp.concatenate([follow, follow]), decode=True)
    alone = _layer()
    alone.init_cache(1, max_length=8)
    np.testing.assert_allclose(out[:1], alone(newcomer, decode=True), **TOL)
    np.testing.assert_allclose(later[:1], alone(follow, decode=True), **TOL)

  def test_a_shared_prompt_is_stored_once_and_read_by_both(self):
    paged = _layer()
    paged.init_paged_cache(B, num_pages=8, page_size=2, max_pages=4)
    prompt = _tokens(1, 5, b=1)
    paged(jnp.concatenate([prompt, prompt]), decode=True,
          mask=aj.Mask(q_lengths=jnp.array([5, 0])))
    paged.update_paged_cache(aj.paged_cache.share_prefix, 0, 1, 5)
    self.assertEqual(int((paged.cache_refcount[...] > 0).sum()), 3)
    x = _tokens(2, 1)
    out = paged(x, decode=True)
    alone = _layer()
    alone.init_cache(1, max_length=8)
    alone(prompt, decode=True)
    for b in range(B):  # each continues the shared prompt with its token
      np.testing.assert_allclose(
          out[b:b + 1], _copy(alone)(x[b:b + 1], decode=True), **TOL)

  def test_an_int8_cache_decodes_close_to_the_float_one(self):
    outs = {}
    for dtype in (jnp.float32, "int8"):
      paged = _layer()
      paged.init_paged_cache(B, num_pages=9, page_size=3, max_pages=6,
                             dtype=dtype)
      outs[str(dtype)] = [paged(_tokens(1, 5), decode=True)]
      outs[str(dtype)] += [paged(_tokens(2 + i, 1), decode=True)
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
    mask = aj.Mask(q_lengths=jnp.array([5, 3]))
    want = linear(_tokens(1, 5), decode=True, mask=mask)
    got = quantised(_tokens(1, 5), decode=True, mask=mask)
    # float8 keys/values: 3 mantissa bits, outputs within a few 1e-2
    np.testing.assert_allclose(got[0], want[0], atol=6e-2)
    np.testing.assert_allclose(got[1, :3], want[1, :3], atol=6e-2)
    with self.assertRaisesRegex(ValueError, "ring buffer .* not supported"):
      _layer(window=(3, 0)).init_cache(B, dtype="int8")

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
