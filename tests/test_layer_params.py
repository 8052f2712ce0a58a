"""Everything a MultiHeadAttention layer learns is in its params dict.

Learned sinks (``sinks``: ``{"logits": [N]}``) and T5's relative position
table (``t5_bias``: ``{"table": [R, N]}``) travel in ``params_dict()`` beside
``W_q``...``W_o``: ``aj.multi_head_attention(mha.params_dict(), ...)`` is
``mha(...)``, ``load_params`` round-trips them into a fresh layer, both
paths equal a float64 NumPy layer written from the formulas, and a value
given twice (in the params and as an argument) is refused. A checkpoint's
sinks come in its params.
"""

import json
import pathlib

from absl.testing import absltest
from absl.testing import parameterized
import chex
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.interop import checkpoints
from tests import _data
from tests import reference

D, N = 16, 4
# float32 projections of 16 terms and a softmax over <= 6 keys against
# float64: errors ~1e-6 (as tests/test_modules_multi_head.py).
TOL = dict(atol=2e-5, rtol=2e-5)
# The function and the module run the same float32 program: at most
# rounding apart (observed: equal).
SAME = dict(atol=1e-6, rtol=1e-6)
# T5Bias with bidirectional buckets: reference.t5_bucket's (mesh-tensorflow).
T5 = aj.T5Bias(num_buckets=8, max_distance=16, bidirectional=True)
# The layers: options, whether the call is causal.
LAYERS = (
    ("sinks", dict(attention_sinks=True), True),
    ("t5", dict(t5_bias=T5), False),
    ("both_gqa_soft_cap", dict(attention_sinks=True, t5_bias=T5,
                               num_kv_heads=2, logits_soft_cap=3.0), True),
)


def _module(seed=0, **options):
  mha = aj.MultiHeadAttention(D, N, rngs=nnx.Rngs(seed), **options)
  if mha.sinks is not None:  # distinct, non-zero sinks, so each one matters
    mha.sinks[...] = _data.normal(seed + 40, (N,)) * 2.0
  if mha.t5_table is not None:  # a table of O(1): the bias moves the output
    mha.t5_table[...] = _data.normal(seed + 50, mha.t5_table.shape)
  return mha


def _function_options(mha):
  """The module's settings as multi_head_attention's arguments."""
  options = dict(t5_bias=mha.t5_bias)
  if mha.logits_soft_cap is not None:
    options["score_mod"] = aj.soft_cap(mha.logits_soft_cap)
  return options


