"""Property-based tests (hypothesis): random shapes, dtypes, masks and biases.

Each example checks, for every ``implementation``: output shape and dtype;
weights non-negative, rows summing to 1 (0 for rows with nothing to attend),
exactly 0 where blocked; agreement with the float64 NumPy reference on the
same rounded inputs; invariance to permuting keys with values (and mask and
bias columns); causal rows that ignore the future; finite gradients.

Profiles (``tests/conftest.py``): ``ci`` (default: few examples,
derandomized, so CI is reproducible) and ``thorough``
(``pytest --hypothesis-profile=thorough tests/test_properties.py``).
Shapes come from small sets so that examples share compiled programs.
"""

from __future__ import annotations

import dataclasses
import functools

from absl.testing import absltest
import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from tests import _data
from tests import reference
from tests import reliability_report

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16,
          "float16": jnp.float16}
# Output error vs float64 on the same rounded inputs, relative to max|v|:
# float32 logits/softmax/sum (a few ulp, 1e-5 with headroom); 16-bit outputs
# are rounded once at the end (bf16 ulp 2^-8 = 4e-3, fp16 2^-11 = 5e-4).
OUT_TOL = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 2e-3}
# Logits of magnitude L carry float32 rounding ~L * 6e-8 into exp(): with
# biases of 1e3 that is ~1e-4 relative in the weights.
BIG_BIAS_TOL = 3e-4
MASKS = ("none", "random", "causal", "padding", "empty_rows", "all_true")


@dataclasses.dataclass(frozen=True)
class Case:
  dtype: str
  lead: tuple[int, ...]  # query leading dims
  kv_lead: tuple[int, ...]  # key/value leading dims (1 = shared, GQA-like)
  t: int
  s: int
  h: int
  hv: int
  mask: str
  bias_scale: float  # 0: no bias
  seed: int


@st.composite
def cases(draw) -> Case:
  rank = draw(st.integers(0, 2))
  lead = tuple(draw(st.sampled_from((1, 2, 3))) for _ in range(rank))
  kv_lead = tuple(draw(st.sampled_from((1, n))) for n in lead)
  return Case(
      dtype=draw(st.sampled_from(sorted(DTYPES))), lead=lead, kv_lead=kv_lead,
      t=draw(st.sampled_from((1, 3, 8))), s=draw(st.sampled_from((1, 5, 8))),
      h=draw(st.sampled_from((4, 8))), hv=draw(st.sampled_from((3, 4))),
      mask=draw(st.sampled_from(MASKS)),
      bias_scale=draw(st.sampled_from((0.0, 1.0, 1e3))),
      seed=draw(st.integers(0, 1000)))


def _inputs(c: Case):
  dtype = DTYPES[c.dtype]
  q = _data.normal(c.seed, c.lead + (c.t, c.h), dtype)
  k = _data.normal(c.seed + 1, c.kv_lead + (c.s, c.h), dtype)
  v = _data.normal(c.seed + 2, c.kv_lead + (c.s, c.hv), dtype)
  mask, causal = None, False
  if c.mask == "random":
    mask = _data.bernoulli(c.seed + 3, 0.6, c.lead + (c.t, c.s))
  elif c.mask == "causal":
    causal = True
  elif c.mask == "padding":
    lengths = np.arange(int(np.prod(c.lead, dtype=int))) % c.s + 1
    mask = np.arange(c.s) < lengths.reshape(c.lead + (1, 1))
  elif c.mask == "empty_rows":  # every other query may attend to nothing
    mask = np.broadcast_to((np.arange(c.t) % 2 == 0)[:, None], (c.t, c.s))
  elif c.mask == "all_true":
    mask = np.ones((c.t, c.s), bool)
  bias = None
  if c.bias_scale:
    bias = c.bias_scale * _data.normal(c.seed + 4, (c.t, c.s))
  # Masks and biases carry the logits' rank; shared ones get size-1 axes.
  full_rank = lambda x: None if x is None else jnp.reshape(
      jnp.asarray(x), (1,) * (len(c.lead) + 2 - np.ndim(x)) + np.shape(x))
  return q, k, v, full_rank(mask), full_rank(bias), causal


def _allowed(c: Case, mask, causal) -> np.ndarray:
  allowed = np.ones(c.lead + (c.t, c.s), bool)
  if mask is not None:
    allowed = allowed & np.asarray(mask)
  if causal:
    allowed = allowed & reference.causal(c.t, c.s)
  return allowed


_ATTEND = jax.jit(aj.scaled_dot_product_attention,
                  static_argnames=("is_causal", "implementation",
                                   "return_weights"))


