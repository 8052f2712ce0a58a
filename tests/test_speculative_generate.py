"""aj.speculative_generate: greedy tokens and caches as aj.generate's.

The reference is aj.generate at temperature 0 over the same parameters with
linear caches (itself tested against full recomputation in
test_generate.py); the default draft is checked against the experiment's
host-side prompt lookup (experiments/speculative.NgramDraft).
"""

import functools

from absl.testing import absltest
import chex
from flax import nnx
import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.layers import speculative_generate as spec_lib
from experiments import speculative

V, D = 13, 16  # vocabulary, model width
# Ragged, repetitive prompts: prompt lookup finds earlier occurrences.
PROMPTS = np.array([[3, 1, 4, 3, 1, 4, 3, 1],
                    [5, 2, 6, 5, 2, 6, 0, 0],
                    [7, 8, 7, 8, 7, 0, 0, 0]])
LENGTHS = np.array([8, 6, 5])
G, WIDTH, DEPTH = 12, 2, 3
T = 1 + WIDTH * DEPTH
Z = 4  # tokens per page
# A test of token equality means something only if no step is a near tie
# that float32 rounding (another kernel's reduction order) could flip.
MIN_MARGIN = 1e-3


class TinyLM(nnx.Module):
  """Embedding, two residual attention layers (RoPE, GQA), readout."""

  def __init__(self):
    rngs = nnx.Rngs(11)  # a seed whose greedy tokens are not all periodic
    self.embed = nnx.Embed(V, D, rngs=rngs)
    self.layers = nnx.List([
        aj.MultiHeadAttention(D, 4, num_kv_heads=2, rope=aj.Rope(base=100.0),
                              rngs=rngs) for _ in range(2)])
    self.out = nnx.Linear(D, V, rngs=rngs)

  def __call__(self, tokens, lengths=None, parents=None):
    rule, positions = aj.tree_step_options(self, parents)
    mask = (None if lengths is None and rule is None
            else aj.Mask(q_lengths=lengths, rule=rule))
    x = self.embed(tokens)
    for layer in self.layers:
      x = x + layer(x, mask=mask, positions=positions, decode=True)
    return self.out(x)


def _verify(model, tokens, lengths, parents):
  return model(tokens, lengths, parents)


@functools.cache
def _model() -> TinyLM:
  """One model for every test: a MultiHeadAttention's config compares by
  identity, so a fresh model's graph is new to nnx.jit (traced again)."""
  return TinyLM()


def _paged(pages_per_row=7):
  model = _model()
  for layer in model.layers:
    layer.init_paged_cache(3, num_pages=3 * pages_per_row, page_size=Z,
                           max_pages=pages_per_row)
  return model


def _table_draft(table, history, lengths):
  """Two branches under each row's root: a decoy (no token of it is
  greedy's), then ``table [B, G + DEPTH]``'s tokens (``table[b, g]``
  drafted as the row's token ``g``; -1 is never a token). The table's
  branch stands at slots past the decoy's, so its nodes' positions
  (depths) are not their slots."""
  emitted = lengths - jnp.asarray(LENGTHS)  # the root is token emitted - 1
  at = emitted[:, None] + jnp.arange(DEPTH)[None, :]
  branch = jnp.take_along_axis(table, at, 1)  # [B, DEPTH]
  decoy = jnp.where(branch < 0, -1, (branch + 2) % V)  # tables: g or g + 1
  tokens = jnp.concatenate([jnp.zeros((3, 1), jnp.int32), decoy, branch], 1)
  chain = jnp.arange(DEPTH)  # node 1 + i's parent: i (the root for i = 0)
  parents = jnp.concatenate([jnp.array([-1]), chain, jnp.array([0]),
                             chain[1:] + DEPTH])  # [T]
  return tokens, jnp.broadcast_to(parents, (3, T)), jnp.full((3,), T)


@nnx.jit
def _run(model, table, lookup):
  """speculative_generate with prompt lookup (``lookup``) or the table's
  draft: one program for every test (tracing the paged layers is most of
  a compile), the draft chosen by data."""
  def draft(history, lengths):
    ours = _table_draft(table, history, lengths)
    default = spec_lib.prompt_lookup_draft(history, lengths, width=WIDTH,
                                           depth=DEPTH)
    return jax.tree.map(lambda a, b: jnp.where(lookup, a, b), default, ours)
  return aj.speculative_generate(
      _verify, model, jnp.asarray(PROMPTS), jnp.asarray(LENGTHS), G,
      draft_fn=draft, width=WIDTH, depth=DEPTH, return_stats=True)


@functools.cache
def _greedy():
  """aj.generate's greedy tokens and logits (linear caches)."""
  model = nnx.clone(_model())
  for layer in model.layers:
    layer.init_cache(3, PROMPTS.shape[1] + G - 1)
  tokens, _, logits = nnx.jit(aj.generate, static_argnums=(0, 4),
                              static_argnames="return_logits")(
      lambda m, t, n: m(t, n), model, jnp.asarray(PROMPTS),
      jnp.asarray(LENGTHS), G, return_logits=True)
  return np.asarray(tokens), np.asarray(logits)


def _table(tokens_of_greedy):
  """``[B, G + DEPTH]``: a function of the greedy tokens, then -1."""
  table = tokens_of_greedy(_greedy()[0])
  return jnp.asarray(np.concatenate([table, np.full((3, DEPTH), -1)], 1),
                     jnp.int32)


