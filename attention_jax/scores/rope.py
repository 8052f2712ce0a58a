"""Rotary position embeddings (RoPE, Su et al. 2021) as pure functions.

Shape glossary: B batch, T length, N heads, H head dim, R rotated features
(the rotary dim, ``Rope.rotary_dim(H)``); ``...`` leading batch dims.

RoPE encodes a token's position ``m`` by rotating pairs of query/key
features through angles ``m * theta_i``. A rotation is orthogonal, so norms
are kept, and the dot product of a query rotated by ``m`` with a key rotated
by ``n`` depends on the positions only through ``m - n``: attention scores
see relative positions. Apply it to queries and keys (not values), after
the projections and before the scores, e.g. ``apply_rope(q, pos[:, None])``
for ``[B, N, T, H]`` queries and ``[B, T]`` positions.

``Rope`` is the one description of a rotary embedding: the base, the
context-extension scaling of the frequencies (HF transformers'
``rope_scaling`` kinds, from the published formulas):

* ``"none"``: ``theta_i = base**(-2 i / R)``.
* ``"linear"`` (position interpolation, kaiokendev; Chen et al. 2023):
  positions divided by ``factor``.
* ``"dynamic"`` (dynamic NTK, bloc97 / emozilla): the base grows with the
  longest position of the call once it passes ``original_max_positions``.
* ``"llama3"`` (Llama 3.1): long wavelengths divided by ``factor``, short
  ones kept, a smooth blend between.
* ``"yarn"`` (Peng et al. 2023, arXiv 2309.00071): a ramp between
  interpolated and extrapolated frequencies over the rotary dims, and a
  magnitude factor on cos and sin.
* ``"longrope"`` (Ding et al. 2024, arXiv 2402.13753; Phi-3, Phi-3.5,
  Phi-4): searched per-frequency divisors, ``short_factor`` while the
  sequence fits the trained context and ``long_factor`` past it, and a
  magnitude factor on cos and sin.

and the layout: the share of the head dim rotated (``fraction``, partial
rotary as GPT-NeoX / Phi / GLM) and which features pair up (half-split
``(x[i], x[i + R/2])`` by default, ``interleaved`` ``(x[2i], x[2i + 1])``
as GPT-J and Meta's original llama code).

Multimodal RoPE (M-RoPE, Qwen2-VL / Qwen2.5-VL / GLM-4V; HF's
``mrope_section``): ``Rope(sections=(16, 24, 24))`` splits the ``R / 2``
frequencies into consecutive sections, and each token carries one position
per section (time, height, width): positions ``[3, ..., T]`` with a
leading axis of ``len(sections)``, frequency ``i`` turning by the position
of the section that contains it. Text tokens carry the same position on
every axis, which is plain RoPE.

Axial RoPE of vision encoders (2-D over a patch grid: Qwen2-VL /
Qwen2.5-VL / Qwen3-VL / GLM-4V's vision towers, HF's ``rope_type="axial"``):
``Rope(sections=(R / 4, R / 4), section_frequencies="per_section")``
with positions ``[2, ..., T]`` (height, width); 3-D over (time, height,
width) as MiniMax-M3-VL's: three sections and positions ``[3, ..., T]``.
Each section is then a 1-D RoPE of its own, with its own frequency
ladder ``base**(-j / n)`` over its ``n`` pairs, instead of a slice of
the one ladder over ``R / 2``.

Packed sequences (several documents in one row, told apart by segment ids)
need positions that restart at each document: ``segment_positions``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
import numpy as np

from attention_jax.core import checks

#: The frequency scalings ``Rope(scaling=...)`` knows (HF's ``rope_type``).
SCALINGS = ("none", "linear", "dynamic", "llama3", "yarn", "longrope")

#: How ``Rope(sections=...)`` assigns frequencies to its sections:
#: ``"split"`` (M-RoPE: one ladder over ``R / 2``, cut into the sections)
#: or ``"per_section"`` (axial vision RoPE: a ladder per section).
SECTION_FREQUENCIES = ("split", "per_section")

# Which scalings read each optional field: a field set away from its
# default under another scaling would be accepted and ignored, so it is an
# error instead.
_USED_BY = {
    "factor": ("linear", "dynamic", "llama3", "yarn", "longrope"),
    "original_max_positions": ("dynamic", "llama3", "yarn", "longrope"),
    "low_freq_factor": ("llama3",),
    "high_freq_factor": ("llama3",),
    "beta_fast": ("yarn",),
    "beta_slow": ("yarn",),
    "attention_factor": ("yarn", "longrope"),
    "short_factor": ("longrope",),
    "long_factor": ("longrope",),
    "truncate": ("yarn",),
    "mscale": ("yarn",),
    "mscale_all_dim": ("yarn",),
}

# What ``factor`` does in each scaling (for the factor >= 1 message).
_FACTOR_ROLE = {
    "linear": "positions are divided by it",
    "dynamic": "the base grows with it past original_max_positions",
    "llama3": "long wavelengths are divided by it",
    "yarn": "interpolated frequencies are divided by it",
    "longrope": "it sets the magnitude sqrt(1 + ln(factor) / "
                "ln(original_max_positions))",
}

# Scalings whose frequencies depend on the positions' maximum: with
# multimodal positions that maximum mixes the time, height and width axes
# (none of them a sequence length), and no checkpoint combines them.
_LENGTH_DEPENDENT = ("dynamic", "longrope")


def _check_number(name: str, value) -> float:
  """A static real number (not a bool, not traced) as a Python float."""
  if isinstance(value, jax.core.Tracer):
    raise TypeError(f"{name} must be a Python number, got a traced value: "
                    "close over it or pass it as a static argument.")
  if isinstance(value, (bool, np.bool_)) or not isinstance(
      value, (int, float, np.integer, np.floating)):
    raise TypeError(f"{name} must be a real Python number, got {value!r} "
                    f"({type(value).__name__}).")
  value = float(value)
  if not np.isfinite(value):
    raise ValueError(f"{name} must be finite, got {value}.")
  return value


def _check_choice(name: str, value, choices: tuple[str, ...], type_hint: str,
                  fix: str) -> None:
  """TypeError unless ``value`` is a string; ValueError unless in
  ``choices`` (``fix`` says which to use)."""
  if not isinstance(value, str):
    raise TypeError(
        f"{name} must be a string, one of {', '.join(map(repr, choices))}"
        f"{type_hint}, got {value!r} ({type(value).__name__}).")
  if value not in choices:
    raise ValueError(f"unknown {name} {value!r}: {fix}.")


def _check_bool(name: str, value) -> bool:
  """A static Python bool (numpy bools accepted; ints, arrays refused)."""
  if isinstance(value, jax.core.Tracer) or not isinstance(
      value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a Python bool, got {value!r} "
                    f"({type(value).__name__}).")
  return bool(value)


def _as_static_tuple(name: str, value, example: str) -> list:
  """A list, tuple or 1-D NumPy array as a list (refused: traced, other)."""
  if isinstance(value, (jax.Array, jax.core.Tracer)):
    raise TypeError(f"{name} must be static (a tuple of Python numbers), got "
                    f"a JAX array of shape {checks.shape_of(value)}: pass "
                    f"tuple(...) of a concrete value, e.g. {example}.")
  if isinstance(value, np.ndarray) and value.ndim == 1:
    value = value.tolist()
  if not isinstance(value, (list, tuple)):
    raise TypeError(f"{name} must be a tuple (or list) of numbers, got "
                    f"{value!r} ({type(value).__name__}), e.g. {example}.")
  if not value:
    raise ValueError(f"{name} is empty: give one entry per rotated pair "
                     f"(R / 2 of them), e.g. {example}.")
  return list(value)


def _check_factors(name: str, value) -> tuple[float, ...]:
  """LongRoPE's per-frequency divisors: positive finite Python floats."""
  values = _as_static_tuple(name, value, "(1.0, 1.05, 1.3, ...)")
  out = tuple(_check_number(f"{name}[{i}]", v) for i, v in enumerate(values))
  bad = [(i, v) for i, v in enumerate(out) if v <= 0.0]
  if bad:
    raise ValueError(f"{name} must be positive (each divides a frequency), "
                     f"got {name}[{bad[0][0]}]={bad[0][1]}.")
  return out


