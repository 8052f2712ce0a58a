"""Training on a data x model mesh equals single-device training; sharded
checkpoints restore, onto the same or another mesh."""

import dataclasses
import tempfile

from absl.testing import absltest
import chex
from flax import nnx
import jax
import numpy as np

from experiments import checkpoints
from experiments import parallel
from experiments import seq2seq
from experiments import training
from experiments import transformer

CONFIG = seq2seq.Seq2SeqConfig(
    transformer=transformer.TransformerConfig(d_model=16, num_heads=4,
                                              num_layers=1, ffn_dim=32),
    train=training.TrainConfig(steps=3, batch_size=8, max_len=6, log_every=1,
                               checkpoint_every=0))
# Same data, same initial values; only the order of the cross-device sums
# differs: float32 rounding over a few steps.
LOSS_TOL = 1e-5


def _build(name, mesh_spec, config=CONFIG):
  config = dataclasses.replace(
      config, train=dataclasses.replace(config.train, mesh=mesh_spec))
  mesh = training.training_mesh(config.train)
  with jax.set_mesh(mesh):
    model = seq2seq.build_model(name, config, mesh)
  return model, mesh, config


def _train(name, mesh_spec, checkpointer=None):
  model, mesh, config = _build(name, mesh_spec)
  stats = training.train(name, model, config.train, checkpointer, mesh)
  return np.array(stats["loss_curve"])[:, 1], model


class ShardedTrainingTest(absltest.TestCase):

  def test_loss_curve_equals_single_device(self):
    # data x model: the batch split 2 ways (gradient all-reduce) and heads
    # and FFN units 4 ways. GRU models take the same data path (replicated
    # over model), so one model covers both kinds.
    want, _ = _train("transformer", "data:1")
    got, model = _train("transformer", "data:2,model:4")
    np.testing.assert_allclose(got, want, atol=LOSS_TOL, rtol=LOSS_TOL)
    self.assertTrue(np.isfinite(got).all())
    leaf = jax.tree.leaves(nnx.state(model, nnx.Param))[0]
    self.assertEqual(len(leaf.sharding.device_set), 8)

  def test_sharded_checkpoint_restores_onto_any_mesh(self):
    workdir = self.enter_context(tempfile.TemporaryDirectory())
    fingerprint = {"test": 1}
    saved, mesh, config = _build("transformer", "data:2,model:4")
    with jax.set_mesh(mesh):
      parallel.shard_state(saved, mesh)
      optimizer = training.make_optimizer(saved, config.train)
      parallel.shard_state(optimizer, mesh)
      # Values unlike a fresh model's, so a silent re-init cannot pass.
      nnx.update(saved, jax.tree.map(lambda x: x + 0.5,
                                     nnx.state(saved, nnx.Param)))
      ckpt = checkpoints.Checkpointer(workdir, fingerprint)
      ckpt.save(CONFIG.train.steps, saved, optimizer, [[1, 2.0]])
      ckpt.wait()
      ckpt.close()
    want = nnx.state(saved, nnx.Param)
    for spec in ("data:4,model:2",):  # another split than the one saved
      model, mesh, config = _build("transformer", spec)
      with jax.set_mesh(mesh):
        parallel.shard_state(model, mesh)
        optimizer = training.make_optimizer(model, config.train)
        parallel.shard_state(optimizer, mesh)
        ckpt = checkpoints.Checkpointer(workdir, fingerprint)
        step, _ = ckpt.restore(model, optimizer)
        ckpt.close()
      self.assertEqual(step, CONFIG.train.steps)
      got = nnx.state(model, nnx.Param)
      chex.assert_trees_all_equal(got, want)
      kernel = model.encoder[0].self_attention.W_q.kernel[...]
      self.assertEqual(kernel.sharding.spec, jax.sharding.PartitionSpec(
          None, "model", None))  # W_q [D, N, H]: heads split
      self.assertEqual(kernel.sharding.mesh.shape["model"],
                       mesh.shape["model"])


if __name__ == "__main__":
  absltest.main()
