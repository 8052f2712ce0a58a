"""A layer's mask and rotary embedding from its HF config, as the family's code
derives them: layer types (sliding or full), windows, rope parameters (new
``rope_parameters`` or old ``rope_scaling``/``rope_theta`` format) mapped to
an ``aj.Rope``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from attention_jax.interop.checkpoints import reading
from attention_jax.scores import rope as rope_lib

# HF's default rotary base per family when a config gives none
# (``default_theta`` of the config class; Gemma 3: global, local).
DEFAULT_THETA = {"gpt_oss": 150000.0, "gemma3": (1e6, 10000.0),
                 "gemma3n": (1e6, 10000.0),
                 "mixtral": 1e6, "cohere": 500000.0, "cohere2": 500000.0,
                 "llama4": 500000.0, "olmo3": 500000.0, "smollm3": 2e6,
                 "ernie4_5_moe": 500000.0}
# transformers' config-class defaults for keys a saved config.json may omit.
DEFAULT_WINDOW = {"gemma2": 4096, "gemma3": 4096, "mistral": 4096,
                   "qwen2": 4096, "qwen3": 4096, "gpt_oss": 128,
                   "cohere2": 4096, "ministral": 4096, "qwen2_moe": 4096,
                   "qwen3_moe": 4096, "dots1": 4096, "olmo3": 4096,
                   "exaone4": 4096, "vaultgemma": 4096, "gemma3n": 512}
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                 "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
# Config classes with a top-level original_max_position_embeddings of their
# own (it wins over the rope parameters' in HF's standardisation).
DEFAULT_ORIGINAL = {"phi3": 4096}
# Config classes whose partial_rotary_factor defaults below 1.
DEFAULT_PARTIAL = {"qwen3_next": 0.25}
# Rope types that scale from a pretraining length (HF standardises
# original_max_position_embeddings for these).
_PRETRAINED = ("llama3", "yarn", "longrope")
# rope_type -> our Rope scaling.
ROPE_SCALINGS = {"default": "none", "linear": "linear",
                  "dynamic": "dynamic", "llama3": "llama3", "yarn": "yarn",
                  "longrope": "longrope"}

# The rope parameters each rope type reads (HF's rope init functions), and
# those every type has; any other field is refused, never dropped.
ROPE_FIELDS = {
    "default": (), "linear": ("factor",), "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast",
             "beta_slow", "truncate", "attention_factor", "mscale",
             "mscale_all_dim"),
    "longrope": ("short_factor", "long_factor", "factor",
                 "original_max_position_embeddings", "attention_factor"),
}
_ANY_TYPE = ("rope_type", "type", "rope_theta", "partial_rotary_factor")

# Families whose attention may slide (the rest never read a window), and
# those that window every layer when they do.
_WINDOWED = ("mistral", "mixtral", "starcoder2", "phi3", "qwen2", "qwen3",
             "ministral3",
             "gemma2", "gemma3", "gpt_oss", "cohere2", "ministral",
             "qwen2_moe", "qwen3_moe", "dots1", "olmo3", "exaone4",
             "smollm3", "vaultgemma", "gemma3n")
EVERY_LAYER = ("mistral", "mixtral", "starcoder2", "phi3", "qwen3_moe",
               "ministral3")
# Windows only with use_sliding_window (HF drops sliding_window without it).
_SWITCHED = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "smollm3")
# Layer types the config class derives when a config gives none: {family:
# rule(cfg, layer) -> sliding?}, as each __post_init__ writes them.
_DERIVED_TYPES = {
    "olmo3": lambda cfg, i: bool((i + 1) % 4),
    "vaultgemma": lambda cfg, i: bool((i + 1) % 2),
    "gemma3n": lambda cfg, i: bool((i + 1) % 5),
    "ministral": lambda cfg, i: cfg.get("sliding_window", 4096) is not None,
    "qwen2_moe": lambda cfg, i: bool(
        (i + 1) % 2 and i < cfg.get("max_window_layers", 28)
        and cfg.get("use_sliding_window", False)),
    "dots1": lambda cfg, i: (cfg.get("sliding_window", 4096) is not None
                             and i >= cfg.get("max_window_layers", 62)),
    "exaone4": lambda cfg, i: (
        cfg.get("sliding_window", 4096) is not None
        and bool((i + 1) % cfg.get("sliding_window_pattern", 4))),
    "smollm3": lambda cfg, i: bool(
        cfg.get("use_sliding_window", False)
        and cfg.get("sliding_window") is not None
        and not rope_flag(cfg, i)),
}


def rope_flag(cfg: Mapping[str, Any], layer: int) -> bool:
  """``no_rope_layers[layer]`` (1: the layer rotates), or its default: every
  ``no_rope_layer_interval``-th layer (4) has none (Llama 4, SmolLM3)."""
  flags = cfg.get("no_rope_layers")
  if not flags:
    return bool((layer + 1) % cfg.get("no_rope_layer_interval", 4))
  if layer >= len(flags):
    raise ValueError(f"layer={layer} but config['no_rope_layers'] has "
                     f"{len(flags)} entries.")
  return bool(flags[layer])


def layer_type(cfg: Mapping[str, Any], family: str, layer: int) -> str:
  """``"sliding_attention"`` or ``"full_attention"``, as HF's config derives it."""
  if family in EVERY_LAYER:  # these models window every layer, layer_types
    return "sliding_attention"  # or not
  types = cfg.get("layer_types")
  if types is not None:
    if layer >= len(types):
      raise ValueError(f"layer={layer} but config['layer_types'] has "
                       f"{len(types)} entries.")
    kind = types[layer]
    kinds = {"llama4": ("chunked_attention", "full_attention"),
             "qwen3_next": ("full_attention",)}.get(
                 family, ("sliding_attention", "full_attention"))
    if kind not in kinds:
      raise ValueError(
          f"config['layer_types'][{layer}] is {kind!r}; {family} layers "
          f"load_attention_weights reads are {' or '.join(map(repr, kinds))}"
          + (" (its linear_attention layers are Gated DeltaNet, not softmax "
             "attention)" if family == "qwen3_next" else "") + ".")
    return kind
  if family in _DERIVED_TYPES:
    return ("sliding_attention" if _DERIVED_TYPES[family](cfg, layer)
            else "full_attention")
  if family in ("gemma2", "gpt_oss"):  # HF: every other layer, from 0
    return "sliding_attention" if (layer + 1) % 2 else "full_attention"
  if family in ("gemma3", "cohere2"):  # every `pattern`-th is global
    pattern = cfg.get("sliding_window_pattern",
                      cfg.get("_sliding_window_pattern",
                              6 if family == "gemma3" else 4))
    return "sliding_attention" if (layer + 1) % pattern else "full_attention"
  if family in ("qwen2", "qwen3"):  # HF: from max_window_layers on
    return ("sliding_attention" if layer >= cfg.get("max_window_layers", 28)
            else "full_attention")
  return "full_attention"


