"""Head-parallel MultiHeadAttention: same numbers, and no collective inside."""

import re

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
from tests import _data

# Sharding changes only which device sums what: float32 rounding.
TOL = dict(atol=1e-5, rtol=1e-5)
COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute",
               "reduce-scatter")


def _mesh(data=2, model=4):
  return jax.make_mesh((data, model), ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _count(hlo: str) -> dict[str, int]:
  return {op: len(re.findall(rf"\b{op}(-start)?\(", hlo)) for op in COLLECTIVES}


class HeadParallelTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.mesh = _mesh()
    self.x = _data.normal(0, (4, 6, 32))  # [B, T, D]
    self.memory = _data.normal(1, (4, 9, 32))  # [B, S, D]

  def _pair(self, **kwargs):
    plain = aj.MultiHeadAttention(32, 8, rngs=nnx.Rngs(0), **kwargs)
    with jax.set_mesh(self.mesh):
      sharded = aj.MultiHeadAttention(32, 8, rngs=nnx.Rngs(0),
                                      head_axis="model", **kwargs)
    return plain, sharded

  @parameterized.named_parameters(
      ("self_causal", dict(), dict(is_causal=True), False),
      ("cross_gqa", dict(num_kv_heads=4), dict(), True),
      ("flash", dict(attention_fn="flash"), dict(), True),
  )
  def test_equals_unsharded(self, init, call, cross):
    plain, sharded = self._pair(**init)
    # Heads axis split: W_q/W_k/W_v [D, N, H] and [N, H], W_o [N, H, D].
    for name in ("W_q", "W_k", "W_v"):
      layer = getattr(sharded, name)
      self.assertEqual(layer.kernel[...].sharding.spec,
                       P(None, "model", None), name)
      self.assertEqual(layer.bias[...].sharding.spec, P("model", None), name)
    self.assertEqual(sharded.W_o.kernel[...].sharding.spec,
                     P("model", None, None))
    chex.assert_trees_all_equal(sharded.params_dict(), plain.params_dict())
    args = (self.x, self.memory) if cross else (self.x,)
    want = plain(*args, **call)
    with jax.set_mesh(self.mesh):
      x = jax.device_put(self.x, NamedSharding(self.mesh, P("data")))
      args = (x, self.memory) if cross else (x,)
      got = nnx.jit(lambda m, *a: m(*a, **call))(sharded, *args)
    chex.assert_trees_all_close(got, want, **TOL)

  def test_attention_core_has_no_collective(self):
    _, sharded = self._pair(num_kv_heads=4)
    graph, state = nnx.split(sharded)

    def forward(state, x):
      return nnx.merge(graph, state)(x, is_causal=True)

    with jax.set_mesh(self.mesh):
      x = jax.device_put(self.x, NamedSharding(self.mesh, P("data")))
      hlo = jax.jit(forward).lower(state, x).compile().as_text()
    # Heads stay on their devices through projection, softmax and weighting;
    # the only data communicated is summing the W_o partial products. The
    # kernels' one-bit question "does q, k or v hold a NaN or inf anywhere?"
    # (it decides whether the rows that may see one are looked for) is an
    # all-reduce of scalars (a float sum per array, or bools), per mesh axis.
    scalar = r"(?:pred|f32)\[\]"
    flags = re.findall(rf"= (?:\((?:{scalar}, )*{scalar}\)|{scalar}) "
                       r"all-reduce(?:-start)?\(", hlo)
    self.assertLessEqual(len(flags), 2, msg=flags)
    counts = _count(hlo)
    counts["all-reduce"] -= len(flags)
    self.assertEqual(counts, {**dict.fromkeys(COLLECTIVES, 0),
                              "all-reduce": 1}, msg=str(counts))

  def test_decode_with_sharded_cache(self):
    plain, sharded = self._pair(num_kv_heads=4)
    plain.init_cache(4, 8)
    want = [plain(self.x[:, :5], decode=True),
            plain(self.x[:, 5:6], decode=True)]
    with jax.set_mesh(self.mesh):
      sharded.init_cache(4, 8)
      self.assertEqual(sharded.cached_key[...].sharding.spec,
                       P(None, "model", None, None))
      step = nnx.jit(lambda m, x: m(x, decode=True))
      got = [step(sharded, self.x[:, :5]), step(sharded, self.x[:, 5:6])]
    chex.assert_trees_all_close(got, want, **TOL)

  def test_heads_must_divide_the_axis(self):
    with jax.set_mesh(_mesh(1, 8)), self.assertRaisesRegex(
        ValueError, "num_kv_heads=2 is not divisible by the size 8 of mesh "
        "axis"):
      aj.MultiHeadAttention(32, 8, num_kv_heads=2, head_axis="model",
                            rngs=nnx.Rngs(0))

  def test_pure_function_ignores_axis_without_mesh(self):
    params = aj.init_multi_head_params(jax.random.key(0), 32, 8)
    x = jnp.asarray(self.x)
    # head_axis is the module's (and forward's) only; the pure function's
    # path is forward without it.
    a = aj.multi_head_attention(params, x, x, x)
    b = multi_head.multi_head_attention(params, x, x, x, head_axis="model")
    chex.assert_trees_all_equal(a, b)


if __name__ == "__main__":
  absltest.main()
