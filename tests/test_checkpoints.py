"""aj.load_attention_weights against Hugging Face transformers' own outputs.

The goldens (``tests/golden/<family>.npz``, written by
``tests/golden/make_attention_goldens.py`` with transformers; torch and
transformers are not needed here) hold a tiny random model's attention
weights under their real HF names, its config, and each layer's attention
input and output as HF's eager attention computed them (its positions,
sliding masks, rotary tables, soft cap, sinks, qk-norm). Each case loads
one layer from the state dict and config alone, runs our module on the
recorded input and compares with the recorded output. Then: removing any
one mapped option moves the output far past the tolerance (so the
comparison sees each option), and the refusals.
"""

import json
import pathlib

from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax import checkpoints

GOLDEN = pathlib.Path(__file__).parent / "golden"
FAMILIES = checkpoints.FAMILIES
# float32 here against float32 torch: projections of 64 terms, a softmax
# over <= 10 keys, the output projection; rounding and the order of sums
# differ (observed <= 4e-7 of the output's scale, ~20). 1e-5 of the scale
# leaves headroom for other CPUs' exp/tanh, while any mis-mapped option
# moves the output by >= 5e-2 of it (test_each_option_is_seen).
REL_TOL = 1e-5


def _golden(family: str):
  z = np.load(GOLDEN / f"{family}.npz")
  sd = {k[len("sd/"):]: z[k] for k in z.files if k.startswith("sd/")}
  return z, sd, json.loads(str(z["config_json"]))


def _run(loaded: checkpoints.LoadedAttention, x, **change) -> np.ndarray:
  """``loaded``'s layer on ``x``, optionally with some options changed."""
  if not change:
    return np.asarray(loaded.module()(jnp.asarray(x)))
  mha = aj.MultiHeadAttention(**{**loaded.options, **change},
                              rngs=nnx.Rngs(0))
  mha.load_params(loaded.params)
  if loaded.sinks is not None and mha.sinks is not None:
    mha.sinks[...] = loaded.sinks
  return np.asarray(mha(jnp.asarray(x)))


def _error(family: str, layer: int, params=None, **change) -> tuple[float,
                                                                    float]:
  """(max |ours - HF|, max |HF|) for one golden layer."""
  z, sd, cfg = _golden(family)
  loaded = checkpoints.load_attention_weights(sd, family=family, config=cfg,
                                     layer=layer)
  if params is not None:
    loaded = checkpoints.LoadedAttention(
        family, layer, loaded.prefix, params(loaded.params), loaded.options,
        loaded.sinks)
  want = z[f"out/{layer}"]
  got = _run(loaded, z[f"in/{layer}"], **change)
  return float(np.abs(got - want).max()), float(np.abs(want).max())


