"""The Llama-style families against their published attention formulas.

Each family's attention written out in float64 NumPy from its modeling code
(transformers 5.25 ``modeling_<family>.py``), one ``Formula`` row per
family, and run on the weights and inputs of its golden
(``tests/golden/<family>.npz``: HF names, its config): the loaded layer must
equal it. The row states what the family's code does with the golden's
config values (window sizes, scales, which layers rotate) without calling
the loader's readers, so a reader that maps a key wrongly disagrees here as
well as with transformers' recorded outputs (``tests/test_checkpoints.py``).

Shape glossary: B batch, T tokens, D hidden, N query heads, K key/value
heads, H head dim, R rotated features.
"""

import dataclasses
import functools
import json
import pathlib

from absl.testing import absltest
from absl.testing import parameterized
import jax.numpy as jnp
import numpy as np

from attention_jax.interop import checkpoints

GOLDEN = pathlib.Path(__file__).parent / "golden"
# float32 layer against float64 formula: projections of 64 terms, a softmax
# over <= 10 keys (observed <= 5e-7 of the output's scale); any wrong
# option moves the output by >= 1e-2 of it.
REL_TOL = 1e-5


@dataclasses.dataclass(frozen=True)
class Formula:
  """One family's attention, as its modeling code computes it."""
  biases: str = "none"  # "none", "qkv", "all"
  scale: float | None = None  # None: H ** -0.5
  qk_norm: str | None = None  # "rms" [H], "rms_all" [N*H], "rms_1p"
  norm_after_rope: bool = False
  norm_names: tuple[str, str] = ("q_norm", "k_norm")
  pairs: str = "half"  # rotary pairs: "half" (rotate_half) or "interleaved"
  fraction: float = 1.0
  ntk_alpha: float | None = None
  windows: tuple[int | None, ...] = (None, None)  # per layer: q - k < W
  rotates: tuple[bool, ...] = (True, True)  # per layer
  soft_cap: float | None = None
  value_rms: bool = False  # Gemma 3n: a weightless RMSNorm on the values
  yarn: bool = False  # the rope parameters' YaRN frequencies (Ministral 3)
  # Ministral 3: queries times 1 + beta * log(1 + floor(i / original)).
  query_scale: tuple[float, int] | None = None
  # Qwen-VL: each frequency turns at one of three positions (time, height,
  # width): "blocked" by mrope_section, or Qwen3-VL's "interleaved".
  mrope: str | None = None


FORMULAS = {
    "granite": Formula(biases="all", scale=0.2),
    "granitemoe": Formula(biases="all", scale=0.2),
    "granitemoeshared": Formula(biases="all", scale=0.2),
    "arcee": Formula(biases="all"),
    "helium": Formula(biases="qkv", pairs="interleaved"),
    "glm": Formula(biases="qkv", pairs="interleaved", fraction=0.5),
    "glm4": Formula(biases="qkv", pairs="interleaved", fraction=0.5),
    "glm4_moe": Formula(biases="qkv", fraction=0.5, qk_norm="rms"),
    "seed_oss": Formula(biases="qkv"),
    "ernie4_5": Formula(biases="all", pairs="interleaved"),
    "ernie4_5_moe": Formula(biases="all", pairs="interleaved"),
    "nemotron": Formula(biases="all", fraction=0.5),
    "ministral": Formula(windows=(4, None)),
    "qwen2_moe": Formula(biases="qkv", windows=(4, None)),
    "qwen3_moe": Formula(qk_norm="rms", windows=(4, 4)),
    "dots1": Formula(qk_norm="rms", windows=(None, 4)),
    "olmo3": Formula(qk_norm="rms_all", windows=(4, None)),
    "exaone4": Formula(qk_norm="rms", windows=(4, None),
                       rotates=(True, False)),
    "smollm3": Formula(windows=(None, 4), rotates=(True, False)),
    "gemma": Formula(),
    "vaultgemma": Formula(scale=24 ** -0.5, windows=(4, None),
                          soft_cap=5.0),
    "ministral3": Formula(yarn=True, query_scale=(0.5, 4)),
    "qwen2_vl": Formula(biases="qkv", windows=(None, 4), mrope="blocked"),
    "qwen2_5_vl": Formula(biases="qkv", mrope="blocked"),
    "qwen3_vl": Formula(biases="all", qk_norm="rms", mrope="interleaved"),
    "gemma3n": Formula(scale=1.0, qk_norm="rms", value_rms=True,
                       windows=(4, None)),
    "hunyuan_v1_dense": Formula(biases="all", qk_norm="rms",
                                norm_after_rope=True, ntk_alpha=4.0,
                                norm_names=("query_layernorm",
                                            "key_layernorm")),
    "hunyuan_v1_moe": Formula(qk_norm="rms", norm_after_rope=True,
                              ntk_alpha=4.0,
                              norm_names=("query_layernorm",
                                          "key_layernorm")),
}


def _rms(x, w, eps, offset=0.0):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * (offset + w)


