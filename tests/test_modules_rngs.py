"""Which rng stream the modules' dropout uses, and the errors when none fits."""

from absl.testing import absltest
from absl.testing import parameterized
import chex
from flax import nnx
import jax
import jax.numpy as jnp

import attention_jax as aj
from tests import _data

_NO_STREAM = (r"dropout_rate=0.1 needs a 'dropout' or 'default' stream in "
              r"rngs: nnx\.Rngs\(params=0, dropout=1\)")


def _mha(rngs, dropout_rate=0.1):
  return aj.MultiHeadAttention(16, 4, dropout_rate=dropout_rate, rngs=rngs)


def _x():
  return _data.normal(0, (2, 5, 16))


def _differs(a, b):
  return float(jnp.abs(a - b).max()) > 1e-3


class ConstructionTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("dropout_stream", lambda: nnx.Rngs(params=0, dropout=1), 0.1),
      ("default_stream", lambda: nnx.Rngs(0), 0.1),
      ("default_and_params", lambda: nnx.Rngs(0, params=1), 0.1),
      ("no_dropout_needs_no_stream", lambda: nnx.Rngs(params=0), 0.0),
  )
  def test_builds(self, make_rngs, rate):
    mha = _mha(make_rngs(), rate)
    self.assertEqual(mha(_x()).shape, (2, 5, 16))
    self.assertEqual(mha.rngs is None, rate == 0.0)

  def test_no_dropout_or_default_stream_is_a_value_error(self):
    with self.assertRaisesRegex(ValueError, _NO_STREAM):
      _mha(nnx.Rngs(params=0))

  def test_dropout_stream_is_preferred_to_default(self):
    x = _x()
    both = _mha(nnx.Rngs(0, params=0, dropout=1))
    only_dropout = _mha(nnx.Rngs(params=0, dropout=1))
    chex.assert_trees_all_close(both(x), only_dropout(x), atol=0, rtol=0)

  @parameterized.named_parameters(
      ("bahdanau", lambda r: aj.BahdanauAttention(6, 4, 8, rngs=r),
       lambda key: aj.init_additive_params(key, 6, 4, 8), (2, 6), (2, 4)),
      ("luong", lambda r: aj.LuongAttention(4, 4, score="general", rngs=r),
       lambda key: aj.init_luong_params(key, 4, 4, score="general"),
       (2, 3, 4), (2, 3, 4)),
  )
  def test_decoder_attention_needs_only_params(self, make, init, q_shape,
                                               out_shape):
    # No dropout there, so no dropout stream: the params stream alone
    # builds the module, its parameters are exactly what the pure init
    # draws from that stream's first key (another seed draws others), and
    # it runs.
    module = make(nnx.Rngs(params=0))
    chex.assert_trees_all_equal(module.params_dict(),
                                init(nnx.Rngs(params=0).params()))
    other = make(nnx.Rngs(params=1)).params_dict()
    self.assertTrue(any(_differs(a, b) for a, b in zip(
        jax.tree.leaves(module.params_dict()), jax.tree.leaves(other))))
    out = module(_data.normal(1, q_shape), _data.normal(2, (2, 5, 4)))
    chex.assert_shape(out, out_shape)
    chex.assert_tree_all_finite(out)


class DefaultStreamDropoutTest(absltest.TestCase):

  def test_training_call_drops_and_is_reproducible(self):
    x = _x()
    mha = _mha(nnx.Rngs(0))
    a = mha(x, deterministic=True)
    t1, t2 = mha(x), mha(x)
    self.assertTrue(_differs(t1, a))
    self.assertTrue(_differs(t1, t2))  # the stream advances
    twin = _mha(nnx.Rngs(0))
    chex.assert_trees_all_close(twin(x), t1, atol=0, rtol=0)
    chex.assert_trees_all_close(twin(x), t2, atol=0, rtol=0)


class PerCallRngsTest(absltest.TestCase):

  def test_overrides_the_module_stream(self):
    x = _x()
    mha = _mha(nnx.Rngs(params=0, dropout=1))
    key = jax.random.key(7)
    chex.assert_trees_all_close(mha(x, rngs=key), mha(x, rngs=key), atol=0,
                                rtol=0)
    for make in (lambda: nnx.Rngs(dropout=3), lambda: nnx.Rngs(3)):
      chex.assert_trees_all_close(mha(x, rngs=make()), mha(x, rngs=make()),
                                  atol=0, rtol=0)
    self.assertTrue(_differs(mha(x, rngs=key), mha(x, deterministic=True)))

  def test_module_without_dropout_stream_uses_the_call_rngs(self):
    mha = _mha(nnx.Rngs(params=0), dropout_rate=0.0)
    mha.dropout_rate = 0.1  # no stream of its own
    x = _x()
    with self.assertRaisesRegex(ValueError, r"module has no rngs"):
      mha(x)
    key = jax.random.key(7)
    chex.assert_trees_all_close(mha(x, rngs=key), mha(x, rngs=key), atol=0,
                                rtol=0)

  def test_call_rngs_without_a_fitting_stream_is_a_value_error(self):
    mha = _mha(nnx.Rngs(params=0, dropout=1))
    with self.assertRaisesRegex(
        ValueError, r"'dropout' or 'default' stream in the call's rngs, which "
        r"has 'params'"):
      mha(_x(), rngs=nnx.Rngs(params=0))

  def test_call_rngs_of_another_type_is_a_type_error(self):
    mha = _mha(nnx.Rngs(params=0, dropout=1))
    with self.assertRaisesRegex(TypeError, r"rngs must be an nnx\.Rngs"):
      mha(_x(), rngs=7)


if __name__ == "__main__":
  absltest.main()
