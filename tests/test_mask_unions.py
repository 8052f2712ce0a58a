"""Unions of masks whose members carry lengths, windows and causality.

A union ``a | b`` is evaluated elementwise (``Mask.evaluate`` per member):
each member's fields are restated there, apart from the kernels' own
field-by-field code, so each is checked here against a brute-force NumPy
mask written from the definitions, with ``T != S`` (the bottom-right offset
of causality and windows) as well as ``T == S``.

Shape glossary: B batch, N heads, T query length, S key length, H head dim.
"""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from tests import _data
from tests import reference

B, N, H = 2, 2, 8
KV_LENGTHS = np.array([10, 5])
Q_LENGTHS = np.array([3, 6])
PREFIX = 3


def _brute(t: int, s: int, causal=False, window=None, kv_lengths=None,
           q_lengths=None, prefix=None):
  """``[B, T, S]`` from the definitions: bottom-right alignment (query i
  sits at key position i + S - T), window (left, right) around it."""
  q = np.arange(t)[None, :, None] + (s - t)  # [1, T, 1] key position
  k = np.arange(s)[None, None, :]  # [1, 1, S]
  ok = np.ones((B, t, s), bool)
  if causal:
    ok &= k <= q
  if window is not None:
    left, right = window
    ok &= (k >= q - left) & (k <= q + right)
  if kv_lengths is not None:
    ok &= k < kv_lengths[:, None, None]
  if q_lengths is not None:
    ok &= np.arange(t)[None, :, None] < q_lengths[:, None, None]
  if prefix is not None:
    ok &= k < prefix
  return ok


def _prefix_rule(b, h, q_idx, kv_idx):
  del b, h, q_idx
  return kv_idx < PREFIX


# (name, members as Mask fields; a member's "prefix" is the rule).
UNIONS = (
    ("causal_kv_lengths_or_prefix",
     dict(causal=True, kv_lengths=KV_LENGTHS), dict(prefix=PREFIX)),
    ("window_or_kv_lengths", dict(causal=True, window=(2, 0)),
     dict(kv_lengths=KV_LENGTHS)),
    ("two_sided_window_q_lengths_or_causal",
     dict(window=(1, 2), q_lengths=Q_LENGTHS), dict(causal=True)),
    ("causal_or_window_with_lengths",
     dict(causal=True, kv_lengths=KV_LENGTHS - 2),
     dict(window=(0, 1), kv_lengths=KV_LENGTHS)),
)


def _as_mask(fields):
  fields = dict(fields)
  if "prefix" in fields:
    fields.pop("prefix")
    fields["rule"] = _prefix_rule
  for name in ("kv_lengths", "q_lengths"):
    if name in fields:
      fields[name] = jnp.asarray(fields[name])
  return aj.Mask(**fields)


class MaskUnionTest(chex.TestCase):

  @parameterized.product(union=UNIONS, lengths=((16, 16), (6, 16)))
  def test_union_equals_brute_force(self, union, lengths):
    name, a, b = union
    t, s = lengths
    allowed = _brute(t, s, **a) | _brute(t, s, **b)  # [B, T, S]
    mask = _as_mask(a) | _as_mask(b)
    q = _data.normal(1, (B, N, t, H))
    k, v = _data.normal(2, (B, N, s, H)), _data.normal(3, (B, N, s, H))
    # The dense kernel's weights are exactly 0 where a key is masked (and
    # positive elsewhere: softmax of finite logits).
    _, weights = jax.jit(lambda q, k, v, m: aj.scaled_dot_product_attention(
        q, k, v, m, implementation="dense", return_weights=True))(
            q, k, v, mask)
    np.testing.assert_array_equal(np.asarray(weights) > 0,
                                  np.broadcast_to(allowed[:, None],
                                                  weights.shape), err_msg=name)
    # The blockwise kernel, at blocks that cut the bands, against float64.
    out = jax.jit(lambda q, k, v, m: aj.scaled_dot_product_attention(
        q, k, v, m, implementation=aj.kernels.Flash(block_q=4, block_k=5)))(
            q, k, v, mask)
    f64 = lambda x: np.asarray(x, np.float64)
    with jax.enable_x64(True):
      want, _ = reference.masked_attention(
          f64(q), f64(k), f64(v), None,
          np.broadcast_to(allowed[:, None], (B, N, t, s)))
    # float32 blockwise sums against float64: a few ulps of O(1) values.
    np.testing.assert_allclose(f64(out), np.asarray(want), atol=2e-6,
                               rtol=2e-6, err_msg=name)


if __name__ == "__main__":
  absltest.main()
