"""Kernels XLA cannot partition, run per shard (kernels.per_shard).

A Pallas call (``PallasGpu``, ``Splash``) inside a sharded ``jit`` would
have its operands all-gathered (or be refused on TPU); with a
``Partition`` it runs on each device's ``[B / 2, N / 4]`` slice inside
``jax.shard_map`` over a ``data: 2 x model: 4`` mesh. Each case equals the
unsharded call (the one-device module, or the float64 reference), outputs
and gradients, and the compiled program gathers no query, key or value.
Interpret-mode Pallas is slow on CPU: tiny shapes, one compile per case
(forward and gradients in one ``value_and_grad``).
"""

import re
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import chex
from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

import attention_jax as aj
from attention_jax.attention import dot_product
from attention_jax.kernels import base
from attention_jax.kernels import per_shard
from attention_jax.kernels.base import Partition
from tests import _data
from tests import reference

# Sharding changes only which device computes which head: the same float32
# kernels on the same numbers, so rounding-level differences (the W_o sum
# over heads is split into per-device partial sums).
TOL = dict(atol=1e-5, rtol=1e-5)
# Gradients of the parameters sum over B, T and heads in another order
# across devices (float32 accumulation of ~100 terms of size ~1).
GRAD_TOL = dict(atol=5e-5, rtol=5e-5)
# Against float64: the kernels compute in float32 (a few roundings per
# softmax over 32 keys, and the flash backward's recomputation).
REF_TOL = dict(atol=2e-5, rtol=2e-5)
REF_GRAD_TOL = dict(atol=1e-4, rtol=1e-4)
AUTO = (jax.sharding.AxisType.Auto,) * 2
EXPLICIT = (jax.sharding.AxisType.Explicit,) * 2
PALLAS = aj.kernels.PallasGpu(block_q=16, block_k=16, interpret=True)
SPLASH = aj.kernels.Splash(interpret=True)


def _mesh(types=AUTO):
  return jax.make_mesh((2, 4), ("data", "model"), axis_types=types)


def _gathers(hlo: str, shapes) -> list[str]:
  """The all-gather lines of ``hlo`` whose result has one of ``shapes``."""
  found = []
  for line in hlo.splitlines():
    if "all-gather" not in line:
      continue
    m = re.search(r"= \w+\[([\d,]*)\]", line)
    dims = tuple(int(d) for d in m.group(1).split(",") if d) if m else None
    if dims is None or dims in shapes:
      found.append(line.strip())
  return found


