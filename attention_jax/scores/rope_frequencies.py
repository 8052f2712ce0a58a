"""RoPE's maths: the rotary dim, the frequency ladder and its scalings.

Shape glossary: H head dim, R rotated features (the rotary dim), ``R / 2``
the rotated pairs; every frequency array is ``[R / 2]``, pair ``i`` turning
by ``theta_i`` radians per unit position, ``theta_i = base**(-2 i / R)``
unscaled.

Pure functions of numbers, one per context-extension scaling of HF
transformers' ``modeling_rope_utils`` (the formulas are in ``Rope``'s
docstring, which chooses among them). The static ones compute in float64
NumPy, so a frequency is rounded once, where it becomes a program constant;
the ``*_on_device`` ones take a length ``seq_len`` that may be traced and
compute what depends on it in ``dtype``, keeping the static part exact.
``ntk_alpha_base`` is Hunyuan's fixed NTK base; ``section_axes`` says which
position axis turns each pair under multimodal sections (blocked or
interleaved).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from attention_jax.scores import rope_checks


def rotary_dim(head_dim: int, fraction) -> int:
  """Features rotated: ``int(H * fraction)`` (HF's partial rotary width),
  which must be positive and even (``rope_checks.check_rotary_width``)."""
  fraction = rope_checks.check_number("fraction", fraction)
  if not 0.0 < fraction <= 1.0:
    raise ValueError(f"fraction must be in (0, 1], got {fraction}.")
  rot = int(head_dim * fraction)
  if rot == 0:
    raise ValueError(
        f"fraction={fraction} rotates no features of head dim H={head_dim} "
        f"(int(H * fraction) is 0); raise fraction.")
  rope_checks.check_rotary_width(fraction, head_dim, rot)
  return rot


def plain_theta(base: float, rot: int) -> np.ndarray:
  """``base**(-2 i / R)`` in float64, ``[R / 2]``."""
  return base ** (-2.0 * np.arange(rot // 2, dtype=np.float64) / rot)


def ntk_alpha_base(base: float, alpha: float, rot: int) -> float:
  """Hunyuan's NTK-alpha base ``base * alpha**(R / (R - 2))`` (HF's
  ``compute_ntk_alpha_rope_parameters``; fixed, no length dependence)."""
  return base * alpha ** (rot / (rot - 2))


def section_axes(sections: tuple[int, ...], interleaved: bool) -> np.ndarray:
  """The position axis of each rotated pair under multimodal sections, int
  ``[R / 2]`` (``R / 2 = sum(sections)``).

  Blocked (Qwen2-VL): section ``a`` takes the pairs ``sum(sections[:a]) <=
  i < sum(sections[:a + 1])``. Interleaved (Qwen3-VL's
  ``recomposition_frequencies``, three sections only): axis 1 (height)
  takes pairs ``1, 4, 7, ...`` and axis 2 (width) ``2, 5, 8, ...``, below
  ``3 * sections[a]`` each; axis 0 (time) the rest, so ``THWTHW...TT``.
  """
  if not interleaved:
    return np.repeat(np.arange(len(sections)), sections)
  axes = np.zeros(sum(sections), np.int64)
  for a in (1, 2):  # HF's slice(a, 3 * sections[a], 3): sections[a] pairs
    axes[a:3 * sections[a]:3] = a
  return axes


def get_mscale(scale: float, mscale: float = 1.0) -> float:
  """YaRN's magnitude ``0.1 * mscale * ln(s) + 1`` (1 for ``s <= 1``)."""
  if scale <= 1.0:
    return 1.0
  return 0.1 * mscale * math.log(scale) + 1.0


def longrope_magnitude(factor: float, original: int) -> float:
  """LongRoPE's default magnitude ``sqrt(1 + ln(s) / ln(O))`` (1 for
  ``s <= 1``), HF's, from the LongRoPE paper."""
  if factor <= 1.0:
    return 1.0
  return math.sqrt(1.0 + math.log(factor) / math.log(original))