def _check_sections(value) -> tuple[int, ...]:
  """M-RoPE's section sizes: positive Python ints."""
  values = _as_static_tuple("sections", value, "(16, 24, 24) (Qwen2-VL)")
  for i, v in enumerate(values):
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
      raise TypeError(f"sections[{i}] must be a Python int (a count of "
                      f"frequencies), got {v!r} ({type(v).__name__}).")
    if v <= 0:
      raise ValueError(f"sections[{i}] must be positive (a count of "
                       f"frequencies), got {v}.")
  return tuple(int(v) for v in values)


def _check_rotary_dim(rotary_dim) -> int:
  if isinstance(rotary_dim, (bool, np.bool_)) or not isinstance(
      rotary_dim, (int, np.integer)):
    raise TypeError(f"rotary_dim must be a Python int, got {rotary_dim!r} "
                    f"({type(rotary_dim).__name__}).")
  if rotary_dim <= 0 or rotary_dim % 2:
    raise ValueError(f"rotary_dim must be a positive even int (features "
                     f"rotate in pairs), got {rotary_dim}; "
                     f"Rope.rotary_dim(H) gives it for head dim H.")
  return int(rotary_dim)


def _get_mscale(scale: float, mscale: float = 1.0) -> float:
  """YaRN's magnitude ``0.1 * mscale * ln(s) + 1`` (1 for ``s <= 1``)."""
  if scale <= 1.0:
    return 1.0
  return 0.1 * mscale * math.log(scale) + 1.0


def _rotary_dim(head_dim: int, fraction) -> int:
  """Features rotated: ``int(H * fraction)`` rounded down to even."""
  fraction = _check_number("fraction", fraction)
  if not 0.0 < fraction <= 1.0:
    raise ValueError(f"fraction must be in (0, 1], got {fraction}.")
  rot = int(head_dim * fraction) // 2 * 2
  if rot == 0:
    raise ValueError(
        f"fraction={fraction} rotates no features of head dim H={head_dim} "
        f"(int(H * fraction) rounded down to even is 0); raise fraction.")
  return rot


