"""Key/value sharing across layers: a ``kv_shared=True`` layer attends over
another layer's keys and values with its own queries, qk-norm and rotary.

Against a float64 NumPy layer written from the formula (Gemma 3n's shared
layers: the queries of one layer, the keys and values of another), against
a plain layer holding both layers' weights, and while decoding: token by
token and chunked, through the other layer's linear and paged caches, it
equals the whole-sequence call. Then the refusals.
"""

import json
import pathlib

from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from attention_jax.interop import checkpoints

D, N, K, H, T, B = 16, 4, 2, 4, 7, 2


def is_exhaustive(test_name: str) -> bool:
  """conftest's hook: token-by-token decoding and the window, each an
  eager call per step, are left to the exhaustive run; chunked linear and
  paged decoding run by default."""
  return test_name.endswith(("cache_linear", "cache_window_linear"))
# float32 layers against float64: projections of 16 terms, softmax over <= 7
# keys (observed <= 3e-7 of the output's scale).
RTOL = 1e-5


def _layers(window=None):
  mask = aj.Mask(causal=True, window=window)
  common = dict(num_kv_heads=K, rope=aj.Rope(), normalize_qk=True,
                mask=mask, use_bias=False)
  source = aj.MultiHeadAttention(
      D, N, rngs=nnx.Rngs(0), value_norm=aj.QKNorm(weight=None), **common)
  shared = aj.MultiHeadAttention(D, N, rngs=nnx.Rngs(1), kv_shared=True,
                                 **common)
  # Norm weights away from 1, so that each layer's own is seen.
  for layer, seed in ((source, 2), (shared, 3)):
    params = layer.params_dict()
    params["q_norm"]["scale"] = 1 + 0.5 * jax.random.normal(
        jax.random.key(seed), (H,))
    if "k_norm" in params:
      params["k_norm"]["scale"] = 1 - 0.5 * jax.random.normal(
          jax.random.key(seed + 10), (H,))
    layer.load_params(params)
  return source, shared