def _check_case(test: absltest.TestCase, c: Case, implementation: str):
  reliability_report.record("property", implementation=implementation,
                            dtype=c.dtype, mask=c.mask)
  q, k, v, mask, bias, causal = _inputs(c)
  dense = implementation == "dense"
  result = _ATTEND(q, k, v, mask, bias=bias, is_causal=causal,
                   implementation=implementation, return_weights=dense)
  out, w = result if dense else (result, None)
  dtype = DTYPES[c.dtype]
  test.assertEqual(out.shape, c.lead + (c.t, c.hv))
  test.assertEqual(out.dtype, dtype)
  test.assertTrue(np.isfinite(np.asarray(out, np.float32)).all())

  ref_out, ref_w = reference.sdpa(
      np.asarray(q, np.float64), np.asarray(k, np.float64),
      np.asarray(v, np.float64), None if mask is None else np.asarray(mask),
      None if bias is None else np.asarray(bias, np.float64),
      is_causal=causal)
  scale = max(1.0, float(np.abs(np.asarray(v, np.float64)).max()))
  tol = OUT_TOL[c.dtype] + (BIG_BIAS_TOL if c.bias_scale >= 1e3 else 0.0)
  np.testing.assert_allclose(np.asarray(out, np.float64), ref_out,
                             atol=tol * scale, rtol=tol)

  allowed = _allowed(c, mask, causal)
  if dense:
    w = np.asarray(w, np.float64)
    test.assertTrue((w >= 0).all())
    np.testing.assert_array_equal(w[~np.broadcast_to(allowed, w.shape)], 0.0)
    sums = w.sum(-1)
    want = np.broadcast_to(allowed, w.shape).any(-1).astype(float)
    np.testing.assert_allclose(sums, want, atol=1e-5)  # float32 weights
    np.testing.assert_allclose(w, ref_w, atol=1e-5 + tol, rtol=tol)

  # Permuting keys with values (and mask/bias columns) changes nothing.
  perm = np.random.default_rng(c.seed).permutation(c.s)
  if not causal:  # causality fixes the key order
    pk, pv = k[..., perm, :], v[..., perm, :]
    pm = None if mask is None else mask[..., perm]
    pb = None if bias is None else bias[..., perm]
    p_out = _ATTEND(q, pk, pv, pm, bias=pb, implementation=implementation)
    np.testing.assert_allclose(np.asarray(p_out, np.float64),
                               np.asarray(out, np.float64),
                               atol=tol * scale, rtol=tol)
  else:  # changing keys in the future of query 0 leaves row 0 alone
    first = 0 + (c.s - c.t) + 1  # first key query 0 may not see
    if 0 < first < c.s:
      k2 = k.at[..., first:, :].multiply(-3.0)
      v2 = v.at[..., first:, :].add(5.0)
      c_out = _ATTEND(q, k2, v2, mask, bias=bias, is_causal=True,
                      implementation=implementation)
      np.testing.assert_array_equal(np.asarray(c_out[..., 0, :]),
                                    np.asarray(out[..., 0, :]))


