"""Gemma 3n's text attention: shared key/value layers, a value norm, scale 1.

Shape glossary: D hidden size, N query heads, K key/value heads, H head dim.

As transformers' ``Gemma3nTextAttention`` computes it: ``q_proj`` and an
RMSNorm ``q_norm [H]`` (the weight itself, not ``1 + w``), rotary at the
layer type's base (``rope_parameters`` nested by ``sliding_attention`` /
``full_attention``, or the old ``rope_theta`` / ``rope_local_base_freq``),
logits unscaled (``scaling = 1.0``), a sliding window of
``sliding_window`` on sliding layers (``layer_types``, by default every 5th
layer global). A layer that computes its own keys and values has ``k_proj``,
``v_proj``, ``k_norm [H]`` and a weightless RMSNorm on the values
(``v_norm``: ``value_norm=aj.QKNorm(weight=None)``). The last
``num_kv_shared_layers`` layers have no ``k_proj``/``v_proj``: each reuses
the keys and values of the last earlier layer of its type (HF's
``kv_sharing_modes``, "store" and "reuse"), loaded as a ``kv_shared=True``
layer whose ``LoadedAttention.kv_source`` names that layer: call it with
``shared_kv=source_layer.shared_kv(x_source)`` (or, decoding,
``shared_kv=source_layer``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attention_jax.interop.checkpoints import config_rope
from attention_jax.interop.checkpoints import reading
from attention_jax.interop.checkpoints import registry
from attention_jax.layers.qk_norm import QKNorm
from attention_jax.masking.mask import Mask

_FAMILY = "gemma3n"


def kv_source(cfg: Mapping[str, Any], layer: int) -> int | None:
  """The layer whose keys and values ``layer`` reuses, or None (its own),
  as ``Gemma3nTextConfig.kv_sharing_modes`` assigns them."""
  count = reading.positive_int(cfg, "num_hidden_layers", _FAMILY)
  shared = cfg.get("num_kv_shared_layers", 15)
  if isinstance(shared, bool) or not isinstance(shared, int) or not (
      0 <= shared <= count):
    raise ValueError(f"config['num_kv_shared_layers'] must be an int in "
                     f"[0, {count}], got {shared!r}.")
  first = count - shared
  if layer < first:
    return None
  kind = config_rope.layer_type(cfg, _FAMILY, layer)
  earlier = [i for i in range(first)
             if config_rope.layer_type(cfg, _FAMILY, i) == kind]
  if not earlier:
    raise ValueError(
        f"layer {layer} ({kind}) reuses the keys and values of an earlier "
        f"{kind} layer, but the {first} layers before the shared ones have "
        "none: transformers refuses this config too.")
  return earlier[-1]


def _build(cfg: Mapping[str, Any], layer: int, read: reading.Reader,
           overrides: Mapping[str, Any], attention: str) -> registry.Built:
  del attention
  d = reading.positive_int(cfg, "hidden_size", _FAMILY)
  n = reading.positive_int(cfg, "num_attention_heads", _FAMILY)
  k = reading.size(cfg, "num_key_value_heads", _FAMILY, n, (), "")
  h = reading.size(cfg, "head_dim", _FAMILY, d // n, (), "")
  eps = float(cfg.get("rms_norm_eps", 1e-6))
  biased = bool(cfg.get("attention_bias", False))
  source = kv_source(cfg, layer)
  names = ("q",) if source is not None else ("q", "k", "v")
  params: dict[str, Any] = {}
  for name in names:
    heads = n if name == "q" else k
    w = read.get(f"{name}_proj.weight", (heads * h, d),
                 f"[heads * head_dim, hidden_size]; heads={heads}, "
                 f"head_dim={h}")
    params[f"W_{name}"] = {"kernel": w.T.reshape(d, heads, h)}
    if biased:
      params[f"W_{name}"]["bias"] = read.get(
          f"{name}_proj.bias", (heads * h,), "attention_bias").reshape(heads, h)
  params["W_o"] = {"kernel": read.get(
      "o_proj.weight", (d, n * h), "[hidden_size, heads * head_dim]").T
                   .reshape(n, h, d)}
  if biased:
    params["W_o"]["bias"] = read.get("o_proj.bias", (d,), "attention_bias")
  for name in names[:2]:
    params[f"{name}_norm"] = {"scale": read.get(
        f"{name}_norm.weight", (h,), "RMSNorm weight [head_dim]")}
  window = config_rope.window(cfg, _FAMILY, layer)
  options: dict[str, Any] = dict(
      d_model=d, num_heads=n, num_kv_heads=k, head_dim=h, use_bias=biased,
      scale=1.0, normalize_qk=overrides.get(
          "normalize_qk", QKNorm(epsilon=eps)),
      mask=Mask(causal=True, window=None if window is None
                else (window - 1, 0)),
      rope=None if "rope" in overrides else config_rope.rope(
          cfg, _FAMILY, layer))
  notes = ["scale 1", f"qk-norm RMSNorm [H] (eps {eps})"]
  if source is None:
    options["value_norm"] = QKNorm(weight=None, epsilon=eps)
    notes.append("values: weightless RMSNorm")
  else:
    options["kv_shared"] = True
    options["kv_source"] = source
    notes.append(f"keys and values of layer {source}")
  return params, options, "; ".join(notes)


FAMILIES = (
    registry.Family(
        name=_FAMILY, model_types=("gemma3n_text", "gemma3n"),
        reads=("sliding_window", "layer_types", "num_kv_shared_layers",
               "rope_local_base_freq", "laurel_rank", "altup_num_inputs",
               "hidden_size_per_layer_input"),
        build=_build, prefix="layers.{layer}.self_attn.",
        anchor="q_proj.weight",
        maps="q/k/v/o_proj (attention_bias); qk-norm RMSNorm [H] and a "
             "weightless value norm; scale 1; sliding/full layer_types with "
             "their rotary bases; the last num_kv_shared_layers layers reuse "
             "an earlier layer's keys and values (kv_shared, kv_source)",
        requires=("num_kv_shared_layers",)),
)
