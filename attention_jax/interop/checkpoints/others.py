"""Decoder families with separate q/k/v projections and options beyond Llama's.

Shape glossary: D hidden size, N query heads, K key/value heads, H head dim.

What each family's HF ``modeling_<family>.py`` computes, under
``model.layers.{i}.self_attn.`` (``q_proj``, ``k_proj``, ``v_proj`` ``[N *
H | K * H, D]``; the output projection ``[D, N * H]``), half-split rotary
pairs and a causal mask in all of them:

- stablelm: biases on q/k/v with ``use_qkv_bias`` (none on ``o_proj``);
  with ``qk_layernorm`` a bias-free ``nn.LayerNorm(H)`` per head
  (``q_layernorm.norms.{j}.weight``, ``layer_norm_eps``) before rotary;
  rotary on the first ``int(H * partial_rotary_factor)`` features (0.25
  when the config gives none); ``H = D // N``.
- olmo: ``attention_bias`` (all four); q, k and v clipped to ``[-clip_qkv,
  clip_qkv]`` (biases included) before rotary.
- olmoe: OLMo's, with ``q_norm [D]`` / ``k_norm [K * H]``: RMSNorm over the
  whole projection width (``rms_norm_eps``), read per head; HF clips
  *after* that norm, which the layer (clipping before its norms) does not
  reproduce: a ``clip_qkv`` is refused.
- phi (Phi-1/2): biases on all four (``dense`` the output); with
  ``qk_layernorm`` one ``nn.LayerNorm(H)`` with a bias shared by the heads
  (``layer_norm_eps``); partial rotary (0.5 when the config gives none).
- bitnet (its float weights): ``attention_bias``; ``attn_sub_norm``, an
  RMSNorm ``[D]`` (``rms_norm_eps``) over the heads' concatenated output
  before ``o_proj``: ``output_norm=aj.QKNorm(over="all",
  weight="per_head")`` with ``o_norm`` ``[N, H]``; rotary base 500000 when
  the config gives none. A quantized checkpoint (``quantization_config``:
  ternary weights, int8 activations) is refused.

A config without ``head_dim`` uses ``D // N`` where the family's code
does; the clip value must be positive (HF clamps to ``[0, 0]`` at 0).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from attention_jax.interop.checkpoints import config_rope
from attention_jax.interop.checkpoints import decoders
from attention_jax.interop.checkpoints import reading
from attention_jax.interop.checkpoints import registry
from attention_jax.layers import multi_head_config
from attention_jax.layers.qk_norm import QKNorm
from attention_jax.masking.mask import Mask
from attention_jax.scores import rope as rope_lib

# Where each family keeps its qk-norm weights: stablelm one LayerNorm per
# head (``q_layernorm.norms.{j}``), phi/persimmon one shared LayerNorm
# (``q_layernorm``), olmoe one RMSNorm over the width (``q_norm [N * H]``).
_NORM_LAYOUT = {"stablelm": "per_head_modules", "phi": "shared_module",
                "persimmon": "shared_module", "olmoe": "whole_width"}
# Config classes whose partial_rotary_factor defaults below 1 (their
# __post_init__'s "assign default for BC").
_PARTIAL = {"stablelm": 0.25, "phi": 0.5, "persimmon": 0.5}
# Config classes whose rotary base defaults to another than 10000.
_THETA = {"bitnet": 500000.0}


def sizes(cfg: Mapping[str, Any], family: str, *, kv_derived: bool,
          head_dim_key: bool) -> tuple[int, int, int, int]:
  """``(D, N, K, H)``: K from ``num_key_value_heads`` (``N`` where the
  config class derives it, refused where its default is a number of its
  own); H from ``head_dim`` where the family's code reads it, else ``D //
  N``."""
  d = reading.positive_int(cfg, "hidden_size", family)
  n = reading.positive_int(cfg, "num_attention_heads", family)
  k = reading.size(cfg, "num_key_value_heads", family, n,
                   (family,) if kv_derived else (), "num_attention_heads")
  if n % k:
    raise ValueError(f"config num_key_value_heads={k} does not divide "
                     f"num_attention_heads={n} (HF's repeat_kv fails too).")
  if head_dim_key and cfg.get("head_dim") is not None:
    return d, n, k, reading.positive_int(cfg, "head_dim", family)
  if d % n:
    raise ValueError(f"config hidden_size={d} is not divisible by "
                     f"num_attention_heads={n}: {family}'s head dim is "
                     "hidden_size // num_attention_heads.")
  if cfg.get("head_dim") not in (None, d // n):
    raise ValueError(
        f"config head_dim={cfg['head_dim']}, but {family}'s attention uses "
        f"hidden_size // num_attention_heads = {d // n} (its rotary table "
        "would read head_dim): remove head_dim from the config.")
  return d, n, k, d // n


def separate_qkv(read: reading.Reader, *, d: int, n: int, k: int, h: int,
                 biases: bool, note: str) -> dict[str, dict[str, Any]]:
  """``W_q``, ``W_k``, ``W_v`` from ``q_proj``, ``k_proj``, ``v_proj``."""
  dims = f"hidden_size={d}, heads={n}, kv_heads={k}, head_dim={h}"
  params = {}
  for name, heads in (("q", n), ("k", k), ("v", k)):
    w = read.get(f"{name}_proj.weight", (heads * h, d),
                 f"[heads * head_dim, hidden_size]; {dims}")
    params[f"W_{name}"] = {"kernel": w.T.reshape(d, heads, h)}
    if biases:
      params[f"W_{name}"]["bias"] = read.get(
          f"{name}_proj.bias", (heads * h,), note).reshape(heads, h)
  return params


def output(read: reading.Reader, name: str, *, d: int, n: int, h: int,
           bias: bool | None, note: str) -> dict[str, Any]:
  """``W_o`` from ``<name>.weight [D, N * H]``; ``bias``: True reads
  ``<name>.bias``, False none, None a zero one (the module's biases are
  all four or none: q/k/v biases without an output one)."""
  w = read.get(f"{name}.weight", (d, n * h),
               f"[hidden_size, heads * head_dim]; hidden_size={d}, "
               f"heads={n}, head_dim={h}")
  out = {"kernel": w.T.reshape(n, h, d)}
  if bias:
    out["bias"] = read.get(f"{name}.bias", (d,), note)
  elif bias is None:
    out["bias"] = np.zeros((d,), w.dtype)
  return out


def clip_value(value: Any, where: str) -> float | None:
  """A config's clip_qkv (None: no clipping) as the layer's ``clip_qkv``;
  any other value must be a positive finite number."""
  if value is None:
    return None
  try:
    return multi_head_config.check_clip_qkv(value)
  except (TypeError, ValueError) as e:
    raise ValueError(
        f"{where}={value!r}: HF clamps the projections to [-clip_qkv, "
        f"clip_qkv], and the loader maps a positive finite number ({e})"
    ) from None


def family_rope(cfg: Mapping[str, Any], family: str,
                layer: int) -> rope_lib.Rope:
  """The family's half-split rotary, with its config class's defaults for
  what a config leaves out, as HF's standardisation fills them in: the
  rope parameters' value wins, then the top-level key, then the class's
  default (``_THETA``; ``_PARTIAL``: rotary on ``int(H * factor)``
  features)."""
  p = config_rope.rope_parameters(cfg, family, layer)
  extra = {}
  if family in _THETA and cfg.get("rope_theta") is None and (
      "rope_theta" not in (cfg.get("rope_scaling") or cfg.get(
          "rope_parameters") or {})):
    extra["rope_theta"] = _THETA[family]
  if (family in _PARTIAL and "partial_rotary_factor" not in p
      and cfg.get("partial_rotary_factor") is None):
    extra["partial_rotary_factor"] = _PARTIAL[family]
  return config_rope.rope({**cfg, **extra}, family, layer,
                          partial=family in _PARTIAL)


def _norm_weights(read: reading.Reader, name: str, layout: str,
                  norm: QKNorm, heads: int, h: int) -> dict[str, Any]:
  """One of q/k's norm weights (and biases) in the family's layout."""
  want = "per_head" if layout != "shared_module" else "shared"
  if norm.weight != want:
    raise ValueError(
        f"normalize_qk={norm} reads weights as weight={norm.weight!r}, but "
        f"this family stores its {name}-norm weights "
        f"{'per head' if want == 'per_head' else 'shared by the heads'}: "
        f"pass an aj.QKNorm with weight={want!r}.")
  entry = {}
  for field in ("weight", "bias") if norm.bias else ("weight",):
    key = "scale" if field == "weight" else "bias"
    if layout == "per_head_modules":  # one nn.LayerNorm(H) per head
      entry[key] = np.stack([read.get(
          f"{name}_layernorm.norms.{j}.{field}", (h,),
          f"head {j}'s LayerNorm {field} [head_dim]") for j in range(heads)])
    elif layout == "shared_module":  # one nn.LayerNorm(H), every head
      entry[key] = read.get(f"{name}_layernorm.{field}", (h,),
                            f"LayerNorm {field} [head_dim], shared")
    else:  # one RMSNorm over the whole width
      entry[key] = read.get(f"{name}_norm.{field}", (heads * h,),
                            f"RMSNorm {field} [heads * head_dim], over the "
                            "whole width").reshape(heads, h)
  return entry


def read_qk_norm(read: reading.Reader, params: dict[str, Any],
                 options: dict[str, Any], notes: list[str], family: str,
                 norm, *, n: int, k: int, h: int) -> None:
  """The layer's qk-norm ``norm`` (the family's, or an override: True,
  False, a ``QKNorm``) and its weights, in the family's layout."""
  if norm is None or norm is False:
    return
  layout = _NORM_LAYOUT.get(family)
  if layout is None or norm is True:  # q_norm.weight [H], as decoders
    decoders.read_norms(read, params, options, notes, norm, n=n, k=k, h=h)
    return
  options["normalize_qk"] = norm
  notes.append(f"qk-norm {norm}")
  for name, heads in (("q", n), ("k", k)):
    params[f"{name}_norm"] = _norm_weights(read, name, layout, norm, heads,
                                           h)


