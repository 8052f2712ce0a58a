"""MultiHeadAttention's options for ported models: output gate, positions,
each rotary variant while decoding, lse / max logits, cross-attention cache.

Every expected value comes from ``tests/reference.py`` (float64 NumPy of
the lesson's equations) or from the module's own uncached forward, which
that reference checks elsewhere.
"""

from absl.testing import absltest
from absl.testing import parameterized
import chex
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.layers import multi_head
from experiments import transformer
from tests import reference

# float32 through four 16x16 matmuls and a softmax against float64: errors
# ~1e-6 (as in test_modules_multi_head.py).
TOL = dict(atol=2e-5, rtol=2e-5)
# Decoding against the full forward, both float32, same maths over other
# shapes: only reduction order differs.
STEP_TOL = dict(atol=3e-6, rtol=3e-6)


def _module(**kwargs):
  kwargs.setdefault("num_kv_heads", 2)
  return aj.MultiHeadAttention(16, 4, rngs=nnx.Rngs(0), **kwargs)


def _x(seed=0, b=2, t=6):
  return jax.random.normal(jax.random.key(seed), (b, t, 16))


@nnx.jit
def _decode(mha, x, extra):
  return mha(x, decode=True, **extra)


def _prefill_then_steps(mha, x, splits=(4, 5), **call):
  """Decodes ``x`` in chunks ``[0, 4), [4, 5), [5, T)``; outputs joined.

  Jitted (two shapes: the prefill and single steps), as decoding runs.
  """
  mha.init_cache(batch_size=x.shape[0], max_length=x.shape[1] + 2)
  bounds = (0, *splits, x.shape[1])
  pieces = []
  for start, stop in zip(bounds[:-1], bounds[1:]):
    extra = {k: v(start, stop) for k, v in call.items()}
    pieces.append(_decode(mha, x[:, start:stop], extra))
  return jnp.concatenate(pieces, 1)


class OutputGateTest(parameterized.TestCase):

  @parameterized.parameters("elementwise", "headwise")
  def test_matches_the_numpy_equations(self, gate):
    mha = _module(output_gate=gate)
    p = mha.params_dict()
    g = 4 if gate == "elementwise" else 1
    self.assertEqual(p["W_g"]["kernel"].shape, (16, 4, g))  # [D, N, G]
    np.testing.assert_array_equal(p["W_g"]["bias"], 0.0)  # zero bias
    mha.W_g.bias[...] = jnp.linspace(-1.0, 1.0, 4 * g).reshape(4, g)
    x = _x()
    want, _ = reference.multi_head_attention(mha.params_dict(), x, x, x,
                                             is_causal=True)
    chex.assert_trees_all_close(mha(x, is_causal=True), want, **TOL)

  def test_decoding_equals_the_full_forward(self):
    mha = _module(output_gate="headwise")
    x = _x(seed=1)
    chex.assert_trees_all_close(_prefill_then_steps(mha, x),
                                mha(x, is_causal=True), **STEP_TOL)

  def test_params_function_adds_a_gate_without_changing_the_rest(self):
    key = jax.random.key(3)
    plain = aj.init_multi_head_params(key, 16, 4)
    gated = aj.init_multi_head_params(key, 16, 4, output_gate="elementwise")
    chex.assert_trees_all_equal({k: gated[k] for k in plain}, plain)
    x = _x(seed=2)
    want, _ = reference.multi_head_attention(gated, x, x, x)
    chex.assert_trees_all_close(aj.multi_head_attention(gated, x, x, x), want,
                                **TOL)


class PositionsTest(absltest.TestCase):

  def test_left_padded_batch_equals_each_example_alone(self):
    # Example 1 holds two pads, then the same 4 tokens as `alone`: with
    # positions starting at its first real token and its pad keys masked,
    # its real rows equal the 4 tokens attended on their own.
    mha = _module(rope=aj.Rope(base=100.0))
    x = _x(seed=4)
    alone = x[1:, 2:]
    x = x.at[1, :2].set(jnp.nan)  # pads may hold anything
    positions = jnp.array([[0, 1, 2, 3, 4, 5], [0, 0, 0, 1, 2, 3]])
    keep = jnp.array([[True] * 6, [False, False] + [True] * 4])
    mask = aj.Mask(dense=keep[:, None, None, :])  # [B, 1, 1, S]
    got = mha(x, mask=mask, is_causal=True, positions=positions)
    chex.assert_trees_all_close(got[1, 2:], mha(alone, is_causal=True)[0],
                                **STEP_TOL)
    # Decoding the padded batch: the pad slots masked over the cache.
    slots = jnp.concatenate([keep, jnp.ones((2, 2), bool)], 1)  # [B, L]
    dense = aj.Mask(dense=slots[:, None, None, :])
    x = x.at[1, :2].set(0.0)  # nothing is projected before the mask here
    steps = _prefill_then_steps(
        mha, x, mask=lambda a, b: dense,
        positions=lambda a, b: positions[:, a:b])
    chex.assert_trees_all_close(steps[1, 2:], got[1, 2:], **STEP_TOL)

  def test_custom_positions_match_numpy(self):
    mha = _module(rope=aj.Rope(base=50.0))
    x = _x(seed=5)
    pos = np.array([[3, 1, 4, 1, 5, 9], [2, 6, 5, 3, 5, 8]])
    want, _ = reference.multi_head_attention(
        mha.params_dict(), x, x, x, rope_base=50.0,
        query_positions=pos[:, None], key_positions=pos[:, None])
    chex.assert_trees_all_close(mha(x, positions=jnp.asarray(pos)), want,
                                **TOL)


