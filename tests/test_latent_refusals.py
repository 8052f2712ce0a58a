"""The latent layer refuses, or runs, as the multi-head layer does.

What used to pass silently or blame the wrong thing in MLA
(``aj.init_latent_cache``, ``aj.latent_decode``,
``MultiHeadLatentAttention``): a cache dtype no linear latent cache can
hold (``"int4"`` accepted, ``"int8"`` rounding every latent), a hand-built
cache whose ``index``, ``overflow`` or paged ``lengths`` has the wrong
shape (a broadcasting error deep inside), a mis-sized param loaded into a
module (another entry blamed), and a module ``scale`` given as a concrete
float scalar array (refused, where ``MultiHeadAttention`` takes it; the
functions now take scalar arrays, traced ones too, as
``aj.multi_head_attention`` does).
"""

import dataclasses
import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.layers import latent
from tests import _data

D, N, RQ = 16, 2, 8
SIZES = dict(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2,
             v_head_dim=4)
R_HR = 8 + 2  # the width of a cached token, [c_kv, k_pe]
B, L, T = 2, 4, 3
EXACT = dict(atol=0, rtol=0)  # the same float32 program: bitwise equal
# A traced scale is folded into the queries rather than the scores: one
# float32 rounding moved, a few 1e-8 on these O(1) outputs.
FOLDED = dict(atol=1e-6, rtol=1e-6)
_ZEROS = nnx.initializers.zeros_init()


def _params(seed=0):
  return _data.params(latent.init_latent_params, seed, D, N, q_lora_rank=RQ,
                      **SIZES)


def _module(**kwargs):
  """Zero initialisers (no sampler compiled), then pool-drawn params."""
  mla = aj.MultiHeadLatentAttention(D, N, q_lora_rank=RQ, rngs=nnx.Rngs(0),
                                    kernel_init=_ZEROS, **SIZES, **kwargs)
  mla.load_params(_params())
  return mla


def _x(seed=1, t=T):
  return _data.normal(seed, (B, t, D))


class DtypeTest(parameterized.TestCase):
  """init_latent_cache's dtype: paged_cache.storage_dtype's check and words."""

  @parameterized.parameters("int4", jnp.int32, "bogus")
  def test_what_no_cache_stores_is_refused_as_the_paged_cache_refuses(
      self, dtype):
    with self.assertRaises(TypeError) as paged:
      aj.init_paged_latent_cache(_params(), B, num_pages=4, page_size=2,
                                 max_pages=2, dtype=dtype)
    with self.assertRaisesRegex(
        TypeError, r"dtype must be a float dtype or one of "
        r"\['float8_e4m3fn', 'int8'\], got ") as linear:
      aj.init_latent_cache(_params(), B, L, dtype=dtype)
    self.assertEqual(str(linear.exception), str(paged.exception))

  @parameterized.parameters(("int8", "int8"), (jnp.int8, "int8"),
                            ("float8_e4m3fn", "float8_e4m3fn"))
  def test_a_quantised_dtype_names_the_paged_cache_that_keeps_it(
      self, dtype, name):
    params = _params()
    with self.assertRaisesRegex(
        TypeError, r"init_latent_cache keeps c_kv and k_pe as they are: "
        r"dtype must be a float dtype.*init_paged_latent_cache\(params, B, "
        rf"dtype='{name}', \*\*aj.paged_cache.linear_pages\('{name}', B, "
        r"L\)\)"):
      aj.init_latent_cache(params, B, L, dtype=dtype)
    # The call the message gives is a real one: room for L tokens a row.
    cache = aj.init_paged_latent_cache(
        params, B, dtype=name, **aj.paged_cache.linear_pages(name, B, L))
    self.assertEqual(cache.key_pages.dtype, jnp.dtype(name))
    self.assertEqual(cache.max_pages * cache.page_size, L)

  def test_float_dtypes_are_kept(self):
    params = _params()
    self.assertEqual(aj.init_latent_cache(params, B, L).latent.dtype,
                     jnp.float32)  # W_dkv's
    cache = aj.init_latent_cache(params, B, L, dtype=jnp.bfloat16)
    self.assertEqual((cache.latent.dtype, cache.rope_key.dtype),
                     (jnp.bfloat16, jnp.bfloat16))


