"""Real checkpoints' attention layers: HF state dicts and configs -> our layer.

Shape glossary: B batch, T length, N query heads, K key/value heads, H head
dim, D model (hidden) dim, L number of layers.

``load_attention_weights(state_dict, family=..., config=..., layer=i)`` reads
one layer's attention weights out of a Hugging Face transformers state dict
and the options the family's modeling code applies to that layer (its
``config.json``), and returns them as ``aj.MultiHeadAttention``'s options and
``aj.multi_head_attention``'s params dict (``W_q`` kernel ``[D, N, H]`` ...
``W_o`` kernel ``[N, H, D]``). What each family maps, as HF's
``modeling_<family>.py`` computes it:

- llama: ``attention_bias`` (all four projections), rope incl. ``llama3`` /
  ``linear`` / ``dynamic`` / ``yarn`` scaling.
- mistral: no biases; ``sliding_window`` on every layer.
- qwen2: q/k/v biases, none on ``o_proj`` (loaded as a zero ``W_o`` bias);
  a window on layers ``>= max_window_layers`` when ``use_sliding_window``.
- qwen3: qk-norm (RMSNorm weight on each head), ``attention_bias``; Qwen's
  window rule.
- gemma2: ``scale = query_pre_attn_scalar ** -0.5``,
  ``attn_logit_softcapping``, sliding and global layers alternating.
- gemma3: qk-norm with Gemma's ``1 + weight`` (folded into the qk-norm scale; a
  bfloat16 checkpoint rounds ``1 + weight`` to bfloat16, where transformers keeps
  it in float32: pass ``dtype=jnp.float32`` for its numbers), the
  Gemma 2 scale, ``layer_types`` (every 6th global), a local rotary base on
  sliding layers and the global base (with its scaling) elsewhere.
- gpt_oss: biases on all four projections, ``sinks [N]``, alternating
  window, yarn rope.
- gpt2: the fused ``c_attn`` (Conv1D ``[D, 3D]``) split into q, k, v;
  ``scale_attn_weights``, ``scale_attn_by_inverse_layer_idx``; no rope.

A sliding window of ``W`` (HF's mask: ``q_idx - kv_idx < W``) is
``aj.Mask(causal=True, window=(W - 1, 0))``. torch is never imported:
tensors are converted through their ``.detach().cpu()`` NumPy view.

Nothing is mapped by a guess: a config of another model type is refused (a
look-alike family can differ where the weights do not show it, e.g.
Cohere's interleaved rotary pairs), and so is a config without
``model_type`` that carries another family's keys, a fused q/k/v weight
(``qkv_proj``, ``query_key_value``, ``Wqkv``, ...), a size whose default
differs between config classes, and rope parameters the layer's type has no
entry for. ``overrides=`` replaces what the loader inferred (``rope``,
``mask``, ``scale``, ``logits_soft_cap``, ``normalize_qk``,
``attention_sinks``) for a port that knows better.
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
import math
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.layers import multi_head
from attention_jax.masking.mask import Mask
from attention_jax.modules.multi_head import MultiHeadAttention
from attention_jax.scores import rope as rope_lib

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3",
            "gpt_oss", "gpt2")

# The config model types each family's code is written for.
_MODEL_TYPES = {
    "llama": ("llama",), "mistral": ("mistral",), "qwen2": ("qwen2",),
    "qwen3": ("qwen3",), "gemma2": ("gemma2",),
    "gemma3": ("gemma3_text", "gemma3"), "gpt_oss": ("gpt_oss",),
    "gpt2": ("gpt2",),
}
# How to port a model no family here reads: never by relabelling its config
# (a look-alike loads with a small error nothing here would notice).
_BY_HAND = (
    "port it by hand: build aj.MultiHeadAttention(d_model=, num_heads=, "
    "num_kv_heads=, head_dim=, use_bias=, mask=, scale=, rope=aj.Rope(...), "
    "...) with the options its modeling code applies, then "
    "module.load_params(params) with W_q/W_k/W_v kernels [D, N|K, H] and "
    "W_o [N, H, D] cut from its weights (docs/usage.md, Porting a model)")
# Config keys that change some model's attention, with what they mean. A
# config without model_type that has one (not None) which the requested
# family's attention does not read is another model's: refused, not loaded
# by a guess.
_SIGNS = {
    "sliding_window": "a sliding window",
    "use_sliding_window": "Qwen's window switch",
    "max_window_layers": "Qwen's window layers",
    "layer_types": "per-layer sliding/full attention",
    "query_pre_attn_scalar": "Gemma's attention scale",
    "attn_logit_softcapping": "Gemma's logit soft cap",
    "use_bidirectional_attention": "Gemma's bidirectional attention",
    "rope_local_base_freq": "Gemma 3's local rotary base",
    "sliding_window_pattern": "Gemma 3's layer pattern",
    "_sliding_window_pattern": "Gemma 3's layer pattern",
    "n_embd": "GPT-2-style sizes", "n_head": "GPT-2-style sizes",
    "scale_attn_weights": "GPT-2's scale switch",
    "scale_attn_by_inverse_layer_idx": "GPT-2's per-layer scale",
    "partial_rotary_factor": "a partial rotary embedding",
    "logit_scale": "Cohere's logit scale", "use_qk_norm": "Cohere's qk-norm",
    "qk_layernorm": "Phi/Persimmon's qk LayerNorm",
    "rotary_pct": "GPT-NeoX's partial rotary",
    "rotary_emb_base": "GPT-NeoX's rotary base",
    "rotary_dim": "GPT-J/CodeGen's partial rotary",
    "alibi": "ALiBi (Falcon)", "multi_query": "multi-query attention",
    "new_decoder_architecture": "Falcon's attention",
    "parallel_attn": "Falcon's parallel attention",
    "attention_multiplier": "Granite's attention scale",
    "kv_lora_rank": "latent attention (DeepSeek)",
    "q_lora_rank": "latent attention (DeepSeek)",
    "clip_qkv": "clipped q/k/v (OLMo, DBRX)",
    "attn_config": "DBRX/MPT attention",
    "position_embedding_type": "an encoder's positions",
}
# The sign keys each family's attention reads (or its config class carries).
_QWEN = ("sliding_window", "use_sliding_window", "max_window_layers",
         "layer_types")
_GEMMA = ("sliding_window", "layer_types", "query_pre_attn_scalar",
          "attn_logit_softcapping", "use_bidirectional_attention")
_READS = {
    "llama": (), "mistral": ("sliding_window",), "qwen2": _QWEN,
    "qwen3": _QWEN, "gemma2": _GEMMA,
    "gemma3": (*_GEMMA, "rope_local_base_freq", "sliding_window_pattern",
               "_sliding_window_pattern"),
    "gpt_oss": ("sliding_window", "layer_types"),
    "gpt2": ("n_embd", "n_head", "scale_attn_weights",
             "scale_attn_by_inverse_layer_idx"),
}
# Fused q/k/v weights no family loader here reads, and whose layout they are.
_FUSED = {
    "qkv_proj": "Phi-3's layout: rows q [N * H], then k [K * H], then v "
                "[K * H]",
    "query_key_value": "GPT-NeoX / Falcon / BLOOM: rows grouped per head, "
                       "in an order each model defines",
    "c_attn": "GPT-2's Conv1D [D, 3D] is family='gpt2'; other models' "
              "c_attn (GPT-BigCode, Qwen 1) have layouts of their own",
    "Wqkv": "MPT / DBRX / ModernBERT: rows q, k, v",
    "W_pack": "Baichuan: rows q, k, v",
}
# The inferred MultiHeadAttention options a port may replace (overrides=);
# sizes and use_bias follow the weights' shapes and the config.
OVERRIDABLE = ("rope", "mask", "scale", "logits_soft_cap", "normalize_qk",
               "attention_sinks")
# HF's default rotary base per family when a config gives none
# (``default_theta`` of the config class; Gemma 3: global, local).
_DEFAULT_THETA = {"gpt_oss": 150000.0, "gemma3": (1e6, 10000.0)}
# transformers' config-class defaults for keys a saved config.json may omit.
_DEFAULT_WINDOW = {"gemma2": 4096, "gemma3": 4096, "mistral": 4096,
                   "qwen2": 4096, "qwen3": 4096, "gpt_oss": 128}
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                 "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
# HF's default attention_bias per family (the config class's).
_DEFAULT_BIAS = {"gpt_oss": True}
# rope_type -> our Rope scaling.
_ROPE_SCALINGS = {"default": "none", "linear": "linear",
                  "dynamic": "dynamic", "llama3": "llama3", "yarn": "yarn"}
# Entries under a layer's prefix that are not weights of the attention:
# GPT-2's causal-mask buffers, old Llama-style checkpoints' rotary buffers.
_IGNORED = {"gpt2": ("bias", "masked_bias")}
_IGNORED_PREFIX = "rotary_emb."
# The options that are the checkpoint's (not to be overridden by module()).
_FIXED = ("d_model", "num_heads", "num_kv_heads", "head_dim", "use_bias",
          "normalize_qk", "mask", "scale", "logits_soft_cap",
          "attention_sinks", "rope")


@dataclasses.dataclass(frozen=True, eq=False)
class LoadedAttention:
  """One checkpoint layer's attention: options and parameters.

  Attributes:
    family: the family it was read as (one of ``FAMILIES``).
    layer: the layer index.
    prefix: the state-dict prefix its weights were read under, e.g.
      ``"model.layers.3.self_attn."``.
    params: ``aj.multi_head_attention``'s params dict (``W_q``, ``W_k``,
      ``W_v``, ``W_o``, with ``q_norm``/``k_norm`` for qk-norm and
      ``sinks`` ``{"logits": [N]}`` for learned sinks), jnp arrays: all the
      layer's weights.
    options: ``aj.MultiHeadAttention`` keyword arguments that reproduce the
      layer (``d_model``, ``num_heads``, ``num_kv_heads``, ``head_dim``,
      ``use_bias``, ``normalize_qk``, ``mask``, ``scale``,
      ``logits_soft_cap``, ``attention_sinks``, ``rope``, ``param_dtype``).
  """

  family: str
  layer: int
  prefix: str
  params: multi_head.Params
  options: Mapping[str, Any]

  @property
  def sinks(self) -> jax.Array | None:
    """The learned sink logits ``[N]`` (gpt-oss), read from ``params``
    (``params["sinks"]["logits"]``), else None."""
    return self.params.get("sinks", {}).get("logits")

  def module(self, *, rngs: nnx.Rngs | None = None,
             **overrides) -> MultiHeadAttention:
    """An ``aj.MultiHeadAttention`` holding this layer's weights.

    Args:
      rngs: for the module's construction (its parameters are then
        replaced, so only a dropout stream draws from it); default
        ``nnx.Rngs(0)``.
      **overrides: other ``MultiHeadAttention`` options (``dtype``,
        ``param_dtype``, ``attention_fn``, ``precision``, ``head_axis``,
        ``dropout_rate``, ...). The options that make up the checkpoint's
        attention (``_FIXED``: sizes, mask, scale, soft cap, sinks, rope)
        are refused here: ``load_attention_weights(..., overrides=)``
        replaces those it infers.

    Raises:
      ValueError: an override of a checkpoint option.
    """
    fixed = sorted(set(overrides) & set(_FIXED))
    if fixed:
      have = ", ".join(f"{k}={self.options.get(k)!r}" for k in fixed)
      raise ValueError(
          f"module() options {fixed} are the checkpoint's (this {self.family} "
          f"layer has {have});"
          f" pass overrides= to load_attention_weights to change "
          f"{[k for k in fixed if k in OVERRIDABLE] or list(OVERRIDABLE)} "
          "(sizes and use_bias follow the weights).")
    options = {**self.options, **overrides}
    mha = MultiHeadAttention(**options,
                             rngs=nnx.Rngs(0) if rngs is None else rngs)
    mha.load_params(self.params)  # sinks included
    return mha


def _as_numpy(x) -> np.ndarray:
  """A torch tensor (any device; bfloat16 included) or array as NumPy."""
  if hasattr(x, "detach"):  # a torch tensor, without importing torch
    x = x.detach().cpu()
    if str(x.dtype) == "torch.bfloat16":  # NumPy has no bfloat16 of its own
      return np.asarray(x.float().numpy()).astype(jnp.bfloat16)
    return np.asarray(x.numpy())
  return np.asarray(x)


def _config_dict(config, family: str) -> dict[str, Any]:
  """The config as a dict (a transformers config object or a mapping)."""
  if isinstance(config, Mapping):
    cfg = dict(config)
  elif hasattr(config, "to_dict") and callable(config.to_dict):
    cfg = dict(config.to_dict())
  else:
    raise TypeError(
        f"config must be a dict (e.g. json.load of config.json) or a "
        f"transformers config object, got {type(config).__name__}.")
  text = cfg.get("text_config")
  if family == "gemma3" and isinstance(text, Mapping):  # multimodal Gemma 3
    cfg = dict(text)
  model_type = cfg.get("model_type")
  if model_type is None:
    signs = sorted(k for k in _SIGNS if cfg.get(k) is not None
                   and k not in _READS[family]
                   and not (k == "partial_rotary_factor"
                            and _is_number(cfg[k]) and cfg[k] >= 1))
    if signs:
      raise ValueError(
          f"config has no model_type, and it has "
          f"{', '.join(f'{k!r} ({_SIGNS[k]})' for k in signs)}, which "
          f"{family} attention does not read: it is another model's config, "
          f"and loading it as {family} would be a guess. Put the model's "
          "model_type (its config.json's) in the config and pass the family "
          f"it names (one of {list(FAMILIES)}); for any other model, "
          f"{_BY_HAND}.")
    return cfg
  if model_type in _MODEL_TYPES[family]:
    return cfg
  owner = [f for f in FAMILIES if model_type in _MODEL_TYPES[f]]
  if owner:
    raise ValueError(
        f"config has model_type={model_type!r}, but family={family!r} reads "
        f"configs of model_type {list(_MODEL_TYPES[family])}: this is a "
        f"{owner[0]} config, pass family={owner[0]!r}.")
  hint = ""
  if (isinstance(text, Mapping)
      and text.get("model_type") in _MODEL_TYPES[family]):
    hint = (f" Its text_config has model_type {text['model_type']!r}: for "
            "the language model's layers pass config['text_config'].")
  raise ValueError(
      f"config has model_type={model_type!r}, which load_attention_weights "
      f"does not read: it maps the families {list(FAMILIES)} (model types "
      f"{sorted(t for f in FAMILIES for t in _MODEL_TYPES[f])}) and no other "
      "model by a guess, since a look-alike can differ where the weights "
      f"do not show it (e.g. interleaved rotary pairs).{hint} To use this "
      f"model, {_BY_HAND}.")


def _is_number(value) -> bool:
  return (isinstance(value, (int, float, np.integer, np.floating))
          and not isinstance(value, bool))


def _require(cfg: Mapping[str, Any], name: str, family: str):
  if cfg.get(name) is None:
    raise ValueError(f"config has no {name!r}, which {family} attention "
                     f"needs; got keys {sorted(cfg)}.")
  return cfg[name]


def _int(cfg: Mapping[str, Any], name: str, family: str) -> int:
  value = _require(cfg, name, family)
  if (isinstance(value, bool) or not isinstance(value, (int, np.integer))
      or value < 1):
    raise ValueError(f"config[{name!r}] must be a positive int, got "
                     f"{value!r}.")
  return int(value)


def _family(family) -> str:
  if not isinstance(family, str):
    raise TypeError(f"family must be a string, one of {list(FAMILIES)}; got "
                    f"{family!r}.")
  name = family.lower().replace("-", "_")
  if name not in FAMILIES:
    raise ValueError(f"unknown family {family!r}: known families are "
                     f"{list(FAMILIES)}.")
  return name


def _layer_type(cfg: Mapping[str, Any], family: str, layer: int) -> str:
  """``"sliding_attention"`` or ``"full_attention"``, as HF's config derives it."""
  if family == "mistral":  # MistralModel windows every layer, layer_types or not
    return "sliding_attention"
  types = cfg.get("layer_types")
  if types is not None:
    if layer >= len(types):
      raise ValueError(f"layer={layer} but config['layer_types'] has "
                       f"{len(types)} entries.")
    kind = types[layer]
    if kind not in ("sliding_attention", "full_attention"):
      raise ValueError(
          f"config['layer_types'][{layer}] is {kind!r}; {family} layers are "
          "'sliding_attention' or 'full_attention'.")
    return kind
  if family in ("gemma2", "gpt_oss"):  # HF: every other layer, from 0
    return "sliding_attention" if (layer + 1) % 2 else "full_attention"
  if family == "gemma3":  # HF: every `sliding_window_pattern`-th is global
    pattern = cfg.get("sliding_window_pattern",
                      cfg.get("_sliding_window_pattern", 6))
    return "sliding_attention" if (layer + 1) % pattern else "full_attention"
  if family in ("qwen2", "qwen3"):  # HF: from max_window_layers on
    return ("sliding_attention" if layer >= cfg.get("max_window_layers", 28)
            else "full_attention")
  return "full_attention"


