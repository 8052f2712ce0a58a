"""Regenerates the attention goldens of ``tests/test_checkpoints.py`` with transformers.

The independent reference for ``aj.load_attention_weights``: for each family a
tiny randomly initialised Hugging Face model (2 layers, so one sliding and one
global layer where the family alternates) runs on random token ids, and a
forward hook on each layer's attention module records what it was given and
what it returned, so the goldens carry HF's own positions, masks (sliding
windows) and rotary tables. Written with transformers 5.24.0 and torch
2.13.0+cpu (each ``.npz`` records the versions it was made with).

Shape glossary: B batch (2), T tokens (10), D hidden size (64), N query heads
(4), K key/value heads (2), H head dim (16).

Each ``<family>.npz`` holds:

- ``sd/<HF name>``: every attention parameter of every layer, with its real
  HF state-dict name (``model.layers.0.self_attn.q_proj.weight``, GPT-2's
  ``transformer.h.0.attn.c_attn.weight``), float32;
- ``in/<layer>``, ``out/<layer>``: the attention module's input
  ``hidden_states [B, T, D]`` and output ``[B, T, D]``, float32;
- ``config_json`` (``cfg.to_json_string(use_diff=False)``), ``family``,
  ``transformers_version``, ``torch_version``: strings.

The attention weights are re-drawn (normal, std 0.3; norm weights perturbed
around their init) after HF's init so that logits are O(1..10): HF's
``initializer_range=0.02`` gives nearly uniform attention, which would hide a
wrong scale, soft cap or window.

Run outside the project venv (torch and transformers are not dependencies)::

  python3.11 -m venv /tmp/hfvenv
  /tmp/hfvenv/bin/pip install torch transformers numpy
  /tmp/hfvenv/bin/python tests/golden/make_attention_goldens.py

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
  }


def _attention_modules(model, family: str) -> list:
  """Each layer's attention module, in layer order."""
  if family == "gpt2":
    return [block.attn for block in model.transformer.h]
  return [layer.self_attn for layer in model.model.layers]


def _redraw(model, torch) -> None:
  """Attention weights with O(1) logits (see the module docstring)."""
  gen = torch.Generator().manual_seed(SEED + 1)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if ".attn." not in name and ".self_attn." not in name:
        continue
      noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
      if "norm" in name:  # Qwen3: weight around 1; Gemma3: 1 + weight
        p.add_(0.3 * noise)
      else:
        p.copy_(0.3 * noise)


def make(family: str, torch, transformers) -> dict[str, np.ndarray]:
  """One family's golden arrays."""
  class_name, kwargs = configs()[family]
  cfg = getattr(transformers, class_name)(**kwargs)
  torch.manual_seed(SEED)
  model = transformers.AutoModelForCausalLM.from_config(
      cfg, attn_implementation="eager", dtype=torch.float32)
  model.eval()
  _redraw(model, torch)
  captured = {}

  def hook(layer):
    def record(module, args, kwargs, output):
      x = args[0] if args else kwargs["hidden_states"]
      captured[f"in/{layer}"] = x.detach().numpy().astype(np.float32)
      captured[f"out/{layer}"] = output[0].detach().numpy().astype(
          np.float32)
    return record

  attn = _attention_modules(model, family)
  for layer, module in enumerate(attn):
    module.register_forward_hook(hook(layer), with_kwargs=True)
  gen = torch.Generator().manual_seed(SEED + 2)
  ids = torch.randint(0, kwargs.get("vocab_size", 128), (B, T), generator=gen)
  with torch.no_grad():
    model(input_ids=ids)
  arrays = dict(captured)
  for name, p in model.named_parameters():
    if ".attn." in name or ".self_attn." in name:
      arrays[f"sd/{name}"] = p.detach().numpy().astype(np.float32)
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
    path = os.path.join(OUT_DIR, f"{family}.npz")
    np.savez(path, **arrays)
    layers = sorted(k for k in arrays if k.startswith("in/"))
    print(f"{path}: {os.path.getsize(path) // 1024} KiB, {len(layers)} "
          f"layers, output scale "
          f"{max(np.abs(arrays[k.replace('in', 'out')]).max() for k in layers):.3g}")


if __name__ == "__main__":
  main(sys.argv)
