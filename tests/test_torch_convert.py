"""torch.nn.MultiheadAttention weights in and out, against torch's formula.

torch is optional: the NumPy test runs everywhere; the tests against a real
torch module skip without it.
"""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax.numpy as jnp
import numpy as np
import pytest

import attention_jax as aj
from tests import _data

E, N, H = 8, 2, 4  # torch's embed_dim, num_heads, head_dim = E // N
# float32 (ours, torch) against float64 or each other: two E-wide matmuls
# and a softmax of O(1) terms, errors ~1e-6; 1e-5 leaves headroom without
# hiding a transposed kernel or a swapped head.
TOL = dict(atol=1e-5, rtol=1e-5)


def _state_dict(seed: int, kdim: int | None = None) -> dict[str, np.ndarray]:
  """A hand-made MultiheadAttention state_dict of NumPy arrays."""
  w = lambda i, shape: np.asarray(_data.normal(seed + i, shape)) / np.sqrt(
      shape[1])
  sd = {"in_proj_bias": 0.5 * np.asarray(_data.normal(seed + 3, (3 * E,))),
        "out_proj.weight": w(4, (E, E)),
        "out_proj.bias": 0.5 * np.asarray(_data.normal(seed + 5, (E,)))}
  if kdim is None:
    sd["in_proj_weight"] = w(0, (3 * E, E))
  else:
    sd.update(q_proj_weight=w(0, (E, E)), k_proj_weight=w(1, (E, kdim)),
              v_proj_weight=w(2, (E, kdim)))
  return sd


def _torch_formula(sd, query, key, value, key_padding_mask=None):
  """torch's multi_head_attention_forward in float64 NumPy (batch first).

  ``in_proj`` rows are q, k, v; each projection's E outputs are N heads of H
  consecutive features; ``softmax(q k^T / sqrt(H)) v`` per head; the heads
  concatenated; ``out_proj``. ``key_padding_mask`` True = ignore (torch's
  convention).
  """
  f64 = lambda x: np.asarray(x, np.float64)
  if "in_proj_weight" in sd:
    wq, wk, wv = np.split(f64(sd["in_proj_weight"]), 3)
  else:
    wq, wk, wv = (f64(sd[f"{n}_proj_weight"]) for n in "qkv")
  bq, bk, bv = np.split(f64(sd["in_proj_bias"]), 3)
  q, k, v = (f64(x) @ w.T + b for x, w, b in ((query, wq, bq), (key, wk, bk),
                                              (value, wv, bv)))
  heads = lambda x: x.reshape(x.shape[0], x.shape[1], N, H).transpose(
      0, 2, 1, 3)  # [B, L, E] -> [B, N, L, H]
  logits = heads(q) @ heads(k).transpose(0, 1, 3, 2) / np.sqrt(H)
  if key_padding_mask is not None:
    logits = np.where(key_padding_mask[:, None, None, :], -np.inf, logits)
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  out = (weights @ heads(v)).transpose(0, 2, 1, 3).reshape(q.shape)  # concat
  return out @ f64(sd["out_proj.weight"]).T + f64(sd["out_proj.bias"])


