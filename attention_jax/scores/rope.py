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

or, instead of a scaling, Hunyuan's fixed NTK-aware base: ``ntk_alpha``
(HF's ``"ntk_alpha"``, a ``"dynamic"`` ``rope_scaling`` with an ``alpha``)
grows the base to ``base * ntk_alpha**(R / (R - 2))`` for every length;
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
every axis, which is plain RoPE. ``sections_interleaved=True`` (Qwen3-VL,
HF's ``mrope_interleaved``) spreads the three axes over the frequencies in
the pattern ``THWTHW...TT`` instead of consecutive blocks.

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

Where it lives (this module re-exports the public names):

* ``rope_spec``: ``Rope`` (its fields, their checks and rules,
  ``inverse_frequencies``), ``SCALINGS``, ``SECTION_FREQUENCIES``.
* ``rope_frequencies``: the maths: the rotary dim, the plain ladder, each
  scaling's frequencies, the YaRN and LongRoPE magnitudes.
* ``rope_checks``: the checks of static values (numbers, flags, factor
  lists, sections) and of the fields that need the rotary dim.
* ``rope_apply``: ``apply_rope``, ``as_rope``, ``segment_positions``.
"""

from __future__ import annotations

from attention_jax.scores.rope_apply import apply_rope
from attention_jax.scores.rope_apply import as_rope
from attention_jax.scores.rope_apply import segment_positions
from attention_jax.scores.rope_spec import SCALINGS
from attention_jax.scores.rope_spec import SECTION_FREQUENCIES
from attention_jax.scores.rope_spec import Rope

__all__ = ["SCALINGS", "SECTION_FREQUENCIES", "Rope", "apply_rope",
           "as_rope", "segment_positions"]
