"""NaN and inf reach only the rows that may see them, in every kernel.

The shared contract (``tests/contract.py``, the ``garbage_*`` cases) plants
NaN and inf in keys, values and a query on every kernel, ring included;
this file covers what it does not: one planted entry at a time on the
causal window a user reported (T = 64, a window of 5, position 40, the
flash kernel's 16 x 16 blocks), the row maxima and weights (which the
contract's garbage cases do not ask for), a NaN query past the query
lengths (padding the backward pass once spread into every key's
gradient), float64, and cuDNN's wiring run through jax.nn's XLA path (the
cuDNN kernel itself needs a GPU). The reference is the float64 one of the
contract (``tests/reference.masked_attention``) on the clean inputs.

Shape glossary: B batch, N query heads, K key/value heads, T query length,
S key/value length, H head dim.
"""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.kernels import cudnn
from tests import _data
from tests import reference

B, N, K, T, H = 1, 2, 1, 64, 8
WINDOW, AT = 5, 40  # the causal window (left) and the planted position
# float32 compute over <= 6 keys per row, against float64: ~1e-6; the
# flash backward recomputes P from lse (a few more roundings).
FWD_TOL, GRAD_TOL = 1e-5, 5e-5

KERNELS = {"dense": "dense",
           "flash": aj.kernels.Flash(block_q=16, block_k=16)}
# (operand, feature, value): one planted entry per test
PLANTS = {"key_nan": ("key", 3, np.nan), "key_inf": ("key", 0, np.inf),
          "value_nan": ("value", 5, np.nan),
          "value_neg_inf": ("value", 2, -np.inf),
          "query_nan": ("query", 1, np.nan)}


def _operands():
  q = _data.normal(40, (B, N, T, H))
  k = _data.normal(41, (B, K, T, H))
  v = _data.normal(42, (B, K, T, H))
  return q, k, v


def _allowed():
  i, j = np.arange(T)[:, None], np.arange(T)[None, :]
  return np.broadcast_to((j <= i) & (j >= i - WINDOW), (B, N, T, T))


def _planted(plant):
  """The operands with one entry planted (head 0 of its tensor), and the
  rows [B, N, T] that see it (all query heads share the one key head)."""
  name, feature, value = PLANTS[plant]
  ops = dict(zip(("query", "key", "value"), _operands()))
  ops[name] = ops[name].at[0, 0, AT, feature].set(value)
  rows = np.zeros((B, N, T), bool)
  if name == "query":
    rows[0, 0, AT] = True
  else:
    rows[0, :, AT:AT + WINDOW + 1] = True  # rows i with i - 5 <= 40 <= i
  return ops, rows


