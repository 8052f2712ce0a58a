"""``aj.key_importance`` and ``aj.paged_key_importance``: the column sums of
the attention weights.

The reference writes the softmax out in float64 NumPy from its definition
(bottom-right causal, lengths, ALiBi, sinks in the denominator) and sums its
columns over the counted rows; it never calls the library. The paged
function is compared with ``key_importance`` over the same keys laid out
linearly (its own correctness then rests on the first comparison), with a
prefix page two rows share.

Shape glossary: B batch, N query heads, K key/value heads, T query length,
S key length, H head dim; Z page size, M pages per row, P pool pages.
"""

import dataclasses
import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.decoding import paged_cache as pc
from tests import _data

B, N, K, T, S, H = 2, 4, 2, 12, 20, 8  # GQA: 2 query heads per KV head
KV_LENGTHS, Q_LENGTHS = (20, 9), (12, 7)
SLOPES = np.array([0.5, 0.25, 0.125, 0.0625])  # one per query head
# Blocks of 4 x 8 over T = 12, S = 20: 3 x 3 blocks, causal skips some and
# cuts others; the backward recomputes P per block from the saved lse.
FLASH = aj.kernels.Flash(block_q=4, block_k=8)
# float32 weights (logits of 8 products, exp, a blockwise sum) against
# float64: ~1e-6 relative per weight, summed over <= 12 rows of mass <= 1.
TOL32 = dict(atol=2e-5, rtol=2e-5)
TOL64 = dict(atol=1e-12, rtol=1e-12)  # float64 on both sides


