"""Encoder families: bidirectional attention (no causal mask).

Shape glossary: D hidden size, N heads, H head dim (``D // N``), W the
half-window of a local layer.

- modernbert (``ModernBertAttention``, under ``model.layers.{i}.attn.``):
  the fused ``Wqkv`` (``nn.Linear``, rows ``[3, N, H]``: all queries, then
  all keys, then all values) and ``Wo``, biases on both iff
  ``attention_bias``; scale ``1 / sqrt(H)``; no causal mask. Each layer is
  global or local by ``layer_types`` (the config class derives them from
  ``global_attn_every_n_layers``, 3: layer ``i`` is global when ``i % n ==
  0``). A local layer sees keys with ``|q - k| <= W``, ``W =
  sliding_window`` (a property of the config class: ``local_attention //
  2``, 128 // 2 by default; a ``sliding_window`` in the config sets
  ``local_attention`` to twice it): ``aj.Mask(window=(W, W))``. Rotary on
  the whole head, split halves, with each layer type's own parameters:
  ``rope_parameters`` nested by layer type (or the old ``global_rope_theta``
  / ``local_rope_theta``, 160000 / 10000 by default, with an old
  ``rope_scaling`` applied to both), rope types as Llama's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attention_jax.interop.checkpoints import config_rope
from attention_jax.interop.checkpoints import reading
from attention_jax.interop.checkpoints import registry
from attention_jax.masking.mask import Mask
from attention_jax.scores import rope as rope_lib

_FAMILY = "modernbert"
# ModernBertConfig's defaults: every 3rd layer global; local_attention 128;
# rotary bases by layer type (its default_theta).
_EVERY = 3
_LOCAL_ATTENTION = 128
_THETA = {"full_attention": ("global_rope_theta", 160000.0),
          "sliding_attention": ("local_rope_theta", 10000.0)}
_KINDS = tuple(_THETA)


def layer_type(cfg: Mapping[str, Any], layer: int) -> str:
  """``"full_attention"`` or ``"sliding_attention"``, as ModernBertConfig
  derives it."""
  types = cfg.get("layer_types")
  if types is not None:
    if layer >= len(types):
      raise ValueError(f"layer={layer} but config['layer_types'] has "
                       f"{len(types)} entries.")
    if types[layer] not in _KINDS:
      raise ValueError(f"config['layer_types'][{layer}] is {types[layer]!r};"
                       f" ModernBERT layers are {' or '.join(_KINDS)}.")
    return types[layer]
  every = (reading.positive_int(cfg, "global_attn_every_n_layers", _FAMILY)
           if cfg.get("global_attn_every_n_layers") is not None else _EVERY)
  return "sliding_attention" if layer % every else "full_attention"


def half_window(cfg: Mapping[str, Any]) -> int:
  """``W``: a local layer's keys lie within ``W`` positions either side."""
  if cfg.get("sliding_window") is not None:  # the property's setter wins
    return reading.positive_int(cfg, "sliding_window", _FAMILY)
  if cfg.get("local_attention") is None:
    return _LOCAL_ATTENTION // 2
  local = reading.positive_int(cfg, "local_attention", _FAMILY)
  return local // 2


def rope_parameters(cfg: Mapping[str, Any], kind: str) -> dict[str, Any]:
  """The layer type's rope parameters, as ``ModernBertConfig`` fills them."""
  if cfg.get("rope_theta") is not None:
    # ModernBertConfig never reads it: its bases are per layer type.
    raise ValueError(
        f"config has rope_theta={cfg['rope_theta']!r}, which transformers' "
        "ModernBertConfig ignores (its rotary bases are per layer type: "
        "rope_parameters['full_attention' / 'sliding_attention'] or the old "
        "global_rope_theta / local_rope_theta); the loader does not guess "
        "which layers it was meant for. Remove it, or set those keys.")
  params = cfg.get("rope_parameters")
  if params is not None and (not isinstance(params, Mapping) or (
      params and not set(params) & set(_KINDS))):
    raise ValueError(
        f"config['rope_parameters'] is {params!r}: ModernBERT's are nested "
        "by layer type ({'full_attention': {...}, 'sliding_attention': "
        "{...}}), which transformers' ModernBertConfig requires; nest them.")
  entry = dict((params or {}).get(kind) or {"rope_type": "default"})
  entry.update(cfg.get("rope_scaling") or {})  # old format: both types
  entry.setdefault("rope_type", entry.get("type", "default"))
  key, default = _THETA[kind]
  entry.setdefault("rope_theta", cfg.get(key, default))
  if not reading.is_number(entry["rope_theta"]):
    raise ValueError(
        f"ModernBERT's {kind} rotary base is {entry['rope_theta']!r} (from "
        f"rope_parameters['{kind}'] or config['{key}']); it must be a "
        "number (transformers cannot build the rotary table without it).")
  return entry


