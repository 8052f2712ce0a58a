"""aj.MultiHeadAttention (Flax NNX) against the functions and the lesson."""

import functools
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import chex
from flax import linen
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import attention_jax as aj
from tests import _data
from tests import reference

# Same reasoning as test_multi_head.py: float32 through four D x D matmuls
# and a softmax against float64, errors ~1e-6.
TOL = dict(atol=2e-5, rtol=2e-5)


def _module(num_heads=4, num_kv_heads=None, seed=0, **kwargs):
  return aj.MultiHeadAttention(16, num_heads, num_kv_heads=num_kv_heads,
                               rngs=nnx.Rngs(seed), **kwargs)


def _x(seed=0, b=2, t=5, d=16):
  return _data.normal(seed, (b, t, d))


class MatchesReferencesTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("self", None, "self", False, False),
      ("self_padded", None, "self", False, True),
      ("cross_s_ne_t_padded", None, "cross", False, True),
      ("causal", None, "self", True, False),
      ("gqa_causal_padded", 2, "self", True, True),
      ("mqa_cross", 1, "cross", False, False),
  )
  def test_equals_function_and_numpy_lesson(self, kv_heads, kind, causal,
                                            padded):
    mha = _module(num_kv_heads=kv_heads)
    x = _x()
    y = x if kind == "self" else _x(seed=3, t=7)
    mask = None
    if padded:
      mask = aj.make_attention_mask(
          aj.padding_mask(jnp.array([5, 4]), 5),
          aj.padding_mask(jnp.array([y.shape[1], 2]), y.shape[1]))
    key = None if kind == "self" else y  # key=None means the query
    value = _x(seed=9, t=y.shape[1])  # distinct: W_v must project value
    out, weights = mha(x, key, value, mask=mask, is_causal=causal,
                       return_weights=True)
    params = mha.params_dict()
    fn_out, fn_weights = aj.multi_head_attention(
        params, x, y, value, mask, is_causal=causal, return_weights=True)
    chex.assert_trees_all_close((out, weights), (fn_out, fn_weights),
                                atol=0, rtol=0)
    ref_out, ref_weights = reference.multi_head_attention(
        jax.tree.map(np.asarray, params), x, y, value, mask, num_heads=4,
        num_kv_heads=kv_heads, is_causal=causal)
    chex.assert_trees_all_close(out, ref_out.astype(np.float32), **TOL)
    chex.assert_trees_all_close(weights, ref_weights.astype(np.float32),
                                **TOL)

  def test_weights_rows_sum_to_one_and_masked_are_zero(self):
    mha = _module()
    x, enc = _x(), _x(seed=5, t=6)
    key_valid = aj.padding_mask(jnp.array([6, 3]), 6)
    out, weights = mha(x, enc, mask=key_valid[:, None, None, :],
                       return_weights=True)
    chex.assert_shape((out, weights), ((2, 5, 16), (2, 4, 5, 6)))
    chex.assert_trees_all_close(weights.sum(-1), jnp.ones((2, 4, 5)),
                                atol=1e-6)
    np.testing.assert_array_equal(weights[1, :, :, 3:], 0.0)

  def test_a_custom_scale_reaches_the_logits_in_every_path(self):
    # Gemma 2's query_pre_attn_scalar: a scale other than 1/sqrt(H), given
    # to the module, the function, or fixed in an attention_fn partial,
    # and through prefill + decode steps; all against the float64 lesson.
    scale = 0.3  # 1/sqrt(H) = 0.5 here
    mha = _module(num_kv_heads=2, scale=scale)
    x, v = _x(seed=11), _x(seed=12)
    params = mha.params_dict()
    want, _ = reference.multi_head_attention(
        jax.tree.map(np.asarray, params), x, x, v, is_causal=True,
        scale=scale)
    want = want.astype(np.float32)
    default, _ = reference.multi_head_attention(
        jax.tree.map(np.asarray, params), x, x, v, is_causal=True)
    self.assertGreater(np.abs(want - default).max(), 1e-2)  # it matters
    partial = functools.partial(aj.scaled_dot_product_attention, scale=scale)
    got = {
        "module": mha(x, x, v, is_causal=True),
        "function": aj.multi_head_attention(params, x, x, v, scale=scale,
                                            is_causal=True),
        "partial": aj.multi_head_attention(params, x, x, v, is_causal=True,
                                           attention_fn=partial),
        "flash": aj.multi_head_attention(
            params, x, x, v, scale=scale, is_causal=True,
            attention_fn="flash"),
    }
    for name, out in got.items():
      chex.assert_trees_all_close(out, want, **TOL, custom_message=name)
    want_self, _ = reference.multi_head_attention(
        jax.tree.map(np.asarray, params), x, x, x, is_causal=True,
        scale=scale)
    mha.init_cache(batch_size=2, max_length=6)
    step = nnx.jit(lambda m, x: m(x, decode=True))
    steps = [step(mha, x[:, :3]), step(mha, x[:, 3:4]), step(mha, x[:, 4:])]
    chex.assert_trees_all_close(jnp.concatenate(steps, 1),
                                want_self.astype(np.float32), **TOL)
    with self.assertRaisesRegex(ValueError, "set the scale in one place"):
      aj.multi_head_attention(params, x, x, v, scale=0.5,
                              attention_fn=partial)
    for bad, error in ((0.0, ValueError), ("0.1", TypeError),
                       (jnp.float32(-0.1), ValueError), (jnp.ones(2), TypeError)):
      with self.assertRaisesRegex(error, "scale"):
        _module(scale=bad)

  def test_a_custom_attention_fn_refuses_what_it_cannot_take(self):
    # The docs' jax.nn adapter takes the mask (one aj.Mask, turned into
    # jax.nn's keywords, a window among them): a windowed layer runs through
    # it and equals ours. What it cannot take (a soft cap: a score modifier)
    # it refuses, Python's TypeError naming it, with a note saying what the
    # layer passed: never dropped.
    def jax_nn_attention(q, k, v, mask, *, bias=None, scale=None):
      swap = lambda x: jnp.swapaxes(x, 1, 2)
      extra = mask.jax_nn_arguments(q.shape[2], k.shape[2])
      return swap(jax.nn.dot_product_attention(
          swap(q), swap(k), swap(v), bias=bias, scale=scale, **extra))

    x = _x(seed=13)
    window = aj.Mask(causal=True, window=(2, 0))
    ours = _module(num_kv_heads=2, mask=window)
    theirs = _module(num_kv_heads=2, mask=window,
                     attention_fn=jax_nn_attention)
    chex.assert_trees_all_close(theirs(x, is_causal=True),
                                ours(x, is_causal=True), atol=1e-6,
                                rtol=1e-6)
    capped = _module(logits_soft_cap=2.0, attention_fn=jax_nn_attention)
    with self.assertRaisesRegex(
        TypeError, r"unexpected keyword argument 'score_mod'") as caught:
      capped(x)
    self.assertIn("attention_fn jax_nn_attention was called as (q, k, v, "
                  "mask, score_mod=...)", caught.exception.__notes__[0])

  def test_a_plain_score_mod_is_static_under_nnx_jit(self):
    # A function (not an aj.ScoreMod) is part of the layer's structure, not
    # its state: nnx.jit and split/merge work, and the numbers are ALiBi's.
    slopes = aj.alibi_slopes(4)
    plain = lambda s, b, h, qi, ki: s - slopes[h] * (qi - ki)
    mha = _module(score_mod=plain)
    x = _x(seed=15)
    want = _module(score_mod=aj.alibi(slopes))(x, is_causal=True)
    got = nnx.jit(lambda m, x: m(x, is_causal=True))(mha, x)
    chex.assert_trees_all_close(got, want, atol=1e-6, rtol=1e-6)
    graph, state = nnx.split(mha)
    chex.assert_trees_all_close(
        jax.jit(lambda s, x: nnx.merge(graph, s)(x, is_causal=True))(state, x),
        want, atol=1e-6, rtol=1e-6)

  def test_t5_bias_learns_and_decodes(self):
    # The layer's table is a parameter the loss reaches (the contract checks
    # its gradient against float64); the layer equals the function with
    # aj.t5_relative_bias over the same table; a causal T5 layer decodes
    # as its full forward (absolute positions, not cache slots).
    settings = aj.T5Bias(num_buckets=8, max_distance=16, bidirectional=False)
    mha = _module(num_kv_heads=2, t5_bias=settings)
    self.assertEqual(mha.t5_table.shape, (8, 4))
    x = _x(seed=14, t=7)
    params = mha.params_dict()  # its table applied here by hand instead
    table = params.pop("t5_bias")["table"]
    want = aj.multi_head_attention(
        params, x, x, x, is_causal=True,
        score_mod=aj.t5_relative_bias(table, max_distance=16,
                                      bidirectional=False))
    full = mha(x, is_causal=True)
    chex.assert_trees_all_close(full, want, atol=0, rtol=0)
    grads = nnx.grad(lambda m: jnp.sum(m(x, is_causal=True) ** 2))(mha)
    # Exactly the buckets of the causal distances 0..6 get gradients.
    rel = np.arange(7)[None, :] - np.arange(7)[:, None]  # kv - q
    used = set(np.asarray(aj.t5_buckets(
        rel[rel <= 0], num_buckets=8, max_distance=16,
        bidirectional=False)).tolist())
    reached = np.abs(np.asarray(grads["t5_table"][...])).sum(-1) > 0
    self.assertEqual(set(np.flatnonzero(reached).tolist()), used)
    # A prefill, one step, a chunk; the prefill and the chunk have one
    # length, so the chunk reuses the prefill's program.
    mha.init_cache(batch_size=2, max_length=9)
    step = nnx.jit(lambda m, x: m(x, decode=True))
    pieces = [step(mha, x[:, :3]), step(mha, x[:, 3:4]), step(mha, x[:, 4:])]
    chex.assert_trees_all_close(jnp.concatenate(pieces, 1), full, atol=2e-6,
                                rtol=2e-6)
    with self.assertRaisesRegex(TypeError, r"t5_bias must be an aj\.T5Bias"):
      _module(t5_bias=32)
    with self.assertRaisesRegex(ValueError, r"at least 2 buckets per "
                                r"direction"):
      aj.T5Bias(num_buckets=2)

  def test_value_defaults_to_key(self):
    mha, x, enc = _module(), _x(), _x(seed=5, t=6)
    chex.assert_trees_all_close(mha(x, enc), mha(x, enc, enc), atol=0, rtol=0)

  def test_attention_fn_is_used(self):
    calls = []

    def spy(q, k, v, mask, **options):  # is_causal is folded into the mask
      calls.append(mask.causal)
      return aj.scaled_dot_product_attention(q, k, v, mask, **options)

    mha = _module(attention_fn=spy)
    plain = _module()
    x = _x()
    chex.assert_trees_all_close(mha(x, is_causal=True),
                                plain(x, is_causal=True), atol=0, rtol=0)
    self.assertEqual(calls, [True])


class KVCacheTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("mha", None, {}), ("gqa", 2, {}),
      ("mqa_qk_norm_rope_head_dim", 1, dict(head_dim=6, normalize_qk=True,
                                            rope=aj.Rope(base=100.0))))
  def test_prefill_then_steps_equals_full_causal(self, kv_heads, options):
    mha = _module(num_kv_heads=kv_heads, **options)
    x = _x(t=8)
    full, full_w = mha(x, is_causal=True, return_weights=True)
    mha.init_cache(batch_size=2, max_length=10)
    self.assertEqual(mha.cached_key.shape,
                     (2, kv_heads or 4, 10, options.get("head_dim", 4)))
    step = nnx.jit(functools.partial(type(mha).__call__, decode=True,
                                     return_weights=True))
    pieces, weights = [], []
    for start, stop in ((0, 5), (5, 6), (6, 7), (7, 8)):  # prefill 5, then 1s
      out, w = step(mha, x[:, start:stop])
      pieces.append(out)
      weights.append(w[..., :8])
    chex.assert_trees_all_close(jnp.concatenate(pieces, 1), full, atol=2e-6,
                                rtol=2e-6)
    chex.assert_trees_all_close(jnp.concatenate(weights, 2), full_w,
                                atol=2e-6, rtol=2e-6)
    np.testing.assert_array_equal(mha.cache_index[...], [8, 8])

  # A window with ALiBi alone is covered by the ring-buffer test below.
  @parameterized.named_parameters(
      ("sinks_softcap", dict(attention_sinks=True, logits_soft_cap=2.0),
       None),
      ("query_lengths", {}, jnp.array([8, 6])),
      ("everything", dict(mask=aj.Mask(causal=True, window=(3, 0)),
                          attention_sinks=True, logits_soft_cap=1.5,
                          score_mod=aj.alibi(aj.alibi_slopes(4))), None))
  def test_decoding_equals_full_forward_under_patterns(self, layer,
                                                       q_lengths):
    # Window, sinks, soft cap, ALiBi (absolute positions) and query lengths
    # hold over cache slots exactly as in the full causal forward.
    mha = _module(num_kv_heads=2, **layer)
    if mha.sinks is not None:  # non-zero sinks, so they matter
      mha.sinks[...] = jnp.array([0.5, -1.0, 2.0, 0.0])
    x = _x(seed=3, t=8)
    mask = None if q_lengths is None else aj.Mask(q_lengths=q_lengths)
    full = mha(x, mask=mask, is_causal=True)
    mha.init_cache(batch_size=2, max_length=11)
    step = nnx.jit(lambda m, x, n: m(
        x, mask=None if n is None else aj.Mask(q_lengths=n), decode=True))
    pieces = []
    for start, stop in ((0, 5), (5, 6), (6, 8)):
      n = None
      if q_lengths is not None:  # this call's rows of the lengths
        n = jnp.clip(q_lengths - start, 0, stop - start)
      pieces.append(step(mha, x[:, start:stop], n))
    chex.assert_trees_all_close(jnp.concatenate(pieces, 1), full, atol=2e-6,
                                rtol=2e-6)

  def test_rope_equals_rotating_projected_heads_by_hand(self):
    # Independent of the module's path: project with plain matmuls, rotate
    # with apply_rope (itself tested against NumPy), attend, project out.
    mha = _module(num_kv_heads=2, rope=aj.Rope(base=500.0))
    x = _x(seed=5, t=6)
    p = mha.params_dict()

    def heads(name, n):  # the lesson's flat [D, n*H] matrix, split after
      kernel = p[name]["kernel"].reshape(16, n * 4)
      y = x @ kernel + p[name]["bias"].reshape(-1)[None, None]  # [B, T, n*H]
      return jnp.swapaxes(y.reshape(2, 6, n, 4), 1, 2)  # [B, n, T, H]

    pos = jnp.arange(6)
    q = aj.apply_rope(heads("W_q", 4), pos, rope=aj.Rope(base=500.0))
    k = aj.apply_rope(heads("W_k", 2), pos, rope=aj.Rope(base=500.0))
    out = aj.scaled_dot_product_attention(q, k, heads("W_v", 2),
                                          is_causal=True)
    out = jnp.swapaxes(out, 1, 2).reshape(2, 6, 16)
    want = out @ p["W_o"]["kernel"].reshape(16, 16) + p["W_o"]["bias"][
        None, None]
    chex.assert_trees_all_close(mha(x, is_causal=True), want, atol=2e-6,
                                rtol=2e-6)

  def test_rope_queries_after_their_keys_and_chunked_prefill(self):
    # T < S: the last two tokens' queries over all six keys stand at
    # positions 4 and 5 (bottom-right, as in the full forward); a prompt
    # prefilled in chunks of 4 then 2 rotates from the cache positions.
    # Both against the float64 lesson with the positions written out, and
    # with values distinct from keys.
    mha = _module(num_kv_heads=2, rope=aj.Rope(base=100.0))
    x, v = _x(seed=6, t=6), _x(seed=7, t=6)
    params = mha.params_dict()
    p64 = jax.tree.map(np.asarray, params)
    late, _ = reference.multi_head_attention(
        p64, x[:, 4:], x, v, is_causal=True, rope_base=100.0,
        query_positions=np.arange(4, 6), key_positions=np.arange(6))
    chex.assert_trees_all_close(mha(x[:, 4:], x, v, is_causal=True),
                                late.astype(np.float32), **TOL)
    chex.assert_trees_all_close(
        aj.multi_head_attention(params, x[:, 4:], x, v, is_causal=True,
                                rope=aj.Rope(base=100.0)),
        late.astype(np.float32), **TOL)
    full, _ = reference.multi_head_attention(
        p64, x, x, x, is_causal=True, rope_base=100.0,
        query_positions=np.arange(6), key_positions=np.arange(6))
    mha.init_cache(batch_size=2, max_length=8)
    step = nnx.jit(lambda m, x: m(x, decode=True))
    chunks = [step(mha, x[:, :4]), step(mha, x[:, 4:])]
    chex.assert_trees_all_close(jnp.concatenate(chunks, 1),
                                full.astype(np.float32), **TOL)

  def test_rope_positions_restart_per_packed_document(self):
    # (Rotary decoding is checked by the qk-norm/rope prefill case and the
    # ragged test; windows while decoding by the ring-buffer test.)
    mha = _module(num_kv_heads=2, rope=aj.Rope(base=10000.0),
                  mask=aj.Mask(causal=True, window=(3, 0)))
    x = _x(seed=6, t=8)
    # Packed: the second document's positions restart at 0.
    ids = jnp.array([[0, 0, 0, 1, 1, 1, 1, 1]] * 2)
    packed = mha(x, mask=aj.Mask(q_segment_ids=ids, kv_segment_ids=ids),
                 is_causal=True)
    chex.assert_trees_all_close(packed[:, 3:], mha(x[:, 3:], is_causal=True),
                                atol=2e-6, rtol=2e-6)

  def test_packed_documents_equal_separate_sequences(self):
    # Two documents packed in one row attend as if run separately.
    mha = _module(mask=None)
    x = _x(seed=4, b=1, t=9)
    ids = jnp.array([[0, 0, 0, 0, 1, 1, 1, 1, 1]])
    segments = aj.Mask(q_segment_ids=ids, kv_segment_ids=ids)
    packed = mha(x, mask=segments, is_causal=True)
    alone = jnp.concatenate([mha(x[:, :4], is_causal=True),
                             mha(x[:, 4:], is_causal=True)], 1)
    chex.assert_trees_all_close(packed, alone, atol=2e-6, rtol=2e-6)
    with self.assertRaisesRegex(ValueError, "not supported while decoding"):
      mha.init_cache(1, 9)
      mha(x, mask=segments, decode=True)

  def test_cache_respects_a_padding_mask_over_slots(self):
    mha = _module()
    x = _x(t=4, b=1)
    valid = jnp.array([[False, True, True, True]])  # left-padded prompt
    full = mha(x, mask=aj.combine_masks(valid[:, None, None, :]),
               is_causal=True)
    mha.init_cache(1, 6)
    slot_valid = jnp.array([[False, True, True, True, True, True]])
    out = mha(x, mask=slot_valid[:, None, None, :], decode=True)
    chex.assert_trees_all_close(out[:, 1:], full[:, 1:], atol=2e-6, rtol=2e-6)

  def test_no_retrace_for_single_steps(self):
    mha = _module()
    mha.init_cache(2, 6)

    @nnx.jit
    @chex.assert_max_traces(n=1)
    def step(module, token):
      return module(token, decode=True)

    x = _x(t=6)
    for i in range(6):
      step(mha, x[:, i:i + 1])
    np.testing.assert_array_equal(mha.cache_index[...], [6, 6])

  def test_overflow_is_an_error_eagerly_and_a_value_under_jit(self):
    mha = _module()
    mha.init_cache(2, 4)
    mha(_x(t=3), decode=True)
    with self.assertRaisesRegex(ValueError, r"KV cache overflow in examples "
                                r"\[0, 1\]: 3 positions are filled and this "
                                r"call brings 2 more, but max_length is 4"):
      mha(_x(t=2), decode=True)
    # Under jit the index is traced: no host callback in the step. The
    # write is dropped (the cached tokens stay intact), the flag is kept,
    # and check_cache raises outside the step.
    before = mha.cached_key[...]
    step = nnx.jit(lambda m, x: m(x, decode=True))
    jax.block_until_ready(step(mha, _x(t=2)))
    chex.assert_trees_all_equal(mha.cached_key[...], before)
    np.testing.assert_array_equal(mha.cache_overflow[...], [True, True])
    with self.assertRaisesRegex(ValueError, r"KV cache overflow in examples "
                                r"\[0, 1\].*max_length is 4"):
      mha.check_cache()
    with self.assertRaisesRegex(ValueError, r"brings 5 tokens but max_length "
                                r"is 4"):
      step(mha, _x(t=5))

  def test_ragged_prefill_then_each_example_decodes_from_its_own_position(
      self):
    # Right-padded prompts of lengths 2 and 5, then 3 tokens each: every
    # example equals its own unpadded causal forward (RoPE positions per
    # example, GQA), and padded prompt rows neither enter the cache nor
    # shift the positions.
    mha = _module(num_kv_heads=2, rope=aj.Rope(base=100.0))
    lengths = np.array([2, 5])
    seqs = [_x(seed=20 + b, b=1, t=int(n) + 3) for b, n in enumerate(lengths)]
    prompt = jnp.concatenate(  # [B, 5, D], right-padded with zeros
        [jnp.pad(s[:, :n], ((0, 0), (0, 5 - n), (0, 0)))
         for s, n in zip(seqs, lengths.tolist())], 0)
    mha.init_cache(2, 9)
    step = nnx.jit(
        lambda m, x, n: m(x, mask=aj.Mask(q_lengths=n), decode=True))
    first = step(mha, prompt, jnp.asarray(lengths))
    np.testing.assert_array_equal(mha.cache_index[...], lengths)
    outs = [first]
    for i in range(3):
      token = jnp.concatenate([s[:, int(n) + i:int(n) + i + 1]
                               for s, n in zip(seqs, lengths)], 0)
      outs.append(nnx.jit(lambda m, x: m(x, decode=True))(mha, token))
    for b, n in enumerate(lengths):
      want = mha(seqs[b], is_causal=True)[0]  # [n + 3, D]
      got = jnp.concatenate([outs[0][b, :n]] + [o[b] for o in outs[1:]], 0)
      chex.assert_trees_all_close(got, want, atol=2e-6, rtol=2e-6)
      np.testing.assert_array_equal(outs[0][b, n:], 0.0)  # padded rows
    mha.check_cache()  # nothing overflowed

  @parameterized.named_parameters(("prefill_longer_than_buffer", 7),
                                  ("token_by_token", 1))
  def test_ring_buffer_equals_full_attention_with_the_window(self, chunk):
    # A sliding-window layer decodes with W = window + 1 slots whatever the
    # length: 15 tokens through 4 slots, with ALiBi on absolute positions.
    mha = _module(mask=aj.Mask(causal=True, window=(3, 0)),
                  score_mod=aj.alibi(aj.alibi_slopes(4)))
    x = _x(seed=7, t=15)
    full = mha(x, is_causal=True)
    mha.init_cache(2)  # ring buffer, implied by the window
    self.assertEqual(mha.cached_key.shape, (2, 4, 4, 4))  # [B, K, W, H]
    step = nnx.jit(lambda m, x: m(x, decode=True))
    pieces = [step(mha, x[:, :chunk])]
    pieces += [step(mha, x[:, i:i + 1]) for i in range(chunk, 15)]
    chex.assert_trees_all_close(jnp.concatenate(pieces, 1), full, atol=2e-6,
                                rtol=2e-6)
    np.testing.assert_array_equal(mha.cache_index[...], [15, 15])
    with self.assertRaisesRegex(ValueError, r"window=3 slots forgets keys "
                                r"older than 2 positions"):
      mha.init_cache(2, window=3)
    with self.assertRaisesRegex(ValueError, r"needs max_length"):
      _module().init_cache(2)

  def test_decode_without_cache_is_an_error(self):
    with self.assertRaisesRegex(ValueError, r"call init_cache"):
      _module()(_x(), decode=True)


