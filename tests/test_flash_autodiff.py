"""Dropout and forward-mode AD through the flash kernel, beyond the contract.

The contract (tests/contract.py) checks each kernel's dropout entry by
entry and its ``jax.jvp`` against the float64 reference; here: dropout's
statistics (the kept fraction, an unbiased output), ``jax.jacfwd``,
Hessian-vector products (forward over reverse), ``check_grads`` in both
modes, tangents in some inputs only (no dots for the others), the refusals
by name, and ``core/linear_map.py`` under ``vmap``.

Shape glossary: B batch, N heads, T query length, S key length, H head dim.
"""

from unittest import mock

from absl.testing import absltest
import chex
import jax
from jax import test_util as jtu
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.core import dropout
from attention_jax.core import linear_map
from attention_jax.kernels import flash_core
from tests import _data

# Odd blocks so that rows and columns straddle them (and padding).
FLASH = aj.kernels.Flash(block_q=16, block_k=24)


def _qkv(t=40, s=56, b=2, n=3, h=8, seed=0):
  return tuple(_data.normal(seed + i, (b, n, x, h))
               for i, x in enumerate((t, s, s)))


CAUSAL = aj.Mask(causal=True)


def _attend(impl, mask=CAUSAL, **kw):
  return lambda q, k, v: aj.scaled_dot_product_attention(
      q, k, v, mask, implementation=impl, **kw)


class DropoutStatisticsTest(chex.TestCase):

  def test_kept_fraction_and_independence(self):
    seed = dropout.seed_words(jax.random.key(0))
    rows, cols = jnp.arange(512)[:, None], jnp.arange(512)[None, :]
    a = np.asarray(dropout.keep_mask(seed, 0, 0, rows, cols, 0.3), float)
    b = np.asarray(dropout.keep_mask(seed, 0, 1, rows, cols, 0.3), float)
    c = np.asarray(dropout.keep_mask(seed, 1, 0, rows, cols, 0.3), float)
    # 262144 Bernoulli(0.7) draws: standard error 9e-4; 5 of them.
    self.assertAlmostEqual(a.mean(), 0.7, delta=5e-3)
    # Another head or example draws another mask: correlation ~ N(0,
    # 1 / 512**2) (standard error 2e-3).
    for other in (b, c):
      self.assertLess(abs(np.corrcoef(a.ravel(), other.ravel())[0, 1]), 1e-2)
    # Neighbouring rows and columns are no copies (nor shifted copies).
    self.assertLess(abs(np.corrcoef(a[:-1].ravel(), a[1:].ravel())[0, 1]),
                    1e-2)
    self.assertLess(abs(np.corrcoef(a[1:, :-1].ravel(),
                                    a[:-1, 1:].ravel())[0, 1]), 1e-2)

  def test_rate_zero_keeps_all_and_rate_near_one_drops_nearly_all(self):
    seed = dropout.seed_words(jax.random.key(1))
    rows, cols = jnp.arange(64)[:, None], jnp.arange(64)[None, :]
    self.assertTrue(bool(dropout.keep_mask(seed, 0, 0, rows, cols, 0.0).all()))
    kept = dropout.keep_mask(seed, 0, 0, rows, cols, 0.999).mean()
    self.assertLess(float(kept), 0.01)

  def test_flash_output_is_unbiased(self):
    # Inverted dropout: E[out] is the output without dropout. The mean of
    # 512 draws is within 5 standard errors of it, entry by entry.
    q, k, v = _qkv(t=20, s=30, b=1, n=2)
    keys = jax.random.split(jax.random.key(3), 512)
    draws = jax.jit(jax.vmap(lambda key: _attend(
        FLASH, dropout_rate=0.4, dropout_rng=key)(q, k, v)))(keys)
    plain = _attend(FLASH)(q, k, v)
    mean, sem = draws.mean(0), draws.std(0) / np.sqrt(len(keys))
    np.testing.assert_array_less(np.abs(mean - plain), 5 * sem + 1e-6)
    # and dropout is on: draws differ from each other
    self.assertGreater(float(draws.std(0).mean()), 1e-2)

  def test_same_key_same_draw_other_key_other_draw(self):
    q, k, v = _qkv()
    run = lambda seed: _attend(FLASH, dropout_rate=0.2,  # noqa: E731
                               dropout_rng=jax.random.key(seed))(q, k, v)
    chex.assert_trees_all_close(run(5), run(5), atol=0, rtol=0)
    self.assertGreater(float(jnp.abs(run(5) - run(6)).max()), 1e-2)

  def test_flash_equals_dense_at_default_blocks(self):
    # Several default-sized blocks, padding and a window: the same draw
    # per entry whichever kernel runs (float32 rounding: 1e-5).
    q, k, v = _qkv(t=600, s=700, b=1, n=2, h=16)
    mask = aj.Mask(causal=True, window=(300, 0))
    kw = dict(dropout_rate=0.25, dropout_rng=jax.random.key(9))
    chex.assert_trees_all_close(_attend("flash", mask, **kw)(q, k, v),
                                _attend("dense", mask, **kw)(q, k, v),
                                atol=1e-5, rtol=1e-5)


  def test_flash_equals_dense_at_query_and_key_positions(self):
    # A decoding-like call (queries at positions 16.., keys at 3..): each
    # entry's draw is keyed by its global (q_idx, kv_idx), so both kernels
    # drop the same entries (float32 rounding: 1e-5).
    q, k, v = _qkv(t=40, s=56)
    mask = aj.Mask(causal=True, q_offset=16, kv_offset=3)
    kw = dict(dropout_rate=0.3, dropout_rng=jax.random.key(4))
    for flash in (FLASH, aj.kernels.Flash(block_q=8, block_k=8)):
      chex.assert_trees_all_close(_attend(flash, mask, **kw)(q, k, v),
                                  _attend("dense", mask, **kw)(q, k, v),
                                  atol=1e-5, rtol=1e-5)

  def test_each_head_and_example_draws_its_own_mask(self):
    # The same inputs in every (b, h): without dropout every output is the
    # same, so a difference is the draw's. Rate 1/2 over 8 x 8 entries:
    # equal masks by chance with p = 2**-64.
    q = jnp.broadcast_to(_data.normal(0, (1, 1, 8, 4)), (2, 3, 8, 4))
    for impl in ("dense", FLASH):
      out = _attend(impl, dropout_rate=0.5, dropout_rng=jax.random.key(1))(
          q, q, q).reshape(6, -1)
      for i in range(6):
        for j in range(i):
          self.assertGreater(float(jnp.abs(out[i] - out[j]).max()), 1e-3,
                             (impl, i, j))