def _eps(cfg: Mapping[str, Any], key: str, default: float) -> float:
  value = cfg.get(key)
  if value is None:
    return default
  if not reading.is_number(value) or not value > 0:
    raise ValueError(f"config[{key!r}] must be a positive number (the "
                     f"norm's epsilon), got {value!r}.")
  return float(value)


def _family_norm(cfg: Mapping[str, Any], family: str) -> QKNorm | None:
  """The qk-norm the family's code applies, or None."""
  if family == "olmoe":
    return QKNorm(over="all", weight="per_head",
                  epsilon=_eps(cfg, "rms_norm_eps", 1e-5))
  if family in ("stablelm", "phi", "persimmon") and cfg.get(
      "qk_layernorm", family == "persimmon"):  # PersimmonConfig: True
    return QKNorm(kind="layer", weight=(
        "per_head" if family == "stablelm" else "shared"),
                  bias=family != "stablelm",
                  epsilon=_eps(cfg, "layer_norm_eps", 1e-5))
  return None


def finish(read: reading.Reader, cfg: Mapping[str, Any], family: str,
           params: dict[str, Any], options: dict[str, Any], notes: list[str],
           overrides: Mapping[str, Any], *, n: int, k: int,
           h: int) -> registry.Built:
  """The causal mask, the family's qk-norm (or the override's) and sinks
  where overrides ask for them; the build's result."""
  if "mask" not in overrides:
    options["mask"] = Mask(causal=True)
  norm = overrides.get("normalize_qk", _family_norm(cfg, family))
  read_qk_norm(read, params, options, notes, family, norm, n=n, k=k, h=h)
  if overrides.get("attention_sinks", False):
    decoders.read_sinks(read, params, options, notes, n)
  return params, options, "; ".join(notes)


