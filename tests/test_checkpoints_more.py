"""aj.load_attention_weights for the families of ``encoders``, ``others``,
``fused_layouts`` and DeepSeek-V2 (``latent``), against transformers.

Three independent checks per family: the goldens (``tests/golden/<family>.npz``
and ``tests/golden/variants/<name>.npz``, written by
``tests/golden/make_more_goldens.py``: a tiny HF model's attention inputs
and outputs) through the loader, every recorded layer; a float64 NumPy
reference written here from each family's formula (projections cut from the
HF state dict as its modeling code cuts them, clip, norms, rotary, mask,
softmax, output projection), against the loaded module on the golden's
input; and that dropping or changing each mapped option (a window, a clip, a
rotary base, ALiBi's maximum bias...) moves the output far past the
tolerance, so the goldens see every option. Then the config keys the
goldens do not vary, and the refusals.
"""

import dataclasses
import functools
import json
import pathlib

from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.interop import checkpoints
from attention_jax.interop.checkpoints import encoders
from attention_jax.interop.checkpoints import fused_layouts
from attention_jax.interop.checkpoints import latent
from attention_jax.interop.checkpoints import others

GOLDEN = pathlib.Path(__file__).parent / "golden"
# Goldens of a family's other layouts (in golden/variants/, which
# tests/test_checkpoints.py does not read): the family that loads them.
VARIANTS = {"gpt_bigcode_mha": "gpt_bigcode", "deepseek_v2_lora": "deepseek_v2",
            "olmoe_clip": "olmoe"}
MODULES = (encoders, others, fused_layouts)
NAMES = tuple(f.name for m in MODULES for f in m.FAMILIES) + ("deepseek_v2",)
# Variants the loader refuses (tested below), not loaded.
REFUSED = ("olmoe_clip",)
# float32 against float32 torch: projections of <= 64 terms, a softmax over
# <= 10 keys, the output projection (observed <= 6e-7 of the output's scale,
# 7..24; <= 1e-6 against float64); as tests/test_checkpoints.py, 1e-5 of
# the scale leaves headroom
# for other CPUs, while every mis-mapped option below moves the output by
# >= 1e-2 of it (1000 times more).
REL_TOL = 1e-5


@functools.cache
def _golden(name: str):
  path = GOLDEN / ("variants" if name in VARIANTS else "") / f"{name}.npz"
  z = np.load(path)
  sd = {k[len("sd/"):]: z[k] for k in z.files if k.startswith("sd/")}
  arrays = {k: z[k] for k in z.files if k.startswith(("in/", "out/"))}
  return arrays, sd, json.loads(str(z["config_json"]))


def _load(name: str, layer: int, cfg=None, **kwargs):
  _, sd, golden_cfg = _golden(name)
  return checkpoints.load_attention_weights(
      sd, family=VARIANTS.get(name, name), layer=layer,
      config=golden_cfg if cfg is None else cfg, **kwargs)


def _module(loaded, params=None, **change):
  """The loaded layer, with options changed (and the params of norms
  changed to None dropped), as a fresh module."""
  latent_layer = checkpoints.FAMILIES[loaded.family].module == "latent"
  cls = aj.MultiHeadLatentAttention if latent_layer else aj.MultiHeadAttention
  options = {**loaded.options, **change}
  params = dict(loaded.params if params is None else params(loaded.params))
  for option, entries in (("normalize_qk", ("q_norm", "k_norm")),
                          ("output_norm", ("o_norm",))):
    if option in change and not change[option]:
      for entry in entries:
        params.pop(entry, None)
  module = cls(**options, rngs=nnx.Rngs(0))
  module.load_params(params)
  return module


def _error(name: str, layer: int, params=None, **change):
  """(max |ours - HF|, max |HF|) on one recorded layer."""
  arrays, _, _ = _golden(name)
  loaded = _load(name, layer)
  got = np.asarray(_module(loaded, params, **change)(
      jnp.asarray(arrays[f"in/{layer}"])))
  want = arrays[f"out/{layer}"]
  return float(np.abs(got - want).max()), float(np.abs(want).max())


def _recorded():
  for name in (*NAMES, *VARIANTS):
    if name in REFUSED:
      continue
    arrays, _, _ = _golden(name)
    for key in sorted(k for k in arrays if k.startswith("in/")):
      yield f"{name}_{key[3:]}", name, int(key[3:])


# ---- float64 references, from each family's formula ----------------------