class GoldenTest(parameterized.TestCase):
  """Each family's layers equal transformers' eager attention."""

  @parameterized.named_parameters(
      *((f"{family}_layer{layer}", family, layer)
        for family in FAMILIES for layer in (0, 1)))
  def test_matches_transformers(self, family, layer):
    error, scale = _error(family, layer)
    self.assertGreater(scale, 1.0)  # a golden of O(1..10) logits, not zeros
    self.assertLess(error, REL_TOL * scale)

  def test_goldens_record_their_provenance(self):
    for family in FAMILIES:
      z, _, cfg = _golden(family)
      self.assertEqual(str(z["family"]), family)
      self.assertTrue(str(z["transformers_version"]))
      self.assertEqual(cfg["num_hidden_layers" if family != "gpt2"
                           else "n_layer"], 2)

  def test_what_each_layer_is_given(self):
    """The options read from the golden configs, layer by layer."""
    def options(family, layer):
      _, sd, cfg = _golden(family)
      return checkpoints.load_attention_weights(sd, family=family, config=cfg,
                                       layer=layer).options
    window = lambda family, layer: options(family, layer)["mask"].window
    self.assertEqual([window("gemma2", 0), window("gemma2", 1)],
                     [(3, 0), None])  # sliding_window=4: q - k < 4
    self.assertEqual([window("qwen2", 0), window("qwen2", 1)],
                     [None, (3, 0)])  # max_window_layers=1
    self.assertEqual([window("mistral", 0), window("mistral", 1)],
                     [(3, 0), (3, 0)])
    self.assertEqual(options("gemma2", 0)["scale"], 24 ** -0.5)
    self.assertEqual(options("gemma2", 0)["logits_soft_cap"], 5.0)
    gemma3 = [options("gemma3", layer)["rope"] for layer in (0, 1)]
    self.assertEqual(gemma3, [aj.Rope(base=10000.0), aj.Rope(
        base=1e6, scaling="linear", factor=8.0)])
    self.assertEqual(options("gpt_oss", 0)["rope"], aj.Rope(
        base=150000.0, scaling="yarn", factor=32.0,
        original_max_positions=64, truncate=False))
    self.assertEqual(options("qwen2", 0)["use_bias"], True)
    self.assertEqual(options("gpt2", 1)["scale"], 16 ** -0.5 / 2)
    self.assertIsNone(options("gpt2", 0)["scale"])  # 1/sqrt(H), the default
    self.assertNotIn("rope", options("gpt2", 0))  # learned positions, outside

  def test_each_option_is_seen(self):
    """Dropping any one mapped option moves the output far past REL_TOL."""
    plus = lambda delta: lambda params: {
        **params, "q_norm": {"scale": params["q_norm"]["scale"] + delta},
        "k_norm": {"scale": params["k_norm"]["scale"] + delta}}
    cases = {
        "window": ("mistral", 0, None, dict(mask=aj.Mask(causal=True))),
        "window_size": ("mistral", 0, None, dict(mask=aj.Mask(
            causal=True, window=(4, 0)))),
        "soft_cap": ("gemma2", 0, None, dict(logits_soft_cap=None)),
        "query_pre_attn_scalar": ("gemma2", 1, None, dict(scale=None)),
        "gemma_one_plus_weight": ("gemma3", 0, plus(-1.0), {}),
        "global_rope": ("gemma3", 1, None, dict(rope=aj.Rope(base=1e6))),
        "llama3_scaling": ("llama", 0, None, dict(rope=aj.Rope())),
        "yarn_truncate": ("gpt_oss", 0, None, dict(rope=aj.Rope(
            base=150000.0, scaling="yarn", factor=32.0,
            original_max_positions=64))),
        "sinks": ("gpt_oss", 1, None, dict(attention_sinks=False)),
        "inverse_layer_scale": ("gpt2", 1, None, dict(scale=None)),
    }
    for name, (family, layer, params, change) in cases.items():
      with self.subTest(name):
        error, scale = _error(family, layer, params, **change)
        self.assertGreater(error, 1000 * REL_TOL * scale)


class _FakeTensor:
  """What the loader uses of a torch tensor: detach, cpu, float, numpy."""

  def __init__(self, array, dtype="torch.float32"):
    self.array, self.dtype = array, dtype

  def detach(self):
    return self

  def cpu(self):
    return self

  def float(self):
    return _FakeTensor(self.array.astype(np.float32))

  def numpy(self):
    if self.dtype == "torch.bfloat16":
      raise TypeError("Got unsupported ScalarType BFloat16")  # as torch
    return self.array


