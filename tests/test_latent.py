"""Multi-head latent attention (DeepSeek-V2 MLA) against a float64 NumPy MLA.

The reference below is written from the paper's equations (arXiv 2405.04434,
section 2.1), not from our code: RMSNorm, a rotary rotation by explicit
pairs, per-head attention with a softmax, W_o. Sizes: D=32, N=4, Rq=16,
R=24, Hn=8, Hr=4, Hv=8.
"""

import functools

from absl.testing import absltest
import chex
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.layers import latent
from attention_jax.layers.latent_module import MultiHeadLatentAttention
from attention_jax.scores.rope import Rope
from tests import _data

D, N, RQ, R, HN, HR, HV = 32, 4, 16, 24, 8, 4, 8
SIZES = dict(kv_lora_rank=R, qk_nope_head_dim=HN, qk_rope_head_dim=HR,
             v_head_dim=HV)
# float32 against float64 through five projections (fan-in <= 32), two
# RMSNorms, the rotation and a softmax: errors are a few 1e-7 relative on
# O(1) outputs, so 2e-5 leaves a wide margin yet catches any wrong term
# (a wrong scale or a missed rotation moves outputs by >1e-2).
TOL = dict(atol=2e-5, rtol=2e-5)
_ZEROS = nnx.initializers.zeros_init()


# Eager calls compile every primitive at every new shape (seconds on a
# shared 2-core CPU); one jit per call pattern is ~10x cheaper.
@functools.partial(nnx.jit, static_argnames=("is_causal",))
def _call(m, x, mask=None, positions=None, is_causal=False):
  return m(x, mask, positions=positions, is_causal=is_causal)


@nnx.jit
def _decode(m, x, mask=None, positions=None):
  return m(x, mask, positions=positions, decode=True)


def _module(q_lora_rank=RQ, seed=0, **kwargs):
  """A module with pool-drawn parameters (non-trivial norms and biases).

  Built with zero initialisers (drawing random kernels would compile a
  sampler per shape), then loaded from the seeded test pool.
  """
  mla = MultiHeadLatentAttention(D, N, q_lora_rank=q_lora_rank,
                                 rngs=nnx.Rngs(0), kernel_init=_ZEROS,
                                 **SIZES, **kwargs)
  use_bias = kwargs.get("use_bias", False)
  mla.load_params(_data.params(
      latent.init_latent_params, seed, D, N, q_lora_rank=q_lora_rank,
      use_bias=use_bias, **SIZES))
  return mla


# -- the float64 reference ------------------------------------------------


def _rms(x, scale, eps=1e-6):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _rotate(x, positions, base, interleaved):
  """RoPE on ``x [T, Hr]``: pair ``i`` turned by ``p * base**(-2i/Hr)``."""
  out = np.array(x, np.float64)
  half = x.shape[-1] // 2
  for t, p in enumerate(positions):
    for i in range(half):
      a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
      angle = p * base ** (-2.0 * i / x.shape[-1])
      c, s = np.cos(angle), np.sin(angle)
      out[t, a] = x[t, a] * c - x[t, b] * s
      out[t, b] = x[t, b] * c + x[t, a] * s
  return out


