"""Regenerates the goldens of ``tests/test_checkpoints_more.py`` with transformers.

The families of ``interop/checkpoints/encoders.py``, ``others.py``,
``fused_layouts.py`` and DeepSeek-V2 in ``latent.py``, recorded as
``make_attention_goldens.py`` records the first ones (whose ``make``, hooks
and weight re-draw this reuses): a tiny random HF model, a forward hook on
each layer's attention module, ``tests/golden/<family>.npz`` with the same
arrays (``sd/<HF name>``, ``in/<layer>``, ``out/<layer>``, ``config_json``,
``family``, versions). Variants of a family's layout that its main golden
cannot show go to ``tests/golden/variants/<name>.npz`` (read by
``tests/test_checkpoints_more.py`` only: ``tests/test_checkpoints.py``
takes every ``tests/golden/*.npz`` as one family's).

Made with transformers 5.25.0, torch 2.14.1 (each file records its own).
Shape glossary: B 2, T 10, D 64, N 4, K 2, H 16, except where a family's
layout differs (``configs()`` says where and why).

Run outside the project venv (torch and transformers are not dependencies)::

  /tmp/hfvenv/bin/python tests/golden/make_more_goldens.py [name ...]

Like ``make_attention_goldens.py`` this imports neither torch nor
transformers at module level, so pytest's doctest collection imports it.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_attention_goldens as base  # noqa: E402 (the directory above)

_SMALL = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
              intermediate_size=64, vocab_size=128, bos_token_id=0,
              eos_token_id=0, pad_token_id=None)
_ROPE = dict(rope_type="default", rope_theta=10000.0)
VARIANTS_DIR = os.path.join(base.OUT_DIR, "variants")
# Variant goldens: {name: the family whose loader reads them}.
VARIANTS = {"gpt_bigcode_mha": "gpt_bigcode", "deepseek_v2_lora": "deepseek_v2",
            "olmoe_clip": "olmoe"}


def configs() -> dict:
  """``{name: (config class name, kwargs)}``: each option set so it shows
  in the output (windows < T, clips below the projections' magnitudes,
  which are ~2 at the re-drawn std 0.3)."""
  return {
      # Layer 0 global (i % 2 == 0), layer 1 local: |q - k| <= 4 // 2;
      # global base 160000, local 10000; attention_bias on.
      "modernbert": ("ModernBertConfig", dict(
          _SMALL, cls_token_id=0, sep_token_id=0, attention_bias=True,
          local_attention=4,
          global_attn_every_n_layers=2, max_position_embeddings=512,
          rope_parameters={
              "full_attention": dict(rope_type="default",
                                     rope_theta=160000.0),
              "sliding_attention": dict(rope_type="default",
                                        rope_theta=10000.0)})),
      # DeepSeek-V2-Lite's full-rank q_proj, biases, YaRN with mscale !=
      # mscale_all_dim (both the rotary magnitude and the softmax scale).
      "deepseek_v2": ("DeepseekV2Config", _deepseek_v2(q_lora_rank=None)),
      "deepseek_v2_lora": ("DeepseekV2Config", _deepseek_v2(q_lora_rank=8)),
      # Multi-query c_attn rows [D + 2H]; biases; no rope.
      "gpt_bigcode": ("GPTBigCodeConfig", _bigcode(multi_query=True)),
      "gpt_bigcode_mha": ("GPTBigCodeConfig", _bigcode(multi_query=False)),
      # q/k/v biases, per-head LayerNorm [N, H] / [K, H] (no bias), a
      # quarter of each head rotated.
      "stablelm": ("StableLmConfig", dict(
          _SMALL, num_key_value_heads=2, use_qkv_bias=True,
          qk_layernorm=True, max_position_embeddings=512,
          rope_parameters=dict(_ROPE, partial_rotary_factor=0.25))),
      "olmo": ("OlmoConfig", dict(
          _SMALL, num_key_value_heads=2, clip_qkv=1.5, attention_bias=True,
          max_position_embeddings=512, rope_parameters=_ROPE)),
      # RMSNorm over the whole width, then (olmoe_clip) the clip.
      "olmoe": ("OlmoeConfig", _olmoe(clip_qkv=None)),
      "olmoe_clip": ("OlmoeConfig", _olmoe(clip_qkv=1.0)),
      "dbrx": ("DbrxConfig", dict(
          d_model=64, n_heads=4, n_layers=2, max_seq_len=32, vocab_size=128,
          attn_config=dict(clip_qkv=1.5, kv_n_heads=2, rope_theta=500000.0),
          ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4,
                          moe_top_k=2),
          rope_parameters=dict(rope_type="default", rope_theta=500000.0))),
      # Six heads (D 48, H 8): MPT's non-power-of-two slope order; an
      # explicit softmax_scale; clip_qkv.
      "mpt": ("MptConfig", dict(
          d_model=48, n_heads=6, n_layers=2, expansion_ratio=1,
          max_seq_len=32, vocab_size=128,
          attn_config=dict(clip_qkv=1.5, softmax_scale=0.25))),
      # Phi-2's layout with qk_layernorm on (one LayerNorm [H] with a
      # bias, shared by the heads); half of each head rotated.
      "phi": ("PhiConfig", dict(
          _SMALL, num_key_value_heads=2, qk_layernorm=True,
          max_position_embeddings=512,
          rope_parameters=dict(_ROPE, partial_rotary_factor=0.5))),
      "persimmon": ("PersimmonConfig", dict(
          _SMALL, qk_layernorm=True, max_position_embeddings=512,
          rope_parameters=dict(_ROPE, partial_rotary_factor=0.5))),
      # attn_sub_norm: RMSNorm [D] on the heads' outputs before o_proj.
      "bitnet": ("BitNetConfig", dict(
          _SMALL, num_key_value_heads=2, max_position_embeddings=512,
          rope_parameters=_ROPE)),
  }


def _deepseek_v2(q_lora_rank) -> dict:
  return dict(
      _SMALL, num_key_value_heads=4, q_lora_rank=q_lora_rank,
      kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16,
      attention_bias=True, first_k_dense_replace=1, n_routed_experts=4,
      n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=16,
      max_position_embeddings=64,
      rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                           original_max_position_embeddings=16, mscale=1.0,
                           mscale_all_dim=0.707, beta_fast=32.0,
                           beta_slow=1.0))


def _bigcode(multi_query: bool) -> dict:
  return dict(n_embd=64, n_head=4, n_layer=2, n_positions=32, vocab_size=128,
              multi_query=multi_query, bos_token_id=0, eos_token_id=0)


def _olmoe(clip_qkv) -> dict:
  return dict(_SMALL, num_key_value_heads=2, num_experts=4,
              num_experts_per_tok=2, clip_qkv=clip_qkv,
              max_position_embeddings=512, rope_parameters=_ROPE)


def _attention_modules(model, family: str) -> dict:
  """``{layer index: attention module}`` where ours differ from the
  first goldens' layouts."""
  family = VARIANTS.get(family, family)
  if family == "gpt_bigcode":
    return {str(i): b.attn for i, b in enumerate(model.transformer.h)}
  if family == "mpt":
    return {str(i): b.attn for i, b in enumerate(model.transformer.blocks)}
  if family == "dbrx":
    return {str(i): b.norm_attn_norm.attn
            for i, b in enumerate(model.transformer.blocks)}
  if family == "modernbert":
    return {str(i): layer.attn for i, layer in enumerate(model.model.layers)}
  return _BASE_MODULES(model, family)


