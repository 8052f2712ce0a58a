"""Regenerates the attention goldens of ``tests/test_checkpoints.py`` with transformers.

The independent reference for ``aj.load_attention_weights``: for each family a
tiny randomly initialised Hugging Face model (2 layers, so one sliding and one
global layer where the family alternates) runs on random token ids, and a
forward hook on each layer's attention module records what it was given and
what it returned, so the goldens carry HF's own positions, masks (sliding
windows, chunks) and rotary tables.

Families: llama, mistral, qwen2, qwen3, gemma2, gemma3, gpt_oss, gpt2 (made
with transformers 5.24.0, torch 2.13.0+cpu); phi3, olmo2, cohere, cohere2,
llama4, qwen3_next, deepseek_v3, t5, umt5, bloom, bloom6, gpt_neox, gptj, falcon,
falcon_mq, falcon_alibi, starcoder2, mixtral (transformers 5.25.0, torch
2.14.1). Each ``.npz`` records the versions it was made with; ``configs()``
says what each family exercises.

Shape glossary: B batch (2), T tokens (10), D hidden size (64), N query heads
(4), K key/value heads (2), H head dim (16), except where a family's layout
differs: bloom6 (D 96, N 6, one layer), falcon_mq (one key/value head),
deepseek_v3 (MLA sizes, see its config), t5 (D 32, N 4, H 8, decoder T 7).

Each ``<family>.npz`` holds:

- ``sd/<HF name>``: every parameter of every recorded attention module, with
  its real HF state-dict name (``model.layers.0.self_attn.q_proj.weight``,
  GPT-2's ``transformer.h.0.attn.c_attn.weight``), float32;
- ``in/<layer>``, ``out/<layer>``: the attention module's input
  ``hidden_states [B, T, D]`` and output ``[B, T, D]``, float32. ``<layer>``
  is the layer index (qwen3_next: its full-attention layer ``1`` only; layer
  0 is linear attention), or for t5 and umt5 ``enc/<i>``, ``dec/<i>`` (encoder and
  decoder self-attention) and ``cross/<i>`` (decoder cross-attention);
- ``kv/cross/<i>`` (t5): the encoder output the cross-attention attended to
  (``key_value_states [B, T, D]``);
- ``res/<layer>`` (bloom, bloom6): the residual ``BloomAttention`` was given;
  it adds it to its output, and ``out/<layer>`` is the attention proper, i.e.
  the module's output minus ``res/<layer>`` (``dense`` bias included);
- ``in_short/<layer>``, ``out_short/<layer>`` (phi3): a second run on the
  first 6 tokens, within LongRoPE's original context (8), so with its short
  factors; the main T = 10 run uses the long ones;
- ``config_json`` (``cfg.to_json_string(use_diff=False)``), ``family``,
  ``transformers_version``, ``torch_version``: strings.

The attention weights are re-drawn (normal, std 0.3; norm weights perturbed
around their init) after HF's init so that logits are O(1..10): HF's
``initializer_range=0.02`` gives nearly uniform attention, which would hide a
wrong scale, soft cap or window. T5, which does not scale q.k, gets std 0.15
and a std-1 relative position table. OLMo-2 has no norm before attention, so
its layer 0 sees the raw embeddings: those are re-drawn with std 1.

Run outside the project venv (torch and transformers are not dependencies)::

  python3.11 -m venv /tmp/hfvenv
  /tmp/hfvenv/bin/pip install torch transformers numpy
  /tmp/hfvenv/bin/python tests/golden/make_attention_goldens.py [family ...]

This file imports nothing of torch or transformers at module level, so
pytest's doctest collection imports it in the project venv.
"""

from __future__ import annotations

import os
import sys

import numpy as np

B, T = 2, 10  # batch, tokens: T > the sliding window (4), so it matters
SEED = 0
COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, num_hidden_layers=2, intermediate_size=64,
              vocab_size=128)
