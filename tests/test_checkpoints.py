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

import dataclasses
import json
import pathlib

from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.interop import checkpoints

GOLDEN = pathlib.Path(__file__).parent / "golden"
FAMILIES = checkpoints.FAMILIES
# Goldens of a family's other layouts, and the family that loads them.
LOADER = {"bloom6": "bloom", "falcon_mq": "falcon", "falcon_alibi": "falcon"}
GOLDENS = sorted(p.stem for p in GOLDEN.glob("*.npz"))
# T5's recorded attentions (``in/enc/0``): the loader's ``attention=``.
ATTENTIONS = {"enc": "encoder", "dec": "decoder", "cross": "cross"}
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


def _recorded(golden: str) -> list[str]:
  """A golden's recorded calls: ``"0"``, ``"enc/1"``, ``"short/0"`` (a
  second run on fewer tokens)..."""
  z = np.load(GOLDEN / f"{golden}.npz")
  if any(k.startswith("pos/") for k in z.files):  # M-RoPE positions [3, B, T]:
    return []  # tests/test_checkpoints_vl.py passes them
  return sorted(k.split("/", 1)[1] if k.startswith("in/")
                else "short/" + k.split("/", 1)[1]
                for k in z.files if k.startswith(("in/", "in_short/")))


def _where(name: str) -> tuple[int, str]:
  """(layer, attention) of a recorded call."""
  head, _, tail = name.rpartition("/")
  return int(tail), ATTENTIONS.get(head, "self")


def _module(loaded: checkpoints.LoadedAttention, **change):
  """``loaded``'s layer, optionally with some options changed."""
  if not change:
    return loaded.module()
  latent = FAMILIES[loaded.family].module == "latent"
  cls = aj.MultiHeadLatentAttention if latent else aj.MultiHeadAttention
  module = cls(**{**loaded.options, **change}, rngs=nnx.Rngs(0))
  params = dict(loaded.params)
  if getattr(module, "sinks", None) is None:  # the layer without sinks
    params.pop("sinks", None)
  if getattr(module, "t5_table", None) is None:
    params.pop("t5_bias", None)
  module.load_params(params)
  return module


def _run(loaded: checkpoints.LoadedAttention, x, kv=None, **change):
  """``loaded``'s layer on ``x`` (cross-attention: to ``kv``)."""
  module = _module(loaded, **change)
  args = (jnp.asarray(x),) if kv is None else (jnp.asarray(x),
                                               jnp.asarray(kv))
  return np.asarray(module(*args))


def _error(golden: str, name, params=None, **change) -> tuple[float, float]:
  """(max |ours - HF|, max |HF|) for one recorded call of a golden."""
  z, sd, cfg = _golden(golden)
  name = str(name)
  short = name.startswith("short/")
  layer, attention = _where(name.removeprefix("short/"))
  loaded = checkpoints.load_attention_weights(
      sd, family=LOADER.get(golden, golden), config=cfg, layer=layer,
      attention=attention)
  if params is not None:
    loaded = dataclasses.replace(loaded, params=params(loaded.params))
  key = name.removeprefix("short/")
  want = z[("out_short/" if short else "out/") + key]
  x = z[("in_short/" if short else "in/") + key]
  kv = z[f"kv/{key}"] if f"kv/{key}" in z.files else None
  got = _run(loaded, x, kv, **change)
  return float(np.abs(got - want).max()), float(np.abs(want).max())


