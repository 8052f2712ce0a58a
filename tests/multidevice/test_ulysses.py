"""ulysses_attention (all-to-all) and its hybrid with the ring, on 4 and 8
devices, against the float64 reference (outputs and gradients)."""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

import attention_jax as aj
from attention_jax.attention.ulysses import ulysses_attention
from tests import _data
from tests import reference
from tests import sequence_parallel_harness as harness

# float32 against float64 over <= 32 keys: ~1e-6 per product, a few more
# roundings through the online softmax's merges and the flash backward's
# recomputed weights (the contract's float32 budget).
FWD_TOL, GRAD_TOL = 1e-5, 5e-5
B, H = 2, 8
SEQ = P(None, None, "seq")


def _mesh(devices):
  return jax.make_mesh((devices,), ("seq",), devices=jax.devices()[:devices],
                       axis_types=(jax.sharding.AxisType.Auto,))


def _allowed(t, s, n, *, causal=False, window=None, kv_lengths=None,
             q_lengths=None, segments=None, head_rule=False, dense=None):
  """Where query t may see key s, ``[B, N, T, S]``, written out."""
  i, j = np.arange(t)[:, None], np.arange(s)[None, :]
  allowed = np.ones((B, n, t, s), bool)
  if causal:
    allowed &= j <= i + (s - t)
  if window is not None:
    left, right = window
    allowed &= (j >= i + (s - t) - left) & (j <= i + (s - t) + right)
  if kv_lengths is not None:
    allowed &= (j < np.asarray(kv_lengths)[:, None, None, None])
  if q_lengths is not None:
    allowed &= (i < np.asarray(q_lengths)[:, None, None, None])
  if segments is not None:
    q_segment_ids, kv_segment_ids = segments
    allowed &= (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])[:, None]
  if head_rule:  # _head_rule: head h skips the first h keys
    allowed &= j >= np.arange(n)[:, None, None]
  if dense is not None:
    allowed &= np.asarray(dense)
  return allowed


def _documents(t, cuts):
  """Sorted segment ids ``[B, T]``: documents starting after each cut."""
  return np.stack([np.searchsorted(c, np.arange(t), side="right")
                   for c in cuts]).astype(np.int32)


def _head_rule(b, h, q_idx, kv_idx):
  del b, q_idx
  return kv_idx >= h


def _loss(out, lse, cot, cot_lse):
  total = jnp.sum(out.astype(jnp.float32) * cot)
  if lse is not None:  # -inf rows contribute nothing
    total = total + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * cot_lse)
  return total