class AttentionPropertiesTest(absltest.TestCase):

  @hypothesis.given(cases())
  def test_dense(self, c):
    _check_case(self, c, "dense")

  @hypothesis.given(cases())
  def test_blockwise(self, c):
    _check_case(self, c, "flash")

  # Two gradient programs to compile per example: a third of the examples.
  @hypothesis.settings(max_examples=max(
      3, hypothesis.settings.default.max_examples // 3))
  @hypothesis.given(cases().filter(lambda c: c.dtype == "float32"))
  def test_gradients_are_finite_and_agree(self, c):
    reliability_report.record("property", implementation="gradients",
                              dtype=c.dtype, mask=c.mask)
    q, k, v, mask, bias, causal = _inputs(c)

    def loss(implementation, q, k, v, bias):
      out = aj.scaled_dot_product_attention(
          q, k, v, mask, bias=bias, is_causal=causal,
          implementation=implementation)
      weights = jnp.cos(jnp.arange(out.shape[-1], dtype=out.dtype))
      return jnp.sum(out * weights.reshape((1,) * (out.ndim - 1) + (-1,)))

    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    dense = jax.jit(jax.grad(lambda *a: loss("dense", *a), argnums))(
        q, k, v, bias)
    block = jax.jit(jax.grad(lambda *a: loss("flash", *a), argnums))(
        q, k, v, bias)
    for d, b in zip(dense, block):
      self.assertTrue(np.isfinite(np.asarray(d)).all())
      # Both float32; large biases amplify rounding as in the forward.
      tol = 5e-5 + (BIG_BIAS_TOL * 10 if c.bias_scale >= 1e3 else 0.0)
      np.testing.assert_allclose(b, d, atol=tol, rtol=tol)


@st.composite
def head_cases(draw):
  """(B, T, S, N, K, D, mask kind, causal, implementation, seed)."""
  n = draw(st.sampled_from((1, 2, 4)))
  k = draw(st.sampled_from([d for d in (1, 2, 4) if n % d == 0]))
  return (draw(st.sampled_from((1, 2))), draw(st.sampled_from((1, 4, 7))),
          draw(st.sampled_from((1, 5))), n, k, 4 * n,
          draw(st.sampled_from(("none", "random", "padding"))),
          draw(st.booleans()), draw(st.sampled_from(("dense", "flash"))),
          draw(st.integers(0, 1000)))


_MHA = jax.jit(aj.multi_head_attention,
               static_argnames=("is_causal", "attention_fn",
                                "return_weights"))


class ModulePropertiesTest(absltest.TestCase):

  @hypothesis.given(head_cases())
  def test_multi_head_attention_with_grouped_heads(self, case):
    b, t, s, n, k, d, kind, causal, implementation, seed = case
    reliability_report.record("property", implementation=implementation,
                              dtype="float32", mask=kind)
    params = _data.params(aj.init_multi_head_params, seed, d, n,
                          num_kv_heads=k)
    x = _data.normal(seed, (b, t, d))
    mem = _data.normal(seed + 1, (b, s, d))
    val = _data.normal(seed + 3, (b, s, d))  # distinct from the keys
    mask = None
    if kind == "random":
      mask = _data.bernoulli(seed + 2, 0.6, (b, 1, t, s))
    elif kind == "padding":
      mask = jnp.asarray(np.arange(s)[None, None, None, :] <
                         (np.arange(b) % s + 1)[:, None, None, None])
    dense = implementation == "dense"
    result = _MHA(params, x, mem, val, mask, is_causal=causal,
                  attention_fn=implementation, return_weights=dense)
    out, w = result if dense else (result, None)
    ref, ref_w = reference.multi_head_attention(
        params, x, mem, val, None if mask is None else np.asarray(mask),
        num_heads=n, num_kv_heads=k, is_causal=causal)
    self.assertEqual(out.shape, (b, t, d))
    # float32 projections and attention vs float64: a few ulp of |out| ~ 1.
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)
    if w is not None:
      np.testing.assert_allclose(w, ref_w, atol=1e-5)

  @hypothesis.given(st.sampled_from(("additive", "dot", "general", "concat")),
                    st.sampled_from((1, 3)), st.sampled_from((1, 6)),
                    st.sampled_from(("none", "padding", "empty_rows")),
                    st.integers(0, 1000))
  def test_bahdanau_and_luong(self, score, t, s, kind, seed):
    reliability_report.record("property", implementation=score,
                              dtype="float32", mask=kind)
    q = _data.normal(seed, (2, t, 4))
    keys = _data.normal(seed + 1, (2, s, 4))
    values = _data.normal(seed + 2, (2, s, 3))
    mask = None  # [B, 1, S]: the weights' rank, shared by the steps
    if kind == "padding":
      mask = jnp.asarray(np.arange(s)[None, None, :] < np.array([[[s]], [[1]]]))
    elif kind == "empty_rows":  # example 1 may attend to nothing
      mask = jnp.asarray(np.array([[[True]], [[False]]]).repeat(s, 2))
    np_mask = None if mask is None else np.asarray(mask)
    if score == "additive":
      params = _data.params(aj.init_additive_params, seed, 4, 4, 5)
      attend = functools.partial(aj.additive_attention, return_weights=True)
      ctx, w = jax.jit(attend)(params, q, keys, values, mask)
      ref, ref_w = reference.additive(params, q, keys, values, np_mask)
    else:
      params = (None if score == "dot" else _data.params(
          aj.init_luong_params, seed, 4, 4, score=score,
          **({"hidden_features": 5} if score == "concat" else {})))
      attend = functools.partial(aj.luong_attention, score=score,
                                 return_weights=True)
      ctx, w = jax.jit(attend)(params, q, keys, values, mask)
      ref, ref_w = reference.luong(q, keys, values, np_mask, score=score,
                                   params=params)
    w = np.asarray(w, np.float64)
    self.assertTrue((w >= 0).all())
    allowed = (np.ones((2, t, s), bool) if np_mask is None
               else np.broadcast_to(np_mask, (2, t, s)))
    np.testing.assert_array_equal(w[~allowed], 0.0)
    np.testing.assert_allclose(w.sum(-1), allowed.any(-1), atol=1e-5)
    np.testing.assert_allclose(ctx, ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(w, ref_w, atol=1e-5)


if __name__ == "__main__":
  absltest.main()