# Families whose config has no head_dim field (hidden / heads = 16 anyway).
_NO_HEAD_DIM = {k: v for k, v in COMMON.items() if k != "head_dim"}
# Special token ids inside the tiny vocabulary (no padding_idx row).
_TOKENS = dict(bos_token_id=0, eos_token_id=0, pad_token_id=None)
_FALCON = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
               ffn_hidden_size=64, vocab_size=128, max_position_embeddings=32,
               rope_parameters=dict(rope_type="default", rope_theta=10000.0),
               **_TOKENS)
T_SHORT = 6  # phi3's second run: <= its original context (8), short factors
T_DEC = 7  # t5's decoder tokens (the encoder gets T)
_SEQ2SEQ = ("t5", "umt5")  # encoder-decoder models: three attentions a layer
OUT_DIR = os.path.dirname(os.path.abspath(__file__))


def configs() -> dict:
  """``{family: (config class name, kwargs)}``: tiny configs of each family."""
  return {
      # llama3 rope with a small original context so all three frequency
      # bands (kept, smoothed, divided by factor) occur in 8 frequencies;
      # attention_bias on to exercise the flag.
      "llama": ("LlamaConfig", dict(
          COMMON, attention_bias=True, max_position_embeddings=512,
          rope_parameters=dict(rope_type="llama3", rope_theta=10000.0,
                               factor=8.0, low_freq_factor=1.0,
                               high_freq_factor=4.0,
                               original_max_position_embeddings=64))),
      "mistral": ("MistralConfig", dict(
          COMMON, sliding_window=4, max_position_embeddings=512,
          rope_parameters=dict(rope_type="default", rope_theta=1e6))),
      # Qwen2.5's long-context yarn (truncate left at its default, True);
      # layer 1 slides (use_sliding_window, max_window_layers=1).
      "qwen2": ("Qwen2Config", dict(
          COMMON, use_sliding_window=True, sliding_window=4,
          max_window_layers=1, max_position_embeddings=128,
          rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=4.0,
                               original_max_position_embeddings=32))),
      "qwen3": ("Qwen3Config", dict(
          COMMON, attention_bias=False, rms_norm_eps=1e-6,
          max_position_embeddings=512,
          rope_parameters=dict(rope_type="default", rope_theta=1e6))),
      # query_pre_attn_scalar != head_dim and a small soft cap, so both
      # show in the output; layer 0 slides, layer 1 is global.
      "gemma2": ("Gemma2Config", dict(
          COMMON, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
          sliding_window=4, max_position_embeddings=512,
          layer_types=["sliding_attention", "full_attention"],
          rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
      # Sliding layers: local base 10000; global: base 1e6, linear factor 8.
      "gemma3": ("Gemma3TextConfig", dict(
          COMMON, query_pre_attn_scalar=24, sliding_window=4,
          rms_norm_eps=1e-6, max_position_embeddings=512,
          layer_types=["sliding_attention", "full_attention"],
          rope_parameters={
              "sliding_attention": dict(rope_type="default",
                                        rope_theta=10000.0),
              "full_attention": dict(rope_type="linear", factor=8.0,
                                     rope_theta=1e6)})),
      # gpt-oss's real yarn (truncate False), with a small original context
      # so the ramp falls inside the 8 frequencies.
      "gpt_oss": ("GptOssConfig", dict(
          COMMON, num_local_experts=4, num_experts_per_tok=2,
          sliding_window=4, max_position_embeddings=2048,
          layer_types=["sliding_attention", "full_attention"],
          rope_parameters=dict(rope_type="yarn", rope_theta=150000.0,
                               factor=32.0, beta_fast=32.0, beta_slow=1.0,
                               truncate=False,
                               original_max_position_embeddings=64))),
      # Layer 1 scaled by 1 / (layer + 1) on top of 1/sqrt(H).
      "gpt2": ("GPT2Config", dict(
          n_embd=64, n_head=4, n_layer=2, n_positions=32, vocab_size=128,
          scale_attn_by_inverse_layer_idx=True, bos_token_id=0,
          eos_token_id=0)),
      # Fused qkv_proj, half the head rotated, LongRoPE: T = 10 > the
      # original context 8 takes the long factors, the extra 6-token run
      # (``in_short``) the short ones; attention factor
      # sqrt(1 + ln(32 / 8) / ln 8) from max / original positions. Phi-3
      # gives its top-level original_max_position_embeddings priority over
      # the rope dict's, so it is set there.
      "phi3": ("Phi3Config", dict(
          _NO_HEAD_DIM, sliding_window=4, max_position_embeddings=32,
          original_max_position_embeddings=8,
          rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                               partial_rotary_factor=0.5,
                               short_factor=[1.1, 1.4, 2.0, 3.0],
                               long_factor=[1.5, 3.0, 6.0, 12.0]),
          **_TOKENS)),
      # q_norm / k_norm: RMSNorm over the whole projection width (N * H).
      "olmo2": ("Olmo2Config", dict(
          _NO_HEAD_DIM, rms_norm_eps=1e-6, max_position_embeddings=512,
          rope_parameters=dict(rope_type="default", rope_theta=500000.0),
          **_TOKENS)),
      # Per-head LayerNorm (weight [N, H], no bias) on q and k; interleaved
      # rotary.
      "cohere": ("CohereConfig", dict(
          _NO_HEAD_DIM, use_qk_norm=True, max_position_embeddings=512,
          rope_parameters=dict(rope_type="default", rope_theta=10000.0),
          **_TOKENS)),
      # Layer 0 slides and is rotated; layer 1 is global without rotary.
      "cohere2": ("Cohere2Config", dict(
          _NO_HEAD_DIM, sliding_window=4, max_position_embeddings=512,
          layer_types=["sliding_attention", "full_attention"],
          rope_parameters=dict(rope_type="default", rope_theta=10000.0),
          **_TOKENS)),
      # no_rope_layers[i] == 1 means layer i USES rope: layer 0 is rotated,
      # chunked (4) and weightless-qk-normed; layer 1 is NoPE, global and
      # temperature-tuned (floor_scale 4 so the scale steps at 3, 7).
      "llama4": ("Llama4TextConfig", dict(
          COMMON, intermediate_size_mlp=64, num_local_experts=2,
          num_experts_per_tok=1, no_rope_layers=[1, 0],
          attention_chunk_size=4, use_qk_norm=True,
          attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5,
          max_position_embeddings=512,
          rope_parameters=dict(rope_type="default", rope_theta=500000.0),
          **_TOKENS)),
      # Layer 0 is linear attention (not recorded); layer 1 is the gated
      # full attention, with half of each head rotated.
      "qwen3_next": ("Qwen3NextConfig", dict(
          COMMON, layer_types=["linear_attention", "full_attention"],
          linear_conv_kernel_dim=4, linear_key_head_dim=8,
          linear_value_head_dim=8, linear_num_key_heads=2,
          linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
          moe_intermediate_size=16, shared_expert_intermediate_size=16,
          max_position_embeddings=512,
          rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                               partial_rotary_factor=0.5),
          **_TOKENS)),
      # MLA with YaRN: mscale != mscale_all_dim, so both the rotary
      # attention factor and the softmax scale differ from 1.
      "deepseek_v3": ("DeepseekV3Config", dict(
          hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
          num_hidden_layers=2, intermediate_size=64, vocab_size=128,
          q_lora_rank=8, kv_lora_rank=16, qk_nope_head_dim=8,
          qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1,
          n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
          n_group=2, topk_group=1, moe_intermediate_size=16,
          max_position_embeddings=64,
          rope_parameters=dict(rope_type="yarn", rope_theta=10000.0,
                               factor=4.0, original_max_position_embeddings=16,
                               mscale=1.0, mscale_all_dim=0.707,
                               beta_fast=32.0, beta_slow=1.0),
          **_TOKENS)),
      # 8 buckets, max distance 6 < T: both the log buckets and the clamp
      # occur (encoder |d| >= 4, decoder d >= 6 share the last bucket).
      # Six attention modules: D 32, H 8 keep the file small.
      "t5": ("T5Config", dict(
          d_model=32, d_kv=8, num_heads=4, d_ff=32, num_layers=2,
          num_decoder_layers=2, vocab_size=128,
          relative_attention_num_buckets=8,
          relative_attention_max_distance=6)),
      # umT5: T5's attention with a relative table in every layer.
      "umt5": ("UMT5Config", dict(
          d_model=32, d_kv=8, num_heads=4, d_ff=32, num_layers=2,
          num_decoder_layers=2, vocab_size=128,
          relative_attention_num_buckets=8,
          relative_attention_max_distance=6)),
      "bloom": ("BloomConfig", dict(
          hidden_size=64, n_head=4, n_layer=2, vocab_size=128, **_TOKENS)),
      # Six heads: ALiBi slopes of a non-power-of-two head count.
      # One layer keeps the file small at hidden 96.
      "bloom6": ("BloomConfig", dict(
          hidden_size=96, n_head=6, n_layer=1, vocab_size=128, **_TOKENS)),
      "gpt_neox": ("GPTNeoXConfig", dict(
          hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
          intermediate_size=64, vocab_size=128, attention_bias=True,
          max_position_embeddings=32,
          rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                               partial_rotary_factor=0.25),
          **_TOKENS)),
      "gptj": ("GPTJConfig", dict(
          n_embd=64, n_head=4, n_layer=2, n_inner=64, n_positions=32,
          vocab_size=128, rotary_dim=8, **_TOKENS)),
      # Falcon-40B layout: grouped [K, N / K + 2, H] fused rows.
      "falcon": ("FalconConfig", dict(
          _FALCON, new_decoder_architecture=True, num_kv_heads=2,
          multi_query=False, parallel_attn=True, bias=False)),
      # Falcon-7B layout: N query heads then one key and one value head.
      "falcon_mq": ("FalconConfig", dict(
          _FALCON, new_decoder_architecture=False, multi_query=True,
          parallel_attn=True, bias=False)),
      # Falcon-RW layout: ALiBi, [N, 3, H] fused rows, biases.
      "falcon_alibi": ("FalconConfig", dict(
          _FALCON, alibi=True, new_decoder_architecture=False,
          multi_query=False, parallel_attn=False, bias=True)),
      "starcoder2": ("Starcoder2Config", dict(
          _NO_HEAD_DIM, use_bias=True, sliding_window=4,
          max_position_embeddings=512,
          rope_parameters=dict(rope_type="default", rope_theta=10000.0),
          **_TOKENS)),
      "mixtral": ("MixtralConfig", dict(
          COMMON, sliding_window=4, num_local_experts=4,
          num_experts_per_tok=2, max_position_embeddings=512,
          rope_parameters=dict(rope_type="default", rope_theta=1e6),
          **_TOKENS)),
      **more_configs(),
  }


