"""The jax.nn and flax drop-ins (jax_nn, flax_fn) against jax.nn and flax.

``dot_product_attention`` against ``jax.nn.dot_product_attention``: every
comparison is with jax.nn's ``implementation='xla'`` in jax.nn's own
``[B, T, N, H]`` layout and its own top-left causal/window alignment, on
rows where jax.nn's answer is defined as ours (rows that see at least one
key; the tests check that they all do, or say which do not).

``flax_attention_fn`` against flax's default ``attention_fn``: two
``nnx.MultiHeadAttention`` layers built from the same seed (so the same
parameters), one with each, compared on rows that see a key.
"""

import functools
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import chex
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.attention import dot_product
from attention_jax.interop import flax_fn
from attention_jax.interop import jax_nn
from tests import _data

# Both sides compute in float32 with sums over <= 8 terms of magnitude
# <= ~4, in different orders (grouped heads, swapped layouts): differences
# stay below ~1e-6; 1e-5 leaves an order of magnitude of headroom. The same
# holds for the gradients, which add one more such sum.
F32_TOL = dict(atol=1e-5, rtol=1e-5)


def _qkv(b=2, t=4, s=6, n=4, k=4, h=8, seed=0):
  """``[B, T, N, H]`` queries and ``[B, S, K, H]`` keys/values."""
  return (_data.normal(seed, (b, t, n, h)), _data.normal(seed + 1, (b, s, k, h)),
          _data.normal(seed + 2, (b, s, k, h)))


# Arguments that change the program: closed over, not traced.
_STATIC = ("scale", "is_causal", "local_window_size", "implementation",
           "return_residual")


def _ours_and_theirs(q, k, v, implementation=None, grad=False, **kwargs):
  """Ours and jax.nn's xla outputs (or q/k/v gradients), in one jit.

  One compiled program per case instead of a compile per eager op keeps
  the file fast; it also runs every case with traced lengths/masks/biases.
  """
  static = {n: kwargs.pop(n) for n in _STATIC if n in kwargs}
  ours_fn = functools.partial(jax_nn.dot_product_attention,
                              implementation=implementation, **static)
  theirs_fn = functools.partial(jax.nn.dot_product_attention,
                                implementation="xla", **static)
  cotangent = _data.normal(9, q.shape)

  def loss(fn, q, k, v, arrays):
    return jnp.sum(fn(q, k, v, **arrays) * cotangent)

  @jax.jit
  def run(q, k, v, arrays):
    if grad:
      return tuple(jax.grad(functools.partial(loss, fn), argnums=(0, 1, 2))(
          q, k, v, arrays) for fn in (ours_fn, theirs_fn))
    return ours_fn(q, k, v, **arrays), theirs_fn(q, k, v, **arrays)

  return run(q, k, v, kwargs)


def _top_left_band(t, s, is_causal, window):
  """jax.nn's visibility ``[T, S]``, written out independently."""
  i, j = np.arange(t)[:, None], np.arange(s)[None, :]
  ok = np.ones((t, s), bool)
  if is_causal:
    ok &= j <= i
  if window is not None:
    left, right = (window, window) if isinstance(window, int) else window
    ok &= (i - left <= j) & (j <= i + right)
  return ok


class AgreesWithJaxNnTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("plain", dict()),
      ("gqa", dict(k=2)),
      ("mqa", dict(k=1)),
      ("bias", dict(bias=True)),
      ("gqa_bias_mask", dict(k=2, bias=True, mask=True)),
      ("mask_4d", dict(mask=True)),
      ("scale", dict(scale=0.3)),
      ("causal_square", dict(t=5, s=5, is_causal=True)),
      ("causal_more_keys_top_left", dict(t=3, s=6, is_causal=True)),
      ("causal_more_queries_top_left", dict(t=6, s=4, is_causal=True)),
      ("causal_gqa_mask_bias_t_ne_s",
       dict(t=5, s=7, k=2, is_causal=True, mask=True, bias=True)),
      ("window_int_square", dict(t=6, s=6, local_window_size=1)),
      ("window_tuple_square", dict(t=6, s=6, local_window_size=(2, 0))),
      ("window_causal_square",
       dict(t=6, s=6, local_window_size=(1, 3), is_causal=True)),
      ("window_int_more_keys", dict(t=5, s=7, local_window_size=1)),
      ("window_tuple_more_queries", dict(t=6, s=4, local_window_size=(2, 1))),
      ("window_causal_more_keys",
       dict(t=4, s=7, local_window_size=(2, 0), is_causal=True)),
      ("window_gqa_mask_lengths_more_keys",
       dict(t=5, s=7, k=2, local_window_size=(3, 1), mask=True,
            key_value_seq_lengths=(7, 5))),
      ("lengths", dict(t=5, s=6, query_seq_lengths=(3, 5),
                       key_value_seq_lengths=(4, 6))),
      ("lengths_causal_t_ne_s", dict(t=5, s=7, is_causal=True, k=2,
                                     query_seq_lengths=(5, 2),
                                     key_value_seq_lengths=(7, 3))),
  )
  def test_output_matches(self, case):
    case = dict(case)
    shape = {d: case.pop(d) for d in ("t", "s", "n", "k") if d in case}
    q, k, v = _qkv(**shape)
    b, t, n, _ = q.shape
    s = k.shape[1]
    kwargs = dict(scale=case.pop("scale", None),
                  is_causal=case.pop("is_causal", False),
                  local_window_size=case.pop("local_window_size", None))
    if case.pop("bias", False):
      kwargs["bias"] = _data.normal(5, (b, n, t, s))
    if case.pop("mask", False):  # column 0 kept open where the band allows
      mask = _data.bernoulli(6, 0.6, (b, 1, t, s))
      kwargs["mask"] = mask.at[..., 0].set(True).at[..., t - 1, :].set(True)
    for name in ("query_seq_lengths", "key_value_seq_lengths"):
      if name in case:
        kwargs[name] = jnp.array(case.pop(name), jnp.int32)
    self.assertEqual(case, {})
    # Every row below its query length sees a key, so jax.nn's answer is
    # defined as ours everywhere.
    sees = _top_left_band(t, s, kwargs["is_causal"],
                          kwargs["local_window_size"])[None, None]
    if "mask" in kwargs:
      sees = sees & np.asarray(kwargs["mask"])
    if "key_value_seq_lengths" in kwargs:
      sees = sees & (np.arange(s) < np.asarray(
          kwargs["key_value_seq_lengths"])[:, None, None, None])
    rows = np.arange(t)[None, None, :]
    if "query_seq_lengths" in kwargs:
      rows = rows < np.asarray(kwargs["query_seq_lengths"])[:, None, None]
    else:
      rows = np.ones((1, 1, t), bool)
    self.assertTrue(np.all(sees.any(-1) | ~rows))
    ours, theirs = _ours_and_theirs(q, k, v, **kwargs)
    chex.assert_trees_all_close(ours, theirs, **F32_TOL)

  @parameterized.named_parameters(
      ("gqa_bias_mask", dict(k=2), dict(bias=(5, (2, 4, 4, 6)),
                                        mask=(6, (2, 1, 4, 6)))),
      ("causal_t_ne_s_lengths", dict(t=6, s=4, k=1),
       dict(is_causal=True, query_seq_lengths=(6, 4),
            key_value_seq_lengths=(4, 3))),
      ("window_t_ne_s", dict(t=4, s=7), dict(local_window_size=(1, 2))),
  )
  def test_gradients_match(self, shape, case):
    q, k, v = _qkv(**shape)
    kwargs = dict(case)
    if "bias" in kwargs:
      kwargs["bias"] = _data.normal(*kwargs["bias"])
    if "mask" in kwargs:
      seed, mask_shape = kwargs["mask"]
      kwargs["mask"] = _data.bernoulli(seed, 0.6, mask_shape).at[..., 0].set(
          True)
    for name in ("query_seq_lengths", "key_value_seq_lengths"):
      if name in kwargs:
        kwargs[name] = jnp.array(kwargs[name], jnp.int32)
    ours, theirs = _ours_and_theirs(q, k, v, implementation="xla", grad=True,
                                    **kwargs)
    chex.assert_trees_all_close(ours, theirs, **F32_TOL)

  def test_unbatched_inputs(self):
    q, k, v = (x[0] for x in _qkv(t=5, s=7, k=2))  # [T, N, H], [S, K, H]
    bias = _data.normal(5, (4, 5, 7))  # [N, T, S]
    kwargs = dict(bias=bias, is_causal=True,
                  key_value_seq_lengths=jnp.array([6], jnp.int32))
    ours, theirs = _ours_and_theirs(q, k, v, return_residual=True, **kwargs)
    chex.assert_shape(ours, ((5, 4, 8), (5, 4)))
    chex.assert_trees_all_close(ours, theirs, **F32_TOL)

  def test_residual_matches(self):
    q, k, v = _qkv(t=5, s=7, k=2)
    kwargs = dict(is_causal=True, local_window_size=(2, 0), scale=0.5,
                  bias=_data.normal(5, (2, 4, 5, 7)))
    ours, theirs = _ours_and_theirs(q, k, v, implementation="xla",
                                    return_residual=True, **kwargs)
    chex.assert_shape(ours[1], (2, 5, 4))
    chex.assert_trees_all_close(ours, theirs, **F32_TOL)


