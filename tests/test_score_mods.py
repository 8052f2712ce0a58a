"""Built-in score modifiers against the formulas of their papers."""

import math

from absl.testing import absltest
import numpy as np

import attention_jax as aj


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
