"""GPT-2 and the families after it with layouts of their own.

Shape glossary: D hidden size (``n_embd`` / ``hidden_size``), N query heads,
K key/value heads, G = N / K query heads per key/value head, H head dim
(``D // N`` in all of these), R rotated features of a head.

- gpt2: the fused ``c_attn`` (Conv1D ``[D, 3D]``, columns q, k, v) and
  ``c_proj``; ``scale_attn_weights``, ``scale_attn_by_inverse_layer_idx``;
  no rope.
- gpt_neox: the fused ``query_key_value`` (rows ``[N, 3, H]``: each head's
  q, k, v) and ``dense``, biases with ``attention_bias``; half-split rotary
  on the first ``int(H * partial_rotary_factor)`` features, the factor and
  base from ``rope_parameters`` / ``rope_scaling`` or the legacy
  ``rotary_pct`` / ``rotary_emb_base``; rope types as Llama's.
- gptj: ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj`` without biases;
  interleaved rotary pairs on the first ``rotary_dim`` features, base 10000
  (fixed in HF's code).
- bloom: the fused ``query_key_value`` (rows ``[N, 3, H]``) and ``dense``,
  with biases; ALiBi with BLOOM's slopes (any head count), added unscaled;
  no rope.
- falcon: the fused ``query_key_value`` in each of Falcon's layouts (rows
  ``[K, G + 2, H]`` with ``new_decoder_architecture``, ``[N + 2, H]`` (one
  key/value head) with ``multi_query``, else ``[N, 3, H]``) and ``dense``,
  biases with ``bias``; half-split rotary, or with ``alibi`` Falcon's ALiBi:
  scaled by ``1 / sqrt(H)`` and rounded to bfloat16 as HF computes it.
"""

from __future__ import annotations

from collections.abc import Mapping
import math
from typing import Any

from jax import lax
import jax.numpy as jnp
import numpy as np

from attention_jax.interop.checkpoints import config_rope
from attention_jax.interop.checkpoints import decoders
from attention_jax.interop.checkpoints import reading
from attention_jax.interop.checkpoints import registry
from attention_jax.masking.mask import Mask
from attention_jax.scores import rope as rope_lib
from attention_jax.scores import score_mods


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


def _size(cfg: Mapping[str, Any], keys: tuple[str, ...], family: str) -> int:
  """The first of ``keys`` the config has (the config class's order of
  precedence), as a positive int; none: refused, naming the last."""
  for key in keys:
    if cfg.get(key) is not None:
      return reading.positive_int(cfg, key, family)
  return reading.positive_int(cfg, keys[-1], family)


def _sizes(cfg: Mapping[str, Any], family: str, hidden: tuple[str, ...],
           heads: tuple[str, ...]) -> tuple[int, int, int]:
  """``(D, N, H)``: these families' head dim is ``D // N``, always."""
  d, n = _size(cfg, hidden, family), _size(cfg, heads, family)
  if d % n:
    raise ValueError(
        f"config {'/'.join(hidden)}={d} is not divisible by "
        f"{'/'.join(heads)}={n}: {family}'s head dim is hidden size // "
        "heads, so the config and its checkpoint disagree.")
  return d, n, d // n


def _fused_qkv(read: reading.Reader, *, d: int, h: int, groups: int,
               per_group: int, use_bias: bool,
               layout: str) -> dict[str, dict[str, Any]]:
  """``W_q``, ``W_k``, ``W_v`` out of ``query_key_value`` (``nn.Linear``,
  rows ``[groups, per_group + 2, H]``: each group's ``per_group`` query
  heads, then its key head, then its value head).

  The three layouts of GPT-NeoX, BLOOM and Falcon are all this one:
  ``[N, 3, H]`` is ``groups=N, per_group=1``, Falcon's multi-query ``[N +
  2, H]`` is ``groups=1, per_group=N``, and its new architecture's ``[K, G
  + 2, H]`` is ``groups=K, per_group=G`` (query head ``j * G + g`` of group
  ``j`` reads key/value head ``j``, as HF's ``repeat_kv`` pairs them).
  """
  slots = per_group + 2
  why = (f"[{groups} * {slots} * head_dim, hidden_size] = "
         f"[{groups * slots * h}, {d}], rows {layout}")
  w = read.get("query_key_value.weight", (groups * slots * h, d), why)
  kernel = w.T.reshape(d, groups, slots, h)  # y = x @ w.T
  parts = {"q": kernel[:, :, :per_group].reshape(d, groups * per_group, h),
           "k": kernel[:, :, per_group], "v": kernel[:, :, per_group + 1]}
  params = {f"W_{name}": {"kernel": part} for name, part in parts.items()}
  if use_bias:
    b = read.get("query_key_value.bias", (groups * slots * h,),
                 f"[{groups * slots * h}], rows {layout}").reshape(
                     groups, slots, h)
    params["W_q"]["bias"] = b[:, :per_group].reshape(groups * per_group, h)
    params["W_k"]["bias"] = b[:, per_group]
    params["W_v"]["bias"] = b[:, per_group + 1]
  return params


