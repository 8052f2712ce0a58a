"""Seeded test inputs without a compile per shape.

``jax.random.normal`` compiles a threefry kernel for every new shape (~1 s on
a 2-core CPU), which would dominate a suite of tiny-shape tests. Instead one
pool per distribution is drawn once from ``jax.random.key(0)`` and tests take
seeded, shaped slices of it in NumPy, so inputs stay reproducible and cheap.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

_POOL = 1 << 16


@functools.cache
def _pools() -> tuple[np.ndarray, np.ndarray]:
  # Concrete even when first asked for inside a jit trace (a test's
  # jitted helper drawing its inputs).
  with jax.ensure_compile_time_eval():
    k_normal, k_uniform = jax.random.split(jax.random.key(0))
    return (np.asarray(jax.random.normal(k_normal, (_POOL,))),
            np.asarray(jax.random.uniform(k_uniform, (_POOL,))))


def _take(pool: np.ndarray, seed: int, shape) -> np.ndarray:
  size = int(np.prod(shape, dtype=np.int64))
  if size > _POOL:
    raise ValueError(f"test data of shape {shape} exceeds the pool")
  start = (seed * 7919) % (_POOL - size + 1)  # a prime stride between seeds
  return pool[start:start + size].reshape(shape)


def normal(seed: int, shape, dtype=jnp.float32) -> jax.Array:
  """Standard-normal array, the same for the same ``(seed, shape)``."""
  return jnp.asarray(_take(_pools()[0], seed, shape), dtype)


def bernoulli(seed: int, p: float, shape) -> jax.Array:
  """Bool array, True with probability ``p``."""
  return jnp.asarray(_take(_pools()[1], seed, shape) < p)


def params(init_fn, seed: int, *args, **kwargs):
  """Parameters shaped like ``init_fn(key, *args, **kwargs)``, from the pool.

  ``jax.eval_shape`` gives the shapes without compiling the initialiser.
  Matrices get std ``1/sqrt(fan_in)``; vectors (biases, ``v``) std 0.5 so
  that biases are non-zero and really tested; scalars (a learned scale) and
  qk-norm ``scale`` vectors are ``1 + 0.2 * N(0, 1)``. Multi-head kernels are
  per head (``[D, N, H]``: fan-in ``D``; ``W_o``'s ``[N, H, D]``: ``N * H``)
  and their biases (``[N, H]``) count as vectors.
  """
  shapes = jax.eval_shape(lambda key: init_fn(key, *args, **kwargs),
                          jax.random.key(0))
  leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
  values = []
  for i, (path, leaf) in enumerate(leaves):
    names = [getattr(k, "key", None) for k in path]
    x = normal(seed + i, leaf.shape, leaf.dtype)
    if names[-1] == "kernel":
      fan_in = np.prod(leaf.shape[:-1]) if "W_o" in names else leaf.shape[0]
      x = x / np.sqrt(fan_in)
    elif names[-1] == "bias":
      x = 0.5 * x
    elif leaf.ndim == 2:
      x = x / np.sqrt(leaf.shape[0])
    elif leaf.ndim == 1 and names[-1] != "scale":
      x = 0.5 * x
    else:
      x = 1.0 + 0.2 * x
    values.append(x)
  return jax.tree.unflatten(treedef, values)