def _reference(q, k, *, kv_lengths=None, q_lengths=None, sinks=None,
               slopes=None, counted=None):
  """float64 ``[B, N, S]``: ``sum_t softmax(...)[b, n, t, s]`` over the
  rows ``counted [B, T]`` (default all). Causal, bottom-right."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  b, n, t, h = q.shape
  s = k.shape[2]
  k = np.repeat(k, n // k.shape[1], axis=1)  # query head n reads n // G
  logits = np.einsum("bnth,bnsh->bnts", q, k) / np.sqrt(h)
  i, j = np.arange(t)[:, None], np.arange(s)[None, :]
  if slopes is not None:
    logits = logits - slopes[None, :, None, None] * (i - j)
  ok = np.broadcast_to(j <= i + s - t, (b, n, t, s)).copy()
  if kv_lengths is not None:
    ok &= j < np.asarray(kv_lengths)[:, None, None, None]
  if q_lengths is not None:
    ok &= i < np.asarray(q_lengths)[:, None, None, None]
  logits = np.where(ok, logits, -np.inf)
  top = logits.max(-1, keepdims=True)
  top = np.where(np.isfinite(top), top, 0.0)
  if sinks is not None:
    top = np.maximum(top, np.asarray(sinks, np.float64)[None, :, None, None])
  e = np.where(ok, np.exp(logits - top), 0.0)
  denominator = e.sum(-1, keepdims=True)
  if sinks is not None:
    denominator = denominator + np.exp(
        np.asarray(sinks, np.float64)[None, :, None, None] - top)
  w = np.where(denominator > 0, e / np.where(denominator > 0, denominator, 1),
               0.0)
  if counted is not None:
    w = w * np.asarray(counted, np.float64)[:, None, :, None]
  return w.sum(2)


def _shapes(jaxpr):
  """Every intermediate's shape in a closed jaxpr, sub-jaxprs (loops,
  conds, custom rules, jit) included."""
  found = []
  for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
    found += [tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars]
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else (param,):
        if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
          found += _shapes(sub)
  return found


def _window(last, q_lengths=None):
  """bool ``[B, T]``: the last ``last`` real rows of each example."""
  n = np.full(B, T) if q_lengths is None else np.asarray(q_lengths)
  i = np.arange(T)[None, :]
  return (i < n[:, None]) & (i >= n[:, None] - last)


def _mask(lengths):
  if not lengths:
    return aj.Mask(causal=True)
  return aj.Mask(causal=True, kv_lengths=jnp.array(KV_LENGTHS),
                 q_lengths=jnp.array(Q_LENGTHS))


class KeyImportanceTest(chex.TestCase):

  def setUp(self):
    super().setUp()
    self.q = _data.normal(0, (B, N, T, H))
    self.k = _data.normal(1, (B, K, S, H))
    self.sinks = 0.5 * _data.normal(2, (N,))

  @parameterized.named_parameters(
      # Every row; then SnapKV's window, counted from T or from each
      # example's real rows; both kernels meet each.
      ("dense_all_rows", "dense", True, None),
      ("flash_all_rows", FLASH, True, None),
      ("flash_window_of_real_rows", FLASH, True, 3),
      ("dense_window_from_t", "dense", False, 5),
  )
  def test_equals_float64_column_sums(self, implementation, lengths, last):
    mask = _mask(lengths)

    @jax.jit
    def both(q, k, sinks):
      options = dict(score_mod=aj.alibi(jnp.asarray(SLOPES, jnp.float32)),
                     sinks=sinks, implementation=implementation, last=last)
      return (aj.key_importance(q, k, mask, **options),
              aj.key_importance(q, k, mask, per_kv_head=True, **options))

    per_head, per_kv = both(self.q, self.k, self.sinks)
    q_lengths = Q_LENGTHS if lengths else None
    counted = None if last is None else _window(last, q_lengths)
    want = _reference(self.q, self.k, sinks=self.sinks, slopes=SLOPES,
                      kv_lengths=KV_LENGTHS if lengths else None,
                      q_lengths=q_lengths, counted=counted)
    self.assertEqual(per_head.dtype, jnp.float32)
    np.testing.assert_allclose(per_head, want, **TOL32)
    # Each KV head's score is its group's query heads' summed.
    np.testing.assert_allclose(per_kv, want.reshape(B, K, N // K, S).sum(2),
                               **TOL32)

  def test_float64_dense_and_the_mass_of_a_row(self):
    # No sinks: every counted row that sees a key gives exactly 1. Example
    # 0 has 9 real rows (3 padded rows give 0); example 1 has no keys
    # (kv_lengths 0): its rows see nothing and give 0.
    with jax.enable_x64(True):
      q, k = self.q.astype(jnp.float64), self.k.astype(jnp.float64)
      mask = aj.Mask(causal=True, q_lengths=jnp.array([9, 12]),
                     kv_lengths=jnp.array([20, 0]))
      got = jax.jit(lambda q, k: aj.key_importance(
          q, k, mask, implementation="dense"))(q, k)
      self.assertEqual(got.dtype, jnp.float64)
      want = _reference(q, k, q_lengths=(9, 12), kv_lengths=(20, 0))
      np.testing.assert_allclose(got, want, **TOL64)
      np.testing.assert_allclose(got.sum(-1), [[9.0] * N, [0.0] * N],
                                 **TOL64)

  def test_three_dimensional_inputs_and_a_value_width_of_one(self):
    # [B, T, H] against [B, S, H]: one score per example; the flash walk
    # with the ones value of width 1 against dense.
    q, k = self.q[:, 0], self.k[:, 0]
    run = jax.jit(lambda q, k, impl: aj.key_importance(
        q, k, is_causal=True, implementation=impl), static_argnums=2)
    got = run(q, k, FLASH)
    self.assertEqual(got.shape, (B, S))
    want = _reference(q[:, None], k[:, None])[:, 0]
    np.testing.assert_allclose(got, want, **TOL32)

  def test_the_flash_program_holds_no_t_by_s_array(self):
    # Traced only (no compile). The dense kernel's [T, S] weights show that
    # the walk sees inside the kernels and the backward; flash's blocks
    # ([16, 16]) are all it holds of the scores.
    t = s = 64
    q = jax.ShapeDtypeStruct((1, 2, t, H), jnp.float32)
    k = jax.ShapeDtypeStruct((1, 1, s, H), jnp.float32)
    for implementation, whole in (("dense", True),
                                  (aj.kernels.Flash(block_q=16, block_k=16), False)):
      jaxpr = jax.make_jaxpr(lambda q, k, impl=implementation: (
          aj.key_importance(q, k, is_causal=True, implementation=impl)))(q, k)
      self.assertEqual(any(shape[-2:] == (t, s) for shape in _shapes(jaxpr)),
                       whole, implementation)

  @parameterized.named_parameters(
      ("zero", dict(last=0), ValueError, "last must be positive"),
      ("float", dict(last=2.0), TypeError, "last must be a Python int"),
      ("bool", dict(last=True), TypeError, "last must be a Python int"),
      ("per_kv_head_3d", dict(per_kv_head=True, three_d=True), ValueError,
       "per_kv_head=True"),
      ("per_kv_head_not_bool", dict(per_kv_head=1), TypeError,
       "per_kv_head must be a Python bool"),
  )
  def test_refusals_name_the_option(self, options, error, message):
    q, k = self.q, self.k
    if options.pop("three_d", False):
      q, k = q[:, 0], k[:, 0]
    with self.assertRaisesRegex(error, message):
      aj.key_importance(q, k, **options)
    with self.assertRaisesRegex(TypeError, "dropout_rate"):
      aj.key_importance(q, k, dropout_rate=0.1)  # pylint: disable=unexpected-keyword-arg


# The paged case: B_P rows over pages of Z = 4 tokens; row 2 shares row 0's
# first 6 tokens (its first page and half of its second), then each row
# appends its own step. Flash reads whole pages per key block.
B_P, Z, M, P = 3, 4, 5, 12
PAGED_FLASH = aj.kernels.Flash(block_q=4, block_k=2 * Z)


@functools.partial(jax.jit, static_argnums=(0, 1))  # one compile, not
def _paged_cache(dtype, values_in_keys):             # one per operation
  """The cache after the prompts, the shared prefix and a ragged step;
  ``(cache, new [B])``."""
  t0, t1 = 7, 4
  cache = pc.init_paged_cache(P, Z, K, H, batch_size=B_P, max_pages=M,
                              dtype=dtype, values_in_keys=values_in_keys)
  k0, k1 = _data.normal(10, (B_P, K, t0, H)), _data.normal(11, (B_P, K, t1, H))
  v0, v1 = (None, None) if values_in_keys else (
      _data.normal(12, (B_P, K, t0, H)), _data.normal(13, (B_P, K, t1, H)))
  cache = pc.append(cache, k0, v0, new_lengths=jnp.array([7, 5, 0]))
  cache = pc.share_prefix(cache, 0, 2, 6)
  new = jnp.array([4, 1, 3])
  cache = pc.append(cache, k1, v1, new_lengths=new)
  return cache, new


def _linear_keys(cache):
  """float32 ``[B, K, M * Z, H]``: each row's keys read through its page
  table (zero where it holds no page), dequantised."""
  keys = cache.key_pages.astype(jnp.float32)
  if cache.key_scales is not None:
    keys = keys * cache.key_scales[..., None]
  rows = keys.at[cache.page_table].get(mode="fill", fill_value=0)
  return jnp.swapaxes(rows, 1, 2).reshape(B_P, K, M * Z, H)


class PagedKeyImportanceTest(chex.TestCase):

  @parameterized.named_parameters(
      ("float_pages", jnp.float32, False, None),
      ("int8_values_in_keys_window", "int8", True, 2),
  )
  def test_equals_key_importance_over_the_linear_keys(
      self, dtype, values_in_keys, last):
    cache, new = _paged_cache(dtype, values_in_keys)
    self.assertGreater(int(cache.refcount.max()), 1)  # a page is shared
    q = _data.normal(14, (B_P, N, 4, H))
    sinks = 0.5 * _data.normal(2, (N,))
    score_mod = aj.alibi(jnp.asarray(SLOPES, jnp.float32))

    @jax.jit
    def both(q, cache, sinks):
      mask = aj.Mask(causal=True, q_lengths=new)
      paged = aj.paged_key_importance(
          q, cache, mask, score_mod=score_mod, sinks=sinks,
          implementation=PAGED_FLASH, last=last)
      # The same step over linear keys: queries at positions lengths - new.
      linear = aj.key_importance(
          q, _linear_keys(cache),
          aj.Mask(causal=True, q_lengths=new, kv_lengths=cache.lengths,
                  q_offset=cache.lengths - new),
          score_mod=score_mod, sinks=sinks, implementation="dense",
          last=last, per_kv_head=True)
      return paged, linear

    paged, linear = both(q, cache, sinks)
    self.assertEqual(paged.shape, (B_P, K, M * Z))
    np.testing.assert_allclose(paged, linear, **TOL32)
    lengths = np.asarray(cache.lengths)
    past = np.arange(M * Z)[None, None, :] >= lengths[:, None, None]
    self.assertTrue(np.all(np.where(past, paged, 0.0) == 0.0))
    # A row's mass is its own (the shared page's too): at most (counted
    # rows) x (N / K) per KV head, the sinks taking the rest.
    rows = np.minimum(np.asarray(new), last or T)
    self.assertTrue(np.all(paged.sum(-1) < rows[:, None] * (N // K)))


@dataclasses.dataclass(frozen=True)
class ForwardOnly(aj.kernels.Kernel):
  """An outside kernel with a forward and no reverse mode: its product
  with the values sits in a while loop of traced trip count, which JAX
  cannot transpose."""
  name = "forward_only"
  implements = frozenset({"causal"})

  def __call__(self, problem):
    ops = problem.ops
    t, s = ops.query.shape[-2], ops.key.shape[-2]

    def head(q, k, v, h):  # [T, H], [S, H], [S, Hv], aj.kernels.Head
      weights = aj.kernels.masked_softmax(
          q @ k.T * problem.scale, aj.kernels.allowed(ops, h, t, s))
      _, out = jax.lax.while_loop(  # one pass
          lambda c: c[0] < 1, lambda c: (c[0] + 1, weights @ v),
          (0, jnp.zeros((t, v.shape[-1]), v.dtype)))
      return out, None, None

    return aj.kernels.lift_heads(head, ops)


class KernelRefusalTest(chex.TestCase):
  """A kernel that cannot score keys is refused by its name (the
  contract's ``test_key_importance`` checks every registry column)."""

  def test_a_kernel_without_reverse_mode(self):
    q, k = _data.normal(0, (B, N, T, H)), _data.normal(1, (B, K, S, H))
    run = jax.jit(lambda q, k, **kw: aj.key_importance(
        q, k, is_causal=True, implementation=ForwardOnly(), **kw))
    # (its forward runs: the call is the kernel's)
    jax.eval_shape(lambda q, k: aj.scaled_dot_product_attention(
        q, k, k, is_causal=True, implementation=ForwardOnly()), q, k)
    with self.assertRaisesRegex(
        ValueError, r"key_importance differentiates implementation="
        r"'forward_only' in reverse mode .*while_loop.*"
        r"implementation='flash'"):
      run(q, k)
    # A call the kernel refuses is sdpa's refusal, the value's shape added.
    with self.assertRaisesRegex(
        ValueError, r"implementation='forward_only' is not possible: .*"
        r"sinks.*key_importance's call: a value of ones, \[2, 4, 20, 1\]"):
      run(q, k, sinks=jnp.zeros(N))


if __name__ == "__main__":
  absltest.main()
