"""DeepSeek Sparse Attention (the lightning indexer) against float64 NumPy.

The references below are written from DeepSeek-V3.2-Exp's formulas, not
from our code: ``I[t, s] = sum_j w[t, j] ReLU(q_I[t, j] . k_I[s])`` with
``k_I`` LayerNormed and a partial rotary of explicit pairs; the top-k as a
sort by (score descending, index ascending) over the visible keys; the main
attention over the chosen tokens per head, for ``aj.MultiHeadAttention``
and ``aj.MultiHeadLatentAttention`` (dense and flash kernels); the KL loss
towards the heads' summed, L1-normalised weights, dense and sparse.
Sizes: D=16, J=3 indexer heads of E=8, B=2, T=12.
"""

import functools

from absl.testing import absltest
import chex
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.layers import dsa
from attention_jax.layers.dsa_module import LightningIndexer
from tests import _data

D, J, E = 16, 3, 8
B, T = 2, 12
ROPE = aj.Rope(fraction=0.5)  # DeepSeek rotates part of the indexer head
# float32 against float64 through two projections (fan-in 16), a
# LayerNorm, the rotation and a J-term sum of O(1) products: errors are a
# few 1e-7 of the scores' O(1) scale; 2e-5 catches a wrong term (a missed
# constant or rotation moves scores by >1e-2).
TOL = dict(atol=2e-5, rtol=2e-5)
# Top-k is compared with the float64 order only where neighbouring scores
# differ by more than float32 can blur (observed errors < 1e-6).
GAP = 1e-4
_ZEROS = nnx.initializers.zeros_init()


def is_exhaustive(test_name: str) -> bool:
  """conftest's hook: the flash-kernel runs of the two layers (a compile of
  the block walk each) are left to the exhaustive run; the dense kernel
  runs them by default."""
  return test_name in ("test_mha_over_the_selection_flash",
                       "test_mla_over_the_selection_flash")


def _params(seed=0, k_norm=True):
  return _data.params(dsa.init_indexer_params, seed, D, J, E, k_norm=k_norm)


def _x(seed=0, b=B, t=T):
  return _data.normal(seed, (b, t, D))


# One jit per call pattern: eager calls compile every primitive per shape.
_scores = jax.jit(dsa.indexer_scores,
                  static_argnames=("chunk", "rope"))
_top_k = jax.jit(dsa.indexer_top_k, static_argnames=("k", "chunk", "rope"))
_loss = jax.jit(dsa.indexer_loss, static_argnames=("chunk", "rope"))


# -- the float64 references -----------------------------------------------


def _rotate(x, positions, fraction, base=10000.0):
  """Half-split RoPE of the first ``R = E * fraction`` features of ``x [...,
  T, E]``: pair ``(i, i + R/2)`` turned by ``p * base**(-2i/R)``."""
  out = np.array(x, np.float64)
  r = int(x.shape[-1] * fraction)
  h = r // 2
  for t, p in enumerate(positions):
    for i in range(h):
      angle = p * base ** (-2.0 * i / r)
      c, s = np.cos(angle), np.sin(angle)
      a, b = x[..., t, i], x[..., t, i + h]
      out[..., t, i] = a * c - b * s
      out[..., t, i + h] = b * c + a * s
  return out


