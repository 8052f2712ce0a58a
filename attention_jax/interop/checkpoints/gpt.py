"""GPT-2 and the families after it with layouts of their own.

Shape glossary: D hidden size (``n_embd``), N heads, H head dim.

- gpt2: the fused ``c_attn`` (Conv1D ``[D, 3D]``, columns q, k, v) and
  ``c_proj``; ``scale_attn_weights``, ``scale_attn_by_inverse_layer_idx``;
  no rope.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attention_jax.interop.checkpoints import decoders
from attention_jax.interop.checkpoints import reading
from attention_jax.interop.checkpoints import registry
from attention_jax.masking.mask import Mask


def _gpt2(cfg: Mapping[str, Any], layer: int, read: reading.Reader,
          overrides: Mapping[str, Any], attention: str) -> registry.Built:
  """GPT-2: Conv1D ``c_attn [D, 3D]`` (columns q, k, v) and ``c_proj``."""
  del attention
  d = int(cfg.get("n_embd") or reading.positive_int(cfg, "hidden_size",
                                                    "gpt2"))
  n = int(cfg.get("n_head") or reading.positive_int(
      cfg, "num_attention_heads", "gpt2"))
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
  decoders.read_norms(read, params, options, notes,
                      overrides.get("normalize_qk"), n=n, k=n, h=h)
  if overrides.get("attention_sinks", False):
    decoders.read_sinks(read, params, options, notes, n)
  return params, options, "; ".join(notes)


FAMILIES = (
    registry.Family(
        name="gpt2", model_types=("gpt2",),
        reads=("n_embd", "n_head", "scale_attn_weights",
               "scale_attn_by_inverse_layer_idx"),
        build=_gpt2, prefix="h.{layer}.attn.", anchor="c_attn.weight",
        maps="fused Conv1D c_attn; scale_attn_weights, "
             "scale_attn_by_inverse_layer_idx; no rope",
        layer_count="n_layer", ignored=("bias", "masked_bias"),
        fused=("c_attn",)),
)
