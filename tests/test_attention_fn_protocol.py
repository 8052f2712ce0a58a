"""A layer calls its ``attention_fn`` by one protocol, configured once.

``attention_fn(q, k, v, mask, **options)``: the mask one ``aj.Mask``, each
option only when the call uses it; no signature is read. A kernel choice
is ``scaled_dot_product_attention`` with that implementation. What a
function cannot honour is refused (Python's TypeError, annotated with what
the layer passed), never dropped; a bad ``attention_fn`` is refused when the
layer is built.
"""

from __future__ import annotations

import functools
import inspect
from unittest import mock

from absl.testing import absltest
import chex
from flax import nnx
import jax.numpy as jnp

import attention_jax as aj
from attention_jax.layers import attention_fn as attention_fn_lib
from tests import _data

D, N = 8, 2


def _mine(query, key, value, mask):
  return aj.scaled_dot_product_attention(query, key, value, mask)


class ProtocolTest(chex.TestCase):

  def test_no_signature_is_read(self):
    real, reads = inspect.signature, []

    def signature(fn, *args, **kwargs):  # counts the reads of _mine only
      if fn is _mine:
        reads.append(fn)
      return real(fn, *args, **kwargs)

    with mock.patch.object(inspect, "signature", side_effect=signature):
      layer = aj.MultiHeadAttention(D, N, attention_fn=_mine,
                                    rngs=nnx.Rngs(0))
      x = _data.normal(0, (1, 3, D))
      out = layer(x, is_causal=True)
    self.assertEqual(reads, [])
    want = aj.MultiHeadAttention(D, N, rngs=nnx.Rngs(0))(x, is_causal=True)
    chex.assert_trees_all_close(out, want, atol=1e-6)

  def test_options_only_when_in_play(self):
    seen = []

    def spy(q, k, v, mask, **options):
      seen.append((mask, sorted(options)))
      return aj.scaled_dot_product_attention(q, k, v, mask, **options)

    x = _data.normal(1, (2, 3, D))
    aj.MultiHeadAttention(D, N, attention_fn=spy, rngs=nnx.Rngs(0))(x)
    layer = aj.MultiHeadAttention(D, N, attention_fn=spy, scale=0.3,
                                  logits_soft_cap=5.0, attention_sinks=True,
                                  dropout_rate=0.1, rngs=nnx.Rngs(0))
    layer(x, bias=jnp.zeros((1, 1, 3, 3)), return_lse=True)
    (plain, none), (_, options) = seen
    self.assertIsInstance(plain, aj.Mask)  # an empty Mask, never None
    self.assertEqual(none, [])
    self.assertEqual(options, ["bias", "dropout_rate", "dropout_rng",
                               "return_lse", "scale", "score_mod", "sinks"])

  def test_a_kernel_choice_is_an_implementation(self):
    fn = attention_fn_lib.as_attention_fn(aj.kernels.Dense())
    self.assertIsInstance(fn, attention_fn_lib.Implementation)
    q = _data.normal(2, (1, 2, 4, 8))
    chex.assert_trees_all_close(
        fn(q, q, q, aj.Mask(causal=True)),
        aj.scaled_dot_product_attention(q, q, q, is_causal=True,
                                        implementation="dense"), atol=0)

  def test_a_bad_attention_fn_is_refused_when_built(self):
    with self.assertRaisesRegex(TypeError, "attention_fn is the class"):
      aj.MultiHeadAttention(D, N, attention_fn=aj.kernels.Dense,
                            rngs=nnx.Rngs(0))
    with self.assertRaisesRegex(TypeError, "implementations to try"):
      aj.MultiHeadAttention(D, N, attention_fn=["flash", _mine],
                            rngs=nnx.Rngs(0))
    fixed = functools.partial(aj.scaled_dot_product_attention, scale=0.3)
    with self.assertRaisesRegex(ValueError, "set the scale in one place"):
      aj.MultiHeadAttention(D, N, attention_fn=fixed, scale=0.5,
                            rngs=nnx.Rngs(0))

  def test_a_reassigned_attention_fn_is_used(self):
    layer = aj.MultiHeadAttention(D, N, logits_soft_cap=5.0,
                                  rngs=nnx.Rngs(0))
    x = _data.normal(1, (1, 3, D))
    layer(x)
    layer.attention_fn = _mine  # takes no score_mod: refused, by name
    with self.assertRaisesRegex(TypeError, "unexpected keyword argument "
                                "'score_mod'") as caught:
      layer(x)
    self.assertIn("score_mod=...", caught.exception.__notes__[0])

  def test_a_wrong_number_of_results_is_refused(self):
    layer = aj.MultiHeadAttention(
        D, N, attention_fn=lambda q, k, v, mask, **kw: q, rngs=nnx.Rngs(0))
    with self.assertRaisesRegex(TypeError, r"returned 1 value\(s\), but this "
                                r"call asked for \(out, weights\)"):
      layer(_data.normal(1, (1, 3, D)), return_weights=True)

  def test_under_nnx_jit(self):
    layer = aj.MultiHeadAttention(D, N, attention_fn=_mine, rngs=nnx.Rngs(0))
    x = _data.normal(3, (1, 3, D))
    got = nnx.jit(lambda m, x: m(x))(layer, x)
    chex.assert_trees_all_close(got, layer(x), atol=1e-6)


if __name__ == "__main__":
  absltest.main()
