"""aj.generate: cached generation against full recomputation, eos, sampling.

The reference for greedy decoding is independent of the cache: per example,
the unpadded tokens so far go through the full causal forward (no cache, no
padding) and the argmax of the last position is appended, one step at a
time.
"""

import functools

from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj

V, D = 13, 16  # vocabulary, model width
PROMPTS = np.array([[3, 1, 4, 1, 5], [9, 2, 0, 0, 0], [6, 5, 3, 5, 0]])
LENGTHS = np.array([5, 2, 4])  # ragged: rows right-padded to P = 5
G = 6  # new tokens: with a window of 2, 5 + 6 tokens wrap a 3-slot ring
# Cached decoding and the full forward are the same float32 maths over
# other shapes (reduction order differs): logits agree to ~1e-6 at these
# sizes; 1e-4 leaves room and is far below a wrong context's effect.
LOGIT_TOL = dict(atol=1e-4, rtol=1e-4)
# A test of token equality means something only if no step is a near tie
# that float32 rounding could flip.
MIN_MARGIN = 1e-3


class TinyLM(nnx.Module):
  """Embedding, two residual attention layers (RoPE, GQA), readout."""

  def __init__(self, *, window: int | None = None, seed: int = 0):
    rngs = nnx.Rngs(seed)
    self.embed = nnx.Embed(V, D, rngs=rngs)
    self.layers = nnx.List([
        aj.MultiHeadAttention(D, 4, num_kv_heads=2, rope=aj.Rope(base=100.0),
                              rngs=rngs),
        aj.MultiHeadAttention(
            D, 4, num_kv_heads=2, rope=aj.Rope(base=100.0), rngs=rngs,
            mask=None if window is None else aj.Mask(causal=True,
                                                     window=(window, 0)))])
    self.out = nnx.Linear(D, V, rngs=rngs)

  def __call__(self, tokens, lengths=None, *, decode=False):
    x = self.embed(tokens)
    mask = None if lengths is None else aj.Mask(q_lengths=lengths)
    for layer in self.layers:
      x = x + layer(x, mask=mask, decode=decode, is_causal=not decode)
    return self.out(x)

  def init_cache(self, batch_size: int, max_length: int):
    for layer in self.layers:
      if layer.mask is None:
        layer.init_cache(batch_size, max_length)
      else:  # the window layer keeps a ring buffer
        layer.init_cache(batch_size)

  def check_cache(self):
    for layer in self.layers:
      layer.check_cache()


def _decode(model, tokens, lengths):
  return model(tokens, lengths, decode=True)


_JITTED = nnx.jit(aj.generate, static_argnums=(0, 4),
                  static_argnames="return_logits")


def _generate(model, jit=False, prompts=PROMPTS, lengths=LENGTHS, g=G,
              **options):
  fn = _JITTED if jit else aj.generate
  return fn(_decode, model, jnp.asarray(prompts), jnp.asarray(lengths), g,
            **options)


def _fresh(window=None, batch=3, length=5 + G):
  model = TinyLM(window=window)
  model.init_cache(batch, length)
  return model


# The full forward, compiled once per sequence length (run eagerly, its
# many small ops cost seconds more per shape); it reads no cache, no pads.
_FULL_FORWARD = nnx.jit(lambda model, tokens: model(tokens))


def _reference_greedy(model, prompts=PROMPTS, lengths=LENGTHS, g=G):
  """``(tokens [B, G], logits [B, G, V])`` by full recomputation per row."""
  tokens, logits = [], []
  for row, n in zip(prompts, lengths):
    seq, row_logits = list(row[:n]), []
    for _ in range(g):
      last = np.asarray(_FULL_FORWARD(model, jnp.asarray([seq])))[0, -1]
      row_logits.append(last)
      seq.append(int(np.argmax(last)))
    tokens.append(seq[n:])
    logits.append(row_logits)
  return np.array(tokens), np.array(logits)


@functools.cache
def _fresh_reference(window=None):
  """``_reference_greedy`` of ``_fresh(window)``, computed once: a fresh
  TinyLM's parameters depend only on its window (the seed is fixed), so the
  eager and the jitted test of a window share one reference."""
  return _reference_greedy(_fresh(window))


def _margins(logits):
  """Top-1 minus top-2 logit at every step."""
  top = np.sort(logits, -1)
  return top[..., -1] - top[..., -2]


class GreedyTest(parameterized.TestCase):

  @parameterized.product(window=(None, 2), jit=(False, True))
  def test_equals_the_argmax_of_a_full_forward_recomputed_each_step(
      self, window, jit):
    model = _fresh(window)
    want, want_logits = _fresh_reference(window)
    self.assertGreater(_margins(want_logits).min(), MIN_MARGIN)
    tokens, lengths, logits = _generate(model, jit, return_logits=True)
    np.testing.assert_array_equal(tokens, want)
    np.testing.assert_array_equal(lengths, [G] * 3)
    np.testing.assert_allclose(logits, want_logits, **LOGIT_TOL)
    # Each row cached its own prompt and the G - 1 tokens fed after it.
    for layer in model.layers:
      np.testing.assert_array_equal(layer.cache_index[...], LENGTHS + G - 1)
    model.check_cache()

  @parameterized.parameters(False, True)
  def test_eos_stops_a_row_which_then_emits_pad(self, jit):
    greedy, _ = _generate(_fresh(), jit)
    greedy = np.asarray(greedy)
    eos, pad = int(greedy[0, 2]), V  # a pad id no row generates
    tokens, lengths = _generate(_fresh(), jit, eos_id=eos, pad_id=pad)
    # Rows are independent: each follows greedy up to its first eos.
    for row, got, n in zip(greedy, np.asarray(tokens), np.asarray(lengths)):
      stop = list(row).index(eos) + 1 if eos in row else G
      self.assertEqual(n, stop)
      np.testing.assert_array_equal(got[:stop], row[:stop])
      np.testing.assert_array_equal(got[stop:], pad)
    self.assertLessEqual(int(lengths[0]), 3)  # row 0 did stop early

  def test_one_new_token_is_the_prefill_argmax(self):
    model = _fresh()
    want, _ = _reference_greedy(model, g=1)
    tokens, lengths = _generate(model, g=1)
    np.testing.assert_array_equal(tokens, want)
    np.testing.assert_array_equal(lengths, [1, 1, 1])


