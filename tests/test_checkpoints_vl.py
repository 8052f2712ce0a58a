"""aj.load_attention_weights on vision-language models' text attention (M-RoPE).

The goldens (``tests/golden/{qwen2_vl,qwen2_5_vl,qwen3_vl}.npz``, written by
``tests/golden/make_vl_goldens.py``) hold a tiny random model's language
attention weights under their full-model names, its whole multimodal
config (``text_config`` nested) and each layer's input, output and the
positions ``[3, B, T]`` it was given (three different rows). Each layer,
loaded from the state dict and config alone and called with those
positions, equals HF's output; dropping the sections or their
interleaving moves it far off; the refusals.
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
VL = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# As tests/test_checkpoints.py: float32 against float32 torch, observed
# <= 4e-7 of the output's scale (~20); a mis-mapped rotary moves it by
# >= 1e-2 of it.
REL_TOL = 1e-5


def _golden(family: str):
  z = np.load(GOLDEN / f"{family}.npz")
  sd = {k[len("sd/"):]: z[k] for k in z.files if k.startswith("sd/")}
  return z, sd, json.loads(str(z["config_json"]))


def _error(family: str, layer: int, rope=None, positions=None, **load):
  """(max |ours - HF|, max |HF|); ``rope``: replaces the loaded one."""
  z, sd, cfg = _golden(family)
  loaded = checkpoints.load_attention_weights(sd, config=cfg, layer=layer,
                                              **load)
  if rope is not None:
    loaded = dataclasses.replace(
        loaded, options={**loaded.options, "rope": rope})
  module = aj.MultiHeadAttention(**loaded.options, rngs=nnx.Rngs(0))
  module.load_params(loaded.params)
  pos = z[f"pos/{layer}"] if positions is None else positions
  got = np.asarray(module(jnp.asarray(z[f"in/{layer}"]),
                          positions=jnp.asarray(pos)))
  want = z[f"out/{layer}"]
  return float(np.abs(got - want).max()), float(np.abs(want).max())


class GoldenTest(parameterized.TestCase):

  @parameterized.product(family=VL, layer=(0, 1))
  def test_matches_transformers(self, family, layer):
    error, scale = _error(family, layer)
    self.assertGreater(scale, 1.0)  # O(1..10) logits, not zeros
    self.assertLess(error, REL_TOL * scale)

  def test_positions_rows_differ_and_config_is_multimodal(self):
    for family in VL:
      z, _, cfg = _golden(family)
      pos = z["pos/0"]
      self.assertEqual(pos.shape, (3, 2, 10))
      self.assertFalse(np.array_equal(pos[0], pos[1]))
      self.assertFalse(np.array_equal(pos[1], pos[2]))
      self.assertEqual(cfg["model_type"], family)
      self.assertEqual(cfg["text_config"]["model_type"], f"{family}_text")

  def test_what_each_layer_is_given(self):
    def options(family, layer):
      _, sd, cfg = _golden(family)
      return checkpoints.load_attention_weights(sd, config=cfg,
                                                layer=layer).options
    self.assertEqual(options("qwen2_vl", 0)["rope"],
                     aj.Rope(base=10000.0, sections=(2, 3, 3)))
    self.assertEqual(options("qwen3_vl", 0)["rope"], aj.Rope(
        base=10000.0, sections=(4, 2, 2), sections_interleaved=True))
    self.assertEqual([options("qwen2_vl", i)["mask"].window for i in (0, 1)],
                     [None, (3, 0)])  # max_window_layers=1, window 4
    self.assertTrue(options("qwen3_vl", 0)["normalize_qk"])

  @parameterized.parameters(
      ("qwen2_vl", aj.Rope(base=10000.0)),  # plain: time row only
      ("qwen2_5_vl", aj.Rope(base=10000.0)),
      ("qwen3_vl", aj.Rope(base=10000.0)),
      ("qwen3_vl", aj.Rope(base=10000.0, sections=(4, 2, 2))),  # blocked
  )
  def test_each_rotary_detail_is_seen(self, family, rope):
    z, _, _ = _golden(family)
    pos = z["pos/0"] if rope.sections else z["pos/0"][0]
    error, scale = _error(family, 0, rope=rope, positions=pos)
    self.assertGreater(error, 1000 * REL_TOL * scale)

  def test_window_is_seen(self):
    error, scale = _error("qwen2_vl", 1, overrides={
        "mask": aj.Mask(causal=True)})
    self.assertGreater(error, 1000 * REL_TOL * scale)

  def test_rope_override_replaces_the_sections(self):
    z, sd, cfg = _golden("qwen2_vl")
    rope = aj.Rope(base=10.0, sections=(4, 2, 2))
    loaded = checkpoints.load_attention_weights(
        sd, config=cfg, layer=0, overrides={"rope": rope})
    self.assertEqual(loaded.options["rope"], rope)


class RefusalTest(parameterized.TestCase):

  def test_calling_without_positions_is_refused(self):
    z, sd, cfg = _golden("qwen3_vl")
    module = checkpoints.load_attention_weights(sd, config=cfg,
                                                layer=0).module()
    with self.assertRaisesRegex(ValueError, r"multimodal positions \[3"):
      module(jnp.asarray(z["in/0"]))

  def test_read_as_qwen2_it_is_refused(self):
    _, sd, cfg = _golden("qwen2_5_vl")
    text = {k: v for k, v in cfg["text_config"].items() if k != "model_type"}
    with self.assertRaisesRegex(ValueError, r"mrope_section=\[2, 3, 3\]"):
      checkpoints.load_attention_weights(sd, family="qwen2", config=text,
                                         layer=0)
    with self.assertRaisesRegex(ValueError, r"this is a qwen2_5_vl config"):
      checkpoints.load_attention_weights(sd, family="qwen2", config=cfg,
                                         layer=0)

  @parameterized.named_parameters(
      ("scaled", dict(rope_type="yarn", factor=2.0), r"rope_type 'yarn'"),
      ("unknown_field", dict(rope_type="default", alpha=2.0),
       r"have \['alpha'\]"),
      ("sections_sum", dict(rope_type="default", mrope_section=[2, 2, 2]),
       r"summing to head_dim / 2 = 8"),
      ("interleaved_overrun", dict(rope_type="default",
                                   mrope_section=[2, 3, 3]),
       r"width axis"),
  )
  def test_bad_rope_parameters_are_refused(self, change, match):
    _, sd, cfg = _golden("qwen3_vl")
    text = dict(cfg["text_config"])
    text["rope_parameters"] = {**text["rope_parameters"], **change}
    with self.assertRaisesRegex(ValueError, match):
      checkpoints.load_attention_weights(
          sd, config={**cfg, "text_config": text}, layer=0)


if __name__ == "__main__":
  absltest.main()