def _window(cfg: Mapping[str, Any], family: str, layer: int) -> int | None:
  """The layer's sliding window ``W`` (keys with ``q - k < W``), or None."""
  if family in ("llama", "gpt2"):
    return None
  window = cfg.get("sliding_window", _DEFAULT_WINDOW.get(family))
  if family in ("qwen2", "qwen3") and not cfg.get("use_sliding_window",
                                                  False):
    return None  # HF sets sliding_window = None without use_sliding_window
  if window is None or _layer_type(cfg, family, layer) != "sliding_attention":
    return None
  if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or (
      window < 1):
    raise ValueError(f"config['sliding_window'] must be a positive int, got "
                     f"{window!r}.")
  return int(window)


def _rope_parameters(cfg: Mapping[str, Any], family: str,
                     layer: int) -> dict[str, Any]:
  """The layer's rope parameters, new (``rope_parameters``) or old format."""
  kind = _layer_type(cfg, family, layer)
  theta = _DEFAULT_THETA.get(family, 10000.0)
  scaling = cfg.get("rope_scaling")  # old format; HF prefers it
  params = cfg.get("rope_parameters")
  if family == "gemma3":
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
    params = _GPT_OSS_ROPE  # GptOssConfig's default: YaRN, not plain rope
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


def _rope(cfg: Mapping[str, Any], family: str, layer: int) -> rope_lib.Rope:
  """The layer's rotary embedding as an ``aj.Rope`` (HF's rope_type mapped)."""
  p = _rope_parameters(cfg, family, layer)
  rope_type = p.get("rope_type", p.get("type", "default"))
  if rope_type not in _ROPE_SCALINGS:
    raise ValueError(
        f"config's rope_type {rope_type!r} (layer {layer}) is not supported: "
        f"load_attention_weights maps rope types {list(_ROPE_SCALINGS)} to "
        "aj.Rope.")

  def need(name):
    if p.get(name) is None:
      raise ValueError(f"config's rope_type {rope_type!r} needs {name!r} in "
                       f"rope_parameters / rope_scaling (layer {layer}); got "
                       f"{p}.")
    return p[name]

  # These families' modeling code rotates the whole head: transformers'
  # default rope never reads partial_rotary_factor, and with a scaled rope
  # type a factor below 1 makes its frequencies and its head disagree.
  partial = p.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
  if partial is not None and float(partial) < 1.0 and rope_type != "default":
    raise ValueError(
        f"config's partial_rotary_factor={partial} with rope_type "
        f"{rope_type!r} (layer {layer}): {family}'s attention rotates the "
        "whole head, and transformers cannot run this combination either.")
  fields = dict(base=float(p["rope_theta"]), scaling=_ROPE_SCALINGS[rope_type])
  max_positions = cfg.get("max_position_embeddings")
  # HF's standardisation: a top-level original_max_position_embeddings wins,
  # then rope_parameters', then max_position_embeddings.
  original = cfg.get("original_max_position_embeddings",
                     p.get("original_max_position_embeddings", max_positions))
  if rope_type in ("linear", "dynamic", "llama3"):
    fields["factor"] = float(need("factor"))
  if rope_type == "dynamic":  # HF's dynamic NTK reads max_position_embeddings
    fields["original_max_positions"] = _int(cfg, "max_position_embeddings",
                                            family)
  if rope_type == "llama3":
    fields.update(original_max_positions=original,
                  low_freq_factor=float(need("low_freq_factor")),
                  high_freq_factor=float(need("high_freq_factor")))
  if rope_type == "yarn":
    factor = p.get("factor")
    if factor is None and max_positions and original:  # HF: the context ratio
      factor = max_positions / original
    fields["factor"] = float(need("factor") if factor is None else factor)
    # HF: `or` defaults (None and 0 mean 32 and 1).
    fields.update(original_max_positions=original,
                  beta_fast=float(p.get("beta_fast") or 32.0),
                  beta_slow=float(p.get("beta_slow") or 1.0),
                  truncate=bool(p.get("truncate", True)))
    if p.get("attention_factor") is not None:
      fields["attention_factor"] = float(p["attention_factor"])
    elif p.get("mscale") and p.get("mscale_all_dim"):  # HF ignores a lone one
      fields.update(mscale=float(p["mscale"]),
                    mscale_all_dim=float(p["mscale_all_dim"]))
  try:
    return rope_lib.Rope(**fields)
  except (TypeError, ValueError) as e:
    raise ValueError(f"config's rope parameters {p} (layer {layer}) do not "
                     f"make an aj.Rope: {e}") from e


