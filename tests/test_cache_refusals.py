"""Caches refuse what they cannot hold, at once, naming the argument.

A cache's dtype is checked when the cache is made (one check for every
``init_*cache``), a hand-built cache's fields at the entry that reads them,
a paged cache's row and length arguments while tracing when known and
under ``aj.checked`` when traced, and ``aj.paged_attention``'s mask must be
an ``aj.Mask``.
"""

from absl.testing import absltest
from absl.testing import parameterized
import chex
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.decoding import cache_step
from attention_jax.decoding import paged_cache as pc
from tests import _data

B, K, Z, M, H = 3, 1, 2, 4, 4  # sequences, kv heads, page size, pages, dim
DTYPE = (r"dtype must be a float dtype or one of \['float8_e4m3fn', "
         r"'int8'\], got ")


def _mha():
  return aj.MultiHeadAttention(8, 2, rngs=nnx.Rngs(0))


def _mla():
  return aj.MultiHeadLatentAttention(
      16, 2, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2,
      v_head_dim=4, rngs=nnx.Rngs(0))


def _filled():
  """A pool of 8 pages: sequence 0 holds 5 tokens, 1 holds 2, 2 is empty."""
  cache = pc.init_paged_cache(8, Z, K, H, B, M)
  kv = _data.normal(0, (B, K, 5, H))
  return pc.append(cache, kv, kv, new_lengths=jnp.array([5, 2, 0]))


class DtypeTest(parameterized.TestCase):
  """init_cache refuses what init_paged_cache refuses, with its words."""

  @parameterized.parameters("int4", jnp.int32, "bogus")
  def test_init_cache_refuses_at_once_as_init_paged_cache_does(self, dtype):
    with self.assertRaises(TypeError) as paged:
      _mha().init_paged_cache(2, num_pages=4, page_size=2, max_pages=2,
                              dtype=dtype)
    for layer in (_mha(), _mla()):
      with self.subTest(type(layer).__name__):
        with self.assertRaisesRegex(TypeError, DTYPE) as linear:
          layer.init_cache(2, 8, dtype=dtype)
        self.assertEqual(str(linear.exception), str(paged.exception))
        self.assertIsNone(getattr(layer, "cache_index", None))

  def test_the_int8_dtype_itself_is_a_quantised_cache_as_its_name_is(self):
    layer = _mha()
    layer.init_cache(2, 8, dtype=jnp.int8)
    self.assertEqual(layer.cached_key.dtype, jnp.int8)
    self.assertIsNotNone(layer.cache_key_scales)  # quantised, in pages
    out = layer(_data.normal(1, (2, 3, 8)), decode=True)
    self.assertEqual(out.shape, (2, 3, 8))

  @parameterized.parameters("int8", "int4")
  def test_a_cross_attention_memory_is_kept_in_a_float_dtype(self, dtype):
    with self.assertRaisesRegex(
        TypeError, "init_cross_cache .*dtype must be a float dtype, got "
        f"'{dtype}'"):
      _mha().init_cross_cache(_data.normal(2, (2, 3, 8)), dtype=dtype)