def window(cfg: Mapping[str, Any], family: str, layer: int) -> int | None:
  """The layer's sliding window ``W`` (keys with ``q - k < W``), or None."""
  if family not in _WINDOWED:
    return None
  window = cfg.get("sliding_window", DEFAULT_WINDOW.get(family))
  if (family in _SWITCHED and "use_sliding_window" not in cfg
      and cfg.get("sliding_window") is not None):
    raise ValueError(
        f"config has sliding_window={cfg['sliding_window']!r} but no "
        f"use_sliding_window: {family}'s code slides only with "
        "use_sliding_window=True (its config.json has the flag). Add it "
        "(False: the window is not used), or, for a model that slides "
        "without such a flag, pass the family its model_type names.")
  if family in _SWITCHED and not cfg.get("use_sliding_window", False):
    return None  # HF sets sliding_window = None without use_sliding_window
  if window is None or layer_type(cfg, family, layer) != "sliding_attention":
    return None
  if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or (
      window < 1):
    raise ValueError(f"config['sliding_window'] must be a positive int, got "
                     f"{window!r}.")
  return int(window)


def rope_parameters(cfg: Mapping[str, Any], family: str,
                     layer: int) -> dict[str, Any]:
  """The layer's rope parameters, new (``rope_parameters``) or old format."""
  kind = layer_type(cfg, family, layer)
  theta = DEFAULT_THETA.get(family, 10000.0)
  scaling = cfg.get("rope_scaling")  # old format; HF prefers it
  params = cfg.get("rope_parameters")
  if family in ("gemma3", "gemma3n"):  # (Gemma 3n's config class: the same)
    global_theta, local_theta = theta
    if isinstance(params, Mapping):  # Gemma 3's are nested by layer type
      if not isinstance(params.get(kind), Mapping):
        raise ValueError(
            f"config['rope_parameters'] has no {kind!r} entry (layer {layer} "
            f"is {kind}; keys {sorted(params)}): Gemma 3's rope_parameters "
            "are nested by layer type ({'sliding_attention': {...}, "
            "'full_attention': {...}}), and the loader does not guess which "
            "applies. Nest them, or use the old rope_theta / "
            "rope_local_base_freq / rope_scaling keys.")
      params = dict(params[kind])
    elif kind == "sliding_attention":  # old format: a local base, no scaling
      params = {"rope_type": "default",
                "rope_theta": cfg.get("rope_local_base_freq", local_theta)}
    else:
      params = {**(scaling or {}),
                "rope_theta": cfg.get("rope_theta", global_theta)}
    # HF fills a nested entry without a base from the top-level ones.
    params.setdefault("rope_theta", cfg.get("rope_theta", global_theta)
                      if kind == "full_attention"
                      else cfg.get("rope_local_base_freq", local_theta))
    return params
  if family == "gpt_oss" and scaling is None and params is None:
    params = GPT_OSS_ROPE  # GptOssConfig's default: YaRN, not plain rope
  params = dict(scaling or params or {})
  nested = sorted({"sliding_attention", "full_attention"} & set(params))
  if nested:  # per layer type: the layer's own entry, never another's
    if not isinstance(params.get(kind), Mapping):
      raise ValueError(
          f"config's rope parameters are nested by layer type ({nested}) "
          f"but have no {kind!r} entry for layer {layer}, which is {kind}: "
          "the loader does not guess which applies; add it.")
    params = dict(params[kind])
  params.setdefault("rope_theta", cfg.get("rope_theta", theta))
  return params


