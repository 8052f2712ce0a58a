"""qk-norm variants (aj.QKNorm) against float64 formulas, and decoding."""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from tests import _data
from tests import reference

# float32 against float64 through four projections, a norm and attention:
# errors ~1e-6 (as test_multi_head); 3e-5 leaves headroom without hiding a
# wrong epsilon (1e-5 vs 1e-6 moves these outputs by ~1e-4, checked below).
TOL = dict(atol=3e-5, rtol=3e-5)
D, N, K, H = 16, 4, 2, 8
BASE = 100.0  # a small rotary base: positions 0..5 turn the pairs far

# One case per value of each field; (name, QKNorm keywords).
VARIANTS = (
    ("rms_head_shared", dict()),  # Qwen3
    ("rms_head_shared_eps", dict(epsilon=0.5)),  # large: visible
    ("rms_head_shared_one_plus", dict(weight_offset=1.0)),  # Gemma 3
    ("rms_all_per_head", dict(over="all", weight="per_head")),  # OLMo 2
    ("layer_head_per_head", dict(kind="layer", weight="per_head")),  # Cohere
    ("layer_all_none", dict(kind="layer", over="all", weight=None)),
    ("rms_head_none_after_rope", dict(weight=None, after_rope=True)),  # L4
    ("rms_head_per_head_after_rope", dict(weight="per_head",
                                          after_rope=True)),
)


def _params(norm: aj.QKNorm, seed=0):
  """Params with the norm's weights drawn away from the identity."""
  params = _data.params(aj.init_multi_head_params, seed, D, N,
                        num_kv_heads=K, head_dim=H, normalize_qk=norm)
  for name in ("q_norm", "k_norm"):
    if name in params:
      scale = params[name]["scale"]
      params[name]["scale"] = scale + 0.5 * _data.normal(
          seed + len(name), scale.shape)
  return params


def _ref_args(norm: aj.QKNorm) -> dict:
  return dict(kind=norm.kind, over=norm.over, eps=norm.epsilon,
              offset=norm.weight_offset, after_rope=norm.after_rope)


class QKNormFormulaTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(*VARIANTS)
  def test_matches_float64_formula(self, fields):
    norm = aj.QKNorm(**fields)
    params = _params(norm)
    x = _data.normal(3, (2, 6, D)) * 3.0  # not unit scale: the norm shows
    fn = self.variant(functools.partial(
        aj.multi_head_attention, rope=aj.Rope(base=BASE), is_causal=True,
        qk_norm=norm))
    out = fn(params, x, x, x)
    pos = np.arange(6)
    want, _ = reference.multi_head_attention(
        params, x, x, x, is_causal=True, rope_base=BASE,
        query_positions=pos, key_positions=pos, qk_norm_args=_ref_args(norm))
    chex.assert_trees_all_close(out, want.astype(np.float32), **TOL)

  @parameterized.named_parameters(
      ("epsilon", dict(epsilon=1e-5)),
      ("over", dict(over="all")),
      ("kind", dict(kind="layer")),
      ("order", dict(after_rope=True)),
      ("offset", dict(weight_offset=1.0)),
  )
  def test_each_field_changes_the_output(self, change):
    """The formula test above would pass a field that is ignored only if the
    field made no difference here: each one moves the output past TOL."""
    params = _params(aj.QKNorm(epsilon=1e-6))
    for name in ("W_q", "W_k"):  # without biases q, k stay ~0.01 ...
      params[name].pop("bias")
      params[name]["kernel"] = params[name]["kernel"] * 0.01
    params["W_v"].pop("bias")
    params["W_o"].pop("bias")
    x = _data.normal(3, (2, 6, D))  # ... so epsilon 1e-5 is 10% of q**2
    run = functools.partial(aj.multi_head_attention, params, x, x, x,
                            rope=aj.Rope(base=BASE), is_causal=True)
    base = run(qk_norm=aj.QKNorm(epsilon=1e-6))
    moved = run(qk_norm=aj.QKNorm(**{"epsilon": 1e-6, **change}))
    self.assertGreater(float(jnp.max(jnp.abs(base - moved))),
                       10 * TOL["atol"])

  def test_default_is_rms_per_head_with_epsilon_1e6(self):
    params = _params(aj.QKNorm())
    x = _data.normal(3, (1, 5, D))
    chex.assert_trees_all_close(
        aj.multi_head_attention(params, x, x, x),
        aj.multi_head_attention(params, x, x, x, qk_norm=aj.QKNorm()),
        atol=0, rtol=0)

  def test_cross_attention_memory_is_normalised_once(self):
    norm = aj.QKNorm(kind="layer", weight="per_head", epsilon=1e-5)
    params = _params(norm)
    x, mem = _data.normal(3, (2, 3, D)), _data.normal(4, (2, 7, D))
    memory = aj.project_memory(params, mem, qk_norm=norm)
    chex.assert_trees_all_close(
        aj.multi_head_attention(params, x, None, None, memory=memory,
                                qk_norm=norm),
        aj.multi_head_attention(params, x, mem, mem, qk_norm=norm), **TOL)
    with self.assertRaisesRegex(ValueError, r"memory's keys were normalised "
                                r"with qk_norm=.*pass project_memory the same"):
      aj.multi_head_attention(params, x, None, None, memory=memory,
                              qk_norm=aj.QKNorm(kind="layer",
                                                weight="per_head"))