def _dense(read: reading.Reader, *, d: int, n: int, h: int,
           use_bias: bool) -> dict[str, Any]:
  """``W_o`` from ``dense`` (``nn.Linear [D, N * H]``)."""
  w = read.get("dense.weight", (d, n * h),
               f"[hidden_size, heads * head_dim]; hidden_size={d}, "
               f"heads={n}, head_dim={h}")
  out = {"kernel": w.T.reshape(n, h, d)}  # [N, H, D]
  if use_bias:
    out["bias"] = read.get("dense.bias", (d,), "[hidden_size]")
  return out


def _finish(read: reading.Reader, params: dict[str, Any],
            options: dict[str, Any], notes: list[str],
            overrides: Mapping[str, Any], *, n: int, k: int,
            h: int) -> registry.Built:
  """qk-norm and sinks where overrides ask for them (these families have
  neither), then the build's result."""
  decoders.read_norms(read, params, options, notes,
                      overrides.get("normalize_qk"), n=n, k=k, h=h)
  if overrides.get("attention_sinks", False):
    decoders.read_sinks(read, params, options, notes, n)
  return params, options, "; ".join(notes)


def _gpt_neox(cfg: Mapping[str, Any], layer: int, read: reading.Reader,
              overrides: Mapping[str, Any], attention: str) -> registry.Built:
  """GPT-NeoX: ``query_key_value`` rows ``[N, 3, H]``, partial rotary."""
  del attention
  d, n, h = _sizes(cfg, "gpt_neox", ("hidden_size",),
                   ("num_attention_heads",))
  if cfg.get("head_dim") not in (None, h):
    # HF's rotary frequencies would read it, its attention would not.
    raise ValueError(
        f"config head_dim={cfg['head_dim']}, but GPT-NeoX's attention uses "
        f"hidden_size // num_attention_heads = {h} (HF would size its "
        "rotary frequencies by head_dim and its heads by the other): remove "
        "head_dim from the config.")
  use_bias = bool(cfg.get("attention_bias", True))  # GPTNeoXConfig: True
  params = _fused_qkv(read, d=d, h=h, groups=n, per_group=1,
                      use_bias=use_bias, layout="[heads, 3, head_dim]: each "
                      "head's q, k, v")
  params["W_o"] = _dense(read, d=d, n=n, h=h, use_bias=use_bias)
  options: dict[str, Any] = dict(d_model=d, num_heads=n, num_kv_heads=n,
                                 head_dim=h, use_bias=use_bias, scale=None)
  if "mask" not in overrides:
    options["mask"] = Mask(causal=True)
  notes = [f"config attention_bias={use_bias}",
           "query_key_value rows [N, 3, H]"]
  if "rope" not in overrides:
    options["rope"] = _neox_rope(cfg, layer, h)
    notes.append(f"rotary on {options['rope'].rotary_dim(h)} of {h} "
                 "features")
  return _finish(read, params, options, notes, overrides, n=n, k=n, h=h)


