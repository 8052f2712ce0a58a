"""A linear map with its own transpose: forward- and reverse-mode AD for one kernel.

A blockwise kernel walks its blocks with loops whose trip counts depend on
the data (the blocks a mask leaves), which JAX can differentiate forward
but not transpose. Its reverse mode is therefore hand-written (the
FlashAttention-2 backward), and a ``jax.custom_vjp`` that holds it cannot
be differentiated forward at all. ``linear_map`` joins both: a kernel is a
``jax.custom_jvp`` whose tangent is ``linear_map(tangent, transpose,
residuals, tangents)``, and

* forward mode (``jax.jvp``, ``jax.jacfwd``) evaluates ``tangent``, a
  second blockwise pass;
* reverse mode (``jax.grad``, ``jax.vjp``) linearises the kernel, so the
  map is never evaluated: JAX transposes it, which runs ``transpose``, the
  hand-written backward, on the saved residuals;
* forward-over-reverse (Hessian-vector products, ``jax.hessian``)
  differentiates ``transpose``'s plain JAX code forward.

Reverse-over-forward (``jax.grad`` of a ``jax.jvp``) would transpose
``tangent``'s loops, which JAX cannot: it raises JAX's error for a
``while_loop``. This is ``jax.custom_derivatives.linear_call`` with the
batching rule (``vmap``: the kernels map heads, ``jax.jacfwd`` maps
tangents) and the forward rule in its residuals that that primitive lacks.

Shapes: whatever ``tangent`` and ``transpose`` take; under ``vmap`` the
primitive records each level's ``in_axes`` and maps the functions itself.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
from typing import Any

import jax
from jax.extend import core as jex_core
from jax.interpreters import ad
from jax.interpreters import batching
from jax.interpreters import mlir
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class _Functions:
  """The map and its transpose on flat leaves (a primitive parameter)."""
  tangent: Callable  # (residuals, linear) -> outputs, pytrees
  transpose: Callable  # (residuals, cotangents) -> linear cotangents
  res_tree: Any
  lin_tree: Any
  out_tree: Any
  # The outputs' (shape, dtype) outside any vmap: traced once, by
  # ``linear_map``; each vmap level adds its size in front (``_abstract``).
  outputs: tuple
  # Forward mode refused with this message (a kernel without a tangent
  # pass): evaluating the map raises it; transposing it still works.
  refusal: str | None = None

  def forward(self, *leaves):
    res, lin = self._split(leaves)
    return jax.tree.leaves(self.tangent(res, lin))

  def backward(self, *leaves):
    n = self.res_tree.num_leaves
    res = jax.tree.unflatten(self.res_tree, leaves[:n])
    cts = jax.tree.unflatten(self.out_tree, leaves[n:])
    return self.lin_tree.flatten_up_to(self.transpose(res, cts))

  def _split(self, leaves):
    n = self.res_tree.num_leaves
    return (jax.tree.unflatten(self.res_tree, leaves[:n]),
            jax.tree.unflatten(self.lin_tree, leaves[n:]))


def _mapped(fn, axes):
  """``fn`` under one ``vmap`` per recorded level (outermost first)."""
  for level in reversed(axes):
    fn = jax.vmap(fn, in_axes=level)
  return fn


def _impl(*leaves, functions, num_res, axes):
  del num_res
  if functions.refusal is not None:  # evaluated (or compiled): forward mode
    raise ValueError(functions.refusal)
  return _mapped(functions.forward, axes)(*leaves)


def _level_sizes(avals, axes) -> tuple[int, ...]:
  """The size of each recorded vmap level, outermost first: ``_batch``
  moved each level's axis to the front of the operands it maps, in front
  of those of the levels inside it."""
  depth = [0] * len(avals)  # leading axes of each operand already read
  sizes = []
  for level in axes:
    size = None
    for i, d in enumerate(level):
      if d is not None:
        size = avals[i].shape[depth[i]] if size is None else size
        depth[i] += 1
    sizes.append(size)
  return tuple(sizes)


def _unplaced(avals) -> bool:
  """Whether no operand lies on a mesh (no sharding in its type, no
  manual axes it varies over) and none is ambient."""
  if not jax.sharding.get_abstract_mesh().empty:
    return False
  for a in avals:
    sharding = getattr(a, "sharding", None)
    if sharding is not None and not sharding.mesh.empty:
      return False
    manual = getattr(a, "manual_axis_type", None)
    if manual is not None and (manual.varying or manual.unreduced
                               or manual.reduced):
      return False
  return True


def _abstract(*avals, functions, num_res, axes):
  del num_res
  if _unplaced(avals):  # the traced shapes, behind each level's size
    sizes = _level_sizes(avals, axes)
    return [jax.core.ShapedArray(sizes + shape, dtype)
            for shape, dtype in functions.outputs]
  # On a mesh: the outputs' shapes, shardings and the mesh axes they vary
  # over, as the map's own code gives them (inside shard_map they vary
  # where the inputs do).
  return [jax.core.ShapedArray(o.shape, o.dtype,
                               sharding=getattr(o, "sharding", None),
                               manual_axis_type=o.manual_axis_type)
          if getattr(o, "manual_axis_type", None) is not None
          else jax.core.ShapedArray(o.shape, o.dtype)
          for o in jax.eval_shape(_mapped(functions.forward, axes), *avals)]


_p = jex_core.Primitive("attention_jax_linear_map")
_p.multiple_results = True
_p.def_impl(_impl)
_p.def_abstract_eval(_abstract)
mlir.register_lowering(_p, mlir.lower_fun(_impl, multiple_results=True))


def _batch(args, dims, *, functions, num_res, axes):
  size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
  del size  # (every mapped operand has it; vmap checks)
  args = [x if d is None else jnp.moveaxis(x, d, 0)
          for x, d in zip(args, dims)]
  level = tuple(None if d is None else 0 for d in dims)
  out = _p.bind(*args, functions=functions, num_res=num_res,
                axes=(level,) + axes)
  return out, [0] * len(out)


batching.primitive_batchers[_p] = _batch


def _transpose(cts, *args, functions, num_res, axes):
  res, lin = args[:num_res], args[num_res:]
  outs = _abstract(*map(jax.typeof, res), *(x.aval for x in lin),
                   functions=functions, num_res=num_res, axes=axes)
  cts = [jnp.zeros(o.shape, o.dtype) if type(ct) is ad.Zero else ct
         for ct, o in zip(cts, outs)]
  # Cotangents are mapped at every level (so are the outputs); a linear
  # input a level did not map gets the sum over that level's axis.
  levels = tuple(level[:num_res] + (0,) * len(cts) for level in axes)
  d_lin = _mapped(functions.backward, levels)(*res, *cts)
  summed = []
  for i, d in enumerate(d_lin):
    unmapped = tuple(n for n, level in enumerate(axes)
                     if level[num_res + i] is None)
    d = d.sum(unmapped) if unmapped else d
    summed.append(d.astype(lin[i].aval.dtype))
  return [None] * num_res + summed


ad.primitive_transposes[_p] = _transpose


def _jvp(primals, tangents, *, functions, num_res, axes):
  params = dict(functions=functions, num_res=num_res, axes=axes)
  out = _p.bind(*primals, **params)
  res, lin = primals[:num_res], primals[num_res:]
  d_res, d_lin = tangents[:num_res], tangents[num_res:]
  d_lin = [ad.instantiate_zeros(t) for t in d_lin]
  d_out = _p.bind(*res, *d_lin, **params)  # linear in the linear inputs
  if any(type(t) is not ad.Zero for t in d_res):  # and the residuals' part
    d_res = [zero_tangent(x) if type(t) is ad.Zero else t
             for x, t in zip(res, d_res)]
    _, more = jax.jvp(lambda *r: _mapped(functions.forward, axes)(*r, *lin),
                      tuple(res), tuple(d_res))
    d_out = [a + b for a, b in zip(d_out, more)]
  return out, d_out


def inexact(x) -> bool:
  """Whether ``x`` has tangents (a float or complex array)."""
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def zero_tangent(x):
  """A zero tangent of ``x`` (``float0`` for integer arrays)."""
  if inexact(x):
    return jnp.zeros_like(x)
  return np.zeros(np.shape(x), jax.dtypes.float0)


ad.primitive_jvps[_p] = _jvp


def linear_map(tangent: Callable, transpose: Callable, residuals, linear, *,
               outputs=None, refusal: str | None = None):
  """``tangent(residuals, linear)``, transposed by ``transpose``.

  ``tangent`` must be linear in ``linear`` (a pytree of float arrays) and
  ``transpose(residuals, cotangents)`` its transpose: the cotangents of
  ``linear`` (same tree, shapes and dtypes) from those of the outputs.
  With ``refusal``, ``tangent`` only gives the outputs' shapes (zeros) and
  evaluating the map, forward mode, raises ``ValueError(refusal)``;
  reverse mode, which only transposes it, is unaffected. ``outputs``: the
  map's outputs' shapes and dtypes (a pytree of arrays or
  ``ShapeDtypeStruct``s) where the caller knows them, e.g. a kernel's
  tangent has its primal outputs' shapes; None traces ``tangent`` once for
  them (reverse mode never evaluates it, and every later shape is derived
  from these).
  """
  res_leaves, res_tree = jax.tree.flatten(residuals)
  lin_leaves, lin_tree = jax.tree.flatten(linear)
  if outputs is None:
    outputs = jax.eval_shape(tangent, residuals, linear)
  out_leaves, out_tree = jax.tree.flatten(outputs)
  functions = _Functions(tangent, transpose, res_tree, lin_tree, out_tree,
                         tuple((tuple(o.shape), o.dtype) for o in out_leaves),
                         refusal)
  out = _p.bind(*res_leaves, *lin_leaves, functions=functions,
                num_res=len(res_leaves), axes=())
  return jax.tree.unflatten(out_tree, out)
