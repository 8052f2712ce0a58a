"""The cuDNN wiring (``kernels/cudnn.py``): our semantics through jax.nn's
arguments.

No GPU here: ``attention`` runs jax.nn's reference path
(``implementation="xla"``), which takes the same arguments as its cuDNN path,
and ``problem_of`` is reached past its GPU check by mocking the backend.
"""

import functools
import itertools
import re
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.kernels import base
from attention_jax.kernels import cudnn
from tests import _data
from tests import reference

# Both sides compute in float32 (jax.nn's logits and softmax, the dense
# path's): they differ only in the order of roundings (eps = 1.2e-7) over at
# most 7 keys of magnitude <= ~4, so ~1e-6 at worst; 1e-5 leaves headroom.
F32_TOL = dict(atol=1e-5, rtol=1e-5)
B, N, H = 2, 4, 8


def _qkv(t, s, dtype=jnp.float32, seed=0):
  return (_data.normal(seed, (B, N, t, H), dtype),
          _data.normal(seed + 1, (B, N, s, H), dtype),
          _data.normal(seed + 2, (B, N, s, H), dtype))


def _wired(q, k, v, mask=None, bias=None, *, is_causal=False, window=None,
           kv_lengths=None, q_lengths=None):
  return cudnn.attention(q, k, v, mask, bias, kv_lengths, q_lengths,
                         scale=H ** -0.5, is_causal=is_causal, window=window,
                         implementation="xla")


# The option grids of two tests below. By default each runs a few of its
# grid's combinations in which every two values of any two options meet
# (``_all_pairs``); the exhaustive run (``-m exhaustive``) has the rest.
MATCHES_DENSE = dict(ts=[(6, 6), (4, 7), (7, 4)], is_causal=[False, True],
                     window=[None, (2, 0), (0, 3)], lengths=["kv0", "q0"])
POSITIONS = dict(positions=["scalar", "top_left", "per_example"],
                 ts=[(4, 7), (7, 4)],
                 band=["causal", "window", "causal_window", "two_sided"])


def _all_pairs(grid) -> frozenset[int]:
  """Indices, in ``parameterized.product``'s order, of combinations of
  ``grid`` that together hold every pair of two options' values (greedy:
  the most new pairs first, product order on ties)."""
  combos = list(itertools.product(*(range(len(v)) for v in grid.values())))

  def pairs(combo):
    return {(i, a, j, b) for (i, a), (j, b)
            in itertools.combinations(enumerate(combo), 2)}

  left, chosen = set().union(*map(pairs, combos)), set()
  while left:
    best = max(range(len(combos)), key=lambda n: len(pairs(combos[n]) & left))
    chosen.add(best)
    left -= pairs(combos[best])
  return frozenset(chosen)


_DEFAULT = {"test_matches_dense": _all_pairs(MATCHES_DENSE),
            "test_positions_match_dense_and_reference": _all_pairs(POSITIONS)}


def is_exhaustive(test_name: str) -> bool:
  """The grids' combinations beyond their pairs (conftest.py reads it)."""
  found = re.fullmatch(r"(test_\w+?)(\d+)", test_name)
  return bool(found) and found[1] in _DEFAULT and (
      int(found[2]) not in _DEFAULT[found[1]])


def _positioned_allowed(t, s, q_offset, kv_offset, is_causal, window):
  """Bool ``[B, 1, T, S]``: query row i at ``q_offset + i``, key column j at
  ``kv_offset + j``, the band written out on those positions."""
  q_at = np.reshape(q_offset, (-1, 1, 1, 1)) + np.arange(t)[:, None]
  kv_at = np.reshape(kv_offset, (-1, 1, 1, 1)) + np.arange(s)[None, :]
  ok = np.ones(np.broadcast_shapes(q_at.shape, kv_at.shape), bool)
  if is_causal:
    ok &= kv_at <= q_at
  if window is not None:
    left, right = window
    ok &= (q_at - left <= kv_at) & (kv_at <= q_at + right)
  return np.broadcast_to(ok, (B, 1, t, s))


def _reference(q, k, v, allowed):
  """float64 NumPy attention over ``allowed`` (rows that see nothing: 0)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  scores = np.einsum("bnth,bnsh->bnts", q, k) * H ** -0.5
  return reference.softmax(scores, allowed) @ v


def _kernel_xla(problem):
  """The Cudnn kernel's own call (its offsets read off the problem), with
  jax.nn's xla path in place of cuDNN."""
  xla = functools.partial(cudnn.attention, implementation="xla")
  with mock.patch.object(cudnn, "attention", xla):
    return cudnn.Cudnn()(problem).out


