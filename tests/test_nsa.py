"""NSA (Yuan et al. 2025) against a float64 NumPy reference from the paper.

The reference (``_reference``) follows the paper's equations, not the
library's code, one query at a time: per-branch projections; compressed
keys/values ``phi(k[i d : i d + l])`` (eq. 7, ``phi`` the flattened block
plus its position table through a one-hidden-layer GELU MLP), read by
query ``t`` when ``i d + l - 1 <= t``; the selection blocks' importance
(eq. 9) as a table ``w[i, j]`` counting the strides of compressed block
``i`` inside selection block ``j``, summed over a GQA group's heads (eq.
10); the first block, ``local_blocks`` local ones and the best others to
``top_n`` (ties to the lower block), read causally (eq. 11); the last
``window`` tokens; sigmoid gates per head and branch; ``W_o``. The layer
must give its output, every branch, the gates, the importance and the
chosen blocks for the dense and flash kernels, and gradients of every
parameter equal to the reference's finite differences (directional
derivatives, one random direction per parameter array).
"""

import functools
import math

from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.layers import nsa
from tests import _data

# Shapes: GQA (G = 2), a compression MLP narrower than H (M != H catches a
# transposed W_1), and the paper's ratios scaled down: l' = 2 l, l = 2 d.
B, T, D, N, K, H, M = 2, 40, 16, 4, 2, 8, 6
CONFIG = dict(block=4, stride=2, select_block=8, top_n=4, window=6,
              local_blocks=2)

# float32 against float64: every output is a few sums of at most ~40
# products of O(1) numbers after softmaxes; rounding stays near 1e-6, and
# 2e-5 leaves room for the flash kernel's blockwise rescaling.
TOL = dict(atol=2e-5, rtol=2e-5)
# The float32 importance must rank blocks as the float64 one does: the
# test data keeps the last chosen free block this far above the best one
# left out (importances are sums of probabilities, rounded near 1e-7).
MARGIN = 1e-4
# Finite differences of the float64 reference: central, step 1e-4
# (truncation ~1e-8, far below the float32 gradients' own rounding).
EPS = 1e-4

# A parameter's gradient the maths makes zero: a bias added to every key
# of a softmax row shifts each logit of the row by the same q . b.
ZERO_GRADIENT = {("W_k_slc", "bias"), ("W_k_win", "bias"), ("phi_k", "b_2")}


def is_exhaustive(test_name: str) -> bool:
  """conftest's hook: what repeats the default dense check on the flash
  kernel (a value-and-gradient compile of ~9 CPU-seconds), at other
  settings (rope, l' = l = d, T < l, top_n covering every block; ~4
  CPU-seconds each) or through the module's call."""
  return test_name in (
      "test_matches_reference_flash",
      "test_flash_parts_match_reference",
      "test_rope_matches_reference",
      "test_equal_block_sizes_match_reference",
      "test_sequence_shorter_than_a_block",
      "test_top_n_covering_every_block_is_causal_attention",
      "test_module_call_is_the_function",
  )


# The reference, from the paper.
def _gelu(z):
  return 0.5 * z * (1.0 + np.vectorize(math.erf)(z / math.sqrt(2.0)))


def _sigmoid(z):
  return 1.0 / (1.0 + np.exp(-z))


def _rotate(x, positions, base=10000.0):
  """Half-split rotary embedding of ``x [..., T, H]``: pair ``(i, i + H/2)``
  turns by ``positions * base ** (-2 i / H)``."""
  h = x.shape[-1] // 2
  angle = positions[:, None] * base ** (-2.0 * np.arange(h) / (2 * h))
  cos, sin = np.cos(angle), np.sin(angle)
  a, b = x[..., :h], x[..., h:]
  return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)