class QKNormDecodeTest(chex.TestCase):

  @parameterized.named_parameters(*VARIANTS)
  def test_decode_equals_forward(self, fields):
    """Prefill 3 tokens, then 3 steps: each step equals the full causal
    forward's row (cached keys were normalised once, as written)."""
    norm = aj.QKNorm(**fields)
    mha = aj.MultiHeadAttention(D, N, num_kv_heads=K, head_dim=H,
                                normalize_qk=norm, rope=aj.Rope(base=BASE),
                                rngs=nnx.Rngs(0))
    mha.load_params(_params(norm, seed=1))
    x = _data.normal(5, (2, 6, D)) * 2.0
    full = mha(x, mask=aj.Mask(causal=True))
    mha.init_cache(batch_size=2, max_length=8)
    outs = [mha(x[:, :3], decode=True)]
    step = nnx.jit(lambda m, x: m(x, decode=True))
    for i in range(3, 6):
      outs.append(step(mha, x[:, i:i + 1]))
    # Same float32 computation in another order (cache slots vs a full
    # matrix): ~1e-6.
    chex.assert_trees_all_close(jnp.concatenate(outs, 1), full, atol=2e-5,
                                rtol=2e-5)


class QKNormModuleTest(chex.TestCase):

  def test_module_weights_follow_the_norm(self):
    def shapes(norm):
      mha = aj.MultiHeadAttention(D, N, num_kv_heads=K, head_dim=H,
                                  normalize_qk=norm, rngs=nnx.Rngs(0))
      p = mha.params_dict()
      return {n: p[n]["scale"].shape for n in ("q_norm", "k_norm") if n in p}
    self.assertEqual(shapes(True), {"q_norm": (H,), "k_norm": (H,)})
    self.assertEqual(shapes(aj.QKNorm(weight="per_head")),
                     {"q_norm": (N, H), "k_norm": (K, H)})
    self.assertEqual(shapes(aj.QKNorm(weight=None)), {})

  def test_one_plus_weight_starts_at_the_identity(self):
    """weight_offset=1 starts at zeros: 1 + 0, the same layer as ones."""
    norm = aj.QKNorm(weight_offset=1.0)
    a = aj.MultiHeadAttention(D, N, normalize_qk=norm, rngs=nnx.Rngs(0))
    b = aj.MultiHeadAttention(D, N, normalize_qk=True, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(a.params_dict()["q_norm"]["scale"], 0.0)
    x = _data.normal(1, (1, 4, D))
    chex.assert_trees_all_close(a(x), b(x), atol=1e-6, rtol=1e-6)

  def test_flax_layer_norm_per_head(self):
    """flax's normalize_qk: a bias-free LayerNorm per head, epsilon 1e-6,
    one [H] scale: aj.QKNorm(kind="layer") gives its numbers."""
    fx = nnx.MultiHeadAttention(num_heads=N, in_features=D, qkv_features=D,
                                normalize_qk=True, decode=False,
                                rngs=nnx.Rngs(0))
    x = _data.normal(2, (2, 5, D))
    h = D // N
    params = {
        "W_q": {"kernel": fx.query.kernel[...], "bias": fx.query.bias[...]},
        "W_k": {"kernel": fx.key.kernel[...], "bias": fx.key.bias[...]},
        "W_v": {"kernel": fx.value.kernel[...], "bias": fx.value.bias[...]},
        "W_o": {"kernel": fx.out.kernel[...], "bias": fx.out.bias[...]},
        "q_norm": {"scale": fx.query_ln.scale[...] + 0.0 * jnp.ones(h)},
        "k_norm": {"scale": fx.key_ln.scale[...] + 0.0 * jnp.ones(h)},
    }
    got = aj.multi_head_attention(params, x, x, x,
                                  qk_norm=aj.QKNorm(kind="layer"))
    chex.assert_trees_all_close(got, fx(x), atol=1e-5, rtol=1e-5)


class QKNormErrorsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("kind", dict(kind="l2"), ValueError, "kind must be one of"),
      ("over", dict(over="token"), ValueError, "over must be one of"),
      ("weight", dict(weight="full"), ValueError, "weight must be one of"),
      ("epsilon", dict(epsilon=0.0), ValueError, "epsilon must be positive"),
      ("epsilon_type", dict(epsilon="1e-6"), TypeError, "finite Python"),
      ("offset", dict(weight_offset=2.0), ValueError, "0 .* or 1"),
      ("offset_no_weight", dict(weight=None, weight_offset=1.0), ValueError,
       "no weight to offset"),
      ("order", dict(after_rope=1), TypeError, "after_rope must be a bool"),
  )
  def test_bad_fields(self, fields, error, message):
    with self.assertRaisesRegex(error, message):
      aj.QKNorm(**fields)

  def test_weights_and_norm_must_agree(self):
    x = _data.normal(0, (1, 3, D))
    shared = _params(aj.QKNorm())
    per_head = _params(aj.QKNorm(weight="per_head"))
    bare = _params(aj.QKNorm(weight=None))
    cases = (
        (shared, aj.QKNorm(weight=None), "would ignore"),
        (shared, aj.QKNorm(weight="per_head"), r"reads weights q_norm \[N, H\]"),
        (per_head, None, r"one weight per head: pass qk_norm="),
        (bare, aj.QKNorm(), r"params has no q_norm/k_norm"),
    )
    for params, norm, message in cases:
      with self.assertRaisesRegex(ValueError, message):
        aj.multi_head_attention(params, x, x, x, qk_norm=norm)
    with self.assertRaisesRegex(TypeError, "normalize_qk must be a bool or"):
      aj.multi_head_attention(shared, x, x, x, qk_norm="rms")

  def test_whole_width_weight_is_told_to_reshape(self):
    params = _params(aj.QKNorm(weight="per_head"))
    params["q_norm"]["scale"] = params["q_norm"]["scale"].reshape(-1)
    x = _data.normal(0, (1, 3, D))
    with self.assertRaisesRegex(ValueError, r"\[32\] reshapes to \(4, 8\)"):
      aj.multi_head_attention(params, x, x, x)

  def test_mixed_weight_shapes_are_refused(self):
    params = _params(aj.QKNorm(weight="per_head"))
    params["k_norm"]["scale"] = jnp.ones((H,))
    x = _data.normal(0, (1, 3, D))
    with self.assertRaisesRegex(ValueError, "both shared"):
      aj.multi_head_attention(params, x, x, x,
                              qk_norm=aj.QKNorm(weight="per_head"))


if __name__ == "__main__":
  jax.config.parse_flags_with_absl()
  absltest.main()