class GoldenTest(parameterized.TestCase):
  """Each family's layers equal transformers' eager attention."""

  @parameterized.named_parameters(
      *((f"{golden}_{name.replace('/', '_')}", golden, name)
        for golden in GOLDENS for name in _recorded(golden)))
  def test_matches_transformers(self, golden, name):
    error, scale = _error(golden, name)
    self.assertGreater(scale, 1.0)  # a golden of O(1..10) logits, not zeros
    self.assertLess(error, REL_TOL * scale)

  def test_every_family_has_a_golden(self):
    covered = {LOADER.get(g, g) for g in GOLDENS}
    self.assertEqual(sorted(set(FAMILIES) - covered), [])
    self.assertEqual(sorted(covered - set(FAMILIES)), [])

  def test_goldens_record_their_provenance(self):
    for golden in GOLDENS:
      z, _, cfg = _golden(golden)
      cfg = cfg.get("text_config", cfg)  # a VL model's: its language model's
      self.assertEqual(str(z["family"]), golden)
      self.assertTrue(str(z["transformers_version"]))
      family = FAMILIES[LOADER.get(golden, golden)]
      # Tiny models: 1 or 2 layers (Gemma 3n: 4, two of them shared).
      self.assertIn(cfg.get(family.count_key(family.attentions[0])),
                    (1, 2, 4 if golden == "gemma3n" else 2))

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
    causal = aj.Mask(causal=True)

    def options(family, layer):
      _, sd, cfg = _golden(family)
      return checkpoints.load_attention_weights(
          sd, family=LOADER.get(family, family), config=cfg,
          layer=layer).options

    def rope(family, layer):
      return options(family, layer)["rope"]

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
        "mixtral_window": ("mixtral", 1, None, dict(mask=causal)),
        "starcoder2_window": ("starcoder2", 0, None, dict(mask=causal)),
        "olmo2_whole_width": ("olmo2", 0, None, dict(
            normalize_qk=aj.QKNorm(weight="per_head"))),
        "cohere_layer_norm": ("cohere", 0, None, dict(
            normalize_qk=aj.QKNorm(weight="per_head", epsilon=1e-5))),
        "cohere_pairs": ("cohere", 1, None, dict(rope=aj.Rope())),
        "cohere2_global_has_no_rope": ("cohere2", 1, None, dict(
            rope=aj.Rope(interleaved=True))),
        "cohere2_window": ("cohere2", 0, None, dict(mask=causal)),
        "phi3_longrope": ("phi3", 0, None, dict(rope=aj.Rope(fraction=0.5))),
        "phi3_long_factors": ("phi3", 1, None, dict(rope=dataclasses.replace(
            options("phi3", 1)["rope"],
            long_factor=options("phi3", 1)["rope"].short_factor))),
        "phi3_short_factors": ("phi3", "short/1", None, dict(
            rope=dataclasses.replace(
                options("phi3", 1)["rope"],
                short_factor=options("phi3", 1)["rope"].long_factor))),
        "phi3_window": ("phi3", 0, None, dict(mask=causal)),
        "llama4_chunks": ("llama4", 0, None, dict(mask=causal)),
        "llama4_qk_norm": ("llama4", 0, None, dict(normalize_qk=False)),
        "llama4_pairs": ("llama4", 0, None, dict(rope=aj.Rope(base=5e5))),
        "llama4_temperature": ("llama4", 1, None, dict(score_mod=None)),
        "qwen3_next_gate": ("qwen3_next", 1, lambda p: {
            k: v for k, v in p.items() if k != "W_g"}, dict(output_gate=None)),
        "qwen3_next_one_plus_weight": ("qwen3_next", 1, None, dict(
            normalize_qk=aj.QKNorm())),
        "qwen3_next_partial_rotary": ("qwen3_next", 1, None, dict(
            rope=aj.Rope())),
        "gpt_neox_partial_rotary": ("gpt_neox", 0, None, dict(
            rope=dataclasses.replace(rope("gpt_neox", 0), fraction=1.0))),
        "gptj_pairs": ("gptj", 1, None, dict(rope=dataclasses.replace(
            rope("gptj", 1), interleaved=False))),
        "bloom_alibi": ("bloom", 0, None, dict(score_mod=None)),
        "bloom6_alibi": ("bloom6", 0, None, dict(score_mod=None)),
        "falcon_pairs": ("falcon", 1, None, dict(rope=dataclasses.replace(
            rope("falcon", 1), interleaved=True))),
        "falcon_mq_rope": ("falcon_mq", 0, None, dict(rope=None)),
        "falcon_alibi": ("falcon_alibi", 1, None, dict(score_mod=None)),
        "t5_no_scaling": ("t5", "enc/1", None, dict(scale=None)),
        "t5_bidirectional": ("t5", "enc/0", None, dict(t5_bias=aj.T5Bias(
            8, 6, bidirectional=False))),
        "t5_bias_table": ("t5", "dec/1", lambda p: {
            k: v for k, v in p.items() if k != "t5_bias"}, dict(t5_bias=None)),
        "t5_decoder_causal": ("t5", "dec/0", None, dict(mask=None)),
        "deepseek_v3_pairs": ("deepseek_v3", 0, None, dict(
            rope=dataclasses.replace(rope("deepseek_v3", 0),
                                     interleaved=False))),
        "deepseek_v3_mscale": ("deepseek_v3", 1, None, dict(
            scale=16 ** -0.5)),  # (Hn + Hr)**-0.5 without YaRN's mscale**2
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

  def test_new_families_take_their_config_classes_defaults(self):
    def load(family, layer=0, drop=(), **extra):
      _, sd, cfg = _golden(family)
      cfg = {k: v for k, v in cfg.items() if k not in drop} | extra
      return checkpoints.load_attention_weights(sd, family=family, config=cfg,
                                                layer=layer).options
    # Llama 4: the mask follows layer_types; without them RoPE layers chunk
    # by attention_chunk_size, 8192 when the config leaves it out.
    full = load("llama4", layer_types=["full_attention"] * 2)
    self.assertEqual(repr(full["mask"]), repr(aj.Mask(causal=True)))
    default = load("llama4", drop=("layer_types", "attention_chunk_size"))
    self.assertEqual(default["mask"].rule, aj.chunked_mask_fn(8192))
    with self.assertRaisesRegex(ValueError, r"config has no 'head_dim': "
                                r"llama4's config class gives it a default"):
      load("llama4", drop=("head_dim",))
    # Qwen3-Next rotates a quarter of the head unless told otherwise.
    _, _, cfg = _golden("qwen3_next")
    rope_params = {k: v for k, v in cfg["rope_parameters"].items()
                   if k != "partial_rotary_factor"}
    quarter = load("qwen3_next", layer=1, drop=("partial_rotary_factor",),
                   rope_parameters=rope_params)
    self.assertEqual(quarter["rope"].fraction, 0.25)
    # Phi-3 (HF 5): the rope parameters' factor wins over max / original,
    # and the config class's top-level original (4096) over theirs.
    _, _, cfg = _golden("phi3")
    given = load("phi3", rope_parameters={**cfg["rope_parameters"],
                                          "factor": 2.0})
    self.assertEqual(given["rope"].factor, 2.0)
    inner = load("phi3", drop=("original_max_position_embeddings",),
                 rope_parameters={**cfg["rope_parameters"],
                                  "original_max_position_embeddings": 8})
    self.assertEqual(inner["rope"].original_max_positions, 4096)
    # OLMo 2's whole-width weights read with an overriding QKNorm too.
    _, sd, cfg = _golden("olmo2")
    norm = aj.QKNorm(over="all", weight="per_head", epsilon=1e-3)
    olmo2 = checkpoints.load_attention_weights(
        sd, family="olmo2", config=cfg, layer=0,
        overrides={"normalize_qk": norm})
    self.assertEqual(olmo2.options["normalize_qk"], norm)
    self.assertEqual(olmo2.params["q_norm"]["scale"].shape, (4, 16))

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
    with self.assertRaises(ValueError) as caught:
      self.load(family="jamba")
    self.assertRegex(str(caught.exception),
                     r"unknown family 'jamba': known families are \['llama', "
                     r"'mistral', .*\]\..*For another model, port it by hand")
    for family in FAMILIES:  # every one of them listed
      self.assertIn(repr(family), str(caught.exception))
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
    mrope = {**self.cfg, "rope_parameters": {
        "rope_type": "mrope", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}}
    # Qwen2-VL's sections: a sign of its family (qwen2_vl reads them).
    with self.assertRaisesRegex(ValueError, r"mrope_section=\[2, 3, 3\] "
                                r"\(multimodal rotary sections"):
      self.load(cfg=mrope)
    with self.assertRaisesRegex(ValueError, r"rope_type 'su' .* is not "
                                r"supported: .* maps rope types \['default', "
                                r"'linear', 'dynamic', 'llama3', 'yarn', "
                                r"'longrope'\]"):
      self.load(cfg={**self.cfg, "rope_parameters": {
          "rope_type": "su", "rope_theta": 1e4}})
    _, sd, cfg = _golden("llama")
    llama3 = {k: v for k, v in cfg["rope_parameters"].items()
              if k != "low_freq_factor"}
    with self.assertRaisesRegex(ValueError, r"rope_type 'llama3' needs "
                                r"'low_freq_factor'"):
      self.load(sd, {**cfg, "rope_parameters": llama3}, family="llama")
    _, sd, cfg = _golden("qwen3")  # the config's epsilon, not a fixed one
    loaded = self.load(sd, {**cfg, "rms_norm_eps": 1e-5}, family="qwen3")
    self.assertEqual(loaded.options["normalize_qk"], aj.QKNorm(epsilon=1e-5))
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



