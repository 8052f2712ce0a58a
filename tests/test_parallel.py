"""Mesh flags and head-parallel set-up on however many devices the suite has
(one); the 8-device behaviour is in tests/multidevice/."""

import dataclasses

from absl.testing import absltest
from absl.testing import parameterized
import chex
from flax import nnx
import jax

import attention_jax as aj
from experiments import parallel
from tests import _data


class ParseMeshTest(parameterized.TestCase):

  def test_default_is_all_devices_on_data(self):
    self.assertEqual(parallel.parse_mesh(""),
                     {"data": jax.device_count()})

  def test_explicit_and_remaining(self):
    self.assertEqual(parallel.parse_mesh("data:1,model:1"),
                     {"data": 1, "model": 1})
    self.assertEqual(parallel.parse_mesh("model:1,data:-1"),
                     {"model": 1, "data": jax.device_count()})

  @parameterized.parameters(
      ("batch:2", "axes from"),
      ("data:2,data:1", "each at most once"),
      ("data", "must look like"),
      ("data:x", "must be an integer"),
      ("data:0", "must be positive"),
      ("data:-1,model:-1", "at most one axis may be -1"),
      ("data:4096", "needs 4096 devices, but JAX sees"),
  )
  def test_bad_specs_name_the_problem(self, spec, message):
    with self.assertRaisesRegex(ValueError, message):
      parallel.parse_mesh(spec)

  def test_batch_must_split_over_data(self):
    mesh = parallel.build_mesh({"data": 1})
    parallel.check_batch(3, mesh)  # anything splits over one device
    self.assertEqual(dict(mesh.shape),
                     {"data": 1, "ring": 1, "seq": 1, "model": 1})

  def test_sequence_axes(self):
    self.assertEqual(parallel.parse_mesh("data:1,seq:1,ring:1"),
                     {"data": 1, "seq": 1, "ring": 1})
    mesh = parallel.build_mesh({"data": 1})
    self.assertEqual(parallel.sequence_devices(mesh), 1)
    parallel.check_no_sequence_axes(mesh, "x")  # nothing split: fine


class SequenceMeshTest(absltest.TestCase):
  """What a mesh that splits sequences means to the experiments, read off
  the mesh alone (a one-device mesh cannot split; these use a stand-in)."""

  class _Mesh:
    def __init__(self, **sizes):
      self.shape = {"data": 1, "ring": 1, "seq": 1, "model": 1, **sizes}

  def test_other_experiments_refuse_a_sequence_split(self):
    with self.assertRaisesRegex(ValueError, r"only --experiment=lm"):
      parallel.check_no_sequence_axes(self._Mesh(seq=4), "this experiment")

  def test_lm_attention_by_mesh(self):
    from experiments import lm  # noqa: PLC0415
    config = lm.LMConfig()
    self.assertIsNone(lm.sequence_attention(config, self._Mesh(data=8)))
    ring = lm.sequence_attention(config, self._Mesh(data=2, seq=4))
    self.assertEqual((ring.method, ring.layout, ring.batch_axis,
                      ring.head_axis), ("ring", "zigzag", "data", None))
    self.assertEqual(lm.layout_devices(config, self._Mesh(data=2, seq=4)), 4)
    hybrid = dataclasses.replace(config, sequence_parallel="hybrid")
    got = lm.sequence_attention(hybrid, self._Mesh(ring=2, seq=2, model=2))
    self.assertEqual((got.method, got.ring_axis, got.head_axis),
                     ("hybrid", "ring", "model"))
    self.assertEqual(lm.layout_devices(hybrid, self._Mesh(ring=2, seq=2)), 2)
    with self.assertRaisesRegex(ValueError, r"hybrid needs both"):
      lm.sequence_attention(hybrid, self._Mesh(seq=4))
    with self.assertRaisesRegex(ValueError, r"hybrid needs both"):
      lm.sequence_attention(config, self._Mesh(ring=2, seq=2))


class HeadAxisTest(absltest.TestCase):

  def test_needs_a_mesh_with_the_axis(self):
    with self.assertRaisesRegex(ValueError, "head_axis='model' shards the "
                                "parameters .* jax.set_mesh"):
      aj.MultiHeadAttention(16, 4, head_axis="model", rngs=nnx.Rngs(0))

  def test_one_device_mesh_gives_the_plain_numbers(self):
    x = _data.normal(0, (2, 5, 16))
    plain = aj.MultiHeadAttention(16, 4, rngs=nnx.Rngs(0))
    mesh = parallel.build_mesh({"data": 1, "model": 1})
    with jax.set_mesh(mesh):
      sharded = aj.MultiHeadAttention(16, 4, head_axis="model",
                                      rngs=nnx.Rngs(0))
      got = sharded(x, is_causal=True)
    self.assertEqual(sharded.W_q.kernel[...].sharding.spec,
                     jax.sharding.PartitionSpec(None, "model", None))
    chex.assert_trees_all_equal(got, plain(x, is_causal=True))


if __name__ == "__main__":
  absltest.main()