class ParamsTest(absltest.TestCase):

  def test_state_of_other_head_counts_is_refused(self):
    # The function reads the head counts off the params; a layer whose
    # state was swapped for one of other shapes (8 heads of 2 dims in place
    # of 4 of 4: the same 16 columns) is refused, never run as 8 heads.
    layer = aj.MultiHeadAttention(16, 4, rngs=nnx.Rngs(0))
    other = aj.MultiHeadAttention(16, 8, head_dim=2, rngs=nnx.Rngs(1))
    nnx.update(layer, nnx.state(other))
    with self.assertRaisesRegex(ValueError, r"num_heads=4 but params"):
      layer(jnp.ones((1, 3, 16)))

  def test_equals_flax_multi_head_attention(self):
    # flax's nnx.MultiHeadAttention has the same per-head layout (W_q kernel
    # [D, N, H], W_o kernel [N, H, Dout]) and creates its projections in the
    # same order from the same initialisers: one seed gives the same
    # parameters. With other (random) parameters loaded into both, outputs
    # agree with H != D / N, GQA, keys of another width and another output
    # width. float32 on both sides with different op orders: ~1e-6.
    ours = aj.MultiHeadAttention(16, 4, num_kv_heads=2, head_dim=3,
                                 kv_features=6, out_features=5,
                                 rngs=nnx.Rngs(3))
    theirs = nnx.MultiHeadAttention(4, 16, qkv_features=12, out_features=5,
                                    num_kv_heads=2, in_kv_features=6,
                                    decode=False, rngs=nnx.Rngs(3))
    names = {"W_q": "query", "W_k": "key", "W_v": "value", "W_o": "out"}
    for name, flax_name in names.items():
      for entry in ("kernel", "bias"):
        np.testing.assert_array_equal(
            getattr(getattr(ours, name), entry)[...],
            getattr(getattr(theirs, flax_name), entry)[...],
            err_msg=f"{name} {entry}")
    params = _data.params(aj.init_multi_head_params, 4, 16, 4,
                          num_kv_heads=2, head_dim=3, kv_features=6,
                          out_features=5)
    ours.load_params(params)
    for name, flax_name in names.items():
      for entry in ("kernel", "bias"):
        getattr(getattr(theirs, flax_name), entry)[...] = params[name][entry]
    x, mem = _x(), _data.normal(8, (2, 7, 6))
    val = _data.normal(9, (2, 7, 6))  # distinct from the keys
    mask = aj.make_attention_mask(jnp.ones((2, 5), bool),
                                  aj.padding_mask(jnp.array([7, 4]), 7))
    chex.assert_trees_all_close(ours(x, mem, val, mask=mask),
                                theirs(x, mem, val, mask=mask), atol=1e-5,
                                rtol=1e-5)

  def test_load_params_checks_the_layout(self):
    source = _module(num_kv_heads=2, normalize_qk=True, seed=1)
    source.q_norm.scale[...] = jnp.array([0.5, 1.0, 2.0, 1.5])
    target = _module(num_kv_heads=2, normalize_qk=True)
    target.load_params(source.params_dict())
    x = _x()
    chex.assert_trees_all_close(target(x), source(x), atol=0, rtol=0)
    with self.assertRaisesRegex(
        ValueError, r"params\['W_k'\]\['kernel'\] has shape \(16, 4, 4\), "
        r"but this module's is \(16, 2, 4\)"):
      target.load_params(_module(normalize_qk=True).params_dict())
    with self.assertRaisesRegex(ValueError, r"but this module has \['W_k', "
                                r"'W_o', 'W_q', 'W_v', 'k_norm', 'q_norm'\]"):
      target.load_params(_module(num_kv_heads=2).params_dict())