def more_configs() -> dict:
  """The Llama-style families added after the first 23 (transformers
  5.25.0, torch 2.14.1): each with the option that sets it apart on."""
  rope = dict(rope_type="default", rope_theta=10000.0)
  half = dict(rope, partial_rotary_factor=0.5)
  two = ["sliding_attention", "full_attention"]
  moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
  deep_moe = dict(n_routed_experts=4, num_experts_per_tok=2,
                  first_k_dense_replace=1, moe_intermediate_size=16,
                  n_group=1, topk_group=1)
  base = dict(COMMON, max_position_embeddings=512, rope_parameters=rope,
              **_TOKENS)
  granite = dict(base, attention_multiplier=0.2, attention_bias=True)
  return {
      # The scale is attention_multiplier (0.2, not 1 / sqrt(16)).
      "granite": ("GraniteConfig", granite),
      "granitemoe": ("GraniteMoeConfig", dict(
          granite, num_local_experts=4, num_experts_per_tok=2)),
      "granitemoeshared": ("GraniteMoeSharedConfig", dict(
          granite, num_local_experts=4, num_experts_per_tok=2,
          shared_intermediate_size=16)),
      "arcee": ("ArceeConfig", dict(base, attention_bias=True)),
      # q/k/v biases without an o_proj one; interleaved pairs.
      "helium": ("HeliumConfig", dict(base, attention_bias=True)),
      # Interleaved pairs on half of each head.
      "glm": ("GlmConfig", dict(base, attention_bias=True,
                                rope_parameters=half)),
      "glm4": ("Glm4Config", dict(base, attention_bias=True,
                                  rope_parameters=half)),
      # Half-split pairs on half of each head, qk-norm.
      "glm4_moe": ("Glm4MoeConfig", dict(
          base, attention_bias=True, use_qk_norm=True, rope_parameters=half,
          n_shared_experts=1, **deep_moe)),
      "seed_oss": ("SeedOssConfig", dict(base, attention_bias=True,
                                         attention_out_bias=False)),
      "ernie4_5": ("Ernie4_5Config", dict(base, use_bias=True)),
      "ernie4_5_moe": ("Ernie4_5_MoeConfig", dict(
          base, use_bias=True, moe_num_experts=4, moe_k=2,
          moe_intermediate_size=16, moe_layer_start_index=1)),
      "nemotron": ("NemotronConfig", dict(base, attention_bias=True,
                                          rope_parameters=half)),
      "ministral": ("MinistralConfig", dict(base, sliding_window=4,
                                            layer_types=two)),
      # Layer 0 slides ((i + 1) % 2 and i < max_window_layers).
      "qwen2_moe": ("Qwen2MoeConfig", dict(
          base, use_sliding_window=True, sliding_window=4,
          max_window_layers=2, shared_expert_intermediate_size=16, **moe)),
      # Every layer slides with use_sliding_window.
      "qwen3_moe": ("Qwen3MoeConfig", dict(
          base, use_sliding_window=True, sliding_window=4, **moe)),
      # Layer 1 slides (i >= max_window_layers).
      "dots1": ("Dots1Config", dict(base, sliding_window=4,
                                    max_window_layers=1, n_shared_experts=1,
                                    **deep_moe)),
      "olmo3": ("Olmo3Config", dict(base, sliding_window=4,
                                    layer_types=two)),
      # Layer 0 slides with rotary; layer 1 is global without (NoPE).
      "exaone4": ("Exaone4Config", dict(base, sliding_window=4,
                                        sliding_window_pattern=2)),
      # Layer 1 is NoPE, and slides (use_sliding_window).
      "smollm3": ("SmolLM3Config", dict(
          base, no_rope_layers=[1, 0], use_sliding_window=True,
          sliding_window=4)),
      "gemma": ("GemmaConfig", base),
      # Its real yarn rope and query scale, stepping every 4 positions.
      "ministral3": ("Ministral3Config", dict(
          base, sliding_window=None, max_position_embeddings=64,
          rope_parameters=dict(
              type="yarn", rope_theta=1e6, factor=16.0,
              original_max_position_embeddings=4, max_position_embeddings=64,
              beta_fast=32.0, beta_slow=1.0, mscale_all_dim=1.0, mscale=1.0,
              llama_4_scaling_beta=0.5))),
      # A fixed NTK base (dynamic with alpha 4); qk-norm after rotary.
      "hunyuan_v1_dense": ("HunYuanDenseV1Config", dict(
          base, attention_bias=True, rope_parameters=dict(
              rope_type="dynamic", rope_theta=10000.0, alpha=4.0,
              factor=1.0))),
      "hunyuan_v1_moe": ("HunYuanMoEV1Config", dict(
          base, num_experts=4, moe_topk=2, rope_parameters=dict(
              rope_type="dynamic", rope_theta=10000.0, alpha=4.0,
              factor=1.0))),
      # Four layers (sliding, full, sliding, full); the last two reuse the
      # keys and values of layers 0 and 1 (recorded as in_shared/<layer>).
      "gemma3n": ("Gemma3nTextConfig", dict(
          base, num_hidden_layers=4, vocab_size_per_layer_input=128,
          hidden_size_per_layer_input=8, laurel_rank=4,
          num_kv_shared_layers=2, layer_types=two * 2, sliding_window=4,
          activation_sparsity_pattern=[0.0] * 4, rope_parameters={
              "sliding_attention": dict(rope_type="default",
                                        rope_theta=10000.0),
              "full_attention": dict(rope_type="default",
                                     rope_theta=1e6)})),
      "vaultgemma": ("VaultGemmaConfig", dict(
          base, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
          sliding_window=4, layer_types=two)),
  }


