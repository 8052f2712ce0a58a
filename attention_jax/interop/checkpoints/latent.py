"""DeepSeek-V2/V3's multi-head latent attention into ``aj.MultiHeadLatentAttention``.

Shape glossary: D hidden size, N heads, Rq ``q_lora_rank``, R
``kv_lora_rank``, Hn ``qk_nope_head_dim``, Hr ``qk_rope_head_dim``, Hv
``v_head_dim``.

What HF's ``modeling_deepseek_v3.py`` (``DeepseekV3Attention``, under
``model.layers.{i}.self_attn.``) computes, as the latent module's params
(``aj.latent_attention``'s layout) and options (``deepseek_v2``: HF's
``DeepseekV2Attention``, the same but where noted):

- query: ``q_a_proj [Rq, D]`` -> ``W_dq [D, Rq]``, ``q_a_layernorm [Rq]``
  -> ``q_norm``, ``q_b_proj [N * (Hn + Hr), Rq]`` -> ``W_uq [Rq, N, Hn +
  Hr]`` (each head ``[q_nope | q_rot]``); with ``q_lora_rank`` None a
  full-rank ``q_proj [N * (Hn + Hr), D]`` -> ``W_q [D, N, Hn + Hr]``;
- keys and values: ``kv_a_proj_with_mqa [R + Hr, D]`` (rows ``[latent |
  the one shared rotary key]``) -> ``W_dkv [D, R + Hr]``,
  ``kv_a_layernorm [R]`` -> ``kv_norm``, ``kv_b_proj [N * (Hn + Hv), R]``
  (each head ``[k_nope | v]``) -> ``W_ukv [R, N, Hn + Hv]``;
- ``o_proj [D, N * Hv]`` -> ``W_o [N, Hv, D]``;
- biases on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj`` iff
  ``attention_bias`` (the module's ``use_bias``: the same three);
- both norms: ``DeepseekV3RMSNorm`` (V2: ``DeepseekV2RMSNorm``) with its
  class default epsilon 1e-6 (``rms_norm_eps`` is not passed to them), the
  module's RMSNorm epsilon;
- rope on the Hr rotary features: the config's rope parameters
  (``config_rope.rope``: default, yarn with ``mscale``/``mscale_all_dim``
  or ``attention_factor``, ...), pairs ``(x[2i], x[2i + 1])`` when
  ``rope_interleave`` (HF's default True: its de-interleaved output is the
  same permutation of q and k, so the same scores), halves otherwise; V2
  always rotates pairs (its complex ``freqs_cis`` over ``(x[2i], x[2i +
  1])``; its config has no ``rope_interleave``, and its code reads none);
- ``scale = (Hn + Hr) ** -0.5``, times ``(0.1 * mscale_all_dim *
  ln(factor) + 1) ** 2`` for any rope type but "default" whose parameters
  set ``mscale_all_dim`` (HF's ``yarn_apply_mscale``), set explicitly (it
  stays with ``overrides={"rope": ...}``);
- a causal mask.

``num_key_value_heads`` must equal ``num_attention_heads`` (HF's code
expands the latent to N key heads and repeats them N / K times, which only
runs at K = N).
"""

from __future__ import annotations

from collections.abc import Mapping
import math
from typing import Any

from attention_jax.interop.checkpoints import config_rope
from attention_jax.interop.checkpoints import reading
from attention_jax.interop.checkpoints import registry
from attention_jax.masking.mask import Mask

# DeepseekV3Config's and DeepseekV2Config's defaults, for keys a config
# leaves out.
_DEFAULTS = {
    "deepseek_v3": dict(hidden_size=7168, num_attention_heads=128,
                        kv_lora_rank=512, q_lora_rank=1536,
                        qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128),
    "deepseek_v2": dict(hidden_size=4096, num_attention_heads=32,
                        kv_lora_rank=512, q_lora_rank=1536,
                        qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128),
}
# The overrides a latent layer can take (MultiHeadLatentAttention has no
# qk-norm, sinks, soft cap or score_mod).
_OVERRIDABLE = ("rope", "mask", "scale")


def _size(cfg: Mapping[str, Any], name: str, family: str) -> int:
  if cfg.get(name) is None:
    return _DEFAULTS[family][name]
  return reading.positive_int(cfg, name, family)