def _neox_rope(cfg: Mapping[str, Any], layer: int,
               h: int) -> rope_lib.Rope:
  """GPT-NeoX's rope, as transformers 5's ``GPTNeoXConfig`` reads it.

  ``rope_parameters`` (or old ``rope_scaling``), whose missing base and
  factor come from the legacy ``rotary_emb_base`` (10000) and
  ``rotary_pct`` (0.25); top-level ``rope_theta`` and
  ``partial_rotary_factor`` are not read by it.
  """
  p = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
  legacy = {"rope_theta": ("rotary_emb_base", 10000.0),
            "partial_rotary_factor": ("rotary_pct", 0.25)}
  for key, (old, default) in legacy.items():
    p.setdefault(key, default if cfg.get(old) is None else cfg[old])
    top = cfg.get(key)
    if top is not None and (not reading.is_number(top) or not reading.is_number(
        p[key]) or float(top) != float(p[key])):
      # transformers 4 let a top-level key win, 5 ignores it: which one a
      # checkpoint was trained with is not in the config.
      raise ValueError(
          f"config has {key}={top!r} at the top level, but GPT-NeoX's rope "
          f"uses {key}={p[key]!r} (rope_parameters / rope_scaling, else the "
          f"legacy {old!r}): transformers 5 ignores the top-level key for "
          "GPT-NeoX and earlier versions applied it, so the loader does not "
          f"pick one. Make them agree (or remove {key!r}), or pass "
          "overrides={'rope': aj.Rope(base=..., fraction=...)}.")
  fraction = p["partial_rotary_factor"]
  rotated = int(h * float(fraction)) if reading.is_number(fraction) else -1
  if rotated < 2 or rotated > h or rotated % 2:
    # HF rotates int(H * factor) features with ceil(R / 2) frequencies: an
    # odd R, or R > H, breaks its own shapes; R = 0 is no rope at all.
    raise ValueError(
        f"config's partial_rotary_factor (rotary_pct) {fraction!r} makes "
        f"GPT-NeoX rotate int(head_dim * factor) = {rotated} of head_dim={h} "
        "features; the loader maps an even number from 2 to head_dim. Fix "
        "the factor, or pass overrides={'rope': aj.Rope(...)} (or None for "
        "no rope).")
  # (config_rope maps the rope types: the base and factor now in `p`.)
  return config_rope.rope({**cfg, "rope_parameters": p, "rope_scaling": None},
                          "gpt_neox", layer, partial=True)


def _gptj(cfg: Mapping[str, Any], layer: int, read: reading.Reader,
          overrides: Mapping[str, Any], attention: str) -> registry.Built:
  """GPT-J: separate q/k/v/out projections, interleaved partial rotary."""
  del attention, layer
  d, n, h = _sizes(cfg, "gptj", ("n_embd", "hidden_size"),
                   ("n_head", "num_attention_heads"))
  dims = f"n_embd={d}, n_head={n}, head_dim={h}"
  params = {}
  for name in ("q", "k", "v"):
    w = read.get(f"{name}_proj.weight", (d, d),
                 f"[n_embd, n_embd], no bias; {dims}")
    params[f"W_{name}"] = {"kernel": w.T.reshape(d, n, h)}
  w = read.get("out_proj.weight", (d, d), f"[n_embd, n_embd], no bias; {dims}")
  params["W_o"] = {"kernel": w.T.reshape(n, h, d)}
  options: dict[str, Any] = dict(d_model=d, num_heads=n, num_kv_heads=n,
                                 head_dim=h, use_bias=False, scale=None)
  if "mask" not in overrides:
    options["mask"] = Mask(causal=True)
  notes = ["GPT-J: no biases"]
  if "rope" not in overrides:
    options["rope"] = _gptj_rope(cfg, h)
    notes.append(f"interleaved rotary on {options['rope'].rotary_dim(h)} of "
                 f"{h} features, base 10000")
  return _finish(read, params, options, notes, overrides, n=n, k=n, h=h)


