"""Rope's scalings and layouts against float64 references of the formulas.

The references below import nothing of ours: inverse frequencies scalar by
scalar from the published definitions (HF transformers'
``modeling_rope_utils``, Meta's llama 3.1 ``apply_scaling``, the YaRN
reference code), and the rotation as explicit 2x2 matrices per token and
pair. Calls go through one ``jax.jit`` with the Rope static: a compile
per case costs less CPU than eager dispatch of the same dozen operations.
"""

import math
import re

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.scores import rope as rope_lib
from attention_jax.scores.rope import Rope
from tests import _data

# float32 against float64 with positions < 64, as tests/test_rope.py: the
# angle p * theta is rounded twice (the frequency, then the product), <= 64
# * 2 * 6e-8 ~ 8e-6 rad, plus a few ulp from cos/sin; pair norms <= ~5 times
# YaRN magnitudes <= 1.2 keep an output within ~5e-5. 1e-4 leaves headroom
# without hiding a wrong frequency, band or pairing (errors of order 1e-2
# and up at these positions, see each case).
F32_TOL = dict(atol=1e-4, rtol=1e-5)
# Frequencies: both sides float64, a handful of operations each.
F64_TOL = dict(atol=0.0, rtol=1e-12)


# --- references ------------------------------------------------------------