def _find_prefix(state: Mapping[str, Any], family: str, layer: int) -> str:
  """The layer's attention prefix, found by its query weight's name."""
  tail = (f"h.{layer}.attn.c_attn.weight" if family == "gpt2"
          else f"layers.{layer}.self_attn.q_proj.weight")
  found = sorted(k[:-len(tail.split(".", 3)[-1])] for k in state
                 if (k == tail or k.endswith("." + tail))
                 and "vision" not in k)  # a multimodal model's image tower
  if not found:
    _refuse_fused(state, family, layer, prefix=None)
  if len(found) != 1:
    example = "transformer." if family == "gpt2" else "model."
    raise ValueError(
        f"state_dict has {'no key' if not found else 'several keys'} ending "
        f"in {tail!r}{'' if not found else f' (prefixes {found})'}: pass "
        f"prefix= (the layer's attention prefix, e.g. "
        f"{example + tail.rsplit('.', 2)[0] + '.'!r}).")
  return found[0]


def _refuse_fused(state: Mapping[str, Any], family: str, layer: int, *,
                  prefix: str | None) -> None:
  """Raises if the layer's q/k/v are one fused weight (not a prefix problem).

  Looks under ``prefix`` if given, else at keys of layer ``layer``: a key
  ``... .<layer>. ... .<fused name>.weight`` outside a vision tower.
  """
  own = ("c_attn",) if family == "gpt2" else ()
  hits = []
  for key in state:
    parts = key.split(".")
    if (len(parts) < 2 or parts[-1] != "weight" or parts[-2] not in _FUSED
        or parts[-2] in own or "vision" in key or "visual" in key):
      continue
    if (key.startswith(prefix) if prefix is not None
        else str(layer) in parts[:-2]):
      hits.append(key)
  if not hits:
    return
  key = sorted(hits)[0]
  name = key.split(".")[-2]
  reads = ("c_attn (GPT-2's Conv1D)" if family == "gpt2"
           else "separate q_proj, k_proj and v_proj weights")
  raise ValueError(
      f"state_dict has {key!r}: a fused q/k/v projection ({_FUSED[name]}). "
      f"The {family} loader does not read this layout (it reads {reads}), "
      "and no prefix= changes that. To proceed: load it with the family it "
      f"belongs to if that is one of {list(FAMILIES)}; or split it by hand "
      "into q_proj.weight [N * H, D], k_proj.weight [K * H, D] and "
      "v_proj.weight [K * H, D] (in the row order its modeling code uses) "
      "and pass that state dict; or "
      f"{_BY_HAND}.")


