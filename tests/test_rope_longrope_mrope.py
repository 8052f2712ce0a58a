"""LongRoPE and multimodal RoPE (M-RoPE) against float64 HF formulas.

The references import nothing of ours and follow HF transformers' code
step by step, in float64 NumPy: ``_compute_longrope_parameters`` with
``longrope_frequency_update`` (Phi-3 / Phi-3.5 / Phi-4) for the
frequencies, and the rotation the way HF writes it, ``x * cos +
rotate_half(x) * sin`` over ``cat((freqs, freqs))`` (``rotate_half_llm``
over ``repeat_interleave(2)`` for the interleaved layout, as GLM-4V),
with Qwen2-VL's ``mrope_section`` split picking each frequency's position
axis (``m[i % 3]``). Axial vision RoPE (``section_frequencies=
"per_section"``, Qwen2-VL's vision tower) against its formula, a 1-D
ladder ``base**(-j / n)`` per section, over the (h, w) positions of a
patch grid, and through the layer. The layer is checked by decoding with
a KV cache against one full forward.
"""

import math

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.decoding.cache_step import KVCache
from attention_jax.scores import rope as rope_lib
from attention_jax.scores.rope import Rope
from tests import _data

# float32 against float64 with positions < 64, as tests/test_rope_variants:
# the angle p * theta is rounded twice, <= 64 * 2 * 6e-8 ~ 8e-6 rad, plus a
# few ulp from cos/sin; features ~N(0, 1) (|x| <= ~5) times magnitudes <=
# ~1.3 keep an output within ~6e-5. 1e-4 leaves headroom without hiding a
# wrong factor set, section or pairing (errors of order 1e-2 and up here).
F32_TOL = dict(atol=1e-4, rtol=1e-5)
# Frequencies: both sides float64, a handful of operations each.
F64_TOL = dict(atol=0.0, rtol=1e-12)
# Cached decoding against one forward, both float32: the same rotations
# (bit for bit: the same positions and frequencies), a softmax summed over
# the cache's slots instead of the call's keys, ~a few ulp of O(1) outputs.
DECODE_TOL = dict(atol=1e-5, rtol=1e-5)

# --- HF's formulas in float64 NumPy ------------------------------------------


def _longrope_reference(rot, base, short, long, original, seq_len, factor,
                        attention_factor=None):
  """HF ``_compute_longrope_parameters`` at ``seq_len`` (None: the init)."""
  # longrope_frequency_update: long factors once max(position_ids) + 1 > O.
  if seq_len is not None and seq_len > original:
    ext = np.asarray(long, np.float64)
  else:
    ext = np.asarray(short, np.float64)
  inv_freq_shape = np.arange(0, rot, 2, dtype=np.float64) / rot
  inv_freq = 1.0 / (ext * base ** inv_freq_shape)
  if attention_factor is None:
    if factor <= 1.0:
      attention_factor = 1.0
    else:
      attention_factor = math.sqrt(1 + math.log(factor) / math.log(original))
  return inv_freq, attention_factor


def _plain_inv_freq(rot, base):
  return 1.0 / base ** (np.arange(0, rot, 2, dtype=np.float64) / rot)


def _rotate_half(x):
  half = x.shape[-1] // 2
  return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _rotate_half_llm(x):  # GLM-4V's, for interleaved pairs
  x1, x2 = x[..., 0::2], x[..., 1::2]
  return np.stack([-x2, x1], axis=-1).reshape(x.shape)


def _hf_rotate(x, freqs, magnitude=1.0, interleaved=False):
  """HF's apply_rotary_pos_emb on the first R features; the rest kept.

  ``freqs`` is ``[..., T, R / 2]``: angle per token and pair.
  """
  x = np.asarray(x, np.float64)
  if interleaved:
    emb = np.repeat(freqs, 2, axis=-1)
    turn = _rotate_half_llm
  else:
    emb = np.concatenate([freqs, freqs], axis=-1)
    turn = _rotate_half
  cos, sin = np.cos(emb) * magnitude, np.sin(emb) * magnitude
  rot = emb.shape[-1]
  out = x.copy()
  out[..., :rot] = x[..., :rot] * cos + turn(x[..., :rot]) * sin
  return out