def _gptj_rope(cfg: Mapping[str, Any], h: int) -> rope_lib.Rope:
  """GPT-J's rope: pairs ``(x[2i], x[2i + 1])`` of the first ``rotary_dim``
  features, base 10000 (``create_sinusoidal_positions``: not configurable)."""
  for key in ("rope_theta", "rope_scaling", "rope_parameters",
              "partial_rotary_factor"):
    if cfg.get(key) is not None:
      raise ValueError(
          f"config has {key}={cfg[key]!r}, which HF's GPT-J does not read "
          "(its rotary base is 10000, fixed in its code, over rotary_dim "
          "features): a config that sets it describes another model's "
          f"rope. Remove {key!r}, or, if this model's code applies it, pass "
          "overrides={'rope': aj.Rope(base=..., interleaved=True, "
          "fraction=...)}.")
  if "rotary_dim" in cfg and cfg["rotary_dim"] is None:
    # Old transformers then sized the table by n_embd, not the head: only
    # one head fits it, and transformers 5 refuses None.
    raise ValueError(
        "config rotary_dim=None: HF's GPT-J then builds its rotary table "
        "over n_embd rather than a head (and transformers 5 refuses it); set "
        f"rotary_dim (an even number of features, at most head_dim={h}).")
  rotated = (reading.positive_int(cfg, "rotary_dim", "gptj")
             if "rotary_dim" in cfg else 64)  # GPTJConfig's default
  if rotated > h or rotated % 2:
    raise ValueError(
        f"config rotary_dim={rotated}, but GPT-J rotates pairs of the first "
        f"rotary_dim features of each head (head_dim={h}): it must be even "
        "and at most head_dim (HF's shapes fail otherwise).")
  fraction = rotated / h
  if int(h * fraction) != rotated:  # rotated / h * h fell just below
    fraction = math.nextafter(fraction, math.inf)
  rope = rope_lib.Rope(base=10000.0, interleaved=True, fraction=fraction)
  if rope.rotary_dim(h) != rotated:
    raise ValueError(f"rotary_dim={rotated} of head_dim={h} is not a "
                     "fraction aj.Rope represents.")
  return rope


def alibi_slopes(num_heads: int) -> np.ndarray:
  """BLOOM's and Falcon's ALiBi slopes, as HF's ``_get_alibi_slopes``.

  The base ``2 ** (-8 / c)`` (``c`` the largest power of two ``<= N``) is
  rounded to float32 first, then raised to the powers ``1 .. c``; past
  ``c`` heads come the odd powers of the next base (``2 ** (-4 / c)``).
  ``aj.alibi_slopes`` raises the exact base instead, so from 11 heads on it
  differs by up to 2e-6 relative: not used. Here each power is the
  correctly rounded one; torch's own float32 ``pow`` is within 1 ulp of it
  (equal on CPU below 32 heads), and differs itself between devices.

  Args:
    num_heads: N, the number of query heads (any positive count).

  Returns:
    float32 ``[N]``, one slope per query head.
  """
  c = 2 ** math.floor(math.log2(num_heads))

  def powers(count: int, exponents: range) -> list[np.float32]:
    base = float(np.float32(2.0 ** (-(2.0 ** -(math.log2(count) - 3)))))
    return [np.float32(base ** e) for e in exponents]

  slopes = powers(c, range(1, c + 1))
  if c != num_heads:
    slopes += powers(2 * c, range(1, 1 + 2 * min(c, num_heads - c), 2))
  return np.asarray(slopes, np.float32)


def _bloom(cfg: Mapping[str, Any], layer: int, read: reading.Reader,
           overrides: Mapping[str, Any], attention: str) -> registry.Built:
  """BLOOM: ``query_key_value`` rows ``[N, 3, H]``, ALiBi added unscaled."""
  del attention, layer
  # BloomConfig: n_embed (old configs) wins over hidden_size.
  d, n, h = _sizes(cfg, "bloom", ("n_embed", "hidden_size"),
                   ("n_head", "num_attention_heads"))
  params = _fused_qkv(read, d=d, h=h, groups=n, per_group=1, use_bias=True,
                      layout="[n_head, 3, head_dim]: each head's q, k, v")
  params["W_o"] = _dense(read, d=d, n=n, h=h, use_bias=True)
  notes = ["BLOOM: biases on query_key_value and dense"]
  tp = (reading.positive_int(cfg, "pretraining_tp", "bloom")
        if cfg.get("pretraining_tp") is not None else 1)
  if cfg.get("slow_but_exact", False) and tp > 1:
    # HF's slow_but_exact path sums F.linear over pretraining_tp column
    # slices of dense without its bias: the bias is read, and not added.
    params["W_o"]["bias"] = np.zeros_like(params["W_o"]["bias"])
    notes.append(f"slow_but_exact with pretraining_tp={tp}: HF does not "
                 "add dense.bias")
  options: dict[str, Any] = dict(d_model=d, num_heads=n, num_kv_heads=n,
                                 head_dim=h, use_bias=True, scale=None)
  if "mask" not in overrides:
    options["mask"] = Mask(causal=True)
  if "score_mod" not in overrides:
    # HF: scores = q.k / sqrt(H) + slope * key position (not scaled); ours
    # subtracts slope * (query - key position), the same softmax (a row's
    # constant drops out). As HF's float32 run: its bfloat16 one rounds
    # slope * position to bfloat16 (not reproduced).
    options["score_mod"] = score_mods.alibi(jnp.asarray(alibi_slopes(n)))
    notes.append("ALiBi (BLOOM's slopes), added unscaled")
  return _finish(read, params, options, notes, overrides, n=n, k=n, h=h)


