"""Interleaved M-RoPE, the NTK-alpha base and ALiBi's max_bias vs float64 HF.

The references import nothing of ours and follow HF transformers' code in
float64 NumPy: Qwen3-VL's ``Qwen3VLTextRotaryEmbedding`` (its
``recomposition_frequencies``: height on pairs ``slice(1, 3 *
sections[1], 3)``, width on ``slice(2, 3 * sections[2], 3)``, time the
rest) with the half-split ``rotate_half`` rotation; Hunyuan's
``compute_ntk_alpha_rope_parameters`` (``base * alpha**(dim / (dim -
2))``); BLOOM's ``_get_alibi_slopes`` (its 8 written as ``max_bias``) and
MPT's ``build_mpt_alibi_tensor`` (``alibi_bias_max``).
"""

import math

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.scores import rope as rope_lib
from attention_jax.scores import rope_frequencies
from attention_jax.scores.rope import Rope
from tests import _data

# float32 against float64 with positions < 64 (as tests/test_rope_variants):
# the angle p * theta is rounded twice, <= 64 * 2 * 6e-8 ~ 8e-6 rad, plus a
# few ulp from cos/sin; features ~N(0, 1) keep an output within ~6e-5. A
# wrong axis, pair or base moves outputs by 1e-2 and more here.
F32_TOL = dict(atol=1e-4, rtol=1e-5)
# Frequencies: both sides float64, a handful of operations each.
F64_TOL = dict(atol=0.0, rtol=1e-12)

_apply = jax.jit(rope_lib.apply_rope, static_argnames=("rope",))

# --- HF's formulas in float64 NumPy ------------------------------------------


def _inv_freq(rot, base):
  return 1.0 / base ** (np.arange(0, rot, 2, dtype=np.float64) / rot)


def _qwen3_vl_freqs(positions, inv_freq, sections):
  """Qwen3-VL's recomposition: ``[3, ..., T]`` -> ``[..., T, R / 2]``."""
  freqs = np.asarray(positions, np.float64)[..., None] * inv_freq
  freqs_thw = freqs[0].copy()  # T everywhere, then H and W overwrite
  for dim, offset in enumerate((1, 2), start=1):
    idx = slice(offset, sections[dim] * 3, 3)
    freqs_thw[..., idx] = freqs[dim][..., idx]
  return freqs_thw


def _qwen2_vl_freqs(positions, inv_freq, sections):
  """Qwen2-VL's blocks: ``split(mrope_section)``, chunk ``i`` axis ``i``."""
  freqs = np.asarray(positions, np.float64)[..., None] * inv_freq
  chunks = np.split(freqs, np.cumsum(sections)[:-1], axis=-1)
  return np.concatenate([m[i] for i, m in enumerate(chunks)], axis=-1)


def _rotate_half(x):
  half = x.shape[-1] // 2
  return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _hf_rotate(x, freqs):
  """HF's ``x * cos + rotate_half(x) * sin`` over ``cat((freqs, freqs))``
  on the first ``R`` features; the rest kept."""
  x = np.asarray(x, np.float64)
  emb = np.concatenate([freqs, freqs], axis=-1)
  rot = emb.shape[-1]
  out = x.copy()
  out[..., :rot] = (x[..., :rot] * np.cos(emb)
                    + _rotate_half(x[..., :rot]) * np.sin(emb))
  return out


def _hunyuan_inv_freq(dim, base, alpha):
  """HF Hunyuan's ``compute_ntk_alpha_rope_parameters``."""
  base = base * alpha ** (dim / (dim - 2))
  return 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)


def _bloom_slopes(num_heads, max_bias):
  """BLOOM's ``_get_alibi_slopes`` in float64, its 8 as ``max_bias``:
  ``2**(-(2**-(log2(c) - 3)))`` is ``2**(-8 / c)``."""
  c = 2 ** math.floor(math.log2(num_heads))
  base = 2.0 ** (-max_bias / c)
  slopes = base ** np.arange(1, 1 + c, dtype=np.float64)
  if c != num_heads:
    extra_base = 2.0 ** (-max_bias / (2 * c))
    remaining = min(c, num_heads - c)
    extra = extra_base ** np.arange(1, 1 + 2 * remaining, 2, dtype=np.float64)
    slopes = np.concatenate([slopes, extra])
  return slopes


def _mpt_slopes(num_heads, alibi_bias_max):
  """MPT's ``build_mpt_alibi_tensor`` slopes in float64."""
  p = 2 ** math.ceil(math.log2(num_heads))
  base = np.arange(1, p + 1, dtype=np.float64) * (alibi_bias_max / p)
  slopes = 1.0 / np.power(2.0, base)
  if p != num_heads:
    slopes = np.concatenate([slopes[1::2], slopes[::2]])[:num_heads]
  return slopes