class ShardedModuleTest(parameterized.TestCase):
  """MultiHeadAttention(head_axis="model") with a fused kernel."""

  def setUp(self):
    super().setUp()
    self.x = _data.normal(0, (2, 32, 32))  # [B, T, D]
    self.cot = _data.normal(1, (2, 32, 32))

  def _pair(self, kernel, mesh):
    kwargs = dict(num_kv_heads=4, head_dim=16, attention_fn=kernel)
    plain = aj.MultiHeadAttention(32, 8, rngs=nnx.Rngs(0), **kwargs)
    with jax.set_mesh(mesh):
      sharded = aj.MultiHeadAttention(32, 8, rngs=nnx.Rngs(0),
                                      head_axis="model", **kwargs)
    return plain, sharded

  def _loss(self, module, x):
    return jnp.sum(module(x, is_causal=True) * self.cot)

  @parameterized.named_parameters(("pallas_gpu", PALLAS), ("splash", SPLASH),
                                  ("flash", aj.kernels.Flash()))
  def test_equals_unsharded_without_gathering(self, kernel):
    plain, sharded = self._pair(kernel, _mesh())
    want_loss, want = nnx.value_and_grad(self._loss)(plain, self.x)
    mesh = _mesh()
    with jax.set_mesh(mesh), mock.patch.object(
        per_shard, "run", wraps=per_shard.run) as ran:
      x = jax.device_put(self.x, NamedSharding(mesh, P("data")))
      step = nnx.jit(nnx.value_and_grad(self._loss))
      got_loss, got = step(sharded, x)
      hlo = jax.jit(lambda x: self._loss(sharded, x)).lower(
          x).compile().as_text()
    chex.assert_trees_all_close(got_loss, want_loss, **GRAD_TOL)
    chex.assert_trees_all_close(got.to_pure_dict(), want.to_pure_dict(),
                                **GRAD_TOL)
    # q [B, N, T, H], k and v [B, K, S, H]: whole, one example's, or
    # grouped [B, K, G, T, H]; none of them is gathered.
    shapes = {(2, 8, 32, 16), (2, 4, 32, 16), (2, 4, 2, 32, 16),
              (2, 4, 1, 32, 16), (1, 8, 32, 16), (1, 4, 32, 16)}
    self.assertEqual(_gathers(hlo, shapes), [])
    # Per shard exactly when XLA cannot partition the kernel (splash's
    # interpreted kernels it could: the check is that they did not need to).
    self.assertEqual(ran.called, not kernel.partitionable)

  def test_explicit_axes(self):
    mesh = _mesh(EXPLICIT)
    plain, sharded = self._pair(PALLAS, mesh)
    want = plain(self.x, is_causal=True)
    with jax.set_mesh(mesh):
      x = jax.device_put(self.x, NamedSharding(mesh, P("data")))
      got = nnx.jit(lambda m, x: m(x, is_causal=True))(sharded, x)
    self.assertEqual(jax.typeof(got).sharding.spec, P("data", None, None))
    chex.assert_trees_all_close(got, want, **TOL)

  def test_partition_read_from_types(self):
    # On explicit axes the query's type states the split: no partition=.
    q, kv = _data.normal(0, (2, 8, 32, 16)), _data.normal(1, (2, 4, 32, 16))
    want = aj.scaled_dot_product_attention(q, kv, kv, is_causal=True,
                                           implementation=PALLAS)
    mesh = _mesh(EXPLICIT)
    with jax.set_mesh(mesh), mock.patch.object(
        per_shard, "run", wraps=per_shard.run) as ran:
      split = NamedSharding(mesh, P("data", "model"))
      q, kv = jax.device_put(q, split), jax.device_put(kv, split)
      self.assertEqual(dot_product.typed_partition(q),
                       Partition("data", "model"))
      got = jax.jit(lambda q, kv: aj.scaled_dot_product_attention(
          q, kv, kv, is_causal=True, implementation=PALLAS))(q, kv)
    self.assertTrue(ran.called)
    self.assertEqual(jax.typeof(got).sharding.spec,
                     P("data", "model", None, None))
    chex.assert_trees_all_close(got, want, **TOL)
    # Auto axes: nothing to read at trace time.
    with jax.set_mesh(_mesh()):
      self.assertIsNone(dot_product.typed_partition(jnp.ones((2, 8, 4, 4))))

  def test_partition_reaches_the_kernel(self):
    # A kernel choice runs with the layer's partition (a function of the
    # attention_fn protocol gets none: it sees the whole arrays).
    seen = []

    class Recording(aj.kernels.Dense):
      name = "recording_dense"

      def __call__(self, problem):
        seen.append(problem.partition)
        return super().__call__(problem)

    with jax.set_mesh(_mesh()):
      layer = aj.MultiHeadAttention(32, 8, rngs=nnx.Rngs(0), head_dim=4,
                                    head_axis="model",
                                    attention_fn=Recording())
      layer(self.x)
      layer.batch_axis = ()
      layer(self.x)
      # Inside a shard_map over data the batch is one device's already.
      layer.batch_axis = None
      jax.jit(jax.shard_map(layer, in_specs=P("data"), out_specs=P("data"),
                            axis_names={"data"}))(self.x)
    self.assertEqual(seen, [Partition(batch="data", heads="model"),
                            Partition(heads="model"),
                            Partition(heads="model")])


def _slopes():
  return jnp.asarray(aj.alibi_slopes(8), jnp.float32)


def _rule(b, h, q_idx, kv_idx):  # example b hides its first 4 * b keys
  del h, q_idx
  return kv_idx >= 4 * b


def _allowed(b, n, t, s):
  """``_rule`` and causality written out: ``[B, N, T, S]``."""
  i, j = np.arange(t)[:, None], np.arange(s)[None, :]
  per_b = np.stack([(j >= 4 * e) & (j <= i + s - t) for e in range(b)])
  return np.broadcast_to(per_b[:, None], (b, n, t, s))