def _round_bfloat16(x: jnp.ndarray) -> jnp.ndarray:
  """float32 ``x`` rounded to the nearest bfloat16 (ties to even), as
  float32. By its bits: XLA may drop a float32 -> bfloat16 -> float32 pair
  of casts as excess precision, which would skip the rounding."""
  bits = lax.bitcast_convert_type(x, jnp.uint32)
  lsb = (bits >> 16) & 1
  bits = (bits + jnp.uint32(0x7FFF) + lsb) & jnp.uint32(0xFFFF0000)
  return lax.bitcast_convert_type(bits, jnp.float32)


def _falcon_alibi_fn(score, b, h, q_idx, kv_idx, params):
  """``score + bf16(slope[h] * bf16(kv_idx)) / sqrt(H)`` (Falcon's ALiBi)."""
  del b, q_idx
  slopes, root = params
  position = _round_bfloat16(kv_idx.astype(jnp.float32))
  # Two bfloat16 values: their float32 product is exact, rounded once.
  bias = _round_bfloat16(slopes[h] * position) / root
  return score + bias.astype(score.dtype)


def falcon_alibi(num_heads: int, head_dim: int) -> score_mods.ScoreMod:
  """Falcon's ALiBi as a score modifier, as HF's ``build_alibi_tensor``.

  HF rounds the slopes to bfloat16, multiplies them by each key's position
  (as bfloat16, rounded to bfloat16) and adds the product divided by
  ``sqrt(H)`` to the scaled scores, in float32 activations too. These
  roundings depend on the key's position, so they do not cancel in the
  softmax: plain ``aj.alibi(slopes / sqrt(H))`` differs by up to
  bfloat16's relative 2**-9 of ``slope * position / sqrt(H)`` (it is exact
  only for power-of-two slopes, i.e. up to 8 heads, below position 256):
  2e-2 of the output's scale at 16 heads and 300 tokens, 2000 times the
  loader's 1e-5 tolerance. This reproduces each rounding, leaving float32
  rounding only (1e-6 there). Positions are the key indices, HF's without
  padding (its left-padded positions restart, and these roundings are not
  shift-invariant). Scores in bfloat16 get the float32 bias rounded once,
  where HF's bfloat16 run also divides in bfloat16.

  Args:
    num_heads: N, the number of query heads (slopes ``alibi_slopes(N)``).
    head_dim: H; the bias is divided by ``sqrt(H)`` in float32.

  Returns:
    An ``aj.ScoreMod`` adding ``bf16(slope[h] * bf16(kv_idx)) / sqrt(H)``
    to the scaled scores.
  """
  slopes = alibi_slopes(num_heads).astype(jnp.bfloat16).astype(np.float32)
  root = np.float32(math.sqrt(head_dim))  # HF: float32 alibi / sqrt(H)
  return score_mods.ScoreMod(
      _falcon_alibi_fn, (jnp.asarray(slopes), jnp.asarray(root)),
      blocks=False)