def _stablelm(cfg, layer, read, overrides, attention) -> registry.Built:
  """StableLM: q/k/v biases, per-head LayerNorm, partial rotary."""
  del attention
  d, n, k, h = sizes(cfg, "stablelm", kv_derived=False, head_dim_key=False)
  bias = bool(cfg.get("use_qkv_bias", False))
  note = f"config use_qkv_bias={bias}"
  params = separate_qkv(read, d=d, n=n, k=k, h=h, biases=bias, note=note)
  params["W_o"] = output(read, "o_proj", d=d, n=n, h=h,
                         bias=None if bias else False, note=note)
  options = dict(d_model=d, num_heads=n, num_kv_heads=k, head_dim=h,
                 use_bias=bias, scale=None)
  if "rope" not in overrides:
    options["rope"] = family_rope(cfg, "stablelm", layer)
  return finish(read, cfg, "stablelm", params, options, [note], overrides,
                n=n, k=k, h=h)


def _olmo(cfg, layer, read, overrides, attention, family) -> registry.Built:
  """OLMo / OLMoE: attention_bias, clip_qkv (OLMoE: whole-width norm)."""
  del attention
  d, n, k, h = sizes(cfg, family, kv_derived=True, head_dim_key=True)
  if family == "olmoe" and n * h != d:
    raise ValueError(
        f"config head_dim={h} with {n} heads: OLMoE's q_norm is an RMSNorm "
        f"over hidden_size={d} features, which HF applies to the {n * h} "
        "of q_proj's output only when they are equal.")
  bias = bool(cfg.get("attention_bias", False))
  note = f"config attention_bias={bias}"
  params = separate_qkv(read, d=d, n=n, k=k, h=h, biases=bias, note=note)
  params["W_o"] = output(read, "o_proj", d=d, n=n, h=h, bias=bias, note=note)
  options = dict(d_model=d, num_heads=n, num_kv_heads=k, head_dim=h,
                 use_bias=bias, scale=None)
  clip = clip_value(cfg.get("clip_qkv"), "config clip_qkv")
  if clip is not None and family == "olmoe":
    raise ValueError(
        f"config clip_qkv={clip}: HF's OlmoeAttention clamps the queries and "
        "keys after their RMSNorm (q_norm / k_norm), and "
        "aj.MultiHeadAttention's clip_qkv clips the projections before any "
        "norm, so this layer cannot be reproduced. Port it by hand (clip "
        "after the norm), or set clip_qkv None if the model has none.")
  notes = [note]
  if clip is not None:
    options["clip_qkv"] = clip
    notes.append(f"q, k, v clipped to +-{clip}")
  if "rope" not in overrides:
    options["rope"] = config_rope.rope(cfg, family, layer)
  return finish(read, cfg, family, params, options, notes, overrides,
                n=n, k=k, h=h)