def _ref_scores(params, x, rope=True, positions=None):
  """``I [B, T, S]`` from DeepSeek's indexer formula (``positions [B, T]``
  of the rotary, default ``0..T-1``)."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  x = np.asarray(x, np.float64)
  out = np.zeros((x.shape[0], x.shape[1], x.shape[1]))
  for b in range(x.shape[0]):
    q = np.einsum("td,dje->jte", x[b], p["W_q"]["kernel"])  # [J, T, E]
    k = x[b] @ p["W_k"]["kernel"]  # [T, E]: one key per token
    if "k_norm" in p:
      mu = k.mean(-1, keepdims=True)
      var = ((k - mu) ** 2).mean(-1, keepdims=True)
      k = (k - mu) / np.sqrt(var + 1e-6) * p["k_norm"]["scale"] + (
          p["k_norm"]["bias"])
    if rope:
      at = range(x.shape[1]) if positions is None else positions[b]
      q = _rotate(q, at, 0.5)
      k = _rotate(k, at, 0.5)
    w = x[b] @ p["W_w"]["kernel"] / np.sqrt(J * E)  # [T, J]
    for t in range(x.shape[1]):
      for s in range(x.shape[1]):
        out[b, t, s] = sum(w[t, j] * max(0.0, q[j, t] @ k[s])
                           for j in range(J))
  return out


def _ref_visible(b_n, t_n, *, window=None, kv_lengths=None, ids=None):
  """Causal ``[B, T, S]``, with a left window, key lengths (a padded token
  chooses nothing either) and segment ids ``[B, T]``."""
  ok = np.zeros((b_n, t_n, t_n), bool)
  for b in range(b_n):
    for t in range(t_n):
      for s in range(t + 1):
        fine = window is None or s >= t - window
        if kv_lengths is not None:
          fine &= s < kv_lengths[b] and t < kv_lengths[b]
        if ids is not None:
          fine &= ids[b][t] == ids[b][s]
        ok[b, t, s] = fine
  return ok


def _ref_top_k(scores, visible, k):
  """``[B, T, k]`` by (score descending, index ascending); ``-1`` padded;
  and the smallest gap between the scores that decide the order (exact
  ties left out: ``I = 0`` wherever every ReLU is 0, or for a repeated
  token, exactly so in float32 too, and broken by the index in both)."""
  b_n, t_n, _ = scores.shape
  out = -np.ones((b_n, t_n, k), int)
  gap = np.inf
  for b in range(b_n):
    for t in range(t_n):
      cand = sorted((s for s in range(t_n) if visible[b, t, s]),
                    key=lambda s, b=b, t=t: (-scores[b, t, s], s))
      out[b, t, :min(k, len(cand))] = cand[:k]
      ranked = [scores[b, t, s] for s in cand[:k + 1]]
      gaps = np.abs(np.diff(ranked))
      gaps = gaps[gaps > 0]
      if gaps.size:
        gap = min(gap, gaps.min())
  return out, gap


def _softmax(z):
  e = np.exp(z - z.max())
  return e / e.sum()


def _ref_loss(scores, q, k, scale, visible, indices=None):
  """mean over rows of KL(mean_n softmax_n || softmax(I)), over the visible
  keys or the selected visible ones (each once)."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  n_heads, kv_heads = q.shape[1], k.shape[1]
  total, rows = 0.0, 0
  for b in range(scores.shape[0]):
    for t in range(scores.shape[1]):
      keys = [s for s in range(scores.shape[2]) if visible[b, t, s]]
      if indices is not None:
        keys = [s for s in sorted(set(indices[b, t].tolist()))
                if s >= 0 and visible[b, t, s]]
      if not keys:
        continue
      p = np.zeros(len(keys))
      for n in range(n_heads):
        kn = k[b, n // (n_heads // kv_heads)][keys]
        p += _softmax(scale * kn @ q[b, n, t])
      p /= p.sum()
      r = _softmax(scores[b, t, keys])
      total += np.sum(p * np.log(p / r))
      rows += 1
  return total / rows


def _ref_attention(q, k, v, scale, allowed):
  """Per head ``softmax(scale q k^T)`` over ``allowed [T, S]``, then v."""
  s = np.where(allowed, scale * q @ k.T, -np.inf)
  m = np.max(s, -1, keepdims=True)
  e = np.where(allowed, np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
  total = e.sum(-1, keepdims=True)
  return (e / np.where(total > 0, total, 1)) @ v


def _allowed(indices):
  """Causal and chosen: ``[B, T, S]``."""
  b_n, t_n, _ = indices.shape
  ok = np.zeros((b_n, t_n, t_n), bool)
  for b in range(b_n):
    for t in range(t_n):
      for s in indices[b, t]:
        if 0 <= s <= t:
          ok[b, t, s] = True
  return ok


class IndexerTest(chex.TestCase):

  def test_scores_equal_the_formula_chunked_or_not(self):
    params, x = _params(), _x()
    want = _ref_scores(params, x)
    whole = _scores(params, x, rope=ROPE)
    chex.assert_trees_all_close(whole, want.astype(np.float32), **TOL)
    # Query chunks of 5: the last one partly past T.
    chunked = _scores(params, x, chunk=5, rope=ROPE)
    np.testing.assert_array_equal(chunked, whole)
    # No LayerNorm, no rotary; a causal mask hides the future as -inf.
    params = _params(seed=3, k_norm=False)
    got = _scores(params, x, mask=aj.Mask(causal=True))
    want = _ref_scores(params, x, rope=False)
    causal = np.tril(np.ones((T, T), bool))
    np.testing.assert_array_equal(np.isfinite(got), np.broadcast_to(
        causal, got.shape))
    chex.assert_trees_all_close(np.where(causal, got, 0),
                                np.where(causal, want, 0), **TOL)

  def test_top_k_equals_the_sorted_reference_and_never_looks_ahead(self):
    params, x = _params(), _x(1)
    scores = _ref_scores(params, x)
    visible = _ref_visible(B, T)
    for k, chunk in ((4, None), (4, 5), (T + 3, 7)):
      want, gap = _ref_top_k(scores, visible, k)
      self.assertGreater(gap, GAP)  # the float64 order is float32's too
      got = np.asarray(_top_k(params, x, k, chunk=chunk, rope=ROPE))
      np.testing.assert_array_equal(got, want, err_msg=f"k={k} {chunk=}")
      rows = np.arange(T)[None, :, None]
      self.assertTrue(np.all(got <= rows), "a future token was chosen")
    # k > T: every visible token is chosen, -1 for the rest.
    np.testing.assert_array_equal((got >= 0).sum(-1),
                                  np.broadcast_to(np.arange(1, T + 1),
                                                  (B, T)))

  def test_ties_go_to_the_lower_index(self):
    params = _params()
    x = np.array(_x(2))
    x[:, 5] = x[:, 2]  # the same token twice: equal keys, tied scores
    x[:, 9] = x[:, 2]
    got = np.asarray(_top_k(params, jnp.asarray(x), T, rope=None))
    scores = _ref_scores(params, x, rope=False)
    self.assertTrue(np.all(scores[:, 9:, 2] != 0))  # not ReLU's zeros
    want, gap = _ref_top_k(scores, _ref_visible(B, T), T)
    self.assertGreater(gap, GAP)  # only exact ties are close
    np.testing.assert_array_equal(got, want)
    for b in range(B):
      for t in range(9, T):  # 2 before 5 before 9 wherever the three tie
        order = got[b, t].tolist()
        self.assertLess(order.index(2), order.index(5))
        self.assertLess(order.index(5), order.index(9))

  def test_window_lengths_and_documents_bound_the_choice(self):
    params = _params()
    x = np.array(_x(3))
    x[1, 8:] = np.nan  # padding may hold garbage
    lengths = np.array([T, 8])
    ids = np.array([[0] * 5 + [1] * 7, [0] * 3 + [1] * 9])
    mask = aj.Mask(window=(6, 0), kv_lengths=jnp.asarray(lengths),
                   q_segment_ids=jnp.asarray(ids))
    visible = _ref_visible(B, T, window=6, kv_lengths=lengths, ids=ids)
    # Rotary positions restart per document (segment_positions).
    positions = [np.r_[0:5, 0:7], np.r_[0:3, 0:9]]
    clean = np.where(np.isnan(x), 0.0, x)
    scores = _ref_scores(params, clean, positions=positions)
    want, gap = _ref_top_k(scores, visible, 3)
    self.assertGreater(gap, GAP)
    got = _top_k(params, jnp.asarray(x), 3, chunk=5, mask=mask, rope=ROPE)
    np.testing.assert_array_equal(got, want)
    # The loss over the same mask: finite, its gradient too.
    q = _data.normal(4, (B, 4, T, 4))
    k = _data.normal(5, (B, 2, T, 4))
    loss, grads = jax.jit(jax.value_and_grad(
        lambda p: dsa.indexer_loss(p, jnp.asarray(x), q, k, scale=0.5,
                                   mask=mask, chunk=5, rope=ROPE)))(params)
    want_loss = _ref_loss(scores, q, k, 0.5, visible)
    np.testing.assert_allclose(loss, want_loss, **TOL)
    self.assertTrue(all(np.isfinite(g).all()
                        for g in jax.tree.leaves(grads)))


class MainAttentionTest(chex.TestCase):
  """The main attention over the chosen tokens, every head alike."""

  def _selection(self, seed):
    # k=4 without chunks: the program the indexer tests compiled already.
    indices = _top_k(_params(seed), _x(seed), 4, rope=ROPE)
    return indices, dsa.dsa_selection(indices, T, block_q=4, block_k=4)

  def _mha(self, attention_fn):
    mha = aj.MultiHeadAttention(D, 4, num_kv_heads=2, head_dim=4,
                                use_bias=False, kernel_init=_ZEROS,
                                attention_fn=attention_fn, rngs=nnx.Rngs(0))
    mha.load_params(_data.params(aj.init_multi_head_params, 11, D, 4,
                                 num_kv_heads=2, head_dim=4, use_bias=False))
    return mha

  def _check_mha(self, attention_fn):
    indices, sel = self._selection(0)
    mha, x = self._mha(attention_fn), _x(8)
    got = mha(x, mask=aj.Mask(causal=True, rule=sel))
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), mha.params_dict())
    xs, allowed = np.asarray(x, np.float64), _allowed(np.asarray(indices))
    want = np.zeros((B, T, D))
    for b in range(B):
      for n in range(4):
        q = xs[b] @ p["W_q"]["kernel"][:, n]
        k = xs[b] @ p["W_k"]["kernel"][:, n // 2]
        v = xs[b] @ p["W_v"]["kernel"][:, n // 2]
        heads = _ref_attention(q, k, v, 0.5, allowed[b])
        want[b] += heads @ p["W_o"]["kernel"][n]
    chex.assert_trees_all_close(got, want.astype(np.float32), **TOL)

  def test_mha_over_the_selection_dense(self):
    self._check_mha("dense")

  def test_mha_over_the_selection_flash(self):
    self._check_mha("flash")  # the BlockMask's 4 x 4 blocks

  def _check_mla(self, attention_fn):
    hn, hr, hv, r = 4, 2, 4, 8
    sizes = dict(kv_lora_rank=r, qk_nope_head_dim=hn, qk_rope_head_dim=hr,
                 v_head_dim=hv)
    mla = aj.MultiHeadLatentAttention(D, 2, rope=None, kernel_init=_ZEROS,
                                      attention_fn=attention_fn,
                                      rngs=nnx.Rngs(0), **sizes)
    mla.load_params(_data.params(aj.init_latent_params, 12, D, 2, **sizes))
    indices, sel = self._selection(1)
    x = _x(9)
    got = mla(x, aj.Mask(causal=True, rule=sel))
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), mla.params_dict())
    xs, allowed = np.asarray(x, np.float64), _allowed(np.asarray(indices))
    want = np.zeros((B, T, D))
    for b in range(B):
      q = np.einsum("td,dnh->nth", xs[b], p["W_q"]["kernel"])
      kv = xs[b] @ p["W_dkv"]["kernel"]  # [T, R + Hr]
      c = kv[:, :r]
      c = c / np.sqrt(np.mean(c * c, -1, keepdims=True) + 1e-6) * (
          p["kv_norm"]["scale"])
      up = np.einsum("tr,rnh->nth", c, p["W_ukv"]["kernel"])
      for n in range(2):
        k = np.concatenate([up[n, :, :hn], kv[:, r:]], -1)  # shared k_pe
        heads = _ref_attention(q[n], k, up[n, :, hn:], (hn + hr) ** -0.5,
                               allowed[b])
        want[b] += heads @ p["W_o"]["kernel"][n]
    chex.assert_trees_all_close(got, want.astype(np.float32), **TOL)

  def test_mla_over_the_selection_dense(self):
    self._check_mla("dense")

  def test_mla_over_the_selection_flash(self):
    self._check_mla("flash")


