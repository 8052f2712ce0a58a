"""Head parallelism on a mesh of explicit axes (``AxisType.Explicit``).

With explicit axes the shardings are part of the array types: the ``W_o``
head sum contracts the heads axis split over ``model`` and must name its
output sharding, and the per-head attention mixes operands of different
shardings (queries split over batch and heads beside replicated sinks or a
memory's keys). Each layer below equals the unsharded one, under ``nnx.jit``
and eagerly, decoding included; so does the pure function on explicitly
sharded params.
"""

from absl.testing import absltest
from absl.testing import parameterized
import chex
from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import attention_jax as aj
from attention_jax.layers import multi_head
from attention_jax.layers import sharding
from tests import _data

# Sharding changes only which device sums what: float32 rounding.
TOL = dict(atol=1e-5, rtol=1e-5)
EXPLICIT = (jax.sharding.AxisType.Explicit,) * 2


def _mesh(data=2, model=4):
  return jax.make_mesh((data, model), ("data", "model"), axis_types=EXPLICIT)


class ExplicitAxesTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.mesh = _mesh()
    self.x = _data.normal(0, (4, 6, 32))  # [B, T, D]
    self.memory = _data.normal(1, (4, 9, 32))  # [B, S, D]

  def _pair(self, **kwargs):
    plain = aj.MultiHeadAttention(32, 8, rngs=nnx.Rngs(0), **kwargs)
    if plain.sinks is not None:  # non-zero sinks, the same in both
      plain.sinks[...] = _data.normal(2, (8,))
    with jax.set_mesh(self.mesh):
      sharded = aj.MultiHeadAttention(32, 8, rngs=nnx.Rngs(0),
                                      head_axis="model", **kwargs)
      if sharded.sinks is not None:
        sharded.sinks[...] = _data.normal(2, (8,))
    return plain, sharded

  @parameterized.named_parameters(
      ("self_causal", dict(), dict(is_causal=True), False),
      ("cross_gqa", dict(num_kv_heads=4), dict(), True),
      ("flash", dict(attention_fn="flash"), dict(), True),
      ("sinks_t5_gate_norm_rope", dict(
          attention_sinks=True, t5_bias=aj.T5Bias(8, 16),
          output_gate="headwise", normalize_qk=True, rope=aj.Rope(base=100.0)),
       dict(is_causal=True), False),
  )
  def test_equals_unsharded(self, init, call, cross):
    plain, sharded = self._pair(**init)
    self.assertEqual(jax.typeof(sharded.W_o.kernel[...]).sharding.spec,
                     P("model", None, None))
    args = (self.x, self.memory) if cross else (self.x,)
    want = plain(*args, **call)
    with jax.set_mesh(self.mesh):
      x = jax.device_put(self.x, NamedSharding(self.mesh, P("data")))
      args = (x, self.memory) if cross else (x,)  # memory replicated
      got = nnx.jit(lambda m, *a: m(*a, **call))(sharded, *args)
      eager = sharded(*args, **call)
    self.assertEqual(jax.typeof(got).sharding.spec, P("data", None, None))
    chex.assert_trees_all_close(got, want, **TOL)
    chex.assert_trees_all_close(eager, want, **TOL)

  def test_weights_and_lse_keep_the_heads_split(self):
    plain, sharded = self._pair(num_kv_heads=4)
    want = plain(self.x, return_weights=True, return_lse=True)
    with jax.set_mesh(self.mesh):
      x = jax.device_put(self.x, NamedSharding(self.mesh, P("data")))
      got = nnx.jit(lambda m, x: m(x, return_weights=True, return_lse=True))(
          sharded, x)
    self.assertEqual(jax.typeof(got[1]).sharding.spec,
                     P("data", "model", None, None))
    self.assertEqual(jax.typeof(got[2]).sharding.spec,
                     P("data", "model", None))
    chex.assert_trees_all_close(got, want, **TOL)

  def test_decode_with_sharded_cache(self):
    plain, sharded = self._pair(num_kv_heads=4, attention_sinks=True)
    plain.init_cache(4, 8)
    want = [plain(self.x[:, :5], decode=True),
            plain(self.x[:, 5:6], decode=True)]
    with jax.set_mesh(self.mesh):
      sharded.init_cache(4, 8)
      step = nnx.jit(lambda m, x: m(x, decode=True))
      got = [step(sharded, self.x[:, :5]), step(sharded, self.x[:, 5:6])]
    chex.assert_trees_all_close(got, want, **TOL)

  def test_function_on_explicitly_sharded_params(self):
    params = aj.init_multi_head_params(jax.random.key(0), 32, 8,
                                       num_kv_heads=4)
    x = jnp.asarray(self.x)
    want = aj.multi_head_attention(params, x, x, x, is_causal=True)
    specs = sharding.projection_specs("model")
    with jax.set_mesh(self.mesh):
      placed = {name: {entry: jax.device_put(
          value, NamedSharding(self.mesh, P(*specs[name][entry])))
                       for entry, value in layer.items()}
                for name, layer in params.items()}
      xs = jax.device_put(x, NamedSharding(self.mesh, P("data")))
      got = jax.jit(lambda p, x: aj.multi_head_attention(
          p, x, x, x, is_causal=True))(placed, xs)
      # output_projection alone: heads split over model, summed over it.
      heads = jax.device_put(_data.normal(3, (4, 8, 6, 4)), NamedSharding(
          self.mesh, P("data", "model")))
      summed = multi_head.output_projection(heads, placed["W_o"])
    chex.assert_trees_all_close(got, want, **TOL)
    self.assertEqual(jax.typeof(summed).sharding.spec, P("data", None, None))
    # Outside the mesh block too: the arrays carry their mesh.
    chex.assert_trees_all_close(
        multi_head.output_projection(heads, placed["W_o"]), summed, **TOL)
    chex.assert_trees_all_close(
        summed, multi_head.output_projection(
            _data.normal(3, (4, 8, 6, 4)), params["W_o"]), **TOL)


if __name__ == "__main__":
  absltest.main()
