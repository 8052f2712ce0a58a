"""The automatic choice per backend: a fused kernel wherever one supports
the call, then the flash core, then dense.

No accelerator here: the backend is patched (as in the cuDNN wiring test),
and only the choice is asked (``aj.kernels.choose``), never run.
"""

from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp

import attention_jax as aj
from attention_jax.kernels import base

B, N, T, H = 1, 4, 1024, 64  # T * S at the automatic choice's threshold


def _choice(backend, dtype=jnp.bfloat16, t=T, **kw):
  q = jnp.zeros((B, N, t, H), dtype)
  problem = base.canonicalize(q, q, q, kw.pop("mask", None), **kw)
  with mock.patch.object(jax, "default_backend", return_value=backend):
    return aj.kernels.choose(aj.kernels.REGISTRY, problem, True).name


CAUSAL = aj.Mask(causal=True)
SEGMENTS = aj.Mask(causal=True, q_segment_ids=jnp.zeros((B, T), jnp.int32))
PATTERNS = {
    "causal": dict(mask=CAUSAL),
    "segments": dict(mask=SEGMENTS),
    "sinks": dict(mask=CAUSAL, sinks=jnp.zeros((N,))),
    "softcap": dict(mask=CAUSAL, score_mod=aj.soft_cap(30.0)),
    "alibi": dict(mask=CAUSAL, score_mod=aj.alibi(aj.alibi_slopes(N))),
    "bias": dict(bias=jnp.zeros((1, N, T, T), jnp.bfloat16)),
    "float32_causal": dict(mask=CAUSAL, dtype=jnp.float32),
    "small": dict(mask=CAUSAL, t=256),
    "prefix_rule": dict(mask=aj.Mask(rule=aj.prefix_lm_mask_fn(100))),
    # A rule reading per-example arrays (prefix lengths [B]) by index.
    "per_example_rule": dict(mask=aj.Mask(
        rule=aj.prefix_lm_mask_fn(jnp.array([100], jnp.int32)))),
    "weights": dict(mask=CAUSAL, return_weights=True),
    "dropout": dict(mask=CAUSAL, dropout_rate=0.1,
                    dropout_rng=jax.random.key(0)),
}
EXPECTED = {
    # backend: pattern -> kernel
    "gpu": {"causal": "cudnn", "segments": "pallas_gpu",
            "sinks": "pallas_gpu", "softcap": "pallas_gpu",
            # ALiBi reads slopes[h]: no Triton lowering, the flash core.
            "alibi": "flash", "bias": "cudnn",
            "float32_causal": "pallas_gpu", "small": "dense",
            "weights": "dense", "prefix_rule": "pallas_gpu",
            "per_example_rule": "flash",
            # cuDNN through jax.nn has no dropout; the Pallas walk has.
            "dropout": "pallas_gpu"},
    "tpu": {"causal": "splash", "segments": "splash", "sinks": "splash",
            "softcap": "splash",
            # Splash's only modifier is a soft cap, and it has no bias.
            "alibi": "flash", "bias": "flash",
            "float32_causal": "splash", "small": "dense", "weights": "dense",
            # Concrete rules become splash's (static) NumPy masks.
            "prefix_rule": "splash", "per_example_rule": "splash",
            "dropout": "flash"},
    "cpu": {"causal": "flash", "segments": "flash",
            "sinks": "flash", "softcap": "flash",
            "alibi": "flash", "bias": "flash",
            "float32_causal": "flash", "small": "dense",
            "weights": "dense", "prefix_rule": "flash",
            "per_example_rule": "flash", "dropout": "flash"},
}


class AutomaticChoiceTest(parameterized.TestCase):

  @parameterized.product(backend=sorted(EXPECTED), pattern=sorted(PATTERNS))
  def test_first_kernel_that_supports_it(self, backend, pattern):
    self.assertEqual(_choice(backend, **PATTERNS[pattern]),
                     EXPECTED[backend][pattern])

  def test_explicit_choice_that_cannot_run_says_why(self):
    q = jnp.zeros((B, N, 64, 16), jnp.bfloat16)
    for name, device in (("pallas_gpu", "GPU"), ("splash", "TPU")):
      with self.assertRaisesRegex(
          ValueError, f"'{name}' is not possible: it needs a {device}"):
        aj.scaled_dot_product_attention(q, q, q, implementation=name)


if __name__ == "__main__":
  absltest.main()