def _layer64(params, x, causal, soft_cap=None, t5=None):
  """The layer in float64: per-head projections, masked attention with
  sinks and the T5 table, W_o; written from the formulas."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  x = np.asarray(x, np.float64)

  def heads(name):  # [B, T, D] x [D, n, H] + [n, H] -> [B, n, T, H]
    return (np.einsum("btd,dnh->bnth", x, p[name]["kernel"])
            + p[name]["bias"][None, :, None, :])

  t = x.shape[1]
  allowed = np.broadcast_to(
      reference.causal(t, t) if causal else np.ones((t, t), bool),
      (x.shape[0], N, t, t))
  sinks = p["sinks"]["logits"] if "sinks" in p else None
  table = p["t5_bias"]["table"] if "t5_bias" in p else None
  with jax.enable_x64(True):
    out, _ = reference.masked_attention(
        heads("W_q"), heads("W_k"), heads("W_v"), None, allowed,
        softcap=soft_cap, sinks=None if sinks is None else jnp.asarray(sinks),
        t5_table=None if table is None else jnp.asarray(table),
        t5_max_distance=None if t5 is None else t5.max_distance)
    out = np.asarray(out)
  return (np.einsum("bnth,nho->bto", out, p["W_o"]["kernel"])
          + p["W_o"]["bias"])


class FunctionEqualsModuleTest(parameterized.TestCase):

  @parameterized.named_parameters(*LAYERS)
  def test_function_of_params_dict_is_the_module(self, options, causal):
    mha = _module(**options)
    x = _data.normal(1, (2, 6, D))
    params = mha.params_dict()
    self.assertEqual("sinks" in params, mha.sinks is not None)
    self.assertEqual("t5_bias" in params, mha.t5_table is not None)
    got = mha(x, is_causal=causal)
    fn = aj.multi_head_attention(params, x, x, x, is_causal=causal,
                                 **_function_options(mha))
    chex.assert_trees_all_close(fn, got, **SAME)
    want = _layer64(params, x, causal, mha.logits_soft_cap, mha.t5_bias)
    chex.assert_trees_all_close(got, want.astype(np.float32), **TOL)
    # Decoding reads the same params: it equals the full causal forward.
    # (Two equal chunks: the second reuses the first's eager op programs;
    # which params are read does not depend on where the split falls.)
    if causal:
      mha.init_cache(batch_size=2, max_length=6)
      pieces = [mha(x[:, :3], decode=True), mha(x[:, 3:], decode=True)]
      chex.assert_trees_all_close(jnp.concatenate(pieces, 1), got, **TOL)

  @parameterized.named_parameters(*LAYERS)
  def test_load_params_round_trips_into_a_fresh_layer(self, options, causal):
    source = _module(seed=0, **options)
    fresh = _module(seed=7, **options)  # other projections, sinks, table
    x = _data.normal(2, (2, 5, D))
    self.assertFalse(np.allclose(fresh(x, is_causal=causal),
                                 source(x, is_causal=causal), atol=1e-3))
    fresh.load_params(source.params_dict())
    chex.assert_trees_all_equal(fresh.params_dict(), source.params_dict())
    chex.assert_trees_all_close(fresh(x, is_causal=causal),
                                source(x, is_causal=causal), atol=0, rtol=0)

  def test_sinks_and_table_keep_param_dtype(self):
    # The projections are cast to dtype; the sinks and the table join the
    # float32 logits as stored, as the layer uses them.
    mha = _module(attention_sinks=True, t5_bias=T5, dtype=jnp.bfloat16)
    params = mha.params_dict()
    self.assertEqual(params["W_q"]["kernel"].dtype, jnp.bfloat16)
    self.assertEqual(params["sinks"]["logits"].dtype, jnp.float32)
    self.assertEqual(params["t5_bias"]["table"].dtype, jnp.float32)
    x = _data.normal(3, (1, 4, D), jnp.bfloat16)
    chex.assert_trees_all_close(
        aj.multi_head_attention(params, x, x, x, t5_bias=T5), mha(x),
        atol=0, rtol=0)

  def test_init_params_makes_them(self):
    params = aj.init_multi_head_params(jax.random.key(0), D, N,
                                       attention_sinks=True, t5_bias=T5)
    self.assertEqual(params["sinks"]["logits"].shape, (N,))
    self.assertEqual(params["t5_bias"]["table"].shape, (8, N))
    plain = aj.init_multi_head_params(jax.random.key(0), D, N)
    chex.assert_trees_all_equal(  # the projections' draws are unchanged
        {k: params[k] for k in plain}, plain)
    mha = aj.MultiHeadAttention(D, N, attention_sinks=True, t5_bias=T5,
                                rngs=nnx.Rngs(0))
    mha.load_params(params)
    x = _data.normal(4, (1, 3, D))
    chex.assert_trees_all_close(
        aj.multi_head_attention(params, x, x, x, t5_bias=T5), mha(x), **SAME)


class RefusalTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.params = _module(attention_sinks=True, t5_bias=T5).params_dict()
    self.x = _data.normal(5, (1, 3, D))

  def call(self, params, **kwargs):
    return aj.multi_head_attention(params, self.x, self.x, self.x, **kwargs)

  def test_t5_table_given_twice(self):
    with self.assertRaisesRegex(
        ValueError, r"score_mod holds a T5 relative bias, and "
        r"params\['t5_bias'\]\['table'\] \[8, 4\] is the layer's own"):
      self.call(self.params, t5_bias=T5, score_mod=aj.chain(
          aj.t5_relative_bias(self.params["t5_bias"]["table"],
                              max_distance=16), aj.soft_cap(3.0)))

  def test_t5_settings_and_table_go_together(self):
    with self.assertRaisesRegex(
        ValueError, r"params\['t5_bias'\]\['table'\] \[8, 4\] is a learned "
        r"T5 relative position bias: pass t5_bias=aj.T5Bias\(num_buckets=8"):
      self.call(self.params)
    no_table = {k: v for k, v in self.params.items() if k != "t5_bias"}
    with self.assertRaisesRegex(
        ValueError, r"describes a learned table that params does not hold: "
        r"add params\['t5_bias'\] = \{'table': \[8, N\]\}"):
      self.call(no_table, t5_bias=T5)
    with self.assertRaisesRegex(
        ValueError, r"has num_buckets=16, but params\['t5_bias'\]\['table'\] "
        r"has shape \(8, 4\)"):
      self.call(self.params, t5_bias=aj.T5Bias(16, 32))
    with self.assertRaisesRegex(TypeError, r"t5_bias must be an aj.T5Bias"):
      self.call(self.params, t5_bias=8)

  def test_shapes_are_checked(self):
    bad = {**self.params, "sinks": {"logits": jnp.zeros(N + 1)}}
    with self.assertRaisesRegex(
        ValueError, r"params\['sinks'\]\['logits'\] has shape \(5,\), "
        r"expected \(4,\) = \[N\]"):
      self.call(bad, t5_bias=T5)
    bad = {**self.params, "t5_bias": {"table": jnp.zeros((8, N - 1))}}
    with self.assertRaisesRegex(
        ValueError, r"params\['t5_bias'\]\['table'\] has shape \(8, 3\), "
        r"expected \[num_buckets, N\] with N=4"):
      self.call(bad, t5_bias=T5)
    bad = {**self.params, "sinks": {"scale": jnp.zeros(N)}}
    with self.assertRaisesRegex(
        ValueError, r"params\['sinks'\] must be a dict with logits \[N\]"):
      self.call(bad, t5_bias=T5)

  def test_load_params_needs_the_layer_to_match(self):
    with self.assertRaisesRegex(
        ValueError, r"params has entries \['W_k', 'W_o', 'W_q', 'W_v', "
        r"'sinks', 't5_bias'\], but this module has \['W_k', 'W_o', 'W_q', "
        r"'W_v', 't5_bias'\] \(.*attention_sinks=False"):
      _module(t5_bias=T5).load_params(self.params)
    with self.assertRaisesRegex(
        ValueError, r"params\['t5_bias'\]\['table'\] has shape \(8, 4\), but "
        r"this module's is \(16, 4\)"):
      _module(attention_sinks=True, t5_bias=aj.T5Bias(16, 32)).load_params(
          self.params)


class CheckpointSinksTest(absltest.TestCase):

  def test_gpt_oss_sinks_are_in_its_params(self):
    golden = pathlib.Path(__file__).parent / "golden" / "gpt_oss.npz"
    z = np.load(golden)
    sd = {k[len("sd/"):]: z[k] for k in z.files if k.startswith("sd/")}
    cfg = json.loads(str(z["config_json"]))
    loaded = checkpoints.load_attention_weights(sd, family="gpt_oss",
                                                config=cfg, layer=1)
    sinks = sd[loaded.prefix + "sinks"]
    np.testing.assert_array_equal(loaded.params["sinks"]["logits"], sinks)
    self.assertIs(loaded.sinks, loaded.params["sinks"]["logits"])
    layer = loaded.module()
    np.testing.assert_array_equal(layer.sinks[...], sinks)
    # The function on the loaded params alone gives transformers' output
    # (test_checkpoints' tolerance: 1e-5 of the output's scale).
    x = jnp.asarray(z["in/1"])
    options = loaded.options
    got = aj.multi_head_attention(
        loaded.params, x, x, x, options["mask"], scale=options.get("scale"),
        rope=options["rope"])
    want = z["out/1"]
    self.assertLess(np.abs(np.asarray(got) - want).max(),
                    1e-5 * np.abs(want).max())
    chex.assert_trees_all_close(got, layer(x), **SAME)


if __name__ == "__main__":
  absltest.main()