def _plain_reference(rot, base):
  return [base ** (-2.0 * i / rot) for i in range(rot // 2)]


def _linear_reference(rot, base, factor):
  # Position interpolation: p / factor, the same angle as theta / factor.
  return [theta / factor for theta in _plain_reference(rot, base)]


def _dynamic_reference(rot, base, factor, original, seq_len):
  # Dynamic NTK (HF _compute_dynamic_ntk_parameters): the base grows once
  # the sequence passes the trained context, else RoPE is unchanged.
  if seq_len > original:
    base = base * ((factor * seq_len / original) - (factor - 1)) ** (
        rot / (rot - 2))
  return _plain_reference(rot, base)


def _llama3_reference(rot, base, factor, original, low_freq_factor,
                      high_freq_factor):
  # Llama 3.1's apply_scaling: short wavelengths kept, long ones divided by
  # factor, a linear blend in original / wavelength between.
  low_freq_wavelen = original / low_freq_factor
  high_freq_wavelen = original / high_freq_factor
  out = []
  for theta in _plain_reference(rot, base):
    wavelen = 2 * math.pi / theta
    if wavelen < high_freq_wavelen:
      out.append(theta)
    elif wavelen > low_freq_wavelen:
      out.append(theta / factor)
    else:
      smooth = ((original / wavelen - low_freq_factor)
                / (high_freq_factor - low_freq_factor))
      out.append((1 - smooth) * theta / factor + smooth * theta)
  return out


def _yarn_reference(rot, base, factor, original, beta_fast=32.0,
                    beta_slow=1.0, truncate=True):
  # YaRN ("NTK-by-parts", arXiv 2309.00071 sec. 3.2, as its reference code
  # and HF): the dim d whose pair turns b times over the trained context
  # solves original / (2 pi base**(2d/rot)) = b. Dims below d(beta_fast)
  # keep theta (extrapolate), dims above d(beta_slow) take theta / factor
  # (interpolate), a linear ramp in d between.
  def dim_turning(turns):
    return rot * math.log(original / (turns * 2 * math.pi)) / (
        2 * math.log(base))

  low, high = dim_turning(beta_fast), dim_turning(beta_slow)
  if truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, rot - 1)
  if low == high:
    high += 0.001
  out = []
  for i, theta in enumerate(_plain_reference(rot, base)):
    ramp = min(max((i - low) / (high - low), 0.0), 1.0)
    out.append(theta / factor * ramp + theta * (1 - ramp))
  return out


def _yarn_magnitude_reference(factor, attention_factor=None, mscale=None,
                              mscale_all_dim=None):
  def get_mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

  if attention_factor is not None:
    return attention_factor
  if mscale is not None:
    return get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
  return get_mscale(factor)


def _rotate_reference(x, positions, thetas, magnitude=1.0, interleaved=False):
  """Float64: each pair times ``magnitude * R(p * theta_i)``; the rest kept.

  Pair ``i`` is ``(2i, 2i + 1)`` interleaved, else ``(i, i + R/2)``.
  """
  x = np.asarray(x, np.float64)
  half = len(thetas)
  pos = np.broadcast_to(np.asarray(positions, np.float64), x.shape[:-1])
  out = x.copy()
  for idx in np.ndindex(x.shape[:-1]):
    for i, theta in enumerate(thetas):
      a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
      angle = pos[idx] * theta
      rotation = magnitude * np.array([[math.cos(angle), -math.sin(angle)],
                                       [math.sin(angle), math.cos(angle)]])
      out[idx + (a,)], out[idx + (b,)] = rotation @ np.array(
          [x[idx + (a,)], x[idx + (b,)]])
  return out


# The Rope is hashable: a static argument.
_apply = jax.jit(rope_lib.apply_rope, static_argnames=("rope",))


def _positions(seed, shape, high=64):
  return np.random.default_rng(seed).integers(0, high, shape).astype(np.int32)


# --- the cases: (Rope fields, head dim, positions, reference thetas, mag) ----

_LLAMA3 = dict(scaling="llama3", factor=8.0, original_max_positions=64)
_YARN = dict(scaling="yarn", factor=4.0, original_max_positions=64)


def _case_reference(fields, rot, seq_len):
  """Reference thetas and magnitude for a case's Rope fields."""
  f = dict(fields)
  base = f.pop("base", 10000.0)
  f.pop("fraction", None)
  interleaved = f.pop("interleaved", False)
  kind = f.pop("scaling", "none")
  magnitude = 1.0
  if kind == "none":
    thetas = _plain_reference(rot, base)
  elif kind == "linear":
    thetas = _linear_reference(rot, base, f["factor"])
  elif kind == "dynamic":
    thetas = _dynamic_reference(rot, base, f["factor"],
                                f["original_max_positions"], seq_len)
  elif kind == "llama3":
    thetas = _llama3_reference(rot, base, f["factor"],
                               f["original_max_positions"],
                               f.get("low_freq_factor", 1.0),
                               f.get("high_freq_factor", 4.0))
  else:
    thetas = _yarn_reference(rot, base, f["factor"],
                             f["original_max_positions"],
                             f.get("beta_fast", 32.0), f.get("beta_slow", 1.0),
                             f.get("truncate", True))
    magnitude = _yarn_magnitude_reference(
        f["factor"], f.get("attention_factor"), f.get("mscale"),
        f.get("mscale_all_dim"))
  return thetas, magnitude, interleaved


class InverseFrequenciesTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("none", dict(base=500.0), 16, None),
      ("linear", dict(scaling="linear", factor=4.0), 16, None),
      ("dynamic_below", dict(scaling="dynamic", factor=2.0,
                             original_max_positions=64), 16, 50),
      ("dynamic_above", dict(scaling="dynamic", factor=2.0,
                             original_max_positions=64), 16, 200),
      # Llama 3.1's published values: the three bands at R = 128 (checked).
      ("llama3_8b", dict(base=500000.0, scaling="llama3", factor=8.0,
                         original_max_positions=8192), 128, None),
      ("llama3_narrow_band", dict(scaling="llama3", factor=4.0,
                                  original_max_positions=512,
                                  low_freq_factor=2.0,
                                  high_freq_factor=3.0), 32, None),
      ("yarn", dict(scaling="yarn", factor=4.0,
                    original_max_positions=2048), 32, None),
      ("yarn_no_truncate", dict(scaling="yarn", factor=4.0,
                                original_max_positions=2048,
                                truncate=False), 32, None),
      ("yarn_betas", dict(scaling="yarn", factor=16.0,
                          original_max_positions=4096, beta_fast=16.0,
                          beta_slow=2.0, base=50000.0), 64, None),
  )
  def test_match_published_formulas(self, fields, rot, seq_len):
    rope = Rope(**fields)
    got = rope.inverse_frequencies(rot, seq_len)
    self.assertIsInstance(got, np.ndarray)
    self.assertEqual(got.dtype, np.float64)
    want, magnitude, _ = _case_reference(fields, rot, seq_len)
    np.testing.assert_allclose(got, want, **F64_TOL)
    self.assertAlmostEqual(rope.magnitude, magnitude, places=14)

  def test_cases_exercise_what_they_claim(self):
    # Llama 3.1 at R = 128: some pairs kept, some divided, some blended.
    plain = np.array(_plain_reference(128, 500000.0))
    got = Rope(**dict(base=500000.0, scaling="llama3", factor=8.0,
                      original_max_positions=8192)).inverse_frequencies(128)
    kept, divided = got == plain, np.isclose(got, plain / 8, rtol=1e-14)
    self.assertTrue(kept.any() and divided.any() and (~kept & ~divided).any())
    # truncate changes YaRN's ramp (floor/ceil of 4.03 and 10.05 at these).
    yarn = dict(scaling="yarn", factor=4.0, original_max_positions=2048)
    a = Rope(**yarn).inverse_frequencies(32)
    b = Rope(**yarn, truncate=False).inverse_frequencies(32)
    self.assertGreater(np.max(np.abs(a / b - 1)), 1e-2)
    # The paper's limits: pairs turning often keep theta, rarely take
    # theta / factor (here dims <= 4 and >= 11 with truncation).
    plain = np.array(_plain_reference(32, 10000.0))
    np.testing.assert_allclose(a[:5], plain[:5], **F64_TOL)
    np.testing.assert_allclose(a[11:], plain[11:] / 4, **F64_TOL)

  def test_dynamic_with_an_array_seq_len_computes_on_device(self):
    rope = Rope(scaling="dynamic", factor=2.0, original_max_positions=64)
    got = rope.inverse_frequencies(16, jnp.asarray(200))
    self.assertIsInstance(got, jax.Array)
    # float32 exp/log of the correction: relative error ~ a few 1e-7.
    np.testing.assert_allclose(
        got, _dynamic_reference(16, 10000.0, 2.0, 64, 200), rtol=2e-6)

  def test_magnitude(self):
    self.assertEqual(Rope().magnitude, 1.0)
    self.assertEqual(Rope(scaling="linear", factor=4.0).magnitude, 1.0)
    yarn = dict(scaling="yarn", original_max_positions=64)
    self.assertAlmostEqual(Rope(**yarn, factor=4.0).magnitude,
                           0.1 * math.log(4.0) + 1.0, places=15)
    self.assertEqual(Rope(**yarn, factor=1.0).magnitude, 1.0)
    self.assertEqual(Rope(**yarn, factor=4.0, attention_factor=0.5)
                     .attention_factor_value, 0.5)
    # DeepSeek-V2-Lite's mscale == mscale_all_dim: the ratio is 1.
    self.assertEqual(Rope(**yarn, factor=40.0, mscale=0.707,
                          mscale_all_dim=0.707).magnitude, 1.0)

  def test_rotary_dim(self):
    # HF's int(head_dim * partial_rotary_factor), never rounded to even.
    self.assertEqual(Rope().rotary_dim(16), 16)
    self.assertEqual(Rope(fraction=0.75).rotary_dim(128), 96)  # Phi-4-mini
    self.assertEqual(Rope(fraction=0.25).rotary_dim(256), 64)  # GPT-J
    self.assertEqual(Rope(fraction=0.4).rotary_dim(80), 32)  # Phi-2
    self.assertEqual(Rope(fraction=0.334).rotary_dim(192), 64)  # MiMo-V2