def _phi(cfg, layer, read, overrides, attention) -> registry.Built:
  """Phi-1/2: biases on all four, shared qk LayerNorm with a bias."""
  del attention
  d, n, k, h = sizes(cfg, "phi", kv_derived=True, head_dim_key=True)
  if cfg.get("qk_layernorm") and h != d // n:
    raise ValueError(f"config head_dim={h}, but Phi's qk LayerNorm has "
                     f"hidden_size // heads = {d // n} features.")
  note = "Phi: biases on q/k/v_proj and dense"
  params = separate_qkv(read, d=d, n=n, k=k, h=h, biases=True, note=note)
  params["W_o"] = output(read, "dense", d=d, n=n, h=h, bias=True, note=note)
  options = dict(d_model=d, num_heads=n, num_kv_heads=k, head_dim=h,
                 use_bias=True, scale=None)
  if "rope" not in overrides:
    options["rope"] = family_rope(cfg, "phi", layer)
  return finish(read, cfg, "phi", params, options, [note], overrides,
                n=n, k=k, h=h)


def _bitnet(cfg, layer, read, overrides, attention) -> registry.Built:
  """BitNet (float weights): attention_bias, attn_sub_norm before o_proj."""
  del attention
  if cfg.get("quantization_config") is not None:
    raise ValueError(
        "config has a quantization_config: this BitNet checkpoint's linear "
        "layers are ternary (packed weights and a weight_scale) and quantize "
        "their inputs to int8 on the fly, which aj.MultiHeadAttention does "
        "not; load_attention_weights reads float (bf16 / fp32) BitNet "
        "weights (e.g. the '-bf16' release) with a config without it.")
  d, n, k, h = sizes(cfg, "bitnet", kv_derived=False, head_dim_key=True)
  if n * h != d:
    raise ValueError(
        f"config head_dim={h} with {n} heads: BitNet's attn_sub_norm is an "
        f"RMSNorm over hidden_size={d} features, which HF applies to the "
        f"{n * h} of the heads' output only when they are equal.")
  bias = bool(cfg.get("attention_bias", False))
  note = f"config attention_bias={bias}"
  params = separate_qkv(read, d=d, n=n, k=k, h=h, biases=bias, note=note)
  params["W_o"] = output(read, "o_proj", d=d, n=n, h=h, bias=bias, note=note)
  eps = _eps(cfg, "rms_norm_eps", 1e-5)
  params["o_norm"] = {"scale": read.get(
      "attn_sub_norm.weight", (d,),
      "RMSNorm [hidden_size] on the heads' output").reshape(n, h)}
  options = dict(d_model=d, num_heads=n, num_kv_heads=k, head_dim=h,
                 use_bias=bias, scale=None,
                 output_norm=QKNorm(over="all", weight="per_head",
                                    epsilon=eps))
  if "rope" not in overrides:
    options["rope"] = family_rope(cfg, "bitnet", layer)
  return finish(read, cfg, "bitnet", params, options,
                [note, f"attn_sub_norm (epsilon {eps})"], overrides,
                n=n, k=k, h=h)