def _mask_handed_on(fn, *args, **kwargs):
  """The ``aj.Mask`` that ``fn`` hands to scaled_dot_product_attention."""
  seen = []
  real = dot_product.scaled_dot_product_attention

  def spy(q, k, v, mask=None, **kw):
    seen.append(mask)
    return real(q, k, v, mask, **kw)

  with mock.patch.object(dot_product, "scaled_dot_product_attention", spy):
    fn(*args, **kwargs)
  (mask,) = seen
  return mask


class TopLeftBandIsPositionsTest(parameterized.TestCase):
  """jax.nn's and flax's band with T != S is positions, not a [T, S] mask."""

  def test_band_is_positions_the_flash_kernel_takes(self):
    # The mask handed on holds no [T, S] array: at T * S = 2 ** 21 the
    # automatic choice picks the flash kernel, which skips blocks by it.
    shape = lambda *dims: jax.ShapeDtypeStruct(dims, jnp.float32)  # noqa: E731
    q, kv = shape(1, 1024, 2, 8), shape(1, 2048, 2, 8)  # [B, T|S, N, H]
    mask = _mask_handed_on(
        lambda *a, **kw: jax.eval_shape(functools.partial(
            jax_nn.dot_product_attention, **kw), *a), q, kv, kv,
        is_causal=True)
    self.assertIsNone(mask.dense)
    self.assertTrue(mask.causal and mask.positioned)
    swapped = lambda x: shape(1, 2, x.shape[1], 8)  # noqa: E731
    why = aj.explain(swapped(q), swapped(kv), swapped(kv), mask)
    self.assertEqual(why.kernel, "flash", str(why))
    # ... and with it the flash kernel gives jax.nn's top-left numbers, on
    # blocks the band cuts (16 x 16 over 32 x 64).
    q, k, v = _qkv(b=1, t=32, s=64, n=2, k=2)
    mask = _mask_handed_on(jax_nn.dot_product_attention, q, k, v,
                           is_causal=True, local_window_size=(20, 3))
    swap = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
    ours = swap(aj.scaled_dot_product_attention(
        swap(q), swap(k), swap(v), mask,
        implementation=aj.kernels.Flash(block_q=16, block_k=16)))
    theirs = jax.nn.dot_product_attention(
        q, k, v, is_causal=True, local_window_size=(20, 3),
        implementation="xla")
    chex.assert_trees_all_close(ours, theirs, **F32_TOL)

  @parameterized.named_parameters(
      ("causal_more_keys", 4, 7, dict(is_causal=True), True),
      ("window_more_queries", 6, 4, dict(local_window_size=(2, 1)), True),
      ("mask_and_window", 4, 7,
       dict(local_window_size=(1, 0), mask=np.ones((2, 1, 4, 7), bool)),
       True),
      ("square", 5, 5, dict(is_causal=True, local_window_size=(2, 0)),
       False),
      ("no_band", 4, 7, dict(), False),
  )
  def test_positions_only_where_the_alignments_differ(self, t, s, kwargs,
                                                      positioned):
    q, k, v = _qkv(t=t, s=s)
    mask = _mask_handed_on(jax_nn.dot_product_attention, q, k, v, **kwargs)
    self.assertEqual(mask.positioned, positioned)
    if positioned:
      self.assertEqual(mask.offsets(t, s), (0, 0))
    self.assertEqual(mask.dense is None, "mask" not in kwargs)

  def test_flax_band_is_positions(self):
    q, k, v = _qkv(t=3, s=6)
    mask = _mask_handed_on(flax_fn.flax_attention_fn, q, k, v,
                           is_causal=True)
    self.assertTrue(mask.causal and mask.positioned)
    self.assertIsNone(mask.dense)
    square = _mask_handed_on(flax_fn.flax_attention_fn, q, q, q,
                             is_causal=True)
    self.assertTrue(square.causal and not square.positioned)