def _attention_modules(model, family: str) -> dict:
  """``{layer name: attention module}``, in layer order.

  The layer name keys the arrays (``in/<layer>``): the layer index, or
  ``enc/<i>``, ``dec/<i>`` (self-attention) and ``cross/<i>`` for T5.
  Qwen3-Next records its full-attention layers only (index kept).
  """
  if family in ("gpt2", "gptj"):
    blocks = {str(i): b.attn for i, b in enumerate(model.transformer.h)}
  elif family.startswith(("bloom", "falcon")):
    blocks = {str(i): b.self_attention
              for i, b in enumerate(model.transformer.h)}
  elif family == "gpt_neox":
    blocks = {str(i): layer.attention
              for i, layer in enumerate(model.gpt_neox.layers)}
  elif family in _SEQ2SEQ:
    blocks = {}
    for i, b in enumerate(model.encoder.block):
      blocks[f"enc/{i}"] = b.layer[0].SelfAttention
    for i, b in enumerate(model.decoder.block):
      blocks[f"dec/{i}"] = b.layer[0].SelfAttention
      blocks[f"cross/{i}"] = b.layer[1].EncDecAttention
  else:
    blocks = {str(i): layer.self_attn
              for i, layer in enumerate(model.model.layers)
              if hasattr(layer, "self_attn")}
  return blocks


