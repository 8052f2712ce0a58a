"""``aj.Mask``: one value for every pattern, combinable, built inside jit.

Each test compares what the kernels compute with a mask against a float64
NumPy reference whose allowed pairs are written out from the mask's
definition (bottom-right alignment, left-aligned per-example arrays).
"""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.kernels import base
from attention_jax.kernels import flash
from tests import _data
from tests import reference

B, N, T, S, H = 2, 2, 12, 16, 8
# float32 kernels against a float64 reference over <= 16 keys.
TOL = 2e-5


def _qkv(t=T, s=S):
  return (_data.normal(70, (B, N, t, H)), _data.normal(71, (B, N, s, H)),
          _data.normal(72, (B, N, s, H)))


def _grid(t=T, s=S):
  return np.arange(t)[:, None], np.arange(s)[None, :]


def _reference(q, k, v, allowed):
  full = np.broadcast_to(allowed, (B, N) + allowed.shape[-2:])
  return reference.sdpa(q, k, v, full)[0]


class MaskTest(parameterized.TestCase):

  def test_is_a_pytree_and_builds_inside_jit_from_traced_values(self):
    q, k, v = _qkv()
    lengths = np.array([16, 9])

    @jax.jit
    def run(q, k, v, lengths):
      mask = aj.Mask(causal=True, kv_lengths=lengths)  # [B], traced
      leaves, tree = jax.tree.flatten(mask)
      again = jax.tree.unflatten(tree, leaves)
      return aj.scaled_dot_product_attention(q, k, v, again)

    i, j = _grid()
    allowed = ((j <= i + S - T)[None] & (j < lengths[:, None, None]))[:, None]
    np.testing.assert_allclose(run(q, k, v, jnp.asarray(lengths)),
                               _reference(q, k, v, allowed), atol=TOL)

  def test_a_mask_is_a_jit_argument_whose_structure_is_static(self):
    q, k, v = _qkv()
    calls = []

    @jax.jit
    def run(q, mask):
      calls.append(1)
      return aj.scaled_dot_product_attention(q, k, v, mask)

    run(q, aj.Mask(kv_lengths=jnp.array([3, 5])))
    run(q, aj.Mask(kv_lengths=jnp.array([7, 2])))  # same structure
    self.assertLen(calls, 1)
    run(q, aj.Mask(kv_lengths=jnp.array([7, 2]), causal=True))
    self.assertLen(calls, 2)

  @parameterized.named_parameters(
      ("dense", "dense"), ("flash", flash.Flash(block_q=4, block_k=4)))
  def test_and_intersects_every_field(self, implementation):
    q, k, v = _qkv()
    dense = _data.bernoulli(73, 0.8, (B, 1, T, S))
    a = aj.Mask(causal=True, window=(6, 3), kv_lengths=jnp.array([15, 11]))
    b = aj.Mask(window=(4, 9), kv_lengths=jnp.array([[13], [16]]),
                q_lengths=jnp.array([12, 8]), dense=dense)
    got = aj.scaled_dot_product_attention(q, k, v, a & b,
                                          implementation=implementation)
    i, j = _grid()
    pos = i + S - T
    band = (j <= pos) & (j >= pos - 4) & (j <= pos + 3)
    kv = np.minimum([15, 11], [13, 16])[:, None, None]
    rows = (i < np.array([12, 8])[:, None, None])
    allowed = (band[None] & (j < kv) & rows)[:, None] & np.asarray(dense)
    want = _reference(q, k, v, allowed)
    want = np.where(allowed.any(-1, keepdims=True), want, 0.0)
    np.testing.assert_allclose(got, want, atol=TOL)
    self.assertEqual((a & b).window, (4, 3))

  @parameterized.named_parameters(
      ("dense", "dense"), ("flash", flash.Flash(block_q=4, block_k=4)))
  def test_or_is_the_union_and_blocks_are_skipped(self, implementation):
    q, k, v = _qkv(T, T)
    prefix = jnp.array([3, 7])  # per example
    rule = aj.MaskRule(lambda b, h, q_idx, kv_idx, p: kv_idx < p[b], prefix)
    mask = aj.Mask(causal=True) | aj.Mask(rule=rule)
    got = jax.jit(functools.partial(aj.scaled_dot_product_attention,
                                    implementation=implementation))(
                                        q, k, v, mask)
    i, j = _grid(T, T)
    allowed = ((j <= i)[None] | (j < np.asarray(prefix)[:, None, None]))
    want = _reference(q, k, v, allowed[:, None])
    np.testing.assert_allclose(got, want, atol=TOL)
    # The union's blocks were classified per example: the last query
    # block's first key block is full, the first query block's last empty.
    problem = base.canonicalize(q, k, v, mask)
    ops = flash.with_rule_tables(problem.ops, 4, 4)
    kinds = np.asarray(ops.rule.kinds)  # [B, 1, nq, nk]: per example
    self.assertEqual(kinds.shape, (B, 1, 3, 3))
    self.assertEqual(kinds[0, 0].tolist(), [[1, 0, 0], [2, 1, 0], [2, 2, 1]])
    self.assertEqual(kinds[1, 0].tolist(), [[2, 1, 0], [2, 1, 0], [2, 2, 1]])

  def test_per_example_arrays_align_to_the_left(self):
    q, k, v = _qkv()
    lengths = jnp.array([4, 16])
    left = aj.scaled_dot_product_attention(q, k, v,
                                           aj.Mask(kv_lengths=lengths))
    explicit = aj.scaled_dot_product_attention(
        q, k, v, aj.Mask(kv_lengths=lengths[:, None]))
    chex.assert_trees_all_close(left, explicit, atol=0.0)
    # [B, T] segment ids are per example, the same as [B, 1, T].
    ids = jnp.array([[0] * 6 + [1] * 6, [0] * 3 + [1] * 9])
    kv_ids = jnp.array([[0] * 8 + [1] * 8, [0] * 5 + [1] * 11])
    got = aj.scaled_dot_product_attention(
        q, k, v, aj.Mask(q_segment_ids=ids, kv_segment_ids=kv_ids))
    allowed = (np.asarray(ids)[:, :, None]
               == np.asarray(kv_ids)[:, None, :])[:, None]
    np.testing.assert_allclose(got, _reference(q, k, v, allowed), atol=TOL)

  def test_refusals_name_the_field_and_the_fix(self):
    q, k, v = _qkv()
    with self.assertRaisesRegex(ValueError, r"kv_lengths.*leading axes"):
      aj.scaled_dot_product_attention(
          q, k, v, aj.Mask(kv_lengths=jnp.ones((B, N, 1), jnp.int32)))
    with self.assertRaisesRegex(TypeError, "q_lengths must be an integer"):
      aj.Mask(q_lengths=jnp.ones((B,)))
    with self.assertRaisesRegex(ValueError, "one pair"):
      aj.Mask(q_segment_ids=jnp.zeros((T,), jnp.int32)) & aj.Mask(
          q_segment_ids=jnp.zeros((T,), jnp.int32))
    with self.assertRaisesRegex(TypeError, "causal must be a Python bool"):
      aj.Mask(causal=jnp.array(True))
    with self.assertRaisesRegex(TypeError, r"aj.Mask\(rule=mask_fn\)"):
      aj.scaled_dot_product_attention(q, k, v, lambda b, h, i, j: i >= j)

  def test_jax_nn_arguments_reproduce_jax_nn(self):
    q, k, v = _qkv(T, T)
    # (6, 0): every row keeps a key (jax.nn averages rows that see none).
    mask = aj.Mask(causal=True, window=(6, 0), kv_lengths=jnp.array([12, 7]))
    swap = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
    theirs = swap(jax.nn.dot_product_attention(
        swap(q), swap(k), swap(v), **mask.jax_nn_arguments(T, T)))
    ours = aj.scaled_dot_product_attention(q, k, v, mask)
    np.testing.assert_allclose(ours, theirs, atol=TOL)
    # T != S: the bottom-right band becomes an explicit mask.
    q2 = q[:, :, :5]
    kw = aj.Mask(causal=True).jax_nn_arguments(5, T)
    self.assertNotIn("is_causal", kw)
    theirs = swap(jax.nn.dot_product_attention(swap(q2), swap(k), swap(v),
                                               **kw))
    ours = aj.scaled_dot_product_attention(q2, k, v, is_causal=True)
    np.testing.assert_allclose(ours, theirs, atol=TOL)
    with self.assertRaisesRegex(ValueError, "no counterpart for segment"):
      aj.Mask(q_segment_ids=jnp.zeros((T,), jnp.int32)).jax_nn_arguments(T, T)

  @parameterized.named_parameters(
      # (mask fields, T, S, the keywords' band: flags, or a mask)
      ("top_left_positions", dict(causal=True, window=(2, 0), q_offset=0,
                                  kv_offset=0), 5, T,
       dict(is_causal=True, local_window_size=(2, 0))),
      ("equal_positions_more_queries", dict(causal=True, q_offset=4,
                                            kv_offset=4), T, 5,
       dict(is_causal=True)),
      ("two_sided_square", dict(window=(1, 2)), T, T,
       dict(local_window_size=(1, 2))),
      ("wide_causal_window_square", dict(causal=True, window=(T, 3)), T, T,
       dict(is_causal=True)),
      ("window_t_ne_s", dict(window=(1, 2)), 5, T, "mask"),
      ("shifted_positions", dict(causal=True, q_offset=2, kv_offset=1), 5, T,
       "mask"),
  )
  def test_jax_nn_arguments_band(self, fields, t, s, want):
    # Key lengths short by one leave every row a key (jax.nn averages rows
    # that see none).
    mask = aj.Mask(**fields, kv_lengths=jnp.array([s, s - 1]))
    kw = mask.jax_nn_arguments(t, s)
    band = {n: x for n, x in kw.items() if n != "key_value_seq_lengths"}
    if want == "mask":  # the band, explicit: no jax.nn flags
      self.assertEqual(set(band), {"mask"})
    else:  # jax.nn's own (top-left) flags are exact: no [T, S] mask
      self.assertEqual(band, want)
    # Either way jax.nn computes what the mask means (a float64 reference
    # written from the definition: positions, else bottom-right).
    q, k, v = _qkv(t, s)
    q_at, kv_at = _grid(t, s)
    q_at = q_at + fields.get("q_offset", s - t if "kv_offset" not in fields
                             else 0)
    kv_at = kv_at + fields.get("kv_offset", 0)
    allowed = np.ones((t, s), bool)
    if fields.get("causal"):
      allowed &= kv_at <= q_at
    if "window" in fields:
      left, right = fields["window"]
      allowed &= (q_at - left <= kv_at) & (kv_at <= q_at + right)
    allowed = allowed[None] & (np.arange(s) < np.array([s, s - 1])[:, None,
                                                                   None])
    self.assertTrue(allowed.any(-1).all())
    swap = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
    theirs = swap(jax.nn.dot_product_attention(swap(q), swap(k), swap(v),
                                               **kw))
    np.testing.assert_allclose(theirs, _reference(q, k, v, allowed[:, None]),
                               atol=TOL)


