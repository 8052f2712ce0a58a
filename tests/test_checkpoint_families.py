"""The loader never reads a config as a family it was not declared to be.

Every family's golden config (``tests/golden/<family>.npz``: a real
transformers config, ``to_json_string(use_diff=False)``, with that family's
state dict) is fed to every other family's reader: with its model_type it is
refused by name; without it (``family=`` declared by hand) it is refused, or
the layer it gives computes exactly what the family it came from computes.
Then: a config with neither is refused with the candidates, the family is
taken from model_type when ``family=`` is left out, unknown rope fields are
refused, and each newer family's distinguishing option is seen (dropping it
moves the output past the goldens' tolerance).
"""

import functools
import json
import pathlib
import sys

from absl.testing import absltest
from absl.testing import parameterized
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.interop import checkpoints

GOLDEN = pathlib.Path(__file__).parent / "golden"
FAMILIES = checkpoints.FAMILIES
# Goldens of a family's other layouts, and the family that loads them.
LOADER = {"bloom6": "bloom", "falcon_mq": "falcon", "falcon_alibi": "falcon"}
# As tests/test_checkpoints.py: float32 against float32 torch, observed
# <= 4e-7 of the output's scale; any mis-mapped option moves it >= 5e-2.
REL_TOL = 1e-5


@functools.cache
def _golden(name: str):
  z = np.load(GOLDEN / f"{name}.npz")
  sd = {k[len("sd/"):]: z[k] for k in z.files if k.startswith("sd/")}
  ins = sorted(k for k in z.files if k.startswith("in/"))
  return sd, json.loads(str(z["config_json"])), {
      k[len("in/"):]: (z[k], z["out/" + k[len("in/"):]]) for k in ins}


def _goldens() -> list[str]:
  """Goldens of self-attention layers run without extra inputs (T5's
  encoder/decoder/cross and M-RoPE's positions have tests of their own)."""
  names = []
  for path in sorted(GOLDEN.glob("*.npz")):
    family = LOADER.get(path.stem, path.stem)
    if family not in FAMILIES or FAMILIES[family].attentions != ("self",):
      continue
    if any(k.startswith("pos/") for k in np.load(path).files):
      continue
    names.append(path.stem)
  return names


@functools.cache
def _own(golden: str, layer: str):
  sd, cfg, _ = _golden(golden)
  return checkpoints.load_attention_weights(
      sd, family=LOADER.get(golden, golden), config=cfg, layer=int(layer))


def _same_layer(a, b) -> bool:
  """Whether two loaded layers are the same: options (masks and score
  modifiers by their repr: equal values, not one object) and weights."""
  plain = lambda o: {k: repr(v) if k in ("mask", "score_mod") else v
                     for k, v in o.items()}
  if plain(a.options) != plain(b.options) or a.params.keys() != b.params.keys():
    return False
  return all(a.params[n].keys() == b.params[n].keys() and all(
      np.array_equal(a.params[n][e], b.params[n][e]) for e in a.params[n])
             for n in a.params)


def _output(sd, cfg, family, layer, x, **kwargs):
  loaded = checkpoints.load_attention_weights(sd, family=family, config=cfg,
                                              layer=int(layer), **kwargs)
  return np.asarray(loaded.module()(jnp.asarray(x)))