def _reference(params, x, *, positions=None, base=10000.0,
               interleaved=False, causal=True, visible=None, scale=None):
  """MLA per example and head; ``visible [B, T, S]`` bool or None."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  bias = lambda name: p[name].get("bias", 0.0)
  x = np.asarray(x, np.float64)
  b_n, t_n, _ = x.shape
  positions = (np.broadcast_to(np.arange(t_n), (b_n, t_n))
               if positions is None else np.asarray(positions))
  scale = 1.0 / np.sqrt(HN + HR) if scale is None else scale
  out = np.zeros((b_n, t_n, p["W_o"]["kernel"].shape[-1]))
  for b in range(b_n):
    h = x[b]  # [T, D]
    if "W_q" in p:
      q = np.einsum("td,dnh->nth", h, p["W_q"]["kernel"])
    else:
      c_q = _rms(h @ p["W_dq"]["kernel"] + bias("W_dq"), p["q_norm"]["scale"])
      q = np.einsum("tr,rnh->nth", c_q, p["W_uq"]["kernel"])
    kv = h @ p["W_dkv"]["kernel"] + bias("W_dkv")  # [T, R + Hr]
    c_kv = _rms(kv[:, :R], p["kv_norm"]["scale"])
    k_pe = _rotate(kv[:, R:], positions[b], base, interleaved)  # one head
    up = np.einsum("tr,rnh->nth", c_kv, p["W_ukv"]["kernel"])
    for n in range(N):
      q_n = np.concatenate(
          [q[n, :, :HN], _rotate(q[n, :, HN:], positions[b], base,
                                 interleaved)], axis=-1)
      k_n = np.concatenate([up[n, :, :HN], k_pe], axis=-1)
      v_n = up[n, :, HN:]
      s = q_n @ k_n.T * scale  # [T, S]
      ok = np.ones_like(s, bool)
      if causal:
        ok &= np.tril(ok)
      if visible is not None:
        ok &= visible[b]
      s = np.where(ok, s, -np.inf)
      m = np.max(s, axis=-1, keepdims=True)
      e = np.where(ok, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
      total = e.sum(-1, keepdims=True)
      w = np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)
      out[b] += (w @ v_n) @ p["W_o"]["kernel"][n]
    out[b] += bias("W_o")
  return out


class LatentAttentionTest(chex.TestCase):

  def test_prefill_equals_the_float64_equations(self):
    x = _data.normal(0, (2, 6, D))
    # With a query low-rank, default rope and scale, causal.
    mla = _module()
    want = _reference(mla.params_dict(), x)
    chex.assert_trees_all_close(_call(mla, x, is_causal=True),
                                want.astype(np.float32), **TOL)
    # Full-rank W_q, biases, interleaved pairs at another base, a custom
    # scale, no causality: every option reaches the numbers.
    rope = Rope(base=500.0, interleaved=True)
    mla = _module(q_lora_rank=None, seed=7, use_bias=True, rope=rope,
                  scale=0.2)
    params = mla.params_dict()
    self.assertEqual(set(params), {"W_q", "W_dkv", "kv_norm", "W_ukv",
                                   "W_o"})
    want = _reference(params, x, base=500.0, interleaved=True, causal=False,
                      scale=0.2)
    chex.assert_trees_all_close(_call(mla, x), want.astype(np.float32),
                                **TOL)
    # The options matter (so the comparison above could fail).
    other = _reference(params, x, base=500.0, interleaved=False,
                       causal=False, scale=0.2)
    self.assertGreater(np.abs(want - other).max(), 1e-2)

  def test_right_padded_prefill_hint_names_what_the_layer_has(self):
    # The latent cache takes no left_padding: the fix offered is q_lengths.
    mla = _module(seed=3)
    mla.init_cache(batch_size=2, max_length=8)
    with self.assertRaisesRegex(ValueError, r"q_lengths=lengths") as caught:
      mla(_data.normal(1, (2, 4, D)), aj.Mask(kv_lengths=[4, 2]),
          decode=True)
    self.assertNotIn("left_padding", str(caught.exception))

  def test_absorbed_decode_equals_the_full_forward(self):
    # Prefill 3 tokens, then 1, 1 and a chunk of 3: the absorbed form (W_uk
    # folded into the query, one shared [c_kv, k_pe] head, W_uv after the
    # attention) computes the same scores in another order, so float32
    # rounding differs from the expanded form by ~1e-7 relative (TOL).
    x = _data.normal(1, (2, 8, D))
    mla = _module(seed=3)
    full = _call(mla, x, is_causal=True)
    mla.init_cache(batch_size=2, max_length=8)
    pieces = [_decode(mla, x[:, :3]), _decode(mla, x[:, 3:4]),
              _decode(mla, x[:, 4:5]), _decode(mla, x[:, 5:])]
    chex.assert_trees_all_close(np.concatenate(pieces, 1), full, **TOL)
    np.testing.assert_array_equal(mla.cache_index[...], [8, 8])
    mla.check_cache()  # no overflow
    # A sliding-window layer decodes with a ring buffer of window + 1 slots.
    window = aj.Mask(causal=True, window=(2, 0))
    ring = _module(seed=3, mask=window)
    full = _call(ring, x, is_causal=True)
    ring.init_cache(batch_size=2)
    self.assertEqual(ring.cached_latent.shape, (2, 3, R))
    pieces = [_decode(ring, x[:, :4])] + [
        _decode(ring, x[:, i:i + 1]) for i in range(4, 8)]
    chex.assert_trees_all_close(np.concatenate(pieces, 1), full, **TOL)

  def test_a_paged_latent_cache_decodes_ragged_rows_as_the_full_forward(self):
    # Two rows through a pool of pages of 2 tokens: a ragged prefill (5 and
    # 2 tokens), then row 0 one token while row 1 catches up with 3; row 0
    # is released and a new sequence starts there while row 1 finishes.
    # Each row must equal its full causal forward (TOL: the absorbed
    # form's rounding, as for the linear cache).
    x = _data.normal(1, (2, 8, D))
    fresh = _data.normal(2, (1, 3, D))
    mla = _module(seed=3)
    full, full_fresh = _call(mla, x, is_causal=True), _call(
        mla, fresh, is_causal=True)
    mla.init_paged_cache(2, num_pages=7, page_size=2, max_pages=4)
    lengths = lambda *n: aj.Mask(q_lengths=jnp.array(n))  # noqa: E731
    first = _decode(mla, x[:, :5], lengths(5, 2))
    chex.assert_trees_all_close(first[0], full[0, :5], **TOL)
    chex.assert_trees_all_close(first[1, :2], full[1, :2], **TOL)
    pad = jnp.zeros((2, D))
    second = _decode(mla, jnp.stack([jnp.concatenate([x[0, 5:6], pad]),
                                     x[1, 2:5]]), lengths(1, 3))
    chex.assert_trees_all_close(second[0, :1], full[0, 5:6], **TOL)
    chex.assert_trees_all_close(second[1], full[1, 2:5], **TOL)
    mla.update_paged_cache(aj.paged_cache.release, jnp.array([True, False]))
    third = _decode(mla, jnp.stack([fresh[0], x[1, 5:8]]), lengths(3, 3))
    chex.assert_trees_all_close(third[0], full_fresh[0], **TOL)
    chex.assert_trees_all_close(third[1], full[1, 5:8], **TOL)
    mla.check_cache()  # no overflow
    pages = mla.cache_pages.get_value()
    self.assertEqual(pages.lengths.tolist(), [3, 8])
    self.assertIsNone(pages.value_pages)  # the latent is stored once
    self.assertEqual(pages.key_pages.shape, (7, 1, 2, R + HR))
    self.assertEqual(mla.cache_bytes_per_token, (R + HR) * 4)

  def test_a_quantised_latent_cache_stays_close_at_a_quarter_of_the_bytes(
      self):
    x = _data.normal(1, (2, 6, D))
    mla = _module(seed=3)
    full = _call(mla, x, is_causal=True)
    mla.init_cache(2, 6, dtype="int8")  # kept in pages: 2 x 1 of 6
    self.assertEqual(mla.cache_pages.get_value().key_pages.shape,
                     (2, 1, 6, R + HR))
    got = _decode(mla, x)
    # int8 with a float32 scale per token: R + Hr bytes and 4.
    self.assertEqual(mla.cache_bytes_per_token, R + HR + 4)
    # Rounding each latent to 1/254 of its row's largest entry moves these
    # O(1) outputs by about 1e-2; a wrong scale or position moves them by
    # O(1).
    chex.assert_trees_all_close(got, full, atol=5e-2, rtol=0)
    self.assertGreater(float(jnp.abs(got - full).max()), 1e-5)  # quantised

  def test_a_paged_latent_cache_refuses_what_it_cannot_do(self):
    mla = _module()
    mla.init_paged_cache(1, num_pages=4, page_size=2, max_pages=2)
    with self.assertRaisesRegex(ValueError, "return_weights is not supported"):
      mla(_data.normal(1, (1, 2, D)), decode=True, return_weights=True)
    params = mla.params_dict()
    not_latent = aj.init_paged_cache(4, 2, 1, R + HR, batch_size=1,
                                     max_pages=2)  # values stored apart
    with self.assertRaisesRegex(ValueError, "init_paged_latent_cache"):
      aj.latent_decode(params, _data.normal(1, (1, 2, D)), not_latent)
    with self.assertRaisesRegex(ValueError, "value must be None"):
      aj.paged_cache.append(mla.cache_pages.get_value(),
                            jnp.ones((1, 1, 2, R + HR)),
                            jnp.ones((1, 1, 2, R + HR)))
    with self.assertRaisesRegex(ValueError, "ring buffer"):
      _module(mask=aj.Mask(causal=True, window=(2, 0))).init_cache(
          1, dtype="int8")
    with self.assertRaisesRegex(ValueError, "leave it out"):
      aj.init_paged_cache(4, 2, 1, 8, batch_size=1, max_pages=2,
                          value_head_dim=8, values_in_keys=True)

  def test_cache_bytes_per_token_against_multi_head_attention(self):
    # Measured from the buffers: MLA caches R + Hr numbers per token, MHA of
    # the same width (D=32, N=K=4, H=8) caches 2 * K * H.
    mla = _module()
    mla.init_cache(batch_size=2, max_length=8)
    buffers = mla.cached_latent[...].nbytes + mla.cached_rope_key[...].nbytes
    self.assertEqual(buffers / (2 * 8), (R + HR) * 4)
    self.assertEqual(mla.cache_bytes_per_token, (R + HR) * 4)  # 112
    mha = aj.MultiHeadAttention(D, N, rngs=nnx.Rngs(0), kernel_init=_ZEROS)
    mha.init_cache(batch_size=2, max_length=8)
    mha_bytes = (mha.cached_key[...].nbytes
                 + mha.cached_value[...].nbytes) / (2 * 8)
    self.assertEqual(mha_bytes, 2 * N * (D // N) * 4)  # 256
    self.assertLess(mla.cache_bytes_per_token, mha_bytes)
    mla.init_cache(batch_size=1, max_length=4, dtype=jnp.bfloat16)
    self.assertEqual(mla.cache_bytes_per_token, (R + HR) * 2)

  def test_left_padded_positions_equal_the_unpadded_run(self):
    # Example 1 is 5 real tokens after 3 pads (holding NaN: they must never
    # reach a real row); positions count from its first real token, a
    # dense mask hides the pads. Its real rows equal the 5 tokens alone,
    # in the full forward and in decoding (positions= given per step,
    # the mask over cache slots).
    pads = np.array([0, 3])
    x = np.array(_data.normal(2, (2, 8, D)))
    x[1, :3] = np.nan
    positions = np.maximum(np.arange(8)[None, :] - pads[:, None], 0)
    keys_ok = np.arange(8)[None, :] >= pads[:, None]  # [B, S]
    mla = _module(seed=5)
    params = mla.params_dict()
    alone = _reference(params, x[1:, 3:]).astype(np.float32)  # [1, 5, D]
    out = _call(mla, jnp.asarray(x), keys_ok[:, None, None, :],
                positions, is_causal=True)
    chex.assert_trees_all_close(out[1:, 3:], alone, **TOL)
    self.assertTrue(np.all(np.isfinite(out)))  # pad rows too
    want = _reference(params, x[:1])  # example 0 has no pads
    chex.assert_trees_all_close(out[0], want[0].astype(np.float32), **TOL)
    # Decoding with the same positions and the pads masked as cache slots.
    mla.init_cache(batch_size=2, max_length=8)
    slots = aj.Mask(dense=keys_ok[:, None, None, :])  # [B, 1, 1, L]
    pieces = [_decode(mla, jnp.asarray(x[:, :5]), slots, positions[:, :5])]
    for i in range(5, 8):
      pieces.append(_decode(mla, jnp.asarray(x[:, i:i + 1]), slots,
                            positions[:, i:i + 1]))
    decoded = np.concatenate(pieces, 1)
    chex.assert_trees_all_close(decoded[1:, 3:], alone, **TOL)
    chex.assert_trees_all_close(decoded[0], out[0], **TOL)
    # positions= is used, not ignored: without it, example 1's rotary
    # positions start at 3 and nothing changes only because RoPE is
    # relative; a non-uniform shift does change the output.
    bent = positions.copy()
    bent[1, 5:] += 2
    moved = _call(mla, jnp.asarray(x), keys_ok[:, None, None, :], bent,
                  is_causal=True)
    self.assertGreater(np.abs(np.asarray(moved - out)[1, 5:]).max(), 1e-3)

  def test_bad_sizes_and_inputs_are_refused_by_name(self):
    for kwargs, pattern in (
        (dict(kv_lora_rank=0), "kv_lora_rank must be positive"),
        (dict(qk_rope_head_dim=3), "qk_rope_head_dim must be even"),
        (dict(q_lora_rank=-1), "q_lora_rank"),
        (dict(v_head_dim=2.0), "v_head_dim must be a Python int"),
    ):
      error = TypeError if "Python int" in pattern else ValueError
      with self.assertRaisesRegex(error, pattern):
        MultiHeadLatentAttention(D, N, rngs=nnx.Rngs(0),
                                 **{**SIZES, **kwargs})
    mla = _module()
    x = _data.normal(0, (2, 6, D))
    with self.assertRaisesRegex(ValueError, r"positions must have shape "
                                r"\[B, T\] = \[2, 6\].*got \(2, 5\)"):
      mla(x, positions=jnp.zeros((2, 5), jnp.int32))
    with self.assertRaisesRegex(TypeError, "positions must be integer"):
      mla(x, positions=jnp.zeros((2, 6)))
    with self.assertRaisesRegex(ValueError, "d_model=32"):
      mla(_data.normal(0, (2, 6, 16)))
    with self.assertRaisesRegex(ValueError, "init_cache"):
      mla(x, decode=True)
    mla.init_cache(batch_size=2, max_length=8)
    with self.assertRaisesRegex(ValueError, "segment ids are not supported"):
      _decode(mla, x, aj.Mask(q_segment_ids=jnp.zeros((2, 6), jnp.int32)))
    params = mla.params_dict()
    params["W_o"] = {"kernel": jnp.zeros((N, HV + 1, D))}
    with self.assertRaisesRegex(ValueError, r"disagree on N and Hv.*W_o "
                                r"\(4, 9, 32\)"):
      latent.latent_attention(params, x)  # raises before computing

  def test_gradients_reach_every_parameter(self):
    params = _data.params(latent.init_latent_params, 9, D, N, q_lora_rank=RQ,
                          use_bias=True, **SIZES)
    x = _data.normal(4, (1, 5, D))
    weights = _data.normal(5, (1, 5, D))

    def loss(p):
      return jnp.sum(latent.latent_attention(p, x, is_causal=True) * weights)

    grads = jax.jit(jax.grad(loss))(params)
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
      name = jax.tree_util.keystr(path)
      g = np.asarray(g)  # NumPy: no eager compile per leaf shape
      self.assertTrue(np.all(np.isfinite(g)), name)
      self.assertGreater(np.abs(g).max(), 0.0, name)

  def test_yarn_scale_follows_deepseek(self):
    # DeepSeek-V3: softmax scale 1/sqrt(Hn + Hr) times
    # (0.1 * mscale_all_dim * ln(factor) + 1)**2 under YaRN.
    rope = Rope(scaling="yarn", factor=40.0, original_max_positions=4096,
               mscale=1.0, mscale_all_dim=1.0)
    want = (HN + HR) ** -0.5 * (0.1 * np.log(40.0) + 1.0) ** 2
    self.assertAlmostEqual(latent.default_scale(HN + HR, rope), want, 12)
    self.assertEqual(latent.default_scale(HN + HR, Rope()),
                     (HN + HR) ** -0.5)


if __name__ == "__main__":
  absltest.main()
