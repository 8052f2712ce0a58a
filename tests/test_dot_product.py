"""scaled_dot_product_attention against independent references."""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
from jax import test_util as jtu
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from tests import _data
from tests import reference

# float32 against float64: logits, exp and the weighted sum each round once
# (eps = 1.2e-7) and sums run over <= 16 terms of magnitude <= ~4, so errors
# stay below ~1e-6; 1e-5 leaves an order of magnitude of headroom.
F32_TOL = dict(atol=1e-5, rtol=1e-5)


def _normal(seed, shape, dtype=jnp.float32):
  return _data.normal(seed, shape, dtype)


def _qkv(t=4, s=6, h=8, hv=8, lead=(2,), seed=0):
  return (_normal(seed, lead + (t, h)), _normal(seed + 1, lead + (s, h)),
          _normal(seed + 2, lead + (s, hv)))


class ReferenceTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
      ("no_batch", (), 4, 4, 8, 8, None, False),
      ("batch", (2,), 4, 6, 8, 8, None, False),
      ("heads_value_dim_differs", (2, 3), 5, 7, 4, 6, None, False),
      ("padding_mask", (2, 3), 4, 6, 8, 8, "padding", False),
      ("causal_square", (2,), 5, 5, 4, 4, None, True),
      ("causal_chunk_at_end", (2,), 3, 7, 4, 4, None, True),
      ("causal_more_queries_than_keys", (2,), 6, 4, 4, 4, None, True),
      ("int_mask_and_causal", (2, 2), 4, 6, 4, 4, "int", True),
  )
  def test_matches_numpy_lesson_formula(self, lead, t, s, h, hv, mask_kind,
                                        is_causal):
    q, k, v = _qkv(t, s, h, hv, lead)
    mask = None
    if mask_kind == "padding":  # [B, 1, 1, S]: key padding, shared by heads
      mask = aj.padding_mask(jnp.array([2, s]), s)[:, None, None, :]
    elif mask_kind == "int":  # the lesson's 0 = blocked convention
      mask = _data.bernoulli(7, 0.7, (1, 1, t, s)).astype(
          jnp.int32)  # [1, 1, T, S]: the logits' rank, shared
    fn = self.variant(functools.partial(aj.scaled_dot_product_attention,
                                        is_causal=is_causal,
                                        return_weights=True))
    out, weights = fn(q, k, v, mask)
    ref_out, ref_weights = reference.sdpa(q, k, v, mask, is_causal=is_causal)
    chex.assert_shape(out, lead + (t, hv))
    chex.assert_shape(weights, lead + (t, s))
    self.assertEqual(weights.dtype, jnp.float32)
    chex.assert_trees_all_close(out, ref_out.astype(np.float32), **F32_TOL)
    chex.assert_trees_all_close(weights, ref_weights.astype(np.float32),
                                **F32_TOL)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
      ("plain", False, False, False),
      ("causal", True, False, False),
      ("mask", False, True, False),
      ("bias_and_mask", False, True, True),
  )
  def test_matches_jax_nn(self, is_causal, use_mask, use_bias):
    b, n, t, h = 2, 3, 5, 8
    q, k, v = _qkv(t, t, h, h, (b, n))
    mask = (_data.bernoulli(3, 0.8, (b, n, t, t))
            if use_mask else None)
    bias = _normal(4, (b, n, t, t)) if use_bias else None
    fn = self.variant(functools.partial(aj.scaled_dot_product_attention,
                                        is_causal=is_causal))
    out = fn(q, k, v, mask, bias=bias)
    # jax.nn wants [B, T, N, H]; it averages V over fully masked rows where
    # we return 0, so the random mask keeps every row's diagonal open.
    if mask is not None:
      mask = mask | jnp.eye(t, dtype=bool)[None, None]
      out = fn(q, k, v, mask, bias=bias)
    swap = lambda x: jnp.swapaxes(x, 1, 2)
    expected = jax.nn.dot_product_attention(
        swap(q), swap(k), swap(v), bias=bias, mask=mask, is_causal=is_causal)
    chex.assert_trees_all_close(out, swap(expected), **F32_TOL)

  @parameterized.product(
      implementation=("dense", "flash"),
      pattern=(dict(is_causal=True, window=(3, 0)),
               dict(window=(2, 4)),
               dict(is_causal=True, kv=(9, 5), q=(9, 6)),
               dict(window=(1, 1), kv=(9, 7), q=(8, 8))))
  def test_patterns_agree_with_jax_nn(self, implementation, pattern):
    # The subset jax.nn shares: T == S (its windows align top-left, ours
    # bottom-right, the same when T == S), and every query row below its
    # length keeps a key (jax.nn averages V over fully masked rows; it zeroes
    # rows past query_seq_lengths as we do). Layout swapped to [B, T, N, H].
    pattern = dict(pattern)
    kv, q_len = pattern.pop("kv", None), pattern.pop("q", None)
    is_causal = pattern.pop("is_causal", False)
    window = pattern.pop("window", None)
    q, k, v = _qkv(t=9, s=9, h=8, hv=8, lead=(2, 4))
    theirs_kw = dict(is_causal=is_causal, local_window_size=window)
    lengths = {}
    if kv is not None:
      # [B]: one length per example (left-aligned to [B, N]), as in jax.nn.
      lengths = dict(kv_lengths=jnp.array(kv), q_lengths=jnp.array(q_len))
      theirs_kw.update(key_value_seq_lengths=lengths["kv_lengths"],
                       query_seq_lengths=lengths["q_lengths"])
    ours = aj.scaled_dot_product_attention(
        q, k, v, aj.Mask(window=window, **lengths), is_causal=is_causal,
        implementation=implementation)
    swap = lambda x: jnp.swapaxes(x, 1, 2)
    theirs = swap(jax.nn.dot_product_attention(
        swap(q), swap(k), swap(v), implementation="xla", **theirs_kw))
    chex.assert_trees_all_close(ours, theirs, **F32_TOL)

  def test_nested_lists_are_arrays(self):
    # Lists are read as arrays (as jnp functions do), not refused with
    # "Cannot determine dtype".
    q = [[0.5, -1.0], [2.0, 0.25], [1.0, 1.0]]
    for fn in (aj.scaled_dot_product_attention, aj.blockwise_attention):
      chex.assert_trees_all_close(fn(q, q, q), fn(*(jnp.asarray(q),) * 3))

  def test_causal_is_bottom_right_aligned_unlike_jax_nn(self):
    q, k, v = _qkv(t=3, s=5, h=4, hv=4, lead=(1, 1))
    ours = aj.scaled_dot_product_attention(q, k, v, is_causal=True)
    swap = lambda x: jnp.swapaxes(x, 1, 2)
    bottom_right = jax.nn.dot_product_attention(
        swap(q), swap(k), swap(v), mask=aj.causal_mask(3, 5)[None, None])
    top_left = jax.nn.dot_product_attention(swap(q), swap(k), swap(v),
                                            is_causal=True)
    chex.assert_trees_all_close(ours, swap(bottom_right), **F32_TOL)
    self.assertGreater(float(jnp.abs(ours - swap(top_left)).max()), 1e-2)

  @chex.variants(with_jit=True, without_jit=True)
  def test_default_scale_is_inverse_sqrt_head_dim(self):
    q, k, v = _qkv(h=16, hv=4)
    sdpa = functools.partial(aj.scaled_dot_product_attention,
                             return_weights=True)
    default = self.variant(sdpa)(q, k, v)
    explicit = self.variant(functools.partial(sdpa, scale=0.25))(q, k, v)
    unscaled = self.variant(functools.partial(sdpa, scale=1.0))(q, k, v)
    chex.assert_trees_all_close(default, explicit, atol=0, rtol=0)
    self.assertGreater(float(jnp.abs(default[1] - unscaled[1]).max()), 1e-2)

  def test_broadcast_kv_head_equals_explicit_repeat(self):
    q = _normal(0, (2, 4, 3, 8))  # [B, N, T, H]
    k, v = _normal(1, (2, 1, 5, 8)), _normal(2, (2, 1, 5, 8))  # one KV head
    shared = aj.scaled_dot_product_attention(q, k, v)
    repeated = aj.scaled_dot_product_attention(
        q, jnp.repeat(k, 4, axis=1), jnp.repeat(v, 4, axis=1))
    chex.assert_trees_all_close(shared, repeated, atol=0, rtol=0)

  def test_mask_with_more_leading_dims_than_query_broadcasts(self):
    q, k, v = _qkv(lead=(2,))
    mask = _data.bernoulli(5, 0.7, (3, 2, 4, 6))
    out, weights = aj.scaled_dot_product_attention(q, k, v, mask,
                                                   return_weights=True)
    chex.assert_shape(out, (3, 2, 4, 8))
    ref_out, ref_w = reference.sdpa(q, k, v, mask)
    chex.assert_trees_all_close(out, ref_out.astype(np.float32), **F32_TOL)
    chex.assert_trees_all_close(weights, ref_w.astype(np.float32), **F32_TOL)