class _Reader:
  """Takes a layer's tensors by name, with messages that name key and prefix."""

  def __init__(self, state: Mapping[str, Any], prefix: str, family: str,
               layer: int):
    self.state, self.prefix = state, prefix
    self.family, self.layer = family, layer
    self.taken: set[str] = set()

  def under(self) -> list[str]:
    return sorted(k for k in self.state if k.startswith(self.prefix))

  def get(self, name: str, shape: tuple[int, ...], why: str) -> np.ndarray:
    key = self.prefix + name
    if key not in self.state:
      _refuse_fused(self.state, self.family, self.layer, prefix=self.prefix)
      raise ValueError(
          f"state_dict has no {key!r} ({self.family} layer {self.layer}, "
          f"prefix {self.prefix!r}; {why}). Keys under that prefix: "
          f"{[k[len(self.prefix):] for k in self.under()]}. Pass prefix= if "
          "the checkpoint names this layer's attention differently.")
    value = _as_numpy(self.state[key])
    if value.shape != shape:
      raise ValueError(
          f"state_dict[{key!r}] has shape {value.shape}, expected {shape} "
          f"({why}).")
    self.taken.add(key)
    return value

  def check_all_taken(self, why: str) -> None:
    ignored = _IGNORED.get(self.family, ())
    unused = [k for k in self.under() if k not in self.taken
              and k[len(self.prefix):] not in ignored
              and not k[len(self.prefix):].startswith(_IGNORED_PREFIX)]
    if unused:
      raise ValueError(
          f"state_dict has {unused} under prefix {self.prefix!r}, which the "
          f"{self.family} attention this config describes does not use "
          f"({why}). Check the config (e.g. attention_bias) matches the "
          "checkpoint, or the prefix.")


