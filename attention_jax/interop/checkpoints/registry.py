"""The families ``aj.load_attention_weights`` reads: one ``Family`` record each.

A family is the modeling code of one Hugging Face model type: where a
layer's weights live, which config keys its attention reads, and a
``build`` function that turns one layer's weights and config into
``aj.MultiHeadAttention`` (or ``aj.MultiHeadLatentAttention``) options and
params. Each family module (``decoders``, ``multimodal``, ``others``,
``fused_layouts``, ``encoders``, ``gpt``, ``t5``, ``latent``) lists its
``Family`` records; ``families`` gathers them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import dataclasses
from typing import Any

# What a build function returns: (params arrays, layer options, notes).
Built = tuple[dict[str, Any], dict[str, Any], str]

# How to port a model no family here reads: never by relabelling its config
# (a look-alike loads with a small error nothing here would notice).
BY_HAND = (
    "port it by hand: build aj.MultiHeadAttention(d_model=, num_heads=, "
    "num_kv_heads=, head_dim=, use_bias=, mask=, scale=, rope=aj.Rope(...), "
    "...) with the options its modeling code applies, then "
    "module.load_params(params) with W_q/W_k/W_v kernels [D, N|K, H] and "
    "W_o [N, H, D] cut from its weights (docs/usage.md, Porting a model)")
# Config keys that change some model's attention, with what they mean. A
# config without model_type that has one (not None) which the requested
# family's attention does not read is another model's: refused, not loaded
# by a guess.
SIGNS = {
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
    "num_kv_heads": "Falcon's key/value heads",
    "n_embed": "BLOOM / Falcon's hidden size",
    "slow_but_exact": "BLOOM's tensor-parallel output projection",
    "use_parallel_residual": "GPT-NeoX / StableLM's parallel block",
    "attention_multiplier": "Granite's attention scale",
    "kv_lora_rank": "latent attention (DeepSeek)",
    "q_lora_rank": "latent attention (DeepSeek)",
    "clip_qkv": "clipped q/k/v (OLMo, DBRX)",
    "attn_config": "DBRX/MPT attention",
    "position_embedding_type": "an encoder's positions",
    "relative_attention_num_buckets": "T5's relative position buckets",
    "relative_attention_max_distance": "T5's relative position buckets",
    "rope_interleave": "DeepSeek's interleaved rotary",
    "attention_chunk_size": "Llama 4's chunked attention",
    "no_rope_layers": "Llama 4's NoPE layers",
    "attn_temperature_tuning": "Llama 4's attention temperature",
    "no_rope_layer_interval": "NoPE layers at an interval (Llama 4, SmolLM3)",
    "attention_out_bias": "an o_proj bias of its own (Seed-OSS)",
    "use_bias": "biases on all four projections (StarCoder2, ERNIE 4.5)",
    "use_qkv_bias": "q/k/v biases (StableLM)",
    "mrope_section": "multimodal rotary sections (Qwen-VL)",
    "vision_start_token_id": "a vision-language model's image positions",
    "image_token_id": "a vision-language model's image positions",
    "num_kv_shared_layers": "layers sharing another's keys and values "
                            "(Gemma 3n)",
    "laurel_rank": "Gemma 3n's layers", "altup_num_inputs": "Gemma 3n's layers",
    "hidden_size_per_layer_input": "Gemma 3n's layers",
    "global_attn_every_n_layers": "ModernBERT's local/global layers",
    "local_attention": "ModernBERT's local window",
    "alibi_bias_max": "ALiBi's maximum bias (MPT)",
}
# Sign values that change nothing: a config that has them says nothing about
# its family (Qwen3's use_sliding_window=False, a whole-head rotary factor).
NEUTRAL = {
    "use_sliding_window": (False,), "use_qk_norm": (False,),
    "qk_layernorm": (False,), "alibi": (False,), "multi_query": (False,),
    "new_decoder_architecture": (False,),
    "use_bidirectional_attention": (False,), "partial_rotary_factor": (1.0,),
    "scale_attn_weights": (True,), "scale_attn_by_inverse_layer_idx": (False,),
    "slow_but_exact": (False,), "attention_out_bias": (False,),
    "use_qkv_bias": (False,), "rope_interleave": (False,),
    "attn_temperature_tuning": (False,), "num_kv_shared_layers": (0,),
}


def _neutral(key: str, value: Any) -> bool:
  for v in NEUTRAL.get(key, ()):
    if (value is v if isinstance(v, bool) or isinstance(value, bool)
        else value == v):
      return True
  return False


# Sign keys that transformers 5 keeps inside the rope parameters.
_ROPE_SIGNS = ("partial_rotary_factor", "mrope_section")


def _rope_entries(cfg: Mapping[str, Any]) -> list[Mapping[str, Any]]:
  """The rope parameter dicts of a config (nested per layer type too)."""
  out = []
  for key in ("rope_parameters", "rope_scaling"):
    entry = cfg.get(key)
    if isinstance(entry, Mapping):
      out.append(entry)
      out.extend(v for v in entry.values() if isinstance(v, Mapping))
  return out


def sign_value(cfg: Mapping[str, Any], key: str) -> Any:
  """A sign key's value: the config's, else its rope parameters'."""
  if cfg.get(key) is not None:
    return cfg[key]
  return next((e[key] for e in _rope_entries(cfg) if e.get(key) is not None),
              None)