def _reference_lse(q, k, mask=None, scale=None):
  """float64 ``log(sum(exp(scaled logits)))`` over allowed keys; -inf if none."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  if scale is None:
    scale = 1.0 / np.sqrt(q.shape[-1])
  logits = np.matmul(q, np.swapaxes(k, -1, -2)) * scale  # [..., T, S]
  allowed = np.ones(logits.shape, bool)
  if mask is not None:
    allowed = np.broadcast_to(np.asarray(mask) != 0, logits.shape)
  safe = np.where(allowed, logits, -np.inf)
  row_max = safe.max(-1, keepdims=True)
  row_max = np.where(np.isfinite(row_max), row_max, 0.0)
  total = np.where(allowed, np.exp(safe - row_max), 0.0).sum(-1)
  with np.errstate(divide="ignore"):
    return np.where(total > 0, row_max[..., 0] + np.log(total), -np.inf)


class GroupedQueryTest(chex.TestCase):
  """Queries [B, N, T, H] over keys/values [B, K, S, H], K dividing N."""

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
      ("n4_k2_mask_shared_by_heads", 4, 2, "shared"),
      ("n4_k2_per_head_mask", 4, 2, "per_head"),
      ("n6_k3_mask_shared_by_heads", 6, 3, "shared"),
      ("n6_k3_per_head_mask", 6, 3, "per_head"),
  )
  def test_equals_float64_reference_with_repeated_kv_heads(
      self, num_heads, num_kv_heads, mask_kind):
    b, t, s, h = 2, 3, 5, 4
    q = _normal(0, (b, num_heads, t, h))
    k = _normal(1, (b, num_kv_heads, s, h))
    v = _normal(2, (b, num_kv_heads, s, h))
    mask_shape = (b, 1 if mask_kind == "shared" else num_heads, t, s)
    mask = _data.bernoulli(3, 0.6, mask_shape)
    mask = mask.at[0, 0, 1].set(False)  # a query that may attend to nothing
    fn = self.variant(functools.partial(aj.scaled_dot_product_attention,
                                        return_weights=True, return_lse=True))
    out, weights, lse = fn(q, k, v, mask)
    group = num_heads // num_kv_heads
    k_rep, v_rep = (np.repeat(np.asarray(x), group, axis=1) for x in (k, v))
    ref_out, ref_w = reference.sdpa(q, k_rep, v_rep, mask)
    ref_lse = _reference_lse(q, k_rep, mask)
    chex.assert_shape(out, (b, num_heads, t, h))
    chex.assert_shape(weights, (b, num_heads, t, s))
    chex.assert_shape(lse, (b, num_heads, t))
    self.assertTrue(np.isneginf(ref_lse[0, 0, 1]))
    chex.assert_trees_all_close(out, ref_out.astype(np.float32), **F32_TOL)
    chex.assert_trees_all_close(weights, ref_w.astype(np.float32), **F32_TOL)
    chex.assert_trees_all_close(lse, ref_lse.astype(np.float32), **F32_TOL)
    # The blockwise path groups the heads the same way (no weights there).
    block_out, block_lse = self.variant(functools.partial(
        aj.scaled_dot_product_attention, implementation="flash",
        return_lse=True))(q, k, v, mask)
    chex.assert_trees_all_close(block_out, ref_out.astype(np.float32),
                                **F32_TOL)
    chex.assert_trees_all_close(block_lse, ref_lse.astype(np.float32),
                                **F32_TOL)


  def test_heads_are_read_only_in_4d(self):
    # [B, T, H] with batch 4 against batch 2 is a batch mistake, not GQA;
    # so is a 5-D [B1, B2, N, T, H] mismatch on axis -3.
    for q_shape, kv_shape in (((4, 3, 8), (2, 5, 8)),
                              ((2, 4, 2, 3, 8), (2, 2, 2, 5, 8))):
      q, kv = jnp.ones(q_shape), jnp.ones(kv_shape)
      for implementation in ("dense", "flash"):
        with self.assertRaisesRegex(ValueError, "do not broadcast"):
          aj.scaled_dot_product_attention(q, kv, kv,
                                          implementation=implementation)

  def test_heads_that_do_not_divide_say_so(self):
    q, kv = jnp.ones((2, 6, 3, 8)), jnp.ones((2, 4, 5, 8))
    with self.assertRaisesRegex(ValueError, "divisor of N"):
      aj.scaled_dot_product_attention(q, kv, kv)


class KeyValueSeqLengthsTest(chex.TestCase):

  def test_lengths_without_head_axis_are_per_example(self):
    # [B] lengths against [B, N, T, H] with B == N used to be refused as
    # ambiguous; they now align to the left: one length per example, never
    # per head (and the same as the old [B, 1] spelling).
    q, k, v = _qkv(lead=(2, 2))  # [B, N, T, H] with B == N
    lengths = jnp.array([3, 6])  # [B]
    per_example = aj.padding_mask(lengths, 6)[:, None, None, :]  # [B,1,1,S]
    per_head = aj.padding_mask(lengths, 6)[None, :, None, :]  # [1,N,1,S]
    ref_out, _ = reference.sdpa(q, k, v, per_example)
    head_out, _ = reference.sdpa(q, k, v, per_head)
    self.assertGreater(float(np.abs(ref_out - head_out).max()), 1e-2)
    for implementation in ("dense", "flash"):
      out = aj.scaled_dot_product_attention(
          q, k, v, aj.Mask(kv_lengths=lengths), implementation=implementation)
      chex.assert_trees_all_close(out, ref_out.astype(np.float32), **F32_TOL)
      old = aj.scaled_dot_product_attention(
          q, k, v, aj.Mask(kv_lengths=lengths[:, None]),
          implementation=implementation)
      chex.assert_trees_all_close(out, old, atol=0, rtol=0)

  def test_lengths_per_example_equal_a_padding_mask(self):
    q, k, v = _qkv(lead=(2, 3))  # [B, N, T, H]
    lengths = jnp.array([3, 6])
    padding = aj.padding_mask(lengths, 6)[:, None, None, :]  # [B, 1, 1, S]
    ref_out, ref_w = reference.sdpa(q, k, v, padding)
    out, weights = aj.scaled_dot_product_attention(
        q, k, v, aj.Mask(kv_lengths=lengths), return_weights=True)
    chex.assert_trees_all_close(out, ref_out.astype(np.float32), **F32_TOL)
    chex.assert_trees_all_close(weights, ref_w.astype(np.float32), **F32_TOL)


class GradientTest(chex.TestCase):

  def test_check_grads_float64(self):
    # Finite differences in float64 are accurate to ~1e-8, so check_grads's
    # default float64 tolerances apply; masked entries included.
    with jax.enable_x64(True):
      q, k, v = (np.asarray(x, np.float64) for x in _qkv(t=3, s=4, h=4, hv=3))
      mask = np.array([[[1, 1, 0, 1], [0, 1, 1, 1], [1, 0, 0, 0]]], bool)
      bias = np.linspace(-1.0, 1.0, 12).reshape(1, 3, 4)  # [1, T, S]
      fn = jax.jit(lambda q, k, v, bias: aj.scaled_dot_product_attention(
          q, k, v, mask, bias=bias, is_causal=True))
      jtu.check_grads(fn, (q, k, v, bias), order=2, modes=("fwd", "rev"))

  def test_grads_match_jax_nn(self):
    q, k, v = _qkv(t=5, s=5, h=8, hv=8, lead=(2, 2))
    cot = _normal(9, (2, 2, 5, 8))
    swap = lambda x: jnp.swapaxes(x, 1, 2)

    def ours(q, k, v):
      return jnp.sum(aj.scaled_dot_product_attention(
          q, k, v, is_causal=True) * cot)

    def theirs(q, k, v):
      out = jax.nn.dot_product_attention(swap(q), swap(k), swap(v),
                                         is_causal=True)
      return jnp.sum(swap(out) * cot)

    grads = lambda f: jax.jit(jax.grad(f, (0, 1, 2)))(q, k, v)
    chex.assert_trees_all_close(grads(ours), grads(theirs), **F32_TOL)


class MaskedRowTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
      ("bool_mask", "mask"), ("int_mask", "int"), ("neg_inf_bias", "bias"),
      ("causal_extra_queries", "causal"))
  def test_fully_masked_row_is_zero_with_zero_finite_grads(self, how):
    q, k, v = _qkv(t=4, s=4, h=4, hv=3, lead=())
    mask, bias, is_causal = jnp.ones((4, 4), bool).at[1].set(False), None, False
    dead_rows = [1]
    if how == "int":
      mask = mask.astype(jnp.int32)
    elif how == "bias":
      mask, bias = None, jnp.zeros((4, 4)).at[1].set(-jnp.inf)
    elif how == "causal":  # T=4 queries, S=2 keys: rows 0 and 1 see nothing
      k, v, mask, is_causal, dead_rows = k[:2], v[:2], None, True, [0, 1]
    fn = self.variant(functools.partial(aj.scaled_dot_product_attention,
                                        is_causal=is_causal,
                                        return_weights=True))
    out, weights = fn(q, k, v, mask, bias=bias)
    ref_out, ref_w = reference.sdpa(q, k, v, mask, bias, is_causal=is_causal)
    chex.assert_trees_all_close(out, ref_out.astype(np.float32), **F32_TOL)
    chex.assert_trees_all_close(weights, ref_w.astype(np.float32), **F32_TOL)
    for row in dead_rows:
      np.testing.assert_array_equal(out[row], 0.0)
      np.testing.assert_array_equal(weights[row], 0.0)
    grads = jax.jit(jax.grad(
        lambda q, k, v: jnp.sum(fn(q, k, v, mask, bias=bias)[0]),
        (0, 1, 2)))(q, k, v)
    chex.assert_tree_all_finite(grads)
    for row in dead_rows:
      np.testing.assert_array_equal(grads[0][row], 0.0)

  def test_weights_rows_sum_to_one_or_zero(self):
    q, k, v = _qkv(t=6, s=6, lead=(3,))
    mask = _data.bernoulli(1, 0.4, (3, 6, 6))
    _, weights = aj.scaled_dot_product_attention(q, k, v, mask,
                                                 return_weights=True)
    sums = weights.sum(-1)
    expected = jnp.where(mask.any(-1), 1.0, 0.0)
    chex.assert_trees_all_close(sums, expected, atol=1e-6)
    np.testing.assert_array_equal(jnp.where(mask, 0.0, weights), 0.0)


class CausalityTest(chex.TestCase):

  @parameterized.named_parameters(("square", 5, 5), ("chunk", 3, 6))
  def test_gradient_of_output_t_ignores_later_positions(self, t, s):
    q, k, v = _qkv(t=t, s=s, h=4, hv=4, lead=())
    fn = lambda k, v: aj.scaled_dot_product_attention(q, k, v,
                                                      is_causal=True)
    jac_k, jac_v = jax.jit(jax.jacrev(fn, (0, 1)))(k, v)  # [T, Hv, S, H]
    for i in range(t):
      future = slice(i + (s - t) + 1, s)
      np.testing.assert_array_equal(jac_k[i, :, future], 0.0)
      np.testing.assert_array_equal(jac_v[i, :, future], 0.0)
      # ...while the visible past does matter.
      self.assertGreater(float(jnp.abs(jac_v[i, :, : i + (s - t) + 1]).max()),
                         0.0)


class PrecisionTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
      # The float32 computation on the same (already rounded) inputs differs
      # only by the final cast of the output: half an ulp of the output dtype
      # (2^-9 for bf16, 2^-12 for fp16) relative, plus a tiny absolute floor.
      ("bfloat16", jnp.bfloat16, 2.0**-8),
      ("float16", jnp.float16, 2.0**-11),
  )
  def test_low_precision_is_fp32_math_with_one_final_rounding(self, dtype,
                                                              rtol):
    q, k, v = (x.astype(dtype) for x in _qkv(t=5, s=7, lead=(2, 2)))
    fn = self.variant(functools.partial(aj.scaled_dot_product_attention,
                                        return_weights=True))
    out, weights = fn(q, k, v)
    self.assertEqual(out.dtype, dtype)
    self.assertEqual(weights.dtype, jnp.float32)
    chex.assert_tree_all_finite((out, weights))
    ref_out, ref_w = fn(*(x.astype(jnp.float32) for x in (q, k, v)))
    chex.assert_trees_all_close(out.astype(jnp.float32), ref_out, rtol=rtol,
                                atol=1e-6)
    # Same float32 softmax; only the dot's accumulation order may differ.
    chex.assert_trees_all_close(weights, ref_w, atol=1e-6, rtol=1e-6)

  def test_float16_logits_beyond_float16_range_stay_finite(self):
    # q.k = 16 * 100 * 100 = 160,000 > 65,504 (fp16 max): fp16 logits would
    # overflow to inf; ours are float32.
    q = jnp.full((1, 2, 16), 100.0, jnp.float16)
    k = jnp.full((1, 3, 16), 100.0, jnp.float16).at[0, 0].set(-100.0)
    v = _normal(0, (1, 3, 4)).astype(jnp.float16)
    out, weights = aj.scaled_dot_product_attention(q, k, v, scale=1.0,
                                                   return_weights=True)
    chex.assert_tree_all_finite((out, weights))
    chex.assert_trees_all_close(weights[0, 0], jnp.array([0.0, 0.5, 0.5]),
                                atol=1e-6)


class DropoutTest(chex.TestCase):

  def test_dropout_keeps_weights_and_is_unbiased(self):
    q, k, v = _qkv(t=3, s=4, h=4, hv=2, lead=())
    clean_out, clean_w = aj.scaled_dot_product_attention(
        q, k, v, return_weights=True)

    def dropped(rng):
      return aj.scaled_dot_product_attention(q, k, v, dropout_rate=0.25,
                                             dropout_rng=rng,
                                             return_weights=True)

    out, weights = dropped(jax.random.key(1))
    np.testing.assert_array_equal(weights, clean_w)  # same numerics path
    self.assertGreater(float(jnp.abs(out - clean_out).max()), 1e-3)
    again, _ = dropped(jax.random.key(1))
    np.testing.assert_array_equal(out, again)  # deterministic given the key
    outs, _ = jax.vmap(dropped)(jax.random.split(jax.random.key(2), 4000))
    # Inverted dropout is unbiased. Each output is a sum of 4 terms w*v/0.75
    # with keep-variance 0.25*0.75; its std over keys is <= ~1.5 for unit v,
    # so the mean of 4000 draws is within 4 sigma = 4*1.5/sqrt(4000) < 0.1.
    chex.assert_trees_all_close(outs.mean(0), clean_out, atol=0.1)

  def test_rate_without_rng_is_an_error(self):
    q, k, v = _qkv()
    with self.assertRaisesRegex(ValueError, "dropout_rng"):
      aj.scaled_dot_product_attention(q, k, v, dropout_rate=0.1)


class VmapAndTracingTest(chex.TestCase):

  @parameterized.named_parameters(("one", 1), ("two", 2), ("four", 4))
  def test_heads_equal_a_loop_over_single_heads(self, num_heads):
    q, k, v = _qkv(t=3, s=5, h=4, hv=4, lead=(2, num_heads))
    mask = _data.bernoulli(8, 0.7, (2, 1, 3, 5))
    out, weights = aj.scaled_dot_product_attention(q, k, v, mask,
                                                   return_weights=True)
    for n in range(num_heads):
      o, w = aj.scaled_dot_product_attention(q[:, n], k[:, n], v[:, n],
                                             mask[:, 0], return_weights=True)
      chex.assert_trees_all_close(out[:, n], o, atol=0, rtol=0)
      chex.assert_trees_all_close(weights[:, n], w, atol=0, rtol=0)

  def test_no_retrace_for_same_shapes(self):
    @jax.jit
    @chex.assert_max_traces(n=1)
    def fn(q, k, v, mask):
      return aj.scaled_dot_product_attention(q, k, v, mask, is_causal=True)

    for seed in range(3):
      q, k, v = _qkv(seed=seed)
      fn(q, k, v, jnp.ones((1, 4, 6), bool))


if __name__ == "__main__":
  absltest.main()
