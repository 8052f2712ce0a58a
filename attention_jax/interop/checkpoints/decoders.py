"""Llama-style decoder families: separate (or Phi-3's fused) q/k/v, ``o_proj``.

Shape glossary: D hidden size, N query heads, K key/value heads, H head dim.

One build function (``build``) reads every family here; what differs
between them is one ``_Traits`` row each, as each family's HF
``modeling_<family>.py`` computes it:

- llama: ``attention_bias`` (all four projections), rope incl. ``llama3`` /
  ``linear`` / ``dynamic`` / ``yarn`` scaling.
- mistral, mixtral: no biases; ``sliding_window`` on every layer.
- starcoder2: ``use_bias`` on all four; ``sliding_window`` on every layer.
- qwen2: q/k/v biases, none on ``o_proj`` (a zero ``W_o`` bias); a window
  on layers ``>= max_window_layers`` when ``use_sliding_window``.
- qwen3: qk-norm (RMSNorm weight ``[H]``, ``rms_norm_eps``); Qwen's window.
- qwen3_next (its ``full_attention`` layers): ``q_proj`` fused with the
  output gate (``[N, 2H]`` per head: query, then gate), qk-norm ``1 + w``,
  partial rotary.
- gemma2: ``scale = query_pre_attn_scalar ** -0.5``,
  ``attn_logit_softcapping``, sliding and global layers alternating.
- gemma3: qk-norm ``1 + w``, the Gemma 2 scale, ``layer_types`` (every 6th
  global), a local rotary base on sliding layers.
- gpt_oss: biases on all four, ``sinks [N]``, alternating window, yarn.
- olmo2: qk-norm over the whole projection (RMSNorm ``[N * H]`` and
  ``[K * H]`` weights, read per head as ``[N, H]`` / ``[K, H]``).
- cohere: interleaved rotary pairs; with ``use_qk_norm`` a LayerNorm per
  head with ``[N, H]`` / ``[K, H]`` weights (``layer_norm_eps``).
- cohere2: interleaved rotary on sliding layers only (global layers have
  no positions); ``layer_types``.
- phi3: ``qkv_proj`` (rows q ``[N * H]``, k ``[K * H]``, v ``[K * H]``),
  partial rotary, LongRoPE, ``sliding_window`` on every layer.
- llama4 (text): RoPE layers (``no_rope_layers[i] = 1``) with interleaved
  rotary, chunked attention (``attention_chunk_size``) and a weightless
  qk-norm after rotary (``use_qk_norm``); NoPE layers with full causal
  attention and, with ``attn_temperature_tuning``, the query temperature
  ``1 + attn_scale * log1p(floor((i + 1) / floor_scale))``.

A sliding window of ``W`` (HF's mask: ``q_idx - kv_idx < W``) is
``aj.Mask(causal=True, window=(W - 1, 0))``.
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
from typing import Any

import numpy as np

from attention_jax.interop.checkpoints import config_rope
from attention_jax.interop.checkpoints import reading
from attention_jax.interop.checkpoints import registry
from attention_jax.layers.qk_norm import QKNorm
from attention_jax.masking.block_tables import chunked_mask_fn
from attention_jax.masking.mask import Mask
from attention_jax.scores import score_mods


@dataclasses.dataclass(frozen=True)
class _Traits:
  """What one family's attention does beyond Llama's."""
  # "flag" (attention_bias, all four), "qkv" (q/k/v always, o never),
  # "qkv_flag" (attention_bias on q/k/v, o never), "qkv_flag_out"
  # (attention_bias on q/k/v, attention_out_bias on o), "none", "use_bias"
  # (use_bias, all four)
  biases: str = "flag"
  default_bias: bool = False  # the config class's default for the flag
  # Which config keys default head_dim / num_key_value_heads when missing
  # (the config class derives them); elsewhere a missing one is refused.
  derives_kv_heads: bool = False
  derives_head_dim: bool = False
  qk_norm: str | None = None  # None, "rms", "rms_1p", "olmo", "cohere"
  interleaved: bool = False  # rotary pairs (x[2i], x[2i + 1])
  partial_rotary: bool = False  # reads partial_rotary_factor
  fused_qkv: bool = False  # Phi-3's qkv_proj
  gated: bool = False  # Qwen3-Next's q_proj with the output gate
  gemma_scale: bool = False
  sinks: bool = False
  scale_key: str | None = None  # Granite: the scale is attention_multiplier
  # Which layers rotate: None (all), "no_rope_layers" (SmolLM3: 1 = rope),
  # "sliding_only" (EXAONE 4: with a window, full layers have none)
  rope_layers: str | None = None
  norm_names: tuple[str, str] = ("q_norm", "k_norm")  # Hunyuan: *_layernorm
  rope_fields: tuple[str, ...] = ()  # rope parameters of its own (alpha)


_TRAITS = {
    "llama": _Traits(derives_kv_heads=True, derives_head_dim=True),
    "mistral": _Traits(biases="none", derives_head_dim=True),
    "mixtral": _Traits(biases="none", derives_head_dim=True),
    "starcoder2": _Traits(biases="use_bias", default_bias=True,
                          derives_head_dim=True),
    "qwen2": _Traits(biases="qkv", derives_head_dim=True),
    "qwen3": _Traits(qk_norm="rms"),
    "qwen3_next": _Traits(qk_norm="rms_1p", partial_rotary=True, gated=True),
    "gemma2": _Traits(gemma_scale=True),
    "gemma3": _Traits(gemma_scale=True, qk_norm="rms_1p"),
    "gpt_oss": _Traits(default_bias=True, sinks=True),
    "olmo2": _Traits(qk_norm="olmo", derives_kv_heads=True,
                     derives_head_dim=True),
    "cohere": _Traits(qk_norm="cohere", interleaved=True,
                      derives_kv_heads=True, derives_head_dim=True),
    "cohere2": _Traits(interleaved=True, derives_kv_heads=True,
                       derives_head_dim=True),
    "phi3": _Traits(biases="none", fused_qkv=True, partial_rotary=True,
                    derives_kv_heads=True, derives_head_dim=True),
    "llama4": _Traits(interleaved=True),  # head_dim defaults to 128
    "granite": _Traits(scale_key="attention_multiplier",
                       derives_kv_heads=True, derives_head_dim=True),
    "granitemoe": _Traits(scale_key="attention_multiplier",
                          derives_kv_heads=True, derives_head_dim=True),
    "granitemoeshared": _Traits(scale_key="attention_multiplier",
                                derives_kv_heads=True,
                                derives_head_dim=True),
    "arcee": _Traits(derives_kv_heads=True, derives_head_dim=True),
    "helium": _Traits(biases="qkv_flag", interleaved=True),
    "glm": _Traits(biases="qkv_flag", interleaved=True, partial_rotary=True),
    "glm4": _Traits(biases="qkv_flag", interleaved=True,
                    partial_rotary=True),
    "glm4_moe": _Traits(biases="qkv_flag", partial_rotary=True,
                        qk_norm="rms_flag"),
    "seed_oss": _Traits(biases="qkv_flag_out", default_bias=True),
    "ernie4_5": _Traits(biases="use_bias", interleaved=True),
    "ernie4_5_moe": _Traits(biases="use_bias", interleaved=True),
    "nemotron": _Traits(partial_rotary=True),
    "ministral": _Traits(biases="none"),
    "qwen2_moe": _Traits(biases="qkv", derives_head_dim=True),
    "qwen3_moe": _Traits(qk_norm="rms"),
    "dots1": _Traits(qk_norm="rms"),
    "olmo3": _Traits(qk_norm="olmo", derives_kv_heads=True,
                     derives_head_dim=True),
    "exaone4": _Traits(qk_norm="rms", rope_layers="sliding_only",
                       derives_head_dim=True),
    "smollm3": _Traits(rope_layers="no_rope_layers"),
    "gemma": _Traits(),
    "vaultgemma": _Traits(gemma_scale=True),
    "ministral3": _Traits(biases="none",
                          rope_fields=("llama_4_scaling_beta",
                                       "max_position_embeddings")),
    "hunyuan_v1_dense": _Traits(qk_norm="rms_after", derives_head_dim=True,
                                norm_names=("query_layernorm",
                                            "key_layernorm"),
                                rope_fields=("alpha",)),
    "hunyuan_v1_moe": _Traits(qk_norm="rms_after", derives_head_dim=True,
                              norm_names=("query_layernorm",
                                          "key_layernorm"),
                              rope_fields=("alpha",)),
}


def _qk_norm(cfg: Mapping[str, Any], family: str, layer: int,
             traits: _Traits) -> QKNorm | None:
  """The qk-norm the family's code applies to this layer, or None."""
  eps = cfg.get("rms_norm_eps")
  if traits.qk_norm == "rms":  # Qwen3: RMSNorm [H]
    return QKNorm(epsilon=float(1e-6 if eps is None else eps))
  if traits.qk_norm == "rms_1p":  # Gemma 3, Qwen3-Next: (1 + w)
    return QKNorm(epsilon=float(1e-6 if eps is None else eps),
                  weight_offset=1.0)
  if traits.qk_norm == "rms_after":  # Hunyuan: RMSNorm [H] after rotary
    return QKNorm(epsilon=float(1e-5 if eps is None else eps),
                  after_rope=True)
  if traits.qk_norm == "rms_flag":  # GLM-4.5: RMSNorm [H] with use_qk_norm
    if not cfg.get("use_qk_norm", False):
      return None
    return QKNorm(epsilon=float(1e-5 if eps is None else eps))
  if traits.qk_norm == "olmo":  # one RMSNorm over all heads' features
    return QKNorm(over="all", weight="per_head",
                  epsilon=float(1e-5 if eps is None else eps))
  if traits.qk_norm == "cohere":
    if not cfg.get("use_qk_norm", False):
      return None
    eps = cfg.get("layer_norm_eps")
    return QKNorm(kind="layer", weight="per_head",
                  epsilon=float(1e-5 if eps is None else eps))
  if (family == "llama4" and cfg.get("use_qk_norm", True)
      and config_rope.rope_flag(cfg, layer)):  # weightless, after rotary
    return QKNorm(weight=None, after_rope=True,
                  epsilon=float(1e-5 if eps is None else eps))
  return None