class NoGuessTest(parameterized.TestCase):
  """A config or state dict the loader cannot place is refused, not guessed."""

  def load(self, family, cfg, sd=None, layer=0, **kwargs):
    if sd is None:
      _, sd, _ = _golden(family)
    return checkpoints.load_attention_weights(sd, family=family, config=cfg,
                                              layer=layer, **kwargs)

  def test_unknown_model_type_says_how_to_port_by_hand(self):
    # Granite's attention is llama's but for its attention_multiplier scale:
    # loaded as llama it would be off, nothing the loader could notice.
    _, sd, cfg = _golden("llama")
    granite = {**cfg, "model_type": "granitex", "attention_multiplier": 0.1}
    with self.assertRaises(ValueError) as caught:
      self.load("llama", granite, sd)
    message = str(caught.exception)
    # The nearest supported family is named, never taken.
    self.assertIn("The nearest supported family is 'granite'", message)
    self.assertRegex(message, r"model_type='granitex', which load_attention_"
                     r"weights does not read: it maps the families \['llama'"
                     r".*\].*no other model by a guess")
    self.assertRegex(message, r"port it by hand: build aj.MultiHeadAttention"
                     r"\(.*rope=aj.Rope.*load_params")
    self.assertNotIn("drop", message)  # never: relabel the config
    # A known model type of another family names that family: Cohere's
    # layers are llama's but for interleaved rotary pairs (0.8% off).
    for other in ("qwen2", "cohere"):
      with self.assertRaisesRegex(ValueError, f"model_type='{other}', but "
                                  f"family='llama' .* this is a {other} "
                                  f"config, pass family='{other}'"):
        self.load("llama", _golden(other)[2], sd)
    # A multimodal wrapper whose text model is the family's: its text_config.
    with self.assertRaisesRegex(ValueError, r"model_type='llava'.* Its "
                                r"text_config has model_type 'llama': for the "
                                r"language model's layers pass "
                                r"config\['text_config'\]"):
      self.load("llama", {"model_type": "llava", "text_config": cfg}, sd)

  def test_no_model_type_is_refused_when_the_config_is_another_familys(self):
    untyped = lambda family: {k: v for k, v in _golden(family)[2].items()
                              if k != "model_type"}
    _, llama_sd, _ = _golden("llama")
    cases = {  # (family asked, config) -> the keys that give it away
        "qwen2_as_llama": ("llama", untyped("qwen2"),
                           r"layer_types=.*max_window_layers=.*"
                           r"sliding_window=.*use_sliding_window="),
        "qwen2_as_mistral": ("mistral", untyped("qwen2"),
                             r"layer_types=.*max_window_layers="),
        "mistral_as_llama": ("llama", untyped("mistral"),
                             r"sliding_window=4 \(a sliding window\)"),
        "gemma2_as_llama": ("llama", untyped("gemma2"),
                            r"attn_logit_softcapping=.*query_pre_attn_"
                            r"scalar="),
        "cohere_as_llama": ("llama", {**untyped("llama"), "logit_scale":
                                      0.0625}, r"logit_scale=0.0625 \(Cohere's"),
        "partial_rotary": ("llama", {**untyped("llama"),
                                     "partial_rotary_factor": 0.5},
                           r"partial_rotary_factor=0.5 \(a partial rotary"),
    }
    for name, (family, cfg, keys) in cases.items():
      with self.subTest(name), self.assertRaisesRegex(
          ValueError, r"config has no model_type, and it sets " + keys +
          r".*which " + family + r" attention does not read: .*It is "
          r"another model's config.*port it by hand"):
        self.load(family, cfg, llama_sd)
    # Nothing that contradicts the family: loaded as with its model_type
    # (but families only a model_type tells apart, tested in
    # tests/test_checkpoint_families.py).
    for family in FAMILIES:
      if "model_type" in FAMILIES[family].requires:
        continue
      with self.subTest(accepted=family):
        z, sd, cfg = _golden(family)
        attention = FAMILIES[family].attentions[0]
        got, want = (self.load(family, c, sd, layer=1,
                               attention=attention).options
                     for c in (untyped(family), cfg))
        self.assertEqual(repr(got["mask"]), repr(want["mask"]))
        self.assertEqual(repr(got.get("score_mod")),
                         repr(want.get("score_mod")))
        plain = lambda o: {k: v for k, v in o.items()
                           if k not in ("mask", "score_mod")}
        self.assertEqual(plain(got), plain(want))
    loaded = self.load("llama", {**untyped("llama"),
                                 "partial_rotary_factor": 1.0}, llama_sd)
    self.assertEqual(loaded.options["rope"].fraction, 1.0)

  def test_a_cohere_config_without_model_type_is_named_not_guessed(self):
    _, sd, cfg = _golden("cohere")
    untyped = {k: v for k, v in cfg.items() if k != "model_type"}
    with self.assertRaises(ValueError) as caught:
      self.load("llama", untyped, {
          k: v for k, v in sd.items() if "norm" not in k})
    message = str(caught.exception)
    self.assertRegex(message, r"logit_scale=0.0625 \(Cohere's logit scale\), "
                     r"use_qk_norm=True \(Cohere's qk-norm\)")
    self.assertRegex(message, r"pass the family its model_type names")
    # Named as Cohere it loads (its interleaved pairs and per-head norms).
    self.assertTrue(self.load("cohere", untyped, sd).options["rope"]
                    .interleaved)

  def test_sizes_whose_default_differs_are_not_guessed(self):
    def without(family, key):
      return {k: v for k, v in _golden(family)[2].items() if k != key}
    for family in ("qwen3", "gemma2", "gemma3", "gpt_oss"):
      with self.subTest(family), self.assertRaisesRegex(
          ValueError, r"config has no 'head_dim': " + family +
          r"'s config class gives it a default of its own"):
        self.load(family, without(family, "head_dim"))
    for family in ("mistral", "qwen2", "qwen3"):
      with self.subTest(family), self.assertRaisesRegex(
          ValueError, r"config has no 'num_key_value_heads'"):
        self.load(family, without(family, "num_key_value_heads"))
    # Llama's config class derives both (hidden_size // heads; the heads).
    loaded = self.load("llama", without("llama", "head_dim"))
    self.assertEqual(loaded.options["head_dim"], 16)
    with self.assertRaisesRegex(ValueError, r"must be a positive int, got 0"):
      self.load("llama", {**_golden("llama")[2], "num_attention_heads": 0})

  def test_rope_parameters_without_the_layers_entry_are_refused(self):
    _, sd, cfg = _golden("gemma3")
    flat = {**cfg, "rope_parameters": {"rope_type": "default",
                                       "rope_theta": 1e6}}
    with self.assertRaisesRegex(ValueError, r"rope_parameters'\] has no "
                                r"'sliding_attention' entry .*nested by layer "
                                r"type"):
      self.load("gemma3", flat, sd, layer=0)
    _, sd, cfg = _golden("gpt_oss")  # layer 0 slides, layer 1 is global
    nested = {**cfg, "rope_parameters": {"full_attention": cfg[
        "rope_parameters"]}}
    self.assertEqual(self.load("gpt_oss", nested, sd, layer=1).options[
        "rope"], self.load("gpt_oss", cfg, sd, layer=1).options["rope"])
    with self.assertRaisesRegex(ValueError, r"nested by layer type "
                                r"\(\['full_attention'\]\) but have no "
                                r"'sliding_attention' entry for layer 0"):
      self.load("gpt_oss", nested, sd, layer=0)

  def test_fused_qkv_is_named_not_blamed_on_the_prefix(self):
    # A tiny Phi-3 layer: qkv_proj [(N + 2K) * H, D] rows q, k, v.
    d, n, k, h = 8, 2, 1, 4
    rng = np.random.default_rng(0)
    w = lambda *shape: rng.normal(size=shape).astype(np.float32)
    p = "model.layers.0.self_attn."
    phi3 = {p + "qkv_proj.weight": w((n + 2 * k) * h, d),
            p + "o_proj.weight": w(d, n * h)}
    cfg = dict(hidden_size=d, num_attention_heads=n, num_key_value_heads=k,
               head_dim=h, num_hidden_layers=1, rope_theta=10000.0)
    fused = (r"state_dict has 'model.layers.0.self_attn.qkv_proj.weight': a "
             r"fused q/k/v projection \(Phi-3's layout: rows q \[N \* H\], "
             r"then k \[K \* H\], then v \[K \* H\]\)\. The llama loader does "
             r"not read this layout .*no prefix= changes that.*load it with "
             r"the family that reads it \(phi3\).*split it by hand")
    for prefix in (None, p):
      with self.subTest(prefix=prefix):
        with self.assertRaises(ValueError) as caught:
          self.load("llama", cfg, phi3, prefix=prefix)
        self.assertRegex(str(caught.exception), fused)
        self.assertNotIn("pass prefix=", str(caught.exception))
    # Phi-3's own config names its family.
    with self.assertRaisesRegex(ValueError, r"model_type='phi3', but family="
                                r"'llama' .* pass family='phi3'"):
      self.load("llama", {**cfg, "model_type": "phi3",
                          "sliding_window": 2047}, phi3)
    others = {  # other models' fused names, as their state dicts spell them
        "gpt_neox.layers.0.attention.query_key_value.weight": "GPT-NeoX",
        "transformer.blocks.0.attn.Wqkv.weight": "MPT",
        "model.layers.0.self_attn.W_pack.weight": "Baichuan",
        "transformer.h.0.attn.c_attn.weight": "family='gpt2'",
    }
    for key, says in others.items():
      with self.subTest(key), self.assertRaisesRegex(
          ValueError, f"state_dict has '{key}': a fused q/k/v projection.*"
          f"{says}"):
        self.load("qwen2", {**cfg, "model_type": "qwen2"}, {key: w(3 * d, d)})