def _dtype(arrays: Mapping[str, np.ndarray], dtype) -> jnp.dtype:
  if dtype is not None:
    return jnp.dtype(dtype)
  first = np.asarray(next(iter(arrays.values())))
  if not jnp.issubdtype(first.dtype, jnp.floating):
    raise TypeError(f"the checkpoint's weights have dtype {first.dtype}; "
                    "pass dtype= (e.g. jnp.float32) to convert them.")
  return jnp.dtype(first.dtype)


def _size(cfg: Mapping[str, Any], name: str, family: str, derived: int,
          derives: tuple[str, ...], how: str) -> int:
  """A size key, or ``derived`` where the family's config class derives it.

  Other config classes default a missing key to a fixed number of their own
  (not ``derived``); there a missing key is refused rather than guessed.
  """
  if cfg.get(name) is not None:
    return _int(cfg, name, family)
  if family in derives:
    return derived
  raise ValueError(
      f"config has no {name!r}: {family}'s config class gives it a default "
      f"of its own, not necessarily {how}={derived}, so the loader does not "
      f"guess it; add it to the config (its config.json has it).")


def _decoder(cfg, family: str, layer: int, read: _Reader,
             overrides: Mapping[str, Any]) -> tuple[
                 dict[str, Any], dict[str, Any], str]:
  """llama-style layers: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``."""
  d = _int(cfg, "hidden_size", family)
  n = _int(cfg, "num_attention_heads", family)
  # LlamaConfig maps a missing num_key_value_heads to the head count, and
  # Llama/Mistral/Qwen 2 a missing head_dim to hidden_size // heads.
  k = _size(cfg, "num_key_value_heads", family, n, ("llama",),
            "num_attention_heads")
  h = _size(cfg, "head_dim", family, d // n, ("llama", "mistral", "qwen2"),
            "hidden_size // num_attention_heads")
  if family == "qwen2":  # fixed in Qwen2Attention
    biases, bias_note = ("q", "k", "v"), "Qwen2: q/k/v biases, none on o_proj"
  elif family == "mistral":
    biases, bias_note = (), "Mistral: no biases"
  else:
    flag = bool(cfg.get("attention_bias", _DEFAULT_BIAS.get(family, False)))
    biases = ("q", "k", "v", "o") if flag else ()
    bias_note = f"config attention_bias={flag}"
  dims = f"hidden_size={d}, heads={n}, kv_heads={k}, head_dim={h}"
  out_shapes = {"q": (n, h), "k": (k, h), "v": (k, h)}
  params: dict[str, dict[str, np.ndarray]] = {}
  for name, (heads, _) in out_shapes.items():
    w = read.get(f"{name}_proj.weight", (heads * h, d),
                 f"[heads * head_dim, hidden_size]; {dims}")
    params[f"W_{name}"] = {"kernel": w.T.reshape(d, heads, h)}  # [D, *, H]
    if name in biases:
      b = read.get(f"{name}_proj.bias", (heads * h,), bias_note)
      params[f"W_{name}"]["bias"] = b.reshape(heads, h)
  w = read.get("o_proj.weight", (d, n * h),
               f"[hidden_size, heads * head_dim]; {dims}")
  params["W_o"] = {"kernel": w.T.reshape(n, h, d)}  # [N, H, D]
  if "o" in biases:
    params["W_o"]["bias"] = read.get("o_proj.bias", (d,), bias_note)
  use_bias = bool(biases)
  if use_bias and "o" not in biases:  # our module: all four or none
    params["W_o"]["bias"] = np.zeros((d,), params["W_o"]["kernel"].dtype)
  options: dict[str, Any] = dict(d_model=d, num_heads=n, num_kv_heads=k,
                                 head_dim=h, use_bias=use_bias)
  notes = [bias_note]
  if family in ("qwen3", "gemma3") and overrides.get("normalize_qk", True):
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    if not math.isclose(eps, multi_head.QK_NORM_EPSILON, rel_tol=1e-9):
      raise ValueError(
          f"config rms_norm_eps={eps}, but aj.MultiHeadAttention's qk-norm "
          f"adds epsilon={multi_head.QK_NORM_EPSILON} (fixed): this "
          f"checkpoint's {family} q_norm/k_norm would not be reproduced.")
  if family in ("gemma2", "gemma3"):
    if cfg.get("use_bidirectional_attention") and "mask" not in overrides:
      raise ValueError(
          "config use_bidirectional_attention=True (Gemma's encoder use, no "
          "causal mask) is not supported: load_attention_weights builds "
          "causal decoder layers (overrides={'mask': ...} sets the mask).")
    if "scale" not in overrides:
      options["scale"] = float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5
  if family == "gemma2" and "logits_soft_cap" not in overrides:
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
    window = _window(cfg, family, layer)
    options["mask"] = Mask(causal=True, window=None if window is None
                           else (window - 1, 0))
  if "rope" not in overrides:
    options["rope"] = _rope(cfg, family, layer)
  _norms_and_sinks(
      family, read, params, options, notes, h=h, n=n,
      qk_norm=overrides.get("normalize_qk", family in ("qwen3", "gemma3")),
      with_sinks=overrides.get("attention_sinks", family == "gpt_oss"))
  return params, options, "; ".join(notes)


