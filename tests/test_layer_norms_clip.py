"""The multi-head layer's clip_qkv, biased qk-norm, value norm and output
sub-norm, against a float64 NumPy formula (function and module), through
params_dict/load_params, every decoding cache and a projected memory."""

import dataclasses

from absl.testing import absltest
from absl.testing import parameterized
import chex
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.layers import multi_head_params
from tests import _data

D, N, K, H, B, T = 16, 4, 2, 8, 2, 6
BASE = 100.0  # a small rotary base: positions 0..5 turn the pairs far
CLIP = 1.0  # inputs * 1.5 give projections of std ~1.5: about half clipped
# float32 against float64 through projections, norms and attention: errors
# ~1e-6 (as test_qk_norm); 3e-5 leaves headroom, and test_each_feature_moves
# shows that dropping any one feature moves the output past 10x this.
TOL = dict(atol=3e-5, rtol=3e-5)

PHI = aj.QKNorm(kind="layer", epsilon=1e-5, bias=True)  # Phi-2, Persimmon
GEMMA3N_V = aj.QKNorm(weight=None, epsilon=1e-6)  # Gemma 3n's v_norm
BITNET_O = aj.QKNorm(over="all", weight="per_head", epsilon=1e-5)
ALL = dict(clip_qkv=CLIP, qk_norm=PHI, value_norm=GEMMA3N_V,
           output_norm=BITNET_O)

# (name, options); "gate": an elementwise output gate in the params.
CASES = (
    ("clip", dict(clip_qkv=CLIP)),
    ("qk_layer_bias_shared", dict(qk_norm=PHI)),
    ("qk_layer_bias_per_head", dict(qk_norm=aj.QKNorm(
        kind="layer", weight="per_head", epsilon=1e-5, bias=True))),
    ("value_norm_weightless", dict(value_norm=GEMMA3N_V)),
    ("value_norm_per_head_bias", dict(value_norm=aj.QKNorm(
        kind="layer", weight="per_head", bias=True))),
    ("output_norm_bitnet_gated", dict(output_norm=BITNET_O, gate=True)),
    ("all_gated", dict(ALL, gate=True)),
)


# ---- the float64 formula ----

def _norm(x, entry, norm):
  """``norm(x) * (offset + w) + b`` of ``x [B, heads, T, H]``, the statistics
  over each head's H features or a token's heads * H."""
  b, heads, t, h = x.shape
  flat = x.transpose(0, 2, 1, 3).reshape(b, t, heads, h)  # [B, T, heads, H]
  if norm.over == "all":
    flat = flat.reshape(b, t, 1, heads * h)
  if norm.kind == "layer":
    flat = flat - flat.mean(-1, keepdims=True)
  y = flat / np.sqrt((flat ** 2).mean(-1, keepdims=True) + norm.epsilon)
  y = y.reshape(b, t, heads, h)
  if norm.weight is not None:  # [H] or [heads, H] against [B, T, heads, H]
    y = y * (norm.weight_offset + entry["scale"])
  if norm.bias:
    y = y + entry["bias"]
  return y.transpose(0, 2, 1, 3)


def _rope(x, base):
  """Half-split rotary at positions 0..T-1 (rotate-half form)."""
  half = x.shape[-1] // 2
  angle = np.arange(x.shape[2])[:, None] * base ** (
      -np.arange(half) / half)  # [T, H/2]
  cos = np.concatenate([np.cos(angle)] * 2, -1)
  sin = np.concatenate([np.sin(angle)] * 2, -1)
  rotated_half = np.concatenate([-x[..., half:], x[..., :half]], -1)
  return x * cos + rotated_half * sin