class UnionAndRuleTest(absltest.TestCase):
  """What a union's members and the built-in rules are held to."""

  def test_union_members_are_validated_like_masks(self):
    q, k, v = _qkv()  # T = 12 queries over S = 16 keys
    ids = jnp.zeros((T,), jnp.int32)
    bad = {
        "segment ids of the wrong length (query ids defaulted for keys)":
            aj.Mask(q_segment_ids=ids),
        "a dense member of too low a rank": aj.Mask(dense=jnp.ones((B, S),
                                                                   bool)),
        "lengths for another batch": aj.Mask(kv_lengths=jnp.arange(5)),
    }
    for what, member in bad.items():
      with self.subTest(what), self.assertRaises(ValueError):
        aj.scaled_dot_product_attention(q, k, v,
                                        member | aj.Mask(causal=True))

  def test_a_union_shares_tables_unless_a_member_reads_arrays(self):
    q, k, v = _qkv(T, T)
    shared = aj.Mask(causal=True) | aj.Mask(rule=aj.chunked_mask_fn(4))
    per_example = aj.Mask(causal=True) | aj.Mask(
        rule=aj.prefix_lm_mask_fn(jnp.array([3, 7])))
    for mask, batch in ((shared, ()), (per_example, (B, 1))):
      ops = flash.with_rule_tables(base.canonicalize(q, k, v, mask).ops, 4, 4)
      self.assertEqual(ops.rule.batch_shape, batch)

  def test_rule_and_rule_is_one_rule_and_decodes(self):
    layer = aj.MultiHeadAttention(16, 2, rngs=nnx.Rngs(0), mask=aj.Mask(
        causal=True, rule=aj.chunked_mask_fn(4)))
    x = _data.normal(74, (B, 7, 16))
    prefix = aj.Mask(rule=aj.prefix_lm_mask_fn(2))
    full = layer(x, mask=prefix)
    layer.init_cache(B, 8)
    steps = [layer(x[:, :3], mask=prefix, decode=True)]
    steps += [layer(x[:, i:i + 1], mask=prefix, decode=True)
              for i in range(3, 7)]
    # Causal & chunked & (prefix | causal) = causal & chunked: decoding
    # (rules at absolute positions) equals the full forward.
    np.testing.assert_allclose(jnp.concatenate(steps, 1), full, atol=TOL)

  def test_per_example_rules_are_checked_against_the_batch(self):
    q, k, v = _qkv(T, T)
    rule = aj.Mask(rule=aj.prefix_lm_mask_fn(jnp.array([3, 6, 9])))
    with self.assertRaisesRegex(ValueError, "3 examples.*batch 2"):
      aj.scaled_dot_product_attention(q, k, v, rule)
    one = aj.Mask(rule=aj.prefix_lm_mask_fn(jnp.array([5])))
    got = aj.scaled_dot_product_attention(
        q[:1], k[:1], v[:1], one, implementation=flash.Flash(4, 4))
    i, j = _grid(T, T)
    want = reference.sdpa(q[:1], k[:1], v[:1],
                          np.broadcast_to((j < 5) | (j <= i), (1, N, T, T)))[0]
    np.testing.assert_allclose(got, want, atol=TOL)

  def test_built_in_rules_trace_once(self):
    q, k, v = _qkv(T, T)
    traces = []

    @jax.jit
    def run(q, mask):
      traces.append(1)
      return aj.scaled_dot_product_attention(q, k, v, mask)

    for _ in range(3):
      run(q, aj.Mask(rule=aj.chunked_mask_fn(4)))
      run(q, aj.Mask(rule=aj.prefix_lm_mask_fn(3)))
    self.assertLen(traces, 2)

  def test_numpy_arrays_combine_with_masks(self):
    dense = np.ones((1, 1, T, S), bool)
    combined = dense & aj.Mask(causal=True)
    self.assertIsInstance(combined, aj.Mask)
    self.assertTrue(combined.causal)