def _norms_and_sinks(family: str, read: _Reader, params: dict[str, Any],
                     options: dict[str, Any], notes: list[str], *, h: int,
                     n: int, qk_norm: bool, with_sinks: bool) -> None:
  """Reads qk-norm scales ``[H]`` and sinks ``[N]`` into ``params`` where the
  layer has them."""
  if qk_norm:
    for name in ("q", "k"):
      w = read.get(f"{name}_norm.weight", (h,), "qk-norm scale [head_dim]")
      if family == "gemma3":  # Gemma3RMSNorm multiplies by (1 + weight)
        w = (1.0 + w.astype(np.float64)).astype(w.dtype)
      params[f"{name}_norm"] = {"scale": w}
    options["normalize_qk"] = True
    notes.append("qk-norm")
  if not with_sinks:
    return
  options["attention_sinks"] = True
  notes.append("sinks")
  params["sinks"] = {"logits": read.get("sinks", (n,),
                                        "attention sinks [heads]")}


def _gpt2(cfg, layer: int, read: _Reader, overrides: Mapping[str, Any]
          ) -> tuple[dict[str, Any], dict[str, Any], str]:
  """GPT-2: Conv1D ``c_attn [D, 3D]`` (columns q, k, v) and ``c_proj``."""
  d = int(cfg.get("n_embd") or _int(cfg, "hidden_size", "gpt2"))
  n = int(cfg.get("n_head") or _int(cfg, "num_attention_heads", "gpt2"))
  if d % n:
    raise ValueError(f"config n_embd={d} is not divisible by n_head={n}.")
  h = d // n
  w = read.get("c_attn.weight", (d, 3 * d), "Conv1D [n_embd, 3 * n_embd]")
  b = read.get("c_attn.bias", (3 * d,), "[3 * n_embd]")
  params = {}
  for i, name in enumerate(("W_q", "W_k", "W_v")):  # Conv1D: x @ w + b
    params[name] = {"kernel": w[:, i * d:(i + 1) * d].reshape(d, n, h),
                    "bias": b[i * d:(i + 1) * d].reshape(n, h)}
  params["W_o"] = {
      "kernel": read.get("c_proj.weight", (d, d),
                         "Conv1D [n_embd, n_embd]").reshape(n, h, d),
      "bias": read.get("c_proj.bias", (d,), "[n_embd]")}
  scale = h ** -0.5 if cfg.get("scale_attn_weights", True) else 1.0
  if cfg.get("scale_attn_by_inverse_layer_idx", False):
    scale /= float(layer + 1)
  options = dict(d_model=d, num_heads=n, num_kv_heads=n, head_dim=h,
                 use_bias=True, mask=Mask(causal=True),
                 scale=None if scale == h ** -0.5 else scale)
  # reorder_and_upcast_attn computes the same scores in float32, as we do.
  notes = ["GPT-2: biases on c_attn and c_proj"]
  _norms_and_sinks(
      "gpt2", read, params, options, notes, h=h, n=n,
      qk_norm=overrides.get("normalize_qk", False),
      with_sinks=overrides.get("attention_sinks", False))
  return params, options, "; ".join(notes)