class GarbageTest(chex.TestCase):

  @parameterized.product(kernel=tuple(KERNELS), plant=tuple(PLANTS))
  def test_only_rows_that_see_it(self, kernel, plant):
    ops, seeing = _planted(plant)
    mask = aj.Mask(causal=True, window=(WINDOW, 0))
    cot = jnp.where(seeing[..., None], 0.0, _data.normal(43, (B, N, T, H)))
    key_like = PLANTS[plant][0] != "value"  # the lse depends on it too
    cot_lse = jnp.where(seeing & key_like, 0.0, _data.normal(44, (B, N, T)))

    def ours(q, k, v):
      out, lse = aj.scaled_dot_product_attention(
          q, k, v, mask, implementation=KERNELS[kernel], return_lse=True)
      loss = jnp.sum(jnp.where(seeing[..., None], 0.0, out) * cot) + jnp.sum(
          jnp.where(seeing & key_like, 0.0, lse) * cot_lse)
      return loss, (out, lse)

    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(
        ours, (0, 1, 2), has_aux=True))(ops["query"], ops["key"],
                                        ops["value"])

    def clean(q, k, v):
      out, lse = reference.masked_attention(q, k, v, None, _allowed())
      loss = jnp.sum(out * cot) + jnp.sum(lse * cot_lse)
      return loss, (out, lse)

    with jax.enable_x64(True):
      f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
      (_, (ref_out, ref_lse)), want = jax.value_and_grad(
          clean, (0, 1, 2), has_aux=True)(
              *(jnp.asarray(f64(x)) for x in _operands()))
    out, lse = f64(out), f64(lse)
    # Exactly the rows that see the entry are not finite.
    np.testing.assert_array_equal(~np.isfinite(out).all(-1), seeing)
    np.testing.assert_array_equal(~np.isfinite(lse), seeing & key_like)
    np.testing.assert_allclose(out[~seeing], f64(ref_out)[~seeing],
                               atol=FWD_TOL, rtol=FWD_TOL)
    finite = np.isfinite(lse)
    np.testing.assert_allclose(lse[finite], f64(ref_lse)[finite],
                               atol=FWD_TOL, rtol=FWD_TOL)
    for name, got, ref, x in zip(("dq", "dk", "dv"), grads, want,
                                 ops.values()):
      got = f64(got)
      self.assertTrue(np.isfinite(got).all(), name)
      at = np.isfinite(f64(x))  # the clean entries
      np.testing.assert_allclose(got[at], f64(ref)[at], atol=GRAD_TOL,
                                 rtol=GRAD_TOL, err_msg=name)

  @parameterized.parameters("dense", "flash")
  def test_row_maxima_and_weights(self, kernel):
    ops, seeing = _planted("key_nan")
    mask = aj.Mask(causal=True, window=(WINDOW, 0))
    kw = dict(return_weights=True) if kernel == "dense" else {}
    got = aj.scaled_dot_product_attention(
        ops["query"], ops["key"], ops["value"], mask,
        implementation=KERNELS[kernel], return_max_logits=True, **kw)
    clean = aj.scaled_dot_product_attention(
        *_operands(), mask, implementation="dense", return_max_logits=True,
        return_weights=True)
    max_logits = np.asarray(got[-1])
    np.testing.assert_array_equal(np.isnan(max_logits), seeing)
    # float32 both; flash scales after the maximum (a rounding apart)
    np.testing.assert_allclose(max_logits[~seeing],
                               np.asarray(clean[-1])[~seeing], rtol=1e-5,
                               atol=1e-6)
    if kernel == "dense":
      weights = np.asarray(got[1])
      np.testing.assert_array_equal(np.isnan(weights).all(-1), seeing)
      np.testing.assert_array_equal(weights[~seeing],
                                    np.asarray(clean[1])[~seeing])

  @parameterized.parameters("dense", "flash")
  def test_nan_query_past_query_lengths(self, kernel):
    """A padded query (not a query at all) reaches no gradient."""
    q, k, v = _operands()
    q_in = q.at[0, 1, T - 3].set(jnp.nan)
    mask = aj.Mask(causal=True, q_lengths=jnp.array([T - 4]))

    def loss(q, k, v):
      return jnp.sum(aj.scaled_dot_product_attention(
          q, k, v, mask, implementation=KERNELS[kernel]) ** 2)

    got = jax.grad(loss, (0, 1, 2))(q_in, k, v)
    want = jax.grad(loss, (0, 1, 2))(q, k, v)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-6,
                                 err_msg=name)

  def test_splash_static_mask(self):
    """Splash finds the rows from its static mask (a concrete rule) in
    plain JAX, beside its kernel."""
    ops, seeing = _planted("value_nan")
    rule = lambda b, h, q_idx, kv_idx: (  # noqa: E731
        (kv_idx <= q_idx) & (kv_idx >= q_idx - WINDOW))
    out = aj.scaled_dot_product_attention(
        *ops.values(), aj.Mask(rule=rule),
        implementation=aj.kernels.Splash(interpret=True))
    clean = aj.scaled_dot_product_attention(
        *_operands(), aj.Mask(causal=True, window=(WINDOW, 0)))
    out = np.asarray(out)
    np.testing.assert_array_equal(~np.isfinite(out).all(-1), seeing)
    np.testing.assert_allclose(out[~seeing], np.asarray(clean)[~seeing],
                               atol=FWD_TOL, rtol=FWD_TOL)

  def test_float64_dense(self):
    with jax.enable_x64(True):
      ops, seeing = _planted("value_nan")
      mask = aj.Mask(causal=True, window=(WINDOW, 0))
      out = aj.scaled_dot_product_attention(
          *(x.astype(jnp.float64) for x in ops.values()), mask)
      clean = aj.scaled_dot_product_attention(
          *(x.astype(jnp.float64) for x in _operands()), mask)
      out = np.asarray(out)
      np.testing.assert_array_equal(~np.isfinite(out).all(-1), seeing)
      # float64 throughout: the same operations on the same numbers
      np.testing.assert_allclose(out[~seeing], np.asarray(clean)[~seeing],
                                 rtol=1e-12)

  def test_cudnn_wiring_by_construction(self):
    """cuDNN's wrapper, run through jax.nn's XLA path (the same calls but
    the kernel): the operands it is given are finite, and exactly the rows
    that may see a bad entry are NaN, GQA heads and key lengths included."""
    q = _data.normal(45, (2, 4, 24, H))
    k, v = _data.normal(46, (2, 2, 24, H)), _data.normal(47, (2, 2, 24, H))
    k = k.at[0, 1, 10, 2].set(jnp.nan)  # seen by query heads 2, 3
    v = v.at[1, 0, 5, 0].set(jnp.inf)  # seen by query heads 0, 1
    v = v.at[1, 1, 22, 0].set(jnp.nan)  # past example 1's length: unseen
    lengths = jnp.array([[24], [20]])
    given = []

    def spy(*args, **kw):
      given.extend(args[:3])
      return real(*args, **kw)

    real = jax.nn.dot_product_attention
    with absltest.mock.patch.object(jax.nn, "dot_product_attention", spy):
      out = cudnn.attention(q, k, v, None, None, lengths, scale=0.3,
                            is_causal=True, window=(3, 0),
                            implementation="xla")
    self.assertTrue(all(np.isfinite(np.asarray(x)).all() for x in given))
    seeing = np.zeros((2, 4, 24), bool)
    seeing[0, 2:, 10:14] = True  # rows i with i - 3 <= 10 <= i
    seeing[1, :2, 5:9] = True
    out = np.asarray(out)
    np.testing.assert_array_equal(~np.isfinite(out).all(-1), seeing)
    clean = aj.scaled_dot_product_attention(
        q, *_data_clean(k, v), aj.Mask(causal=True, window=(3, 0),
                                       kv_lengths=lengths[:, 0]), scale=0.3)
    np.testing.assert_allclose(out[~seeing], np.asarray(clean)[~seeing],
                               atol=1e-5)