class InputsTest(parameterized.TestCase):
  """Configs in either format, tensors, prefixes."""

  def test_old_config_format_reads_the_same(self):
    # Hub config.json files predate rope_parameters: rope_theta +
    # rope_scaling, Gemma 3's rope_local_base_freq, no layer_types.
    for family, old in {
        "llama": lambda c: {"rope_theta": 10000.0, "rope_scaling": {
            k: v for k, v in c["rope_parameters"].items()
            if k != "rope_theta"}},
        "gpt_oss": lambda c: {"rope_theta": 150000.0, "rope_scaling": {
            k: v for k, v in c["rope_parameters"].items()
            if k != "rope_theta"}},
        "gemma3": lambda c: {"rope_theta": 1e6, "rope_local_base_freq":
                             10000.0, "sliding_window_pattern": 2,
                             "rope_scaling": {"rope_type": "linear",
                                              "factor": 8.0}},
    }.items():
      _, sd, cfg = _golden(family)
      legacy = {k: v for k, v in cfg.items()
                if k not in ("rope_parameters", "layer_types")}
      legacy.update(old(cfg))
      for layer in (0, 1):
        with self.subTest(family=family, layer=layer):
          new = checkpoints.load_attention_weights(sd, family=family, config=cfg,
                                          layer=layer).options
          got = checkpoints.load_attention_weights(sd, family=family, config=legacy,
                                          layer=layer).options
          self.assertEqual(got["rope"], new["rope"])
          self.assertEqual(got["mask"].window, new["mask"].window)

  def test_keys_a_config_json_leaves_out_take_transformers_defaults(self):
    # A saved config.json may omit keys whose config-class default is not
    # None: the sliding window (4096; gpt-oss 128) and gpt-oss's YaRN rope.
    def window(family, drop, layer=0, **extra):
      _, sd, cfg = _golden(family)
      cfg = {k: v for k, v in cfg.items() if k not in drop} | extra
      got = checkpoints.load_attention_weights(sd, family=family, config=cfg,
                                               layer=layer).options
      return got["mask"].window, got["rope"]

    self.assertEqual(window("gemma2", {"sliding_window"})[0], (4095, 0))
    w, rope = window("gpt_oss", {"sliding_window", "rope_parameters"})
    self.assertEqual(w, (127, 0))
    self.assertEqual(rope, aj.Rope(
        base=150000.0, scaling="yarn", factor=32.0,
        original_max_positions=4096, truncate=False))
    # Mistral windows every layer: its model ignores layer_types.
    self.assertEqual(window("mistral", (), layer=0,
                            layer_types=["full_attention"] * 2)[0], (3, 0))
    # Gemma 3's nested rope entries without a base take the top-level ones.
    _, rope_local = window("gemma3", (), layer=0, rope_local_base_freq=100.0,
                           rope_parameters={"sliding_attention": {
                               "rope_type": "default"}, "full_attention": {
                                   "rope_type": "default"}})
    self.assertEqual(rope_local.base, 100.0)

  def test_rope_types(self):
    _, sd, cfg = _golden("qwen3")
    base = {k: v for k, v in cfg.items() if k != "rope_parameters"}
    cases = {  # old-style rope_scaling ("type" in the oldest configs)
        "dynamic": ({"type": "dynamic", "factor": 2.0}, aj.Rope(
            base=1e6, scaling="dynamic", factor=2.0,
            original_max_positions=512)),  # HF: max_position_embeddings
        "linear": ({"rope_type": "linear", "factor": 4.0}, aj.Rope(
            base=1e6, scaling="linear", factor=4.0)),
    }
    for name, (scaling, want) in cases.items():
      with self.subTest(name):
        got = checkpoints.load_attention_weights(
            sd, family="qwen3", layer=0, config={
                **base, "rope_theta": 1e6, "rope_scaling": scaling})
        self.assertEqual(got.options["rope"], want)
    # Qwen 3's attention rotates the whole head whatever the factor says
    # (transformers' default rope never reads it); with a scaled rope type
    # transformers cannot run it, so it is refused.
    partial = checkpoints.load_attention_weights(
        sd, family="qwen3", layer=0, config={
            **cfg, "partial_rotary_factor": 0.5})
    self.assertEqual(partial.options["rope"], aj.Rope(base=1e6))
    with self.assertRaisesRegex(ValueError, "rotates the whole head"):
      checkpoints.load_attention_weights(
          sd, family="qwen3", layer=0, config={
              **base, "partial_rotary_factor": 0.5, "rope_theta": 1e6,
              "rope_scaling": {"rope_type": "linear", "factor": 4.0}})

  def test_config_objects_and_multimodal_gemma3(self):
    _, sd, cfg = _golden("gemma3")

    class Config:  # a transformers config: read through to_dict()
      def to_dict(self):
        return {"model_type": "gemma3", "text_config": cfg}

    loaded = checkpoints.load_attention_weights(
        {"model.language_model." + k[len("model."):]: v for k, v in sd.items()},
        family="gemma3", config=Config(), layer=1)
    self.assertEqual(loaded.prefix, "model.language_model.layers.1.self_attn.")
    self.assertTrue(loaded.options["normalize_qk"])

  def test_torch_tensors_and_bfloat16(self):
    _, sd, cfg = _golden("qwen3")
    tensors = {k: _FakeTensor(v) for k, v in sd.items()}
    loaded = checkpoints.load_attention_weights(tensors, family="qwen3", config=cfg,
                                       layer=0)
    np.testing.assert_array_equal(
        loaded.params["W_q"]["kernel"],
        sd["model.layers.0.self_attn.q_proj.weight"].T.reshape(64, 4, 16))
    bf16 = {k: _FakeTensor(v, "torch.bfloat16") for k, v in sd.items()}
    loaded = checkpoints.load_attention_weights(bf16, family="qwen3", config=cfg,
                                       layer=0)
    self.assertEqual(loaded.params["q_norm"]["scale"].dtype, jnp.bfloat16)
    self.assertEqual(loaded.options["param_dtype"], jnp.bfloat16)
    as_f32 = checkpoints.load_attention_weights(bf16, family="qwen3", config=cfg,
                                       layer=0, dtype=jnp.float32)
    self.assertEqual(as_f32.params["W_o"]["kernel"].dtype, jnp.float32)

  def test_explicit_prefix(self):
    _, sd, cfg = _golden("gpt2")
    base = {k[len("transformer."):]: v for k, v in sd.items()}  # GPT2Model
    found = checkpoints.load_attention_weights(base, family="gpt2", config=cfg,
                                      layer=1)
    given = checkpoints.load_attention_weights(base, family="gpt2", config=cfg,
                                      layer=1, prefix="h.1.attn")
    self.assertEqual((found.prefix, given.prefix), ("h.1.attn.", "h.1.attn."))
    np.testing.assert_array_equal(found.params["W_v"]["kernel"],
                                  given.params["W_v"]["kernel"])


