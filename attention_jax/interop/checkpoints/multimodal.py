"""Vision-language models' text attention: Qwen2-VL, Qwen2.5-VL, Qwen3-VL (M-RoPE).

Shape glossary: B batch, T tokens, H head dim.

Their language models' attention is Qwen2's (``qwen2_vl``, ``qwen2_5_vl``:
q/k/v biases, none on ``o_proj``, Qwen's window from ``max_window_layers``
with ``use_sliding_window``; ``head_dim = hidden_size // heads`` whatever the
config says) or Qwen3's (``qwen3_vl``: qk-norm RMSNorm ``[H]``,
``attention_bias`` on all four, no window: HF's code drops it), so
``decoders.build`` reads the weights; what differs is the rotary embedding,
multimodal RoPE: ``rope_parameters["mrope_section"]`` splits the ``H / 2``
frequencies into time, height and width sections, blocked
(``aj.Rope(sections=...)``, Qwen2-VL, Qwen2.5-VL) or interleaved ``THWTHW...``
(``sections_interleaved=True``, Qwen3-VL, whose code interleaves whatever
``mrope_interleaved`` says). Such a layer takes explicit positions
``[3, B, T]`` when called (``module(x, positions=pos)``; text tokens repeat
one position on the three rows); it has no default positions.

The weights live under ``model.language_model.layers.{i}.self_attn.``; a
multimodal config (``model_type`` ``"qwen2_vl"``...) is read through its
``text_config`` (``"qwen2_vl_text"``...). A config's missing sizes and rope
base take the config classes' defaults (base 1e6, Qwen3-VL 5e5; 80 window
layers; HF's default sections where ``mrope_section`` is missing).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attention_jax.interop.checkpoints import config_rope
from attention_jax.interop.checkpoints import decoders
from attention_jax.interop.checkpoints import reading
from attention_jax.interop.checkpoints import registry
from attention_jax.scores import rope as rope_lib

# {family: (decoders' family, interleaved sections, default base, default
# mrope_section)}, as each modeling_<family>.py / configuration_<family>.py.
_VL = {
    "qwen2_vl": ("qwen2", False, 1e6, (16, 24, 24)),
    "qwen2_5_vl": ("qwen2", False, 1e6, (16, 24, 24)),
    "qwen3_vl": ("qwen3", True, 500000.0, (24, 20, 20)),
}
# The rope parameters the VL rotary embeddings read (mrope_interleaved only
# names Qwen3-VL's layout, which its code applies whatever the flag says).
_ROPE_KEYS = ("rope_type", "type", "rope_theta", "mrope_section",
              "mrope_interleaved")
_VL_SIGNS = ("vision_start_token_id", "image_token_id")
_WINDOW_LAYERS = 80  # Qwen2-VL / Qwen2.5-VL text configs' max_window_layers


def _text_config(cfg: Mapping[str, Any], family: str) -> dict[str, Any]:
  """The config decoders' Qwen family reads, with the VL classes' defaults
  where they differ from Qwen2's / Qwen3's."""
  out = dict(cfg)
  if _VL[family][0] == "qwen2":
    out.pop("head_dim", None)  # HF: hidden_size // num_attention_heads
    out.setdefault("max_window_layers", _WINDOW_LAYERS)
  else:  # Qwen3-VL's attention has no window, whatever the config carries
    for key in decoders.QWEN_WINDOW:  # noqa: SLF001 (the Qwen window keys)
      out.pop(key, None)
  return out


def mrope(cfg: Mapping[str, Any], family: str, layer: int,
          head_dim: int) -> rope_lib.Rope:
  """The layer's M-RoPE as an ``aj.Rope`` with sections."""
  qwen, interleaved, theta, default_sections = _VL[family]
  p = config_rope.rope_parameters({**cfg, "rope_theta": cfg.get(
      "rope_theta", theta)}, qwen, layer)
  rope_type = p.get("rope_type", p.get("type", "default"))
  if rope_type not in ("default", "mrope"):
    raise ValueError(
        f"config's rope_type {rope_type!r} (layer {layer}) is not supported "
        f"for {family}: load_attention_weights maps its multimodal rotary "
        "with rope_type 'default' or 'mrope' (no scaling) only. Pass "
        "overrides={'rope': aj.Rope(..., sections=...)} if you know the "
        "model's rotary.")
  unknown = sorted(set(p) - set(_ROPE_KEYS))
  if unknown:
    raise ValueError(
        f"config's rope parameters (layer {layer}) have {unknown}, which "
        f"{family}'s multimodal rotary does not read (it reads "
        f"{sorted(_ROPE_KEYS)}): loading them as if absent would be a "
        "guess; remove them if this model does not use them.")
  sections = p.get("mrope_section")
  sections = default_sections if sections is None else sections
  if (not isinstance(sections, (list, tuple)) or not sections
      or sum(int(s) for s in sections) * 2 != head_dim):
    raise ValueError(
        f"config's mrope_section={sections!r} (layer {layer}) must be a list "
        f"of section sizes summing to head_dim / 2 = {head_dim // 2} (the "
        f"rotary frequencies; {family}'s code splits them so), e.g. "
        f"{list(default_sections)} for head_dim 128.")
  try:
    return rope_lib.Rope(base=float(p["rope_theta"]),
                         sections=tuple(int(s) for s in sections),
                         sections_interleaved=interleaved)
  except (TypeError, ValueError) as e:
    raise ValueError(f"config's rope parameters {p} (layer {layer}) do not "
                     f"make {family}'s multimodal aj.Rope: {e}") from e


def build(cfg: Mapping[str, Any], family: str, layer: int,
          read: reading.Reader, overrides: Mapping[str, Any],
          attention: str) -> registry.Built:
  """One VL text layer: decoders' Qwen layer with the M-RoPE (decoders
  is given a rope override, so it reads none of the config's)."""
  text = _text_config(cfg, family)
  given = "rope" in overrides
  params, options, notes = decoders.build(
      text, _VL[family][0], layer, read,
      {**overrides, "rope": overrides["rope"] if given else None}, attention)
  if not given:  # the user's rope replaces the config's, unread
    options["rope"] = mrope(text, family, layer, options["head_dim"])
    notes += (f"; M-RoPE sections {options['rope'].sections}"
              f"{' interleaved' if _VL[family][1] else ''} (positions "
              "[3, B, T])")
  return params, options, notes


def _family(name: str, maps: str) -> registry.Family:
  def build_family(cfg, layer, read, overrides, attention):
    return build(cfg, name, layer, read, overrides, attention)
  windows = _VL[name][0] == "qwen2"
  return registry.Family(
      name=name, model_types=(name, f"{name}_text"),
      reads=("mrope_section", *(decoders.QWEN_WINDOW if windows else ())),  # noqa: SLF001
      build=build_family, prefix="layers.{layer}.self_attn.",
      anchor="q_proj.weight", maps=maps,
      ignores=(*_VL_SIGNS, *(() if windows else decoders.QWEN_WINDOW)),  # noqa: SLF001
      requires=("model_type",))


FAMILIES = (
    _family("qwen2_vl", "text layers: Qwen2's (q/k/v biases, Qwen's "
            "window); M-RoPE mrope_section, blocked; positions [3, B, T]"),
    _family("qwen2_5_vl", "text layers: Qwen2's (q/k/v biases, Qwen's "
            "window); M-RoPE mrope_section, blocked; positions [3, B, T]"),
    _family("qwen3_vl", "text layers: Qwen3's (qk-norm RMSNorm [H], "
            "attention_bias); M-RoPE mrope_section, interleaved THW; "
            "positions [3, B, T]"),
)