class ShardedCallTest(parameterized.TestCase):
  """scaled_dot_product_attention(partition=...) with PallasGpu."""

  def test_global_indices_sinks_gqa(self):
    # N = 8 query heads over K = 4 key/value heads split over model (one
    # per device); ALiBi reads h (per-head slopes), the rule reads b.
    q = _data.normal(0, (2, 8, 32, 16))
    k = _data.normal(1, (2, 4, 32, 16))
    v = _data.normal(2, (2, 4, 32, 16))
    sinks = _data.normal(3, (8,))
    cot = _data.normal(4, (2, 8, 32, 16))
    mask = aj.Mask(causal=True, rule=_rule)

    def loss(q, k, v, slopes, sinks, partition):
      out = aj.scaled_dot_product_attention(
          q, k, v, mask, score_mod=aj.alibi(slopes), sinks=sinks,
          implementation=PALLAS, partition=partition)
      return jnp.sum(out * cot), out

    mesh = _mesh()
    with jax.set_mesh(mesh):
      split = NamedSharding(mesh, P("data", "model"))
      args = [jax.device_put(x, split) for x in (q, k, v)]
      (_, out), grads = jax.jit(jax.value_and_grad(
          lambda *a: loss(*a, Partition("data", "model")), (0, 1, 2, 3, 4),
          has_aux=True))(*args, _slopes(), sinks)

    def ref_loss(q, k, v, slopes, sinks):
      out, _ = reference.masked_attention(
          q, k, v, None, _allowed(2, 8, 32, 32), sinks=sinks, slopes=slopes)
      return jnp.sum(out * cot.astype(out.dtype)), out

    with jax.enable_x64(True):
      f64 = [np.asarray(x, np.float64) for x in (q, k, v, _slopes(), sinks)]
      (_, want), want_grads = jax.value_and_grad(
          ref_loss, (0, 1, 2, 3, 4), has_aux=True)(*f64)
      want, want_grads = jax.tree.map(np.asarray, (want, want_grads))
    chex.assert_trees_all_close(out, want.astype(np.float32), **REF_TOL)
    chex.assert_trees_all_close(
        grads, jax.tree.map(lambda x: x.astype(np.float32), want_grads),
        **REF_GRAD_TOL)

  def test_rule_reads_the_head_under_a_heads_split(self):
    # Each device holds 1 of B = 2 examples and 2 of N = 8 heads: the rule's
    # h must be the shard's first global head (its index times the local
    # head count, 2) plus the local one; a batch-sized offset (1) would
    # give device m heads m, m + 1 instead of 2m, 2m + 1. The rule hides a
    # different quarter of the keys per (b, h), never a whole row.
    q = _data.normal(0, (2, 8, 32, 16))
    k = _data.normal(1, (2, 4, 32, 16))
    v = _data.normal(2, (2, 4, 32, 16))
    cot = _data.normal(3, (2, 8, 32, 16))
    mask = aj.Mask(rule=lambda b, h, q_idx, kv_idx:
                   (kv_idx + 3 * h + 5 * b) % 4 != 0)

    def loss(q, k, v, partition):
      out = aj.scaled_dot_product_attention(
          q, k, v, mask, implementation=PALLAS, partition=partition)
      return jnp.sum(out * cot), out

    mesh = _mesh()
    with jax.set_mesh(mesh):
      split = NamedSharding(mesh, P("data", "model"))
      args = [jax.device_put(x, split) for x in (q, k, v)]
      (_, out), grads = jax.jit(jax.value_and_grad(
          lambda *a: loss(*a, Partition("data", "model")), (0, 1, 2),
          has_aux=True))(*args)
    b, h, j = np.ogrid[:2, :8, :32]
    allowed = np.broadcast_to(((j + 3 * h + 5 * b) % 4 != 0)[:, :, None],
                              (2, 8, 32, 32))

    def ref_loss(q, k, v):
      out, _ = reference.masked_attention(q, k, v, None, allowed)
      return jnp.sum(out * cot.astype(out.dtype)), out

    with jax.enable_x64(True):
      f64 = [np.asarray(x, np.float64) for x in (q, k, v)]
      (_, want), want_grads = jax.value_and_grad(
          ref_loss, (0, 1, 2), has_aux=True)(*f64)
      want, want_grads = jax.tree.map(np.asarray, (want, want_grads))
    chex.assert_trees_all_close(out, want.astype(np.float32), **REF_TOL)
    chex.assert_trees_all_close(
        grads, jax.tree.map(lambda x: x.astype(np.float32), want_grads),
        **REF_GRAD_TOL)

  def test_splash_keeps_a_shared_mask_on_the_host(self):
    # A concrete [1, 1, T, S] mask is the same on every shard: it stays a
    # constant, which splash needs (it builds its mask tables on the host;
    # under jit every mask is traced, so eagerly).
    q, kv = _data.normal(0, (2, 4, 32, 16)), _data.normal(1, (2, 4, 32, 16))
    allowed = _data.bernoulli(2, 0.7, (1, 1, 32, 32))
    allowed = np.asarray(allowed) | np.eye(32, dtype=bool)  # no empty row
    call = lambda q, kv, partition=None: aj.scaled_dot_product_attention(
        q, kv, kv, allowed, implementation=SPLASH, partition=partition)
    with jax.set_mesh(_mesh()):
      got = call(q, kv, Partition("data", "model"))
    with jax.enable_x64(True):
      want, _ = reference.masked_attention(
          *(np.asarray(x, np.float64) for x in (q, kv, kv)), None,
          np.broadcast_to(allowed, (2, 4, 32, 32)))
    chex.assert_trees_all_close(got, np.asarray(want, np.float32),
                                **REF_TOL)

  def test_paged_pools_split_along_k(self):
    # A decoding step over a paged cache: the pools [P, K, Z, H] split
    # along K over model, the page table [B, M] along B over data.
    q = _data.normal(0, (2, 8, 1, 16))
    key_pages = _data.normal(1, (6, 4, 16, 16))
    value_pages = _data.normal(2, (6, 4, 16, 16))
    table = jnp.array([[0, 3], [5, 1]], jnp.int32)
    lengths = jnp.array([20, 9], jnp.int32)
    mask = aj.Mask(causal=True, kv_lengths=lengths, q_offset=lengths - 1,
                   kv_offset=jnp.zeros_like(lengths))

    def step(kernel, q, key_pages, value_pages, partition=None):
      return dot_product.run(
          q, None, None, mask, sinks=_data.normal(3, (8,)),
          implementation=kernel, return_lse=True, partition=partition,
          pages=base.Pages(key_pages, value_pages, table))

    want = step("flash", q, key_pages, value_pages)
    mesh = _mesh()
    with jax.set_mesh(mesh):
      pool = NamedSharding(mesh, P(None, "model"))
      got = jax.jit(lambda *a: step(
          aj.kernels.PagedGpu(interpret=True), *a,
          partition=Partition("data", "model")))(
              q, *(jax.device_put(x, pool) for x in (key_pages, value_pages)))
    chex.assert_trees_all_close(got.out, want.out, **TOL)
    chex.assert_trees_all_close(got.lse, want.lse, **TOL)

  def test_refusals(self):
    q = _data.normal(0, (2, 8, 32, 16))
    kv = _data.normal(1, (2, 2, 32, 16))  # K = 2 heads: model's 4 split none

    def call(partition, q=q, kv=kv, kernel=PALLAS, **kwargs):
      return aj.scaled_dot_product_attention(
          q, kv, kv, implementation=kernel, partition=partition, **kwargs)

    with jax.set_mesh(_mesh()):
      with self.assertRaisesRegex(ValueError, r"does not divide K = 2"):
        call(Partition(heads="model"))
      with self.assertRaisesRegex(ValueError, r"does not have.*'data', "
                                  r"'model'"):
        call(Partition(batch="rows"))
      with self.assertRaisesRegex(ValueError, r"does not divide B = 3"):
        q3 = _data.normal(0, (3, 8, 32, 16))
        call(Partition(batch="data"), q=q3, kv=q3)
      with self.assertRaisesRegex(ValueError, r"needs \[B, N, T, H\]"):
        call(Partition(heads="model"), q=q[0], kv=q[0])
      with self.assertRaisesRegex(ValueError, r"more than once"):
        Partition(batch="data", heads="data")
      # Splash evaluates a rule on the host; a shard's b is on device.
      with self.assertRaisesRegex(ValueError, r"refuses the shard's problem"):
        call(Partition(batch="data"), kv=q, kernel=SPLASH,
             mask=aj.Mask(rule=_rule))

      class NoPartitionDense(aj.kernels.Dense):
        name = "unpartitioned_dense"
        partitionable = False

      with self.assertRaisesRegex(ValueError, r"dropout there would draw"):
        call(Partition(batch="data"), kv=q, kernel=NoPartitionDense(),
             dropout_rate=0.5, dropout_rng=jax.random.key(0))

      def inner(q):  # inside a shard_map over data: the axis is manual
        return call(Partition(batch="data"), q=q, kv=q)

      with self.assertRaisesRegex(ValueError, r"manual here"):
        jax.shard_map(inner, in_specs=P("data"), out_specs=P("data"))(q)

  def test_partition_record(self):
    self.assertEqual(Partition("data", ("model",)),
                     Partition(batch=("data",), heads="model"))
    self.assertFalse(Partition())
    with self.assertRaisesRegex(TypeError, r"batch must be a mesh axis"):
      Partition(batch=3)
    # Not a feature: a kernel need not declare it.
    with jax.set_mesh(_mesh()):
      problem = base.canonicalize(
          jnp.ones((2, 4, 8, 4)), jnp.ones((2, 4, 8, 4)),
          jnp.ones((2, 4, 8, 4)), None,
          partition=Partition(batch="data", heads="model"))
    self.assertEqual(problem.partition, Partition("data", "model"))
    self.assertNotIn("partition", problem.features)


if __name__ == "__main__":
  absltest.main()