def _attend(q, keys, values, scale):
  """Softmax attention of queries ``[n, H]`` over keys ``[n, s, H]``."""
  logits = np.einsum("nh,nsh->ns", q, keys) * scale
  w = np.exp(logits - logits.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  return np.einsum("ns,nsh->nh", w, values), w


def _stride_table(c, j, block, stride, select_block):
  """Eq. 9's weights ``[C, J]``: how many strides of compressed block
  ``i`` (tokens ``[i d, i d + l)``) lie in selection block ``j``."""
  w = np.zeros((c, j))
  for i in range(c):
    for s in range(i, i + block // stride):  # the strides it covers
      w[i, s * stride // select_block] += 1
  return w


def _reference(params, x, *, block, stride, select_block, top_n, window,
               local_blocks, rope=False):
  """The layer in float64: ``(out [B, T, D], parts)``, parts the branches
  ``[B, N, T, H]``, gates ``[B, N, T, 3]``, ``p_cmp [B, N, T, C]``,
  importance and chosen ``[B, K, T, J]`` and ``margin``."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  x = np.asarray(x, np.float64)
  b_, t_, _ = x.shape
  n_, h_ = p["W_q"]["kernel"].shape[1:]
  k_ = p["W_k_cmp"]["kernel"].shape[1]
  g_ = n_ // k_
  scale = 1.0 / math.sqrt(h_)

  def proj(name):
    out = np.einsum("btd,dnh->bnth", x, p[name]["kernel"])
    if "bias" in p[name]:
      out = out + p[name]["bias"][None, :, None, :]
    return out

  q = proj("W_q")
  kv = {name: proj(name) for name in p if name[:3] in ("W_k", "W_v")}
  if rope:
    q = _rotate(q, np.arange(t_))
    for name in ("W_k_cmp", "W_k_slc", "W_k_win"):
      kv[name] = _rotate(kv[name], np.arange(t_))
  c_ = (t_ - block) // stride + 1 if t_ >= block else 0

  def phi(w, rows):  # rows [l, H] -> [H]
    hidden = _gelu((rows + w["position"]).reshape(-1)
                   @ w["W_1"].reshape(block * h_, -1) + w["b_1"])
    return hidden @ w["W_2"] + w["b_2"]

  k_cmp = np.zeros((b_, k_, c_, h_))
  v_cmp = np.zeros((b_, k_, c_, h_))
  for b in range(b_):
    for kh in range(k_):
      for i in range(c_):
        span = slice(i * stride, i * stride + block)
        k_cmp[b, kh, i] = phi(p["phi_k"], kv["W_k_cmp"][b, kh, span])
        v_cmp[b, kh, i] = phi(p["phi_v"], kv["W_v_cmp"][b, kh, span])
  j_ = -(-t_ // select_block)
  table = _stride_table(c_, j_, block, stride, select_block)
  heads = np.arange(n_) // g_  # each query head's key/value head
  parts = {name: np.zeros((b_, n_, t_, h_)) for name in ("cmp", "slc",
                                                         "win")}
  p_cmp = np.zeros((b_, n_, t_, c_))
  importance = np.zeros((b_, k_, t_, j_))
  chosen = np.zeros((b_, k_, t_, j_), bool)
  margin = np.inf
  for b in range(b_):
    for t in range(t_):
      seen = [i for i in range(c_) if i * stride + block - 1 <= t]
      if seen:  # else the branch gives 0
        parts["cmp"][b, :, t], p_cmp[b, :, t][:, seen] = _attend(
            q[b, :, t], k_cmp[b][heads][:, seen], v_cmp[b][heads][:, seen],
            scale)
      recent = list(range(max(0, t - window + 1), t + 1))
      parts["win"][b, :, t] = _attend(
          q[b, :, t], kv["W_k_win"][b][heads][:, recent],
          kv["W_v_win"][b][heads][:, recent], scale)[0]
      own = t // select_block
      forced = {0} | {own - m for m in range(local_blocks) if own >= m}
      for kh in range(k_):
        group = slice(kh * g_, (kh + 1) * g_)
        score = (p_cmp[b, group, t] @ table).sum(0)  # eq. 10: sum of heads
        importance[b, kh, t] = score
        rest = sorted(set(range(own + 1)) - forced,
                      key=lambda j: (-score[j], j))
        free = top_n - len(forced)
        if 0 < free < len(rest) and score[rest[free - 1]] > 0:
          margin = min(margin, score[rest[free - 1]] - score[rest[free]])
        blocks = sorted(forced | set(rest[:free]))
        chosen[b, kh, t, blocks] = True
        cols = [s for j in blocks
                for s in range(j * select_block,
                               min((j + 1) * select_block, t + 1))]
        parts["slc"][b, group, t] = _attend(
            q[b, group, t], kv["W_k_slc"][b, kh][None, cols].repeat(g_, 0),
            kv["W_v_slc"][b, kh][None, cols].repeat(g_, 0), scale)[0]
  gates = _sigmoid(np.einsum("btd,dnr->bntr", x, p["W_g"]["kernel"])
                   + p["W_g"]["bias"][None, :, None, :])
  mixed = sum(gates[..., r, None] * parts[name]
              for r, name in enumerate(("cmp", "slc", "win")))
  out = np.einsum("bnth,nhd->btd", mixed, p["W_o"]["kernel"])
  if "bias" in p["W_o"]:
    out = out + p["W_o"]["bias"]
  parts.update(gates=gates, p_cmp=p_cmp, importance=importance,
               chosen=chosen, margin=margin)
  return out, parts


# Test data.
def _params(seed=0, use_bias=True, block=CONFIG["block"], m=M):
  """Seeded parameters: kernels with std 1/sqrt(fan-in), biases and the
  position tables 0.5 N(0, 1), so every entry matters."""
  shapes = jax.eval_shape(lambda key: aj.init_nsa_params(
      key, D, N, K, H, block=block, stride=CONFIG["stride"],
      select_block=CONFIG["select_block"], compress_hidden=m,
      use_bias=use_bias), jax.random.key(0))
  params = {}
  for i, (name, entries) in enumerate(sorted(shapes.items())):
    params[name] = {}
    for e, (entry, leaf) in enumerate(sorted(entries.items())):
      value = _data.normal(seed + 10 * i + e, leaf.shape)
      if entry in ("kernel", "W_1", "W_2"):
        fan_in = (leaf.shape[0] if name[:3] in ("W_q", "W_k", "W_v", "W_g")
                  else math.prod(leaf.shape[:-1]))
        value = value / np.sqrt(fan_in)
      else:
        value = 0.5 * value
      params[name][entry] = value
  return params


def _x(seed=7, t=T):
  return _data.normal(seed, (B, t, D))


@functools.cache
def _run(implementation, **settings):
  """One compile: ``(out, parts), grads`` of ``sum(out * cot)`` with
  respect to ``(params, x)``, ``parts`` the layer's branches."""

  def loss(params, x, cot):
    out, parts = aj.nsa_attention(params, x, implementation=implementation,
                                  return_branches=True, **settings)
    return jnp.sum(out * cot), (out, parts)

  return jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))


def _settings(**changes):
  return tuple(sorted({**CONFIG, **changes}.items()))


def _call(implementation="dense", params=None, x=None, cot=None, **changes):
  params = _params() if params is None else params
  x = _x() if x is None else x
  cot = _data.normal(3, x.shape) if cot is None else cot
  (_, (out, parts)), grads = _run(implementation,
                                  **dict(_settings(**changes)))(params, x,
                                                                cot)
  return out, parts, grads


@functools.cache
def _default_reference():
  return _reference(_params(), _x(), **CONFIG)


def _directional_derivative(params, x, cot, name, entry, direction):
  """d sum(out * cot) along ``direction`` of ``params[name][entry]``, by
  central differences of the float64 reference."""
  values, cot = [], np.asarray(cot, np.float64)
  for sign in (1.0, -1.0):
    moved = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    moved[name][entry] = moved[name][entry] + sign * EPS * direction
    values.append(np.sum(_reference(moved, x, **CONFIG)[0] * cot))
  return (values[0] - values[1]) / (2 * EPS)


class ReferenceTest(parameterized.TestCase):
  """The layer against the float64 reference, the paper's equations."""

  def _check_parts(self, out, parts, want, want_parts):
    self.assertGreater(want_parts["margin"], MARGIN, "test data too close "
                       "to a tie for float32 to rank as float64 does")
    np.testing.assert_array_equal(np.asarray(parts["chosen"]),
                                  want_parts["chosen"])
    np.testing.assert_allclose(parts["importance"],
                               want_parts["importance"], **TOL)
    for name in ("cmp", "slc", "win", "gates"):
      np.testing.assert_allclose(parts[name], want_parts[name], **TOL,
                                 err_msg=name)
    np.testing.assert_allclose(out, want, **TOL)

  @parameterized.named_parameters(("dense", "dense"), ("flash", "flash"))
  def test_matches_reference(self, implementation):
    """Output, branches, gates, importance and chosen blocks; gradients of
    every parameter along a random direction against the reference's
    central differences."""
    params, x, cot = _params(), _x(), _data.normal(3, (B, T, D))
    out, parts, (grads, _) = _call(implementation)
    want, want_parts = _default_reference()
    self._check_parts(out, parts, want, want_parts)
    for i, name in enumerate(sorted(params)):
      for e, (entry, grad) in enumerate(sorted(grads[name].items())):
        direction = np.asarray(_data.normal(100 + 10 * i + e, grad.shape),
                               np.float64)
        got = float(np.sum(np.asarray(grad, np.float64) * direction))
        want_d = _directional_derivative(params, x, cot, name, entry,
                                         direction)
        # float32 gradients: each term rounded near 1e-6 of its size.
        tol = 1e-4 * float(np.sum(np.abs(grad) * np.abs(direction))) + 1e-5
        self.assertAlmostEqual(got, want_d, delta=tol,
                               msg=f"{name}.{entry}")
        if (name, entry) not in ZERO_GRADIENT:
          self.assertGreater(float(np.abs(grad).max()), 1e-3,
                             f"no gradient reaches {name}.{entry}")

  def test_flash_parts_match_reference(self):
    """The flash forward alone (no gradient compile) at other settings:
    local_blocks=1, a window longer than a selection block."""
    settings = dict(CONFIG, local_blocks=1, top_n=3, window=11)
    fn = jax.jit(functools.partial(aj.nsa_attention, implementation="flash",
                                   return_branches=True, **settings))
    out, parts = fn(_params(1), _x(8))
    want, want_parts = _reference(_params(1), _x(8), **settings)
    self._check_parts(out, parts, want, want_parts)

  def test_selection_is_shared_by_a_group_and_keeps_first_and_local(self):
    """The chosen blocks are one per key/value head (its query heads'
    importance summed: the per-head choices differ, so the sum is what
    decides), always hold block 0 and the local blocks, never a later
    block, and leave some past block out (the selection is sparse)."""
    _, parts, _ = _call()
    chosen = np.asarray(parts["chosen"])  # [B, K, T, J]
    want_parts = _default_reference()[1]
    self.assertEqual(chosen.shape, (B, K, T, -(-T // 8)))
    own = np.arange(T) // CONFIG["select_block"]
    blocks = np.arange(chosen.shape[-1])
    self.assertTrue(chosen[..., 0].all())
    self.assertTrue(chosen[..., np.arange(T), own].all())
    self.assertTrue(chosen[..., np.arange(T)[own > 0], own[own > 0] - 1]
                    .all())
    self.assertFalse((chosen & (blocks > own[:, None])).any())
    np.testing.assert_array_less(chosen.sum(-1), CONFIG["top_n"] + 1)
    past = blocks <= own[:, None]
    self.assertTrue((past & ~chosen).any(), "no block was left out")
    # Each query head alone would choose otherwise somewhere.
    table = _stride_table(want_parts["p_cmp"].shape[-1], chosen.shape[-1],
                          CONFIG["block"], CONFIG["stride"],
                          CONFIG["select_block"])
    alone = want_parts["p_cmp"] @ table  # [B, N, T, J]
    free = past & (blocks > 0) & (blocks < own[:, None] - 1)
    best = np.where(free, alone, -np.inf).argmax(-1)  # [B, N, T]
    self.assertTrue((best[:, 0::2] != best[:, 1::2]).any(),
                    "the heads of a group agree everywhere")

  def test_causal_by_gradient(self):
    """Output row t has zero gradient with respect to x at t' > t (and
    some at t' <= t)."""
    for row in (5, 17):
      cot = np.zeros((B, T, D), np.float32)
      cot[:, row] = np.asarray(_data.normal(4, (B, D)))
      _, _, (_, grad_x) = _call(cot=jnp.asarray(cot))
      np.testing.assert_array_equal(np.asarray(grad_x)[:, row + 1:], 0.0)
      for seen in (0, row):
        self.assertGreater(float(np.abs(grad_x[:, seen]).max()), 0.0)

  def test_rope_matches_reference(self):
    settings = dict(CONFIG, rope=aj.Rope())
    fn = jax.jit(functools.partial(aj.nsa_attention, implementation="dense",
                                   return_branches=True, **settings))
    out, parts = fn(_params(2), _x(9))
    want, want_parts = _reference(_params(2), _x(9), **CONFIG, rope=True)
    self._check_parts(out, parts, want, want_parts)

  def test_equal_block_sizes_match_reference(self):
    """l' = l = d: the importance is p_cmp itself (summed over the
    group)."""
    settings = dict(block=4, stride=4, select_block=4, top_n=4, window=3,
                    local_blocks=1)
    params = _params(3, use_bias=False)
    fn = jax.jit(functools.partial(aj.nsa_attention, implementation="dense",
                                   return_branches=True, **settings))
    out, parts = fn(params, _x(10))
    want, want_parts = _reference(params, _x(10), **settings)
    self._check_parts(out, parts, want, want_parts)
    np.testing.assert_allclose(
        parts["importance"],  # C = J = T / 4 here
        want_parts["p_cmp"].reshape(B, K, N // K, T, -1).sum(2), **TOL)

  def test_sequence_shorter_than_a_block(self):
    """T < l: no compressed block; that branch gives 0, the selection
    keeps the causal blocks."""
    settings = dict(CONFIG, block=8, select_block=8)
    params = _params(4, block=8)
    out, parts = aj.nsa_attention(params, _x(11, t=6), implementation="dense",
                                  return_branches=True, **settings)
    want, _ = _reference(params, _x(11, t=6), **settings)
    np.testing.assert_array_equal(parts["cmp"], 0.0)
    np.testing.assert_allclose(out, want, **TOL)

  def test_top_n_covering_every_block_is_causal_attention(self):
    """top_n >= J: the selected branch is plain causal attention."""
    settings = dict(CONFIG, top_n=5)
    params, x = _params(5), _x(12)
    _, parts = jax.jit(functools.partial(
        aj.nsa_attention, implementation="flash", return_branches=True,
        **settings))(params, x)
    self.assertTrue(np.asarray(parts["chosen"])[
        ..., np.arange(5) <= (np.arange(T) // 8)[:, None]].all())
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    xs = np.asarray(x, np.float64)
    q = np.einsum("btd,dnh->bnth", xs, p["W_q"]["kernel"]) + p["W_q"][
        "bias"][:, None]
    k, v = (np.repeat(np.einsum("btd,dkh->bkth", xs, p[n]["kernel"])
                      + p[n]["bias"][:, None], N // K, 1)
            for n in ("W_k_slc", "W_v_slc"))
    logits = np.einsum("bnth,bnsh->bnts", q, k) / math.sqrt(H)
    logits = np.where(np.tril(np.ones((T, T), bool)), logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    want = np.einsum("bnts,bnsh->bnth", w / w.sum(-1, keepdims=True), v)
    np.testing.assert_allclose(parts["slc"], want, **TOL)


class PiecesTest(absltest.TestCase):
  """The selection's pieces, each against its equation (cheap compiles)."""

  def test_block_importance_is_eq_9_and_10(self):
    block, stride, select_block, t, c = 6, 2, 4, 17, 6
    p_cmp = np.asarray(_data.normal(20, (B, N, t, c))) ** 2
    got = nsa.block_importance(jnp.asarray(p_cmp), num_kv_heads=K,
                               block=block, stride=stride,
                               select_block=select_block, num_blocks=5)
    table = _stride_table(c, 5, block, stride, select_block)
    want = (p_cmp @ table).reshape(B, K, N // K, t, 5).sum(2)
    np.testing.assert_allclose(got, want, rtol=1e-6)  # float32 sums

  def test_choose_blocks(self):
    """Forced blocks first, then the best (ties to the lower block); top_n
    at least J keeps every causal block."""
    importance = jnp.asarray([[[[0.0, 0.1, 0.3, 0.3, 0.0, 0.9]] * 24]])
    own = np.arange(24) // 4
    chosen = np.asarray(nsa.choose_blocks(importance, select_block=4,
                                          top_n=4, local_blocks=2))[0, 0]
    # t = 23 (own block 5): 0, 4, 5 forced, then 2 (tied with 3, lower).
    np.testing.assert_array_equal(chosen[23], [1, 0, 1, 0, 1, 1])
    np.testing.assert_array_equal(chosen[9], [1, 1, 1, 0, 0, 0])
    everything = np.asarray(nsa.choose_blocks(
        importance, select_block=4, top_n=6, local_blocks=1))[0, 0]
    np.testing.assert_array_equal(everything,
                                  np.arange(6) <= own[:, None])


class RefusalTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("stride_not_dividing_block", dict(stride=3), ValueError,
       "stride=3 must divide block=4"),
      ("stride_above_block", dict(stride=8, select_block=8), ValueError,
       "stride=8 must divide block=4"),
      ("select_block_not_a_multiple", dict(select_block=5), ValueError,
       "select_block=5 must be a multiple of stride=2"),
      ("top_n_below_the_forced_blocks", dict(top_n=2), ValueError,
       "top_n=2 must be at least 1 \\+ local_blocks = 3"),
      ("zero_window", dict(window=0), ValueError, "window must be positive"),
      ("float_block", dict(block=4.0), TypeError, "block must be a Python "
       "int"),
      ("block_not_the_params", dict(block=8, select_block=8), ValueError,
       "block=8 but params\\['phi_k'\\]\\['position'\\] has shape \\(4, 8\\)"),
      ("rope_a_number", dict(rope=10000.0), TypeError, "rope="),
      ("return_branches_not_bool", dict(return_branches=1), TypeError,
       "return_branches must be a Python bool"),
  )
  def test_settings(self, changes, error, message):
    with self.assertRaisesRegex(error, message):
      aj.nsa_attention(_params(), _x(t=8), **{**CONFIG, **changes})

  def test_inputs_and_params(self):
    kw = dict(CONFIG)
    with self.assertRaisesRegex(ValueError, r"x has 8 features"):
      aj.nsa_attention(_params(), jnp.ones((1, 8, 8)), **kw)
    with self.assertRaisesRegex(ValueError, r"x must have rank 3"):
      aj.nsa_attention(_params(), jnp.ones((8, 16)), **kw)
    with self.assertRaisesRegex(TypeError, r"x must be a real floating"):
      aj.nsa_attention(_params(), jnp.ones((1, 8, 16), int), **kw)
    params = _params()
    del params["W_g"]
    with self.assertRaisesRegex(ValueError, r"missing \['W_g'\]"):
      aj.nsa_attention(params, _x(t=8), **kw)
    params = _params()
    params["W_v_win"]["kernel"] = jnp.ones((D, K, H + 1))
    with self.assertRaisesRegex(ValueError, r"params\['W_v_win'\]\['kernel'"
                                r"\] has shape \(16, 2, 9\)"):
      aj.nsa_attention(params, _x(t=8), **kw)
    params = _params()
    params["W_k_cmp"]["kernel"] = jnp.ones((D, 3, H))
    with self.assertRaisesRegex(ValueError, "K dividing N=4"):
      aj.nsa_attention(params, _x(t=8), **kw)
    with self.assertRaisesRegex(ValueError, "num_heads=4 must be divisible "
                                "by num_kv_heads=3"):
      aj.init_nsa_params(jax.random.key(0), D, 4, 3, H, block=4, stride=2,
                         select_block=4)
    with self.assertRaisesRegex(ValueError, "stride=3 must divide block=4"):
      aj.init_nsa_params(jax.random.key(0), D, 4, 2, H, block=4, stride=3,
                         select_block=6)


class ModuleTest(absltest.TestCase):

  def _module(self, **kw):
    return aj.NativeSparseAttention(D, N, K, H, **{**CONFIG, **kw},
                                    compress_hidden=M, use_bias=True,
                                    rngs=nnx.Rngs(0))

  def test_params_round_trip_and_shapes(self):
    """The module holds init_nsa_params' layout; load_params puts a params
    dict in place and refuses another shape; a call's shape (traced only:
    its values are test_module_call_is_the_function's)."""
    module = self._module()
    params = _params()
    module.load_params(params)
    jax.tree.map(np.testing.assert_array_equal, module.params_dict(), params)
    self.assertEqual(module.W_q.kernel.shape, (D, N, H))
    self.assertEqual(module.phi_v.W_1.shape, (4, H, M))
    out = jax.eval_shape(lambda m, x: m(x), module, _x())
    self.assertEqual(out.shape, (B, T, D))
    bad = _params()
    bad["phi_k"]["W_2"] = jnp.ones((M + 1, H))
    with self.assertRaisesRegex(ValueError, r"params\['phi_k'\]\['W_2'\]"):
      module.load_params(bad)
    with self.assertRaisesRegex(ValueError, "x has 8 features"):
      module(jnp.ones((1, 4, 8)))
    with self.assertRaisesRegex(ValueError, "top_n=1 must be at least"):
      self._module(top_n=1)

  def test_module_call_is_the_function(self):
    # Flash at the selection's blocks given by the module (16 query rows,
    # key blocks of 4 inside the selection blocks of 8).
    module = self._module(implementation=aj.kernels.Flash(16, 4),
                          block_q=16, block_k=4)
    module.load_params(_params())
    want, _ = _default_reference()
    np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(module, _x()),
                               want, **TOL)
    grads = nnx.jit(nnx.grad(lambda m, x: m(x).sum()))(module, _x())
    self.assertGreater(float(jnp.abs(grads["phi_k"]["W_1"][...]).max()),
                       0.0)


if __name__ == "__main__":
  absltest.main()