class SamplingTest(parameterized.TestCase):

  def test_top_k_1_and_a_tiny_temperature_equal_greedy(self):
    greedy, _, logits = _generate(_fresh(), return_logits=True)
    margin = _margins(np.asarray(logits)).min()
    self.assertGreater(margin, MIN_MARGIN)
    key = jax.random.key(7)
    top1, _ = _generate(_fresh(), temperature=1.0, top_k=1, key=key)
    np.testing.assert_array_equal(top1, greedy)
    # At temperature 1e-5 the top logit leads by margin / 1e-5 > 100, more
    # than the Gumbel noise of a float32 draw can make up (< 20).
    cold, _ = _generate(_fresh(), temperature=1e-5, key=key)
    np.testing.assert_array_equal(cold, greedy)

  @parameterized.parameters(False, True)
  def test_the_same_key_gives_the_same_tokens_within_the_top_k(self, jit):
    options = dict(temperature=1.5, top_k=4, return_logits=True)
    a, _, logits = _generate(_fresh(), jit, key=jax.random.key(1), **options)
    b, _, _ = _generate(_fresh(), jit, key=jax.random.key(1), **options)
    c, _, _ = _generate(_fresh(), jit, key=jax.random.key(2), **options)
    np.testing.assert_array_equal(a, b)
    self.assertFalse(np.array_equal(a, c))  # another key, other draws
    # Every draw is among the 4 most likely tokens of its step's logits.
    rank = (np.asarray(logits) > np.take_along_axis(
        np.asarray(logits), np.asarray(a)[..., None], -1)).sum(-1)
    self.assertLess(rank.max(), 4)


def _small_cache():
  model = TinyLM()
  model.init_cache(3, 5 + G - 2)
  return model


def _no_cache():
  model = TinyLM()
  model.layers[0].init_cache(3, 5 + G)
  return model


def _other_batch():
  model = TinyLM()
  model.init_cache(2, 5 + G)
  return model


BAD = [
    ("prompts_rank", dict(prompts=PROMPTS[0]), ValueError,
     r"prompts must be integer token ids \[B, P\].*shape \(5,\)"),
    ("float_prompts", dict(prompts=PROMPTS.astype(np.float32)), ValueError,
     r"prompts must be integer token ids .*float32"),
    ("lengths_shape", dict(lengths=LENGTHS[:2]), ValueError,
     r"prompt_lengths must be integer \[B\] = \[3\].*\(2,\)"),
    ("empty_prompt", dict(lengths=np.array([5, 0, 4])), ValueError,
     r"prompt_lengths must lie in \[1, P\] = \[1, 5\].*\[5, 0, 4\]"),
    ("long_length", dict(lengths=np.array([5, 6, 4])), ValueError,
     r"prompt_lengths must lie in \[1, P\]"),
    ("no_new_tokens", dict(g=0), ValueError, r"max_new_tokens must be >= 1"),
    ("float_new_tokens", dict(g=2.0), TypeError,
     r"max_new_tokens must be a Python int"),
    ("negative_temperature", dict(temperature=-0.5), ValueError,
     r"temperature must be >= 0 \(0: greedy\), got -0.5"),
    ("sampling_without_key", dict(temperature=0.7), ValueError,
     r"temperature=0.7 samples at random: pass key="),
    ("negative_top_k", dict(top_k=-1, temperature=1.0,
                            key=jax.random.key(0)), ValueError,
     r"top_k must be non-negative, got -1"),
    ("float_eos", dict(eos_id=1.0), TypeError, r"eos_id must be an integer"),
]


class BadInputTest(parameterized.TestCase):

  @parameterized.named_parameters(*BAD)
  def test_refused(self, options, error, regex):
    with self.assertRaisesRegex(error, regex):
      _generate(_fresh(), **options)

  @parameterized.named_parameters(
      ("cache_too_small", _small_cache,
       r"layers/0 holds L = 9 tokens, but prompts of P = 5 and "
       r"max_new_tokens = 6 need P \+ max_new_tokens - 1 = 10"),
      ("layer_without_cache", _no_cache,  # the layer's own refusal
       r"decode=True needs a cache: call init_cache"),
      ("other_batch", _other_batch,
       r"layers/0 holds 2 examples, but prompts has B = 3"),
  )
  def test_caches_are_checked_before_generating(self, build, regex):
    with self.assertRaisesRegex(ValueError, regex):
      _generate(build())
    with self.assertRaisesRegex(ValueError, regex):  # shapes are static
      _generate(build(), jit=True)


if __name__ == "__main__":
  absltest.main()