class NeverGuessTest(parameterized.TestCase):

  @parameterized.named_parameters((g, g) for g in _goldens())
  def test_other_families_refuse_or_agree(self, golden):
    sd, cfg, calls = _golden(golden)
    own = LOADER.get(golden, golden)
    layer, (x, want) = next(iter(calls.items()))
    untyped = {k: v for k, v in cfg.items() if k != "model_type"}
    for other in FAMILIES:
      if other == own or FAMILIES[other].attentions != ("self",):
        continue
      with self.subTest(other=other):
        with self.assertRaisesRegex(ValueError, "model_type"):
          checkpoints.load_attention_weights(sd, family=other, config=cfg,
                                             layer=int(layer))
        try:
          loaded = checkpoints.load_attention_weights(
              sd, family=other, config=untyped, layer=int(layer))
        except ValueError:
          continue  # refused: the config or the weights are another's
        if _same_layer(loaded, _own(golden, layer)):
          continue  # the same options and weights: the same layer
        got = np.asarray(loaded.module()(jnp.asarray(x)))
        scale = np.abs(want).max()
        self.assertLess(np.abs(got - want).max(), REL_TOL * scale,
                        f"{golden}'s config read as {other} computes "
                        "something else")

  def test_multimodal_rotary_configs_are_refused_by_every_other_family(self):
    # The Qwen-VL goldens' layers need their [3, B, T] positions, so they
    # are not run here: no other family may read their configs at all.
    for path in sorted(GOLDEN.glob("qwen*_vl.npz")):
      sd, cfg, _ = _golden(path.stem)
      text = cfg.get("text_config", cfg)
      for config in (cfg, {k: v for k, v in text.items()
                           if k != "model_type"}):
        for other in FAMILIES:
          if other == path.stem or FAMILIES[other].attentions != ("self",):
            continue
          with self.subTest(golden=path.stem, other=other,
                            typed="model_type" in config), self.assertRaises(
                                ValueError):
            checkpoints.load_attention_weights(sd, family=other,
                                               config=config, layer=0)

  def test_the_family_comes_from_model_type(self):
    sd, cfg, calls = _golden("granite")
    loaded = checkpoints.load_attention_weights(sd, config=cfg, layer=0)
    self.assertEqual((loaded.family, loaded.options["scale"]),
                     ("granite", 0.2))
    untyped = {k: v for k, v in cfg.items() if k != "model_type"}
    with self.assertRaisesRegex(
        ValueError, r"no model_type and no family=.*named as \[.*'llama'.*"
        r"'granite'.*\]'s"):
      checkpoints.load_attention_weights(sd, config=untyped, layer=0)

  def test_a_look_alike_without_model_type_is_refused(self):
    # Helium is Llama with interleaved rotary pairs: nothing in its config
    # tells the two apart, so only a config with its model_type is read.
    sd, cfg, _ = _golden("arcee")
    untyped = {k: v for k, v in cfg.items() if k != "model_type"}
    with self.assertRaisesRegex(ValueError, "nothing in its config tells it "
                                "apart.*Give the config its model_type"):
      checkpoints.load_attention_weights(sd, family="helium", config=untyped,
                                         layer=0)
    # Gemma 2 configs always carry its scale and soft cap.
    with self.assertRaisesRegex(ValueError, r"every gemma2 config has "
                                r"\['query_pre_attn_scalar', "
                                r"'attn_logit_softcapping'\]"):
      checkpoints.load_attention_weights(sd, family="gemma2", config=untyped,
                                         layer=0)

  def test_keys_the_family_does_not_read_are_named(self):
    sd, cfg, _ = _golden("llama")
    for key, value, meaning in (
        ("num_kv_shared_layers", 2, "Gemma 3n"),
        ("attention_multiplier", 0.1, "Granite's attention scale"),
        ("image_token_id", 7, "vision-language")):
      with self.subTest(key), self.assertRaisesRegex(
          ValueError, rf"sets {key}={value} \(.*{meaning}.*which llama "
          "attention does not read"):
        checkpoints.load_attention_weights(sd, family="llama", layer=0,
                                           config={**cfg, key: value})

  def test_unknown_rope_fields_are_refused(self):
    sd, cfg, _ = _golden("qwen2")
    rope = {**cfg["rope_parameters"], "rope_type": "default"}
    rope.pop("factor"), rope.pop("original_max_position_embeddings")
    for field, value in (("mrope_section", [2, 3, 3]), ("alpha", 4.0),
                         ("low_freq_factor", 1.0)):
      # mrope_section is also a sign key (refused before the rope is read).
      with self.subTest(field), self.assertRaisesRegex(
          ValueError, rf"{field}.*which qwen2('s rotary embedding with this "
          "type| attention) does not read"):
        checkpoints.load_attention_weights(
            sd, family="qwen2", layer=0,
            config={**cfg, "rope_parameters": {**rope, field: value}})

  def test_a_window_without_its_switch_is_refused(self):
    sd, cfg, _ = _golden("qwen3_moe")
    cfg = {k: v for k, v in cfg.items() if k != "use_sliding_window"}
    with self.assertRaisesRegex(ValueError, "sliding_window=4 but no "
                                "use_sliding_window"):
      checkpoints.load_attention_weights(sd, family="qwen3_moe", config=cfg,
                                         layer=0)


class CoveragePageTest(absltest.TestCase):

  def test_every_family_is_on_the_page_with_what_it_maps(self):
    page = (pathlib.Path(__file__).parents[1] / "docs" / "families.md"
            ).read_text()
    rows = {line.split("|")[1].strip(" `"): line for line in page.splitlines()
            if line.startswith("| `")}
    self.assertEqual(sorted(rows), sorted(FAMILIES))
    self.assertIn(family_table(), page)  # --write_docs regenerates it


