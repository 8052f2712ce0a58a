"""apply_rope and segment_positions against independent NumPy references."""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.scores import rope
from tests import _data
from tests import reference

# float32 against float64 with positions < 64: the angle p * base**(-2i/rot)
# is rounded twice (the frequency, then the product), an absolute error of
# <= 64 * 2 * 6e-8 ~ 8e-6 rad; XLA's float32 cos/sin add a few ulp (~5e-7).
# With pair norms <= ~5 (standard-normal inputs) an output is off by
# <= ~4e-5; 1e-4 leaves headroom without hiding a wrong frequency or pairing
# (those give errors of order 1).
F32_TOL = dict(atol=1e-4, rtol=1e-5)
# bfloat16 output: the float32 result above, rounded once to 8 significant
# bits (relative error <= 2**-8); rtol is twice that unit roundoff.
BF16_TOL = dict(atol=1e-4, rtol=2.0**-7)
MAX_POSITION = 64  # the tolerances above assume positions below this


def _positions(seed, shape, high=MAX_POSITION):
  return np.random.default_rng(seed).integers(0, high, shape).astype(np.int32)


def _rope_reference(x, positions, base=10000.0, fraction=1.0):
  """Float64 rotary embedding: an explicit 2x2 rotation per token and pair.

  Half-split pairs ``(x[i], x[i + rot/2])`` rotated by
  ``p * base**(-2 i / rot)``; features ``rot:`` are copied.
  """
  x = np.asarray(x, np.float64)
  h = x.shape[-1]
  rot = int(h * fraction) // 2 * 2
  half = rot // 2
  pos = np.broadcast_to(np.asarray(positions, np.float64), x.shape[:-1])
  out = x.copy()
  for idx in np.ndindex(x.shape[:-1]):
    for i in range(half):
      theta = pos[idx] * base ** (-2.0 * i / rot)
      rotation = np.array([[np.cos(theta), -np.sin(theta)],
                           [np.sin(theta), np.cos(theta)]])
      pair = rotation @ np.array([x[idx + (i,)], x[idx + (i + half,)]])
      out[idx + (i,)], out[idx + (i + half,)] = pair
  return out


def _segment_positions_reference(ids):
  """Offsets from the start of each run of equal consecutive ids, by loop."""
  ids = np.asarray(ids)
  out = np.zeros(ids.shape, np.int32)
  for idx in np.ndindex(ids.shape[:-1]):
    row = ids[idx]
    for t in range(1, row.shape[0]):
      out[idx + (t,)] = 0 if row[t] != row[t - 1] else out[idx + (t - 1,)] + 1
  return out


def _runs(row):
  """[(start, end)] of the maximal runs of equal consecutive ids in ``row``."""
  row = np.asarray(row)
  starts = [0] + [t for t in range(1, len(row)) if row[t] != row[t - 1]]
  return list(zip(starts, starts[1:] + [len(row)]))


class ApplyRopeTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
      # Every pair of (dtype, fraction, positions layout) values occurs once.
      ("f32_full_shared_pos", jnp.float32, 1.0, "shared", 10000.0),
      ("f32_half_batch_pos_small_base", jnp.float32, 0.5, "batch", 100.0),
      ("bf16_full_batch_pos", jnp.bfloat16, 1.0, "batch", 10000.0),
      ("bf16_half_shared_pos", jnp.bfloat16, 0.5, "shared", 500.0),
  )
  def test_matches_numpy_reference(self, dtype, fraction, pos_kind, base):
    b, n, t, h = 2, 3, 5, 8
    x = _data.normal(0, (b, n, t, h), dtype)
    positions = (_positions(1, (t,)) if pos_kind == "shared"
                 else _positions(2, (b, 1, t)))
    fn = self.variant(functools.partial(
        rope.apply_rope, rope=rope.Rope(base=base, fraction=fraction)))
    out = fn(x, positions)
    chex.assert_shape(out, x.shape)
    self.assertEqual(out.dtype, x.dtype)
    # The reference rotates the same (possibly bf16-rounded) input values.
    ref = _rope_reference(np.asarray(x, np.float64), positions, base,
                          fraction)
    tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, **tol)
    rot = int(h * fraction)
    # Features past the rotary dim are copied bit for bit.
    np.testing.assert_array_equal(np.asarray(out[..., rot:], np.float32),
                                  np.asarray(x[..., rot:], np.float32))

  @chex.variants(with_jit=True, without_jit=True)
  def test_partial_rotary_and_float_positions(self):
    # H=12, fraction 0.7 -> int(8.4) = 8 rotated features; float positions.
    x = _data.normal(3, (4, 12))
    positions = np.array([0.0, 1.5, 7.25, 30.0], np.float32)
    fn = self.variant(functools.partial(rope.apply_rope,
                                        rope=rope.Rope(fraction=0.7)))
    out = fn(x, positions)
    np.testing.assert_allclose(
        out, _rope_reference(x, positions, fraction=0.7), **F32_TOL)
    np.testing.assert_array_equal(out[..., 8:], x[..., 8:])

  def test_float64_input_computes_in_float64(self):
    with jax.enable_x64(True):
      x = jnp.asarray(_data.normal(4, (3, 6)), jnp.float64)
      positions = jnp.array([5, 1000, 123456])
      out = jax.jit(rope.apply_rope)(x, positions)
      self.assertEqual(out.dtype, jnp.float64)
      # float64 angles at positions ~1e5: ~1e5 * 2.2e-16 rad of error.
      np.testing.assert_allclose(out, _rope_reference(x, positions),
                                 atol=1e-10, rtol=1e-10)

  def test_the_multi_head_reference_rotates_as_the_loop_does(self):
    # tests/reference.py's vectorised rotary (used against the module) is
    # the same rotation as the explicit 2x2 loop above.
    x = np.asarray(_data.normal(6, (2, 3, 5, 6)), np.float64)
    positions = _positions(7, (2, 1, 5))
    np.testing.assert_allclose(reference.rope(x, positions, 500.0),
                               _rope_reference(x, positions, base=500.0),
                               atol=1e-12, rtol=1e-12)

  def test_position_zero_is_identity(self):
    x = _data.normal(5, (2, 3, 16))
    # A scalar position (a Python int) applies to every token.
    out = rope.apply_rope(x, 0)
    np.testing.assert_array_equal(out, x)  # cos 0 = 1, sin 0 = 0 exactly


class RelativePositionTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(("full", 1.0), ("partial", 0.5))
  def test_scores_depend_only_on_position_difference(self, fraction):
    t, s, h, shift = 6, 7, 8, 23
    q = _data.normal(10, (2, t, h))
    k = _data.normal(11, (2, s, h))
    m = _positions(12, (2, t), high=MAX_POSITION - shift)
    n = _positions(13, (2, s), high=MAX_POSITION - shift)

    @self.variant
    def scores(m, n):
      rq = rope.apply_rope(q, m, rope=rope.Rope(fraction=fraction))
      rk = rope.apply_rope(k, n, rope=rope.Rope(fraction=fraction))
      return jnp.einsum("bth,bsh->bts", rq, rk)

    got = scores(m, n)
    # Shifting both positions by a constant keeps every score: the error
    # budget is two rotated vectors (F32_TOL each) times norms <= ~4, summed
    # over H = 8 features -> below ~1e-3.
    np.testing.assert_allclose(scores(m + shift, n + shift), got,
                               atol=1e-3, rtol=1e-5)
    # And each score is <R(m - n) q, k>, computed in float64.
    ref = np.zeros((2, t, s))
    for b, i, j in np.ndindex(2, t, s):
      rq = _rope_reference(q[b, i][None], m[b, i] - n[b, j],
                           fraction=fraction)[0]
      ref[b, i, j] = rq @ np.asarray(k[b, j], np.float64)
    np.testing.assert_allclose(got, ref, atol=1e-3, rtol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  def test_preserves_norm_of_each_pair(self):
    h, fraction = 16, 0.5  # rot = 8: pairs (i, i + 4) for i < 4
    x = _data.normal(20, (3, 5, h))
    # Large positions too: the angle may be off, the norm must not be.
    positions = _positions(21, (3, 5), high=100_000)
    out = self.variant(functools.partial(
        rope.apply_rope, rope=rope.Rope(fraction=fraction)))(x, positions)
    pair_norm = lambda a: np.hypot(np.asarray(a[..., :4], np.float64),
                                   np.asarray(a[..., 4:8], np.float64))
    # cos**2 + sin**2 = 1 to a few float32 ulp, plus one rounding per output:
    # relative error ~5e-7.
    np.testing.assert_allclose(pair_norm(out), pair_norm(x), rtol=5e-6,
                               atol=1e-6)
    np.testing.assert_array_equal(out[..., 8:], x[..., 8:])


class SegmentPositionsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
      ("one_row", "increasing", (13,)),
      ("batch", "increasing", (3, 11)),
      ("batch_heads", "increasing", (2, 2, 9)),
      ("repeated_ids_across_runs", "small_alphabet", (4, 10)),
      ("single_token", "increasing", (2, 1)),
  )
  def test_matches_numpy_loop(self, kind, shape):
    if kind == "increasing":  # packed documents: ids grow at each boundary
      ids = np.cumsum(np.asarray(_data.bernoulli(30, 0.3, shape)), axis=-1)
    else:  # ids like [2, 0, 0, 2, 1]: a change of id starts a run
      ids = np.random.default_rng(31).integers(0, 3, shape)
    ids = ids.astype(np.int32)
    got = self.variant(rope.segment_positions)(ids)
    self.assertEqual(got.dtype, jnp.int32)
    np.testing.assert_array_equal(got, _segment_positions_reference(ids))

  def test_same_id_after_a_change_restarts(self):
    got = rope.segment_positions(jnp.array([[0, 0, 1, 1, 0], [4, 4, 4, 4, 4]]))
    np.testing.assert_array_equal(got, [[0, 1, 0, 1, 0], [0, 1, 2, 3, 4]])

  @chex.variants(with_jit=True, without_jit=True)
  def test_packed_rope_matches_each_document_alone(self):
    b, n, t, h = 2, 2, 12, 8
    x = _data.normal(40, (b, n, t, h))
    ids = np.array([[0] * 5 + [1] * 4 + [2] * 3,
                    [7] * 2 + [8] * 7 + [9] * 3], np.int32)

    @self.variant
    def packed(x, ids):
      return rope.apply_rope(x, rope.segment_positions(ids)[:, None, :])

    out = packed(x, ids)
    alone = jax.jit(rope.apply_rope)
    for row in range(b):
      for start, end in _runs(ids[row]):
        want = alone(x[row, :, start:end], jnp.arange(end - start))
        # The same float32 operations per element; XLA's vector and scalar
        # code paths for cos/sin may still differ by an ulp or so.
        np.testing.assert_allclose(out[row, :, start:end], want, atol=1e-6,
                                   rtol=1e-6)


class ValidationTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("odd_head_dim", dict(x=np.ones((4, 7), np.float32)), ValueError,
       r"x must have an even head dim.*\(4, 7\)"),
      ("integer_x", dict(x=np.ones((4, 8), np.int32)), TypeError,
       r"x must be a real floating-point array.*int32.*\(4, 8\)"),
      ("rank_1_x", dict(x=np.ones((8,), np.float32)), ValueError,
       r"x must have rank >= 2.*\(8,\)"),
      ("fraction_zero", dict(fraction=0.0), ValueError,
       r"fraction must be in \(0, 1\], got 0.0"),
      ("fraction_above_one", dict(fraction=1.5), ValueError,
       r"fraction must be in \(0, 1\], got 1.5"),
      ("fraction_rotates_nothing", dict(fraction=0.1), ValueError,
       r"fraction=0.1 rotates no features of head dim H=8"),
      ("fraction_not_a_number", dict(fraction="half"), TypeError,
       r"fraction must be a real Python number"),
      ("base_zero", dict(base=0.0), ValueError,
       r"base must be positive, got 0.0"),
      ("base_negative", dict(base=-10.0), ValueError,
       r"base must be positive, got -10.0"),
      ("base_array", dict(base=jnp.array(10000.0)), TypeError,
       r"base must be a real Python number"),
      ("positions_wrong_length", dict(positions=np.arange(5)), ValueError,
       r"positions with shape \(5,\) is not broadcastable to "
       r"x.shape\[:-1\].*\(2, 4\)"),
      ("positions_grow_x", dict(positions=np.zeros((3, 2, 4), np.int32)),
       ValueError, r"positions with shape \(3, 2, 4\) is not broadcastable"),
      ("positions_bool", dict(positions=np.ones((4,), bool)), TypeError,
       r"positions must be an integer or float array.*bool"),
      ("positions_none", dict(positions=None), TypeError,
       r"positions is None"),
  )
  def test_apply_rope_rejects(self, override, exception, pattern):
    kwargs = dict(x=np.ones((2, 4, 8), np.float32), positions=np.arange(4))
    kwargs.update(override)
    x, positions = kwargs.pop("x"), kwargs.pop("positions")
    with self.assertRaisesRegex(exception, pattern):
      if kwargs:  # base and fraction: the Rope holds them
        kwargs = {"rope": rope.Rope(**kwargs)}
      rope.apply_rope(x, positions, **kwargs)

  def test_base_must_be_static(self):
    x = jnp.ones((4, 8))
    with self.assertRaisesRegex(TypeError, r"base must be a Python number, "
                                r"got a traced value"):
      jax.jit(lambda base: rope.apply_rope(x, jnp.arange(4),
                                           rope=rope.Rope(base=base)))(1e4)

  @parameterized.named_parameters(
      ("float_ids", np.zeros((2, 5), np.float32), TypeError,
       r"segment_ids must be an integer array.*float32.*\(2, 5\)"),
      ("bool_ids", np.zeros((5,), bool), TypeError,
       r"segment_ids must be an integer array.*bool"),
      ("scalar_ids", np.int32(3), ValueError,
       r"segment_ids must have rank >= 1.*\(\)"),
  )
  def test_segment_positions_rejects(self, ids, exception, pattern):
    with self.assertRaisesRegex(exception, pattern):
      rope.segment_positions(ids)


if __name__ == "__main__":
  absltest.main()