class DocumentedDifferenceTest(absltest.TestCase):

  def test_row_that_sees_nothing_is_zero_not_the_mean_of_values(self):
    q, k, v = _qkv(t=4, s=6, k=2)
    mask = jnp.ones((2, 1, 4, 6), bool).at[0, 0, 1].set(False)  # b 0, row 1
    lengths = jnp.array([6, 0], jnp.int32)  # example 1: no key at all
    (ours, lse), (theirs, _) = _ours_and_theirs(
        q, k, v, mask=mask, key_value_seq_lengths=lengths,
        return_residual=True)
    np.testing.assert_array_equal(ours[0, 1], 0.0)
    np.testing.assert_array_equal(ours[1], 0.0)
    self.assertTrue(np.all(np.isneginf(lse[0, 1])))
    self.assertTrue(np.all(np.isneginf(lse[1])))
    # jax.nn averages the values (of each query head's key/value head).
    mean = jnp.repeat(v.mean(axis=1), 2, axis=1)  # [B, N, H]
    chex.assert_trees_all_close(theirs[0, 1], mean[0], **F32_TOL)
    chex.assert_trees_all_close(theirs[1], jnp.broadcast_to(
        mean[1], (4, 4, 8)), **F32_TOL)
    # Every other row agrees.
    chex.assert_trees_all_close(ours[0, [0, 2, 3]], theirs[0, [0, 2, 3]],
                                **F32_TOL)

  def test_window_past_the_keys_gives_zero_rows(self):
    # Top-left window (1, 0) with T = 6 > S = 3: queries 4 and 5 see nothing.
    q, k, v = _qkv(t=6, s=3)
    ours, theirs = _ours_and_theirs(q, k, v, local_window_size=(1, 0))
    np.testing.assert_array_equal(ours[:, 4:], 0.0)
    chex.assert_trees_all_close(ours[:, :4], theirs[:, :4], **F32_TOL)


class ValidationTest(parameterized.TestCase):

  def test_wrong_rank_names_the_layout_and_the_swap(self):
    q = jnp.ones((4, 8))
    with self.assertRaisesRegex(ValueError, r"(?s)\[B, T, N, H\].*"
                                r"jnp\.swapaxes\(x, 1, 2\).*\[B, N, T, H\]"):
      jax_nn.dot_product_attention(q, q, q)

  def test_heads_that_do_not_group_name_the_layout(self):
    q, k, v = _qkv(n=4, k=3)
    with self.assertRaisesRegex(ValueError, r"(?s)multiple.*\[B, T, N, H\]"
                                r".*jnp\.swapaxes"):
      jax_nn.dot_product_attention(q, k, v)

  def test_mismatched_batch_names_the_layout(self):
    q, k, v = _qkv()
    with self.assertRaisesRegex(ValueError, r"(?s)\[B, T, N, H\].*swapaxes"):
      jax_nn.dot_product_attention(q[:1], k, v)

  @parameterized.named_parameters(
      ("lengths_not_b", dict(key_value_seq_lengths=jnp.ones((2, 1), int)),
       ValueError, r"\[B\]"),
      ("lengths_past_s",
       dict(key_value_seq_lengths=jnp.array([7, 3], jnp.int32)), ValueError,
       r"\[0, 6\]"),
      ("float_lengths", dict(query_seq_lengths=jnp.ones((2,))), TypeError,
       "integer"),
      ("mask_rank_5", dict(mask=jnp.ones((1, 2, 4, 4, 6), bool)), ValueError,
       r"rank <= 4"),
      ("mask_not_broadcastable", dict(mask=jnp.ones((2, 3, 4, 6), bool)),
       ValueError, r"\[B, N, T, S\]"),
      ("float_mask", dict(mask=jnp.ones((4, 6))), TypeError, "bias"),
      ("implementation", dict(implementation="dense"), ValueError, "'xla'"),
      ("negative_window", dict(local_window_size=-1), ValueError,
       "non-negative"),
  )
  def test_bad_arguments(self, kwargs, error, regex):
    q, k, v = _qkv()
    with self.assertRaisesRegex(error, regex):
      jax_nn.dot_product_attention(q, k, v, **kwargs)

  def test_cudnn_refused_off_gpu(self):
    if jax.default_backend() == "gpu":
      self.skipTest("cuDNN is available here")
    q, k, v = _qkv()
    with self.assertRaisesRegex(ValueError, "cudnn"):
      jax_nn.dot_product_attention(q, k, v, implementation="cudnn")