class DynamicRopeTest(absltest.TestCase):

  def test_queries_and_keys_share_one_length(self):
    # Two queries at 0, 1 over 12 keys past the trained context (8): both
    # rotate with the frequencies of length 12, as transformers computes one
    # inv_freq per forward.
    rope = aj.Rope(scaling="dynamic", factor=4.0, original_max_positions=8)
    params = aj.init_multi_head_params(jax.random.key(5), 16, 4)
    x, mem = _x(seed=12, t=2), _x(seed=13, t=12)
    got = aj.multi_head_attention(params, x, mem, mem, rope=rope,
                                  positions=jnp.arange(2),
                                  kv_positions=jnp.arange(12))
    heads = lambda name, y: multi_head.project_heads(y, params[name])
    q = aj.apply_rope(heads("W_q", x), jnp.arange(2), rope=rope, seq_len=12)
    k = aj.apply_rope(heads("W_k", mem), jnp.arange(12), rope=rope,
                      seq_len=12)
    out = aj.scaled_dot_product_attention(q, k, heads("W_v", mem))
    want = multi_head.output_projection(out, params["W_o"])
    chex.assert_trees_all_close(got, want, **STEP_TOL)


class RopeVariantsDecodeTest(parameterized.TestCase):
  # The cached path rotates each key once, at its own step, with the same
  # description: it must equal rotating the whole sequence at once.

  @parameterized.named_parameters(
      ("linear", aj.Rope(scaling="linear", factor=4.0)),
      ("llama3", aj.Rope(base=500.0, scaling="llama3", factor=8.0,
                         original_max_positions=4)),
      ("yarn", aj.Rope(scaling="yarn", factor=4.0, original_max_positions=4,
                       truncate=False)),
      ("interleaved_partial", aj.Rope(interleaved=True, fraction=0.5)),
      # Within the original context dynamic NTK is the plain formula; past
      # it a cache keeps each key at its step's frequencies (as transformers
      # does), which no full forward reproduces.
      ("dynamic_within_context", aj.Rope(scaling="dynamic", factor=2.0,
                                         original_max_positions=16)))
  def test_decoding_equals_the_full_forward(self, rope):
    mha = _module(rope=rope)
    x = _x(seed=6)
    chex.assert_trees_all_close(_prefill_then_steps(mha, x),
                                mha(x, is_causal=True), **STEP_TOL)


def _scaled_logits(mha, x):
  """float64 ``scale * q . k`` per head ``[B, N, T, S]`` from the params."""
  p = {k: jax.tree.map(lambda a: np.asarray(a, np.float64), v)
       for k, v in mha.params_dict().items()}
  q = np.einsum("btd,dnh->bnth", x, p["W_q"]["kernel"]) + p["W_q"]["bias"][
      None, :, None]
  k = np.einsum("btd,dnh->bnth", x, p["W_k"]["kernel"]) + p["W_k"]["bias"][
      None, :, None]
  k = np.repeat(k, 2, axis=1)  # N=4 query heads over K=2
  return np.einsum("bnth,bnsh->bnts", q, k) / np.sqrt(4.0)


class LseAndMaxLogitsTest(absltest.TestCase):

  def test_lse_matches_numpy(self):
    mha = _module()
    x = np.asarray(_x(seed=7), np.float64)
    logits = _scaled_logits(mha, x)
    logits = np.where(reference.causal(6, 6), logits, -np.inf)
    top = logits.max(-1, keepdims=True)
    want = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[..., 0]
    _, lse = mha(jnp.asarray(x, jnp.float32), is_causal=True,
                 return_lse=True)
    chex.assert_trees_all_close(lse, want, **TOL)

  def test_max_logits_are_raw_and_come_last(self):
    # Before the soft cap (the raw maxima here exceed it) and after lse.
    mha = _module(logits_soft_cap=0.5)
    x = np.asarray(_x(seed=8), np.float64) * 3.0
    logits = np.where(reference.causal(6, 6), _scaled_logits(mha, x),
                      -np.inf)
    out, lse, top = mha(jnp.asarray(x, jnp.float32), is_causal=True,
                        return_lse=True, return_max_logits=True)
    self.assertGreater(float(np.max(top)), 0.5)
    chex.assert_trees_all_close(top, logits.max(-1), **TOL)
    chex.assert_trees_all_close(out, mha(jnp.asarray(x, jnp.float32),
                                         is_causal=True), atol=0, rtol=0)
    self.assertEqual(lse.shape, (2, 4, 6))


