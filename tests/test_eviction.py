"""KV-cache eviction: each policy's choice against a NumPy reference written
from its paper's rule, ``evict`` against attention over the kept keys only
(float64 NumPy), the pages it returns, the scores that follow their slots,
the DecoderLM plumbing (importance and decoding at kept positions) and the
measurement, tiny."""

import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import chex
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.decoding import paged_cache as pc
from experiments import cache_accuracy
from experiments import eviction_accuracy
from experiments import eviction_model
from experiments import lm_model

B, K, Z, M, H = 3, 2, 4, 5, 8  # rows, KV heads, page size, pages, head dim
L = M * Z


def is_exhaustive(test_name: str) -> bool:
  """conftest's hook: the measurement at every policy compiles its four
  programs (~20 CPU-s; the default run keeps StreamingLLM's two, where the
  full budget equals the full cache); the importance through
  ``aj.paged_key_importance`` (the gathered keys' by default) repeats the
  default check's numbers through the other route; the model's per-layer
  eviction (each layer its own slots) and its importance against the
  full forward's weights run in the measurement's H2O and SnapKV too."""
  return test_name.startswith(("test_every_policy_runs",
                               "test_paged_importance", "test_evicted_layers",
                               "test_importance_is_the_full"))


# --- NumPy references, one row (and KV head) at a time, from the papers.


def _np_streaming(n, budget, sinks):
  if n <= budget:
    return list(range(n))
  s = min(sinks, budget)
  return list(range(s)) + list(range(n - (budget - s), n))


def _np_top(scores, candidates, k):
  """The ``k`` best candidates by score, the earlier of equal ones."""
  order = sorted(candidates, key=lambda i: (-scores[i], i))
  return order[:k]


def _np_h2o(scores, n, budget, recent):
  if n <= budget:
    return list(range(n))
  r = min(recent, budget)
  newest = list(range(n - r, n))
  return sorted(_np_top(scores, range(n - r), budget - r) + newest)


def _np_snapkv(scores, n, budget, window, kernel, pooling):
  if n <= budget:
    return list(range(n))
  w = min(window, budget)
  end = n - w
  half = kernel // 2
  pooled = np.zeros(end)
  for i in range(end):
    near = [scores[j] for j in range(i - half, i + half + 1) if 0 <= j < end]
    pooled[i] = max(near) if pooling == "max" else sum(near) / kernel
  return sorted(_np_top(pooled, range(end), budget - w)
                + list(range(end, n)))


def _kept(source, count, b, k=None):
  row = np.asarray(source[b] if k is None or source.ndim == 2
                   else source[b, k])
  return row[:int(count[b])].tolist()


class PolicyTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters((5, 2), (7, 0), (3, 4))
  def test_streaming_keeps_sinks_and_the_newest(self, budget, sinks):
    lengths = np.array([12, 5, budget])
    keep = self.variant(lambda n: aj.streaming_keep(n, budget, sinks=sinks))
    source, count = keep(jnp.asarray(lengths))
    self.assertEqual(source.shape, (B, budget))
    for b, n in enumerate(lengths):
      self.assertEqual(_kept(source, count, b), _np_streaming(n, budget,
                                                              sinks))

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters((6, 3), (6, 0), (4, 9))
  def test_h2o_keeps_the_newest_and_the_heavy_hitters(self, budget, recent):
    rng = np.random.default_rng(budget + recent)
    scores = rng.random((B, K, L)).astype(np.float32)
    lengths = np.array([17, 6, 3])
    source, count = self.variant(
        lambda s, n: aj.h2o_keep(s, n, budget, recent=recent))(
            jnp.asarray(scores), jnp.asarray(lengths))
    self.assertEqual(source.shape, (B, K, budget))
    self.assertEqual(count.tolist(), np.minimum(lengths, budget).tolist())
    for b, n in enumerate(lengths):
      for k in range(K):  # each KV head its own heavy hitters
        self.assertEqual(_kept(source, count, b, k),
                         _np_h2o(scores[b, k], n, budget, recent), (b, k))

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters((8, 3, 5, "max"), (8, 3, 3, "avg"),
                            (5, 7, 1, "max"), (9, 2, 7, "avg"))
  def test_snapkv_pools_the_window_scores(self, budget, window, kernel,
                                          pooling):
    rng = np.random.default_rng(budget * kernel)
    # Small integers: sums are exact in float32, and max pooling makes
    # ties, which go to the earlier slot as in the reference.
    scores = rng.integers(0, 6, (B, K, L)).astype(np.float32)
    lengths = np.array([20, 11, 4])
    source, count = self.variant(
        lambda s, n: aj.snapkv_keep(s, n, budget, window=window,
                                    kernel=kernel, pooling=pooling))(
                                        jnp.asarray(scores),
                                        jnp.asarray(lengths))
    for b, n in enumerate(lengths):
      for k in range(K):
        self.assertEqual(
            _kept(source, count, b, k),
            _np_snapkv(scores[b, k], n, budget, window, kernel, pooling),
            (b, k))

  def test_a_traced_budget_per_row(self):
    rng = np.random.default_rng(7)
    scores = rng.random((B, K, L)).astype(np.float32)
    lengths = np.array([17, 9, 12])
    budgets = np.array([4, 9, 6])

    @jax.jit
    def choose(budgets):
      return (aj.streaming_keep(lengths, budgets, sinks=2, width=L),
              aj.h2o_keep(scores, lengths, budgets, recent=budgets // 2,
                          width=L),
              aj.snapkv_keep(scores, lengths, budgets, window=3, width=L))

    (streaming, h2o, snapkv) = choose(jnp.asarray(budgets))
    for b, (n, a) in enumerate(zip(lengths, budgets)):
      self.assertEqual(_kept(*streaming, b), _np_streaming(n, a, 2))
      for k in range(K):
        self.assertEqual(_kept(*h2o, b, k),
                         _np_h2o(scores[b, k], n, a, a // 2))
        self.assertEqual(_kept(*snapkv, b, k),
                         _np_snapkv(scores[b, k], n, a, 3, 7, "max"))
    self.assertEqual(h2o[0].shape, (B, K, L))

  def test_refusals(self):
    scores, lengths = jnp.zeros((B, K, L)), jnp.array([3, 4, 5])
    with self.assertRaisesRegex(TypeError, "width="):
      aj.streaming_keep(lengths, jnp.int32(4))
    with self.assertRaisesRegex(ValueError, "budget must be positive"):
      aj.h2o_keep(scores, lengths, 0, recent=1)
    with self.assertRaisesRegex(ValueError, "recent must be >= 0"):
      aj.h2o_keep(scores, lengths, 4, recent=-1)
    with self.assertRaisesRegex(ValueError, r"kernel must be odd"):
      aj.snapkv_keep(scores, lengths, 4, window=2, kernel=4)
    with self.assertRaisesRegex(ValueError, "pooling must be one of"):
      aj.snapkv_keep(scores, lengths, 4, window=2, pooling="mean")
    with self.assertRaisesRegex(ValueError, r"scores must be \[B, K, L\]"):
      aj.h2o_keep(scores[0], lengths, 4, recent=1)
    with self.assertRaisesRegex(ValueError, r"lengths must be .*\[3\]"):
      aj.h2o_keep(scores, lengths[:2], 4, recent=1)
    with self.assertRaisesRegex(ValueError, "above width"):
      aj.streaming_keep(lengths, 9, width=4)


def _filled_cache(keys, values, lengths):
  """A cache holding ``keys`` and ``values [B, K, L, H]`` up to
  ``lengths``."""
  cache = pc.init_paged_cache(B * M + 2, Z, K, H, batch_size=B, max_pages=M)
  return pc.append(cache, keys, values, new_lengths=lengths)


def _np_attention(q, keys, values):
  """float64 softmax(q k^T / sqrt(H)) v of one head: [H], [S, H], [S, H]."""
  s = keys.astype(np.float64) @ q.astype(np.float64) / np.sqrt(H)
  w = np.exp(s - s.max())
  return (w / w.sum()) @ values.astype(np.float64)


class EvictTest(absltest.TestCase):
  """One jitted run: H2O's choice (each KV head its own slots) evicted from
  rows of 19, 6 and 11 tokens to 7, then a token appended and attended."""

  LENGTHS = np.array([19, 6, 11])
  BUDGET = 7

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    rng = np.random.default_rng(0)
    cls.keys, cls.values = rng.normal(size=(2, B, K, L, H)).astype(
        np.float32)
    # A score that names its token (the key's first column), so moved
    # scores can be checked against the keys the pages then hold.
    cls.scores = np.where(np.arange(L) < cls.LENGTHS[:, None, None],
                          cls.keys[..., 0], 0.0).astype(np.float32)
    rng = np.random.default_rng(2)
    cls.new = rng.normal(size=(2, B, K, 1, H)).astype(np.float32)
    cls.q = rng.normal(size=(B, 2 * K, 1, H)).astype(
        np.float32)  # two query heads per KV head

    @jax.jit
    def run(keys, values, scores, new_k, new_v, q):
      cache = _filled_cache(keys, values, jnp.asarray(cls.LENGTHS))
      pages_before = jnp.sum(cache.refcount > 0)
      source, count = aj.h2o_keep(scores, cache.lengths, cls.BUDGET,
                                  recent=3)
      evicted_cache, evicted = aj.evict(cache, source, count)
      moved = aj.moved_scores(scores, source, count)
      held = eviction_model.gathered_keys(evicted_cache)[..., 0]
      cache = pc.append(evicted_cache, new_k, new_v)
      out = aj.paged_attention(q, cache, aj.Mask(causal=True))
      return (out, evicted_cache, cache, source, count, evicted, moved,
              held, pages_before)

    (cls.out, cls.evicted_cache, cls.appended, cls.source, cls.count,
     cls.evicted, cls.moved, cls.held, cls.pages_before) = run(
         cls.keys, cls.values, cls.scores, cls.new[0], cls.new[1], cls.q)

  def test_attention_after_eviction_sees_only_the_kept_keys(self):
    kept_n = np.minimum(self.LENGTHS, self.BUDGET)
    self.assertEqual(self.evicted.tolist(), (self.LENGTHS - kept_n).tolist())
    self.assertEqual(self.appended.lengths.tolist(), (kept_n + 1).tolist())
    for b in range(B):
      for n in range(2 * K):
        k = n // 2
        kept = _kept(self.source, self.count, b, k)
        self.assertEqual(kept, _np_h2o(self.scores[b, k], self.LENGTHS[b],
                                       self.BUDGET, 3))
        ks = np.concatenate([self.keys[b, k, kept], self.new[0][b, k]])
        vs = np.concatenate([self.values[b, k, kept], self.new[1][b, k]])
        # float32 attention over <= 8 keys against float64 (observed
        # ~1e-7 of the values' scale).
        np.testing.assert_allclose(self.out[b, n, 0], _np_attention(
            self.q[b, n, 0], ks, vs), rtol=1e-5, atol=1e-6)

  def test_pages_past_the_budget_return_to_the_pool(self):
    cache = self.evicted_cache
    kept = np.minimum(self.LENGTHS, self.BUDGET)
    table = np.asarray(cache.page_table)
    p = cache.num_pages
    for b in range(B):  # a row holds exactly the pages its kept slots need
      self.assertEqual(int((table[b] < p).sum()), -(-int(kept[b]) // Z))
    np.testing.assert_array_equal(  # counts = the tables' references
        np.asarray(cache.refcount), np.bincount(table[table < p],
                                                minlength=p))
    self.assertEqual(int(self.pages_before), 5 + 2 + 3)
    self.assertEqual(int((cache.refcount > 0).sum()), 2 + 2 + 2)

  def test_moved_scores_follow_their_slots(self):
    kept = np.arange(L) < np.asarray(self.evicted_cache.lengths)[:, None,
                                                                 None]
    np.testing.assert_array_equal(np.where(kept, self.held, 0.0),
                                  self.moved)
    # Every-head-alike sources too (StreamingLLM's [B, A]).
    source, count = aj.streaming_keep(jnp.asarray(self.LENGTHS), 4, sinks=3)
    moved = aj.moved_scores(self.scores, source, count)
    np.testing.assert_array_equal(moved[0, :, :4],
                                  self.scores[0][:, [0, 1, 2, 18]])
    self.assertTrue((moved[:, :, 4:] == 0).all())


def _tiny_model(layers=2):
  config = lm_model.LMModelConfig(d_model=16, num_heads=2,
                                  num_layers=layers, ffn_dim=32)
  return lm_model.DecoderLM(config, vocab_size=30, rngs=nnx.Rngs(0))


def _jitted(fn):
  """``fn(model, *args)`` compiled once: the model split into its graph and
  state (eager layers would compile each op apart, many times slower)."""
  @jax.jit
  def run(state, *args):
    model = nnx.merge(graphdef, state)
    return fn(model, *args), nnx.state(model)

  graphdef = None

  def call(model, *args):
    nonlocal graphdef
    graphdef, state = nnx.split(model)
    out, state = run(state, *args)
    nnx.update(model, state)
    return out

  return call


class ModelTest(absltest.TestCase):

  def _importance(self, paged):
    model = _tiny_model()
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 30, (2, 7)),
                         jnp.int32)
    real = jnp.array([7, 7])
    model.init_paged_cache(2, 8, 4, 2)

    def read(model, tokens):
      rotary = eviction_model.positions(jnp.zeros((2,), jnp.int32), 7)
      logits, scores = eviction_model.decode_with_importance(
          model, tokens, real, rotary, last=3, paged=paged)
      want, weights = model(tokens, return_weights=True)
      return logits, want, scores, weights

    logits, want, scores, weights = _jitted(read)(model, tokens)
    # The paged step's logits are the full forward's (float32 attention
    # through pages and densely: sums in other orders, a few ulps).
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)
    # The layers' own weights in the full causal forward: each slot's
    # importance is its column's sum over the last 3 query rows (K = N:
    # one query head per KV head).
    for found, w in zip(scores, weights):
      expected = np.asarray(w, np.float64)[:, :, 4:, :].sum(2)  # [B, N, 7]
      # float32 backward passes over <= 7 keys against the forward's
      # weights (~1 ulp of a mass of 1 per row).
      np.testing.assert_allclose(found[..., :7], expected, atol=2e-6)
      self.assertTrue((np.asarray(found)[..., 7:] == 0).all())

  def test_importance_is_the_full_forwards_attention(self):
    self._importance(paged=False)

  def test_paged_importance_is_the_full_forwards_attention(self):
    self._importance(paged=True)

  def test_evicted_layers_keep_their_own_slots(self):
    model = _tiny_model()
    model.init_paged_cache(2, 8, 4, 2)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 30, (2, 7)),
                         jnp.int32)
    scores = [jnp.asarray(np.random.default_rng(s).random((2, 2, 8)),
                          jnp.float32) for s in (0, 1)]

    def run(model, tokens):
      model.decode(tokens, jnp.array([7, 5]))
      before = [eviction_model.gathered_keys(b.attention._paged())
                for b in model.blocks]
      lengths = eviction_model.lengths(model)
      choices = [aj.h2o_keep(s, lengths, 3, recent=1) for s in scores]
      evicted = eviction_model.evict(model, choices)
      after = [eviction_model.gathered_keys(b.attention._paged())
               for b in model.blocks]
      return (before, after, choices, evicted, eviction_model.lengths(model),
              model.pages_in_use())

    before, after, choices, evicted, lengths, pages = _jitted(run)(model,
                                                                   tokens)
    self.assertEqual(evicted.tolist(), [4, 2])
    self.assertEqual(lengths.tolist(), [3, 3])
    self.assertEqual(int(pages), 2)  # one page of 4 each
    for keys, moved, (source, count) in zip(before, after, choices):
      for b in range(2):
        for k in range(2):
          np.testing.assert_array_equal(
              moved[b, k, :3], keys[b, k, _kept(source, count, b, k)])