def _rope(cfg: Mapping[str, Any], layer: int, kind: str) -> rope_lib.Rope:
  entry = rope_parameters(cfg, kind)
  # config_rope maps the rope type from one flat entry: the layer's own.
  flat = {**cfg, "rope_parameters": entry, "rope_scaling": None,
          "rope_theta": None, "layer_types": None}
  return config_rope.rope(flat, _FAMILY, layer)


def _sizes(cfg: Mapping[str, Any]) -> tuple[int, int, int]:
  d = reading.positive_int(cfg, "hidden_size", _FAMILY)
  n = reading.positive_int(cfg, "num_attention_heads", _FAMILY)
  if d % n:
    raise ValueError(f"config hidden_size={d} is not divisible by "
                     f"num_attention_heads={n} (transformers' ModernBERT "
                     "refuses it too).")
  h = d // n
  if cfg.get("head_dim") not in (None, h):
    # Its rotary table would read head_dim, its heads D // N.
    raise ValueError(
        f"config head_dim={cfg['head_dim']}, but ModernBERT's attention "
        f"uses hidden_size // num_attention_heads = {h} (transformers "
        "would size its rotary table by head_dim and its heads by the "
        "other): remove head_dim from the config.")
  return d, n, h


def _modernbert(cfg: Mapping[str, Any], layer: int, read: reading.Reader,
                overrides: Mapping[str, Any], attention: str) -> registry.Built:
  """ModernBERT: ``Wqkv`` rows ``[3, N, H]``, ``Wo``; global or local."""
  del attention
  d, n, h = _sizes(cfg)
  use_bias = bool(cfg.get("attention_bias", False))
  bias_note = f"config attention_bias={use_bias}"
  dims = f"hidden_size={d}, heads={n}, head_dim={h}"
  w = read.get("Wqkv.weight", (3 * d, d),
               f"[3 * hidden_size, hidden_size], rows [3, heads, head_dim]: "
               f"queries, keys, values; {dims}")
  kernel = w.T.reshape(d, 3, n, h)  # y = x @ w.T
  params = {f"W_{name}": {"kernel": kernel[:, i]}
            for i, name in enumerate("qkv")}
  if use_bias:
    b = read.get("Wqkv.bias", (3 * d,), bias_note).reshape(3, n, h)
    for i, name in enumerate("qkv"):
      params[f"W_{name}"]["bias"] = b[i]
  params["W_o"] = {"kernel": read.get(
      "Wo.weight", (d, d), f"[hidden_size, hidden_size]; {dims}").T.reshape(
          n, h, d)}
  if use_bias:
    params["W_o"]["bias"] = read.get("Wo.bias", (d,), bias_note)
  kind = layer_type(cfg, layer)
  options: dict[str, Any] = dict(d_model=d, num_heads=n, num_kv_heads=n,
                                 head_dim=h, use_bias=use_bias, scale=None)
  notes = [bias_note, f"{kind}, bidirectional"]
  if "mask" not in overrides:
    w_half = half_window(cfg) if kind == "sliding_attention" else None
    # HF's bidirectional sliding mask: |q - k| <= sliding_window.
    options["mask"] = (None if w_half is None
                       else Mask(window=(w_half, w_half)))
  if "rope" not in overrides:
    options["rope"] = _rope(cfg, layer, kind)
  return params, options, "; ".join(notes)


FAMILIES = (
    registry.Family(
        name=_FAMILY, model_types=(_FAMILY,),
        reads=("layer_types", "global_attn_every_n_layers", "local_attention",
               "sliding_window", "global_rope_theta", "local_rope_theta"),
        build=_modernbert, prefix="layers.{layer}.attn.", anchor="Wqkv.weight",
        maps="encoder: fused Wqkv [3, N, H] and Wo, attention_bias; no causal "
             "mask; local layers (global_attn_every_n_layers / layer_types) "
             "see local_attention // 2 keys either side; global and local "
             "rotary bases",
        # Hub configs carry BERT's position_embedding_type ("absolute"),
        # which ModernBertConfig does not have and its code never reads.
        fused=("Wqkv",), requires=("local_attention",),
        ignores=("position_embedding_type",)),
)

#: The config keys ModernBERT's attention reads that ``registry.SIGNS``
#: lacks, with what they mean (``global_attn_every_n_layers`` and
#: ``local_attention`` are there).
SIGNS = {
    "global_rope_theta": "ModernBERT's global rotary base",
    "local_rope_theta": "ModernBERT's local rotary base",
}