def _model_class(family: str, transformers):
  """ModernBERT is an encoder: its masked-LM model."""
  if family == "modernbert":
    return transformers.AutoModelForMaskedLM
  return transformers.AutoModelForCausalLM


_BASE_MODULES = base._attention_modules  # noqa: SLF001


def main(argv: list[str]) -> None:
  import torch  # noqa: PLC0415 (optional: only this script needs it)
  import transformers  # noqa: PLC0415

  # make() reads these through its module: ours, for our families.
  base.configs = configs
  base._attention_modules = _attention_modules  # noqa: SLF001
  base._model_class = _model_class  # noqa: SLF001
  os.makedirs(VARIANTS_DIR, exist_ok=True)
  for name in argv[1:] or list(configs()):
    arrays = base.make(name, torch, transformers)
    folder = VARIANTS_DIR if name in VARIANTS else base.OUT_DIR
    path = os.path.join(folder, f"{name}.npz")
    np.savez(path, **arrays)
    outs = [k for k in arrays if k.startswith("out/")]
    print(f"{path}: {os.path.getsize(path) // 1024} KiB, {len(outs)} "
          f"outputs, output scale "
          f"{max(np.abs(arrays[k]).max() for k in outs):.3g}")


if __name__ == "__main__":
  main(sys.argv)