class LossTest(chex.TestCase):

  def _main(self):
    return _data.normal(13, (B, 4, T, 4)), _data.normal(14, (B, 2, T, 4))

  def test_dense_warm_up_equals_the_kl(self):
    params, x = _params(), _x(4)
    q, k = self._main()
    want = _ref_loss(_ref_scores(params, x), q, k, 0.7, _ref_visible(B, T))
    for chunk in (None, 5):
      got = _loss(params, x, q, k, scale=0.7, chunk=chunk, rope=ROPE)
      np.testing.assert_allclose(got, want, **TOL, err_msg=f"{chunk=}")

  def test_sparse_stage_equals_the_kl_over_the_selection(self):
    params, x = _params(), _x(4)
    q, k = self._main()
    indices = np.array(_top_k(params, x, 4, rope=ROPE))
    indices[0, 7, 3] = indices[0, 7, 0]  # a repeat counts once
    indices[1, 9, 2] = 11  # a future token is never in the set
    want = _ref_loss(_ref_scores(params, x), q, k, 0.7, _ref_visible(B, T),
                     indices)
    for chunk in (None, 5):
      got = _loss(params, x, q, k, scale=0.7, indices=jnp.asarray(indices),
                  chunk=chunk, rope=ROPE)
      np.testing.assert_allclose(got, want, **TOL, err_msg=f"{chunk=}")

  def test_gradient_reaches_only_the_indexer(self):
    params, x = _params(), _x(5)
    main = _data.params(aj.init_multi_head_params, 15, D, 4, num_kv_heads=2,
                        head_dim=4, use_bias=False)
    indices = _top_k(params, x, 4, rope=ROPE)

    def total(indexer, main, x, indices):
      seen = {}

      def capture(q, k, v, mask, **options):  # the heads as attended
        seen["q"], seen["k"] = q, k
        return aj.scaled_dot_product_attention(q, k, v, mask, **options)

      y = aj.multi_head_attention(main, x, x, x, aj.Mask(causal=True),
                                  attention_fn=capture)
      # The main model's own loss would use y; the indexer's reads q, k.
      del y
      return dsa.indexer_loss(indexer, x, seen["q"], seen["k"],
                              scale=0.5, indices=indices, rope=ROPE)

    grads = jax.jit(jax.grad(total, argnums=(0, 1, 2)))(params, main, x,
                                                         indices)
    g_indexer, g_main, g_x = grads
    for leaf in jax.tree.leaves(g_main) + [g_x]:
      np.testing.assert_array_equal(leaf, 0.0)
    for path, leaf in jax.tree_util.tree_leaves_with_path(g_indexer):
      self.assertGreater(float(jnp.abs(leaf).max()), 1e-4, path)
    # The indexer's gradient along a direction against the float64
    # reference's central difference (eps 1e-5: truncation ~1e-10).
    xs = np.asarray(x, np.float64)
    p64 = jax.tree.map(lambda a: np.asarray(a, np.float64), main)
    q = np.einsum("btd,dnh->bnth", xs, p64["W_q"]["kernel"])
    k = np.einsum("btd,dnh->bnth", xs, p64["W_k"]["kernel"])
    direction = jax.tree.map(
        lambda a: np.asarray(_data.normal(16, a.shape), np.float64), params)
    visible, chosen = _ref_visible(B, T), np.asarray(indices)

    def ref(eps):
      moved = jax.tree.map(lambda a, d: np.asarray(a, np.float64) + eps * d,
                           params, direction)
      return _ref_loss(_ref_scores(moved, xs), q, k, 0.5, visible, chosen)

    numeric = (ref(1e-5) - ref(-1e-5)) / 2e-5
    analytic = sum(float(jnp.vdot(g, d)) for g, d in zip(
        jax.tree.leaves(g_indexer), jax.tree.leaves(direction)))
    # float32 gradient against float64: a few 1e-6 relative observed.
    np.testing.assert_allclose(analytic, numeric, rtol=1e-4)