class KernelInterfaceTest(absltest.TestCase):

  def test_nothing_fits_lists_each_kernels_reason(self):
    q, k, v = _qkv()
    with self.assertRaisesRegex(
        ValueError, r"no implementation takes this call \(cudnn: .*; "
        r"flash: it never forms the attention weights"):
      aj.scaled_dot_product_attention(q, k, v, implementation=(
          "cudnn", "flash"), return_weights=True)
    with self.assertRaisesRegex(ValueError, "one of \\['cudnn', 'splash', "
                                "'paged_tpu', 'paged_gpu', 'pallas_gpu', "
                                "'gathered', 'flash', 'dense'\\]"):
      aj.scaled_dot_product_attention(q, k, v, implementation="flashy")

  def test_a_list_runs_the_first_kernel_that_fits(self):
    q, k, v = _qkv()
    out, w = aj.scaled_dot_product_attention(
        q, k, v, implementation=("flash", "dense"), return_weights=True)
    want, want_w = aj.scaled_dot_product_attention(
        q, k, v, implementation="dense", return_weights=True)
    chex.assert_trees_all_close((out, w), (want, want_w), atol=0.0)

  def test_a_new_kernel_is_one_class(self):
    seen = []

    class Recording(aj.kernels.Dense):
      name = "recording"

      def __call__(self, problem):
        seen.append(problem.scale)
        return super().__call__(problem)

    q, k, v = _qkv()
    out = aj.scaled_dot_product_attention(q, k, v, scale=0.25,
                                          implementation=Recording())
    self.assertEqual(seen, [0.25])
    want = aj.scaled_dot_product_attention(q, k, v, scale=0.25,
                                           implementation="dense")
    chex.assert_trees_all_close(out, want, atol=0.0)


if __name__ == "__main__":
  absltest.main()