def _yarn(base, r, rope):
  """YaRN's inverse frequencies ``[R / 2]`` (HF's _compute_yarn_parameters,
  truncated correction range; its magnitude is 1 when mscale equals
  mscale_all_dim, as in the goldens)."""
  factor, original = rope["factor"], rope["original_max_position_embeddings"]
  dim_at = lambda rot: (r * np.log(original / (rot * 2 * np.pi))
                        / (2 * np.log(base)))
  low = max(np.floor(dim_at(rope.get("beta_fast", 32.0))), 0)
  high = min(np.ceil(dim_at(rope.get("beta_slow", 1.0))), r - 1)
  ramp = np.clip((np.arange(r // 2) - low) / max(high - low, 1e-3), 0, 1)
  extrapolate = 1 - ramp
  freqs = base ** (np.arange(0, r, 2, dtype=np.float64) / r)
  return (1 / (factor * freqs)) * (1 - extrapolate) + (1 / freqs) * extrapolate


def _mrope_axes(sections, layout):
  """Which of time, height, width (0, 1, 2) turns each frequency."""
  if layout == "blocked":  # Qwen2-VL: [T...T H...H W...W]
    return np.repeat(np.arange(3), sections)
  axes = np.zeros(sum(sections), int)  # Qwen3-VL: T H W T H W ... T T
  axes[1:3 * sections[1]:3] = 1
  axes[2:3 * sections[2]:3] = 2
  return axes


def _rotate(x, base, fraction, pairs, alpha, yarn=None, mrope=None):
  """Rotary embedding of ``x [B, heads, T, H]`` at positions ``0..T-1``
  (``mrope``: ``(positions [3, B, T], axis of each frequency)``)."""
  h = x.shape[-1]
  r = int(h * fraction)
  if alpha is not None:  # Hunyuan's fixed NTK base
    base = base * alpha ** (h / (h - 2))
  inv = base ** (-np.arange(0, r, 2, dtype=np.float64) / r)  # [R / 2]
  if yarn is not None:
    inv = _yarn(base, r, yarn)
  angles = np.arange(x.shape[2])[:, None] * inv[None]  # [T, R / 2]
  if mrope is not None:
    positions, axes = mrope  # [3, B, T], [R / 2]
    angles = (np.asarray(positions, np.float64)[axes].transpose(1, 2, 0)
              * inv)[:, None]  # [B, 1, T, R / 2]
  cos, sin = np.cos(angles), np.sin(angles)
  rot, rest = x[..., :r], x[..., r:]
  if pairs == "half":  # (x_i, x_{i + R/2}) turn together
    a, b = rot[..., :r // 2], rot[..., r // 2:]
    out = np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)
  else:  # (x_{2i}, x_{2i + 1})
    a, b = rot[..., 0::2], rot[..., 1::2]
    out = np.stack([a * cos - b * sin, b * cos + a * sin], -1).reshape(
        rot.shape)
  return np.concatenate([out, rest], -1)


def formula_attention(f: Formula, sd, cfg, layer: int, x, shared=None,
                      positions=None):
  """The layer's output ``[B, T, D]`` in float64, from the formula;
  ``shared``: ``(layer, its input)`` whose keys and values it reuses
  (Gemma 3n's shared layers); ``positions [3, B, T]``: M-RoPE's."""
  p = f"model.layers.{layer}.self_attn."
  if f.mrope is not None:  # a vision-language model's language model
    p, cfg = f"model.language_model.layers.{layer}.self_attn.", cfg[
        "text_config"]
  w = lambda name: np.asarray(sd[(kv_p if name[0] in "kv" else p) + name],
                              np.float64)
  kv_p = p if shared is None else f"model.layers.{shared[0]}.self_attn."
  n, k = cfg["num_attention_heads"], cfg["num_key_value_heads"]
  h = cfg.get("head_dim") or cfg["hidden_size"] // n
  x = np.asarray(x, np.float64)
  b, t, _ = x.shape

  kv_x = x if shared is None else np.asarray(shared[1], np.float64)

  def proj(name, heads, bias):
    y = (x if name == "q" else kv_x) @ w(f"{name}_proj.weight").T
    if bias:
      y = y + w(f"{name}_proj.bias")
    return y.reshape(b, t, heads, h).transpose(0, 2, 1, 3)  # [B, h, T, H]

  qkv_bias = f.biases in ("qkv", "all")
  q, key, v = proj("q", n, qkv_bias), proj("k", k, qkv_bias), proj(
      "v", k, qkv_bias)

  eps = cfg.get("rms_norm_eps")  # the qk-norms of these families read it

  def norm(q, key):
    if f.qk_norm == "rms_all":  # OLMo: over the whole projection width
      flat = lambda y: y.transpose(0, 2, 1, 3).reshape(b, t, -1)
      back = lambda y, heads: y.reshape(b, t, heads, h).transpose(0, 2, 1, 3)
      return (back(_rms(flat(q), w(f.norm_names[0] + ".weight"), eps), n),
              back(_rms(flat(key), w(f.norm_names[1] + ".weight"), eps),
                   k))
    offset = 1.0 if f.qk_norm == "rms_1p" else 0.0
    return (_rms(q, w(f.norm_names[0] + ".weight"), eps, offset),
            _rms(key, w(f.norm_names[1] + ".weight"), eps, offset))

  if f.value_rms:
    v = _rms(v, 1.0, eps)
  if f.qk_norm and not f.norm_after_rope:
    q, key = norm(q, key)
  if f.rotates[layer]:
    rope = cfg["rope_parameters"]
    kind = cfg.get("layer_types", [None] * 2)[layer]
    if isinstance(rope.get(kind), dict):  # OLMo 3: nested by layer type
      rope = rope[kind]
    base = rope["rope_theta"]
    mrope = None if f.mrope is None else (
        positions, _mrope_axes(rope["mrope_section"], f.mrope))
    q, key = (_rotate(y, base, f.fraction, f.pairs, f.ntk_alpha,
                      rope if f.yarn else None, mrope) for y in (q, key))
  if f.qk_norm and f.norm_after_rope:
    q, key = norm(q, key)
  key, v = (np.repeat(y, n // k, axis=1) for y in (key, v))  # GQA
  scores = np.einsum("bnqh,bnkh->bnqk", q, key) * (
      h ** -0.5 if f.scale is None else f.scale)
  if f.query_scale is not None:
    beta, original = f.query_scale
    scores = scores * (1 + beta * np.log1p(np.floor(np.arange(t) / original))
                       )[:, None]
  if f.soft_cap is not None:
    scores = f.soft_cap * np.tanh(scores / f.soft_cap)
  i, j = np.arange(t)[:, None], np.arange(t)[None]
  allowed = j <= i
  if f.windows[layer] is not None:
    allowed &= i - j < f.windows[layer]
  scores = np.where(allowed, scores, -np.inf)
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  out = np.einsum("bnqk,bnkh->bqnh", weights, v).reshape(b, t, n * h)
  out = out @ w("o_proj.weight").T
  if f.biases == "all" and p + "o_proj.bias" in sd:
    out = out + w("o_proj.bias")
  return out


@functools.cache
def _golden(family: str):
  z = np.load(GOLDEN / f"{family}.npz")
  sd = {k[len("sd/"):]: z[k] for k in z.files if k.startswith("sd/")}
  return z, sd, json.loads(str(z["config_json"]))


class FormulaTest(parameterized.TestCase):

  @parameterized.named_parameters(
      (f"{family}_{layer}", family, layer)
      for family in FORMULAS for layer in (0, 1))
  def test_loaded_layer_equals_the_formula(self, family, layer):
    z, sd, cfg = _golden(family)
    x = z[f"in/{layer}"]
    positions = z[f"pos/{layer}"] if f"pos/{layer}" in z.files else None
    want = formula_attention(FORMULAS[family], sd, cfg, layer, x,
                             positions=positions)
    loaded = checkpoints.load_attention_weights(sd, config=cfg, layer=layer)
    got = np.asarray(loaded.module()(jnp.asarray(x), **(
        {} if positions is None else {"positions": jnp.asarray(positions)})))
    scale = np.abs(want).max()
    self.assertLess(np.abs(got - want).max(), REL_TOL * scale)
    # The formula is transformers' too (its recorded output, float32).
    self.assertLess(np.abs(z[f"out/{layer}"] - want).max(), REL_TOL * scale)

  def test_gemma3n_shared_layers_equal_the_formula(self):
    z, sd, cfg = _golden("gemma3n")
    for layer, source in ((2, 0), (3, 1)):
      with self.subTest(layer=layer):
        x, x_source = z[f"in_shared/{layer}"], z[f"in/{source}"]
        f = dataclasses.replace(FORMULAS["gemma3n"],
                                windows=(4, None, 4, None),
                                rotates=(True,) * 4)
        want = formula_attention(f, sd, cfg, layer, x,
                                 shared=(source, x_source))
        owner = checkpoints.load_attention_weights(sd, config=cfg,
                                                   layer=source).module()
        got = checkpoints.load_attention_weights(
            sd, config=cfg, layer=layer).module()(
                jnp.asarray(x), shared_kv=owner.shared_kv(
                    jnp.asarray(x_source)))
        scale = np.abs(want).max()
        self.assertLess(np.abs(np.asarray(got) - want).max(),
                        REL_TOL * scale)

  def test_the_formulas_tell_the_options_apart(self):
    # The reference is not blind to what it checks: a changed row moves
    # its output far past REL_TOL.
    z, sd, cfg = _golden("glm4")
    x = z["in/0"]
    want = formula_attention(FORMULAS["glm4"], sd, cfg, 0, x)
    for change in (dict(pairs="half"), dict(fraction=1.0),
                   dict(biases="none"), dict(scale=0.1)):
      with self.subTest(**change):
        other = formula_attention(
            dataclasses.replace(FORMULAS["glm4"], **change), sd, cfg, 0, x)
        self.assertGreater(np.abs(other - want).max(),
                           100 * REL_TOL * np.abs(want).max())


if __name__ == "__main__":
  absltest.main()