@dataclasses.dataclass(frozen=True)
class Rope:
  """One description of a rotary position embedding: frequencies and layout.

  A frozen, hashable value (a static argument under ``jax.jit``, not a
  pytree). ``apply_rope(x, positions, rope=Rope(...))`` applies it. The
  frequencies follow HF transformers' ``modeling_rope_utils`` (the de-facto
  spec of the published methods), with ``R`` the rotary dim and
  ``theta_i = base**(-2 i / R)``, ``i < R / 2``:

  * ``"none"``: ``theta_i``.
  * ``"linear"``: ``theta_i / factor`` (positions divided by ``factor``).
  * ``"dynamic"`` (dynamic NTK): with ``L = max(positions) + 1`` over the
    whole positions array (HF takes the max of ``position_ids``; or the
    ``seq_len`` given) and ``O = original_max_positions``, the base becomes
    ``base * (factor * L / O - (factor - 1))**(R / (R - 2))`` when
    ``L > O``, and stays ``base`` otherwise. ``L`` may be traced, so these
    frequencies are computed on device, in the compute dtype. Stateless:
    unlike HF's module, which keeps the largest length seen so far, each
    call's frequencies depend on its own positions only. Rotate queries and
    keys with the same positions (or the same ``seq_len``). A KV cache
    keeps each key rotated with the frequencies of its own step (as HF
    does), so decoding matches a full forward only while ``L <= O``.
  * ``"llama3"``: with wavelengths ``w_i = 2 pi / theta_i``,
    ``low = O / low_freq_factor`` and ``high = O / high_freq_factor``:
    ``theta_i / factor`` where ``w_i > low``, ``theta_i`` where
    ``w_i < high``, and in between (both ends included, as HF)
    ``(1 - s) theta_i / factor + s theta_i`` with
    ``s = (O / w_i - low_freq_factor) / (high_freq_factor -
    low_freq_factor)``.
  * ``"yarn"``: HF's ``find_correction_range``: the dims
    ``d(b) = R ln(O / (2 pi b)) / (2 ln base)`` for ``b = beta_fast`` (low)
    and ``beta_slow`` (high), floored / ceiled when ``truncate``, clipped
    to ``[0, R - 1]``; the ramp ``r_i = clip((i - low) / (high - low), 0,
    1)`` (``high += 0.001`` if equal); frequencies
    ``theta_i / factor * r_i + theta_i * (1 - r_i)``. ``magnitude``
    multiplies cos and sin (so attention scores scale by its square).
  * ``"longrope"`` (HF's ``_compute_longrope_parameters`` and
    ``longrope_frequency_update``): ``theta_i / e_i`` with ``e =
    long_factor`` when ``L > O`` (``L`` as for ``"dynamic"``: ``max(
    positions) + 1`` over the whole array, or the ``seq_len`` given) and
    ``e = short_factor`` otherwise. ``L`` may be traced: both sets are
    float64 constants and the choice is made on device. ``magnitude``
    multiplies cos and sin with either set (HF's ``attention_scaling`` is
    fixed at init). A KV cache keeps each key rotated with the set of its
    own step (as HF: keys cached with the short factors are not rotated
    again), so decoding matches a full forward only while the whole
    sequence stays on one side of ``O``: ``L <= O`` throughout, or (a
    prompt already longer than ``O``) ``L > O`` from the first step.

  ``sections`` (M-RoPE) does not change the frequencies, only which
  position each one turns by: frequency ``i`` takes the position axis
  ``a`` with ``sum(sections[:a]) <= i < sum(sections[:a + 1])`` (HF
  Qwen2-VL's ``mrope_section`` split, ``m[i % 3]``, then ``cat((freq,
  freq))`` for the half-split layout; GLM-4V's ``repeat_interleave(2)``
  for the interleaved one: pair ``i`` either way).

  ``section_frequencies="per_section"`` (axial RoPE of vision encoders)
  does change them: pair ``i`` of section ``a`` (start ``s = sum(sections[
  :a])``, size ``n = sections[a]``) turns at ``base**(-2 (i - s) / (2 n))
  = base**(-(i - s) / n)``, the frequencies of a 1-D RoPE of rotary dim
  ``2 n``, by position axis ``a``. Each axis so gets the full range of
  wavelengths, from 1 down to ``base**(-(n - 1) / n)``. HF's vision towers
  (``compute_axial_rope_parameters``: ``base**(-arange(0, R / 2, 2) /
  (R / 2))`` for height and width alike, recomposed ``cat((h, w))`` then
  ``cat((hw, hw))``) are the case ``sections=(R / 4, R / 4)``, and
  MiniMax-M3-VL's 3-D one (time, height, width; the tail of the head
  unrotated) is ``sections=(n, n, n)``, ``n = (H // 3) // 2``, with
  ``fraction=6 n / H``. Unequal sections follow the same rule, a 1-D
  RoPE per section (no HF model uses them).

  Attributes:
    base: the wavelength base, a positive number (10000 in the paper; Llama
      3 uses 500000).
    scaling: one of ``SCALINGS``: ``"none"``, ``"linear"``, ``"dynamic"``,
      ``"llama3"``, ``"yarn"``, ``"longrope"`` (HF's ``rope_type``).
    factor: the scaling factor ``s`` (``rope_scaling["factor"]``), >= 1,
      used as given (an HF config that derives it from
      ``max_position_embeddings / original_max_position_embeddings`` means
      that ratio: Phi-3 / Phi-4 longrope configs give no ``factor``, so
      pass that ratio, e.g. ``131072 / 4096 = 32.0``). Must stay 1 with
      ``scaling="none"``. ``"longrope"`` reads it only for its default
      magnitude: it needs ``factor > 1`` or ``attention_factor``, not both.
    original_max_positions: ``O``, the context the model was trained at
      (HF's ``original_max_position_embeddings``; for ``"dynamic"`` HF
      reads ``max_position_embeddings``); required by dynamic, llama3,
      yarn and longrope, refused by the others.
    low_freq_factor, high_freq_factor: llama3's band edges
      (``high_freq_factor > low_freq_factor > 0``; 1 and 4 in Llama 3.1).
    beta_fast, beta_slow: yarn's rotation counts bounding the ramp
      (``beta_fast >= beta_slow > 0``; 32 and 1 in the paper).
    attention_factor: the magnitude of yarn or longrope, positive. None:
      yarn's ``mscale / mscale_all_dim`` if given, else ``0.1 ln(factor) +
      1``; longrope's ``sqrt(1 + ln(factor) / ln(O))``; both 1 if
      ``factor <= 1``.
    short_factor, long_factor: longrope's divisors of the ``R / 2``
      frequencies (HF's ``rope_scaling`` lists of the same names; lists are
      kept as tuples, so the ``Rope`` stays hashable), positive; required
      by longrope, refused by the others. Their length must be ``R / 2``
      for the head dim they are applied to (checked there: ``R`` depends
      on ``H``).
    truncate: yarn: floor/ceil the correction range (HF's default; gpt-oss
      sets False).
    mscale, mscale_all_dim: DeepSeek's yarn magnitude, both or neither:
      ``get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)``
      with ``get_mscale(s, m) = 0.1 m ln(s) + 1`` (1 for ``s <= 1``), as
      HF. DeepSeek also multiplies the softmax scale by
      ``get_mscale(factor, mscale_all_dim)**2``: that is the attention's
      ``scale=``, not part of the rotary embedding.
    fraction: partial rotary, the share of the head dim rotated, in
      ``(0, 1]``: the first ``rotary_dim(H)`` features rotate (the
      magnitude too), the rest pass unchanged.
    interleaved: pairs ``(x[2i], x[2i + 1])`` (GPT-J, Meta's original
      llama) instead of the half-split ``(x[i], x[i + R/2])`` (HF llama,
      GPT-NeoX, flax, Gemma); pair ``i`` rotates by ``theta_i`` either way.
    sections: M-RoPE (HF's ``mrope_section``), positive ints summing to
      ``R / 2`` (checked where ``H`` is known), e.g. ``(16, 24, 24)`` for
      Qwen2-VL's ``H = 128``; None: plain positions. With it, positions
      have a leading axis of ``len(sections)`` (see ``apply_rope``).
      Refused with ``"dynamic"`` and ``"longrope"``: their frequencies
      follow ``max(positions) + 1``, which over time, height and width
      axes is no sequence length (and no checkpoint combines them).
    section_frequencies: ``"split"`` (default; M-RoPE: the sections cut
      the one ladder ``theta_i``) or ``"per_section"`` (axial vision
      RoPE: each section its own ladder ``base**(-j / n)``, ``j < n``, as
      a 1-D RoPE of rotary dim ``2 n``; Qwen2-VL's vision tower is
      ``sections=(H / 4, H / 4)``, positions (height, width)). Needs
      ``sections``; ``"per_section"`` needs ``scaling="none"`` (HF's axial
      rope has no scaling, and the scalings' per-frequency rules are
      defined over the one ladder).

  Raises:
    TypeError: a field of the wrong type (a number not a real Python
      number, a traced value, a flag not a bool, ``scaling`` not a string).
    ValueError: an unknown scaling, a value out of range, a field missing
      for the scaling, or set away from its default where the scaling does
      not read it.

  Example:
    >>> from attention_jax.scores.rope import Rope, apply_rope
    >>> rope = Rope(base=500000.0, scaling="llama3", factor=8.0,
    ...             original_max_positions=8192)
    >>> theta = rope.inverse_frequencies(128)  # float64 [R / 2]
    >>> plain = Rope(base=500000.0).inverse_frequencies(128)
    >>> bool(theta[0] == plain[0]), bool(theta[-1] == plain[-1] / 8)
    (True, True)
    >>> q = jnp.ones((1, 2, 4, 128))  # [B, N, T, H]
    >>> apply_rope(q, jnp.arange(4), rope=rope).shape
    (1, 2, 4, 128)
  """

  base: float = 10000.0
  scaling: str = "none"
  factor: float = 1.0
  original_max_positions: int | None = None
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  attention_factor: float | None = None
  truncate: bool = True
  fraction: float = 1.0
  interleaved: bool = False
  mscale: float | None = None
  mscale_all_dim: float | None = None
  short_factor: tuple[float, ...] | None = None
  long_factor: tuple[float, ...] | None = None
  sections: tuple[int, ...] | None = None
  section_frequencies: str = "split"

  def __post_init__(self):
    set_field = lambda name, value: object.__setattr__(self, name, value)
    scaling = self.scaling
    _check_choice("scaling", scaling, SCALINGS, " ('none' for plain RoPE)",
                  f"use one of {', '.join(map(repr, SCALINGS))}")
    # Types first (normalised, so equal descriptions hash equal).
    for name in ("base", "factor", "low_freq_factor", "high_freq_factor",
                 "beta_fast", "beta_slow", "fraction"):
      set_field(name, _check_number(name, getattr(self, name)))
    for name in ("attention_factor", "mscale", "mscale_all_dim"):
      if getattr(self, name) is not None:
        set_field(name, _check_number(name, getattr(self, name)))
    for name in ("truncate", "interleaved"):
      set_field(name, _check_bool(name, getattr(self, name)))
    # Lists (as in HF configs) become tuples: hashable, and equal to the
    # same factors given as a tuple.
    for name in ("short_factor", "long_factor"):
      if getattr(self, name) is not None:
        set_field(name, _check_factors(name, getattr(self, name)))
    if self.sections is not None:
      set_field("sections", _check_sections(self.sections))
    original = self.original_max_positions
    if original is not None:
      if isinstance(original, jax.core.Tracer):
        raise TypeError("original_max_positions must be a Python int, got a "
                        "traced value: close over it.")
      checks.check_positive_int("original_max_positions", original)
      set_field("original_max_positions", int(original))

    if self.base <= 0.0:
      raise ValueError(f"base must be positive, got {self.base}.")
    if not 0.0 < self.fraction <= 1.0:
      raise ValueError(f"fraction must be in (0, 1], got {self.fraction}.")
    for field in dataclasses.fields(self):
      users = _USED_BY.get(field.name, ())
      value = getattr(self, field.name)
      if users and scaling not in users and value != field.default:
        raise ValueError(
            f"{field.name}={value!r} has no effect with scaling={scaling!r} "
            f"(read by scaling {' / '.join(map(repr, users))}): choose one of "
            f"those or leave {field.name} at its default {field.default!r}.")
    if self.sections is not None and scaling in _LENGTH_DEPENDENT:
      raise ValueError(
          f"sections={self.sections} with scaling={scaling!r} is not "
          f"supported: its frequencies follow max(positions) + 1, which over "
          f"multimodal positions (time, height, width) is no sequence "
          f"length. Use sections with scaling 'none', 'linear', 'llama3' or "
          f"'yarn', or drop sections.")
    self._check_section_frequencies()
    if scaling == "none":
      return
    if self.factor < 1.0:
      raise ValueError(
          f"scaling={scaling!r} needs factor >= 1 (the context extension: "
          f"{_FACTOR_ROLE[scaling]}), got factor={self.factor}.")
    if scaling in _USED_BY["original_max_positions"] and original is None:
      raise ValueError(
          f"scaling={scaling!r} needs original_max_positions: the context "
          f"length the model was trained at (HF rope_scaling's "
          f"original_max_position_embeddings), e.g. 8192.")
    if scaling == "llama3" and not (
        0.0 < self.low_freq_factor < self.high_freq_factor):
      raise ValueError(
          f"scaling='llama3' needs high_freq_factor > low_freq_factor > 0 "
          f"(the band of wavelengths between O / high_freq_factor and "
          f"O / low_freq_factor is blended), got low_freq_factor="
          f"{self.low_freq_factor}, high_freq_factor={self.high_freq_factor}.")
    if scaling == "yarn":
      self._check_yarn()
    if scaling == "longrope":
      self._check_longrope()

  def _check_section_frequencies(self):
    value = self.section_frequencies
    _check_choice(
        "section_frequencies", value, SECTION_FREQUENCIES, "",
        "use 'split' (M-RoPE, Qwen2-VL's mrope_section: one frequency ladder "
        "over R / 2 cut into the sections) or 'per_section' (axial vision "
        "RoPE: a ladder per section)")
    if value == "split":
      return
    if self.sections is None:
      # Without sections there is one axis and one ladder: the value would
      # be accepted and ignored.
      raise ValueError(
          f"section_frequencies={value!r} needs sections: the sizes (in "
          f"rotated pairs) of the axes that get a ladder each, e.g. "
          f"sections=(20, 20) with positions [2, ..., T] (height, width) for "
          f"Qwen2-VL's vision head dim 80; or leave section_frequencies "
          f"'split'.")
    if self.scaling != "none":
      fix = (" (for 'linear', divide the positions by factor instead)"
             if self.scaling == "linear" else "")
      raise ValueError(
          f"section_frequencies='per_section' with scaling={self.scaling!r} "
          f"is not supported: HF's axial vision rope has no scaling, and "
          f"the scalings' per-frequency rules are defined over the one "
          f"ladder of R / 2 frequencies, not per section. Use "
          f"scaling='none'{fix}, or section_frequencies='split'.")

  def _check_longrope(self):
    missing = [name for name in ("short_factor", "long_factor")
               if getattr(self, name) is None]
    if missing:
      raise ValueError(
          f"scaling='longrope' needs {' and '.join(missing)}: the R / 2 "
          f"divisors of the frequencies (HF rope_scaling's short_factor, used "
          f"while the sequence fits original_max_positions, and long_factor, "
          f"past it).")
    if self.attention_factor is not None:
      if self.attention_factor <= 0.0:
        raise ValueError(f"attention_factor must be positive, got "
                         f"{self.attention_factor}.")
      if self.factor != 1.0:
        raise ValueError(
            f"scaling='longrope' reads factor only for its default magnitude, "
            f"and attention_factor={self.attention_factor} replaces it: drop "
            f"factor={self.factor} (or attention_factor).")
      return
    if self.factor == 1.0:
      # factor's default would silently drop the magnitude of a model
      # extended past O (Phi-3's configs give no factor: HF derives it).
      raise ValueError(
          "scaling='longrope' needs factor > 1 (its default magnitude is "
          "sqrt(1 + ln(factor) / ln(original_max_positions))): for Phi-3 / "
          "Phi-4 pass factor=max_position_embeddings / "
          "original_max_position_embeddings, e.g. 131072 / 4096 = 32.0; or "
          "give the magnitude itself as attention_factor (1.0 for none).")
    if self.original_max_positions < 2:
      raise ValueError(
          f"scaling='longrope' with factor={self.factor} divides by "
          f"ln(original_max_positions), which is 0 at original_max_positions"
          f"={self.original_max_positions}: give the trained context (e.g. "
          f"4096) or attention_factor.")

  def _check_longrope_dim(self, rot: int, head_dim: int | None = None):
    """LongRoPE's factor lists must have one entry per rotated pair."""
    where = (f" (head dim H={head_dim}, fraction={self.fraction})"
             if head_dim is not None else "")
    for name in ("short_factor", "long_factor"):
      n = len(getattr(self, name))
      if n != rot // 2:
        raise ValueError(
            f"{name} has {n} entries, but the rotary dim R={rot}{where} has "
            f"R / 2 = {rot // 2} frequencies: give one factor per frequency "
            f"(HF: head_dim * partial_rotary_factor / 2).")

  def _check_sections_dim(self, rot: int, head_dim: int | None = None):
    """M-RoPE's sections must split the rotated pairs exactly."""
    if self.sections is None or sum(self.sections) == rot // 2:
      return
    where = (f" (head dim H={head_dim}, fraction={self.fraction})"
             if head_dim is not None else "")
    raise ValueError(
        f"sections={self.sections} sum to {sum(self.sections)}, but the "
        f"rotary dim R={rot}{where} has R / 2 = {rot // 2} frequencies: the "
        f"sections must split them exactly (Qwen2-VL: (16, 24, 24) for "
        f"H=128).")

  def _check_yarn(self):
    if self.base <= 1.0:
      raise ValueError(
          f"scaling='yarn' needs base > 1 (its correction range divides by "
          f"ln(base)), got base={self.base}.")
    if not 0.0 < self.beta_slow <= self.beta_fast:
      raise ValueError(
          f"scaling='yarn' needs beta_fast >= beta_slow > 0 (rotation counts: "
          f"beta_fast bounds the extrapolated dims, beta_slow the "
          f"interpolated), got beta_fast={self.beta_fast}, "
          f"beta_slow={self.beta_slow}.")
    if (self.mscale is None) != (self.mscale_all_dim is None):
      given = "mscale" if self.mscale is not None else "mscale_all_dim"
      raise ValueError(
          f"{given} without {'mscale_all_dim' if given == 'mscale' else 'mscale'}"
          f": give both (the magnitude is their get_mscale ratio; HF ignores a "
          f"lone one) or neither.")
    if self.attention_factor is not None and self.mscale is not None:
      raise ValueError(
          "attention_factor and mscale/mscale_all_dim are both set, and "
          "attention_factor would override them: give one of the two.")
    if self.attention_factor is not None and self.attention_factor <= 0.0:
      raise ValueError(f"attention_factor must be positive, got "
                       f"{self.attention_factor}.")
    if self.magnitude <= 0.0:
      raise ValueError(
          f"mscale={self.mscale}, mscale_all_dim={self.mscale_all_dim} give a "
          f"magnitude of {self.magnitude} at factor={self.factor}; it must be "
          f"positive.")

  def rotary_dim(self, head_dim: int) -> int:
    """Features rotated for head dim ``H``: ``int(H * fraction)``, even.

    Raises:
      TypeError: ``head_dim`` not an int.
      ValueError: ``head_dim <= 0``, or no feature rotates (raise
        ``fraction``).
    """
    checks.check_positive_int("head_dim", head_dim)
    return _rotary_dim(int(head_dim), self.fraction)

  @property
  def magnitude(self) -> float:
    """The factor multiplied into cos and sin: YaRN's or LongRoPE's, else 1.

    Attention scores between rotated queries and keys scale by its square.
    """
    if self.scaling not in ("yarn", "longrope"):
      return 1.0
    if self.attention_factor is not None:
      return self.attention_factor
    if self.scaling == "longrope":  # HF's default, from the LongRoPE paper
      if self.factor <= 1.0:
        return 1.0
      return math.sqrt(1.0 + math.log(self.factor)
                       / math.log(self.original_max_positions))
    if self.mscale is not None:
      return (_get_mscale(self.factor, self.mscale)
              / _get_mscale(self.factor, self.mscale_all_dim))
    return _get_mscale(self.factor)

  #: The same as ``magnitude`` (HF calls it ``attention_factor``).
  attention_factor_value = magnitude

  def inverse_frequencies(self, rotary_dim: int, seq_len=None):
    """The angle per unit position of each rotated pair, ``[R / 2]``.

    With ``section_frequencies="per_section"``: the sections' own ladders
    concatenated, pair ``i`` at its place (``base**(-(i - s) / n)`` in the
    section of start ``s`` and size ``n``), each turned by its section's
    position axis.

    Args:
      rotary_dim: ``R``, the features rotated (``rotary_dim(H)``), even.
      seq_len: the length ``L`` the frequencies are chosen for (HF:
        ``max(position_ids) + 1``): required by ``"dynamic"``;
        ``"longrope"`` takes ``long_factor`` when ``L >
        original_max_positions``, else (and for None, as HF's init)
        ``short_factor``. The other scalings do not depend on it.

    Returns:
      float64 NumPy ``[R / 2]``; for ``"dynamic"`` or ``"longrope"`` with a
      JAX array ``seq_len`` (concrete or traced), a ``jnp`` array in the
      default float dtype (float32 unless ``jax_enable_x64``).

    Raises:
      TypeError: ``rotary_dim`` not an int, ``seq_len`` not a number or a
        scalar array.
      ValueError: ``rotary_dim`` odd or not positive; ``"dynamic"`` without
        ``seq_len`` or with ``R = 2`` (its exponent ``R / (R - 2)``);
        ``short_factor``/``long_factor`` without ``R / 2`` entries;
        ``sections`` not summing to ``R / 2``.
    """
    rot = _check_rotary_dim(rotary_dim)
    self._check_sections_dim(rot)
    if self.section_frequencies == "per_section":  # scaling is "none"
      # A 1-D RoPE of rotary dim 2 n per section, concatenated: pair i
      # keeps its place, so apply_rope's section split reads it unchanged.
      return np.concatenate([_plain_theta(self.base, 2 * n)
                             for n in self.sections])
    theta = _plain_theta(self.base, rot)
    if self.scaling == "longrope":
      self._check_longrope_dim(rot)
      if seq_len is None:
        return theta / np.asarray(self.short_factor)
      if isinstance(seq_len, (jax.Array, jax.core.Tracer)):
        _check_seq_len_array(seq_len)
        dtype = jax.dtypes.canonicalize_dtype(jnp.float64)
        return self._longrope(theta, seq_len, dtype)
      long = _check_number("seq_len", seq_len) > self.original_max_positions
      return theta / np.asarray(self.long_factor if long
                                else self.short_factor)
    if self.scaling == "none":
      return theta
    if self.scaling == "linear":
      return theta / self.factor
    if self.scaling == "llama3":
      return self._llama3(theta)
    if self.scaling == "yarn":
      return self._yarn(theta, rot)
    if seq_len is None:
      raise ValueError(
          "scaling='dynamic' needs seq_len: its frequencies depend on the "
          "longest position (apply_rope uses max(positions) + 1).")
    self._check_dynamic_dim(rot)
    if isinstance(seq_len, (jax.Array, jax.core.Tracer)):
      _check_seq_len_array(seq_len)
      dtype = jax.dtypes.canonicalize_dtype(jnp.float64)
      return self._dynamic(theta, rot, seq_len, dtype)
    length = _check_number("seq_len", seq_len)
    original = self.original_max_positions
    length = max(length, original)  # at or below O: unscaled, as HF
    base = self.base * (self.factor * length / original
                        - (self.factor - 1.0)) ** (rot / (rot - 2))
    return _plain_theta(base, rot)

  def _check_dynamic_dim(self, rot: int) -> None:
    if rot < 4:
      raise ValueError(
          f"scaling='dynamic' needs a rotary dim R >= 4 (its base exponent "
          f"R / (R - 2) is undefined at R = 2), got R={rot}: raise the head "
          f"dim or fraction.")

  def _llama3(self, theta: np.ndarray) -> np.ndarray:
    original, factor = self.original_max_positions, self.factor
    low_wavelen = original / self.low_freq_factor
    high_wavelen = original / self.high_freq_factor
    wavelen = 2.0 * np.pi / theta
    out = np.where(wavelen > low_wavelen, theta / factor, theta)
    smooth = ((original / wavelen - self.low_freq_factor)
              / (self.high_freq_factor - self.low_freq_factor))
    # HF's band: neither shorter than high nor longer than low (ends kept).
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    blended = (1.0 - smooth) * theta / factor + smooth * theta
    return np.where(medium, blended, out)

  def _yarn(self, theta: np.ndarray, rot: int) -> np.ndarray:
    original = self.original_max_positions

    def correction_dim(rotations):  # the dim turning `rotations` times in O
      return (rot * math.log(original / (rotations * 2.0 * math.pi))
              / (2.0 * math.log(self.base)))

    low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
    if self.truncate:
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot - 1)
    if low == high:
      high += 0.001  # HF's guard against a zero-width ramp
    ramp = np.clip((np.arange(rot // 2, dtype=np.float64) - low)
                   / (high - low), 0.0, 1.0)
    extrapolation = 1.0 - ramp  # 1: the dim keeps its frequency
    return (theta / self.factor * (1.0 - extrapolation)
            + theta * extrapolation)

  def _longrope(self, theta: np.ndarray, seq_len, dtype):
    """LongRoPE's frequencies on device: ``seq_len`` may be traced.

    Both sets are float64 constants rounded once to ``dtype``; the scalar
    comparison picks one for every position (HF's ``torch.where``).
    """
    short = jnp.asarray(theta / np.asarray(self.short_factor), dtype)
    long = jnp.asarray(theta / np.asarray(self.long_factor), dtype)
    return jnp.where(jnp.asarray(seq_len) > self.original_max_positions,
                     long, short)

  def _dynamic(self, theta: np.ndarray, rot: int, seq_len, dtype):
    """Dynamic NTK frequencies on device: ``seq_len`` may be traced.

    ``base' ** (-2i/R) = theta_i * scale ** (-2i / (R - 2))`` with
    ``scale = factor * L / O - (factor - 1)``: the static part stays exact
    (float64, rounded once); only the correction is computed in ``dtype``.
    """
    original = float(self.original_max_positions)
    length = jnp.maximum(jnp.asarray(seq_len, dtype), original)
    scale = self.factor * length / original - (self.factor - 1.0)
    exponent = jnp.asarray(
        -2.0 * np.arange(rot // 2, dtype=np.float64) / (rot - 2), dtype)
    return jnp.asarray(theta, dtype) * jnp.exp(exponent * jnp.log(scale))


def _check_seq_len_array(seq_len) -> None:
  dtype = jnp.result_type(seq_len)
  if np.ndim(seq_len) != 0 or not (jnp.issubdtype(dtype, jnp.integer)
                                   or jnp.issubdtype(dtype, jnp.floating)):
    raise TypeError(
        f"seq_len must be a number or a scalar integer/float array, got "
        f"dtype {dtype} with shape {checks.shape_of(seq_len)}.")


def as_rope(value) -> Rope | None:
  """A ``rope=`` option checked: None (no rotary embedding) or a ``Rope``.

  Raises:
    TypeError: anything else, with the ``Rope`` to write for a number
      (``rope=10000.0`` is ``Rope(base=10000.0)``) or a scaling's name.

  Example:
    >>> from attention_jax.scores.rope import Rope, as_rope
    >>> as_rope(Rope(base=500.0)) == Rope(base=500.0), as_rope(None)
    (True, None)
  """
  if value is None or isinstance(value, Rope):
    return value
  hint = ("pass None (no rotary embedding) or a Rope, e.g. Rope(base="
          "500000.0, scaling='llama3', factor=8.0, original_max_positions="
          "8192)")
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"rope={value!r} is a bool, not a rotary embedding: "
                    f"{hint}.")
  if isinstance(value, (int, float, np.integer, np.floating)):
    raise TypeError(f"rope={value!r} is a number: the rotary base goes in "
                    f"the Rope, rope=aj.Rope(base={float(value)!r}).")
  if isinstance(value, str):
    fix = (f"Rope(scaling={value!r}, ...)" if value in SCALINGS
           else f"Rope(...) (scalings: {', '.join(map(repr, SCALINGS))})")
    raise TypeError(f"rope={value!r} is a string: describe the embedding "
                    f"with {fix}.")
  if isinstance(value, (jax.Array, jax.core.Tracer, np.ndarray)):
    raise TypeError(
        f"rope must be static, got an array of shape "
        f"{checks.shape_of(value)}: {hint}.")
  raise TypeError(f"rope={value!r} ({type(value).__name__}) is not a rotary "
                  f"embedding: {hint}.")


def apply_rope(x: ArrayLike, positions: ArrayLike, *,
               rope: Rope | None = None,
               seq_len: ArrayLike | None = None) -> jax.Array:
  """Rotates the features of ``x`` by angles proportional to ``positions``.

  Convention ("half-split", as in Gemma, flax, HF llama and most
  llama-in-JAX code): with ``R = int(H * rope.fraction)`` rounded down to
  even and ``h = R / 2``, feature ``i < h`` is paired with feature ``i + h``
  and the pair is rotated by the angle ``p * theta_i`` for position ``p``
  (``theta_i = rope.base**(-2 i / R)`` without scaling)::

    out[i]     = x[i] * cos - x[i + h] * sin
    out[i + h] = x[i + h] * cos + x[i] * sin

  Features ``R:`` (partial rotary, ``Rope(fraction < 1)``) pass unchanged.
  Checkpoints trained with interleaved pairs ``(x[2i], x[2i + 1])`` (GPT-J,
  ``rotate_every_two``, Meta's original llama) use
  ``rope=Rope(interleaved=True)``: pair ``i`` is then ``(x[2i], x[2i + 1])``
  rotated by ``theta_i``. ``rope=Rope(...)`` also gives the context-extension
  scalings (linear, dynamic NTK, llama3, YaRN, LongRoPE; see ``Rope``);
  the ``magnitude`` of YaRN and LongRoPE multiplies cos and sin, so it
  scales the rotated features only. ``Rope(sections=...)`` (M-RoPE) takes
  one position per section: pair ``i`` turns by the position of the
  section that contains ``i``; with ``section_frequencies="per_section"``
  (axial vision RoPE) at its section's own frequencies (see ``Rope``).

  Frequencies are float64 NumPy constants (dynamic NTK's, which depend on
  the positions, are computed on device, and LongRoPE's choice between its
  two sets is made there); angles, cos and sin and the
  rotation are computed in float32 (float64 for float64 ``x``, which needs
  ``jax_enable_x64``); the result is cast back to ``x``'s dtype. float32
  angles lose absolute precision at large positions (about ``p * 1.2e-7``
  radians).

  Args:
    x: float ``[..., T, H]`` (e.g. queries or keys ``[B, N, T, H]``), ``H``
      even.
    positions: integer or float ``[..., T]``, broadcastable to
      ``x.shape[:-1]`` without growing it: ``[T]`` shared by the batch,
      ``[B, 1, T]`` per example for ``[B, N, T, H]``, ``[B, N, T]``, or a
      scalar position for every token. With ``rope.sections``: ``[P, ...,
      T]``, ``P = len(sections)`` (Qwen2-VL: time, height, width), then one
      axis per axis of ``x.shape[:-1]``, each equal or 1 (e.g. ``[3, B, 1,
      T]`` for ``[B, N, T, H]``, ``pos[:, :, None]`` of HF's ``[3, B,
      T]``): all of ``x.ndim`` axes, so that plain ``[B, ..., T]``
      positions with ``B == P`` are refused, never read as sections.
    rope: the embedding (``Rope``: base, fraction, scaling, layout); None:
      ``Rope()``, the paper's (base 10000, every feature rotated).
    seq_len: ``scaling="dynamic"`` or ``"longrope"`` only: the length
      ``L`` their frequencies are chosen for (a number or a scalar array,
      may be traced); None: ``max(positions) + 1`` over the whole array, as
      HF. Give queries and keys rotated in separate calls the same one.

  Returns:
    ``x`` rotated, same shape and dtype.

  Raises:
    TypeError: ``x`` not floating point, ``positions`` not integer or
      float, ``rope`` not a ``Rope``.
    ValueError: odd ``H``, ``x`` of rank < 2, ``positions`` not
      broadcastable (or, with ``sections``, without the leading axis of
      ``len(sections)`` and ``x.ndim`` axes in all), a fraction rotating no
      features, ``seq_len``
      given without dynamic or longrope scaling, ``short_factor`` /
      ``long_factor`` without ``R / 2`` entries, ``sections`` not summing
      to ``R / 2``.

  Example:
    >>> from attention_jax.scores.rope import Rope, apply_rope
    >>> q = jnp.ones((1, 2, 4, 8))  # [B, N, T, H]
    >>> out = apply_rope(q, jnp.arange(4))  # positions [T]
    >>> out.shape, out.dtype
    ((1, 2, 4, 8), dtype('float32'))
    >>> bool(jnp.all(out[:, :, 0] == q[:, :, 0]))  # position 0: identity
    True
    >>> apply_rope(jnp.array([[1.0, 0.0]]), jnp.array([1]), rope=Rope(base=1.0))
    Array([[0.5403023 , 0.84147096]], dtype=float32)
    >>> long = Rope(base=500000.0, scaling="llama3", factor=8.0,
    ...             original_max_positions=8192, interleaved=True)
    >>> apply_rope(q, jnp.arange(4), rope=long).shape
    (1, 2, 4, 8)
    >>> mrope = Rope(sections=(2, 1, 1))  # R / 2 = 4 frequencies
    >>> thw = jnp.stack([jnp.arange(4)] * 3)[:, None, None, :]  # [3, 1, 1, T]
    >>> bool(jnp.allclose(apply_rope(q, thw, rope=mrope),
    ...                   apply_rope(q, jnp.arange(4))))  # text: plain RoPE
    True
    >>> axial = Rope(sections=(2, 2), section_frequencies="per_section")
    >>> axial.inverse_frequencies(8)  # a ladder over 2 pairs per axis
    array([1.  , 0.01, 1.  , 0.01])
    >>> hw = jnp.array([[0, 0, 1, 1], [0, 1, 0, 1]])[:, None, None, :]
    >>> apply_rope(q, hw, rope=axial).shape  # (h, w) of a 2 x 2 grid
    (1, 2, 4, 8)
  """
  x = checks.as_array_operand("x", x, "[..., T, H]")
  checks.check_float_array("x", x)
  checks.check_min_rank("x", x, 2, "[..., T, H]")
  x = jnp.asarray(x)
  head_dim = x.shape[-1]
  if head_dim % 2:
    raise ValueError(f"x must have an even head dim H (features are rotated "
                     f"in pairs), got shape {x.shape} with H={head_dim}.")
  rope = Rope() if rope is None else as_rope(rope)
  rot = _rotary_dim(head_dim, rope.fraction)
  rope._check_sections_dim(rot, head_dim)
  if rope.scaling == "longrope":
    rope._check_longrope_dim(rot, head_dim)
  if seq_len is not None and rope.scaling not in _LENGTH_DEPENDENT:
    raise ValueError(
        f"seq_len chooses dynamic NTK frequencies, and this rope has "
        f"scaling={rope.scaling!r}: leave seq_len None or use "
        f"scaling='dynamic' (or 'longrope', whose factor set it picks).")

  if positions is None:
    raise TypeError("positions is None: pass integer positions [..., T].")
  if isinstance(positions, (list, tuple)):
    positions = np.asarray(positions)
  pos_dtype = jnp.result_type(positions)
  if not (jnp.issubdtype(pos_dtype, jnp.integer)
          or jnp.issubdtype(pos_dtype, jnp.floating)):
    raise TypeError(
        f"positions must be an integer or float array [..., T], got dtype "
        f"{pos_dtype} with shape {checks.shape_of(positions)}.")
  pos_shape = checks.shape_of(positions)
  if rope.sections is not None:
    _check_section_positions(rope.sections, pos_shape, x.shape)
  elif len(pos_shape) >= x.ndim:
    raise ValueError(
        f"positions with shape {pos_shape} is not broadcastable to "
        f"x.shape[:-1] ([..., T]) = {x.shape[:-1]}: it has more axes. "
        f"Multimodal positions [P, ..., T] need Rope(sections=...).")
  else:
    checks.check_broadcastable_to("positions", pos_shape, x.shape[:-1],
                                  "x.shape[:-1] ([..., T])")

  compute = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
  half = rot // 2
  lead = x.ndim - 1
  pos = jnp.asarray(positions).astype(compute)
  if rope.scaling in _LENGTH_DEPENDENT:
    if seq_len is None:
      # HF's max(position_ids) + 1; an empty call leaves the base as is
      # (dynamic) and takes the short factors (longrope).
      seq_len = jnp.max(pos, initial=-1.0) + 1.0
    elif not isinstance(seq_len, (jax.Array, jax.core.Tracer)):
      seq_len = _check_number("seq_len", seq_len)
    else:
      _check_seq_len_array(seq_len)
  theta = _plain_theta(rope.base, rot)
  if rope.scaling == "dynamic":
    rope._check_dynamic_dim(rot)
    inv_freq = rope._dynamic(theta, rot, seq_len, compute)
  elif rope.scaling == "longrope":
    inv_freq = rope._longrope(theta, seq_len, compute)
  else:
    # float64 NumPy (exact up to one final rounding), a program constant.
    inv_freq = jnp.asarray(rope.inverse_frequencies(rot), compute)
  inv_freq = inv_freq.reshape((1,) * lead + (half,))  # [1, ..., 1, h]
  if rope.sections is None:
    pos = pos.reshape((1,) * (lead - pos.ndim) + pos.shape)[..., None]
  else:
    # Pair i reads the position axis of its section: [P, ..., T] -> [..., T,
    # h], then the same product as plain RoPE (HF multiplies every axis by
    # every frequency and keeps, per frequency, its section's axis).
    axis_of = np.repeat(np.arange(len(rope.sections)), rope.sections)
    pos = jnp.moveaxis(jnp.take(pos, axis_of, axis=0), 0, -1)
  angle = pos * inv_freq  # [..., T, h] (leading dims of 1 where shared)
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  magnitude = rope.magnitude
  if magnitude != 1.0:  # YaRN, LongRoPE: on cos and sin, so rotated only
    cos, sin = cos * magnitude, sin * magnitude

  if rope.interleaved:
    pairs = x[..., :rot].astype(compute).reshape(x.shape[:-1] + (half, 2))
    x1, x2 = pairs[..., 0], pairs[..., 1]  # [..., T, h] each
    rotated = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin],
                        axis=-1).reshape(x.shape[:-1] + (rot,))
  else:
    x1 = x[..., :half].astype(compute)
    x2 = x[..., half:rot].astype(compute)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin],
                              axis=-1)
  rotated = rotated.astype(x.dtype)
  if rot == head_dim:
    return rotated
  return jnp.concatenate([rotated, x[..., rot:]], axis=-1)