def _mscale(factor: float, mscale: float) -> float:
  """HF's ``yarn_get_mscale``: ``0.1 * mscale * ln(factor) + 1`` (1 if
  ``factor <= 1``)."""
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(cfg: Mapping[str, Any], layer: int, qk_head_dim: int,
                  family: str = "deepseek_v3") -> float:
  """HF's ``yarn_apply_mscale(config.rope_parameters, qk_head_dim ** -0.5)``
  (V2's and V3's attention both)."""
  p = config_rope.rope_parameters(cfg, family, layer)
  value = qk_head_dim ** -0.5
  rope_type = p.get("rope_type", p.get("type", "default"))
  if rope_type == "default" or not p.get("mscale_all_dim"):
    return value
  if not reading.is_number(p.get("factor")):
    raise ValueError(
        f"config's rope parameters have rope_type {rope_type!r} and "
        f"mscale_all_dim={p['mscale_all_dim']} but factor={p.get('factor')!r}"
        f": HF's DeepSeek attention multiplies its softmax scale by "
        "(0.1 * mscale_all_dim * ln(factor) + 1) ** 2 and reads factor "
        "from rope_parameters; add it.")
  return value * _mscale(float(p["factor"]), float(p["mscale_all_dim"])) ** 2


def _sizes(cfg: Mapping[str, Any],
           family: str) -> tuple[int, int, int | None, int, int, int, int]:
  """``(D, N, Rq, R, Hn, Hr, Hv)``, refusing what HF's code cannot run."""
  d = _size(cfg, "hidden_size", family)
  n = _size(cfg, "num_attention_heads", family)
  k = cfg.get("num_key_value_heads")
  if k is not None and k != n:
    raise ValueError(
        f"config num_key_value_heads={k}, num_attention_heads={n}: HF's "
        "DeepSeek attention expands the latent to num_attention_heads key "
        "heads and then repeats them num_attention_heads // "
        "num_key_value_heads times, which only runs when the two are "
        "equal; set num_key_value_heads to num_attention_heads (or leave "
        "it out).")
  # q_lora_rank None (present, or the config class's 1536 when absent) is
  # the full-rank q_proj.
  full_rank = "q_lora_rank" in cfg and cfg["q_lora_rank"] is None
  rq = None if full_rank else _size(cfg, "q_lora_rank", family)
  r = _size(cfg, "kv_lora_rank", family)
  hn = _size(cfg, "qk_nope_head_dim", family)
  hr = _size(cfg, "qk_rope_head_dim", family)
  hv = _size(cfg, "v_head_dim", family)
  if hr % 2:
    raise ValueError(f"config qk_rope_head_dim={hr} is odd: rope rotates "
                     "feature pairs.")
  return d, n, rq, r, hn, hr, hv


def _query_params(read: reading.Reader, d: int, n: int, rq: int | None,
                  hqk: int, bias: bool,
                  dims: str) -> dict[str, dict[str, Any]]:
  """The query: full-rank ``W_q``, or low-rank ``W_dq``, ``q_norm``, ``W_uq``."""
  bias_note = f"config attention_bias={bias}"
  params: dict[str, dict[str, Any]] = {}
  if rq is None:
    w = read.get("q_proj.weight", (n * hqk, d),
                 f"[heads * (qk_nope_head_dim + qk_rope_head_dim), "
                 f"hidden_size] (q_lora_rank None); {dims}")
    params["W_q"] = {"kernel": w.T.reshape(d, n, hqk)}
  else:
    w = read.get("q_a_proj.weight", (rq, d),
                 f"[q_lora_rank, hidden_size]; {dims}")
    params["W_dq"] = {"kernel": w.T}  # [D, Rq]
    if bias:
      params["W_dq"]["bias"] = read.get("q_a_proj.bias", (rq,), bias_note)
    params["q_norm"] = {"scale": read.get("q_a_layernorm.weight", (rq,),
                                          "RMSNorm [q_lora_rank]")}
    w = read.get("q_b_proj.weight", (n * hqk, rq),
                 f"[heads * (qk_nope_head_dim + qk_rope_head_dim), "
                 f"q_lora_rank]; {dims}")
    params["W_uq"] = {"kernel": w.T.reshape(rq, n, hqk)}
  return params


