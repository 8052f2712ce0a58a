"""A smoke test at the dependency floors: run by ``.ci/floors``, not by pytest.

``.ci/floors`` installs exactly the ``>=`` floors of pyproject.toml's
``[project] dependencies`` (plus optax, pinned as in requirements.txt) in a
throwaway venv and runs ``python tests/floors_smoke.py`` there. Each check
uses only NumPy, jax, flax, optax and ``attention_jax`` (no test helpers:
the venv has nothing else), and compares with an independent answer
(jax.nn, flax, full attention, a falling loss). The file name does not match
``test_*.py``, so the main suite does not collect it.
"""

import sys

import flax
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import attention_jax as aj

# float32 throughout, sums of <= 8 terms of magnitude <= ~4 in different
# orders (grouped heads, blocked walks, cache writes): differences stay
# below ~1e-6; 1e-5 leaves an order of magnitude of headroom.
TOL = dict(atol=1e-5, rtol=1e-5)
B, N, K, T, H, D = 2, 4, 2, 6, 8, 16


def _normal(seed, shape):
  return jax.random.normal(jax.random.key(seed), shape)


def check_against_jax_nn():
  q, k, v = _normal(0, (B, N, T, H)), _normal(1, (B, K, T, H)), _normal(
      2, (B, K, T, H))
  mask = jnp.arange(T)[None, None, None, :] < jnp.array(
      [T, 3])[:, None, None, None]  # [B, 1, 1, S]: key padding
  ours = aj.scaled_dot_product_attention(q, k, v, mask, is_causal=True)
  swap = lambda x: jnp.swapaxes(x, 1, 2)  # jax.nn's [B, T, N, H]
  theirs = jax.nn.dot_product_attention(swap(q), swap(k), swap(v), mask=mask,
                                        is_causal=True, implementation="xla")
  np.testing.assert_allclose(ours, swap(theirs), **TOL)


def check_flax_attention_fn():
  def layer(attention_fn):
    # (no num_kv_heads: flax 0.12.2's layer lacks it)
    return nnx.MultiHeadAttention(num_heads=N, in_features=D, decode=False,
                                  attention_fn=attention_fn,
                                  rngs=nnx.Rngs(0))

  x = _normal(3, (B, T, D))
  mask = nnx.make_causal_mask(jnp.ones((B, T)))
  np.testing.assert_allclose(layer(aj.flax_attention_fn)(x, mask=mask),
                             layer(nnx.dot_product_attention)(x, mask=mask),
                             **TOL)


def check_module_forward_and_decode():
  mha = aj.MultiHeadAttention(d_model=D, num_heads=N, num_kv_heads=K,
                              rngs=nnx.Rngs(0))
  x = _normal(4, (B, T, D))
  full = mha(x, is_causal=True)
  mha.init_cache(batch_size=B, max_length=T + 2)
  prefill = mha(x[:, :T - 2], decode=True)
  steps = [mha(x[:, i:i + 1], decode=True) for i in (T - 2, T - 1)]
  np.testing.assert_allclose(jnp.concatenate([prefill, *steps], axis=1), full,
                             **TOL)


def check_train_step():
  model = aj.MultiHeadAttention(d_model=D, num_heads=N, num_kv_heads=K,
                                rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  x, target = _normal(5, (B, T, D)), _normal(6, (B, T, D))

  @nnx.jit
  def train_step(model, optimizer, x, target):
    def loss_fn(model):
      return jnp.mean((model(x, is_causal=True) - target) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(train_step(model, optimizer, x, target)) for _ in range(5)]
  if not (np.all(np.isfinite(losses)) and losses[-1] < losses[0]):
    raise AssertionError(f"the loss did not fall: {losses}")


def check_flash_both_modes():
  """The flash kernel's custom JVP over its linear map (jax.extend's
  Primitive, the interpreters' rules): forward and reverse mode and
  dropout, against the dense kernel."""
  q, k, v = (_normal(i, (1, 2, 12, 8)) for i in range(3))

  def attend(impl):
    return lambda q: aj.scaled_dot_product_attention(
        q, k, v, is_causal=True, implementation=impl, dropout_rate=0.2,
        dropout_rng=jax.random.key(0))

  for mode in (lambda f: jax.jvp(f, (q,), (v,))[1],
               lambda f: jax.grad(lambda q: jnp.sum(jnp.sin(f(q))))(q)):
    np.testing.assert_allclose(mode(attend("flash")), mode(attend("dense")),
                               atol=1e-5, rtol=1e-5)


def main():
  jax.config.update("jax_numpy_rank_promotion", "raise")
  print(f"python {sys.version.split()[0]}, jax {jax.__version__}, flax "
        f"{flax.__version__}, numpy {np.__version__}, optax "
        f"{optax.__version__}")
  for check in (check_against_jax_nn, check_flax_attention_fn,
                check_module_forward_and_decode, check_train_step,
                check_flash_both_modes):
    check()
    print(f"ok  {check.__name__}")


if __name__ == "__main__":
  main()