def _check_books(test, model):
  """Each layer holds the plain run's lengths, exactly the pages they need,
  and its reference counts are its tables' references (no page leaked)."""
  for layer in model.layers:
    np.testing.assert_array_equal(layer.cache_index[...], LENGTHS + G - 1)
    table = np.asarray(layer.cache_page_table[...])
    p = layer.cached_key.shape[0]
    np.testing.assert_array_equal(
        np.asarray(layer.cache_refcount[...]),
        np.bincount(table[table < p], minlength=p))
    np.testing.assert_array_equal((table < p).sum(1),
                                  -(-(LENGTHS + G - 1) // Z))
    layer.check_cache()


class SpeculativeGenerateTest(chex.TestCase):

  def _generate(self, table=None):
    model = _paged()
    lookup = table is None
    tokens, lengths, stats = _run(
        model, _table(lambda g: g) if lookup else table, lookup)
    want, logits = _greedy()
    top = np.sort(logits, -1)
    self.assertGreater((top[..., -1] - top[..., -2]).min(), MIN_MARGIN)
    np.testing.assert_array_equal(tokens, want)
    np.testing.assert_array_equal(lengths, [G] * 3)
    _check_books(self, model)
    return int(stats["verify_calls"]), float(stats["mean_accepted"])

  def test_prompt_lookup_equals_greedy_generate(self):
    calls, accepted = self._generate()
    # The tree path is exercised: drafted tokens were accepted, so fewer
    # verification calls than the G - 1 of one token each.
    self.assertGreater(accepted, 0.0)
    self.assertLess(calls, G - 1)

  def test_a_draft_of_the_greedy_tokens_is_accepted_whole(self):
    calls, accepted = self._generate(_table(lambda g: g))
    # Each call accepts DEPTH drafted tokens (fewer at the end: the table's
    # -1s) and emits the target's own after them.
    emitted, want_calls, total = 1, 0, 0
    while emitted < G:
      n = min(DEPTH, G - emitted)
      emitted, want_calls, total = emitted + n + 1, want_calls + 1, total + n
    self.assertEqual(calls, want_calls)
    self.assertLess(calls, G - 1)
    self.assertAlmostEqual(accepted, total / want_calls, places=6)

  def test_a_wrong_draft_is_rejected_and_changes_nothing(self):
    calls, accepted = self._generate(_table(lambda g: (g + 1) % V))
    self.assertEqual(calls, G - 1)
    self.assertEqual(accepted, 0.0)


class PromptLookupTest(chex.TestCase):

  @hypothesis.settings(max_examples=10, deadline=None)
  @hypothesis.given(st.data())
  def test_equals_the_experiments_host_draft(self, data):
    """The same trees as experiments/speculative.NgramDraft (a small
    vocabulary: many repeats, ties between continuations, short tails)."""
    a = 16
    histories = [np.asarray(data.draw(st.lists(
        st.integers(0, 3), min_size=1, max_size=a)), np.int32)
                 for _ in range(3)]
    buffer = np.full((3, a), 9, np.int32)  # 9: never read past a length
    for r, h in enumerate(histories):
      buffer[r, :len(h)] = h
    lengths = np.array([len(h) for h in histories])
    tokens, parents, n = _LOOKUP(jnp.asarray(buffer), jnp.asarray(lengths))
    want = speculative.NgramDraft(width=3, depth=3, max_n=3)
    for r, tree in enumerate(want.trees(histories)):
      self.assertEqual(int(n[r]), tree.size)
      np.testing.assert_array_equal(tokens[r, :tree.size], tree.tokens)
      np.testing.assert_array_equal(parents[r, :tree.size], tree.parents)
      np.testing.assert_array_equal(tokens[r, tree.size:], 0)  # pad_id
      np.testing.assert_array_equal(parents[r, tree.size:], -1)


_LOOKUP = jax.jit(functools.partial(spec_lib.prompt_lookup_draft, width=3,
                                    depth=3, max_n=3))


class RefusalTest(absltest.TestCase):

  def _call(self, model, **options):
    return aj.speculative_generate(_verify, model, PROMPTS, LENGTHS, G,
                                   width=WIDTH, depth=DEPTH, **options)

  def test_a_linear_cache_is_refused_with_the_fix(self):
    model = TinyLM()
    for layer in model.layers:
      layer.init_cache(3, 20)
    with self.assertRaisesRegex(
        ValueError, r"layers/0 is a linear cache.*init_paged_cache"):
      self._call(model)

  def test_no_cache_is_refused(self):
    with self.assertRaisesRegex(ValueError, "found none.*init_paged_cache"):
      self._call(TinyLM())

  def test_a_cache_too_small_names_the_pages_needed(self):
    need = PROMPTS.shape[1] + G - 2 + T  # 25 tokens: 7 pages of 4
    with self.assertRaisesRegex(
        ValueError, rf"{need} tokens.*max_pages=7, num_pages=21"):
      self._call(_paged(pages_per_row=6))

  def test_bad_draft_shapes_are_refused(self):
    def draft(history, lengths):
      b = history.shape[0]
      return (jnp.zeros((b, 4), jnp.int32), jnp.zeros((b, 5), jnp.int32),
              lengths)
    with self.assertRaisesRegex(ValueError, r"parents \[B, T\].*\(3, 5\)"):
      self._call(_paged(), draft_fn=draft)
    with self.assertRaisesRegex(ValueError, "must return"):
      self._call(_paged(), draft_fn=lambda h, n: h)

  def test_tree_step_options_needs_a_paged_cache(self):
    self.assertEqual(aj.tree_step_options(TinyLM(), None), (None, None))
    with self.assertRaisesRegex(ValueError, "no MultiHeadAttention layer"):
      aj.tree_step_options(TinyLM(), jnp.array([[-1, 0]]))


if __name__ == "__main__":
  absltest.main()