def _data_clean(*arrays):
  """The arrays with their NaN and inf replaced by 0 (rows that see them
  are not compared)."""
  return tuple(jnp.where(jnp.isfinite(x), x, 0.0) for x in arrays)


class OneRowGarbageTest(chex.TestCase):
  """One query row (a decoding step over a cache): the dense kernel reads
  what the row sees off its logits and output instead of sanitising the
  keys and values (one more pass over the cache), so the garbage the row
  does and does not see is checked here, each planted slot apart."""

  S, POS = 32, 20  # cache slots; the query's position (window 5: 15..20)

  def _call(self, q, k, v, **kw):
    mask = aj.Mask(causal=True, window=(WINDOW, 0), kv_lengths=[self.POS + 1],
                   q_offset=self.POS)
    return aj.scaled_dot_product_attention(
        q, k, v, mask, implementation="dense", return_lse=True, **kw)

  def _operands(self):
    return (_data.normal(50, (1, N, 1, H)), _data.normal(51, (1, K, self.S, H)),
            _data.normal(52, (1, K, self.S, H)))

  @parameterized.product(
      name=("key", "value"), value=(np.nan, np.inf, -np.inf),
      slot=(3, 14, 25))  # before the window, its edge, past the length
  def test_unseen_slot(self, name, value, slot):
    ops = dict(zip(("q", "k", "v"), self._operands()))
    clean = self._call(ops["q"], ops["k"], ops["v"])
    ops[name[0]] = ops[name[0]].at[0, 0, slot, 2].set(value)
    got = self._call(ops["q"], ops["k"], ops["v"])
    # the same operations on the same finite entries: exactly equal
    chex.assert_trees_all_equal(got, clean)

  @parameterized.product(name=("key", "value"),
                         value=(np.nan, np.inf, -np.inf), slot=(15, 20))
  def test_seen_slot(self, name, value, slot):
    q, k, v = self._operands()
    if name == "key":
      k = k.at[0, 0, slot, 2].set(value)
    else:
      v = v.at[0, 0, slot, 2].set(value)
    out, lse = self._call(q, k, v)
    self.assertTrue(np.isnan(out).all(), out)  # never a finite number
    # a bad key spoils the row's lse; a bad value only its output
    self.assertEqual(bool(np.isnan(lse).all()), name == "key")
    self.assertEqual(bool(np.isfinite(lse).all()), name == "value")

  def test_unseen_slot_gradients(self):
    """Garbage the row does not see changes no gradient (its own is 0)."""
    q, k, v = self._operands()

    def loss(q, k, v):
      return jnp.sum(self._call(q, k, v)[0] ** 2)

    clean = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    got = jax.grad(loss, argnums=(0, 1, 2))(
        q, k.at[0, 0, 3, 2].set(jnp.nan), v.at[0, 0, 25, 1].set(jnp.inf))
    chex.assert_trees_all_equal(got, clean)  # same finite operations

  def test_value_blocked_by_bias(self):
    """A slot a -inf bias blocks is not seen: its NaN value stays out."""
    q, k, v = self._operands()
    bias = jnp.zeros((1, 1, 1, self.S)).at[..., 17].set(-jnp.inf)
    clean = self._call(q, k, v, bias=bias)
    got = self._call(q, k.at[0, 0, 17].set(jnp.nan),
                     v.at[0, 0, 17].set(jnp.nan), bias=bias)
    chex.assert_trees_all_equal(got, clean)
    self.assertTrue(np.isfinite(got[0]).all())

  def test_nan_query(self):
    q, k, v = self._operands()
    out, lse = self._call(q.at[0, 0, 0, 1].set(jnp.nan), k, v)
    self.assertTrue(np.isnan(out[0, 0]).all() and np.isnan(lse[0, 0]).all())
    self.assertTrue(np.isfinite(out[0, 1:]).all())  # the other head


if __name__ == "__main__":
  absltest.main()