class HandBuiltCacheTest(parameterized.TestCase):
  """A cache's fields are checked before latent_decode reads them, eagerly
  and under jit alike (shapes and dtypes are known while tracing)."""

  @parameterized.named_parameters(
      ("index_shape", dict(index=jnp.zeros((3,), jnp.int32)), ValueError,
       r"cache.index must be an integer scalar shared by the batch or one "
       r"per example \[B\] = \[2\], got shape \(3,\)"),
      ("index_dtype", dict(index=jnp.zeros((B,))), TypeError,
       r"cache.index must be an integer scalar or \[B\] array.*got dtype "
       r"float32"),
      ("overflow_shape", dict(overflow=jnp.zeros((3,), bool)), ValueError,
       r"cache.overflow must be bool \[B\] = \[2\] \(B from x and "
       r"cache.latent \(2, 4, 8\)\), or None, got bool \(3,\)"),
      ("overflow_dtype", dict(overflow=jnp.zeros((B,), jnp.int32)),
       ValueError, r"cache.overflow must be bool \[B\] = \[2\].*got int32 "
       r"\(2,\)"),
      ("latent_dtype", dict(latent=jnp.zeros((B, L, 8), jnp.int8)),
       TypeError, r"cache.latent must be a real floating-point array, got "
       r"dtype int8"))
  def test_a_linear_cache(self, fields, error, message):
    params = _params()
    cache = dataclasses.replace(aj.init_latent_cache(params, B, L), **fields)
    for name, decode in (("eager", aj.latent_decode),
                         ("jit", jax.jit(aj.latent_decode))):
      with self.subTest(name), self.assertRaisesRegex(error, message):
        decode(params, _x(), cache)

  def test_a_shared_scalar_index_is_every_row_s(self):
    params = _params()
    cache = aj.init_latent_cache(params, B, L)
    step = jax.jit(aj.latent_decode)
    want, _ = step(params, _x(), dataclasses.replace(
        cache, index=jnp.ones((B,), jnp.int32)))
    got, written = step(params, _x(), dataclasses.replace(
        cache, index=jnp.int32(1)))
    chex.assert_trees_all_close(got, want, **EXACT)
    self.assertEqual(written.index.tolist(), [1 + T] * B)

  @parameterized.named_parameters(
      ("lengths", dict(lengths=jnp.zeros((3,), jnp.int32)),
       r"cache.lengths must be integer \[B\] = \[2\] .*got int32 \(3,\)"),
      ("overflow", dict(overflow=jnp.zeros((B,), jnp.int32)),
       r"cache.overflow must be bool \[B\] = \[2\] .*got int32 \(2,\)"),
      ("refcount", dict(refcount=jnp.zeros((5,), jnp.int32)),
       r"cache.refcount must be integer \[P\] = \[4\] .*got int32 \(5,\)"))
  def test_a_paged_cache(self, fields, message):
    params = _params()
    cache = aj.init_paged_latent_cache(
        params, B, num_pages=4, page_size=2, max_pages=2)._replace(**fields)
    for name, decode in (("eager", aj.latent_decode),
                         ("jit", jax.jit(aj.latent_decode))):
      with self.subTest(name), self.assertRaisesRegex(ValueError, message):
        decode(params, _x(), cache)


