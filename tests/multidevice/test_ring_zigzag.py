"""Ring attention in the zigzag layout, and with a dense mask and a bias.

Device ``i`` of ``P`` holds the global chunks ``i`` and ``2P - 1 - i`` (of
``2P``); the caller permutes tokens, segment ids and the dense mask's and
bias's rows and columns into that order (``ring_layout.zigzag``) and the
outputs back. Each call here runs on global arrays, permuted and sharded
inside the differentiated function, against the float64 reference
``tests/reference.masked_attention`` (outputs, lse or row maxima, and the
gradients of q, k, v, the bias, the sinks and ALiBi's slopes).

Shape glossary: B batch, N query heads, K key/value heads, T query length,
S key/value length, H head dim, P devices.
"""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

import attention_jax as aj
from attention_jax.kernels import ring
from attention_jax.kernels import ring_layout
from tests import _data
from tests import reference

# float32 online softmax over <= 32 keys, merged once per chunk pair and
# ring step (a few roundings each): the contract's float32 budgets.
FWD_TOL = dict(atol=1e-5, rtol=1e-5)
GRAD_TOL = 5e-5  # times max(1, the largest reference gradient)
SEQ = P(None, None, "seq")  # [B, N, T, H] with T split over the ring
B, N, K, H = 2, 4, 2, 8


def _mesh(devices):
  return jax.make_mesh((devices,), ("seq",), devices=jax.devices()[:devices],
                       axis_types=(jax.sharding.AxisType.Auto,))


def _order(x, devices, layout, axis):
  """``x`` laid out as the devices hold it (size-1 axes as they are)."""
  if layout != "zigzag" or x.shape[axis] == 1:
    return x
  return ring_layout.zigzag(x, devices, axis=axis)


def _ring(devices, layout, q, k, v, ids, dense, bias, extras, *, mask,
          **call):
  """``aj.ring_attention`` on global ``[B, N|K, T|S, H]`` arrays: permuted
  into ``layout``, sharded (ids ``[B, T]`` and dense/bias rows of full
  length by the sequence; the rest replicated), run, gathered and
  permuted back (the output and the per-row result after it)."""
  t = q.shape[-2]
  order = functools.partial(_order, devices=devices, layout=layout)
  q, k, v = (order(x, axis=-2) for x in (q, k, v))
  ids = None if ids is None else order(ids, axis=-1)
  dense, bias = ((None if x is None else order(order(x, axis=-2), axis=-1))
                 for x in (dense, bias))

  def rows(x):  # this device's rows when it has them, else replicated
    return P() if x is None or x.shape[-2] != t else P(None, None, "seq")

  def local(q, k, v, ids, dense, bias, extras):
    m = aj.Mask(dense=dense, q_segment_ids=ids, **mask)
    mod = aj.alibi(extras["slopes"]) if "slopes" in extras else None
    return aj.ring_attention(
        q, k, v, m, bias=bias, sinks=extras.get("sinks"), score_mod=mod,
        axis_name="seq", block_q=2, block_k=3, layout=layout, **call)

  out = jax.shard_map(
      local, mesh=_mesh(devices),
      in_specs=(SEQ, SEQ, SEQ, P(None, "seq"), rows(dense), rows(bias),
                P()),
      out_specs=(SEQ, SEQ))(q, k, v, ids, dense, bias, extras)
  inverse = lambda x, axis: x if layout != "zigzag" else (  # noqa: E731
      ring_layout.unzigzag(x, devices, axis=axis))
  return inverse(out[0], -2), inverse(out[1], -1)


