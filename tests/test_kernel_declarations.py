"""Kernels run only what they declare (``Kernel.implements``).

A call's features (``Problem.features``) are read off the mask's fields,
the operands given and the record's options, so a mask field or option
added later is a feature no kernel declares: every kernel must refuse it by
name (also cuDNN and splash, which never run on CPU CI), and the automatic
choice must raise rather than run a kernel that would drop it.
"""

from __future__ import annotations

import collections

from absl.testing import absltest
import chex
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.attention import dot_product
from tests import _data
from tests import contract

B, N, T, S, H = 2, 2, 8, 8, 4


def _operands():
  return tuple(_data.normal(i, (B, N, T if i == 0 else S, H))
               for i in range(3))


def _all_kernels():
  """The registry's kernels as the contract runs them, and ring."""
  kernels = [contract.CONFIGURED.get(k.name, k) for k in aj.kernels.REGISTRY]
  return kernels + [contract.CONFIGURED["ring"]]


class DeclarationTest(chex.TestCase):

  def test_mask_fields_are_every_field_a_mask_sets(self):
    # A field added to Mask must join MASK_FIELDS (what kernels declare
    # from): a Mask with every field set shows them all as features.
    full = aj.Mask(causal=True, window=(2, 0), q_lengths=jnp.array([3, 4]),
                   kv_lengths=jnp.array([5, 6]),
                   q_segment_ids=jnp.zeros((T,), jnp.int32),
                   dense=jnp.ones((1, 1, T, S), bool),
                   rule=lambda b, h, q, kv: kv <= q, q_offset=1,
                   kv_offset=0)
    self.assertEqual(set(vars(full)), set(aj.kernels.MASK_FIELDS))
    problem, _, _ = dot_product.prepare(*_operands(), full)
    self.assertEqual(problem.features, aj.kernels.MASK_FIELDS)

  def test_features_name_operands_and_options(self):
    q, k, v = _operands()
    problem, _, _ = dot_product.prepare(
        q, k, v, is_causal=True, bias=jnp.zeros((1, 1, T, S)),
        sinks=jnp.zeros((N,)), return_lse=True, dropout_rate=0.1,
        dropout_rng=jax.random.key(0))
    self.assertEqual(problem.features,
                     {"causal", "bias", "sinks", "return_lse",
                      "dropout_rate"})
    plain, _, _ = dot_product.prepare(q, k, v)
    self.assertEqual(plain.features, frozenset())

  def test_a_partition_is_no_feature(self):
    # How the call is split over the mesh is the record's, not a kernel's
    # to declare: every kernel runs under one (XLA's or per_shard's split).
    mesh = jax.make_mesh((1, 1), ("data", "model"))
    with jax.set_mesh(mesh):
      problem, _, _ = dot_product.prepare(
          *_operands(), is_causal=True,
          partition=aj.kernels.Partition(batch="data", heads="model"))
    self.assertEqual(problem.partition,
                     aj.kernels.Partition(("data",), ("model",)))
    self.assertEqual(problem.features, {"causal"})
    plain, _, _ = dot_product.prepare(*_operands())
    self.assertIsNone(plain.partition)  # no mesh: nothing to read
    # Only fused kernels run per shard; XLA partitions the pure-JAX ones.
    self.assertEqual(
        {k.name for k in aj.kernels.REGISTRY if not k.partitionable},
        {"splash", "paged_tpu", "paged_gpu", "pallas_gpu"})

  def test_every_declaration_is_in_the_vocabulary(self):
    for kernel in _all_kernels():
      extra = kernel.implements - aj.kernels.MASK_FIELDS - aj.kernels.OPTIONS
      self.assertEqual(extra, set(), kernel.name)

  def test_a_new_mask_field_is_refused_by_every_kernel_by_name(self):
    q, k, v = _operands()
    mask = aj.Mask(causal=True)
    mask.new_field = np.ones((B,), np.int32)  # a field no kernel knows
    problem, _, _ = dot_product.prepare(q, k, v, mask)
    self.assertIn("new_field", problem.features)
    for kernel in _all_kernels():
      missing = problem.features - kernel.implements
      self.assertIn("new_field", missing, kernel.name)
      self.assertIn("new_field", aj.kernels.undeclared(kernel, missing))
    # End to end: the kernels that can run here, and the automatic choice.
    for kernel in (aj.kernels.Dense(), aj.kernels.Flash(),
                   contract.CONFIGURED["pallas_gpu"],
                   contract.CONFIGURED["splash"]):
      with self.assertRaisesRegex(ValueError, f"{kernel.name}.*new_field"):
        aj.scaled_dot_product_attention(q, k, v, mask, implementation=kernel)
    with self.assertRaisesRegex(ValueError, "no implementation takes"):
      aj.scaled_dot_product_attention(q, k, v, mask)

  def test_a_new_option_is_refused_by_every_kernel_by_name(self):
    problem, _, _ = dot_product.prepare(*_operands(), is_causal=True)
    # The record with one more option, set: as if added to Problem.
    fields = problem._fields + ("new_option",)
    extended = collections.namedtuple(
        "Problem", fields, defaults=(None,) * len(fields))
    extended.features = type(problem).features
    extended.dropout_on = type(problem).dropout_on
    grown = extended(*problem, new_option=True)
    self.assertIn("new_option", grown.features)
    for kernel in _all_kernels():
      missing = grown.features - kernel.implements
      self.assertIn("new_option", missing, kernel.name)
      self.assertIn("new_option", aj.kernels.undeclared(kernel, missing))
    verdicts = list(aj.kernels.verdicts(
        [aj.kernels.Dense(), aj.kernels.Flash()], grown, automatic=False))
    self.assertEqual([v for _, v, _ in verdicts], ["refuses", "refuses"])

  def test_every_kernel_returns_one_named_result(self):
    q, k, v = _operands()
    problem, _, _ = dot_product.prepare(q, k, v, is_causal=True,
                                        return_lse=True)
    for kernel in (aj.kernels.Dense(), aj.kernels.Flash(),
                   contract.CONFIGURED["pallas_gpu"],
                   contract.CONFIGURED["splash"]):
      result = kernel(problem)
      self.assertIsInstance(result, aj.kernels.Result, kernel.name)
      self.assertEqual(result.lse.shape, (B, N, T), kernel.name)
      self.assertIsNone(result.max_logits, kernel.name)

    class Counted(aj.kernels.Dense):  # the old convention: a bare tuple
      name = "counted"

      def __call__(self, problem):
        return tuple(super().__call__(problem))[:3]

    with self.assertRaisesRegex(TypeError, "'counted' returned tuple"):
      aj.scaled_dot_product_attention(q, k, v, implementation=Counted())

  def test_positions_are_refused_where_not_implemented(self):
    q, k, v = _operands()
    mask = aj.Mask(causal=True, q_offset=jnp.array([0, 3]))
    with self.assertRaisesRegex(ValueError, "q_offset"):
      aj.scaled_dot_product_attention(
          q, k, v, mask, implementation=contract.CONFIGURED["splash"])
    # The Pallas GPU kernel declares them: it runs them (interpreted here),
    # as the dense kernel does.
    np.testing.assert_allclose(
        aj.scaled_dot_product_attention(
            q, k, v, mask, implementation=contract.CONFIGURED["pallas_gpu"]),
        aj.scaled_dot_product_attention(q, k, v, mask, implementation="dense"),
        atol=1e-5)  # float32, two summation orders over S keys


if __name__ == "__main__":
  absltest.main()
