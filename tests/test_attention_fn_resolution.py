"""A layer's ``attention_fn`` is resolved and checked once, when it is built.

Reading a function's signature (which keywords it takes) on every call
costs Python time in every eager step and hides a bad ``attention_fn``
until the first call; the module resolves it in its constructor and only
again if the attribute is reassigned.
"""

from __future__ import annotations

import inspect
from unittest import mock

from absl.testing import absltest
import chex
from flax import nnx

import attention_jax as aj
from tests import _data

D, N = 8, 2


def _mine(query, key, value, mask=None):
  return aj.scaled_dot_product_attention(query, key, value, mask)


class ResolutionTest(chex.TestCase):

  def test_read_once_at_construction(self):
    real, reads = inspect.signature, []

    def signature(fn, *args, **kwargs):  # counts the reads of _mine only
      if fn is _mine:
        reads.append(fn)
      return real(fn, *args, **kwargs)

    with mock.patch.object(inspect, "signature", side_effect=signature):
      layer = aj.MultiHeadAttention(D, N, attention_fn=_mine,
                                    rngs=nnx.Rngs(0))
      self.assertLen(reads, 1)
      x = _data.normal(0, (1, 3, D))
      for _ in range(3):
        out = layer(x)
      self.assertLen(reads, 1)  # not once per call
    want = aj.MultiHeadAttention(D, N, rngs=nnx.Rngs(0))(x)
    chex.assert_trees_all_close(out, want, atol=1e-6)

  def test_a_bad_attention_fn_is_refused_when_built(self):
    with self.assertRaisesRegex(TypeError, "attention_fn is the class"):
      aj.MultiHeadAttention(D, N, attention_fn=aj.kernels.Dense,
                            rngs=nnx.Rngs(0))

  def test_a_reassigned_attention_fn_is_used(self):
    layer = aj.MultiHeadAttention(D, N, logits_soft_cap=5.0,
                                  rngs=nnx.Rngs(0))
    x = _data.normal(1, (1, 3, D))
    layer(x)
    layer.attention_fn = _mine  # takes no score_mod: refused by name
    with self.assertRaisesRegex(ValueError, "takes no score_mod"):
      layer(x)


if __name__ == "__main__":
  absltest.main()
