"""Attention read through a paged cache against a float64 model of the
sequences, over random request schedules; and what it refuses.

The schedules mix ragged appends (some sequences idle), releases (their
pages return to the pool and are handed out again, stale tokens and all)
and prefix shares (copy on write). After every append, each sequence's
newest tokens attend, through its page table, over what it holds: the
answer must be the float64 softmax over the model's list of its keys
(causal, optionally windowed, at its positions), whatever pages hold
them. The pool starts as NaN, so a slot or page a row may not see that
reached it would show.
"""

import chex
import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.decoding import paged_cache as pc

B, N, K, Z, M, T, H = 3, 2, 1, 2, 4, 3, 4  # sequences, heads, page size, ...
P = 7  # fewer pages than B * M: sequences compete for them


def _attend(window, block_k):
  mask = aj.Mask(causal=True, window=window)
  kernel = aj.kernels.Flash(block_k=block_k)

  @jax.jit
  def step(cache, q, k, v, n):
    cache = pc.append(cache, k, v, new_lengths=n)
    out = aj.paged_attention(q, cache, mask & aj.Mask(q_lengths=n),
                             implementation=kernel)
    return cache, out

  return step


# Key blocks of the flash walk: one page (the default: a slice of the
# pool), a row's 4 pages in one block (gathered), 3 pages (the row of 4
# padded to 6 "no page" entries: 2 blocks).
_BLOCK_K = (None, M * Z, 3 * Z)
_STEPS = {(w, bk): _attend(w, bk) for w in (None, (2, 0)) for bk in _BLOCK_K}
_release = jax.jit(pc.release)
_share = jax.jit(pc.share_prefix)


