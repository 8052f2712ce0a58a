"""``aj.explain``: the kernel a call takes, every other kernel's reason, and
the flash walk's empty / full / partial block pairs.

Block counts are checked against a brute-force classification of a NumPy
mask written out from the pattern; the chosen kernel against the one
``scaled_dot_product_attention`` really runs (``aj.kernels.base.choose``
recorded).

Shape glossary: B batch, N query heads, T query length, S key/value
length, H head dim.
"""

from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj

CPU = jax.default_backend() == "cpu"


def _brute_force(allowed, bq: int, bk: int):
  """``(empty, full, partial)`` block pairs of bool ``[..., T, S]``.

  T and S padded to whole blocks with blocked entries; a padded query row
  counts as allowed wherever the last real row is (the flash core neither
  masks nor counts rows past T, so padding never makes a block partial).
  """
  *lead, t, s = allowed.shape
  nq, nk = -(-t // bq), -(-s // bk)
  grid = np.zeros((*lead, nq * bq, nk * bk), bool)
  grid[..., :t, :s] = allowed
  grid[..., t:, :] = grid[..., t - 1:t, :]
  blocks = grid.reshape(*lead, nq, bq, nk, bk)
  some, every = blocks.any((-3, -1)), blocks.all((-3, -1))
  return int((~some).sum()), int(every.sum()), int((some & ~every).sum())


def _ran(call):
  """The kernel ``call()`` runs, as ``scaled_dot_product_attention`` picks it."""
  chosen = []
  choose = aj.kernels.base.choose

  def recording(*a, **kw):
    chosen.append(choose(*a, **kw))
    return chosen[-1]

  with mock.patch.object(aj.kernels.base, "choose", recording):
    call()
  (kernel,) = chosen
  return kernel.name


def _positions(t, s):
  return np.arange(t)[:, None] + (s - t), np.arange(s)[None, :]


class BlockCountTest(parameterized.TestCase):

  def test_causal_1024_at_the_known_blocks(self):
    q = jax.ShapeDtypeStruct((1, 4, 1024, 64), jnp.float32)  # [B, N, T, H]
    why = aj.explain(q, q, q, is_causal=True)
    self.assertEqual(why.kernel, "flash")
    self.assertEqual(why.block_sizes, (512, 256))  # plain causal's rule
    pos, col = _positions(1024, 1024)
    want = _brute_force(np.broadcast_to(col <= pos, (1, 4, 1024, 1024)),
                        512, 256)
    self.assertEqual((why.empty, why.full, why.partial), want)
    self.assertEqual(why.pairs, sum(want))
    self.assertEqual(why.fractions(),
                     {"empty": 0.25, "full": 0.25, "partial": 0.5})

  @parameterized.named_parameters(
      # T, S, block sizes, causal, window, kv_lengths per example, docs,
      # exact (a single pattern's intervals are exact; intersected ones
      # may visit a block that only their combination empties).
      ("window_lengths", 96, 128, (16, 32), True, (20, 0), (128, 70), None,
       True),
      ("two_sided_window", 64, 64, (16, 16), False, (5, 9), None, None,
       True),
      ("documents", 64, 64, (16, 16), False, None, None, (10, 30, 47), True),
      ("documents_causal_lengths", 64, 64, (16, 16), True, None, (64, 41),
       (10, 30, 47), False),
      ("t_not_multiple", 50, 70, (16, 32), True, None, (70, 33), None,
       True))
  def test_patterns_against_brute_force(self, t, s, blocks, causal, window,
                                        lengths, cuts, exact):
    b = 2
    q = jax.ShapeDtypeStruct((b, 2, t, 8), jnp.float32)
    k = jax.ShapeDtypeStruct((b, 2, s, 8), jnp.float32)
    pos, col = _positions(t, s)
    allowed = np.ones((b, 1, t, s), bool)
    fields = dict(causal=causal, window=window)
    if causal:
      allowed &= col <= pos
    if window is not None:
      allowed &= (col >= pos - window[0]) & (col <= pos + window[1])
    if lengths is not None:
      fields["kv_lengths"] = jnp.array(lengths, jnp.int32)  # [B]
      allowed &= (col < np.array(lengths)[:, None, None, None])
    if cuts is not None:  # packed documents, the same cuts for both
      ids = np.searchsorted(np.array(cuts), np.arange(t), side="right")
      fields["q_segment_ids"] = jnp.asarray(np.stack([ids, ids]), jnp.int32)
      allowed &= ids[:, None] == ids[None, :]
    why = aj.explain(q, k, k, aj.Mask(**fields),
                     implementation=aj.kernels.Flash(*blocks))
    self.assertEqual(why.block_sizes, blocks)
    want = _brute_force(np.broadcast_to(allowed, (b, 2, t, s)), *blocks)
    if exact:
      self.assertEqual((why.empty, why.full, why.partial), want)
    else:  # never skips a block it must see, never calls a masked one full
      self.assertLessEqual(why.empty, want[0])
      self.assertLessEqual(why.full, want[1])
      self.assertEqual(why.pairs, sum(want))

  def test_positions_place_the_blocks(self):
    # Top-left causal (positions 0/0, T != S) and per-example offsets with
    # a window: counted at the mask's positions, as the kernel walks them.
    t, s, b = 32, 64, 2
    q = jax.ShapeDtypeStruct((b, 2, t, 8), jnp.float32)
    k = jax.ShapeDtypeStruct((b, 2, s, 8), jnp.float32)
    for q_off, kv_off, window in (((0, 0), (0, 0), None),
                                  ((40, 17), (0, -5), (20, 0))):
      mask = aj.Mask(causal=True, window=window,
                     q_offset=jnp.array(q_off), kv_offset=jnp.array(kv_off))
      why = aj.explain(q, k, k, mask,
                       implementation=aj.kernels.Flash(16, 16))
      pos = np.arange(t)[:, None] + np.array(q_off)[:, None, None, None]
      col = np.arange(s)[None, :] + np.array(kv_off)[:, None, None, None]
      allowed = col <= pos
      if window is not None:
        allowed &= col >= pos - window[0]
      want = _brute_force(np.broadcast_to(allowed, (b, 2, t, s)), 16, 16)
      self.assertEqual((why.empty, why.full, why.partial), want)

  def test_block_mask_counts_are_its_tables(self):
    t = 64
    bm = aj.block_mask(aj.prefix_lm_mask_fn(20), t, t, block_q=16,
                       block_k=16)
    q = jax.ShapeDtypeStruct((1, 2, t, 8), jnp.float32)
    why = aj.explain(q, q, q, bm, implementation="flash")
    self.assertEqual(why.block_sizes, (16, 16))
    kinds = np.asarray(bm.kinds)
    heads = 2  # one table shared by both heads
    self.assertEqual(
        (why.empty, why.partial, why.full),
        tuple(heads * int((kinds == kind).sum()) for kind in range(3)))

  def test_a_dense_mask_runs_every_visited_block_masked(self):
    q = jax.ShapeDtypeStruct((1, 1, 64, 8), jnp.float32)
    dense = np.ones((1, 1, 64, 64), bool)
    why = aj.explain(q, q, q, aj.Mask(causal=True, dense=dense),
                     implementation=aj.kernels.Flash(16, 16))
    # causality still skips the 6 blocks above the diagonal; the dense
    # mask is checked in each of the other 10, full or not.
    self.assertEqual((why.empty, why.full, why.partial), (6, 0, 10))

  def test_traced_lengths_are_not_counted(self):
    q = jnp.zeros((2, 1, 1024, 8))
    found = []

    @jax.jit
    def f(lengths):
      found.append(aj.explain(q, q, q, aj.Mask(causal=True,
                                               kv_lengths=lengths)))
      return lengths

    f(jnp.array([1024, 10], jnp.int32))
    (why,) = found
    self.assertEqual(why.kernel, "flash")
    self.assertIsNone(why.pairs)
    self.assertIsNone(why.fractions())
    self.assertIn("kv_lengths", why.note)
    # Abstract lengths inside the mask say the same.
    lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
    self.assertEqual(
        aj.explain(q, q, q, aj.Mask(causal=True, kv_lengths=lengths)), why)

  def test_abstract_and_concrete_inputs_explain_alike(self):
    lengths = jnp.array([1024, 300], jnp.int32)
    mask = aj.Mask(causal=True, kv_lengths=lengths)
    q = jnp.zeros((2, 4, 1024, 8))
    abstract = jax.ShapeDtypeStruct(q.shape, q.dtype)
    self.assertEqual(aj.explain(abstract, abstract, abstract, mask),
                     aj.explain(q, q, q, mask))


class ChoiceTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("small", 32, {}),
      ("causal_1024", 1024, dict(is_causal=True)),
      ("weights_1024", 1024, dict(is_causal=True, return_weights=True)),
      ("a_list", 32, dict(implementation=("cudnn", "flash", "dense"))),
      ("float64_list", 32, dict(implementation=("flash", "dense"),
                                x64=True)))
  def test_the_kernel_that_runs(self, t, kw):
    with jax.enable_x64(kw.pop("x64", False)):
      dtype = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
      q = jnp.zeros((1, 1, t, 8), dtype)
      why = aj.explain(q, q, q, **kw)
      ran = _ran(lambda: aj.scaled_dot_product_attention(q, q, q, **kw))
    self.assertEqual(why.kernel, ran)
    self.assertEqual(why.automatic, "implementation" not in kw)
    self.assertEqual([v.verdict for v in why.verdicts].count("runs"), 1)

  @absltest.skipUnless(CPU, "the refusals of a CPU backend")
  def test_refusals_on_cpu(self):
    q = jax.ShapeDtypeStruct((1, 4, 1024, 64), jnp.bfloat16)
    why = aj.explain(q, q, q, is_causal=True)
    self.assertEqual(
        [(v.name, v.verdict) for v in why.verdicts],
        [("cudnn", "refuses"), ("splash", "refuses"),
         ("paged_tpu", "refuses"), ("paged_gpu", "refuses"),
         ("pallas_gpu", "refuses"), ("gathered", "refuses"),
         ("flash", "runs"),
         ("dense", "not tried")])
    self.assertIn("it needs a GPU, the backend is 'cpu'", why.reason("cudnn"))
    self.assertIn("needs a TPU", why.reason("splash"))
    self.assertEqual(why.reason("dense"), "would take it")
    table = str(why)
    for line in ("cudnn       refuses    it needs a GPU",
                 "flash       runs", "blocks 512 x 256",
                 "empty             8   25.00%  skipped"):
      self.assertIn(line, table)

  def test_declines_and_nothing_fits(self):
    q = jnp.zeros((1, 1, 32, 8))
    why = aj.explain(q, q, q)
    self.assertEqual(why.kernel, "dense")
    self.assertEqual(why.verdicts[-2].verdict, "declines")
    self.assertIn("below 1048576", why.reason("flash"))
    self.assertIsNone(why.block_sizes)
    self.assertIn("no blocks", why.note)
    # Nothing takes it: explained, not raised; the call raises the same.
    kw = dict(implementation=("cudnn", "flash"), return_weights=True)
    why = aj.explain(q, q, q, **kw)
    self.assertIsNone(why.kernel)
    self.assertEqual([v.verdict for v in why.verdicts], ["refuses"] * 2)
    with self.assertRaises(ValueError) as raised:
      aj.scaled_dot_product_attention(q, q, q, **kw)
    for v in why.verdicts:
      self.assertIn(f"{v.name}: {v.reason}", str(raised.exception))
    self.assertIn("nothing (the call raises)", str(why))

  def test_bad_arguments_raise_as_the_call_does(self):
    q = jnp.zeros((1, 1, 8, 4))
    with self.assertRaisesRegex(ValueError, "dropout_rng"):
      aj.explain(q, q, q, dropout_rate=0.5)
    with self.assertRaisesRegex(ValueError, "one of \\['cudnn', 'splash', "
                                "'paged_tpu', 'paged_gpu', 'pallas_gpu', "
                                "'gathered', 'flash', "
                                "'dense'\\]"):
      aj.explain(q, q, q, implementation="flahs")


class NamesTest(absltest.TestCase):

  def test_one_name_per_kernel(self):
    self.assertEqual(aj.kernels.Flash.name, "flash")
    self.assertEqual(aj.kernels.Dense.name, "dense")
    names = [kernel.name for kernel in aj.kernels.REGISTRY]
    self.assertEqual(len(names), len(set(names)))
    with self.assertRaisesRegex(ValueError, "got 'blockwise'"):
      aj.kernels.by_name("blockwise")  # the function's name, not a kernel's


if __name__ == "__main__":
  absltest.main()
