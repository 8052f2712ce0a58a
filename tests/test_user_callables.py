"""What a call hands the kernels is checked once, at the call.

Score modifiers must be elementwise (``elementwise``: a jaxpr walk), rules
must return booleans and ``scale`` must be a positive finite number: each
refused with one message whatever kernel would run, since otherwise the
answer would move with the automatic choice (dense below T * S = 1024**2,
blockwise above). Elementwise modifiers written in every usual way stay
accepted and give the same numbers in both kernels.

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

Q = _data.normal(1, (1, 2, 6, 8))  # [B, N, T, H]
KV = _data.normal(2, (1, 2, 7, 8))  # [B, N, S, H]
TABLE = _data.normal(3, (6, 7))  # [T, S]: read at (q_idx, kv_idx)
KERNELS = ("dense", aj.kernels.Flash(block_q=4, block_k=3), None)

MIXING = (
    ("sum", lambda s, b, h, q, k: s.sum(), "returned shape ()"),
    ("row_std", lambda s, b, h, q, k: s / s.std(-1, keepdims=True),
     "applies 'reduce_sum'"),
    ("row_max", lambda s, b, h, q, k: s - s.max(-1, keepdims=True),
     "applies 'reduce_max'"),
    ("sort", lambda s, b, h, q, k: jnp.sort(s, -1), "applies 'sort'"),
    ("cumsum", lambda s, b, h, q, k: jnp.cumsum(s, -1), "applies 'cumsum'"),
    ("reversed", lambda s, b, h, q, k: s[:, ::-1], "applies 'rev'"),
    ("matmul", lambda s, b, h, q, k: s @ jnp.ones((7, 7)),
     "applies 'dot_general'"),
    ("transposed", lambda s, b, h, q, k: (s.T @ jnp.eye(6)).T,
     "applies 'transpose'"),
    ("reshaped", lambda s, b, h, q, k: s.reshape(s.shape[::-1]).reshape(
        s.shape), "applies 'reshape'"),
    # An array of the whole [T, S] added as it is: right in the dense
    # kernel only (a block is not [T, S]).
    ("whole_table", lambda s, b, h, q, k: s + TABLE,
     r"returned shape \(6, 7\) for score \[1, 1\]"),
    ("bool", lambda s, b, h, q, k: s > 0, "must return float scores"),
)

ELEMENTWISE = (
    ("where", lambda s, b, h, q, k: jnp.where(k > q + 1, -jnp.inf, s)),
    ("softplus", lambda s, b, h, q, k: jax.nn.softplus(s) - 1.0),
    ("table_at_indices", lambda s, b, h, q, k: s + TABLE[q, k]),
    ("per_head", lambda s, b, h, q, k: s * (1.0 + h)),
    ("checkpointed", lambda s, b, h, q, k: jax.checkpoint(jnp.tanh)(s)),
    ("cond_on_head", lambda s, b, h, q, k: jax.lax.cond(
        h > 0, lambda x: 2.0 * x, lambda x: x, s)),
    ("size_one_axes", lambda s, b, h, q, k: s[None, :, :, None][0, ..., 0]),
    ("table_at_score", lambda s, b, h, q, k: s + jnp.arange(4.0)[
        jnp.clip(s, 0, 3).astype(jnp.int32)]),
)


def _attend(mod, kernel, **kw):
  return aj.scaled_dot_product_attention(Q, KV, KV, score_mod=mod,
                                         implementation=kernel, **kw)


class ScoreModTest(chex.TestCase):

  @parameterized.named_parameters(*MIXING)
  def test_non_elementwise_is_refused_alike(self, mod, pattern):
    messages = set()
    for kernel in KERNELS:
      for jit in (False, True):
        fn = jax.jit(_attend, static_argnums=(0, 1)) if jit else _attend
        with self.assertRaisesRegex((ValueError, TypeError), pattern) as e:
          fn(mod, kernel)
        messages.add(str(e.exception))
    self.assertLen(messages, 1)  # one message, whatever the kernel

  @parameterized.named_parameters(*ELEMENTWISE)
  def test_elementwise_is_accepted_and_kernels_agree(self, mod):
    dense = _attend(mod, "dense")
    blockwise = _attend(mod, aj.kernels.Flash(block_q=4, block_k=3))
    # Both are float32 softmaxes of the same scores, summed in different
    # orders: a few ulps of O(1) outputs.
    chex.assert_trees_all_close(dense, blockwise, atol=1e-5, rtol=1e-5)

  def test_closure_over_traced_arrays_is_checked_under_jit(self):
    f = jax.jit(lambda table: _attend(
        lambda s, b, h, q, k: s + table.sum(), "dense"))
    # The table's sum does not read the scores: elementwise in them.
    chex.assert_shape(f(TABLE), (1, 2, 6, 8))
    g = jax.jit(lambda table: _attend(
        lambda s, b, h, q, k: s + table * s.mean(), "dense"))
    with self.assertRaisesRegex(ValueError, "not elementwise"):
      g(TABLE)


class RuleTest(chex.TestCase):

  @parameterized.named_parameters(
      ("int", lambda b, h, q, k: (k <= q).astype(jnp.int32)),
      ("float", lambda b, h, q, k: jnp.where(k <= q, 1.0, 0.0)),
  )
  def test_non_boolean_rule_is_refused_alike(self, rule):
    messages = set()
    for mask in (aj.Mask(rule=rule), aj.Mask(causal=True) | aj.Mask(
        rule=rule), aj.Mask(rule=aj.MaskRule(
            lambda b, h, q, k, p: rule(b, h, q, k), None))):
      for kernel in KERNELS:
        with self.assertRaisesRegex(TypeError, "must return a bool array"
                                    ) as e:
          aj.scaled_dot_product_attention(Q, KV, KV, mask,
                                          implementation=kernel)
        messages.add(str(e.exception))
    self.assertLen(messages, 1)


class ScaleTest(chex.TestCase):

  @parameterized.named_parameters(
      ("zero", 0, ValueError), ("negative", -1.0, ValueError),
      ("nan", float("nan"), ValueError), ("inf", float("inf"), ValueError),
      ("string", "x", TypeError), ("bool", True, TypeError),
      ("zero_array", jnp.array(0.0), ValueError),
      ("nan_array", np.float32("nan"), ValueError),
      ("vector", jnp.array([1.0, 2.0]), TypeError),
      ("int_array", jnp.array(2), TypeError),
  )
  def test_bad_scale_is_refused(self, scale, error):
    with self.assertRaisesRegex(error, "scale must be"):
      aj.scaled_dot_product_attention(Q, KV, KV, scale=scale)

  @parameterized.parameters(None, "dense", aj.kernels.Flash(4, 4))
  def test_traced_scale_is_the_multiplier(self, implementation):
    # A learned scale under jit: the blockwise kernels compile their scale
    # in, so a traced one is folded into the queries; same numbers and the
    # same gradient (float32: a rounding of the product apart).
    def f(s):
      return aj.scaled_dot_product_attention(
          Q, KV, KV, scale=s, is_causal=True,
          implementation=implementation).sum()

    got, got_grad = jax.jit(jax.value_and_grad(f))(jnp.float32(0.25))
    want = aj.scaled_dot_product_attention(Q, KV, KV, scale=0.25,
                                           is_causal=True).sum()
    want_grad = jax.grad(lambda s: aj.scaled_dot_product_attention(
        Q, KV, KV, scale=s, is_causal=True, implementation="dense").sum())(
            jnp.float32(0.25))
    chex.assert_trees_all_close((got, got_grad), (want, want_grad),
                                atol=1e-5, rtol=1e-5)


if __name__ == "__main__":
  absltest.main()