def _lin(x, sd, name, bias=True):
  """``x @ W.T + b`` of the HF ``nn.Linear`` ``name``, float64."""
  y = x @ sd[name + ".weight"].astype(np.float64).T
  if bias and name + ".bias" in sd:
    y = y + sd[name + ".bias"]
  return y


def _heads(x, heads):
  """``[B, T, heads * H]`` -> ``[B, T, heads, H]``."""
  return x.reshape(*x.shape[:2], heads, -1)


def _rotate(x, inv_freq, interleaved=False, magnitude=1.0):
  """Rotary positions 0..T-1 on the first ``2 * len(inv_freq)`` features of
  ``x [B, T, heads, H]``: pairs ``(i, i + R/2)``, or ``(2i, 2i + 1)``."""
  r = 2 * len(inv_freq)
  angle = np.arange(x.shape[1])[:, None] * inv_freq[None]  # [T, R/2]
  cos = (np.cos(angle) * magnitude)[None, :, None]
  sin = (np.sin(angle) * magnitude)[None, :, None]
  rot = x[..., :r]
  if interleaved:
    a, b = rot[..., 0::2], rot[..., 1::2]
    out = np.stack([a * cos - b * sin, b * cos + a * sin], -1).reshape(
        rot.shape)
  else:
    a, b = rot[..., :r // 2], rot[..., r // 2:]
    out = np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)
  return np.concatenate([out, x[..., r:]], -1)


def _freq(base, r):
  return base ** (-np.arange(0, r, 2) / r)