class EvaluateTest(absltest.TestCase):

  def _rows(self, n=2, t=12):
    tokens = np.random.default_rng(0).integers(2, 30, (n, t + 1)).astype(
        np.int32)
    return cache_accuracy.Rows(tokens, np.full(n, t, np.int32))

  def test_full_budget_equals_the_full_cache(self):
    result = eviction_accuracy.evaluate(  # (one layer: a quicker compile)
        _tiny_model(1), self._rows(), budgets=(1.0, 0.25),
        policies=("streaming",), page_size=4, batch_rows=2, sinks=1)
    full, kept = result["full"], result["streaming"][1.0]
    self.assertEqual(kept["bits_per_char"], full["bits_per_char"])
    self.assertEqual(kept["greedy_agreement"], 1.0)
    self.assertEqual(kept["pages_at_end"], full["pages_at_end"])
    self.assertEqual(result["protocol"]["predictions"], 2 * 6)
    # 3 of 12 slots: one page of 4 per row at the end, 4 slots attended at
    # most (the kept 3 and the call's own), and other predictions.
    small = result["streaming"][0.25]
    self.assertEqual((small["budget_tokens"], small["pages_at_end"],
                      small["peak_slots"]), (3, 1.0, 4))
    self.assertNotEqual(small["bits_per_char"], full["bits_per_char"])

  def test_every_policy_runs_and_full_budget_equals_the_full_cache(self):
    model = _tiny_model()
    result = eviction_accuracy.evaluate(
        model, self._rows(3), budgets=(1.0, 0.5), page_size=4,
        batch_rows=2, window=2, kernel=3)
    full = result["full"]
    self.assertEqual(full["pages_at_end"], 3.0)  # 12 tokens, pages of 4
    for policy in eviction_accuracy.POLICIES:
      same, half = result[policy][1.0], result[policy][0.5]
      self.assertEqual(same["greedy_agreement"], 1.0, policy)
      # The scored programs add importance ops beside the same decode
      # (fusions may differ by an ulp of the log-softmax).
      np.testing.assert_allclose(same["bits_per_char"],
                                 full["bits_per_char"], rtol=1e-6)
      self.assertEqual(half["budget_tokens"], 6)
      self.assertEqual(half["pages_at_end"], 2.0)  # 6 slots, pages of 4
      self.assertLess(half["bytes_at_end"], full["bytes_at_end"])
    self.assertEqual(result["streaming"][0.5]["peak_slots"], 7)
    self.assertEqual(result["snapkv"][0.5]["peak_slots"], 8)  # + window
    text = "\n".join(eviction_accuracy.section(result))
    self.assertIn("| H2O | 6 (0.5) |", text)
    with tempfile.TemporaryDirectory() as d:
      eviction_accuracy.plot(result, d + "/eviction.png")


if __name__ == "__main__":
  absltest.main()