# The layers' projections are the same ops on the same parameters, so only
# attention differs: float32 sums of <= 6 terms of magnitude <= ~4 in other
# orders (~1e-6); the parameter gradients add sums over <= 12 rows, still
# well below 1e-5, which leaves an order of magnitude of headroom.
FLAX_TOL = dict(atol=1e-5, rtol=1e-5)


def _flax_layers(**kwargs):
  """Ours and flax's default layer, each built from seed 0."""
  kwargs = dict(num_heads=4, in_features=8, qkv_features=16, num_kv_heads=2,
                decode=False) | kwargs
  return tuple(nnx.MultiHeadAttention(**kwargs, attention_fn=fn,
                                      rngs=nnx.Rngs(0))
               for fn in (flax_fn.flax_attention_fn,
                          nnx.dot_product_attention))


def _flax_values_and_grads(layers, inputs, cotangent, **call):
  """Each layer's output and gradients (params, then each input), one jit."""

  def loss(layer, *inputs):
    out = layer(*inputs, **call)
    return jnp.sum(out * cotangent), out

  @nnx.jit
  def run(ours, theirs, inputs):
    argnums = tuple(range(len(inputs) + 1))
    return [nnx.grad(loss, argnums=argnums, has_aux=True)(layer, *inputs)
            for layer in (ours, theirs)]

  return run(*layers, inputs)