def rope(cfg: Mapping[str, Any], family: str, layer: int, *,
         interleaved: bool = False, partial: bool = False,
         extra_fields: tuple[str, ...] = ()) -> rope_lib.Rope:
  """The layer's rotary embedding as an ``aj.Rope`` (HF's rope_type mapped).

  ``interleaved``: the family rotates pairs ``(x[2i], x[2i + 1])``;
  ``partial``: its code rotates the first ``partial_rotary_factor`` of the
  head (elsewhere a factor below 1 is refused); ``extra_fields``: rope
  parameters the caller reads itself (any other unknown one is refused).
  """
  p = rope_parameters(cfg, family, layer)
  rope_type = p.get("rope_type", p.get("type", "default"))
  if rope_type not in ROPE_SCALINGS:
    raise ValueError(
        f"config's rope_type {rope_type!r} (layer {layer}) is not supported: "
        f"load_attention_weights maps rope types {list(ROPE_SCALINGS)} to "
        "aj.Rope.")

  unknown = sorted(set(p) - set(_ANY_TYPE) - set(ROPE_FIELDS[rope_type])
                   - set(extra_fields))
  if unknown:
    raise ValueError(
        f"config's rope parameters (layer {layer}, rope_type {rope_type!r}) "
        f"have {unknown}, which {family}'s rotary embedding with this type "
        f"does not read (it reads {sorted(ROPE_FIELDS[rope_type])}"
        f"{' and ' + str(sorted(extra_fields)) if extra_fields else ''}): "
        "loading them as if absent would be a guess. They belong to another "
        "model's rotary embedding (e.g. mrope_section: Qwen-VL's) or another "
        "rope_type; pass that model's family, or remove them if this model "
        "does not use them.")

  if "alpha" in extra_fields and rope_type == "dynamic" and p.get("alpha"):
    # Hunyuan: "dynamic" with an alpha is a fixed NTK base (HF renames it
    # ntk_alpha), base * alpha ** (R / (R - 2)); factor is not read.
    return rope_lib.Rope(base=float(p["rope_theta"]),
                         ntk_alpha=float(p["alpha"]), interleaved=interleaved)

  def need(name):
    if p.get(name) is None:
      raise ValueError(f"config's rope_type {rope_type!r} needs {name!r} in "
                       f"rope_parameters / rope_scaling (layer {layer}); got "
                       f"{p}.")
    return p[name]

  # These families' modeling code rotates the whole head: transformers'
  # default rope never reads partial_rotary_factor, and with a scaled rope
  # type a factor below 1 makes its frequencies and its head disagree.
  fraction = p.get("partial_rotary_factor", cfg.get(
      "partial_rotary_factor", DEFAULT_PARTIAL.get(family)))
  if (not partial and fraction is not None and float(fraction) < 1.0
      and rope_type != "default"):
    raise ValueError(
        f"config's partial_rotary_factor={fraction} with rope_type "
        f"{rope_type!r} (layer {layer}): {family}'s attention rotates the "
        "whole head, and transformers cannot run this combination either.")
  fields = dict(base=float(p["rope_theta"]), scaling=ROPE_SCALINGS[rope_type],
                interleaved=interleaved)
  if partial and fraction is not None:
    fields["fraction"] = float(fraction)
  max_positions = cfg.get("max_position_embeddings")
  original = (original_positions(cfg, p, family, rope_type, layer)
              if rope_type in _PRETRAINED else None)
  if rope_type in ("linear", "dynamic", "llama3"):
    fields["factor"] = float(need("factor"))
  if rope_type == "dynamic":  # HF's dynamic NTK reads max_position_embeddings
    fields["original_max_positions"] = reading.positive_int(
        cfg, "max_position_embeddings", family)
  if rope_type == "llama3":
    fields.update(original_max_positions=original,
                  low_freq_factor=float(need("low_freq_factor")),
                  high_freq_factor=float(need("high_freq_factor")))
  if rope_type == "yarn":
    fields.update(_yarn_fields(p, need, max_positions, original))
  if rope_type == "longrope":
    fields.update(_longrope_fields(p, need, cfg, family, original))
  try:
    return rope_lib.Rope(**fields)
  except (TypeError, ValueError) as e:
    raise ValueError(f"config's rope parameters {p} (layer {layer}) do not "
                     f"make an aj.Rope: {e}") from e