def _biases(cfg: Mapping[str, Any], traits: _Traits) -> tuple[tuple[str, ...],
                                                              str]:
  if traits.biases == "qkv":  # fixed in Qwen2Attention
    return ("q", "k", "v"), "Qwen2: q/k/v biases, none on o_proj"
  if traits.biases == "none":
    return (), "no biases"
  key = "use_bias" if traits.biases == "use_bias" else "attention_bias"
  flag = bool(cfg.get(key, traits.default_bias))
  if traits.biases == "qkv_flag":
    return ((("q", "k", "v") if flag else ()),
            f"config {key}={flag} (q/k/v; o_proj has none)")
  if traits.biases == "qkv_flag_out":
    out = bool(cfg.get("attention_out_bias", False))
    return (("q", "k", "v") if flag else ()) + (("o",) if out else ()), (
        f"config {key}={flag} (q/k/v), attention_out_bias={out} (o_proj)")
  return (("q", "k", "v", "o") if flag else ()), f"config {key}={flag}"


def _projections(read: reading.Reader, traits: _Traits, biases, bias_note,
                 d: int, n: int, k: int, h: int) -> dict[str, dict[str, Any]]:
  """``W_q``, ``W_k``, ``W_v`` (and Qwen3-Next's ``W_g``) per head."""
  dims = f"hidden_size={d}, heads={n}, kv_heads={k}, head_dim={h}"
  params: dict[str, dict[str, Any]] = {}
  if traits.fused_qkv:  # Phi-3: rows q [N*H], k [K*H], v [K*H]
    w = read.get("qkv_proj.weight", ((n + 2 * k) * h, d),
                 f"[(heads + 2 * kv_heads) * head_dim, hidden_size]; {dims}")
    rows = {"q": w[:n * h], "k": w[n * h:(n + k) * h], "v": w[(n + k) * h:]}
    for name, heads in (("q", n), ("k", k), ("v", k)):
      params[f"W_{name}"] = {"kernel": rows[name].T.reshape(d, heads, h)}
    return params
  for name, heads in (("q", n), ("k", k), ("v", k)):
    width = 2 * h if (name == "q" and traits.gated) else h
    w = read.get(f"{name}_proj.weight", (heads * width, d),
                 f"[heads * {'2 * ' if width > h else ''}head_dim, "
                 f"hidden_size]; {dims}")
    kernel = w.T.reshape(d, heads, width)  # [D, heads, H or 2H]
    b = None
    if name in biases:
      b = read.get(f"{name}_proj.bias", (heads * width,),
                   bias_note).reshape(heads, width)
    if width > h:  # Qwen3-Next: each head's 2H rows are query, then gate
      params["W_g"] = {"kernel": kernel[..., h:]}
      kernel = kernel[..., :h]
      if b is not None:
        params["W_g"]["bias"], b = b[:, h:], b[:, :h]
    params[f"W_{name}"] = {"kernel": kernel}
    if b is not None:
      params[f"W_{name}"]["bias"] = b
  return params