class UlyssesTest(parameterized.TestCase):

  def _check(self, run, q, k, v, allowed, diff, *, rows=None,
             positions=None, lse=True):
    """``run(q, k, v, diff) -> (out, lse or None)`` on global arrays vs
    ``reference.masked_attention`` (float64): outputs, lse and the
    gradients of q, k, v and each of ``diff`` (bias, sinks, slopes)."""
    t = q.shape[2]
    cot = _data.normal(70, q.shape[:3] + v.shape[-1:])
    cot_lse = _data.normal(71, q.shape[:3])

    def ours(q, k, v, diff):
      out, got_lse = run(q, k, v, diff)
      return _loss(out, got_lse if lse else None, cot, cot_lse), (out,
                                                                  got_lse)

    (_, (out, got_lse)), grads = jax.jit(jax.value_and_grad(
        ours, (0, 1, 2, 3), has_aux=True))(q, k, v, diff)
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731

    def theirs(q, k, v, diff):
      out, want_lse = reference.masked_attention(
          q, k, v, diff.get("bias"), allowed, sinks=diff.get("sinks"),
          slopes=diff.get("slopes"), rows=rows, positions=positions)
      return _loss(out, want_lse if lse else None, f64(cot),
                   f64(cot_lse)), (out, want_lse)

    with jax.enable_x64(True):
      (_, (want, want_lse)), want_grads = jax.jit(jax.value_and_grad(
          theirs, (0, 1, 2, 3), has_aux=True))(
              f64(q), f64(k), f64(v), jax.tree.map(f64, diff))
    chex.assert_shape(out, q.shape[:3] + v.shape[-1:])
    self.assertEqual(out.dtype, q.dtype)
    np.testing.assert_allclose(out, want, atol=FWD_TOL, rtol=FWD_TOL)
    if lse:
      chex.assert_shape(got_lse, (q.shape[0], q.shape[1], t))
      np.testing.assert_allclose(got_lse, want_lse, atol=FWD_TOL,
                                 rtol=FWD_TOL)
    names = ["dq", "dk", "dv"] + [f"d{n}" for n in diff]
    got_all = list(grads[:3]) + [grads[3][n] for n in diff]
    want_all = list(want_grads[:3]) + [want_grads[3][n] for n in diff]
    for name, got, ref in zip(names, got_all, want_all):
      scale = max(1.0, float(np.abs(ref).max()))  # sums over many rows
      np.testing.assert_allclose(got, ref, atol=GRAD_TOL * scale,
                                 rtol=GRAD_TOL, err_msg=name)

  @parameterized.named_parameters(
      # 4 devices, N = 4: one query head each; K = 2 < P: each key/value
      # head repeated twice before the all-to-all. The automatic kernel.
      dict(testcase_name="gqa_repeat_causal_window_lengths_4", devices=4,
           n=4, kv_heads=2, implementation=None),
      # 8 devices, N = 8, K = 8 split; the flash kernel at ragged blocks.
      dict(testcase_name="mha_flash_8", devices=8, n=8, kv_heads=8,
           implementation=aj.kernels.Flash(block_q=5, block_k=3)),
  )
  def test_pattern_and_lengths(self, devices, n, kv_heads, implementation):
    t = s = 24
    q = _data.normal(0, (B, n, t, H))
    k, v = (_data.normal(i, (B, kv_heads, s, H)) for i in (1, 2))
    kv_lengths, q_lengths = np.array([24, 15]), np.array([20, 24])
    ids = _documents(t, ([7, 15], [3, 20]))  # [B, T], sharded like q
    parts = dict(causal=True, window=(9, 0), kv_lengths=jnp.asarray(
        kv_lengths), q_lengths=jnp.asarray(q_lengths),
                 q_segment_ids=jnp.asarray(ids))
    run = harness.make(devices=devices, implementation=implementation)
    rows = (np.arange(t) < q_lengths[:, None])[:, None]  # [B, 1, T]
    self._check(lambda q, k, v, d: run(q, k, v, parts, return_lse=True),
                q, k, v, _allowed(t, s, n, causal=True, window=(9, 0),
                                  kv_lengths=kv_lengths, q_lengths=q_lengths,
                                  segments=(ids, ids)), {}, rows=rows)

  def test_global_head_alibi_sinks_rule(self):
    # What reads the head: ALiBi's slopes [N], sinks [N] and a rule on h
    # see the global head on every device (a wrong shift moves them all).
    # K = 1 (MQA) on 4 devices: the one head repeated 4 times.
    n, t = 4, 24
    q = _data.normal(3, (B, n, t, H))
    k, v = (_data.normal(i, (B, 1, t, H)) for i in (4, 5))
    diff = {"sinks": 0.5 * _data.normal(6, (n,)),
            "slopes": jnp.abs(_data.normal(7, (n,))) * 0.3}
    run = harness.make(implementation="flash")
    self._check(
        lambda q, k, v, d: run(q, k, v, dict(causal=True, rule=_head_rule),
                               sinks=d["sinks"],
                               score_mod=aj.alibi(d["slopes"]),
                               return_lse=True),
        q, k, v, _allowed(t, t, n, causal=True, head_rule=True), diff)

  @parameterized.parameters("contiguous", "zigzag")
  def test_dense_mask_and_bias(self, layout):
    # A dense mask [B, 1, T, S] and a per-head bias [1, N, T, S]: each
    # device passes its rows (every key column), in the layout's order
    # (the harness permutes rows and columns for zigzag). Bias gradients.
    n, t, s = 4, 16, 24
    q = _data.normal(8, (B, n, t, H))
    k, v = (_data.normal(i, (B, 2, s, H)) for i in (9, 10))
    dense = np.array(_data.bernoulli(11, 0.7, (B, 1, t, s)))
    dense[0, 0, 3] = False  # a row that sees nothing
    bias = _data.normal(12, (1, n, t, s))
    run = harness.make(layout=layout)
    self._check(
        lambda q, k, v, d: run(q, k, v, dict(causal=True,
                                             dense=jnp.asarray(dense)),
                               bias=d["bias"], return_lse=True),
        q, k, v, _allowed(t, s, n, causal=True, dense=dense),
        {"bias": bias})

  def test_block_mask_per_head_tables(self):
    # A BlockMask with per-(b, h) tables, built for the whole sequence:
    # each device keeps its heads' tables and its rule sees the global h.
    n, t = 4, 16
    q, k, v = (_data.normal(i, (B, n, t, H)) for i in (13, 14, 15))
    bm = aj.block_mask(lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx)
                       & (kv_idx >= h), t, t, batch=(1, n), block_q=4,
                       block_k=4)
    run = harness.make(implementation="flash")
    self._check(lambda q, k, v, d: run(q, k, v, dict(rule=bm),
                                       return_lse=True),
                q, k, v, _allowed(t, t, n, causal=True, head_rule=True), {})

  def test_fused_kernel_interpreted(self):
    # A fused kernel runs unchanged on each device's whole sequence of its
    # heads (Pallas's interpreter; Triton's smallest 16-blocks): causal
    # and ALiBi, which reads the global head. A pallas_call inside
    # shard_map needs check_vma=False (its outputs carry no varying
    # axes): the replicated slopes' gradient is then summed all the same.
    n, t = 4, 32
    q, k, v = (_data.normal(i, (1, n, t, 16)) for i in (16, 17, 18))
    diff = {"slopes": jnp.abs(_data.normal(19, (n,))) * 0.3}
    run = harness.make(implementation=aj.kernels.PallasGpu(
        block_q=16, block_k=16, interpret=True), check_vma=False)
    self._check(
        lambda q, k, v, d: (run(q, k, v, dict(causal=True),
                                score_mod=aj.alibi(d["slopes"])), None),
        q, k, v, _allowed(t, t, n, causal=True)[:1], diff, lse=False)

  @parameterized.named_parameters(
      # 2 groups of 4: segment ids (gathered within the group), sinks.
      dict(testcase_name="ring2_a2a4", devices=8, layout="contiguous",
           more=True),
      dict(testcase_name="ring2_a2a2", devices=4, layout="contiguous",
           more=False),
      # the ring's load-balanced layout (the harness permutes by 2 chunks
      # per ring device)
      dict(testcase_name="ring2_a2a2_zigzag", devices=4, layout="zigzag",
           more=False),
  )
  def test_hybrid(self, devices, layout, more):
    # All-to-all within each group of "seq", a ring over "ring" across the
    # 2 groups: causal, ALiBi (the global head), GQA (K = 4 of N = 8).
    n, t = 8, 16
    q = _data.normal(20, (B, n, t, H))
    k, v = (_data.normal(i, (B, 4, t, H)) for i in (21, 22))
    ids = _documents(t, ([5, 9], [3, 14])) if more else None
    diff = {"slopes": jnp.abs(_data.normal(24, (n,))) * 0.3}
    parts = dict(causal=True)
    if more:
      parts["q_segment_ids"] = jnp.asarray(ids)
      diff["sinks"] = 0.5 * _data.normal(23, (n,))
    run = harness.make(rings=2, devices=devices, layout=layout, block_q=4,
                       block_k=4)
    self._check(
        lambda q, k, v, d: run(q, k, v, parts, sinks=d.get("sinks"),
                               score_mod=aj.alibi(d["slopes"]),
                               return_lse=True),
        q, k, v, _allowed(t, t, n, causal=True,
                          segments=None if ids is None else (ids, ids)),
        diff)

  def test_four_all_to_alls_forward(self):
    # q, k, v there and the output back: 4 all-to-alls in the compiled
    # program; the lse is a fifth.
    x = _data.normal(25, (1, 4, 16, 8))  # [B, N, T, H]
    for return_lse, count in ((False, 4), (True, 5)):
      spec = (SEQ, SEQ) if return_lse else SEQ
      fn = jax.jit(jax.shard_map(
          functools.partial(ulysses_attention, axis_name="seq",
                            is_causal=True, return_lse=return_lse),
          mesh=_mesh(4), in_specs=(SEQ,) * 3, out_specs=spec))
      hlo = fn.lower(x, x, x).compile().as_text()
      ops = [line for line in hlo.splitlines() if " all-to-all(" in line]
      self.assertLen(ops, count, "\n".join(ops))

  def test_refusals(self):
    def call(q, kv, devices=4, **kw):
      spec = P(None, None, "seq")
      return jax.shard_map(
          lambda q, kv: ulysses_attention(q, kv, kv, axis_name="seq", **kw),
          mesh=_mesh(devices), in_specs=(spec, spec), out_specs=spec)(q, kv)

    q6 = jnp.ones((1, 6, 8, 8))  # [B, N, T, H]
    with self.assertRaisesRegex(
        ValueError, r"query heads N = 6 do not split over the P = 4 "
        r"devices of axis_name='seq'.*divides 6, or ring_attention"):
      call(q6, q6)
    with self.assertRaisesRegex(
        ValueError, r"key/value heads K = 3 neither split over the P = 2 "
        r"devices .* nor divide them"):
      call(q6, jnp.ones((1, 3, 8, 8)), devices=2)
    x = jnp.ones((1, 4, 8, 8))
    with self.assertRaisesRegex(ValueError,
                                r"axis_name='seq' is not bound: call "
                                r"ulysses_attention inside jax.shard_map"):
      ulysses_attention(x, x, x, axis_name="seq")
    with self.assertRaisesRegex(ValueError, r"\[B, N, T, H\], \[B, K, S, H\]"):
      call(jnp.ones((1, 8, 8)), jnp.ones((1, 8, 8)))
    with self.assertRaisesRegex(ValueError, r"implementation='flash' was "
                                r"given too"):
      call(x, x, implementation="flash", block_q=4)
    with self.assertRaisesRegex(ValueError, r"bias has shape \(1, 4, 8, 8\)"
                                r".*\[B\|1, 4\|1, 2\|1, 8\|1\]"):
      call(x, x, bias=jnp.ones((1, 4, 8, 8)))  # global rows, not 8 / 4
    with self.assertRaisesRegex(ValueError, r"layout must be one of"):
      call(x, x, layout="striped")
    with self.assertRaisesRegex(ValueError, r"T = 1 and S = 1 must be even"):
      call(jnp.ones((1, 4, 4, 8)), jnp.ones((1, 4, 4, 8)), layout="zigzag")
    mesh = jax.make_mesh((2, 2), ("ring", "seq"),
                         devices=jax.devices()[:4],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    spec = P(None, None, ("ring", "seq"))
    with self.assertRaisesRegex(ValueError, r"ring_axis='ring'\) runs the "
                                r"ring kernel .* would be ignored"):
      jax.shard_map(
          lambda q: ulysses_attention(q, q, q, axis_name="seq",
                                      ring_axis="ring",
                                      implementation="flash"),
          mesh=mesh, in_specs=spec, out_specs=spec)(x)


if __name__ == "__main__":
  absltest.main()
