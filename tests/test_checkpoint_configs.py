"""aj.load_attention_weights on configs and state dicts the goldens do not
cover: what transformers fills in for a key a config leaves out (a rope's
pretraining length, Llama 4's NoPE layers), the refusal where it has no
defined value, and weights of another family than the one asked for.

Small synthetic state dicts (random NumPy weights under HF names) and
configs written here; no transformers, no network.
"""

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

import attention_jax as aj
from attention_jax.interop import checkpoints

D, N, K, H = 8, 2, 1, 4  # hidden, heads, kv heads, head dim


def _weights(layers=1, fused=False, prefix="model.layers.{}.self_attn."):
  """A Llama-style (or, fused, Phi-3-style) attention state dict."""
  rng = np.random.default_rng(0)
  w = lambda *shape: rng.normal(size=shape).astype(np.float32)
  sd = {}
  for i in range(layers):
    p = prefix.format(i)
    if fused:  # Phi-3: rows q [N * H], k [K * H], v [K * H]
      sd[p + "qkv_proj.weight"] = w((N + 2 * K) * H, D)
    else:
      sd.update({p + "q_proj.weight": w(N * H, D),
                 p + "k_proj.weight": w(K * H, D),
                 p + "v_proj.weight": w(K * H, D)})
    sd[p + "o_proj.weight"] = w(D, N * H)
  return sd


def _config(layers=1, **extra):
  return dict(hidden_size=D, num_attention_heads=N, num_key_value_heads=K,
              head_dim=H, num_hidden_layers=layers, rope_theta=10000.0,
              **extra)


def _load(family, cfg, sd=None, layer=0, **kwargs):
  sd = _weights(cfg["num_hidden_layers"]) if sd is None else sd
  return checkpoints.load_attention_weights(sd, family=family, config=cfg,
                                            layer=layer, **kwargs)


_SHORT, _LONG = [1.0, 1.5], [2.0, 4.0]  # H / 2 rotary pairs each