def build(cfg: Mapping[str, Any], family: str, layer: int,
          read: reading.Reader, overrides: Mapping[str, Any],
          attention: str) -> registry.Built:
  """One llama-style layer's params, ``MultiHeadAttention`` options, notes."""
  del attention  # decoders have one attention per layer
  traits = _TRAITS[family]
  d = reading.positive_int(cfg, "hidden_size", family)
  n = reading.positive_int(cfg, "num_attention_heads", family)
  k = reading.size(cfg, "num_key_value_heads", family, n,
                   (family,) if traits.derives_kv_heads else (),
                   "num_attention_heads")
  h = reading.size(cfg, "head_dim", family, d // n,
                   (family,) if traits.derives_head_dim else (),
                   "hidden_size // num_attention_heads")
  if family == "cohere2" and cfg.get("head_dim") not in (None, d // n):
    raise ValueError(f"config head_dim={cfg['head_dim']}, but Cohere2Config "
                     f"sets head_dim = hidden_size // heads = {d // n}.")
  biases, bias_note = _biases(cfg, traits)
  params = _projections(read, traits, biases, bias_note, d, n, k, h)
  w = read.get("o_proj.weight", (d, n * h),
               f"[hidden_size, heads * head_dim]; hidden_size={d}, "
               f"heads={n}, head_dim={h}")
  params["W_o"] = {"kernel": w.T.reshape(n, h, d)}  # [N, H, D]
  if "o" in biases:
    params["W_o"]["bias"] = read.get("o_proj.bias", (d,), bias_note)
  use_bias = bool(biases)
  if use_bias:  # our module: all four or none; a missing one is zero
    for name, shape in (("q", (n, h)), ("k", (k, h)), ("v", (k, h)),
                        ("o", (d,))):
      if name not in biases:
        params[f"W_{name}"]["bias"] = np.zeros(
            shape, params[f"W_{name}"]["kernel"].dtype)
  if "W_g" in params and use_bias and "bias" not in params["W_g"]:
    params["W_g"]["bias"] = np.zeros((n, h), params["W_g"]["kernel"].dtype)
  options: dict[str, Any] = dict(d_model=d, num_heads=n, num_kv_heads=k,
                                 head_dim=h, use_bias=use_bias)
  notes = [bias_note]
  if "W_g" in params:
    options["output_gate"] = "elementwise"
    notes.append("output gate from q_proj")
  if traits.gemma_scale:
    if cfg.get("use_bidirectional_attention") and "mask" not in overrides:
      raise ValueError(
          "config use_bidirectional_attention=True (Gemma's encoder use, no "
          "causal mask) is not supported: load_attention_weights builds "
          "causal decoder layers (overrides={'mask': ...} sets the mask).")
    options["scale"] = float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5
  if traits.scale_key is not None:  # Granite: attention_multiplier (1.0)
    options["scale"] = float(cfg.get(traits.scale_key, 1.0))
    notes.append(f"scale {traits.scale_key}={options['scale']}")
  if family in ("gemma2", "vaultgemma"):
    cap = cfg.get("attn_logit_softcapping", 50.0)  # HF's default
    if cap is not None:
      options["logits_soft_cap"] = float(cap)
  if (family == "gemma3" and cfg.get("attn_logit_softcapping") is not None
      and "logits_soft_cap" not in overrides):
    raise ValueError(
        f"config attn_logit_softcapping={cfg['attn_logit_softcapping']}, but "
        "HF's Gemma 3 attention does not apply it (only Gemma 2 does): "
        "remove it from the config, or, if this model does cap its logits, "
        "pass overrides={'logits_soft_cap': cap}.")
  if "mask" not in overrides:
    options["mask"] = _mask(cfg, family, layer)
  options["rope"] = _rope(cfg, family, layer, traits, overrides)
  if family == "llama4":
    _llama4_temperature(cfg, layer, options, notes)
  if family == "ministral3" and "score_mod" not in overrides:
    _ministral3_temperature(cfg, layer, options, notes)
  norm = overrides.get("normalize_qk", _qk_norm(cfg, family, layer, traits))
  read_norms(read, params, options, notes, norm, n=n, k=k, h=h,
             whole_width=traits.qk_norm in ("olmo",),  # OLMo 2: [N * H]
             names=traits.norm_names)
  if overrides.get("attention_sinks", traits.sinks):
    read_sinks(read, params, options, notes, n)
  return params, options, "; ".join(notes)


def _mask(cfg: Mapping[str, Any], family: str, layer: int) -> Mask:
  if family == "llama4":
    # HF picks the mask by layer_types; its config derives them as
    # "chunked_attention" on RoPE layers while attention_chunk_size (8192
    # by default) is set.
    chunk = cfg.get("attention_chunk_size", 8192)
    if cfg.get("layer_types") is not None:
      chunked = config_rope.layer_type(cfg, family,
                                       layer) == "chunked_attention"
    else:
      chunked = config_rope.rope_flag(cfg, layer) and chunk is not None
    if not chunked:
      return Mask(causal=True)
    if chunk is None:
      raise ValueError(
          f"config['layer_types'][{layer}] is 'chunked_attention' but "
          "attention_chunk_size is None: give the chunk size.")
    # HF's chunked causal mask: both tokens in one chunk of `chunk`.
    return Mask(causal=True, rule=chunked_mask_fn(int(chunk)))
  window = config_rope.window(cfg, family, layer)
  return Mask(causal=True, window=None if window is None else (window - 1, 0))


def _rope(cfg: Mapping[str, Any], family: str, layer: int, traits: _Traits,
          overrides: Mapping[str, Any]):
  if "rope" in overrides:
    return None  # replaced by the override (the config's is not read)
  if family == "cohere2" and config_rope.layer_type(
      cfg, family, layer) != "sliding_attention":
    return None  # Cohere2's global layers have no positions
  if family == "llama4" and not config_rope.rope_flag(cfg, layer):
    return None  # NoPE
  if traits.rope_layers == "no_rope_layers" and not config_rope.rope_flag(cfg, layer):
    return None  # SmolLM3's NoPE layers (the same flags as Llama 4's)
  if (traits.rope_layers == "sliding_only"
      and cfg.get("sliding_window") is not None
      and config_rope.layer_type(cfg, family, layer) != "sliding_attention"):
    return None  # EXAONE 4's global layers: no positions
  return config_rope.rope(cfg, family, layer, interleaved=traits.interleaved,
                          partial=traits.partial_rotary,
                          extra_fields=traits.rope_fields)


def _llama4_temperature(cfg: Mapping[str, Any], layer: int,
                        options: dict[str, Any], notes: list[str]) -> None:
  if config_rope.rope_flag(cfg, layer) or not cfg.get("attn_temperature_tuning", True):
    return
  floor_scale = cfg.get("floor_scale", 8192)
  attn_scale = cfg.get("attn_scale", 0.1)
  options["score_mod"] = score_mods.query_temperature(
      floor_scale=float(floor_scale), attn_scale=float(attn_scale))
  notes.append(f"NoPE temperature (floor_scale={floor_scale}, "
               f"attn_scale={attn_scale})")


def _ministral3_temperature(cfg: Mapping[str, Any], layer: int,
                            options: dict[str, Any], notes: list[str]) -> None:
  """Ministral 3's query scale ``1 + beta * log(1 + floor(i / original))``
  (``llama_4_scaling_beta``, the rope's pretraining length), on every
  layer: Llama 4's temperature with positions counted from 0."""
  p = config_rope.rope_parameters(cfg, "ministral3", layer)
  beta = p.get("llama_4_scaling_beta")
  if not beta:
    return
  original = p.get("original_max_position_embeddings")
  if original is None:
    raise ValueError(
        "config's rope parameters have llama_4_scaling_beta but no "
        "original_max_position_embeddings, the length its query scale "
        "steps at: add it.")
  options["score_mod"] = score_mods.query_temperature(
      floor_scale=float(original), attn_scale=float(beta), offset=0)
  notes.append(f"query scale (beta={beta}, every {original} positions)")


def read_norms(read: reading.Reader, params: dict[str, Any],
               options: dict[str, Any], notes: list[str], norm, *, n: int,
               k: int, h: int, whole_width: bool = False,
               names: tuple[str, str] = ("q_norm", "k_norm")) -> None:
  """Reads the qk-norm weights ``norm`` (a ``QKNorm``, True or None/False)
  says the layer has into ``params``; ``whole_width``: stored as ``[N *
  H]`` (OLMo 2), read per head; ``names``: the checkpoint's modules."""
  if norm is None or norm is False:
    return
  norm = QKNorm() if norm is True else norm
  options["normalize_qk"] = norm
  notes.append(f"qk-norm {norm}")
  if norm.weight is None:
    return
  for name, heads, module in (("q", n, names[0]), ("k", k, names[1])):
    if norm.weight == "shared":
      w = read.get(f"{module}.weight", (h,), "qk-norm weight [head_dim]")
    elif whole_width:
      w = read.get(f"{module}.weight", (heads * h,),
                   "qk-norm weight [heads * head_dim], over the whole "
                   "projection").reshape(heads, h)
    else:
      w = read.get(f"{module}.weight", (heads, h),
                   "qk-norm weight [heads, head_dim]")
    params[f"{name}_norm"] = {"scale": w}


def read_sinks(read: reading.Reader, params: dict[str, Any],
               options: dict[str, Any], notes: list[str], n: int) -> None:
  options["attention_sinks"] = True
  notes.append("sinks")
  params["sinks"] = {"logits": read.get("sinks", (n,),
                                        "attention sinks [heads]")}


QWEN_WINDOW = ("sliding_window", "use_sliding_window", "max_window_layers",
         "layer_types")
_GEMMA = ("sliding_window", "layer_types", "query_pre_attn_scalar",
          "attn_logit_softcapping", "use_bidirectional_attention")


# Keys every config of these classes has, which set them apart (a config
# without model_type must have them); "model_type": nothing does.
_REQUIRES = {
    "gemma2": ("query_pre_attn_scalar", "attn_logit_softcapping"),
    "vaultgemma": ("query_pre_attn_scalar", "attn_logit_softcapping"),
    "gemma3": ("query_pre_attn_scalar",),
    "cohere": ("logit_scale",), "cohere2": ("logit_scale",),
    "llama4": ("no_rope_layers", "attention_chunk_size"),
    "granite": ("attention_multiplier",),
    "granitemoe": ("attention_multiplier",),
    "granitemoeshared": ("attention_multiplier",),
    "starcoder2": ("use_bias", "norm_epsilon"),
    "ernie4_5": ("use_bias",), "ernie4_5_moe": ("use_bias",),
    "seed_oss": ("attention_out_bias",), "glm4_moe": ("use_qk_norm",),
    "qwen2": ("use_sliding_window", "max_window_layers"),
    "qwen3": ("use_sliding_window", "max_window_layers"),
    "qwen2_moe": ("use_sliding_window", "max_window_layers"),
    "qwen3_moe": ("use_sliding_window",), "dots1": ("max_window_layers",),
    "smollm3": ("no_rope_layers",),
    "helium": ("model_type",), "glm": ("model_type",),
    "ministral3": ("model_type",),
    "glm4": ("model_type",),
}


def _family(name: str, model_types: tuple[str, ...], reads: tuple[str, ...],
            maps: str, **kwargs) -> registry.Family:
  def build_family(cfg, layer, read, overrides, attention):
    return build(cfg, name, layer, read, overrides, attention)
  traits = _TRAITS[name]
  anchor = "qkv_proj.weight" if traits.fused_qkv else "q_proj.weight"
  # What their config classes carry and HF's code does not read: a
  # partial_rotary_factor where the whole head rotates (refused with a
  # scaled rope type, config_rope.rope), layer_types where every layer
  # slides (Mistral's model windows all of them whatever it says).
  ignores = tuple(key for key, ignored in (
      ("partial_rotary_factor", not traits.partial_rotary),
      ("layer_types", name in config_rope.EVERY_LAYER)) if ignored)
  return registry.Family(
      name=name, model_types=model_types, reads=reads, build=build_family,
      prefix="layers.{layer}.self_attn.", anchor=anchor, maps=maps,
      fused=("qkv_proj",) if traits.fused_qkv else (), ignores=ignores,
      requires=_REQUIRES.get(name, ()), **kwargs)


FAMILIES = (
    _family("llama", ("llama",), (),
            "attention_bias; rope (default, linear, dynamic, llama3, yarn)"),
    _family("mistral", ("mistral",), ("sliding_window",),
            "no biases; sliding_window on every layer; rope"),
    _family("mixtral", ("mixtral",), ("sliding_window",),
            "no biases; sliding_window on every layer; rope"),
    _family("starcoder2", ("starcoder2",), ("sliding_window", "use_bias"),
            "use_bias (all four); sliding_window on every layer; rope"),
    _family("qwen2", ("qwen2",), QWEN_WINDOW,
            "q/k/v biases; window from max_window_layers with "
            "use_sliding_window; rope"),
    _family("qwen3", ("qwen3",), QWEN_WINDOW,
            "qk-norm RMSNorm [H] (rms_norm_eps); attention_bias; Qwen's "
            "window; rope"),
    _family("qwen3_next", ("qwen3_next",),
            ("layer_types", "partial_rotary_factor"),
            "full_attention layers: q_proj with the output gate, qk-norm "
            "1 + w [H], partial rotary"),
    _family("gemma2", ("gemma2",), _GEMMA,
            "query_pre_attn_scalar scale; attn_logit_softcapping; "
            "alternating sliding/global layers"),
    _family("gemma3", ("gemma3_text", "gemma3"),
            (*_GEMMA, "rope_local_base_freq", "sliding_window_pattern",
             "_sliding_window_pattern"),
            "qk-norm 1 + w [H]; Gemma 2's scale; layer_types; local and "
            "global rotary bases"),
    _family("gpt_oss", ("gpt_oss",), ("sliding_window", "layer_types"),
            "biases; sinks [N]; alternating window; yarn rope"),
    _family("olmo2", ("olmo2",), (),
            "qk-norm RMSNorm over the whole width ([N * H], [K * H]); "
            "attention_bias; rope"),
    _family("cohere", ("cohere",), ("logit_scale", "use_qk_norm"),
            "interleaved rotary; use_qk_norm: LayerNorm per head [N, H] "
            "(layer_norm_eps); attention_bias"),
    _family("cohere2", ("cohere2",),
            ("logit_scale", "sliding_window", "layer_types",
             "sliding_window_pattern", "_sliding_window_pattern"),
            "interleaved rotary on sliding layers, none on global ones; "
            "layer_types; attention_bias"),
    _family("phi3", ("phi3",),
            ("sliding_window", "partial_rotary_factor"),
            "fused qkv_proj; partial rotary; longrope; sliding_window"),
    _family("llama4", ("llama4_text", "llama4"),
            ("attention_chunk_size", "no_rope_layers", "use_qk_norm",
             "layer_types", "attn_temperature_tuning", "floor_scale",
             "attn_scale", "no_rope_layer_interval"),
            "RoPE layers: interleaved rotary, chunked attention, weightless "
            "qk-norm after rotary; NoPE layers: temperature tuning"),
    _family("granite", ("granite",), ("attention_multiplier",),
            "attention_multiplier as the scale; attention_bias; rope"),
    _family("granitemoe", ("granitemoe",), ("attention_multiplier",),
            "attention_multiplier as the scale; attention_bias; rope"),
    _family("granitemoeshared", ("granitemoeshared",),
            ("attention_multiplier",),
            "attention_multiplier as the scale; attention_bias; rope"),
    _family("arcee", ("arcee",), (), "attention_bias; rope"),
    _family("helium", ("helium",), (),
            "attention_bias on q/k/v; interleaved rotary"),
    _family("glm", ("glm",), ("partial_rotary_factor",),
            "attention_bias on q/k/v; interleaved rotary on "
            "partial_rotary_factor of the head"),
    _family("glm4", ("glm4",), ("partial_rotary_factor",),
            "attention_bias on q/k/v; interleaved rotary on "
            "partial_rotary_factor of the head"),
    _family("glm4_moe", ("glm4_moe",),
            ("partial_rotary_factor", "use_qk_norm"),
            "attention_bias on q/k/v; use_qk_norm: RMSNorm [H]; half-split "
            "rotary on partial_rotary_factor of the head"),
    _family("seed_oss", ("seed_oss",), ("attention_out_bias",),
            "attention_bias (q/k/v), attention_out_bias (o); rope"),
    _family("ernie4_5", ("ernie4_5",), ("use_bias",),
            "use_bias (all four); interleaved rotary"),
    _family("ernie4_5_moe", ("ernie4_5_moe",), ("use_bias",),
            "use_bias (all four); interleaved rotary"),
    _family("nemotron", ("nemotron",), ("partial_rotary_factor",),
            "attention_bias; half-split rotary on partial_rotary_factor of "
            "the head"),
    _family("ministral", ("ministral",),
            ("sliding_window", "layer_types"),
            "no biases; layer_types (sliding_window); rope"),
    _family("qwen2_moe", ("qwen2_moe",), QWEN_WINDOW,
            "q/k/v biases; layer_types or Qwen2-MoE's alternating window "
            "(use_sliding_window, max_window_layers); rope"),
    _family("qwen3_moe", ("qwen3_moe",), QWEN_WINDOW,
            "qk-norm RMSNorm [H]; attention_bias; sliding_window on every "
            "layer with use_sliding_window; rope"),
    _family("dots1", ("dots1",), QWEN_WINDOW,
            "qk-norm RMSNorm [H]; attention_bias; layer_types (window from "
            "max_window_layers); rope"),
    _family("olmo3", ("olmo3",), ("sliding_window", "layer_types"),
            "qk-norm RMSNorm over the whole width; layer_types (3 sliding, "
            "1 full); rope per layer type"),
    _family("exaone4", ("exaone4",),
            ("sliding_window", "layer_types", "sliding_window_pattern"),
            "qk-norm RMSNorm [H]; layer_types; with a window, rotary on "
            "sliding layers only (global NoPE)"),
    _family("smollm3", ("smollm3",),
            ("no_rope_layers", "no_rope_layer_interval", "sliding_window",
             "use_sliding_window", "layer_types"),
            "no_rope_layers (NoPE layers); attention_bias; window on NoPE "
            "layers with use_sliding_window; rope"),
    _family("gemma", ("gemma",), (), "attention_bias; rope (Gemma 1)"),
    _family("ministral3", ("ministral3",), ("sliding_window",),
            "no biases; sliding_window on every layer; yarn rope; the "
            "llama_4_scaling_beta query scale by position"),
    _family("hunyuan_v1_dense", ("hunyuan_v1_dense",), (),
            "attention_bias; qk-norm RMSNorm [H] after rotary "
            "(query_layernorm, key_layernorm); rope, or NTK-alpha (a "
            "dynamic rope with an alpha)"),
    _family("hunyuan_v1_moe", ("hunyuan_v1_moe",), (),
            "attention_bias; qk-norm RMSNorm [H] after rotary "
            "(query_layernorm, key_layernorm); rope, or NTK-alpha (a "
            "dynamic rope with an alpha)"),
    _family("vaultgemma", ("vaultgemma",), _GEMMA,
            "query_pre_attn_scalar scale; attn_logit_softcapping; "
            "layer_types (alternating sliding/global)"),
)