def _check_section_positions(sections, pos_shape, x_shape) -> None:
  """M-RoPE positions: ``[P, ...]`` with ``x.ndim`` axes in all."""
  n = len(sections)
  if len(pos_shape) != len(x_shape) or pos_shape[0] != n:
    lead = ", ".join(["1"] * (len(x_shape) - 2) + ["T"])
    raise ValueError(
        f"rope.sections={sections} needs multimodal positions [{n}, ..., T]: "
        f"a leading axis of len(sections)={n} (one position per section, "
        f"e.g. time, height, width), then one axis per axis of x.shape[:-1]"
        f" = {tuple(x_shape[:-1])}, each equal or 1 ({len(x_shape)} axes, "
        f"e.g. [{n}, {lead}]); got positions of shape {pos_shape}. Text "
        f"tokens repeat one position on every axis. "
        f"aj.multi_head_attention needs them passed explicitly, positions "
        f"[{n}, B, T] while decoding too: its default positions (arange, "
        f"segments, a cache's) are plain.")
  checks.check_broadcastable_to("positions", pos_shape[1:], x_shape[:-1],
                                "x.shape[:-1] ([..., T])",
                                full_shape=pos_shape)


def _plain_theta(base: float, rot: int) -> np.ndarray:
  """``base**(-2 i / R)`` in float64, ``[R / 2]``."""
  return base ** (-2.0 * np.arange(rot // 2, dtype=np.float64) / rot)


def segment_positions(segment_ids: ArrayLike) -> jax.Array:
  """Positions that restart at 0 at each new segment along the last axis.

  A segment is a run: a maximal block of equal consecutive ids, so
  ``[0, 0, 1, 1, 0]`` has three segments (positions ``[0, 1, 0, 1, 0]``).
  Padding tokens get positions like any other run; mask them out of the
  attention as usual. Vectorised: the start index of each run is carried
  forward with a cumulative maximum.

  Args:
    segment_ids: integer ``[..., T]`` ids of packed documents (e.g. ``[T]``
      or ``[B, T]``).

  Returns:
    int32 ``[..., T]``: each token's offset from the start of its run.
    Pass ``positions[:, None, :]`` to ``apply_rope`` for ``[B, N, T, H]``.

  Raises:
    TypeError: ``segment_ids`` not an integer array.
    ValueError: ``segment_ids`` a scalar.

  Example:
    >>> from attention_jax.scores.rope import segment_positions
    >>> segment_positions(jnp.array([3, 3, 3, 7, 7, 1]))
    Array([0, 1, 2, 0, 1, 0], dtype=int32)
  """
  if segment_ids is None:
    raise TypeError("segment_ids is None: pass integer ids [..., T].")
  if isinstance(segment_ids, (list, tuple)):
    segment_ids = np.asarray(segment_ids)
  dtype = jnp.result_type(segment_ids)
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(
        f"segment_ids must be an integer array [..., T], got dtype {dtype} "
        f"with shape {checks.shape_of(segment_ids)}.")
  checks.check_min_rank("segment_ids", segment_ids, 1, "[..., T]")
  ids = jnp.asarray(segment_ids)
  t = ids.shape[-1]
  index = jnp.arange(t, dtype=jnp.int32).reshape((1,) * (ids.ndim - 1) + (t,))
  first = jnp.ones(ids.shape[:-1] + (min(t, 1),), jnp.bool_)
  starts = jnp.concatenate([first, ids[..., 1:] != ids[..., :-1]], axis=-1)
  run_start = jax.lax.cummax(jnp.where(starts, index, 0), axis=ids.ndim - 1)
  return index - run_start