def _build(cfg: Mapping[str, Any], layer: int, read: reading.Reader,
           overrides: Mapping[str, Any], attention: str,
           family: str) -> registry.Built:
  """One DeepSeek-V2/V3 layer's MLA params, ``MultiHeadLatentAttention``
  options and notes."""
  del attention  # self-attention only
  unknown = sorted(set(overrides) - set(_OVERRIDABLE))
  if unknown:
    raise ValueError(
        f"overrides {unknown} do not apply to {family}: its layer is "
        f"aj.MultiHeadLatentAttention, whose inferred options are "
        f"{list(_OVERRIDABLE)} (no qk-norm, sinks, soft cap or score_mod).")
  if family == "deepseek_v2" and cfg.get("rope_interleave") is not None:
    raise ValueError(
        f"config has rope_interleave={cfg['rope_interleave']!r}, which "
        "DeepseekV2Config does not have and HF's DeepseekV2Attention does "
        "not read (it always rotates pairs (x[2i], x[2i + 1])): this is a "
        "DeepSeek-V3 config (pass family='deepseek_v3'), or remove the key.")
  d, n, rq, r, hn, hr, hv = _sizes(cfg, family)
  bias = bool(cfg.get("attention_bias", False))
  bias_note = f"config attention_bias={bias}"
  dims = (f"hidden_size={d}, heads={n}, q_lora_rank={rq}, kv_lora_rank={r}, "
          f"qk_nope_head_dim={hn}, qk_rope_head_dim={hr}, v_head_dim={hv}")
  hqk = hn + hr
  params = _query_params(read, d, n, rq, hqk, bias, dims)
  w = read.get("kv_a_proj_with_mqa.weight", (r + hr, d),
               f"[kv_lora_rank + qk_rope_head_dim, hidden_size]; {dims}")
  params["W_dkv"] = {"kernel": w.T}  # [D, R + Hr]: latent, then rotary key
  if bias:
    params["W_dkv"]["bias"] = read.get("kv_a_proj_with_mqa.bias", (r + hr,),
                                       bias_note)
  params["kv_norm"] = {"scale": read.get("kv_a_layernorm.weight", (r,),
                                         "RMSNorm [kv_lora_rank]")}
  w = read.get("kv_b_proj.weight", (n * (hn + hv), r),
               f"[heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]; "
               f"{dims}")
  params["W_ukv"] = {"kernel": w.T.reshape(r, n, hn + hv)}
  w = read.get("o_proj.weight", (d, n * hv),
               f"[hidden_size, heads * v_head_dim]; {dims}")
  params["W_o"] = {"kernel": w.T.reshape(n, hv, d)}
  if bias:
    params["W_o"]["bias"] = read.get("o_proj.bias", (d,), bias_note)
  options: dict[str, Any] = dict(
      d_model=d, num_heads=n, q_lora_rank=rq, kv_lora_rank=r,
      qk_nope_head_dim=hn, qk_rope_head_dim=hr, v_head_dim=hv, use_bias=bias,
      mask=Mask(causal=True))
  # V3: `if self.config.rope_interleave` (a None in the config is False);
  # V2's complex rotation always pairs (x[2i], x[2i + 1]).
  interleaved = (family == "deepseek_v2"
                 or bool(cfg.get("rope_interleave", True)))
  if "rope" not in overrides:
    options["rope"] = config_rope.rope(cfg, family, layer,
                                       interleaved=interleaved)
  if "scale" not in overrides:
    options["scale"] = softmax_scale(cfg, layer, hqk, family)
  notes = [bias_note, "q low rank" if rq else "full-rank q_proj",
           f"rope {'pairs' if interleaved else 'halves'}"]
  return params, options, "; ".join(notes)


def _build_v3(cfg, layer, read, overrides, attention) -> registry.Built:
  return _build(cfg, layer, read, overrides, attention, "deepseek_v3")


def _build_v2(cfg, layer, read, overrides, attention) -> registry.Built:
  return _build(cfg, layer, read, overrides, attention, "deepseek_v2")


FAMILIES = (
    registry.Family(
        name="deepseek_v3", model_types=("deepseek_v3",),
        reads=("q_lora_rank", "kv_lora_rank", "rope_interleave"),
        build=_build_v3, prefix="layers.{layer}.self_attn.",
        anchor="kv_a_proj_with_mqa.weight",
        maps="MLA into aj.MultiHeadLatentAttention: q_lora_rank (or full-"
             "rank q_proj), kv_lora_rank, attention_bias, rope_interleave, "
             "yarn with mscale / mscale_all_dim (rotary and softmax scale)",
        fused=(), module="latent"),
    registry.Family(
        name="deepseek_v2", model_types=("deepseek_v2",),
        reads=("q_lora_rank", "kv_lora_rank"),
        build=_build_v2, prefix="layers.{layer}.self_attn.",
        anchor="kv_a_proj_with_mqa.weight",
        maps="MLA into aj.MultiHeadLatentAttention: q_lora_rank (or full-"
             "rank q_proj, V2-Lite), kv_lora_rank, attention_bias, rotary "
             "pairs (x[2i], x[2i + 1]) always, yarn with mscale / "
             "mscale_all_dim (rotary and softmax scale)",
        fused=(), module="latent"),
)