class PretrainingLengthTest(parameterized.TestCase):
  """llama3 / YaRN / LongRoPE's original_max_position_embeddings."""

  def test_longrope_falls_back_to_max_position_embeddings(self):
    # transformers' standardize_rope_params: without a top-level or rope
    # parameters' original_max_position_embeddings it sets it to
    # max_position_embeddings, so the factor is 64 / 64 = 1 and LongRoPE's
    # magnitude sqrt(1 + ln(factor) / ln(original)) is 1 (factor <= 1).
    cfg = _config(max_position_embeddings=64, rope_scaling={
        "rope_type": "longrope", "short_factor": _SHORT,
        "long_factor": _LONG})
    self.assertEqual(_load("llama", cfg).options["rope"], aj.Rope(
        base=10000.0, scaling="longrope", original_max_positions=64,
        short_factor=tuple(_SHORT), long_factor=tuple(_LONG),
        attention_factor=1.0))

  @parameterized.named_parameters(
      ("longrope", {"rope_type": "longrope", "short_factor": _SHORT,
                    "long_factor": _LONG, "factor": 4.0}),
      ("llama3", {"rope_type": "llama3", "factor": 8.0,
                  "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
      ("yarn", {"rope_type": "yarn", "factor": 4.0}))
  def test_no_length_anywhere_is_refused_by_name(self, scaling):
    # Neither key: transformers would take its config class's default
    # max_position_embeddings, which differs between classes.
    rope_type = scaling["rope_type"]
    with self.assertRaisesRegex(
        ValueError, f"rope_type '{rope_type}' \\(layer 0\\) needs "
        r"'original_max_position_embeddings'.*no 'max_position_embeddings' "
        r"either.*Add 'original_max_position_embeddings' to the rope "
        r"parameters"):
      _load("llama", _config(rope_scaling=scaling))

  def test_a_null_length_is_refused_by_name(self):
    scaling = {"rope_type": "longrope", "short_factor": _SHORT,
               "long_factor": _LONG}
    cases = {  # where the null is -> how the message names it
        "top_level": (_config(max_position_embeddings=64, rope_scaling=scaling,
                              original_max_position_embeddings=None),
                      r"config\['original_max_position_embeddings'\]"),
        "rope_parameters": (_config(max_position_embeddings=64, rope_scaling={
            **scaling, "original_max_position_embeddings": None}),
                            r"the rope parameters' "
                            r"'original_max_position_embeddings'"),
        "a_float": (_config(max_position_embeddings=64, rope_scaling={
            **scaling, "original_max_position_embeddings": 32.5}),
                    r"the rope parameters' 'original_max_position_embeddings'"),
    }
    for name, (cfg, where) in cases.items():
      with self.subTest(name), self.assertRaisesRegex(
          ValueError, where + r" must be a positive int \(the context length "
          r"the model was pretrained at\) for rope_type 'longrope' \(layer "
          r"0\), got (None|32.5)"):
        _load("llama", cfg)

  def test_a_given_length_is_read_from_either_place(self):
    scaling = {"rope_type": "longrope", "short_factor": _SHORT,
               "long_factor": _LONG}
    inner = _config(max_position_embeddings=64, rope_scaling={
        **scaling, "original_max_position_embeddings": 16})
    outer = _config(max_position_embeddings=64, rope_scaling=scaling,
                    original_max_position_embeddings=16)
    for cfg in (inner, outer):
      rope = _load("llama", cfg).options["rope"]
      self.assertEqual(rope.original_max_positions, 16)
      self.assertEqual(rope.factor, 64 / 16)  # HF: max / original


class OtherFamilysWeightsTest(parameterized.TestCase):
  """Weights of another family name it, not prefix=."""

  def test_llama_weights_asked_as_phi3_name_llama(self):
    for prefix in (None, "model.layers.0.self_attn."):
      with self.subTest(prefix=prefix):
        with self.assertRaises(ValueError) as caught:
          _load("phi3", _config(), prefix=prefix)
        message = str(caught.exception)
        self.assertRegex(
            message, r"no key (ending in )?'(model\.)?layers\.0\.self_attn\."
            r"qkv_proj\.weight' \(the weight phi3 layers are found by\) but "
            r"has 'model\.layers\.0\.self_attn\.q_proj\.weight': these look "
            r"like another family's weights \(llama; .*mistral.*\), not "
            r"phi3's, and no prefix= changes that\. Pass family='llama'")
        self.assertNotIn("pass prefix=", message.lower())
    # Named so, they load.
    self.assertEqual(_load("llama", _config()).family, "llama")

  def test_the_configs_signs_pick_the_family(self):
    # A config with a sliding window (no model_type): of the families
    # whose weights these names are, the first that reads a window.
    with self.assertRaisesRegex(ValueError, r"another family's weights "
                                r"\(mistral; .*\).*Pass family='mistral'"):
      _load("phi3", _config(sliding_window=4))

  def test_a_config_of_the_asked_family_is_flagged(self):
    cfg = _config(model_type="phi3", sliding_window=4)
    with self.assertRaisesRegex(ValueError, r"Pass family='mistral'.*the "
                                r"config says model_type='phi3', so the "
                                r"config and the weights seem to be "
                                r"different models'"):
      _load("phi3", cfg)

  def test_other_layouts_name_their_family(self):
    # GPT-2's weights asked as llama are refused as a fused layout (the
    # refusal names gpt2); llama's asked as GPT-2 or T5 name llama.
    for family in ("gpt2", "t5", "deepseek_v3"):
      with self.subTest(family), self.assertRaisesRegex(
          ValueError, r"another family's weights \(llama.*Pass "
          r"family='llama'"):
        kwargs = {"attention": "encoder"} if family == "t5" else {}
        _load(family, _config(), **kwargs)
    # Phi-3's fused weights asked as llama: named by the fused refusal.
    with self.assertRaisesRegex(ValueError, r"load it with the family that "
                                r"reads it \(phi3\)"):
      _load("llama", _config(), _weights(fused=True))


class Llama4NoRopeLayersTest(parameterized.TestCase):
  """A Llama 4 config without no_rope_layers, as transformers derives it."""

  def layers(self, count=8, **extra):
    cfg = _config(layers=count, model_type="llama4_text",
                  attention_chunk_size=4, **extra)
    sd = _weights(count)
    return [_load("llama4", cfg, sd, layer=i).options for i in range(count)]

  def nope(self, options):
    """The layers loaded without rotary positions (NoPE)."""
    got = [i for i, o in enumerate(options) if o["rope"] is None]
    # A NoPE layer: full causal attention with the query temperature, and
    # no qk-norm (HF applies it on RoPE layers only).
    for i, o in enumerate(options):
      with self.subTest(layer=i):
        self.assertEqual(o.get("score_mod") is not None, i in got)
        self.assertEqual(o["mask"].rule is None, i in got)
        self.assertEqual(o.get("normalize_qk") is None, i in got)
    return got

  def test_every_fourth_layer_from_the_fourth_is_nope(self):
    # Llama4TextConfig: no_rope_layers[i] = int((i + 1) % interval != 0),
    # 1 = RoPE: layers 3, 7, ... have none (not 0, 4, ...).
    self.assertEqual(self.nope(self.layers()), [3, 7])
    # An empty list is "not given" there too (`no_rope_layers or default`).
    self.assertEqual(self.nope(self.layers(no_rope_layers=[])), [3, 7])

  def test_the_interval_is_read(self):
    self.assertEqual(self.nope(self.layers(no_rope_layer_interval=3)),
                     [2, 5])
    # A list given wins over the interval.
    flags = [0, 1, 1, 1, 1, 1, 1, 0]
    self.assertEqual(self.nope(self.layers(no_rope_layers=flags)), [0, 7])


if __name__ == "__main__":
  absltest.main()