def reference(params, x, memory=None, *, clip_qkv=None, qk_norm=None,
              value_norm=None, output_norm=None, gate=False, rope=True,
              causal=True, swap_gate=False, clipped="qkv"):
  """The layer from the formula, float64 (``x [B, T, D]``; keys from
  ``memory`` when given). ``gate`` only says the params hold ``W_g``;
  ``swap_gate`` gates before the sub-norm (the wrong order); ``clipped``:
  which projections ``clip_qkv`` clips (all three in the layer)."""
  del gate
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  x = np.asarray(x, np.float64)
  kv = x if memory is None else np.asarray(memory, np.float64)

  def project(name, inputs):  # [B, L, D] -> [B, heads, L, H]
    y = np.einsum("bld,dnh->bnlh", inputs, p[name]["kernel"])
    return y + p[name]["bias"][None, :, None, :] if "bias" in p[name] else y

  q, k, v = project("W_q", x), project("W_k", kv), project("W_v", kv)
  if clip_qkv is not None:
    q, k, v = (np.clip(a, -clip_qkv, clip_qkv) if name in clipped else a
               for name, a in zip("qkv", (q, k, v)))
  if qk_norm is not None:
    q = _norm(q, p.get("q_norm"), qk_norm)
    k = _norm(k, p.get("k_norm"), qk_norm)
  if rope:
    q, k = _rope(q, BASE), _rope(k, BASE)
  if value_norm is not None:
    v = _norm(v, p.get("v_norm"), value_norm)
  k, v = np.repeat(k, N // K, 1), np.repeat(v, N // K, 1)
  logits = q @ k.transpose(0, 1, 3, 2) / np.sqrt(H)  # [B, N, T, S]
  if causal:
    logits = np.where(np.tril(np.ones(logits.shape[-2:], bool)), logits,
                      -np.inf)
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  out = weights / weights.sum(-1, keepdims=True) @ v  # [B, N, T, H]
  gates = (1 / (1 + np.exp(-project("W_g", x))) if "W_g" in p else 1.0)
  if swap_gate:
    out = out * gates
  if output_norm is not None:
    out = _norm(out, p.get("o_norm"), output_norm)
  if not swap_gate:
    out = out * gates
  return (np.einsum("bnth,nhd->btd", out, p["W_o"]["kernel"])
          + p["W_o"]["bias"])


# ---- the layer ----

def _params(options, seed=0):
  """Params of the options' norms, drawn away from the identity (biases
  non-zero: _data draws them with std 0.5)."""
  return _data.params(
      aj.init_multi_head_params, seed, D, N, num_kv_heads=K, head_dim=H,
      normalize_qk=options.get("qk_norm") or False,
      value_norm=options.get("value_norm"),
      output_norm=options.get("output_norm"),
      output_gate="elementwise" if options.get("gate") else None)


def _layer_options(options):
  return {k: v for k, v in options.items() if k != "gate"}


def _module(options, *, rope=True, seed=0, **kwargs):
  opts = _layer_options(options)
  mha = aj.MultiHeadAttention(
      D, N, num_kv_heads=K, head_dim=H, rngs=nnx.Rngs(0),
      rope=aj.Rope(base=BASE) if rope else None,
      normalize_qk=opts.pop("qk_norm", None) or False,
      output_gate="elementwise" if options.get("gate") else None,
      **opts, **kwargs)
  mha.load_params(_params(options, seed))
  return mha


def _x(seed=3, t=T):
  return _data.normal(seed, (B, t, D)) * 1.5



def is_exhaustive(test_name: str) -> bool:
  """conftest's hook: the ring buffer's decode (the linear and paged ones
  run by default) is left to the exhaustive run."""
  return test_name == "test_decode_equals_forward_ring"

class FormulaTest(chex.TestCase):

  @parameterized.named_parameters(*CASES)
  def test_function_and_module_match_float64(self, options):
    params, x = _params(options), _x()
    want = reference(params, x, **options)
    got = aj.multi_head_attention(params, x, x, x, is_causal=True,
                                  rope=aj.Rope(base=BASE),
                                  **_layer_options(options))
    chex.assert_trees_all_close(got, want.astype(np.float32), **TOL)
    mha = _module(options)
    chex.assert_trees_all_close(mha(x, is_causal=True),
                                want.astype(np.float32), **TOL)

  def test_each_feature_moves_the_output(self):
    """The formula test would catch a feature dropped (or applied in the
    wrong order): each change moves the reference past 10 x TOL."""
    options = dict(ALL, gate=True)
    params, x = _params(options), _x()
    got = np.asarray(aj.multi_head_attention(
        params, x, x, x, is_causal=True, rope=aj.Rope(base=BASE),
        **_layer_options(options)))
    unbiased = jax.tree.map(lambda a: a, params)
    for name in ("q_norm", "k_norm"):
      unbiased[name] = dict(unbiased[name], bias=0.0 * params[name]["bias"])
    changed = {
        "no clip": reference(params, x, **dict(options, clip_qkv=None)),
        "no qk bias": reference(unbiased, x, **options),
        "no value norm": reference(params, x,
                                   **dict(options, value_norm=None)),
        "no output norm": reference(params, x,
                                    **dict(options, output_norm=None)),
        "gate before the sub-norm": reference(params, x, **options,
                                              swap_gate=True),
        **{f"{name} unclipped": reference(params, x, **options,
                                          clipped="qkv".replace(name, ""))
           for name in "qkv"},
    }
    for what, other in changed.items():
      self.assertGreater(np.max(np.abs(got - other)), 10 * TOL["atol"],
                         what)


class ParamsTest(absltest.TestCase):

  def test_init_shapes_and_identity(self):
    norm_v = aj.QKNorm(weight="per_head", bias=True)
    params = aj.init_multi_head_params(
        jax.random.key(0), D, N, num_kv_heads=K, head_dim=H,
        normalize_qk=PHI, value_norm=norm_v, output_norm=BITNET_O)
    shapes = {name: {e: a.shape for e, a in params[name].items()}
              for name in ("q_norm", "k_norm", "v_norm", "o_norm")}
    self.assertEqual(shapes, {
        "q_norm": {"scale": (H,), "bias": (H,)},
        "k_norm": {"scale": (H,), "bias": (H,)},
        "v_norm": {"scale": (K, H), "bias": (K, H)},
        "o_norm": {"scale": (N, H)}})
    for name in ("q_norm", "k_norm", "v_norm"):
      np.testing.assert_array_equal(params[name]["bias"], 0.0)
      np.testing.assert_array_equal(params[name]["scale"], 1.0)
    self.assertEqual(multi_head_params.param_dims(params)[:3], (N, K, H))
    mha = aj.MultiHeadAttention(D, N, num_kv_heads=K, head_dim=H,
                                normalize_qk=PHI, value_norm=norm_v,
                                output_norm=BITNET_O, rngs=nnx.Rngs(0))
    module = mha.params_dict()
    for name, entries in shapes.items():
      for entry, shape in entries.items():
        self.assertEqual(module[name][entry].shape, shape, (name, entry))
        np.testing.assert_array_equal(module[name][entry],
                                      params[name][entry])

  def test_round_trip(self):
    options = dict(ALL, gate=True, value_norm=aj.QKNorm(
        kind="layer", weight="per_head", bias=True))
    a = _module(options, seed=1)
    b = _module(options, seed=2)
    b.load_params(a.params_dict())
    chex.assert_trees_all_equal(a.params_dict(), b.params_dict())
    self.assertEqual(set(a.params_dict()["v_norm"]), {"scale", "bias"})
    x = _x()
    chex.assert_trees_all_equal(a(x, is_causal=True), b(x, is_causal=True))
    # The function runs the module's params_dict as the module does.
    chex.assert_trees_all_close(
        aj.multi_head_attention(a.params_dict(), x, x, x, is_causal=True,
                                rope=a.rope, qk_norm=a.qk_norm,
                                clip_qkv=a.clip_qkv,
                                value_norm=a.value_norm,
                                output_norm=a.output_norm),
        a(x, is_causal=True), atol=1e-6, rtol=1e-6)  # one float32 path

  def test_load_params_names_the_norms(self):
    mha = _module(dict(ALL, value_norm=aj.QKNorm(weight="per_head")))
    params = mha.params_dict()
    without_v = {k: v for k, v in params.items() if k != "v_norm"}
    with self.assertRaisesRegex(ValueError, r"value_norm=QKNorm\("):
      mha.load_params(without_v)
    unbiased = dict(params, q_norm={"scale": params["q_norm"]["scale"]})
    with self.assertRaisesRegex(
        ValueError, r"params\['q_norm'\] has no 'bias', but this module's "
        r"q_norm has one \(its aj.QKNorm has bias=True\)"):
      mha.load_params(unbiased)
    wrong = dict(params, o_norm={"scale": jnp.ones((H,))})
    with self.assertRaisesRegex(ValueError, r"params\['o_norm'\]\['scale'\] "
                                r"has shape \(8,\), but this module's is "
                                r"\(4, 8\)"):
      mha.load_params(wrong)


class DecodeTest(chex.TestCase):

  @parameterized.named_parameters(
      ("linear", None, dict(max_length=8)),
      ("ring", (2, 0), dict(window=4)),
  )
  def test_decode_equals_forward(self, window, cache):
    """Prefill 3 tokens, then 3 steps: each equals the full causal forward
    (keys and values were clipped and normalised before the cache write)."""
    mha = _module(dict(ALL, gate=True),
                  mask=aj.Mask(causal=True, window=window))
    x = _x(5)
    full = mha(x)
    mha.init_cache(B, **cache)
    step = nnx.jit(lambda m, x: m(x, decode=True))
    outs = [step(mha, x[:, :3])] + [step(mha, x[:, i:i + 1])
                                    for i in range(3, T)]
    # The same float32 numbers in another order (cache slots): ~1e-6.
    chex.assert_trees_all_close(jnp.concatenate(outs, 1), full, atol=2e-5,
                                rtol=2e-5)

  def test_paged_decode_with_clip_and_value_norm(self):
    options = dict(clip_qkv=CLIP, value_norm=GEMMA3N_V)
    mha = _module(options, mask=aj.Mask(causal=True))
    x = _x(6)
    want = reference(_params(options), x, **options)
    mha.init_paged_cache(B, num_pages=6, page_size=2, max_pages=3)
    step = nnx.jit(lambda m, x: m(x, decode=True))
    outs = [step(mha, x[:, i:i + 1]) for i in range(T)]  # one compile
    chex.assert_trees_all_close(jnp.concatenate(outs, 1),
                                want.astype(np.float32), **TOL)


class MemoryTest(chex.TestCase):

  def test_projected_memory_is_clipped_and_normalised(self):
    options = dict(clip_qkv=CLIP, qk_norm=PHI, value_norm=aj.QKNorm(
        weight="per_head", bias=True), output_norm=BITNET_O)
    params, x, mem = _params(options), _x(t=3), _x(seed=8, t=7)
    want = reference(params, x, mem, rope=False, causal=False, **options)
    memory = aj.project_memory(
        params, mem, qk_norm=PHI, clip_qkv=CLIP,
        value_norm=options["value_norm"])
    got = aj.multi_head_attention(params, x, None, None, memory=memory,
                                  **options)
    chex.assert_trees_all_close(got, want.astype(np.float32), **TOL)
    cross = _module(options, rope=False)
    cross.init_cross_cache(mem)
    chex.assert_trees_all_close(cross(x, decode=True),
                                want.astype(np.float32), **TOL)
    bare = aj.project_memory(params, mem, qk_norm=PHI,
                             value_norm=options["value_norm"])
    with self.assertRaisesRegex(ValueError, r"memory's keys and values were "
                                r"clipped with clip_qkv=None, but this call "
                                r"has clip_qkv=1.0"):
      aj.multi_head_attention(params, x, None, None, memory=bare, **options)
    unnormed = aj.project_memory(params, mem, qk_norm=PHI, clip_qkv=CLIP,
                                 value_norm=aj.QKNorm(
                                     weight="per_head", bias=True,
                                     epsilon=1e-3))
    with self.assertRaisesRegex(ValueError, r"memory's values were "
                                r"normalised with value_norm=QKNorm"):
      aj.multi_head_attention(params, x, None, None, memory=unnormed,
                              **options)
    cross.value_norm = aj.QKNorm(weight="per_head", bias=True, epsilon=0.5)
    with self.assertRaisesRegex(ValueError, r"memory's values were "
                                r"normalised with value_norm="):
      cross(x, decode=True)  # reassigned after the memory was projected


class RefusalsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("negative", -1.0, ValueError, r"clip_qkv must be a positive finite "
       r"number .* got -1.0"),
      ("zero", 0, ValueError, r"clip_qkv must be a positive finite"),
      ("inf", float("inf"), ValueError, r"clip_qkv must be a positive"),
      ("nan", float("nan"), ValueError, r"clip_qkv must be a positive"),
      ("string", "8", TypeError, r"clip_qkv must be None or a positive "
       r"finite Python number .* got '8' \(str\)"),
      ("bool", True, TypeError, r"clip_qkv must be None or a positive"),
  )
  def test_bad_clip(self, value, error, message):
    params, x = _params({}), _x(t=2)
    with self.assertRaisesRegex(error, message):
      aj.multi_head_attention(params, x, x, x, clip_qkv=value)
    with self.assertRaisesRegex(error, message):
      aj.MultiHeadAttention(D, N, rngs=nnx.Rngs(0), clip_qkv=value)
    with self.assertRaisesRegex(error, message):
      aj.project_memory(params, x, clip_qkv=value)

  @parameterized.named_parameters(("value_norm", "value_norm"),
                                  ("output_norm", "output_norm"))
  def test_norm_after_rope_or_not_a_qk_norm(self, option):
    rotated = aj.QKNorm(weight=None, after_rope=True)
    params, x = _params({}), _x(t=2)
    message = rf"{option}=QKNorm\(.*after_rope=True.* never rotated"
    with self.assertRaisesRegex(ValueError, message):
      aj.multi_head_attention(params, x, x, x, **{option: rotated})
    with self.assertRaisesRegex(ValueError, message):
      aj.MultiHeadAttention(D, N, rngs=nnx.Rngs(0), **{option: rotated})
    with self.assertRaisesRegex(ValueError, message):
      aj.init_multi_head_params(jax.random.key(0), D, N, **{option: rotated})
    with self.assertRaisesRegex(TypeError, rf"{option} must be None or an "
                                r"aj.QKNorm"):
      aj.multi_head_attention(params, x, x, x, **{option: True})

  def test_bias_needs_a_weight(self):
    with self.assertRaisesRegex(ValueError, r"bias=True adds a bias of the "
                                r"weight's shape, and weight=None has none"):
      aj.QKNorm(weight=None, bias=True)
    with self.assertRaisesRegex(TypeError, r"QKNorm bias must be a bool"):
      aj.QKNorm(bias=1)

  def test_params_and_norms_must_agree(self):
    x = _x(t=2)
    shared_v = aj.QKNorm()
    with_v = _params(dict(value_norm=shared_v, output_norm=BITNET_O))
    biased = _params(dict(qk_norm=PHI))
    cases = (
        (with_v, dict(output_norm=BITNET_O), r"params has v_norm \(scale "
         r"\(8,\)\), which value_norm=None would ignore: pass value_norm="),
        (with_v, dict(value_norm=shared_v), r"params has o_norm \(scale "
         r"\(4, 8\)\), which output_norm=None would ignore"),
        (with_v, dict(value_norm=GEMMA3N_V, output_norm=BITNET_O),
         r"value_norm=QKNorm\(.*has no weight, but params has v_norm"),
        (with_v, dict(value_norm=aj.QKNorm(weight="per_head"),
                      output_norm=BITNET_O),
         r"reads weights v_norm \[K, H\], but params has v_norm scale"),
        (_params({}), dict(value_norm=shared_v),
         r"reads weights v_norm \[H\], but params has no v_norm"),
        (with_v, dict(value_norm=aj.QKNorm(bias=True), output_norm=BITNET_O),
         r"has bias=True, but params\['v_norm'\] has no 'bias' entry"),
        (biased, dict(qk_norm=dataclasses.replace(PHI, bias=False)),
         r"has bias=False, but params\['q_norm'\] has a 'bias' entry"),
        (biased, dict(), r"with a bias \(params\['q_norm'\]\['bias'\]\): "
         r"pass qk_norm=aj.QKNorm\(weight='shared', bias=True"),
    )
    for params, options, message in cases:
      with self.assertRaisesRegex(ValueError, message):
        aj.multi_head_attention(params, x, x, x, **options)
    with self.assertRaisesRegex(ValueError, r"params has v_norm .* "
                                r"value_norm=None would ignore"):
      aj.project_memory(with_v, x)

  def test_malformed_norm_params(self):
    x = _x(t=2)
    params = _params(dict(qk_norm=PHI, value_norm=aj.QKNorm(bias=True)))
    cases = (
        (dict(params, v_norm=dict(params["v_norm"], bias=jnp.ones((K, H)))),
         r"params\['v_norm'\]\['bias'\] has shape \(2, 8\), expected \(8,\), "
         r"the shape of its scale"),
        (dict(params, k_norm={"scale": params["k_norm"]["scale"]}),
         r"params\['q_norm'\] has a 'bias' and the other of q_norm/k_norm "
         r"none"),
        (dict(params, v_norm=dict(params["v_norm"], shift=jnp.ones(H))),
         r"params\['v_norm'\] has unexpected entries \['shift'\]"),
    )
    for bad, message in cases:
      with self.assertRaisesRegex(ValueError, message):
        aj.multi_head_attention(bad, x, x, x, qk_norm=PHI,
                                value_norm=aj.QKNorm(bias=True))

  def test_reassigned_norm_must_find_its_weights(self):
    mha = aj.MultiHeadAttention(D, N, rngs=nnx.Rngs(0))
    mha.value_norm = aj.QKNorm()
    with self.assertRaisesRegex(ValueError, r"reads weights v_norm \[H\], "
                                r"but params has no v_norm"):
      mha(_x(t=2))


if __name__ == "__main__":
  jax.config.parse_flags_with_absl()
  absltest.main()
