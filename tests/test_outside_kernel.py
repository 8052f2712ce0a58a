"""A kernel written outside the library, with its public names only.

``PlainSoftmax`` is what a user would write in their own package: one head's
``softmax(q k^T * scale + bias, where=allowed) v`` for the calls it
supports, refusing the rest (score modifiers, mask rules, max logits,
weights, dropout). It uses nothing but ``aj.`` names (checked below from
this file's source), registers into the automatic choice, and passes the
contract (``tests/contract.py``'s ``outside_suite``) on a subset of cases
that touches every feature it takes and two it refuses.

Shape glossary: B batch, N query heads, T query length, S key/value
length, H head dim.
"""

import ast
import dataclasses
import pathlib

from absl.testing import absltest
import chex
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from tests import _data
from tests import contract
from tests import reference

CALLS = []  # names of the PlainSoftmax kernels that ran, in order


@dataclasses.dataclass(frozen=True)
class PlainSoftmax(aj.kernels.Kernel):
  """One head's whole ``[T, S]`` softmax, for the calls it supports."""
  name = "plain_softmax"
  # What it implements; everything else (a rule, a score modifier, max
  # logits, weights, dropout) the choice refuses by name.
  implements = (aj.kernels.MASK_FIELDS - {"rule"}) | {"bias", "sinks",
                                                       "return_lse"}

  def __call__(self, problem):
    CALLS.append(self.name)
    ops = problem.ops
    t, s = ops.query.shape[-2], ops.key.shape[-2]
    dtype = aj.kernels.compute_dtype(problem.out_dtype)

    def head(q, k, v, h):  # [T, H], [S, H], [S, Hv], aj.kernels.Head
      allowed = aj.kernels.allowed(ops, h, t, s)  # [T, S] or None
      if allowed is not None:  # padding may hold NaN
        k, v = aj.kernels.zero_unseen(jnp.any(allowed, axis=0), k, v)
      logits = jnp.einsum("TH,SH->TS", q, k, preferred_element_type=dtype)
      logits = logits * jnp.asarray(problem.scale, dtype)  # [T, S]
      if h.bias is not None:  # -inf blocks like the mask
        logits = logits + jnp.broadcast_to(h.bias.astype(dtype), (t, s))
        finite = logits > -jnp.inf
        allowed = finite if allowed is None else allowed & finite
      weights = aj.kernels.masked_softmax(logits, allowed)  # [T, S]
      lse = aj.kernels.masked_logsumexp(logits, allowed)  # [T]
      if h.sink is not None:
        weights, _, lse = aj.kernels.with_sink(weights, lse, h.sink,
                                               h.q_lengths)
      out = jnp.einsum("TS,SV->TV", weights, v.astype(dtype))  # [T, Hv]
      return out.astype(problem.out_dtype), None, lse

    return aj.kernels.lift_heads(head, ops)


REFUSES = {"softcap", "alibi", "t5", "rule", "max_logits"}
# Every feature it takes once (masks with empty rows, -inf bias, NaN
# padding, lengths, windows, unsorted segments, sinks, float64, T > S, MQA)
# and two refusals: seconds, not the whole contract's minutes.
SUBSET = ("causal_t_gt_s_empty_rows", "zero_length_nan_padding",
          "mask_empty_rows", "bias_neg_inf", "float64",
          "segments_unsorted_window_lengths", "sinks_causal_query_lengths",
          "mqa_causal_lengths", "block_mask_prefix_lm",
          "max_logits_modified_patterned")

OutsideContractTest = contract.outside_suite(PlainSoftmax(), REFUSES, SUBSET)


def _qkv(t=12, s=12):
  q = _data.normal(0, (2, 4, t, 8))  # [B, N, T, H]
  k = _data.normal(1, (2, 4, s, 8))
  v = _data.normal(2, (2, 4, s, 8))
  return q, k, v


