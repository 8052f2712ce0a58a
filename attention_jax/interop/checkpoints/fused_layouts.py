"""Families whose q/k/v are one fused ``nn.Linear``, each in its own row order.

Shape glossary: D hidden size, N query heads, K key/value heads, H head dim
(``D // N`` in all of these).

What each family's HF ``modeling_<family>.py`` computes (a causal mask in
all of them):

- gpt_bigcode (``transformer.h.{i}.attn.``): ``c_attn`` (an ``nn.Linear``,
  not GPT-2's Conv1D) with ``multi_query`` (the default) rows ``[D + 2H]``:
  the N query heads, then one key head, then one value head (K = 1); without
  it rows ``[N, 3, H]`` (each head's q, k, v). Biases on ``c_attn`` and
  ``c_proj``; scale ``1 / sqrt(H)``, 1 without ``scale_attn_weights``; no
  rope (learned positions, outside attention).
- dbrx (``transformer.blocks.{i}.norm_attn_norm.attn.``): ``Wqkv`` rows q
  ``[D]``, k ``[K * H]``, v ``[K * H]`` (``attn_config.kv_n_heads``, 1 by
  default), no biases, ``out_proj``; ``attn_config.clip_qkv`` clips all
  three; rotary from the top-level rope parameters (transformers 5 reads
  them there; an ``attn_config.rope_theta``, which older versions read,
  must agree).
- mpt (``transformer.blocks.{i}.attn.``): ``Wqkv`` rows ``[3, N, H]``, no
  biases, ``out_proj``; ``attn_config.clip_qkv`` (0 or None: none),
  ``attn_config.softmax_scale`` (None: ``1 / sqrt(H)``); ALiBi with MPT's
  slopes ``aj.alibi_slopes(N, max_bias=8)`` added to the scaled scores: HF's
  ``MptModel`` builds them with 8 whatever ``alibi_bias_max`` says, and
  applies them even with ``alibi=False``, and it ignores ``qk_ln`` and
  ``prefix_lm``. Where the config sets those otherwise, MosaicML's own code
  and transformers' compute different layers: refused, not guessed.
- persimmon (``model.layers.{i}.self_attn.``): ``query_key_value`` rows
  ``[N, 3, H]`` and ``dense``, biases on both; with ``qk_layernorm`` (the
  default) one ``nn.LayerNorm(H)`` with a bias shared by the heads
  (``layer_norm_eps``); partial rotary (0.5 when the config gives none).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from attention_jax.interop.checkpoints import config_rope
from attention_jax.interop.checkpoints import others
from attention_jax.interop.checkpoints import reading
from attention_jax.interop.checkpoints import registry
from attention_jax.scores import score_mods

# HF's MptModel: build_mpt_alibi_tensor's default, the only one it uses.
_MPT_ALIBI_MAX = 8


def _sizes(cfg: Mapping[str, Any], family: str, hidden: tuple[str, ...],
           heads: tuple[str, ...]) -> tuple[int, int, int]:
  """``(D, N, H = D // N)``, from the first key of each the config has."""
  def first(keys):
    for key in keys:
      if cfg.get(key) is not None:
        return reading.positive_int(cfg, key, family)
    return reading.positive_int(cfg, keys[-1], family)
  d, n = first(hidden), first(heads)
  if d % n:
    raise ValueError(f"config {'/'.join(hidden)}={d} is not divisible by "
                     f"{'/'.join(heads)}={n}: {family}'s head dim is hidden "
                     "size // heads.")
  return d, n, d // n


def split_rows(w, b, *, d: int, h: int, layout: str, n: int,
               k: int) -> dict[str, dict[str, Any]]:
  """``W_q``, ``W_k``, ``W_v`` of a fused ``nn.Linear`` weight ``w [rows,
  D]`` (and bias ``b [rows]`` or None): ``layout`` ``"blocks"`` is rows q
  ``[N * H]``, k ``[K * H]``, v ``[K * H]``; ``"per_head"`` rows ``[N, 3,
  H]`` (each head's q, k, v; K = N)."""
  if layout == "per_head":
    kernel = w.T.reshape(d, n, 3, h)  # y = x @ w.T
    parts = {name: kernel[:, :, i] for i, name in enumerate("qkv")}
    biases = (None if b is None else
              {name: b.reshape(n, 3, h)[:, i] for i, name in enumerate("qkv")})
  else:
    edges = {"q": (0, n * h), "k": (n * h, (n + k) * h),
             "v": ((n + k) * h, (n + 2 * k) * h)}
    parts = {name: w[lo:hi].T.reshape(d, -1, h)
             for name, (lo, hi) in edges.items()}
    biases = (None if b is None else {name: b[lo:hi].reshape(-1, h)
                                      for name, (lo, hi) in edges.items()})
  params = {f"W_{name}": {"kernel": part} for name, part in parts.items()}
  for name in "qkv" if biases is not None else ():
    params[f"W_{name}"]["bias"] = biases[name]
  return params


def _fused(read: reading.Reader, name: str, *, d: int, n: int, k: int,
           h: int, layout: str, bias: bool) -> dict[str, dict[str, Any]]:
  rows = (n + 2 * k) * h
  order = ("rows [heads, 3, head_dim]: each head's q, k, v"
           if layout == "per_head" else
           f"rows q [{n * h}], k [{k * h}], v [{k * h}]")
  w = read.get(f"{name}.weight", (rows, d),
               f"[{rows}, hidden_size={d}], {order}; heads={n}, "
               f"kv_heads={k}, head_dim={h}")
  b = read.get(f"{name}.bias", (rows,), order) if bias else None
  return split_rows(w, b, d=d, h=h, layout=layout, n=n, k=k)


def _gpt_bigcode(cfg, layer, read, overrides, attention) -> registry.Built:
  """GPT-BigCode: ``c_attn`` (multi-query ``[D + 2H]`` or ``[N, 3, H]``)."""
  del attention, layer
  d, n, h = _sizes(cfg, "gpt_bigcode", ("n_embd", "hidden_size"),
                   ("n_head", "num_attention_heads"))
  multi_query = bool(cfg.get("multi_query", True))  # GPTBigCodeConfig: True
  k = 1 if multi_query else n
  params = _fused(read, "c_attn", d=d, n=n, k=k, h=h, bias=True,
                  layout="blocks" if multi_query else "per_head")
  params["W_o"] = others.output(read, "c_proj", d=d, n=n, h=h, bias=True,
                                note="c_proj bias [n_embd]")
  scale = None if cfg.get("scale_attn_weights", True) else 1.0
  options = dict(d_model=d, num_heads=n, num_kv_heads=k, head_dim=h,
                 use_bias=True, scale=scale)
  notes = ["biases on c_attn and c_proj",
           f"multi_query={multi_query}: c_attn rows "
           + (f"[{d} + 2 * {h}]" if multi_query else f"[{n}, 3, {h}]")]
  return others.finish(read, cfg, "gpt_bigcode", params, options, notes,
                       overrides, n=n, k=k, h=h)


def _attn_config(cfg: Mapping[str, Any], family: str) -> Mapping[str, Any]:
  sub = cfg.get("attn_config")
  if sub is None:
    return {}
  if hasattr(sub, "to_dict"):  # a transformers sub-config object
    sub = sub.to_dict()
  if not isinstance(sub, Mapping):
    raise ValueError(f"config['attn_config'] must be a dict ({family}'s "
                     f"attention settings), got {type(sub).__name__}.")
  return sub


def _dbrx(cfg, layer, read, overrides, attention) -> registry.Built:
  """DBRX: ``Wqkv`` rows q, k, v; clip_qkv; rotary."""
  del attention
  d, n, h = _sizes(cfg, "dbrx", ("d_model", "hidden_size"),
                   ("n_heads", "num_attention_heads"))
  sub = _attn_config(cfg, "dbrx")
  k = (reading.positive_int(sub, "kv_n_heads", "dbrx")
       if sub.get("kv_n_heads") is not None else 1)  # DbrxAttentionConfig
  if n % k:
    raise ValueError(f"attn_config kv_n_heads={k} does not divide "
                     f"n_heads={n} (HF's repeat_kv fails too).")
  params = _fused(read, "Wqkv", d=d, n=n, k=k, h=h, layout="blocks",
                  bias=False)
  params["W_o"] = others.output(read, "out_proj", d=d, n=n, h=h, bias=False,
                                note="")
  options = dict(d_model=d, num_heads=n, num_kv_heads=k, head_dim=h,
                 use_bias=False, scale=None)
  notes = ["DBRX: no biases"]
  clip = others.clip_value(sub.get("clip_qkv"), "attn_config clip_qkv")
  if clip is not None:
    options["clip_qkv"] = clip
    notes.append(f"q, k, v clipped to +-{clip}")
  if "rope" not in overrides:
    options["rope"] = config_rope.rope(cfg, "dbrx", layer)
    theta = sub.get("rope_theta")
    if theta is not None and (not reading.is_number(theta)
                              or float(theta) != options["rope"].base):
      raise ValueError(
          f"config attn_config['rope_theta']={theta!r}, but the top-level "
          f"rope parameters give base {options['rope'].base}: transformers 5"
          "'s DBRX rotates with the top-level ones, earlier versions with "
          "attn_config's, so the loader does not pick. Make them agree (set "
          "rope_parameters['rope_theta'] or rope_theta), or pass "
          "overrides={'rope': aj.Rope(base=...)}.")
  return others.finish(read, cfg, "dbrx", params, options, notes, overrides,
                       n=n, k=k, h=h)


def _mpt_refusals(sub: Mapping[str, Any], overrides: Mapping[str, Any],
                  n: int, d: int) -> None:
  """What HF's MptAttention does not apply but MosaicML's code does."""
  both = ("transformers' MptModel and MosaicML's own code compute "
          "different layers here, and the loader does not pick one")
  if sub.get("attn_type", "multihead_attention") != "multihead_attention":
    raise ValueError(
        f"attn_config attn_type={sub['attn_type']!r}: HF's MptAttention is "
        f"multi-head only (Wqkv [3 * {d}, {d}]), so it cannot load this "
        "checkpoint either.")
  checks = (
      ("alibi", sub.get("alibi", True) is not True, "score_mod",
       "HF applies ALiBi whatever it says"),
      ("alibi_bias_max", sub.get("alibi_bias_max", _MPT_ALIBI_MAX)
       != _MPT_ALIBI_MAX, "score_mod", "HF's MptModel builds its slopes "
       f"with the default {_MPT_ALIBI_MAX}, not the config's"),
      ("qk_ln", bool(sub.get("qk_ln", False)), "normalize_qk",
       "HF's MptAttention has no qk LayerNorm"),
      ("prefix_lm", bool(sub.get("prefix_lm", False)), "mask",
       "HF's MPT is causal throughout"),
  )
  for key, differs, option, why in checks:
    if differs and option not in overrides:
      raise ValueError(
          f"config attn_config[{key!r}]={sub[key]!r}: {why}; {both}. Pass "
          f"overrides={{{option!r}: ...}} with the layer's {option} (e.g. "
          + ("aj.alibi(aj.alibi_slopes(N, max_bias=alibi_bias_max))"
             if option == "score_mod" else "the model's") + ").")


def _mpt(cfg, layer, read, overrides, attention) -> registry.Built:
  """MPT: ``Wqkv`` rows ``[3, N, H]``, clip_qkv, softmax_scale, ALiBi."""
  del attention, layer
  d, n, h = _sizes(cfg, "mpt", ("d_model", "hidden_size"),
                   ("n_heads", "num_attention_heads"))
  sub = _attn_config(cfg, "mpt")
  _mpt_refusals(sub, overrides, n, d)
  params = _fused(read, "Wqkv", d=d, n=n, k=n, h=h, layout="blocks",
                  bias=False)
  params["W_o"] = others.output(read, "out_proj", d=d, n=n, h=h, bias=False,
                                note="")
  scale = sub.get("softmax_scale")
  if scale is not None and not (reading.is_number(scale) and scale > 0):
    raise ValueError(f"config attn_config softmax_scale={scale!r} must be a "
                     "positive number (or None: 1 / sqrt(head_dim)).")
  options = dict(d_model=d, num_heads=n, num_kv_heads=n, head_dim=h,
                 use_bias=False, scale=None if scale is None else float(scale))
  notes = ["MPT: no biases"]
  # HF: `if self.clip_qkv:` (0 clips nothing).
  clip = others.clip_value(sub.get("clip_qkv") or None,
                           "attn_config clip_qkv")
  if clip is not None:
    options["clip_qkv"] = clip
    notes.append(f"q, k, v clipped to +-{clip}")
  if "score_mod" not in overrides:
    # HF adds slope * (k - (S - 1)) to the scaled scores; ours subtracts
    # slope * (q - k): per row the same up to a constant, which the
    # softmax cancels.
    options["score_mod"] = score_mods.alibi(jnp.asarray(
        score_mods.alibi_slopes(n, max_bias=_MPT_ALIBI_MAX)))
    notes.append(f"ALiBi (max bias {_MPT_ALIBI_MAX})")
  return others.finish(read, cfg, "mpt", params, options, notes, overrides,
                       n=n, k=n, h=h)


def _persimmon(cfg, layer, read, overrides, attention) -> registry.Built:
  """Persimmon: ``query_key_value`` rows ``[N, 3, H]``, qk LayerNorm."""
  del attention
  d, n, h = _sizes(cfg, "persimmon", ("hidden_size",),
                   ("num_attention_heads",))
  note = "Persimmon: biases on query_key_value and dense"
  params = _fused(read, "query_key_value", d=d, n=n, k=n, h=h,
                  layout="per_head", bias=True)
  params["W_o"] = others.output(read, "dense", d=d, n=n, h=h, bias=True,
                                note=note)
  options = dict(d_model=d, num_heads=n, num_kv_heads=n, head_dim=h,
                 use_bias=True, scale=None)
  if "rope" not in overrides:
    options["rope"] = others.family_rope(cfg, "persimmon", layer)
  return others.finish(read, cfg, "persimmon", params, options, [note],
                       overrides, n=n, k=n, h=h)


FAMILIES = (
    others.family(
        "gpt_bigcode", ("n_embd", "n_head", "multi_query",
                        "scale_attn_weights"), _gpt_bigcode,
        "fused nn.Linear c_attn (multi_query: [D + 2H], one key/value head; "
        "else [N, 3, H]) and c_proj, biases; scale_attn_weights; no rope",
        prefix="h.{layer}.attn.", anchor="c_attn.weight",
        layer_count="n_layer", fused=("c_attn",), requires=("multi_query",)),
    others.family(
        "dbrx", ("attn_config",), _dbrx,
        "fused Wqkv (rows q, k, v; attn_config.kv_n_heads) and out_proj, "
        "no biases; attn_config.clip_qkv; rope",
        prefix="blocks.{layer}.norm_attn_norm.attn.", anchor="Wqkv.weight",
        layer_count="n_layers", fused=("Wqkv",), requires=("attn_config",)),
    others.family(
        "mpt", ("attn_config",), _mpt,
        "fused Wqkv [3, N, H] and out_proj, no biases; attn_config clip_qkv "
        "and softmax_scale; ALiBi (max bias 8, as HF); alibi=False, another "
        "alibi_bias_max, qk_ln, prefix_lm refused",
        prefix="blocks.{layer}.attn.", anchor="Wqkv.weight",
        layer_count="n_layers", fused=("Wqkv",), ignores=("logit_scale",),
        requires=("attn_config",)),
    others.family(
        "persimmon", ("partial_rotary_factor", "qk_layernorm"), _persimmon,
        "fused query_key_value [N, 3, H] and dense, biases; qk_layernorm "
        "(default on): LayerNorm [H] with a bias, shared; partial rotary "
        "(0.5)",
        anchor="query_key_value.weight", fused=("query_key_value",),
        requires=("qk_layernorm",)),
)

#: The config keys these families' attention reads that ``registry.SIGNS``
#: lacks (``attn_config``, ``multi_query``, ``qk_layernorm`` are there).
SIGNS: dict[str, str] = {}