def original_positions(cfg: Mapping[str, Any], p: Mapping[str, Any],
                       family: str, rope_type: str, layer: int) -> int:
  """The pretraining context length a llama3/YaRN/LongRoPE rope scales from,
  as transformers' ``standardize_rope_params`` fills it in: a top-level
  ``original_max_position_embeddings`` (Phi-3's config class has one,
  4096) wins over the rope parameters', and without either it is
  ``max_position_embeddings`` (no scaling at all: factor 1)."""
  if "original_max_position_embeddings" in cfg:
    where, value = ("config['original_max_position_embeddings']",
                    cfg["original_max_position_embeddings"])
  elif family in DEFAULT_ORIGINAL:
    return DEFAULT_ORIGINAL[family]
  elif "original_max_position_embeddings" in p:
    where, value = ("the rope parameters' 'original_max_position_embeddings'",
                    p["original_max_position_embeddings"])
  elif cfg.get("max_position_embeddings") is not None:
    where, value = ("config['max_position_embeddings'] (transformers' "
                    "fallback for a missing original_max_position_embeddings)",
                    cfg["max_position_embeddings"])
  else:  # HF would take its config class's default, which differs by class
    raise ValueError(
        f"config's rope_type {rope_type!r} (layer {layer}) needs "
        "'original_max_position_embeddings', the context length the model "
        "was pretrained at: the config has it neither at its top level nor "
        "in rope_parameters / rope_scaling, and has no "
        "'max_position_embeddings' either (transformers' fallback for it, "
        f"whose default differs between config classes). Add "
        "'original_max_position_embeddings' to the rope parameters (the "
        "model's config.json or model card gives it, e.g. 4096 for Phi-3 "
        "mini, 8192 for Llama 3.1).")
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or (
      value < 1):
    raise ValueError(
        f"{where} must be a positive int (the context length the model was "
        f"pretrained at) for rope_type {rope_type!r} (layer {layer}), got "
        f"{value!r}; transformers cannot compute this rope from it either. "
        "Set it to the model's pretraining length (e.g. 4096).")
  return int(value)


def _yarn_fields(p: Mapping[str, Any], need: Callable[[str], Any],
                 max_positions, original) -> dict[str, Any]:
  """YaRN's ``Rope`` fields, with HF's defaults for what a config omits."""
  factor = p.get("factor")
  if factor is None and max_positions and original:  # HF: the context ratio
    factor = max_positions / original
  # HF: `or` defaults (None and 0 mean 32 and 1).
  fields = dict(factor=float(need("factor") if factor is None else factor),
                original_max_positions=original,
                beta_fast=float(p.get("beta_fast") or 32.0),
                beta_slow=float(p.get("beta_slow") or 1.0),
                truncate=bool(p.get("truncate", True)))
  if p.get("attention_factor") is not None:
    fields["attention_factor"] = float(p["attention_factor"])
  elif p.get("mscale") and p.get("mscale_all_dim"):  # HF ignores a lone one
    fields.update(mscale=float(p["mscale"]),
                  mscale_all_dim=float(p["mscale_all_dim"]))
  return fields


def _longrope_fields(p: Mapping[str, Any], need: Callable[[str], Any],
                     cfg: Mapping[str, Any], family: str,
                     original) -> dict[str, Any]:
  """LongRoPE's ``Rope`` fields: the factor lists, and the magnitude as HF
  derives it (``Rope`` refuses a factor and an attention_factor both)."""
  # HF 5: the rope parameters' factor, else max_position_embeddings /
  # original (Phi-3's configs give none); it sets the default magnitude.
  factor = p.get("factor")
  if factor is None:
    factor = reading.positive_int(cfg, "max_position_embeddings",
                                  family) / original
  fields = dict(original_max_positions=int(original),
                short_factor=tuple(map(float, need("short_factor"))),
                long_factor=tuple(map(float, need("long_factor"))))
  if p.get("attention_factor") is not None:
    fields["attention_factor"] = float(p["attention_factor"])
  elif float(factor) <= 1.0:  # HF: magnitude 1
    fields["attention_factor"] = 1.0
  else:
    fields["factor"] = float(factor)
  return fields
