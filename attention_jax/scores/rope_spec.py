"""``Rope``: the one description of a rotary position embedding.

Shape glossary: H head dim, R rotated features (the rotary dim,
``Rope.rotary_dim(H)``); frequency arrays are ``[R / 2]``, one per rotated
pair.

A frozen, hashable dataclass (a static argument under ``jax.jit``): the
base (Hunyuan's fixed NTK-alpha growth of it), the context-extension
scaling of the frequencies (HF's ``rope_type``), the layout (partial,
interleaved) and the multimodal sections (blocked or interleaved).
Building one checks every field and the rules between them (a field its
scaling does not read is refused, not ignored); ``inverse_frequencies``
picks the scaling's maths in ``rope_frequencies``.
Applying it to arrays (and checking a ``rope=`` option) is
``rope_apply``'s; ``rope`` re-exports both.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.core import checks
from attention_jax.scores import rope_checks
from attention_jax.scores import rope_frequencies

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

# Scalings whose frequencies depend on the positions' maximum (apply_rope
# takes seq_len for them only): with multimodal positions that maximum
# mixes the time, height and width axes (none of them a sequence length),
# and no checkpoint combines them.
LENGTH_DEPENDENT = ("dynamic", "longrope")


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

  ``sections_interleaved=True`` (Qwen3-VL) keeps the frequencies and
  changes only the assignment: pairs ``1, 4, 7, ...`` (``sections[1]`` of
  them) turn by height, ``2, 5, 8, ...`` (``sections[2]``) by width, the
  rest (``sections[0]``) by time, spreading each axis over the whole
  range of wavelengths.

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
      ``(0, 1]``: the first ``rotary_dim(H) = int(H * fraction)`` features
      rotate (the magnitude too), the rest pass unchanged. That width must
      be even (pairs rotate): an odd one is refused where ``H`` is known
      (``apply_rope``, a layer when built), never rounded.
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
    sections_interleaved: Qwen3-VL's interleaved M-RoPE (HF's
      ``mrope_interleaved``, its ``recomposition_frequencies``) instead of
      Qwen2-VL's blocks: pair ``i`` turns by height for ``i = 1, 4, 7,
      ...`` below ``3 * sections[1]``, by width for ``i = 2, 5, 8, ...``
      below ``3 * sections[2]``, by time otherwise (``THWTHW...TT``).
      Needs exactly three ``sections`` whose height and width pairs fit
      in ``R / 2`` (``3 * sections[1] - 1 <= R / 2`` and ``3 *
      sections[2] <= R / 2``; HF's slice would drop the rest unsaid) and
      ``section_frequencies="split"``. The pair layout (half-split, as
      Qwen3-VL's ``rotate_half``, or ``interleaved``) is separate.
    ntk_alpha: Hunyuan's fixed NTK-aware base (HF's ``"ntk_alpha"``: a
      ``rope_scaling`` of type ``"dynamic"`` with an ``alpha``): the base
      becomes ``base * ntk_alpha**(R / (R - 2))``, ``R`` the rotary dim
      (HF's ``head_dim``: Hunyuan rotates it whole), for every length (no
      dependence on the positions). Positive; None: the base as given.
      Only with ``scaling="none"`` (it replaces the scaling: HF reads no
      ``factor`` then) and ``section_frequencies="split"``; needs ``R >=
      4``.

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
  sections_interleaved: bool = False
  ntk_alpha: float | None = None

  def __post_init__(self):
    set_field = lambda name, value: object.__setattr__(self, name, value)
    scaling = self.scaling
    rope_checks.check_choice(
        "scaling", scaling, SCALINGS, " ('none' for plain RoPE)",
        f"use one of {', '.join(map(repr, SCALINGS))}")
    # Types first (normalised, so equal descriptions hash equal).
    for name in ("base", "factor", "low_freq_factor", "high_freq_factor",
                 "beta_fast", "beta_slow", "fraction"):
      set_field(name, rope_checks.check_number(name, getattr(self, name)))
    for name in ("attention_factor", "mscale", "mscale_all_dim",
                 "ntk_alpha"):
      if getattr(self, name) is not None:
        set_field(name, rope_checks.check_number(name, getattr(self, name)))
    for name in ("truncate", "interleaved", "sections_interleaved"):
      set_field(name, rope_checks.check_bool(name, getattr(self, name)))
    # Lists (as in HF configs) become tuples: hashable, and equal to the
    # same factors given as a tuple.
    for name in ("short_factor", "long_factor"):
      if getattr(self, name) is not None:
        set_field(name, rope_checks.check_factors(name, getattr(self, name)))
    if self.sections is not None:
      set_field("sections", rope_checks.check_sections(self.sections))
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
    if self.sections is not None and scaling in LENGTH_DEPENDENT:
      raise ValueError(
          f"sections={self.sections} with scaling={scaling!r} is not "
          f"supported: its frequencies follow max(positions) + 1, which over "
          f"multimodal positions (time, height, width) is no sequence "
          f"length. Use sections with scaling 'none', 'linear', 'llama3' or "
          f"'yarn', or drop sections.")
    self._check_section_frequencies()
    self._check_sections_interleaved()
    self._check_ntk_alpha()
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
    rope_checks.check_choice(
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

  def _check_sections_interleaved(self):
    if not self.sections_interleaved:
      return
    if self.sections is None:
      raise ValueError(
          "sections_interleaved=True needs sections: Qwen3-VL's "
          "mrope_section (time, height, width), e.g. sections=(24, 20, 20) "
          "for H=128, with positions [3, ..., T]; or leave "
          "sections_interleaved False.")
    if self.section_frequencies != "split":
      raise ValueError(
          f"sections_interleaved=True with section_frequencies="
          f"{self.section_frequencies!r} is not supported: the interleaved "
          f"pattern (Qwen3-VL) cuts the one ladder over R / 2; per-section "
          f"ladders (axial vision RoPE) sit in blocks. Use one of the two.")
    rope_checks.check_sections_interleaved(self.sections)

  def _check_ntk_alpha(self):
    alpha = self.ntk_alpha
    if alpha is None:
      return
    if alpha <= 0.0:
      raise ValueError(
          f"ntk_alpha must be positive (the base grows by ntk_alpha**(R / "
          f"(R - 2))), got {alpha}: Hunyuan's rope_scaling alpha, e.g. "
          f"1000.0, or None for the base as given.")
    if self.scaling != "none" or self.section_frequencies != "split":
      what = (f"scaling={self.scaling!r}" if self.scaling != "none" else
              f"section_frequencies={self.section_frequencies!r}")
      raise ValueError(
          f"ntk_alpha={alpha} with {what} is not supported: ntk_alpha "
          f"replaces the scaling (HF turns a 'dynamic' rope_scaling with an "
          f"alpha into the fixed 'ntk_alpha' base and reads nothing else) "
          f"and is defined over the one ladder. Use scaling='none' (for a "
          f"Hunyuan config of type 'dynamic' with an alpha) and "
          f"section_frequencies='split', or drop ntk_alpha.")

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
    """Features rotated for head dim ``H``: ``int(H * fraction)`` (HF's
    ``int(head_dim * partial_rotary_factor)``).

    Raises:
      TypeError: ``head_dim`` not an int.
      ValueError: ``head_dim <= 0``, no feature rotates (raise
        ``fraction``), or an odd count (pairs rotate: the message gives the
        fractions and head dims that fit).
    """
    checks.check_positive_int("head_dim", head_dim)
    return rope_frequencies.rotary_dim(int(head_dim), self.fraction)

  @property
  def magnitude(self) -> float:
    """The factor multiplied into cos and sin: YaRN's or LongRoPE's, else 1.

    Attention scores between rotated queries and keys scale by its square.
    """
    if self.scaling not in ("yarn", "longrope"):
      return 1.0
    if self.attention_factor is not None:
      return self.attention_factor
    if self.scaling == "longrope":
      return rope_frequencies.longrope_magnitude(self.factor,
                                                 self.original_max_positions)
    mscale = rope_frequencies.get_mscale
    if self.mscale is not None:
      return (mscale(self.factor, self.mscale)
              / mscale(self.factor, self.mscale_all_dim))
    return mscale(self.factor)

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
        ``seq_len``, or it or ``ntk_alpha`` with ``R = 2`` (the exponent
        ``R / (R - 2)``);
        ``short_factor``/``long_factor`` without ``R / 2`` entries;
        ``sections`` not summing to ``R / 2``.
    """
    rot = rope_checks.check_rotary_dim(rotary_dim)
    rope_checks.check_sections_dim(self.sections, self.fraction, rot)
    if self.ntk_alpha is not None:  # scaling "none", one ladder
      rope_checks.check_dynamic_dim(rot, "ntk_alpha")
      return rope_frequencies.plain_theta(rope_frequencies.ntk_alpha_base(
          self.base, self.ntk_alpha, rot), rot)
    if self.section_frequencies == "per_section":  # scaling is "none"
      # A 1-D RoPE of rotary dim 2 n per section, concatenated: pair i
      # keeps its place, so apply_rope's section split reads it unchanged.
      return np.concatenate([rope_frequencies.plain_theta(self.base, 2 * n)
                             for n in self.sections])
    theta = rope_frequencies.plain_theta(self.base, rot)
    if self.scaling == "none":
      return theta
    if self.scaling == "linear":
      return theta / self.factor
    if self.scaling == "llama3":
      return rope_frequencies.llama3(
          theta, self.factor, self.original_max_positions,
          self.low_freq_factor, self.high_freq_factor)
    if self.scaling == "yarn":
      return rope_frequencies.yarn(
          theta, rot, base=self.base, factor=self.factor,
          original=self.original_max_positions, beta_fast=self.beta_fast,
          beta_slow=self.beta_slow, truncate=self.truncate)
    return self._for_length(theta, rot, seq_len)

  def _for_length(self, theta: np.ndarray, rot: int, seq_len):
    """Dynamic NTK's or LongRoPE's frequencies: chosen for the length
    ``seq_len``, on device when it is a JAX array (it may be traced)."""
    original = self.original_max_positions
    if self.scaling == "longrope":
      rope_checks.check_longrope_dim(self.short_factor, self.long_factor,
                                     self.fraction, rot)
      if seq_len is None:  # HF's init: the short factors
        return rope_frequencies.longrope(theta, self.short_factor,
                                         self.long_factor, original, None)
    elif seq_len is None:
      raise ValueError(
          "scaling='dynamic' needs seq_len: its frequencies depend on the "
          "longest position (apply_rope uses max(positions) + 1).")
    else:
      rope_checks.check_dynamic_dim(rot)
    if isinstance(seq_len, (jax.Array, jax.core.Tracer)):
      rope_checks.check_seq_len_array(seq_len)
      dtype = jax.dtypes.canonicalize_dtype(jnp.float64)
      if self.scaling == "longrope":
        return rope_frequencies.longrope_on_device(
            theta, self.short_factor, self.long_factor, original, seq_len,
            dtype)
      return rope_frequencies.dynamic_on_device(theta, rot, self.factor,
                                                original, seq_len, dtype)
    length = rope_checks.check_number("seq_len", seq_len)
    if self.scaling == "longrope":
      return rope_frequencies.longrope(theta, self.short_factor,
                                       self.long_factor, original, length)
    return rope_frequencies.dynamic(self.base, rot, self.factor, original,
                                    length)

