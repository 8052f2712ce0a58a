"""Regenerates the goldens of ``tests/test_checkpoints_vl.py`` with transformers.

The text attention of the vision-language families of
``interop/checkpoints/multimodal.py`` (qwen2_vl, qwen2_5_vl, qwen3_vl),
recorded as ``make_attention_goldens.py`` records the first ones: a tiny
random HF model (the whole ``<X>ForConditionalGeneration``, with a
one-block vision tower it never runs: only token ids go in), its attention
weights re-drawn with ``make_attention_goldens._redraw`` (std 0.3, norm
weights around 1), a forward hook on each language-model layer's attention.
Each call is given explicit multimodal positions ``[3, B, T]`` whose three
rows differ (time ``arange``, height and width other integer patterns), as
an image's tokens have, so the sections show.

Each ``tests/golden/<family>.npz`` holds ``sd/<HF name>`` (the language
model's attention parameters, named as the full model's state dict names
them: ``model.language_model.layers.0.self_attn.q_proj.weight``),
``in/<layer>``, ``out/<layer>`` (``[B, T, D]``), ``pos/<layer>`` (the
positions ``[3, B, T]`` that layer was given), ``config_json`` (the whole
multimodal config, ``text_config`` nested), ``family``, versions.

Made with transformers 5.25.0, torch 2.14.1 (each file records its own).
Shape glossary: B 2, T 10, D 64, N 4, K 2, H 16.

Run outside the project venv (torch and transformers are not dependencies)::

  /tmp/hfvenv/bin/python tests/golden/make_vl_goldens.py [family ...]

Like ``make_attention_goldens.py`` this imports neither torch nor
transformers at module level, so pytest's doctest collection imports it.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_attention_goldens as base  # noqa: E402 (the directory above)

_TEXT = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=2, intermediate_size=64, vocab_size=128,
             max_position_embeddings=512, bos_token_id=0, eos_token_id=0,
             pad_token_id=None)
# A one-block vision tower: the model must build, it never runs.
_VISION = dict(depth=1, hidden_size=32, num_heads=2, patch_size=2,
               spatial_merge_size=1, temporal_patch_size=1)


def configs() -> dict:
  """``{family: (config class name, kwargs)}``: the sections (summing to
  H / 2 = 8) uneven so that a blocked and an interleaved layout differ."""
  return {
      # Layer 1 slides (use_sliding_window, max_window_layers=1, window 4).
      "qwen2_vl": ("Qwen2VLConfig", dict(
          text_config=dict(
              _TEXT, use_sliding_window=True, sliding_window=4,
              max_window_layers=1,
              rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                   mrope_section=[2, 3, 3])),
          vision_config=dict(_VISION, embed_dim=32, mlp_ratio=2),
          image_token_id=120, video_token_id=121,
          vision_start_token_id=122, vision_end_token_id=123)),
      # Old-style "mrope" rope_type (HF reads it as default).
      "qwen2_5_vl": ("Qwen2_5_VLConfig", dict(
          text_config=dict(
              _TEXT, rope_parameters=dict(rope_type="mrope",
                                          rope_theta=10000.0,
                                          mrope_section=[2, 3, 3])),
          vision_config=dict(_VISION, intermediate_size=32,
                             out_hidden_size=64, fullatt_block_indexes=[0],
                             window_size=4),
          image_token_id=120, video_token_id=121,
          vision_start_token_id=122, vision_end_token_id=123)),
      # Interleaved THW: height pairs 1, 4 and width 2, 5 (below 3 * 2),
      # time 0, 3, 6, 7; attention_bias on all four.
      "qwen3_vl": ("Qwen3VLConfig", dict(
          text_config=dict(
              _TEXT, head_dim=16, attention_bias=True,
              rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                   mrope_section=[4, 2, 2],
                                   mrope_interleaved=True)),
          vision_config=dict(_VISION, intermediate_size=32,
                             out_hidden_size=64, deepstack_visual_indexes=[],
                             num_position_embeddings=16),
          image_token_id=120, video_token_id=121,
          vision_start_token_id=122, vision_end_token_id=123)),
  }


def positions() -> np.ndarray:
  """``[3, B, T]`` int positions: time ``arange(T)``, height ``t // 3 +
  b``, width ``(t * 2) % 5 + 3 b``: three different rows per batch row."""
  t = np.arange(base.T)
  b = np.arange(base.B)[:, None]
  return np.stack([np.broadcast_to(t, (base.B, base.T)), t // 3 + b,
                   (t * 2) % 5 + 3 * b]).astype(np.int64)


def _attention_modules(model, family: str) -> dict:
  del family
  return {str(i): layer.self_attn
          for i, layer in enumerate(model.model.language_model.layers)}


def make(family: str, torch, transformers) -> dict[str, np.ndarray]:
  """One family's golden arrays."""
  class_name, kwargs = configs()[family]
  cfg = getattr(transformers, class_name)(**kwargs)
  torch.manual_seed(base.SEED)
  model = transformers.AutoModelForImageTextToText.from_config(
      cfg, attn_implementation="eager", dtype=torch.float32)
  model.eval()
  base._attention_modules = _attention_modules  # noqa: SLF001 (_redraw's)
  base._redraw(model, torch, family)  # noqa: SLF001
  captured = {}

  def hook(layer):
    def record(module, args, kw, output):
      x = args[0] if args else kw["hidden_states"]
      y = output[0] if isinstance(output, tuple) else output
      captured[f"in/{layer}"] = x.detach().numpy().astype(np.float32)
      captured[f"out/{layer}"] = y.detach().numpy().astype(np.float32)
      captured[f"pos/{layer}"] = pos
    return record

  modules = _attention_modules(model, family)
  for layer, module in modules.items():
    module.register_forward_hook(hook(layer), with_kwargs=True)
  print(f"{family}: {type(model).__name__}, "
        f"{model.config.text_config._attn_implementation} attention")
  pos = positions()
  gen = torch.Generator().manual_seed(base.SEED + 2)
  ids = torch.randint(0, 100, (base.B, base.T), generator=gen)  # text only
  with torch.no_grad():
    model(input_ids=ids, position_ids=torch.tensor(pos))
  arrays = dict(captured)
  ids_ = {id(p) for m in modules.values() for p in m.parameters()}
  state = model.state_dict()  # the names a saved checkpoint has
  for name, p in model.named_parameters():
    if id(p) in ids_:
      assert name in state, name
      arrays[f"sd/{name}"] = p.detach().numpy().astype(np.float32)
  arrays["config_json"] = np.array(cfg.to_json_string(use_diff=False))
  arrays["family"] = np.array(family)
  arrays["transformers_version"] = np.array(transformers.__version__)
  arrays["torch_version"] = np.array(torch.__version__)
  return arrays


def main(argv: list[str]) -> None:
  import torch  # noqa: PLC0415 (optional: only this script needs it)
  import transformers  # noqa: PLC0415

  for family in argv[1:] or list(configs()):
    arrays = make(family, torch, transformers)
    path = os.path.join(base.OUT_DIR, f"{family}.npz")
    np.savez(path, **arrays)
    outs = [k for k in arrays if k.startswith("out/")]
    print(f"{path}: {os.path.getsize(path) // 1024} KiB, {len(outs)} "
          f"outputs, output scale "
          f"{max(np.abs(arrays[k]).max() for k in outs):.3g}, sd "
          f"{sorted(k for k in arrays if k.startswith('sd/'))[:2]}")


if __name__ == "__main__":
  main(sys.argv)