def _falcon(cfg: Mapping[str, Any], layer: int, read: reading.Reader,
            overrides: Mapping[str, Any], attention: str) -> registry.Built:
  """Falcon: its three ``query_key_value`` layouts; rotary or ALiBi."""
  del attention
  d, n, h = _sizes(cfg, "falcon", ("n_embed", "hidden_size"),
                   ("num_attention_heads",))
  new = bool(cfg.get("new_decoder_architecture", False))
  multi_query = bool(cfg.get("multi_query", True))  # FalconConfig: True
  kv = cfg.get("num_kv_heads")
  if new:  # wins over multi_query in HF's code
    k = n if kv is None else reading.positive_int(cfg, "num_kv_heads",
                                                  "falcon")
    if n % k:
      raise ValueError(
          f"config num_kv_heads={k} does not divide "
          f"num_attention_heads={n}: Falcon's new_decoder_architecture "
          "groups the query heads by key/value head (HF's view fails too).")
    groups, per_group = k, n // k
    layout = (f"[num_kv_heads, heads / num_kv_heads + 2, head_dim] = [{k}, "
              f"{n // k + 2}, {h}]: each group's queries, key, value")
  elif multi_query:  # num_kv_heads is not read: one key/value head
    k, groups, per_group = 1, 1, n
    layout = (f"[heads + 2, head_dim] = [{n + 2}, {h}]: the queries, then "
              "one key, one value (multi_query)")
  else:
    if kv not in (None, n):
      raise ValueError(
          f"config num_kv_heads={kv} with new_decoder_architecture=False and "
          f"multi_query=False: that Falcon layout has num_attention_heads="
          f"{n} key/value heads (rows [heads, 3, head_dim]), and HF's code "
          f"then fails grouping them by num_kv_heads={kv}. Set num_kv_heads "
          f"to {n} (or remove it), or new_decoder_architecture=True if the "
          "checkpoint has grouped [num_kv_heads, heads / num_kv_heads + 2, "
          "head_dim] rows.")
    k, groups, per_group = n, n, 1
    layout = f"[heads, 3, head_dim] = [{n}, 3, {h}]: each head's q, k, v"
  use_bias = bool(cfg.get("bias", False))  # FalconConfig: False
  params = _fused_qkv(read, d=d, h=h, groups=groups, per_group=per_group,
                      use_bias=use_bias, layout=layout)
  params["W_o"] = _dense(read, d=d, n=n, h=h, use_bias=use_bias)
  options: dict[str, Any] = dict(d_model=d, num_heads=n, num_kv_heads=k,
                                 head_dim=h, use_bias=use_bias, scale=None)
  if "mask" not in overrides:
    options["mask"] = Mask(causal=True)
  notes = [f"config bias={use_bias}", f"query_key_value rows {layout}"]
  # parallel_attn / num_ln_in_parallel_attn place the layer norms and the
  # MLP, not attention.
  if cfg.get("alibi", False):  # HF: rotary is `not alibi`
    if "score_mod" not in overrides:
      options["score_mod"] = falcon_alibi(n, h)
      notes.append("ALiBi / sqrt(head_dim) in bfloat16 (Falcon's)")
  elif "rope" not in overrides:
    options["rope"] = config_rope.rope(cfg, "falcon", layer)
    notes.append("rotary")
  return _finish(read, params, options, notes, overrides, n=n, k=k, h=h)


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
    registry.Family(
        name="gpt_neox", model_types=("gpt_neox",),
        reads=("rotary_pct", "rotary_emb_base", "partial_rotary_factor",
               "use_parallel_residual"),
        build=_gpt_neox, prefix="layers.{layer}.attention.",
        anchor="query_key_value.weight",
        maps="fused query_key_value [N, 3, H] and dense; attention_bias; "
             "partial rotary (rotary_pct, rotary_emb_base, rope types)",
        # Old checkpoints' causal-mask buffers (rotary_emb.inv_freq is
        # reading.IGNORED_PREFIX).
        ignored=("bias", "masked_bias"), fused=("query_key_value",)),
    registry.Family(
        name="gptj", model_types=("gptj",),
        reads=("n_embd", "n_head", "rotary_dim"),
        build=_gptj, prefix="h.{layer}.attn.", anchor="q_proj.weight",
        maps="q/k/v/out_proj, no biases; interleaved rotary on rotary_dim "
             "features, base 10000",
        layer_count="n_layer", ignored=("bias", "masked_bias")),
    registry.Family(
        name="bloom", model_types=("bloom",),
        reads=("n_head", "n_embed", "slow_but_exact"),
        build=_bloom, prefix="h.{layer}.self_attention.",
        anchor="query_key_value.weight",
        maps="fused query_key_value [N, 3, H] and dense, biases; ALiBi "
             "(BLOOM's slopes, unscaled); no rope",
        layer_count="n_layer", fused=("query_key_value",)),
    registry.Family(
        name="falcon", model_types=("falcon",),
        reads=("alibi", "multi_query", "new_decoder_architecture",
               "parallel_attn", "num_kv_heads", "n_embed"),
        build=_falcon, prefix="h.{layer}.self_attention.",
        anchor="query_key_value.weight",
        maps="fused query_key_value ([K, G + 2, H] new_decoder_architecture,"
             " [N + 2, H] multi_query, else [N, 3, H]) and dense; bias; "
             "rotary, or ALiBi / sqrt(H) in bfloat16 (alibi)",
        fused=("query_key_value",)),
)