def _dense(q, k, v, mask=None, bias=None, *, is_causal=False, window=None,
           kv_lengths=None, q_lengths=None):
  return aj.scaled_dot_product_attention(
      q, k, v, aj.Mask(dense=mask, window=window, kv_lengths=kv_lengths,
                       q_lengths=q_lengths),
      bias=bias, implementation="dense", is_causal=is_causal)


class AttentionTest(parameterized.TestCase):

  @parameterized.product(**MATCHES_DENSE)
  def test_matches_dense(self, ts, is_causal, window, lengths):
    t, s = ts
    q, k, v = _qkv(t, s)
    # One example with a length 0 (every row sees nothing) beside one with
    # both lengths short; T > S causal, narrow windows and a key length of 1
    # add single rows that see nothing.
    kv_lengths, q_lengths = {
        "none": (None, None),
        "kv0": (jnp.array([[0], [s - 2]]), jnp.array([[t], [t - 1]])),
        "q0": (jnp.array([[s], [1]]), jnp.array([[0], [t - 2]])),
    }[lengths]
    kw = dict(is_causal=is_causal, window=window, kv_lengths=kv_lengths,
              q_lengths=q_lengths)
    got = _wired(q, k, v, **kw)
    chex.assert_shape(got, (B, N, t, H))
    np.testing.assert_allclose(got, _dense(q, k, v, **kw), **F32_TOL)

  @parameterized.named_parameters(
      ("square", 5, 5, True, None),
      ("chunk_at_end", 3, 6, True, (1, 0)),
      ("more_queries", 6, 3, False, (0, 1)),
  )
  def test_mask_bias_and_scalar_lengths(self, t, s, is_causal, window):
    q, k, v = _qkv(t, s, seed=3)
    mask = _data.bernoulli(5, 0.7, (B, 1, t, s)).at[0, 0, 1].set(False)
    bias = _data.normal(6, (1, N, t, s)).at[0, 1, 2].set(-jnp.inf)
    kw = dict(is_causal=is_causal, window=window, kv_lengths=jnp.array(s - 1),
              q_lengths=jnp.array(t - 1))
    np.testing.assert_allclose(_wired(q, k, v, mask, bias, **kw),
                               _dense(q, k, v, mask, bias, **kw), **F32_TOL)

  def test_rows_that_see_nothing_are_exactly_zero(self):
    q, k, v = _qkv(6, 3)  # causal T > S: rows 0-2 see nothing
    mask = jnp.ones((B, 1, 6, 3), bool).at[1, 0, 4].set(False)
    out = _wired(q, k, v, mask, is_causal=True, kv_lengths=jnp.array([[3], [0]]))
    np.testing.assert_array_equal(out[0, :, :3], 0.0)
    np.testing.assert_array_equal(out[1], 0.0)  # key length 0
    self.assertTrue(np.all(np.abs(out[0, :, 3:]).sum(-1) > 0))

  @parameterized.product(**POSITIONS)
  def test_positions_match_dense_and_reference(self, positions, ts, band):
    t, s = ts
    q_offset, kv_offset = {
        "scalar": (3, 1),
        "top_left": (0, 0),  # jax.nn's own alignment, T != S
        "per_example": (np.array([0, 5]), np.array([0, 2])),
    }[positions]
    is_causal, window = {
        "causal": (True, None), "window": (False, (2, 0)),
        "causal_window": (True, (1, 3)), "two_sided": (False, (1, 2)),
    }[band]
    q, k, v = _qkv(t, s, seed=11)
    mask = aj.Mask(causal=is_causal, window=window, q_offset=q_offset,
                   kv_offset=kv_offset, kv_lengths=jnp.array([s, s - 1]))
    got = _kernel_xla(base.canonicalize(q, k, v, mask))
    chex.assert_shape(got, (B, N, t, H))
    allowed = _positioned_allowed(t, s, q_offset, kv_offset, is_causal,
                                  window) & (np.arange(s) < np.array(
                                      [s, s - 1])[:, None, None, None])
    np.testing.assert_allclose(got, _reference(q, k, v, allowed), **F32_TOL)
    np.testing.assert_allclose(got, aj.scaled_dot_product_attention(
        q, k, v, mask, implementation="dense"), **F32_TOL)

  def test_top_left_positions_use_jax_nns_own_flags(self):
    # Concrete q_offset = kv_offset with T == S: jax.nn's causal flag and
    # left window are exact, so no [T, S] band is built. (For T != S the
    # band is explicit: cuDNN's own alignment there is unchecked on a GPU.)
    q, k, v = _qkv(7, 7, seed=12)
    seen = {}
    real = jax.nn.dot_product_attention

    def spy(*args, **kwargs):
      seen.update(is_causal=kwargs["is_causal"], mask=kwargs["mask"],
                  window=kwargs["local_window_size"])
      return real(*args, **kwargs)

    mask = aj.Mask(causal=True, window=(2, 0), q_offset=0, kv_offset=0)
    with mock.patch.object(jax.nn, "dot_product_attention", spy):
      got = _kernel_xla(base.canonicalize(q, k, v, mask))
    self.assertEqual(seen, dict(is_causal=True, mask=None, window=(2, 0)))
    allowed = _positioned_allowed(7, 7, 0, 0, True, (2, 0))
    np.testing.assert_allclose(got, _reference(q, k, v, allowed), **F32_TOL)
    # Another offset (here traced) is an explicit band, not jax.nn's flags.
    with mock.patch.object(jax.nn, "dot_product_attention", spy):
      jax.jit(lambda q, k, v, o: _kernel_xla(base.canonicalize(
          q, k, v, aj.Mask(causal=True, q_offset=o))))(q, k, v, 0)
    self.assertFalse(seen["is_causal"])
    chex.assert_shape(seen["mask"], (1, 1, 7, 7))
    q4 = q[:, :, :4]  # top-left with T != S: an explicit band too
    with mock.patch.object(jax.nn, "dot_product_attention", spy):
      got = _kernel_xla(base.canonicalize(q4, k, v, aj.Mask(
          causal=True, q_offset=0, kv_offset=0)))
    self.assertFalse(seen["is_causal"])
    chex.assert_shape(seen["mask"], (1, 1, 4, 7))
    allowed = _positioned_allowed(4, 7, 0, 0, True, None)
    np.testing.assert_allclose(got, _reference(q4, k, v, allowed), **F32_TOL)

  def test_jax_nn_alone_differs_where_the_wiring_steps_in(self):
    # What the wiring corrects: jax.nn's causal diagonal is top-left, and a
    # row that may see nothing is the mean of all values, not 0.
    q, k, v = _qkv(3, 5)
    swap = lambda x: jnp.swapaxes(x, 1, 2)
    raw = swap(jax.nn.dot_product_attention(
        swap(q), swap(k), swap(v), is_causal=True, implementation="xla"))
    self.assertFalse(np.allclose(raw, _dense(q, k, v, is_causal=True)))
    mask = jnp.zeros((1, 1, 3, 5), bool)
    raw = swap(jax.nn.dot_product_attention(
        swap(q), swap(k), swap(v), mask=mask, implementation="xla"))
    np.testing.assert_allclose(raw, jnp.broadcast_to(
        v.mean(axis=2, keepdims=True), raw.shape), **F32_TOL)
    np.testing.assert_array_equal(_wired(q, k, v, mask), 0.0)

  def test_jit_and_old_call_shape(self):
    q, k, v = _qkv(4, 4)
    fn = jax.jit(lambda q, k, v, n: cudnn.attention(
        q, k, v, None, None, n, scale=0.5, is_causal=True,
        implementation="xla"))
    n = jnp.array([[4], [2]])
    np.testing.assert_allclose(
        fn(q, k, v, n), aj.scaled_dot_product_attention(
            q, k, v, aj.Mask(kv_lengths=n), scale=0.5, is_causal=True,
            implementation="dense"), **F32_TOL)


class ProblemTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    # Past the GPU check to the later ones; nothing runs on the "GPU".
    self.enter_context(mock.patch.object(jax, "default_backend",
                                         return_value="gpu"))

  def _problem(self, t=8, s=8, structured=None, lengths=None, **kw):
    q, k, v = _qkv(t, s, jnp.bfloat16)
    return cudnn.problem_of(q, k, v, None, None, lengths, False, structured,
                            **kw)

  def test_nothing_structured(self):
    self.assertIsNone(self._problem())
    self.assertIsNone(self._problem(structured={}))
    self.assertIsNone(self._problem(structured={"sinks": None}))

  @parameterized.named_parameters(
      ("per_example", np.array([[3], [8]])),
      ("shared", np.array([[3]])),
      ("scalar", 5),
  )
  def test_query_lengths_accepted(self, q_lengths):
    self.assertIsNone(self._problem(
        structured={"q_lengths": q_lengths}))
    self.assertIsNone(self._problem(
        t=4, s=8, lengths=jnp.array(3),
        structured={"q_lengths": q_lengths}))

  def test_query_lengths_refused(self):
    # problem_of sees the lengths left-aligned to the [B, N] leading dims:
    # one per head ([B, N]) is what cuDNN cannot take.
    q_lengths = np.ones((2, 4), np.int32)
    self.assertRegex(self._problem(structured={"q_lengths": q_lengths}),
                     r"^it takes one length per example.*mask's q_lengths")
    self.assertRegex(self._problem(lengths=jnp.asarray(q_lengths)),
                     r"mask's kv_lengths must be \[B\]")

  def _supports(self, mask):
    q, k, v = _qkv(8, 8, jnp.bfloat16)
    return cudnn.Cudnn().supports(base.canonicalize(q, k, v, mask))

  def test_flat_lengths_are_one_per_example(self):
    # [B] lengths (which had to be [B, 1] before) align to the left: one
    # per example, what cuDNN takes; [B, N] (one per head) it refuses.
    flat = np.array([3, 8])
    self.assertIsNone(self._supports(aj.Mask(q_lengths=flat,
                                             kv_lengths=flat)))
    self.assertIsNone(self._supports(aj.Mask(q_lengths=flat[:, None],
                                             kv_lengths=flat[:, None])))
    per_head = np.full((B, N), 5)
    self.assertRegex(self._supports(aj.Mask(q_lengths=per_head)),
                     r"mask's q_lengths")
    self.assertRegex(self._supports(aj.Mask(kv_lengths=per_head)),
                     r"mask's kv_lengths")

  def test_flat_lengths_run_as_per_example(self):
    # Through the kernel (jax.nn's xla path in place of cuDNN), [B] lengths
    # give exactly what [B, 1] lengths give, and differ from none.
    q, k, v = _qkv(8, 8, jnp.bfloat16, seed=7)
    xla = functools.partial(cudnn.attention, implementation="xla")
    run = lambda mask: aj.scaled_dot_product_attention(
        q, k, v, mask, implementation="cudnn")
    with mock.patch.object(cudnn, "attention", xla):
      flat = run(aj.Mask(kv_lengths=jnp.array([3, 8]),
                         q_lengths=jnp.array([8, 5])))
      column = run(aj.Mask(kv_lengths=jnp.array([[3], [8]]),
                           q_lengths=jnp.array([[8], [5]])))
      plain = run(None)
    np.testing.assert_array_equal(flat, column)
    np.testing.assert_array_equal(flat[1, :, 5:], 0.0)
    self.assertFalse(np.allclose(flat[0], plain[0]))
    np.testing.assert_array_equal(flat[1, :, :5], plain[1, :, :5])

  @parameterized.named_parameters(
      ("causal_window", 8, 8, (3, 0), False),
      ("causal_window_wide", 8, 8, (100, 0), False),
      ("two_sided_clipped_by_causal", 8, 8, (3, 2), True),
  )
  def test_window_accepted(self, t, s, window, is_causal):
    self.assertIsNone(self._problem(t, s, {"window": window},
                                    is_causal=is_causal))

  @parameterized.named_parameters(
      ("scalar", 4, 8, dict(q_offset=3, kv_offset=1), None),
      ("top_left", 4, 8, dict(q_offset=0, kv_offset=0), None),
      ("top_left_window_square", 8, 8, dict(q_offset=0, kv_offset=0),
       (2, 0)),
      ("per_example", 8, 4, dict(q_offset=np.array([0, 5])), None),
  )
  def test_positions_accepted(self, t, s, positions, window):
    # Causality at any offset (an explicit band where it is not 0); a
    # window at offset 0 only, where it is jax.nn's own.
    q, k, v = _qkv(t, s, jnp.bfloat16)
    mask = aj.Mask(causal=True, window=window, **positions)
    self.assertIsNone(cudnn.Cudnn().supports(base.canonicalize(q, k, v,
                                                               mask)))

  @parameterized.named_parameters(
      ("bottom_right_chunk", 4, 8, {}, r"offset \(S - T = 4\)"),
      ("bottom_right_more_queries", 8, 4, {}, r"offset \(S - T = -4\)"),
      ("scalar_positions", 8, 8, dict(q_offset=3, kv_offset=1),
       r"offset \(q_offset - kv_offset, not concretely 0\)"),
      ("per_example", 8, 8, dict(q_offset=np.array([0, 5])),
       r"offset \(q_offset - kv_offset, not concretely 0\)"),
      # jax.nn's cuDNN causal alignment for T != S is not checked on a GPU
      # here: top-left positions with T != S go as an explicit band.
      ("top_left_t_ne_s", 4, 8, dict(q_offset=0, kv_offset=0),
       r"offset, T = 4 != S = 8"),
  )
  def test_windows_off_offset_zero_refused(self, t, s, positions, why):
    # cuDNN's window is top-left: anywhere else it would be a [T, S] mask,
    # which the automatic choice leaves to the kernels that skip blocks.
    q, k, v = _qkv(t, s, jnp.bfloat16)
    mask = aj.Mask(causal=True, window=(2, 0), **positions)
    self.assertRegex(
        cudnn.Cudnn().supports(base.canonicalize(q, k, v, mask)),
        r"^window=\(2, 0\) with query row i at key column i \+ " + why
        + r".*explicit \[T, S\] mask")

  @parameterized.named_parameters(
      ("two_sided", 8, 8, (3, 2), r"only a left window"),
      ("right_only", 8, 8, (0, 2), r"only a left window"),
      ("right_only_t_ne_s", 4, 8, (0, 2), r"only a left window"),
  )
  def test_window_refused(self, t, s, window, why):
    self.assertRegex(self._problem(t, s, {"window": window}),
                     r"^(a )?window.*" + why)

  @parameterized.parameters("segment_ids", "sinks", "score_mod", "rule",
                            "something_new")
  def test_unsupported_named(self, name):
    self.assertRegex(self._problem(structured={name: object()}),
                     "^" + name)

  def test_first_refused_argument_named(self):
    structured = {"q_lengths": np.array([[3], [8]]),
                  "window": (2, 0), "score_mod": aj.soft_cap(30.0),
                  "sinks": jnp.zeros((N,))}
    self.assertRegex(self._problem(structured=structured), "^score_mod")

  def test_earlier_checks_still_first(self):
    q, k, v = _qkv(8, 8)  # float32
    self.assertRegex(cudnn.problem_of(q, k, v, None, None, None, False,
                                      {"score_mod": aj.soft_cap(1.0)}),
                     "float16/bfloat16")