def _rotate(x, base, interleaved):
  """RoPE at positions 0..T-1, float64: ``x [T, heads, H]``."""
  t, _, h = x.shape
  angle = np.arange(t)[:, None] * base ** (-np.arange(0, h, 2) / h)  # [T, H/2]
  cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]  # [T, 1, H/2]
  if interleaved:  # pairs (x[2i], x[2i + 1])
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * cos - b * sin, b * cos + a * sin
    return out
  a, b = x[..., :h // 2], x[..., h // 2:]  # pairs (x[i], x[i + H/2])
  return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)


def _llama_reference(sd, p, x, *, n, k, base, interleaved=False, scale=None,
                     window=None, cap=None, norm=False, sinks=False):
  """A llama-style layer on ``x [T, D]`` in float64, from the HF weights."""
  x = x.astype(np.float64)
  t = x.shape[0]
  w = lambda name: sd[p + name].astype(np.float64)
  h = w("q_proj.weight").shape[0] // n
  q = (x @ w("q_proj.weight").T).reshape(t, n, h)
  key = (x @ w("k_proj.weight").T).reshape(t, k, h)
  v = (x @ w("v_proj.weight").T).reshape(t, k, h)
  if norm:  # RMSNorm per head, epsilon 1e-6, before the rotation
    rms = lambda a, g: a / np.sqrt((a * a).mean(-1, keepdims=True) + 1e-6) * g
    q, key = rms(q, w("q_norm.weight")), rms(key, w("k_norm.weight"))
  q, key = _rotate(q, base, interleaved), _rotate(key, base, interleaved)
  key = np.repeat(key, n // k, axis=1)  # query head i reads kv head i // G
  v = np.repeat(v, n // k, axis=1)
  logits = np.einsum("tnh,snh->nts", q, key) * (h ** -0.5 if scale is None
                                                else scale)
  if cap is not None:
    logits = cap * np.tanh(logits / cap)
  i, j = np.arange(t)[:, None], np.arange(t)[None, :]
  seen = (j <= i) & ((i - j <= window) if window is not None else True)
  logits = np.where(seen, logits, -np.inf)
  e = np.exp(logits - logits.max(-1, keepdims=True))
  total = e.sum(-1, keepdims=True)
  if sinks:  # exp(sink) joins each row's denominator
    total = total + np.exp(w("sinks")[:, None, None]
                           - logits.max(-1, keepdims=True))
  out = np.einsum("nts,snh->tnh", e / total, v).reshape(t, n * h)
  return out @ w("o_proj.weight").T


class OverridesTest(parameterized.TestCase):
  """overrides= replaces inferred options; unknown names are refused."""

  D, N, K, H, T = 8, 2, 1, 4, 6
  P = "model.layers.0.self_attn."

  def setUp(self):
    super().setUp()
    rng = np.random.default_rng(1)
    w = lambda *shape: rng.normal(size=shape).astype(np.float32)
    d, n, k, h = self.D, self.N, self.K, self.H
    self.sd = {self.P + "q_proj.weight": w(n * h, d),
               self.P + "k_proj.weight": w(k * h, d),
               self.P + "v_proj.weight": w(k * h, d),
               self.P + "o_proj.weight": w(d, n * h)}
    self.extra = {self.P + "q_norm.weight": 1 + 0.3 * w(h),
                  self.P + "k_norm.weight": 1 + 0.3 * w(h),
                  self.P + "sinks": w(n)}
    self.cfg = dict(model_type="llama", hidden_size=d, num_attention_heads=n,
                    num_key_value_heads=k, num_hidden_layers=1,
                    rope_theta=100.0)
    self.x = w(self.T, d)

  def compare(self, loaded, sd, **reference):
    got = np.asarray(loaded.module()(jnp.asarray(self.x[None])))[0]
    want = _llama_reference(sd, self.P, self.x, n=self.N, k=self.K,
                            **reference)
    # float32 against float64: sums of 8 products, a softmax over <= 6 keys
    # (~1e-6 of the output's scale); every override below moves the output
    # by > 1e-2 of it.
    np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max())
    return want

  def test_rope_override_changes_the_rotation(self):
    load = lambda **kw: checkpoints.load_attention_weights(
        self.sd, family="llama", config=self.cfg, layer=0, **kw)
    half = self.compare(load(), self.sd, base=100.0)
    rope = aj.Rope(base=100.0, interleaved=True)  # Cohere's / GPT-J's pairs
    loaded = load(overrides={"rope": rope})
    self.assertEqual(loaded.options["rope"], rope)
    pairs = self.compare(loaded, self.sd, base=100.0, interleaved=True)
    self.assertGreater(np.abs(pairs - half).max(), 1e-2 * np.abs(half).max())
    # An overriding Rope replaces the config's, which is then not read, so
    # a rope type the loader does not map is no obstacle.
    longrope = {**self.cfg, "rope_scaling": {"rope_type": "longrope"}}
    loaded = checkpoints.load_attention_weights(
        self.sd, family="llama", config=longrope, layer=0,
        overrides={"rope": aj.Rope(base=1000.0)})
    self.assertEqual(loaded.options["rope"], aj.Rope(base=1000.0))
    self.compare(loaded, self.sd, base=1000.0)

  def test_mask_scale_and_soft_cap_overrides(self):
    overrides = {"mask": aj.Mask(causal=True, window=(1, 0)), "scale": 0.9,
                 "logits_soft_cap": 1.5}
    loaded = checkpoints.load_attention_weights(
        self.sd, family="llama", config=self.cfg, layer=0,
        overrides=overrides)
    self.assertEqual({k: loaded.options[k] for k in overrides}, overrides)
    self.compare(loaded, self.sd, base=100.0, window=1, scale=0.9, cap=1.5)
    # Gemma 3's refused soft cap becomes the port's choice.
    _, sd, cfg = _golden("gemma3")
    capped = checkpoints.load_attention_weights(
        sd, family="gemma3", config={**cfg, "attn_logit_softcapping": 50.0},
        layer=0, overrides={"logits_soft_cap": 50.0})
    self.assertEqual(capped.options["logits_soft_cap"], 50.0)

  def test_qk_norm_and_sinks_overrides_read_their_weights(self):
    sd = {**self.sd, **self.extra}
    with self.assertRaisesRegex(ValueError, r"k_norm.weight.*does not use"):
      checkpoints.load_attention_weights(sd, family="llama", config=self.cfg,
                                         layer=0)
    loaded = checkpoints.load_attention_weights(
        sd, family="llama", config=self.cfg, layer=0,
        overrides={"normalize_qk": True, "attention_sinks": True})
    self.assertTrue(loaded.options["normalize_qk"])
    np.testing.assert_array_equal(loaded.sinks, self.extra[self.P + "sinks"])
    self.compare(loaded, sd, base=100.0, norm=True, sinks=True)

  def test_t5_bias_override_sets_the_buckets(self):
    z, sd, cfg = _golden("t5")
    load = lambda attention, bias: checkpoints.load_attention_weights(
        sd, family="t5", config=cfg, layer=1, attention=attention,
        overrides={"t5_bias": bias})
    x, want = jnp.asarray(z["in/enc/1"]), z["out/enc/1"]
    same = load("encoder", aj.T5Bias(8, 6, bidirectional=True))
    np.testing.assert_allclose(same.module()(x), want,
                               atol=REL_TOL * np.abs(want).max())
    farther = load("encoder", aj.T5Bias(8, 100, bidirectional=True))
    self.assertEqual(farther.options["t5_bias"].max_distance, 100)
    self.assertGreater(np.abs(farther.module()(x) - want).max(),
                       1000 * REL_TOL * np.abs(want).max())
    with self.assertRaisesRegex(ValueError, r"cross attention has no "
                                r"relative table"):
      load("cross", aj.T5Bias(8, 6))
    with self.assertRaisesRegex(ValueError, r"llama layers have no such "
                                r"table \(t5 and umt5 do\)"):
      checkpoints.load_attention_weights(
          self.sd, family="llama", config=self.cfg, layer=0,
          overrides={"t5_bias": aj.T5Bias(8, 6)})
    with self.assertRaisesRegex(TypeError, r"overrides\['t5_bias'\] must be "
                                r"an aj.T5Bias"):
      load("encoder", 8)

  def test_bad_overrides_are_refused(self):
    load = lambda overrides: checkpoints.load_attention_weights(
        self.sd, family="llama", config=self.cfg, layer=0,
        overrides=overrides)
    valid = (r"\['rope', 'mask', 'scale', 'logits_soft_cap', 'normalize_qk', "
             r"'attention_sinks', 'score_mod', 't5_bias'\]")
    with self.assertRaisesRegex(ValueError, r"overrides has \['window'\], "
                                r"which load_attention_weights does not infer:"
                                r" the options it can override are " + valid +
                                r" \(a window W is mask=aj.Mask\(causal=True, "
                                r"window=\(W - 1, 0\)\)\)"):
      load({"window": 4})
    with self.assertRaisesRegex(ValueError, r"overrides has \['d_model', "
                                r"'dtype'\].*" + valid + r".*Sizes and "
                                r"use_bias follow the weights"):
      load({"d_model": 16, "dtype": jnp.float16})
    with self.assertRaisesRegex(TypeError, r"overrides must be a dict"):
      load([("rope", None)])
    with self.assertRaisesRegex(TypeError, r"overrides\['normalize_qk'\] must "
                                r"be a bool or an aj.QKNorm"):
      load({"normalize_qk": 1})
    with self.assertRaisesRegex(TypeError, r"rope='x'"):
      load({"rope": "x"})
    # module() keeps the checkpoint's options, and says where to change them.
    with self.assertRaisesRegex(ValueError, r"module\(\) options \['rope'\] "
                                r".*pass overrides= to load_attention_weights"):
      load(None).module(rope=None)


class LoadedDecodingTest(parameterized.TestCase):
  """A loaded layer decodes token by token as its full forward computes."""

  @parameterized.named_parameters(
      ("llama4_chunked_qk_norm_after_rope", "llama4", 0),
      ("llama4_nope_temperature", "llama4", 1),
      ("olmo2_whole_width_norm", "olmo2", 0),
      ("cohere_layer_norm_pairs", "cohere", 1),
      ("qwen3_next_gate", "qwen3_next", 1),
      ("cohere2_global_without_rope", "cohere2", 1),
      ("bloom_alibi", "bloom", 1),
      ("falcon_alibi_bfloat16_positions", "falcon_alibi", 0),
      ("gptj_partial_pairs", "gptj", 0),
      ("t5_decoder_relative_bias", "t5", "dec/1"),
      ("deepseek_v3_latent", "deepseek_v3", 0),
  )
  def test_decode_equals_forward(self, golden, name):
    z, sd, cfg = _golden(golden)
    layer, attention = _where(str(name))
    module = checkpoints.load_attention_weights(
        sd, family=LOADER.get(golden, golden), config=cfg, layer=layer,
        attention=attention).module()
    x = jnp.asarray(z[f"in/{name}"])  # [B, T, D]
    full = module(x)
    module.init_cache(batch_size=x.shape[0], max_length=x.shape[1])
    outs = [module(x[:, :3], decode=True)]
    step = nnx.jit(lambda m, x: m(x, decode=True))
    for i in range(3, x.shape[1]):
      outs.append(step(module, x[:, i:i + 1]))
    # The same float32 sums in another order (cache slots): ~1e-6 of the
    # output's scale, as the goldens' REL_TOL allows.
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full,
                               atol=REL_TOL * float(jnp.abs(full).max()))