def _mrope_freqs(positions, inv_freq, sections):
  """Qwen2-VL's recomposition: ``[P, ..., T]`` positions -> ``[..., T, h]``."""
  freqs = np.asarray(positions, np.float64)[..., None] * inv_freq
  chunks = np.split(freqs, np.cumsum(sections)[:-1], axis=-1)
  return np.concatenate(
      [m[i % len(sections)] for i, m in enumerate(chunks)], axis=-1)


def _axial_inv_freq(base, sections):
  """Each section its own 1-D ladder: ``base**(-2 j / (2 n))``, ``j < n``.

  HF's ``compute_axial_rope_parameters`` is the case of two equal
  sections: ``base**(-arange(0, R / 2, 2) / (R / 2))`` for h and w alike.
  """
  return np.concatenate([
      1.0 / base ** (np.arange(0, 2 * n, 2, dtype=np.float64) / (2 * n))
      for n in sections])


def _grid_positions(rows, cols):
  """Row-major (h, w) positions of a ``rows x cols`` patch grid, ``[2, T]``."""
  h, w = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
  return np.stack([h.reshape(-1), w.reshape(-1)]).astype(np.int32)


# The Rope is hashable: a static argument.
_apply = jax.jit(rope_lib.apply_rope, static_argnames=("rope",))

# Phi-style factors for R = 16 (8 pairs): short near 1, long growing.
_SHORT = (1.0, 1.02, 1.05, 1.1, 1.2, 1.4, 1.7, 2.0)
_LONG = (1.0, 1.3, 1.9, 2.8, 4.1, 6.0, 9.5, 14.0)
_PHI = dict(scaling="longrope", short_factor=_SHORT, long_factor=_LONG,
            original_max_positions=32, factor=4.0)


class LongropeTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("init", None), ("short", 20), ("at_original", 32), ("long", 33),
      ("far", 5000))
  def test_inverse_frequencies_match_hf(self, seq_len):
    rope = Rope(**_PHI, base=500.0)
    got = rope.inverse_frequencies(16, seq_len)
    want, magnitude = _longrope_reference(16, 500.0, _SHORT, _LONG, 32,
                                          seq_len, 4.0)
    self.assertEqual(got.dtype, np.float64)
    np.testing.assert_allclose(got, want, **F64_TOL)
    self.assertAlmostEqual(rope.magnitude, magnitude, places=14)

  def test_traced_seq_len_picks_the_set_on_device(self):
    rope = Rope(**_PHI)
    pick = jax.jit(lambda n: rope.inverse_frequencies(16, n))
    for n in (32, 33):  # the last short length, the first long one
      want, _ = _longrope_reference(16, 10000.0, _SHORT, _LONG, 32,
                                    n, 4.0)
      # float64 constants rounded once to float32 (half an ulp, 6e-8).
      np.testing.assert_allclose(pick(jnp.asarray(n)), want, rtol=1e-7)

  def test_magnitude(self):
    # Phi-3-mini-128k: factor 131072 / 4096 = 32, sqrt(1 + ln 32 / ln 4096).
    phi = Rope(scaling="longrope", short_factor=[1.0] * 48,
               long_factor=[1.0] * 48, original_max_positions=4096,
               factor=131072 / 4096)
    self.assertAlmostEqual(phi.magnitude, math.sqrt(1 + 5 / 12), places=14)
    self.assertEqual(Rope(**{**_PHI, "factor": 1.0},
                          attention_factor=1.3).magnitude, 1.3)
    self.assertEqual(phi.attention_factor_value, phi.magnitude)

  def test_lists_become_tuples(self):
    a = Rope(**{**_PHI, "short_factor": list(_SHORT),
                "long_factor": np.asarray(_LONG)})
    self.assertEqual(a.short_factor, _SHORT)
    self.assertIsInstance(a.long_factor, tuple)
    self.assertEqual(a, Rope(**_PHI))
    self.assertEqual(hash(a), hash(Rope(**_PHI)))

  @parameterized.named_parameters(
      # max position 20: L = 21 <= 32, the short factors.
      ("short", dict(), 16, 21),
      # max position 40: L = 41 > 32, the long factors for every token.
      ("long", dict(), 16, 41),
      # Phi-4-mini's partial rotary: 0.75 of H = 16 rotates 12 (6 pairs).
      ("partial", dict(fraction=0.75, short_factor=_SHORT[:6],
                       long_factor=_LONG[:6]), 16, 41),
      ("interleaved", dict(interleaved=True), 16, 41),
      ("attention_factor", dict(factor=1.0, attention_factor=0.8), 16, 21),
  )
  def test_apply_matches_hf(self, fields, h, seq_len):
    fields = {**_PHI, **fields}
    rope = Rope(**fields)
    x = _data.normal(1, (2, 3, 8, h))
    rng = np.random.default_rng(2)
    positions = rng.integers(0, seq_len - 1, (2, 1, 8)).astype(np.int32)
    positions[0, 0, 0] = seq_len - 1  # L = seq_len exactly
    out = _apply(x, positions, rope=rope)
    rot = rope.rotary_dim(h)
    inv_freq, magnitude = _longrope_reference(
        rot, 10000.0, fields["short_factor"], fields["long_factor"], 32,
        seq_len, fields["factor"], fields.get("attention_factor"))
    want = _hf_rotate(x, positions[..., None] * inv_freq, magnitude,
                      fields.get("interleaved", False))
    np.testing.assert_allclose(np.asarray(out, np.float64), want, **F32_TOL)
    np.testing.assert_array_equal(out[..., rot:], x[..., rot:])

  def test_the_switch_is_visible_and_seq_len_overrides(self):
    rope = Rope(**_PHI)
    x = _data.normal(3, (4, 16))
    positions = np.arange(4, dtype=np.int32)
    short = _apply(x, positions, rope=rope)
    long = _apply(x, positions, rope=rope, seq_len=64)  # traced seq_len
    inv_freq, magnitude = _longrope_reference(16, 10000.0, _SHORT, _LONG, 32,
                                              64, 4.0)
    np.testing.assert_allclose(
        long, _hf_rotate(x, positions[:, None] * inv_freq, magnitude),
        **F32_TOL)
    # Factors up to 14 apart at positions <= 3: O(1e-1) differences.
    self.assertGreater(float(jnp.max(jnp.abs(short - long))), 1e-2)


class MropeTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("half_split", dict(sections=(4, 2, 2)), 16),
      # GLM-4V: interleaved pairs, partial rotary (R = 16 of H = 32).
      ("interleaved_partial", dict(sections=(2, 3, 3), interleaved=True,
                                   fraction=0.5), 32),
      ("two_axes", dict(sections=(5, 3)), 16),
      ("yarn", dict(sections=(4, 2, 2), scaling="yarn", factor=4.0,
                    original_max_positions=32), 16),
  )
  def test_apply_matches_hf(self, fields, h):
    rope = Rope(**fields)
    b, n, t = 2, 2, 6
    p = len(fields["sections"])
    x = _data.normal(4, (b, n, t, h))
    # HF's [P, B, T] position ids, one head axis added.
    positions = np.random.default_rng(5).integers(0, 40, (p, b, t))
    positions = positions.astype(np.int32)[:, :, None, :]  # [P, B, 1, T]
    out = _apply(x, positions, rope=rope)
    rot = rope.rotary_dim(h)
    inv_freq = rope.inverse_frequencies(rot)  # the scalings are tested apart
    freqs = _mrope_freqs(positions, inv_freq, fields["sections"])
    want = _hf_rotate(x, freqs, rope.magnitude, rope.interleaved)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, **F32_TOL)
    np.testing.assert_array_equal(out[..., rot:], x[..., rot:])

  def test_sections_pick_their_axis(self):
    # Qwen2-VL's (16, 24, 24) scaled down: pairs 0-1 time, 2-4 height, 5-7
    # width. Moving one axis's positions turns only its section's pairs.
    rope = Rope(sections=(2, 3, 3))
    x = _data.normal(6, (5, 16))
    base = np.stack([np.arange(5)] * 3).astype(np.int32)  # [3, T]
    plain = _apply(x, base, rope=rope)
    for axis, pairs in ((0, range(0, 2)), (1, range(2, 5)), (2, range(5, 8))):
      moved = base.copy()
      moved[axis] += 7
      out = _apply(x, moved, rope=rope)
      changed = np.abs(np.asarray(out - plain)) > 1e-3  # [T, 16]
      idx = np.array(list(pairs))
      want = np.zeros(16, bool)
      want[idx] = want[idx + 8] = True  # half-split: pair i is (i, i + 8)
      np.testing.assert_array_equal(changed[1:].any(axis=0), want)

  @parameterized.named_parameters(
      ("half_split", dict()), ("interleaved", dict(interleaved=True)),
      ("partial_llama3", dict(fraction=0.5, scaling="llama3", factor=8.0,
                              original_max_positions=16)))
  def test_equal_axes_are_plain_rope(self, fields):
    # Text tokens: HF's position_ids.expand(3, -1, -1). Each pair then
    # takes the same position whatever its section: plain RoPE, bit for bit.
    h = 16
    rot = Rope(**fields).rotary_dim(h)
    third = rot // 6
    sections = (rot // 2 - 2 * third, third, third)
    x = _data.normal(7, (2, 3, 5, h))
    positions = np.random.default_rng(8).integers(0, 50, (2, 1, 5))
    positions = positions.astype(np.int32)
    stacked = np.stack([positions] * 3)  # [3, B, 1, T]
    np.testing.assert_array_equal(
        _apply(x, stacked, rope=Rope(**fields, sections=sections)),
        _apply(x, positions, rope=Rope(**fields)))

  def test_positions_broadcast_over_equal_or_unit_axes(self):
    rope = Rope(sections=(4, 2, 2))
    x = _data.normal(9, (2, 3, 5, 16))
    shared = np.random.default_rng(10).integers(0, 30, (3, 1, 1, 5))
    full = np.broadcast_to(shared, (3, 2, 3, 5))
    np.testing.assert_array_equal(_apply(x, shared, rope=rope),
                                  _apply(x, full, rope=rope))


_AXIAL = dict(section_frequencies="per_section")


class AxialTest(parameterized.TestCase):
  """2-D / 3-D vision RoPE: a frequency ladder per section."""

  @parameterized.named_parameters(
      ("equal", 10000.0, (4, 4)), ("qwen2_vl_vision", 10000.0, (20, 20)),
      ("unequal", 100.0, (2, 3, 5)), ("one_section", 500.0, (8,)))
  def test_inverse_frequencies(self, base, sections):
    rope = Rope(base=base, sections=sections, **_AXIAL)
    got = rope.inverse_frequencies(2 * sum(sections))
    self.assertEqual(got.dtype, np.float64)
    np.testing.assert_allclose(got, _axial_inv_freq(base, sections),
                               **F64_TOL)
    # Each section restarts at 1 (wavelength 2 pi): the full range per axis.
    starts = np.cumsum((0,) + sections[:-1])
    np.testing.assert_array_equal(got[starts], 1.0)
    self.assertEqual(rope.magnitude, 1.0)

  @parameterized.named_parameters(
      # Qwen2-VL's vision layout scaled down: sections (H / 4, H / 4).
      ("half_split", dict(sections=(4, 4)), 16),
      ("interleaved", dict(sections=(4, 4), interleaved=True), 16),
      ("partial", dict(sections=(2, 2), fraction=0.5), 16),
      ("unequal", dict(sections=(3, 5), base=100.0), 16),
  )
  def test_apply_matches_reference_on_a_grid(self, fields, h):
    rope = Rope(**fields, **_AXIAL)
    hw = _grid_positions(2, 3)  # [2, T = 6]: a 2 x 3 patch grid
    x = _data.normal(15, (2, 6, h))  # [N, T, H]
    out = _apply(x, hw[:, None, :], rope=rope)  # positions [2, 1, T]
    rot = rope.rotary_dim(h)
    inv_freq = _axial_inv_freq(fields.get("base", 10000.0),
                               fields["sections"])
    freqs = _mrope_freqs(hw[:, None, :], inv_freq, fields["sections"])
    want = _hf_rotate(x, freqs, 1.0, rope.interleaved)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, **F32_TOL)
    np.testing.assert_array_equal(out[..., rot:], x[..., rot:])
    # The split (M-RoPE) ladder turns the width pairs far slower here.
    split = _apply(x, hw[:, None, :], rope=Rope(**fields))
    self.assertGreater(float(jnp.max(jnp.abs(split - out))), 1e-2)

  @parameterized.named_parameters(("half_split", False),
                                  ("interleaved", True))
  def test_two_independent_1d_ropes(self, interleaved):
    # Qwen2-VL's vision rope, (R / 4, R / 4): a 1-D RoPE of rotary dim R / 2
    # by the row on the pairs of the first half, one by the column on the
    # second. Half-split pairs are (i, i + R / 2), so the height rope's
    # features are [0:R/4] and [R/2:3R/4]; interleaved ones are contiguous.
    h, quarter = 16, 4
    rope = Rope(sections=(quarter, quarter), interleaved=interleaved,
                **_AXIAL)
    hw = _grid_positions(2, 3)
    x = _data.normal(16, (3, 6, h))
    out = np.asarray(_apply(x, hw[:, None, :], rope=rope))
    if interleaved:
      idx = [np.arange(0, 2 * quarter), np.arange(2 * quarter, h)]
    else:
      idx = [np.r_[0:quarter, 2 * quarter:3 * quarter],
             np.r_[quarter:2 * quarter, 3 * quarter:h]]
    one_d = Rope(interleaved=interleaved)
    for axis in (0, 1):
      np.testing.assert_allclose(
          out[..., idx[axis]],
          _apply(x[..., idx[axis]], hw[axis], rope=one_d),
          atol=1e-6, rtol=1e-6)
    # One section: the ladder over R / 2 is plain RoPE's.
    np.testing.assert_array_equal(
        _apply(x, hw[:1, None, :], rope=Rope(sections=(8,), **_AXIAL)),
        _apply(x, hw[0], rope=Rope()))

  def test_attention_with_grid_positions(self):
    # Vision towers attend bidirectionally over the patches: no cache, a
    # full forward against a float64 reference of the whole layer.
    b, t, d, n, h = 2, 6, 16, 2, 16
    params = _params(h)
    x = _data.normal(17, (b, t, d))
    hw = _grid_positions(2, 3)
    positions = np.stack([hw, hw[:, ::-1]], axis=1)  # [2, B, T]
    rope = Rope(sections=(h // 4, h // 4), **_AXIAL)
    got = aj.multi_head_attention(params, x, x, x, rope=rope,
                                  positions=positions)
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    xf = np.asarray(x, np.float64)

    def project(layer):  # [B, T, D] -> [B, heads, T, H]
      return (np.einsum("btd,dnh->bnth", xf, layer["kernel"])
              + layer["bias"][None, :, None, :])

    inv_freq = _axial_inv_freq(10000.0, (h // 4, h // 4))
    freqs = _mrope_freqs(positions[:, :, None, :], inv_freq, (4, 4))
    q = _hf_rotate(project(p["W_q"]), freqs)
    k = np.repeat(_hf_rotate(project(p["W_k"]), freqs), n, axis=1)  # GQA
    v = np.repeat(project(p["W_v"]), n, axis=1)
    scores = np.einsum("bnth,bnsh->bnts", q, k) / math.sqrt(h)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    heads = np.einsum("bnts,bnsh->bnth", weights, v)
    want = (np.einsum("bnth,nhd->btd", heads, p["W_o"]["kernel"])
            + p["W_o"]["bias"])
    np.testing.assert_allclose(np.asarray(got, np.float64), want, **F32_TOL)
    split = aj.multi_head_attention(params, x, x, x, rope=Rope(sections=(4, 4)),
                                    positions=positions)
    self.assertGreater(float(jnp.max(jnp.abs(split - got))), 1e-3)

  def test_split_is_the_default(self):
    self.assertEqual(Rope(sections=(4, 4), section_frequencies="split"),
                     Rope(sections=(4, 4)))
    self.assertNotEqual(Rope(sections=(4, 4), **_AXIAL),
                        Rope(sections=(4, 4)))


def _params(h):
  return aj.init_multi_head_params(jax.random.key(0), 16, 2, num_kv_heads=1,
                                   head_dim=h)


def _decode(params, x, rope, chunk, positions=None, slots=16):
  """Chunks of ``x`` through a KV cache; positions sliced per chunk."""
  b, t, _ = x.shape
  k = params["W_k"]["kernel"].shape[1]
  h = params["W_k"]["kernel"].shape[2]
  cache = KVCache(jnp.zeros((b, k, slots, h)), jnp.zeros((b, k, slots, h)),
                  jnp.int32(0), jnp.zeros((b,), bool))
  outs = []
  for i in range(0, t, chunk):
    xi = x[:, i:i + chunk]
    pos = None if positions is None else positions[..., i:i + chunk]
    out, cache = aj.multi_head_attention(params, xi, xi, xi, rope=rope,
                                         positions=pos, cache=cache)
    outs.append(out)
  return jnp.concatenate(outs, axis=1)


class DecodeTest(chex.TestCase):

  def test_longrope_within_the_original_context(self):
    # 12 tokens, O = 32: short factors at every step and in the forward.
    params, rope = _params(16), Rope(**_PHI)
    x = _data.normal(11, (2, 12, 16))
    want = aj.multi_head_attention(params, x, x, x, is_causal=True,
                                   rope=rope)
    got = _decode(params, x, rope, chunk=5)
    chex.assert_trees_all_close(got, want, **DECODE_TOL)

  def test_longrope_past_the_original_context_from_the_first_step(self):
    # O = 8 and a 10-token prompt: long factors at every step (L > O from
    # the first), as in the forward. A sequence crossing O while decoding
    # would mix both sets in the cache, as HF does.
    params, rope = _params(16), Rope(**{**_PHI, "original_max_positions": 8})
    x = _data.normal(12, (2, 12, 16))
    want = aj.multi_head_attention(params, x, x, x, is_causal=True,
                                   rope=rope)
    got = _decode(params, x, rope, chunk=10)
    chex.assert_trees_all_close(got, want, **DECODE_TOL)
    crossing = _decode(params, x, rope, chunk=4)  # steps at L = 4, 8, 12
    self.assertGreater(float(jnp.max(jnp.abs(crossing - want))), 1e-4)

  def test_mrope_with_explicit_positions(self):
    # An image of 2 x 3 patches between text tokens, Qwen2-VL style: text
    # repeats its position on the three axes; patches share the time
    # position and spread over height and width.
    text0 = [[0, 1, 2]] * 3
    image = [[3] * 6, [3, 3, 3, 4, 4, 4], [3, 4, 5, 3, 4, 5]]
    text1 = [[6, 7, 8]] * 3
    thw = np.concatenate([text0, image, text1], axis=1)  # [3, T = 12]
    positions = np.stack([thw, thw + 2], axis=1).astype(np.int32)  # [3, B, T]
    params, rope = _params(16), Rope(sections=(4, 2, 2))
    x = _data.normal(13, (2, 12, 16))
    want = aj.multi_head_attention(params, x, x, x, is_causal=True,
                                   rope=rope, positions=positions)
    got = _decode(params, x, rope, chunk=5, positions=positions)
    chex.assert_trees_all_close(got, want, **DECODE_TOL)
    # The positions matter: plain arange positions stacked give another
    # result.
    plain = np.broadcast_to(np.arange(12, dtype=np.int32), (3, 1, 12))
    other = aj.multi_head_attention(params, x, x, x, is_causal=True,
                                    rope=rope, positions=plain)
    self.assertGreater(float(jnp.max(jnp.abs(other - want))), 1e-3)


class ValidationTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("missing_long", dict(scaling="longrope", short_factor=_SHORT,
                            original_max_positions=32, factor=4.0),
       ValueError, r"scaling='longrope' needs long_factor"),
      ("missing_original", dict(scaling="longrope", short_factor=_SHORT,
                                long_factor=_LONG, factor=4.0), ValueError,
       r"scaling='longrope' needs original_max_positions"),
      ("no_factor", dict(_PHI, factor=1.0), ValueError,
       r"scaling='longrope' needs factor > 1.*131072 / 4096 = 32.0.*"
       r"attention_factor"),
      ("factor_and_attention_factor", dict(_PHI, attention_factor=1.2),
       ValueError, r"attention_factor=1.2 replaces it: drop factor=4.0"),
      ("attention_factor_negative", dict(_PHI, factor=1.0,
                                         attention_factor=-1.0), ValueError,
       r"attention_factor must be positive, got -1.0"),
      ("factor_below_one", dict(_PHI, factor=0.5), ValueError,
       r"scaling='longrope' needs factor >= 1"),
      ("original_one", dict(_PHI, original_max_positions=1), ValueError,
       r"divides by ln\(original_max_positions\), which is 0"),
      ("factor_zero", dict(_PHI, short_factor=(1.0, 0.0)), ValueError,
       r"short_factor must be positive.*short_factor\[1\]=0.0"),
      ("factor_nan", dict(_PHI, long_factor=(1.0, float("nan"))), ValueError,
       r"long_factor\[1\] must be finite"),
      ("factor_string", dict(_PHI, long_factor=(1.0, "2")), TypeError,
       r"long_factor\[1\] must be a real Python number"),
      ("factor_scalar", dict(_PHI, short_factor=1.0), TypeError,
       r"short_factor must be a tuple \(or list\) of numbers, got 1.0"),
      ("factor_empty", dict(_PHI, short_factor=[]), ValueError,
       r"short_factor is empty"),
      ("factor_array", dict(_PHI, short_factor=jnp.ones(8)), TypeError,
       r"short_factor must be static.*JAX array of shape \(8,\)"),
      ("factors_on_yarn", dict(scaling="yarn", factor=4.0,
                               original_max_positions=32, long_factor=_LONG),
       ValueError, r"long_factor=\(1.0, .*\) has no effect with "
       r"scaling='yarn' \(read by scaling 'longrope'\)"),
      ("factors_on_none", dict(short_factor=[1.0]), ValueError,
       r"short_factor=\(1.0,\) has no effect with scaling='none'"),
      ("sections_with_longrope", dict(_PHI, sections=(4, 2, 2)), ValueError,
       r"sections=\(4, 2, 2\) with scaling='longrope' is not supported"),
      ("sections_with_dynamic", dict(scaling="dynamic", factor=2.0,
                                     original_max_positions=8,
                                     sections=(4, 4)), ValueError,
       r"with scaling='dynamic' is not supported.*max\(positions\) \+ 1"),
      ("sections_zero", dict(sections=(4, 0, 4)), ValueError,
       r"sections\[1\] must be positive"),
      ("sections_float", dict(sections=(4.0, 4)), TypeError,
       r"sections\[0\] must be a Python int"),
      ("sections_bool", dict(sections=(True, 4)), TypeError,
       r"sections\[0\] must be a Python int"),
      ("sections_int", dict(sections=8), TypeError,
       r"sections must be a tuple \(or list\) of numbers, got 8"),
      ("per_section_without_sections", dict(_AXIAL), ValueError,
       r"section_frequencies='per_section' needs sections.*"
       r"sections=\(20, 20\)"),
      ("per_section_linear", dict(_AXIAL, sections=(4, 4), scaling="linear",
                                  factor=2.0), ValueError,
       r"section_frequencies='per_section' with scaling='linear' is not "
       r"supported.*divide the positions by factor instead"),
      ("per_section_yarn", dict(_AXIAL, sections=(4, 4), scaling="yarn",
                                factor=4.0, original_max_positions=32),
       ValueError, r"with scaling='yarn' is not supported.*scaling='none'"),
      ("per_section_llama3", dict(_AXIAL, sections=(4, 4), scaling="llama3",
                                  factor=8.0, original_max_positions=16),
       ValueError, r"with scaling='llama3' is not supported"),
      ("section_frequencies_unknown", dict(sections=(4, 4),
                                           section_frequencies="axial"),
       ValueError, r"unknown section_frequencies 'axial'.*'per_section'"),
      ("section_frequencies_bool", dict(sections=(4, 4),
                                        section_frequencies=True),
       TypeError, r"section_frequencies must be a string.*got True"),
  )
  def test_rope_rejects(self, fields, exception, pattern):
    with self.assertRaisesRegex(exception, pattern):
      Rope(**fields)

  def test_apply_rope_rejects(self):
    x = np.ones((2, 3, 4, 16), np.float32)  # [B, N, T, H]
    pos = np.zeros((3, 2, 1, 4), np.int32)
    with self.assertRaisesRegex(
        ValueError, r"short_factor has 8 entries, but the rotary dim R=12 "
        r"\(head dim H=16, fraction=0.75\) has R / 2 = 6 frequencies"):
      rope_lib.apply_rope(x, pos[0], rope=Rope(**_PHI, fraction=0.75))
    with self.assertRaisesRegex(
        ValueError, r"sections=\(4, 4, 4\) sum to 12, but the rotary dim "
        r"R=16 \(head dim H=16, fraction=1.0\) has R / 2 = 8"):
      rope_lib.apply_rope(x, pos, rope=Rope(sections=(4, 4, 4)))
    mrope = Rope(sections=(4, 2, 2))
    with self.assertRaisesRegex(
        ValueError, r"rope.sections=\(4, 2, 2\) needs multimodal positions "
        r"\[3, \.\.\., T\].*got positions of shape \(2, 1, 4\)"):
      rope_lib.apply_rope(x, pos[0], rope=mrope)  # plain, B == ... refused
    with self.assertRaisesRegex(ValueError, r"got positions of shape "
                                r"\(2, 2, 1, 4\)"):
      rope_lib.apply_rope(x, pos[:2], rope=mrope)  # P = 2 != 3
    with self.assertRaisesRegex(ValueError, r"positions with shape "
                                r"\(3, 2, 2, 4\).*not broadcastable"):
      rope_lib.apply_rope(x, np.zeros((3, 2, 2, 4), np.int32), rope=mrope)
    with self.assertRaisesRegex(
        ValueError, r"positions with shape \(3, 2, 1, 4\) is not "
        r"broadcastable.*more axes.*Rope\(sections=\.\.\.\)"):
      rope_lib.apply_rope(x, pos, rope=Rope())
    with self.assertRaisesRegex(
        ValueError, r"seq_len chooses dynamic NTK frequencies, and this "
        r"rope has scaling='none'.*'longrope'"):
      rope_lib.apply_rope(x, pos[0], rope=mrope, seq_len=8)

  def test_plain_positions_are_never_read_as_sections(self):
    # B = 3 = len(sections): [B, 1, T] positions would broadcast as [P, ...]
    # if the rank were not checked.
    x = np.ones((3, 2, 4, 16), np.float32)
    with self.assertRaisesRegex(ValueError, r"needs multimodal positions"):
      rope_lib.apply_rope(x, np.zeros((3, 1, 4), np.int32),
                          rope=Rope(sections=(4, 2, 2)))

  def test_inverse_frequencies_rejects(self):
    with self.assertRaisesRegex(ValueError, r"long_factor has 4 entries, but "
                                r"the rotary dim R=16 has R / 2 = 8"):
      Rope(**{**_PHI, "long_factor": (1.0,) * 4}).inverse_frequencies(16)
    with self.assertRaisesRegex(ValueError, r"sections=\(2, 2\) sum to 4, "
                                r"but the rotary dim R=16 has R / 2 = 8"):
      Rope(sections=(2, 2)).inverse_frequencies(16)

  def test_layer_rejects(self):
    params, mrope = _params(16), Rope(sections=(4, 2, 2))
    x = _data.normal(14, (3, 4, 16))  # B = 3 = len(sections)
    cache = KVCache(jnp.zeros((3, 1, 8, 16)), jnp.zeros((3, 1, 8, 16)),
                    jnp.int32(0), jnp.zeros((3,), bool))
    # Decoding without positions: the cache's positions are plain.
    with self.assertRaisesRegex(
        ValueError, r"needs multimodal positions.*positions \[3, B, T\] "
        r"while decoding too"):
      aj.multi_head_attention(params, x, x, x, rope=mrope, cache=cache)
    # No positions, no cache: the default arange is plain too.
    with self.assertRaisesRegex(ValueError, r"needs multimodal positions"):
      aj.multi_head_attention(params, x, x, x, rope=mrope)
    # Plain [B, T] positions with B == len(sections): refused, not misread.
    with self.assertRaisesRegex(ValueError, r"needs multimodal positions"):
      aj.multi_head_attention(params, x, x, x, rope=mrope,
                              positions=np.zeros((3, 4), np.int32))
    with self.assertRaisesRegex(
        ValueError, r"positions has shape \(3, 4, 4\), expected.*"
        r"multimodal ones \(Rope\(sections=\.\.\.\)\) \[P, B, T\]"):
      aj.multi_head_attention(params, x, x, x, rope=mrope,
                              positions=np.zeros((3, 4, 4), np.int32))
    # Multimodal positions without sections.
    with self.assertRaisesRegex(ValueError, r"need Rope\(sections=\.\.\.\)"):
      aj.multi_head_attention(params, x, x, x, rope=Rope(),
                              positions=np.zeros((3, 3, 4), np.int32))


if __name__ == "__main__":
  absltest.main()