def _overrides(overrides) -> dict[str, Any]:
  """``overrides=`` checked: known names; bools bools; rope as an aj.Rope."""
  if overrides is None:
    return {}
  if not isinstance(overrides, Mapping):
    raise TypeError(f"overrides must be a dict of aj.MultiHeadAttention "
                    f"options (names {list(OVERRIDABLE)}), got "
                    f"{type(overrides).__name__}.")
  unknown = sorted(str(k) for k in overrides if k not in OVERRIDABLE)
  if unknown:
    window = (" (a window W is mask=aj.Mask(causal=True, window=(W - 1, "
              "0)))" if "window" in unknown else "")
    raise ValueError(
        f"overrides has {unknown}, which load_attention_weights does not "
        f"infer: the options it can override are {list(OVERRIDABLE)}"
        f"{window}. Sizes and use_bias follow the weights' shapes and the "
        "config; other options (dtype, precision, attention_fn, score_mod, "
        "...) go to .module().")
  out = dict(overrides)
  for name in ("normalize_qk", "attention_sinks"):
    if name in out and not isinstance(out[name], (bool, np.bool_)):
      raise TypeError(f"overrides[{name!r}] must be a bool (whether the "
                      f"layer has it), got {out[name]!r}.")
    if name in out:
      out[name] = bool(out[name])
  if "rope" in out:
    out["rope"] = rope_lib.as_rope(out["rope"])
  return out