def _olmo_build(family: str):
  def build(cfg, layer, read, overrides, attention):
    return _olmo(cfg, layer, read, overrides, attention, family)
  return build


def family(name: str, reads: tuple[str, ...], build, maps: str,
           **fields) -> registry.Family:
  """A ``registry.Family`` of these modules' families (``model_type`` its
  name; Llama-style prefix and anchor unless given)."""
  fields.setdefault("prefix", "layers.{layer}.self_attn.")
  fields.setdefault("anchor", "q_proj.weight")
  return registry.Family(name=name, model_types=(name,), reads=reads,
                         build=build, maps=maps, **fields)


FAMILIES = (
    # A config without model_type must have the keys its class always
    # writes (requires): an untyped Llama config read as StableLM would
    # rotate a quarter of each head.
    family("stablelm",
           ("partial_rotary_factor", "qk_layernorm", "use_qkv_bias",
            "use_parallel_residual"), _stablelm,
           "use_qkv_bias (q/k/v); qk_layernorm: LayerNorm per head [N, H] "
           "(layer_norm_eps); partial rotary (0.25)",
           requires=("use_qkv_bias", "qk_layernorm")),
    family("olmo", ("clip_qkv",), _olmo_build("olmo"),
           "attention_bias; clip_qkv on q, k, v; rope",
           requires=("clip_qkv",)),
    family("olmoe", ("clip_qkv",), _olmo_build("olmoe"),
           "attention_bias; qk-norm RMSNorm over the whole width ([N * H], "
           "[K * H]); rope (a clip_qkv, after that norm in HF, refused)",
           requires=("clip_qkv",)),
    family("phi", ("partial_rotary_factor", "qk_layernorm"), _phi,
           "biases (q/k/v_proj, dense); qk_layernorm: LayerNorm [H] with a "
           "bias, shared by the heads; partial rotary (0.5)",
           requires=("qk_layernorm",)),
    family("bitnet", (), _bitnet,
           "attention_bias; attn_sub_norm: RMSNorm [D] on the heads' output "
           "before o_proj (output_norm); rope (base 500000 by default); "
           "float weights only"),
)

#: The config keys these families' attention reads that ``registry.SIGNS``
#: lacks (none now: ``use_qkv_bias``, ``qk_layernorm``, ``clip_qkv`` and
#: ``partial_rotary_factor`` are there).
SIGNS: dict[str, str] = {}