def present_signs(cfg: Mapping[str, Any]) -> list[str]:
  """The sign keys (``SIGNS``) ``cfg`` sets to a value that changes
  attention (not None, not one of ``NEUTRAL``'s), at its top level or (a
  partial rotary factor, M-RoPE sections) in its rope parameters, sorted."""
  found = {k for k in SIGNS
           if cfg.get(k) is not None and not _neutral(k, cfg[k])}
  for entry in _rope_entries(cfg):
    found.update(k for k in _ROPE_SIGNS
                 if entry.get(k) is not None and not _neutral(k, entry[k]))
  return sorted(found)
# Fused q/k/v weights, and whose layout they are (a family that reads one
# names it in Family.fused).
FUSED = {
    "qkv_proj": "Phi-3's layout: rows q [N * H], then k [K * H], then v "
                "[K * H]",
    "query_key_value": "GPT-NeoX, BLOOM and Falcon's old layout: rows [N, "
                       "3, H] (each head's q, k, v); Falcon multi_query: "
                       "[N + 2, H] (the queries, one key, one value); "
                       "Falcon new_decoder_architecture: [K, N / K + 2, H] "
                       "(each key/value group's queries, key, value)",
    "c_attn": "GPT-2's Conv1D [D, 3D] is family='gpt2'; other models' "
              "c_attn (GPT-BigCode, Qwen 1) have layouts of their own",
    "Wqkv": "MPT / DBRX / ModernBERT: rows q, k, v",
    "W_pack": "Baichuan: rows q, k, v",
}


@dataclasses.dataclass(frozen=True)
class Family:
  """One model family's attention, as its HF modeling code computes it.

  Attributes:
    name: the ``family=`` name (``"llama"``, ``"gpt_neox"``, ...).
    model_types: the config ``model_type`` values its code is written for.
    reads: the sign keys (``SIGNS``) its attention reads or its config class
      carries: a config without ``model_type`` with any other sign is
      another model's, and refused.
    build: ``build(cfg, layer, read, overrides, attention) -> (params,
      options, notes)``: the layer's params (NumPy arrays, the module's
      layout), module options, and a note of what was mapped (for
      messages).
    prefix: where layer ``layer``'s attention weights live, below the
      model's own prefix: ``"layers.{layer}.self_attn."``; for families
      with several attentions per layer, one template each (T5:
      ``{"encoder": "encoder.block.{layer}.layer.0.SelfAttention.", ...}``).
    anchor: a weight every layer has under ``prefix`` (found to locate it).
    maps: one line: what the loader maps (for messages and the docs).
    layer_count: the config key with the number of layers (or one per
      attention: T5's encoder and decoder differ).
    ignored: entries under the prefix that are buffers, not weights.
    fused: the fused q/k/v weight names this family reads (``FUSED``).
    module: ``"multi_head"`` (``aj.MultiHeadAttention``) or ``"latent"``
      (``aj.MultiHeadLatentAttention``).
    attentions: the ``attention=`` values it takes: ``("self",)``, or T5's
      ``("encoder", "decoder", "cross")``.
    ignores: sign keys (``SIGNS``) its config class carries that its
      attention knowingly does not depend on (accepted, not read).
    requires: keys every config of its class has (``to_dict`` and
      config.json write them), which a config without ``model_type`` must
      have to be read as this family: without them it is another model's.
      ``"model_type"``: nothing in its config tells it apart from a
      look-alike whose code differs (Helium's interleaved rotary pairs),
      so only a config with its model_type is read.
  """

  name: str
  model_types: tuple[str, ...]
  reads: tuple[str, ...]
  build: Callable[..., Built]
  prefix: str | Mapping[str, str]
  anchor: str
  maps: str
  layer_count: str | Mapping[str, str] = "num_hidden_layers"
  ignored: tuple[str, ...] = ()
  fused: tuple[str, ...] = ()
  module: str = "multi_head"
  attentions: tuple[str, ...] = ("self",)
  ignores: tuple[str, ...] = ()
  requires: tuple[str, ...] = ()

  def unread(self, cfg: Mapping[str, Any]) -> list[str]:
    """The sign keys ``cfg`` sets that this family neither reads nor
    knowingly ignores: another model's, refused by the loader."""
    return [k for k in present_signs(cfg)
            if k not in self.reads and k not in self.ignores]

  def layer_prefix(self, layer: int, attention: str) -> str:
    prefix = (self.prefix if isinstance(self.prefix, str)
              else self.prefix[attention])
    return prefix.format(layer=layer)

  def count_key(self, attention: str) -> str:
    """The config key with the number of layers ``attention`` has."""
    return (self.layer_count if isinstance(self.layer_count, str)
            else self.layer_count[attention])

  def templates(self) -> str:
    """The prefix template(s), for messages."""
    return (repr(self.prefix) if isinstance(self.prefix, str)
            else " or ".join(map(repr, self.prefix.values())))


def by_name(families: tuple[Family, ...]) -> Mapping[str, Family]:
  names = [f.name for f in families]
  if len(set(names)) != len(names):
    raise RuntimeError(f"duplicate family names in {names}")
  return {f.name: f for f in families}