def _attend(q, k, v, *, scale, seen=None, bias=None):
  """Softmax attention, float64: ``q [B, T, N, H]``, ``k``, ``v [B, T, K,
  H]`` (query head j reads key head j // (N / K)); ``seen [T, T]``;
  ``bias [N, T, T]`` added to the scaled scores."""
  n, kv = q.shape[2], k.shape[2]
  k, v = np.repeat(k, n // kv, axis=2), np.repeat(v, n // kv, axis=2)
  logits = np.einsum("btnh,bsnh->bnts", q, k) * scale
  if bias is not None:
    logits = logits + bias[None]
  if seen is not None:
    logits = np.where(seen, logits, -np.inf)
  e = np.exp(logits - logits.max(-1, keepdims=True))
  out = np.einsum("bnts,bsnh->btnh", e / e.sum(-1, keepdims=True), v)
  return out.reshape(*out.shape[:2], -1)


def _causal(t):
  return np.tril(np.ones((t, t), bool))


def _layer_norm(x, w, b, eps):
  mu = x.mean(-1, keepdims=True)
  y = (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps)
  return y * w + (0.0 if b is None else b)


def _rms_norm(x, w, eps):
  return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _modernbert(x, sd, cfg, layer):
  p = f"model.layers.{layer}.attn."
  n = cfg["num_attention_heads"]
  qkv = _lin(x, sd, p + "Wqkv").reshape(*x.shape[:2], 3, n, -1)
  q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
  kind = cfg["layer_types"][layer]
  inv = _freq(cfg["rope_parameters"][kind]["rope_theta"], q.shape[-1])
  q, k = _rotate(q, inv), _rotate(k, inv)
  t = x.shape[1]
  i, j = np.arange(t)[:, None], np.arange(t)[None]
  seen = (np.abs(i - j) <= cfg["local_attention"] // 2
          if kind == "sliding_attention" else None)  # bidirectional
  out = _attend(q, k, v, scale=q.shape[-1] ** -0.5, seen=seen)
  return _lin(out, sd, p + "Wo")


def _yarn(p, dim):
  """HF's _compute_yarn_parameters (truncate): inv_freq, magnitude."""
  base, factor = p["rope_theta"], p["factor"]
  mscale = lambda m: 0.1 * m * np.log(factor) + 1.0 if factor > 1 else 1.0
  corr = lambda rot: (dim * np.log(p["original_max_position_embeddings"] / (
      rot * 2 * np.pi))) / (2 * np.log(base))
  low = max(np.floor(corr(p["beta_fast"])), 0)
  high = min(np.ceil(corr(p["beta_slow"])), dim - 1)
  ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
  extra = _freq(base, dim)
  inv = extra / factor * ramp + extra * (1 - ramp)
  return inv, mscale(p["mscale"]) / mscale(p["mscale_all_dim"])


def _deepseek_v2(x, sd, cfg, layer):
  p = f"model.layers.{layer}.self_attn."
  n, r = cfg["num_attention_heads"], cfg["kv_lora_rank"]
  hn, hr = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
  if cfg["q_lora_rank"] is None:
    q = _lin(x, sd, p + "q_proj")
  else:  # DeepseekV2RMSNorm's own epsilon, 1e-6
    q = _lin(_rms_norm(_lin(x, sd, p + "q_a_proj"),
                       sd[p + "q_a_layernorm.weight"], 1e-6), sd,
             p + "q_b_proj")
  q = _heads(q, n)
  compressed = _lin(x, sd, p + "kv_a_proj_with_mqa")
  latent_kv = _rms_norm(compressed[..., :r], sd[p + "kv_a_layernorm.weight"],
                        1e-6)
  kv = _heads(_lin(latent_kv, sd, p + "kv_b_proj"), n)
  inv, magnitude = _yarn(cfg["rope_parameters"], hr)
  # Complex rotation of pairs (x[2i], x[2i + 1]), freqs_cis * magnitude.
  q_rot = _rotate(q[..., hn:], inv, True, magnitude)
  k_rot = _rotate(compressed[:, :, None, r:], inv, True, magnitude)
  q = np.concatenate([q[..., :hn], q_rot], -1)
  k = np.concatenate([kv[..., :hn], np.repeat(k_rot, n, axis=2)], -1)
  rope = cfg["rope_parameters"]
  m = 0.1 * rope["mscale_all_dim"] * np.log(rope["factor"]) + 1.0
  out = _attend(q, k, kv[..., hn:], scale=(hn + hr) ** -0.5 * m * m,
                seen=_causal(x.shape[1]))
  return _lin(out, sd, p + "o_proj")


def _gpt_bigcode(x, sd, cfg, layer):
  p = f"transformer.h.{layer}.attn."
  d, n = cfg["n_embd"], cfg["n_head"]
  h = d // n
  fused = _lin(x, sd, p + "c_attn")
  if cfg["multi_query"]:  # the queries, one key head, one value head
    q = _heads(fused[..., :d], n)
    k, v = fused[..., None, d:d + h], fused[..., None, d + h:]
  else:  # each head's q, k, v
    qkv = fused.reshape(*x.shape[:2], n, 3, h)
    q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
  out = _attend(q, k, v, scale=h ** -0.5, seen=_causal(x.shape[1]))
  return _lin(out, sd, p + "c_proj")


def _separate(x, sd, p, n, k):
  return (_heads(_lin(x, sd, p + "q_proj"), n),
          _heads(_lin(x, sd, p + "k_proj"), k),
          _heads(_lin(x, sd, p + "v_proj"), k))


def _stablelm(x, sd, cfg, layer):
  p = f"model.layers.{layer}.self_attn."
  n, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
  q, k, v = _separate(x, sd, p, n, kv)
  eps = cfg["layer_norm_eps"]
  for name, a in (("q", q), ("k", k)):  # one bias-free LayerNorm per head
    for j in range(a.shape[2]):
      a[:, :, j] = _layer_norm(a[:, :, j], sd[
          f"{p}{name}_layernorm.norms.{j}.weight"], None, eps)
  h = q.shape[-1]
  inv = _freq(cfg["rope_parameters"]["rope_theta"], int(
      h * cfg["rope_parameters"]["partial_rotary_factor"]))
  q, k = _rotate(q, inv), _rotate(k, inv)
  out = _attend(q, k, v, scale=h ** -0.5, seen=_causal(x.shape[1]))
  return _lin(out, sd, p + "o_proj")


def _olmo(x, sd, cfg, layer, whole_width_norm=False):
  p = f"model.layers.{layer}.self_attn."
  n, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
  q = _lin(x, sd, p + "q_proj")
  k, v = _lin(x, sd, p + "k_proj"), _lin(x, sd, p + "v_proj")
  if whole_width_norm:  # OLMoE: RMSNorm over N * H, then the clip
    q = _rms_norm(q, sd[p + "q_norm.weight"], cfg["rms_norm_eps"])
    k = _rms_norm(k, sd[p + "k_norm.weight"], cfg["rms_norm_eps"])
  c = cfg["clip_qkv"]
  if c is not None:
    q, k, v = (np.clip(a, -c, c) for a in (q, k, v))
  q, k, v = _heads(q, n), _heads(k, kv), _heads(v, kv)
  inv = _freq(cfg["rope_parameters"]["rope_theta"], q.shape[-1])
  q, k = _rotate(q, inv), _rotate(k, inv)
  out = _attend(q, k, v, scale=q.shape[-1] ** -0.5, seen=_causal(x.shape[1]))
  return _lin(out, sd, p + "o_proj")


def _dbrx(x, sd, cfg, layer):
  p = f"transformer.blocks.{layer}.norm_attn_norm.attn."
  d, n, kv = cfg["d_model"], cfg["n_heads"], cfg["attn_config"]["kv_n_heads"]
  h = d // n
  c = cfg["attn_config"]["clip_qkv"]
  fused = np.clip(_lin(x, sd, p + "Wqkv"), -c, c)  # rows q, k, v
  q = _heads(fused[..., :d], n)
  k = _heads(fused[..., d:d + kv * h], kv)
  v = _heads(fused[..., d + kv * h:], kv)
  inv = _freq(cfg["rope_parameters"]["rope_theta"], h)
  q, k = _rotate(q, inv), _rotate(k, inv)
  out = _attend(q, k, v, scale=h ** -0.5, seen=_causal(x.shape[1]))
  return _lin(out, sd, p + "out_proj")


def _mpt_slopes(n, max_bias=8):
  """build_mpt_alibi_tensor's slopes: the next power of two's, odd ones
  after even ones."""
  p2 = 2 ** int(np.ceil(np.log2(n)))
  slopes = 1.0 / 2.0 ** (np.arange(1, p2 + 1) * (max_bias / p2))
  if p2 != n:
    slopes = np.concatenate([slopes[1::2], slopes[::2]])[:n]
  return slopes


def _mpt(x, sd, cfg, layer):
  p = f"transformer.blocks.{layer}.attn."
  n = cfg["n_heads"]
  c, scale = cfg["attn_config"]["clip_qkv"], cfg["attn_config"]["softmax_scale"]
  fused = np.clip(_lin(x, sd, p + "Wqkv"), -c, c)
  q, k, v = (_heads(a, n) for a in np.split(fused, 3, axis=-1))
  t = x.shape[1]
  # HF: slope * (kv - (T - 1)) added to every row (its last T of S).
  bias = _mpt_slopes(n)[:, None, None] * (np.arange(t) - (t - 1))[None, None]
  out = _attend(q, k, v, scale=scale, seen=_causal(t),
                bias=np.broadcast_to(bias, (n, t, t)))
  return _lin(out, sd, p + "out_proj")


def _shared_ln(a, sd, name, eps):
  return _layer_norm(a, sd[name + ".weight"], sd[name + ".bias"], eps)


def _phi(x, sd, cfg, layer):
  p = f"model.layers.{layer}.self_attn."
  n, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
  q, k, v = _separate(x, sd, p, n, kv)
  eps = cfg["layer_norm_eps"]  # one LayerNorm(H) with a bias, every head
  q = _shared_ln(q, sd, p + "q_layernorm", eps)
  k = _shared_ln(k, sd, p + "k_layernorm", eps)
  h = q.shape[-1]
  rope = cfg["rope_parameters"]
  inv = _freq(rope["rope_theta"], int(h * rope["partial_rotary_factor"]))
  q, k = _rotate(q, inv), _rotate(k, inv)
  out = _attend(q, k, v, scale=h ** -0.5, seen=_causal(x.shape[1]))
  return _lin(out, sd, p + "dense")


def _persimmon(x, sd, cfg, layer):
  p = f"model.layers.{layer}.self_attn."
  n = cfg["num_attention_heads"]
  qkv = _lin(x, sd, p + "query_key_value").reshape(*x.shape[:2], n, 3, -1)
  eps = cfg["layer_norm_eps"]
  q = _shared_ln(qkv[..., 0, :], sd, p + "q_layernorm", eps)
  k = _shared_ln(qkv[..., 1, :], sd, p + "k_layernorm", eps)
  h = q.shape[-1]
  rope = cfg["rope_parameters"]
  inv = _freq(rope["rope_theta"], int(h * rope["partial_rotary_factor"]))
  q, k = _rotate(q, inv), _rotate(k, inv)
  out = _attend(q, k, qkv[..., 2, :], scale=h ** -0.5,
                seen=_causal(x.shape[1]))
  return _lin(out, sd, p + "dense")


def _bitnet(x, sd, cfg, layer):
  p = f"model.layers.{layer}.self_attn."
  n, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
  q, k, v = _separate(x, sd, p, n, kv)
  inv = _freq(cfg["rope_parameters"]["rope_theta"], q.shape[-1])
  q, k = _rotate(q, inv), _rotate(k, inv)
  out = _attend(q, k, v, scale=q.shape[-1] ** -0.5, seen=_causal(x.shape[1]))
  out = _rms_norm(out, sd[p + "attn_sub_norm.weight"], cfg["rms_norm_eps"])
  return _lin(out, sd, p + "o_proj")


REFERENCES = {
    "modernbert": _modernbert, "deepseek_v2": _deepseek_v2,
    "deepseek_v2_lora": _deepseek_v2, "gpt_bigcode": _gpt_bigcode,
    "gpt_bigcode_mha": _gpt_bigcode, "stablelm": _stablelm, "olmo": _olmo,
    "olmoe": functools.partial(_olmo, whole_width_norm=True),
    "dbrx": _dbrx, "mpt": _mpt, "phi": _phi, "persimmon": _persimmon,
    "bitnet": _bitnet,
}


class GoldenTest(parameterized.TestCase):
  """Every recorded layer equals transformers' eager attention and a
  float64 NumPy reference of the family's formula, written from the HF
  state dict (not the loader's params)."""

  @parameterized.named_parameters(*_recorded())
  def test_matches_transformers_and_the_formula(self, name, layer):
    arrays, sd, cfg = _golden(name)
    x, hf = arrays[f"in/{layer}"], arrays[f"out/{layer}"]
    got = np.asarray(_load(name, layer).module()(jnp.asarray(x)))
    scale = float(np.abs(hf).max())
    self.assertGreater(scale, 1.0)  # O(1..10) logits, not near-zeros
    self.assertLess(float(np.abs(got - hf).max()), REL_TOL * scale)
    want = REFERENCES[name](x.astype(np.float64), sd, cfg, layer)
    # float32 against float64: the same sums as against torch (<= 1e-6
    # of the scale), so REL_TOL as there.
    np.testing.assert_allclose(got, want, atol=REL_TOL * scale, rtol=0)
    # The reference is HF's computation too (a check of the reference).
    np.testing.assert_allclose(hf, want, atol=REL_TOL * scale, rtol=0)

  def test_every_family_and_variant_has_a_golden_and_a_reference(self):
    self.assertEqual(sorted(REFERENCES), sorted(
        n for n in (*NAMES, *VARIANTS) if n not in REFUSED))
    for name in REFERENCES:
      arrays, _, _ = _golden(name)
      self.assertEqual(sorted(k for k in arrays if k.startswith("in/")),
                       ["in/0", "in/1"])  # both layers recorded


def _replace_rope(name, layer, **fields):
  return dataclasses.replace(_load(name, layer).options["rope"], **fields)


def _slopes(values):
  return aj.alibi(jnp.asarray(np.asarray(values, np.float32)))


class OptionsSeenTest(parameterized.TestCase):
  """Dropping or changing any mapped option moves the output far past
  REL_TOL: the goldens see each one."""

  def test_each_option_is_seen(self):
    mpt_slopes = _mpt_slopes(6)
    first_head = lambda key: lambda p: {**p, key: {
        **p[key], "scale": np.broadcast_to(p[key]["scale"][:1],
                                           p[key]["scale"].shape)}}
    no_bias = lambda p: {**p, **{key: {"scale": p[key]["scale"]}
                                 for key in ("q_norm", "k_norm")}}
    zero_biases = lambda p: {k: {**v, **({"bias": np.zeros_like(v["bias"])}
                                         if "bias" in v else {})}
                             for k, v in p.items()}
    cases = {
        "modernbert_biases": ("modernbert", 0, zero_biases, {}),
        "deepseek_v2_biases": ("deepseek_v2", 1, zero_biases, {}),
        "gpt_bigcode_biases": ("gpt_bigcode", 1, zero_biases, {}),
        "olmo_biases": ("olmo", 1, zero_biases, {}),
        "modernbert_window": ("modernbert", 1, None, dict(mask=None)),
        "modernbert_window_size": ("modernbert", 1, None, dict(
            mask=aj.Mask(window=(3, 3)))),
        "modernbert_bidirectional": ("modernbert", 0, None, dict(
            mask=aj.Mask(causal=True))),
        "modernbert_local_base": ("modernbert", 1, None, dict(
            rope=aj.Rope(base=160000.0))),
        "modernbert_global_base": ("modernbert", 0, None, dict(
            rope=aj.Rope(base=10000.0))),
        "deepseek_v2_pairs": ("deepseek_v2", 0, None, dict(
            rope=_replace_rope("deepseek_v2", 0, interleaved=False))),
        "deepseek_v2_mscale": ("deepseek_v2", 1, None, dict(
            scale=16 ** -0.5)),  # without YaRN's mscale ** 2
        "gpt_bigcode_scale": ("gpt_bigcode", 0, None, dict(scale=1.0)),
        "gpt_bigcode_mha_layout": ("gpt_bigcode_mha", 1, lambda p: {
            **p, "W_k": p["W_q"], "W_q": p["W_k"]}, {}),
        "stablelm_qk_norm": ("stablelm", 0, None, dict(normalize_qk=False)),
        "stablelm_norm_per_head": ("stablelm", 1, first_head("q_norm"), {}),
        "stablelm_partial_rotary": ("stablelm", 0, None, dict(
            rope=_replace_rope("stablelm", 0, fraction=1.0))),
        "olmo_clip": ("olmo", 0, None, dict(clip_qkv=None)),
        "olmo_clip_value": ("olmo", 1, None, dict(clip_qkv=2.0)),
        "olmoe_whole_width": ("olmoe", 0, None, dict(normalize_qk=aj.QKNorm(
            weight="per_head", epsilon=1e-5))),
        "dbrx_clip": ("dbrx", 0, None, dict(clip_qkv=None)),
        "dbrx_rope_base": ("dbrx", 1, None, dict(rope=aj.Rope())),
        "mpt_alibi": ("mpt", 0, None, dict(score_mod=None)),
        "mpt_alibi_max_bias": ("mpt", 1, None, dict(score_mod=aj.alibi(
            aj.alibi_slopes(6, max_bias=16.0)))),
        "mpt_slope_order": ("mpt", 1, None, dict(score_mod=_slopes(
            sorted(mpt_slopes, reverse=True)))),
        "mpt_clip": ("mpt", 0, None, dict(clip_qkv=None)),
        "mpt_softmax_scale": ("mpt", 1, None, dict(scale=None)),
        "phi_qk_norm_bias": ("phi", 0, no_bias, dict(
            normalize_qk=dataclasses.replace(
                _load("phi", 0).options["normalize_qk"], bias=False))),
        "phi_partial_rotary": ("phi", 1, None, dict(
            rope=_replace_rope("phi", 1, fraction=1.0))),
        "persimmon_qk_norm": ("persimmon", 0, None, dict(
            normalize_qk=False)),
        "persimmon_partial_rotary": ("persimmon", 1, None, dict(
            rope=_replace_rope("persimmon", 1, fraction=1.0))),
        "bitnet_sub_norm": ("bitnet", 0, None, dict(output_norm=None)),
    }
    for case, (name, layer, params, change) in cases.items():
      with self.subTest(case):
        error, scale = _error(name, layer, params, **change)
        self.assertGreater(error, 1000 * REL_TOL * scale)
    # The slopes mapped are MPT's own (HF's build_mpt_alibi_tensor order).
    np.testing.assert_allclose(aj.alibi_slopes(6), mpt_slopes, rtol=1e-7)


def _edit(name, drop=(), **extra):
  """The golden's config without ``drop``, with ``extra``."""
  _, _, cfg = _golden(name)
  return {k: v for k, v in cfg.items() if k not in drop} | extra


def _sub(name, **extra):
  """The golden's config with ``attn_config`` entries changed."""
  _, _, cfg = _golden(name)
  return {**cfg, "attn_config": {**cfg["attn_config"], **extra}}


class ConfigTest(parameterized.TestCase):
  """Config keys the goldens do not vary: old formats and the config
  classes' defaults, as transformers 5.25 fills them in."""

  def test_modernbert_old_keys_and_defaults(self):
    new = [_load("modernbert", i).options for i in (0, 1)]
    old = _edit("modernbert", drop=("layer_types", "rope_parameters"),
                global_rope_theta=160000.0, local_rope_theta=10000.0)
    for i in (0, 1):  # Hub configs: global/local_rope_theta, the pattern
      got = _load("modernbert", i, old).options
      self.assertEqual(got["rope"], new[i]["rope"])
      self.assertEqual(repr(got["mask"]), repr(new[i]["mask"]))
    # ModernBertConfig: every 3rd layer global, local_attention 128, bases
    # 160000 / 10000; an old rope_scaling applies to both layer types.
    bare = _edit("modernbert", drop=(
        "layer_types", "rope_parameters", "global_attn_every_n_layers",
        "local_attention"), num_hidden_layers=4,
                 rope_scaling={"rope_type": "linear", "factor": 2.0})
    got = [_load("modernbert", i, bare,  # (layer 3 reads layer 1's weights)
                 prefix=f"model.layers.{min(i, 1)}.attn.").options
           for i in (0, 1, 3)]
    self.assertEqual([g["mask"] and g["mask"].window for g in got],
                     [None, (64, 64), None])
    self.assertEqual([(g["rope"].base, g["rope"].scaling, g["rope"].factor)
                      for g in got], [(160000.0, "linear", 2.0),
                                      (10000.0, "linear", 2.0),
                                      (160000.0, "linear", 2.0)])
    # Hub configs' BERT leftover, which transformers 5 never reads.
    hub = _edit("modernbert", position_embedding_type="absolute")
    self.assertEqual(_load("modernbert", 1, hub).options["rope"],
                     new[1]["rope"])
    # The sliding_window property's setter wins over local_attention.
    half = _edit("modernbert", sliding_window=3)
    self.assertEqual(_load("modernbert", 1, half).options["mask"].window,
                     (3, 3))

  def test_partial_rotary_and_base_defaults(self):
    def rope(name, layer=0, **change):
      cfg = _edit(name, **change)
      return _load(name, layer, cfg).options["rope"]
    theta = {"rope_parameters": {"rope_type": "default",
                                 "rope_theta": 10000.0}}
    # StableLM / Phi / Persimmon: their config classes' factor.
    self.assertEqual(rope("stablelm", **theta).fraction, 0.25)
    self.assertEqual(rope("phi", **theta).fraction, 0.5)
    self.assertEqual(rope("persimmon", **theta).fraction, 0.5)
    # A top-level factor is taken where the rope parameters have none.
    self.assertEqual(rope("phi", partial_rotary_factor=0.25,
                          **theta).fraction, 0.25)
    # BitNet's class default base is 500000 (its default_theta).
    self.assertEqual(rope("bitnet", drop=("rope_parameters",)).base,
                     500000.0)
    self.assertEqual(rope("bitnet", drop=("rope_parameters",),
                          rope_theta=7.0).base, 7.0)

  def test_other_defaults(self):
    # PersimmonConfig's qk_layernorm is on by default.
    self.assertTrue(_load("persimmon", 0, _edit(
        "persimmon", drop=("qk_layernorm",))).options["normalize_qk"])
    # GPT-BigCode: multi_query by default; scale_attn_weights=False is 1.
    self.assertEqual(_load("gpt_bigcode", 0, _edit(
        "gpt_bigcode", drop=("multi_query",))).options["num_kv_heads"], 1)
    self.assertEqual(_load("gpt_bigcode", 0, _edit(
        "gpt_bigcode", scale_attn_weights=False)).options["scale"], 1.0)
    # MPT: clip_qkv 0 clips nothing (HF: `if self.clip_qkv:`).
    self.assertNotIn("clip_qkv", _load("mpt", 0, _sub(
        "mpt", clip_qkv=0)).options)
    # An explicit alibi_bias_max override is the port's choice.
    slopes = aj.alibi(aj.alibi_slopes(6, max_bias=16.0))
    got = _load("mpt", 0, _sub("mpt", alibi_bias_max=16),
                overrides={"score_mod": slopes})
    self.assertIs(got.options["score_mod"], slopes)
    # The config's epsilons reach the norms.
    for name, key, option in (("stablelm", "layer_norm_eps", "normalize_qk"),
                              ("phi", "layer_norm_eps", "normalize_qk"),
                              ("olmoe", "rms_norm_eps", "normalize_qk"),
                              ("bitnet", "rms_norm_eps", "output_norm")):
      got = _load(name, 0, _edit(name, **{key: 1e-3})).options[option]
      self.assertEqual(got.epsilon, 1e-3, name)

  def test_family_records(self):
    for module in (*MODULES, latent):
      for family in module.FAMILIES:
        with self.subTest(family.name):
          self.assertIs(checkpoints.FAMILIES[family.name], family)
          self.assertEqual(family.model_types, (family.name,))
          self.assertTrue(family.maps)
      signs = getattr(module, "SIGNS", {})
      read = {k for f in module.FAMILIES for k in f.reads}
      self.assertLessEqual(set(signs), read, module.__name__)
    # MPT's config class carries logit_scale (its LM head's), not read.
    self.assertIn("logit_scale", checkpoints.FAMILIES["mpt"].ignores)
    self.assertNotIn("logit_scale", checkpoints.FAMILIES["mpt"].reads)


class RefusalTest(parameterized.TestCase):
  """What HF applies and the layer cannot reproduce, what HF and the
  model's own code disagree on, and values HF cannot run: refused, named."""

  def test_options_that_cannot_be_reproduced(self):
    cases = {
        # HF norms, then clips, q and k; the layer clips before its norms.
        "olmoe_clip": ("olmoe_clip", None, r"config clip_qkv=1.0: HF's "
                       r"OlmoeAttention clamps the queries and keys after "
                       r"their RMSNorm"),
        "bitnet_quantized": ("bitnet", _edit("bitnet", quantization_config={
            "quant_method": "bitnet"}), r"quantization_config: this BitNet "
                             r"checkpoint's linear layers are ternary"),
        "olmo_clip_zero": ("olmo", _edit("olmo", clip_qkv=0.0),
                           r"config clip_qkv=0.0: HF clamps the projections"
                           r" .*positive finite number"),
        "dbrx_clip_negative": ("dbrx", _sub("dbrx", clip_qkv=-1.0),
                               r"attn_config clip_qkv=-1.0"),
        "modernbert_rope_theta": ("modernbert", _edit(
            "modernbert", rope_theta=5.0), r"rope_theta=5.0, which "
                                  r"transformers' ModernBertConfig ignores"),
        "modernbert_flat_rope": ("modernbert", _edit(
            "modernbert", rope_parameters={"rope_type": "default",
                                           "rope_theta": 5.0}),
                                 r"ModernBERT's are nested by layer type"),
        "deepseek_v2_interleave_key": ("deepseek_v2", _edit(
            "deepseek_v2", rope_interleave=False), r"rope_interleave=False,"
            r" which DeepseekV2Config does not have.*family='deepseek_v3'"),
        "dbrx_two_bases": ("dbrx", _sub("dbrx", rope_theta=10000.0),
                           r"attn_config\['rope_theta'\]=10000.0, but the "
                           r"top-level rope parameters give base 500000.0"),
        "stablelm_head_dim": ("stablelm", _edit("stablelm", head_dim=8),
                              r"head_dim=8, but stablelm's attention uses "
                              r"hidden_size // num_attention_heads = 16"),
    }
    for case, (name, cfg, message) in cases.items():
      with self.subTest(case), self.assertRaisesRegex(ValueError, message):
        _load(name, 0, cfg)

  def test_olmoe_clip_refusal_is_needed(self):
    """Clipping before the norm (all the layer can do) is not HF's."""
    arrays, _, cfg = _golden("olmoe_clip")
    loaded = _load("olmoe_clip", 1, {**cfg, "clip_qkv": None})
    want = arrays["out/1"]
    for clip in (None, 1.0):
      got = np.asarray(_module(loaded, clip_qkv=clip)(
          jnp.asarray(arrays["in/1"])))
      self.assertGreater(np.abs(got - want).max(),
                         1000 * REL_TOL * np.abs(want).max())

  def test_mpt_where_transformers_and_mosaicml_differ(self):
    cases = {"alibi": False, "alibi_bias_max": 16, "qk_ln": True,
             "prefix_lm": True}
    for key, value in cases.items():
      with self.subTest(key), self.assertRaisesRegex(
          ValueError, rf"attn_config\['{key}'\]={value}: .*MosaicML's own "
          r"code compute different layers here.*Pass overrides="):
        _load("mpt", 0, _sub("mpt", **{key: value}))
    with self.assertRaisesRegex(ValueError, r"attn_type='multiquery_"
                                r"attention': HF's MptAttention is "
                                r"multi-head only"):
      _load("mpt", 0, _sub("mpt", attn_type="multiquery_attention"))

  def test_untyped_configs_need_their_class_keys(self):
    untyped = _edit("stablelm", drop=("model_type", "use_qkv_bias"))
    with self.assertRaisesRegex(ValueError, r"config has no model_type, and "
                                r"every stablelm config has \['use_qkv_bias'"
                                r"\]"):
      _load("stablelm", 0, untyped)
    # With them, an untyped config loads as the typed one.
    typed = _load("mpt", 1).options
    got = _load("mpt", 1, _edit("mpt", drop=("model_type",))).options
    self.assertEqual(repr(got), repr(typed))

  def test_weights_of_another_layout_are_named(self):
    _, sd, cfg = _golden("gpt_bigcode")
    with self.assertRaisesRegex(ValueError, r"c_attn.weight'\] has shape "
                                r"\(96, 64\), expected \(192, 64\).*rows "
                                r"\[heads, 3, head_dim\]"):
      checkpoints.load_attention_weights(
          sd, family="gpt_bigcode", config={**cfg, "multi_query": False},
          layer=0)
    _, sd, cfg = _golden("dbrx")  # kv_n_heads defaults to 1
    with self.assertRaisesRegex(ValueError, r"Wqkv.weight'\] has shape "
                                r"\(128, 64\), expected \(96, 64\)"):
      checkpoints.load_attention_weights(
          sd, family="dbrx", layer=0, config={**cfg, "attn_config": {
              k: v for k, v in cfg["attn_config"].items()
              if k != "kv_n_heads"}})


if __name__ == "__main__":
  absltest.main()