def _reference(source, shared, x, window=None):
  """float64: the shared layer's queries over the source's keys/values."""
  a, b = source.params_dict(), shared.params_dict()
  f = lambda t: np.asarray(t, np.float64)
  x = f(x)
  rms = lambda y, w: y / np.sqrt((y * y).mean(-1, keepdims=True) + 1e-6) * w

  def rotate(y):  # half-split pairs at positions 0..T-1, base 10000
    angle = np.arange(T)[:, None] * 1e4 ** (-np.arange(0, H, 2) / H)
    c, s = np.cos(angle), np.sin(angle)
    u, v = y[..., :H // 2], y[..., H // 2:]
    return np.concatenate([u * c - v * s, v * c + u * s], -1)

  q = rotate(rms(np.einsum("btd,dnh->bnth", x, f(b["W_q"]["kernel"])),
                 f(b["q_norm"]["scale"])))
  k = rotate(rms(np.einsum("btd,dkh->bkth", x, f(a["W_k"]["kernel"])),
                 f(a["k_norm"]["scale"])))
  v = rms(np.einsum("btd,dkh->bkth", x, f(a["W_v"]["kernel"])), 1.0)
  k, v = (np.repeat(y, N // K, axis=1) for y in (k, v))
  logits = np.einsum("bnqh,bnkh->bnqk", q, k) * H ** -0.5
  i, j = np.arange(T)[:, None], np.arange(T)[None]
  seen = (j <= i) & ((i - j <= window[0]) if window else True)
  logits = np.where(seen, logits, -np.inf)
  w = np.exp(logits - logits.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  out = np.einsum("bnqk,bnkh->bnqh", w, v)
  return np.einsum("bnqh,nhd->bqd", out, f(b["W_o"]["kernel"]))


class KVSharingTest(parameterized.TestCase):

  @parameterized.named_parameters(("causal", None), ("window", (2, 0)))
  def test_equals_the_formula(self, window):
    source, shared = _layers(window)
    x = jax.random.normal(jax.random.key(0), (B, T, D))
    got = shared(x, shared_kv=source.shared_kv(x))
    want = _reference(source, shared, x, window)
    self.assertEqual(sorted(shared.params_dict()), ["W_o", "W_q", "q_norm"])
    np.testing.assert_allclose(got, want, atol=RTOL * np.abs(want).max())

  @parameterized.named_parameters(
      ("linear", "linear", (1,) * T), ("linear_chunks", "linear", (4, 3)),
      ("paged", "paged", (4, 3)), ("window_linear", "linear", (3, 4)))
  def test_decoding_reads_the_other_layers_cache(self, kind, chunks):
    window = (2, 0) if self._testMethodName.endswith("window_linear") else (
        None)
    source, shared = _layers(window)
    x = jax.random.normal(jax.random.key(1), (B, T, D))
    want = shared(x, shared_kv=source.shared_kv(x))
    if kind == "linear":
      source.init_cache(B, 16)
    else:
      source.init_paged_cache(B, num_pages=8, page_size=2, max_pages=4)
    got, start = [], 0
    for size in chunks:
      step = x[:, start:start + size]
      source(step, decode=True)
      got.append(shared(step, decode=True, shared_kv=source))
      start += size
    np.testing.assert_allclose(jnp.concatenate(got, 1), want,
                               atol=RTOL * np.abs(want).max())
    # The shared layer wrote nothing: the source's cache holds T tokens.
    np.testing.assert_array_equal(source.cache_index[...], [T] * B)

  def test_refusals(self):
    source, shared = _layers()
    x = jnp.ones((B, T, D))
    cases = (
        (lambda: shared(x), TypeError, r"needs shared_kv=other.shared_kv"),
        (lambda: source(x, shared_kv=source.shared_kv(x)), ValueError,
         "for a layer built with kv_shared=True"),
        (lambda: shared(x, x, shared_kv=source.shared_kv(x)), ValueError,
         "pass shared_kv=, not key/value"),
        (lambda: shared(x, decode=True, shared_kv=source.shared_kv(x)),
         TypeError, "the layer whose cache this step wrote"),
        (lambda: shared.shared_kv(x), ValueError, "ask that layer"),
        (lambda: shared(x, shared_kv=aj.project_memory(
            source.params_dict(), x, qk_norm=source.qk_norm,
            value_norm=source.value_norm)), TypeError,
         r"needs shared_kv=other.shared_kv"),
    )
    for call, error, message in cases:
      with self.subTest(message), self.assertRaisesRegex(error, message):
        call()
    source, shared = _layers(window=(2, 0))
    source.init_cache(B, window=3)  # a ring buffer forgets
    source(x[:, :1], decode=True)
    with self.assertRaisesRegex(ValueError, "a ring buffer"):
      shared(x[:, :1], decode=True, shared_kv=source)


if __name__ == "__main__":
  absltest.main()


class Gemma3nTest(absltest.TestCase):
  """Gemma 3n's shared layers, loaded, against transformers' outputs."""

  def test_shared_layers_match_transformers(self):
    z = np.load(pathlib.Path(__file__).parent / "golden" / "gemma3n.npz")
    sd = {k[3:]: z[k] for k in z.files if k.startswith("sd/")}
    cfg = json.loads(str(z["config_json"]))
    load = lambda i: checkpoints.load_attention_weights(sd, config=cfg,
                                                        layer=i)
    for layer, source in ((2, 0), (3, 1)):
      with self.subTest(layer=layer):
        loaded = load(layer)
        self.assertEqual(loaded.kv_source, source)
        self.assertTrue(loaded.options["kv_shared"])
        self.assertNotIn("W_k", loaded.params)
        owner = load(source)
        self.assertIsNone(owner.kv_source)
        kv = owner.module().shared_kv(jnp.asarray(z[f"in/{source}"]))
        got = loaded.module()(jnp.asarray(z[f"in_shared/{layer}"]),
                              shared_kv=kv)
        want = z[f"out_shared/{layer}"]
        # float32 both sides, as tests/test_checkpoints.py's REL_TOL.
        self.assertLess(np.abs(got - want).max(), 1e-5 * np.abs(want).max())
    # The value norm and scale 1 are seen: dropping either moves layer 0.
    loaded = load(0)
    x, want = jnp.asarray(z["in/0"]), z["out/0"]
    for change in (dict(value_norm=None), dict(scale=None)):
      with self.subTest(**change):
        module = aj.MultiHeadAttention(**{**loaded.options, **change},
                                       rngs=nnx.Rngs(0))
        module.load_params(loaded.params)
        self.assertGreater(np.abs(module(x) - want).max(),
                           1e-3 * np.abs(want).max())