class OutsideKernelTest(chex.TestCase):

  def setUp(self):
    super().setUp()
    CALLS.clear()
    self.registry = aj.kernels.REGISTRY
    # Whatever a test does, the registry is as it was after it.
    self.addCleanup(self.assertEqual, aj.kernels.REGISTRY, self.registry)

  def test_uses_only_public_names(self):
    tree = ast.parse(pathlib.Path(__file__).read_text())
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module:
        self.assertFalse(node.module.startswith("attention_jax"),
                         node.module)
      if isinstance(node, ast.Attribute):
        chain, value = [node.attr], node.value
        while isinstance(value, ast.Attribute):
          chain.append(value.attr)
          value = value.value
        if isinstance(value, ast.Name) and value.id == "aj":
          self.assertEqual([a for a in chain if a.startswith("_")], [],
                           ast.unparse(node))

  def test_registered_it_is_the_automatic_choice(self):
    q, k, v = _qkv()
    with aj.kernels.register(PlainSoftmax(), before="flash") as kernel:
      names = [k.name for k in aj.kernels.REGISTRY]
      self.assertEqual(names.index("plain_softmax") + 1, names.index("flash"))
      self.assertEqual(aj.explain(q, k, v, is_causal=True).kernel,
                       "plain_softmax")
      out = aj.scaled_dot_product_attention(q, k, v, is_causal=True)
      self.assertEqual(CALLS, ["plain_softmax"])
      # Its name works as implementation= while registered.
      by_name = aj.scaled_dot_product_attention(
          q, k, v, is_causal=True, implementation="plain_softmax")
      # What it refuses goes on to the next kernel (dense here).
      _, weights = aj.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                   return_weights=True)
      self.assertEqual(CALLS, ["plain_softmax"] * 2)
      self.assertIs(kernel, aj.kernels.by_name("plain_softmax"))
    chex.assert_trees_all_close(out, by_name, atol=0.0)
    chex.assert_shape(weights, (2, 4, 12, 12))
    allowed = np.broadcast_to(np.tril(np.ones((12, 12), bool)), (2, 4, 12, 12))
    with jax.enable_x64(True):
      want, _ = reference.masked_attention(
          *(np.asarray(x, np.float64) for x in (q, k, v)), None, allowed)
    # float32 logits over 12 keys against the float64 formula.
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)
    # Unregistered on leaving the block: the name is gone again.
    self.assertNotIn("plain_softmax", [k.name for k in aj.kernels.REGISTRY])
    with self.assertRaisesRegex(ValueError, "'plain_softmax'"):
      aj.kernels.by_name("plain_softmax")

  def test_first_by_default_and_unregister_by_name(self):
    aj.kernels.register(PlainSoftmax())
    try:
      self.assertEqual(aj.kernels.REGISTRY[0].name, "plain_softmax")
      # First, it runs even where the flash kernel would (T * S = 1024^2).
      q = jax.ShapeDtypeStruct((1, 1, 1024, 8), jnp.float32)
      self.assertEqual(aj.explain(q, q, q).kernel, "plain_softmax")
    finally:
      removed = aj.kernels.unregister("plain_softmax")
    self.assertIsInstance(removed, PlainSoftmax)

  def test_registration_errors_name_the_fix(self):
    with self.assertRaisesRegex(TypeError, "pass an instance"):
      aj.kernels.register(PlainSoftmax)
    with self.assertRaisesRegex(ValueError, "'dense' is already registered"):
      aj.kernels.register(aj.kernels.Dense())
    with self.assertRaisesRegex(ValueError, "'flash' is already"):
      aj.kernels.register(type("Old", (PlainSoftmax,),
                               {"name": "flash"})())
    with self.assertRaisesRegex(ValueError, "needs its own name"):
      aj.kernels.register(type("Nameless", (aj.kernels.Kernel,), {})())
    with self.assertRaisesRegex(ValueError, "before must name a registered "
                                "kernel, one of .*'flash'.*, got 'nope'"):
      aj.kernels.register(PlainSoftmax(), before="nope")
    with self.assertRaisesRegex(ValueError, "no registered kernel is called "
                                "'plain_softmax'"):
      aj.kernels.unregister("plain_softmax")

  def test_a_builtin_unregistered_and_back(self):
    flash = aj.kernels.unregister("flash")
    try:
      self.assertNotIn(flash, aj.kernels.REGISTRY)
      q = jax.ShapeDtypeStruct((1, 1, 1024, 8), jnp.float32)
      self.assertEqual(aj.explain(q, q, q, is_causal=True).kernel, "dense")
    finally:
      aj.kernels.register(flash, before="dense")

  def test_outside_suite_checks_its_arguments(self):
    with self.assertRaisesRegex(ValueError, "no case feature: \\['softcaps'"):
      contract.outside_suite(PlainSoftmax(), {"softcaps"})
    with self.assertRaisesRegex(ValueError, "no such contract cases"):
      contract.outside_suite(PlainSoftmax(), REFUSES, ["nope"])
    with self.assertRaisesRegex(TypeError, "Kernel instance"):
      contract.outside_suite(PlainSoftmax, REFUSES)


if __name__ == "__main__":
  absltest.main()