def _reference(q, keys, values, window):
  """float64 ``[N, n, H]``: ``q [N, n, H]`` (the last ``n`` of the ``L``
  tokens ``keys``/``values [L, H]``) causal, windowed, one KV head."""
  n, length = q.shape[1], len(keys)
  pos = length - n + np.arange(n)[:, None]  # [n, 1]
  j = np.arange(length)[None, :]
  ok = j <= pos
  if window is not None:
    ok &= j >= pos - window[0]
  logits = np.einsum("tnh,sh->nts", np.swapaxes(q, 0, 1), keys) / np.sqrt(H)
  logits = np.where(ok, logits, -np.inf)
  w = np.exp(logits - logits.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  return np.einsum("nts,sh->nth", w, values)


class PagedAttentionTest(chex.TestCase):

  @hypothesis.settings(max_examples=12, deadline=None)
  @hypothesis.given(
      window=st.sampled_from([None, (2, 0)]),
      block_k=st.sampled_from(_BLOCK_K),
      seed=st.integers(0, 2**16),
      schedule=st.lists(st.tuples(
          st.sampled_from(["append", "append", "append", "release",
                           "share"]),
          st.lists(st.integers(0, T), min_size=B, max_size=B),
          st.integers(0, B - 1), st.integers(0, B - 1),
          st.integers(0, M * Z)), min_size=1, max_size=8))
  def test_equals_the_sequences_attention_over_random_schedules(
      self, window, block_k, seed, schedule):
    rng = np.random.default_rng(seed)
    cache = pc.init_paged_cache(P, Z, K, H, B, M)
    cache = cache._replace(key_pages=jnp.full_like(cache.key_pages, jnp.nan),
                           value_pages=jnp.full_like(cache.value_pages,
                                                     jnp.nan))
    keys = [np.zeros((0, H)) for _ in range(B)]  # the model: what each holds
    values = [np.zeros((0, H)) for _ in range(B)]
    for op, counts, src, dst, length in schedule:
      if op == "append":
        k, v = (rng.standard_normal((B, K, T, H)).astype(np.float32)
                for _ in range(2))
        q = rng.standard_normal((B, N, T, H)).astype(np.float32)
        n = np.array(counts, np.int32)
        cache, out = _STEPS[window, block_k](
            cache, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
            jnp.asarray(n))
        for b in range(B):
          if cache.overflow[b]:  # no room: nothing written (model unchanged)
            cache = _release(cache, jnp.arange(B) == b)
            keys[b], values[b] = keys[b][:0], values[b][:0]
            continue
          keys[b] = np.concatenate([keys[b], k[b, 0, :n[b]]])
          values[b] = np.concatenate([values[b], v[b, 0, :n[b]]])
          if n[b]:
            want = _reference(np.asarray(q[b, :, :n[b]], np.float64),
                              keys[b], values[b], window)
            # float32 attention over <= 12 keys against float64
            np.testing.assert_allclose(out[b, :, :n[b]], want, atol=2e-6,
                                       rtol=2e-6, err_msg=f"sequence {b}")
      elif op == "release":
        cache = _release(cache, jnp.arange(B) == src)
        keys[src], values[src] = keys[src][:0], values[src][:0]
      elif src != dst and not len(keys[dst]) and length <= len(keys[src]):
        cache = _share(cache, jnp.int32(src), jnp.int32(dst),
                       jnp.int32(length))
        keys[dst], values[dst] = keys[src][:length], values[src][:length]

  def test_a_shared_prompt_is_read_by_both_holders(self):
    rng = np.random.default_rng(0)
    cache = pc.init_paged_cache(8, Z, K, H, B, M)
    prompt = jnp.asarray(rng.standard_normal((B, K, 3, H)), jnp.float32)
    cache = pc.append(cache, prompt, -prompt, new_lengths=jnp.array([3, 0, 0]))
    cache = pc.share_prefix(cache, 0, 1, 3)
    q = jnp.broadcast_to(jnp.asarray(rng.standard_normal((N, 3, H)),
                                     jnp.float32), (B, N, 3, H))
    out = aj.paged_attention(q, cache, aj.Mask(
        causal=True, q_lengths=jnp.array([3, 3, 0])))
    # Sequence 1 holds sequence 0's pages: the same keys, the same answer.
    np.testing.assert_array_equal(out[0], out[1])
    self.assertEqual(int(cache.refcount[cache.page_table[0, 0]]), 2)

  def test_other_kernels_refuse_pages_by_name(self):
    cache = pc.init_paged_cache(4, Z, K, H, 1, M)
    x = jnp.ones((1, K, 2, H))
    cache = pc.append(cache, x, x)
    q = jnp.ones((1, N, 1, H))
    for name in ("dense", "cudnn", "splash", "pallas_gpu"):  # (no pages)
      with self.assertRaisesRegex(ValueError, r"does not implement [a-z_, ]*\bpages\b"):
        aj.paged_attention(q, cache, implementation=name)
    with self.assertRaisesRegex(ValueError, "block_k=3 is not a multiple "
                                "of the page size 2"):
      aj.paged_attention(q, cache, implementation=aj.kernels.Flash(block_k=3))

  def test_what_the_cache_says_is_not_taken_from_the_mask(self):
    cache = pc.init_paged_cache(4, Z, K, H, 1, M)
    x = jnp.ones((1, K, 2, H))
    cache = pc.append(cache, x, x)
    q = jnp.ones((1, N, 1, H))
    with self.assertRaisesRegex(ValueError, "lengths say how many keys"):
      aj.paged_attention(q, cache, aj.Mask(kv_lengths=jnp.array([1])))
    with self.assertRaisesRegex(ValueError, "the cache places"):
      aj.paged_attention(q, cache, aj.Mask(causal=True, q_offset=0,
                                           kv_offset=0))
    with self.assertRaisesRegex(ValueError, "no dense mask or bias"):
      aj.paged_attention(q, cache, aj.Mask(dense=jnp.ones((1, 1, 1, 8),
                                                          bool)))
    with self.assertRaisesRegex(TypeError, "PagedKVCache"):
      aj.paged_attention(q, (x, x))


class PagedGarbageTest(chex.TestCase):

  def test_a_nan_a_row_sees_spoils_that_row_alone_in_every_paged_kernel(self):
    cache = pc.init_paged_cache(6, Z, K, H, 2, M, dtype=jnp.bfloat16)
    x = jnp.ones((2, K, 5, H), jnp.bfloat16)
    # Sequence 0's token 2 (its second page, slot 0): a NaN key.
    cache = pc.append(cache, x.at[0, 0, 2, 0].set(jnp.nan), x)
    self.assertFalse(bool(pc.all_finite(cache)))
    q = jnp.ones((2, N, 1, H), jnp.bfloat16)
    for impl in ("flash", aj.kernels.PagedTpu(interpret=True),
                 aj.kernels.PagedGpu(interpret=True)):
      out = np.asarray(aj.paged_attention(q, cache, aj.Mask(causal=True),
                                          implementation=impl), np.float32)
      self.assertFalse(np.isfinite(out[0]).any(), impl)
      np.testing.assert_array_equal(out[1], 1.0)

  def test_a_nan_written_where_the_window_hides_it_reaches_no_row(self):
    # Written through append, the NaN marks its page, so the flash walk
    # searches the blocks it loads: the page of tokens 8-11 is loaded for
    # the query at 12 (window 2: tokens 10-12), and token 9's NaN value
    # must not reach it (0 * NaN would). Garbage past the length (the
    # NaN pool) stays out as ever.
    z = 4
    rng = np.random.default_rng(3)
    k, v = (rng.standard_normal((1, 1, 13, H)).astype(np.float32)
            for _ in range(2))
    q = rng.standard_normal((1, N, 1, H)).astype(np.float32)
    cache = pc.init_paged_cache(8, z, 1, H, 1, 4)
    cache = cache._replace(key_pages=jnp.full_like(cache.key_pages, jnp.nan),
                           value_pages=jnp.full_like(cache.value_pages,
                                                     jnp.nan))
    cache = pc.append(cache, jnp.asarray(k).at[0, 0, 9].set(jnp.nan),
                      jnp.asarray(v).at[0, 0, 9].set(jnp.nan))
    self.assertFalse(bool(pc.all_finite(cache)))
    window = (2, 0)
    want = _reference(q[0], k[0, 0], v[0, 0], window)  # no NaN anywhere
    for impl in ("flash", aj.kernels.Flash(block_k=2 * z)):
      got = aj.paged_attention(jnp.asarray(q), cache,
                               aj.Mask(causal=True, window=window),
                               implementation=impl)
      # float32 against float64 over 3 keys: rounding only.
      np.testing.assert_allclose(np.asarray(got)[0], want, rtol=1e-5,
                                 atol=1e-6)


class ValuesInKeysTest(chex.TestCase):

  def test_a_cache_whose_values_are_its_keys_attends_with_them_everywhere(
      self):
    # MLA's latent cache stores [c_kv, k_pe] once: each paged kernel must
    # treat the key pages as the values too, as dense attention with
    # value = key does.
    rng = np.random.default_rng(5)
    k = rng.standard_normal((2, 1, 7, H)).astype(np.float32)
    q = rng.standard_normal((2, N, 1, H)).astype(np.float32)
    cache = pc.init_paged_cache(8, Z, 1, H, 2, M, values_in_keys=True)
    cache = pc.append(cache, jnp.asarray(k), None,
                      new_lengths=jnp.array([7, 4]))
    self.assertIsNone(cache.value_pages)
    for b, n in enumerate((7, 4)):
      want = aj.scaled_dot_product_attention(
          q[b:b + 1], k[b:b + 1, :, :n], k[b:b + 1, :, :n])
      for impl in ("flash", aj.kernels.PagedGpu(interpret=True)):
        got = aj.paged_attention(jnp.asarray(q), cache,
                                 aj.Mask(causal=True), implementation=impl)
        # float32, the same sums in other orders (blocks, partitions).
        np.testing.assert_allclose(np.asarray(got)[b], np.asarray(want)[0],
                                   rtol=1e-5, atol=1e-6, err_msg=str(impl))