class RefusalTest(parameterized.TestCase):
  """Bad input names what is wrong and the fix."""

  def setUp(self):
    super().setUp()
    _, self.sd, self.cfg = _golden("qwen2")
    self.p = "model.layers.0.self_attn."

  def load(self, sd=None, cfg=None, family="qwen2", **kwargs):
    return checkpoints.load_attention_weights(
        self.sd if sd is None else sd, family=family,
        config=self.cfg if cfg is None else cfg, **{"layer": 0, **kwargs})

  def test_unknown_family_lists_the_known_ones(self):
    with self.assertRaisesRegex(ValueError, r"unknown family 'falcon': known "
                                r"families are \['llama', 'mistral', 'qwen2'"
                                r", 'qwen3', 'gemma2', 'gemma3', 'gpt_oss', "
                                r"'gpt2'\]"):
      self.load(family="falcon")
    with self.assertRaisesRegex(ValueError, r"model_type='qwen2', but "
                                r"family='llama' reads configs of model_type"
                                r" \['llama'\]"):
      self.load(family="llama")

  def test_missing_key_names_key_and_prefix(self):
    sd = {k: v for k, v in self.sd.items() if k != self.p + "k_proj.bias"}
    with self.assertRaisesRegex(
        ValueError, r"state_dict has no 'model.layers.0.self_attn.k_proj."
        r"bias' \(qwen2 layer 0, prefix 'model.layers.0.self_attn.'; Qwen2: "
        r"q/k/v biases.*Pass prefix="):
      self.load(sd)
    with self.assertRaisesRegex(ValueError, r"no key ending in 'layers.0.self"
                                r"_attn.q_proj.weight': pass prefix="):
      self.load({"x.q_proj.weight": np.zeros((64, 64))})

  def test_wrong_shape_names_it(self):
    sd = dict(self.sd)
    sd[self.p + "k_proj.weight"] = np.zeros((64, 64), np.float32)
    with self.assertRaisesRegex(
        ValueError, r"state_dict\['model.layers.0.self_attn.k_proj.weight'\] "
        r"has shape \(64, 64\), expected \(32, 64\) \(\[heads \* head_dim, "
        r"hidden_size\]; hidden_size=64, heads=4, kv_heads=2, head_dim=16\)"):
      self.load(sd)

  def test_unused_entries_are_refused(self):
    sd = {**self.sd, self.p + "o_proj.bias": np.zeros(64, np.float32)}
    with self.assertRaisesRegex(ValueError, r"\['model.layers.0.self_attn.o_"
                                r"proj.bias'\] under prefix .* does not use "
                                r"\(Qwen2: q/k/v biases, none on o_proj\)"):
      self.load(sd)
    _, sd, cfg = _golden("llama")  # attention_bias=True checkpoint ...
    with self.assertRaisesRegex(ValueError, r"q_proj.bias.*config "
                                r"attention_bias=False"):
      self.load(sd, {**cfg, "attention_bias": False}, family="llama")

  def test_unsupported_options_are_refused(self):
    longrope = {**self.cfg, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0],
        "long_factor": [1.0], "original_max_position_embeddings": 32}}
    with self.assertRaisesRegex(ValueError, r"rope_type 'longrope' .* is not "
                                r"supported: .* maps rope types \['default', "
                                r"'linear', 'dynamic', 'llama3', 'yarn'\]"):
      self.load(cfg=longrope)
    _, sd, cfg = _golden("llama")
    llama3 = {k: v for k, v in cfg["rope_parameters"].items()
              if k != "low_freq_factor"}
    with self.assertRaisesRegex(ValueError, r"rope_type 'llama3' needs "
                                r"'low_freq_factor'"):
      self.load(sd, {**cfg, "rope_parameters": llama3}, family="llama")
    _, sd, cfg = _golden("qwen3")
    with self.assertRaisesRegex(ValueError, r"rms_norm_eps=1e-05, but "
                                r"aj.MultiHeadAttention's qk-norm adds "
                                r"epsilon=1e-06"):
      self.load(sd, {**cfg, "rms_norm_eps": 1e-5}, family="qwen3")
    _, sd, cfg = _golden("gemma3")
    with self.assertRaisesRegex(ValueError, r"use_bidirectional_attention"):
      self.load(sd, {**cfg, "use_bidirectional_attention": True},
                family="gemma3")
    with self.assertRaisesRegex(ValueError, r"does not apply it"):
      self.load(sd, {**cfg, "attn_logit_softcapping": 50.0}, family="gemma3")
    with self.assertRaisesRegex(ValueError, r"layer=2 is out of range: the "
                                r"config has 2 layers"):
      self.load(layer=2)
    with self.assertRaisesRegex(TypeError, r"config must be a dict"):
      self.load(cfg="config.json")

  def test_module_keeps_the_checkpoint_options(self):
    loaded = self.load()
    with self.assertRaisesRegex(ValueError, r"module\(\) options \['mask'\] "
                                r"are the checkpoint's"):
      loaded.module(mask=aj.Mask(causal=True))
    mha = loaded.module(param_dtype=jnp.float16)  # not the checkpoint's
    self.assertEqual(mha.W_o.bias.dtype, jnp.float16)
    np.testing.assert_array_equal(mha.W_o.bias[...], 0.0)  # Qwen2: no o bias


if __name__ == "__main__":
  absltest.main()
