"""Score modifiers: the built-ins against their papers, closures in kernels."""

import functools
import math

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from tests import _data


def _paper_alibi_slopes(n):
  """ALiBi's slopes as the paper's reference code computes them (float64).

  Press et al. 2022: for ``n`` a power of two, the geometric sequence
  starting at ``2**(-2**-(log2(n) - 3))`` with that ratio; otherwise the
  closest smaller power of two's slopes, then every other slope of twice
  that power (``[0::2]``), as many as are missing.
  """
  def power_of_2(n):
    start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
    return [start * start ** i for i in range(n)]

  if math.log2(n).is_integer():
    return power_of_2(n)
  closest = 2 ** math.floor(math.log2(n))
  return (power_of_2(closest)
          + _paper_alibi_slopes(2 * closest)[0::2][:n - closest])


class AlibiSlopesTest(absltest.TestCase):

  def test_equal_the_paper_for_1_to_12_heads(self):
    for n in range(1, 13):
      got = np.asarray(aj.alibi_slopes(n))
      self.assertEqual(got.shape, (n,))
      # float32 rounding of float64 powers of two and their products: 1e-6.
      np.testing.assert_allclose(got, _paper_alibi_slopes(n), rtol=1e-6,
                                 atol=0, err_msg=f"{n} heads")
      self.assertLen(set(got.tolist()), n, f"{n} heads share a slope")


if __name__ == "__main__":
  absltest.main()


def _closure_problem(t):
  q = _data.normal(30, (1, 2, t, 8))
  k = _data.normal(31, (1, 2, t, 8))
  v = _data.normal(32, (1, 2, t, 8))
  cot = _data.normal(33, (1, 2, t, 8))
  return q, k, v, cot


def _penalised_reference(slope, q, k, v, cot):
  """float64 causal attention with a learned ALiBi slope, and its loss."""
  t = q.shape[2]
  distance = (jnp.arange(t)[:, None] - jnp.arange(t)[None, :])[None, None]
  logits = jnp.einsum("BNTH,BNSH->BNTS", q, k) / np.sqrt(q.shape[-1])
  logits = jnp.where(distance >= 0, logits - slope * distance, -jnp.inf)
  out = jax.nn.softmax(logits, -1) @ v
  return jnp.sum(out * cot)


class ClosureTest(absltest.TestCase):
  """A score_mod closing over a traced, differentiated value."""

  def test_gradients_reach_a_closed_over_parameter_in_every_kernel(self):
    # The flash kernels' custom VJP cannot see a closure; the value is
    # hoisted (jax.closure_convert) and differentiated as an operand. At
    # T = 1024 the automatic choice runs blockwise (where this used to be
    # an UnexpectedTracerError); dense and blockwise with small blocks too.
    slope = jnp.float32(0.05)
    cases = {"auto": (1024, {}), "flash": (40, dict(
        implementation="flash")), "dense": (40, dict(
            implementation="dense"))}
    for name, (t, kwargs) in cases.items():
      q, k, v, cot = _closure_problem(t)

      def loss(slope, q, k, v, cot=cot, kwargs=kwargs):
        mod = lambda s, b, h, qi, ki: s - slope * (qi - ki)  # closes over slope
        out = aj.scaled_dot_product_attention(
            q, k, v, is_causal=True, score_mod=mod, **kwargs)
        return jnp.sum(out * cot)

      got = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(slope, q, k, v)
      with jax.enable_x64(True):
        f64 = lambda x: jnp.asarray(x, jnp.float64)  # noqa: E731
        want = jax.jit(jax.grad(_penalised_reference, argnums=(0, 1, 2, 3)))(
            f64(slope), f64(q), f64(k), f64(v), f64(cot))
      for n, g, w in zip(("dslope", "dq", "dk", "dv"), got, want):
        # float32 sums over up to 1024 keys against float64: 1e-4 of scale.
        w = np.asarray(w)
        np.testing.assert_allclose(
            np.asarray(g, np.float64), w, rtol=1e-4,
            atol=1e-4 * max(1.0, float(np.abs(w).max())),
            err_msg=f"{name} {n}")


class IndexTest(absltest.TestCase):

  def test_b_and_h_name_the_example_and_the_query_head(self):
    # score + table[b, h] must equal the same numbers given as a bias, in
    # every in-process kernel, with grouped heads (N = 4 over K = 2) and
    # with [B, T, H] operands (h = 0).
    table = _data.normal(50, (2, 4))  # [B, N]
    q = _data.normal(51, (2, 4, 6, 8))
    k, v = _data.normal(52, (2, 2, 9, 8)), _data.normal(53, (2, 2, 9, 8))
    mod = aj.ScoreMod(lambda s, b, h, qi, ki, t: s + t[b, h], table)
    want = aj.scaled_dot_product_attention(q, k, v, bias=table[..., None, None],
                                           implementation="dense")
    for impl in ("dense", "flash"):
      got = jax.jit(functools.partial(
          aj.scaled_dot_product_attention, implementation=impl))(
              q, k, v, score_mod=mod)
      # the same float32 sums in another order: 1e-6
      np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6,
                                 err_msg=impl)
    flat = aj.ScoreMod(lambda s, b, h, qi, ki, t: s + t[b] + 10.0 * h,
                       table[:, 0])
    got = aj.scaled_dot_product_attention(q[:, 0], k[:, 0], v[:, 0],
                                          score_mod=flat)
    want = aj.scaled_dot_product_attention(
        q[:, 0], k[:, 0], v[:, 0], bias=table[:, 0, None, None])
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)


class ChainTest(absltest.TestCase):

  def test_a_soft_cap_after_a_blocking_modifier_keeps_the_block(self):
    # The cap alone maps -inf to -cap; in a chain, what an earlier modifier
    # blocked stays blocked: equal to the same block as a mask, capped.
    q, k, v = (_data.normal(i, (1, 2, 8, 8)) for i in (70, 71, 72))
    diagonal = aj.ScoreMod(lambda s, b, h, qi, ki, p: jnp.where(
        qi == ki, -jnp.inf, s))
    off_diagonal = ~jnp.eye(8, dtype=bool)[None, None]
    for impl in ("dense", "flash"):
      got = aj.scaled_dot_product_attention(
          q, k, v, score_mod=aj.chain(diagonal, aj.soft_cap(2.0)),
          implementation=impl)
      want = aj.scaled_dot_product_attention(
          q, k, v, off_diagonal, score_mod=aj.soft_cap(2.0),
          implementation="dense")
      np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6,
                                 err_msg=impl)


class QueryTemperatureTest(absltest.TestCase):

  def test_positions_from_one_or_zero(self):
    # 1 + s * log1p(floor((i + offset) / F)), F = 4, s = 0.5, i = 0..8.
    i = np.arange(9.0)
    for offset in (1, 0):
      mod = aj.query_temperature(floor_scale=4.0, attn_scale=0.5,
                                 offset=offset)
      got = mod(jnp.ones((9, 1)), 0, 0, jnp.arange(9)[:, None], 0).ravel()
      want = 1 + 0.5 * np.log1p(np.floor((i + offset) / 4.0))
      np.testing.assert_allclose(got, want, rtol=1e-6)  # float32 log1p
    with self.assertRaisesRegex(ValueError, "offset must be 1"):
      aj.query_temperature(floor_scale=4.0, attn_scale=0.5, offset=2)