def llama3(theta: np.ndarray, factor: float, original: int,
           low_freq_factor: float, high_freq_factor: float) -> np.ndarray:
  """Llama 3.1's: long wavelengths divided by ``factor``, short ones kept,
  a linear blend in between."""
  low_wavelen = original / low_freq_factor
  high_wavelen = original / high_freq_factor
  wavelen = 2.0 * np.pi / theta
  out = np.where(wavelen > low_wavelen, theta / factor, theta)
  smooth = ((original / wavelen - low_freq_factor)
            / (high_freq_factor - low_freq_factor))
  # HF's band: neither shorter than high nor longer than low (ends kept).
  medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
  blended = (1.0 - smooth) * theta / factor + smooth * theta
  return np.where(medium, blended, out)


def yarn(theta: np.ndarray, rot: int, *, base: float, factor: float,
         original: int, beta_fast: float, beta_slow: float,
         truncate: bool) -> np.ndarray:
  """YaRN's: a ramp over the pairs between interpolated (``theta /
  factor``) and extrapolated (``theta``) frequencies."""

  def correction_dim(rotations):  # the dim turning `rotations` times in O
    return (rot * math.log(original / (rotations * 2.0 * math.pi))
            / (2.0 * math.log(base)))

  low, high = correction_dim(beta_fast), correction_dim(beta_slow)
  if truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, rot - 1)
  if low == high:
    high += 0.001  # HF's guard against a zero-width ramp
  ramp = np.clip((np.arange(rot // 2, dtype=np.float64) - low)
                 / (high - low), 0.0, 1.0)
  extrapolation = 1.0 - ramp  # 1: the dim keeps its frequency
  return theta / factor * (1.0 - extrapolation) + theta * extrapolation


def dynamic(base: float, rot: int, factor: float, original: int,
            length: float) -> np.ndarray:
  """Dynamic NTK's for a static length ``L``: the base grown by
  ``(factor * L / O - (factor - 1))**(R / (R - 2))`` past ``O``."""
  length = max(length, original)  # at or below O: unscaled, as HF
  grown = base * (factor * length / original
                  - (factor - 1.0)) ** (rot / (rot - 2))
  return plain_theta(grown, rot)


def dynamic_on_device(theta: np.ndarray, rot: int, factor: float,
                      original: int, seq_len, dtype):
  """Dynamic NTK frequencies on device: ``seq_len`` may be traced.

  ``base' ** (-2i/R) = theta_i * scale ** (-2i / (R - 2))`` with
  ``scale = factor * L / O - (factor - 1)``: the static part stays exact
  (float64, rounded once); only the correction is computed in ``dtype``.
  """
  original = float(original)
  length = jnp.maximum(jnp.asarray(seq_len, dtype), original)
  scale = factor * length / original - (factor - 1.0)
  exponent = jnp.asarray(
      -2.0 * np.arange(rot // 2, dtype=np.float64) / (rot - 2), dtype)
  return jnp.asarray(theta, dtype) * jnp.exp(exponent * jnp.log(scale))


def longrope(theta: np.ndarray, short_factor, long_factor, original: int,
             length: float | None) -> np.ndarray:
  """LongRoPE's for a static length ``L``: ``theta / long_factor`` past
  ``O``, else (and for None, as HF's init) ``theta / short_factor``."""
  long = length is not None and length > original
  return theta / np.asarray(long_factor if long else short_factor)


def longrope_on_device(theta: np.ndarray, short_factor, long_factor,
                       original: int, seq_len, dtype):
  """LongRoPE's frequencies on device: ``seq_len`` may be traced.

  Both sets are float64 constants rounded once to ``dtype``; the scalar
  comparison picks one for every position (HF's ``torch.where``).
  """
  short = jnp.asarray(theta / np.asarray(short_factor), dtype)
  long = jnp.asarray(theta / np.asarray(long_factor), dtype)
  return jnp.where(jnp.asarray(seq_len) > original, long, short)