class FalconAlibiTest(parameterized.TestCase):
  """Falcon's ALiBi rounds slope and position to bfloat16 (HF's
  build_alibi_tensor); the 4-head goldens cannot tell, 16 heads at 300
  positions can (bfloat16's 2**-9 of slope * position)."""

  def test_bias_matches_hfs_bfloat16_formula(self):
    from attention_jax.interop.checkpoints import gpt  # noqa: PLC0415
    n, h, s = 16, 64, 300
    # HF's slopes (base 2**-(8 / 16) for 16 heads), then its bfloat16 math.
    slopes = np.float32(2.0 ** -0.5) ** np.arange(1, n + 1, dtype=np.float32)
    bf16 = jnp.bfloat16
    product = (slopes.astype(bf16)[:, None]
               * np.arange(s).astype(bf16)[None, :])  # [N, S] bfloat16
    want = product.astype(np.float32) / np.float32(np.sqrt(h))
    mod = gpt.falcon_alibi(n, h)
    kv = jnp.arange(s)[None, :]
    got = np.stack([np.asarray(mod(jnp.zeros((1, s)), 0, head, 0, kv))[0]
                    for head in range(n)])
    # float32 division against float32 division: equal to an ulp.
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    plain = slopes[:, None] * np.arange(s)[None, :] / np.sqrt(h)
    self.assertGreater(np.abs(plain - want).max(), 1e-3)  # it matters