class FlaxAttentionFnTest(parameterized.TestCase):

  def test_self_attention_with_padding_and_causal_mask(self):
    x = _data.normal(0, (2, 5, 8))  # [B, T, D]
    valid = jnp.array([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]], bool)
    mask = nnx.combine_masks(nnx.make_attention_mask(valid, valid),
                             nnx.make_causal_mask(valid))  # float [B, 1, T, T]
    rows = valid[..., None]  # padding queries see nothing: compared apart
    layers = _flax_layers()
    (ours_g, ours), (theirs_g, theirs) = _flax_values_and_grads(
        layers, (x,), _data.normal(9, (2, 5, 8)) * rows, mask=mask)
    chex.assert_trees_all_close(ours * rows, theirs * rows, **FLAX_TOL)
    chex.assert_trees_all_close(ours_g, theirs_g, **FLAX_TOL)
    # A padding query: attention 0 here (out = the zero-initialised output
    # bias), flax's mean of the values there.
    np.testing.assert_array_equal(ours[~valid], 0.0)
    self.assertGreater(float(jnp.abs(theirs[~valid]).max()), 1e-3)

  def test_cross_attention_top_left_causal_extra_batch_dim(self):
    q = _data.normal(1, (2, 2, 3, 8))   # [batch..., T, D]
    k = _data.normal(2, (2, 2, 6, 5))   # [batch..., S, Dkv]
    v = _data.normal(5, (2, 2, 6, 5))   # distinct from the keys
    key_valid = jnp.arange(6)[None, None] < jnp.array([[6, 4], [5, 2]])[..., None]
    mask = nnx.make_attention_mask(jnp.ones((2, 2, 3), bool), key_valid)
    layers = _flax_layers(in_kv_features=5)
    (ours_g, ours), (theirs_g, theirs) = _flax_values_and_grads(
        layers, (q, k, v), _data.normal(9, (2, 2, 3, 8)), mask=mask,
        is_causal=True)  # T = 3 < S = 6: query i sees keys j <= i
    chex.assert_trees_all_close(ours, theirs, **FLAX_TOL)
    chex.assert_trees_all_close(ours_g, theirs_g, **FLAX_TOL)

  def test_decode_with_the_cache(self):
    layers = _flax_layers(decode=True)
    x = _data.normal(3, (2, 4, 8))
    for layer in layers:
      layer.init_cache(x.shape)

    @nnx.jit
    def step(ours, theirs, token):
      return ours(token), theirs(token)

    for i in range(x.shape[1]):
      ours, theirs = step(*layers, x[:, i:i + 1])
      chex.assert_trees_all_close(ours, theirs, **FLAX_TOL)

  def test_dropout_and_sown_weights(self):
    # broadcast_dropout=False is flax's independent draw per example, head,
    # query and key; ours draws each entry's bit by a hash of its indices
    # (core/dropout.py, the same in every kernel), not flax's bernoulli
    # array, so the outputs differ while the sown weights (before dropout)
    # are flax's.
    layers = _flax_layers(dropout_rate=0.5, broadcast_dropout=False)
    x = _data.normal(4, (2, 5, 8))

    @nnx.jit
    def run(ours, theirs):
      return [nnx.capture(layer, nnx.Intermediate)(
          x, deterministic=False, sow_weights=True) for layer in (ours, theirs)]

    (ours, ours_sown), (theirs, theirs_sown) = run(*layers)
    self.assertGreater(  # dropout is on
        float(jnp.abs(ours - layers[0](x, deterministic=True)).max()), 1e-2)
    chex.assert_shape(ours, theirs.shape)
    chex.assert_shape(ours_sown["attention_weights"].get_value(),
                      ((2, 4, 5, 5),))
    chex.assert_trees_all_close(ours_sown, theirs_sown, **FLAX_TOL)

  def test_precision_reaches_every_product(self):
    q, k, v = _qkv(t=4, s=6, n=4, k=2)

    def products(precision):
      loss = lambda q, k, v: jnp.sum(flax_fn.flax_attention_fn(
          q, k, v, precision=precision))
      jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
      return [e.params["precision"] for e in jaxpr.eqns
              if e.primitive.name == "dot_general"]

    highest = (jax.lax.Precision.HIGHEST,) * 2
    self.assertLen(products("highest"), 6)  # 2 forward, 4 backward
    self.assertTrue(all(p == highest for p in products("highest")))
    self.assertTrue(all(p != highest for p in products(None)))

  @parameterized.named_parameters(
      ("broadcast_dropout", dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)),
       ValueError, "broadcast_dropout=False"),
      ("dropout_without_rng",
       dict(dropout_rate=0.1, broadcast_dropout=False), ValueError,
       "dropout_rng"),
      ("mixed_precision", dict(precision=("high", "highest")), ValueError,
       "single"),
      ("dot_algorithm",
       dict(precision=jax.lax.DotAlgorithmPreset.BF16_BF16_F32), TypeError,
       "dot algorithms"),
      ("mask_not_broadcastable", dict(mask=jnp.ones((2, 3, 4, 6), bool)),
       ValueError, r"\[batch\.\.\., num_heads, q_length, kv_length\]"),
      ("flag_not_bool", dict(is_causal="yes"), TypeError,
       "is_causal"),
  )
  def test_refuses(self, kwargs, error, regex):
    q, k, v = _qkv()
    with self.assertRaisesRegex(error, regex):
      flax_fn.flax_attention_fn(q, k, v, **kwargs)

  def test_refuses_mismatched_batch_dims(self):
    q, k, v = _qkv()
    with self.assertRaisesRegex(ValueError, "same batch dims"):
      flax_fn.flax_attention_fn(q[None], k[None].repeat(2, 0), v[None])

  def test_deterministic_needs_no_dropout_rng(self):
    q, k, v = _qkv()
    out = jax.eval_shape(functools.partial(
        flax_fn.flax_attention_fn, dropout_rate=0.5, deterministic=True),
                         q, k, v)
    self.assertEqual(out.shape, q.shape)


if __name__ == "__main__":
  absltest.main()
