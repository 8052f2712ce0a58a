"""A multi-head layer's params and options: refused by name, or run right.

What used to pass silently or blame the wrong argument: a rope whose
partial width ``int(H * fraction)`` is odd (one feature fewer rotated), a
mis-sized ``W_q`` reported as ``W_o``'s or ``W_k``'s fault, a params dict
without a ``W_k`` bias (a legitimate layout, Whisper's: run as it is by the
function, loaded into a module as the zero bias it is), and a module's
``scale`` given as a concrete float scalar array (refused, where
``aj.scaled_dot_product_attention`` takes one).
"""

from absl.testing import absltest
from absl.testing import parameterized
import chex
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.layers import multi_head_params
from tests import _data
from tests import reference

D, N = 8, 2  # H = 4
# float32 projections of 8 terms and a softmax over 5 keys against float64:
# errors ~1e-6 (as tests/test_layer_params.py).
TOL = dict(atol=2e-5, rtol=2e-5)
EXACT = dict(atol=0, rtol=0)  # the same float32 program: bitwise equal


def _params(seed=0, **kwargs):
  return _data.params(aj.init_multi_head_params, seed, D, N, **kwargs)


def _x(seed=1, t=5):
  return _data.normal(seed, (2, t, D))


def _module(**kwargs):
  return aj.MultiHeadAttention(D, N, rngs=nnx.Rngs(0), **kwargs)


def _without(params, name, entry="bias"):
  return {k: ({e: a for e, a in v.items() if (k, e) != (name, entry)})
          for k, v in params.items()}


class RopeWidthTest(absltest.TestCase):

  def test_an_odd_width_is_refused_when_the_layer_is_built(self):
    # D=12, N=2: H=6, half of it is 3 features (it rotated 2).
    pattern = (r"rope does not fit this layer's heads \(head dim H=6\): "
               r"fraction=0.5 of head dim H=6 gives int\(H \* fraction\) = "
               r"3 rotated features, an odd count.*0.6666666666666666 \(4 "
               r"of 6\)")
    with self.assertRaisesRegex(ValueError, pattern):
      aj.MultiHeadAttention(12, 2, rngs=nnx.Rngs(0),
                            rope=aj.Rope(fraction=0.5))
    params = _data.params(aj.init_multi_head_params, 0, 12, 2)
    x = _data.normal(1, (1, 3, 12))
    with self.assertRaisesRegex(ValueError, pattern):
      aj.multi_head_attention(params, x, x, x, rope=aj.Rope(fraction=0.5))
    aj.MultiHeadAttention(12, 2, rngs=nnx.Rngs(0),  # 4 of 6: even, built
                          rope=aj.Rope(fraction=0.6666666666666666))


class BiasLayoutTest(absltest.TestCase):

  def test_no_w_k_bias_runs_as_the_formula(self):
    # Whisper's layout: q/v/o biases, none on k. With rope the k bias would
    # turn with the keys (not a constant per row): its absence matters.
    params = _without(_params(), "W_k")
    x = _x()
    pos = np.arange(5)
    got = aj.multi_head_attention(params, x, x, x, rope=aj.Rope())
    want, _ = reference.multi_head_attention(
        jax.tree.map(np.asarray, params), x, x, x, rope_base=10000.0,
        query_positions=pos, key_positions=pos)
    chex.assert_trees_all_close(got, want.astype(np.float32), **TOL)

  def test_a_module_loads_it_as_the_zero_bias_it_is(self):
    params = _without(_params(), "W_k")
    mha = _module(rope=aj.Rope())
    before = mha.W_q.kernel[...]
    with self.assertRaisesRegex(
        ValueError, r"params\['W_k'\] has no 'bias', but this module's W_k "
        r"has one \(use_bias=True\).*add params\['W_k'\]\['bias'\] = zeros "
        r"\(2, 4\)"):
      mha.load_params(params)
    np.testing.assert_array_equal(mha.W_q.kernel[...], before)  # untouched
    zero = {**params, "W_k": {**params["W_k"], "bias": jnp.zeros((N, 4))}}
    mha.load_params(zero)
    x = _x()
    chex.assert_trees_all_close(
        mha(x), aj.multi_head_attention(params, x, x, x, rope=aj.Rope()),
        **EXACT)

  def test_biases_into_a_module_without_them(self):
    with self.assertRaisesRegex(
        ValueError, r"params\['W_q'\] has a 'bias', but this module's W_q "
        r"has none \(use_bias=False\): build it with use_bias=True"):
      _module(use_bias=False).load_params(_params())

  def test_a_none_bias_is_refused(self):
    params = _params()
    params["W_k"]["bias"] = None
    with self.assertRaisesRegex(
        ValueError, r"params\['W_k'\]\['bias'\] is None: leave the entry out "
        r"for a projection without a bias, or give \[K, H\]"):
      multi_head_params.param_dims(params)