def load_attention_weights(
    state_dict: Mapping[str, Any],
    *,
    family: str,
    config: Any,
    layer: int,
    prefix: str | None = None,
    dtype: jnp.dtype | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> LoadedAttention:
  """One layer's attention of an HF checkpoint, as our layer's options and params.

  Args:
    state_dict: HF names to arrays: a model's ``state_dict()`` (torch
      tensors, any device, bfloat16 included) or NumPy arrays (e.g. from
      ``safetensors.numpy.load_file``). Only the layer's attention entries
      are read; every other entry under its prefix must be one this
      family's attention uses (an unused ``o_proj.bias`` is an error, not
      ignored).
    family: one of ``FAMILIES``: ``"llama"``, ``"mistral"``, ``"qwen2"``,
      ``"qwen3"``, ``"gemma2"``, ``"gemma3"``, ``"gpt_oss"`` (or
      ``"gpt-oss"``), ``"gpt2"``.
    config: the model's config: a dict (``json.load`` of its
      ``config.json``; old ``rope_scaling``/``rope_theta`` or new
      ``rope_parameters`` format) or a transformers config object (read via
      ``to_dict()``); a multimodal Gemma 3 config's ``text_config`` is used.
    layer: the layer index, ``0 <= layer < num_hidden_layers``.
    prefix: the layer's attention prefix in ``state_dict`` (e.g.
      ``"model.layers.3.self_attn."``); by default found as the one key
      ending in ``layers.{layer}.self_attn.q_proj.weight`` (GPT-2:
      ``h.{layer}.attn.c_attn.weight``), which covers ``model.``,
      ``model.language_model.`` and base-model (no prefix) checkpoints.
    dtype: the params' dtype; None keeps the checkpoint's (bfloat16 stays
      bfloat16). Also the module's ``param_dtype``.
    overrides: ``aj.MultiHeadAttention`` options that replace what the
      loader infers from the config, by name (``OVERRIDABLE``): ``rope``
      (an ``aj.Rope``, a base, or None; the config's rope is then not read,
      so an unsupported rope type there is no obstacle), ``mask`` (an
      ``aj.Mask``: a window ``W`` is ``aj.Mask(causal=True, window=(W - 1,
      0))``), ``scale``, ``logits_soft_cap``, ``normalize_qk`` (True reads
      ``q_norm.weight``/``k_norm.weight [H]`` under the prefix, as the
      module's RMSNorm with epsilon ``1e-6``) and ``attention_sinks`` (True
      reads ``sinks [N]``). For a port whose modeling code differs from the
      family's in these only, e.g. ``{"rope": aj.Rope(base=1e4,
      interleaved=True)}``. Sizes and ``use_bias`` follow the weights and
      the config.

  Returns:
    A ``LoadedAttention``: ``.params`` (``aj.multi_head_attention``'s
    params dict), ``.options`` (``aj.MultiHeadAttention`` keywords),
    ``.sinks`` (``[N]`` or None, from ``.params``) and
    ``.module(rngs=...)``, the layer built.

  Raises:
    ValueError: an unknown family (the known ones listed); a config of
      another model type (or without one, with another family's keys), a
      fused q/k/v weight, an unknown ``overrides`` name (the valid ones
      listed), a missing config key, an option we cannot
      reproduce (a rope type without an ``aj.Rope`` scaling, a qk-norm
      epsilon other than ``1e-6``, bidirectional Gemma); a missing or
      unused state-dict key (named with the prefix); a wrong shape (named,
      with the expected one).
    TypeError: ``config`` neither a dict nor a config object; ``layer`` not
      an int; ``overrides`` not a mapping, or a bool override that is not a
      bool.

  Example:
    >>> D, N, K, H = 8, 2, 1, 4
    >>> rng = np.random.default_rng(0)
    >>> w = lambda *shape: rng.normal(size=shape).astype(np.float32)
    >>> p = "model.layers.0.self_attn."
    >>> sd = {p + "q_proj.weight": w(N * H, D), p + "k_proj.weight": w(K * H, D),
    ...       p + "v_proj.weight": w(K * H, D), p + "o_proj.weight": w(D, N * H)}
    >>> cfg = {"hidden_size": D, "num_attention_heads": N,
    ...        "num_key_value_heads": K, "num_hidden_layers": 1,
    ...        "sliding_window": 4, "rope_theta": 10000.0}
    >>> loaded = load_attention_weights(sd, family="mistral", config=cfg,
    ...                                 layer=0)
    >>> loaded.options["mask"].window, loaded.options["use_bias"]
    ((3, 0), False)
    >>> loaded.params["W_q"]["kernel"].shape      # [D, N, H]
    (8, 2, 4)
    >>> loaded.module()(jnp.ones((1, 5, D))).shape
    (1, 5, 8)
  """
  family = _family(family)
  if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
    raise TypeError(f"layer must be an int (the layer index), got {layer!r}.")
  layer = int(layer)
  if not isinstance(state_dict, Mapping):
    raise TypeError(f"state_dict must be a mapping of HF names to arrays "
                    f"(model.state_dict()), got {type(state_dict).__name__}.")
  overrides = _overrides(overrides)
  cfg = _config_dict(config, family)
  count = cfg.get("n_layer" if family == "gpt2" else "num_hidden_layers")
  if layer < 0 or (count is not None and layer >= count):
    raise ValueError(f"layer={layer} is out of range: the config has "
                     f"{count} layers (0 <= layer < {count}).")
  if prefix is None:
    prefix = _find_prefix(state_dict, family, layer)
  elif not isinstance(prefix, str):
    raise TypeError(f"prefix must be a string such as "
                    f"'model.layers.{layer}.self_attn.', got {prefix!r}.")
  elif prefix and not prefix.endswith("."):
    prefix += "."
  read = _Reader(state_dict, prefix, family, layer)
  if family == "gpt2":
    arrays, options, notes = _gpt2(cfg, layer, read, overrides)
  else:
    arrays, options, notes = _decoder(cfg, family, layer, read, overrides)
  read.check_all_taken(notes)
  options.update(overrides)
  param_dtype = _dtype(arrays["W_q"], dtype)
  params = {name: {entry: jnp.asarray(value, param_dtype)
                   for entry, value in entries.items()}
            for name, entries in arrays.items()}
  options["param_dtype"] = param_dtype
  return LoadedAttention(
      family=family, layer=layer, prefix=prefix, params=params,
      options=options)