class PagedArgumentsTest(parameterized.TestCase):
  """take_rows / share_prefix: known values raise while tracing, traced
  ones under aj.checked; a valid call passes either way."""

  @parameterized.named_parameters(
      ("out_of_range", [1, 5], r"\[1 5\]"),
      ("negative", [-1], r"\[-1\]"),
      ("repeated", [2, 2], r"\[2 2\]"))
  def test_take_rows_traced(self, rows, shown):
    take = aj.checked(jax.jit(pc.take_rows))
    with self.assertRaisesRegex(
        ValueError, r"rows must be distinct sequences in \[0, B\) = "
        r"\[0, 3\), got " + shown):
      take(_filled(), jnp.array(rows))
    put = aj.checked(jax.jit(pc.put_rows))
    part = pc.take_rows(_filled(), jnp.arange(len(rows)))
    with self.assertRaisesRegex(ValueError, "rows must be distinct"):
      put(_filled(), part, jnp.array(rows))

  def test_take_rows_known_under_jit_raises_while_tracing(self):
    cache, rows = _filled(), jnp.array([0, 7])  # concrete, closed over
    with self.assertRaisesRegex(ValueError, r"got \[0, 7\]"):
      jax.jit(lambda: pc.take_rows(cache, rows))()

  def test_take_rows_valid_passes_checked(self):
    cache = _filled()
    part = aj.checked(jax.jit(pc.take_rows))(cache, jnp.array([1, 0]))
    self.assertEqual(part.lengths.tolist(), [2, 5])
    back = aj.checked(jax.jit(pc.put_rows))(cache, part, jnp.array([1, 0]))
    chex.assert_trees_all_equal(back, cache)

  @parameterized.named_parameters(
      ("length", 0, 2, 6, r"length must be in \[0, 5\] \(source 0 holds 5 "
       r"tokens\), got 6"),
      ("negative_length", 0, 2, -1, r"length must be in \[0, 5\].*got -1"),
      ("source", 3, 2, 1, r"source and target must be two different "
       r"sequences in \[0, B\) = \[0, 3\), got 3 and 2"),
      ("negative_target", 0, -1, 1, r"two different sequences .*got 0 and "
       r"-1"),
      ("same", 2, 2, 0, r"two different sequences .*got 2 and 2"),
      ("not_empty", 0, 1, 2, r"target 1 must be empty \(release it first\); "
       r"it holds 2 tokens"))
  def test_share_prefix(self, source, target, length, message):
    cache = _filled()
    args = tuple(jnp.int32(x) for x in (source, target, length))
    calls = {
        "traced, checked": lambda: aj.checked(jax.jit(pc.share_prefix))(
            cache, *args),
        "known under jit": jax.jit(  # closed over: concrete
            lambda: pc.share_prefix(cache, *args)),
        "eager": lambda: pc.share_prefix(cache, source, target, length)}
    for name, call in calls.items():
      with self.subTest(name), self.assertRaisesRegex(ValueError, message):
        call()
    with self.subTest("traced, unchecked: only target's flag changes"):
      out = jax.jit(pc.share_prefix)(cache, *args)
      for name in ("page_table", "lengths", "refcount"):
        np.testing.assert_array_equal(getattr(out, name),
                                      getattr(cache, name))
      flagged = np.zeros(B, bool)
      if 0 <= target < B:
        flagged[target] = True
      np.testing.assert_array_equal(out.overflow, flagged)

  def test_share_prefix_valid_passes_checked(self):
    out = aj.checked(jax.jit(pc.share_prefix))(
        _filled(), jnp.int32(0), jnp.int32(2), jnp.int32(3))
    self.assertEqual(out.lengths.tolist(), [5, 2, 3])
    self.assertFalse(out.overflow.any())


class PagedAttentionMaskTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("dense_array", jnp.ones((B, 2, 1, M * Z), bool),
       r"got ArrayImpl with shape \(3, 2, 1, 8\): a dense array cannot be "
       r"placed .*aj.Mask\(rule=...\)"),
      ("numpy_array", np.ones((B, 2, 1, M * Z), bool),
       r"got ndarray with shape \(3, 2, 1, 8\): a dense array"),
      ("function", lambda b, h, i, j: i >= j,
       r"got function: .*mask=aj.Mask\(rule=mask_fn\)"),
      ("mask_rule", aj.MaskRule(lambda b, h, i, j, p: i >= j, {}),
       r"got MaskRule: .*mask=aj.Mask\(rule=mask\)"),
      ("bool", True, r"got bool: e.g. mask=aj.Mask\(causal=True"))
  def test_a_mask_that_is_not_a_mask_is_named(self, mask, message):
    q = _data.normal(3, (B, 2, 1, H))
    with self.assertRaisesRegex(
        TypeError, r"mask must be an aj.Mask \(placed at each sequence's "
        r"positions\) or None, " + message):
      aj.paged_attention(q, _filled(), mask)

  def test_the_rule_in_a_mask_runs(self):
    q = _data.normal(3, (B, 2, 1, H))
    rule = aj.MaskRule(lambda b, h, i, j, p: i >= j, {})
    out = aj.paged_attention(q, _filled(), aj.Mask(rule=rule))
    # a rule of causality adds nothing to the cache's own placement
    np.testing.assert_allclose(out, aj.paged_attention(q, _filled()),
                               rtol=0, atol=0)  # the same walk, bitwise


def _paged_entries(q, kv):
  """Every entry that reads a paged cache, as ``name -> f(cache)``."""
  p = _data.params(aj.init_multi_head_params, 0, 8, 2, num_kv_heads=K)
  x = _data.normal(5, (B, 1, 8))
  return {
      "paged_attention": lambda c: aj.paged_attention(q, c),
      "append": lambda c: pc.append(c, kv, kv),
      "release": lambda c: pc.release(c, jnp.zeros(B, bool)),
      "share_prefix": lambda c: pc.share_prefix(c, 0, 2, 1),
      "take_rows": lambda c: pc.take_rows(c, jnp.array([0])),
      "check_overflow": pc.check_overflow,
      "multi_head_attention": lambda c: aj.multi_head_attention(
          p, x, x, x, cache=c),
  }