def _mrope_positions(seed, b, t):
  """HF's ``[3, B, T]`` position ids with a head axis: ``[3, B, 1, T]``."""
  positions = np.random.default_rng(seed).integers(0, 40, (3, b, t))
  return positions.astype(np.int32)[:, :, None, :]


class InterleavedMropeTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("small", (4, 3, 3), 20, 1.0),
      ("qwen3_vl", (24, 20, 20), 128, 1.0),  # Qwen3-VL's mrope_section
      ("tight", (2, 1, 1), 8, 1.0),  # W's last pair is the last pair
      ("partial", (4, 3, 3), 40, 0.5),  # R = 20 of H = 40: the tail kept
  )
  def test_apply_matches_hf(self, sections, h, fraction):
    rope = Rope(sections=sections, sections_interleaved=True,
                fraction=fraction, base=500.0)
    x = _data.normal(40, (2, 2, 6, h))
    positions = _mrope_positions(41, 2, 6)
    out = _apply(x, positions, rope=rope)
    rot = rope.rotary_dim(h)
    freqs = _qwen3_vl_freqs(positions, _inv_freq(rot, 500.0), sections)
    np.testing.assert_allclose(np.asarray(out, np.float64),
                               _hf_rotate(x, freqs), **F32_TOL)
    np.testing.assert_array_equal(out[..., rot:], x[..., rot:])

  def test_differs_from_the_blocked_layout(self):
    sections, h = (4, 3, 3), 20
    x = _data.normal(42, (2, 2, 6, h))
    positions = _mrope_positions(43, 2, 6)
    blocked = _apply(x, positions, rope=Rope(sections=sections))
    inter = _apply(x, positions,
                   rope=Rope(sections=sections, sections_interleaved=True))
    freqs = _qwen2_vl_freqs(positions, _inv_freq(h, 10000.0), sections)
    np.testing.assert_allclose(np.asarray(blocked, np.float64),
                               _hf_rotate(x, freqs), **F32_TOL)
    self.assertGreater(float(jnp.max(jnp.abs(blocked - inter))), 1e-1)

  def test_each_axis_turns_its_pairs(self):
    # (4, 3, 3): pairs 0 3 6 9 time, 1 4 7 height, 2 5 8 width.
    np.testing.assert_array_equal(
        rope_frequencies.section_axes((4, 3, 3), True),
        [0, 1, 2, 0, 1, 2, 0, 1, 2, 0])
    rope = Rope(sections=(4, 3, 3), sections_interleaved=True)
    x = _data.normal(44, (5, 20))
    base = np.stack([np.arange(5)] * 3).astype(np.int32)  # [3, T]
    plain = _apply(x, base, rope=rope)
    for axis, pairs in ((0, [0, 3, 6, 9]), (1, [1, 4, 7]), (2, [2, 5, 8])):
      moved = base.copy()
      moved[axis] += 7
      changed = np.abs(np.asarray(_apply(x, moved, rope=rope) - plain)) > 1e-3
      want = np.zeros(20, bool)
      want[pairs] = want[np.add(pairs, 10)] = True  # half-split pairs
      np.testing.assert_array_equal(changed[1:].any(axis=0), want)

  def test_qwen3_vl_counts(self):
    # THWTHW...TT: every axis gets as many pairs as its section says.
    axes = rope_frequencies.section_axes((24, 20, 20), True)
    np.testing.assert_array_equal(np.bincount(axes), [24, 20, 20])
    np.testing.assert_array_equal(axes[-4:], [0, 0, 0, 0])

  def test_equal_axes_are_plain_rope(self):
    x = _data.normal(45, (2, 3, 5, 20))
    positions = np.arange(5, dtype=np.int32)[None, None]  # [1, 1, T]
    stacked = np.stack([positions] * 3)  # [3, 1, 1, T]
    np.testing.assert_array_equal(
        _apply(x, stacked,
               rope=Rope(sections=(4, 3, 3), sections_interleaved=True)),
        _apply(x, positions, rope=Rope()))

  def test_a_distinct_static_value(self):
    inter = Rope(sections=[4, 3, 3], sections_interleaved=np.bool_(True))
    same = Rope(sections=(4, 3, 3), sections_interleaved=True)
    self.assertEqual(inter, same)
    self.assertEqual(hash(inter), hash(same))
    self.assertIs(inter.sections_interleaved, True)
    self.assertNotEqual(inter, Rope(sections=(4, 3, 3)))
    self.assertIn("sections_interleaved=True", repr(inter))


class NtkAlphaTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("hunyuan", 10000.0, 1000.0, 16, 1.0),
      ("below_one", 500.0, 0.5, 16, 1.0),
      # R = 16 of H = 32: the exponent reads the rotary dim.
      ("partial", 10000.0, 50.0, 32, 0.5))
  def test_frequencies_and_rotation_match_hf(self, base, alpha, h, fraction):
    rope = Rope(base=base, ntk_alpha=alpha, fraction=fraction)
    rot = rope.rotary_dim(h)
    want = _hunyuan_inv_freq(rot, base, alpha)
    np.testing.assert_allclose(rope.inverse_frequencies(rot), want,
                               **F64_TOL)
    x = _data.normal(50, (2, 2, 6, h))
    positions = np.arange(40, 46, dtype=np.int32)
    out = _apply(x, positions, rope=rope)
    freqs = positions[:, None].astype(np.float64) * want  # [T, R / 2]
    np.testing.assert_allclose(np.asarray(out, np.float64),
                               _hf_rotate(x, freqs), **F32_TOL)

  def test_no_length_dependence(self):
    # HF's "ntk_alpha" is static (dynamic_rope_update skips it): a token's
    # rotation does not depend on how long the call is.
    rope = Rope(ntk_alpha=1000.0)
    x = _data.normal(51, (1, 2, 9, 16))
    whole = _apply(x, np.arange(9), rope=rope)
    np.testing.assert_array_equal(_apply(x[:, :, :3], np.arange(3), rope=rope),
                                  whole[:, :, :3])
    with self.assertRaisesRegex(ValueError, "seq_len"):
      rope_lib.apply_rope(x, np.arange(9), rope=rope, seq_len=4)

  def test_value_and_combinations(self):
    self.assertEqual(Rope(ntk_alpha=1000), Rope(ntk_alpha=1000.0))
    self.assertIsInstance(Rope(ntk_alpha=1000).ntk_alpha, float)
    self.assertNotEqual(Rope(ntk_alpha=2.0), Rope())
    np.testing.assert_array_equal(Rope(ntk_alpha=1.0).inverse_frequencies(8),
                                  Rope().inverse_frequencies(8))
    # With sections: the grown base, cut into the sections.
    np.testing.assert_allclose(
        Rope(ntk_alpha=3.0, sections=(2, 1, 1)).inverse_frequencies(8),
        _hunyuan_inv_freq(8, 10000.0, 3.0), **F64_TOL)


class AlibiMaxBiasTest(parameterized.TestCase):

  @parameterized.product(num_heads=(8, 6), max_bias=(8.0, 16.0))
  def test_matches_bloom_and_mpt(self, num_heads, max_bias):
    got = np.asarray(aj.alibi_slopes(num_heads, max_bias=max_bias))
    self.assertEqual(got.dtype, np.float32)
    # These slopes are powers of two: exact in float32 and float64 alike.
    np.testing.assert_array_equal(got, _bloom_slopes(num_heads, max_bias))
    np.testing.assert_array_equal(got, _mpt_slopes(num_heads, max_bias))

  def test_slopes_between_powers_of_two(self):
    # 12 heads: the extra slopes 2**(-m j / 16) are irrational; float32
    # rounding of a float64 value is within half an ulp (6e-8 relative).
    for max_bias in (8.0, 16.0, 12.5):
      got = np.asarray(aj.alibi_slopes(12, max_bias=max_bias))
      np.testing.assert_allclose(got, _mpt_slopes(12, max_bias), rtol=1e-7)
      np.testing.assert_allclose(got, _bloom_slopes(12, max_bias), rtol=1e-7)
    self.assertFalse(np.array_equal(aj.alibi_slopes(12, max_bias=16.0),
                                    aj.alibi_slopes(12)))

  def test_default_is_unchanged(self):
    def previous(n):  # alibi_slopes before max_bias, verbatim
      def powers(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]
      closest = 2 ** math.floor(math.log2(n))
      slopes = powers(closest)
      if closest < n:
        slopes += powers(2 * closest)[0::2][:n - closest]
      return np.asarray(slopes, np.float32)
    for n in (1, 3, 6, 12, 24, 40):
      np.testing.assert_array_equal(aj.alibi_slopes(n), previous(n))
      np.testing.assert_array_equal(aj.alibi_slopes(n, max_bias=8), previous(n))

  @parameterized.named_parameters(
      ("zero", 0.0, ValueError, "positive and finite"),
      ("negative", -8.0, ValueError, "positive and finite"),
      ("inf", math.inf, ValueError, "positive and finite"),
      ("nan", math.nan, ValueError, "positive and finite"),
      ("bool", True, TypeError, "max_bias must be a positive Python number"),
      ("string", "8", TypeError, "max_bias must be a positive Python number"),
      ("array", jnp.float32(8.0), TypeError, "pass a number"),
      ("none", None, TypeError, "max_bias"))
  def test_rejects(self, value, exception, pattern):
    with self.assertRaisesRegex(exception, pattern):
      aj.alibi_slopes(6, max_bias=value)

  def test_rejects_a_traced_max_bias(self):
    with self.assertRaisesRegex(TypeError, "max_bias"):
      jax.jit(lambda m: aj.alibi_slopes(4, max_bias=m))(8.0)


class ValidationTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("interleaved_without_sections", dict(sections_interleaved=True),
       ValueError, "sections_interleaved=True needs sections"),
      ("interleaved_two_sections",
       dict(sections=(4, 4), sections_interleaved=True), ValueError,
       "needs three sections"),
      ("interleaved_four_sections",
       dict(sections=(4, 2, 2, 2), sections_interleaved=True), ValueError,
       "needs three sections"),
      # 5 pairs: height at 1, 4, 7 runs past pair 4 (HF's slice: 2 only).
      ("height_past_the_end", dict(sections=(1, 3, 1),
                                   sections_interleaved=True), ValueError,
       r"height axis's 3 pairs sit at 1, 4, \.\.\., 7.*at most 2"),
      ("width_past_the_end", dict(sections=(2, 1, 2),
                                  sections_interleaved=True), ValueError,
       r"width axis's 2 pairs sit at 2, 5, \.\.\., 5.*at most 1"),
      ("interleaved_per_section",
       dict(sections=(4, 3, 3), sections_interleaved=True,
            section_frequencies="per_section"), ValueError,
       "section_frequencies='per_section' is not supported"),
      ("interleaved_not_bool", dict(sections=(4, 3, 3),
                                    sections_interleaved=1), TypeError,
       "sections_interleaved must be a Python bool"),
      ("alpha_zero", dict(ntk_alpha=0.0), ValueError,
       "ntk_alpha must be positive"),
      ("alpha_negative", dict(ntk_alpha=-2.0), ValueError,
       "ntk_alpha must be positive"),
      ("alpha_inf", dict(ntk_alpha=math.inf), ValueError,
       "ntk_alpha must be finite"),
      ("alpha_bool", dict(ntk_alpha=True), TypeError,
       "ntk_alpha must be a real Python number"),
      ("alpha_string", dict(ntk_alpha="1000"), TypeError,
       "ntk_alpha must be a real Python number"),
      ("alpha_with_dynamic", dict(ntk_alpha=1000.0, scaling="dynamic",
                                  factor=2.0, original_max_positions=64),
       ValueError, "scaling='dynamic' is not supported.*scaling='none'"),
      ("alpha_with_linear", dict(ntk_alpha=1000.0, scaling="linear",
                                 factor=2.0),
       ValueError, "scaling='linear' is not supported"),
      ("alpha_per_section", dict(ntk_alpha=2.0, sections=(2, 2),
                                 section_frequencies="per_section"),
       ValueError, "section_frequencies='per_section' is not supported"),
  )
  def test_rope_rejects(self, fields, exception, pattern):
    with self.assertRaisesRegex(exception, pattern):
      Rope(**fields)

  def test_rejects_a_traced_alpha(self):
    with self.assertRaisesRegex(TypeError, "ntk_alpha.*traced"):
      jax.jit(lambda a: Rope(ntk_alpha=a))(1000.0)

  def test_alpha_needs_four_rotated_features(self):
    with self.assertRaisesRegex(ValueError, "ntk_alpha needs a rotary dim"):
      Rope(ntk_alpha=2.0).inverse_frequencies(2)
    with self.assertRaisesRegex(ValueError, "ntk_alpha needs a rotary dim"):
      rope_lib.apply_rope(jnp.ones((3, 2)), jnp.arange(3),
                          rope=Rope(ntk_alpha=2.0))

  def test_layer_refuses_alpha_on_two_features(self):
    params = aj.init_multi_head_params(jax.random.key(0), 4, 2, head_dim=2)
    x = jnp.ones((1, 3, 4))
    with self.assertRaisesRegex(ValueError, "ntk_alpha needs a rotary dim"):
      aj.multi_head_attention(params, x, x, x, rope=Rope(ntk_alpha=2.0))

  def test_interleaved_sections_must_sum_to_the_pairs(self):
    with self.assertRaisesRegex(ValueError, r"sections=\(4, 3, 3\) sum to 10"):
      rope_lib.apply_rope(jnp.ones((3, 16)), jnp.zeros((3, 3), jnp.int32),
                          rope=Rope(sections=(4, 3, 3),
                                    sections_interleaved=True))


if __name__ == "__main__":
  absltest.main()
