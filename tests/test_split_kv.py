"""Split-KV (``aj.kernels.SplitKV``): the kernel contract on chunks, and
what it refuses.

The contract's cases run with the keys in 3 chunks of the flash kernel
(odd blocks, so chunk, block and page edges all fall inside patterns):
every mask field at shifted positions, sinks as a part of the merge,
query lengths, garbage, and the paged cases (chunks are runs of the page
table). It implements what its inner kernel implements, less dropout and
the weights.
"""

from absl.testing import absltest
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from tests import contract

SPLIT = aj.kernels.SplitKV(3, aj.kernels.Flash(block_q=5, block_k=7))

# Cases whose features it takes everywhere (a rule's block tables and a
# bottom-right T != S score modifier are refused: see the tests below).
SplitKvContractTest = contract.outside_suite(
    SPLIT, refuses={"float64"}, cases=(
        "causal_t_lt_s", "causal_square_lengths", "zero_length_nan_padding",
        "mqa_causal_lengths", "mask_empty_rows", "bias_neg_inf",
        "causal_sliding_window", "two_sided_window_lengths",
        "query_lengths_causal", "packed_documents_causal",
        "sinks_causal_query_lengths", "max_logits_modified_patterned",
        "positions_causal_window_rule", "positions_causal_alibi",
        "garbage_causal_window_lengths", "float64",
        "paged_prefill_window_gqa_sinks", "paged_decode_alibi_rule_mqa"))


class SplitKvTest(absltest.TestCase):

  def _operands(self, t=2, s=30):
    rng = np.random.default_rng(0)
    return (jnp.asarray(rng.standard_normal((1, 2, t, 8)), jnp.float32),
            jnp.asarray(rng.standard_normal((1, 2, s, 8)), jnp.float32),
            jnp.asarray(rng.standard_normal((1, 2, s, 8)), jnp.float32))

  def test_more_splits_than_keys_is_still_exact(self):
    q, k, v = self._operands(s=5)
    want = aj.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           implementation="dense")
    got = aj.scaled_dot_product_attention(
        q, k, v, is_causal=True, implementation=aj.kernels.SplitKV(8))
    # float32 merge of 5 one-key parts against one softmax
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)

  def test_refuses_what_a_chunk_cannot_say_by_name(self):
    q, k, v = self._operands()
    split = aj.kernels.SplitKV(2)
    with self.assertRaisesRegex(ValueError, "T != S and a score modifier"):
      aj.scaled_dot_product_attention(q, k, v, score_mod=aj.soft_cap(2.0),
                                      implementation=split)
    with self.assertRaisesRegex(ValueError, "BlockMask's tables"):
      aj.scaled_dot_product_attention(
          q, k, v, aj.block_mask(aj.prefix_lm_mask_fn(3), 2, 30),
          implementation=split)
    with self.assertRaisesRegex(ValueError, "return_weights"):
      aj.scaled_dot_product_attention(q, k, v, return_weights=True,
                                      implementation=split)
    with self.assertRaisesRegex(TypeError, "inner must be"):
      aj.kernels.SplitKV(2, "flash")

  def test_the_automatic_choice_leaves_it_out(self):
    # Not in the registry: measured slower on CPU (benchmarks/split_kv.py).
    self.assertNotIn("split_kv", [k.name for k in aj.kernels.REGISTRY])
    self.assertIn("measured", aj.kernels.SplitKV().declines(None))


if __name__ == "__main__":
  absltest.main()