class HeadGroupsTest(chex.TestCase):
  """Heads walked a few at a time (lax.map over groups, vmap inside:
  flash_core.head_group) give what all heads under one vmap give."""

  def test_groups_of_two_equal_dense_in_every_mode(self):
    q, k, v = _qkv(t=40, s=56, b=2, n=3)  # 6 heads: groups 2, 2, 2
    mask = aj.Mask(causal=True, kv_lengths=jnp.array([56, 33]))
    kw = dict(dropout_rate=0.2, dropout_rng=jax.random.key(4))
    flash = _attend(FLASH, mask, **kw)
    dense = _attend("dense", mask, **kw)
    entries = FLASH.block_q * FLASH.block_k * 2  # two heads' blocks
    with mock.patch.object(flash_core, "HEAD_GROUP_ENTRIES", entries):
      self.assertEqual(flash_core.head_group(6, 40, 56, 16, 24), 2)
      got = jax.jit(flash)(q, k, v)
      grads = jax.jit(jax.grad(lambda *a: jnp.sum(flash(*a) ** 2),
                               (0, 1, 2)))(q, k, v)
      _, tangent = jax.jit(lambda p, t: jax.jvp(flash, p, t))((q, k, v),
                                                              (0.5 * q, v, k))
    # (float32 rounding of sums of a few products: 1e-5)
    chex.assert_trees_all_close(got, dense(q, k, v), atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(
        grads, jax.grad(lambda *a: jnp.sum(dense(*a) ** 2), (0, 1, 2))(
            q, k, v), atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(
        tangent, jax.jvp(dense, (q, k, v), (0.5 * q, v, k))[1], atol=1e-5,
        rtol=1e-5)


class ForwardModeTest(chex.TestCase):

  def test_jacfwd_equals_jacrev_and_dense(self):
    q, k, v = _qkv(t=6, s=9, b=1, n=1, h=4)
    f = lambda q: _attend(FLASH)(q, k, v)  # noqa: E731
    fwd, rev = jax.jacfwd(f)(q), jax.jacrev(f)(q)
    dense = jax.jacfwd(lambda q: _attend("dense")(q, k, v))(q)
    # (float32 sums of a few products: 1e-5)
    chex.assert_trees_all_close(fwd, rev, atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(fwd, dense, atol=1e-5, rtol=1e-5)

  def test_hessian_vector_product_equals_dense(self):
    # Forward over reverse: jax.jvp of jax.grad differentiates the
    # backward pass forward (a Hessian-vector product).
    q, k, v = _qkv()
    t = _data.normal(20, q.shape)

    def hvp(impl):
      loss = lambda q: jnp.sum(jnp.sin(_attend(impl)(q, k, v)))  # noqa: E731
      return jax.jit(lambda q, t: jax.jvp(jax.grad(loss), (q,), (t,))[1])(
          q, t)

    # (second derivatives in float32: sums of more products, 1e-4)
    chex.assert_trees_all_close(hvp(FLASH), hvp("dense"), atol=1e-4,
                                rtol=1e-4)

  def test_check_grads_both_modes_with_dropout(self):
    q, k, v = _qkv(t=12, s=20, b=1, n=2, h=4)
    f = _attend(FLASH, aj.Mask(causal=True, kv_lengths=jnp.array([17])),
                dropout_rate=0.3, dropout_rng=jax.random.key(2))
    # (float32 finite differences: the tolerance check_grads uses for it)
    jtu.check_grads(f, (q, k, v), order=1, modes=("fwd", "rev"), atol=2e-2,
                    rtol=2e-2)

  def test_reverse_over_forward_raises(self):
    # jax.grad of a jax.jvp would transpose the tangent pass's loops: JAX
    # refuses (no silent number).
    q, k, v = _qkv(t=8, s=8, b=1, n=1, h=4)
    f = lambda q: jax.jvp(lambda q: _attend(FLASH)(q, k, v), (q,),  # noqa: E731
                          (q,))[1].sum()
    with self.assertRaisesRegex(ValueError, "Reverse-mode differentiation"):
      jax.grad(f)(q)

  def test_custom_vjp_kernels_refuse_forward_over_reverse_by_name(self):
    q, k, v = _qkv(t=16, s=16, b=1, n=1, h=8)
    kernel = aj.kernels.PallasGpu(block_q=16, block_k=16, interpret=True)
    loss = lambda q: jnp.sum(_attend(kernel)(q, k, v))  # noqa: E731
    with self.assertRaisesRegex(ValueError, r"implementation='pallas_gpu' "
                                r"has no forward-mode AD"):
      jax.jvp(jax.grad(loss), (q,), (q,))
    # reverse mode is the kernel's own backward
    chex.assert_trees_all_close(
        jax.grad(loss)(q), jax.grad(lambda q: jnp.sum(_attend("dense")(
            q, k, v)))(q), atol=1e-5, rtol=1e-5)


class UnperturbedInputsTest(chex.TestCase):
  """Inputs JAX knows are constant (symbolic zeros) cost no tangent dots."""

  @staticmethod
  def _in(args, which):
    """``f(*perturbed)`` with the inputs not in ``which`` held constant."""
    def pick(f):
      def g(*perturbed):
        full = list(args)
        for i, x in zip(which, perturbed):
          full[i] = x
        return f(*full)
      return g
    return pick

  def test_tangents_in_some_inputs_equal_dense_both_modes(self):
    q, k, v = _qkv(t=20, s=28, b=1, n=2, h=8)
    t = tuple(_data.normal(30 + i, x.shape) for i, x in enumerate((q, k, v)))
    for which in ((0,), (1,), (2,), (0, 2)):
      pick = self._in((q, k, v), which)
      flash, dense = pick(_attend(FLASH)), pick(_attend("dense"))
      primals = tuple((q, k, v)[i] for i in which)
      tangents = tuple(t[i] for i in which)
      # (float32 sums of a few dozen products: 1e-5)
      chex.assert_trees_all_close(
          jax.jvp(flash, primals, tangents)[1],
          jax.jvp(dense, primals, tangents)[1], atol=1e-5, rtol=1e-5)
      loss = lambda f: lambda *x: jnp.sum(jnp.sin(f(*x)))  # noqa: E731
      chex.assert_trees_all_close(
          jax.grad(loss(flash), argnums=tuple(range(len(which))))(*primals),
          jax.grad(loss(dense), argnums=tuple(range(len(which))))(*primals),
          atol=1e-5, rtol=1e-5)

  def test_unperturbed_inputs_make_no_dots(self):
    # The compiled jax.jvp's dots, counted in its program: the forward's
    # two products per block body, then per tangent body q k^T again and
    # one per perturbed input's term (dq k^T, q dk^T, (P * dS) v, P dv).
    q, k, v = _qkv(t=16, s=24, b=1, n=1, h=8)
    flash = aj.kernels.Flash(block_q=16, block_k=24)  # one block: one body

    def dots(which):
      f = self._in((q, k, v), which)(_attend(flash, mask=None))
      primals = tuple((q, k, v)[i] for i in which)
      text = jax.jit(lambda *x: jax.jvp(f, x, x)).lower(*primals).as_text()
      return text.count("stablehlo.dot_general")

    self.assertEqual(dots((0, 1, 2)), 2 + 5)
    self.assertEqual(dots((0,)), 2 + 3)
    self.assertEqual(dots((2,)), 2 + 2)


class LinearMapTest(chex.TestCase):
  """The primitive on a toy map y = c * x (residual c), transpose by hand."""

  @staticmethod
  def _scale(c, x):
    return linear_map.linear_map(lambda c, x: c * x, lambda c, ct: c * ct,
                                 c, x)

  def test_vmap_sums_the_cotangent_of_an_unmapped_linear_input(self):
    c = jnp.arange(1.0, 4.0)  # mapped residual
    x = jnp.array(2.0)  # one linear input shared by the map
    grad = jax.grad(lambda x: jax.vmap(self._scale, (0, None))(c, x).sum())(x)
    self.assertAlmostEqual(float(grad), 6.0)

  def test_nested_vmaps_map_their_own_axes(self):
    # y = c @ x under two vmaps with different axes and sizes (2 outer, 3
    # inner): forward and transpose against the plain einsum (exact in
    # float32 up to summation order: 1e-5).
    c = _data.normal(0, (2, 3, 4, 5))  # [A, B, I, J]
    x = _data.normal(1, (5, 2))  # [J, A]: the outer level maps axis 1
    def f(x):
      one = lambda c, x: linear_map.linear_map(  # noqa: E731
          lambda c, x: c @ x, lambda c, ct: c.T @ ct, c, x)
      return jax.vmap(jax.vmap(one, (0, None)), (0, 1))(c, x)  # [A, B, I]
    want = lambda x: jnp.einsum("abij,ja->abi", c, x)  # noqa: E731
    chex.assert_trees_all_close(jax.jvp(f, (x,), (x,))[1],
                                want(x), atol=1e-5, rtol=1e-5)
    ct = _data.normal(2, (2, 3, 4))
    chex.assert_trees_all_close(jax.vjp(f, x)[1](ct),
                                jax.vjp(want, x)[1](ct), atol=1e-5, rtol=1e-5)

  def test_forward_rule_in_the_residuals(self):
    # d/dc (c * x) = x: jax.jvp through the residual
    _, tangent = jax.jvp(lambda c: self._scale(c, jnp.float32(3.0)),
                         (jnp.float32(2.0),), (jnp.float32(1.0),))
    self.assertAlmostEqual(float(tangent), 3.0)

  def test_refusal_raises_only_when_evaluated(self):
    def f(x):
      return linear_map.linear_map(lambda c, x: c * x, lambda c, ct: c * ct,
                                   jnp.float32(2.0), x, refusal="no tangent")

    @jax.custom_jvp
    def g(x):
      return 2.0 * x

    g.defjvp(lambda p, t: (g(*p), f(*t)))
    self.assertAlmostEqual(float(jax.grad(g)(jnp.float32(1.0))), 2.0)
    with self.assertRaisesRegex(ValueError, "no tangent"):
      jax.jvp(g, (jnp.float32(1.0),), (jnp.float32(1.0),))


if __name__ == "__main__":
  absltest.main()
