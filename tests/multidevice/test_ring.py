"""ring_attention on 2, 4 and 8 devices against blockwise and float64 references."""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

import attention_jax as aj
from tests import _data
from tests import reference

# Same budgets as test_blockwise: ring attention is the same float32 online
# softmax with one more merge per device (a few roundings).
FWD_TOL = dict(atol=1e-5, rtol=1e-5)
GRAD_TOL = dict(atol=5e-5, rtol=5e-5)
SEQ = P(None, None, "seq")  # [B, N, T, H] with T split over the ring


def _mesh(devices):
  return jax.make_mesh((devices,), ("seq",), devices=jax.devices()[:devices],
                       axis_types=(jax.sharding.AxisType.Auto,))


def _ring_fn(devices, **kwargs):
  def local(q, k, v, lengths):
    return aj.ring_attention(q, k, v, aj.Mask(kv_lengths=lengths),
                             axis_name="seq", block_q=4, block_k=2, **kwargs)
  return jax.shard_map(local, mesh=_mesh(devices),
                       in_specs=(SEQ, SEQ, SEQ, P()), out_specs=SEQ)


class RingAttentionTest(parameterized.TestCase):

  @parameterized.parameters((2, True), (4, False), (8, True))
  def test_matches_references(self, devices, causal):
    t = 5 * devices  # 5 rows per device: ragged 4-row blocks inside
    q = _data.normal(0, (2, 2, t, 8))
    k = _data.normal(1, (2, 1, t, 8))  # one KV head shared by 2 (GQA)
    v = _data.normal(2, (2, 1, t, 6))
    lengths = jnp.array([t, t - 7])  # uneven valid lengths, [B]
    cot = _data.normal(3, (2, 2, t, 6))
    ring = jax.jit(_ring_fn(devices, is_causal=causal))
    out = ring(q, k, v, lengths)
    mask = np.arange(t)[None, :] < np.asarray(lengths)[:, None]  # [B, S]
    ref, _ = reference.sdpa(q, k, v, mask[:, None, None], is_causal=causal)
    chex.assert_trees_all_close(out, ref.astype(np.float32), **FWD_TOL)

    def loss(fn, q, k, v):
      return jnp.sum(fn(q, k, v) * cot)

    got = jax.jit(jax.grad(functools.partial(
        loss, lambda q, k, v: ring(q, k, v, lengths)), (0, 1, 2)))(q, k, v)
    block = lambda q, k, v: aj.blockwise_attention(
        q, k, v, aj.Mask(kv_lengths=lengths), is_causal=causal)
    want = jax.jit(jax.grad(functools.partial(loss, block), (0, 1, 2)))(
        q, k, v)
    chex.assert_tree_all_finite(got)
    chex.assert_trees_all_close(got, want, **GRAD_TOL)

  def test_more_keys_than_queries_causal(self):
    # T != S per device: bottom-right causality on the global lengths.
    q = _data.normal(4, (1, 1, 12, 8))  # 3 per device
    k = _data.normal(5, (1, 1, 20, 8))  # 5 per device
    v = _data.normal(6, (1, 1, 20, 8))
    ring = jax.jit(jax.shard_map(
        lambda q, k, v: aj.ring_attention(q, k, v, axis_name="seq",
                                          is_causal=True, block_k=2),
        mesh=_mesh(4), in_specs=SEQ, out_specs=SEQ))
    ref, _ = reference.sdpa(q, k, v, is_causal=True)
    chex.assert_trees_all_close(ring(q, k, v), ref.astype(np.float32),
                                **FWD_TOL)

  def test_lse_and_rows_with_nothing_to_attend(self):
    # causal with T > S: the first 8 global rows see no key: output 0.
    q = _data.normal(7, (1, 16, 8))
    k = _data.normal(8, (1, 8, 8))
    spec = P(None, "seq")
    ring = jax.jit(jax.shard_map(
        lambda q, k: aj.ring_attention(q, k, k, axis_name="seq",
                                       is_causal=True, return_lse=True),
        mesh=_mesh(4), in_specs=spec, out_specs=(spec, spec)))
    out, lse = ring(q, k)
    _, want_lse = aj.blockwise_attention(q, k, k, is_causal=True,
                                         return_lse=True)
    np.testing.assert_array_equal(out[0, :8], 0.0)
    np.testing.assert_array_equal(lse[0, :8], -np.inf)
    chex.assert_trees_all_close(lse, want_lse, **FWD_TOL)

  @parameterized.parameters(((3, 0), True, 1), ((7, 0), True, 2),
                            ((2, 2), False, 2))
  def test_window_skips_ring_steps(self, window, causal, shifts):
    # 8 devices x 4 rows: a window reaching k blocks back needs k shifts of
    # K and V forward, not P - 1 = 7; the numbers stay exact.
    t = 32
    q = _data.normal(9, (1, 2, t, 8))
    k = _data.normal(10, (1, 2, t, 8))
    v = _data.normal(11, (1, 2, t, 8))
    fn = jax.jit(jax.shard_map(
        lambda q, k, v: aj.ring_attention(q, k, v, aj.Mask(window=window),
                                          axis_name="seq", is_causal=causal,
                                          block_q=4, block_k=4),
        mesh=_mesh(8), in_specs=SEQ, out_specs=SEQ))
    hlo = fn.lower(q, k, v).compile().as_text()
    permutes = [line for line in hlo.splitlines()
                if "collective-permute(" in line]
    # One ppermute each for K and V per step made (a two-sided window
    # makes one step forward and one that wraps round to the right).
    self.assertLen(permutes, 2 * shifts)
    want = aj.blockwise_attention(q, k, v, aj.Mask(window=window),
                                  is_causal=causal)
    chex.assert_trees_all_close(fn(q, k, v), want, **FWD_TOL)

  def test_score_mod_with_a_learned_slope(self):
    # A ScoreMod's parameter passed into shard_map (replicated): its
    # gradient is the sum of the devices' shares. A plain closure over the
    # same traced value is refused with the fix.
    t = 16
    q, k, v = (_data.normal(i, (1, 2, t, 8)) for i in (40, 41, 42))
    cot = _data.normal(43, (1, 2, t, 8))
    penalty = lambda s, b, h, qi, ki, slope: s - slope * (qi - ki)

    def loss(slope, q, k, v, fn):
      return jnp.sum(fn(q, k, v, aj.ScoreMod(penalty, slope)) * cot)

    def ring(q, k, v, mod):
      return jax.shard_map(
          lambda q, k, v, mod: aj.ring_attention(
              q, k, v, axis_name="seq", is_causal=True, score_mod=mod,
              block_q=2, block_k=2),
          mesh=_mesh(4), in_specs=(SEQ, SEQ, SEQ, P()),
          out_specs=SEQ)(q, k, v, mod)

    def dense(q, k, v, mod):
      return aj.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             score_mod=mod,
                                             implementation="dense")

    grads = {name: jax.jit(jax.grad(functools.partial(loss, fn=fn),
                                    (0, 1, 2, 3)))(jnp.float32(0.1), q, k, v)
             for name, fn in (("ring", ring), ("dense", dense))}
    # dense is checked against float64 (tests/test_score_mods.py).
    chex.assert_trees_all_close(grads["ring"], grads["dense"], **GRAD_TOL)

    def closure_loss(slope):
      mod = lambda s, b, h, qi, ki: s - slope * (qi - ki)  # closes over it
      return jnp.sum(jax.shard_map(
          lambda q, k, v: aj.ring_attention(q, k, v, axis_name="seq",
                                            score_mod=mod),
          mesh=_mesh(4), in_specs=(SEQ, SEQ, SEQ), out_specs=SEQ)(q, k, v))

    with self.assertRaisesRegex(ValueError, r"closes over 1 traced array"
                                r".*aj\.ScoreMod"):
      jax.grad(closure_loss)(jnp.float32(0.1))

  def test_traced_per_example_prefix_lm(self):
    # A prefix-LM rule from traced per-example prefix lengths, built for the
    # global sequence and passed into shard_map: each device evaluates it
    # on global indices. Outputs and gradients against the float64 lesson.
    t = 20  # 5 rows per device on 4 devices
    q, k, v = (_data.normal(i, (2, 2, t, 8)) for i in (50, 51, 52))
    cot = _data.normal(53, (2, 2, t, 8))
    prefix = np.array([3, 11])

    def ring(q, k, v, p):
      bm = aj.block_mask(aj.prefix_lm_mask_fn(p), t, t, batch=(2, 1),
                         block_q=4, block_k=4)
      return jax.shard_map(
          lambda q, k, v, bm: aj.ring_attention(q, k, v, bm,
                                                axis_name="seq", block_q=2,
                                                block_k=2),
          mesh=_mesh(4), in_specs=(SEQ, SEQ, SEQ, P()),
          out_specs=SEQ)(q, k, v, bm)

    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    allowed = np.stack([(j < p) | (j <= i) for p in prefix])[:, None]
    want, _ = reference.sdpa(q, k, v, allowed)
    out = jax.jit(ring)(q, k, v, jnp.asarray(prefix))
    chex.assert_trees_all_close(out, want.astype(np.float32), **FWD_TOL)
    grads = jax.jit(jax.grad(lambda q, k, v, p: jnp.sum(ring(q, k, v, p)
                                                        * cot), (0, 1, 2)))(
        q, k, v, jnp.asarray(prefix))
    dense = jax.grad(lambda q, k, v: jnp.sum(aj.scaled_dot_product_attention(
        q, k, v, jnp.asarray(allowed), implementation="dense") * cot),
                     (0, 1, 2))(q, k, v)  # dense is checked against float64
    chex.assert_trees_all_close(grads, dense, **GRAD_TOL)

  def test_traced_positions_make_every_step(self):
    # Positions passed into shard_map are traced: the steps a window needs
    # cannot be known when tracing, so every step is made (the numbers
    # stay exact); concrete ones skip (test_window_skips_ring_steps).
    t, s = 16, 32  # 4 and 8 per device, a chunk at its place in a cache
    q = _data.normal(60, (2, 2, t, 8))
    k, v = (_data.normal(i, (2, 1, s, 8)) for i in (61, 62))
    q_at, kv_at = jnp.array([9, 16]), jnp.array([0, -3])  # [B]
    mask = lambda q_at, kv_at: aj.Mask(causal=True, window=(3, 0),  # noqa: E731
                                       q_offset=q_at, kv_offset=kv_at)
    fn = jax.jit(jax.shard_map(
        lambda q, k, v, q_at, kv_at: aj.ring_attention(
            q, k, v, mask(q_at, kv_at), axis_name="seq", block_q=2,
            block_k=4),
        mesh=_mesh(4), in_specs=(SEQ, SEQ, SEQ, P(), P()), out_specs=SEQ))
    hlo = fn.lower(q, k, v, q_at, kv_at).compile().as_text()
    permutes = [line for line in hlo.splitlines()
                if "collective-permute(" in line]
    # K and V, shifted in the loop over every one of the P - 1 steps
    # (a schedule that skips steps unrolls them instead).
    self.assertLen(permutes, 2)
    self.assertTrue(all("while/body" in line for line in permutes),
                    permutes)
    want = aj.scaled_dot_product_attention(
        q, k, v, mask(q_at, kv_at), implementation="dense")
    chex.assert_trees_all_close(fn(q, k, v, q_at, kv_at), want, **FWD_TOL)

  def test_kernel_without_positions_refuses_what_they_place(self):
    # The kernel reads this device's mask: without positions, causality,
    # lengths or a score modifier have nowhere to stand, and a global
    # length would be read as this device's. Refused by name; plain
    # attention needs none (ring_attention always gives them).
    x = _data.normal(63, (1, 8, 8))  # [B, T, H], T split over "seq"
    spec = P(None, "seq")
    ring = aj.kernels.Ring("seq")
    calls = {
        "causal": lambda q: aj.scaled_dot_product_attention(
            q, q, q, is_causal=True, implementation=ring),
        "kv_lengths": lambda q: aj.scaled_dot_product_attention(
            q, q, q, aj.Mask(kv_lengths=3), implementation=ring),
        "score_mod": lambda q: aj.scaled_dot_product_attention(
            q, q, q, score_mod=aj.alibi(jnp.ones(1)), implementation=ring),
    }
    for name, fn in calls.items():
      with self.assertRaisesRegex(
          ValueError, f"needs this device's positions .* for {name}: call "
          r"aj\.ring_attention"):
        jax.shard_map(fn, mesh=_mesh(2), in_specs=spec, out_specs=spec)(x)
    plain = jax.shard_map(
        lambda q: aj.scaled_dot_product_attention(q, q, q,
                                                  implementation=ring),
        mesh=_mesh(2), in_specs=spec, out_specs=spec)
    chex.assert_trees_all_close(plain(x), aj.blockwise_attention(x, x, x),
                                **FWD_TOL)

  def test_unbound_axis_is_a_value_error(self):
    x = jnp.ones((4, 8))
    with self.assertRaisesRegex(ValueError, "axis_name='seq' is not bound"):
      aj.ring_attention(x, x, x, axis_name="seq")

  def test_dense_mask_and_bias_of_wrong_shapes_are_refused(self):
    # A dense mask and a bias hold this device's rows and every key column
    # ([..., T|1, P*S|1]); a [T, S] block of this device's keys is refused
    # naming both lengths, and so is either given to the dispatcher
    # (whose checks see this device's S keys) instead of ring_attention.
    x = jnp.ones((1, 8, 8))  # [B, T, H], T split over "seq"
    spec = P(None, "seq")
    local = jnp.ones((1, 4, 4), bool)  # this device's [B, T, S]: no
    calls = (
        (r"the mask's dense field has shape \(1, 4, 4\).*= \[1, 4\|1, 8\|1\] "
         r"\(T_local = 4 .* P\*S_local = 2 \* 4 = 8",
         lambda q: aj.ring_attention(q, q, q, local, axis_name="seq")),
        (r"the bias has shape \(1, 4, 4\).*= \[1, 4\|1, 8\|1\]",
         lambda q: aj.ring_attention(q, q, q, axis_name="seq",
                                     bias=jnp.ones((1, 4, 4)))),
        (r"the bias has shape \(4, 8\).*leading dims",  # rank
         lambda q: aj.ring_attention(q, q, q, axis_name="seq",
                                     bias=jnp.ones((4, 8)))),
        (r"implementation='ring' is not possible: it takes a bias only over "
         r"every key column.*aj\.ring_attention",
         lambda q: aj.scaled_dot_product_attention(
             q, q, q, bias=jnp.ones((1, 4, 4)),
             implementation=aj.kernels.Ring("seq"))),
    )
    for message, fn in calls:
      ring = jax.shard_map(fn, mesh=_mesh(2), in_specs=spec, out_specs=spec)
      with self.assertRaisesRegex(ValueError, message):
        ring(x)

  def test_global_lengths_and_unions_with_local_arrays(self):
    # Lengths are global: 6 keys of 2 devices x 4 are accepted and equal
    # blockwise on the gathered sequence; a union holding this device's
    # segment ids (evaluated on global indices) is refused, not misread.
    x = _data.normal(90, (1, 8, 8))  # [B, T, H], T split over "seq"
    spec = P(None, "seq")
    mask = aj.Mask(causal=True, kv_lengths=6)
    ring = jax.shard_map(lambda q: aj.ring_attention(q, q, q, mask,
                                                     axis_name="seq"),
                         mesh=_mesh(2), in_specs=spec, out_specs=spec)
    np.testing.assert_allclose(ring(x), aj.blockwise_attention(x, x, x, mask),
                               atol=1e-5)  # float32, 8 keys
    ids = jnp.array([[0, 0, 1, 1]])  # this device's [B, T]
    union = jax.shard_map(
        lambda q: aj.ring_attention(
            q, q, q, aj.Mask(q_segment_ids=ids) | aj.Mask(window=0),
            axis_name="seq"), mesh=_mesh(2), in_specs=spec, out_specs=spec)
    with self.assertRaisesRegex(ValueError, "segment ids inside a union"):
      union(x)

  @parameterized.parameters("kv_lengths", "q_lengths")
  def test_lengths_beyond_the_global_sequence_are_refused(self, name):
    # 2 devices x 4 rows: lengths count the global 8. A concrete 9 (closed
    # over: still concrete inside shard_map and under jit) is refused
    # naming the global length and the fix; 8 is the whole sequence.
    x = _data.normal(91, (2, 8, 8))  # [B, T, H], T split over "seq"
    spec = P(None, "seq")

    def ring(lengths):
      return jax.shard_map(
          lambda q: aj.ring_attention(q, q, q, aj.Mask(**{name: lengths}),
                                      axis_name="seq"),
          mesh=_mesh(2), in_specs=spec, out_specs=spec)

    letter = "S" if name == "kv_lengths" else "T"
    message = (rf"the mask's {name} must lie in \[0, 8\], got values from 3 "
               rf"to 9 .*the global {letter} = P \* {letter}_local = 2 \* 4.*"
               rf"jnp\.minimum\({name}, 8\)")
    for run in (lambda f: f(x), lambda f: jax.jit(f)(x)):
      with self.assertRaisesRegex(ValueError, message):
        run(ring(jnp.array([3, 9])))
      with self.assertRaisesRegex(ValueError, r"got values from -1 to 8"):
        run(ring(np.array([8, -1])))
    got = jax.jit(ring(jnp.array([8, 3])))(x)
    want = aj.blockwise_attention(x, x, x, aj.Mask(**{name: jnp.array([8, 3])}))
    np.testing.assert_allclose(got, want, atol=1e-5)  # float32, 8 keys

  @parameterized.parameters("kv_lengths", "q_lengths")
  def test_traced_lengths_are_checked_under_checked(self, name):
    # Lengths passed into shard_map are traced on every device: checked
    # under aj.checked (a scalar: [B] lengths would batch the flash walk's
    # while loops, which checkify cannot carry), clipping otherwise.
    x = _data.normal(92, (1, 8, 8))
    spec = P(None, "seq")
    ring = jax.jit(jax.shard_map(
        lambda q, lengths: aj.ring_attention(
            q, q, q, aj.Mask(**{name: lengths}), axis_name="seq"),
        mesh=_mesh(2), in_specs=(spec, P()), out_specs=spec))
    with self.assertRaisesRegex(
        ValueError, rf"the mask's {name} must lie in \[0, 8\] \(the global "
        rf".* = 2 \* 4.*\), got 9"):
      aj.checked(ring)(x, jnp.array(9))
    with self.assertRaisesRegex(ValueError, r"must lie in \[0, 8\].*got -1"):
      aj.checked(ring)(x, jnp.array(-1))
    got = aj.checked(ring)(x, jnp.array(5))
    want = aj.blockwise_attention(x, x, x, aj.Mask(**{name: 5}))
    np.testing.assert_allclose(got, want, atol=1e-5)  # float32, 8 keys
    # Off (no aj.checked), the documented clip: 9 reads as the whole 8.
    np.testing.assert_allclose(ring(x, jnp.array(9)), ring(x, jnp.array(8)),
                               atol=0)


if __name__ == "__main__":
  absltest.main()