class FromStateDictTest(parameterized.TestCase):
  """Without torch: NumPy state_dicts against torch's formula."""

  @parameterized.named_parameters(("packed_in_proj", None),
                                  ("kdim_vdim", 6))
  def test_matches_torch_formula(self, kdim):
    sd = _state_dict(0, kdim)
    params = aj.from_torch_multihead_attention(sd, num_heads=N)
    x = _data.normal(10, (2, 3, E))
    mem = _data.normal(11, (2, 5, kdim or E))
    val = _data.normal(12, (2, 5, kdim or E))  # distinct from the keys
    padding = np.array([[False] * 5, [False] * 3 + [True] * 2])  # torch: True = pad
    got = aj.multi_head_attention(params, x, mem, val,
                                  ~padding[:, None, None, :])
    want = _torch_formula(sd, x, mem, val, key_padding_mask=padding)
    chex.assert_trees_all_close(got, want.astype(np.float32), **TOL)

  def test_refusals(self):
    sd = _state_dict(0)
    with self.assertRaisesRegex(ValueError, r"num_heads is required with a "
                                r"state_dict"):
      aj.from_torch_multihead_attention(sd)
    with self.assertRaisesRegex(ValueError, r"bias_k/bias_v \(add_bias_kv"):
      aj.from_torch_multihead_attention(
          {**sd, "bias_k": np.zeros((1, 1, E)), "bias_v": np.zeros((1, 1, E))},
          num_heads=N)
    uneven = _state_dict(0, kdim=6)
    uneven["v_proj_weight"] = np.zeros((E, 5), np.float32)
    with self.assertRaisesRegex(ValueError, r"kdim=6 != vdim=5 .* share one "
                                r"input width"):
      aj.from_torch_multihead_attention(uneven, num_heads=N)
    with self.assertRaisesRegex(ValueError, r"E=8 .* not divisible by "
                                r"num_heads=3"):
      aj.from_torch_multihead_attention(sd, num_heads=3)
    params = aj.from_torch_multihead_attention(sd, num_heads=N)
    cases = {
        r"grouped-query heads \(K=1 key/value heads for N=2\)":
            _data.params(aj.init_multi_head_params, 0, E, N, num_kv_heads=1),
        r"N \* H = 2 \* 3 != D = 8": _data.params(
            aj.init_multi_head_params, 0, E, N, head_dim=3),
        r"out_features=5 != D=8": _data.params(
            aj.init_multi_head_params, 0, E, N, out_features=5),
        r"qk-norm": {**params, "q_norm": {"scale": jnp.ones(H)},
                     "k_norm": {"scale": jnp.ones(H)}},
        r"attention sinks": {**params, "sinks": {"logits": jnp.zeros(N)}},
        r"a T5 relative-position table": {
            **params, "t5_bias": {"table": jnp.zeros((8, N))}},
        r"a value norm": {**params, "v_norm": {"scale": jnp.ones(H)}},
        r"an output sub-norm": {**params, "o_norm": {"scale": jnp.ones(H)}},
    }
    for message, bad in cases.items():
      with self.assertRaisesRegex(ValueError, "cannot express .*" + message):
        aj.to_torch_multihead_attention(bad)


class AgainstTorchTest(parameterized.TestCase):
  """With torch: a real torch.nn.MultiheadAttention."""

  def setUp(self):
    super().setUp()
    self.torch = pytest.importorskip("torch")

  @parameterized.named_parameters(("packed_in_proj", None), ("kdim_vdim", 6))
  def test_outputs_masks_and_round_trip(self, kdim):
    torch = self.torch
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(E, N, kdim=kdim, vdim=kdim,
                                         batch_first=True)
    with torch.no_grad():  # non-zero biases, so they are tested
      module.in_proj_bias.normal_()
      module.out_proj.bias.normal_()
    module.eval()
    params = aj.from_torch_multihead_attention(module)
    x = np.array(_data.normal(20, (2, 5, E)))  # writable, for torch
    mem = np.array(_data.normal(21, (2, 5, kdim or E)))
    val = np.array(_data.normal(22, (2, 5, kdim or E)))  # distinct from keys
    padding = np.array([[False] * 5, [False] * 3 + [True] * 2])  # True = pad
    causal = np.triu(np.ones((5, 5), bool), 1)  # torch: True = not allowed
    t = torch.from_numpy
    with torch.no_grad():
      want, want_w = module(t(x), t(mem), t(val), key_padding_mask=t(padding),
                            attn_mask=t(causal), is_causal=True,
                            average_attn_weights=False)
    got, got_w = aj.multi_head_attention(
        params, x, mem, val, ~padding[:, None, None, :], is_causal=True,
        return_weights=True)
    chex.assert_trees_all_close((got, got_w), (want.numpy(), want_w.numpy()),
                                **TOL)
    # params -> torch -> params is exact: only transposes and reshapes.
    fresh = torch.nn.MultiheadAttention(E, N, kdim=kdim, vdim=kdim,
                                        batch_first=True)
    fresh.load_state_dict(aj.to_torch_multihead_attention(params))
    chex.assert_trees_all_equal(aj.from_torch_multihead_attention(fresh),
                                params)


if __name__ == "__main__":
  absltest.main()