class DropoutTest(absltest.TestCase):

  def test_deterministic_and_training_modes(self):
    mha = _module(dropout_rate=0.3, seed=1)
    x = _x()
    a, b = mha(x, deterministic=True), mha(x, deterministic=True)
    chex.assert_trees_all_close(a, b, atol=0, rtol=0)
    t1, t2 = mha(x), mha(x)  # the module's dropout stream advances
    self.assertGreater(float(jnp.abs(t1 - a).max()), 1e-3)
    self.assertGreater(float(jnp.abs(t1 - t2).max()), 1e-3)
    # Reproducible: a fresh module from the same seeds draws the same masks.
    twin = _module(dropout_rate=0.3, seed=1)
    chex.assert_trees_all_close(twin(x), t1, atol=0, rtol=0)
    # Per-call rngs and eval() as in flax.
    key = jax.random.key(7)
    chex.assert_trees_all_close(mha(x, rngs=key), mha(x, rngs=key), atol=0,
                                rtol=0)
    mha.eval()
    chex.assert_trees_all_close(mha(x), a, atol=0, rtol=0)


class FlaxIntegrationTest(absltest.TestCase):

  def test_gradients_reach_every_parameter(self):
    mha = _module(num_kv_heads=2)
    x = _x()

    def loss(module):
      return jnp.mean(module(x, is_causal=True) ** 2)

    grads = nnx.grad(loss)(mha)
    leaves = jax.tree.leaves(nnx.state(grads, nnx.Param))
    self.assertLen(leaves, 8)  # 4 kernels + 4 biases
    chex.assert_tree_all_finite(leaves)
    for g in leaves:
      self.assertGreater(float(jnp.abs(g).max()), 0.0)

  def test_nnx_jit_no_retrace_and_optimizer_step(self):
    mha = _module()
    optimizer = nnx.Optimizer(mha, optax.adam(1e-2), wrt=nnx.Param)
    x, target = _x(), _x(seed=9)

    @nnx.jit
    @chex.assert_max_traces(n=1)
    def train_step(module, optimizer):
      loss, grads = nnx.value_and_grad(
          lambda m: jnp.mean((m(x) - target) ** 2))(module)
      optimizer.update(module, grads)
      return loss

    losses = [float(train_step(mha, optimizer)) for _ in range(5)]
    self.assertLess(losses[-1], losses[0])

  def test_split_merge_and_orbax_round_trip(self):
    mha = _module(num_kv_heads=2)
    x = _x()
    graphdef, state = nnx.split(mha)
    chex.assert_trees_all_close(nnx.merge(graphdef, state)(x), mha(x),
                                atol=0, rtol=0)
    with tempfile.TemporaryDirectory() as tmp:
      checkpointer = ocp.StandardCheckpointer()
      checkpointer.save(f"{tmp}/state", state)
      checkpointer.wait_until_finished()
      fresh = _module(num_kv_heads=2, seed=1)
      abstract = nnx.state(fresh)
      restored = checkpointer.restore(f"{tmp}/state", abstract)
    nnx.update(fresh, restored)
    chex.assert_trees_all_close(fresh(x), mha(x), atol=0, rtol=0)

  def test_inside_a_linen_model_through_bridge(self):

    class Block(linen.Module):

      @linen.compact
      def __call__(self, x):
        attn = nnx.bridge.ToLinen(aj.MultiHeadAttention, args=(16, 4),
                                  kwargs={"num_kv_heads": 2})
        return x + attn(x)

    x = _x()
    variables = Block().init(jax.random.key(0), x)
    out = Block().apply(variables, x)
    params = variables["params"]["ToLinen_0"]
    expected = aj.multi_head_attention(
        {name: dict(params[name]) for name in ("W_q", "W_k", "W_v", "W_o")},
        x, x, x)
    chex.assert_trees_all_close(out, x + expected, atol=1e-6, rtol=1e-6)


class InvalidTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("d_model", dict(d_model=10, num_heads=4), ValueError,
       r"d_model=10 must be divisible by num_heads=4"),
      ("kv_heads", dict(d_model=16, num_heads=4, num_kv_heads=3), ValueError,
       r"num_heads=4 must be divisible by num_kv_heads=3"),
      ("dropout", dict(d_model=16, num_heads=4, dropout_rate=1.5), ValueError,
       r"dropout_rate must be in \[0, 1\), got 1.5"),
  )
  def test_construction(self, kwargs, exception, pattern):
    with self.assertRaisesRegex(exception, pattern):
      aj.MultiHeadAttention(**kwargs, rngs=nnx.Rngs(0))

  @parameterized.named_parameters(
      ("features", lambda m: m(jnp.ones((2, 5, 8))),
       r"query has 8 features \(shape \(2, 5, 8\)\), but the module was built "
       r"with d_model=16"),
      ("key_features", lambda m: m(jnp.ones((2, 5, 16)), jnp.ones((2, 3, 12))),
       r"key has 12 features"),
      ("rank", lambda m: m(jnp.ones((5, 16))), r"query must have rank 3"),
      ("mask", lambda m: m(jnp.ones((2, 5, 16)),
                           mask=jnp.ones((2, 3, 5, 5), bool)),
       r"mask with shape \(2, 3, 5, 5\) is not broadcastable to \[B, N, T, S\]"),
  )
  def test_call(self, call, pattern):
    with self.assertRaisesRegex(ValueError, pattern):
      call(_module())


if __name__ == "__main__":
  absltest.main()