def _check(test, devices, layout, *, t=32, allowed, rows=None, dense=None,
           bias=None, extras=None, segment_ids=None, max_logits=False,
           **mask):
  """Ring vs the float64 reference: outputs, the second result (lse, or
  the row maxima), gradients of q, k, v, bias and the extras."""
  extras = extras or {}
  q = _data.normal(0, (B, N, t, H))
  k, v = _data.normal(1, (B, K, t, H)), _data.normal(2, (B, K, t, H))
  cot = _data.normal(3, (B, N, t, H))
  cot_row = _data.normal(4, (B, N, t))
  ids = None if segment_ids is None else jnp.asarray(segment_ids)
  call = dict(return_max_logits=True) if max_logits else dict(
      return_lse=True)

  def loss(q, k, v, bias, extras):
    out, row = _ring(devices, layout, q, k, v, ids, dense, bias, extras,
                     mask=mask, **call)
    total = jnp.sum(out * cot)
    if not max_logits:  # through lse too (no gradient through maxima)
      total += jnp.sum(jnp.where(jnp.isfinite(row), row, 0.0) * cot_row)
    return total, (out, row)

  argnums = (0, 1, 2, 4) + ((3,) if bias is not None else ())
  (_, (out, row)), grads = jax.jit(jax.value_and_grad(
      loss, argnums, has_aux=True))(q, k, v, bias, extras)

  f64 = lambda x: None if x is None else np.asarray(x, np.float64)  # noqa
  rows_ok = None if rows is None else rows[:, None, :]  # [B, 1, T]

  def ref_loss(q, k, v, bias, extras):
    out, lse = reference.masked_attention(
        q, k, v, bias, allowed, rows=rows_ok, **extras)
    total = jnp.sum(out * f64(cot))
    if not max_logits:
      total += jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * f64(cot_row))
    return total, (out, lse)

  with jax.enable_x64(True):
    (_, (want_out, want_lse)), want = jax.value_and_grad(
        ref_loss, argnums, has_aux=True)(
            f64(q), f64(k), f64(v), f64(bias),
            {n: f64(x) for n, x in extras.items()})
  chex.assert_trees_all_close(np.asarray(out, np.float64), want_out,
                              **FWD_TOL)
  if max_logits:  # the raw scale * q.k where allowed, float64
    kk = np.repeat(f64(k), N // K, axis=1)
    raw = np.einsum("bnth,bnsh->bnts", f64(q), kk) / np.sqrt(H)
    want_row = np.where(allowed, raw, -np.inf).max(-1)
  else:
    want_row = np.asarray(want_lse)
  np.testing.assert_allclose(np.asarray(row, np.float64), want_row,
                             **FWD_TOL)
  names = ["dq", "dk", "dv", "extras"] + (["dbias"] if bias is not None
                                          else [])
  for name, got, ref in zip(names, grads, want):
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
      g, r = np.asarray(g, np.float64), np.asarray(r)
      test.assertTrue(np.isfinite(g).all(), name)
      scale = max(1.0, float(np.abs(r).max()))
      np.testing.assert_allclose(g, r, atol=GRAD_TOL * scale,
                                 rtol=GRAD_TOL, err_msg=name)


def _segments(t):
  """Packed documents ``[B, T]``: cuts that straddle chunks."""
  cuts = ((5, 13, 26), (9, 10, 21))
  return np.stack([np.searchsorted(np.array(c), np.arange(t), side="right")
                   for c in cuts]).astype(np.int32)


class ZigzagTest(parameterized.TestCase):

  def test_causal_lengths_segments_sinks_alibi(self):
    # 4 devices x 8 rows (two chunks of 4), GQA, ragged 2 x 3 blocks.
    t, devices = 32, 4
    lengths, q_lengths = np.array([32, 21]), np.array([30, 32])
    ids = _segments(t)
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    allowed = ((j <= i)[None] & (j < lengths[:, None, None])
               & (i < q_lengths[:, None, None])
               & (ids[:, :, None] == ids[:, None, :]))[:, None]
    extras = {"sinks": 0.5 * _data.normal(5, (N,)),
              "slopes": jnp.abs(_data.normal(6, (N,))) * 0.3}
    _check(self, devices, "zigzag", allowed=np.broadcast_to(
        allowed, (B, N, t, t)), rows=np.arange(t)[None] < q_lengths[:, None],
           extras=extras, segment_ids=ids, causal=True,
           kv_lengths=jnp.asarray(lengths), q_lengths=jnp.asarray(q_lengths))

  def test_window_rule_dense_mask_bias_max_logits(self):
    # 8 devices x 4 rows: a causal window, a chunked rule (at global
    # positions), a random dense mask and a bias with a -inf column, their
    # rows sharded and their columns whole, in the zigzag order.
    t, devices, chunk = 32, 8, 8
    dense = np.asarray(_data.bernoulli(7, 0.8, (B, 1, t, t)))
    bias = np.array(_data.normal(8, (1, N, t, t)))
    bias[0, 1, :, 6] = -np.inf  # a key no query of head 1 may see
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    allowed = ((j <= i) & (j >= i - 5) & (i // chunk == j // chunk)) & dense
    allowed = allowed & np.isfinite(bias)
    _check(self, devices, "zigzag", allowed=allowed, dense=jnp.asarray(dense),
           bias=jnp.asarray(bias), max_logits=True, causal=True,
           window=(5, 0), rule=aj.chunked_mask_fn(chunk))

  @parameterized.parameters("contiguous", "zigzag")
  def test_replicated_key_mask_and_bias(self, layout):
    # A key-padding mask [B, 1, 1, S] and a key bias [1, N, 1, S]: one row,
    # replicated on every device (the bias's gradient is every device's
    # share, summed).
    t, devices = 16, 4
    dense = np.ones((B, 1, 1, t), bool)
    dense[0, ..., 3:7] = False
    dense[1, ..., 11:] = False
    bias = _data.normal(9, (1, N, 1, t))
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    allowed = np.broadcast_to((j <= i) & dense, (B, N, t, t))
    _check(self, devices, layout, t=t, allowed=allowed,
           dense=jnp.asarray(dense), bias=bias, causal=True)

  def test_window_skips_steps_and_their_ppermutes(self):
    # A causal window within a chunk's neighbour: device i's chunk i needs
    # device i - 1's keys (step 1), its chunk 2P - 1 - i device i + 1's
    # (step P - 1); the other steps are never made: no compute, no
    # ppermute (one each for K and V per step made), exact numbers.
    t, devices = 64, 8  # chunks of 4 rows: a window of 3 reaches one back
    q, k, v = (_data.normal(10 + n, (1, 2, t, 8)) for n in range(3))
    mask = aj.Mask(causal=True, window=(3, 0))
    self.assertEqual(ring.needed_steps((3, 0), 8, 8, devices, 0, "zigzag"),
                     (0, 1, devices - 1))
    fn = jax.jit(jax.shard_map(
        lambda q, k, v: aj.ring_attention(q, k, v, mask, axis_name="seq",
                                          block_q=2, block_k=2,
                                          layout="zigzag"),
        mesh=_mesh(devices), in_specs=SEQ, out_specs=SEQ))
    zig = [ring_layout.zigzag(x, devices) for x in (q, k, v)]
    hlo = fn.lower(*zig).compile().as_text()
    permutes = [line for line in hlo.splitlines()
                if "collective-permute(" in line]
    self.assertLen(permutes, 2 * 2)
    want, _ = reference.sdpa(q, k, v, np.tril(np.ones((t, t), bool))
                             & np.triu(np.ones((t, t), bool), -3))
    chex.assert_trees_all_close(
        ring_layout.unzigzag(fn(*zig), devices), want.astype(np.float32),
        **FWD_TOL)

  def test_round_trip(self):
    x = _data.normal(13, (2, 3, 24, 4))  # [B, N, T, H]
    for devices in (4, 6):
      np.testing.assert_array_equal(
          ring_layout.unzigzag(ring_layout.zigzag(x, devices), devices), x)
    ids = np.arange(24)[None].repeat(2, 0)  # [B, T]
    z = ring_layout.zigzag(ids, 4, axis=-1)
    np.testing.assert_array_equal(z[0, :6], [0, 1, 2, 21, 22, 23])
    np.testing.assert_array_equal(ring_layout.unzigzag(z, 4, axis=-1), ids)

  def test_zigzag_moves_chunks_not_the_whole_sequence(self):
    # The permutation is x[zigzag_indices]; on an array sharded along the
    # sequence XLA moves chunks between devices (collective permutes),
    # never gathering the whole axis on one (a gather by index would).
    x = _data.normal(14, (2, 3, 64, 4))  # [B, N, T, H]
    perm = ring_layout.zigzag_indices(64, 4)
    np.testing.assert_array_equal(ring_layout.zigzag(x, 4), x[:, :, perm])
    np.testing.assert_array_equal(
        ring_layout.unzigzag(x[:, :, perm], 4), x)
    sharded = jax.sharding.NamedSharding(_mesh(4), SEQ)
    for fn in (ring_layout.zigzag, ring_layout.unzigzag):
      hlo = jax.jit(lambda x, fn=fn: jax.lax.with_sharding_constraint(
          fn(x, 4), sharded)).lower(jax.device_put(x, sharded)).compile(
              ).as_text()
      ops = [line.split("=")[1].split("(")[0].split()[-1]
             for line in hlo.splitlines()
             if "all-gather(" in line or "collective-permute(" in line]
      self.assertNotIn("all-gather", ops)
      self.assertIn("collective-permute", ops)

  def test_refusals(self):
    x = jnp.ones((1, 24, 8))  # [B, T, H], T split over "seq"
    spec = P(None, "seq")

    def run(fn, devices=4):
      return jax.shard_map(fn, mesh=_mesh(devices), in_specs=spec,
                           out_specs=spec)(x)

    with self.assertRaisesRegex(
        ValueError, r"layout='zigzag' holds two chunks .* lengths must be "
        r"even: T = 3, S = 3 on 8 devices \(global 24 and 24\)\. Pad the "
        r"global lengths to multiples of 2 \* 8 = 16"):
      run(lambda q: aj.ring_attention(q, q, q, axis_name="seq",
                                      is_causal=True, layout="zigzag"), 8)
    with self.assertRaisesRegex(ValueError, r"Ring's layout must be one of "
                                r"\('contiguous', 'zigzag'\), got 'striped'"):
      run(lambda q: aj.ring_attention(q, q, q, axis_name="seq",
                                      layout="striped"))
    # this device's [B, T, S] (6 x 6) instead of its rows of every key
    # column ([6, 24]): refused naming both; a bias likewise.
    with self.assertRaisesRegex(
        ValueError, r"the mask's dense field has shape \(1, 6, 6\).*= \[1, "
        r"6\|1, 24\|1\] \(T_local = 6 .* P\*S_local = 4 \* 6 = 24"):
      run(lambda q: aj.ring_attention(q, q, q, jnp.ones((1, 6, 6), bool),
                                      axis_name="seq", layout="zigzag"))
    with self.assertRaisesRegex(ValueError,
                                r"the bias has shape \(1, 24, 24\)"):
      run(lambda q: aj.ring_attention(q, q, q, axis_name="seq",
                                      bias=jnp.ones((1, 24, 24)),
                                      layout="zigzag"))
    with self.assertRaisesRegex(ValueError,
                                r"length=20 is not a multiple of 2 \* "
                                r"devices = 8 \(devices=4\)"):
      ring_layout.zigzag(jnp.ones((20, 8)), 4)


if __name__ == "__main__":
  absltest.main()