class OddRotaryWidthTest(parameterized.TestCase):
  # An odd int(H * fraction) used to rotate one feature fewer, silently.

  @parameterized.named_parameters(
      ("half_of_6", 0.5, 6, 3),
      ("three_quarters_of_12", 0.75, 12, 9),
      ("one", 0.1, 16, 1),
  )
  def test_refused_where_the_head_dim_is_known(self, fraction, h, width):
    rope = Rope(fraction=fraction)  # H unknown yet: accepted
    pattern = (rf"fraction={fraction} of head dim H={h} gives int\(H \* "
               rf"fraction\) = {width} rotated features, an odd count")
    with self.assertRaisesRegex(ValueError, pattern):
      rope.rotary_dim(h)
    x, positions = _data.normal(3, (2, 4, h)), np.arange(4)
    for apply in (rope_lib.apply_rope, _apply):  # eager and under jit
      with self.assertRaisesRegex(ValueError, pattern):
        apply(x, positions, rope=rope)

  @parameterized.named_parameters(("half_of_6", 0.5, 6),
                                  ("three_quarters_of_12", 0.75, 12))
  def test_the_fixes_it_offers_fit(self, fraction, h):
    with self.assertRaises(ValueError) as refused:
      Rope(fraction=fraction).rotary_dim(h)
    message = str(refused.exception)
    offered = re.findall(r"(\d\.\d+) \((\d+) of (\d+)\)", message)
    self.assertLen(offered, 2)  # one width below, one above
    dims = re.findall(r"H=(\d+)", message.split("is even")[-1])
    self.assertLen(dims, 2)  # the nearest below and above
    for head_dim in map(int, dims):  # each offered head dim gives an even width
      self.assertEqual(Rope(fraction=fraction).rotary_dim(head_dim) % 2, 0)
    x, positions = _data.normal(4, (2, 6, h)), _positions(5, (2, 6))
    for value, width, of in offered:
      self.assertEqual(int(of), h)
      rope = Rope(fraction=float(value))
      self.assertEqual(rope.rotary_dim(h), int(width))
      want = _rotate_reference(x, positions,
                               _plain_reference(int(width), 10000.0))
      np.testing.assert_allclose(np.asarray(_apply(x, positions, rope=rope),
                                            np.float64), want, **F32_TOL)


class ApplyRopeVariantsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      # factor 4 moves every angle by 3/4 of itself: O(1) at p ~ 60.
      ("linear", dict(scaling="linear", factor=4.0), 16, "random"),
      ("dynamic_below", dict(scaling="dynamic", factor=2.0,
                             original_max_positions=64), 16, "random"),
      # max position 15 > 8: the base grows by (2 * 16 / 8 - 1)**(16 / 14).
      ("dynamic_above", dict(scaling="dynamic", factor=2.0,
                             original_max_positions=8), 16, "to_15"),
      # O = 64 at R = 32: pairs 0-1 kept, 2-4 blended, 5+ divided.
      ("llama3", _LLAMA3, 32, "random"),
      # O = 64 at R = 32: the ramp runs over dims 0..5 (0..4.03 untruncated).
      ("yarn", _YARN, 32, "random"),
      ("yarn_no_truncate", dict(_YARN, truncate=False), 32, "random"),
      ("yarn_attention_factor", dict(_YARN, attention_factor=0.7), 32,
       "random"),
      ("yarn_mscale", dict(_YARN, mscale=1.0, mscale_all_dim=0.5), 32,
       "random"),
      ("interleaved", dict(interleaved=True, base=500.0), 16, "random"),
      ("partial_half_split", dict(_YARN, fraction=0.5), 32, "random"),
      # H = 16, fraction 0.75: 12 features rotate as 6 interleaved pairs.
      ("partial_interleaved", dict(_LLAMA3, fraction=0.75, interleaved=True),
       16, "random"),
      ("partial_interleaved_yarn", dict(_YARN, fraction=0.5,
                                        interleaved=True), 32, "random"),
  )
  def test_matches_rotation_reference(self, fields, h, pos_kind):
    b, n, t = 2, 2, 8
    x = _data.normal(1, (b, n, t, h))
    if pos_kind == "random":
      positions = _positions(2, (b, 1, t))
    else:
      positions = np.array([[[0, 3, 7, 8, 10, 12, 14, 15]],
                            [[1, 2, 4, 5, 6, 9, 11, 13]]], np.int32)
    rope = Rope(**fields)
    out = _apply(x, positions, rope=rope)
    self.assertEqual(out.shape, x.shape)
    self.assertEqual(out.dtype, x.dtype)
    rot = int(h * fields.get("fraction", 1.0)) // 2 * 2
    seq_len = int(np.max(positions)) + 1
    thetas, magnitude, interleaved = _case_reference(fields, rot, seq_len)
    want = _rotate_reference(x, positions, thetas, magnitude, interleaved)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, **F32_TOL)
    # Pass-through features are copied bit for bit (no magnitude either).
    np.testing.assert_array_equal(out[..., rot:], x[..., rot:])

  def test_default_rope_is_the_plain_call_exactly(self):
    x = _data.normal(3, (2, 5, 12))
    positions = _positions(4, (2, 5))
    for plain, rope in [
        (None, Rope()),
        # factor 1 divides by one: the same frequencies exactly.
        (Rope(base=500.0), Rope(base=500.0, scaling="linear", factor=1.0)),
    ]:
      np.testing.assert_array_equal(
          rope_lib.apply_rope(x, positions, rope=rope),
          rope_lib.apply_rope(x, positions, rope=plain))

  def test_dynamic_at_or_below_the_trained_context_is_plain_rope(self):
    x = _data.normal(5, (3, 6, 16))
    positions = _positions(6, (3, 6), high=64)
    positions[0, 0] = 63  # L = 64 = O: still unscaled
    rope = Rope(scaling="dynamic", factor=2.0, original_max_positions=64)
    # scale = 2 * 64 / 64 - 1 = 1 exactly in float32, ln 1 = 0, exp 0 = 1.
    np.testing.assert_array_equal(_apply(x, positions, rope=rope),
                                  _apply(x, positions, rope=Rope()))

  def test_dynamic_seq_len_overrides_the_positions(self):
    x = _data.normal(7, (4, 16))
    positions = np.array([0, 1, 2, 3], np.int32)
    rope = Rope(scaling="dynamic", factor=2.0, original_max_positions=8)
    out = _apply(x, positions, rope=rope, seq_len=32)  # seq_len traced
    want = _rotate_reference(x, positions,
                             _dynamic_reference(16, 10000.0, 2.0, 8, 32))
    np.testing.assert_allclose(out, want, **F32_TOL)
    # Without seq_len, L = 4 <= 8: plain RoPE, visibly different.
    plain = _apply(x, positions, rope=rope)
    self.assertGreater(float(jnp.max(jnp.abs(plain - out))), 1e-2)

  def test_static_under_jit_and_traced_dynamic_positions(self):
    # One compile: the Rope is a static argument (hashable), the positions
    # traced, so dynamic NTK's L = max(positions) + 1 is found on device.
    self.assertEqual(hash(Rope(base=10000)), hash(Rope()))
    rope = Rope(scaling="dynamic", factor=2.0, original_max_positions=8,
                interleaved=True)
    x = _data.normal(8, (2, 3, 8, 16))
    positions = _positions(9, (2, 1, 8), high=40)
    got = _apply(x, positions, rope=rope)
    seq_len = int(np.max(positions)) + 1
    want = _rotate_reference(
        x, positions, _dynamic_reference(16, 10000.0, 2.0, 8, seq_len),
        interleaved=True)
    # Positions < 40: the float32 budget above holds.
    np.testing.assert_allclose(got, want, **F32_TOL)

  def test_float64_input(self):
    with jax.enable_x64(True):
      x = jnp.asarray(_data.normal(10, (3, 32)), jnp.float64)
      positions = jnp.array([5, 1000, 123456])
      out = _apply(x, positions, rope=Rope(**_YARN))
      self.assertEqual(out.dtype, jnp.float64)
      want = _rotate_reference(x, positions, _yarn_reference(32, 10000.0, 4.0,
                                                             64),
                               _yarn_magnitude_reference(4.0))
      # float64 angles at positions ~1e5: ~1e5 * 2.2e-16 rad of error.
      np.testing.assert_allclose(out, want, atol=1e-10, rtol=1e-10)


class RelativePositionTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("linear", dict(scaling="linear", factor=4.0)),
      ("llama3_interleaved", dict(_LLAMA3, interleaved=True)),
      ("yarn_partial", dict(_YARN, fraction=0.5)),
  )
  def test_scores_depend_only_on_position_difference(self, fields):
    t, s, h, shift = 6, 7, 16, 23
    q = _data.normal(20, (2, t, h))
    k = _data.normal(21, (2, s, h))
    m = _positions(22, (2, t), high=64 - shift)
    n = _positions(23, (2, s), high=64 - shift)
    rope = Rope(**fields)

    def scores(m, n, rope=rope):
      rq, rk = _apply(q, m, rope=rope), _apply(k, n, rope=rope)
      return np.einsum("bth,bsh->bts", np.asarray(rq, np.float64),
                       np.asarray(rk, np.float64))

    got = scores(m, n)
    # Two rotated vectors (F32_TOL each) times norms <= ~5 over H = 16
    # features: below ~2e-3.
    np.testing.assert_allclose(scores(m + shift, n + shift), got, atol=2e-3,
                               rtol=1e-5)
    if rope.magnitude != 1.0:
      # YaRN's magnitude on cos and sin scales the rotated part of each
      # score by its square (the pass-through part is untouched).
      unit = Rope(**{**fields, "attention_factor": 1.0})
      rot = rope.rotary_dim(h)
      rotated = lambda r: np.einsum(
          "bth,bsh->bts",
          np.asarray(_apply(q, m, rope=r)[..., :rot], np.float64),
          np.asarray(_apply(k, n, rope=r)[..., :rot], np.float64))
      np.testing.assert_allclose(rotated(rope),
                                 rope.magnitude ** 2 * rotated(unit),
                                 atol=2e-3, rtol=1e-5)


