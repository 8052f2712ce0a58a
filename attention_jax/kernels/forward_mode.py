"""Forward-mode AD refused by name for kernels that have only a backward.

Shape glossary: whatever the kernel's ``Result`` holds (``[..., N, T, Hv]``
outputs, ``[..., N, T]`` row statistics).

A kernel differentiated by a ``jax.custom_vjp`` (a Pallas call, cuDNN's)
cannot be differentiated forward: JAX raises "can't apply
forward-mode autodiff (jvp) to a custom_vjp function", naming neither the
kernel nor the fix, and only when the tangent is computed. ``run`` wraps
such a kernel's call (``Kernel.forward_mode`` False) in a
``jax.custom_jvp`` whose tangent is ``linear_map``'s refusal: ``jax.jvp``
and ``jax.jacfwd`` raise a ``ValueError`` naming the kernel and the ones
that take forward mode, while ``jax.grad`` transposes the map into the
kernel's own backward (``jax.vjp`` of the call), unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from attention_jax.core import linear_map
from attention_jax.kernels import base


def refusal(kernel: base.Kernel) -> str:
  return (f"implementation={kernel.name!r} has no forward-mode AD (jax.jvp, "
          "jax.jacfwd, jax.linearize): its gradient is a custom VJP. Use "
          "implementation='flash' or 'dense' (or ring attention), which "
          "take both modes (or "
          "reverse mode: jax.grad, jax.vjp, and jax.jvp of a jax.grad for "
          "Hessian-vector products through 'flash').")


def run(kernel: base.Kernel, call: Callable, problem: base.Problem):
  """``call(problem)``, a ``kernels.Result``, with forward mode refused by
  ``kernel``'s name and reverse mode through ``call``'s own backward."""
  leaves, tree = jax.tree.flatten(problem)
  where = [i for i, x in enumerate(leaves)
           if isinstance(x, jax.Array) and linear_map.inexact(x)]

  def attend(*arrays):
    full = list(leaves)
    for i, x in zip(where, arrays):
      full[i] = x
    return call(jax.tree.unflatten(tree, full))

  @jax.custom_jvp
  def differentiable(*arrays):
    return attend(*arrays)

  @differentiable.defjvp
  def jvp(primals, tangents):
    try:
      result, pullback = jax.vjp(attend, *primals)
    except TypeError as e:  # forward mode over the custom VJP (an HVP)
      if "forward-mode" not in str(e):
        raise
      raise ValueError(refusal(kernel)) from e

    def zeros(pullback, tangents):  # the outputs' shapes (never evaluated)
      zero = sum((jnp.zeros_like(t, jnp.float32, shape=())
                  for t in jax.tree.leaves(tangents)), jnp.float32(0))
      return jax.tree.map(lambda x: jnp.zeros_like(x) + zero.astype(x.dtype),
                          result)

    d_result = linear_map.linear_map(
        zeros, lambda pullback, cts: pullback(cts), pullback,
        tuple(tangents), outputs=result, refusal=refusal(kernel))
    return result, d_result

  return differentiable(*(leaves[i] for i in where))