class MisSizedParamTest(absltest.TestCase):

  def test_load_params_names_w_q_against_the_module(self):
    # W_q with 4 heads (its bias too) for a 2-head module: W_o's N=2
    # disagrees with it, and was the one blamed.
    params = _params()
    params["W_q"] = {"kernel": jnp.ones((D, 4, 4)), "bias": jnp.ones((4, 4))}
    mha = _module()
    before = mha.W_q.kernel[...]
    with self.assertRaisesRegex(
        ValueError, r"params\['W_q'\]\['kernel'\] has shape \(8, 4, 4\), but "
        r"this module's is \(8, 2, 4\) \(kernel \[D, N, H\], bias \[N, H\]; "
        r"d_model=8, num_heads=2"):
      mha.load_params(params)
    np.testing.assert_array_equal(mha.W_q.kernel[...], before)

  def test_params_name_the_one_against_the_others(self):
    params = _params()
    params["W_q"] = {**params["W_q"], "kernel": jnp.ones((D, 4, 4))}
    with self.assertRaisesRegex(
        ValueError, r"params\['W_q'\]\['kernel'\] has shape \(8, 4, 4\), "
        r"expected \[D, N, H\] with D=8, N=2, H=4 \(N=2: the query heads the "
        r"W_o kernel and the W_q bias agree on\)"):
      multi_head_params.param_dims(params)
    params = _params()
    params["W_q"] = {**params["W_q"], "kernel": jnp.ones((D, 2, 5)),
                     "bias": jnp.ones((2, 5))}
    with self.assertRaisesRegex(
        ValueError, r"params\['W_q'\]\['kernel'\] has shape \(8, 2, 5\), "
        r"expected \[D, N, H\] with D=8, N=2, H=4 \(H=4: the head dim the "
        r"W_k/W_v/W_o kernels and the W_k/W_v biases agree on\)"):
      multi_head_params.param_dims(params)

  def test_a_tie_names_both(self):
    # Without a W_q bias only W_q and W_o hold N: either may be wrong.
    params = _without(_params(), "W_q")
    params["W_q"] = {"kernel": jnp.ones((D, 4, 4))}
    with self.assertRaisesRegex(
        ValueError, r"params\['W_q'\]\['kernel'\] \(8, 4, 4\) \(N=4\) and "
        r"params\['W_o'\]\['kernel'\] \(2, 4, 8\) \(N=2\) disagree on N, the "
        r"query heads"):
      aj.multi_head_attention(params, _x(), _x(), _x())


class ScaleTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("jax", jnp.float32(0.3)), ("numpy_0d", np.asarray(0.3, np.float32)),
      ("numpy_scalar", np.float32(0.3)))
  def test_a_concrete_float_scalar_is_its_float(self, scale):
    mha = _module(scale=scale)
    self.assertIs(type(mha.scale), float)
    self.assertEqual(mha.scale, float(np.float32(0.3)))
    x = _x()
    want, _ = reference.multi_head_attention(
        jax.tree.map(np.asarray, mha.params_dict()), x, x, x,
        scale=float(np.float32(0.3)))
    chex.assert_trees_all_close(mha(x), want.astype(np.float32), **TOL)

  def test_a_concrete_array_closed_over_by_jit_is_accepted(self):
    scale = jnp.float32(0.3)
    built = jax.jit(lambda: jnp.float32(_module(scale=scale).scale))()
    self.assertEqual(float(built), float(np.float32(0.3)))

  def test_refused(self):
    def build(s):
      _module(scale=s)
      return s
    with self.assertRaisesRegex(
        TypeError, r"scale is a traced value: a module's scale is static "
        r"configuration.*learned scale in the params"):
      jax.jit(build)(jnp.float32(0.3))
    with self.assertRaisesRegex(
        TypeError, r"float scalar array \(shape \(\)\), got an array of "
        r"dtype float32 with shape \(2,\)"):
      _module(scale=jnp.full((2,), 0.3))
    with self.assertRaisesRegex(TypeError, r"dtype int32 with shape \(\)"):
      _module(scale=jnp.int32(2))
    with self.assertRaisesRegex(ValueError, r"scale must be positive"):
      _module(scale=jnp.float32(-0.3))

  def test_the_function_takes_the_same_scales(self):
    # A call's scale: a float, a concrete or a traced scalar array alike.
    params, x = _params(), _x()
    want = aj.multi_head_attention(params, x, x, x, scale=0.3)
    got = {
        "concrete": aj.multi_head_attention(params, x, x, x,
                                            scale=jnp.float32(0.3)),
        "traced": jax.jit(lambda s: aj.multi_head_attention(
            params, x, x, x, scale=s))(jnp.float32(0.3)),
    }
    for name, out in got.items():
      # The traced scale folds into the queries: rounding apart.
      chex.assert_trees_all_close(out, want, atol=1e-6, rtol=1e-6,
                                  custom_message=name)


if __name__ == "__main__":
  absltest.main()