class CrossAttentionCacheTest(absltest.TestCase):

  def test_decoding_over_the_stored_memory_equals_projecting_it(self):
    cross = _module(normalize_qk=True, kv_features=8)
    memory = jax.random.normal(jax.random.key(8), (2, 5, 8))
    mask = aj.Mask(kv_lengths=jnp.array([5, 3]))
    x = _x(seed=9, t=3)
    want, want_w = cross(x, memory, mask=mask, return_weights=True)
    cross.init_cross_cache(memory)
    self.assertEqual(cross.memory_key.shape, (2, 2, 5, 4))  # [B, K, S, H]
    step = nnx.jit(lambda m, x, mask: m(x, mask=mask, decode=True,
                                        return_weights=True))
    pieces = [step(cross, x[:, i:i + 1], mask) for i in range(3)]
    got = jnp.concatenate([o for o, _ in pieces], 1)
    got_w = jnp.concatenate([w for _, w in pieces], 2)
    chex.assert_trees_all_close(got_w, want_w, **STEP_TOL)
    chex.assert_trees_all_close(got, want, **STEP_TOL)

  def test_masked_memory_rows_may_hold_nan_with_a_dense_mask(self):
    cross = _module()
    memory = _x(seed=10, t=5)
    keep = jnp.array([[True] * 5, [True] * 3 + [False] * 2])
    mask = keep[:, None, None, :]  # [B, 1, 1, S]
    want = cross(_x(seed=11, t=2), memory, mask=mask)
    cross.init_cross_cache(memory.at[1, 3:].set(jnp.nan))
    got = cross(_x(seed=11, t=2), mask=mask, decode=True)
    chex.assert_trees_all_close(got, want, **STEP_TOL)

  def test_the_transformer_experiment_decodes_as_it_is_taught(self):
    # Greedy decoding (cached self-attention, memory projected once) picks
    # the argmax of the teacher-forced logits at every step.
    model = transformer.TransformerSeq2Seq(
        transformer.TransformerConfig(d_model=16, num_heads=2, num_layers=1,
                                      ffn_dim=16), vocab_size=5,
        rngs=nnx.Rngs(0))
    src = jnp.array([[3, 4, 5, 6], [7, 5, 3, 0]])
    src_len = jnp.array([4, 3])
    tokens, _ = transformer.greedy(model, src, src_len, 4)
    tgt_in = jnp.concatenate([jnp.ones((2, 1), jnp.int32), tokens[:, :-1]], 1)
    logits, _ = model(src, src_len, tgt_in)  # BOS, then its own choices
    np.testing.assert_array_equal(jnp.argmax(logits, -1), tokens)

  def test_refusals(self):
    cross = _module()
    cross.init_cross_cache(_x(t=5))
    with self.assertRaisesRegex(ValueError, "pass no key/value"):
      cross(_x(t=1), _x(t=5), decode=True)
    with self.assertRaisesRegex(ValueError, "rope=None"):
      _module(rope=aj.Rope(base=10000.0)).init_cross_cache(_x(t=5))
    with self.assertRaisesRegex(ValueError, "kv_features=16"):
      cross.init_cross_cache(jnp.ones((2, 5, 8)))


class ValidationTest(absltest.TestCase):

  def test_refusals_name_the_argument(self):
    x = _x()
    with self.assertRaisesRegex(ValueError, "rope=None"):
      _module()(x, positions=jnp.arange(6))
    with self.assertRaisesRegex(ValueError, r"positions has shape \(5,\)"):
      _module(rope=aj.Rope(base=10.0))(x, positions=jnp.arange(5))
    with self.assertRaisesRegex(TypeError, "integer array"):
      _module(rope=aj.Rope(base=10.0))(x, positions=jnp.arange(6.0))
    with self.assertRaisesRegex(ValueError, "pass kv_positions"):
      _module(rope=aj.Rope(base=10.0))(x, _x(t=4), positions=jnp.arange(6))
    with self.assertRaisesRegex(ValueError, "pass kv_positions"):  # S == T
      _module(rope=aj.Rope(base=10.0))(x, _x(seed=1), positions=jnp.arange(6))
    with self.assertRaisesRegex(ValueError, "rotates no features"):
      _module(rope=aj.Rope(fraction=0.1))  # at construction, H = 4
    with self.assertRaisesRegex(TypeError, "returned 1 value"):
      _module(attention_fn=lambda q, k, v, mask, **kw: aj.attend_heads(
          q, k, v))(x, return_lse=True)
    with self.assertRaisesRegex(ValueError, "output_gate must be"):
      _module(output_gate="sigmoid")
    mha = _module(rope=aj.Rope(base=10.0))
    mha.init_cache(2, 8)
    with self.assertRaisesRegex(ValueError, "while decoding"):
      mha(x, decode=True, kv_positions=jnp.arange(6))


if __name__ == "__main__":
  absltest.main()