class ModuleTest(chex.TestCase):

  def test_module_calls_the_functions(self):
    indexer = LightningIndexer(D, J, E, top_k=4, chunk=5, rope=ROPE,
                               block_q=4, block_k=4, kernel_init=_ZEROS,
                               rngs=nnx.Rngs(0))
    params = _params(7)
    indexer.load_params(params)
    chex.assert_trees_all_equal(indexer.params_dict(), params)
    x = _x(6)
    q, k = _data.normal(13, (B, 4, T, 4)), _data.normal(14, (B, 2, T, 4))

    @nnx.jit
    def run(m, x, q, k):
      indices, sel = m(x)
      return indices, sel, m.loss(x, q, k, scale=0.7, indices=indices)

    indices, sel, got = run(indexer, x, q, k)
    # The functions at the arguments the other tests compiled them with.
    np.testing.assert_array_equal(
        indices, _top_k(params, x, 4, chunk=5, rope=ROPE))
    self.assertEqual((sel.block_q, sel.block_k, sel.batch_shape),
                     (4, 4, (B, 1)))
    want = _loss(params, x, q, k, scale=0.7, indices=indices, chunk=5,
                 rope=ROPE)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    with self.assertRaisesRegex(ValueError, r"params has entries .* but "
                                "this module has"):
      indexer.load_params(_params(7, k_norm=False))