class AsRopeTest(parameterized.TestCase):

  def test_accepted(self):
    rope = Rope(scaling="linear", factor=2.0)
    self.assertIs(rope_lib.as_rope(rope), rope)
    self.assertIsNone(rope_lib.as_rope(None))

  @parameterized.named_parameters(
      ("bool", True, TypeError, r"rope=True is a bool.*Rope"),
      ("scaling_name", "llama3", TypeError,
       r"rope='llama3' is a string.*Rope\(scaling='llama3', \.\.\.\)"),
      ("other_string", "rope", TypeError,
       r"rope='rope' is a string.*scalings: 'none'"),
      ("array", jnp.array(10000.0), TypeError,
       r"rope must be static, got an array of shape \(\)"),
      ("list", [10000.0], TypeError, r"is not a rotary embedding"),
      ("number", 500, TypeError, r"rope=500 is a number: the rotary base goes "
       r"in the Rope, rope=aj.Rope\(base=500.0\)"),
      ("numpy_number", np.float32(500.0), TypeError, r"is a number"),
  )
  def test_rejected(self, value, exception, pattern):
    with self.assertRaisesRegex(exception, pattern):
      rope_lib.as_rope(value)


class ValidationTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("unknown_scaling", dict(scaling="ntk"), ValueError,
       r"unknown scaling 'ntk': use one of 'none', 'linear', 'dynamic', "
       r"'llama3', 'yarn'"),
      ("scaling_none_object", dict(scaling=None), TypeError,
       r"scaling must be a string.*'none' for plain RoPE.*got None"),
      ("factor_without_scaling", dict(factor=4.0), ValueError,
       r"factor=4.0 has no effect with scaling='none'"),
      ("factor_below_one", dict(scaling="linear", factor=0.5), ValueError,
       r"scaling='linear' needs factor >= 1.*positions are divided by it"),
      ("yarn_factor_below_one", dict(_YARN, factor=0.25), ValueError,
       r"scaling='yarn' needs factor >= 1"),
      ("factor_string", dict(scaling="linear", factor="2"), TypeError,
       r"factor must be a real Python number"),
      ("missing_original", dict(scaling="llama3", factor=8.0), ValueError,
       r"scaling='llama3' needs original_max_positions.*"
       r"original_max_position_embeddings"),
      ("dynamic_missing_original", dict(scaling="dynamic", factor=2.0),
       ValueError, r"scaling='dynamic' needs original_max_positions"),
      ("original_unused", dict(scaling="linear", factor=2.0,
                               original_max_positions=4096), ValueError,
       r"original_max_positions=4096 has no effect with scaling='linear'"),
      ("original_float", dict(_YARN, original_max_positions=64.0), TypeError,
       r"original_max_positions must be a Python int"),
      ("original_zero", dict(_YARN, original_max_positions=0), ValueError,
       r"original_max_positions must be positive"),
      ("llama3_band_inverted", dict(_LLAMA3, low_freq_factor=4.0,
                                    high_freq_factor=1.0), ValueError,
       r"needs high_freq_factor > low_freq_factor > 0.*low_freq_factor=4.0"),
      ("llama3_field_on_yarn", dict(_YARN, high_freq_factor=8.0), ValueError,
       r"high_freq_factor=8.0 has no effect with scaling='yarn' \(read by "
       r"scaling 'llama3'\)"),
      ("yarn_field_on_llama3", dict(_LLAMA3, truncate=False), ValueError,
       r"truncate=False has no effect with scaling='llama3'"),
      ("attention_factor_on_none", dict(attention_factor=1.2), ValueError,
       r"attention_factor=1.2 has no effect"),
      ("yarn_betas_inverted", dict(_YARN, beta_fast=1.0, beta_slow=32.0),
       ValueError, r"needs beta_fast >= beta_slow > 0"),
      ("yarn_base_one", dict(_YARN, base=1.0), ValueError,
       r"scaling='yarn' needs base > 1"),
      ("yarn_attention_factor_negative", dict(_YARN, attention_factor=-1.0),
       ValueError, r"attention_factor must be positive"),
      ("yarn_lone_mscale", dict(_YARN, mscale=0.707), ValueError,
       r"mscale without mscale_all_dim: give both"),
      ("yarn_mscale_and_attention_factor", dict(
          _YARN, mscale=1.0, mscale_all_dim=1.0, attention_factor=1.0),
       ValueError, r"attention_factor would override them"),
      ("truncate_int", dict(_YARN, truncate=1), TypeError,
       r"truncate must be a Python bool, got 1"),
      ("interleaved_string", dict(interleaved="yes"), TypeError,
       r"interleaved must be a Python bool"),
      ("base_negative", dict(base=-1.0), ValueError,
       r"base must be positive, got -1.0"),
      ("base_array", dict(base=jnp.array(10000.0)), TypeError,
       r"base must be a real Python number"),
      ("fraction_zero", dict(fraction=0.0), ValueError,
       r"fraction must be in \(0, 1\], got 0.0"),
  )
  def test_rope_rejects(self, fields, exception, pattern):
    with self.assertRaisesRegex(exception, pattern):
      Rope(**fields)

  def test_frozen(self):
    with self.assertRaises(AttributeError):  # dataclasses.FrozenInstanceError
      Rope().base = 1.0

  def test_apply_rope_rejects(self):
    x = np.ones((4, 8), np.float32)
    positions = np.arange(4)
    with self.assertRaisesRegex(TypeError, r"unexpected keyword.*base"):
      rope_lib.apply_rope(x, positions, base=500.0)  # the Rope holds it
    with self.assertRaisesRegex(
        TypeError, r"rope=10000.0 is a number: .*rope=aj.Rope\(base=10000.0\)"):
      rope_lib.apply_rope(x, positions, rope=10000.0)
    with self.assertRaisesRegex(
        ValueError, r"seq_len chooses dynamic NTK frequencies, and this rope "
        r"has scaling='linear'"):
      rope_lib.apply_rope(x, positions, seq_len=16,
                          rope=Rope(scaling="linear", factor=2.0))
    with self.assertRaisesRegex(
        ValueError, r"scaling='dynamic' needs a rotary dim R >= 4.*got R=2"):
      rope_lib.apply_rope(x, positions, rope=Rope(
          scaling="dynamic", factor=2.0, original_max_positions=8,
          fraction=0.25))
    with self.assertRaisesRegex(ValueError,
                                r"fraction=0.1 rotates no features of head "
                                r"dim H=8"):
      rope_lib.apply_rope(x, positions, rope=Rope(fraction=0.1))

  def test_inverse_frequencies_rejects(self):
    dynamic = Rope(scaling="dynamic", factor=2.0, original_max_positions=8)
    with self.assertRaisesRegex(ValueError,
                                r"scaling='dynamic' needs seq_len"):
      dynamic.inverse_frequencies(16)
    with self.assertRaisesRegex(ValueError,
                                r"rotary_dim must be a positive even int.*"
                                r"got 7"):
      Rope().inverse_frequencies(7)
    with self.assertRaisesRegex(TypeError, r"rotary_dim must be a Python int"):
      Rope().inverse_frequencies(8.0)
    with self.assertRaisesRegex(TypeError, r"seq_len must be a number or a "
                                r"scalar integer/float array.*\(3,\)"):
      dynamic.inverse_frequencies(16, jnp.arange(3))
    with self.assertRaisesRegex(TypeError, r"head_dim must be a Python int"):
      Rope().rotary_dim(16.0)


if __name__ == "__main__":
  absltest.main()