class QwenWindowLayersTest(parameterized.TestCase):
  """Qwen's window rule on its own: layers >= max_window_layers slide."""

  @parameterized.named_parameters(
      ("all", 0, [(3, 0), (3, 0)]), ("from_1", 1, [None, (3, 0)]),
      ("none", 2, [None, None]), ("default_28", None, [None, None]))
  def test_boundary(self, max_window_layers, want):
    for family in ("qwen2", "qwen3"):
      z, sd, cfg = _golden(family)
      # Without layer_types the loader derives them, as Qwen's config does.
      cfg = {k: v for k, v in cfg.items()
             if k not in ("layer_types", "max_window_layers")}
      cfg.update(use_sliding_window=True, sliding_window=4)
      if max_window_layers is not None:
        cfg["max_window_layers"] = max_window_layers
      got = [checkpoints.load_attention_weights(
          sd, family=family, config=cfg, layer=layer).options["mask"].window
             for layer in (0, 1)]
      self.assertEqual(got, want, family)
      if family == "qwen2" and max_window_layers == 1:  # the golden's rule
        for layer in (0, 1):
          loaded = checkpoints.load_attention_weights(
              sd, family=family, config=cfg, layer=layer)
          want_out = z[f"out/{layer}"]
          np.testing.assert_allclose(
              _run(loaded, z[f"in/{layer}"]), want_out,
              atol=REL_TOL * np.abs(want_out).max())


if __name__ == "__main__":
  absltest.main()


class ServingTest(parameterized.TestCase):
  """A loaded layer serves from a paged cache unchanged: its prompt
  prefilled, then a token at a time through the page table, it gives the
  checkpoint's own (golden) outputs."""

  @parameterized.parameters("llama", "gemma2", "qwen3", "gpt_oss")
  def test_paged_decoding_gives_the_checkpoints_outputs(self, family):
    z, sd, cfg = _golden(family)
    layer = 0
    loaded = checkpoints.load_attention_weights(sd, family=family, config=cfg,
                                                layer=layer)
    mha = loaded.module()
    x = jnp.asarray(z[f"in/{layer}"])  # [B, T, D]
    b, t = x.shape[:2]
    mha.init_paged_cache(b, num_pages=b * t, page_size=2, max_pages=t)
    step = nnx.jit(lambda m, x: m(x, decode=True))  # 2 compiles, not eager
    outs = [step(mha, x[:, :3])]
    outs += [step(mha, x[:, i:i + 1]) for i in range(3, t)]
    want = z[f"out/{layer}"]
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(np.concatenate(outs, axis=1), want,
                               atol=REL_TOL * scale, rtol=0)
