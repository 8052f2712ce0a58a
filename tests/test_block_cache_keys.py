"""The tuned-blocks cache key (``kernels/block_cache.py``): calls whose best
blocks may differ never share an entry, calls running the same program do.

A shared entry is a silent wrong answer of its own: a grouped-query call
would run blocks timed for a multi-head one, a window of 200 blocks timed
for a window of 16 (where most blocks are skipped). Each test stores an
entry for one call and looks up another through ``aj.kernels.flash_blocks``
(nothing is timed), with the cache in a temporary directory.

Shape glossary: B batch, N query heads, K key/value heads, T length, H
head dim.
"""

import os
import pathlib
import tempfile
from unittest import mock

from absl.testing import absltest
import jax
import jax.numpy as jnp

import attention_jax as aj
from attention_jax.kernels import base
from attention_jax.kernels import block_cache
from attention_jax.masking import mask as mask_lib
from tests import _data

B, N, T, H = 1, 4, 256, 16


def _qkv(k_heads=N, t=T):
  q = _data.normal(0, (B, N, t, H), jnp.float32)
  k, v = (_data.normal(s, (B, k_heads, t, H), jnp.float32) for s in (1, 2))
  return q, k, v


def _problem(q, k, v, mask=None, **options):
  return base.canonicalize(q, k, v, mask_lib.as_mask(mask), **options)


class CacheKeyTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    tmp = tempfile.TemporaryDirectory()
    self.addCleanup(tmp.cleanup)
    env = mock.patch.dict(os.environ, {
        block_cache.ENV: str(pathlib.Path(tmp.name) / "tuned")})
    env.start()
    self.addCleanup(env.stop)
    block_cache.forget()
    self.addCleanup(block_cache.forget)

  def stored_for(self, problem, blocks=(32, 64)):
    block_cache.store(block_cache.cache_key(problem),
                      {"blocks": list(blocks)})

  def test_key_value_head_count_is_in_the_key(self):
    # Multi-head (K = N), grouped (K = 2) and multi-query (K = 1): the same
    # query heads, a key/value block shared by N / K of them.
    calls = {k: _qkv(k_heads=k) for k in (N, 2, 1)}
    keys = {k: block_cache.cache_key(_problem(*qkv))
            for k, qkv in calls.items()}
    self.assertLen(set(keys.values()), 3)
    self.stored_for(_problem(*calls[N]))
    self.assertEqual(aj.kernels.flash_blocks(*calls[N]), (32, 64, "cache"))
    for k in (2, 1):
      with self.subTest(kv_heads=k):
        self.assertEqual(aj.kernels.flash_blocks(*calls[k]).source,
                         "defaults")

  def test_window_size_is_in_the_key(self):
    q, k, v = _qkv()
    window = lambda left, right=0: aj.Mask(causal=True,
                                           window=(left, right))
    self.stored_for(_problem(q, k, v, window(16)))
    self.assertEqual(aj.kernels.flash_blocks(q, k, v, window(16)),
                     (32, 64, "cache"))
    for other in (window(200), window(16, 4), aj.Mask(causal=True)):
      with self.subTest(other=other.window):
        self.assertEqual(aj.kernels.flash_blocks(q, k, v, other).source,
                         "defaults")

  def test_score_modifier_is_in_the_key_by_name(self):
    q, k, v = _qkv()
    cap, slopes = aj.soft_cap(30.0), aj.alibi(aj.alibi_slopes(N))
    key = lambda mod: block_cache.cache_key(_problem(q, k, v,
                                                     score_mod=mod))
    plain = lambda s, b, h, i, j: s * 2.0
    names = {"cap": key(cap), "alibi": key(slopes), "none": key(None),
             "chain": key(aj.chain(slopes, cap)), "plain": key(plain),
             "plain_chain": key(aj.chain(plain, cap))}
    self.assertLen(set(names.values()), len(names))
    # The same function with other static values is the same work per
    # entry: one entry (and one name in every process: no object ids).
    self.assertEqual(key(aj.soft_cap(50.0)), names["cap"])
    self.assertEqual(key(aj.alibi(2 * aj.alibi_slopes(N))), names["alibi"])
    self.assertIn("_SoftCap", names["cap"])
    self.assertNotRegex(names["plain"], r"0x[0-9a-f]+")

  def test_dropout_is_in_the_key(self):
    # autotune times calls without dropout; one with it draws a hash per
    # entry (again in the backward) and must not run those blocks.
    q, k, v = _qkv()
    plain = block_cache.cache_key(_problem(q, k, v))
    dropping = block_cache.cache_key(_problem(
        q, k, v, dropout_rate=0.1, dropout_rng=jax.random.key(0)))
    self.assertNotEqual(plain, dropping)
    self.assertIn("dropout=True", dropping)
    # A rate of 0 is no dropout (canonicalize drops the key): one entry.
    self.assertEqual(plain, block_cache.cache_key(_problem(
        q, k, v, dropout_rate=0.0)))

  def test_the_same_program_shares_an_entry(self):
    # B and N count as their product (one single-head walk per index).
    q, k, v = _qkv()
    self.stored_for(_problem(q, k, v, aj.Mask(causal=True)))
    swapped = [x.reshape(N, B, T, H) for x in (q, k, v)]
    self.assertEqual(aj.kernels.flash_blocks(*swapped, is_causal=True),
                     (32, 64, "cache"))


if __name__ == "__main__":
  absltest.main()