def _attention_parameters(model, family: str) -> list[str]:
  """HF names of the recorded attention modules' parameters, model order."""
  ids = {id(p) for m in _attention_modules(model, family).values()
         for p in m.parameters()}
  return [name for name, p in model.named_parameters() if id(p) in ids]


def _redraw(model, torch, family: str) -> None:
  """Attention weights with O(1) logits (see the module docstring)."""
  names = set(_attention_parameters(model, family))
  # T5 does not scale q.k by 1/sqrt(H): smaller weights keep logits O(1..10);
  # its relative position table gets std 1 so that the bias shows.
  std = 0.15 if family in _SEQ2SEQ else 0.3
  gen = torch.Generator().manual_seed(SEED + 1)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name not in names:
        continue
      noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
      if "norm" in name:  # Qwen3: weight around 1; Gemma3: 1 + weight
        p.add_(0.3 * noise)
      elif "relative_attention_bias" in name:
        p.copy_(noise)
      else:
        p.copy_(std * noise)


def _model_class(family: str, transformers):
  """T5ForConditionalGeneration for t5; Llama4ForCausalLM for llama4."""
  if family in _SEQ2SEQ:
    return transformers.AutoModelForSeq2SeqLM
  return transformers.AutoModelForCausalLM


def make(family: str, torch, transformers) -> dict[str, np.ndarray]:
  """One family's golden arrays."""
  class_name, kwargs = configs()[family]
  cfg = getattr(transformers, class_name)(**kwargs)
  torch.manual_seed(SEED)
  model = _model_class(family, transformers).from_config(
      cfg, attn_implementation="eager", dtype=torch.float32)
  model.eval()
  _redraw(model, torch, family)
  if family in ("olmo2", "olmo3", "exaone4"):
    # No norm before attention: layer 0 sees the raw embeddings, which HF
    # draws with std 0.02; std 1 keeps its output O(1..10) too.
    with torch.no_grad():
      emb = model.get_input_embeddings().weight
      emb.copy_(torch.randn(emb.shape, dtype=emb.dtype,
                            generator=torch.Generator().manual_seed(SEED + 3)))
  captured = {}
  run = {"in": "in", "out": "out"}  # array prefixes of the current run

  def hook(layer):
    def record(module, args, kwargs, output):
      x = args[0] if args else kwargs["hidden_states"]
      y = output[0] if isinstance(output, tuple) else output
      if family.startswith("bloom"):
        # BloomAttention adds the residual it is given to its output:
        # record that residual and the attention proper (output - residual).
        res = args[1] if len(args) > 1 else kwargs["residual"]
        captured[f"res/{layer}"] = res.detach().numpy().astype(np.float32)
        y = y - res
      kv = kwargs.get("key_value_states",  # T5 cross-attention (umT5's name)
                      kwargs.get("encoder_hidden_states"))
      if kv is not None:
        captured[f"kv/{layer}"] = kv.detach().numpy().astype(np.float32)
      captured[f"{run['in']}/{layer}"] = x.detach().numpy().astype(np.float32)
      captured[f"{run['out']}/{layer}"] = y.detach().numpy().astype(
          np.float32)
    return record

  for layer, module in _attention_modules(model, family).items():
    module.register_forward_hook(hook(layer), with_kwargs=True)
  print(f"{family}: {type(model).__name__}, "
        f"{model.config._attn_implementation} attention")
  gen = torch.Generator().manual_seed(SEED + 2)
  vocab = kwargs.get("vocab_size", 128)
  ids = torch.randint(0, vocab, (B, T), generator=gen)
  with torch.no_grad():
    if family in _SEQ2SEQ:
      dec_ids = torch.randint(0, vocab, (B, T_DEC), generator=gen)
      model(input_ids=ids, decoder_input_ids=dec_ids, use_cache=False)
    else:
      model(input_ids=ids)
      if family == "phi3":  # within the original context: short factors
        run.update({"in": "in_short", "out": "out_short"})
        model(input_ids=ids[:, :T_SHORT])
  arrays = dict(captured)
  params = dict(model.named_parameters())
  for name in _attention_parameters(model, family):
    arrays[f"sd/{name}"] = params[name].detach().numpy().astype(np.float32)
  arrays["config_json"] = np.array(cfg.to_json_string(use_diff=False))
  arrays["family"] = np.array(family)
  arrays["transformers_version"] = np.array(transformers.__version__)
  arrays["torch_version"] = np.array(torch.__version__)
  return arrays


def main(argv: list[str]) -> None:
  import torch  # noqa: PLC0415 (optional: only this script needs it)
  import transformers  # noqa: PLC0415

  families = argv[1:] or list(configs())
  for family in families:
    arrays = make(family, torch, transformers)
    if family == "gemma3n":  # layers 2, 3 attend over layers 0, 1's keys
      for layer in ("2", "3"):  # (the generic golden test runs each alone)
        for kind in ("in", "out"):
          arrays[f"{kind}_shared/{layer}"] = arrays.pop(f"{kind}/{layer}")
    path = os.path.join(OUT_DIR, f"{family}.npz")
    np.savez(path, **arrays)
    outs = [k for k in arrays if k.startswith(("out/", "out_short/"))]
    print(f"{path}: {os.path.getsize(path) // 1024} KiB, "
          f"{len(outs)} outputs, output scale "
          f"{max(np.abs(arrays[k]).max() for k in outs):.3g}")


if __name__ == "__main__":
  main(sys.argv)