class NewerFamiliesTest(parameterized.TestCase):
  """Each newer family's distinguishing option, as its golden shows it."""

  @parameterized.named_parameters(
      ("granite_scale", "granite", 0, dict(scale=None)),
      ("helium_pairs", "helium", 0, dict(rope=aj.Rope())),
      ("glm_partial_pairs", "glm4", 0,
       dict(rope=aj.Rope(fraction=0.5))),
      ("glm4_moe_qk_norm", "glm4_moe", 0, dict(normalize_qk=False)),
      ("ernie_pairs", "ernie4_5", 1, dict(rope=aj.Rope())),
      ("nemotron_partial", "nemotron", 0, dict(rope=aj.Rope())),
      ("ministral_window", "ministral", 0,
       dict(mask=aj.Mask(causal=True))),
      ("qwen2_moe_window", "qwen2_moe", 0,
       dict(mask=aj.Mask(causal=True))),
      ("qwen3_moe_every_layer", "qwen3_moe", 1,
       dict(mask=aj.Mask(causal=True))),
      ("dots1_window", "dots1", 1, dict(mask=aj.Mask(causal=True))),
      ("olmo3_window", "olmo3", 0, dict(mask=aj.Mask(causal=True))),
      ("exaone4_nope", "exaone4", 1, dict(rope=aj.Rope())),
      ("smollm3_nope", "smollm3", 1, dict(rope=aj.Rope(base=2e6))),
      ("smollm3_window", "smollm3", 1, dict(mask=aj.Mask(causal=True))),
      ("vaultgemma_soft_cap", "vaultgemma", 0,
       dict(logits_soft_cap=None)),
      ("hunyuan_ntk_alpha", "hunyuan_v1_dense", 0,
       dict(rope=aj.Rope())),
      ("ministral3_query_scale", "ministral3", 0, dict(score_mod=None)),
      ("ministral3_from_zero", "ministral3", 1, dict(
          score_mod=aj.query_temperature(floor_scale=4.0, attn_scale=0.5))),
  )
  def test_dropping_the_option_is_seen(self, golden, layer, change):
    sd, cfg, calls = _golden(golden)
    x, want = calls[str(layer)]
    scale = np.abs(want).max()
    self.assertLess(np.abs(_output(sd, cfg, golden, layer, x) - want).max(),
                    REL_TOL * scale)
    loaded = checkpoints.load_attention_weights(sd, family=golden, config=cfg,
                                                layer=layer)
    options = {**loaded.options, **change}
    params = dict(loaded.params)
    if change.get("normalize_qk") is False:
      params = {k: v for k, v in params.items() if not k.endswith("_norm")}
    module = aj.MultiHeadAttention(**options, rngs=__import__(
        "flax").nnx.Rngs(0))
    module.load_params(params)
    got = np.asarray(module(jnp.asarray(x)))
    self.assertGreater(np.abs(got - want).max(), 100 * REL_TOL * scale)

  def test_module_keeps_the_new_options(self):
    sd, cfg, _ = _golden("olmo")
    loaded = checkpoints.load_attention_weights(sd, config=cfg, layer=0)
    for name, value in (("clip_qkv", 100.0), ("value_norm", aj.QKNorm()),
                        ("output_norm", aj.QKNorm())):
      with self.subTest(name), self.assertRaisesRegex(
          ValueError, rf"\['{name}'\] are the checkpoint's"):
        loaded.module(**{name: value})

  def test_option_values(self):
    def options(golden, layer):
      sd, cfg, _ = _golden(golden)
      return checkpoints.load_attention_weights(sd, family=golden, config=cfg,
                                                layer=layer).options
    self.assertEqual(options("hunyuan_v1_dense", 0)["rope"],
                     aj.Rope(base=10000.0, ntk_alpha=4.0))
    self.assertEqual(options("glm", 0)["rope"],
                     aj.Rope(fraction=0.5, interleaved=True))
    self.assertIsNone(options("exaone4", 1)["rope"])  # global NoPE
    self.assertEqual(options("exaone4", 0)["mask"].window, (3, 0))
    self.assertEqual([options("dots1", i)["mask"].window for i in (0, 1)],
                     [None, (3, 0)])
    self.assertTrue(options("seed_oss", 0)["use_bias"])


def family_table() -> str:
  """docs/families.md's table, from the loader's records."""
  rows = ["| family | model types | what it maps | config keys it reads | "
          "a config without model_type needs |", "|---|---|---|---|---|"]
  for name, family in FAMILIES.items():
    cell = lambda keys: ", ".join(f"`{k}`" for k in keys) or "-"
    maps = family.maps.replace("|", "\\|")  # a cell of the table
    rows.append(f"| `{name}` | {cell(family.model_types)} | {maps} | "
                f"{cell(family.reads)} | {cell(family.requires)} |")
  return "\n".join(rows)


def write_docs() -> None:
  page = pathlib.Path(__file__).parents[1] / "docs" / "families.md"
  text = page.read_text()
  start, end = "<!-- families -->\n", "\n<!-- /families -->"
  head, rest = text.split(start)
  page.write_text(head + start + family_table() + end + rest.split(end)[1])


if __name__ == "__main__":
  if "--write_docs" in sys.argv:
    write_docs()
  else:
    absltest.main()