class RefusalTest(absltest.TestCase):

  def test_refusals_name_the_argument(self):
    params, x = _params(), _x()
    q, k = _data.normal(13, (B, 4, T, 4)), _data.normal(14, (B, 2, T, 4))
    top_k = functools.partial(dsa.indexer_top_k, params, x)
    with self.assertRaisesRegex(ValueError, "k must be positive"):
      top_k(0)
    with self.assertRaisesRegex(TypeError, "k must be a Python int"):
      top_k(2.0)
    with self.assertRaisesRegex(ValueError, "chunk must be positive"):
      top_k(2, chunk=0)
    with self.assertRaisesRegex(ValueError, "x has 8 features"):
      dsa.indexer_top_k(params, x[..., :8], 2)
    with self.assertRaisesRegex(ValueError, r"missing \['W_w'\]"):
      dsa.indexer_top_k({n: params[n] for n in ("W_q", "W_k")}, x, 2)
    bad = dict(params, W_w={"kernel": jnp.zeros((D, J + 1))})
    with self.assertRaisesRegex(ValueError, "one D, J and E"):
      dsa.indexer_top_k(bad, x, 2)
    for mask, pattern in (
        (aj.Mask(rule=lambda b, h, q, kv: q >= kv), "holds a rule"),
        (aj.Mask(dense=jnp.ones((1, 1, T, T), bool)), "holds a dense"),
        (aj.Mask(q_offset=3), "positions"),
        (aj.Mask(kv_lengths=jnp.full((B, 4), T)), "per-head fields"),
    ):
      with self.assertRaisesRegex(ValueError, pattern):
        top_k(2, mask=mask)
    with self.assertRaisesRegex(TypeError, "mask must be an aj.Mask"):
      top_k(2, mask=jnp.ones((T, T), bool))
    with self.assertRaisesRegex(ValueError, "positions are given but rope "
                                "is None"):
      top_k(2, positions=jnp.arange(T))
    loss = functools.partial(dsa.indexer_loss, params, x)
    with self.assertRaisesRegex(ValueError, r"q \[B, N, T, H\] and k"):
      loss(q[:, :, :5], k, scale=0.5)
    with self.assertRaisesRegex(ValueError, "K dividing N"):
      loss(q[:, :3], k, scale=0.5)
    with self.assertRaisesRegex(TypeError, "scale"):
      loss(q, k)  # the main attention's scale is never guessed
    with self.assertRaisesRegex(ValueError, "scale must be positive"):
      loss(q, k, scale=-1.0)
    with self.assertRaisesRegex(TypeError, "indices must be an integer"):
      loss(q, k, scale=0.5, indices=jnp.zeros((B, T, 2)))
    with self.assertRaisesRegex(ValueError, r"indices must be \[B, T, k\] = "
                                r"\[2, 12, k\]"):
      loss(q, k, scale=0.5, indices=jnp.zeros((B, T - 1, 2), int))
    with self.assertRaisesRegex(ValueError, r"indices must be \[B, T, k\]"):
      dsa.dsa_selection(jnp.zeros((T, 2), int), T)
    with self.assertRaisesRegex(ValueError, "top_k must be positive"):
      LightningIndexer(D, J, E, top_k=0, rngs=nnx.Rngs(0))


if __name__ == "__main__":
  absltest.main()
