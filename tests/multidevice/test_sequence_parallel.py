"""aj.SequenceParallel in a model: a layer whose sequence, batch and heads
are split equals the unsplit layer; layout="zigzag" on natural-order arrays
(permuted by the call) and permuted=True on aj.zigzag'ed ones equal dense
attention (in its order); lengths beyond the whole sequence are refused;
the LM trains on data x seq meshes with the one-device loss curve."""

import dataclasses
import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from experiments import lm
from experiments import lm_model
from experiments import training
from tests import _data

# The split layer computes the same float32 sums in another order (online
# softmax merges per ring step, all-to-all moves values exactly).
FWD_TOL = dict(atol=2e-5, rtol=2e-5)
GRAD_TOL = dict(atol=1e-4, rtol=1e-4)
B, T, D, N, K = 2, 32, 32, 4, 2


def _mesh(**sizes):
  names = tuple(sizes)
  return jax.make_mesh(tuple(sizes.values()), names,
                       devices=jax.devices()[:int(np.prod(list(
                           sizes.values())))],
                       axis_types=(jax.sharding.AxisType.Auto,) * len(names))


def _layer(attention_fn, head_axis=None):
  return aj.MultiHeadAttention(D, N, num_kv_heads=K, rope=aj.Rope(base=10000.0),
                               attention_fn=attention_fn,
                               head_axis=head_axis, rngs=nnx.Rngs(0))


class SequenceParallelLayerTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("ring_zigzag", "ring", "zigzag", dict(data=2, seq=4), None, False),
      ("ring_zigzag_permuted", "ring", "zigzag", dict(data=2, seq=4), None,
       True),
      ("ring_contiguous_heads", "ring", "contiguous",
       dict(data=2, seq=2, model=2), "model", False),
      ("ulysses_zigzag", "ulysses", "zigzag", dict(seq=4, data=2), None,
       False),
      ("hybrid_zigzag_heads_permuted", "hybrid", "zigzag",
       dict(ring=2, seq=2, model=2), "model", True))
  def test_split_layer_equals_the_layer(self, method, layout, sizes,
                                        head_axis, permuted):
    # Natural-order rows (the layer permutes them itself), or rows the
    # caller laid out once in the zigzag order (permuted=True).
    mesh = _mesh(**sizes)
    x = _data.normal(0, (B, T, D))
    ids = jnp.asarray(np.repeat([[0, 1, 2, 3]], B, 0).repeat(T // 4, 1)
                      .cumsum(1) // 9)  # [B, T] documents of 9 tokens
    positions = aj.segment_positions(ids)
    # zigzag lays rows over the ring's devices (the hybrid's outer axis)
    devices = sizes["ring"] if method == "hybrid" else sizes["seq"]
    perm = (lambda a, axis=1: aj.zigzag(a, devices, axis=axis)) \
        if permuted else (lambda a, axis=1: a)
    unperm = (lambda a, axis=1: aj.unzigzag(a, devices, axis=axis)) \
        if permuted else (lambda a, axis=1: a)
    cot = _data.normal(1, (B, T, D))
    mask = lambda ids: aj.Mask(causal=True, q_segment_ids=ids)  # noqa: E731

    def loss(layer, x, ids, positions, cot):
      out = layer(x, mask=mask(ids), positions=positions)
      return jnp.sum(out * cot), out

    want_layer = _layer(None)
    (_, want), want_grads = nnx.value_and_grad(loss, has_aux=True)(
        want_layer, x, ids, positions, cot)
    with jax.set_mesh(mesh):
      split = aj.SequenceParallel(
          "seq", method=method, layout=layout,
          ring_axis="ring" if method == "hybrid" else None,
          batch_axis="data" if "data" in sizes else None,
          head_axis=head_axis, block_q=4, block_k=4, permuted=permuted)
      layer = _layer(split, head_axis)
      (_, got), got_grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(
          layer, perm(x), perm(ids), perm(positions), perm(cot))
    chex.assert_trees_all_close(unperm(got), want, **FWD_TOL)
    # (values only: the sharded layer's params carry their mesh metadata)
    leaves = lambda g: [np.asarray(x) for x in jax.tree.leaves(  # noqa: E731
        nnx.state(g, nnx.Param))]
    chex.assert_trees_all_close(leaves(got_grads), leaves(want_grads),
                                **GRAD_TOL)

  @parameterized.parameters("ring", "ulysses")
  def test_every_array_reaches_its_shard(self, method):
    # Batch, heads and sequence all split: per-example lengths and a rule
    # reading b, ALiBi slopes and sinks per head (read at the global (b,
    # h)), segment ids per token, a scale, the lse; gradients of every
    # operand.
    mesh = _mesh(data=2, seq=2, model=2)
    q = _data.normal(2, (2, 4, 16, 8))
    k, v = (_data.normal(3 + i, (2, 2, 16, 8)) for i in range(2))
    slopes, sinks = _data.normal(5, (4,)), _data.normal(6, (4,))
    starts = jnp.array([0, 3])  # [B] keys before these are hidden
    ids = jnp.asarray(np.repeat([[0] * 10 + [1] * 6], 2, 0))  # [B, T]
    rule = aj.MaskRule(lambda b, h, q, k, p: k >= p[b], starts)
    cot = _data.normal(7, (2, 4, 16, 8))

    def loss(fn, q, k, v, slopes, sinks):
      mask = aj.Mask(causal=True, kv_lengths=jnp.array([16, 11]),
                     q_segment_ids=ids, rule=rule)
      out, lse = fn(q, k, v, mask, score_mod=aj.alibi(slopes), sinks=sinks,
                    scale=0.3, return_lse=True)
      return jnp.sum(out * cot) + jnp.sum(jnp.where(
          jnp.isfinite(lse), lse, 0.0)), (out, lse)

    args = (q, k, v, slopes, sinks)
    grad = lambda fn: jax.jit(jax.value_and_grad(  # noqa: E731
        functools.partial(loss, fn), (0, 1, 2, 3, 4), has_aux=True))(*args)
    (_, want), want_grads = grad(aj.scaled_dot_product_attention)
    with jax.set_mesh(mesh):
      split = aj.SequenceParallel("seq", method=method, batch_axis="data",
                                  head_axis="model")
      (_, got), got_grads = grad(split)
    chex.assert_trees_all_close(got, want, **FWD_TOL)
    chex.assert_trees_all_close(got_grads, want_grads, **GRAD_TOL)

  @parameterized.product(method=("ring", "ulysses"),
                         split=("batch", "heads"))
  def test_shared_arrays_under_one_split(self, method, split):
    # One of batch or heads split: the other shift is a constant 0; a plain
    # rule reading b; a bias shared by the examples (and the heads) and
    # sinks per example and head, both differentiated; a concrete array
    # scale.
    mesh = _mesh(data=2, seq=2, model=2)
    q, k, v = (_data.normal(10 + i, (2, 4, 16, 8)) for i in range(3))
    slopes, sinks = _data.normal(13, (4,)), _data.normal(14, (2, 4))
    bias = _data.normal(15, (1, 1, 16, 16))  # [1, 1, T, S]
    cot = _data.normal(16, (2, 4, 16, 8))
    mask = aj.Mask(causal=True, rule=lambda b, h, q, k: k >= 3 * b)

    def loss(fn, q, k, v, slopes, sinks, bias):
      out = fn(q, k, v, mask, bias=bias, score_mod=aj.alibi(slopes),
               sinks=sinks, scale=jnp.float32(0.3))
      return jnp.sum(out * cot), out

    args = (q, k, v, slopes, sinks, bias)
    grad = lambda fn: jax.jit(jax.value_and_grad(  # noqa: E731
        functools.partial(loss, fn), tuple(range(6)), has_aux=True))(*args)
    (_, want), want_grads = grad(aj.scaled_dot_product_attention)
    with jax.set_mesh(mesh):
      split_fn = aj.SequenceParallel(
          "seq", method=method,
          batch_axis="data" if split == "batch" else None,
          head_axis="model" if split == "heads" else None)
      (_, got), got_grads = grad(split_fn)
    chex.assert_trees_all_close(got, want, **FWD_TOL)
    chex.assert_trees_all_close(got_grads, want_grads, **GRAD_TOL)

  def test_refusals(self):
    with jax.set_mesh(_mesh(seq=4)):
      q = jnp.ones((1, 4, 6, 8))  # T = 6 does not split over 4 devices
      with self.assertRaisesRegex(ValueError, r"T = 6 does not split"):
        jax.jit(aj.SequenceParallel("seq"))(q, q, q)
      with self.assertRaisesRegex(ValueError, r"'nope'.*does not have"):
        aj.SequenceParallel("nope")(q, q, q)
      q = jnp.ones((1, 4, 8, 8))
      with self.assertRaisesRegex(ValueError, r"bias of the logits' rank"):
        aj.SequenceParallel("seq")(q, q, q, bias=jnp.zeros((8, 8)))
    explicit = jax.make_mesh((4,), ("seq",), devices=jax.devices()[:4],
                             axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(explicit), self.assertRaisesRegex(
        ValueError, r"splits over Auto mesh axes"):
      aj.SequenceParallel("seq")(q, q, q)
    with self.assertRaisesRegex(ValueError, r"method must be one of"):
      aj.SequenceParallel("seq", method="tree")
    with self.assertRaisesRegex(ValueError, r"needs ring_axis"):
      aj.SequenceParallel("seq", method="hybrid")
    with self.assertRaisesRegex(ValueError, r"would be ignored"):
      aj.SequenceParallel("seq", implementation="flash")


def _sets_mesh_checks_fail() -> bool:
  """Whether checkify cannot carry a check into a shard_map under
  jax.set_mesh (jax-ml/jax#40907, jax 0.10.2): then no check of a traced
  value inside SequenceParallel's shard_map can be run by aj.checked."""
  from jax.experimental import checkify  # noqa: PLC0415

  def f(x):
    checkify.debug_check(jnp.all(x > 0), "x")
    return jax.shard_map(lambda x: x, in_specs=jax.P("seq"),
                         out_specs=jax.P("seq"))(x)

  with jax.set_mesh(_mesh(seq=2)):
    try:
      checkify.checkify(jax.jit(f), errors=checkify.user_checks)(
          jnp.ones(2))
    except ValueError as e:
      return "should match the aval mesh" in str(e)
  return False


class SequenceParallelZigzagTest(parameterized.TestCase):
  """layout="zigzag" on natural-order arrays (permuted here), and
  permuted=True on arrays the caller put in the zigzag order."""

  @parameterized.product(
      (dict(method="ring", sizes=dict(data=2, seq=4)),
       dict(method="hybrid", sizes=dict(ring=2, seq=2, model=2)),
       dict(method="ulysses", sizes=dict(seq=4))),
      permuted=(False, True))
  def test_zigzag_equals_dense_attention(self, method, sizes, permuted):
    # Every per-token array: segment ids, a key mask [B, 1, 1, S] and a
    # bias [B, 1, T, S] (rows and key columns), global lengths that leave
    # rows with nothing to see; the output, the lse and the gradients.
    t, devices = 32, sizes.get("ring", sizes["seq"])
    q = _data.normal(20, (2, 4, t, 8))
    k, v = (_data.normal(21 + i, (2, 2, t, 8)) for i in range(2))
    bias = _data.normal(23, (2, 1, t, t))
    cot, cot_lse = _data.normal(24, (2, 4, t, 8)), _data.normal(25, (2, 4, t))
    ids = jnp.asarray(np.arange(t)[None].repeat(2, 0) // 9)  # [B, T]
    keys = np.ones((2, 1, 1, t), bool)
    keys[1, ..., 3:5] = False  # [B, 1, 1, S]: two keys hidden
    zz = functools.partial(aj.zigzag, devices=devices)
    order = zz if permuted else (lambda x, axis=-2: x)

    def loss(fn, order, q, k, v, bias):
      mask = aj.Mask(causal=True, q_segment_ids=order(ids, axis=-1),
                     dense=order(keys, axis=-1), kv_lengths=jnp.array([t, 27]))
      out, lse = fn(q, k, v, mask, bias=bias, return_lse=True)
      finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
      return jnp.sum(out * order(cot)) + jnp.sum(
          finite * order(cot_lse, axis=-1)), (out, lse)

    grad = lambda fn, order, *a: jax.jit(jax.value_and_grad(  # noqa: E731
        functools.partial(loss, fn, order), (0, 1, 2, 3), has_aux=True))(*a)
    (_, want), want_grads = grad(functools.partial(
        aj.scaled_dot_product_attention, implementation="dense"),
        lambda x, axis=-2: x, q, k, v, bias)
    with jax.set_mesh(_mesh(**sizes)):
      split = aj.SequenceParallel(
          "seq", method=method, layout="zigzag", permuted=permuted,
          ring_axis="ring" if method == "hybrid" else None,
          batch_axis="data" if "data" in sizes else None,
          head_axis="model" if "model" in sizes else None,
          block_q=4, block_k=4)
      (_, got), got_grads = grad(split, order, order(q), order(k),
                                 order(v), order(order(bias), axis=-1))
    if permuted:  # the zigzag of the dense results
      want = (zz(want[0]), zz(want[1], axis=-1))
      want_grads = (*(zz(g) for g in want_grads[:3]),
                    zz(zz(want_grads[3]), axis=-1))
    np.testing.assert_array_equal(np.isinf(got[1]), np.isinf(want[1]))
    chex.assert_trees_all_close(got, want, **FWD_TOL)
    chex.assert_trees_all_close(got_grads, want_grads, **GRAD_TOL)

  def test_zigzag_refusals(self):
    q = jnp.ones((1, 2, 12, 8))  # T = 12 splits over 4, not into 2 * 4
    with jax.set_mesh(_mesh(seq=4)), self.assertRaisesRegex(
        ValueError, r"layout='zigzag'\) cuts the sequence into 2 \* 4 "
        r"chunks .*T = 12 and S = 12 must be multiples of 8"):
      aj.SequenceParallel("seq", layout="zigzag")(q, q, q)
    with self.assertRaisesRegex(ValueError, r"permuted=True\) says .* goes "
                                r"with layout='zigzag', got "
                                r"layout='contiguous'"):
      aj.SequenceParallel("seq", permuted=True)
    with self.assertRaisesRegex(TypeError, r"permuted must be a Python bool"):
      aj.SequenceParallel("seq", layout="zigzag", permuted=1)

  @parameterized.product(method=("ring", "ulysses"),
                         name=("kv_lengths", "q_lengths"))
  def test_lengths_beyond_the_sequence_are_refused(self, method, name):
    # The whole arrays' T = S = 16: a concrete 17, eager or closed over
    # under jit, is refused before the shard_map makes it a shard's
    # traced operand.
    q = _data.normal(30, (2, 4, 16, 8))
    mask = aj.Mask(**{name: jnp.array([16, 17])})
    letter = "S" if name == "kv_lengths" else "T"
    message = (rf"the mask's {name} must lie in \[0, 16\], got values from 16 "
               rf"to 17 .*\({letter} = 16, the whole sequence.*"
               rf"jnp\.minimum\({name}, 16\)")
    with jax.set_mesh(_mesh(seq=4)):
      split = aj.SequenceParallel("seq", method=method, layout="zigzag")
      for run in (lambda q: split(q, q, q, mask),
                  jax.jit(lambda q: split(q, q, q, mask))):
        with self.assertRaisesRegex(ValueError, message):
          run(q)

  def test_traced_lengths_are_checked_under_checked(self):
    if _sets_mesh_checks_fail():
      self.skipTest("checkify cannot carry a check into a shard_map under "
                    "jax.set_mesh in this jax (jax-ml/jax#40907)")
    q = _data.normal(31, (1, 4, 16, 8))
    with jax.set_mesh(_mesh(seq=4)):
      split = aj.SequenceParallel("seq", layout="zigzag")
      fn = jax.jit(lambda q, lengths: split(
          q, q, q, aj.Mask(kv_lengths=lengths)))
      with self.assertRaisesRegex(ValueError, r"kv_lengths must lie in "
                                  r"\[0, 16\].*got 17"):
        aj.checked(fn)(q, jnp.array(17))
      got = aj.checked(fn)(q, jnp.array(11))
    want = aj.scaled_dot_product_attention(q, q, q, aj.Mask(kv_lengths=11))
    chex.assert_trees_all_close(got, want, **FWD_TOL)


_LM = lm.LMConfig(
    seq_len=32, model=lm_model.LMModelConfig(d_model=32, num_heads=4,
                                             num_layers=1, ffn_dim=64),
    train=training.TrainConfig(steps=3, batch_size=4, log_every=1,
                               checkpoint_every=0, learning_rate=3e-3))
# A few Adam steps of the same data from the same parameters; the sums run
# in other orders: float32 rounding, grown a little by the optimizer.
LOSS_TOL = 2e-5


class SequenceParallelLMTest(parameterized.TestCase):

  @functools.cached_property
  def corpus(self):
    from experiments import lm_data  # noqa: PLC0415
    return lm_data.build_corpus(_LM.seq_len, _LM.valid_fraction, 0)

  def _curve(self, mesh_spec, **changes):
    config = dataclasses.replace(
        _LM, train=dataclasses.replace(_LM.train, mesh=mesh_spec), **changes)
    mesh = training.training_mesh(config.train, sequence=True)
    with jax.set_mesh(mesh):
      model = lm.build_model("segments", config, self.corpus.vocab.size, mesh)
    stats = training.train(
        "segments", model, config.train, None, mesh,
        batches=functools.partial(lm.train_batch, self.corpus, config,
                                  "segments",
                                  devices=lm.layout_devices(config, mesh)),
        step_fn=lm.train_step)
    return np.array(stats["loss_curve"])[:, 1]

  @parameterized.named_parameters(
      ("ring_zigzag", "data:2,seq:4", {}),
      ("ulysses_heads", "data:2,seq:2,model:2",
       dict(sequence_parallel="ulysses")),
      ("hybrid", "ring:2,seq:2,model:2", dict(sequence_parallel="hybrid")))
  def test_loss_curve_equals_one_device(self, mesh_spec, changes):
    want = self._curve("data:1")
    got = self._curve(mesh_spec, **changes)
    np.testing.assert_allclose(got, want, atol=LOSS_TOL, rtol=LOSS_TOL)


if __name__ == "__main__":
  absltest.main()