class NoGpuTest(absltest.TestCase):

  def test_cpu_refused(self):
    q, k, v = _qkv(8, 8, jnp.bfloat16)
    self.assertRegex(cudnn.problem_of(q, k, v, None, None, None, False, {}),
                     "needs a GPU")


class MultiHeadDispatchTest(absltest.TestCase):

  def test_multi_head_path_reaches_cudnn_with_its_own_operands(self):
    # attend_heads hands 4-D [B, N, T, H] queries over [B, K, S, H] keys to
    # the dispatcher; with a GPU (patched) and bf16 inputs large enough for
    # the fused kernel it must pick cuDNN and pass the ungrouped operands
    # (jax.nn groups heads itself). The kernel call is recorded, not run.
    q = jnp.zeros((1, 8, 1024, 64), jnp.bfloat16)
    kv = jnp.zeros((1, 2, 1024, 64), jnp.bfloat16)
    seen = {}

    def fake(query, key, value, *args, **kwargs):
      seen.update(query=query.shape, key=key.shape, causal=kwargs["is_causal"])
      return jnp.zeros(query.shape, query.dtype)

    with mock.patch.object(jax, "default_backend", return_value="gpu"), \
        mock.patch.object(cudnn, "attention", fake):
      aj.attend_heads(q, kv, kv, is_causal=True)
      self.assertEqual(seen, dict(query=(1, 8, 1024, 64),
                                  key=(1, 2, 1024, 64), causal=True))
      # A pattern cuDNN cannot take sends the automatic choice elsewhere:
      # the Pallas GPU kernel (tests/test_kernel_choice.py has the rest).
      problem = base.canonicalize(q, kv, kv, aj.Mask(causal=True),
                                  sinks=jnp.zeros(8))
      kernels, automatic = aj.kernels.candidates(None)
      choice = aj.kernels.choose(kernels, problem, automatic)
      self.assertEqual(choice.name, "pallas_gpu")


if __name__ == "__main__":
  absltest.main()