class LoadParamsTest(parameterized.TestCase):
  """load_params names the entry that differs from the module, with both
  shapes, before the params are compared among themselves."""

  @parameterized.named_parameters(
      # W_dkv two columns wider: Hr read as 4 made every query kernel
      # disagree, and W_uq/W_ukv/W_o were blamed.
      ("W_dkv", "W_dkv", (D, R_HR + 2),
       r"params\['W_dkv'\]\['kernel'\] has shape \(16, 12\), but this "
       r"module's is \(16, 10\) \(kernel \[D, R \+ Hr\], bias \[R \+ Hr\]; "
       r"d_model=16, num_heads=2, q_lora_rank=8, kv_lora_rank=8, "
       r"qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4, "
       r"out_features=16\)"),
      # W_uq with 3 heads: N disagreed with W_ukv, both named.
      ("W_uq", "W_uq", (RQ, 3, 6),
       r"params\['W_uq'\]\['kernel'\] has shape \(8, 3, 6\), but this "
       r"module's is \(8, 2, 6\) \(kernel \[Rq, N, Hn \+ Hr\]"))
  def test_the_wrong_entry_is_named(self, name, shape, message):
    params = _params()
    params[name] = {"kernel": jnp.ones(shape)}
    mla = _module()
    before = jax.tree.map(np.asarray, mla.params_dict())
    with self.assertRaisesRegex(ValueError, message):
      mla.load_params(params)
    chex.assert_trees_all_equal(mla.params_dict(), before)  # untouched

  def test_a_bias_the_module_lacks_is_named_with_its_fix(self):
    params = _params()
    params["W_o"]["bias"] = jnp.zeros((D,))
    with self.assertRaisesRegex(
        ValueError, r"params\['W_o'\] has a 'bias', but this module's W_o "
        r"has none \(use_bias=False\): build it with use_bias=True"):
      _module().load_params(params)


class ScaleTest(parameterized.TestCase):
  """A module's scale as MultiHeadAttention's (multi_head_config
  .static_scale); the functions' as aj.multi_head_attention's."""

  @parameterized.named_parameters(
      ("jax", jnp.float32(0.3)), ("numpy_0d", np.asarray(0.3, np.float32)),
      ("numpy_scalar", np.float32(0.3)))
  def test_a_concrete_float_scalar_is_its_float(self, scale):
    mla = _module(scale=scale)
    self.assertIs(type(mla.scale), float)
    self.assertEqual(mla.scale, float(np.float32(0.3)))
    forward = nnx.jit(lambda m, x: m(x, is_causal=True))
    want = forward(_module(scale=float(np.float32(0.3))), _x())
    chex.assert_trees_all_close(forward(mla, _x()), want, **EXACT)
    # The scale reaches the numbers (so the comparison above could fail).
    self.assertGreater(float(jnp.abs(forward(_module(), _x()) - want).max()),
                       1e-3)

  def test_refused(self):
    def build(s):
      _module(scale=s)
      return s
    with self.assertRaisesRegex(
        TypeError, r"scale is a traced value: a module's scale is static "
        r"configuration"):
      jax.jit(build)(jnp.float32(0.3))
    with self.assertRaisesRegex(TypeError, r"float scalar array \(shape "
                                r"\(\)\), got an array of dtype float32 "
                                r"with shape \(2,\)"):
      _module(scale=jnp.full((2,), 0.3))
    with self.assertRaisesRegex(ValueError, "scale must be positive"):
      _module(scale=jnp.float32(-0.3))

  def test_the_functions_take_concrete_and_traced_scalar_arrays(self):
    params, x = _params(), _x(t=L)
    linear = aj.init_latent_cache(params, B, L)
    paged = aj.init_paged_latent_cache(params, B, num_pages=4, page_size=2,
                                       max_pages=2)
    concrete = jnp.float32(0.3)
    for name, run in (
        ("forward", lambda s: aj.latent_attention(params, x, is_causal=True,
                                                  scale=s)),
        ("linear", lambda s: aj.latent_decode(params, x, linear, scale=s)[0]),
        ("paged", lambda s: aj.latent_decode(params, x, paged, scale=s)[0])):
      # Bound by partial, not passed: a Python float stays static, the
      # array concrete.
      want = jax.jit(functools.partial(run, 0.3))()
      with self.subTest(name):
        chex.assert_trees_all_close(
            jax.jit(functools.partial(run, concrete))(), want, **FOLDED)
        chex.assert_trees_all_close(jax.jit(run)(concrete), want, **FOLDED)
    with self.assertRaisesRegex(ValueError, "scale must be positive"):
      aj.latent_attention(params, x, scale=jnp.float32(-0.3))
    with self.assertRaisesRegex(ValueError, "scale must be positive"):
      aj.checked(jax.jit(lambda s: aj.latent_decode(
          params, x, linear, scale=s)[0]))(jnp.float32(np.nan))


if __name__ == "__main__":
  absltest.main()