class HandBuiltCacheTest(parameterized.TestCase):
  """A hand-built cache's fields are checked where they enter."""

  @parameterized.named_parameters(
      ("lengths_shape", dict(lengths=jnp.zeros(B + 1, jnp.int32)),
       r"cache.lengths must be integer \[B\] = \[3\] .*got int32 \(4,\)"),
      ("lengths_float", dict(lengths=jnp.zeros(B)),
       r"cache.lengths must be integer \[B\] = \[3\] .*got float32 \(3,\)"),
      ("table_rank", dict(page_table=jnp.zeros(B, jnp.int32)),
       r"cache.page_table \[B, M\], got shapes .* and \(3,\)"),
      ("table_float", dict(page_table=jnp.zeros((B, M))),
       r"cache.page_table must be integer \[B, M\] = \[3, 4\]"),
      ("refcount", dict(refcount=jnp.zeros(7, jnp.int32)),
       r"cache.refcount must be integer \[P\] = \[8\] .*\(7,\)"),
      ("overflow", dict(overflow=jnp.zeros(B, jnp.int32)),
       r"cache.overflow must be bool \[B\] = \[3\] .*got int32"),
      ("nonfinite", dict(nonfinite=jnp.zeros(B, bool)),
       r"cache.nonfinite must be bool \[P\] = \[8\]"),
      ("value_pages", dict(value_pages=jnp.zeros((8, K, Z + 1, H))),
       r"cache.value_pages must be float \[P, K, Z, Hv\] = \[8, 1, 2, _\]"),
      ("int8_without_scales", dict(key_pages=jnp.zeros((8, K, Z, H),
                                                       jnp.int8)),
       r"cache.key_pages must be float \[P, K, Z, H\] .*got int8 "
       r"\(8, 1, 2, 4\) \(quantised pages come with key_scales\)"),
      ("scales", dict(key_scales=jnp.zeros((8, K, Z))),
       r"cache.key_pages must be int8 or float8_e4m3fn \[P, K, Z, H\] .*"
       r"got float32 \(8, 1, 2, 4\) \(key_scales are given\)"))
  def test_paged(self, fields, message):
    q, kv = _data.normal(3, (B, 2, 1, H)), _data.normal(4, (B, K, 1, H))
    bad = _filled()._replace(**fields)
    for name, entry in _paged_entries(q, kv).items():
      with self.subTest(name), self.assertRaisesRegex(ValueError, message):
        entry(bad)

  def test_paged_value_scales_go_with_value_pages(self):
    cache = pc.init_paged_cache(8, Z, K, H, B, M, dtype="int8")
    with self.assertRaisesRegex(ValueError, "cache.value_scales must be "
                                "given exactly when"):
      pc.append(cache._replace(value_scales=None), *[jnp.ones((B, K, 1, H))]
                * 2)

  @parameterized.named_parameters(
      ("index_shape", dict(index=jnp.zeros(B + 1, jnp.int32)), ValueError,
       r"cache.index must be an integer scalar shared by the batch or one "
       r"per example \[B\] = \[3\], got shape \(4,\)"),
      ("index_float", dict(index=jnp.zeros(B)), TypeError,
       r"cache.index must be an integer scalar or \[B\] array .*float32"),
      ("overflow", dict(overflow=jnp.zeros(B + 1, bool)), ValueError,
       r"cache.overflow must be bool \[B\] = \[3\] .*got bool \(4,\)"),
      ("pad_written", dict(pad_written=jnp.zeros(B, jnp.int32)), ValueError,
       r"cache.pad_written must be bool \[B\] = \[3\] .*got int32"),
      ("left_padding", dict(left_padding=jnp.int32(1)), ValueError,
       r"cache.left_padding must be integer \[B\] = \[3\] .*got int32 \(\)"),
      ("value", dict(value=jnp.zeros((B, 2, 6, 4))), ValueError,
       r"cache.key \(3, 2, 8, 4\) and cache.value \(3, 2, 6, 4\) must share"),
      ("key_rank", dict(key=jnp.zeros((B, 8, 4))), ValueError,
       r"cache.key must have rank 4 \(\[B, K, L, H\]\)"))
  def test_linear(self, fields, error, message):
    p = _data.params(aj.init_multi_head_params, 0, 8, 2)
    x = _data.normal(5, (B, 1, 8))
    good = cache_step.KVCache(jnp.zeros((B, 2, 8, 4)), jnp.zeros((B, 2, 8, 4)),
                              jnp.zeros(B, jnp.int32), jnp.zeros(B, bool))
    aj.multi_head_attention(p, x, x, x, cache=good)  # the good one runs
    for run in (lambda c: aj.multi_head_attention(p, x, x, x, cache=c),
                jax.jit(lambda c: aj.multi_head_attention(p, x, x, x,
                                                          cache=c))):
      with self.assertRaisesRegex(error, message):
        run(good._replace(**fields))

  def test_linear_cache_of_another_batch_is_named(self):
    p = _data.params(aj.init_multi_head_params, 0, 8, 2)
    x = _data.normal(5, (B + 1, 1, 8))
    cache = cache_step.KVCache(jnp.zeros((B, 2, 8, 4)),
                               jnp.zeros((B, 2, 8, 4)), jnp.zeros(B, jnp.int32))
    with self.assertRaisesRegex(ValueError, "B must equal the cache's batch "
                                "3"):
      aj.multi_head_attention(p, x, x, x, cache=cache)


if __name__ == "__main__":
  absltest.main()
